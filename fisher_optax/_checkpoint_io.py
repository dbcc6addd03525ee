# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Reading and writing parameter trees: orbax checkpoints and flax msgpack.

Only two formats are accepted, and neither can execute code on load: flax
msgpack files (``*.msgpack``; arrays are raw bytes plus a dtype name) and
orbax checkpoint directories (tensorstore arrays plus JSON metadata).
Anything else, pickles included, is refused with a message saying what is
supported.

**Checksums, and what is ours.** Every output carries SHA-256 checksums in
``sha256sum`` format: a msgpack file ``NAME.msgpack`` gets the sidecar
``NAME.msgpack.sha256`` next to it, an orbax directory the manifest
``fisher_optax.sha256`` inside it (one line per file of the checkpoint).
Reads verify them when present and raise :class:`ChecksumError` on any
difference (a flipped byte, a missing file); files without checksums (e.g.
written by flax or orbax directly) are read unverified. The checksums are
also the mark of an output we wrote: ``overwrite`` replaces only such an
output and refuses anything else (a directory of a user's files, a file
another program wrote), leaving it untouched.

**Atomic, exclusive writes.** The tree goes to a temporary sibling
``.NAME.tmp-<pid>-<random>`` that becomes ``NAME`` only once complete and
checksummed. A new output is put in place with an operation that fails if
something appeared at ``NAME`` meanwhile: ``os.link`` for files, Linux
``renameat2(RENAME_NOREPLACE)`` for directories (elsewhere ``os.rename``,
which cannot replace a file or a non-empty directory). An existing output
(``overwrite``) is replaced with ``os.replace`` (files) or swapped with
``renameat2(RENAME_EXCHANGE)`` (directories; elsewhere moved aside and
restored if the rename fails), so an interrupted write keeps the old
output. Temporaries left by a killed writer (its process id no longer
runs) are removed by the next write to the same path. Outputs get the
usual permissions (``0666`` less the umask).
"""

from __future__ import annotations

import ctypes
import errno
import glob
import hashlib
import os
import pathlib
import re
import shutil
from typing import Any
import uuid

import jax
import jax.numpy as jnp
import numpy as np

from fisher_optax.fisher import validation

PyTree = Any

MSGPACK = "msgpack"
ORBAX = "orbax"
FORMATS = (MSGPACK, ORBAX)

# The checksum manifest inside an orbax directory we wrote, and the suffix of
# the sidecar next to a msgpack file we wrote (both in ``sha256sum`` format).
MANIFEST = "fisher_optax.sha256"
SIDECAR_SUFFIX = ".sha256"

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
_FLAX_HINT = "install the extra: pip install 'fisher_optax[flax]'"


class CheckpointFormatError(ValueError):
  """A path is not a checkpoint in a supported format."""


class ChecksumError(CheckpointFormatError):
  """A checkpoint's bytes differ from the checksums written with it."""


class OutputExistsError(FileExistsError):
  """The output path is taken (or not ours to replace).

  ``str(e)`` names the Python keyword (``overwrite=True``);
  :meth:`message` can name a command-line flag instead.
  """

  def __init__(self, template: str):
    self.template = template
    super().__init__(self.message())

  def message(self, flag: str = "overwrite=True") -> str:
    return self.template.replace("{flag}", flag)


def import_flax_serialization():
  """``flax.serialization``, or an ImportError saying which extra to install."""
  try:
    from flax import serialization  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
      f"Reading or writing '*.msgpack' files needs flax ({e}); {_FLAX_HINT}."
    ) from e
  return serialization


def import_orbax():
  """``orbax.checkpoint``, or an ImportError saying which extra to install."""
  try:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
      f"Orbax checkpoint directories need orbax-checkpoint ({e}); "
      f"{_FLAX_HINT} (flax brings orbax-checkpoint)."
    ) from e
  return ocp


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


# -- checksums -----------------------------------------------------------------

_LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)")


