# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The documented Flax workflows, written in NNX the way a user writes them.

Each runs in one ``nnx.Optimizer`` (moments kept across tasks) and is checked
against the same workflow on a plain optax state where that is meaningful.
``tests/linen_workflows_test.py`` has the same workflows in Linen form.
"""

import inspect
import pathlib
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import optax

import fisher_optax
from fisher_optax import checkpoint
from fisher_optax import fisher
import fisher_optax.flax as fo_flax

_TASKS = 3
_STEPS = 4


class _MLP(nnx.Module):
  def __init__(self, rngs, dropout=0.0):
    self.l1 = nnx.Linear(4, 6, rngs=rngs)
    self.drop = nnx.Dropout(dropout, rngs=rngs)
    self.l2 = nnx.Linear(6, 3, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(jnp.tanh(self.l1(x))))


def _ce(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _task(t, n=8):
  x = jax.random.normal(jax.random.key(10 + t), (n, 4))
  y = (jnp.arange(n) + t) % 3
  return x, y


def _example_loss(m, ex):
  return _ce(m(ex[0][None]), ex[1][None])


def _natural_galore(source):
  # Where the window comes from: "batch" or "per_example" (the keyword was
  # window_source with "history" for "batch" before it became fisher_source).
  names = inspect.signature(fisher_optax.natural_galore).parameters
  if "fisher_source" in names:
    kw = {"fisher_source": source}
  else:
    kw = {"window_source": "history" if source == "batch" else source}
  return fisher_optax.natural_galore(1e-2, rank=2, update_proj_gap=2, **kw)


def _pure_params(model):
  return nnx.as_pure(nnx.state(model, nnx.Param))


class StateAccessTest(absltest.TestCase):
  """get_state / replace_state on an nnx.Optimizer."""

  def _opt(self):
    model = _MLP(nnx.Rngs(0))
    tx = optax.chain(fisher_optax.add_ewc_gradient(1.0), optax.adam(1e-2))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  def test_optax_tree_set_breaks_the_next_step_replace_state_does_not(self):
    model, opt = self._opt()
    x, y = _task(0)
    grads = nnx.grad(lambda m: _ce(m(x), y))(model)
    anchor = fisher_optax.consolidate(
      fo_flax.get_state(opt, "ewc_anchor"),
      nnx.state(model, nnx.Param),  # the NNX view (variables) directly
      diagonal=jax.tree.map(jnp.ones_like, _pure_params(model)),
    )
    broken = nnx.Optimizer(model, opt.tx, wrt=nnx.Param)
    broken.opt_state = optax.tree.set(broken.opt_state, ewc_anchor=anchor)
    with self.assertRaisesRegex(ValueError, "immutable"):
      broken.update(model, grads)
    self.assertIs(fo_flax.replace_state(opt, ewc_anchor=anchor), opt)
    opt.update(model, grads)
    chex.assert_trees_all_equal(fo_flax.get_state(opt, "ewc_anchor"), anchor)
    self.assertEqual(int(fo_flax.get_state(opt, "ScaleByAdamState").count), 1)

  def test_inside_nnx_jit(self):
    _, opt = self._opt()
    anchor = fo_flax.get_state(opt, "ewc_anchor")
    new = jax.tree.map(lambda a: a + 1.0, anchor)

    @nnx.jit
    def write(opt, new):
      fo_flax.replace_state(opt, ewc_anchor=new)

    write(opt, new)
    chex.assert_trees_all_equal(fo_flax.get_state(opt, "ewc_anchor"), new)

  def test_errors(self):
    model, opt = self._opt()
    anchor = fo_flax.get_state(opt, "ewc_anchor")
    with self.assertRaisesRegex(KeyError, "no_such"):
      fo_flax.get_state(opt, "no_such")
    with self.assertRaisesRegex(KeyError, "2 pieces named 'count'"):
      fo_flax.get_state(opt, "count")
    wrong_shape = jax.tree.map(lambda a: jnp.zeros((1,) + a.shape), anchor)
    with self.assertRaisesRegex(ValueError, "shape"):
      fo_flax.replace_state(opt, ewc_anchor=wrong_shape)
    wrong_dtype = jax.tree.map(lambda a: a.astype(jnp.float16), anchor)
    with self.assertRaisesRegex(ValueError, "dtype"):
      fo_flax.replace_state(opt, ewc_anchor=wrong_dtype)
    with self.assertRaisesRegex(ValueError, "structure"):
      fo_flax.replace_state(opt, ewc_anchor=anchor.diagonal)
    # A plain dict with the same keys is fine: it takes nnx.State's place.
    as_dict = anchor._replace(
      diagonal=anchor.diagonal._replace(
        precision=nnx.to_pure_dict(anchor.diagonal.precision)
      )
    )
    fo_flax.replace_state(opt, ewc_anchor=as_dict)
    self.assertIsInstance(
      fo_flax.get_state(opt, "ewc_anchor").diagonal.precision, nnx.State
    )
    del model


class EWCWorkflowTest(absltest.TestCase):
  def test_three_tasks_one_optimizer_no_retrace(self):
    strength = 10.0
    tx = optax.chain(fisher_optax.add_ewc_gradient(strength), optax.adam(1e-2))
    model = _MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    # The same workflow on a plain optax state, as the reference.
    params = _pure_params(model)
    state = tx.init(params)
    traces = []

    @nnx.jit
    def nnx_step(model, opt, x, y):
      traces.append("nnx")
      grads = nnx.grad(lambda m: _ce(m(x), y))(model)
      opt.update(model, grads)

    @jax.jit
    def plain_step(params, state, x, y):
      traces.append("plain")
      apply_fn, _ = fo_flax.nnx_apply_fn(model)
      grads = jax.grad(lambda p: _ce(apply_fn(p, x), y))(params)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    for t in range(_TASKS):
      x, y = _task(t)
      for _ in range(_STEPS):
        nnx_step(model, opt, x, y)
        params, state = plain_step(params, state, x, y)
      chex.assert_trees_all_close(_pure_params(model), params, atol=1e-6)
      # End of task t: fold its Fisher into the anchor, in place.
      apply_fn, theta = fo_flax.nnx_apply_fn(model)
      stat = fisher.diagonal(
        apply_fn, theta, (x, y), likelihood=fisher.Categorical(), kind="exact"
      )
      anchor = fisher_optax.consolidate(
        fo_flax.get_state(opt, "ewc_anchor"), theta, diagonal=stat
      )
      fo_flax.replace_state(opt, ewc_anchor=anchor)
      state = fo_flax.replace_state(
        state,
        ewc_anchor=fisher_optax.consolidate(
          fo_flax.get_state(state, "ewc_anchor"), params, diagonal=stat
        ),
      )
    self.assertEqual(traces.count("nnx"), 1)
    self.assertEqual(traces.count("plain"), 1)
    # Adam's moments and count were kept across the three tasks.
    adam = fo_flax.get_state(opt, "ScaleByAdamState")
    self.assertEqual(int(adam.count), _TASKS * _STEPS)
    chex.assert_trees_all_close(
      adam, fo_flax.get_state(state, "ScaleByAdamState"), atol=1e-6
    )
    # The anchor holds all three tasks (precision is their Fisher sum).
    prec = fo_flax.get_state(opt, "ewc_anchor").diagonal.precision
    self.assertGreater(float(jnp.sum(prec["l2"]["kernel"])), 0.0)
    # The penalty pulls back: its gradient is in the next update.
    moved = jax.tree.map(lambda p: p + 0.1, _pure_params(model))
    pull = fisher_optax.ewc_gradient(
      moved, fo_flax.get_state(opt, "ewc_anchor")
    )
    self.assertGreater(float(jnp.abs(pull["l2"]["kernel"]).max()), 0.0)


class PhysGuardWorkflowTest(absltest.TestCase):
  def test_subspace_accumulates_across_tasks(self):
    max_rank = 6
    model = _MLP(nnx.Rngs(1))
    opt = nnx.Optimizer(
      model, fisher_optax.physguard(1e-2, max_rank=max_rank), wrt=nnx.Param
    )

    @nnx.jit
    def step(model, opt, x, y):
      grads = nnx.grad(lambda m: _ce(m(x), y))(model)
      return opt.update(model, grads)

    ranks = []
    for t in range(_TASKS):
      x, y = _task(t, n=4)
      for _ in range(2):
        step(model, opt, x, y)
      g = fo_flax.nnx_per_example_grads(_example_loss, model, (x, y))
      sub = fisher_optax.protected_subspace(
        g,
        max_rank=max_rank,
        tau=0.999,
        existing=fo_flax.get_state(opt, "protected_subspace"),
      )
      fo_flax.replace_state(opt, protected_subspace=sub)
      ranks.append(int(sub.rank["l2"]["kernel"]))
    self.assertEqual(ranks, sorted(ranks))
    self.assertGreater(ranks[-1], ranks[0])
    # The next update has no component in the protected directions.
    sub = fo_flax.get_state(opt, "protected_subspace")
    updates = step(model, opt, *_task(_TASKS))
    basis = sub.bases["l2"]["kernel"].reshape(max_rank, -1)
    proj = basis @ updates["l2"]["kernel"].reshape(-1)
    self.assertLess(float(jnp.abs(proj).max()), 1e-6)

  def test_subspace_given_at_construction(self):
    # nnx.Optimizer's init passes NNX variables, which the subspace check
    # compared against as they were (a ValueError on the library's own
    # protected_subspace).
    model = _MLP(nnx.Rngs(1))
    x, y = _task(0, n=4)
    g = fo_flax.nnx_per_example_grads(_example_loss, model, (x, y))
    sub = fisher_optax.protected_subspace(g, max_rank=2)
    for tx in (
      fisher_optax.physguard(1e-2, max_rank=2, subspace=sub),
      fisher_optax.project_out_subspace(max_rank=2, subspace=sub),
    ):
      opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
      chex.assert_trees_all_equal(
        fo_flax.get_state(opt, "protected_subspace").bases, sub.bases
      )

  def test_subspace_from_gradients_of_a_split_state(self):
    # jax.grad of an nnx.split state gives gradients that hold variables;
    # the subspace built from them has array bases, as the adapter's.
    model = _MLP(nnx.Rngs(1))
    x, y = _task(0, n=4)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = lambda p, ex: _example_loss(nnx.merge(graphdef, p, rest), ex)
    g = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, (x, y))
    sub = fisher_optax.protected_subspace(g, max_rank=2)
    want = fisher_optax.protected_subspace(
      fo_flax.nnx_per_example_grads(_example_loss, model, (x, y)), max_rank=2
    )
    chex.assert_trees_all_close(sub.bases, want.bases, rtol=1e-5, atol=1e-6)
    opt = nnx.Optimizer(
      model,
      fisher_optax.physguard(1e-2, max_rank=2, subspace=sub),
      wrt=nnx.Param,
    )
    chex.assert_trees_all_equal(
      fo_flax.get_state(opt, "protected_subspace").bases, sub.bases
    )


class DimensionNumbersCallableTest(parameterized.TestCase):
  """A routing callable sees the same paths at init (where nnx.Optimizer
  passes NNX variables, "['kernel'].value") as at every update."""

  @parameterized.named_parameters(
    (
      "fismo",
      "fismo_weight_dimension_numbers",
      optax.contrib.MuonDimensionNumbers(),
    ),
    (
      "natural_galore",
      "weight_dimension_numbers",
      optax.contrib.GaLoreDimensionNumbers(0, 1),
    ),
  )
  def test_path_based_callable(self, keyword, numbers):
    def by_path(params):
      return jax.tree_util.tree_map_with_path(
        lambda path, _: (
          numbers if jax.tree_util.keystr(path).endswith("['kernel']") else None
        ),
        params,
      )

    if keyword == "fismo_weight_dimension_numbers":
      tx = fisher_optax.fismo(1e-2, **{keyword: by_path})
    else:
      tx = fisher_optax.natural_galore(1e-2, rank=2, **{keyword: by_path})
    model = _MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x, y = _task(0)
    grads = nnx.grad(lambda m: _ce(m(x), y))(model)
    opt.update(model, grads)  # a state built for other leaves was refused
    chex.assert_tree_all_finite(nnx.state(model, nnx.Param))


class EstimatorWorkflowTest(absltest.TestCase):
  def test_estimator_refreshes_inside_optimizer(self):
    model = _MLP(nnx.Rngs(2))
    apply_fn, _ = fo_flax.nnx_apply_fn(model)
    tx = optax.chain(
      fisher.estimate_fisher_diag(
        apply_fn, fisher.Categorical(), kind="exact", interval=2
      ),
      optax.sgd(0.5),
    )
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x, y = _task(0)

    @nnx.jit
    def step(model, opt):
      grads = nnx.grad(lambda m: _ce(m(x), y))(model)
      opt.update(model, grads, batch=(x, y))

    expected = []
    for _ in range(3):
      stat = fisher.diagonal(
        apply_fn,
        _pure_params(model),
        (x, y),
        likelihood=fisher.Categorical(),
        kind="exact",
      )
      expected.append(stat.diag)
      step(model, opt)
    # Refreshed at steps 0 and 2 (interval 2), not at step 1.
    diag = fisher.get_fisher_diag(nnx.as_pure(opt.opt_state))
    chex.assert_trees_all_close(diag, expected[2], rtol=1e-5)
    self.assertEqual(int(fo_flax.get_state(opt, "num_refreshes")), 2)
    self.assertGreater(
      float(
        jnp.abs(expected[2]["l1"]["kernel"] - expected[0]["l1"]["kernel"]).max()
      ),
      0.0,
    )
    # The statistic is readable and replaceable like any named piece.
    zeros = jax.tree.map(jnp.zeros_like, diag)
    fo_flax.replace_state(opt, diag=zeros)
    chex.assert_trees_all_equal(fo_flax.get_state(opt, "diag"), zeros)


class AccumulateFisherWorkflowTest(absltest.TestCase):
  def test_microbatches_match_the_full_batch_step(self):
    k = 3
    model = _MLP(nnx.Rngs(3))
    params = _pure_params(model)
    inner = fisher_optax.fadam(0.1, fisher_source="per_example")
    opt = nnx.Optimizer(
      model, fisher_optax.accumulate_fisher(inner, every_k=k), wrt=nnx.Param
    )
    x, y = _task(0, n=12)

    @nnx.jit
    def step(model, opt, xb, yb):
      grads = nnx.grad(lambda m: _ce(m(xb), yb))(model)
      pex = fo_flax.nnx_per_example_grads(_example_loss, model, (xb, yb))
      opt.update(model, grads, per_example_grads=pex)

    for i in range(k):
      step(model, opt, x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4])
    apply_fn, _ = fo_flax.nnx_apply_fn(model)
    full_pex = fisher.per_example_grads(
      lambda p, ex: _ce(apply_fn(p, ex[0][None]), ex[1][None]), params, (x, y)
    )
    full_grads = jax.tree.map(lambda g: g.mean(0), full_pex)
    ref, _ = inner.update(
      full_grads, inner.init(params), params, per_example_grads=full_pex
    )
    chex.assert_trees_all_close(
      _pure_params(model),
      optax.apply_updates(params, ref),
      rtol=1e-5,
      atol=1e-6,
    )


class PerExampleDropoutTest(parameterized.TestCase):
  def test_per_example_grads_are_deterministic_per_example(self):
    model = _MLP(nnx.Rngs(0, dropout=1), dropout=0.5)
    x = jnp.ones((4, 4))  # identical inputs: only the masks differ
    y = jnp.zeros(4, jnp.int32)
    full = fo_flax.nnx_per_example_grads(_example_loss, model, (x, y))
    chunked = fo_flax.nnx_per_example_grads(
      _example_loss, model, (x, y), chunk_size=3
    )
    again = fo_flax.nnx_per_example_grads(_example_loss, model, (x, y))
    chex.assert_trees_all_close(full, chunked, atol=1e-6)
    chex.assert_trees_all_equal(full, again)
    k = full["l2"]["kernel"]
    self.assertGreater(float(jnp.abs(k[0] - k[1]).max()), 0.0)
    # Example n alone, with n folded into the model's dropout key.
    graphdef, *parts = nnx.split(model, nnx.Param, nnx.RngKey, ...)
    params, keys, rest = nnx.as_pure(tuple(parts))
    for n in (0, 3):
      own = jax.tree.map(lambda key, n=n: jax.random.fold_in(key, n), keys)
      one = lambda p, n=n, own=own: _example_loss(
        nnx.merge(graphdef, p, own, rest), (x[n], y[n])
      )
      chex.assert_trees_all_close(
        jax.tree.map(lambda a, n=n: a[n], full),
        jax.grad(one)(params),
        atol=1e-6,
      )
    # The model itself is not modified (its streams did not advance).
    self.assertEqual(int(model.drop.rngs.count[...]), 0)

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
  def test_optimizer_with_dropout_model(self, make_tx):
    model = _MLP(nnx.Rngs(0, dropout=1), dropout=0.2)
    opt = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
    x, y = _task(0)

    @nnx.jit
    def step(model, opt):
      loss, grads = nnx.value_and_grad(lambda m: _ce(m(x), y))(model)
      pex = fo_flax.nnx_per_example_grads(_example_loss, model, (x, y))
      opt.update(model, grads, per_example_grads=pex)
      return loss

    before = _pure_params(model)
    for _ in range(3):
      self.assertTrue(bool(jnp.isfinite(step(model, opt))))
    after = _pure_params(model)
    self.assertTrue(fisher.numerics.tree_all_finite(after))
    self.assertGreater(
      float(jnp.abs(after["l1"]["kernel"] - before["l1"]["kernel"]).max()), 0.0
    )


_CHECKPOINTED = {
  "fadam": (lambda: fisher_optax.fadam(1e-2), ()),
  "fadam_per_example": (
    lambda: fisher_optax.fadam(1e-2, fisher_source="per_example"),
    ("per_example_grads",),
  ),
  "fismo": (lambda: fisher_optax.fismo(1e-2, precondition_interval=2), ()),
  "natural_galore": (lambda: _natural_galore("batch"), ()),
  "mfac": (lambda: fisher_optax.mfac(1e-2, window_size=2, damping=1.0), ()),
  "ewc": (
    lambda: optax.chain(
      fisher_optax.add_ewc_gradient(1.0, rank=1), optax.adam(1e-2)
    ),
    (),
  ),
  "physguard": (lambda: fisher_optax.physguard(1e-2, max_rank=2), ()),
  "estimate_fisher_diag": (
    lambda: optax.chain(
      fisher.estimate_fisher_diag(kind="empirical", interval=2),
      optax.sgd(0.1),
    ),
    ("per_example_grads",),
  ),
  "estimate_fisher_low_rank": (
    lambda: optax.chain(
      fisher.estimate_fisher_low_rank(rank=2, kind="empirical"),
      optax.sgd(0.1),
    ),
    ("per_example_grads",),
  ),
  "accumulate_fisher": (
    lambda: fisher_optax.accumulate_fisher(
      fisher_optax.fadam(1e-2, fisher_source="per_example"), every_k=2
    ),
    ("per_example_grads",),
  ),
}


class CheckpointWorkflowTest(parameterized.TestCase):
  @parameterized.named_parameters(*[(n, n) for n in _CHECKPOINTED])
  def test_resume_follows_the_uninterrupted_run(self, name):
    make_tx, extras = _CHECKPOINTED[name]
    tx = make_tx()
    x, y = _task(0)

    @nnx.jit
    def step(model, opt):
      grads = nnx.grad(lambda m: _ce(m(x), y))(model)
      kw = {}
      if extras:
        kw["per_example_grads"] = fo_flax.nnx_per_example_grads(
          _example_loss, model, (x, y)
        )
      opt.update(model, grads, **kw)

    model = _MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for _ in range(2):
      step(model, opt)
    if name == "ewc":  # a consolidated anchor, written in place
      theta = _pure_params(model)
      g = jax.tree.map(lambda p: p[None], theta)
      anchor = fisher_optax.consolidate(
        fo_flax.get_state(opt, "ewc_anchor"),
        theta,
        diagonal=jax.tree.map(jnp.ones_like, theta),
        low_rank=(jnp.ones(1), g),
      )
      fo_flax.replace_state(opt, ewc_anchor=anchor)
    if name == "physguard":
      g = fo_flax.nnx_per_example_grads(_example_loss, model, (x, y))
      fo_flax.replace_state(
        opt, protected_subspace=fisher_optax.protected_subspace(g, max_rank=2)
      )
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "ckpt"
      checkpoint.save(
        path,
        {
          "model": nnx.as_pure(nnx.state(model)),
          "opt": nnx.as_pure(nnx.state(opt)),
        },
      )
      # A fresh process rebuilds the model and optimizer (the same tx).
      model2 = _MLP(nnx.Rngs(5))
      opt2 = nnx.Optimizer(model2, tx, wrt=nnx.Param)
      target = {
        "model": nnx.as_pure(nnx.state(model2)),
        "opt": nnx.as_pure(nnx.state(opt2)),
      }
      restored = checkpoint.restore(path, target)
    nnx.update(model2, restored["model"])
    nnx.update(opt2, restored["opt"])
    for _ in range(2):
      step(model, opt)
      step(model2, opt2)
    chex.assert_trees_all_close(
      nnx.as_pure(nnx.state(opt2)), nnx.as_pure(nnx.state(opt)), atol=1e-7
    )
    chex.assert_trees_all_close(
      _pure_params(model2), _pure_params(model), atol=1e-7
    )


if __name__ == "__main__":
  absltest.main()
