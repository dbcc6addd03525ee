# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""FISMO under sharded jit on 8 CPU devices (run by fismo_multidevice_test)."""

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import fisher_optax


class FismoShardedTest(absltest.TestCase):
  def test_device_count(self):
    self.assertEqual(jax.device_count(), 8)

  def test_sharded_matches_single_device(self):
    # Auto axes: GSPMD propagates the shardings through the optimizer.
    mesh = jax.make_mesh(
      (4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    rng = np.random.default_rng(0)
    params = {
      "w": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
      "stack": jnp.asarray(rng.normal(size=(4, 8, 6)), jnp.float32),
      "b": jnp.asarray(rng.normal(size=(8,)), jnp.float32),
    }
    # Whole matrices per device for the stacked leaf, a sharded
    # matrix for "w": both must give the single-device numbers.
    shardings = {
      "w": NamedSharding(mesh, P("data", "model")),
      "stack": NamedSharding(mesh, P("data", None, None)),
      "b": NamedSharding(mesh, P("model")),
    }
    dims = {
      "w": fisher_optax.FISMODimensionNumbers(),
      "stack": fisher_optax.FISMODimensionNumbers(1, 2),
      "b": None,
    }
    grads_seq = [
      jax.tree.map(
        lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params
      )
      for _ in range(3)
    ]
    for method in ("eigh", "newton"):
      tx = fisher_optax.fismo(
        1e-2,
        precondition_interval=2,
        root_method=method,
        fismo_weight_dimension_numbers=dims,
      )
      ref_state = tx.init(params)
      update = jax.jit(tx.update)
      sharded_params = jax.device_put(params, shardings)
      state = jax.jit(tx.init)(sharded_params)
      for g in grads_seq:
        ref_u, ref_state = update(g, ref_state, params)
        u, state = update(jax.device_put(g, shardings), state, sharded_params)
        chex.assert_trees_all_close(u, ref_u, atol=1e-5, rtol=1e-4)
      chex.assert_tree_all_finite(state)


if __name__ == "__main__":
  absltest.main()
