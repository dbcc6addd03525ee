# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for the shared numerics in ``fisher_optax.fisher.linalg`` and ``fisher_optax._matrix_roots``."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from fisher_optax import _matrix_roots
from fisher_optax.fisher import linalg


class StackedPushRowsTest(parameterized.TestCase):
  """The ring-buffer push keeps the cached Gram equal to a fresh one."""

  def _tree(self, key, m):
    k1, k2 = jax.random.split(key)
    return {
      "w": jax.random.normal(k1, (m, 3, 2)),
      "b": jax.random.normal(k2, (m, 4)),
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
      a = jax.random.normal(jax.random.key(0), (3, 6, 6), jnp.float64)
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


if __name__ == "__main__":
  absltest.main()


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

      diag = linalg.woodbury_inverse_diag(stacked, factor)
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


class MatrixRootsAndPolarTest(parameterized.TestCase):
  """Newton-Schulz polar factors and inverse roots (used by FISMO)."""

  def _spd(self, seed, n, batch=(), cond=50.0):
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=batch + (n, n)))
    evals = np.geomspace(1.0, 1.0 / cond, n)
    return (q * evals[..., None, :]) @ np.swapaxes(q, -1, -2)

  def test_newton_schulz_quintic_matches_optax_muon(self):
    from optax.contrib import _muon  # pylint: disable=g-import-not-at-top

    x = jax.random.normal(jax.random.key(0), (7, 5))
    for mat in (x, x.T):
      ours = jax.jit(_matrix_roots.newton_schulz_polar)(mat)
      ref = jax.jit(_muon.orthogonalize_via_newton_schulz)(
        mat, jnp.asarray(_matrix_roots.QUINTIC_NS_COEFFS)
      )
      chex.assert_trees_all_close(ours, ref, atol=1e-6)

  @parameterized.parameters(
    ((2.0, -1.5, 0.5), 20), (_matrix_roots.CUBIC_NS_COEFFS, 40)
  )
  def test_convergent_newton_schulz_is_svd_polar(self, coeffs, steps):
    with jax.enable_x64(True):
      rng = np.random.default_rng(1)
      u, _ = np.linalg.qr(rng.normal(size=(2, 6, 4)))
      v, _ = np.linalg.qr(rng.normal(size=(2, 4, 4)))
      s = np.array([1.0, 0.7, 0.4, 0.2])
      x = jnp.asarray((u * s) @ np.swapaxes(v, -1, -2))
      polar = _matrix_roots.newton_schulz_polar(x, coeffs, steps)
      want = u @ np.swapaxes(v, -1, -2)
      np.testing.assert_allclose(polar, want, atol=1e-8)
      # The transposed (wide) input goes through the same code path.
      np.testing.assert_allclose(
        _matrix_roots.newton_schulz_polar(
          jnp.swapaxes(x, -1, -2), coeffs, steps
        ),
        np.swapaxes(want, -1, -2),
        atol=1e-8,
      )

  def test_newton_schulz_per_step_schedule_and_bad_coeffs(self):
    x = jax.random.normal(jax.random.key(2), (4, 4))
    sched = (_matrix_roots.QUINTIC_NS_COEFFS,) * 3
    chex.assert_trees_all_close(
      _matrix_roots.newton_schulz_polar(x, sched, steps=99),
      _matrix_roots.newton_schulz_polar(
        x, _matrix_roots.QUINTIC_NS_COEFFS, steps=3
      ),
    )
    with self.assertRaisesRegex(ValueError, "coefficients"):
      _matrix_roots.newton_schulz_polar(x, (1.0, 2.0))

  @parameterized.parameters(1, 2, 4)
  def test_eigh_inverse_root(self, p):
    with jax.enable_x64(True):
      a = self._spd(3, 6, batch=(2,))
      root = _matrix_roots.matrix_inverse_root_eigh(
        jnp.asarray(a), p, floor=0.0
      )
      power = root
      for _ in range(p - 1):
        power = power @ root
      np.testing.assert_allclose(
        power @ a, np.broadcast_to(np.eye(6), a.shape), atol=1e-9
      )
      np.testing.assert_allclose(root, np.swapaxes(root, -1, -2), atol=1e-12)

  def test_eigh_floor_bounds_the_condition_number(self):
    with jax.enable_x64(True):
      a = jnp.diag(jnp.array([1.0, 1e-12, 0.0, -1e-9]))
      root = _matrix_roots.matrix_inverse_root_eigh(a, 2, floor=1e-4)
      mean = 0.25
      self.assertTrue(bool(jnp.all(jnp.isfinite(root))))
      self.assertAlmostEqual(
        float(jnp.max(root)), (1e-4 * mean) ** -0.5, places=6
      )

  @parameterized.parameters(1, 2, 4)
  def test_newton_cold_start_matches_eigh(self, p):
    a = jnp.asarray(self._spd(4, 8, batch=(3,)), jnp.float32)
    res = _matrix_roots.matrix_inverse_root_newton(a, p, floor=0.0, tol=1e-5)
    want = _matrix_roots.matrix_inverse_root_eigh(a, p, floor=0.0)
    self.assertTrue(bool(jnp.all(res.error <= 1e-5)))
    np.testing.assert_allclose(res.root, want, rtol=2e-4, atol=2e-4)

  def test_newton_warm_start_whitens_in_few_iterations(self):
    a = self._spd(5, 10, cond=100.0)
    b = a + 0.05 * self._spd(6, 10)  # the factor moved a little
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    cold = _matrix_roots.matrix_inverse_root_newton(b, 2, floor=0.0, tol=1e-5)
    old = _matrix_roots.matrix_inverse_root_eigh(a, 2, floor=0.0)
    warm = _matrix_roots.matrix_inverse_root_newton(
      b, 2, init=old, floor=0.0, tol=1e-5
    )
    self.assertLess(int(warm.iterations), int(cold.iterations))
    np.testing.assert_allclose(
      warm.root.T @ b @ warm.root, np.eye(10), atol=1e-4
    )
    with self.assertRaisesRegex(ValueError, "p=2"):
      _matrix_roots.matrix_inverse_root_newton(b, 4, init=old)

  def test_cholesky_whitening(self):
    with jax.enable_x64(True):
      a = jnp.asarray(self._spd(7, 5, batch=(2,)))
      w = _matrix_roots.cholesky_whitening(a, floor=0.0)
      eye = np.broadcast_to(np.eye(5), a.shape)
      np.testing.assert_allclose(
        jnp.swapaxes(w, -1, -2) @ a @ w, eye, atol=1e-10
      )
      np.testing.assert_allclose(
        w @ jnp.swapaxes(w, -1, -2), np.linalg.inv(a), rtol=1e-8, atol=1e-10
      )
      np.testing.assert_allclose(np.tril(w, -1), 0.0)


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
        "w": jax.random.normal(k1, (1, 4, 2)),
        "b": jax.random.normal(k2, (1, 3)),
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
