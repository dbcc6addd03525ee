# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Hyperparameter and input checks shared by every transform.

Checks run on values known at call time: Python and NumPy numbers and
concrete scalar arrays (``optax.inject_hyperparams`` calls the factory with
them in an eager ``init``). Under ``jit`` the factory is re-called with
traced arrays, which cannot be validated without a host round-trip, so
they pass through.
"""

from __future__ import annotations

from collections.abc import Mapping
import math
from typing import Any
import warnings

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import optax


def concrete_value(x: Any) -> float | None:
  """The value of a real scalar known now, else ``None``.

  Python numbers, NumPy scalars and concrete 0-d arrays (what
  ``inject_hyperparams`` passes to ``init`` outside ``jit``) are checked;
  traced values pass through.
  """
  if isinstance(x, (bool, np.bool_)) or isinstance(x, jax.core.Tracer):
    return None
  if isinstance(x, (int, float, np.number)):
    return float(x)
  if isinstance(x, (np.ndarray, jax.Array)) and x.shape == ():
    if jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(
      x.dtype, jnp.floating
    ):
      return float(x)
  return None


def _hint(value: Any) -> str:
  """Why a low-precision hyperparameter may be out of range."""
  dtype = getattr(value, "dtype", None)
  if dtype is not None and dtype in (jnp.bfloat16, jnp.float16):
    return (
      f" It is {jnp.dtype(dtype).name}, which rounds it (0.999 is 1.0 in"
      " bfloat16): under inject_hyperparams pass"
      " hyperparam_dtype=jnp.float32."
    )
  return ""


def _not_a_schedule(name: str, value: Any, schedule: bool) -> bool:
  """Whether ``value`` is a number to check; a schedule only if allowed."""
  if not callable(value):
    return True
  if schedule:
    return False
  raise TypeError(
    f"{name} takes a number, not a schedule ({value!r}); to schedule it, "
    "wrap the optimizer in optax.inject_hyperparams and pass the schedule "
    "there."
  )


def check_scalar(name: str, value: Any) -> None:
  """Raises ``ValueError`` unless ``value`` is 0-d (a shape is static, so
  traced values are checked too: a vector would broadcast silently)."""
  if jnp.ndim(value) != 0:
    raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(value)}.")


def _check_real(name: str, value: Any) -> None:
  """A bool or complex number is no hyperparameter: ``True`` as a decay
  rate, or ``False`` as a damping, passed every range check unread."""
  dtype = jnp.result_type(value)
  if jnp.issubdtype(dtype, jnp.bool_) or jnp.issubdtype(
    dtype, jnp.complexfloating
  ):
    raise TypeError(f"{name} must be a real number, got {value!r}.")


def check_positive(
  name: str,
  value: Any,
  *,
  allow_zero: bool = False,
  schedule: bool = False,
  allow_inf: bool = False,
) -> None:
  """Raises ``ValueError`` if ``value`` is not a scalar, or a concrete one is
  negative (or zero), or infinite unless ``allow_inf`` (an infinite damping
  or step size only ever gives NaN or zero updates).

  A callable is a ``TypeError`` unless ``schedule`` (the value then goes to
  an optax transform that accepts schedules).
  """
  if not _not_a_schedule(name, value, schedule):
    return
  check_scalar(name, value)
  _check_real(name, value)
  v = concrete_value(value)
  if v is not None:
    if v != v:  # NaN
      raise ValueError(f"{name} must be a number, got NaN.")
    if v < 0 or (v == 0 and not allow_zero):
      bound = ">= 0" if allow_zero else "> 0"
      raise ValueError(f"{name} must be {bound}, got {v}.{_hint(value)}")
    if v == math.inf and not allow_inf:
      raise ValueError(f"{name} must be finite, got {v}.")


def check_in_unit_interval(
  name: str, value: Any, *, closed_right: bool = False
) -> None:
  """Raises ``ValueError`` unless ``value`` is a scalar and, when concrete,
  lies in [0, 1) (``[0, 1]`` with ``closed_right``)."""
  _not_a_schedule(name, value, False)
  check_scalar(name, value)
  _check_real(name, value)
  v = concrete_value(value)
  if v is not None:
    ok = 0 <= v <= 1 if closed_right else 0 <= v < 1
    if not ok:
      interval = "[0, 1]" if closed_right else "[0, 1)"
      raise ValueError(f"{name} must lie in {interval}, got {v}.{_hint(value)}")
    # Computed in float32 without x64: 1 - 1e-8 is 1.0 there, and a decay of
    # 1 freezes a moment (or zeroes a bias correction: every step skipped).
    x64 = jax.dtypes.canonicalize_dtype(np.float64) == np.float64
    if not closed_right and not x64:
      if np.float32(v) == 1.0:
        raise ValueError(
          f"{name}={v} rounds to 1.0 in float32: use a value below "
          "1 - 6e-8, or enable x64."
        )


def check_learning_rate(value: Any) -> None:
  """A float learning rate must be >= 0; callables are schedules."""
  check_positive("learning_rate", value, allow_zero=True, schedule=True)


def _check_int(name: str, value: Any, minimum: int, must: str) -> int:
  """A Python int ``>= minimum`` (``TypeError`` saying what it ``must`` be,
  else ``ValueError``)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(
    value, (int, np.integer)
  ):
    raise TypeError(f"{name} {must}, got {type(value).__name__}.")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}.")
  return int(value)


