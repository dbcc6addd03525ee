# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for fisher_optax.fisher.numerics: the shared non-finite policy and
tree helpers (the transforms' own tests cover them in use)."""

from __future__ import annotations

from typing import NamedTuple

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fisher_optax.fisher import numerics
from tests import nonfinite_testing


class _State(NamedTuple):
  total: jax.Array
  notfinite_count: jax.Array


class SkipNonfiniteStepTest(parameterized.TestCase):
  @parameterized.parameters(float("nan"), float("inf"))
  def test_nonfinite_inputs_never_reach_the_step(self, bad):
    # A decomposition in the step must never see them (LAPACK's SVD on an
    # infinite matrix need not terminate on XLA:CPU).
    ran = []
    g = jnp.ones(3)
    inputs = jnp.array([1.0, bad])
    state = _State(jnp.zeros(()), jnp.zeros((), jnp.int32))

    def step():
      jax.debug.callback(lambda: ran.append(True))
      return -g, state._replace(total=state.total + inputs.sum())

    updates, new = numerics.skip_nonfinite_step(step, g, state, inputs=inputs)
    jax.effects_barrier()
    self.assertEqual(ran, [])
    # A finite gradient with bad inputs: zero updates, the state kept.
    chex.assert_trees_all_equal(updates, jnp.zeros(3))
    self.assertEqual(float(new.total), 0.0)
    self.assertEqual(int(new.notfinite_count), 1)

  def test_finite_inputs_run_the_step(self):
    ran = []
    g = jnp.ones(3)
    state = _State(jnp.zeros(()), jnp.zeros((), jnp.int32))

    def step():
      jax.debug.callback(lambda: ran.append(True))
      return -g, state._replace(total=state.total + 1.0)

    updates, new = numerics.skip_nonfinite_step(
      step, g, state, inputs=jnp.ones(2)
    )
    jax.effects_barrier()
    self.assertEqual(ran, [True])
    chex.assert_trees_all_equal(updates, -g)
    self.assertEqual(float(new.total), 1.0)
    self.assertEqual(int(new.notfinite_count), 0)


class SkipNonfiniteTest(parameterized.TestCase):
  """``skip_nonfinite(inner, bounded=True)``: the same policy, no cond."""

  def _run(self, bounded, grads):
    tx = numerics.skip_nonfinite(optax.scale_by_adam(), bounded=bounded)
    update = jax.jit(tx.update)
    state = tx.init(jnp.zeros(4))
    _, state = update(jnp.arange(1.0, 5.0), state)
    out = []
    for g in grads:
      u, state = update(g, state)
      out.append(u)
    return out, state

  def test_bounded_policy_equals_the_cond(self):
    grads = [
      jnp.array([1.0, jnp.nan, 0.0, 2.0]),
      jnp.array([1.0, jnp.inf, 0.0, 2.0]),
      jnp.full(4, 1e30),  # Adam's second moment overflows: skipped
      jnp.zeros(4),
      jnp.array([0.5, -1.0, 3.0, 1e-30]),
    ]
    want, want_state = self._run(False, grads)
    got, got_state = self._run(True, grads)
    chex.assert_trees_all_close(got, want)
    chex.assert_trees_all_close(got_state, want_state)
    self.assertEqual(int(got_state.notfinite_count), 3)

  def test_bounded_policy_updates_a_donated_state_in_place(self):
    # Under the cond its outputs (Adam's moments and updates) were
    # temporaries: 3.25 times the params here.
    params = jnp.zeros((256, 512))
    tx = optax.chain(
      numerics.skip_nonfinite(optax.scale_by_adam(), bounded=True),
      optax.scale(-1e-3),
    )

    temp = nonfinite_testing.donated_step_temp(tx, params, params)
    self.assertLess(temp, 1.5 * params.nbytes)


class MaskedLikeTest(absltest.TestCase):
  def test_masks_the_leaves_the_updates_mask(self):
    updates = {"a": jnp.ones(2), "b": optax.MaskedNode()}
    full = {"a": jnp.ones((4, 2)), "b": jnp.ones((4, 3))}
    out = numerics.masked_like(full, updates)
    self.assertIsInstance(out["b"], optax.MaskedNode)
    np.testing.assert_array_equal(out["a"], full["a"])
    # Already masked, unmasked updates, None and another structure pass
    # through as they are.
    self.assertIs(numerics.masked_like(out, updates)["b"], out["b"])
    self.assertIs(numerics.masked_like(full, full), full)
    self.assertIsNone(numerics.masked_like(None, updates))
    other = {"c": jnp.ones((4, 2))}
    self.assertIs(numerics.masked_like(other, updates), other)


if __name__ == "__main__":
  absltest.main()
