# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Natural GaLore: GaLore with a windowed inverse empirical Fisher in low rank.

:func:`scale_by_natural_galore` (alias :func:`natural_galore`) is GaLore with
the windowed Woodbury preconditioner of
:func:`fisher_optax.scale_by_woodbury_fisher` applied in the low-rank space,
per projected leaf, before the base optimizer. Its arguments mirror
``optax.contrib.galore`` so switching is a one-word change. The window
maths (ring-buffer push, Gram, Cholesky solve, per-example rows) is the
engine's (:mod:`fisher_optax.fisher.linalg`), shared with M-FAC; which axes
of a leaf form its matrix is resolved by the dimension-numbers module shared
with FISMO.

Decisions where the paper leaves room, each documented where it is used:

1. *Projection side*: ``projection_side="larger"`` (default) projects the
   larger dimension exactly like ``optax.contrib.galore`` (smallest state);
   ``"smaller"`` projects the smaller dimension like the GaLore/Natural GaLore
   reference code, and is the only side that reaches full rank. The side is
   fixed statically per leaf from its shape. The reference code's two-sided
   Tucker projection is not offered (the paper describes one-sided SVD).
2. *Damping* is absolute, as in the paper: ``F = damping * I + H H^T`` with no
   ``1/s`` factor (the paper's ``1/h`` is dropped by its own Woodbury formula
   and code).
3. *Output scale* is the paper's ``F^{-1} g`` (which divides by ``damping``);
   ``normalize_output=True`` returns ``damping * F^{-1} g`` instead.
4. *Window at refresh*: ``"reproject"`` (default) rotates the stored
   gradients into the new basis, ``"keep"`` matches the reference code,
   ``"reset"`` clears it. The base optimizer's moments are kept as they are,
   as in GaLore, the reference and optax.
5. *Defaults*: ``history_size=8`` (the reference uses 20; the window
   dominates memory), float32 window, ``damping=1e-3`` as in the reference.
6. *Leaves*: optax's rule (every 2-D leaf, or ``weight_dimension_numbers``);
   pass a pytree or callable to exclude embeddings and heads as the reference
   does. Unprojected leaves get the base optimizer only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import GaLoreDimensionNumbers

from fisher_optax import _matrix_view as matrix_view
from fisher_optax.fisher import linalg
from fisher_optax.fisher import numerics
from fisher_optax.fisher import validation

PyTree = Any
_HIGHEST = jax.lax.Precision.HIGHEST

GaLoreDimNumsOrFn = GaLoreDimensionNumbers | PyTree | Callable[[PyTree], PyTree]

_SIDES = ("larger", "smaller")
_REFRESH_POLICIES = ("reproject", "keep", "reset")
_SVD_METHODS = ("exact", "randomized", "subspace")
# Old value of the renamed keyword window_source=.
_LEGACY_SOURCES = {"history": "batch"}
# Extra columns sampled by the randomized range finder.
_OVERSAMPLING = 8


# -- projections ---------------------------------------------------------------


class _Projection(NamedTuple):
  """A projected leaf: its matrix view, the rank and the projected side."""

  view: matrix_view.LeafPlan
  rank: int
  left: bool  # True: P is (m, r) and the low-rank gradient is P^T G (r, n)

  @property
  def projector_shape(self) -> tuple[int, int]:
    return (self.view.rows if self.left else self.view.cols, self.rank)

  @property
  def low_rank_shape(self) -> tuple[int, int]:
    rows, cols = self.view.matrix_shape
    return (self.rank, cols) if self.left else (rows, self.rank)

  def project(self, p: jax.Array, g2: jax.Array) -> jax.Array:
    """The low-rank gradient; gathered, not the gradient, under explicit
    mesh axes (the window and the base optimizer hold it replicated)."""
    if self.left:
      return linalg.replicated_matmul(p.T, g2, precision=None)
    return linalg.replicated_matmul(g2, p, precision=None)

  def project_back(
    self, p: jax.Array, u: jax.Array, like: jax.Array | None = None
  ) -> jax.Array:
    """``u`` at full size, sharded like ``like`` (the gradient's matrix)
    under explicit mesh axes: each device forms only its own block."""
    spec = None if like is None else numerics.explicit_spec(like)
    a, b = (p, u) if self.left else (u, p.T)
    return jnp.matmul(a, b, out_sharding=spec)


def _projections(
  spec: GaLoreDimNumsOrFn | None, tree: PyTree, rank: int, side: str
) -> list[_Projection | None]:
  """One :class:`_Projection` (or ``None``: not projected) per leaf."""
  out: list[_Projection | None] = []
  for view in matrix_view.plans(
    spec, tree, kind=GaLoreDimensionNumbers, batch_axes=False
  ):
    if view is None:
      out.append(None)
      continue
    m, n = view.matrix_shape
    left = m >= n if side == "larger" else m < n
    out.append(_Projection(view, min(rank, m, n), left))
  return out


# -- subspace refresh ----------------------------------------------------------


def _cholesky_qr(y: jax.Array, shift: Any = 0.0) -> jax.Array:
  """``Q = Y L^{-T}`` with ``L L^T = Y^T Y + shift I``: only matmuls."""
  c = linalg.symmetrize(jnp.matmul(y.T, y, precision=_HIGHEST))
  c = c + shift * jnp.eye(c.shape[0], dtype=c.dtype)
  chol = jnp.linalg.cholesky(c)
  return jax.scipy.linalg.solve_triangular(chol, y.T, lower=True).T


