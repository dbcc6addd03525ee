# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Reading and writing parameter trees: orbax checkpoints and flax msgpack.

Only two formats are accepted, and neither can execute code on load: flax
msgpack files (``*.msgpack``; arrays are raw bytes plus a dtype name) and
orbax checkpoint directories (tensorstore arrays plus JSON metadata).
Anything else, pickles included, is refused with a message saying what is
supported. Writes are atomic: the tree goes to a temporary sibling path that
is renamed over the destination only once it is complete.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from typing import Any
import uuid

import jax
import numpy as np

PyTree = Any

MSGPACK = "msgpack"
ORBAX = "orbax"
FORMATS = (MSGPACK, ORBAX)

_MSGPACK_SUFFIXES = (".msgpack",)
# Files present in an orbax checkpoint directory (any of them suffices).
_ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt")
_PICKLE_SUFFIXES = (
  ".pkl",
  ".pickle",
  ".pt",
  ".pth",
  ".bin",
  ".ckpt",
  ".npy",
  ".joblib",
)


class CheckpointFormatError(ValueError):
  """A path is not a checkpoint in a supported format."""


def _supported() -> str:
  return (
    "supported formats: a flax msgpack file ('*.msgpack') or an orbax "
    "checkpoint directory"
  )


def detect_format(path: str | os.PathLike[str]) -> str:
  """Returns ``"msgpack"`` or ``"orbax"`` for an existing checkpoint path.

  Args:
    path: a ``*.msgpack`` file or an orbax checkpoint directory.

  Returns:
    The format name.

  Raises:
    FileNotFoundError: nothing exists at ``path``.
    CheckpointFormatError: ``path`` exists but is in no supported format.
  """
  p = pathlib.Path(path)
  if not p.exists():
    raise FileNotFoundError(f"No checkpoint at {str(p)!r}.")
  if p.is_dir():
    if any((p / m).exists() for m in _ORBAX_MARKERS):
      return ORBAX
    raise CheckpointFormatError(
      f"{str(p)!r} is a directory but not an orbax checkpoint (none of "
      f"{', '.join(_ORBAX_MARKERS)} inside); {_supported()}."
    )
  if p.suffix.lower() in _MSGPACK_SUFFIXES:
    return MSGPACK
  if p.suffix.lower() in _PICKLE_SUFFIXES:
    raise CheckpointFormatError(
      f"Refusing {str(p)!r}: {p.suffix!r} files may be pickles, which can "
      f"run arbitrary code when loaded and are never read; {_supported()}."
    )
  raise CheckpointFormatError(
    f"Unknown checkpoint format for {str(p)!r}; {_supported()}."
  )


def output_format(path: str | os.PathLike[str], fmt: str | None = None) -> str:
  """The format a tree will be written in: ``fmt``, or inferred from ``path``.

  ``*.msgpack`` means msgpack; a path without a suffix means an orbax
  directory; any other suffix is refused.
  """
  if fmt is not None:
    if fmt not in FORMATS:
      raise CheckpointFormatError(
        f"Unknown output format {fmt!r}; {_supported()}."
      )
    return fmt
  p = pathlib.Path(path)
  if p.suffix.lower() in _MSGPACK_SUFFIXES:
    return MSGPACK
  if not p.suffix or p.is_dir():
    return ORBAX
  raise CheckpointFormatError(
    f"Cannot infer the output format of {str(p)!r} from its suffix; name "
    f"it '*.msgpack' or give a path without a suffix for an orbax "
    f"directory ({_supported()})."
  )


def _to_numpy(tree: PyTree) -> PyTree:
  return jax.tree.map(np.asarray, tree)


def load_tree(path: str | os.PathLike[str]) -> PyTree:
  """Loads a parameter tree (nested dicts of numpy arrays) from a checkpoint.

  Args:
    path: a flax msgpack file or an orbax checkpoint directory.

  Returns:
    The tree, with numpy leaves. Orbax checkpoints are restored without a
    target, so containers come back as dicts (and lists).

  Raises:
    FileNotFoundError, CheckpointFormatError: see :func:`detect_format`;
    also for a msgpack file that does not parse.
  """
  fmt = detect_format(path)
  if fmt == MSGPACK:
    from flax import serialization  # pylint: disable=g-import-not-at-top

    data = pathlib.Path(path).read_bytes()
    try:
      tree = serialization.msgpack_restore(data)
    except Exception as e:  # msgpack raises several unrelated types.
      raise CheckpointFormatError(
        f"{str(path)!r} is not a valid flax msgpack file: {e}"
      ) from e
    if not isinstance(tree, dict):
      raise CheckpointFormatError(
        f"{str(path)!r} holds a {type(tree).__name__}, not a tree of arrays."
      )
    return _to_numpy(tree)
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  with ocp.StandardCheckpointer() as ckptr:
    tree = ckptr.restore(os.path.abspath(path))
  return _to_numpy(tree)


