# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The generic per-example path: ``vmap(grad)``, chunked with ``lax.map``/scan.

Chunking splits a batch of ``B`` examples into ``B // c`` chunks of ``c``
examples (mapped sequentially with ``lax.map``/``lax.scan``, each chunk
vectorised with ``vmap``) and one exact remainder of ``B % c`` examples, so
peak memory grows with ``c``, not with ``B``, and no example is dropped or
padded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fisher_optax.fisher import validation

PyTree = Any


def check_batch_tree(batch: PyTree, *, what: str = "batch") -> int:
  """Checks every leaf is an array with one common leading axis; returns it.

  Raises:
    TypeError: a leaf that is not an array.
    ValueError: no leaves, a scalar leaf, leaves that disagree on the leading
      axis, or an empty batch (a mean over no examples is undefined).
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(batch)
  if not flat:
    raise ValueError(f"{what} has no array leaves.")
  sizes = {}
  for path, leaf in flat:
    name = what + jax.tree_util.keystr(path)
    if not isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
      raise TypeError(
        f"{name} must be an array (jax.Array or numpy.ndarray) with a "
        f"leading batch axis, got {type(leaf).__name__}."
      )
    if not leaf.shape:
      raise ValueError(f"{name} is a scalar; it needs a leading batch axis.")
    sizes.setdefault(leaf.shape[0], name)
  if len(sizes) > 1:
    detail = ", ".join(f"{n}: {s}" for s, n in sizes.items())
    raise ValueError(
      f"{what} leaves disagree on the leading (batch) axis ({detail})."
    )
  (size,) = sizes
  if size == 0:
    raise ValueError(
      f"{what} is empty (a leading batch axis of 0): a Fisher statistic is a "
      "mean over examples and needs at least one."
    )
  return size


def check_chunk_size(chunk_size: Any) -> int | None:
  if chunk_size is None:
    return None
  return validation.check_static_int("chunk_size", chunk_size, minimum=1)


def map_chunks(
  fn: Callable[..., PyTree], xs: PyTree, size: int, chunk_size: int | None
) -> PyTree:
  """``vmap(fn)(xs)`` over the leading axis, ``chunk_size`` rows at a time.

  The output keeps the leading axis ``size`` (``lax.map`` over the full
  chunks, then the remainder, concatenated).
  """
  vfn = jax.vmap(fn)
  if chunk_size is None or chunk_size >= size:
    return vfn(xs)
  q, rem = divmod(size, chunk_size)
  main = jax.tree.map(
    lambda a: a[: q * chunk_size].reshape(q, chunk_size, *a.shape[1:]), xs
  )
  out = jax.lax.map(vfn, main)
  out = jax.tree.map(lambda a: a.reshape(q * chunk_size, *a.shape[2:]), out)
  if rem:
    tail = vfn(jax.tree.map(lambda a: a[q * chunk_size :], xs))
    out = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out, tail)
  return out


def reduce_chunks(
  fn: Callable[[PyTree], PyTree], xs: PyTree, size: int, chunk_size: int | None
) -> PyTree:
  """``sum_chunks fn(chunk)`` where ``fn`` maps a chunk to a sum.

  ``fn`` receives a slice of ``xs`` with a leading axis of at most
  ``chunk_size`` rows and returns partial sums (a fixed-shape tree); the
  partial sums are accumulated in a ``lax.scan`` carry, so only one chunk's
  intermediates are live at a time.
  """
  if chunk_size is None or chunk_size >= size:
    return fn(xs)
  q, rem = divmod(size, chunk_size)
  main = jax.tree.map(
    lambda a: a[: q * chunk_size].reshape(q, chunk_size, *a.shape[1:]), xs
  )
  first = jax.tree.map(lambda a: a[0], main)
  init = jax.tree.map(jnp.zeros_like, jax.eval_shape(fn, first))

  def body(carry, chunk):
    return jax.tree.map(jnp.add, carry, fn(chunk)), None

  total, _ = jax.lax.scan(body, init, main)
  if rem:
    tail = fn(jax.tree.map(lambda a: a[q * chunk_size :], xs))
    total = jax.tree.map(jnp.add, total, tail)
  return total


def per_example_grads(
  loss_fn: Callable[[PyTree, PyTree], jax.Array],
  params: PyTree,
  batch: PyTree,
  *,
  chunk_size: int | None = None,
) -> PyTree:
  """Per-example gradients ``grad_theta loss_fn(theta, example_n)``.

  .. math::

    G_n = \\nabla_\\theta\\, \\ell(\\theta, z_n), \\qquad n = 1, \\dots, B,

  computed as ``jax.vmap(jax.grad(loss_fn))``; with ``chunk_size`` the batch
  is processed ``chunk_size`` examples at a time under ``lax.map`` (plus an
  exact remainder), which bounds the *intermediate* memory by the chunk (the
  ``B x P`` result itself is returned).

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar`` for ONE example, where
      ``example`` is ``batch`` without its leading axis.
    params: the parameters (any pytree of arrays).
    batch: a pytree of arrays sharing a leading batch axis ``B``.
    chunk_size: examples per ``vmap`` chunk; ``None`` vectorises the whole
      batch. A static Python int ``>= 1``.

  Returns:
    A tree shaped like ``params`` whose leaves have a leading axis ``B``.
    Non-finite per-example gradients are returned as they are.

  Raises:
    TypeError: a ``batch`` leaf is not an array, or ``chunk_size`` is not an
      int.
    ValueError: ``batch`` leaves disagree on ``B``, or ``chunk_size < 1``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from fisher_optax import fisher
    >>> loss = lambda w, ex: 0.5 * (ex[0] @ w - ex[1]) ** 2
    >>> x, y = jnp.ones((5, 3)), jnp.zeros((5,))
    >>> fisher.per_example_grads(loss, jnp.ones(3), (x, y), chunk_size=2).shape
    (5, 3)
  """
  size = check_batch_tree(batch)
  chunk_size = check_chunk_size(chunk_size)
  return map_chunks(
    lambda ex: jax.grad(loss_fn)(params, ex), batch, size, chunk_size
  )


def expand(example: PyTree) -> PyTree:
  """Adds a batch axis of one to every leaf."""
  return jax.tree.map(lambda a: a[None], example)


def pseudo_grads_fn(
  apply_fn: Callable[[PyTree, PyTree], jax.Array], params: PyTree
) -> Callable[[PyTree, jax.Array], PyTree]:
  """``(example, r (S, *out)) -> g (S, *params)`` with ``g_s = J^T r_s``.

  One forward (linearisation) per example, one backprop per column ``s``.
  """

  def one(example, r):
    xb = expand(example)
    _, pull = jax.vjp(lambda p: apply_fn(p, xb)[0], params)
    return jax.vmap(lambda rs: pull(rs.astype(r.dtype))[0])(r)

  return one
