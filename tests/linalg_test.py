# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for the shared numerics in ``fisher_optax.fisher.linalg`` and ``fisher_optax._matrix_roots``."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from fisher_optax.fisher import linalg
from tests import fisher_testing


class TopEighTest(parameterized.TestCase):
  """LOBPCG for large float32 matrices, the full eigh otherwise."""

  N = 1100  # above min_iterative: LOBPCG

  def _gram(self, rank, scale):
    g = np.random.default_rng(0).normal(size=(self.N, rank))
    return (scale * (g @ g.T)).astype(np.float32)

  @parameterized.parameters(
    (30, 1.0), (30, 1e-30), (30, 1e30), (3, 1.0), (2000, 1.0)
  )
  def test_matches_the_full_eigh(self, rank, scale):
    """Tiny and huge scales, a rank below the block, full rank."""
    a = self._gram(rank, scale)
    vals, vecs = jax.jit(lambda a: linalg.top_eigh(a, 8))(a)
    want, wvecs = np.linalg.eigh(a.astype(np.float64))
    want, wvecs = want[::-1][:8], wvecs[:, ::-1][:, :8]
    big = want[0]
    np.testing.assert_allclose(vals, want, rtol=1e-5, atol=1e-5 * big)
    vecs = np.asarray(vecs, np.float64)
    np.testing.assert_allclose(vecs.T @ vecs, np.eye(8), atol=1e-5)
    # Each pair's residual, relative to the largest eigenvalue.
    res = np.linalg.norm(a @ vecs - vecs * np.asarray(vals), axis=0)
    self.assertLess(res.max(), 1e-4 * big)
    # The well separated directions agree with eigh's up to sign.
    n = min(rank, 8) - 1
    cos = np.abs(np.sum(vecs[:, :n] * wvecs[:, :n], 0))
    np.testing.assert_allclose(cos, 1.0, atol=1e-4)

  def test_zero_matrix(self):
    vals, vecs = linalg.top_eigh(jnp.zeros((self.N, self.N)), 4)
    np.testing.assert_array_equal(vals, 0.0)
    np.testing.assert_allclose(vecs.T @ vecs, np.eye(4), atol=1e-6)

  def test_small_and_float64_matrices_take_eigh(self):
    a = self._gram(30, 1.0)
    full_vals, full_vecs = np.linalg.eigh(a)
    kw = {"min_iterative": self.N + 1}
    vals, vecs = jax.jit(lambda a: linalg.top_eigh(a, 8, **kw))(a)
    np.testing.assert_allclose(vals, full_vals[::-1][:8], rtol=1e-5)
    np.testing.assert_allclose(
      np.abs(vecs), np.abs(full_vecs[:, ::-1][:, :8]), atol=1e-4
    )
    hlo = jax.jit(lambda a: linalg.top_eigh(a, 8)).lower(a).as_text()
    self.assertIn("while", hlo)  # LOBPCG's loop
    with jax.enable_x64(True):
      hlo = (
        jax.jit(lambda a: linalg.top_eigh(a, 8))
        .lower(jnp.asarray(a, jnp.float64))
        .as_text()
      )
      self.assertNotIn("while", hlo)  # no LOBPCG loop


