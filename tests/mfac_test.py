# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for M-FAC: ``fisher.sum_of_rank_one`` and ``scale_by_mfac``/``mfac``."""

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
from fisher_optax import fisher
from fisher_optax.fisher import linalg
from fisher_optax.fisher import validation
from tests import nonfinite_testing

M, SHAPES = 6, {"b": (5,), "w": (3, 2)}  # d = 11 (dict order: b, then w)
D = 11


def _grads(seed, m=M, dtype=jnp.float64):
  keys = jax.random.split(jax.random.key(seed), len(SHAPES))
  return {
    name: jax.random.normal(k, (m, *shape), dtype)
    for k, (name, shape) in zip(keys, SHAPES.items())
  }


def _flat(tree):
  return np.concatenate(
    [np.asarray(x).reshape(-1) for x in jax.tree.leaves(tree)]
  )


def _flat_rows(stacked):
  m = jax.tree.leaves(stacked)[0].shape[0]
  return np.concatenate(
    [np.asarray(x).reshape(m, -1) for x in jax.tree.leaves(stacked)], axis=1
  )


def _unflat(x):
  return {"b": jnp.asarray(x[:5]), "w": jnp.asarray(x[5:]).reshape(3, 2)}


def _dense_fisher(stacked, damping, m=None, block_size=None):
  g = _flat_rows(stacked)
  m = g.shape[0] if m is None else m
  f = damping * np.eye(g.shape[1]) + g.T @ g / m
  if block_size is not None:
    mask = np.zeros_like(f)
    for start in range(0, f.shape[0], block_size):
      mask[start : start + block_size, start : start + block_size] = 1.0
    f = f * mask
  return f


