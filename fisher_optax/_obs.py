# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Optimal Brain Surgeon pruning with the M-FAC inverse empirical Fisher.

All functions take a :class:`fisher_optax.fisher.RankOneSumFisher` (from
:func:`fisher_optax.fisher.sum_of_rank_one`) whose tree structure matches the
weights they prune. Weights are addressed by flat indices in
``jax.flatten_util.ravel_pytree`` order, or by boolean masks shaped like the
weights (``True`` = keep).
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from fisher_optax import fisher
from fisher_optax.fisher import numerics
from fisher_optax.fisher import validation

PyTree = Any
RankOneSumFisher = fisher.RankOneSumFisher
_SCOPES = ("global", "per_leaf")
_UPDATES = ("independent", "group", "none")


def _unravel(flat: jax.Array, like: PyTree) -> PyTree:
  """:func:`numerics.unravel`, each leaf cast to ``like``'s dtype."""
  return jax.tree.map(
    lambda x, l: x.astype(jnp.result_type(l)),
    numerics.unravel(flat, like),
    like,
  )


def obs_saliency(params: PyTree, fisher: RankOneSumFisher) -> PyTree:
  """Returns the OBS saliency of every weight.

  .. math::

    \\rho_j = \\frac{w_j^2}{2\\,[F^{-1}]_{jj}},

  the second-order loss increase of removing ``w_j`` alone and letting the
  other weights compensate optimally. ``O(d m)`` for all weights.

  Args:
    params: the weights, same structure and shapes as the Fisher's.
    fisher: the factored Fisher.

  Returns:
    A tree of saliencies shaped like ``params``, in the factor's dtype
    (float32, or float64 for a float64 factor).

  Example::

    >>> import jax, jax.numpy as jnp, fisher_optax
    >>> g = {"w": jax.random.normal(jax.random.key(0), (4, 3))}
    >>> f = fisher_optax.fisher.sum_of_rank_one(g, 1e-2)
    >>> fisher_optax.obs_saliency({"w": jnp.ones(3)}, f)["w"].shape
    (3,)

  References:
    Hassibi & Stork, `Second order derivatives for network pruning: Optimal
    Brain Surgeon <https://proceedings.neurips.cc/paper/1992/hash/
    303ed4c69846ab36c2904d3ba8573050-Abstract.html>`_, 1992

    Frantar et al, `M-FAC: Efficient Matrix-Free Approximations of
    Second-Order Information <https://arxiv.org/abs/2107.03356>`_, 2021
  """
  fisher.check_compatible(params, "params")
  inv_diag = fisher.inverse_diag()
  return jax.tree.map(
    lambda w, h: jnp.square(w.astype(h.dtype)) / (2.0 * h), params, inv_diag
  )


