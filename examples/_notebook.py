# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Lets one file be both an absl script and a jupytext notebook.

In a script, :func:`run` hands control to ``absl.app.run``. In a notebook
(an IPython kernel is running) it parses the flags from
``FISHER_OPTAX_NOTEBOOK_ARGS`` (e.g. ``--small`` in CI) and calls ``main``
directly, since ``app.run`` would try to parse the kernel's own arguments.

:func:`show` saves a figure and, in a notebook, also displays it inline. A
script draws off screen (matplotlib's ``Agg`` backend, chosen on import of
this module outside a notebook); a notebook keeps its inline backend.
"""

from __future__ import annotations

from collections.abc import Callable
import os
import pathlib
import shlex
import sys
from typing import Any

from absl import app
from absl import flags
from absl import logging


def in_notebook() -> bool:
  return "ipykernel" in sys.modules


if not in_notebook():
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top

    # A script only writes image files: never open a window.
    matplotlib.use("Agg")
  except ImportError:  # pragma: no cover
    pass


def show(fig: Any, path: str | os.PathLike[str], dpi: int = 120) -> None:
  """Saves ``fig`` to ``path``; in a notebook also displays it inline."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig.savefig(pathlib.Path(path), dpi=dpi)
  if in_notebook():
    from IPython.display import display  # pylint: disable=g-import-not-at-top

    display(fig)
  # Closed either way, so the inline backend does not draw it a second time.
  plt.close(fig)


def run(main: Callable[[list[str]], None]) -> None:
  """Runs ``main`` as an absl app, or directly inside a notebook."""
  # JAX logs backend probing at INFO; examples show only warnings and up.
  logging.set_verbosity(logging.WARNING)
  if in_notebook():
    args = shlex.split(os.environ.get("FISHER_OPTAX_NOTEBOOK_ARGS", ""))
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["notebook", *args])
    main([])
  else:
    app.run(main)
