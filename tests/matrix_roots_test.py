# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for Newton-Schulz and the matrix roots (``_matrix_roots``)."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from fisher_optax import _matrix_roots


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

  def test_newton_schulz_traced_step_count(self):
    """An array count (inject_hyperparams) runs a loop of that many steps,
    the same iterations as the unrolled ones."""
    x = jax.random.normal(jax.random.key(2), (4, 6))
    polar = functools.partial(
      _matrix_roots.newton_schulz_polar, x, _matrix_roots.QUINTIC_NS_COEFFS
    )
    looped = jax.jit(polar)
    for n in (1, 3):
      chex.assert_trees_all_close(
        looped(jnp.asarray(n)), jax.jit(polar, static_argnums=0)(n), atol=1e-6
      )

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

  @parameterized.parameters(1, 2, 4)
  def test_newton_on_huge_matrices(self, p):
    # The power iteration's vector norms overflowed float32 at 1e20: the
    # scale fell back to 1 and the iteration diverged (error -inf). The
    # start is scaled by c^(-1/p) for every p.
    a = jnp.asarray(self._spd(4, 8, batch=(2,)), jnp.float32)
    for scale in (1e20, 1e-20, 1e3):
      with self.subTest(scale=scale):
        res = _matrix_roots.matrix_inverse_root_newton(a * scale, p, floor=0.0)
        want = _matrix_roots.matrix_inverse_root_eigh(a, p, floor=0.0)
        self.assertTrue(bool(jnp.all(res.error <= 1e-4)))
        np.testing.assert_allclose(
          res.root * scale ** (1.0 / p), want, rtol=1e-3, atol=1e-3
        )

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

  def test_newton_error_is_the_true_residual_at_p2(self):
    # The iteration's M drifts from H^T A H for nearly singular A; a caller
    # that keeps a root only when its error is small (FISMO) needs the
    # residual itself, and a diverged root must not read as converged.
    rng = np.random.default_rng(0)
    v = rng.normal(size=(32, 8))
    for floor in (1e-3, 1e-6):  # the second diverges in float32
      a = jnp.asarray(v @ v.T, jnp.float32)
      for init in (None, jnp.eye(32)):
        with self.subTest(floor=floor, warm=init is not None):
          res = _matrix_roots.matrix_inverse_root_newton(
            a, 2, init=init, floor=floor
          )
          h = np.asarray(res.root, np.float64)
          mean = np.trace(np.asarray(a, np.float64)) / 32
          ridged = np.asarray(a, np.float64) + floor * mean * np.eye(32)
          if np.all(np.isfinite(h)):
            residual = np.abs(h.T @ ridged @ h - np.eye(32)).max()
            np.testing.assert_allclose(
              float(res.error), residual, rtol=0.25, atol=1e-4
            )
          else:
            self.assertEqual(float(res.error), np.inf)

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


if __name__ == "__main__":
  absltest.main()
