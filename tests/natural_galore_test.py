# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for Natural GaLore and the windowed Woodbury Fisher preconditioner."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fisher_optax
from fisher_optax.fisher import validation
from tests import nonfinite_testing

_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _grads(shapes, steps, seed=0, dtype=jnp.float32):
  """A list of ``steps`` gradient trees with the given leaf shapes."""
  key = jax.random.key(seed)
  out = []
  for t in range(steps):
    keys = jax.random.split(jax.random.fold_in(key, t), len(shapes))
    out.append(
      {
        f"w{i}": jax.random.normal(k, s, dtype)
        for i, (k, s) in enumerate(zip(keys, shapes))
      }
    )
  return out


def _run(tx, grads_seq, **extras):
  """Runs ``tx`` over the sequence; returns the updates and the states."""
  state = tx.init(grads_seq[0])
  update = jax.jit(functools.partial(tx.update, **extras))
  updates, states = [], [state]
  for g in grads_seq:
    u, state = update(g, state)
    updates.append(u)
    states.append(state)
  return updates, states


def _dense_solve(window, g, damping, scale=1.0):
  """``(damping I + scale H^T H)^{-1} g`` with H rows = flattened window."""
  h = np.asarray(window, np.float64).reshape(window.shape[0], -1)
  f = damping * np.eye(h.shape[1]) + scale * h.T @ h
  return np.linalg.solve(f, np.asarray(g, np.float64).ravel()).reshape(g.shape)


class WoodburyFisherTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("partly_filled", 5, 3, (4, 3), True),
    ("wrapped_ring", 3, 7, (4, 3), True),
    ("window_larger_than_dim", 6, 8, (2, 2), True),
    ("global_block", 3, 5, (3, 2), False),
  )
  def test_equals_dense_solve_float64(self, s, steps, shape, block_diagonal):
    with jax.enable_x64(True):
      damping = 0.3
      grads = _grads([shape, (3,)], steps, dtype=jnp.float64)
      tx = fisher_optax.scale_by_woodbury_fisher(
        s, damping, block_diagonal=block_diagonal
      )
      updates, _ = _run(tx, grads)
      for t, (g, u) in enumerate(zip(grads, updates)):
        window = grads[max(0, t - s + 1) : t + 1]
        if block_diagonal:
          for name in g:
            h = np.stack([np.asarray(w[name]) for w in window])
            np.testing.assert_allclose(
              u[name], _dense_solve(h, g[name], damping), rtol=1e-9, atol=1e-10
            )
        else:
          flat = lambda tree: np.concatenate(
            [np.asarray(x).ravel() for x in jax.tree.leaves(tree)]
          )
          h = np.stack([flat(w) for w in window])
          expect = _dense_solve(h, flat(g), damping)
          np.testing.assert_allclose(flat(u), expect, rtol=1e-9, atol=1e-10)

  def test_history_one_is_closed_form(self):
    damping = 0.5
    grads = _grads([(3, 4)], 3)
    tx = fisher_optax.scale_by_woodbury_fisher(1, damping)
    updates, _ = _run(tx, grads)
    for g, u in zip(grads, updates):
      g = g["w0"]
      chex.assert_trees_all_close(
        u["w0"], g / (damping + jnp.sum(g * g)), rtol=1e-5, atol=1e-7
      )

  def test_normalized_output_is_damping_times_solve(self):
    grads = _grads([(3, 4)], 4)
    plain, _ = _run(fisher_optax.scale_by_woodbury_fisher(3, 0.2), grads)
    normed, _ = _run(
      fisher_optax.scale_by_woodbury_fisher(3, 0.2, normalize_output=True),
      grads,
    )
    chex.assert_trees_all_close(
      jax.tree.map(lambda x: 0.2 * x, plain[-1]), normed[-1], rtol=1e-5
    )

  def test_per_example_window_equals_dense_empirical_fisher(self):
    with jax.enable_x64(True):
      pe = _grads([(5, 3, 2)], 1, dtype=jnp.float64)[0]
      g = jax.tree.map(lambda x: x.mean(0), pe)
      tx = fisher_optax.scale_by_woodbury_fisher(
        damping=0.1, fisher_source="per_example"
      )
      u, _ = tx.update(g, tx.init(g), per_example_grads=pe)
      expect = _dense_solve(pe["w0"], g["w0"], 0.1, scale=1 / 5)
      np.testing.assert_allclose(u["w0"], expect, rtol=1e-9)

  def test_nan_gradient_never_enters_window(self):
    tx = fisher_optax.scale_by_woodbury_fisher(2, 0.1)
    g = {"w": jnp.ones((2, 2))}
    state = tx.init(g)
    _, state = tx.update(g, state)
    _, state = tx.update({"w": jnp.full((2, 2), jnp.nan)}, state)
    chex.assert_tree_all_finite(state)
    u, state = tx.update({"w": jnp.zeros((2, 2))}, state)
    chex.assert_tree_all_finite((u, state))

  def test_bad_inputs_raise(self):
    with self.assertRaisesRegex(TypeError, "history_size"):
      fisher_optax.scale_by_woodbury_fisher(2.0)
    # An integer window would truncate every stored gradient.
    for dtype in (jnp.int32, jnp.bool_):
      with self.assertRaisesRegex(TypeError, "window_dtype"):
        fisher_optax.scale_by_natural_galore(window_dtype=dtype)
    with self.assertRaisesRegex(ValueError, "history_size"):
      fisher_optax.scale_by_woodbury_fisher(0)
    with self.assertRaisesRegex(ValueError, "damping"):
      fisher_optax.scale_by_woodbury_fisher(2, -1.0)
    with self.assertRaisesRegex(ValueError, "fisher_source"):
      fisher_optax.scale_by_woodbury_fisher(2, fisher_source="future")
    tx = fisher_optax.scale_by_woodbury_fisher(fisher_source="per_example")
    g = {"w": jnp.ones((2, 2))}
    with self.assertRaisesRegex(ValueError, "per_example_grads"):
      tx.update(g, tx.init(g))
    with self.assertRaisesRegex(ValueError, "per_example_grads"):
      tx.update(g, tx.init(g), per_example_grads={"w": jnp.ones((3, 2, 3))})
    tx = fisher_optax.scale_by_woodbury_fisher(2)
    with self.assertRaisesRegex(ValueError, "structure"):
      tx.update({"v": jnp.ones((2, 2))}, tx.init(g))

  @parameterized.parameters(
    ("history", "batch"), ("per_example", "per_example")
  )
  def test_old_window_source_keyword_warns_and_matches(self, old, new):
    pe = _grads([(3, 4, 2)], 1)[0]
    g = jax.tree.map(lambda x: x.mean(0), pe)
    with self.assertWarns(validation.FisherOptaxDeprecationWarning):
      old_tx = fisher_optax.scale_by_woodbury_fisher(2, 0.1, window_source=old)
    new_tx = fisher_optax.scale_by_woodbury_fisher(2, 0.1, fisher_source=new)
    run = lambda tx: _run(tx, [g, g], per_example_grads=pe)
    chex.assert_trees_all_equal(run(old_tx), run(new_tx))
    with self.assertWarns(validation.FisherOptaxDeprecationWarning):
      fisher_optax.scale_by_woodbury_fisher(fisher_source="history")
    with self.assertRaisesRegex(TypeError, "fisher_source"):
      fisher_optax.scale_by_woodbury_fisher(
        fisher_source="batch", window_source="history"
      )

  def test_works_in_optax_galore_base_slot(self):
    params = {"w": jnp.ones((6, 4)), "b": jnp.ones((4,))}
    tx = optax.contrib.galore(
      1e-2,
      rank=2,
      base_optimizer=optax.chain(
        fisher_optax.scale_by_woodbury_fisher(3, 1e-2), optax.scale_by_adam()
      ),
    )
    grads = _grads([(6, 4), (4,)], 3)
    grads = [{"w": g["w0"], "b": g["w1"]} for g in grads]
    state = tx.init(params)
    for g in grads:
      u, state = jax.jit(tx.update)(g, state, params)
    chex.assert_tree_all_finite((u, state))


