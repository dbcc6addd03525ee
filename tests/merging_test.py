# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for Fisher merging (fisher_merge, the accumulator, weight search)."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import fisher_optax
from fisher_optax import _merging


def _tree(key, dtype=jnp.float32):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
    "dense": {
      "kernel": jax.random.normal(k1, (3, 4), dtype),
      "bias": jax.random.normal(k2, (4,), dtype),
    },
    "head": jax.random.normal(k3, (4, 2), dtype),
  }


def _fisher(key, like, zero_frac=0.0):
  leaves, treedef = jax.tree.flatten(like)
  keys = jax.random.split(key, 2 * len(leaves))
  out = []
  for i, x in enumerate(leaves):
    f = jax.random.exponential(keys[2 * i], x.shape, jnp.float32)
    drop = jax.random.uniform(keys[2 * i + 1], x.shape) < zero_frac
    out.append(jnp.where(drop, 0.0, f))
  return treedef.unflatten(out)


def _models(k, seed=0, zero_frac=0.0):
  keys = jax.random.split(jax.random.key(seed), 2 * k)
  params = [_tree(keys[i]) for i in range(k)]
  fishers = [_fisher(keys[k + i], params[0], zero_frac) for i in range(k)]
  return params, fishers


def _reference(params, fishers, weights, floor, floor_mode, target):
  """Explicit float64 formula (numpy), leaf by leaf."""

  def leaf(*args):
    k = len(args) // 2
    thetas = [np.asarray(a, np.float64) for a in args[:k]]
    fs = [np.asarray(f, np.float64) for f in args[k:]]
    num = np.zeros_like(thetas[0])
    den = np.zeros_like(thetas[0])
    for i in range(k):
      f = fs[i]
      if floor_mode == "all" or i == target:
        f = np.maximum(f, floor)
      num += weights[i] * f * thetas[i]
      den += weights[i] * f
    return np.where(den > 0, num / np.where(den > 0, den, 1), thetas[target])

  return jax.tree.map(leaf, *params, *fishers)


