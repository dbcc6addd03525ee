# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Fisher estimators as optax transforms (Sophia's estimator pattern).

Each transform passes ``updates`` through unchanged and keeps a Fisher
statistic in its state, refreshed every ``interval`` steps under
``lax.cond`` from one of two extra arguments:

- ``per_example_grads=``: the per-example gradients (``updates``' tree with a
  leading batch axis), for the kinds that need no model (``empirical``,
  ``batch_squared``);
- ``batch=(inputs, targets)``: the estimator runs the model itself through
  the ``apply_fn`` and ``likelihood`` given at construction (any kind).

A chain passes every extra argument to every member, so both may arrive
(next to a transform with ``fisher_source="per_example"``): the kinds that
need the model (``exact``, ``mc``) then take ``batch=``, the others
``per_example_grads=``.

A later transform in the same chain, or the training loop, reads the
statistic with :func:`get_fisher_diag` / :func:`get_fisher_low_rank`.
Both follow the one non-finite policy of every fisher_optax transform
(:func:`fisher_optax.fisher.numerics.skip_nonfinite_step`): a step whose
gradient, per-example gradients or batch hold a NaN or an infinity, or whose
new statistic is not finite (an overflow, an out-of-range label), leaves the
state as it was (the previous statistic is kept) and is counted in
``notfinite_count``. The updates always pass through unchanged: a
non-finite gradient stays visible to :func:`optax.apply_if_finite`, and a
finite gradient whose statistic overflowed is still applied.
Statistics are float32 (float64 under x64 for float64 inputs) whatever the
gradients' dtype: bf16/float16 gradients are widened before they are squared,
so their statistics do not overflow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import optax

from fisher_optax.fisher import _estimators
from fisher_optax.fisher import _likelihoods
from fisher_optax.fisher import numerics
from fisher_optax.fisher import validation

PyTree = Any


def _make_key(key: jax.Array | int | None) -> jax.Array:
  """Raw uint32 key data: plain arrays for chex, orbax and tree utilities.

  An integer seed may also come as a scalar array (``inject_hyperparams``
  turns numbers into arrays).
  """
  if key is None:
    key = 0
  if isinstance(key, int) or (
    jnp.ndim(key) == 0 and jnp.issubdtype(jnp.result_type(key), jnp.integer)
  ):
    key = jax.random.key(key)
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  # A fresh buffer: a donated state must not delete the caller's key.
  return jnp.array(key, copy=True)


def _key_impl(key: Any) -> Any:
  """The PRNG implementation of a typed ``key`` (``None``: the default)."""
  if isinstance(key, jax.Array) and jnp.issubdtype(
    key.dtype, jax.dtypes.prng_key
  ):
    return jax.random.key_impl(key)
  return None


def _split(raw: jax.Array, impl: Any = None) -> tuple[jax.Array, jax.Array]:
  """``(next state key data, key to use now)``, keys of ``impl``."""
  nxt, now = jax.random.split(jax.random.wrap_key_data(raw, impl=impl))
  return jax.random.key_data(nxt), now


def _check_key(key: Any) -> None:
  """A bad ``key`` is an error now, not at ``init`` or the first step."""
  if key is None or isinstance(key, jax.core.Tracer):
    return
  try:
    _split(_make_key(key), _key_impl(key))
  except (TypeError, ValueError, AttributeError) as err:
    raise TypeError(
      "key must be None, an int seed or a PRNG key (typed, or raw uint32 "
      f"key data); got {key!r}."
    ) from err


def _check_common(
  apply_fn, likelihood, kind, interval, decay, num_samples, method, chunk_size
):
  # method and chunk_size are used only with batch=: checked now, not at the
  # first such step.
  validation.check_choice("method", method, _estimators.METHODS)
  if chunk_size is not None:
    validation.check_static_int("chunk_size", chunk_size, minimum=1)
  if likelihood is not None:
    likelihood = _likelihoods.as_likelihood(likelihood)
    _likelihoods.check_kind(likelihood, kind)
  else:
    validation.check_choice("kind", kind, _likelihoods.KINDS)
  if (apply_fn is None) != (likelihood is None):
    raise ValueError(
      "apply_fn and likelihood go together: give both (to "
      "estimate from batch=) or neither (per_example_grads=)."
    )
  validation.check_static_int("num_samples", num_samples, minimum=1)
  validation.check_count("interval", interval, minimum=1)
  validation.check_in_unit_interval("decay", decay)
  return likelihood


