# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The layer-statistics path on standard Flax layers (Linen and NNX).

A transformer LM built from Flax's own ``MultiHeadDotProductAttention`` /
``MultiHeadAttention`` (``DenseGeneral`` projections with 3-D kernels and
2-D biases), ``LayerNorm``, learned positions and an untied head must run
entirely on the layer path, and its statistics must equal the per-example
path's.
"""

from collections.abc import Callable
import functools
import math
import re
from typing import Any
from unittest import mock
import warnings

from absl.testing import absltest
from absl.testing import parameterized
from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from fisher_optax import fisher
from fisher_optax import flax as fo_flax
from fisher_optax.fisher import _taps as fisher_taps
from tests import fisher_testing

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


# -- stacked by scan (with remat), with a tied head ----------------------------

LAYERS = 2


class _LinenBlock(nn.Module):
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, _):
    kw: dict[str, Any] = dict(param_dtype=self.dtype, dtype=self.dtype)
    h = nn.LayerNorm(**kw)(x)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + nn.MultiHeadDotProductAttention(num_heads=H, **kw)(h, h, mask=mask)
    h = nn.gelu(nn.Dense(2 * D, **kw)(nn.LayerNorm(**kw)(x)))
    return x + nn.Dense(D, **kw)(h), None


class _LinenScanLM(nn.Module):
  """``nn.scan`` over ``nn.remat`` blocks, the head tied to the embedding."""

  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, ids):
    kw: dict[str, Any] = dict(param_dtype=self.dtype, dtype=self.dtype)
    embed = nn.Embed(VOCAB, D, **kw)
    pos = self.param("pos", nn.initializers.normal(0.5), (T, D), self.dtype)
    blocks = nn.scan(
      nn.remat(_LinenBlock),
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=LAYERS,
    )
    x, _ = blocks(self.dtype, name="blocks")(embed(ids) + pos, None)
    return embed.attend(nn.LayerNorm(**kw)(x))


class _NnxBlock(nnx.Module):
  def __init__(self, rngs, dtype):
    kw: dict[str, Any] = dict(param_dtype=dtype, dtype=dtype, rngs=rngs)
    self.norm1 = nnx.LayerNorm(D, **kw)
    self.attn = nnx.MultiHeadAttention(H, D, decode=False, **kw)
    self.norm2 = nnx.LayerNorm(D, **kw)
    self.up = nnx.Linear(D, 2 * D, **kw)
    self.down = nnx.Linear(2 * D, D, **kw)

  def __call__(self, x):
    h = self.norm1(x)
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + self.attn(h, h, mask=mask)
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class _NnxScanLM(nnx.Module):
  """``nnx.vmap``-built blocks run by ``nnx.scan`` over ``nnx.remat``."""

  def __init__(self, rngs, dtype):
    kw: dict[str, Any] = dict(param_dtype=dtype, dtype=dtype, rngs=rngs)
    self.embed = nnx.Embed(VOCAB, D, **kw)
    self.pos = nnx.Param(jax.random.normal(rngs.params(), (T, D), dtype) / 2)

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return _NnxBlock(rngs, dtype)

    self.blocks = make(rngs)
    self.norm = nnx.LayerNorm(D, **kw)

  def __call__(self, ids):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def run(x, block):
      return block(x)

    x = run(self.embed(ids) + self.pos[...], self.blocks)
    return self.embed.attend(self.norm(x))


def _perturbed(params, dtype):
  """Non-trivial norm scales and biases (their initial values are 1 and 0),
  added in NumPy: no compile per leaf shape."""
  noise = lambda p: jnp.asarray(
    np.asarray(p)
    + 0.3 * np.asarray(fisher_testing.normal(jax.random.key(3), p.shape)),
    dtype,
  )
  return jax.tree.map(noise, params)


def _cached(build: Callable) -> Callable:
  """Builds each model once per test process (and per x64 mode): init and
  its compiles are a large share of this module's time otherwise."""
  cache = functools.cache(lambda name, dtype, x64: build(name, dtype))
  return functools.wraps(build)(
    lambda name, dtype: cache(name, jnp.dtype(dtype), jax.config.x64_enabled)
  )


def _functional(model: Any, x: Any, dtype) -> tuple[Callable, Any]:
  """``(apply_fn, params)`` of a Linen or NNX model, the parameters
  perturbed (:func:`_perturbed`)."""
  if isinstance(model, nnx.Module):
    graphdef, state = nnx.split(model)
    apply_fn = lambda st, inp: nnx.merge(graphdef, st)(inp)
    return apply_fn, _perturbed(state, dtype)
  init = jax.jit(model.init)(jax.random.key(0), x)
  return model.apply, _perturbed(init, dtype)


@_cached
def _model(name: str, dtype):
  ids = np.random.default_rng(1).integers(0, VOCAB, (B, T), dtype=np.int32)
  ids[0, :2] = 1  # a repeated token within an example
  ids = jnp.asarray(ids)
  if name in ("linen", "linen_scan"):
    model = (_LinenLM if name == "linen" else _LinenScanLM)(dtype)
  else:
    model = (_NnxLM if name == "nnx" else _NnxScanLM)(nnx.Rngs(0), dtype)
  return (*_functional(model, ids, dtype), ids)


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
  """Leafwise to ``rtol`` of each leaf's scale; a leaf that is zero in exact
  arithmetic (attention's key bias: softmax ignores it) is rounding noise,
  held to a few ulps of the whole statistic's scale."""
  leaves = [np.asarray(b) for b in jax.tree.leaves(want)]
  top = max(float(np.abs(b).max()) for b in leaves)
  for a, b in zip(jax.tree.leaves(got), leaves):
    a = np.asarray(a)
    noise = 100 * np.finfo(b.dtype).eps * top
    atol = max(rtol * float(np.abs(b).max()), noise)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


class TransformerZooTest(parameterized.TestCase):
  @parameterized.parameters("linen", "nnx")
  def test_every_leaf_is_on_the_layer_path(self, name):
    apply_fn, params, ids = _model(name, jnp.float32)
    cov = fisher.coverage(apply_fn, params, ids)
    flat = jax.tree_util.tree_flatten_with_path(cov)[0]
    off = {jax.tree_util.keystr(p): c.reason for p, c in flat if not c}
    self.assertEqual(off, {})
    self.assertTrue(all(isinstance(c, fisher.LeafCoverage) for _, c in flat))
    # K-FAC factors: Dense kernels and biases, the (d, heads, head_dim) q/k/v
    # kernels, their (heads, head_dim) biases and the output projection;
    # not the elementwise parameters (norms, positions).
    for path, c in flat:
      key = jax.tree_util.keystr(path)
      fallback = re.search(r"norm|pos", key, re.I)
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
      if x64 and name == "nnx":
        # nnx.MultiHeadAttention takes its softmax in float32 whatever the
        # dtype: two orders of the same float64 sums round differently
        # there (the layer path pulls the exact kind's samples back one at
        # a time, the per-example path all at once).
        rtol = 1e-6
      for key in [k for m, k in out if m == "auto"]:
        with self.subTest(key):
          _assert_tree_close(out["auto", key], out["per_example", key], rtol)


