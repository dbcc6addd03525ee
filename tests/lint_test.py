# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Lint, format and type checks, run as tests so the one test command runs them.

The tool versions are pinned in the ``[test]`` extra; their configuration is
in ``pyproject.toml`` (``[tool.ruff]``, ``[tool.pyright]``).
"""

import pathlib
import subprocess
import sys

from absl.testing import absltest

_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", *args],
    cwd=_ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )


class LintTest(absltest.TestCase):
  def _assert_ok(self, proc: subprocess.CompletedProcess, fix: str):
    self.assertEqual(
      proc.returncode,
      0,
      f"{' '.join(map(str, proc.args[2:]))} failed ({fix}):\n"
      f"{proc.stdout[-8000:]}\n{proc.stderr[-2000:]}",
    )

  def test_ruff_check(self):
    self._assert_ok(_run("ruff", "check", "."), "run `ruff check --fix .`")

  def test_ruff_format(self):
    self._assert_ok(
      _run("ruff", "format", "--check", "."), "run `ruff format .`"
    )

  def test_pyright(self):
    # The interpreter running the tests is the environment pyright checks
    # against (jax, optax, flax, ... as installed by the [test] extra).
    proc = _run("pyright", "--pythonpath", sys.executable, "fisher_optax")
    self._assert_ok(proc, "pyright fisher_optax")


if __name__ == "__main__":
  absltest.main()
