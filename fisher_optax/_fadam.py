# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
r"""FAdam: Adam read as natural gradient descent with a diagonal Fisher.

:func:`scale_by_fadam` states the rule; these are the decisions taken where
the paper and its reference implementations disagree or are silent:

* ``eps_mode="paper"`` puts :math:`\hat\epsilon` outside the power as Adam's
  :math:`\sqrt{\hat v} + \epsilon`, with the power :math:`2p` so that it has
  the units of :math:`f^p`. This form was reconstructed from the reference
  implementations' histories (the pytorch_optimizer 3.11+ form); we could not
  retrieve the body of the paper's Algorithm 1 to check it.
  ``eps_mode="v3"`` reproduces paper v3 and older ports:
  :math:`\hat\epsilon = \epsilon \min(1, \mathrm{RMS}(g))`,
  :math:`d = f^p + \hat\epsilon`.
* When :math:`\mathrm{RMS}(g) = 0` (a whole leaf without gradient), both
  modes use :math:`\hat\epsilon = \epsilon`, so zero-Fisher entries give
  ``0 / eps`` = 0, not the ``0 / 0`` of paper v3; the decay still acts.
* :math:`\hat\epsilon^{2p}` is floored at the smallest normal number of the
  compute dtype, so :math:`d` never underflows to 0.
* The clip divides by :math:`\max(1, \mathrm{RMS}/c)` as the paper writes it;
  all FAdam_PyTorch revisions and pytorch_optimizer <= 4.0 divide by
  :math:`\max(1, \mathrm{RMS})/c`, which differs when ``clip != 1``.
* One step counter for all leaves (optax has no missing gradients; exclude
  leaves from the decay with ``weight_decay_mask``).
* Non-finite steps follow the library's one policy,
  :func:`fisher_optax.fisher.numerics.skip_nonfinite_step`: a step whose
  gradient (or Fisher input) is non-finite leaves the state, ``count``
  included, unchanged (``notfinite_count`` counts it). Its updates are NaN
  for every leaf when the gradient itself is not finite, so the failure
  reaches the caller; a finite gradient with non-finite Fisher inputs, or
  whose Fisher or natural gradient overflows, gives zero updates (NaN from
  a finite gradient would pass :func:`optax.apply_if_finite`). Wrap the optimizer in :func:`optax.apply_if_finite` to skip
  NaN steps.
* Statistics are computed in (at least) float32 and stored, by default, in
  ``promote(param dtype, float32)``, so float16 squares do not overflow;
  ``mu_dtype``/``fim_dtype`` store them narrower. The updates keep the
  gradient's dtype.

**Where the Fisher comes from** (``fisher_source``). ``"batch"`` (the paper)
squares the mean gradient :math:`\bar g` that the transform receives as
``updates``. ``"per_example"`` (beyond the paper and its ports) uses the true
diagonal empirical Fisher :math:`\frac1B \sum_b g_b^2`, the engine's
:func:`fisher_optax.fisher.diagonal_from_grads` of a ``per_example_grads``
extra argument (the updates' tree with a leading batch axis), or a
precomputed ``fisher`` extra argument (a
:class:`fisher_optax.fisher.DiagonalFisher` or its ``.diag`` tree). The
numerator and :math:`\mathrm{RMS}(g)` still use the mean gradient. Since
:math:`\frac1B\sum_b g_b^2 = \bar g^2 + \mathrm{Var}(g_b)`, the Fisher is up
to about :math:`B` times larger when per-example gradients are noisy, so
unclipped steps shrink by up to :math:`B^{p}` (:math:`\sqrt B` at
``p = 1/2``) and are no longer sign-like: retune the learning rate (typically
upwards) and expect the clip to bind less often. The old value
``"batch_squared"`` still means ``"batch"`` but is deprecated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import optax

from fisher_optax import fisher
from fisher_optax.fisher import numerics
from fisher_optax.fisher import validation

PyTree = Any
ScalarOrSchedule = float | jax.Array | optax.Schedule
MaskOrFn = PyTree | Callable[[PyTree], PyTree] | None

_EPS_MODES = ("paper", "v3")
_LEGACY_SOURCES = {"batch_squared": "batch"}


class FAdamState(NamedTuple):
  """State of :func:`scale_by_fadam`.

  Attributes:
    count: int32 number of steps taken (non-finite steps are not counted).
    mu: momentum of the clipped natural gradient, params-shaped.
    fim: diagonal Fisher estimate, params-shaped. After step ``t`` it equals
      Adam's bias-corrected second moment ``v_hat_t``.
    notfinite_count: int32 number of steps skipped as non-finite (as in
      :func:`optax.apply_if_finite`'s state).
  """

  count: jax.Array
  mu: optax.Updates
  fim: optax.Updates
  notfinite_count: jax.Array


class _Hyper(NamedTuple):
  """The per-step hyperparameters (floats, or arrays under inject)."""

  b1: Any
  eps: Any
  eps2: Any
  clip: Any
  p: Any
  weight_decay: Any
  eps_mode: str
  sqrt_p: bool  # p == 0.5, known statically: sqrt instead of a power.


class _LeafPlan(NamedTuple):
  """Pass 1's per-leaf results: the clips as scalar coefficients."""

  dtype: Any  # The compute dtype.
  b2_hat: jax.Array
  eps_term: jax.Array
  coef_n: jax.Array  # (1 - b1) / max(1, RMS(n) / c).
  # lambda / max(s, RMS(theta s / d) / c), s = eps_term; None: no decay.
  coef_w: jax.Array | None
  mean_squares: tuple[jax.Array, ...]  # ms(g), ms(g / d) [, ms(theta s / d)].


def _checked_hyper(
  b1: Any,
  b2: Any,
  eps: Any,
  eps2: Any,
  clip: Any,
  p: Any,
  weight_decay: Any,
  eps_mode: str,
) -> _Hyper:
  validation.check_in_unit_interval("b1", b1)
  validation.check_in_unit_interval("b2", b2)
  # Zero would leave a coordinate the gradient never reaches (an unused
  # embedding row) with d = 0: theta / d overflows and every step is skipped.
  validation.check_positive("eps", eps)
  validation.check_positive("eps2", eps2)
  validation.check_positive("clip", clip, allow_inf=True)
  if p is not None:
    validation.check_positive("p", p)
  validation.check_positive("weight_decay", weight_decay, allow_zero=True)
  validation.check_choice("eps_mode", eps_mode, _EPS_MODES)
  # None (the default) is a static 1/2, also under inject_hyperparams, which
  # traces numbers: a traced p needs a general power, about 1.4x the cost
  # of a whole train step on XLA:CPU.
  sqrt_p = p is None or (isinstance(p, (int, float)) and p == 0.5)
  p = 0.5 if p is None else p
  return _Hyper(b1, eps, eps2, clip, p, weight_decay, eps_mode, sqrt_p)


def scale_by_fadam(
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps2: float = 1e-2,
  clip: float = 1.0,
  p: float | None = None,
  weight_decay: float = 0.1,
  weight_decay_mask: MaskOrFn = None,
  mu_dtype: jax.typing.DTypeLike | None = None,
  fim_dtype: jax.typing.DTypeLike | None = None,
  *,
  eps_mode: str = "paper",
  fisher_source: str = "batch",
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales updates by the FAdam rule (Fisher Adam), before the lr.

  For each leaf (parameter tensor) with gradient :math:`g` and instantaneous
  Fisher diagonal :math:`s` (:math:`g^2`, see ``fisher_source``), at step
  :math:`t = 1, 2, \dots` and with :math:`\mathrm{RMS}(x) = \sqrt{\mathrm{mean}
  (x^2)}` over that leaf's elements:

  .. math::

    \hat\beta_2 &= \beta_2 \frac{1 - \beta_2^{t-1}}{1 - \beta_2^t}, \qquad
    f \leftarrow \hat\beta_2 f + (1 - \hat\beta_2)\, s \\
    \hat\epsilon &= \min(\epsilon, \epsilon_2 \mathrm{RMS}(g)), \qquad
    d = f^p + \hat\epsilon^{2p} \\
    n &= \frac{g / d}{\max(1, \mathrm{RMS}(g / d) / c)}, \qquad
    m \leftarrow \beta_1 m + (1 - \beta_1)\, n \\
    w &= \frac{\theta / d}{\max(1, \mathrm{RMS}(\theta / d) / c)}, \qquad
    u = m + \lambda w .

  :math:`u` is the step before the learning rate; :math:`f` equals Adam's
  bias-corrected second moment (:math:`\hat\beta_2 = 0` at :math:`t = 1`);
  the momentum is not bias-corrected. The decay is the gradient of a Gaussian
  prior: preconditioned by :math:`d`, clipped on its own, outside the
  momentum. The argument needs a log-likelihood loss (cross-entropy, a
  Gaussian NLL). The module documentation lists the decisions taken where the
  sources disagree (epsilon form, zero leaves, clip, non-finite steps).

  Args:
    b1: decay rate of the momentum of the natural gradient.
    b2: decay rate of the Fisher average (debiased as above).
    eps: upper bound of the adaptive epsilon :math:`\hat\epsilon` (> 0).
    eps2: factor of :math:`\mathrm{RMS}(g)` in :math:`\hat\epsilon` (unused
      with ``eps_mode="v3"``).
    clip: RMS bound :math:`c` of each leaf's natural gradient and decay
      direction; ``float("inf")`` disables both clips.
    p: power of the Fisher in the preconditioner. ``None`` (default) is
      ``1/2``, Adam's square root, kept static under
      :func:`optax.inject_hyperparams`; a number there is injected and
      traced, so the denominator takes a general power (slower).
    weight_decay: :math:`\lambda`, the Fisher-preconditioned weight decay.
    weight_decay_mask: a tree of static bools with the params' structure (or
      a prefix of it, or a callable ``params -> tree``); leaves marked
      ``False`` get no decay. Under :func:`optax.inject_hyperparams` list a
      callable in ``static_args``.
    mu_dtype: dtype of the momentum; default ``promote(param, float32)``.
    fim_dtype: dtype of the Fisher diagonal; default as ``mu_dtype``.
    eps_mode: ``"paper"`` (default) or ``"v3"`` (paper v3's epsilon).
    fisher_source: ``"batch"`` (default, the paper's :math:`s = \bar g^2`)
      or ``"per_example"`` (:math:`s = \frac1B \sum_b g_b^2`, from the
      ``per_example_grads`` or ``fisher`` extra argument).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with state
    :class:`FAdamState`. Its ``update(updates, state, params=None, *,
    per_example_grads=None, fisher=None, **extra_args)`` needs ``params``
    unless ``weight_decay`` is 0 or masked everywhere.

  Example::

    >>> import jax, jax.numpy as jnp, optax, fisher_optax
    >>> tx = optax.chain(fisher_optax.scale_by_fadam(weight_decay=0.0),
    ...                  optax.scale(-1e-2))
    >>> params = jnp.array([1.0, -2.0])
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jnp.array([4.0, 0.5]), state, params)
    >>> print(updates)
    [-0.001 -0.001]

  References:
    Hwang, `FAdam: Adam is a natural gradient optimizer using diagonal
    empirical Fisher information <https://arxiv.org/abs/2405.12807>`_, 2024
  """
  hyper = _checked_hyper(b1, b2, eps, eps2, clip, p, weight_decay, eps_mode)
  source = validation.check_fisher_source(
    fisher_source, function="scale_by_fadam", legacy=_LEGACY_SOURCES
  )
  mu_dtype = numerics.canonical_float_dtype("mu_dtype", mu_dtype)
  fim_dtype = numerics.canonical_float_dtype("fim_dtype", fim_dtype)
  # Python branches on floats only when they are concrete (inject_hyperparams
  # passes arrays).
  # Known zero (a number, or a concrete injected value): params are not
  # needed.
  no_decay = validation.concrete_value(weight_decay) == 0

  def init_fn(params: optax.Params) -> FAdamState:
    validation.check_real_floating(
      params, what="params", function="scale_by_fadam"
    )
    return _init_state(params, mu_dtype, fim_dtype)

  def update_fn(
    updates: optax.Updates,
    state: FAdamState,
    params: optax.Params | None = None,
    *,
    per_example_grads: PyTree | None = None,
    fisher: Any | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, FAdamState]:
    del extra_args
    validation.check_like(
      updates, state.mu, what="updates", reference_name="init's params"
    )
    decay = _decay_mask(weight_decay_mask, updates, params, no_decay)
    stats = _fisher_statistic(source, updates, per_example_grads, fisher)
    thetas = _params_leaves(params, updates)
    # The raw inputs: a finite per-example gradient whose squares overflow
    # is an overflowing step (zero updates), not a non-finite input.
    inputs = stats if per_example_grads is None else per_example_grads
    return _fadam_update(
      updates, state, thetas, decay, stats, b2, hyper, inputs
    )

  # optax types update's state as OptState; ours is an FAdamState.
  return optax.GradientTransformationExtraArgs(
    init_fn,
    update_fn,  # pyright: ignore[reportArgumentType]
  )


def fadam(
  learning_rate: ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps2: float = 1e-2,
  clip: float = 1.0,
  p: float | None = None,
  weight_decay: float = 0.1,
  weight_decay_mask: MaskOrFn = None,
  mu_dtype: jax.typing.DTypeLike | None = None,
  fim_dtype: jax.typing.DTypeLike | None = None,
  *,
  eps_mode: str = "paper",
  fisher_source: str = "batch",
) -> optax.GradientTransformationExtraArgs:
  r"""FAdam (Fisher Adam): natural gradient with a diagonal empirical Fisher.

  :func:`scale_by_fadam` followed by the learning rate:

  .. math::

    \theta_t = \theta_{t-1} - \eta_t \,(m_t + \lambda w_t),

  where :math:`m_t` is the momentum of the clipped natural gradient
  :math:`g / (f^p + \hat\epsilon^{2p})` and :math:`w_t` the clipped,
  Fisher-preconditioned decay direction (see :func:`scale_by_fadam` for the
  full rule and the decisions taken where the sources disagree). A schedule
  scales both terms; a step skipped as non-finite leaves its count
  unchanged, as the rest of the state. Unlike :func:`optax.adamw`, the first step is
  :math:`(1 - \beta_1)\eta\, n_1` (no momentum bias correction), and
  :math:`\lambda` acts on :math:`\theta / d`, so a good :math:`\lambda` is
  on another scale than AdamW's.

  **Learning rate.** Use AdamW's: the clipped natural gradient has Adam's
  scale. Swapped for :func:`optax.adamw` at AdamW's best lr (1e-3 on a
  digits MLP, 400 steps, three seeds) it reached a slightly higher test loss
  (0.063 +- 0.002 vs 0.060 +- 0.001); it also trained well at 3e-2 (0.064).
  Each at its own best lr on that MLP, FAdam's test loss was also slightly
  above AdamW's (by 0.010 +- 0.001), so expect AdamW's quality, not better.

  Args:
    learning_rate: a float or an optax schedule.
    b1: decay rate of the momentum.
    b2: decay rate of the Fisher average.
    eps: upper bound of the adaptive epsilon (> 0).
    eps2: factor of the gradient's RMS in the adaptive epsilon.
    clip: RMS bound of each leaf's natural gradient and decay direction.
    p: power of the Fisher in the preconditioner; ``None``: ``1/2``, static
      under :func:`optax.inject_hyperparams` (see :func:`scale_by_fadam`).
    weight_decay: strength of the Fisher-preconditioned weight decay.
    weight_decay_mask: bool tree or callable; ``False`` leaves are not
      decayed.
    mu_dtype: dtype of the momentum (default: at least float32).
    fim_dtype: dtype of the Fisher diagonal (default: at least float32).
    eps_mode: ``"paper"`` or ``"v3"`` (paper v3's epsilon).
    fisher_source: ``"batch"`` (the squared mean gradient) or
      ``"per_example"`` (needs a ``per_example_grads`` or ``fisher`` extra
      argument in ``update``).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`.

  Example::

    >>> import jax, jax.numpy as jnp, optax, fisher_optax
    >>> loss = lambda p: jnp.sum((p - 1.0) ** 2)
    >>> tx = fisher_optax.fadam(learning_rate=0.1)
    >>> params = jnp.zeros(3)
    >>> state = tx.init(params)
    >>> @jax.jit
    ... def step(params, state):
    ...   grads = jax.grad(loss)(params)
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> for _ in range(100):
    ...   params, state = step(params, state)
    >>> bool(loss(params) < 0.05)
    True

  References:
    Hwang, `FAdam: Adam is a natural gradient optimizer using diagonal
    empirical Fisher information <https://arxiv.org/abs/2405.12807>`_, 2024
  """
  validation.check_learning_rate(learning_rate)
  fisher_source = validation.check_fisher_source(
    fisher_source, function="fadam", legacy=_LEGACY_SOURCES
  )
  chain = optax.chain(
    scale_by_fadam(
      b1=b1,
      b2=b2,
      eps=eps,
      eps2=eps2,
      clip=clip,
      p=p,
      weight_decay=weight_decay,
      weight_decay_mask=weight_decay_mask,
      mu_dtype=mu_dtype,
      fim_dtype=fim_dtype,
      eps_mode=eps_mode,
      fisher_source=fisher_source,
    ),
    optax.scale_by_learning_rate(learning_rate),
  )
  # A skipped step leaves the schedule's count where it was, too.
  return numerics.chain_following(chain, 0)


# -- the rule, leaf by leaf ----------------------------------------------------


def _zeros(leaf: Any, override: jnp.dtype | None) -> jax.Array:
  # Statistics default to at least float32, also for bf16/f16 params;
  # zeros_like keeps a concrete input's sharding.
  dtype = numerics.compute_dtype(leaf) if override is None else override
  return jnp.zeros_like(leaf, dtype)


def _init_state(
  params: optax.Params,
  mu_dtype: jnp.dtype | None,
  fim_dtype: jnp.dtype | None,
) -> FAdamState:
  return FAdamState(
    count=jnp.zeros([], jnp.int32),
    mu=jax.tree.map(lambda x: _zeros(x, mu_dtype), params),
    fim=jax.tree.map(lambda x: _zeros(x, fim_dtype), params),
    notfinite_count=jnp.zeros([], jnp.int32),
  )


def _debiased_b2(b2: Any, count: jax.typing.ArrayLike) -> jax.Array:
  """Returns b2 (1 - b2^(t-1)) / (1 - b2^t) in the widest float available."""
  # A float32 value alone moves a long float64 trajectory visibly.
  wide = jax.dtypes.canonicalize_dtype(jnp.float64)
  b2 = jnp.asarray(b2, jnp.promote_types(jnp.result_type(b2), wide))
  t = jnp.asarray(count).astype(b2.dtype)
  return b2 * (1.0 - b2 ** (t - 1.0)) / (1.0 - b2**t)


def _mean_square(x: jax.Array) -> jax.Array:
  # A reduction, not a dot: a dot over sharded axes needs an explicit
  # out_sharding under explicit-sharding meshes.
  return jnp.sum(jnp.square(x)) / x.size


def _eps_term(ms_g: jax.Array, cd: jnp.dtype, hp: _Hyper) -> jax.Array:
  """The epsilon added to ``f^p``: ``eps_hat^(2p)`` (paper) or ``eps_hat``."""
  rms_g = jnp.sqrt(ms_g)
  if hp.eps_mode == "paper":
    eps_hat = jnp.minimum(hp.eps, hp.eps2 * rms_g)
  else:
    eps_hat = hp.eps * jnp.minimum(1.0, rms_g)
  eps_hat = jnp.where(rms_g > 0, eps_hat, hp.eps).astype(cd)
  if hp.eps_mode == "v3" or hp.sqrt_p:
    term = eps_hat
  else:
    term = eps_hat ** (2.0 * hp.p)
  return jnp.maximum(term, jnp.finfo(cd).tiny)


def _denominator(f: jax.Array, eps_term: jax.Array, hp: _Hyper) -> jax.Array:
  power = jnp.sqrt(f) if hp.sqrt_p else f ** jnp.asarray(hp.p, f.dtype)
  return power + eps_term


def _floor_over(eps_term: jax.Array, d: jax.Array) -> jax.Array:
  """``s / d`` in (0, 1], with ``s`` the denominator's floor ``eps_term``."""
  return eps_term / d


def _new_fisher(
  g: jax.Array, f_old: jax.Array, sq: jax.Array | None, bh: jax.Array, cd: Any
) -> tuple[jax.Array, jax.Array]:
  """The gradient in the compute dtype and the new Fisher diagonal."""
  g32 = jnp.asarray(g, cd)
  sq = jnp.square(g32) if sq is None else jnp.asarray(sq, cd)
  return g32, bh * f_old.astype(cd) + (1.0 - bh) * sq


def _leaf_plan(
  g: jax.Array,
  f_old: jax.Array,
  theta: jax.Array | None,
  decay: bool,
  sq: jax.Array | None,
  b2_hat: jax.Array,
  hp: _Hyper,
) -> _LeafPlan:
  """Pass 1: the per-leaf scalars (RMS of g, n and w) of one leaf.

  The clips become scalar coefficients, so pass 2 fuses into one sweep.
  """
  cd = numerics.compute_dtype(g)
  bh = b2_hat.astype(cd)
  ms_g = _mean_square(jnp.asarray(g, cd))
  eps_term = _eps_term(ms_g, cd, hp)

  def ms_over_d(x: jax.Array | None, after: Any) -> jax.Array:
    """ms(g / d) (x None) or ms(x s / d), from fresh inputs (see
    :func:`fisher_optax.fisher.numerics.fresh`)."""
    g_, f_, sq_, x, bh_, eps_ = numerics.fresh(
      (g, f_old, sq, x, bh, eps_term), after
    )
    g32, f = _new_fisher(g_, f_, sq_, bh_, cd)
    d = _denominator(f, eps_, hp)
    if x is None:  # |g / d| <= 1 / sqrt(1 - b2): no overflow
      return _mean_square(g32 / d)
    return _mean_square(jnp.asarray(x, cd) * _floor_over(eps_, d))

  ms_n = ms_over_d(None, ms_g)
  coef_n = (1.0 - hp.b1) / jnp.maximum(1.0, jnp.sqrt(ms_n) / hp.clip)
  coef_w, mean_squares = None, (ms_g, ms_n)
  if decay:
    # theta / d overflows float32 where d is near its floor s (a leaf whose
    # gradient is tiny: s follows its RMS), though the clip bounds the term;
    # the step was then skipped, every step. theta s / d cannot overflow,
    # and lambda (theta / d) / max(1, RMS(theta / d) / c) equals
    # lambda (theta s / d) / max(s, RMS(theta s / d) / c).
    ms_w = ms_over_d(theta, ms_n)
    coef_w = hp.weight_decay / jnp.maximum(eps_term, jnp.sqrt(ms_w) / hp.clip)
    mean_squares += (ms_w,)
  return _LeafPlan(cd, bh, eps_term, coef_n, coef_w, mean_squares)


def _leaf_step(
  g: jax.Array,
  plan: _LeafPlan,
  m_old: jax.Array,
  f_old: jax.Array,
  theta: jax.Array | None,
  sq: jax.Array | None,
  ok: jax.Array,
  fill: jax.Array,
  hp: _Hyper,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Pass 2: one leaf's output, momentum and Fisher after the policy.

  ``ok`` False keeps the old statistics and outputs ``fill``. The new
  Fisher is recomputed from the inputs, and the weight-decay term takes its
  own denominator (see :func:`fisher_optax.fisher.numerics.fresh`); the
  output reads the stored momentum, since a second read of the old momentum
  would make XLA copy a donated state.
  """
  cd = plan.dtype
  g, f_old, sq, scalars = numerics.fresh((g, f_old, sq, tuple(plan[1:])), ok)
  plan = _LeafPlan(cd, *scalars)
  g32, f = _new_fisher(g, f_old, sq, plan.b2_hat, cd)
  f_new = jnp.where(ok, f, f_old.astype(cd)).astype(f_old.dtype)
  f_d = f_new.astype(cd) if f_new.dtype == cd else f
  m = hp.b1 * m_old.astype(cd) + plan.coef_n * (
    g32 / _denominator(f_d, plan.eps_term, hp)
  )
  m_new = jnp.where(ok, m, m_old.astype(cd)).astype(m_old.dtype)
  out = m_new.astype(cd) if m_new.dtype == cd else m
  if plan.coef_w is not None:
    f_w, eps_w = numerics.fresh((f_d, plan.eps_term), m_new)
    d_w = _denominator(f_w, eps_w, hp)
    out = out + plan.coef_w * (jnp.asarray(theta, cd) * _floor_over(eps_w, d_w))
  out = jnp.where(ok, out, fill.astype(cd))
  return out.astype(jnp.result_type(g)), m_new, f_new


def _narrows(stored: jax.Array, plan: _LeafPlan) -> bool:
  """Whether storing a statistic can overflow (e.g. a float16 ``fim``)."""
  big = lambda dt: jnp.finfo(dt).max
  return bool(big(stored.dtype) < big(plan.dtype))


def _fadam_update(
  updates: optax.Updates,
  state: FAdamState,
  thetas: list[Any],
  decay: list[bool],
  stats: list[Any],
  b2: Any,
  hp: _Hyper,
  inputs: PyTree,
) -> tuple[optax.Updates, FAdamState]:
  """One FAdam step over all leaves, under the non-finite policy.

  Two passes over the leaves (pass 1 reduces, pass 2 writes, see the leaf
  functions), with :func:`fisher_optax.fisher.numerics.skip_nonfinite_step`'s
  policy folded in rather than wrapped around them: that wrapper's cond,
  finiteness checks of the results and select of the old state would cost
  several more passes over the state, and a copy of it when it is donated.
  The policy's decision is known after pass 1: the pass-1 mean squares are
  finite exactly when ``g``, ``g / d`` and ``theta s / d`` are (or overflow
  when squared), and then the new Fisher (a convex combination of finite
  values), momentum and output are finite; so pass 2 selects the old state
  in the same sweep. Only statistics stored narrower than they are computed
  (``mu_dtype``/``fim_dtype``) need a check of the stored values.
  """
  treedef = jax.tree.structure(updates)
  grads = treedef.flatten_up_to(updates)
  mus = treedef.flatten_up_to(state.mu)
  fims = treedef.flatten_up_to(state.fim)
  count_inc = optax.safe_increment(state.count)
  b2_hat = _debiased_b2(b2, count_inc)
  plans = [
    # An empty leaf has nothing to precondition (and mean([]) is NaN).
    None if jnp.size(g) == 0 else _leaf_plan(g, f, th, dc, sq, b2_hat, hp)
    for g, f, th, dc, sq in zip(grads, fims, thetas, decay, stats)
  ]
  # A NaN/Inf gradient makes ms(g) non-finite, so it needs no check of its
  # own here.
  ok = numerics.tree_all_finite(
    ([pl.mean_squares for pl in plans if pl is not None], inputs)
  )
  true, zero = jnp.asarray(True), jnp.zeros([])  # candidates, no policy
  narrow = [
    new
    for g, plan, m, f, theta, sq in zip(grads, plans, mus, fims, thetas, stats)
    if plan is not None and (_narrows(m, plan) or _narrows(f, plan))
    for new in _leaf_step(g, plan, m, f, theta, sq, true, zero, hp)[1:]
  ]
  if narrow:  # statistics stored narrower than computed may overflow
    ok = ok & numerics.tree_all_finite(narrow)
  # The policy's updates on a skipped step: NaN for a non-finite gradient,
  # else zeros; the gradient is read again only on a skipped step.
  fill = numerics.skipped_fill(ok, updates)
  steps = [
    (g, m, f)
    if plan is None
    else _leaf_step(g, plan, m, f, theta, sq, ok, fill, hp)
    for g, plan, m, f, theta, sq in zip(grads, plans, mus, fims, thetas, stats)
  ]
  outs, new_mus, new_fims = zip(*steps) if steps else ((), (), ())
  nf = state.notfinite_count
  return treedef.unflatten(outs), state._replace(
    count=jnp.where(ok, count_inc, state.count),
    mu=treedef.unflatten(new_mus),
    fim=treedef.unflatten(new_fims),
    notfinite_count=jnp.where(ok, nf, optax.safe_increment(nf)),
  )


# -- inputs ---------------------------------------------------------------------


def _flatten_like(tree: PyTree, like: PyTree, what: str) -> list[Any]:
  validation.check_like(tree, like, what=what, reference_name="updates")
  return jax.tree.leaves(tree)


def _params_leaves(params: PyTree | None, updates: PyTree) -> list[Any]:
  """The params' leaves (``None`` each without params), checked."""
  if params is None:
    return [None] * len(jax.tree.leaves(updates))
  validation.check_like(updates, params, what="updates")
  return jax.tree.leaves(params)


def _static_bool(m: Any) -> Any:
  # A concrete array entry (jnp.array(True)) is as static as a Python bool;
  # anything else is left for the mask resolver to reject.
  if isinstance(m, (int, np.ndarray, jax.Array)) and np.ndim(m) == 0:
    try:
      return bool(m)
    except jax.errors.ConcretizationTypeError:
      return m
  return m


def _decay_mask(
  mask: MaskOrFn, updates: PyTree, params: PyTree | None, no_decay: bool
) -> list[bool]:
  """Per-leaf decay flags (static Python bools); checks params are given."""
  if no_decay:
    return [False] * len(jax.tree.leaves(updates))
  if callable(mask):
    if params is None:
      raise ValueError(
        "a callable weight_decay_mask needs params: call "
        "update(updates, state, params)."
      )
    mask = mask(params)
  if mask is not None:
    mask = jax.tree.map(_static_bool, mask)
  resolved = numerics.resolve_mask(mask, updates, name="weight_decay_mask")
  decay = jax.tree.leaves(resolved)
  if params is None and any(decay):
    raise ValueError(
      "scale_by_fadam applies a Fisher-preconditioned weight decay and "
      "needs the current params: call update(updates, state, params), or "
      "set weight_decay=0 (under inject_hyperparams inside jit, also list "
      "it in static_args)."
    )
  return decay


def _fisher_statistic(
  source: str,
  updates: PyTree,
  per_example_grads: PyTree | None,
  stat: Any | None,
) -> list[Any]:
  """Per-leaf instantaneous Fisher diagonal, or None for g^2."""
  if source == "batch":
    return [None] * len(jax.tree.leaves(updates))
  if per_example_grads is not None and stat is not None:
    raise ValueError(
      "fisher_source='per_example' got both per_example_grads and fisher; "
      "pass only one."
    )
  if per_example_grads is not None:
    per_example_grads, _ = numerics.checked_per_example_grads(
      per_example_grads, updates, function="fadam"
    )
    diag = fisher.diagonal_from_grads(per_example_grads, kind="empirical")
    return jax.tree.leaves(diag.diag)
  if stat is not None:
    # A fisher.DiagonalFisher (or any object with .diag) or the tree itself.
    diag = getattr(stat, "diag", stat)
    leaves = _flatten_like(diag, updates, "fisher.diag")
    for path, leaf in jax.tree_util.tree_leaves_with_path(diag):
      # A negative Fisher makes the step non-finite, so every step would be
      # skipped; a non-finite one is left to the non-finite policy.
      if not isinstance(leaf, jax.core.Tracer) and np.any(np.asarray(leaf) < 0):
        raise ValueError(
          f"fisher{jax.tree_util.keystr(path)} has negative entries: a "
          "diagonal Fisher is non-negative."
        )
    return leaves
  raise ValueError(
    "fisher_source='per_example' needs a per_example_grads=... (the "
    "updates' tree with a leading batch axis) or fisher=... (a "
    "fisher_optax.fisher.DiagonalFisher or its .diag) extra argument in "
    "update()."
  )