class SumOfRankOneTest(parameterized.TestCase):
  # Unblocked, blocked with m > B (compressed rows) and with m <= B.
  @parameterized.parameters(
    (1e-3, None), (1.0, None), (1e-3, 4), (1e-3, 6), (1.0, 8)
  )
  def test_matches_explicit_inverse(self, damping, block_size):
    with jax.enable_x64(True):
      grads = _grads(0)
      f = fisher.sum_of_rank_one(grads, damping, block_size=block_size)
      dense = _dense_fisher(grads, damping, block_size=block_size)
      inv = np.linalg.inv(dense)
      v = _unflat(np.linspace(-1.0, 2.0, D))
      np.testing.assert_allclose(
        _flat(f.ihvp(v)),
        inv @ _flat(v),
        rtol=1e-9,
        atol=1e-9 * np.abs(inv).max(),
      )
      np.testing.assert_allclose(
        _flat(f.inverse_diag()), np.diag(inv), rtol=1e-9
      )
      idx = jnp.arange(D)
      np.testing.assert_allclose(
        f.inverse_entry(idx[:, None], idx[None, :]),
        inv,
        atol=1e-9 * np.abs(inv).max(),
      )
      q = jnp.array([7, 1, 4, 10])
      np.testing.assert_allclose(
        f.inverse_submatrix(q), inv[np.ix_(q, q)], atol=1e-9 * np.abs(inv).max()
      )
      # F (F^{-1} v) = v, with F applied matrix-free and densely.
      np.testing.assert_allclose(
        _flat(f.matvec(f.ihvp(v))), _flat(v), rtol=1e-8, atol=1e-10
      )
      np.testing.assert_allclose(
        dense @ _flat(f.ihvp(v)), _flat(v), rtol=1e-8, atol=1e-10
      )
      np.testing.assert_allclose(
        f.quadratic_form(v), _flat(v) @ dense @ _flat(v), rtol=1e-10
      )

  def test_blocked_equals_per_block_dense(self):
    with jax.enable_x64(True):
      grads = _grads(1)
      f = fisher.sum_of_rank_one(grads, 1e-2, block_size=3)
      g = _flat_rows(grads)
      diag = _flat(f.inverse_diag())
      for start in range(0, D, 3):
        sl = slice(start, min(start + 3, D))
        block = 1e-2 * np.eye(sl.stop - sl.start) + g[:, sl].T @ g[:, sl] / M
        np.testing.assert_allclose(
          diag[sl], np.diag(np.linalg.inv(block)), rtol=1e-9
        )

  def test_matches_paper_recursion(self):
    """The batched Cholesky form equals M-FAC's m-step recursion."""
    with jax.enable_x64(True):
      grads = _grads(2)
      damping = 1e-2
      g = _flat_rows(grads)
      vs, dens = [], []
      for k in range(M):  # v_k = F_{k-1}^{-1} g_k with F_0 = damping * I
        v = g[k] / damping
        for vj, dj in zip(vs, dens):
          v = v - vj * (vj @ g[k]) / dj
        vs.append(v)
        dens.append(M + g[k] @ v)
      recursion = np.eye(D) / damping - sum(
        np.outer(v, v) / d for v, d in zip(vs, dens)
      )
      f = fisher.sum_of_rank_one(grads, damping)
      idx = jnp.arange(D)
      np.testing.assert_allclose(
        f.inverse_entry(idx[:, None], idx[None, :]),
        recursion,
        atol=1e-9 * np.abs(recursion).max(),
      )
      # Rows of Z / sqrt(damping) are v_k / sqrt(den_k).
      np.testing.assert_allclose(
        np.abs(_flat_rows(f.whitened)) / np.sqrt(damping),
        np.abs(np.stack([v / np.sqrt(d) for v, d in zip(vs, dens)])),
        rtol=1e-8,
        atol=1e-12,
      )

  def test_float32_is_close_to_float64(self):
    grads = _grads(3, dtype=jnp.float32)
    f = fisher.sum_of_rank_one(grads, 1e-1)
    inv = np.linalg.inv(_dense_fisher(jax.tree.map(np.float64, grads), 1e-1))
    self.assertEqual(f.chol.dtype, jnp.float32)
    np.testing.assert_allclose(_flat(f.inverse_diag()), np.diag(inv), rtol=1e-4)

  @parameterized.parameters(1.0, 10.0)
  def test_float32_blocks_spanned_by_their_gradients(self, grad_scale):
    # m >= block_size: (I - Z^T Z) / damping cancelled in float32, so the
    # inverse diagonal was 2-116% off (median) and 22 of 64 entries were
    # <= 0 at grad_scale 10, which OBS then pruned first.
    rng = np.random.default_rng(0)
    m, b, d, damping = 256, 32, 64, 1e-5
    g = rng.normal(size=(m, d)) * grad_scale
    f = fisher.sum_of_rank_one(
      {"w": jnp.asarray(g, jnp.float32)}, damping, block_size=b
    )
    blocks = [
      np.linalg.inv(
        damping * np.eye(b) + g[:, s : s + b].T @ g[:, s : s + b] / m
      )
      for s in range(0, d, b)
    ]
    inv = np.zeros((d, d))
    for i, block in enumerate(blocks):
      inv[i * b : (i + 1) * b, i * b : (i + 1) * b] = block
    np.testing.assert_allclose(f.inverse_diag()["w"], np.diag(inv), rtol=1e-5)
    v = rng.normal(size=d)
    got = np.asarray(f.ihvp({"w": jnp.asarray(v, jnp.float32)})["w"])
    want = inv @ v
    self.assertLess(np.linalg.norm(got - want) / np.linalg.norm(want), 1e-5)
    q = jnp.array([3, 40, 7])
    np.testing.assert_allclose(
      f.inverse_submatrix(q),
      inv[np.ix_(q, q)],
      rtol=1e-5,
      atol=1e-5 * np.abs(inv).max(),
    )

  def test_as_many_gradients_as_weights_is_one_direct_block(self):
    # Unblocked with m >= d the span is everything and (I - Z^T Z) cancels:
    # 16 gradients of 16 weights at damping 1e-6 gave a negative inverse
    # diagonal (-15), 64 of 8 a NaN factor.
    rng = np.random.default_rng(0)
    for m, d in ((16, 16), (64, 8)):
      g = rng.normal(size=(m, d)) * 10.0
      f = fisher.sum_of_rank_one({"w": jnp.asarray(g, jnp.float32)}, 1e-6)
      self.assertEqual(f.block_size, d)
      want = np.diag(np.linalg.inv(1e-6 * np.eye(d) + g.T @ g / m))
      np.testing.assert_allclose(f.inverse_diag()["w"], want, rtol=1e-4)

  @parameterized.parameters(None, 4)
  def test_bfloat16_and_integer_vectors(self, block_size):
    # Products run in the factor's dtype: a bfloat16 v lost (I - Z^T Z) v to
    # cancellation (69% off), an integer v was divided by an integer damping.
    grads = _grads(4, dtype=jnp.float32)
    f = fisher.sum_of_rank_one(grads, 1e-2, block_size=block_size)
    inv = np.linalg.inv(
      _dense_fisher(
        jax.tree.map(np.float64, grads), 1e-2, block_size=block_size
      )
    )
    dense = _dense_fisher(
      jax.tree.map(np.float64, grads), 1e-2, block_size=block_size
    )
    row = jax.tree.map(lambda g: g[0], grads)
    v16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), row)
    v16_64 = _flat(jax.tree.map(lambda x: np.asarray(x, np.float64), v16))
    out = f.ihvp(v16)
    self.assertEqual(jax.tree.leaves(out)[0].dtype, jnp.bfloat16)
    want = inv @ v16_64
    err = np.linalg.norm(_flat(jax.tree.map(np.float64, out)) - want)
    self.assertLess(err / np.linalg.norm(want), 1e-2)
    ones = jax.tree.map(lambda x: jnp.ones(x.shape[1:], jnp.int32), grads)
    for name, got, want in (
      ("ihvp", f.ihvp(ones), inv @ np.ones(D)),
      ("matvec", f.matvec(ones), dense @ np.ones(D)),
    ):
      self.assertEqual(jax.tree.leaves(got)[0].dtype, jnp.float32, msg=name)
      np.testing.assert_allclose(_flat(got), want, rtol=1e-4, err_msg=name)

  def test_bad_inputs_raise(self):
    grads = _grads(0, dtype=jnp.float32)
    with self.assertRaisesRegex(ValueError, "damping"):
      fisher.sum_of_rank_one(grads, 0.0)
    # An infinite damping only gives a non-finite factor; a vector one would
    # broadcast past the range check.
    with self.assertRaisesRegex(ValueError, "damping must be finite"):
      fisher.sum_of_rank_one(grads, float("inf"))
    with self.assertRaisesRegex(ValueError, "damping must be a scalar"):
      fisher.sum_of_rank_one(grads, jnp.array([1e-2, 1e-3]))
    with self.assertRaisesRegex(ValueError, "damping must be finite"):
      fisher_optax.mfac(1e-3, window_size=4, damping=float("inf"))
    with self.assertRaisesRegex(TypeError, "block_size"):
      fisher.sum_of_rank_one(grads, 1.0, block_size=2.5)
    with self.assertRaisesRegex(ValueError, "leading"):
      fisher.sum_of_rank_one({"a": jnp.ones((3, 2)), "b": jnp.ones((4,))}, 1.0)
    with self.assertRaisesRegex(ValueError, "at least one leaf"):
      fisher.sum_of_rank_one({}, 1.0)
    f = fisher.sum_of_rank_one(grads, 1.0)
    with self.assertRaisesRegex(ValueError, "tree structure"):
      f.ihvp({"w": jnp.ones((3, 2))})
    with self.assertRaisesRegex(ValueError, "shape"):
      f.ihvp({"b": jnp.ones((5,)), "w": jnp.ones((2, 3))})


