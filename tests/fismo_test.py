# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for FISMO (fisher_optax._fismo)."""

from __future__ import annotations

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers
import pytest

import fisher_optax
from fisher_optax import _matrix_roots
from tests import nonfinite_testing

DN = fisher_optax.FISMODimensionNumbers
EXACT_NS = ((2.0, -1.5, 0.5), 24)  # convergent quintic: the exact polar.

# -- a float64 NumPy re-implementation of the paper's Algorithm 1 ------------


def _np_inv_sqrt(a):
  w, v = np.linalg.eigh(0.5 * (a + a.T))
  return (v * w**-0.5) @ v.T


def _np_ns(x, coeffs, steps, eps=1e-8):
  tr = x.shape[0] > x.shape[1]
  x = x.T if tr else x
  x = x / (np.linalg.norm(x) + eps)
  for _ in range(steps):
    a = x @ x.T
    x = coeffs[0] * x + (coeffs[1] * a + coeffs[2] * a @ a) @ x
  return x.T if tr else x


def numpy_fismo(grads, *, beta, gamma, damping, factor_norm, coeffs, steps):
  """Algorithm 1, refreshing roots every step; returns updates, P, Q."""
  m, n = grads[0].shape
  p, q, mom = np.eye(m), np.eye(n), np.zeros((m, n))
  out = []
  for t, g in enumerate(grads, start=1):

    def ema(old, s, d):
      if factor_norm == "paper":
        target = s + damping * np.trace(old) / d * np.eye(d)
      else:
        target = (d * s / np.trace(s) + damping * np.eye(d)) / (1 + damping)
      mixed = gamma * old + (1 - gamma) * target
      new = d * mixed / np.trace(mixed)
      return 0.5 * (new + new.T)

    q_is = _np_inv_sqrt(q)
    p = ema(p, g @ q_is @ q_is @ g.T / n, m)
    p_is = _np_inv_sqrt(p)
    q = ema(q, g.T @ p_is @ p_is @ g / m, n)
    q_is = _np_inv_sqrt(q)
    mom = beta * mom + (1 - beta) * (p_is @ g @ q_is)
    mom_hat = mom / (1 - beta**t)
    out.append((p_is @ _np_ns(mom_hat, coeffs, steps) @ q_is, p, q))
  return out


def _grads(seed, shape, num, scale=1.0):
  keys = jax.random.split(jax.random.key(seed), num)
  return [scale * jax.random.normal(k, shape) for k in keys]


def _run_many(txs, params, grads_seqs):
  """Scans each transform over its gradients, all in ONE jit compile.

  ``init`` runs inside the jit too (eagerly it compiles op by op). Returns,
  per transform, the per-step updates and states as NumPy trees.
  """
  stacked = [jax.tree.map(lambda *g: jnp.stack(g), *seq) for seq in grads_seqs]

  @jax.jit
  def run(params, stacked):
    out = []
    for tx, grads in zip(txs, stacked):

      def body(state, g, tx=tx):
        u, state = tx.update(g, state, params)
        return state, (u, state)

      out.append(jax.lax.scan(body, tx.init(params), grads)[1])
    return out

  results = []
  for seq, (ups, states) in zip(grads_seqs, run(params, stacked)):
    ups, states = jax.tree.map(np.asarray, (ups, states))
    unstack = lambda t: [
      jax.tree.map(lambda a, i=i: a[i], t) for i in range(len(seq))
    ]
    results.append((unstack(ups), unstack(states)))
  return results


def _run(tx, params, grads_seq):
  """Updates over a gradient sequence (one compile); updates and states."""
  return _run_many([tx], params, [grads_seq])[0]


def _kron_grads(seed, m, n, num, scale):
  """G = P*^{1/2} Z Q*^{1/2}: batch gradients with a known Kronecker Fisher."""
  rng = np.random.default_rng(seed)

  def spd(d, cond):
    u, _ = np.linalg.qr(rng.normal(size=(d, d)))
    return (u * np.geomspace(cond, 1.0, d)) @ u.T

  p_star, q_star = spd(m, 7.0), spd(n, 4.0)
  ph = np.linalg.cholesky(p_star)
  qh = np.linalg.cholesky(q_star)
  z = rng.normal(size=(num, m, n))
  g = scale * ph @ z @ qh.T
  return jnp.asarray(g, jnp.float32), p_star, q_star


def _cos(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sum(a * b) / np.linalg.norm(a) / np.linalg.norm(b))


@functools.cache
def _scan_runner(kw_items):
  """A jitted scan of scale_by_fismo (interval 1), cached per settings."""
  tx = fisher_optax.scale_by_fismo(precondition_interval=1, **dict(kw_items))

  @jax.jit
  def run(grads):
    params = jnp.zeros(grads.shape[1:], grads.dtype)

    def body(state, g):
      u, state = tx.update(g, state, params)
      return state, u

    return jax.lax.scan(body, tx.init(params), grads)

  return run