def _orthonormalize(y: jax.Array) -> jax.Array:
  """Orthonormal basis of ``range(Y)``: shifted Cholesky-QR3, QR fallback.

  Cholesky-QR uses only a matmul, an ``l x l`` Cholesky and a triangular
  solve, so a row-sharded ``Y`` is never gathered; the shift (Fukaya et al,
  2020) makes it stable for condition numbers up to ``1/eps``. A
  rank-deficient ``Y`` (a gradient of rank below ``l``) breaks it; only then,
  under ``lax.cond``, Householder QR takes over.
  """
  l = y.shape[1]
  eps = jnp.finfo(y.dtype).eps
  y = y / jnp.maximum(jnp.max(jnp.abs(y)), jnp.finfo(y.dtype).tiny)
  shift = 11.0 * (y.size + l * (l + 1)) * eps * jnp.sum(jnp.square(y))
  q = _cholesky_qr(_cholesky_qr(_cholesky_qr(y, shift)))
  off = jnp.matmul(q.T, q, precision=_HIGHEST) - jnp.eye(l, dtype=q.dtype)
  # CholQR2 reaches O(eps) orthogonality when it works; anything looser
  # means Y was (numerically) rank-deficient and the basis is noise. The
  # finiteness is checked on its own: XLA:CPU's max of 4096 or more
  # elements can skip NaNs (a partial breakdown would then pass).
  ok = numerics.tree_all_finite(off) & (jnp.max(jnp.abs(off)) < 20 * l * eps)
  return jax.lax.cond(ok, lambda: q, lambda: jnp.linalg.qr(y)[0])


def _finite_orthonormalize(y: jax.Array) -> jax.Array:
  """:func:`_orthonormalize`, NaN (never run) for a non-finite ``Y``.

  A finite gradient near the float range overflows ``G G^T Q``; the QR and
  Cholesky of the result must not see the infinity.
  """
  return numerics.finite_or_nan(_orthonormalize, y)


def _range_finder_basis(
  mat: jax.Array, start: jax.Array, rank: int, power_iterations: int
) -> jax.Array:
  """Top-``rank`` left singular vectors of ``mat`` by subspace iteration.

  Args:
    mat: ``(p, q)`` float32 or wider; its rows are the projected axis.
    start: ``(q, l)`` test matrix, ``l >= rank``.
    rank: number of vectors returned.
    power_iterations: extra ``mat mat^T`` applications.

  Returns:
    ``(p, rank)`` with orthonormal columns. Only matmuls, ``l x l``
    Choleskys and one ``l x l`` eigendecomposition touch the data, so a
    sharded ``mat`` is never gathered. NaN if an intermediate overflowed
    (no decomposition sees it).
  """
  q = _finite_orthonormalize(linalg.replicated_matmul(mat, start))
  for _ in range(power_iterations):
    q = _finite_orthonormalize(
      linalg.replicated_matmul(mat, linalg.replicated_matmul(mat.T, q))
    )
  # Rayleigh-Ritz: rotate range(Q) onto the top singular directions.
  b = linalg.replicated_matmul(q.T, mat)
  _, vecs = numerics.finite_or_nan(
    jnp.linalg.eigh, linalg.symmetrize(jnp.matmul(b, b.T, precision=_HIGHEST))
  )
  return jnp.matmul(q, vecs[:, ::-1][:, :rank], precision=_HIGHEST)


def _align_signs(new: jax.Array, old: jax.Array) -> jax.Array:
  """Flips columns of ``new`` to agree with ``old`` (else: max entry > 0).

  Singular vectors are defined up to sign, and the base optimizer's moments
  survive a refresh, so an arbitrary flip scrambles them; the sign of an
  eigensolver's output also depends on float noise (e.g. the sharding).
  """
  overlap = jnp.sum(new * old, axis=0)
  rows = jnp.argmax(jnp.abs(new), axis=0)
  peak = jnp.take_along_axis(new, rows[None, :], axis=0)[0]
  sign = jnp.where(jnp.abs(overlap) > 1e-3, jnp.sign(overlap), jnp.sign(peak))
  return new * jnp.where(sign == 0, 1.0, sign).astype(new.dtype)


def _new_projector(
  proj: _Projection,
  g2: jax.Array,
  old: jax.Array,
  method: str,
  power_iterations: int,
  key: jax.Array,
) -> jax.Array:
  """Refreshed projector; keeps ``old`` for a zero gradient or a non-finite
  basis (an intermediate that overflowed)."""
  r = proj.rank
  if r == 0:  # an empty leaf (min(m, n) == 0): no vector to find
    return old
  dtype = old.dtype
  g32 = g2.astype(numerics.compute_dtype(g2))
  if method == "exact":
    svd = lambda x: jnp.linalg.svd(x, full_matrices=False)
    u, _, vh = numerics.finite_or_nan(svd, linalg.replicated(g32))
    new = u[:, :r] if proj.left else vh[:r, :].T
  else:
    mat = g32 if proj.left else g32.T
    p, q = mat.shape
    width = min(r + _OVERSAMPLING, p, q)
    start = jax.random.normal(key, (q, width), g32.dtype)
    if method == "subspace":
      warm = linalg.replicated_matmul(mat.T, old.astype(g32.dtype))
      start = start.at[:, :r].set(warm)
    new = _range_finder_basis(mat, start, r, power_iterations)
    new = _align_signs(new, old.astype(new.dtype))
  new = new.astype(dtype)
  ok = (
    jnp.all(jnp.isfinite(g32)) & jnp.any(g32 != 0) & jnp.all(jnp.isfinite(new))
  )
  return jnp.where(ok, new, old)


def _identity_basis(shape: tuple[int, int], dtype: Any) -> jax.Array:
  return jnp.eye(shape[0], shape[1], dtype=dtype)


# -- Natural GaLore ------------------------------------------------------------


class NaturalGaLoreState(NamedTuple):
  """State of :func:`scale_by_natural_galore`.

  Attributes:
    count: number of updates so far (int32).
    projector: per leaf, the orthonormal basis ``P`` (params' dtype, like
      optax's GaLore); ``(0, 0)`` for unprojected leaves.
    window: per projected leaf, the last ``history_size`` low-rank gradients,
      ``(history_size, *low_rank_shape)``; zero-size otherwise.
    window_gram: per projected leaf, the float32 (float64 for float64
      params) ``(s, s)`` Gram of its window; zero-size otherwise.
    base_optimizer_state: the base optimizer's state over the low-rank
      gradients (full shape for unprojected leaves).
    notfinite_count: int32 number of steps skipped as non-finite (as in
      :func:`optax.apply_if_finite`'s state).
    leaf_shapes: per leaf, a zero-size ``(*leaf_shape, 0)`` array of the
      params' dtype: the shapes ``init`` saw, against which ``update``
      checks the updates (no memory, no work per step). ``None`` in a state
      built by hand without it: only the projected shapes are checked then.
  """

  count: jax.Array
  projector: PyTree
  window: PyTree
  window_gram: PyTree
  base_optimizer_state: optax.OptState
  notfinite_count: jax.Array
  leaf_shapes: PyTree = None


