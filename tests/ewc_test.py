# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for the EWC penalties, anchors and transform (``_ewc.py``)."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fisher_optax
from fisher_optax import fisher
from tests import fisher_testing as ft


def _params(seed, dtype=jnp.float64):
  return ft.mlp_params(jax.random.key(seed), dtype=dtype)


def _positive_tree(seed, like):
  n = len(jax.tree.leaves(like))
  keys = iter(jax.random.split(jax.random.key(seed), n))
  return jax.tree.map(
    lambda x: jnp.abs(jax.random.normal(next(keys), x.shape, x.dtype)), like
  )


def _orthonormal(seed, like, k):
  """k orthonormal directions over the whole tree, as a stacked tree."""
  p = ft.ravel(like).size
  q, _ = jnp.linalg.qr(
    jax.random.normal(jax.random.key(seed), (p, k), ft.ravel(like).dtype)
  )
  return ft.unravel_like(like, q.T)


def _dense_low_rank(vals, vecs):
  u = jax.vmap(ft.ravel)(vecs)
  return u.T @ jnp.diag(vals) @ u


class EWCPenaltyTest(parameterized.TestCase):
  def _anchor(self, params, parts):
    diag = "diag" in parts
    rank = 3 if "low" in parts else 0
    anchor = fisher_optax.init_ewc_anchor(params, diagonal=diag, rank=rank)
    kwargs = {}
    if diag:
      kwargs["diagonal"] = _positive_tree(1, params)
    if rank:
      kwargs["low_rank"] = (
        jnp.array([3.0, 2.0, 0.5]),
        _orthonormal(2, params, 3),
      )
    return fisher_optax.consolidate(anchor, params, **kwargs), kwargs

  def test_zero_at_anchor(self):
    # Both parts are nonnegative, so a zero sum means each part is zero.
    with jax.enable_x64(True):
      theta = _params(0)
      anchor, _ = self._anchor(theta, ("diag", "low"))
      self.assertEqual(float(fisher_optax.ewc_penalty(theta, anchor, 7.0)), 0.0)
      grad = jax.grad(fisher_optax.ewc_penalty)(theta, anchor, 7.0)
      chex.assert_trees_all_close(
        grad, jax.tree.map(jnp.zeros_like, theta), atol=1e-12
      )

  @parameterized.parameters(("low",), ("diag", "low"))
  def test_penalty_is_dense_quadratic_form(self, *parts):
    with jax.enable_x64(True):
      theta_star, theta = _params(0), _params(5)
      anchor, kwargs = self._anchor(theta_star, parts)
      dense = 0.0
      if "diagonal" in kwargs:
        dense = dense + jnp.diag(ft.ravel(kwargs["diagonal"]))
      if "low_rank" in kwargs:
        dense = dense + _dense_low_rank(*kwargs["low_rank"])
      d = ft.ravel(theta) - ft.ravel(theta_star)
      lam = 3.0
      np.testing.assert_allclose(
        fisher_optax.ewc_penalty(theta, anchor, lam),
        0.5 * lam * d @ dense @ d,
        rtol=1e-12,
      )
      chex.assert_trees_all_close(
        jax.grad(fisher_optax.ewc_penalty)(theta, anchor, lam),
        ft.unravel_like(theta, lam * dense @ d),
        rtol=1e-10,
        atol=1e-12,
      )

  def test_transform_increment_is_grad_of_loss_form(self):
    with jax.enable_x64(True):
      theta_star, theta = _params(0), _params(5)
      anchor, _ = self._anchor(theta_star, ("diag", "low"))
      tx = fisher_optax.add_ewc_gradient(2.5, anchor)
      updates = jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), theta)
      out, state = jax.jit(tx.update)(updates, tx.init(theta), theta)
      expected = jax.tree.map(
        jnp.add, updates, jax.grad(fisher_optax.ewc_penalty)(theta, anchor, 2.5)
      )
      chex.assert_trees_all_close(out, expected, rtol=1e-12, atol=1e-12)
      self.assertEqual(int(state.count), 1)

  def test_strength_zero_is_identity(self):
    with jax.enable_x64(True):
      theta_star, theta = _params(0), _params(5)
      anchor, _ = self._anchor(theta_star, ("diag", "low"))
      tx = fisher_optax.add_ewc_gradient(0.0, anchor)
      g = _positive_tree(3, theta)
      out, _ = jax.jit(tx.update)(g, tx.init(theta), theta)
      chex.assert_trees_all_equal(out, g)


