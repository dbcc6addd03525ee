# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Estimator tests: every statistic against its dense ``jax.jacobian`` oracle."""

from __future__ import annotations

import functools
import re
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np

from fisher_optax import fisher
from fisher_optax.fisher import _taps
from tests import fisher_testing as ft

LIKELIHOODS = {
  "categorical": fisher.Categorical,
  "gaussian": lambda: fisher.Gaussian(ft.SIGMA),
  "bernoulli": fisher.Bernoulli,
  "heteroscedastic": fisher.HeteroscedasticGaussian,
}
N = 7  # Not a multiple of the chunk sizes below: remainders are exercised.


def _setup(family, n=N, seed=0):
  # float64 under jax.enable_x64, float32 (without a truncation warning)
  # outside it.
  dtype = jax.dtypes.canonicalize_dtype(jnp.float64)
  params = ft.mlp_params(jax.random.key(seed), dtype=dtype)
  x, y = ft.make_batch(jax.random.key(seed + 1), n, family)
  return ft.apply_for(family), params, x, y


def _scaled_mlp(params, x):
  """An MLP with an element-wise parameter the layer path does not cover."""
  h = jnp.tanh(x @ params["dense_0"]["kernel"] + params["dense_0"]["bias"])
  h = jnp.minimum(h, params["scale"])  # a learned clip: no layer rule
  return h @ params["dense_1"]["kernel"] + params["dense_1"]["bias"]


def _est(fn, apply_fn, params, batch, /, **kwargs):
  """Runs an estimator under jit: one compile instead of many eager ops."""
  return jax.jit(functools.partial(fn, apply_fn, **kwargs))(params, batch)


def _est_many(apply_fn, params, batch, calls, oracles=None):
  """Runs several estimators (and dense oracles) in ONE jit compile.

  ``calls`` maps a name to ``(estimator, kwargs)``; ``oracles`` maps a name
  to a function ``(params, batch) -> array``. Returns a dict of results.
  """
  oracles = oracles or {}

  @jax.jit
  def run(params, batch):  # A list: the names need not be sortable.
    return [fn(apply_fn, params, batch, **kw) for fn, kw in calls.values()] + [
      f(params, batch) for f in oracles.values()
    ]

  return dict(zip([*calls, *oracles], run(params, batch)))


def _mlp_ignoring_empty(params, x):
  """The MLP of ``params`` without its (zero-size, unused) ``"empty"`` leaf."""
  return ft.mlp_apply({k: v for k, v in params.items() if k != "empty"}, x)


def _stack_flat(stacked, k):
  return jnp.stack(
    [ft.ravel(jax.tree.map(lambda a, j=j: a[j], stacked)) for j in range(k)]
  )


class DiagonalTest(parameterized.TestCase):
  @parameterized.parameters(*ft.FAMILIES)
  def test_matches_dense_oracle(self, family):
    """Every kind and path of one family: one compile, oracles included."""
    kinds = ("empirical", "exact", "batch_squared")
    methods = ("auto", "per_example")
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup(family)
      lik = LIKELIHOODS[family]()
      calls = {
        (kind, method): (
          fisher.diagonal,
          dict(likelihood=lik, kind=kind, method=method, chunk_size=3),
        )
        for kind in kinds
        for method in methods
      }
      oracles = {
        kind: functools.partial(
          lambda p, b, kind: ft.dense_fisher(
            apply_fn, p, b[0], b[1], family=family, kind=kind
          ),
          kind=kind,
        )
        for kind in kinds
      }
      oracles["mean_grad"] = lambda p, b: ft.mean_grad_dense(
        apply_fn, p, b[0], b[1], family
      )
      out = _est_many(apply_fn, params, (x, y), calls, oracles)
      for kind in kinds:
        for method in methods:
          with self.subTest(kind=kind, method=method):
            stat = out[(kind, method)]
            chex.assert_trees_all_close(
              stat.diag,
              ft.unravel_like(params, jnp.diag(out[kind])),
              rtol=1e-10,
              atol=1e-12,
            )
            chex.assert_trees_all_close(
              stat.mean_grad, out["mean_grad"], rtol=1e-10, atol=1e-12
            )
            self.assertEqual(int(stat.count), N)
            self.assertEqual(stat.kind, kind)

  @parameterized.parameters(*ft.FAMILIES)
  def test_mc_matches_oracle_on_the_same_labels(self, family):
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup(family)
      lik = LIKELIHOODS[family]()
      key = jax.random.key(7)

      def oracle(p, b):
        # Example n draws its labels with fold_in(key, n).
        out = apply_fn(p, b[0])

        def draw(n, o):
          return lik.sample(jax.random.fold_in(key, n), o[None], 3)[:, 0]

        labels = jax.vmap(draw, out_axes=1)(jnp.arange(len(out)), out)
        return ft.dense_fisher(
          apply_fn, p, b[0], labels, family=family, kind="empirical_samples"
        )

      out = _est_many(
        apply_fn,
        params,
        (x, y),
        {
          "mc": (
            fisher.diagonal,
            dict(likelihood=lik, kind="mc", num_samples=3, key=key),
          )
        },
        {"dense": oracle},
      )
      chex.assert_trees_all_close(
        out["mc"].diag,
        ft.unravel_like(params, jnp.diag(out["dense"])),
        rtol=1e-10,
        atol=1e-12,
      )

  # Every family: a sampler that ignores sigma (Gaussian) or draws from
  # 1 - p (Bernoulli) converges, but to the wrong Fisher.
  @parameterized.parameters(*ft.FAMILIES)
  def test_mc_converges_to_exact(self, family):
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup(family)
      lik = LIKELIHOODS[family]()
      calls = {"exact": (fisher.diagonal, dict(likelihood=lik, kind="exact"))}
      for k in (2, 4096):
        calls[k] = (
          fisher.diagonal,
          dict(likelihood=lik, kind="mc", num_samples=k, key=jax.random.key(3)),
        )
      out = _est_many(apply_fn, params, (x, y), calls)
      exact = ft.ravel(out["exact"].diag)

      def rel_err(k):
        return float(
          jnp.linalg.norm(ft.ravel(out[k].diag) - exact)
          / jnp.linalg.norm(exact)
        )

      few, many = rel_err(2), rel_err(4096)
      # The MC error shrinks like 1/sqrt(k): ~45x from 2 to 4096 samples.
      self.assertLess(many, 0.06)
      self.assertLess(many, few / 5)

  def test_auto_with_uncovered_leaf_equals_per_example(self):
    with jax.enable_x64(True):
      _, params, x, y = _setup("categorical")
      params = dict(params, scale=jnp.linspace(0.5, 1.5, 5))
      kw = dict(
        likelihood=fisher.Categorical(),
        kind="mc",
        num_samples=2,
        key=jax.random.key(0),
      )
      out = _est_many(
        _scaled_mlp,
        params,
        (x, y),
        {
          "auto": (fisher.diagonal, kw),
          "slow": (
            fisher.diagonal,
            dict(kw, method="per_example", chunk_size=2),
          ),
          # The uncovered leaf's Gram adds to the layers' (one sample per
          # example, so the fused low-rank path).
          "low": (fisher.low_rank, dict(kw, num_samples=1, rank=3)),
          "low_slow": (
            fisher.low_rank,
            dict(kw, num_samples=1, rank=3, method="per_example"),
          ),
        },
      )
      chex.assert_trees_all_close(
        out["auto"], out["slow"], rtol=1e-10, atol=1e-14
      )
      np.testing.assert_allclose(
        out["low"].eigvals, out["low_slow"].eigvals, rtol=1e-9
      )
      v = jax.tree.map(jnp.ones_like, params)
      chex.assert_trees_all_close(
        out["low"].matvec(v), out["low_slow"].matvec(v), rtol=1e-8, atol=1e-12
      )
      with self.assertRaisesRegex(ValueError, r"\['scale'\]"):
        _est(fisher.diagonal, _scaled_mlp, params, (x, y), method="taps", **kw)

  def test_bare_loss_is_empirical_only(self):
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup("categorical")

      def ce(out, t):
        return -jax.nn.log_softmax(out)[t]

      out = _est_many(
        apply_fn,
        params,
        (x, y),
        {
          "stat": (fisher.diagonal, dict(likelihood=ce, kind="empirical")),
          "ref": (
            fisher.diagonal,
            dict(likelihood=fisher.Categorical(), kind="empirical"),
          ),
        },
      )
      chex.assert_trees_all_close(out["stat"], out["ref"], rtol=1e-10)
      for kind in ("exact", "mc"):
        with self.assertRaisesRegex(ValueError, "probabilistic likelihood"):
          _est(
            fisher.diagonal,
            apply_fn,
            params,
            (x, y),
            likelihood=ce,
            kind=kind,
            key=jax.random.key(0),
          )

  def test_targets_none_for_exact(self):
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup("categorical")
      stat = _est(
        fisher.diagonal,
        apply_fn,
        params,
        (x, None),
        likelihood=fisher.Categorical(),
        kind="exact",
      )
      self.assertIsNone(stat.mean_grad)
      with self.assertRaisesRegex(ValueError, "needs targets"):
        _est(
          fisher.diagonal,
          apply_fn,
          params,
          (x, None),
          likelihood=fisher.Categorical(),
          kind="empirical",
        )

  def test_bf16_params(self):
    apply_fn, _, x, y = _setup("categorical")
    params = ft.mlp_params(jax.random.key(0), dtype=jnp.float32)
    x = x.astype(jnp.float32)
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    methods = ("auto", "per_example")

    @jax.jit
    def run(params, p16, x, y):  # One compile: the f32 ref and both paths.
      est = functools.partial(
        fisher.diagonal, apply_fn, likelihood=fisher.Categorical(), kind="exact"
      )
      return est(params, (x, y)), {
        m: est(p16, (x.astype(jnp.bfloat16), y), method=m) for m in methods
      }

    ref, stats = run(params, p16, x, y)
    for method in methods:
      stat = stats[method]
      chex.assert_trees_all_equal_dtypes(
        stat.diag, jax.tree.map(lambda a: a.astype(jnp.float32), params)
      )
      chex.assert_tree_all_finite(stat.diag)
      chex.assert_trees_all_close(stat.diag, ref.diag, rtol=0.1, atol=2e-3)

  def test_no_retrace_on_second_call(self):
    apply_fn, _, x, y = _setup("categorical")
    params = ft.mlp_params(jax.random.key(0))
    x = x.astype(jnp.float32)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def estimate(params, batch, key):
      return _est(
        fisher.diagonal,
        apply_fn,
        params,
        batch,
        likelihood=fisher.Categorical(),
        kind="mc",
        key=key,
        chunk_size=3,
      )

    estimate(params, (x, y), jax.random.key(0))
    estimate(
      jax.tree.map(lambda a: a + 1, params), (x + 1, y), jax.random.key(1)
    )

  def test_non_finite_example_is_not_averaged_away(self):
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup("categorical")
      x = x.at[2, 0].set(jnp.nan)
      kw = dict(likelihood=fisher.Categorical(), kind="empirical")
      calls = {
        m: (fisher.diagonal, dict(kw, method=m))
        for m in ("auto", "per_example")
      }
      calls["low_rank"] = (fisher.low_rank, dict(kw, rank=2))
      out = _est_many(apply_fn, params, (x, y), calls)
      for method in ("auto", "per_example"):
        stat = out[method]
        self.assertFalse(bool(stat.is_finite()))
        self.assertEqual(int(stat.count), N)
      self.assertFalse(bool(out["low_rank"].is_finite()))

  def test_flax_linen_and_nnx_apply_fns(self):
    from flax import linen as nn  # pylint: disable=g-import-not-at-top
    from flax import nnx  # pylint: disable=g-import-not-at-top

    class Linen(nn.Module):
      @nn.compact
      def __call__(self, ids):
        h = nn.Embed(6, 4)(ids).reshape(ids.shape[0], -1)
        return nn.Dense(3)(jnp.tanh(nn.Dense(5)(h)))

    class Nnx(nnx.Module):
      def __init__(self, rngs):
        self.embed = nnx.Embed(6, 4, rngs=rngs)
        self.hidden = nnx.Linear(8, 5, rngs=rngs)
        self.out = nnx.Linear(5, 3, rngs=rngs)

      def __call__(self, ids):
        h = self.embed(ids).reshape(ids.shape[0], -1)
        return self.out(jnp.tanh(self.hidden(h)))

    ids = jax.random.randint(jax.random.key(0), (N, 2), 0, 6)
    y = jax.random.randint(jax.random.key(1), (N,), 0, 3)
    linen = Linen()
    graphdef, state = nnx.split(Nnx(nnx.Rngs(0)))
    models = {
      "linen": (linen.apply, jax.jit(linen.init)(jax.random.key(2), ids)),
      "nnx": (lambda s, x: nnx.merge(graphdef, s)(x), state),
    }
    for name, (apply_fn, params) in models.items():
      with self.subTest(name):
        kw = dict(likelihood=fisher.Categorical(), kind="exact")
        out = _est_many(
          apply_fn,
          params,
          (ids, y),
          {
            "fast": (fisher.diagonal, dict(kw, method="taps")),
            "slow": (fisher.diagonal, dict(kw, method="per_example")),
          },
        )
        chex.assert_trees_all_close(
          out["fast"], out["slow"], rtol=1e-5, atol=1e-7
        )


