# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""FAdam vs AdamW and Adam on scikit-learn digits.

Protocol: standardised digits, stratified 60/20/20 split; an MLP 64-128-128-10
(GELU, Flax NNX), cross-entropy, batch 64, 30 epochs. Each optimizer gets the
same tuning budget: a 4 x 4 grid of learning rate x weight decay (16 runs,
seed 0), scored by validation NLL after the last epoch; then 5 seeds (model
init and batch order; the split is fixed) at the best setting, reporting test
NLL (main metric), test accuracy and the mean training loss over all steps
(a speed-of-training summary), as mean ± std, plus loss curves.

Adam is AdamW with zero weight decay, so its grid is the lr column of AdamW's
(4 runs). ``fadam (per-example Fisher)`` uses ``fisher_source="per_example"``;
its Fisher is ~B times larger, so its lr grid is shifted up by 3x-10x (same
number of runs). Run from the repository root::

  python -m benchmarks.fadam_quality           # full protocol (a few minutes)
  python -m benchmarks.fadam_quality --small   # seconds-long smoke run
"""

from __future__ import annotations

from collections.abc import Callable
import functools
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
import fisher_optax

_SMALL = flags.DEFINE_bool("small", False, "2 epochs, 2x2 grid, 2 seeds.")
_OUT = flags.DEFINE_string("out_dir", None, "Results dir (default results/).")

NAME = "fadam_quality"
BATCH = 64

# name -> (factory, lr grid, weight-decay grid, needs per-example grads)
OPTIMIZERS: dict[
  str, tuple[Callable[..., Any], list[float], list[float], bool]
] = {
  "fadam": (
    fisher_optax.fadam,
    [3e-4, 1e-3, 3e-3, 1e-2],
    [0.0, 1e-3, 1e-2, 1e-1],
    False,
  ),
  "adamw": (
    optax.adamw,
    [3e-4, 1e-3, 3e-3, 1e-2],
    [0.0, 1e-2, 1e-1, 5e-1],
    False,
  ),
  "adam": (optax.adamw, [3e-4, 1e-3, 3e-3, 1e-2], [0.0], False),
  "fadam (per-example Fisher)": (
    functools.partial(fisher_optax.fadam, fisher_source="per_example"),
    [1e-3, 3e-3, 1e-2, 3e-2],
    [0.0, 1e-3, 1e-2, 1e-1],
    True,
  ),
}


class Trainer:
  """One compiled epoch per optimizer; hyperparameters live in the state."""

  def __init__(
    self,
    factory: Callable[..., Any],
    per_example: bool,
    data: dict[str, tuple[np.ndarray, np.ndarray]],
  ):
    self.data = data
    self.tx = optax.inject_hyperparams(factory)(
      learning_rate=1e-3, weight_decay=0.0
    )
    apply_fn, _ = common.digits_mlp(0)
    self.apply_fn = apply_fn

    def loss_fn(params, x, y):
      return common.cross_entropy(apply_fn(params, x), y)

    def example_loss(params, x, y):
      return loss_fn(params, x[None], y[None])

    def step(carry, batch):
      params, state = carry
      x, y = batch
      value, grads = jax.value_and_grad(loss_fn)(params, x, y)
      extras = {}
      if per_example:
        extras["per_example_grads"] = jax.vmap(
          jax.grad(example_loss), in_axes=(None, 0, 0)
        )(params, x, y)
      updates, state = self.tx.update(grads, state, params, **extras)
      return (optax.apply_updates(params, updates), state), value

    @jax.jit
    def epoch(params, state, xs, ys):
      (params, state), losses = jax.lax.scan(step, (params, state), (xs, ys))
      return params, state, losses

    @jax.jit
    def evaluate(params, x, y):
      logits = apply_fn(params, x)
      return common.cross_entropy(logits, y), common.accuracy(logits, y)

    self.epoch, self.evaluate = epoch, evaluate

  def run(self, lr: float, wd: float, seed: int, epochs: int) -> dict[str, Any]:
    _, params = common.digits_mlp(seed)
    state = self.tx.init(params)
    state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
    state.hyperparams["weight_decay"] = jnp.asarray(wd, jnp.float32)
    x, y = self.data["train"]
    steps = len(x) // BATCH
    batches = common.minibatches(x, y, BATCH, seed)
    train_curve, val_curve, all_losses = [], [], []
    for _ in range(epochs):
      xs, ys = zip(*itertools.islice(batches, steps))
      params, state, losses = self.epoch(
        params, state, np.stack(xs), np.stack(ys)
      )
      losses = np.asarray(losses)
      all_losses.append(losses)
      train_curve.append(float(losses.mean()))
      val_curve.append(float(self.evaluate(params, *self.data["val"])[0]))
    test_nll, test_acc = self.evaluate(params, *self.data["test"])
    val_nll = val_curve[-1]
    finite = math.isfinite(val_nll) and math.isfinite(float(test_nll))
    return {
      "lr": lr,
      "weight_decay": wd,
      "seed": seed,
      "val_nll": val_nll if finite else float("inf"),
      "test_nll": float(test_nll) if finite else float("inf"),
      "test_accuracy": float(test_acc),
      "mean_train_loss": float(np.concatenate(all_losses).mean()),
      "train_curve": train_curve,
      "val_curve": val_curve,
    }


def plot_curves(finals: dict[str, list[dict[str, Any]]], path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for name, runs in finals.items():
    for ax, key in zip(axes, ("train_curve", "val_curve")):
      curves = np.array([r[key] for r in runs])
      epochs = np.arange(1, curves.shape[1] + 1)
      mean, std = curves.mean(0), curves.std(0)
      ax.plot(epochs, mean, label=name)
      ax.fill_between(epochs, mean - std, mean + std, alpha=0.2)
  for ax, title in zip(axes, ("training loss (epoch mean)", "validation NLL")):
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_title(title)
    ax.grid(alpha=0.3)
  axes[1].legend()
  fig.suptitle(
    "digits MLP 64-128-128-10, best setting per optimizer, "
    f"{len(next(iter(finals.values())))} seeds (mean ± std)"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  t0 = time.time()
  small = _SMALL.value
  epochs, seeds = (2, [0, 1]) if small else (30, [0, 1, 2, 3, 4])
  data = datasets.load_digits(seed=0, split=(0.6, 0.2, 0.2), standardize=True)
  grids, finals, best = {}, {}, {}
  for name, (factory, lrs, wds, per_example) in OPTIMIZERS.items():
    if small:
      lrs, wds = lrs[1:3], wds[:2] if len(wds) > 1 else wds
    trainer = Trainer(factory, per_example, data)
    grid = [trainer.run(lr, wd, 0, epochs) for lr in lrs for wd in wds]
    for r in grid:
      del r["train_curve"], r["val_curve"]
    grids[name] = grid
    top = min(grid, key=lambda r: r["val_nll"])
    best[name] = {
      "lr": top["lr"],
      "weight_decay": top["weight_decay"],
      "val_nll": top["val_nll"],
      "grid_runs": len(grid),
    }
    finals[name] = [
      trainer.run(top["lr"], top["weight_decay"], s, epochs) for s in seeds
    ]
    print(
      f"{name}: best lr={top['lr']} wd={top['weight_decay']} "
      f"val NLL {top['val_nll']:.4f}; test NLL "
      f"{common.fmt_mean_std([r['test_nll'] for r in finals[name]])}"
    )

  rows = []
  for name, runs in finals.items():
    rows.append(
      [
        name,
        f"{best[name]['lr']:g}",
        f"{best[name]['weight_decay']:g}",
        best[name]["grid_runs"],
        common.fmt_mean_std([r["test_nll"] for r in runs]),
        common.fmt_mean_std([r["test_accuracy"] for r in runs]),
        common.fmt_mean_std([r["mean_train_loss"] for r in runs]),
      ]
    )
  table = common.markdown_table(
    [
      "optimizer",
      "best lr",
      "best weight decay",
      "tuning runs",
      "test NLL",
      "test accuracy",
      "mean train loss",
    ],
    rows,
  )
  nll = {k: [r["test_nll"] for r in v] for k, v in finals.items()}
  _, adamw_std = common.mean_std(nll["adamw"])
  comparisons, lines = {}, []
  for name in ("fadam", "fadam (per-example Fisher)"):
    diff, se = common.paired_difference(nll[name], nll["adamw"])
    mean_diff = common.mean_std(nll[name])[0] - common.mean_std(nll["adamw"])[0]
    verdict = "matches or beats" if mean_diff <= adamw_std else "does not match"
    comparisons[name] = {"mean": diff, "se": se, "verdict": verdict}
    lines.append(
      f"- {name} - AdamW test NLL, paired by seed: {diff:+.4f} "
      f"± {se:.4f} (s.e.): {verdict} AdamW by our "
      f"criterion (mean no worse than AdamW's by more than one "
      f"AdamW seed std, {adamw_std:.4f})."
    )
  edges = []
  for name, (_, lrs, wds, _) in OPTIMIZERS.items():
    b = best[name]
    if b["lr"] in (lrs[0], lrs[-1]) or (
      len(wds) > 1 and b["weight_decay"] in (wds[0], wds[-1])
    ):
      edges.append(name)
  if edges and not small:
    lines.append(
      "- Best settings on an edge of their grid (a wider grid "
      "might help them): " + ", ".join(edges) + "."
    )
  suffix = "_small" if small else ""
  plot_name = f"{NAME}{suffix}.png"
  out_dir = common.RESULTS_DIR if _OUT.value is None else _OUT.value
  import pathlib  # pylint: disable=g-import-not-at-top

  pathlib.Path(out_dir).mkdir(parents=True, exist_ok=True)
  plot_curves(finals, pathlib.Path(out_dir) / plot_name)
  md = (
    f"### FAdam vs AdamW on digits ({len(seeds)} seeds, "
    f"{epochs} epochs)\n\n{table}\n\n"
    f"Mean ± std over seeds at the setting with the best validation NLL "
    f"(seed 0) in each optimizer's grid; mean train loss is the mean "
    f"over all training steps (lower = faster training).\n\n"
    + "\n".join(lines)
    + f"\n\nLoss curves: `{plot_name}`.\n"
  )
  common.write_results(
    NAME + suffix,
    {
      "protocol": {
        "epochs": epochs,
        "batch": BATCH,
        "seeds": seeds,
        "model": "MLP 64-128-128-10 gelu",
        "split": "stratified 60/20/20, seed 0, standardised",
        "tuning": "4x4 grid (lr x wd) on final val NLL, seed 0",
      },
      "grids": grids,
      "best": best,
      "finals": finals,
      "minus_adamw_test_nll": comparisons,
      "best_on_grid_edge": edges,
      "wall_s": time.time() - t0,
    },
    md,
    out_dir=out_dir,
  )
  print(md)
  print(f"wall {time.time() - t0:.0f}s")


if __name__ == "__main__":
  app.run(main)
