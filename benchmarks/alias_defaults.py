# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Swap ``optax.adamw(lr)`` for one of ours at the same lr: what happens?

Run from the repository root::

  python -m benchmarks.alias_defaults            # full run (a few min, 2 CPUs)
  python -m benchmarks.alias_defaults --small    # quick CI-size run

Every alias is used exactly as a user would first try it: its defaults, only
the learning rate given (``physguard`` with an empty protected subspace,
i.e. no source task, ``max_rank=8``). Task: the digits MLP (64-128-128-10,
GELU) of the other quality benchmarks, batch 128, 400 steps. Protocol: one
lr grid for every optimizer; each lr trained once with the tuning seed and
scored on the *validation* split. Each alias is then rerun with ``--seeds``
fresh seeds (init and data order) at AdamW's best lr ("swap at AdamW's lr")
and at its own best lr, and scored on the *test* split (mean ± standard
error). A constant learning rate is the last factor of every alias' update,
so the runs multiply the updates of ``alias(1.0)`` by the lr, batched
across ``jax.vmap`` lanes (one compile per optimizer).
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import math
import time
from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import common
from examples.common import datasets
from examples.common import models
import fisher_optax

_SMALL = flags.DEFINE_bool("small", False, "Quick CI-size run.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds for the final runs.")
_STEPS = flags.DEFINE_integer("steps", 400, "Training steps.")
_ARMS = flags.DEFINE_list("arms", [], "Subset of optimizers (default all).")
_NAME = flags.DEFINE_string("name", "alias_defaults", "Results file name.")

LR_GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
SMALL_LR_GRID = (1e-3, 1e-2)
BATCH = 128
TUNE_SEED = 100

# Muon's own advice: hidden 2-D kernels only; the head goes to Adam.
hidden_matrices = functools.partial(
  models.digits_hidden_dims, kind=optax.contrib.MuonDimensionNumbers
)

# Each optimizer at its defaults with lr 1 (the lr is applied per lane).
ARMS: dict[str, Callable[[], optax.GradientTransformation]] = {
  "adamw": lambda: optax.adamw(1.0),
  "fadam": lambda: fisher_optax.fadam(1.0),
  "natural_galore": lambda: fisher_optax.natural_galore(1.0),
  # Its baseline at the same defaults (rank, refresh gap, scale), and the
  # damping at which its window stops whitening away the gradient's mean.
  "galore": lambda: optax.contrib.galore(1.0),
  "natural_galore_damping1": lambda: fisher_optax.natural_galore(
    1.0, damping=1.0
  ),
  "mfac": lambda: fisher_optax.mfac(1.0),
  "physguard": lambda: fisher_optax.physguard(1.0, max_rank=8),
  # FISMO against Muon, both at their defaults (every 2-D leaf, head
  # included; the Adam leaves at the same lr), and FISMO at the defaults it
  # had before the sweep in ``benchmarks/fismo_defaults.py``.
  "muon": lambda: optax.contrib.muon(1.0),
  "fismo": lambda: fisher_optax.fismo(1.0),
  "fismo_previous_defaults": lambda: fisher_optax.fismo(
    1.0,
    damping=0.1,
    momentum_space="whitened",
    grafting="none",
    precondition_interval=10,
  ),
  # Not default: the paper's unscaled step (the default until the LM
  # benchmark), and the defaults sweep's best interval.
  "fismo_grafting_none": lambda: fisher_optax.fismo(1.0, grafting="none"),
  "fismo_k50": lambda: fisher_optax.fismo(1.0, precondition_interval=50),
  # Both with the classifier head (and biases) on Adam, as Muon's author
  # advises: FISMO's class-side factor is what costs it most on this task.
  "muon_hidden": lambda: optax.contrib.muon(
    1.0, muon_weight_dimension_numbers=hidden_matrices
  ),
  "fismo_hidden": lambda: fisher_optax.fismo(
    1.0, fismo_weight_dimension_numbers=hidden_matrices
  ),
  # The damping FISMO's docstring advises for small MLP classifiers.
  "fismo_damping10": lambda: fisher_optax.fismo(1.0, damping=10.0),
}


def make_runner(apply_fn, make_tx, data, steps: int):
  """``run(seeds, lrs) -> (val_loss, test_loss, test_acc)``, one lane each."""
  tx = make_tx()
  xtr, ytr = map(jnp.asarray, data["train"])
  xva, yva = map(jnp.asarray, data["val"])
  xte, yte = map(jnp.asarray, data["test"])
  n = xtr.shape[0]

  def objective(params, x, y):
    return common.cross_entropy(apply_fn(params, x), y)

  def one(params, key, lr):
    idx = jax.random.randint(key, (steps, BATCH), 0, n)

    def body(carry, i):
      p, s = carry
      g = jax.grad(objective)(p, xtr[i], ytr[i])
      u, s = tx.update(g, s, p)
      u = jax.tree.map(lambda x: (lr * x).astype(x.dtype), u)
      return (optax.apply_updates(p, u), s), None

    (params, _), _ = jax.lax.scan(body, (params, tx.init(params)), idx)
    logits_va, logits_te = apply_fn(params, xva), apply_fn(params, xte)
    return (
      common.cross_entropy(logits_va, yva),
      common.cross_entropy(logits_te, yte),
      common.accuracy(logits_te, yte),
    )

  batched = jax.jit(jax.vmap(one))

  def run(seeds, lrs):
    inits = [common.digits_mlp(seed=int(s))[1] for s in seeds]
    params = jax.tree.map(lambda *xs: jnp.stack(xs), *inits)
    keys = jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))
    out = batched(params, keys, jnp.asarray(lrs, jnp.float32))
    return [np.asarray(o, np.float64) for o in out]

  return run


