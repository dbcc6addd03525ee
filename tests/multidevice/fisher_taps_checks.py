# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Layer statistics on 8 CPU devices (run by fisher_taps_multidevice_test)."""

from unittest import mock
import warnings

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fisher_optax import fisher
from fisher_optax.fisher import _taps
from tests import fisher_taps_test
from tests import fisher_testing


def _apply(p, x):
  h = jnp.tanh(x @ p["w1"] + p["b1"])  # x: (B, T, 3), weight sharing
  return h.mean(1) @ p["w2"]


def _setup():
  k = jax.random.split(jax.random.key(0), 5)
  params = {
    "w1": jax.random.normal(k[0], (3, 5)),
    "b1": jax.random.normal(k[1], (5,)),
    "w2": jax.random.normal(k[2], (5, 2)),
  }
  x = jax.random.normal(k[3], (16, 4, 3))
  cot = jax.random.normal(k[4], (2, 16, 2))
  return params, x, cot


def _stats(p, x, c):
  return {
    s: fisher_testing.layer_statistics(_apply, p, x, c, structure=s)[0]
    for s in ("diag", "kron")
  }


def _chunked_stats(apply_fn):
  """``(p, x, c) -> {(structure, fused): statistic}`` for the diagonal and
  K-FAC sums, recorded and formed in the backward pass, one example per
  chunk (so the chunk loops run)."""

  def stats(p, x, c):
    return {
      (s, fused): fisher_testing.layer_statistics(
        apply_fn, p, x, c, structure=s, chunk_size=1, fused=fused
      )[0]
      for s in ("diag", "kron")
      for fused in (False, True)
    }

  return stats


def _sharded_sums(stats, params, x, cot):
  """``stats`` of each device's examples (batch split over 8 devices by
  ``shard_map``, params replicated), summed over the devices."""
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  local = jax.shard_map(
    lambda p, x, c: jax.lax.psum(stats(p, x, c), "d"),
    mesh=mesh,
    in_specs=(P(), P("d"), P(None, "d")),
    out_specs=P(),
  )
  with jax.set_mesh(mesh):
    return jax.jit(local)(
      params, jax.device_put(x, P("d")), jax.device_put(cot, P(None, "d"))
    )


