# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Fisher engine cost: each estimator against one jitted batch gradient.

Models (float32, softmax cross-entropy, 10 classes): the MLP 784-512-512-10
(NNX), a small Linen transformer on Flax's own layers (token and learned
positional embeddings, ``MultiHeadDotProductAttention``, ``LayerNorm``, an
MLP; 32 tokens per example, so every kernel is weight-shared over positions),
the same transformer with its blocks stacked by ``nn.scan`` over
``nn.remat`` (every block leaf ``(layers, ...)``), a small Linen CNN (two
convolutions and a dense head) and the same CNN with two more convolutions
stacked by ``nn.scan`` over ``nn.remat``. For each batch
size, every estimator returns the mean gradient and its statistic, and is
timed against ``jax.value_and_grad`` of the mean loss in the same process
(interleaved rounds, median of within-round ratios). Rows:

* ``fisher.diagonal`` for kinds empirical / mc (1 sample) / exact, by
  ``method="auto"`` (layer statistics) and ``method="per_example"``
  (``vmap`` of one-example VJPs, chunked);
* ``fisher.kronecker`` (K-FAC factors from layer statistics, of the
  empirical and the exact Fisher; Shampoo-style factors from per-example
  gradients);
* ``fisher.low_rank(rank=8)`` (Gram matrix from layer statistics or from the
  stacked per-example gradients);
* ``taps one pass``: the diagonal empirical Fisher and the gradient from one
  forward and one backward pass (``_taps.record(...).gradient``), the floor
  the engine can reach.

Each ratio has its floor: the flops the estimator's math needs over the
batch gradient's, counted over the model's contractions (``Site``: a
``k -> o`` matmul at ``rows`` positions per example; ``P`` = the sum of
``rows k o``, ``P'`` the same over the layers that carry the cotangent on to
their input). The gradient is ``2 B P`` forward, ``2 B P`` for the weights
and ``2 B P'`` backward, plus attention scores (``4 T^2 d`` forward, twice
that backward, per block) and, under ``nn.remat``, the blocks' forward
again; a diagonal adds ``2 B P`` (``(a^2)^T delta^2``, or the per-example
products of a weight-shared layer); each further cotangent (MC sample,
class of the exact Fisher) another backward pass, and with weight sharing
its own per-example products; K-FAC ``2 B rows (k^2 + o^2)`` per layer,
one input factor for q, k and v (the exact kind: one output factor per
class, after its backward pass); top-k low rank (dense layers only) the
ghost Gram ``2 B^2 (k + o)`` per layer and ``2 k B P`` to form its ``k``
directions. A ratio under its floor means the estimator's matmuls run
closer to the machine's peak than the gradient's own.

Memory is XLA's temp bytes of the compiled function. Run from the repository
root::

  python -m benchmarks.fisher_engine           # full run
  python -m benchmarks.fisher_engine --small   # smoke run, B=8 (3-4 min on 2 CPU cores: ~100 compiles)
  python -m benchmarks.fisher_engine --models=cnn --merge  # one model again
  python -m benchmarks.fisher_engine --memory_only --merge  # temp MB @2048
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import json
import pathlib
from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.engine_models import NUM_CLASSES
from benchmarks.engine_models import flop_floors
from benchmarks.engine_models import make_model
from benchmarks.engine_models import model_sites
from fisher_optax import fisher
from fisher_optax.fisher import _taps

_SMALL = flags.DEFINE_bool("small", False, "Tiny models, few rounds (smoke).")
_ROUNDS = flags.DEFINE_integer("rounds", 9, "Interleaved rounds (fast rows).")
_SLOW_ROUNDS = flags.DEFINE_integer(
  "slow_rounds", 3, "Interleaved rounds for the per-example rows."
)
_CHUNK = flags.DEFINE_integer("chunk", 32, "Per-example path chunk size.")
_BATCHES = flags.DEFINE_list(
  "batches", ["32", "128", "512"], "Batch sizes (full run)."
)
_MEMORY_BATCHES = flags.DEFINE_list(
  "memory_batches",
  ["2048"],
  "Larger batch sizes where only XLA's temp bytes are read (compiled, not "
  "run), for the layer-path rows: whether memory grows with B beyond the "
  "gradient's.",
)
_MEMORY_ONLY = flags.DEFINE_bool(
  "memory_only",
  False,
  "Only the --memory_batches rows, compiled (with --merge: every timed row "
  "kept as stored).",
)
_MODELS = flags.DEFINE_list(
  "models",
  ["mlp", "transformer", "transformer_scan", "cnn", "cnn_scan"],
  "Models to run.",
)
_MERGE = flags.DEFINE_bool(
  "merge", False, "Keep the stored rows of the models not run this time."
)
_ONLY = flags.DEFINE_list(
  "only",
  [],
  "Estimators to measure (default all). With --merge, the stored rows of "
  "the other estimators, batch gradient included, are kept.",
)
_OUT = flags.DEFINE_string("out_dir", None, "Results dir (default results/).")