class LowRankTest(parameterized.TestCase):
  def test_large_batches_take_lobpcg(self):
    """With 1100 float32 pseudo-gradients the Gram matrix's top eigenpairs
    come from LOBPCG (not an O(M^3) eigh), on both paths: the eigenvalues
    and the projected Fisher match the dense float64 Fisher's."""
    from jax.experimental.sparse import linalg as sparse_linalg  # noqa: PLC0415

    apply_fn, params, x, y = _setup("categorical", n=1100)
    calls = []
    lobpcg = sparse_linalg.lobpcg_standard

    def spy(*args, **kwargs):
      calls.append(args[1].shape)
      return lobpcg(*args, **kwargs)

    kw = dict(likelihood=fisher.Categorical(), kind="empirical", rank=4)
    with mock.patch.object(sparse_linalg, "lobpcg_standard", spy):
      stats = [
        _est(fisher.low_rank, apply_fn, params, (x, y), method=m, **kw)
        for m in ("auto", "per_example")
      ]
    self.assertEqual(calls, [(1100, 12)] * 2)  # rank 4 + 8 more
    with jax.enable_x64(True):
      p64 = jax.tree.map(lambda a: a.astype(jnp.float64), params)
      dense = ft.dense_fisher(
        apply_fn,
        p64,
        x.astype(jnp.float64),
        y,
        family="categorical",
        kind="empirical",
      )
      vals, vecs = ft.top_eig(dense, 4)
    vals, vecs = np.asarray(vals), np.asarray(vecs)
    for stat in stats:
      np.testing.assert_allclose(stat.eigvals, vals, rtol=1e-5)
      flat = np.stack(
        [
          np.concatenate(
            [np.ravel(l[j]) for l in jax.tree.leaves(stat.eigvecs)]
          )
          for j in range(4)
        ]
      )
      # The same projector onto the top-4 subspace.
      np.testing.assert_allclose(flat.T @ flat, vecs.T @ vecs, atol=1e-4)

  @parameterized.parameters("categorical", "heteroscedastic")
  def test_matches_dense_eigenpairs(self, family):
    """Every kind and path of one family: one compile, oracles included."""
    kinds = ("empirical", "exact", "batch_squared")
    methods = ("auto", "per_example")
    ranks = {kind: 1 if kind == "batch_squared" else 3 for kind in kinds}
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup(family)
      lik = LIKELIHOODS[family]()
      calls = {
        (kind, method): (
          fisher.low_rank,
          dict(
            likelihood=lik,
            kind=kind,
            rank=ranks[kind],
            method=method,
            chunk_size=3,
          ),
        )
        for kind in kinds
        for method in methods
      }
      oracles = {
        kind: functools.partial(
          lambda p, b, kind: ft.dense_fisher(
            apply_fn, p, b[0], b[1], family=family, kind=kind
          ),
          kind=kind,
        )
        for kind in kinds
      }
      out = _est_many(apply_fn, params, (x, y), calls, oracles)
      for kind in kinds:
        k = ranks[kind]
        vals, vecs = ft.top_eig(out[kind], k)
        for method in methods:
          with self.subTest(kind=kind, method=method):
            stat = out[(kind, method)]
            np.testing.assert_allclose(
              stat.eigvals, vals, rtol=1e-9, atol=1e-12
            )
            v = _stack_flat(stat.eigvecs, k)
            np.testing.assert_allclose(v @ v.T, np.eye(k), atol=1e-10)
            np.testing.assert_allclose(np.abs(v @ vecs.T), np.eye(k), atol=1e-8)

  def test_rank_larger_than_examples_pads_with_zeros(self):
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup("categorical", n=2)
      stat = _est(
        fisher.low_rank,
        apply_fn,
        params,
        (x, y),
        likelihood=fisher.Categorical(),
        kind="empirical",
        rank=5,
      )
      self.assertEqual(stat.eigvals.shape, (5,))
      np.testing.assert_array_equal(stat.eigvals[2:], 0.0)
      np.testing.assert_array_equal(_stack_flat(stat.eigvecs, 5)[2:], 0.0)
      self.assertGreater(float(stat.eigvals[1]), 0.0)

  def test_zero_gradients_give_zero_not_nan(self):
    with jax.enable_x64(True):
      apply_fn, params, x, _ = _setup("gaussian")
      # Zero residuals, exactly (a recomputed forward could differ in its
      # last bits): every gradient is zero.
      params = jax.tree.map(jnp.zeros_like, params)
      y = jnp.zeros_like(apply_fn(params, x))
      kw = dict(likelihood=fisher.Gaussian(), kind="empirical")
      out = _est_many(
        apply_fn,
        params,
        (x, y),
        {
          "stat": (fisher.low_rank, dict(kw, rank=3)),
          "one": (fisher.rank_one, dict(kw, scale="optimal")),
        },
      )
      stat, one = out["stat"], out["one"]
      chex.assert_tree_all_finite(stat)
      np.testing.assert_array_equal(stat.eigvals, 0.0)
      chex.assert_tree_all_finite(one)
      np.testing.assert_array_equal(one.eigvals, 0.0)

  def test_per_leaf_matches_diagonal_blocks(self):
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup("categorical")
      dense = ft.dense_fisher(
        apply_fn, params, x, y, family="categorical", kind="exact"
      )
      stats = _est(
        fisher.low_rank,
        apply_fn,
        params,
        (x, y),
        likelihood=fisher.Categorical(),
        kind="exact",
        rank=2,
        per_leaf=True,
      )
      flat = jax.tree.leaves(
        stats, is_leaf=lambda s: isinstance(s, fisher.LowRankFisher)
      )
      for stat, block in zip(flat, ft.leaf_blocks(params, dense)):
        vals, _ = ft.top_eig(block, 2)
        np.testing.assert_allclose(stat.eigvals, vals, rtol=1e-9, atol=1e-12)

  def test_per_leaf_batch_squared_reports_the_example_count(self):
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup("categorical")
      stats = _est(
        fisher.low_rank,
        apply_fn,
        params,
        (x, y),
        likelihood=fisher.Categorical(),
        kind="batch_squared",
        rank=1,
        per_leaf=True,
      )
      flat = jax.tree.leaves(
        stats, is_leaf=lambda s: isinstance(s, fisher.LowRankFisher)
      )
      means = jax.tree.leaves(stats["dense_0"]["kernel"].mean_grad)
      self.assertLen(means, 1)
      for stat in flat:
        self.assertEqual(int(stat.count), N)
        # The leaf's block of mu mu^T has the one eigenvalue |mu_leaf|^2.
        np.testing.assert_allclose(
          stat.eigvals, [jnp.sum(jnp.square(stat.mean_grad))], rtol=1e-10
        )

  def test_zero_size_leaf_gives_empty_directions(self):
    # A zero-size leaf (here unused by the model) gets (k, 0) directions;
    # the other leaves are as without it.
    _, params, x, y = _setup("categorical")
    apply_fn = _mlp_ignoring_empty
    with_empty = dict(
      params, empty=jnp.zeros((0,), params["dense_0"]["bias"].dtype)
    )
    kw = dict(likelihood=fisher.Categorical(), kind="empirical", rank=2)
    calls = {
      "auto": (fisher.low_rank, kw),
      "per_example": (fisher.low_rank, dict(kw, method="per_example")),
      "per_leaf": (fisher.low_rank, dict(kw, per_leaf=True)),
    }
    ref = _est_many(apply_fn, params, (x, y), calls)
    got = _est_many(apply_fn, with_empty, (x, y), calls)
    for name in ("auto", "per_example"):
      self.assertEqual(got[name].eigvecs["empty"].shape, (2, 0))
      np.testing.assert_allclose(
        got[name].eigvals, ref[name].eigvals, rtol=1e-5, atol=1e-7
      )
    self.assertEqual(got["per_leaf"]["empty"].eigvecs.shape, (2, 0))
    np.testing.assert_array_equal(got["per_leaf"]["empty"].eigvals, 0.0)
    np.testing.assert_allclose(
      got["per_leaf"]["dense_1"]["kernel"].eigvals,
      ref["per_leaf"]["dense_1"]["kernel"].eigvals,
      rtol=1e-5,
    )

  def test_rank_one(self):
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup("categorical")
      lik = fisher.Categorical()
      kinds = ("empirical", "exact")
      calls, oracles = {}, {}
      for kind in kinds:
        kw = dict(likelihood=lik, kind=kind)
        calls[kind, "plain"] = (fisher.rank_one, kw)
        calls[kind, "opt"] = (fisher.rank_one, dict(kw, scale="optimal"))
        calls[kind, "top"] = (fisher.rank_one, dict(kw, direction="top_eig"))
        oracles[kind] = functools.partial(
          lambda p, b, kind: ft.dense_fisher(
            apply_fn, p, b[0], b[1], family="categorical", kind=kind
          ),
          kind=kind,
        )
      oracles["mu"] = lambda p, b: ft.ravel(
        ft.mean_grad_dense(apply_fn, p, b[0], b[1], "categorical")
      )
      out = _est_many(apply_fn, params, (x, y), calls, oracles)
      mu = out["mu"]
      for kind in kinds:
        dense = out[kind]
        plain, opt = out[kind, "plain"], out[kind, "opt"]
        np.testing.assert_allclose(
          ft.ravel(plain.eigvecs), mu / jnp.linalg.norm(mu), rtol=1e-10
        )
        np.testing.assert_allclose(plain.eigvals, [mu @ mu], rtol=1e-10)
        c_star = (mu @ dense @ mu) / (mu @ mu) ** 2
        np.testing.assert_allclose(
          opt.eigvals, [c_star * (mu @ mu)], rtol=1e-10
        )
        top = out[kind, "top"]
        vals, _ = ft.top_eig(dense, 1)
        np.testing.assert_allclose(top.eigvals, vals, rtol=1e-10)
      # batch_squared is mu mu^T itself: the optimal scale leaves |mu|^2.
      sq = fisher.rank_one(
        apply_fn,
        params,
        (x, y),
        likelihood=lik,
        kind="batch_squared",
        scale="optimal",
      )
      np.testing.assert_allclose(sq.eigvals, [mu @ mu], rtol=1e-10)


