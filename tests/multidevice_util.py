# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Runs multi-device checks in a process of their own.

XLA fixes the number of host devices when the backend starts, so checks that
need 8 CPU devices cannot share the main pytest process. A test module calls
:func:`run_checks` on a file under ``tests/multidevice/`` (named
``*_checks.py`` so pytest does not collect it directly); that file runs in a
fresh interpreter with ``--xla_force_host_platform_device_count``.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys

_ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_checks(
  test_case, checks_file: str, n_devices: int = 8, timeout: float = 600.0
) -> None:
  """Runs ``tests/multidevice/<checks_file>`` under pytest with n CPU devices."""
  path = _ROOT / "tests" / "multidevice" / checks_file
  env = dict(os.environ)
  flags = env.get("XLA_FLAGS", "")
  env["XLA_FLAGS"] = (
    f"{flags} --xla_force_host_platform_device_count={n_devices}".strip()
  )
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(_ROOT), env.get("PYTHONPATH", "")) if p
  )
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "pytest",
      "-q",
      "-p",
      "no:cacheprovider",
      "-p",
      "no:xdist",
      str(path),
    ],
    env=env,
    cwd=_ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )
  test_case.assertEqual(
    proc.returncode,
    0,
    f"multi-device checks in {checks_file} failed:\n"
    f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}",
  )


def largest_all_gather(hlo_text: str) -> int:
  """The most elements any all-gather of a compiled program returns (0 if
  it has none): what a device receives at most in one gather."""
  largest = 0
  for line in hlo_text.splitlines():
    head, sep, _ = line.partition(" all-gather")
    if not sep or "=" not in head:
      continue
    for dims in re.findall(r"\w+\[([\d,]*)\]", head.split("=", 1)[1]):
      largest = max(largest, math.prod(int(d) for d in dims.split(",") if d))
  return largest
