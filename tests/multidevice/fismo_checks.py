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
from tests import multidevice_util


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

  def test_explicit_axes_match_single_device(self):
    # Explicit axes (jax.set_mesh): a contraction over sharded axes must
    # name its output's sharding. Factors and Gram matrices are replicated,
    # products with the roots keep the gradient's sharding.
    explicit = jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(explicit,) * 2)
    rng = np.random.default_rng(1)
    specs = {
      "w": P("data", "model"),
      "t": P("model", None),
      "stack": P(None, "data", "model"),
      "b": P(),
    }
    shapes = {"w": (16, 16), "t": (8, 32), "stack": (2, 8, 6), "b": (8,)}
    dims = {
      "w": fisher_optax.FISMODimensionNumbers(),
      "t": fisher_optax.FISMODimensionNumbers(),
      "stack": fisher_optax.FISMODimensionNumbers(1, 2),
      "b": None,
    }
    normal = lambda shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    params = {k: normal(v) for k, v in shapes.items()}
    grads_seq = [{k: normal(v) for k, v in shapes.items()} for _ in range(3)]
    pe_seq = [{k: normal((4, *v)) for k, v in shapes.items()} for _ in range(3)]
    configs = {
      "newton": {},
      "eigh_original": dict(root_method="eigh", momentum_space="original"),
      "cholesky": dict(root_method="cholesky", momentum_space="original"),
      "grafted_nesterov": dict(grafting="muon_norm", nesterov=True),
      "per_example": dict(fisher_source="per_example"),
    }
    for name, kw in configs.items():
      with self.subTest(name):
        tx = fisher_optax.fismo(
          1e-2,
          precondition_interval=2,
          fismo_weight_dimension_numbers=dims,
          **kw,
        )
        extra = lambda i, put: (
          {"per_example_grads": put(pe_seq[i], True)}
          if kw.get("fisher_source") == "per_example"
          else {}
        )
        step = jax.jit(lambda g, s, p, e, tx=tx: tx.update(g, s, p, **e))
        state, want = tx.init(params), []
        for i, g in enumerate(grads_seq):
          u, state = step(g, state, params, extra(i, lambda t, _: t))
          want.append(u)

        def put(tree, stacked=False):
          return {
            k: jax.device_put(
              v,
              NamedSharding(mesh, P(None, *specs[k]) if stacked else specs[k]),
            )
            for k, v in tree.items()
          }

        with jax.set_mesh(mesh):
          sharded = put(params)
          state = tx.init(sharded)
          for i, (g, w) in enumerate(zip(grads_seq, want)):
            u, state = step(put(g), state, sharded, extra(i, put))
            chex.assert_trees_all_close(u, w, rtol=1e-4, atol=1e-5)
          for k, spec in specs.items():
            self.assertTrue(
              u[k].sharding.is_equivalent_to(
                NamedSharding(mesh, spec), u[k].ndim
              ),
              (k, u[k].sharding),
            )

  def test_short_side_sharded_leaf_is_not_gathered(self):
    # A leaf sharded along its shorter side (FSDP on a d x 4d kernel) is
    # moved to its longer side for the step: the short side's Gram matrices
    # (Newton-Schulz, the factor) are all-reduced, never formed from a
    # gathered leaf, and the update comes back in the leaf's sharding.
    explicit = jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(explicit,) * 2)
    shape = (64, 256)  # only the 64 side is preconditioned
    rng = np.random.default_rng(2)
    params = {"w": jnp.asarray(rng.normal(size=shape), jnp.float32)}
    grads = [
      {"w": jnp.asarray(rng.normal(size=shape), jnp.float32)} for _ in range(2)
    ]
    tx = fisher_optax.fismo(1e-2, max_precond_dim=128, precondition_interval=1)
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    state, want = tx.init(params), []
    for g in grads:
      u, state = step(g, state, params)
      want.append(u)
    for spec in (P("x", None), P("x", "y"), P(("x", "y"), None)):
      with self.subTest(str(spec)), jax.set_mesh(mesh):
        put = lambda t: {"w": jax.device_put(t["w"], NamedSharding(mesh, spec))}
        sharded = put(params)
        state = tx.init(sharded)
        hlo = step.lower(put(grads[0]), state, sharded).compile().as_text()
        for g, w in zip(grads, want):
          u, state = step(put(g), state, sharded)
          chex.assert_trees_all_close(u, w, rtol=1e-4, atol=1e-5)
        self.assertTrue(
          u["w"].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
        )
        gathered = multidevice_util.largest_all_gather(hlo)
        self.assertLess(gathered, shape[0] * shape[1] // 2, gathered)


if __name__ == "__main__":
  absltest.main()
