# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Fisher merging: Fisher-weighted averaging of models over arbitrary pytrees.

Each model's posterior is approximated by a Gaussian centred at its
parameters with a diagonal precision given by its Fisher information; the
merge maximises the weighted joint density, coordinate by coordinate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from fisher_optax import fisher as fisher_engine
from fisher_optax.fisher import numerics
from fisher_optax.fisher import validation

PyTree = Any
MaskOrFn = PyTree | Callable[[PyTree], PyTree] | None

_FLOOR_MODES = ("all", "target")


# -- helpers -----------------------------------------------------------------


def _is_float(leaf: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(leaf), jnp.floating)


def _leaf_names(tree: PyTree) -> list[str]:
  paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [jax.tree_util.keystr(p) or "<root>" for p, _ in paths]


def _unwrap_fisher(fisher: Any) -> PyTree:
  """Accepts a params-shaped tree or an engine ``DiagonalFisher``."""
  if isinstance(fisher, fisher_engine.DiagonalFisher):
    return numerics.pure_arrays(fisher.diag)
  if isinstance(fisher, fisher_engine.FisherStatistic):
    raise TypeError(
      "Fisher merging needs a diagonal Fisher: a fisher.DiagonalFisher or a "
      f"params-shaped tree, got a {type(fisher).__name__}."
    )
  return numerics.pure_arrays(fisher)


def _check_like(
  reference: PyTree,
  other: PyTree,
  *,
  what: str,
  reference_name: str,
  check_dtype: bool,
) -> None:
  """Same structure and per-leaf shapes (and dtypes), naming the leaf."""
  validation.check_same_structure(
    reference, other, what=what, reference_name=reference_name
  )
  for name, ref, leaf in zip(
    _leaf_names(reference), jax.tree.leaves(reference), jax.tree.leaves(other)
  ):
    if jnp.shape(ref) != jnp.shape(leaf):
      raise ValueError(
        f"{what}{name} has shape {jnp.shape(leaf)} but {reference_name}"
        f"{name} has shape {jnp.shape(ref)}."
      )
    if check_dtype and jnp.result_type(ref) != jnp.result_type(leaf):
      raise ValueError(
        f"{what}{name} has dtype {jnp.result_type(leaf)} but "
        f"{reference_name}{name} has dtype {jnp.result_type(ref)}."
      )


def _merged_leaves(merge_mask: MaskOrFn, params: PyTree) -> list[bool]:
  """Flat list: True where the leaf is merged (floating and not masked out)."""
  if callable(merge_mask):
    merge_mask = merge_mask(params)
  mask = numerics.resolve_mask(
    numerics.pure_arrays(merge_mask), params, name="merge_mask"
  )
  return [
    m and _is_float(x)
    for m, x in zip(jax.tree.leaves(mask), jax.tree.leaves(params))
  ]


def _check_weight(name: str, weight: Any) -> None:
  validation.check_scalar(name, weight)
  if isinstance(weight, jax.core.Tracer):
    return
  arr = np.asarray(weight)
  if not np.isfinite(arr) or arr < 0:
    raise ValueError(f"{name} must be finite and >= 0, got {arr}.")


check_fisher_leaf = validation.check_fisher_leaf


def _check_weight_vector(name: str, weights: Any) -> None:
  """Concrete merge weights: finite, >= 0 and not all zero."""
  w = np.asarray(weights, np.float64)
  if not np.all(np.isfinite(w)) or np.any(w < 0) or not np.any(w > 0):
    raise ValueError(f"{name} must be finite, >= 0 and not all zero, got {w}.")


def _host_scaled(name: str, weights: Any) -> np.ndarray:
  """Checked concrete weights in float64, scaled by a power of two so the
  largest is in ``[1, 2)``: the merge does not depend on their scale, and
  weights below float32's smallest normal number (1e-38) would be zeros on
  the device, the merge then the target."""
  _check_weight_vector(name, weights)
  w = np.asarray(weights, np.float64)
  return w / 2.0 ** np.floor(np.log2(w.max()))


