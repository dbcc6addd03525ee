# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""FISMO vs Muon vs AdamW: digits MLP and a char-level transformer LM.

Run from the repository root::

  python -m benchmarks.fismo_quality            # full run (~10 min, 2 CPUs)
  python -m benchmarks.fismo_quality --small    # seconds-long smoke run

Protocol (equal tuning budget): every arm gets the same number of learning
rates (a 3-point grid centred on its usual range), each trained once with the
tuning seed and scored on the *validation* split; the best lr is then rerun
with ``--seeds`` fresh seeds (init and data order) and scored on the *test*
split (digits) or held-out text (LM). Muon/FISMO route hidden matrices to
themselves and embeddings, head, biases and norms to AdamW with a fixed lr
(Muon's convention), identical for both.
"""

from __future__ import annotations

from collections.abc import Callable
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

_SMALL = flags.DEFINE_bool("small", False, "Tiny budget smoke run.")
_SEEDS = flags.DEFINE_integer("seeds", 5, "Seeds for the final runs.")
_DIGITS_STEPS = flags.DEFINE_integer("digits_steps", 400, "Digits steps.")
_LM_STEPS = flags.DEFINE_integer("lm_steps", 250, "Char-LM steps.")
_TASKS = flags.DEFINE_list("tasks", ["digits", "charlm"], "Tasks to run.")
_ARMS = flags.DEFINE_list(
  "arms", [], "Subset of arms (default all; Muon, the paired base, always)."
)
_DAMPINGS = flags.DEFINE_list(
  "fismo_dampings",
  [],
  "Extra arms: FISMO at its defaults but these dampings (Muon's lr grid).",
)
_NAME = flags.DEFINE_string("name", "fismo_quality", "Results file name.")

DN = optax.contrib.MuonDimensionNumbers
# lr grids, one per arm, same size (the tuning budget). AdamW's and Muon's are
# centred on their usual lrs. FISMO at its defaults (grafting="muon_norm",
# Muon's step norm) takes Muon's grid; without grafting (the paper's step,
# larger) a grid from a one-seed digits pilot (validation split).
GRIDS = {
  "adamw": (1e-3, 3e-3, 1e-2),
  "muon": (3e-3, 1e-2, 3e-2),
  "fismo": (3e-3, 1e-2, 3e-2),
  "fismo_no_graft": (3e-4, 1e-3, 3e-3),
}


_STATIC = {
  "muon": ("ns_steps", "nesterov"),
  "fismo": ("ns_steps", "max_precond_dim", "max_aspect_ratio"),
}


def arms() -> dict[str, tuple[float, ...]]:
  """The arms to run and their lr grids (from ``--arms``/``--fismo_dampings``)."""
  grids = dict(GRIDS)
  grids.update({f"fismo_d{float(d):g}": GRIDS["muon"] for d in _DAMPINGS.value})
  keep = set(_ARMS.value or grids) | {"muon"}
  return {a: g for a, g in grids.items() if a in keep}


def make_tx(
  arm: str, lr: float, dims: Any, adam_lr: float
) -> optax.GradientTransformation:
  """The arm's optimizer with an injected (traced) learning rate."""
  if arm == "adamw":
    return optax.inject_hyperparams(optax.adamw)(lr, weight_decay=0.0)
  if arm == "muon":
    return optax.inject_hyperparams(
      optax.contrib.muon, static_args=_STATIC["muon"]
    )(
      lr,
      nesterov=True,
      adam_learning_rate=adam_lr,
      muon_weight_dimension_numbers=dims,
    )
  kw: dict[str, Any] = {"grafting": "none"} if arm == "fismo_no_graft" else {}
  if arm.startswith("fismo_d"):
    kw["damping"] = float(arm.removeprefix("fismo_d"))
  return optax.inject_hyperparams(
    fisher_optax.fismo, static_args=_STATIC["fismo"]
  )(
    lr,
    adam_learning_rate=adam_lr,
    fismo_weight_dimension_numbers=dims,
    **kw,
  )


class Trainer:
  """One compiled training scan per (task, arm); lr and seed are data."""

  def __init__(
    self, apply_fn: Callable[..., Any], arm: str, dims: Any, adam_lr: float
  ):
    self.arm, self.dims, self.adam_lr = arm, dims, adam_lr
    tx = make_tx(arm, 1.0, dims, adam_lr)

    def objective(params, x, y):
      return common.cross_entropy(apply_fn(params, x), y)

    def body(carry, batch):
      params, state = carry
      loss, grads = jax.value_and_grad(objective)(params, *batch)
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), loss

    @jax.jit
    def run(params, lr, xs, ys):
      state = tx.init(params)
      state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
      (params, _), losses = jax.lax.scan(body, (params, state), (xs, ys))
      return params, losses

    self._run = run

  def __call__(
    self, params: Any, lr: float, xs: np.ndarray, ys: np.ndarray
  ) -> tuple[Any, list[float], float]:
    t0 = time.perf_counter()
    params, losses = self._run(params, lr, xs, ys)
    losses = np.asarray(losses, np.float64)
    return params, losses.tolist(), (time.perf_counter() - t0) / len(xs)


