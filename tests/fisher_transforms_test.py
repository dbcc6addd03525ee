# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests of the estimator transforms (``estimate_fisher_diag`` and friends)."""

from __future__ import annotations

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fisher_optax import fisher
from fisher_optax.fisher import validation
from tests import fisher_testing as ft


def _problem(n=6):
  params = ft.mlp_params(jax.random.key(0))
  x, y = ft.make_batch(jax.random.key(1), n, "categorical", jnp.float32)
  return params, x, y


@jax.jit  # Module-level: one compile for every test (same shapes).
def _grads(params, x, y):
  def loss(p, ex):
    return fisher.Categorical().nll(ft.mlp_apply(p, ex[0][None])[0], ex[1])

  return fisher.per_example_grads(loss, params, (x, y))


class EstimateFisherDiagTest(parameterized.TestCase):
  def test_per_example_grads_extra(self):
    params, x, y = _problem()
    g = _grads(params, x, y)
    updates = jax.tree.map(lambda a: jnp.mean(a, 0), g)
    tx = fisher.estimate_fisher_diag()
    state = tx.init(params)
    out, state = jax.jit(tx.update)(
      updates, state, params, per_example_grads=g, unknown_extra=1.0
    )
    chex.assert_trees_all_equal(out, updates)
    chex.assert_trees_all_close(
      fisher.get_fisher_diag(state),
      jax.tree.map(lambda a: jnp.mean(a**2, 0), g),
      rtol=1e-6,
    )
    self.assertEqual(int(state.count), 1)
    self.assertEqual(int(state.num_refreshes), 1)

  def test_batch_extra_in_a_chain(self):
    params, x, y = _problem()
    tx = optax.chain(
      fisher.estimate_fisher_diag(
        ft.mlp_apply, fisher.Categorical(), kind="mc", num_samples=2, key=3
      ),
      optax.sgd(0.1),
    )
    state = tx.init(params)
    step = jax.jit(functools.partial(tx.update))
    _, state = step(params, state, params, batch=(x, y))
    _, key = jax.random.split(jax.random.key(3))  # the first step's key
    ref = jax.jit(
      lambda p, b, k: fisher.diagonal(
        ft.mlp_apply,
        p,
        b,
        likelihood=fisher.Categorical(),
        kind="mc",
        num_samples=2,
        key=k,
      )
    )(params, (x, y), key)
    chex.assert_trees_all_close(
      fisher.get_fisher_diag(state), ref.diag, rtol=1e-5, atol=1e-7
    )

  def test_interval_and_decay(self):
    params, x, y = _problem()
    g1 = _grads(params, x, y)
    g2 = jax.tree.map(lambda a: 2 * a, g1)
    tx = fisher.estimate_fisher_diag(interval=2, decay=0.5)
    state = tx.init(params)
    upd = jax.tree.map(lambda a: a[0], g1)
    step = jax.jit(tx.update)
    _, state = step(upd, state, per_example_grads=g1)  # count 0: refresh
    d1 = fisher.get_fisher_diag(state)
    _, state = step(upd, state, per_example_grads=g2)  # count 1: keep
    chex.assert_trees_all_close(fisher.get_fisher_diag(state), d1)
    _, state = step(upd, state, per_example_grads=g2)  # count 2: EMA
    chex.assert_trees_all_close(
      fisher.get_fisher_diag(state),
      jax.tree.map(lambda d: 2.5 * d, d1),
      rtol=1e-6,
    )
    self.assertEqual(int(state.num_refreshes), 2)

  def test_non_finite_refresh_is_skipped_and_counted(self):
    params, x, y = _problem()
    g = _grads(params, x, y)
    tx = fisher.estimate_fisher_diag()
    state = tx.init(params)
    upd = jax.tree.map(lambda a: a[0], g)
    update = jax.jit(tx.update)  # One compile for both calls.
    _, state = update(upd, state, per_example_grads=g)
    bad = jax.tree.map(lambda a: a.at[0].set(jnp.nan), g)
    _, state2 = update(upd, state, per_example_grads=bad)
    chex.assert_trees_all_equal(
      fisher.get_fisher_diag(state2), fisher.get_fisher_diag(state)
    )
    self.assertEqual(int(state2.notfinite_count), 1)
    with self.assertWarns(validation.FisherOptaxDeprecationWarning):
      self.assertEqual(int(state2.num_nonfinite), 1)  # The old name.
    self.assertEqual(int(state2.num_refreshes), 1)

  def test_init_abstract_and_map_params_and_inject(self):
    params, x, y = _problem()
    tx = fisher.estimate_fisher_diag(
      ft.mlp_apply, fisher.Categorical(), kind="exact"
    )
    abstract = jax.tree.map(
      lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params
    )
    shapes = jax.eval_shape(tx.init, abstract)
    chex.assert_trees_all_equal_shapes_and_dtypes(
      shapes, jax.eval_shape(tx.init, params)
    )
    state = tx.init(params)
    mapped = optax.tree.map_params(tx.init, lambda p: p * 0, state)
    self.assertEqual(jax.tree.structure(mapped), jax.tree.structure(state))
    inj = optax.inject_hyperparams(
      fisher.estimate_fisher_diag,
      static_args=("apply_fn", "likelihood", "kind", "num_samples"),
    )(
      apply_fn=ft.mlp_apply,
      likelihood=fisher.Categorical(),
      kind="exact",
      decay=0.3,
    )
    istate = inj.init(params)
    (_, istate), (_, state) = jax.jit(
      lambda s1, s2, p, b: (  # One compile.
        inj.update(p, s1, p, batch=b),
        tx.update(p, s2, p, batch=b),
      )
    )(istate, state, params, (x, y))
    chex.assert_trees_all_close(
      fisher.get_fisher_diag(istate), fisher.get_fisher_diag(state), rtol=1e-6
    )

  def test_inject_interval_decay_and_seed(self):
    """interval, decay and an int seed become state arrays and still work."""
    params, x, y = _problem()
    g = _grads(params, x, y)
    upd = jax.tree.map(lambda a: jnp.mean(a, 0), g)
    kw = dict(interval=2, decay=0.5, key=3)
    tx = fisher.estimate_fisher_diag(**kw)
    inj = optax.inject_hyperparams(
      fisher.estimate_fisher_diag, static_args=("num_samples",)
    )(**kw)

    @jax.jit  # Both transforms, three steps: one compile.
    def run(s1, s2, g):
      for i in range(3):
        scaled = jax.tree.map(lambda a: a * (i + 1.0), g)
        _, s1 = tx.update(upd, s1, per_example_grads=scaled)
        _, s2 = inj.update(upd, s2, per_example_grads=scaled, unknown=1.0)
      return s1, s2

    s1, s2 = run(tx.init(params), inj.init(params), g)
    self.assertEqual(set(s2.hyperparams), {"interval", "decay", "key"})
    chex.assert_trees_all_close(s2.inner_state, s1, rtol=1e-6)
    self.assertEqual(int(s1.num_refreshes), 2)

  def test_bad_inputs(self):
    params, x, y = _problem()
    g = _grads(params, x, y)
    upd = jax.tree.map(lambda a: a[0], g)
    tx = fisher.estimate_fisher_diag()
    state = tx.init(params)
    with self.assertRaisesRegex(ValueError, "per_example_grads= or batch="):
      tx.update(upd, state)
    with self.assertRaisesRegex(ValueError, "per_example_grads"):
      tx.update(upd, state, per_example_grads={"dense_0": g["dense_0"]})
    with self.assertRaisesRegex(ValueError, "apply_fn"):
      tx.update(upd, state, batch=(x, y))
    with self.assertRaisesRegex(ValueError, "needs params"):
      fisher.estimate_fisher_diag(ft.mlp_apply, fisher.Categorical()).update(
        upd, state, batch=(x, y)
      )
    with self.assertRaisesRegex(ValueError, "needs the model"):
      fisher.estimate_fisher_diag(kind="exact").update(
        upd, state, per_example_grads=g
      )
    with self.assertRaisesRegex(ValueError, "go together"):
      fisher.estimate_fisher_diag(ft.mlp_apply)
    with self.assertRaisesRegex(ValueError, "interval"):
      fisher.estimate_fisher_diag(interval=0)
    for interval in (2.5, True):  # 2.5 refreshed every 5 steps
      with self.assertRaisesRegex(TypeError, "interval"):
        fisher.estimate_fisher_diag(interval=interval)
    with self.assertRaisesRegex(ValueError, "decay"):
      fisher.estimate_fisher_diag(decay=1.5)
    with self.assertRaisesRegex(ValueError, "probabilistic"):
      fisher.estimate_fisher_diag(ft.mlp_apply, lambda o, t: 0.0, kind="exact")
    # Used only with batch=, they were checked at the first such step.
    low_rank = functools.partial(fisher.estimate_fisher_low_rank, rank=2)
    for make in (fisher.estimate_fisher_diag, low_rank):
      with self.assertRaisesRegex(ValueError, "method must be one of"):
        make(method="vmap")
      with self.assertRaisesRegex(ValueError, "chunk_size"):
        make(chunk_size=0)
      with self.assertRaisesRegex(TypeError, "chunk_size"):
        make(chunk_size=2.5)
      # A bad key at construction, not at init or the first step.
      for key in ("x", 1.5, jnp.array([1, 2, 3], jnp.uint32)):
        with self.assertRaisesRegex(TypeError, "key must be"):
          make(key=key)

  def test_model_kinds_take_batch_when_both_extras_come(self):
    # A chain gives every extra to every member: next to a transform that
    # takes per_example_grads, the exact kind uses batch=.
    params, x, y = _problem()
    g = _grads(params, x, y)
    updates = jax.tree.map(lambda a: jnp.mean(a, 0), g)
    # NaN per-example gradients, another member's concern, skip nothing.
    extras = dict(
      batch=(x, y), per_example_grads=jax.tree.map(lambda a: a * jnp.nan, g)
    )
    model = dict(likelihood=fisher.Categorical(), kind="exact")
    for make, read, want in (
      (
        fisher.estimate_fisher_diag,
        fisher.get_fisher_diag,
        lambda: fisher.diagonal(ft.mlp_apply, params, (x, y), **model).diag,
      ),
      (
        functools.partial(fisher.estimate_fisher_low_rank, rank=2),
        lambda s: fisher.get_fisher_low_rank(s)[0],
        lambda: (
          fisher.low_rank(ft.mlp_apply, params, (x, y), rank=2, **model).eigvals
        ),
      ),
    ):
      tx = make(ft.mlp_apply, fisher.Categorical(), kind="exact")
      _, state = tx.update(updates, tx.init(params), params, **extras)
      self.assertEqual(int(state.notfinite_count), 0)
      chex.assert_trees_all_close(read(state), want(), rtol=1e-5, atol=1e-7)