class KroneckerTest(parameterized.TestCase):
  def _kfac_oracle(self, params, x, dense):
    """A = E[a a^T] from the activations, Gamma = the bias block of F."""
    h = jnp.tanh(x @ params["dense_0"]["kernel"] + params["dense_0"]["bias"])
    blocks = ft.leaf_blocks(params, dense)  # bias_0, kernel_0, bias_1, ...
    return {
      "dense_0": (x.T @ x / x.shape[0], blocks[0]),
      "dense_1": (h.T @ h / x.shape[0], blocks[2]),
    }

  def test_kfac_factors(self):
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup("categorical")
      kinds = ("empirical", "exact")
      out = _est_many(
        apply_fn,
        params,
        (x, y),
        {
          (kind, "stat"): (
            fisher.kronecker,
            dict(likelihood=fisher.Categorical(), kind=kind, estimator="kfac"),
          )
          for kind in kinds
        },
        {
          kind: functools.partial(
            lambda p, b, kind: ft.dense_fisher(
              apply_fn, p, b[0], b[1], family="categorical", kind=kind
            ),
            kind=kind,
          )
          for kind in kinds
        },
      )
      for kind in kinds:
        dense, stat = out[kind], out[kind, "stat"]
        self.assertEqual(stat.estimator, "kfac")
        for layer, (a, gamma) in self._kfac_oracle(params, x, dense).items():
          np.testing.assert_allclose(stat.left[layer]["kernel"], a, rtol=1e-10)
          np.testing.assert_allclose(
            stat.right[layer]["kernel"], gamma, rtol=1e-10, atol=1e-14
          )
          np.testing.assert_allclose(
            stat.right[layer]["bias"], gamma, rtol=1e-10, atol=1e-14
          )
          np.testing.assert_allclose(stat.left[layer]["bias"], [[1.0]])

  def test_shampoo_factors_and_nearest_kronecker(self):
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup("categorical")
      g = ft.per_example_grads_dense(apply_fn, params, x, y, "categorical")
      kernel = ft.unravel_like(params, g)["dense_1"]["kernel"]  # (N, 5, 4)
      block = ft.leaf_blocks(params, g.T @ g / N)[
        3
      ]  # kernel_1 block, row-major vec
      kw = dict(
        likelihood=fisher.Categorical(), kind="empirical", estimator="shampoo"
      )
      out = _est_many(
        apply_fn,
        params,
        (x, y),
        {
          "one": (fisher.kronecker, kw),
          "near": (fisher.kronecker, dict(kw, num_iters=20, chunk_size=3)),
        },
      )
      one, near = out["one"], out["near"]
      ggt = jnp.einsum("nij,nkj->ik", kernel, kernel) / N
      gtg = jnp.einsum("nij,nik->jk", kernel, kernel) / N
      np.testing.assert_allclose(one.left["dense_1"]["kernel"], ggt, rtol=1e-10)
      np.testing.assert_allclose(
        one.right["dense_1"]["kernel"], gtg / jnp.trace(ggt), rtol=1e-10
      )
      # Van Loan-Pitsianis: the nearest Kronecker product is the top singular
      # pair of the rearranged block.
      m, n = 5, 4
      rearranged = (
        block.reshape(m, n, m, n).transpose(0, 2, 1, 3).reshape(m * m, n * n)
      )
      u, s, vt = jnp.linalg.svd(rearranged)
      best = jnp.kron(s[0] * u[:, 0].reshape(m, m), vt[0].reshape(n, n))
      approx = jnp.kron(
        near.left["dense_1"]["kernel"], near.right["dense_1"]["kernel"]
      )
      np.testing.assert_allclose(approx, best, atol=1e-8)
      err_one = jnp.linalg.norm(
        block
        - jnp.kron(
          one.left["dense_1"]["kernel"], one.right["dense_1"]["kernel"]
        )
      )
      self.assertLessEqual(
        float(jnp.linalg.norm(block - approx)), float(err_one) + 1e-12
      )

  def test_batch_squared_honours_num_iters(self):
    # vec(M) vec(M)^T for the mean gradient M (rank > 1): one step gives
    # (M M^T, M^T M / tr), num_iters > 0 the nearest Kronecker product.
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup("categorical")
      kw = dict(likelihood=fisher.Categorical(), kind="batch_squared")
      out = _est_many(
        apply_fn,
        params,
        (x, y),
        {
          "one": (fisher.kronecker, kw),
          "near": (fisher.kronecker, dict(kw, num_iters=30)),
        },
      )
      one, near = out["one"], out["near"]
      self.assertEqual((one.estimator, near.estimator), ("shampoo",) * 2)
      self.assertEqual(int(near.count), N)
      mat = one.mean_grad["dense_1"]["kernel"]  # (5, 4)
      m, n = mat.shape
      sv = jnp.linalg.svd(mat, compute_uv=False)
      self.assertGreater(float(sv[1] / sv[0]), 1e-3)  # not rank one
      ggt = mat @ mat.T
      np.testing.assert_allclose(one.left["dense_1"]["kernel"], ggt, rtol=1e-12)
      np.testing.assert_allclose(
        one.right["dense_1"]["kernel"], mat.T @ mat / jnp.trace(ggt), rtol=1e-12
      )
      block = jnp.outer(mat.ravel(), mat.ravel())
      rearranged = (
        block.reshape(m, n, m, n).transpose(0, 2, 1, 3).reshape(m * m, n * n)
      )
      u, s, vt = jnp.linalg.svd(rearranged)
      best = jnp.kron(s[0] * u[:, 0].reshape(m, m), vt[0].reshape(n, n))
      approx = jnp.kron(
        near.left["dense_1"]["kernel"], near.right["dense_1"]["kernel"]
      )
      np.testing.assert_allclose(approx, best, atol=1e-8)
      err_one = jnp.linalg.norm(
        block
        - jnp.kron(
          one.left["dense_1"]["kernel"], one.right["dense_1"]["kernel"]
        )
      )
      self.assertLess(float(jnp.linalg.norm(block - approx)), float(err_one))

  def test_zero_size_leaf_gives_empty_factors(self):
    # An unused (0,) leaf, a (1, 0) matrix: (1, 1) and (0, 0) factors; the
    # other leaves are as without it.
    _, params, x, y = _setup("categorical")
    apply_fn = _mlp_ignoring_empty
    with_empty = dict(
      params, empty=jnp.zeros((0,), params["dense_0"]["bias"].dtype)
    )
    kw = dict(likelihood=fisher.Categorical(), kind="empirical")
    calls = {
      "auto": (fisher.kronecker, kw),
      "shampoo": (fisher.kronecker, dict(kw, estimator="shampoo")),
      "near": (fisher.kronecker, dict(kw, estimator="shampoo", num_iters=2)),
    }
    ref = _est_many(apply_fn, params, (x, y), calls)
    got = _est_many(apply_fn, with_empty, (x, y), calls)
    for name in calls:
      stat = got[name]
      self.assertEqual(stat.left["empty"].shape, (1, 1))
      self.assertEqual(stat.right["empty"].shape, (0, 0))
      chex.assert_tree_all_finite((stat.left, stat.right))
      chex.assert_trees_all_close(
        (stat.left["dense_1"], stat.right["dense_1"]),
        (ref[name].left["dense_1"], ref[name].right["dense_1"]),
        rtol=1e-5,
        atol=1e-7,
      )

  def test_auto_mixes_kfac_and_shampoo(self):
    with jax.enable_x64(True):
      _, params, x, y = _setup("categorical")
      params = dict(params, scale=jnp.linspace(0.5, 1.5, 5))
      kw = dict(likelihood=fisher.Categorical(), kind="exact")
      out = _est_many(
        _scaled_mlp,
        params,
        (x, y),
        {
          "stat": (fisher.kronecker, kw),
          "ref": (
            fisher.kronecker,
            dict(kw, method="per_example", estimator="shampoo"),
          ),
        },
      )
      stat, ref = out["stat"], out["ref"]
      self.assertEqual(stat.estimator, "mixed")
      np.testing.assert_allclose(stat.left["scale"], ref.left["scale"])
      np.testing.assert_allclose(stat.right["scale"], ref.right["scale"])
      with self.assertRaisesRegex(
        ValueError, "no K-FAC factors for these leaves"
      ):
        _est(
          fisher.kronecker,
          _scaled_mlp,
          params,
          (x, y),
          likelihood=fisher.Categorical(),
          kind="exact",
          estimator="kfac",
        )

  def test_example_chunks_keep_every_factor(self):
    # K-FAC leaves (dense), an elementwise gain and a squared scale (a
    # value computed from a parameter; both Shampoo factors from the layer
    # path), the examples in chunks of 3 with a remainder vs one forward
    # pass.
    def apply_fn(params, x):
      h = jnp.tanh(x @ params["dense_0"]["kernel"] + params["dense_0"]["bias"])
      h = h * params["gain"] * params["scale"] ** 2
      return h @ params["dense_1"]["kernel"] + params["dense_1"]["bias"]

    with jax.enable_x64(True):
      _, params, x, y = _setup("categorical")
      params = dict(
        params,
        gain=jnp.linspace(0.8, 1.2, 5),
        scale=jnp.linspace(0.5, 1.5, 5),
      )
      kw = dict(likelihood=fisher.Categorical(), kind="exact")
      out = _est_many(
        apply_fn,
        params,
        (x, y),
        {
          c: (fisher.kronecker, dict(kw, chunk_size=c))
          for c in (3, N)  # chunk_size >= B: one pass of all examples
        },
      )
      self.assertEqual(out[3].estimator, "mixed")
      for field in ("left", "right", "mean_grad"):
        chex.assert_trees_all_close(
          getattr(out[3], field), getattr(out[N], field), rtol=1e-10
        )
      self.assertEqual(int(out[3].count), N)

      # Power iterations keep one forward pass: K-FAC leaves as at
      # num_iters=0, the gain and the scale as the per-example path's.
      rounds = dict(kw, num_iters=3)
      more = _est_many(
        apply_fn,
        params,
        (x, y),
        {
          "auto": (fisher.kronecker, dict(rounds, chunk_size=3)),
          "ref": (
            fisher.kronecker,
            dict(rounds, method="per_example", estimator="shampoo"),
          ),
        },
      )
      for leaf in ("gain", "scale"):
        for field in ("left", "right"):
          np.testing.assert_allclose(
            getattr(more["auto"], field)[leaf],
            getattr(more["ref"], field)[leaf],
            rtol=1e-8,
            atol=1e-12,
          )
      for field in ("left", "right"):
        chex.assert_trees_all_close(
          getattr(more["auto"], field)["dense_1"],
          getattr(out[N], field)["dense_1"],
          rtol=1e-10,
        )


