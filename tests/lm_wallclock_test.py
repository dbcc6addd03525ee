# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Smoke test of benchmarks/lm_wallclock.py: ``--small`` writes finite results."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
import tempfile

from absl.testing import absltest

_ROOT = pathlib.Path(__file__).resolve().parent.parent


class LmWallclockTest(absltest.TestCase):
  def test_small_run_writes_finite_results(self):
    out = pathlib.Path(tempfile.mkdtemp())
    # A process of its own: the benchmark's absl flags (--small, --out_dir)
    # would clash with the examples' in a shared test process. One pair keeps
    # the test short (each optimizer costs one XLA compile).
    cmd = [sys.executable, "-m", "benchmarks.lm_wallclock", "--small"]
    cmd += [f"--out_dir={out}", "--pairs=fadam"]
    proc = subprocess.run(
      cmd, cwd=_ROOT, capture_output=True, text=True, check=False
    )
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    name = "lm_wallclock_small"
    for suffix in (".md", ".json", "_steps.png", "_time.png"):
      self.assertTrue((out / f"{name}{suffix}").exists(), suffix)
    data = json.loads((out / f"{name}.json").read_text())
    self.assertEqual(set(data["val_curves"]), {"adamw", "fadam"})
    for curves in data["val_curves"].values():
      for curve in curves:
        self.assertLen(curve, len(data["eval_steps"]))
        self.assertTrue(all(math.isfinite(v) for v in curve))
    for pair in data["equal_time"].values():
      for name_, entry in pair.items():
        if name_ != "equal_time_s":
          self.assertTrue(
            all(math.isfinite(v) for v in entry["loss_at_equal_time"])
          )
    md = (out / f"{name}.md").read_text()
    self.assertIn("Loss at equal steps", md)
    self.assertIn("Loss at equal time", md)

    # --rerun trains FAdam again (same seeds and data: the same curves) and
    # takes AdamW's runs from the stored results.
    proc = subprocess.run(
      cmd + ["--rerun=fadam"],
      cwd=_ROOT,
      capture_output=True,
      text=True,
      check=False,
    )
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    self.assertIn("sweep fadam", proc.stdout)
    self.assertNotIn("sweep adamw", proc.stdout)
    again = json.loads((out / f"{name}.json").read_text())
    self.assertEqual(again["val_curves"]["adamw"], data["val_curves"]["adamw"])
    self.assertEqual(again["best_lr"], data["best_lr"])
    for a, b in zip(again["val_curves"]["fadam"], data["val_curves"]["fadam"]):
      self.assertSequenceAlmostEqual(a, b, places=5)
    self.assertIn("`--rerun`", (out / f"{name}.md").read_text())


if __name__ == "__main__":
  absltest.main()
