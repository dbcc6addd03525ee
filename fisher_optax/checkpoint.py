# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Save and restore optimizer states (and any pytree of arrays) with orbax.

Needs orbax-checkpoint (``pip install 'fisher_optax[flax]'``). Two
details make a plain ``orbax.checkpoint.StandardCheckpointer`` round trip
fail or silently change types, and these helpers take care of both:

* restore against an **abstract target** (``jax.eval_shape(tx.init,
  params)``), otherwise NamedTuple states come back as lists and dicts;
* orbax refuses **zero-size arrays**, which some states hold as placeholders
  (e.g. a Natural GaLore projector for a 1-D leaf, as in optax's GaLore):
  they are dropped on save and refilled from the target on restore.

Writes are atomic: the checkpoint goes to a temporary sibling directory that
is renamed into place only once complete, so an interrupted save never
leaves a partial checkpoint behind (and the next save removes what a killed
one left). Every checkpoint holds a SHA-256 manifest of its files,
``fisher_optax.sha256`` (``sha256sum -c`` reads it), which :func:`restore`
verifies: a damaged or changed file raises an error instead of restoring
silently wrong values. The manifest also marks the directory as written by
:func:`save`: ``overwrite=True`` replaces only such a checkpoint and refuses
any other directory or file, leaving it untouched.

Example:

  >>> import pathlib, tempfile
  >>> import jax, jax.numpy as jnp, fisher_optax
  >>> from fisher_optax import checkpoint
  >>> params = {"w": jnp.ones(3)}
  >>> tx = fisher_optax.fadam(1e-3)
  >>> tree = {"params": params, "opt_state": tx.init(params)}
  >>> tmp = tempfile.TemporaryDirectory()  # removed when collected
  >>> path = pathlib.Path(tmp.name) / "ckpt"
  >>> checkpoint.save(path, tree)
  >>> # Later, in a fresh process: rebuild tx, restore against its shapes.
  >>> target = {"params": jax.eval_shape(lambda: params),
  ...           "opt_state": jax.eval_shape(tx.init, params)}
  >>> restored = checkpoint.restore(path, target)
  >>> jax.tree.structure(restored) == jax.tree.structure(tree)
  True

Training continued from ``restored`` follows the uninterrupted trajectory
exactly (``tests/checkpoint_test.py`` checks this for every transform).
"""

from __future__ import annotations

import math
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fisher_optax import _checkpoint_io

PyTree = Any

__all__ = ["restore", "save"]


def _empty(x: Any) -> bool:
  return math.prod(np.shape(x)) == 0  # Python scalars and abstract leaves too


def _drop_empty(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda x: None if _empty(x) else x, tree)


def _key_name(key: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _path_name(path: tuple) -> str:
  return "/".join(_key_name(k) for k in path)


def _saved_dtype(m: Any) -> Any:
  """The saved dtype as JAX holds it (float64 is float32 without x64)."""
  dtype = getattr(m, "dtype", None)
  return None if dtype is None else jax.dtypes.canonicalize_dtype(dtype)


def _checked_abstract(
  metadata: PyTree, target: PyTree, abstract: PyTree
) -> PyTree:
  """``abstract``, refused where its shapes or dtypes differ from the
  checkpoint's, with Python-number leaves given the saved dtype.

  Orbax casts to the target's dtype without a word, and a zero-size target
  leaf (a placeholder, never read) would throw the saved array away. A
  Python number in the target (a ``TrainState``'s ``step``) stands for a
  saved scalar of any dtype: it is restored in that dtype (an ``int`` target
  does not truncate a saved 2.7). A PRNG key is saved as its key data,
  checked against the target key's.
  """
  saved = {
    _path_name(p): m
    for p, m in jax.tree_util.tree_flatten_with_path(metadata)[0]
  }
  out = []
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  for (p, x), raw in zip(flat, jax.tree.leaves(target)):
    name = _path_name(p)
    m = saved.get(name)
    number = isinstance(raw, (bool, int, float, complex))
    key = jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    if m is None:
      if not _empty(x) or number:
        raise ValueError(
          f"The checkpoint has no array at {name!r} (the target's is "
          f"{x.dtype}{list(x.shape)}): it was saved as a zero-size "
          "placeholder, or the target's structure differs."
        )
      out.append(x)
      continue
    shape = tuple(getattr(m, "shape", ()) or ())
    dtype = _saved_dtype(m)
    if number and shape == () and dtype is not None:
      out.append(jax.ShapeDtypeStruct((), dtype, sharding=x.sharding))
      continue
    # A key's data: (*shape, words of its implementation), uint32.
    want = jax.eval_shape(jax.random.key_data, x) if key else x
    if shape != tuple(want.shape) or (
      dtype is not None and dtype != jnp.dtype(want.dtype)
    ):
      what = "key data " if key else ""
      raise ValueError(
        f"The checkpoint's array at {name!r} is {dtype}{list(shape)}, the "
        f"target's {what}{want.dtype}{list(want.shape)}: restore into the "
        "saved shapes and dtypes (cast afterwards if a change is meant)."
      )
    out.append(x)
  return jax.tree.unflatten(treedef, out)


def save(
  path: str | os.PathLike[str], tree: PyTree, *, overwrite: bool = False
) -> None:
  """Writes ``tree`` as an orbax checkpoint directory at ``path``, atomically.

  Args:
    path: the checkpoint directory (made absolute for orbax).
    tree: a pytree of arrays: params, optimizer states, or a dict of both.
    overwrite: replace an existing checkpoint written by :func:`save`
      (only once the new one is complete); anything else at ``path`` is
      refused.

  Raises:
    FileExistsError: ``path`` exists and ``overwrite`` is False, or it is
      not a checkpoint written by :func:`save`.
  """
  path = pathlib.Path(path).absolute()
  _checkpoint_io.check_destination(
    path, _checkpoint_io.ORBAX, overwrite=overwrite
  )
  # The tree keeps its containers (restore rebuilds them from the target).
  _checkpoint_io.write_atomically(
    path, _drop_empty(tree), fmt=_checkpoint_io.ORBAX, overwrite=overwrite
  )


def restore(path: str | os.PathLike[str], target: PyTree) -> PyTree:
  """Reads a checkpoint written by :func:`save` into the structure of ``target``.

  Args:
    path: the checkpoint directory.
    target: a tree with the checkpoint's structure, shapes and dtypes:
      abstract (``jax.eval_shape``) or concrete. Its container types
      (NamedTuples, ``nnx.State``) are what comes back, placed with its
      leaves' shardings where they have one (another mesh than the one
      saved from works).

  Returns:
    The restored tree.

  Raises:
    FileNotFoundError: no checkpoint directory at ``path``.
    ValueError: (``ChecksumError``) a file of the checkpoint differs from
      its SHA-256 manifest; or a target leaf's shape or dtype differs from
      the saved array's.
  """
  ocp = _checkpoint_io.import_orbax()
  path = pathlib.Path(path).absolute()
  if not path.is_dir():
    raise FileNotFoundError(f"No checkpoint directory at {str(path)!r}.")
  _checkpoint_io.verify_checksums(path)
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      jnp.shape(x),
      jnp.result_type(x),
      # Where the target says: a restore onto another mesh or topology.
      sharding=getattr(x, "sharding", None),
    ),
    target,
  )
  with ocp.StandardCheckpointer() as ckptr:
    abstract = _checked_abstract(
      ckptr.metadata(path).item_metadata.tree, target, abstract
    )
    restored = ckptr.restore(path, _drop_empty(abstract))
  return jax.tree.map(_as_target, abstract, restored)


def _as_target(s: jax.ShapeDtypeStruct, r: Any) -> Any:
  """A restored leaf as its target asks: a zero-size placeholder refilled,
  key data as a key of the target's implementation (and a key as its data
  for a ``uint32`` target)."""
  if _empty(s):
    return jnp.zeros(s.shape, s.dtype, device=s.sharding)
  key = jnp.issubdtype(s.dtype, jax.dtypes.prng_key)
  if key == jnp.issubdtype(r.dtype, jax.dtypes.prng_key):
    if key and jax.random.key_impl(r) != _key_impl(s):
      raise ValueError(
        f"The checkpoint holds a {r.dtype} key where the target has a "
        f"{s.dtype} one."
      )
    return r
  if key:
    return jax.random.wrap_key_data(r, impl=_key_impl(s))
  return jax.random.key_data(r)


def _key_impl(s: jax.ShapeDtypeStruct) -> Any:
  return jax.random.key_impl(jnp.zeros((), s.dtype))
