# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Small reference models (Flax NNX) for the demo, examples and benchmarks.

Needs flax (``pip install 'fisher_optax[examples]'``). Models are used
functionally: :func:`functional` splits a module into ``apply_fn(params,
inputs)`` and a plain nested dict of parameters, the form every
``fisher_optax.fisher`` estimator and optax transform takes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

PyTree = Any


class MLP(nnx.Module):
  """A plain MLP ``sizes[0] -> ... -> sizes[-1]`` with Dense layers."""

  def __init__(
    self, sizes: Sequence[int], *, activation: str = "gelu", rngs: nnx.Rngs
  ):
    self.layers = nnx.List(
      [nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])]
    )
    self.activation = getattr(jax.nn, activation)

  def __call__(self, x: jax.Array) -> jax.Array:
    for layer in self.layers[:-1]:
      x = self.activation(layer(x))
    return self.layers[-1](x)


class Block(nnx.Module):
  """Pre-LayerNorm block: causal ``nnx.MultiHeadAttention`` and a GELU MLP."""

  def __init__(self, d: int, heads: int, ffn: int, *, rngs: nnx.Rngs):
    if d % heads:
      raise ValueError(f"d={d} is not divisible by heads={heads}.")
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
      num_heads=heads, in_features=d, decode=False, rngs=rngs
    )
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.fc = nnx.Linear(d, ffn, rngs=rngs)
    self.proj = nnx.Linear(ffn, d, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.ln1(x)
    x = x + self.attn(h, mask=nnx.make_causal_mask(x[..., 0]))
    return x + self.proj(jax.nn.gelu(self.fc(self.ln2(x))))


class CharTransformer(nnx.Module):
  """A small GPT-style decoder on Flax's own layers, for character and byte
  LMs: ``nnx.Embed`` and learned positions, pre-``nnx.LayerNorm`` blocks of
  causal ``nnx.MultiHeadAttention`` and a GELU MLP, a final LayerNorm and an
  ``nnx.Linear`` head.

  The attention ``query``/``key``/``value`` kernels are ``(d, heads,
  head_dim)`` and the ``out`` kernel ``(heads, head_dim, d)``; matrix
  methods (Muon, FISMO, GaLore) see them as ``d x (heads * head_dim)`` and
  ``(heads * head_dim) x d`` through :func:`hidden_axes`.
  """

  def __init__(
    self,
    vocab: int,
    *,
    d: int = 64,
    heads: int = 4,
    layers: int = 2,
    ffn: int = 256,
    context: int = 64,
    rngs: nnx.Rngs,
  ):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (context, d)))
    self.blocks = nnx.List(
      [Block(d, heads, ffn, rngs=rngs) for _ in range(layers)]
    )
    self.ln_f = nnx.LayerNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, vocab, rngs=rngs)

  def __call__(self, ids: jax.Array) -> jax.Array:
    x = self.embed(ids) + self.pos[: ids.shape[-1]]
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_f(x))


_ATTN = ("query", "key", "value")


def hidden_axes(params: PyTree) -> PyTree:
  """``(reduction, output)`` axes of the hidden matrices of a
  :class:`CharTransformer` (attention and MLP kernels in its blocks), None
  for the embedding, positions, norms, biases and head.

  Map them to ``optax.contrib.MuonDimensionNumbers`` or
  ``GaLoreDimensionNumbers`` with :func:`hidden_dims`.
  """

  def pick(path, leaf):
    # Keys and indices only: an nnx.State path ends in the Variable's
    # ``.value`` attribute.
    names = [
      str(getattr(k, "key", getattr(k, "idx", k)))
      for k in path
      if not isinstance(k, jax.tree_util.GetAttrKey)
    ]
    if names[-1] != "kernel" or "blocks" not in names:
      return None
    if names[-2] in _ATTN:  # (d, heads, head_dim)
      return (0, (1, 2))
    if names[-2] == "out":  # (heads, head_dim, d)
      return ((0, 1), 2)
    return (0, 1) if jnp.ndim(leaf) == 2 else None

  return jax.tree_util.tree_map_with_path(pick, params)


def hidden_dims(params: PyTree, kind: Callable[..., Any]) -> PyTree:
  """``kind(*axes)`` for every :func:`hidden_axes` entry, None elsewhere."""
  return jax.tree.map(
    lambda a: None if a is None else kind(*a),
    hidden_axes(params),
    is_leaf=lambda a: a is None or isinstance(a, tuple),
  )


def digits_hidden_dims(params: PyTree, kind: Callable[..., Any]) -> PyTree:
  """``kind()`` for the hidden kernels of :func:`digits_mlp`'s params (every
  layer's but the last, the classifier head), None for the head and biases:
  Muon's advice for what Muon (and FISMO) should take."""
  head = max(params["layers"])
  return {
    "layers": {
      i: {k: kind() if k == "kernel" and i != head else None for k in layer}
      for i, layer in params["layers"].items()
    }
  }


def functional(module: nnx.Module) -> tuple[Callable[..., Any], PyTree]:
  """Splits an NNX module into ``(apply_fn, params)`` for pure optax loops.

  ``params`` is a plain nested dict (``nnx.to_pure_dict``), so masks, label
  functions and dimension-number trees are ordinary dicts.
  """
  graphdef, state, rest = nnx.split(module, nnx.Param, ...)
  params = nnx.to_pure_dict(state)

  def apply_fn(p: PyTree, x: jax.Array) -> jax.Array:
    template = jax.tree.map(lambda v: v, state)
    nnx.replace_by_pure_dict(template, p)
    return nnx.merge(graphdef, template, rest)(x)

  return apply_fn, params


def digits_mlp(
  seed: int = 0,
  sizes: Sequence[int] = (64, 128, 128, 10),
  activation: str = "gelu",
):
  """``(apply_fn, params)`` of the digits MLP used across benchmarks."""
  return functional(MLP(sizes, activation=activation, rngs=nnx.Rngs(seed)))


def char_transformer(vocab: int, seed: int = 0, **kwargs):
  """``(apply_fn, params)`` of :class:`CharTransformer`."""
  return functional(CharTransformer(vocab, rngs=nnx.Rngs(seed), **kwargs))
