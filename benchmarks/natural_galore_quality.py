# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Natural GaLore vs GaLore vs AdamW on a char-level transformer.

A 2-layer pre-LayerNorm transformer (Flax attention) learns
``pydoc_data.topics`` (ships with CPython; the last 10% is validation). The
attention and MLP kernels (3-D attention kernels as matrices) are
projected at equal rank for GaLore and Natural GaLore (same projection side,
optax's), everything else gets plain Adam inside the same transform. Each
optimizer first picks its learning rate on a tuning seed, then runs
``--seeds`` paired seeds that share initialisation and data order. We report
validation nats/char at fixed steps and the paired difference
GaLore - Natural GaLore with its standard error, whichever way it comes out.

Run from the repository root::

  python -m benchmarks.natural_galore_quality          # full (~10 min)
  python -m benchmarks.natural_galore_quality --small  # seconds
"""

from __future__ import annotations

import time

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

_SMALL = flags.DEFINE_bool("small", False, "A seconds-long smoke run.")
_SEEDS = flags.DEFINE_integer("seeds", 5, "Paired seeds.")
_STEPS = flags.DEFINE_integer("steps", 400, "Training steps.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 100, "Evaluation period.")
_TUNE_STEPS = flags.DEFINE_integer(
  "tune_steps", 200, "Steps of the learning-rate sweep."
)
_LRS = flags.DEFINE_list("lrs", ["1e-3", "3e-3", "1e-2"], "LR grid.")
_RANK = flags.DEFINE_integer("rank", 8, "Projection rank.")
_GAP = flags.DEFINE_integer("update_proj_gap", 100, "Refresh period T.")
_HISTORY = flags.DEFINE_integer("history_size", 8, "Natural GaLore window s.")
_DAMPING = flags.DEFINE_float("damping", 1e-3, "Natural GaLore damping.")
_BATCH = flags.DEFINE_integer("batch", 32, "Batch size.")
_CONTEXT = flags.DEFINE_integer("context", 64, "Context length.")
_D = flags.DEFINE_integer("d", 64, "Model width.")


def projected_dims(params):
  """GaLoreDimensionNumbers for the attention and MLP kernels (attention's
  3-D kernels as ``d x (heads * head_dim)`` matrices), None elsewhere."""
  return models.hidden_dims(params, optax.contrib.GaLoreDimensionNumbers)


def make_optimizers(rank, gap, history, damping):
  """name -> (factory, kwargs, static_args) for ``optax.inject_hyperparams``.

  The learning rate is injected so that one compiled training chunk per
  optimizer serves every learning rate and seed.
  """
  common_kw = dict(
    rank=rank,
    update_proj_gap=gap,
    scale=1.0,
    weight_dimension_numbers=projected_dims,
  )
  galore_static = ("rank", "update_proj_gap", "weight_dimension_numbers")
  return {
    "adamw": (optax.adamw, {"weight_decay": 0.0}, ()),
    "galore": (optax.contrib.galore, common_kw, galore_static),
    "natural_galore": (
      fisher_optax.natural_galore,
      dict(common_kw, history_size=history, damping=damping),
      galore_static + ("history_size", "svd_power_iterations"),
    ),
  }


class Trainer:
  """One compiled ``eval_every``-step training chunk for one optimizer."""

  def __init__(self, factory, kwargs, static_args, apply_fn, val, chunk):
    self.tx = optax.inject_hyperparams(factory, static_args=static_args)(
      learning_rate=1e-3, **kwargs
    )
    self.chunk = chunk
    tx = self.tx

    def loss(p, x, y):
      return common.cross_entropy(apply_fn(p, x), y)

    @jax.jit
    def run_chunk(params, state, xb, yb):
      def body(carry, batch):
        p, s = carry
        g = jax.grad(loss)(p, *batch)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), None

      return jax.lax.scan(body, (params, state), (xb, yb))[0]

    self.run_chunk = run_chunk
    self.val_loss = jax.jit(lambda p: loss(p, *val))

  def train(self, params, lr, xs, ys, steps):
    """Trains ``steps`` steps; returns {step: val nats/char}."""
    state = self.tx.init(params)
    state.hyperparams["learning_rate"] = jnp.asarray(
      lr, state.hyperparams["learning_rate"].dtype
    )
    curve = {}
    for start in range(0, steps, self.chunk):
      stop = start + self.chunk
      params, state = self.run_chunk(
        params, state, xs[start:stop], ys[start:stop]
      )
      curve[stop] = float(self.val_loss(params))
    return curve


def main(argv):
  del argv
  small = _SMALL.value
  ids, vocab = datasets.load_pydoc_topics()
  train_ids, val_ids = datasets.char_split(ids, 0.1)
  cfg = {
    "vocab": len(vocab),
    "d": _D.value,
    "batch": _BATCH.value,
    "context": _CONTEXT.value,
  }
  steps, every, tune_steps = _STEPS.value, _EVAL_EVERY.value, _TUNE_STEPS.value
  seeds = list(range(1, _SEEDS.value + 1))
  lrs = [float(x) for x in _LRS.value]
  max_windows = 256
  if small:
    steps, every, tune_steps, seeds, lrs = 20, 10, 10, [1, 2], [3e-3]
    cfg.update(d=32, batch=8, context=32)
    max_windows = 16
  vx, vy = datasets.char_eval_windows(val_ids, cfg["context"], max_windows)
  val = (jnp.asarray(vx), jnp.asarray(vy))
  if steps % every or tune_steps % every:
    raise ValueError("steps and tune_steps must be multiples of eval_every.")
  model_kw = dict(
    d=cfg["d"], heads=4, layers=2, ffn=4 * cfg["d"], context=cfg["context"]
  )
  apply_fn, _ = common.char_transformer(cfg["vocab"], seed=0, **model_kw)
  init_params = lambda seed: common.char_transformer(
    cfg["vocab"], seed=seed, **model_kw
  )[1]

  def data(seed, n):
    batches = datasets.char_batches(
      train_ids, cfg["batch"], cfg["context"], seed=seed
    )
    xs, ys = zip(*(next(batches) for _ in range(n)))
    return jnp.asarray(np.stack(xs)), jnp.asarray(np.stack(ys))

  trainers = {
    name: Trainer(factory, kwargs, static, apply_fn, val, every)
    for name, (factory, kwargs, static) in make_optimizers(
      _RANK.value, _GAP.value, _HISTORY.value, _DAMPING.value
    ).items()
  }
  t0 = time.time()

  # 1. Learning-rate sweep on tuning seed 0 (not one of the paired seeds).
  sweep = {}
  xs, ys = data(0, tune_steps)
  for name, trainer in trainers.items():
    sweep[name] = {}
    for lr in lrs:
      curve = trainer.train(init_params(0), lr, xs, ys, tune_steps)
      sweep[name][lr] = curve[tune_steps]
      print(f"sweep {name} lr={lr:g}: {curve[tune_steps]:.4f}", flush=True)
  best = {
    name: min(res, key=lambda lr: np.nan_to_num(res[lr], nan=1e9))
    for name, res in sweep.items()
  }

  # 2. Paired seeds at each optimizer's best learning rate.
  curves = {name: [] for name in trainers}
  for seed in seeds:
    xs, ys = data(seed, steps)
    for name, trainer in trainers.items():
      curves[name].append(
        trainer.train(init_params(seed), best[name], xs, ys, steps)
      )
      print(f"seed {seed} {name}: {curves[name][-1]}", flush=True)
  elapsed = time.time() - t0
  opts = trainers

  eval_steps = sorted(curves["adamw"][0])
  rows = []
  for name in opts:
    rows.append(
      [name, f"{best[name]:g}"]
      + [
        common.fmt_mean_std([c[s] for c in curves[name]], 3) for s in eval_steps
      ]
    )
  table = common.markdown_table(
    ["optimizer", "lr"] + [f"val nats/char @ {s}" for s in eval_steps], rows
  )
  diffs = {}
  drow = []
  for s in eval_steps:
    g = [c[s] for c in curves["galore"]]
    n = [c[s] for c in curves["natural_galore"]]
    mean, se = common.paired_difference(g, n)
    diffs[s] = {"mean": mean, "se": se}
    drow.append(f"{mean:+.4f} ± {se:.4f}")
  diff_table = common.markdown_table(
    ["paired GaLore − Natural GaLore"] + [f"@ {s}" for s in eval_steps],
    [["nats/char (mean ± SE)"] + drow],
  )
  last = diffs[eval_steps[-1]]
  verdict = (
    "Natural GaLore is better by more than 2 SE"
    if last["mean"] > 2 * last["se"]
    else "GaLore is better by more than 2 SE"
    if last["mean"] < -2 * last["se"]
    else "no difference beyond 2 SE"
  )
  md = "\n\n".join(
    [
      "## Natural GaLore: char-level transformer on pydoc_data.topics",
      f"2-layer pre-LayerNorm transformer (nnx.MultiHeadAttention), d={cfg['d']}, 4 heads, FFN "
      f"{4 * cfg['d']}, context {cfg['context']}, batch {cfg['batch']}, "
      f"{steps} steps; attention and MLP kernels projected at rank {_RANK.value}, "
      f"T={_GAP.value}, scale 1 (embeddings, head, norms: plain Adam). "
      f"Natural GaLore s={_HISTORY.value}, damping {_DAMPING.value:g}, "
      "same (optax) projection side as GaLore. Each optimizer's lr is the "
      f"best of {lrs} after {tune_steps} steps on tuning seed 0; then "
      f"{len(seeds)} paired seeds (shared init and data order). Validation "
      f"nats/char on {len(vx)} windows of the last 10%, mean ± std.",
      table,
      diff_table,
      f"At step {eval_steps[-1]}: {verdict} "
      f"(criterion: mean > 2·SE). Wall time {elapsed:.0f} s "
      "on 2 shared CPU cores.",
    ]
  )
  name = "natural_galore_quality" + ("_small" if small else "")
  path = common.write_results(
    name,
    {
      "config": cfg,
      "steps": steps,
      "seeds": seeds,
      "lrs": lrs,
      "rank": _RANK.value,
      "update_proj_gap": _GAP.value,
      "history_size": _HISTORY.value,
      "damping": _DAMPING.value,
      "sweep": sweep,
      "best_lr": best,
      "curves": curves,
      "paired_galore_minus_ng": diffs,
      "elapsed_s": elapsed,
    },
    md,
  )
  _plot(curves, eval_steps, path.with_suffix(".png"))
  print(md)
  print(f"wrote {path}")


def _plot(curves, eval_steps, path):
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for name, runs in curves.items():
    arr = np.array([[c[s] for s in eval_steps] for c in runs])
    mean, std = arr.mean(0), arr.std(0)
    ax.plot(eval_steps, mean, marker="o", label=name)
    ax.fill_between(eval_steps, mean - std, mean + std, alpha=0.2)
  ax.set_xlabel("step")
  ax.set_ylabel("validation nats/char")
  ax.set_title("char LM on pydoc_data.topics")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  app.run(main)