def _sha256(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _sidecar(path: pathlib.Path) -> pathlib.Path:
  return path.with_name(path.name + SIDECAR_SUFFIX)


def _manifest_text(digests: dict[str, str]) -> str:
  # ``sha256sum -c`` reads this format.
  return "".join(f"{d}  {name}\n" for name, d in sorted(digests.items()))


def _parse_manifest(path: pathlib.Path) -> dict[str, str] | None:
  """``{relative path: digest}``, or ``None`` if not a checksum file of ours."""
  try:
    text = path.read_text("utf-8")
  except (OSError, UnicodeDecodeError):
    return None
  if not text.endswith("\n"):
    return None
  out = {}
  for line in text[:-1].split("\n"):
    m = _LINE.fullmatch(line)
    if m is None:
      return None
    out[m.group(2)] = m.group(1)
  return out or None


def _dir_digests(root: pathlib.Path) -> dict[str, str]:
  return {
    p.relative_to(root).as_posix(): _sha256(p)
    for p in sorted(root.rglob("*"))
    if p.is_file() and p.relative_to(root).as_posix() != MANIFEST
  }


def verify_checksums(path: str | os.PathLike[str]) -> bool:
  """Checks a checkpoint against the checksums written with it.

  Args:
    path: a msgpack file (checked against its ``.sha256`` sidecar) or an
      orbax directory (against its ``fisher_optax.sha256`` manifest).

  Returns:
    True if checksums were found and match, False if there are none.

  Raises:
    ChecksumError: a file differs from its checksum, a listed file is
      missing, or the checksum file itself is damaged.
  """
  p = pathlib.Path(path)
  manifest = p / MANIFEST if p.is_dir() else _sidecar(p)
  if not manifest.exists():
    return False
  listed = _parse_manifest(manifest)
  if listed is None or (not p.is_dir() and list(listed) != [p.name]):
    raise ChecksumError(
      f"The checksum file {str(manifest)!r} is damaged; cannot verify "
      f"{str(p)!r}."
    )
  for name, digest in listed.items():
    f = p / name if p.is_dir() else p
    if not f.is_file():
      raise ChecksumError(
        f"{str(p)!r} is incomplete: {name!r}, listed in {str(manifest)!r}, "
        "is missing."
      )
    if _sha256(f) != digest:
      raise ChecksumError(
        f"{str(f)!r} does not match its SHA-256 checksum in "
        f"{str(manifest)!r}: the file is damaged or was changed after it "
        "was written."
      )
  return True


def is_ours(path: str | os.PathLike[str]) -> bool:
  """Whether ``path`` is an output this module wrote (it has our checksums)."""
  p = pathlib.Path(path)
  if p.is_symlink():
    return False
  if p.is_dir():
    return _parse_manifest(p / MANIFEST) is not None
  listed = _parse_manifest(_sidecar(p))
  return p.is_file() and listed is not None and list(listed) == [p.name]


# -- reading -------------------------------------------------------------------


def is_key(x: Any) -> bool:
  """Whether ``x`` is a typed PRNG key array (e.g. an NNX ``RngKey``)."""
  return isinstance(x, jax.Array) and jnp.issubdtype(
    x.dtype, jax.dtypes.prng_key
  )


def dtype_of(x: Any) -> np.dtype:
  """``x``'s dtype without converting it (a key array has no NumPy form)."""
  return x.dtype if is_key(x) else np.asarray(x).dtype


def _to_numpy(tree: PyTree) -> PyTree:
  # Key arrays stay typed: NumPy cannot hold them, and an orbax checkpoint
  # of an NNX model with dropout or other RNG state carries them.
  return jax.tree.map(lambda x: x if is_key(x) else np.asarray(x), tree)


def load_tree(path: str | os.PathLike[str]) -> PyTree:
  """Loads a parameter tree (nested dicts of numpy arrays) from a checkpoint.

  Checksums written with the checkpoint are verified first.

  Args:
    path: a flax msgpack file or an orbax checkpoint directory.

  Returns:
    The tree, with numpy leaves. Orbax checkpoints are restored without a
    target, so containers come back as dicts (and lists).

  Raises:
    FileNotFoundError, CheckpointFormatError: see :func:`detect_format`;
    also for a msgpack file that does not parse.
    ChecksumError: the checkpoint differs from its checksums.
  """
  fmt = detect_format(path)
  verify_checksums(path)
  if fmt == MSGPACK:
    serialization = import_flax_serialization()
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
  ocp = import_orbax()
  with ocp.StandardCheckpointer() as ckptr:
    tree = ckptr.restore(os.path.abspath(path))
  return _to_numpy(tree)


def _to_plain(tree: PyTree) -> PyTree:
  """Nested dicts of numpy arrays (NNX state and NamedTuples included)."""
  serialization = import_flax_serialization()
  if hasattr(tree, "to_pure_dict"):  # nnx.State
    tree = tree.to_pure_dict()
  return _to_numpy(serialization.to_state_dict(tree))


# -- destinations --------------------------------------------------------------


def _check_replaceable(path: pathlib.Path, fmt: str, overwrite: bool) -> None:
  """Raises unless the existing ``path`` may be replaced."""
  if not overwrite:
    raise OutputExistsError(
      f"{str(path)!r} exists; pass {{flag}} to replace it."
    )
  if path.is_symlink():
    raise OutputExistsError(
      f"{str(path)!r} is a symbolic link; refusing to replace it, even with "
      "{flag}."
    )
  if fmt == MSGPACK and path.is_dir():
    raise OutputExistsError(
      f"{str(path)!r} is a directory; refusing to replace it with a file."
    )
  if fmt == ORBAX and not path.is_dir():
    raise OutputExistsError(
      f"{str(path)!r} is a file; refusing to replace it with an orbax "
      "directory."
    )
  if not is_ours(path):
    mark = (
      f"no {MANIFEST} inside"
      if fmt == ORBAX
      else f"no matching {_sidecar(path).name} next to it"
    )
    raise OutputExistsError(
      f"{str(path)!r} was not written by fisher_optax ({mark}); {{flag}} "
      "replaces only outputs of fisher_optax, so it is left untouched. Move "
      "it away or choose another output path."
    )


def _check_destination(path: pathlib.Path, fmt: str, overwrite: bool) -> None:
  # Checked before the path exists: "no" would otherwise read as True.
  validation.check_flag("overwrite", overwrite)
  if os.path.lexists(path):
    _check_replaceable(path, fmt, overwrite)
    return
  if not path.parent.is_dir():
    raise FileNotFoundError(
      f"The output directory {str(path.parent)!r} does not exist."
    )
  sidecar = _sidecar(path)
  if fmt == MSGPACK and os.path.lexists(sidecar):
    # A sidecar of ours without its file (deleted) is replaced; anything
    # else of that name is not ours.
    if sidecar.is_symlink() or _parse_manifest(sidecar) is None:
      raise OutputExistsError(
        f"{str(sidecar)!r} exists and is not a checksum file of "
        "fisher_optax; refusing to replace it."
      )


def check_destination(
  path: str | os.PathLike[str],
  fmt: str | None = None,
  *,
  overwrite: bool = False,
) -> str:
  """Checks that ``path`` can be written (before doing any expensive work).

  Args:
    path: the destination.
    fmt: ``"msgpack"`` or ``"orbax"``; inferred from ``path`` if ``None``.
    overwrite: whether an existing output of ours may be replaced.

  Returns:
    The output format.

  Raises:
    OutputExistsError: ``path`` exists and ``overwrite`` is False, or it is
      not an output of ours (or not of the format).
    FileNotFoundError: the parent directory does not exist.
  """
  fmt = output_format(path, fmt)
  _check_destination(pathlib.Path(path), fmt, overwrite)
  return fmt


# -- leftovers of killed writers -----------------------------------------------

_TMP = "tmp"
_OLD = "old"


def _temp_name(path: pathlib.Path, kind: str = _TMP) -> pathlib.Path:
  # The pid tells a later run whether the writer still lives.
  return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex}")


