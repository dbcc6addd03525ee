# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Elastic weight consolidation: diagonal, rank-1, low-rank and mixed penalties.

A finished task ``k`` leaves an anchor ``theta*_k`` and a Fisher ``F_k``; later
training adds the quadratic penalty

.. math::

  R(\\theta) = \\frac{\\lambda}{2} \\sum_k (\\theta - \\theta^*_k)^\\top F_k
      (\\theta - \\theta^*_k), \\qquad
  \\nabla R = \\lambda \\sum_k F_k (\\theta - \\theta^*_k).

Everything a penalty needs is an :class:`EWCAnchor` of fixed shapes: a
:class:`DiagonalEWC` (precision and precision-weighted anchor, ``2P`` numbers
for any number of tasks) and/or a :class:`LowRankEWC` (``K`` slots of one
direction, one scale and one anchor projection each, and one constant;
``K P + 2K + 1`` numbers).
:func:`consolidate` folds a new task into an anchor at fixed shapes, so the
jitted training step never retraces when the task changes.

Decisions:

* **Scale.** ``R = lambda/2 D^T F D`` so ``grad R = lambda F D``; Avalanche and
  the reference code have no ``1/2`` (``lambda_ours = 2 lambda_theirs``).
  ``F`` is a *mean* over examples, so ``lambda`` does not grow with the data
  size. ``F`` inherits the per-example loss reduction: a pixel-*mean* MSE
  (diffusion) gives a Fisher ``1/D^2`` times that of a pixel-sum loss, and
  ``lambda`` must be ``D^2`` larger. BATCHED Fisher (squared mini-batch
  gradients, ``kind="batch_squared"`` per batch) is about ``F / b + mu mu^T``:
  its best ``lambda`` is about ``b`` times larger.
* **Rank-1.** The direction is the mean gradient, as in the paper (the top
  eigenvector is available through ``fisher.rank_one(direction="top_eig")``
  or ``fisher.low_rank(rank=1)``); the scale is none (paper ``rank1``), the
  Frobenius-optimal ``c*`` (paper ``rank1_opt``) or the eigenvalue. Plain
  ``rank1`` is kept although ``mu -> 0`` at a converged classifier, where its
  curvature ``|mu|^2`` vanishes; with ``c*`` the curvature along ``mu`` is the
  Rayleigh quotient ``mu^T F mu / |mu|^2``, which does not.
  Diagonal plus low rank is allowed (no source does it).
* **Low rank across tasks.** Fixed slots (default, exact: one slot per task
  and direction) or re-compression to the top ``K`` eigenpairs of the sum.
* **AlignGuard.** Its ``l_A sum_i s_i (u_i . D)^2`` term is this low-rank
  penalty (``strength = 2 l_A``) with a Fisher on alignment data; its
  diagonal ``l_T`` term is a diagonal anchor. The collision terms are not
  provided: under an exact projector ``E_geo = 0``, and under a coordinate
  mask both vanish, so they only matter when ``D_A`` and ``D_T`` are
  separate parameters.
* **Model mode.** Compute the Fisher with the model in evaluation mode (no
  dropout, frozen batch-norm statistics): the engine assumes examples do not
  interact. For LoRA, compute it on the LoRA factors you train (see
  :func:`add_ewc_gradient`), not on the merged weight.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fisher_optax import fisher
from fisher_optax.fisher import linalg
from fisher_optax.fisher import numerics
from fisher_optax.fisher import validation

PyTree = Any

_MODES = ("separate", "online")
_LOW_RANK_UPDATES = ("slots", "compress")
_HIGHEST = jax.lax.Precision.HIGHEST


class DiagonalEWC(NamedTuple):
  """Sum of diagonal EWC quadratics in merged form (``2P + 1`` numbers).

  ``sum_k gamma^(T-k) F_k * (theta - theta*_k)^2`` equals
  ``precision * (theta - anchor)^2 + residual`` exactly, with
  ``precision = sum_k gamma^(T-k) F_k`` and ``anchor`` the precision-weighted
  mean of the ``theta*_k``.

  Attributes:
    precision: params-shaped, ``sum_k gamma^(T-k) F_k`` (float32 or wider).
    anchor: params-shaped, precision-weighted mean of the task anchors.
    residual: scalar, the penalty's minimum ``sum F_k (anchor - theta*_k)^2``
      (0 for one task or in online mode); it keeps the merged penalty value,
      not only its gradient, equal to the sum of the separate ones.
  """

  precision: PyTree
  anchor: PyTree
  residual: jax.Array


class LowRankEWC(NamedTuple):
  """``K`` rank-one EWC terms ``sum_k s_k (u_k . theta - a_k)^2 + residual``
  (``KP + 2K + 1`` numbers).

  No anchor vector is stored: ``a_k = u_k . theta*`` is all the penalty needs.

  Precision: the penalty forms ``u_k . theta - a_k`` from two numbers of
  magnitude about ``|u_k . theta*|``, so a move ``theta - theta*`` is
  resolved only down to the float rounding of ``|u_k . theta*|`` (about
  ``1e-7`` times it in float32); smaller moves are lost to cancellation
  and the penalty is too large there. Far from the anchor this does not
  matter. Enabling x64 (``jax.config.update("jax_enable_x64", True)``
  with float64 params) avoids that floor, and so does the diagonal part,
  which stores ``theta*`` itself.

  Attributes:
    vectors: params-shaped leaves with a leading ``K`` axis, ``u_k``.
    scales: ``(K,)`` nonnegative ``s_k``; an empty slot has scale 0.
    anchor_proj: ``(K,)`` ``a_k``.
    residual: scalar, the constant left when ``low_rank_update="compress"``
      merges terms with different anchors (the minimum of the merged terms,
      as :class:`DiagonalEWC`'s ``residual``); it keeps the merged penalty
      value, not only its gradient, equal to the sum of the separate ones.
      0 until such a merge, and in online mode. Defaults to ``0.0``, so a
      ``LowRankEWC`` built from the other three fields still works.
  """

  vectors: PyTree
  scales: jax.Array
  anchor_proj: jax.Array
  residual: jax.Array | float = 0.0


