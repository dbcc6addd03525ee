# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for the layer-statistics path (``fisher_optax.fisher._taps``).

Every statistic is checked in float64 against the per-example
pseudo-gradients ``g_{s,n} = J_n^T r_{s,n}`` built from dense ``jax.jacobian``
matrices (``tests/fisher_testing.py``), on Linen, NNX and plain-function
models, with and without weight sharing, with ``S > 1`` cotangents.
"""

import functools
import math
from unittest import mock
import warnings

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from examples.common import models
from fisher_optax import fisher
from fisher_optax.fisher import _taps
from tests import fisher_testing

B, S, T, VOCAB = 3, 2, 4, 5


# -- models -------------------------------------------------------------------


class _LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(5, param_dtype=x.dtype)(x))
    return nn.Dense(3, param_dtype=x.dtype)(x)


class _LinenSeq(nn.Module):
  """Embedding -> Dense on (B, T, d) (weight sharing) -> mean -> Dense."""

  @nn.compact
  def __call__(self, ids):
    dt = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    h = nn.Embed(VOCAB, 4, param_dtype=dt)(ids)
    h = jnp.tanh(nn.Dense(6, param_dtype=dt)(h))
    return nn.Dense(3, param_dtype=dt)(h.mean(axis=1))


class _NnxMLP(nnx.Module):
  def __init__(self, rngs, dtype):
    self.l1 = nnx.Linear(4, 5, rngs=rngs, param_dtype=dtype)
    self.l2 = nnx.Linear(5, 3, rngs=rngs, param_dtype=dtype)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


class _NnxSeq(nnx.Module):
  def __init__(self, rngs, dtype):
    self.emb = nnx.Embed(VOCAB, 4, rngs=rngs, param_dtype=dtype)
    self.l1 = nnx.Linear(4, 6, rngs=rngs, param_dtype=dtype)
    self.l2 = nnx.Linear(6, 3, rngs=rngs, param_dtype=dtype)

  def __call__(self, ids):
    return self.l2(jnp.tanh(self.l1(self.emb(ids))).mean(axis=1))


def _plain_seq(params, ids):
  """jnp.take (negative ids wrap), a jitted and a rematerialised layer."""
  h = jnp.take(params["table"], ids, axis=0)

  @jax.jit
  def layer(h, w, b):
    return jnp.tanh(jnp.einsum("btd,de->bte", h, w) + b)

  h = jax.checkpoint(layer)(h, params["w1"], params["b1"])
  return jnp.dot(h.sum(axis=1), params["w2"])


def _plain_general(params, x):
  """An N-D kernel contracting two axes, a kernel as the left operand with
  its axes swapped, elementwise scale (vector and scalar) and positions."""
  h = jnp.einsum("btij,ijk->btk", x, params["w3"])  # (B, T, 4)
  h = jax.lax.dot_general(params["wl"], h, (((1,), (2,)), ((), ())))
  h = jnp.tanh(jnp.moveaxis(h, 0, -1)) * params["s"] + params["pos"]
  return (h * params["c"]).sum(1) @ params["w2"]


def _plain_scan(params, ids):
  """Layers stacked along a reversed ``lax.scan`` of a rematerialised body
  with a nested scan (a twice-sliced leaf, the layer's kernel shared by its
  steps), a recurrent cell's kernel shared by the steps of a scan inside
  ``remat``, a kernel used twice and a head tied to the embedding table."""
  h = jnp.take(params["table"], ids, axis=0)  # (B, T, 4)

  def layer(h, w):
    k, b, s, sub = w
    h = h + jnp.tanh(jnp.einsum("btd,de->bte", h, k) + b) * s

    def step(h, u):
      return h + jnp.tanh(h @ u) @ k / 4, None

    return jax.lax.scan(step, h, sub)[0], None

  stack = (params["k"], params["b"], params["s"], params["sub"])
  h = jax.lax.scan(jax.checkpoint(layer), h, stack, reverse=True)[0]

  @jax.checkpoint  # remat around a scan
  def rnn(h, w):
    def cell(c, x):
      c = jnp.tanh(c @ w + x)
      return c, c

    hs = jax.lax.scan(cell, jnp.zeros_like(h[:, 0]), jnp.moveaxis(h, 1, 0))[1]
    return jnp.moveaxis(hs, 0, 1)

  h = h + rnn(h, params["cell"])
  h = jnp.tanh(h @ params["shared"]) @ params["shared"]
  return h.mean(axis=1) @ params["table"].T


_MASK = np.arange(25).reshape(5, 5) % 3 != 1


def _plain_derived(params, x):
  """Leaves used through functions of parameters only: a weight-normed
  kernel, a softplus scale, a weight-normed conv kernel (its two leaves
  share their per-example gradients' pass), merged LoRA weights passed into
  a jitted einsum, a masked kernel used twice, a leaf used both masked and
  as is, weight-normed kernels stacked along a reversed scan of a
  rematerialised body with a softplus scale its layers share, and an exp
  temperature."""
  v, g = params["v"], params["g"]
  w = v * (g / jnp.sqrt(jnp.sum(v * v, axis=0)))  # WeightNorm
  h = jnp.tanh(x @ w) * jax.nn.softplus(params["s"])  # (B, T, 5)
  cv, cg = params["cv"], params["cg"]
  kernel = cv * (cg / jnp.sqrt(jnp.sum(cv * cv, axis=(0, 1))))
  dn = ("NWC", "WIO", "NWC")
  conv = jax.lax.conv_general_dilated(h, kernel, (1,), "SAME", None, None, dn)
  h = h + jnp.tanh(conv)
  merged = params["w0"] + params["a"] @ params["b"]
  h = jnp.tanh(jnp.einsum("btd,de->bte", h, merged))
  masked = params["m"] * jnp.asarray(_MASK, h.dtype)
  h = jnp.tanh(h @ masked + h @ params["m"]) @ masked

  def layer(h, w):  # weight-normed kernels stacked along a scan
    wv, wg = w
    k = wv * (wg / jnp.sqrt(jnp.sum(wv * wv, axis=0)))
    # a softplus scale every layer shares (a const of the scan)
    return h + jnp.tanh(h @ k) * jax.nn.softplus(params["sh"]), None

  stack = (params["wv"], params["wg"])
  h = jax.lax.scan(jax.checkpoint(layer), h, stack, reverse=True)[0]
  return jnp.mean(h, axis=1) @ params["head"] * jnp.exp(params["t"])


def _plain_heads(params, x):
  """Per-head kernels (``dot_general`` batch axes): an einsum with the
  activation first, one with the kernel first, one contracting all of a
  kernel's free axes, and per-head kernels stacked along a scan (one of
  them shared by the iterations)."""
  b, t = x.shape[:2]
  h = jnp.einsum("bthd,hde->bhte", x.reshape(b, t, 2, 2), params["k"])
  h = jnp.tanh(h)  # (B, H, T, 3)
  dn = (((2,), (3,)), ((0,), (1,)))
  h = jnp.transpose(jax.lax.dot_general(params["k2"], h, dn), (2, 0, 3, 1))

  def layer(h, k):  # (B, H, T, 3), a stacked and a shared per-head kernel
    h = h + jnp.tanh(jnp.einsum("bhtd,hde->bhte", h, k))
    return jnp.tanh(jnp.einsum("bhtd,hde->bhte", h, params["shared"])), None

  h = jax.lax.scan(layer, h, params["stack"])[0]
  h = jnp.tanh(jnp.einsum("bhtd,hd->bht", h, params["v"]))
  return h.reshape(b, -1) @ params["w"]


def _paths(tree):
  return jax.tree_util.tree_flatten_with_path(tree)[0]


def _sum_outer(x: np.ndarray) -> np.ndarray:
  """``sum x_i x_i^T`` over every leading axis of ``x`` (NumPy)."""
  rows = x.reshape(-1, x.shape[-1])
  return rows.T @ rows


def _jitted(fn):
  """``fn()`` as one compiled program: run op by op, each small op would
  compile on its own (most of a test's time)."""
  return jax.jit(fn)()


def _model(name: str, dtype=None):
  """Returns (apply_fn, params, inputs, out_dim) for a named test model."""
  dtype = dtype or jnp.float64
  key = jax.random.key(0)
  kp, kx = jax.random.split(key)
  x = fisher_testing.normal(kx, (B, 4), dtype)
  ids = jax.random.randint(kx, (B, T), 0, VOCAB)
  ids = ids.at[0, :2].set(1)  # repeated tokens within an example
  if name == "plain_mlp":
    params = fisher_testing.mlp_params(kp, (4, 5, 3), dtype=dtype)
    return fisher_testing.mlp_apply, params, x, 3
  if name == "linen_mlp":
    model = _LinenMLP()
    return model.apply, model.init(kp, x), x, 3
  if name == "linen_seq":
    model = _LinenSeq()
    return model.apply, model.init(kp, ids), ids, 3
  if name in ("nnx_mlp", "nnx_seq"):
    cls = _NnxMLP if name == "nnx_mlp" else _NnxSeq
    graphdef, state = nnx.split(cls(nnx.Rngs(0), dtype))
    apply_fn = lambda st, inp: nnx.merge(graphdef, st)(inp)
    return apply_fn, state, (x if name == "nnx_mlp" else ids), 3
  if name == "plain_seq":
    k = jax.random.split(kp, 4)
    params = {
      "table": fisher_testing.normal(k[0], (VOCAB, 4), dtype),
      "w1": fisher_testing.normal(k[1], (4, 6), dtype) / 2,
      "b1": fisher_testing.normal(k[2], (6,), dtype) / 4,
      "w2": fisher_testing.normal(k[3], (6, 3), dtype) / 3,
    }
    return _plain_seq, params, ids.at[1, 3].set(-1), 3
  if name == "plain_general":
    k = jax.random.split(kp, 6)
    params = {
      "w3": fisher_testing.normal(k[0], (2, 3, 4), dtype) / 2,
      "wl": fisher_testing.normal(k[1], (5, 4), dtype) / 2,
      "s": fisher_testing.normal(k[2], (5,), dtype),
      "pos": fisher_testing.normal(k[3], (T, 5), dtype),
      "c": jnp.asarray(1.5, dtype),
      "w2": fisher_testing.normal(k[4], (5, 3), dtype) / 3,
    }
    return (
      _plain_general,
      params,
      fisher_testing.normal(kx, (B, T, 2, 3), dtype),
      3,
    )
  if name == "plain_scan":
    k = jax.random.split(kp, 7)
    params = {
      "table": fisher_testing.normal(k[0], (VOCAB, 4), dtype),
      "k": fisher_testing.normal(k[1], (2, 4, 4), dtype) / 2,
      "b": fisher_testing.normal(k[2], (2, 4), dtype) / 3,
      "s": fisher_testing.normal(k[3], (2, 4), dtype),
      "sub": fisher_testing.normal(k[4], (2, 3, 4, 4), dtype) / 3,
      "cell": fisher_testing.normal(k[5], (4, 4), dtype) / 2,
      "shared": fisher_testing.normal(k[6], (4, 4), dtype) / 2,
    }
    return _plain_scan, params, ids, VOCAB
  if name == "plain_heads_seq":
    k = jax.random.split(kp, 6)
    params = {
      "k": fisher_testing.normal(k[0], (2, 2, 3), dtype),
      "k2": fisher_testing.normal(k[1], (2, 3, 3), dtype) / 2,
      "stack": fisher_testing.normal(k[2], (2, 2, 3, 3), dtype) / 2,
      "shared": fisher_testing.normal(k[3], (2, 3, 3), dtype) / 2,
      "v": fisher_testing.normal(k[4], (2, 3), dtype),
      "w": fisher_testing.normal(k[5], (2 * T, 3), dtype) / 2,
    }
    x = fisher_testing.normal(kx, (B, T, 4), dtype)
    return _plain_heads, params, x, 3
  if name == "plain_derived_seq":
    k = jax.random.split(kp, 13)
    params = {
      "v": fisher_testing.normal(k[0], (4, 5), dtype),
      "g": fisher_testing.normal(k[1], (5,), dtype),
      "s": fisher_testing.normal(k[2], (5,), dtype),
      "w0": fisher_testing.normal(k[3], (5, 5), dtype) / 3,
      "a": fisher_testing.normal(k[4], (5, 2), dtype) / 2,
      "b": fisher_testing.normal(k[5], (2, 5), dtype) / 2,
      "m": fisher_testing.normal(k[6], (5, 5), dtype) / 3,
      "head": fisher_testing.normal(k[7], (5, 3), dtype),
      "t": jnp.asarray(0.3, dtype),
      "cv": fisher_testing.normal(k[8], (3, 5, 5), dtype) / 3,
      "cg": fisher_testing.normal(k[9], (5,), dtype),
      "wv": fisher_testing.normal(k[10], (2, 5, 5), dtype) / 3,
      "wg": fisher_testing.normal(k[11], (2, 5), dtype),
      "sh": fisher_testing.normal(k[12], (5,), dtype),
    }
    return (
      _plain_derived,
      params,
      fisher_testing.normal(kx, (B, T, 4), dtype),
      3,
    )
  raise ValueError(name)


# linen_mlp is left to the bf16 test: Linen dense layers are exercised here by
# linen_seq.
_MODELS = (
  "plain_mlp",
  "nnx_mlp",
  "linen_seq",
  "nnx_seq",
  "plain_seq",
  "plain_general",
  "plain_scan",
  "plain_derived_seq",
  "plain_heads_seq",
)


# -- oracles ------------------------------------------------------------------


def _cotangents(out_dim: int, num_samples: int = S, dtype=jnp.float64):
  return fisher_testing.normal(
    jax.random.key(7), (num_samples, B, out_dim), dtype
  )


def _stats(apply_fn, params, inputs, cot, structure, chunk_size=None):
  """Jitted layer_statistics (compiled runs beat eager op-by-op dispatch)."""
  return _jit_stats(apply_fn, params, inputs, cot, structure, chunk_size)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _jit_stats(apply_fn, params, inputs, cot, structure, chunk_size):
  return fisher_testing.layer_statistics(
    apply_fn, params, inputs, cot, structure=structure, chunk_size=chunk_size
  )


@functools.partial(jax.jit, static_argnums=0)
def _pseudo_grads(apply_fn, params, inputs, cot):
  """Stacked per-leaf pseudo-gradients (S * B, *leaf), rows s * B + n."""
  jac = fisher_testing.jacobians(apply_fn, params, inputs)  # (B, O, P)
  r = cot.reshape(cot.shape[0], cot.shape[1], -1)
  g = jnp.einsum("bop,sbo->sbp", jac, r).reshape(-1, jac.shape[-1])
  return fisher_testing.unravel_like(params, g)


def _gaussian_kfac(apply_fn, params, x, out_dim, mode):
  """``fisher.kronecker`` (K-FAC, empirical, Gaussian) of ``(x, 0)``."""
  return fisher.kronecker(
    apply_fn,
    params,
    (x, jnp.zeros((x.shape[0], out_dim))),
    likelihood=fisher.Gaussian(),
    kind="empirical",
    estimator="kfac",
    weight_sharing=mode,
  )


def _leaf_values(tree):
  return jax.tree.leaves(tree, is_leaf=lambda x: x is None)


def _assert_close(test, got, want, rtol=1e-10, atol=1e-12):
  np.testing.assert_allclose(
    np.asarray(got), np.asarray(want), rtol=rtol, atol=atol
  )


def _gradient_and_diagonal(apply_fn):
  """``(grad_fn, diag_fn)`` of a classifier, each ``(params, x, y)``: the
  batch gradient of its mean cross-entropy, and its empirical diagonal
  (``diag_fn`` also takes ``method``)."""

  def grad_fn(p, x, y):
    def loss(q):
      z = apply_fn(q, x)
      picked = jnp.take_along_axis(z, y[:, None], 1)[:, 0]
      return jnp.mean(jax.nn.logsumexp(z, -1) - picked)

    return jax.grad(loss)(p)

  def diag_fn(p, x, y, method="auto"):
    return fisher.diagonal(
      apply_fn,
      p,
      (x, y),
      likelihood=fisher.Categorical(),
      kind="empirical",
      method=method,
    )

  return grad_fn, diag_fn


def _assert_paths_agree(test, apply_fn, params, batch, rank: int) -> None:
  """The estimators by ``method="auto"`` (no fallback) equal the
  per-example path's (:func:`fisher_testing.estimates_by_path`)."""
  out = fisher_testing.estimates_by_path(apply_fn, params, batch, rank=rank)
  for key in ("empirical", "exact", "low_rank"):
    with test.subTest(key):
      for a, b in zip(
        jax.tree.leaves(out["auto", key]),
        jax.tree.leaves(out["per_example", key]),
      ):
        _assert_close(test, a, b, rtol=1e-9, atol=1e-12)


class LayerStatisticsTest(parameterized.TestCase):
  @parameterized.parameters(*_MODELS)
  def test_statistics_match_jacobian_oracle(self, name):
    with jax.enable_x64(True):
      apply_fn, params, inputs, out_dim = _model(name)
      cov = _taps.coverage(apply_fn, params, inputs)
      self.assertTrue(all(jax.tree.leaves(cov)), cov)
      cot = _cotangents(out_dim)
      weights = fisher_testing.normal(
        jax.random.key(3), (2, S * B), jnp.float64
      )
      # 5 does not divide S * B = 6
      chunk = 5 if "seq" in name or "scan" in name else None

      @jax.jit
      def run(params, inputs, cot, weights):
        out = {
          st: fisher_testing.layer_statistics(
            apply_fn, params, inputs, cot, structure=st, chunk_size=chunk
          )[0]
          for st in ("diag", "norms", "gram")
        }
        out["combine"] = fisher_testing.layer_combine(
          apply_fn, params, inputs, cot, weights
        )[0]
        out["g"] = _pseudo_grads(apply_fn, params, inputs, cot)
        return out

      out = run(params, inputs, cot, weights)
      g = jax.tree.leaves(out["g"])
      for got, gi in zip(jax.tree.leaves(out["diag"]), g):
        _assert_close(self, got, jnp.sum(gi**2, 0))
      for got, gi in zip(jax.tree.leaves(out["norms"]), g):
        _assert_close(self, got, jnp.sum(gi.reshape(S * B, -1) ** 2, 1))
      flat = jnp.concatenate([gi.reshape(S * B, -1) for gi in g], 1)
      _assert_close(self, out["gram"], flat @ flat.T)
      for got, gi in zip(jax.tree.leaves(out["combine"]), g):
        _assert_close(self, got, jnp.tensordot(weights, gi, 1))

  # Budget 8 gives blocks of one feature; 48 blocks of two embedding ids
  # (S B = 6 rows of 4 outputs) with a remainder block (VOCAB = 5).
  @parameterized.product(
    name=("plain_seq", "linen_seq", "plain_mlp", "nnx_mlp"), budget=(8, 48)
  )
  def test_statistics_in_blocks(self, name, budget):
    """With tiny budgets the Gram matrix is summed over input-feature
    blocks (one-hot blocks for an embedding) or formed by blocks of rows
    (dense layers without weight sharing, biases; rows of several samples
    read their example's activations), the weighted sums over example
    chunks, and the squares of a dense diagonal a chunk of examples at a
    time (a remainder chunk): all equal the oracle."""
    with jax.enable_x64(True):
      apply_fn, params, inputs, out_dim = _model(name)
      cot = _cotangents(out_dim)
      weights = fisher_testing.normal(
        jax.random.key(3), (2, S * B), jnp.float64
      )
      g = jax.tree.leaves(_pseudo_grads(apply_fn, params, inputs, cot))
      with (
        mock.patch.object(_taps, "_BLOCK_ELEMENTS", budget),
        mock.patch.object(_taps, "_PATCH_CHUNK_ELEMENTS", 18),
      ):

        def statistics():
          grads = _taps.record(apply_fn, params, inputs).backward(cot)
          return (
            grads.statistics("gram"),
            grads.combine(weights),
            grads.statistics("diag"),
          )

        gram, combined, diag = _jitted(statistics)
      g, weights = jax.tree.map(np.asarray, (g, weights))
      flat = np.concatenate([gi.reshape(S * B, -1) for gi in g], 1)
      _assert_close(self, gram, flat @ flat.T)
      for got, gi in zip(jax.tree.leaves(combined), g):
        _assert_close(self, got, np.tensordot(weights, gi, 1))
      for got, gi in zip(jax.tree.leaves(diag), g):
        _assert_close(self, got, np.sum(gi**2, 0))

  @parameterized.parameters((7, 7, 3), (12, 4, 5), (6, 3, 4), (5, 5, 8))
  def test_rows_gram_by_blocks(self, n, b, block_rows):
    """Blocks of rows (a remainder block when no divisor is near the
    budget; several samples per example) give the dense Gram matrix."""
    keys = jax.random.split(jax.random.key(0), 4)
    a = fisher_testing.normal(keys[0], (b, 3))
    r1 = fisher_testing.normal(keys[1], (n, 2))
    r2 = fisher_testing.normal(keys[2], (n, 4))
    aa = jnp.tile(a @ a.T, (n // b, n // b))
    want = (aa + 1) * (r1 @ r1.T) + r2 @ r2.T
    terms = [(a, r1, True), (None, r2, False)]
    chunks, chunk_map = [], _taps._chunk_map

    def recorded(fn, xs, chunk):
      chunks.append(chunk)
      return chunk_map(fn, xs, chunk)

    # Each block holds every site's two products (all run before the fusion
    # that sums them): the budget is for all of them.
    budget = 2 * len(terms) * n * block_rows
    with mock.patch.object(_taps, "_BLOCK_ELEMENTS", budget):
      with mock.patch.object(_taps, "_chunk_map", recorded):
        got = _taps._rows_gram(terms, n, b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    self.assertEqual(chunks, [block_rows])

  @parameterized.parameters((7, 3), (12, 5), (8, 4), (3, 8))
  def test_sums_over_example_chunks_without_padding(self, b, chunk):
    x = fisher_testing.normal(jax.random.key(0), (b, 3))
    y = fisher_testing.normal(jax.random.key(1), (2, b))
    got = _taps._sum_over_example_chunks(
      lambda x_c, y_c: y_c @ x_c, [x, y], [0, 1], b, chunk, (2, 3), x.dtype
    )
    np.testing.assert_allclose(got, y @ x, rtol=1e-5, atol=1e-6)
    rows = _taps._chunk_map(lambda x_c, y_c: x_c * y_c[:, :1], [x, y.T], chunk)
    np.testing.assert_allclose(rows, x * y.T[:, :1], rtol=1e-6)
    self.assertEqual(_taps._even_chunk(12, 5), 4)
    self.assertEqual(_taps._even_chunk(7, 3), 3)  # 7 = 2 * 3 + 1

  def test_transformer_matches_per_example_vjps(self):
    """Attention (q, k, v, o on (B, T, d)), MLP, embedding, head."""
    with jax.enable_x64(True):
      apply_fn, params = models.char_transformer(
        7, d=8, heads=2, layers=1, ffn=12, context=5
      )
      params = jax.tree.map(lambda a: a.astype(jnp.float64), params)
      ids = jax.random.randint(jax.random.key(1), (B, 5), 0, 7)
      cot = fisher_testing.normal(jax.random.key(2), (S, B, 5, 7))

      @jax.jit
      def run(params, ids, cot):
        def one(x, r):  # g_{s,n} for one example, all s
          _, vjp = jax.vjp(lambda p: apply_fn(p, x[None])[0], params)
          return jax.vmap(lambda rs: vjp(rs)[0])(r)

        g = jax.vmap(one, in_axes=(0, 1))(ids, cot)  # (B, S, ...)
        diag, covered = fisher_testing.layer_statistics(
          apply_fn, params, ids, cot, structure="diag"
        )
        norms, _ = fisher_testing.layer_statistics(
          apply_fn, params, ids, cot, structure="norms"
        )
        return g, diag, norms, covered

      g, diag, norms, covered = run(params, ids, cot)
      # Everything, RMS-norm scales and learned positions included.
      self.assertTrue(all(jax.tree.leaves(covered)))
      for d, n, c, gi in zip(
        _leaf_values(diag),
        _leaf_values(norms),
        jax.tree.leaves(covered),
        jax.tree.leaves(g),
      ):
        if c:
          # With Flax's default dtypes this model gathers its embedding from
          # a float32 copy and takes its softmax in float32: its float64
          # statistics carry float32 roundoff, and two compilations of the
          # same sums may round differently there.
          tol = 1e-6
          gi = np.asarray(gi)
          _assert_close(self, d, np.sum(gi**2, (0, 1)), rtol=tol)
          gi = np.swapaxes(gi, 0, 1).reshape(S * B, -1)
          _assert_close(self, n, np.sum(gi**2, 1), rtol=tol)

  @parameterized.parameters("plain_seq", "linen_seq", "nnx_seq")
  def test_ordered_shared_dense_loop_and_chunks(self, name):
    """Dense kernels shared over positions, ordered in the empirical
    diagonal's backward pass (their cotangent the sum of the per-example
    gradients the diagonal forms): by the loop over examples (CPU) and by
    chunks of batched products (other backends, remainder rows), the
    diagonal and mean gradient equal the per-example path's."""
    with jax.enable_x64(True):
      apply_fn, params, inputs, out_dim = _model(name)
      y = jnp.arange(B) % out_dim

      def diag(method, chunk_size=None):
        return fisher_testing.empirical(
          fisher.diagonal,
          apply_fn,
          params,
          (inputs, y),
          method=method,
          chunk_size=chunk_size,
        )

      tape = _taps.record(
        apply_fn, params, inputs, statistic="diag", ordered=True
      )
      self.assertNotEmpty(fisher_testing.fused_kernels(tape, "dense"))
      want = _jitted(lambda: diag("per_example"))
      for loop, chunk in ((True, None), (False, None), (False, 3)):
        with mock.patch.object(_taps, "_loop_over_examples", lambda: loop):
          got = _jitted(lambda: diag("auto", chunk))
        with self.subTest(loop=loop, chunk=chunk):
          for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            _assert_close(self, a, b)

  @parameterized.parameters("linen_seq", "plain_derived_seq")
  def test_weight_shared_diag_loop_and_chunks(self, name):
    """The loops over examples (CPU: the weight-shared diagonal, a derived
    value's per-example VJPs) and the chunked batched forms (other
    backends; chunks with remainder rows) equal the oracle."""
    with jax.enable_x64(True):
      apply_fn, params, inputs, out_dim = _model(name)
      cot = _cotangents(out_dim)
      weights = fisher_testing.normal(jax.random.key(3), (2, S * B))
      g = _pseudo_grads(apply_fn, params, inputs, cot)
      want = jax.tree.map(lambda gi: jnp.sum(gi**2, 0), g)
      flat = jnp.concatenate(
        [gi.reshape(S * B, -1) for gi in jax.tree.leaves(g)], 1
      )
      if name == "plain_derived_seq":
        # The weight-normed conv's two leaves share one pass.
        grads = _taps.record(apply_fn, params, inputs).backward(cot)
        names = [jax.tree_util.keystr(p) for p, _ in _paths(params)]
        groups = [[names[k] for k in g] for g in grads._special_groups()]
        self.assertIn(["['cg']", "['cv']"], groups)
      for loop in (True, False):
        with mock.patch.object(_taps, "_loop_over_examples", lambda: loop):

          @jax.jit
          def run(params, inputs, cot, weights):
            grads = _taps.record(apply_fn, params, inputs).backward(cot)
            diags = [
              grads.statistics("diag", chunk_size=c) for c in (1, 4, None)
            ]
            return diags, grads.statistics("gram"), grads.combine(weights)

          diags, gram, combined = run(params, inputs, cot, weights)
          for c, got in zip((1, 4, None), diags):
            with self.subTest(loop=loop, chunk=c):
              for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                _assert_close(self, a, b)
          with self.subTest(loop=loop, statistic="gram, combine"):
            _assert_close(self, gram, flat @ flat.T)
            for a, gi in zip(jax.tree.leaves(combined), jax.tree.leaves(g)):
              _assert_close(self, a, jnp.tensordot(weights, gi, 1))

  def test_gram_both_weight_sharing_forms(self):
    """Ghost form (small T) and materialised form (large T) both exact."""
    with jax.enable_x64(True):
      for t in (2, 9):
        k = jax.random.split(jax.random.key(4), 3)
        params = {
          "w": fisher_testing.normal(k[0], (3, 4)),
          "v": fisher_testing.normal(k[1], (4, 2)),
        }
        apply_fn = lambda p, x: jnp.tanh(x @ p["w"]).sum(1) @ p["v"]
        x = fisher_testing.normal(k[2], (B, t, 3))
        cot = _cotangents(2)
        g = _pseudo_grads(apply_fn, params, x, cot)
        gram, _ = _stats(apply_fn, params, x, cot, "gram")
        flat = jnp.concatenate(
          [gi.reshape(S * B, -1) for gi in jax.tree.leaves(g)], 1
        )
        _assert_close(self, gram, flat @ flat.T)

  def test_kron_factors(self):
    """A = sum_n mean_t a a^T; Gamma = sum delta delta^T (delta: bias grad)."""
    with jax.enable_x64(True):
      params = fisher_testing.mlp_params(
        jax.random.key(0), (4, 5, 3), dtype=jnp.float64
      )
      x = fisher_testing.normal(jax.random.key(1), (B, 4))
      cot = _cotangents(3)
      g = _pseudo_grads(fisher_testing.mlp_apply, params, x, cot)
      kron, _ = _stats(fisher_testing.mlp_apply, params, x, cot, "kron")
      # One example, one sample: A (x) Gamma is the exact kernel block.
      kron1, _ = _stats(
        fisher_testing.mlp_apply, params, x[:1], cot[:1, :1], "kron"
      )
      hidden = jnp.tanh(
        x @ params["dense_0"]["kernel"] + params["dense_0"]["bias"]
      )
      for layer, a in (("dense_0", x), ("dense_1", hidden)):
        d = g[layer]["bias"]  # per-example delta, rows (s, n)
        a_sum, gamma = kron[layer]["kernel"]
        _assert_close(self, a_sum, a.T @ a)
        _assert_close(self, gamma, d.T @ d)
        b_a, b_gamma = kron[layer]["bias"]
        _assert_close(self, b_a, [[B]])
        _assert_close(self, b_gamma, d.T @ d)
      g1 = g["dense_1"]["kernel"][0].reshape(-1)
      a_sum, gamma = kron1["dense_1"]["kernel"]
      _assert_close(self, jnp.kron(a_sum, gamma), jnp.outer(g1, g1))

  def test_kron_weight_sharing_expand(self):
    with jax.enable_x64(True):
      apply_fn, params, ids, out_dim = _model("plain_seq")
      cot = _cotangents(out_dim)
      kron, _ = _stats(apply_fn, params, ids, cot, "kron")
      h = jnp.take(params["table"], ids, axis=0)  # (B, T, 4)
      a_sum, _ = kron["w1"]
      _assert_close(self, a_sum, jnp.einsum("btd,bte->de", h, h) / T)
      counts = (
        jnp.zeros(VOCAB)
        .at[jnp.where(ids < 0, ids + VOCAB, ids).reshape(-1)]
        .add(1.0)
      )
      _assert_close(self, kron["table"][0], jnp.diag(counts) / T)

  def test_kron_weight_sharing_both_conventions_brute_force(self):
    """expand and reduce factors equal their definitions from per-example
    activations and cotangents; with one position the Kronecker product of
    either is the exact block of one example; kronecker() threads it."""

    def apply_fn(p, ids):
      e = p["table"][ids]  # (B, T, 4)
      h = jnp.tanh(e @ p["w1"] + p["b1"])
      return h.sum(axis=1) @ p["w2"]  # positions pooled before the output

    with jax.enable_x64(True):
      k = jax.random.split(jax.random.key(0), 4)
      params = {
        "table": fisher_testing.normal(k[0], (VOCAB, 4)),
        "w1": fisher_testing.normal(k[1], (4, 6)) / 2,
        "b1": fisher_testing.normal(k[2], (6,)) / 4,
        "w2": fisher_testing.normal(k[3], (6, 3)) / 3,
      }
      ids = jax.random.randint(jax.random.key(1), (B, T), 0, VOCAB)
      ids = ids.at[0, :2].set(2)  # a repeated row within an example
      cot = _cotangents(3)
      modes = ("expand", "reduce")

      @jax.jit
      def run(params, ids, cot):
        out = {}
        grads = _taps.record(apply_fn, params, ids).backward(cot)
        one = _taps.record(apply_fn, params, ids[:1]).backward(cot[:, :1])
        for mode in modes:
          kfac = functools.partial(
            fisher.kronecker,
            apply_fn,
            params,
            (ids, jnp.arange(B) % 3),
            likelihood=fisher.Categorical(),
            kind="exact",
            estimator="kfac",
            weight_sharing=mode,
          )
          out[mode] = (
            grads.statistics("kron", weight_sharing=mode),
            one.statistics("kron", weight_sharing=mode)["w2"],
            kfac(),
            # All samples' backward passes at once: the same factors.
            kfac(chunk_size=64 * B),  # more than S * B rows
          )
        return out

      out = run(params, ids, cot)
      # Per-example quantities by hand, in NumPy.
      p = jax.tree.map(np.asarray, params)
      ids, cot = np.asarray(ids), np.asarray(cot)
      e = p["table"][ids]
      h = np.tanh(e @ p["w1"] + p["b1"])
      dz = np.einsum("sbo,ho->sbh", cot, p["w2"])[:, :, None] * (
        1 - h**2
      )  # (S, B, T, 6)
      de = dz @ p["w1"].T  # (S, B, T, 4)
      onehot = np.eye(VOCAB)[ids]  # (B, T, V)
      sq = _sum_outer
      want = {
        "expand": {
          "w1": (sq(e) / T, sq(dz)),
          "b1": (np.full((1, 1), B), sq(dz)),
          "table": (sq(onehot) / T, sq(de)),
          "w2": (sq(h.sum(1)), sq(cot)),
        },
        "reduce": {
          "w1": (sq(e.mean(1)), sq(dz.sum(2))),
          "b1": (np.full((1, 1), B), sq(dz.sum(2))),
          "table": (sq(onehot.mean(1)), sq(de.sum(2))),
          "w2": (sq(h.sum(1)), sq(cot)),
        },
      }
      for mode, leaves in want.items():
        kron, (a_sum, gamma), stat, one_pass = out[mode]
        for name, (a_want, g_want) in leaves.items():
          with self.subTest(f"{mode}/{name}"):
            _assert_close(self, kron[name][0], a_want)
            _assert_close(self, kron[name][1], g_want)
        # One example, one position (w2): either product is the exact block.
        g = np.einsum("i,sj->sij", h[0].sum(0), cot[:, 0]).reshape(S, -1)
        _assert_close(self, np.kron(a_sum, gamma), g.T @ g)
        _assert_close(self, stat.left["w1"], want[mode]["w1"][0] / B)
        for got, ref in zip(
          jax.tree.leaves((one_pass.left, one_pass.right)),
          jax.tree.leaves((stat.left, stat.right)),
        ):
          _assert_close(self, got, ref)
      grads = _taps.record(apply_fn, params, ids).backward(cot)
      with self.assertRaisesRegex(ValueError, "weight_sharing"):
        grads.statistics("kron", weight_sharing="sum")

  @parameterized.parameters("expand", "reduce")
  def test_kron_attention_projections(self, mode):
    """A q/k/v-style kernel (d, heads, head_dim) and its (heads, head_dim)
    bias get factors in the (d, heads * head_dim) view, an output kernel
    (heads, head_dim, d) in (heads * head_dim, d); with one position the
    product is the exact block; KroneckerFisher applies it to the leaf."""

    def apply_fn(p, x):
      z = jnp.einsum("btd,dhk->bthk", x, p["q"]) + p["qb"]
      y = jnp.einsum("bthk,hke->bte", jnp.tanh(z), p["o"])
      return jnp.sum(jnp.tanh(y), axis=1)  # (B, 5)

    with jax.enable_x64(True):
      k = jax.random.split(jax.random.key(0), 4)
      params = {
        "q": fisher_testing.normal(k[0], (4, 2, 3)) / 2,
        "qb": fisher_testing.normal(k[1], (2, 3)) / 4,
        "o": fisher_testing.normal(k[2], (2, 3, 5)) / 2,
      }
      x = fisher_testing.normal(k[3], (B, T, 4))
      cov = _taps.coverage(apply_fn, params, x)
      self.assertTrue(all(c.kronecker for c in jax.tree.leaves(cov)), cov)
      cot = _cotangents(5)
      # Per-example quantities by hand, in NumPy.
      p, xn, cn = jax.tree.map(np.asarray, (params, x, cot))
      z = np.einsum("btd,dhk->bthk", xn, p["q"]) + p["qb"]
      h = np.tanh(z).reshape(B, T, 6)
      y = h @ p["o"].reshape(6, 5)
      dy = cn[:, :, None] * (1 - np.tanh(y) ** 2)  # (S, B, T, 5)
      dz = (dy @ p["o"].reshape(6, 5).T) * (1 - h**2)  # (S, B, T, 6)
      sq = _sum_outer
      if mode == "expand":
        want = {
          "q": (sq(xn) / T, sq(dz)),
          "qb": (np.full((1, 1), B), sq(dz)),
          "o": (sq(h) / T, sq(dy)),
        }
      else:
        want = {
          "q": (sq(xn.mean(1)), sq(dz.sum(2))),
          "qb": (np.full((1, 1), B), sq(dz.sum(2))),
          "o": (sq(h.mean(1)), sq(dy.sum(2))),
        }
      kron, (a_sum, gamma), g, stat, got = _jitted(
        lambda: (
          _taps.record(apply_fn, params, x)
          .backward(cot)
          .statistics("kron", weight_sharing=mode),
          _taps.record(apply_fn, params, x[:1, :1])
          .backward(cot[:, :1])
          .statistics("kron", weight_sharing=mode)["q"],
          _pseudo_grads(apply_fn, params, x[:1, :1], cot[:, :1])["q"],
          stat := _gaussian_kfac(apply_fn, params, x, 5, mode),
          stat.matvec(jax.tree.map(jnp.cos, params)),
        )
      )
      for name, (a_want, g_want) in want.items():
        with self.subTest(name):
          _assert_close(self, kron[name][0], a_want)
          _assert_close(self, kron[name][1], g_want)
      # One example, one position: the product is the exact block.
      g = np.asarray(g).reshape(S, -1)
      _assert_close(self, np.kron(a_sum, gamma), g.T @ g)
      self.assertEqual(stat.estimator, "kfac")
      self.assertEqual(stat.left["q"].shape, (4, 4))
      self.assertEqual(stat.right["q"].shape, (6, 6))
      self.assertEqual(stat.left["o"].shape, (6, 6))
      v = jax.tree.map(np.cos, p)
      for name in params:
        dense = np.kron(stat.left[name], stat.right[name])
        want_v = (dense @ v[name].reshape(-1)).reshape(params[name].shape)
        with self.subTest(f"matvec/{name}"):
          _assert_close(self, got[name], want_v)
      solved = stat.solve(got, 0.0 + 1e-3)
      back = stat.matvec(solved)
      for name in params:
        np.testing.assert_allclose(
          back[name] + 1e-3 * solved[name], got[name], rtol=1e-6, atol=1e-9
        )

  @parameterized.parameters("expand", "reduce")
  def test_kron_of_a_scanned_stack_is_per_layer(self, mode):
    """A (L, d, h, k) kernel and (L, h, k) bias stacked along a scan get one
    factor pair per layer, equal to the unrolled model's; KroneckerFisher
    applies the stacked factors layer by layer."""
    num_layers = 3

    def layer(x, w, b):
      z = jnp.einsum("btd,dhk->bthk", x, w) + b
      return jnp.tanh(z).reshape(x.shape)

    def scanned(p, x):
      step = lambda h, wb: (layer(h, *wb), None)
      return jnp.sum(jax.lax.scan(step, x, (p["w"], p["b"]))[0], axis=1)

    def unrolled(p, x):
      for i in range(num_layers):
        x = layer(x, p[f"w{i}"], p[f"b{i}"])
      return jnp.sum(x, axis=1)

    with jax.enable_x64(True):
      k = jax.random.split(jax.random.key(0), 3)
      params = {
        "w": fisher_testing.normal(k[0], (num_layers, 4, 2, 2)) / 2,
        "b": fisher_testing.normal(k[1], (num_layers, 2, 2)) / 4,
      }
      unstack = lambda tree: {
        f"{n}{i}": tree[n][i] for n in ("w", "b") for i in range(num_layers)
      }
      flat = unstack(params)
      x = fisher_testing.normal(k[2], (B, T, 4))
      cov = _taps.coverage(scanned, params, x)
      self.assertTrue(cov["w"].kronecker and cov["b"].kronecker, cov)
      cot = _cotangents(4)
      got, want = _jitted(
        lambda: (
          _taps.record(scanned, params, x)
          .backward(cot)
          .statistics("kron", weight_sharing=mode),
          _taps.record(unrolled, flat, x)
          .backward(cot)
          .statistics("kron", weight_sharing=mode),
        )
      )
      self.assertEqual(got["w"][0].shape, (num_layers, 4, 4))
      self.assertEqual(got["w"][1].shape, (num_layers, 4, 4))
      for name in ("w", "b"):
        for i in range(num_layers):
          for j in (0, 1):
            with self.subTest(f"{name}{i}/{j}"):
              _assert_close(self, got[name][j][i], want[f"{name}{i}"][j])
      stat = _jitted(lambda: _gaussian_kfac(scanned, params, x, 4, mode))
      self.assertEqual(stat.estimator, "kfac")
      per_layer = fisher.KroneckerFisher(
        unstack(stat.left), unstack(stat.right), None, stat.count
      )
      v = jax.tree.map(np.cos, params)
      v_flat = unstack(v)
      methods = (
        ("matvec", ()),
        ("solve", (1e-2,)),
        ("inverse_diag", (1e-2, params)),
        ("diagonal", (params,)),
      )

      def apply_methods():
        out = {}
        for method, args in methods:
          if method in ("inverse_diag", "diagonal"):
            out[method] = (
              getattr(stat, method)(*args),
              getattr(per_layer, method)(*args[:-1], flat),
            )
          else:
            out[method] = (
              getattr(stat, method)(v, *args),
              getattr(per_layer, method)(v_flat, *args),
            )
        quadratic = (stat.quadratic_form(v), per_layer.quadratic_form(v_flat))
        return out, quadratic

      results, quadratic = _jitted(apply_methods)
      for method, (out, ref) in results.items():
        for name in ("w", "b"):
          for i in range(num_layers):
            with self.subTest(f"{method}/{name}{i}"):
              _assert_close(self, out[name][i], ref[f"{name}{i}"])
      _assert_close(self, *quadratic)
      with self.assertRaisesRegex(ValueError, "do not fit"):
        stat.matvec({"w": v["w"][:2], "b": v["b"]})

  @parameterized.parameters("expand", "reduce")
  def test_stacked_conv_kron_factors_per_layer(self, mode):
    """Conv kernels stacked along a scan have one K-FAC pair per layer,
    those of the same convs unrolled with a leaf each, also formed around
    the backward pass (``statistic="kron"``); their diagonal formed in the
    backward pass equals the recorded one; a conv kernel shared by the
    iterations has no K-FAC factors."""
    dn = ("NHWC", "HWIO", "NHWC")
    num_layers = 3

    def conv(h, k):
      return jnp.tanh(
        jax.lax.conv_general_dilated(h, k, (1, 1), "SAME", None, None, dn)
      )

    def scanned(p, x):
      h, _ = jax.lax.scan(lambda h, k: (conv(h, k), None), x, p["k"])
      return h.reshape(x.shape[0], -1) @ p["w"]

    def unrolled(p, x):
      h = x
      for i in range(num_layers):
        h = conv(h, p[f"k{i}"])
      return h.reshape(x.shape[0], -1) @ p["w"]

    def shared(p, x):
      h, _ = jax.lax.scan(lambda h, _: (conv(h, p["k"]), None), x, None, 2)
      return h.reshape(x.shape[0], -1) @ p["w"]

    with jax.enable_x64(True):
      x = fisher_testing.normal(jax.random.key(0), (B, 4, 4, 2))
      k = 0.5 * fisher_testing.normal(
        jax.random.key(1), (num_layers, 3, 3, 2, 2)
      )
      w = fisher_testing.normal(jax.random.key(2), (4 * 4 * 2, 3))
      stacked = {"k": k, "w": w}
      layers = {"w": w, **{f"k{i}": k[i] for i in range(num_layers)}}
      self.assertTrue(_taps.coverage(scanned, stacked, x)["k"].kronecker)
      shared_k = _taps.coverage(shared, {"k": k[0], "w": w}, x)["k"]
      self.assertTrue(shared_k)
      self.assertFalse(shared_k.kronecker)
      for num_s in (1, 2):
        cot = _cotangents(3, num_s)
        # Under statistic="kron": A in the forward pass, Gamma in the
        # backward pass.
        fusion = _traced_tape(scanned, stacked, x, statistic="kron")._fusion
        assert fusion is not None
        self.assertIn(sorted(stacked).index("k"), fusion.leaves)
        diag = lambda statistic: (
          _taps.record(scanned, stacked, x, statistic=statistic, chunk_size=2)
          .backward(cot)
          .statistics("diag", chunk_size=2)["k"]
        )
        got, want, fused, diags = _jitted(
          lambda: (
            _taps.record(scanned, stacked, x)
            .backward(cot)
            .statistics("kron", weight_sharing=mode)["k"],
            _taps.record(unrolled, layers, x)
            .backward(cot)
            .statistics("kron", weight_sharing=mode),
            _taps.record(
              scanned, stacked, x, statistic="kron", weight_sharing=mode
            )
            .backward(cot)
            .statistics("kron", weight_sharing=mode)["k"],
            (diag("diag"), diag(None)),
          )
        )
        for i in range(num_layers):
          with self.subTest(f"S={num_s}, layer {i}"):
            _assert_close(self, got[0][i], want[f"k{i}"][0])
            _assert_close(self, got[1][i], want[f"k{i}"][1])
            _assert_close(self, fused[0][i], want[f"k{i}"][0])
            _assert_close(self, fused[1][i], want[f"k{i}"][1])
        _assert_close(self, *diags)

  def test_conv_shared_by_scan_iterations(self):
    """A conv kernel shared by a scan's iterations (also inside a scan that
    slices it) takes per-example gradients summed over the iterations: the
    diagonal, Gram matrix and weighted sums equal per-example VJPs'; K-FAC
    (Shampoo factors for these leaves, also for the shared shift) equals the
    per-example path's Shampoo factors."""
    dn = ("NHWC", "HWIO", "NHWC")

    def conv(h, k):
      return jnp.tanh(
        jax.lax.conv_general_dilated(h, k, (1, 1), "SAME", None, None, dn)
      )

    def apply_fn(p, x):
      def layer(h, k):  # k is sliced by the outer scan, shared by the inner
        return jax.lax.scan(lambda h, _: (conv(h, k), None), h, None, 2)[
          0
        ], None

      h = jax.lax.scan(layer, x, p["stack"])[0]
      h = jax.lax.scan(
        lambda h, _: (conv(h, p["k"]) + p["c"], None), h, None, length=3
      )[0]
      return h.reshape(x.shape[0], -1) @ p["w"]

    with jax.enable_x64(True):
      keys = jax.random.split(jax.random.key(0), 5)
      x = fisher_testing.normal(keys[0], (B, 4, 4, 2))
      params = {
        "stack": 0.5 * fisher_testing.normal(keys[1], (2, 3, 3, 2, 2)),
        "k": 0.5 * fisher_testing.normal(keys[2], (3, 3, 2, 2)),
        "c": fisher_testing.normal(keys[3], (2,)),
        "w": fisher_testing.normal(keys[4], (4 * 4 * 2, 3)),
      }
      cov = _taps.coverage(apply_fn, params, x)
      for name in ("stack", "k", "c"):
        self.assertTrue(cov[name], cov[name].reason)
        self.assertFalse(cov[name].kronecker)
      self.assertIn("shared by the iterations", cov["k"].reason)
      cot = _cotangents(3, 2)
      weights = fisher_testing.normal(jax.random.key(9), (2, 2 * B))
      y = jnp.arange(B) % 3

      @jax.jit
      def run(params, x, cot, weights, y):
        def one(x, r):  # g_{s,n} of one example, both samples
          _, vjp = jax.vjp(lambda p: apply_fn(p, x[None])[0], params)
          return jax.vmap(lambda rs: vjp(rs)[0])(r)

        g = jax.vmap(one, in_axes=(0, 1))(x, cot)
        g = jax.tree.map(
          lambda a: jnp.swapaxes(a, 0, 1).reshape((-1,) + a.shape[2:]), g
        )
        grads = _taps.record(apply_fn, params, x).backward(cot)
        kron = {
          method: fisher_testing.empirical(
            fisher.kronecker, apply_fn, params, (x, y), method=method
          )
          for method in ("auto", "per_example")
        }
        return (
          g,
          grads.statistics("diag", chunk_size=2),
          grads.combine(weights),
          grads.statistics("gram", chunk_size=2),
          kron,
        )

      with warnings.catch_warnings():
        # These leaves have no K-FAC rule (asserted above): "auto" warns.
        warnings.simplefilter("ignore", fisher.FisherFallbackWarning)
        g, diag, combine, gram, kron = run(params, x, cot, weights, y)
      g, weights = jax.tree.map(np.asarray, (g, weights))
      rows = np.concatenate(
        [a.reshape(2 * B, -1) for a in jax.tree.leaves(g)], 1
      )
      _assert_close(self, gram, rows @ rows.T)
      for name in params:
        with self.subTest(name):
          _assert_close(self, diag[name], np.sum(g[name] ** 2, 0))
          _assert_close(self, combine[name], np.tensordot(weights, g[name], 1))
      for name in ("stack", "k", "c"):  # w has K-FAC factors under "auto"
        with self.subTest(f"kron {name}"):
          chex.assert_trees_all_close(
            (kron["auto"].left[name], kron["auto"].right[name]),
            (kron["per_example"].left[name], kron["per_example"].right[name]),
            rtol=1e-10,
            atol=1e-12,
          )

  @parameterized.parameters("expand", "reduce")
  def test_conv_kron_factors(self, mode):
    """An HWIO conv kernel's factors are its input patches' and output
    cotangents' (brute force by slicing); with one output position the
    product is the exact block of one example; grouped convs have none."""
    dn = ("NHWC", "HWIO", "NHWC")

    def apply_fn(p, x):
      h = jax.lax.conv_general_dilated(
        x, p["k"], (1, 1), "VALID", None, None, dn
      )
      return jnp.tanh(h).reshape(x.shape[0], -1) @ p["w"]

    with jax.enable_x64(True):
      x = fisher_testing.normal(jax.random.key(0), (B, 4, 5, 2))
      k = fisher_testing.normal(jax.random.key(1), (3, 3, 2, 4))
      params = {
        "k": k,
        "w": fisher_testing.normal(jax.random.key(2), (2 * 3 * 4, 3)),
      }
      self.assertTrue(_taps.coverage(apply_fn, params, x)["k"].kronecker)
      cot = _cotangents(3)
      got = (
        _taps.record(apply_fn, params, x)
        .backward(cot)
        .statistics("kron", weight_sharing=mode)["k"]
      )
      patches = jnp.stack(
        [
          x[:, i : i + 3, j : j + 3, :].reshape(B, -1)
          for i in range(2)
          for j in range(3)
        ],
        1,
      )  # (B, T, 18), positions row-major
      h = jax.lax.conv_general_dilated(x, k, (1, 1), "VALID", None, None, dn)
      delta = jnp.einsum("sbo,po->sbp", cot, params["w"]).reshape(
        (S,) + h.shape
      ) * (1 - jnp.tanh(h) ** 2)
      delta = delta.reshape(S, B, -1, 4)
      sq = lambda z: jnp.einsum("...i,...j->ij", z, z)
      if mode == "expand":
        want = (sq(patches) / patches.shape[1], sq(delta))
      else:
        want = (sq(patches.mean(1)), sq(delta.sum(2)))
      _assert_close(self, got[0], want[0])
      _assert_close(self, got[1], want[1])
      # Patches of 2 examples at a time (the last chunk padded): same factors.
      with mock.patch.object(_taps, "_BLOCK_ELEMENTS", 2 * 6 * 18):
        chunked = (
          _taps.record(apply_fn, params, x)
          .backward(cot)
          .statistics("kron", weight_sharing=mode)["k"]
        )
      _assert_close(self, chunked[0], want[0])
      _assert_close(self, chunked[1], want[1])
      # One output position, one example: the exact block.
      params1 = dict(params, w=params["w"][:4])
      x1 = x[:1, :3, :3]
      one = _taps.record(apply_fn, params1, x1).backward(cot[:, :1])
      a_sum, gamma = one.statistics("kron", weight_sharing=mode)["k"]
      g = _pseudo_grads(apply_fn, params1, x1, cot[:, :1])["k"].reshape(S, -1)
      _assert_close(self, jnp.kron(a_sum, gamma), g.T @ g)

      def grouped(p, x):
        h = jax.lax.conv_general_dilated(
          x, p["k"], (1, 1), "VALID", None, None, dn, feature_group_count=2
        )
        return h.reshape(x.shape[0], -1)

      cov = _taps.coverage(grouped, {"k": k[:, :, :1]}, x)
      self.assertTrue(cov["k"])
      self.assertFalse(cov["k"].kronecker)

  def test_tape_gradient_backward_and_take(self):
    """gradient() is the batch VJP plus S=1 stats; take() slices samples."""
    with jax.enable_x64(True):
      apply_fn, params, inputs, out_dim = _model("linen_seq")
      cot = _cotangents(out_dim, 3)

      @jax.jit
      def run(params, inputs, cot):
        tape = _taps.record(apply_fn, params, inputs)
        grad, lg = tape.gradient(cot[0])
        _, vjp = jax.vjp(lambda p: apply_fn(p, inputs), params)
        both = tape.backward(cot)
        return dict(
          grad=grad,
          vjp=vjp(cot[0])[0],
          outputs=tape.outputs,
          apply=apply_fn(params, inputs),
          diag0=lg.statistics("diag"),
          want0=both.take(slice(0, 1)).statistics("diag"),
          diag12=both.take(slice(1, None)).statistics("diag"),
          want12=fisher_testing.layer_statistics(
            apply_fn, params, inputs, cot[1:], structure="diag"
          )[0],
        )

      out = run(params, inputs, cot)
      g = _pseudo_grads(apply_fn, params, inputs, cot)
      for got, gi in zip(jax.tree.leaves(out["diag0"]), jax.tree.leaves(g)):
        _assert_close(self, got, jnp.sum(gi[:B] ** 2, 0))
      chex.assert_trees_all_close(out["grad"], out["vjp"], rtol=1e-12)
      chex.assert_trees_all_close(out["diag0"], out["want0"], rtol=1e-12)
      chex.assert_trees_all_close(out["diag12"], out["want12"], rtol=1e-12)
      np.testing.assert_allclose(out["outputs"], out["apply"], rtol=1e-12)


class CoverageTest(parameterized.TestCase):
  def test_uncovered_leaves_are_reported(self):
    """Norms, tied and reused dense and conv kernels are covered (a reused
    kernel sums its uses per example, without K-FAC factors)."""

    class Mixed(nn.Module):
      @nn.compact
      def __call__(self, ids):
        emb = nn.Embed(VOCAB, 4)
        h = emb(ids)  # (B, T, 4)
        conv = nn.Conv(4, (2,))
        h = conv(conv(h))  # a conv kernel used twice
        h = nn.LayerNorm()(h)
        shared = nn.Dense(4)
        h = shared(jnp.tanh(shared(h)))  # a kernel used twice
        h = nn.Dense(4, name="head")(h.mean(1))
        return emb.attend(h)  # tied: the table is used twice

    model = Mixed()
    ids = jnp.array([[0, 1, 2], [3, 3, 4]])
    params = model.init(jax.random.key(0), ids)
    cov = _taps.coverage(model.apply, params, ids)["params"]
    self.assertTrue(cov["Embed_0"]["embedding"])
    self.assertTrue(cov["Conv_0"]["kernel"])
    self.assertFalse(cov["Conv_0"]["kernel"].kronecker)
    self.assertTrue(cov["LayerNorm_0"]["scale"])
    self.assertIn("shared by 2 uses", cov["Dense_0"]["kernel"].reason)
    self.assertIn("conv_general_dilated", cov["Conv_0"]["kernel"].reason)
    self.assertIn("shared by 2 uses", cov["Conv_0"]["kernel"].reason)
    self.assertTrue(cov["Conv_0"]["bias"])
    self.assertTrue(cov["Dense_0"]["kernel"])
    self.assertTrue(cov["Dense_0"]["bias"])
    self.assertFalse(cov["Dense_0"]["kernel"].kronecker)
    self.assertTrue(cov["head"]["kernel"])
    self.assertTrue(cov["head"]["bias"])
    # Covered leaves still match the oracle; uncovered ones are None.
    with jax.enable_x64(True):
      p64 = jax.tree.map(lambda a: a.astype(jnp.float64), params)
      cot = fisher_testing.normal(jax.random.key(1), (S, 2, VOCAB))
      g = _pseudo_grads(model.apply, p64, ids, cot)
      diag, covered = _stats(model.apply, p64, ids, cot, "diag")
      for d, c, gi in zip(
        _leaf_values(diag), jax.tree.leaves(covered), jax.tree.leaves(g)
      ):
        if c:
          _assert_close(self, d, jnp.sum(gi**2, 0))
        else:
          self.assertIsNone(d)

  def test_bias_with_second_consumer_is_an_elementwise_shift(self):
    params = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
    x = jnp.ones((4, 3))

    def apply_fn(p, x):
      z = x @ p["w"]
      return (z + p["b"]) * z  # the product feeds the bias add and more

    cov = _taps.coverage(apply_fn, params, x)
    self.assertEqual(cov["w"].reason, "the kernel of a dot_general")
    self.assertEqual(cov["b"].reason, "an elementwise shift (add)")

  def test_stacked_linear_layers_are_covered(self):
    """A product feeding another product directly (no bias, no activation)."""
    params = {"w1": jnp.ones((3, 4)), "w2": jnp.ones((4, 2))}
    cov = _taps.coverage(
      lambda p, x: x @ p["w1"] @ p["w2"], params, jnp.ones((5, 3))
    )
    self.assertTrue(cov["w1"] and cov["w2"])

  def test_scan_rules(self):
    """Stacked and const leaves are covered; a leaf carried with the
    activations and a scan over the examples themselves are not. A scan of
    parameters alone computes a derived value."""
    params = {"w": jnp.ones((3, 3)), "v": jnp.ones((2, 3, 3))}

    def apply_fn(p, x):
      h = jax.lax.scan(lambda h, v: (h @ v, None), x @ p["w"], p["v"])[0]
      twice = lambda c, _: ((c[0] * 2, c[1]), None)
      c = jax.lax.scan(twice, (p["w"], h), None, length=2)[0]
      return c[1] @ c[0]

    cov = _taps.coverage(apply_fn, params, jnp.ones((4, 3)))
    self.assertIn("stacked along the iterations", cov["v"].reason)
    self.assertIn("a scan carry", cov["w"].reason)
    self.assertFalse(cov["w"])

    def param_scan(p, x):  # the scan's result depends on w alone
      c = jax.lax.scan(lambda c, _: (c * 2, None), p["w"], None, length=2)[0]
      return x @ c

    cov = _taps.coverage(param_scan, params, jnp.ones((4, 3)))
    self.assertTrue(cov["w"])
    self.assertIn("computed from parameters", cov["w"].reason)

    def over_batch(p, x):  # B = T = 4: the body sees (T, d) slices
      return jax.lax.map(lambda xi: jnp.tanh(xi @ p["w"]), x)

    cov = _taps.coverage(over_batch, params, jnp.ones((4, 4, 3)))
    self.assertIn("a scan over the batch", cov["w"].reason)

    # Linen's recurrent cells: nn.scan broadcasts their parameters to every
    # step (consts), so K-FAC factors exist too.
    rnn = nn.RNN(nn.LSTMCell(4))
    x = jnp.ones((2, 3, 5))
    abstract = jax.eval_shape(rnn.init, jax.random.key(0), x)
    flat = jax.tree.leaves(_taps.coverage(rnn.apply, abstract, x))
    self.assertLen(flat, 12)
    self.assertTrue(all(c and c.kronecker for c in flat), flat)

  @parameterized.parameters(
    # (dimension_numbers, kernel shape, strides, padding, lhs/rhs dilation,
    # feature groups)
    (("NCHW", "OIHW", "NCHW"), (4, 2, 3, 2), (1, 2), "SAME", (1, 1), (1, 1), 1),
    (
      ("NHWC", "HWIO", "NHWC"),
      (2, 2, 1, 4),
      (2, 1),
      "VALID",
      (1, 1),
      (2, 1),
      2,
    ),
    (
      ("NHWC", "HWIO", "NHWC"),
      (3, 1, 2, 4),
      (1, 1),
      ((1, 2), (0, 1)),
      (2, 1),
      (1, 1),
      1,
    ),
    (("NWHC", "WHIO", "NHWC"), (2, 2, 1, 2), (1, 1), "SAME", (1, 1), (1, 2), 2),
  )
  def test_conv_layouts(
    self, dn, shape, strides, padding, lhs_d, rhs_d, groups
  ):
    """Any dimension numbers, strides, padding, dilations and feature groups:
    diag, Gram and norms equal the oracle."""

    def apply_fn(p, x):
      h = jax.lax.conv_general_dilated(
        x,
        p["k"],
        strides,
        padding,
        lhs_d,
        rhs_d,
        dn,
        feature_group_count=groups,
      )
      return jnp.tanh(h).reshape(x.shape[0], -1) @ p["w"]

    with jax.enable_x64(True):
      x = fisher_testing.normal(jax.random.key(0), (B, 5, 5, 5), jnp.float64)
      x = x[..., :2] if dn[0].endswith("C") else x[:, :2]  # 2 channels in
      k = fisher_testing.normal(jax.random.key(1), shape, jnp.float64)
      h = jax.eval_shape(
        lambda: jax.lax.conv_general_dilated(
          x, k, strides, padding, lhs_d, rhs_d, dn, feature_group_count=groups
        )
      )
      w = fisher_testing.normal(
        jax.random.key(2), (math.prod(h.shape[1:]), 3), jnp.float64
      )
      params = {"k": k, "w": w}
      cov = _taps.coverage(apply_fn, params, x)
      self.assertTrue(cov["k"])
      # K-FAC factors fit the (patch, O) matrix view of HWIO, one group.
      self.assertEqual(cov["k"].kronecker, dn[1] == "HWIO" and groups == 1)
      cot = _cotangents(3)
      g = _pseudo_grads(apply_fn, params, x, cot)
      for structure in ("diag", "gram", "norms"):
        got, _ = _stats(apply_fn, params, x, cot, structure, 2)
        if structure == "diag":
          want = jax.tree.map(lambda gi: jnp.sum(gi**2, 0), g)
        else:
          flat = jnp.concatenate(
            [a.reshape(a.shape[0], -1) for a in jax.tree.leaves(g)], 1
          )
          want = flat @ flat.T
          if structure == "norms":
            want = jax.tree.map(
              lambda gi: jnp.sum(gi.reshape(gi.shape[0], -1) ** 2, 1), g
            )
        with self.subTest(structure):
          for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            _assert_close(self, a, b, rtol=1e-9)

  def test_conv_patch_budget_chunks_rows(self):
    """With the default chunking, examples are split so that a chunk's
    input patches fit the patch budget: the diagonal's chunks of examples
    (the kernel's one use outside scans), the combination's chunks of rows
    (a padded last chunk included); both equal the oracle."""

    def apply_fn(p, x):
      h = jax.lax.conv_general_dilated(
        x, p["k"], (2, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
      )
      return jnp.tanh(h).reshape(x.shape[0], -1) @ p["w"]

    with jax.enable_x64(True):
      x = fisher_testing.normal(jax.random.key(0), (B, 5, 4, 2), jnp.float64)
      params = {
        "k": fisher_testing.normal(
          jax.random.key(1), (3, 2, 2, 3), jnp.float64
        ),
        "w": fisher_testing.normal(
          jax.random.key(2), (3 * 4 * 3, 2), jnp.float64
        ),
      }
      cot = _cotangents(2)
      g = _pseudo_grads(apply_fn, params, x, cot)
      flat = jnp.concatenate(
        [a.reshape(a.shape[0], -1) for a in jax.tree.leaves(g)], 1
      )
      weights = fisher_testing.normal(
        jax.random.key(3), (2, S * B), jnp.float64
      )
      patches = 3 * 4 * 6 * 2  # positions x window x input channels
      # The diagonal: chunks of 1 example of B = 3 (2 do not divide it).
      with mock.patch.object(_taps, "_PATCH_CHUNK_ELEMENTS", 2 * patches):
        diag, _ = _stats(apply_fn, params, x, cot, "diag", None)
      _jit_stats.clear_cache()
      # The combination: chunks of 4 rows of S * B = 6, the last one padded.
      with mock.patch.object(_taps, "_PATCH_CHUNK_ELEMENTS", 4 * patches):
        tape = _taps.record(apply_fn, params, x)
        combined = tape.backward(cot).combine(weights)
      _jit_stats.clear_cache()
      want = jax.tree.map(lambda gi: jnp.sum(gi**2, 0), g)
      for a, b in zip(jax.tree.leaves(diag), jax.tree.leaves(want)):
        _assert_close(self, a, b, rtol=1e-9)
      want = fisher_testing.unravel_like(params, weights @ flat)
      for a, b in zip(jax.tree.leaves(combined), jax.tree.leaves(want)):
        _assert_close(self, a, b, rtol=1e-9)

  @parameterized.parameters("empirical", "exact")
  def test_conv_diagonal_slices_the_recorded_arrays(self, kind):
    """A conv kernel used once outside scans forms its diagonal from slices
    of the recorded activations and cotangents, a chunk of examples at a
    time: no gather of rows from them (the generic path's), which also made
    XLA:CPU copy the activation next to the forward pass's own."""

    def apply_fn(p, x):
      dn = ("NHWC", "HWIO", "NHWC")
      z = jax.lax.conv_general_dilated(
        x, p["c1"], (1, 1), "SAME", dimension_numbers=dn
      )
      z = jax.lax.conv_general_dilated(
        jax.nn.relu(z), p["c2"], (2, 2), "SAME", dimension_numbers=dn
      )
      return jnp.tanh(z).reshape(x.shape[0], -1) @ p["w"]

    key = jax.random.split(jax.random.key(0), 5)
    params = {
      "c1": fisher_testing.normal(key[0], (3, 3, 2, 4)),
      "c2": fisher_testing.normal(key[1], (3, 3, 4, 4)) / 4,
      "w": fisher_testing.normal(key[2], (4 * 4 * 4, 3)) / 8,
    }
    x = fisher_testing.normal(key[3], (8, 8, 8, 2))
    y = jax.random.randint(key[4], (8,), 0, 3)

    def diag(method):
      return lambda p: fisher.diagonal(
        apply_fn,
        p,
        (x, y),
        likelihood=fisher.Categorical(),
        kind=kind,
        method=method,
      )

    gathered = []

    def walk(jaxpr):
      for eqn in jaxpr.eqns:
        if eqn.primitive.name == "gather":
          gathered.append(eqn.invars[0].aval.shape)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
          walk(sub)

    # A patch budget of 3 examples: a loop over chunks, and a remainder.
    with mock.patch.object(_taps, "_PATCH_CHUNK_ELEMENTS", 3 * 8 * 8 * 9 * 2):
      walk(jax.make_jaxpr(diag("auto"))(params).jaxpr)
      got = jax.jit(diag("auto"))(params)
    self.assertEmpty(gathered)
    want = jax.jit(diag("per_example"))(params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

  def test_conv_rules(self):
    """A conv kernel shared by a scan's iterations is covered, without
    K-FAC factors; one with batch groups is not (its bias is)."""
    x = jnp.ones((4, 6, 2))
    k = jnp.ones((2, 2, 2))

    def in_scan(p, x):
      step = lambda h, _: (
        jax.lax.conv_general_dilated(
          h, p["k"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
        )
        + p["b"],
        None,
      )
      return jax.lax.scan(step, x, None, length=2)[0]

    cov = _taps.coverage(in_scan, {"k": k, "b": jnp.ones(2)}, x)
    self.assertTrue(cov["k"])
    self.assertFalse(cov["k"].kronecker)
    self.assertIn("shared by the iterations of a scan", cov["k"].reason)
    self.assertTrue(cov["b"])

    def batch_groups(p, x):
      out = jax.lax.conv_general_dilated(
        x,
        p["k"],
        (1,),
        "SAME",
        dimension_numbers=("NWC", "WIO", "NWC"),
        batch_group_count=2,
      )
      return out.reshape(x.shape[0], 6, -1)  # B/2 rows back to B

    cov = _taps.coverage(batch_groups, {"k": k}, x)
    self.assertIn("batch_group_count > 1", cov["k"].reason)
    self.assertFalse(cov["k"])

  def test_parameters_times_constants(self):
    """A leaf times a constant (a BatchNorm's ``rsqrt(var + eps)``, a scalar
    multiplier on a kernel) records ``x * c``: every statistic, K-FAC
    factors included, is the one of the model with ``c`` moved onto the
    activation. A kernel times a mask is not covered."""
    with jax.enable_x64(True):
      x = fisher_testing.normal(jax.random.key(1), (B, 3, 4))
      c = 0.5 + jnp.abs(fisher_testing.normal(jax.random.key(2), (4,)))
      params = {
        "s": fisher_testing.normal(jax.random.key(3), (4,)),
        "u": fisher_testing.normal(jax.random.key(5), (1, 4)),
        "w": fisher_testing.normal(jax.random.key(4), (4, 2)),
      }
      c2 = jnp.full((1, 1), 1.5)  # size-one axes broadcast by the product

      def scaled(p, x):  # the constants enter with the parameters
        h = jnp.tanh(x * (p["s"] * c)) * (p["u"] * c2)
        return h @ (p["w"] * 0.25)

      def moved(p, x):  # the same function, constants on the activations
        h = (jnp.tanh((x * c) * p["s"]) * 1.5) * p["u"]
        return (h * 0.25) @ p["w"]

      cov = _taps.coverage(scaled, params, x)
      self.assertTrue(all(jax.tree.leaves(cov)))
      self.assertIn("times a constant", cov["s"].reason)
      self.assertTrue(cov["w"].kronecker)
      cot = fisher_testing.normal(jax.random.key(7), (S, B, 3, 2))
      for structure in ("diag", "kron", "gram"):
        with self.subTest(structure):
          got, _ = _stats(scaled, params, x, cot, structure)
          want, _ = _stats(moved, params, x, cot, structure)
          self.assertEqual(jax.tree.structure(got), jax.tree.structure(want))
          for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            _assert_close(self, g, w)

      # A kernel times a mask, and a constant outside the jaxpr of the layer
      # using the product (here, outside a jit), do not fold into the
      # activation: their products run as derived values (a VJP per
      # example, no K-FAC factors; test_values_computed_from_parameters).
      mask = jnp.arange(8.0).reshape(4, 2) % 3
      inner = jax.jit(lambda s, x: x * s)
      for fn, leaf in (
        (lambda p, x: x @ (p["w"] * mask), "w"),
        (lambda p, x: inner(p["s"] * c, x), "s"),
      ):
        cov = _taps.coverage(fn, params, x)
        self.assertTrue(cov[leaf])
        self.assertFalse(cov[leaf].kronecker)
        self.assertIn("computed from parameters", cov[leaf].reason)

  def test_values_computed_from_parameters(self):
    """A layer using a value computed from parameters alone (WeightNorm,
    softplus, a mask, merged LoRA weights; statistics: the oracle test's
    plain_derived_seq) is on the layer path without K-FAC factors, also in
    a scan's body from the leaves it slices; the value entering a scan,
    made in a scan from a shared leaf or in nested scans, made in a call
    that also takes inputs, used opaquely or returned is not."""
    params = {
      "w": jnp.ones((3, 3)),
      "s": jnp.ones(3),
      "v": jnp.ones((2, 3, 3)),
      "n": jnp.ones((2, 2, 3, 3)),
    }
    x = jnp.ones((4, 3))
    soft = lambda p: jax.nn.softplus(p["s"])  # a jitted function of s

    cov = _taps.coverage(
      lambda p, x: (x * soft(p)) @ (p["w"] / 2 + 1), params, x
    )
    self.assertTrue(cov["w"] and cov["s"])
    self.assertFalse(cov["w"].kronecker or cov["s"].kronecker)
    self.assertIn("elementwise scale (mul), a value computed", cov["s"].reason)

    def into_scan(p, x):  # a derived stack enters the scan
      layer = lambda h, w: (jnp.tanh(h @ w), None)
      return jax.lax.scan(layer, x, p["v"] * 2 + 1)[0]

    def in_scan(p, x):  # derived inside the body, from the sliced leaf
      layer = lambda h, w: (jnp.tanh(h @ (w * _MASK[:3, :3])), None)
      return jax.lax.scan(layer, x, p["v"])[0]

    cov = _taps.coverage(in_scan, params, x)
    self.assertTrue(cov["v"])
    self.assertIn("a value computed from parameters", cov["v"].reason)

    def shared_in_scan(p, x):  # derived inside the body from a shared leaf
      layer = lambda h, _: (jnp.tanh(h @ jnp.exp(p["w"])), None)
      return jax.lax.scan(layer, x, None, length=2)[0]

    cov = _taps.coverage(shared_in_scan, params, x)
    self.assertTrue(cov["w"])

    def mixed_in_scan(p, x):  # from a sliced and a shared leaf
      layer = lambda h, v: (jnp.tanh(h @ (v + jnp.exp(p["w"]))), None)
      return jax.lax.scan(layer, x, p["v"])[0]

    def out_of_scan(p, x):  # derived inside the body, then returned
      layer = lambda h, w: (jnp.tanh(h @ w), jnp.exp(w))
      h, ws = jax.lax.scan(layer, x, p["v"])
      return h @ ws[0]

    def nested(p, x):  # derived inside a scan inside a scan
      def outer(h, w):
        inner = lambda h, u: (jnp.tanh(h @ (u * _MASK[:3, :3])), None)
        return jax.lax.scan(inner, h, w)[0], None

      return jax.lax.scan(outer, x, p["n"])[0]

    made_inside = jax.jit(lambda x, w: (jnp.tanh(x), w * 2 + 1))

    def from_call(p, x):
      h, w = made_inside(x, p["w"])
      return h @ w

    cases = {
      "an operand of scan (a value computed": into_scan,
      "inside a scan, from leaves the scan slices and shares": mixed_in_scan,
      "computed from parameters inside nested scans": nested,
      "an output of a scan body (a value computed": out_of_scan,
      "computed from parameters inside a call taking inputs": from_call,
      "an operand of max": lambda p, x: jnp.maximum(x, soft(p)),
    }
    for reason, fn in cases.items():
      with self.subTest(reason):
        cov = _taps.coverage(fn, params, x)
        leaf = "v" if "scan" in reason else ("w" if "call" in reason else "s")
        leaf = "w" if "slices and shares" in reason else leaf
        leaf = "n" if "nested" in reason else leaf
        self.assertFalse(cov[leaf])
        self.assertIn(reason, cov[leaf].reason)
    # A value returned as an output (the estimators and coverage refuse
    # such outputs; the planner still names the use).
    leaves, _, _, closed, _, b = _taps._trace(
      lambda p, x: (x @ p["w"], soft(p)), params, x
    )
    plan = _taps._make_plan(closed, len(leaves), b)
    names = [k for k, _ in sorted(params.items())]
    self.assertIn("returned by apply_fn", plan.reasons[names.index("s")])

  @parameterized.parameters("plain_heads_seq", "plain_derived_seq")
  def test_estimators_equal_the_per_example_path(self, name):
    """Per-head kernels and values computed from parameters, end to end:
    ``method="auto"`` (no fallback) against ``"per_example"``."""
    with jax.enable_x64(True):
      apply_fn, params, x, out_dim = _model(name)
      y = jnp.arange(B) % out_dim
      _assert_paths_agree(self, apply_fn, params, (x, y), rank=3)

  def test_per_head_kfac_factors(self):
    """A per-head kernel's K-FAC sums are, head by head, those of the same
    model with one dense kernel per head (both weight-sharing conventions);
    stacked along a scan they are per layer and head; a kernel whose
    contracted axes do not lead its free ones has none."""
    with jax.enable_x64(True):
      x = fisher_testing.normal(jax.random.key(1), (B, T, 2, 3))
      k = fisher_testing.normal(jax.random.key(2), (2, 3, 4))
      w = fisher_testing.normal(jax.random.key(3), (T * 2 * 4, 2))
      cot = fisher_testing.normal(jax.random.key(4), (S, B, 2))

      def batched(p, x):
        h = jnp.tanh(jnp.einsum("bthd,hde->bthe", x, p["k"]))
        return h.reshape(len(x), -1) @ p["w"]

      def unrolled(p, x):
        heads = [x[:, :, i] @ p[f"k{i}"] for i in range(2)]
        h = jnp.tanh(jnp.stack(heads, axis=2))
        return h.reshape(len(x), -1) @ p["w"]

      split = {"k0": k[0], "k1": k[1], "w": w}
      for mode in ("expand", "reduce"):
        with self.subTest(mode):
          got, want = _jitted(
            lambda: (
              _taps.record(batched, {"k": k, "w": w}, x)
              .backward(cot)
              .statistics("kron", weight_sharing=mode)["k"],
              _taps.record(unrolled, split, x)
              .backward(cot)
              .statistics("kron", weight_sharing=mode),
            )
          )
          for i in range(2):
            _assert_close(self, got[0][i], want[f"k{i}"][0])
            _assert_close(self, got[1][i], want[f"k{i}"][1])

      apply_fn, params, inputs, out_dim = _model("plain_heads_seq")
      cov = _taps.coverage(apply_fn, params, inputs)
      kron = [cov[n].kronecker for n in ("k", "k2", "stack", "shared", "v")]
      self.assertEqual(kron, [True, False, True, False, True])
      cot = _cotangents(out_dim)
      factors = jax.eval_shape(
        lambda: (
          _taps.record(apply_fn, params, inputs)
          .backward(cot)
          .statistics("kron")
        )
      )
      self.assertEqual(factors["stack"][0].shape, (2, 2, 3, 3))  # (L, H, ...)
      self.assertEqual(factors["v"][1].shape, (2, 1, 1))
      self.assertIsNone(factors["k2"])

  def test_conv_local_takes_the_per_head_rule(self):
    """Linen ``ConvLocal`` contracts its patches with one kernel per output
    position (a ``dot_general`` batch axis): on the layer path, equal to
    the per-example path."""

    class LocalNet(nn.Module):
      @nn.compact
      def __call__(self, x):
        h = nn.ConvLocal(3, (3, 3), param_dtype=x.dtype)(x)
        return nn.Dense(4, param_dtype=x.dtype)(jnp.tanh(h).reshape(len(x), -1))

    with jax.enable_x64(True):
      x = fisher_testing.normal(jax.random.key(1), (B, 5, 5, 2))
      model = LocalNet()
      params = model.init(jax.random.key(0), x)
      cov = _taps.coverage(model.apply, params, x)
      kernel = cov["params"]["ConvLocal_0"]["kernel"]
      self.assertIn("dot_general with batch axes", kernel.reason)
      y = jnp.arange(B) % 4
      _assert_paths_agree(self, model.apply, params, (x, y), rank=2)

  def test_coverage_on_shape_dtype_structs(self):
    params = fisher_testing.mlp_params(jax.random.key(0))
    abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params
    )
    cov = _taps.coverage(
      fisher_testing.mlp_apply,
      abstract,
      jax.ShapeDtypeStruct((7, 4), jnp.float32),
    )
    self.assertTrue(all(jax.tree.leaves(cov)))


class NumericsAndTracingTest(parameterized.TestCase):
  def test_bf16_params_give_float32_statistics(self):
    apply_fn, p32, x32, out_dim = _model("linen_mlp", jnp.float32)
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p32)
    cot = _cotangents(out_dim, dtype=jnp.float32)
    d16, _ = _stats(apply_fn, p16, x32.astype(jnp.bfloat16), cot, "diag")
    d32, _ = _stats(apply_fn, p32, x32, cot, "diag")
    for a, b in zip(jax.tree.leaves(d16), jax.tree.leaves(d32)):
      self.assertEqual(a.dtype, jnp.float32)
      np.testing.assert_allclose(a, b, rtol=0.1, atol=1e-2)

  def test_no_retrace_under_jit(self):
    apply_fn, params, inputs, out_dim = _model("linen_seq", jnp.float32)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def stats(p, x, c):
      return fisher_testing.layer_statistics(
        apply_fn, p, x, c, structure="diag"
      )[0]

    cot = _cotangents(out_dim, dtype=jnp.float32)
    stats(params, inputs, cot)
    out = stats(params, inputs, 2 * cot)
    chex.assert_tree_all_finite(out)

  def test_nonfinite_cotangent_is_not_hidden(self):
    apply_fn, params, inputs, out_dim = _model("plain_mlp", jnp.float32)
    cot = _cotangents(out_dim, dtype=jnp.float32).at[0, 1, 0].set(jnp.nan)
    diag, _ = _stats(apply_fn, params, inputs, cot, "diag")
    self.assertTrue(np.isnan(diag["dense_1"]["kernel"]).any())

  def test_zero_cotangents_give_zero_statistics(self):
    apply_fn, params, inputs, out_dim = _model("nnx_seq", jnp.float32)
    cot = jnp.zeros((S, B, out_dim))
    for structure in ("diag", "norms"):
      stats, _ = _stats(apply_fn, params, inputs, cot, structure)
      for leaf in jax.tree.leaves(stats):
        np.testing.assert_array_equal(leaf, 0.0)


class ErrorsTest(parameterized.TestCase):
  def setUp(self):
    super().setUp()
    self.params = fisher_testing.mlp_params(jax.random.key(0))
    self.x = jnp.ones((B, 4))
    self.cot = jnp.ones((S, B, fisher_testing.OUT_DIM))

  def _stats(self, **kw):
    args = dict(
      apply_fn=fisher_testing.mlp_apply,
      params=self.params,
      inputs=self.x,
      cotangents=self.cot,
      structure="diag",
    )
    args.update(kw)
    return fisher_testing.layer_statistics(**args)

  def test_bad_structure(self):
    with self.assertRaisesRegex(ValueError, "structure must be one of"):
      self._stats(structure="full")

  @parameterized.parameters(0, -2, 1.5, True)
  def test_bad_chunk_size(self, chunk):
    with self.assertRaisesRegex(ValueError, "chunk_size"):
      self._stats(chunk_size=chunk)

  def test_cotangent_shape_mismatch(self):
    with self.assertRaisesRegex(ValueError, r"cotangents must have shape"):
      self._stats(cotangents=jnp.ones((S, B + 1, fisher_testing.OUT_DIM)))
    with self.assertRaisesRegex(ValueError, r"cotangents must have shape"):
      self._stats(cotangents=jnp.ones((B, fisher_testing.OUT_DIM)))

  def test_mismatched_input_batch(self):
    with self.assertRaisesRegex(ValueError, "leading batch axis"):
      self._stats(
        apply_fn=lambda p, xs: fisher_testing.mlp_apply(p, xs[0]),
        inputs=(self.x, jnp.ones((B + 1, 4))),
      )

  def test_non_array_param(self):
    params = dict(self.params, extra={"scale": "big"})
    with self.assertRaisesRegex(TypeError, r"\['extra'\]\['scale'\]"):
      self._stats(params=params)

  def test_bad_combine_weights(self):
    with self.assertRaisesRegex(ValueError, r"weights must have shape"):
      fisher_testing.layer_combine(
        fisher_testing.mlp_apply,
        self.params,
        self.x,
        self.cot,
        jnp.ones((2, S * B + 1)),
      )


class _RematBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))
    return x + nn.Dense(x.shape[-1])(nn.gelu(h)), None


class _ScannedStack(nn.Module):
  """Blocks stacked by ``nn.scan`` over ``nn.remat``, a mean-pooled head."""

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(
      nn.remat(_RematBlock),
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=4,
    )
    x, _ = scan()(nn.Dense(32)(x), None)
    return nn.Dense(8)(jnp.mean(x, axis=1))


class _ConvBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return jax.nn.relu(nn.Conv(4, (3, 3))(x)), None


class _ScannedConvs(nn.Module):
  """3x3 convs stacked by ``nn.scan`` over ``nn.remat``, a dense head."""

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3, 3), strides=2)(x)
    scan = nn.scan(
      nn.remat(_ConvBlock),
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=2,
    )
    x, _ = scan()(x, None)
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


def _traced_tape(apply_fn, params, inputs, **kw) -> _taps.LayerTape:
  """A tape recorded under ``eval_shape``: its plan, without running it."""
  tapes = []

  def record(params, inputs):
    tapes.append(_taps.record(apply_fn, params, inputs, **kw))
    return 0.0

  jax.eval_shape(record, params, inputs)
  return tapes[0]


def _assert_same_statistic(test, got, want) -> None:
  """The same tree (``None`` where a leaf has no statistic), leaves equal to
  float32 roundoff of each leaf's scale."""
  is_none = lambda v: v is None
  test.assertEqual(
    jax.tree.structure(got, is_leaf=is_none),
    jax.tree.structure(want, is_leaf=is_none),
  )
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    scale = float(jnp.max(jnp.abs(w)))
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale)