def check_static_int(name: str, value: Any, *, minimum: int = 0) -> int:
  """Shape-setting integers must be static Python ints (``TypeError``)."""
  return _check_int(
    name,
    value,
    minimum,
    "sets array shapes and must be a static Python int (under "
    "inject_hyperparams list it in static_args)",
  )


def check_count(name: str, value: Any, *, minimum: int = 1) -> Any:
  """A count that need not set shapes (an iteration count, an interval): a
  Python int ``>= minimum``, or an integer scalar array, which is what
  ``inject_hyperparams`` passes (checked when concrete; traced ones pass,
  as every traced hyperparameter does)."""
  if isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0:
    if not jnp.issubdtype(value.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer, got {value.dtype}.")
    v = concrete_value(value)
    if v is not None and v < minimum:
      raise ValueError(f"{name} must be >= {minimum}, got {int(v)}.")
    return value
  return _check_int(
    name, value, minimum, "must be an int or an integer scalar array"
  )


def check_finite(name: str, value: Any) -> None:
  """Raises ``ValueError`` if a value known now (of any shape) holds a NaN
  or an infinity; traced values pass through."""
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(value)):
    return
  if not np.isfinite(np.asarray(value, np.float64)).all():
    raise ValueError(f"{name} must be finite, got {value!r}.")


def check_flag(name: str, value: Any) -> bool:
  """A static on/off option: ``True`` or ``False`` (NumPy bools too).

  A string such as ``"no"`` or ``None`` is refused, since Python's
  truthiness would silently read ``"no"`` as on.
  """
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(
      f"{name} must be True or False, got {value!r} ({type(value).__name__})."
    )
  return bool(value)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
  if value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {value!r}.")
  return value