class FisherMergeTest(parameterized.TestCase):
  def test_identical_models_return_that_model(self):
    params, fishers = _models(3, zero_frac=0.3)
    same = [params[0]] * 3
    merged = jax.jit(fisher_optax.fisher_merge)(
      same, fishers, jnp.array([0.2, 0.5, 0.3])
    )
    chex.assert_trees_all_equal(merged, params[0])

  def test_equal_fishers_give_weighted_average(self):
    params, fishers = _models(3)
    weights = np.array([0.2, 0.3, 0.5], np.float32)
    merged = jax.jit(fisher_optax.fisher_merge)(
      params, [fishers[0]] * 3, weights
    )
    expected = jax.tree.map(
      lambda *xs: sum(w * x for w, x in zip(weights, xs)), *params
    )
    chex.assert_trees_all_close(merged, expected, rtol=1e-5, atol=1e-6)
    # fishers=None is the plain weighted average too.
    plain = fisher_optax.fisher_merge(params, None, weights)
    chex.assert_trees_all_close(plain, expected, rtol=1e-5, atol=1e-6)

  def test_weights_are_scale_invariant(self):
    params, fishers = _models(3, zero_frac=0.3)
    w = jnp.array([0.1, 0.6, 0.3])
    merge = jax.jit(fisher_optax.fisher_merge)
    chex.assert_trees_all_close(
      merge(params, fishers, w),
      merge(params, fishers, 37.0 * w),
      rtol=1e-6,
      atol=1e-6,
    )

  def test_extreme_weights_and_fishers_give_the_same_merge(self):
    models = [{"w": jnp.zeros(2)}, {"w": jnp.ones(2)}]
    fishers = [{"w": jnp.array([1.0, 1.0])}, {"w": jnp.array([3.0, 1.0])}]
    want = np.array([0.75, 0.5])
    merge = fisher_optax.fisher_merge
    for w in (2e38, 1e20, 1e-30):
      weights = jnp.array([w, w])
      np.testing.assert_allclose(merge(models, fishers, weights)["w"], want)
      np.testing.assert_allclose(
        jax.jit(merge)(models, fishers, weights)["w"], want
      )
    # Below float32's smallest normal number: the device flushed them to
    # zero and the merge returned the target.
    for weights in ([1e-38, 1e-38], np.array([1e-45, 1e-45]), (1e-40, 1e-40)):
      np.testing.assert_allclose(merge(models, fishers, weights)["w"], want)
    # w_i F_i = 1e40 would overflow float32.
    big = [jax.tree.map(lambda f: 1e20 * f, f) for f in fishers]
    np.testing.assert_allclose(
      merge(models, big, jnp.array([1e20, 1e20]))["w"], want
    )
    # The default (equal) weights are scaled as given ones: Fishers whose
    # sum overflows at weight 1 merge as with weights [1, 1].
    huge = [jax.tree.map(lambda f: 1e38 * f, f) for f in fishers]
    np.testing.assert_allclose(merge(models, huge)["w"], want)
    np.testing.assert_allclose(jax.jit(merge)(models, huge)["w"], want)

  def test_weight_gradient_is_exact_at_any_scale(self):
    models = [{"w": jnp.array([0.0, 2.0])}, {"w": jnp.array([1.0, 0.0])}]
    fishers = [{"w": jnp.array([1.0, 2.0])}, {"w": jnp.array([3.0, 1.0])}]
    f = np.array([[1.0, 2.0], [3.0, 1.0]])
    theta = np.array([[0.0, 2.0], [1.0, 0.0]])
    for scale in (1.0, 1e30):
      w = scale * np.array([0.4, 0.6])
      jac = jax.jacobian(
        lambda w: fisher_optax.fisher_merge(models, fishers, w)["w"]
      )(jnp.asarray(w, jnp.float32))
      den = w @ f
      merged = (w[:, None] * f * theta).sum(0) / den
      want = (f * (theta - merged) / den).T  # d merged_j / d w_i
      np.testing.assert_allclose(jac, want, rtol=1e-5)

  @parameterized.parameters("all", "target")
  def test_all_zero_fisher_coordinate_follows_floor_mode(self, floor_mode):
    params, fishers = _models(2, seed=1)
    zero = jax.tree.map(jnp.zeros_like, fishers[0])
    weights = jnp.array([0.25, 0.75])
    merged = fisher_optax.fisher_merge(
      params, [zero, zero], weights, floor_mode=floor_mode, target_index=1
    )
    if floor_mode == "all":
      expected = jax.tree.map(
        lambda a, b: 0.25 * a + 0.75 * b, params[0], params[1]
      )
    else:
      expected = params[1]
    chex.assert_trees_all_close(merged, expected, rtol=1e-6, atol=1e-6)

  def test_target_mode_only_floors_the_target(self):
    params, fishers = _models(2, seed=2)
    # Model 1 has zero Fisher but a big weight; with "target" it is ignored.
    zero = jax.tree.map(jnp.zeros_like, fishers[0])
    merged = fisher_optax.fisher_merge(
      params, [fishers[0], zero], jnp.array([1e-3, 1.0]), floor_mode="target"
    )
    chex.assert_trees_all_close(merged, params[0], rtol=1e-6, atol=1e-6)

  def test_result_in_convex_hull(self):
    params, fishers = _models(4, seed=3, zero_frac=0.5)
    merged = fisher_optax.fisher_merge(
      params, fishers, jnp.array([0.1, 0.2, 0.3, 0.4]), fisher_floor=0.0
    )
    lo = jax.tree.map(lambda *xs: jnp.min(jnp.stack(xs), 0), *params)
    hi = jax.tree.map(lambda *xs: jnp.max(jnp.stack(xs), 0), *params)
    for m, a, b in zip(*map(jax.tree.leaves, (merged, lo, hi))):
      self.assertTrue(bool(jnp.all((a <= m) & (m <= b))))

  @parameterized.parameters(
    ("all", 0, False),
    ("target", 2, False),
    ("all", 2, True),
    ("target", 0, True),
  )
  def test_matches_float64_reference(self, floor_mode, target, normalize):
    params, fishers = _models(3, seed=4, zero_frac=0.3)
    weights = np.array([0.5, 0.2, 0.3])
    ref_weights = weights
    if normalize:
      norms = [
        np.sqrt(
          sum(
            np.sum(np.asarray(f, np.float64) ** 2) for f in jax.tree.leaves(fi)
          )
        )
        for fi in fishers
      ]
      ref_weights = weights / np.array(norms)
    with jax.enable_x64(True):
      p64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params)
      f64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), fishers)
      merged = jax.jit(
        lambda p, f, w: fisher_optax.fisher_merge(
          p,
          f,
          w,
          1e-3,
          floor_mode=floor_mode,
          target_index=target,
          normalize=normalize,
        )
      )(p64, f64, jnp.asarray(weights))
      expected = _reference(
        params, fishers, ref_weights, 1e-3, floor_mode, target
      )
      chex.assert_trees_all_close(merged, expected, rtol=1e-12, atol=1e-12)
    merged32 = fisher_optax.fisher_merge(
      params,
      fishers,
      weights,
      1e-3,
      floor_mode=floor_mode,
      target_index=target,
      normalize=normalize,
    )
    chex.assert_trees_all_close(merged32, expected, rtol=2e-5, atol=2e-5)

  def test_normalize_removes_fisher_scale(self):
    params, fishers = _models(2, seed=5)
    scaled = [fishers[0], jax.tree.map(lambda f: 1e4 * f, fishers[1])]
    a = fisher_optax.fisher_merge(
      params, fishers, normalize=True, fisher_floor=0.0
    )
    b = fisher_optax.fisher_merge(
      params, scaled, normalize=True, fisher_floor=0.0
    )
    chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-6)

  @parameterized.parameters(1e-30, 1e-20, 1e30)
  def test_normalize_handles_tiny_and_huge_fishers(self, scale):
    # The squared norm of these Fishers under- or overflows float32.
    models = [{"w": jnp.zeros(4)}, {"w": jnp.ones(4)}]
    f = jnp.array([1.0, 2.0, 3.0, 4.0])
    merged = fisher_optax.fisher_merge(
      models, [{"w": scale * f}, {"w": f}], normalize=True, fisher_floor=0.0
    )
    np.testing.assert_allclose(merged["w"], np.full(4, 0.5), rtol=1e-6)
    acc = fisher_optax.fisher_merge_accumulator(0.0, normalize=True)
    state = acc.add(acc.init(models[0], {"w": scale * f}), models[1], {"w": f})
    np.testing.assert_allclose(acc.finalize(state)["w"], merged["w"])

  def test_merge_mask_and_integer_leaves_come_from_target(self):
    params, fishers = _models(2, seed=6)
    params = [
      dict(p, step=jnp.array(i, jnp.int32)) for i, p in enumerate(params)
    ]
    fishers = [dict(f, step=jnp.zeros((), jnp.float32)) for f in fishers]
    mask = {"dense": True, "head": False, "step": True}
    merged = fisher_optax.fisher_merge(
      params, fishers, merge_mask=mask, target_index=1
    )
    chex.assert_trees_all_equal(merged["head"], params[1]["head"])
    chex.assert_trees_all_equal(merged["step"], params[1]["step"])
    full = fisher_optax.fisher_merge(params, fishers, target_index=1)
    chex.assert_trees_all_equal(merged["dense"], full["dense"])
    # A callable mask gives the same.
    by_fn = fisher_optax.fisher_merge(
      params,
      fishers,
      target_index=1,
      merge_mask=lambda p: jax.tree.map(lambda _: True, p) | {"head": False},
    )
    chex.assert_trees_all_equal(by_fn, merged)

  def test_weight_sweep_is_one_vmap(self):
    params, fishers = _models(2, seed=7)
    grid = jnp.asarray(fisher_optax.merge_weight_candidates(2, 5))
    sweep = jax.jit(
      jax.vmap(lambda w: fisher_optax.fisher_merge(params, fishers, w))
    )(grid)
    for i in range(5):
      one = fisher_optax.fisher_merge(params, fishers, grid[i])
      chex.assert_trees_all_close(
        jax.tree.map(lambda x, i=i: x[i], sweep), one, rtol=1e-5, atol=1e-6
      )
    # grid[0] = (0, 1): model 1 exactly; grid[-1] = (1, 0): model 0.
    chex.assert_trees_all_close(
      jax.tree.map(lambda x: x[0], sweep), params[1], rtol=1e-6
    )
    chex.assert_trees_all_close(
      jax.tree.map(lambda x: x[-1], sweep), params[0], rtol=1e-6
    )

  @parameterized.parameters(jnp.bfloat16, jnp.float16, jnp.float32)
  def test_keeps_dtype_and_computes_in_float32(self, dtype):
    params, fishers = _models(2, seed=8)
    low = [jax.tree.map(lambda x: x.astype(dtype), p) for p in params]
    merged = jax.jit(fisher_optax.fisher_merge)(low, fishers)
    chex.assert_trees_all_equal_dtypes(merged, low[0])
    expected = fisher_optax.fisher_merge(
      [jax.tree.map(lambda x: x.astype(jnp.float32), p) for p in low], fishers
    )
    chex.assert_trees_all_close(
      merged, jax.tree.map(lambda x: x.astype(dtype), expected)
    )

  def test_nnx_state_and_eval_shape(self):
    model_a = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    model_b = nnx.Linear(3, 2, rngs=nnx.Rngs(1))
    sa, sb = nnx.state(model_a, nnx.Param), nnx.state(model_b, nnx.Param)
    fa = jax.tree.map(jnp.ones_like, sa)
    merged = jax.jit(fisher_optax.fisher_merge)([sa, sb], [fa, fa])
    self.assertEqual(jax.tree.structure(merged), jax.tree.structure(sa))
    chex.assert_trees_all_close(
      jax.tree.leaves(merged),
      jax.tree.leaves(jax.tree.map(lambda a, b: (a + b) / 2, sa, sb)),
    )
    shapes = jax.eval_shape(fisher_optax.fisher_merge, [sa, sb], [fa, fa])
    chex.assert_trees_all_equal_shapes_and_dtypes(shapes, sa)

  def test_rng_keys_in_the_state_come_from_the_target(self):
    # A whole nnx.state with dropout holds a typed PRNG key (and a uint32
    # counter): not merged, taken from the target, still typed.
    def model(seed):
      class Net(nnx.Module):
        def __init__(self, rngs):
          self.lin = nnx.Linear(3, 2, rngs=rngs)
          self.drop = nnx.Dropout(0.5, rngs=rngs)

      return Net(nnx.Rngs(seed))

    states = [nnx.as_pure(nnx.state(model(i))) for i in range(2)]
    fishers = [jax.tree.map(lambda x: jnp.ones(x.shape), s) for s in states]
    plain = functools.partial(fisher_optax.fisher_merge, target_index=1)
    for merge in (plain, jax.jit(plain)):
      merged = merge(states, fishers)
      key = merged["drop"]["rngs"]["key"]
      self.assertTrue(jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key))
      np.testing.assert_array_equal(
        jax.random.key_data(key),
        jax.random.key_data(states[1]["drop"]["rngs"]["key"]),
      )
      chex.assert_trees_all_close(
        merged["lin"],
        jax.tree.map(
          lambda a, b: (a + b) / 2, states[0]["lin"], states[1]["lin"]
        ),
      )

  def test_nnx_variable_state_with_engine_fishers(self):
    # nnx.state(model) holds variables; the engine's Fishers (and
    # nnx_apply_fn's theta) hold plain arrays. Both views merge the same.
    models = [nnx.Linear(3, 2, rngs=nnx.Rngs(i)) for i in range(2)]
    states = [nnx.state(m) for m in models]
    pure = [nnx.as_pure(s) for s in states]
    fishers = [
      fisher_optax.fisher.DiagonalFisher(
        diag=jax.tree.map(lambda x, i=i: jnp.full(x.shape, i + 1.0), p),
        mean_grad=p,
        count=jnp.array(1),
        kind="exact",
      )
      for i, p in enumerate(pure)
    ]
    merged = fisher_optax.fisher_merge(states, fishers)
    expected = fisher_optax.fisher_merge(pure, fishers)
    # Variables in, variables out (the documented "structure of the inputs").
    self.assertEqual(jax.tree.structure(merged), jax.tree.structure(states[0]))
    self.assertIsInstance(merged["kernel"], nnx.Param)
    chex.assert_trees_all_close(nnx.as_pure(merged), expected)
    chex.assert_trees_all_close(
      expected, jax.tree.map(lambda a, b: (a + 2 * b) / 3, *pure)
    )
    nnx.update(models[0], merged)
    chex.assert_trees_all_close(nnx.as_pure(nnx.state(models[0])), expected)

  def test_zero_weight_returns_other_model_exactly(self):
    params, fishers = _models(2, seed=14)
    merged = fisher_optax.fisher_merge(params, fishers, jnp.array([0.0, 1.0]))
    chex.assert_trees_all_equal(merged, params[1])
    merged = fisher_optax.fisher_merge(params, fishers, jnp.array([1.0, 0.0]))
    chex.assert_trees_all_equal(merged, params[0])

  def test_zero_weight_on_target_with_zero_floor_is_not_nan(self):
    params, _ = _models(2, seed=9)
    zero = jax.tree.map(jnp.zeros_like, params[0])
    merged = fisher_optax.fisher_merge(
      params, [zero, zero], jnp.array([0.0, 1.0]), fisher_floor=0.0
    )
    chex.assert_trees_all_equal(merged, params[0])

  def test_accepts_engine_diagonal_fisher(self):
    params, fishers = _models(2, seed=10)
    wrapped = [
      fisher_optax.fisher.DiagonalFisher(
        diag=f, mean_grad=f, count=jnp.array(1), kind="exact"
      )
      for f in fishers
    ]
    chex.assert_trees_all_close(
      fisher_optax.fisher_merge(params, wrapped),
      fisher_optax.fisher_merge(params, fishers),
    )


