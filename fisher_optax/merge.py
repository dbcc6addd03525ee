# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
r"""Command line: Fisher-merge checkpoints, and compute a model's Fisher.

Three subcommands, the same as the ``fisher-merge`` console script and as
``python -m fisher_optax.merge``::

  # Merge K checkpoints given their diagonal Fishers.
  fisher-merge merge \
      --models base.msgpack finetuned.msgpack \
      --fishers base_fisher.msgpack finetuned_fisher.msgpack \
      --weights 0.6 0.4 --output merged.msgpack

  # Compute a model's diagonal Fisher on a dataset, through the engine.
  fisher-merge fisher \
      --model my_project.models:make_model --params base.msgpack \
      --data train.npz --output base_fisher.msgpack

  # A first try: two small trained models and their data; prints the
  # 'fisher' and 'merge' commands to run on them.
  fisher-merge example try_merge/

``fisher-merge --help`` (and ``fisher-merge merge --help``, ...) documents
every option with its default. Reading and writing ``*.msgpack`` files needs
flax (``pip install 'fisher_optax[flax]'``).

**Formats.** Checkpoints, Fishers and outputs are flax msgpack files
(``*.msgpack``, e.g. written by ``flax.serialization.msgpack_serialize`` of
``nnx.to_pure_dict(nnx.state(model))`` or of Linen ``params``) or orbax
checkpoint directories (e.g. ``ocp.StandardCheckpointer().save(path,
nnx.state(model))``). Nothing is ever unpickled; other formats are refused.
Datasets are ``.npz`` files read with ``allow_pickle=False``.

**merge** loads the target first, then streams the other models through
:func:`fisher_optax.fisher_merge_accumulator`, so memory holds two
params-sized buffers plus one model and its Fisher. Every model is checked
against the target (same leaves, shapes and dtypes) and every Fisher against
the models (same leaves and shapes, floating point, finite, non-negative);
model parameters must be finite, and so must the merged result. Values are
checked in their own dtype, and float64 models are merged in float64. The
first problem found is reported with the file and the leaf, the command
exits with status 1, and nothing is written. ``--keep-target REGEX``
(repeatable) copies the leaves whose path (``a/b/c``) matches from the
target unmerged (heads); non-floating leaves always come from the target.

**Outputs and checksums.** Outputs are written atomically (a temporary
sibling, then an exclusive rename that never replaces a file that appeared
meanwhile), with the usual permissions (umask), and with SHA-256 checksums:
``merged.msgpack.sha256`` next to a msgpack file (``sha256sum -c`` reads
it), ``fisher_optax.sha256`` inside an orbax directory. Inputs that carry
such checksums are verified before use, so a damaged file is an error, not
a silently wrong merge; inputs without them are read unverified. An existing
output is replaced only with ``--overwrite``, only if it carries our
checksums (a directory or file we did not write is refused and left
untouched), and only once the new output is complete. Temporaries
(``.NAME.tmp-*``) of a killed run are removed by the next run.

**fisher** imports ``--model module:factory`` (with the current directory
first on ``sys.path``, as ``python -m`` has it, so ``--model mymodels:make``
finds ``./mymodels.py`` from the console script too) and calls ``factory()``
with no arguments. It must return either

* an ``nnx.Module``: the checkpoint is its state as a pure dict (orbax's
  ``{"value": ...}`` wrappers are accepted); ``nnx.Param`` leaves get a
  Fisher, other leaves (batch statistics, RNG state) zeros. ``model.eval()``
  is called first, so dropout is off.
* a function ``apply_fn(params, inputs) -> outputs`` (e.g.
  ``lambda p, x: linen_module.apply({"params": p}, x)``), differentiated
  with respect to every floating leaf of the checkpoint;
* or a pair ``(apply_fn, params)``, as ``examples.common.models.functional``
  returns (``--model examples.common.models:digits_mlp``); the checkpoint must
  have the leaves and shapes of ``params``.

The inputs are ``--inputs-key`` (default ``x``) of the ``.npz`` file, the
targets ``--targets-key`` (default ``y``; needed by ``--kind empirical``
only). By default the Fisher is the paper's: the exact expectation over the
model's own predictive distribution (``--kind exact``, labels unused) for a
categorical likelihood, on at most ``--max-examples`` (4096, as in the paper)
examples drawn at random with ``--seed``. The Fisher file mirrors the
checkpoint's tree, so it can be passed straight to ``merge``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import contextlib
import importlib
import os
import pathlib
import re
import shlex
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fisher_optax import _checkpoint_io
from fisher_optax import _merging
from fisher_optax import fisher
from fisher_optax.fisher import numerics

PyTree = Any


class MergeInputError(ValueError):
  """Inputs to the merge are inconsistent (the message names the leaf)."""


# -- tree helpers --------------------------------------------------------------


def _path_str(path: tuple[Any, ...]) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def _flat(tree: PyTree) -> dict[str, Any]:
  return {
    _path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def _is_float(x: Any) -> bool:
  # jnp's check also knows the ml_dtypes floats (bfloat16, float8s).
  return jnp.issubdtype(_checkpoint_io.dtype_of(x), jnp.floating)


# -- validation ----------------------------------------------------------------


def _check_leaves(
  ref: dict[str, Any], other: dict[str, Any], *, ref_name: str, name: str
) -> None:
  missing = [k for k in ref if k not in other]
  extra = [k for k in other if k not in ref]
  if missing:
    raise MergeInputError(
      f"{name} lacks leaf {missing[0]!r} (present in {ref_name}); "
      f"{len(missing)} missing in all."
    )
  if extra:
    raise MergeInputError(
      f"{name} has leaf {extra[0]!r}, absent from {ref_name}; "
      f"{len(extra)} extra in all."
    )
  for k, r in ref.items():
    if np.shape(other[k]) != np.shape(r):
      raise MergeInputError(
        f"{name} leaf {k!r} has shape {np.shape(other[k])} but "
        f"{ref_name}'s has shape {np.shape(r)}."
      )


def _all_finite(x: Any) -> bool:
  """Every entry finite, in the array's own dtype (1e300 in float64 is)."""
  x = np.asarray(x)
  try:
    return bool(np.all(np.isfinite(x)))
  except TypeError:  # a float type numpy has no ufunc for: widening is exact
    return bool(np.all(np.isfinite(x.astype(np.float64))))