def _conv_classifier(b: int, side: int, stacked: bool):
  """``(apply_fn, params, x, y)``: two 3x3 convs (8 and 16 channels, the
  second strided) with biases and relu on ``(b, side, side, 1)`` inputs,
  with ``stacked`` two 16-channel convs in a ``lax.scan`` over a
  ``jax.checkpoint`` body, and a dense head to 10 classes."""
  dn = ("NHWC", "HWIO", "NHWC")
  conv = lambda h, k, s=1: jax.lax.conv_general_dilated(
    h, k, (s, s), "SAME", None, None, dn
  )

  def apply_fn(p, x):
    h = jax.nn.relu(conv(x, p["k0"]) + p["b0"])
    h = jax.nn.relu(conv(h, p["k1"], 2) + p["b1"])
    if "ks" in p:

      @jax.checkpoint
      def block(h, k):
        return jax.nn.relu(conv(h, k)), None

      h, _ = jax.lax.scan(block, h, p["ks"])
    return h.reshape(h.shape[0], -1) @ p["out"]

  key = jax.random.split(jax.random.key(0), 5)
  params = {
    "k0": fisher_testing.normal(key[0], (3, 3, 1, 8)) / 3,
    "b0": jnp.zeros(8),
    "k1": fisher_testing.normal(key[1], (3, 3, 8, 16)) / 8,
    "b1": jnp.zeros(16),
    "out": fisher_testing.normal(key[3], ((side // 2) ** 2 * 16, 10)) / 50,
  }
  if stacked:
    params["ks"] = fisher_testing.normal(key[2], (2, 3, 3, 16, 16)) / 12
  x = fisher_testing.normal(key[4], (b, side, side, 1))
  return apply_fn, params, x, jnp.arange(b) % 10


def _convs(program) -> int:
  """Convolutions in a compiled program's text, loop bodies included."""
  return program.as_text().count(" convolution(")


class FusedStatisticsTest(parameterized.TestCase):
  """``record(statistic=...)``: the scanned layers' statistic in the backward."""

  def setUp(self):
    super().setUp()
    model = _ScannedStack()
    self.x = fisher_testing.normal(jax.random.key(0), (64, 32, 16))
    self.params = model.init(jax.random.key(1), self.x)
    self.apply_fn = model.apply
    self.r = fisher_testing.normal(jax.random.key(2), (64, 8))

  def _temp(self, fn) -> int:
    compiled = jax.jit(fn).lower(self.params, self.x, self.r).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  @parameterized.parameters("diag", "kron", "gram", "low rank")
  def test_memory_stays_near_the_batch_gradients(self, structure):
    """The unfused tape keeps every stacked layer's (L, B, T, K) activations
    and cotangents and undoes remat; the fused one keeps the gradient's.
    ``low rank``: the Gram matrix, then the weighted sums of its top
    directions from a second pass recorded with ``statistic="combine"``."""

    def grad_fn(p, x, r):
      out, vjp = jax.vjp(lambda q: self.apply_fn(q, x), p)
      return vjp(r)[0]

    def stat_fn(p, x, r, statistic):
      if structure != "low rank":
        tape = _taps.record(self.apply_fn, p, x, statistic=statistic)
        grad, layers = tape.gradient(r)
        return grad, layers.statistics(structure)
      first = statistic and "gram"
      tape = _taps.record(self.apply_fn, p, x, statistic=first)
      grad, layers = tape.gradient(r)
      weights = jnp.linalg.eigh(layers.statistics("gram"))[1][:, -4:].T
      if statistic is not None:
        tape = _taps.record(
          self.apply_fn, p, x, statistic="combine", weights=weights
        )
        layers = tape.backward(r[None])
      return grad, layers.combine(weights)

    base = self._temp(grad_fn)
    fused = self._temp(functools.partial(stat_fn, statistic=structure))
    unfused = self._temp(functools.partial(stat_fn, statistic=None))
    # The weighted sums also hold one layer's weighted activations, k times
    # (bounded by a block budget, not by B).
    self.assertLess(fused, (1.5 if structure == "low rank" else 1.3) * base)
    self.assertLess(fused, 0.5 * unfused)

  @parameterized.parameters("diag", "kron")
  def test_several_samples_one_backward_pass_at_a_time(self, structure):
    """The diagonal, or the K-FAC sums with the norms' per-example
    gradients, of S cotangents pull them back one sample per pass by
    default (a scan): memory near one gradient's, not S of them."""
    num = 10
    cot = jnp.stack([self.r * (s + 1) for s in range(num)])

    def grad_fn(p, x, r):
      out, vjp = jax.vjp(lambda q: self.apply_fn(q, x), p)
      return vjp(r)[0]

    def stat_fn(p, x, r, chunk_size):
      del r
      tape = _taps.record(self.apply_fn, p, x, statistic=structure)
      grads = tape.backward(cot)
      if structure == "kron":
        return grads.kron_and_example_grads(chunk_size=chunk_size)
      return grads.statistics("diag", chunk_size=chunk_size)

    base = self._temp(grad_fn)
    one = self._temp(functools.partial(stat_fn, chunk_size=None))
    every = self._temp(functools.partial(stat_fn, chunk_size=num * 64))
    self.assertLess(one, 1.3 * base)
    self.assertLess(one, 0.5 * every)

  @parameterized.product(model=("scanned", "mlp"), structure=("diag", "kron"))
  def test_samples_per_pass_leave_the_statistics_unchanged(
    self, model, structure
  ):
    """One, three (the last pass padded) or all ten samples per backward
    pass; fused and unfused scanned layers (K-FAC sums per layer, the
    stacked norms' per-example gradients), and dense layers without weight
    sharing (their delta^2 is summed over samples before one matmul)."""
    b, num = 6, 10
    if model == "scanned":
      apply_fn, params, x = self.apply_fn, self.params, self.x[:b, :8]
      cot = fisher_testing.normal(jax.random.key(3), (num, b, 8))
      statistics = (structure, None)
    else:
      apply_fn = fisher_testing.mlp_apply
      params = fisher_testing.mlp_params(jax.random.key(3))
      x = fisher_testing.normal(jax.random.key(4), (b, fisher_testing.IN_DIM))
      cot = fisher_testing.normal(
        jax.random.key(5), (num, b, fisher_testing.OUT_DIM)
      )
      statistics = (None,)

    def stat(grads, chunk_size=None):
      if structure == "kron":
        return grads.kron_and_example_grads(chunk_size=chunk_size)
      return grads.statistics("diag", chunk_size=chunk_size)

    @jax.jit
    def run(params, x, cot):
      out = {}
      for statistic in statistics:
        tape = _taps.record(apply_fn, params, x, statistic=statistic)
        for per_pass in (1, 3, num):
          out[f"{statistic} {per_pass}"] = stat(
            tape.backward(cot), per_pass * b
          )
        # held cotangents (``take``) go through one pass
        out[f"{statistic} held"] = stat(tape.backward(cot).take(slice(None)))
      if structure == "kron":  # the public statistic, one sample per pass
        grads = _taps.record(apply_fn, params, x).backward(cot)
        out["statistics"] = (grads.statistics("kron"), grads.example_grads())
      return out

    out = run(params, x, cot)
    want = out["None held"]
    self.assertNotEmpty(jax.tree.leaves(want))
    if structure == "kron" and model == "scanned":
      self.assertNotEmpty(jax.tree.leaves(want[1]))  # the norms'
    for key, got in out.items():
      with self.subTest(key):
        _assert_same_statistic(self, got, want)

  def test_equal_to_the_unfused_statistics(self):
    x, r = self.x[:8, :8], self.r[:8]
    cot = jnp.stack([r, -2.0 * r, r**2])
    cases = (("diag", "expand"), ("kron", "expand"), ("kron", "reduce"))

    @jax.jit
    def run(params, x, cot):
      out = {}
      for structure, mode in cases:
        kw = dict(weight_sharing=mode)
        for statistic in (None, structure):
          tape = _taps.record(
            self.apply_fn, params, x, statistic=statistic, **kw
          )
          out[structure, mode, statistic or ""] = tape.backward(cot).statistics(
            structure, **kw
          )
      return out

    out = run(self.params, x, cot)
    for structure, mode in cases:
      with self.subTest(f"{structure} {mode}"):
        want = out[structure, mode, ""]
        _assert_same_statistic(self, out[structure, mode, structure], want)

  def test_fused_gram_and_combine_equal_the_unfused(self):
    """One sample: the Gram matrix formed in the backward pass, and the
    weighted sums formed in a second pass that carries the weights in."""
    x, r = self.x[:8, :8], self.r[:8]
    weights = fisher_testing.normal(jax.random.key(4), (3, 8))

    @jax.jit
    def run(params, x, r, weights):
      plain = _taps.record(self.apply_fn, params, x).backward(r[None])
      gram = _taps.record(self.apply_fn, params, x, statistic="gram")
      combine = _taps.record(
        self.apply_fn, params, x, statistic="combine", weights=weights
      )
      return (
        (plain.statistics("gram"), plain.combine(weights)),
        (
          gram.gradient(r)[1].statistics("gram"),
          combine.backward(r[None]).combine(weights),
        ),
      )

    want, got = run(self.params, x, r, weights)
    self.assertIsNotNone(
      _traced_tape(self.apply_fn, self.params, x, statistic="gram")._fusion
    )
    _assert_same_statistic(self, got, want)

  @parameterized.parameters(None, 3)
  def test_fused_conv_gram_and_combine(self, chunk_size):
    """Stacked conv kernels form their Gram matrix and weighted sums in the
    backward pass from per-example kernel gradients (in chunks of examples,
    a remainder chunk for 3 of 7), equal to the recorded layers'."""
    model = _ScannedConvs()
    x = fisher_testing.normal(jax.random.key(0), (7, 8, 8, 2))
    params = model.init(jax.random.key(1), x)
    r = fisher_testing.normal(jax.random.key(2), (7, 3))
    weights = fisher_testing.normal(jax.random.key(3), (2, 7))
    kw = dict(chunk_size=chunk_size)

    @jax.jit
    def run(params, x, r, weights):
      plain = _taps.record(model.apply, params, x).backward(r[None])
      gram = _taps.record(model.apply, params, x, statistic="gram", **kw)
      combine = _taps.record(
        model.apply, params, x, statistic="combine", weights=weights, **kw
      )
      return (
        (plain.statistics("gram"), plain.combine(weights)),
        (
          gram.gradient(r)[1].statistics("gram", chunk_size=chunk_size),
          combine.backward(r[None]).combine(weights),
        ),
      )

    want, got = run(params, x, r, weights)
    tape = _traced_tape(model.apply, params, x, statistic="gram")
    assert tape._fusion is not None
    kernels = [
      i
      for i, (path, _) in enumerate(
        jax.tree_util.tree_flatten_with_path(params)[0]
      )
      if "ScanCheckpoint" in jax.tree_util.keystr(path)
      and "kernel" in jax.tree_util.keystr(path)
    ]
    self.assertLen(kernels, 1)
    self.assertIn(kernels[0], tape._fusion.leaves)
    _assert_same_statistic(self, got, want)

  @parameterized.parameters(None, 3)
  def test_ordered_gram_keeps_per_example_gradients(self, chunk_size):
    """With ``ordered=True`` the one backward pass forms the per-example
    gradients of convs (stacked or not) and biases that are smaller than
    their recorded input and cotangent: one tape then gives the Gram
    matrix, the weighted sums and the gradient (the kernels' cotangents are
    those gradients' sums), equal to the recorded layers'."""
    model = _ScannedConvs()
    x = fisher_testing.normal(jax.random.key(0), (7, 16, 16, 2))
    params = model.init(jax.random.key(1), x)
    r = fisher_testing.normal(jax.random.key(2), (7, 3))
    weights = fisher_testing.normal(jax.random.key(3), (2, 7))
    kw = dict(statistic="gram", ordered=True, chunk_size=chunk_size)

    @jax.jit
    def run(params, x, r, weights):
      plain = _taps.record(model.apply, params, x)
      grad, lg = _taps.record(model.apply, params, x, **kw).gradient(r)
      stats = (
        lg.statistics("gram", chunk_size=chunk_size),
        lg.combine(weights),
      )
      want = plain.backward(r[None])
      return (
        (want.statistics("gram"), want.combine(weights), plain.gradient(r)[0]),
        (*stats, grad),
      )

    want, got = run(params, x, r, weights)
    tape = _traced_tape(model.apply, params, x, **kw)
    assert tape._fusion is not None
    self.assertFalse(tape.fused)  # one pass serves Gram and combine
    names = [
      jax.tree_util.keystr(path)
      for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    ]
    grads = {names[i] for i in tape._fusion.grads}
    # Every conv leaf, stacked or not; the dense head keeps (a, delta).
    self.assertEqual(grads, {n for n in names if "Dense" not in n})
    _assert_same_statistic(self, got, want)

  def test_reversed_nested_and_rematerialised_scans(self):
    """A reversed scan over a remat body with a nested scan (a leaf sliced
    twice), next to a scan-shared cell and a kernel used twice (both
    recorded as usual): fused and recorded statistics agree."""
    with jax.enable_x64(True):
      apply_fn, params, x, out_dim = _model("plain_scan", jnp.float64)
      cot = _cotangents(out_dim)

      @functools.partial(jax.jit, static_argnums=(3, 4))
      def stats(params, x, cot, structure, fused):
        return fisher_testing.layer_statistics(
          apply_fn, params, x, cot, structure=structure, fused=fused
        )[0]

      for structure in ("diag", "kron", "gram"):
        # The Gram matrix fuses for one sample per backward pass.
        c = cot[:1] if structure == "gram" else cot
        want = stats(params, x, c, structure, False)
        got = stats(params, x, c, structure, True)
        tape = _traced_tape(apply_fn, params, x, statistic=structure)
        # k (used twice), cell (scan-shared) and table (tied) are recorded,
        # and so is b: it is the bias of k's first product, whose (a, delta)
        # k needs anyway.
        assert tape._fusion is not None
        fused = {sorted(params)[i] for i in tape._fusion.leaves}
        self.assertEqual(fused, {"s", "sub"})
        chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-12)

  def test_per_head_kernels_stacked_along_a_scan(self):
    """A per-head kernel stacked along a scan forms its diagonal, K-FAC
    Gamma (A in the forward pass), Gram matrix and weighted sums inside the
    backward pass, equal to the recorded ones; the per-head kernel that the
    iterations share is recorded, and so are the leaves outside the scan,
    except for the Gram matrix and the weighted sums (which run two passes
    anyway)."""
    with jax.enable_x64(True):
      apply_fn, params, x, out_dim = _model("plain_heads_seq", jnp.float64)
      cot = _cotangents(out_dim)
      weights = fisher_testing.normal(jax.random.key(5), (2, B))

      @functools.partial(jax.jit, static_argnums=(3, 4))
      def stats(params, x, cot, structure, fused):
        if structure == "combine":
          tape = _taps.record(
            apply_fn,
            params,
            x,
            statistic="combine" if fused else None,
            weights=weights if fused else None,
          )
          return tape.backward(cot[:1]).combine(weights)
        return fisher_testing.layer_statistics(
          apply_fn, params, x, cot, structure=structure, fused=fused
        )[0]

      for structure in ("diag", "kron", "gram", "combine"):
        # The Gram matrix fuses for one sample per backward pass.
        c = cot[:1] if structure == "gram" else cot
        with self.subTest(structure):
          tape = _traced_tape(
            apply_fn,
            params,
            x,
            statistic=structure,
            weights=weights if structure == "combine" else None,
          )
          assert tape._fusion is not None
          fused = {sorted(params)[i] for i in tape._fusion.leaves}
          two_passes = structure in ("gram", "combine")
          outside = {"k", "k2", "v", "w"} if two_passes else set()
          self.assertEqual(fused, {"stack"} | outside)
          got = stats(params, x, c, structure, True)
          want = stats(params, x, c, structure, False)
          chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-12)

  @parameterized.parameters("empirical", "exact")
  def test_fused_layers_of_a_scan_without_remat_hold_no_copies(self, kind):
    """Without ``remat`` the scan keeps its layers' inputs for the backward
    pass, and a fused tap reads those same arrays (of a dense and a
    per-head kernel stacked along the scan): the diagonal holds no stacked
    copy of them, so its memory stays near the gradient's. (A tap that read
    them through ``stop_gradient`` made the scan keep a second stack.)"""
    b, h, t, k, layers = 64, 4, 16, 16, 3

    def apply_fn(p, x):
      def layer(z, ws):
        z = z + jnp.tanh(jnp.einsum("bhtk,hko->bhto", z, ws["heads"]))
        return z + jnp.tanh(z @ ws["dense"]), None

      z, _ = jax.lax.scan(layer, x, p["stack"])
      return jnp.mean(z, axis=(1, 2)) @ p["w"]

    key = jax.random.split(jax.random.key(0), 5)
    params = {
      "stack": {
        "heads": fisher_testing.normal(key[0], (layers, h, k, k)) / 4,
        "dense": fisher_testing.normal(key[1], (layers, k, k)) / 4,
      },
      "w": fisher_testing.normal(key[2], (k, 3)),
    }
    x = fisher_testing.normal(key[3], (b, h, t, k))
    y = jax.random.randint(key[4], (b,), 0, 3)

    def grad_fn(p, x, y):
      del y
      loss = lambda q: jnp.mean(jax.nn.logsumexp(apply_fn(q, x), axis=-1))
      return jax.grad(loss)(p)

    def diag_fn(p, x, y):
      return fisher.diagonal(
        apply_fn, p, (x, y), likelihood=fisher.Categorical(), kind=kind
      )

    def temp(fn):
      compiled = jax.jit(fn).lower(params, x, y).compile()
      return compiled.memory_analysis().temp_size_in_bytes

    tape = _traced_tape(apply_fn, params, x, statistic="diag")
    assert tape._fusion is not None
    self.assertLen(tape._fusion.leaves, 2)
    # A stacked copy of both kernels' inputs would add 2 * layers of them.
    one_layer = b * h * t * k * 4
    self.assertLess(temp(diag_fn), temp(grad_fn) + 2 * layers * one_layer)

  def test_empirical_diagonal_frees_each_layer_input_before_the_next(self):
    """The empirical diagonal's one backward pass forms an unscanned
    layer's statistic and its parameter's cotangent before the cotangent of
    its input, as the gradient alone does: the layer's input is freed
    first, so beyond the gradient's memory it holds the statistics' chunk
    budget (made small here), not another activation (XLA:CPU held one
    when left to order the statistic itself)."""
    b, d = 2048, 128

    def apply_fn(p, x):
      h = x
      for i in range(3):
        h = jax.nn.relu(h @ p[f"w{i}"] + p[f"b{i}"])
      return h @ p["out"]

    key = jax.random.split(jax.random.key(0), 6)
    params = {
      f"w{i}": fisher_testing.normal(key[i], (d, d)) / 12 for i in range(3)
    }
    params.update({f"b{i}": jnp.zeros(d) for i in range(3)})
    params["out"] = fisher_testing.normal(key[4], (d, 10)) / 12
    x = fisher_testing.normal(key[5], (b, d))
    y = jnp.zeros((b,), jnp.int32)

    grad_fn, diag_fn = _gradient_and_diagonal(apply_fn)

    def temp(fn):
      compiled = jax.jit(fn).lower(params, x, y).compile()
      return compiled.memory_analysis().temp_size_in_bytes

    with mock.patch.object(_taps, "_PATCH_CHUNK_ELEMENTS", 4096):
      extra = temp(diag_fn) - temp(grad_fn)
    self.assertLess(extra, b * d * 4 / 2)  # half an activation
    got, want = jax.jit(
      lambda p, x, y: (
        diag_fn(p, x, y).diag,
        diag_fn(p, x, y, "per_example").diag,
      )
    )(params, x, y)
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-9)

  def test_empirical_diagonal_of_convs_holds_no_more_than_the_gradient(self):
    """A conv kernel's cotangent is the sum of the per-example gradients
    its diagonal forms (stacked along a scan too: there XLA:CPU's
    kernel-gradient convolution made the gradient alone about 4x slower
    than the estimator with these sums): the backward pass runs no
    kernel-gradient convolution, whose operand XLA:CPU copied to another
    layout in the forward pass while the statistic held the input as
    recorded. With a scan after the convs (where the peak falls in the
    forward pass) that copy had cost a whole activation beyond the
    gradient's memory."""
    b, side = 512, 28
    apply_fn, params, x, y = _conv_classifier(b, side, stacked=True)
    grad_fn, diag_fn = _gradient_and_diagonal(apply_fn)

    def compiled(fn):
      return jax.jit(fn).lower(params, x, y).compile()

    with mock.patch.object(_taps, "_PATCH_CHUNK_ELEMENTS", 4096):
      diag_program = compiled(diag_fn)
    grad_program = compiled(grad_fn)
    # No gradient convolution for either unscanned kernel, nor for the
    # stacked one in the scan's backward iterations.
    self.assertEqual(_convs(diag_program), _convs(grad_program) - 3)
    diag = diag_program.memory_analysis().temp_size_in_bytes
    grad = grad_program.memory_analysis().temp_size_in_bytes
    activation = b * side * side * 8 * 4  # the first conv's output
    self.assertLess(diag - grad, activation / 4)
    x, y = x[:16], y[:16]  # the values, on fewer examples

    @jax.jit
    def values(params, x, y):
      with mock.patch.object(_taps, "_PATCH_CHUNK_ELEMENTS", 4096):
        got = diag_fn(params, x, y)
      return got, diag_fn(params, x, y, "per_example"), grad_fn(params, x, y)

    got, want, grad_sum = values(params, x, y)
    for a, w in zip(jax.tree.leaves(got.diag), jax.tree.leaves(want.diag)):
      np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-9)
    for a, w in zip(jax.tree.leaves(got.mean_grad), jax.tree.leaves(grad_sum)):
      np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-7)

  @parameterized.parameters("mc", "exact")
  def test_stacked_conv_kernel_cotangents_from_patches(self, kind):
    """On XLA:CPU every backward pass through a tape gives a conv kernel
    stacked along a scan its cotangent summed from input patches and output
    cotangents: the estimators' gradient pass (here the MC and exact kinds,
    which record without ``ordered``) runs no kernel-gradient convolution
    in the scan, and its gradient equals ``jax.grad``'s."""
    apply_fn, params, x, y = _conv_classifier(16, 12, stacked=True)
    grad_fn, _ = _gradient_and_diagonal(apply_fn)

    def diag_fn(p, x, y):
      return fisher.diagonal(
        apply_fn,
        p,
        (x, y),
        likelihood=fisher.Categorical(),
        kind=kind,
        key=jax.random.key(0),
      )

    def compiled(fn):
      return jax.jit(fn).lower(params, x, y).compile()

    program = compiled(diag_fn)
    with mock.patch.object(_taps, "_bind_loop_conv", _taps._bind):
      plain = compiled(lambda p, x, y: diag_fn(p, x, y))
    # The stacked kernel's gradient convolution is gone from the loop (the
    # statistic's passes need no kernel cotangents: XLA drops those).
    self.assertEqual(_convs(program), _convs(plain) - 1)
    got, want = program(params, x, y), compiled(grad_fn)(params, x, y)
    for a, w in zip(jax.tree.leaves(got.mean_grad), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-7)

  def test_empirical_low_rank_of_convs_holds_no_more_than_the_gradient(self):
    """The empirical low rank keeps an unscanned conv's per-example
    gradients (formed in the backward pass, smaller than the layer's input
    and output cotangent) in place of both, and takes the kernel's
    cotangent as their sum: no kernel-gradient convolution, and beyond the
    gradient's memory less than half the first conv's output (it held
    nearly two of them with every layer recorded)."""
    b, side = 512, 28
    apply_fn, params, x, y = _conv_classifier(b, side, stacked=False)
    grad_fn, _ = _gradient_and_diagonal(apply_fn)

    def low_rank(p, x, y, method="auto"):
      return fisher.low_rank(
        apply_fn,
        p,
        (x, y),
        likelihood=fisher.Categorical(),
        kind="empirical",
        rank=4,
        method=method,
      )

    def compiled(fn):
      return jax.jit(fn).lower(params, x, y).compile()

    lr_program, grad_program = compiled(low_rank), compiled(grad_fn)
    self.assertEqual(_convs(lr_program), _convs(grad_program) - 2)
    extra = (
      lr_program.memory_analysis().temp_size_in_bytes
      - grad_program.memory_analysis().temp_size_in_bytes
    )
    self.assertLess(extra, b * side * side * 8 * 4 / 2)
    x, y = x[:16], y[:16]  # the values, on fewer examples
    got, want = jax.jit(
      lambda p, x, y: (low_rank(p, x, y), low_rank(p, x, y, "per_example"))
    )(params, x, y)
    np.testing.assert_allclose(got.eigvals, want.eigvals, rtol=1e-4)
    for a, w in zip(
      jax.tree.leaves(got.eigvecs), jax.tree.leaves(want.eigvecs)
    ):
      sign = jnp.sign(
        jnp.sum(a * w, axis=tuple(range(1, a.ndim)), keepdims=True)
      )
      np.testing.assert_allclose(a, sign * w, atol=2e-4)

  def test_empirical_diagonal_of_attention_holds_no_more_than_the_gradient(
    self,
  ):
    """Flax's attention merges its heads, a transposed value, before the
    output projection: the diagonal's loop over examples reads that input as
    the projection's matmul does, so XLA:CPU keeps one row-major copy of it
    (it had made a second for the loop, held to the backward pass)."""
    b, t, d = 64, 32, 128

    class Block(nn.Module):
      @nn.compact
      def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=4)(h, h)
        x = x + nn.Dense(d)(jax.nn.gelu(nn.Dense(2 * d)(nn.LayerNorm()(x))))
        return nn.Dense(10)(jnp.mean(x, axis=1))

    model = Block()
    x = fisher_testing.normal(jax.random.key(0), (b, t, d))
    y = jnp.arange(b) % 10
    params = model.init(jax.random.key(1), x[:1])

    grad_fn, diag_fn = _gradient_and_diagonal(model.apply)

    def temp(fn):
      compiled = jax.jit(fn).lower(params, x, y).compile()
      return compiled.memory_analysis().temp_size_in_bytes

    # (Its values against the per-example path: the zoo's attention LMs.)
    self.assertLess(temp(diag_fn) - temp(grad_fn), b * t * d * 4 / 2)

  def test_fused_kron_forms_a_in_the_forward_pass(self):
    """Under ``statistic="kron"`` a stacked kernel's ``A_sum`` is formed
    once, in the forward pass (recorded per layer), and a backward pass
    returns its ``Gamma_sum`` alone: a loop of backward passes (several
    samples, the exact kind) does not form ``A`` again."""
    apply_fn, params, x, out_dim = _model("plain_scan", jnp.float32)
    leaf = sorted(params).index("sub")  # (2, 3, 4, 4): nested scans

    def shapes(params, x, cot):
      tape = _taps.record(apply_fn, params, x, statistic="kron")
      assert tape._fusion is not None
      site = tape._fusion.leaves[leaf][0]
      grads = tape.backward(cot)
      return tape._acts[site][leaf], grads._deltas[site][leaf]

    cot = _cotangents(out_dim, 3, jnp.float32)
    a_sum, per_pass = jax.eval_shape(shapes, params, x, cot)
    self.assertEqual(a_sum.shape, (2, 3, 4, 4))
    self.assertEqual(per_pass.shape, (3, 2, 3, 4, 4))  # (S, *L, O, O)

  def test_other_statistics_raise(self):
    def check(params, x, r):  # traced only: the errors come at trace time
      tape = _taps.record(self.apply_fn, params, x, statistic="kron")
      layers = tape.backward(r[None])
      for structure, kw in (
        ("gram", {}),
        ("diag", {}),
        ("kron", dict(weight_sharing="reduce")),
      ):
        with self.assertRaisesRegex(ValueError, "statistic='kron'"):
          layers.statistics(structure, **kw)
      with self.assertRaisesRegex(ValueError, "combine needs"):
        layers.combine(jnp.ones((1, 64)))
      with self.assertRaisesRegex(ValueError, "statistic must be"):
        _taps.record(self.apply_fn, params, x, statistic="low_rank")
      gram = _taps.record(self.apply_fn, params, x, statistic="gram")
      with self.assertRaisesRegex(ValueError, "one sample"):
        gram.backward(jnp.stack([r, r]))
      weights = jnp.ones((2, 64))
      with self.assertRaisesRegex(ValueError, "exactly with"):
        _taps.record(self.apply_fn, params, x, statistic="combine")
      with self.assertRaisesRegex(ValueError, "exactly with"):
        _taps.record(self.apply_fn, params, x, weights=weights)
      with self.assertRaisesRegex(ValueError, r"\(k, B\) = \(k, 64\)"):
        _taps.record(
          self.apply_fn, params, x, statistic="combine", weights=weights.T
        )
      combine = _taps.record(
        self.apply_fn, params, x, statistic="combine", weights=weights
      )
      with self.assertRaisesRegex(ValueError, "same array"):
        combine.backward(r[None]).combine(jnp.zeros((2, 64)))
      with self.assertRaisesRegex(ValueError, "statistic='combine'"):
        combine.backward(r[None]).statistics("gram")
      return 0.0

    jax.eval_shape(check, self.params, self.x, self.r)

  def test_without_stacked_leaves_records_as_usual(self):
    tape = _traced_tape(
      fisher_testing.mlp_apply,
      fisher_testing.mlp_params(jax.random.key(0)),
      jnp.ones((B, 4)),
      statistic="diag",
    )
    self.assertIsNone(tape._fusion)