def _scale_pow2(x: Any, e: jax.Array) -> jax.Array:
  """``x * 2**-e``, exactly, for an int32 scalar ``e``.

  Two power-of-two factors, neither of them subnormal: a division by a
  number above ``2**126`` (or a multiplication by its reciprocal) flushes
  to 0 on XLA:CPU.
  """
  x = jnp.asarray(x)
  half = e // 2
  one = jnp.ones((), x.dtype)
  return x * jnp.ldexp(one, -half) * jnp.ldexp(one, half - e)


def _exponent(x: jax.Array) -> jax.Array:
  """``e`` with ``x = m 2**e``, ``0.5 <= m < 1`` (0 for ``x = 0``)."""
  return jnp.frexp(x)[1]


def _fisher_norm(
  fisher_leaves: list[Any], merged: list[bool]
) -> tuple[jax.Array, jax.Array]:
  """The global L2 norm over the merged leaves as ``(e, root)``.

  ``norm = 2**e * root``, with ``2**e`` just above the largest ``|F|`` and
  ``root = sqrt(sum (F 2**-e)^2)``: squaring ``F`` itself would underflow
  for tiny Fishers and overflow for huge ones. ``(0, 1)`` for an all-zero
  Fisher (no scale to remove) and when nothing is merged.
  """
  leaves = [jnp.asarray(f) for f, m in zip(fisher_leaves, merged) if m]
  if not leaves:
    return jnp.zeros((), jnp.int32), jnp.ones((), jnp.float32)
  dtype = numerics.compute_dtype(jnp.result_type(*leaves))
  leaves = [f.astype(dtype) for f in leaves]
  amax = functools.reduce(
    jnp.maximum, [jnp.max(jnp.abs(f), initial=0.0) for f in leaves]
  )
  e = _exponent(amax)
  root = jnp.sqrt(sum(jnp.sum(jnp.square(_scale_pow2(f, e))) for f in leaves))
  return e, jnp.where(root > 0, root, 1.0)


def _coefficients(
  fisher_leaves: list[Any],
  merged: list[bool],
  weight: Any,
  floor: Any,
  apply_floor: bool,
  normalize: bool,
) -> list[Any]:
  """Per-leaf ``w * max(F, floor)`` (``None`` for leaves not merged).

  With ``normalize``, ``w * max(F, floor) / |F|``, divided in two steps
  (see :func:`_fisher_norm`) so that ``1 / |F|`` is never formed.
  """
  norm = _fisher_norm(fisher_leaves, merged) if normalize else None
  out = []
  for f, m in zip(fisher_leaves, merged):
    if not m:
      out.append(None)
      continue
    f = jnp.asarray(f)
    if apply_floor:
      f = jnp.maximum(f, floor)
    if norm is not None:
      e, root = norm
      f = _scale_pow2(f.astype(root.dtype), e) / root
    out.append(weight * f)
  return out


def _fold(mean: jax.Array, mass: jax.Array, theta: Any, coeff: jax.Array):
  """Adds one model to a running Fisher-weighted mean.

  ``mean_new = mean + c / (mass + c) * (theta - mean)`` equals the batch
  ratio ``sum c_i theta_i / sum c_i`` in exact arithmetic, but is exact for
  identical models, stays in the convex hull (the clip removes rounding
  excursions) and leaves zero-mass coordinates at the first model's value.
  Where ``c / (mass + c)`` is exactly 1 (the mass so far is zero, e.g. a
  zero weight on the target) the result is ``theta`` itself, bit for bit.
  """
  dtype = mean.dtype
  theta = jnp.asarray(theta).astype(dtype)
  coeff = jnp.broadcast_to(coeff.astype(dtype), mean.shape)
  new_mass = mass + coeff
  # Scale large masses down first (exactly): XLA:CPU flushes a division by
  # a number above 2**126 to 0.
  down = jnp.where(new_mass > 2.0**64, 2.0**-64, 1.0).astype(dtype)
  pos = new_mass > 0
  t = jnp.where(pos, coeff * down / jnp.where(pos, new_mass * down, 1), 0)
  new_mean = jnp.where(t == 1, theta, mean + t * (theta - mean))
  new_mean = jnp.clip(
    new_mean, jnp.minimum(mean, theta), jnp.maximum(mean, theta)
  )
  return new_mean, new_mass


# -- streaming accumulator ----------------------------------------------------