def _blend(old, new, decay, first):
  """EMA with ``decay``; the first refresh replaces (no zero-init bias)."""
  d = jnp.where(first, 0.0, jnp.asarray(decay, jnp.float32))
  return jax.tree.map(
    lambda o, n: (d * o + (1 - d) * n).astype(o.dtype), old, new
  )


def _refresh(state: Any, interval: Any, compute, keep) -> tuple[Any, dict]:
  """Runs ``compute`` every ``interval`` steps (``keep`` otherwise).

  Returns the statistic and the state's new ``count`` and
  ``num_refreshes``. A non-finite refresh is undone by the policy in
  :func:`_update_fn`, counters included.
  """
  due = state.count % interval == 0
  stat = jax.lax.cond(due, compute, keep)
  return stat, dict(
    count=optax.safe_increment(state.count),
    num_refreshes=state.num_refreshes + due.astype(jnp.int32),
  )


def _poison(tree: PyTree, ok: jax.Array) -> PyTree:
  """NaN where ``ok`` is False: a statistic that is not finite (e.g. only its
  ``mean_grad``, from an out-of-range label) is rejected as a whole."""
  return jax.tree.map(lambda x: jnp.where(ok, x, jnp.nan).astype(x.dtype), tree)


def _deprecated_num_nonfinite(self: Any) -> jax.Array:
  validation.warn_deprecated(
    f"{type(self).__name__}.num_nonfinite is deprecated; use "
    "notfinite_count (every skipped step, as in optax.apply_if_finite).",
    stacklevel=3,
  )
  return self.notfinite_count


def _statistic(
  name: str,
  updates: PyTree,
  params: PyTree,
  per_example_grads: PyTree,
  batch: Any,
  *,
  apply_fn: Callable[[PyTree, PyTree], jax.Array] | None,
  from_grads: Callable[[PyTree], Any],
  from_model: Callable[..., Any],
) -> Any:
  """The engine's statistic from whichever extra argument was given.

  ``from_model(apply_fn, params, batch)`` runs on ``batch=``,
  ``from_grads(per_example_grads)`` on ``per_example_grads=``.
  """
  if per_example_grads is not None:
    validation.check_leading_axis(
      per_example_grads, updates, what="per_example_grads"
    )
    return from_grads(per_example_grads)
  if batch is None:
    raise ValueError(
      f"{name} needs the extra argument per_example_grads= or batch=."
    )
  if apply_fn is None:
    raise ValueError(
      "batch= needs apply_fn and likelihood at "
      "construction; or pass per_example_grads=."
    )
  if params is None:
    raise ValueError(
      f"{name} with batch= needs params: call "
      "update(updates, state, params, batch=...)."
    )
  return from_model(apply_fn, params, batch)


def _update_fn(
  step: Callable[..., Any],
  like: Callable[[Any], PyTree],
  impl: Any = None,
  *,
  needs_model: bool = False,
):
  """An ``update_fn`` that passes ``updates`` through and refreshes the state.

  ``step(updates, state, params, per_example_grads, batch, key)`` returns the
  new state (its ``key`` is replaced by the next one); unknown extra
  arguments are ignored, as in any optax transform. The state follows
  :func:`numerics.skip_nonfinite_step`; the updates pass through. With
  ``needs_model`` (the exact and MC kinds) and a ``batch``, per-example
  gradients given for another member of a chain are neither used nor
  checked. ``like(state)`` gives the params' shapes the updates must have
  (a scalar or transposed leaf would broadcast into the statistic).
  """

  def update_fn(
    updates,
    state,
    params=None,
    *,
    per_example_grads=None,
    batch=None,
    **extra_args,
  ):
    del extra_args
    validation.check_like(
      updates, like(state), what="updates", reference_name="init's params"
    )
    if needs_model and batch is not None:
      per_example_grads = None
    key_next, key_now = _split(state.key, impl)
    per_example_grads = numerics.masked_like(per_example_grads, updates)

    def run():
      new = step(updates, state, params, per_example_grads, batch, key_now)
      return updates, new._replace(key=key_next)

    # The policy decides the state; the updates pass through as they came
    # (a non-finite gradient stays visible to optax.apply_if_finite, which
    # checks the gradients it is given, and a finite one whose statistic
    # overflowed is still a usable gradient: NaN here would reach the
    # params even under apply_if_finite).
    _, new_state = numerics.skip_nonfinite_step(
      run, updates, state, inputs=(per_example_grads, batch)
    )
    return updates, new_state

  return update_fn


