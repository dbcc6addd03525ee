# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The documented Flax workflows in Linen form (``fisher_optax.flax.TrainState``).

The same workflows as ``tests/nnx_workflows_test.py``: one ``TrainState``
across tasks (moments kept), named pieces written back with
``fisher_optax.flax.replace_state``, extras forwarded by ``tx_kwargs``.
"""

import functools
import inspect
import pathlib
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import linen as nn
import jax
import jax.numpy as jnp
import optax

import fisher_optax
from fisher_optax import checkpoint
from fisher_optax import fisher
import fisher_optax.flax as fo_flax

_TASKS = 3
_STEPS = 4


class _MLP(nn.Module):
  dropout: float = 0.0

  @nn.compact
  def __call__(self, x, train=False):
    h = jnp.tanh(nn.Dense(6)(x))
    h = nn.Dropout(self.dropout, deterministic=not train)(h)
    return nn.Dense(3)(h)


_NET = _MLP()
_DROP_NET = _MLP(dropout=0.5)


def _ce(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _task(t, n=8):
  x = jax.random.normal(jax.random.key(10 + t), (n, 4))
  y = (jnp.arange(n) + t) % 3
  return x, y


def _state(tx, seed=0, net=_NET):
  params = net.init(jax.random.key(seed), jnp.zeros((1, 4)))
  return fo_flax.TrainState.create(apply_fn=net.apply, params=params, tx=tx)


def _example_loss(p, ex):
  return _ce(_NET.apply(p, ex[0][None]), ex[1][None])


def _per_example(params, x, y):
  return fisher.per_example_grads(_example_loss, params, (x, y))


def _natural_galore(source):
  # Where the window comes from: "batch" or "per_example" (the keyword was
  # window_source with "history" for "batch" before it became fisher_source).
  names = inspect.signature(fisher_optax.natural_galore).parameters
  if "fisher_source" in names:
    kw = {"fisher_source": source}
  else:
    kw = {"window_source": "history" if source == "batch" else source}
  return fisher_optax.natural_galore(1e-2, rank=2, update_proj_gap=2, **kw)


@functools.partial(jax.jit, static_argnames="extras")
def _step(state, x, y, extras=()):
  grads = jax.grad(lambda p: _ce(state.apply_fn(p, x), y))(state.params)
  kw = {}
  if "per_example_grads" in extras:
    kw["per_example_grads"] = _per_example(state.params, x, y)
  if "batch" in extras:
    kw["batch"] = (x, y)
  return state.apply_gradients(grads=grads, tx_kwargs=kw)


class EWCWorkflowTest(absltest.TestCase):
  def test_three_tasks_one_train_state_no_retrace(self):
    tx = optax.chain(fisher_optax.add_ewc_gradient(10.0), optax.adam(1e-2))
    state = _state(tx)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state, x, y):
      grads = jax.grad(lambda p: _ce(state.apply_fn(p, x), y))(state.params)
      return state.apply_gradients(grads=grads)

    anchors = []
    for t in range(_TASKS):
      x, y = _task(t)
      for _ in range(_STEPS):
        state = step(state, x, y)
      stat = fisher.diagonal(
        state.apply_fn,
        state.params,
        (x, y),
        likelihood=fisher.Categorical(),
        kind="exact",
      )
      anchor = fisher_optax.consolidate(
        fo_flax.get_state(state, "ewc_anchor"), state.params, diagonal=stat
      )
      state = fo_flax.replace_state(state, ewc_anchor=anchor)
      anchors.append(anchor)
    chex.assert_trees_all_equal(fo_flax.get_state(state, "ewc_anchor"), anchor)
    adam = fo_flax.get_state(state, "ScaleByAdamState")
    self.assertEqual(int(adam.count), _TASKS * _STEPS)
    self.assertEqual(int(state.step), _TASKS * _STEPS)
    # Precision grows task by task: every task is in the anchor.
    sums = [
      float(sum(jnp.sum(v) for v in jax.tree.leaves(a.diagonal.precision)))
      for a in anchors
    ]
    self.assertEqual(sums, sorted(sums))
    self.assertGreater(sums[-1], sums[0])


class PhysGuardWorkflowTest(absltest.TestCase):
  def test_subspace_accumulates_across_tasks(self):
    max_rank = 6
    state = _state(fisher_optax.physguard(1e-2, max_rank=max_rank), seed=1)
    ranks = []
    for t in range(_TASKS):
      x, y = _task(t, n=4)
      for _ in range(2):
        state = _step(state, x, y)
      sub = fisher_optax.protected_subspace(
        _per_example(state.params, x, y),
        max_rank=max_rank,
        tau=0.999,
        existing=fo_flax.get_state(state, "protected_subspace"),
      )
      state = fo_flax.replace_state(state, protected_subspace=sub)
      ranks.append(int(sub.rank["params"]["Dense_1"]["kernel"]))
    self.assertEqual(ranks, sorted(ranks))
    self.assertGreater(ranks[-1], ranks[0])
    before = state.params["params"]["Dense_1"]["kernel"]
    state = _step(state, *_task(_TASKS))
    update = state.params["params"]["Dense_1"]["kernel"] - before
    basis = sub.bases["params"]["Dense_1"]["kernel"].reshape(max_rank, -1)
    self.assertLess(float(jnp.abs(basis @ update.reshape(-1)).max()), 1e-6)


class EstimatorWorkflowTest(absltest.TestCase):
  def test_estimator_refreshes_inside_train_state(self):
    tx = optax.chain(
      fisher.estimate_fisher_diag(
        _NET.apply, fisher.Categorical(), kind="exact", interval=2
      ),
      optax.sgd(0.5),
    )
    state = _state(tx, seed=2)
    x, y = _task(0)
    expected = []
    for _ in range(3):
      stat = fisher.diagonal(
        _NET.apply,
        state.params,
        (x, y),
        likelihood=fisher.Categorical(),
        kind="exact",
      )
      expected.append(stat.diag)
      state = _step(state, x, y, extras=("batch",))
    chex.assert_trees_all_close(
      fisher.get_fisher_diag(state.opt_state), expected[2], rtol=1e-5
    )
    self.assertEqual(int(fo_flax.get_state(state, "num_refreshes")), 2)
    zeros = jax.tree.map(jnp.zeros_like, expected[0])
    state = fo_flax.replace_state(state, diag=zeros)
    chex.assert_trees_all_equal(fo_flax.get_state(state, "diag"), zeros)


class AccumulateFisherWorkflowTest(absltest.TestCase):
  def test_microbatches_match_the_full_batch_step(self):
    k = 3
    inner = fisher_optax.fadam(0.1, fisher_source="per_example")
    state = _state(fisher_optax.accumulate_fisher(inner, every_k=k), seed=3)
    params = state.params
    x, y = _task(0, n=12)
    for i in range(k):
      sl = slice(4 * i, 4 * i + 4)
      state = _step(state, x[sl], y[sl], extras=("per_example_grads",))
    pex = _per_example(params, x, y)
    grads = jax.tree.map(lambda g: g.mean(0), pex)
    ref, _ = inner.update(
      grads, inner.init(params), params, per_example_grads=pex
    )
    chex.assert_trees_all_close(
      state.params, optax.apply_updates(params, ref), rtol=1e-5, atol=1e-6
    )


class PerExampleDropoutTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("fadam", lambda: fisher_optax.fadam(1e-2, fisher_source="per_example")),
    (
      "fismo",
      lambda: fisher_optax.fismo(
        1e-2, fisher_source="per_example", precondition_interval=2
      ),
    ),
    ("natural_galore", lambda: _natural_galore("per_example")),
  )
  def test_train_state_with_dropout(self, make_tx):
    state = _state(make_tx(), net=_DROP_NET)
    x, y = _task(0)

    def loss(p, ex, key):
      logits = _DROP_NET.apply(
        p, ex[0][None], train=True, rngs={"dropout": key}
      )
      return _ce(logits, ex[1][None])

    @jax.jit
    def step(state, key):
      # Example n draws its own mask from fold_in(key, n), whatever the
      # chunking: the same per-example keys as fisher_optax.flax's NNX helper.
      keys = jax.vmap(lambda n: jax.random.fold_in(key, n))(
        jnp.arange(x.shape[0], dtype=jnp.uint32)
      )
      pex = fisher.per_example_grads(
        lambda p, ex: loss(p, ex[:2], ex[2]), state.params, (x, y, keys)
      )
      grads = jax.tree.map(lambda g: g.mean(0), pex)
      return state.apply_gradients(
        grads=grads, tx_kwargs={"per_example_grads": pex}
      ), pex

    before = state.params
    for i in range(3):
      state, pex = step(state, jax.random.key(i))
    k = pex["params"]["Dense_1"]["kernel"]
    self.assertGreater(float(jnp.abs(k[0] - k[1]).max()), 0.0)
    self.assertTrue(fisher.numerics.tree_all_finite(state.params))
    moved = jax.tree.map(
      lambda a, b: float(jnp.abs(a - b).max()), state.params, before
    )
    self.assertGreater(max(jax.tree.leaves(moved)), 0.0)


_CHECKPOINTED = {
  "ewc": lambda: optax.chain(
    fisher_optax.add_ewc_gradient(1.0), optax.adam(1e-2)
  ),
  "physguard": lambda: fisher_optax.physguard(1e-2, max_rank=2),
  "fismo": lambda: fisher_optax.fismo(1e-2, precondition_interval=2),
  "natural_galore": lambda: _natural_galore("batch"),
}


class CheckpointWorkflowTest(parameterized.TestCase):
  @parameterized.named_parameters(*[(n, n) for n in _CHECKPOINTED])
  def test_resume_follows_the_uninterrupted_run(self, name):
    tx = _CHECKPOINTED[name]()
    x, y = _task(0)
    state = _state(tx)
    for _ in range(2):
      state = _step(state, x, y)
    if name == "ewc":
      ones = jax.tree.map(jnp.ones_like, state.params)
      state = fo_flax.replace_state(
        state,
        ewc_anchor=fisher_optax.consolidate(
          fo_flax.get_state(state, "ewc_anchor"), state.params, diagonal=ones
        ),
      )
    if name == "physguard":
      sub = fisher_optax.protected_subspace(
        _per_example(state.params, x, y), max_rank=2
      )
      state = fo_flax.replace_state(state, protected_subspace=sub)
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "ckpt"
      checkpoint.save(
        path, {"params": state.params, "opt_state": state.opt_state}
      )
      fresh = _state(tx, seed=5)
      restored = checkpoint.restore(
        path,
        {
          "params": jax.eval_shape(lambda: fresh.params),
          "opt_state": jax.eval_shape(tx.init, fresh.params),
        },
      )
    resumed = fresh.replace(step=state.step, **restored)
    for _ in range(2):
      state = _step(state, x, y)
      resumed = _step(resumed, x, y)
    chex.assert_trees_all_close(resumed.params, state.params, atol=1e-7)
    chex.assert_trees_all_close(resumed.opt_state, state.opt_state, atol=1e-7)


if __name__ == "__main__":
  absltest.main()