class DerivativesTest(parameterized.TestCase):
  """``jax.grad`` through an estimate: the dense oracle differentiated, on
  both paths (the likelihood's output cotangents depend on ``params`` too)."""

  @parameterized.parameters("categorical", "heteroscedastic")
  def test_grad_through_estimates_equals_the_oracle(self, family):
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup(family)
      lik = LIKELIHOODS[family]()
      flat, unravel = jax.flatten_util.ravel_pytree(params)

      def objectives(fl):
        p = unravel(fl)
        out = {}
        for kind in ("empirical", "exact"):
          dense = ft.dense_fisher(apply_fn, p, x, y, family=family, kind=kind)
          out["dense", kind, "diag"] = jnp.sum(jnp.sin(jnp.diag(dense)))
          out["dense", kind, "top"] = jnp.sum(jnp.linalg.eigvalsh(dense)[-2:])
          for method in ("auto", "per_example"):
            kw = dict(likelihood=lik, kind=kind, method=method)
            d = fisher.diagonal(apply_fn, p, (x, y), **kw)
            diag = jax.flatten_util.ravel_pytree(d.diag)[0]
            out[method, kind, "diag"] = jnp.sum(jnp.sin(diag))
            top = fisher.low_rank(apply_fn, p, (x, y), rank=2, **kw)
            out[method, kind, "top"] = jnp.sum(top.eigvals)
            if kind == "empirical":
              g = jax.flatten_util.ravel_pytree(d.mean_grad)[0]
              out[method, "mean_grad"] = jnp.sum(jnp.cos(g))
        want = ft.mean_grad_dense(apply_fn, p, x, y, family)
        out["dense", "mean_grad"] = jnp.sum(
          jnp.cos(jax.flatten_util.ravel_pytree(want)[0])
        )
        return out

      grads = jax.jit(jax.jacrev(objectives))(flat)
      for method in ("auto", "per_example"):
        for key in [k for k in grads if k[0] == "dense"]:
          with self.subTest(method=method, objective=key[1:]):
            np.testing.assert_allclose(
              grads[(method, *key[1:])], grads[key], rtol=1e-8, atol=1e-12
            )


