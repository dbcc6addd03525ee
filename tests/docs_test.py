# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Builds the documentation as BUILD.md says, warnings as errors."""

import pathlib
import subprocess
import sys
import tempfile

from absl.testing import absltest

_ROOT = pathlib.Path(__file__).resolve().parent.parent


class DocsTest(absltest.TestCase):
  def test_sphinx_build_has_no_warnings(self):
    with tempfile.TemporaryDirectory() as out:
      proc = subprocess.run(
        [
          sys.executable,
          "-m",
          "sphinx",
          "-W",
          "--keep-going",
          "-q",
          "-b",
          "html",
          "-d",
          str(pathlib.Path(out) / "doctrees"),
          "docs",
          str(pathlib.Path(out) / "html"),
        ],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
      )
      self.assertEqual(
        proc.returncode,
        0,
        "docs build failed (python -m sphinx -W --keep-going -b html docs "
        f"docs/_build/html):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}",
      )
      html = pathlib.Path(out) / "html"
      for page in ("index", "fisher", "examples", "_generated/api/index"):
        self.assertTrue((html / f"{page}.html").exists(), page)
      self.assertTrue((html / "_images" / "fisher_structures.png").exists())
      notebooks = list((html / "_generated" / "examples").glob("*.html"))
      self.assertGreaterEqual(len(notebooks), 5, notebooks)


if __name__ == "__main__":
  absltest.main()
