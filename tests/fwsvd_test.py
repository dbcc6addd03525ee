# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for ``fisher_weighted_svd`` and ``generalized_fwsvd``."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import fisher_optax
from fisher_optax import fisher
from tests import fisher_testing

N_IN, N_OUT = 7, 5


def _problem(seed=0):
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  w = fisher_testing.normal(k1, (N_IN, N_OUT), jnp.float64)
  fd = jnp.exp(fisher_testing.normal(k2, (N_IN, N_OUT), jnp.float64))
  ra = fisher_testing.normal(k3, (N_IN, 2 * N_IN), jnp.float64)
  rb = fisher_testing.normal(k4, (N_OUT, 2 * N_OUT), jnp.float64)
  return w, fd, ra @ ra.T / N_IN, rb @ rb.T / N_OUT


def _svd_r(x, r):
  u, s, vt = np.linalg.svd(np.asarray(x), full_matrices=False)
  return (u[:, :r] * s[:r]) @ vt[:r]


class FWSVDTest(parameterized.TestCase):
  @parameterized.parameters(
    ("in", False, "left"),
    ("out", False, "balanced"),
    ("in", True, "balanced"),
    ("out", True, "left"),
  )
  def test_uniform_fisher_is_truncated_svd(self, axis, two_sided, split):
    with jax.enable_x64(True):
      w, _, _, _ = _problem()
      a, b = fisher_optax.fisher_weighted_svd(
        w,
        3.0 * jnp.ones_like(w),
        2,
        weight_axis=axis,
        two_sided=two_sided,
        split=split,
      )
      self.assertEqual((a.shape, b.shape), ((N_IN, 2), (2, N_OUT)))
      np.testing.assert_allclose(a @ b, _svd_r(w, 2), atol=1e-10)

  @parameterized.product(axis=("in", "out"), two_sided=(False, True))
  def test_full_rank_reconstructs_and_is_weighted_optimum(
    self, axis, two_sided
  ):
    with jax.enable_x64(True):
      w, fd, _, _ = _problem(1)
      a, b = fisher_optax.fisher_weighted_svd(
        w, fd, N_OUT, weight_axis=axis, two_sided=two_sided
      )
      np.testing.assert_allclose(a @ b, w, atol=1e-10)
      # Rank 2: the closed-form weighted optimum, built here from scratch.
      rs, cs = np.asarray(fd).sum(1), np.asarray(fd).sum(0)
      r = np.sqrt(rs + 1e-5 * rs.mean())  # eps is relative to the mean
      c = np.sqrt(cs + 1e-5 * cs.mean())
      r = r if (two_sided or axis == "in") else np.ones_like(r)
      c = c if (two_sided or axis == "out") else np.ones_like(c)
      expected = _svd_r(r[:, None] * np.asarray(w) * c, 2) / r[:, None] / c
      a, b = fisher_optax.fisher_weighted_svd(
        w, fd, 2, weight_axis=axis, two_sided=two_sided
      )
      np.testing.assert_allclose(a @ b, expected, atol=1e-10)
      err = lambda x: np.sum((r[:, None] * c * (np.asarray(w) - x)) ** 2)
      self.assertLess(err(a @ b), err(_svd_r(w, 2)))

  def test_fisher_scale_is_irrelevant(self):
    with jax.enable_x64(True):
      w, fd, _, _ = _problem(2)
      ab1 = fisher_optax.fisher_weighted_svd(w, fd, 3, eps=0.0)
      ab2 = fisher_optax.fisher_weighted_svd(w, 1e4 * fd, 3, eps=0.0)
      np.testing.assert_allclose(ab1[0] @ ab1[1], ab2[0] @ ab2[1], atol=1e-10)

  @parameterized.parameters(
    ("in", False), ("out", False), ("in", True), ("out", True)
  )
  def test_default_eps_is_invariant_to_fisher_scale(self, axis, two_sided):
    # float32, and a Fisher far from uniform, so that an absolute eps
    # would drown the weighting at small scales (a plain SVD).
    w = jax.random.normal(jax.random.key(0), (8, 5))
    fd = jnp.exp(2.0 * jax.random.normal(jax.random.key(1), (8, 5)))
    fd = fd.at[0].mul(100.0).at[:, 1].mul(100.0)
    kw = {"weight_axis": axis, "two_sided": two_sided}
    prod = lambda ab: np.asarray(ab[0] @ ab[1])
    want = prod(fisher_optax.fisher_weighted_svd(w, fd, 2, eps=0.0, **kw))
    for scale in (1.0, 1e-8, 1e8):
      got = prod(fisher_optax.fisher_weighted_svd(w, scale * fd, 2, **kw))
      np.testing.assert_allclose(got, want, atol=2e-4, err_msg=f"{scale}")
    plain = _svd_r(w, 2)
    self.assertGreater(np.abs(want - plain).max(), 0.1)

  def test_all_zero_fisher_is_plain_svd(self):
    w = jax.random.normal(jax.random.key(0), (6, 4))
    for kw in ({}, {"weight_axis": "out"}, {"two_sided": True}):
      a, b = fisher_optax.fisher_weighted_svd(w, jnp.zeros_like(w), 2, **kw)
      np.testing.assert_allclose(a @ b, _svd_r(w, 2), atol=1e-5)

  def test_bfloat16_kernel_keeps_dtype(self):
    w = jnp.ones((4, 3), jnp.bfloat16)
    a, b = fisher_optax.fisher_weighted_svd(w, jnp.ones((4, 3)), 1)
    self.assertEqual((a.dtype, b.dtype), (jnp.bfloat16, jnp.bfloat16))

  def test_accepts_engine_diagonal_fisher(self):
    with jax.enable_x64(True):
      w, _, _, _ = _problem(6)
      g = fisher_testing.normal(
        jax.random.key(7), (9, N_IN, N_OUT), jnp.float64
      )
      stat = fisher.diagonal_from_grads(g)
      for kw in ({}, {"weight_axis": "out"}, {"two_sided": True}):
        got = fisher_optax.fisher_weighted_svd(w, stat, 2, **kw)
        want = fisher_optax.fisher_weighted_svd(w, stat.diag, 2, **kw)
        np.testing.assert_array_equal(got[0] @ got[1], want[0] @ want[1])
      several = fisher.diagonal_from_grads({"a": g, "b": g})
      with self.assertRaisesRegex(TypeError, "leaf of its .diag"):
        fisher_optax.fisher_weighted_svd(w, several, 2)

  def test_bad_inputs_raise(self):
    w = jnp.ones((4, 3))
    with self.assertRaisesRegex(ValueError, "rank must be <="):
      fisher_optax.fisher_weighted_svd(w, w, 4)
    with self.assertRaisesRegex(TypeError, "rank"):
      fisher_optax.fisher_weighted_svd(w, w, 2.0)
    with self.assertRaisesRegex(TypeError, "two_sided must be True or False"):
      fisher_optax.fisher_weighted_svd(w, w, 2, two_sided="no")
    with self.assertRaisesRegex(ValueError, "fisher_diag must have shape"):
      fisher_optax.fisher_weighted_svd(w, w.T, 2)
    with self.assertRaisesRegex(ValueError, "matrix"):
      fisher_optax.fisher_weighted_svd(jnp.ones(3), jnp.ones(3), 1)
    with self.assertRaisesRegex(ValueError, "weight_axis"):
      fisher_optax.fisher_weighted_svd(w, w, 2, weight_axis="rows")
    with self.assertRaisesRegex(ValueError, "left must have shape"):
      fisher_optax.generalized_fwsvd(w, jnp.eye(3), jnp.eye(3), 2)
    with self.assertRaisesRegex(ValueError, "right must have shape"):
      fisher_optax.generalized_fwsvd(w, jnp.eye(4), jnp.eye(4), 2)
    with self.assertRaisesRegex(ValueError, "eps must be a scalar"):
      fisher_optax.fisher_weighted_svd(w, w, 2, eps=jnp.full(4, 1e-5))
    with self.assertRaisesRegex(ValueError, "damping must be a scalar"):
      fisher_optax.generalized_fwsvd(
        w, jnp.eye(4), jnp.eye(3), 2, damping=jnp.full(3, 1e-6)
      )

  @parameterized.parameters(
    (np.nan, 1e-5, {}, "1 non-finite"),
    (np.inf, 1e-5, {"weight_axis": "out"}, "1 non-finite"),
    (-1.0, 1e-5, {}, "1 negative"),
    (0.0, 0.0, {}, r"input features .*\[1\] have zero total Fisher"),
    (0.0, 0.0, {"two_sided": True}, r"input features .*\[1\]"),
  )
  def test_bad_fisher_values_raise(self, value, eps, kw, pattern):
    w = jax.random.normal(jax.random.key(0), (4, 3))
    fd = jnp.ones((4, 3)).at[1].set(jnp.array([value, 0.0, 0.0]))
    with self.assertRaisesRegex(ValueError, f"fisher_diag.*{pattern}"):
      fisher_optax.fisher_weighted_svd(w, fd, 2, eps=eps, **kw)

  def test_zero_fisher_feature_with_eps_zero(self):
    w = jax.random.normal(jax.random.key(0), (4, 3))
    fd = jnp.ones((4, 3)).at[:, 2].set(0.0)
    with self.assertRaisesRegex(ValueError, r"output features .*\[2\]"):
      fisher_optax.fisher_weighted_svd(w, fd, 2, eps=0.0, weight_axis="out")
    # Unweighted features may have zero Fisher, and eps > 0 keeps them finite.
    for kw in ({"eps": 0.0}, {"eps": 1e-5, "weight_axis": "out"}):
      a, b = fisher_optax.fisher_weighted_svd(w, fd, 2, **kw)
      self.assertTrue(bool(jnp.all(jnp.isfinite(a @ b))))
    # Traced values cannot be checked: no error under jit.
    jax.jit(lambda f: fisher_optax.fisher_weighted_svd(w, f, 2))(-fd)