class StackedPushRowsTest(parameterized.TestCase):
  """The ring-buffer push keeps the cached Gram equal to a fresh one."""

  def _tree(self, key, m):
    k1, k2 = jax.random.split(key)
    return {
      "w": fisher_testing.normal(k1, (m, 3, 2)),
      "b": fisher_testing.normal(k2, (m, 4)),
    }

  @parameterized.parameters((1, 0), (1, 4), (3, 3), (3, 4), (5, 0))
  def test_gram_matches_fresh_gram(self, k, index):
    m = 5
    with jax.enable_x64(True):
      window = jax.tree.map(
        lambda x: x.astype(jnp.float64), self._tree(jax.random.key(0), m)
      )
      rows = jax.tree.map(
        lambda x: x.astype(jnp.float64), self._tree(jax.random.key(1), k)
      )
      gram = linalg.tree_stacked_gram(window)
      push = jax.jit(linalg.stacked_push_rows)
      new_window, new_gram = push(window, gram, rows, index)
      slots = [(index + i) % m for i in range(k)]
      for i, slot in enumerate(slots):
        chex.assert_trees_all_close(
          jax.tree.map(lambda x, s=slot: x[s], new_window),
          jax.tree.map(lambda x, i=i: x[i], rows),
        )
      untouched = [s for s in range(m) if s not in slots]
      for slot in untouched:
        chex.assert_trees_all_close(
          jax.tree.map(lambda x, s=slot: x[s], new_window),
          jax.tree.map(lambda x, s=slot: x[s], window),
        )
      np.testing.assert_allclose(
        new_gram, linalg.tree_stacked_gram(new_window), rtol=1e-12
      )

  def test_too_many_rows_raise(self):
    window = self._tree(jax.random.key(0), 2)
    rows = self._tree(jax.random.key(1), 3)
    with self.assertRaisesRegex(ValueError, "window of 2 rows"):
      linalg.stacked_push_rows(
        window, linalg.tree_stacked_gram(window), rows, 0
      )


class TrilInverseTest(parameterized.TestCase):
  """The LU-based triangular inverse matches a float64 triangular solve."""

  def test_matches_solve(self):
    with jax.enable_x64(True):
      a = fisher_testing.normal(jax.random.key(0), (3, 6, 6), jnp.float64)
      chol = jnp.linalg.cholesky(a @ jnp.swapaxes(a, -1, -2) + jnp.eye(6))
      inv = linalg.tril_inverse(chol)
      for c, i in zip(chol, inv):
        np.testing.assert_allclose(
          i,
          jax.scipy.linalg.solve_triangular(c, jnp.eye(6), lower=True),
          rtol=1e-10,
          atol=1e-12,
        )
        np.testing.assert_array_equal(np.triu(np.asarray(i), 1), 0.0)


class WoodburyTest(parameterized.TestCase):
  """Woodbury solves of F = damping*I + scale*G^T G against dense float64."""

  @parameterized.product(
    damping=(1e-3, 1.0), scale=(1.0, 0.25), zero_rows=(0, 2)
  )
  def test_solve_and_inverse_diag_match_dense(self, damping, scale, zero_rows):
    with jax.enable_x64(True):
      rng = np.random.default_rng(0)
      m, shapes = 6, {"a": (3, 4), "b": (5,)}
      stacked = {k: rng.normal(size=(m, *s)) for k, s in shapes.items()}
      for k in stacked:  # an unfilled ring-buffer tail contributes nothing
        stacked[k][m - zero_rows :] = 0.0
      x = {k: rng.normal(size=s) for k, s in shapes.items()}
      stacked = jax.tree.map(jnp.asarray, stacked)
      x = jax.tree.map(jnp.asarray, x)
      g = np.concatenate(
        [np.asarray(stacked[k]).reshape(m, -1) for k in sorted(shapes)], axis=1
      )
      dense = damping * np.eye(g.shape[1]) + scale * g.T @ g
      flat_x = np.concatenate([np.asarray(x[k]).ravel() for k in sorted(x)])
      expected = np.linalg.solve(dense, flat_x)

      factor = linalg.woodbury_factor(
        linalg.tree_stacked_gram(stacked), damping, scale
      )
      got = linalg.woodbury_solve(stacked, factor, x)
      flat_got = np.concatenate(
        [np.asarray(got[k]).ravel() for k in sorted(got)]
      )
      np.testing.assert_allclose(flat_got, expected, rtol=1e-9, atol=1e-12)
      np.testing.assert_allclose(dense @ flat_got, flat_x, rtol=1e-9, atol=1e-9)

      normalized = linalg.woodbury_solve(stacked, factor, x, normalized=True)
      flat_norm = np.concatenate(
        [np.asarray(normalized[k]).ravel() for k in sorted(normalized)]
      )
      np.testing.assert_allclose(
        flat_norm, damping * expected, rtol=1e-9, atol=1e-12
      )

      diag = fisher_testing.woodbury_inverse_diag(stacked, factor)
      flat_diag = np.concatenate(
        [np.asarray(diag[k]).ravel() for k in sorted(diag)]
      )
      np.testing.assert_allclose(
        flat_diag, np.diag(np.linalg.inv(dense)), rtol=1e-9
      )

  def test_stacked_algebra_matches_flat(self):
    rng = np.random.default_rng(1)
    stacked = {
      "a": jnp.asarray(rng.normal(size=(4, 2, 3)), jnp.float32),
      "b": jnp.asarray(rng.normal(size=(4, 5)), jnp.float32),
    }
    x = {"a": jnp.ones((2, 3)), "b": jnp.arange(5.0)}
    g = np.concatenate(
      [np.asarray(stacked["a"]).reshape(4, -1), np.asarray(stacked["b"])],
      axis=1,
    )
    fx = np.concatenate([np.ones(6), np.arange(5.0)])
    np.testing.assert_allclose(
      linalg.tree_stacked_dot(stacked, x), g @ fx, rtol=1e-5
    )
    np.testing.assert_allclose(
      linalg.tree_stacked_gram(stacked), g @ g.T, rtol=1e-5
    )
    z = jnp.array([1.0, -2.0, 0.5, 3.0])
    comb = linalg.tree_stacked_combine(stacked, z)
    np.testing.assert_allclose(
      np.concatenate([np.asarray(comb["a"]).ravel(), np.asarray(comb["b"])]),
      np.asarray(z) @ g,
      rtol=1e-5,
    )


