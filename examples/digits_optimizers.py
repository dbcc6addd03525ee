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
# # Digits in Flax NNX: AdamW, FAdam, FISMO and Natural GaLore side by side
#
# Every fisher_optax optimizer is an ordinary optax transformation, so it goes
# straight into `nnx.Optimizer`. This example trains the same MLP on
# scikit-learn's digits (bundled, no download) with four optimizers and plots
# their training loss and test accuracy.
#
# On a GPU or TPU runtime, install the accelerator jax wheel first
# (`pip install -U "jax[cuda12]"` or `"jax[tpu]"`); nothing else changes.
# Run as a script: `python examples/digits_optimizers.py --out_dir plots`.

# %%
import pathlib

import _notebook
from absl import flags
from common import datasets
from common import models
from flax import nnx
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from tqdm.auto import tqdm

import fisher_optax

flags.DEFINE_integer("steps", 600, "Training steps per optimizer.")
flags.DEFINE_integer("batch_size", 64, "Mini-batch size.")
flags.DEFINE_integer("seed", 0, "Seed of the split, the init and the batches.")
flags.DEFINE_string("out_dir", "example_outputs", "Where plots are written.")
flags.DEFINE_bool("small", False, "Tiny run (CI): few steps.")
FLAGS = flags.FLAGS

# %% [markdown]
# ## The optimizers
# Settings are the tuned ones of `benchmarks/` (AdamW and FAdam: a
# learning-rate x weight-decay grid on validation NLL; FISMO: Muon's best
# digits lr and the damping of its sweep on digits). See
# `benchmarks/REPORT.md` for the seeded comparisons.
# FISMO and Natural GaLore act on the 2-D kernels; the 1-D biases fall back
# to Adam, as in `optax.contrib.muon` / `optax.contrib.galore`.


# %%
def optimizers() -> dict[str, optax.GradientTransformation]:
  return {
    "AdamW": optax.adamw(3e-3, weight_decay=0.5),
    "FAdam": fisher_optax.fadam(3e-3, weight_decay=0.1),
    # Small MLP classifiers want more damping than language models (10
    # against the default 1): see `fismo`'s docstring.
    "FISMO": fisher_optax.fismo(3e-3, adam_learning_rate=3e-3, damping=10.0),
    # AdamW's lr with damping 1 (far above the default 1e-3): see
    # `natural_galore`'s docstring.
    "Natural GaLore": fisher_optax.natural_galore(
      3e-3, rank=16, update_proj_gap=100, history_size=8, damping=1.0
    ),
  }


# %% [markdown]
# ## Training with `nnx.Optimizer`


# %%
def train(name, tx, data, steps, batch_size, seed):
  model = models.MLP((64, 128, 128, 10), rngs=nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def loss_fn(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @nnx.jit
  def step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss

  x_train, y_train = data["train"]
  rng = np.random.default_rng(seed)
  losses = []
  for _ in tqdm(range(steps), desc=name, leave=False):
    idx = rng.integers(0, len(x_train), batch_size)
    losses.append(float(step(model, optimizer, x_train[idx], y_train[idx])))
  x_test, y_test = data["test"]
  acc = float(jnp.mean(jnp.argmax(model(x_test), -1) == y_test))
  return np.asarray(losses), acc


# %%
def main(argv):
  del argv
  steps = 40 if FLAGS.small else FLAGS.steps
  data = datasets.load_digits(seed=FLAGS.seed)
  results = {}
  for name, tx in optimizers().items():
    results[name] = train(name, tx, data, steps, FLAGS.batch_size, FLAGS.seed)
    print(
      f"{name:>15}: final train loss {results[name][0][-10:].mean():.4f}"
      f"  test accuracy {results[name][1]:.3f}"
    )

  out = pathlib.Path(FLAGS.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
  window = max(1, steps // 30)
  for name, (losses, acc) in results.items():
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    ax1.plot(smooth, label=name)
    ax2.bar(name, acc)
  ax1.set(xlabel="step", ylabel="train loss (smoothed)", yscale="log")
  ax1.legend()
  ax2.set(ylabel="test accuracy", ylim=(0.8, 1.0))
  ax2.tick_params(axis="x", rotation=20)
  fig.tight_layout()
  path = out / "digits_optimizers.png"
  _notebook.show(fig, path)
  print(
    f"wrote {path} ({jax.device_count()} {jax.default_backend()} device(s))"
  )


# %%
if __name__ == "__main__":
  _notebook.run(main)