mean_se = common.mean_se
fmt = common.fmt_mean_se


def tune(run, grid) -> dict[float, float]:
  val, _, _ = run([TUNE_SEED] * len(grid), list(grid))
  return {
    lr: float(v) if math.isfinite(v) else math.inf for lr, v in zip(grid, val)
  }


def write_report(
  results: dict[str, dict[str, Any]],
  grid: tuple[float, ...],
  steps: int,
  seeds: int,
  adamw_lr: float,
  t0: float,
  small: bool,
) -> None:
  """Writes the table so far (after every optimizer: runs are long)."""
  wall = time.perf_counter() - t0
  rows = []
  for name, r in results.items():
    a, b = r["at_adamw_lr"], r["at_best_lr"]
    val = ", ".join(
      f"{lr:g}: {v:.3f}" if math.isfinite(v) else f"{lr:g}: diverged"
      for lr, v in r["tuning_val_loss"].items()
    )
    rows.append(
      [
        name,
        fmt(a["test_loss"]),
        fmt(a["test_acc"]),
        f"{r['best_lr']:g}",
        fmt(b["test_loss"]),
        fmt(b["test_acc"]),
        val,
      ]
    )
  out = f"{_NAME.value}_small" if small else _NAME.value
  md = [
    "## Every alias at its defaults, at AdamW's lr and at its own best lr",
    "",
    f"Digits MLP 64-128-128-10 (GELU), batch {BATCH}, {steps} steps; lr "
    f"chosen on validation loss (one tuning seed) from {list(grid)}; test "
    f"loss/accuracy mean ± se over {seeds} fresh seeds. AdamW is "
    "`optax.adamw(lr)` (its defaults, weight decay 1e-4); every alias at "
    f"its defaults; AdamW's best lr is {adamw_lr:g}. `physguard` has an "
    "empty protected subspace (no source task), so it is Adam.",
    "",
    common.markdown_table(
      [
        "optimizer",
        "test loss @ AdamW's lr",
        "test acc @ AdamW's lr",
        "own best lr",
        "test loss @ own lr",
        "test acc @ own lr",
        "validation loss per lr (tuning seed)",
      ],
      rows,
    ),
    "",
    f"Total wall time {wall:.0f} s ({jax.default_backend()}, shared 2-core "
    "CPU).",
  ]
  common.write_results(
    out,
    {
      "settings": {
        "steps": steps,
        "batch": BATCH,
        "lr_grid": grid,
        "seeds": seeds,
        "tune_seed": TUNE_SEED,
      },
      "results": results,
    },
    "\n".join(md),
  )
  print("\n".join(md))


def main(argv: Any) -> None:
  del argv
  small = _SMALL.value
  seeds = 2 if small else _SEEDS.value
  steps = 60 if small else _STEPS.value
  grid = SMALL_LR_GRID if small else LR_GRID
  arms = _ARMS.value or list(ARMS)
  if "adamw" not in arms:
    arms = ["adamw", *arms]
  t0 = time.perf_counter()
  data = datasets.load_digits(seed=0)
  apply_fn, _ = common.digits_mlp(seed=0)
  results: dict[str, dict[str, Any]] = {}
  adamw_lr = math.nan  # set by the first arm, AdamW
  for name in arms:
    run = make_runner(apply_fn, ARMS[name], data, steps)
    scores = tune(run, grid)
    best = min(scores, key=lambda lr: scores[lr])
    adamw_lr = best if name == "adamw" else adamw_lr
    lrs = [adamw_lr] * seeds + [best] * seeds
    _, test_loss, test_acc = run(list(range(seeds)) * 2, lrs)
    results[name] = {
      "tuning_val_loss": scores,
      "best_lr": best,
      "adamw_lr": adamw_lr,
      "at_adamw_lr": {
        "test_loss": test_loss[:seeds].tolist(),
        "test_acc": test_acc[:seeds].tolist(),
      },
      "at_best_lr": {
        "test_loss": test_loss[seeds:].tolist(),
        "test_acc": test_acc[seeds:].tolist(),
      },
    }
    print(
      f"{name}: best lr {best:g} test {fmt(test_loss[seeds:])}; at AdamW's "
      f"lr {adamw_lr:g} test {fmt(test_loss[:seeds])}",
      flush=True,
    )
    write_report(results, grid, steps, seeds, adamw_lr, t0, small)


if __name__ == "__main__":
  app.run(main)