# -- the leaf update -----------------------------------------------------------


class _Config(NamedTuple):
  """The static options of :func:`scale_by_natural_galore`."""

  rank: int
  projection_side: str
  history_size: int
  per_example: bool  # fisher_source == "per_example"
  window_at_refresh: str
  normalize_output: bool
  window_dtype: Any
  svd_method: str
  svd_power_iterations: int
  weight_dimension_numbers: Any

  @property
  def windowed(self) -> bool:
    """A window of past projected gradients is kept."""
    return self.history_size > 0 and not self.per_example

  @property
  def per_example_window(self) -> bool:
    """This batch's projected per-example gradients are the window."""
    return self.history_size > 0 and self.per_example

  def projections(self, tree: PyTree) -> list[_Projection | None]:
    return _projections(
      self.weight_dimension_numbers, tree, self.rank, self.projection_side
    )


def _init_leaf(
  cfg: _Config, p: jax.Array, proj: _Projection | None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """``(projector, window, window_gram, base optimizer proxy, shape
  placeholder)`` of a leaf."""
  # The leaf's axes first: a sharding spec written for the leaf fits it.
  like = jnp.zeros((*p.shape, 0), p.dtype)
  if proj is None:  # placeholders; the base optimizer sees the leaf as is
    return (
      jnp.zeros((0, 0), p.dtype),
      jnp.zeros((0,), numerics.compute_dtype(p)),
      jnp.zeros((0, 0), jnp.float32),
      numerics.zeros_like_stacked(p, dtype=p.dtype),
      like,
    )
  n = cfg.history_size if cfg.windowed else 0
  wdtype = (
    jnp.dtype(cfg.window_dtype)
    if cfg.window_dtype is not None
    else numerics.compute_dtype(p)
  )
  return (
    _identity_basis(proj.projector_shape, p.dtype),
    jnp.zeros((n, *proj.low_rank_shape), wdtype),
    jnp.zeros((n, n), numerics.compute_dtype(wdtype)),
    jnp.zeros(proj.low_rank_shape, p.dtype),
    like,
  )


def _init(
  cfg: _Config, base_optimizer: optax.GradientTransformation, params: PyTree
) -> NaturalGaLoreState:
  validation.check_real_floating(
    params, what="params", function="scale_by_natural_galore"
  )
  leaves, treedef = jax.tree.flatten(params)
  # Two arrays, not one: a state whose fields share a buffer cannot be
  # donated to a jitted step.
  count, notfinite = jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32)
  if not leaves:  # e.g. optax.tree.map_params' placeholder
    return NaturalGaLoreState(
      count,
      params,
      params,
      params,
      base_optimizer.init(params),
      notfinite,
      params,
    )
  parts = [
    _init_leaf(cfg, p, proj) for p, proj in zip(leaves, cfg.projections(params))
  ]
  projector, window, gram, proxy, shapes = (
    jax.tree.unflatten(treedef, list(column)) for column in zip(*parts)
  )
  return NaturalGaLoreState(
    count,
    projector,
    window,
    gram,
    base_optimizer.init(proxy),
    notfinite,
    shapes,
  )