def _to_plain(tree: PyTree) -> PyTree:
  """Nested dicts of numpy arrays (NNX state and NamedTuples included)."""
  from flax import serialization  # pylint: disable=g-import-not-at-top

  if hasattr(tree, "to_pure_dict"):  # nnx.State
    tree = tree.to_pure_dict()
  return _to_numpy(serialization.to_state_dict(tree))


def _check_destination(path: pathlib.Path, fmt: str, overwrite: bool) -> None:
  if not path.exists():
    if not path.parent.is_dir():
      raise FileNotFoundError(
        f"The output directory {str(path.parent)!r} does not exist."
      )
    return
  if not overwrite:
    raise FileExistsError(
      f"{str(path)!r} exists; pass overwrite=True (--overwrite) to replace it."
    )
  if fmt == MSGPACK and path.is_dir():
    raise FileExistsError(
      f"{str(path)!r} is a directory; refusing to replace it with a file."
    )
  if fmt == ORBAX and not path.is_dir():
    raise FileExistsError(
      f"{str(path)!r} is a file; refusing to replace it with an orbax "
      "directory."
    )


def check_destination(
  path: str | os.PathLike[str],
  fmt: str | None = None,
  *,
  overwrite: bool = False,
) -> str:
  """Checks that ``path`` can be written (before doing any expensive work).

  Returns:
    The output format.
  """
  fmt = output_format(path, fmt)
  _check_destination(pathlib.Path(path), fmt, overwrite)
  return fmt


def commit(tmp: pathlib.Path, path: pathlib.Path) -> None:
  """Moves a finished temporary output into place (the only visible step)."""
  if tmp.is_dir() and path.exists():
    # Directories cannot be swapped in one call: move the old one aside,
    # rename, then delete it (restoring it if the rename fails).
    old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(path, old)
    try:
      os.rename(tmp, path)
    except BaseException:
      os.rename(old, path)
      raise
    shutil.rmtree(old, ignore_errors=True)
  else:
    os.replace(tmp, path)  # atomic for files, also over an existing one


def write_atomically(path: pathlib.Path, tree: PyTree, *, fmt: str) -> None:
  """Writes ``tree`` as it is to a temporary sibling, then renames it over ``path``.

  The one writer of both formats: nothing is visible at ``path`` until the
  write is complete, and a failed write leaves no temporary file behind.
  Check the destination first (:func:`check_destination`).

  Args:
    path: the destination (``*.msgpack`` file or orbax directory).
    tree: for msgpack, nested dicts of arrays; for orbax, any pytree orbax
      saves (NamedTuples and ``nnx.State`` included).
    fmt: ``"msgpack"`` or ``"orbax"``.
  """
  tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
  try:
    if fmt == MSGPACK:
      from flax import serialization  # pylint: disable=g-import-not-at-top

      data = serialization.msgpack_serialize(tree)
      fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
      tmp = pathlib.Path(name)
      with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    else:
      import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

      with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(tmp), tree)
        ckptr.wait_until_finished()
    commit(tmp, path)
  finally:
    if tmp.is_dir():
      shutil.rmtree(tmp, ignore_errors=True)
    elif tmp.exists():
      tmp.unlink()


def save_tree(
  path: str | os.PathLike[str],
  tree: PyTree,
  *,
  fmt: str | None = None,
  overwrite: bool = False,
) -> str:
  """Writes a tree atomically as flax msgpack or an orbax checkpoint.

  The tree is written to a temporary sibling of ``path`` and renamed into
  place only when complete, so an interrupted write never leaves a partial
  output and an existing ``path`` is replaced only on success. Containers
  are written as nested dicts (NamedTuples by field name, ``nnx.State`` as
  its pure dict), leaves as numpy arrays.

  Args:
    path: the destination (``*.msgpack`` file or orbax directory).
    tree: a pytree of arrays (dicts, lists, NamedTuples, ``nnx.State``).
    fmt: ``"msgpack"`` or ``"orbax"``; inferred from ``path`` if ``None``.
    overwrite: replace an existing ``path``.

  Returns:
    The format written.

  Example:
    >>> import pathlib, tempfile
    >>> import numpy as np
    >>> from fisher_optax import _checkpoint_io
    >>> tmp = tempfile.TemporaryDirectory()  # removed when collected
    >>> path = pathlib.Path(tmp.name) / "params.msgpack"
    >>> _checkpoint_io.save_tree(path, {"w": np.arange(3.0)})
    'msgpack'
    >>> _checkpoint_io.load_tree(path)
    {'w': array([0., 1., 2.])}
  """
  path = pathlib.Path(path)
  fmt = check_destination(path, fmt, overwrite=overwrite)
  write_atomically(path, _to_plain(tree), fmt=fmt)
  return fmt