class NaturalGaLoreTest(parameterized.TestCase):
  SHAPES = [(8, 5), (4, 9), (7,)]

  @parameterized.parameters(3, 10)
  def test_history_zero_is_optax_galore_bitwise(self, rank):
    grads = _grads(self.SHAPES + [(6, 6)], 3)
    ours, _ = _run(
      fisher_optax.scale_by_natural_galore(
        rank=rank, update_proj_gap=2, scale=0.5, history_size=0
      ),
      grads,
    )
    ref, _ = _run(
      optax.contrib.scale_by_galore(rank=rank, update_proj_gap=2, scale=0.5),
      grads,
    )
    chex.assert_trees_all_equal(ours, ref)

  @parameterized.parameters((None,), ({"w0": True, "w1": False},))
  def test_alias_history_zero_is_optax_galore_alias(self, mask):
    params = {"w0": jnp.ones((8, 5)), "w1": jnp.ones((5,))}
    grads = _grads([(8, 5), (5,)], 3)
    ours = fisher_optax.natural_galore(
      1e-2, 2, 2, 1.0, None, 0.1, mask, history_size=0
    )
    ref = optax.contrib.galore(1e-2, 2, 2, 1.0, None, 0.1, mask)
    s1, s2 = ours.init(params), ref.init(params)
    # Both compiled: op-by-op dispatch rounds Adam differently from XLA.
    update1, update2 = jax.jit(ours.update), jax.jit(ref.update)
    for g in grads:
      u1, s1 = update1(g, s1, params)
      u2, s2 = update2(g, s2, params)
      chex.assert_trees_all_equal(u1, u2)

  def test_huge_damping_normalized_matches_galore(self):
    grads = _grads(self.SHAPES, 4)
    ours, _ = _run(
      fisher_optax.scale_by_natural_galore(
        rank=3,
        update_proj_gap=2,
        history_size=3,
        damping=1e12,
        normalize_output=True,
      ),
      grads,
    )
    ref, _ = _run(
      optax.contrib.scale_by_galore(rank=3, update_proj_gap=2), grads
    )
    chex.assert_trees_all_close(ours, ref, rtol=1e-5, atol=1e-6)

  def test_full_rank_reference_side_identity_base_is_sgd(self):
    grads = _grads(self.SHAPES, 3)
    ours, _ = _run(
      fisher_optax.scale_by_natural_galore(
        rank=100,
        update_proj_gap=2,
        history_size=0,
        base_optimizer=optax.identity(),
        projection_side="smaller",
      ),
      grads,
    )
    chex.assert_trees_all_close(ours, grads, atol=1e-4)
    # The optax side never reaches full rank on a non-square matrix.
    theirs, _ = _run(
      fisher_optax.scale_by_natural_galore(
        rank=100,
        update_proj_gap=2,
        history_size=0,
        base_optimizer=optax.identity(),
      ),
      grads,
    )
    self.assertGreater(
      float(jnp.max(jnp.abs(theirs[1]["w0"] - grads[1]["w0"]))), 1e-2
    )

  @parameterized.parameters("reproject", "keep")
  def test_full_rank_window_is_full_space_woodbury(self, policy):
    """At full rank the low-rank solve is the dense full-space solve.

    With ``reproject`` this holds across refreshes (every step here); with
    ``keep`` only while the basis is fixed.
    """
    with jax.enable_x64(True):
      damping, s = 0.2, 3
      gap = 1 if policy == "reproject" else 100
      grads = _grads([(5, 3), (2, 6)], 5, dtype=jnp.float64)
      for side in ("smaller", "larger"):
        if side == "larger":
          grads = _grads([(3, 3)], 5, dtype=jnp.float64)
        tx = fisher_optax.scale_by_natural_galore(
          rank=10,
          update_proj_gap=gap,
          history_size=s,
          damping=damping,
          base_optimizer=optax.identity(),
          projection_side=side,
          window_at_refresh=policy,
        )
        updates, _ = _run(tx, grads)
        for t, (g, u) in enumerate(zip(grads, updates)):
          window = grads[max(0, t - s + 1) : t + 1]
          for name in g:
            h = np.stack([np.asarray(w[name]) for w in window])
            np.testing.assert_allclose(
              u[name],
              _dense_solve(h, g[name], damping),
              rtol=1e-7,
              atol=1e-8,
              err_msg=f"{side} step {t} {name}",
            )

  @parameterized.parameters("exact", "randomized", "subspace")
  def test_projector_orthonormal_and_refreshed_on_schedule(self, method):
    grads = _grads(self.SHAPES, 4)
    tx = fisher_optax.scale_by_natural_galore(
      rank=3, update_proj_gap=2, history_size=2, svd_method=method
    )
    _, states = _run(tx, grads)
    for t in range(1, len(states)):
      for name in ("w0", "w1"):
        p = states[t].projector[name]
        chex.assert_trees_all_close(p.T @ p, jnp.eye(p.shape[1]), atol=1e-5)
        changed = bool(jnp.any(p != states[t - 1].projector[name]))
        self.assertEqual(changed, (t - 1) % 2 == 0, f"{name} at step {t}")
    self.assertEqual(states[0].projector["w2"].shape, (0, 0))

  @parameterized.parameters("randomized", "subspace")
  def test_inexact_svd_finds_top_subspace(self, method):
    key = jax.random.key(3)
    u, _ = jnp.linalg.qr(jax.random.normal(key, (40, 40)))
    v, _ = jnp.linalg.qr(
      jax.random.normal(jax.random.fold_in(key, 1), (30, 30))
    )
    sv = 2.0 ** -jnp.arange(30.0)
    g = {"w": (u[:, :30] * sv) @ v.T}
    tx = fisher_optax.scale_by_natural_galore(
      rank=4, history_size=0, svd_method=method
    )
    _, state = jax.jit(tx.update)(g, tx.init(g))
    p = state.projector["w"]
    exact = u[:, :4]
    chex.assert_trees_all_close(p @ p.T, exact @ exact.T, atol=1e-4)

  @parameterized.parameters("randomized", "subspace")
  def test_inexact_svd_keeps_column_signs_across_refreshes(self, method):
    # The base optimizer's moments survive a refresh: a column must keep its
    # sign where the new basis overlaps the old, even when its largest entry
    # moves to one of the opposite sign.
    unit = lambda x: x / jnp.linalg.norm(x)
    u0 = unit(jnp.array([1.0, -0.98, 0.1, 0.2, 0.1, 0.05]))
    u1 = unit(jnp.array([0.98, -1.0, 0.1, 0.2, 0.1, 0.05]))
    v0 = unit(jnp.array([1.0, -0.97, 0.3, 0.1, 0.2]))
    v1 = unit(jnp.array([0.97, -1.0, 0.3, 0.1, 0.2]))
    tx = fisher_optax.scale_by_natural_galore(
      rank=1, history_size=0, update_proj_gap=1, svd_method=method
    )
    state = tx.init({"w": jnp.zeros((6, 5))})
    projectors = []
    for u, v in ((u0, v0), (u1, v1)):
      _, state = tx.update({"w": 10.0 * jnp.outer(u, v)}, state)
      projectors.append(state.projector["w"])
    overlap = jnp.sum(projectors[0] * projectors[1], axis=0)
    self.assertGreater(float(overlap.min()), 0.9)

  def test_zero_size_leaf_every_svd_method(self):
    # min(m, n) == 0 gives rank 0: nothing to decompose, at every refresh.
    params = {
      "w": jnp.zeros((0, 5)),
      "u": jnp.zeros((4, 0)),
      "v": jnp.ones((6, 4)),
    }
    grads = [dict(params, v=g["w0"]) for g in _grads([(6, 4)], 3)]
    for method in ("exact", "randomized", "subspace"):
      for side in ("larger", "smaller"):
        with self.subTest(method=method, side=side):
          tx = fisher_optax.scale_by_natural_galore(
            rank=2,
            update_proj_gap=1,
            history_size=2,
            svd_method=method,
            projection_side=side,
          )
          updates, states = _run(tx, grads)
          chex.assert_trees_all_equal_shapes(updates[-1], params)
          chex.assert_tree_all_finite((updates, states[-1]))
          self.assertEqual(states[-1].projector["w"].shape[1], 0)
          self.assertEqual(states[-1].projector["u"].shape[1], 0)
          # The empty leaves leave the others alone (up to the rounding of
          # another random sketch: the key depends on the leaf's index).
          alone, _ = _run(tx, [{"v": g["v"]} for g in grads])
          chex.assert_trees_all_close(
            updates[-1]["v"], alone[-1]["v"], rtol=1e-4, atol=1e-6
          )

  def test_shapes_tall_wide_square_and_rank_above_min(self):
    params = {
      "tall": jnp.ones((9, 4)),
      "wide": jnp.ones((3, 8)),
      "square": jnp.ones((5, 5)),
      "bias": jnp.ones((5,)),
      "conv": jnp.ones((2, 3, 4)),
    }
    dims = {
      "tall": fisher_optax_dims(),
      "wide": fisher_optax_dims(),
      "square": fisher_optax_dims(),
      "bias": None,
      "conv": optax.contrib.GaLoreDimensionNumbers((0, 1), 2),
    }
    expect = {
      "larger": {
        "tall": ((9, 4), (4, 4)),
        "wide": ((8, 3), (3, 3)),
        "square": ((5, 5), (5, 5)),
        "conv": ((6, 4), (4, 4)),
      },
      "smaller": {
        "tall": ((4, 4), (9, 4)),
        "wide": ((3, 3), (3, 8)),
        "square": ((5, 5), (5, 5)),
        "conv": ((4, 4), (6, 4)),
      },
    }
    for side, shapes in expect.items():
      tx = fisher_optax.scale_by_natural_galore(
        rank=6,
        history_size=2,
        weight_dimension_numbers=dims,
        projection_side=side,
      )
      state = tx.init(params)
      for name, (p_shape, low_shape) in shapes.items():
        self.assertEqual(state.projector[name].shape, p_shape, f"{side} {name}")
        self.assertEqual(state.window[name].shape, (2,) + low_shape)
        self.assertEqual(state.base_optimizer_state.mu[name].shape, low_shape)
      u, state = jax.jit(tx.update)(params, state)
      chex.assert_trees_all_equal_shapes(u, params)
      chex.assert_tree_all_finite((u, state))

  def test_window_policies_at_refresh(self):
    grads = _grads([(8, 3)], 4)
    states = {}
    for policy in ("keep", "reset", "reproject"):
      tx = fisher_optax.scale_by_natural_galore(
        rank=2, update_proj_gap=2, history_size=3, window_at_refresh=policy
      )
      _, st = _run(tx, grads[:3])
      states[policy] = st
    before = states["keep"][2]  # after steps 0 and 1; refresh at count 2
    after = {k: v[3] for k, v in states.items()}
    newest = lambda st: st.window["w0"][2]
    # keep: old rows untouched; reset: only the newest row left.
    chex.assert_trees_all_equal(
      after["keep"].window["w0"][:2], before.window["w0"][:2]
    )
    chex.assert_trees_all_equal(
      after["reset"].window["w0"][:2], jnp.zeros((2, 2, 3))
    )
    p_old = before.projector["w0"]
    p_new = after["reproject"].projector["w0"]
    rotated = jnp.einsum(
      "ij,sjn->sin", p_new.T @ p_old, before.window["w0"][:2]
    )
    chex.assert_trees_all_close(
      after["reproject"].window["w0"][:2], rotated, atol=1e-6
    )
    for st in after.values():
      chex.assert_trees_all_close(newest(st), newest(after["keep"]))
      w = st.window["w0"].reshape(3, -1)
      chex.assert_trees_all_close(st.window_gram["w0"], w @ w.T, atol=1e-5)

  @parameterized.parameters("exact", "randomized", "subspace")
  def test_zero_and_nan_gradients_at_refresh_keep_a_finite_basis(self, method):
    tx = fisher_optax.scale_by_natural_galore(
      rank=2, update_proj_gap=1, history_size=2, svd_method=method
    )
    g = {"w": jnp.arange(12.0).reshape(4, 3) - 5.0}
    state = tx.init(g)
    update = jax.jit(tx.update)
    _, state = update(jax.tree.map(jnp.zeros_like, g), state)
    chex.assert_tree_all_finite(state)
    chex.assert_trees_all_equal(state.projector["w"], jnp.eye(4, 2))
    _, state = update(g, state)
    good = state.projector["w"]
    _, state = update(jax.tree.map(lambda x: x * jnp.nan, g), state)
    chex.assert_trees_all_equal(state.projector["w"], good)
    chex.assert_tree_all_finite(state.window)
    chex.assert_tree_all_finite(state.window_gram)
    tiny = jax.tree.map(lambda x: x * 1e-30, g)
    _, state = update(tiny, state)
    chex.assert_tree_all_finite(state.projector)

  def test_per_example_window_matches_dense(self):
    with jax.enable_x64(True):
      pe = _grads([(6, 7, 4)], 1, dtype=jnp.float64)[0]
      g = jax.tree.map(lambda x: x.mean(0), pe)
      tx = fisher_optax.scale_by_natural_galore(
        rank=3,
        damping=0.05,
        base_optimizer=optax.identity(),
        fisher_source="per_example",
        normalize_output=True,
      )
      u, state = tx.update(g, tx.init(g), per_example_grads=pe)
      p = np.asarray(state.projector["w0"])  # (7, 3), left side
      h = np.einsum("ij,bjk->bik", p.T, np.asarray(pe["w0"]))
      low = p.T @ np.asarray(g["w0"])
      expect = p @ (0.05 * _dense_solve(h, low, 0.05, scale=1 / 6))
      np.testing.assert_allclose(u["w0"], expect, rtol=1e-8, atol=1e-10)
      self.assertEqual(state.window["w0"].shape, (0, 3, 4))

  def test_bfloat16_params_and_window(self):
    params = {"w": jnp.ones((6, 4), jnp.bfloat16)}
    grads = _grads([(6, 4)], 3, dtype=jnp.bfloat16)
    grads = [{"w": g["w0"]} for g in grads]
    tx = fisher_optax.natural_galore(
      1e-2, rank=2, history_size=2, window_dtype=jnp.bfloat16
    )
    state = tx.init(params)
    self.assertEqual(state[0].window["w"].dtype, jnp.bfloat16)
    self.assertEqual(state[0].window_gram["w"].dtype, jnp.float32)
    for g in grads:
      u, state = jax.jit(tx.update)(g, state, params)
      self.assertEqual(u["w"].dtype, jnp.bfloat16)
    chex.assert_tree_all_finite((u, state))

  def test_inject_damping_and_static_sizes(self):
    factory = optax.inject_hyperparams(
      fisher_optax.natural_galore,
      static_args=("rank", "history_size", "svd_power_iterations"),
    )
    tx = factory(learning_rate=1e-2, rank=2, history_size=2, damping=0.1)
    params = {"w": jnp.ones((5, 3))}
    state = tx.init(params)
    state.hyperparams["damping"] = jnp.asarray(1e9)
    u1, _ = jax.jit(tx.update)(params, state, params)
    state.hyperparams["damping"] = jnp.asarray(1e-2)
    u2, _ = jax.jit(tx.update)(params, state, params)
    self.assertFalse(bool(jnp.allclose(u1["w"], u2["w"])))
    with self.assertRaisesRegex(TypeError, "rank"):
      optax.inject_hyperparams(fisher_optax.natural_galore)(
        learning_rate=1e-2
      ).init(params)

  def test_bad_inputs_raise(self):
    ng = fisher_optax.scale_by_natural_galore
    with self.assertRaisesRegex(TypeError, "rank"):
      ng(rank=2.0)
    with self.assertRaisesRegex(ValueError, "rank"):
      ng(rank=0)
    with self.assertRaisesRegex(ValueError, "damping"):
      ng(damping=0.0)
    with self.assertRaisesRegex(ValueError, "update_proj_gap"):
      ng(update_proj_gap=0)
    for arg in (
      "projection_side",
      "window_at_refresh",
      "svd_method",
      "fisher_source",
    ):
      with self.assertRaisesRegex(ValueError, arg):
        ng(**{arg: "nonsense"})
    params = {"w": jnp.ones((4, 3)), "v": jnp.ones((2, 2))}
    with self.assertRaisesRegex(ValueError, "weight_dimension_numbers"):
      ng(weight_dimension_numbers={"w": fisher_optax_dims()}).init(params)
    with self.assertRaisesRegex(ValueError, "disjoint"):
      ng(
        weight_dimension_numbers=optax.contrib.GaLoreDimensionNumbers(0, 0)
      ).init(params)
    with self.assertRaisesRegex(ValueError, "rank >= 2"):
      ng(
        weight_dimension_numbers={
          "w": fisher_optax_dims(),
          "v": None,
          "b": fisher_optax_dims(),
        }
      ).init({**params, "b": jnp.ones((3,))})
    tx = ng(rank=2)
    state = tx.init(params)
    with self.assertRaisesRegex(ValueError, "structure"):
      tx.update({"w": params["w"]}, state)
    with self.assertRaisesRegex(ValueError, "projector"):
      tx.update({"w": jnp.ones((5, 3)), "v": params["v"]}, state)
    tx = ng(rank=2, fisher_source="per_example")
    with self.assertRaisesRegex(ValueError, "per_example_grads"):
      tx.update(params, tx.init(params))

  def test_update_proj_gap_below_one_or_fractional_is_refused(self):
    ng = fisher_optax.scale_by_natural_galore
    for gap in (
      0,
      np.int64(0),
      np.int32(-3),
      jnp.array(0),
      np.array(-1),
      0.5,
      2.5,
      np.float32(0.0),
      jnp.array(2.5),
      float("nan"),
      float("inf"),
    ):
      with self.subTest(gap=repr(gap)):
        with self.assertRaisesRegex(ValueError, "update_proj_gap"):
          ng(rank=2, history_size=2, update_proj_gap=gap)
    with self.assertRaisesRegex(ValueError, "update_proj_gap.*scalar"):
      ng(update_proj_gap=jnp.array([2, 2]))
    for gap in (True, "2", lambda count: 2):
      with self.subTest(gap=repr(gap)):
        with self.assertRaisesRegex(TypeError, "update_proj_gap"):
          ng(update_proj_gap=gap)
    # The other counts are static: NumPy values are checked as ints are.
    for name, value in (
      ("rank", np.int64(0)),
      ("history_size", np.int32(-1)),
      ("svd_power_iterations", np.int64(-1)),
    ):
      with self.subTest(name=name):
        with self.assertRaisesRegex(ValueError, name):
          ng(**{name: value})
    factory = optax.inject_hyperparams(
      fisher_optax.natural_galore,
      static_args=("rank", "history_size", "svd_power_iterations"),
    )
    params = {"w": jnp.ones((6, 4))}
    with self.assertRaisesRegex(ValueError, "update_proj_gap"):
      factory(1e-2, rank=2, history_size=2, update_proj_gap=0).init(params)
    tx = factory(1e-2, rank=2, history_size=2, update_proj_gap=2)
    state = tx.init(params)
    state.hyperparams["update_proj_gap"] = jnp.asarray(-2)
    with self.assertRaisesRegex(ValueError, "update_proj_gap"):
      tx.update(params, state, params)  # concrete: checked
    jax.jit(tx.update)(params, state, params)  # traced: passes
    # Integers of any kind and integral floats give the same schedule.
    grads = [{"w": g["w0"]} for g in _grads([(6, 4)], 3)]
    run = lambda gap: _run(
      ng(rank=2, history_size=2, update_proj_gap=gap), grads
    )
    ref = run(2)
    for gap in (np.int64(2), 2.0, jnp.array(2.0)):
      with self.subTest(gap=repr(gap)):
        chex.assert_trees_all_close(run(gap), ref, rtol=1e-6)

  @parameterized.parameters(
    ("history", "batch"), ("per_example", "per_example")
  )
  def test_old_window_source_keyword_warns_and_matches(self, old, new):
    pe = _grads([(4, 6, 5)], 1)[0]
    g = jax.tree.map(lambda x: x.mean(0), pe)
    kw = dict(rank=2, update_proj_gap=1, history_size=2, damping=0.1)
    for factory in (
      lambda **k: fisher_optax.scale_by_natural_galore(**kw, **k),
      lambda **k: fisher_optax.natural_galore(1e-2, **kw, **k),
    ):
      with self.assertWarns(validation.FisherOptaxDeprecationWarning):
        old_tx = factory(window_source=old)
      new_tx = factory(fisher_source=new)
      run = lambda tx: _run(tx, [g, g], per_example_grads=pe, params=g)
      chex.assert_trees_all_equal(run(old_tx), run(new_tx))