class EstimateFisherShapesTest(absltest.TestCase):
  def test_mismatched_updates_are_refused(self):
    # A scalar leaf would broadcast into the statistic.
    params = {"w": jnp.ones(3)}
    for tx in (
      fisher.estimate_fisher_diag(),
      fisher.estimate_fisher_low_rank(rank=1),
    ):
      state = tx.init(params)
      for bad in (jnp.float32(0.5), jnp.ones((1, 3))):
        with self.assertRaisesRegex(
          ValueError, r"updates\['w'\] has shape .* where init's params"
        ):
          tx.update(
            {"w": bad},
            state,
            params,
            per_example_grads={"w": jnp.stack([bad, bad])},
          )


class EstimateFisherKeyTest(parameterized.TestCase):
  @parameterized.parameters("threefry2x32", "rbg", "unsafe_rbg")
  def test_key_is_copied_and_keeps_its_implementation(self, impl):
    # The state held the caller's key buffer (a donated step deleted it, and
    # two states donated together were one buffer), and keys of another
    # implementation failed the first update (wrapped as threefry).
    params = {"w": jnp.zeros(3)}
    key = jax.random.key(0, impl=impl)
    tx = fisher.estimate_fisher_diag(key=key)
    step = jax.jit(
      lambda s1, s2: (
        tx.update(params, s1, per_example_grads={"w": jnp.ones((2, 3))})[1],
        s2,
      ),
      donate_argnums=(0, 1),
    )
    step(tx.init(params), tx.init(params))
    jax.random.normal(key, (2,))  # still alive

  @parameterized.parameters("diag", "low_rank")
  def test_mc_samples_afresh_at_every_refresh(self, structure):
    # The same batch twice: a key that is not advanced draws the same
    # labels, and the running Fisher never averages over new samples.
    params, x, y = _problem()
    make = {
      "diag": fisher.estimate_fisher_diag,
      "low_rank": functools.partial(fisher.estimate_fisher_low_rank, rank=2),
    }[structure]
    tx = make(
      ft.mlp_apply, fisher.Categorical(), kind="mc", key=jax.random.key(1)
    )
    get = {
      "diag": fisher.get_fisher_diag,
      "low_rank": lambda s: fisher.get_fisher_low_rank(s)[0],
    }[structure]
    step = jax.jit(lambda s: tx.update(params, s, params, batch=(x, y))[1])
    first = step(tx.init(params))
    second = step(first)
    self.assertFalse(
      all(
        bool(jnp.all(a == b))
        for a, b in zip(
          jax.tree.leaves(get(first)), jax.tree.leaves(get(second))
        )
      )
    )

  def test_mc_keys_follow_the_given_implementation(self):
    params, x, y = _problem()
    runs = []
    for impl in ("threefry2x32", "rbg"):
      tx = fisher.estimate_fisher_diag(
        ft.mlp_apply,
        fisher.Categorical(),
        kind="mc",
        key=jax.random.key(0, impl=impl),
      )
      _, state = jax.jit(tx.update)(
        params, tx.init(params), params, batch=(x, y)
      )
      chex.assert_tree_all_finite(state.diag)
      runs.append(state.diag)
    # Different generators, different samples.
    self.assertFalse(
      all(
        bool(jnp.all(a == b))
        for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1]))
      )
    )


