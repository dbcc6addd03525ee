# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The conformance suite every fisher_optax optimizer alias must pass.

It mirrors ``optax/contrib/_common_test.py`` (see conventions.md §3). Use it by
mixing :class:`OptimizerConformance` into a ``parameterized.TestCase``::

  class FAdamConformanceTest(conformance.OptimizerConformance,
                             parameterized.TestCase):
    FACTORY = staticmethod(fisher_optax.fadam)
    KWARGS = {"learning_rate": 1e-2}
    INJECTABLE = ("learning_rate", "b1", "b2", "weight_decay")

Subclasses tune the class attributes below; every check runs under ``jit``.
The mixin holds no parameterized decorators (absl expands those per class),
so targets and dtypes are looped with ``subTest``.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import logging
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


class _CompileCounter(logging.Handler):
  def __init__(self):
    super().__init__()
    self.records: list[str] = []

  def emit(self, record):
    if "Finished XLA compilation" in record.getMessage() or (
      "Compiling" in record.getMessage()
    ):
      self.records.append(record.getMessage())


class OptimizerConformance:
  """Mixin of the shared checks. Subclasses set at least ``FACTORY``."""

  # The alias under test, e.g. ``fisher_optax.fadam``.
  FACTORY: Callable[..., optax.GradientTransformation]
  # Keyword arguments for the factory (learning_rate included).
  KWARGS: dict[str, Any] = {"learning_rate": 1e-2}
  # Per-target overrides of KWARGS, e.g. {"rosenbrock": {"learning_rate": 1e-3}}.
  TARGET_KWARGS: dict[str, dict[str, Any]] = {}
  # Targets that must converge and the number of steps for each.
  CONVERGENCE_STEPS: dict[str, int] = {
    "parabola": 3000,
    "rosenbrock": 10000,
    "matrix_parabola": 3000,
    "mixed_tensors": 3000,
  }
  CONVERGENCE_TOL: float = 3e-2
  # Hyperparameters that inject_hyperparams must turn into state arrays.
  INJECTABLE: tuple[str, ...] = ("learning_rate",)
  # Arguments inject_hyperparams must keep static (shape-setting ints etc.).
  STATIC_ARGS: tuple[str, ...] = ()
  # Float dtypes whose state must stay stable under lax.cond.
  STABLE_DTYPES: tuple[Any, ...] = (
    jnp.float16,
    jnp.bfloat16,
    jnp.float32,
    jnp.float64,
  )

  # -- hooks -------------------------------------------------------------------

  def make(self, **overrides) -> optax.GradientTransformation:
    kwargs = dict(self.KWARGS)
    kwargs.update(overrides)
    return type(self).FACTORY(**kwargs)

  def extra_args(
    self, params: PyTree, obj_fn: Callable[[PyTree], Any]
  ) -> dict[str, Any]:
    """Extra keyword arguments the transform needs in ``update``."""
    del params, obj_fn
    return {}

  # -- helpers -----------------------------------------------------------------

  def _step_fn(self, opt, obj_fn, extra_unknown: bool = False):
    def step(params, state):
      grads = jax.grad(obj_fn)(params)
      extras = self.extra_args(params, obj_fn)
      if extra_unknown:
        extras["an_unexpected_extra_arg_nobody_expects"] = 1.0
      updates, state = opt.update(grads, state, params, **extras)
      return optax.apply_updates(params, updates), state

    return step

  # -- the checks ----------------------------------------------------------------

  def test_conformance_converges(self):
    # Every target's scan in ONE jit: one compile instead of one per target.
    problems, inits = {}, {}
    for name, steps in self.CONVERGENCE_STEPS.items():
      init, final, obj = TARGETS[name](jnp.float32)
      opt = self.make(**self.TARGET_KWARGS.get(name, {}))
      state = opt.init(init)
      state = optax.tree.map_params(opt, lambda v: v, state)
      problems[name] = (self._step_fn(opt, obj), steps, final)
      inits[name] = (init, state)

    @jax.jit
    def run(inits):
      out = {}
      for name, carry in inits.items():
        step, steps, _ = problems[name]
        out[name] = jax.lax.scan(
          lambda c, _, step=step: (step(*c), None), carry, length=steps
        )[0][0]
      return out

    results = run(inits)
    for name, params in results.items():
      with self.subTest(target=name):
        final = problems[name][2]
        chex.assert_tree_all_finite(params)
        chex.assert_trees_all_close(
          params, final, atol=self.CONVERGENCE_TOL, rtol=self.CONVERGENCE_TOL
        )

  def test_conformance_ignores_unknown_extras_and_no_recompile(self):
    init, _, obj = TARGETS["mixed_tensors"](jnp.float32)
    opt = self.make()
    step = jax.jit(self._step_fn(opt, obj, extra_unknown=True))
    params, state = step(init, opt.init(init))
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
    self.assertEmpty(handler.records, "update recompiled on its second call")
    chex.assert_tree_all_finite(params)

  def test_conformance_inject_hyperparams(self):
    factory = type(self).FACTORY
    kwargs = dict(self.KWARGS)
    opt = factory(**kwargs)
    injected = optax.inject_hyperparams(factory, static_args=self.STATIC_ARGS)(
      **kwargs
    )
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
    obj_fn = lambda p: sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(p))
    extras = self.extra_args(params, obj_fn)
    for name in self.INJECTABLE:
      self.assertIn(
        name, injected.init(params).hyperparams, f"{name} is not injectable"
      )
    # One compile for both inits and one for both updates.
    s1, s2 = jax.jit(lambda p: (opt.init(p), injected.init(p)))(params)

    @jax.jit
    def update_both(g, s1, s2, params):
      return (
        opt.update(g, s1, params, **extras),
        injected.update(g, s2, params, **extras),
      )

    for g in grads_seq:
      (u1, s1), (u2, s2) = update_both(g, s1, s2, params)
      chex.assert_trees_all_close(u1, u2, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(s2.inner_state, s1, rtol=1e-5, atol=1e-6)

  def test_conformance_preserves_dtype(self):
    dtypes = (jnp.bfloat16, jnp.float32)
    opt = self.make()
    obj = lambda p: sum(
      jnp.sum(x.astype(jnp.float32) ** 2) for x in jax.tree.leaves(p)
    )
    step = self._step_fn(opt, obj)
    # Both dtypes in one jit: one compile.
    step_all = jax.jit(lambda carries: [step(*c) for c in carries])
    params = [
      (
        jnp.array([1.0, 2.0, -3.0], dtype),
        jnp.arange(6.0, dtype=dtype).reshape(2, 3) - 2.0,
      )
      for dtype in dtypes
    ]
    carries = [(p, opt.init(p)) for p in params]
    for _ in range(2):
      new_carries = step_all(carries)
      for dtype, (new_params, _), (old_params, _) in zip(
        dtypes, new_carries, carries
      ):
        with self.subTest(dtype=jnp.dtype(dtype).name):
          chex.assert_trees_all_equal_dtypes(new_params, old_params)
      carries = new_carries

  def test_conformance_multisteps_first_ministep_is_zero(self):
    dtypes = (jnp.bfloat16, jnp.float32)
    obj = lambda p: jnp.sum(p.astype(jnp.float32) ** 2)
    opt = optax.MultiSteps(self.make(), every_k_schedule=4)

    @jax.jit
    def first_ministep(all_params):  # Both dtypes: one compile.
      out = []
      for params in all_params:
        extras = self.extra_args(params, obj)
        grads = jax.grad(obj)(params).astype(params.dtype)
        out.append(
          (opt.update(grads, opt.init(params), params, **extras)[0], grads)
        )
      return out

    all_params = [
      jnp.array([[1.0, 2.0], [-1.0, 0.5]], dtype) for dtype in dtypes
    ]
    for dtype, (updates, grads) in zip(dtypes, first_ministep(all_params)):
      with self.subTest(dtype=jnp.dtype(dtype).name):
        chex.assert_trees_all_equal(updates, jnp.zeros_like(grads))

  def test_conformance_state_stable_under_cond(self):
    # One compile for the dtypes that need no x64, one for float64.
    groups = (
      [d for d in self.STABLE_DTYPES if d != jnp.float64],
      [d for d in self.STABLE_DTYPES if d == jnp.float64],
    )
    for dtypes in groups:
      if not dtypes:
        continue
      with jax.enable_x64(dtypes[0] == jnp.float64):
        steps, carries, inits = [], [], []
        for dtype in dtypes:
          init, _, obj = TARGETS["mixed_tensors"](dtype)
          opt = self.make()
          steps.append(self._step_fn(opt, obj))
          carries.append((init, opt.init(init)))
          inits.append(init)

        @jax.jit
        def cond_step(carries, steps=steps):
          pred = jax.random.randint(jax.random.key(0), (), 0, 2) == 0
          return [
            jax.lax.cond(pred, step, lambda p, s: (p, s), *c)
            for step, c in zip(steps, carries)
          ]

        for _ in range(2):
          carries = cond_step(carries)
          for dtype, (params, _), init in zip(dtypes, carries, inits):
            with self.subTest(dtype=jnp.dtype(dtype).name):
              chex.assert_trees_all_equal_dtypes(params, init)

  def test_conformance_learning_rate_schedule(self):
    init, _, obj = TARGETS["mixed_tensors"](jnp.float32)
    lr = self.KWARGS.get("learning_rate", 1e-2)
    schedule = optax.linear_schedule(lr, 0.1 * lr, 50)
    opt = self.make(learning_rate=schedule)
    step = jax.jit(self._step_fn(opt, obj))
    params, state = init, opt.init(init)
    for _ in range(3):
      params, state = step(params, state)
    chex.assert_tree_all_finite(params)
    self.assertFalse(
      all(
        bool(jnp.all(a == b))
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(init))
      ),
      "a scheduled learning rate produced no update",
    )

  def test_conformance_init_on_shape_dtype_struct(self):
    init, _, _ = TARGETS["mixed_tensors"](jnp.float32)
    opt = self.make()
    structs = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), init
    )
    abstract = jax.eval_shape(opt.init, structs)
    concrete = opt.init(init)
    chex.assert_trees_all_equal_shapes_and_dtypes(abstract, concrete)

  def test_conformance_zero_and_nonfinite_gradients(self):
    """All-zero gradients give finite updates; NaN never enters the state."""
    init, _, _ = TARGETS["mixed_tensors"](jnp.float32)
    opt = self.make()
    obj = lambda p: jnp.sum(jnp.square(p[1]))
    extras = self.extra_args(init, obj)
    update = jax.jit(functools.partial(opt.update, **extras))
    state = opt.init(init)
    zeros = jax.tree.map(jnp.zeros_like, init)
    updates, state = update(zeros, state, init)
    chex.assert_tree_all_finite(updates)
    chex.assert_tree_all_finite(state)
