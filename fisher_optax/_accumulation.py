# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Gradient accumulation whose diagonal Fisher sees every micro-batch.

``optax.MultiSteps`` calls the inner ``update`` on every micro-batch but keeps
the inner state only when it emits, so a transform that reads per-example
gradients sees only the *last* micro-batch's extras. :func:`accumulate_fisher`
folds every micro-batch's per-example gradients into a running diagonal
Fisher and hands the inner transform the whole accumulation's statistic.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fisher_optax import fisher
from fisher_optax.fisher import numerics
from fisher_optax.fisher import validation

PyTree = Any


class AccumulateFisherState(NamedTuple):
  """State of :func:`accumulate_fisher`.

  Attributes:
    mini_step: micro-batches seen since the last emit (int32).
    grad_sum: running sum of the per-example gradients (each micro-batch's
      mean times its size).
    sq_sum: running sum of squared per-example gradients.
    count: examples accumulated.
    inner_state: the wrapped transform's state.
    notfinite_count: int32 number of micro-batches skipped as non-finite (as
      in :func:`optax.apply_if_finite`'s state).
  """

  mini_step: jax.Array
  grad_sum: PyTree
  sq_sum: PyTree
  count: jax.Array
  inner_state: Any
  notfinite_count: jax.Array


def _zeros_wide(tree: PyTree) -> PyTree:
  # At least float32, so that bfloat16 models do not accumulate in bfloat16;
  # float64 for float64 params (x64).
  return jax.tree.map(
    lambda p: numerics.zeros_like_stacked(p, dtype=numerics.compute_dtype(p)),
    tree,
  )


def _fresh_state(
  like: PyTree, inner_state: Any, notfinite_count: jax.Array
) -> AccumulateFisherState:
  return AccumulateFisherState(
    mini_step=jnp.zeros([], jnp.int32),
    grad_sum=_zeros_wide(like),
    sq_sum=_zeros_wide(like),
    count=jnp.zeros([], jnp.int32),
    inner_state=inner_state,
    notfinite_count=notfinite_count,
  )


def _fold(
  state: AccumulateFisherState,
  updates: PyTree,
  per_example_grads: PyTree,
  batch: int,
) -> AccumulateFisherState:
  """Adds one micro-batch: its gradient sum (mean times size) and its
  squared per-example gradients."""
  grad_sum = jax.tree.map(
    lambda s, g: s + g.astype(s.dtype) * batch, state.grad_sum, updates
  )
  sq_sum = jax.tree.map(
    lambda s, g: s + jnp.sum(jnp.square(g.astype(s.dtype)), axis=0),
    state.sq_sum,
    per_example_grads,
  )
  return state._replace(
    mini_step=state.mini_step + 1,
    grad_sum=grad_sum,
    sq_sum=sq_sum,
    count=state.count + batch,
  )


def _statistic(state: AccumulateFisherState):
  """The empirical diagonal Fisher over every accumulated example."""
  return fisher.DiagonalFisher(
    diag=jax.tree.map(lambda s: s / state.count, state.sq_sum),
    mean_grad=jax.tree.map(lambda s: s / state.count, state.grad_sum),
    count=state.count,
    kind="empirical",
  )


