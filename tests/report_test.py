# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The one speed table (``python -m benchmarks.report --speed-only``).

An accelerator run writes the speed benchmarks' results in the same format
as the committed CPU ones, so reading the committed results checks the table
an accelerator run would get, without timing anything.
"""

from __future__ import annotations

import math
import pathlib
import shutil
import tempfile

from absl.testing import absltest

from benchmarks import report


def _device(platform: str) -> dict[str, object]:
  return {
    "platform": platform,
    "device_kind": platform,
    "device_count": 1,
    "jax": "test",
  }


class SpeedTableTest(absltest.TestCase):
  def test_every_speed_benchmark_gives_rows_with_floors(self):
    text, data = report.speed_table(
      report.RESULTS, _device("cpu"), {}, small=False
    )
    self.assertEqual({r["benchmark"] for r in data["rows"]}, set(report.SPEED))
    self.assertNotIn("lacks", text)
    self.assertNotIn("not run", text)
    for row in data["rows"]:
      with self.subTest(f"{row['benchmark']}: {row['config']}"):
        for key in ("median_s", "baseline_s", "ratio"):
          self.assertTrue(math.isfinite(row[key]) and row[key] > 0, key)
    # Every benchmark states a floor for at least one of its rows.
    for name in report.SPEED:
      floors = [r["floor"] for r in data["rows"] if r["benchmark"] == name]
      self.assertTrue(any(f is not None for f in floors), name)

  def test_missing_and_failed_benchmarks_are_rows_too(self):
    with tempfile.TemporaryDirectory() as tmp:
      out = pathlib.Path(tmp)
      shutil.copy(report.RESULTS / "fadam_speed.json", out)
      statuses = {"fismo_speed": "timed out after 60 s"}
      text, data = report.speed_table(out, _device("gpu"), statuses, small=True)
    self.assertEqual({r["benchmark"] for r in data["rows"]}, {"fadam_speed"})
    self.assertIn("| fismo_speed | timed out after 60 s |", text)
    self.assertIn("| mfac_scaling | not run (no results) |", text)


if __name__ == "__main__":
  absltest.main()
