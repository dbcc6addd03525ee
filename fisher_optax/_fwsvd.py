# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Fisher-weighted low-rank compression: FWSVD and generalized (Kronecker) FWSVD.

Weights follow the Flax kernel layout: ``W`` has shape ``(n_in, n_out)`` and
a dense layer computes ``y = x W``. Both functions return factors ``(a, b)``
with ``W ~ a @ b``, ``a`` of shape ``(n_in, rank)`` and ``b`` of shape
``(rank, n_out)``, so the layer becomes two dense layers ``x -> x a -> x a b``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from fisher_optax import fisher
from fisher_optax.fisher import numerics
from fisher_optax.fisher import validation

_AXES = ("in", "out")
_SPLITS = ("left", "balanced")
_HIGHEST = jax.lax.Precision.HIGHEST


def _check_matrix(name: str, x: Any, shape: tuple[int, ...] | None = None):
  if jnp.ndim(x) != 2:
    raise ValueError(f"{name} must be a matrix, got shape {jnp.shape(x)}.")
  if shape is not None and jnp.shape(x) != shape:
    raise ValueError(f"{name} must have shape {shape}, got {jnp.shape(x)}.")


def _check_rank(rank: Any, w: jax.Array) -> int:
  rank = validation.check_static_int("rank", rank, minimum=1)
  if rank > min(w.shape):
    raise ValueError(
      f"rank must be <= min{tuple(w.shape)} = {min(w.shape)}, got {rank}."
    )
  return rank


def _kernel_diag(fisher_diag: Any) -> Any:
  """The kernel's Fisher diagonal from an array or a ``DiagonalFisher``."""
  if not isinstance(fisher_diag, fisher.DiagonalFisher):
    return fisher_diag
  diag = fisher_diag.diag
  if not isinstance(diag, (jax.Array, np.ndarray)):
    raise TypeError(
      "fisher_diag: a DiagonalFisher of several leaves holds no single "
      "kernel's Fisher; pass that kernel's leaf of its .diag."
    )
  return diag


def _check_feature_weights(weights: jax.Array, what: str) -> None:
  """Concrete summed Fishers (plus eps): finite and positive."""
  if isinstance(weights, jax.core.Tracer):
    return
  arr = np.asarray(weights)
  if not np.all(np.isfinite(arr)):
    raise ValueError(
      f"fisher_diag: the summed Fisher of {what} "
      f"{np.flatnonzero(~np.isfinite(arr)).tolist()} overflows "
      f"{arr.dtype}; divide the Fisher by a common factor."
    )
  if np.any(arr <= 0):
    raise ValueError(
      f"fisher_diag: {what} {np.flatnonzero(arr <= 0).tolist()} have zero "
      "total Fisher and eps=0: a feature of zero weight leaves its part of "
      "the factors undetermined; pass eps > 0."
    )


def _truncated(wt: jax.Array, rank: int, split: str):
  u, s, vt = jnp.linalg.svd(wt, full_matrices=False)
  u, s, vt = u[:, :rank], s[:rank], vt[:rank]
  if split == "left":
    return u * s, vt
  root = jnp.sqrt(s)
  return u * root, root[:, None] * vt