class EWCAnchor(NamedTuple):
  """What an EWC penalty remembers: a diagonal part, a low-rank part, or both.

  Attributes:
    diagonal: a :class:`DiagonalEWC` or ``None``.
    low_rank: a :class:`LowRankEWC` or ``None``.
  """

  diagonal: DiagonalEWC | None
  low_rank: LowRankEWC | None


class AddEWCGradientState(NamedTuple):
  """State of :func:`add_ewc_gradient`.

  Attributes:
    count: int32 step counter.
    ewc_anchor: the :class:`EWCAnchor`; swap it between tasks with
      ``optax.tree.set(opt_state, ewc_anchor=new_anchor)``, or, for a Linen
      ``TrainState`` or an ``nnx.Optimizer`` as well,
      ``fisher_optax.flax.replace_state(holder, ewc_anchor=new_anchor)``.
  """

  count: jax.Array
  ewc_anchor: EWCAnchor


# -- helpers -----------------------------------------------------------------


def _scalar_dtype(params: PyTree) -> Any:
  # Never reads a leaf's value: works on ShapeDtypeStructs and placeholders.
  dtypes = [x.dtype for x in jax.tree.leaves(params)]
  if not dtypes:
    return jnp.dtype(jnp.float32)
  return numerics.compute_dtype(jnp.result_type(*dtypes))


def _diagonal_entries(stat: Any) -> PyTree:
  """The params-shaped entries of ``consolidate(diagonal=...)``."""
  if isinstance(stat, fisher.DiagonalFisher):
    return stat.diag
  if isinstance(stat, fisher.FisherStatistic):
    hint = (
      "; pass a LowRankFisher as low_rank="
      if isinstance(stat, fisher.LowRankFisher)
      else ""
    )
    raise TypeError(
      "diagonal= must be a fisher.DiagonalFisher or a params-shaped tree of "
      f"diagonal entries, got a {type(stat).__name__}{hint}."
    )
  # Anything else carrying ``.diag`` (estimate_fisher_diag's state) or a tree.
  return stat.diag if hasattr(stat, "diag") else stat


def _low_rank_pair(stat: Any) -> tuple[jax.Array, PyTree]:
  """``(eigvals, eigvecs)`` of ``consolidate(low_rank=...)``."""
  # A LowRankFisher, or anything carrying the same two fields (the state of
  # estimate_fisher_low_rank).
  if hasattr(stat, "eigvals") and hasattr(stat, "eigvecs"):
    return stat.eigvals, stat.eigvecs
  if isinstance(stat, tuple) and len(stat) == 2:
    return stat[0], stat[1]
  hint = (
    "; pass a DiagonalFisher as diagonal="
    if isinstance(stat, fisher.DiagonalFisher)
    else ""
  )
  raise TypeError(
    "low_rank must be a fisher.LowRankFisher (with .eigvals and .eigvecs) or "
    f"an (eigvals, eigvecs) pair, got a {type(stat).__name__}{hint}."
  )


def _params_like(anchor: EWCAnchor) -> PyTree:
  """The params' shapes the anchor was built for (no leaf is read)."""
  if anchor.diagonal is not None:
    return anchor.diagonal.precision
  assert anchor.low_rank is not None  # EWCAnchor holds at least one part.
  return jax.tree.map(
    lambda v: jax.ShapeDtypeStruct(v.shape[1:], v.dtype),
    anchor.low_rank.vectors,
  )


def _check_params(params: PyTree, like: PyTree, what: str) -> None:
  validation.check_same_structure(
    like, params, what=what, reference_name="the anchor's params"
  )
  for p, q in zip(jax.tree.leaves(like), jax.tree.leaves(params)):
    if jnp.shape(p) != jnp.shape(q):
      raise ValueError(
        f"{what} leaf shape {jnp.shape(q)} does not match the anchor's "
        f"{jnp.shape(p)}."
      )


def _diagonal_gap(diag: DiagonalEWC, params: PyTree) -> PyTree:
  """``theta - anchor`` in the anchor's dtype."""
  return jax.tree.map(lambda m, p: p.astype(m.dtype) - m, diag.anchor, params)


def _projection_gap(low_rank: LowRankEWC, params: PyTree) -> jax.Array:
  """``u_k . theta - a_k`` for every slot ``k``, in the scales' dtype."""
  proj = linalg.tree_stacked_dot(low_rank.vectors, numerics.widen(params))
  return proj.astype(low_rank.scales.dtype) - low_rank.anchor_proj


# -- building anchors ----------------------------------------------------------


