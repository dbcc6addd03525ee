# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for FAdam (fisher_optax._fadam)."""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fisher_optax
from fisher_optax.fisher import validation
from tests import nonfinite_testing

# -- a float64 NumPy re-implementation of the rule in scale_by_fadam ----------


def _rms(x: np.ndarray) -> float:
  return float(np.sqrt(np.mean(np.square(x))))


def numpy_fadam(
  theta0,
  grads_seq,
  *,
  lr,
  b1,
  b2,
  eps,
  eps2,
  clip,
  p,
  weight_decay,
  eps_mode="paper",
  decay=None,
  fisher_seq=None,
):
  """Runs the FAdam rule in float64; returns params after every step, flags.

  ``fisher_seq[t][i]`` replaces g^2 of leaf i at step t (per-example Fisher);
  ``decay[i]`` False turns the decay off for leaf i.
  """
  theta = [np.array(x, np.float64) for x in theta0]
  m = [np.zeros_like(x) for x in theta]
  f = [np.zeros_like(x) for x in theta]
  decay = decay or [True] * len(theta)
  traj, flags = (
    [],
    {
      "n_clip": 0,
      "n_free": 0,
      "w_clip": 0,
      "w_free": 0,
      "eps2_branch": 0,
      "zero_leaf": 0,
    },
  )
  for t, grads in enumerate(grads_seq, start=1):
    b2_hat = b2 * (1.0 - b2 ** (t - 1)) / (1.0 - b2**t)
    for i, g in enumerate(grads):
      g = np.asarray(g, np.float64)
      sq = g**2 if fisher_seq is None else np.asarray(fisher_seq[t - 1][i])
      f[i] = b2_hat * f[i] + (1.0 - b2_hat) * sq
      rms_g = _rms(g)
      if rms_g == 0.0:
        eps_hat = eps
        flags["zero_leaf"] += 1
      elif eps_mode == "paper":
        eps_hat = min(eps, eps2 * rms_g)
        flags["eps2_branch"] += eps2 * rms_g < eps
      else:
        eps_hat = eps * min(1.0, rms_g)
      eps_term = eps_hat ** (2 * p) if eps_mode == "paper" else eps_hat
      d = f[i] ** p + eps_term
      n = g / d
      flags["n_clip" if _rms(n) > clip else "n_free"] += 1
      n = n / max(1.0, _rms(n) / clip)
      m[i] = b1 * m[i] + (1.0 - b1) * n
      step = m[i].copy()
      if decay[i]:
        w = theta[i] / d
        flags["w_clip" if _rms(w) > clip else "w_free"] += 1
        w = w / max(1.0, _rms(w) / clip)
        step = step + weight_decay * w
      theta[i] = theta[i] - lr * step
    traj.append([x.copy() for x in theta])
  return traj, flags


def _problem(num_steps: int = 28, seed: int = 0):
  """Gradients with spikes, always-zero entries, a zero leaf, tiny leaves."""
  rng = np.random.default_rng(seed)
  theta0 = [
    rng.normal(size=(4, 5)),
    rng.normal(size=(6,)),
    rng.normal(size=(3,)),
  ]
  grads_seq = []
  for t in range(1, num_steps + 1):
    a = rng.normal(size=(4, 5)) * 0.3
    a[:, 2] = 0.0  # Entries that never see a gradient: zero Fisher.
    if t in (7, 19):
      a[1, 1] *= 300.0  # Spike.
    b = rng.normal(size=(6,)) * 1e-3  # Small: eps2 * RMS(g) < eps.
    if t in (1, 12):
      b[:] = 0.0  # The whole leaf's gradient is zero.
    c = rng.normal(size=(3,)) * (50.0 if t == 15 else 1.0)
    grads_seq.append([a, b, c])
  return theta0, grads_seq


_HPARAMS = dict(lr=0.05, b1=0.9, b2=0.95, eps=1e-3, eps2=1e-2, weight_decay=0.1)


def _run_fadam(tx, theta0, grads_seq, dtype, extras_seq=None):
  params = [jnp.asarray(x, dtype) for x in theta0]
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads, extras):
    updates, state = tx.update(grads, state, params, **extras)
    return optax.apply_updates(params, updates), state

  traj = []
  for t, grads in enumerate(grads_seq):
    extras = extras_seq[t] if extras_seq else {}
    params, state = step(
      params, state, [jnp.asarray(g, dtype) for g in grads], extras
    )
    traj.append([np.asarray(x, np.float64) for x in params])
  return traj, state


class FAdamOracleTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("p075_clip07", 0.75, 0.7, "paper"),
    ("p1_clip25", 1.0, 2.5, "paper"),
    ("v3_p05_clip15", 0.5, 1.5, "v3"),
  )
  def test_matches_numpy_float64(self, p, clip, eps_mode):
    theta0, grads_seq = _problem()
    expected, flags = numpy_fadam(
      theta0, grads_seq, clip=clip, p=p, eps_mode=eps_mode, **_HPARAMS
    )
    # The trajectory must exercise every branch of the rule.
    self.assertGreater(flags["n_clip"], 0)
    self.assertGreater(flags["n_free"], 0)
    self.assertGreater(flags["w_clip"], 0)
    self.assertGreater(flags["w_free"], 0)
    self.assertEqual(flags["zero_leaf"], 2)
    if eps_mode == "paper":
      self.assertGreater(flags["eps2_branch"], 0)
    hp = dict(_HPARAMS)
    lr = hp.pop("lr")
    with jax.enable_x64(True):
      tx = fisher_optax.fadam(lr, clip=clip, p=p, eps_mode=eps_mode, **hp)
      got, state = _run_fadam(tx, theta0, grads_seq, jnp.float64)
      self.assertEqual(int(state[0].count), len(grads_seq))
    for t, (g, e) in enumerate(zip(got, expected)):
      for leaf_g, leaf_e in zip(g, e):
        np.testing.assert_allclose(
          leaf_g, leaf_e, rtol=1e-10, atol=1e-12, err_msg=f"step {t + 1}"
        )

  def test_matches_numpy_float32(self, eps_mode="paper"):
    theta0, grads_seq = _problem()
    hp = dict(_HPARAMS)
    lr = hp.pop("lr")
    expected, _ = numpy_fadam(
      theta0, grads_seq, lr=lr, clip=0.7, p=0.75, eps_mode=eps_mode, **hp
    )
    tx = fisher_optax.fadam(lr, clip=0.7, p=0.75, eps_mode=eps_mode, **hp)
    got, state = _run_fadam(tx, theta0, grads_seq, jnp.float32)
    chex.assert_tree_all_finite(state)
    for t, (g, e) in enumerate(zip(got, expected)):
      for leaf_g, leaf_e in zip(g, e):
        np.testing.assert_allclose(
          leaf_g, leaf_e, rtol=2e-4, atol=2e-5, err_msg=f"step {t + 1}"
        )

  def test_first_step_closed_form(self):
    g = jnp.array([4.0, -0.25, 0.0, 1e-3])
    p, eps, eps2 = 0.75, 1e-3, 1e-2
    tx = fisher_optax.scale_by_fadam(
      b1=0.0, eps=eps, eps2=eps2, p=p, clip=float("inf"), weight_decay=0.0
    )
    update, state = jax.jit(tx.update)(g, tx.init(g))
    eps_hat = min(eps, eps2 * float(jnp.sqrt(jnp.mean(g**2))))
    expected = g / (jnp.abs(g) ** (2 * p) + eps_hat ** (2 * p))
    chex.assert_trees_all_close(state.fim, g**2)
    chex.assert_trees_all_close(update, expected, rtol=1e-6)

  def test_no_decay_no_clip_is_adam_with_p_power(self):
    """λ = 0 and c = ∞: momentum of g / (sqrt(v_hat) + eps_hat), no m-hat."""
    g_seq = [
      jnp.array([1.0, -2.0, 0.5]),
      jnp.array([0.3, 0.1, -4.0]),
      jnp.array([-1.0, 2.0, 2.0]),
    ]
    b1, b2, eps = 0.9, 0.99, 1e-8
    tx = fisher_optax.scale_by_fadam(
      b1=b1, b2=b2, eps=eps, clip=float("inf"), weight_decay=0.0
    )
    adam_nu = optax.scale_by_adam(b1=0.0, b2=b2, eps=0.0)
    state, nu_state = tx.init(g_seq[0]), adam_nu.init(g_seq[0])
    update_fn, nu_fn = jax.jit(tx.update), jax.jit(adam_nu.update)
    m = jnp.zeros(3)
    for g in g_seq:
      update, state = update_fn(g, state)
      _, nu_state = nu_fn(g, nu_state)
      v_hat = nu_state.nu / (1 - b2**nu_state.count)
      eps_hat = min(eps, 1e-2 * float(jnp.sqrt(jnp.mean(g**2))))
      m = b1 * m + (1 - b1) * g / (jnp.sqrt(v_hat) + eps_hat)
      chex.assert_trees_all_close(state.fim, v_hat, rtol=1e-5)
      chex.assert_trees_all_close(update, m, rtol=1e-5)


# -- the per-example Fisher --------------------------------------------------


def _per_example_problem(num_steps: int = 6, batch: int = 5):
  rng = np.random.default_rng(1)
  theta0 = [rng.normal(size=(3, 2)), rng.normal(size=(4,))]
  pegs = [
    [rng.normal(size=(batch, 3, 2)), rng.normal(size=(batch, 4)) * 0.1]
    for _ in range(num_steps)
  ]
  grads = [[x.mean(0) for x in step] for step in pegs]
  fisher = [[np.mean(x**2, 0) for x in step] for step in pegs]
  return theta0, pegs, grads, fisher


