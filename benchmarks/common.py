# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Shared benchmark harness: models, training loops, timing ratios, reports.

Every benchmark script imports this module (run scripts from the repository
root: ``python -m benchmarks.<name>``). Conventions:

* Speed is reported as a **ratio** against the optax/peer baseline measured in
  the same process, in interleaved rounds, as the median of within-round
  ratios (robust to a noisy, shared CPU). Absolute times are indicative only.
* Memory is XLA's temp + output bytes of the compiled function, or the bytes
  of an optimizer state pytree.
* Quality is mean ± std over seeds; every run records its settings.
* Results go to ``benchmarks/results/<name>.json`` and ``<name>.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
import dataclasses
import json
import math
import os
import pathlib
import platform
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples.common import models

PyTree = Any
RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


# -- models: re-exported from the package so the demo, examples and
# benchmarks share one definition.
MLP = models.MLP
CharTransformer = models.CharTransformer
functional = models.functional
digits_mlp = models.digits_mlp
char_transformer = models.char_transformer


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), labels
  ).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return jnp.mean(jnp.argmax(logits, -1) == labels)


# -- training -------------------------------------------------------------


def make_train_step(
  apply_fn: Callable[..., Any],
  tx: optax.GradientTransformation,
  loss: Callable[[jax.Array, jax.Array], jax.Array] = cross_entropy,
  extra_args_fn: Callable[..., dict[str, Any]] | None = None,
):
  """A jitted ``step(params, opt_state, batch) -> (params, opt_state, loss)``.

  ``extra_args_fn(params, batch)`` may return extra keyword arguments for
  ``tx.update`` (e.g. ``per_example_grads``).
  """

  def objective(params, batch):
    x, y = batch
    return loss(apply_fn(params, x), y)

  @jax.jit
  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(objective)(params, batch)
    extras = extra_args_fn(params, batch) if extra_args_fn else {}
    updates, opt_state = tx.update(grads, opt_state, params, **extras)
    return optax.apply_updates(params, updates), opt_state, value

  return step


def minibatches(
  x: np.ndarray,
  y: np.ndarray,
  batch_size: int,
  seed: int,
  drop_last: bool = True,
) -> Iterable[tuple[np.ndarray, np.ndarray]]:
  """Endless shuffled epochs of ``(x, y)`` mini-batches."""
  rng = np.random.default_rng(seed)
  n = len(x)
  while True:
    perm = rng.permutation(n)
    stop = n - batch_size + 1 if drop_last else n
    for i in range(0, stop, batch_size):
      idx = perm[i : i + batch_size]
      yield x[idx], y[idx]


def evaluate(
  apply_fn,
  params,
  x,
  y,
  batch_size: int = 512,
  loss: Callable[[jax.Array, jax.Array], jax.Array] = cross_entropy,
) -> dict[str, float]:
  """Mean loss and accuracy over a dataset, in batches."""
  f = jax.jit(
    lambda p, a, b: (
      loss(apply_fn(p, a), b) * len(a),
      accuracy(apply_fn(p, a), b) * len(a),
    )
  )
  tot_loss = tot_acc = 0.0
  for i in range(0, len(x), batch_size):
    l, a = f(params, x[i : i + batch_size], y[i : i + batch_size])
    tot_loss += float(l)
    tot_acc += float(a)
  return {"loss": tot_loss / len(x), "accuracy": tot_acc / len(x)}


# -- timing and memory -------------------------------------------------------


def block(tree: PyTree) -> PyTree:
  return jax.tree.map(
    lambda x: x.block_until_ready() if hasattr(x, "block_until_ready") else x,
    tree,
  )


def time_ratios(
  fns: dict[str, Callable[[], Any]],
  baseline: str,
  *,
  rounds: int = 15,
  inner: int = 3,
  warmup: int = 2,
) -> dict[str, dict[str, float]]:
  """Times zero-argument callables in interleaved rounds.

  Each round runs every function ``inner`` times (after ``warmup`` calls at
  the start) and records its per-call wall time; the ratio of a function is
  the median over rounds of its time divided by the baseline's time in the
  same round.

  Returns:
    ``{name: {"median_s": ..., "ratio": ...}}``.
  """
  if baseline not in fns:
    raise ValueError(f"baseline {baseline!r} is not among {list(fns)}.")
  for f in fns.values():
    for _ in range(warmup):
      block(f())
  per_round: dict[str, list[float]] = {k: [] for k in fns}
  for _ in range(rounds):
    for name, f in fns.items():
      t0 = time.perf_counter()
      for _ in range(inner):
        out = f()
      block(out)
      per_round[name].append((time.perf_counter() - t0) / inner)
  base = per_round[baseline]
  return {
    name: {
      "median_s": statistics.median(ts),
      "ratio": statistics.median(t / b for t, b in zip(ts, base)),
    }
    for name, ts in per_round.items()
  }


