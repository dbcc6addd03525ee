# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""FAdam step time and state memory against optax.adamw.

A jitted optimizer step (``update`` + ``apply_updates``, params and state
donated) on ~10M float32 parameters in the leaves of a small transformer
(embedding, attention and MLP matrices, norms, biases). Timing is interleaved
in one process; the result is the median of per-round time ratios to
``optax.adamw``. A second table times the plain jitted ``update`` (nothing
donated), the form a quick measurement usually takes.

Floor: FAdam needs RMS(g) before ``d``, then RMS(g / d) and RMS(theta / d)
before the state pass, so at best it reads ``g`` (1), then ``g, fim,
theta`` (3), then reads ``g, mu, fim, theta`` and writes ``mu, fim`` and the
output or the params (7): 11 passes over the parameters, against AdamW's 7
(read ``g, mu, nu, theta``, write ``mu, nu`` and the output): 11/7 = 1.57.
Run from the repository root::

  python -m benchmarks.fadam_speed            # ~10M params
  python -m benchmarks.fadam_speed --small    # seconds-long smoke run
"""

from __future__ import annotations

from collections.abc import Callable
import functools
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


def make_plain_runner(
  tx: optax.GradientTransformation, params: Any, grads: Any
) -> Callable[[], Any]:
  """A zero-argument callable doing one jitted ``update`` (nothing donated)."""
  update = jax.jit(tx.update)
  state = tx.init(params)
  return lambda: update(grads, state, params)[0]


FLOOR = 11 / 7
# Passes over the parameters relative to AdamW's 7 (without decay FAdam
# neither reduces nor reads theta / d: 1 + 2 + 6).
FLOORS = {
  "optax.adamw": 1.0,
  "optax.adam": 6 / 7,
  "fisher_optax.fadam": FLOOR,
  "fadam (weight_decay=0)": 9 / 7,
}
ANATOMY = (
  "The reductions alone (the table above, the largest leaf, measured in "
  "the same run). FAdam's RMS of g / d, with d formed from g and the old "
  "Fisher, costs {ms_n:.1f}x a plain two-input sum, and RMS(theta / d) "
  "{ms_w:.1f}x, while the same arithmetic as an elementwise loop that also "
  "writes g / d costs {written:.1f}x. XLA:CPU gives reductions to YNNPACK, "
  "which runs them on both cores (1.9x slower pinned to one, on a "
  "10M-element leaf) but evaluates each elementwise operation of the fused "
  "chain (new Fisher, square root, epsilon, divide, square: about 8) as "
  "its own pass over a tile, so a reduction's time grows with its "
  "operation count, where XLA's loop emitter keeps the chain in registers. "
  "XLA's own reduce emitter (`--xla_cpu_experimental_ynn_fusion_type=`) is "
  "3-10x slower still. Scaled to all {n:.1f}M parameters the three "
  "reductions take about {total:.1f} ms of the {step:.1f} ms step, against "
  "{adamw:.1f} ms for AdamW's whole step: {left}. Two "
  "ways round them were measured and not kept: both RMS from one reduction "
  "of a stacked (2, n) operand (5-7x slower) or a variadic reduce (XLA's "
  "emitter, above); and a loop over cache-sized chunks that forms d once "
  "per chunk with the loop emitter and reduces both RMS from it (7.7-8 ms "
  "against 11.7 ms for the two on a 10M-element leaf), which would be a "
  "second, CPU-only code path whose loop over a leaf's elements defeats "
  "sharded parameters and GPU/TPU reductions."
)
GAP = (
  "Reading the gap (XLA:CPU, from the compiled HLO, its buffer assignment "
  "and getrusage). XLA:CPU does not fuse two outputs into one sweep, and "
  "keeps in memory any elementwise value that two fusions read; FAdam "
  "therefore recomputes the new Fisher and the denominator in each sweep "
  "rather than sharing them. As compiled, that is the bytes column: every "
  "pass the fusions make, from XLA's own cost analysis, relative to AdamW's "
  "(about 1.85x with weight decay, 1.45x without, against the 1.57x and "
  "1.29x floors). The temp column is the skipped-step branch's one-byte "
  "finiteness masks, allocated but not touched on a finite step (hence no "
  "page faults). Until this release FAdam shared those values between "
  "sweeps: with params and state donated they became temporaries twice the "
  "size of the parameters, mapped fresh and page-faulted at every step, "
  "and the donated step took 6.1x AdamW's time (5.2x without decay). "
  "The time above the bytes is arithmetic. A profiler trace of the donated "
  "step (jax.profiler, 20 steps) put 22 of 38 ms of kernel time in the "
  "three RMS reductions, YNNPACK reduce fusions that take a square root "
  "and a divide per element (next table); as compiled, a matrix leaf "
  "costs 4 square roots and 4 divides per element against AdamW's 1 and 2, "
  "so on this CPU the step is bound by them rather than by memory passes. "
  "One variadic reduce for the two RMS sweeps that share the denominator "
  "cut the bytes to 1.65x but ran slower (3.6x: XLA's own reduce emitter)."
)


def reduction_anatomy(n: int, rounds: int, inner: int) -> dict[str, Any]:
  """Times FAdam's RMS reductions on one ``n``-element leaf against plain
  sums of the same inputs and against the same arithmetic written out
  elementwise (in place), each jitted alone."""
  rng = np.random.default_rng(2)
  g, f, theta = (jnp.asarray(rng.random(n, np.float32) + 0.1) for _ in range(3))
  b, eps = 0.999, 1e-8
  d = lambda g, f: jnp.sqrt(b * f + (1 - b) * g * g) + eps
  fns = {
    "sum(g + f): two reads": lambda g, f, t: jnp.sum(g + f),
    "sum(g): one read": lambda g, f, t: jnp.sum(g),
    "ms(g / d), d from g and f (FAdam)": lambda g, f, t: jnp.mean(
      jnp.square(g / d(g, f))
    ),
    "ms(theta / d) (FAdam)": lambda g, f, t: jnp.mean(jnp.square(t / d(g, f))),
  }
  runs = {k: functools.partial(jax.jit(v), g, f, theta) for k, v in fns.items()}
  held = {"out": jnp.copy(f)}
  written = jax.jit(lambda o, g: g / d(g, o), donate_argnums=0)

  def elementwise():
    held["out"] = written(held["out"], g)
    return held["out"]

  runs["g / d written in place (elementwise)"] = elementwise
  return common.time_ratios(
    runs, "sum(g + f): two reads", rounds=rounds, inner=inner
  )


def anatomy_text(
  anatomy: dict[str, Any], timings: dict[str, Any], biggest: int, n: int
) -> str:
  """:data:`ANATOMY` with this run's numbers."""
  ratio = lambda k: anatomy[k]["ratio"]
  rms = [k for k in anatomy if k.startswith(("sum(g):", "ms("))]
  total = sum(anatomy[k]["median_s"] for k in rms) * n / biggest * 1e3
  adamw = timings["optax.adamw"]["median_s"] * 1e3
  return ANATOMY.format(
    ms_n=ratio("ms(g / d), d from g and f (FAdam)"),
    ms_w=ratio("ms(theta / d) (FAdam)"),
    written=ratio("g / d written in place (elementwise)"),
    n=n / 1e6,
    total=total,
    step=timings["fisher_optax.fadam"]["median_s"] * 1e3,
    adamw=adamw,
    left=(
      f"with reductions at this rate, 1.6x would leave FAdam's output "
      f"sweeps {(FLOOR * adamw - total) / adamw:.0%} of AdamW's time"
      if FLOOR * adamw > total
      else "on their own they are past 1.6x AdamW's step"
    ),
  )


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
  runners, state_bytes, temp_bytes, accessed = {}, {}, {}, {}
  for name, tx in optimizers.items():
    runners[name] = common.donated_step_runner(tx, params, grads)
    state_bytes[name] = common.tree_bytes(jax.eval_shape(tx.init, params))
    compiled = common.compiled_donated_step(tx, params, grads)
    temp_bytes[name] = common.temp_bytes(compiled)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    accessed[name] = float((cost or {}).get("bytes accessed", float("nan")))
  faults = {
    name: common.minor_faults_per_step(run) for name, run in runners.items()
  }
  timings = common.time_ratios(
    runners, "optax.adamw", rounds=rounds, inner=inner
  )
  plain = common.time_ratios(
    {
      name: make_plain_runner(optimizers[name], params, grads)
      for name in ("optax.adamw", "fisher_optax.fadam")
    },
    "optax.adamw",
    rounds=rounds,
    inner=inner,
  )
  biggest = max(leaf.size for leaf in jax.tree.leaves(params))
  anatomy = reduction_anatomy(biggest, rounds, inner)
  rows = []
  for name in optimizers:
    rows.append(
      [
        name,
        f"{timings[name]['ratio']:.3f}",
        f"{FLOORS[name]:.2f}",
        f"{accessed[name] / accessed['optax.adamw']:.2f}",
        f"{timings[name]['median_s'] * 1e3:.2f}",
        f"{state_bytes[name] / 2**20:.1f}",
        f"{state_bytes[name] / state_bytes['optax.adamw']:.2f}",
        f"{temp_bytes[name] / 2**20:.1f}" if temp_bytes[name] >= 0 else "n/a",
        f"{faults[name]:.0f}",
      ]
    )
  table = common.markdown_table(
    [
      "optimizer",
      "step time / adamw (median)",
      "floor (passes)",
      "bytes accessed as compiled / adamw",
      "median step (ms)",
      "state (MiB)",
      "state / adamw",
      "XLA temp, donated (MiB)",
      "page faults / step",
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
    "on a shared CPU are indicative only. Floor: 11/7 passes over the "
    "parameters (see the script's docstring).\n\n"
    + common.markdown_table(
      [
        "plain jitted update (not donated)",
        "update time / adamw (median)",
        "floor (passes)",
        "median update (ms)",
      ],
      [
        [
          name,
          f"{plain[name]['ratio']:.3f}",
          f"{FLOORS[name]:.2f}",
          f"{plain[name]['median_s'] * 1e3:.2f}",
        ]
        for name in plain
      ],
    )
    + "\n\n"
    + GAP
    + "\n\n"
    + common.markdown_table(
      [
        f"one {biggest / 1e6:.1f}M-element leaf, jitted alone",
        "time / two-read sum (median)",
        "median (ms)",
      ],
      [
        [name, f"{v['ratio']:.2f}", f"{v['median_s'] * 1e3:.3f}"]
        for name, v in anatomy.items()
      ],
    )
    + "\n\n"
    + anatomy_text(anatomy, timings, biggest, n_params)
    + "\n"
  )
  common.write_results(
    NAME,
    {
      "n_params": int(n_params),
      "rounds": rounds,
      "inner": inner,
      "small": _SMALL.value,
      "timings": timings,
      "plain_update_timings": plain,
      "floor_ratio": FLOOR,
      "floors": FLOORS,
      "state_bytes": state_bytes,
      "xla_temp_bytes": temp_bytes,
      "xla_bytes_accessed": accessed,
      "minor_page_faults_per_step": faults,
      "reduction_anatomy": anatomy,
    },
    md,
    out_dir=_OUT.value,
  )
  print(md)


if __name__ == "__main__":
  app.run(main)