class IsotropicMuonTest(parameterized.TestCase):
  """With P = Q = I, FISMO is optax.contrib.muon."""

  def test_identity_factors_equal_muon(self):
    params = {
      "w": jnp.ones((5, 3)),
      "k": jnp.ones((3, 2, 4)),
      "b": jnp.zeros((4,)),
    }
    dims = {"w": DN(), "k": DN(reduction_axis=(0, 1), output_axis=2), "b": None}
    grads = [
      jax.tree.map(
        lambda x, g=g: jnp.cos(x * g + jnp.arange(x.size).reshape(x.shape)),
        params,
      )
      for g in (0.3, 1.1, 2.0)
    ]
    txs = []
    for nesterov in (False, True):
      txs += [
        fisher_optax.fismo(
          3e-2,
          gamma=1.0,
          nesterov=nesterov,
          fismo_weight_dimension_numbers=dims,
        ),
        optax.contrib.muon(
          3e-2, nesterov=nesterov, muon_weight_dimension_numbers=dims
        ),
      ]
    # Both nesterov settings, ours and Muon: one compile.
    out = _run_many(txs, params, [grads] * 4)
    for i, nesterov in enumerate((False, True)):
      with self.subTest(nesterov=nesterov):
        chex.assert_trees_all_close(
          out[2 * i][0], out[2 * i + 1][0], atol=1e-6, rtol=1e-5
        )

  def test_muon_options_pass_through(self):
    """Every option fismo() shares with muon() acts as muon()'s does."""
    params = {"w": jnp.ones((5, 3)), "v": jnp.ones((3, 3)), "b": jnp.ones(4)}
    dims = {"w": DN(), "v": DN(), "b": None}
    shared = dict(
      eps=1e-3,  # Small gradients below: eps and eps_root matter.
      weight_decay=0.1,
      weight_decay_mask={"w": True, "v": False, "b": True},
      nesterov=False,
      adam_b1=0.5,
      adam_b2=0.6,
      adam_eps_root=1e-4,
      adam_weight_decay=0.2,
      adam_learning_rate=1e-1,
      consistent_rms=0.2,
    )
    grads = [
      jax.tree.map(
        lambda x, g=g: (
          1e-2 * jnp.cos(g * x + jnp.arange(x.size).reshape(x.shape))
        ),
        params,
      )
      for g in (0.3, 1.1, 2.5)
    ]
    txs = []
    for kw in (shared, dict(shared, mu_dtype=jnp.bfloat16)):
      txs += [
        fisher_optax.fismo(
          3e-2, gamma=1.0, fismo_weight_dimension_numbers=dims, **kw
        ),
        optax.contrib.muon(3e-2, muon_weight_dimension_numbers=dims, **kw),
      ]
    out = _run_many(txs, params, [grads] * 4)
    chex.assert_trees_all_close(out[0][0], out[1][0], atol=1e-6, rtol=1e-5)
    # bf16 momentum: both round it (differently); the steps stay aligned.
    for a, b in zip(jax.tree.leaves(out[2][0]), jax.tree.leaves(out[3][0])):
      self.assertGreater(_cos(a, b), 0.95)
    inner = out[2][1][0].inner_states["fismo"].inner_state[0]
    self.assertEqual(inner.momentum["w"].dtype, jnp.bfloat16)

  def test_huge_damping_is_muon(self):
    params = {"w": jnp.ones((6, 4))}
    grads = [{"w": g} for g in _grads(0, (6, 4), 3)]
    ours = fisher_optax.scale_by_fismo(damping=1e7, gamma=0.5)
    ref = optax.contrib.scale_by_muon(
      nesterov=False, weight_dimension_numbers={"w": DN()}
    )
    (u1, _), (u2, _) = _run_many([ours, ref], params, [grads, grads])
    chex.assert_trees_all_close(u1, u2, atol=1e-5)


class AlgorithmOracleTest(parameterized.TestCase):
  """Factor updates and steps equal the dense float64 formulas."""

  def test_matches_numpy_algorithm_1(self):
    with jax.enable_x64(True):
      grads = [np.asarray(g, np.float64) * 0.7 for g in _grads(1, (5, 4), 3)]
      norms = ("pre_ema", "paper")
      kws = [
        dict(beta=0.9, gamma=0.8, damping=0.05, factor_norm=f) for f in norms
      ]
      txs = [
        fisher_optax.scale_by_fismo(
          precondition_interval=1,
          root_method="eigh",
          eigenvalue_floor=0.0,
          grafting="none",  # Algorithm 1's step, not rescaled
          **kw,
        )
        for kw in kws
      ]
      params = jnp.zeros((5, 4), jnp.float64)
      jgrads = [jnp.asarray(g) for g in grads]
      # Both factor norms: one compile.
      runs = _run_many(txs, params, [jgrads, jgrads])
      for factor_norm, kw, (ups, states) in zip(norms, kws, runs):
        want = numpy_fismo(
          grads, coeffs=_matrix_roots.QUINTIC_NS_COEFFS, steps=5, **kw
        )
        with self.subTest(factor_norm=factor_norm):
          for u, s, (wu, wp, wq) in zip(ups, states, want):
            np.testing.assert_allclose(s.left_factor[0], wp, atol=1e-12)
            np.testing.assert_allclose(s.right_factor[0], wq, atol=1e-12)
            np.testing.assert_allclose(
              s.left_root[0], _np_inv_sqrt(wp), atol=1e-10
            )
            np.testing.assert_allclose(u, wu, atol=1e-9)

  def test_trust_region_geometry_with_exact_polar(self):
    """||P^1/2 D Q^1/2||_2 = 1 and <G, D> = ||P^-1/2 G Q^-1/2||_nuc."""
    with jax.enable_x64(True):
      coeffs, steps = EXACT_NS
      tx = fisher_optax.scale_by_fismo(
        beta=0.0,
        gamma=0.5,
        ns_coeffs=coeffs,
        ns_steps=steps,
        precondition_interval=1,
        eigenvalue_floor=0.0,
        root_method="eigh",
        grafting="none",  # the paper's trust-region step
      )
      grads = [jnp.asarray(g, jnp.float64) for g in _grads(2, (6, 4), 3)]
      ups, states = _run(tx, jnp.zeros((6, 4), jnp.float64), grads)
      d, s, g = np.asarray(ups[-1]), states[-1], np.asarray(grads[-1])
      p, q = np.asarray(s.left_factor[0]), np.asarray(s.right_factor[0])
      ph = np.linalg.inv(_np_inv_sqrt(p))
      qh = np.linalg.inv(_np_inv_sqrt(q))
      self.assertFalse(np.allclose(p, np.eye(6), atol=1e-2))
      sv = np.linalg.svd(ph @ d @ qh, compute_uv=False)
      np.testing.assert_allclose(sv, np.ones(4), atol=1e-8)
      whitened = _np_inv_sqrt(p) @ g @ _np_inv_sqrt(q)
      self.assertAlmostEqual(
        float(np.sum(g * d)),
        float(np.linalg.svd(whitened, compute_uv=False).sum()),
        places=8,
      )

  def test_muon_norm_grafting_keeps_polar_frobenius_norm(self):
    """grafting="muon_norm" (default) rescales the step to ||Polar(M)||_F."""
    grads = _grads(12, (6, 4), 3)
    params = jnp.zeros((6, 4))
    # Little damping, so that the factors are far from the identity and the
    # plain step is visibly larger than the polar factor.
    kw = dict(gamma=0.5, precondition_interval=1, ns_coeffs=EXACT_NS[0])
    kw.update(ns_steps=EXACT_NS[1], damping=0.1)
    (plain, _), (graft, _) = _run_many(
      [
        fisher_optax.scale_by_fismo(grafting="none", **kw),
        fisher_optax.scale_by_fismo(**kw),  # muon_norm by default
      ],
      params,
      [grads, grads],
    )
    for a, b in zip(plain, graft):
      self.assertAlmostEqual(_cos(a, b), 1.0, places=5)
      # The exact polar factor of a 6x4 matrix has Frobenius norm 2.
      self.assertAlmostEqual(float(np.linalg.norm(b)), 2.0, places=3)
      self.assertGreater(float(np.linalg.norm(a)), 2.0)

  def test_identity_polar_gives_inverse_kronecker_step(self):
    """ns_coeffs=(1,0,0) makes Polar(X) = X/|X|_F: D ∝ P^-1 G Q^-1."""
    with jax.enable_x64(True):
      tx = fisher_optax.scale_by_fismo(
        beta=0.0,
        ns_coeffs=(1.0, 0.0, 0.0),
        ns_steps=1,
        gamma=0.3,
        precondition_interval=1,
        eigenvalue_floor=0.0,
        root_method="eigh",
      )
      grads = [jnp.asarray(g, jnp.float64) for g in _grads(3, (4, 5), 2)]
      ups, states = _run(tx, jnp.zeros((4, 5), jnp.float64), grads)
      p = np.asarray(states[-1].left_factor[0])
      q = np.asarray(states[-1].right_factor[0])
      g = np.asarray(grads[-1])
      want = np.linalg.inv(p) @ g @ np.linalg.inv(q)
      self.assertAlmostEqual(_cos(ups[-1], want), 1.0, places=10)

  def test_orthogonal_equivariance_over_a_trajectory(self):
    """W -> U W V^T maps every update to U D V^T (eigh path)."""
    with jax.enable_x64(True):
      rng = np.random.default_rng(4)
      u, _ = np.linalg.qr(rng.normal(size=(5, 5)))
      v, _ = np.linalg.qr(rng.normal(size=(3, 3)))
      tx = fisher_optax.scale_by_fismo(
        precondition_interval=2,
        gamma=0.7,
        eigenvalue_floor=0.0,
        root_method="eigh",
      )
      grads = [jnp.asarray(g, jnp.float64) for g in _grads(5, (5, 3), 4)]
      params = jnp.zeros((5, 3), jnp.float64)
      (ups, _), (ups_rot, _) = _run_many(  # One compile for both.
        [tx, tx], params, [grads, [u @ g @ v.T for g in grads]]
      )
      for a, b in zip(ups, ups_rot):
        np.testing.assert_allclose(u @ np.asarray(a) @ v.T, b, atol=1e-9)