class EstimateFisherLowRankTest(absltest.TestCase):
  def test_matches_low_rank_from_grads(self):
    params, x, y = _problem()
    g = _grads(params, x, y)
    tx = fisher.estimate_fisher_low_rank(rank=3)
    state = tx.init(params)
    upd = jax.tree.map(lambda a: jnp.mean(a, 0), g)
    (_, state), ref = jax.jit(
      lambda s, u, g: (  # One compile.
        tx.update(u, s, per_example_grads=g),
        fisher.low_rank_from_grads(g, rank=3),
      )
    )(state, upd, g)
    vals, vecs = fisher.get_fisher_low_rank(state)
    np.testing.assert_allclose(vals, ref.eigvals, rtol=1e-5)
    chex.assert_trees_all_close(vecs, ref.eigvecs, atol=1e-5)
    with self.assertRaisesRegex(TypeError, "rank"):
      fisher.estimate_fisher_low_rank(rank=2.0)

  def test_batch_extra(self):
    params, x, y = _problem()
    tx = fisher.estimate_fisher_low_rank(
      ft.mlp_apply, fisher.Categorical(), rank=2, kind="exact"
    )
    state = tx.init(params)
    (_, state), ref = jax.jit(
      lambda s, p, b: (  # One compile.
        tx.update(p, s, p, batch=b),
        fisher.low_rank(
          ft.mlp_apply,
          p,
          b,
          likelihood=fisher.Categorical(),
          kind="exact",
          rank=2,
        ),
      )
    )(state, params, (x, y))
    np.testing.assert_allclose(state.eigvals, ref.eigvals, rtol=1e-5)

  def test_keeps_float64_under_x64(self):
    with jax.enable_x64(True):
      rng = np.random.default_rng(0)
      g = {"a": rng.normal(size=(5, 4, 3)), "b": rng.normal(size=(5, 2))}
      params = jax.tree.map(lambda a: jnp.zeros(a.shape[1:]), g)
      tx = fisher.estimate_fisher_low_rank(rank=2)
      state = tx.init(params)
      chex.assert_trees_all_equal_dtypes(
        state.eigvecs, jax.tree.map(lambda p: p[None], params)
      )
      upd = jax.tree.map(lambda a: jnp.mean(a, 0), g)
      _, state = tx.update(upd, state, per_example_grads=g)
      # Float64 oracle: eigenpairs of the empirical Fisher (1/N) G^T G.
      flat = np.concatenate([g["a"].reshape(5, -1), g["b"]], axis=1)
      vals, vecs = np.linalg.eigh(flat.T @ flat / 5)
      self.assertEqual(state.eigvals.dtype, jnp.float64)
      np.testing.assert_allclose(state.eigvals, vals[::-1][:2], rtol=1e-12)
      got = np.concatenate(
        [state.eigvecs["a"].reshape(2, -1), state.eigvecs["b"]], axis=1
      )
      overlap = np.abs(np.sum(got * vecs[:, ::-1][:, :2].T, axis=1))
      np.testing.assert_allclose(overlap, 1.0, rtol=1e-12)


if __name__ == "__main__":
  absltest.main()
