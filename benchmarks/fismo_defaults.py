# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""FISMO's open choices, swept on a task no default was tuned on.

Run from the repository root::

  python -m benchmarks.fismo_defaults            # full run (~15 min, 2 CPUs)
  python -m benchmarks.fismo_defaults --small    # quick CI-size run

The FISMO paper (Xu et al, 2026) leaves open the damping, where the momentum
lives, how often the factor roots are refreshed and whether the step is
grafted to Muon's norm. This sweeps ``grafting`` x ``damping`` x
``momentum_space`` at ``precondition_interval=10`` (16 configurations) and
``grafting`` x ``damping`` x ``precondition_interval`` in {1, 50} with
whitened momentum (16 more); ``--small`` keeps a 2 x 2 x 2 corner at
interval 10, on a task that
neither the tests nor the other quality benchmarks use: a narrower GELU MLP
(64-96-96-10) on the digits data under a different stratified split (split
seed 7), batch size (64) and step budget (200).

Protocol: every arm (each FISMO configuration, Muon and AdamW) gets the same
lr grid; each lr is trained once with the tuning seed and scored on the
*validation* split; the best lr is rerun with ``--seeds`` fresh seeds (init
and data order) and scored on the *test* split (mean ± standard error).
FISMO is also rerun at Muon's best lr ("Muon's lr transfers"). Hidden
matrices go to Muon/FISMO, the head and biases to AdamW at a fixed lr
(Muon's convention), identical for both. Lanes (lrs, dampings, seeds) are
batched with ``jax.vmap``, so one compile serves each static configuration.
"""

from __future__ import annotations

import itertools
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
_STEPS = flags.DEFINE_integer("steps", 200, "Training steps.")
_DAMPINGS = flags.DEFINE_list(
  "dampings", [], "Dampings to sweep (default: DAMPINGS)."
)
_CONFIGS = flags.DEFINE_list(
  "configs",
  [],
  "Configurations as grafting/momentum_space/interval[/root_method], e.g. "
  "muon_norm/whitened/10/eigh (default: CONFIGS; root_method newton).",
)
_NAME = flags.DEFINE_string("name", "fismo_defaults", "Results file name.")

LR_GRID = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
SMALL_LR_GRID = (1e-3, 1e-2)
DAMPINGS = (1e-3, 1e-2, 1e-1, 1.0)
GRAFTINGS = ("none", "muon_norm")
MOMENTUM_SPACES = ("whitened", "original")
# (grafting, momentum_space, precondition_interval, root_method): a
# factorial subset, with the Newton roots the stored table was made with.
CONFIGS = tuple(
  itertools.product(GRAFTINGS, MOMENTUM_SPACES, (10,), ("newton",))
) + tuple(itertools.product(GRAFTINGS, ("whitened",), (1, 50), ("newton",)))
SIZES = (64, 96, 96, 10)
BATCH = 64
SPLIT_SEED = 7
TUNE_SEED = 100
ADAM_LR = 1e-3  # non-matrix leaves (head, biases), all arms but AdamW
DN = optax.contrib.MuonDimensionNumbers


def make_tx(arm: tuple[Any, ...], dims: Any) -> optax.GradientTransformation:
  """The arm's optimizer; lr (and FISMO's damping) are injected, traced."""
  if arm[0] == "adamw":
    return optax.inject_hyperparams(optax.adamw)(1.0, weight_decay=0.0)
  if arm[0] == "muon":
    return optax.inject_hyperparams(
      optax.contrib.muon, static_args=("ns_steps", "nesterov")
    )(
      1.0,
      nesterov=True,
      adam_learning_rate=ADAM_LR,
      muon_weight_dimension_numbers=dims,
    )
  _, grafting, space, interval, root = arm
  return optax.inject_hyperparams(
    fisher_optax.fismo,
    static_args=("ns_steps", "max_precond_dim", "max_aspect_ratio"),
  )(
    1.0,
    damping=0.1,
    adam_learning_rate=ADAM_LR,
    grafting=grafting,
    momentum_space=space,
    precondition_interval=interval,
    root_method=root,
    fismo_weight_dimension_numbers=dims,
  )


def make_runner(apply_fn, arm, dims, data, steps: int):
  """``run(seeds, lrs, dampings) -> (val_loss, test_loss, test_acc)``.

  One compiled function per static arm; every lane is an independent
  training run (its own init and data order from its seed).
  """
  tx = make_tx(arm, dims)
  xtr, ytr = data["train"]
  xtr, ytr = jnp.asarray(xtr), jnp.asarray(ytr)
  xva, yva = map(jnp.asarray, data["val"])
  xte, yte = map(jnp.asarray, data["test"])
  n = xtr.shape[0]

  def objective(params, x, y):
    return common.cross_entropy(apply_fn(params, x), y)

  def one(params, key, lr, damping):
    state: Any = tx.init(params)
    state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
    if "damping" in state.hyperparams:
      state.hyperparams["damping"] = jnp.asarray(damping, jnp.float32)
    idx = jax.random.randint(key, (steps, BATCH), 0, n)

    def body(carry, i):
      p, s = carry
      g = jax.grad(objective)(p, xtr[i], ytr[i])
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None

    (params, _), _ = jax.lax.scan(body, (params, state), idx)
    logits_va, logits_te = apply_fn(params, xva), apply_fn(params, xte)
    return (
      common.cross_entropy(logits_va, yva),
      common.cross_entropy(logits_te, yte),
      common.accuracy(logits_te, yte),
    )

  batched = jax.jit(jax.vmap(one))

  def run(seeds, lrs, dampings):
    inits = [common.digits_mlp(seed=int(s), sizes=SIZES)[1] for s in seeds]
    params = jax.tree.map(lambda *xs: jnp.stack(xs), *inits)
    keys = jnp.stack([jax.random.key_data(jax.random.key(s)) for s in seeds])
    keys = jax.vmap(jax.random.wrap_key_data)(keys)
    out = batched(
      params,
      keys,
      jnp.asarray(lrs, jnp.float32),
      jnp.asarray(dampings, jnp.float32),
    )
    return [np.asarray(o, np.float64) for o in out]

  return run


def _finite(x: float) -> float:
  return float(x) if math.isfinite(x) else math.inf


mean_se = common.mean_se
fmt = common.fmt_mean_se


def run_arm(apply_fn, arm, dims, data, steps, grid, dampings, seeds, extra_lr):
  """Tunes lr per damping (one lane each), then reruns the winners.

  Returns one record per damping (a single record for Muon/AdamW).
  """
  run = make_runner(apply_fn, arm, dims, data, steps)
  lanes = list(itertools.product(dampings, grid))
  val, _, _ = run(
    [TUNE_SEED] * len(lanes), [lr for _, lr in lanes], [d for d, _ in lanes]
  )
  records = []
  finals = []
  for d in dampings:
    tune = {lr: _finite(v) for (dd, lr), v in zip(lanes, val) if dd == d}
    best = min(tune, key=lambda lr: tune[lr])
    records.append({"damping": d, "tuning_val_loss": tune, "best_lr": best})
    finals += [(d, best, s) for s in range(seeds)]
    if extra_lr is not None:
      finals += [(d, extra_lr, s) for s in range(seeds)]
  _, test_loss, test_acc = run(
    [s for *_, s in finals],
    [lr for _, lr, _ in finals],
    [d for d, *_ in finals],
  )
  for r in records:
    pick = lambda lr, r=r: [
      i for i, (d, l, _) in enumerate(finals) if d == r["damping"] and l == lr
    ]
    i_best = pick(r["best_lr"])[:seeds]
    r["test_loss"] = test_loss[i_best].tolist()
    r["test_acc"] = test_acc[i_best].tolist()
    if extra_lr is not None:
      i_x = pick(extra_lr)[-seeds:]
      r["transfer_lr"] = extra_lr
      r["transfer_test_loss"] = test_loss[i_x].tolist()
  return records


def arm_name(arm: tuple[Any, ...], damping: float | None) -> str:
  if arm[0] != "fismo":
    return arm[0]
  _, grafting, space, interval, root = arm
  name = f"fismo g={grafting} d={damping:g} m={space} k={interval}"
  return name if root == "newton" else f"{name} r={root}"


def main(argv: Any) -> None:
  del argv
  small = _SMALL.value
  seeds = 2 if small else _SEEDS.value
  steps = 60 if small else _STEPS.value
  grid = SMALL_LR_GRID if small else LR_GRID
  dampings = (1e-2, 1.0) if small else DAMPINGS
  configs = CONFIGS[:4] if small else CONFIGS
  if _DAMPINGS.value:
    dampings = tuple(float(d) for d in _DAMPINGS.value)
  if _CONFIGS.value:
    configs = tuple(
      (g, m, int(k), *(r or ["newton"]))
      for g, m, k, *r in (c.split("/") for c in _CONFIGS.value)
    )
  t0 = time.perf_counter()
  data = datasets.load_digits(seed=SPLIT_SEED)
  apply_fn, params0 = common.digits_mlp(seed=0, sizes=SIZES)
  dims = models.digits_hidden_dims(params0, DN)  # not the head
  results: list[dict[str, Any]] = []
  for base in (("adamw",), ("muon",)):
    (r,) = run_arm(apply_fn, base, dims, data, steps, grid, (0.0,), seeds, None)
    r.update(arm=base[0], damping=None)
    results.append(r)
    print(
      f"{base[0]}: lr={r['best_lr']} test={fmt(r['test_loss'])}", flush=True
    )
  muon_lr = results[1]["best_lr"]
  for g, m, k, root in configs:
    arm = ("fismo", g, m, k, root)
    for r in run_arm(
      apply_fn, arm, dims, data, steps, grid, dampings, seeds, muon_lr
    ):
      r.update(arm=arm_name(arm, r["damping"]), grafting=g)
      r.update(momentum_space=m, precondition_interval=k, root_method=root)
      results.append(r)
      print(
        f"{r['arm']}: lr={r['best_lr']} test={fmt(r['test_loss'])} "
        f"@muon lr={fmt(r['transfer_test_loss'])}",
        flush=True,
      )
  wall = time.perf_counter() - t0
  muon_loss = mean_se(results[1]["test_loss"])[0]
  rows = []
  for r in sorted(results, key=lambda r: mean_se(r["test_loss"])[0]):
    transfer = r.get("transfer_test_loss")
    rows.append(
      [
        r["arm"],
        f"{r['best_lr']:g}",
        fmt(r["test_loss"]),
        fmt(r["test_acc"]),
        fmt(transfer) if transfer else "-",
        f"{mean_se(r['test_loss'])[0] / muon_loss:.2f}",
      ]
    )
  name = f"{_NAME.value}_small" if small else _NAME.value
  md = [
    "## FISMO's open choices (defaults sweep)",
    "",
    f"Digits MLP {'-'.join(map(str, SIZES))} (GELU), digits split "
    f"seed {SPLIT_SEED}, batch {BATCH}, {steps} steps. lr chosen on the "
    f"validation loss (one tuning seed) from {list(grid)}, the same grid "
    f"for every arm; test loss/accuracy mean ± se over {seeds} fresh seeds "
    "at that lr. `g` grafting, `d` damping, `m` momentum space, `k` "
    "precondition interval, `r` the root method where not Newton's; other "
    "options at their defaults (pre_ema factor norm, beta = gamma = 0.95). "
    "Hidden matrices to "
    f"Muon/FISMO, head and biases to AdamW at lr {ADAM_LR:g}. "
    f"'@ Muon's lr' is FISMO's test loss at Muon's best lr ({muon_lr:g}). "
    "Sorted by test loss.",
    "",
    common.markdown_table(
      [
        "arm",
        "best lr",
        "test loss",
        "test acc",
        "test loss @ Muon's lr",
        "loss / Muon's",
      ],
      rows,
    ),
    "",
    f"Total wall time {wall:.0f} s ({jax.default_backend()}, shared 2-core "
    "CPU).",
  ]
  common.write_results(
    name,
    {
      "settings": {
        "sizes": SIZES,
        "batch": BATCH,
        "steps": steps,
        "split_seed": SPLIT_SEED,
        "tune_seed": TUNE_SEED,
        "lr_grid": grid,
        "seeds": seeds,
        "adam_lr": ADAM_LR,
      },
      "results": results,
    },
    "\n".join(md),
  )
  print("\n".join(md))


if __name__ == "__main__":
  app.run(main)