NAME = "fisher_engine"


def estimators(apply_fn, chunk: int) -> dict[str, tuple[Callable, bool]]:
  """name -> (fn(params, x, y, key), slow). Each returns grad + statistic."""
  cat = fisher.Categorical()

  def diag(kind, method):
    return lambda p, x, y, k: fisher.diagonal(
      apply_fn,
      p,
      (x, y),
      likelihood=cat,
      kind=kind,
      key=k,
      method=method,
      chunk_size=chunk if method == "per_example" else None,
    )

  def kron(method, kind="empirical"):
    est = "auto" if method == "auto" else "shampoo"
    return lambda p, x, y, k: fisher.kronecker(
      apply_fn,
      p,
      (x, y),
      likelihood=cat,
      kind=kind,
      key=k,
      estimator=est,
      method=method,
      chunk_size=chunk if method == "per_example" else None,
    )

  def low_rank(method):
    return lambda p, x, y, k: fisher.low_rank(
      apply_fn,
      p,
      (x, y),
      likelihood=cat,
      kind="empirical",
      rank=8,
      method=method,
      chunk_size=chunk if method == "per_example" else None,
    )

  def one_pass(p, x, y, k):
    del k
    tape = _taps.record(apply_fn, p, x, statistic="diag", ordered=True)
    logits = tape.outputs
    r = (jax.nn.softmax(logits) - jax.nn.one_hot(y, NUM_CLASSES)) / len(y)
    grad, lg = tape.gradient(r)
    return grad, lg.statistics("diag")

  return {
    "diag empirical / auto": (diag("empirical", "auto"), False),
    "diag mc-1 / auto": (diag("mc", "auto"), False),
    "diag exact / auto": (diag("exact", "auto"), False),
    "kron (K-FAC) / auto": (kron("auto"), False),
    "kron exact (K-FAC) / auto": (kron("auto", "exact"), True),
    "top-8 low rank / auto": (low_rank("auto"), False),
    "taps one pass (grad + diag emp.)": (one_pass, False),
    "diag empirical / per_example": (diag("empirical", "per_example"), True),
    "diag mc-1 / per_example": (diag("mc", "per_example"), True),
    "diag exact / per_example": (diag("exact", "per_example"), True),
    "kron (Shampoo) / per_example": (kron("per_example"), True),
    "top-8 low rank / per_example": (low_rank("per_example"), True),
  }