class ScanAndTiedZooTest(parameterized.TestCase):
  """The same blocks stacked by ``nn.scan``/``nnx.scan`` (rematerialised),
  their leaves ``(LAYERS, ...)``, with the head tied to the embedding."""

  @parameterized.parameters(("linen_scan", True), ("nnx_scan", False))
  def test_every_leaf_on_the_layer_path_and_exact(self, name, x64):
    """Every leaf is covered, and the diagonal, Gram matrix and weighted sums
    of the pseudo-gradients ``g_{s,n}`` (every estimator's layer statistics;
    the Fisher kinds only change the cotangents), in chunks of 2 where
    gradients are formed, and the one-pass gradient of the empirical kind
    equal the per-example ones."""
    with jax.enable_x64(x64):
      dtype = jnp.float64 if x64 else jnp.float32
      apply_fn, params, ids = _model(name, dtype)
      flat = jax.tree_util.tree_flatten_with_path(
        fisher.coverage(apply_fn, params, ids)
      )[0]
      off = {jax.tree_util.keystr(p): c.reason for p, c in flat if not c}
      self.assertEqual(off, {})
      for path, c in flat:
        key = jax.tree_util.keystr(path)
        if "blocks" in key:
          self.assertIn("stacked along the iterations of a scan", c.reason)
        if "embedding" in key:
          self.assertIn("shared by 2 uses", c.reason)
        # K-FAC factors per layer for the stacked kernels and biases; none
        # for the elementwise or shared (tied embedding) leaves.
        want = "blocks" in key and not re.search(r"norm", key, re.I)
        self.assertEqual(c.kronecker, want, key)
      num_s = 2
      cot = jax.random.normal(jax.random.key(4), (num_s, B, T, VOCAB), dtype)
      weights = jax.random.normal(jax.random.key(5), (2, num_s * B), dtype)

      @jax.jit
      def run(params, ids, cot, weights):
        def one(x, r):  # g_{s,n} of one example n, all s
          _, vjp = jax.vjp(lambda p: apply_fn(p, x[None])[0], params)
          return jax.vmap(lambda rs: vjp(rs)[0])(r)

        g = jax.vmap(one, in_axes=(0, 1))(ids, cot)  # (B, S, ...)
        g = jax.tree.map(
          lambda a: jnp.swapaxes(a, 0, 1).reshape((-1,) + a.shape[2:]), g
        )  # rows s * B + n
        tape = fisher_taps.record(apply_fn, params, ids)
        grads = tape.backward(cot)
        # The empirical kind's single backward pass (gradient and deltas).
        grad, first = tape.gradient(cot[0])
        # The stacked leaves' statistic formed inside the backward pass.
        fused = fisher_taps.record(
          apply_fn, params, ids, statistic="diag", chunk_size=2
        )
        fused_grad, fused_first = fused.gradient(cot[0])
        kron = {}
        for mode in ("expand", "reduce"):
          kw = dict(weight_sharing=mode)
          kron[mode] = (
            grads.statistics("kron", **kw),
            fisher_taps.record(apply_fn, params, ids, statistic="kron", **kw)
            .backward(cot)
            .statistics("kron", **kw),
          )
        # Low rank's two fused passes, one sample: the Gram matrix, then the
        # weighted sums with the weights carried into the backward pass.
        w0 = weights[:, :B]
        low_rank = (
          fisher_taps.record(
            apply_fn, params, ids, statistic="gram", chunk_size=2
          )
          .gradient(cot[0])[1]
          .statistics("gram", chunk_size=2),
          fisher_taps.record(
            apply_fn, params, ids, statistic="combine", weights=w0
          )
          .backward(cot[:1])
          .combine(w0),
        )
        return g, (
          grads.statistics("diag", chunk_size=2),
          grads.statistics("gram", chunk_size=2),
          grads.combine(weights),
          grad,
          first.statistics("diag"),
          fused.backward(cot).statistics("diag", chunk_size=2),
          fused_grad,
          fused_first.statistics("diag"),
          kron,
          low_rank,
        )

      g, out = run(params, ids, cot, weights)
      diag, gram, combine, grad, first, *fused_out, kron, low_rank = out
      fused_diag, fused_grad, fused_first = fused_out
      rtol = 1e-10 if x64 else 1e-5
      # References in NumPy: eager jnp would compile each op per leaf shape.
      g, weights = jax.tree.map(np.asarray, (g, weights))
      flat = jax.tree_util.tree_flatten_with_path(g)[0]
      rows = np.concatenate([a.reshape(num_s * B, -1) for _, a in flat], 1)
      _assert_tree_close([gram], [rows @ rows.T], rtol)
      _assert_tree_close([low_rank[0]], [rows[:B] @ rows[:B].T], rtol)
      for mode, (want, got) in kron.items():
        with self.subTest(f"kron {mode}, fused"):
          is_pair = lambda v: v is None or isinstance(v, tuple)
          nones = lambda t: jax.tree.leaves(
            jax.tree.map(lambda v: v is None, t, is_leaf=is_pair)
          )
          self.assertEqual(nones(got), nones(want))
          self.assertTrue(any(v is not None for v in jax.tree.leaves(got)))
          _assert_tree_close(got, want, rtol)
      for (path, gi), d, c, g0, d0, fd, fg, fd0, fc in zip(
        flat,
        jax.tree.leaves(diag),
        jax.tree.leaves(combine),
        jax.tree.leaves(grad),
        jax.tree.leaves(first),
        jax.tree.leaves(fused_diag),
        jax.tree.leaves(fused_grad),
        jax.tree.leaves(fused_first),
        jax.tree.leaves(low_rank[1]),
      ):
        key = jax.tree_util.keystr(path)
        if "['key']['bias']" in key:
          # Softmax ignores a key bias: its gradient is 0 and both paths
          # return roundoff.
          continue
        with self.subTest(key):
          _assert_tree_close([d], [np.sum(gi**2, 0)], rtol)
          _assert_tree_close([c], [np.tensordot(weights, gi, 1)], rtol)
          _assert_tree_close([g0], [np.sum(gi[:B], 0)], rtol)
          _assert_tree_close([d0], [np.sum(gi[:B] ** 2, 0)], rtol)
          _assert_tree_close([fd], [np.sum(gi**2, 0)], rtol)
          _assert_tree_close([fg], [np.sum(gi[:B], 0)], rtol)
          _assert_tree_close([fd0], [np.sum(gi[:B] ** 2, 0)], rtol)
          _assert_tree_close(
            [fc], [np.tensordot(weights[:, :B], gi[:B], 1)], rtol
          )

  @parameterized.parameters(("linen_scan", True), ("nnx_scan", False))
  def test_low_rank_in_two_fused_passes(self, name, x64):
    """``low_rank`` of one sample per example forms the stacked layers' Gram
    matrix, then their weighted sums, inside two backward passes: equal
    to the per-example path."""
    with jax.enable_x64(x64):
      dtype = jnp.float64 if x64 else jnp.float32
      apply_fn, params, ids = _model(name, dtype)
      targets = jnp.roll(ids, -1, axis=1)
      v = jax.tree.map(jnp.ones_like, params)

      @jax.jit
      def run(params, ids, targets, key):
        out = {}
        for method in ("auto", "per_example"):
          for kind in ("empirical", "mc"):
            top = fisher.low_rank(
              apply_fn,
              params,
              (ids, targets),
              likelihood=fisher.Categorical(),
              kind=kind,
              key=key,
              rank=4,
              method=method,
            )
            out[method, kind] = (top.eigvals, top.matvec(v))
        return out

      out = run(params, ids, targets, jax.random.key(3))
      rtol = 1e-10 if x64 else 1e-5
      for kind in ("empirical", "mc"):
        with self.subTest(kind):
          _assert_tree_close(out["auto", kind], out["per_example", kind], rtol)

  @parameterized.parameters(
    ("linen_scan", 0, "empirical"),
    ("nnx", 2, "empirical"),
    ("linen_scan", 0, "exact"),
  )
  def test_kronecker_norms_and_positions_take_shampoo_factors(
    self, name, num_iters, kind
  ):
    """Leaves without K-FAC factors (norm scales and biases, stacked or not,
    learned positions) get the per-example path's Shampoo-style factors,
    formed from their per-example gradients on the layer path (with one
    class per backward pass, summed a pass at a time)."""
    with jax.enable_x64(True):
      apply_fn, params, ids = _model(name, jnp.float64)
      targets = jnp.roll(ids, -1, axis=1)
      kw: dict[str, Any] = dict(
        likelihood=fisher.Categorical(), kind=kind, num_iters=num_iters
      )

      @jax.jit
      def run(params, ids, targets):
        return (
          fisher.kronecker(apply_fn, params, (ids, targets), **kw),
          fisher.kronecker(
            apply_fn,
            params,
            (ids, targets),
            method="per_example",
            estimator="shampoo",
            **kw,
          ),
        )

      stat, ref = run(params, ids, targets)
      self.assertEqual(stat.estimator, "mixed")
      cov = fisher.coverage(apply_fn, params, ids)
      flat = jax.tree_util.tree_flatten_with_path(cov)[0]
      checked = 0
      for (path, c), l, r, l0, r0 in zip(
        flat,
        jax.tree.leaves(stat.left),
        jax.tree.leaves(stat.right),
        jax.tree.leaves(ref.left),
        jax.tree.leaves(ref.right),
      ):
        if c.kronecker:
          continue
        checked += 1
        with self.subTest(jax.tree_util.keystr(path)):
          _assert_tree_close([l, r], [l0, r0], 1e-10)
      self.assertGreaterEqual(checked, 3)


