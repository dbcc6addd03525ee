# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for examples.common.models."""

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
import numpy as np

from examples.common import models


class ModelsTest(absltest.TestCase):
  def test_functional_mlp_matches_module(self):
    from flax import nnx  # pylint: disable=g-import-not-at-top

    module = models.MLP((5, 7, 3), rngs=nnx.Rngs(0))
    apply_fn, params = models.functional(module)
    self.assertIsInstance(params, dict)
    x = jnp.arange(10.0).reshape(2, 5)
    chex.assert_trees_all_close(apply_fn(params, x), module(x), rtol=1e-6)
    # New params change the output; the template is not mutated.
    doubled = jax.tree.map(lambda p: 2 * p, params)
    self.assertFalse(np.allclose(apply_fn(doubled, x), module(x)))
    chex.assert_trees_all_close(apply_fn(params, x), module(x), rtol=1e-6)

  def test_char_transformer_is_causal(self):
    apply_fn, params = models.char_transformer(
      11, context=8, d=16, heads=2, layers=1, ffn=32
    )
    ids = jnp.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    changed = ids.at[0, 5].set(9)
    a, b = jax.jit(apply_fn)(params, ids), jax.jit(apply_fn)(params, changed)
    self.assertEqual(a.shape, (1, 8, 11))
    chex.assert_trees_all_close(a[:, :5], b[:, :5], atol=1e-6)
    self.assertFalse(np.allclose(a[:, 5:], b[:, 5:]))

  def test_projected_kernels_are_2d(self):
    _, params = models.char_transformer(
      11, context=8, d=16, heads=2, layers=1, ffn=32
    )
    block = params["blocks"][0]
    for name in ("q", "k", "v", "o"):
      self.assertEqual(block["attn"][name]["kernel"].shape, (16, 16))
    self.assertEqual(block["up"]["kernel"].shape, (16, 32))

  def test_bad_heads(self):
    with self.assertRaisesRegex(ValueError, "divisible"):
      models.char_transformer(11, d=10, heads=3)


if __name__ == "__main__":
  absltest.main()