class FactorTest(parameterized.TestCase):
  """Scale invariance (factor_norm), invariants and Kronecker recovery."""

  def _factors_after(self, grads, **kw):
    return _scan_runner(tuple(sorted(kw.items())))(grads)

  def test_pre_ema_recovers_kronecker_structure_at_any_scale(self):
    """The same preconditioner at gradient scales 1, 1e-2, 1e-4."""
    grads, p_star, q_star = _kron_grads(0, 6, 5, 250, 1.0)
    results = []
    for scale in (1.0, 1e-2, 1e-4):
      state, ups = self._factors_after(scale * grads, gamma=0.98, damping=1e-3)
      p, q = state.left_factor[0], state.right_factor[0]
      self.assertGreater(_cos(p, p_star), 0.98)
      self.assertGreater(_cos(q, q_star), 0.98)
      results.append((p, q, ups[-1]))
    for p, q, u in results[1:]:
      np.testing.assert_allclose(p, results[0][0], rtol=2e-3, atol=2e-3)
      np.testing.assert_allclose(q, results[0][1], rtol=2e-3, atol=2e-3)
      np.testing.assert_allclose(u, results[0][2], rtol=2e-2, atol=2e-3)

  def test_paper_mode_is_scale_dependent(self):
    """Read literally, small gradients leave P at the identity."""
    grads, p_star, _ = _kron_grads(0, 6, 5, 250, 1.0)
    big, _ = self._factors_after(
      grads, gamma=0.98, damping=1e-3, factor_norm="paper"
    )
    small, _ = self._factors_after(
      1e-2 * grads, gamma=0.98, damping=1e-3, factor_norm="paper"
    )
    kappa = lambda a: float(np.linalg.cond(np.asarray(a[0], np.float64)))
    self.assertGreater(_cos(big.left_factor[0], p_star), 0.95)
    self.assertGreater(kappa(big.left_factor), 3.0)
    self.assertLess(kappa(small.left_factor), 1.1)

  @parameterized.parameters("pre_ema", "paper")
  def test_factor_invariants(self, factor_norm):
    """tr P = m, tr Q = n, symmetric, lambda_min >= floor, finite."""
    damping = 0.1
    grads = jnp.stack(_grads(6, (2, 6, 4), 6))
    tx_kw = dict(damping=damping, gamma=0.5, factor_norm=factor_norm)
    state, _ = self._factors_after(
      grads, weight_dimension_numbers=DN(1, 2), **tx_kw
    )
    for f, d in ((state.left_factor, 6), (state.right_factor, 4)):
      f = np.asarray(f, np.float64)
      np.testing.assert_allclose(
        np.trace(f, axis1=1, axis2=2), [d, d], rtol=1e-5
      )
      np.testing.assert_allclose(f, np.swapaxes(f, 1, 2), atol=1e-6)
      if factor_norm == "pre_ema":
        self.assertGreaterEqual(
          np.linalg.eigvalsh(f).min(), damping / (1 + damping) * (1 - 1e-4)
        )
      self.assertTrue(np.all(np.isfinite(f)))

  def test_batch_axes_have_their_own_factors(self):
    grads = jnp.stack(_grads(7, (3, 4, 5), 3))
    state, ups = self._factors_after(
      grads, root_method="eigh", weight_dimension_numbers=DN(1, 2)
    )
    for i in range(3):
      s_i, u_i = self._factors_after(grads[:, i], root_method="eigh")
      np.testing.assert_allclose(
        state.left_factor[i], s_i.left_factor[0], atol=1e-4
      )
      np.testing.assert_allclose(ups[:, i], u_i, atol=1e-4)

  def test_zero_and_nonfinite_gradients_keep_the_state(self):
    params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros((3,))}
    tx = fisher_optax.scale_by_fismo(precondition_interval=1)
    grads = {
      "w": jax.random.normal(jax.random.key(0), (4, 3)),
      "b": jnp.ones((3,)),
    }
    zeros = jax.tree.map(jnp.zeros_like, grads)
    bad = {
      "w": grads["w"].at[0, 0].set(jnp.nan),
      "b": grads["b"].at[0].set(jnp.inf),
    }
    # One compile: a real step, then a zero (or a non-finite) gradient.
    (zero_ups, zero_states), (nan_ups, nan_states) = _run_many(
      [tx, tx], params, [[grads, zeros], [grads, bad]]
    )
    state, zero_u, zero_s = zero_states[0], zero_ups[1], zero_states[1]
    chex.assert_tree_all_finite((zero_u, zero_s))
    chex.assert_trees_all_close(zero_s.left_factor, state.left_factor)
    chex.assert_trees_all_close(zero_s.right_root, state.right_root, atol=1e-5)
    state, nan_u, nan_s = nan_states[0], nan_ups[1], nan_states[1]
    self.assertTrue(bool(jnp.all(jnp.isnan(nan_u["w"]))))
    chex.assert_tree_all_finite(nan_s)
    self.assertEqual(int(nan_s.notfinite_count), int(state.notfinite_count) + 1)
    chex.assert_trees_all_close(
      nan_s._replace(count=state.count, notfinite_count=state.notfinite_count),
      state,
    )