def _evaluator(apply_fn: Callable[..., Any]):
  """Jitted once per task: loss and accuracy over a whole (small) eval set."""

  @jax.jit
  def ev(params, x, y):
    logits = apply_fn(params, x)
    return common.cross_entropy(logits, y), common.accuracy(logits, y)

  def run(params, x, y):
    loss, acc = ev(params, x, y)
    return {"loss": float(loss), "accuracy": float(acc)}

  return run


def _stack(batches, steps: int) -> tuple[np.ndarray, np.ndarray]:
  xs, ys = zip(*(next(batches) for _ in range(steps)))
  return np.stack(xs), np.stack(ys)


def _tune_and_run(
  trainer: Trainer, init_fn, grid, seeds: int, data_fn, tune_eval, final_eval
) -> dict[str, Any]:
  tune = {}
  for lr in grid:
    params, _, _ = trainer(init_fn(100), lr, *data_fn(100))
    loss = tune_eval(params)
    tune[lr] = loss if np.isfinite(loss) else np.inf
  best = min(tune, key=tune.get)
  finals: dict[str, list[Any]] = {
    "train_loss": [],
    "s_per_step": [],
    "curves": [],
    "eval": [],
  }
  for s in range(seeds):
    params, losses, sps = trainer(init_fn(s), best, *data_fn(s))
    finals["eval"].append(final_eval(params))
    finals["train_loss"].append(float(np.mean(losses[-20:])))
    finals["s_per_step"].append(sps)
    finals["curves"].append(losses)
  return {"tuning_val_loss": tune, "best_lr": best, **finals}


def run_digits(seeds: int, steps: int, small: bool) -> dict[str, Any]:
  data = datasets.load_digits(seed=0)
  xtr, ytr = data["train"]
  apply_fn, params0 = common.digits_mlp(seed=0)
  dims = models.digits_hidden_dims(params0, DN)  # not the head
  init_fn = lambda s: common.digits_mlp(seed=s)[1]
  evaluate = _evaluator(apply_fn)
  data_fn = lambda s: _stack(common.minibatches(xtr, ytr, 128, seed=s), steps)
  results: dict[str, Any] = {}
  for arm, grid in arms().items():
    trainer = Trainer(apply_fn, arm, dims, adam_lr=1e-3)
    r = _tune_and_run(
      trainer,
      init_fn,
      grid[:1] if small else grid,
      seeds,
      data_fn,
      lambda p: evaluate(p, *data["val"])["loss"],
      lambda p: evaluate(p, *data["test"]),
    )
    r["test_acc"] = [e["accuracy"] for e in r["eval"]]
    r["test_loss"] = [e["loss"] for e in r["eval"]]
    results[arm] = r
    print(
      f"digits {arm}: lr={r['best_lr']} "
      f"acc={common.fmt_mean_std(r['test_acc'])}",
      flush=True,
    )
  return results


def run_charlm(seeds: int, steps: int, small: bool) -> dict[str, Any]:
  ids, vocab = datasets.load_pydoc_topics()
  train_ids, val_ids = datasets.char_split(ids, 0.1)
  context, batch = (32, 8) if small else (64, 16)
  model_kw = dict(d=64, heads=4, layers=2, ffn=128, context=context)
  # Tuning is scored on the first half of the held-out text, reporting on
  # the second half.
  half = len(val_ids) // 2
  tune_x, tune_y = datasets.char_eval_windows(val_ids[:half], context, 64)
  test_x, test_y = datasets.char_eval_windows(val_ids[half:], context, 128)
  apply_fn, params0 = common.char_transformer(len(vocab), seed=0, **model_kw)
  dims = models.hidden_dims(params0, DN)  # attention (3-D) and MLP kernels
  init_fn = lambda s: common.char_transformer(len(vocab), seed=s, **model_kw)[1]
  evaluate = _evaluator(apply_fn)
  data_fn = lambda s: _stack(
    datasets.char_batches(train_ids, batch, context, seed=s), steps
  )
  results: dict[str, Any] = {}
  for arm, grid in arms().items():
    trainer = Trainer(apply_fn, arm, dims, adam_lr=3e-3)
    r = _tune_and_run(
      trainer,
      init_fn,
      grid[:1] if small else grid,
      seeds,
      data_fn,
      lambda p: evaluate(p, tune_x, tune_y)["loss"],
      lambda p: evaluate(p, test_x, test_y)["loss"],
    )
    r["val_loss"] = r["eval"]
    results[arm] = r
    print(
      f"charlm {arm}: lr={r['best_lr']} "
      f"val={common.fmt_mean_std(r['val_loss'])}",
      flush=True,
    )
  return results