class ConsolidateTest(parameterized.TestCase):
  def _tasks(self, n=3):
    thetas = [_params(10 + t) for t in range(n)]
    fishers = [_positive_tree(20 + t, thetas[0]) for t in range(n)]
    return thetas, fishers

  def _separate_penalty(self, theta, thetas, fishers, decay):
    total = 0.0
    n = len(thetas)
    for k, (ts, f) in enumerate(zip(thetas, fishers)):
      d = ft.ravel(theta) - ft.ravel(ts)
      total += decay ** (n - 1 - k) * jnp.sum(ft.ravel(f) * d * d)
    return 0.5 * total

  @parameterized.parameters(1.0, 0.7)
  def test_merged_diagonal_equals_sum_of_separate(self, decay):
    with jax.enable_x64(True):
      thetas, fishers = self._tasks()
      anchor = fisher_optax.init_ewc_anchor(thetas[0])
      for ts, f in zip(thetas, fishers):
        anchor = jax.jit(fisher_optax.consolidate, static_argnames="mode")(
          anchor, ts, diagonal=f, decay=decay
        )
      theta = _params(99)
      sep = lambda th: self._separate_penalty(th, thetas, fishers, decay)
      np.testing.assert_allclose(
        fisher_optax.ewc_penalty(theta, anchor, 1.0), sep(theta), rtol=1e-12
      )
      chex.assert_trees_all_close(
        jax.grad(fisher_optax.ewc_penalty)(theta, anchor, 1.0),
        jax.grad(sep)(theta),
        rtol=1e-10,
        atol=1e-12,
      )
      # 2P + 1 numbers, whatever the number of tasks.
      size = sum(x.size for x in jax.tree.leaves(anchor))
      self.assertEqual(size, 2 * ft.ravel(thetas[0]).size + 1)

  def test_online_decay_equals_manual_recursion(self):
    with jax.enable_x64(True):
      thetas, fishers = self._tasks()
      gamma = 0.6
      anchor = fisher_optax.init_ewc_anchor(thetas[0])
      manual = jnp.zeros_like(ft.ravel(thetas[0]))
      for ts, f in zip(thetas, fishers):
        anchor = fisher_optax.consolidate(
          anchor, ts, diagonal=f, decay=gamma, mode="online"
        )
        manual = gamma * manual + ft.ravel(f)
      np.testing.assert_allclose(
        ft.ravel(anchor.diagonal.precision), manual, rtol=1e-12
      )
      theta = _params(99)
      d = ft.ravel(theta) - ft.ravel(thetas[-1])
      np.testing.assert_allclose(
        fisher_optax.ewc_penalty(theta, anchor, 2.0),
        jnp.sum(manual * d * d),
        rtol=1e-12,
      )

  @parameterized.parameters("separate", "online")
  def test_low_rank_slots_equal_separate_terms(self, mode):
    with jax.enable_x64(True):
      thetas, _ = self._tasks(2)
      stats = [
        (jnp.array([2.0, 1.0]), _orthonormal(30 + t, thetas[0], 2))
        for t in range(2)
      ]
      anchor = fisher_optax.init_ewc_anchor(thetas[0], diagonal=False, rank=4)
      for ts, st in zip(thetas, stats):
        anchor = fisher_optax.consolidate(
          anchor, ts, low_rank=st, decay=0.5, mode=mode
        )
      theta = _params(99)
      terms = []
      for k, (ts, st) in enumerate(zip(thetas, stats)):
        ref = thetas[-1] if mode == "online" else ts
        d = ft.ravel(theta) - ft.ravel(ref)
        terms.append(0.5 ** (1 - k) * d @ _dense_low_rank(*st) @ d)
      np.testing.assert_allclose(
        fisher_optax.ewc_penalty(theta, anchor, 2.0), sum(terms), rtol=1e-10
      )

  def test_compress_is_exact_within_budget_and_keeps_top_directions(self):
    with jax.enable_x64(True):
      thetas, _ = self._tasks(2)
      s1 = (jnp.array([5.0]), _orthonormal(40, thetas[0], 1))
      s2 = (jnp.array([3.0]), _orthonormal(41, thetas[0], 1))
      # Budget 2 >= total rank 2: the compressed gradient is exact.
      anchor = fisher_optax.init_ewc_anchor(thetas[0], diagonal=False, rank=2)
      anchor = fisher_optax.consolidate(
        anchor, thetas[0], low_rank=s1, low_rank_update="compress"
      )
      anchor = fisher_optax.consolidate(
        anchor, thetas[1], low_rank=s2, low_rank_update="compress"
      )
      theta = _params(99)

      def sep(th):
        out = 0.0
        for ts, st in zip(thetas, (s1, s2)):
          d = ft.ravel(th) - ft.ravel(ts)
          out += 0.5 * d @ _dense_low_rank(*st) @ d
        return out

      chex.assert_trees_all_close(
        jax.grad(fisher_optax.ewc_penalty)(theta, anchor, 1.0),
        jax.grad(sep)(theta),
        rtol=1e-8,
        atol=1e-10,
      )
      # Budget 1: the top eigenpair of the summed curvature survives.
      small = fisher_optax.init_ewc_anchor(thetas[0], diagonal=False, rank=1)
      small = fisher_optax.consolidate(
        small, thetas[0], low_rank=s1, low_rank_update="compress"
      )
      small = fisher_optax.consolidate(
        small, thetas[1], low_rank=s2, low_rank_update="compress"
      )
      dense = _dense_low_rank(*s1) + _dense_low_rank(*s2)
      vals, vecs = ft.top_eig(dense, 1)
      np.testing.assert_allclose(small.low_rank.scales, vals, rtol=1e-10)
      got = ft.ravel(jax.tree.map(lambda v: v[0], small.low_rank.vectors))
      np.testing.assert_allclose(abs(got @ vecs[0]), 1.0, rtol=1e-10)

  @parameterized.parameters(1.0, 0.6)
  def test_compress_keeps_penalty_value_within_budget(self, decay):
    # Three tasks whose directions span a plane (total rank 2 <= K = 2) with
    # different anchors: the merged penalty's value, constant included, and
    # its gradient equal the sum of the separate terms.
    with jax.enable_x64(True):
      thetas, _ = self._tasks(3)
      plane = jax.vmap(ft.ravel)(_orthonormal(60, thetas[0], 2))
      stats = []
      for angle, s in ((0.3, 5.0), (1.2, 2.0), (2.0, 1.0)):
        u = jnp.cos(angle) * plane[0] + jnp.sin(angle) * plane[1]
        stats.append((jnp.array([s]), ft.unravel_like(thetas[0], u[None])))
      anchor = fisher_optax.init_ewc_anchor(thetas[0], diagonal=False, rank=2)
      for ts, st in zip(thetas, stats):
        anchor = fisher_optax.consolidate(
          anchor, ts, low_rank=st, decay=decay, low_rank_update="compress"
        )

      def sep(th):
        out = 0.0
        for k, (ts, st) in enumerate(zip(thetas, stats)):
          d = ft.ravel(th) - ft.ravel(ts)
          out += 0.5 * decay ** (2 - k) * d @ _dense_low_rank(*st) @ d
        return out

      self.assertGreater(float(anchor.low_rank.residual), 0.0)
      for theta in (_params(99), thetas[0], thetas[2]):
        np.testing.assert_allclose(
          fisher_optax.ewc_penalty(theta, anchor, 1.0), sep(theta), rtol=1e-9
        )
      chex.assert_trees_all_close(
        jax.grad(fisher_optax.ewc_penalty)(_params(99), anchor, 1.0),
        jax.grad(sep)(_params(99)),
        rtol=1e-8,
        atol=1e-10,
      )

  @parameterized.parameters("axes", "rotated")
  def test_compress_keeps_small_scales_within_budget(self, basis):
    # float32, rank 2 <= K = 2, scales 1 and 1e-7: both terms are kept, as
    # "slots" keeps them (the engine's eigensolver cutoff would drop the
    # second).
    n = 6
    if basis == "axes":
      dirs = np.eye(n)[:2]
    else:
      dirs = np.linalg.qr(np.random.default_rng(0).normal(size=(n, 2)))[0].T
    rng = np.random.default_rng(1)
    thetas = [rng.normal(size=n), rng.normal(size=n)]
    anchors = {}
    for update in ("slots", "compress"):
      a = fisher_optax.init_ewc_anchor(
        {"w": jnp.zeros(n)}, diagonal=False, rank=2
      )
      for t, u, s in zip(thetas, dirs, (1.0, 1e-7)):
        a = fisher_optax.consolidate(
          a,
          {"w": jnp.asarray(t, jnp.float32)},
          low_rank=(jnp.array([s]), {"w": jnp.asarray(u[None], jnp.float32)}),
          low_rank_update=update,
        )
      anchors[update] = a
    low = anchors["compress"].low_rank
    np.testing.assert_allclose(low.scales, [1.0, 1e-7], rtol=1e-4)
    # Each slot holds one task's term: its direction (up to sign) and the
    # projection of that task's anchor on it.
    got = np.asarray(low.vectors["w"], np.float64)
    sign = np.sign(np.sum(got * dirs, axis=1))
    np.testing.assert_allclose(sign[:, None] * got, dirs, atol=1e-4)
    np.testing.assert_allclose(
      sign * low.anchor_proj,
      [d @ t for d, t in zip(dirs, thetas)],
      rtol=1e-4,
      atol=1e-5,
    )
    theta = {"w": jnp.asarray(rng.normal(size=n), jnp.float32)}
    np.testing.assert_allclose(
      fisher_optax.ewc_penalty(theta, anchors["compress"], 1.0),
      fisher_optax.ewc_penalty(theta, anchors["slots"], 1.0),
      rtol=1e-5,
    )
    if basis == "axes":
      # Along the weak direction the gradient is 1e-7 (u_2 . (theta - t_2)),
      # exactly resolved on its own coordinate.
      g = fisher_optax.ewc_gradient(theta, anchors["compress"])["w"]
      want = 1e-7 * (theta["w"][1] - thetas[1][1])
      np.testing.assert_allclose(g[1], want, rtol=1e-4)

  def test_compress_is_exact_within_budget_for_long_vectors(self):
    # float32, 20000 parameters, the same two directions again with new
    # anchors (rank 2 <= K = 2): the Gram's rounding must not hide the
    # constant of the merged terms.
    rng = np.random.default_rng(0)
    n = 20_000
    base = rng.normal(size=(2, n))
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    f32 = lambda x: np.asarray(x, np.float32)
    tasks = [
      (f32(rng.normal(size=n)), f32(base[:k]), f32(rng.uniform(0.5, 2, k)))
      for k in (2, 1, 2)
    ]
    theta = f32(rng.normal(size=n))
    anchor = fisher_optax.init_ewc_anchor(
      {"w": jnp.zeros(n)}, diagonal=False, rank=2
    )
    want = 0.0
    for t, u, s in tasks:
      anchor = fisher_optax.consolidate(
        anchor, {"w": t}, low_rank=(s, {"w": u}), low_rank_update="compress"
      )
      d = theta.astype(np.float64) - t
      want += 0.5 * np.sum(s * (u.astype(np.float64) @ d) ** 2)
      np.testing.assert_allclose(
        fisher_optax.ewc_penalty({"w": theta}, anchor, 1.0), want, rtol=1e-4
      )

  def test_compress_drops_truncated_terms_whole(self):
    # Three orthogonal rank-one terms in K = 2 slots: the weakest term goes,
    # constant and all; the other two are kept exactly.
    with jax.enable_x64(True):
      thetas, _ = self._tasks(3)
      dirs = _orthonormal(70, thetas[0], 3)
      stats = [
        (jnp.array([s]), jax.tree.map(lambda v, i=i: v[i : i + 1], dirs))
        for i, s in enumerate((5.0, 2.0, 1.0))
      ]
      anchor = fisher_optax.init_ewc_anchor(thetas[0], diagonal=False, rank=2)
      for ts, st in zip(thetas, stats):
        anchor = fisher_optax.consolidate(
          anchor, ts, low_rank=st, low_rank_update="compress"
        )
      theta = _params(99)
      kept = 0.0
      for ts, st in zip(thetas[:2], stats[:2]):
        d = ft.ravel(theta) - ft.ravel(ts)
        kept += 0.5 * d @ _dense_low_rank(*st) @ d
      np.testing.assert_allclose(
        fisher_optax.ewc_penalty(theta, anchor, 1.0), kept, rtol=1e-9
      )

  def test_compress_same_direction_keeps_constant(self):
    # (1/2)[(t - 1)^2 + (t - 2)^2] = (t - 1.5)^2 + 0.25: the value at the
    # merged anchor t = 1.5 is 0.25, not 0.
    p = {"w": jnp.zeros(2)}
    u = (jnp.array([1.0]), {"w": jnp.array([[1.0, 0.0]])})
    anchor = fisher_optax.init_ewc_anchor(p, diagonal=False, rank=1)
    for a in (1.0, 2.0):
      anchor = fisher_optax.consolidate(
        anchor,
        {"w": jnp.array([a, 0.0])},
        low_rank=u,
        low_rank_update="compress",
      )
    np.testing.assert_allclose(anchor.low_rank.residual, 0.5, rtol=1e-6)
    for t, want in ((1.5, 0.25), (0.0, 2.5), (3.5, 4.25)):
      np.testing.assert_allclose(
        fisher_optax.ewc_penalty({"w": jnp.array([t, 5.0])}, anchor, 1.0),
        want,
        rtol=1e-6,
      )
    # Online mode re-anchors every term at the latest parameters: no constant.
    online = fisher_optax.consolidate(
      anchor,
      {"w": jnp.array([2.0, 0.0])},
      low_rank=u,
      mode="online",
      low_rank_update="compress",
    )
    self.assertEqual(float(online.low_rank.residual), 0.0)

  def test_three_field_low_rank_anchor_still_works(self):
    # A LowRankEWC built without ``residual`` (as before it existed).
    old = fisher_optax.LowRankEWC(
      vectors={"w": jnp.array([[1.0, 0.0]])},
      scales=jnp.array([2.0]),
      anchor_proj=jnp.array([1.0]),
    )
    anchor = fisher_optax.EWCAnchor(diagonal=None, low_rank=old)
    np.testing.assert_allclose(
      fisher_optax.ewc_penalty({"w": jnp.array([3.0, 0.0])}, anchor, 1.0), 4.0
    )
    new = fisher_optax.consolidate(
      anchor,
      {"w": jnp.array([2.0, 0.0])},
      low_rank=(jnp.array([2.0]), old.vectors),
      low_rank_update="compress",
    )
    np.testing.assert_allclose(new.low_rank.residual, 1.0, rtol=1e-6)
    self.assertEqual(new.low_rank.residual.dtype, jnp.float32)

  def test_slots_evict_weakest(self):
    with jax.enable_x64(True):
      theta = _params(0)
      anchor = fisher_optax.init_ewc_anchor(theta, diagonal=False, rank=2)
      for t, s in enumerate((4.0, 1.0, 3.0)):
        anchor = fisher_optax.consolidate(
          anchor,
          theta,
          low_rank=(jnp.array([s]), _orthonormal(50 + t, theta, 1)),
        )
      np.testing.assert_allclose(jnp.sort(anchor.low_rank.scales), [3.0, 4.0])

  def test_zero_fisher_and_zero_directions_give_no_nan(self):
    theta = _params(0, jnp.float32)
    anchor = fisher_optax.init_ewc_anchor(theta, rank=2)
    zeros = jax.tree.map(jnp.zeros_like, theta)
    for update in ("slots", "compress"):
      a = fisher_optax.consolidate(
        anchor,
        theta,
        diagonal=zeros,
        low_rank=(jnp.zeros([1]), jax.tree.map(lambda x: x[None], zeros)),
        low_rank_update=update,
      )
      a = fisher_optax.consolidate(
        a,
        _params(1, jnp.float32),
        diagonal=zeros,
        low_rank=(jnp.zeros([1]), jax.tree.map(lambda x: x[None], zeros)),
        low_rank_update=update,
      )
      chex.assert_tree_all_finite(a)
      chex.assert_tree_all_finite(
        jax.grad(fisher_optax.ewc_penalty)(_params(2, jnp.float32), a, 1.0)
      )

  def test_non_finite_statistics_never_enter_the_state(self):
    theta = {"a": jnp.ones(3), "b": jnp.ones((2, 2))}
    bad = {"a": jnp.array([1.0, jnp.nan, jnp.inf]), "b": jnp.ones((2, 2))}
    vecs = jax.tree.map(lambda x, t: jnp.stack([x, t]) / 3.0, bad, theta)
    anchor = fisher_optax.consolidate(
      fisher_optax.init_ewc_anchor(theta, rank=2),
      theta,
      diagonal=bad,
      low_rank=(jnp.array([1.0, 2.0]), vecs),
    )
    chex.assert_tree_all_finite(anchor)
    np.testing.assert_allclose(anchor.diagonal.precision["a"], [1.0, 0.0, 0.0])
    # The NaN direction is dropped; the finite one is kept.
    np.testing.assert_allclose(jnp.sort(anchor.low_rank.scales), [0.0, 2.0])

  @parameterized.parameters("separate", "online")
  def test_a_dropped_direction_evicts_no_stored_term(self, mode):
    # Full slots: a NaN direction (dropped) must not take a task's slot.
    theta = {"w": jnp.zeros(3)}
    anchor = fisher_optax.consolidate(
      fisher_optax.init_ewc_anchor(theta, diagonal=False, rank=2),
      theta,
      low_rank=(jnp.array([2.0, 1.0]), {"w": jnp.eye(3)[:2]}),
      mode=mode,
    )
    moved = {"w": jnp.array([1.0, 1.0, 0.0])}
    before = float(fisher_optax.ewc_penalty(moved, anchor, 1.0))
    self.assertAlmostEqual(before, 1.5, places=6)
    after = fisher_optax.consolidate(
      anchor,
      theta,
      low_rank=(jnp.array([jnp.nan, 4.0]), {"w": jnp.eye(3)[1:]}),
      mode=mode,
    )
    chex.assert_tree_all_finite(after)
    # The weaker term (scale 1, e_1) gives way to the finite new one (4, e_2).
    np.testing.assert_allclose(jnp.sort(after.low_rank.scales), [2.0, 4.0])
    self.assertAlmostEqual(
      float(fisher_optax.ewc_penalty(moved, after, 1.0)), 1.0, places=6
    )

  def test_negative_diagonal_entries_add_no_precision(self):
    # A negative entry (e.g. a bad estimate) would make the penalty reward
    # moving away from the anchor: it is stored as 0.
    theta = {"w": jnp.array([1.0, 2.0])}
    anchor = fisher_optax.consolidate(
      fisher_optax.init_ewc_anchor(theta),
      theta,
      diagonal={"w": jnp.array([-4.0, 1.0])},
    )
    np.testing.assert_array_equal(anchor.diagonal.precision["w"], [0.0, 1.0])
    # Moving only along the negative coordinate costs nothing (not -4 / 2).
    moved = {"w": jnp.array([2.0, 2.0])}
    self.assertEqual(float(fisher_optax.ewc_penalty(moved, anchor, 1.0)), 0.0)

  @parameterized.parameters("slots", "compress")
  def test_negative_eigenvalues_add_no_curvature(self, update):
    # The same for a low-rank statistic: a negative eigenvalue is scale 0.
    theta = {"w": jnp.array([1.0, 2.0, 3.0])}
    vecs = {"w": jnp.eye(3)[:2]}
    anchor = fisher_optax.consolidate(
      fisher_optax.init_ewc_anchor(theta, diagonal=False, rank=2),
      theta,
      low_rank=(jnp.array([-3.0, 2.0]), vecs),
      low_rank_update=update,
    )
    np.testing.assert_allclose(jnp.sort(anchor.low_rank.scales), [0.0, 2.0])
    moved = {"w": jnp.array([2.0, 2.0, 3.0])}  # along the -3 direction only
    np.testing.assert_allclose(
      fisher_optax.ewc_penalty(moved, anchor, 1.0), 0.0, atol=1e-6
    )

  def test_engine_statistics_plug_in(self):
    theta = _params(0, jnp.float32)
    x, y = ft.make_batch(jax.random.key(3), 16, "categorical", jnp.float32)
    kw = dict(likelihood=fisher.Categorical(), kind="empirical")
    diag = jax.jit(lambda p: fisher.diagonal(ft.mlp_apply, p, (x, y), **kw))(
      theta
    )
    r1 = jax.jit(
      lambda p: fisher.rank_one(ft.mlp_apply, p, (x, y), scale="optimal", **kw)
    )(theta)
    anchor = fisher_optax.init_ewc_anchor(theta, rank=1)
    anchor = fisher_optax.consolidate(anchor, theta, diagonal=diag, low_rank=r1)
    theta2 = _params(1, jnp.float32)
    d = ft.ravel(theta2) - ft.ravel(theta)
    expected = 0.5 * (
      jnp.sum(ft.ravel(diag.diag) * d * d)
      + r1.eigvals[0]
      * (ft.ravel(jax.tree.map(lambda v: v[0], r1.eigvecs)) @ d) ** 2
    )
    np.testing.assert_allclose(
      fisher_optax.ewc_penalty(theta2, anchor, 1.0), expected, rtol=1e-5
    )


