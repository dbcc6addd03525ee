# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""M-FAC: sliding-window inverse empirical Fisher preconditioning."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fisher_optax.fisher import linalg
from fisher_optax.fisher import validation

PyTree = Any
_GRADIENT_SOURCES = ("mean", "per_example")


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


def _stats_dtype(dtype: Any) -> Any:
  # Statistics in float32, or float64 for float64 params.
  return jnp.promote_types(dtype, jnp.float32)


def scale_by_mfac(
  window_size: int = 1024,
  damping: float | jax.Array = 1e-5,
  *,
  gradients: str = "mean",
) -> optax.GradientTransformationExtraArgs:
  """Preconditions by the inverse empirical Fisher of a sliding window.

  Keeps the last ``m = window_size`` gradients ``g_1..g_m`` in a ring buffer
  with their Gram matrix, pushes the new gradient, and returns

  .. math::

    u = F^{-1} g, \\qquad
    F = \\lambda I + \\frac{1}{m} \\sum_{k=1}^m g_k g_k^\\top,

  through the Woodbury identity on the ``m x m`` Cholesky factor of
  ``G G^T + m \\lambda I``. A step costs ``O(d m)`` for the new Gram row,
  ``O(m^3)`` for the refactorization and ``O(d m + m^2)`` for the product;
  the state holds ``m d + m^2`` floats.

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
      transfer 1:1 between the two ``gradients`` modes.
    gradients: ``"mean"`` (default, the paper's optimizer) pushes the
      mini-batch gradient ``updates``; ``"per_example"`` pushes the ``b``
      rows of the ``per_example_grads`` extra (``b <= m``) and
      preconditions their mean ``updates``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`. ``update`` takes the
    keyword extra ``per_example_grads`` (same tree as ``updates`` with a
    leading batch axis) when ``gradients="per_example"`` and ignores other
    extras. Non-finite gradients are not pushed (the window is unchanged).

  Example::

    >>> import jax.numpy as jnp, optax, fisher_optax
    >>> tx = fisher_optax.scale_by_mfac(window_size=8, damping=1e-3)
    >>> params = {"w": jnp.ones((3,))}
    >>> state = tx.init(params)
    >>> u, state = tx.update({"w": jnp.array([1.0, 0.0, -1.0])}, state)
    >>> u["w"].shape
    (3,)

  References:
    Frantar et al, `M-FAC: Efficient Matrix-Free Approximations of
    Second-Order Information <https://arxiv.org/abs/2107.03356>`_, 2021
  """
  m = validation.check_static_int("window_size", window_size, minimum=1)
  validation.check_positive("damping", damping)
  validation.check_choice("gradients", gradients, _GRADIENT_SOURCES)
  per_example = gradients == "per_example"

  def init_fn(params: PyTree) -> MFACState:
    window = jax.tree.map(
      lambda p: jnp.zeros((m, *jnp.shape(p)), _stats_dtype(p.dtype)), params
    )
    leaves = jax.tree.leaves(window)
    gram_dtype = jnp.result_type(*leaves) if leaves else jnp.float32
    return MFACState(
      count=jnp.zeros([], jnp.int32),
      index=jnp.zeros([], jnp.int32),
      grads=window,
      gram=jnp.zeros((m, m), gram_dtype),
    )

  def update_fn(
    updates: PyTree,
    state: MFACState,
    params: PyTree | None = None,
    *,
    per_example_grads: PyTree | None = None,
    **extra_args: Any,
  ) -> tuple[PyTree, MFACState]:
    del params, extra_args
    validation.check_same_structure(
      updates, state.grads, what="the M-FAC window (state.grads)"
    )
    if per_example:
      if per_example_grads is None:
        raise ValueError(
          'scale_by_mfac(gradients="per_example") needs the keyword extra '
          "per_example_grads in update()."
        )
      k = validation.check_leading_axis(
        per_example_grads, updates, what="per_example_grads"
      )
      if k > m:
        raise ValueError(
          f"per_example_grads has {k} rows, more than window_size={m}."
        )
      rows = per_example_grads
    else:
      k = 1
      rows = jax.tree.map(lambda g: g[None], updates)
    # A non-finite push leaves the window (and the write index) unchanged.
    window, gram, pushed = linalg.stacked_push_rows_if_finite(
      state.grads, state.gram, rows, state.index
    )
    index = jnp.where(pushed, (state.index + k) % m, state.index)

    lam = jnp.asarray(damping, gram.dtype)
    lam = jnp.maximum(lam, jnp.finfo(gram.dtype).eps * jnp.trace(gram))
    factor = linalg.woodbury_factor(gram, lam, 1.0 / m)
    g = jax.tree.map(lambda u, s: u.astype(s.dtype), updates, window)
    if jax.tree.leaves(g):
      precond = linalg.woodbury_solve(window, factor, g)
    else:
      precond = g
    new_updates = jax.tree.map(lambda p, u: p.astype(u.dtype), precond, updates)
    return new_updates, MFACState(
      count=optax.safe_increment(state.count),
      index=index,
      grads=window,
      gram=gram,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def mfac(
  learning_rate: optax.ScalarOrSchedule,
  window_size: int = 1024,
  damping: float | jax.Array = 1e-5,
  momentum: float | jax.Array | None = None,
  weight_decay: float | jax.Array = 0.0,
  mask: Any = None,
  *,
  gradients: str = "mean",
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
  ``gradients="per_example"`` only the mean gradient is decayed).

  Args:
    learning_rate: a float or an optax schedule (the paper uses ``1e-3``).
    window_size: ``m``, static; the paper's default is 1024.
    damping: ``lambda``; the paper's default is ``1e-5``.
    momentum: ``beta`` of the undebiased EMA of the preconditioned
      gradients, or ``None`` (the paper's default, ``beta = 0``) for none.
    weight_decay: ``omega``, added to the gradient before preconditioning.
    mask: which params get weight decay (a pytree of bools or a callable), as
      in ``optax.add_decayed_weights``.
    gradients: ``"mean"`` or ``"per_example"``, see :func:`scale_by_mfac`.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`.

  Example::

    >>> import jax, jax.numpy as jnp, optax, fisher_optax
    >>> f = lambda p: jnp.sum(jnp.square(p - 1.0))
    >>> tx = fisher_optax.mfac(0.1, window_size=4, damping=1e-2)
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
  validation.check_learning_rate(learning_rate)
  validation.check_positive("weight_decay", weight_decay, allow_zero=True)
  if momentum is not None:
    validation.check_in_unit_interval("momentum", momentum)
    ema = optax.ema(momentum, debias=False)
  else:
    ema = optax.identity()
  return optax.chain(
    optax.add_decayed_weights(weight_decay, mask),
    scale_by_mfac(window_size, damping, gradients=gradients),
    ema,
    optax.scale_by_learning_rate(learning_rate),
  )