def group_obs_update(
  params: PyTree, drop: PyTree | jax.Array, fisher: RankOneSumFisher
) -> tuple[PyTree, jax.Array]:
  """Removes a set ``Q`` of weights with the exact group OBS update.

  .. math::

    \\delta w = -F^{-1} E_Q \\bigl([F^{-1}]_{QQ}\\bigr)^{-1} w_Q, \\qquad
    \\delta L = \\tfrac12 w_Q^\\top \\bigl([F^{-1}]_{QQ}\\bigr)^{-1} w_Q,

  the minimiser of the quadratic model ``0.5 dw^T F dw`` subject to
  ``(w + dw)_Q = 0``. With ``|Q| = 1`` this is the single-weight OBS step
  and ``dL`` its saliency. Cost ``O(d m + |Q|^2 m + |Q|^3)``: the ``|Q| x
  |Q|`` block comes from ``O(m)`` entry queries, the update is one ``ihvp``.
  This is also the compensation step of ZK-APEX (on a blocked Fisher).

  Args:
    params: the weights, same structure and shapes as the Fisher's.
    drop: which weights to remove: a boolean tree shaped like ``params``
      (``True`` = remove; must be concrete) or a 1-D int array (or list)
      of flat indices (``ravel_pytree`` order), unique and in ``[0, d)``.
      Concrete
      indices are checked; traced ones (under ``jit``, which makes the
      function jit-able for a fixed ``|Q|``) cannot be, and then an
      out-of-range index is clamped or dropped by the gathers and a
      repeated one makes ``[F^{-1}]_{QQ}`` singular (NaN results).
    fisher: the factored Fisher.

  Returns:
    ``(new_params, loss_increase)``; the removed weights are exactly zero.

  Raises:
    ValueError: for flat indices that are not 1-D, concrete ones that are
      out of range, negative or repeated, or a ``drop`` tree unlike
      ``params`` (in structure or leaf shapes).

  Example::

    >>> import jax, jax.numpy as jnp, fisher_optax
    >>> g = {"w": jax.random.normal(jax.random.key(0), (4, 3))}
    >>> f = fisher_optax.fisher.sum_of_rank_one(g, 1e-2)
    >>> w, dl = fisher_optax.group_obs_update(
    ...     {"w": jnp.ones(3)}, jnp.array([0, 2]), f)
    >>> w["w"][0], w["w"][2]
    (Array(0., dtype=float32), Array(0., dtype=float32))

  References:
    Kurtic et al, `The Optimal BERT Surgeon: Scalable and Accurate
    Second-Order Pruning for Large Language Models
    <https://arxiv.org/abs/2203.07259>`_, 2022 (the group update)

    Hassibi & Stork, `Second order derivatives for network pruning: Optimal
    Brain Surgeon <https://proceedings.neurips.cc/paper/1992/hash/
    303ed4c69846ab36c2904d3ba8573050-Abstract.html>`_, 1992
  """
  fisher.check_compatible(params, "params")
  if isinstance(drop, (list, tuple)) and all(
    isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in drop
  ):
    drop = np.asarray(drop, np.int64).reshape(len(drop))  # [0, 2]: indices
  if isinstance(drop, (jax.Array, np.ndarray)) and jnp.issubdtype(
    jnp.result_type(drop), jnp.integer
  ):
    if jnp.ndim(drop) != 1:
      raise ValueError(
        "drop as flat indices must be a 1-D integer array, got shape "
        f"{jnp.shape(drop)}."
      )
    if not isinstance(drop, jax.core.Tracer):
      _check_flat_indices(np.asarray(drop), fisher.dim)
    index = jnp.asarray(drop, jnp.int32)
  else:
    # Leaf shapes too: a mask of the wrong shape would name other weights.
    validation.check_like(drop, params, what="drop")
    try:
      flat = np.asarray(numerics.ravel(drop)).astype(bool)
    except jax.errors.TracerArrayConversionError as e:
      raise TypeError(
        "a boolean drop mask must be concrete (it sets |Q|); pass flat "
        "indices to use group_obs_update under jit."
      ) from e
    index = jnp.asarray(np.nonzero(flat)[0], jnp.int32)
  return _group_update(params, index, fisher)


def _check_flat_indices(index: np.ndarray, dim: int) -> None:
  """Concrete flat indices of ``group_obs_update``: unique, in ``[0, dim)``."""
  bad = index[(index < 0) | (index >= dim)]
  if bad.size:
    raise ValueError(
      f"drop: flat indices must lie in [0, {dim}) (the number of weights), "
      f"got {bad.tolist()}."
    )
  values, counts = np.unique(index, return_counts=True)
  if np.any(counts > 1):
    raise ValueError(
      "drop: flat indices must be unique, got repeated "
      f"{values[counts > 1].tolist()}."
    )


def _work_dtype(params: PyTree, fisher: RankOneSumFisher) -> jnp.dtype:
  """The Fisher's dtype, or the params' where wider (float64 weights keep
  their digits under a float32 Fisher)."""
  return jnp.result_type(fisher.chol.dtype, *jax.tree.leaves(params))