class ScaleByMFACTest(parameterized.TestCase):
  def _run(self, seq, m, damping=1e-2, **kw):
    tx = fisher_optax.scale_by_mfac(m, damping, **kw)
    update = jax.jit(tx.update)
    state = tx.init(jax.tree.map(lambda x: x[0], seq))
    for t in range(jax.tree.leaves(seq)[0].shape[0]):
      u, state = update(jax.tree.map(lambda x, t=t: x[t], seq), state)
    return u, state

  @parameterized.parameters(0, 3, 8)
  def test_window_equals_static_factor_of_last_m(self, extra):
    with jax.enable_x64(True):
      seq = _grads(4, m=M + extra)
      u, state = self._run(seq, M)
      last = jax.tree.map(lambda x: x[extra:], seq)
      static = fisher.sum_of_rank_one(last, 1e-2)
      g = jax.tree.map(lambda x: x[-1], seq)
      chex.assert_trees_all_close(u, static.ihvp(g), rtol=1e-9, atol=1e-9)
      np.testing.assert_allclose(
        state.gram,
        _flat_rows(state.grads) @ _flat_rows(state.grads).T,
        rtol=1e-12,
      )
      self.assertEqual(int(state.index), (M + extra) % M)
      self.assertEqual(int(state.count), M + extra)

  def test_partial_window_keeps_one_over_m(self):
    with jax.enable_x64(True):
      seq = _grads(5, m=2)
      u, _ = self._run(seq, M)
      dense = _dense_fisher(seq, 1e-2, m=M)  # two rows, divided by M
      g = _flat(jax.tree.map(lambda x: x[-1], seq))
      np.testing.assert_allclose(_flat(u), np.linalg.solve(dense, g), rtol=1e-9)

  def test_per_example_pushes_every_row(self):
    with jax.enable_x64(True):
      tx = fisher_optax.scale_by_mfac(M, 1e-2, fisher_source="per_example")
      first, second = _grads(6, m=4), _grads(7, m=4)
      mean = lambda t: jax.tree.map(lambda x: x.mean(0), t)
      state = tx.init(mean(first))
      _, state = tx.update(mean(first), state, per_example_grads=first)
      u, state = tx.update(mean(second), state, per_example_grads=second)
      window = jax.tree.map(
        lambda a, b: jnp.concatenate([a[2:], b]), first, second
      )  # last M = 6 rows
      static = fisher.sum_of_rank_one(window, 1e-2)
      chex.assert_trees_all_close(u, static.ihvp(mean(second)), rtol=1e-9)
      self.assertEqual(int(state.index), 8 % M)

  def test_nonfinite_gradient_leaves_window_unchanged(self):
    tx = fisher_optax.scale_by_mfac(4, 1e-2)
    params = {"b": jnp.ones(5), "w": jnp.ones((3, 2))}
    state = tx.init(params)
    _, state = tx.update(jax.tree.map(jnp.ones_like, params), state)
    bad = {"b": jnp.full((5,), jnp.nan), "w": jnp.ones((3, 2))}
    _, new_state = jax.jit(tx.update)(bad, state)
    chex.assert_trees_all_equal(new_state.grads, state.grads)
    chex.assert_trees_all_equal(new_state.gram, state.gram)
    self.assertEqual(int(new_state.index), int(state.index))

  def test_evicting_a_gradient_spike_keeps_float32_accuracy(self):
    # The step that overwrites a row 1e4 times the others: the rows' sum
    # must not add that row and subtract it again (225% error before).
    rng = np.random.default_rng(1)
    m, lam, d = 4, 1e-3, 28
    seq = [rng.normal(size=d) * s for s in (1, 1e4, 1, 1, 1, 1)]
    tx = fisher_optax.scale_by_mfac(m, lam)
    update, state = jax.jit(tx.update), tx.init(jnp.zeros(d))
    window = np.zeros((m, d))
    for t, g in enumerate(seq):
      window[t % m] = g
      u, state = update(jnp.asarray(g, jnp.float32), state)
    self.assertEqual(t % m, 1)  # the last step evicted the spike
    # The same rule in float64, the documented damping floor included.
    floor = np.finfo(np.float32).eps * np.trace(window @ window.T)
    dense = max(lam, floor) * np.eye(d) + window.T @ window / m
    want = np.linalg.solve(dense, seq[-1])
    np.testing.assert_allclose(np.asarray(u, np.float64), want, rtol=1e-2)

  def test_tiny_damping_float32_stays_finite(self):
    tx = fisher_optax.scale_by_mfac(8, 1e-12)
    state = tx.init(jnp.zeros(3))
    for _ in range(10):  # identical, rank-one gradients of size 1e3
      u, state = tx.update(jnp.array([1e3, -2e3, 5e2]), state)
    chex.assert_tree_all_finite((u, state))

  @parameterized.product(
    make=("woodbury", "woodbury_tree", "mfac"), per_example=(False, True)
  )
  def test_large_repeated_gradients_are_solved_not_skipped(
    self, make, per_example
  ):
    # |g|^2 / damping = 1e9: the exact damping is below float32's
    # resolution of the Gram, whose Cholesky then failed and every step
    # after the first was skipped. The floored damping solves it.
    g = {"w": 100.0 * jax.random.normal(jax.random.key(0), (16, 8))}
    source = "per_example" if per_example else "batch"
    tx = {
      "woodbury": lambda: fisher_optax.scale_by_woodbury_fisher(
        8, 1e-3, fisher_source=source
      ),
      "woodbury_tree": lambda: fisher_optax.scale_by_woodbury_fisher(
        8, 1e-3, block_diagonal=False, fisher_source=source
      ),
      "mfac": lambda: fisher_optax.scale_by_mfac(8, 1e-3, fisher_source=source),
    }[make]()
    state = tx.init(g)
    sq = float(jnp.sum(jnp.square(g["w"])))
    eps = float(jnp.finfo(jnp.float32).eps)
    for k in range(1, 6):
      if per_example:  # k equal per-example rows, their mean the gradient
        rows = {"w": jnp.broadcast_to(g["w"], (k, 16, 8))}
        u, state = tx.update(g, state, per_example_grads=rows)
        scale, count = 1.0 / k, k
        if make == "mfac":  # pushed into its window of 8, a mean over 8
          scale, count = 1.0 / 8, min(k * (k + 1) // 2, 8)
      else:
        u, state = tx.update(g, state)
        count = k
        scale = 1.0 / 8 if make == "mfac" else 1.0
      self.assertEqual(int(state.notfinite_count), 0)
      # F = lam I + scale * count g g^T, the damping floored at scale m eps
      # trace(G G^T) for m rows: about 1/m relative accuracy on equal rows.
      m = 8 if make == "mfac" or not per_example else k
      lam = max(1e-3, scale * m * eps * count * sq)
      want = g["w"] / (lam + scale * count * sq)
      err = float(jnp.linalg.norm(u["w"] - want) / jnp.linalg.norm(want))
      self.assertLess(err, 1.0 / m)

  def test_bad_inputs_raise(self):
    with self.assertRaisesRegex(TypeError, "window_size"):
      fisher_optax.scale_by_mfac(4.0)
    with self.assertRaisesRegex(ValueError, "window_size"):
      fisher_optax.scale_by_mfac(0)
    with self.assertRaisesRegex(ValueError, "damping"):
      fisher_optax.scale_by_mfac(4, -1.0)
    with self.assertRaisesRegex(ValueError, "fisher_source"):
      fisher_optax.scale_by_mfac(4, fisher_source="sample")
    with self.assertRaisesRegex(ValueError, "momentum"):
      fisher_optax.mfac(1e-3, momentum=1.5)
    params = {"b": jnp.ones(5), "w": jnp.ones((3, 2))}
    tx = fisher_optax.scale_by_mfac(4)
    with self.assertRaisesRegex(ValueError, "tree structure"):
      tx.update({"b": jnp.ones(5)}, tx.init(params))
    tx = fisher_optax.scale_by_mfac(4, fisher_source="per_example")
    state = tx.init(params)
    with self.assertRaisesRegex(ValueError, "per_example_grads"):
      tx.update(params, state)
    with self.assertRaisesRegex(ValueError, "more than window_size"):
      tx.update(
        params,
        state,
        per_example_grads=jax.tree.map(lambda x: jnp.stack([x] * 5), params),
      )
    with self.assertRaisesRegex(ValueError, "per_example_grads"):
      tx.update(params, state, per_example_grads=params)

  @parameterized.parameters(("mean", "batch"), ("per_example", "per_example"))
  def test_old_gradients_keyword_warns_and_matches(self, old, new):
    seq = _grads(8, m=3, dtype=jnp.float32)
    mean = jax.tree.map(lambda x: x.mean(0), seq)
    extras = {"per_example_grads": seq} if new == "per_example" else {}

    def run(tx):
      state = tx.init(mean)
      for _ in range(2):
        u, state = tx.update(mean, state, mean, **extras)
      return u, state

    for factory in (
      lambda **kw: fisher_optax.scale_by_mfac(4, 1e-2, **kw),
      lambda **kw: fisher_optax.mfac(0.1, 4, 1e-2, momentum=0.5, **kw),
    ):
      with self.assertWarns(validation.FisherOptaxDeprecationWarning):
        old_tx = factory(gradients=old)
      chex.assert_trees_all_equal(run(old_tx), run(factory(fisher_source=new)))

  def test_old_gradients_value_warns(self):
    with self.assertWarns(validation.FisherOptaxDeprecationWarning):
      fisher_optax.scale_by_mfac(4, fisher_source="mean")
    with self.assertRaisesRegex(TypeError, "fisher_source"):
      fisher_optax.scale_by_mfac(4, fisher_source="batch", gradients="mean")


def _pairs(g):
  """Two per-example rows whose mean is ``g`` (a bad value reaches both)."""
  return {"per_example_grads": jax.tree.map(lambda x: jnp.stack([x, x]), g)}


class MFACAliasTest(absltest.TestCase):
  def test_follows_the_paper_step_with_masked_decay_and_momentum(self):
    # g <- grad + omega theta (masked leaves: no decay), u = F^{-1} g over
    # the window, v <- beta v + (1 - beta) u, theta <- theta - lr v.
    lr, m, lam, beta, omega = 0.1, 3, 1e-2, 0.5, 0.3
    mask = {"b": False, "w": True}
    with jax.enable_x64(True):
      params = {"b": jnp.array([0.5, -1.0]), "w": jnp.array([1.0, 2.0, -0.5])}
      tx = fisher_optax.mfac(
        lr, m, lam, momentum=beta, weight_decay=omega, mask=mask
      )
      state = tx.init(params)
      theta = np.concatenate([params["b"], params["w"]])
      decay = np.array([0.0, 0.0, 1.0, 1.0, 1.0])
      window, v = [], np.zeros(5)
      rng = np.random.default_rng(0)
      for _ in range(5):
        grad = rng.normal(size=5)
        tree = {"b": jnp.asarray(grad[:2]), "w": jnp.asarray(grad[2:])}
        updates, state = tx.update(tree, state, params)
        params = optax.apply_updates(params, updates)
        g = grad + omega * decay * theta
        window = (window + [g])[-m:]
        rows = np.array(window)
        fisher_ = lam * np.eye(5) + rows.T @ rows / m
        v = beta * v + (1 - beta) * np.linalg.solve(fisher_, g)
        theta = theta - lr * v
        np.testing.assert_allclose(
          np.concatenate([params["b"], params["w"]]), theta, rtol=1e-9
        )


class WindowNonfiniteTest(parameterized.TestCase):
  """The one non-finite policy for M-FAC and the windowed Woodbury transform.

  The Gram of 1e30 gradients overflows float32; a Cholesky (LAPACK on
  XLA:CPU) of a matrix holding an infinity returns garbage rather than an
  error, and the guards keep every decomposition on finite input, as for
  the SVD/eigh of the other transforms, which need not terminate at all.
  """

  PARAMS = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  GRADS = {"w": jnp.full((3, 2), 0.5), "b": jnp.array([1.0, -1.0])}

  @pytest.mark.timeout(240)
  @parameterized.named_parameters(
    ("mfac", lambda: fisher_optax.mfac(0.1, 3, 1e-2, momentum=0.5), False),
    ("scale_by_mfac", lambda: fisher_optax.scale_by_mfac(3, 1e-2), False),
    (
      "mfac_per_example",
      lambda: fisher_optax.scale_by_mfac(4, 1e-2, fisher_source="per_example"),
      True,
    ),
    ("woodbury", lambda: fisher_optax.scale_by_woodbury_fisher(3, 1e-2), False),
    (
      "woodbury_tree",
      lambda: fisher_optax.scale_by_woodbury_fisher(
        3, 1e-2, block_diagonal=False, window_dtype=jnp.bfloat16
      ),
      False,
    ),
    (
      "woodbury_per_example",
      lambda: fisher_optax.scale_by_woodbury_fisher(
        damping=1e-2, fisher_source="per_example"
      ),
      True,
    ),
  )
  def test_nonfinite_policy(self, make, per_example):
    # Steps before the bad one: a filling window, and one that has wrapped.
    nonfinite_testing.check_policy(
      self,
      make(),
      self.PARAMS,
      self.GRADS,
      steps_before=(1, 4),
      extra=_pairs if per_example else None,
    )

  @parameterized.parameters(True, False)
  def test_overflowing_gram_never_reaches_the_cholesky(self, per_example):
    seen, solve = [], linalg.woodbury_window_solve

    def recording(window, gram, *args, **kwargs):
      jax.debug.callback(
        lambda ok: seen.append(bool(ok)), jnp.all(jnp.isfinite(gram))
      )
      return solve(window, gram, *args, **kwargs)

    if per_example:
      tx = fisher_optax.scale_by_woodbury_fisher(
        damping=1e-2, fisher_source="per_example"
      )
    else:
      tx = fisher_optax.scale_by_mfac(3, 1e-2)
    state = tx.init(self.PARAMS)
    huge = jax.tree.map(lambda g: jnp.full_like(g, 1e30), self.GRADS)
    extra = _pairs(huge) if per_example else {}
    with mock.patch.object(linalg, "woodbury_window_solve", recording):
      u, new_state = tx.update(huge, state, **extra)
      jax.effects_barrier()
    self.assertTrue(seen)
    self.assertTrue(all(seen))
    chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, huge))
    self.assertEqual(int(new_state.notfinite_count), 1)

  def test_skipped_step_keeps_momentum_and_write_index(self):
    tx = fisher_optax.mfac(0.1, 3, 1e-2, momentum=0.5)
    state = tx.init(self.PARAMS)
    _, state = tx.update(self.GRADS, state, self.PARAMS)
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.inf), self.GRADS)
    u, new_state = jax.jit(tx.update)(bad, state, self.PARAMS)
    self.assertFalse(
      any(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(u))
    )
    _, rest = nonfinite_testing.split_counts(state)
    _, new_rest = nonfinite_testing.split_counts(new_state)
    chex.assert_trees_all_equal(new_rest, rest)
    self.assertEqual(int(new_state[1].index), 1)
    self.assertEqual(int(new_state[1].notfinite_count), 1)

  def test_flags_must_be_bools(self):
    for name in ("normalize_output", "block_diagonal"):
      with self.assertRaisesRegex(TypeError, f"{name} must be True or False"):
        fisher_optax.scale_by_woodbury_fisher(**{name: "no"})

  def test_mismatched_gradients_are_refused(self):
    params = {"w": jnp.ones((4, 3))}
    for tx in (
      fisher_optax.mfac(1e-2, 4),
      fisher_optax.mfac(1e-2, 4, weight_decay=0.1),
      fisher_optax.scale_by_mfac(4),
      fisher_optax.scale_by_woodbury_fisher(2),
    ):
      state = tx.init(params)
      for bad in (jnp.ones(()), jnp.ones((3, 4)), jnp.ones((4, 1))):
        with self.assertRaisesRegex(
          ValueError, r"updates do not match (init's )?params"
        ):
          tx.update({"w": bad}, state, params)
      # Without params the window's shapes are the reference.
      if not isinstance(state, tuple) or hasattr(state, "_fields"):
        with self.assertRaisesRegex(
          ValueError, r"updates do not match (init's )?params"
        ):
          tx.update({"w": jnp.ones(())}, state)


