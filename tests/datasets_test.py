# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for examples.common.datasets."""

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from examples.common import datasets


class DigitsTest(parameterized.TestCase):
  def test_split_sizes_stratified_and_disjoint(self):
    d = datasets.load_digits(seed=3)
    n = sum(len(d[k][0]) for k in ("train", "val", "test"))
    self.assertEqual(n, 1797)
    self.assertAlmostEqual(len(d["train"][0]) / n, 0.6, delta=0.01)
    for name in ("train", "val", "test"):
      x, y = d[name]
      self.assertEqual(x.dtype, np.float32)
      self.assertEqual(y.dtype, np.int32)
      self.assertEqual(x.shape[1], 64)
      counts = np.bincount(y, minlength=10) / len(y)
      np.testing.assert_allclose(counts, 0.1, atol=0.02)
    rows = {k: {r.tobytes() for r in d[k][0]} for k in d}
    # The 1797 images are all distinct, so disjoint splits share no row.
    self.assertEmpty(rows["train"] & rows["test"])
    self.assertEmpty(rows["train"] & rows["val"])
    self.assertEmpty(rows["val"] & rows["test"])

  def test_standardised_with_train_statistics(self):
    x = datasets.load_digits(seed=0)["train"][0]
    np.testing.assert_allclose(x.mean(0), 0.0, atol=1e-5)
    std = x.std(0)
    # Constant pixels stay exactly 0; the others have unit variance.
    np.testing.assert_allclose(std[std > 0], 1.0, atol=1e-4)
    self.assertTrue(np.all(x[:, std == 0] == 0))

  def test_deterministic_and_seed_dependent(self):
    a = datasets.load_digits(seed=1)["train"][1]
    b = datasets.load_digits(seed=1)["train"][1]
    c = datasets.load_digits(seed=2)["train"][1]
    np.testing.assert_array_equal(a, b)
    self.assertFalse(np.array_equal(a, c))

  def test_unscaled_option(self):
    x = datasets.load_digits(standardize=False)["test"][0]
    self.assertGreaterEqual(x.min(), 0.0)
    self.assertLessEqual(x.max(), 1.0)

  @parameterized.parameters(
    ((0.5, 0.5, 0.5),), ((1.2, -0.1, -0.1),), ((0.5, 0.5),)
  )
  def test_bad_split(self, split):
    with self.assertRaisesRegex(ValueError, "split"):
      datasets.load_digits(split=split)


class PydocTopicsTest(absltest.TestCase):
  def test_ids_and_vocab(self):
    ids, vocab = datasets.load_pydoc_topics()
    self.assertGreater(len(ids), 100_000)
    self.assertEqual(ids.dtype, np.int32)
    self.assertEqual(ids.max(), len(vocab) - 1)
    self.assertEqual(len(set(vocab)), len(vocab))

  def test_batches_are_shifted_windows(self):
    ids, _ = datasets.load_pydoc_topics()
    train, val = datasets.char_split(ids, 0.1)
    self.assertEqual(len(train) + len(val), len(ids))
    x, y = next(datasets.char_batches(train, 5, 16, seed=0))
    self.assertEqual(x.shape, (5, 16))
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    x2, _ = next(datasets.char_batches(train, 5, 16, seed=0))
    np.testing.assert_array_equal(x, x2)
    ex, ey = datasets.char_eval_windows(val, 16, max_windows=4)
    np.testing.assert_array_equal(ex.reshape(-1)[1:], ey.reshape(-1)[:-1])

  def test_bad_arguments(self):
    with self.assertRaises(ValueError):
      datasets.char_split(np.arange(10), 1.5)
    with self.assertRaises(ValueError):
      next(datasets.char_batches(np.arange(4), 2, 8))


if __name__ == "__main__":
  absltest.main()