class _Diag:
  """Stands in for fisher_optax.fisher.DiagonalFisher (only .diag is read)."""

  def __init__(self, diag):
    self.diag = diag


jax.tree_util.register_pytree_node(
  _Diag, lambda d: ((d.diag,), None), lambda _, c: _Diag(*c)
)


class FAdamPerExampleTest(parameterized.TestCase):
  @parameterized.parameters(("per_example_grads",), ("fisher",))
  def test_matches_numpy(self, extra):
    theta0, pegs, grads, fisher = _per_example_problem()
    hp = dict(_HPARAMS)
    lr = hp.pop("lr")
    expected, _ = numpy_fadam(
      theta0, grads, lr=lr, clip=1.0, p=0.5, fisher_seq=fisher, **hp
    )
    with jax.enable_x64(True):
      if extra == "per_example_grads":
        extras = [
          {"per_example_grads": [jnp.asarray(x) for x in s]} for s in pegs
        ]
      else:  # A DiagonalFisher-like object on odd steps, .diag on even.
        extras = [
          {"fisher": _Diag([jnp.asarray(x) for x in s])}
          if t % 2
          else {"fisher": [jnp.asarray(x) for x in s]}
          for t, s in enumerate(fisher)
        ]
      tx = fisher_optax.fadam(lr, fisher_source="per_example", **hp)
      got, _ = _run_fadam(tx, theta0, grads, jnp.float64, extras)
    for g, e in zip(got, expected):
      for leaf_g, leaf_e in zip(g, e):
        np.testing.assert_allclose(leaf_g, leaf_e, rtol=1e-10, atol=1e-12)

  def test_engine_diagonal_fisher(self):
    """fisher=fisher_optax.fisher.diagonal(...) equals per_example_grads."""
    from fisher_optax import fisher  # pylint: disable=g-import-not-at-top

    rng = np.random.default_rng(2)
    params = {
      "w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
      "b": jnp.zeros((3,), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, size=6), jnp.int32)
    apply_fn = lambda p, xb: xb @ p["w"] + p["b"]

    def nll(p, xi, yi):
      return -jax.nn.log_softmax(apply_fn(p, xi))[yi]

    tx = fisher_optax.fadam(1e-2, fisher_source="per_example")

    @jax.jit
    def both(params, x, y):  # One compile for the engine and both updates.
      pegs = jax.vmap(jax.grad(nll), in_axes=(None, 0, 0))(params, x, y)
      grads = jax.tree.map(lambda g: g.mean(0), pegs)
      stat = fisher.diagonal(
        apply_fn,
        params,
        (x, y),
        likelihood=fisher.Categorical(),
        kind="empirical",
      )
      u_stat, _ = tx.update(grads, tx.init(params), params, fisher=stat)
      u_pegs, _ = tx.update(
        grads, tx.init(params), params, per_example_grads=pegs
      )
      return u_stat, u_pegs

    u_stat, u_pegs = both(params, x, y)
    chex.assert_trees_all_close(u_stat, u_pegs, rtol=1e-5, atol=1e-7)

  def test_differs_from_batch_squared(self):
    theta0, pegs, grads, _ = _per_example_problem()
    params = [jnp.asarray(x, jnp.float32) for x in theta0]
    g = [jnp.asarray(x, jnp.float32) for x in grads[0]]
    peg = [jnp.asarray(x, jnp.float32) for x in pegs[0]]
    tx_b = fisher_optax.scale_by_fadam(weight_decay=0.0)
    tx_p = fisher_optax.scale_by_fadam(
      weight_decay=0.0, fisher_source="per_example"
    )
    _, s_b = jax.jit(tx_b.update)(g, tx_b.init(params), params)
    _, s_p = jax.jit(tx_p.update)(
      g, tx_p.init(params), params, per_example_grads=peg
    )
    # Mean of squares >= square of mean, strictly for noisy examples.
    for fb, fp in zip(s_b.fim, s_p.fim):
      self.assertTrue(bool(jnp.all(fp >= fb - 1e-7)))
      self.assertTrue(bool(jnp.any(fp > 1.5 * fb)))

  def test_batch_squared_is_deprecated_batch(self):
    theta0, _, grads, _ = _per_example_problem()
    hp = dict(_HPARAMS)
    lr = hp.pop("lr")
    for factory, args in (
      (fisher_optax.fadam, (lr,)),
      (fisher_optax.scale_by_fadam, ()),
    ):
      with self.assertWarnsRegex(
        validation.FisherOptaxDeprecationWarning, "fisher_source='batch'"
      ) as cm:
        old = factory(*args, fisher_source="batch_squared", **hp)
      self.assertEqual(cm.filename, __file__)  # Points at the caller.
      new = factory(*args, fisher_source="batch", **hp)
      got_old, s_old = _run_fadam(old, theta0, grads, jnp.float32)
      got_new, s_new = _run_fadam(new, theta0, grads, jnp.float32)
      chex.assert_trees_all_equal((got_old, s_old), (got_new, s_new))

  def test_errors(self):
    params = {"a": jnp.ones((3, 2)), "b": jnp.ones((4,))}
    tx = fisher_optax.fadam(1e-2, fisher_source="per_example")
    state = tx.init(params)
    with self.assertRaisesRegex(ValueError, "per_example_grads=.*fisher="):
      tx.update(params, state, params)
    bad_tree = {"a": jnp.ones((5, 3, 2))}
    with self.assertRaisesRegex(ValueError, "same tree structure"):
      tx.update(params, state, params, per_example_grads=bad_tree)
    bad_shape = {"a": jnp.ones((5, 3, 2)), "b": jnp.ones((5, 3))}
    with self.assertRaisesRegex(ValueError, r"must have shape \(batch"):
      tx.update(params, state, params, per_example_grads=bad_shape)
    no_batch = {"a": jnp.ones((3, 2)), "b": jnp.ones((4,))}
    with self.assertRaisesRegex(ValueError, "must have shape"):
      tx.update(params, state, params, per_example_grads=no_batch)
    with self.assertRaisesRegex(ValueError, "fisher.diag"):
      tx.update(params, state, params, fisher=_Diag({"a": jnp.ones((3, 2))}))
    with self.assertRaisesRegex(ValueError, "shapes"):
      tx.update(
        params,
        state,
        params,
        fisher={"a": jnp.ones((3, 2)), "b": jnp.ones((5,))},
      )
    with self.assertRaisesRegex(ValueError, r"fisher\['b'\] has negative"):
      tx.update(
        params,
        state,
        params,
        fisher={"a": jnp.ones((3, 2)), "b": -jnp.ones((4,))},
      )
    with self.assertRaisesRegex(ValueError, "only one"):
      tx.update(
        params,
        state,
        params,
        fisher=params,
        per_example_grads=jax.tree.map(lambda x: x[None], params),
      )