class ZeroSizeLayerTest(absltest.TestCase):
  """Zero-size leaves that layers read (a zero-width layer, a layer on its
  empty output) get empty statistics; the others are the per-example
  path's."""

  def test_every_statistic(self):
    k = jax.random.split(jax.random.key(0), 3)
    params = {
      "w0": jnp.zeros((5, 0)),  # a zero-width layer
      "b0": jnp.zeros((0,)),
      "w1": jnp.zeros((0, 3)),  # a layer on its empty output
      "b1": jax.random.normal(k[0], (3,)),
      "w2": jax.random.normal(k[1], (5, 3)),
    }

    def apply_fn(p, x):
      h = x @ p["w0"] + p["b0"]
      return jnp.concatenate([x, h], -1) @ p["w2"] + (h @ p["w1"] + p["b1"])

    x = jax.random.normal(k[2], (6, 5))
    y = jnp.arange(6) % 3
    cov = fisher.coverage(apply_fn, params, x)
    for name in ("w0", "b0", "w1"):
      self.assertIn("zero-size", cov[name].reason)
    self.assertEqual(cov["w2"].path, "layer")
    L = fisher.Categorical()
    key = jax.random.key(1)
    kw = {
      "diag_emp": (fisher.diagonal, dict(likelihood=L, kind="empirical")),
      "diag_mc": (fisher.diagonal, dict(likelihood=L, kind="mc", key=key)),
      "diag_exact": (fisher.diagonal, dict(likelihood=L, kind="exact")),
      "kron": (fisher.kronecker, dict(likelihood=L, kind="empirical")),
      "low_rank": (
        fisher.low_rank,
        dict(likelihood=L, kind="empirical", rank=2),
      ),
    }
    calls = dict(kw)
    for name, (fn, a) in kw.items():
      if name != "kron":  # per-example K-FAC is Shampoo's: no oracle
        calls[name + "_pe"] = (fn, dict(a, method="per_example"))
    got = _est_many(apply_fn, params, (x, y), calls)
    for name in ("diag_emp", "diag_mc", "diag_exact"):
      self.assertEqual(got[name].diag["w0"].shape, (5, 0))
      chex.assert_trees_all_close(
        got[name].diag, got[name + "_pe"].diag, rtol=1e-5, atol=1e-7
      )
    np.testing.assert_allclose(
      got["low_rank"].eigvals, got["low_rank_pe"].eigvals, rtol=1e-5
    )
    self.assertEqual(got["low_rank"].eigvecs["w1"].shape, (2, 0, 3))
    self.assertEqual(got["kron"].right["w1"].shape, (3, 3))
    chex.assert_tree_all_finite((got["kron"].left, got["kron"].right))


class OperationsTest(parameterized.TestCase):
  """matvec / quadratic_form / solve against the dense matrix they stand for."""

  def _dense_of(self, stat, params):
    if isinstance(stat, fisher.DiagonalFisher):
      return jnp.diag(ft.ravel(stat.diag))
    if isinstance(stat, fisher.LowRankFisher):
      v = _stack_flat(stat.eigvecs, stat.rank)
      return v.T @ jnp.diag(stat.eigvals) @ v
    blocks = [
      jnp.kron(l, r)
      for l, r in zip(jax.tree.leaves(stat.left), jax.tree.leaves(stat.right))
    ]
    return jax.scipy.linalg.block_diag(*blocks)

  def test_operations(self):
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup("categorical")
      kw = dict(likelihood=fisher.Categorical(), kind="exact")
      # The three structures in one compile, their operations in another.
      stats = _est_many(
        apply_fn,
        params,
        (x, y),
        {
          "diagonal": (fisher.diagonal, kw),
          "low_rank": (fisher.low_rank, dict(kw, rank=4)),
          "kronecker": (fisher.kronecker, kw),
        },
      )
      size = ft.ravel(params).shape[0]
      v = ft.unravel_like(
        params, ft.normal(jax.random.key(5), (size,), jnp.float64)
      )
      flat_v = ft.ravel(v)
      ops = jax.jit(
        lambda stats, v: {
          k: (
            s.matvec(v),
            s.quadratic_form(v),
            s.solve(v, 0.3),
            s.inverse_diag(0.3),
            s.is_finite(),
          )
          for k, s in stats.items()
        }
      )(stats, v)
      for structure, stat in stats.items():
        with self.subTest(structure=structure):
          self.assertIsInstance(stat, fisher.FisherStatistic)
          self.assertEqual(int(stat.count), N)
          dense = self._dense_of(stat, params)
          matvec, quad, solved, inv_diag, finite = ops[structure]
          self.assertTrue(bool(finite))
          np.testing.assert_allclose(
            ft.ravel(matvec), dense @ flat_v, rtol=1e-9, atol=1e-12
          )
          np.testing.assert_allclose(quad, flat_v @ dense @ flat_v, rtol=1e-9)
          damped = dense + 0.3 * jnp.eye(dense.shape[0])
          np.testing.assert_allclose(
            ft.ravel(solved),
            jnp.linalg.solve(damped, flat_v),
            rtol=1e-8,
            atol=1e-10,
          )
          np.testing.assert_allclose(
            ft.ravel(inv_diag),
            jnp.diag(jnp.linalg.inv(damped)),
            rtol=1e-8,
            atol=1e-10,
          )
          # Registered pytrees: jit, vmap and tree ops see the arrays only.
          out = jax.jit(lambda s: s)(stat)
          self.assertEqual(out.kind, "exact")
          chex.assert_trees_all_close(out, stat)


class StatisticInputChecksTest(absltest.TestCase):
  """Operations refuse inputs they would silently misread."""

  def test_kronecker_round_off_eigenvalues_count_as_zero(self):
    # A softmax output layer's Gamma is singular (its cotangents sum to
    # zero): eigh gives about -eps for that eigenvalue, and a small damping
    # must not divide by a denominator near or below zero.
    with jax.enable_x64(True):
      x = jax.random.normal(jax.random.key(0), (8, 3))
      y = jax.random.randint(jax.random.key(1), (8,), 0, 3)
      params = {"w": jnp.full((3, 3), 0.1)}
      kron = fisher.kronecker(
        lambda p, x: x @ p["w"],
        params,
        (x, y),
        likelihood=fisher.Categorical(),
        kind="empirical",
      )
      damping = 1e-18
      a, qa = np.linalg.eigh(np.asarray(kron.left["w"]))
      b, qb = np.linalg.eigh(np.asarray(kron.right["w"]))
      lam = np.maximum(a, 0)[:, None] * np.maximum(b, 0)[None, :] + damping
      want = (qa**2) @ (1 / lam) @ (qb**2).T
      got = np.asarray(kron.inverse_diag(damping)["w"])
      self.assertTrue(np.all(got > 0))
      np.testing.assert_allclose(got, want, rtol=1e-6)

  def test_shapes_damping_indices_and_dtypes(self):
    diag = fisher.DiagonalFisher(
      {"w": jnp.ones((3, 2))}, None, jnp.asarray(1, jnp.int32)
    )
    # A (3, 1) leaf would broadcast to (3, 2).
    for op in (diag.matvec, diag.quadratic_form, lambda v: diag.solve(v, 1.0)):
      with self.assertRaisesRegex(ValueError, r"v\['w'\] has shape"):
        op({"w": jnp.ones((3, 1))})
    # Factors (3, 3) and (2, 2): a transposed (2, 3) leaf has the size of
    # a (3, 2) matrix but other rows.
    kron = fisher.KroneckerFisher(
      {"w": jnp.eye(3)}, {"w": jnp.eye(2)}, None, jnp.asarray(1, jnp.int32)
    )
    for bad in ((2, 3), (6,)):
      with self.assertRaisesRegex(ValueError, "do not fit"):
        kron.matvec({"w": jnp.ones(bad)})
    self.assertEqual(kron.matvec({"w": jnp.ones((3, 2))})["w"].shape, (3, 2))
    # Kronecker: the factors are singular in general, damping must be > 0.
    for op in (
      lambda: kron.solve({"w": jnp.ones((3, 2))}, 0.0),
      lambda: kron.inverse_diag(0.0),
    ):
      with self.assertRaisesRegex(ValueError, "damping"):
        op()
    # Low rank: F is singular, damping must be > 0; v's leaves are checked.
    low = fisher.low_rank_from_grads({"w": jnp.ones((2, 4))}, rank=2)
    with self.assertRaisesRegex(ValueError, r"v\['w'\] has shape"):
      low.matvec({"w": jnp.ones((2, 2))})
    for op in (
      lambda: low.solve({"w": jnp.ones(4)}, 0.0),
      lambda: low.inverse_diag(0.0),
    ):
      with self.assertRaisesRegex(ValueError, "damping"):
        op()
    # Sum of rank one: a zero-size leaf, out-of-range indices, and a
    # quadratic form summed in float32 for a bfloat16 v.
    grads = {"a": jnp.ones((3, 0)), "b": jnp.arange(6.0).reshape(3, 2)}
    r1s = fisher.sum_of_rank_one(grads, 0.1)
    dense = jnp.linalg.inv(grads["b"].T @ grads["b"] / 3 + 0.1 * jnp.eye(2))
    np.testing.assert_allclose(r1s.inverse_entry(0, 1), dense[0, 1], rtol=1e-4)
    with self.assertRaisesRegex(ValueError, r"\[0, 2\)"):
      r1s.inverse_entry(5, 5)
    v = {
      "a": jnp.zeros(0, jnp.bfloat16),
      "b": jnp.array([3.1, -2.3], jnp.bfloat16),
    }
    self.assertEqual(r1s.quadratic_form(v).dtype, jnp.float32)

  def test_low_rank_inverse_diag_in_float32(self):
    # A coordinate inside the eigenvectors' span: 1 / damping minus a
    # correction cancelled (83% off at eigvals / damping = 1e7).
    rng = np.random.default_rng(0)
    d = 50
    rest = np.linalg.qr(rng.standard_normal((d - 1, 3)))[0]
    vecs = np.zeros((d, 4))
    vecs[0, 0], vecs[1:, 1:] = 1.0, rest
    eigvals = np.array([1e4, 10.0, 1.0, 0.1])
    stat = fisher.LowRankFisher(
      jnp.asarray(eigvals, jnp.float32),
      {"w": jnp.asarray(vecs.T, jnp.float32)},
      None,
      jnp.asarray(8, jnp.int32),
    )
    for damping in (1e-3, 1e-1):
      dense = vecs @ np.diag(eigvals) @ vecs.T + damping * np.eye(d)
      np.testing.assert_allclose(
        stat.inverse_diag(damping)["w"],
        np.diag(np.linalg.inv(dense)),
        rtol=1e-6,
      )