def run_one(
  model_name: str,
  batch: int,
  small: bool,
  chunk: int,
  rounds: int,
  slow_rounds: int,
) -> list[dict[str, Any]]:
  apply_fn, params, in_shape = make_model(model_name, small)
  rng = np.random.default_rng(batch)
  if model_name.startswith("transformer"):  # token ids
    x = jnp.asarray(rng.integers(0, 256, size=(batch,) + in_shape), jnp.int32)
  else:
    x = jnp.asarray(rng.normal(size=(batch,) + in_shape), jnp.float32)
  y = jnp.asarray(rng.integers(0, NUM_CLASSES, size=batch), jnp.int32)
  key = jax.random.key(1)

  def loss(p, x, y):
    return common.cross_entropy(apply_fn(p, x), y)

  base = jax.value_and_grad(loss)
  fns = {"batch gradient": (lambda p, x, y, k: base(p, x, y), False)}
  fns.update(
    (k, v)
    for k, v in estimators(apply_fn, chunk).items()
    if not _ONLY.value or k in _ONLY.value
  )
  # Per-example exact costs C backprops per example: too slow past B = 128.
  skip = set()
  if batch > 128 and not small:
    skip = {
      "diag exact / per_example",
      "top-8 low rank / per_example",
      "kron (Shampoo) / per_example",
    }
  coverage = _taps.coverage(apply_fn, params, x)
  covered = sum(
    int(np.prod(l.shape))
    for l, c in zip(jax.tree.leaves(params), jax.tree.leaves(coverage))
    if c
  )
  total = sum(int(np.prod(l.shape)) for l in jax.tree.leaves(params))

  sites, extra = model_sites(model_name, params, in_shape)
  floors = flop_floors(sites, batch, **extra)
  rows: dict[str, dict[str, Any]] = {}
  jitted = {}
  for name, (fn, slow) in fns.items():
    mem = common.compiled_memory_bytes(fn, params, x, y, key)
    rows[name] = {
      "model": model_name,
      "batch": batch,
      "estimator": name,
      "temp_mb": mem / 2**20,
      "slow": slow,
      "covered_fraction": covered / total,
      "sizes": "-".join(
        [str(in_shape[0])]
        + [str(l.shape[-1]) for l in jax.tree.leaves(params) if l.ndim == 1]
      )
      if model_name == "mlp"
      else "",
      "num_params": total,
      "floor": floors.get(name),
    }
    if name not in skip:
      jitted[name] = functools.partial(jax.jit(fn), params, x, y, key)

  fast = {k: f for k, f in jitted.items() if not fns[k][1]}
  slow = {k: f for k, f in jitted.items() if fns[k][1]}
  slow["batch gradient"] = jitted["batch gradient"]
  for group, nr, inner in ((fast, rounds, 3), (slow, slow_rounds, 1)):
    res = common.time_ratios(
      group, "batch gradient", rounds=nr, inner=inner, warmup=1
    )
    for k, v in res.items():
      if k == "batch gradient" and group is slow:
        continue
      rows[k].update(v)
  for k in skip & set(rows):
    rows[k].update({"median_s": None, "ratio": None})
  return list(rows.values())


def memory_rows(
  model_name: str, batch: int, small: bool, chunk: int
) -> list[dict[str, Any]]:
  """XLA's temp bytes of the batch gradient and every layer-path row at
  ``batch``, compiled only (``memory_only`` rows, no time)."""
  apply_fn, params, in_shape = make_model(model_name, small)
  if model_name.startswith("transformer"):
    x = jnp.zeros((batch,) + in_shape, jnp.int32)
  else:
    x = jnp.zeros((batch,) + in_shape, jnp.float32)
  y = jnp.zeros((batch,), jnp.int32)

  def loss(p, x, y):
    return common.cross_entropy(apply_fn(p, x), y)

  grad = jax.value_and_grad(loss)
  fns = {"batch gradient": lambda p, x, y, k: grad(p, x, y)}
  fns.update(
    (k, f)
    for k, (f, slow) in estimators(apply_fn, chunk).items()
    if not slow or "auto" in k  # every layer-path row, whatever --only
  )
  return [
    {
      "model": model_name,
      "batch": batch,
      "estimator": name,
      "temp_mb": common.compiled_memory_bytes(
        fn, params, x, y, jax.random.key(0)
      )
      / 2**20,
      "memory_only": True,
    }
    for name, fn in fns.items()
  ]


def _fmt_ratio(r):
  return "—" if r is None else (f"{r:.2f}x" if r < 20 else f"{r:.0f}x")


