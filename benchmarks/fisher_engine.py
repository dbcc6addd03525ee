# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Fisher engine cost: each estimator against one jitted batch gradient.

Models (float32, softmax cross-entropy, 10 classes): the MLP 784-512-512-10
(NNX), a small Linen transformer on Flax's own layers (token and learned
positional embeddings, ``MultiHeadDotProductAttention``, ``LayerNorm``, an
MLP; 32 tokens per example, so every kernel is weight-shared over positions),
the same transformer with its blocks stacked by ``nn.scan`` over
``nn.remat`` (every block leaf ``(layers, ...)``) and a small Linen CNN (two
convolutions and a dense head). For each batch
size, every estimator returns the mean gradient and its statistic, and is
timed against ``jax.value_and_grad`` of the mean loss in the same process
(interleaved rounds, median of within-round ratios). Rows:

* ``fisher.diagonal`` for kinds empirical / mc (1 sample) / exact, by
  ``method="auto"`` (layer statistics) and ``method="per_example"``
  (``vmap`` of one-example VJPs, chunked);
* ``fisher.kronecker`` (K-FAC factors from layer statistics; Shampoo-style
  factors from per-example gradients);
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
one input factor for q, k and v; top-k low rank (dense layers only) the
ghost Gram ``2 B^2 (k + o)`` per layer and ``2 k B P`` to form its ``k``
directions. A ratio under its floor means the estimator's matmuls run
closer to the machine's peak than the gradient's own.

Memory is XLA's temp bytes of the compiled function. Run from the repository
root::

  python -m benchmarks.fisher_engine           # full run
  python -m benchmarks.fisher_engine --small   # seconds-long smoke run
  python -m benchmarks.fisher_engine --models=cnn --merge  # one model again
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import json
import pathlib
from typing import Any, NamedTuple

from absl import app
from absl import flags
from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from examples.common import models
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
_MODELS = flags.DEFINE_list(
  "models",
  ["mlp", "transformer", "transformer_scan", "cnn"],
  "Models to run.",
)
_MERGE = flags.DEFINE_bool(
  "merge", False, "Keep the stored rows of the models not run this time."
)
_OUT = flags.DEFINE_string("out_dir", None, "Results dir (default results/).")

NAME = "fisher_engine"
NUM_CLASSES = 10


class SmallCNN(nn.Module):
  """28x28x1 -> conv 8 -> conv 16 (stride 2) -> dense 10."""

  width: int = 8

  @nn.compact
  def __call__(self, x):
    x = jax.nn.relu(nn.Conv(self.width, (3, 3))(x))
    x = jax.nn.relu(nn.Conv(2 * self.width, (3, 3), strides=2)(x))
    return nn.Dense(NUM_CLASSES)(x.reshape(x.shape[0], -1))


class _Block(nn.Module):
  """Pre-LayerNorm block: causal ``MultiHeadDotProductAttention`` and an
  MLP (a scan body: ``(x, _) -> (x, None)``)."""

  d: int
  heads: int

  @nn.compact
  def __call__(self, x, _):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(self.heads)(h, h, mask=mask)
    h = nn.Dense(4 * self.d)(nn.LayerNorm()(x))
    return x + nn.Dense(self.d)(jax.nn.gelu(h)), None


class SmallTransformer(nn.Module):
  """Token classifier on Flax's own layers: learned positions, pre-LayerNorm
  blocks of ``MultiHeadDotProductAttention`` (causal) and an MLP, mean pool,
  dense head. ``scan=True`` stacks the blocks by ``nn.scan`` over
  ``nn.remat`` (block leaves ``(layers, ...)``), as large models are
  written."""

  vocab: int = 256
  d: int = 128
  heads: int = 4
  layers: int = 2
  scan: bool = False

  @nn.compact
  def __call__(self, ids):
    t = ids.shape[-1]
    x = nn.Embed(self.vocab, self.d)(ids)
    x = x + self.param("pos", nn.initializers.normal(0.02), (t, self.d))
    if self.scan:
      blocks = nn.scan(
        nn.remat(_Block),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=self.layers,
      )
      x, _ = blocks(self.d, self.heads, name="blocks")(x, None)
    else:
      for _ in range(self.layers):
        x, _ = _Block(self.d, self.heads)(x, None)
    return nn.Dense(NUM_CLASSES)(nn.LayerNorm()(x).mean(axis=1))


