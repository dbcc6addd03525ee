# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Protected-subspace fine-tuning (PhysGuard): project updates off old Fisher.

Per parameter leaf ``m``, the per-example gradients ``G_m`` (``N x d_m``) of
the source task span the directions its empirical Fisher ``G_m^T G_m / N``
cares about. :func:`protected_subspace` keeps the top ones (the smallest ``k``
that reaches an energy fraction ``tau``) as an orthonormal basis ``U_m``, and
:func:`project_out_subspace` removes ``alpha U_m U_m^T u`` from every update.

Decisions where the paper and its reference code leave a choice:

* **Placement.** :func:`physguard` projects *after* Adam by default (the
  paper projects before): only then is the applied update (weight decay
  included) exactly orthogonal to the protected directions; Adam's
  per-coordinate scaling re-mixes a projected gradient. ``benchmarks/
  continual.py`` compares both placements on permuted digits.
* **Grouping.** One basis per parameter leaf (per tensor, as in the paper);
  there is no global dense mode. A leaf never gets more than ``min(N,
  d_leaf)`` directions and is not frozen by identity columns when small (the
  reference code's ``d <= 2 k_max`` rule).
* **Labels, tau, N.** The caller chooses the gradients: true labels give
  PhysGuard's empirical-Fisher basis, labels sampled from the model a
  true-Fisher basis. ``tau`` defaults to the paper's 0.9; a larger ``tau``
  with more examples and sampled labels may protect better (the continual
  benchmark measures both).
* **Several tasks.** ``existing=`` extends a basis GPM-style: new directions
  come from the gradients' residual off the old basis, so the basis stays
  orthonormal and old directions are never dropped.
* **Precision.** Bases are computed in (at least) float32 and stored, by
  default, in ``promote(param dtype, float32)``; ``basis_dtype`` stores them
  narrower (bf16 halves their memory, at the price of a projection that is
  exact only to bf16's precision). :func:`physguard`'s Adam moments have
  the params' dtype, float32 for float16 params (whose range cannot hold
  squared gradients).
* **Non-finite values.** No eigendecomposition ever sees a non-finite
  matrix: :func:`protected_subspace` refuses per-example gradients that are
  not finite (or whose energy overflows), and the transforms follow the
  library's one non-finite policy
  (:func:`fisher_optax.fisher.numerics.skip_nonfinite_step`).
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fisher_optax import fisher
from fisher_optax.fisher import linalg
from fisher_optax.fisher import numerics
from fisher_optax.fisher import validation

PyTree = Any
ScalarOrSchedule = float | jax.Array | optax.Schedule
MaskOrFn = PyTree | Callable[[PyTree], PyTree] | None

_PLACEMENTS = ("after", "before")


class ProtectedSubspace(NamedTuple):
  """Per-leaf orthonormal protected bases, zero-padded to ``max_rank`` rows.

  Attributes:
    bases: params-shaped leaves with a leading ``max_rank`` axis; rows
      ``[0, rank)`` are orthonormal, the rest are exactly zero.
    rank: params-shaped tree of int32 scalars, the number of protected
      directions of each leaf.
  """

  bases: PyTree
  rank: PyTree


class ProjectOutSubspaceState(NamedTuple):
  """State of :func:`project_out_subspace`.

  Attributes:
    count: int32 step counter (drives an ``alpha`` schedule; non-finite
      steps are not counted).
    protected_subspace: the :class:`ProtectedSubspace`; swap it with
      ``optax.tree.set(opt_state, protected_subspace=...)`` (no retrace when
      its dtypes and shapes are the same).
    notfinite_count: int32 number of steps skipped as non-finite (as in
      :func:`optax.apply_if_finite`'s state).
  """

  count: jax.Array
  protected_subspace: ProtectedSubspace
  notfinite_count: jax.Array


def init_protected_subspace(
  params: PyTree,
  max_rank: int,
  *,
  basis_dtype: jax.typing.DTypeLike | None = None,
) -> ProtectedSubspace:
  """An empty :class:`ProtectedSubspace` (projection is the identity).

  Args:
    params: parameters (arrays or ``jax.ShapeDtypeStruct``).
    max_rank: rows per leaf. Static int.
    basis_dtype: dtype of the stored bases; default ``promote(param dtype,
      float32)``. ``jnp.bfloat16`` halves their memory for bf16 params.

  Returns:
    Zero bases and zero ranks.

  Example::

    >>> import jax.numpy as jnp, fisher_optax
    >>> sub = fisher_optax.init_protected_subspace({"w": jnp.ones(3)}, 2)
    >>> sub.bases["w"].shape, int(sub.rank["w"])
    ((2, 3), 0)
  """
  max_rank = validation.check_static_int("max_rank", max_rank, minimum=1)
  basis_dtype = numerics.canonical_float_dtype("basis_dtype", basis_dtype)
  bases = jax.tree.map(
    lambda p: numerics.zeros_like_stacked(
      p, (max_rank,), basis_dtype or numerics.compute_dtype(p)
    ),
    params,
  )
  rank = jax.tree.map(lambda p: jnp.zeros([], jnp.int32), params)
  return ProtectedSubspace(bases=bases, rank=rank)


def _leaf_ok(grads: jax.Array, old: jax.Array) -> jax.Array:
  """Whether a leaf's gradients are finite and their energy does not overflow
  (the Gram matrix of the eigensolver is then finite)."""
  g = grads.reshape(grads.shape[0], -1).astype(numerics.compute_dtype(old))
  return jnp.isfinite(jnp.sum(jnp.square(g)))


def _leaf_subspace(
  grads: jax.Array,
  old: jax.Array,
  old_rank: jax.Array,
  tau: Any,
) -> tuple[jax.Array, jax.Array]:
  """Extends one leaf's basis ``old`` (R, d) from finite gradients (N, d)."""
  max_rank = old.shape[0]
  n = grads.shape[0]
  cd = numerics.compute_dtype(old)
  g = grads.reshape(n, -1).astype(cd)
  u_old = old.reshape(max_rank, -1).astype(cd)
  total = jnp.sum(jnp.square(g))
  # Remove what is already protected: the new directions are then orthogonal
  # to the old ones by construction (GPM-style accumulation).
  residual = g - (g @ u_old.T) @ u_old
  captured = total - jnp.sum(jnp.square(residual))
  take = min(n, max_rank)
  # The engine's Gram-matrix eigensolver: eigenpairs of residual^T residual/N,
  # with zero directions (eigenvalue 0) below round-off.
  top = fisher.low_rank_from_grads(residual, rank=take)
  evals = n * top.eigvals.astype(g.dtype)
  vecs = top.eigvecs.astype(g.dtype)
  # Smallest k with (captured + top-k energy) >= tau * total; zero gradients
  # give k = 0.
  cum = captured + jnp.concatenate(
    [jnp.zeros([1], evals.dtype), jnp.cumsum(evals)]
  )
  k = jnp.sum(cum < tau * total)  # prefixes 0..take that fall short of tau
  k = jnp.minimum(k, jnp.sum(evals > 0))
  k = jnp.minimum(k, max_rank - old_rank).astype(jnp.int32)
  new = jnp.where((jnp.arange(take) < k)[:, None], vecs, 0.0)
  # Re-orthogonalise against the old basis once ("twice is enough").
  new = new - (new @ u_old.T) @ u_old
  norms = jnp.linalg.norm(new, axis=1, keepdims=True)
  new = jnp.where(norms > 0, new / jnp.where(norms > 0, norms, 1.0), 0.0)
  slots = old_rank + jnp.arange(take)
  bases = u_old.at[slots].add(new, mode="drop")
  bases = bases.reshape(old.shape).astype(old.dtype)
  return bases, (old_rank + k).astype(jnp.int32)


def protected_subspace(
  per_example_grads: PyTree,
  *,
  max_rank: int,
  tau: float | jax.Array = 0.9,
  existing: ProtectedSubspace | None = None,
  basis_dtype: jax.typing.DTypeLike | None = None,
) -> ProtectedSubspace:
  """Protected directions per leaf from per-example gradients on source data.

  For each leaf with per-example gradients :math:`G` (``N x d``), the
  :math:`N \\times N` Gram :math:`K = G G^\\top = Q \\Lambda Q^\\top`
  (eigenvalues descending) gives the top eigenvectors of the empirical Fisher
  :math:`G^\\top G / N` as :math:`u_i = G^\\top q_i / \\sqrt{\\lambda_i}`. The
  leaf keeps the smallest :math:`k` with

  .. math::

    \\frac{\\|G U_{\\text{old}}^\\top\\|^2 + \\sum_{i \\le k} \\lambda_i}
         {\\|G\\|_F^2} \\ge \\tau,

  capped by ``max_rank`` and the numerical rank of :math:`G`.

  With ``existing`` bases (cross-task accumulation, our GPM-style extension of
  PhysGuard), ``G`` is first projected off the existing directions, so the new
  directions are orthogonal to the old ones and the whole basis stays
  orthonormal; the energy already captured counts towards ``tau``. Bases
  never exceed ``min(max_rank, d_leaf)`` directions: unlike the reference
  code, a small tensor is not frozen by identity columns (its rank simply
  follows the tau rule).

  Labels: pass gradients with the true labels (PhysGuard) or with labels
  sampled from the model (a true-Fisher basis).

  Args:
    per_example_grads: params-shaped leaves with a leading ``N`` axis, e.g.
      ``fisher_optax.fisher.per_example_grads(loss_fn, params, batch)``.
    max_rank: rows per leaf (static int; 200-500 in the paper).
    tau: energy threshold in [0, 1] (paper: 0.9).
    existing: a :class:`ProtectedSubspace` to extend, with ``max_rank`` rows
      (the result keeps its dtypes).
    basis_dtype: dtype of new bases (without ``existing``); default
      ``promote(gradient dtype, float32)``. The eigenproblem is solved in at
      least float32 either way.

  Returns:
    A :class:`ProtectedSubspace`.

  Raises:
    ValueError: if a leaf's gradients are not finite or their squared sum
      overflows (the eigensolver never sees them). Under an outer ``jit``,
      where this cannot be checked, such a leaf keeps its ``existing``
      basis and rank.

  Example::

    >>> import jax, jax.numpy as jnp, fisher_optax
    >>> from fisher_optax import fisher
    >>> loss = lambda w, ex: (ex[0] @ w - ex[1]) ** 2
    >>> x, y = jnp.eye(4)[:2], jnp.ones(2)  # Two source examples.
    >>> g = fisher.per_example_grads(loss, jnp.zeros(4), (x, y))
    >>> sub = fisher_optax.protected_subspace(g, max_rank=3, tau=0.99)
    >>> int(sub.rank)  # The two directions the examples span.
    2

  References:
    Zhou et al, `PhysGuard: Fisher-guided gradient projection for
    sim-to-real neural PDE surrogates <https://arxiv.org/abs/2606.16602>`_,
    2026.
    Saha et al, `Gradient Projection Memory for continual learning
    <https://arxiv.org/abs/2103.09762>`_, 2021.
  """
  max_rank = validation.check_static_int("max_rank", max_rank, minimum=1)
  validation.check_in_unit_interval("tau", tau, closed_right=True)
  # Gradients of an nnx.split state hold variables: the bases are arrays.
  per_example_grads = numerics.pure_arrays(per_example_grads)
  if existing is not None:
    existing = numerics.pure_arrays(existing)
  like = jax.tree.map(
    lambda g: jax.ShapeDtypeStruct(g.shape[1:], g.dtype), per_example_grads
  )
  if existing is None:
    existing = init_protected_subspace(like, max_rank, basis_dtype=basis_dtype)
  else:
    validation.check_same_structure(
      existing.rank,
      like,
      what="per_example_grads",
      reference_name="existing.rank",
    )
    rows = {b.shape[0] for b in jax.tree.leaves(existing.bases)}
    if rows and rows != {max_rank}:
      raise ValueError(
        f"existing bases have {sorted(rows)} rows but max_rank={max_rank}."
      )
  validation.check_per_example_grads(
    per_example_grads,
    jax.tree.map(lambda b: b[0], existing.bases),
    function="protected_subspace",
  )
  subspace, ok = _extend(per_example_grads, existing, tau)
  _raise_if_not_finite(per_example_grads, ok)
  return subspace


def _raise_if_not_finite(per_example_grads: PyTree, ok: list[Any]) -> None:
  """A clear error for bad leaves (when the flags are concrete)."""
  try:
    bad = [not bool(o) for o in ok]
  except jax.errors.ConcretizationTypeError:
    return  # Under an outer jit: the bad leaves kept their basis.
  paths = [
    p for p, _ in jax.tree_util.tree_flatten_with_path(per_example_grads)[0]
  ]
  names = [jax.tree_util.keystr(p) for p, b in zip(paths, bad) if b]
  if names:
    raise ValueError(
      f"per_example_grads of {', '.join(names)} are not finite (or their "
      "squared sum overflows); no protected subspace can be computed from "
      "them."
    )


@jax.jit
def _extend(
  per_example_grads: PyTree, existing: ProtectedSubspace, tau: Any
) -> tuple[ProtectedSubspace, list[jax.Array]]:
  # One compiled program for all leaves (eager op-by-op dispatch of the
  # eigensolver is far slower on CPU).
  g_leaves, treedef = jax.tree.flatten(per_example_grads)
  bases, ranks, oks = [], [], []
  for g, b, r in zip(
    g_leaves,
    treedef.flatten_up_to(existing.bases),
    treedef.flatten_up_to(existing.rank),
  ):
    # LAPACK's eigh need not terminate on a non-finite matrix (XLA:CPU): a
    # bad leaf's solver sees zeros (also under vmap, unlike a lax.cond) and
    # the leaf keeps its old basis.
    ok = _leaf_ok(g, b)
    new_b, new_r = _leaf_subspace(jnp.where(ok, g, 0), b, r, tau)
    bases.append(jnp.where(ok, new_b, b))
    ranks.append(jnp.where(ok, new_r, r))
    oks.append(ok)
  subspace = ProtectedSubspace(
    bases=treedef.unflatten(bases), rank=treedef.unflatten(ranks)
  )
  return subspace, oks


def project_out_subspace(
  max_rank: int,
  alpha: ScalarOrSchedule = 1.0,
  subspace: ProtectedSubspace | None = None,
  *,
  basis_dtype: jax.typing.DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Removes the protected directions from the updates, leaf by leaf.

  .. math::

    u_m \\leftarrow u_m - \\alpha\\, U_m^\\top (U_m u_m)

  with orthonormal rows :math:`U_m` (``alpha = 1``: exact projection onto the
  orthogonal complement; ``alpha = 0``: identity). Placed first in a chain it
  is PhysGuard (the optimizer then sees projected gradients, but Adam's
  per-coordinate scaling re-mixes them); placed after the optimizer it
  guarantees the applied update is orthogonal to the protected directions
  (the default of :func:`physguard`). :func:`physguard` runs Adam, the
  decay and this projection as one step under one non-finite decision,
  which holds fewer temporaries than the same transforms chained; chain
  this one after other optimizers.

  Args:
    max_rank: rows per leaf of the stored bases. Static int.
    alpha: strength in [0, 1], or a schedule of the step count (PhysGuard's
      optional relaxation); a schedule's or an injected value is clipped
      to [0, 1].
    subspace: initial :class:`ProtectedSubspace`; default empty (identity).
      Swap it later with ``optax.tree.set(state, protected_subspace=...)``.
    basis_dtype: dtype of the empty bases built by ``init`` (without
      ``subspace``); default ``promote(param dtype, float32)``. Pass the same
      to :func:`protected_subspace` for subspaces swapped in later.

  Returns:
    An ``optax.GradientTransformationExtraArgs``. Updates shaped unlike the
    params raise ``ValueError``; a non-finite step leaves the state
    unchanged (``notfinite_count`` counts it) and returns updates that are
    NaN where the incoming ones are not finite and zero elsewhere.

  Example::

    >>> import jax.numpy as jnp, fisher_optax
    >>> g = jnp.array([[1.0, 0.0, 0.0]])  # Protect the first coordinate.
    >>> sub = fisher_optax.protected_subspace(g, max_rank=2)
    >>> tx = fisher_optax.project_out_subspace(2, subspace=sub)
    >>> updates, _ = tx.update(jnp.ones(3), tx.init(jnp.zeros(3)))
    >>> print(updates)
    [0. 1. 1.]

  References:
    Zhou et al, `PhysGuard <https://arxiv.org/abs/2606.16602>`_, 2026.
  """
  max_rank = validation.check_static_int("max_rank", max_rank, minimum=1)
  if not callable(alpha):
    validation.check_in_unit_interval("alpha", alpha, closed_right=True)
  if subspace is not None and not isinstance(subspace, ProtectedSubspace):
    raise TypeError(
      f"subspace must be a ProtectedSubspace, got {type(subspace).__name__}."
    )
  basis_dtype = numerics.canonical_float_dtype("basis_dtype", basis_dtype)

  if subspace is not None:
    rows = {b.shape[0] for b in jax.tree.leaves(subspace.bases)}
    if rows - {max_rank}:
      raise ValueError(
        f"subspace holds bases of {sorted(rows)} rows per leaf; max_rank is "
        f"{max_rank}: pass the max_rank it was built with."
      )

  def init_fn(params: PyTree) -> ProjectOutSubspaceState:
    validation.check_real_floating(
      params, what="params", function="project_out_subspace"
    )
    if subspace is None:
      start = init_protected_subspace(params, max_rank, basis_dtype=basis_dtype)
    else:  # Built for other params, it would fail only at the first update.
      # nnx.Optimizer's init passes the params as NNX variables.
      pure = numerics.pure_arrays(subspace)
      validation.check_like(
        _bases_like(pure), numerics.pure_arrays(params), what="subspace"
      )
      # Fresh buffers: a donated state must not delete the user's subspace.
      start = jax.tree.map(jnp.copy, pure)
    return ProjectOutSubspaceState(
      count=jnp.zeros([], jnp.int32),
      protected_subspace=start,
      notfinite_count=jnp.zeros([], jnp.int32),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _check_updates(updates, state)
    out, ok = _projection(updates, state, alpha)
    return out, _counted(state, ok, ok)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _bases_like(subspace: ProtectedSubspace) -> PyTree:
  """The params the bases were built for, as shapes."""
  return jax.tree.map(
    lambda b: jax.ShapeDtypeStruct(b.shape[1:], b.dtype), subspace.bases
  )


def _check_updates(updates: PyTree, state: ProjectOutSubspaceState) -> None:
  """The updates must be shaped like the params the bases were built for."""
  validation.check_like(
    updates,
    _bases_like(state.protected_subspace),
    what="updates",
    reference_name="subspace",
  )


# Up to this many rows, B^T c is summed row by row in the output's sweep;
# as one matrix product it is a leaf-sized temporary (small next to reading
# many rows).
_UNROLLED_ROWS = 16


def _coefficients(updates: PyTree, bases: PyTree) -> PyTree:
  """``B u`` per leaf, in the bases' compute dtype."""

  def leaf(u: jax.Array, basis: jax.Array) -> jax.Array:
    cd = numerics.compute_dtype(basis)
    return linalg.tree_stacked_dot(basis.astype(cd), u.astype(cd))

  return jax.tree.map(leaf, updates, bases)


def _projected(
  u: jax.Array, basis: jax.Array, c: jax.Array, a: Any
) -> jax.Array:
  """``u - a B^T c`` in ``c``'s dtype."""
  basis = basis.astype(c.dtype)
  if basis.shape[0] <= _UNROLLED_ROWS:
    rows = range(1, basis.shape[0])
    back = sum((c[k] * basis[k] for k in rows), c[0] * basis[0])
  else:
    back = linalg.tree_stacked_combine(basis, c)
  return u.astype(c.dtype) - jnp.asarray(a, c.dtype) * back


def _alpha(alpha: ScalarOrSchedule, count: jax.Array) -> Any:
  # A schedule's (or an injected) value cannot be checked at call time:
  # clipped, so that alpha > 1 never reverses the protected component.
  # NaN stays NaN, and the step is skipped.
  a = alpha(count) if callable(alpha) else alpha
  return jnp.clip(a, 0.0, 1.0)


def _projection(
  updates: PyTree, state: ProjectOutSubspaceState, alpha: ScalarOrSchedule
) -> tuple[PyTree, jax.Array]:
  """``u - alpha B^T (B u)`` per leaf under the non-finite policy, and the
  policy's decision.

  The policy (:func:`fisher_optax.fisher.numerics.skip_nonfinite_step`'s)
  is folded in rather than wrapped around the step: its ``cond`` would hold
  the projected updates, and its checks read them again, three leaf-sized
  temporaries in all. No decomposition runs here, and the coefficients
  ``B u`` decide it: every row multiplies every entry of ``u``, so they are
  non-finite whenever ``u`` is (``0 * inf`` is NaN) or overflows, and with
  orthonormal rows and ``0 <= alpha <= 1`` the output is no larger than
  ``u``. A skipped step's updates are NaN where ``u`` is not finite and
  zero elsewhere, formed in the same sweep as the output.
  """
  a = _alpha(alpha, state.count)
  bases = state.protected_subspace.bases
  coefs = _coefficients(updates, bases)
  ok = numerics.tree_all_finite(coefs) & jnp.isfinite(a)

  def project(u: jax.Array, basis: jax.Array, c: jax.Array) -> jax.Array:
    # A skipped step's updates: NaN where the incoming ones are not finite,
    # else 0, from the value this sweep reads anyway (a decision over all
    # of them, under a cond, held them as a temporary).
    fill = jnp.where(jnp.isfinite(u), 0.0, jnp.nan).astype(c.dtype)
    return jnp.where(ok, _projected(u, basis, c, a), fill).astype(u.dtype)

  return jax.tree.map(project, updates, bases, coefs), ok


def _counted(
  state: ProjectOutSubspaceState, counts: jax.Array, ok: jax.Array
) -> ProjectOutSubspaceState:
  """``state`` after a step: ``count`` moves where ``counts``, and
  ``notfinite_count`` where not ``ok``."""
  inc = optax.safe_increment
  count, nf = state.count, state.notfinite_count
  return state._replace(
    count=jnp.where(counts, inc(count), count),
    notfinite_count=jnp.where(ok, nf, inc(nf)),
  )


def _adam_direction(
  state: optax.ScaleByAdamState, like: PyTree, b1: float, b2: float, eps: float
) -> PyTree:
  """The update :func:`optax.scale_by_adam` (no Nesterov, ``eps_root=0``)
  returns with ``state``, its new state (``count`` already incremented), in
  the dtypes of ``like``."""
  mu = optax.tree.bias_correction(state.mu, b1, state.count)
  nu = optax.tree.bias_correction(state.nu, b2, state.count)
  return jax.tree.map(
    lambda m, v, g: (m / (jnp.sqrt(v) + eps)).astype(jnp.result_type(g)),
    mu,
    nu,
    like,
  )


def _fused_step(
  adam: optax.GradientTransformation,
  decay: optax.GradientTransformation,
  learning_rate: optax.GradientTransformation,
  alpha: ScalarOrSchedule,
  hyper: tuple[float, float, float],
  placement: str,
) -> Callable[..., tuple[PyTree, tuple[Any, ...]]]:
  """The update of :func:`physguard`'s chain (``eps > 0``) as one step with
  one decision.

  The chain is ``skip_nonfinite(adam, bounded=True)``, the decay and the
  projection (after Adam, or before it) and the learning rate under
  :func:`numerics.chain_following`. This returns the chain's updates,
  states and counts (a test compares them step by step); what differs is
  what XLA holds and reads. Chained, the coefficients ``B u`` after Adam
  read its updates after its policy's select, and XLA held them twice (the
  select as the product's operand, Adam's output for the last sweep); the
  output read the old moments while the selects overwrote them in place, so
  XLA copied donated moments (before Adam); the decision's squares, shared
  with Adam's, were a leaf-sized temporary. Here:

  * after Adam, the coefficients read Adam's raw updates, their only
    reader (on a step Adam's policy skips they are unused; the chain
    projected its fill, whose fate a ``cond`` decides on a skip only);
  * the moments are selected once the decision is known, from fresh
    inputs, and the output recomputes Adam's direction from the stored
    moments, as :func:`optax.adamw`'s step does;
  * the decision squares fresh inputs.

  ``hyper`` is Adam's ``(b1, b2, eps)``.
  """
  b1, b2, eps = hyper
  after = placement == "after"
  fresh = numerics.fresh

  def update_fn(
    updates: PyTree,
    state: tuple[Any, ...],
    params: PyTree | None = None,
    **extra_args: Any,
  ) -> tuple[PyTree, tuple[Any, ...]]:
    if after:
      adam_state, decay_state, project_state, lr_state = state
    else:
      project_state, adam_state, decay_state, lr_state = state
    _check_updates(updates, project_state)
    bases = project_state.protected_subspace.bases
    a = _alpha(alpha, project_state.count)
    coefs = None
    if after:
      g = updates
      ok_adam = numerics.squares_finite(fresh(g))

      def skipped() -> tuple[jax.Array, jax.Array]:
        # Adam's fill (NaN for a non-finite gradient, else 0) and whether
        # the chain's projection of it, decayed, is finite.
        fill = jnp.where(numerics.tree_all_finite(g), 0.0, jnp.nan)
        filled = jax.tree.map(lambda x: jnp.full_like(x, fill), g)
        filled, _ = decay.update(filled, decay_state, params)
        return fill, numerics.tree_all_finite(_coefficients(filled, bases))

      fill, fill_projects = jax.lax.cond(
        ok_adam, lambda: (jnp.zeros([]), jnp.asarray(True)), skipped
      )
      raw, _ = adam.update(g, adam_state.inner_state, params, **extra_args)
      raw, _ = decay.update(raw, decay_state, params)
      coefs = _coefficients(raw, bases)
      ok_project = jnp.isfinite(a) & jnp.where(
        ok_adam, numerics.tree_all_finite(coefs), fill_projects
      )
    else:
      g, ok_project = _projection(updates, project_state, alpha)
      ok_adam = numerics.squares_finite(fresh(g))
      fill = numerics.skipped_fill(ok_adam, g)
    ok = ok_adam & ok_project

    def kept(new: Any, old: Any) -> Any:
      return numerics.tree_select(ok, numerics.keep_types(new, old), old)

    g_fresh, inner = fresh((g, adam_state.inner_state), ok)
    _, new_adam = adam.update(g_fresh, inner, params, **extra_args)
    new_adam = kept(new_adam, adam_state.inner_state)
    u = _adam_direction(new_adam, updates, b1, b2, eps)
    u, new_decay = decay.update(u, decay_state, params)
    if coefs is not None:
      u = jax.tree.map(functools.partial(_projected, a=a), u, bases, coefs)
    out, new_lr = learning_rate.update(u, lr_state, params)
    # The chain's skipped updates are also NaN where the decay alone is not
    # finite (non-finite params).
    decayed, _ = decay.update(
      jax.tree.map(jnp.zeros_like, updates), decay_state, params
    )

    def output(o: jax.Array, d: jax.Array, g: jax.Array) -> jax.Array:
      skip = jnp.where(jnp.isfinite(d), fill, jnp.nan)
      return jnp.where(ok, o, skip).astype(jnp.result_type(g))

    out = jax.tree.map(output, out, decayed, updates)
    nf_adam = adam_state.notfinite_count
    adam_state = numerics.SkipNonfiniteState(
      new_adam, jnp.where(ok_adam, nf_adam, optax.safe_increment(nf_adam))
    )
    project_state = _counted(project_state, ok, ok_project)
    decay_state = kept(new_decay, decay_state)
    lr_state = kept(new_lr, lr_state)
    if after:
      return out, (adam_state, decay_state, project_state, lr_state)
    return out, (project_state, adam_state, decay_state, lr_state)

  return update_fn


def physguard(
  learning_rate: ScalarOrSchedule,
  *,
  max_rank: int,
  alpha: ScalarOrSchedule = 1.0,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  mask: MaskOrFn | None = None,
  placement: str = "after",
  subspace: ProtectedSubspace | None = None,
  basis_dtype: jax.typing.DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Adam(W) fine-tuning that leaves the protected directions untouched.

  .. math::

    u_t = -\\eta_t\\, (I - \\alpha U U^\\top)\\,
      \\mathrm{adam}(g_t) \\quad (\\text{placement="after"}), \\qquad
    u_t = -\\eta_t\\, \\mathrm{adam}((I - \\alpha U U^\\top) g_t)
      \\quad (\\text{"before"}).

  PhysGuard projects the gradient *before* Adam. We default to ``"after"``:
  it makes the applied update (weight decay included) exactly orthogonal to
  the protected directions, and it forgot less in the continual-learning
  benchmark (``benchmarks/continual.py``). ``"before"`` reproduces the paper.
  With ``"before"``, coordinates whose gradients lie wholly in the protected
  subspace (a leaf protected whole, say) still move at about the learning
  rate: their projected gradient is rounding noise, which Adam's
  normalisation scales up to a full step.

  **Learning rate.** Use AdamW's: with an empty protected subspace this is
  Adam (and it matched :func:`optax.adamw` at AdamW's best lr on a digits
  MLP); the projection only removes components, so it never makes a step
  larger.

  Args:
    learning_rate: a float or schedule.
    max_rank: rows per leaf of the protected bases. Static int.
    alpha: projection strength in [0, 1] or schedule (clipped to it).
    b1: Adam's first-moment decay.
    b2: Adam's second-moment decay.
    eps: Adam's epsilon.
    weight_decay: decoupled weight decay.
    mask: weight-decay mask (pytree or callable).
    placement: ``"after"`` (default) or ``"before"`` the Adam scaling.
    subspace: initial :class:`ProtectedSubspace` (default empty).
    basis_dtype: dtype of the empty bases built by ``init`` (see
      :func:`project_out_subspace`).

  Returns:
    An ``optax.GradientTransformationExtraArgs``, a chain whose state is a
    tuple (Adam's state under :func:`fisher_optax.fisher.numerics.
    skip_nonfinite`, the projection's, ...). A step that the Adam scaling or
    the projection skips as non-finite leaves the whole state unchanged but
    for the ``notfinite_count`` fields.

  Example::

    >>> import jax.numpy as jnp, optax, fisher_optax
    >>> params = jnp.zeros(3)
    >>> tx = fisher_optax.physguard(1e-2, max_rank=2)
    >>> state = tx.init(params)
    >>> g = jnp.array([[1.0, 0.0, 0.0]])  # Source task's per-example grads.
    >>> state = optax.tree.set(
    ...     state, protected_subspace=fisher_optax.protected_subspace(
    ...         g, max_rank=2))
    >>> updates, state = tx.update(jnp.ones(3), state, params)
    >>> abs(float(updates[0]))  # The protected direction does not move.
    0.0

  References:
    Zhou et al, `PhysGuard <https://arxiv.org/abs/2606.16602>`_, 2026.
  """
  validation.check_learning_rate(learning_rate)
  validation.check_choice("placement", placement, _PLACEMENTS)
  validation.check_positive(
    "weight_decay", weight_decay, allow_zero=True, schedule=True
  )
  validation.check_in_unit_interval("b1", b1)
  validation.check_in_unit_interval("b2", b2)
  validation.check_positive("eps", eps, allow_zero=True)
  project = project_out_subspace(
    max_rank, alpha, subspace, basis_dtype=basis_dtype
  )
  # With eps > 0 known now, Adam keeps finite gradients finite: its policy
  # needs no cond (see numerics.skip_nonfinite).
  positive_eps = (validation.concrete_value(eps) or 0.0) > 0
  scale = numerics.widen_float16_state(
    optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
  )
  adam = numerics.skip_nonfinite(scale, bounded=positive_eps)
  decay = optax.add_decayed_weights(weight_decay, mask)
  if placement == "after":
    parts = (adam, decay, project)
  else:
    parts = (project, adam, decay)
  lr = optax.scale_by_learning_rate(learning_rate)
  chain = optax.chain(*parts, lr)
  if positive_eps:  # the chain's step, fused (its init is the chain's)
    return optax.GradientTransformationExtraArgs(
      chain.init,
      _fused_step(scale, decay, lr, alpha, (b1, b2, eps), placement),  # pyright: ignore[reportArgumentType]
    )
  # A step Adam skips as overflowing reaches the projection (or came from
  # it) as a finite one: the projection's and the schedule's counts must
  # not move on it either.
  following = numerics.chain_following(
    chain, (parts.index(adam), parts.index(project))
  )
  at_project = parts.index(project)

  def update_fn(updates, state, params=None, **extra_args):
    # Checked before Adam, which would broadcast a scalar gradient.
    _check_updates(updates, state[at_project])
    return following.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(chain.init, update_fn)