def init_ewc_anchor(
  params: PyTree, *, diagonal: bool = True, rank: int = 0
) -> EWCAnchor:
  """An empty :class:`EWCAnchor` (zero Fisher) with fixed shapes.

  Args:
    params: parameters (arrays or ``jax.ShapeDtypeStruct``).
    diagonal: whether the anchor holds a diagonal part.
    rank: number ``K`` of low-rank slots (0: no low-rank part). Static.

  Returns:
    An :class:`EWCAnchor` whose penalty is identically zero.

  Example:
    >>> import jax.numpy as jnp
    >>> import fisher_optax
    >>> anchor = fisher_optax.init_ewc_anchor({"w": jnp.zeros(3)}, rank=2)
    >>> anchor.diagonal.precision["w"].shape, anchor.low_rank.scales.shape
    ((3,), (2,))
    >>> float(fisher_optax.ewc_penalty({"w": jnp.ones(3)}, anchor, 1.0))
    0.0
  """
  rank = validation.check_static_int("rank", rank)
  diagonal = validation.check_flag("diagonal", diagonal)
  params = numerics.pure_arrays(params)
  if not diagonal and rank == 0:
    raise ValueError("an EWC anchor needs diagonal=True or rank > 0.")
  zeros = lambda shape_prefix: jax.tree.map(
    lambda p: jnp.zeros(
      shape_prefix + tuple(p.shape), numerics.compute_dtype(p.dtype)
    ),
    params,
  )
  sdtype = _scalar_dtype(params)
  diag = None
  if diagonal:
    diag = DiagonalEWC(
      precision=zeros(()), anchor=zeros(()), residual=jnp.zeros([], sdtype)
    )
  low = None
  if rank:
    low = LowRankEWC(
      vectors=zeros((rank,)),
      scales=jnp.zeros([rank], sdtype),
      anchor_proj=jnp.zeros([rank], sdtype),
      residual=jnp.zeros([], sdtype),
    )
  return EWCAnchor(diagonal=diag, low_rank=low)


def _merge_diagonal(
  old: DiagonalEWC,
  params: PyTree,
  fisher_diag: PyTree,
  decay: Any,
  mode: str,
) -> DiagonalEWC:
  theta = numerics.widen(params)
  # Non-finite or negative Fisher entries carry no usable curvature: 0.
  fdiag = jax.tree.map(
    lambda f, p: jnp.nan_to_num(
      jnp.maximum(jnp.asarray(f).astype(p.dtype), 0.0), nan=0.0, posinf=0.0
    ),
    fisher_diag,
    old.precision,
  )
  old_prec = jax.tree.map(lambda p: decay * p, old.precision)
  precision = jax.tree.map(jnp.add, old_prec, fdiag)
  if mode == "online":
    # Online EWC (Schwarz et al.): one anchor, the latest parameters.
    return DiagonalEWC(precision, theta, jnp.zeros_like(old.residual))

  # Exact merge of two quadratics per coordinate:
  # a(x-m)^2 + b(x-t)^2 = (a+b)(x - t - w(m-t))^2 + w b (m-t)^2, w = a/(a+b),
  # where x = t exactly when nothing was stored before (a = 0).
  def weight(a, b):
    tot = a + b
    return jnp.where(tot > 0, a / jnp.where(tot > 0, tot, 1.0), 0.0)

  w = jax.tree.map(weight, old_prec, fdiag)
  anchor = jax.tree.map(lambda wi, m, t: t + wi * (m - t), w, old.anchor, theta)
  gaps = jax.tree.leaves(
    jax.tree.map(
      lambda wi, b, m, t: jnp.sum(wi * b * jnp.square(m - t)),
      w,
      fdiag,
      old.anchor,
      theta,
    )
  )
  residual = decay * old.residual + sum(
    g.astype(old.residual.dtype) for g in gaps
  )
  return DiagonalEWC(precision, anchor, residual)


def _new_directions(
  old: LowRankEWC, eigvals: jax.Array, eigvecs: PyTree
) -> tuple[jax.Array, PyTree]:
  """The new ``(scales, vectors)`` in the anchor's dtypes, NaN-free."""
  validation.check_leading_axis(
    eigvecs,
    jax.tree.map(lambda v: v[0], old.vectors),
    what="low-rank Fisher eigvecs",
  )
  eigvals = jnp.atleast_1d(jnp.asarray(eigvals)).astype(old.scales.dtype)
  if eigvals.ndim != 1:
    raise ValueError(
      "low-rank Fisher eigvals must be a scalar or a vector (k,), one per "
      f"direction, got shape {eigvals.shape}."
    )
  k_new = eigvals.shape[0]
  sizes = {v.shape[0] for v in jax.tree.leaves(eigvecs)}
  if sizes and sizes != {k_new}:
    raise ValueError(
      f"low-rank Fisher has {k_new} eigenvalues but eigvecs with leading "
      f"axis {sorted(sizes)}."
    )
  vecs = jax.tree.map(lambda v, o: v.astype(o.dtype), eigvecs, old.vectors)
  # A direction with a non-finite entry or eigenvalue is dropped (scale 0,
  # zero vector) so that NaN never enters the state.
  finite = jax.vmap(numerics.tree_all_finite)((eigvals, vecs))
  vecs = jax.tree.map(
    lambda v: jnp.where(finite.reshape((-1,) + (1,) * (v.ndim - 1)), v, 0.0),
    vecs,
  )
  return jnp.where(finite, jnp.maximum(eigvals, 0.0), 0.0), vecs