# -- convolutions: a small CNN and a ViT-style block ---------------------------

IMG, CH, CLASSES, PATCH = 8, 3, 4, 4


class _LinenCNN(nn.Module):
  """Conv, GroupNorm, a strided conv, a grouped conv (dilated), a depthwise
  1x1 conv, global pooling and a Dense head."""

  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    kw: dict[str, Any] = dict(param_dtype=self.dtype, dtype=self.dtype)
    x = nn.relu(nn.GroupNorm(num_groups=2, **kw)(nn.Conv(4, (3, 3), **kw)(x)))
    x = nn.relu(nn.Conv(4, (3, 3), strides=2, padding="VALID", **kw)(x))
    x = nn.Conv(4, (2, 2), kernel_dilation=2, feature_group_count=2, **kw)(x)
    x = nn.Conv(4, (1, 1), feature_group_count=4, **kw)(jnp.tanh(x))
    return nn.Dense(CLASSES, **kw)(jnp.mean(x, axis=(1, 2)))


class _ConvBlock(nn.Module):
  """A conv, a GroupNorm and a depthwise conv: one layer of a scanned stack."""

  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, _):
    kw: dict[str, Any] = dict(param_dtype=self.dtype, dtype=self.dtype)
    x = nn.relu(nn.GroupNorm(num_groups=2, **kw)(nn.Conv(4, (3, 3), **kw)(x)))
    return nn.Conv(4, (1, 1), feature_group_count=4, **kw)(x), None


class _WeightNormBlock(nn.Module):
  """A weight-normed conv and Dense: one layer of a scanned stack."""

  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, _):
    kw: dict[str, Any] = dict(param_dtype=self.dtype, dtype=self.dtype)
    wn: dict[str, Any] = dict(param_dtype=self.dtype, dtype=self.dtype)
    h = nn.relu(nn.WeightNorm(nn.Conv(4, (3, 3), **kw), **wn)(x))
    return x + jnp.tanh(nn.WeightNorm(nn.Dense(4, **kw), **wn)(h)), None


class _LinenScanCNN(nn.Module):
  """A strided conv, then conv blocks run by ``nn.scan``, pooling and a Dense
  head: stacked over ``nn.remat`` (each layer its own kernels), or with
  ``shared`` one block applied three times (``variable_broadcast``: every
  iteration shares its kernels, like a recurrent cell). ``block``: the
  layer (weight-normed blocks compute their kernels inside the body)."""

  dtype: jnp.dtype = jnp.float32
  shared: bool = False
  block: Any = _ConvBlock

  @nn.compact
  def __call__(self, x):
    kw: dict[str, Any] = dict(param_dtype=self.dtype, dtype=self.dtype)
    x = nn.relu(nn.Conv(4, (3, 3), strides=2, **kw)(x))
    if self.shared:
      stack = nn.scan(
        self.block,
        variable_broadcast="params",
        split_rngs={"params": False},
        length=3,
      )
    else:
      stack = nn.scan(
        nn.remat(self.block),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=2,
      )
    x, _ = stack(self.dtype)(x, None)
    return nn.Dense(CLASSES, **kw)(jnp.mean(x, axis=(1, 2)))


class _NnxCNN(nnx.Module):
  def __init__(self, rngs, dtype):
    kw: dict[str, Any] = dict(param_dtype=dtype, dtype=dtype, rngs=rngs)
    self.conv1 = nnx.Conv(CH, 4, (3, 3), **kw)
    self.norm = nnx.GroupNorm(4, num_groups=2, **kw)
    self.conv2 = nnx.Conv(4, 4, (3, 3), strides=2, padding="VALID", **kw)
    self.conv3 = nnx.Conv(
      4, 4, (2, 2), kernel_dilation=2, feature_group_count=2, **kw
    )
    self.conv4 = nnx.Conv(4, 4, (1, 1), feature_group_count=4, **kw)
    self.head = nnx.Linear(4, CLASSES, **kw)

  def __call__(self, x):
    x = nnx.relu(self.norm(self.conv1(x)))
    x = nnx.relu(self.conv2(x))
    x = self.conv4(jnp.tanh(self.conv3(x)))
    return self.head(jnp.mean(x, axis=(1, 2)))


class _NnxConvBlock(nnx.Module):
  def __init__(self, rngs, dtype):
    kw: dict[str, Any] = dict(param_dtype=dtype, dtype=dtype, rngs=rngs)
    self.conv = nnx.Conv(4, 4, (3, 3), **kw)
    self.norm = nnx.GroupNorm(4, num_groups=2, **kw)
    self.depthwise = nnx.Conv(4, 4, (1, 1), feature_group_count=4, **kw)

  def __call__(self, x):
    return self.depthwise(nnx.relu(self.norm(self.conv(x))))


class _NnxScanCNN(nnx.Module):
  """``nnx.vmap``-built conv blocks run by ``nnx.scan`` over ``nnx.remat``."""

  def __init__(self, rngs, dtype):
    kw: dict[str, Any] = dict(param_dtype=dtype, dtype=dtype, rngs=rngs)
    self.stem = nnx.Conv(CH, 4, (3, 3), strides=2, **kw)

    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return _NnxConvBlock(rngs, dtype)

    self.blocks = make(rngs)
    self.head = nnx.Linear(4, CLASSES, **kw)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def run(x, block):
      return block(x)

    x = run(nnx.relu(self.stem(x)), self.blocks)
    return self.head(jnp.mean(x, axis=(1, 2)))


class _NnxSharedCNN(nnx.Module):
  """One conv block applied three times by ``nnx.scan`` (the block a
  broadcast argument: every iteration shares its kernels), under
  ``nnx.remat``."""

  def __init__(self, rngs, dtype):
    kw: dict[str, Any] = dict(param_dtype=dtype, dtype=dtype, rngs=rngs)
    self.stem = nnx.Conv(CH, 4, (3, 3), strides=2, **kw)
    self.block = _NnxConvBlock(rngs, dtype)
    self.head = nnx.Linear(4, CLASSES, **kw)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, None), out_axes=nnx.Carry, length=3)
    @nnx.remat
    def run(x, block):
      return block(x)

    x = run(nnx.relu(self.stem(x)), self.block)
    return self.head(jnp.mean(x, axis=(1, 2)))


class _LinenViT(nn.Module):
  """A patch embedding (a conv with stride = kernel size), learned
  positions, one pre-norm attention block and a pooled Dense head."""

  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    kw: dict[str, Any] = dict(param_dtype=self.dtype, dtype=self.dtype)
    x = nn.Conv(D, (PATCH, PATCH), strides=PATCH, padding="VALID", **kw)(x)
    x = x.reshape(x.shape[0], -1, D)
    pos = self.param(
      "pos", nn.initializers.normal(0.5), x.shape[1:], self.dtype
    )
    x = x + pos
    h = nn.LayerNorm(**kw)(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=H, **kw)(h, h)
    return nn.Dense(CLASSES, **kw)(jnp.mean(nn.LayerNorm(**kw)(x), axis=1))