# -- behaviour ---------------------------------------------------------------


class FAdamBehaviourTest(parameterized.TestCase):
  @parameterized.parameters(
    dict(kwargs={"learning_rate": -1.0}, match="learning_rate"),
    dict(kwargs={"eps": -1e-8}, match="eps"),
    dict(kwargs={"eps": 0.0}, match="eps"),
    dict(kwargs={"eps2": -1.0}, match="eps2"),
    dict(kwargs={"eps2": 0.0}, match="eps2"),
    dict(kwargs={"b1": 1.0}, match="b1"),
    dict(kwargs={"b1": -0.1}, match="b1"),
    dict(kwargs={"b2": 1.0}, match="b2"),
    dict(kwargs={"b2": 1.5}, match="b2"),
    dict(kwargs={"clip": 0.0}, match="clip"),
    dict(kwargs={"clip": -1.0}, match="clip"),
    dict(kwargs={"p": 0.0}, match="p must"),
    dict(kwargs={"p": -0.5}, match="p must"),
    dict(kwargs={"weight_decay": -0.1}, match="weight_decay"),
    dict(kwargs={"eps_mode": "v2"}, match="eps_mode"),
    dict(kwargs={"fisher_source": "mc"}, match="fisher_source"),
  )
  def test_invalid_hyperparameters(self, kwargs, match):
    kwargs = {"learning_rate": 1e-3, **kwargs}
    with self.assertRaisesRegex(ValueError, match):
      fisher_optax.fadam(**kwargs)
    # NumPy and concrete JAX scalars are checked as Python numbers are.
    for wrap in (np.float32, jnp.asarray):
      numeric = {
        k: wrap(v) if isinstance(v, float) else v for k, v in kwargs.items()
      }
      with self.subTest(wrap=wrap.__name__):
        with self.assertRaisesRegex(ValueError, match):
          fisher_optax.fadam(**numeric)

  def test_bool_complex_and_float32_rounding_hyperparameters(self):
    # A bool passed every range check unread (b1=True froze the momentum,
    # eps=False divided by zero), and a b2 that rounds to 1.0 in float32
    # zeroed the bias correction: every step skipped, no error.
    for name, value in (("eps", False), ("b1", True), ("eps", 1j)):
      with self.subTest(name=name, value=value):
        with self.assertRaisesRegex(TypeError, f"{name} must be a real"):
          fisher_optax.fadam(1e-3, **{name: value})
    with self.assertRaisesRegex(TypeError, "momentum must be a real"):
      fisher_optax.mfac(0.1, 2, 1.0, momentum=True)
    with self.assertRaisesRegex(ValueError, "b2=0.99999999 rounds to 1.0"):
      fisher_optax.fadam(1e-3, b2=0.99999999)
    with jax.enable_x64(True):  # float64 keeps it below 1
      fisher_optax.fadam(1e-3, b2=0.99999999)

  def test_bfloat16_hyperparameters_that_round_out_of_range(self):
    # inject_hyperparams casts b2=0.999 to the params' bfloat16: 1.0, which
    # would skip every step as non-finite. init says so and how to fix it.
    params = {"w": jnp.ones((4, 3), jnp.bfloat16)}
    tx = optax.inject_hyperparams(fisher_optax.fadam)(learning_rate=1e-3)
    with self.assertRaisesRegex(ValueError, "b2.*hyperparam_dtype"):
      tx.init(params)
    tx = optax.inject_hyperparams(
      fisher_optax.fadam, hyperparam_dtype=jnp.float32
    )(learning_rate=1e-3)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)({"w": jnp.ones((4, 3))}, state, params)
    self.assertEqual(int(state.inner_state[0].notfinite_count), 0)
    self.assertTrue(bool(jnp.all(updates["w"] < 0)))

  def test_skipped_step_keeps_the_schedule_count(self):
    schedule = optax.linear_schedule(1e-2, 0.0, 10)
    tx = fisher_optax.fadam(schedule)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    _, state = tx.update({"w": jnp.ones(3)}, state, params)
    _, skipped = tx.update({"w": jnp.full(3, jnp.nan)}, state, params)
    chex.assert_trees_all_equal(skipped[1], state[1])
    self.assertEqual(int(skipped[0].notfinite_count), 1)

  def test_invalid_dtype(self):
    with self.assertRaisesRegex(TypeError, "mu_dtype"):
      fisher_optax.scale_by_fadam(mu_dtype=jnp.int32)

  def test_params_required_for_decay(self):
    params = jnp.ones(3)
    tx = fisher_optax.fadam(1e-2)
    with self.assertRaisesRegex(ValueError, "needs the current params"):
      tx.update(params, tx.init(params))
    tx = fisher_optax.fadam(1e-2, weight_decay=0.0)
    updates, _ = tx.update(params, tx.init(params))  # No params needed.
    chex.assert_tree_all_finite(updates)

  def test_injected_zero_decay_needs_no_params(self):
    params = jnp.ones(3)
    tx = optax.inject_hyperparams(fisher_optax.fadam)(1e-2, weight_decay=0.0)
    updates, _ = tx.update(params, tx.init(params))  # concrete: no params
    chex.assert_tree_all_finite(updates)

  def test_tiny_gradient_leaf_is_not_skipped(self):
    # eps_hat follows the leaf's tiny RMS, so theta / d (about 1e19 here)
    # overflowed float32 when squared and every step was skipped, though
    # the weight decay's clip bounds the term.
    theta = [np.ones(100), np.linspace(-1.0, 1.0, 8)]
    rng = np.random.default_rng(0)
    grads_seq = [[np.zeros(100), rng.normal(size=8)] for _ in range(3)]
    for g in grads_seq:
      g[0][0] = 1e-16
    hp = dict(_HPARAMS, eps=1e-8)
    want, _ = numpy_fadam(theta, grads_seq, p=0.5, clip=1.0, **hp)
    tx = fisher_optax.fadam(
      hp["lr"],
      b1=hp["b1"],
      b2=hp["b2"],
      eps=hp["eps"],
      eps2=hp["eps2"],
      weight_decay=hp["weight_decay"],
    )
    got, state = _run_fadam(tx, theta, grads_seq, jnp.float32)
    self.assertEqual(int(state[0].notfinite_count), 0)
    for g_step, w_step in zip(got, want):
      for a, b in zip(g_step, w_step):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

  def test_schedules_where_numbers_are_needed(self):
    with self.assertRaisesRegex(TypeError, "weight_decay takes a number"):
      fisher_optax.fadam(1e-2, weight_decay=optax.constant_schedule(0.1))
    with self.assertRaisesRegex(TypeError, "b1 takes a number"):
      fisher_optax.fadam(1e-2, b1=optax.constant_schedule(0.9))

  def test_weight_decay_mask(self):
    params = {"w": jnp.full((2, 3), 2.0), "b": jnp.full((3,), -1.0)}
    grads = jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), params)

    def run(**kw):
      tx = fisher_optax.scale_by_fadam(**kw)
      return tx.update(grads, tx.init(params), params)[0]

    full, none = run(), run(weight_decay=0.0)
    for mask in (
      {"w": True, "b": False},
      lambda p: {"w": True, "b": False},
      {"w": jnp.array(True), "b": jnp.array(False)},
    ):
      masked = run(weight_decay_mask=mask)
      chex.assert_trees_all_close(masked["w"], full["w"])
      chex.assert_trees_all_close(masked["b"], none["b"])
      self.assertFalse(bool(jnp.allclose(masked["w"], none["w"])))
    with self.assertRaisesRegex(ValueError, "weight_decay_mask"):
      run(weight_decay_mask={"w": True})

  def test_wrong_params_structure(self):
    params = {"w": jnp.ones((2, 3))}
    tx = fisher_optax.fadam(1e-2)
    with self.assertRaisesRegex(ValueError, "params"):
      tx.update(params, tx.init(params), {"v": jnp.ones((2, 3))})
    with self.assertRaisesRegex(ValueError, "shapes"):
      tx.update(params, tx.init(params), {"w": jnp.ones((3, 2))})

  def test_nonfinite_gradient_keeps_state(self):
    params = (jnp.ones((2, 2)), jnp.ones(3))
    tx = fisher_optax.fadam(1e-2)
    update = jax.jit(tx.update)
    state = tx.init(params)
    _, state = update((jnp.full((2, 2), 0.5), jnp.ones(3)), state, params)
    bad = (
      jnp.array([[1.0, jnp.nan], [0.0, 1.0]]),
      jnp.array([jnp.inf, 1.0, 1.0]),
    )
    updates, new_state = update(bad, state, params)
    # Unchanged but for the count of skipped steps.
    self.assertEqual(int(new_state[0].notfinite_count), 1)
    skipped = new_state[0]._replace(notfinite_count=state[0].notfinite_count)
    chex.assert_trees_all_equal((skipped, *new_state[1:]), state)
    self.assertFalse(bool(jnp.all(jnp.isfinite(updates[0]))))

  def test_zero_gradients_from_start(self):
    params = {"w": jnp.ones((3, 3)), "b": jnp.zeros(3)}
    zeros = jax.tree.map(jnp.zeros_like, params)
    for eps_mode in ("paper", "v3"):
      tx = fisher_optax.fadam(1e-2, eps_mode=eps_mode)
      state = tx.init(params)
      for _ in range(3):
        updates, state = tx.update(zeros, state, params)
        chex.assert_tree_all_finite((updates, state))
      # Only the (clipped) decay moves w; b = 0 stays put.
      self.assertLess(float(jnp.max(updates["w"])), 0.0)
      chex.assert_trees_all_equal(updates["b"], jnp.zeros(3))

  def test_tiny_gradients_p1_stay_finite(self):
    """eps_hat^(2p) underflows in float32; the floor keeps d > 0."""
    params = (jnp.ones((4,)), jnp.ones((2, 2)))
    grads = (jnp.array([1e-25, 0.0, 0.0, 0.0]), jnp.zeros((2, 2)))
    tx = fisher_optax.fadam(1e-2, p=1.0)
    updates, state = tx.update(grads, tx.init(params), params)
    chex.assert_tree_all_finite((updates, state))

  def test_bf16(self):
    params = {
      "w": jnp.ones((4, 3), jnp.bfloat16),
      "b": jnp.full((3,), 0.5, jnp.bfloat16),
    }
    grads = jax.tree.map(
      lambda x: (0.1 * jnp.arange(x.size).reshape(x.shape) - 0.3).astype(
        jnp.bfloat16
      ),
      params,
    )
    ref_tx = fisher_optax.fadam(1e-2)
    ref_params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    ref_grads = jax.tree.map(lambda x: x.astype(jnp.float32), grads)
    ref_updates, _ = jax.jit(ref_tx.update)(
      ref_grads, ref_tx.init(ref_params), ref_params
    )
    for kw, state_dtype in (
      ({}, jnp.float32),
      ({"mu_dtype": jnp.bfloat16, "fim_dtype": jnp.bfloat16}, jnp.bfloat16),
    ):
      tx = fisher_optax.fadam(1e-2, **kw)
      update = jax.jit(tx.update)
      updates, state = update(grads, tx.init(params), params)
      if not kw:
        bf16_updates = updates
      updates, state = update(grads, state, params)
      chex.assert_trees_all_equal_dtypes(updates, params)
      for leaf in jax.tree.leaves((state[0].mu, state[0].fim)):
        self.assertEqual(leaf.dtype, state_dtype)
      chex.assert_tree_all_finite(state)
    # One step in bf16 agrees with float32 to bf16 precision.
    chex.assert_trees_all_close(
      jax.tree.map(lambda x: x.astype(jnp.float32), bf16_updates),
      ref_updates,
      rtol=2e-2,
      atol=1e-5,
    )

  def test_inject_hyperparams_keeps_the_default_square_root(self):
    # A traced p would need a general power: 1.4x a whole train step.
    injected = optax.inject_hyperparams(fisher_optax.fadam)(1e-2)
    params = {"w": jnp.ones((8, 4))}
    state = injected.init(params)
    self.assertNotIn("p", state.hyperparams)
    self.assertIn("b2", state.hyperparams)
    hlo = jax.jit(injected.update).lower(params, state, params).as_text()
    # (b2 ** t in the bias correction is a scalar power.)
    self.assertNotRegex(hlo, r"stablehlo.power [^\n]*tensor<8x4xf32>")
    self.assertRegex(hlo, r"stablehlo.sqrt [^\n]*tensor<8x4xf32>")

  def test_inject_hyperparams_p_clip_eps(self):
    injected = optax.inject_hyperparams(fisher_optax.fadam)(
      learning_rate=1e-2, p=0.75, clip=0.5, eps=1e-3
    )
    plain = fisher_optax.fadam(1e-2, p=0.75, clip=0.5, eps=1e-3)
    params = (jnp.ones((3, 2)), -jnp.ones(4))
    s1, s2 = plain.init(params), injected.init(params)
    for name in ("p", "clip", "eps", "b1", "b2", "weight_decay"):
      self.assertIn(name, s2.hyperparams)
    for i in range(3):
      g = jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1.0) + 0.3), params)
      u1, s1 = jax.jit(plain.update)(g, s1, params)
      u2, s2 = jax.jit(injected.update)(g, s2, params)
      chex.assert_trees_all_close(u1, u2, rtol=1e-5, atol=1e-7)
    # A changed hyperparameter takes effect without re-building.
    s2.hyperparams["weight_decay"] = jnp.asarray(0.0)
    u3, _ = injected.update(g, s2, params)
    self.assertFalse(bool(jnp.allclose(u3[0], u2[0])))

  def test_in_masked_with_per_example_grads(self):
    params = {"w": jnp.ones((3, 2)), "frozen": jnp.ones((2,))}
    pegs = jax.tree.map(
      lambda x: jnp.stack([jnp.sin(x + k) for k in range(4)]), params
    )
    grads = jax.tree.map(lambda x: x.mean(0), pegs)
    mask = {"w": True, "frozen": False}
    tx = optax.masked(
      fisher_optax.fadam(1e-2, fisher_source="per_example"),
      mask,
      mask_compatible_extra_args=True,
    )
    updates, _ = jax.jit(tx.update)(
      grads, tx.init(params), params, per_example_grads=pegs
    )
    alone = fisher_optax.fadam(1e-2, fisher_source="per_example")
    sub = {"w": params["w"]}
    ref, _ = jax.jit(alone.update)(
      {"w": grads["w"]},
      alone.init(sub),
      sub,
      per_example_grads={"w": pegs["w"]},
    )
    chex.assert_trees_all_close(updates["w"], ref["w"])
    chex.assert_trees_all_equal(updates["frozen"], grads["frozen"])

  def test_nnx_optimizer(self):
    from flax import nnx  # pylint: disable=g-import-not-at-top

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(
      model,
      fisher_optax.fadam(1e-2, fisher_source="per_example"),
      wrt=nnx.Param,
    )
    x = jnp.arange(12.0).reshape(4, 3) / 10.0
    y = jnp.ones((4, 2))

    def loss(m, xi, yi):
      return jnp.mean((m(xi) - yi) ** 2)

    @nnx.jit
    def step(model, opt, x, y):
      grads = nnx.grad(loss)(model, x, y)
      graphdef, params, rest = nnx.split(model, nnx.Param, ...)

      def per_example(p, xi, yi):
        return loss(nnx.merge(graphdef, p, rest), xi[None], yi[None])

      pegs = jax.vmap(jax.grad(per_example), in_axes=(None, 0, 0))(params, x, y)
      opt.update(model, grads, per_example_grads=pegs)
      return loss(model, x, y)

    first = float(loss(model, x, y))
    for _ in range(20):
      last = float(step(model, opt, x, y))
    self.assertLess(last, first)

  def test_orbax_round_trip(self):
    import tempfile  # pylint: disable=g-import-not-at-top

    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    tx = fisher_optax.fadam(1e-2)
    state = tx.init(params)
    _, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    with tempfile.TemporaryDirectory() as tmp:
      ckpt = ocp.StandardCheckpointer()
      ckpt.save(f"{tmp}/state", state)
      ckpt.wait_until_finished()
      restored = ckpt.restore(f"{tmp}/state", jax.eval_shape(tx.init, params))
    self.assertIsInstance(restored[0], fisher_optax.FAdamState)
    chex.assert_trees_all_equal(restored, state)

  @parameterized.parameters(0.0, 0.1)
  def test_donated_step_keeps_no_leaf_sized_temporaries(self, weight_decay):
    # With params and state donated, an elementwise term that two fusions
    # read (the new Fisher, a denominator, a broadcast scalar) becomes a
    # temporary; one that lives across the all-leaf policy decision is as
    # large as every leaf together. What may remain is the skipped-step
    # branch's one-byte finiteness masks (a quarter of the float32 params).
    rng = np.random.default_rng(0)
    shapes = [(256, 512), (512,), (512, 256), (256, 256), (64, 256, 4)]
    params = {
      f"w{i}": jnp.asarray(rng.normal(size=s), jnp.float32)
      for i, s in enumerate(shapes)
    }
    grads = jax.tree.map(lambda p: 0.1 * p, params)
    tx = fisher_optax.fadam(1e-3, weight_decay=weight_decay)

    temp = nonfinite_testing.donated_step_temp(tx, params, grads)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    self.assertLess(temp, 0.3 * param_bytes)