def _write_slots(
  old_vectors: PyTree,
  scales: jax.Array,
  proj: jax.Array,
  residual: jax.Array,
  new: LowRankEWC,
) -> LowRankEWC:
  """Overwrites the weakest slots with ``new``; empty slots (scale 0) first.

  An overwritten term is dropped whole, so ``residual`` is kept as it is. A
  new term of scale 0 (a dropped non-finite direction) overwrites nothing,
  and the strongest new terms take the weakest slots.
  """
  k_slots, k_new = scales.shape[0], new.scales.shape[0]
  if k_new > k_slots:
    raise ValueError(
      f"cannot store {k_new} new directions in {k_slots} low-rank slots; "
      "use more slots (rank=) or low_rank_update='compress'."
    )
  slots = jnp.argsort(scales, stable=True)[:k_new]
  order = jnp.argsort(-new.scales, stable=True)
  write = new.scales[order] > 0

  def put(old: jax.Array, n: jax.Array) -> jax.Array:
    keep = write.reshape((-1,) + (1,) * (old.ndim - 1))
    return old.at[slots].set(jnp.where(keep, n[order], old[slots]))

  return LowRankEWC(
    jax.tree.map(put, old_vectors, new.vectors),
    put(scales, new.scales),
    put(proj, new.anchor_proj),
    residual,
  )


def _compress(
  old_vectors: PyTree,
  scales: jax.Array,
  proj: jax.Array,
  residual: jax.Array,
  new: LowRankEWC,
) -> LowRankEWC:
  """The top-``K`` eigenpairs of the old and new terms together.

  With ``W`` the ``m = K + k`` rows ``sqrt(s_j) u_j`` of the old and new
  slots and ``y = sqrt(s) * a``, their sum is ``|W theta - y|^2``. With
  ``V`` the orthonormal eigenvectors of the ``m x m`` Gram ``W W^T`` and
  ``r_i = W^T v_i`` it is, exactly, a sum of ``m`` terms

  .. math::

    |W \\theta - y|^2 = \\sum_i (r_i \\cdot \\theta - v_i \\cdot y)^2
      = \\sum_i l_i (u_i \\cdot \\theta - a_i)^2, \\quad
    l_i = |r_i|^2, \\ u_i = r_i / \\sqrt{l_i}, \\
    a_i = v_i \\cdot y / \\sqrt{l_i},

  where the ``u_i`` are the eigenvectors of ``W^T W`` and the ``l_i`` its
  eigenvalues. ``l_i`` is taken as ``|r_i|^2`` rather than the Gram's
  eigenvalue: the Gram squares ``W``, so its small eigenvalues carry an
  absolute error of the float rounding of its largest, while ``|r_i|^2``
  resolves them to about ``eps^2`` times the largest. The ``K`` largest
  terms are kept (any ``l_i`` above ``eps^1.5`` times the largest; each is
  exact whatever ``l_i``); a term with ``l_i`` below ``eps`` times the
  largest is the constant ``(v_i . y)^2`` and goes to the residual (the
  sum's minimum, never formed as a difference of large numbers); any other
  truncated term is dropped whole. The result is exact when the sum has
  rank ``<= K``, and the residual ``0`` in online mode (``y = W theta*``).
  """
  k_slots = scales.shape[0]
  all_vecs = jax.tree.map(
    lambda o, n: jnp.concatenate([o, n]), old_vectors, new.vectors
  )
  all_scales = jnp.concatenate([scales, new.scales])
  all_proj = jnp.concatenate([proj, new.anchor_proj])
  dtype = all_scales.dtype
  root_s = jnp.sqrt(all_scales)
  weighted = jax.tree.map(
    lambda v: v * root_s.astype(v.dtype).reshape((-1,) + (1,) * (v.ndim - 1)),
    all_vecs,
  )
  gram = linalg.symmetrize(linalg.tree_stacked_gram(weighted)).astype(dtype)
  # A non-finite Gram (overflowing scales) gives NaN without reaching LAPACK.
  v = numerics.finite_or_nan(jnp.linalg.eigh, gram)[1]
  rows = linalg.tree_stacked_combine(weighted, v)  # r_i = W^T v_i
  sq = jnp.asarray(
    sum(
      jnp.sum(jnp.square(r), axis=tuple(range(1, r.ndim))).astype(dtype)
      for r in jax.tree.leaves(rows)
    ),
    dtype,
  )
  order = jnp.argsort(-sq, stable=True)
  sq, v = sq[order], v[:, order]
  eps = jnp.finfo(dtype).eps
  top = jnp.maximum(sq[0], 0.0)
  keep = (jnp.arange(sq.shape[0]) < k_slots) & (
    sq > jnp.maximum(eps**1.5 * top, jnp.finfo(dtype).tiny)
  )
  null = ~keep & (sq <= eps * top)
  inv_root = jnp.where(keep, jax.lax.rsqrt(jnp.where(keep, sq, 1.0)), 0.0)
  vy = jnp.matmul(v.T, root_s * all_proj, precision=_HIGHEST)
  top_k = order[:k_slots]
  vectors = jax.tree.map(
    lambda r, o: (
      r[top_k]
      * inv_root[:k_slots].astype(r.dtype).reshape((-1,) + (1,) * (r.ndim - 1))
    ).astype(o.dtype),
    rows,
    old_vectors,
  )
  new_residual = residual + jnp.sum(jnp.where(null, jnp.square(vy), 0.0))
  return LowRankEWC(
    vectors,
    jnp.where(keep, sq, 0.0)[:k_slots].astype(scales.dtype),
    (vy * inv_root)[:k_slots].astype(scales.dtype),
    new_residual.astype(residual.dtype),
  )