class RootsTest(parameterized.TestCase):
  """Cached roots, refresh schedule, root methods and whitening."""

  def test_roots_refresh_exactly_on_schedule(self):
    params = jnp.zeros((4, 3))
    tx = fisher_optax.scale_by_fismo(
      precondition_interval=3,
      eigenvalue_floor=0.0,
      gamma=0.5,
      root_method="eigh",
    )
    _, states = _run(tx, params, _grads(8, (4, 3), 7))
    for t, s in enumerate(states):
      fresh = _matrix_roots.matrix_inverse_root_eigh(
        s.left_factor, 2, floor=0.0
      )
      if t % 3 == 0:
        np.testing.assert_allclose(s.left_root, fresh, atol=1e-5)
      else:
        chex.assert_trees_all_equal(s.left_root, states[t - 1].left_root)
        chex.assert_trees_all_equal(s.right_root, states[t - 1].right_root)
        self.assertGreater(float(jnp.abs(s.left_root - fresh).max()), 1e-4)

  def test_refresh_is_a_cond_on_the_count(self):
    params = {"w": jnp.zeros((2, 4, 3))}
    tx = fisher_optax.scale_by_fismo(
      precondition_interval=5,
      root_method="eigh",
      weight_dimension_numbers=DN(1, 2),
    )
    jaxpr = jax.make_jaxpr(tx.update)(params, tx.init(params), params)
    top = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    self.assertIn("cond", top)
    self.assertNotIn("eigh", top)
    # The first refresh (count 0) equals refreshing every step.
    grads = [{"w": g} for g in _grads(9, (2, 4, 3), 1)]
    every = fisher_optax.scale_by_fismo(
      precondition_interval=1,
      root_method="eigh",
      weight_dimension_numbers=DN(1, 2),
    )
    (u_tx, _), (u_every, _) = _run_many([tx, every], params, [grads, grads])
    chex.assert_trees_all_close(u_tx, u_every)

  def test_vmapped_refresh_stays_a_cond(self):
    # Under vmap the count is batched and a cond on it becomes a select:
    # every lane computed its Newton roots (and eigh fallbacks) every step,
    # 2.5x the step time on 10 lanes. The refresh runs lane by lane instead.
    def loops_outside_cond(jaxpr, inside=False):
      found = 0
      for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        found += name == "while" and not inside
        for value in eqn.params.values():
          for sub in value if isinstance(value, (tuple, list)) else (value,):
            sub = getattr(sub, "jaxpr", sub)
            if hasattr(sub, "eqns"):
              found += loops_outside_cond(sub, inside or name == "cond")
      return found

    params = {"w": jnp.zeros((3, 4, 3))}  # three lanes
    tx = fisher_optax.scale_by_fismo(precondition_interval=5)
    step = jax.vmap(lambda g, s: tx.update(g, s, g))
    jaxpr = jax.make_jaxpr(step)(params, jax.vmap(tx.init)(params))
    self.assertEqual(loops_outside_cond(jaxpr.jaxpr), 0)

  def test_root_methods_agree_in_original_space(self):
    """The whitening/un-whitening round trip is root-independent."""
    params = jnp.zeros((5, 4))
    grads = _grads(10, (5, 4), 6)
    kw = dict(momentum_space="original", precondition_interval=2, gamma=0.6)
    methods = ("eigh", "newton", "cholesky")
    # The eigh reference and both methods: one compile.
    runs = _run_many(
      [fisher_optax.scale_by_fismo(root_method=m, **kw) for m in methods],
      params,
      [grads] * 3,
    )
    ref = runs[0][0]
    for method, (ups, states) in zip(methods[1:], runs[1:]):
      with self.subTest(method=method):
        chex.assert_trees_all_close(ups, ref, atol=2e-4, rtol=2e-3)
        s = states[4]  # a refresh step: its cached roots match its factors.
        for f, w in (
          (s.left_factor, s.left_root),
          (s.right_factor, s.right_root),
        ):
          eye = np.broadcast_to(np.eye(f.shape[-1]), f.shape)
          np.testing.assert_allclose(
            jnp.swapaxes(w, -1, -2) @ f @ w, eye, atol=1e-3
          )

  def test_newton_whitened_momentum_tracks_eigh(self):
    params = jnp.zeros((5, 4))
    grads = _grads(11, (5, 4), 5)
    (ref, _), (ups, _) = _run_many(  # One compile for both.
      [
        fisher_optax.scale_by_fismo(precondition_interval=1, root_method=m)
        for m in ("eigh", "newton")
      ],
      params,
      [grads, grads],
    )
    for a, b in zip(ups, ref):
      self.assertGreater(_cos(a, b), 0.999)

  def test_newton_recovers_after_the_factor_moves_far(self):
    # The gradients' scale jumps 1000x with a small damping: the warm start
    # from the cached root failed on every refresh, the stale root was kept
    # (and warm-started the next refresh, which failed again): 80 of 120
    # updates pointed elsewhere than eigh's (cosine < 0.9, down to -0.06).
    rng = np.random.default_rng(3)
    scale = np.where(np.arange(120) < 30, 1.0, 1e3)[:, None, None]
    grads = jnp.asarray(rng.normal(size=(120, 6, 4)) * scale, jnp.float32)
    kw = dict(
      factor_norm="paper",
      damping=1e-3,
      precondition_interval=10,
      momentum_space="original",
    )

    def run(root_method):
      tx = fisher_optax.scale_by_fismo(root_method=root_method, **kw)
      p = jnp.zeros((6, 4))

      def body(s, g):
        u, s = tx.update(g, s, p)
        return s, u

      return jax.lax.scan(body, tx.init(p), grads)[1]

    ref, got = jax.jit(lambda: (run("eigh"), run("newton")))()
    for a, b in zip(ref, got):
      self.assertGreater(_cos(a, b), 0.9)