class FisherMergeState(NamedTuple):
  """State of :func:`fisher_merge_accumulator`.

  Attributes:
    count: int32, number of models added so far (the target included).
    mean: the running merged parameters, in at least float32; leaves that are
      not merged hold the target's leaf unchanged.
    mass: the running sum of ``w_i * max(F_i, floor)`` per coordinate (a
      scalar zero for leaves that are not merged).
    dtypes: zero-size arrays carrying each leaf's original dtype, so that
      :meth:`finalize` can cast back.
  """

  count: jax.Array
  mean: PyTree
  mass: PyTree
  dtypes: PyTree


class FisherMergeAccumulator(NamedTuple):
  """Streams models into a Fisher merge (see :func:`fisher_merge_accumulator`).

  Attributes:
    init: ``init(target_params, target_fisher, weight=1.0) -> state``.
    add: ``add(state, params, fisher, weight=1.0) -> state``.
    finalize: ``finalize(state) -> merged params`` in the params' dtypes.
  """

  init: Callable[..., FisherMergeState]
  add: Callable[..., FisherMergeState]
  finalize: Callable[[FisherMergeState], PyTree]


class _MergeOptions(NamedTuple):
  fisher_floor: Any
  floor_mode: str
  normalize: bool
  merge_mask: MaskOrFn


def _model_coefficients(
  opts: _MergeOptions,
  params: PyTree,
  fisher: Any,
  weight: Any,
  is_target: bool,
  names: tuple[str, str],
) -> tuple[list[bool], list[Any]]:
  """Which leaves merge, and each merged leaf's ``w * max(F, floor)``.

  ``names`` are how messages call ``(params, fisher)``.
  """
  params_name, fisher_name = names
  fisher = _unwrap_fisher(fisher)
  _check_like(
    params,
    fisher,
    what=fisher_name,
    reference_name=params_name,
    check_dtype=False,
  )
  merged = _merged_leaves(opts.merge_mask, params)
  for name, f, m in zip(_leaf_names(fisher), jax.tree.leaves(fisher), merged):
    if m:
      check_fisher_leaf(f, name=f"{fisher_name}{name}")
  apply_floor = opts.floor_mode == "all" or is_target
  coeffs = _coefficients(
    jax.tree.leaves(fisher),
    merged,
    weight,
    opts.fisher_floor,
    apply_floor,
    opts.normalize,
  )
  return merged, coeffs


def _init_state(
  opts: _MergeOptions,
  target_params: PyTree,
  target_fisher: Any,
  weight: Any,
  names: tuple[str, str] = ("params", "fisher"),
) -> FisherMergeState:
  """The state holding the target alone (``names`` as in the messages)."""
  _check_weight("weight", weight)
  target_params = numerics.pure_arrays(target_params)
  merged, coeffs = _model_coefficients(
    opts, target_params, target_fisher, weight, True, names
  )
  leaves, treedef = jax.tree.flatten(target_params)
  means, masses, dtypes = [], [], []
  for x, m, c in zip(leaves, merged, coeffs):
    x = jnp.asarray(x)
    dtypes.append(jnp.zeros((0,), x.dtype))
    if not m:
      means.append(x)
      masses.append(jnp.zeros((), jnp.float32))
      continue
    dtype = numerics.compute_dtype(x)
    means.append(x.astype(dtype))
    masses.append(jnp.broadcast_to(c.astype(dtype), x.shape))
  _check_mass(masses, _leaf_names(target_params), names)
  return FisherMergeState(
    count=jnp.ones((), jnp.int32),
    mean=treedef.unflatten(means),
    mass=treedef.unflatten(masses),
    dtypes=treedef.unflatten(dtypes),
  )


def _check_mass(
  masses: list[Any], names: list[str], what: tuple[str, str]
) -> None:
  """Concrete Fisher masses are finite: ``sum_i w_i F_i`` did not overflow.

  Traced masses cannot be checked: under ``jit`` an overflow gives a wrong
  (or NaN) merge of those coordinates.
  """
  if any(isinstance(m, jax.core.Tracer) for m in masses):
    return
  if bool(numerics.tree_all_finite(masses)):
    return
  bad = next(n for n, m in zip(names, masses) if not np.all(np.isfinite(m)))
  params_name, fisher_name = what
  raise ValueError(
    f"the Fisher mass sum_i w_i * max(F_i, floor) of {params_name}{bad} "
    f"overflows its dtype after adding {fisher_name}; divide the weights "
    "(or the Fishers and fisher_floor) by a common factor, which leaves the "
    "merge unchanged."
  )