class RankOneScaleTest(absltest.TestCase):
  """c* is the least-squares scale; collinear gradients are exact."""

  def test_optimal_scale_is_least_squares(self):
    with jax.enable_x64(True):
      theta = _params(0)
      x, y = ft.make_batch(jax.random.key(1), 12, "categorical")
      stat = jax.jit(
        lambda p: fisher.rank_one(
          ft.mlp_apply,
          p,
          (x, y),
          likelihood=fisher.Categorical(),
          kind="empirical",
          scale="optimal",
        )
      )(theta)
      dense = ft.dense_fisher(
        ft.mlp_apply, theta, x, y, family="categorical", kind="empirical"
      )
      mu = ft.ravel(
        ft.mean_grad_dense(ft.mlp_apply, theta, x, y, "categorical")
      )
      m = jnp.outer(mu, mu)
      c_star = jnp.sum(dense * m) / jnp.sum(m * m)  # argmin_c |F - c m|_F
      np.testing.assert_allclose(stat.eigvals[0], c_star * mu @ mu, rtol=1e-6)
      # And it beats nearby scales.
      err = lambda c: jnp.linalg.norm(dense - c * m)
      self.assertLess(err(c_star), err(1.01 * c_star))
      self.assertLess(err(c_star), err(0.99 * c_star))

  def test_collinear_gradients_make_rank_one_exact(self):
    with jax.enable_x64(True):
      u = _orthonormal(0, {"w": jnp.zeros((3, 2), jnp.float64)}, 1)["w"][0]
      a = jnp.array([0.5, -1.0, 2.0, 3.0])
      g = a[:, None, None] * u[None]  # g_n = a_n u
      dense = jnp.einsum("nij,nkl->ijkl", g, g).reshape(6, 6) / 4
      mu = jnp.mean(g, 0).ravel()
      c_star = jnp.mean((g.reshape(4, -1) @ mu) ** 2) / (mu @ mu) ** 2
      np.testing.assert_allclose(c_star * jnp.outer(mu, mu), dense, atol=1e-12)
      top = fisher.low_rank_from_grads({"w": g}, rank=1)
      v = top.eigvecs["w"][0].ravel()
      np.testing.assert_allclose(
        top.eigvals[0] * jnp.outer(v, v), dense, atol=1e-12
      )


