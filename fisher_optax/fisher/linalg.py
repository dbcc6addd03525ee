# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Stacked-tree algebra and Woodbury solves: the engine's linear algebra.

Every consumer of a "sum of rank-one terms" Fisher (Natural GaLore's window,
M-FAC, low-rank EWC, the engine's Gram-matrix eigenproblems) works with a
*stacked tree*: a pytree whose leaves carry one extra leading axis ``m`` (one
slice per gradient). The helpers below treat such a tree as an ``m x d``
matrix ``G`` without ever flattening or concatenating leaves, so leaf
shardings survive and XLA only all-reduces ``m`` or ``m x m`` numbers
(windows of rows no longer than ``m``, solved as ``d x d`` matrices, are
small enough to gather).

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

from collections.abc import Sequence
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fisher_optax.fisher import numerics

PyTree = Any
_HIGHEST = jax.lax.Precision.HIGHEST


def _leaf_dot(stacked_leaf: jax.Array, x_leaf: jax.Array) -> jax.Array:
  axes = tuple(range(1, stacked_leaf.ndim))
  return jnp.tensordot(
    stacked_leaf,
    x_leaf,
    axes=(axes, tuple(range(x_leaf.ndim))),
    precision=_HIGHEST,
    out_sharding=replicated_spec(),
  )


def replicated_spec() -> Any:
  """``out_sharding`` of a small statistic (a Gram, coordinates) contracted
  over sharded parameter axes: replicated under explicit mesh axes, where
  such a contraction must say (``None``, XLA's choice, otherwise)."""
  return jax.sharding.PartitionSpec() if numerics.explicit_axes() else None


def matmul(
  a: jax.Array,
  b: jax.Array,
  *,
  precision: Any = None,
  out_sharding: Any = None,
) -> jax.Array:
  """``a @ b`` over leading batch axes that broadcast, with ``out_sharding``.

  ``jnp.matmul`` squeezes size-one batch axes before it applies
  ``out_sharding``, which then has the wrong rank; an einsum does not.
  """
  return jnp.einsum(
    "...ij,...jk->...ik",
    a,
    b,
    precision=precision,
    out_sharding=out_sharding,
  )


def _spec_entry(spec: Any, axis: int) -> Any:
  """The mesh axes of ``spec`` on ``axis`` (``None``: unsharded)."""
  return spec[axis] if spec is not None and axis < len(spec) else None


def _mesh_axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes of a spec entry, in order (``()``: unsharded)."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _shards(entry: Any) -> int:
  """How many blocks a spec entry cuts its axis into (current mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  return math.prod(mesh.shape[a] for a in _mesh_axes(entry))


def replicated_matmul(
  a: jax.Array, b: jax.Array, *, precision: Any = _HIGHEST
) -> jax.Array:
  """``a @ b`` of matrices, on every device under explicit mesh axes.

  Each device multiplies its own blocks; the partial products are summed
  over the mesh axes that shard the contraction and gathered over those
  that shard the rows of ``a`` or the columns of ``b``. So a sharded
  operand is never gathered whole: for a sketch ``G Q`` of a sharded
  gradient ``G`` the devices exchange ``G Q``, not ``G``. (Given only a
  replicated ``out_sharding``, XLA gathers the sharded operand first.) A
  replicated operand is sliced to match the other one, at no cost.
  Elsewhere it is ``jnp.matmul``, with XLA's choice of collectives.
  """
  if a.ndim != 2 or b.ndim != 2:
    raise ValueError(
      f"replicated_matmul takes matrices, got shapes {a.shape} and {b.shape}."
    )
  if not numerics.explicit_axes():
    return jnp.matmul(a, b, precision=precision)
  spec_a, spec_b = numerics.explicit_spec(a), numerics.explicit_spec(b)
  contract = _spec_entry(spec_a, 1) or _spec_entry(spec_b, 0)
  rows = _spec_entry(spec_a, 0)
  if set(_mesh_axes(rows)) & set(_mesh_axes(contract)):
    rows = None
  cols = _spec_entry(spec_b, 1)
  if set(_mesh_axes(cols)) & set(_mesh_axes(contract) + _mesh_axes(rows)):
    cols = None
  if a.shape[0] % _shards(rows) or a.shape[1] % _shards(contract):
    return jnp.matmul(  # uneven blocks: XLA's collectives
      a, b, precision=precision, out_sharding=jax.sharding.PartitionSpec()
    )
  if b.shape[1] % _shards(cols):
    cols = None
  spec_a = jax.sharding.PartitionSpec(rows, contract)
  spec_b = jax.sharding.PartitionSpec(contract, cols)

  def local(x: jax.Array, y: jax.Array) -> jax.Array:
    out = jnp.matmul(x, y, precision=precision)
    return out if contract is None else jax.lax.psum(out, contract)

  out = jax.shard_map(
    local,
    in_specs=(spec_a, spec_b),
    out_specs=jax.sharding.PartitionSpec(rows, cols),
  )(jax.sharding.reshard(a, spec_a), jax.sharding.reshard(b, spec_b))
  return jax.sharding.reshard(out, jax.sharding.PartitionSpec())


def long_side_spec(x: jax.Array) -> Any:
  """A spec for ``x``'s matrices (its last two axes) sharded along their
  longer side only, under explicit mesh axes; ``None`` if ``x`` already is
  (or elsewhere, or if the longer side does not split evenly).

  A Gram matrix of the shorter side (``X X^T`` for a wide ``X``, as in
  Newton-Schulz iterations and Kronecker factors) then sums over devices
  (an all-reduce of the small Gram), where a sharded shorter side needs all
  of ``X`` on every device: one all-to-all into this layout replaces a
  gather of ``X`` per product.
  """
  spec = numerics.explicit_spec(x)
  if spec is None or x.ndim < 2:
    return None
  entries = list(spec) + [None] * (x.ndim - len(spec))
  short, long = (x.ndim - 2, x.ndim - 1)
  if x.shape[-2] > x.shape[-1]:
    short, long = long, short
  moved = entries[short]
  if moved is None:
    return None
  axes = _mesh_axes(entries[long]) + _mesh_axes(moved)
  if x.shape[long] % _shards(axes):
    return None
  entries[short], entries[long] = None, axes
  return jax.sharding.PartitionSpec(*entries)


def replicated(x: jax.Array) -> jax.Array:
  """``x`` gathered on every device under explicit mesh axes (a dense
  decomposition's input must be), else as it is."""
  spec = replicated_spec()
  return x if spec is None else jax.sharding.reshard(x, spec)


def tree_stacked_dot(stacked: PyTree, x: PyTree) -> jax.Array:
  """Returns ``G x`` of shape ``(m,)`` for a stacked tree ``G`` and a tree ``x``."""
  terms = jax.tree.leaves(jax.tree.map(_leaf_dot, stacked, x))
  if not terms:
    raise ValueError("tree_stacked_dot needs at least one leaf.")
  dtype = jnp.result_type(*terms)
  return functools.reduce(jnp.add, [t.astype(dtype) for t in terms])


def tree_stacked_combine(stacked: PyTree, z: jax.Array) -> PyTree:
  """Returns ``G^T z``: the tree ``sum_k z[k] * G[k]``; for ``z`` of shape
  ``(m, n)`` the stacked tree of its ``n`` columns' combinations."""
  return jax.tree.map(
    lambda s: jnp.tensordot(
      z.astype(s.dtype), s, axes=(0, 0), precision=_HIGHEST
    ),
    stacked,
  )


def tree_stacked_gram(
  a: PyTree, b: PyTree | None = None, *, dtype: Any = None
) -> jax.Array:
  """Returns ``A B^T`` of shape ``(m_a, m_b)`` for stacked trees (``b=a``
  default), accumulated in ``dtype`` when given (e.g. a float32 Gram of a
  bfloat16 window)."""
  b = a if b is None else b

  # Contract the trailing axes directly: on XLA:CPU an explicit transpose of
  # a reshaped window is materialised and is far slower.
  def leaf_gram(x: jax.Array, y: jax.Array) -> jax.Array:
    axes = tuple(range(1, x.ndim))
    out = jnp.tensordot(
      x,
      y,
      axes=(axes, axes),
      precision=_HIGHEST,
      preferred_element_type=dtype,
      out_sharding=replicated_spec(),
    )
    return out if dtype is None else out.astype(dtype)

  terms = jax.tree.leaves(jax.tree.map(leaf_gram, a, b))
  if not terms:
    raise ValueError("tree_stacked_gram needs at least one leaf.")
  return functools.reduce(jnp.add, terms)


class WoodburyFactor(NamedTuple):
  """Cholesky factor of ``C = G G^T + (damping / scale) I``.

  Attributes:
    chol: lower-triangular ``L`` with ``L L^T = C``, shape ``(m, m)``.
    damping: ``lambda`` in ``F = lambda I + scale * G^T G``.
  """

  chol: jax.Array
  damping: jax.Array


def floored_damping(
  gram: jax.Array, damping: Any, scale: jax.Array | float = 1.0
) -> jax.Array:
  """The damping of ``F = damping I + scale G^T G`` floored where the
  window's Cholesky cannot resolve it: ``max(damping, scale m eps
  trace(gram))`` for ``m`` rows, ``eps`` of ``gram``'s dtype.

  The factorisation is of ``G G^T + (damping / scale) I``, whose condition
  number on nearly dependent rows (a window of similar gradients) is about
  ``trace / (damping / scale)``. Past ``1 / eps`` the Gram's rounding
  outweighs the shift: the Cholesky fails (a windowed optimizer would skip
  every step) or its solve is noise. The floor keeps the condition number
  under ``1 / (m eps)``: a solve of ``m`` equal rows then keeps about
  ``1 / m`` relative accuracy (measured on 8 equal or nearly equal float32
  rows: 2-7% at this floor, 20-80% at ``eps * trace``, 0.2-0.5% at ``64
  eps * trace``; rows in general position are solved accurately whatever
  the floor). Where ``damping`` is above the floor it is returned
  unchanged: the exact maths wherever the dtype resolves it.

  Args:
    gram: ``(m, m)`` Gram matrix ``G G^T``, or a stack ``(n, m, m)`` (a
      floor each).
    damping: ``lambda > 0``.
    scale: ``c > 0`` in ``F`` (e.g. ``1/m`` for M-FAC's mean).

  Returns:
    The damping, a scalar (or ``(n,)``), in ``gram``'s dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax.fisher import linalg
    >>> rows = jnp.full((4, 8), 100.0)  # four equal gradients
    >>> float(linalg.floored_damping(rows @ rows.T, 1e-3))  # 4 eps 3.2e5
    0.152587890625
    >>> float(linalg.floored_damping(rows @ rows.T / 1e6, 1e-3))
    0.001...
  """
  dtype = gram.dtype
  m = gram.shape[-1]
  trace = jnp.trace(gram, axis1=-2, axis2=-1)
  floor = jnp.asarray(scale, dtype) * (m * jnp.finfo(dtype).eps)
  return jnp.maximum(jnp.asarray(damping, dtype), floor * trace)


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
  stacked: PyTree,
  factor: WoodburyFactor,
  x: PyTree | None,
  *,
  normalized: bool = False,
  gx: jax.Array | None = None,
  pending: tuple[PyTree, jax.Array] | None = None,
) -> PyTree:
  """Returns ``F^{-1} x`` (or ``damping * F^{-1} x`` when ``normalized``).

  Cost: two stacked contractions, ``O(m d)``, and two ``m x m`` triangular
  solves; one contraction when ``gx``, the product ``G x`` of shape
  ``(m,)``, is given (e.g. a Gram column when ``x`` is a row of ``G``).

  ``pending=(rows, slots)`` solves with the window whose rows ``slots``
  (int32, shape ``(k,)``) are replaced by the stacked ``rows``, without
  writing them: see :func:`stacked_pending_gram`.

  More generally it returns ``(x - G^T C^{-1} gx) / damping`` for any
  ``gx``; ``x=None`` reads as zeros there (``gx`` is then required), which
  :func:`woodbury_window_solve` uses to solve inside the window's span.
  """
  if x is None:
    if gx is None:
      raise ValueError("woodbury_solve needs gx when x is None.")
  elif gx is None:
    gx = tree_stacked_dot(stacked, x)
    if pending is not None:
      gx = gx.at[pending[1]].set(tree_stacked_dot(pending[0], x))
  gx = gx.astype(factor.chol.dtype)
  w = _tri_solve(
    factor.chol, _tri_solve(factor.chol, gx, transpose=False), transpose=True
  )
  return _woodbury_apply(
    stacked, w, x, factor.damping, normalized=normalized, pending=pending
  )


def _woodbury_apply(
  stacked: PyTree,
  w: jax.Array,
  x: PyTree | None,
  damping: jax.Array,
  *,
  normalized: bool,
  pending: tuple[PyTree, jax.Array] | None,
) -> PyTree:
  """``(x - G^T w) / damping`` (without the division when ``normalized``),
  ``w = C^{-1} G x``."""
  if pending is None:
    correction = tree_stacked_combine(stacked, w)
  else:
    rows, slots = pending
    # G_new^T w = G^T w' + rows^T w[slots], w' zero at the slots. Adding
    # (rows - G[slots])^T w[slots] instead cancels an evicted row that is
    # large next to the rest (a gradient spike) in float32.
    correction = jax.tree.map(
      jnp.add,
      tree_stacked_combine(stacked, w.at[slots].set(0)),
      tree_stacked_combine(rows, w[slots]),
    )
  if x is None:
    out = jax.tree.map(lambda b: -b, correction)
  else:
    out = jax.tree.map(lambda a, b: a - b.astype(a.dtype), x, correction)
  if normalized:
    return out
  return jax.tree.map(lambda a: a / damping.astype(a.dtype), out)


def symmetrize(a: jax.Array) -> jax.Array:
  """``(A + A^T) / 2`` over the last two axes."""
  return 0.5 * (a + jnp.matrix_transpose(a))


# LOBPCG's block: the wanted eigenpairs plus a few more, whose extra
# directions speed up the convergence of the last wanted ones.
_OVERSAMPLE = 8


def top_eigh(
  a: jax.Array,
  k: int,
  *,
  min_iterative: int = 1024,
  max_iters: int = 200,
) -> tuple[jax.Array, jax.Array]:
  """The ``k`` largest eigenpairs of a symmetric ``(n, n)`` matrix.

  A full ``eigh`` costs ``O(n^3)``; for ``n >= min_iterative`` and a float32
  (or narrower) matrix the pairs come from LOBPCG (Knyazev, 2001) with a
  block of ``k + 8`` directions, ``O(n^2 k)`` per iteration and no copy of
  the matrix, until every residual ``|A v - lambda v|`` is below about
  ``1e-5 lambda`` (the float32 round-off of the Gram matrices it serves is
  about ``4e-6 lambda``); on those it converged in 30 to 60 iterations.
  After ``max_iters`` it returns the Ritz pairs it has. On the engine's
  ``2048 x 2048`` Gram matrices it took a fifth to a seventh of ``eigh``'s
  time on CPU. Float64 matrices always take ``eigh``.

  Args:
    a: a symmetric ``(n, n)`` matrix (finite; see
      :func:`fisher_optax.fisher.numerics.finite_or_nan`).
    k: number of eigenpairs (static, ``1 <= k <= n``).
    min_iterative: the smallest ``n`` that takes LOBPCG.
    max_iters: LOBPCG's iteration limit (static).

  Returns:
    ``(vals, vecs)``: ``vals (k,)`` in descending order and orthonormal
    ``vecs (n, k)``.

  References:
    Knyazev, `Toward the optimal preconditioned eigensolver: locally optimal
    block preconditioned conjugate gradient method
    <https://doi.org/10.1137/S1064827500366124>`_, 2001.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from fisher_optax.fisher import linalg
    >>> g = jax.random.normal(jax.random.key(0), (64, 8))
    >>> vals, vecs = linalg.top_eigh(g @ g.T, 2, min_iterative=64)
    >>> bool(jnp.allclose(vals, jnp.linalg.eigvalsh(g @ g.T)[::-1][:2],
    ...                   rtol=1e-4))
    True
  """
  n = a.shape[-1]
  block = k + _OVERSAMPLE

  if n < min_iterative or 5 * block >= n or jnp.finfo(a.dtype).bits > 32:
    vals, vecs = jnp.linalg.eigh(a)
    return vals[::-1][:k], vecs[:, ::-1][:, :k]
  from jax.experimental.sparse import linalg as sparse_linalg  # noqa: PLC0415

  # Entries of order one: LOBPCG's squared norms would underflow (or
  # overflow) for a Gram matrix of tiny (huge) gradients. Scaled in the
  # product, not in a scaled copy of the matrix. A zero matrix (zero
  # gradients) would give 0/0: it runs as the identity, eigenvalues 0.
  top = jnp.max(jnp.abs(a))
  nonzero = top > 0
  scale = jnp.where(nonzero, top, 1.0)

  def matmul(x: jax.Array) -> jax.Array:
    ax = jnp.matmul(a, x / scale, precision=_HIGHEST)
    return jnp.where(nonzero, ax, x)

  # Converged at |A v - lambda v| < tol * 10 n (lambda + |A v|), ~20 n tol.
  tol = 1e-5 / (20.0 * n)
  start = jax.random.normal(jax.random.key(0), (n, block), a.dtype)
  vals, vecs, iters = sparse_linalg.lobpcg_standard(
    matmul, start, max_iters, tol
  )
  del iters  # a fallback to eigh would hold two more copies of the matrix
  order = jnp.argsort(-vals)[:k]
  return jnp.where(nonzero, vals[order] * scale, 0.0), vecs[:, order]


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
  stored = jax.tree.map(lambda s, r: r.astype(s.dtype), stacked, rows)
  stacked = jax.tree.map(lambda s, r: s.at[slots].set(r), stacked, stored)

  # Contract the *new* window (its rows ``slots`` hold the k x k block): XLA
  # does not order a product with the old window before the in-place write
  # and copies the whole window instead (twice when it is donated). Window
  # first: on XLA:CPU the (k, d) x (m, d)^T order transposes the window.
  # Products accumulate in the Gram's dtype (exact for a bfloat16 window).
  cols = tree_stacked_gram(stacked, stored, dtype=gram.dtype)
  gram = gram.at[:, slots].set(cols).at[slots, :].set(cols.T)
  return stacked, gram


def stacked_push_rows_if_finite(
  stacked: PyTree, gram: jax.Array, rows: PyTree, index: jax.Array | int
) -> tuple[PyTree, jax.Array, jax.Array]:
  """:func:`stacked_push_rows` that leaves the window untouched on NaN/Inf rows.

  Non-finite rows are replaced by the current content of their slots, so the
  push still touches only ``k`` rows (never selects the whole window) and the
  cached Gram stays the exact Gram of the buffer.

  Returns:
    ``(stacked, gram, pushed)`` with ``pushed`` a boolean scalar: False when
    any new row was non-finite (the caller keeps its write index then).
  """
  leaves = jax.tree.leaves(rows)
  if not leaves:
    return stacked, gram, jnp.asarray(True)
  finite = numerics.tree_all_finite(rows)
  k = leaves[0].shape[0]
  slots = (
    jnp.asarray(index, jnp.int32) + jnp.arange(k, dtype=jnp.int32)
  ) % gram.shape[0]
  rows = jax.tree.map(
    lambda r, s: jnp.where(finite, r.astype(s.dtype), s[slots]), rows, stacked
  )
  stacked, gram = stacked_push_rows(stacked, gram, rows, index)
  return stacked, gram, finite


def stacked_pending_gram(
  stacked: PyTree,
  gram: jax.Array,
  rows: PyTree,
  index: jax.Array | int,
  x: PyTree | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """The Gram after :func:`stacked_push_rows`, without writing the rows.

  For a step that decides only later whether the rows enter the window (a
  non-finite policy): the solve runs on the old window with the rows
  ``pending`` (:func:`woodbury_solve`), and the caller writes them in place
  at the end, once. Every read of the old window then comes before that
  write, so a donated window is neither copied nor read twice for the Gram.

  Args:
    stacked: the window, a stacked tree with leading axis ``m``.
    gram: its ``(m, m)`` Gram matrix.
    rows: a stacked tree with leading axis ``k <= m``, cast to the window's
      dtypes.
    index: the slot of the first new row (traced ints are fine).
    x: optional tree shaped like one row, cast to the window's dtypes (pass
      it only where that is exact): ``G x`` for the new window comes from
      the same pass over the window.

  Returns:
    ``(gram, gx)``: the new ``(m, m)`` Gram and ``G x`` of shape ``(m,)``
    (None without ``x``).
  """
  sizes = {r.shape[0] for r in jax.tree.leaves(rows)}
  if not sizes:  # a tree without leaves: nothing pending, G x is empty
    return gram, None if x is None else jnp.zeros(gram.shape[0], gram.dtype)
  k = sizes.pop()
  m = gram.shape[0]
  slots = (jnp.asarray(index, jnp.int32) + jnp.arange(k, dtype=jnp.int32)) % m
  new = jax.tree.map(lambda s, r: r.astype(s.dtype), stacked, rows)
  if x is not None:
    new = jax.tree.map(
      lambda r, v: jnp.concatenate([r, v[None].astype(r.dtype)]), new, x
    )

  # Window first: on XLA:CPU the (k, d) x (m, d)^T order transposes it. One
  # pass over G gives (m, k), or (m, k + 1) with x; then the new rows' entries.
  cols = tree_stacked_gram(stacked, new, dtype=gram.dtype)
  head = jax.tree.map(lambda r: r[:k], new)
  cols = cols.at[slots].set(tree_stacked_gram(head, new, dtype=gram.dtype))
  gx = cols[:, k] if x is not None else None
  cols = cols[:, :k]
  gram = gram.at[:, slots].set(cols).at[slots, :].set(cols.T)
  return gram, gx


# -- Matrix functions for Kronecker-factored preconditioners (FISMO) ---------
#
# All functions below act on the last two axes and broadcast over leading
# (batch) axes, so a stack of same-shaped factors is one batched call.


def tril_inverse(chol: jax.Array) -> jax.Array:
  """Returns ``L^{-1}`` for lower-triangular ``L`` (batched over leading axes).

  Uses an LU-based inverse: on XLA:CPU, ``triangular_solve`` with a matrix
  right-hand side is about 100x slower than ``jnp.linalg.inv`` at
  ``128 x 128`` (measured with jax 0.10.2), which dominated M-FAC's blocked
  factorization. For the well-conditioned damped factors used here the LU
  inverse is as accurate; the result is re-triangularized.
  """
  return jnp.tril(jnp.linalg.inv(chol))


# -- Windows of gradients (M-FAC, the windowed Woodbury preconditioner,
# Natural GaLore's projected window) ------------------------------------------


def _pending_coords(m: int, slots: jax.Array, coords: Any, dtype: Any):
  """``a`` of length ``m`` with ``x = G^T a``: ``coords`` at the pending
  rows' ``slots``, zero elsewhere (a solve inside the window's span)."""
  return jnp.zeros(m, dtype).at[slots].set(jnp.asarray(coords, dtype))


def remainder_of(
  x: PyTree, rows: PyTree, coords: jax.Array, dtype: Any = None
) -> PyTree:
  """``r = x - rows^T a`` (``a = coords``), in ``dtype`` (default ``x``'s).

  The part of ``x`` outside the span of ``rows`` that
  :func:`woodbury_window_solve` solves with ``coords`` and ``remainder``;
  a caller that forms ``G r`` in its own pass over the window computes
  ``r`` here, as the solve does.
  """
  if dtype is not None:
    x = jax.tree.map(lambda v: v.astype(dtype), x)
    rows = jax.tree.map(lambda v: v.astype(dtype), rows)
  in_span = tree_stacked_combine(rows, jnp.asarray(coords))
  return jax.tree.map(lambda v, s: v - s.astype(v.dtype), x, in_span)


def _row_size(stacked: PyTree) -> int:
  """``d``, the number of entries in one row of a stacked tree."""
  return sum(math.prod(leaf.shape[1:]) for leaf in jax.tree.leaves(stacked))


def _short_rows(stacked: PyTree) -> bool:
  """Whether a window's rows are no longer than its length (``d <= m``):
  see :func:`_short_rows_solve`."""
  leaves = jax.tree.leaves(stacked)
  return bool(leaves) and _row_size(stacked) <= leaves[0].shape[0]


def _short_rows_solve(
  window: PyTree,
  x: PyTree,
  damping: jax.Array | float,
  scale: jax.Array | float,
  woodbury: PyTree,
  *,
  normalized: bool,
) -> PyTree:
  """The solve of a window with ``d <= m``: direct or ``woodbury``'s.

  The ``m x m`` Gram of such a window is singular (rank ``d`` at most),
  with ``m - d`` pivots of ``lambda / c``, and the Woodbury form cancels
  unless its nonzero rows' block is well conditioned. The ``d x d`` matrix
  ``F`` is factored directly where that is well conditioned (rows spanning
  every direction at a size that counts). Where ``F``'s weakest direction
  is near the damping (a window still filling, or rows much smaller than
  the rest, as after a gradient spike) a direct solve amplifies the
  rounding of ``x`` there, and ``woodbury`` (the Woodbury form's result,
  exact in those cases) is kept. Measured in float32 against float64 on a
  4-entry leaf under a window of 8 at damping 1e-5: 2e-3 to 6e-2 relative
  error in the Woodbury form once the window is full of comparable rows,
  5e-8 to 6e-7 directly; after a spike (rows 1e-4 as large) 1% directly,
  1e-7 in the Woodbury form.
  """
  direct, weakest, strongest = _direct_solve(
    window, x, damping, scale, normalized=normalized
  )
  # The direct solve's relative error is about eps * cond(F), the Woodbury
  # form's at most eps * |F| / damping: direct where its own is small, or
  # far below the other's bound.
  eps = jnp.finfo(weakest.dtype).eps
  lam = jnp.asarray(damping, weakest.dtype)
  spanned = (eps * strongest < 1e-4 * weakest) | (weakest > 100 * lam)
  direct = numerics.keep_types(direct, woodbury)  # gathered: resharded
  return numerics.tree_select(spanned, direct, woodbury)


def _with_rows(stacked: PyTree, pending: tuple[PyTree, jax.Array]) -> PyTree:
  """The window with the pending ``rows`` written at their ``slots``."""
  rows, slots = pending
  return jax.tree.map(lambda s, r: s.at[slots].set(r), stacked, rows)


def _direct_solve(
  stacked: PyTree,
  x: PyTree,
  damping: jax.Array | float,
  scale: jax.Array | float,
  *,
  normalized: bool,
) -> tuple[PyTree, jax.Array, jax.Array]:
  """``F^{-1} x`` (``damping F^{-1} x`` if ``normalized``) with the ``d x d``
  ``F = damping I + scale G^T G`` formed and factored (``d <= m``), and
  estimates of ``F``'s smallest and largest eigenvalues (three steps of
  inverse and of power iteration from a fixed start).

  A non-finite ``G^T G`` or ``x`` gives NaN outputs without reaching the
  Cholesky, as the Woodbury solves do.
  """
  leaves = [replicated(v) for v in jax.tree.leaves(stacked)]
  m = leaves[0].shape[0]
  dtype = leaves[0].dtype
  g = jnp.concatenate([v.reshape(m, -1) for v in leaves], axis=1)
  xv = numerics.ravel(jax.tree.map(replicated, x), dtype)
  damping = jnp.asarray(damping, dtype)
  gtg = jnp.matmul(g.T, g, precision=_HIGHEST)
  eye = jnp.eye(g.shape[1], dtype=dtype)
  f = jnp.asarray(scale, dtype) * symmetrize(gtg) + damping * eye
  ok = jnp.all(jnp.isfinite(f)) & jnp.all(jnp.isfinite(xv))
  chol = jnp.linalg.cholesky(jnp.where(ok, f, eye))

  def solve(b: jax.Array) -> jax.Array:
    return _tri_solve(
      chol, _tri_solve(chol, b, transpose=False), transpose=True
    )

  u = solve(xv)
  u = jnp.where(ok, damping * u if normalized else u, jnp.nan)
  # A start with no special direction (ones would be one: a softmax bias's
  # rows sum to zero).
  start = jnp.cos(1.7 * jnp.arange(g.shape[1], dtype=dtype) + 0.3)
  v = w = start
  for _ in range(3):
    v = solve(v / jnp.linalg.norm(v))
    w = f @ (w / jnp.linalg.norm(w))
  weakest, strongest = 1.0 / jnp.linalg.norm(v), jnp.linalg.norm(w)
  return numerics.unravel(u, x), weakest, strongest


def woodbury_window_solve(
  stacked: PyTree,
  gram: jax.Array,
  x: PyTree,
  damping: jax.Array | float,
  *,
  scale: jax.Array | float = 1.0,
  normalized: bool = False,
  gx: jax.Array | None = None,
  pending: tuple[PyTree, jax.Array] | None = None,
  coords: jax.Array | None = None,
  remainder: bool = True,
  gr: jax.Array | None = None,
) -> PyTree:
  """``(damping I + scale G^T G)^{-1} x`` for a window ``G`` and its Gram.

  The window solve of every windowed-Woodbury preconditioner: a
  :func:`woodbury_factor` of the cached ``gram = G G^T`` and a
  :func:`woodbury_solve`, computed in :func:`numerics.compute_dtype` of the
  Gram and ``x`` (at least float32, so a bfloat16 window is exact enough)
  and cast back to ``x``'s dtypes. A window whose rows are no longer than
  the window (``d <= m``: a scalar or a short bias) is solved as the
  ``d x d`` matrix ``F`` where that is well conditioned: its ``m x m`` Gram
  is singular, and the Woodbury form cancels unless its nonzero rows are.

  Args:
    stacked: the window ``G``, a stacked tree (leading axis ``m``).
    gram: its ``(m, m)`` Gram matrix.
    x: a tree shaped like one row of ``stacked``.
    damping: ``lambda > 0``.
    scale: ``c > 0`` in ``F = lambda I + c G^T G``.
    normalized: return ``damping * F^{-1} x`` instead.
    gx: ``G x`` of shape ``(m,)`` if already known (the solve then reads the
      window once): when ``x`` is the row just pushed, it is that row's
      column of the Gram.
    pending: ``(rows, slots)``, rows that replace the window's rows
      ``slots`` for this solve without being written (``gram`` is then the
      Gram with them, from :func:`stacked_pending_gram`).
    coords: ``(k,)`` coefficients ``a`` of the pending rows with
      ``x = rows^T a + r`` (e.g. one for the gradient just pushed, ``1/k``
      for the mean of ``k`` per-example rows); without ``pending``,
      ``(m,)`` coefficients of the window's own rows. The part in the window's span
      is then solved as ``G^T (scale G G^T + damping I)^{-1} a``, which has
      no cancellation: ``(x - G^T w) / damping`` loses float32 digits in
      proportion to ``scale |x|^2 / damping`` when ``x`` lies in the span.
    remainder: with ``coords``, whether ``r = x - rows^T a`` is solved too
      (by the formula above); False takes ``x`` as exactly ``rows^T a``,
      e.g. the rows as stored in a narrower window. ``G r`` is formed from
      ``r`` itself (``G x - gram a`` would cancel as above), so ``gx`` is
      refused here; pass ``gr`` instead where it is already known.
    gr: with ``coords`` and ``remainder``, ``G r`` of shape ``(m,)`` if
      already known (e.g. from the pass that forms the Gram, given the same
      ``r = x - rows^T a``).

  Returns:
    ``F^{-1} x`` in ``x``'s dtypes; ``x`` itself for a tree without leaves.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax.fisher import linalg
    >>> g = jnp.array([[1.0, 0.0], [0.0, 0.0]])  # one gradient, one empty slot
    >>> linalg.woodbury_window_solve(g, g @ g.T, jnp.array([1.0, 1.0]), 1.0)
    Array([0.5, 1. ], dtype=float32)
  """
  leaves = jax.tree.leaves(x)
  if not leaves:
    return x
  if coords is not None and remainder and gx is not None:
    raise ValueError(
      "with coords and remainder, pass G r as gr, not G x as gx "
      "(G x - gram a cancels)."
    )
  dtype = numerics.compute_dtype(jnp.result_type(gram, *leaves))
  wide = jax.tree.map(lambda s: s.astype(dtype), stacked)
  pending = (
    None
    if pending is None
    else (jax.tree.map(lambda r: r.astype(dtype), pending[0]), pending[1])
  )
  gram = gram.astype(dtype)
  factor = woodbury_factor(gram, damping, scale)
  xw: PyTree | None = jax.tree.map(lambda v: v.astype(dtype), x)
  if coords is not None:
    if pending is None:  # Coefficients of the window's own rows.
      rows, slots = wide, None
      a = jnp.asarray(coords, dtype)
    else:
      rows, slots = pending
      a = _pending_coords(gram.shape[0], slots, coords, dtype)
    shifted = factor.damping / jnp.asarray(scale, dtype) * a
    if remainder:
      # x = G^T a + r: F^{-1} x = (r - G^T C^{-1} (G r - shift a)) / damping.
      xw = remainder_of(xw, rows, coords, dtype)
      if gr is None:
        gr = tree_stacked_dot(wide, xw)
        if slots is not None:
          gr = gr.at[slots].set(tree_stacked_dot(rows, xw))
      gx = gr.astype(dtype) - shifted
    else:
      xw, gx = None, -shifted
  out = woodbury_solve(
    wide, factor, xw, normalized=normalized, gx=gx, pending=pending
  )
  if _short_rows(wide):
    window = wide if pending is None else _with_rows(wide, pending)
    if coords is None or remainder:
      xp = jax.tree.map(lambda v: v.astype(dtype), x)
    else:  # x is exactly rows^T a
      rows = wide if pending is None else pending[0]
      xp = tree_stacked_combine(rows, jnp.asarray(coords, dtype))
    out = _short_rows_solve(
      window, xp, damping, scale, out, normalized=normalized
    )
  return numerics.keep_types(out, x)  # x's dtypes and explicit sharding


def woodbury_window_solves(
  windows: Sequence[PyTree],
  grams: Sequence[jax.Array],
  xs: Sequence[PyTree],
  damping: jax.Array | float,
  *,
  normalized: bool = False,
  gxs: Sequence[jax.Array | None] | None = None,
  pendings: Sequence[tuple[PyTree, jax.Array] | None] | None = None,
  pushed: Sequence[bool] | None = None,
) -> list[PyTree]:
  """:func:`woodbury_window_solve` (``scale = 1``) of several windows at once.

  The windows (one per parameter leaf, say) may differ in shape but have the
  same length ``m``: their ``m x m`` Cholesky factorisations and triangular
  solves run as one batched call each instead of one per window, which on
  a CPU is most of a small solve's time. A window whose Gram or ``G x`` is
  not finite gets NaN outputs and never reaches the factorisation (as with
  :func:`numerics.finite_or_nan`); the others are unaffected.

  Args:
    windows: the windows ``G_i`` (stacked trees, leading axis ``m``).
    grams: their ``(m, m)`` Gram matrices (with the pending rows, if any).
    xs: trees shaped like one row of each window.
    damping: ``lambda > 0``, shared, or one per window (``(n,)``, e.g.
      :func:`floored_damping` of the stacked Grams).
    normalized: return ``damping * F_i^{-1} x_i`` instead.
    gxs: ``G_i x_i`` where known, else ``None`` entries.
    pendings: ``(rows, slots)`` per window or ``None`` entries, as in
      :func:`woodbury_window_solve`.
    pushed: per window, whether ``x_i`` is its one pending row (the
      gradient just pushed), taken as stored: it is then solved inside the
      window's span, ``G^T (G G^T + damping I)^{-1} e_slot``, without the
      float32 cancellation of ``(x - G^T w) / damping`` (see
      :func:`woodbury_window_solve`'s ``coords``); ``x_i`` is not read.

  Returns:
    The list of ``F_i^{-1} x_i`` in the dtypes of ``x_i``.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax.fisher import linalg
    >>> g = jnp.array([[1.0, 0.0], [0.0, 0.0]])
    >>> a, b = linalg.woodbury_window_solves(
    ...     [g, 2 * g], [g @ g.T, 4 * g @ g.T], [jnp.ones(2)] * 2, 1.0)
    >>> [x.round(3).tolist() for x in (a, b)]
    [[0.5, 1.0], [0.2, 1.0]]
  """
  n = len(xs)
  gxs = [None] * n if gxs is None else list(gxs)
  pendings = [None] * n if pendings is None else list(pendings)
  pushed = [False] * n if pushed is None else list(pushed)
  if not n:
    return []
  dtype = numerics.compute_dtype(jnp.result_type(*grams, *jax.tree.leaves(xs)))
  lams = jnp.broadcast_to(jnp.asarray(damping, dtype), (n,))
  short: dict[int, tuple[PyTree, PyTree]] = {}
  wides, xws, products = [], [], []
  for i, (g, gram_i, x, gx, pend, in_span) in enumerate(
    zip(windows, grams, xs, gxs, pendings, pushed)
  ):
    wide = jax.tree.map(lambda s: s.astype(dtype), g)
    xw = jax.tree.map(lambda v: v.astype(dtype), x)
    if pend is not None:
      pend = (jax.tree.map(lambda r: r.astype(dtype), pend[0]), pend[1])
    if in_span and pend is None:
      raise ValueError("pushed needs the pending row.")
    if _short_rows(wide):  # d <= m: see _short_rows_solve
      window = wide if pend is None else _with_rows(wide, pend)
      xp = xw
      if in_span and pend is not None:  # the pushed row itself
        xp = jax.tree.map(lambda r: r.sum(0), pend[0])
      short[i] = (window, xp)
    if in_span and pend is not None:
      # x = G^T e_slot: F^{-1} x = (0 - G^T C^{-1} (-damping e_slot)) / damping.
      e = _pending_coords(gram_i.shape[-1], pend[1], 1.0, dtype)
      gx, xw = -lams[i] * e, None
    elif gx is None:
      gx = tree_stacked_dot(wide, xw)
      if pend is not None:
        gx = gx.at[pend[1]].set(tree_stacked_dot(pend[0], xw))
    wides.append((wide, pend))
    xws.append(xw)
    products.append(gx.astype(dtype))
  gram = jnp.stack([g.astype(dtype) for g in grams])
  gx = jnp.stack(products)
  ok = jnp.all(jnp.isfinite(gram), axis=(1, 2)) & jnp.all(
    jnp.isfinite(gx), axis=1
  )
  gram = jnp.where(ok[:, None, None], symmetrize(gram), 0.0)
  gx = jnp.where(ok[:, None], gx, 0.0)
  eye = jnp.eye(gram.shape[-1], dtype=dtype)
  chol = jnp.linalg.cholesky(gram + lams[:, None, None] * eye)
  w = jax.scipy.linalg.solve_triangular(chol, gx[..., None], lower=True)
  w = jax.scipy.linalg.solve_triangular(chol, w, lower=True, trans=1)[..., 0]
  w = jnp.where(ok[:, None], w, jnp.nan)
  out = []
  for i, ((wide, pend), xw, x) in enumerate(zip(wides, xws, xs)):
    o = _woodbury_apply(
      wide, w[i], xw, lams[i], normalized=normalized, pending=pend
    )
    if i in short:
      o = _short_rows_solve(*short[i], lams[i], 1.0, o, normalized=normalized)
    # x's dtypes, and its sharding under explicit mesh axes (a solve in the
    # span, G^T w, would take the window's).
    out.append(numerics.keep_types(o, x))
  return out


def woodbury_rows_solve(
  rows: PyTree,
  x: PyTree,
  damping: jax.Array | float,
  *,
  normalized: bool = False,
  mean: bool = False,
) -> PyTree:
  """``(damping I + (1/B) R^T R)^{-1} x`` for ``B`` stacked rows ``R``.

  The damped empirical Fisher of one batch of per-example gradients, with
  no window kept: :func:`woodbury_window_solve` over the rows (widened to
  :func:`numerics.compute_dtype`) and their fresh Gram.

  Args:
    rows: a stacked tree, leading axis ``B >= 1``.
    x: a tree shaped like one row.
    damping: ``lambda > 0``.
    normalized: return ``damping * F^{-1} x`` instead.
    mean: ``x`` is (about) the rows' mean, e.g. the batch gradient of these
      per-example gradients: its part in their span is solved there,
      without float32 cancellation, and only ``x - mean(R)`` by the
      general formula (``coords = 1/B`` in :func:`woodbury_window_solve`).

  Returns:
    ``F^{-1} x`` in ``x``'s dtypes.
  """
  leaves = jax.tree.leaves(rows)
  if not leaves:
    return x
  b = leaves[0].shape[0]
  wide = numerics.widen(rows)
  return woodbury_window_solve(
    wide,
    tree_stacked_gram(wide),
    x,
    damping,
    scale=1.0 / b,
    normalized=normalized,
    coords=jnp.full((b,), 1.0 / b, jnp.float32) if mean else None,
  )
