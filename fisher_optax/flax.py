# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Flax adapters: use fisher_optax from NNX and Linen with no glue code.

Needs flax (``pip install 'fisher_optax[flax]'``). Import it explicitly::

  import fisher_optax.flax as fo_flax

**NNX.** ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` hands ``tx.update`` pure
``nnx.State`` trees restricted to ``wrt``, and forwards extra keyword
arguments. The adapters here produce extras with exactly that structure:

* :func:`nnx_per_example_grads` — per-example gradients of a model, stacked on
  a leading batch axis, in the pure tree ``tx.update`` receives (``nnx.grad``
  returns the same paths with ``Param`` leaves);
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

**A named piece of a transform's state.** :func:`get_state` reads and
:func:`replace_state` replaces a piece of a state by its name (the EWC anchor
``ewc_anchor``, PhysGuard's ``protected_subspace``, an estimator transform's
``diag``, Natural GaLore's ``projector``, ...) the same way for a plain
``opt_state``, a Linen ``TrainState`` and an ``nnx.Optimizer``. The NNX
optimizer state holds variables, not arrays: ``optax.tree.set`` on it puts
arrays where the optimizer expects variables and its next ``update`` fails,
while :func:`replace_state` writes the new values into the variables in place
(same shapes and dtypes, so a jitted step does not retrace).

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
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
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
  "get_state",
  "nnx_apply_fn",
  "nnx_mask",
  "nnx_obj_fn",
  "nnx_per_example_grads",
  "replace_state",
]


# -- NNX --------------------------------------------------------------------


def _split(model: nnx.Module, wrt: Filter):
  """``(graphdef, params, rest)``, ``rest`` as arrays: the module merged from
  them inside a trace (``jax.grad``, ``jit``, an estimator) may update its
  own random streams and statistics, which the live model's variables may
  not be from another trace level; the model is left as it is."""
  graphdef, params, rest = nnx.split(model, wrt, ...)
  return graphdef, params, nnx.as_pure(rest)


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

  Random streams (``nnx.Rngs``, e.g. for dropout) are read, never advanced:
  example ``n`` of the batch draws from the model's current keys with ``n``
  folded in, so every example has its own dropout mask, the same whatever
  ``chunk_size`` and however often it is called. The masks change when the
  model's streams advance (e.g. in the step's ``nnx.grad`` call). Other
  mutable state (batch statistics) is read, and its updates are discarded.

  Returns:
    An ``nnx.State`` with the structure ``nnx.Optimizer.update`` gives to
    ``tx.update`` as gradients, every leaf with a leading batch axis.
  """
  graphdef, params, keys, rest = nnx.split(model, wrt, nnx.RngKey, ...)
  # Merged from arrays inside the trace: the module built for each example
  # may update its own streams and statistics (a captured variable may not).
  pure_params, keys, rest = nnx.as_pure((params, keys, rest))
  sizes = {jnp.shape(x)[0] for x in jax.tree.leaves(batch)}
  if len(sizes) != 1:
    raise ValueError(
      "batch must be a non-empty pytree of arrays sharing a leading batch "
      f"axis, got leading sizes {sorted(sizes)}."
    )

  def pure_loss(p, indexed):
    index, example = indexed
    own_keys = jax.tree.map(lambda k: jax.random.fold_in(k, index), keys)
    return loss_fn(nnx.merge(graphdef, p, own_keys, rest), example)

  indices = jnp.arange(sizes.pop(), dtype=jnp.uint32)
  return fisher.per_example_grads(
    pure_loss, pure_params, (indices, batch), chunk_size=chunk_size
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
  the module), so the closure works as an ``obj_fn=`` extra. It works under
  ``jax.grad`` and ``jit`` whatever mutable state the model holds: random
  streams (dropout) are read at their current keys, never advanced (the same
  masks at every call until the model's streams move), and batch-statistics
  updates are discarded; the model is not modified. The model's structure
  and its other state are captured when this is called: after
  ``model.eval()`` or ``model.train()``, a new random stream position or new
  batch statistics, call it again (a closure per step is cheap).
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
  fisher=...)``. As with :func:`nnx_obj_fn`, the model's other state
  (random streams, batch statistics) is read and never modified, and it is
  captured when this is called, with the model's structure: after
  ``model.eval()`` or ``model.train()`` or new batch statistics, call it
  again (e.g. before building an estimator transform around ``apply_fn``).
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
    As in flax, gradients under ``"_overwrite_with_gradient"`` (fp8 scales)
    replace those params instead of going through ``tx``, which then sees
    ``params["params"]`` only (and ``per_example_grads["params"]``).
  """
  owg = OVERWRITE_WITH_GRADIENT in grads
  params = state.params["params"] if owg else state.params
  if owg:
    extra = tx_kwargs.get("per_example_grads")
    if extra is not None and OVERWRITE_WITH_GRADIENT in extra:
      tx_kwargs = {**tx_kwargs, "per_example_grads": extra["params"]}
  updates, opt_state = state.tx.update(
    grads["params"] if owg else grads, state.opt_state, params, **tx_kwargs
  )
  params = optax.apply_updates(params, updates)
  if owg:
    params = {
      "params": params,
      OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT],
    }
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


# -- named pieces of a transform's state --------------------------------------


def _opt_state(holder: Any) -> PyTree:
  if isinstance(holder, (nnx.Optimizer, train_state.TrainState)):
    return holder.opt_state
  return holder


def _find(pure_state: PyTree, key: str, filtering: Any) -> PyTree:
  found = optax.tree_utils.tree_get_all_with_path(
    pure_state, key, filtering=filtering
  )
  if not found:
    raise KeyError(
      f"No piece named {key!r} in the optimizer state (a NamedTuple field, "
      "a NamedTuple's class name or a dict key)."
    )
  if len(found) > 1:
    paths = [jax.tree_util.keystr(path) for path, _ in found]
    raise KeyError(
      f"{len(found)} pieces named {key!r} in the optimizer state, at "
      f"{paths}; pick one with filtering=."
    )
  return found[0][1]


def _conform(key: str, new: PyTree, old: PyTree) -> PyTree:
  """``new`` in ``old``'s exact tree, shapes and dtypes (no retrace)."""
  new_flat, _ = jax.tree_util.tree_flatten_with_path(new)
  old_flat, old_def = jax.tree_util.tree_flatten_with_path(old)
  new_paths = [jax.tree_util.keystr(k) for k, _ in new_flat]
  old_paths = [jax.tree_util.keystr(k) for k, _ in old_flat]
  if new_paths != old_paths:
    raise ValueError(
      f"the new {key!r} does not have the structure of the one in the "
      f"optimizer state: leaves at {new_paths}, expected {old_paths}."
    )
  leaves = []
  for path, (_, n), (_, o) in zip(old_paths, new_flat, old_flat):
    n = jnp.asarray(n)
    if n.shape != jnp.shape(o) or n.dtype != jnp.result_type(o):
      raise ValueError(
        f"{key}{path}: new value has shape {n.shape} and dtype {n.dtype}, "
        f"the optimizer state holds {jnp.shape(o)} {jnp.result_type(o)}; "
        "a jitted step would retrace or fail."
      )
    # Strips a weak type, which would also retrace a jitted step.
    leaves.append(jnp.asarray(n, dtype=jnp.result_type(o)))
  return jax.tree_util.tree_unflatten(old_def, leaves)


def get_state(holder: Any, key: str, *, filtering: Any = None) -> PyTree:
  """Reads the piece ``key`` of a transform's state, as arrays.

  Args:
    holder: a plain optimizer state (``tx.init(params)``), a Linen
      ``TrainState`` or an ``nnx.Optimizer``.
    key: a NamedTuple field (``"ewc_anchor"``, ``"protected_subspace"``,
      ``"diag"``, ``"projector"``, ...), a NamedTuple's class name or a dict
      key, as in ``optax.tree.get``.
    filtering: optional ``filtering(path, value) -> bool`` to choose among
      several pieces with the same name, as in ``optax.tree.get``.

  Returns:
    The piece, with arrays where the NNX optimizer holds variables (for NNX,
    params-shaped parts are ``nnx.State`` trees of arrays, the tree of
    ``nnx.state(model, nnx.Param)``), ready for :func:`fisher_optax.consolidate`
    or :func:`fisher_optax.protected_subspace`.

  Raises:
    KeyError: if no piece, or more than one, has that name.

  Example:
    >>> import jax.numpy as jnp, optax, fisher_optax
    >>> from flax import nnx
    >>> import fisher_optax.flax as fo_flax
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> tx = optax.chain(fisher_optax.add_ewc_gradient(1.0), optax.adam(1e-3))
    >>> opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> anchor = fo_flax.get_state(opt, "ewc_anchor")
    >>> anchor.diagonal.precision["kernel"].shape
    (2, 1)
  """
  return _find(nnx.as_pure(_opt_state(holder)), key, filtering)


def replace_state(holder: Any, /, filtering: Any = None, **pieces: Any) -> Any:
  """Replaces named pieces of a transform's state; no retrace.

  ``replace_state(holder, ewc_anchor=new)`` works the same for the three
  places a state lives:

  * a plain optimizer state: returns the new state (``optax.tree.set``);
  * a Linen ``TrainState``: returns ``state.replace(opt_state=...)``;
  * an ``nnx.Optimizer``: writes the new values into its variables in place
    (also inside ``nnx.jit``) and returns the same optimizer. Everything else
    in the state, such as Adam's moments and the step count, is kept.

  Each new piece must have the tree, shapes and dtypes of the old one (a
  jitted step then never retraces); arrays, NNX variables and ``nnx.State``
  trees are accepted, and weak types are made strong.

  Args:
    holder: a plain optimizer state, a Linen ``TrainState`` or an
      ``nnx.Optimizer``.
    filtering: optional ``filtering(path, value) -> bool`` to choose among
      several pieces with the same name, as in ``optax.tree.set``.
    **pieces: ``name=new_value`` for each piece to replace (names as in
      :func:`get_state`).

  Returns:
    The new state or ``TrainState``; the same ``nnx.Optimizer``, updated.

  Raises:
    KeyError: if no piece, or more than one, has a given name.
    ValueError: if a new value's tree, shapes or dtypes differ from the old.

  Example (continual learning in one NNX optimizer; Adam's moments are kept):
    >>> import jax.numpy as jnp, optax, fisher_optax
    >>> from flax import nnx
    >>> from fisher_optax import fisher
    >>> import fisher_optax.flax as fo_flax
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> tx = optax.chain(fisher_optax.add_ewc_gradient(1.0), optax.adam(1e-3))
    >>> opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> x, y = jnp.ones((4, 2)), jnp.array([0, 1, 2, 0])
    >>> apply_fn, params = fo_flax.nnx_apply_fn(model)
    >>> stat = fisher.diagonal(apply_fn, params, (x, y),
    ...                        likelihood=fisher.Categorical(), kind="exact")
    >>> anchor = fisher_optax.consolidate(
    ...     fo_flax.get_state(opt, "ewc_anchor"), params, diagonal=stat)
    >>> opt = fo_flax.replace_state(opt, ewc_anchor=anchor)
    >>> bool(jnp.all(fo_flax.get_state(opt, "ewc_anchor").diagonal.anchor[
    ...     "kernel"] == model.kernel[...]))
    True
  """
  opt_state = _opt_state(holder)
  pure = nnx.as_pure(opt_state)
  new = {
    key: _conform(key, nnx.as_pure(value), _find(pure, key, filtering))
    for key, value in pieces.items()
  }
  if isinstance(holder, nnx.Optimizer):
    is_var = lambda x: isinstance(x, nnx.Variable)
    for key, value in new.items():
      variables = jax.tree.leaves(
        _find(opt_state, key, filtering), is_leaf=is_var
      )
      for var, val in zip(variables, jax.tree.leaves(value), strict=True):
        var.set_value(val)
    return holder
  new_state = optax.tree.set(opt_state, filtering, **new)
  if isinstance(holder, train_state.TrainState):
    return holder.replace(opt_state=new_state)
  return new_state


del flax
