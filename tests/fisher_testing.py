# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Shared test helpers: a tiny MLP and dense ``jax.jacobian`` Fisher oracles.

At the end, test-only entry points to the engine's internals: layer
statistics straight from a recorded tape (with per-example norms) and the
Woodbury whitening, which the package computes inside its estimators.

The oracles never call :mod:`fisher_optax.fisher`: they build the full
``P x P`` Fisher of a tiny model from the per-example Jacobian
``J_n = d f(x_n) / d theta`` and closed-form output statistics, so any
estimator (any kind, any structure, any path) can be checked against its
definition. Call them inside ``with jax.enable_x64(True):`` with float64
params for tight tolerances.

Typical use::

  with jax.enable_x64(True):
    params = fisher_testing.mlp_params(jax.random.key(0), dtype=jnp.float64)
    x, y = fisher_testing.make_batch(jax.random.key(1), 6, "categorical")
    dense = fisher_testing.dense_fisher(
        fisher_testing.mlp_apply, params, x, y, family="categorical",
        kind="exact")
    diag = fisher_testing.unravel_like(params, jnp.diag(dense))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
from typing import Any
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from fisher_optax import fisher
from fisher_optax.fisher import _taps
from fisher_optax.fisher import linalg

PyTree = Any

FAMILIES = ("categorical", "gaussian", "bernoulli", "heteroscedastic")
SIGMA = 0.7  # Fixed sigma of the "gaussian" family.
IN_DIM = 4
OUT_DIM = 4  # Heteroscedastic: reshaped to (2, 2) = (mu, log var) pairs.


def normal(key: jax.Array, shape: Sequence[int], dtype: Any = None):
  """Like ``jax.random.normal``, drawn by NumPy from the key's bits.

  Test data only: an eager ``jax.random`` call compiles for every new shape
  (about 0.1 s each on CPU), most of a small test's time.
  """
  seed = np.asarray(jax.random.key_data(key)).ravel().tolist()
  draw = np.random.default_rng(seed).standard_normal(tuple(shape))
  return jnp.asarray(draw, dtype or jnp.result_type(float))


def mlp_params(
  key: jax.Array,
  sizes: Sequence[int] = (IN_DIM, 5, OUT_DIM),
  dtype: Any = jnp.float32,
) -> dict[str, dict[str, jax.Array]]:
  """Flax-like params ``{"dense_i": {"kernel": (d_in, d_out), "bias"}}``."""
  params = {}
  keys = jax.random.split(key, len(sizes) - 1)
  for i, (k, d_in, d_out) in enumerate(zip(keys, sizes[:-1], sizes[1:])):
    kw, kb = jax.random.split(k)
    params[f"dense_{i}"] = {
      "kernel": (normal(kw, (d_in, d_out)) / np.sqrt(d_in)).astype(dtype),
      "bias": (0.1 * normal(kb, (d_out,))).astype(dtype),
    }
  return params


def mlp_apply(params: PyTree, inputs: jax.Array) -> jax.Array:
  """``tanh`` MLP on a batch ``(B, d_in) -> (B, d_out)``."""
  h = inputs
  n = len(params)
  for i in range(n):
    layer = params[f"dense_{i}"]
    h = h @ layer["kernel"] + layer["bias"]
    if i < n - 1:
      h = jnp.tanh(h)
  return h


def mlp_apply_pairs(params: PyTree, inputs: jax.Array) -> jax.Array:
  """The MLP with outputs reshaped to ``(B, OUT_DIM // 2, 2)`` pairs."""
  return mlp_apply(params, inputs).reshape(inputs.shape[0], -1, 2)


def apply_for(family: str) -> Callable[[PyTree, jax.Array], jax.Array]:
  """The MLP apply function whose outputs suit ``family``."""
  return mlp_apply_pairs if family == "heteroscedastic" else mlp_apply