def check_real_floating(tree: Any, *, what: str, function: str) -> None:
  """Raises ``TypeError`` naming the first leaf that is not a real float.

  The Fisher of every method here is defined for real parameters: a complex
  leaf would be squared where its modulus is meant, and an integer or
  boolean leaf (a step counter kept with the parameters) has no gradient.
  ``optax.MaskedNode`` and ``None`` leaves pass.

  Args:
    tree: the tree to check (params at ``init``, or per-example gradients).
    what: ``tree``'s name in the message.
    function: the caller's public name, for the message.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax.fisher import validation
    >>> validation.check_real_floating(
    ...   {"w": jnp.zeros(2, jnp.complex64)}, what="params", function="fadam"
    ... )
    Traceback (most recent call last):
    ...
    TypeError: params['w'] has dtype complex64: fadam requires real floating-point params. ...
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None and isinstance(leaf, (bool, int, float, complex)):
      dtype = np.result_type(leaf)
    if dtype is None or jnp.issubdtype(dtype, jnp.floating):
      continue
    head = (
      f"{what}{jax.tree_util.keystr(path)} has dtype {dtype}: {function} "
      f"requires real floating-point {what}."
    )
    if jnp.issubdtype(dtype, jnp.complexfloating):
      raise TypeError(
        f"{head} Complex parameters are not supported (their Fisher needs "
        "|g|^2 and conjugate transposes); keep the real and imaginary parts "
        "as two real leaves."
      )
    raise TypeError(
      f"{head} Leave integer and boolean leaves out with optax.masked or "
      "optax.partition."
    )


def _has_masked_nodes(tree: Any) -> bool:
  is_masked = lambda x: isinstance(x, optax.MaskedNode)
  return any(map(is_masked, jax.tree.leaves(tree, is_leaf=is_masked)))


def _masked_hint(tree: Any, what: str, like: Any, like_name: str) -> str:
  """Under ``optax.masked`` the inner transform sees ``MaskedNode`` leaves:
  a tree built on the full params then differs in structure."""
  masked, like_masked = _has_masked_nodes(tree), _has_masked_nodes(like)
  if masked == like_masked:
    return ""
  return (
    "\n  (optax.masked gives the inner transform optax.MaskedNode for the "
    f"leaves it skips: build {like_name if masked else what} on the masked "
    "tree.)"
  )


def check_same_structure(
  reference: Any, other: Any, *, what: str, reference_name: str = "updates"
) -> None:
  """Raises ``ValueError`` naming both tree structures when they differ."""
  ref_def = jax.tree.structure(reference)
  other_def = jax.tree.structure(other)
  if ref_def != other_def:
    raise ValueError(
      f"{what} must have the same tree structure as {reference_name}.\n"
      f"  {reference_name}: {ref_def}\n  {what}: {other_def}"
      + _masked_hint(other, what, reference, reference_name)
    )


def check_leading_axis(tree: Any, like: Any, *, what: str) -> int:
  """Checks ``tree`` = ``like`` with one extra leading axis; returns its size.

  Args:
    tree: the stacked tree, e.g. per-example gradients.
    like: a tree of the unstacked shapes, e.g. the updates.
    what: the name used in error messages.

  Returns:
    The common size of the leading axis.
  """
  check_same_structure(like, tree, what=what)
  sizes = set()
  for path, leaf, ref in zip(
    jax.tree_util.tree_flatten_with_path(tree)[0],
    jax.tree.leaves(tree),
    jax.tree.leaves(like),
  ):
    name = jax.tree_util.keystr(path[0])
    if jnp.ndim(leaf) != jnp.ndim(ref) + 1 or jnp.shape(leaf)[1:] != jnp.shape(
      ref
    ):
      raise ValueError(
        f"{what}{name} must have shape (batch, *{jnp.shape(ref)}), got "
        f"{jnp.shape(leaf)}."
      )
    sizes.add(jnp.shape(leaf)[0])
  if len(sizes) > 1:
    raise ValueError(
      f"{what} leaves disagree on the leading (batch) axis: {sorted(sizes)}."
    )
  return sizes.pop() if sizes else 0


# Where a transform's Fisher comes from: one keyword, ``fisher_source``, and
# one set of values across the library (documented in ``fisher_optax.fisher``).
FISHER_SOURCES: tuple[str, ...] = ("batch", "per_example")


def check_fisher_source(
  value: Any,
  *,
  function: str,
  legacy: Mapping[str, str] | None = None,
  stacklevel: int = 4,
) -> str:
  """Validates a ``fisher_source=`` value; old spellings warn and translate.

  Args:
    value: ``"batch"`` or ``"per_example"`` (or a key of ``legacy``).
    function: the transform's name, for messages.
    legacy: deprecated spellings this transform accepted before, mapped to
      their current value.
    stacklevel: of the deprecation warning (4: the transform's caller).

  Returns:
    The canonical value.
  """
  if legacy and value in legacy:
    warn_deprecated(
      f"{function}(fisher_source={value!r}) is deprecated; use "
      f"fisher_source={legacy[value]!r}.",
      stacklevel=stacklevel,
    )
    return legacy[value]
  return check_choice("fisher_source", value, FISHER_SOURCES)


# -- deprecations --------------------------------------------------------------


class FisherOptaxDeprecationWarning(DeprecationWarning):
  """Warned when a deprecated fisher_optax name, keyword or value is used."""


_MISSING = object()


def warn_deprecated(message: str, *, stacklevel: int = 3) -> None:
  warnings.warn(message, FisherOptaxDeprecationWarning, stacklevel=stacklevel)


def module_getattr(module: str, renamed: Mapping[str, tuple[str, Any]]):
  """A module ``__getattr__`` serving old names with a deprecation warning.

  Args:
    module: the module's ``__name__`` (for the error message).
    renamed: ``old name -> (new name, object)``.

  Returns:
    A function to assign to the module's ``__getattr__``.
  """

  def __getattr__(name: str) -> Any:
    if name in renamed:
      new, obj = renamed[name]
      warn_deprecated(
        f"{module}.{name} is deprecated; use {new}.", stacklevel=3
      )
      return obj
    raise AttributeError(f"module {module!r} has no attribute {name!r}")

  return __getattr__


def renamed_keyword(
  function: str,
  old: str,
  old_value: Any,
  new: str,
  new_value: Any,
  *,
  value_map: Mapping[Any, Any] | None = None,
  stacklevel: int = 4,
) -> Any:
  """Resolves a renamed keyword argument (``old_value`` is ``None`` if unset).

  Returns ``new_value`` when the old keyword is unset; otherwise warns and
  returns the old value (translated by ``value_map``). Passing both raises.
  ``stacklevel`` is the warning's (4: the transform's caller).
  """
  if old_value is None:
    return new_value
  if new_value is not None:
    raise TypeError(f"{function}: pass {new}= only ({old}= is deprecated).")
  translated = value_map.get(old_value, old_value) if value_map else old_value
  warn_deprecated(
    f"{function}({old}={old_value!r}) is deprecated; use {new}={translated!r}.",
    stacklevel=stacklevel,
  )
  return translated


def fisher_source_or_old_keyword(
  function: str,
  fisher_source: str | None,
  old: str,
  old_value: str | None,
  legacy: Mapping[str, str],
) -> str:
  """``fisher_source=`` for a transform that took it under another keyword.

  The old keyword and the old values (``legacy``) warn and translate; unset,
  the source is ``"batch"``. Both warnings point at the transform's caller.
  """
  value = renamed_keyword(
    function,
    old,
    old_value,
    "fisher_source",
    fisher_source,
    value_map=legacy,
    stacklevel=5,
  )
  return check_fisher_source(
    value or "batch", function=function, legacy=legacy, stacklevel=5
  )


def check_per_example_grads(
  per_example_grads: Any, updates: Any, *, function: str
) -> int:
  """The batch size of a required ``per_example_grads=`` extra argument.

  Args:
    per_example_grads: the extra argument (``None`` if it was not given).
    updates: the updates it must match, with one extra leading axis.
    function: the transform's name, for messages.

  Returns:
    The size of the leading (batch) axis (0 for a tree without leaves).

  Raises:
    ValueError: if it is missing, shaped unlike the updates, or has an
      empty batch axis.
  """
  if per_example_grads is None:
    raise ValueError(
      f'{function}(fisher_source="per_example") needs the per_example_grads '
      "extra argument in update() (the updates' tree with a leading batch "
      "axis)."
    )
  batch = check_leading_axis(
    per_example_grads, updates, what="per_example_grads"
  )
  if batch == 0 and jax.tree.leaves(updates):
    raise ValueError("per_example_grads has an empty batch axis.")
  return batch


def check_like(
  tree: Any, like: Any, *, what: str, reference_name: str = "params"
) -> None:
  """Raises ``ValueError`` unless ``tree`` has ``like``'s structure and shapes.

  The one "updates do not match params" check of the transforms: a scalar,
  transposed or otherwise reshaped leaf is refused before it can broadcast.

  Args:
    tree: the tree to check, e.g. the updates.
    like: the reference (arrays or ``jax.ShapeDtypeStruct``), e.g. params.
    what: ``tree``'s name in the message.
    reference_name: ``like``'s name in the message.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax.fisher import validation
    >>> validation.check_like(
    ...   {"w": jnp.zeros(3)}, {"w": jnp.zeros((3, 1))}, what="updates"
    ... )
    Traceback (most recent call last):
    ...
    ValueError: updates do not match params (different shapes): updates['w'] has shape (3,) where params['w'] has shape (3, 1).
  """
  ref_def = jax.tree.structure(like)
  tree_def = jax.tree.structure(tree)
  if ref_def != tree_def:
    raise ValueError(
      f"{what} do not match {reference_name}: {what} must have the same "
      f"tree structure as {reference_name}.\n  {reference_name}: {ref_def}\n"
      f"  {what}: {tree_def}" + _masked_hint(tree, what, like, reference_name)
    )
  paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  for (path, leaf), ref in zip(paths, jax.tree.leaves(like)):
    if jnp.shape(leaf) != jnp.shape(ref):
      name = jax.tree_util.keystr(path)
      raise ValueError(
        f"{what} do not match {reference_name} (different shapes): {what}"
        f"{name} has shape "
        f"{jnp.shape(leaf)} where {reference_name}{name} has shape "
        f"{jnp.shape(ref)}."
      )


def check_fisher_leaf(
  leaf: Any, *, name: str = "fisher", error: type[Exception] | None = None
) -> None:
  """Checks one leaf of a diagonal Fisher: floating, finite, non-negative.

  The value checks need concrete values: a traced leaf (under ``jit``)
  passes them.

  Args:
    leaf: the Fisher's leaf (a numpy or jax array).
    name: how messages name the leaf, e.g. ``"fisher['head']"``.
    error: the exception class raised for every problem; by default a
      ``TypeError`` for a non-floating dtype and a ``ValueError`` for
      non-finite or negative values.

  Raises:
    TypeError: (or ``error``) if the leaf is not floating point.
    ValueError: (or ``error``) if a value is non-finite or negative.

  Example:
    >>> import numpy as np
    >>> from fisher_optax.fisher.validation import check_fisher_leaf
    >>> check_fisher_leaf(np.array([0.0, 2.0]))  # a valid leaf: no error
    >>> check_fisher_leaf(np.array([1.0, -1.0]), name="fisher['w']")
    Traceback (most recent call last):
    ...
    ValueError: fisher['w'] has 1 negative entries; ...
  """
  if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
    raise (error or TypeError)(
      f"{name} has dtype {jnp.result_type(leaf)}; a Fisher must be floating "
      "point."
    )
  if isinstance(leaf, jax.core.Tracer):
    return
  arr = np.asarray(leaf)
  if arr.dtype != np.float64:  # bf16/f16 through float32
    arr = arr.astype(np.float32)
  if not np.all(np.isfinite(arr)):
    raise (error or ValueError)(
      f"{name} has non-finite values "
      f"({int(np.sum(~np.isfinite(arr)))} non-finite entries)."
    )
  if np.any(arr < 0):
    raise (error or ValueError)(
      f"{name} has {int(np.sum(arr < 0))} negative entries; a diagonal "
      "Fisher is non-negative."
    )