def fisher_weighted_svd(
  w: jax.Array,
  fisher_diag: jax.Array | fisher.DiagonalFisher,
  rank: int,
  *,
  weight_axis: str = "in",
  two_sided: bool = False,
  eps: float = 1e-5,
  split: str = "left",
) -> tuple[jax.Array, jax.Array]:
  """Fisher-weighted SVD (FWSVD) of a dense kernel from its diagonal Fisher.

  FWSVD minimises the Fisher-weighted error with one weight per row group,
  which a plain SVD solves after rescaling. With ``weight_axis="in"``
  (the default) every input feature ``i`` gets ``r_i = sum_j F_ij``:

  .. math::

    S = \\operatorname{diag}(\\sqrt{r + \\epsilon \\bar r}), \\quad
    S W = U \\Sigma V^\\top, \\quad
    W \\approx \\underbrace{S^{-1} U_r \\Sigma_r}_{a}\\,
               \\underbrace{V_r^\\top}_{b},

  with ``r_bar`` the mean of ``r`` (``eps`` is relative), the exact
  minimiser of ``sum_ij (r_i + eps r_bar) (W - a b)_ij^2`` over rank-``r``
  factors. ``weight_axis="out"`` weighs output features,
  ``c_j = sum_i F_ij``, and rescales columns instead; ``two_sided=True``
  uses both (``sqrt(r) W sqrt(c)``), which is the diagonal-factor case of
  :func:`generalized_fwsvd`.

  Axis convention (a documented choice): the paper sums the Fisher "per row"
  of its weight matrix without fixing a layer layout; the public code sums
  over the output axis of a ``y = x W`` kernel, i.e. one weight per input
  feature. That is our ``"in"`` default; ``"out"`` gives the other reading.
  The weighting is exact for any Fisher that is constant along the summed
  axis and an approximation otherwise.

  Args:
    w: the kernel, shape ``(n_in, n_out)``.
    fisher_diag: its diagonal Fisher, same shape, finite and non-negative
      (checked when concrete; under ``jit`` the values cannot be
      inspected): an array (e.g. that kernel's leaf of
      ``fisher_optax.fisher.diagonal(...).diag``) or a
      :class:`fisher_optax.fisher.DiagonalFisher` of the kernel alone.
    rank: the target rank, a static int ``<= min(n_in, n_out)``.
    weight_axis: ``"in"`` or ``"out"`` (ignored when ``two_sided``).
    two_sided: weigh both input and output features.
    eps: relative regularisation: ``eps`` times the mean summed Fisher
      ``r_bar`` of the weighted side is added to each summed Fisher before
      the square root, so features with zero Fisher stay invertible and the
      result does not depend on the Fisher's scale (a Fisher ``c F`` gives
      the factors of ``F`` for any ``c > 0``). For an all-zero Fisher
      (``r_bar = 0``) ``eps`` itself is added: equal weights, a plain SVD.
      ``eps=0`` needs a positive total Fisher on every weighted feature:
      one with zero total Fisher has zero weight in the objective, so its
      row (column) of ``a @ b`` is not determined; that is refused eagerly,
      and gives non-finite factors under ``jit``.
    split: ``"left"`` (``a = S^{-1} U Sigma``, ``b = V^T``, the paper's form)
      or ``"balanced"`` (``sqrt(Sigma)`` on each side).

  Returns:
    ``(a, b)`` with ``a @ b`` the rank-``rank`` approximation, in ``w``'s
    dtype (computed in float32 or wider).

  Raises:
    ValueError: for a concrete Fisher with non-finite or negative entries,
      a weighted feature whose summed Fisher overflows, or ``eps=0`` with a
      weighted feature of zero total Fisher; and for bad shapes or options.

  Example::

    >>> import jax, jax.numpy as jnp, fisher_optax
    >>> w = jax.random.normal(jax.random.key(0), (6, 4))
    >>> a, b = fisher_optax.fisher_weighted_svd(w, jnp.ones_like(w), rank=2)
    >>> a.shape, b.shape
    ((6, 2), (2, 4))

  With the engine's diagonal of per-example gradients ``(B, 6, 4)``:

    >>> from fisher_optax import fisher
    >>> g = jax.random.normal(jax.random.key(1), (8, 6, 4))
    >>> stat = fisher.diagonal_from_grads(g)
    >>> a, b = fisher_optax.fisher_weighted_svd(w, stat, rank=2)
    >>> a2, b2 = fisher_optax.fisher_weighted_svd(w, stat.diag, rank=2)
    >>> bool(jnp.allclose(a @ b, a2 @ b2))
    True

  References:
    Hsu et al, `Language model compression with weighted low-rank
    factorization <https://arxiv.org/abs/2207.00112>`_, 2022
  """
  _check_matrix("w", w)
  fisher_diag = _kernel_diag(fisher_diag)
  _check_matrix("fisher_diag", fisher_diag, jnp.shape(w))
  rank = _check_rank(rank, w)
  validation.check_choice("weight_axis", weight_axis, _AXES)
  two_sided = validation.check_flag("two_sided", two_sided)
  validation.check_choice("split", split, _SPLITS)
  validation.check_scalar("eps", eps)
  validation.check_positive("eps", eps, allow_zero=True)
  validation.check_fisher_leaf(fisher_diag, name="fisher_diag")
  dtype = numerics.compute_dtype(w)
  wf = w.astype(dtype)
  fd = jnp.asarray(fisher_diag, dtype)
  use_rows = two_sided or weight_axis == "in"
  use_cols = two_sided or weight_axis == "out"

  def scale(use: bool, axis: int, what: str) -> jax.Array:
    """The square roots of one side's summed Fisher (ones when unused)."""
    if not use:
      return jnp.ones(fd.shape[1 - axis], dtype)
    sums = jnp.sum(fd, axis=axis)
    # eps relative to the mean, so the result is invariant to the Fisher's
    # scale; an all-zero Fisher falls back to the absolute eps (equal
    # weights). Dividing before summing keeps the mean from overflowing.
    mean = jnp.sum(sums / sums.shape[0])
    sums = sums + eps * jnp.where(mean > 0, mean, 1.0)
    _check_feature_weights(sums, what)
    return jnp.sqrt(sums)

  rows = scale(use_rows, 1, "input features (rows of w)")
  cols = scale(use_cols, 0, "output features (columns of w)")
  a, b = _truncated(rows[:, None] * wf * cols[None, :], rank, split)
  return (a / rows[:, None]).astype(w.dtype), (b / cols[None, :]).astype(
    w.dtype
  )


