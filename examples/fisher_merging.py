# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Fisher merging of a base and a fine-tuned model
#
# A base MLP learns digits (task A); a copy is fine-tuned on digits with
# permuted pixels (task B) and forgets A. Merging the two,
#
# $$\theta^\star = \frac{w F_A \theta_A + (1 - w) F_B \theta_B}
#                      {w F_A + (1 - w) F_B},$$
#
# with each model's diagonal Fisher $F$ (Matena & Raffel, 2022) keeps more of
# both tasks than the plain weighted average ($F = 1$). We sweep the weight
# $w$ on the base and plot both tasks' accuracy for both merges, then let
# `search_merge_weights` pick $w$ on the validation split.
#
# On a GPU or TPU runtime, install the accelerator jax wheel first
# (`pip install -U "jax[cuda12]"` or `"jax[tpu]"`); nothing else changes.
# Run as a script: `python examples/fisher_merging.py --out_dir plots`.

# %%
import functools
import pathlib

import _notebook
from absl import flags
from common import datasets
from common import models
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from tqdm.auto import tqdm

import fisher_optax
from fisher_optax import fisher

flags.DEFINE_integer(
  "steps", 500, "Training steps of the base and of the fine-tuning."
)
flags.DEFINE_integer("batch_size", 64, "Mini-batch size.")
flags.DEFINE_integer("n_fisher", 512, "Examples per Fisher estimate.")
flags.DEFINE_integer("num_weights", 21, "Points of the weight sweep.")
flags.DEFINE_integer("seed", 0, "Seed of the split, the init and the batches.")
flags.DEFINE_string("out_dir", "example_outputs", "Where plots are written.")
flags.DEFINE_bool("small", False, "Tiny run (CI): few steps.")
FLAGS = flags.FLAGS


# %% [markdown]
# ## Two tasks, two models


# %%
def permuted(data, seed):
  perm = np.random.default_rng(seed + 1000).permutation(64)
  return {k: (x[:, perm], y) for k, (x, y) in data.items()}


def train(apply_fn, params, data, steps, batch_size, seed, desc):
  tx = optax.adam(1e-3)

  @jax.jit
  def step(p, s, x, y):
    grads = jax.grad(
      lambda q: optax.softmax_cross_entropy_with_integer_labels(
        apply_fn(q, x), y
      ).mean()
    )(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  x, y = data["train"]
  rng = np.random.default_rng(seed)
  state = tx.init(params)
  for _ in tqdm(range(steps), desc=desc, leave=False):
    idx = rng.integers(0, len(x), batch_size)
    params, state = step(params, state, x[idx], y[idx])
  return params


@functools.partial(jax.jit, static_argnums=0)  # one compile, not one per op
def _accuracy(apply_fn, params, x, y):
  return jnp.mean(jnp.argmax(apply_fn(params, x), -1) == y)


def accuracy(apply_fn, params, x, y):
  return float(_accuracy(apply_fn, params, x, y))


# %% [markdown]
# ## Fishers and the weight sweep
# Each model's exact diagonal Fisher on its own task's training inputs
# (`kind="exact"`: the expectation over the model's predictive distribution).


# %%
def main(argv):
  del argv
  small = FLAGS.small
  steps = 40 if small else FLAGS.steps
  n_fisher = 64 if small else FLAGS.n_fisher
  num_weights = 5 if small else FLAGS.num_weights
  data_a = datasets.load_digits(seed=FLAGS.seed)
  data_b = permuted(data_a, FLAGS.seed)
  apply_fn, init = models.digits_mlp(FLAGS.seed)

  base = train(
    apply_fn, init, data_a, steps, FLAGS.batch_size, FLAGS.seed, "base (task A)"
  )
  tuned = train(
    apply_fn,
    base,
    data_b,
    steps,
    FLAGS.batch_size,
    FLAGS.seed + 1,
    "fine-tune (task B)",
  )
  exact_diagonal = jax.jit(
    lambda p, batch: (
      fisher.diagonal(
        apply_fn, p, batch, likelihood=fisher.Categorical(), kind="exact"
      ).diag
    )
  )
  fishers = [
    exact_diagonal(p, tuple(a[:n_fisher] for a in d["train"]))
    for p, d in ((base, data_a), (tuned, data_b))
  ]

  def scores(params, split):
    return (
      accuracy(apply_fn, params, *data_a[split]),
      accuracy(apply_fn, params, *data_b[split]),
    )

  merge = fisher_optax.fisher_merge
  weights = np.linspace(0.0, 1.0, num_weights)
  sweep = {"plain average": [], "Fisher merging": []}
  for w in tqdm(weights, desc="weight sweep", leave=False):
    ws = jnp.asarray([w, 1.0 - w])
    sweep["plain average"].append(
      scores(merge([base, tuned], None, ws), "test")
    )
    sweep["Fisher merging"].append(
      scores(merge([base, tuned], fishers, ws), "test")
    )

  print(
    f"base:  task A {scores(base, 'test')[0]:.3f}  "
    f"task B {scores(base, 'test')[1]:.3f}"
  )
  print(
    f"tuned: task A {scores(tuned, 'test')[0]:.3f}  "
    f"task B {scores(tuned, 'test')[1]:.3f}"
  )
  for name, fs in (("plain average", None), ("Fisher merging", fishers)):
    search = fisher_optax.search_merge_weights(
      lambda p: np.mean(scores(p, "val")),
      [base, tuned],
      fs,
      num_points=num_weights,
    )
    w = float(np.asarray(search.best_weights)[0])
    a, b = scores(
      fisher_optax.fisher_merge([base, tuned], fs, search.best_weights), "test"
    )
    print(
      f"{name:>15}: weight on base {w:.2f} (chosen on val)  "
      f"task A {a:.3f}  task B {b:.3f}  mean {(a + b) / 2:.3f}"
    )

  out = pathlib.Path(FLAGS.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
  for name, style in (("plain average", "--"), ("Fisher merging", "-")):
    acc = np.asarray(sweep[name])
    axes[0].plot(weights, acc[:, 0], style, label=name)
    axes[1].plot(weights, acc[:, 1], style, label=name)
    axes[2].plot(weights, acc.mean(1), style, label=name)
  for ax, title in zip(
    axes, ("task A (base)", "task B (fine-tuned)", "mean of both")
  ):
    ax.set(title=title, xlabel="weight on the base model")
  axes[0].set(ylabel="test accuracy")
  axes[2].legend()
  fig.tight_layout()
  path = out / "fisher_merging.png"
  _notebook.show(fig, path)
  print(
    f"wrote {path} ({jax.device_count()} {jax.default_backend()} device(s))"
  )


# %%
if __name__ == "__main__":
  _notebook.run(main)
