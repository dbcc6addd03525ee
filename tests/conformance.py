# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The conformance checks every public fisher_optax transform must pass.

They mirror ``optax/contrib/_common_test.py``. A :class:`Case` describes one
transform (its factory, keyword arguments, what follows it in a chain, the
extra arguments its ``update`` needs); each ``check_*`` function takes a
``TestCase`` and a :class:`Case`. ``tests/conformance_test.py`` holds the one
table of cases and runs every check on every case.

Every check runs under ``jit``. Compiles are shared where two checks can use
the same program (the jitted steps are cached per case), and shapes are tiny.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
import logging
import re
from typing import Any

import chex
import jax
import jax.numpy as jnp
import optax

PyTree = Any


def parabola(dtype):
  init = jnp.array([-1.0, 10.0, 1.0], dtype=dtype)
  final = jnp.array([1.0, -1.0, 1.0], dtype=dtype)
  return init, final, lambda p: jnp.sum(jnp.square(p - final))


def rosenbrock(dtype):
  init = jnp.array([0.0, 0.0], dtype=dtype)
  final = jnp.array([1.0, 1.0], dtype=dtype)
  return (
    init,
    final,
    lambda p: (1.0 - p[0]) ** 2 + 100.0 * (p[1] - p[0] ** 2) ** 2,
  )


def matrix_parabola(dtype):
  init = jnp.zeros((2, 2), dtype=dtype)
  final = jnp.array([[3.0, -2.0], [1.0, 4.0]], dtype=dtype)
  return init, final, lambda p: jnp.sum(jnp.square(p - final))


def mixed_tensors(dtype):
  init = (jnp.zeros((3,), dtype), jnp.zeros((2, 2), dtype))
  final = (
    jnp.array([1.0, -1.0, 2.0], dtype),
    jnp.array([[1.0, 0.0], [-1.0, 1.0]], dtype),
  )

  def obj(p):
    return jnp.sum(jnp.square(p[0] - final[0])) + jnp.sum(
      jnp.square(p[1] - final[1])
    )

  return init, final, obj


TARGETS: dict[str, Callable[..., Any]] = {
  "parabola": parabola,
  "rosenbrock": rosenbrock,
  "matrix_parabola": matrix_parabola,
  "mixed_tensors": mixed_tensors,
}

DEFAULT_STEPS = {
  "parabola": 3000,
  "rosenbrock": 10000,
  "matrix_parabola": 3000,
  "mixed_tensors": 3000,
}

# Gradient values fed by check_nonfinite_gradients (0.0 is checked strictly).
BAD_VALUES = {
  "zero": 0.0,
  "nan": float("nan"),
  "pos_inf": float("inf"),
  "neg_inf": float("-inf"),
  "huge": 1e30,
}

_UNKNOWN_EXTRA = "an_unexpected_extra_arg_nobody_expects"