class _NnxViT(nnx.Module):
  def __init__(self, rngs, dtype):
    kw: dict[str, Any] = dict(param_dtype=dtype, dtype=dtype, rngs=rngs)
    self.patch = nnx.Conv(
      CH, D, (PATCH, PATCH), strides=PATCH, padding="VALID", **kw
    )
    tokens = (IMG // PATCH) ** 2
    self.pos = nnx.Param(
      jax.random.normal(rngs.params(), (tokens, D), dtype) / 2
    )
    self.norm1 = nnx.LayerNorm(D, **kw)
    self.attn = nnx.MultiHeadAttention(H, D, decode=False, **kw)
    self.norm2 = nnx.LayerNorm(D, **kw)
    self.head = nnx.Linear(D, CLASSES, **kw)

  def __call__(self, x):
    x = self.patch(x)
    x = x.reshape(x.shape[0], -1, D) + self.pos[...]
    h = self.norm1(x)
    x = x + self.attn(h, h)
    return self.head(jnp.mean(self.norm2(x), axis=1))


class _BNBlock(nn.Module):
  """A residual conv block with BatchNorm: one layer of a scanned stack."""

  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, _):
    kw: dict[str, Any] = dict(param_dtype=self.dtype, dtype=self.dtype)
    y = nn.Conv(4, (3, 3), use_bias=False, **kw)(x)
    return x + nn.relu(nn.BatchNorm(use_running_average=True, **kw)(y)), None


class _LinenBNCNN(nn.Module):
  """BatchNorm with running statistics (as in evaluation, or a frozen
  backbone): a conv stem, residual blocks stacked by ``nn.scan``, and a
  head kernel that enters times a constant (a muP-style multiplier)."""

  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    kw: dict[str, Any] = dict(param_dtype=self.dtype, dtype=self.dtype)
    x = nn.Conv(4, (3, 3), strides=2, use_bias=False, **kw)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=True, **kw)(x))
    stack = nn.scan(
      nn.remat(_BNBlock),
      variable_axes={"params": 0, "batch_stats": 0},
      split_rngs={"params": True},
      length=2,
    )
    x, _ = stack(self.dtype)(x, None)
    w = self.param("head", nn.initializers.normal(1.0), (4, CLASSES))
    return jnp.mean(x, axis=(1, 2)) @ (w.astype(self.dtype) * 0.25)


class _NnxBNBlock(nnx.Module):
  def __init__(self, rngs, dtype):
    kw: dict[str, Any] = dict(param_dtype=dtype, dtype=dtype, rngs=rngs)
    self.conv = nnx.Conv(4, 4, (3, 3), use_bias=False, **kw)
    self.norm = nnx.BatchNorm(4, use_running_average=True, **kw)

  def __call__(self, x):
    return x + nnx.relu(self.norm(self.conv(x)))


class _NnxBNCNN(nnx.Module):
  def __init__(self, rngs, dtype):
    kw: dict[str, Any] = dict(param_dtype=dtype, dtype=dtype, rngs=rngs)
    self.stem = nnx.Conv(CH, 4, (3, 3), strides=2, use_bias=False, **kw)
    self.norm = nnx.BatchNorm(4, use_running_average=True, **kw)

    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return _NnxBNBlock(rngs, dtype)

    self.blocks = make(rngs)
    self.head = nnx.Param(jax.random.normal(rngs.params(), (4, CLASSES), dtype))

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def run(x, block):
      return block(x)

    x = run(nnx.relu(self.norm(self.stem(x))), self.blocks)
    return jnp.mean(x, axis=(1, 2)) @ (self.head[...] * 0.25)


class _StdConv(nn.Module):
  """A conv with a weight-standardised kernel (BiT's ``StdConv``): zero mean
  and unit variance per output channel, computed from the kernel alone."""

  features: int
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    shape = (3, 3, x.shape[-1], self.features)
    w = self.param("kernel", nn.initializers.lecun_normal(), shape, self.dtype)
    w = (w - w.mean((0, 1, 2))) / jnp.sqrt(w.var((0, 1, 2)) + 1e-5)
    dn = ("NHWC", "HWIO", "NHWC")
    return jax.lax.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=dn
    )


class _LinenDerivedCNN(nn.Module):
  """Kernels computed from parameters before use: a weight-normed conv, a
  weight-standardised conv, a spectral-normed Dense (power iteration on
  its kernel, the ``u`` estimate a constant) and a softplus-parameterised
  temperature on the logits."""

  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    kw: dict[str, Any] = dict(param_dtype=self.dtype, dtype=self.dtype)
    x = nn.relu(nn.WeightNorm(nn.Conv(4, (3, 3), strides=2, **kw))(x))
    x = jnp.tanh(_StdConv(4, self.dtype)(x))
    h = nn.SpectralNorm(nn.Dense(6, **kw))(
      jnp.mean(x, (1, 2)), update_stats=False
    )
    t = self.param("log_t", nn.initializers.zeros, (), self.dtype)
    return nn.Dense(CLASSES, **kw)(jnp.tanh(h)) * jax.nn.softplus(t + 0.5)


class _NnxDerivedCNN(nnx.Module):
  """NNX weight-normed conv and Dense head around a masked conv (a fixed
  sparsity pattern on the kernel)."""

  def __init__(self, rngs, dtype):
    kw: dict[str, Any] = dict(param_dtype=dtype, dtype=dtype, rngs=rngs)
    wn: dict[str, Any] = dict(param_dtype=dtype, rngs=rngs)
    self.conv1 = nnx.WeightNorm(nnx.Conv(CH, 4, (3, 3), **kw), **wn)
    self.conv2 = nnx.Conv(4, 4, (3, 3), strides=2, **kw)
    self.head = nnx.WeightNorm(nnx.Linear(4, CLASSES, **kw), **wn)

  def __call__(self, x):
    x = nnx.relu(self.conv1(x))
    mask = np.arange(3 * 3 * 4 * 4).reshape(3, 3, 4, 4) % 3 != 0
    k = self.conv2.kernel[...] * jnp.asarray(mask, x.dtype)
    dn = ("NHWC", "HWIO", "NHWC")
    x = jax.lax.conv_general_dilated(x, k, (2, 2), "SAME", dimension_numbers=dn)
    x = jnp.tanh(x + self.conv2.bias[...])
    return self.head(jnp.mean(x, axis=(1, 2)))


def _running_stats(stats, dtype):
  """BatchNorm running means and variances far from their initial 0 and 1
  (positive, so that every ``rsqrt(var + eps)`` is finite)."""
  stats = _perturbed(stats, dtype)
  return jax.tree.map(lambda a: jnp.asarray(np.abs(a) + 0.1, dtype), stats)


@_cached
def _conv_model(
  name: str, dtype
) -> tuple[Callable[[Any, Any], Any], Any, jax.Array]:
  x = fisher_testing.normal(jax.random.key(1), (B, IMG, IMG, CH), dtype)
  if name == "linen_bn_cnn":  # the running statistics are constants
    model = _LinenBNCNN(dtype)
    variables = jax.jit(model.init)(jax.random.key(0), x)
    params = _perturbed(variables["params"], dtype)
    stats = _running_stats(variables["batch_stats"], dtype)
    return (
      (lambda p, inp: model.apply({"params": p, "batch_stats": stats}, inp)),
      params,
      x,
    )
  if name == "linen_derived_cnn":  # SpectralNorm's u is a constant
    model = _LinenDerivedCNN(dtype)
    variables = jax.jit(model.init)(jax.random.key(0), x)
    params = _perturbed(variables["params"], dtype)
    stats = variables["batch_stats"]
    return (
      (lambda p, inp: model.apply({"params": p, "batch_stats": stats}, inp)),
      params,
      x,
    )
  if name == "nnx_bn_cnn":
    graphdef, params, rest = nnx.split(
      _NnxBNCNN(nnx.Rngs(0), dtype), nnx.Param, ...
    )
    params, rest = _perturbed(params, dtype), _running_stats(rest, dtype)

    def apply_fn(p, inp):  # fresh Variables for the constants in each trace
      return nnx.merge(graphdef, p, jax.tree.map(jnp.asarray, rest))(inp)

    return apply_fn, params, x
  if name.startswith("linen"):
    model = {
      "linen_cnn": _LinenCNN,
      "linen_scan_cnn": _LinenScanCNN,
      "linen_shared_cnn": functools.partial(_LinenScanCNN, shared=True),
      "linen_vit": _LinenViT,
      "linen_derived_scan_cnn": functools.partial(
        _LinenScanCNN, block=_WeightNormBlock
      ),
      "linen_derived_shared_cnn": functools.partial(
        _LinenScanCNN, shared=True, block=_WeightNormBlock
      ),
    }[name](dtype)
    return (*_functional(model, x, dtype), x)
  cls = {
    "nnx_cnn": _NnxCNN,
    "nnx_scan_cnn": _NnxScanCNN,
    "nnx_shared_cnn": _NnxSharedCNN,
    "nnx_vit": _NnxViT,
    "nnx_derived_cnn": _NnxDerivedCNN,
  }[name]
  return (*_functional(cls(nnx.Rngs(0), dtype), x, dtype), x)