def validate_model(
  ref: dict[str, Any], model: dict[str, Any], *, ref_name: str, name: str
) -> None:
  """Same leaves, shapes and dtypes as the reference; finite floats."""
  _check_leaves(ref, model, ref_name=ref_name, name=name)
  for k, r in ref.items():
    x = model[k]
    x_dtype, r_dtype = _checkpoint_io.dtype_of(x), _checkpoint_io.dtype_of(r)
    if x_dtype != r_dtype:
      raise MergeInputError(
        f"{name} leaf {k!r} has dtype {x_dtype} but {ref_name}'s has dtype "
        f"{r_dtype}."
      )
    if _is_float(x) and not _all_finite(x):
      raise MergeInputError(f"{name} leaf {k!r} has non-finite values.")


def validate_fisher(
  ref: dict[str, Any], fisher: dict[str, Any], *, ref_name: str, name: str
) -> None:
  """Same leaves and shapes as the model; floating, finite, non-negative."""
  _check_leaves(ref, fisher, ref_name=ref_name, name=name)
  for k, r in ref.items():
    if not _is_float(r):  # not merged; its Fisher is ignored
      continue
    leaf, where = np.asarray(fisher[k]), f"{name} leaf {k!r}"
    if not _is_float(leaf):
      _merging.check_fisher_leaf(leaf, name=where, error=MergeInputError)
    # The values are checked here in the leaf's own dtype (the library's
    # check works in float32, which a finite float64 1e300 overflows).
    if not _all_finite(leaf):
      raise MergeInputError(f"{where} has non-finite values.")
    negative = int(np.sum(leaf < 0))
    if negative:
      raise MergeInputError(
        f"{where} has {negative} negative entries; a diagonal Fisher is "
        "non-negative."
      )


def _build_mask(
  flat_ref: dict[str, Any], patterns: Sequence[str], tree: PyTree
) -> PyTree | None:
  if not patterns:
    return None
  regexes = []
  for p in patterns:
    try:
      regexes.append(re.compile(p))
    except re.error as e:
      raise MergeInputError(f"--keep-target {p!r} is not a regex: {e}") from e
  for p, rx in zip(patterns, regexes):
    if not any(rx.search(k) for k in flat_ref):
      raise MergeInputError(
        f"--keep-target {p!r} matches no leaf; leaves look like "
        f"{next(iter(flat_ref), '<none>')!r}."
      )
  return jax.tree_util.tree_map_with_path(
    lambda path, _: not any(rx.search(_path_str(path)) for rx in regexes), tree
  )


# -- merge ---------------------------------------------------------------------


def _check_merge_args(
  n_models: int,
  n_fishers: int,
  weights: Sequence[float] | None,
  target_index: int,
  fisher_floor: float,
) -> np.ndarray:
  """Validates the arguments of :func:`merge_checkpoints`; returns weights."""
  if n_models < 1:
    raise MergeInputError("Give at least one model.")
  if n_fishers != n_models:
    raise MergeInputError(
      f"Got {n_models} models but {n_fishers} Fishers; give one "
      "Fisher per model, in the same order."
    )
  if weights is None:
    weights = [1.0] * n_models
  if len(weights) != n_models:
    raise MergeInputError(f"Got {len(weights)} weights for {n_models} models.")
  w = np.asarray(weights, np.float64)
  if not np.all(np.isfinite(w)) or np.any(w < 0) or not np.any(w > 0):
    raise MergeInputError(
      f"Weights must be finite, >= 0 and not all zero, got {list(weights)}."
    )
  if not 0 <= target_index < n_models:
    raise MergeInputError(
      f"--target-index must lie in [0, {n_models}), got {target_index}."
    )
  if fisher_floor < 0 or not np.isfinite(fisher_floor):
    raise MergeInputError(
      f"--floor must be finite and >= 0, got {fisher_floor}."
    )
  return w


