# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Fisher engine on 8 CPU devices == 1 device (run by fisher_multidevice_test).

Two scale-out routes: ``jit`` with the batch sharded over a mesh
(Auto and Explicit axis types; XLA inserts the all-reduce), and ``shard_map``
with ``axis_name=`` (local sums, psum, then normalise; params pcast to
varying so per-example cotangents are not psum'd across devices).
"""

from __future__ import annotations

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import fisher_optax
from fisher_optax import fisher
from tests import fisher_testing as ft

B = 16  # Two examples per device.
TOL = dict(rtol=2e-5, atol=1e-6)


def _problem():
  params = ft.mlp_params(jax.random.key(0))
  x, y = ft.make_batch(jax.random.key(1), B, "categorical", jnp.float32)
  return params, x, y


def _auto_mesh():
  return jax.make_mesh(
    (8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )


def _flat_vecs(stat):
  return np.stack(
    [
      np.asarray(ft.ravel(jax.tree.map(lambda a, j=j: a[j], stat.eigvecs)))
      for j in range(stat.rank)
    ]
  )


ESTIMATORS = {
  "diag_empirical": functools.partial(fisher.diagonal, kind="empirical"),
  "diag_exact_per_example": functools.partial(
    fisher.diagonal, kind="exact", method="per_example", chunk_size=1
  ),
  "diag_exact_taps": functools.partial(fisher.diagonal, kind="exact"),
  # One example per forward pass: a scan over each device's examples whose
  # carry must vary over the mesh axis.
  "diag_exact_taps_example_chunks": functools.partial(
    fisher.diagonal, kind="exact", chunk_size=1
  ),
  "low_rank": functools.partial(fisher.low_rank, kind="exact", rank=3),
  "kron_kfac": functools.partial(fisher.kronecker, kind="exact"),
  "kron_kfac_example_chunks": functools.partial(
    fisher.kronecker, kind="exact", chunk_size=1
  ),
  "kron_shampoo": functools.partial(
    fisher.kronecker, kind="empirical", estimator="shampoo", num_iters=2
  ),
  "rank_one": functools.partial(fisher.rank_one, kind="exact", scale="optimal"),
}


ESTIMATORS["diag_mc"] = functools.partial(
  fisher.diagonal, kind="mc", num_samples=2, key=jax.random.key(4)
)


@functools.cache
def _jitted(name):
  """One jit per estimator, shared by every test that uses it."""
  return jax.jit(
    functools.partial(
      ESTIMATORS[name], ft.mlp_apply, likelihood=fisher.Categorical()
    )
  )


@functools.cache
def _want(name):
  """The single-device reference, computed (and compiled) once per name."""
  params, x, y = _problem()
  return _jitted(name)(params, (x, y))


def _compare(test, got, want, name):
  if isinstance(want, fisher.LowRankFisher):
    np.testing.assert_allclose(got.eigvals, want.eigvals, **TOL)
    v, w = _flat_vecs(got), _flat_vecs(want)
    np.testing.assert_allclose(
      np.abs(v @ w.T), np.eye(want.rank), atol=1e-4, err_msg=name
    )
    chex.assert_trees_all_close(got.mean_grad, want.mean_grad, **TOL)
  else:
    chex.assert_trees_all_close(got, want, **TOL)
  test.assertEqual(int(got.count), B)


class FisherMultiDeviceTest(parameterized.TestCase):
  def test_0_device_count(self):
    self.assertEqual(jax.device_count(), 8)

  @parameterized.parameters(*(n for n in ESTIMATORS if n != "diag_mc"))
  def test_shard_map_axis_name(self, name):
    params, x, y = _problem()
    est = functools.partial(
      ESTIMATORS[name], ft.mlp_apply, likelihood=fisher.Categorical()
    )
    want = _want(name)
    mesh = _auto_mesh()

    def local(params, x, y):
      return est(params, (x, y), axis_name="data")

    got = jax.jit(
      jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P()
      )
    )(params, x, y)
    _compare(self, got, want, name)

  @staticmethod
  def _shard_map_mc(**kw):
    """The MC diagonal of the batch split over the devices."""
    params, x, y = _problem()

    def local(params, x, y):
      return fisher.diagonal(
        ft.mlp_apply,
        params,
        (x, y),
        likelihood=fisher.Categorical(),
        kind="mc",
        key=jax.random.key(4),
        axis_name="data",
        **kw,
      )

    return jax.jit(
      jax.shard_map(
        local,
        mesh=_auto_mesh(),
        in_specs=(P(), P("data"), P("data")),
        out_specs=P(),
      )
    )(params, x, y)

  def test_shard_map_mc_draws_as_one_device(self):
    # Example n draws with fold_in(key, n), n counted across the devices.
    got = self._shard_map_mc(num_samples=2)
    _compare(self, got, _want("diag_mc"), "diag_mc")

  def test_shard_map_one_mc_sample_in_example_chunks(self):
    # MC with targets takes a second (empirical) backward pass, so it runs
    # its examples in chunks: a scan whose carry varies over the mesh axis.
    got = self._shard_map_mc(chunk_size=1)
    exact = _want("diag_exact_taps")
    chex.assert_tree_all_finite(got.diag)
    self.assertEqual(int(got.count), int(exact.count))
    chex.assert_trees_all_close(
      got.mean_grad, exact.mean_grad, rtol=1e-5, atol=1e-7
    )

  def test_diagonal_from_grads_axis_name(self):
    params, x, y = _problem()
    g = ft.unravel_like(
      params,
      ft.per_example_grads_dense(ft.mlp_apply, params, x, y, "categorical"),
    )
    want = jax.jit(fisher.diagonal_from_grads)(g)
    mesh = _auto_mesh()
    got = jax.jit(
      jax.shard_map(
        lambda g: fisher.diagonal_from_grads(g, axis_name="data"),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
      )
    )(g)
    chex.assert_trees_all_close(got, want, **TOL)

    def loss(p, ex):
      return fisher.Categorical().nll(ft.mlp_apply(p, ex[0][None])[0], ex[1])

    from_loss = jax.jit(
      jax.shard_map(
        lambda p, x, y: fisher.diagonal_from_loss(
          loss, p, (x, y), chunk_size=1, axis_name="data"
        ),
        mesh=mesh,
        in_specs=(P(), P("data"), P("data")),
        out_specs=P(),
      )
    )(params, x, y)
    chex.assert_trees_all_close(from_loss, want, **TOL)

  @parameterized.parameters("auto", "per_example")
  def test_shard_map_rank_one_optimal_on_conv(self, method):
    # The JVP of the optimal scale takes the (all-reduced, invariant)
    # direction as the tangent of varying params; conv's JVP rule refuses
    # operands that differ in how they vary.
    def apply_fn(p, x):
      dn = ("NHWC", "HWIO", "NHWC")
      h = jax.lax.conv_general_dilated(
        x, p["k"], (1, 1), "SAME", None, None, dn
      )
      h = jnp.tanh(h + p["b"])
      return h.reshape(h.shape[0], -1) @ p["w"]

    k = jax.random.split(jax.random.key(0), 3)
    params = {
      "k": 0.3 * jax.random.normal(k[0], (3, 3, 2, 4)),
      "b": jnp.zeros(4),
      "w": 0.1 * jax.random.normal(k[1], (64, 3)),
    }
    x, y = jax.random.normal(k[2], (B, 4, 4, 2)), jnp.arange(B) % 3
    est = functools.partial(
      fisher.rank_one,
      apply_fn,
      likelihood=fisher.Categorical(),
      kind="exact",
      scale="optimal",
      method=method,
    )
    want = jax.jit(est)(params, (x, y))
    got = jax.jit(
      jax.shard_map(
        lambda p, x, y: est(p, (x, y), axis_name="data"),
        mesh=_auto_mesh(),
        in_specs=(P(), P("data"), P("data")),
        out_specs=P(),
      )
    )(params, x, y)
    _compare(self, got, want, "rank_one")

  @parameterized.parameters(
    *[(name, "auto") for name in ESTIMATORS],
    *[
      (name, "explicit")
      for name in ("diag_exact_per_example", "low_rank", "kron_kfac", "diag_mc")
    ],
  )
  def test_jit_batch_sharded(self, name, axis_type):
    params, x, y = _problem()
    est, want = _jitted(name), _want(name)
    kind = {
      "auto": jax.sharding.AxisType.Auto,
      "explicit": jax.sharding.AxisType.Explicit,
    }[axis_type]
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    ys = jax.device_put(y, NamedSharding(mesh, P("data")))
    ps = jax.device_put(params, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
      got = est(ps, (xs, ys))
    _compare(self, got, want, name)


class StatePlacementTest(absltest.TestCase):
  """States made eagerly from sharded params keep the params' sharding
  (``numerics.zeros_like_stacked``): an M-FAC window or PhysGuard bases
  ``(m, *p)`` put on one device hold ``m`` copies of the model there."""

  def test_eager_init_keeps_param_sharding(self):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    k = jax.device_put(
      jnp.ones((64, 32)), NamedSharding(mesh, P(None, "model"))
    )
    params = {
      "k": k,
      "b": jax.device_put(jnp.ones(32), NamedSharding(mesh, P())),
    }
    stacked = fisher.numerics.zeros_like_stacked(k, (3,), jnp.bfloat16)
    self.assertEqual(stacked.sharding.spec, P(None, None, "model"))
    # (optimizer, a path fragment of its params-shaped state, leading axes)
    cases = {
      "mfac": (fisher_optax.mfac(1e-2, window_size=4), ".grads", (4,)),
      "physguard": (fisher_optax.physguard(1e-2, max_rank=3), ".bases", (3,)),
      "fismo": (fisher_optax.fismo(1e-2), ".momentum", ()),
    }
    for name, (tx, field, lead) in cases.items():
      with self.subTest(name):
        state = tx.init(params)
        found = [
          leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
          if field in jax.tree_util.keystr(path)
          and jax.tree_util.keystr(path).endswith("['k']")
        ]
        self.assertLen(found, 1)
        self.assertEqual(found[0].shape, (*lead, 64, 32))
        spec = tuple(found[0].sharding.spec)
        self.assertEqual(
          spec[: len(lead) + 2], (*(None,) * len(lead), None, "model")
        )


class ExplicitAxesTest(absltest.TestCase):
  """Under explicit mesh axes (``jax.set_mesh``) a contraction over sharded
  parameter axes must name its output's sharding: the library's small
  statistics (Gram matrices, coordinates) are replicated."""

  def test_window_and_projection_transforms_match_one_device(self):
    explicit = jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(explicit,) * 2)
    rng = np.random.default_rng(0)
    specs = {"k": P(None, "model"), "w": P("data", "model"), "b": P()}
    shapes = {"k": (16, 8), "w": (16, 16), "b": (8,)}
    params = {
      k: jnp.asarray(rng.normal(size=v), jnp.float32) for k, v in shapes.items()
    }
    grads = [
      {
        k: jnp.asarray(rng.normal(size=v), jnp.float32)
        for k, v in shapes.items()
      }
      for _ in range(3)
    ]
    txs = {
      "mfac": fisher_optax.mfac(1e-2, window_size=4, damping=0.1),
      "physguard": fisher_optax.physguard(1e-2, max_rank=2),
      # The exact SVD gathers its matrix (as documented); the sketches
      # do not.
      **{
        f"natural_galore_{m}": fisher_optax.natural_galore(
          1e-2, rank=2, update_proj_gap=2, damping=0.1, svd_method=m
        )
        for m in ("exact", "randomized")
      },
    }
    for name, tx in txs.items():
      with self.subTest(name):
        step = jax.jit(lambda g, s, p, tx=tx: tx.update(g, s, p))
        state = tx.init(params)
        want = []
        for g in grads:
          u, state = step(g, state, params)
          want.append(u)
        with jax.set_mesh(mesh):
          put = lambda t: {
            k: jax.device_put(v, NamedSharding(mesh, specs[k]))
            for k, v in t.items()
          }
          sp = put(params)
          state = jax.jit(tx.init)(sp)
          for g, w in zip(grads, want):
            u, state = step(put(g), state, sp)
            chex.assert_trees_all_close(u, w, rtol=1e-4, atol=1e-6)
          self.assertEqual(u["k"].sharding.spec, specs["k"])

  def test_short_windows_match_one_device(self):
    # A sharded leaf no longer than the window (d = 4 <= m = 4) is solved
    # as the 4 x 4 matrix once full: gathered, and its updates resharded.
    explicit = jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(explicit,) * 2)
    rng = np.random.default_rng(1)
    specs = {"k": P(None, "model"), "b": P("model")}
    shapes = {"k": (16, 8), "b": (4,)}
    params = {k: jnp.zeros(v, jnp.float32) for k, v in shapes.items()}
    grads = [
      {
        k: jnp.asarray(rng.normal(size=v), jnp.float32)
        for k, v in shapes.items()
      }
      for _ in range(6)
    ]
    tx = fisher_optax.scale_by_woodbury_fisher(4, 1e-4)
    step = jax.jit(tx.update)
    state, want = tx.init(params), []
    for g in grads:
      u, state = step(g, state)
      want.append(u)
    with jax.set_mesh(mesh):
      put = lambda t: {
        k: jax.device_put(v, NamedSharding(mesh, specs[k]))
        for k, v in t.items()
      }
      state = jax.jit(tx.init)(put(params))
      for g, w in zip(grads, want):
        u, state = step(put(g), state)
        chex.assert_trees_all_close(u, w, rtol=1e-4, atol=1e-6)
        self.assertEqual(u["b"].sharding.spec, specs["b"])


if __name__ == "__main__":
  absltest.main()
