# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Lets one file be both an absl script and a jupytext notebook.

In a script, :func:`run` hands control to ``absl.app.run``. In a notebook
(an IPython kernel is running) it parses the flags from
``FISHER_OPTAX_NOTEBOOK_ARGS`` (e.g. ``--small`` in CI) and calls ``main``
directly, since ``app.run`` would try to parse the kernel's own arguments.
"""

from __future__ import annotations

from collections.abc import Callable
import os
import shlex
import sys

from absl import app
from absl import flags
from absl import logging


def in_notebook() -> bool:
  return "ipykernel" in sys.modules


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