def _load_pair(
  params: PyTree,
  model_name: str,
  fisher_path: str,
  target: PyTree,
  ref_name: str,
) -> tuple[PyTree, PyTree]:
  """Checks a model against the target and loads its Fisher in its shape."""
  flat_target = _flat(target)
  validate_model(flat_target, _flat(params), ref_name=ref_name, name=model_name)
  if jax.tree.structure(params) != jax.tree.structure(target):
    raise MergeInputError(
      f"{model_name} has the leaves of {ref_name} but a different "
      "container structure."
    )
  fisher_tree = _flat(_checkpoint_io.load_tree(fisher_path))
  validate_fisher(
    flat_target, fisher_tree, ref_name=model_name, name=fisher_path
  )
  for k, r in flat_target.items():
    fisher_tree[k] = _in_compute_dtype(fisher_tree[k], r, fisher_path, k)
  # Fishers mirror the model's containers (e.g. lists vs dicts).
  return params, jax.tree.unflatten(
    jax.tree.structure(params), [fisher_tree[k] for k in _flat(params)]
  )


def _in_compute_dtype(f: Any, ref: Any, name: str, key: str) -> Any:
  """A float64 Fisher leaf for a narrower model, cast to float32 (checked).

  The merge runs in at least float32 and in float64 only for float64
  models; a Fisher beyond float32's range would overflow silently there.
  """
  f = np.asarray(f)
  if not _is_float(ref) or not _is_float(f) or f.dtype.itemsize <= 4:
    return f
  if np.asarray(ref).dtype == np.float64:
    return f
  with np.errstate(over="ignore"):  # reported below
    narrow = f.astype(np.float32)
  if not _all_finite(narrow):
    raise MergeInputError(
      f"{name} leaf {key!r} has values up to {float(np.max(f)):.3g}, beyond "
      "float32, the precision this model is merged in; divide every Fisher "
      "by one common factor or store the models in float64."
    )
  return narrow


def _needs_x64(tree: PyTree) -> bool:
  return any(
    _checkpoint_io.dtype_of(x) == np.float64 for x in jax.tree.leaves(tree)
  )


def _x64_if(on: bool) -> contextlib.AbstractContextManager[Any]:
  if not on or jax.config.read("jax_enable_x64"):
    return contextlib.nullcontext()
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(True)  # pyright: ignore[reportReturnType]
  # Older jax: the experimental context manager.
  return importlib.import_module("jax.experimental").enable_x64()


def merge_checkpoints(
  models: Sequence[str],
  fishers: Sequence[str],
  output: str,
  *,
  weights: Sequence[float] | None = None,
  fisher_floor: float = 1e-6,
  floor_mode: str = "all",
  normalize: bool = False,
  keep_target: Sequence[str] = (),
  target_index: int = 0,
  output_format: str | None = None,
  overwrite: bool = False,
) -> str:
  """Validates and merges checkpoint files, writing ``output`` atomically.

  Args:
    models: checkpoint paths, one per model.
    fishers: Fisher paths, one per model, same trees as the models.
    output: destination path.
    weights: one non-negative weight per model (default equal).
    fisher_floor: see :func:`fisher_optax.fisher_merge`.
    floor_mode: ``"all"`` or ``"target"``.
    normalize: divide weights by the Fishers' global L2 norms.
    keep_target: regexes over leaf paths ``a/b/c`` taken from the target.
    target_index: which model is the target.
    output_format: ``"msgpack"``/``"orbax"``, or inferred from ``output``.
    overwrite: replace an existing output (only once the merge succeeded).

  Returns:
    The format written.

  Raises:
    MergeInputError: inconsistent or non-finite inputs (the message names
      file and leaf), or a merged result that is not finite; nothing is
      written.
    OutputExistsError: ``output`` exists and ``overwrite`` is False, or it
      is not an output of this command.
    ChecksumError: an input differs from the checksums written with it.

  Example:
    >>> import pathlib, tempfile
    >>> import numpy as np
    >>> from flax import serialization
    >>> from fisher_optax import merge
    >>> tmp_dir = tempfile.TemporaryDirectory()  # removed when collected
    >>> tmp = pathlib.Path(tmp_dir.name)
    >>> def write(name, w):
    ...   data = serialization.msgpack_serialize({"w": np.float32(w)})
    ...   (tmp / name).write_bytes(data)
    ...   return str(tmp / name)
    >>> models = [write("a.msgpack", [1, 1]), write("b.msgpack", [3, 3])]
    >>> fishers = [write("fa.msgpack", [1, 3]), write("fb.msgpack", [1, 1])]
    >>> out = str(tmp / "merged.msgpack")
    >>> merge.merge_checkpoints(models, fishers, out)
    'msgpack'
    >>> merged = serialization.msgpack_restore(pathlib.Path(out).read_bytes())
    >>> print(merged["w"])  # (F_a w_a + F_b w_b) / (F_a + F_b), per entry
    [2.  1.5]
  """
  w = _check_merge_args(
    len(models), len(fishers), weights, target_index, fisher_floor
  )
  # Fail on a bad destination before any work.
  fmt = _checkpoint_io.check_destination(
    output, output_format, overwrite=overwrite
  )
  for p in list(models) + list(fishers):
    _checkpoint_io.detect_format(p)

  ref_name = models[target_index]
  target = _checkpoint_io.load_tree(ref_name)
  # float64 models are merged in float64 (jax computes in float32 otherwise).
  with _x64_if(_needs_x64(target)):
    merged = _stream_merge(
      models,
      fishers,
      w,
      target,
      target_index,
      keep_target,
      fisher_floor=fisher_floor,
      floor_mode=floor_mode,
      normalize=normalize,
    )
  if not _all_finite_tree(merged):
    raise MergeInputError(
      "The merged parameters have non-finite entries (the Fishers or "
      "weights overflow); nothing written."
    )
  return _checkpoint_io.save_tree(output, merged, fmt=fmt, overwrite=overwrite)


