# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
r"""Command line: Fisher-merge checkpoints, and compute a model's Fisher.

Two subcommands (also installed as the ``fisher-merge`` console script)::

  # Merge K checkpoints given their diagonal Fishers.
  python -m fisher_optax.merge merge \
      --models base.msgpack finetuned.msgpack \
      --fishers base_fisher.msgpack finetuned_fisher.msgpack \
      --weights 0.6 0.4 --output merged.msgpack

  # Compute a model's diagonal Fisher on a dataset, through the engine.
  python -m fisher_optax.merge fisher \
      --model my_project.models:make_model --params base.msgpack \
      --data train.npz --output base_fisher.msgpack

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
model parameters must be finite. The first problem found is reported with the
file and the leaf, and nothing is written. ``--keep-target REGEX`` (repeatable)
copies the leaves whose path (``a/b/c``) matches from the target unmerged
(heads); non-floating leaves always come from the target. The output is
written atomically (temporary sibling, then rename), and an existing output
is replaced only with ``--overwrite`` and only once the merge succeeded.

**fisher** imports ``--model module:factory`` and calls ``factory()`` with
no arguments. It must return either

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
import importlib
import re
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
  return jnp.issubdtype(np.asarray(x).dtype, jnp.floating)


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


def validate_model(
  ref: dict[str, Any], model: dict[str, Any], *, ref_name: str, name: str
) -> None:
  """Same leaves, shapes and dtypes as the reference; finite floats."""
  _check_leaves(ref, model, ref_name=ref_name, name=name)
  for k, r in ref.items():
    x, r = np.asarray(model[k]), np.asarray(r)
    if x.dtype != r.dtype:
      raise MergeInputError(
        f"{name} leaf {k!r} has dtype {x.dtype} but {ref_name}'s has dtype "
        f"{r.dtype}."
      )
    if _is_float(x) and not np.all(np.isfinite(x.astype(np.float32))):
      raise MergeInputError(f"{name} leaf {k!r} has non-finite values.")


def validate_fisher(
  ref: dict[str, Any], fisher: dict[str, Any], *, ref_name: str, name: str
) -> None:
  """Same leaves and shapes as the model; floating, finite, non-negative."""
  _check_leaves(ref, fisher, ref_name=ref_name, name=name)
  for k, r in ref.items():
    if _is_float(r):  # Other leaves are not merged; their Fisher is ignored.
      _merging.check_fisher_leaf(
        fisher[k], name=f"{name} leaf {k!r}", error=MergeInputError
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
  # Fishers mirror the model's containers (e.g. lists vs dicts).
  return params, jax.tree.unflatten(
    jax.tree.structure(params), [fisher_tree[k] for k in _flat(params)]
  )


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
    MergeInputError: inconsistent inputs (the message names file and leaf).

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
  acc = _merging.fisher_merge_accumulator(
    fisher_floor,
    floor_mode=floor_mode,
    normalize=normalize,
    merge_mask=_build_mask(_flat(target), keep_target, target),
  )
  # Donating the state lets XLA update the two running buffers in place.
  init, add = jax.jit(acc.init), jax.jit(acc.add, donate_argnums=0)
  state = init(
    *_load_pair(target, ref_name, fishers[target_index], target, ref_name),
    jnp.float32(w[target_index]),
  )
  for i in range(len(models)):
    if i != target_index:
      params = _checkpoint_io.load_tree(models[i])
      pair = _load_pair(params, models[i], fishers[i], target, ref_name)
      state = add(state, *pair, jnp.float32(w[i]))
      del params, pair  # one model and its Fisher in memory at a time
  merged = jax.device_get(acc.finalize(state))
  return _checkpoint_io.save_tree(output, merged, fmt=fmt, overwrite=overwrite)


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
  """``(inputs, targets or None)`` from an ``.npz`` file, never unpickling."""
  try:
    arrays = np.load(data, allow_pickle=False)
  except ValueError as e:
    raise ValueError(f"Cannot read {data!r} without unpickling: {e}") from e
  if inputs_key not in arrays:
    raise ValueError(
      f"{data!r} has no array {inputs_key!r}; it has {list(arrays.keys())}."
    )
  y = arrays[targets_key] if targets_key in arrays else None
  if kind == "empirical" and y is None:
    raise ValueError(
      f"--kind empirical needs targets {targets_key!r} in {data!r}."
    )
  return arrays[inputs_key], y


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
  from flax import nnx  # pylint: disable=g-import-not-at-top

  if isinstance(built, nnx.Module):
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
  examples whatever the batch size; ``estimator`` are ``fisher.diagonal``'s
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


# -- entry point ---------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="fisher-merge",
    description="Fisher-weighted merging of checkpoints (Matena & Raffel, "
    "2022) and diagonal Fisher computation.",
  )
  sub = parser.add_subparsers(dest="command", required=True)
  _add_merge_options(
    sub.add_parser("merge", help="merge checkpoints given their Fishers")
  )
  _add_fisher_options(
    sub.add_parser("fisher", help="compute a checkpoint's diagonal Fisher")
  )
  return parser


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
    help="one weight per model (default equal)",
  )
  m.add_argument(
    "--floor",
    dest="fisher_floor",
    metavar="FLOOR",
    type=float,
    default=1e-6,
    help="Fisher floor (default 1e-6)",
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
    help="leaves whose path a/b/c matches come from the target",
  )
  m.add_argument("--target-index", type=int, default=0)
  m.add_argument("--output-format", choices=_checkpoint_io.FORMATS)
  m.add_argument(
    "--overwrite",
    action="store_true",
    help="replace an existing output (only on success)",
  )


def _add_fisher_options(f: argparse.ArgumentParser) -> None:
  f.add_argument(
    "--model",
    required=True,
    metavar="MODULE:FACTORY",
    help="factory() -> nnx.Module or apply_fn(params, inputs)",
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
  )
  f.add_argument(
    "--sigma",
    type=float,
    default=1.0,
    help="Gaussian likelihood's standard deviation",
  )
  f.add_argument(
    "--kind", default="exact", choices=("exact", "mc", "empirical")
  )
  f.add_argument(
    "--num-samples",
    type=int,
    default=1,
    help="label samples per example for --kind mc",
  )
  f.add_argument("--max-examples", type=int, default=4096)
  f.add_argument("--batch-size", type=int, default=256)
  f.add_argument("--inputs-key", default="x")
  f.add_argument("--targets-key", default="y")
  f.add_argument("--seed", type=int, default=0)
  f.add_argument("--output-format", choices=_checkpoint_io.FORMATS)
  f.add_argument("--overwrite", action="store_true")


def run(argv: Sequence[str] | None = None) -> int:
  """Console entry point (``fisher-merge``); returns the exit status."""
  # Every option's dest is the keyword of the function that runs it.
  kwargs = vars(_parser().parse_args(argv))
  command = _COMMANDS[kwargs.pop("command")]
  try:
    fmt = command(**kwargs)
  except (ValueError, TypeError, OSError, ImportError) as e:
    print(f"fisher-merge: error: {e}", file=sys.stderr)
    return 1
  print(f"wrote {kwargs['output']} ({fmt})")
  return 0


_COMMANDS = {"merge": merge_checkpoints, "fisher": compute_fisher}


if __name__ == "__main__":
  sys.exit(run())
