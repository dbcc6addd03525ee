# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for the Flax adapters in fisher_optax.flax."""

import subprocess
import sys
import textwrap

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fisher_optax
from fisher_optax import fisher
import fisher_optax.flax as fo_flax


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, 6, rngs=rngs)
    self.bn_count = nnx.BatchStat(jnp.zeros(()))  # a non-Param variable
    self.l2 = nnx.Linear(6, 3, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


def _data(n=8):
  x = jax.random.normal(jax.random.key(0), (n, 4))
  y = jnp.arange(n) % 3
  return x, y


def _ce(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class NNXAdaptersTest(parameterized.TestCase):
  def test_per_example_grads_match_loop_and_optimizer_tree(self):
    model = _Net(nnx.Rngs(0))
    x, y = _data()
    loss = lambda m, ex: _ce(m(ex[0][None]), ex[1][None])
    pex = fo_flax.nnx_per_example_grads(loss, model, (x, y), chunk_size=3)
    grads = nnx.grad(lambda m: _ce(m(x), y))(model)
    pure_grads = nnx.as_pure(nnx.state(grads, nnx.Param))
    self.assertEqual(jax.tree.structure(pex), jax.tree.structure(pure_grads))
    chex.assert_trees_all_close(
      jax.tree.map(lambda g: g.mean(0), pex), pure_grads, atol=1e-6
    )
    for n in (0, 5):
      one = nnx.grad(lambda m: _ce(m(x[n : n + 1]), y[n : n + 1]))(model)
      chex.assert_trees_all_close(
        jax.tree.map(lambda g: g[n], pex),
        nnx.as_pure(nnx.state(one, nnx.Param)),
        atol=1e-6,
      )

  def test_optimizer_update_with_per_example_extra(self):
    model = _Net(nnx.Rngs(0))
    x, y = _data()
    opt = nnx.Optimizer(
      model,
      fisher_optax.fadam(1e-2, fisher_source="per_example"),
      wrt=nnx.Param,
    )
    loss = lambda m, ex: _ce(m(ex[0][None]), ex[1][None])

    @nnx.jit
    def step(model, opt):
      l, grads = nnx.value_and_grad(lambda m: _ce(m(x), y))(model)
      pex = fo_flax.nnx_per_example_grads(loss, model, (x, y))
      opt.update(model, grads, per_example_grads=pex)
      return l

    losses = [float(step(model, opt)) for _ in range(20)]
    self.assertLess(losses[-1], losses[0])

  def test_obj_fn_and_apply_fn(self):
    model = _Net(nnx.Rngs(1))
    x, y = _data()
    obj = fo_flax.nnx_obj_fn(lambda m, a, b: _ce(m(a), b), model, x, y)
    apply_fn, params = fo_flax.nnx_apply_fn(model)
    self.assertAlmostEqual(
      float(obj(params)), float(_ce(model(x), y)), places=6
    )
    chex.assert_trees_all_close(apply_fn(params, x), model(x))
    # The engine's statistics come out in the optimizer's tree.
    stat = fisher.diagonal(
      apply_fn,
      params,
      (x, y),
      likelihood=fisher.Categorical(),
      kind="empirical",
    )
    self.assertEqual(jax.tree.structure(stat.diag), jax.tree.structure(params))
    grads = nnx.as_pure(
      nnx.state(nnx.grad(lambda m: _ce(m(x), y))(model), nnx.Param)
    )
    chex.assert_trees_all_close(stat.mean_grad, grads, atol=1e-6)

  def test_obj_fn_and_apply_fn_on_models_with_mutable_state(self):
    # Dropout's stream and train-mode BatchNorm statistics: the closures
    # work under grad and jit, and the live model is never modified.
    class Net(nnx.Module):
      def __init__(self, rngs):
        self.l1 = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(4, 2, rngs=rngs)

      def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))

    model = Net(nnx.Rngs(0, dropout=1))
    x = jax.random.normal(jax.random.key(2), (6, 3))
    y = jnp.arange(6) % 2
    before = nnx.as_pure(nnx.state(model))
    obj = fo_flax.nnx_obj_fn(lambda m, a, b: _ce(m(a), b), model, x, y)
    apply_fn, params = fo_flax.nnx_apply_fn(model)
    grads = jax.grad(obj)(params)
    chex.assert_tree_all_finite(grads)
    # The same masks at every call: the streams are read, not advanced.
    np.testing.assert_allclose(jax.jit(obj)(params), obj(params), rtol=1e-6)
    self.assertEqual(float(obj(params)), float(obj(params)))
    self.assertEqual(jax.jit(apply_fn)(params, x).shape, (6, 2))
    chex.assert_trees_all_equal(nnx.as_pure(nnx.state(model)), before)

  def test_mask_from_filter(self):
    model = _Net(nnx.Rngs(0))
    mask = fo_flax.nnx_mask(model, nnx.PathContains("kernel"))
    _, params = fo_flax.nnx_apply_fn(model)
    self.assertEqual(jax.tree.structure(mask), jax.tree.structure(params))
    flat = {
      jax.tree_util.keystr(k): v
      for k, v in jax.tree_util.tree_flatten_with_path(mask)[0]
    }
    self.assertTrue(all(v == ("kernel" in k) for k, v in flat.items()))
    # Works where optax takes a mask: only kernels decay.
    tx = optax.add_decayed_weights(1.0, mask=mask)
    upd, _ = tx.update(
      jax.tree.map(jnp.zeros_like, params), tx.init(params), params
    )
    for k, v in jax.tree_util.tree_flatten_with_path(upd)[0]:
      is_kernel = "kernel" in jax.tree_util.keystr(k)
      self.assertEqual(bool(jnp.any(v != 0)), is_kernel)