def _damped_cholesky(x: jax.Array, damping: Any, name: str) -> jax.Array:
  """The Cholesky factor of ``x + damping * mean(eigenvalues) * I``.

  Concrete factors are checked (non-finite entries, or a factor whose
  Cholesky fails); traced ones cannot be, and give NaN.
  """
  if not isinstance(x, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(x))):
    raise ValueError(f"{name} has non-finite entries.")
  x = 0.5 * (x + x.T)
  n = x.shape[0]
  # Damping relative to the mean eigenvalue, so it is scale-free. A factor
  # without a positive mean (all zero) gets damping * I: uniform weights on
  # that side, i.e. a plain SVD there.
  mean = jnp.sum(jnp.diagonal(x) / n)
  shift = damping * jnp.where(mean > 0, mean, 1.0)
  chol = jnp.linalg.cholesky(x + shift * jnp.eye(n, dtype=x.dtype))
  # Checked on the factor itself: a traced damping makes it traced too.
  if not isinstance(chol, jax.core.Tracer) and not bool(
    jnp.all(jnp.isfinite(chol))
  ):
    raise ValueError(
      f"{name} is not positive semi-definite, or is singular with "
      f"damping={damping}, or overflows {x.dtype}: its damped Cholesky "
      f"factor is not finite. Pass a PSD {name} and, for a singular one, "
      "damping > 0."
    )
  return chol