class KernelViewGradientTest(parameterized.TestCase):
  """``mean_grad`` where a kernel reaches its layer as a view of its leaf.

  The layer path takes a shared kernel's cotangent from its per-example
  gradients' sum, in the leaf's layout and times the view's constant; used
  as the view's cotangent, a transposed kernel got its gradient reshaped
  (relative error 1.6) and a scaled one the constant twice. (Every leaf is
  used: a fallback warning is given once per process and leaf names.)
  """

  @parameterized.named_parameters(
    (
      "transposed",
      lambda p, x: jnp.tanh(x @ p["view_w"]) @ p["view_u"].T,
      {"view_w": (3, 5), "view_u": (2, 5)},
    ),
    (
      "scaled",
      lambda p, x: jnp.tanh(x @ p["view_w"]) @ (p["view_u"] * 0.5),
      {"view_w": (3, 5), "view_u": (5, 2)},
    ),
    (
      "conv_scaled",
      lambda p, x: (
        jnp.tanh(
          jax.lax.conv_general_dilated(
            x,
            p["view_k"] * 0.5,
            (1,),
            "SAME",
            dimension_numbers=("NWC", "WIO", "NWC"),
          )
        )
        @ p["view_u"]
      ),
      {"view_k": (3, 3, 4), "view_u": (4, 2)},
    ),
  )
  def test_mean_grad_is_the_gradient(self, apply_fn, shapes):
    keys = jax.random.split(jax.random.key(0), 2 + len(shapes))
    x = jax.random.normal(keys[0], (3, 4, 3))
    y = jax.random.randint(keys[1], (3, 4), 0, 2)
    params = {
      name: jax.random.normal(k, shape)
      for k, (name, shape) in zip(keys[2:], sorted(shapes.items()))
    }
    lik = fisher.Categorical()
    want = jax.grad(lambda p: jnp.mean(jax.vmap(lik.nll)(apply_fn(p, x), y)))(
      params
    )
    for name in ("diagonal", "low_rank"):
      kw = {"rank": 2} if name == "low_rank" else {}
      with warnings.catch_warnings():
        warnings.simplefilter("error", fisher.FisherFallbackWarning)
        got = getattr(fisher, name)(
          apply_fn, params, (x, y), likelihood=lik, kind="empirical", **kw
        ).mean_grad
      chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
  absltest.main()