class FisherMergeErrorsTest(parameterized.TestCase):
  def test_structure_mismatch_names_trees(self):
    params, fishers = _models(2)
    bad = dict(params[1], extra=jnp.zeros(1))
    with self.assertRaisesRegex(ValueError, r"params_list\[1\]"):
      fisher_optax.fisher_merge([params[0], bad], fishers)

  def test_shape_mismatch_names_leaf(self):
    params, fishers = _models(2)
    bad = jax.tree.map(lambda x: x, params[1])
    bad["head"] = jnp.zeros((4, 3))
    with self.assertRaisesRegex(ValueError, r"\['head'\].*shape"):
      fisher_optax.fisher_merge([params[0], bad], fishers)

  def test_dtype_mismatch_names_leaf(self):
    params, fishers = _models(2)
    bad = dict(params[1], head=params[1]["head"].astype(jnp.bfloat16))
    with self.assertRaisesRegex(ValueError, r"\['head'\].*dtype"):
      fisher_optax.fisher_merge([params[0], bad], fishers)

  def test_fisher_shape_mismatch(self):
    params, fishers = _models(2)
    bad = dict(fishers[1], head=jnp.ones((2, 4)))
    with self.assertRaisesRegex(ValueError, r"fishers\[1\]\['head'\]"):
      fisher_optax.fisher_merge(params, [fishers[0], bad])

  def test_fisher_errors_name_the_model(self):
    params, fishers = _models(3)
    bad = dict(fishers[2], head=fishers[2]["head"].at[0, 0].set(jnp.nan))
    with self.assertRaisesRegex(
      ValueError, r"^fishers\[2\]\['head'\] .*non-finite"
    ):
      fisher_optax.fisher_merge(params, [*fishers[:2], bad])
    bad = {"other": fishers[1]["head"]}
    with self.assertRaisesRegex(
      ValueError, r"^fishers\[1\] .*structure.*params_list\[1\]"
    ):
      fisher_optax.fisher_merge(params, [fishers[0], bad, fishers[2]])
    # The target is validated first, under its own index.
    with self.assertRaisesRegex(ValueError, r"^fishers\[1\]"):
      fisher_optax.fisher_merge(
        params, [fishers[0], bad, fishers[2]], target_index=1
      )

  def test_fisher_count_and_type(self):
    params, fishers = _models(2)
    with self.assertRaisesRegex(ValueError, "one Fisher per model"):
      fisher_optax.fisher_merge(params, fishers[:1])
    with self.assertRaisesRegex(TypeError, "list or tuple"):
      fisher_optax.fisher_merge(params[0], fishers)
    with self.assertRaisesRegex(ValueError, "at least one"):
      fisher_optax.fisher_merge([], [])

  @parameterized.parameters(
    ([1.0],), ([1.0, -1.0],), ([0.0, 0.0],), ([1.0, float("nan")],)
  )
  def test_bad_weights(self, weights):
    params, fishers = _models(2)
    with self.assertRaisesRegex(ValueError, "weights"):
      fisher_optax.fisher_merge(params, fishers, np.array(weights))

  def test_bad_hyperparameters(self):
    params, fishers = _models(2)
    with self.assertRaisesRegex(ValueError, "floor_mode"):
      fisher_optax.fisher_merge(params, fishers, floor_mode="none")
    with self.assertRaisesRegex(ValueError, "fisher_floor"):
      fisher_optax.fisher_merge(params, fishers, fisher_floor=-1.0)
    with self.assertRaisesRegex(ValueError, "fisher_floor must be a scalar"):
      fisher_optax.fisher_merge(params, fishers, fisher_floor=jnp.ones(2))
    with self.assertRaisesRegex(ValueError, "target_index"):
      fisher_optax.fisher_merge(params, fishers, target_index=2)
    with self.assertRaisesRegex(TypeError, "target_index"):
      fisher_optax.fisher_merge(params, fishers, target_index=0.0)
    with self.assertRaisesRegex(ValueError, "merge_mask"):
      fisher_optax.fisher_merge(params, fishers, merge_mask={"x": True})
    with self.assertRaisesRegex(TypeError, "merge_mask"):
      fisher_optax.fisher_merge(
        params,
        fishers,
        merge_mask=jax.tree.map(lambda _: jnp.array(True), params[0]),
      )

  @parameterized.parameters(
    (-1.0, "1 negative"),
    (float("nan"), "non-finite"),
    (float("inf"), "non-finite"),
  )
  def test_bad_fisher_values_name_leaf(self, value, pattern):
    params, fishers = _models(2)
    bad = dict(fishers[1], head=fishers[1]["head"].at[0, 1].set(value))
    with self.assertRaisesRegex(
      ValueError, rf"fishers\[1\]\['head'\].*{pattern}"
    ):
      fisher_optax.fisher_merge(params, [fishers[0], bad])

  def test_integer_fisher_on_merged_leaf(self):
    params, fishers = _models(2)
    bad = dict(fishers[1], head=jnp.ones((4, 2), jnp.int32))
    with self.assertRaisesRegex(TypeError, r"fishers\[1\]\['head'\].*floating"):
      fisher_optax.fisher_merge(params, [fishers[0], bad])

  def test_low_rank_statistic_is_named(self):
    params, fishers = _models(2)
    low = fisher_optax.fisher.LowRankFisher(
      jnp.ones([1]),
      jax.tree.map(lambda x: x[None], fishers[1]),
      None,
      jnp.array(1),
    )
    with self.assertRaisesRegex(TypeError, "diagonal.*got a LowRankFisher"):
      fisher_optax.fisher_merge(params, [fishers[0], low])

  def test_check_fisher_leaf_error_class_and_tracers(self):
    class InputError(ValueError):
      pass

    check = _merging.check_fisher_leaf
    with self.assertRaisesRegex(InputError, r"^F\[0\] has dtype int32"):
      check(np.ones(2, np.int32), name="F[0]", error=InputError)
    with self.assertRaisesRegex(InputError, "F has 2 negative entries"):
      check(-np.ones(2), name="F", error=InputError)
    with self.assertRaisesRegex(ValueError, "fisher has non-finite"):
      check(np.array([np.inf]))
    # Values are unknown under jit: only the dtype is checked.
    jax.jit(lambda f: check(f) or f)(-jnp.ones(2))