def _all_finite_tree(tree: PyTree) -> bool:
  return all(_all_finite(x) for x in jax.tree.leaves(tree) if _is_float(x))


def _stream_merge(
  models: Sequence[str],
  fishers: Sequence[str],
  w: np.ndarray,
  target: PyTree,
  target_index: int,
  keep_target: Sequence[str],
  *,
  fisher_floor: float,
  floor_mode: str,
  normalize: bool,
) -> PyTree:
  """The target, then the other models, folded into the accumulator."""
  ref_name = models[target_index]
  acc = _merging.fisher_merge_accumulator(
    fisher_floor,
    floor_mode=floor_mode,
    normalize=normalize,
    merge_mask=_build_mask(_flat(target), keep_target, target),
  )
  # Donating the state lets XLA update the two running buffers in place.
  init, add = jax.jit(acc.init), jax.jit(acc.add, donate_argnums=0)
  # The weights in the precision of the merge (float64 for float64 models;
  # the caller enables x64 for them).
  weight_dtype = np.float64 if _needs_x64(target) else np.float32
  w = _merging._host_scaled("weights", w)  # as fisher_merge scales them
  state = init(
    *_load_pair(target, ref_name, fishers[target_index], target, ref_name),
    jnp.asarray(w[target_index], weight_dtype),
  )
  for i in range(len(models)):
    if i != target_index:
      params = _checkpoint_io.load_tree(models[i])
      pair = _load_pair(params, models[i], fishers[i], target, ref_name)
      state = add(state, *pair, jnp.asarray(w[i], weight_dtype))
      del params, pair  # one model and its Fisher in memory at a time
  return jax.device_get(acc.finalize(state))


# -- fisher --------------------------------------------------------------------


def _load_factory(spec: str):
  if ":" not in spec:
    raise ValueError(
      f"--model must look like 'package.module:factory', got {spec!r}."
    )
  mod_name, attr = spec.split(":", 1)
  module = importlib.import_module(mod_name)
  obj = module
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise ValueError(f"{mod_name!r} has no attribute {attr!r}.")
    obj = getattr(obj, part)
  if not callable(obj):
    raise ValueError(f"{spec!r} is not callable.")
  return obj


def _strip_value(path: str) -> str:
  # orbax restores nnx.State leaves as {"value": array}.
  return path.removesuffix("/value")


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for k, v in flat.items():
    node = out
    parts = k.split("/")
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[parts[-1]] = v
  return out


_LIKELIHOODS = {
  "categorical": lambda sigma: fisher.Categorical(),
  "bernoulli": lambda sigma: fisher.Bernoulli(),
  "gaussian": lambda sigma: fisher.Gaussian(sigma),
}


def _likelihood(name: str, sigma: float):
  if name not in _LIKELIHOODS:
    raise ValueError(f"Unknown likelihood {name!r}.")
  return _LIKELIHOODS[name](sigma)


def _load_examples(
  data: str, inputs_key: str, targets_key: str, *, kind: str
) -> tuple[np.ndarray, np.ndarray | None]:
  """``(inputs, targets or None)`` from an ``.npz`` file, never unpickling.

  Targets are read for ``kind="empirical"`` only: the other kinds draw
  labels from the model, so a file's labels (one-hot, strings, any shape)
  are not read.
  """
  npz = "an .npz archive (a zip of .npy arrays, as np.savez writes)"
  try:
    with open(data, "rb") as f:
      is_zip = f.read(4) == b"PK\x03\x04"
  except OSError as e:
    raise ValueError(f"Cannot read {data!r}: {e}") from e
  if not is_zip:
    raise ValueError(f"{data!r} is not {npz}.")
  try:
    arrays = np.load(data, allow_pickle=False)
  except ValueError as e:
    raise ValueError(f"Cannot read {data!r} as {npz}: {e}") from e
  if inputs_key not in arrays:
    raise ValueError(
      f"{data!r} has no array {inputs_key!r}; it has {list(arrays.keys())}."
    )
  if kind != "empirical":
    return arrays[inputs_key], None
  if targets_key not in arrays:
    raise ValueError(
      f"--kind empirical needs targets {targets_key!r} in {data!r}."
    )
  return arrays[inputs_key], arrays[targets_key]