class RankOneSumInterfaceTest(absltest.TestCase):
  """M-FAC's factored statistic under the shared statistic interface."""

  def test_interface_and_dense_inverse_diag(self):
    with jax.enable_x64(True):
      k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
      grads = {
        "b": ft.normal(k1, (5, 4), jnp.float64),
        "w": ft.normal(k2, (5, 3, 2), jnp.float64),
      }
      v = ft.unravel_like(
        jax.tree.map(lambda g: g[0], grads),
        ft.normal(k3, (10,), jnp.float64),
      )

      @jax.jit  # Both forms in one compile.
      def run(grads, v):
        out = {}
        for name, block_size in (("full", None), ("blocked", 4)):
          f = fisher.sum_of_rank_one(grads, 0.1, block_size=block_size)
          out[name] = (f.solve(v), f.ihvp(v), f.inverse_diag(), f.is_finite())
        return out

      out = run(grads, v)
      g = jnp.concatenate([grads["b"], grads["w"].reshape(5, -1)], 1)
      blocks = jnp.arange(10) // 4
      for name, mask in (
        ("full", jnp.ones((10, 10))),
        ("blocked", (blocks[:, None] == blocks[None, :]).astype(jnp.float64)),
      ):
        with self.subTest(name):
          solved, ihvp, inv_diag, finite = out[name]
          chex.assert_trees_all_equal(solved, ihvp)
          dense = 0.1 * jnp.eye(10) + mask * (g.T @ g) / 5
          np.testing.assert_allclose(
            ft.ravel(inv_diag), jnp.diag(jnp.linalg.inv(dense)), rtol=1e-9
          )
          self.assertTrue(bool(finite))
      f = fisher.sum_of_rank_one(grads, 0.1)
      self.assertIsInstance(f, fisher.FisherStatistic)
      self.assertEqual((int(f.count), f.kind), (5, "empirical"))
      with self.assertRaisesRegex(ValueError, "damping=None"):
        f.solve(v, 0.2)
      with self.assertRaisesRegex(ValueError, "damping=None"):
        f.inverse_diag(0.2)
      f.check_compatible(v)
      with self.assertRaisesRegex(ValueError, "params leaf has shape"):
        f.check_compatible(dict(v, w=jnp.ones((2, 3))), what="params")


class FromGradsTest(absltest.TestCase):
  def test_diagonal_and_low_rank_from_grads(self):
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup("categorical")
      g = ft.per_example_grads_dense(apply_fn, params, x, y, "categorical")
      grads = ft.unravel_like(params, g)
      emp, sq, lr = jax.jit(
        lambda g: (  # One compile, not many eager ops.
          fisher.diagonal_from_grads(g),
          fisher.diagonal_from_grads(g, kind="batch_squared"),
          fisher.low_rank_from_grads(g, rank=3),
        )
      )(grads)
      chex.assert_trees_all_close(
        emp.diag, ft.unravel_like(params, jnp.mean(g**2, 0)), rtol=1e-12
      )
      chex.assert_trees_all_close(
        sq.diag, ft.unravel_like(params, jnp.mean(g, 0) ** 2), rtol=1e-12
      )
      vals, _ = ft.top_eig(g.T @ g / N, 3)
      np.testing.assert_allclose(lr.eigvals, vals, rtol=1e-9)

  def test_diagonal_from_loss_is_chunked_sufficient_statistics(self):
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup("categorical")

      def loss(p, ex):
        return fisher.Categorical().nll(apply_fn(p, ex[0][None])[0], ex[1])

      g = ft.per_example_grads_dense(apply_fn, params, x, y, "categorical")
      kinds, chunks = ("empirical", "batch_squared"), (None, 3)
      names = [(kind, chunk) for kind in kinds for chunk in chunks]
      got = dict(
        zip(
          names,
          jax.jit(
            lambda p, b: [  # One compile for all.
              fisher.diagonal_from_loss(loss, p, b, kind=kind, chunk_size=chunk)
              for kind, chunk in names
            ]
          )(params, (x, y)),
        )
      )
      for kind in kinds:
        ref = fisher.diagonal_from_grads(ft.unravel_like(params, g), kind=kind)
        for chunk in chunks:
          chex.assert_trees_all_close(
            got[kind, chunk], ref, rtol=1e-10, atol=1e-14
          )
      with self.assertRaisesRegex(ValueError, "kind"):
        fisher.diagonal_from_loss(loss, params, (x, y), kind="exact")


class BadInputTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    self.apply_fn, self.params, self.x, self.y = _setup("categorical")
    self.kw = dict(likelihood=fisher.Categorical(), kind="exact")

  def test_mismatched_batch(self):
    with self.assertRaisesRegex(ValueError, "leading .batch. axis"):
      fisher.diagonal(
        self.apply_fn, self.params, (self.x, self.y[:3]), **self.kw
      )

  def test_non_array_leaf(self):
    with self.assertRaisesRegex(TypeError, r"batch\[0\].*must be an array"):
      fisher.diagonal(
        self.apply_fn, self.params, ([[1.0]] * N, self.y), **self.kw
      )

  def test_complex_or_integer_leaves_are_refused(self):
    # A complex gradient would be squared where |g|^2 is meant.
    name = jax.tree_util.keystr(
      jax.tree_util.tree_flatten_with_path(self.params)[0][0][0]
    )
    first, *rest = jax.tree.leaves(self.params)
    treedef = jax.tree.structure(self.params)
    for dtype in (jnp.complex64, jnp.int32):
      with self.subTest(str(jnp.dtype(dtype))):
        bad = treedef.unflatten([first.astype(dtype), *rest])
        for method in ("auto", "per_example"):
          with self.assertRaisesRegex(
            TypeError, re.escape(f"params{name} has dtype")
          ):
            fisher.diagonal(
              self.apply_fn, bad, (self.x, self.y), method=method, **self.kw
            )
        g = jnp.ones((2, 3), dtype)
        for fn in (
          fisher.diagonal_from_grads,
          functools.partial(fisher.low_rank_from_grads, rank=1),
          functools.partial(fisher.sum_of_rank_one, damping=1.0),
        ):
          with self.assertRaisesRegex(TypeError, "real floating-point"):
            fn({"w": g})

  def test_batch_not_a_pair(self):
    with self.assertRaisesRegex(ValueError, "pair"):
      fisher.diagonal(self.apply_fn, self.params, self.x, **self.kw)

  def test_chunk_size(self):
    with self.assertRaisesRegex(ValueError, "chunk_size"):
      fisher.diagonal(
        self.apply_fn, self.params, (self.x, self.y), chunk_size=0, **self.kw
      )
    with self.assertRaisesRegex(TypeError, "chunk_size"):
      fisher.per_example_grads(
        lambda p, e: 0.0, self.params, (self.x, self.y), chunk_size=2.0
      )

  def test_kind_and_options(self):
    with self.assertRaisesRegex(ValueError, "kind"):
      fisher.diagonal(
        self.apply_fn,
        self.params,
        (self.x, self.y),
        likelihood=fisher.Categorical(),
        kind="fisher",
      )
    with self.assertRaisesRegex(ValueError, "key"):
      fisher.diagonal(
        self.apply_fn,
        self.params,
        (self.x, self.y),
        likelihood=fisher.Categorical(),
        kind="mc",
      )
    with self.assertRaisesRegex(ValueError, "method"):
      fisher.diagonal(
        self.apply_fn, self.params, (self.x, self.y), method="fast", **self.kw
      )
    with self.assertRaisesRegex(TypeError, "rank"):
      fisher.low_rank(
        self.apply_fn, self.params, (self.x, self.y), rank=2.0, **self.kw
      )
    with self.assertRaisesRegex(TypeError, "likelihood"):
      fisher.diagonal(
        self.apply_fn,
        self.params,
        (self.x, self.y),
        likelihood="categorical",
        kind="exact",
      )
    with self.assertRaisesRegex(ValueError, "sigma"):
      fisher.Gaussian(-1.0)

  def test_apply_fn_output(self):
    # The first example's output: a slice along the examples (it warns).
    with (
      self.assertWarns(fisher.FisherMixedExamplesWarning),
      self.assertRaisesRegex(ValueError, "batch axis first"),
    ):
      fisher.diagonal(
        lambda p, x: self.apply_fn(p, x)[0],
        self.params,
        (self.x, self.y),
        **self.kw,
      )