def _merge_low_rank(
  old: LowRankEWC,
  params: PyTree,
  eigvals: jax.Array,
  eigvecs: PyTree,
  decay: Any,
  mode: str,
  update: str,
) -> LowRankEWC:
  theta = numerics.widen(params)
  new_scales, new_vecs = _new_directions(old, eigvals, eigvecs)
  new_proj = linalg.tree_stacked_dot(new_vecs, theta).astype(old.scales.dtype)
  new = LowRankEWC(new_vecs, new_scales, new_proj)
  proj = old.anchor_proj
  residual = (decay * jnp.asarray(old.residual, old.scales.dtype)).astype(
    old.scales.dtype
  )
  if mode == "online":
    proj = linalg.tree_stacked_dot(old.vectors, theta).astype(proj.dtype)
  merge = _write_slots if update == "slots" else _compress
  out = merge(old.vectors, decay * old.scales, proj, residual, new)
  if mode == "online":
    # Every term is anchored at theta: no constant is left (not even the
    # round-off of compress's).
    out = out._replace(residual=jnp.zeros([], old.scales.dtype))
  return out


def consolidate(
  anchor: EWCAnchor,
  params: PyTree,
  *,
  diagonal: Any = None,
  low_rank: Any = None,
  decay: float | jax.Array = 1.0,
  mode: str = "separate",
  low_rank_update: str = "slots",
) -> EWCAnchor:
  """Folds a finished task (anchor ``params``, Fisher) into an EWC anchor.

  With decay :math:`\\gamma`, the penalty after task :math:`T` is

  .. math::

    R_T(\\theta) = \\frac{\\lambda}{2} \\sum_{k \\le T} \\gamma^{T-k}
      (\\theta - \\theta^*_k)^\\top F_k (\\theta - \\theta^*_k)
    \\quad \\text{(separate)}, \\qquad
    \\frac{\\lambda}{2} (\\theta - \\theta^*_T)^\\top \\tilde F_T
      (\\theta - \\theta^*_T), \\ \\tilde F_T = \\gamma \\tilde F_{T-1} + F_T
    \\quad \\text{(online)}.

  *Separate* keeps every task's own anchor (Kirkpatrick et al.); for the
  diagonal part the sum is merged exactly into one precision and one
  precision-weighted anchor (``2P`` numbers for any number of tasks). *Online*
  is online EWC (Schwarz et al.; Huszar): one accumulated Fisher, re-anchored
  at the latest parameters. P&C's extra ``gamma`` inside the penalty only
  rescales ``lambda``, so it is not a separate option.

  Low-rank slots: ``low_rank_update="slots"`` writes the new directions into
  the ``k`` weakest slots (empty ones first) and leaves the others untouched,
  so ``K`` slots hold ``K / k`` tasks exactly; ``"compress"`` re-compresses the
  old and new terms to the top ``K`` eigenpairs of their sum (exact while the
  sum has rank ``<= K``, the penalty's value included, whose constant goes
  to :class:`LowRankEWC`'s ``residual``, for eigenvalues down to about
  ``eps^1.5`` times the largest, e.g. scale ratios of ``1e-7`` in float32;
  otherwise the terms along the eigenvectors of the smallest eigenvalues
  are dropped whole).

  All shapes are fixed, so this function can run under ``jit`` and the
  training step that reads the anchor never retraces.

  Non-finite statistics are skipped, never stored: a NaN, infinite or
  negative diagonal entry adds no precision, and a low-rank direction with a
  non-finite entry or eigenvalue is dropped, so the anchor stays finite. To
  refuse such a statistic instead, check its ``is_finite()`` first.

  Args:
    anchor: the current :class:`EWCAnchor` (e.g. from :func:`init_ewc_anchor`
      or ``optax.tree.get(opt_state, "ewc_anchor")``).
    params: the parameters at the end of the finished task, ``theta*``.
    diagonal: a :class:`fisher_optax.fisher.DiagonalFisher` (e.g. from
      ``fisher.diagonal``; its ``.diag`` is used) or a params-shaped tree of
      diagonal entries; required iff the anchor has a diagonal part.
    low_rank: a :class:`fisher_optax.fisher.LowRankFisher` (``.eigvals``,
      ``.eigvecs``), e.g. from ``fisher.rank_one`` or ``fisher.low_rank``, or
      an ``(eigvals, eigvecs)`` pair; required iff the anchor has low-rank
      slots.
    decay: ``gamma`` in [0, 1] applied to the old terms, a scalar.
    mode: ``"separate"`` or ``"online"``.
    low_rank_update: ``"slots"`` or ``"compress"``.

  Returns:
    The new :class:`EWCAnchor`, same shapes and dtypes.

  Raises:
    TypeError: if a statistic of another structure is passed (a
      ``LowRankFisher`` as ``diagonal=``, a ``DiagonalFisher`` as
      ``low_rank=``, a ``KroneckerFisher``, ...).

  Example:
    >>> import jax.numpy as jnp
    >>> import fisher_optax
    >>> from fisher_optax import fisher
    >>> params = {"w": jnp.ones((3, 2))}
    >>> x, y = jnp.eye(3), jnp.array([0, 1, 1])
    >>> stat = fisher.diagonal(lambda p, x: x @ p["w"], params, (x, y),
    ...                        likelihood=fisher.Categorical(), kind="exact")
    >>> anchor = fisher_optax.consolidate(
    ...     fisher_optax.init_ewc_anchor(params), params, diagonal=stat)
    >>> bool(jnp.all(anchor.diagonal.precision["w"] == stat.diag["w"]))
    True
    >>> float(fisher_optax.ewc_penalty(params, anchor, strength=1.0))
    0.0

    In a training loop the anchor lives in the optimizer state (see
    :func:`add_ewc_gradient`)::

      anchor = fisher_optax.consolidate(
          optax.tree.get(opt_state, "ewc_anchor"), params, diagonal=stat)
      opt_state = optax.tree.set(opt_state, ewc_anchor=anchor)
  """
  validation.check_choice("mode", mode, _MODES)
  validation.check_choice("low_rank_update", low_rank_update, _LOW_RANK_UPDATES)
  validation.check_scalar("decay", decay)
  validation.check_in_unit_interval("decay", decay, closed_right=True)
  anchor, params, diagonal, low_rank = numerics.pure_arrays(
    (anchor, params, diagonal, low_rank)
  )
  if not isinstance(anchor, EWCAnchor):
    raise TypeError(
      f"anchor must be an EWCAnchor, got {type(anchor).__name__}."
    )
  if (diagonal is None) != (anchor.diagonal is None):
    raise ValueError(
      "diagonal= must be given exactly when the anchor has a diagonal part "
      f"(anchor.diagonal is {'None' if anchor.diagonal is None else 'set'})."
    )
  if (low_rank is None) != (anchor.low_rank is None):
    raise ValueError(
      "low_rank= must be given exactly when the anchor has low-rank slots "
      f"(anchor.low_rank is {'None' if anchor.low_rank is None else 'set'})."
    )
  diag = None if diagonal is None else _diagonal_entries(diagonal)
  low = None if low_rank is None else _low_rank_pair(low_rank)
  like = _params_like(anchor)
  _check_params(params, like, "params")
  if diag is not None:
    _check_params(diag, like, "diagonal Fisher")
  return _consolidate(
    anchor, params, diag, low, decay, mode=mode, low_rank_update=low_rank_update
  )


