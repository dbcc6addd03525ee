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

import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp

from fisher_optax import _checkpoint_io

PyTree = Any

__all__ = ["restore", "save"]


def _drop_empty(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda x: None if x.size == 0 else x, tree)


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
      (NamedTuples, ``nnx.State``) are what comes back.

  Returns:
    The restored tree.

  Raises:
    FileNotFoundError: no checkpoint directory at ``path``.
    ValueError: (``ChecksumError``) a file of the checkpoint differs from
      its SHA-256 manifest.
  """
  ocp = _checkpoint_io.import_orbax()
  path = pathlib.Path(path).absolute()
  if not path.is_dir():
    raise FileNotFoundError(f"No checkpoint directory at {str(path)!r}.")
  _checkpoint_io.verify_checksums(path)
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), target
  )
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(path, _drop_empty(abstract))
  return jax.tree.map(
    lambda s, r: jnp.zeros(s.shape, s.dtype) if s.size == 0 else r,
    abstract,
    restored,
  )
