# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Smoke test of benchmarks/lm_wallclock.py: ``--small`` writes finite results."""

from __future__ import annotations

import json
import math
import pathlib
import tempfile

from absl import flags
from absl.testing import absltest

from benchmarks import lm_wallclock


class LmWallclockTest(absltest.TestCase):
  def test_small_run_writes_finite_results(self):
    out = pathlib.Path(tempfile.mkdtemp())
    # One pair keeps the test under 40 s on a shared 2-core CPU (each
    # optimizer costs one XLA compile); --small runs all four pairs.
    flags.FLAGS(
      [
        "lm_wallclock",
        "--small",
        f"--out_dir={out}",
        "--pairs=fadam",
      ]
    )
    try:
      lm_wallclock.main([])
    finally:
      flags.FLAGS.unparse_flags()
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


if __name__ == "__main__":
  absltest.main()
