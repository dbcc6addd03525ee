# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""FAdam: Adam read as natural gradient descent with a diagonal Fisher."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fisher_optax.fisher import validation

PyTree = Any
ScalarOrSchedule = float | jax.Array | optax.Schedule
MaskOrFn = PyTree | Callable[[PyTree], PyTree] | None

_EPS_MODES = ("paper", "v3")
_FISHER_SOURCES = ("batch_squared", "per_example")


class FAdamState(NamedTuple):
  """State of :func:`scale_by_fadam`.

  Attributes:
    count: int32 number of steps taken (non-finite steps are not counted).
    mu: momentum of the clipped natural gradient, params-shaped.
    fim: diagonal Fisher estimate, params-shaped. After step ``t`` it equals
      Adam's bias-corrected second moment ``v_hat_t``.
  """

  count: jax.Array
  mu: optax.Updates
  fim: optax.Updates


def _state_dtype(leaf: Any, override: jnp.dtype | None) -> jnp.dtype:
  # Statistics default to at least float32, also for bf16/f16 params.
  if override is not None:
    return override
  return jnp.promote_types(jnp.result_type(leaf), jnp.float32)


def _debiased_b2(b2: Any, count: jax.Array) -> jax.Array:
  """Returns b2 (1 - b2^(t-1)) / (1 - b2^t) in the widest float available."""
  # A float32 value alone moves a 25-step float64 trajectory by ~1e-6.
  wide = jax.dtypes.canonicalize_dtype(jnp.float64)
  b2 = jnp.asarray(b2, jnp.promote_types(jnp.result_type(b2), wide))
  t = count.astype(b2.dtype)
  return b2 * (1.0 - b2 ** (t - 1.0)) / (1.0 - b2**t)


def _mean_square(x: jax.Array) -> jax.Array:
  # A reduction, not a dot: a dot over sharded axes needs an explicit
  # out_sharding under explicit-sharding meshes.
  return jnp.mean(jnp.square(x))


