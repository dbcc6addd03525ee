# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Runs ``python -m examples.demo --small`` end to end, from the repo root."""

import importlib.util
import json
import pathlib
import subprocess
import sys
import tempfile

from absl.testing import absltest
import jax
import matplotlib

matplotlib.use("Agg")

from examples import demo  # noqa: E402
from examples.common import models  # noqa: E402

_ROOT = pathlib.Path(__file__).resolve().parent.parent


class DemoTest(absltest.TestCase):
  def test_demo_and_toy_modules_are_not_in_the_package(self):
    # The wheel ships fisher_optax only; these live in examples/.
    for name in ("demo", "datasets", "models"):
      self.assertIsNone(importlib.util.find_spec(f"fisher_optax.{name}"))

  def test_output_folders_are_ignored_by_git(self):
    ignored = (_ROOT / ".gitignore").read_text().splitlines()
    self.assertIn("fisher_optax_demo/", ignored)
    self.assertIn("example_outputs/", ignored)

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
      # Compile time is its own column, not hidden in the step time.
      self.assertGreater(row["compile_s"], 0.0)
      self.assertGreater(row["ms_per_step"], 0.0)
    self.assertIn("compile_s: compiling the jitted train step", proc.stdout)
    errs = report["fisher"]["relative_error_vs_exact_diagonal"]
    self.assertAlmostEqual(errs["exact"], 0.0, places=6)
    self.assertGreater(errs["batch_squared"], errs["empirical"])
    self.assertBetween(report["fisher"]["energy_top_k"], 0.0, 1.0 + 1e-6)
    # The printed example count is the one used.
    n = report["fisher"]["n_examples"]
    self.assertIn(f"model ({n} examples)", proc.stdout)
    self.assertIn(demo._MC_NOTE, proc.stdout)
    self.assertLen(report["continual"], 3)
    self.assertLen(report["merging"], 2)
    self.assertLen(report["pruning"], 3)

  def test_fismo_and_mfac_precondition_the_hidden_kernels_only(self):
    _, params = models.digits_mlp(0, demo._SIZES)
    flags = jax.tree_util.tree_leaves_with_path(demo._hidden(params))
    picked = sorted(jax.tree_util.keystr(k) for k, v in flags if v)
    self.assertEqual(
      picked, ["['layers'][0]['kernel']", "['layers'][1]['kernel']"]
    )

  def test_figure_shows_the_claimed_differences(self):
    curves = {"a": [1.0, 0.5, 0.2], "b": [1.0, 0.6, 0.3]}
    fisher_summary = {
      "relative_error_vs_exact_diagonal": {"exact": 0.0, "mc": 1.5}
    }
    continual = [
      {"method": m, "task_A_accuracy": a, "task_B_accuracy": 0.97}
      for m, a in (("fine-tune", 0.77), ("EWC", 0.90), ("rank-1", 0.76))
    ]
    merging = [
      {"merge": "plain average", "mean_test_accuracy": 0.9347},
      {"merge": "Fisher merging", "mean_test_accuracy": 0.9431},
    ]
    pruning = [
      {"pruning": p, "test_accuracy": a}
      for p, a in (("dense", 0.983), ("magnitude", 0.972), ("OBS", 0.986))
    ]
    fig = demo._figure(
      curves, [3.0, 2.0, 1.0], fisher_summary, continual, merging, pruning
    )
    fig.canvas.draw()
    axes = fig.axes
    for ax, values in ((axes[4], merging), (axes[5], pruning)):
      lo, hi = ax.get_ylim()
      # Zoomed: a 0.01 difference is a visible share of the axis.
      self.assertGreater(lo, 0.5)
      self.assertLess(hi - lo, 0.2)
      labels = {t.get_text() for t in ax.texts}
      for row in values:
        value = row.get("mean_test_accuracy", row.get("test_accuracy"))
        self.assertIn(f"{value:.3f}", labels)
    # The legend of panel 3 covers no bar.
    ax = axes[3]
    legend = ax.get_legend().get_window_extent()
    for bar in ax.patches:
      self.assertFalse(
        legend.overlaps(bar.get_window_extent()), "legend hides a bar"
      )

  def test_missing_extra_names_the_install_command(self):
    # flax absent: importing it fails, as on a core-only install.
    code = (
      "import sys; sys.modules['flax'] = None; "
      "import runpy; runpy.run_module('examples.demo', run_name='__main__')"
    )
    proc = subprocess.run(
      [sys.executable, "-c", code],
      cwd=_ROOT,
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
    )
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn("pip install -e '.[examples]'", proc.stderr)


if __name__ == "__main__":
  absltest.main()
