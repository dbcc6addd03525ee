# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Dimension numbers: which axes of a leaf form the matrix an optimizer sees.

Matrix optimizers (Muon, GaLore, and here FISMO and Natural GaLore) act on
a leaf as a linear map. Optax names, per leaf, the *reduction* axes (the
rows: fan-in) and the *output* axes (the columns: fan-out) with
:class:`optax.contrib.MuonDimensionNumbers` or
:class:`optax.contrib.GaLoreDimensionNumbers` (the two have the same
fields); every other axis is a *batch* axis, holding independent matrices.
This module is the one place where such a specification is resolved and a
leaf is reshaped to its matrices and back:

* :func:`resolve` turns a user's specification (``None``, one
  dimension-numbers object, a tree of them, or a callable returning a tree)
  into one dimension-numbers object (or ``None``: the leaf is left out) per
  leaf, validating every axis against the leaf's rank.
* :func:`plan` turns one leaf's shape and dimension numbers into a static
  :class:`LeafPlan`, whose :meth:`LeafPlan.to_matrices` /
  :meth:`LeafPlan.to_matrix` / :meth:`LeafPlan.from_matrix` do the
  reshapes; :func:`plans` does both steps for a whole tree.

Resolution rules (those of :func:`optax.contrib.muon`):

* ``None``: every rank-2 leaf gets the default numbers (rows = axis 0,
  columns = axis 1); other leaves are left out.
* one dimension-numbers object: given to every leaf of rank >= 2 and
  validated against each (leaves of rank < 2 are left out).
* a tree with the structure of the params (or a prefix of it) holding
  dimension numbers or ``None``, or a callable ``params -> such a tree``.

Axes are Python or NumPy integers. Invalid numbers raise ``ValueError``
naming the leaf: an axis that is not an integer or is out of range for the
leaf's rank, an empty, repeated or overlapping reduction/output
axis, a leaf of rank < 2 given numbers, and (for ``batch_axes=False``) any
axis left over as a batch axis. Axes are never wrapped modulo the rank.

Example:
  >>> import jax.numpy as jnp
  >>> from optax.contrib import MuonDimensionNumbers
  >>> from fisher_optax import _matrix_view as matrix_view
  >>> params = {"conv": jnp.zeros((3, 3, 8, 16)), "b": jnp.zeros(16)}
  >>> dims = {"conv": MuonDimensionNumbers((0, 1, 2), 3), "b": None}
  >>> b_plan, conv_plan = matrix_view.plans(dims, params)  # leaves order
  >>> b_plan is None
  True
  >>> conv_plan.stacked_shape
  (1, 72, 16)
  >>> x = jnp.arange(3 * 3 * 8 * 16.0).reshape(3, 3, 8, 16)
  >>> bool(jnp.all(conv_plan.from_matrix(conv_plan.to_matrix(x)) == x))
  True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from optax.contrib import GaLoreDimensionNumbers
from optax.contrib import MuonDimensionNumbers

from fisher_optax.fisher import numerics

PyTree = Any
DimensionNumbers = MuonDimensionNumbers | GaLoreDimensionNumbers
DimensionNumbersSpec = (
  DimensionNumbers | PyTree | Callable[[PyTree], PyTree] | None
)

_KINDS = (MuonDimensionNumbers, GaLoreDimensionNumbers)


def is_dimension_numbers(x: Any) -> bool:
  """Whether ``x`` is a Muon or GaLore dimension-numbers object."""
  return isinstance(x, _KINDS)


def is_spec_leaf(x: Any) -> bool:
  """``is_leaf`` for a tree of dimension numbers: numbers and ``None``.

  Dimension numbers are NamedTuples, hence pytree nodes; pass this to
  ``jax.tree`` functions so they are treated as leaves.
  """
  return x is None or is_dimension_numbers(x)