def _alive(pid: int) -> bool:
  if pid == os.getpid():
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:  # e.g. another user's process
    return True
  return True


def _remove(p: pathlib.Path) -> None:
  if p.is_dir() and not p.is_symlink():
    shutil.rmtree(p, ignore_errors=True)
  elif os.path.lexists(p):
    p.unlink(missing_ok=True)


def clean_leftovers(path: str | os.PathLike[str]) -> list[str]:
  """Removes temporaries of ``path`` left by writers that were killed.

  ``.NAME.tmp-<pid>-*`` files and directories whose process no longer runs
  are deleted. ``.NAME.old-<pid>-*`` (an output moved aside during a
  directory swap on systems without ``renameat2``) is put back at ``NAME``
  if ``NAME`` is missing, else deleted.

  Returns:
    The names removed or restored.
  """
  path = pathlib.Path(path)
  pattern = re.compile(
    rf"\.{re.escape(path.name)}\.({_TMP}|{_OLD})-(\d+)-[0-9a-f]+(\..*)?"
  )
  done = []
  if not path.parent.is_dir():
    return done
  for p in sorted(path.parent.iterdir()):
    m = pattern.fullmatch(p.name)
    if m is None or _alive(int(m.group(2))):
      continue
    if m.group(1) == _OLD and not os.path.lexists(path):
      os.rename(p, path)
    else:
      _remove(p)
    done.append(p.name)
  return done