class _LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(jnp.tanh(nn.Dense(5)(x)))


class LinenAdaptersTest(absltest.TestCase):
  def test_apply_gradients_forwards_extras(self):
    net = _LinenNet()
    x, y = _data()
    params = net.init(jax.random.key(0), x)
    tx = fisher_optax.fadam(1e-2, fisher_source="per_example")
    state = fo_flax.TrainState.create(apply_fn=net.apply, params=params, tx=tx)
    loss = lambda p, ex: _ce(net.apply(p, ex[0][None]), ex[1][None])
    grads = jax.grad(lambda p: _ce(net.apply(p, x), y))(params)
    pex = fisher.per_example_grads(loss, params, (x, y))
    new = state.apply_gradients(
      grads=grads, tx_kwargs={"per_example_grads": pex}
    )
    self.assertEqual(int(new.step), 1)
    # Same as the functional form and as calling tx directly.
    other = fo_flax.apply_gradients(state, grads, per_example_grads=pex)
    chex.assert_trees_all_close(new.params, other.params)
    upd, _ = tx.update(grads, tx.init(params), params, per_example_grads=pex)
    chex.assert_trees_all_close(new.params, optax.apply_updates(params, upd))
    # Flax's own TrainState cannot pass the extra: the transform says so.
    from flax.training import train_state  # pylint: disable=g-import-not-at-top

    plain = train_state.TrainState.create(
      apply_fn=net.apply, params=params, tx=tx
    )
    with self.assertRaisesRegex(ValueError, "per_example_grads"):
      plain.apply_gradients(grads=grads)

  def test_overwrite_with_gradient_params_are_replaced(self):
    # fp8 scales: flax replaces them by their gradients and runs tx on
    # params["params"] only; we took an optimizer step on the scale (SGD)
    # or failed on the tree (FAdam, initialised on params["params"]).
    from flax.training import train_state  # pylint: disable=g-import-not-at-top

    params = {
      "params": {"w": jnp.ones(2)},
      "_overwrite_with_gradient": {"scale": jnp.ones(())},
    }
    grads = {
      "params": {"w": jnp.full(2, 0.5)},
      "_overwrite_with_gradient": {"scale": jnp.full((), 5.0)},
    }
    pex = {
      "params": {"w": jnp.stack([jnp.full(2, 0.25), jnp.full(2, 0.75)])},
      "_overwrite_with_gradient": {"scale": jnp.full((2,), 5.0)},
    }
    for tx, extra in (
      (optax.sgd(0.1), {}),
      (fisher_optax.fadam(1e-2), {}),
      (
        fisher_optax.fadam(1e-2, fisher_source="per_example"),
        {"per_example_grads": pex},
      ),
    ):
      ours = fo_flax.TrainState.create(apply_fn=None, params=params, tx=tx)
      new = ours.apply_gradients(grads=grads, tx_kwargs=extra)
      self.assertEqual(
        float(new.params["_overwrite_with_gradient"]["scale"]), 5.0
      )
      if not extra:  # Flax's own, where it can run the transform.
        flax_new = train_state.TrainState.create(
          apply_fn=None, params=params, tx=tx
        ).apply_gradients(grads=grads)
        chex.assert_trees_all_close(new.params, flax_new.params)