class LeafPlan(NamedTuple):
  """Static layout of one leaf seen as a batch of ``(rows, cols)`` matrices.

  Built by :func:`plan`. All fields are Python ints/tuples (hashable and
  usable under ``jit``); axes are non-negative.

  Attributes:
    shape: the leaf's shape.
    batch_axes: the axes not named by the dimension numbers, in order.
    reduction_axes: the axes flattened into the rows (fan-in).
    output_axes: the axes flattened into the columns (fan-out).
  """

  shape: tuple[int, ...]
  batch_axes: tuple[int, ...]
  reduction_axes: tuple[int, ...]
  output_axes: tuple[int, ...]

  @property
  def perm(self) -> tuple[int, ...]:
    """The transpose taking the leaf to ``(*batch, *reduction, *output)``."""
    return self.batch_axes + self.reduction_axes + self.output_axes

  @property
  def batch(self) -> int:
    """Number of matrices: the product of the batch axes (1 if none)."""
    return math.prod(self.shape[a] for a in self.batch_axes)

  @property
  def rows(self) -> int:
    """``m``: the product of the reduction axes."""
    return math.prod(self.shape[a] for a in self.reduction_axes)

  @property
  def cols(self) -> int:
    """``n``: the product of the output axes."""
    return math.prod(self.shape[a] for a in self.output_axes)

  @property
  def matrix_shape(self) -> tuple[int, int]:
    """``(rows, cols)``."""
    return (self.rows, self.cols)

  @property
  def stacked_shape(self) -> tuple[int, int, int]:
    """``(batch, rows, cols)``."""
    return (self.batch, self.rows, self.cols)

  def to_matrices(self, x: jax.Array) -> jax.Array:
    """The leaf ``x`` as a ``(batch, rows, cols)`` stack of matrices."""
    return jnp.transpose(x, self.perm).reshape(self.stacked_shape)

  def to_matrix(self, x: jax.Array) -> jax.Array:
    """The leaf ``x`` as one ``(rows, cols)`` matrix (no batch axes).

    Raises:
      ValueError: if the plan has batch axes (use :meth:`to_matrices`).
    """
    if self.batch_axes:
      raise ValueError(
        f"a leaf of shape {self.shape} with batch axes {self.batch_axes} "
        "is a stack of matrices; use to_matrices."
      )
    return jnp.transpose(x, self.perm).reshape(self.matrix_shape)

  def from_matrix(self, y: jax.Array) -> jax.Array:
    """Inverse of :meth:`to_matrix` / :meth:`to_matrices`: back to ``shape``.

    Args:
      y: ``(rows, cols)`` or ``(batch, rows, cols)``.

    Returns:
      ``y`` reshaped and transposed to the leaf's ``shape``.
    """
    perm = self.perm
    permuted = tuple(self.shape[a] for a in perm)
    inverse = tuple(sorted(range(len(perm)), key=lambda i: perm[i]))
    return jnp.transpose(jnp.reshape(y, permuted), inverse)


def _as_tuple(axes: Any) -> tuple[Any, ...]:
  """``axes`` as a tuple: a lone axis (a Python or NumPy integer, or
  anything else that is not iterable, refused later) is wrapped."""
  if isinstance(axes, (int, np.integer)):
    return (axes,)
  try:
    return tuple(axes)
  except TypeError:
    return (axes,)


def _is_axis(a: Any) -> bool:
  """Whether ``a`` is an integer axis: Python or NumPy, not a bool."""
  return isinstance(a, (int, np.integer)) and not isinstance(
    a, (bool, np.bool_)
  )


def plan(
  shape: Sequence[int],
  dims: DimensionNumbers,
  *,
  batch_axes: bool = True,
  name: str = "",
) -> LeafPlan:
  """Validates ``dims`` against a leaf's shape and returns its plan.

  Args:
    shape: the leaf's shape.
    dims: its dimension numbers (negative axes count from the end).
    batch_axes: whether axes outside the reduction and output axes are
      allowed (as batch axes); ``False`` requires the two to cover every
      axis.
    name: the leaf's path, for error messages.

  Returns:
    The leaf's :class:`LeafPlan`.

  Raises:
    ValueError: if the leaf has rank < 2, or an axis is not an integer,
      out of range, repeated, shared by both sides, or
      (``batch_axes=False``) unused.
  """
  shape = tuple(int(d) for d in shape)
  ndim = len(shape)
  leaf = f"leaf {name} (shape {shape})" if name else f"a leaf of shape {shape}"
  if not is_dimension_numbers(dims):
    raise ValueError(
      f"dimension numbers for {leaf} must be MuonDimensionNumbers, "
      f"GaLoreDimensionNumbers or None, got {dims!r}."
    )
  if ndim < 2:
    raise ValueError(
      f"{leaf} was given dimension numbers {dims}, but a matrix view needs "
      "rank >= 2; give it None to leave it out."
    )
  red = _as_tuple(dims.reduction_axis)
  out = _as_tuple(dims.output_axis)
  bad = [a for a in red + out if not _is_axis(a)]
  if bad:
    raise ValueError(
      f"dimension numbers {dims} for {leaf} name non-integer axes {bad}: "
      "axes must be Python or NumPy ints."
    )
  if any(not -ndim <= a < ndim for a in red + out):
    raise ValueError(
      f"dimension numbers {dims} for {leaf} are out of range: axes must be "
      f"ints in [-{ndim}, {ndim})."
    )
  # Python ints: the plan is static (hashed as a jit cache key).
  red = tuple(int(a) % ndim for a in red)
  out = tuple(int(a) % ndim for a in out)
  if (
    not red
    or not out
    or len(set(red)) != len(red)
    or len(set(out)) != len(out)
    or set(red) & set(out)
  ):
    raise ValueError(
      f"dimension numbers {dims} for {leaf} must name non-empty, disjoint "
      "reduction and output axes, each axis once."
    )
  batch = tuple(a for a in range(ndim) if a not in red + out)
  if batch and not batch_axes:
    raise ValueError(
      f"dimension numbers {dims} for {leaf} must split all {ndim} axes into "
      f"disjoint reduction and output axes; axes {batch} are left over."
    )
  return LeafPlan(
    shape=shape, batch_axes=batch, reduction_axes=red, output_axes=out
  )