def _subsample(n: int, max_examples: int, seed: int) -> np.ndarray:
  """Sorted indices of at most ``max_examples`` of ``n`` examples."""
  if n <= max_examples:
    return np.arange(n)
  rng = np.random.default_rng(seed)
  return np.sort(rng.choice(n, max_examples, replace=False))


class _Model(NamedTuple):
  """A model ready for the engine: what to differentiate, and how back."""

  apply_fn: Callable[[PyTree, Any], Any]
  params: PyTree
  # Maps the Fisher (a tree like ``params``) to {checkpoint leaf path: array}.
  to_flat: Callable[[PyTree], dict[str, Any]]


def _nnx_model(module: Any, tree: PyTree, params_path: str) -> _Model:
  """Loads the checkpoint into an NNX module; the Fisher is over its Params."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from fisher_optax import flax as fo_flax  # pylint: disable=g-import-not-at-top

  if hasattr(module, "eval"):
    module.eval()  # no dropout
  _, param_state, rest = nnx.split(module, nnx.Param, ...)
  by_key = {_strip_value(k): v for k, v in _flat(tree).items()}
  wanted = _flat(nnx.to_pure_dict(param_state))
  for k, ref in wanted.items():
    if k not in by_key:
      raise MergeInputError(
        f"{params_path} lacks parameter {k!r} of the model."
      )
    if np.shape(by_key[k]) != np.shape(ref):
      raise MergeInputError(
        f"{params_path} leaf {k!r} has shape {np.shape(by_key[k])} but "
        f"the model's has shape {np.shape(ref)}."
      )
  rest_keys = _flat(nnx.to_pure_dict(rest))
  unknown = [k for k in by_key if k not in wanted and k not in rest_keys]
  if unknown:
    raise MergeInputError(
      f"{params_path} has leaf {unknown[0]!r}, which the model lacks."
    )
  nnx.replace_by_pure_dict(
    param_state, _unflatten({k: by_key[k] for k in wanted})
  )
  rest_loaded = {k: by_key[k] for k in rest_keys if k in by_key}
  if rest_loaded:
    nnx.replace_by_pure_dict(rest, _unflatten(rest_loaded))
  nnx.update(module, param_state, rest)
  apply_fn, params = fo_flax.nnx_apply_fn(module)
  return _Model(apply_fn, params, lambda d: _flat(nnx.to_pure_dict(d)))


def _function_model(
  built: Any, tree: PyTree, model: str, params_path: str
) -> _Model:
  """An ``apply_fn`` (or ``(apply_fn, params)``) over the checkpoint's tree.

  The Fisher is over every floating leaf; the others (step counters, integer
  buffers) are passed through unchanged.
  """
  flat_tree = _flat(tree)
  if isinstance(built, tuple) and len(built) == 2 and callable(built[0]):
    _check_leaves(
      _flat(built[1]), flat_tree, ref_name=f"{model}'s params", name=params_path
    )
    built = built[0]
  if not callable(built):
    raise TypeError(
      f"{model}() returned a {type(built).__name__}; expected an "
      "nnx.Module, an apply_fn(params, inputs) or (apply_fn, params)."
    )
  keys = [k for k, v in flat_tree.items() if _is_float(v)]
  leaves, treedef = jax.tree.flatten(tree)
  is_float = [_is_float(v) for v in leaves]

  def apply_fn(p, inputs):
    it = iter(p)
    full = [next(it) if f else v for v, f in zip(leaves, is_float)]
    return built(treedef.unflatten(full), inputs)

  params = [v for v, f in zip(leaves, is_float) if f]
  return _Model(apply_fn, params, lambda d: dict(zip(keys, d)))


def _build_model(
  factory: Callable[[], Any], tree: PyTree, model: str, params_path: str
) -> _Model:
  built = factory()
  # A factory that returns an nnx.Module has imported flax.nnx; a function
  # model needs no flax at all.
  nnx = sys.modules.get("flax.nnx")
  if nnx is not None and isinstance(built, nnx.Module):
    return _nnx_model(built, tree, params_path)
  return _function_model(built, tree, model, params_path)


def _mean_diagonal(
  model: _Model,
  x: np.ndarray,
  y: np.ndarray | None,
  idx: np.ndarray,
  *,
  batch_size: int,
  seed: int,
  **estimator: Any,
) -> PyTree:
  """The engine's ``fisher.diagonal`` averaged over ``idx``, batch by batch.

  Batches are weighted by their size, so the result is the mean over the
  examples whatever the batch size (the MC kind's labels are drawn with one
  key per batch, so they change with it); ``estimator`` are ``fisher.diagonal``'s
  keywords (likelihood, kind, num_samples).
  """

  @jax.jit
  def batch_sum(p, xb, yb, key):
    stat = fisher.diagonal(model.apply_fn, p, (xb, yb), key=key, **estimator)
    return jax.tree.map(lambda d: d * xb.shape[0], stat.diag)

  total = None
  key = jax.random.key(seed)
  for start in range(0, len(idx), batch_size):
    sel = idx[start : start + batch_size]
    key, sub = jax.random.split(key)
    yb = None if y is None else jnp.asarray(y[sel])
    d = batch_sum(model.params, jnp.asarray(x[sel]), yb, sub)
    total = d if total is None else jax.tree.map(jnp.add, total, d)
  return jax.tree.map(lambda v: np.asarray(v / len(idx), np.float32), total)


def compute_fisher(
  model: str,
  params_path: str,
  data: str,
  output: str,
  *,
  likelihood: str = "categorical",
  sigma: float = 1.0,
  kind: str = "exact",
  num_samples: int = 1,
  max_examples: int = 4096,
  batch_size: int = 256,
  inputs_key: str = "x",
  targets_key: str = "y",
  seed: int = 0,
  output_format: str | None = None,
  overwrite: bool = False,
) -> str:
  """Computes a checkpoint's diagonal Fisher on an ``.npz`` dataset.

  See the module docstring for the ``model`` contract. The Fisher is the mean
  over examples of the engine's ``fisher.diagonal`` (batches weighted by
  size) and mirrors the checkpoint's tree: leaves that get no Fisher (not a
  parameter, not floating point) are zeros.

  Args:
    model: ``"package.module:factory"``.
    params_path: the model's checkpoint.
    data: an ``.npz`` file with the inputs (and targets).
    output: destination path of the Fisher.
    likelihood: ``"categorical"``, ``"bernoulli"`` or ``"gaussian"``.
    sigma: the Gaussian likelihood's standard deviation.
    kind: ``"exact"``, ``"mc"`` or ``"empirical"`` (needs targets).
    num_samples: label samples per example for ``kind="mc"``.
    max_examples: examples drawn at random (with ``seed``) at most.
    batch_size: examples per compiled batch.
    inputs_key: the inputs' array in ``data``.
    targets_key: the targets' array in ``data``.
    seed: seed of the subsample and of ``kind="mc"``'s labels.
    output_format: ``"msgpack"``/``"orbax"``, or inferred from ``output``.
    overwrite: replace an existing output (only once the Fisher is written).

  Returns:
    The format written.
  """
  fmt = _checkpoint_io.check_destination(
    output, output_format, overwrite=overwrite
  )
  if max_examples < 1 or batch_size < 1:
    raise ValueError("--max-examples and --batch-size must be >= 1.")
  factory = _load_factory(model)
  tree = _checkpoint_io.load_tree(params_path)
  x, y = _load_examples(data, inputs_key, targets_key, kind=kind)
  if x.ndim == 0 or x.shape[0] == 0:
    raise ValueError(
      f"{data!r} holds no examples: its array {inputs_key!r} has shape "
      f"{x.shape}; the Fisher is a mean over at least one example."
    )
  idx = _subsample(x.shape[0], max_examples, seed)
  built = _build_model(factory, tree, model, params_path)
  diag = _mean_diagonal(
    built,
    x,
    y,
    idx,
    batch_size=batch_size,
    seed=seed,
    likelihood=_likelihood(likelihood, sigma),
    kind=kind,
    num_samples=num_samples,
  )
  flat_diag = built.to_flat(diag)
  if not bool(numerics.tree_all_finite(flat_diag)):
    raise ValueError(
      "The Fisher has non-finite entries (non-finite model "
      "outputs?); nothing written."
    )
  out = jax.tree_util.tree_map_with_path(
    lambda path, v: flat_diag.get(
      _strip_value(_path_str(path)), np.zeros(np.shape(v), np.float32)
    ),
    tree,
  )
  return _checkpoint_io.save_tree(output, out, fmt=fmt, overwrite=overwrite)


# -- example inputs ------------------------------------------------------------

_EXAMPLE_SIZES = (8, 16, 3)  # inputs, hidden units, classes


def example_model():
  """``(apply_fn, params)`` of the small MLP that ``example`` trains.

  The ``--model`` of the example recipe
  (``--model fisher_optax.merge:example_model``); needs no flax.
  """
  n_in, n_hidden, n_out = _EXAMPLE_SIZES

  def apply_fn(p, x):
    h = jnp.tanh(x @ p["hidden"]["kernel"] + p["hidden"]["bias"])
    return h @ p["head"]["kernel"] + p["head"]["bias"]

  zeros = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
  params = {
    "hidden": {"kernel": zeros(n_in, n_hidden), "bias": zeros(n_hidden)},
    "head": {"kernel": zeros(n_hidden, n_out), "bias": zeros(n_out)},
  }
  return apply_fn, params


def _example_task(seed: int, features: slice) -> tuple[np.ndarray, np.ndarray]:
  """Gaussian inputs; the label is the largest of three of their features."""
  x = np.random.default_rng(seed).normal(size=(512, _EXAMPLE_SIZES[0]))
  return x.astype(np.float32), np.argmax(x[:, features], 1).astype(np.int32)


def _train_example(params: PyTree, x: np.ndarray, y: np.ndarray) -> PyTree:
  """Full-batch gradient descent on the cross-entropy (a few hundred steps)."""
  apply_fn, _ = example_model()

  def loss(p):
    logp = jax.nn.log_softmax(apply_fn(p, x))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], 1))

  @jax.jit
  def train(p):
    step = lambda _, p: jax.tree.map(  # noqa: E731
      lambda a, g: a - 0.5 * g, p, jax.grad(loss)(p)
    )
    return jax.lax.fori_loop(0, 300, step, p)

  return jax.device_get(train(params))


def write_example(outdir: str) -> list[str]:
  """Writes two small trained models and their datasets for a first try.

  Both models start from one initialisation and are trained on different
  tasks (the label is the largest of inputs 0-2, or of inputs 3-5), as a
  base fine-tuned two ways. ``outdir`` is created; it must be empty or
  missing.

  Args:
    outdir: the directory to fill.

  Returns:
    The commands (``fisher-merge ...``) that compute both Fishers and merge.
  """
  out = pathlib.Path(outdir)
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise _checkpoint_io.OutputExistsError(
      f"{outdir!r} exists and is not an empty directory; choose a new one."
    )
  out.mkdir(parents=True, exist_ok=True)
  _, template = example_model()
  keys = jax.random.split(jax.random.key(0), 2)
  init = {
    "hidden": {
      "kernel": 0.5 * jax.random.normal(keys[0], (8, 16)),
      "bias": jnp.zeros(16),
    },
    "head": {
      "kernel": 0.5 * jax.random.normal(keys[1], (16, 3)),
      "bias": jnp.zeros(3),
    },
  }
  init = jax.tree.map(lambda a, t: np.asarray(a, t.dtype), init, template)
  q = lambda name: shlex.quote(str(out / name))  # noqa: E731
  commands = []
  for name, seed, features in (("a", 1, slice(0, 3)), ("b", 2, slice(3, 6))):
    x, y = _example_task(seed, features)
    with open(out / f"data_{name}.npz", "xb") as f:
      np.savez(f, x=x, y=y)
    params = _train_example(init, x, y)
    _checkpoint_io.save_tree(out / f"model_{name}.msgpack", params)
    commands.append(
      f"fisher-merge fisher --model fisher_optax.merge:example_model "
      f"--params {q(f'model_{name}.msgpack')} --data {q(f'data_{name}.npz')} "
      f"--output {q(f'fisher_{name}.msgpack')}"
    )
  commands.append(
    f"fisher-merge merge --models {q('model_a.msgpack')} "
    f"{q('model_b.msgpack')} --fishers {q('fisher_a.msgpack')} "
    f"{q('fisher_b.msgpack')} --output {q('merged.msgpack')}"
  )
  return commands


# -- entry point ---------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows each option's default, except for required options and None."""

  def _get_help_string(self, action: argparse.Action) -> str | None:
    if action.required or action.default is None:
      return action.help
    return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="fisher-merge",
    description="Fisher-weighted merging of checkpoints (Matena & Raffel, "
    "2022) and diagonal Fisher computation. New here? 'fisher-merge example "
    "DIR' writes two small models and data, and prints the commands that "
    "compute their Fishers and merge them.",
  )
  sub = parser.add_subparsers(dest="command", required=True)
  _add_merge_options(
    sub.add_parser(
      "merge",
      help="merge checkpoints given their Fishers",
      formatter_class=_HelpFormatter,
    )
  )
  _add_fisher_options(
    sub.add_parser(
      "fisher",
      help="compute a checkpoint's diagonal Fisher",
      formatter_class=_HelpFormatter,
    )
  )
  example = sub.add_parser(
    "example",
    help="write two small models and their data to try 'fisher' and 'merge'",
    formatter_class=_HelpFormatter,
  )
  example.add_argument(
    "outdir", help="directory to create (must be empty or missing)"
  )
  return parser