def _group_update(params, index, fisher, valid=None):
  """Exact group OBS; ``valid`` masks padding entries of ``index``."""
  w = numerics.ravel(params).astype(_work_dtype(params, fisher))
  if index.shape[0] == 0:
    return params, jnp.zeros([], w.dtype)
  valid = jnp.ones(index.shape, bool) if valid is None else valid
  wq = jnp.where(valid, w[index], 0.0)
  both = valid[:, None] & valid[None, :]
  block = jnp.where(
    both,
    fisher.inverse_submatrix(index),
    jnp.eye(index.shape[0], dtype=w.dtype),
  )
  chol = jnp.linalg.cholesky(0.5 * (block + block.T))
  coef = jnp.where(valid, jax.scipy.linalg.cho_solve((chol, True), wq), 0.0)
  # .add/.max: padding repeats an index with zero weight.
  sparse = jnp.zeros_like(w).at[index].add(coef)
  drop = jnp.zeros(w.shape, bool).at[index].max(valid)
  # In the working dtype: 1/damping overflows a float16 product.
  delta = numerics.ravel(fisher.ihvp(numerics.unravel(sparse, params)))
  new = jnp.where(drop, 0.0, w - delta.astype(w.dtype))
  return _unravel(new, params), 0.5 * jnp.dot(wq, coef)


@jax.jit
def _group_update_padded(params, index, valid, fisher):
  return _group_update(params, index, fisher, valid)


@jax.jit
def _independent_update(params, drop, fisher):
  """Sum of single-weight OBS updates (M-FAC's pruner), one ihvp.

  The loss is ``0.5 dw^T F dw`` of the step applied (rounded to the params'
  dtypes, removed weights set to zero): the sum of the single-weight
  saliencies ignores the cross terms of correlated weights.
  """
  w = numerics.ravel(params).astype(_work_dtype(params, fisher))
  inv_diag = numerics.ravel(fisher.inverse_diag())
  coef = jnp.where(drop, w / inv_diag, 0.0)
  delta = numerics.ravel(fisher.ihvp(numerics.unravel(coef, params)))
  new = _unravel(jnp.where(drop, 0.0, w - delta.astype(w.dtype)), params)
  step = numerics.ravel(new).astype(w.dtype) - w
  return new, 0.5 * fisher.quadratic_form(numerics.unravel(step, params))


@jax.jit
def _zeroing_loss(params, drop, fisher):
  w = numerics.ravel(params).astype(fisher.chol.dtype)
  return 0.5 * fisher.quadratic_form(_unravel(jnp.where(drop, w, 0.0), params))


class ObsPruneResult(NamedTuple):
  """Output of :func:`obs_prune` and :func:`magnitude_prune`.

  Attributes:
    params: the pruned weights (pruned entries exactly zero).
    masks: boolean arrays shaped like ``params`` (``True`` = kept; all
      ``True`` on leaves that were not prunable). They are elementwise, so
      not ``optax.masked``'s one bool per leaf: multiply the updates by
      them to keep the sparsity during fine-tuning, e.g. last in a chain,
      ``optax.stateless(lambda u, _: jax.tree.map(jnp.multiply, u,
      masks))``.
    predicted_loss_increase: float32 array ``(steps,)``, the quadratic
      model's loss increase ``0.5 dw^T F dw`` of the step ``dw`` applied at
      every step (removal and compensation), with ``F`` that step's damped,
      blocked Fisher; for ``update="group"`` this is the group OBS value
      ``0.5 w_Q^T ([F^{-1}]_{QQ})^{-1} w_Q``. Empty for magnitude pruning.
  """

  params: PyTree
  masks: PyTree
  predicted_loss_increase: jax.Array


def _select(
  scores: list[jax.Array], alive: list[jax.Array], n_prune: list[int] | int
) -> np.ndarray:
  """Flat indices (global or per leaf) of the lowest-score alive weights.

  Selection runs on the host: its output size changes every step, which
  would recompile a jitted version each time.
  """
  masked = [
    np.where(np.asarray(a), np.asarray(s, np.float64), np.inf).ravel()
    for s, a in zip(scores, alive)
  ]
  if isinstance(n_prune, int):  # global
    return np.argsort(np.concatenate(masked), kind="stable")[:n_prune]
  out, offset = [], 0
  for flat, n in zip(masked, n_prune):
    out.append(np.argsort(flat, kind="stable")[:n] + offset)
    offset += flat.size
  return np.concatenate(out)


def _kept(density: float, n: int) -> int:
  """Weights kept of ``n``: ``density n`` to the nearest, halves up, and at
  least one (a sparsity below 1 never prunes every weight)."""
  return min(n, max(1, math.floor(density * n + 0.5)))