class AccumulatorTest(parameterized.TestCase):
  @parameterized.parameters("all", "target")
  def test_streaming_equals_batch(self, floor_mode):
    params, fishers = _models(4, seed=11, zero_frac=0.3)
    weights = [0.4, 0.1, 0.3, 0.2]
    acc = fisher_optax.fisher_merge_accumulator(
      1e-2, floor_mode=floor_mode, normalize=True
    )
    add = jax.jit(acc.add)
    state = jax.jit(acc.init)(params[0], fishers[0], weights[0])
    for p, f, w in zip(params[1:], fishers[1:], weights[1:]):
      state = add(state, p, f, w)
    self.assertEqual(int(state.count), 4)
    batch = fisher_optax.fisher_merge(
      params,
      fishers,
      np.array(weights),
      1e-2,
      floor_mode=floor_mode,
      normalize=True,
    )
    chex.assert_trees_all_close(acc.finalize(state), batch, rtol=1e-6)

  def test_memory_is_two_params_sized_buffers(self):
    params, fishers = _models(1)
    acc = fisher_optax.fisher_merge_accumulator()
    state = acc.init(params[0], fishers[0])
    n = sum(x.size for x in jax.tree.leaves(params[0]))
    self.assertEqual(
      sum(
        x.size for x in jax.tree.leaves((state.mean, state.mass, state.dtypes))
      ),
      2 * n,
    )

  def test_add_rejects_mismatched_model(self):
    params, fishers = _models(2)
    acc = fisher_optax.fisher_merge_accumulator()
    state = acc.init(params[0], fishers[0])
    bad = dict(params[1], head=params[1]["head"].astype(jnp.float16))
    with self.assertRaisesRegex(ValueError, r"\['head'\].*dtype"):
      acc.add(state, bad, fishers[1])
    with self.assertRaisesRegex(ValueError, "weight"):
      acc.add(state, params[1], fishers[1], -1.0)
    with self.assertRaisesRegex(TypeError, "normalize"):
      fisher_optax.fisher_merge_accumulator(normalize=1)
    with self.assertRaisesRegex(TypeError, "normalize must be True or False"):
      fisher_optax.fisher_merge(params[:2], fishers[:2], normalize="no")

  def test_non_scalar_weight_raises_also_under_jit(self):
    params, fishers = _models(2)
    acc = fisher_optax.fisher_merge_accumulator()
    state = acc.init(params[0], fishers[0])
    for add in (acc.add, jax.jit(acc.add)):
      with self.assertRaisesRegex(ValueError, r"weight must be a scalar.*\(2,"):
        add(state, params[1], fishers[1], jnp.ones(2))
    with self.assertRaisesRegex(ValueError, "weight must be a scalar"):
      jax.jit(acc.init)(params[0], fishers[0], jnp.ones(1))

  def test_large_weights_are_exact_or_raise(self):
    models = [{"w": jnp.zeros(2)}, {"w": jnp.ones(2)}]
    fishers = [{"w": jnp.array([1.0, 1.0])}, {"w": jnp.array([3.0, 1.0])}]
    acc = fisher_optax.fisher_merge_accumulator()
    # Masses up to 2e38: above 2**126, where a plain division flushes to 0.
    for add in (acc.add, jax.jit(acc.add)):
      state = acc.init(models[0], fishers[0], 5e37)
      state = add(state, models[1], fishers[1], 5e37)
      np.testing.assert_allclose(acc.finalize(state)["w"], [0.75, 0.5])
    # The accumulator cannot rescale weights it has not seen: the mass
    # overflows, which is refused eagerly.
    state = acc.init(models[0], fishers[0], 2e38)
    with self.assertRaisesRegex(ValueError, r"params\['w'\] overflows"):
      acc.add(state, models[1], fishers[1], 2e38)


