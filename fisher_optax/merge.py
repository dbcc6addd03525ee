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
from collections.abc import Sequence
import functools
import importlib
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fisher_optax import _checkpoint_io
from fisher_optax import _merging

PyTree = Any


class MergeInputError(ValueError):
  """Inputs to the merge are inconsistent (the message names the leaf)."""


# -- tree helpers --------------------------------------------------------------


def _path_str(path: tuple[Any, ...]) -> str:
  parts = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def _flat(tree: PyTree) -> dict[str, Any]:
  return {
    _path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def _is_float(x: Any) -> bool:
  return np.issubdtype(np.asarray(x).dtype, np.floating) or (
    jnp.issubdtype(np.asarray(x).dtype, jnp.floating)
  )


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
    x = model[k]
    if np.asarray(x).dtype != np.asarray(r).dtype:
      raise MergeInputError(
        f"{name} leaf {k!r} has dtype {np.asarray(x).dtype} but "
        f"{ref_name}'s has dtype {np.asarray(r).dtype}."
      )
    if _is_float(x) and not np.all(np.isfinite(np.asarray(x, np.float32))):
      raise MergeInputError(f"{name} leaf {k!r} has non-finite values.")


def validate_fisher(
  ref: dict[str, Any], fisher: dict[str, Any], *, ref_name: str, name: str
) -> None:
  """Same leaves and shapes as the model; floating, finite, non-negative."""
  _check_leaves(ref, fisher, ref_name=ref_name, name=name)
  for k, r in ref.items():
    f = fisher[k]
    if not _is_float(r):
      continue  # Not merged; its Fisher is ignored.
    if not _is_float(f):
      raise MergeInputError(
        f"{name} leaf {k!r} has dtype {np.asarray(f).dtype}; a Fisher must "
        "be floating point."
      )
    f32 = np.asarray(f, np.float32)
    if not np.all(np.isfinite(f32)):
      raise MergeInputError(f"{name} leaf {k!r} has non-finite values.")
    if np.any(f32 < 0):
      raise MergeInputError(
        f"{name} leaf {k!r} has {int(np.sum(f32 < 0))} negative entries; "
        "a diagonal Fisher is non-negative."
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
  """
  if len(models) < 1:
    raise MergeInputError("Give at least one model.")
  if len(fishers) != len(models):
    raise MergeInputError(
      f"Got {len(models)} models but {len(fishers)} Fishers; give one "
      "Fisher per model, in the same order."
    )
  if weights is None:
    weights = [1.0] * len(models)
  if len(weights) != len(models):
    raise MergeInputError(
      f"Got {len(weights)} weights for {len(models)} models."
    )
  w = np.asarray(weights, np.float64)
  if not np.all(np.isfinite(w)) or np.any(w < 0) or not np.any(w > 0):
    raise MergeInputError(
      f"Weights must be finite, >= 0 and not all zero, got {list(weights)}."
    )
  if not 0 <= target_index < len(models):
    raise MergeInputError(
      f"--target-index must lie in [0, {len(models)}), got {target_index}."
    )
  if fisher_floor < 0 or not np.isfinite(fisher_floor):
    raise MergeInputError(
      f"--floor must be finite and >= 0, got {fisher_floor}."
    )
  # Fail on a bad destination before any work.
  fmt = _checkpoint_io.check_destination(
    output, output_format, overwrite=overwrite
  )
  for p in list(models) + list(fishers):
    _checkpoint_io.detect_format(p)

  order = [target_index] + [i for i in range(len(models)) if i != target_index]
  target = _checkpoint_io.load_tree(models[target_index])
  flat_target = _flat(target)
  ref_name = models[target_index]
  mask = _build_mask(flat_target, keep_target, target)
  acc = _merging.fisher_merge_accumulator(
    fisher_floor, floor_mode=floor_mode, normalize=normalize, merge_mask=mask
  )
  # Donating the state lets XLA update the two running buffers in place.
  init, add = jax.jit(acc.init), jax.jit(acc.add, donate_argnums=0)
  state = None
  for i in order:
    params = (
      target if i == target_index else _checkpoint_io.load_tree(models[i])
    )
    validate_model(
      flat_target, _flat(params), ref_name=ref_name, name=models[i]
    )
    if jax.tree.structure(params) != jax.tree.structure(target):
      raise MergeInputError(
        f"{models[i]} has the leaves of {ref_name} but a different "
        "container structure."
      )
    fisher = _checkpoint_io.load_tree(fishers[i])
    validate_fisher(
      flat_target, _flat(fisher), ref_name=models[i], name=fishers[i]
    )
    # Fishers mirror the model's containers (e.g. lists vs dicts).
    fisher = jax.tree.unflatten(
      jax.tree.structure(params), [_flat(fisher)[k] for k in _flat(params)]
    )
    weight = jnp.float32(w[i])
    if state is None:
      state = init(params, fisher, weight)
    else:
      state = add(state, params, fisher, weight)
    del params, fisher
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


def _likelihood(name: str, sigma: float):
  from fisher_optax import fisher  # pylint: disable=g-import-not-at-top

  if name == "categorical":
    return fisher.Categorical()
  if name == "bernoulli":
    return fisher.Bernoulli()
  if name == "gaussian":
    return fisher.Gaussian(sigma)
  raise ValueError(f"Unknown likelihood {name!r}.")


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
  size) and mirrors the checkpoint's tree.

  Returns:
    The format written.
  """
  from fisher_optax import fisher  # pylint: disable=g-import-not-at-top

  fmt = _checkpoint_io.check_destination(
    output, output_format, overwrite=overwrite
  )
  if max_examples < 1 or batch_size < 1:
    raise ValueError("--max-examples and --batch-size must be >= 1.")
  factory = _load_factory(model)
  tree = _checkpoint_io.load_tree(params_path)
  try:
    arrays = np.load(data, allow_pickle=False)
  except ValueError as e:
    raise ValueError(f"Cannot read {data!r} without unpickling: {e}") from e
  if inputs_key not in arrays:
    raise ValueError(
      f"{data!r} has no array {inputs_key!r}; it has {list(arrays.keys())}."
    )
  x = arrays[inputs_key]
  y = arrays[targets_key] if targets_key in arrays else None
  if kind == "empirical" and y is None:
    raise ValueError(
      f"--kind empirical needs targets {targets_key!r} in {data!r}."
    )
  n = x.shape[0]
  idx = np.arange(n)
  if n > max_examples:
    idx = np.sort(
      np.random.default_rng(seed).choice(n, max_examples, replace=False)
    )

  flat_tree = _flat(tree)
  built = factory()
  from flax import nnx  # pylint: disable=g-import-not-at-top

  if isinstance(built, nnx.Module):
    if hasattr(built, "eval"):
      built.eval()
    graphdef, param_state, rest = nnx.split(built, nnx.Param, ...)
    by_key = {_strip_value(k): v for k, v in flat_tree.items()}
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
    params = param_state

    def apply_fn(p, inputs):
      return nnx.merge(graphdef, p, rest)(inputs)

    def to_flat(diag):
      return _flat(nnx.to_pure_dict(diag))
  else:
    if (
      isinstance(built, tuple) and len(built) == 2 and callable(built[0])
    ):  # (apply_fn, params template)
      template = _flat(built[1])
      _check_leaves(
        template, flat_tree, ref_name=f"{model}'s params", name=params_path
      )
      for k, ref in template.items():
        if np.shape(flat_tree[k]) != np.shape(ref):
          raise MergeInputError(
            f"{params_path} leaf {k!r} has shape {np.shape(flat_tree[k])} "
            f"but the model's has shape {np.shape(ref)}."
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

    def to_flat(diag):
      return dict(zip(keys, diag))

  like = _likelihood(likelihood, sigma)

  @jax.jit
  def batch_diag(p, xb, yb, key):
    stat = fisher.diagonal(
      apply_fn,
      p,
      (xb, yb),
      likelihood=like,
      kind=kind,
      num_samples=num_samples,
      key=key,
    )
    return stat.diag

  total = None
  key = jax.random.key(seed)
  for start in range(0, len(idx), batch_size):
    sel = idx[start : start + batch_size]
    key, sub = jax.random.split(key)
    d = batch_diag(
      params,
      jnp.asarray(x[sel]),
      None if y is None else jnp.asarray(y[sel]),
      sub,
    )
    d = jax.tree.map(functools.partial(jnp.multiply, len(sel)), d)
    total = d if total is None else jax.tree.map(jnp.add, total, d)
  diag = jax.tree.map(lambda v: np.asarray(v / len(idx), np.float32), total)
  flat_diag = to_flat(diag)
  if not all(np.all(np.isfinite(v)) for v in flat_diag.values()):
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


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for k, v in flat.items():
    node = out
    parts = k.split("/")
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[parts[-1]] = v
  return out


# -- entry point ---------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="fisher-merge",
    description="Fisher-weighted merging of checkpoints (Matena & Raffel, "
    "2022) and diagonal Fisher computation.",
  )
  sub = parser.add_subparsers(dest="command", required=True)

  m = sub.add_parser("merge", help="merge checkpoints given their Fishers")
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
    "--floor", type=float, default=1e-6, help="Fisher floor (default 1e-6)"
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

  f = sub.add_parser("fisher", help="compute a checkpoint's diagonal Fisher")
  f.add_argument(
    "--model",
    required=True,
    metavar="MODULE:FACTORY",
    help="factory() -> nnx.Module or apply_fn(params, inputs)",
  )
  f.add_argument("--params", required=True, help="the model's checkpoint")
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
  return parser


def run(argv: Sequence[str] | None = None) -> int:
  """Console entry point (``fisher-merge``); returns the exit status."""
  args = _parser().parse_args(argv)
  try:
    if args.command == "merge":
      fmt = merge_checkpoints(
        args.models,
        args.fishers,
        args.output,
        weights=args.weights,
        fisher_floor=args.floor,
        floor_mode=args.floor_mode,
        normalize=args.normalize,
        keep_target=args.keep_target,
        target_index=args.target_index,
        output_format=args.output_format,
        overwrite=args.overwrite,
      )
    else:
      fmt = compute_fisher(
        args.model,
        args.params,
        args.data,
        args.output,
        likelihood=args.likelihood,
        sigma=args.sigma,
        kind=args.kind,
        num_samples=args.num_samples,
        max_examples=args.max_examples,
        batch_size=args.batch_size,
        inputs_key=args.inputs_key,
        targets_key=args.targets_key,
        seed=args.seed,
        output_format=args.output_format,
        overwrite=args.overwrite,
      )
  except (ValueError, TypeError, OSError, ImportError) as e:
    print(f"fisher-merge: error: {e}", file=sys.stderr)
    return 1
  print(f"wrote {args.output} ({fmt})")
  return 0


if __name__ == "__main__":
  sys.exit(run())