def _targets(
  sizes: list[int], alive_counts: list[int], density: float, scope: str
) -> list[int] | int:
  if scope == "global":
    return max(sum(alive_counts) - _kept(density, sum(sizes)), 0)
  return [max(a - _kept(density, n), 0) for n, a in zip(sizes, alive_counts)]


def _prunable_leaves(
  params: PyTree, prunable: Any
) -> tuple[list[Any], Any, list[bool]]:
  """``(leaves, treedef, flags)``: flags mark the floating leaves selected.

  Non-floating leaves (step counters, ids, PRNG keys) are never pruned.
  """
  leaves, treedef = jax.tree.flatten(params)
  mask = numerics.resolve_mask(prunable, params, name="prunable")
  flags = [
    f and jnp.issubdtype(jnp.result_type(x), jnp.floating)
    for f, x in zip(jax.tree.leaves(mask), leaves)
  ]
  if not any(flags):
    raise ValueError(
      "No prunable leaf: prunable selects no floating-point leaf of params."
    )
  # A NaN weight sorts last by magnitude or score, so it would never be
  # pruned; say so instead (concrete params only: a host-side check).
  bad = [
    jax.tree_util.keystr(path)
    for (path, x), f in zip(
      jax.tree_util.tree_flatten_with_path(params)[0], flags
    )
    if f
    and not isinstance(x, jax.core.Tracer)
    and not np.all(np.isfinite(np.asarray(x, np.float32)))
  ]
  if bad:
    raise ValueError(f"params{', params'.join(bad)} hold NaN or Inf weights.")
  return leaves, treedef, flags


def _check_sparsity(sparsity: Any) -> float:
  if not isinstance(sparsity, (int, float)) or isinstance(sparsity, bool):
    raise TypeError(f"sparsity must be a Python float, got {sparsity!r}.")
  validation.check_in_unit_interval("sparsity", sparsity)
  return float(sparsity)


def magnitude_prune(
  params: PyTree,
  sparsity: float,
  *,
  prunable: Any = None,
  scope: str = "global",
) -> ObsPruneResult:
  """Zeroes the smallest-magnitude weights (the baseline for :func:`obs_prune`).

  Args:
    params: the weights.
    sparsity: the fraction of prunable weights to remove, in ``[0, 1)``.
      Of ``n`` weights (all prunable ones, or each leaf's), ``(1 -
      sparsity) n`` are kept, rounded to the nearest count (halves up) and
      at least one.
    prunable: which leaves to prune: ``None`` (all), a pytree of bools or a
      callable ``params -> bools`` (the mask forms ``optax.masked`` takes).
      Only floating-point leaves are pruned: other leaves (step counters,
      ids) pass through unchanged, with all-``True`` masks.
    scope: ``"global"`` (one threshold over all prunable leaves) or
      ``"per_leaf"`` (every leaf to the same sparsity).

  Returns:
    An :class:`ObsPruneResult`.

  Raises:
    ValueError: if no floating-point leaf is prunable, or for an invalid
      sparsity or scope.

  Example::

    >>> import jax.numpy as jnp, fisher_optax
    >>> r = fisher_optax.magnitude_prune({"w": jnp.arange(1.0, 5.0)}, 0.5)
    >>> r.params["w"]
    Array([0., 0., 3., 4.], dtype=float32)
  """
  sparsity = _check_sparsity(sparsity)
  validation.check_choice("scope", scope, _SCOPES)
  leaves, treedef, flags = _prunable_leaves(params, prunable)
  sel = [x for x, f in zip(leaves, flags) if f]
  scores = [jnp.abs(x).astype(jnp.float32) for x in sel]
  alive = [jnp.ones(x.shape, bool) for x in sel]
  n_prune = _targets(
    [x.size for x in sel], [x.size for x in sel], 1.0 - sparsity, scope
  )
  index = _select(scores, alive, n_prune)
  sel, alive = _apply_zeroing(
    sel, alive, _drop_mask(index, sum(x.size for x in sel))
  )
  return _assemble(leaves, flags, sel, alive, treedef, jnp.zeros((0,)))