# -- diagonal -----------------------------------------------------------------


class EstimateFisherDiagState(NamedTuple):
  """State of :func:`estimate_fisher_diag`.

  Attributes:
    count: int32 number of accepted ``update`` calls (a skipped,
      non-finite step leaves the whole state, ``count`` included, as it
      was: ``interval`` counts accepted steps).
    diag: params-shaped diagonal Fisher in float32 (float64 for float64
      params under x64; zeros before the first refresh).
    num_refreshes: int32 accepted refreshes.
    key: raw PRNG key data (uint32) for ``kind="mc"``, split every step.
    notfinite_count: int32 steps skipped because an input or the new
      statistic was not finite (the state is otherwise unchanged by them),
      as in :class:`optax.ApplyIfFiniteState`. The old name
      ``num_nonfinite`` still reads it, with a deprecation warning.
  """

  count: jax.Array
  diag: PyTree
  num_refreshes: jax.Array
  key: jax.Array
  notfinite_count: jax.Array

  num_nonfinite = property(_deprecated_num_nonfinite)


def estimate_fisher_diag(
  apply_fn: Callable[[PyTree, PyTree], jax.Array] | None = None,
  likelihood: Any = None,
  *,
  kind: str = "empirical",
  interval: int = 1,
  decay: float = 0.0,
  num_samples: int = 1,
  key: jax.Array | int | None = None,
  method: str = "auto",
  chunk_size: int | None = None,
  axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Keeps a diagonal Fisher in the optimizer state; updates pass through.

  Every ``interval`` steps (``count % interval == 0``)

  .. math::

    D \\leftarrow \\beta D + (1 - \\beta) \\hat D, \\qquad
    \\hat D = \\operatorname{diag} \\hat F,

  with ``beta = decay`` (the first refresh sets ``D = hat D``) and ``hat F``
  from :func:`fisher_optax.fisher.diagonal` on ``batch=`` or
  :func:`fisher_optax.fisher.diagonal_from_grads` on ``per_example_grads=``.

  Args:
    apply_fn: ``apply_fn(params, inputs)``, needed for ``batch=``.
    likelihood: the likelihood (or per-example loss), with ``apply_fn``.
    kind: the Fisher kind; with ``per_example_grads=`` only ``empirical`` or
      ``batch_squared``.
    interval: refresh period in steps (``>= 1``).
    decay: EMA factor in ``[0, 1)``; 0 replaces the statistic.
    num_samples: MC samples (static int).
    key: PRNG key or int seed, for ``kind="mc"``.
    method, chunk_size, axis_name: as in :func:`fisher_optax.fisher.diagonal`.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose ``update`` takes
    ``per_example_grads=`` or ``batch=`` and returns ``updates`` unchanged.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from fisher_optax import fisher
    >>> apply_fn = lambda p, x: x @ p
    >>> tx = optax.chain(
    ...     fisher.estimate_fisher_diag(apply_fn, fisher.Categorical(),
    ...                                 kind="exact"),
    ...     optax.sgd(0.1))
    >>> params = jnp.zeros((3, 2))
    >>> state = tx.init(params)
    >>> x, y = jnp.eye(3), jnp.array([0, 1, 1])
    >>> g = jnp.ones((3, 2))
    >>> _, state = tx.update(g, state, params, batch=(x, y))
    >>> fisher.get_fisher_diag(state).shape
    (3, 2)
  """
  likelihood = _check_common(
    apply_fn, likelihood, kind, interval, decay, num_samples, method, chunk_size
  )
  _check_key(key)

  def init_fn(params):
    validation.check_real_floating(
      params, what="params", function="estimate_fisher_diag"
    )
    # The estimators' dtype: float32, or float64 for float64 params (x64).
    zeros = jax.tree.map(
      lambda p: numerics.zeros_like_stacked(p, dtype=numerics.compute_dtype(p)),
      params,
    )
    # A fresh array per counter: a donated state must not share buffers.
    z = lambda: jnp.zeros((), jnp.int32)
    return EstimateFisherDiagState(z(), zeros, z(), _make_key(key), z())

  model_kwargs = dict(
    likelihood=likelihood,
    kind=kind,
    num_samples=num_samples,
    method=method,
    chunk_size=chunk_size,
    axis_name=axis_name,
  )
  grads_kind = "batch_squared" if kind == "batch_squared" else "empirical"

  def step(updates, state, params, per_example_grads, batch, key):
    if per_example_grads is not None and kind not in (
      "empirical",
      "batch_squared",
    ):
      raise ValueError(
        f"kind={kind!r} needs the model: pass batch=, not "
        "per_example_grads= (which only give empirical/batch_squared)."
      )

    def compute():
      stat = _statistic(
        "estimate_fisher_diag",
        updates,
        params,
        per_example_grads,
        batch,
        apply_fn=apply_fn,
        from_grads=lambda g: _estimators.diagonal_from_grads(
          g, kind=grads_kind, axis_name=axis_name
        ),
        from_model=lambda fn, p, b: _estimators.diagonal(
          fn, p, b, key=key, **model_kwargs
        ),
      )
      new = _blend(state.diag, stat.diag, decay, state.num_refreshes == 0)
      return _poison(new, stat.is_finite())

    diag, counters = _refresh(state, interval, compute, lambda: state.diag)
    return state._replace(diag=diag, **counters)

  needs_model = kind not in ("empirical", "batch_squared")
  return optax.GradientTransformationExtraArgs(
    init_fn,
    _update_fn(step, lambda s: s.diag, _key_impl(key), needs_model=needs_model),
  )


# -- low rank -----------------------------------------------------------------


class EstimateFisherLowRankState(NamedTuple):
  """State of :func:`estimate_fisher_low_rank`.

  Attributes:
    count: int32 number of accepted ``update`` calls (a skipped,
      non-finite step leaves the whole state, ``count`` included, as it
      was: ``interval`` counts accepted steps).
    eigvals: ``(rank,)``, descending; float32, or float64 when a parameter
      is float64 (x64).
    eigvecs: params-shaped tree with a leading ``rank`` axis, each leaf in
      its parameter's compute dtype (float32, or float64 for float64).
    num_refreshes: int32 accepted refreshes.
    key: raw PRNG key data (uint32) for ``kind="mc"``.
    notfinite_count: int32 skipped (non-finite) steps, as in
      :class:`EstimateFisherDiagState` (old name ``num_nonfinite``).
  """

  count: jax.Array
  eigvals: jax.Array
  eigvecs: PyTree
  num_refreshes: jax.Array
  key: jax.Array
  notfinite_count: jax.Array

  num_nonfinite = property(_deprecated_num_nonfinite)


def estimate_fisher_low_rank(
  apply_fn: Callable[[PyTree, PyTree], jax.Array] | None = None,
  likelihood: Any = None,
  *,
  rank: int,
  kind: str = "empirical",
  interval: int = 1,
  num_samples: int = 1,
  key: jax.Array | int | None = None,
  method: str = "auto",
  chunk_size: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Keeps the top-``rank`` Fisher eigenpairs in the state; updates pass.

  Every ``interval`` steps the eigenpairs are replaced by those of
  :func:`fisher_optax.fisher.low_rank` (``batch=``) or
  :func:`fisher_optax.fisher.low_rank_from_grads` (``per_example_grads=``,
  empirical only). There is no averaging across refreshes: eigenvectors of
  different estimates do not add.

  ``apply_fn``, ``likelihood``, ``kind``, ``interval``, ``num_samples``,
  ``key``, ``method`` and ``chunk_size`` are as in
  :func:`estimate_fisher_diag`.

  Args:
    rank: number of eigenpairs (static int ``>= 1``).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; read the statistic
    with :func:`get_fisher_low_rank`.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax import fisher
    >>> tx = fisher.estimate_fisher_low_rank(rank=2)
    >>> state = tx.init(jnp.zeros(3))
    >>> g = jnp.array([[1.0, 0, 0], [0, 2.0, 0]])
    >>> _, state = tx.update(g.mean(0), state, per_example_grads=g)
    >>> state.eigvals
    Array([2. , 0.5], dtype=float32)
  """
  rank = validation.check_static_int("rank", rank, minimum=1)
  likelihood = _check_common(
    apply_fn, likelihood, kind, interval, 0.0, num_samples, method, chunk_size
  )
  _check_key(key)

  def init_fn(params):
    validation.check_real_floating(
      params, what="params", function="estimate_fisher_low_rank"
    )
    # As the estimators: float32, or float64 for float64 params (x64).
    vecs = jax.tree.map(
      lambda p: numerics.zeros_like_stacked(
        p, (rank,), numerics.compute_dtype(p)
      ),
      params,
    )
    vals_dtype = numerics.compute_dtype(
      jnp.result_type(jnp.float32, *jax.tree.leaves(vecs))
    )
    z = lambda: jnp.zeros((), jnp.int32)
    return EstimateFisherLowRankState(
      z(), jnp.zeros((rank,), vals_dtype), vecs, z(), _make_key(key), z()
    )

  model_kwargs = dict(
    likelihood=likelihood,
    kind=kind,
    rank=rank,
    num_samples=num_samples,
    method=method,
    chunk_size=chunk_size,
  )

  def step(updates, state, params, per_example_grads, batch, key):
    if per_example_grads is not None and kind != "empirical":
      raise ValueError(
        f"kind={kind!r} needs batch=; per_example_grads= "
        "give the empirical Fisher only."
      )

    def compute():
      stat = _statistic(
        "estimate_fisher_low_rank",
        updates,
        params,
        per_example_grads,
        batch,
        apply_fn=apply_fn,
        from_grads=lambda g: _estimators.low_rank_from_grads(g, rank=rank),
        from_model=lambda fn, p, b: _estimators.low_rank(
          fn, p, b, key=key, **model_kwargs
        ),
      )
      new = (
        stat.eigvals.astype(state.eigvals.dtype),
        jax.tree.map(
          lambda v, s: v.astype(s.dtype), stat.eigvecs, state.eigvecs
        ),
      )
      return _poison(new, stat.is_finite())

    (vals, vecs), counters = _refresh(
      state, interval, compute, lambda: (state.eigvals, state.eigvecs)
    )
    return state._replace(eigvals=vals, eigvecs=vecs, **counters)

  return optax.GradientTransformationExtraArgs(
    init_fn,
    _update_fn(
      step,
      lambda s: jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(v.shape[1:], v.dtype), s.eigvecs
      ),
      _key_impl(key),
      needs_model=kind != "empirical",
    ),
  )


# -- reading the statistic from a (chain) state -------------------------------


def _find(state: Any, cls: type) -> Any:
  found = [
    s
    for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, cls))
    if isinstance(s, cls)
  ]
  if not found:
    raise ValueError(f"no {cls.__name__} in this optimizer state.")
  if len(found) > 1:
    raise ValueError(
      f"{len(found)} {cls.__name__}s in this optimizer state; "
      "index the chain state to pick one."
    )
  return found[0]


def get_fisher_diag(state: Any) -> PyTree:
  """The diagonal Fisher kept by :func:`estimate_fisher_diag` in ``state``.

  ``state`` may be the transform's own state or any state containing exactly
  one :class:`EstimateFisherDiagState` (a chain, ``inject_hyperparams``).
  """
  return _find(state, EstimateFisherDiagState).diag


def get_fisher_low_rank(state: Any) -> tuple[jax.Array, PyTree]:
  """``(eigvals, eigvecs)`` kept by :func:`estimate_fisher_low_rank`."""
  s = _find(state, EstimateFisherLowRankState)
  return s.eigvals, s.eigvecs
