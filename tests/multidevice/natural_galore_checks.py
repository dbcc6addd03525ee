# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Natural GaLore under sharded jit equals the unsharded run (8 CPU devices)."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import fisher_optax
from tests import multidevice_util


class NaturalGaLoreShardedTest(parameterized.TestCase):
  def test_eight_devices(self):
    self.assertEqual(jax.device_count(), 8)

  @parameterized.parameters("exact", "subspace", "randomized")
  def test_sharded_equals_unsharded(self, svd_method):
    # GSPMD (Auto) axes: XLA propagates shardings through the projections.
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    key = jax.random.key(0)
    params = {
      "w": jax.random.normal(key, (64, 16)),
      "v": jax.random.normal(jax.random.fold_in(key, 1), (16, 40)),
      "b": jnp.zeros((16,)),
    }
    specs = {"w": P("x", None), "v": P(None, "x"), "b": P()}
    # damping=0.1: with 1e-3 the (g - Hz)/damping cancellation amplifies
    # float32 reduction-order noise to ~1e-4, which is not what this tests.
    tx = fisher_optax.natural_galore(
      1e-2,
      rank=4,
      update_proj_gap=2,
      history_size=3,
      damping=0.1,
      svd_method=svd_method,
    )
    target = jax.random.normal(jax.random.fold_in(key, 2), (8, 40))
    # Gradients of rank 8 > rank 4, so the top-4 bases are well defined.
    loss = lambda p, x: jnp.mean(
      (jnp.tanh(x @ p["w"] + p["b"]) @ p["v"] - target) ** 2
    )

    def step(p, s, x):
      g = jax.grad(loss)(p, x)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    xs = [
      jax.random.normal(jax.random.fold_in(key, 10 + t), (8, 64))
      for t in range(4)
    ]
    p1, s1 = params, tx.init(params)
    for x in xs:
      p1, s1 = jax.jit(step)(p1, s1, x)

    shard = {k: NamedSharding(mesh, v) for k, v in specs.items()}
    p2 = jax.device_put(params, shard)
    s2 = jax.jit(tx.init)(p2)
    sharded_step = jax.jit(step, out_shardings=(shard, None))
    for x in xs:
      p2, s2 = sharded_step(
        p2, s2, jax.device_put(x, NamedSharding(mesh, P(None, "x")))
      )
    self.assertEqual(p2["w"].sharding, shard["w"])
    chex.assert_trees_all_close(
      jax.tree.map(np.asarray, p2),
      jax.tree.map(np.asarray, p1),
      rtol=1e-4,
      atol=1e-5,
    )

  @parameterized.product(
    svd_method=("randomized", "subspace"),
    spec=(P("x", None), P(None, "x"), P("x", "y")),
  )
  def test_sketches_never_gather_the_gradient(self, svd_method, spec):
    # Under explicit axes the range finder's products are formed with the
    # gradient's shardings and only the (m, rank + 8) sketches are
    # gathered; a replicated out_sharding made XLA gather the gradient.
    explicit = jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(explicit,) * 2)
    shape, rank = (64, 256), 4
    tx = fisher_optax.natural_galore(
      1e-2, rank=rank, update_proj_gap=2, svd_method=svd_method
    )
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=shape), jnp.float32)}
    grads = {"w": jnp.asarray(rng.normal(size=shape), jnp.float32)}
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    want, _ = step(grads, tx.init(params), params)
    with jax.set_mesh(mesh):
      put = lambda t: {"w": jax.device_put(t["w"], NamedSharding(mesh, spec))}
      sp, sg = put(params), put(grads)
      state = tx.init(sp)
      compiled = step.lower(sg, state, sp).compile()
      got, _ = step(sg, state, sp)
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)
    gathered = multidevice_util.largest_all_gather(compiled.as_text())
    self.assertLessEqual(gathered, max(shape) * (rank + 8), gathered)


if __name__ == "__main__":
  absltest.main()
