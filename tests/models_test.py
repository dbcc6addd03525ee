# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for examples.common.models."""

from absl.testing import absltest
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples.common import models
import fisher_optax
from fisher_optax import _matrix_view as matrix_view


def _none(x):
  return x is None


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

  def test_attention_kernels_and_hidden_axes(self):
    _, params = models.char_transformer(
      11, context=8, d=16, heads=2, layers=1, ffn=32
    )
    attn = params["blocks"][0]["attn"]
    for name in ("query", "key", "value"):
      self.assertEqual(attn[name]["kernel"].shape, (16, 2, 8))
    self.assertEqual(attn["out"]["kernel"].shape, (2, 8, 16))
    self.assertEqual(params["blocks"][0]["fc"]["kernel"].shape, (16, 32))
    axes = models.hidden_axes(params)
    block = axes["blocks"][0]
    self.assertEqual(block["attn"]["query"]["kernel"], (0, (1, 2)))
    self.assertEqual(block["attn"]["out"]["kernel"], ((0, 1), 2))
    self.assertIsNone(block["attn"]["out"]["bias"])
    self.assertEqual(block["proj"]["kernel"], (0, 1))
    for name in ("embed", "head", "ln_f"):
      self.assertIsNone(jax.tree.leaves(axes[name], is_leaf=_none)[0], name)
    self.assertIsNone(axes["pos"])
    # Every hidden kernel resolves to a (heads * head_dim)-sized matrix view.
    dims = models.hidden_dims(params, optax.contrib.MuonDimensionNumbers)
    views = matrix_view.plans(dims, params)
    shapes = {v.matrix_shape for v in views if v is not None}
    self.assertEqual(shapes, {(16, 16), (16, 32), (32, 16)})
    self.assertLen([v for v in views if v is not None], 6)

  def test_hidden_dims_route_fismo_under_nnx_optimizer(self):
    """nnx.Optimizer hands FISMO an nnx.State (paths end in ``.value``): the
    callable still routes the six hidden kernels, and a step runs."""
    model = models.CharTransformer(
      11, d=16, heads=2, layers=1, ffn=32, context=8, rngs=nnx.Rngs(0)
    )
    dims_fn = lambda p: models.hidden_dims(
      p, optax.contrib.MuonDimensionNumbers
    )
    tx = fisher_optax.fismo(1e-3, fismo_weight_dimension_numbers=dims_fn)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    state = nnx.state(model, nnx.Param)
    dims = matrix_view.resolve(dims_fn, state)
    self.assertLen([d for d in dims if d is not None], 6)
    grads = jax.tree.map(jnp.ones_like, state)
    optimizer.update(model, grads)

  def test_bad_heads(self):
    with self.assertRaisesRegex(ValueError, "divisible"):
      models.char_transformer(11, d=10, heads=3)


if __name__ == "__main__":
  absltest.main()
