# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Runs ``python -m examples.demo --small`` end to end, from the repo root."""

import importlib.util
import json
import pathlib
import subprocess
import sys
import tempfile

from absl.testing import absltest

_ROOT = pathlib.Path(__file__).resolve().parent.parent


class DemoTest(absltest.TestCase):
  def test_demo_and_toy_modules_are_not_in_the_package(self):
    # The wheel ships fisher_optax only; these live in examples/.
    for name in ("demo", "datasets", "models"):
      self.assertIsNone(importlib.util.find_spec(f"fisher_optax.{name}"))

  def test_small_demo_runs_and_reports_every_part(self):
    with tempfile.TemporaryDirectory() as out:
      proc = subprocess.run(
        [
          sys.executable,
          "-m",
          "examples.demo",
          "--small",
          f"--out_dir={out}",
        ],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
      )
      self.assertEqual(
        proc.returncode, 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
      )
      self.assertTrue((pathlib.Path(out) / "demo.png").stat().st_size > 0)
      report = json.loads((pathlib.Path(out) / "demo.json").read_text())
    names = [r["optimizer"] for r in report["optimizers"]]
    self.assertEqual(
      names, ["AdamW (optax)", "FAdam", "FISMO", "Natural GaLore", "M-FAC"]
    )
    for row in report["optimizers"]:
      self.assertBetween(row["test_accuracy"], 0.0, 1.0)
      self.assertLess(row["final_train_loss"], 2.31)  # below chance: it learns
    errs = report["fisher"]["relative_error_vs_exact_diagonal"]
    self.assertAlmostEqual(errs["exact"], 0.0, places=6)
    self.assertGreater(errs["batch_squared"], errs["empirical"])
    self.assertBetween(report["fisher"]["energy_top_k"], 0.0, 1.0 + 1e-6)
    self.assertLen(report["continual"], 3)
    self.assertLen(report["merging"], 2)
    self.assertLen(report["pruning"], 3)


if __name__ == "__main__":
  absltest.main()
