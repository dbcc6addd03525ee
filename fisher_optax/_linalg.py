# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Shared numerics: stacked-tree algebra and Woodbury solves.

Every consumer of a "sum of rank-one terms" Fisher (Natural GaLore's window,
M-FAC, low-rank EWC, the engine's Gram-matrix eigenproblems) works with a
*stacked tree*: a pytree whose leaves carry one extra leading axis ``m`` (one
slice per gradient). The helpers below treat such a tree as an ``m x d``
matrix ``G`` without ever flattening or concatenating leaves, so leaf
shardings survive and XLA only all-reduces ``m`` or ``m x m`` numbers.

Woodbury form (derivation in the M-FAC paper, batched Cholesky variant):

.. math::

  F = \\lambda I + c\\, G^\\top G, \\qquad
  F^{-1} = \\tfrac{1}{\\lambda}\\bigl(I - G^\\top (G G^\\top
      + \\tfrac{\\lambda}{c} I)^{-1} G\\bigr) = \\tfrac{1}{\\lambda}(I - Z^\\top Z),

with ``C = G G^T + (lambda / c) I = L L^T`` and ``Z = L^{-1} G``. Zero rows of
``G`` (an unfilled ring buffer slot) contribute nothing, so partially filled
windows need no mask.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PyTree = Any
_HIGHEST = jax.lax.Precision.HIGHEST


def _leaf_dot(stacked_leaf: jax.Array, x_leaf: jax.Array) -> jax.Array:
  axes = tuple(range(1, stacked_leaf.ndim))
  return jnp.tensordot(
      stacked_leaf, x_leaf, axes=(axes, tuple(range(x_leaf.ndim))),
      precision=_HIGHEST,
  )


def tree_stacked_dot(stacked: PyTree, x: PyTree) -> jax.Array:
  """Returns ``G x`` of shape ``(m,)`` for a stacked tree ``G`` and a tree ``x``."""
  terms = jax.tree.leaves(jax.tree.map(_leaf_dot, stacked, x))
  if not terms:
    raise ValueError("tree_stacked_dot needs at least one leaf.")
  return sum(t.astype(jnp.result_type(*terms)) for t in terms)


def tree_stacked_combine(stacked: PyTree, z: jax.Array) -> PyTree:
  """Returns ``G^T z``: the tree ``sum_k z[k] * G[k]``."""
  return jax.tree.map(
      lambda s: jnp.tensordot(z.astype(s.dtype), s, axes=(0, 0),
                              precision=_HIGHEST),
      stacked,
  )


def tree_stacked_gram(a: PyTree, b: PyTree | None = None) -> jax.Array:
  """Returns ``A B^T`` of shape ``(m_a, m_b)`` for stacked trees (``b=a`` default)."""
  b = a if b is None else b

  def leaf_gram(x: jax.Array, y: jax.Array) -> jax.Array:
    x2 = x.reshape(x.shape[0], -1)
    y2 = y.reshape(y.shape[0], -1)
    return jnp.matmul(x2, y2.T, precision=_HIGHEST)

  terms = jax.tree.leaves(jax.tree.map(leaf_gram, a, b))
  if not terms:
    raise ValueError("tree_stacked_gram needs at least one leaf.")
  return sum(terms)


class WoodburyFactor(NamedTuple):
  """Cholesky factor of ``C = G G^T + (damping / scale) I``.

  Attributes:
    chol: lower-triangular ``L`` with ``L L^T = C``, shape ``(m, m)``.
    damping: ``lambda`` in ``F = lambda I + scale * G^T G``.
  """

  chol: jax.Array
  damping: jax.Array


def woodbury_factor(
    gram: jax.Array, damping: jax.Array | float, scale: jax.Array | float = 1.0
) -> WoodburyFactor:
  """Factors ``F = damping * I + scale * G^T G`` given ``gram = G G^T``.

  Args:
    gram: ``(m, m)`` Gram matrix of the stacked gradients.
    damping: ``lambda > 0``.
    scale: ``c > 0``; e.g. ``1/m`` for M-FAC's mean of outer products.

  Returns:
    A :class:`WoodburyFactor` for :func:`woodbury_solve` and friends.
  """
  gram = 0.5 * (gram + gram.T)
  damping = jnp.asarray(damping, gram.dtype)
  shift = damping / jnp.asarray(scale, gram.dtype)
  eye = jnp.eye(gram.shape[0], dtype=gram.dtype)
  chol = jnp.linalg.cholesky(gram + shift * eye)
  return WoodburyFactor(chol=chol, damping=damping)


def _tri_solve(chol: jax.Array, b: jax.Array, *, transpose: bool) -> jax.Array:
  return jax.scipy.linalg.solve_triangular(
      chol, b, lower=True, trans=1 if transpose else 0
  )


def woodbury_solve(
    stacked: PyTree, factor: WoodburyFactor, x: PyTree, *,
    normalized: bool = False,
) -> PyTree:
  """Returns ``F^{-1} x`` (or ``damping * F^{-1} x`` when ``normalized``).

  Cost: two stacked contractions, ``O(m d)``, and two ``m x m`` triangular
  solves.
  """
  gx = tree_stacked_dot(stacked, x).astype(factor.chol.dtype)
  w = _tri_solve(factor.chol, _tri_solve(factor.chol, gx, transpose=False),
                 transpose=True)
  correction = tree_stacked_combine(stacked, w)
  out = jax.tree.map(lambda a, b: a - b.astype(a.dtype), x, correction)
  if normalized:
    return out
  return jax.tree.map(lambda a: a / factor.damping.astype(a.dtype), out)


def woodbury_whiten(stacked: PyTree, factor: WoodburyFactor) -> PyTree:
  """Returns ``Z = L^{-1} G`` as a stacked tree (``F^{-1} = (I - Z^T Z)/lambda``)."""
  linv = _tri_solve(
      factor.chol, jnp.eye(factor.chol.shape[0], dtype=factor.chol.dtype),
      transpose=False,
  )
  return jax.tree.map(
      lambda s: jnp.tensordot(linv.astype(s.dtype), s, axes=(1, 0),
                              precision=_HIGHEST),
      stacked,
  )


def woodbury_inverse_diag(stacked: PyTree, factor: WoodburyFactor) -> PyTree:
  """Returns the diagonal of ``F^{-1}`` as a tree shaped like one slice."""
  z = woodbury_whiten(stacked, factor)
  return jax.tree.map(
      lambda zl: (1.0 - jnp.sum(jnp.square(zl), axis=0))
      / factor.damping.astype(zl.dtype),
      z,
  )


def symmetrize(a: jax.Array) -> jax.Array:
  """``(A + A^T) / 2`` over the last two axes."""
  return 0.5 * (a + jnp.swapaxes(a, -1, -2))