class PerExampleGradsTest(absltest.TestCase):
  def test_chunked_equals_unchunked_and_oracle(self):
    with jax.enable_x64(True):
      apply_fn, params, x, y = _setup("categorical")

      def loss(p, ex):
        xi, yi = ex
        return fisher.Categorical().nll(apply_fn(p, xi[None])[0], yi)

      chunks = (1, 2, 3, 7, 50)
      # One compile: the unchunked grads and every chunk size.
      full, chunked = jax.jit(
        lambda p, b: (
          fisher.per_example_grads(loss, p, b),
          {
            c: fisher.per_example_grads(loss, p, b, chunk_size=c)
            for c in chunks
          },
        )
      )(params, (x, y))
      chex.assert_tree_shape_prefix(full, (N,))
      oracle = ft.unravel_like(
        params,
        ft.per_example_grads_dense(apply_fn, params, x, y, "categorical"),
      )
      chex.assert_trees_all_close(full, oracle, rtol=1e-10, atol=1e-14)
      for chunk in chunks:
        chex.assert_trees_all_close(
          chunked[chunk], full, rtol=1e-12, atol=1e-15
        )


class ExampleChunksTest(absltest.TestCase):
  """Several samples per example: the examples in chunks, one forward each."""

  @staticmethod
  def _shared_mlp():
    # Weight-shared over 4 positions, so the layer path records its layers.
    sizes = (8, 256, 256, 256, 10)
    params = ft.mlp_params(jax.random.key(0), sizes)

    def apply_fn(p, x):
      h = x.reshape(x.shape[0], 4, 8)
      for i in range(len(sizes) - 1):
        h = h @ p[f"dense_{i}"]["kernel"] + p[f"dense_{i}"]["bias"]
        h = jnp.tanh(h) if i < len(sizes) - 2 else h
      return h.mean(1)

    x = ft.normal(jax.random.key(1), (256, 32))
    return apply_fn, params, x, jnp.arange(256) % 10

  @staticmethod
  def _compiled(apply_fn, params, batch, **kw):
    """The jitted diagonal of ``params`` and its memory analysis."""
    fn = jax.jit(
      lambda p: fisher.diagonal(
        apply_fn, p, batch, likelihood=fisher.Categorical(), **kw
      )
    )
    return fn, fn.lower(params).compile().memory_analysis()

  def test_default_chunks_bound_the_memory_and_keep_the_values(self):
    apply_fn, params, x, y = self._shared_mlp()
    held, _ = _taps.held_elements(apply_fn, params, x, statistic="diag")

    def compiled(chunk_size):
      return self._compiled(
        apply_fn, params, (x, y), kind="exact", chunk_size=chunk_size
      )

    one_pass, one_mem = compiled(len(x))  # chunk_size >= B: no chunks
    with mock.patch.object(_taps, "PASS_ELEMENTS", held // 4):
      chunked, mem = compiled(None)  # four chunks of 64 by default
      got = chunked(params)
    if mem is None:
      self.skipTest("no memory analysis on this backend")
    want = one_pass(params)
    chex.assert_trees_all_close(got.diag, want.diag, rtol=1e-5, atol=1e-9)
    chex.assert_trees_all_close(
      got.mean_grad, want.mean_grad, rtol=1e-5, atol=1e-8
    )
    self.assertEqual(int(got.count), len(x))
    self.assertLess(mem.temp_size_in_bytes, 0.4 * one_mem.temp_size_in_bytes)

  def test_without_targets(self):
    apply_fn, params, x, _ = _setup("categorical")
    kw = dict(likelihood=fisher.Categorical(), kind="exact")
    got = _est(fisher.diagonal, apply_fn, params, (x, None), chunk_size=3, **kw)
    want = _est(fisher.diagonal, apply_fn, params, (x, None), **kw)
    self.assertIsNone(got.mean_grad)
    chex.assert_trees_all_close(got.diag, want.diag, rtol=1e-5, atol=1e-9)
    kron = _est(
      fisher.kronecker, apply_fn, params, (x, None), chunk_size=3, **kw
    )
    self.assertIsNone(kron.mean_grad)
    self.assertEqual(int(kron.count), N)

  def test_mc_draws_do_not_depend_on_chunks_or_path(self):
    # Example n draws with fold_in(key, n): chunks of 3 (a remainder of 1
    # included) and the per-example path see the same labels.
    apply_fn, params, x, y = _setup("categorical")
    kw = dict(likelihood=fisher.Categorical(), kind="mc", num_samples=2)
    key = jax.random.key(5)
    want = _est(fisher.diagonal, apply_fn, params, (x, y), key=key, **kw)
    for method in ("auto", "per_example"):
      for chunk_size in (None, 3):
        with self.subTest(method=method, chunk_size=chunk_size):
          got = _est(
            fisher.diagonal,
            apply_fn,
            params,
            (x, y),
            key=key,
            chunk_size=chunk_size,
            method=method,
            **kw,
          )
          chex.assert_trees_all_close(got.diag, want.diag, rtol=1e-5, atol=1e-9)
    other = _est(
      fisher.diagonal, apply_fn, params, (x, y), key=jax.random.key(6), **kw
    )
    self.assertFalse(
      all(
        np.allclose(a, b)
        for a, b in zip(jax.tree.leaves(other.diag), jax.tree.leaves(want.diag))
      )
    )

  def test_one_mc_sample_with_targets_runs_in_chunks(self):
    # The mean gradient's empirical pass is a second backward pass, so MC
    # with one sample and targets chunks its examples like several samples;
    # without targets it is one pass and never chunks.
    apply_fn, params, x, y = self._shared_mlp()
    held, _ = _taps.held_elements(apply_fn, params, x, statistic="diag")
    key = jax.random.key(3)

    def compiled(targets, chunk_size):
      return self._compiled(
        apply_fn,
        params,
        (x, targets),
        kind="mc",
        key=key,
        chunk_size=chunk_size,
      )

    one_pass, one_mem = compiled(y, len(x))
    no_targets, _ = compiled(None, len(x))
    with mock.patch.object(_taps, "PASS_ELEMENTS", held // 4):
      chunked, mem = compiled(y, None)  # four chunks of 64
      got = chunked(params)
      unlabelled = compiled(None, None)[0](params)
    # The chunks draw the labels the single pass draws.
    want = one_pass(params)
    chex.assert_trees_all_close(got.diag, want.diag, rtol=1e-5, atol=1e-9)
    chex.assert_trees_all_close(
      got.mean_grad, one_pass(params).mean_grad, rtol=1e-5, atol=1e-8
    )
    chex.assert_trees_all_close(
      unlabelled.diag, no_targets(params).diag, rtol=1e-6, atol=1e-10
    )
    if mem is not None:
      self.assertLess(mem.temp_size_in_bytes, 0.5 * one_mem.temp_size_in_bytes)


class LowRankMemoryTest(absltest.TestCase):
  def test_directions_are_written_once(self):
    # The k directions (k x P floats, the output) come straight out of their
    # matmuls: XLA's temp stays far below the output, where a transposed
    # copy of them (once 90% of it) would show.
    sizes = [(256, 256), (256, 256), (256, 10)]
    keys = jax.random.split(jax.random.key(0), len(sizes))
    params = [
      {"w": 0.05 * ft.normal(k, s), "b": jnp.zeros(s[1])}
      for k, s in zip(keys, sizes)
    ]

    def apply_fn(ps, x):
      for i, p in enumerate(ps):
        x = x @ p["w"] + p["b"]
        x = jax.nn.relu(x) if i < len(ps) - 1 else x
      return x

    x, y = jnp.ones((64, 256)), jnp.arange(64) % 10
    fn = jax.jit(
      lambda p, x, y: fisher.low_rank(
        apply_fn,
        p,
        (x, y),
        likelihood=fisher.Categorical(),
        kind="empirical",
        rank=8,
      )
    )
    stats = fn.lower(params, x, y).compile().memory_analysis()
    if stats is None:
      self.skipTest("no memory analysis on this backend")
    self.assertLess(stats.temp_size_in_bytes, 0.25 * stats.output_size_in_bytes)


class ExactSequenceMemoryTest(absltest.TestCase):
  """The exact kind on per-position outputs ``(B, T, C)`` has ``S = T C``
  cotangent columns, each zero away from its position: formed all at once
  they held ``B T^2 C^2`` numbers (4 GB for T=64, C=128 at B=8); the
  backward passes now form the few columns they take."""

  def test_columns_are_formed_per_pass(self):
    t, c, d, b = 32, 64, 16, 8
    k = jax.random.split(jax.random.key(0), 3)
    params = {
      "emb": jax.random.normal(k[0], (c, d)),
      "w": jax.random.normal(k[1], (d, d)) / 4,
      "head": jax.random.normal(k[2], (d, c)) / 4,
    }

    def apply_fn(p, ids):
      return jnp.tanh(p["emb"][ids] @ p["w"]) @ p["head"]

    ids = jnp.arange(b * t).reshape(b, t) % c
    batch = (ids, (ids + 1) % c)
    exact = lambda p: fisher.diagonal(
      apply_fn, p, batch, likelihood=fisher.Categorical(), kind="exact"
    )
    stats = jax.jit(exact).lower(params).compile().memory_analysis()
    if stats is None:
      self.skipTest("no memory analysis on this backend")
    all_columns = (t * c) * b * t * c * 4  # bytes, float32
    self.assertLess(stats.temp_size_in_bytes, all_columns / 20)
    per_example = fisher.diagonal(
      apply_fn,
      params,
      batch,
      likelihood=fisher.Categorical(),
      kind="exact",
      method="per_example",
      chunk_size=2,
    )
    chex.assert_trees_all_close(
      jax.jit(exact)(params).diag, per_example.diag, rtol=2e-5, atol=1e-7
    )


class LargeBatchMemoryTest(absltest.TestCase):
  """Memory that used to grow with ``B`` beyond the batch gradient's: the
  squares of a dense diagonal (matmul operands XLA writes out) and the
  per-leaf ``(B, B)`` products of a Gram matrix."""

  B = 4096

  def setUp(self):
    super().setUp()
    self.params = ft.mlp_params(jax.random.key(0), (256, 256, 256, 10))
    self.x = jnp.ones((self.B, 256))
    self.y = jnp.arange(self.B) % 10

  def _temp(self, fn) -> int:
    stats = jax.jit(fn).lower(self.params).compile().memory_analysis()
    if stats is None:
      self.skipTest("no memory analysis on this backend")
    return stats.temp_size_in_bytes

  def _estimate(self, estimator, **kw):
    return lambda p: estimator(
      ft.mlp_apply,
      p,
      (self.x, self.y),
      likelihood=fisher.Categorical(),
      kind="empirical",
      **kw,
    )

  def test_dense_diagonal_squares_a_chunk_of_examples_at_a_time(self):
    def loss(p):
      logp = jax.nn.log_softmax(ft.mlp_apply(p, self.x))
      return jnp.mean(logp[jnp.arange(self.B), self.y])

    grad = self._temp(jax.grad(loss))
    diag = self._temp(self._estimate(fisher.diagonal))
    self.assertLess(diag, 1.5 * grad)  # 1.75x with all squares at once

  def test_gram_matrix_forms_by_blocks_of_rows(self):
    temp = self._temp(self._estimate(fisher.low_rank, rank=8))
    gram = 4 * self.B**2
    self.assertLess(temp, 4 * gram)  # 10.4 Gram matrices with one per leaf

  def test_stacked_layers_add_to_one_gram_matrix(self):
    """A scanned stack's layers add their Gram matrices to one ``(B, B)``
    sum inside the backward pass: memory beyond the gradient's does not grow
    with the number of layers (it held one Gram per leaf and layer)."""
    b, width = 512, 16

    def extra(layers: int) -> float:
      keys = jax.random.split(jax.random.key(layers), 3)
      params = {
        "stack": {
          "k": ft.normal(keys[0], (layers, width, width)) / 4,
          "b": jnp.zeros((layers, width)),
        },
        "head": ft.normal(keys[1], (width, 10)),
      }

      def apply_fn(p, x):
        def layer(z, w):
          return jnp.tanh(z @ w["k"] + w["b"]), None

        return jax.lax.scan(layer, x, p["stack"])[0] @ p["head"]

      x = ft.normal(keys[2], (b, width))
      y = jnp.arange(b) % 10

      def loss(p):
        logp = jax.nn.log_softmax(apply_fn(p, x))
        return jnp.mean(logp[jnp.arange(b), y])

      grad = jax.grad(loss)

      def top(p):
        return ft.empirical(fisher.low_rank, apply_fn, p, (x, y), rank=4)

      temp = [
        jax.jit(f).lower(params).compile().memory_analysis()
        for f in (top, grad)
      ]
      if temp[0] is None:
        self.skipTest("no memory analysis on this backend")
      return (temp[0].temp_size_in_bytes - temp[1].temp_size_in_bytes) / (
        4 * b * b
      )

    # 20 more Gram matrices at 12 layers than at 2 with one per leaf.
    self.assertLess(extra(12) - extra(2), 2)


class KroneckerMemoryTest(absltest.TestCase):
  def test_shampoo_sums_of_elementwise_leaves_form_a_pass_at_a_time(self):
    """A learned positional table (no K-FAC rule) takes Shampoo factors from
    its per-example gradients on the layer path; with the exact kind's one
    class per backward pass, their sums form a pass at a time rather than
    from all ``S * B`` gradients held at once."""
    b, t, d, classes = 64, 64, 64, 10
    keys = jax.random.split(jax.random.key(0), 2)
    params = {
      "pos": 0.1 * ft.normal(keys[0], (t, d)),
      "w": 0.1 * ft.normal(keys[1], (d, classes)),
    }

    def apply_fn(p, x):
      return jnp.mean(jnp.tanh(x + p["pos"]), axis=1) @ p["w"]

    x = jnp.ones((b, t, d))
    y = jnp.arange(b) % classes
    fn = jax.jit(
      lambda p, x, y: fisher.kronecker(
        apply_fn, p, (x, y), likelihood=fisher.Categorical(), kind="exact"
      )
    )
    stats = fn.lower(params, x, y).compile().memory_analysis()
    if stats is None:
      self.skipTest("no memory analysis on this backend")
    rows = classes * b * t * d * 4  # every pseudo-gradient of pos, float32
    self.assertLess(stats.temp_size_in_bytes, 0.75 * rows)


class InputChecksTest(absltest.TestCase):
  """Inputs that used to give unrelated errors or meaningless numbers."""

  def setUp(self):
    super().setUp()
    self.apply_fn = lambda p, x: jnp.tanh(x @ p["w"]) @ p["u"]
    keys = jax.random.split(jax.random.key(0), 3)
    self.params = {
      "w": jax.random.normal(keys[0], (3, 4)),
      "u": jax.random.normal(keys[1], (4, 2)),
    }
    self.batch = (jax.random.normal(keys[2], (5, 3)), jnp.arange(5) % 2)

  def test_integer_leaf_is_named(self):
    params = {**self.params, "step": jnp.int32(0)}
    with self.assertRaisesRegex(TypeError, r"params\['step'\] has dtype int32"):
      fisher.diagonal(
        self.apply_fn,
        params,
        self.batch,
        likelihood=fisher.Categorical(),
        kind="exact",
      )

  def test_negative_damping_is_refused(self):
    lik = fisher.Categorical()
    diag = fisher.diagonal(
      self.apply_fn, self.params, self.batch, likelihood=lik, kind="exact"
    )
    kron = fisher.kronecker(
      self.apply_fn, self.params, self.batch, likelihood=lik, kind="exact"
    )
    for solve, bound in (
      (lambda: diag.solve(self.params, -0.5), ">= 0"),
      (lambda: diag.inverse_diag(-0.5), ">= 0"),
      (lambda: kron.solve(self.params, -0.5), "> 0"),
      (lambda: kron.inverse_diag(-0.5), "> 0"),
    ):
      with self.assertRaisesRegex(ValueError, f"damping must be {bound}"):
        solve()

  def test_diag_transform_keeps_float64(self):
    with jax.enable_x64(True):
      params = jax.tree.map(lambda p: p.astype(jnp.float64), self.params)
      tx = fisher.estimate_fisher_diag(
        self.apply_fn, fisher.Categorical(), kind="exact"
      )
      state = tx.init(params)
      _, state = tx.update(params, state, params, batch=self.batch)
      got = fisher.get_fisher_diag(state)
      self.assertEqual(got["w"].dtype, jnp.float64)


if __name__ == "__main__":
  absltest.main()
