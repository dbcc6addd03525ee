# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Numerics shared by the engine and every transform.

One helper per idea: the compute dtype of a statistic (at least float32),
the all-finite flag of a tree, the resolution of an optax-style mask, and
the flattening of a tree into one vector. Transforms import these instead of
writing their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
import math
import sys
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fisher_optax.fisher import validation

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


def pure_arrays(tree: PyTree) -> PyTree:
  """``tree`` with Flax NNX variables replaced by their arrays.

  ``nnx.state(model)`` and an ``nnx.Optimizer``'s state hold variables; the
  methods that take params or statistics (EWC, merging) accept either view.
  NNX is only looked up when the caller already imported it: no Flax is
  needed otherwise.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax.fisher import numerics
    >>> numerics.pure_arrays({"w": jnp.ones(2)})["w"].shape
    (2,)
  """
  nnx = sys.modules.get("flax.nnx")
  as_pure = getattr(nnx, "as_pure", None)
  return tree if as_pure is None else as_pure(tree)


def tree_all_finite(tree: PyTree) -> jax.Array:
  """A scalar bool: every element of every leaf is finite (True if empty).

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax.fisher import numerics
    >>> bool(numerics.tree_all_finite({"a": jnp.ones(2), "b": jnp.nan}))
    False
  """
  leaves = [
    jnp.all(jnp.isfinite(x))
    for x in jax.tree.leaves(tree)
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
  ]
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


def masked_like(tree: PyTree, updates: PyTree) -> PyTree:
  """``tree`` with ``optax.MaskedNode`` wherever ``updates`` holds one.

  ``optax.masked`` (and ``optax.partition``) masks the updates and params it
  hands the inner transform, not its extra arguments: a full
  ``per_example_grads`` tree then met updates with masked leaves. A tree
  that does not have the updates' structure up to those leaves is returned
  as it is, for the caller's check to report.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from fisher_optax.fisher import numerics
    >>> u = {"a": jnp.ones(2), "b": optax.MaskedNode()}
    >>> pe = {"a": jnp.ones((4, 2)), "b": jnp.ones((4, 3))}
    >>> numerics.masked_like(pe, u)["b"]
    MaskedNode()
  """
  masked = lambda x: isinstance(x, optax.MaskedNode)
  if tree is None or not any(
    masked(x) for x in jax.tree.leaves(updates, is_leaf=masked)
  ):
    return tree
  try:
    return jax.tree.map(
      lambda u, t: u if masked(u) else t, updates, tree, is_leaf=masked
    )
  except ValueError:
    return tree


def checked_per_example_grads(
  per_example_grads: PyTree, updates: PyTree, *, function: str
) -> tuple[PyTree, int]:
  """A required ``per_example_grads=`` extra, masked like ``updates``
  (:func:`masked_like`) and checked against them
  (:func:`fisher_optax.fisher.validation.check_per_example_grads`).

  Returns:
    ``(per_example_grads, batch)``: the tree to use and its batch size.
  """
  tree = masked_like(per_example_grads, updates)
  batch = validation.check_per_example_grads(tree, updates, function=function)
  return tree, batch


def zeros_like_stacked(
  leaf: Any, lead: tuple[int, ...] = (), dtype: Any = None
) -> jax.Array:
  """Zeros shaped ``(*lead, *leaf.shape)``, placed as ``leaf`` is.

  A state leaf shaped like a parameter (a momentum), or a stack of such
  (a window of gradients), made from a parameter sharded over a mesh keeps
  its sharding (the new leading axes unsharded), eagerly and under ``jit``
  with explicit axes; ``jnp.zeros`` would put all of it on one device, or
  every device.
  """
  zeros = jnp.zeros_like(leaf, dtype=dtype)
  return jnp.broadcast_to(zeros, (*lead, *jnp.shape(leaf))) if lead else zeros


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


# -- the non-finite policy -----------------------------------------------------


def tree_select(pred: jax.Array, on_true: PyTree, on_false: PyTree) -> PyTree:
  """``jnp.where(pred, on_true, on_false)`` leaf by leaf, PRNG keys included."""

  def select(a: Any, b: Any) -> Any:
    if jnp.issubdtype(jnp.result_type(a), jax.dtypes.prng_key):
      data = jnp.where(pred, jax.random.key_data(a), jax.random.key_data(b))
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(a))
    return jnp.where(pred, a, b)

  return jax.tree.map(select, on_true, on_false)