def _add_output_options(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--output-format",
    choices=_checkpoint_io.FORMATS,
    help="format of --output (default: 'msgpack' for '*.msgpack', else an "
    "orbax directory)",
  )
  p.add_argument(
    "--overwrite",
    action="store_true",
    help="replace an existing --output, only if this command wrote it (it "
    "has our .sha256 checksums) and only once the new one is complete",
  )


def _add_merge_options(m: argparse.ArgumentParser) -> None:
  m.add_argument(
    "--models",
    nargs="+",
    required=True,
    help="checkpoints (*.msgpack files or orbax directories)",
  )
  m.add_argument(
    "--fishers",
    nargs="+",
    required=True,
    help="one diagonal Fisher per model, same order",
  )
  m.add_argument("--output", required=True, help="output checkpoint path")
  m.add_argument(
    "--weights",
    nargs="+",
    type=float,
    default=None,
    help="one weight per model (default: equal weights)",
  )
  m.add_argument(
    "--floor",
    dest="fisher_floor",
    metavar="FLOOR",
    type=float,
    default=1e-6,
    help="lower bound applied to the Fisher entries",
  )
  m.add_argument(
    "--floor-mode",
    choices=("all", "target"),
    default="all",
    help="floor every Fisher (paper) or the target's only (released code)",
  )
  m.add_argument(
    "--normalize",
    action="store_true",
    help="divide weights by the Fishers' global L2 norms",
  )
  m.add_argument(
    "--keep-target",
    action="append",
    default=[],
    metavar="REGEX",
    help="leaves whose path a/b/c matches come from the target unmerged "
    "(repeatable)",
  )
  m.add_argument(
    "--target-index",
    type=int,
    default=0,
    help="which of --models is the target (its tree and unmerged leaves)",
  )
  _add_output_options(m)