def generalized_fwsvd(
  w: jax.Array,
  left: jax.Array,
  right: jax.Array,
  rank: int,
  *,
  damping: float = 1e-6,
  split: str = "left",
) -> tuple[jax.Array, jax.Array]:
  """Generalized FWSVD: the optimal low-rank ``W`` under a Kronecker Fisher.

  For ``F = A \\otimes B`` on the row-major ``vec(W)`` of a kernel ``W``
  (``A``: ``n_in x n_in``, ``B``: ``n_out x n_out``), with
  ``A = L_A L_A^T`` and ``B = L_B L_B^T``,

  .. math::

    \\operatorname{vec}(\\Delta)^\\top F \\operatorname{vec}(\\Delta)
      = \\lVert L_A^\\top \\Delta L_B \\rVert_F^2, \\qquad
    \\widehat W = L_A^{-\\top}\\,
      \\bigl[L_A^\\top W L_B\\bigr]_r\\, L_B^{-1},

  where ``[.]_r`` is the truncated SVD: the Eckart-Young optimum in the
  Fisher norm. ``A = B = I`` is the plain SVD, diagonal ``A`` and ``B`` the
  two-sided :func:`fisher_weighted_svd`.

  Convention: the paper writes ``W`` as ``(n_out, n_in)`` (its
  ``L_B^{-T} W_r L_A^{-1}``); with a Flax kernel ``(n_in, n_out)`` the same
  estimator reads as above, with ``A`` the input-side factor (K-FAC's
  ``E[x x^T]``) and ``B`` the output-side one (``E[delta delta^T]``).

  Args:
    w: the kernel, shape ``(n_in, n_out)``.
    left: ``A``, PSD ``(n_in, n_in)``; e.g. ``k.left[name]`` of a
      ``fisher_optax.fisher.KroneckerFisher`` ``k`` (K-FAC or the nearest
      Kronecker product of per-example gradients, as in the paper).
    right: ``B``, PSD ``(n_out, n_out)``; e.g. ``k.right[name]``.
    rank: the target rank, a static int ``<= min(n_in, n_out)``.
    damping: each factor gets ``damping * mean(eigenvalues)`` added to its
      diagonal before the Cholesky (relative, so factor scale is
      irrelevant). A factor whose mean eigenvalue is not positive (an
      all-zero one) gets ``damping`` itself: that side is weighed
      uniformly, a plain SVD on that side. ``damping=0`` needs
      positive-definite factors.
    split: ``"left"`` (singular values in ``a``) or ``"balanced"``.

  Returns:
    ``(a, b)`` with ``a @ b = W_hat``, in ``w``'s dtype.

  Raises:
    ValueError: for concrete factors with non-finite entries, or whose
      damped Cholesky factor is not finite (a factor that is not positive
      semi-definite, or a singular one with ``damping=0``); and for bad
      shapes or options. Under ``jit`` the values cannot be checked and
      such factors give NaN results.

  Example::

    >>> import jax, jax.numpy as jnp, fisher_optax
    >>> w = jax.random.normal(jax.random.key(0), (6, 4))
    >>> a, b = fisher_optax.generalized_fwsvd(w, jnp.eye(6), jnp.eye(4), 2)
    >>> (a @ b).shape
    (6, 4)

  References:
    Chekalina et al, `Generalized Fisher-Weighted SVD: Scalable
    Kronecker-Factored Fisher Approximation for Compressing Large Language
    Models <https://arxiv.org/abs/2505.17974>`_, 2025

    Hsu et al, `Language model compression with weighted low-rank
    factorization <https://arxiv.org/abs/2207.00112>`_, 2022
  """
  _check_matrix("w", w)
  n_in, n_out = jnp.shape(w)
  _check_matrix("left", left, (n_in, n_in))
  _check_matrix("right", right, (n_out, n_out))
  rank = _check_rank(rank, w)
  validation.check_scalar("damping", damping)
  validation.check_positive("damping", damping, allow_zero=True)
  validation.check_choice("split", split, _SPLITS)
  dtype = numerics.compute_dtype(w)
  la = _damped_cholesky(jnp.asarray(left, dtype), damping, "left")
  lb = _damped_cholesky(jnp.asarray(right, dtype), damping, "right")
  wt = jnp.matmul(
    jnp.matmul(la.T, w.astype(dtype), precision=_HIGHEST),
    lb,
    precision=_HIGHEST,
  )
  u, v = _truncated(wt, rank, split)
  # a = L_A^{-T} u,  b = v L_B^{-1}  (triangular solves, no inverses).
  a = jax.scipy.linalg.solve_triangular(la, u, lower=True, trans=1)
  b = jax.scipy.linalg.solve_triangular(lb, v.T, lower=True, trans=1).T
  return a.astype(w.dtype), b.astype(w.dtype)