def _check_model(state: FisherMergeState, params: PyTree) -> None:
  """A model to add has the target's structure, shapes and dtypes."""
  _check_like(
    state.mean,
    params,
    what="params",
    reference_name="target",
    check_dtype=False,
  )
  for name, d, x in zip(
    _leaf_names(params), jax.tree.leaves(state.dtypes), jax.tree.leaves(params)
  ):
    if jnp.result_type(x) != d.dtype:
      raise ValueError(
        f"params{name} has dtype {jnp.result_type(x)} but target{name} "
        f"has dtype {d.dtype}."
      )


def _add_model(
  opts: _MergeOptions,
  state: FisherMergeState,
  params: PyTree,
  fisher: Any,
  weight: Any,
  names: tuple[str, str] = ("params", "fisher"),
) -> FisherMergeState:
  """Folds one more model into the running merge."""
  _check_weight("weight", weight)
  params = numerics.pure_arrays(params)
  _check_model(state, params)
  merged, coeffs = _model_coefficients(
    opts, params, fisher, weight, False, names
  )
  treedef = jax.tree.structure(params)
  means, masses = [], []
  for x, m, c, mean, mass in zip(
    jax.tree.leaves(params),
    merged,
    coeffs,
    jax.tree.leaves(state.mean),
    jax.tree.leaves(state.mass),
  ):
    if m:
      mean, mass = _fold(mean, mass, x, c)
    means.append(mean)
    masses.append(mass)
  _check_mass(masses, _leaf_names(params), names)
  return FisherMergeState(
    count=state.count + 1,
    mean=treedef.unflatten(means),
    mass=treedef.unflatten(masses),
    dtypes=state.dtypes,
  )


def _finalize(state: FisherMergeState) -> PyTree:
  """The merged parameters in the params' dtypes."""
  # A leaf kept in its dtype (not merged) may have no astype (a PRNG key).
  return jax.tree.map(
    lambda x, d: x if x.dtype == d.dtype else x.astype(d.dtype),
    state.mean,
    state.dtypes,
  )


def _merge_options(
  fisher_floor: Any, floor_mode: str, normalize: bool, merge_mask: MaskOrFn
) -> _MergeOptions:
  validation.check_choice("floor_mode", floor_mode, _FLOOR_MODES)
  validation.check_scalar("fisher_floor", fisher_floor)
  validation.check_positive("fisher_floor", fisher_floor, allow_zero=True)
  normalize = validation.check_flag("normalize", normalize)
  return _MergeOptions(fisher_floor, floor_mode, normalize, merge_mask)


