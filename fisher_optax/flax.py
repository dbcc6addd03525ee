# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Flax adapters: use fisher_optax from NNX and Linen with no glue code.

Needs flax (``pip install 'fisher_optax[flax]'``). Import it explicitly::

  import fisher_optax.flax as fo_flax

**NNX.** ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` hands ``tx.update`` pure
``nnx.State`` trees restricted to ``wrt``, and forwards extra keyword
arguments. The adapters here produce extras with exactly that structure:

* :func:`nnx_per_example_grads` — per-example gradients of a model, stacked on
  a leading batch axis, with the same tree as ``nnx.grad``'s gradients;
* :func:`nnx_obj_fn` — an ``obj_fn(params)`` closure for transforms that
  re-evaluate the loss (Sophia-style ``obj_fn`` extras) while the optimizer
  sees ``nnx.State``;
* :func:`nnx_apply_fn` — ``(apply_fn, params)`` for the Fisher estimators of
  :mod:`fisher_optax.fisher`, with ``params`` in the optimizer's tree;
* :func:`nnx_mask` — a boolean mask tree built from an NNX filter, for
  ``optax.masked`` and the ``*_mask`` arguments (a plain dict mask does not
  match an ``nnx.State``).

**Linen.** ``flax.training.train_state.TrainState.apply_gradients`` never
forwards extra arguments to ``tx.update``. :func:`apply_gradients` and the
:class:`TrainState` subclass do.

**Gradient accumulation.** :func:`fisher_optax.accumulate_fisher` (which
needs no Flax) is re-exported here as ``accumulate_fisher``: it makes a
diagonal Fisher estimate see every micro-batch, where ``optax.MultiSteps``
hands the inner transform only the last micro-batch's extras.

Example (NNX):

  >>> import jax.numpy as jnp, optax, fisher_optax
  >>> from flax import nnx
  >>> import fisher_optax.flax as fo_flax
  >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  >>> tx = fisher_optax.fadam(1e-3, fisher_source="per_example")
  >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  >>> x, y = jnp.ones((4, 3)), jnp.array([0, 1, 0, 1])
  >>> ce = optax.softmax_cross_entropy_with_integer_labels
  >>> grads = nnx.grad(lambda m: ce(m(x), y).mean())(model)
  >>> pex = fo_flax.nnx_per_example_grads(
  ...     lambda m, ex: ce(m(ex[0]), ex[1]), model, (x, y))
  >>> pex["kernel"].shape  # one gradient per example, in the optimizer's tree
  (4, 3, 2)
  >>> _ = optimizer.update(model, grads, per_example_grads=pex)
  >>> int(optimizer.step[...])
  1
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax
from flax import nnx
from flax.training import train_state
import jax
import jax.numpy as jnp
import optax

from fisher_optax import fisher

# Re-exported: the same objects as fisher_optax.accumulate_fisher & co.
from fisher_optax._accumulation import AccumulateFisherState
from fisher_optax._accumulation import accumulate_fisher

PyTree = Any
Filter = Any

__all__ = [
  "AccumulateFisherState",
  "TrainState",
  "accumulate_fisher",
  "apply_gradients",
  "nnx_apply_fn",
  "nnx_mask",
  "nnx_obj_fn",
  "nnx_per_example_grads",
]


# -- NNX --------------------------------------------------------------------


def _split(model: nnx.Module, wrt: Filter):
  graphdef, params, rest = nnx.split(model, wrt, ...)
  return graphdef, params, rest


def nnx_per_example_grads(
  loss_fn: Callable[[nnx.Module, Any], jax.Array],
  model: nnx.Module,
  batch: PyTree,
  *,
  wrt: Filter = nnx.Param,
  chunk_size: int | None = None,
) -> nnx.State:
  """Per-example gradients of an NNX model, in the optimizer's tree.

  Args:
    loss_fn: ``loss_fn(model, example) -> scalar`` for ONE example (the batch
      pytree without its leading axis). Add the batch axis back inside if the
      model needs it, e.g. ``model(x[None])``.
    model: the NNX module; it is not modified.
    batch: a pytree of arrays sharing a leading batch axis.
    wrt: the filter of the parameters, the same as ``nnx.Optimizer``'s.
    chunk_size: examples per chunk (peak memory grows with the chunk, not the
      batch); ``None`` is one vmap over the batch.

  Returns:
    An ``nnx.State`` with the structure ``nnx.Optimizer.update`` gives to
    ``tx.update`` as gradients, every leaf with a leading batch axis.
  """
  graphdef, params, rest = _split(model, wrt)
  pure_params = nnx.as_pure(params)

  def pure_loss(p, example):
    return loss_fn(nnx.merge(graphdef, p, rest), example)

  return fisher.per_example_grads(
    pure_loss, pure_params, batch, chunk_size=chunk_size
  )


def nnx_obj_fn(
  loss_fn: Callable[..., jax.Array],
  model: nnx.Module,
  *args: Any,
  wrt: Filter = nnx.Param,
  **kwargs: Any,
) -> Callable[[PyTree], jax.Array]:
  """Returns ``obj_fn(params) = loss_fn(model_with(params), *args, **kwargs)``.

  ``params`` is the pure state ``nnx.Optimizer`` passes to ``tx.update`` (not
  the module), so the closure works as an ``obj_fn=`` extra.
  """
  graphdef, _, rest = _split(model, wrt)

  def obj_fn(params: PyTree) -> jax.Array:
    return loss_fn(nnx.merge(graphdef, params, rest), *args, **kwargs)

  return obj_fn


def nnx_apply_fn(
  model: nnx.Module, *, wrt: Filter = nnx.Param
) -> tuple[Callable[[PyTree, Any], Any], PyTree]:
  """``(apply_fn, params)`` for the estimators of :mod:`fisher_optax.fisher`.

  ``apply_fn(params, inputs)`` merges ``params`` back into the model and calls
  it; ``params`` is the model's pure ``wrt`` state (the optimizer's tree), so
  statistics computed from it plug straight into ``optimizer.update(...,
  fisher=...)``.
  """
  graphdef, params, rest = _split(model, wrt)

  def apply_fn(p: PyTree, inputs: Any) -> Any:
    return nnx.merge(graphdef, p, rest)(inputs)

  return apply_fn, nnx.as_pure(params)


def nnx_mask(
  model: nnx.Module, select: Filter, *, wrt: Filter = nnx.Param
) -> PyTree:
  """A boolean tree over the model's ``wrt`` state: True where ``select`` matches.

  Use it wherever optax takes a mask (``optax.masked``, ``weight_decay_mask``)
  with ``nnx.Optimizer``; e.g. ``nnx_mask(model, nnx.PathContains("kernel"))``
  decays kernels only.

  Example:
    >>> from flax import nnx
    >>> import fisher_optax.flax as fo_flax
    >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    >>> mask = fo_flax.nnx_mask(model, nnx.PathContains("kernel"))
    >>> mask["kernel"], mask["bias"]
    (True, False)
  """
  predicate = nnx.filterlib.to_predicate(select)
  _, params, _ = _split(model, wrt)
  flat = nnx.to_flat_state(params)
  masked = [(path, predicate(path, var)) for path, var in flat]
  bool_state = nnx.from_flat_state(
    [(path, jnp.asarray(flag)) for path, flag in masked]
  )
  # Python bools, so optax.masked sees static leaves.
  return jax.tree.map(lambda x: bool(x), nnx.as_pure(bool_state))


# -- Linen ------------------------------------------------------------------


def apply_gradients(
  state: train_state.TrainState, grads: PyTree, **tx_kwargs: Any
) -> train_state.TrainState:
  """``state.apply_gradients(grads=grads)`` that forwards ``tx_kwargs`` to tx.

  Args:
    state: a Linen ``TrainState`` (or subclass).
    grads: gradients with the structure of ``state.params``.
    **tx_kwargs: extra arguments for ``tx.update``, e.g.
      ``per_example_grads=...`` or ``fisher=...``.

  Returns:
    The new state with ``step + 1``, updated ``params`` and ``opt_state``.
  """
  updates, opt_state = state.tx.update(
    grads, state.opt_state, state.params, **tx_kwargs
  )
  params = optax.apply_updates(state.params, updates)
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state)


class TrainState(train_state.TrainState):
  """A Linen ``TrainState`` whose ``apply_gradients`` forwards tx extras.

  ``state.apply_gradients(grads=g, tx_kwargs={"per_example_grads": pex})``;
  other keyword arguments replace dataclass fields, as in flax.
  """

  def apply_gradients(
    self, *, grads, tx_kwargs: dict[str, Any] | None = None, **kwargs
  ):
    new = apply_gradients(self, grads, **(tx_kwargs or {}))
    return new.replace(**kwargs) if kwargs else new


del flax