class NaturalGaLoreFloat32AccuracyTest(parameterized.TestCase):
  """float32 against the same steps in float64 at the default damping.

  The low-rank gradient of a 256 x 512 leaf at rank 16 has ``|g|^2 /
  damping`` near 1e7: ``(g - G^T C^{-1} G g) / damping`` cancelled almost
  all of it and the preconditioned gradients were 10-146% off. The gradient
  is the row just pushed, so the solve now stays in the window's span.
  """

  def test_matches_float64(self):
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=(256, 512)) for _ in range(10)]

    def run(dtype):
      tx = fisher_optax.scale_by_natural_galore(
        rank=16,
        base_optimizer=optax.identity(),
        update_proj_gap=1000,
        damping=1e-3,
      )
      params = {"w": jnp.zeros((256, 512), dtype)}
      state, step, outs = tx.init(params), jax.jit(tx.update), []
      for g in grads:
        u, state = step({"w": jnp.asarray(g, dtype)}, state, params)
        outs.append(np.asarray(u["w"], np.float64))
      return outs

    got = run(jnp.float32)
    with jax.enable_x64(True):
      want = run(jnp.float64)
    for a, b in zip(got, want):
      self.assertLess(np.linalg.norm(a - b) / np.linalg.norm(b), 1e-4)

  @parameterized.parameters(1e-3, 1e-5)
  def test_per_example_source_solves_in_the_rows_span(self, damping):
    # One example: the gradient is its row, F = damping I + l l^T in the
    # low-rank space, and F^{-1} l = l / (damping + |l|^2). The solve was
    # (l - G^T C^{-1} G l) / damping: 4% off at 1e-3, all of it at 1e-5.
    g = jnp.asarray(
      np.random.default_rng(5).normal(size=(64, 128)), jnp.float32
    )
    params = {"w": jnp.zeros((64, 128))}
    tx = fisher_optax.scale_by_natural_galore(
      rank=8,
      base_optimizer=optax.identity(),
      damping=damping,
      fisher_source="per_example",
    )
    state = tx.init(params)
    u, state = jax.jit(tx.update)(
      {"w": g}, state, params, per_example_grads={"w": g[None]}
    )
    p = np.asarray(state.projector["w"], np.float64)  # (128, 8): right side
    low = np.asarray(g, np.float64) @ p
    want = low / (damping + np.sum(low**2)) @ p.T
    err = np.linalg.norm(np.asarray(u["w"], np.float64) - want)
    self.assertLess(err / np.linalg.norm(want), 1e-5)