@jax.jit(static_argnames=("mode", "low_rank_update"))
def _consolidate(
  anchor: EWCAnchor,
  params: PyTree,
  diag: PyTree | None,
  low: tuple[jax.Array, PyTree] | None,
  decay: Any,
  *,
  mode: str,
  low_rank_update: str,
) -> EWCAnchor:
  # Compiled once per shape: eager dispatch of the merge is slow on CPU.
  new_diag = anchor.diagonal
  if new_diag is not None:
    new_diag = _merge_diagonal(new_diag, params, diag, decay, mode)
  new_low = anchor.low_rank
  if new_low is not None:
    assert low is not None  # consolidate checked it is given.
    new_low = _merge_low_rank(
      new_low, params, low[0], low[1], decay, mode, low_rank_update
    )
  return EWCAnchor(diagonal=new_diag, low_rank=new_low)


# -- the penalty -------------------------------------------------------------


def ewc_gradient(params: PyTree, anchor: EWCAnchor) -> PyTree:
  """``sum_k F_k (theta - theta*_k)``: the penalty gradient for ``lambda = 1``.

  Args:
    params: current parameters ``theta``.
    anchor: an :class:`EWCAnchor`.

  Returns:
    A params-shaped tree in the anchor's (float32 or wider) dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> import fisher_optax
    >>> theta_star = {"w": jnp.array([1.0, 2.0])}
    >>> anchor = fisher_optax.consolidate(
    ...     fisher_optax.init_ewc_anchor(theta_star), theta_star,
    ...     diagonal={"w": jnp.array([4.0, 1.0])})
    >>> fisher_optax.ewc_gradient({"w": jnp.zeros(2)}, anchor)["w"]
    Array([-4., -2.], dtype=float32)
  """
  params, anchor = numerics.pure_arrays((params, anchor))
  _check_params(params, _params_like(anchor), "params")
  terms = []
  if anchor.diagonal is not None:
    d = anchor.diagonal
    terms.append(
      jax.tree.map(jnp.multiply, d.precision, _diagonal_gap(d, params))
    )
  if anchor.low_rank is not None:
    lr = anchor.low_rank
    gap = _projection_gap(lr, params)
    terms.append(linalg.tree_stacked_combine(lr.vectors, lr.scales * gap))
  if len(terms) == 1:
    return terms[0]
  return jax.tree.map(jnp.add, *terms)