class WindowDtypeTest(parameterized.TestCase):
  def test_bfloat16_window_halves_the_window_memory(self):
    params = {"w": jnp.ones((16, 8), jnp.bfloat16)}
    nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))
    default = fisher_optax.mfac(1e-2, 8).init(params)[1]
    narrow = fisher_optax.mfac(1e-2, 8, window_dtype=jnp.bfloat16).init(params)[
      1
    ]
    # Today's default for bf16 params: a float32 window.
    self.assertEqual(default.grads["w"].dtype, jnp.float32)
    self.assertEqual(narrow.grads["w"].dtype, jnp.bfloat16)
    self.assertEqual(nbytes(narrow.grads) * 2, nbytes(default.grads))
    # The Gram stays float32.
    self.assertEqual(narrow.gram.dtype, jnp.float32)

  def test_bfloat16_window_matches_float32_window(self):
    params = {"w": jnp.ones((16, 8), jnp.bfloat16)}
    seq = jax.random.normal(jax.random.key(3), (5, 16, 8)).astype(jnp.bfloat16)
    out = {}
    for dtype in (None, jnp.bfloat16):
      tx = fisher_optax.mfac(1e-2, 4, 1e-1, window_dtype=dtype)
      state = tx.init(params)
      for g in seq:
        u, state = tx.update({"w": g}, state, params)
      self.assertEqual(u["w"].dtype, jnp.bfloat16)
      out[dtype] = u["w"].astype(jnp.float32)
    # The bf16 rows are exact copies of the bf16 gradients.
    np.testing.assert_allclose(
      out[None], out[jnp.bfloat16], rtol=2e-2, atol=1e-3
    )

  @parameterized.parameters(jnp.bfloat16, jnp.float16)
  def test_narrow_window_keeps_the_direction_at_small_damping(self, dtype):
    # float32 gradients in a narrower window: the solve takes the rows as
    # stored, so their rounding is not scaled by 1 / damping (it made the
    # updates 280-1600x too large, cosine 0.005, before).
    seq = jax.random.normal(jax.random.key(4), (6, 64))
    out = {}
    for window_dtype in (None, dtype):
      tx = fisher_optax.scale_by_mfac(4, 1e-5, window_dtype=window_dtype)
      state = tx.init(seq[0])
      for g in seq:
        u, state = tx.update(g, state)
      out[window_dtype] = np.asarray(u, np.float64)
    a, b = out[None], out[dtype]
    self.assertGreater(a @ b / np.linalg.norm(a) / np.linalg.norm(b), 0.99)
    self.assertAlmostEqual(
      np.linalg.norm(b) / np.linalg.norm(a), 1.0, delta=0.15
    )

  @parameterized.parameters(jnp.int32, jnp.bool_, "foo")
  def test_window_dtype_must_be_a_float(self, dtype):
    with self.assertRaisesRegex(TypeError, "window_dtype must be a float"):
      fisher_optax.scale_by_mfac(4, window_dtype=dtype)

  def test_float16_statistics_do_not_overflow(self):
    # 1e3-sized float16 gradients: squares are far above float16's 65504.
    params = jnp.zeros(4, jnp.float16)
    tx = fisher_optax.scale_by_mfac(4, 1e-2)
    state = tx.init(params)
    self.assertEqual(state.grads.dtype, jnp.float32)
    for scale in (1e3, 2e3, -1e3):
      u, state = tx.update(jnp.full(4, scale, jnp.float16), state)
    self.assertEqual(u.dtype, jnp.float16)
    chex.assert_tree_all_finite((u, state))
    self.assertEqual(int(state.notfinite_count), 0)