def _refresh_window(
  cfg: _Config,
  proj: _Projection,
  old_p: jax.Array,
  new_p: jax.Array,
  window: jax.Array,
  gram: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """The window after a basis change: kept, reset or reprojected."""
  if not cfg.windowed or cfg.window_at_refresh == "keep":
    return window, gram
  if cfg.window_at_refresh == "reset":
    return jnp.zeros_like(window), jnp.zeros_like(gram)
  # Rotate old-basis coordinates into the new basis: R = P_new^T P_old.
  dtype = gram.dtype
  rot = jnp.matmul(
    new_p.astype(dtype).T, old_p.astype(dtype), precision=_HIGHEST
  )
  w32 = window.astype(dtype)
  # Batched matmuls keep the window's row-major layout: an einsum that
  # contracts its middle axis makes XLA pick a transposed layout for the
  # refresh cond's output, and the steady (pass-through) branch then copies
  # the whole window twice on every step.
  if proj.left:
    rots = jnp.broadcast_to(rot, (w32.shape[0], *rot.shape))
    w32 = jnp.matmul(rots, w32, precision=_HIGHEST)
  else:
    w32 = jnp.matmul(w32, rot.T, precision=_HIGHEST)
  window = w32.astype(window.dtype)
  return window, linalg.tree_stacked_gram(window.astype(dtype))


def _refresh_leaves(
  cfg: _Config,
  projs: Sequence[_Projection | None],
  leaves: Sequence[jax.Array],
  state: NaturalGaLoreState,
  refresh: jax.Array,
  healthy: jax.Array | None = None,
) -> tuple[list[tuple[Any, Any, Any]], dict[int, jax.Array]]:
  """``(projector, window, gram)`` per leaf, refreshed when ``refresh``, and
  the projected leaves' gradients as matrices (by leaf index).

  One ``cond`` for all the leaves (they share the schedule): a cond per leaf
  is a thunk of its own on XLA:CPU at every step, refresh or not.
  ``refresh`` is the schedule alone: it depends only on the step count (and
  ``update_proj_gap``), so under :func:`jax.vmap` over hyperparameters or
  data it stays unbatched and the cond stays a cond. The gradient-dependent
  ``healthy`` flag (None: True) gets a cond of its own inside the branch: in
  the predicate, under ``vmap`` it would turn the outer cond into a select
  that runs the refresh, SVD included, on every step. The refresh runs lane
  by lane under ``vmap`` (:func:`fisher_optax.fisher.numerics.lane_by_lane`):
  batched LAPACK calls can deadlock XLA:CPU.
  """
  olds = list(
    zip(
      jax.tree.leaves(state.projector),
      jax.tree.leaves(state.window),
      jax.tree.leaves(state.window_gram),
    )
  )
  on = [(i, proj) for i, proj in enumerate(projs) if proj is not None]
  g2s = {i: proj.view.to_matrix(leaves[i]) for i, proj in on}
  base_key = jax.random.fold_in(jax.random.key(0), state.count)

  def one(i, proj):
    p_old, window, gram = olds[i]
    p_new = numerics.lane_by_lane(
      lambda g2, p_old, key: _new_projector(
        proj, g2, p_old, cfg.svd_method, cfg.svd_power_iterations, key
      )
    )(g2s[i], p_old, jax.random.fold_in(base_key, i))
    return (p_new, *_refresh_window(cfg, proj, p_old, p_new, window, gram))

  keep = lambda: [olds[i] for i, _ in on]
  do_refresh = lambda: [one(i, proj) for i, proj in on]

  def scheduled():
    if healthy is None:
      return do_refresh()
    return jax.lax.cond(healthy, do_refresh, keep)

  new = list(olds)
  if on:
    for (i, _), value in zip(on, jax.lax.cond(refresh, scheduled, keep)):
      new[i] = tuple(value)
  return new, g2s


def _per_example_solve(
  cfg: _Config,
  proj: _Projection,
  lg: jax.Array,
  p: jax.Array,
  per_example: jax.Array | None,
  damping: Any,
) -> jax.Array:
  """``F^{-1} lg`` with ``F`` from this batch's projected per-example rows.

  The window maths is M-FAC's (:mod:`fisher_optax.fisher.linalg`); the
  per-example gradients are projected with this step's basis and solved
  against without being stored. A Gram that overflowed from finite rows
  (1e30 gradients) never reaches the Cholesky: the solve's output is NaN
  and the non-finite policy skips the step. Without a window (``history_size
  = 0``) ``lg`` is returned as is: GaLore.
  """
  if not cfg.per_example_window or per_example is None:
    return lg
  pe = jax.vmap(lambda x: proj.view.to_matrix(x).astype(p.dtype))(per_example)
  rows = jnp.einsum("mr,bmn->brn", p, pe) if proj.left else pe @ p
  rows = rows.astype(numerics.compute_dtype(rows))
  scale = 1.0 / rows.shape[0]
  # The gradient is (about) the rows' mean: its part in their span is solved
  # there, without float32 cancellation; only the rest by (g - G^T w) / lambda.
  coords = jnp.full((rows.shape[0],), scale, rows.dtype)

  def solve(gram: jax.Array) -> jax.Array:
    return linalg.woodbury_window_solve(
      rows,
      gram,
      lg,
      linalg.floored_damping(gram, damping, scale),
      scale=scale,
      normalized=cfg.normalize_output,
      coords=coords,
    )

  return numerics.finite_or_nan(solve, linalg.tree_stacked_gram(rows))


def _check_updates(
  cfg: _Config,
  updates: PyTree,
  state: NaturalGaLoreState,
  params: PyTree | None,
) -> list[_Projection | None]:
  """The one "updates do not match params" check; returns the projections.

  Against ``params`` when given, and always against the state ``init``
  built, so a scalar or transposed gradient is refused before it can
  broadcast (or reach an einsum): its projector and window shapes, and the
  full shapes in ``leaf_shapes``, which alone catch an unprojected leaf and
  a transposed one at ``rank >= min(m, n)`` (same projected shapes). Only
  shapes are read, at trace time.
  """
  validation.check_same_structure(
    updates, state.projector, what="state.projector"
  )
  if params is not None:
    validation.check_like(updates, params, what="updates")
  projs = cfg.projections(updates)
  paths = jax.tree_util.tree_flatten_with_path(updates)[0]
  built = zip(jax.tree.leaves(state.projector), jax.tree.leaves(state.window))
  likes: list[Any] = [None] * len(projs)
  if state.leaf_shapes is not None:  # None: a state built without the field
    validation.check_same_structure(
      updates, state.leaf_shapes, what="state.leaf_shapes"
    )
    likes = jax.tree.leaves(state.leaf_shapes)
  for (path, g), proj, (p, w), like in zip(paths, projs, built, likes):
    # Unprojected leaves hold a (0,) window, projected ones (s, r, n).
    was = None if w.ndim == 1 else (tuple(p.shape), tuple(w.shape[1:]))
    now = None if proj is None else (proj.projector_shape, proj.low_rank_shape)
    if was != now:
      what = (
        "an unprojected leaf"
        if was is None
        else f"a projector of shape {was[0]} and low-rank gradients of "
        f"shape {was[1]}"
      )
    elif like is not None and jnp.shape(g) != like.shape[:-1]:
      what = f"a leaf of shape {like.shape[:-1]}"
    else:
      continue
    raise ValueError(
      "updates do not match params (different shapes): updates"
      f"{jax.tree_util.keystr(path)} has shape {jnp.shape(g)} where the "
      f"Natural GaLore state was built for {what}; re-run init on the "
      "current params."
    )
  return projs


def _step(
  cfg: _Config,
  base_optimizer: optax.GradientTransformation,
  hyper: tuple[Any, Any, Any],
  updates: PyTree,
  projs: list[_Projection | None],
  per_example: list[Any],
  state: NaturalGaLoreState,
) -> tuple[PyTree, NaturalGaLoreState]:
  """One step with this batch's per-example rows as the window, from finite
  inputs; ``hyper`` is ``(scale, update_proj_gap, damping)``, the options
  that may be injected."""
  scale, update_proj_gap, damping = hyper
  leaves, treedef = jax.tree.flatten(updates)
  count = state.count
  refresh = (count % update_proj_gap) == 0
  # (projector, window, gram) per leaf
  new, g2s = _refresh_leaves(cfg, projs, leaves, state, refresh)
  low = []
  for i, (g, proj, pe) in enumerate(zip(leaves, projs, per_example)):
    if proj is None:
      low.append(g)
      continue
    p = new[i][0]
    low.append(
      _per_example_solve(cfg, proj, proj.project(p, g2s[i]), p, pe, damping)
    )

  unflat = lambda xs: jax.tree.unflatten(treedef, list(xs))
  columns = list(zip(*new)) or [(), (), ()]
  projector, window, gram = (unflat(column) for column in columns)
  low_updates, base_state = base_optimizer.update(
    unflat(low), state.base_optimizer_state, None
  )
  out = _expand(scale, leaves, treedef, projs, projector, low_updates)
  return out, state._replace(
    count=jnp.asarray(optax.safe_increment(count)),
    projector=projector,
    window=window,
    window_gram=gram,
    base_optimizer_state=base_state,
  )


def _expand(
  scale: Any,
  leaves: list[jax.Array],
  treedef: Any,
  projs: list[_Projection | None],
  projector: PyTree,
  low_updates: PyTree,
) -> PyTree:
  """The base optimizer's low-rank updates mapped back to full size."""
  out = [
    u
    if proj is None
    else (
      scale
      * proj.view.from_matrix(
        proj.project_back(p, u, like=proj.view.to_matrix(g))
      )
    ).astype(g.dtype)
    for g, proj, p, u in zip(
      leaves, projs, jax.tree.leaves(projector), jax.tree.leaves(low_updates)
    )
  ]
  return jax.tree.unflatten(treedef, out)


def _windowed_update(
  cfg: _Config,
  base_optimizer: optax.GradientTransformation,
  hyper: tuple[Any, Any, Any],
  updates: PyTree,
  projs: list[_Projection | None],
  state: NaturalGaLoreState,
) -> tuple[PyTree, NaturalGaLoreState]:
  """A step with a window of past gradients, the window updated in place
  (or with none: GaLore, ``history_size=0``).

  The window is the state's one large array, so it never goes through the
  non-finite policy's cond or its select (either makes XLA copy it whole):
  the refresh may rotate it, the Gram and the solve see this step's row as
  pending, and the row is written once, in place, after the policy's
  decision (as in :func:`fisher_optax.mfac`). A refresh runs only on a
  gradient whose squared norm is finite, so the SVD never sees NaN or Inf
  and the step after it cannot overflow the Gram; the policy then restores
  everything else on a skipped step.
  """
  scale, update_proj_gap, damping = hyper
  leaves, treedef = jax.tree.flatten(updates)
  count = state.count
  sq = [
    jnp.sum(jnp.square(g.astype(numerics.compute_dtype(g)))) for g in leaves
  ]
  healthy = jnp.isfinite(functools.reduce(jnp.add, sq, jnp.zeros([])))
  refresh = (count % update_proj_gap) == 0
  slot = count % cfg.history_size if cfg.windowed else 0
  slots = jnp.asarray(slot, jnp.int32)[None]
  new, g2s = _refresh_leaves(cfg, projs, leaves, state, refresh, healthy)
  # Per leaf: (projector, window, its Gram, the Gram with this step's row,
  # the row as stored, the low-rank gradient).
  parts = []
  for i, (g, proj, (p, window, gram)) in enumerate(zip(leaves, projs, new)):
    if proj is None:
      parts.append((p, window, gram, gram, None, g))
      continue
    g2 = g2s[i]
    lg = proj.project(p, g2)
    if not cfg.windowed:  # GaLore: no window to solve against
      parts.append((p, window, gram, gram, None, lg))
      continue
    row = numerics.keep_types(lg.astype(window.dtype)[None], window[:1])
    pushed, _ = linalg.stacked_pending_gram(window, gram, row, slot)
    parts.append((p, window, gram, pushed, row, lg))
  unflat = lambda xs: jax.tree.unflatten(treedef, list(xs))
  projector = unflat(part[0] for part in parts)

  def step() -> tuple[PyTree, NaturalGaLoreState]:
    """The base optimizer's low-rank updates and the light state."""
    low = [lg for *_, lg in parts]
    solved = [i for i, part in enumerate(parts) if part[4] is not None]
    windows = [parts[i][1] for i in solved]
    grams = [parts[i][3] for i in solved]
    # The pushed row is the gradient itself: solved inside the window's
    # span, with no cancellation and no G g (a narrower window's rounding
    # of it lies outside the span, where 1 / damping would scale it).
    # One batched s x s factorisation and solve for all leaves.
    # Damping below float32's resolution of a window's Gram (similar,
    # large gradients) would fail its Cholesky: floored per window.
    lams = linalg.floored_damping(jnp.stack(grams), damping) if grams else None
    outs = linalg.woodbury_window_solves(
      windows,
      grams,
      [low[i] for i in solved],
      damping if lams is None else lams,
      normalized=cfg.normalize_output,
      pendings=[(parts[i][4], slots) for i in solved],
      pushed=[True] * len(solved),
    )
    for i, out in zip(solved, outs):
      low[i] = out
    low_updates, base_state = base_optimizer.update(
      unflat(low), state.base_optimizer_state, None
    )
    return low_updates, light._replace(
      count=jnp.asarray(optax.safe_increment(count)),
      window_gram=unflat(part[3] for part in parts),
      base_optimizer_state=base_state,
    )

  # The policy counts from zero so that a skip is seen even once the count
  # saturates; the refreshed basis and its Gram are kept on a skip.
  zero = jnp.zeros([], jnp.int32)
  light = state._replace(
    projector=projector,
    window=(),
    window_gram=unflat(part[2] for part in parts),
    notfinite_count=zero,
  )
  # The policy runs at low rank: a skipped step's NaN or zero updates map
  # back to NaN or zero, and P has orthonormal columns, so the full-size
  # updates are finite when the low-rank ones are (for a bounded base
  # optimizer such as Adam) and need no pass of their own.
  # The squared norm is finite exactly when the gradient is and does not
  # overflow, so the gradient is read once more only when it is not.
  bad_in = numerics.skipped_fill(healthy, updates)
  low_updates, new = numerics.skip_nonfinite_step(step, bad_in, light)
  out = _expand(scale, leaves, treedef, projs, projector, low_updates)
  ok = new.notfinite_count == 0
  window = unflat(
    w if row is None else w.at[slots].set(jnp.where(ok, row, w[slots]))
    for _, w, _, _, row, _ in parts
  )
  counter = state.notfinite_count
  return out, new._replace(
    window=window,
    notfinite_count=jnp.where(ok, counter, optax.safe_increment(counter)),
  )


def _update(
  cfg: _Config,
  base_optimizer: optax.GradientTransformation,
  hyper: tuple[Any, Any, Any],
  updates: PyTree,
  state: NaturalGaLoreState,
  params: PyTree | None,
  per_example_grads: PyTree | None,
) -> tuple[PyTree, NaturalGaLoreState]:
  """One step under the non-finite policy, after the shape checks: the
  policy runs on the low-rank updates unless the window is per-example."""
  projs = _check_updates(cfg, updates, state, params)
  per_example: list[Any] = [None] * len(projs)
  if cfg.per_example_window:
    per_example_grads, _ = numerics.checked_per_example_grads(
      per_example_grads, updates, function="scale_by_natural_galore"
    )
    per_example = jax.tree.leaves(per_example_grads)
  if not cfg.per_example:
    return _windowed_update(cfg, base_optimizer, hyper, updates, projs, state)
  step = lambda: _step(
    cfg, base_optimizer, hyper, updates, projs, per_example, state
  )
  inputs = per_example if cfg.per_example_window else ()
  return numerics.skip_nonfinite_step(step, updates, state, inputs=inputs)


def _check_update_proj_gap(value: Any) -> Any:
  """The refresh period ``T`` to use, validated when it is known now.

  ``T`` enters only ``count % T == 0``, where ``0`` would refresh on every
  step and a negative value acts as its absolute value, so every concrete
  value below 1 is refused: Python and NumPy numbers and concrete scalar
  arrays (what ``optax.inject_hyperparams`` passes to ``init``). An
  integral float is accepted (Python and NumPy numbers become ints, keeping
  the modulo in integers); traced values pass unchecked.

  Args:
    value: the ``update_proj_gap`` argument.

  Returns:
    ``value``, as a Python int when it is a Python or NumPy number.

  Raises:
    TypeError: if it is a bool, a schedule or not a real number.
    ValueError: if it is not a scalar, or a concrete value is not an
      integer >= 1.
  """
  name = "update_proj_gap"
  if isinstance(value, (bool, np.bool_, int, np.integer)):
    return validation.check_count(name, value)
  if isinstance(value, (np.ndarray, jax.Array)):
    numeric = jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(
      value.dtype, jnp.floating
    )
  else:
    numeric = isinstance(value, (float, np.floating))
  if not numeric:
    raise TypeError(
      f"{name} must be an integer (or an integral float), got "
      f"{type(value).__name__}; to schedule it, wrap the optimizer in "
      "optax.inject_hyperparams."
    )
  validation.check_scalar(name, value)
  v = validation.concrete_value(value)
  if v is None:  # traced
    return value
  if not (v >= 1 and v.is_integer()):
    raise ValueError(f"{name} must be an integer >= 1, got {value}.")
  return value if isinstance(value, (np.ndarray, jax.Array)) else int(v)


def scale_by_natural_galore(
  rank: int = 128,
  update_proj_gap: int = 200,
  scale: float | jax.Array = 1.0,
  base_optimizer: optax.GradientTransformation | None = None,
  weight_dimension_numbers: GaLoreDimNumsOrFn | None = None,
  history_size: int = 8,
  damping: float | jax.Array = 1e-3,
  *,
  projection_side: str = "larger",
  window_at_refresh: str = "reproject",
  normalize_output: bool = False,
  window_dtype: Any | None = None,
  fisher_source: str | None = None,
  svd_method: str = "exact",
  svd_power_iterations: int = 1,
  window_source: str | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Natural GaLore: GaLore with a windowed inverse-Fisher in low rank.

  For each projected weight :math:`W \in \mathbb{R}^{m\times n}` with gradient
  :math:`G_t`:

  .. math::

    P &\leftarrow \text{top-}r\text{ singular vectors of } G_t
        \quad (t \bmod T = 0) \\
    g_t &= P^\top G_t \ \ (\text{or } G_t P), \qquad
    H = [g_{t-s+1}, \dots, g_t] \\
    \tilde g_t &= (\lambda I + H H^\top)^{-1} g_t
        = \tfrac{1}{\lambda}(g_t - H z), \quad
        (\lambda I_s + H^\top H) z = H^\top g_t \\
    u_t &= \text{base\_optimizer}(\tilde g_t), \qquad
    \Delta W = \alpha\, P u_t \ \ (\text{or } \alpha\, u_t P^\top)

  Each leaf has its own window and ``s x s`` Cholesky solve, so the Fisher is
  block-diagonal over layers, as in the paper. The arguments shared with
  ``optax.contrib.scale_by_galore`` keep its names, order and defaults;
  ``history_size=0`` turns the preconditioner off and reproduces it exactly.

  Decisions where the paper leaves room:

  * ``projection_side="larger"`` projects the larger dimension as optax does
    (state ``r x min(m, n)``); ``"smaller"`` projects the smaller one as the
    reference code does (state ``r x max``), the only side that reaches full
    rank: at ``rank >= min(m, n)`` with an identity base it is SGD. The
    reference's two-sided Tucker projection is not offered.
  * Damping is absolute with no ``1/s`` (paper formula and code).
  * The output is the paper's :math:`F^{-1} g` (scale ``1/\lambda``) unless
    ``normalize_output``. Adam is scale-invariant up to its epsilon, so this
    matters only through epsilon.
  * At a refresh the base moments are kept (GaLore, optax, the reference) and
    the window is ``"reproject"``-ed into the new basis
    (:math:`H \leftarrow P_{new}^\top P_{old} H`), ``"keep"``-ed as the
    reference does, or ``"reset"``.
  * A zero gradient at a refresh keeps the old basis (the initial one is
    ``eye``).
  * ``scale`` applies to projected leaves only, as in optax and GaLore.
  * Inexact refreshes flip each new basis vector to agree in sign with the
    old one, so kept moments stay meaningful and the result does not depend
    on float noise such as the sharding. The exact SVD keeps LAPACK's signs,
    as optax does, so ``history_size=0`` stays bit-identical to it under
    ``jit`` (eager calls may differ in the last bit: XLA fuses the
    arithmetic differently op by op).

  Non-finite steps follow the library's one policy
  (:func:`fisher_optax.fisher.numerics.skip_nonfinite_step`): a NaN or
  infinite gradient (or ``per_example_grads``) leaves the whole state, base
  optimizer included, unchanged but for ``notfinite_count`` and gives NaN
  updates, and a refresh never decomposes it (the old basis stays); a
  finite gradient whose statistics overflow (the window's Gram or Adam's
  moments of 1e30 gradients) is skipped the same way with zero updates.
  Updates not shaped like the params (or the state ``init`` built) are
  refused with a ``ValueError``.

  Beyond the paper: ``fisher_source="per_example"`` builds :math:`H` from this
  batch's projected ``per_example_grads`` (``F = \lambda I + \frac1B H
  H^\top``, no window memory); ``svd_method="randomized"`` or
  ``"subspace"`` (warm-started from the old basis) refreshes with matmuls,
  Cholesky-QR and an ``l x l`` eigendecomposition only, so a sharded weight
  is never gathered.

  Args:
    rank: projection rank ``r`` (static), clipped to ``min(m, n)``.
    update_proj_gap: refresh period ``T``, an integer >= 1 (an integral
      float is accepted); may be injected.
    scale: :math:`\alpha`, multiplies projected leaves' updates.
    base_optimizer: gradient-only transform applied in the low-rank space
      (called with ``params=None``); default ``optax.scale_by_adam()``
      (with float32 moments for float16 params).
    weight_dimension_numbers: which leaves are projected and how they are
      viewed as matrices, exactly as in ``optax.contrib.scale_by_galore``.
    history_size: window length ``s`` (static); 0 disables the
      preconditioner.
    damping: :math:`\lambda > 0`, absolute; may be injected. Far below
      the squared norms of the projected gradients the window whitens
      away their mean (see :func:`natural_galore`'s learning-rate note).
      Below the window's float resolution, ``s eps trace(H H^T)`` (large,
      similar gradients), that floor is used instead: the exact
      :math:`\lambda` would fail the factorisation and skip every step
      (:func:`fisher_optax.fisher.linalg.floored_damping`).
    projection_side: ``"larger"`` (optax) or ``"smaller"`` (reference).
    window_at_refresh: ``"reproject"``, ``"keep"`` or ``"reset"``.
    normalize_output: return :math:`\lambda F^{-1} g`.
    window_dtype: stored window dtype (default float32, or float64 for
      float64 params; bfloat16 halves it).
    fisher_source: ``"batch"`` (default: a window of past projected
      gradients) or ``"per_example"`` (this batch's projected
      ``per_example_grads`` extra, leaves ``(B, *param_shape)``, e.g. from
      :func:`fisher_optax.fisher.per_example_grads`).
    svd_method: ``"exact"``, ``"randomized"`` or ``"subspace"``.
    svd_power_iterations: power iterations of the inexact methods (static).
    window_source: deprecated spelling of ``fisher_source`` (``"history"``
      meant ``"batch"``).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with state
    :class:`NaturalGaLoreState`.

  Raises:
    TypeError: if ``rank``, ``history_size`` or ``svd_power_iterations`` is
      not a static integer, or ``update_proj_gap`` is not a number.
    ValueError: if a hyperparameter known now is out of range (e.g. an
      ``update_proj_gap`` that is not an integer >= 1) or an option is not
      one of its choices.

  Example::

    >>> import jax, jax.numpy as jnp, optax, fisher_optax
    >>> tx = fisher_optax.scale_by_natural_galore(rank=4, history_size=4)
    >>> params = {"w": jnp.ones((8, 6)), "b": jnp.zeros((6,))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state)
    >>> updates["w"].shape
    (8, 6)

  References:
    Das, `Natural GaLore: Accelerating GaLore for memory-efficient LLM
    training and fine-tuning <https://arxiv.org/abs/2410.16029>`_, 2024

    Zhao et al, `GaLore: Memory-Efficient LLM Training by Gradient Low-Rank
    Projection <https://arxiv.org/abs/2403.03507>`_, 2024

    Halko et al, `Finding structure with randomness
    <https://arxiv.org/abs/0909.4061>`_, 2011
  """
  source = validation.fisher_source_or_old_keyword(
    "scale_by_natural_galore",
    fisher_source,
    "window_source",
    window_source,
    _LEGACY_SOURCES,
  )
  base = (
    # Squares of float16 gradients above 256 would overflow float16 moments
    # and every such step would be skipped as non-finite.
    numerics.widen_float16_state(optax.scale_by_adam())
    if base_optimizer is None
    else base_optimizer
  )
  cfg = _Config(
    rank=validation.check_static_int("rank", rank, minimum=1),
    projection_side=validation.check_choice(
      "projection_side", projection_side, _SIDES
    ),
    history_size=validation.check_static_int("history_size", history_size),
    per_example=source == "per_example",
    window_at_refresh=validation.check_choice(
      "window_at_refresh", window_at_refresh, _REFRESH_POLICIES
    ),
    normalize_output=validation.check_flag(
      "normalize_output", normalize_output
    ),
    window_dtype=numerics.canonical_float_dtype("window_dtype", window_dtype),
    svd_method=validation.check_choice("svd_method", svd_method, _SVD_METHODS),
    svd_power_iterations=validation.check_static_int(
      "svd_power_iterations", svd_power_iterations
    ),
    weight_dimension_numbers=weight_dimension_numbers,
  )
  update_proj_gap = _check_update_proj_gap(update_proj_gap)
  validation.check_positive("damping", damping)

  def update_fn(
    updates: PyTree,
    state: NaturalGaLoreState,
    params: PyTree | None = None,
    *,
    per_example_grads: PyTree | None = None,
    **extra_args: Any,
  ) -> tuple[PyTree, NaturalGaLoreState]:
    del extra_args
    hyper = (scale, update_proj_gap, damping)
    return _update(cfg, base, hyper, updates, state, params, per_example_grads)

  return optax.GradientTransformationExtraArgs(
    lambda params: _init(cfg, base, params),
    update_fn,  # pyright: ignore[reportArgumentType]
  )


def natural_galore(
  learning_rate: optax.ScalarOrSchedule,
  rank: int = 128,
  update_proj_gap: int = 200,
  scale: float | jax.Array = 1.0,
  base_optimizer: optax.GradientTransformation | None = None,
  weight_decay: float | jax.Array = 0.0,
  mask: Any | Callable[[PyTree], Any] | None = None,
  weight_dimension_numbers: GaLoreDimNumsOrFn | None = None,
  history_size: int = 8,
  damping: float | jax.Array = 1e-3,
  *,
  projection_side: str = "larger",
  window_at_refresh: str = "reproject",
  normalize_output: bool = False,
  window_dtype: Any | None = None,
  fisher_source: str | None = None,
  svd_method: str = "exact",
  svd_power_iterations: int = 1,
  window_source: str | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Natural GaLore optimizer: a drop-in for ``optax.contrib.galore``.

  :func:`scale_by_natural_galore` followed by decoupled weight decay in the
  full parameter space and the learning rate:

  .. math::

    W \leftarrow W - \eta_t\bigl(\alpha P\,\text{Adam}((\lambda I +
      H H^\top)^{-1} P^\top G) + \text{wd}\cdot W\bigr).

  The first eight arguments are ``optax.contrib.galore``'s, in its order,
  so replacing ``optax.contrib.galore`` by ``fisher_optax.natural_galore``
  is the whole change. Under ``optax.inject_hyperparams`` list ``rank``,
  ``history_size`` and ``svd_power_iterations`` in ``static_args`` (and
  ``weight_dimension_numbers`` if it is a callable); ``damping``, ``scale``,
  ``update_proj_gap``, ``weight_decay`` and the learning rate may be
  injected. A step that :func:`scale_by_natural_galore` skips as non-finite
  leaves the whole chain's state (a schedule's count included) unchanged but
  for ``notfinite_count``.

  **Learning rate and damping.** Swapped for :func:`optax.adamw`, keep
  AdamW's learning rate and set ``damping`` to 0.1-1; at the default
  ``damping`` expect about 3x AdamW's learning rate, in a narrow window.
  On a digits MLP (400 steps, three seeds; ``benchmarks/alias_defaults``)
  at AdamW's best lr, 1e-3, the defaults undertrained (test loss 0.229
  against AdamW's 0.060 and GaLore's 0.055); at 3e-3 they reached 0.056,
  but at 1e-2 their validation loss was 0.67 (GaLore's 0.37), while
  ``damping=1.0`` gave 0.055 at 1e-3 and validation losses of 0.20, 0.22
  and 0.17 at 1e-3, 3e-3 and 1e-2. The damping is absolute: at 1e-3 it was
  far below the window Gram's eigenvalues (0.02 to 3 there), so
  :math:`F^{-1} g` was nearly the part of ``g`` orthogonal to the previous
  gradients, uncorrelated from one step to the next (cosine -0.01, against
  0.75 for the projected gradients), and Adam's early steps were small.
  Compare ``damping`` with the squared norms of the projected gradients,
  and tune it with the lr.

  Args:
    learning_rate: a float or an optax schedule.
    rank: projection rank (static).
    update_proj_gap: steps between basis refreshes.
    scale: multiplies projected leaves' updates (GaLore's alpha).
    base_optimizer: gradient-only transform in the low-rank space; default
      ``optax.scale_by_adam()``.
    weight_decay: decoupled weight decay, applied in full space.
    mask: weight-decay mask (tree or callable), as in ``optax.adamw``.
    weight_dimension_numbers: as in ``optax.contrib.galore``.
    history_size: Fisher window length (static); 0 gives GaLore.
    damping: absolute damping :math:`\lambda`, the reference code's 1e-3
      (see *Learning rate and damping* above).
    projection_side: see :func:`scale_by_natural_galore`.
    window_at_refresh: see :func:`scale_by_natural_galore`.
    normalize_output: see :func:`scale_by_natural_galore`.
    window_dtype: see :func:`scale_by_natural_galore`.
    fisher_source: see :func:`scale_by_natural_galore`.
    svd_method: see :func:`scale_by_natural_galore`.
    svd_power_iterations: see :func:`scale_by_natural_galore`.
    window_source: deprecated spelling of ``fisher_source``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is the
    chain's (:class:`NaturalGaLoreState`, weight decay, learning rate).

  Example::

    >>> import jax, jax.numpy as jnp, optax, fisher_optax
    >>> f = lambda p: jnp.sum(jnp.square(p["w"]))
    >>> tx = fisher_optax.natural_galore(1e-2, rank=4, history_size=4)
    >>> params = {"w": jnp.ones((8, 6)), "b": jnp.ones((6,))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jax.grad(f)(params), state, params)
    >>> params = optax.apply_updates(params, updates)

  References:
    Das, `Natural GaLore: Accelerating GaLore for memory-efficient LLM
    training and fine-tuning <https://arxiv.org/abs/2410.16029>`_, 2024
  """
  source = validation.fisher_source_or_old_keyword(
    "natural_galore",
    fisher_source,
    "window_source",
    window_source,
    _LEGACY_SOURCES,
  )
  validation.check_learning_rate(learning_rate)
  validation.check_positive(
    "weight_decay", weight_decay, allow_zero=True, schedule=True
  )
  chain = optax.chain(
    scale_by_natural_galore(
      rank=rank,
      update_proj_gap=update_proj_gap,
      scale=scale,
      base_optimizer=base_optimizer,
      weight_dimension_numbers=weight_dimension_numbers,
      history_size=history_size,
      damping=damping,
      projection_side=projection_side,
      window_at_refresh=window_at_refresh,
      normalize_output=normalize_output,
      window_dtype=window_dtype,
      fisher_source=source,
      svd_method=svd_method,
      svd_power_iterations=svd_power_iterations,
    ),
    optax.add_decayed_weights(weight_decay, mask),
    optax.scale_by_learning_rate(learning_rate),
  )

  return numerics.chain_following(chain, 0)