def _plot(results: dict[str, Any], name: str) -> None:
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  tasks = [t for t in ("digits", "charlm") if t in results]
  fig, axes = plt.subplots(
    1, len(tasks), figsize=(5 * len(tasks), 3.5), squeeze=False
  )
  for ax, task in zip(axes[0], tasks):
    for arm, r in results[task].items():
      curves = np.asarray(r["curves"], np.float64)
      k = 10  # moving average for readability
      smooth = np.stack(
        [np.convolve(c, np.ones(k) / k, mode="valid") for c in curves]
      )
      mean, std = smooth.mean(0), smooth.std(0)
      x = np.arange(len(mean)) + k
      ax.plot(x, mean, label=f"{arm} (lr={r['best_lr']:g})")
      ax.fill_between(x, mean - std, mean + std, alpha=0.2)
    ax.set_title(f"{task}: train loss (mean ± std over seeds)")
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(common.RESULTS_DIR / f"{name}.png", dpi=110)


def main(argv: Any) -> None:
  del argv
  small = _SMALL.value
  seeds = 2 if small else _SEEDS.value
  results, t0 = {}, time.perf_counter()
  if "digits" in _TASKS.value:
    results["digits"] = run_digits(
      seeds, 30 if small else _DIGITS_STEPS.value, small
    )
  if "charlm" in _TASKS.value:
    results["charlm"] = run_charlm(
      seeds, 20 if small else _LM_STEPS.value, small
    )
  name = f"{_NAME.value}_small" if small else _NAME.value
  md = ["## FISMO vs Muon vs AdamW", ""]
  if "digits" in results:
    rows = []
    base = results["digits"]["muon"]["test_acc"]
    for arm, r in results["digits"].items():
      diff, se = common.paired_difference(r["test_acc"], base)
      rows.append(
        [
          arm,
          f"{r['best_lr']:g}",
          common.fmt_mean_std(r["test_acc"]),
          common.fmt_mean_std(r["test_loss"]),
          common.fmt_mean_std(r["train_loss"]),
          f"{diff:+.4f} ± {se:.4f}",
          f"{1e3 * np.median(r['s_per_step']):.1f}",
        ]
      )
    md += [
      f"**Digits MLP** 64-128-128-10, batch 128, "
      f"{30 if small else _DIGITS_STEPS.value} steps, {seeds} seeds "
      "(test split; lr chosen on validation loss from 3 values per arm)",
      "",
      common.markdown_table(
        [
          "arm",
          "lr",
          "test acc",
          "test loss",
          "final train loss",
          "Δacc vs Muon (paired)",
          "ms/step",
        ],
        rows,
      ),
      "",
    ]
  if "charlm" in results:
    rows = []
    base = results["charlm"]["muon"]["val_loss"]
    for arm, r in results["charlm"].items():
      diff, se = common.paired_difference(r["val_loss"], base)
      rows.append(
        [
          arm,
          f"{r['best_lr']:g}",
          common.fmt_mean_std(r["val_loss"]),
          common.fmt_mean_std(r["train_loss"]),
          f"{diff:+.4f} ± {se:.4f}",
          f"{1e3 * np.median(r['s_per_step']):.1f}",
        ]
      )
    md += [
      f"**Char-level transformer LM** on `pydoc_data.topics` (d=64, 2 "
      f"layers, {20 if small else _LM_STEPS.value} steps, {seeds} "
      "seeds; held-out text loss in nats/char)",
      "",
      common.markdown_table(
        [
          "arm",
          "lr",
          "held-out loss",
          "final train loss",
          "Δloss vs Muon (paired)",
          "ms/step",
        ],
        rows,
      ),
      "",
    ]
  md.append(
    f"Total wall time {time.perf_counter() - t0:.0f} s "
    f"({jax.default_backend()}, shared 2-core CPU)."
  )
  common.write_results(
    name, {"grids": arms(), "results": results}, "\n".join(md)
  )
  _plot(results, name)
  print("\n".join(md))


if __name__ == "__main__":
  app.run(main)