class Float32AccuracyTest(parameterized.TestCase):
  """float32 against a float64 oracle where ``|g|^2 / damping`` is large.

  ``(g - G^T C^{-1} G g) / damping`` cancels almost all of ``g`` there and
  lost 4-80% of the answer (more than 100% at damping 1e-6); the gradient
  lies in the window's span, which the solve now uses.
  """

  @parameterized.parameters(
    ("mfac", 64, 4, 1e-5),
    ("mfac", 4096, 8, 1e-3),
    ("mfac", 4096, 8, 1e-6),
    ("woodbury", 4096, 8, 1e-3),
    # Rows no longer than the window: solved as the d x d matrix (a 3%
    # and a 0.4% error in the Woodbury form).
    ("woodbury", 4, 8, 1e-5),
    ("mfac", 24, 32, 1e-3),
  )
  def test_matches_float64_oracle(self, kind, d, m, damping):
    rng = np.random.default_rng(0)
    if kind == "mfac":
      tx, scale = fisher_optax.scale_by_mfac(m, damping), 1.0 / m
    else:
      tx, scale = fisher_optax.scale_by_woodbury_fisher(m, damping), 1.0
    state, rows, step = tx.init(jnp.zeros(d)), [], jax.jit(tx.update)
    for _ in range(m + 3):  # filling the window, then wrapping
      g = rng.normal(size=d).astype(np.float32)
      rows = (rows + [g.astype(np.float64)])[-m:]
      u, state = step(jnp.asarray(g), state)
      gm = np.stack(rows)
      # (damping I + scale G^T G)^{-1} g by Woodbury, in float64 (a dense
      # d x d solve per step took most of this test's time).
      g64 = g.astype(np.float64)
      small = np.eye(len(rows)) * damping / scale + gm @ gm.T
      want = (g64 - gm.T @ np.linalg.solve(small, gm @ g64)) / damping
      err = np.linalg.norm(np.asarray(u, np.float64) - want)
      self.assertLess(err / np.linalg.norm(want), 1e-4)

  @parameterized.parameters(jnp.float32, jnp.bfloat16)
  def test_per_example_rows_mean_matches_float64_oracle(self, window_dtype):
    # The mean of the rows as stored: a bfloat16 window's rounding of the
    # mean, scaled by 1 / damping, made the update 24x too large.
    rng = np.random.default_rng(1)
    pe = jnp.asarray(rng.normal(size=(4, 256)), jnp.float32)
    tx = fisher_optax.scale_by_mfac(
      16, 1e-3, fisher_source="per_example", window_dtype=window_dtype
    )
    u, _ = tx.update(pe.mean(0), tx.init(jnp.zeros(256)), per_example_grads=pe)
    rows = np.asarray(pe.astype(window_dtype), np.float64)
    fisher_matrix = 1e-3 * np.eye(256) + rows.T @ rows / 16
    want = np.linalg.solve(fisher_matrix, rows.mean(0))
    err = np.linalg.norm(np.asarray(u, np.float64) - want)
    # float32 updates: the rounding of their mean is amplified by the
    # conditioning |g|^2 / (m damping) ~ 1.6e4, as it is for any input.
    tol = 1e-4 if window_dtype == jnp.bfloat16 else 5e-3
    self.assertLess(err / np.linalg.norm(want), tol)

  @parameterized.parameters("mfac", "woodbury", "woodbury_tree")
  def test_per_example_exact_mean_is_solved_in_span(self, kind):
    # The updates are the rows' mean as the solve forms it (so in the rows'
    # span, to the bit): only cancellation could make the solve miss. G r
    # came from G g - Gram a (a window of 16), or g was solved by (g - G^T w)
    # / damping (this batch's rows as the window), both cancelling.
    rng = np.random.default_rng(3)
    pe = jnp.asarray(rng.normal(size=(4, 256)), jnp.float32)
    mean = fisher.linalg.tree_stacked_combine(pe, jnp.full((4,), 0.25))
    damping = 1e-5
    if kind == "mfac":
      tx = fisher_optax.scale_by_mfac(16, damping, fisher_source="per_example")
      scale = 1.0 / 16
    else:
      tx = fisher_optax.scale_by_woodbury_fisher(
        damping=damping,
        fisher_source="per_example",
        block_diagonal=kind == "woodbury",
      )
      scale = 1.0 / 4
    u, _ = tx.update(mean, tx.init(jnp.zeros(256)), per_example_grads=pe)
    rows = np.asarray(pe, np.float64)
    fisher_matrix = damping * np.eye(256) + scale * rows.T @ rows
    want = np.linalg.solve(fisher_matrix, rows.mean(0))
    err = np.linalg.norm(np.asarray(u, np.float64) - want)
    self.assertLess(err / np.linalg.norm(want), 1e-4)

  def test_per_example_keeps_terms_added_to_the_mean(self):
    # An exact window solves the part of the updates outside the rows' span.
    rng = np.random.default_rng(2)
    pe = jnp.asarray(rng.normal(size=(4, 32)), jnp.float32)
    extra = jnp.asarray(rng.normal(size=32), jnp.float32)
    tx = fisher_optax.scale_by_mfac(8, 1e-1, fisher_source="per_example")
    x = pe.mean(0) + extra
    u, _ = tx.update(x, tx.init(jnp.zeros(32)), per_example_grads=pe)
    rows = np.asarray(pe, np.float64)
    fisher_matrix = 1e-1 * np.eye(32) + rows.T @ rows / 8
    want = np.linalg.solve(fisher_matrix, np.asarray(x, np.float64))
    np.testing.assert_allclose(u, want, rtol=1e-4, atol=1e-5)