class WeightSearchTest(absltest.TestCase):
  def test_two_model_grid_finds_best(self):
    params, fishers = _models(2, seed=12)
    target = fisher_optax.fisher_merge(params, fishers, np.array([0.3, 0.7]))

    def score(p):
      return -sum(
        jnp.sum((a - b) ** 2)
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(target))
      )

    result = fisher_optax.search_merge_weights(
      score, params, fishers, num_points=11
    )
    np.testing.assert_allclose(result.best_weights, [0.3, 0.7], atol=1e-6)
    self.assertEqual(result.scores.shape, (11,))
    self.assertEqual(result.best_score, result.scores.max())

  def test_dirichlet_candidates(self):
    cands = fisher_optax.merge_weight_candidates(3, 8, key=jax.random.key(1))
    self.assertEqual(cands.shape, (8, 3))
    np.testing.assert_allclose(cands[0], [1 / 3] * 3, rtol=1e-6)
    np.testing.assert_allclose(cands.sum(1), np.ones(8), rtol=1e-5)
    self.assertTrue(np.all(cands >= 0))
    params, fishers = _models(3, seed=13)
    result = fisher_optax.search_merge_weights(
      lambda p: -jnp.sum(p["head"] ** 2), params, fishers, candidates=cands
    )
    best = fisher_optax.fisher_merge(params, fishers, result.best_weights)
    self.assertAlmostEqual(
      float(-jnp.sum(best["head"] ** 2)), result.best_score, places=5
    )

  def test_tiny_candidate_weights_merge_as_fisher_merge(self):
    # Weights below float32's smallest normal number, scaled on the host
    # as fisher_merge scales them (traced, they would be zeros).
    models = [{"w": jnp.array([0.0])}, {"w": jnp.array([1.0])}]
    result = fisher_optax.search_merge_weights(
      lambda p: p["w"][0], models, None, candidates=[[1e-39, 3e-39], [1, 0]]
    )
    np.testing.assert_allclose(result.scores, [0.75, 0.0], rtol=1e-6)
    want = fisher_optax.fisher_merge(models, None, [1e-39, 3e-39])["w"][0]
    self.assertAlmostEqual(float(want), 0.75, places=6)

  def test_bad_candidates(self):
    params, fishers = _models(2)
    with self.assertRaisesRegex(ValueError, "candidates"):
      fisher_optax.search_merge_weights(
        lambda p: 0.0, params, fishers, candidates=np.ones((3, 3))
      )
    with self.assertRaisesRegex(ValueError, r"candidates\[1\].*>= 0"):
      fisher_optax.search_merge_weights(
        lambda p: 0.0, params, fishers, candidates=[[1.0, 1.0], [-1.0, 2.0]]
      )
    with self.assertRaisesRegex(ValueError, r"candidates\[2\].*not all zero"):
      fisher_optax.search_merge_weights(
        lambda p: 0.0, params, fishers, candidates=[[1, 1], [1, 0], [0, 0]]
      )
    with self.assertRaisesRegex(ValueError, r"candidates\[1\].*finite"):
      fisher_optax.search_merge_weights(
        lambda p: 0.0, params, fishers, candidates=[[1, 1], [np.inf, 1]]
      )
    with self.assertRaisesRegex(ValueError, "no finite score"):
      fisher_optax.search_merge_weights(
        lambda p: float("nan"), params, fishers, num_points=3
      )


if __name__ == "__main__":
  absltest.main()