def _add_fisher_options(f: argparse.ArgumentParser) -> None:
  f.add_argument(
    "--model",
    required=True,
    metavar="MODULE:FACTORY",
    help="factory() -> nnx.Module, apply_fn(params, inputs) or (apply_fn, "
    "params); MODULE is imported with the current directory on sys.path",
  )
  f.add_argument(
    "--params",
    dest="params_path",
    metavar="PARAMS",
    required=True,
    help="the model's checkpoint",
  )
  f.add_argument("--data", required=True, help=".npz dataset")
  f.add_argument("--output", required=True, help="output Fisher path")
  f.add_argument(
    "--likelihood",
    default="categorical",
    choices=("categorical", "bernoulli", "gaussian"),
    help="the model's predictive distribution",
  )
  f.add_argument(
    "--sigma",
    type=float,
    default=1.0,
    help="Gaussian likelihood's standard deviation",
  )
  f.add_argument(
    "--kind",
    default="exact",
    choices=("exact", "mc", "empirical"),
    help="expectation over the model's labels (exact), sampled labels (mc), "
    "or the dataset's labels (empirical)",
  )
  f.add_argument(
    "--num-samples",
    type=int,
    default=1,
    help="label samples per example for --kind mc",
  )
  f.add_argument(
    "--max-examples",
    type=int,
    default=4096,
    help="examples drawn at random (with --seed) at most",
  )
  f.add_argument(
    "--batch-size",
    type=int,
    default=256,
    help=(
      "examples per compiled batch (the result does not depend on it, but"
      " for --kind mc's sampled labels, which are drawn per batch)"
    ),
  )
  f.add_argument(
    "--inputs-key", default="x", help="the inputs' array in --data"
  )
  f.add_argument(
    "--targets-key",
    default="y",
    help="the targets' array in --data (--kind empirical only)",
  )
  f.add_argument(
    "--seed",
    type=int,
    default=0,
    help="seed of the subsample and of --kind mc's labels",
  )
  _add_output_options(f)