def make_model(name: str, small: bool):
  """(apply_fn, params, input shape without batch)."""
  if name in ("transformer", "transformer_scan"):
    t = 8 if small else 32
    model = SmallTransformer(
      d=16 if small else 128,
      heads=2 if small else 4,
      scan=name == "transformer_scan",
    )
    params = model.init(jax.random.key(0), jnp.zeros((1, t), jnp.int32))
    return model.apply, params, (t,)
  if name == "mlp":
    sizes = (64, 64, 64, 10) if small else (784, 512, 512, 10)
    apply_fn, params = models.functional(
      models.MLP(sizes, activation="relu", rngs=nnx.Rngs(0))
    )
    return apply_fn, params, (sizes[0],)
  side = 8 if small else 28
  model = SmallCNN(width=4 if small else 8)
  params = model.init(jax.random.key(0), jnp.zeros((1, side, side, 1)))
  return model.apply, params, (side, side, 1)


class Site(NamedTuple):
  """A parameter contraction, per example: ``rows`` positions (sequence or
  output pixels; 1 for a plain dense layer) of a ``k -> o`` matmul;
  ``carries`` if the cotangent goes on to the layer's input."""

  rows: int
  k: int
  o: int
  carries: bool = True


def flop_floors(
  sites: list[Site],
  batch: int,
  rank: int = 8,
  fwd_other: float = 0.0,
  back_other: float = 0.0,
  kfac_inputs: list[tuple[int, int]] | None = None,
) -> dict[str, float]:
  """Flops each estimator's math needs / the batch gradient's (see above).

  ``fwd_other``/``back_other``: per-example flops outside the sites (e.g.
  attention scores), forward and backward. ``kfac_inputs``: the distinct
  layer inputs ``(rows, k)`` (q, k and v read one input: one factor).
  """
  b = batch
  p = sum(s.rows * s.k * s.o for s in sites)  # one weight gradient's worth
  back = sum(s.rows * s.k * s.o for s in sites if s.carries)
  grad = b * (4 * p + 2 * back + fwd_other + back_other)
  diag = 2 * b * p
  shared = any(s.rows > 1 for s in sites)
  cotangent = b * (2 * back + back_other)  # one more backward pass
  inputs = kfac_inputs or [(s.rows, s.k) for s in sites]
  kfac = (
    2
    * b
    * (sum(r * k * k for r, k in inputs) + sum(s.rows * s.o**2 for s in sites))
  )
  flops = {
    "diag empirical / auto": grad + diag,
    "diag mc-1 / auto": grad + cotangent + diag,
    # Without weight sharing one (a^2)^T (sum_c delta_c^2) serves all
    # classes; with it, each class needs its own per-example products.
    "diag exact / auto": grad
    + NUM_CLASSES * cotangent
    + (NUM_CLASSES if shared else 1) * diag,
    "kron (K-FAC) / auto": grad + kfac,
    "taps one pass (grad + diag emp.)": grad + diag,
  }
  if not shared:  # the ghost Gram of a dense layer: 2 B^2 (k + o)
    gram = sum(2 * b * b * (s.k + s.o) for s in sites)
    flops["top-8 low rank / auto"] = grad + gram + 2 * rank * b * p
  return {k: v / grad for k, v in flops.items()}