# -- committing ----------------------------------------------------------------

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _load_renameat2():
  try:
    fn = ctypes.CDLL(None, use_errno=True).renameat2
  except (AttributeError, OSError):  # not glibc >= 2.28 / not Linux
    return None
  fn.argtypes = [
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_uint,
  ]
  fn.restype = ctypes.c_int
  return fn


_renameat2 = _load_renameat2()


def _rename2(src: pathlib.Path, dst: pathlib.Path, flags: int) -> bool:
  """``renameat2``; False if this system or file system lacks it."""
  if _renameat2 is None:
    return False
  rc = _renameat2(
    _AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags
  )
  if rc == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
    return False
  raise OSError(err, os.strerror(err), str(dst))


def _place_new(tmp: pathlib.Path, path: pathlib.Path) -> None:
  """Moves ``tmp`` to ``path``; FileExistsError if ``path`` exists by now."""
  if not tmp.is_dir():
    try:
      os.link(tmp, path)  # fails if path exists
    except FileExistsError:
      raise
    except OSError:  # no hard links on this file system
      if not _rename2(tmp, path, _RENAME_NOREPLACE):
        if os.path.lexists(path):
          raise FileExistsError(
            errno.EEXIST, "File exists", str(path)
          ) from None
        os.rename(tmp, path)
      return
    os.unlink(tmp)
    return
  if not _rename2(tmp, path, _RENAME_NOREPLACE):
    # os.rename cannot replace a file or a non-empty directory.
    if os.path.lexists(path):
      raise FileExistsError(errno.EEXIST, "File exists", str(path))
    try:
      os.rename(tmp, path)
    except OSError as e:
      if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
        raise FileExistsError(errno.EEXIST, "File exists", str(path)) from e
      raise


def _replace(tmp: pathlib.Path, path: pathlib.Path) -> None:
  """Replaces the existing ``path`` (already checked to be ours) by ``tmp``."""
  if not tmp.is_dir():
    os.replace(tmp, path)  # atomic for files
    return
  if _rename2(tmp, path, _RENAME_EXCHANGE):
    shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old output
    return
  # Directories cannot be swapped in one call here: move the old one aside,
  # rename, then delete it (restoring it if the rename fails).
  old = _temp_name(path, _OLD)
  os.rename(path, old)
  try:
    os.rename(tmp, path)
  except BaseException:
    os.rename(old, path)
    raise
  shutil.rmtree(old, ignore_errors=True)


def commit(
  tmp: pathlib.Path,
  path: pathlib.Path,
  *,
  fmt: str,
  overwrite: bool = False,
  sidecar: pathlib.Path | None = None,
) -> None:
  """Moves a finished temporary output into place (the only visible step).

  A new output never replaces something that appeared at ``path`` while we
  wrote; an existing one is replaced only with ``overwrite`` and only if it
  is ours. ``sidecar`` (a msgpack file's checksums) follows the file.
  """
  try:
    _place_new(tmp, path)
  except FileExistsError:
    _check_replaceable(path, fmt, overwrite)
    _replace(tmp, path)
  if sidecar is not None:
    os.replace(sidecar, _sidecar(path))
  _fsync_dir(path.parent)