def _apply_zeroing(sel, alive, drop):
  w = numerics.ravel(sel)
  a = numerics.ravel(alive) & ~drop
  return (
    _unravel(jnp.where(a, w, 0).astype(w.dtype), sel),
    _unravel(a, alive),
  )


def _drop_mask(index: np.ndarray, size: int) -> jax.Array:
  drop = np.zeros(size, bool)
  drop[index] = True
  return jnp.asarray(drop)


def _assemble(leaves, flags, sel, alive, treedef, losses):
  it_w, it_a = iter(sel), iter(alive)
  out_w, out_m = [], []
  for x, f in zip(leaves, flags):
    out_w.append(next(it_w).astype(x.dtype) if f else x)
    out_m.append(next(it_a) if f else jnp.ones(jnp.shape(x), bool))
  return ObsPruneResult(
    jax.tree.unflatten(treedef, out_w),
    jax.tree.unflatten(treedef, out_m),
    jnp.asarray(losses, jnp.float32),
  )


def obs_prune(
  params: PyTree,
  grad_fn: Callable[[PyTree, int], PyTree],
  sparsity: float,
  *,
  prunable: Any = None,
  scope: str = "global",
  steps: int = 16,
  block_size: int | None = 128,
  damping: float = 1e-5,
  update: str = "independent",
) -> ObsPruneResult:
  """Prunes to a target sparsity with M-FAC's iterative OBS pruner.

  Step ``s = 1..steps`` asks ``grad_fn`` for fresh gradients at the current
  weights, factors ``F = lambda I + (1/m) sum_k g_k g_k^T`` blockwise over the
  surviving prunable weights (:func:`fisher_optax.fisher.sum_of_rank_one`),
  scores them by :func:`obs_saliency`, removes the lowest ones to reach
  density ``(1 - sparsity)^{s / steps}`` (the paper's geometric schedule)
  and compensates the rest:

  .. math::

    \\delta w = -F^{-1} \\sum_{q \\in Q} \\frac{w_q}{[F^{-1}]_{qq}} e_q
    \\quad (\\texttt{update="independent"}), \\qquad
    \\delta w = -F^{-1} E_Q ([F^{-1}]_{QQ})^{-1} w_Q
    \\quad (\\texttt{"group"}).

  Gradients of removed and non-prunable weights are zeroed before the
  factorization, so those weights decouple and are never moved; non-prunable
  leaves are not even stored in the factor.

  Args:
    params: the weights.
    grad_fn: ``grad_fn(params, step) -> stacked gradients`` (leading axis
      ``m``, same tree as ``params``), e.g. per-example or mini-batch
      gradients from ``fisher_optax.fisher.per_example_grads`` on a fresh
      batch. Called ``steps`` times, outside ``jit``.
    sparsity: the final fraction of prunable weights removed, in ``[0, 1)``;
      counts round as in :func:`magnitude_prune` (at least one weight kept).
    prunable: ``None`` (all leaves), a pytree of bools or a callable, as in
      ``optax.masked``. Only floating-point leaves are pruned: other leaves
      pass through unchanged, with all-``True`` masks, and get no Fisher.
    scope: ``"global"`` or ``"per_leaf"`` sparsity.
    steps: the number of recomputation steps (the paper uses 16), static.
    block_size: the Fisher block size along the flattened prunable weights
      (the paper uses 128), or ``None`` for the full (unblocked) factor.
    damping: ``lambda`` (the paper uses ``1e-5`` with mini-batch gradients;
      per-example gradients need a larger one).
    update: ``"independent"`` (the paper's sum of single-weight updates),
      ``"group"`` (exact group OBS, ``O(|Q|^3)`` per step) or ``"none"``
      (remove by saliency, no compensation).

  Returns:
    An :class:`ObsPruneResult`.

  Raises:
    ValueError / TypeError: if no floating-point leaf is prunable, for
      invalid sparsity, steps, scope, update,
      gradients whose structure or shapes do not match ``params``, or a step
      whose gradients give a non-finite Fisher factor (NaN/Inf, or an
      overflowing Gram: no decomposition runs on them).

  Example::

    >>> import jax, jax.numpy as jnp, fisher_optax
    >>> params = {"w": jnp.arange(1.0, 9.0)}
    >>> grad_fn = lambda p, s: {"w": jax.random.normal(
    ...     jax.random.key(s), (16, 8))}
    >>> r = fisher_optax.obs_prune(params, grad_fn, 0.5, steps=2,
    ...                            block_size=None, damping=1e-2)
    >>> int(r.masks["w"].sum())
    4

  References:
    Frantar et al, `M-FAC: Efficient Matrix-Free Approximations of
    Second-Order Information <https://arxiv.org/abs/2107.03356>`_, 2021

    Hassibi & Stork, `Second order derivatives for network pruning: Optimal
    Brain Surgeon <https://proceedings.neurips.cc/paper/1992/hash/
    303ed4c69846ab36c2904d3ba8573050-Abstract.html>`_, 1992
  """
  sparsity = _check_sparsity(sparsity)
  steps = validation.check_static_int("steps", steps, minimum=1)
  validation.check_choice("scope", scope, _SCOPES)
  validation.check_choice("update", update, _UPDATES)
  validation.check_positive("damping", damping)
  leaves, treedef, flags = _prunable_leaves(params, prunable)
  sel = [x for x, f in zip(leaves, flags) if f]
  alive = [jnp.ones(x.shape, bool) for x in sel]
  sizes = [x.size for x in sel]
  losses = []
  for s in range(1, steps + 1):
    grads = grad_fn(
      jax.tree.unflatten(treedef, _merge(leaves, flags, sel)), s - 1
    )
    validation.check_leading_axis(grads, params, what="grad_fn output")
    g_sel = [g for g, f in zip(jax.tree.leaves(grads), flags) if f]
    saliency, fisher = _score(sel, alive, g_sel, damping, block_size=block_size)
    # A host loop, so a bad step can say so instead of pruning on NaN scores.
    if not bool(fisher.is_finite()):
      raise ValueError(
        f"obs_prune: step {s}: the Fisher factor is not finite (grad_fn "
        "returned NaN/Inf gradients, or gradients whose Gram overflows); "
        "nothing was pruned at this step."
      )
    bad = sum(int(np.sum(~(np.asarray(x) >= 0))) for x in saliency)
    if bad:  # Scores that would prune the wrong weights first (or never).
      raise ValueError(
        f"obs_prune: step {s}: {bad} weights have negative or NaN scores: "
        "a NaN weight, or an inverse-Fisher diagonal lost to rounding "
        "(damping tiny next to the squared gradients; raise damping, use "
        "block_size <= the number of gradients, or float64). Nothing was "
        "pruned at this step."
      )
    density = (1.0 - sparsity) ** (s / steps)
    n_prune = _targets(sizes, [int(a.sum()) for a in alive], density, scope)
    index = _select(saliency, alive, n_prune)
    drop = _drop_mask(index, sum(sizes))
    if update == "independent":
      sel, loss = _independent_update(sel, drop, fisher)
    elif update == "group":
      # Pad |Q| to a power of two so that the jitted solve compiles rarely.
      padded = 1 << max(len(index) - 1, 0).bit_length()
      valid = np.arange(padded) < len(index)
      idx = np.zeros(padded, np.int32)
      idx[: len(index)] = index
      sel, loss = _group_update_padded(
        sel, jnp.asarray(idx), jnp.asarray(valid), fisher
      )
    else:
      loss = _zeroing_loss(sel, drop, fisher)
    losses.append(loss)
    sel, alive = _apply_zeroing(sel, alive, drop)
  return _assemble(leaves, flags, sel, alive, treedef, jnp.stack(losses))


@functools.partial(jax.jit, static_argnames=("block_size",))
def _score(sel, alive, grads, damping, *, block_size):
  """Factors the Fisher of the surviving weights and scores them."""
  grads = [jnp.where(a, g, 0) for a, g in zip(alive, grads)]
  factor = fisher.sum_of_rank_one(grads, damping, block_size=block_size)
  return obs_saliency(sel, factor), factor


def _merge(leaves, flags, sel):
  it = iter(sel)
  return [next(it).astype(x.dtype) if f else x for x, f in zip(leaves, flags)]
