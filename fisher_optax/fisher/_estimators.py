# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Fisher estimators: which Fisher (``kind``) x which structure x which path.

Every estimator runs one forward pass and one batched backward pass for the
mean loss gradient, turns the outputs into per-example output cotangents
``r_{s,n}`` (:func:`fisher_optax.fisher._likelihoods.output_cotangents`), and
reduces the pseudo-gradients ``g_{s,n} = J_n^T r_{s,n}`` to *sums* by either

- the layer-statistics path (``fisher_optax.fisher._taps``: products with
  a parameter, embeddings, elementwise scales and shifts, never forming
  ``B x P``; :func:`fisher_optax.fisher.coverage` says which leaves), or
- the generic per-example path (``vmap`` of one-example VJPs, chunked),

then all-reduces the sums over ``axis_name`` (when given) and divides by the
global example count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
from typing import Any, NamedTuple, TypeVar, cast

import jax
import jax.numpy as jnp

from fisher_optax.fisher import _likelihoods
from fisher_optax.fisher import _per_example
from fisher_optax.fisher import _statistics
from fisher_optax.fisher import _taps
from fisher_optax.fisher import linalg
from fisher_optax.fisher import numerics
from fisher_optax.fisher import validation

PyTree = Any
ApplyFn = Callable[[PyTree, PyTree], jax.Array]
METHODS = ("auto", "taps", "per_example")


class _Options(NamedTuple):
  """The arguments every model-based estimator shares (see :func:`diagonal`)."""

  likelihood: Any
  kind: str
  num_samples: int
  key: jax.Array | None
  method: str
  chunk_size: int | None
  axis_name: str | None


class _Pass(NamedTuple):
  """What every estimator needs after the forward/backward pass.

  ``apply_fn``, ``params``, ``inputs``, ``cotangents``, ``size`` and
  ``chunk_size`` also define the per-example problem ``g_{s,n} = J_n^T
  r_{s,n}``; :func:`_uncovered` restricts it to some leaves.
  """

  apply_fn: ApplyFn
  params: PyTree  # pcast to varying under axis_name
  inputs: PyTree
  cotangents: jax.Array  # (S, B, *out)
  size: int  # local B
  chunk_size: int | None
  axis_name: str | None
  mean_grad: PyTree = None  # global mean, float32, or None without targets
  count: Any = None  # global int32 N
  layers: Any = None  # _taps.LayerGrads of the cotangents, on the layer path
  covered: PyTree = None  # params-shaped Python bools, on the layer path


def _explicit_axes() -> tuple[str, ...]:
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  return tuple(
    n
    for n, t in zip(mesh.axis_names, mesh.axis_types)
    if t == jax.sharding.AxisType.Explicit
  )


_F = TypeVar("_F", bound=Callable[..., Any])


def _auto_axes_under_explicit_mesh(fn: _F) -> _F:
  """Runs an estimator with the mesh's Explicit axes switched to Auto.

  Batch contractions (sums over a sharded batch axis, Gram matrices) are
  ambiguous for Explicit sharding; under Auto, XLA picks the all-reduces and
  the replicated statistic comes back. Without an Explicit mesh, or under
  ``axis_name`` (``shard_map``), ``fn`` runs as it is.
  """

  @functools.wraps(fn)
  def wrapper(apply_fn, params, batch, *, key=None, axis_name=None, **kwargs):
    if axis_name is not None or not _explicit_axes():
      return fn(apply_fn, params, batch, key=key, axis_name=axis_name, **kwargs)
    inner = lambda p, b, k: fn(apply_fn, p, b, key=k, **kwargs)
    replicated = jax.sharding.PartitionSpec()
    auto = jax.sharding.auto_axes(inner, out_sharding=replicated)
    return auto(params, batch, key)  # pyright: ignore[reportCallIssue]

  return cast(_F, wrapper)


def _psum(x: PyTree, axis_name: str | None) -> PyTree:
  if axis_name is None:
    return x
  return jax.lax.psum(x, axis_name)


def _check_arguments(
  params: PyTree, batch: Any, opts: _Options
) -> tuple[_likelihoods.Likelihood, PyTree, Any, int]:
  """Validates the shared arguments: ``(likelihood, inputs, targets, B)``."""
  likelihood = _likelihoods.as_likelihood(opts.likelihood)
  _likelihoods.check_kind(likelihood, opts.kind)
  validation.check_choice("method", opts.method, METHODS)
  validation.check_static_int("num_samples", opts.num_samples, minimum=1)
  _per_example.check_chunk_size(opts.chunk_size)
  if not isinstance(batch, (tuple, list)) or len(batch) != 2:
    raise ValueError(
      "batch must be a pair (inputs, targets); got "
      f"{type(batch).__name__}"
      + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
      + "."
    )
  inputs, targets = batch
  size = _per_example.check_batch_tree(
    inputs if targets is None else (inputs, targets), what="batch"
  )
  if opts.kind == "mc" and opts.key is None:
    raise ValueError(
      "kind='mc' samples labels from the model and needs key=, a PRNG key."
    )
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not isinstance(leaf, jax.Array) and not hasattr(leaf, "dtype"):
      raise TypeError(
        f"params{jax.tree_util.keystr(path)} must be an array, "
        f"got {type(leaf).__name__}."
      )
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      raise TypeError(
        f"params{jax.tree_util.keystr(path)} has dtype {leaf.dtype}: a Fisher "
        "is over floating parameters. Pass only those (with Flax NNX, "
        "nnx.split(model, nnx.Param, ...) keeps RNG keys and counters "
        "apart)."
      )
  return likelihood, inputs, targets, size


def _forward(
  apply_fn: ApplyFn,
  params: PyTree,
  batch: Any,
  opts: _Options,
  *,
  layers: bool = False,
  statistic: str | None = None,
  weight_sharing: str = "expand",
  normalise: bool = True,
  first: jax.Array | int | None = None,
) -> _Pass:
  """Validates the arguments and runs the shared forward/backward pass.

  With ``layers``, the forward pass is recorded with taps on the dense and
  embedding layers (:func:`_taps.record`): the mean gradient and the layer
  ``delta`` then share one backward pass (``empirical``), or the ``delta``
  of the ``S`` cotangents come from more backward passes, run when a
  statistic needs them (``LayerTape.backward``). A ``statistic``
  (``"diag"``, ``"kron"``) is formed inside those passes for the leaves
  stacked along scans (:func:`_taps.record`).

  ``normalise=False`` (a chunk of the examples): ``mean_grad`` holds this
  device's gradient sums and ``count`` its examples, to be all-reduced and
  divided by the caller. ``first`` is the index of the batch's first
  example in the whole batch, for the MC kind's draws (default: this
  device's first).
  """
  likelihood, inputs, targets, size = _check_arguments(params, batch, opts)
  kind, key, axis_name = opts.kind, opts.key, opts.axis_name
  if axis_name is not None:
    # Replicated params are device-invariant, so autodiff would psum their
    # cotangents and mix examples across devices: make them varying.
    params = jax.tree.map(
      lambda p: jax.lax.pcast(p, axis_name, to="varying"), params
    )

  layers = layers and kind != "batch_squared"
  if layers:
    tape = _taps.record(
      apply_fn,
      params,
      inputs,
      axis_name=axis_name,
      statistic=statistic,
      chunk_size=opts.chunk_size,
      weight_sharing=weight_sharing,
      ordered=kind == "empirical",
    )
    out = tape.outputs
    pull = lambda r: tape.gradient(r)
  else:
    tape = None
    leaves, _, _, closed, _, num = _taps._trace(apply_fn, params, inputs)
    _taps.check_independent_examples(closed, len(leaves), num)
    out, vjp = jax.vjp(lambda p: apply_fn(p, inputs), params)
    pull = lambda r: (vjp(r)[0], None)
  _taps.check_apply_outputs(out, size)
  cot = _likelihoods.output_cotangents(
    likelihood,
    kind,
    out,
    targets,
    key=key,
    num_samples=opts.num_samples,
    first=_first_index(axis_name, size) if first is None else first,
  )
  count = jnp.asarray(size, jnp.int32)
  if normalise:
    count = _psum(count, axis_name)
  mean_grad, layer_grads = None, None
  if targets is not None:
    if kind in ("empirical", "batch_squared"):
      r_emp = cot[0]
    else:
      r_emp = _likelihoods.output_cotangents(
        likelihood, "empirical", out, targets
      )[0]
    sums, layer_grads = pull(r_emp)
    if normalise:
      mean_grad = jax.tree.map(
        lambda s: s / count, _psum(numerics.widen(sums), axis_name)
      )
    else:
      mean_grad = numerics.widen(sums)
  if tape is not None and (kind != "empirical" or layer_grads is None):
    columns = None
    if kind == "exact":
      columns = functools.partial(_exact_columns, likelihood, out)
    layer_grads = tape.backward(cot, columns=columns)
  return _Pass(
    apply_fn,
    params,
    inputs,
    cot,
    size,
    opts.chunk_size,
    axis_name,
    mean_grad,
    count,
    layer_grads,
    tape.covered if tape is not None else None,
  )


