# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""FISMO: Fisher-structured momentum orthogonalisation (a Muon generalisation).

FISMO models the Fisher of a weight matrix as a Kronecker product
:math:`F \\approx Q \\otimes P` and takes Muon's step in the geometry it
defines: whiten the gradient with :math:`P^{-1/2}, Q^{-1/2}`, accumulate
momentum, orthogonalise it by Newton-Schulz and map the result back. With
:math:`P = Q = I` it is exactly Muon.

The routing of leaves (``MuonDimensionNumbers``, reshapes of N-D leaves,
batch axes, an Adam fallback) mirrors :func:`optax.contrib.muon`; it is
resolved by the shared :mod:`fisher_optax._matrix_view`. Per leaf, the step
is a chain of module-level pure functions: :func:`_update_factors` (the
statistics :func:`_statistic`, their EMA :func:`_ema_factor` and the root
refresh :func:`_inverse_root`), then :func:`_momentum` and
:func:`_direction`, tied together by :func:`_leaf_update`.
"""

from __future__ import annotations

from collections.abc import Callable
import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers

from fisher_optax import _matrix_roots
from fisher_optax import _matrix_view as matrix_view
from fisher_optax.fisher import linalg
from fisher_optax.fisher import numerics
from fisher_optax.fisher import validation

PyTree = Any
FISMODimensionNumbers = MuonDimensionNumbers
WeightDimNumOrFn = (
  MuonDimensionNumbers | PyTree | Callable[[PyTree], PyTree] | None
)

_HIGHEST = jax.lax.Precision.HIGHEST
_FACTOR_NORMS = ("pre_ema", "paper")
_ROOT_METHODS = ("eigh", "newton", "cholesky")
_MOMENTUM_SPACES = ("whitened", "original")
_GRAFTINGS = ("none", "muon_norm")
_MAX_PRECOND_DIM = 4096
_MAX_ASPECT_RATIO = 2
# A warm-started Newton root that ends with max|H^T F H - I| above this is
# discarded for eigh's (Distributed Shampoo keeps the previous root, which
# can then defeat every later warm start).
_NEWTON_MAX_ERROR = 0.1
_NEWTON_TOL = 1e-4
_NEWTON_MAX_ITERS = 30


class FISMOState(NamedTuple):
  """State of :func:`scale_by_fismo`.

  Per-leaf entries are ``optax.MaskedNode()`` where they do not apply (leaves
  routed to the fallback, or a side that is not preconditioned).

  Attributes:
    count: number of updates so far, int32.
    momentum: params-shaped momentum (whitened or original coordinates, see
      ``momentum_space``), in ``mu_dtype``.
    left_factor: ``P``, float32 ``(batch, m, m)`` per leaf, trace ``m``.
    right_factor: ``Q``, float32 ``(batch, n, n)`` per leaf, trace ``n``.
    left_root: the cached whitening factor ``P^{-1/2}`` (refreshed every
      ``precondition_interval`` steps).
    right_root: the cached ``Q^{-1/2}``.
    fallback: the state of the fallback transform on the other leaves.
    notfinite_count: int32 number of steps skipped as non-finite (as in
      :func:`optax.apply_if_finite`'s state).
  """

  count: jax.Array
  momentum: optax.Updates
  left_factor: PyTree
  right_factor: PyTree
  left_root: PyTree
  right_root: PyTree
  fallback: optax.OptState
  notfinite_count: jax.Array


# Old spellings, served with a FisherOptaxDeprecationWarning.
__getattr__ = validation.module_getattr(
  __name__,
  {
    "FismoState": ("FISMOState", FISMOState),
    "FismoDimensionNumbers": ("FISMODimensionNumbers", FISMODimensionNumbers),
  },
)


# -- routing -----------------------------------------------------------------


class _Plan(NamedTuple):
  """Static per-leaf layout: the matrix view and the preconditioned sides."""

  view: matrix_view.LeafPlan
  left: bool
  right: bool


def _plans(
  spec: WeightDimNumOrFn,
  tree: PyTree,
  max_precond_dim: int,
  max_aspect_ratio: int,
) -> list[_Plan | None]:
  """One :class:`_Plan` (or ``None``: fallback) per leaf of ``tree``.

  As in Distributed Shampoo, a side longer than ``max_precond_dim`` is not
  preconditioned, and a very rectangular leaf only on its smaller side.
  """
  out: list[_Plan | None] = []
  for view in matrix_view.plans(spec, tree):
    if view is None:
      out.append(None)
      continue
    m, n = view.rows, view.cols
    left, right = m <= max_precond_dim, n <= max_precond_dim
    if max(m, n) > max_aspect_ratio * min(m, n):
      left, right = left and m <= n, right and n < m
    out.append(_Plan(view=view, left=left, right=right))
  return out


# -- per-leaf mathematics ------------------------------------------------------


def _mm(
  a: jax.Array,
  b: jax.Array,
  like: jax.Array | None = None,
  precision: Any = _HIGHEST,
) -> jax.Array:
  """``a @ b``. Under explicit mesh axes, a product with a root is sharded
  like ``like`` (the gradient's matrices); one without, a factor's
  statistic, is replicated, as the factors are."""
  out = (
    linalg.replicated_spec() if like is None else numerics.explicit_spec(like)
  )
  return linalg.matmul(a, b, precision=precision, out_sharding=out)


class _Options(NamedTuple):
  """The hyperparameters a leaf update reads (numbers may be traced)."""

  beta: Any
  gamma: Any
  damping: Any
  coeffs: Any
  ns_steps: int | jax.Array
  eps: Any
  nesterov: bool
  root_method: str
  factor_norm: str
  momentum_space: str
  grafting: str
  eigenvalue_floor: Any


def _eye_like(batch: int, d: int, dtype: Any) -> jax.Array:
  return jnp.broadcast_to(jnp.eye(d, dtype=dtype), (batch, d, d))


def _trace(a: jax.Array) -> jax.Array:
  return jnp.trace(a, axis1=-2, axis2=-1)[..., None, None]


def _statistic(
  x: jax.Array, per_example: jax.Array | None, side_dim: int, left: bool
) -> jax.Array:
  """``X X^T / n`` (left) or ``X^T X / m`` (right), batch or per-example.

  Args:
    x: ``(b, m, n)`` gradient, already whitened on the other side.
    per_example: ``(B, b, m, n)`` per-example gradients (whitened the same
      way) or ``None``; if given, the statistic is their mean outer product.
    side_dim: the other side's size (``n`` for left, ``m`` for right).
    left: which side's statistic.
  """
  if per_example is None:
    outer = (
      _mm(x, jnp.matrix_transpose(x))
      if left
      else _mm(jnp.matrix_transpose(x), x)
    )
    return outer / side_dim
  pattern = "kbmn,kbpn->bmp" if left else "kbmn,kbmp->bnp"
  outer = jnp.einsum(
    pattern,
    per_example,
    per_example,
    precision=_HIGHEST,
    out_sharding=linalg.replicated_spec(),
  )
  return outer / (side_dim * per_example.shape[0])


def _ema_factor(
  old: jax.Array, stat: jax.Array, d: int, opts: _Options
) -> jax.Array:
  """``norm_d(gamma old + (1 - gamma) target(stat))``.

  ``"pre_ema"`` trace-normalises the statistic before the damping (an
  all-zero statistic keeps ``old``); ``"paper"`` damps it as it is. A
  statistic that overflowed (finite gradients of 1e30) gives a non-finite
  factor: the step is then skipped by the non-finite policy, and no root is
  computed from it.
  """
  eye = jnp.eye(d, dtype=old.dtype)
  stat = stat.astype(old.dtype)
  damping = opts.damping
  tiny = jnp.finfo(old.dtype).tiny
  if opts.factor_norm == "pre_ema":
    tr = _trace(stat)
    keep = tr <= tiny  # False for an overflowed (inf or NaN) trace.
    normed = d * stat / jnp.where(keep, 1.0, tr)
    target = (normed + damping * eye) / (1.0 + damping)
  else:  # Algorithm 1 as written.
    target = stat + damping * _trace(old) / d * eye
    keep = jnp.zeros(old.shape[:-2] + (1, 1), bool)
  mixed = opts.gamma * old + (1.0 - opts.gamma) * target
  tr_mixed = _trace(mixed)
  keep |= tr_mixed <= tiny  # Nothing to normalise (all-zero, undamped).
  new = d * mixed / jnp.where(keep, 1.0, tr_mixed)
  return jnp.where(keep, old, linalg.symmetrize(new).astype(old.dtype))


# LAPACK's decompositions one factor at a time (stacked factors, vmap lanes):
# batched, two of them at once deadlocked XLA:CPU's thread pool.
_eigh_roots = numerics.matrix_by_matrix(
  lambda f, floor: _matrix_roots.matrix_inverse_root_eigh(f, 2, floor=floor)
)
_cholesky_roots = numerics.matrix_by_matrix(
  lambda f, floor: _matrix_roots.cholesky_whitening(f, floor=floor)
)


def _inverse_root(
  factor: jax.Array, old_root: jax.Array, opts: _Options
) -> jax.Array:
  """A whitening factor of ``factor``; ``old_root`` where it fails.

  A non-finite (overflowed) factor never reaches the decomposition: LAPACK's
  ``eigh`` need not terminate on one on XLA:CPU, so
  :func:`fisher_optax.fisher.numerics.finite_or_nan` hands it zeros (also
  under ``vmap``, where a ``lax.cond`` would run both branches) and the old
  root is kept.
  """
  floor = opts.eigenvalue_floor
  if opts.root_method == "eigh":
    root = numerics.finite_or_nan(_eigh_roots, factor, jnp.asarray(floor))
    ok = jnp.ones(factor.shape[:-2], bool)
  elif opts.root_method == "newton":
    newton = lambda f, init: _matrix_roots.matrix_inverse_root_newton(
      f,
      2,
      init=init,
      floor=floor,
      max_iters=_NEWTON_MAX_ITERS,
      tol=_NEWTON_TOL,
    )
    warm = numerics.finite_or_nan(newton, factor, linalg.symmetrize(old_root))
    ok = warm.error < _NEWTON_MAX_ERROR

    # A factor that moved far from the cached root's (a jump in the
    # gradients' scale, a nearly singular factor) can defeat the warm start,
    # and keeping the old root would defeat every later one too (a cold
    # Newton start fails on such factors in float32 as well): those take
    # eigh's root. Only a refresh that needs it decomposes.
    def fallback() -> tuple[jax.Array, jax.Array]:
      exact = numerics.finite_or_nan(_eigh_roots, factor, jnp.asarray(floor))
      root = jnp.where(ok[..., None, None], warm.root, exact)
      return root, jnp.ones_like(ok)

    root, ok = jax.lax.cond(jnp.all(ok), lambda: (warm.root, ok), fallback)
  else:
    root = numerics.finite_or_nan(_cholesky_roots, factor, jnp.asarray(floor))
    ok = jnp.ones(factor.shape[:-2], bool)
  ok &= jnp.all(jnp.isfinite(root), axis=(-2, -1))
  return jnp.where(ok[..., None, None], root.astype(old_root.dtype), old_root)


def _refresh_factor(
  old: jax.Array,
  old_root: jax.Array,
  stat: jax.Array,
  d: int,
  refresh: jax.Array,
  opts: _Options,
) -> tuple[jax.Array, jax.Array]:
  """EMA of one factor, then (on refresh steps) its inverse root."""
  new = _ema_factor(old, stat, d, opts)

  # Lane by lane under vmap: a batched predicate would turn the conds into
  # selects, computing every lane's roots (and eigh fallbacks) every step.
  def refreshed(refresh: jax.Array, f: jax.Array, r: jax.Array) -> jax.Array:
    return jax.lax.cond(refresh, lambda: _inverse_root(f, r, opts), lambda: r)

  return new, numerics.lane_by_lane(refreshed)(refresh, new, old_root)


def _update_factors(
  gm: jax.Array,
  pe: jax.Array | None,
  plan: _Plan,
  factors: tuple[Any, Any, Any, Any],
  refresh: jax.Array,
  opts: _Options,
) -> tuple[Any, Any, Any, Any]:
  """One Gauss-Seidel sweep: ``P`` from the cached ``Q`` root, then ``Q``.

  Args:
    gm: ``(b, m, n)`` gradient matrices (finite).
    pe: ``(B, b, m, n)`` per-example gradient matrices or ``None``.
    plan: the leaf's plan.
    factors: ``(P, Q, P root, Q root)``, ``MaskedNode`` on unused sides.
    refresh: whether the roots are recomputed this step.
    opts: the hyperparameters.

  Returns:
    The new ``(P, Q, P root, Q root)``.
  """
  p, q, wp, wq = factors
  _, m, n = plan.view.stacked_shape
  if plan.left:
    y = _mm(gm, wq, gm) if plan.right else gm
    ype = None if pe is None else (_mm(pe, wq, pe) if plan.right else pe)
    stat = _statistic(y, ype, n, True)
    p, wp = _refresh_factor(p, wp, stat, m, refresh, opts)
  if plan.right:
    z = _mm(jnp.matrix_transpose(wp), gm, gm) if plan.left else gm
    zpe = (
      None
      if pe is None
      else (_mm(jnp.matrix_transpose(wp), pe, pe) if plan.left else pe)
    )
    stat = _statistic(z, zpe, m, False)
    q, wq = _refresh_factor(q, wq, stat, n, refresh, opts)
  return p, q, wp, wq


def _momentum(
  x: jax.Array, mu_prev: jax.Array, count: jax.Array, opts: _Options
) -> tuple[jax.Array, jax.Array]:
  """Muon's momentum EMA: the new momentum and its bias-corrected read-out."""
  beta = opts.beta
  mu_new = (1.0 - beta) * x + beta * mu_prev  # optax's update_moment order.
  if opts.nesterov:
    mu_hat = beta * optax.tree.bias_correction(
      mu_new, beta, optax.safe_increment(count)
    ) + (1.0 - beta) * optax.tree.bias_correction(x, beta, count)
  else:
    mu_hat = optax.tree.bias_correction(mu_new, beta, count)
  return mu_new, mu_hat


def _direction(
  mu_hat: jax.Array, plan: _Plan, wp: Any, wq: Any, opts: _Options
) -> jax.Array:
  """``P^{-1/2} Polar(M) Q^{-1/2}`` (optionally grafted to Polar's norm)."""
  mm = lambda a, b, like: _mm(a, b, like, precision=None)
  if opts.momentum_space == "original":  # Whiten after accumulation.
    if plan.left:
      mu_hat = mm(jnp.matrix_transpose(wp), mu_hat, mu_hat)
    if plan.right:
      mu_hat = mm(mu_hat, wq, mu_hat)
  ortho = _matrix_roots.newton_schulz_polar(
    mu_hat, opts.coeffs, opts.ns_steps, opts.eps
  )
  delta = ortho
  if plan.left:
    delta = mm(wp, delta, mu_hat)
  if plan.right:
    delta = mm(delta, jnp.matrix_transpose(wq), mu_hat)
  if opts.grafting == "muon_norm":
    fro = lambda a: jnp.sqrt(
      jnp.sum(jnp.square(a), axis=(-2, -1), keepdims=True)
    )
    delta = delta * (fro(ortho) / jnp.maximum(fro(delta), 1e-30))
  return delta


def _leaf_update(
  g: jax.Array,
  peg: jax.Array | None,
  plan: _Plan,
  leaf_state: tuple[Any, Any, Any, Any, Any],
  count: jax.Array,
  refresh: jax.Array,
  opts: _Options,
) -> tuple[jax.Array, tuple[Any, Any, Any, Any, Any]]:
  """FISMO's step for one leaf.

  Args:
    g: the leaf's gradient.
    peg: its per-example gradients ``(B, *g.shape)`` or ``None``.
    plan: its plan.
    leaf_state: ``(momentum, P, Q, P root, Q root)``.
    count: the incremented step count (for the bias correction).
    refresh: whether the roots are recomputed this step.
    opts: the hyperparameters.

  Returns:
    The update and the new ``leaf_state`` (the step runs on finite inputs
    only, under the non-finite policy).
  """
  mu, *factors = leaf_state
  view = plan.view
  sd = numerics.compute_dtype(g.dtype)
  gm = view.to_matrices(g).astype(sd)
  mu_prev = view.to_matrices(mu).astype(sd)
  pe = None
  if peg is not None:
    pe = jax.vmap(view.to_matrices)(peg).astype(sd)
  # Under explicit mesh axes the matrices are worked on sharded along their
  # longer side, where the Gram matrices of the shorter one (Newton-Schulz,
  # factors) are all-reduced rather than gathered from the whole matrix.
  homes = numerics.explicit_spec(gm), numerics.explicit_spec(mu_prev)
  work = linalg.long_side_spec(gm)
  if work is not None:
    gm = jax.sharding.reshard(gm, work)
    mu_prev = jax.sharding.reshard(mu_prev, work)
  pe_work = None if pe is None else linalg.long_side_spec(pe)
  if pe_work is not None:
    pe = jax.sharding.reshard(pe, pe_work)
  p, q, wp, wq = _update_factors(gm, pe, plan, tuple(factors), refresh, opts)
  x = gm
  if opts.momentum_space == "whitened":
    if plan.left:
      x = _mm(jnp.matrix_transpose(wp), x, gm)
    if plan.right:
      x = _mm(x, wq, gm, precision=None)
  mu_new, mu_hat = _momentum(x, mu_prev, count, opts)
  delta = _direction(mu_hat, plan, wp, wq, opts)
  if work is not None:  # back to the leaf's own sharding
    delta = jax.sharding.reshard(delta, homes[0])
    mu_new = jax.sharding.reshard(mu_new, homes[1])
  out = view.from_matrix(delta).astype(g.dtype)
  mu_out = view.from_matrix(mu_new).astype(mu.dtype)
  return out, (mu_out, p, q, wp, wq)


def _init_leaf(
  x: jax.Array, plan: _Plan | None, mu_dtype: Any
) -> tuple[Any, Any, Any, Any, Any]:
  """``(momentum, P, Q, P root, Q root)`` for one leaf: zeros and identities."""
  masked = optax.MaskedNode()
  if plan is None:
    return (masked, masked, masked, masked, masked)
  b, m, n = plan.view.stacked_shape
  sd = numerics.compute_dtype(x.dtype)
  # The factors and their roots start equal but in separate buffers, so that
  # a fresh state can be donated to a jitted step.
  left = lambda: _eye_like(b, m, sd) if plan.left else masked
  right = lambda: _eye_like(b, n, sd) if plan.right else masked
  mu = numerics.zeros_like_stacked(x, dtype=mu_dtype or x.dtype)
  return (mu, left(), right(), left(), right())


def _check_options(
  beta: Any,
  gamma: Any,
  damping: Any,
  ns_coeffs: Any,
  ns_steps: Any,
  eps: Any,
  nesterov: bool,
  precondition_interval: Any,
  root_method: str,
  factor_norm: str,
  momentum_space: str,
  grafting: str,
  eigenvalue_floor: Any,
) -> _Options:
  """Validates :func:`scale_by_fismo`'s hyperparameters (concrete ones)."""
  validation.check_in_unit_interval("beta", beta)
  validation.check_in_unit_interval("gamma", gamma, closed_right=True)
  validation.check_positive("damping", damping, allow_zero=True)
  validation.check_positive("eps", eps, allow_zero=True)
  validation.check_positive(
    "eigenvalue_floor", eigenvalue_floor, allow_zero=True
  )
  ns_steps = validation.check_count("ns_steps", ns_steps)
  validation.check_count("precondition_interval", precondition_interval)
  validation.check_choice("root_method", root_method, _ROOT_METHODS)
  validation.check_choice("factor_norm", factor_norm, _FACTOR_NORMS)
  validation.check_choice("momentum_space", momentum_space, _MOMENTUM_SPACES)
  validation.check_choice("grafting", grafting, _GRAFTINGS)
  if root_method == "cholesky" and momentum_space != "original":
    raise ValueError(
      'root_method="cholesky" gives a triangular whitening, under which '
      'whitened momentum is not meaningful: use momentum_space="original".'
    )
  # Kept as given, an array only inside update: built under a trace
  # (jax.eval_shape of a TrainState), an array here would leak its tracer.
  shape = np.shape(ns_coeffs)
  if len(shape) not in (1, 2) or shape[-1] != 3:
    raise ValueError(f"ns_coeffs must have shape (3,) or (k, 3), got {shape}.")
  validation.check_finite("ns_coeffs", ns_coeffs)
  return _Options(
    beta=beta,
    gamma=gamma,
    damping=damping,
    coeffs=ns_coeffs,
    ns_steps=ns_steps,
    eps=eps,
    nesterov=validation.check_flag("nesterov", nesterov),
    root_method=root_method,
    factor_norm=factor_norm,
    momentum_space=momentum_space,
    grafting=grafting,
    eigenvalue_floor=eigenvalue_floor,
  )


def _per_example_leaves(
  fisher_source: str,
  per_example_grads: PyTree | None,
  updates: PyTree,
  treedef: Any,
) -> list[Any]:
  """The ``per_example_grads`` leaves (``None`` each for batch statistics)."""
  if fisher_source == "batch":
    return [None] * treedef.num_leaves
  per_example_grads, _ = numerics.checked_per_example_grads(
    per_example_grads, updates, function="scale_by_fismo"
  )
  return treedef.flatten_up_to(per_example_grads)


def _leaf_states(state: FISMOState, treedef: Any) -> list[tuple[Any, ...]]:
  """Per leaf, ``(momentum, P, Q, P root, Q root)`` from ``state``."""
  fields = (
    state.momentum,
    state.left_factor,
    state.right_factor,
    state.left_root,
    state.right_root,
  )
  try:
    flat = [treedef.flatten_up_to(f) for f in fields]
  except (ValueError, TypeError) as e:
    raise ValueError(
      "updates do not match the FISMO state built by init (different "
      f"tree structure).\n  updates: {treedef}\n  state.momentum: "
      f"{jax.tree.structure(state.momentum)}"
    ) from e
  return list(zip(*flat))


def _state_from_leaves(
  treedef: Any,
  count: jax.Array,
  leaf_states: list[tuple[Any, ...]],
  fallback: optax.OptState,
  notfinite_count: jax.Array,
) -> FISMOState:
  fields = list(zip(*leaf_states)) or [()] * 5
  mu, p, q, wp, wq = (treedef.unflatten(list(f)) for f in fields)
  return FISMOState(
    count=count,
    momentum=mu,
    left_factor=p,
    right_factor=q,
    left_root=wp,
    right_root=wq,
    fallback=fallback,
    notfinite_count=notfinite_count,
  )


def _fallback_view(
  treedef: Any, leaves: list[Any], plans: list[_Plan | None]
) -> PyTree:
  """The tree the fallback sees: its own leaves, ``MaskedNode`` elsewhere."""
  return treedef.unflatten(
    [x if p is None else optax.MaskedNode() for x, p in zip(leaves, plans)]
  )


def _check_leaf_states(
  updates: PyTree, plan_list: list[_Plan | None], old_states: list[Any]
) -> None:
  """Each leaf must be shaped (and routed) as the state was built for."""
  paths = jax.tree_util.tree_flatten_with_path(updates)[0]
  for (path, g), plan, old in zip(paths, plan_list, old_states):
    built = None if isinstance(old[0], optax.MaskedNode) else jnp.shape(old[0])
    if (plan is None) == (built is None) and built in (None, jnp.shape(g)):
      continue
    was = "a fallback leaf" if built is None else f"shape {built}"
    raise ValueError(
      "updates do not match params (different shapes): updates"
      f"{jax.tree_util.keystr(path)} has shape {jnp.shape(g)} where the "
      f"FISMO state was built for {was}; re-run init on the current params."
    )


def _check_fallback_state(
  fallback_tx: optax.GradientTransformation, view: PyTree, built: Any
) -> None:
  """The fallback's state must be the one its leaves, as given, would get:
  a leaf without a FISMO plan carries no state of ours to compare with, and
  a mis-shaped one would broadcast against the fallback's statistics."""
  want = jax.eval_shape(fallback_tx.init, view)
  same = jax.tree.structure(want) == jax.tree.structure(built) and all(
    jnp.shape(a) == jnp.shape(b)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(built))
  )
  if same:
    return
  leaves = [
    f"updates{jax.tree_util.keystr(path)} {jnp.shape(x)}"
    for path, x in jax.tree_util.tree_flatten_with_path(view)[0]
  ]
  raise ValueError(
    "updates do not match params (different shapes): the fallback state "
    "was built for other shapes of the leaves without a FISMO plan (now "
    f"{', '.join(leaves)}); re-run init on the current params."
  )


def _fismo_step(
  treedef: Any,
  leaf_inputs: tuple[list[Any], list[Any], list[Any], list[Any]],
  state: FISMOState,
  fallback_tx: optax.GradientTransformationExtraArgs,
  precondition_interval: Any,
  opts: _Options,
  *,
  fallback_params: PyTree = None,
) -> tuple[optax.Updates, FISMOState]:
  """One FISMO step over all leaves, from finite inputs.

  Args:
    treedef: the updates' tree structure.
    leaf_inputs: per leaf, ``(gradient, per-example gradients or None, plan,
      (momentum, P, Q, P root, Q root))`` as four aligned lists.
    state: the old state.
    fallback_tx: the transform of the leaves without a plan.
    precondition_interval: steps between root refreshes.
    opts: the hyperparameters.
    fallback_params: the fallback's view of the params (``None`` without
      params).
  """
  leaves, pegs, plan_list, old_states = leaf_inputs
  count_inc = jnp.asarray(optax.safe_increment(state.count))
  refresh = (state.count % precondition_interval) == 0
  fb_view = _fallback_view(treedef, leaves, plan_list)
  fb_updates, fb_state = fallback_tx.update(
    fb_view, state.fallback, fallback_params
  )
  new_updates, new_states = [], []
  for g, peg, plan, old, fb in zip(
    leaves, pegs, plan_list, old_states, treedef.flatten_up_to(fb_updates)
  ):
    if plan is None:
      new_updates.append(fb)
      new_states.append(old)
    elif jnp.size(g) == 0:  # An empty matrix: nothing to precondition.
      new_updates.append(g)
      new_states.append(old)
    else:
      u, new = _leaf_update(g, peg, plan, old, count_inc, refresh, opts)
      new_updates.append(u)
      new_states.append(new)
  new_state = _state_from_leaves(
    treedef, count_inc, new_states, fb_state, state.notfinite_count
  )
  return treedef.unflatten(new_updates), new_state


def scale_by_fismo(
  beta: float | jax.Array = 0.95,
  gamma: float | jax.Array = 0.95,
  damping: float | jax.Array = 1.0,
  ns_coeffs: Any = _matrix_roots.QUINTIC_NS_COEFFS,
  ns_steps: int | jax.Array = 5,
  eps: float | jax.Array = 1e-8,
  mu_dtype: Any = None,
  *,
  nesterov: bool = False,
  precondition_interval: int | jax.Array = 10,
  root_method: Literal["eigh", "newton", "cholesky"] = "newton",
  factor_norm: Literal["pre_ema", "paper"] = "pre_ema",
  momentum_space: Literal["whitened", "original"] = "whitened",
  grafting: Literal["none", "muon_norm"] = "muon_norm",
  max_precond_dim: int | None = None,
  max_aspect_ratio: int | None = None,
  eigenvalue_floor: float | jax.Array = 1e-6,
  fisher_source: Literal["batch", "per_example"] = "batch",
  weight_dimension_numbers: WeightDimNumOrFn = None,
  fallback: optax.GradientTransformation | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales updates by FISMO: Muon in a Kronecker-factored Fisher metric.

  For each matrix leaf :math:`G \in \mathbb{R}^{m \times n}` (rows are the
  reduction/fan-in axis after Muon's reshape), with :math:`P_0 = I_m`,
  :math:`Q_0 = I_n`, :math:`M_0 = 0` (paper, Algorithm 1):

  .. math::

    S_P &= G Q^{-1} G^\top / n, \quad
    P \leftarrow \mathrm{norm}_m\bigl(\gamma P + (1-\gamma) L(S_P)\bigr) \\
    S_Q &= G^\top P^{-1} G / m, \quad
    Q \leftarrow \mathrm{norm}_n\bigl(\gamma Q + (1-\gamma) R(S_Q)\bigr)
      \quad\text{(with the new } P\text{)} \\
    \tilde G &= P^{-1/2} G Q^{-1/2}, \quad
    M \leftarrow \beta M + (1-\beta) \tilde G \\
    \Delta &= P^{-1/2}\, \mathrm{Polar}(M)\, Q^{-1/2},

  where :math:`\mathrm{norm}_d(X) = \mathrm{sym}(d X / \operatorname{tr} X)`
  and Polar is Muon's Newton-Schulz iteration. :math:`\Delta` maximises
  :math:`\langle G, \Delta\rangle` subject to
  :math:`\|P^{1/2} \Delta Q^{1/2}\|_2 \le 1`; :math:`P = Q = I` is Muon.
  By default (``grafting="muon_norm"``) :math:`\Delta` is then rescaled to
  the Frobenius norm of :math:`\mathrm{Polar}(M)`, Muon's step; pass
  ``grafting="none"`` for Algorithm 1's step as written.

  **Decisions where the paper leaves a choice** (each one tested):

  * ``factor_norm``: read literally (``"paper"``),
    :math:`L = S_P + \mu \operatorname{tr}(P)/m\, I` mixes the trace-``m``
    factor with *unnormalised* statistics, so at small gradient scales the
    factors stay at the identity and FISMO silently becomes Muon.
    The default ``"pre_ema"`` trace-normalises first,
    :math:`L = (m S_P / \operatorname{tr} S_P + \mu I)/(1 + \mu)` (relative
    damping), which makes the whole update invariant to the gradient scale.
  * damping: Algorithm 1's :math:`\mu \operatorname{tr}(P_{old})/m`
    (Theorem 1's :math:`\operatorname{tr}(Q^{-1})` variant is not offered);
    the paper gives no defaults, ours are :math:`\beta=\gamma=0.95`,
    :math:`\mu=1`.
  * **How the defaults were chosen.** The paper leaves damping, momentum
    space, refresh interval and grafting open; we swept them (damping 1e-3
    to 1, both momentum spaces, both graftings, a refresh every 1, 10 or 50
    steps; 32 configurations, each with its own lr chosen on a validation
    split) on a task that no test or other benchmark tunes on (a 64-96-96-10
    MLP on another split of the digits data), against Muon and AdamW at
    their best lrs, over three seeds. The damping decided it: with
    :math:`\mu \le 0.1` every configuration ended at 1.5 to 3.9 times
    Muon's test loss; with :math:`\mu = 1` all eight came within 1.07 to
    1.28 times (about one standard error), at Muon's own best lr. Momentum
    space, grafting and interval moved the loss by less than the seed noise
    there, so momentum space keeps the paper's choice (whitened) and the
    interval is 10. Grafting was decided on language models, where it
    mattered most: on a 5.7M-parameter Flax transformer LM (byte-level
    text, hidden matrices to FISMO or Muon, each lr chosen from Muon's grid
    on validation, three seeds; ``benchmarks/lm_wallclock.py``) FISMO
    without grafting ended at validation loss 2.255 (2.197 at a tenth of
    its chosen lr) against Muon's 2.145, and with ``"muon_norm"`` at
    2.134; on a small character LM (``benchmarks/fismo_quality.py``, five
    seeds) grafting helped more (held-out loss 2.141 without, 1.916 with,
    Muon 2.008). On the digits MLPs the unscaled step did as well or better
    (test loss 0.079 without, 0.095 with). Less damping trusts the factors
    more: lower it (and the lr) when the factor statistics are reliable,
    e.g. large batches or ``fisher_source="per_example"``; ``damping=0.1``
    was the default before this sweep.
  * **Damping above 1 trades tasks.** A later sweep past the first one's
    edge (``benchmarks/fismo_defaults.py --dampings 1,3,10,30``, same
    held-out task) put :math:`\mu` = 3 to 30 at 0.92-0.97 times Muon's
    test loss, against 1.07-1.25 at :math:`\mu = 1`; on the digits MLP of
    ``benchmarks/fismo_quality.py`` (five seeds) :math:`\mu = 10` tied
    Muon (test loss 0.035 against 0.033; 0.095 at :math:`\mu = 1`). On
    the character LM the order reverses: held-out loss 1.916 at
    :math:`\mu = 1`, 1.980 at 3, 2.043 at 10, Muon 2.008. The default stays
    1, for language models; on small MLP classifiers use ``damping=10``.
  * roots: the inverse square roots are recomputed in float32 every
    ``precondition_interval`` steps (``lax.cond`` on the step count only) and
    cached in the state. Between refreshes the Gauss-Seidel sweep uses the
    cached (stale) :math:`P^{-1/2}`; with ``precondition_interval=1``,
    ``root_method="eigh"`` and ``grafting="none"`` the step is exactly
    Algorithm 1.
    ``"newton"`` (default): matmul-only coupled Newton iteration
    warm-started from the (symmetrised) cached root, so a few iterations;
    it returns a whitening factor :math:`W` (:math:`W W^\top = P^{-1}`)
    equal to the symmetric root up to an orthogonal factor (the first
    refresh, from the identity, is exact); a root whose residual
    :math:`\max|W^\top P W - I|` ends above 0.1 (a factor far from the
    cached root's, e.g. after a jump in the gradients' scale) is replaced
    by eigh's, on that refresh only. The orthogonal factor is not
    removed and can build up over refreshes when the factors change a lot
    between them, which rotates the frame of the whitened momentum: with
    the gradient's statistics changing every 10 steps, the updates were
    3% from ``"eigh"``'s at ``damping=1`` and up to 12% (147% at single
    steps) at ``damping=1e-3``, in a scratch test; ``"eigh"`` or
    ``momentum_space="original"`` avoid it. It did not show in training:
    ``benchmarks/fismo_defaults.py`` (5 seeds) put Newton's and eigh's test
    losses within 0.002 of each other at ``damping=1``. ``"eigh"``: exact symmetric roots with a
    relative eigenvalue floor; an eigendecomposition costs more than the
    few matmuls of a warm-started Newton refresh (``benchmarks/fismo_speed.py``
    times both: on 2 CPU cores, a refresh step of 1.63x Muon's with eigh,
    1.56x with Newton, for 1024-row leaves).
    ``"cholesky"``: :math:`W = L^{-\top}`; a triangular whitening, valid only
    with ``momentum_space="original"`` (checked), where the step depends on
    :math:`P` alone and not on which whitening is used. Both LAPACK methods
    decompose one factor per call, also for stacked factors and under
    ``jax.vmap``: jaxlib's CPU kernels split a batch over XLA:CPU's thread
    pool and block a pool thread meanwhile, and two batched calls at once
    deadlocked it (10 vmapped lanes on 2 cores hung within 100 steps).
    Newton stays the default: matmuls only, fast on accelerators.
  * Newton-Schulz: Muon's quintic coefficients, 5 steps (optax's defaults).
  * ``grafting``: ``"muon_norm"`` (default) rescales :math:`\Delta` to the
    Frobenius norm of :math:`\mathrm{Polar}(M)`, Muon's step, so that the
    preconditioning changes the step's direction and not its size, and
    Muon's learning rates transfer; ``"none"`` is Algorithm 1's step, larger
    by about the mean inverse eigenvalue of the trace-normalised factors
    (>= 1), which grows as the factors move away from the identity.
  * ``momentum_space``: ``"whitened"`` (paper; the momentum goes stale
    as :math:`P, Q` move) or ``"original"`` (Mousse: momentum on :math:`G`,
    whitened after accumulation).
  * ``fisher_source``: ``"batch"`` uses the mini-batch gradient (paper).
    ``"per_example"`` (beyond the paper) averages the statistics over
    per-example gradients, passed as the ``per_example_grads`` extra argument
    (``updates``' tree with a leading batch axis).
  * routing: biases, embeddings and other non-matrix leaves follow Muon's
    convention: ``weight_dimension_numbers`` routes them (``None`` leaves) to
    ``fallback`` (default :func:`optax.scale_by_adam`).
  * Momentum is Muon's EMA with bias correction (``nesterov`` as in optax);
    the bias correction is a scalar that the Frobenius normalisation in
    Newton-Schulz removes, so the paper's plain EMA is the same step.

  Cost: per step, with cached roots, about :math:`8 m^2 n + 6 m n^2` flops on
  top of Muon's :math:`5(4 m^2 n + 2 m^3)`; plus the roots at each refresh.
  As in Distributed Shampoo, a side longer than ``max_precond_dim`` is not
  preconditioned, and for leaves with ``max(m, n) > max_aspect_ratio *
  min(m, n)`` only the smaller side is.

  Non-finite steps follow the library's one policy
  (:func:`fisher_optax.fisher.numerics.skip_nonfinite_step`): a non-finite
  gradient (or per-example gradient) leaves the whole state, fallback
  included, unchanged but for ``notfinite_count`` and gives NaN updates, so
  that :func:`optax.apply_if_finite` sees it; a finite step whose factor
  statistics overflow (gradients of 1e30) is skipped the same way with zero
  updates, and no root is ever computed from a non-finite factor. An
  all-zero gradient leaves the factors unchanged (``"pre_ema"``). Updates
  shaped unlike the params (or the state built by ``init``) raise
  ``ValueError``; zero-size leaves pass through.

  Args:
    beta: momentum decay :math:`\beta`.
    gamma: factor EMA decay :math:`\gamma` in [0, 1]; 1 freezes ``P = Q = I``.
    damping: :math:`\mu \ge 0` (relative to the mean eigenvalue).
    ns_coeffs: Newton-Schulz coefficients ``(a, b, c)`` or one triple per step.
    ns_steps: Newton-Schulz steps: an int (unrolled), or an integer scalar
      array, run as a loop (``inject_hyperparams`` passes one unless
      ``ns_steps`` is in its ``static_args``).
    eps: added to the Frobenius norm in Newton-Schulz.
    mu_dtype: momentum dtype (default: the params').
    nesterov: Muon's Nesterov momentum (not in the paper; default off,
      where ``optax.contrib.muon``'s is on: identity factors give
      ``muon()``'s steps with ``nesterov=True``).
    precondition_interval: steps between root refreshes (step 0 refreshes).
    root_method: ``"eigh"``, ``"newton"`` or ``"cholesky"`` (see above).
    factor_norm: ``"pre_ema"`` (scale-invariant) or ``"paper"``.
    momentum_space: ``"whitened"`` or ``"original"``.
    grafting: ``"muon_norm"`` (default) or ``"none"`` (the paper's step).
    max_precond_dim: sides longer than this stay unpreconditioned (static
      int; ``None``: 4096).
    max_aspect_ratio: two-sided only if ``max(m,n) <= ratio * min(m,n)``
      (static int; ``None``: 2).
    eigenvalue_floor: relative floor of the factors' eigenvalues in the roots.
    fisher_source: ``"batch"`` or ``"per_example"`` (see above).
    weight_dimension_numbers: ``MuonDimensionNumbers`` routing, as in
      :func:`optax.contrib.muon`: ``None`` (rank-2 leaves), one object (every
      leaf of rank >= 2), a tree/prefix with ``None`` for fallback leaves, or
      a callable returning one (under ``inject_hyperparams`` list a callable
      in ``static_args``).
    fallback: transform for the leaves routed away from FISMO.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs`; ``update`` accepts the
    keyword extra ``per_example_grads`` and ignores other extras.

  Example::

    >>> import jax.numpy as jnp
    >>> import fisher_optax
    >>> params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
    >>> tx = fisher_optax.scale_by_fismo()
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.arange(12.0).reshape(4, 3), "b": jnp.ones((3,))}
    >>> updates, state = tx.update(grads, state, params)
    >>> updates["w"].shape
    (4, 3)

  References:
    Xu et al, `FISMO: Fisher-Structured Momentum-Orthogonalized Optimizer
    <https://arxiv.org/abs/2601.21750>`_, 2026

    Jordan, `Muon: An optimizer for hidden layers
    <https://kellerjordan.github.io/posts/muon/>`_, 2024

    Anil et al, `Scalable Second Order Optimization for Deep Learning
    <https://arxiv.org/abs/2002.09018>`_, 2020
  """
  opts = _check_options(
    beta,
    gamma,
    damping,
    ns_coeffs,
    ns_steps,
    eps,
    nesterov,
    precondition_interval,
    root_method,
    factor_norm,
    momentum_space,
    grafting,
    eigenvalue_floor,
  )
  # None defaults: inject_hyperparams would make an int default an array.
  max_precond_dim = validation.check_static_int(
    "max_precond_dim",
    _MAX_PRECOND_DIM if max_precond_dim is None else max_precond_dim,
    minimum=0,
  )
  max_aspect_ratio = validation.check_static_int(
    "max_aspect_ratio",
    _MAX_ASPECT_RATIO if max_aspect_ratio is None else max_aspect_ratio,
    minimum=1,
  )
  source = validation.check_fisher_source(
    fisher_source, function="scale_by_fismo"
  )
  mu_dtype = numerics.canonical_float_dtype("mu_dtype", mu_dtype)
  # Adam's second moment of float16 leaves would overflow float16.
  fallback_tx = optax.with_extra_args_support(
    numerics.widen_float16_state(optax.scale_by_adam())
    if fallback is None
    else fallback
  )

  def plans(tree: PyTree) -> tuple[Any, list[Any], list[_Plan | None]]:
    leaves, treedef = jax.tree.flatten(tree)
    spec = weight_dimension_numbers
    return (
      treedef,
      leaves,
      _plans(spec, tree, max_precond_dim, max_aspect_ratio),
    )

  def init_fn(params: optax.Params) -> FISMOState:
    validation.check_real_floating(
      params, what="params", function="scale_by_fismo"
    )
    treedef, leaves, plan_list = plans(params)
    leaf_states = [
      _init_leaf(x, p, mu_dtype) for x, p in zip(leaves, plan_list)
    ]
    fallback_state = fallback_tx.init(
      _fallback_view(treedef, leaves, plan_list)
    )
    count = jnp.zeros([], jnp.int32)
    return _state_from_leaves(
      treedef, count, leaf_states, fallback_state, jnp.zeros([], jnp.int32)
    )

  def update_fn(
    updates: optax.Updates,
    state: FISMOState,
    params: optax.Params | None = None,
    *,
    per_example_grads: optax.Updates | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, FISMOState]:
    del extra_args
    if params is not None:
      validation.check_like(updates, params, what="updates")
    treedef, leaves, plan_list = plans(updates)
    pegs = _per_example_leaves(source, per_example_grads, updates, treedef)
    old_states = _leaf_states(state, treedef)
    _check_leaf_states(updates, plan_list, old_states)
    _check_fallback_state(
      fallback_tx, _fallback_view(treedef, leaves, plan_list), state.fallback
    )

    fb_params = None
    if params is not None:
      fb_params = _fallback_view(
        treedef, treedef.flatten_up_to(params), plan_list
      )

    def step() -> tuple[optax.Updates, FISMOState]:
      return _fismo_step(
        treedef,
        (leaves, pegs, plan_list, old_states),
        state,
        fallback_tx,
        precondition_interval,
        opts,
        fallback_params=fb_params,
      )

    return numerics.skip_nonfinite_step(step, updates, state, inputs=pegs)

  return optax.GradientTransformationExtraArgs(
    init_fn,
    update_fn,  # pyright: ignore[reportArgumentType]
  )


def _scale_by_shape(
  weight_dimension_numbers: WeightDimNumOrFn,
  consistent_rms: float | jax.Array | None,
  name: str,
) -> optax.GradientTransformation:
  """Muon's width scaling, with FISMO's routing (optax.contrib.muon's)."""

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    views = matrix_view.plans(weight_dimension_numbers, updates, name=name)

    def scale(u, view):
      if view is None or jnp.size(u) == 0:
        return u
      fan_in, fan_out = view.rows, view.cols
      if consistent_rms is None:
        factor = math.sqrt(max(1.0, fan_out / fan_in))
      else:
        factor = math.sqrt(max(fan_in, fan_out)) * consistent_rms
      return (factor * u).astype(u.dtype)

    return treedef.unflatten(list(map(scale, leaves, views))), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def fismo(
  learning_rate: optax.ScalarOrSchedule,
  beta: float | jax.Array = 0.95,
  gamma: float | jax.Array = 0.95,
  damping: float | jax.Array = 1.0,
  ns_coeffs: Any = _matrix_roots.QUINTIC_NS_COEFFS,
  ns_steps: int | jax.Array = 5,
  eps: float | jax.Array = 1e-8,
  weight_decay: float | jax.Array = 0.0,
  weight_decay_mask: Any = None,
  mu_dtype: Any = None,
  *,
  nesterov: bool = False,
  precondition_interval: int | jax.Array = 10,
  root_method: Literal["eigh", "newton", "cholesky"] = "newton",
  factor_norm: Literal["pre_ema", "paper"] = "pre_ema",
  momentum_space: Literal["whitened", "original"] = "whitened",
  grafting: Literal["none", "muon_norm"] = "muon_norm",
  max_precond_dim: int | None = None,
  max_aspect_ratio: int | None = None,
  eigenvalue_floor: float | jax.Array = 1e-6,
  fisher_source: Literal["batch", "per_example"] = "batch",
  adam_b1: float | jax.Array = 0.9,
  adam_b2: float | jax.Array = 0.999,
  adam_eps_root: float | jax.Array = 0.0,
  adam_weight_decay: float | jax.Array = 0.0,
  adam_learning_rate: optax.ScalarOrSchedule | None = None,
  fismo_weight_dimension_numbers: WeightDimNumOrFn = None,
  consistent_rms: float | jax.Array | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""FISMO: Fisher-structured momentum orthogonalisation, built like muon().

  Matrix leaves (routed by ``fismo_weight_dimension_numbers`` exactly as
  :func:`optax.contrib.muon` routes ``muon_weight_dimension_numbers``) get

  .. math::

    \Delta W = -\eta\, \bigl(s\, P^{-1/2}\, \mathrm{Polar}(M)\, Q^{-1/2}
      + \lambda W\bigr),

  :func:`scale_by_fismo` followed by Muon's width scaling
  :math:`s = \sqrt{\max(1, \text{fan\_out}/\text{fan\_in})}` (or
  ``consistent_rms``), decoupled weight decay and the learning rate; every
  other leaf gets :func:`optax.adamw` with its own learning rate and weight
  decay (under the same non-finite policy, its state in
  :class:`fisher_optax.fisher.numerics.SkipNonfiniteState`; float32
  moments for float16 params). See :func:`scale_by_fismo` for the algorithm and the documented
  decisions on the paper's ambiguities.

  **Learning rate.** Use Muon's lr, not AdamW's: with the default
  ``grafting="muon_norm"`` the step has Muon's norm (and
  ``adam_learning_rate`` defaults to the same lr). On a 5.7M-parameter
  transformer LM FISMO was best at 3e-2 and Muon at 1e-2 of the same grid
  (validation loss 2.134 vs 2.145 after 400 steps; FISMO's step took
  1.25-1.35x Muon's time). On a digits MLP (every matrix to FISMO or Muon,
  400 steps, three seeds) both were best at 3e-3, and at AdamW's best lr
  (1e-3) both undertrained; there FISMO trails Muon at the best lr (test
  loss 0.103, or 0.083 with ``grafting="none"``, vs 0.038).

  **Keep the output layer off FISMO**, as Muon's author advises for Muon:
  route only hidden matrices (a ``fismo_weight_dimension_numbers`` with
  ``None`` at the head). On that digits MLP most of FISMO's gap came from
  the classifier head, whose class-side factor whitens the logits' Fisher:
  with the head on Adam at the same lr FISMO ended at test loss 0.044
  against Muon's 0.033 (0.103 against 0.038 with every matrix). On such
  small classifiers also raise ``damping`` to 10 (see
  :func:`scale_by_fismo`): with the head on Adam at 1e-3, FISMO's 0.095
  became 0.035 (Muon 0.033), and with every matrix on FISMO 0.039 (Muon
  0.038); language models want the default.

  Args:
    learning_rate: FISMO learning rate or schedule.
    beta: momentum decay.
    gamma: factor EMA decay.
    damping: relative damping :math:`\mu`.
    ns_coeffs: Newton-Schulz coefficients.
    ns_steps: Newton-Schulz steps (an int, or an integer scalar array: see
      :func:`scale_by_fismo`).
    eps: Newton-Schulz and Adam epsilon.
    weight_decay: decoupled weight decay of the FISMO leaves (times the lr).
    weight_decay_mask: mask (or callable) for ``weight_decay``.
    mu_dtype: momentum dtype.
    nesterov: Nesterov momentum (also passed to the Adam fallback, as
      muon()); off by default, on in ``optax.contrib.muon``.
    precondition_interval: steps between inverse-root refreshes.
    root_method: ``"eigh"``, ``"newton"`` or ``"cholesky"``.
    factor_norm: ``"pre_ema"`` or ``"paper"``.
    momentum_space: ``"whitened"`` or ``"original"``.
    grafting: ``"muon_norm"`` (default) or ``"none"`` (the paper's step).
    max_precond_dim: sides longer than this are not preconditioned (static
      int; ``None``: 4096).
    max_aspect_ratio: two-sided preconditioning only up to this aspect ratio
      (static int; ``None``: 2).
    eigenvalue_floor: relative eigenvalue floor in the roots.
    fisher_source: ``"batch"`` or ``"per_example"`` (``per_example_grads``
      extra, masked to the FISMO leaves automatically).
    adam_b1: Adam's first-moment decay.
    adam_b2: Adam's second-moment decay.
    adam_eps_root: Adam's ``eps_root``.
    adam_weight_decay: AdamW weight decay of the non-FISMO leaves.
    adam_learning_rate: their learning rate (default ``learning_rate``).
    fismo_weight_dimension_numbers: routing, see :func:`scale_by_fismo`.
    consistent_rms: optional consistent-RMS scaling, as in muon().

  Returns:
    A :class:`optax.GradientTransformationExtraArgs`.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> import fisher_optax
    >>> params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
    >>> loss = lambda p: jnp.sum((jnp.arange(4.0) @ p["w"] + p["b"]) ** 2)
    >>> tx = fisher_optax.fismo(learning_rate=1e-2)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jax.grad(loss)(params), state, params)
    >>> params = optax.apply_updates(params, updates)

  References:
    Xu et al, `FISMO: Fisher-Structured Momentum-Orthogonalized Optimizer
    <https://arxiv.org/abs/2601.21750>`_, 2026

    Jordan, `Muon: An optimizer for hidden layers
    <https://kellerjordan.github.io/posts/muon/>`_, 2024
  """
  validation.check_learning_rate(learning_rate)
  if adam_learning_rate is None:
    adam_learning_rate = learning_rate
  else:
    validation.check_positive(
      "adam_learning_rate", adam_learning_rate, allow_zero=True, schedule=True
    )
  if consistent_rms is not None:
    validation.check_positive("consistent_rms", consistent_rms)
  validation.check_positive(
    "weight_decay", weight_decay, allow_zero=True, schedule=True
  )
  validation.check_in_unit_interval("adam_b1", adam_b1)
  validation.check_in_unit_interval("adam_b2", adam_b2)
  validation.check_positive("adam_eps_root", adam_eps_root, allow_zero=True)
  validation.check_positive(
    "adam_weight_decay", adam_weight_decay, allow_zero=True, schedule=True
  )
  dims_spec = fismo_weight_dimension_numbers
  name = "fismo_weight_dimension_numbers"

  def param_labels(params):
    dims = matrix_view.resolve(dims_spec, params, name=name)
    labels = ["adam" if d is None else "fismo" for d in dims]
    return jax.tree.structure(params).unflatten(labels)

  tx = optax.partition(
    transforms={
      "fismo": optax.chain(
        scale_by_fismo(
          beta=beta,
          gamma=gamma,
          damping=damping,
          ns_coeffs=ns_coeffs,
          ns_steps=ns_steps,
          eps=eps,
          mu_dtype=mu_dtype,
          nesterov=nesterov,
          precondition_interval=precondition_interval,
          root_method=root_method,
          factor_norm=factor_norm,
          momentum_space=momentum_space,
          grafting=grafting,
          max_precond_dim=max_precond_dim,
          max_aspect_ratio=max_aspect_ratio,
          eigenvalue_floor=eigenvalue_floor,
          fisher_source=fisher_source,
          weight_dimension_numbers=dims_spec,
        ),
        _scale_by_shape(dims_spec, consistent_rms, name),
        optax.add_decayed_weights(weight_decay, weight_decay_mask),
        optax.scale_by_learning_rate(learning_rate),
      ),
      # Under the non-finite policy too; float32 moments for float16.
      "adam": numerics.skip_nonfinite(
        numerics.widen_float16_state(
          optax.adamw(
            learning_rate=adam_learning_rate,
            b1=adam_b1,
            b2=adam_b2,
            eps=eps,
            eps_root=adam_eps_root,
            weight_decay=adam_weight_decay,
            mu_dtype=mu_dtype,
            nesterov=nesterov,
          )
        )
      ),
    },
    param_labels=param_labels,
    mask_compatible_extra_args=True,
  )
  # A skip in either partition (or an overflow in FISMO's statistics) undoes
  # the whole step: the schedules' counts, the weight decay and the other
  # partition's moments do not move on it.
  tx = numerics.follow_skips(tx)

  def update_fn(updates, state, params=None, **extra_args):
    # Before the labels are computed from the updates' shapes (a scalar
    # gradient for a matrix would be routed to Adam and broadcast).
    if params is not None:
      validation.check_like(updates, params, what="updates")
    return tx.update(updates, state, params, **extra_args)

  def init_fn(params: optax.Params) -> Any:
    # Here too: the leaves routed to Adam never reach scale_by_fismo's check.
    validation.check_real_floating(params, what="params", function="fismo")
    return tx.init(params)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