def fisher_merge_accumulator(
  fisher_floor: float | jax.Array = 1e-6,
  *,
  floor_mode: str = "all",
  normalize: bool = False,
  merge_mask: MaskOrFn = None,
) -> FisherMergeAccumulator:
  r"""Fisher merging one model at a time, in memory for two models.

  Keeps the running merged parameters and the running Fisher mass,

  .. math::

    m_K = \sum_{i \le K} w_i \hat F_i, \qquad
    \bar\theta_K = \bar\theta_{K-1} + \frac{w_K \hat F_K}{m_K}
      (\theta_K - \bar\theta_{K-1}),

  which equals the batch formula of :func:`fisher_merge` after the last
  model, so ``N`` models merge with two params-sized buffers plus the model
  being added. The first model (given to ``init``) is the target: with
  ``floor_mode="target"`` only its Fisher is floored, leaves that are not
  merged are its, and coordinates whose Fisher mass stays zero keep its
  value. All three functions are jit-able. Params and Fishers may hold Flax
  NNX variables (``nnx.state(model)``); the state and ``finalize`` hold
  plain arrays (``nnx.update(model, merged)`` takes either).

  Unlike :func:`fisher_merge`, which rescales all the weights together,
  it sees one weight at a time and uses the weights as given: the running
  mass ``sum_i w_i max(F_i, floor)`` must fit the statistics' dtype. An
  overflow raises a ``ValueError`` when called eagerly (divide the weights
  by a common factor, which leaves the merge unchanged); under ``jit`` it
  cannot be checked and gives wrong values on those coordinates.

  It trades time for memory: each model is a separate pass over the
  buffers. Donate the state to ``add`` (``jax.jit(acc.add,
  donate_argnums=0)``) so XLA updates the buffers in place.

  Args:
    fisher_floor: lower bound applied to the Fishers (see ``floor_mode``).
    floor_mode: ``"all"`` floors every model's Fisher (the paper);
      ``"target"`` floors only the target's (the released code's
      ``favor_target_model``).
    normalize: divide each model's weight by the global L2 norm of its raw
      Fisher over the merged leaves (the released code's
      ``normalize_fishers``), computed without underflow or overflow for
      Fishers of any scale.
    merge_mask: pytree of bools (or a prefix of one, or a callable of the
      params returning one); ``False`` leaves are taken from the target.
      Non-floating leaves (step counters, keys) always come from the target.

  Returns:
    A :class:`FisherMergeAccumulator` ``(init, add, finalize)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fisher_optax
    >>> models = [{"w": jnp.array([0.0, 0.0])}, {"w": jnp.array([1.0, 1.0])},
    ...           {"w": jnp.array([2.0, 2.0])}]
    >>> fishers = [{"w": jnp.array([1.0, 3.0])}, {"w": jnp.array([1.0, 1.0])},
    ...            {"w": jnp.array([2.0, 4.0])}]
    >>> acc = fisher_optax.fisher_merge_accumulator()
    >>> add = jax.jit(acc.add)  # one compile for every model that follows
    >>> state = acc.init(models[0], fishers[0])
    >>> for params, fisher in zip(models[1:], fishers[1:]):  # e.g. loaded
    ...   state = add(state, params, fisher)
    >>> acc.finalize(state)["w"]
    Array([1.25 , 1.125], dtype=float32)
    >>> fisher_optax.fisher_merge(models, fishers)["w"]  # the same merge
    Array([1.25 , 1.125], dtype=float32)

  References:
    Matena et al, `Merging Models with Fisher-Weighted Averaging
    <https://arxiv.org/abs/2111.09832>`_, 2022
  """
  opts = _merge_options(fisher_floor, floor_mode, normalize, merge_mask)

  def init_fn(
    target_params: PyTree, target_fisher: Any, weight: Any = 1.0
  ) -> FisherMergeState:
    return _init_state(opts, target_params, target_fisher, weight)

  def add_fn(
    state: FisherMergeState, params: PyTree, fisher: Any, weight: Any = 1.0
  ) -> FisherMergeState:
    return _add_model(opts, state, params, fisher, weight)

  return FisherMergeAccumulator(init_fn, add_fn, _finalize)


# -- batch merge --------------------------------------------------------------


