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


def stacked_push_rows(
    stacked: PyTree, gram: jax.Array, rows: PyTree, index: jax.Array | int
) -> tuple[PyTree, jax.Array]:
  """Writes ``k`` rows into a ring buffer of ``m`` rows and refreshes its Gram.

  The rows land in slots ``index, index + 1, ..., index + k - 1`` (mod ``m``),
  overwriting the oldest entries, and only the matching rows and columns of
  the cached ``gram = G G^T`` are recomputed: ``O(k m d)`` work instead of the
  ``O(m^2 d)`` of a fresh :func:`tree_stacked_gram`. Entries are recomputed,
  never accumulated, so the cache does not drift.

  Args:
    stacked: the window, a stacked tree with leading axis ``m``.
    gram: its ``(m, m)`` Gram matrix.
    rows: a stacked tree with leading axis ``k <= m``, same structure.
    index: the slot of the first new row (traced ints are fine).

  Returns:
    ``(stacked, gram)`` after the push, in the dtypes of the inputs.
  """
  sizes = {x.shape[0] for x in jax.tree.leaves(rows)}
  if not sizes:  # a tree without leaves: nothing to push
    return stacked, gram
  if len(sizes) > 1:
    raise ValueError(f"rows disagree on the leading axis: {sorted(sizes)}.")
  k = sizes.pop()
  m = gram.shape[0]
  if k > m:
    raise ValueError(f"cannot push {k} rows into a window of {m} rows.")
  slots = (jnp.asarray(index, jnp.int32) + jnp.arange(k, dtype=jnp.int32)) % m
  stacked = jax.tree.map(
      lambda s, r: s.at[slots].set(r.astype(s.dtype)), stacked, rows)
  new = tree_stacked_gram(
      jax.tree.map(lambda s: s[slots], stacked), stacked).astype(gram.dtype)
  gram = gram.at[slots, :].set(new).at[:, slots].set(new.T)
  return stacked, gram


def ring_buffer_push(
    stacked: PyTree, gram: jax.Array, x: PyTree, slot: jax.Array | int
) -> tuple[PyTree, jax.Array]:
  """Writes ``x`` into row ``slot`` of a stacked tree and updates its Gram.

  A windowed Fisher keeps its last ``m`` gradients as a ring buffer ``G``
  plus the cached Gram ``G G^T``. Replacing one row changes one row and one
  column of the Gram, so a step costs ``O(m d)`` instead of ``O(m^2 d)``.
  The new row is computed from the *stored* value of ``x`` (after the cast
  to the buffer's dtype), so the cache stays the exact Gram of the buffer
  even for a bfloat16 window. Shared by Natural GaLore and M-FAC.

  Args:
    stacked: the buffer, leaves ``(m, *shape)``.
    gram: its Gram matrix ``(m, m)`` (float32 or wider).
    x: the new gradient, leaves ``shape``.
    slot: the row to overwrite, usually ``count % m``.

  Returns:
    ``(new_stacked, new_gram)``.
  """
  new_stacked = jax.tree.map(
      lambda s, v: s.at[slot].set(v.astype(s.dtype)), stacked, x)
  stored = jax.tree.map(lambda s: s[slot].astype(gram.dtype), new_stacked)
  wide = jax.tree.map(lambda s: s.astype(gram.dtype), new_stacked)
  row = tree_stacked_dot(wide, stored).astype(gram.dtype)
  new_gram = gram.at[slot, :].set(row).at[:, slot].set(row)
  return new_stacked, new_gram


def tree_stacked_eigh(
    stacked: PyTree, *, scale: jax.Array | float = 1.0,
    rtol: float | None = None,
) -> tuple[jax.Array, PyTree]:
  """Eigenpairs of ``scale * G^T G`` from the ``m x m`` Gram ``G G^T``.

  The nonzero spectrum of ``G^T G`` (``d x d``) equals that of ``G G^T``
  (``m x m``); with ``G G^T q_i = l_i q_i`` the unit eigenvectors of
  ``G^T G`` are ``v_i = G^T q_i / sqrt(l_i)``, orthonormal over the whole
  tree. Eigenvalues below ``rtol * max(l)`` (round-off of the Gram) are set to
  zero and their vectors to exactly zero, so rank-deficient or all-zero ``G``
  never divides by zero.

  Args:
    stacked: ``G`` as a stacked tree with leading axis ``m``.
    scale: ``c`` in ``c G^T G`` (e.g. ``1/N`` for a mean of outer products).
    rtol: relative cut-off; default ``10 m eps`` of the Gram's dtype.

  Returns:
    ``(eigvals, eigvecs)``: ``eigvals`` ``(m,)`` in descending order (of
    ``scale * G^T G``, clipped at zero) and ``eigvecs`` a stacked tree shaped
    like ``stacked``.
  """
  gram = symmetrize(tree_stacked_gram(stacked))
  m = gram.shape[0]
  if rtol is None:
    rtol = 10.0 * m * float(jnp.finfo(gram.dtype).eps)
  evals, evecs = jnp.linalg.eigh(gram)
  evals, evecs = evals[::-1], evecs[:, ::-1]
  top = jnp.maximum(evals[0], 0.0)
  keep = evals > rtol * top
  safe = jnp.where(keep, evals, 1.0)
  coeffs = jnp.where(keep, 1.0 / jnp.sqrt(safe), 0.0)[None, :] * evecs
  # v_i = G^T q_i / sqrt(l_i), one stacked combination per eigenvector.
  vecs = jax.tree.map(
      lambda s: jnp.tensordot(coeffs.T.astype(s.dtype), s, axes=(1, 0),
                              precision=_HIGHEST),
      stacked,
  )
  evals = jnp.where(keep, evals, 0.0) * jnp.asarray(scale, gram.dtype)
  return evals, vecs