def keep_types(new: PyTree, old: PyTree) -> PyTree:
  """``new`` with ``old``'s dtypes, leaf by leaf (and its shardings, under
  explicit mesh axes, where they are part of the type).

  A state keeps the dtypes ``init`` gave it: float32 hyperparameters
  (``inject_hyperparams(..., hyperparam_dtype=jnp.float32)``) promote optax's
  bfloat16 moments, which a ``lax.cond``, a ``scan`` carry or a jitted
  loop's donated buffers would refuse or recompile for.
  """

  def keep(n: Any, o: Any) -> Any:
    dtype = jnp.result_type(o)
    n = n if jnp.result_type(n) == dtype else jnp.asarray(n).astype(dtype)
    # Under explicit mesh axes the sharding is part of the type too.
    want = explicit_spec(o)
    if want is not None and explicit_spec(n) != want:
      n = jax.sharding.reshard(n, want)
    return n

  return jax.tree.map(keep, new, old)


def explicit_axes() -> bool:
  """Whether the current mesh has explicit axes (``jax.set_mesh``), where
  shardings are part of the types and contractions must name theirs."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and jax.sharding.AxisType.Explicit in tuple(
    mesh.axis_types
  )


def varying_axes(aval: Any) -> tuple[str, ...]:
  """Manual mesh axes a value varies over (``shard_map``), any jax version.

  Args:
    aval: an abstract value (``jax.typeof(x)``) or a ``ShapeDtypeStruct``.

  Returns:
    The sorted axis names; ``()`` outside ``shard_map``.
  """
  vma = getattr(aval, "vma", None)
  if vma is None:
    vma = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
  return tuple(sorted(vma or ()))


def explicit_spec(x: Any) -> Any:
  """``x``'s ``PartitionSpec`` where it is part of its type (explicit mesh
  axes), else ``None``: the ``out_sharding`` of a product shaped like ``x``."""
  if not explicit_axes():
    return None
  sharding = getattr(jax.typeof(x), "sharding", None)
  return None if sharding is None else sharding.spec


def skip_nonfinite_step(
  step: Callable[[], tuple[PyTree, Any]],
  updates: PyTree,
  state: Any,
  *,
  inputs: PyTree = (),
) -> tuple[PyTree, Any]:
  """The one non-finite policy of every fisher_optax transform.

  A step whose gradient (``updates``) or other inputs (per-example
  gradients, Fisher statistics) hold a NaN or an infinity never runs: the
  step is behind :func:`jax.lax.cond`, so no decomposition (SVD, ``eigh``,
  Cholesky, a Newton iteration) ever sees the bad values, which matters
  because LAPACK's SVD on an infinite matrix need not terminate on XLA:CPU.
  The state is left unchanged except for its ``notfinite_count``
  (incremented, like :func:`optax.apply_if_finite`'s).

  A finite step whose new state or updates would not be finite (squares of
  1e30-sized gradients overflow float32) is skipped the same way.

  The updates of a skipped step are NaN when the incoming gradient was not
  finite, so the user sees the bad step (and an :func:`optax.apply_if_finite`
  wrapped around the transform has already rejected it), and zero otherwise
  (finite gradient with non-finite per-example gradients, or an overflow):
  ``apply_if_finite`` checks only the gradient it is given, so NaN updates
  from a finite gradient would reach the parameters.

  Args:
    step: a thunk computing ``(new_updates, new_state)`` from finite inputs.
    updates: the incoming updates (gradients).
    state: the transform's state: a NamedTuple with an int32
      ``notfinite_count`` field.
    inputs: any other arrays the step reads (checked for finiteness too).

  Returns:
    ``(updates, state)`` after the policy.

  Example:
    >>> import jax.numpy as jnp
    >>> from typing import NamedTuple
    >>> from fisher_optax.fisher import numerics
    >>> class State(NamedTuple):
    ...   total: jnp.ndarray
    ...   notfinite_count: jnp.ndarray
    >>> state = State(jnp.zeros(()), jnp.zeros((), jnp.int32))
    >>> g = jnp.array([1.0, jnp.inf])
    >>> step = lambda: (-g, state._replace(total=state.total + g.sum()))
    >>> u, state = numerics.skip_nonfinite_step(step, g, state)
    >>> bool(jnp.isnan(u).all()), float(state.total), int(state.notfinite_count)
    (True, 0.0, 1)
    >>> g = jnp.array([1e30, 1e30])
    >>> step = lambda: (-g, state._replace(total=state.total + g.sum() ** 2))
    >>> u, state = numerics.skip_nonfinite_step(step, g, state)
    >>> u.tolist(), float(state.total), int(state.notfinite_count)
    ([0.0, 0.0], 0.0, 2)
  """
  out_shape = jax.eval_shape(step)

  def checked() -> tuple[PyTree, Any, jax.Array]:
    new_updates, new_state = step()
    new_state = keep_types(new_state, state)
    return new_updates, new_state, tree_all_finite((new_updates, new_state))

  def nan_like(s: Any, u: Any) -> jax.Array:
    # Like the incoming leaf where it can: full_like keeps its sharding,
    # which a branch of the cond must match under explicit mesh axes.
    if u is not None and jnp.shape(u) == s.shape:
      return jnp.full_like(u, jnp.nan, dtype=s.dtype)
    spec = explicit_spec(s)
    return jnp.full(s.shape, jnp.nan, s.dtype, out_sharding=spec)

  def skipped() -> tuple[PyTree, Any, jax.Array]:
    if jax.tree.structure(out_shape[0]) == jax.tree.structure(updates):
      nan = jax.tree.map(nan_like, out_shape[0], updates)
    else:
      nan = jax.tree.map(lambda s: nan_like(s, None), out_shape[0])
    return nan, state, jnp.asarray(False)

  ok_in = tree_all_finite((updates, inputs))
  # The decision leaves the cond as one value. Formed outside it from a
  # flag per leaf, XLA:CPU fused that combination into every select below,
  # each then reading one operand per leaf of the tree.
  new_updates, new_state, ok = jax.lax.cond(ok_in, checked, skipped)
  new_state = jax.tree.map(lambda a, b: tree_select(ok, a, b), new_state, state)
  fill = jnp.where(tree_all_finite(updates), 0.0, jnp.nan)
  new_updates = jax.tree.map(
    lambda u: jnp.where(ok, u, fill.astype(u.dtype)), new_updates
  )
  count = state.notfinite_count
  return new_updates, new_state._replace(
    notfinite_count=jnp.where(ok, count, optax.safe_increment(count))
  )


def skipped_fill(ok: jax.Array, updates: PyTree) -> jax.Array:
  """The updates' value on a step the policy skips, for a policy folded
  into a transform's own sweep: NaN for a non-finite gradient, else 0 (an
  overflow), and 0 when ``ok``. ``updates`` are read only on a skipped
  step (see :func:`skip_nonfinite_step`)."""
  return jax.lax.cond(
    ok,
    lambda: jnp.zeros([]),
    lambda: jnp.where(tree_all_finite(updates), 0.0, jnp.nan),
  )


def finite_or_nan(fn: Callable[..., PyTree], *args: Any) -> PyTree:
  """``fn(*args)`` if every float in ``args`` is finite, else NaN outputs.

  For decompositions (``eigh``, SVD, Cholesky): ``fn`` never sees a NaN or
  an infinity, because non-finite arguments are replaced by zeros before it
  runs and its float outputs are then set to NaN. LAPACK's ``eigh``/SVD on
  an infinite matrix need not terminate on XLA:CPU. Unlike a
  :func:`jax.lax.cond`, the guard holds under :func:`jax.vmap` too (a
  batched predicate would run both branches).

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax.fisher import numerics
    >>> bad = jnp.full((2, 2), jnp.inf)
    >>> vals, _ = numerics.finite_or_nan(jnp.linalg.eigh, bad)
    >>> bool(jnp.isnan(vals).all())
    True
  """
  ok = tree_all_finite(args)
  safe = jax.tree.map(
    lambda a: (
      jnp.where(ok, a, jnp.zeros_like(a))
      if jnp.issubdtype(jnp.result_type(a), jnp.inexact)
      else a
    ),
    args,
  )

  def poison(x: Any) -> Any:
    if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
      return x
    return jnp.where(ok, x, jnp.asarray(jnp.nan, jnp.result_type(x)))

  return jax.tree.map(poison, fn(*safe))


def lane_by_lane(fn: Callable[..., PyTree]) -> Callable[..., PyTree]:
  """``fn`` that, under :func:`jax.vmap`, runs one lane at a time.

  For functions that call LAPACK decompositions (SVD, QR, ``eigh``,
  Cholesky): batched by ``vmap``, they become one batched LAPACK custom call
  each, and jaxlib 0.10.2's CPU kernels split a batch over XLA:CPU's
  intra-op thread pool and block a pool thread until it is done. Once as many
  such calls run at once as the pool has threads (two independent leaves on a
  two-core host), every pool thread waits for work only a pool thread can do
  and XLA:CPU deadlocks at 0% CPU; fewer of them still serialize badly. Under
  ``vmap`` this wrapper runs ``fn`` with :func:`jax.lax.map` instead (nested
  ``vmap`` nests the maps), so no decomposition sees a batch axis; unbatched
  arguments are closed over, not broadcast. Without ``vmap`` it is ``fn``.
  Not differentiable (an optimizer's basis refresh need not be).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from fisher_optax.fisher import numerics
    >>> qr = numerics.lane_by_lane(lambda a: jnp.linalg.qr(a)[0])
    >>> jax.vmap(qr)(jnp.ones((3, 4, 2))).shape
    (3, 4, 2)
  """

  @jax.custom_batching.custom_vmap
  def wrapped(*args: Any) -> PyTree:
    return fn(*args)

  @wrapped.def_vmap
  def _rule(axis_size: int, in_batched: Sequence[Any], *args: Any):
    del axis_size
    flags = [any(jax.tree.leaves(b)) for b in in_batched]
    lanes = tuple(a for a, b in zip(args, flags) if b)

    def one(xs: tuple[Any, ...]) -> PyTree:
      it = iter(xs)
      return wrapped(*(next(it) if b else a for a, b in zip(args, flags)))

    out = jax.lax.map(one, lanes)
    return out, jax.tree.map(lambda _: True, out)

  return wrapped


def matrix_by_matrix(fn: Callable[..., PyTree]) -> Callable[..., PyTree]:
  """``fn(a, *args)`` on ``(..., n, n)`` matrices, one matrix per call.

  Stacked matrices (``a``'s leading axes: a scanned stack's factors) go
  through :func:`jax.lax.map`, and so do :func:`jax.vmap` lanes
  (:func:`lane_by_lane`): no LAPACK decomposition inside ``fn`` sees a batch
  axis, so none can block XLA:CPU's thread pool (see :func:`lane_by_lane`).
  ``args`` (e.g. a floor) are the same for every matrix. Not
  differentiable.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from fisher_optax.fisher import numerics
    >>> vals = numerics.matrix_by_matrix(lambda a: jnp.linalg.eigh(a)[0])
    >>> jax.vmap(vals)(jnp.ones((2, 3, 4, 4))).shape
    (2, 3, 4)
  """

  def run(a: jax.Array, *args: Any) -> PyTree:
    lead = a.shape[:-2]
    if not lead or math.prod(lead) == 0:
      return fn(a, *args)
    flat = a.reshape((-1, *a.shape[-2:]))
    if flat.shape[0] == 1:
      out = jax.tree.map(lambda o: o[None], fn(flat[0], *args))
    else:
      out = jax.lax.map(lambda x: fn(x, *args), flat)
    return jax.tree.map(lambda o: o.reshape(lead + o.shape[1:]), out)

  return lane_by_lane(run)


def fresh(xs: PyTree, after: Any = None) -> PyTree:
  """``xs`` unchanged, but values XLA cannot merge with other uses of them.

  XLA keeps an elementwise value that two fusions read (a new moment, a
  denominator, even a scalar broadcast to a leaf's shape) in memory, and
  merges (CSE) equal expressions, so a square a reduction shares with an
  update becomes a leaf-sized temporary. On XLA:CPU with a donated state
  such a temporary is allocated, and above 32 MiB page-faulted, anew at
  every step. A sweep that derives its terms from its own fresh inputs
  recomputes them instead, which costs arithmetic only. ``after`` (a value
  the sweep follows, e.g. a decision) makes two barriers over the same
  arrays distinct.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax.fisher import numerics
    >>> numerics.fresh(jnp.ones(2), after=jnp.asarray(True))
    Array([1., 1.], dtype=float32)
  """
  return jax.lax.optimization_barrier((xs, after))[0]


def _wide_floats(tree: PyTree) -> list[jax.Array]:
  return [
    x.astype(jnp.promote_types(x.dtype, jnp.float32))
    for x in jax.tree.leaves(tree)
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
  ]


def squares_finite(updates: PyTree) -> jax.Array:
  """Whether the float leaves' squared norm is finite: the decision of a
  policy whose step is bounded (see :func:`skip_nonfinite`).

  False for any NaN or infinity, and for values whose squares overflow
  (in float32 at least), which would overflow a second moment.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax.fisher import numerics
    >>> [bool(numerics.squares_finite(jnp.array([x, 1.0])))
    ...  for x in (2.0, 1e30, jnp.nan)]
    [True, False, False]
  """
  zero = jnp.zeros([], jnp.float32)
  total = sum((jnp.sum(jnp.square(x)) for x in _wide_floats(updates)), zero)
  return jnp.isfinite(total)


class SkipNonfiniteState(NamedTuple):
  """State of :func:`skip_nonfinite`.

  Attributes:
    inner_state: the wrapped transform's state.
    notfinite_count: int32 number of steps skipped as non-finite (as in
      :func:`optax.apply_if_finite`'s state).
  """

  inner_state: Any
  notfinite_count: jax.Array


def skip_nonfinite(
  inner: optax.GradientTransformation,
  *,
  bounded: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Puts a transform we do not own (e.g. optax's Adam) under the policy.

  The stateful parts of an alias (the Adam partition of an optimizer, the
  Adam scaling before a projection) follow :func:`skip_nonfinite_step` like
  the library's own transforms: a non-finite input or a non-finite result
  leaves ``inner``'s state unchanged and gives NaN updates.

  ``bounded=True`` promises that ``inner``'s results are finite whenever
  the squares of its inputs are (Adam with ``eps > 0``, momentum, SGD:
  elementwise, no decomposition). The policy then needs no ``cond``: the
  step always runs, the squared norm of the updates decides, and the new
  state is selected elementwise, so XLA can update a donated state in
  place. Under the ``cond`` its outputs are temporaries as large as the
  state and the updates (Adam on one 1024 x 4096 leaf: 52 MiB, against none
  for plain Adam). A gradient whose squared norm overflows is skipped.

  Args:
    inner: any :class:`optax.GradientTransformation`.
    bounded: whether ``inner`` keeps finite inputs finite (above).

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` with state
    :class:`SkipNonfiniteState`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from fisher_optax.fisher import numerics
    >>> tx = numerics.skip_nonfinite(optax.scale_by_adam())
    >>> state = tx.init(jnp.zeros(2))
    >>> u, state = tx.update(jnp.array([1.0, jnp.nan]), state)
    >>> bool(jnp.isnan(u).all()), int(state.notfinite_count)
    (True, 1)
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: PyTree) -> SkipNonfiniteState:
    return SkipNonfiniteState(inner.init(params), jnp.zeros([], jnp.int32))

  def update_fn(
    updates: PyTree,
    state: SkipNonfiniteState,
    params: PyTree | None = None,
    **extra_args: Any,
  ) -> tuple[PyTree, SkipNonfiniteState]:
    def step() -> tuple[PyTree, SkipNonfiniteState]:
      new_updates, new_inner = inner.update(
        updates, state.inner_state, params, **extra_args
      )
      return new_updates, state._replace(inner_state=new_inner)

    if not bounded:
      return skip_nonfinite_step(step, updates, state)
    # Two sums per leaf: of the squares (the decision) and of the values
    # scaled by 2^-64 (finite exactly when the values are, at any size),
    # which sets a skipped step's updates. skipped_fill's cond made XLA
    # keep the step's updates as a temporary here (2.25 leaves of temp on
    # Adam against 1.0), and a finiteness mask is one too.
    floats = _wide_floats(updates)
    zero = jnp.zeros([], jnp.float32)
    ok = squares_finite(updates)
    values = sum((jnp.sum(x * 2.0**-64) for x in floats), zero)
    fill = jnp.where(jnp.isfinite(values), 0.0, jnp.nan)
    new_updates, new_state = step()
    new_state = keep_types(new_state, state)
    count = state.notfinite_count
    return jax.tree.map(
      lambda u: jnp.where(ok, u, fill.astype(u.dtype)), new_updates
    ), tree_select(ok, new_state, state)._replace(
      notfinite_count=jnp.where(ok, count, optax.safe_increment(count))
    )

  return optax.GradientTransformationExtraArgs(
    init_fn,
    update_fn,  # pyright: ignore[reportArgumentType]
  )


def widen_float16_state(
  inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` (e.g. optax's Adam) with float32 state for float16 params.

  Squares of float16 gradients above 256 overflow float16 (largest value
  65504), so a second moment stored in the params' float16 would make every
  such step non-finite. The state of float16 leaves is float32 instead
  (and their gradients are widened before ``inner`` sees them); other
  dtypes (bf16 has float32's range) are untouched, and the updates keep the
  incoming updates' dtypes.

  Args:
    inner: any :class:`optax.GradientTransformation`.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` with ``inner``'s state.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from fisher_optax.fisher import numerics
    >>> tx = numerics.widen_float16_state(optax.scale_by_adam())
    >>> g = jnp.full(2, 1e3, jnp.float16)
    >>> u, state = tx.update(g, tx.init(jnp.zeros(2, jnp.float16)))
    >>> u.dtype, state.nu.dtype, float(state.nu[0])
    (dtype('float16'), dtype('float32'), 1000.0)
  """
  inner = optax.with_extra_args_support(inner)

  def widen16(x: Any) -> Any:
    if jnp.result_type(x) != jnp.float16:
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return x.update(dtype=jnp.float32)
    return jnp.asarray(x, jnp.float32)  # Keeps a concrete input's sharding.

  def init_fn(params: PyTree) -> Any:
    return inner.init(jax.tree.map(widen16, params))

  def update_fn(
    updates: PyTree,
    state: Any,
    params: PyTree | None = None,
    **extra_args: Any,
  ) -> tuple[PyTree, Any]:
    # The gradients too: optax squares them before promoting.
    wide = jax.tree.map(widen16, updates)
    new_updates, new_state = inner.update(wide, state, params, **extra_args)
    new_updates = jax.tree.map(
      lambda n, u: n.astype(jnp.result_type(u)), new_updates, updates
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(
    init_fn,
    update_fn,  # pyright: ignore[reportArgumentType]
  )


def _is_guarded(node: Any) -> bool:
  """A state that follows :func:`skip_nonfinite_step` (has the count)."""
  return isinstance(node, tuple) and "notfinite_count" in getattr(
    node, "_fields", ()
  )


def _rewind_after_skip(
  updates: PyTree,
  old_parts: Sequence[Any],
  new_parts: Sequence[Any],
  guarded: Sequence[bool],
) -> tuple[PyTree, list[Any]]:
  """Undoes every part of a step that one guarded part skipped.

  A guarded part handles its own skip; it is rewound (keeping its count)
  only when another guarded part skipped, so with one guarded part its
  state (a large window) is never selected. Every other part keeps its old
  state. The updates of a skipped step keep their NaNs (a non-finite
  gradient, for the user to see) and are zero elsewhere: a weight decay
  after the skipped part, or a partition that did not skip, must not move
  the parameters either.
  """
  skips = {
    i: new.notfinite_count != old.notfinite_count
    for i, (old, new, g) in enumerate(zip(old_parts, new_parts, guarded))
    if g
  }

  def any_skip(exclude: int | None = None) -> jax.Array:
    flags = [s for i, s in skips.items() if i != exclude]
    return functools.reduce(jnp.logical_or, flags, jnp.asarray(False))

  def kept(i: int, old: Any, new: Any) -> Any:
    if i not in skips:
      return tree_select(any_skip(), old, new)
    if len(skips) == 1:
      return new
    rewound = old._replace(notfinite_count=new.notfinite_count)
    return tree_select(any_skip(exclude=i), rewound, new)

  skipped = any_skip()
  updates = jax.tree.map(
    lambda u: jnp.where(skipped & ~jnp.isnan(u), jnp.zeros_like(u), u),
    updates,
  )
  parts = [
    kept(i, old, keep_types(new, old))
    for i, (old, new) in enumerate(zip(old_parts, new_parts))
  ]
  return updates, parts


def chain_following(
  chain: optax.GradientTransformation,
  index: int | Sequence[int],
  *,
  check_params: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """An alias's ``optax.chain`` whose every part follows its method's skips.

  The transforms at ``index`` of ``chain`` follow :func:`skip_nonfinite_step`
  (their states have ``notfinite_count``). On a step one of them skipped,
  the chain's other states (momentum, a schedule's count) keep their old
  value too, as if the step had not happened, and the updates are the
  skipped part's (NaN for a non-finite gradient, else zero) whatever the
  parts after it do (a weight decay adds nothing). A guarded part's own
  state is selected only when another guarded part skipped, so with one
  guarded part a large window in it is never copied.

  Args:
    chain: the alias's ``optax.chain(...)``.
    index: the position of the method's transform in the chain, or the
      positions of several guarded parts.
    check_params: refuse ``updates`` that do not match ``params`` before any
      part can broadcast them (e.g. a weight decay before the method).

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` with ``chain``'s state.
  """
  guarded = (index,) if isinstance(index, int) else tuple(index)
  chain = optax.with_extra_args_support(chain)

  def update_fn(
    updates: PyTree,
    state: tuple[Any, ...],
    params: PyTree | None = None,
    **extra_args: Any,
  ) -> tuple[PyTree, tuple[Any, ...]]:
    if check_params and params is not None:
      validation.check_like(updates, params, what="updates")
    new_updates, new_state = chain.update(updates, state, params, **extra_args)
    new_state = cast(tuple[Any, ...], new_state)
    flags = [i in guarded for i in range(len(state))]
    new_updates, parts = _rewind_after_skip(
      new_updates, state, new_state, flags
    )
    return new_updates, tuple(parts)

  return optax.GradientTransformationExtraArgs(
    chain.init,
    update_fn,  # pyright: ignore[reportArgumentType]
  )


def follow_skips(
  inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Any composition (e.g. an :func:`optax.partition`) skips as one step.

  Every state inside ``inner`` that follows :func:`skip_nonfinite_step`
  (has ``notfinite_count``) is found in the state tree. When any of them
  skips a step, the whole step is undone as in :func:`chain_following`:
  the other states keep their old values (the skipping ones count the
  skip), and the updates are zero but for the NaNs of a non-finite
  gradient. So an optimizer that sends matrices to one method and the rest
  to Adam never applies half a step.

  Args:
    inner: any :class:`optax.GradientTransformation` built from the
      library's transforms (or :func:`skip_nonfinite`-wrapped ones).

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` with ``inner``'s state.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from fisher_optax.fisher import numerics
    >>> adam = numerics.skip_nonfinite(optax.scale_by_adam())
    >>> tx = numerics.follow_skips(optax.partition(
    ...     {"a": adam, "b": adam}, {"x": "a", "y": "b"}))
    >>> params = {"x": jnp.zeros(2), "y": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> grads = {"x": jnp.array([1.0, jnp.nan]), "y": jnp.ones(2)}
    >>> u, new_state = tx.update(grads, state)
    >>> u["y"].tolist()  # The step is undone for "y" too.
    [0.0, 0.0]
    >>> int(new_state.inner_states["b"].inner_state.inner_state.count)
    0
  """
  inner = optax.with_extra_args_support(inner)

  def update_fn(
    updates: PyTree,
    state: Any,
    params: PyTree | None = None,
    **extra_args: Any,
  ) -> tuple[PyTree, Any]:
    new_updates, new_state = inner.update(updates, state, params, **extra_args)
    old_parts, treedef = jax.tree.flatten(state, is_leaf=_is_guarded)
    new_parts = treedef.flatten_up_to(new_state)
    flags = [_is_guarded(p) for p in old_parts]
    new_updates, parts = _rewind_after_skip(
      new_updates, old_parts, new_parts, flags
    )
    return new_updates, treedef.unflatten(parts)

  return optax.GradientTransformationExtraArgs(
    inner.init,
    update_fn,  # pyright: ignore[reportArgumentType]
  )
