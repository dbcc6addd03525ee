# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for protected-subspace fine-tuning (``_physguard.py``)."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fisher_optax
from fisher_optax.fisher import numerics
from tests import nonfinite_testing


def _grads(seed, n=12, dtype=jnp.float32):
  """Per-example gradients with a decaying spectrum, leaves (n, *shape)."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  w = jax.random.normal(k1, (n, 4, 3), dtype) * jnp.geomspace(
    3.0, 0.05, 12
  ).reshape(4, 3).astype(dtype)
  return {
    "w": w,
    "b": jax.random.normal(k2, (n, 5), dtype),
    "s": jax.random.normal(k3, (n, 2), dtype),
  }


def _flat(leaf):
  return np.asarray(leaf).reshape(leaf.shape[0], -1)


class ProtectedSubspaceTest(parameterized.TestCase):
  @parameterized.parameters(0.5, 0.9, 0.99)
  def test_gram_trick_and_tau_rule(self, tau):
    with jax.enable_x64(True):
      g = _grads(0, dtype=jnp.float64)
      sub = fisher_optax.protected_subspace(g, max_rank=8, tau=tau)
      for name in g:
        mat = _flat(g[name])
        dense = mat.T @ mat
        vals, vecs = np.linalg.eigh(dense)
        vals, vecs = vals[::-1], vecs[:, ::-1]
        frac = np.cumsum(vals) / vals.sum()
        k_min = int(np.argmax(frac >= tau - 1e-12)) + 1
        k = int(sub.rank[name])
        self.assertEqual(k, min(k_min, 8), name)
        u = _flat(sub.bases[name])
        np.testing.assert_allclose(
          u @ u.T, np.diag([1.0] * k + [0.0] * (8 - k)), atol=1e-10
        )
        # Same subspace as the dense top-k eigenvectors.
        v = vecs[:, :k]
        np.testing.assert_allclose(u[:k].T @ u[:k], v @ v.T, atol=1e-8)

  def test_zero_gradients_give_rank_zero(self):
    g = jax.tree.map(jnp.zeros_like, _grads(0))
    sub = fisher_optax.protected_subspace(g, max_rank=4, tau=0.9)
    chex.assert_tree_all_finite(sub)
    for r in jax.tree.leaves(sub.rank):
      self.assertEqual(int(r), 0)
    chex.assert_trees_all_equal(
      sub.bases, jax.tree.map(lambda x: jnp.zeros((4,) + x.shape[1:]), g)
    )

  def test_rank_stops_at_the_gradients_rank(self):
    # tau = 1 asks for all the energy; rank-one gradients have one
    # direction, and zero eigenvectors must not take basis slots.
    # The top energy rounds to just below the total for some draws.
    for seed in range(4):
      v = jax.random.normal(jax.random.key(seed), (6,))
      c = jnp.array([1.0, 2.0, -0.5, 3.0])
      g = {"w": c[:, None] * v}  # 4 examples, rank one
      sub = fisher_optax.protected_subspace(g, max_rank=4, tau=1.0)
      self.assertEqual(int(sub.rank["w"]), 1)
      np.testing.assert_allclose(
        np.abs(sub.bases["w"][0] @ v) / np.linalg.norm(v), 1.0, rtol=1e-5
      )
      chex.assert_trees_all_equal(sub.bases["w"][1:], jnp.zeros((3, 6)))

  def test_small_tensor_has_no_identity_columns(self):
    """Unlike the reference code, a 2-entry leaf is not frozen by e_1, e_2."""
    g = {"s": jnp.stack([jnp.array([0.0, c]) for c in (1.0, -2.0, 3.0)])}
    sub = fisher_optax.protected_subspace(g, max_rank=4, tau=0.9)
    self.assertEqual(int(sub.rank["s"]), 1)
    np.testing.assert_allclose(
      jnp.abs(sub.bases["s"][0]), [0.0, 1.0], atol=1e-6
    )

  def test_accumulated_bases_stay_orthonormal(self):
    with jax.enable_x64(True):
      sub = None
      for task in range(4):
        g = _grads(task, n=6, dtype=jnp.float64)
        sub = fisher_optax.protected_subspace(
          g, max_rank=10, tau=0.95, existing=sub
        )
        for name in g:
          k = int(sub.rank[name])
          d = _flat(g[name]).shape[1]
          self.assertLessEqual(k, min(10, d))
          u = _flat(sub.bases[name])
          np.testing.assert_allclose(
            u @ u.T, np.diag([1.0] * k + [0.0] * (10 - k)), atol=1e-9
          )
      # A leaf of 2 entries is full after the first tasks: rank 2, not more.
      self.assertEqual(int(sub.rank["s"]), 2)

  def test_accumulation_protects_old_directions(self):
    with jax.enable_x64(True):
      g1, g2 = _grads(1, dtype=jnp.float64), _grads(2, dtype=jnp.float64)
      s1 = fisher_optax.protected_subspace(g1, max_rank=12, tau=0.9)
      s12 = fisher_optax.protected_subspace(
        g2, max_rank=12, tau=0.9, existing=s1
      )
      for name in g1:
        k1 = int(s1.rank[name])
        chex.assert_trees_all_close(s12.bases[name][:k1], s1.bases[name][:k1])

  def test_bad_inputs(self):
    g = _grads(0)
    with self.assertRaisesRegex(TypeError, "max_rank"):
      fisher_optax.protected_subspace(g, max_rank=4.0)
    with self.assertRaisesRegex(ValueError, "tau"):
      fisher_optax.protected_subspace(g, max_rank=4, tau=1.5)
    with self.assertRaisesRegex(ValueError, "leading"):
      fisher_optax.protected_subspace(
        {"w": g["w"], "b": g["b"][:3], "s": g["s"]}, max_rank=4
      )
    sub = fisher_optax.protected_subspace(g, max_rank=4)
    with self.assertRaisesRegex(ValueError, "rows"):
      fisher_optax.protected_subspace(g, max_rank=5, existing=sub)
    with self.assertRaisesRegex(ValueError, "tree structure"):
      fisher_optax.protected_subspace({"w": g["w"]}, max_rank=4, existing=sub)
    with self.assertRaisesRegex(ValueError, "empty batch axis"):
      fisher_optax.protected_subspace(
        jax.tree.map(lambda x: x[:0], g), max_rank=4
      )


class ProjectOutSubspaceTest(parameterized.TestCase):
  def _setup(self, max_rank=6):
    g = _grads(3)
    sub = fisher_optax.protected_subspace(g, max_rank=max_rank, tau=0.99)
    params = jax.tree.map(lambda x: x[0], g)
    u = jax.tree.map(lambda x: x[1] + 0.3, g)
    return sub, params, u

  # 20 rows: B^T c as one product rather than a sum row by row.
  @parameterized.product(alpha=(0.0, 0.4, 1.0), max_rank=(6, 20))
  def test_removes_alpha_of_protected_component(self, alpha, max_rank):
    sub, params, u = self._setup(max_rank)
    tx = fisher_optax.project_out_subspace(max_rank, alpha, sub)
    out, state = jax.jit(tx.update)(u, tx.init(params), params)
    for name in u:
      b = _flat(sub.bases[name])
      np.testing.assert_allclose(
        b @ np.ravel(out[name]),
        (1 - alpha) * (b @ np.ravel(u[name])),
        atol=1e-5,
      )
      # The orthogonal component is untouched.
      perp = lambda x: np.ravel(x) - b.T @ (b @ np.ravel(x))
      np.testing.assert_allclose(perp(out[name]), perp(u[name]), atol=1e-5)
    if alpha == 0.0:
      chex.assert_trees_all_close(out, u, atol=1e-6)
    if alpha == 1.0:  # idempotent
      again, _ = tx.update(out, state, params)
      chex.assert_trees_all_close(again, out, atol=1e-6)

  def test_alpha_schedule(self):
    sub, params, u = self._setup()
    tx = fisher_optax.project_out_subspace(
      6, optax.linear_schedule(1.0, 0.0, 1), sub
    )
    state = tx.init(params)
    first, state = tx.update(u, state, params)
    second, _ = tx.update(u, state, params)
    b = _flat(sub.bases["w"])
    np.testing.assert_allclose(b @ np.ravel(first["w"]), 0.0, atol=1e-5)
    chex.assert_trees_all_close(second, u, atol=1e-6)
    # Values outside [0, 1] (unchecked at call time) are clipped: 2 would
    # reverse the protected component, -1 double it.
    injected = optax.inject_hyperparams(
      fisher_optax.project_out_subspace, static_args=("max_rank",)
    )
    for value, same_as in ((2.0, first), (-1.0, u)):
      tx = fisher_optax.project_out_subspace(6, lambda c, v=value: v, sub)
      got, _ = tx.update(u, tx.init(params), params)
      chex.assert_trees_all_close(got, same_as, atol=1e-5)
      # Injected: refused where concrete, clipped where traced.
      tx = injected(max_rank=6, alpha=0.5, subspace=sub)
      state = tx.init(params)
      state.hyperparams["alpha"] = jnp.asarray(value)
      with self.assertRaisesRegex(ValueError, "alpha must lie in"):
        tx.update(u, state, params)
      got, _ = jax.jit(tx.update)(u, state, params)
      chex.assert_trees_all_close(got, same_as, atol=1e-5)

  def test_bf16_params_float32_bases(self):
    params = {"w": jnp.ones((3, 2), jnp.bfloat16)}
    tx = fisher_optax.project_out_subspace(2)
    state = tx.init(params)
    self.assertEqual(state.protected_subspace.bases["w"].dtype, jnp.float32)
    out, _ = tx.update(params, state, params)
    chex.assert_trees_all_equal(out, params)  # Empty basis: the identity.

  @parameterized.parameters("after", "before")
  def test_physguard_placement(self, placement):
    sub, params, _ = self._setup()
    tx = fisher_optax.physguard(
      0.1, max_rank=6, placement=placement, weight_decay=0.1, subspace=sub
    )
    state = tx.init(params)
    step = jax.jit(tx.update)
    for i in range(3):
      g = jax.tree.map(lambda x, i=i: jnp.cos(x * (i + 1.0)), params)
      out, state = step(g, state, params)
    leak = max(
      float(np.abs(_flat(sub.bases[n]) @ np.ravel(out[n])).max()) for n in out
    )
    if placement == "after":  # the applied update is exactly orthogonal
      self.assertLess(leak, 1e-6)
    else:  # Adam's per-coordinate scaling re-mixes the projected gradient
      self.assertGreater(leak, 1e-3)
      # "b" is protected whole: Adam scales its rounding noise to a step
      # (as the docstring says).
      self.assertEqual(int(sub.rank["b"]), out["b"].size)
      self.assertGreater(float(jnp.abs(out["b"]).max()), 0.01)

  @parameterized.parameters("after", "before")
  def test_physguard_without_a_subspace_is_adamw(self, placement):
    # An empty protected subspace projects nothing: Adam's b1, b2 and eps
    # and the masked weight decay are optax.adamw's.
    params = {"b": jnp.array([0.5, -1.0]), "w": jnp.array([[1.0, 2.0]])}
    kw = dict(b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1)
    mask = {"b": False, "w": True}
    ours = fisher_optax.physguard(
      0.1, max_rank=2, placement=placement, mask=mask, **kw
    )
    ref = optax.adamw(0.1, mask=mask, **kw)
    s_ours, s_ref = ours.init(params), ref.init(params)
    for i in range(3):
      g = jax.tree.map(lambda x, i=i: jnp.cos(x * (i + 1.0)), params)
      u_ours, s_ours = ours.update(g, s_ours, params)
      u_ref, s_ref = ref.update(g, s_ref, params)
      chex.assert_trees_all_close(u_ours, u_ref, rtol=1e-6, atol=1e-7)
      params = optax.apply_updates(params, u_ref)

  def test_step_holds_at_most_the_projection_beyond_the_params(self):
    # The non-finite policy is folded into the projection: a cond around it
    # held the projected updates and its checks read them again (three
    # leaf-sized temporaries). What remains is B^T (B u), one leaf.
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(256, 512)), jnp.float32)}
    grads = jax.tree.map(lambda x: x[None] * jnp.ones((4, 1, 1)), params)
    grads = jax.tree.map(lambda x: x * rng.normal(size=(4, 1, 1)), grads)
    sub = fisher_optax.protected_subspace(grads, max_rank=4)
    tx = optax.chain(
      fisher_optax.project_out_subspace(4, subspace=sub), optax.sgd(1e-2)
    )

    temp = nonfinite_testing.donated_step_temp(tx, params, params)
    self.assertLess(temp, 1.5 * params["w"].nbytes)

  @parameterized.parameters(("after", 0.0), ("after", 0.1), ("before", 0.1))
  def test_physguard_step_holds_one_leaf(self, placement, weight_decay):
    # After Adam: Adam's updates, the coefficients' operand. Chained, the
    # step held them twice, Adam's output and its policy's select (3.25
    # leaves when a cond decided the fill). Before Adam: XLA:CPU's copy of
    # the gradient as the coefficients' operand, which the projected
    # gradient reuses, and a finiteness mask (a quarter leaf); chained, 3
    # leaves (the donated moments were copied).
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(256, 512)), jnp.float32)}
    grads = jnp.asarray(rng.normal(size=(4, 256, 512)), jnp.float32)
    sub = fisher_optax.protected_subspace({"w": grads}, max_rank=4)
    tx = fisher_optax.physguard(
      1e-3,
      max_rank=4,
      subspace=sub,
      weight_decay=weight_decay,
      placement=placement,
    )
    temp = nonfinite_testing.donated_step_temp(tx, params, params)
    leaves = 1.01 if placement == "after" else 1.26
    self.assertLessEqual(temp, leaves * params["w"].nbytes)

  def test_subspace_of_the_full_params_under_masked(self):
    # The error says how to build it for optax.masked's MaskedNode tree.
    params = {"base": jnp.ones((3, 2)), "lora": jnp.ones((3, 2))}
    tx = optax.masked(
      fisher_optax.project_out_subspace(
        2, subspace=fisher_optax.init_protected_subspace(params, 2)
      ),
      {"base": False, "lora": True},
    )
    with self.assertRaisesRegex(
      ValueError, "MaskedNode .* build subspace on the masked tree"
    ):
      tx.init(params)

  def test_donated_state_keeps_the_users_subspace(self):
    sub, params, u = self._setup()
    want = jax.tree.map(np.asarray, sub.bases)
    tx = fisher_optax.physguard(1e-2, max_rank=6, subspace=sub)
    step = jax.jit(tx.update, donate_argnums=1)
    step(u, tx.init(params), params)
    step(u, tx.init(params), params)  # A second init reads it again.
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, sub.bases), want)

  def test_swap_does_not_retrace(self):
    sub, params, u = self._setup()
    tx = fisher_optax.physguard(1e-2, max_rank=6)
    state = tx.init(params)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(p, s):
      upd, s = tx.update(u, s, p)
      return optax.apply_updates(p, upd), s

    params, state = step(params, state)
    state = optax.tree.set(state, protected_subspace=sub)
    params, state = step(params, state)
    chex.assert_tree_all_finite(params)

  def test_bad_inputs(self):
    with self.assertRaisesRegex(TypeError, "max_rank"):
      fisher_optax.project_out_subspace(2.0)
    with self.assertRaisesRegex(ValueError, "alpha"):
      fisher_optax.project_out_subspace(2, alpha=1.5)
    # A vector would broadcast past the range check (and over-project).
    with self.assertRaisesRegex(ValueError, "alpha must be a scalar"):
      fisher_optax.project_out_subspace(2, alpha=jnp.array([1.5]))
    with self.assertRaisesRegex(ValueError, "b1 must be a scalar"):
      fisher_optax.physguard(1e-3, max_rank=2, b1=jnp.array([0.9, 2.0]))
    with self.assertRaisesRegex(ValueError, "placement"):
      fisher_optax.physguard(1e-3, max_rank=2, placement="middle")
    # A subspace built for other params, or with another max_rank.
    sub = fisher_optax.init_protected_subspace({"w": jnp.zeros((4, 3))}, 2)
    tx = fisher_optax.project_out_subspace(2, subspace=sub)
    with self.assertRaisesRegex(ValueError, r"subspace\['w'\] has shape"):
      tx.init({"w": jnp.zeros((3, 4))})
    with self.assertRaisesRegex(ValueError, "max_rank"):
      fisher_optax.physguard(1e-3, max_rank=3, subspace=sub)
    for name, value in (("b1", 1.0), ("b2", 1.5), ("eps", -1e-8)):
      with self.assertRaisesRegex(ValueError, name):
        fisher_optax.physguard(1e-3, max_rank=2, **{name: value})
    # Over bfloat16 params inject_hyperparams rounds b2=0.999 to 1.0, which
    # skipped every step as non-finite: init says so.
    tx = optax.inject_hyperparams(
      fisher_optax.physguard, static_args=("max_rank",)
    )(1e-3, max_rank=2)
    with self.assertRaisesRegex(ValueError, "b2.*hyperparam_dtype"):
      tx.init({"w": jnp.ones((3, 2), jnp.bfloat16)})
    with self.assertRaisesRegex(TypeError, "ProtectedSubspace"):
      fisher_optax.project_out_subspace(2, subspace={"w": 1})
    tx = fisher_optax.project_out_subspace(2)
    p = {"a": jnp.ones(3)}
    with self.assertRaisesRegex(ValueError, "tree structure"):
      tx.update({"a": p["a"], "b": p["a"]}, tx.init(p))


class PhysGuardNonfiniteAndDtypeTest(parameterized.TestCase):
  """The one non-finite policy, shape errors and the bases' dtype."""

  def _setup(self):
    g = _grads(3)
    sub = fisher_optax.protected_subspace(g, max_rank=6, tau=0.99)
    params = jax.tree.map(lambda x: x[0], g)
    return sub, params, jax.tree.map(lambda x: x[1] + 0.3, g)

  @pytest.mark.timeout(120)
  def test_project_out_subspace_policy(self):
    sub, params, grads = self._setup()
    tx = fisher_optax.project_out_subspace(6, subspace=sub)
    # A projection squares nothing: 1e30 gradients are a good step.
    nonfinite_testing.check_policy(self, tx, params, grads, overflows=False)

  @pytest.mark.timeout(120)
  @parameterized.parameters("after", "before")
  def test_physguard_policy(self, placement):
    sub, params, grads = self._setup()
    tx = fisher_optax.physguard(
      1e-2, max_rank=6, subspace=sub, placement=placement, weight_decay=1e-2
    )
    nonfinite_testing.check_policy(self, tx, params, grads)

  @parameterized.product(
    dtype=(jnp.float32, jnp.bfloat16, jnp.float16),
    schedules=(False, True),
    placement=("after", "before"),
  )
  def test_physguard_is_its_chain(self, dtype, schedules, placement):
    # physguard runs Adam, the decay and the projection as one step; the
    # chain it stands for, step by step: updates, states and counts on
    # finite, NaN, infinite and overflowing gradients, NaN params and a NaN
    # alpha.
    sub, params, grads = self._setup()
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    mask = {"w": True, "b": False, "s": True}
    lr = optax.linear_schedule(0.1, 0.01, 4) if schedules else 0.05
    # Under 1: leaf "b" is protected whole, so alpha = 1 leaves rounding
    # noise, which Adam scales to the step size.
    alphas = jnp.array([0.9, 0.7, 0.5, jnp.nan, 0.9, 0.8, 0.6, 0.6, 0.6])
    alpha = (lambda count: alphas[count]) if schedules else 0.8
    kw = dict(b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1, mask=mask)
    ours = fisher_optax.physguard(
      lr, max_rank=6, subspace=sub, alpha=alpha, placement=placement, **kw
    )
    adam = numerics.skip_nonfinite(
      numerics.widen_float16_state(
        optax.scale_by_adam(b1=kw["b1"], b2=kw["b2"], eps=kw["eps"])
      ),
      bounded=True,
    )
    decay = optax.add_decayed_weights(kw["weight_decay"], mask)
    project = fisher_optax.project_out_subspace(6, alpha, sub)
    if placement == "after":
      parts, guarded = (adam, decay, project), (0, 2)
    else:
      parts, guarded = (project, adam, decay), (0, 1)
    chain = numerics.chain_following(
      optax.chain(*parts, optax.scale_by_learning_rate(lr)), guarded
    )
    at_adam, at_project = parts.index(adam), parts.index(project)
    big = 1e30 if dtype != jnp.float16 else 6e4  # f16: squares stay finite
    edits = ("big", "nan", None, "inf", None, "big", None, "nan param", None)
    s_ours, s_ref = ours.init(params), chain.init(params)
    step_ours, step_ref = jax.jit(ours.update), jax.jit(chain.update)
    tol = 1e-6 if dtype == jnp.float32 else 1e-3
    for i, edit in enumerate(edits):
      g = jax.tree.map(lambda x, i=i: (x * (1.0 + i)).astype(dtype), grads)
      p = params
      if edit == "nan param":  # Decayed into the projection's input.
        p = {**p, "w": p["w"].at[0, 0].set(jnp.nan)}
      elif edit is not None:
        value = {"nan": jnp.nan, "inf": jnp.inf, "big": big}[edit]
        g = {**g, "b": g["b"].at[1].set(value)}
      u_ours, s_ours = step_ours(g, s_ours, p)
      u_ref, s_ref = step_ref(g, s_ref, p)
      chex.assert_trees_all_close(u_ours, u_ref, rtol=tol, atol=tol)
      chex.assert_trees_all_equal_dtypes(u_ours, u_ref)
      chex.assert_trees_all_close(s_ours, s_ref, rtol=tol, atol=tol)
      chex.assert_trees_all_equal_dtypes(s_ours, s_ref)
      u_ref = jax.tree.map(lambda u: jnp.where(jnp.isnan(u), 0, u), u_ref)
      params = optax.apply_updates(params, u_ref)
    adam_skips = 2 if dtype == jnp.float16 else 4  # nan, inf (and big)
    self.assertEqual(int(s_ours[at_adam].notfinite_count), adam_skips)
    # nan, inf (and alpha's NaN once the count reaches 3); after Adam, the
    # NaN param too.
    skips = 2 + schedules + (placement == "after")
    self.assertGreaterEqual(int(s_ours[at_project].notfinite_count), skips)

  @pytest.mark.timeout(120)
  def test_protected_subspace_never_decomposes_nonfinite_gradients(self):
    # LAPACK's eigh need not terminate on an infinite matrix (XLA:CPU): the
    # solver must never see one, including a Gram of 1e30 gradients.
    g = _grads(0)
    existing = fisher_optax.protected_subspace(g, max_rank=4)
    for value in (jnp.nan, jnp.inf, -jnp.inf, 1e30):
      bad = dict(g, w=g["w"].at[0, 0, 0].set(value))
      with self.subTest(value=value):
        with self.assertRaisesRegex(ValueError, r"\['w'\] are not finite"):
          fisher_optax.protected_subspace(bad, max_rank=4)
        # Under an outer jit the bad leaf keeps its existing basis.
        out = jax.jit(
          lambda b: fisher_optax.protected_subspace(
            b, max_rank=4, existing=existing
          )
        )(bad)
        chex.assert_tree_all_finite(out)
        chex.assert_trees_all_equal(out.bases["w"], existing.bases["w"])
        chex.assert_trees_all_equal(out.rank["w"], existing.rank["w"])
    # Tiny gradients are fine.
    tiny = jax.tree.map(lambda x: x * 1e-30, g)
    chex.assert_tree_all_finite(
      fisher_optax.protected_subspace(tiny, max_rank=4)
    )

  def test_mismatched_gradients_are_refused(self):
    params = {"w": jnp.ones((4, 3))}
    for tx in (
      fisher_optax.project_out_subspace(2),
      fisher_optax.physguard(1e-2, max_rank=2),
      fisher_optax.physguard(1e-2, max_rank=2, placement="before"),
    ):
      state = tx.init(params)
      for bad in (jnp.ones(()), jnp.ones((3, 4)), jnp.ones((4, 1))):
        with self.assertRaisesRegex(
          ValueError, "updates do not match subspace"
        ):
          tx.update({"w": bad}, state, params)

  def test_bf16_bases_halve_memory(self):
    params = {"w": jnp.ones((8, 6), jnp.bfloat16)}
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
    default = fisher_optax.physguard(1e-2, max_rank=4).init(params)
    narrow_tx = fisher_optax.physguard(
      1e-2, max_rank=4, basis_dtype=jnp.bfloat16
    )
    narrow = narrow_tx.init(params)
    sub = lambda st: optax.tree.get(st, "protected_subspace").bases
    self.assertEqual(sub(default)["w"].dtype, jnp.float32)
    self.assertEqual(sub(narrow)["w"].dtype, jnp.bfloat16)
    self.assertEqual(2 * nbytes(sub(narrow)), nbytes(sub(default)))
    # A bf16 basis computed in float32 still protects to bf16's precision.
    g = {"w": jax.random.normal(jax.random.key(0), (3, 8, 6), jnp.bfloat16)}
    basis = fisher_optax.protected_subspace(
      g, max_rank=4, tau=1.0, basis_dtype=jnp.bfloat16
    )
    self.assertEqual(basis.bases["w"].dtype, jnp.bfloat16)
    state = optax.tree.set(narrow, protected_subspace=basis)
    updates, state = narrow_tx.update({"w": g["w"][0]}, state, params)
    self.assertEqual(updates["w"].dtype, jnp.bfloat16)
    rows = basis.bases["w"].reshape(4, -1).astype(jnp.float32)
    coeff = rows @ updates["w"].astype(jnp.float32).reshape(-1)
    self.assertLess(
      float(jnp.max(jnp.abs(coeff))),
      0.05 * float(jnp.linalg.norm(updates["w"].astype(jnp.float32))) + 1e-6,
    )
    with self.assertRaisesRegex(TypeError, "basis_dtype"):
      fisher_optax.project_out_subspace(2, basis_dtype=jnp.int32)

  def test_half_precision_gradients(self):
    # float16 gradients of 1e3: their squares (1e6) overflow float16, not
    # the float32 statistics of the Adam scaling and the bases.
    params = {"w": jnp.ones((4, 3), jnp.float16)}
    g = {"w": jnp.full((2, 4, 3), 1e3, jnp.float16).at[1].multiply(-0.5)}
    sub = fisher_optax.protected_subspace(g, max_rank=2)
    self.assertEqual(sub.bases["w"].dtype, jnp.float32)
    chex.assert_tree_all_finite(sub)
    tx = fisher_optax.physguard(1e-2, max_rank=2, subspace=sub)
    updates, state = tx.update({"w": g["w"][0]}, tx.init(params), params)
    self.assertEqual(updates["w"].dtype, jnp.float16)
    chex.assert_tree_all_finite((updates, state))
    self.assertEqual(state[0].inner_state.nu["w"].dtype, jnp.float32)
    self.assertEqual(
      nonfinite_testing.split_counts(state)[0], [0, 0]
    )  # No step skipped: the statistics did not overflow.


if __name__ == "__main__":
  absltest.main()