class AccumulateFisherTest(absltest.TestCase):
  def _setup(self):
    w = {"w": jnp.array([[0.5, -1.0], [2.0, 0.3], [0.1, 0.2]])}
    x = jax.random.normal(jax.random.key(3), (12, 3))
    y = jnp.arange(12) % 2
    loss = lambda p, ex: _ce((ex[0] @ p["w"])[None], ex[1][None])
    return w, x, y, loss

  def test_fisher_sees_every_microbatch(self):
    params, x, y, loss = self._setup()
    k, b = 3, 4

    # A spy transform that outputs the Fisher diagonal it is given and keeps
    # its example count as state.
    def spy_update(updates, state, params=None, *, fisher=None, **_):
      del updates, state, params
      return fisher.diag, fisher.count

    spy = optax.GradientTransformationExtraArgs(
      lambda p: jnp.zeros([], jnp.int32), spy_update
    )
    tx = fo_flax.accumulate_fisher(spy, every_k=k)
    state = tx.init(params)
    full_pex = fisher.per_example_grads(loss, params, (x, y))
    for i in range(k):
      pex = jax.tree.map(lambda g, i=i: g[i * b : (i + 1) * b], full_pex)
      grads = jax.tree.map(lambda g: g.mean(0), pex)
      upd, state = tx.update(grads, state, params, per_example_grads=pex)
      if i < k - 1:
        chex.assert_trees_all_equal(upd, jax.tree.map(jnp.zeros_like, grads))
        self.assertEqual(int(state.mini_step), i + 1)
    self.assertEqual(int(state.inner_state), k * b)
    chex.assert_trees_all_close(
      upd, jax.tree.map(lambda g: jnp.mean(g**2, 0), full_pex), rtol=1e-5
    )
    self.assertEqual(int(state.mini_step), 0)

  def test_matches_full_batch_fadam_and_differs_from_multisteps(self):
    params, x, y, loss = self._setup()
    k, b = 3, 4
    inner = lambda: fisher_optax.fadam(0.1, fisher_source="per_example")
    full_pex = fisher.per_example_grads(loss, params, (x, y))
    full_grads = jax.tree.map(lambda g: g.mean(0), full_pex)
    ref, _ = inner().update(
      full_grads, inner().init(params), params, per_example_grads=full_pex
    )
    acc = fo_flax.accumulate_fisher(inner(), every_k=k)
    multi = optax.MultiSteps(inner(), every_k_schedule=k)
    s_acc, s_multi = acc.init(params), multi.init(params)
    for i in range(k):
      pex = jax.tree.map(lambda g, i=i: g[i * b : (i + 1) * b], full_pex)
      grads = jax.tree.map(lambda g: g.mean(0), pex)
      u_acc, s_acc = acc.update(grads, s_acc, params, per_example_grads=pex)
      u_multi, s_multi = multi.update(
        grads, s_multi, params, per_example_grads=pex
      )
    chex.assert_trees_all_close(u_acc, ref, rtol=1e-5, atol=1e-7)
    # optax.MultiSteps hands only the last micro-batch's extras to the inner
    # transform, so its Fisher (and hence its step) differs.
    self.assertGreater(float(jnp.max(jnp.abs(u_multi["w"] - ref["w"]))), 1e-4)

  def test_core_export_is_the_adapter_and_needs_no_flax(self):
    self.assertIs(fisher_optax.accumulate_fisher, fo_flax.accumulate_fisher)
    self.assertIs(
      fisher_optax.AccumulateFisherState, fo_flax.AccumulateFisherState
    )
    # In a process where flax cannot be imported, the core one still steps.
    script = textwrap.dedent("""
      import sys
      sys.modules["flax"] = None  # any `import flax` now fails
      import jax.numpy as jnp
      import optax
      import fisher_optax
      tx = fisher_optax.accumulate_fisher(optax.sgd(1.0), every_k=2)
      params = {"w": jnp.ones(3)}
      state = tx.init(params)
      pex = {"w": jnp.arange(6.0).reshape(2, 3)}
      grads = {"w": pex["w"].mean(0)}
      for _ in range(2):
        u, state = tx.update(grads, state, params, per_example_grads=pex)
      assert "flax" not in [m.split(".")[0] for m in sys.modules if sys.modules[m]]
      print(u["w"].tolist(), int(state.count))
    """)
    proc = subprocess.run(
      [sys.executable, "-c", script],
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
    )
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    self.assertEqual(proc.stdout.split(), ["[-1.5,", "-2.5,", "-3.5]", "0"])

  def test_overflow_on_the_last_micro_batch_keeps_the_window(self):
    # Each square (2.25e38) fits float32, two summed do not: the second
    # micro-batch is skipped (counted) and the first stays folded in, also
    # when the second would have completed the window.
    params = {"w": jnp.ones(3)}
    pex = {"w": jnp.full((1, 3), 1.5e19)}
    grads = {"w": pex["w"][0]}
    for every_k in (2, 3):
      with self.subTest(every_k=every_k):
        tx = fo_flax.accumulate_fisher(
          fisher_optax.fadam(0.1, fisher_source="per_example"), every_k
        )
        state = tx.init(params)
        _, state = tx.update(grads, state, params, per_example_grads=pex)
        _, after = tx.update(grads, state, params, per_example_grads=pex)
        self.assertEqual(int(after.mini_step), 1)
        self.assertEqual(int(after.notfinite_count), 1)
        chex.assert_trees_all_equal(after.sq_sum, state.sq_sum)
        chex.assert_trees_all_equal(after.inner_state, state.inner_state)

  def test_errors(self):
    params, _, _, _ = self._setup()
    with self.assertRaisesRegex(ValueError, "every_k"):
      fo_flax.accumulate_fisher(optax.sgd(1.0), every_k=0)
    with self.assertRaisesRegex(TypeError, "every_k"):
      fo_flax.accumulate_fisher(optax.sgd(1.0), every_k=2.0)
    # NumPy integers are ints (as optax.MultiSteps takes them).
    fo_flax.accumulate_fisher(optax.sgd(1.0), every_k=np.int64(2))
    tx = fo_flax.accumulate_fisher(optax.sgd(1.0), every_k=2)
    with self.assertRaisesRegex(ValueError, "per_example_grads"):
      tx.update(params, tx.init(params), params)
    bad = {"w": jnp.zeros((4, 2, 2))}
    with self.assertRaisesRegex(ValueError, "shape"):
      tx.update(params, tx.init(params), params, per_example_grads=bad)
    # An empty micro-batch counted towards every_k and halved the gradient.
    with self.assertRaisesRegex(ValueError, "empty batch axis"):
      tx.update(
        params,
        tx.init(params),
        params,
        per_example_grads={"w": jnp.zeros((0, 3, 2))},
      )

  def test_micro_batches_of_different_sizes(self):
    # The gradient and the statistic's mean_grad are the mean over every
    # example, as its diag is: mean_grad was a mean of micro-batch means.
    params, x, y, loss = self._setup()
    full_pex = fisher.per_example_grads(loss, params, (x, y))
    want = jax.tree.map(lambda g: g.mean(0), full_pex)
    # Spies that output the gradient, or the statistic's mean_grad.
    for out in (lambda u, f: u, lambda u, f: f.mean_grad):
      spy = optax.GradientTransformationExtraArgs(
        lambda p: (),
        lambda u, s, p=None, *, fisher=None, out=out, **_: (out(u, fisher), s),
      )
      tx = fo_flax.accumulate_fisher(spy, every_k=3)
      state = tx.init(params)
      for lo, hi in ((0, 1), (1, 2), (2, 12)):
        pex = jax.tree.map(lambda g, lo=lo, hi=hi: g[lo:hi], full_pex)
        grads = jax.tree.map(lambda g: g.mean(0), pex)
        upd, state = tx.update(grads, state, params, per_example_grads=pex)
      chex.assert_trees_all_close(upd, want, rtol=1e-5)

  def test_float64_sums_under_x64(self):
    with jax.enable_x64(True):
      params = {"w": jnp.zeros(3, jnp.float64)}
      tx = fo_flax.accumulate_fisher(optax.sgd(1.0), every_k=2)
      state = tx.init(params)
      self.assertEqual(state.grad_sum["w"].dtype, jnp.float64)
      g1 = jnp.array([1.0 + 1e-12, 1.0 / 3, 1e-9], jnp.float64)
      g2 = jnp.array([1.0, 2.0 / 3, 1e-9], jnp.float64)
      for g in (g1, g2):
        u, state = tx.update(
          {"w": g}, state, params, per_example_grads={"w": g[None]}
        )
      np.testing.assert_allclose(u["w"], -(g1 + g2) / 2, rtol=1e-15)


if __name__ == "__main__":
  absltest.main()