def per_example_grads(grads: PyTree) -> dict[str, PyTree]:
  """A batch of two examples whose mean is ``grads``: ``g + d`` and ``g - d``.

  ``d`` is a fixed small tree, so the per-example Fisher has rank two and
  a bad value in ``grads`` reaches every example.
  """

  def two(g):
    d = 0.1 * jnp.cos(jnp.arange(g.size, dtype=jnp.float32)).reshape(g.shape)
    d = d.astype(g.dtype)
    return jnp.stack([g + d, g - d])

  return {"per_example_grads": jax.tree.map(two, grads)}


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
  """One row of the conformance table.

  Attributes:
    name: the row's name (test ids end with it).
    factory: the public transform, e.g. ``fisher_optax.fadam``.
    kwargs: keyword arguments of ``factory`` (no learning rate).
    then: what follows the transform in the chain that is trained, given the
      learning rate (e.g. ``optax.scale_by_learning_rate`` after a
      ``scale_by_*``, ``optax.adam`` after a penalty or an estimator); None
      when ``factory`` is an optimizer alias taking ``learning_rate``.
    learning_rate: the default learning rate.
    target_learning_rate: per-target learning rates for the convergence check.
    steps: convergence targets and their step counts.
    tol: convergence tolerance (absolute and relative).
    injectable: hyperparameters of ``factory`` that ``inject_hyperparams``
      must turn into state arrays (``learning_rate`` included for aliases).
    static_args: arguments ``inject_hyperparams`` must keep static.
    extras: extra ``update`` arguments as a function of the gradients.
    stable_dtypes: parameter dtypes the lax.cond check runs.
    inject_tol: tolerance of the inject_hyperparams comparison.
    covers: the public name the row covers (default: the factory's name).
  """

  name: str
  factory: Callable[..., optax.GradientTransformation]
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  then: Callable[[Any], optax.GradientTransformation] | None = None
  learning_rate: float = 1e-2
  target_learning_rate: dict[str, float] = dataclasses.field(
    default_factory=dict
  )
  steps: dict[str, int] = dataclasses.field(
    default_factory=lambda: dict(DEFAULT_STEPS)
  )
  tol: float = 3e-2
  injectable: tuple[str, ...] = ()
  static_args: tuple[str, ...] = ()
  extras: Callable[[PyTree], dict[str, Any]] | None = None
  stable_dtypes: tuple[Any, ...] = (
    jnp.float16,
    jnp.bfloat16,
    jnp.float32,
    jnp.float64,
  )
  inject_tol: float = 1e-5
  covers: str = ""

  def make(self, learning_rate: Any = None) -> optax.GradientTransformation:
    """The chain that is trained (the transform and what follows it)."""
    lr = self.learning_rate if learning_rate is None else learning_rate
    if self.then is None:
      return self.factory(learning_rate=lr, **self.kwargs)
    return optax.chain(self.factory(**self.kwargs), self.then(lr))

  def factory_kwargs(self) -> dict[str, Any]:
    """The factory's own keyword arguments (learning rate for aliases)."""
    if self.then is None:
      return {"learning_rate": self.learning_rate, **self.kwargs}
    return dict(self.kwargs)

  def extra_args(self, grads: PyTree) -> dict[str, Any]:
    return {} if self.extras is None else self.extras(grads)


def _step_fn(case: Case, opt, obj_fn, extra_unknown: bool = False):
  def step(params, state):
    grads = jax.grad(obj_fn)(params)
    extras = case.extra_args(grads)
    if extra_unknown:
      extras[_UNKNOWN_EXTRA] = 1.0
    updates, state = opt.update(grads, state, params, **extras)
    return optax.apply_updates(params, updates), state

  return step


class _CompileCounter(logging.Handler):
  def __init__(self):
    super().__init__()
    self.records: list[str] = []

  def emit(self, record):
    if "Finished XLA compilation" in record.getMessage() or (
      "Compiling" in record.getMessage()
    ):
      self.records.append(record.getMessage())


# -- the checks ----------------------------------------------------------------


def check_converges(test, case: Case):
  """Every target converges; all targets' scans run in ONE jit."""
  problems, inits = {}, {}
  for name, steps in case.steps.items():
    init, final, obj = TARGETS[name](jnp.float32)
    opt = case.make(case.target_learning_rate.get(name))
    problems[name] = (_step_fn(case, opt, obj), steps, final)
    inits[name] = (init, opt.init(init))

  @jax.jit
  def run(inits):
    out = {}
    for name, carry in inits.items():
      step, steps, _ = problems[name]
      out[name] = jax.lax.scan(
        lambda c, _, step=step: (step(*c), None), carry, length=steps
      )[0][0]
    return out

  for name, params in run(inits).items():
    with test.subTest(target=name):
      chex.assert_tree_all_finite(params)
      chex.assert_trees_all_close(
        params, problems[name][2], atol=case.tol, rtol=case.tol
      )


@functools.cache
def _scheduled_step(case: Case):
  """A jitted step on mixed_tensors with a scheduled learning rate and an
  unknown extra argument, shared by the recompile and schedule checks."""
  init, _, obj = TARGETS["mixed_tensors"](jnp.float32)
  lr = case.learning_rate
  opt = case.make(optax.linear_schedule(lr, 0.1 * lr, 50))
  step = jax.jit(_step_fn(case, opt, obj, extra_unknown=True))
  return step, init, opt.init(init)


def check_ignores_unknown_extras_and_no_recompile(test, case: Case):
  step, params, state = _scheduled_step(case)
  params, state = step(params, state)
  handler = _CompileCounter()
  logger = logging.getLogger("jax")
  old_level = logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.DEBUG)
  try:
    with jax.log_compiles(True):
      params, state = step(params, state)
  finally:
    logger.removeHandler(handler)
    logger.setLevel(old_level)
  test.assertEmpty(handler.records, "update recompiled on its second call")
  chex.assert_tree_all_finite(params)