class EWCTransformTest(parameterized.TestCase):
  def test_converges_to_penalised_minimum(self):
    target = jnp.array([1.0, -2.0, 3.0])
    anchor_at = jnp.array([0.0, 0.0, 1.0])
    prec = jnp.array([1.0, 4.0, 0.5])
    lam = 2.0
    anchor = fisher_optax.consolidate(
      fisher_optax.init_ewc_anchor(anchor_at), anchor_at, diagonal=prec
    )
    tx = optax.chain(
      fisher_optax.add_ewc_gradient(lam, anchor), optax.sgd(0.05)
    )
    loss = lambda p: jnp.sum((p - target) ** 2)

    def step(carry, _):
      p, s = carry
      u, s = tx.update(jax.grad(loss)(p), s, p)
      return (optax.apply_updates(p, u), s), None

    (p, _), _ = jax.lax.scan(step, (anchor_at, tx.init(anchor_at)), length=500)
    expected = (2 * target + lam * prec * anchor_at) / (2 + lam * prec)
    np.testing.assert_allclose(p, expected, rtol=1e-5)

  def test_donated_state_keeps_the_users_anchor(self):
    params = {"w": jnp.ones((3, 2))}
    anchor = fisher_optax.consolidate(
      fisher_optax.init_ewc_anchor(params),
      params,
      diagonal={"w": jnp.ones((3, 2))},
    )
    tx = optax.chain(fisher_optax.add_ewc_gradient(1.0, anchor), optax.sgd(0.1))

    def step(p, s):
      u, s = tx.update(jax.tree.map(jnp.ones_like, p), s, p)
      return optax.apply_updates(p, u), s

    step = jax.jit(step, donate_argnums=(0, 1))
    for _ in range(2):  # a second init (a rerun) reads the anchor again
      step(jax.tree.map(jnp.copy, params), tx.init(params))
    self.assertFalse(any(x.is_deleted() for x in jax.tree.leaves(anchor)))

  def test_task_swap_does_not_retrace(self):
    theta = _params(0, jnp.float32)
    tx = optax.chain(
      fisher_optax.add_ewc_gradient(1.0, rank=2), optax.adam(1e-2)
    )
    state = tx.init(theta)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(p, s):
      u, s = tx.update(_positive_tree(0, p), s, p)
      return optax.apply_updates(p, u), s

    consolidate = jax.jit(fisher_optax.consolidate)
    for t in range(3):
      theta, state = step(theta, state)
      anchor = optax.tree.get(state, "ewc_anchor")
      anchor = consolidate(
        anchor,
        theta,
        diagonal=_positive_tree(t, theta),
        low_rank=(jnp.ones([1]), _orthonormal(t, theta, 1)),
      )
      state = optax.tree.set(state, ewc_anchor=anchor)
    theta, state = step(theta, state)
    chex.assert_tree_all_finite(theta)

  def test_keeps_bf16_dtype(self):
    theta = _params(0, jnp.bfloat16)
    anchor = fisher_optax.consolidate(
      fisher_optax.init_ewc_anchor(theta),
      theta,
      diagonal=_positive_tree(0, theta),
    )
    chex.assert_trees_all_equal_dtypes(
      anchor.diagonal.precision,
      jax.tree.map(lambda x: x.astype(jnp.float32), theta),
    )
    tx = fisher_optax.add_ewc_gradient(1.0, anchor)
    out, _ = jax.jit(tx.update)(theta, tx.init(theta), _params(1, jnp.bfloat16))
    chex.assert_trees_all_equal_dtypes(out, theta)

  def test_anchor_of_the_full_params_under_masked(self):
    params = {"base": jnp.ones(3), "lora": jnp.ones(2)}
    tx = optax.masked(
      fisher_optax.add_ewc_gradient(1.0, fisher_optax.init_ewc_anchor(params)),
      {"base": False, "lora": True},
    )
    with self.assertRaisesRegex(ValueError, "build the anchor's params on"):
      tx.update(params, tx.init(params), params)

  def test_masked_lora_style(self):
    """AlignGuard-style: the penalty acts only on the masked (LoRA) leaves."""
    theta = {"base": jnp.ones((3,)), "lora": jnp.ones((2, 2))}
    mask = {"base": False, "lora": True}
    # optax.masked shows the inner transform MaskedNode for masked-out leaves.
    masked = lambda t: jax.tree.map(
      lambda m, x: x if m else optax.MaskedNode(), mask, t
    )
    full_diag = {"base": jnp.ones(3), "lora": jnp.full((2, 2), 2.0)}
    full_vec = {
      "base": jnp.zeros((1, 3)),
      "lora": jnp.eye(2)[None] / jnp.sqrt(2.0),
    }
    anchor = fisher_optax.consolidate(
      fisher_optax.init_ewc_anchor(masked(theta), rank=1),
      masked(theta),
      diagonal=masked(full_diag),
      low_rank=(jnp.ones([1]), masked(full_vec)),
    )
    tx = optax.masked(fisher_optax.add_ewc_gradient(1.0, anchor), mask)
    state = tx.init(theta)
    moved = jax.tree.map(lambda x: x + 1.0, theta)
    zeros = jax.tree.map(jnp.zeros_like, theta)
    out, _ = tx.update(zeros, state, moved)
    np.testing.assert_allclose(out["base"], 0.0)
    np.testing.assert_allclose(out["lora"], 2.0 + jnp.eye(2), rtol=1e-6)