def resolve(
  spec: DimensionNumbersSpec,
  tree: PyTree,
  *,
  kind: type = MuonDimensionNumbers,
  batch_axes: bool = True,
  name: str = "weight_dimension_numbers",
) -> list[DimensionNumbers | None]:
  """One validated dimension-numbers object (or ``None``) per leaf of ``tree``.

  Args:
    spec: ``None``, one dimension-numbers object, a tree (or prefix) of them
      with ``None`` for leaves left out, or a callable ``tree -> such a
      tree`` (see the module docstring for the rules).
    tree: the params or updates; only shapes are read. ``optax.MaskedNode``
      subtrees have no leaves and get no entry.
    kind: the class used for the default numbers (``spec=None``).
    batch_axes: see :func:`plan`.
    name: the argument's name, for error messages.

  Returns:
    A list aligned with ``jax.tree.leaves(tree)``.

  Raises:
    ValueError: if the tree of numbers does not match ``tree``'s structure,
      or any leaf's numbers are invalid (see :func:`plan`).
  """
  # Plain arrays (nnx.Optimizer's init passes NNX variables, one leaf each):
  # a callable then sees the paths the updates have ("['kernel']", not
  # "['kernel'].value"), at init as at every step.
  tree = numerics.pure_arrays(tree)
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  dims: list[Any]
  if spec is None:
    dims = [kind() if jnp.ndim(x) == 2 else None for _, x in path_leaves]
  elif is_dimension_numbers(spec):
    dims = [spec if jnp.ndim(x) >= 2 else None for _, x in path_leaves]
  else:
    given = spec(tree) if callable(spec) else spec
    try:
      broadcast = jax.tree.map(
        lambda d, sub: jax.tree.map(lambda _: d, sub),
        given,
        tree,
        is_leaf=is_spec_leaf,
      )
      dims = treedef.flatten_up_to(broadcast)
    except (ValueError, TypeError) as e:
      raise ValueError(
        f"{name} must be dimension numbers, None, or a tree of them with the "
        "structure of (a prefix of) the params.\n"
        f"  params: {treedef}\n"
        f"  {name}: {jax.tree.structure(given, is_leaf=is_spec_leaf)}"
      ) from e
  for (path, x), d in zip(path_leaves, dims):
    if d is not None:
      plan(
        jnp.shape(x),
        d,
        batch_axes=batch_axes,
        name=jax.tree_util.keystr(path),
      )
  return dims


def plans(
  spec: DimensionNumbersSpec,
  tree: PyTree,
  *,
  kind: type = MuonDimensionNumbers,
  batch_axes: bool = True,
  name: str = "weight_dimension_numbers",
) -> list[LeafPlan | None]:
  """:func:`resolve`, then :func:`plan` for every leaf that has numbers.

  Returns:
    A list aligned with ``jax.tree.leaves(tree)``: a :class:`LeafPlan`, or
    ``None`` for leaves left out.
  """
  dims = resolve(spec, tree, kind=kind, batch_axes=batch_axes, name=name)
  return [
    None if d is None else plan(jnp.shape(x), d, batch_axes=batch_axes)
    for x, d in zip(jax.tree.leaves(tree), dims)
  ]