def check_learning_rate_schedule(test, case: Case):
  step, init, state = _scheduled_step(case)
  params = init
  for _ in range(3):
    params, state = step(params, state)
  chex.assert_tree_all_finite(params)
  test.assertFalse(
    all(
      bool(jnp.all(a == b))
      for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(init))
    ),
    "a scheduled learning rate produced no update",
  )


def check_inject_hyperparams(test, case: Case):
  """inject_hyperparams on the factory itself gives the same updates."""
  kwargs = case.factory_kwargs()
  opt = case.factory(**kwargs)
  injected = optax.inject_hyperparams(
    case.factory, static_args=case.static_args
  )(**kwargs)
  params = (-jnp.ones((3, 4)), jnp.ones((5,)), jnp.ones((2, 3, 4)))
  grads_seq = [
    jax.tree.map(
      lambda x, i=i: jnp.cos(
        x * (i + 1.0) + jnp.arange(x.size).reshape(x.shape)
      ),
      params,
    )
    for i in range(3)
  ]
  hyperparams = injected.init(params).hyperparams
  for name in case.injectable:
    test.assertIn(name, hyperparams, f"{name} is not injectable")
  # One compile for both inits and one for both updates.
  s1, s2 = jax.jit(lambda p: (opt.init(p), injected.init(p)))(params)

  @jax.jit
  def update_both(g, s1, s2, params):
    extras = case.extra_args(g)
    return (
      opt.update(g, s1, params, **extras),
      injected.update(g, s2, params, **extras),
    )

  for g in grads_seq:
    (u1, s1), (u2, s2) = update_both(g, s1, s2, params)
    chex.assert_trees_all_close(
      u1, u2, rtol=case.inject_tol, atol=0.1 * case.inject_tol
    )
  chex.assert_trees_all_close(
    s2.inner_state, s1, rtol=case.inject_tol, atol=0.1 * case.inject_tol
  )