class GeneralizedFWSVDTest(parameterized.TestCase):
  def test_identity_factors_give_svd(self):
    with jax.enable_x64(True):
      w, _, _, _ = _problem(3)
      a, b = fisher_optax.generalized_fwsvd(w, jnp.eye(N_IN), jnp.eye(N_OUT), 3)
      np.testing.assert_allclose(a @ b, _svd_r(w, 3), atol=1e-10)

  def test_diagonal_factors_give_two_sided_fwsvd(self):
    with jax.enable_x64(True):
      w, fd, _, _ = _problem(4)
      rows, cols = fd.sum(1), fd.sum(0)
      a, b = fisher_optax.generalized_fwsvd(
        w, jnp.diag(rows), jnp.diag(cols), 2, damping=0.0
      )
      a2, b2 = fisher_optax.fisher_weighted_svd(
        w, fd, 2, two_sided=True, eps=0.0
      )
      np.testing.assert_allclose(a @ b, a2 @ b2, atol=1e-10)

  @parameterized.parameters(1, 2, 4)
  def test_optimal_in_the_kronecker_fisher_norm(self, rank):
    with jax.enable_x64(True):
      w, fd, fa, fb = _problem(5)
      a, b = fisher_optax.generalized_fwsvd(w, fa, fb, rank, damping=0.0)
      dense = np.kron(np.asarray(fa), np.asarray(fb))  # row-major vec(W)
      err = lambda x: (
        (np.asarray(w) - x).ravel() @ dense @ (np.asarray(w) - x).ravel()
      )
      # Dense reference: whiten with the symmetric square roots instead.
      sa = np.real(_sqrtm(np.asarray(fa)))
      sb = np.real(_sqrtm(np.asarray(fb)))
      ref = np.linalg.solve(sa, _svd_r(sa @ np.asarray(w) @ sb, rank)) @ (
        np.linalg.inv(sb)
      )
      np.testing.assert_allclose(err(a @ b), err(ref), rtol=1e-9)
      others = [
        _svd_r(w, rank),
        np.asarray(
          jnp.matmul(
            *fisher_optax.fisher_weighted_svd(w, fd, rank, two_sided=True)
          )
        ),
      ]
      for other in others:
        self.assertLess(err(a @ b), err(other))
      np.testing.assert_allclose(
        jnp.matmul(*fisher_optax.generalized_fwsvd(w, fa, fb, N_OUT)),
        w,
        atol=1e-9,
      )

  def test_default_damping_is_invariant_to_factor_scale(self):
    # The damping is relative to each factor's mean eigenvalue: an absolute
    # 1e-6 would swamp a 1e-9-scaled factor (a plain SVD on that side).
    with jax.enable_x64(True):
      w, _, fa, fb = _problem(9)
      prod = lambda ab: np.asarray(ab[0] @ ab[1])
      want = prod(fisher_optax.generalized_fwsvd(w, fa, fb, 2))
      for left, right in ((1e-9 * fa, fb), (fa, 1e-9 * fb), (1e9 * fa, fb)):
        got = prod(fisher_optax.generalized_fwsvd(w, left, right, 2))
        np.testing.assert_allclose(got, want, atol=1e-8)
      # The factors matter: the result is not the plain SVD.
      self.assertGreater(np.abs(want - _svd_r(w, 2)).max(), 0.1)

  def test_zero_factor_weighs_that_side_uniformly(self):
    with jax.enable_x64(True):
      problem = _problem(8)
    w, _, fa, fb = (jnp.asarray(np.asarray(x), jnp.float32) for x in problem)
    n_in, n_out = jnp.eye(N_IN), jnp.eye(N_OUT)
    prod = lambda ab: np.asarray(ab[0] @ ab[1])
    for left, right, want_left, want_right in (
      (jnp.zeros_like(fa), fb, n_in, fb),
      (fa, jnp.zeros_like(fb), fa, n_out),
      (jnp.zeros_like(fa), jnp.zeros_like(fb), n_in, n_out),
    ):
      got = prod(fisher_optax.generalized_fwsvd(w, left, right, 2))
      self.assertTrue(np.all(np.isfinite(got)))
      want = prod(fisher_optax.generalized_fwsvd(w, want_left, want_right, 2))
      np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(
      prod(fisher_optax.generalized_fwsvd(w, 0 * fa, 0 * fb, 2)),
      _svd_r(w, 2),
      atol=1e-5,
    )

  @parameterized.parameters(
    ("nan", 1e-6, "left has non-finite entries"),
    ("negative", 1e-6, "left is not positive semi-definite"),
    ("zero", 0.0, "left is not positive semi-definite.*damping > 0"),
    ("singular", 0.0, "left is not positive semi-definite.*damping > 0"),
  )
  def test_bad_factors_raise(self, kind, damping, pattern):
    w = jax.random.normal(jax.random.key(0), (6, 4))
    x = jax.random.normal(jax.random.key(1), (2, 6))
    left = {
      "nan": jnp.full((6, 6), jnp.nan),
      "negative": -jnp.eye(6),
      "zero": jnp.zeros((6, 6)),
      "singular": x.T @ x,  # rank 2
    }[kind]
    with self.assertRaisesRegex(ValueError, pattern):
      fisher_optax.generalized_fwsvd(w, left, jnp.eye(4), 2, damping=damping)
    with self.assertRaisesRegex(ValueError, pattern.replace("left", "right")):
      fisher_optax.generalized_fwsvd(w.T, jnp.eye(4), left, 2, damping=damping)
    # Traced values cannot be checked: NaN under jit, as documented.
    a, b = jax.jit(
      lambda f: fisher_optax.generalized_fwsvd(w, f, jnp.eye(4), 2, damping=0.0)
    )(left)
    self.assertTrue(bool(jnp.any(jnp.isnan(a @ b))))

  def test_accepts_engine_kronecker_factors(self):
    with jax.enable_x64(True):
      params = fisher_testing.mlp_params(
        jax.random.key(0), sizes=(4, 6, 3), dtype=jnp.float64
      )
      x = fisher_testing.normal(jax.random.key(1), (32, 4), jnp.float64)
      y = jnp.arange(32) % 3
      kron = jax.jit(
        lambda p, b: fisher.kronecker(
          fisher_testing.mlp_apply,
          p,
          b,
          likelihood=fisher.Categorical(),
          kind="exact",
          estimator="kfac",
        )
      )(params, (x, y))
      w = params["dense_0"]["kernel"]
      left, right = (
        kron.left["dense_0"]["kernel"],
        kron.right["dense_0"]["kernel"],
      )
      a, b = fisher_optax.generalized_fwsvd(w, left, right, 2)
      dense = np.kron(np.asarray(left), np.asarray(right))
      err = lambda z: (
        (np.asarray(w) - z).ravel() @ dense @ (np.asarray(w) - z).ravel()
      )
      self.assertLess(err(a @ b), err(_svd_r(w, 2)))


def _sqrtm(x):
  vals, vecs = np.linalg.eigh(x)
  return (vecs * np.sqrt(np.maximum(vals, 0.0))) @ vecs.T


if __name__ == "__main__":
  absltest.main()
