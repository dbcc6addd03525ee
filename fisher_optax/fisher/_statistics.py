# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Fisher statistics: registered pytrees with the operations consumers need.

Every statistic is a *mean* over ``count`` examples, carries the ``kind`` it
estimates (static metadata), and the mean loss gradient of the same pass
(``mean_grad``, ``None`` when no targets were given). They are frozen
dataclasses registered with :func:`jax.tree_util.register_dataclass`, so
``jit``, ``vmap``, sharding and checkpointing (orbax, with an abstract
target from ``jax.eval_shape``) treat them like any other pytree. Statistics
are float32 (or wider); vectors passed to ``matvec``/``solve`` keep their
own dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from fisher_optax.fisher import linalg

PyTree = Any


def _register(cls, data, meta):
  return jax.tree_util.register_dataclass(
    dataclasses.dataclass(frozen=True)(cls), data_fields=data, meta_fields=meta
  )


def all_finite(tree: PyTree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def _wide(x: jax.Array) -> jax.Array:
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


class DiagonalFisher:
  """Diagonal Fisher ``F = diag(diag)``.

  Attributes:
    diag: params-shaped tree, ``mean_n sum_s g_{s,n}^2``.
    mean_grad: params-shaped mean loss gradient (or ``None``).
    count: int32 number of examples ``N`` the means are over.
    kind: ``"empirical" | "mc" | "exact" | "batch_squared"``.
  """

  diag: PyTree
  mean_grad: PyTree
  count: jax.Array
  kind: str = "empirical"

  def matvec(self, v: PyTree) -> PyTree:
    """``F v``, in ``v``'s dtype."""
    return jax.tree.map(
      lambda d, x: (d * _wide(x)).astype(x.dtype), self.diag, v
    )

  def quadratic_form(self, v: PyTree) -> jax.Array:
    """``v^T F v`` (a float32 scalar)."""
    terms = jax.tree.leaves(
      jax.tree.map(lambda d, x: jnp.sum(d * jnp.square(_wide(x))), self.diag, v)
    )
    return sum(terms, jnp.zeros((), jnp.float32))

  def solve(self, v: PyTree, damping: float | jax.Array) -> PyTree:
    """``(F + damping I)^{-1} v``."""
    return jax.tree.map(
      lambda d, x: (_wide(x) / (d + damping)).astype(x.dtype), self.diag, v
    )

  def is_finite(self) -> jax.Array:
    """Whether every entry is finite (non-finite inputs propagate here)."""
    return all_finite(self.diag)


DiagonalFisher = _register(
  DiagonalFisher, ["diag", "mean_grad", "count"], ["kind"]
)


class LowRankFisher:
  """Low-rank Fisher ``F = sum_j eigvals[j] v_j v_j^T``.

  The ``v_j`` are orthonormal over the whole tree (or over each leaf for a
  per-leaf statistic, see :func:`fisher_optax.fisher.low_rank`). Directions
  of numerically zero eigenvalues are zero vectors with eigenvalue 0.

  Attributes:
    eigvals: ``(k,)`` descending, float32.
    eigvecs: params-shaped tree, leaves with a leading ``k`` axis.
    mean_grad: params-shaped mean loss gradient (or ``None``).
    count: int32 number of examples.
    kind: the Fisher kind.
  """

  eigvals: jax.Array
  eigvecs: PyTree
  mean_grad: PyTree
  count: jax.Array
  kind: str = "empirical"

  @property
  def rank(self) -> int:
    return self.eigvals.shape[-1]

  def project(self, v: PyTree) -> jax.Array:
    """Coordinates ``V v`` of shape ``(k,)``."""
    return linalg.tree_stacked_dot(self.eigvecs, jax.tree.map(_wide, v))

  def matvec(self, v: PyTree) -> PyTree:
    """``F v = V^T diag(eigvals) V v``."""
    out = linalg.tree_stacked_combine(
      self.eigvecs, self.eigvals * self.project(v)
    )
    return jax.tree.map(lambda o, x: o.astype(x.dtype), out, v)

  def quadratic_form(self, v: PyTree) -> jax.Array:
    """``v^T F v = sum_j eigvals[j] (v_j . v)^2``."""
    return jnp.sum(self.eigvals * jnp.square(self.project(v)))

  def solve(self, v: PyTree, damping: float | jax.Array) -> PyTree:
    """``(F + damping I)^{-1} v`` in closed form (``V`` orthonormal)."""
    coef = self.eigvals / (damping * (self.eigvals + damping))
    corr = linalg.tree_stacked_combine(self.eigvecs, coef * self.project(v))
    return jax.tree.map(
      lambda x, c: (_wide(x) / damping - c).astype(x.dtype), v, corr
    )

  def is_finite(self) -> jax.Array:
    return jnp.logical_and(all_finite(self.eigvals), all_finite(self.eigvecs))


LowRankFisher = _register(
  LowRankFisher, ["eigvals", "eigvecs", "mean_grad", "count"], ["kind"]
)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
  """A leaf's matrix view: ``(*s, n) -> (prod(s), n)``, ``(n,) -> (1, n)``."""
  if not shape:
    return (1, 1)
  return (math.prod(shape[:-1]), shape[-1])


class KroneckerFisher:
  """Per-leaf Kronecker-factored Fisher ``F_leaf = left ⊗ right``.

  Each leaf ``W`` is viewed as a matrix ``(m, n)`` (:func:`matrix_shape`: all
  but the last axis are rows; a vector is one row) and its Fisher block on
  the row-major ``vec(W)`` is ``left ⊗ right``, i.e. ``F vec(V) =
  vec(left @ V @ right)``. For a dense kernel ``(d_in, d_out)`` under K-FAC,
  ``left = E[a a^T]`` and ``right = E[delta delta^T]``.

  Attributes:
    left: params-shaped tree of ``(m, m)`` float32 matrices.
    right: params-shaped tree of ``(n, n)`` float32 matrices.
    mean_grad: params-shaped mean loss gradient (or ``None``).
    count: int32 number of examples.
    kind: the Fisher kind.
    estimator: ``"kfac"`` (layer statistics), ``"shampoo"`` (one
      nearest-Kronecker step from the identity) or ``"nearest"`` (several
      power-iteration steps); a per-leaf mix is reported as ``"mixed"``.
  """

  left: PyTree
  right: PyTree
  mean_grad: PyTree
  count: jax.Array
  kind: str = "empirical"
  estimator: str = "kfac"

  def matvec(self, v: PyTree) -> PyTree:
    """``F v`` leaf by leaf: ``left @ V @ right``."""

    def leaf(l, r, x):
      m = _wide(x).reshape(matrix_shape(x.shape))
      return (l @ m @ r).reshape(x.shape).astype(x.dtype)

    return jax.tree.map(leaf, self.left, self.right, v)

  def quadratic_form(self, v: PyTree) -> jax.Array:
    """``v^T F v = sum_leaves <V, left V right>``."""

    def leaf(l, r, x):
      m = _wide(x).reshape(matrix_shape(x.shape))
      return jnp.sum(m * (l @ m @ r))

    return sum(
      jax.tree.leaves(jax.tree.map(leaf, self.left, self.right, v)),
      jnp.zeros((), jnp.float32),
    )

  def solve(self, v: PyTree, damping: float | jax.Array) -> PyTree:
    """``(left ⊗ right + damping I)^{-1} v`` exactly, by two ``eigh``.

    With ``left = Q_a diag(a) Q_a^T`` and ``right = Q_b diag(b) Q_b^T``:
    ``X = Q_a [(Q_a^T V Q_b) / (a b^T + damping)] Q_b^T``.
    """

    def leaf(l, r, x):
      m = _wide(x).reshape(matrix_shape(x.shape))
      a, qa = jnp.linalg.eigh(linalg.symmetrize(l))
      b, qb = jnp.linalg.eigh(linalg.symmetrize(r))
      inner = (qa.T @ m @ qb) / (a[:, None] * b[None, :] + damping)
      return (qa @ inner @ qb.T).reshape(x.shape).astype(x.dtype)

    return jax.tree.map(leaf, self.left, self.right, v)

  def diagonal(self, like: PyTree | None = None) -> PyTree:
    """The diagonal of ``left ⊗ right``, shaped like ``like`` (default
    ``mean_grad``; matrix-shaped ``(m, n)`` leaves when both are ``None``)."""
    like = self.mean_grad if like is None else like
    mats = jax.tree.map(
      lambda l, r: jnp.outer(jnp.diag(l), jnp.diag(r)), self.left, self.right
    )
    if like is None:
      return mats
    return jax.tree.map(lambda d, p: d.reshape(jnp.shape(p)), mats, like)

  def is_finite(self) -> jax.Array:
    return jnp.logical_and(all_finite(self.left), all_finite(self.right))


KroneckerFisher = _register(
  KroneckerFisher,
  ["left", "right", "mean_grad", "count"],
  ["kind", "estimator"],
)