class OrthonormalizeTest(parameterized.TestCase):
  """The sketched refresh's Cholesky-QR and its Householder fallback."""

  def test_partial_breakdown_takes_the_fallback(self):
    """A Cholesky-QR basis with one NaN entry (a partial breakdown) is
    refused however wide it is: XLA:CPU's max over 4096 or more elements
    can skip a NaN, so the orthogonality error alone would pass it."""
    from fisher_optax import _natural_galore  # noqa: PLC0415

    real, calls = _natural_galore._cholesky_qr, []

    def breaks_last(y, shift=0.0):
      q = real(y, shift)
      calls.append(None)
      return q.at[3, 5].set(jnp.nan) if len(calls) == 3 else q

    y = jax.random.normal(jax.random.key(0), (256, 72))  # 72^2 > 4096
    with mock.patch.object(_natural_galore, "_cholesky_qr", breaks_last):
      q = np.asarray(jax.jit(_natural_galore._orthonormalize)(y))
    self.assertLen(calls, 3)
    self.assertTrue(np.all(np.isfinite(q)))
    np.testing.assert_allclose(q.T @ q, np.eye(72), atol=1e-5)


class NaturalGaLoreNonfiniteTest(parameterized.TestCase):
  """The one non-finite policy and the one shape check.

  The guards exist because LAPACK's SVD (and eigh) on a matrix holding an
  infinity need not terminate on XLA:CPU: a bad gradient at a basis refresh
  must never reach the decomposition, and a finite 1e30 gradient, whose
  window Gram and Adam moments overflow float32, must not poison the state.
  """

  PARAMS = {"w": jnp.ones((6, 4)), "b": jnp.zeros((4,))}

  def _grads(self):
    g = _grads([(6, 4), (4,)], 1, seed=3)[0]
    return {"w": g["w0"], "b": g["w1"]}

  @staticmethod
  def _per_example(g):
    return {"per_example_grads": jax.tree.map(lambda x: jnp.stack([x, -x]), g)}

  # steps_before=(2, 1) with update_proj_gap=2: the bad step is a refresh
  # step (count 2) and a step between refreshes (count 1).
  @pytest.mark.timeout(240)
  @parameterized.parameters(
    ("batch", "exact"),
    ("per_example", "exact"),
    ("batch", "randomized"),
    ("batch", "subspace"),
  )
  def test_policy(self, fisher_source, svd_method):
    tx = fisher_optax.scale_by_natural_galore(
      rank=2,
      update_proj_gap=2,
      history_size=2,
      fisher_source=fisher_source,
      svd_method=svd_method,
    )
    extra = self._per_example if fisher_source == "per_example" else None
    nonfinite_testing.check_policy(
      self, tx, self.PARAMS, self._grads(), steps_before=(2, 1), extra=extra
    )

  # Every step a refresh; history_size=0 is GaLore (only Adam overflows).
  @pytest.mark.timeout(240)
  @parameterized.parameters(0, 2)
  def test_alias_policy_refresh_every_step(self, history_size):
    tx = fisher_optax.natural_galore(
      optax.linear_schedule(1e-2, 1e-3, 10),
      rank=2,
      update_proj_gap=1,
      history_size=history_size,
      weight_decay=1e-2,
    )
    nonfinite_testing.check_policy(self, tx, self.PARAMS, self._grads())

  @parameterized.parameters("batch", "per_example")
  def test_huge_finite_gradient_leaves_the_state_unchanged(self, source):
    tx = fisher_optax.scale_by_natural_galore(
      rank=2, update_proj_gap=1, history_size=2, fisher_source=source
    )
    g = self._grads()
    extra = self._per_example if source == "per_example" else (lambda g: {})
    update = jax.jit(lambda g, s: tx.update(g, s, **extra(g)))
    _, state = update(g, tx.init(self.PARAMS))
    huge = jax.tree.map(lambda x: jnp.full_like(x, 1e30), g)
    updates, new_state = update(huge, state)
    chex.assert_trees_all_equal(
      new_state._replace(notfinite_count=state.notfinite_count), state
    )
    self.assertEqual(int(new_state.notfinite_count), 1)
    # A finite gradient: zeros, not NaN (apply_if_finite would let NaN in).
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, g))
    updates, after = update(g, new_state)
    chex.assert_tree_all_finite((updates, after))
    self.assertEqual(int(after.count), int(state.count) + 1)

  @parameterized.parameters("batch", "per_example")
  def test_large_repeated_gradients_are_not_skipped(self, source):
    # |g|^2 / damping ~ 1e9 on a window of equal gradients: the exact
    # damping is below float32's resolution of the window's Gram, whose
    # Cholesky failed, so every step after the first was skipped (zero
    # updates). The damping floored at m eps trace solves it.
    g = {"w": 100.0 * jax.random.normal(jax.random.key(0), (16, 8))}
    tx = fisher_optax.scale_by_natural_galore(
      rank=4,
      history_size=8,
      damping=1e-3,
      base_optimizer=optax.identity(),
      fisher_source=source,
    )
    pe = {"w": jnp.broadcast_to(g["w"], (4, 16, 8))}
    extra = {"per_example_grads": pe} if source == "per_example" else {}
    state = tx.init(g)
    for k in range(1, 6):
      u, state = tx.update(g, state, **extra)
      self.assertEqual(int(state.notfinite_count), 0)
      # The projected gradient lg is the same every step, so F^{-1} lg =
      # lg / (lam + c |lg|^2), c = k gradients in the window (a mean of 4
      # equal rows per example: c = 1): |u| c |lg| = 1 to the floor's
      # 1/m. u is parallel to P lg, so |lg| = <g, u> / |u|.
      norm = float(jnp.linalg.norm(u["w"]))
      lg_norm = float(jnp.vdot(g["w"], u["w"])) / norm
      c = k if source == "batch" else 1
      self.assertAlmostEqual(norm * c * lg_norm, 1.0, delta=0.15)

  def test_nan_gradient_gives_nan_updates_and_keeps_the_base_state(self):
    tx = fisher_optax.scale_by_natural_galore(
      rank=2, update_proj_gap=1, history_size=2
    )
    g = self._grads()
    _, state = tx.update(g, tx.init(self.PARAMS))
    bad = dict(g, b=g["b"].at[0].set(jnp.nan))  # an unprojected leaf
    updates, new_state = tx.update(bad, state)
    self.assertTrue(bool(jnp.all(jnp.isnan(updates["w"]))))
    chex.assert_trees_all_equal(
      new_state.base_optimizer_state, state.base_optimizer_state
    )
    chex.assert_trees_all_equal(new_state.projector, state.projector)

  def test_float16_default_adam_state_does_not_overflow(self):
    params = jax.tree.map(lambda x: x.astype(jnp.float16), self.PARAMS)
    g = jax.tree.map(lambda x: jnp.full_like(x, 1e3), params)
    tx = fisher_optax.scale_by_natural_galore(rank=2, history_size=0)
    updates, state = tx.update(g, tx.init(params))
    self.assertEqual(int(state.notfinite_count), 0)
    self.assertEqual(updates["w"].dtype, jnp.float16)
    chex.assert_tree_all_finite((updates, state))

  def test_normalize_output_must_be_a_bool(self):
    for make in (
      fisher_optax.scale_by_natural_galore,
      fisher_optax.natural_galore,
    ):
      kw = (
        {}
        if make is fisher_optax.scale_by_natural_galore
        else {"learning_rate": 1e-2}
      )
      with self.assertRaisesRegex(TypeError, "normalize_output must be True"):
        make(normalize_output="no", **kw)

  def test_mismatched_gradients_are_refused(self):
    params = {"w": jnp.ones((8, 6)), "b": jnp.ones((6,))}
    for bad in (jnp.ones(()), jnp.ones((6, 8))):
      g = dict(params, w=bad)
      for name, tx in (
        ("scale_by", fisher_optax.scale_by_natural_galore(rank=2)),
        ("alias", fisher_optax.natural_galore(1e-2, rank=2)),
      ):
        state = tx.init(params)
        for with_params in (True, False):
          if name == "alias" and not with_params:
            continue
          with self.subTest(shape=bad.shape, tx=name, params=with_params):
            args = (params,) if with_params else ()
            with self.assertRaisesRegex(
              ValueError, r"updates do not match params.*updates\['w'\]"
            ):
              tx.update(g, state, *args)

  def test_every_leaf_shape_is_checked_without_params(self):
    # A transposed leaf at rank >= min(m, n) flips the projected side and
    # gives the same projector and low-rank shapes; an unprojected leaf
    # would broadcast through Adam.
    params = {"w": jnp.ones((8, 6)), "b": jnp.ones((6,))}
    cases = [(rank, dict(params, w=jnp.ones((6, 8)))) for rank in (6, 100)]
    cases += [(2, dict(params, b=b)) for b in (jnp.ones(()), jnp.ones((1,)))]
    for rank, g in cases:
      bad = "w" if g["w"].shape != params["w"].shape else "b"
      for name, tx in (
        ("scale_by", fisher_optax.scale_by_natural_galore(rank=rank)),
        (
          "chain",
          optax.chain(
            fisher_optax.scale_by_natural_galore(rank=rank), optax.scale(-1.0)
          ),
        ),
      ):
        # init and update traced apart, and the state restored from its
        # leaves against an abstract target (as a checkpoint restore does).
        state = jax.jit(tx.init)(params)
        target = jax.eval_shape(tx.init, params)
        restored = jax.tree.unflatten(
          jax.tree.structure(target),
          [np.asarray(x) for x in jax.tree.leaves(state)],
        )
        for st in (state, restored):
          with self.subTest(rank=rank, leaf=bad, tx=name):
            with self.assertRaisesRegex(
              ValueError, rf"updates do not match params.*updates\['{bad}'\]"
            ):
              jax.jit(tx.update)(g, st)
            u, _ = jax.jit(tx.update)(params, st)
            chex.assert_trees_all_equal_shapes(u, params)

  def test_state_without_leaf_shapes_checks_projected_shapes(self):
    # A state built by hand without the field: the projected shapes only.
    params = {"w": jnp.ones((8, 6)), "b": jnp.ones((6,))}
    tx = fisher_optax.scale_by_natural_galore(rank=2)
    state = tx.init(params)._replace(leaf_shapes=None)
    tx.update(params, state)
    with self.assertRaisesRegex(ValueError, r"updates\['w'\]"):
      tx.update(dict(params, w=jnp.ones((6, 8))), state)