def _fsync_dir(d: pathlib.Path) -> None:
  try:
    fd = os.open(d, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def _write_new_file(path: pathlib.Path, data: bytes) -> None:
  # O_EXCL: never through a file or link planted at our temporary name;
  # 0o666 less the umask, as any program's outputs.
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
  with os.fdopen(fd, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def write_atomically(
  path: pathlib.Path, tree: PyTree, *, fmt: str, overwrite: bool = False
) -> None:
  """Writes ``tree`` as it is to a temporary sibling, then moves it to ``path``.

  The one writer of both formats: nothing is visible at ``path`` until the
  write is complete and checksummed, a failed write leaves no temporary
  behind, and temporaries of killed writers are removed first. Check the
  destination first (:func:`check_destination`).

  Args:
    path: the destination (``*.msgpack`` file or orbax directory).
    tree: for msgpack, nested dicts of arrays; for orbax, any pytree orbax
      saves (NamedTuples and ``nnx.State`` included).
    fmt: ``"msgpack"`` or ``"orbax"``.
    overwrite: replace an existing output of ours.
  """
  path = pathlib.Path(path)
  clean_leftovers(path)
  tmp = _temp_name(path)
  sidecar = None
  try:
    if fmt == MSGPACK:
      serialization = import_flax_serialization()
      data = serialization.msgpack_serialize(tree)
      _write_new_file(tmp, data)
      sidecar = tmp.with_name(tmp.name + SIDECAR_SUFFIX)
      digest = hashlib.sha256(data).hexdigest()
      _write_new_file(
        sidecar, _manifest_text({path.name: digest}).encode("utf-8")
      )
    else:
      ocp = import_orbax()
      with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(tmp), tree)
        ckptr.wait_until_finished()
      _write_new_file(
        tmp / MANIFEST, _manifest_text(_dir_digests(tmp)).encode("utf-8")
      )
    commit(tmp, path, fmt=fmt, overwrite=overwrite, sidecar=sidecar)
  finally:
    for p in (tmp, sidecar):
      if p is not None:
        _remove(p)
    # orbax writes through its own sibling (``<tmp>.orbax-checkpoint-tmp``),
    # which a failed save can leave behind; the uuid makes the prefix ours.
    for p in tmp.parent.glob(glob.escape(tmp.name) + ".*"):
      _remove(p)


def save_tree(
  path: str | os.PathLike[str],
  tree: PyTree,
  *,
  fmt: str | None = None,
  overwrite: bool = False,
) -> str:
  """Writes a tree atomically as flax msgpack or an orbax checkpoint.

  The tree is written to a temporary sibling of ``path`` and moved into
  place only when complete, with SHA-256 checksums (see the module
  docstring), so an interrupted write never leaves a partial output and an
  existing ``path`` is replaced only on success, and only if we wrote it.
  Containers are written as nested dicts (NamedTuples by field name,
  ``nnx.State`` as its pure dict), leaves as numpy arrays.

  Args:
    path: the destination (``*.msgpack`` file or orbax directory).
    tree: a pytree of arrays (dicts, lists, NamedTuples, ``nnx.State``).
    fmt: ``"msgpack"`` or ``"orbax"``; inferred from ``path`` if ``None``.
    overwrite: replace an existing output written by this module.

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
    >>> sorted(p.name for p in pathlib.Path(tmp.name).iterdir())
    ['params.msgpack', 'params.msgpack.sha256']
    >>> _checkpoint_io.load_tree(path)  # checksums verified
    {'w': array([0., 1., 2.])}
  """
  path = pathlib.Path(path)
  fmt = check_destination(path, fmt, overwrite=overwrite)
  plain = _to_plain(tree)
  keys = [
    jax.tree_util.keystr(p)
    for p, x in jax.tree_util.tree_flatten_with_path(plain)[0]
    if is_key(x)
  ]
  if fmt == MSGPACK and keys:
    raise ValueError(
      "flax msgpack cannot hold typed PRNG key arrays "
      f"({', '.join(keys)}); write an orbax checkpoint instead."
    )
  if fmt == ORBAX:
    # Orbax refuses them, and a target-less load could not rebuild them.
    empty = [
      jax.tree_util.keystr(p)
      for p, x in jax.tree_util.tree_flatten_with_path(plain)[0]
      if np.size(x) == 0
    ]
    if empty:
      raise ValueError(
        "An orbax checkpoint cannot hold zero-size arrays "
        f"({', '.join(empty)}); "
        "write a .msgpack file instead."
      )
  write_atomically(path, plain, fmt=fmt, overwrite=overwrite)
  return fmt