def fisher_merge(
  params_list: Sequence[PyTree],
  fishers: Sequence[PyTree] | None,
  weights: Any = None,
  fisher_floor: float | jax.Array = 1e-6,
  *,
  floor_mode: str = "all",
  normalize: bool = False,
  merge_mask: MaskOrFn = None,
  target_index: int = 0,
) -> PyTree:
  r"""Merges models by Fisher-weighted averaging of their parameters.

  Each model's posterior is approximated by a Gaussian with diagonal
  precision :math:`F_i` (its Fisher); the weighted joint density is
  maximised coordinate by coordinate:

  .. math::

    \theta^\star_j = \frac{\sum_i w_i \hat F_{ij} \theta_{ij}}
      {\sum_i w_i \hat F_{ij}}, \qquad \hat F_{ij} = \max(F_{ij}, \epsilon).

  With every :math:`F_i = 1` (``fishers=None``) this is the plain weighted
  average. The result is invariant to scaling all weights (they are
  rescaled so that the largest is of order 1 before use, so weights of any
  magnitude give the same merge), and each coordinate lies between the
  models' values (it is a convex combination).

  The paper floors every Fisher (``floor_mode="all"``, the default here);
  the released code floors only the target (``floor_mode="target"``), so a
  coordinate where every Fisher is zero takes the target's value instead of
  the weighted average. The released code also divides each weight by the
  global L2 norm of its raw Fisher (``normalize=True``; the research code
  and the default here do not), and copies unshared leaves such as heads
  from the target (``merge_mask``). Coordinates whose total weighted Fisher
  is zero (possible only with zero weights or ``fisher_floor=0``) take the
  target's value rather than NaN.

  Everything is jit-able; ``weights`` may be traced, so a weight sweep is one
  ``jax.vmap``. Leaves are folded in one at a time (see
  :func:`fisher_merge_accumulator`), which XLA fuses into a single pass over
  the inputs. Statistics use at least float32; the result has the params'
  dtypes.

  Args:
    params_list: ``K >= 1`` pytrees with the same structure, shapes and dtypes
      (Flax NNX state, Linen params, plain dicts). NNX state may hold
      variables (``nnx.state(model)``) or plain arrays (``nnx.as_pure``, or
      the ``theta`` of ``fisher_optax.flax.nnx_apply_fn``).
    fishers: ``K`` diagonal Fishers, each params-shaped (or an engine
      ``DiagonalFisher``; with or without NNX variables whatever the params
      hold), non-negative and finite (checked when called eagerly, with a
      ``ValueError`` naming the model and the leaf, e.g.
      ``fishers[1]['w']``; under ``jit`` the values cannot be inspected);
      ``None`` for plain averaging.
    weights: ``(K,)`` non-negative weights (traced allowed), default equal.
    fisher_floor: lower bound :math:`\epsilon` on the Fishers (1e-6 in the
      paper).
    floor_mode: ``"all"`` or ``"target"`` (see above).
    normalize: divide each weight by the global L2 norm of its Fisher over
      the merged leaves (an all-zero Fisher keeps its weight), computed
      without underflow or overflow for Fishers of any scale.
    merge_mask: pytree of bools (or a prefix of one, or a callable of the
      params returning one); ``False`` leaves come from the target unmerged.
      Non-floating leaves always come from the target.
    target_index: static index of the target model.

  Returns:
    The merged parameters, with the structure and dtypes of the target
    ``params_list[target_index]`` (NNX variables in, NNX variables out,
    with the target's variable metadata).

  Example:

    >>> import jax, jax.numpy as jnp
    >>> import fisher_optax
    >>> a, b = {"w": jnp.array([0.0, 0.0])}, {"w": jnp.array([1.0, 1.0])}
    >>> fa, fb = {"w": jnp.array([1.0, 3.0])}, {"w": jnp.array([1.0, 1.0])}
    >>> fisher_optax.fisher_merge([a, b], [fa, fb])["w"]
    Array([0.5 , 0.25], dtype=float32)
    >>> grid = jnp.array([[1.0, 0.0], [1.0, 1.0]])  # a weight sweep: one vmap
    >>> merge = lambda w: fisher_optax.fisher_merge([a, b], [fa, fb], w)
    >>> jax.vmap(merge)(grid)["w"]
    Array([[0.  , 0.  ],
           [0.5 , 0.25]], dtype=float32)

  References:
    Matena et al, `Merging Models with Fisher-Weighted Averaging
    <https://arxiv.org/abs/2111.09832>`_, 2022
  """
  if isinstance(params_list, (dict,)) or not isinstance(params_list, Sequence):
    raise TypeError(
      "params_list must be a list or tuple of parameter pytrees, got "
      f"{type(params_list).__name__}."
    )
  num_models = len(params_list)
  if num_models == 0:
    raise ValueError("params_list must hold at least one model.")
  if fishers is None:
    ones = jax.tree.map(
      lambda x: jnp.ones(jnp.shape(x), jnp.float32), params_list[0]
    )
    fishers = [ones] * num_models
  elif not isinstance(fishers, Sequence) or isinstance(fishers, dict):
    raise TypeError(
      "fishers must be a list or tuple with one Fisher per model (or None), "
      f"got {type(fishers).__name__}."
    )
  if len(fishers) != num_models:
    raise ValueError(
      f"Got {num_models} models but {len(fishers)} Fishers; pass one "
      "Fisher per model."
    )
  validation.check_static_int("target_index", target_index)
  if not 0 <= target_index < num_models:
    raise ValueError(
      f"target_index must lie in [0, {num_models}), got {target_index}."
    )
  # The merge runs on plain arrays; the result goes back into the target's
  # tree (NNX variables included).
  out_treedef = jax.tree.structure(params_list[target_index])
  params_list = [numerics.pure_arrays(p) for p in params_list]
  for i, params in enumerate(params_list):
    _check_like(
      params_list[0],
      params,
      what=f"params_list[{i}]",
      reference_name="params_list[0]",
      check_dtype=True,
    )
  if weights is None:
    weights = np.ones((num_models,), np.float32)
  # np.shape: a list or tuple of floats is fine (jnp.shape deprecates it).
  if np.shape(weights) != (num_models,):
    raise ValueError(
      f"weights must have shape ({num_models},), one per model, got "
      f"{np.shape(weights)}."
    )
  dtype = jnp.asarray(weights).dtype
  if not jnp.issubdtype(dtype, jnp.floating):
    dtype = jnp.float32
  if not isinstance(weights, jax.core.Tracer):
    weights = _host_scaled("weights", weights)
  weights = jnp.asarray(weights, dtype)
  # The merge is invariant to scaling all weights: scaling the largest to
  # [0.5, 1) keeps w_i F_i from overflowing (the default equal weights
  # too). A power of two is exact, and as f(w / c) = f(w) for any c > 0,
  # treating it as a constant keeps the gradient exact.
  e = jax.lax.stop_gradient(_exponent(jnp.max(weights)))
  weights = _scale_pow2(weights, e)

  opts = _merge_options(fisher_floor, floor_mode, normalize, merge_mask)

  def names(i: int) -> tuple[str, str]:
    return f"params_list[{i}]", f"fishers[{i}]"

  state = _init_state(
    opts,
    params_list[target_index],
    fishers[target_index],
    weights[target_index],
    names(target_index),
  )
  for i in range(num_models):
    if i != target_index:
      state = _add_model(
        opts, state, params_list[i], fishers[i], weights[i], names(i)
      )
  return jax.tree.unflatten(out_treedef, jax.tree.leaves(_finalize(state)))


