# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The layer-statistics path on standard Flax layers (Linen and NNX).

A transformer LM built from Flax's own ``MultiHeadDotProductAttention`` /
``MultiHeadAttention`` (``DenseGeneral`` projections with 3-D kernels and
2-D biases), ``LayerNorm``, learned positions and an untied head must run
entirely on the layer path, and its statistics must equal the per-example
path's.
"""

import functools
import re
from typing import Any
import warnings

from absl.testing import absltest
from absl.testing import parameterized
from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from fisher_optax import fisher

B, T, D, H, VOCAB = 3, 5, 8, 2, 7


class _LinenLM(nn.Module):
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, ids):
    kw: dict[str, Any] = dict(param_dtype=self.dtype, dtype=self.dtype)
    x = nn.Embed(VOCAB, D, **kw)(ids)
    pos = self.param("pos", nn.initializers.normal(0.5), (T, D), self.dtype)
    x = x + pos
    h = nn.LayerNorm(**kw)(x)
    mask = nn.make_causal_mask(jnp.ones(ids.shape))
    x = x + nn.MultiHeadDotProductAttention(num_heads=H, **kw)(h, h, mask=mask)
    h = nn.gelu(nn.Dense(2 * D, **kw)(nn.LayerNorm(**kw)(x)))
    x = x + nn.Dense(D, **kw)(h)
    return nn.Dense(VOCAB, **kw)(nn.LayerNorm(**kw)(x))


class _NnxLM(nnx.Module):
  def __init__(self, rngs, dtype):
    kw: dict[str, Any] = dict(param_dtype=dtype, dtype=dtype, rngs=rngs)
    self.embed = nnx.Embed(VOCAB, D, **kw)
    self.pos = nnx.Param(jax.random.normal(rngs.params(), (T, D), dtype) / 2)
    self.norm1 = nnx.LayerNorm(D, **kw)
    self.attn = nnx.MultiHeadAttention(H, D, decode=False, **kw)
    self.norm2 = nnx.LayerNorm(D, **kw)
    self.up = nnx.Linear(D, 2 * D, **kw)
    self.down = nnx.Linear(2 * D, D, **kw)
    self.norm = nnx.LayerNorm(D, **kw)
    self.head = nnx.Linear(D, VOCAB, **kw)

  def __call__(self, ids):
    x = self.embed(ids) + self.pos[...]
    h = self.norm1(x)
    mask = nnx.make_causal_mask(jnp.ones(ids.shape))
    x = x + self.attn(h, h, mask=mask)
    x = x + self.down(nnx.gelu(self.up(self.norm2(x))))
    return self.head(self.norm(x))


def _model(name: str, dtype):
  ids = jax.random.randint(jax.random.key(1), (B, T), 0, VOCAB)
  ids = ids.at[0, :2].set(1)  # a repeated token within an example
  if name == "linen":
    model = _LinenLM(dtype)
    params = jax.jit(model.init)(jax.random.key(0), ids)
    # Non-trivial norm scales and biases (their initial values are 1 and 0).
    params = jax.tree.map(
      lambda p: p + 0.3 * jax.random.normal(jax.random.key(3), p.shape, dtype),
      params,
    )
    return model.apply, params, ids
  graphdef, state = nnx.split(_NnxLM(nnx.Rngs(0), dtype))
  state = jax.tree.map(
    lambda p: p + 0.3 * jax.random.normal(jax.random.key(3), p.shape, dtype),
    state,
  )
  return (lambda st, x: nnx.merge(graphdef, st)(x)), state, ids


def _estimates(apply_fn, params, ids, kinds):
  """Diagonals of ``kinds`` and a top-4 low rank, on both paths."""
  targets = jnp.roll(ids, -1, axis=1)
  out = {}
  for method in ("auto", "per_example"):
    kw: dict[str, Any] = dict(likelihood=fisher.Categorical(), method=method)
    for kind in kinds:
      out[method, kind] = fisher.diagonal(
        apply_fn, params, (ids, targets), kind=kind, **kw
      ).diag
    if "exact" in kinds and len(kinds) > 1:
      top = fisher.low_rank(
        apply_fn, params, (ids, targets), kind="exact", rank=4, **kw
      )
      v = jax.tree.map(jnp.ones_like, params)
      out[method, "low_rank"] = (top.eigvals, top.matvec(v))
  return out


def _assert_tree_close(got, want, rtol):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())


class TransformerZooTest(parameterized.TestCase):
  @parameterized.parameters("linen", "nnx")
  def test_every_leaf_is_on_the_layer_path(self, name):
    apply_fn, params, ids = _model(name, jnp.float32)
    cov = fisher.coverage(apply_fn, params, ids)
    flat = jax.tree_util.tree_flatten_with_path(cov)[0]
    off = {jax.tree_util.keystr(p): c.reason for p, c in flat if not c}
    self.assertEqual(off, {})
    self.assertTrue(all(isinstance(c, fisher.LeafCoverage) for _, c in flat))
    # K-FAC factors: Dense kernels and vector biases, the attention output
    # projection (contracted axes first); not the (d, heads, head_dim) q/k/v
    # kernels, their (heads, head_dim) biases or the elementwise parameters.
    for path, c in flat:
      key = jax.tree_util.keystr(path)
      fallback = re.search(r"\['(query|key|value)'\]|norm|pos", key, re.I)
      self.assertEqual(c.kronecker, not fallback, key)

  @parameterized.parameters(
    ("linen", True, ("empirical", "exact")),
    ("nnx", True, ("empirical", "exact")),
    ("linen", False, ("exact",)),
  )
  def test_statistics_equal_the_per_example_path(self, name, x64, kinds):
    """Diagonal (empirical, exact) and low rank (Gram + combine)."""
    with jax.enable_x64(x64):
      dtype = jnp.float64 if x64 else jnp.float32
      apply_fn, params, ids = _model(name, dtype)
      run = jax.jit(functools.partial(_estimates, apply_fn), static_argnums=2)
      with warnings.catch_warnings():
        warnings.simplefilter("error", fisher.FisherFallbackWarning)
        out = run(params, ids, kinds)
      rtol = 1e-10 if x64 else 1e-5
      for key in [k for m, k in out if m == "auto"]:
        with self.subTest(key):
          _assert_tree_close(out["auto", key], out["per_example", key], rtol)


class FallbackWarningTest(absltest.TestCase):
  def test_warns_once_naming_the_leaves(self):
    def apply_fn(p, x):  # a convolution: no layer rule (yet)
      h = jax.lax.conv_general_dilated(x, p["conv"], (1,), "SAME")
      return h.reshape(x.shape[0], -1) @ p["w"]

    params = {"conv": jnp.ones((4, 2, 3)), "w": jnp.ones((4 * 6, 2)) / 9}
    x, y = jnp.ones((2, 2, 6)), jnp.array([0, 1])
    kw: dict[str, Any] = dict(likelihood=fisher.Categorical(), kind="empirical")
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      fisher.diagonal(apply_fn, params, (x, y), **kw)
      fisher.diagonal(apply_fn, params, (x, y), **kw)
      fisher.diagonal(apply_fn, params, (x, y), method="per_example", **kw)
    found = [w for w in caught if w.category is fisher.FisherFallbackWarning]
    self.assertLen(found, 1)
    self.assertIn("['conv']", str(found[0].message))
    self.assertIn("conv_general_dilated", str(found[0].message))
    self.assertEqual(found[0].filename, __file__)
    cov = fisher.coverage(apply_fn, params, x)
    self.assertEqual(cov["conv"].path, "per_example")
    self.assertEqual(cov["w"].path, "layer")


if __name__ == "__main__":
  absltest.main()