def _decomposition_operands(jaxpr, names=("eigh", "cholesky")):
  """Operand shapes of every LAPACK decomposition in ``jaxpr``, nested too."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in names:
      out.append(tuple(eqn.invars[0].aval.shape))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          out.extend(_decomposition_operands(sub, names))
  return out


class DecompositionBatchTest(parameterized.TestCase):
  """The eigh and Cholesky roots decompose one factor per LAPACK call.

  Batched (stacked factors, or lanes under ``jax.vmap``), two such calls at
  once deadlocked XLA:CPU's thread pool: ``fismo_defaults`` with
  ``root_method="eigh"`` over 10 vmapped lanes hung at 0% CPU within 100
  steps, every run. A hang cannot be a test; the program's structure can.
  """

  @parameterized.parameters(("eigh", "whitened"), ("cholesky", "original"))
  def test_vmapped_stacked_factors_one_at_a_time(self, root_method, space):
    params = {"stack": jnp.ones((2, 8, 6)), "w": jnp.ones((8, 8))}
    dims = {
      "stack": fisher_optax.FISMODimensionNumbers(1, 2),
      "w": fisher_optax.FISMODimensionNumbers(),
    }
    tx = fisher_optax.fismo(
      1e-2,
      root_method=root_method,
      momentum_space=space,
      precondition_interval=1,
      fismo_weight_dimension_numbers=dims,
    )
    rng = np.random.default_rng(0)
    lanes = jax.tree.map(
      lambda x: jnp.asarray(rng.normal(size=(3, *x.shape)), jnp.float32),
      params,
    )

    def step(p):
      return tx.update(p, tx.init(p), p)[0]

    jaxpr = jax.make_jaxpr(jax.vmap(step))(lanes).jaxpr
    shapes = _decomposition_operands(jaxpr)
    self.assertNotEmpty(shapes)
    self.assertTrue(all(len(s) == 2 for s in shapes), shapes)
    batched = jax.jit(jax.vmap(step))(lanes)
    for i in range(3):
      lane = jax.jit(step)(jax.tree.map(lambda x, i=i: x[i], lanes))
      chex.assert_trees_all_close(
        jax.tree.map(lambda x, i=i: x[i], batched), lane, rtol=1e-5, atol=1e-6
      )


class RoutingTest(parameterized.TestCase):
  """Muon-style routing: reshapes, one-sided leaves, fallback, errors."""

  def test_one_sided_and_max_precond_dim(self):
    params = {
      "tall": jnp.zeros((9, 3)),
      "wide": jnp.zeros((2, 7)),
      "sq": jnp.zeros((6, 5)),
      "v": jnp.zeros((3,)),
    }
    tx = fisher_optax.scale_by_fismo(max_precond_dim=5)
    state = jax.eval_shape(tx.init, params)  # Routing needs shapes only.
    masked = optax.MaskedNode
    self.assertIsInstance(state.left_factor["tall"], masked)
    self.assertEqual(state.right_factor["tall"].shape, (1, 3, 3))
    self.assertEqual(state.left_factor["wide"].shape, (1, 2, 2))
    self.assertIsInstance(state.right_factor["wide"], masked)
    self.assertIsInstance(state.left_factor["sq"], masked)  # 6 > 5
    self.assertEqual(state.right_factor["sq"].shape, (1, 5, 5))
    self.assertIsInstance(state.momentum["v"], masked)
    grads = jax.tree.map(
      lambda x: jnp.cos(jnp.arange(x.size).reshape(x.shape)), params
    )
    ups, _ = _run(tx, params, [grads, grads])
    chex.assert_tree_all_finite(ups)

  def test_conv_reshape_and_fallback_configurable(self):
    params = {"conv": jnp.zeros((2, 2, 3, 4)), "b": jnp.zeros((4,))}
    dims = {"conv": DN(reduction_axis=(0, 1, 2), output_axis=3), "b": None}
    tx = fisher_optax.scale_by_fismo(
      weight_dimension_numbers=dims,
      fallback=optax.scale_by_sign(),
      max_aspect_ratio=3,
    )
    state = jax.eval_shape(tx.init, params)  # Routing needs shapes only.
    self.assertEqual(state.left_factor["conv"].shape, (1, 12, 12))
    self.assertEqual(state.right_factor["conv"].shape, (1, 4, 4))
    grads = {"conv": jnp.ones((2, 2, 3, 4)), "b": jnp.array([1.0, -2, 0, 3])}
    ups, _ = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(grads, params)
    np.testing.assert_array_equal(ups["b"], jnp.sign(grads["b"]))
    self.assertEqual(ups["conv"].shape, (2, 2, 3, 4))

  def test_fallback_gets_its_leaves_params(self):
    # A fallback that decays weights reads the params of its own leaves.
    params = {"w": jnp.ones((4, 3)), "b": jnp.full((3,), 2.0)}
    grads = {"w": jnp.arange(12.0).reshape(4, 3), "b": jnp.ones((3,))}
    tx = fisher_optax.scale_by_fismo(fallback=optax.add_decayed_weights(0.1))
    ups, _ = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(grads, params)
    np.testing.assert_allclose(ups["b"], grads["b"] + 0.1 * params["b"])
    adamw = optax.adamw(1e-3, weight_decay=0.1)
    tx = fisher_optax.scale_by_fismo(fallback=adamw)
    ups, _ = tx.update(grads, tx.init(params), params)
    want, _ = adamw.update(
      {"b": grads["b"]}, adamw.init({"b": params["b"]}), {"b": params["b"]}
    )
    np.testing.assert_allclose(ups["b"], want["b"], rtol=1e-6)

  def test_built_under_a_trace(self):
    # jax.eval_shape of a TrainState (the abstract target of a restore)
    # builds the transform under a trace; it must not keep a tracer.
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)}
    for make in (
      lambda: fisher_optax.fismo(1e-2),
      lambda: fisher_optax.scale_by_fismo(nesterov=True),
    ):
      made = []
      jax.eval_shape(lambda make=make: made.append(make()) or jnp.zeros(()))
      want, _ = make().update(params, make().init(params), params)
      got, _ = made[0].update(params, made[0].init(params), params)
      chex.assert_trees_all_close(got, want)

  def test_routing_errors(self):
    params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros((3,))}
    with self.assertRaisesRegex(ValueError, r"\['b'\].*rank >= 2"):
      fisher_optax.scale_by_fismo(
        weight_dimension_numbers={"w": DN(), "b": DN()}
      ).init(params)
    with self.assertRaisesRegex(ValueError, "disjoint"):
      fisher_optax.scale_by_fismo(
        weight_dimension_numbers={"w": DN(0, 0), "b": None}
      ).init(params)
    with self.assertRaisesRegex(ValueError, "out of range"):
      fisher_optax.scale_by_fismo(
        weight_dimension_numbers={"w": DN(0, 2), "b": None}
      ).init(params)
    with self.assertRaisesRegex(ValueError, "structure"):
      fisher_optax.scale_by_fismo(weight_dimension_numbers={"w": DN()}).init(
        params
      )
    tx = fisher_optax.scale_by_fismo()
    state = tx.init(params)
    with self.assertRaisesRegex(ValueError, "do not match the FISMO state"):
      tx.update({"w": params["w"]}, state)
    with self.assertRaisesRegex(ValueError, "re-run init"):
      tx.update({"w": jnp.zeros((5, 3)), "b": params["b"]}, state)

  def test_hyperparameter_validation(self):
    bad = [
      (ValueError, "beta", dict(beta=1.5)),
      (ValueError, "gamma", dict(gamma=-0.1)),
      (ValueError, "damping", dict(damping=-1.0)),
      (ValueError, "eigenvalue_floor", dict(eigenvalue_floor=-1.0)),
      (TypeError, "ns_steps", dict(ns_steps=2.5)),
      (TypeError, "ns_steps", dict(ns_steps=jnp.asarray(2.0))),
      (ValueError, "ns_steps", dict(ns_steps=0)),
      # Concrete arrays (what inject_hyperparams passes) are checked too.
      (ValueError, "ns_steps", dict(ns_steps=jnp.asarray(-1))),
      (ValueError, "interval", dict(precondition_interval=jnp.asarray(0))),
      (ValueError, "interval", dict(precondition_interval=np.array(-3))),
      (TypeError, "max_precond_dim", dict(max_precond_dim=1e3)),
      (ValueError, "precondition_interval", dict(precondition_interval=0)),
      (TypeError, "precondition_interval", dict(precondition_interval=2.0)),
      (ValueError, "root_method", dict(root_method="svd")),
      (ValueError, "factor_norm", dict(factor_norm="post_ema")),
      (ValueError, "momentum_space", dict(momentum_space="dual")),
      (ValueError, "grafting", dict(grafting="adam")),
      (ValueError, "cholesky", dict(root_method="cholesky")),
      (ValueError, "ns_coeffs", dict(ns_coeffs=(1.0, 2.0))),
    ]
    for err, pattern, kw in bad:
      with self.subTest(**{k: str(v) for k, v in kw.items()}):
        with self.assertRaisesRegex(err, pattern):
          fisher_optax.scale_by_fismo(**kw)
    with self.assertRaisesRegex(ValueError, "learning_rate"):
      fisher_optax.fismo(-1.0)
    for name, value in (
      ("adam_b1", 1.0),
      ("adam_b2", -0.5),
      ("adam_eps_root", -1.0),
      ("adam_weight_decay", -1e-2),
      ("damping", np.float32(-1.0)),
      ("beta", jnp.asarray(1.5)),
      ("adam_learning_rate", -1.0),
      ("consistent_rms", -0.2),
      ("consistent_rms", float("nan")),
    ):
      with self.subTest(alias_option=name):
        with self.assertRaisesRegex(ValueError, name):
          fisher_optax.fismo(1e-2, **{name: value})


class PerExampleTest(parameterized.TestCase):
  """fisher_source="per_example" (beyond the paper)."""

  def test_statistic_is_mean_of_per_example_outer_products(self):
    with jax.enable_x64(True):
      peg = jax.random.normal(jax.random.key(3), (7, 4, 3), jnp.float64)
      params = jnp.zeros((4, 3), jnp.float64)
      tx = fisher_optax.scale_by_fismo(
        gamma=0.0,
        damping=0.0,
        fisher_source="per_example",
        precondition_interval=1,
        eigenvalue_floor=0.0,
      )
      _, state = jax.jit(
        lambda g, p, peg: tx.update(  # init inside.
          g, tx.init(p), p, per_example_grads=peg
        )
      )(peg.mean(0), params, peg)
      s = np.einsum("kmn,kpn->mp", peg, peg)
      np.testing.assert_allclose(
        state.left_factor[0], 4 * s / np.trace(s), atol=1e-12
      )
      w = np.asarray(state.left_root[0])
      s_q = np.einsum("kmn,mp,pq,kqr->nr", peg, w, w, peg)
      np.testing.assert_allclose(
        state.right_factor[0], 3 * s_q / np.trace(s_q), atol=1e-12
      )

  @parameterized.parameters("pre_ema", "paper")
  def test_per_example_factors_are_means_over_examples(self, factor_norm):
    # Every example twice is the same batch: the factors are means, so the
    # damping (which "paper" adds to the statistic as it is) weighs the same.
    peg = jax.random.normal(jax.random.key(4), (3, 4, 3))
    params = jnp.zeros((4, 3))
    tx = fisher_optax.scale_by_fismo(
      gamma=0.0,
      damping=0.5,
      factor_norm=factor_norm,
      fisher_source="per_example",
      precondition_interval=1,
    )
    states = [
      tx.update(peg.mean(0), tx.init(params), params, per_example_grads=p)[1]
      for p in (peg, jnp.concatenate([peg, peg]))
    ]
    for field in ("left_factor", "right_factor"):
      np.testing.assert_allclose(
        getattr(states[0], field), getattr(states[1], field), rtol=1e-5
      )

  def test_per_example_errors_and_alias_masking(self):
    params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros((3,))}
    tx = fisher_optax.scale_by_fismo(fisher_source="per_example")
    state = jax.eval_shape(tx.init, params)  # The errors come before math.
    with self.assertRaisesRegex(ValueError, "per_example_grads"):
      tx.update(params, state)
    with self.assertRaisesRegex(ValueError, "per_example_grads"):
      tx.update(
        params,
        state,
        per_example_grads={"w": jnp.zeros((2, 4, 3)), "b": jnp.zeros((3, 3))},
      )
    # An empty batch gave a NaN statistic and a silently skipped step.
    with self.assertRaisesRegex(ValueError, "empty batch axis"):
      tx.update(
        params,
        state,
        per_example_grads=jax.tree.map(
          lambda x: jnp.zeros((0, *x.shape)), params
        ),
      )
    alias = fisher_optax.fismo(1e-2, fisher_source="per_example")
    peg = jax.tree.map(lambda x: jnp.ones((5,) + x.shape), params)
    ups, _ = jax.jit(
      lambda p, peg: alias.update(p, alias.init(p), p, per_example_grads=peg)
    )(params, peg)
    chex.assert_tree_all_finite(ups)


class IntegrationTest(parameterized.TestCase):
  """optax.masked, nnx.Optimizer, bf16 (inject: see the conformance table)."""

  def test_masked(self):
    params = {"w": jnp.ones((4, 3)), "v": jnp.ones((3, 3))}
    grads = jax.tree.map(
      lambda x: jnp.cos(x + jnp.arange(x.size).reshape(x.shape)), params
    )
    tx = optax.masked(fisher_optax.scale_by_fismo(), {"w": True, "v": False})
    alone = fisher_optax.scale_by_fismo()
    ups, direct = jax.jit(
      lambda g, p: (  # One compile for both.
        tx.update(g, tx.init(p), p)[0],
        alone.update({"w": g["w"]}, alone.init({"w": p["w"]}))[0],
      )
    )(grads, params)
    chex.assert_trees_all_equal(ups["v"], grads["v"])
    chex.assert_trees_all_close(ups["w"], direct["w"], atol=1e-4)
    # inject_hyperparams (a traced precondition_interval included) is
    # covered by the conformance table (tests/conformance_test.py).

  def test_nnx_optimizer(self):
    from flax import nnx  # pylint: disable=g-import-not-at-top

    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, fisher_optax.fismo(1e-2), wrt=nnx.Param)
    x = jnp.ones((8, 4))

    @nnx.jit
    def step(model, opt):
      loss, grads = nnx.value_and_grad(
        lambda m: jnp.mean(jnp.square(m(x) - 1.0))
      )(model)
      opt.update(model, grads)
      return loss

    losses = [float(step(model, opt)) for _ in range(5)]
    self.assertLess(losses[-1], losses[0])

  def test_bf16_params_float32_statistics(self):
    params = {"w": jnp.ones((4, 3), jnp.bfloat16)}
    tx = fisher_optax.fismo(1e-2)
    grads = {"w": jnp.cos(jnp.arange(12.0)).reshape(4, 3).astype(jnp.bfloat16)}
    ups, state = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(
      grads, params
    )
    self.assertEqual(ups["w"].dtype, jnp.bfloat16)
    inner = state.inner_states["fismo"].inner_state[0]
    self.assertEqual(inner.left_factor["w"].dtype, jnp.float32)
    self.assertEqual(inner.momentum["w"].dtype, jnp.bfloat16)


class DeprecatedNamesTest(absltest.TestCase):
  def test_old_casing_warns_and_is_the_new_class(self):
    from fisher_optax import _fismo  # pylint: disable=g-import-not-at-top

    for module in (fisher_optax, _fismo):
      for old, new in (
        ("FismoState", fisher_optax.FISMOState),
        ("FismoDimensionNumbers", fisher_optax.FISMODimensionNumbers),
      ):
        with self.subTest(module=module.__name__, name=old):
          with self.assertWarns(
            fisher_optax.fisher.validation.FisherOptaxDeprecationWarning
          ):
            self.assertIs(getattr(module, old), new)
    self.assertNotIn("FismoState", fisher_optax.__all__)
    self.assertIn("FISMOState", fisher_optax.__all__)
    with self.assertRaises(AttributeError):
      fisher_optax.__getattr__("FismoNothing")


class FISMONonfiniteShapeAndDtypeTest(parameterized.TestCase):
  """The one non-finite policy, shape checks and half-precision state."""

  def _problem(self, dtype=jnp.float32):
    params = {"w": jnp.ones((4, 3), dtype), "b": jnp.zeros((3,), dtype)}
    grads = {
      "w": jnp.cos(jnp.arange(12.0)).reshape(4, 3).astype(dtype),
      "b": jnp.sin(jnp.arange(3.0)).astype(dtype),
    }
    return params, grads

  # The guards exist because LAPACK's eigh (and SVD) on a matrix holding an
  # infinity need not terminate on XLA:CPU: a bad value at a root refresh
  # must never reach the decomposition. steps_before=(2, 1): the bad step
  # is a refresh step (count 2, interval 2) and a step between refreshes.
  @pytest.mark.timeout(120)
  @parameterized.parameters("newton", "eigh")
  def test_scale_by_fismo_policy(self, root_method):
    params, grads = self._problem()
    tx = fisher_optax.scale_by_fismo(
      precondition_interval=2, root_method=root_method
    )
    nonfinite_testing.check_policy(self, tx, params, grads, steps_before=(2, 1))

  @pytest.mark.timeout(120)
  def test_per_example_policy(self):
    params, grads = self._problem()
    tx = fisher_optax.scale_by_fismo(
      precondition_interval=2, fisher_source="per_example"
    )
    extra = lambda g: {
      "per_example_grads": jax.tree.map(lambda x: jnp.stack([x, -x]), g)
    }
    nonfinite_testing.check_policy(
      self, tx, params, grads, steps_before=(2, 1), extra=extra
    )

  @pytest.mark.timeout(120)
  def test_fismo_alias_policy_includes_the_adam_leaves(self):
    params, grads = self._problem()
    # With a schedule and weight decay on both partitions: a bad value in
    # any leaf undoes the whole step (no half step, no decay, no count).
    schedule = optax.linear_schedule(1e-2, 1e-3, 10)
    tx = fisher_optax.fismo(
      schedule,
      precondition_interval=2,
      weight_decay=0.1,
      adam_weight_decay=0.1,
    )
    nonfinite_testing.check_policy(self, tx, params, grads, steps_before=(2, 1))
    state = tx.init(params)
    _, state = tx.update(grads, state, params)
    for leaf in ("w", "b"):
      with self.subTest(bad_leaf=leaf):
        bad = dict(grads, **{leaf: grads[leaf].at[0].set(jnp.nan)})
        updates, new_state = tx.update(bad, state, params)
        counts, rest = nonfinite_testing.split_counts(state)
        new_counts, new_rest = nonfinite_testing.split_counts(new_state)
        chex.assert_trees_all_equal(new_rest, rest)
        self.assertEqual(sum(new_counts), sum(counts) + 1)
        other = "b" if leaf == "w" else "w"
        np.testing.assert_array_equal(updates[other], 0.0)

  def test_single_dimension_numbers_are_validated(self):
    params = {"w": jnp.zeros((2, 3, 4)), "b": jnp.zeros(3)}
    for dims, match in (
      (MuonDimensionNumbers(reduction_axis=5, output_axis=2), "out of range"),
      (MuonDimensionNumbers(reduction_axis=(0, 1), output_axis=1), "disjoint"),
    ):
      with self.subTest(dims=repr(dims)):
        with self.assertRaisesRegex(ValueError, match):
          fisher_optax.fismo(1e-2, fismo_weight_dimension_numbers=dims).init(
            params
          )
        with self.assertRaisesRegex(ValueError, match):
          fisher_optax.scale_by_fismo(weight_dimension_numbers=dims).init(
            params
          )

  def test_zero_gradient_leaf_with_eps_zero(self):
    # Newton-Schulz divided 0 by 0 (eps = 0, or an injected float16 1e-8):
    # the NaN skipped every step, the Adam leaves' too, forever.
    params = {"w1": jnp.ones((4, 3)), "w2": jnp.ones((3, 2)), "b": jnp.ones(2)}
    grads = {"w1": jnp.zeros((4, 3)), "w2": jnp.ones((3, 2)), "b": jnp.ones(2)}
    for tx, dtype in (
      (fisher_optax.fismo(1e-2, eps=0.0), jnp.float32),
      (
        optax.inject_hyperparams(fisher_optax.fismo)(learning_rate=1e-2),
        jnp.float16,
      ),
    ):
      p = jax.tree.map(lambda x, d=dtype: x.astype(d), params)
      g = jax.tree.map(lambda x, d=dtype: x.astype(d), grads)
      u, state = jax.jit(tx.update)(g, tx.init(p), p)
      chex.assert_tree_all_finite(u)
      np.testing.assert_array_equal(u["w1"], 0.0)
      self.assertGreater(float(jnp.abs(u["w2"]).max()), 0.0)
      counts = [
        int(c)
        for path, c in jax.tree_util.tree_flatten_with_path(state)[0]
        if "notfinite_count" in jax.tree_util.keystr(path)
      ]
      self.assertEqual(sum(counts), 0)

  def test_zero_size_leaf(self):
    params = {"w": jnp.ones((4, 3)), "e": jnp.zeros((0, 3))}
    for root_method in ("newton", "eigh"):
      tx = fisher_optax.fismo(1e-2, root_method=root_method)
      state = tx.init(params)
      grads = {"w": jnp.ones((4, 3)), "e": jnp.zeros((0, 3))}
      updates, state = jax.jit(tx.update)(grads, state, params)
      self.assertEqual(updates["e"].shape, (0, 3))
      chex.assert_tree_all_finite((updates, state))

  def test_nesterov_must_be_a_bool(self):
    # "no" is truthy: it turned Nesterov momentum on.
    for bad in ("no", None, 0):
      with self.assertRaisesRegex(TypeError, "nesterov must be True or False"):
        fisher_optax.fismo(1e-2, nesterov=bad)
      with self.assertRaisesRegex(TypeError, "nesterov must be True or False"):
        fisher_optax.scale_by_fismo(nesterov=bad)

  def test_ns_coeffs_are_checked(self):
    # A NaN coefficient skipped every step as non-finite (zero updates).
    with self.assertRaisesRegex(ValueError, "ns_coeffs must be finite"):
      fisher_optax.fismo(1e-2, ns_coeffs=(float("nan"), 1.0, 1.0))
    with self.assertRaisesRegex(ValueError, r"ns_coeffs must have shape"):
      fisher_optax.scale_by_fismo(ns_coeffs=(1.0, 2.0))

  def test_mismatched_gradients_are_refused(self):
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    for bad in (jnp.ones(()), jnp.ones((3, 4)), jnp.ones((4, 3, 1))):
      grads = {"w": bad, "b": jnp.ones(3)}
      for tx in (fisher_optax.fismo(1e-2), fisher_optax.scale_by_fismo()):
        state = tx.init(params)
        with self.subTest(shape=bad.shape):
          with self.assertRaisesRegex(
            ValueError, "updates do not match params"
          ):
            tx.update(grads, state, params)
      # Without params: checked against the state built by init.
      tx = fisher_optax.scale_by_fismo()
      with self.assertRaisesRegex(ValueError, "updates do not match params"):
        tx.update(grads, tx.init(params))
    # A fallback leaf (the bias) carries no FISMO state: without params it
    # is checked against the fallback's (it broadcast against it before).
    tx = fisher_optax.scale_by_fismo()
    for bad in (jnp.ones(()), jnp.ones(1), jnp.ones(4)):
      with self.subTest(bias=bad.shape):
        with self.assertRaisesRegex(ValueError, "updates do not match params"):
          tx.update({"w": jnp.ones((4, 3)), "b": bad}, tx.init(params))

  @parameterized.parameters(jnp.float16, jnp.bfloat16)
  def test_half_precision_statistics_do_not_overflow(self, dtype):
    # 1e3 squared is far above float16's largest value (65504).
    params, _ = self._problem(dtype)
    grads = {
      "w": jnp.full((4, 3), 1e3, dtype).at[0].set(-5e2),
      "b": jnp.full((3,), 1e3, dtype),
    }
    tx = fisher_optax.fismo(1e-2, precondition_interval=1)
    update = jax.jit(tx.update)
    state = tx.init(params)
    for _ in range(2):
      updates, state = update(grads, state, params)
    self.assertEqual(updates["w"].dtype, dtype)
    self.assertEqual(updates["b"].dtype, dtype)
    chex.assert_tree_all_finite((updates, state))
    self.assertEqual(nonfinite_testing.split_counts(state)[0], [0, 0])
    inner = state.inner_states["fismo"].inner_state[0]
    self.assertEqual(inner.left_factor["w"].dtype, jnp.float32)
    self.assertEqual(inner.momentum["w"].dtype, dtype)
    adam = state.inner_states["adam"].inner_state.inner_state
    # float16 moments would overflow; bf16 has float32's range.
    wide = jnp.float32 if dtype == jnp.float16 else dtype
    self.assertEqual(adam[0].nu["b"].dtype, wide)


if __name__ == "__main__":
  absltest.main()