def _batch_major(cot: jax.Array) -> jax.Array:
  return jnp.moveaxis(cot, 0, 1)  # (B, S, *out)


def _pseudo_grad_chunk(
  ps: _Pass,
) -> Callable[[tuple[PyTree, jax.Array]], PyTree]:
  """``(inputs_chunk, cot_chunk (c, S, *out)) -> g (c, S, *params)``."""
  one = _per_example.pseudo_grads_fn(ps.apply_fn, ps.params)
  return lambda xs: jax.vmap(one)(*xs)


def _reduce_pseudo_grads(ps: _Pass, chunk_sum: Callable[[PyTree], PyTree]):
  """``sum_chunks chunk_sum(pseudo-gradients of the chunk)``."""
  pg = _pseudo_grad_chunk(ps)
  return _per_example.reduce_chunks(
    lambda xs: chunk_sum(pg(xs)),
    (ps.inputs, _batch_major(ps.cotangents)),
    ps.size,
    ps.chunk_size,
  )


# -- the layer-statistics path -------------------------------------------------


def _use_taps(method: str) -> bool:
  return method != "per_example"


def _warn_fallback(ps: _Pass, method: str, structure: str = "diag") -> None:
  """One :class:`_taps.FisherFallbackWarning` per model when ``auto`` sends
  more than a tenth of the parameters to the per-example path."""
  if method == "auto" and ps.layers is not None:
    # stacklevel: _taps.warn_fallback, here, the estimator, its wrapper.
    _taps.warn_fallback(ps.layers.tape, structure=structure, stacklevel=4)


def _check_covered(ps: _Pass, method: str) -> None:
  """Raises for leaves ``method="taps"`` (or ``"kfac"``: K-FAC factors)
  cannot compute; unused leaves (zero statistics) pass."""
  if method not in ("taps", "kfac"):
    return
  flat = jax.tree_util.tree_flatten_with_path(ps.covered)[0]
  unused = jax.tree.leaves(ps.layers.tape.unused)
  missing = [
    jax.tree_util.keystr(p)
    for (p, c), u in zip(flat, unused, strict=True)
    if not (c or u)
  ]
  if missing and method == "kfac":
    raise ValueError(
      f"estimator='kfac' has no K-FAC factors for these leaves: {missing} "
      "(K-FAC factors exist for dense, attention and embedding kernels and "
      "their biases, and for conv kernels of one feature group; "
      "fisher.coverage says which path each leaf takes). Use "
      "estimator='auto' for Shampoo factors of per-example gradients there."
    )
  if missing:
    raise ValueError(
      "method='taps' cannot compute these leaves from layer statistics "
      f"(no layer rule matches; fisher.coverage says why): {missing}. Use "
      "method='auto' to fall back to the per-example path for them."
    )


