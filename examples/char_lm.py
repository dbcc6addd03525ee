# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A char-level transformer LM on `pydoc_data.topics` (Flax NNX)
#
# Python ships its own help text (`pydoc_data.topics`, about 0.7 MB), so this
# language model needs no download. A small decoder-only transformer
# (`common.models.CharTransformer`) is trained with AdamW, FAdam and
# FISMO through `nnx.Optimizer`; we plot training loss and validation
# bits per character, then sample some text.
#
# On a GPU or TPU runtime, install the accelerator jax wheel first
# (`pip install -U "jax[cuda12]"` or `"jax[tpu]"`); nothing else changes.
# Run as a script: `python examples/char_lm.py --out_dir plots`.

# %%
import math
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

flags.DEFINE_integer("steps", 1000, "Training steps per optimizer.")
flags.DEFINE_integer("batch_size", 32, "Sequences per batch.")
flags.DEFINE_integer("context", 64, "Characters per sequence.")
flags.DEFINE_integer("d_model", 64, "Transformer width.")
flags.DEFINE_integer("layers", 2, "Transformer blocks.")
flags.DEFINE_integer("seed", 0, "Seed of the init and the batches.")
flags.DEFINE_string("out_dir", "example_outputs", "Where plots are written.")
flags.DEFINE_bool("small", False, "Tiny run (CI): few steps, tiny model.")
FLAGS = flags.FLAGS


# %% [markdown]
# ## The optimizers
# FISMO preconditions the hidden matrices: the MLP kernels and the attention
# kernels, whose `(d, heads, head_dim)` layout it reads as a `d x (heads *
# head_dim)` matrix through `models.hidden_dims`; embeddings, norms, biases
# and the head get Adam. All three share one warmup-cosine schedule (optax
# schedules work everywhere).


# %%
def optimizers(steps: int) -> dict[str, optax.GradientTransformation]:
  lr = optax.warmup_cosine_decay_schedule(0.0, 3e-3, max(1, steps // 10), steps)
  return {
    "AdamW": optax.adamw(lr, weight_decay=1e-2),
    "FAdam": fisher_optax.fadam(lr, weight_decay=1e-2),
    "FISMO": fisher_optax.fismo(
      lr,
      adam_learning_rate=lr,
      weight_decay=1e-2,
      fismo_weight_dimension_numbers=lambda p: models.hidden_dims(
        p, optax.contrib.MuonDimensionNumbers
      ),
    ),
  }


# %% [markdown]
# ## Training with `nnx.Optimizer`


# %%
def loss_fn(model, x, y):
  logits = model(x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@nnx.jit
def train_step(model, optimizer, x, y):
  loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def eval_loss(model, x, y):
  return loss_fn(model, x, y)


def sample(model, vocab, prompt, length, context, key):
  lookup = {c: i for i, c in enumerate(vocab)}
  ids = [lookup.get(c, 0) for c in prompt]
  step = nnx.jit(lambda m, window: m(window[None])[0, -1])
  for _ in range(length):
    window = jnp.asarray(ids[-context:], jnp.int32)
    key, sub = jax.random.split(key)
    ids.append(int(jax.random.categorical(sub, step(model, window) / 0.8)))
  return "".join(vocab[i] for i in ids)


def train(name, tx, vocab_size, train_ids, val, cfg):
  model = models.CharTransformer(
    vocab_size,
    d=cfg["d"],
    heads=4,
    layers=cfg["layers"],
    ffn=4 * cfg["d"],
    context=cfg["context"],
    rngs=nnx.Rngs(cfg["seed"]),
  )
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  batches = datasets.char_batches(
    train_ids, cfg["batch_size"], cfg["context"], seed=cfg["seed"]
  )
  losses, val_bpc = [], []
  for t in tqdm(range(cfg["steps"]), desc=name, leave=False):
    x, y = next(batches)
    losses.append(float(train_step(model, optimizer, x, y)))
    if (t + 1) % cfg["eval_every"] == 0 or t + 1 == cfg["steps"]:
      val_bpc.append((t + 1, float(eval_loss(model, *val)) / math.log(2)))
  return model, np.asarray(losses), np.asarray(val_bpc)


# %%
def main(argv):
  del argv
  small = FLAGS.small
  cfg = {
    "steps": 8 if small else FLAGS.steps,
    "batch_size": 8 if small else FLAGS.batch_size,
    "context": 16 if small else FLAGS.context,
    "d": 16 if small else FLAGS.d_model,
    "layers": 1 if small else FLAGS.layers,
    "seed": FLAGS.seed,
  }
  cfg["eval_every"] = max(1, cfg["steps"] // 10)
  ids, vocab = datasets.load_pydoc_topics()
  train_ids, val_ids = datasets.char_split(ids)
  val = datasets.char_eval_windows(
    val_ids, cfg["context"], max_windows=16 if small else 256
  )
  print(f"{len(ids):,} characters, vocabulary {len(vocab)}")

  results = {}
  for name, tx in optimizers(cfg["steps"]).items():
    results[name] = train(name, tx, len(vocab), train_ids, val, cfg)
    print(f"{name:>6}: validation {results[name][2][-1, 1]:.3f} bits/char")

  best = min(results, key=lambda n: results[n][2][-1, 1])
  text = sample(
    results[best][0],
    vocab,
    "The ",
    12 if small else 200,
    cfg["context"],
    jax.random.key(FLAGS.seed),
  )
  print(f"\nsample from the {best} model:\n{text}")

  out = pathlib.Path(FLAGS.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
  window = max(1, cfg["steps"] // 30)
  for name, (_, losses, val_bpc) in results.items():
    ax1.plot(
      np.convolve(losses, np.ones(window) / window, mode="valid"), label=name
    )
    ax2.plot(val_bpc[:, 0], val_bpc[:, 1], marker=".", label=name)
  ax1.set(xlabel="step", ylabel="train loss (nats, smoothed)")
  ax2.set(xlabel="step", ylabel="validation bits / char")
  ax1.legend()
  fig.tight_layout()
  path = out / "char_lm.png"
  _notebook.show(fig, path)
  print(
    f"wrote {path} ({jax.device_count()} {jax.default_backend()} device(s))"
  )


# %%
if __name__ == "__main__":
  _notebook.run(main)