def _cwd_on_path() -> None:
  # ``python -m`` puts the current directory first on sys.path, a console
  # script does not; ``--model mymodels:make`` must work with both.
  cwd = os.getcwd()
  if "" not in sys.path and cwd not in sys.path:
    sys.path.insert(0, cwd)


def _run_merge(**kwargs: Any) -> str:
  return f"wrote {kwargs['output']} ({merge_checkpoints(**kwargs)})"


def _run_fisher(**kwargs: Any) -> str:
  _cwd_on_path()
  return f"wrote {kwargs['output']} ({compute_fisher(**kwargs)})"


def _run_example(outdir: str) -> str:
  commands = write_example(outdir)
  return (
    f"wrote two models and their data to {outdir}; now run\n  "
    + "\n  ".join(commands)
  )


_COMMANDS: dict[str, Callable[..., str]] = {
  "merge": _run_merge,
  "fisher": _run_fisher,
  "example": _run_example,
}


def run(argv: Sequence[str] | None = None) -> int:
  """Console entry point (``fisher-merge``); returns the exit status."""
  # Every option's dest is the keyword of the function that runs it.
  kwargs = vars(_parser().parse_args(argv))
  command = _COMMANDS[kwargs.pop("command")]
  try:
    message = command(**kwargs)
  except _checkpoint_io.OutputExistsError as e:
    print(f"fisher-merge: error: {e.message('--overwrite')}", file=sys.stderr)
    return 1
  except (ValueError, TypeError, OSError, ImportError) as e:
    print(f"fisher-merge: error: {e}", file=sys.stderr)
    return 1
  print(message)
  return 0


if __name__ == "__main__":
  sys.exit(run())