def scale_by_fadam(
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps2: float = 1e-2,
  clip: float = 1.0,
  p: float = 0.5,
  weight_decay: float = 0.1,
  weight_decay_mask: MaskOrFn = None,
  mu_dtype: jax.typing.DTypeLike | None = None,
  fim_dtype: jax.typing.DTypeLike | None = None,
  *,
  eps_mode: str = "paper",
  fisher_source: str = "batch_squared",
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales updates by the FAdam rule (Fisher Adam), before the lr.

  For each leaf (parameter tensor) with gradient :math:`g`, at step
  :math:`t = 1, 2, \dots` and with :math:`\mathrm{RMS}(x) = \sqrt{\mathrm{mean}
  (x^2)}` over that leaf's elements:

  .. math::

    \hat\beta_2 &= \beta_2 \frac{1 - \beta_2^{t-1}}{1 - \beta_2^t}, \qquad
    f \leftarrow \hat\beta_2 f + (1 - \hat\beta_2)\, g^2 \\
    \hat\epsilon &= \min(\epsilon, \epsilon_2 \mathrm{RMS}(g)), \qquad
    d = f^p + \hat\epsilon^{2p} \\
    n &= \frac{g / d}{\max(1, \mathrm{RMS}(g / d) / c)}, \qquad
    m \leftarrow \beta_1 m + (1 - \beta_1)\, n \\
    w &= \frac{\theta / d}{\max(1, \mathrm{RMS}(\theta / d) / c)}, \qquad
    u = m + \lambda w .

  The output :math:`u` is the step before the learning rate:
  :func:`fadam` applies :math:`\theta \leftarrow \theta - \eta u`. With the
  time-dependent :math:`\hat\beta_2` (exactly 0 at :math:`t = 1`), :math:`f`
  equals Adam's bias-corrected second moment, so no further correction
  follows. The momentum averages the preconditioned, clipped gradient and is
  not bias-corrected. The decay :math:`\lambda\theta` is read as the gradient
  of a Gaussian prior, so it is preconditioned by the same :math:`d` and
  clipped on its own, and it bypasses the momentum. ``p = 1/2`` is Adam's
  square root; ``p = 1`` the plain inverse diagonal Fisher. Clipping is per
  leaf (no global norm). The paper's argument needs a log-likelihood loss
  (cross-entropy, a Gaussian NLL): the squared gradient of another loss is not
  a Fisher.

  Decisions and ambiguities:

  * ``eps_mode="paper"`` is the rule above; :math:`\hat\epsilon` sits outside
    the power as Adam's :math:`\sqrt{\hat v} + \epsilon`, with the power
    :math:`2p` so that it has the units of :math:`f^p`. This form was
    reconstructed from the reference implementations' histories (the
    pytorch_optimizer 3.11+ form); we could not retrieve the body of the
    paper's Algorithm 1 to check it. ``eps_mode="v3"`` reproduces paper v3 and
    older ports: :math:`\hat\epsilon = \epsilon \min(1, \mathrm{RMS}(g))`,
    :math:`d = f^p + \hat\epsilon`.
  * When :math:`\mathrm{RMS}(g) = 0` (a whole leaf without gradient), both
    modes use :math:`\hat\epsilon = \epsilon`, so zero-Fisher entries give
    ``0 / eps`` = 0, not the ``0 / 0`` of paper v3; the decay still acts.
  * :math:`\hat\epsilon^{2p}` is floored at the smallest normal number of the
    compute dtype, so :math:`d` never underflows to 0.
  * The clip divides by :math:`\max(1, \mathrm{RMS}/c)` as the paper writes
    it; all FAdam_PyTorch revisions and pytorch_optimizer <= 4.0 divide by
    :math:`\max(1, \mathrm{RMS})/c`, which differs when ``clip != 1``.
  * One step counter for all leaves (optax has no missing gradients; exclude
    leaves from the decay with ``weight_decay_mask``).
  * A step whose gradient is non-finite (or whose natural gradient
    overflows) leaves the state, ``count`` included, unchanged and returns
    NaN updates for every leaf, so the failure reaches the caller; wrap the
    optimizer in :func:`optax.apply_if_finite` to skip such steps.
  * Statistics are computed in (at least) float32 and stored, by default, in
    ``promote(param dtype, float32)``; the updates keep the gradient's dtype.

  ``fisher_source="per_example"`` (beyond the paper and its ports) replaces
  :math:`g^2` in the Fisher update by the true diagonal empirical Fisher
  :math:`\frac1B \sum_b g_b^2`, the mean of per-example squared gradients,
  read from a ``per_example_grads`` extra argument (the updates' tree with a
  leading batch axis) or from a ``fisher`` extra (a
  :class:`fisher_optax.fisher.DiagonalFisher` or its ``.diag`` tree). The
  numerator and :math:`\mathrm{RMS}(g)` still use the mean gradient
  ``updates``. Since :math:`\frac1B\sum_b g_b^2 = \bar g^2 +
  \mathrm{Var}(g_b)`, the Fisher is up to about :math:`B` times larger when
  per-example gradients are noisy, so unclipped steps shrink by up to
  :math:`B^{p}` (:math:`\sqrt B` at ``p = 1/2``) and are no longer sign-like:
  retune the learning rate (typically upwards) and expect the clip to bind
  less often.

  Args:
    b1: decay rate of the momentum of the natural gradient.
    b2: decay rate of the Fisher average (debiased as above).
    eps: upper bound of the adaptive epsilon :math:`\hat\epsilon`.
    eps2: factor of :math:`\mathrm{RMS}(g)` in :math:`\hat\epsilon` (unused
      with ``eps_mode="v3"``).
    clip: RMS bound :math:`c` of each leaf's natural gradient and decay
      direction; ``float("inf")`` disables both clips.
    p: power of the Fisher in the preconditioner (``0.5``: Adam).
    weight_decay: :math:`\lambda`, the Fisher-preconditioned weight decay.
    weight_decay_mask: a tree of bools with the params' structure (or a
      callable ``params -> tree``); leaves marked ``False`` get no decay.
      Under :func:`optax.inject_hyperparams` list a callable in
      ``static_args``.
    mu_dtype: dtype of the momentum; default ``promote(param, float32)``.
    fim_dtype: dtype of the Fisher diagonal; default as ``mu_dtype``.
    eps_mode: ``"paper"`` (default) or ``"v3"``, see above.
    fisher_source: ``"batch_squared"`` (default, the paper's
      :math:`\bar g^2`) or ``"per_example"`` (see above).

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
  validation.check_in_unit_interval("b1", b1)
  validation.check_in_unit_interval("b2", b2)
  validation.check_positive("eps", eps, allow_zero=True)
  validation.check_positive("eps2", eps2, allow_zero=True)
  validation.check_positive("clip", clip)
  validation.check_positive("p", p)
  validation.check_positive("weight_decay", weight_decay, allow_zero=True)
  validation.check_choice("eps_mode", eps_mode, _EPS_MODES)
  validation.check_choice("fisher_source", fisher_source, _FISHER_SOURCES)
  mu_dtype = _canonical_float_dtype("mu_dtype", mu_dtype)
  fim_dtype = _canonical_float_dtype("fim_dtype", fim_dtype)
  # Python branches on floats only when they are concrete (inject_hyperparams
  # passes arrays).
  no_decay = isinstance(weight_decay, (int, float)) and weight_decay == 0
  sqrt_p = isinstance(p, (int, float)) and p == 0.5

  def init_fn(params: optax.Params) -> FAdamState:
    # zeros_like keeps a concrete input's sharding.
    mu = jax.tree.map(
      lambda x: jnp.zeros_like(x, _state_dtype(x, mu_dtype)), params
    )
    fim = jax.tree.map(
      lambda x: jnp.zeros_like(x, _state_dtype(x, fim_dtype)), params
    )
    return FAdamState(count=jnp.zeros([], jnp.int32), mu=mu, fim=fim)

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
    treedef = jax.tree.structure(updates)
    grads = treedef.flatten_up_to(updates)
    n_leaves = len(grads)

    decay_mask = _decay_mask(weight_decay_mask, updates, params, no_decay)
    if params is None and any(m is not False for m in decay_mask):
      raise ValueError(
        "scale_by_fadam applies a Fisher-preconditioned weight decay and "
        "needs the current params: call update(updates, state, params), or "
        "set weight_decay=0."
      )
    thetas = (
      [None] * n_leaves
      if params is None
      else _flatten_like(params, updates, "params")
    )
    sq_stats = _fisher_statistic(
      fisher_source, updates, per_example_grads, fisher
    )

    count_inc = optax.safe_increment(state.count)
    b2_hat = _debiased_b2(b2, count_inc)

    def eps_term_of(ms_g: jax.Array, cd: jnp.dtype) -> jax.Array:
      rms_g = jnp.sqrt(ms_g)
      if eps_mode == "paper":
        eps_hat = jnp.minimum(eps, eps2 * rms_g)
      else:
        eps_hat = eps * jnp.minimum(1.0, rms_g)
      eps_hat = jnp.where(rms_g > 0, eps_hat, eps).astype(cd)
      term = eps_hat if (eps_mode == "v3" or sqrt_p) else eps_hat ** (2.0 * p)
      return jnp.maximum(term, jnp.finfo(cd).tiny)

    def denominator(f: jax.Array, eps_term: jax.Array) -> jax.Array:
      return (
        jnp.sqrt(f) if sqrt_p else f ** jnp.asarray(p, f.dtype)
      ) + eps_term

    # Pass 1: per-leaf scalars (RMS of g, n and w). The clips become scalar
    # coefficients, so pass 2 fuses into one sweep over each leaf.
    leaves, finite = [], []
    for g, f_old, theta, mask, sq in zip(
      grads, treedef.flatten_up_to(state.fim), thetas, decay_mask, sq_stats
    ):
      if jnp.size(g) == 0:  # Nothing to precondition; avoid mean([]) = NaN.
        leaves.append(None)
        continue
      cd = jnp.promote_types(jnp.result_type(g), jnp.float32)
      g32 = jnp.asarray(g, cd)
      bh = b2_hat.astype(cd)
      sq = jnp.square(g32) if sq is None else jnp.asarray(sq, cd)
      ms_g = _mean_square(g32)
      eps_term = eps_term_of(ms_g, cd)
      d = denominator(bh * f_old.astype(cd) + (1.0 - bh) * sq, eps_term)
      ms_n = _mean_square(g32 / d)
      # (1 - b1) n / max(1, RMS(n) / c) and lambda w / max(1, RMS(w) / c) as
      # scalar coefficients of g / d and theta / d.
      coef_n = (1.0 - b1) / jnp.maximum(1.0, jnp.sqrt(ms_n) / clip)
      coef_w = None
      if mask is not False:
        ms_w = _mean_square(jnp.asarray(theta, cd) / d)
        coef_w = weight_decay / jnp.maximum(1.0, jnp.sqrt(ms_w) / clip)
        if mask is not True:  # A traced mask entry.
          coef_w = jnp.where(mask, coef_w, 0.0)
      finite.append(jnp.isfinite(ms_g) & jnp.isfinite(ms_n))
      leaves.append((g32, sq, bh, eps_term, coef_n, coef_w))

    # Pass 2: state and output. A non-finite step keeps the state and returns
    # NaN updates; the selects act on scalars and on the gradient, never on
    # whole state arrays, so XLA can update the state in place.
    ok = jnp.all(jnp.stack(finite)) if finite else jnp.array(True)
    outs, mus, fims = [], [], []
    for g, leaf, m_old, f_old, theta in zip(
      grads,
      leaves,
      treedef.flatten_up_to(state.mu),
      treedef.flatten_up_to(state.fim),
      thetas,
    ):
      if leaf is None:
        outs.append(g)
        mus.append(m_old)
        fims.append(f_old)
        continue
      g32, sq, bh, eps_term, coef_n, coef_w = leaf
      cd = g32.dtype
      zero = jnp.zeros((), cd)
      f = jnp.where(ok, bh, 1.0) * f_old.astype(cd) + jnp.where(
        ok, 1.0 - bh, zero
      ) * jnp.where(ok, sq, zero)
      d = denominator(f, jnp.where(ok, eps_term, 1.0).astype(cd))
      m = jnp.where(ok, b1, 1.0) * m_old.astype(cd) + jnp.where(
        ok, coef_n, zero
      ) * (jnp.where(ok, g32, zero) / d)
      out = m if coef_w is None else m + coef_w * (jnp.asarray(theta, cd) / d)
      out = jnp.where(ok, out, jnp.nan)
      outs.append(out.astype(jnp.result_type(g)))
      mus.append(m.astype(m_old.dtype))
      fims.append(f.astype(f_old.dtype))
    count = jnp.where(ok, count_inc, state.count)
    return treedef.unflatten(outs), FAdamState(
      count=count, mu=treedef.unflatten(mus), fim=treedef.unflatten(fims)
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def fadam(
  learning_rate: ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps2: float = 1e-2,
  clip: float = 1.0,
  p: float = 0.5,
  weight_decay: float = 0.1,
  weight_decay_mask: MaskOrFn = None,
  mu_dtype: jax.typing.DTypeLike | None = None,
  fim_dtype: jax.typing.DTypeLike | None = None,
  *,
  eps_mode: str = "paper",
  fisher_source: str = "batch_squared",
) -> optax.GradientTransformationExtraArgs:
  r"""FAdam (Fisher Adam): natural gradient with a diagonal empirical Fisher.

  :func:`scale_by_fadam` followed by the learning rate:

  .. math::

    \theta_t = \theta_{t-1} - \eta_t \,(m_t + \lambda w_t),

  where :math:`m_t` is the momentum of the clipped natural gradient
  :math:`g / (f^p + \hat\epsilon^{2p})` and :math:`w_t` the clipped,
  Fisher-preconditioned decay direction (see :func:`scale_by_fadam` for the
  full rule and the decisions taken where the sources disagree). A schedule
  scales both terms. Unlike :func:`optax.adamw`, the first step is
  :math:`(1 - \beta_1)\eta\, n_1` (no momentum bias correction), and
  :math:`\lambda` acts on :math:`\theta / d`, so a good :math:`\lambda` is
  on another scale than AdamW's.

  Args:
    learning_rate: a float or an optax schedule.
    b1: decay rate of the momentum.
    b2: decay rate of the Fisher average.
    eps: upper bound of the adaptive epsilon.
    eps2: factor of the gradient's RMS in the adaptive epsilon.
    clip: RMS bound of each leaf's natural gradient and decay direction.
    p: power of the Fisher in the preconditioner.
    weight_decay: strength of the Fisher-preconditioned weight decay.
    weight_decay_mask: bool tree or callable; ``False`` leaves are not
      decayed.
    mu_dtype: dtype of the momentum (default: at least float32).
    fim_dtype: dtype of the Fisher diagonal (default: at least float32).
    eps_mode: ``"paper"`` or ``"v3"`` (paper v3's epsilon).
    fisher_source: ``"batch_squared"`` or ``"per_example"`` (needs a
      ``per_example_grads`` or ``fisher`` extra argument in ``update``).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`.

  Example::

    >>> import jax, jax.numpy as jnp, optax, fisher_optax
    >>> loss = lambda p: jnp.sum((p - 1.0) ** 2)
    >>> tx = fisher_optax.fadam(learning_rate=0.1)
    >>> params = jnp.zeros(3)
    >>> state = tx.init(params)
    >>> for _ in range(100):
    ...   grads = jax.grad(loss)(params)
    ...   updates, state = tx.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> bool(loss(params) < 0.05)
    True

  References:
    Hwang, `FAdam: Adam is a natural gradient optimizer using diagonal
    empirical Fisher information <https://arxiv.org/abs/2405.12807>`_, 2024
  """
  validation.check_learning_rate(learning_rate)
  return optax.chain(
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


# -- helpers -------------------------------------------------------------------


def _canonical_float_dtype(name: str, dtype: Any) -> jnp.dtype | None:
  if dtype is None:
    return None
  try:
    dtype = jax.dtypes.canonicalize_dtype(dtype)
  except TypeError as e:
    raise TypeError(f"{name} must be a float dtype, got {dtype!r}.") from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name} must be a float dtype, got {dtype}.")
  return dtype


def _flatten_like(tree: PyTree, like: PyTree, what: str) -> list[Any]:
  validation.check_same_structure(like, tree, what=what)
  leaves = jax.tree.leaves(tree)
  for leaf, ref in zip(leaves, jax.tree.leaves(like)):
    if jnp.shape(leaf) != jnp.shape(ref):
      raise ValueError(
        f"{what} leaves must have the updates' shapes, got {jnp.shape(leaf)}"
        f" where the updates have {jnp.shape(ref)}."
      )
  return leaves


def _decay_mask(
  mask: MaskOrFn, updates: PyTree, params: PyTree | None, no_decay: bool
) -> list[Any]:
  """Per-leaf decay flags: False, True or a traced bool."""
  n = len(jax.tree.leaves(updates))
  if no_decay:
    return [False] * n
  if mask is None:
    return [True] * n
  if callable(mask):
    if params is None:
      raise ValueError(
        "a callable weight_decay_mask needs params: call "
        "update(updates, state, params)."
      )
    mask = mask(params)
  validation.check_same_structure(updates, mask, what="weight_decay_mask")
  return [
    bool(m) if isinstance(m, (bool, int, np.bool_)) else m
    for m in jax.tree.leaves(mask)
  ]


def _fisher_statistic(
  source: str,
  updates: PyTree,
  per_example_grads: PyTree | None,
  fisher: Any | None,
) -> list[Any]:
  """Per-leaf instantaneous Fisher diagonal, or None for g^2."""
  n = len(jax.tree.leaves(updates))
  if source == "batch_squared":
    return [None] * n
  if per_example_grads is not None and fisher is not None:
    raise ValueError(
      "fisher_source='per_example' got both per_example_grads and fisher; "
      "pass only one."
    )
  if per_example_grads is not None:
    batch = validation.check_leading_axis(
      per_example_grads, updates, what="per_example_grads"
    )
    if batch == 0:
      raise ValueError("per_example_grads has an empty batch axis.")
    return [
      jnp.mean(
        jnp.square(
          jnp.asarray(x, jnp.promote_types(jnp.result_type(x), jnp.float32))
        ),
        axis=0,
      )
      for x in jax.tree.leaves(per_example_grads)
    ]
  if fisher is not None:
    diag = getattr(fisher, "diag", fisher)
    return _flatten_like(diag, updates, "fisher.diag")
  raise ValueError(
    "fisher_source='per_example' needs a per_example_grads=... (the "
    "updates' tree with a leading batch axis) or fisher=... (a "
    "fisher_optax.fisher.DiagonalFisher or its .diag) extra argument in "
    "update()."
  )