class EWCValidationTest(parameterized.TestCase):
  def test_bad_hyperparameters(self):
    with self.assertRaisesRegex(ValueError, "strength"):
      fisher_optax.add_ewc_gradient(-1.0)
    with self.assertRaisesRegex(TypeError, "rank"):
      fisher_optax.add_ewc_gradient(1.0, rank=2.0)
    with self.assertRaisesRegex(TypeError, "EWCAnchor"):
      fisher_optax.add_ewc_gradient(1.0, anchor={"a": 1})
    with self.assertRaisesRegex(ValueError, "diagonal=True or rank"):
      fisher_optax.init_ewc_anchor({"a": jnp.ones(2)}, diagonal=False)
    # A truthy string would read as True.
    for bad in ("no", None):
      with self.assertRaisesRegex(TypeError, "diagonal must be True or False"):
        fisher_optax.init_ewc_anchor({"a": jnp.ones(2)}, diagonal=bad, rank=1)
      with self.assertRaisesRegex(TypeError, "diagonal must be True or False"):
        fisher_optax.add_ewc_gradient(1.0, diagonal=bad, rank=1)

  def test_inject_hyperparams_with_default_rank(self):
    params = {"w": jnp.ones(3)}
    tx = optax.inject_hyperparams(fisher_optax.add_ewc_gradient)(strength=1.0)
    state = tx.init(params)
    self.assertIsNone(state.inner_state.ewc_anchor.low_rank)
    anchor = fisher_optax.consolidate(
      state.inner_state.ewc_anchor,
      params,
      diagonal={"w": jnp.array([1.0, 0.0, 2.0])},
    )
    state = optax.tree.set(state, ewc_anchor=anchor)
    state.hyperparams["strength"] = jnp.asarray(3.0)
    zeros = {"w": jnp.zeros(3)}
    out, _ = jax.jit(tx.update)(zeros, state, zeros)
    np.testing.assert_allclose(out["w"], [-3.0, 0.0, -6.0])
    # An explicit int rank sets shapes: static_args, or a clear error.
    with self.assertRaisesRegex(TypeError, "rank.*static_args"):
      optax.inject_hyperparams(fisher_optax.add_ewc_gradient)(1.0, rank=2).init(
        params
      )
    ok = optax.inject_hyperparams(
      fisher_optax.add_ewc_gradient, static_args="rank"
    )(1.0, rank=2).init(params)
    self.assertEqual(ok.inner_state.ewc_anchor.low_rank.scales.shape, (2,))

  def test_update_without_params(self):
    tx = fisher_optax.add_ewc_gradient(1.0)
    p = {"a": jnp.ones(2)}
    with self.assertRaisesRegex(ValueError, "needs params"):
      tx.update(p, tx.init(p))

  def test_bad_consolidate_inputs(self):
    p = {"a": jnp.ones(2), "b": jnp.ones((2, 3))}
    anchor = fisher_optax.init_ewc_anchor(p, rank=1)
    lr = (jnp.ones([1]), jax.tree.map(lambda x: x[None], p))
    with self.assertRaisesRegex(ValueError, "mode"):
      fisher_optax.consolidate(anchor, p, diagonal=p, low_rank=lr, mode="x")
    with self.assertRaisesRegex(ValueError, "decay"):
      fisher_optax.consolidate(anchor, p, diagonal=p, low_rank=lr, decay=1.5)
    with self.assertRaisesRegex(ValueError, "low_rank= must be given"):
      fisher_optax.consolidate(anchor, p, diagonal=p)
    with self.assertRaisesRegex(ValueError, "tree structure"):
      fisher_optax.consolidate(anchor, {"a": p["a"]}, diagonal=p, low_rank=lr)
    with self.assertRaisesRegex(ValueError, "leaf shape"):
      fisher_optax.consolidate(
        anchor, p, diagonal={"a": jnp.ones(3), "b": p["b"]}, low_rank=lr
      )
    two = (jnp.ones([2]), jax.tree.map(lambda x: jnp.stack([x, x]), p))
    with self.assertRaisesRegex(ValueError, "low-rank slots"):
      fisher_optax.consolidate(anchor, p, diagonal=p, low_rank=two)
    with self.assertRaisesRegex(ValueError, "eigvecs"):
      fisher_optax.consolidate(
        anchor, p, diagonal=p, low_rank=(jnp.ones([1]), p)
      )
    with self.assertRaisesRegex(ValueError, r"eigvals must be .*\(1, 1\)"):
      fisher_optax.consolidate(
        anchor, p, diagonal=p, low_rank=(jnp.ones([1, 1]), lr[1])
      )
    tx = fisher_optax.add_ewc_gradient(1.0)
    with self.assertRaisesRegex(ValueError, "tree structure"):
      tx.update(p, tx.init(p), {"a": p["a"]})

  def test_non_scalar_hyperparameters_raise(self):
    p = {"w": jnp.ones(3)}
    anchor = fisher_optax.consolidate(
      fisher_optax.init_ewc_anchor(p), p, diagonal=p
    )
    vec = jnp.array([0.5, 0.5, 0.5])
    consolidate = lambda d: fisher_optax.consolidate(
      anchor, p, diagonal=p, decay=d
    )
    penalty = lambda s: fisher_optax.ewc_penalty(p, anchor, s)
    # Eagerly and under jit: the shape is static.
    for fn in (consolidate, jax.jit(consolidate)):
      with self.assertRaisesRegex(ValueError, r"decay must be a scalar.*\(3,"):
        fn(vec)
    for fn in (penalty, jax.jit(penalty)):
      with self.assertRaisesRegex(ValueError, "strength must be a scalar"):
        fn(jnp.array([1.0, 2.0]))
    with self.assertRaisesRegex(ValueError, "strength must be a scalar"):
      fisher_optax.add_ewc_gradient(vec)

  def test_update_checks_updates_against_params(self):
    p = {"w": jnp.zeros(3)}
    tx = fisher_optax.add_ewc_gradient(1.0)
    state = tx.init(p)
    for bad in (jnp.zeros(()), jnp.zeros((1, 3))):
      with self.assertRaisesRegex(
        ValueError, r"updates do not match params.*updates\['w'\]"
      ):
        tx.update({"w": bad}, state, p)

  def test_low_rank_only_anchor_checks_params(self):
    p = {"v": jnp.zeros(2), "w": jnp.zeros(3)}
    anchor = fisher_optax.init_ewc_anchor(p, diagonal=False, rank=1)
    tx = fisher_optax.add_ewc_gradient(1.0, anchor)
    state = tx.init(p)
    calls = (
      fisher_optax.ewc_gradient,
      lambda q, a: fisher_optax.ewc_penalty(q, a, 1.0),
      lambda q, a: tx.update(q, state, q),
    )
    for call in calls:
      with self.assertRaisesRegex(ValueError, "tree structure"):
        call({"a": jnp.zeros(2), "b": jnp.zeros(3)}, anchor)
      with self.assertRaisesRegex(ValueError, r"leaf shape \(3, 1\)"):
        call({"v": jnp.zeros(2), "w": jnp.zeros((3, 1))}, anchor)
      with self.assertRaisesRegex(ValueError, "leaf shape"):
        call({"v": jnp.zeros(3), "w": jnp.zeros(2)}, anchor)

  def test_wrong_statistic_type_is_named(self):
    p = {"a": jnp.ones(2), "b": jnp.ones((2, 3))}
    one = jnp.ones((), jnp.int32)
    diag = fisher.DiagonalFisher(p, None, one)
    low = fisher.LowRankFisher(
      jnp.ones([1]), jax.tree.map(lambda x: x[None] / 3.0, p), None, one
    )
    anchor = fisher_optax.init_ewc_anchor(p, rank=1)
    with self.assertRaisesRegex(TypeError, "diagonal=.*got a LowRankFisher"):
      fisher_optax.consolidate(anchor, p, diagonal=low, low_rank=low)
    with self.assertRaisesRegex(TypeError, "low_rank.*got a DiagonalFisher"):
      fisher_optax.consolidate(anchor, p, diagonal=diag, low_rank=diag)
    # The right types, from the engine, are accepted as they are.
    fisher_optax.consolidate(anchor, p, diagonal=diag, low_rank=low)


if __name__ == "__main__":
  absltest.main()