def _uncovered(ps: _Pass) -> _Pass | None:
  """The per-example problem of the leaves the layer path does not cover.

  Its ``params`` is the list of uncovered leaves (``None`` if there are
  none); the covered leaves are held fixed inside its ``apply_fn``.
  """
  leaves, treedef = jax.tree.flatten(ps.params)
  flags = jax.tree.leaves(ps.covered)
  idx = [i for i, c in enumerate(flags) if not c]
  if not idx:
    return None

  def rebuild(sub):
    full = list(leaves)
    for i, leaf in zip(idx, sub):
      full[i] = leaf
    return jax.tree.unflatten(treedef, full)

  apply_fn = ps.apply_fn
  params = [leaves[i] for i in idx]
  chunk = ps.chunk_size
  if chunk is None:
    # A fallback keeps its per-example (pseudo-)gradients, S per example,
    # near the layer path's chunk budget rather than holding B of them.
    # An unused leaf's are zeros that XLA never forms.
    unused = (
      jax.tree.leaves(ps.layers.tape.unused)
      if ps.layers is not None
      else [False] * len(leaves)
    )
    num_s = jax.tree.leaves(ps.cotangents)[0].shape[0]
    per_example = num_s * sum(jnp.size(leaves[i]) for i in idx if not unused[i])
    chunk = max(1, _taps.DEFAULT_CHUNK_ELEMENTS // max(1, per_example))
  return ps._replace(
    apply_fn=lambda q, x: apply_fn(rebuild(q), x),
    params=params,
    chunk_size=chunk,
  )


def _merge(
  stats: PyTree,
  covered: PyTree,
  uncovered: list[Any] | None,
  covered_fn: Callable[[Any], Any] = numerics.widen,
) -> PyTree:
  """Params-shaped: ``covered_fn(stat)`` at covered leaves, the next entry of
  ``uncovered`` (per-example path results, in leaf order) elsewhere.

  ``stats`` has ``covered``'s structure down to its leaves (a leaf's
  statistic may be a pair; ``None`` where not covered).
  """
  it = iter(uncovered or ())
  return jax.tree.map(
    lambda c, s: covered_fn(s) if c else next(it), covered, stats
  )


# -- examples in chunks (several samples per example) -------------------------


def _examples_per_pass(
  apply_fn: ApplyFn, params: PyTree, batch: Any, opts: _Options, statistic
) -> int | None:
  """Examples per forward pass on the layer path; ``None``: all of them.

  With more than one backward pass per forward pass (``exact``, ``mc`` with
  ``num_samples > 1``, and ``mc`` with targets, whose mean gradient takes
  an empirical pass of its own) every pass after the first needs all the
  forward residuals, so they stay alive next to one pass's cotangents: up
  to twice a batch gradient's memory (``mc`` with one sample and targets:
  about 1.2x), growing with ``B``. So the examples go in chunks, each with
  its own forward pass: ``chunk_size`` of them when that is fewer than
  ``B``, and by default as few chunks as keep the recorded layers'
  activations and cotangents (:func:`_taps.held_elements`) within
  ``_taps.PASS_ELEMENTS``.
  """
  if not _use_taps(opts.method) or opts.kind not in ("exact", "mc"):
    return None
  _, inputs, targets, size = _check_arguments(params, batch, opts)
  if opts.kind == "mc" and opts.num_samples == 1 and targets is None:
    return None  # one backward pass
  if opts.chunk_size is not None:
    return opts.chunk_size if opts.chunk_size < size else None
  held, _ = _taps.held_elements(apply_fn, params, inputs, statistic=statistic)
  chunks = -(-held // _taps.PASS_ELEMENTS)
  return -(-size // chunks) if chunks > 1 else None


def _exact_columns(
  likelihood: Any, out: jax.Array, start: jax.Array, n: int
) -> jax.Array:
  """Cotangents ``start .. start + n`` of the exact kind, formed where a
  backward pass takes them: on sequence outputs all ``S = T * C`` of them
  would be ``T`` times the outputs' size per column, most of it zeros."""
  return _likelihoods.output_cotangents(
    likelihood, "exact", out, None, columns=(start, n)
  )


def _first_index(axis_name: str | None, size: int) -> jax.Array | int:
  """Index in the whole batch of this device's first example (equal shards)."""
  if axis_name is None:
    return 0
  return jax.lax.axis_index(axis_name) * size


def _chunk_sums(
  apply_fn: ApplyFn,
  params: PyTree,
  batch: Any,
  opts: _Options,
  per: int,
  sums_fn: Callable[[_Pass], PyTree],
  **forward_kwargs: Any,
) -> tuple[PyTree, PyTree, Any]:
  """``(sum of sums_fn, mean gradient, count)`` over chunks of ``per``
  examples, each chunk its own forward pass (:func:`_forward` on the layer
  path, not normalised), summed in a scan; all-reduced over ``axis_name``
  (the mean gradient is ``None`` without targets). Each chunk tells the MC
  kind where its examples sit in the batch."""
  _, inputs, targets, size = _check_arguments(params, batch, opts)
  start = _first_index(opts.axis_name, size)

  def one(chunk):
    examples, first = chunk
    ps = _forward(
      apply_fn,
      params,
      examples,
      opts,
      layers=True,
      normalise=False,
      first=start + first[0],
      **forward_kwargs,
    )
    return sums_fn(ps), ps.mean_grad

  total = _per_example.reduce_chunks(
    one, ((inputs, targets), jnp.arange(size)), size, per
  )
  sums, grad_sums = _psum(total, opts.axis_name)
  count = _psum(jnp.asarray(size, jnp.int32), opts.axis_name)
  mean_grad = jax.tree.map(lambda g: g / count, grad_sums)  # None stays
  return sums, mean_grad, count


# -- structure: diagonal -------------------------------------------------------


def _diag_sums(ps: _Pass) -> PyTree:
  """``sum_{s,n} g_{s,n}^2`` by the per-example path."""
  return _reduce_pseudo_grads(
    ps,
    lambda g: jax.tree.map(
      lambda x: jnp.sum(jnp.square(numerics.widen(x)), axis=(0, 1)), g
    ),
  )


def _diag_sums_taps(ps: _Pass) -> PyTree:
  """``sum_{s,n} g_{s,n}^2``: layer statistics, per-example elsewhere."""
  stats = ps.layers.statistics("diag", chunk_size=ps.chunk_size)
  sub = _uncovered(ps)
  return _merge(stats, ps.covered, _diag_sums(sub) if sub else None)


@_auto_axes_under_explicit_mesh
def diagonal(
  apply_fn: ApplyFn,
  params: PyTree,
  batch: tuple[PyTree, jax.Array | None],
  *,
  likelihood: Any,
  kind: str,
  num_samples: int = 1,
  key: jax.Array | None = None,
  method: str = "auto",
  chunk_size: int | None = None,
  axis_name: str | None = None,
) -> _statistics.DiagonalFisher:
  """Diagonal Fisher of a model's likelihood, with the mean gradient.

  .. math::

    \\operatorname{diag} F = \\frac{1}{N} \\sum_{n=1}^{N} \\sum_s
      (J_n^\\top r_{s,n})^{\\odot 2}

  with the cotangents ``r`` of ``kind`` (see :mod:`fisher_optax.fisher`);
  ``batch_squared`` is ``(mean_n g_n)^2``, Adam's quantity.

  On the layer path the ``empirical`` kind takes one backward pass, the
  mean gradient's. The diagonals of layers stacked along scans, of conv
  layers and dense layers shared over positions, and of dense layers whose
  inputs are large, form inside it, and such a layer's input is freed
  before the next cotangent is written, as in the gradient alone (not held
  next to it for a statistic formed after). A conv or shared dense
  kernel's gradient outside scans is the sum of the per-example gradients
  its diagonal forms, so the pass runs no kernel-gradient product for it.

  Args:
    apply_fn: ``apply_fn(params, inputs) -> outputs`` with the batch axis
      first (a Linen ``model.apply``, an NNX merge function, any function).
      Examples must not interact (no batch norm in training mode).
    params: the parameters to differentiate.
    batch: ``(inputs, targets)``; ``targets`` may be ``None`` for ``mc`` and
      ``exact`` (then ``mean_grad`` is ``None``).
    likelihood: a likelihood object, or a per-example loss
      ``loss(output, target)`` (then only ``empirical`` and
      ``batch_squared``).
    kind: ``"empirical" | "mc" | "exact" | "batch_squared"``.
    num_samples: label samples per example for ``mc`` (static int).
    key: PRNG key, required by ``mc``. Example ``n`` of the batch (counted
      across devices under ``axis_name``) draws its labels from
      ``jax.random.fold_in(key, n)``, so the draws, and the statistic, are
      the same on both paths, for every ``chunk_size`` and device count.
    method: ``"auto"`` (layer statistics where they apply, per-example
      elsewhere), ``"taps"`` (layer statistics only; error otherwise) or
      ``"per_example"``.
    chunk_size: examples per chunk on the per-example path (static int;
      ``None``: all at once with ``method="per_example"``, and for the
      leaves ``"auto"`` sends there, chunks of about ``2**24`` gradient
      elements). On the layer path, with several samples per example
      (``exact``, ``mc`` with ``num_samples > 1``), the rows (sample,
      example) one backward pass takes: ``max(1, chunk_size // B)``
      samples of all examples at a time, or, when ``chunk_size < B``, one
      sample of ``chunk_size`` examples, the examples then running in
      chunks with a forward pass each. By default one sample per pass, and
      the examples in chunks once the recorded layers' activations and
      cotangents would pass ``2**25`` elements; so the memory does not
      grow with ``S``, nor with ``B`` beyond that budget (a loop of passes
      keeps the forward residuals of all its examples). ``chunk_size = S *
      B`` runs all samples in one pass. ``mc`` with one sample and targets
      chunks its examples the same way, since its mean gradient takes a
      second (empirical) backward pass.
    axis_name: a ``shard_map``/``pmap`` axis the batch is split over; sums
      are all-reduced before normalising.

  Returns:
    A :class:`DiagonalFisher` (float32 statistics). Non-finite per-example
    gradients are not masked: they make ``diag`` non-finite (check
    ``.is_finite()``), so a bad example is never silently averaged away.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from fisher_optax import fisher
    >>> params = {"w": jnp.ones((3, 2))}
    >>> apply_fn = lambda p, x: x @ p["w"]
    >>> x, y = jnp.ones((4, 3)), jnp.array([0, 1, 1, 0])
    >>> stat = fisher.diagonal(apply_fn, params, (x, y),
    ...                        likelihood=fisher.Categorical(), kind="exact")
    >>> stat.diag["w"].shape, int(stat.count)
    ((3, 2), 4)

  References:
    Kunstner et al, `Limitations of the empirical Fisher approximation for
    natural gradient descent <https://arxiv.org/abs/1905.12558>`_, 2019
  """
  opts = _Options(
    likelihood, kind, num_samples, key, method, chunk_size, axis_name
  )
  per = _examples_per_pass(apply_fn, params, batch, opts, "diag")
  if per is not None:

    def sums_fn(ps: _Pass) -> PyTree:
      _check_covered(ps, method)
      _warn_fallback(ps, method)
      return _diag_sums_taps(ps)

    sums, mean_grad, count = _chunk_sums(
      apply_fn, params, batch, opts, per, sums_fn, statistic="diag"
    )
    diag = jax.tree.map(lambda s: s / count, sums)
    return _statistics.DiagonalFisher(diag, mean_grad, count, kind)
  ps = _forward(
    apply_fn, params, batch, opts, layers=_use_taps(method), statistic="diag"
  )
  if kind == "batch_squared":
    diag = jax.tree.map(jnp.square, ps.mean_grad)
    return _statistics.DiagonalFisher(diag, ps.mean_grad, ps.count, kind)
  if _use_taps(method):
    _check_covered(ps, method)
    _warn_fallback(ps, method)
    sums = _diag_sums_taps(ps)
  else:
    sums = _diag_sums(ps)
  diag = jax.tree.map(lambda s: s / ps.count, _psum(sums, axis_name))
  return _statistics.DiagonalFisher(diag, ps.mean_grad, ps.count, kind)


# -- structure: low rank -------------------------------------------------------


def _stacked_pseudo_grads(ps: _Pass) -> PyTree:
  """All pseudo-gradients as a stacked tree ``(S*B, *leaf)``, s-major."""
  one = _per_example.pseudo_grads_fn(ps.apply_fn, ps.params)
  g = _per_example.map_chunks(
    lambda xr: one(*xr),
    (ps.inputs, _batch_major(ps.cotangents)),
    ps.size,
    ps.chunk_size,
  )
  # Explicit row counts: ``-1`` cannot be inferred for a zero-size leaf.
  return jax.tree.map(
    lambda a: numerics.widen(
      jnp.moveaxis(a, 1, 0).reshape(a.shape[0] * a.shape[1], *a.shape[2:])
    ),
    g,
  )


def _gather_rows(stacked: PyTree, axis_name: str) -> PyTree:
  """All devices' rows, device-invariant: each device writes its block into
  zeros and a psum assembles them (an all_gather result would stay
  "varying" for shard_map's replication check)."""
  n_dev = jax.lax.axis_size(axis_name)
  idx = jax.lax.axis_index(axis_name)

  def leaf(a):
    full = jnp.zeros((n_dev * a.shape[0], *a.shape[1:]), a.dtype)
    start = (idx * a.shape[0],) + (0,) * (a.ndim - 1)
    return jax.lax.psum(jax.lax.dynamic_update_slice(full, a, start), axis_name)

  return jax.tree.map(leaf, stacked)


def _top_k(
  gram: jax.Array, rank: int, count: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Top-``rank`` eigvals of ``gram / N`` and weights ``W (M, k)`` so that
  ``V_j = sum_i W[i, j] g_i`` are orthonormal eigvecs of ``G^T G / N``."""
  m = gram.shape[0]
  gram = linalg.symmetrize(gram) / count
  # A non-finite Gram (NaN inputs, bad labels, 1e30 gradients squared) gives
  # NaN eigenpairs without reaching LAPACK, whose eigh on an infinite
  # matrix need not terminate on XLA:CPU.
  vals, vecs = numerics.finite_or_nan(
    lambda a: linalg.top_eigh(a, min(rank, m)), gram
  )
  if rank > m:  # Fewer pseudo-gradients than directions: pad with zeros.
    vals = jnp.concatenate([vals, jnp.zeros((rank - m,), vals.dtype)])
    vecs = jnp.concatenate([vecs, jnp.zeros((m, rank - m), vecs.dtype)], 1)
  vals, vecs = vals[:rank], vecs[:, :rank]
  tol = jnp.maximum(vals[0], 0.0) * m * jnp.finfo(vals.dtype).eps
  ok = vals > jnp.maximum(tol, jnp.finfo(vals.dtype).tiny)
  # Zero eigenvalues get zero directions, not 0/0.
  scale = jnp.where(ok, jax.lax.rsqrt(jnp.where(ok, vals * count, 1.0)), 0.0)
  vals = jnp.where(ok | jnp.isnan(vals), vals, 0.0)
  return vals, vecs * scale[None, :]


def _combine(stacked: PyTree, weights: jax.Array) -> PyTree:
  """``V[j] = sum_i weights[i, j] stacked[i]`` as a stacked tree (k, ...)."""
  return jax.tree.map(
    lambda s: jnp.tensordot(
      weights.T.astype(s.dtype),
      s,
      axes=(1, 0),
      precision=jax.lax.Precision.HIGHEST,
    ),
    stacked,
  )


def _low_rank_from_stacked(
  stacked: PyTree, rank: int, count: jax.Array, mean_grad: PyTree, kind: str
) -> _statistics.LowRankFisher:
  vals, w = _top_k(linalg.tree_stacked_gram(stacked), rank, count)
  return _statistics.LowRankFisher(
    vals, _combine(stacked, w), mean_grad, count, kind
  )


@_auto_axes_under_explicit_mesh
def low_rank(
  apply_fn: ApplyFn,
  params: PyTree,
  batch: tuple[PyTree, jax.Array | None],
  *,
  likelihood: Any,
  kind: str,
  rank: int,
  per_leaf: bool = False,
  num_samples: int = 1,
  key: jax.Array | None = None,
  method: str = "auto",
  chunk_size: int | None = None,
  axis_name: str | None = None,
) -> _statistics.LowRankFisher | PyTree:
  """Top-``rank`` eigenpairs of the Fisher by the Gram-matrix trick.

  With the ``M = S * B`` pseudo-gradients stacked as rows of ``G``,
  ``F = G^T G / N`` and the ``M x M`` Gram ``K = G G^T / N`` share their
  non-zero eigenvalues:

  .. math::

    K = U \\Lambda U^\\top, \\qquad
    V = G^\\top U \\Lambda^{-1/2} / \\sqrt{N},

  so ``V`` has orthonormal columns and ``F V = V \\Lambda``; ``P x P`` is
  never formed. ``K`` takes ``M^2`` memory; from ``M = 1024`` (float32) its
  top ``k`` eigenpairs come from LOBPCG
  (:func:`fisher_optax.fisher.linalg.top_eigh`), ``O(M^2 k)`` per
  iteration, where a full ``eigh`` costs ``O(M^3)``. Eigenvalues below
  ``M * eps * max(eigvals)`` get eigenvalue 0 and a zero direction (no
  division by zero). ``rank > M`` pads with zeros.

  On the layer path, layers stacked by a scan (``nn.scan``, ``nnx.scan``,
  ``lax.scan``) form ``K`` inside the backward pass when there is one
  sample per example (``kind="empirical"``, or ``"mc"`` with one sample),
  and ``V`` inside a second forward and backward pass: memory stays near
  the batch gradient's (``remat`` is kept) for about one more gradient's
  time. Other kinds record the stacked layers' activations. The Gram
  matrix pairs every two examples, so the examples never run in chunks
  with a forward pass each (as :func:`diagonal`'s may).

  ``apply_fn``, ``params``, ``batch``, ``likelihood``, ``kind``,
  ``num_samples``, ``key``, ``method``, ``chunk_size`` and ``axis_name`` are
  as in :func:`diagonal`.

  Args:
    rank: number of eigenpairs ``k`` (static int ``>= 1``).
    per_leaf: if ``True``, one top-``k`` eigenproblem per leaf (block-diagonal
      Fisher) and a params-shaped tree of :class:`LowRankFisher` is returned.

  Returns:
    A :class:`LowRankFisher` (``eigvals (k,)`` descending, ``eigvecs``
    leaves ``(k, *leaf)`` orthonormal over the whole tree), or a tree of
    them when ``per_leaf`` (each with the leaf's ``mean_grad`` and the
    global example ``count``).

  .. note::
    Under ``axis_name`` every device's pseudo-gradients are gathered (``S*B
    x P`` over all devices) to form the global Gram matrix exactly; the same
    holds for ``jit`` with a batch-sharded input, where XLA chooses the
    collectives. Under an Explicit mesh the estimators run with the axes
    switched to Auto (:func:`jax.sharding.auto_axes`) and return replicated
    statistics.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from fisher_optax import fisher
    >>> params = {"w": jnp.ones((3, 2))}
    >>> x, y = jnp.eye(3)[jnp.array([0, 1, 2, 0])], jnp.array([0, 1, 1, 0])
    >>> stat = fisher.low_rank(lambda p, x: x @ p["w"], params, (x, y),
    ...                        likelihood=fisher.Categorical(),
    ...                        kind="empirical", rank=2)
    >>> stat.eigvals.shape, stat.eigvecs["w"].shape
    ((2,), (2, 3, 2))
  """
  rank = validation.check_static_int("rank", rank, minimum=1)
  per_leaf = validation.check_flag("per_leaf", per_leaf)
  opts = _Options(
    likelihood, kind, num_samples, key, method, chunk_size, axis_name
  )
  use_layers = _use_taps(method) and not per_leaf and axis_name is None
  # One sample per example: the Gram matrix and the weighted sums of scanned
  # layers then form inside two backward passes (_low_rank_taps).
  one_sample = kind == "empirical" or (kind == "mc" and num_samples == 1)
  ps = _forward(
    apply_fn,
    params,
    batch,
    opts,
    layers=use_layers,
    statistic="gram" if one_sample else None,
  )
  if kind == "batch_squared":
    # One row, the mean gradient, normalised by 1 (the statistic still
    # reports ps.count examples).
    stacked = jax.tree.map(lambda m: m[None], ps.mean_grad)
    count = jnp.ones((), jnp.int32)
  else:
    count = ps.count
    if use_layers:
      _check_covered(ps, method)
      _warn_fallback(ps, method)
      return _low_rank_taps(ps, rank, kind)
    stacked = _stacked_pseudo_grads(ps)
    if axis_name is not None:
      stacked = _gather_rows(stacked, axis_name)
  if per_leaf:
    mean = (
      ps.mean_grad
      if ps.mean_grad is not None
      else jax.tree.map(lambda _: None, stacked)
    )

    def one_leaf(s, mg):
      stat = _low_rank_from_stacked(s, rank, count, mg, kind)
      return _statistics.LowRankFisher(
        stat.eigvals, stat.eigvecs, mg, ps.count, kind
      )

    return jax.tree.map(one_leaf, stacked, mean, is_leaf=lambda x: x is None)
  stat = _low_rank_from_stacked(stacked, rank, count, ps.mean_grad, kind)
  return _statistics.LowRankFisher(
    stat.eigvals, stat.eigvecs, ps.mean_grad, ps.count, kind
  )


def _low_rank_taps(
  ps: _Pass, rank: int, kind: str
) -> _statistics.LowRankFisher:
  """Global low rank with the Gram of covered leaves from layer statistics.

  A tape that formed its scanned layers' Gram matrix inside the backward
  pass (``statistic="gram"``) keeps none of their activations, so their
  weighted sums come from a second forward and backward pass that forms
  them the same way (``statistic="combine"``): one more gradient's time
  for memory near the gradient's, as the other fused statistics.
  """
  gram = numerics.widen(ps.layers.statistics("gram", chunk_size=ps.chunk_size))
  sub = _uncovered(ps)
  sub_stacked = None
  if sub is not None:
    sub_stacked = _stacked_pseudo_grads(sub)
    gram = gram + linalg.tree_stacked_gram(sub_stacked)
  vals, w = _top_k(gram, rank, ps.count)
  weights, layers = w.T, ps.layers
  if layers.tape.fused:
    tape = _taps.record(
      ps.apply_fn,
      ps.params,
      ps.inputs,
      statistic="combine",
      chunk_size=ps.chunk_size,
      weights=weights,
    )
    layers = tape.backward(ps.cotangents)
  tree = layers.combine(weights)
  if sub_stacked is not None:
    tree = _merge(tree, ps.covered, _combine(sub_stacked, w))
  return _statistics.LowRankFisher(
    vals, numerics.widen(tree), ps.mean_grad, ps.count, kind
  )


def _norm(tree: PyTree) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def _tangent_for(t: jax.Array, p: jax.Array) -> jax.Array:
  """``t`` in ``p``'s dtype, varying over the mesh axes ``p`` varies over:
  under ``shard_map`` the direction is all-reduced (invariant) while the
  params are made varying, and some JVP rules (``conv_general_dilated``)
  refuse operands that differ there."""
  t = t.astype(p.dtype)
  have = numerics.varying_axes(jax.typeof(t))
  missing = tuple(
    a for a in numerics.varying_axes(jax.typeof(p)) if a not in have
  )
  return jax.lax.pcast(t, missing, to="varying") if missing else t


def _quadratic_form_jvp(ps: _Pass, v: PyTree) -> jax.Array:
  """``v^T F v = (1/N) sum_{s,n} <r_{s,n}, (J v)_n>^2``, one jvp."""
  tangent = jax.tree.map(_tangent_for, v, ps.params)
  _, jv = jax.jvp(lambda p: ps.apply_fn(p, ps.inputs), (ps.params,), (tangent,))
  dots = jnp.sum(
    numerics.widen(ps.cotangents) * numerics.widen(jv)[None],
    axis=tuple(range(2, ps.cotangents.ndim)),
  )
  return _psum(jnp.sum(jnp.square(dots)), ps.axis_name) / ps.count


@_auto_axes_under_explicit_mesh
def rank_one(
  apply_fn: ApplyFn,
  params: PyTree,
  batch: tuple[PyTree, jax.Array],
  *,
  likelihood: Any,
  kind: str,
  direction: str = "mean",
  scale: str = "none",
  num_samples: int = 1,
  key: jax.Array | None = None,
  method: str = "auto",
  chunk_size: int | None = None,
  axis_name: str | None = None,
) -> _statistics.LowRankFisher:
  """A rank-one Fisher ``F ~ lambda v v^T``.

  ``direction="mean"``: ``v = mu / |mu|`` with ``mu`` the mean gradient, and
  ``lambda = |mu|^2`` (``scale="none"``) or the Frobenius-optimal
  ``lambda = c^* |mu|^2 = v^T F v`` with

  .. math::

    c^* = \\arg\\min_c \\|F - c\\, \\mu\\mu^\\top\\|_F
        = \\frac{\\mu^\\top F \\mu}{\\|\\mu\\|^4}
        = \\frac{1}{N \\|\\mu\\|^4} \\sum_{s,n} (\\mu \\cdot g_{s,n})^2,

  computed with one Jacobian-vector product (``mu . g = r . J mu``), never
  per-example gradients. For ``kind="empirical"`` this is
  ``mean_n (mu . g_n)^2 / |mu|^4``. ``direction="top_eig"``: the top
  eigenpair (:func:`low_rank` with ``rank=1``), whose eigenvalue is already
  Frobenius-optimal, so ``scale`` does not change it.

  ``apply_fn``, ``params``, ``batch``, ``likelihood``, ``kind``,
  ``num_samples``, ``key``, ``method``, ``chunk_size`` and ``axis_name`` are
  as in :func:`diagonal`; ``direction="mean"`` needs targets.

  Args:
    direction: ``"mean" | "top_eig"``.
    scale: ``"none" | "optimal"``.

  Returns:
    A :class:`LowRankFisher` with ``k = 1``. A zero mean gradient gives a
    zero direction and eigenvalue 0.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax import fisher
    >>> x, y = jnp.eye(3)[jnp.array([0, 1, 2, 0])], jnp.array([0, 1, 1, 0])
    >>> stat = fisher.rank_one(lambda p, x: x @ p, jnp.ones((3, 2)), (x, y),
    ...                        likelihood=fisher.Categorical(),
    ...                        kind="empirical", scale="optimal")
    >>> stat.eigvecs.shape
    (1, 3, 2)
  """
  validation.check_choice("direction", direction, ("mean", "top_eig"))
  validation.check_choice("scale", scale, ("none", "optimal"))
  opts = _Options(
    likelihood, kind, num_samples, key, method, chunk_size, axis_name
  )
  if direction == "top_eig":
    return low_rank(apply_fn, params, batch, rank=1, **opts._asdict())
  if isinstance(batch, (tuple, list)) and len(batch) == 2 and batch[1] is None:
    raise ValueError(
      "rank_one(direction='mean') needs targets for the mean "
      "gradient; got targets=None."
    )
  ps = _forward(apply_fn, params, batch, opts)
  mu = ps.mean_grad
  norm = _norm(mu)
  safe = jnp.where(norm > 0, norm, 1.0)
  v = jax.tree.map(lambda m: jnp.where(norm > 0, m / safe, 0.0), mu)
  if scale == "none" or kind == "batch_squared":
    val = jnp.square(norm)
  else:
    val = _quadratic_form_jvp(ps, v)
  eigvecs = jax.tree.map(lambda x: x[None], v)
  return _statistics.LowRankFisher(
    jnp.reshape(val, (1,)), eigvecs, mu, ps.count, kind
  )


# -- structure: Kronecker ------------------------------------------------------


def _as_matrix(g: jax.Array) -> jax.Array:
  """``(c, *leaf) -> (c, m, n)`` with :func:`matrix_shape`."""
  return g.reshape(g.shape[0], *_statistics.matrix_shape(g.shape[1:]))


def _kron_pass(
  ps: _Pass,
  contract: Callable[..., Any],
  extra: PyTree,
  grads: PyTree | None = None,
) -> PyTree:
  """``contract(G, extra_leaf)`` summed over the chunks, per leaf: ``G``
  ``(c, m, n)`` a chunk's per-example (pseudo-)gradients as matrices, by the
  per-example path or given as ``grads`` (``(N, *leaf)``); ``contract``
  sums over its first axis."""

  def chunk_sum(g):
    def leaf(gl, e):
      # (c, S, *leaf) -> (c S, *leaf); explicit for a zero-size leaf.
      rows = gl.shape[0] * gl.shape[1]
      return contract(
        _as_matrix(numerics.widen(gl).reshape(rows, *gl.shape[2:])), e
      )

    return jax.tree.map(leaf, g, extra)

  if grads is not None:
    return _psum(
      chunk_sum(jax.tree.map(lambda g: g[:, None], grads)), ps.axis_name
    )
  return _psum(_reduce_pseudo_grads(ps, chunk_sum), ps.axis_name)


# Sums over per-example matrices ``G`` ``(c, m, n)`` as contractions, not a
# vmap of products: no ``(c, m, m)`` or ``(c, n, n)`` intermediates.


def _sum_ggt_gtg(g: jax.Array, _) -> tuple[jax.Array, jax.Array]:
  """``(sum_c G G^T, sum_c G^T G)``."""
  return _hp_einsum("cij,ckj->ik", g, g), _hp_einsum("cji,cjk->ik", g, g)


def _sum_grgt(g: jax.Array, r: jax.Array) -> jax.Array:
  """``sum_c G R G^T``."""
  return _hp_einsum("cik,clk->il", _hp_einsum("cij,jk->cik", g, r), g)


def _sum_gtlg(g: jax.Array, l: jax.Array) -> jax.Array:
  """``sum_c G^T L G``."""
  return _hp_einsum("cik,ckl->il", _hp_einsum("cji,jk->cik", g, l), g)


def _hp_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
  """``num / den``, and 0 where ``den <= 0`` (no 0/0)."""
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def _shampoo_sums(ps: _Pass, grads: PyTree | None) -> PyTree:
  """Per leaf ``(sum G G^T, sum G^T G)``, all-reduced over ``ps.axis_name``
  (none when it is ``None``)."""
  dummy = jax.tree.map(lambda p: jnp.zeros(()), ps.params)
  return _kron_pass(ps, _sum_ggt_gtg, dummy, grads)


def _shampoo_finish(sums: tuple[Any, Any], count: Any) -> tuple[Any, Any]:
  """One Shampoo step from a leaf's sums: ``E[G G^T]`` and ``E[G^T G] /
  tr(E[G G^T])``."""
  return sums[0] / count, _safe_div(sums[1] / count, jnp.trace(sums[0]) / count)


def _shampoo_step(ps: _Pass, grads: PyTree | None) -> tuple[PyTree, PyTree]:
  """One Shampoo step: ``E[G G^T]`` and ``E[G^T G] / tr(E[G G^T])``."""
  sums = _shampoo_sums(ps, grads)
  # Mapped over params: a leaf's sums are a pair (params may hold tuples).
  factors = jax.tree.map(
    lambda _, s: _shampoo_finish(s, ps.count), ps.params, sums
  )
  left = jax.tree.map(lambda _, f: f[0], ps.params, factors)
  right = jax.tree.map(lambda _, f: f[1], ps.params, factors)
  return left, right


def _shampoo_factors(
  ps: _Pass, num_iters: int, grads: PyTree | None = None
) -> tuple[PyTree, PyTree]:
  """Nearest-Kronecker factors from per-example (pseudo-)gradients: by the
  per-example path of ``ps``, or ``grads`` (``(N, *leaf)`` per leaf of
  ``ps.params``).

  ``num_iters = 0``: one Shampoo step (:func:`_shampoo_step`). Otherwise
  alternate ``L <- E[G R G^T] / |R|^2``, ``R <- E[G^T L G] / |L|^2`` from
  ``R = I``.
  """
  if num_iters == 0:
    return _shampoo_step(ps, grads)
  count = ps.count

  def normalised(s, f):
    return _safe_div(s / count, jnp.sum(jnp.square(f)))

  def one_round(_, lr):
    _, right = lr
    s = _kron_pass(ps, _sum_grgt, right, grads)
    left = jax.tree.map(normalised, s, right)
    s = _kron_pass(ps, _sum_gtlg, left, grads)
    return left, jax.tree.map(normalised, s, left)

  def eye_and_zeros(p):
    rows, cols = _statistics.matrix_shape(p.shape)
    dtype = numerics.compute_dtype(p)
    return jnp.zeros((rows, rows), dtype), jnp.eye(cols, dtype=dtype)

  init = jax.tree.map(eye_and_zeros, ps.params)
  left = jax.tree.map(lambda _, t: t[0], ps.params, init)
  right = jax.tree.map(lambda _, t: t[1], ps.params, init)
  # One trace of the two passes whatever num_iters is.
  return jax.lax.fori_loop(0, num_iters, one_round, (left, right))


def _kfac_parts(
  ps: _Pass,
  weight_sharing: str,
  shampoo: Callable[[_Pass, list | None], Sequence[Any]],
  reduce_rows: Callable[[dict], dict] | None = None,
) -> tuple[list, list[bool]]:
  """Per leaf, in leaf order: this device's K-FAC sums ``(sum a a^T, sum
  delta delta^T)`` for the leaves with K-FAC factors, and for the others
  ``shampoo(sub, grads)``'s entry (one per leaf of ``sub.params``):
  ``grads`` their per-example gradients from the layer path (elementwise
  leaves), ``None`` for the rest, which take the per-example path. Also
  which leaves are K-FAC's. With ``reduce_rows`` the layer path's entries
  are ``reduce_rows`` of those gradients instead, formed a backward pass at
  a time (:meth:`_taps.LayerGrads.kron_and_example_grads`)."""
  leaves, treedef = jax.tree.flatten(ps.params)
  # One set of backward passes for both (a few samples per pass).
  kron, example_grads = ps.layers.kron_and_example_grads(
    chunk_size=ps.chunk_size,
    weight_sharing=weight_sharing,
    reduce_rows=reduce_rows,
  )
  kfac = treedef.flatten_up_to(ps.covered)
  parts = [
    (numerics.widen(s[0]), numerics.widen(s[1])) if k else None
    for k, s in zip(kfac, treedef.flatten_up_to(kron))
  ]
  grads = treedef.flatten_up_to(example_grads)
  cheap = [
    i for i, (k, g) in enumerate(zip(kfac, grads)) if not k and g is not None
  ]
  if cheap and reduce_rows is not None:
    for i in cheap:
      parts[i] = grads[i]
  elif cheap:
    sub = ps._replace(params=[leaves[i] for i in cheap])
    for i, v in zip(cheap, shampoo(sub, [grads[i] for i in cheap])):
      parts[i] = v
  done = [v is not None for v in parts]
  sub = _uncovered(ps._replace(covered=jax.tree.unflatten(treedef, done)))
  if sub is not None:
    rest = [i for i, d in enumerate(done) if not d]
    for i, v in zip(rest, shampoo(sub, None)):
      parts[i] = v
  return parts, kfac


def _kfac_sums(ps: _Pass, weight_sharing: str) -> tuple[list, list[bool]]:
  """This device's sums behind one-step factors (``num_iters = 0``), in
  leaf order: K-FAC's for the leaves with K-FAC factors, Shampoo's ``(sum
  G G^T, sum G^T G)`` for the others (:func:`_kfac_parts`); and which
  leaves are K-FAC's. Sums over examples, so chunks of examples add up
  (:func:`_chunk_sums`)."""
  return _kfac_parts(
    ps._replace(axis_name=None), weight_sharing, _shampoo_sums, _row_sums
  )


def _row_sums(rows: dict) -> dict:
  """Shampoo's ``(sum G G^T, sum G^T G)`` of each leaf's per-example
  gradients ``(N, *leaf)``: what :func:`_shampoo_sums` forms from them."""
  return {
    k: _sum_ggt_gtg(_as_matrix(numerics.widen(g)), None)
    for k, g in rows.items()
  }


def _kfac_finish(sums: list, kfac: list[bool], count: Any) -> tuple[list, list]:
  """Leaf-ordered ``(left, right)`` factors from :func:`_kfac_sums`'s
  all-reduced sums."""
  factors = [
    (s[0] / count, s[1] / count) if k else _shampoo_finish(s, count)
    for s, k in zip(sums, kfac)
  ]
  return [f[0] for f in factors], [f[1] for f in factors]


def _kfac_factors(
  ps: _Pass, num_iters: int, weight_sharing: str = "expand"
) -> tuple[PyTree, PyTree, bool]:
  """K-FAC factors of covered leaves, Shampoo-style ones elsewhere.

  The Shampoo-style factors of elementwise leaves (norms, positions) come
  from their per-example gradients on the layer path
  (:meth:`_taps.LayerGrads.example_grads`), the others' from the
  per-example path. Returns ``(left, right, mixed)``; ``mixed`` when some
  leaf has no K-FAC factors.
  """
  treedef = jax.tree.structure(ps.params)
  unflat = lambda xs: jax.tree.unflatten(treedef, xs)
  if num_iters == 0:
    sums, kfac = _kfac_sums(ps, weight_sharing)
    left, right = _kfac_finish(_psum(sums, ps.axis_name), kfac, ps.count)
    return unflat(left), unflat(right), not all(kfac)

  def shampoo(sub: _Pass, grads: list | None) -> list:
    left, right = _shampoo_factors(sub, num_iters, grads)
    return list(zip(left, right))

  parts, kfac = _kfac_parts(ps, weight_sharing, shampoo)
  kron = _psum([p if k else None for p, k in zip(parts, kfac)], ps.axis_name)
  factors = [
    (s[0] / ps.count, s[1] / ps.count) if k else p
    for p, s, k in zip(parts, kron, kfac)
  ]
  left, right = [f[0] for f in factors], [f[1] for f in factors]
  return unflat(left), unflat(right), not all(kfac)


@_auto_axes_under_explicit_mesh
def kronecker(
  apply_fn: ApplyFn,
  params: PyTree,
  batch: tuple[PyTree, jax.Array | None],
  *,
  likelihood: Any,
  kind: str,
  estimator: str = "auto",
  num_iters: int = 0,
  num_samples: int = 1,
  key: jax.Array | None = None,
  method: str = "auto",
  chunk_size: int | None = None,
  axis_name: str | None = None,
  weight_sharing: str = "expand",
) -> _statistics.KroneckerFisher:
  """Per-leaf Kronecker factors ``F_leaf ~ left ⊗ right``.

  Each leaf is viewed as an ``(m, n)`` matrix (:class:`KroneckerFisher`).

  - ``estimator="kfac"`` (layer-statistics path: dense, attention, conv and
    embedding kernels, biases; one factor pair per layer for a leaf stacked
    along a scan): for a kernel ``(d_in, d_out)`` with inputs ``a`` and
    pre-activation cotangents ``delta``,

    .. math::

      \\text{left} = \\frac{1}{N}\\sum_n a_n a_n^\\top, \\qquad
      \\text{right} = \\frac{1}{N}\\sum_{s,n} \\delta_{s,n}\\delta_{s,n}^\\top.

    A layer applied at ``T`` positions (a sequence, weight sharing) follows
    ``weight_sharing``: ``"expand"`` (default) takes positions as extra
    examples, ``left = (1/N) sum_n mean_t a_t a_t^T``, ``right = (1/N)
    sum_{s,n,t} delta delta^T``; ``"reduce"`` sums them first,
    ``left = (1/N) sum_n abar_n abar_n^T`` (``abar_n = mean_t a_t``),
    ``right = (1/N) sum_{s,n} (sum_t delta)(sum_t delta)^T``. With
    ``T = 1`` the two coincide; even with ``kind="exact"`` the product
    ``E[a a^T] ⊗ E[delta delta^T]`` is the exact Fisher block
    ``E[a a^T ⊗ delta delta^T]`` of a dense layer only when the
    pre-activation Fisher ``sum_s delta_{s,n} delta_{s,n}^T`` is the same
    for every example (one example, ``B = 1``; or a dense output layer
    under a Gaussian likelihood of fixed variance), otherwise an
    approximation (e.g. a Categorical output layer with ``B > 1``). With
    ``T > 1`` each convention is exact, under those conditions, for its
    model class only (Eschenhagen et al, 2023).
  - ``estimator="shampoo"`` (any leaf, from per-example gradients): with
    ``num_iters=0`` one nearest-Kronecker step from the identity,
    ``left = E[G G^T]``, ``right = E[G^T G] / tr E[G G^T]`` (exact for
    rank-one ``G``; Morwani et al's ``L ⊗ R / tr F``); with
    ``num_iters = t > 0`` ``t`` rounds of the Van Loan–Pitsianis power
    iteration ``L <- E[G R G^T] / |R|_F^2``, ``R <- E[G^T L G] / |L|_F^2``
    (from ``R = I``), converging to the Frobenius-nearest Kronecker product
    (two passes over the per-example gradients per round).
  - ``kind="batch_squared"`` (any ``estimator``): the Shampoo-style factors
    above of ``vec(M) vec(M)^T``, ``M`` the leaf's mean gradient as the one
    "gradient" (``E`` over it alone): with ``num_iters=0``
    ``left = M M^T``, ``right = M^T M / tr(M M^T)``, which is
    ``vec(M) vec(M)^T`` exactly only when ``M`` has rank one (generally not
    for ``B > 1``); with ``num_iters > 0`` the power iteration toward its
    Frobenius-nearest Kronecker product ``sigma_1^2 u_1 u_1^T ⊗ v_1
    v_1^T`` (``M``'s top singular triple).
  - ``estimator="auto"``: ``kfac`` for leaves the layer path covers,
    ``shampoo`` for the others (``estimator`` field ``"mixed"``). The
    per-example gradients of elementwise leaves without K-FAC factors (norm
    scales and biases, learned positions) come from the layer path, without
    a per-example backward pass.

  ``apply_fn``, ``params``, ``batch``, ``likelihood``, ``kind``,
  ``num_samples``, ``key``, ``method`` and ``axis_name`` are as in
  :func:`diagonal`.

  Args:
    chunk_size: as in :func:`diagonal`: on the layer path the samples'
      backward passes take ``max(1, chunk_size // B)`` at a time, one by
      default, so the memory does not grow with ``S``; ``chunk_size = S *
      B`` runs them as one pass (faster on some models, see the
      benchmarks). Examples run in chunks as for :func:`diagonal` (not
      with ``num_iters > 0``, whose rounds need every example's gradient).
      The ``A`` factors are formed once per chunk, except those of layers
      stacked by a scan, which every pass forms again.
    estimator: ``"auto" | "kfac" | "shampoo"``.
    num_iters: nearest-Kronecker rounds for ``shampoo`` and
      ``kind="batch_squared"`` (static int ``>= 0``).
    weight_sharing: ``"expand" | "reduce"``, the K-FAC convention for
      weight-shared layers (``kfac`` leaves only).

  Returns:
    A :class:`KroneckerFisher` with float32 factors; its ``estimator`` is
    ``"kfac"``, ``"mixed"`` or ``"shampoo"`` (``estimator="shampoo"`` and
    ``kind="batch_squared"``, whatever ``num_iters`` is).

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax import fisher
    >>> x, y = jnp.eye(3)[jnp.array([0, 1, 2, 0])], jnp.array([0, 1, 1, 0])
    >>> stat = fisher.kronecker(lambda p, x: x @ p, jnp.ones((3, 2)), (x, y),
    ...                         likelihood=fisher.Categorical(),
    ...                         kind="exact", estimator="shampoo")
    >>> stat.left.shape, stat.right.shape
    ((3, 3), (2, 2))

  References:
    Martens & Grosse, `Optimizing neural networks with Kronecker-factored
    approximate curvature <https://arxiv.org/abs/1503.05671>`_, 2015;
    Morwani et al, `A new perspective on Shampoo's preconditioner
    <https://arxiv.org/abs/2406.17748>`_, 2024;
    Eschenhagen et al, `Kronecker-factored approximate curvature for modern
    neural network architectures <https://arxiv.org/abs/2311.00636>`_, 2023
  """
  validation.check_choice("estimator", estimator, ("auto", "kfac", "shampoo"))
  validation.check_choice(
    "weight_sharing", weight_sharing, ("expand", "reduce")
  )
  num_iters = validation.check_static_int("num_iters", num_iters)
  opts = _Options(
    likelihood, kind, num_samples, key, method, chunk_size, axis_name
  )
  if estimator == "kfac" and method == "per_example":
    raise ValueError(
      "estimator='kfac' needs layer statistics (method='auto' "
      "or 'taps'); method='per_example' supports "
      "estimator='shampoo'."
    )
  use_taps = estimator != "shampoo" and _use_taps(
    "taps" if estimator == "kfac" else method
  )
  per = None
  if use_taps and num_iters == 0:  # power iterations need all examples
    per = _examples_per_pass(apply_fn, params, batch, opts, "kron")
  if per is not None:
    flags: list[list[bool]] = []

    def sums_fn(ps: _Pass) -> list:
      ps = ps._replace(covered=ps.layers.tape.covered_for("kron"))
      _check_covered(ps, "kfac" if estimator == "kfac" else method)
      _warn_fallback(ps, method, "kron")
      sums, kfac = _kfac_sums(ps, weight_sharing)
      flags.append(kfac)
      return sums

    sums, mean_grad, count = _chunk_sums(
      apply_fn,
      params,
      batch,
      opts,
      per,
      sums_fn,
      statistic="kron",
      weight_sharing=weight_sharing,
    )
    treedef = jax.tree.structure(params)
    left, right = _kfac_finish(sums, flags[0], count)
    return _statistics.KroneckerFisher(
      jax.tree.unflatten(treedef, left),
      jax.tree.unflatten(treedef, right),
      mean_grad,
      count,
      kind,
      "mixed" if not all(flags[0]) else "kfac",
    )
  ps = _forward(
    apply_fn,
    params,
    batch,
    opts,
    layers=use_taps,
    statistic="kron",
    weight_sharing=weight_sharing,
  )
  if kind == "batch_squared":
    left, right = _batch_squared_kron(ps, num_iters)
    estimator_name = "shampoo"
  elif not use_taps:
    left, right = _shampoo_factors(ps, num_iters)
    estimator_name = "shampoo"
  else:
    # Leaves without K-FAC factors (elementwise parameters, leaves with
    # several uses) take Shampoo factors.
    ps = ps._replace(covered=ps.layers.tape.covered_for("kron"))
    _check_covered(ps, "kfac" if estimator == "kfac" else method)
    _warn_fallback(ps, method, "kron")
    left, right, mixed = _kfac_factors(ps, num_iters, weight_sharing)
    estimator_name = "mixed" if mixed else "kfac"
  return _statistics.KroneckerFisher(
    left, right, ps.mean_grad, ps.count, kind, estimator_name
  )


def _batch_squared_kron(ps: _Pass, num_iters: int) -> tuple[PyTree, PyTree]:
  """Kronecker factors of ``vec(M) vec(M)^T`` per leaf, ``M`` the leaf's
  (global) mean gradient as a matrix: :func:`_shampoo_factors` of the one
  "per-example gradient" ``M``.

  ``num_iters = 0`` gives ``(M M^T, M^T M / tr(M M^T))``, exact only when
  ``M`` has rank one (then ``vec(M) vec(M)^T`` is a Kronecker product);
  ``num_iters > 0`` runs the power iteration toward the Frobenius-nearest
  Kronecker product, ``u_1 u_1^T ⊗ v_1 v_1^T`` times ``sigma_1^2`` for the
  top singular pair of ``M``.
  """
  grads = jax.tree.map(lambda m: m[None], ps.mean_grad)
  # mean_grad is already global: no all-reduce, and one "example".
  one = ps._replace(axis_name=None, count=jnp.ones((), jnp.int32))
  return _shampoo_factors(one, num_iters, grads)


# -- from given per-example gradients ------------------------------------------


def diagonal_from_grads(
  per_example_grads: PyTree,
  *,
  kind: str = "empirical",
  axis_name: str | None = None,
) -> _statistics.DiagonalFisher:
  """Diagonal Fisher from precomputed per-example gradients ``(B, *leaf)``.

  ``kind="empirical"``: ``mean_n g_n^2``; ``"batch_squared"``:
  ``(mean_n g_n)^2``. ``mean_grad`` is ``mean_n g_n``. Non-finite gradients
  propagate into ``diag``.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax import fisher
    >>> fisher.diagonal_from_grads(jnp.array([[1.0], [3.0]])).diag
    Array([5.], dtype=float32)
  """
  validation.check_choice("kind", kind, ("empirical", "batch_squared"))
  size = _per_example.check_batch_tree(
    per_example_grads, what="per_example_grads"
  )
  validation.check_real_floating(
    per_example_grads, what="per_example_grads", function="diagonal_from_grads"
  )
  count = _psum(jnp.asarray(size, jnp.int32), axis_name)
  g = numerics.widen(per_example_grads)
  mean = jax.tree.map(
    lambda s: s / count,
    _psum(jax.tree.map(lambda x: jnp.sum(x, 0), g), axis_name),
  )
  if kind == "batch_squared":
    diag = jax.tree.map(jnp.square, mean)
  else:
    diag = jax.tree.map(
      lambda s: s / count,
      _psum(jax.tree.map(lambda x: jnp.sum(jnp.square(x), 0), g), axis_name),
    )
  return _statistics.DiagonalFisher(diag, mean, count, kind)


def diagonal_from_loss(
  loss_fn: Callable[[PyTree, PyTree], jax.Array],
  params: PyTree,
  batch: PyTree,
  *,
  kind: str = "empirical",
  chunk_size: int | None = None,
  axis_name: str | None = None,
) -> _statistics.DiagonalFisher:
  r"""Batch sufficient statistics of a bare per-example loss.

  .. math::

    \bar g = \frac{1}{N}\sum_n g_n, \qquad
    \operatorname{diag} F = \frac{1}{N}\sum_n g_n^{\odot 2}
    \;(\texttt{empirical}) \text{ or } \bar g^{\odot 2}
    \;(\texttt{batch\_squared}),

  with ``g_n = grad loss_fn(params, example_n)``, accumulated chunk by chunk
  (``lax.scan``), so memory grows with ``chunk_size``, never with ``B x P``
  (the quantity ``optax.microbatching.micro_grad`` gives with MEAN
  accumulation). A bare loss defines no distribution: only the two kinds
  that need no likelihood are available.

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar`` for ONE example.
    params: the parameters.
    batch: a pytree of arrays with a leading batch axis.
    kind: ``"empirical" | "batch_squared"``.
    chunk_size: examples per chunk (static int ``>= 1``).
    axis_name: a ``shard_map`` axis the batch is split over.

  Returns:
    A :class:`DiagonalFisher` with ``mean_grad`` = ``bar g``.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax import fisher
    >>> loss = lambda w, ex: 0.5 * (ex[0] @ w - ex[1]) ** 2
    >>> x, y = jnp.eye(3), jnp.ones(3)
    >>> fisher.diagonal_from_loss(loss, jnp.zeros(3), (x, y)).diag
    Array([0.33333334, 0.33333334, 0.33333334], dtype=float32)
  """
  validation.check_choice("kind", kind, ("empirical", "batch_squared"))
  size = _per_example.check_batch_tree(batch)
  chunk_size = _per_example.check_chunk_size(chunk_size)
  if axis_name is not None:
    params = jax.tree.map(
      lambda p: jax.lax.pcast(p, axis_name, to="varying"), params
    )

  def chunk_sums(examples):
    g = numerics.widen(
      jax.vmap(lambda ex: jax.grad(loss_fn)(params, ex))(examples)
    )
    return (
      jax.tree.map(lambda a: jnp.sum(a, 0), g),
      jax.tree.map(lambda a: jnp.sum(jnp.square(a), 0), g),
    )

  sums, squares = _psum(
    _per_example.reduce_chunks(chunk_sums, batch, size, chunk_size), axis_name
  )
  count = _psum(jnp.asarray(size, jnp.int32), axis_name)
  mean = jax.tree.map(lambda s: s / count, sums)
  if kind == "batch_squared":
    diag = jax.tree.map(jnp.square, mean)
  else:
    diag = jax.tree.map(lambda s: s / count, squares)
  return _statistics.DiagonalFisher(diag, mean, count, kind)


def low_rank_from_grads(
  per_example_grads: PyTree, *, rank: int
) -> _statistics.LowRankFisher:
  """Top-``rank`` empirical-Fisher eigenpairs from per-example gradients.

  Same Gram-matrix trick as :func:`low_rank` on ``G`` = the given
  ``(B, *leaf)`` gradients.
  """
  rank = validation.check_static_int("rank", rank, minimum=1)
  size = _per_example.check_batch_tree(
    per_example_grads, what="per_example_grads"
  )
  validation.check_real_floating(
    per_example_grads, what="per_example_grads", function="low_rank_from_grads"
  )
  g = numerics.widen(per_example_grads)
  count = jnp.asarray(size, jnp.int32)
  mean = jax.tree.map(lambda x: jnp.mean(x, 0), g)
  return _low_rank_from_stacked(g, rank, count, mean, "empirical")