# -- weight search ------------------------------------------------------------


class MergeWeightSearch(NamedTuple):
  """Result of :func:`search_merge_weights`.

  Attributes:
    best_weights: ``(K,)`` the candidate with the highest score.
    best_score: that score.
    weights: ``(n, K)`` every candidate tried, in order.
    scores: ``(n,)`` their scores (numpy).
  """

  best_weights: np.ndarray
  best_score: float
  weights: np.ndarray
  scores: np.ndarray


def merge_weight_candidates(
  num_models: int, num_points: int = 51, *, key: jax.Array | None = None
) -> np.ndarray:
  r"""Candidate weights for a merge search, ``(num_points, num_models)``.

  Two models: the grid :math:`(\lambda, 1-\lambda)` for ``num_points``
  values of :math:`\lambda` evenly spaced in :math:`[0, 1]` (the paper's
  51-point grid by default). More models: the equal weights first, then
  ``num_points - 1`` samples from a flat Dirichlet.

  Args:
    num_models: number of models ``K >= 1``.
    num_points: number of candidates.
    key: PRNG key for the Dirichlet samples (default ``jax.random.key(0)``).

  Returns:
    Non-negative weights summing to one, one row per candidate.

  Example:
    >>> import fisher_optax
    >>> fisher_optax.merge_weight_candidates(2, num_points=3)
    array([[0. , 1. ],
           [0.5, 0.5],
           [1. , 0. ]], dtype=float32)
    >>> fisher_optax.merge_weight_candidates(3, num_points=4).shape
    (4, 3)
  """
  validation.check_static_int("num_models", num_models, minimum=1)
  validation.check_static_int("num_points", num_points, minimum=1)
  if num_models == 1:
    return np.ones((1, 1), np.float32)
  if num_models == 2:
    lam = np.linspace(0.0, 1.0, num_points, dtype=np.float32)
    if num_points == 1:
      lam = np.full((1,), 0.5, np.float32)
    return np.stack([lam, 1.0 - lam], axis=1)
  if key is None:
    key = jax.random.key(0)
  # Normalised iid Exp(1) draws are exactly flat-Dirichlet samples, and far
  # cheaper to compile than jax.random.dirichlet's gamma sampler.
  e = jax.random.exponential(key, (num_points - 1, num_models))
  samples = e / jnp.sum(e, axis=1, keepdims=True)
  uniform = np.full((1, num_models), 1.0 / num_models, np.float32)
  return np.concatenate([uniform, np.asarray(samples, np.float32)], axis=0)