def check_inject_hyperparams_low_precision(test, case: Case):
  """bfloat16 params with float32 hyperparameters (``hyperparam_dtype``):
  the state keeps its dtypes across jitted steps and the updates are finite
  (float32 hyperparameters used to promote optax's bfloat16 moments, which
  the non-finite policy's ``lax.cond`` refused)."""
  injected = optax.inject_hyperparams(
    case.factory, static_args=case.static_args, hyperparam_dtype=jnp.float32
  )(**case.factory_kwargs())
  params = (
    -jnp.ones((3, 4), jnp.bfloat16),
    jnp.ones((5,), jnp.bfloat16),
    jnp.ones((2, 3, 4), jnp.bfloat16),
  )
  state = injected.init(params)

  @jax.jit
  def update(g, state, params):
    return injected.update(g, state, params, **case.extra_args(g))

  for i in range(2):
    g = jax.tree.map(
      lambda x, i=i: jnp.cos(
        x * (i + 1.0) + jnp.arange(x.size).reshape(x.shape)
      ),
      params,
    )
    updates, new_state = update(g, state, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
    chex.assert_tree_all_finite(updates)
    state = new_state


@functools.cache
def _cond_step(case: Case, x64: bool):
  """One jitted program stepping mixed_tensors in several dtypes, each step
  under ``lax.cond(pred, ...)``; shared by the dtype and lax.cond checks."""
  dtypes = tuple(
    d for d in case.stable_dtypes if (jnp.dtype(d) == jnp.float64) == x64
  )
  steps, carries = [], []
  with jax.enable_x64(x64):
    for dtype in dtypes:
      init, _, obj = TARGETS["mixed_tensors"](dtype)
      opt = case.make()
      steps.append(_step_fn(case, opt, obj))
      carries.append((init, opt.init(init)))

  @jax.jit
  def cond_step(carries, pred):
    return [
      jax.lax.cond(pred, step, lambda p, s: (p, s), *c)
      for step, c in zip(steps, carries)
    ]

  return dtypes, cond_step, carries


def _run_cond_steps(test, case: Case, x64: bool, preds):
  dtypes, cond_step, carries = _cond_step(case, x64)
  if not dtypes:
    return
  with jax.enable_x64(x64):
    for pred in preds:
      new_carries = cond_step(carries, jnp.asarray(pred))
      for dtype, (params, state), (old_params, old_state) in zip(
        dtypes, new_carries, carries
      ):
        with test.subTest(dtype=jnp.dtype(dtype).name):
          chex.assert_trees_all_equal_dtypes(params, old_params)
          chex.assert_trees_all_equal_shapes_and_dtypes(state, old_state)
      carries = new_carries


def check_preserves_dtype_under_cond(test, case: Case):
  """Taken and skipped ``lax.cond`` branches agree on the state's types, and
  taken steps (two of them, a skipped one between) keep every parameter's and
  state leaf's dtype, with and without x64."""
  for x64 in (False, True):
    _run_cond_steps(test, case, x64=x64, preds=(True, False, True))


def check_multisteps_first_ministep_is_zero(test, case: Case):
  dtypes = (jnp.bfloat16, jnp.float32)
  obj = lambda p: jnp.sum(p.astype(jnp.float32) ** 2)
  opt = optax.MultiSteps(case.make(), every_k_schedule=4)

  @jax.jit
  def first_ministep(all_params):  # Both dtypes: one compile.
    out = []
    for params in all_params:
      grads = jax.grad(obj)(params).astype(params.dtype)
      extras = case.extra_args(grads)
      out.append(
        (opt.update(grads, opt.init(params), params, **extras)[0], grads)
      )
    return out

  all_params = [jnp.array([[1.0, 2.0], [-1.0, 0.5]], dtype) for dtype in dtypes]
  for dtype, (updates, grads) in zip(dtypes, first_ministep(all_params)):
    with test.subTest(dtype=jnp.dtype(dtype).name):
      chex.assert_trees_all_equal(updates, jnp.zeros_like(grads))


def check_init_on_shape_dtype_struct(test, case: Case):
  init, _, _ = TARGETS["mixed_tensors"](jnp.float32)
  opt = case.make()
  structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), init)
  abstract = jax.eval_shape(opt.init, structs)
  concrete = opt.init(init)
  chex.assert_trees_all_equal_shapes_and_dtypes(abstract, concrete)
  # A fresh state can be donated to a jitted step: no two of its arrays
  # share a buffer (e.g. one zero counter used for two fields).
  seen: dict[int, str] = {}
  for path, x in jax.tree_util.tree_flatten_with_path(concrete)[0]:
    if isinstance(x, jax.Array) and x.size:
      where = jax.tree_util.keystr(path)
      first = seen.setdefault(x.unsafe_buffer_pointer(), where)
      test.assertEqual(first, where, f"state{where} shares a buffer")


def check_refuses_non_real_params(test, case: Case):
  """A complex or integer leaf is refused at init, naming the leaf: the
  Fisher would square a complex gradient where its modulus is meant."""
  init, _, _ = TARGETS["mixed_tensors"](jnp.float32)
  (path, first), *_ = jax.tree_util.tree_flatten_with_path(init)[0]
  leaf = jax.tree_util.keystr(path)
  leaves, treedef = jax.tree.flatten(init)
  for dtype in (jnp.complex64, jnp.int32, jnp.bool_):
    bad = treedef.unflatten([first.astype(dtype), *leaves[1:]])
    with test.subTest(str(jnp.dtype(dtype))):
      with test.assertRaisesRegex(
        TypeError,
        re.escape(f"params{leaf} has dtype {jnp.dtype(dtype)}")
        + ".*requires real floating-point params",
      ):
        case.factory(**case.factory_kwargs()).init(bad)


def check_map_params(test, case: Case):
  """optax.tree.map_params reaches the params-shaped leaves of the state and
  leaves the structure alone (what sharding annotations rely on)."""
  init, _, _ = TARGETS["mixed_tensors"](jnp.float32)
  opt = case.make()
  state = opt.init(init)
  same = optax.tree.map_params(opt, lambda v: v, state)
  chex.assert_trees_all_equal(same, state)
  # Mapping params to structs must not touch the non-params leaves' values.
  structs = optax.tree.map_params(
    opt, lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state
  )
  test.assertEqual(jax.tree.structure(structs), jax.tree.structure(state))