class FAdamNonfiniteAndDtypeTest(parameterized.TestCase):
  """The one non-finite policy, shape errors and float16 statistics."""

  @pytest.mark.timeout(120)
  @parameterized.parameters("batch", "per_example")
  def test_nonfinite_policy(self, fisher_source):
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    grads = {"w": jnp.full((3, 2), 0.5), "b": jnp.ones(2)}
    tx = fisher_optax.fadam(1e-2, fisher_source=fisher_source)
    extra = None
    if fisher_source == "per_example":
      # The per-example gradients carry the bad value too.
      extra = lambda g: {
        "per_example_grads": jax.tree.map(lambda x: jnp.stack([x, x]), g)
      }
    nonfinite_testing.check_policy(self, tx, params, grads, extra=extra)

  def test_mismatched_gradients_are_refused(self):
    params = {"w": jnp.ones((4, 3))}
    tx = fisher_optax.fadam(1e-2)
    state = tx.init(params)
    for bad in (jnp.ones(()), jnp.ones((3, 4)), jnp.ones((4, 1))):
      with self.assertRaisesRegex(
        ValueError, r"updates do not match (init's )?params"
      ):
        tx.update({"w": bad}, state, params)
      with self.assertRaisesRegex(
        ValueError, r"updates do not match (init's )?params"
      ):
        fisher_optax.scale_by_fadam(weight_decay=0.0).update(
          {"w": bad}, state[0], None
        )

  def test_policy_adds_no_pass_over_the_state(self):
    # The policy is folded into the two passes: no cond returns a
    # params-sized array (a second copy of the state, then selected against
    # the old one), and no params-sized array is checked for finiteness on
    # every step (a whole pass each; inside a cond branch it runs only on a
    # skipped step).
    shape = (16, 8)
    params = {"w": jnp.ones(shape), "b": jnp.ones((8,))}
    grads = jax.tree.map(lambda p: 0.5 * p, params)
    tx = fisher_optax.fadam(1e-2)
    jaxpr = jax.make_jaxpr(tx.update)(grads, tx.init(params), params)

    def eqns(jx, in_cond=False):
      for eqn in jx.eqns:
        yield eqn, in_cond
        for value in eqn.params.values():
          for sub in value if isinstance(value, tuple) else (value,):
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
              yield from eqns(inner, in_cond or eqn.primitive.name == "cond")

    big = lambda v: getattr(v.aval, "shape", None) == shape
    for eqn, in_cond in eqns(jaxpr.jaxpr):
      if eqn.primitive.name == "cond":
        self.assertFalse(any(map(big, eqn.outvars)), eqn)
      if eqn.primitive.name == "is_finite" and not in_cond:
        self.assertFalse(any(map(big, eqn.invars)), eqn)

  @parameterized.parameters(jnp.float16, jnp.bfloat16)
  def test_half_precision_statistics_do_not_overflow(self, dtype):
    # 1e3 squared is far above float16's largest value (65504).
    params = {"w": jnp.ones((4, 3), dtype)}
    grads = {"w": jnp.full((4, 3), 1e3, dtype)}
    tx = fisher_optax.fadam(1e-2)
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    self.assertEqual(updates["w"].dtype, dtype)
    self.assertEqual(state[0].fim["w"].dtype, jnp.float32)
    self.assertEqual(state[0].mu["w"].dtype, jnp.float32)
    np.testing.assert_allclose(state[0].fim["w"], 1e6)
    chex.assert_tree_all_finite((updates, state))
    self.assertEqual(int(state[0].notfinite_count), 0)
    # Narrow storage on request: the statistics still run in float32.
    tx = fisher_optax.fadam(1e-2, mu_dtype=dtype, fim_dtype=jnp.float32)
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    self.assertEqual(state[0].mu["w"].dtype, dtype)
    chex.assert_tree_all_finite(state)

  def test_fisher_stored_in_float16_that_overflows_skips_the_step(self):
    # A float16 fim_dtype cannot hold 1e6: the step is skipped (zero updates,
    # the stored Fisher kept) rather than an infinite Fisher stored.
    params = {"w": jnp.ones(3)}
    tx = fisher_optax.fadam(1e-2, fim_dtype=jnp.float16)
    state = tx.init(params)
    small = {"w": jnp.full(3, 1.0)}
    _, state = jax.jit(tx.update)(small, state, params)
    before = state[0].fim["w"]
    updates, state = jax.jit(tx.update)({"w": jnp.full(3, 1e3)}, state, params)
    self.assertEqual(int(state[0].notfinite_count), 1)
    chex.assert_trees_all_equal(state[0].fim["w"], before)
    chex.assert_trees_all_equal(updates["w"], jnp.zeros(3))


if __name__ == "__main__":
  absltest.main()