def ewc_penalty(
  params: PyTree, anchor: EWCAnchor, strength: float | jax.Array
) -> jax.Array:
  """The EWC penalty in loss form, for users who add it to their loss.

  .. math::

    R(\\theta) = \\frac{\\lambda}{2} \\Bigl[\\sum_i \\mathrm{Pr}_i
      (\\theta_i - m_i)^2 + r \\Bigr] + \\frac{\\lambda}{2} \\Bigl[\\sum_k
      s_k (u_k^\\top \\theta - a_k)^2 + r_{\\mathrm{low}} \\Bigr],

  with ``r`` and ``r_low`` the constants (``residual``) of
  :class:`DiagonalEWC` and :class:`LowRankEWC`, i.e.
  :math:`\\tfrac{\\lambda}{2} \\sum_k (\\theta - \\theta^*_k)^\\top F_k
  (\\theta - \\theta^*_k)` with the ``1/2`` convention, so that
  ``jax.grad(ewc_penalty)`` is exactly the increment of
  :func:`add_ewc_gradient`. Avalanche and the reference EWC code omit the
  ``1/2``: ``lambda_ours = 2 lambda_theirs``.

  The low-rank terms resolve moves from the anchor only down to about the
  float rounding of ``|u_k . theta*|`` (``1e-7`` times it in float32; see
  :class:`LowRankEWC`); x64 or the diagonal part avoids that floor.

  Args:
    params: current parameters ``theta``.
    anchor: an :class:`EWCAnchor`.
    strength: ``lambda >= 0``, a scalar.

  Returns:
    A scalar in the anchor's dtype.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fisher_optax
    >>> theta_star = {"w": jnp.array([1.0, 2.0])}
    >>> anchor = fisher_optax.consolidate(
    ...     fisher_optax.init_ewc_anchor(theta_star), theta_star,
    ...     diagonal={"w": jnp.array([4.0, 1.0])})
    >>> theta = {"w": jnp.zeros(2)}
    >>> fisher_optax.ewc_penalty(theta, anchor, strength=2.0)
    Array(8., dtype=float32)
    >>> penalty = lambda p: fisher_optax.ewc_penalty(p, anchor, strength=2.0)
    >>> jax.grad(penalty)(theta)["w"]  # = 2 * ewc_gradient(theta, anchor)
    Array([-8., -4.], dtype=float32)

    Added to a task loss: ``loss(p, batch) + ewc_penalty(p, anchor, lam)``.
  """
  validation.check_scalar("strength", strength)
  validation.check_positive("strength", strength, allow_zero=True)
  params, anchor = numerics.pure_arrays((params, anchor))
  _check_params(params, _params_like(anchor), "params")
  total = []
  if anchor.diagonal is not None:
    d = anchor.diagonal
    sq = jax.tree.map(
      lambda pr, g: jnp.sum(pr * jnp.square(g)),
      d.precision,
      _diagonal_gap(d, params),
    )
    total.append(sum(jax.tree.leaves(sq)) + d.residual)
  if anchor.low_rank is not None:
    lr = anchor.low_rank
    quad = jnp.sum(lr.scales * jnp.square(_projection_gap(lr, params)))
    total.append(quad + lr.residual)
  return jnp.asarray(0.5 * strength * sum(total))


# -- the transform -----------------------------------------------------------