def fisher_optax_dims():
  return optax.contrib.GaLoreDimensionNumbers(0, 1)


class NaturalGaLoreDonatedWindowTest(parameterized.TestCase):
  """Between refreshes the window is written in place, never copied.

  A whole-window copy (the window carried through the non-finite policy's
  cond or select, a layout change at the refresh cond, a read of the window
  after its in-place write) shows as temp memory of at least one window.
  A refresh that reprojects the window needs one rotated window (and the
  broadcast rotation) as temporaries, but only on refresh steps.
  """

  PARAMS = {"k": jnp.zeros((128, 96)), "b": jnp.zeros((96,))}

  @parameterized.parameters(("keep", 0.5), ("reset", 0.5), ("reproject", 2.5))
  def test_no_window_copy(self, window_at_refresh, max_windows):
    tx = fisher_optax.natural_galore(
      1e-3, rank=64, history_size=16, window_at_refresh=window_at_refresh
    )
    params = self.PARAMS
    grads = jax.tree.map(jnp.ones_like, params)
    state = tx.init(params)
    window_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim == 3)
    step = jax.jit(lambda g, s: tx.update(g, s, params), donate_argnums=1)
    memory = step.lower(grads, state).compile().memory_analysis()
    assert memory is not None
    self.assertLess(memory.temp_size_in_bytes, max_windows * window_bytes)
    self.assertGreaterEqual(memory.alias_size_in_bytes, window_bytes)
    for _ in range(2):  # a refresh step, then a steady one, both donated
      u, state = step(grads, state)
    chex.assert_tree_all_finite((u, state))


