# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Likelihoods and the map from a Fisher ``kind`` to output cotangents.

A likelihood turns model outputs into a distribution over targets. For an
example ``n`` with outputs ``f_n`` and Jacobian ``J_n = d f_n / d theta``,
every kind of Fisher is a mean of outer products of *pseudo-gradients*

.. math::

  F = \\frac{1}{N} \\sum_n \\sum_s g_{s,n} g_{s,n}^\\top, \\qquad
  g_{s,n} = J_n^\\top r_{s,n},

so a kind is fully described by its output cotangents ``r_{s,n}``:

- ``empirical``: one cotangent, ``r = d NLL(f_n, y_n) / d f_n`` (dataset label);
- ``mc`` (``k`` samples): ``r_s = d NLL(f_n, yhat_s) / d f_n / sqrt(k)`` with
  ``yhat_s ~ p(. | f_n)`` (labels are constants, not differentiated);
- ``exact``: ``r_s`` = column ``s`` of ``S_n`` with ``S_n S_n^T = Lambda_n``,
  the closed-form Fisher of the output distribution w.r.t. ``f_n``;
- ``batch_squared``: not per-example; the square of the mean gradient.

Per-example shapes: every method takes ONE example's ``output`` (the model
output without its batch axis) except :meth:`Likelihood.sample`, which works
on a batch. Event axes of an output are independent (a sequence of logits is a
product of categoricals), and the NLL of an example is the sum over them.
"""

from __future__ import annotations

from collections.abc import Callable
import math
from typing import Any

import jax
import jax.numpy as jnp

from fisher_optax.fisher import validation

KINDS = ("empirical", "mc", "exact", "batch_squared")


class Likelihood:
  """Base class: an output distribution ``p(y | f)`` for one example.

  Subclasses implement :meth:`nll`, :meth:`sample` and :meth:`sqrt_fisher`;
  :meth:`grad_out` defaults to autodiff of :meth:`nll`, and
  :meth:`sqrt_fisher_columns` to indexing :meth:`sqrt_fisher` (the built-in
  likelihoods form the columns they are asked for instead).
  """

  #: Kinds this likelihood can estimate.
  kinds: tuple[str, ...] = KINDS

  def nll(self, output: jax.Array, target: jax.Array) -> jax.Array:
    """Negative log-likelihood of one example (summed over event axes)."""
    raise NotImplementedError

  def grad_out(self, output: jax.Array, target: jax.Array) -> jax.Array:
    """``d nll / d output`` for one example, shaped like ``output``."""
    return jax.grad(self.nll)(output, target)

  def sample(
    self, key: jax.Array, outputs: jax.Array, num_samples: int
  ) -> jax.Array:
    """Targets ``(num_samples, B, ...)`` drawn from ``p(. | outputs)``."""
    raise NotImplementedError

  def sqrt_fisher(self, output: jax.Array) -> jax.Array:
    """Columns of ``S``, ``S S^T = Lambda``: ``(num_columns, *output.shape)``."""
    raise NotImplementedError

  def sqrt_fisher_columns(self, output: jax.Array, idx: jax.Array) -> jax.Array:
    """Columns ``idx`` (in range) of :meth:`sqrt_fisher`: ``(n, *output.shape)``.

    The exact kind's backward passes take a few columns at a time; on
    sequence outputs ``num_columns = T * C`` and all of them together
    would be ``T`` times the outputs' size per column.
    """
    return self.sqrt_fisher(output)[idx]

  def check(self, outputs: Any, targets: Any = None) -> None:
    """Checks a batch's outputs (and targets) at trace time.

    Shapes and dtypes are static, so a mismatch raises here, before any
    statistic is computed; values (e.g. a class label out of range) are not
    static and turn the statistic NaN instead (see :meth:`nll`). The base
    class checks nothing: a bare loss decides what it accepts.

    Args:
      outputs: the model outputs ``(B, ...)`` (an array or a
        ``ShapeDtypeStruct``).
      targets: the targets ``(B, ...)``, or ``None``.

    Raises:
      ValueError: shapes that do not match.
      TypeError: a target dtype the likelihood cannot take.
    """
    del outputs, targets

  def __repr__(self) -> str:
    return f"{type(self).__name__}()"


def _shape(x: Any) -> tuple[int, ...]:
  return tuple(jnp.shape(x))


def _check_same_shape(name: str, outputs: Any, targets: Any) -> None:
  """Targets shaped exactly like the outputs (no broadcasting)."""
  if _shape(targets) != _shape(outputs):
    raise ValueError(
      f"{name} needs targets shaped exactly like the outputs "
      f"{_shape(outputs)}, got {_shape(targets)}; targets are not "
      "broadcast (reshape them if that is what you mean)."
    )


def _check_real_targets(name: str, targets: Any, *, allow_bool: bool) -> None:
  dtype = jnp.result_type(targets)
  ok = jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
  if not ok and not (allow_bool and dtype == jnp.bool_):
    raise TypeError(
      f"{name} needs real-valued (float or integer) targets, got {dtype}."
    )


def _check_event_axis(name: str, outputs: Any, size: int | None, what: str):
  """Outputs ``(B, ..., k)`` with a last (event) axis, of ``size`` if given."""
  shape = _shape(outputs)
  if len(shape) < 2 or (size is not None and shape[-1] != size):
    want = f"(B, ..., {size})" if size is not None else "(B, ..., C)"
    raise ValueError(
      f"{name} needs outputs {want} with {what} on the last axis; got "
      f"outputs of shape {shape}."
    )


class Categorical(Likelihood):
  """Categorical over the last output axis; outputs are logits.

  Outputs are logits ``(B, ..., C)``; targets are integer class labels
  ``(B, ...)`` (the outputs without the class axis). A label outside
  ``[0, C)`` gives a NaN loss and gradient, so every statistic it enters is
  NaN and its ``is_finite()`` is False (labels are values, not shapes: they
  cannot be checked at trace time). The exact Fisher of the logits is
  ``Lambda = diag(p) - p p^T`` with columns ``s_c = sqrt(p_c) (e_c - p)``
  (one per class and event position).
  """

  def check(self, outputs, targets=None):
    _check_event_axis("Categorical", outputs, None, "the class logits")
    if targets is None:
      return
    dtype = jnp.result_type(targets)
    if not jnp.issubdtype(dtype, jnp.integer):
      raise TypeError(
        f"Categorical needs integer class labels, got {dtype} targets "
        "(for soft labels use a per-example loss as the likelihood)."
      )
    if _shape(targets) != _shape(outputs)[:-1]:
      raise ValueError(
        "Categorical needs targets shaped like the outputs without their "
        f"class axis, {_shape(outputs)[:-1]}; got {_shape(targets)}."
      )

  def nll(self, output, target):
    c = output.shape[-1]
    target = jnp.asarray(target, jnp.int32)
    valid = (target >= 0) & (target < c)
    logp = jax.nn.log_softmax(output, axis=-1)
    picked = jnp.take_along_axis(
      logp, jnp.where(valid, target, 0)[..., None], axis=-1
    )[..., 0]
    return -jnp.sum(jnp.where(valid, picked, jnp.nan))

  def grad_out(self, output, target):
    c = output.shape[-1]
    valid = (target >= 0) & (target < c)
    p = jax.nn.softmax(output, axis=-1)
    grad = p - jax.nn.one_hot(target, c, dtype=output.dtype)
    return jnp.where(valid[..., None], grad, jnp.nan)

  def sample(self, key, outputs, num_samples):
    return jax.random.categorical(
      key, outputs, axis=-1, shape=(num_samples, *outputs.shape[:-1])
    )

  def sqrt_fisher(self, output):
    return self.sqrt_fisher_columns(output, jnp.arange(output.size))

  def sqrt_fisher_columns(self, output, idx):
    c = output.shape[-1]
    lead = output.shape[:-1]
    t = math.prod(lead)
    p = jax.nn.softmax(output, axis=-1).reshape(t, c)
    # Column (t, k) = sqrt(p_tk) (e_k - p_t) at position t: event positions
    # are independent, so it is zero away from t.
    # One-hot products rather than gathers: n is a few columns per pass.
    at = jax.nn.one_hot(idx // c, t, dtype=p.dtype)
    e_k = jax.nn.one_hot(idx % c, c, dtype=p.dtype)
    p_pos = jnp.matmul(at, p, precision=jax.lax.Precision.HIGHEST)  # no TF32
    val = jnp.sqrt(jnp.sum(p_pos * e_k, -1, keepdims=True)) * (e_k - p_pos)
    cols = at[:, :, None] * val[:, None]
    return cols.reshape(idx.shape[0], *lead, c)


class Gaussian(Likelihood):
  """Gaussian with mean ``output`` and a fixed scalar ``sigma``.

  ``nll = |y - f|^2 / (2 sigma^2)`` (constants dropped) and
  ``Lambda = I / sigma^2``.
  With ``sigma = 1`` the empirical Fisher is that of the squared error
  ``0.5 |y - f|^2``.

  Args:
    sigma: the noise scale, ``> 0``; a float or a scalar array.
  """

  def __init__(self, sigma: float | jax.Array = 1.0):
    validation.check_positive("sigma", sigma)
    self.sigma = sigma

  def check(self, outputs, targets=None):
    if targets is not None:
      _check_real_targets("Gaussian", targets, allow_bool=False)
      _check_same_shape("Gaussian", outputs, targets)

  def nll(self, output, target):
    return 0.5 * jnp.sum(jnp.square(output - target)) / self.sigma**2

  def grad_out(self, output, target):
    return (output - target) / self.sigma**2

  def sample(self, key, outputs, num_samples):
    noise = jax.random.normal(key, (num_samples, *outputs.shape), outputs.dtype)
    return outputs[None] + self.sigma * noise

  def sqrt_fisher(self, output):
    return self.sqrt_fisher_columns(output, jnp.arange(output.size))

  def sqrt_fisher_columns(self, output, idx):
    scale = jnp.ones((output.size,), output.dtype) / self.sigma
    return _diagonal_columns(scale, idx, output.shape)

  def __repr__(self) -> str:
    return f"Gaussian(sigma={self.sigma})"


class Bernoulli(Likelihood):
  """Independent Bernoulli per output element; outputs are logits.

  Targets are 0/1 labels (or soft labels in ``[0, 1]``) shaped exactly like
  the outputs; a target outside ``[0, 1]`` gives a NaN loss and gradient.
  ``Lambda = diag(p (1 - p))``.
  """

  def check(self, outputs, targets=None):
    if targets is not None:
      _check_real_targets("Bernoulli", targets, allow_bool=True)
      _check_same_shape("Bernoulli", outputs, targets)

  def nll(self, output, target):
    nll = jax.nn.softplus(output) - target * output
    return jnp.sum(jnp.where(_in_unit_interval(target), nll, jnp.nan))

  def grad_out(self, output, target):
    # sigmoid(x) - t as (1 - t) s(x) - t s(-x): no float32 cancellation at
    # large logits with target 1 (sigmoid(20) - 1 rounds to 0).
    grad = (1 - target) * jax.nn.sigmoid(output) - target * jax.nn.sigmoid(
      -output
    )
    return jnp.where(_in_unit_interval(target), grad, jnp.nan)

  def sample(self, key, outputs, num_samples):
    p = jax.nn.sigmoid(outputs)
    return jax.random.bernoulli(key, p, (num_samples, *outputs.shape)).astype(
      outputs.dtype
    )

  def sqrt_fisher(self, output):
    return self.sqrt_fisher_columns(output, jnp.arange(output.size))

  def sqrt_fisher_columns(self, output, idx):
    x = output.ravel()
    # p (1 - p) as s(x) s(-x): 1 - p rounds to 0 at large positive logits.
    scale = jnp.sqrt(jax.nn.sigmoid(x) * jax.nn.sigmoid(-x))
    return _diagonal_columns(scale, idx, output.shape)


def _diagonal_columns(scale: jax.Array, idx: jax.Array, shape) -> jax.Array:
  """Columns ``idx`` of ``diag(scale)``, each shaped ``shape``."""
  cols = jax.nn.one_hot(idx, scale.shape[0], dtype=scale.dtype) * scale
  return cols.reshape(idx.shape[0], *shape)


def _in_unit_interval(target: jax.Array) -> jax.Array:
  return (target >= 0) & (target <= 1)


class HeteroscedasticGaussian(Likelihood):
  """Gaussian whose last output axis is ``(mean, log variance)``.

  Outputs have shape ``(B, ..., 2)``; targets shape ``(B, ...)``, under
  every kind. ``nll = (log v + (y - mu)^2 / v) / 2`` and the Fisher w.r.t.
  ``(mu, log v)`` is ``diag(1 / v, 1 / 2)``.
  """

  def check(self, outputs, targets=None):
    _check_event_axis(
      "HeteroscedasticGaussian", outputs, 2, "(mean, log variance)"
    )
    if targets is None:
      return
    _check_real_targets("HeteroscedasticGaussian", targets, allow_bool=False)
    if _shape(targets) != _shape(outputs)[:-1]:
      raise ValueError(
        "HeteroscedasticGaussian needs targets shaped like the outputs "
        f"without their (mean, log variance) axis, {_shape(outputs)[:-1]}; "
        f"got {_shape(targets)}."
      )

  def nll(self, output, target):
    mu, logvar = output[..., 0], output[..., 1]
    return 0.5 * jnp.sum(logvar + jnp.square(target - mu) * jnp.exp(-logvar))

  def sample(self, key, outputs, num_samples):
    mu, logvar = outputs[..., 0], outputs[..., 1]
    noise = jax.random.normal(key, (num_samples, *mu.shape), outputs.dtype)
    return mu[None] + jnp.exp(0.5 * logvar)[None] * noise

  def sqrt_fisher(self, output):
    return self.sqrt_fisher_columns(output, jnp.arange(output.size))

  def sqrt_fisher_columns(self, output, idx):
    if output.shape[-1:] != (2,):
      raise ValueError(
        "HeteroscedasticGaussian needs outputs with a last axis of size 2 "
        f"(mean, log variance); got per-example shape {output.shape}."
      )
    logvar = output[..., 1]
    d = jnp.stack(
      [jnp.exp(-0.5 * logvar), jnp.full_like(logvar, math.sqrt(0.5))], -1
    )
    return _diagonal_columns(d.ravel(), idx, output.shape)


class LossLikelihood(Likelihood):
  """A bare per-example loss ``loss(output, target) -> scalar``.

  It defines no distribution, so only ``empirical`` and ``batch_squared``
  are available (there is nothing to sample from or take an expectation
  under). Any callable passed as ``likelihood=`` is wrapped in this class.
  """

  kinds = ("empirical", "batch_squared")

  def __init__(self, loss: Callable[[jax.Array, jax.Array], jax.Array]):
    self.loss = loss

  def nll(self, output, target):
    return self.loss(output, target)

  def __repr__(self) -> str:
    name = getattr(self.loss, "__name__", type(self.loss).__name__)
    return f"LossLikelihood({name})"


def as_likelihood(likelihood: Any) -> Likelihood:
  """Returns a :class:`Likelihood`; callables become :class:`LossLikelihood`."""
  if isinstance(likelihood, Likelihood):
    return likelihood
  loss: Any = likelihood  # any callable loss(output, target)
  if callable(likelihood):
    return LossLikelihood(loss)
  raise TypeError(
    "likelihood must be a fisher_optax.fisher likelihood (Categorical(), "
    "Gaussian(sigma), Bernoulli(), HeteroscedasticGaussian()) or a "
    f"per-example loss callable loss(output, target); got {likelihood!r}."
  )


def check_kind(likelihood: Likelihood, kind: str) -> str:
  """Validates ``kind`` against :data:`KINDS` and what ``likelihood`` can do."""
  validation.check_choice("kind", kind, KINDS)
  if kind not in likelihood.kinds:
    raise ValueError(
      f"kind={kind!r} needs a probabilistic likelihood, but {likelihood!r} "
      f"only supports {likelihood.kinds}. Pass e.g. likelihood=Categorical()"
      " instead of a bare loss."
    )
  return kind


def output_cotangents(
  likelihood: Likelihood,
  kind: str,
  outputs: jax.Array,
  targets: jax.Array | None,
  *,
  key: jax.Array | None = None,
  num_samples: int = 1,
  columns: tuple[jax.Array, int] | None = None,
  first: jax.Array | int = 0,
) -> jax.Array:
  """Returns the cotangents ``r`` of shape ``(S, B, *outputs.shape[1:])``.

  ``mc`` draws example ``n``'s labels with ``fold_in(key, first + n)``:
  ``first`` is the index of ``outputs[0]`` in the whole batch, so the draws
  do not depend on how the batch is chunked or split over devices.

  ``batch_squared`` returns the empirical cotangents (``S = 1``); the
  squaring of the mean happens in the estimator. Computed in float32 (or
  wider) and cast back to ``outputs.dtype`` so they can be pulled back
  through the model. Outputs and targets are checked first
  (:meth:`Likelihood.check`). ``columns=(start, n)`` (``exact`` only)
  returns ``r[start : start + n]``, zero past ``S``, formed alone.
  """
  likelihood.check(outputs, targets)
  dtype = outputs.dtype
  work = outputs.astype(jnp.promote_types(dtype, jnp.float32))
  if kind in ("empirical", "batch_squared"):
    if targets is None:
      raise ValueError(
        f"kind={kind!r} needs targets: batch=(inputs, targets)"
        ", got targets=None."
      )
    r = jax.vmap(likelihood.grad_out)(work, targets)[None]
  elif kind == "mc":
    if key is None:
      raise ValueError("kind='mc' samples labels and needs key=, a PRNG key.")
    index = first + jnp.arange(work.shape[0])
    keys = jax.vmap(lambda n: jax.random.fold_in(key, n))(index)
    draw = lambda k, o: likelihood.sample(k, o[None], num_samples)[:, 0]
    yhat = jax.lax.stop_gradient(jax.vmap(draw, out_axes=1)(keys, work))
    r = jax.vmap(jax.vmap(likelihood.grad_out), in_axes=(None, 0))(
      work, yhat
    ) / jnp.sqrt(jnp.asarray(num_samples, work.dtype))
  elif kind == "exact" and columns is None:
    r = jnp.moveaxis(jax.vmap(likelihood.sqrt_fisher)(work), 1, 0)
  elif kind == "exact" and columns is not None:
    start, n = columns
    num = jax.eval_shape(likelihood.sqrt_fisher, work[0]).shape[0]
    idx = start + jnp.arange(n)
    pick = jax.vmap(likelihood.sqrt_fisher_columns, in_axes=(0, None))
    r = jnp.moveaxis(pick(work, jnp.minimum(idx, num - 1)), 1, 0)
    keep = (idx < num).reshape((n,) + (1,) * (r.ndim - 1))
    r = jnp.where(keep, r, jnp.zeros((), r.dtype))
  else:
    raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}.")
  return r.astype(dtype)
