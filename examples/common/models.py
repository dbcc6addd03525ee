# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Small reference models (Flax NNX) for the demo, examples and benchmarks.

Needs flax (``pip install 'fisher_optax[examples]'``). Models are used
functionally: :func:`functional` splits a module into ``apply_fn(params,
inputs)`` and a plain nested dict of parameters, the form every
``fisher_optax.fisher`` estimator and optax transform takes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import math
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


class CausalSelfAttention(nnx.Module):
  """Multi-head causal attention with separate 2-D q, k, v, o kernels."""

  def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs):
    if d % heads:
      raise ValueError(f"d={d} is not divisible by heads={heads}.")
    self.heads = heads
    self.q = nnx.Linear(d, d, use_bias=False, rngs=rngs)
    self.k = nnx.Linear(d, d, use_bias=False, rngs=rngs)
    self.v = nnx.Linear(d, d, use_bias=False, rngs=rngs)
    self.o = nnx.Linear(d, d, use_bias=False, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    split = lambda y: y.reshape(b, t, self.heads, d // self.heads)
    q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // self.heads)
    mask = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(mask, logits, -1e30)
    att = jax.nn.softmax(logits, axis=-1)
    return self.o(jnp.einsum("bhts,bshd->bthd", att, v).reshape(b, t, d))


class Block(nnx.Module):
  def __init__(self, d: int, heads: int, ffn: int, *, rngs: nnx.Rngs):
    self.norm1 = nnx.RMSNorm(d, rngs=rngs)
    self.attn = CausalSelfAttention(d, heads, rngs=rngs)
    self.norm2 = nnx.RMSNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, ffn, rngs=rngs)
    self.down = nnx.Linear(ffn, d, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.norm1(x))
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class CharTransformer(nnx.Module):
  """A small pre-RMSNorm decoder-only transformer for character LMs.

  Projection-friendly: every attention/MLP weight is a 2-D ``nnx.Linear``
  kernel named ``q``, ``k``, ``v``, ``o``, ``up``, ``down``.
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
    self.norm = nnx.RMSNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, vocab, rngs=rngs)

  def __call__(self, ids: jax.Array) -> jax.Array:
    x = self.embed(ids) + self.pos[: ids.shape[-1]]
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


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
