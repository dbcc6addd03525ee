# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The models of ``benchmarks/fisher_engine.py`` and their flop floors.

Kept apart from the script (no command-line flags) so that tests can import
them. The floors are explained in ``fisher_engine``'s docstring.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from examples.common import models

NUM_CLASSES = 10


def _stacked(block: type[nn.Module], length: int) -> Any:
  """``block`` (a scan body ``(x, _) -> (x, None)``) stacked ``length``
  times by ``nn.scan`` over ``nn.remat``, each layer its own parameters
  (leaves ``(length, ...)``), as large models are written."""
  return nn.scan(
    nn.remat(block),
    variable_axes={"params": 0},
    split_rngs={"params": True},
    length=length,
  )


class _ConvBlock(nn.Module):
  """A 3x3 conv and relu (a scan body: ``(x, _) -> (x, None)``)."""

  width: int

  @nn.compact
  def __call__(self, x, _):
    return jax.nn.relu(nn.Conv(self.width, (3, 3))(x)), None


class SmallCNN(nn.Module):
  """28x28x1 -> conv 8 -> conv 16 (stride 2) -> dense 10. ``blocks > 0``
  adds that many 16-channel 3x3 convs after the strided one, stacked by
  ``nn.scan`` over ``nn.remat`` (kernels ``(blocks, 3, 3, 16, 16)``)."""

  width: int = 8
  blocks: int = 0

  @nn.compact
  def __call__(self, x):
    x = jax.nn.relu(nn.Conv(self.width, (3, 3))(x))
    x = jax.nn.relu(nn.Conv(2 * self.width, (3, 3), strides=2)(x))
    if self.blocks:
      stack = _stacked(_ConvBlock, self.blocks)
      x, _ = stack(2 * self.width, name="blocks")(x, None)
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
      blocks = _stacked(_Block, self.layers)
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
  model = SmallCNN(
    width=4 if small else 8, blocks=2 if name == "cnn_scan" else 0
  )
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
  kfac_in = 2 * b * sum(r * k * k for r, k in inputs)
  kfac_out = 2 * b * sum(s.rows * s.o**2 for s in sites)
  kfac = kfac_in + kfac_out
  flops = {
    "diag empirical / auto": grad + diag,
    "diag mc-1 / auto": grad + cotangent + diag,
    # Without weight sharing one (a^2)^T (sum_c delta_c^2) serves all
    # classes; with it, each class needs its own per-example products.
    "diag exact / auto": grad
    + NUM_CLASSES * cotangent
    + (NUM_CLASSES if shared else 1) * diag,
    "kron (K-FAC) / auto": grad + kfac,
    # One output factor per class, the input factors once.
    "kron exact (K-FAC) / auto": grad
    + NUM_CLASSES * cotangent
    + kfac_in
    + NUM_CLASSES * kfac_out,
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
  if model_name in ("cnn", "cnn_scan"):
    side = in_shape[0]
    sites, rows, remat = [], side * side, 0
    for i, (_, s) in enumerate(kernels):
      if len(s) == 5:  # the stacked blocks, after the strided conv
        sites += [Site(rows, s[1] * s[2] * s[3], s[4])] * s[0]
        remat += 2 * s[0] * rows * s[1] * s[2] * s[3] * s[4]  # under remat
      elif len(s) == 4:  # SAME padding; the second conv has stride 2
        rows = rows if i == 0 else rows // 4
        sites.append(Site(rows, s[0] * s[1] * s[2], s[3], carries=i > 0))
      else:
        sites.append(Site(1, s[0], s[1]))
    return sites, {"fwd_other": remat}
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
