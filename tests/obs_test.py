# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for OBS pruning (``obs_saliency``, ``group_obs_update``, ``obs_prune``)."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import fisher_optax
from fisher_optax import fisher

M = 7


def _setup(
  seed=0, block_size=None, damping=1e-2, dtype=jnp.float64, fisher_dtype=None
):
  """Stacked grads, weights and the dense float64 Fisher (call under x64);
  the factor from the grads cast to ``fisher_dtype`` when given."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  grads = {
    "b": jax.random.normal(k1, (M, 4), dtype),
    "w": jax.random.normal(k2, (M, 2, 3), dtype),
  }
  params = {
    "b": jax.random.normal(k3, (4,), dtype),
    "w": jnp.linspace(-1.0, 1.5, 6, dtype=dtype).reshape(2, 3),
  }
  g = np.concatenate(
    [np.asarray(grads["b"]), np.asarray(grads["w"]).reshape(M, -1)], axis=1
  )
  dense = damping * np.eye(10) + g.T @ g / M
  if block_size is not None:
    mask = np.zeros_like(dense)
    for s in range(0, 10, block_size):
      mask[s : s + block_size, s : s + block_size] = 1.0
    dense = dense * mask
  if fisher_dtype is not None:
    grads = jax.tree.map(lambda x: x.astype(fisher_dtype), grads)
  f = fisher.sum_of_rank_one(grads, damping, block_size=block_size)
  return params, f, dense


def _flat(tree):
  return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(tree)])


class ObsTest(parameterized.TestCase):
  @parameterized.parameters(None, 3)
  def test_saliency_matches_dense(self, block_size):
    with jax.enable_x64(True):
      params, f, dense = _setup(block_size=block_size)
      inv = np.linalg.inv(dense)
      w = _flat(params)
      np.testing.assert_allclose(
        _flat(fisher_optax.obs_saliency(params, f)),
        w**2 / (2 * np.diag(inv)),
        rtol=1e-9,
      )

  @parameterized.parameters(0, 9)
  def test_single_weight_update_is_exact(self, q):
    with jax.enable_x64(True):
      params, f, dense = _setup(1)
      inv = np.linalg.inv(dense)
      w = _flat(params)
      new, dl = fisher_optax.group_obs_update(params, jnp.array([q]), f)
      new = _flat(new)
      self.assertEqual(new[q], 0.0)  # exactly zero
      expected = w - w[q] / inv[q, q] * inv[:, q]
      np.testing.assert_allclose(new, expected, rtol=1e-9, atol=1e-12)
      dw = new - w
      rho = w[q] ** 2 / (2 * inv[q, q])
      np.testing.assert_allclose(0.5 * dw @ dense @ dw, rho, rtol=1e-9)
      np.testing.assert_allclose(dl, rho, rtol=1e-9)

  @parameterized.parameters(
    *[(u, None, jnp.float16, 1e-5) for u in ("group", "independent")],
    *[(u, 4, jnp.float64, 1e-2) for u in ("group", "independent")],
  )
  def test_params_dtype_narrower_or_wider_than_the_fishers(
    self, update, block_size, dtype, damping
  ):
    # float16 weights: 1/damping overflows float16, so the products must run
    # in the Fisher's dtype. float64 weights under a float32 Fisher: the
    # blocks the removed weight does not touch keep every digit.
    with jax.enable_x64(True):
      params, f32, dense = _setup(
        2, block_size, damping, fisher_dtype=jnp.float32
      )
      params = jax.tree.map(lambda w: (w + 1e-12).astype(dtype), params)
      drop = jnp.array([0])
      if update == "group":
        new, _ = fisher_optax.group_obs_update(params, drop, f32)
      else:
        mask = jnp.zeros(10, bool).at[drop].set(True)
        new, _ = fisher_optax._obs._independent_update(params, mask, f32)
      jax.tree.map(lambda n, p: self.assertEqual(n.dtype, p.dtype), new, params)
      new, w = _flat(new).astype(np.float64), _flat(params).astype(np.float64)
      self.assertTrue(np.all(np.isfinite(new)))
      inv = np.linalg.inv(dense)
      want = w - w[0] / inv[0, 0] * inv[:, 0]
      np.testing.assert_allclose(new, want, rtol=1e-2, atol=1e-2)
      if block_size is not None:
        np.testing.assert_array_equal(new[block_size:], w[block_size:])

  @parameterized.parameters(None, 3)
  def test_group_beats_independent_beats_zeroing(self, block_size):
    with jax.enable_x64(True):
      params, f, dense = _setup(2, block_size=block_size)
      inv = np.linalg.inv(dense)
      w = _flat(params)
      q = np.array([1, 2, 6, 8])
      drop = jax.tree.map(lambda x: jnp.zeros(x.shape, bool), params)
      drop = {
        "b": drop["b"].at[jnp.array([1, 2])].set(True),
        "w": drop["w"].at[0, 2].set(True).at[1, 1].set(True),
      }
      new, dl = fisher_optax.group_obs_update(params, drop, f)
      dw_group = _flat(new) - w
      np.testing.assert_array_equal(_flat(new)[q], 0.0)
      expected = -inv[:, q] @ np.linalg.solve(inv[np.ix_(q, q)], w[q])
      np.testing.assert_allclose(dw_group, expected, rtol=1e-8, atol=1e-12)
      loss = lambda dw: 0.5 * dw @ dense @ dw
      np.testing.assert_allclose(loss(dw_group), dl, rtol=1e-8)
      dw_indep = -sum(w[j] / inv[j, j] * inv[:, j] for j in q)
      dw_indep[q] = -w[q]
      dw_zero = np.zeros_like(w)
      dw_zero[q] = -w[q]
      self.assertLessEqual(loss(dw_group), loss(dw_indep) * (1 + 1e-12))
      self.assertLessEqual(loss(dw_indep), loss(dw_zero))
      # The index form agrees with the mask form, also under jit.
      new_idx, _ = jax.jit(fisher_optax.group_obs_update)(
        params, jnp.asarray(q), f
      )
      np.testing.assert_allclose(_flat(new_idx), _flat(new), rtol=1e-10)

  def test_bad_inputs_raise(self):
    params, f, _ = _setup(dtype=jnp.float32)
    with self.assertRaisesRegex(ValueError, "tree structure"):
      fisher_optax.obs_saliency({"w": params["w"]}, f)
    with self.assertRaisesRegex(ValueError, "shape"):
      fisher_optax.obs_saliency({"b": params["b"], "w": params["w"].T}, f)
    with self.assertRaisesRegex(ValueError, "drop"):
      fisher_optax.group_obs_update(params, {"w": params["w"] > 0}, f)
    # A mask of another shape would name other weights.
    wrong = {"b": params["b"] > 0, "w": (params["w"] > 0).reshape(-1)}
    with self.assertRaisesRegex(ValueError, r"drop\['w'\] has shape"):
      fisher_optax.group_obs_update(params, wrong, f)
    with self.assertRaisesRegex(ValueError, "1-D integer"):
      fisher_optax.group_obs_update(params, np.array([[0, 2]]), f)
    traced_mask = jax.jit(
      lambda p: fisher_optax.group_obs_update(
        p, jax.tree.map(lambda x: x > 0, p), f
      )
    )
    with self.assertRaisesRegex(TypeError, "concrete"):
      traced_mask(params)

  def test_flat_indices_as_a_list(self):
    params, f, _ = _setup(dtype=jnp.float32)
    from_list = fisher_optax.group_obs_update(params, [0, 2], f)
    from_array = fisher_optax.group_obs_update(params, np.array([0, 2]), f)
    chex.assert_trees_all_equal(from_list, from_array)

  @parameterized.parameters(
    ([10], r"in \[0, 10\).*\[10\]"),
    ([3, -1], r"in \[0, 10\).*\[-1\]"),
    ([2, 5, 2], r"unique.*\[2\]"),
  )
  def test_bad_flat_indices_raise(self, index, pattern):
    params, f, _ = _setup(dtype=jnp.float32)
    for as_array in (jnp.asarray, np.asarray):
      with self.assertRaisesRegex(ValueError, pattern):
        fisher_optax.group_obs_update(params, as_array(index), f)


class ObsPruneTest(parameterized.TestCase):
  def _regression(self, seed=0, n=256, d=12):
    """Least squares with correlated features: grads are exact, Fisher = X^T X."""
    kx, kw, kn = jax.random.split(jax.random.key(seed), 3)
    base = jax.random.normal(kx, (n, d // 2))
    x = jnp.concatenate(
      [base, base + 0.3 * jax.random.normal(kn, (n, d // 2))], axis=1
    )
    w_true = jax.random.normal(kw, (d,))
    y = x @ w_true
    params = {"w": w_true, "b": jnp.zeros(())}
    loss = lambda p: 0.5 * jnp.mean(jnp.square(x @ p["w"] + p["b"] - y))

    def grad_fn(p, step):  # per-example residual gradients at the weights
      del step
      r = x @ p["w"] + p["b"] - y
      return {"w": r[:, None] * x, "b": r}

    def fisher_grad_fn(p, step):  # per-example "output" gradients: g_n = x_n
      del p, step
      return {"w": x, "b": jnp.ones((n,))}

    return params, loss, grad_fn, fisher_grad_fn

  @parameterized.parameters("global", "per_leaf")
  def test_reaches_sparsity_and_masks_match(self, scope):
    params = {
      "a": jnp.arange(1.0, 13.0).reshape(3, 4),
      "c": jnp.arange(5.0),
      "skip": jnp.ones(3),
    }
    grad_fn = lambda p, s: jax.tree.map(
      lambda x: jax.random.normal(jax.random.key(s), (9, *x.shape)), p
    )
    res = fisher_optax.obs_prune(
      params,
      grad_fn,
      0.5,
      prunable={"a": True, "c": True, "skip": False},
      scope=scope,
      steps=3,
      block_size=4,
      damping=1e-1,
    )
    kept = {k: int(v.sum()) for k, v in res.masks.items()}
    if scope == "global":
      self.assertEqual(kept["a"] + kept["c"], 9)  # 0.5 * 17, halves up
    else:
      self.assertEqual((kept["a"], kept["c"]), (6, 3))
    self.assertEqual(kept["skip"], 3)
    np.testing.assert_array_equal(res.params["skip"], params["skip"])
    for k in ("a", "c"):
      np.testing.assert_array_equal(res.params[k][~res.masks[k]], 0.0)
    self.assertEqual(res.predicted_loss_increase.shape, (3,))

  @parameterized.parameters("independent", "group")
  def test_obs_beats_magnitude_on_correlated_regression(self, update):
    params, loss, _, fisher_grad_fn = self._regression()
    prunable = {"w": True, "b": False}
    mag = fisher_optax.magnitude_prune(params, 0.5, prunable=prunable)
    obs = fisher_optax.obs_prune(
      params,
      fisher_grad_fn,
      0.5,
      prunable=prunable,
      steps=4,
      block_size=None,
      damping=1e-4,
      update=update,
    )
    self.assertEqual(int(obs.masks["w"].sum()), int(mag.masks["w"].sum()))
    self.assertLess(float(loss(obs.params)), 0.5 * float(loss(mag.params)))
    # The quadratic model is exact here: predicted = realised increase.
    if update == "group":
      np.testing.assert_allclose(
        float(jnp.sum(obs.predicted_loss_increase)),
        float(loss(obs.params)),
        rtol=1e-2,
      )

  def test_independent_reports_the_applied_steps_loss(self):
    # Correlated weights: the sum of single-weight saliencies misses the
    # cross terms; the reported value is 0.5 dw^T F dw of the applied step.
    rng = np.random.default_rng(0)
    g = rng.normal(size=(16, 8))
    g[:, 1] = g[:, 0] + 0.1 * g[:, 1]
    with jax.enable_x64(True):
      w = jnp.asarray(rng.normal(size=8))
      for block_size in (None, 4):
        dense = 1e-2 * np.eye(8) + g.T @ g / 16
        if block_size:
          dense *= np.kron(np.eye(2), np.ones((4, 4)))
        for update in ("independent", "group", "none"):
          res = fisher_optax.obs_prune(
            {"w": w},
            lambda p, s: {"w": jnp.asarray(g)},
            0.5,
            steps=1,
            block_size=block_size,
            damping=1e-2,
            update=update,
          )
          dw = np.asarray(res.params["w"]) - np.asarray(w)
          np.testing.assert_allclose(
            res.predicted_loss_increase[0], 0.5 * dw @ dense @ dw, rtol=1e-5
          )

  def test_non_floating_leaves_pass_through(self):
    params = {
      "w": jnp.array([5.0, 6.0, 7.0, 8.0]),
      "step": jnp.array(1, jnp.int32),
      "ids": jnp.array([0, 1, 2], jnp.int32),
    }

    def grad_fn(p, s):
      return jax.tree.map(
        lambda x: jax.random.normal(jax.random.key(s), (8, *x.shape)).astype(
          x.dtype
        ),
        p,
      )

    for res in (
      fisher_optax.magnitude_prune(params, 0.5),
      fisher_optax.obs_prune(
        params, grad_fn, 0.5, steps=1, block_size=None, damping=1e-2
      ),
    ):
      self.assertEqual(int(res.masks["w"].sum()), 2)  # ints are not counted
      for k in ("step", "ids"):
        np.testing.assert_array_equal(res.params[k], params[k])
        self.assertEqual(res.params[k].dtype, jnp.int32)
        self.assertTrue(bool(jnp.all(res.masks[k])))

  def test_no_prunable_leaf_raises(self):
    grad_fn = lambda p, s: jax.tree.map(lambda x: jnp.ones((3, *x.shape)), p)
    for params, prunable in (
      ({"a": jnp.ones(4), "b": jnp.ones(2)}, {"a": False, "b": False}),
      ({"step": jnp.array(3)}, None),
    ):
      with self.assertRaisesRegex(ValueError, "No prunable leaf"):
        fisher_optax.magnitude_prune(params, 0.5, prunable=prunable)
      with self.assertRaisesRegex(ValueError, "No prunable leaf"):
        fisher_optax.obs_prune(params, grad_fn, 0.5, prunable=prunable)

  def test_negative_scores_and_nan_weights_raise(self):
    # Unblocked, one gradient fewer than weights: the span covers all but
    # one direction, and float32 rounding of (I - Z^T Z) / damping makes an
    # entry of the inverse diagonal negative; it was pruned first.
    g = 10.0 * np.random.default_rng(0).normal(size=(63, 64))
    grad_fn = lambda p, s: {"w": jnp.asarray(g, jnp.float32)}
    params = {"w": jnp.ones(64)}
    with self.assertRaisesRegex(ValueError, "weights have negative or NaN"):
      fisher_optax.obs_prune(
        params, grad_fn, 0.5, block_size=None, damping=1e-6
      )
    # A NaN weight sorts last by magnitude or score: it was never pruned.
    params = {"w": jnp.array([1.0, jnp.nan, 2.0, 3.0])}
    for prune in (
      lambda: fisher_optax.magnitude_prune(params, 0.5),
      lambda: fisher_optax.obs_prune(
        params, lambda p, s: {"w": g[:3, :4]}, 0.5
      ),
    ):
      with self.assertRaisesRegex(ValueError, r"params\['w'\] hold NaN"):
        prune()

  def test_magnitude_prune_removes_smallest(self):
    res = fisher_optax.magnitude_prune(
      {"a": jnp.array([3.0, -0.5, 2.0]), "b": jnp.array([-0.1, 4.0])}, 0.4
    )
    np.testing.assert_array_equal(res.params["a"], [3.0, 0.0, 2.0])
    np.testing.assert_array_equal(res.params["b"], [0.0, 4.0])

  def test_kept_counts_round_halves_up_and_keep_one(self):
    def kept(n, sparsity, scope="per_leaf"):
      w = {"w": jnp.arange(1.0, n + 1.0), "e": jnp.zeros((0,))}
      res = fisher_optax.magnitude_prune(w, sparsity, scope=scope)
      self.assertEqual(res.params["e"].shape, (0,))
      return int(res.masks["w"].sum())

    # (1 - sparsity) n to the nearest count, ties kept, and never zero.
    for n, sparsity, want in [
      (1, 0.5, 1),
      (3, 0.5, 2),
      (5, 0.5, 3),
      (17, 0.5, 9),
      (10, 0.99, 1),
      (10, 0.94, 1),
      (10, 0.96, 1),
      (10, 0.0, 10),
      (10, 0.26, 7),
    ]:
      for scope in ("per_leaf", "global"):
        with self.subTest(n=n, sparsity=sparsity, scope=scope):
          self.assertEqual(kept(n, sparsity, scope), want)

  def test_bad_inputs_raise(self):
    params = {"w": jnp.ones(4)}
    grad_fn = lambda p, s: {"w": jnp.ones((3, 4))}
    with self.assertRaisesRegex(ValueError, "sparsity"):
      fisher_optax.obs_prune(params, grad_fn, 1.0)
    with self.assertRaisesRegex(TypeError, "sparsity"):
      fisher_optax.obs_prune(params, grad_fn, jnp.array(0.5))
    with self.assertRaisesRegex(TypeError, "steps"):
      fisher_optax.obs_prune(params, grad_fn, 0.5, steps=2.0)
    with self.assertRaisesRegex(ValueError, "scope"):
      fisher_optax.obs_prune(params, grad_fn, 0.5, scope="layer")
    with self.assertRaisesRegex(ValueError, "update"):
      fisher_optax.obs_prune(params, grad_fn, 0.5, update="fancy")
    with self.assertRaisesRegex(ValueError, "grad_fn output"):
      fisher_optax.obs_prune(params, lambda p, s: {"w": jnp.ones((3, 5))}, 0.5)
    with self.assertRaisesRegex(ValueError, "scope"):
      fisher_optax.magnitude_prune(params, 0.5, scope="x")

  def test_non_finite_gradients_raise_before_pruning(self):
    # LAPACK's Cholesky on an Inf matrix may return garbage or never end on
    # XLA:CPU: obs_prune must refuse the step, naming it.
    params = {"w": jnp.arange(1.0, 9.0)}
    for value in (jnp.nan, jnp.inf, -jnp.inf, 1e30):
      grad_fn = lambda p, s, v=value: {
        "w": jnp.ones((4, 8)).at[0, 7].set(v if s == 1 else 1.0)
      }
      for update in ("independent", "group"):
        with self.assertRaisesRegex(ValueError, "step 2: .*not finite"):
          fisher_optax.obs_prune(
            params, grad_fn, 0.5, steps=2, block_size=None, update=update
          )


if __name__ == "__main__":
  absltest.main()