class TapsShardedTest(absltest.TestCase):
  def test_device_count(self):
    self.assertEqual(jax.device_count(), 8)

  def test_shard_map_sums_match_one_device(self):
    """Replicated params: taps must vary per device or examples mix."""
    params, x, cot = _setup()
    ref = jax.jit(_stats)(params, x, cot)
    out = _sharded_sums(_stats, params, x, cot)
    chex.assert_trees_all_close(out, ref, rtol=1e-5, atol=1e-6)

  def test_shard_map_scan_and_shared_leaves(self):
    """Stacked, scan-shared and tied leaves: their chunked sums are carried
    in loops, whose carries must vary per device too; so must the taps of
    the statistics formed in the backward pass (``fused``)."""
    apply_fn, params, _, out_dim = fisher_taps_test._model(
      "plain_scan", jnp.float32
    )
    k = jax.random.split(jax.random.key(3))
    ids = jax.random.randint(k[0], (16, fisher_taps_test.T), 0, out_dim)
    cot = jax.random.normal(k[1], (2, 16, out_dim))

    stats = _chunked_stats(apply_fn)
    ref = jax.jit(stats)(params, ids, cot)
    out = _sharded_sums(stats, params, ids, cot)
    chex.assert_trees_all_close(out, ref, rtol=1e-5, atol=1e-6)

  def test_shard_map_stacked_convs(self):
    """Conv kernels stacked along a scan: their per-layer factors, and
    their diagonal from chunked per-example gradients (recorded, and formed
    in the backward pass), summed in loops whose carries vary per device."""
    dn = ("NHWC", "HWIO", "NHWC")

    def apply_fn(p, x):
      conv = lambda h, k: jnp.tanh(
        jax.lax.conv_general_dilated(h, k, (1, 1), "SAME", None, None, dn)
      )
      h, _ = jax.lax.scan(lambda h, k: (conv(h, k), None), x, p["k"])
      return h.reshape(x.shape[0], -1) @ p["w"]

    k = jax.random.split(jax.random.key(4), 4)
    params = {
      "k": 0.5 * jax.random.normal(k[0], (3, 3, 3, 2, 2)),
      "w": jax.random.normal(k[1], (4 * 4 * 2, 2)),
    }
    x = jax.random.normal(k[2], (16, 4, 4, 2))
    cot = jax.random.normal(k[3], (2, 16, 2))

    stats = _chunked_stats(apply_fn)
    # Input patches of one example at a time: the factors' loop too.
    with mock.patch.object(_taps, "_BLOCK_ELEMENTS", 64):
      ref = jax.jit(stats)(params, x, cot)
      out = _sharded_sums(stats, params, x, cot)
    chex.assert_trees_all_close(out, ref, rtol=1e-5, atol=1e-6)

  def test_values_computed_from_parameters(self):
    """Leaves reaching their layers through functions of parameters (a
    weight-normed, a masked and a merged kernel, a softplus scale) stay on
    the layer path under a batch-sharded jit, and under shard_map with
    ``axis_name`` (which makes the params vary per device, so the values'
    VJPs do not sum the devices' cotangents): both equal one device's
    diagonal. Without it (device-invariant params) the raw tape leaves them
    uncovered, and says why."""
    apply_fn, params, _, out_dim = fisher_taps_test._model(
      "plain_derived_seq", jnp.float32
    )
    k = jax.random.split(jax.random.key(5))
    x = jax.random.normal(k[0], (16, fisher_taps_test.T, 4))
    y = jax.random.randint(k[1], (16,), 0, out_dim)
    kw = dict(likelihood=fisher.Categorical(), kind="exact", chunk_size=3)
    diag = lambda p, x, y, **more: (
      fisher.diagonal(apply_fn, p, (x, y), **kw, **more).diag
    )
    ref = jax.jit(diag)(params, x, y)

    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    local = jax.shard_map(
      lambda p, x, y: diag(p, x, y, axis_name="d"),
      mesh=mesh,
      in_specs=(P(), P("d"), P("d")),
      out_specs=P(),
    )
    with warnings.catch_warnings():
      warnings.simplefilter("error", fisher.FisherFallbackWarning)
      chex.assert_trees_all_close(
        jax.jit(local)(params, x, y), ref, rtol=1e-5, atol=1e-6
      )
    found = {}

    def invariant(p, x):  # coverage is static: read while tracing
      found.update(fisher.coverage(apply_fn, p, x))
      return jnp.zeros(())

    jax.jit(
      jax.shard_map(invariant, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
    )(params, x)
    self.assertFalse(found["v"])
    self.assertIn(
      "device-invariant parameters under shard_map", found["v"].reason
    )
    xs = jax.device_put(x, NamedSharding(mesh, P("d")))
    ys = jax.device_put(y, NamedSharding(mesh, P("d")))
    with jax.set_mesh(mesh):
      out = jax.jit(diag)(params, xs, ys)
    chex.assert_trees_all_close(out, ref, rtol=1e-5, atol=1e-6)

  def test_sharded_jit_matches_one_device(self):
    # Auto axes only: with Explicit axes a global-view jit needs an
    # out_sharding on every batch contraction, which _taps does not pass yet
    # (Explicit meshes work through shard_map, above).
    params, x, cot = _setup()
    ref = jax.jit(_stats)(params, x, cot)
    for axis_type in (AxisType.Auto,):
      mesh = jax.make_mesh((8,), ("d",), axis_types=(axis_type,))
      xs = jax.device_put(x, NamedSharding(mesh, P("d")))
      cs = jax.device_put(cot, NamedSharding(mesh, P(None, "d")))
      with jax.set_mesh(mesh):
        out = jax.jit(_stats)(params, xs, cs)
      chex.assert_trees_all_close(out, ref, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
  absltest.main()
