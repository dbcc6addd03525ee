# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The one speed table (``python -m benchmarks.report --speed-only``).

An accelerator run writes the speed benchmarks' results in the same format
as the committed CPU ones, so a table made from the committed results
(``--no-run``) checks what an accelerator run would get, without timing
anything.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import subprocess
import sys
import tempfile

from absl.testing import absltest

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_RESULTS = _ROOT / "benchmarks" / "results"
# benchmarks.report.SPEED (not imported here: see the test).
_SPEED = (
  "fadam_speed",
  "fismo_speed",
  "mfac_scaling",
  "natural_galore_memory_speed",
  "physguard_speed",
  "fisher_engine",
)


class SpeedTableTest(absltest.TestCase):
  def test_table_from_stored_results(self):
    with tempfile.TemporaryDirectory() as tmp:
      out = pathlib.Path(tmp)
      for name in _SPEED:
        if name != "mfac_scaling":  # a benchmark without results
          shutil.copy(_RESULTS / f"{name}.json", out)
      # A process of its own: the report's absl flags (--small) would clash
      # with the examples' in a shared test process.
      proc = subprocess.run(
        [
          sys.executable,
          "-m",
          "benchmarks.report",
          "--speed-only",
          "--no-run",
          f"--speed-out-dir={out}",
        ],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        check=False,
      )
      self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
      (table,) = out.glob("speed_*.md")
      text = table.read_text()
      data = json.loads(table.with_suffix(".json").read_text())
    self.assertIn("| mfac_scaling | not run (no results) |", text)
    self.assertNotIn("lacks", text)
    rows = data["rows"]
    want = set(_SPEED) - {"mfac_scaling"}
    self.assertEqual({r["benchmark"] for r in rows}, want)
    for row in rows:
      with self.subTest(f"{row['benchmark']}: {row['config']}"):
        for key in ("median_s", "baseline_s", "ratio"):
          self.assertTrue(math.isfinite(row[key]) and row[key] > 0, key)
    # Every benchmark states a floor for at least one of its rows.
    for name in want:
      floors = [r["floor"] for r in rows if r["benchmark"] == name]
      self.assertTrue(any(f is not None for f in floors), name)


if __name__ == "__main__":
  absltest.main()
