# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for the shared numerics in ``fisher_optax._linalg``."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from fisher_optax import _linalg


class StackedPushRowsTest(parameterized.TestCase):
  """The ring-buffer push keeps the cached Gram equal to a fresh one."""

  def _tree(self, key, m):
    k1, k2 = jax.random.split(key)
    return {"w": jax.random.normal(k1, (m, 3, 2)),
            "b": jax.random.normal(k2, (m, 4))}

  @parameterized.parameters((1, 0), (1, 4), (3, 3), (3, 4), (5, 0))
  def test_gram_matches_fresh_gram(self, k, index):
    m = 5
    with jax.enable_x64(True):
      window = jax.tree.map(lambda x: x.astype(jnp.float64),
                            self._tree(jax.random.key(0), m))
      rows = jax.tree.map(lambda x: x.astype(jnp.float64),
                          self._tree(jax.random.key(1), k))
      gram = _linalg.tree_stacked_gram(window)
      push = jax.jit(_linalg.stacked_push_rows)
      new_window, new_gram = push(window, gram, rows, index)
      slots = [(index + i) % m for i in range(k)]
      for i, slot in enumerate(slots):
        chex.assert_trees_all_close(
            jax.tree.map(lambda x, s=slot: x[s], new_window),
            jax.tree.map(lambda x, i=i: x[i], rows))
      untouched = [s for s in range(m) if s not in slots]
      for slot in untouched:
        chex.assert_trees_all_close(
            jax.tree.map(lambda x, s=slot: x[s], new_window),
            jax.tree.map(lambda x, s=slot: x[s], window))
      np.testing.assert_allclose(
          new_gram, _linalg.tree_stacked_gram(new_window), rtol=1e-12)

  def test_too_many_rows_raise(self):
    window = self._tree(jax.random.key(0), 2)
    rows = self._tree(jax.random.key(1), 3)
    with self.assertRaisesRegex(ValueError, "window of 2 rows"):
      _linalg.stacked_push_rows(
          window, _linalg.tree_stacked_gram(window), rows, 0)


class TreeStackedEighTest(parameterized.TestCase):
  """Eigenpairs of G^T G through the Gram (used by EWC and PhysGuard)."""

  @parameterized.parameters((3, 1.0), (6, 0.25), (20, 1.0))
  def test_matches_dense_eigh(self, m, scale):
    with jax.enable_x64(True):
      k1, k2 = jax.random.split(jax.random.key(m))
      tree = {"w": jax.random.normal(k1, (m, 3, 2), jnp.float64),
              "b": jax.random.normal(k2, (m, 4), jnp.float64)}
      evals, vecs = _linalg.tree_stacked_eigh(tree, scale=scale)
      flat = np.concatenate([np.asarray(tree["b"]).reshape(m, -1),
                             np.asarray(tree["w"]).reshape(m, -1)], axis=1)
      vflat = np.concatenate([np.asarray(vecs["b"]).reshape(m, -1),
                              np.asarray(vecs["w"]).reshape(m, -1)], axis=1)
      dense = scale * flat.T @ flat
      ref = np.sort(np.linalg.eigvalsh(dense))[::-1]
      ref = np.pad(ref, (0, max(0, m - ref.size)))[:m]
      np.testing.assert_allclose(evals, np.maximum(ref, 0.0), atol=1e-9)
      rank = int(np.sum(np.asarray(evals) > 0))
      self.assertEqual(rank, min(m, 10))
      v = vflat[:rank]
      np.testing.assert_allclose(v @ v.T, np.eye(rank), atol=1e-9)
      np.testing.assert_allclose(
          dense @ v.T, v.T * np.asarray(evals[:rank])[None], atol=1e-8)
      # Directions beyond the rank are exactly zero, not NaN.
      self.assertTrue(np.all(vflat[rank:] == 0.0))

  def test_zero_gradients_give_zero_pairs(self):
    tree = {"w": jnp.zeros((4, 3))}
    evals, vecs = _linalg.tree_stacked_eigh(tree)
    chex.assert_trees_all_equal(evals, jnp.zeros(4))
    chex.assert_trees_all_equal(vecs, tree)


if __name__ == "__main__":
  absltest.main()