def _donated_step(tx: optax.GradientTransformation) -> Callable[..., Any]:
  """``update`` + ``apply_updates``, jitted with params and state donated."""

  def step(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  return jax.jit(step, donate_argnums=(0, 1))


def donated_step_runner(
  tx: optax.GradientTransformation, params: Any, grads: Any
) -> Callable[[], Any]:
  """A zero-argument callable doing one donated, jitted step per call."""
  jitted = _donated_step(tx)
  holder = {"p": jax.tree.map(jnp.copy, params)}
  holder["s"] = tx.init(holder["p"])

  def run():
    holder["p"], holder["s"] = jitted(holder["p"], holder["s"], grads)
    return holder["p"]

  return run


def compiled_donated_step(
  tx: optax.GradientTransformation, params: Any, grads: Any
) -> Any:
  """The step of :func:`donated_step_runner`, compiled (as timed, params and
  state donated: its intermediates are temporaries, where without donation
  some would live in the output buffers)."""
  return _donated_step(tx).lower(params, tx.init(params), grads).compile()


def temp_bytes(compiled: Any) -> int:
  """XLA temp bytes of a compiled function (-1 if unknown)."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return -1
  return int(getattr(analysis, "temp_size_in_bytes", -1))


def minor_faults_per_step(run: Callable[[], Any], steps: int = 5) -> float:
  """Minor page faults of this process per call of ``run`` (POSIX only)."""
  try:
    import resource  # noqa: PLC0415
  except ImportError:  # not on this platform
    return float("nan")
  jax.block_until_ready(run())
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(steps):
    jax.block_until_ready(run())
  after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  return (after - before) / steps


def compiled_memory_bytes(fn: Callable[..., Any], *args, **kwargs) -> int:
  """XLA temp bytes of ``jit(fn)`` compiled for these arguments (-1 if unknown)."""
  return temp_bytes(jax.jit(fn).lower(*args, **kwargs).compile())


def tree_bytes(tree: PyTree) -> int:
  """Bytes of all array leaves (works on ShapeDtypeStructs too)."""
  return int(
    sum(
      np.prod(x.shape) * jnp.dtype(x.dtype).itemsize
      for x in jax.tree.leaves(tree)
      if hasattr(x, "shape")
    )
  )


# -- statistics and reports ---------------------------------------------------


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
  xs = [float(x) for x in xs]
  if not xs:
    return float("nan"), float("nan")
  return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def fmt_mean_std(xs: Sequence[float], digits: int = 4) -> str:
  m, s = mean_std(xs)
  return f"{m:.{digits}f} ± {s:.{digits}f}"


def mean_se(xs: Sequence[float] | np.ndarray) -> tuple[float, float]:
  """Mean and standard error of the mean (0 for one value)."""
  a = np.asarray(xs, np.float64)
  se = float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else 0.0
  return float(a.mean()), se


def fmt_mean_se(xs: Sequence[float] | np.ndarray, digits: int = 4) -> str:
  m, s = mean_se(xs)
  return f"{m:.{digits}f} ± {s:.{digits}f}"


def paired_difference(
  a: Sequence[float], b: Sequence[float]
) -> tuple[float, float]:
  """Mean and standard error of ``a - b`` over paired seeds."""
  d = np.asarray(a, float) - np.asarray(b, float)
  se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
  return float(d.mean()), se


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
  lines = [
    "| " + " | ".join(header) + " |",
    "|" + "|".join("---" for _ in header) + "|",
  ]
  for r in rows:
    lines.append("| " + " | ".join(str(c) for c in r) + " |")
  return "\n".join(lines)


def environment() -> dict[str, Any]:
  """What a reader needs to interpret the numbers."""
  return {
    "jax": jax.__version__,
    "optax": optax.__version__,
    "backend": jax.default_backend(),
    "devices": [str(d) for d in jax.devices()],
    "cpu_count": os.cpu_count(),
    "python": platform.python_version(),
    "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
  }


def _jsonable(obj: Any) -> Any:
  if dataclasses.is_dataclass(obj):
    return dataclasses.asdict(obj)
  if isinstance(obj, (np.generic,)):
    return obj.item()
  if isinstance(obj, (np.ndarray, jax.Array)):
    return np.asarray(obj).tolist()
  raise TypeError(f"not JSON serialisable: {type(obj)}")


def write_results(
  name: str,
  data: dict[str, Any],
  markdown: str,
  out_dir: str | os.PathLike[str] | None = None,
) -> pathlib.Path:
  """Writes ``<name>.json`` (data + environment) and ``<name>.md``."""
  out = pathlib.Path(out_dir) if out_dir else RESULTS_DIR
  out.mkdir(parents=True, exist_ok=True)
  payload = {"name": name, "environment": environment(), **data}
  (out / f"{name}.json").write_text(
    json.dumps(payload, indent=2, default=_jsonable) + "\n"
  )
  (out / f"{name}.md").write_text(markdown.rstrip() + "\n")
  return out / f"{name}.md"