def add_ewc_gradient(
  strength: float | jax.Array,
  anchor: EWCAnchor | None = None,
  *,
  diagonal: bool = True,
  rank: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Adds the gradient of the EWC penalty, ``lambda F (theta - theta*)``.

  .. math::

    u \\leftarrow u + \\lambda \\sum_k F_k (\\theta - \\theta^*_k),

  the gradient of :func:`ewc_penalty` (``1/2`` convention: ``R = lambda/2
  D^T F D``). Put it **first** in a chain, where it is exactly the loss-form
  penalty; placed after an adaptive optimizer it becomes a decoupled
  (AdamW-style) pull towards the anchor whose ``lambda`` no longer matches the
  loss form.

  The Fisher lives in the state as an :class:`EWCAnchor` of fixed shapes.
  After each task, fold the task in with :func:`consolidate` and write it back
  with ``optax.tree.set(opt_state, ewc_anchor=...)``: same shapes, so the
  jitted step does not retrace. In Flax (a Linen ``TrainState`` or an
  ``nnx.Optimizer``, whose state holds variables) read and write it with
  :func:`fisher_optax.flax.get_state` and
  :func:`fisher_optax.flax.replace_state`; the EWC functions also accept the
  NNX view (variables) of anchors and parameters directly.

  Fisher flavours (all from :mod:`fisher_optax.fisher`):

  * classic EWC: ``diagonal(..., kind="exact"|"mc"|"empirical")``;
  * ``kind="batch_squared"`` (Avalanche's "BATCHED" squared mini-batch
    gradient) estimates about ``F / b + mu mu^T`` for batch size ``b``, so its
    best ``lambda`` is about ``b`` times larger;
  * rank-1 EWC (Wang et al.): ``rank_one(..., direction="mean")``; with
    ``scale="none"`` the term is ``(1/2) (mu . D)^2`` as in the paper's
    ``rank1``, with ``scale="optimal"`` it is ``(1/2) c* (mu . D)^2`` with the
    Frobenius-optimal ``c* = mean((mu . g_n)^2) / |mu|^4`` (``rank1_opt``);
  * rank-k / AlignGuard's ``l_A`` term: ``low_rank(..., rank=k)``;
  * diagonal plus low rank together (no source does this): ``diagonal=True,
    rank=k`` and both statistics in :func:`consolidate`.

  ``lambda`` multiplies a *mean* Fisher (per-example mean over the task's
  data), so it does not depend on the number of examples the Fisher saw.

  Args:
    strength: ``lambda >= 0``; the one hyperparameter
      ``optax.inject_hyperparams`` can inject (the defaults of the others
      pass through it as they are).
    anchor: an initial :class:`EWCAnchor`; default an empty one built by
      :func:`init_ewc_anchor` with ``diagonal`` and ``rank``.
    diagonal: whether the default anchor has a diagonal part. Static.
    rank: low-rank slots ``K`` of the default anchor (``None``: 0, no
      low-rank part). A static int: under ``optax.inject_hyperparams``, list
      it in ``static_args`` when you pass it.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` requires params.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import fisher_optax
    >>> params = {"w": jnp.array([1.0, 2.0])}
    >>> tx = optax.chain(fisher_optax.add_ewc_gradient(10.0), optax.sgd(0.1))
    >>> state = tx.init(params)
    >>> # Task A ends at params: fold its Fisher into the anchor.
    >>> anchor = fisher_optax.consolidate(
    ...     optax.tree.get(state, "ewc_anchor"), params,
    ...     diagonal={"w": jnp.array([1.0, 0.0])})
    >>> state = optax.tree.set(state, ewc_anchor=anchor)
    >>> # Task B moved w; the penalty pulls w[0] (A's coordinate) back.
    >>> grads, moved = {"w": jnp.array([0.0, 1.0])}, {"w": jnp.zeros(2)}
    >>> updates, state = tx.update(grads, state, moved)
    >>> updates["w"]
    Array([ 1. , -0.1], dtype=float32)

    AlignGuard-style, a rank-one Fisher penalty on the LoRA leaves only
    (``optax.masked`` shows the inner transform ``MaskedNode`` for the other
    leaves, so the anchor is built on the masked tree):

    >>> import jax
    >>> params = {"base": jnp.ones(3), "lora": jnp.ones(2)}
    >>> is_lora = {"base": False, "lora": True}
    >>> only_lora = lambda t: jax.tree.map(
    ...     lambda m, x: x if m else optax.MaskedNode(), is_lora, t)
    >>> tx = optax.masked(
    ...     fisher_optax.add_ewc_gradient(1.0, diagonal=False, rank=1), is_lora)
    >>> state = tx.init(params)
    >>> u = {"base": jnp.zeros((1, 3)), "lora": jnp.array([[1.0, 0.0]])}
    >>> anchor = fisher_optax.consolidate(
    ...     optax.tree.get(state, "ewc_anchor"), only_lora(params),
    ...     low_rank=(jnp.array([2.0]), only_lora(u)))
    >>> state = optax.tree.set(state, ewc_anchor=anchor)
    >>> moved = {"base": jnp.zeros(3), "lora": jnp.array([2.0, 1.0])}
    >>> zeros = jax.tree.map(jnp.zeros_like, params)
    >>> updates, _ = tx.update(zeros, state, moved)
    >>> updates["base"]  # not LoRA: untouched
    Array([0., 0., 0.], dtype=float32)
    >>> updates["lora"]  # 2 (u . (moved - params)) u
    Array([2., 0.], dtype=float32)

  A Fisher computed over all parameters and then restricted to the LoRA
  leaves keeps only its block; for a LoRA-only Fisher, compute it on the LoRA
  parameters, as AlignGuard does.

  References:
    Kirkpatrick et al, `Overcoming catastrophic forgetting in neural
    networks <https://arxiv.org/abs/1612.00796>`_, 2017.
    Schwarz et al, `Progress & Compress
    <https://arxiv.org/abs/1805.06370>`_, 2018.
    Wang et al, `Avoid catastrophic forgetting with rank-1 Fisher from
    diffusion models <https://arxiv.org/abs/2509.23593>`_, 2025.
    Das et al, `AlignGuard-LoRA <https://arxiv.org/abs/2508.02079>`_, 2025.
  """
  validation.check_scalar("strength", strength)
  validation.check_positive("strength", strength, allow_zero=True)
  diagonal = validation.check_flag("diagonal", diagonal)
  # ``None`` (not 0) by default: inject_hyperparams would turn an int default
  # into an array, which cannot set a shape.
  rank = validation.check_static_int("rank", 0 if rank is None else rank)
  if anchor is not None and not isinstance(anchor, EWCAnchor):
    raise TypeError(
      f"anchor must be an EWCAnchor, got {type(anchor).__name__}."
    )

  def init_fn(params: PyTree) -> AddEWCGradientState:
    validation.check_real_floating(
      params, what="params", function="add_ewc_gradient"
    )
    if anchor is None:
      start = init_ewc_anchor(params, diagonal=diagonal, rank=rank)
    else:  # Fresh buffers: a donated state must not delete the user's anchor.
      start = jax.tree.map(jnp.copy, anchor)
    return AddEWCGradientState(count=jnp.zeros([], jnp.int32), ewc_anchor=start)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError(
        "add_ewc_gradient needs params: call update(updates, state, params)."
      )
    validation.check_like(updates, numerics.pure_arrays(params), what="updates")
    grad = ewc_gradient(params, state.ewc_anchor)
    updates = jax.tree.map(
      lambda u, g: (u.astype(g.dtype) + strength * g).astype(u.dtype),
      updates,
      grad,
    )
    count = optax.safe_increment(state.count)
    return updates, AddEWCGradientState(
      count=jnp.asarray(count), ewc_anchor=state.ewc_anchor
    )

  # optax types the state as an OptState (arrays all the way down); ours holds
  # None for an anchor part that is absent.
  return optax.GradientTransformationExtraArgs(
    init_fn,  # pyright: ignore[reportArgumentType]
    update_fn,  # pyright: ignore[reportArgumentType]
  )
