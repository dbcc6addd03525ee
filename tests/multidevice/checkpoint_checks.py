# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Checkpoints of sharded states on 8 CPU devices (checkpoint_multidevice)."""

import pathlib
import tempfile

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fisher_optax import checkpoint


class CheckpointShardedTest(absltest.TestCase):
  def test_restore_places_arrays_as_the_target_says(self):
    saved_mesh = jax.make_mesh((8,), ("d",))
    w = jax.device_put(jnp.arange(16.0), NamedSharding(saved_mesh, P("d")))
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "ckpt"
      checkpoint.save(path, {"w": w, "e": jnp.zeros((0, 2))})
      # Another mesh (two devices, replicated): a restore onto another
      # topology, as after a resize.
      mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
      want = NamedSharding(mesh, P())
      target = {
        "w": jax.ShapeDtypeStruct((16,), jnp.float32, sharding=want),
        "e": jax.ShapeDtypeStruct((0, 2), jnp.float32, sharding=want),
      }
      restored = checkpoint.restore(path, target)
    chex.assert_trees_all_equal(restored["w"], jnp.arange(16.0))
    self.assertEqual(restored["w"].sharding, want)
    self.assertEqual(restored["e"].sharding, want)


if __name__ == "__main__":
  absltest.main()