def accumulate_fisher(
  inner: optax.GradientTransformation, every_k: int
) -> optax.GradientTransformationExtraArgs:
  """Gradient accumulation whose diagonal Fisher sees every micro-batch.

  Like ``optax.MultiSteps(inner, every_k)``: updates are zero on the first
  ``every_k - 1`` micro-batches, and on the ``every_k``-th the inner transform
  runs once on the mean gradient over every example (MultiSteps' mean of
  the micro-batch means when they have equal sizes; micro-batches of
  different sizes weigh by their sizes, as the Fisher does). In addition, every micro-batch's
  ``per_example_grads`` extra (required) is folded into running sums, and the
  inner transform receives ``fisher=`` a
  :class:`fisher_optax.fisher.DiagonalFisher` of kind ``"empirical"`` over all
  ``every_k * B`` examples. Per-example gradients are never stored across
  micro-batches, so memory is ``2P`` on top of the inner state.

  A micro-batch whose gradients or per-example gradients are non-finite, or
  whose squares overflow the running sums, follows the library's one
  non-finite policy (:func:`fisher_optax.fisher.numerics.skip_nonfinite_step`):
  it is not folded in (the state, ``mini_step`` included, is unchanged but for
  ``notfinite_count``) and its updates are NaN when its gradient is not
  finite, else zero (non-finite per-example gradients only, or an
  overflow).

  With plain ``optax.MultiSteps`` the inner transform would see only the last
  micro-batch's ``per_example_grads`` (a ``1/every_k`` sample of the data).

  Args:
    inner: a transform that accepts a ``fisher=`` DiagonalFisher extra (e.g.
      ``fisher_optax.fadam(..., fisher_source="per_example")``).
    every_k: micro-batches per update (static int >= 1).

  Returns:
    A ``GradientTransformationExtraArgs``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fisher_optax
    >>> tx = fisher_optax.accumulate_fisher(
    ...     fisher_optax.fadam(0.1, fisher_source="per_example"), every_k=2)
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> pex = {"w": jnp.arange(12.0).reshape(4, 3)}  # 4 examples
    >>> grads = jax.tree.map(lambda g: g.mean(0), pex)
    >>> u, state = tx.update(grads, state, params, per_example_grads=pex)
    >>> print(u["w"])  # accumulating: no step yet
    [0. 0. 0.]
    >>> u, state = tx.update(grads, state, params, per_example_grads=pex)
    >>> bool(jnp.all(u["w"] < 0)), int(state.mini_step)
    (True, 0)
  """
  every_k = validation.check_static_int("every_k", every_k, minimum=1)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    validation.check_real_floating(
      params, what="params", function="accumulate_fisher"
    )
    return _fresh_state(params, inner.init(params), jnp.zeros([], jnp.int32))

  def update_fn(
    updates, state, params=None, *, per_example_grads=None, **extra_args
  ):
    if per_example_grads is None:
      raise ValueError(
        "accumulate_fisher needs a per_example_grads= extra on "
        "every micro-batch."
      )
    validation.check_like(updates, state.grad_sum, what="updates")
    per_example_grads, batch = numerics.checked_per_example_grads(
      per_example_grads, updates, function="accumulate_fisher"
    )
    step = lambda: _accumulate(
      inner,
      every_k,
      updates,
      state,
      params,
      per_example_grads,
      batch,
      extra_args,
    )
    return numerics.skip_nonfinite_step(
      step, updates, state, inputs=per_example_grads
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _accumulate(
  inner: optax.GradientTransformationExtraArgs,
  every_k: int,
  updates: PyTree,
  state: AccumulateFisherState,
  params: PyTree,
  per_example_grads: PyTree,
  batch: int,
  extra_args: dict[str, Any],
) -> tuple[PyTree, AccumulateFisherState]:
  """Folds one (finite) micro-batch in; runs ``inner`` on the ``every_k``-th."""
  state = _fold(state, updates, per_example_grads, batch)

  def emit(state):
    stat = _statistic(state)
    mean_grad = jax.tree.map(
      lambda m, u: m.astype(u.dtype), stat.mean_grad, updates
    )
    new_updates, inner_state = inner.update(
      mean_grad, state.inner_state, params, fisher=stat, **extra_args
    )
    # Float32 hyperparameters over bfloat16 params promote both.
    new_updates = numerics.keep_types(new_updates, updates)
    inner_state = numerics.keep_types(inner_state, state.inner_state)
    return new_updates, _fresh_state(
      state.grad_sum, inner_state, state.notfinite_count
    )

  def skip(state):
    return jax.tree.map(jnp.zeros_like, updates), state

  # Emitting would reset the sums: a micro-batch that overflowed them is
  # left in, for the policy to see and skip (the window is kept).
  ready = (state.mini_step >= every_k) & numerics.tree_all_finite(
    (state.grad_sum, state.sq_sum)
  )
  return jax.lax.cond(ready, emit, skip, state)
