# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Runs every example at small size, as its paired notebook.

Each ``examples/<name>.py`` is an absl script in jupytext percent format,
paired with ``examples/<name>.ipynb``. The notebook must be in sync with the
script (the same cells, checked here), carry no outputs, and run top to bottom
with ``--small``, writing its plots to ``--out_dir``, showing its figures
inline (image outputs) with progress bars that render (no ``IProgress not
found``). Since the cells are the script's, running the notebook runs every
line of the script but its entry point (``examples._notebook.run``, which
hands a script to ``absl.app.run``); that entry point is run as a script for
one example, the quickest, rather than compiling every example twice.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jupytext
from nbclient import NotebookClient
import nbformat

_EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
# The demo (``python -m examples.demo``) has its own test and no notebook.
_NAMES = sorted(
  p.stem
  for p in _EXAMPLES.glob("*.py")
  if not p.name.startswith("_") and p.stem != "demo"
)
# Test names say which example: test_notebook_runs_small_char_lm, ...
_CASES = [(f"_{n}", n) for n in _NAMES]
# The example run as a script too (the quickest; see the module docstring).
_SCRIPT_CASES = [(f"_{n}", n) for n in _NAMES if n == "scaling_out"]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
  env = dict(os.environ)
  env.setdefault("JAX_PLATFORMS", "cpu")
  env.update(extra or {})
  return env


class ExamplesTest(parameterized.TestCase):
  def test_there_are_examples(self):
    self.assertGreaterEqual(len(_NAMES), 5, _NAMES)

  @parameterized.named_parameters(*_CASES)
  def test_notebook_is_paired_and_clean(self, name):
    path = _EXAMPLES / f"{name}.ipynb"
    self.assertTrue(path.exists(), f"{name}.py has no paired notebook")
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
      if cell.cell_type == "code":
        self.assertEmpty(cell.outputs, f"{name}.ipynb has committed outputs")
        self.assertIsNone(cell.execution_count)
    script = jupytext.read(_EXAMPLES / f"{name}.py")
    strip = lambda cells: [c.source.strip() for c in cells]
    self.assertEqual(
      strip(nb.cells),
      strip(script.cells),
      f"{name}.ipynb is out of sync with {name}.py; run "
      f"`jupytext --sync examples/{name}.py`",
    )

  def test_every_example_uses_the_shared_entry_point(self):
    for name in _NAMES:
      source = (_EXAMPLES / f"{name}.py").read_text()
      self.assertIn("_notebook.run(main)", source, name)
    self.assertLen(_SCRIPT_CASES, 1)

  @parameterized.named_parameters(*_SCRIPT_CASES)
  def test_script_runs_small(self, name):
    with tempfile.TemporaryDirectory() as out:
      proc = subprocess.run(
        [
          sys.executable,
          str(_EXAMPLES / f"{name}.py"),
          "--small",
          f"--out_dir={out}",
        ],
        cwd=_EXAMPLES,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
      )
      self.assertEqual(
        proc.returncode, 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
      )
      self.assertNotEmpty(
        list(pathlib.Path(out).glob("*.png")), f"{name} wrote no plot"
      )

  @parameterized.named_parameters(*_CASES)
  def test_notebook_runs_small(self, name):
    nb = nbformat.read(_EXAMPLES / f"{name}.ipynb", as_version=4)
    with tempfile.TemporaryDirectory() as out:
      os.environ["FISHER_OPTAX_NOTEBOOK_ARGS"] = f"--small --out_dir={out}"
      try:
        NotebookClient(
          nb,
          timeout=600,
          kernel_name="python3",
          resources={"metadata": {"path": str(_EXAMPLES)}},
        ).execute()
      finally:
        del os.environ["FISHER_OPTAX_NOTEBOOK_ARGS"]
      self.assertNotEmpty(
        list(pathlib.Path(out).glob("*.png")), f"{name}.ipynb wrote no plot"
      )
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    self.assertNotEmpty(images, f"{name}.ipynb shows no figure inline")
    text = "".join(
      o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
      for o in outputs
    )
    self.assertNotIn("IProgress not found", text)


if __name__ == "__main__":
  absltest.main()
