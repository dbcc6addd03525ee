# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""One-shot pruning of a digits MLP without retraining.

A 64-64-10 tanh MLP is trained on sklearn's digits with Adam, then both
kernels are pruned globally (biases kept) to 80% and 90% sparsity by

* ``magnitude``: zero the smallest |w|;
* ``obs_1``: one OBS step (M-FAC saliency + the sum of independent updates);
* ``obs_16``: M-FAC's pruner, 16 geometric recomputation steps with fresh
  per-example gradients (``obs_prune``, update="independent");
* ``obs_16_group``: the same with exact group OBS updates.

Fisher: blocks of 128 along the flattened kernels, 512 per-example empirical
gradients per step, damping 1e-4 (a reference prototype's settings). Test
accuracy without any retraining, mean ± std over seeds. Run from the
repository root::

  python -m benchmarks.obs_pruning            # 3 seeds (a few minutes)
  python -m benchmarks.obs_pruning --small    # seconds-long smoke run
"""

from __future__ import annotations

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
from fisher_optax import fisher

_SMALL = flags.DEFINE_bool("small", False, "1 seed, 2 steps (smoke run).")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Number of seeds.")
_OUT = flags.DEFINE_string("out_dir", None, "Results dir (default results/).")

NAME = "obs_pruning"
SPARSITIES = (0.8, 0.9)


def train(seed: int, data: dict[str, Any], steps: int):
  apply_fn, params = common.digits_mlp(
    seed, sizes=(64, 64, 10), activation="tanh"
  )
  tx = optax.adam(3e-3)
  step = common.make_train_step(apply_fn, tx)
  state = tx.init(params)
  batches = common.minibatches(*data["train"], batch_size=64, seed=seed)
  for _ in range(steps):
    x, y = next(batches)
    params, state, _ = step(params, state, (jnp.asarray(x), jnp.asarray(y)))
  return apply_fn, params


def is_kernel(params):
  return jax.tree.map(lambda x: x.ndim == 2, params)


def make_grad_fn(apply_fn, data, seed: int, num_grads: int):
  x_train, y_train = data["train"]

  def loss_fn(p, example):
    x, y = example
    return common.cross_entropy(apply_fn(p, x[None]), y[None])

  grads = jax.jit(lambda p, x, y: fisher.per_example_grads(loss_fn, p, (x, y)))

  def grad_fn(p, step):
    rng = np.random.default_rng(1000 * seed + step)
    idx = rng.choice(len(x_train), size=num_grads, replace=False)
    return grads(p, jnp.asarray(x_train[idx]), jnp.asarray(y_train[idx]))

  return grad_fn


def main(argv):
  del argv
  small = _SMALL.value
  seeds = 1 if small else _SEEDS.value
  steps_full = 2 if small else 16
  train_steps = 200 if small else 1500
  settings = dict(
    block_size=128,
    num_grads=512,
    damping=1e-4,
    train_steps=train_steps,
    recompute_steps=steps_full,
    sparsities=SPARSITIES,
    seeds=seeds,
    small=small,
  )
  methods = (
    "magnitude",
    "obs_1",
    f"obs_{steps_full}",
    f"obs_{steps_full}_group",
  )
  acc = {(m, s): [] for m in methods for s in SPARSITIES}
  dense_acc, secs = [], {m: [] for m in methods}
  for seed in range(seeds):
    data = datasets.load_digits(seed=seed)
    apply_fn, params = train(seed, data, train_steps)
    test = lambda p: common.evaluate(apply_fn, p, *data["test"])["accuracy"]
    dense_acc.append(test(params))
    grad_fn = make_grad_fn(apply_fn, data, seed, settings["num_grads"])
    for sparsity in SPARSITIES:
      for method in methods:
        t0 = time.perf_counter()
        if method == "magnitude":
          res = fisher_optax.magnitude_prune(
            params, sparsity, prunable=is_kernel
          )
        else:
          res = fisher_optax.obs_prune(
            params,
            grad_fn,
            sparsity,
            prunable=is_kernel,
            steps=1 if method == "obs_1" else steps_full,
            block_size=settings["block_size"],
            damping=settings["damping"],
            update="group" if method.endswith("group") else "independent",
          )
        common.block(res.params)
        secs[method].append(time.perf_counter() - t0)
        kernels = [
          m
          for m, k in zip(
            jax.tree.leaves(res.masks), jax.tree.leaves(is_kernel(params))
          )
          if k
        ]
        achieved = 1.0 - sum(float(m.sum()) for m in kernels) / sum(
          m.size for m in kernels
        )
        assert abs(achieved - sparsity) < 1e-3, achieved
        acc[(method, sparsity)].append(test(res.params))
        print(
          f"seed {seed} sparsity {sparsity} {method}: "
          f"{acc[(method, sparsity)][-1]:.4f}",
          flush=True,
        )

  rows = [["dense (0%)", common.fmt_mean_std(dense_acc, 3), "", "", ""]]
  for sparsity in SPARSITIES:
    row = [f"{int(sparsity * 100)}%"]
    for method in methods:
      row.append(common.fmt_mean_std(acc[(method, sparsity)], 3))
    rows.append(row)
  header = [
    "sparsity",
    "magnitude",
    "OBS, 1 step",
    f"OBS, {steps_full} steps",
    f"group OBS, {steps_full} steps",
  ]
  table = common.markdown_table(header, rows)
  md = (
    f"### OBS pruning without retraining (digits MLP 64-64-10 tanh)\n\n"
    f"Test accuracy, mean ± std over {seeds} seed(s); both kernels pruned "
    f"globally, biases kept; M-FAC Fisher with blocks of "
    f"{settings['block_size']}, {settings['num_grads']} per-example "
    f"gradients per step, damping {settings['damping']}. Seconds per "
    "pruning run (mean): "
    + ", ".join(f"{m} {np.mean(v):.1f}" for m, v in secs.items())
    + ".\n\n"
    + table
    + "\n"
  )
  data_out = {
    "settings": settings,
    "dense_accuracy": dense_acc,
    "accuracy": {f"{m}@{s}": v for (m, s), v in acc.items()},
    "seconds": secs,
  }
  name = NAME + ("_small" if small else "")
  path = common.write_results(name, data_out, md, _OUT.value)
  print(md)
  print("wrote", path)


if __name__ == "__main__":
  app.run(main)