class WoodburySpanTest(parameterized.TestCase):
  """Solves of the rows' mean inside their span (``coords``), float32
  against a float64 oracle where ``scale |x|^2 / damping`` is near 1e8."""

  def _rows(self):
    rng = np.random.default_rng(4)
    rows = {
      "a": jnp.asarray(rng.normal(size=(4, 8, 16)), jnp.float32),
      "b": jnp.asarray(rng.normal(size=(4, 32)), jnp.float32),
    }
    flat = np.concatenate(
      [np.asarray(rows["a"], np.float64).reshape(4, -1), rows["b"]], axis=1
    )
    return rows, flat

  @staticmethod
  def _flat(tree):
    return np.concatenate(
      [np.asarray(tree["a"], np.float64).ravel(), np.asarray(tree["b"])]
    )

  @parameterized.parameters(0.0, 1.0)
  def test_window_own_rows_and_rows_solve(self, extra):
    rows, flat = self._rows()
    damping, coords = 1e-5, jnp.full((4,), 0.25)
    # The mean as the solve forms it, plus (or not) a part outside the span.
    x = linalg.tree_stacked_combine(rows, coords)
    x = {"a": x["a"] + extra, "b": x["b"]}
    fisher_matrix = damping * np.eye(flat.shape[1]) + flat.T @ flat / 4
    # The oracle takes the rows' exact mean: x's own float32 rounding lies
    # outside the span, where F^{-1} scales it by 1 / damping (15% here).
    exact = flat.mean(0) + extra * (np.arange(flat.shape[1]) < 128)
    want = np.linalg.solve(fisher_matrix, exact)
    gram = linalg.tree_stacked_gram(rows)
    got = {
      "window": linalg.woodbury_window_solve(
        rows, gram, x, damping, scale=0.25, coords=coords
      ),
      "rows": linalg.woodbury_rows_solve(rows, x, damping, mean=True),
      "pending": linalg.woodbury_window_solve(
        rows,
        gram,
        x,
        damping,
        scale=0.25,
        pending=(rows, jnp.arange(4)),
        coords=coords,
      ),
    }
    for name, out in got.items():
      err = np.linalg.norm(self._flat(out) - want) / np.linalg.norm(want)
      self.assertLess(err, 1e-4, msg=name)
    if not extra:  # Without the span: cancellation, far off.
      plain = linalg.woodbury_rows_solve(rows, x, damping)
      err = np.linalg.norm(self._flat(plain) - want) / np.linalg.norm(want)
      self.assertGreater(err, 1e-2)

  def test_g_x_with_a_remainder_is_refused(self):
    rows, _ = self._rows()
    x = jax.tree.map(lambda r: r[0], rows)
    with self.assertRaisesRegex(ValueError, "gr"):
      linalg.woodbury_window_solve(
        rows,
        linalg.tree_stacked_gram(rows),
        x,
        1e-3,
        gx=linalg.tree_stacked_dot(rows, x),
        coords=jnp.full((4,), 0.25),
      )