class EmptyTreeTest(parameterized.TestCase):
  """A transform given no leaves (an optax.partition group left empty)
  returns its empty updates; the unwritten rows raised a KeyError."""

  @parameterized.named_parameters(
    ("mfac", lambda: fisher_optax.scale_by_mfac(4), False),
    (
      "woodbury_tree",
      lambda: fisher_optax.scale_by_woodbury_fisher(4, block_diagonal=False),
      False,
    ),
    (
      "mfac_per_example",
      lambda: fisher_optax.scale_by_mfac(4, fisher_source="per_example"),
      True,
    ),
  )
  def test_no_leaves(self, make, per_example):
    tx = make()
    extra = {"per_example_grads": {}} if per_example else {}
    step = jax.jit(lambda g, s: tx.update(g, s, **extra))
    u, state = step({}, tx.init({}))
    self.assertEqual(u, {})
    self.assertEqual(int(state.notfinite_count), 0)

  def test_empty_partition_group(self):
    params = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
    tx = optax.partition(
      {"m": fisher_optax.mfac(1e-2, 4), "a": optax.adam(1e-3)},
      {"w": "a", "b": "a"},
    )
    u, _ = jax.jit(tx.update)(params, tx.init(params), params)
    chex.assert_trees_all_equal_shapes(u, params)