def search_merge_weights(
  score_fn: Callable[[PyTree], Any],
  params_list: Sequence[PyTree],
  fishers: Sequence[PyTree] | None,
  *,
  num_points: int = 51,
  key: jax.Array | None = None,
  candidates: Any = None,
  **merge_kwargs: Any,
) -> MergeWeightSearch:
  """Picks merge weights by a validation score.

  Merges once per candidate (one compiled merge, weights traced) and calls
  ``score_fn`` on each result; ties go to the earliest candidate.

  Args:
    score_fn: ``score_fn(merged_params) -> scalar``, higher is better (e.g.
      validation accuracy). It runs eagerly, so it may use numpy.
    params_list: the models, as in :func:`fisher_merge`.
    fishers: their Fishers, or ``None`` to tune a plain weighted average.
    num_points: number of candidates (see :func:`merge_weight_candidates`).
    key: PRNG key for the Dirichlet candidates (more than two models).
    candidates: explicit ``(n, K)`` candidate weights, overriding the above;
      every row is checked as :func:`fisher_merge` checks ``weights``
      (finite, ``>= 0``, not all zero), with a ``ValueError`` naming it.
    **merge_kwargs: passed to :func:`fisher_merge` (``fisher_floor``,
      ``floor_mode``, ``normalize``, ``merge_mask``, ``target_index``).

  Returns:
    A :class:`MergeWeightSearch` with the best weights and all scores.

  Example:
    >>> import jax.numpy as jnp
    >>> import fisher_optax
    >>> models = [{"w": jnp.array([0.0])}, {"w": jnp.array([1.0])}]
    >>> fishers = [{"w": jnp.array([1.0])}, {"w": jnp.array([1.0])}]
    >>> # A validation score that prefers w close to 0.3.
    >>> score = lambda params: -abs(float(params["w"][0]) - 0.3)
    >>> result = fisher_optax.search_merge_weights(
    ...     score, models, fishers, num_points=11)
    >>> result.best_weights
    array([0.7, 0.3], dtype=float32)
    >>> merged = fisher_optax.fisher_merge(models, fishers, result.best_weights)
    >>> merged["w"]
    Array([0.3], dtype=float32)
  """
  if candidates is None:
    candidates = merge_weight_candidates(len(params_list), num_points, key=key)
  exact = np.asarray(candidates, np.float64)
  candidates = exact.astype(np.float32)
  if candidates.ndim != 2 or candidates.shape[1] != len(params_list):
    raise ValueError(
      f"candidates must have shape (n, {len(params_list)}), got "
      f"{candidates.shape}."
    )
  if candidates.shape[0] == 0:
    raise ValueError("candidates must hold at least one row.")
  # The jitted merge sees traced weights: every row is checked and scaled
  # here, and the models and Fishers checked by one eager merge.
  scaled = [_host_scaled(f"candidates[{i}]", w) for i, w in enumerate(exact)]
  fisher_merge(params_list, fishers, exact[0], **merge_kwargs)
  merge = jax.jit(lambda p, f, w: fisher_merge(p, f, w, **merge_kwargs))
  params_list, fishers = list(params_list), fishers and list(fishers)
  scores = np.asarray(
    [
      float(score_fn(merge(params_list, fishers, jnp.asarray(w, jnp.float32))))
      for w in scaled
    ],
    np.float64,
  )
  if not np.any(np.isfinite(scores)):
    raise ValueError("score_fn returned no finite score.")
  best = int(np.nanargmax(np.where(np.isfinite(scores), scores, -np.inf)))
  return MergeWeightSearch(
    best_weights=candidates[best],
    best_score=float(scores[best]),
    weights=candidates,
    scores=scores,
  )
