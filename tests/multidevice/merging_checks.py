# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Fisher merging of sharded models on 8 CPU devices (merging_multidevice)."""

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import fisher_optax


class MergingShardedTest(absltest.TestCase):
  def test_device_count(self):
    self.assertEqual(jax.device_count(), 8)

  def test_sharded_merge_matches_single_device_and_keeps_sharding(self):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    shapes = {"w": (16, 8), "b": (8,)}
    shardings = {
      "w": NamedSharding(mesh, P("data", "model")),
      "b": NamedSharding(mesh, P("model")),
    }

    def tree(positive=False):
      out = {}
      for k, s in shapes.items():
        x = rng.normal(size=s).astype(np.float32)
        out[k] = np.abs(x) if positive else x
      return out

    models = [tree() for _ in range(3)]
    fishers = [tree(positive=True) for _ in range(3)]
    fishers[1]["b"][:] = 0.0  # An all-zero leaf: the floor decides.
    weights = jnp.array([0.5, 0.3, 0.2])
    expected = fisher_optax.fisher_merge(
      models, fishers, weights, floor_mode="target"
    )
    put = lambda t: jax.device_put(t, shardings)
    merge = jax.jit(
      lambda m, f, w: fisher_optax.fisher_merge(m, f, w, floor_mode="target")
    )
    with jax.set_mesh(mesh):
      got = merge([put(m) for m in models], [put(f) for f in fishers], weights)
    chex.assert_trees_all_close(got, expected, rtol=1e-6, atol=1e-6)
    for k in shapes:
      self.assertTrue(
        got[k].sharding.is_equivalent_to(shardings[k], len(shapes[k])), k
      )

    # The streaming accumulator with donated state, on sharded inputs.
    acc = fisher_optax.fisher_merge_accumulator(floor_mode="target")
    add = jax.jit(acc.add, donate_argnums=0)
    with jax.set_mesh(mesh):
      state = jax.jit(acc.init)(put(models[0]), put(fishers[0]), weights[0])
      for i in (1, 2):
        state = add(state, put(models[i]), put(fishers[i]), weights[i])
    chex.assert_trees_all_close(
      acc.finalize(state), expected, rtol=1e-6, atol=1e-6
    )
    self.assertTrue(
      state.mean["w"].sharding.is_equivalent_to(shardings["w"], 2)
    )


if __name__ == "__main__":
  absltest.main()
