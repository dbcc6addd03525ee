# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Numerics shared by the engine and every transform.

One helper per idea: the compute dtype of a statistic (at least float32),
the all-finite flag of a tree, the resolution of an optax-style mask, and
the flattening of a tree into one vector. Transforms import these instead of
writing their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
MaskOrFn = PyTree | Callable[[PyTree], PyTree] | None


def compute_dtype(x: Any) -> jnp.dtype:
  """The dtype statistics are computed in: ``x``'s float dtype, >= float32.

  Args:
    x: an array, a ``ShapeDtypeStruct``, a dtype or a Python scalar.

  Returns:
    ``float32`` for bf16/f16/f32 (and integer) inputs, ``float64`` for f64.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax.fisher import numerics
    >>> numerics.compute_dtype(jnp.zeros(2, jnp.bfloat16))
    dtype('float32')
  """
  dtype = x if isinstance(x, (np.dtype, type)) else jnp.result_type(x)
  return jnp.promote_types(dtype, jnp.float32)


def widen(tree: PyTree) -> PyTree:
  """Casts every leaf of ``tree`` to its :func:`compute_dtype`."""
  return jax.tree.map(lambda x: jnp.asarray(x, compute_dtype(x)), tree)


def canonical_float_dtype(name: str, dtype: Any) -> jnp.dtype | None:
  """Canonicalizes an optional state-dtype argument (``None`` passes through).

  Raises:
    TypeError: if ``dtype`` is not a floating dtype.
  """
  if dtype is None:
    return None
  try:
    dtype = jax.dtypes.canonicalize_dtype(dtype)
  except TypeError as e:
    raise TypeError(f"{name} must be a float dtype, got {dtype!r}.") from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name} must be a float dtype, got {dtype}.")
  return dtype


def tree_all_finite(tree: PyTree) -> jax.Array:
  """A scalar bool: every element of every leaf is finite (True if empty).

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax.fisher import numerics
    >>> bool(numerics.tree_all_finite({"a": jnp.ones(2), "b": jnp.nan}))
    False
  """
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def resolve_mask(
  mask: MaskOrFn, params: PyTree, *, name: str = "mask"
) -> PyTree:
  """Resolves an optax-style mask to a tree of Python bools shaped like params.

  Args:
    mask: ``None`` (every leaf), a pytree of bools with the structure of
      ``params`` or a prefix of it, or a callable ``params -> such a tree``.
    params: the parameters (or updates) the mask applies to.
    name: the argument's name in error messages.

  Returns:
    A tree with the structure of ``params`` and a Python ``bool`` per leaf.

  Raises:
    ValueError: if the mask's structure is not a prefix of ``params``'.
    TypeError: if a mask leaf is not a Python bool (the mask decides the
      program's structure, so it must be static).
  """
  if mask is None:
    return jax.tree.map(lambda _: True, params)
  resolved = mask(params) if callable(mask) else mask
  try:
    full = jax.tree.broadcast(resolved, params, is_leaf=lambda x: x is None)
  except ValueError as e:
    raise ValueError(
      f"{name} must be a pytree of bools with the structure of the params "
      f"(or a prefix of it): {e}"
    ) from e
  for m in jax.tree.leaves(full):
    if not isinstance(m, (bool, np.bool_)):
      raise TypeError(
        f"{name} leaves must be Python bools (the mask decides the program's "
        f"structure), got {type(m).__name__}."
      )
  return jax.tree.map(bool, full)


def ravel(tree: PyTree, dtype: Any = None) -> jax.Array:
  """Concatenates the leaves of ``tree`` into one vector (optionally cast)."""
  leaves = [jnp.ravel(x) for x in jax.tree.leaves(tree)]
  if not leaves:
    return jnp.zeros((0,), dtype or jnp.float32)
  flat = jnp.concatenate(leaves)
  return flat if dtype is None else flat.astype(dtype)


def unravel(flat: jax.Array, like: PyTree) -> PyTree:
  """Inverse of :func:`ravel`: splits ``flat`` into leaves shaped like ``like``.

  Leaves keep ``flat``'s dtype; cast afterwards where ``like``'s matters.
  """
  leaves, treedef = jax.tree.flatten(like)
  sizes = [int(np.prod(np.shape(x))) for x in leaves]
  parts = jnp.split(flat, np.cumsum(sizes)[:-1]) if leaves else []
  return jax.tree.unflatten(
    treedef, [p.reshape(np.shape(x)) for p, x in zip(parts, leaves)]
  )
