# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""FAdam step time and state memory against optax.adamw.

A jitted optimizer step (``update`` + ``apply_updates``, params and state
donated) on ~10M float32 parameters in the leaves of a small transformer
(embedding, attention and MLP matrices, norms, biases). Timing is interleaved
in one process; the result is the median of per-round time ratios to
``optax.adamw``. Run from the repository root::

  python -m benchmarks.fadam_speed            # ~10M params
  python -m benchmarks.fadam_speed --small    # seconds-long smoke run
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import common
import fisher_optax

_SMALL = flags.DEFINE_bool("small", False, "Tiny model, few rounds (smoke).")
_ROUNDS = flags.DEFINE_integer("rounds", 15, "Interleaved timing rounds.")
_INNER = flags.DEFINE_integer("inner", 5, "Steps per function per round.")
_OUT = flags.DEFINE_string("out_dir", None, "Results dir (default results/).")

NAME = "fadam_speed"


def make_params(
  d: int, vocab: int, layers: int, seed: int = 0
) -> dict[str, Any]:
  """Leaves of a decoder-only transformer: a realistic mix of shapes."""
  rng = np.random.default_rng(seed)
  normal = lambda *s: jnp.asarray(rng.normal(size=s) * 0.02, jnp.float32)
  params: dict[str, Any] = {
    "embed": normal(vocab, d),
    "head": normal(d, vocab),
    "final_norm": jnp.ones((d,), jnp.float32),
  }
  for i in range(layers):
    params[f"layer{i}"] = {
      "qkv": normal(d, 3 * d),
      "attn_out": normal(d, d),
      "mlp_in": normal(d, 4 * d),
      "mlp_in_bias": jnp.zeros((4 * d,)),
      "mlp_out": normal(4 * d, d),
      "norm1": jnp.ones((d,)),
      "norm2": jnp.ones((d,)),
    }
  return params


def make_runner(
  tx: optax.GradientTransformation, params: Any, grads: Any
) -> tuple[Callable[[], Any], Callable[..., Any]]:
  """A zero-argument callable doing one donated, jitted step per call."""

  def step(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  jitted = jax.jit(step, donate_argnums=(0, 1))
  holder = {"p": jax.tree.map(jnp.copy, params)}
  holder["s"] = tx.init(holder["p"])

  def run():
    holder["p"], holder["s"] = jitted(holder["p"], holder["s"], grads)
    return holder["p"]

  return run, step


def main(argv):
  del argv
  if _SMALL.value:
    d, vocab, layers, rounds, inner = 64, 256, 2, 3, 2
  else:
    d, vocab, layers, rounds, inner = 512, 4096, 2, _ROUNDS.value, _INNER.value
  params = make_params(d, vocab, layers)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  rng = np.random.default_rng(1)
  grads = jax.tree.map(
    lambda x: jnp.asarray(rng.normal(size=x.shape) * 1e-3, jnp.float32), params
  )
  optimizers = {
    "optax.adamw": optax.adamw(1e-3, weight_decay=0.1),
    "optax.adam": optax.adam(1e-3),
    "fisher_optax.fadam": fisher_optax.fadam(1e-3),
    "fadam (weight_decay=0)": fisher_optax.fadam(1e-3, weight_decay=0.0),
  }
  runners, state_bytes, temp_bytes = {}, {}, {}
  for name, tx in optimizers.items():
    runners[name], step = make_runner(tx, params, grads)
    state_bytes[name] = common.tree_bytes(jax.eval_shape(tx.init, params))
    temp_bytes[name] = common.compiled_memory_bytes(
      step, params, tx.init(params), grads
    )
  timings = common.time_ratios(
    runners, "optax.adamw", rounds=rounds, inner=inner
  )
  rows = []
  for name in optimizers:
    rows.append(
      [
        name,
        f"{timings[name]['ratio']:.3f}",
        f"{timings[name]['median_s'] * 1e3:.2f}",
        f"{state_bytes[name] / 2**20:.1f}",
        f"{state_bytes[name] / state_bytes['optax.adamw']:.2f}",
        f"{temp_bytes[name] / 2**20:.1f}" if temp_bytes[name] >= 0 else "n/a",
      ]
    )
  table = common.markdown_table(
    [
      "optimizer",
      "step time / adamw (median)",
      "median step (ms)",
      "state (MiB)",
      "state / adamw",
      "XLA temp (MiB)",
    ],
    rows,
  )
  env = common.environment()
  md = (
    f"### FAdam step time and memory ({n_params / 1e6:.1f}M float32 params,"
    f" {len(jax.tree.leaves(params))} leaves, {env['backend']})\n\n"
    f"{table}\n\n"
    f"Jitted `update` + `apply_updates` with donated params/state; "
    f"{rounds} interleaved rounds x {inner} steps, ratio = median of "
    "per-round ratios to `optax.adamw` in the same process. Absolute times "
    "on a shared CPU are indicative only.\n"
  )
  common.write_results(
    NAME,
    {
      "n_params": int(n_params),
      "rounds": rounds,
      "inner": inner,
      "small": _SMALL.value,
      "timings": timings,
      "state_bytes": state_bytes,
      "xla_temp_bytes": temp_bytes,
    },
    md,
    out_dir=_OUT.value,
  )
  print(md)


if __name__ == "__main__":
  app.run(main)