@functools.cache
def _bad_gradient_run(case: Case):
  """One jitted program: 4 steps, gradients replaced by ``bad`` at steps 0
  and 2 (the whole leaf, or only its first element), for the bare transform
  and for it under ``optax.apply_if_finite``. ``bad`` is an argument, so
  every bad value shares the compile; the steps are a scan, so the update
  is compiled once for each of the two."""
  init, _, obj = TARGETS["mixed_tensors"](jnp.float32)
  opt = case.make()
  guarded = optax.apply_if_finite(opt, max_consecutive_errors=100)

  def step(tx, carry, spoiled, bad, whole):
    params, state = carry
    grads = jax.grad(obj)(params)

    def spoil(x):
      first = jnp.arange(x.size).reshape(x.shape) == 0
      return jnp.where(spoiled & (whole | first), bad.astype(x.dtype), x)

    grads = jax.tree.map(spoil, grads)
    updates, state = tx.update(grads, state, params, **case.extra_args(grads))
    return (optax.apply_updates(params, updates), state), updates

  @jax.jit
  def run(bad, whole):
    def body(carry, spoiled):
      bare, safe = carry
      bare, bare_updates = step(opt, bare, spoiled, bad, whole)
      safe, _ = step(guarded, safe, spoiled, bad, whole)
      return (bare, safe), (bare_updates, bare[1], safe[0])

    carry = ((init, opt.init(init)), (init, guarded.init(init)))
    spoiled = jnp.array([True, False, True, False])
    _, (bare_updates, bare_states, safe_params) = jax.lax.scan(
      body, carry, spoiled
    )
    return bare_updates, bare_states, safe_params

  return run


def check_nonfinite_gradients(test, case: Case):
  """Zero, NaN, +-Inf and 1e30 gradients: the update returns; zero gradients
  give finite updates and state; under ``optax.apply_if_finite`` the params
  stay finite after every step."""
  run = _bad_gradient_run(case)
  for label, value in BAD_VALUES.items():
    for whole in (True, False) if value != 0.0 else (True,):
      with test.subTest(gradient=label, whole_leaf=whole):
        out = run(jnp.float32(value), jnp.asarray(whole))
        bare_updates, bare_states, safe_params = jax.block_until_ready(out)
        if value == 0.0:
          chex.assert_tree_all_finite(
            bare_updates, custom_message="updates of zero gradients"
          )
          chex.assert_tree_all_finite(
            bare_states, custom_message="state after zero gradients"
          )
        # Leaves stacked over the 4 steps: finite after every step.
        chex.assert_tree_all_finite(
          safe_params, custom_message="params under apply_if_finite"
        )


CHECKS: dict[str, Callable[[Any, Case], None]] = {
  "converges": check_converges,
  "ignores_unknown_extras_and_no_recompile": (
    check_ignores_unknown_extras_and_no_recompile
  ),
  "learning_rate_schedule": check_learning_rate_schedule,
  "inject_hyperparams": check_inject_hyperparams,
  "preserves_dtype_under_cond": check_preserves_dtype_under_cond,
  "multisteps_first_ministep_is_zero": check_multisteps_first_ministep_is_zero,
  "init_on_shape_dtype_struct": check_init_on_shape_dtype_struct,
  "map_params": check_map_params,
  "nonfinite_gradients": check_nonfinite_gradients,
}


def check_masked(test, case: Case):
  """Under ``optax.masked`` the unmasked leaves get what the transform gives
  them alone, and the extras are passed as for the whole tree (optax masks
  the updates and params, not the extra arguments)."""
  params = {
    "v": jnp.linspace(-1.0, 1.0, 3),
    "m": jnp.arange(4.0).reshape(2, 2) / 4,
    "x": jnp.ones(3),
  }
  mask = {"v": True, "m": True, "x": False}
  kept = lambda tree: {k: tree[k] for k in ("v", "m")}
  masked, plain = optax.masked(case.make(), mask), case.make()
  s_masked, s_plain = masked.init(params), plain.init(kept(params))
  for t in range(3):
    grads = jax.tree.map(lambda p: jnp.cos(3.0 * p + t), params)
    u_masked, s_masked = masked.update(
      grads, s_masked, params, **case.extra_args(grads)
    )
    u_plain, s_plain = plain.update(
      kept(grads), s_plain, kept(params), **case.extra_args(kept(grads))
    )
    chex.assert_trees_all_close(kept(u_masked), u_plain, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal(u_masked["x"], grads["x"])