class NaturalGaLorePolicyFanInTest(parameterized.TestCase):
  """The non-finite policy's decision is formed once per step.

  It combines a flag per leaf of the low-rank updates and state. Formed
  outside the step's cond, XLA:CPU fused that combination into every
  select of the state: each read one operand per leaf, so a step's work
  grew with the square of its leaf count (198 such fusions at 48 leaves).
  """

  @parameterized.parameters(0, 4)
  def test_no_fusion_reads_every_leaf(self, history_size):
    n = 48
    params = {
      f"l{i}": jnp.ones((8,)) if i % 2 else jnp.ones((4, 6)) for i in range(n)
    }
    tx = fisher_optax.natural_galore(1e-2, rank=2, history_size=history_size)
    grads = jax.tree.map(lambda x: 0.3 * x, params)
    hlo = (
      jax.jit(lambda g, s: tx.update(g, s, params))
      .lower(grads, tx.init(params))
      .compile()
      .as_text()
    )
    fan_in = [
      line.count("%") - 1 for line in hlo.splitlines() if " fusion(" in line
    ]
    self.assertNotEmpty(fan_in)
    self.assertLessEqual(sum(k >= n for k in fan_in), 8)


# Trains two small weights with natural_galore, every lane its own learning
# rate, under jit(vmap(...)) and lane by lane; prints the largest difference.
# Its own process: on XLA:CPU a batched LAPACK call can deadlock the thread
# pool, and a hang must fail the test, not stall the suite.
_VMAP_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
import fisher_optax