def _check_layer_statistics(test, apply_fn, params, inputs, cot, rtol):
  """Diagonal, Gram matrix and weighted sums of the pseudo-gradients
  ``g_{s,n}`` (in chunks of 2 where gradients are formed), and the one-pass
  gradient, against per-example VJPs."""
  num_s = cot.shape[0]
  weights = jax.random.normal(jax.random.key(5), (2, num_s * B), cot.dtype)

  @jax.jit
  def run(params, inputs, cot, weights):
    def one(x, r):  # g_{s,n} of one example n, all s
      _, vjp = jax.vjp(lambda p: apply_fn(p, x[None])[0], params)
      return jax.vmap(lambda rs: vjp(rs)[0])(r)

    g = jax.vmap(one, in_axes=(0, 1))(inputs, cot)  # (B, S, ...)
    g = jax.tree.map(
      lambda a: jnp.swapaxes(a, 0, 1).reshape((-1,) + a.shape[2:]), g
    )  # rows s * B + n
    tape = fisher_taps.record(apply_fn, params, inputs)
    grads = tape.backward(cot)
    grad, first = tape.gradient(cot[0])
    return g, (
      grads.statistics("diag", chunk_size=2),
      grads.statistics("gram", chunk_size=2),
      grads.combine(weights),
      grad,
      first.statistics("diag"),
    )

  g, (diag, gram, combine, grad, first) = run(params, inputs, cot, weights)
  # References in NumPy: eager jnp would compile each op per leaf shape.
  g, weights = jax.tree.map(np.asarray, (g, weights))
  flat = jax.tree_util.tree_flatten_with_path(g)[0]
  rows = np.concatenate([a.reshape(num_s * B, -1) for _, a in flat], 1)
  _assert_tree_close([gram], [rows @ rows.T], rtol)
  for (path, gi), d, c, g0, d0 in zip(
    flat,
    jax.tree.leaves(diag),
    jax.tree.leaves(combine),
    jax.tree.leaves(grad),
    jax.tree.leaves(first),
  ):
    key = jax.tree_util.keystr(path)
    if "['key']['bias']" in key:
      continue  # softmax ignores a key bias: both paths return roundoff
    with test.subTest(key):
      _assert_tree_close([d], [np.sum(gi**2, 0)], rtol)
      _assert_tree_close([c], [np.tensordot(weights, gi, 1)], rtol)
      _assert_tree_close([g0], [np.sum(gi[:B], 0)], rtol)
      _assert_tree_close([d0], [np.sum(gi[:B] ** 2, 0)], rtol)


class ConvZooTest(parameterized.TestCase):
  """A CNN (plain, strided, dilated, grouped and depthwise convs) and a
  ViT-style block (a patch-embedding conv and Flax attention)."""

  @parameterized.parameters(
    ("linen_cnn", True),
    ("nnx_cnn", False),
    ("linen_vit", False),
    ("nnx_vit", True),
    ("linen_scan_cnn", True),
    ("nnx_scan_cnn", False),
    ("linen_shared_cnn", False),
    ("nnx_shared_cnn", True),
    ("linen_bn_cnn", True),
    ("nnx_bn_cnn", False),
    ("linen_derived_cnn", True),
    ("nnx_derived_cnn", False),
    ("linen_derived_scan_cnn", True),
    ("linen_derived_shared_cnn", False),
  )
  def test_every_leaf_on_the_layer_path_and_exact(self, name, x64):
    with jax.enable_x64(x64):
      dtype = jnp.float64 if x64 else jnp.float32
      apply_fn, params, x = _conv_model(name, dtype)
      flat = jax.tree_util.tree_flatten_with_path(
        fisher.coverage(apply_fn, params, x)
      )[0]
      off = {jax.tree_util.keystr(p): c.reason for p, c in flat if not c}
      self.assertEqual(off, {})
      convs = [c for p, c in flat if "conv_general_dilated" in c.reason]
      # K-FAC factors for ungrouped convs (the first two, the patch
      # embedding), not grouped ones.
      want = {
        "linen_scan_cnn": [True, True, False],  # stacked: factors per layer
        "nnx_scan_cnn": [True, False, True],
        # Kernels shared by a scan's iterations: per-example gradients
        # summed over the iterations, no K-FAC factors.
        "linen_shared_cnn": [True, False, False],
        "nnx_shared_cnn": [False, False, True],
        "linen_vit": [True],
        "nnx_vit": [True],
        "linen_bn_cnn": [True, True],  # the stem, the stacked block's
        "nnx_bn_cnn": [True, True],
        # Kernels computed from parameters (and a WeightNorm scale): a VJP
        # per example, no factors.
        "linen_derived_cnn": [False] * 3,
        "nnx_derived_cnn": [False] * 3,
        # the stem; the stacked weight-normed conv's kernel and scale
        "linen_derived_scan_cnn": [True, False, False],
        "linen_derived_shared_cnn": [True, False, False],
      }.get(name, [True, True, False, False])
      self.assertEqual([c.kronecker for c in convs], want)
      rtol = 1e-10 if x64 else 1e-5
      cot = jax.random.normal(jax.random.key(4), (2, B, CLASSES), dtype)
      for mode in ("expand", "reduce"):
        kron = jax.eval_shape(  # shapes only (the values: below)
          lambda p, x, c, mode=mode: (
            fisher_taps.record(apply_fn, p, x)
            .backward(c)
            .statistics("kron", weight_sharing=mode)
          ),
          params,
          x,
          cot,
        )
        leaves = jax.tree.leaves(params)
        for (path, c), f, p in zip(
          flat,
          jax.tree.leaves(
            kron, is_leaf=lambda v: v is None or isinstance(v, tuple)
          ),
          leaves,
        ):
          key = jax.tree_util.keystr(path)
          with self.subTest(f"{mode}{key}"):
            self.assertEqual(f is not None, c.kronecker)
            if f is not None:  # square factors of a row-major view
              stacked = "Scan" in key or "blocks" in key
              if stacked and "shared" not in name:  # one pair per layer
                self.assertEqual(f[0].shape[0], p.shape[0])
                self.assertEqual(f[1].shape[0], p.shape[0])
                p = p[0]
              rows, cols = f[0].shape[-1], f[1].shape[-1]
              self.assertEqual(f[0].shape[-2:], (rows, rows))
              self.assertEqual(f[1].shape[-2:], (cols, cols))
              self.assertEqual(rows * cols, p.size)
              lead = [math.prod(p.shape[:k]) for k in range(p.ndim + 1)]
              self.assertIn(rows, lead)
      _check_layer_statistics(self, apply_fn, params, x, cot, rtol)

  @parameterized.parameters(
    "linen_cnn",
    "nnx_vit",
    "linen_scan_cnn",
    "nnx_shared_cnn",
    "nnx_bn_cnn",
    "linen_derived_cnn",
    "linen_derived_scan_cnn",
    "linen_derived_shared_cnn",
  )
  def test_estimators_equal_the_per_example_path(self, name):
    """``method="auto"`` (no fallback warning) against ``"per_example"``:
    diagonals of the empirical and exact Fisher and a top-4 low rank."""
    with jax.enable_x64(True):
      apply_fn, params, x = _conv_model(name, jnp.float64)
      y = jnp.arange(B) % CLASSES
      out = fisher_testing.estimates_by_path(apply_fn, params, (x, y), rank=4)
      for key in ("empirical", "exact", "low_rank"):
        with self.subTest(key):
          _assert_tree_close(out["auto", key], out["per_example", key], 1e-10)

  @parameterized.parameters("linen_cnn", "nnx_cnn")
  def test_ordered_layers_equal_the_per_example_path(self, name):
    """The empirical diagonal with every unscanned dense and conv layer's
    statistic formed in the backward pass, its input cotangent ordered
    after it (a chunk budget of one element: every layer's input exceeds
    it): the diagonal and the mean gradient as by ``"per_example"``."""
    with jax.enable_x64(True):
      apply_fn, params, x = _conv_model(name, jnp.float64)
      y = jnp.arange(B) % CLASSES

      def diag(method):
        return fisher_testing.empirical(
          fisher.diagonal, apply_fn, params, (x, y), method=method
        )

      with mock.patch.object(fisher_taps, "_PATCH_CHUNK_ELEMENTS", 1):
        tape = fisher_taps.record(
          apply_fn, params, x, statistic="diag", ordered=True
        )
        got = diag("auto")
      self.assertNotEmpty(fisher_testing.fused_kernels(tape, "conv"))
      want = diag("per_example")
      _assert_tree_close(got.diag, want.diag, 1e-10)
      _assert_tree_close(got.mean_grad, want.mean_grad, 1e-10)

  @parameterized.parameters("linen_cnn", "nnx_cnn")
  def test_input_cotangent_convolutions_keep_the_fast_layout(self, name):
    """XLA:CPU gives convolutions its fast kernel layout in the entry
    computation only; the tape stores kernels so that the input-cotangent
    convolutions inside the one-class-per-pass loop of the exact kind
    already have it (no kernel ``(spatial..., o, i)``)."""
    if jax.default_backend() != "cpu":
      self.skipTest("a layout of XLA:CPU's")
    apply_fn, params, x = _conv_model(name, jnp.float32)
    y = jnp.arange(B) % CLASSES
    diag = jax.jit(
      lambda p: fisher.diagonal(
        apply_fn, p, (x, y), likelihood=fisher.Categorical(), kind="exact"
      )
    )
    hlo = diag.lower(params).compile().as_text()
    convs = [line for line in hlo.splitlines() if " convolution(" in line]
    self.assertNotEmpty(convs)
    slow = [c for c in convs if re.search(r"dim_labels=\w+_\d+oi->", c)]
    self.assertEqual(slow, [])