class WoodburyWindowSolvesTest(parameterized.TestCase):
  @parameterized.parameters(False, True)
  def test_equals_one_solve_per_window_and_isolates_nan(self, normalized):
    rng = np.random.default_rng(0)
    shapes = [(3, 5), (3, 4, 2), (3, 7)]  # windows of m = 3 rows
    windows = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
    xs = [jnp.asarray(rng.normal(size=s[1:]), jnp.float32) for s in shapes]
    grams = [linalg.tree_stacked_gram(w) for w in windows]
    rows = jnp.asarray(rng.normal(size=(1, 7)), jnp.float32)
    slots = jnp.array([1], jnp.int32)
    pending_gram, _ = linalg.stacked_pending_gram(windows[2], grams[2], rows, 1)
    grams[2] = pending_gram
    pendings = [None, None, (rows, slots)]
    gxs = [grams[0][:, 0], None, None]
    xs[0] = windows[0][0]  # G x is the Gram's column of row 0
    got = linalg.woodbury_window_solves(
      windows,
      grams,
      xs,
      0.1,
      normalized=normalized,
      gxs=gxs,
      pendings=pendings,
    )
    for w, g, x, gx, pend, out in zip(windows, grams, xs, gxs, pendings, got):
      want = linalg.woodbury_window_solve(
        w, g, x, 0.1, normalized=normalized, gx=gx, pending=pend
      )
      np.testing.assert_allclose(out, want, rtol=2e-5, atol=1e-6)
    # A non-finite Gram gives its window NaN and leaves the others alone.
    grams[1] = grams[1].at[0, 0].set(jnp.inf)
    got = linalg.woodbury_window_solves(
      windows, grams, xs, 0.1, gxs=gxs, pendings=pendings
    )
    self.assertTrue(bool(jnp.isnan(got[1]).all()))
    self.assertTrue(bool(jnp.isfinite(got[0]).all()))
    self.assertTrue(bool(jnp.isfinite(got[2]).all()))