svd_method, history_size = sys.argv[1], int(sys.argv[2])
# float64: the lanes must agree to rounding, which Adam would amplify in
# float32 where a low-rank gradient entry is near zero.
jax.config.update("jax_enable_x64", True)
tx = fisher_optax.natural_galore(
  1.0, rank=8, update_proj_gap=2, history_size=history_size,
  svd_method=svd_method,
)
keys = jax.random.split(jax.random.key(0), 3)
params = {
  "a": jax.random.normal(keys[0], (48, 40), jnp.float64),
  "b": jax.random.normal(keys[1], (40, 48), jnp.float64),
}
x = jax.random.normal(keys[2], (6, 16, 48), jnp.float64)

def loss(p, xb):
  return jnp.mean(jnp.square(jnp.tanh(xb @ p["a"]) @ p["b"] - xb))

def train(lr):
  def body(carry, xb):
    p, s = carry
    u, s = tx.update(jax.grad(loss)(p, xb), s, p)
    p = optax.apply_updates(p, jax.tree.map(lambda v: lr * v, u))
    return (p, s), loss(p, xb)
  (p, s), losses = jax.lax.scan(body, (params, tx.init(params)), x)
  return p, s, losses

lrs = jnp.asarray([1e-2, 3e-2])
batched = jax.jit(jax.vmap(train))(lrs)
lanes = [jax.jit(train)(lr) for lr in lrs]
diff = max(
  float(np.max(np.abs(np.asarray(b[i]) - np.asarray(l)), initial=0.0))
  for i, lane in enumerate(lanes)
  for b, l in zip(jax.tree.leaves(batched), jax.tree.leaves(lane))
)
finite = bool(all(jnp.all(jnp.isfinite(v)) for v in jax.tree.leaves(batched)))
print(json.dumps({"diff": diff, "finite": finite}))
"""


def _walk_svds(jaxpr, under_cond=False):
  """``under_cond`` for every ``svd`` equation of ``jaxpr``, nested ones too."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "svd":
      out.append(under_cond)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          cond = under_cond or eqn.primitive.name == "cond"
          out.extend(_walk_svds(sub, cond))
  return out


