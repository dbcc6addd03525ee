# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
r"""M-FAC: preconditioning by a sliding window's inverse empirical Fisher.

One transform keeps a ring buffer of the last gradients :math:`G` (rows
:math:`g_k`) with their cached Gram matrix :math:`G G^\top` and returns

.. math::

  u = (\lambda I + c\, G^\top G)^{-1} g

through the Woodbury identity on an ``s x s`` Cholesky factor
(:func:`fisher_optax.fisher.linalg.woodbury_window_solve`), in ``O(s d)``
per step. It has two public configurations:

* :func:`scale_by_woodbury_fisher`: absolute damping, :math:`c = 1`, one
  window per leaf by default (Natural GaLore's choice) or one for the tree;
  with ``fisher_source="per_example"`` the window is this batch's
  per-example gradients (:math:`c = 1/B`).
* :func:`scale_by_mfac` (and the optimizer :func:`mfac`): M-FAC's dynamic
  algorithm, one window for the whole tree, :math:`c = 1/m`, per-example
  rows pushed into the window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fisher_optax.fisher import linalg
from fisher_optax.fisher import numerics
from fisher_optax.fisher import validation

PyTree = Any
# Old values of the renamed keywords (window_source=, gradients=).
_LEGACY_SOURCES = {"history": "batch", "mean": "batch"}


class WoodburyFisherState(NamedTuple):
  """State of :func:`scale_by_woodbury_fisher`.

  Attributes:
    count: number of steps taken so far, int32 (a step skipped as
      non-finite is not counted).
    window: ring buffer of the last ``history_size`` gradients, leaves
      ``(history_size, *shape)`` (zero-size leaves with per-example windows).
    gram: cached Gram matrix of the window in float32 (or wider): one
      ``(s, s)`` array per leaf when block-diagonal, else a single one.
    notfinite_count: int32 number of steps skipped as non-finite (as in
      :func:`optax.apply_if_finite`'s state).
  """

  count: jax.Array
  window: PyTree
  gram: PyTree
  notfinite_count: jax.Array


class MFACState(NamedTuple):
  """State of :func:`scale_by_mfac`.

  Attributes:
    count: number of steps taken so far, int32 (a step skipped as
      non-finite is not counted).
    index: the ring-buffer slot the next gradient overwrites, int32.
    grads: the window ``G``, a tree shaped like the params with a leading axis
      ``window_size`` (oldest rows are overwritten first; starts at zero).
    gram: ``G G^T``, shape ``(window_size, window_size)``, kept in sync, in
      float32 (or wider).
    notfinite_count: int32 number of steps skipped as non-finite (as in
      :func:`optax.apply_if_finite`'s state).
  """

  count: jax.Array
  index: jax.Array
  grads: PyTree
  gram: jax.Array
  notfinite_count: jax.Array


# -- the windowed Woodbury preconditioner --------------------------------------


class _Window(NamedTuple):
  """Static configuration of the windowed Woodbury preconditioner."""

  size: int  # rows kept; 0: per-example rows only, no memory
  block_diagonal: bool  # one window (and Gram) per leaf
  per_example: bool  # rows come from per_example_grads, not updates
  mean: bool  # F = lambda I + (1/size) G^T G (M-FAC), else no 1/size
  normalized: bool  # return lambda F^{-1} g
  dtype: Any  # stored window dtype (None: compute dtype of the params)
  function: str  # the public name, for messages


def _init_window(cfg: _Window, params: PyTree) -> tuple[PyTree, PyTree]:
  """Zero window (leading axis ``cfg.size``) and its Gram."""
  wdtype = lambda p: (
    cfg.dtype if cfg.dtype is not None else numerics.compute_dtype(p)
  )
  n = cfg.size
  window = jax.tree.map(
    lambda p: numerics.zeros_like_stacked(p, (n,), wdtype(p)), params
  )
  if cfg.block_diagonal:
    gram = jax.tree.map(
      lambda p: jnp.zeros((n, n), numerics.compute_dtype(wdtype(p))), params
    )
  else:
    wdtypes = [wdtype(p) for p in jax.tree.leaves(params)]
    dtype = numerics.compute_dtype(jnp.result_type(jnp.float32, *wdtypes))
    gram = jnp.zeros((n, n), dtype)
  return window, gram


def _new_rows(
  cfg: _Window, updates: PyTree, per_example_grads: PyTree | None
) -> PyTree:
  """This step's rows: the ``per_example_grads`` or the gradient itself."""
  if not cfg.per_example:
    return jax.tree.map(lambda g: g[None], updates)
  per_example_grads, k = numerics.checked_per_example_grads(
    per_example_grads, updates, function=cfg.function
  )
  if cfg.size and k > cfg.size:
    raise ValueError(
      f"per_example_grads has {k} rows, more than window_size={cfg.size}."
    )
  return per_example_grads


def _check_updates(updates: PyTree, window: PyTree) -> None:
  """The one "updates do not match params" check, against the window's rows."""
  rows = jax.tree.map(
    lambda w: jax.ShapeDtypeStruct(w.shape[1:], w.dtype), window
  )
  validation.check_like(
    updates, rows, what="updates", reference_name="init's params"
  )


def _slots(slot: jax.Array, k: int, m: int) -> jax.Array:
  return (jnp.asarray(slot, jnp.int32) + jnp.arange(k, dtype=jnp.int32)) % m


def _pending_gram(
  cfg: _Window,
  window: PyTree,
  gram: PyTree,
  rows: PyTree,
  slot: jax.Array,
  x: PyTree | None,
) -> tuple[PyTree, PyTree]:
  """The Gram (per leaf) with the rows in the window, and ``G x`` (or None)."""
  if not cfg.block_diagonal:
    return linalg.stacked_pending_gram(window, gram, rows, slot, x)
  leaves, treedef = jax.tree.flatten(window)
  xs = [None] * len(leaves) if x is None else treedef.flatten_up_to(x)
  pending = [
    linalg.stacked_pending_gram(w, g, r, slot, v)
    for w, g, r, v in zip(
      leaves, treedef.flatten_up_to(gram), treedef.flatten_up_to(rows), xs
    )
  ]
  gram = jax.tree.unflatten(treedef, [g for g, _ in pending])
  if x is None:
    return gram, None
  return gram, jax.tree.unflatten(treedef, [v for _, v in pending])


def _solve(
  cfg: _Window,
  window: PyTree,
  gram: PyTree,
  g: PyTree,
  damping: Any,
  scale: float,
  gr: PyTree = None,
  pending: tuple[PyTree, jax.Array] | None = None,
  coords: jax.Array | None = None,
  remainder: bool = True,
) -> PyTree:
  """``F^{-1} g`` for a window and its Gram, per leaf if block-diagonal.

  ``pending=(rows, slots)`` are rows not yet written into the window
  (see :func:`fisher_optax.fisher.linalg.stacked_pending_gram`); ``coords``
  and ``remainder`` say which part of ``g`` they span (of the pending rows,
  or of the window's own without ``pending``), and ``gr`` is ``G r`` of the
  remainder (per leaf if block-diagonal) when already known, else None
  (see :func:`fisher_optax.fisher.linalg.woodbury_window_solve`). A Gram that
  overflowed from finite rows (1e30 gradients) never reaches the Cholesky:
  the solve runs on a zero Gram and its output is NaN, so the non-finite
  policy skips the step.
  """

  def solve(w: PyTree, c: jax.Array, x: PyTree, gr: Any, rows: Any) -> PyTree:
    if c is None:  # a None leaf (optax's placeholder): nothing to solve
      return x

    def factor_and_solve(c: jax.Array, gr: Any) -> PyTree:
      lam = linalg.floored_damping(c, damping, scale)
      return linalg.woodbury_window_solve(
        w,
        c,
        x,
        lam,
        scale=scale,
        normalized=cfg.normalized,
        pending=None if pending is None else (rows, pending[1]),
        coords=coords,
        remainder=remainder,
        gr=gr,
      )

    return numerics.finite_or_nan(factor_and_solve, c, gr)

  rows = None if pending is None else pending[0]
  if not cfg.block_diagonal:
    return solve(window, gram, g, gr, rows)
  none = jax.tree.map(lambda _: None, gram)
  return jax.tree.map(
    solve,
    window,
    gram,
    g,
    none if gr is None else gr,
    none if rows is None else rows,
    is_leaf=lambda x: x is None,
  )


def _rows_solve(
  cfg: _Window, rows: PyTree, updates: PyTree, damping: Any
) -> PyTree:
  """``F^{-1} g`` with this batch's ``B`` rows as the window (scale ``1/B``)."""
  wide = numerics.widen(rows)
  if cfg.block_diagonal:
    gram = jax.tree.map(lambda r: linalg.tree_stacked_gram(r), wide)
  else:
    gram = linalg.tree_stacked_gram(wide) if jax.tree.leaves(wide) else None
  b = jax.tree.leaves(rows)[0].shape[0] if jax.tree.leaves(rows) else 1
  if gram is None:
    return updates
  # The updates are (about) the rows' mean: solved in their span.
  coords = jnp.full((b,), 1.0 / b, jnp.float32)
  return _solve(cfg, wide, gram, updates, damping, 1.0 / b, coords=coords)


def _window_step(
  cfg: _Window,
  damping: Any,
  updates: PyTree,
  window: PyTree,
  light: Any,
  slot: jax.Array,
  advance: Callable[[Any, int], Any],
  per_example_grads: PyTree | None,
) -> tuple[PyTree, PyTree, Any]:
  """One step under the non-finite policy: push the rows, precondition.

  ``light`` is the state without its window (the field set to ``()``) and
  with a ``gram`` field: the policy keeps or restores it whole, while the
  window, the state's one large array, is only written ``k`` rows at a time
  (never selected or copied whole, so a donated window is updated in
  place). ``advance(light, k)`` moves ``light``'s counters on a good step
  that pushed ``k`` rows.

  Returns:
    ``(updates, window, light)`` after the step.
  """
  rows = _new_rows(cfg, updates, per_example_grads)
  inputs = rows if cfg.per_example else ()
  if cfg.size == 0:  # this batch's per-example gradients are the window
    step = lambda: (
      _rows_solve(cfg, rows, updates, damping),
      advance(light, 0),
    )
    out, light = numerics.skip_nonfinite_step(
      step, updates, light, inputs=inputs
    )
    return out, window, light
  leaves = jax.tree.leaves(rows)
  k = leaves[0].shape[0] if leaves else 1
  slots = _slots(slot, k, cfg.size)
  stored = jax.tree.map(lambda r, w: r.astype(w.dtype), rows, window)
  # The rows are written once, in place, after the policy's decision: the
  # Gram and the solve see them as pending rows of the old window. Reading a
  # donated window after an earlier write of it would make XLA copy it whole.
  exact = all(
    jnp.promote_types(u.dtype, w.dtype) == w.dtype
    for u, w in zip(jax.tree.leaves(updates), jax.tree.leaves(window))
  )
  # The gradient is the row pushed (the per-example rows' mean): it lies in
  # the window's span, where the solve needs no G g and has no cancellation
  # (see linalg.woodbury_window_solve's coords). A narrower window (bf16)
  # holds the rows rounded: that rounding lies outside the span, where the
  # inverse scales by 1 / damping, so the solve takes the rows as stored.
  # An exact window keeps the rest of per-example updates (their mean's
  # rounding, or terms added to the gradient) as the remainder.
  coords = jnp.full((k,), 1.0 / k, jnp.float32)
  remainder = exact and cfg.per_example
  # G r of the remainder comes from the Gram's pass over the window (from
  # r itself: G g - Gram a would cancel).
  rest = None
  if remainder:
    dtype = numerics.compute_dtype(
      jnp.result_type(*jax.tree.leaves(light.gram), *jax.tree.leaves(updates))
    )
    rest = linalg.remainder_of(updates, stored, coords, dtype)
  gram, gr = _pending_gram(cfg, window, light.gram, stored, slot, rest)
  # The policy counts from zero, so a skip is seen even once the count
  # saturates.
  zero = jnp.zeros([], jnp.int32)
  fresh = light._replace(notfinite_count=zero)
  scale = 1.0 / cfg.size if cfg.mean else 1.0
  step = lambda: (
    _solve(
      cfg,
      window,
      gram,
      updates,
      damping,
      scale,
      gr,
      (stored, slots),
      coords,
      remainder,
    ),
    advance(fresh, k)._replace(gram=gram),
  )
  out, new = numerics.skip_nonfinite_step(step, updates, fresh, inputs=inputs)
  # A skipped step (a non-finite row, a Gram overflowing from 1e30 rows)
  # keeps the old rows, so the window stays the Gram's window.
  ok = new.notfinite_count == 0
  window = jax.tree.map(
    lambda w, r: w.at[slots].set(jnp.where(ok, r, w[slots])), window, stored
  )
  count = light.notfinite_count
  return (
    out,
    window,
    new._replace(
      notfinite_count=jnp.where(ok, count, optax.safe_increment(count))
    ),
  )


def scale_by_woodbury_fisher(
  history_size: int = 8,
  damping: float | jax.Array = 1e-3,
  *,
  normalize_output: bool = False,
  block_diagonal: bool = True,
  fisher_source: str | None = None,
  window_dtype: Any | None = None,
  window_source: str | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Preconditions with a windowed inverse empirical Fisher (Woodbury).

  With the last ``s`` gradients as the columns of :math:`H` (the current one
  included), the update is

  .. math::

    \tilde g = (\lambda I + H H^\top)^{-1} g
             = \tfrac{1}{\lambda}\bigl(g - H z\bigr), \qquad
    (\lambda I_s + H^\top H)\, z = H^\top g,

  an ``s x s`` Cholesky solve. The Gram :math:`H^\top H` is cached and
  updated one row per step (:func:`fisher_optax.fisher.linalg.stacked_push_rows`),
  so a step costs about ``6 s d`` flops. Unfilled slots are zero and need no
  mask. With ``block_diagonal=True`` (the Natural GaLore choice) every leaf
  has its own window solve; otherwise one solve couples the whole tree (the
  M-FAC choice; :func:`scale_by_mfac` is that configuration with M-FAC's
  ``1/m`` scale).

  With ``fisher_source="per_example"`` no history is stored: :math:`H` holds
  this batch's ``B`` per-example gradients (the ``per_example_grads`` extra,
  leaves ``(B, *shape)``) and :math:`F = \lambda I + \frac1B H H^\top` is the
  batch's damped empirical Fisher. This is an extension, not in the paper.

  Damping is absolute and there is no ``1/s`` factor, as in the Natural
  GaLore paper's Woodbury formula and code (its definition of :math:`\hat F`
  has ``1/h``; the code drops it, and we follow the code's numbers).

  Args:
    history_size: window length ``s >= 1`` (static). Ignored for per-example
      windows.
    damping: :math:`\lambda > 0`; may be injected. Below the window's
      float resolution, ``m eps trace(G G^T)`` for ``m`` rows (large,
      similar gradients), that floor is used instead, as in
      :func:`scale_by_mfac`: the exact :math:`\lambda` would fail the
      factorisation and skip every step
      (:func:`fisher_optax.fisher.linalg.floored_damping`).
    normalize_output: return :math:`\lambda F^{-1} g` (which is ``g`` on
      directions the window has not seen) instead of :math:`F^{-1} g`.
    block_diagonal: one window solve per leaf (default) or one for the tree.
    fisher_source: ``"batch"`` (default: a window of past mini-batch
      gradients ``updates``) or ``"per_example"`` (this batch's
      ``per_example_grads``).
    window_dtype: dtype of the stored window (default float32, float64 for
      float64 params); bfloat16 halves its memory, and the gradient is
      then preconditioned as stored (rounded). The Gram is float32+.
    window_source: deprecated spelling of ``fisher_source`` (``"history"``
      meant ``"batch"``).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with state
    :class:`WoodburyFisherState`. Non-finite steps follow the library's one
    policy (:func:`fisher_optax.fisher.numerics.skip_nonfinite_step`): a NaN
    or infinite gradient never enters the window, the state is unchanged but
    for ``notfinite_count`` and the updates are NaN; a finite gradient whose
    Gram overflows (1e30 entries) is skipped the same way with zero updates,
    and never reaches the Cholesky.

  Example::

    >>> import jax.numpy as jnp, optax, fisher_optax
    >>> tx = optax.chain(fisher_optax.scale_by_woodbury_fisher(4, 1e-2),
    ...                  optax.scale_by_adam(), optax.scale(-1e-3))
    >>> params = {"w": jnp.ones((3, 2))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state)
    >>> updates["w"].shape
    (3, 2)

  References:
    Das, `Natural GaLore: Accelerating GaLore for memory-efficient LLM
    training and fine-tuning <https://arxiv.org/abs/2410.16029>`_, 2024

    Frantar et al, `M-FAC: Efficient Matrix-Free Approximations of
    Second-Order Information <https://arxiv.org/abs/2107.03356>`_, 2021
  """
  source = validation.fisher_source_or_old_keyword(
    "scale_by_woodbury_fisher",
    fisher_source,
    "window_source",
    window_source,
    _LEGACY_SOURCES,
  )
  per_example = source == "per_example"
  s = validation.check_static_int(
    "history_size", history_size, minimum=0 if per_example else 1
  )
  validation.check_positive("damping", damping)
  cfg = _Window(
    size=0 if per_example else s,
    block_diagonal=validation.check_flag("block_diagonal", block_diagonal),
    per_example=per_example,
    mean=False,
    normalized=validation.check_flag("normalize_output", normalize_output),
    dtype=numerics.canonical_float_dtype("window_dtype", window_dtype),
    function="scale_by_woodbury_fisher",
  )

  def init_fn(params: PyTree) -> WoodburyFisherState:
    validation.check_real_floating(
      params, what="params", function="scale_by_woodbury_fisher"
    )
    window, gram = _init_window(cfg, params)
    # Separate buffers, so the state can be donated (jit's donate_argnums).
    zero = lambda: jnp.zeros([], jnp.int32)
    return WoodburyFisherState(zero(), window, gram, notfinite_count=zero())

  def update_fn(
    updates: PyTree,
    state: WoodburyFisherState,
    params: PyTree | None = None,
    *,
    per_example_grads: PyTree | None = None,
    **extra_args: Any,
  ) -> tuple[PyTree, WoodburyFisherState]:
    del params, extra_args
    state = jax.tree.map(jnp.asarray, state)  # e.g. restored as NumPy
    _check_updates(updates, state.window)
    out, window, light = _window_step(
      cfg,
      damping,
      updates,
      state.window,
      state._replace(window=()),
      state.count % max(cfg.size, 1),
      lambda s, k: s._replace(count=optax.safe_increment(s.count)),
      per_example_grads,
    )
    return out, light._replace(window=window)

  return optax.GradientTransformationExtraArgs(
    init_fn,
    update_fn,  # pyright: ignore[reportArgumentType]
  )


def scale_by_mfac(
  window_size: int = 1024,
  damping: float | jax.Array = 1e-5,
  *,
  fisher_source: str | None = None,
  window_dtype: Any | None = None,
  gradients: str | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Preconditions by the inverse empirical Fisher of a sliding window.

  Keeps the last ``m = window_size`` gradients ``g_1..g_m`` in a ring buffer
  with their Gram matrix, pushes the new gradient, and returns

  .. math::

    u = F^{-1} g, \\qquad
    F = \\lambda I + \\frac{1}{m} \\sum_{k=1}^m g_k g_k^\\top,

  through the Woodbury identity on the ``m x m`` Cholesky factor of
  ``G G^T + m \\lambda I``: the tree-wide configuration of
  :func:`scale_by_woodbury_fisher` with M-FAC's ``1/m``. A step costs
  ``O(d m)`` for the new Gram row, ``O(m^3)`` for the refactorization and
  ``O(d m + m^2)`` for the product; the state holds ``m d + m^2`` floats.

  Paper conventions kept on purpose: the window starts as ``m`` zero rows and
  always divides by ``m`` (while it fills, ``F`` averages the ``k < m``
  pushed gradients with ``m - k`` zeros), and the new gradient enters the
  window before the product. The paper updates its factors with a rank-one
  recursion (an un-pivoted LU on GPU); we refactor the cached Gram with a
  Cholesky, which gives the same ``F^{-1}`` and is numerically safer.

  Numerical floor (ours): the damping used is ``max(damping, eps *
  trace(G G^T))``, ``eps`` the machine epsilon of the statistics dtype,
  i.e. ``max(lambda, eps m mean |g|^2)``
  (:func:`fisher_optax.fisher.linalg.floored_damping`). On nearly
  dependent rows (correlated gradients) the Cholesky of ``G G^T + m lambda
  I`` has a condition number near ``trace(G G^T) / (m lambda)``: past
  ``1/eps`` it fails or the product of a gradient in the window's span is
  rounding noise, and the floor keeps it under ``1 / (m eps)``. The floor
  is active where the gradients are large next to ``lambda``: in float32
  at the paper's ``m = 1024``, ``lambda = 1e-5`` once the window's mean
  squared gradient norm passes about 0.08, and then the step outside the
  window's span is shorter than the paper's by the ratio of the two
  dampings (a float64 window under x64 has an ``eps`` 2^29 times smaller).

  Args:
    window_size: ``m``, a static int (it sets state shapes).
    damping: ``lambda > 0``; M-FAC's default is ``1e-5``. Mini-batch
      gradients are smaller than per-example ones, so ``lambda`` does not
      transfer 1:1 between the two sources.
    fisher_source: ``"batch"`` (default, the paper's optimizer) pushes the
      mini-batch gradient ``updates``; ``"per_example"`` pushes the ``b``
      rows of the ``per_example_grads`` extra (``b <= m``) and
      preconditions their mean ``updates``.
    window_dtype: dtype of the stored window (default float32, float64 for
      float64 params); bfloat16 halves its memory, and the gradient is
      then preconditioned as stored (rounded: its rounding error, outside
      the window, would be scaled by ``1 / damping``). The Gram and the
      solve are float32 (or wider) whatever the window's dtype.
    gradients: deprecated spelling of ``fisher_source`` (``"mean"`` meant
      ``"batch"``).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with state
    :class:`MFACState`. ``update`` takes the keyword extra
    ``per_example_grads`` (same tree as ``updates`` with a leading batch
    axis) when ``fisher_source="per_example"`` and ignores other extras.
    Non-finite steps follow the library's one policy
    (:func:`fisher_optax.fisher.numerics.skip_nonfinite_step`): a NaN or
    infinite gradient never enters the window, the state is unchanged but
    for ``notfinite_count`` and the updates are NaN; a finite gradient whose
    Gram overflows (1e30 entries) is skipped the same way with zero updates,
    and never reaches the Cholesky.

  Example::

    >>> import jax.numpy as jnp, optax, fisher_optax
    >>> tx = fisher_optax.scale_by_mfac(window_size=8, damping=1e-3)
    >>> params = {"w": jnp.ones((3,))}
    >>> state = tx.init(params)
    >>> u, state = tx.update({"w": jnp.array([1.0, 0.0, -1.0])}, state)
    >>> u["w"].shape, int(state.index)
    ((3,), 1)

  References:
    Frantar et al, `M-FAC: Efficient Matrix-Free Approximations of
    Second-Order Information <https://arxiv.org/abs/2107.03356>`_, 2021
  """
  source = validation.fisher_source_or_old_keyword(
    "scale_by_mfac", fisher_source, "gradients", gradients, _LEGACY_SOURCES
  )
  m = validation.check_static_int("window_size", window_size, minimum=1)
  validation.check_positive("damping", damping)
  cfg = _Window(
    size=m,
    block_diagonal=False,
    per_example=source == "per_example",
    mean=True,
    normalized=False,
    dtype=numerics.canonical_float_dtype("window_dtype", window_dtype),
    function="scale_by_mfac",
  )

  def init_fn(params: PyTree) -> MFACState:
    validation.check_real_floating(
      params, what="params", function="scale_by_mfac"
    )
    window, gram = _init_window(cfg, params)
    # Separate buffers, so the state can be donated (jit's donate_argnums).
    zero = lambda: jnp.zeros([], jnp.int32)
    return MFACState(zero(), zero(), window, gram, notfinite_count=zero())

  def update_fn(
    updates: PyTree,
    state: MFACState,
    params: PyTree | None = None,
    *,
    per_example_grads: PyTree | None = None,
    **extra_args: Any,
  ) -> tuple[PyTree, MFACState]:
    del params, extra_args
    state = jax.tree.map(jnp.asarray, state)  # e.g. restored as NumPy
    _check_updates(updates, state.grads)
    advance = lambda s, k: s._replace(
      count=optax.safe_increment(s.count), index=(s.index + k) % m
    )
    out, window, light = _window_step(
      cfg,
      damping,
      updates,
      state.grads,
      state._replace(grads=()),
      state.index,
      advance,
      per_example_grads,
    )
    return out, light._replace(grads=window)

  return optax.GradientTransformationExtraArgs(
    init_fn,
    update_fn,  # pyright: ignore[reportArgumentType]
  )


def mfac(
  learning_rate: optax.ScalarOrSchedule,
  window_size: int = 1024,
  damping: float | jax.Array = 1e-5,
  momentum: float | jax.Array | None = None,
  weight_decay: float | jax.Array = 0.0,
  mask: Any = None,
  *,
  fisher_source: str | None = None,
  window_dtype: Any | None = None,
  gradients: str | None = None,
) -> optax.GradientTransformationExtraArgs:
  """The M-FAC optimizer: SGD preconditioned by a windowed inverse Fisher.

  Follows the paper's reference optimizer step by step:

  .. math::

    g \\leftarrow \\nabla L + \\omega \\theta, \\quad
    u = F^{-1} g, \\quad v \\leftarrow \\beta v + (1 - \\beta) u, \\quad
    \\theta \\leftarrow \\theta - \\eta v,

  with ``F`` the damped empirical Fisher of the last ``window_size``
  gradients (see :func:`scale_by_mfac`). Unlike optax's ``adamw``, weight
  decay is added *before* the preconditioner, as in the paper, so the
  decayed gradient is what enters the window (with
  ``fisher_source="per_example"`` only the mean gradient is decayed).

  The learning rate does not carry over from Adam: the window and the
  damping set the step's size (with the paper's tiny damping, about ``lr *
  m / |g|`` along the newest gradient). On the digits MLP of ``benchmarks/alias_defaults.py``
  (400 steps, these defaults) the best lr was ``3e-4``, on par with AdamW at
  its best (test loss 0.064 against 0.060), while at AdamW's ``1e-3``
  M-FAC was unstable (0.24 +- 0.10): start about 3x below an Adam lr, or
  raise ``damping`` (``1e-2`` with ``window_size=32`` needed ``lr`` near
  ``0.1`` on the transformer of ``benchmarks/lm_wallclock.py``).

  Args:
    learning_rate: a float or an optax schedule (the paper uses ``1e-3``).
    window_size: ``m``, static; the paper's default is 1024.
    damping: ``lambda``; the paper's default is ``1e-5``.
    momentum: ``beta`` of the undebiased EMA of the preconditioned
      gradients, or ``None`` (the paper's default, ``beta = 0``) for none.
    weight_decay: ``omega``, added to the gradient before preconditioning.
    mask: which params get weight decay (a pytree of bools or a callable), as
      in ``optax.add_decayed_weights``.
    fisher_source: ``"batch"`` or ``"per_example"``, see
      :func:`scale_by_mfac`.
    window_dtype: dtype of the stored window, see :func:`scale_by_mfac`.
    gradients: deprecated spelling of ``fisher_source``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is the
    chain's (decay, :class:`MFACState`, momentum, learning rate). A step
    that M-FAC skips as non-finite leaves all of it unchanged but for
    ``notfinite_count``.

  Example: on a parabola, with the damping of the order of the squared
  gradient norms (the empirical Fisher of a deterministic gradient is not
  its Hessian, and a tiny damping makes steps of size ``lr * m / |g|``)::

    >>> import jax, jax.numpy as jnp, optax, fisher_optax
    >>> f = lambda p: jnp.sum(jnp.square(p - 1.0))
    >>> tx = fisher_optax.mfac(1.0, window_size=4, damping=1.0)
    >>> params = jnp.zeros(3)
    >>> state = tx.init(params)
    >>> @jax.jit
    ... def step(params, state):
    ...   u, state = tx.update(jax.grad(f)(params), state, params)
    ...   return optax.apply_updates(params, u), state
    >>> for _ in range(20):
    ...   params, state = step(params, state)
    >>> bool(f(params) < 1e-2)
    True

  References:
    Frantar et al, `M-FAC: Efficient Matrix-Free Approximations of
    Second-Order Information <https://arxiv.org/abs/2107.03356>`_, 2021
  """
  source = validation.fisher_source_or_old_keyword(
    "mfac", fisher_source, "gradients", gradients, _LEGACY_SOURCES
  )
  validation.check_learning_rate(learning_rate)
  validation.check_positive(
    "weight_decay", weight_decay, allow_zero=True, schedule=True
  )
  if momentum is not None:
    validation.check_in_unit_interval("momentum", momentum)
    ema = optax.ema(momentum, debias=False)
  else:
    ema = optax.identity()
  chain = optax.chain(
    optax.add_decayed_weights(weight_decay, mask),
    scale_by_mfac(
      window_size, damping, fisher_source=source, window_dtype=window_dtype
    ),
    ema,
    optax.scale_by_learning_rate(learning_rate),
  )

  return numerics.chain_following(chain, 1, check_params=True)
