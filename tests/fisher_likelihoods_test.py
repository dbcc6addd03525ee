# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""What the engine does with inputs it must not trust.

- Shapes and dtypes that do not fit the likelihood raise at trace time.
- Out-of-range labels give NaN statistics (``is_finite()`` False), under
  ``jit``, for every kind that reads labels and every structure.
- NaN, +-Inf and 1e30 inputs: the call returns and the statistic says it is
  bad. The guards exist because LAPACK's ``eigh``/SVD on a matrix holding an
  infinity need not terminate on XLA:CPU (a hang, not an error), so no
  decomposition of the engine may see one; the per-test timeout turns such a
  hang into a failure.
- The estimator transforms follow the one non-finite policy (state kept,
  NaN updates, ``notfinite_count``).
- bf16/float16 models and gradients give float32 statistics that do not
  overflow.
"""

from __future__ import annotations

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fisher_optax import fisher

pytestmark = pytest.mark.timeout(120)

NONFINITE = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}
BAD_VALUES = {**NONFINITE, "1e30": 1e30}  # 1e30 squared overflows float32
GOOD_VALUES = {"zero": 0.0, "1e-30": 1e-30}
LABEL_KINDS = ("empirical", "exact", "batch_squared")


def _linear(params, x):
  return x @ params["w"]


_W = {"w": jnp.ones((2, 3))}  # (B, 2) inputs -> (B, 3) outputs


def _diag(batch, likelihood, kind="empirical", apply_fn=_linear):
  return fisher.diagonal(apply_fn, _W, batch, likelihood=likelihood, kind=kind)


class ShapeAndDtypeTest(parameterized.TestCase):
  """Every mismatch is a clear error before anything is computed."""

  x = jnp.ones((4, 2))

  def test_categorical(self):
    cat = fisher.Categorical()
    with self.assertRaisesRegex(TypeError, "integer class labels"):
      _diag((self.x, jnp.zeros((4,), jnp.float32)), cat)
    with self.assertRaisesRegex(TypeError, "integer class labels"):
      _diag((self.x, jnp.zeros((4,), bool)), cat)
    with self.assertRaisesRegex(ValueError, "without their class axis"):
      _diag((self.x, jnp.zeros((4, 3), jnp.int32)), cat)
    # (B,) outputs: a clear message, not an IndexError, for every kind.
    squeeze = lambda p, x: _linear(p, x)[:, 0]
    for kind in ("empirical", "exact"):
      with self.assertRaisesRegex(ValueError, r"\(B, \.\.\., C\)"):
        _diag((self.x, jnp.zeros((4,), jnp.int32)), cat, kind, squeeze)
    with self.assertRaisesRegex(ValueError, r"\(B, \.\.\., C\)"):
      _diag((self.x, None), cat, "exact", squeeze)

  @parameterized.parameters((4,), (4, 1), (4, 3, 1), (4, 2))
  def test_gaussian_targets_are_not_broadcast(self, *shape):
    with self.assertRaisesRegex(ValueError, "exactly like the outputs"):
      _diag((self.x[: shape[0]], jnp.zeros(shape)), fisher.Gaussian())

  def test_gaussian_sigma_must_be_positive(self):
    for sigma in (0.0, -1.0, np.float32(0.0), jnp.asarray(0.0)):
      with self.subTest(sigma=repr(sigma)):
        with self.assertRaisesRegex(ValueError, "sigma"):
          fisher.Gaussian(sigma=sigma)

  def test_gaussian_and_bernoulli_dtypes(self):
    with self.assertRaisesRegex(TypeError, "real-valued"):
      _diag((self.x, jnp.zeros((4, 3), bool)), fisher.Gaussian())
    # Integer 0/1 and bool labels of the right shape are fine for Bernoulli.
    for y in (jnp.ones((4, 3), jnp.int32), jnp.ones((4, 3), bool)):
      self.assertTrue(bool(_diag((self.x, y), fisher.Bernoulli()).is_finite()))

  def test_bernoulli_labels_of_another_shape(self):
    with self.assertRaisesRegex(ValueError, "exactly like the outputs"):
      _diag((self.x, jnp.zeros((4,), jnp.int32)), fisher.Bernoulli())

  @parameterized.parameters("empirical", "exact", "mc", "batch_squared")
  def test_heteroscedastic_needs_pairs_under_every_kind(self, kind):
    het = fisher.HeteroscedasticGaussian()
    with self.assertRaisesRegex(ValueError, r"\(mean, log variance\)"):
      fisher.diagonal(
        _linear,
        _W,
        (self.x, jnp.zeros((4,))),
        likelihood=het,
        kind=kind,
        key=jax.random.key(0),
      )

  def test_heteroscedastic_targets(self):
    pairs = lambda p, x: jnp.stack([x @ p["w"]] * 2, -1)  # (B, 3, 2)
    het = fisher.HeteroscedasticGaussian()
    with self.assertRaisesRegex(ValueError, "without their"):
      _diag((self.x, jnp.zeros((4,))), het, apply_fn=pairs)
    good = _diag((self.x, jnp.zeros((4, 3))), het, apply_fn=pairs)
    self.assertTrue(bool(good.is_finite()))

  def test_empty_batch(self):
    empty = (jnp.ones((0, 2)), jnp.zeros((0,), jnp.int32))
    cat = fisher.Categorical()
    with self.assertRaisesRegex(ValueError, "empty"):
      _diag(empty, cat)
    with self.assertRaisesRegex(ValueError, "empty"):
      fisher.low_rank(_linear, _W, empty, likelihood=cat, kind="exact", rank=1)
    with self.assertRaisesRegex(ValueError, "empty"):
      fisher.diagonal_from_grads({"w": jnp.ones((0, 2, 3))})
    tx = fisher.estimate_fisher_diag()
    with self.assertRaisesRegex(ValueError, "empty"):
      tx.update(_W, tx.init(_W), per_example_grads={"w": jnp.ones((0, 2, 3))})


def _estimate(structure, kind, batch):
  cat = fisher.Categorical()
  if structure == "diagonal":
    return _diag(batch, cat, kind)
  if structure == "low_rank":
    return fisher.low_rank(
      _linear, _W, batch, likelihood=cat, kind=kind, rank=2
    )
  if structure == "low_rank_per_example":
    return fisher.low_rank(
      _linear, _W, batch, likelihood=cat, kind=kind, rank=2,
      method="per_example",
    )  # fmt: skip
  return fisher.kronecker(_linear, _W, batch, likelihood=cat, kind=kind)


class SqrtFisherColumnsTest(parameterized.TestCase):
  """The columns a backward pass asks for equal those of the whole square
  root, on sequence outputs too."""

  @parameterized.named_parameters(
    ("categorical", fisher.Categorical(), (3, 4, 5)),
    ("gaussian", fisher.Gaussian(sigma=0.5), (3, 4)),
    ("bernoulli", fisher.Bernoulli(), (3, 4)),
    ("heteroscedastic", fisher.HeteroscedasticGaussian(), (3, 2)),
  )
  def test_columns_match(self, likelihood, shape):
    out = jax.random.normal(jax.random.key(0), shape)
    full = likelihood.sqrt_fisher(out)
    self.assertEqual(full.shape, (out.size, *shape))
    idx = jnp.array([0, 5, out.size - 1, 2])
    np.testing.assert_allclose(
      likelihood.sqrt_fisher_columns(out, idx), full[idx], rtol=1e-6
    )


class BernoulliLargeLogitsTest(absltest.TestCase):
  def test_symmetric_in_the_logit(self):
    # 1 - sigmoid(20) rounds to 0 in float32: the Fisher was 0 at +20 but
    # 2e-9 at -20, and the gradient of a target 1 at +20 was 0.
    x = jnp.array([20.0, -20.0, 30.0, -30.0])
    want = np.exp(-np.abs(np.asarray(x, np.float64)))
    want = want / (1 + want) ** 2  # p (1 - p), exact
    fisher_diag = jnp.diagonal(fisher.Bernoulli().sqrt_fisher(x)) ** 2
    np.testing.assert_allclose(fisher_diag, want, rtol=1e-5)
    # sigmoid(x) - t: -sigmoid(-x) for t = 1, sigmoid(x) for t = 0.
    grad = fisher.Bernoulli().grad_out(x, jnp.array([1.0, 0.0, 1.0, 0.0]))
    tail = 1 / (1 + np.exp(np.array([20.0, 20.0, 30.0, 30.0])))
    np.testing.assert_allclose(grad, tail * [-1, 1, -1, 1], rtol=1e-5)


class OutOfRangeLabelTest(parameterized.TestCase):
  """``one_hot`` makes a bad label a zero vector; the engine makes it NaN."""

  @parameterized.product(
    structure=("diagonal", "low_rank", "low_rank_per_example", "kronecker"),
    kind=LABEL_KINDS,
  )
  def test_bad_label_gives_a_non_finite_statistic(self, structure, kind):
    x = jax.random.normal(jax.random.key(0), (2, 2))
    run = jax.jit(lambda y: _estimate(structure, kind, (x, y)).is_finite())
    self.assertTrue(bool(run(jnp.array([0, 1]))))
    for bad in (-1, 3, 7, 1000):
      with self.subTest(label=bad):
        self.assertFalse(bool(run(jnp.array([0, bad]))))

  def test_issue_reproducer(self):
    stat = fisher.diagonal(
      lambda p, x: x @ p["w"],
      {"w": jnp.ones((2, 3))},
      (jnp.ones((2, 2)), jnp.array([0, 7])),
      likelihood=fisher.Categorical(),
      kind="empirical",
    )
    self.assertFalse(bool(stat.is_finite()))

  def test_bernoulli_target_outside_unit_interval(self):
    x = jnp.ones((2, 2))
    y = jnp.array([[0.0, 1.0, 0.5], [0.0, 2.0, 1.0]])
    self.assertFalse(bool(_diag((x, y), fisher.Bernoulli()).is_finite()))

  @parameterized.parameters("diag", "low_rank")
  def test_estimator_transform_keeps_its_statistic(self, structure):
    make = {
      "diag": fisher.estimate_fisher_diag,
      "low_rank": functools.partial(fisher.estimate_fisher_low_rank, rank=1),
    }[structure]
    tx = make(_linear, fisher.Categorical(), kind="exact")
    x = jax.random.normal(jax.random.key(0), (2, 2))
    update = jax.jit(lambda s, y: tx.update(_W, s, _W, batch=(x, y)))
    _, good = update(tx.init(_W), jnp.array([0, 1]))
    updates, bad = update(good, jnp.array([0, 5]))
    chex.assert_trees_all_equal(updates, _W)  # passed through
    chex.assert_trees_all_equal(bad._replace(notfinite_count=0), good)
    self.assertEqual(int(bad.notfinite_count), 1)


class DecompositionGuardTest(parameterized.TestCase):
  """Non-finite (or overflowing) inputs never reach ``eigh``/Cholesky."""

  @parameterized.named_parameters(*BAD_VALUES.items())
  def test_low_rank_from_bad_inputs(self, value):
    x = jnp.array([[1.0, 2.0], [value, 1.0], [0.5, 0.5]])
    y = jnp.array([0, 1, 2])
    for method in ("auto", "per_example"):
      with self.subTest(method=method):
        stat = jax.jit(
          lambda x: fisher.low_rank(
            _linear, _W, (x, y), likelihood=fisher.Categorical(),
            kind="exact", rank=2, method=method,
          )
        )(x)  # fmt: skip
        self.assertFalse(bool(stat.is_finite()))

  @parameterized.named_parameters(*BAD_VALUES.items())
  def test_low_rank_from_grads_and_sum_of_rank_one(self, value):
    g = jnp.ones((4, 6)).at[1, 2].set(value)
    stat = jax.jit(lambda g: fisher.low_rank_from_grads(g, rank=2))(g)
    self.assertFalse(bool(stat.is_finite()))
    for block_size in (None, 3, 4):  # 3 < m: compressed blocks.
      with self.subTest(block_size=block_size):
        factor = jax.jit(
          functools.partial(
            fisher.sum_of_rank_one, damping=1e-2, block_size=block_size
          )
        )(g)
        self.assertFalse(bool(factor.is_finite()))

  @parameterized.named_parameters(*NONFINITE.items())
  def test_kronecker_solve(self, value):
    left = jnp.eye(2).at[0, 1].set(value)
    stat = fisher.KroneckerFisher(left, jnp.eye(3), None, jnp.asarray(1))
    self.assertFalse(bool(stat.is_finite()))
    out = jax.jit(lambda v: stat.solve(v, 1e-3))(jnp.ones((2, 3)))
    self.assertTrue(bool(jnp.isnan(out).all()))

  @parameterized.named_parameters(*GOOD_VALUES.items())
  def test_tiny_and_zero_gradients_are_fine(self, value):
    g = jnp.full((4, 6), value)
    self.assertTrue(bool(fisher.low_rank_from_grads(g, rank=2).is_finite()))
    for block_size in (None, 3):
      self.assertTrue(
        bool(fisher.sum_of_rank_one(g, 1e-2, block_size=block_size).is_finite())
      )


def _transforms():
  return {
    "diag": fisher.estimate_fisher_diag(interval=2, decay=0.5),
    "low_rank": fisher.estimate_fisher_low_rank(rank=2, interval=2),
  }


_PARAMS = {"a": jnp.zeros((3,)), "b": jnp.zeros((2, 2))}
_GRADS = jax.tree.map(
  lambda p: jax.random.normal(jax.random.key(0), (4, *p.shape)) + 1.0, _PARAMS
)


def _spoil(grads, value):
  return jax.tree.map(lambda x: x.at[0].set(value), grads)


def _spoiled_mean(value):
  return jax.tree.map(lambda x: x.mean(0), _spoil(_GRADS, value))


@functools.cache
def _policy_run(name):
  """Four steps in one jit: good, bad-or-good (``value`` at step ``at``),
  good, good. Step 0 and 2 refresh (``interval=2``), 1 and 3 do not."""
  tx = _transforms()[name]
  params, grads = _PARAMS, _GRADS

  @jax.jit
  def run(value, at):
    state = tx.init(params)
    out = []
    for i in range(4):
      g = jax.tree.map(
        lambda x, s: jnp.where(i == at, s, x), grads, _spoil(grads, value)
      )
      mean = jax.tree.map(lambda x: x.mean(0), g)
      updates, state = tx.update(mean, state, per_example_grads=g)
      out.append((updates, state))
    return out

  return run


class NonFinitePolicyTest(parameterized.TestCase):
  @parameterized.product(
    name=("diag", "low_rank"),
    value=tuple(BAD_VALUES),
    at=(1, 2),  # between refreshes, at a refresh
  )
  def test_bad_step_keeps_the_state(self, name, value, at):
    out = _policy_run(name)(jnp.float32(BAD_VALUES[value]), at)
    jax.block_until_ready(out)
    (_, before), (updates, after), (_, last) = out[at - 1 : at + 2]
    if value == "1e30" and at == 1:
      # Finite gradients between refreshes: no statistic is computed, so
      # nothing overflows and the step is a good one.
      chex.assert_tree_all_finite((updates, after))
      self.assertEqual(int(after.count), int(before.count) + 1)
      self.assertEqual(int(out[-1][1].notfinite_count), 0)
      return
    # The updates pass through as they came (the mean of the spoiled
    # per-example gradients): non-finite ones stay visible to
    # optax.apply_if_finite, which checks the gradients it is given.
    mean = _spoiled_mean(BAD_VALUES[value])
    chex.assert_trees_all_equal(updates, mean)
    self.assertEqual(int(after.notfinite_count), 1)
    chex.assert_trees_all_equal(after._replace(notfinite_count=0), before)
    chex.assert_tree_all_finite(last)
    self.assertEqual(int(last.notfinite_count), 1)
    # The skipped step did not count, so a refresh it held comes one step
    # later: two refreshes in four steps either way.
    self.assertEqual(int(out[-1][1].num_refreshes), 2)

  @parameterized.product(name=("diag", "low_rank"), value=tuple(GOOD_VALUES))
  def test_tiny_and_zero_gradients_are_good_steps(self, name, value):
    out = _policy_run(name)(jnp.float32(GOOD_VALUES[value]), 2)
    for updates, state in out:
      chex.assert_tree_all_finite((updates, state))
      self.assertEqual(int(state.notfinite_count), 0)
    self.assertEqual(int(out[-1][1].num_refreshes), 2)

  def test_overflowing_batch_in_a_low_rank_refresh(self):
    tx = fisher.estimate_fisher_low_rank(
      _linear, fisher.Categorical(), kind="empirical", rank=2
    )
    y = jnp.array([0, 1, 2])
    update = jax.jit(lambda s, x: tx.update(_W, s, _W, batch=(x, y)))
    _, good = update(tx.init(_W), jnp.ones((3, 2)))
    # Finite inputs, but the Gram of the pseudo-gradients overflows float32.
    _, bad = update(good, jnp.full((3, 2), 1e30))
    self.assertEqual(int(bad.notfinite_count), 1)
    chex.assert_trees_all_equal(bad._replace(notfinite_count=0), good)


class HalfPrecisionTest(parameterized.TestCase):
  """Statistics are float32; squares of half-precision values never overflow
  (float16's largest value is 65504, so 1e3 squared would)."""

  @parameterized.parameters(jnp.float16, jnp.bfloat16)
  def test_model_statistics(self, dtype):
    # Per-example gradients ~ 30 * 28 fit in float16; their squares do not.
    params = {"w": jnp.full((2, 3), 0.5, dtype)}
    x = jnp.full((4, 2), 30.0, dtype)
    y = jnp.array([0.0, 1.0, 2.0, 3.0])[:, None] * jnp.ones((4, 3))
    y = y.astype(dtype)
    gauss = fisher.Gaussian()
    diag = fisher.diagonal(_linear, params, (x, y), likelihood=gauss,
                           kind="empirical")  # fmt: skip
    self.assertEqual(diag.diag["w"].dtype, jnp.float32)
    self.assertTrue(bool(diag.is_finite()))
    self.assertGreater(float(diag.diag["w"].min()), 65504.0)
    for method in ("auto", "per_example"):  # Gram from layers / stacked
      low = fisher.low_rank(_linear, params, (x, y), likelihood=gauss,
                            kind="empirical", rank=2, method=method)  # fmt: skip
      self.assertEqual(low.eigvals.dtype, jnp.float32)
      self.assertTrue(bool(low.is_finite()))
      self.assertGreater(float(low.eigvals[0]), 65504.0)

  @parameterized.parameters(jnp.float16, jnp.bfloat16)
  def test_estimator_transforms(self, dtype):
    params = {"w": jnp.zeros((3,), dtype)}
    g = {"w": jnp.full((2, 3), 1e3, dtype)}
    mean = {"w": jnp.full((3,), 1e3, dtype)}
    for tx in (
      fisher.estimate_fisher_diag(),
      fisher.estimate_fisher_low_rank(rank=1),
    ):
      updates, state = tx.update(mean, tx.init(params), per_example_grads=g)
      self.assertEqual(updates["w"].dtype, dtype)
      self.assertEqual(int(state.notfinite_count), 0)
      chex.assert_tree_all_finite(state)
      stat = state.diag if hasattr(state, "diag") else state.eigvals
      for leaf in jax.tree.leaves(stat):
        self.assertEqual(leaf.dtype, jnp.float32)
        self.assertGreater(float(leaf.max()), 65504.0)


if __name__ == "__main__":
  absltest.main()
