# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Matrix-free inverse of a damped sum of rank-one terms (M-FAC, static).

:func:`sum_of_rank_one` factors

.. math::

  F = \\lambda I + \\frac{1}{m} \\sum_{k=1}^m g_k g_k^\\top

once, in ``O(d m^2 + m^3)``, and then answers inverse-Fisher queries without
ever forming a ``d x d`` matrix: ``F^{-1} v`` and the full diagonal of
``F^{-1}`` in ``O(d m)``, a single entry ``[F^{-1}]_{ij}`` in ``O(m)``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from fisher_optax.fisher import linalg
from fisher_optax.fisher import numerics
from fisher_optax.fisher import validation

PyTree = Any


def _flat_blocks(
  tree: PyTree, block_size: int, num_blocks: int, lead: tuple[int, ...]
) -> jax.Array:
  """Ravels the trailing (param) axes of a tree into ``(*lead, nb, B)``."""
  flat = jnp.concatenate(
    [x.reshape(*lead, -1) for x in jax.tree.leaves(tree)], axis=-1
  )
  pad = num_blocks * block_size - flat.shape[-1]
  flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, pad)])
  return flat.reshape(*lead, num_blocks, block_size)


@jax.tree_util.register_pytree_node_class
class RankOneSumFisher:
  """Factored ``F = damping * I + (1/m) sum_k g_k g_k^T`` (see :func:`sum_of_rank_one`).

  The factor keeps ``Z = L^{-1} G`` with ``L L^T = G G^T + m * damping * I``
  (one ``m x d`` array, as much memory as the gradients), so that
  ``F^{-1} = (I - Z^T Z) / damping``. With ``block_size`` set, ``F`` is the
  block-diagonal part of that matrix over consecutive blocks of the
  flattened parameters (``jax.flatten_util.ravel_pytree`` order), and every
  block has its own factor: ``m x m`` as above while ``m < block_size``;
  otherwise (``direct``) the block's gradients span it, and it keeps
  ``W = sqrt(m) L^{-1}`` with ``L L^T = G^T G + m * damping * I``
  (``B x B``), so that ``F^{-1} = W^T W``: a sum of squares, without the
  float32 cancellation of ``I - Z^T Z`` where ``|g|^2 / damping`` is large.

  A :class:`~fisher_optax.fisher.FisherStatistic` whose damping is built in:
  ``solve(v)`` (= :meth:`ihvp`) and ``inverse_diag()`` take ``damping=None``;
  ``count`` is ``m`` and ``kind`` is ``"empirical"``. Callers that combine
  the factor with trees of their own check them with
  :meth:`check_compatible`.

  Attributes:
    whitened: ``Z`` (or ``W``); a stacked tree (leading axis ``m``) shaped
      like the gradients, or ``(num_blocks, r, block_size)`` when blocked,
      with ``r = min(m, block_size)``.
    chol: ``L``, shape ``(m, m)`` or ``(num_blocks, r, r)``.
    damping: ``lambda``, a scalar array.
    block_size: ``None`` or the static block size.
    direct: whether the blocks keep ``W`` (``m >= block_size``).
  """

  def __init__(
    self,
    whitened: PyTree,
    chol: jax.Array,
    damping: jax.Array,
    block_size: int | None,
    treedef: Any,
    shapes: tuple[tuple[int, ...], ...],
    num_grads: int,
    direct: bool = False,
  ):
    self.whitened = whitened
    self.chol = chol
    self.damping = damping
    self.block_size = block_size
    self.direct = direct
    self._treedef = treedef
    self._shapes = shapes
    self._num_grads = num_grads

  def tree_flatten(self):
    return (
      (self.whitened, self.chol, self.damping),
      (
        self.block_size,
        self._treedef,
        self._shapes,
        self._num_grads,
        self.direct,
      ),
    )

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, *aux)

  # -- shapes ------------------------------------------------------------------

  @property
  def num_grads(self) -> int:
    """``m``, the number of rank-one terms."""
    return self._num_grads

  @property
  def dim(self) -> int:
    """``d``, the number of parameters."""
    return sum(math.prod(s) for s in self._shapes)

  @property
  def count(self) -> jax.Array:
    """``m`` as an int32 scalar: the Fisher is a mean over ``m`` gradients."""
    return jnp.asarray(self._num_grads, jnp.int32)

  @property
  def kind(self) -> str:
    """``"empirical"``: a mean of outer products of the given gradients."""
    return "empirical"

  def check_compatible(self, v: PyTree, what: str = "v") -> None:
    """Raises ``ValueError`` unless ``v`` is shaped like one gradient.

    Every product checks its argument this way; callers that only read the
    factor (e.g. a pruner combining ``inverse_diag`` with the weights) can
    check their own trees with it.

    Args:
      v: a tree that should have the gradients' structure and leaf shapes
        (without the stacking axis ``m``).
      what: the argument's name in the error message.
    """
    ref = jax.tree.unflatten(
      self._treedef,
      [jax.ShapeDtypeStruct(s, jnp.float32) for s in self._shapes],
    )
    validation.check_same_structure(
      ref, v, what=what, reference_name="the gradients"
    )
    for leaf, shape in zip(jax.tree.leaves(v), self._shapes):
      if jnp.shape(leaf) != shape:
        raise ValueError(
          f"{what} leaf has shape {jnp.shape(leaf)}, expected {shape} "
          "(one gradient without the stacking axis)."
        )

  def is_finite(self) -> jax.Array:
    """Whether the factor (``Z``, ``L`` and the damping) is finite."""
    return numerics.tree_all_finite((self.whitened, self.chol, self.damping))

  def _to_blocks(self, v: PyTree) -> jax.Array:
    if self.block_size is None:
      raise ValueError("only a blocked factor has blocks.")
    return _flat_blocks(v, self.block_size, self.chol.shape[0], ())

  def _from_blocks(self, x: jax.Array, like: PyTree) -> PyTree:
    return self._like(numerics.unravel(x.reshape(-1)[: self.dim], like), like)

  # -- products ------------------------------------------------------------------

  def _inverse(self, eye: Any, cross: jax.Array) -> jax.Array:
    """``[F^{-1}]`` from ``eye`` (``I``'s entries) and ``cross`` (``Z^T Z``'s)."""
    if self.direct:
      return cross
    return (eye - cross) / self.damping.astype(cross.dtype)

  def _wide(self, v: PyTree) -> PyTree:
    """``v`` in the factor's dtype or wider (bfloat16 and integer ``v``)."""
    dtype = self.chol.dtype
    return jax.tree.map(
      lambda a: jnp.asarray(a, jnp.promote_types(jnp.result_type(a), dtype)),
      v,
    )

  def _like(self, out: PyTree, v: PyTree) -> PyTree:
    """``out`` in ``v``'s float dtypes (integer ``v``: the factor's)."""
    return jax.tree.map(lambda o, a: o.astype(_float_dtype(a, o)), out, v)

  def ihvp(self, v: PyTree) -> PyTree:
    """Returns ``F^{-1} v`` in ``O(d m)``, in ``v``'s (float) dtypes."""
    self.check_compatible(v, "v")
    if self.block_size is None:
      x = self._wide(v)
      zv = linalg.tree_stacked_dot(self.whitened, x)
      corr = linalg.tree_stacked_combine(self.whitened, zv)
      out = jax.tree.map(
        lambda a, c: self._inverse(a, c.astype(a.dtype)), x, corr
      )
      return self._like(out, v)
    x = self._to_blocks(self._wide(v))
    hi = jax.lax.Precision.HIGHEST
    zx = jnp.einsum("bmk,bk->bm", self.whitened, x, precision=hi)
    out = self._inverse(
      x, jnp.einsum("bmk,bm->bk", self.whitened, zx, precision=hi)
    )
    return self._from_blocks(out, v)

  def solve(self, v: PyTree, damping: None = None) -> PyTree:
    """Returns ``F^{-1} v``: :meth:`ihvp` under the statistics' interface.

    Args:
      v: a tree shaped like one gradient.
      damping: must be ``None``: the damping is part of the factorization
        (:func:`sum_of_rank_one`); refactor to change it.
    """
    _check_own_damping(damping, "solve")
    return self.ihvp(v)

  def matvec(self, v: PyTree) -> PyTree:
    """Returns ``F v`` in ``O(d m + m^2)`` (``G = L Z``, never stored)."""
    self.check_compatible(v, "v")
    lam, m = self.damping, self.num_grads
    hi = jax.lax.Precision.HIGHEST
    if self.block_size is None:
      x = self._wide(v)
      zv = linalg.tree_stacked_dot(self.whitened, x)
      llz = jnp.matmul(
        self.chol.T, jnp.matmul(self.chol, zv, precision=hi), precision=hi
      )
      corr = linalg.tree_stacked_combine(self.whitened, llz / m)
      out = jax.tree.map(
        lambda a, c: lam.astype(a.dtype) * a + c.astype(a.dtype), x, corr
      )
      return self._like(out, v)
    x = self._to_blocks(self._wide(v))
    if self.direct:  # F = L L^T / m
      lx = jnp.einsum("bji,bj->bi", self.chol, x, precision=hi)
      out = jnp.einsum("bij,bj->bi", self.chol, lx, precision=hi) / m
      return self._from_blocks(out, v)
    zx = jnp.einsum(
      "bmk,bk->bm", self.whitened, x, precision=jax.lax.Precision.HIGHEST
    )
    llz = jnp.einsum(
      "bji,bjk,bk->bi",
      self.chol,
      self.chol,
      zx,
      precision=jax.lax.Precision.HIGHEST,
    )
    out = (
      lam * x
      + jnp.einsum(
        "bmk,bm->bk", self.whitened, llz, precision=jax.lax.Precision.HIGHEST
      )
      / m
    )
    return self._from_blocks(out, v)

  def quadratic_form(self, v: PyTree) -> jax.Array:
    """Returns ``v^T F v``."""
    # In float32 or wider: matvec returns v's dtype (bfloat16 sums lose 3%).
    v = numerics.widen(v)
    fv = self.matvec(v)
    terms = [
      jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(v), jax.tree.leaves(fv))
    ]
    return functools.reduce(jnp.add, terms)

  def inverse_diag(self, damping: None = None) -> PyTree:
    """Returns the diagonal of ``F^{-1}`` shaped like one gradient, ``O(d m)``.

    ``damping`` must be ``None`` (the factor's own), as in :meth:`solve`.
    """
    _check_own_damping(damping, "inverse_diag")
    if self.block_size is None:
      return jax.tree.map(
        lambda z: self._inverse(1.0, jnp.sum(jnp.square(z), axis=0)),
        self.whitened,
      )
    out = self._inverse(1.0, jnp.sum(jnp.square(self.whitened), axis=1))
    like = jax.tree.unflatten(
      self._treedef,
      [jax.ShapeDtypeStruct(s, self.whitened.dtype) for s in self._shapes],
    )
    return self._from_blocks(out, like)

  def whitened_columns(self, index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Returns the columns ``z_i`` of ``Z`` at flat indices and their blocks.

    Args:
      index: int array of flat parameter indices (``ravel_pytree`` order).

    Returns:
      ``(columns, block)``: columns of shape ``(*index.shape, m)``, and the
      block id of every index (all zeros when unblocked).
    """
    if not isinstance(index, jax.core.Tracer):
      bad = np.asarray(index)
      bad = bad[(bad < 0) | (bad >= self.dim)]
      if bad.size:
        raise ValueError(
          f"flat indices must lie in [0, {self.dim}); got {bad.tolist()}."
        )
    index = jnp.asarray(index, jnp.int32)
    if self.block_size is not None:
      block = index // self.block_size
      return self.whitened[block, :, index % self.block_size], block
    cols = jnp.zeros(index.shape + (self.chol.shape[-1],), self.chol.dtype)
    offset = 0
    for z, shape in zip(jax.tree.leaves(self.whitened), self._shapes):
      n = math.prod(shape)
      if not n:  # no index falls in a zero-size leaf
        continue
      local = index - offset
      inside = (local >= 0) & (local < n)
      taken = jnp.take(
        z.reshape(z.shape[0], n), jnp.clip(local, 0, n - 1), axis=1
      )  # (m, *index.shape)
      cols = jnp.where(
        inside[..., None], jnp.moveaxis(taken, 0, -1).astype(cols.dtype), cols
      )
      offset += n
    return cols, jnp.zeros_like(index)

  def inverse_entry(self, i: jax.Array, j: jax.Array) -> jax.Array:
    """Returns ``[F^{-1}]_{ij}`` for flat indices (broadcasting), ``O(m)`` each."""
    i, j = jnp.broadcast_arrays(
      jnp.asarray(i, jnp.int32), jnp.asarray(j, jnp.int32)
    )
    zi, bi = self.whitened_columns(i)
    zj, bj = self.whitened_columns(j)
    cross = jnp.where(bi == bj, jnp.sum(zi * zj, axis=-1), 0.0)
    return self._inverse((i == j).astype(cross.dtype), cross)

  def inverse_submatrix(self, index: jax.Array) -> jax.Array:
    """Returns ``[F^{-1}]_{QQ}`` for a 1-D array of flat indices ``Q``."""
    index = jnp.asarray(index, jnp.int32)
    zq, bq = self.whitened_columns(index)
    cross = jnp.where(
      bq[:, None] == bq[None, :],
      jnp.matmul(zq, zq.T, precision=jax.lax.Precision.HIGHEST),
      0.0,
    )
    return self._inverse(jnp.eye(index.shape[0], dtype=cross.dtype), cross)


def _float_dtype(v: Any, out: jax.Array) -> Any:
  """``v``'s dtype if it is a float, else ``out``'s."""
  dtype = jnp.result_type(v)
  return dtype if jnp.issubdtype(dtype, jnp.floating) else out.dtype


def _check_own_damping(damping: Any, method: str) -> None:
  if damping is not None:
    raise ValueError(
      f"RankOneSumFisher.{method} uses the damping it was factored with; "
      "pass damping=None, or call sum_of_rank_one again with the new damping."
    )


def _whiten(stacked: PyTree, chol: jax.Array) -> PyTree:
  """``Z = L^{-1} G`` as a stacked tree (see ``linalg.tril_inverse``)."""
  return linalg.tree_stacked_combine(stacked, linalg.tril_inverse(chol).T)


def _chol(gram: jax.Array, damping: jax.Array, m: int) -> jax.Array:
  """``L`` with ``L L^T = gram + m * damping * I``; NaN for a non-finite
  Gram (1e30 gradients overflow it) without running the Cholesky on it."""
  return numerics.finite_or_nan(
    lambda g, lam: linalg.woodbury_factor(g, lam, 1.0 / m).chol, gram, damping
  )


def sum_of_rank_one(
  grads: PyTree,
  damping: float | jax.Array,
  *,
  block_size: int | None = None,
) -> RankOneSumFisher:
  """Factors the damped empirical Fisher of ``m`` stacked gradients.

  .. math::

    F = \\lambda I + \\frac{1}{m} G^\\top G, \\qquad
    C = G G^\\top + m \\lambda I = L L^\\top, \\quad Z = L^{-1} G, \\qquad
    F^{-1} = \\frac{1}{\\lambda}\\bigl(I - Z^\\top Z\\bigr).

  This is the batched form of M-FAC's static algorithm: its recursion
  ``v_k = F_{k-1}^{-1} g_k``, ``F^{-1} = I/lambda - sum_k v_k v_k^T /
  (m + g_k^T v_k)`` produces exactly the rows of ``Z / sqrt(lambda)``, but a
  Cholesky factor and one triangular solve replace the ``m``-step sequential
  loop. Zero rows (e.g. an unfilled window) add nothing; the ``1/m`` stays.

  Args:
    grads: stacked gradients, a pytree whose leaves carry a leading axis
      ``m`` (e.g. the output of ``fisher_optax.fisher.per_example_grads``).
    damping: ``lambda > 0``.
    block_size: if set (a static int), ``F`` is restricted to its diagonal
      blocks of this many consecutive entries of the flattened parameters
      (the last block is zero-padded) and each block is factored on its own,
      as in M-FAC's pruner. When ``m >= block_size`` a block is factored
      directly: the Cholesky factor ``L`` of ``G^T G + m lambda I`` and
      ``W = sqrt(m) L^{-1}``, so a block costs ``O(m B^2 + B^3)``, stores
      ``B x B`` numbers, and its inverse is ``W^T W``, free of the float32
      cancellation of ``(I - Z^T Z) / lambda`` (which lost all digits of
      ``inverse_diag`` there at small damping). Without ``block_size``, as
      many gradients as weights (``m >= d``) make one such block of all
      ``d`` weights (``block_size`` then reads ``d``).

  Returns:
    A :class:`RankOneSumFisher` with ``ihvp`` (also ``solve``),
    ``inverse_diag``, ``inverse_entry``, ``inverse_submatrix``, ``matvec``,
    ``quadratic_form``, ``is_finite`` and ``check_compatible``. Statistics
    are float32 (float64 for float64 inputs). Non-finite gradients, or
    finite ones whose Gram overflows, give a factor whose ``is_finite()`` is
    False; the Cholesky never sees the non-finite matrix.

  Raises:
    ValueError: for a non-positive damping, leaves without a common leading
      axis, or no leaves at all.
    TypeError: for a non-integer ``block_size``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from fisher_optax import fisher
    >>> g = {"w": jax.random.normal(jax.random.key(0), (8, 3, 2))}
    >>> f = fisher.sum_of_rank_one(g, damping=1e-2)
    >>> f.ihvp({"w": jnp.ones((3, 2))})["w"].shape
    (3, 2)

  References:
    Frantar et al, `M-FAC: Efficient Matrix-Free Approximations of
    Second-Order Information <https://arxiv.org/abs/2107.03356>`_, 2021
  """
  validation.check_positive("damping", damping)
  if block_size is not None:
    validation.check_static_int("block_size", block_size, minimum=1)
  leaves, treedef = jax.tree.flatten(grads)
  if not leaves:
    raise ValueError("sum_of_rank_one needs gradients with at least one leaf.")
  validation.check_real_floating(
    grads, what="grads", function="sum_of_rank_one"
  )
  sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
  m = next(iter(sizes))
  if m is None or len(sizes) != 1:
    raise ValueError(
      "grads must be stacked: every leaf needs the same leading axis m, got "
      f"leading sizes {sorted(str(s) for s in sizes)}."
    )
  if m < 1:
    raise ValueError("grads must hold at least one gradient (m >= 1).")
  shapes = tuple(tuple(jnp.shape(x)[1:]) for x in leaves)
  dtype = numerics.compute_dtype(jnp.result_type(*leaves))
  grads = jax.tree.map(lambda x: jnp.asarray(x, dtype), grads)
  lam = jnp.asarray(damping, dtype)
  d = sum(math.prod(s) for s in shapes)
  if block_size is None and 0 < d <= m:
    block_size = d  # As many gradients as weights: one direct block.
  if block_size is None:
    chol = _chol(linalg.tree_stacked_gram(grads), lam, m)
    return RankOneSumFisher(
      _whiten(grads, chol), chol, lam, None, treedef, shapes, m
    )
  nb = -(-d // block_size)
  blocks = jnp.swapaxes(_flat_blocks(grads, block_size, nb, (m,)), 0, 1)

  # The block's gradients span it: F = (G^T G + m lam I) / m = L L^T / m
  # and F^{-1} = W^T W with W = sqrt(m) L^{-1}, a sum of squares.
  direct = m >= block_size

  def one_block(g):
    if direct:
      h = linalg.symmetrize(
        jnp.matmul(g.T, g, precision=jax.lax.Precision.HIGHEST)
      )
      eye = jnp.eye(block_size, dtype=dtype)
      chol = numerics.finite_or_nan(jnp.linalg.cholesky, h + (m * lam) * eye)
      return math.sqrt(m) * linalg.tril_inverse(chol), chol
    chol = _chol(linalg.tree_stacked_gram(g), lam, m)
    return _whiten(g, chol), chol

  z, chol = jax.vmap(one_block)(blocks)
  return RankOneSumFisher(z, chol, lam, block_size, treedef, shapes, m, direct)
