# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""FAdam under sharded jit on 8 CPU devices (run by fadam_multidevice_test)."""

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import fisher_optax


class FAdamShardedTest(absltest.TestCase):
  def test_device_count(self):
    self.assertEqual(jax.device_count(), 8)

  def test_sharded_matches_single_device(self):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    params = {
      "w": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
      "b": jnp.asarray(rng.normal(size=(8,)), jnp.float32),
    }
    shardings = {
      "w": NamedSharding(mesh, P("data", "model")),
      "b": NamedSharding(mesh, P("model")),
    }
    grads_seq = [
      jax.tree.map(
        lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params
      )
      for _ in range(4)
    ]
    grads_seq[2]["b"] = jnp.zeros((8,), jnp.float32)  # A zero-gradient leaf.
    # Per-example grads sharded over the batch (data) axis.
    pegs = [
      jax.tree.map(lambda g: jnp.stack([g * 1.5, g * 0.5] * 4), gs)
      for gs in grads_seq
    ]
    peg_shardings = {
      "w": NamedSharding(mesh, P("data", None, "model")),
      "b": NamedSharding(mesh, P("data", "model")),
    }

    for source in ("batch", "per_example"):
      tx = fisher_optax.fadam(1e-2, p=0.75, clip=0.8, fisher_source=source)

      def step(params, state, grads, peg, tx=tx):
        updates, state = tx.update(grads, state, params, per_example_grads=peg)
        return optax.apply_updates(params, updates), state

      ref_p, ref_s = params, tx.init(params)
      for g, peg in zip(grads_seq, pegs):
        ref_p, ref_s = jax.jit(step)(ref_p, ref_s, g, peg)

      sh_p = jax.device_put(params, shardings)
      sh_s = tx.init(sh_p)
      self.assertEqual(sh_s[0].fim["w"].sharding, shardings["w"])
      self.assertEqual(sh_s[0].mu["b"].sharding, shardings["b"])
      sharded_step = jax.jit(step)
      for g, peg in zip(grads_seq, pegs):
        sh_p, sh_s = sharded_step(
          sh_p,
          sh_s,
          jax.device_put(g, shardings),
          jax.device_put(peg, peg_shardings),
        )
      self.assertEqual(sh_p["w"].sharding, shardings["w"])
      chex.assert_trees_all_close(sh_p, ref_p, rtol=1e-5, atol=1e-6)
      chex.assert_trees_all_close(sh_s, ref_s, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
  absltest.main()
