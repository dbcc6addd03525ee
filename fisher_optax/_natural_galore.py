# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Natural GaLore and the windowed Woodbury inverse-empirical-Fisher.

Two transforms:

* :func:`scale_by_woodbury_fisher` preconditions gradients with the inverse
  of ``damping * I + H H^T``, where the columns of ``H`` are the last
  ``history_size`` gradients (or this batch's per-example gradients). It can
  sit anywhere in a chain, including the ``base_optimizer`` slot of
  ``optax.contrib.scale_by_galore``.
* :func:`scale_by_natural_galore` (alias :func:`natural_galore`) is GaLore
  with that preconditioner applied in the low-rank space, per projected leaf,
  before the base optimizer. Its arguments mirror ``optax.contrib.galore`` so
  switching is a one-word change.

Decisions (spec ``natural_galore.md`` §8), each documented where it is used:

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
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import GaLoreDimensionNumbers

from fisher_optax.fisher import linalg
from fisher_optax.fisher import validation

PyTree = Any
_HIGHEST = jax.lax.Precision.HIGHEST

GaLoreDimNumsOrFn = GaLoreDimensionNumbers | PyTree | Callable[[PyTree], PyTree]

_SIDES = ("larger", "smaller")
_REFRESH_POLICIES = ("reproject", "keep", "reset")
_WINDOW_SOURCES = ("history", "per_example")
_SVD_METHODS = ("exact", "randomized", "subspace")
# Extra columns sampled by the randomized range finder.
_OVERSAMPLING = 8


def _is_dim_leaf(x: Any) -> bool:
  return x is None or isinstance(x, GaLoreDimensionNumbers)


# -- windowed Woodbury preconditioner ------------------------------------------


def _all_finite(tree: PyTree) -> jax.Array:
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.asarray(True)
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _push_if_finite(
  window: PyTree, gram: jax.Array, g: PyTree, slot: jax.Array
) -> tuple[PyTree, jax.Array]:
  """Ring-buffer push of one gradient; a NaN/Inf ``g`` leaves the window as is."""
  window, gram, _ = linalg.stacked_push_rows_if_finite(
    window, gram, jax.tree.map(lambda x: x[None], g), slot
  )
  return window, gram


def _stat_dtype(*dtypes: Any) -> jnp.dtype:
  """float32, or wider when an input is wider (float64 oracles)."""
  return jnp.dtype(jnp.result_type(jnp.float32, *dtypes))


def _woodbury_apply(
  stacked: PyTree,
  gram: jax.Array,
  g: PyTree,
  damping: Any,
  *,
  scale: Any = 1.0,
  normalize_output: bool,
) -> PyTree:
  """``(damping I + scale H^T H)^{-1} g`` in float32+, cast back to ``g``."""
  dtype = _stat_dtype(gram.dtype, *jax.tree.leaves(g))
  wide = jax.tree.map(lambda s: s.astype(dtype), stacked)
  g32 = jax.tree.map(lambda x: x.astype(dtype), g)
  factor = linalg.woodbury_factor(gram.astype(dtype), damping, scale)
  out = linalg.woodbury_solve(wide, factor, g32, normalized=normalize_output)
  return jax.tree.map(lambda o, x: o.astype(x.dtype), out, g)


class WoodburyFisherState(NamedTuple):
  """State of :func:`scale_by_woodbury_fisher`.

  Attributes:
    count: number of updates so far (int32).
    window: ring buffer of the last ``history_size`` gradients, leaves
      ``(history_size, *shape)`` (zero-size leaves with per-example windows).
    gram: cached Gram matrix of the window in float32 (or wider): one
      ``(s, s)`` array per leaf when block-diagonal, else a single one.
  """

  count: jax.Array
  window: PyTree
  gram: PyTree


def scale_by_woodbury_fisher(
  history_size: int = 8,
  damping: float | jax.Array = 1e-3,
  *,
  normalize_output: bool = False,
  block_diagonal: bool = True,
  window_source: str = "history",
  window_dtype: Any | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Preconditions with a windowed inverse empirical Fisher (Woodbury).

  With the last ``s`` gradients as the columns of :math:`H` (the current one
  included), the update is

  .. math::

    \tilde g = (\lambda I + H H^\top)^{-1} g
             = \tfrac{1}{\lambda}\bigl(g - H z\bigr), \qquad
    (\lambda I_s + H^\top H)\, z = H^\top g,

  an ``s x s`` Cholesky solve. The Gram :math:`H^\top H` is cached and
  updated one row per step (:func:`fisher_optax.linalg.stacked_push_rows`),
  so a step costs about ``6 s d`` flops. Unfilled slots are zero and need no
  mask. With ``block_diagonal=True`` (the Natural GaLore choice) every leaf
  has its own window solve; otherwise one solve couples the whole tree (the
  M-FAC choice).

  With ``window_source="per_example"`` no history is stored: :math:`H` holds
  this batch's ``B`` per-example gradients (the ``per_example_grads`` extra,
  leaves ``(B, *shape)``) and :math:`F = \lambda I + \frac1B H H^\top` is the
  batch's damped empirical Fisher. This is an extension, not in the paper.

  Damping is absolute and there is no ``1/s`` factor, as in the paper's
  Woodbury formula and code (its definition of :math:`\hat F` has ``1/h``;
  the code drops it, and we follow the code's numbers).

  Args:
    history_size: window length ``s >= 1`` (static). Ignored for per-example
      windows.
    damping: :math:`\lambda > 0`; may be injected.
    normalize_output: return :math:`\lambda F^{-1} g` (which is ``g`` on
      directions the window has not seen) instead of :math:`F^{-1} g`.
    block_diagonal: one window solve per leaf (default) or one for the tree.
    window_source: ``"history"`` or ``"per_example"``.
    window_dtype: dtype of the stored window (default float32, float64 for
      float64 params); bfloat16 halves its memory. The Gram is float32+.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`.

  Example::

    >>> import jax.numpy as jnp, optax, fisher_optax
    >>> tx = optax.chain(fisher_optax.scale_by_woodbury_fisher(4, 1e-2),
    ...                  optax.scale_by_adam(), optax.scale(-1e-3))
    >>> params = {"w": jnp.ones((3, 2))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state)

  References:
    Das, `Natural GaLore: Accelerating GaLore for memory-efficient LLM
    training and fine-tuning <https://arxiv.org/abs/2410.16029>`_, 2024

    Frantar et al, `M-FAC: Efficient Matrix-Free Approximations of
    Second-Order Information <https://arxiv.org/abs/2107.03356>`_, 2021
  """
  validation.check_choice("window_source", window_source, _WINDOW_SOURCES)
  per_example = window_source == "per_example"
  s = validation.check_static_int(
    "history_size", history_size, minimum=0 if per_example else 1
  )
  validation.check_positive("damping", damping)

  def init_fn(params: PyTree) -> WoodburyFisherState:
    n = 0 if per_example else s
    wdtype = lambda p: (
      jnp.dtype(window_dtype)
      if window_dtype is not None
      else _stat_dtype(p.dtype)
    )
    window = jax.tree.map(
      lambda p: jnp.zeros((n,) + tuple(jnp.shape(p)), wdtype(p)), params
    )
    if block_diagonal:
      gram = jax.tree.map(
        lambda p: jnp.zeros((n, n), _stat_dtype(wdtype(p))), params
      )
    else:
      gram = jnp.zeros(
        (n, n), _stat_dtype(*[wdtype(p) for p in jax.tree.leaves(params)])
      )
    return WoodburyFisherState(
      count=jnp.zeros([], jnp.int32), window=window, gram=gram
    )

  def update_fn(
    updates: PyTree,
    state: WoodburyFisherState,
    params: PyTree | None = None,
    *,
    per_example_grads: PyTree | None = None,
    **extra_args: Any,
  ) -> tuple[PyTree, WoodburyFisherState]:
    del params, extra_args
    validation.check_positive("damping", damping)
    count_inc = optax.safe_increment(state.count)
    if per_example:
      if per_example_grads is None:
        raise ValueError(
          "scale_by_woodbury_fisher(window_source='per_example') needs the "
          "per_example_grads keyword argument in update()."
        )
      batch = validation.check_leading_axis(
        per_example_grads, updates, what="per_example_grads"
      )
      if batch == 0:
        raise ValueError("per_example_grads has an empty batch axis.")
      f32 = lambda t: jax.tree.map(lambda x: x.astype(_stat_dtype(x.dtype)), t)
      if block_diagonal:
        out = jax.tree.map(
          lambda h, g: _woodbury_apply(
            h,
            linalg.tree_stacked_gram(f32(h)),
            g,
            damping,
            scale=1.0 / batch,
            normalize_output=normalize_output,
          ),
          per_example_grads,
          updates,
        )
      else:
        out = _woodbury_apply(
          per_example_grads,
          linalg.tree_stacked_gram(f32(per_example_grads)),
          updates,
          damping,
          scale=1.0 / batch,
          normalize_output=normalize_output,
        )
      return out, state._replace(count=count_inc)

    validation.check_same_structure(updates, state.window, what="state.window")
    slot = state.count % s
    if block_diagonal:
      pushed = jax.tree.map(
        lambda w, gr, g: _push_if_finite(w, gr, g, slot),
        state.window,
        state.gram,
        updates,
      )
      treedef = jax.tree.structure(updates)
      window, gram = jax.tree.transpose(
        treedef, jax.tree.structure((0, 0)), pushed
      )
      out = jax.tree.map(
        lambda w, gr, g: _woodbury_apply(
          w, gr, g, damping, normalize_output=normalize_output
        ),
        window,
        gram,
        updates,
      )
    else:
      window, gram = _push_if_finite(state.window, state.gram, updates, slot)
      out = _woodbury_apply(
        window, gram, updates, damping, normalize_output=normalize_output
      )
    return out, WoodburyFisherState(count=count_inc, window=window, gram=gram)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# -- projections ---------------------------------------------------------------


class _LeafPlan(NamedTuple):
  """Static per-leaf layout: the 2-D view and which side is projected."""

  perm: tuple[int, ...]
  rows: int  # m: product of the reduction axes
  cols: int  # n: product of the output axes
  rank: int
  left: bool  # True: P is (m, r) and the low-rank gradient is P^T G (r, n)

  def to_matrix(self, x: jax.Array) -> jax.Array:
    return jnp.transpose(x, self.perm).reshape(self.rows, self.cols)

  def from_matrix(self, y: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    permuted = tuple(shape[a] for a in self.perm)
    inverse = tuple(sorted(range(len(shape)), key=lambda i: self.perm[i]))
    return jnp.transpose(y.reshape(permuted), inverse)

  @property
  def projector_shape(self) -> tuple[int, int]:
    return (self.rows if self.left else self.cols, self.rank)

  @property
  def low_rank_shape(self) -> tuple[int, int]:
    return (self.rank, self.cols) if self.left else (self.rows, self.rank)

  def project(self, p: jax.Array, g2: jax.Array) -> jax.Array:
    return p.T @ g2 if self.left else g2 @ p

  def project_back(self, p: jax.Array, u: jax.Array) -> jax.Array:
    return p @ u if self.left else u @ p.T


def _axes(spec: Sequence[int] | int, ndim: int) -> tuple[int, ...]:
  spec = (spec,) if isinstance(spec, int) else tuple(spec)
  return tuple(a % ndim for a in spec)


def _make_plan(
  shape: tuple[int, ...], dims: GaLoreDimensionNumbers, rank: int, side: str
) -> _LeafPlan:
  ndim = len(shape)
  if ndim < 2:
    raise ValueError(
      f"Natural GaLore projects leaves of rank >= 2, got shape {shape}; "
      "give it None in weight_dimension_numbers."
    )
  red = _axes(dims.reduction_axis, ndim)
  out = _axes(dims.output_axis, ndim)
  if set(red) & set(out) or len(set(red) | set(out)) != ndim:
    raise ValueError(
      f"weight_dimension_numbers {dims} must split all {ndim} axes of shape "
      f"{shape} into disjoint reduction and output axes."
    )
  m = math.prod(shape[a] for a in red)
  n = math.prod(shape[a] for a in out)
  left = m >= n if side == "larger" else m < n
  return _LeafPlan(
    perm=red + out, rows=m, cols=n, rank=min(rank, m, n), left=left
  )


def _resolve_dim_nums(
  weight_dimension_numbers: GaLoreDimNumsOrFn | None, params: PyTree
) -> list[GaLoreDimensionNumbers | None]:
  """One ``GaLoreDimensionNumbers`` or ``None`` per leaf of ``params``."""
  leaves, treedef = jax.tree.flatten(params)
  if weight_dimension_numbers is None:
    return [
      GaLoreDimensionNumbers() if jnp.ndim(p) == 2 else None for p in leaves
    ]
  if isinstance(weight_dimension_numbers, GaLoreDimensionNumbers):
    return [
      weight_dimension_numbers if jnp.ndim(p) >= 2 else None for p in leaves
    ]
  dims = weight_dimension_numbers
  if callable(dims):
    dims = dims(params)
  try:
    flat = treedef.flatten_up_to(dims)
  except (ValueError, TypeError) as e:
    raise ValueError(
      "weight_dimension_numbers must be a GaLoreDimensionNumbers, or a tree "
      "with the structure of params holding GaLoreDimensionNumbers or None "
      f"(or a callable returning one). Got {dims!r}."
    ) from e
  for d in flat:
    if not _is_dim_leaf(d):
      raise ValueError(
        "weight_dimension_numbers leaves must be GaLoreDimensionNumbers or "
        f"None, got {d!r}."
      )
  return flat


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
  err = jnp.max(
    jnp.abs(jnp.matmul(q.T, q, precision=_HIGHEST) - jnp.eye(l, dtype=q.dtype))
  )
  # CholQR2 reaches O(eps) orthogonality when it works; anything looser
  # means Y was (numerically) rank-deficient and the basis is noise.
  ok = jnp.isfinite(err) & (err < 20 * l * eps)
  return jax.lax.cond(ok, lambda: q, lambda: jnp.linalg.qr(y)[0])


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
    sharded ``mat`` is never gathered.
  """
  q = _orthonormalize(jnp.matmul(mat, start, precision=_HIGHEST))
  for _ in range(power_iterations):
    z = jnp.matmul(mat.T, q, precision=_HIGHEST)
    q = _orthonormalize(jnp.matmul(mat, z, precision=_HIGHEST))
  # Rayleigh-Ritz: rotate range(Q) onto the top singular directions.
  b = jnp.matmul(q.T, mat, precision=_HIGHEST)
  _, vecs = jnp.linalg.eigh(
    linalg.symmetrize(jnp.matmul(b, b.T, precision=_HIGHEST))
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
  plan: _LeafPlan,
  g2: jax.Array,
  old: jax.Array,
  method: str,
  power_iterations: int,
  key: jax.Array,
) -> jax.Array:
  """Refreshed projector; keeps ``old`` when the gradient is zero or NaN."""
  dtype = old.dtype
  g32 = g2.astype(_stat_dtype(g2.dtype))
  r = plan.rank
  if method == "exact":
    u, _, vh = jnp.linalg.svd(g32, full_matrices=False)
    new = u[:, :r] if plan.left else vh[:r, :].T
  else:
    mat = g32 if plan.left else g32.T
    p, q = mat.shape
    width = min(r + _OVERSAMPLING, p, q)
    start = jax.random.normal(key, (q, width), g32.dtype)
    if method == "subspace":
      warm = jnp.matmul(mat.T, old.astype(g32.dtype), precision=_HIGHEST)
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
      params) ``(s, s)`` Gram of its
      window; zero-size otherwise.
    base_optimizer_state: the base optimizer's state over the low-rank
      gradients (full shape for unprojected leaves).
  """

  count: jax.Array
  projector: PyTree
  window: PyTree
  window_gram: PyTree
  base_optimizer_state: optax.OptState


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
  window_source: str = "history",
  svd_method: str = "exact",
  svd_power_iterations: int = 1,
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

  Decisions where the paper leaves room (spec §8):

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
  * A zero or NaN gradient at a refresh keeps the old basis (the initial one
    is ``eye``); a NaN gradient never enters the window. NaN still reaches
    the base optimizer and the updates, so ``optax.apply_if_finite`` sees it.
  * ``scale`` applies to projected leaves only, as in optax and GaLore.
  * Inexact refreshes flip each new basis vector to agree in sign with the
    old one, so kept moments stay meaningful and the result does not depend
    on float noise such as the sharding. The exact SVD keeps LAPACK's signs,
    as optax does, so ``history_size=0`` stays bit-identical to it.

  Beyond the paper: ``window_source="per_example"`` builds :math:`H` from this
  batch's projected ``per_example_grads`` (``F = \lambda I + \frac1B H
  H^\top``, no window memory); ``svd_method="randomized"`` or
  ``"subspace"`` (warm-started from the old basis) refreshes with matmuls,
  Cholesky-QR and an ``l x l`` eigendecomposition only, so a sharded weight
  is never gathered.

  Args:
    rank: projection rank ``r`` (static), clipped to ``min(m, n)``.
    update_proj_gap: refresh period ``T``.
    scale: :math:`\alpha`, multiplies projected leaves' updates.
    base_optimizer: gradient-only transform applied in the low-rank space
      (called with ``params=None``); default ``optax.scale_by_adam()``.
    weight_dimension_numbers: which leaves are projected and how they are
      viewed as matrices, exactly as in ``optax.contrib.scale_by_galore``.
    history_size: window length ``s`` (static); 0 disables the
      preconditioner.
    damping: :math:`\lambda > 0`; may be injected.
    projection_side: ``"larger"`` (optax) or ``"smaller"`` (reference).
    window_at_refresh: ``"reproject"``, ``"keep"`` or ``"reset"``.
    normalize_output: return :math:`\lambda F^{-1} g`.
    window_dtype: stored window dtype (default float32; bfloat16 halves it).
    window_source: ``"history"`` or ``"per_example"`` (needs the
      ``per_example_grads`` extra, leaves ``(B, *param_shape)``, e.g. from
      :func:`fisher_optax.fisher.per_example_grads`).
    svd_method: ``"exact"``, ``"randomized"`` or ``"subspace"``.
    svd_power_iterations: power iterations of the inexact methods (static).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with state
    :class:`NaturalGaLoreState`.

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
  if base_optimizer is None:
    base_optimizer = optax.scale_by_adam()
  rank = validation.check_static_int("rank", rank, minimum=1)
  s = validation.check_static_int("history_size", history_size)
  n_iter = validation.check_static_int(
    "svd_power_iterations", svd_power_iterations
  )
  if isinstance(update_proj_gap, bool) or (
    isinstance(update_proj_gap, (int, float))
    and (update_proj_gap < 1 or update_proj_gap != int(update_proj_gap))
  ):
    raise ValueError(
      f"update_proj_gap must be a positive integer, got {update_proj_gap}."
    )
  validation.check_positive("damping", damping)
  validation.check_choice("projection_side", projection_side, _SIDES)
  validation.check_choice(
    "window_at_refresh", window_at_refresh, _REFRESH_POLICIES
  )
  validation.check_choice("window_source", window_source, _WINDOW_SOURCES)
  validation.check_choice("svd_method", svd_method, _SVD_METHODS)
  per_example = window_source == "per_example"
  windowed = s > 0 and not per_example

  def plans(tree: PyTree) -> list[_LeafPlan | None]:
    dims = _resolve_dim_nums(weight_dimension_numbers, tree)
    return [
      None
      if d is None
      else _make_plan(tuple(jnp.shape(x)), d, rank, projection_side)
      for x, d in zip(jax.tree.leaves(tree), dims)
    ]

  def init_fn(params: PyTree) -> NaturalGaLoreState:
    leaves, treedef = jax.tree.flatten(params)
    if not leaves:  # e.g. optax.tree.map_params' placeholder
      return NaturalGaLoreState(
        count=jnp.zeros([], jnp.int32),
        projector=params,
        window=params,
        window_gram=params,
        base_optimizer_state=base_optimizer.init(params),
      )
    projectors, windows, grams, proxies = [], [], [], []
    for p, plan in zip(leaves, plans(params)):
      if plan is None:
        projectors.append(jnp.zeros((0, 0), p.dtype))
        windows.append(jnp.zeros((0,), _stat_dtype(p.dtype)))
        grams.append(jnp.zeros((0, 0), jnp.float32))
        proxies.append(jnp.zeros(jnp.shape(p), p.dtype))
        continue
      n = s if windowed else 0
      wdtype = (
        jnp.dtype(window_dtype)
        if window_dtype is not None
        else _stat_dtype(p.dtype)
      )
      projectors.append(_identity_basis(plan.projector_shape, p.dtype))
      windows.append(jnp.zeros((n,) + plan.low_rank_shape, wdtype))
      grams.append(jnp.zeros((n, n), _stat_dtype(wdtype)))
      proxies.append(jnp.zeros(plan.low_rank_shape, p.dtype))
    unflat = lambda xs: jax.tree.unflatten(treedef, xs)
    return NaturalGaLoreState(
      count=jnp.zeros([], jnp.int32),
      projector=unflat(projectors),
      window=unflat(windows),
      window_gram=unflat(grams),
      base_optimizer_state=base_optimizer.init(unflat(proxies)),
    )

  def refresh_window(plan, old_p, new_p, window, gram):
    if not windowed or window_at_refresh == "keep":
      return window, gram
    if window_at_refresh == "reset":
      return jnp.zeros_like(window), jnp.zeros_like(gram)
    # Rotate old-basis coordinates into the new basis: R = P_new^T P_old.
    dtype = gram.dtype
    rot = jnp.matmul(
      new_p.astype(dtype).T, old_p.astype(dtype), precision=_HIGHEST
    )
    w32 = window.astype(dtype)
    if plan.left:
      w32 = jnp.einsum("ij,sjn->sin", rot, w32, precision=_HIGHEST)
    else:
      w32 = jnp.einsum("smj,ij->smi", w32, rot, precision=_HIGHEST)
    window = w32.astype(window.dtype)
    return window, linalg.tree_stacked_gram(window.astype(dtype))

  def update_fn(
    updates: PyTree,
    state: NaturalGaLoreState,
    params: PyTree | None = None,
    *,
    per_example_grads: PyTree | None = None,
    **extra_args: Any,
  ) -> tuple[PyTree, NaturalGaLoreState]:
    del params, extra_args
    validation.check_positive("damping", damping)
    leaves, treedef = jax.tree.flatten(updates)
    validation.check_same_structure(
      updates, state.projector, what="state.projector"
    )
    pe_leaves = [None] * len(leaves)
    batch = 0
    if per_example and s > 0:
      if per_example_grads is None:
        raise ValueError(
          "scale_by_natural_galore(window_source='per_example') needs the "
          "per_example_grads keyword argument in update()."
        )
      batch = validation.check_leading_axis(
        per_example_grads, updates, what="per_example_grads"
      )
      if batch == 0:
        raise ValueError("per_example_grads has an empty batch axis.")
      pe_leaves = jax.tree.leaves(per_example_grads)

    count = state.count
    refresh = (count % update_proj_gap) == 0
    slot = count % s if windowed else 0
    base_key = jax.random.fold_in(jax.random.key(0), count)
    low, new_projectors, new_windows, new_grams = [], [], [], []
    leaf_plans = plans(updates)
    for i, (g, plan, p_old, window, gram, pe) in enumerate(
      zip(
        leaves,
        leaf_plans,
        jax.tree.leaves(state.projector),
        jax.tree.leaves(state.window),
        jax.tree.leaves(state.window_gram),
        pe_leaves,
      )
    ):
      if plan is None:
        low.append(g)
        new_projectors.append(p_old)
        new_windows.append(window)
        new_grams.append(gram)
        continue
      expected = plan.projector_shape
      if tuple(p_old.shape) != expected:
        raise ValueError(
          f"state.projector leaf {i} has shape {p_old.shape}, expected "
          f"{expected} for a gradient of shape {g.shape}; was the state "
          "initialised with other params or options?"
        )
      g2 = plan.to_matrix(g)
      key = jax.random.fold_in(base_key, i)

      def do_refresh(
        p_old=p_old, g2=g2, key=key, window=window, gram=gram, plan=plan
      ):
        p_new = _new_projector(plan, g2, p_old, svd_method, n_iter, key)
        return (p_new,) + refresh_window(plan, p_old, p_new, window, gram)

      p_new, window, gram = jax.lax.cond(
        refresh,
        do_refresh,
        lambda p_old=p_old, window=window, gram=gram: (p_old, window, gram),
      )
      lg = plan.project(p_new, g2)
      if windowed:
        window, gram = _push_if_finite(window, gram, lg, slot)
        lg = _woodbury_apply(
          window, gram, lg, damping, normalize_output=normalize_output
        )
      elif per_example and s > 0:
        pe2 = jax.vmap(plan.to_matrix)(pe)
        h = jax.vmap(
          lambda x, p_new=p_new, plan=plan: plan.project(
            p_new, x.astype(p_new.dtype)
          )
        )(pe2)
        h = h.astype(_stat_dtype(h.dtype))
        lg = _woodbury_apply(
          h,
          linalg.tree_stacked_gram(h),
          lg,
          damping,
          scale=1.0 / batch,
          normalize_output=normalize_output,
        )
      low.append(lg)
      new_projectors.append(p_new)
      new_windows.append(window)
      new_grams.append(gram)

    unflat = lambda xs: jax.tree.unflatten(treedef, xs)
    low_updates, base_state = base_optimizer.update(
      unflat(low), state.base_optimizer_state, None
    )
    out = []
    for g, plan, p, u in zip(
      leaves, leaf_plans, new_projectors, jax.tree.leaves(low_updates)
    ):
      if plan is None:
        out.append(u)
        continue
      full = plan.from_matrix(plan.project_back(p, u), g.shape)
      out.append((scale * full).astype(g.dtype))
    return unflat(out), NaturalGaLoreState(
      count=optax.safe_increment(count),
      projector=unflat(new_projectors),
      window=unflat(new_windows),
      window_gram=unflat(new_grams),
      base_optimizer_state=base_state,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
  window_source: str = "history",
  svd_method: str = "exact",
  svd_power_iterations: int = 1,
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
  injected.

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
    damping: absolute damping :math:`\lambda`.
    projection_side: see :func:`scale_by_natural_galore`.
    window_at_refresh: see :func:`scale_by_natural_galore`.
    normalize_output: see :func:`scale_by_natural_galore`.
    window_dtype: see :func:`scale_by_natural_galore`.
    window_source: see :func:`scale_by_natural_galore`.
    svd_method: see :func:`scale_by_natural_galore`.
    svd_power_iterations: see :func:`scale_by_natural_galore`.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`.

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
  validation.check_learning_rate(learning_rate)
  validation.check_positive("weight_decay", weight_decay, allow_zero=True)
  return optax.chain(
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
      window_source=window_source,
      svd_method=svd_method,
      svd_power_iterations=svd_power_iterations,
    ),
    optax.add_decayed_weights(weight_decay, mask),
    optax.scale_by_learning_rate(learning_rate),
  )