def model_sites(
  model_name: str, params: Any, in_shape: tuple[int, ...]
) -> tuple[list[Site], dict[str, Any]]:
  """The benchmark models' contractions, for :func:`flop_floors`."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  kernels = [
    (jax.tree_util.keystr(k), v.shape)
    for k, v in leaves
    if "kernel" in jax.tree_util.keystr(k)
  ]
  if model_name == "mlp":
    return [
      Site(1, s[0], s[1], carries=i > 0) for i, (_, s) in enumerate(kernels)
    ], {}
  if model_name == "cnn":
    side = in_shape[0]
    sites, rows = [], side * side
    for i, (_, s) in enumerate(kernels):
      if len(s) == 4:  # SAME padding; the second conv has stride 2
        rows = rows if i == 0 else rows // 4
        sites.append(Site(rows, s[0] * s[1] * s[2], s[3], carries=i > 0))
      else:
        sites.append(Site(1, s[0], s[1]))
    return sites, {}
  # Transformers: every block matmul runs at each of the T positions, the
  # head (after mean pooling) once; attention scores (QK^T, AV) cost 4 T^2 d
  # forward and twice that backward, per block; the embedding has only its
  # output factor (its input factor is a diagonal of token counts). Blocks
  # stacked by nn.scan over nn.remat run their forward twice.
  t = in_shape[0]
  d = int(params["params"]["Embed_0"]["embedding"].shape[1])
  sites, inputs, blocks, block_flops = [], [], 0, 0
  for name, s in kernels:
    if "'blocks'" not in name and "_Block_" not in name:  # the head
      sites.append(Site(1, s[0], s[-1]))
      inputs.append((1, s[0]))
      continue
    n = s[0] if "'blocks'" in name else 1
    s = s[1:] if "'blocks'" in name else s
    k = int(np.prod(s[:-1])) if "'out'" in name else int(s[0])
    o = int(s[-1]) if "'out'" in name else int(np.prod(s[1:]))
    sites += [Site(t, k, o)] * n
    block_flops += 2 * n * t * k * o
    if "'key'" not in name and "'value'" not in name:
      inputs += [(t, k)] * n  # q, k and v read one input
    blocks += n if "'query'" in name else 0
  sites.append(Site(t, 1, d, carries=False))
  attention = 4.0 * t * t * d * blocks
  remat = block_flops + attention if model_name == "transformer_scan" else 0
  return sites, {
    "fwd_other": attention + remat,
    "back_other": 2 * attention,
    "kfac_inputs": inputs,
  }


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

  def kron(method):
    est = "auto" if method == "auto" else "shampoo"
    return lambda p, x, y, k: fisher.kronecker(
      apply_fn,
      p,
      (x, y),
      likelihood=cat,
      kind="empirical",
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
    tape = _taps.record(apply_fn, p, x)
    logits = tape.outputs
    r = (jax.nn.softmax(logits) - jax.nn.one_hot(y, NUM_CLASSES)) / len(y)
    grad, lg = tape.gradient(r)
    return grad, lg.statistics("diag")

  return {
    "diag empirical / auto": (diag("empirical", "auto"), False),
    "diag mc-1 / auto": (diag("mc", "auto"), False),
    "diag exact / auto": (diag("exact", "auto"), False),
    "kron (K-FAC) / auto": (kron("auto"), False),
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
  fns.update(estimators(apply_fn, chunk))
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
  for k in skip:
    rows[k].update({"median_s": None, "ratio": None})
  return list(rows.values())


def _fmt_ratio(r):
  return "—" if r is None else (f"{r:.2f}x" if r < 20 else f"{r:.0f}x")


def to_markdown(
  rows: list[dict[str, Any]], batches: list[int], chunk: int
) -> str:
  out = []
  order = ["mlp", "transformer", "transformer_scan", "cnn"]
  for model in sorted({r["model"] for r in rows}, key=order.index):
    sub = [r for r in rows if r["model"] == model]
    batches_m = [b for b in batches if any(r["batch"] == b for r in sub)]
    frac = sub[0]["covered_fraction"]
    base = {
      r["batch"]: r["median_s"]
      for r in sub
      if r["estimator"] == "batch gradient"
    }
    header = (
      ["estimator / path"]
      + [f"B={b}" for b in batches_m]
      + [f"temp MB @{b}" for b in batches_m]
    )
    table = []
    names = list(dict.fromkeys(r["estimator"] for r in sub))
    for name in names:
      by_b = {r["batch"]: r for r in sub if r["estimator"] == name}
      cells = []
      for b in batches_m:
        r = by_b[b]
        if name == "batch gradient":
          cells.append(f"{1e3 * base[b]:.2f} ms")
        else:
          cell = _fmt_ratio(r["ratio"])
          if r.get("floor") is not None:
            cell += f" ({r['floor']:.2f})"
          cells.append(cell)
      mems = [f"{by_b[b]['temp_mb']:.1f}" for b in batches_m]
      table.append([name] + cells + mems)
    title = {
      "mlp": "MLP (NNX, relu): " + sub[0]["sizes"],
      "cnn": "small CNN (Linen: 2 convs + dense head)",
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
      + "\n"
    )
    out.append(common.markdown_table(header, table))
    out.append("")
  return "\n".join(out)


def _stored_rows() -> list[dict[str, Any]]:
  path = pathlib.Path(_OUT.value or common.RESULTS_DIR) / f"{NAME}.json"
  return json.loads(path.read_text())["rows"] if path.exists() else []


def main(argv):
  del argv
  small = _SMALL.value
  batches = [8, 16] if small else [int(b) for b in _BATCHES.value]
  rounds = 2 if small else _ROUNDS.value
  slow_rounds = 1 if small else _SLOW_ROUNDS.value
  chunk = 4 if small else _CHUNK.value
  rows = []
  if _MERGE.value and not small:
    rows = [r for r in _stored_rows() if r["model"] not in _MODELS.value]
  for model_name in _MODELS.value:
    for b in batches:
      print(f"[{NAME}] {model_name} B={b}", flush=True)
      rows.extend(run_one(model_name, b, small, chunk, rounds, slow_rounds))
      # Written after every configuration, so a long run leaves its results.
      done = [bb for bb in batches if any(r["batch"] == bb for r in rows)]
      md = to_markdown(rows, done, chunk)
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
