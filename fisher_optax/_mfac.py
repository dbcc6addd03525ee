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
    count: number of updates so far (int32).
    window: ring buffer of the last ``history_size`` gradients, leaves
      ``(history_size, *shape)`` (zero-size leaves with per-example windows).
    gram: cached Gram matrix of the window in float32 (or wider): one
      ``(s, s)`` array per leaf when block-diagonal, else a single one.
  """

  count: jax.Array
  window: PyTree
  gram: PyTree


class MFACState(NamedTuple):
  """State of :func:`scale_by_mfac`.

  Attributes:
    count: number of ``update`` calls, int32.
    index: the ring-buffer slot the next gradient overwrites, int32.
    grads: the window ``G``, a tree shaped like the params with a leading axis
      ``window_size`` (oldest rows are overwritten first; starts at zero).
    gram: ``G G^T``, shape ``(window_size, window_size)``, kept in sync.
  """

  count: jax.Array
  index: jax.Array
  grads: PyTree
  gram: jax.Array


# -- the windowed Woodbury preconditioner --------------------------------------


class _Window(NamedTuple):
  """Static configuration of the windowed Woodbury preconditioner."""

  size: int  # rows kept; 0: per-example rows only, no memory
  block_diagonal: bool  # one window (and Gram) per leaf
  per_example: bool  # rows come from per_example_grads, not updates
  mean: bool  # F = lambda I + (1/size) G^T G (M-FAC), else no 1/size
  damping_floor: bool  # lambda >= eps * trace(G G^T) (M-FAC)
  normalized: bool  # return lambda F^{-1} g
  dtype: Any  # stored window dtype (None: compute dtype of the params)
  function: str  # the public name, for messages


def _init_window(cfg: _Window, params: PyTree) -> tuple[PyTree, PyTree]:
  """Zero window (leading axis ``cfg.size``) and its Gram."""
  wdtype = lambda p: (
    jnp.dtype(cfg.dtype) if cfg.dtype is not None else numerics.compute_dtype(p)
  )
  n = cfg.size
  window = jax.tree.map(
    lambda p: jnp.zeros((n, *jnp.shape(p)), wdtype(p)), params
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
  k = validation.check_per_example_grads(
    per_example_grads, updates, function=cfg.function
  )
  if cfg.size and k > cfg.size:
    raise ValueError(
      f"per_example_grads has {k} rows, more than window_size={cfg.size}."
    )
  return per_example_grads


def _push(
  cfg: _Window, window: PyTree, gram: PyTree, rows: PyTree, slot: jax.Array
) -> tuple[PyTree, PyTree, jax.Array]:
  """Pushes the rows unless one is non-finite (per leaf if block-diagonal).

  Returns:
    ``(window, gram, pushed)``; ``pushed`` is False when a row was NaN/Inf
    (for a block-diagonal window: in any leaf).
  """
  if not cfg.block_diagonal:
    return linalg.stacked_push_rows_if_finite(window, gram, rows, slot)
  leaves, treedef = jax.tree.flatten(window)
  pushed = [
    linalg.stacked_push_rows_if_finite(w, g, r, slot)
    for w, g, r in zip(
      leaves, treedef.flatten_up_to(gram), treedef.flatten_up_to(rows)
    )
  ]
  return (
    jax.tree.unflatten(treedef, [w for w, _, _ in pushed]),
    jax.tree.unflatten(treedef, [g for _, g, _ in pushed]),
    jnp.all(jnp.stack([ok for _, _, ok in pushed]))
    if pushed
    else jnp.asarray(True),
  )


def _window_solve(
  cfg: _Window, window: PyTree, gram: PyTree, g: PyTree, damping: Any
) -> PyTree:
  """``F^{-1} g`` for the (pushed) window, per leaf if block-diagonal."""
  scale = 1.0 / cfg.size if cfg.mean else 1.0
  solve = lambda w, gr, x: linalg.woodbury_window_solve(
    w,
    gr,
    x,
    _floored_damping(gr, damping) if cfg.damping_floor else damping,
    scale=scale,
    normalized=cfg.normalized,
  )
  if cfg.block_diagonal:
    return jax.tree.map(solve, window, gram, g)
  return solve(window, gram, g)


def _floored_damping(gram: jax.Array, damping: Any) -> jax.Array:
  # In float32 the Cholesky of a nearly rank-deficient Gram fails once
  # m * lambda is below rounding; this floor is inactive otherwise.
  lam = jnp.asarray(damping, gram.dtype)
  return jnp.maximum(lam, jnp.finfo(gram.dtype).eps * jnp.trace(gram))


def _window_step(
  cfg: _Window,
  damping: Any,
  updates: PyTree,
  window: PyTree,
  gram: PyTree,
  slot: jax.Array,
  per_example_grads: PyTree | None,
) -> tuple[PyTree, PyTree, PyTree, jax.Array, int]:
  """One step: push this step's rows, then precondition ``updates``.

  Returns:
    ``(updates, window, gram, pushed, k)`` with ``k`` the rows pushed.
  """
  validation.check_same_structure(updates, window, what="state.window")
  rows = _new_rows(cfg, updates, per_example_grads)
  if cfg.size == 0:  # this batch's per-example gradients are the window
    if cfg.block_diagonal:
      out = jax.tree.map(
        lambda h, g: linalg.woodbury_rows_solve(
          h, g, damping, normalized=cfg.normalized
        ),
        rows,
        updates,
      )
    else:
      out = linalg.woodbury_rows_solve(
        rows, updates, damping, normalized=cfg.normalized
      )
    return out, window, gram, jnp.asarray(True), 0
  window, gram, pushed = _push(cfg, window, gram, rows, slot)
  k = jax.tree.leaves(rows)[0].shape[0] if jax.tree.leaves(rows) else 1
  return (
    _window_solve(cfg, window, gram, updates, damping),
    window,
    gram,
    pushed,
    k,
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
    damping: :math:`\lambda > 0`; may be injected.
    normalize_output: return :math:`\lambda F^{-1} g` (which is ``g`` on
      directions the window has not seen) instead of :math:`F^{-1} g`.
    block_diagonal: one window solve per leaf (default) or one for the tree.
    fisher_source: ``"batch"`` (default: a window of past mini-batch
      gradients ``updates``) or ``"per_example"`` (this batch's
      ``per_example_grads``).
    window_dtype: dtype of the stored window (default float32, float64 for
      float64 params); bfloat16 halves its memory. The Gram is float32+.
    window_source: deprecated spelling of ``fisher_source`` (``"history"``
      meant ``"batch"``).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with state
    :class:`WoodburyFisherState`.

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
  # Nested so that both deprecation warnings point at the caller's line.
  source = validation.check_fisher_source(
    validation.renamed_keyword(
      "scale_by_woodbury_fisher",
      "window_source",
      window_source,
      "fisher_source",
      fisher_source,
      value_map=_LEGACY_SOURCES,
    )
    or "batch",
    function="scale_by_woodbury_fisher",
    legacy=_LEGACY_SOURCES,
  )
  per_example = source == "per_example"
  s = validation.check_static_int(
    "history_size", history_size, minimum=0 if per_example else 1
  )
  validation.check_positive("damping", damping)
  cfg = _Window(
    size=0 if per_example else s,
    block_diagonal=block_diagonal,
    per_example=per_example,
    mean=False,
    damping_floor=False,
    normalized=normalize_output,
    dtype=window_dtype,
    function="scale_by_woodbury_fisher",
  )

  def init_fn(params: PyTree) -> WoodburyFisherState:
    window, gram = _init_window(cfg, params)
    return WoodburyFisherState(jnp.zeros([], jnp.int32), window, gram)

  def update_fn(
    updates: PyTree,
    state: WoodburyFisherState,
    params: PyTree | None = None,
    *,
    per_example_grads: PyTree | None = None,
    **extra_args: Any,
  ) -> tuple[PyTree, WoodburyFisherState]:
    del params, extra_args
    slot = state.count % max(cfg.size, 1)
    out, window, gram, _, _ = _window_step(
      cfg, damping, updates, state.window, state.gram, slot, per_example_grads
    )
    count = jnp.asarray(optax.safe_increment(state.count))
    return out, WoodburyFisherState(count, window, gram)

  return optax.GradientTransformationExtraArgs(
    init_fn,
    update_fn,  # pyright: ignore[reportArgumentType]
  )


def scale_by_mfac(
  window_size: int = 1024,
  damping: float | jax.Array = 1e-5,
  *,
  fisher_source: str | None = None,
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

  Numerical floor (ours): in float32 a Cholesky of a nearly rank-deficient
  Gram fails once ``m lambda`` is below rounding, so the damping used is
  ``max(damping, eps * trace(G G^T))`` with ``eps`` the machine epsilon of
  the statistics dtype; it is inactive unless ``lambda`` is tiny relative to
  the squared gradient norms.

  Args:
    window_size: ``m``, a static int (it sets state shapes).
    damping: ``lambda > 0``; M-FAC's default is ``1e-5``. Mini-batch
      gradients are smaller than per-example ones, so ``lambda`` does not
      transfer 1:1 between the two sources.
    fisher_source: ``"batch"`` (default, the paper's optimizer) pushes the
      mini-batch gradient ``updates``; ``"per_example"`` pushes the ``b``
      rows of the ``per_example_grads`` extra (``b <= m``) and
      preconditions their mean ``updates``.
    gradients: deprecated spelling of ``fisher_source`` (``"mean"`` meant
      ``"batch"``).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with state
    :class:`MFACState`. ``update`` takes the keyword extra
    ``per_example_grads`` (same tree as ``updates`` with a leading batch
    axis) when ``fisher_source="per_example"`` and ignores other extras.
    Non-finite gradients are not pushed (the window and its write index are
    unchanged).

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
  # Nested so that both deprecation warnings point at the caller's line.
  source = validation.check_fisher_source(
    validation.renamed_keyword(
      "scale_by_mfac",
      "gradients",
      gradients,
      "fisher_source",
      fisher_source,
      value_map=_LEGACY_SOURCES,
    )
    or "batch",
    function="scale_by_mfac",
    legacy=_LEGACY_SOURCES,
  )
  m = validation.check_static_int("window_size", window_size, minimum=1)
  validation.check_positive("damping", damping)
  cfg = _Window(
    size=m,
    block_diagonal=False,
    per_example=source == "per_example",
    mean=True,
    damping_floor=True,
    normalized=False,
    dtype=None,
    function="scale_by_mfac",
  )

  def init_fn(params: PyTree) -> MFACState:
    window, gram = _init_window(cfg, params)
    zero = jnp.zeros([], jnp.int32)
    return MFACState(count=zero, index=zero, grads=window, gram=gram)

  def update_fn(
    updates: PyTree,
    state: MFACState,
    params: PyTree | None = None,
    *,
    per_example_grads: PyTree | None = None,
    **extra_args: Any,
  ) -> tuple[PyTree, MFACState]:
    del params, extra_args
    out, window, gram, pushed, k = _window_step(
      cfg,
      damping,
      updates,
      state.grads,
      state.gram,
      state.index,
      per_example_grads,
    )
    # A non-finite push leaves the window and the write index unchanged.
    index = jnp.where(pushed, (state.index + k) % m, state.index)
    return out, MFACState(
      count=jnp.asarray(optax.safe_increment(state.count)),
      index=index,
      grads=window,
      gram=gram,
    )

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
    gradients: deprecated spelling of ``fisher_source``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`.

  Example: on a parabola, with the damping of the order of the squared
  gradient norms (the empirical Fisher of a deterministic gradient is not
  its Hessian, and a tiny damping makes steps of size ``lr * m / |g|``)::

    >>> import jax, jax.numpy as jnp, optax, fisher_optax
    >>> f = lambda p: jnp.sum(jnp.square(p - 1.0))
    >>> tx = fisher_optax.mfac(1.0, window_size=4, damping=1.0)
    >>> params = jnp.zeros(3)
    >>> state = tx.init(params)
    >>> for _ in range(20):
    ...   u, state = tx.update(jax.grad(f)(params), state, params)
    ...   params = optax.apply_updates(params, u)
    >>> bool(f(params) < 1e-2)
    True

  References:
    Frantar et al, `M-FAC: Efficient Matrix-Free Approximations of
    Second-Order Information <https://arxiv.org/abs/2107.03356>`_, 2021
  """
  # Nested so that both deprecation warnings point at the caller's line.
  source = validation.check_fisher_source(
    validation.renamed_keyword(
      "mfac",
      "gradients",
      gradients,
      "fisher_source",
      fisher_source,
      value_map=_LEGACY_SOURCES,
    )
    or "batch",
    function="mfac",
    legacy=_LEGACY_SOURCES,
  )
  validation.check_learning_rate(learning_rate)
  validation.check_positive("weight_decay", weight_decay, allow_zero=True)
  if momentum is not None:
    validation.check_in_unit_interval("momentum", momentum)
    ema = optax.ema(momentum, debias=False)
  else:
    ema = optax.identity()
  return optax.chain(
    optax.add_decayed_weights(weight_decay, mask),
    scale_by_mfac(window_size, damping, fisher_source=source),
    ema,
    optax.scale_by_learning_rate(learning_rate),
  )