class NaturalGaLoreVmapTest(parameterized.TestCase):
  """Under ``jax.vmap`` over learning rates a step finishes, lane by lane.

  ``jit(vmap(train))`` over learning rates once hung XLA:CPU (every thread
  waiting at 0% CPU): a gradient-dependent refresh predicate, batched, ran
  the SVD on every step as a select, and each leaf's batched SVD blocked a
  thread-pool thread until its batch, queued on the same exhausted pool,
  was done.
  """

  @parameterized.parameters(("exact", 4), ("randomized", 0))
  def test_vmap_over_learning_rates_equals_lanes(self, method, history):
    proc = subprocess.run(
      [sys.executable, "-c", _VMAP_SCRIPT, method, str(history)],
      cwd=_ROOT,
      env={**os.environ, "PYTHONPATH": str(_ROOT)},
      capture_output=True,
      text=True,
      timeout=240,
      check=False,
    )
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    self.assertTrue(result["finite"])
    self.assertLess(result["diff"], 1e-9)

  def test_refresh_stays_a_cond_and_unbatched_under_vmap(self):
    tx = fisher_optax.natural_galore(1.0, rank=4, update_proj_gap=3)
    params = {"w": jnp.ones((8, 6)), "b": jnp.ones((6,))}

    def step(lr, g):
      u, _ = tx.update(g, tx.init(params), params)
      return jax.tree.map(lambda v: lr * v, u)

    grads = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), params)
    vmapped = jax.vmap(step)
    jaxpr = jax.make_jaxpr(vmapped)(jnp.ones(2), grads).jaxpr
    # The SVD runs only on refresh steps: under a cond, not a select.
    self.assertEqual(_walk_svds(jaxpr), [True])
    # No decomposition of the refresh sees the vmap axis. (The window
    # solve's s x s Cholesky is one batched call per step by design.)
    hlo = jax.jit(vmapped).lower(jnp.ones(2), grads).as_text()
    calls = [line for line in hlo.splitlines() if "lapack_sgesdd" in line]
    self.assertNotEmpty(calls)
    for line in calls:
      self.assertIn('num_batch_dims = "0"', line)


if __name__ == "__main__":
  absltest.main()