class WoodburyShortRowsTest(parameterized.TestCase):
  """Windows whose rows are no longer than the window (``d <= m``: a scalar
  or a short bias under a window of 8) are solved as the ``d x d`` matrix
  where that is well conditioned (rows spanning every direction).

  In the Woodbury form the ``m x m`` Gram has rank ``d`` at most, and
  float32 lost 5-15% of the answer at damping 1e-5 here.
  """

  def setUp(self):
    super().setUp()
    rng = np.random.default_rng(0)
    self.m = 8
    # d = 3: a (2,) leaf and a scalar; the last two rows unfilled.
    g = rng.normal(size=(self.m, 3)) * rng.uniform(0.3, 3.0, size=(self.m, 1))
    g[-2:] = 0.0
    self.g64 = g
    self.window = {
      "a": jnp.asarray(g[:, :2], jnp.float32),
      "s": jnp.asarray(g[:, 2], jnp.float32),
    }
    self.x64 = rng.normal(size=3)
    self.x = {
      "a": jnp.asarray(self.x64[:2], jnp.float32),
      "s": jnp.asarray(self.x64[2], jnp.float32),
    }
    self.rows64 = rng.normal(size=(2, 3))
    self.rows = {
      "a": jnp.asarray(self.rows64[:, :2], jnp.float32),
      "s": jnp.asarray(self.rows64[:, 2], jnp.float32),
    }

  def flat(self, tree):
    return np.concatenate(
      [np.asarray(tree["a"], np.float64), np.asarray(tree["s"])[None]]
    )

  def want(self, g, x, damping, scale=1.0):
    dense = damping * np.eye(g.shape[1]) + scale * g.T @ g
    return np.linalg.solve(dense, x)

  @parameterized.product(damping=(1e-5, 1e-3), normalized=(False, True))
  def test_window_solve_matches_float64(self, damping, normalized):
    gram = linalg.tree_stacked_gram(self.window)
    got = linalg.woodbury_window_solve(
      self.window, gram, self.x, damping, scale=0.5, normalized=normalized
    )
    want = self.want(self.g64, self.x64, damping, 0.5)
    want = damping * want if normalized else want
    self.assertEqual(got["s"].shape, ())
    np.testing.assert_allclose(self.flat(got), want, rtol=1e-4)

  @parameterized.parameters(True, False)
  def test_pending_rows_and_coords(self, remainder):
    slots = jnp.array([6, 7], jnp.int32)
    gram, _ = linalg.stacked_pending_gram(
      self.window, linalg.tree_stacked_gram(self.window), self.rows, 6
    )
    coords = jnp.array([0.25, -0.5], jnp.float32)
    # Without remainder, x is taken as exactly rows^T a (x is not read).
    x = self.x if remainder else jax.tree.map(jnp.zeros_like, self.x)
    got = linalg.woodbury_window_solve(
      self.window,
      gram,
      x,
      1e-5,
      pending=(self.rows, slots),
      coords=coords,
      remainder=remainder,
    )
    g = self.g64.copy()
    g[6:] = self.rows64
    x = self.x64 if remainder else self.rows64.T @ np.array([0.25, -0.5])
    np.testing.assert_allclose(self.flat(got), self.want(g, x, 1e-5), rtol=1e-4)

  def test_filling_window_keeps_the_woodbury_form(self):
    # Two rows filled of d = 3: F has the damping alone in the direction no
    # row spans, where a direct solve would amplify the rounding of x (a
    # row itself here). The Gram's filled block is exact instead.
    window = jax.tree.map(lambda v: v.at[2:].set(0.0), self.window)
    g = self.g64.copy()
    g[2:] = 0.0
    gram = linalg.tree_stacked_gram(window)
    got = linalg.woodbury_window_solve(
      window, gram, self.x, 1e-5, coords=jnp.eye(8)[1], remainder=False
    )
    want = self.want(g, g[1], 1e-5)
    np.testing.assert_allclose(self.flat(got), want, rtol=1e-5)

  def test_rows_after_a_spike_keep_the_woodbury_form(self):
    # Two large rows, then rows 1e-4 as large: F's weakest direction is
    # about the damping, and a direct solve lost 1% there, the Woodbury
    # form (its small rows' block is well conditioned) 1e-7.
    rng = np.random.default_rng(2)
    g = np.concatenate(
      [rng.normal(size=(2, 3)), 1e-4 * rng.normal(size=(6, 3))]
    )
    window = jnp.asarray(g, jnp.float32)
    g = np.asarray(window, np.float64)
    got = linalg.woodbury_window_solve(
      window,
      linalg.tree_stacked_gram(window),
      window[2],
      1e-5,
      coords=jnp.eye(8)[2],
      remainder=False,
    )
    np.testing.assert_allclose(got, self.want(g, g[2], 1e-5), rtol=1e-5)

  def test_own_coords_without_remainder_solve_the_rows(self):
    # x is taken as exactly G^T a, not read: a full window, solved directly.
    a = jnp.array([0.0, 0.5, 0.0, -1.0, 0.0, 0.0, 2.0, 0.0], jnp.float32)
    got = linalg.woodbury_window_solve(
      self.window,
      linalg.tree_stacked_gram(self.window),
      jax.tree.map(jnp.zeros_like, self.x),
      1e-5,
      coords=a,
      remainder=False,
    )
    want = self.want(self.g64, self.g64.T @ np.asarray(a, np.float64), 1e-5)
    np.testing.assert_allclose(self.flat(got), want, rtol=1e-4)

  def test_window_solves_mix_short_and_long_windows(self):
    # One short window with its pushed row, one long (d = 12 > m) window.
    rng = np.random.default_rng(1)
    long_window = jnp.asarray(rng.normal(size=(self.m, 12)), jnp.float32)
    long_x = jnp.asarray(rng.normal(size=12), jnp.float32)
    row = jax.tree.map(lambda r: r[:1], self.rows)
    slots = jnp.array([6], jnp.int32)
    grams = [
      linalg.stacked_pending_gram(
        self.window, linalg.tree_stacked_gram(self.window), row, 6
      )[0],
      linalg.tree_stacked_gram(long_window),
    ]
    got = linalg.woodbury_window_solves(
      [self.window, long_window],
      grams,
      [self.x, long_x],
      1e-5,
      pendings=[(row, slots), None],
      pushed=[True, False],
    )
    g = self.g64.copy()
    g[6] = self.rows64[0]
    want = self.want(g, self.rows64[0], 1e-5)
    np.testing.assert_allclose(self.flat(got[0]), want, rtol=1e-4)
    self.assertEqual(got[0]["s"].dtype, jnp.float32)
    want_long = linalg.woodbury_window_solve(
      long_window, grams[1], long_x, 1e-5
    )
    np.testing.assert_allclose(got[1], want_long, rtol=1e-5)
    # A non-finite short window gives NaN and leaves the other alone.
    bad = {**self.window, "s": self.window["s"].at[0].set(jnp.inf)}
    got = linalg.woodbury_window_solves(
      [bad, long_window], grams, [self.x, long_x], 1e-5
    )
    self.assertTrue(bool(jnp.isnan(self.flat(got[0])).all()))
    self.assertTrue(bool(jnp.isfinite(got[1]).all()))