def to_markdown(
  rows: list[dict[str, Any]], batches: list[int], chunk: int
) -> str:
  out = []
  order = ["mlp", "transformer", "transformer_scan", "cnn", "cnn_scan"]
  for model in sorted({r["model"] for r in rows}, key=order.index):
    sub = [r for r in rows if r["model"] == model]
    timed = [r for r in sub if not r.get("memory_only")]
    batches_m = [b for b in batches if any(r["batch"] == b for r in timed)]
    mem_b = batches_m + sorted(
      {r["batch"] for r in sub if r.get("memory_only")} - set(batches_m)
    )
    frac = sub[0]["covered_fraction"]
    base = {
      r["batch"]: r["median_s"]
      for r in timed
      if r["estimator"] == "batch gradient"
    }
    header = (
      ["estimator / path"]
      + [f"B={b}" for b in batches_m]
      + [f"temp MB @{b}" for b in mem_b]
    )
    table = []
    order = ["batch gradient", *estimators(None, 1)]
    names = sorted({r["estimator"] for r in sub}, key=order.index)
    for name in names:
      by_b = {r["batch"]: r for r in sub if r["estimator"] == name}
      if all(by_b[b].get("memory_only") for b in by_b):
        continue  # a per-example row: not compiled at the memory batches
      cells = []
      for b in batches_m:
        r = by_b.get(b)
        if r is None:  # not measured yet in this run
          cells.append("…")
        elif name == "batch gradient":
          cells.append(f"{1e3 * base[b]:.2f} ms")
        else:
          cell = _fmt_ratio(r["ratio"])
          if r.get("floor") is not None:
            cell += f" ({r['floor']:.2f})"
          cells.append(cell)
      mems = [f"{by_b[b]['temp_mb']:.1f}" if b in by_b else "—" for b in mem_b]
      table.append([name] + cells + mems)
    title = {
      "mlp": "MLP (NNX, relu): " + sub[0]["sizes"],
      "cnn": "small CNN (Linen: 2 convs + dense head)",
      "cnn_scan": "the same CNN with two 16-channel 3x3 convs after the "
      "strided one, stacked by nn.scan over nn.remat",
      "transformer": "small transformer (Linen: 2 blocks of "
      "MultiHeadDotProductAttention + LayerNorm + MLP, d=128, T=32)",
      "transformer_scan": "the same transformer, blocks stacked by nn.scan "
      "over nn.remat",
    }[model]
    out.append(
      f"### {title}\n\nParameters on the layer path: "
      f"{100 * frac:.1f}% (the rest use the per-example path under "
      f'`method="auto"`). Per-example chunk: {chunk}. Ratios are '
      "wall time / the jitted batch gradient in the same process "
      "(median of within-round ratios); the batch-gradient row "
      "gives its absolute median time"
      + "; in parentheses, the flop floor (see the script's docstring)."
      + (
        " Temp memory at B="
        + "/".join(str(b) for b in mem_b[len(batches_m) :])
        + " is read from the compiled functions only (not run)."
        if len(mem_b) > len(batches_m)
        else ""
      )
      + "\n"
    )
    out.append(common.markdown_table(header, table))
    out.append("")
  return "\n".join(out)


def _stored_rows() -> list[dict[str, Any]]:
  path = pathlib.Path(_OUT.value or common.RESULTS_DIR) / f"{NAME}.json"
  return json.loads(path.read_text())["rows"] if path.exists() else []


def _stored_preamble() -> str:
  """The stored table's hand-written notes (all before its first model
  table), kept by a ``--merge`` run."""
  path = pathlib.Path(_OUT.value or common.RESULTS_DIR) / f"{NAME}.md"
  text = path.read_text() if path.exists() else ""
  return text.split("### ", 1)[0] if "### " in text else ""


def main(argv):
  del argv
  small = _SMALL.value
  batches = [8] if small else [int(b) for b in _BATCHES.value]
  rounds = 2 if small else _ROUNDS.value
  slow_rounds = 1 if small else _SLOW_ROUNDS.value
  chunk = 4 if small else _CHUNK.value
  rows, preamble = [], ""
  memory_only = _MEMORY_ONLY.value and not small
  if _MERGE.value and not small:
    only = set(_ONLY.value)
    rows = [
      r
      for r in _stored_rows()
      if r["model"] not in _MODELS.value
      or (only and r["estimator"] not in only)
      or (memory_only and not r.get("memory_only"))
    ]
    preamble = _stored_preamble()
  for model_name in _MODELS.value:
    for b in batches:
      if not memory_only:
        print(f"[{NAME}] {model_name} B={b}", flush=True)
        new = run_one(model_name, b, small, chunk, rounds, slow_rounds)
        if _ONLY.value and _MERGE.value and not small:
          # The stored rows' ratios refer to the stored gradient row.
          new = [r for r in new if r["estimator"] != "batch gradient"]
        rows.extend(new)
      if b == batches[-1]:  # after the timed batches: memory only
        for mb in [] if small else [int(v) for v in _MEMORY_BATCHES.value]:
          print(f"[{NAME}] {model_name} B={mb} (memory only)", flush=True)
          mem = memory_rows(model_name, mb, small, chunk)
          key = lambda r: (r["model"], r["batch"], r["estimator"])
          fresh = {key(r) for r in mem}  # replace stored ones (--merge)
          rows[:] = [r for r in rows if key(r) not in fresh] + mem
      # Written after every configuration, so a long run leaves its results.
      done = [bb for bb in batches if any(r["batch"] == bb for r in rows)]
      md = preamble + to_markdown(rows, done, chunk)
      data = {
        "settings": {
          "small": small,
          "batches": batches,
          "rounds": rounds,
          "slow_rounds": slow_rounds,
          "chunk": chunk,
        },
        "rows": rows,
      }
      path = common.write_results(
        NAME + ("_small" if small else ""), data, md, _OUT.value
      )
  print(md)
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