class RestoredStateTest(parameterized.TestCase):
  """States as a user may hold them: with ``None`` leaves (optax's
  placeholder) and as NumPy arrays (a msgpack or ``device_get`` round
  trip), updated eagerly."""

  @parameterized.named_parameters(("batch", "batch"), ("rows", "per_example"))
  def test_none_leaf(self, source):
    params = {"w": jnp.ones((3, 2)), "b": None}
    extra = {}
    if source == "per_example":
      extra = {"per_example_grads": {"w": jnp.ones((4, 3, 2)), "b": None}}
    tx = fisher_optax.scale_by_woodbury_fisher(2, fisher_source=source)
    state = tx.init(params)
    for _ in range(3):
      u, state = tx.update(params, state, **extra)
    self.assertIsNone(u["b"])
    chex.assert_tree_all_finite(u["w"])

  def test_numpy_state_updates_eagerly(self):
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)}
    for tx in (
      fisher_optax.mfac(1e-2, window_size=4),
      fisher_optax.scale_by_woodbury_fisher(2),
    ):
      state = tx.init(params)
      for _ in range(2):
        want, state_next = jax.jit(tx.update)(params, state, params)
        got, _ = tx.update(params, jax.device_get(state), params)
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)
        state = state_next


class DonatedWindowTest(parameterized.TestCase):
  """The window is updated in place: no copy of it in the compiled step.

  A whole-window copy (a read of the donated window after its in-place write,
  a window carried through a cond) shows as temp memory of at least one
  window; the step needs a few vectors of size d besides the window.
  """

  M, PARAMS = 16, {"k": jnp.zeros((63, 256)), "b": jnp.zeros((256,))}

  @parameterized.named_parameters(
    ("scale_by_mfac", lambda: fisher_optax.scale_by_mfac(16, 1e-3), False),
    ("mfac", lambda: fisher_optax.mfac(1e-3, 16, momentum=0.9), False),
    (
      "mfac_per_example",
      lambda: fisher_optax.scale_by_mfac(16, 1e-3, fisher_source="per_example"),
      True,
    ),
    ("woodbury", lambda: fisher_optax.scale_by_woodbury_fisher(16), False),
    (
      "woodbury_tree",
      lambda: fisher_optax.scale_by_woodbury_fisher(16, block_diagonal=False),
      False,
    ),
  )
  def test_no_window_copy(self, make, per_example):
    tx = make()
    params = self.PARAMS
    grads = jax.tree.map(jnp.ones_like, params)
    extra = {}
    if per_example:
      extra = {"per_example_grads": jax.tree.map(lambda g: g[None], grads)}
    state = tx.init(params)
    window = [
      x for x in jax.tree.leaves(state) if x.ndim > 1 and x.shape[0] == self.M
    ]
    window_bytes = sum(x.nbytes for x in window if x.shape != (self.M, self.M))
    step = jax.jit(
      lambda g, s: tx.update(g, s, params, **extra), donate_argnums=1
    )
    compiled = step.lower(grads, state).compile()
    memory = compiled.memory_analysis()
    assert memory is not None
    self.assertLess(memory.temp_size_in_bytes, window_bytes / 4)
    # The donated window is the output's buffer.
    self.assertGreaterEqual(memory.alias_size_in_bytes, window_bytes)
    # And the fresh state can be donated (no buffer shared between fields).
    u, state = step(grads, state)
    chex.assert_tree_all_finite((u, state))


if __name__ == "__main__":
  absltest.main()