class PushIfFiniteTest(parameterized.TestCase):
  """One-row pushes (Natural GaLore's window): the cache stays the exact Gram
  of the stored (possibly bfloat16) window, and NaN rows change nothing."""

  @parameterized.parameters(jnp.float32, jnp.bfloat16)
  def test_gram_is_exact_gram_of_stored_window(self, window_dtype):
    m = 3
    key = jax.random.key(0)
    window = {
      "w": jnp.zeros((m, 4, 2), window_dtype),
      "b": jnp.zeros((m, 3), window_dtype),
    }
    gram = jnp.zeros((m, m), jnp.float32)
    push = jax.jit(linalg.stacked_push_rows_if_finite)
    for t in range(6):  # wraps around the ring; step 4 pushes a NaN
      k1, k2 = jax.random.split(jax.random.fold_in(key, t))
      x = {
        "w": fisher_testing.normal(k1, (1, 4, 2)),
        "b": fisher_testing.normal(k2, (1, 3)),
      }
      if t == 4:
        x["b"] = x["b"].at[0, 1].set(jnp.nan)
      old = window
      window, gram, pushed = push(window, gram, x, t % m)
      self.assertEqual(bool(pushed), t != 4)
      if t == 4:
        chex.assert_trees_all_equal(window, old)
      else:
        chex.assert_trees_all_equal(
          jax.tree.map(lambda s: s[t % m], window),
          jax.tree.map(lambda v: v[0].astype(window_dtype), x),
        )
      wide = jax.tree.map(lambda s: s.astype(jnp.float32), window)
      chex.assert_trees_all_close(
        gram, linalg.tree_stacked_gram(wide), rtol=1e-6, atol=1e-6
      )
      self.assertEqual(gram.dtype, jnp.float32)


class ShardedProductsTest(absltest.TestCase):
  """Without a mesh the sharding-aware helpers are plain linear algebra (the
  8-device checks test them under explicit mesh axes)."""

  def test_replicated_matmul_is_matmul(self):
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(5, 7)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(7, 3)), jnp.float32)
    got = jax.jit(linalg.replicated_matmul)(a, b)
    np.testing.assert_allclose(got, np.asarray(a) @ np.asarray(b), rtol=1e-5)

  def test_replicated_matmul_takes_matrices(self):
    with self.assertRaisesRegex(ValueError, "takes matrices"):
      linalg.replicated_matmul(jnp.ones((2, 3, 4)), jnp.ones((4, 2)))

  def test_long_side_spec_without_explicit_axes(self):
    self.assertIsNone(linalg.long_side_spec(jnp.ones((4, 8))))


if __name__ == "__main__":
  absltest.main()