def make_batch(
  key: jax.Array, n: int, family: str, dtype: Any = None
) -> tuple[jax.Array, jax.Array]:
  """Random ``(inputs (n, IN_DIM), targets)`` for a likelihood family."""
  dtype = dtype or (jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
  kx, ky = jax.random.split(key)
  x = normal(kx, (n, IN_DIM), dtype)
  if family == "categorical":
    y = jax.random.randint(ky, (n,), 0, OUT_DIM)
  elif family == "gaussian":
    y = normal(ky, (n, OUT_DIM), dtype)
  elif family == "bernoulli":
    y = jax.random.bernoulli(ky, 0.5, (n, OUT_DIM)).astype(dtype)
  elif family == "heteroscedastic":
    y = normal(ky, (n, OUT_DIM // 2), dtype)
  else:
    raise ValueError(family)
  return x, y


def fused_kernels(tape: Any, kind: str) -> list[int]:
  """The kernel leaves of ``kind`` sites (``"dense"``, ``"conv"``) whose
  statistic a recorded tape forms in the backward pass."""
  assert tape._fusion is not None
  return [
    leaf
    for leaf, (s, role) in tape._fusion.leaves.items()
    if role == "kernel" and tape._plan.sites[s].kind == kind
  ]


def ravel(tree: PyTree) -> jax.Array:
  return jnp.concatenate([jnp.ravel(l) for l in jax.tree.leaves(tree)])


def unravel_like(like: PyTree, flat: jax.Array) -> PyTree:
  """Splits a flat vector (or a leading-axis stack of them) into ``like``."""
  leaves, treedef = jax.tree.flatten(like)
  out, i = [], 0
  lead = flat.shape[:-1]
  for leaf in leaves:
    size = int(np.prod(leaf.shape))
    out.append(flat[..., i : i + size].reshape(*lead, *leaf.shape))
    i += size
  return jax.tree.unflatten(treedef, out)


def jacobians(
  apply_fn: Callable[..., jax.Array], params: PyTree, inputs: jax.Array
) -> jax.Array:
  """Per-example Jacobians ``(B, O, P)``: outputs flattened, params ravelled."""
  flat = ravel(params)

  def f(theta, x):
    out = apply_fn(unravel_like(params, theta), x[None])[0]
    return jnp.ravel(out)

  return jax.vmap(jax.jacobian(f), in_axes=(None, 0))(flat, inputs)


def output_grad(family: str, out: jax.Array, y: jax.Array) -> jax.Array:
  """Closed-form ``d NLL / d out`` for one example, flattened."""
  if family == "categorical":
    return jax.nn.softmax(out) - jax.nn.one_hot(
      y, out.shape[-1], dtype=out.dtype
    )
  if family == "gaussian":
    return jnp.ravel((out - y) / SIGMA**2)
  if family == "bernoulli":
    return jnp.ravel(jax.nn.sigmoid(out) - y)
  if family == "heteroscedastic":
    mu, logvar = out[..., 0], out[..., 1]
    r = y - mu
    dmu = -r * jnp.exp(-logvar)
    dlv = 0.5 - 0.5 * r**2 * jnp.exp(-logvar)
    return jnp.ravel(jnp.stack([dmu, dlv], -1))
  raise ValueError(family)


def output_fisher(family: str, out: jax.Array) -> jax.Array:
  """Closed-form ``Lambda`` (``O x O``) for one example."""
  if family == "categorical":
    p = jax.nn.softmax(out)
    return jnp.diag(p) - jnp.outer(p, p)
  if family == "gaussian":
    return jnp.eye(out.size, dtype=out.dtype) / SIGMA**2
  if family == "bernoulli":
    p = jax.nn.sigmoid(jnp.ravel(out))
    return jnp.diag(p * (1 - p))
  if family == "heteroscedastic":
    logvar = out[..., 1]
    d = jnp.stack([jnp.exp(-logvar), 0.5 * jnp.ones_like(logvar)], -1)
    return jnp.diag(jnp.ravel(d))
  raise ValueError(family)


@functools.partial(jax.jit, static_argnums=(0, 4))
def per_example_grads_dense(
  apply_fn,
  params,
  inputs,
  targets,
  family,
) -> jax.Array:
  """``(B, P)`` per-example NLL gradients ``J_n^T d NLL/d out``."""
  jac = jacobians(apply_fn, params, inputs)
  outs = apply_fn(params, inputs)
  r = jax.vmap(lambda o, y: output_grad(family, o, y))(outs, targets)
  return jnp.einsum("bop,bo->bp", jac, r)


@functools.partial(
  jax.jit, static_argnums=(0,), static_argnames=("family", "kind")
)
def dense_fisher(
  apply_fn: Callable[..., jax.Array],
  params: PyTree,
  inputs: jax.Array,
  targets: jax.Array | None,
  *,
  family: str,
  kind: str,
) -> jax.Array:
  """The dense ``P x P`` Fisher (a mean over examples) of the given kind.

  ``kind="mc"`` is not deterministic: for it pass the sampled labels as
  ``targets`` with a leading sample axis ``(S, B, ...)`` and use
  ``kind="empirical_samples"``, which averages over the samples.
  """
  if kind == "exact":
    jac = jacobians(apply_fn, params, inputs)
    outs = apply_fn(params, inputs)
    lam = jax.vmap(lambda o: output_fisher(family, o))(outs)
    return jnp.einsum("bop,boq,bqr->pr", jac, lam, jac) / inputs.shape[0]
  if kind == "empirical":
    g = per_example_grads_dense(apply_fn, params, inputs, targets, family)
    return g.T @ g / inputs.shape[0]
  if kind == "batch_squared":
    g = per_example_grads_dense(apply_fn, params, inputs, targets, family)
    m = jnp.mean(g, 0)
    return jnp.outer(m, m)
  if kind == "empirical_samples":
    fs = [
      dense_fisher(
        apply_fn, params, inputs, targets[i], family=family, kind="empirical"
      )
      for i in range(targets.shape[0])
    ]
    return sum(fs) / len(fs)
  raise ValueError(kind)


@functools.partial(jax.jit, static_argnums=(0, 4))
def mean_grad_dense(apply_fn, params, inputs, targets, family) -> PyTree:
  """The mean NLL gradient as a params-shaped tree."""
  g = per_example_grads_dense(apply_fn, params, inputs, targets, family)
  return unravel_like(params, jnp.mean(g, 0))


def leaf_blocks(params: PyTree, dense: jax.Array) -> list[jax.Array]:
  """The diagonal blocks of a dense Fisher, one per leaf (flatten order)."""
  blocks, i = [], 0
  for leaf in jax.tree.leaves(params):
    size = int(np.prod(leaf.shape))
    blocks.append(dense[i : i + size, i : i + size])
    i += size
  return blocks


def top_eig(dense: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Top-``k`` eigenpairs ``(vals (k,) descending, vecs (k, P))``."""
  vals, vecs = jnp.linalg.eigh(dense)
  return vals[::-1][:k], vecs[:, ::-1][:, :k].T


# -- layer-statistics and Woodbury helpers only the tests use ------------------
#
# The engine computes these inside its estimators; the tests call them
# directly to check the layer path and the Woodbury algebra leaf by leaf.

LAYER_STRUCTURES = ("diag", "kron", "gram", "norms")


def _check_chunk(chunk_size) -> None:
  if chunk_size is not None and (
    not isinstance(chunk_size, (int, np.integer))
    or isinstance(chunk_size, bool)
    or chunk_size < 1
  ):
    raise ValueError(
      f"chunk_size must be None or a positive int, got {chunk_size!r}."
    )


def layer_norms(layer_grads: Any) -> PyTree:
  """``|g_i|^2`` per covered leaf, ``(S * B,)`` ordered ``i = s * B + n``.

  The "ghost norm" of a (weight-shared) dense layer,
  :math:`\\langle a a^\\top, \\delta \\delta^\\top \\rangle`, from a
  ``_taps.LayerGrads`` (reads its per-site views).
  """
  out = {}
  for leaf, s, role in layer_grads._leaf_items():
    site, act, delta, _ = layer_grads._view(s)
    if role == "bias":
      out[leaf] = jnp.sum(jnp.sum(delta, axis=2) ** 2, axis=-1).reshape(-1)
      continue
    if site.kind == "embed":
      same = (act[:, :, None] == act[:, None, :]).astype(delta.dtype)
    elif act.shape[1] == 1:
      a2 = jnp.sum(act[:, 0] ** 2, axis=-1)
      out[leaf] = (jnp.sum(delta[:, :, 0] ** 2, axis=-1) * a2).reshape(-1)
      continue
    else:
      same = jnp.einsum("ntd,nud->ntu", act, act)
    dd = jnp.einsum("sntd,snud->sntu", delta, delta)
    out[leaf] = jnp.einsum("ntu,sntu->sn", same, dd).reshape(-1)
  num = layer_grads.num_samples * layer_grads.tape.batch
  for leaf in layer_grads.tape._plan.special:  # scanned or shared leaves
    views = layer_grads._special_views(leaf)
    chunk, count, grads = layer_grads._chunks(views, (leaf,), None)
    rows = [grads(j)[1][0].reshape(chunk, -1) for j in range(count)]
    out[leaf] = jnp.sum(jnp.concatenate(rows) ** 2, axis=1)[:num]
  return layer_grads._unflatten(out)


def layer_statistics(
  apply_fn: Callable[[PyTree, PyTree], PyTree],
  params: PyTree,
  inputs: PyTree,
  cotangents: PyTree,
  *,
  structure: str,
  chunk_size: int | None = None,
  axis_name: str | None = None,
  fused: bool = False,
) -> tuple[Any, PyTree]:
  """``(stats, covered)`` of ``_taps.record(...).backward(cotangents)``.

  ``structure`` is one of ``LayerGrads.statistics``' (``"diag"``,
  ``"kron"``, ``"gram"``) or ``"norms"`` (:func:`layer_norms`);
  ``cotangents`` is ``(S, B, *out_shape)``. With ``fused``, the tape forms
  the statistic of stacked layers inside the backward pass
  (``record(statistic=structure)``).
  """
  if structure not in LAYER_STRUCTURES:
    raise ValueError(
      f"structure must be one of {LAYER_STRUCTURES}, got {structure!r}."
    )
  _check_chunk(chunk_size)
  tape = _taps.record(
    apply_fn,
    params,
    inputs,
    axis_name=axis_name,
    statistic=structure if fused else None,
    chunk_size=chunk_size,
  )
  grads = tape.backward(cotangents)
  if structure == "norms":
    return layer_norms(grads), tape.covered
  return grads.statistics(structure, chunk_size=chunk_size), tape.covered


def layer_combine(
  apply_fn: Callable[[PyTree, PyTree], PyTree],
  params: PyTree,
  inputs: PyTree,
  cotangents: PyTree,
  weights: jax.Array,
  *,
  axis_name: str | None = None,
) -> tuple[PyTree, PyTree]:
  """``(sum_i weights[:, i] g_i, covered)``; ``weights`` is ``(k, S * B)``."""
  lead = jax.tree.leaves(cotangents)[0].shape[:2]
  if np.ndim(weights) != 2 or np.shape(weights)[1] != int(np.prod(lead)):
    raise ValueError(
      f"weights must have shape (k, S * B) = (k, {int(np.prod(lead))}); "
      f"got {np.shape(weights)}."
    )
  tape = _taps.record(apply_fn, params, inputs, axis_name=axis_name)
  return tape.backward(cotangents).combine(weights), tape.covered


def woodbury_whiten(stacked: PyTree, factor: Any) -> PyTree:
  """``Z = L^{-1} G`` as a stacked tree (``F^{-1} = (I - Z^T Z)/lambda``)."""
  linv = linalg.tril_inverse(factor.chol)
  return jax.tree.map(
    lambda s: jnp.tensordot(
      linv.astype(s.dtype), s, axes=(1, 0), precision=jax.lax.Precision.HIGHEST
    ),
    stacked,
  )


def woodbury_inverse_diag(stacked: PyTree, factor: Any) -> PyTree:
  """The diagonal of ``F^{-1}`` of a ``linalg.woodbury_factor``, one slice."""
  z = woodbury_whiten(stacked, factor)
  return jax.tree.map(
    lambda zl: (
      (1.0 - jnp.sum(jnp.square(zl), axis=0)) / factor.damping.astype(zl.dtype)
    ),
    z,
  )


def empirical(
  estimator: Callable[..., Any],
  apply_fn: Callable[[PyTree, PyTree], PyTree],
  params: PyTree,
  batch: tuple[Any, Any],
  **kw: Any,
) -> Any:
  """``estimator`` (``fisher.diagonal``, ``kronecker``, ``low_rank``, ...)
  of a categorical model's empirical Fisher on ``batch``."""
  return estimator(
    apply_fn,
    params,
    batch,
    likelihood=fisher.Categorical(),
    kind="empirical",
    **kw,
  )


def estimates_by_path(
  apply_fn: Callable[[PyTree, PyTree], PyTree],
  params: PyTree,
  batch: tuple[Any, Any],
  *,
  rank: int,
) -> dict[tuple[str, str], Any]:
  """Categorical diagonals (``"empirical"``, ``"exact"``) and a top-``rank``
  exact ``"low_rank"`` (eigenvalues, product with ones), by ``method="auto"``
  and ``"per_example"`` in one jit: ``{(method, key): value}``. ``"auto"``
  must not fall back (a ``FisherFallbackWarning`` is an error)."""

  @jax.jit
  def run(params, batch):
    out = {}
    for method in ("auto", "per_example"):
      kw: dict[str, Any] = dict(likelihood=fisher.Categorical(), method=method)
      for kind in ("empirical", "exact"):
        out[method, kind] = fisher.diagonal(
          apply_fn, params, batch, kind=kind, **kw
        ).diag
      top = fisher.low_rank(
        apply_fn, params, batch, kind="exact", rank=rank, **kw
      )
      v = jax.tree.map(jnp.ones_like, params)
      out[method, "low_rank"] = (top.eigvals, top.matvec(v))
    return out

  with warnings.catch_warnings():
    warnings.simplefilter("error", fisher.FisherFallbackWarning)
    return run(params, batch)