# -- more of Flax's layers: one small model each ------------------------------


class _ConvTranspose(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.ConvTranspose(4, (3, 3), strides=(2, 2))(x)
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


class _Recurrent(nn.Module):
  cell: type[nn.RNNCellBase]

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.RNN(self.cell(8))(x)[:, -1])


class _Norms(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.RMSNorm()(nn.Dense(8)(x))
    x = nn.LayerNorm(use_bias=False)(nn.Dense(8)(x))
    return nn.Dense(3)(x)


class _Einsum(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Einsum((4, 6, 5), "btd,dhk->bthk")(x)
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


class _QKNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.MultiHeadDotProductAttention(num_heads=2, normalize_qk=True)(x)
    return nn.Dense(3)(x.mean(1))


class _Conv1D(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(6, (3,), padding="CAUSAL")(x)
    x = nn.Conv(6, (3,), kernel_dilation=2, padding="CIRCULAR")(x)
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


class _Pools(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.avg_pool(nn.Conv(6, (3, 3))(x), (2, 2), (2, 2))
    x = nn.GroupNorm(num_groups=2)(x)
    x = nn.Conv(6, (3, 3), feature_group_count=6)(x)  # depthwise
    x = nn.max_pool(x, (2, 2), (2, 2))
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


class _Mixer(nn.Module):
  """MLP-Mixer's token mixing: a Dense along the sequence axis."""

  @nn.compact
  def __call__(self, x):
    y = jnp.swapaxes(nn.LayerNorm()(x), 1, 2)
    y = nn.Dense(x.shape[1])(nn.gelu(nn.Dense(5)(y)))
    return nn.Dense(3)((x + jnp.swapaxes(y, 1, 2)).mean(1))


class _Glu(nn.Module):
  """A gated unit and a raw scale parameter (``self.param``)."""

  @nn.compact
  def __call__(self, x):
    a, b = jnp.split(nn.Dense(16)(x), 2, -1)
    scale = self.param("scale", nn.initializers.ones, (8,))
    return nn.Dense(3)(a * nn.sigmoid(b) * scale)


class _NnxRecurrent(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.rnn = nnx.RNN(nnx.GRUCell(4, 8, rngs=rngs), rngs=False)
    self.norm = nnx.RMSNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    h = self.rnn(x, initial_carry=jnp.zeros((x.shape[0], 8), x.dtype))
    return self.head(self.norm(h[:, -1]))


class _NnxConvEinsum(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.ConvTranspose(3, 4, (3, 3), strides=(2, 2), rngs=rngs)
    self.mix = nnx.Einsum("bhwc,cd->bhwd", (4, 5), (5,), rngs=rngs)
    self.head = nnx.Linear(10 * 10 * 5, 3, rngs=rngs)

  def __call__(self, x):
    x = self.mix(self.up(x))
    return self.head(x.reshape(x.shape[0], -1))


_LAYER_MODELS: dict[str, tuple[Callable[[], Any], tuple[int, ...]]] = {
  "conv_transpose": (_ConvTranspose, (5, 5, 3)),
  "lstm": (lambda: _Recurrent(nn.OptimizedLSTMCell), (7, 4)),
  "gru": (lambda: _Recurrent(nn.GRUCell), (7, 4)),
  "rms_norm": (_Norms, (4,)),
  "einsum": (_Einsum, (3, 4)),
  "qk_norm_attention": (_QKNorm, (3, 8)),
  "conv_1d": (_Conv1D, (9, 3)),
  "pools_depthwise": (_Pools, (8, 8, 3)),
  "mixer": (_Mixer, (6, 4)),
  "glu_scale": (_Glu, (4,)),
  "nnx_gru_rms_norm": (_NnxRecurrent, (7, 4)),
  "nnx_conv_transpose_einsum": (_NnxConvEinsum, (5, 5, 3)),
}


@_cached
def _layer_model(name: str, dtype):
  build, shape = _LAYER_MODELS[name]
  x = fisher_testing.normal(jax.random.key(2), (4, *shape), dtype)
  model = build(rngs=nnx.Rngs(0)) if name.startswith("nnx") else build()
  return (*_functional(model, x, dtype), x)


class MoreLayersZooTest(parameterized.TestCase):
  """Recurrent cells, transposed, 1-D, dilated, depthwise and pooled
  convolutions, RMSNorm, Einsum, qk-normalised attention, token mixing and
  raw parameters: every leaf on the layer path, the same diagonal."""

  @parameterized.parameters(*_LAYER_MODELS)
  def test_every_leaf_on_the_layer_path_and_exact(self, name):
    apply_fn, params, x = _layer_model(name, jnp.float32)
    flat = jax.tree_util.tree_flatten_with_path(
      fisher.coverage(apply_fn, params, x)
    )[0]
    self.assertEqual(
      {jax.tree_util.keystr(p): c.reason for p, c in flat if not c}, {}
    )
    y = jnp.arange(x.shape[0]) % 3

    def both(p):
      return [
        fisher.diagonal(
          apply_fn,
          p,
          (x, y),
          likelihood=fisher.Categorical(),
          kind="empirical",
          method=method,
        ).diag
        for method in ("auto", "per_example")
      ]

    with warnings.catch_warnings():
      warnings.simplefilter("error", fisher.FisherFallbackWarning)
      fast, slow = jax.jit(both)(params)
    _assert_tree_close(fast, slow, 1e-5)


def _bn_train_model(api: str = "linen"):
  """A conv and a BatchNorm normalising by the batch's statistics."""
  x = jax.random.normal(jax.random.key(1), (B, IMG, IMG, CH))
  if api == "nnx":
    rngs = nnx.Rngs(0)
    net = nnx.Sequential(
      nnx.Conv(CH, 4, (3, 3), rngs=rngs), nnx.BatchNorm(4, rngs=rngs)
    )
    graphdef, params, rest = nnx.split(net, nnx.Param, ...)

    def nnx_apply(p, inp):
      out = nnx.merge(graphdef, p, jax.tree.map(jnp.asarray, rest))(inp)
      return out.mean(axis=(1, 2))

    return nnx_apply, params, x
  model = nn.Sequential([nn.Conv(4, (3, 3)), nn.BatchNorm(False)])
  variables = jax.jit(model.init)(jax.random.key(0), x)

  def apply_fn(p, inp):
    stats = {"batch_stats": variables["batch_stats"]}
    out, _ = model.apply({"params": p, **stats}, inp, mutable=["batch_stats"])
    return out.mean(axis=(1, 2))

  return apply_fn, variables["params"], x


def _empirical_diagonal(apply_fn, params, batch, method: str):
  return fisher.diagonal(
    apply_fn,
    params,
    batch,
    likelihood=fisher.Categorical(),
    kind="empirical",
    method=method,
  )


class MixedExamplesTest(parameterized.TestCase):
  """A model whose outputs combine different examples has no per-example
  gradients: every estimator says so, on either path."""

  def _found(self, apply_fn, params, x):
    leaves, _, _, closed, _, b = fisher_taps._trace(apply_fn, params, x)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      found = fisher_taps.check_independent_examples(closed, len(leaves), b)
    self.assertLen(caught, int(found is not None))
    return found

  def test_models_that_mix_examples(self):
    w = {"w": jnp.ones((6, 3))}
    x = jnp.ones((B, 6))
    self.assertIn("reduce_sum over", self._found(*_bn_train_model()))
    cases = {
      "reduce_sum over": lambda p, x: (x - x.mean(0)) @ p["w"],
      "pairing every two": lambda p, x: (x @ p["w"]) @ (x @ p["w"]).T,
      "contracting": lambda p, x: p["w"].T @ (x.T @ x),
      "cumsum along": lambda p, x: jnp.cumsum(x @ p["w"], axis=0),
      # the examples reordered or shifted (in-batch negatives)
      "rev along": lambda p, x: x[::-1] @ p["w"],
      "slice along": lambda p, x: (lambda h: h * jnp.roll(h, 1, 0))(
        jnp.tanh(x @ p["w"])
      ),
      "concatenate along": lambda p, x: jnp.concatenate([x, 2 * x]) @ p["w"],
      # examples moved off axis 0, then reduced there
      "reduce_max over": lambda p, x: jnp.max(jnp.swapaxes(x, 0, 1), 1),
      # followed through pooling and a split of the features
      "reduce_sum over the": lambda p, x: jnp.split(
        nn.avg_pool(x[..., None], (2,), strides=(2,))[..., 0], [1], 1
      )[1].mean(0),
    }
    for want, fn in cases.items():
      with self.subTest(want):
        self.assertIn(want, self._found(fn, w, x) or "")
    # The examples merged with the positions after them, then reduced.
    xs = jnp.ones((B, 5, 6))
    merged = {
      "mean of all": lambda p, x: (x - x.reshape(-1).mean()).mean(1) @ p["w"],
      "a slice of the rows": lambda p, x: (
        x.reshape(-1, 6)[1:].sum(1).reshape(-1)[: x.shape[0]]
      ),
    }
    for name, fn in merged.items():
      with self.subTest(name):
        self.assertIsNotNone(self._found(fn, w, xs))
    seq_bn = nn.BatchNorm(use_running_average=False)
    bn_vars = seq_bn.init(jax.random.key(0), jnp.ones((B * 5, 3)))

    def bn_rows(p, x):  # a BatchNorm over (B * T, C) rows
      rows = (x @ p["w"]).reshape(-1, 3)
      out, _ = seq_bn.apply(bn_vars, rows, mutable=["batch_stats"])
      return out.reshape(x.shape[0], 5, 3).mean(1)

    self.assertIn("reduce_sum over", self._found(bn_rows, w, xs) or "")

  def test_models_that_keep_examples_apart(self):
    lm = _model("linen_scan", jnp.float32)
    self.assertIsNone(self._found(*lm))
    for name in ("nnx_bn_cnn", "linen_shared_cnn", "nnx_vit"):
      with self.subTest(name):
        self.assertIsNone(self._found(*_conv_model(name, jnp.float32)))
    w = {"w": jnp.ones((6, 3))}
    xs = jnp.ones((B, 5, 6))
    fns = {
      # time-major processing, examples back on axis 0
      "transposed": lambda p, x: jnp.swapaxes(
        jnp.cumsum(jnp.swapaxes(x, 0, 1) @ p["w"], axis=0), 0, 1
      ),
      # per-example matmuls with the examples as dot_general batch axis
      "batched dot": lambda p, x: jnp.einsum("btd,bsd->bts", x, x) @ x @ p["w"],
      # a map over the examples (a scan over their axis)
      "map": lambda p, x: jax.lax.map(lambda e: e.sum(0) @ p["w"], x),
      # rows of (B * T, C), normalised per row, then split back
      "rows": lambda p, x: (
        jax.nn.standardize((x @ p["w"]).reshape(-1, 3), axis=-1)
        .reshape(x.shape[0], 1, 5 * 3)
        .sum(1)
      ),
      # a size-one axis before the merged rows, and a split of the rows
      "split rows": lambda p, x: (
        (x.reshape(1, -1, 6) @ p["w"])
        .reshape(x.shape[0] * 5, 3)[None]
        .reshape(x.shape[0], 15)
      ),
    }
    for name, fn in fns.items():
      with self.subTest(name):
        self.assertIsNone(self._found(fn, w, xs))

  def test_random_values_per_example(self):
    class Dropped(nn.Module):  # an active dropout, as in training
      broadcast_dims: tuple[int, ...] = ()

      @nn.compact
      def __call__(self, x):
        h = nn.Dropout(0.5, self.broadcast_dims, deterministic=False)(
          nn.Dense(4)(x)
        )
        return nn.Dense(2)(h)

    x = jnp.ones((B, 6))
    key = jax.random.key(1)

    def dropped(dims):
      model = Dropped(dims)
      params = model.init(key, x)
      return lambda p, x: model.apply(p, x, rngs={"dropout": key}), params

    w = {"w": jnp.ones((6, 3))}

    def scanned(p, x):  # a mask per layer, drawn inside a scan's body
      def body(h, k):
        return jnp.where(jax.random.bernoulli(k, 0.5, h.shape), h, 0.0), None

      return jax.lax.scan(body, x, jax.random.split(key, 2))[0] @ p["w"]

    class NnxDropped(nnx.Module):
      def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(6, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

      def __call__(self, x):
        return self.head(self.drop(self.dense(x)))

    nnx_model = NnxDropped(nnx.Rngs(0, dropout=1))
    draws = {
      "dropout": dropped(()),
      "nnx dropout": fo_flax.nnx_apply_fn(nnx_model),
      "dropout over features": dropped((1,)),
      "noise": (lambda p, x: (x + jax.random.normal(key, x.shape)) @ p["w"], w),
      "scan": (scanned, w),
    }
    for name, (fn, params) in draws.items():
      with self.subTest(name):
        found = self._found(fn, params, x) or ""
        self.assertStartsWith(found, "random values for each example")
    shared = {
      # one mask for the whole batch, broadcast over the examples
      "dropout over examples": dropped((0,)),
      # a draw contracted with the examples (random features)
      "features": (
        lambda p, x: jnp.cos(x @ jax.random.normal(key, (6, 6))) @ p["w"],
        w,
      ),
      # a draw of size one along the examples' axis
      "row": (lambda p, x: (x * jax.random.normal(key, (1, 6))) @ p["w"], w),
    }
    nnx_model.eval()  # dropout off
    shared["nnx eval"] = fo_flax.nnx_apply_fn(nnx_model)
    for name, (fn, params) in shared.items():
      with self.subTest(name):
        self.assertIsNone(self._found(fn, params, x))
    fn, params = dropped(())
    y = jnp.arange(B) % 2
    for method in ("auto", "per_example"):
      with (
        self.subTest(method),
        self.assertWarnsRegex(
          fisher.FisherMixedExamplesWarning, "draws random values.*dropout"
        ) as caught,
      ):
        _empirical_diagonal(fn, params, (x, y), method)
      self.assertEqual(caught.filename, __file__)

  @parameterized.product(method=("auto", "per_example"), api=("linen", "nnx"))
  def test_estimators_warn(self, method, api):
    apply_fn, params, x = _bn_train_model(api)
    y = jnp.arange(B) % 4
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      _empirical_diagonal(apply_fn, params, (x, y), method)
    found = [
      w for w in caught if w.category is fisher.FisherMixedExamplesWarning
    ]
    self.assertLen(found, 1)
    self.assertIn("BatchNorm", str(found[0].message))
    self.assertEqual(found[0].filename, __file__)

  def test_coverage_warns(self):
    apply_fn, params, x = _bn_train_model()
    with self.assertWarnsRegex(
      fisher.FisherMixedExamplesWarning, "combines different examples"
    ) as caught:
      fisher.coverage(apply_fn, params, x)
    self.assertEqual(caught.filename, __file__)


class FallbackWarningTest(absltest.TestCase):
  def test_warns_once_naming_the_leaves(self):
    def apply_fn(p, x):  # a kernel through sin in nested scans: no rule
      step = lambda c, _: (c, c @ jnp.sin(p["k"]))
      outer = lambda c, _: (c, jax.lax.scan(step, c, None, length=1)[1][0])
      h = jax.lax.scan(outer, x.reshape(x.shape[0], -1), None, length=1)[1]
      return h[0] @ p["w"]

    params = {"k": jnp.ones((12, 24)), "w": jnp.ones((24, 2)) / 9}
    x, y = jnp.ones((2, 2, 6)), jnp.array([0, 1])
    kw: dict[str, Any] = dict(likelihood=fisher.Categorical(), kind="empirical")
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      fisher.diagonal(apply_fn, params, (x, y), **kw)
      fisher.diagonal(apply_fn, params, (x, y), **kw)
      fisher.diagonal(apply_fn, params, (x, y), method="per_example", **kw)
    found = [w for w in caught if w.category is fisher.FisherFallbackWarning]
    self.assertLen(found, 1)
    self.assertIn("['k']", str(found[0].message))
    self.assertIn("an operand of sin", str(found[0].message))
    self.assertEqual(found[0].filename, __file__)
    cov = fisher.coverage(apply_fn, params, x)
    self.assertEqual(cov["k"].path, "per_example")
    self.assertEqual(cov["w"].path, "layer")

  def test_unused_leaves_cost_nothing_and_do_not_warn(self):
    def apply_fn(p, x):  # an encoder of two heads, one used
      return jnp.tanh(x @ p["enc"]) @ p["head_a"]

    params = {
      "enc": jnp.ones((6, 4)) / 6,
      "head_a": jnp.ones((4, 3)),
      "head_b": jnp.ones((400, 400)),  # 99.8% of the parameters
      "empty": jnp.zeros((0, 3)),
    }
    x, y = jnp.ones((5, 6)), jnp.arange(5) % 3
    cov = fisher.coverage(apply_fn, params, x)
    self.assertEqual(cov["head_b"].path, "unused")
    self.assertEqual(cov["head_b"].reason, "not used by apply_fn")
    self.assertEqual(cov["empty"].path, "unused")
    self.assertTrue(all(jax.tree.leaves(cov)))
    kw: dict[str, Any] = dict(likelihood=fisher.Categorical(), kind="empirical")
    with warnings.catch_warnings():
      warnings.simplefilter("error", fisher.FisherFallbackWarning)
      auto = fisher.diagonal(apply_fn, params, (x, y), **kw)
      taps = fisher.diagonal(apply_fn, params, (x, y), method="taps", **kw)
      fisher.kronecker(apply_fn, params, (x, y), estimator="kfac", **kw)
    ref = fisher.diagonal(apply_fn, params, (x, y), method="per_example", **kw)
    for got in (auto, taps):
      np.testing.assert_allclose(
        got.diag["enc"], ref.diag["enc"], rtol=1e-5, atol=1e-7
      )
      np.testing.assert_array_equal(got.diag["head_b"], 0.0)
      self.assertEqual(got.diag["empty"].shape, (0, 3))

  def test_each_distinct_fallback_warns(self):
    # Two models, the same leaf names, different reasons: each warns once.
    kw: dict[str, Any] = dict(likelihood=fisher.Categorical(), kind="empirical")
    params = {"dup_k": jnp.ones((6,)) / 6, "dup_w": jnp.ones((6, 2))}
    x, y = jnp.ones((3, 6)), jnp.array([0, 1, 0])
    fns = (
      lambda p, x: jnp.maximum(x, p["dup_k"]) @ p["dup_w"],
      lambda p, x: jnp.minimum(x, p["dup_k"]) @ p["dup_w"],
    )
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      for fn in fns * 2:
        fisher.diagonal(fn, params, (x, y), **kw)
    found = [
      str(w.message)
      for w in caught
      if w.category is fisher.FisherFallbackWarning
    ]
    self.assertLen(found, 2)
    self.assertIn("['dup_k']: an operand of max", found[0])
    self.assertIn("['dup_k']: an operand of min", found[1])

  def test_coverage_checks_the_outputs_as_the_estimators_do(self):
    params, x = {"w": jnp.ones((4, 3))}, jnp.ones((5, 4))
    for fn, got in [
      (lambda p, x: (x @ p["w"], x), "tuple"),
      (lambda p, x: (x @ p["w"]).sum(), r"\(\)"),
    ]:
      with self.assertRaisesRegex(ValueError, f"one array.*got {got}"):
        fisher.coverage(fn, params, x)
    # An empty batch (rows merged and split back): nothing to mix.
    rows = lambda p, x: (x.reshape(x.shape[0] * 2, 4) @ p["w"]).reshape(
      x.shape[0], 6
    )
    cov = fisher.coverage(rows, params, jnp.ones((0, 2, 4)))
    self.assertEqual(cov["w"].path, "layer")

  def test_fallback_memory_is_chunked_by_default(self):
    """Without chunk_size, the per-example gradients of the leaves sent to
    the per-example path come a chunk at a time (here 2048 x 128 x 128
    elements, twice the budget), not all B at once."""

    def apply_fn(p, x):  # leaf names of its own: the warning is per leaf set
      step = lambda h, _: (h @ jnp.sin(p["big"]), None)  # nested scans: no rule
      outer = lambda h, _: (jax.lax.scan(step, h, None, length=1)[0], None)
      return jax.lax.scan(outer, x, None, length=1)[0] @ p["head"]

    params = {"big": jnp.ones((128, 128)), "head": jnp.ones((128, 2))}
    b = 2048
    x, y = jnp.ones((b, 128)), jnp.zeros((b,), jnp.int32)

    def temp(chunk_size):
      fn = functools.partial(
        fisher.diagonal,
        apply_fn,
        likelihood=fisher.Categorical(),
        kind="empirical",
        chunk_size=chunk_size,
      )
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", fisher.FisherFallbackWarning)
        compiled = jax.jit(fn).lower(params, (x, y)).compile()
      return compiled.memory_analysis().temp_size_in_bytes

    self.assertLess(temp(None), 0.6 * temp(b))


if __name__ == "__main__":
  absltest.main()
