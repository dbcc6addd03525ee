# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The paper-claims report: ``python -m benchmarks.report [--small]``.

Runs every benchmark script in ``benchmarks/`` (each in its own subprocess,
with ``--small`` when asked), then writes ``benchmarks/REPORT.md``: a
headline table with one row per paper claim and a verdict derived from the
benchmark's JSON numbers, followed by each benchmark's own tables and plots.

Flags: ``--only fadam_quality,merging`` restricts the run (the report still
aggregates everything that exists); ``--no_run`` (or ``--norun``) only
aggregates the existing results. The headline table is also written to
``benchmarks/results/report_headline.md`` (links rebased for the README).
A benchmark whose results are missing shows
as "not run". Full-size results are preferred; ``<name>_small`` results are
used when no full-size ones exist and are labelled as such.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import json
import math
import pathlib
import subprocess
import sys
import time
from typing import Any

from absl import app
from absl import flags

flags.DEFINE_bool("small", False, "Run every benchmark with --small.")
flags.DEFINE_list("only", [], "Benchmarks to run (default: all).")
flags.DEFINE_bool(
  "run",
  True,
  "Run the benchmarks (--norun / --no_run: only aggregate existing results).",
)
flags.DEFINE_integer("timeout", 1800, "Seconds allowed per benchmark.")
flags.DEFINE_string(
  "output", None, "Report path (default benchmarks/REPORT.md)."
)
FLAGS = flags.FLAGS

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
_NOT_BENCHMARKS = {"__init__", "common", "report"}


def benchmark_names() -> list[str]:
  return sorted(
    p.stem
    for p in HERE.glob("*.py")
    if p.stem not in _NOT_BENCHMARKS and not p.stem.startswith("_")
  )


def run_benchmarks(
  names: list[str], small: bool, timeout: int
) -> dict[str, str]:
  """Runs each benchmark as ``python -m benchmarks.<name>``; returns status."""
  status = {}
  for name in names:
    cmd = [sys.executable, "-m", f"benchmarks.{name}"] + (
      ["--small"] if small else []
    )
    print(f"[report] running {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    try:
      proc = subprocess.run(
        cmd,
        cwd=HERE.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
      )
      ok = proc.returncode == 0
      status[name] = (
        f"ok ({time.perf_counter() - start:.0f} s)"
        if ok
        else f"failed (exit {proc.returncode})"
      )
      if not ok:
        print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n")
    except subprocess.TimeoutExpired:
      status[name] = f"timed out after {timeout} s"
    print(f"[report] {name}: {status[name]}", flush=True)
  return status


@dataclasses.dataclass
class Result:
  """One benchmark's stored results (full size preferred over small)."""

  name: str
  stem: str | None  # file stem actually found, e.g. "merging_small"
  data: dict[str, Any] | None
  markdown: str | None

  @property
  def small(self) -> bool:
    return bool(self.stem and self.stem.endswith("_small"))


def load(name: str) -> Result:
  for stem in (name, f"{name}_small"):
    path = RESULTS / f"{stem}.json"
    if path.exists():
      try:
        data = json.loads(path.read_text())
      except json.JSONDecodeError:
        data = None
      md = RESULTS / f"{stem}.md"
      return Result(name, stem, data, md.read_text() if md.exists() else None)
  return Result(name, None, None, None)


# -- statistics -----------------------------------------------------------


def mean_std(xs: list[float]) -> tuple[float, float]:
  n = len(xs)
  mean = sum(xs) / n
  std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
  return mean, std


def fmt(xs: list[float], digits: int = 3) -> str:
  m, s = mean_std(xs)
  return f"{m:.{digits}f} ± {s:.{digits}f} (n={len(xs)})"


# -- claims ---------------------------------------------------------------
# Each claim reads one benchmark's JSON and returns (verdict, evidence). A
# missing key raises and is reported as "results incomplete", never guessed.

REPRODUCED = "reproduced"
NOT_REPRODUCED = "**did not reproduce**"
PARTIAL = "partly reproduced"


@dataclasses.dataclass
class Claim:
  method: str
  paper: str
  claim: str
  benchmark: str
  check: Callable[[dict[str, Any]], tuple[str, str]]


def _fadam_quality(d):
  r = d["minus_adamw_test_nll"]["fadam"]
  ok = r["mean"] - 2 * r["se"] <= 0
  return (
    REPRODUCED if ok else NOT_REPRODUCED,
    f"test NLL FAdam − AdamW = {r['mean']:+.4f} ± {r['se']:.4f} (se); "
    "reproduced if ≤ 0 within 2 se",
  )


def _fadam_speed(d):
  t = d["timings"]
  ratio = t["fisher_optax.fadam"]["ratio"] / t["optax.adamw"]["ratio"]
  return (
    REPRODUCED if ratio <= 1.25 else NOT_REPRODUCED,
    f"step time FAdam / AdamW = {ratio:.2f}× ({d['n_params']:,} "
    "params); reproduced if ≤ 1.25×",
  )


def _fismo_quality(d):
  r = d["results"]["digits"]
  f, a = r["fismo"]["test_loss"], r["adamw"]["test_loss"]
  mu = r["muon"]["test_loss"]
  better = mean_std(f)[0] < min(mean_std(a)[0], mean_std(mu)[0])
  return (
    REPRODUCED if better else NOT_REPRODUCED,
    f"digits test loss FISMO {fmt(f)}, AdamW {fmt(a)}, Muon {fmt(mu)}; "
    "reproduced if FISMO's mean is lowest",
  )


def _fismo_charlm(d):
  r = d["results"]["charlm"]
  f, a = r["fismo"]["val_loss"], r["adamw"]["val_loss"]
  mu = r["muon"]["val_loss"]
  better = mean_std(f)[0] < min(mean_std(a)[0], mean_std(mu)[0])
  return (
    REPRODUCED if better else NOT_REPRODUCED,
    f"char-LM val loss FISMO {fmt(f)}, AdamW {fmt(a)}, Muon {fmt(mu)}",
  )


def _fismo_speed(d):
  k10 = d["amortised_ratio"]["eigh_k10"]
  best = min(v for k, v in d["amortised_ratio"].items() if k.endswith("k10"))
  return (
    REPRODUCED if best <= 1.5 else NOT_REPRODUCED,
    f"step time / Muon at refresh every 10 steps: eigh {k10:.2f}×, best "
    f"root method {best:.2f}×; reproduced if ≤ 1.5×",
  )


def _ng_quality(d):
  last = max(d["paired_galore_minus_ng"], key=int)
  r = d["paired_galore_minus_ng"][last]
  sweep = d["sweep"]
  best = {k: min(v.values()) for k, v in sweep.items()}
  ok = r["mean"] - 2 * r["se"] > 0
  return (
    REPRODUCED if ok else NOT_REPRODUCED,
    f"val loss GaLore − Natural GaLore at step {last} = "
    f"{r['mean']:+.4f} ± {r['se']:.4f} (se); best-lr val loss "
    + ", ".join(f"{k} {v:.3f}" for k, v in best.items())
    + "; reproduced if > 0 by 2 se",
  )


def _ng_memory(d):
  by = {}
  for r in d["memory"]:
    by.setdefault(r["config"], {})[r["optimizer"]] = r["state_bytes"]
  ratios = {}
  for cfg, v in by.items():
    ng = [b for k, b in v.items() if "natural" in k]
    if "adamw" in v and ng:
      ratios[cfg] = ng[0] / v["adamw"]
  if not ratios:
    raise KeyError("no config with both adamw and natural_galore")
  wins = sum(r < 1 for r in ratios.values())
  verdict = (
    REPRODUCED if wins == len(ratios) else PARTIAL if wins else NOT_REPRODUCED
  )
  return verdict, (
    "optimizer state Natural GaLore / AdamW: "
    + "; ".join(f"{r:.2f} ({c})" for c, r in ratios.items())
  )


def _mfac(d):
  s = d["slopes_d"]["mfac"]
  sm = d["slopes_m"]["mfac"]
  ok = s <= 1.2 and sm <= 1.2
  return (
    REPRODUCED if ok else NOT_REPRODUCED,
    f"log-log slope of step time vs d = {s:.2f}, vs m = {sm:.2f}; "
    "reproduced if both ≤ 1.2 (linear in d and m)",
  )


def _merging(d):
  parts, wins = [], 0
  for shift, s in d["e1_summary"].items():
    m, sd = s["fisher_minus_average"]
    wins += m > 0
    parts.append(f"{shift}: {m:+.3f} ± {sd:.3f}")
  n = len(d["e1_summary"])
  verdict = REPRODUCED if wins == n else PARTIAL if wins else NOT_REPRODUCED
  return verdict, (
    "accuracy Fisher merge − tuned average: "
    + "; ".join(parts)
    + f" ({wins}/{n} shifts positive)"
  )


def _obs(d):
  acc = d["accuracy"]
  rows, wins = [], 0
  for key in acc:
    if not key.startswith("magnitude@"):
      continue
    sp = key.split("@")[1]
    obs = [k for k in acc if k.startswith("obs") and k.endswith(f"@{sp}")]
    best = max(obs, key=lambda k: mean_std(acc[k])[0])
    wins += mean_std(acc[best])[0] > mean_std(acc[key])[0]
    rows.append(f"{sp}: {best} {fmt(acc[best])} vs magnitude {fmt(acc[key])}")
  n = len(rows)
  return (
    REPRODUCED if wins == n else PARTIAL if wins else NOT_REPRODUCED,
    "; ".join(rows),
  )


def _continual(first, second, what):
  def check(d):
    m = d["methods"]
    a, b = m[first]["fgt"], m[second]["fgt"]
    ok = mean_std(a)[0] < mean_std(b)[0]
    return (
      REPRODUCED if ok else NOT_REPRODUCED,
      f"forgetting {first} {fmt(a)} vs {second} {fmt(b)}; {what}",
    )

  return check


CLAIMS = [
  Claim(
    "FAdam",
    "Hwang 2024",
    "matches or beats AdamW",
    "fadam_quality",
    _fadam_quality,
  ),
  Claim(
    "FAdam",
    "Hwang 2024",
    "costs about as much as Adam per step",
    "fadam_speed",
    _fadam_speed,
  ),
  Claim(
    "FISMO",
    "Xu et al 2026",
    "beats AdamW and Muon (digits MLP)",
    "fismo_quality",
    _fismo_quality,
  ),
  Claim(
    "FISMO",
    "Xu et al 2026",
    "beats AdamW and Muon (char LM)",
    "fismo_quality",
    _fismo_charlm,
  ),
  Claim(
    "FISMO",
    "Xu et al 2026",
    "overhead over Muon is modest when "
    "preconditioners are refreshed periodically",
    "fismo_speed",
    _fismo_speed,
  ),
  Claim(
    "Natural GaLore",
    "Das 2024",
    "lower loss than GaLore at equal memory",
    "natural_galore_quality",
    _ng_quality,
  ),
  Claim(
    "Natural GaLore",
    "Das 2024",
    "optimizer state smaller than AdamW's",
    "natural_galore_memory_speed",
    _ng_memory,
  ),
  Claim(
    "M-FAC",
    "Frantar et al 2021",
    "cost linear in dimension d and window m",
    "mfac_scaling",
    _mfac,
  ),
  Claim(
    "Fisher merging",
    "Matena & Raffel 2022",
    "beats tuned plain averaging",
    "merging",
    _merging,
  ),
  Claim(
    "OBS pruning",
    "Frantar et al 2021",
    "beats magnitude pruning without retraining",
    "obs_pruning",
    _obs,
  ),
  Claim(
    "EWC",
    "Kirkpatrick et al 2017",
    "diagonal EWC forgets less than fine-tuning",
    "continual",
    _continual("diag EWC, exact", "fine-tune", "reproduced if lower"),
  ),
  Claim(
    "Rank-1 EWC",
    "Wang et al 2025",
    "rank-1 (c*) forgets no more than diagonal EWC",
    "continual",
    _continual(
      "rank-1 EWC, mean, c*", "diag EWC, exact", "reproduced if lower"
    ),
  ),
  Claim(
    "PhysGuard",
    "Zhou et al 2026",
    "protected-subspace fine-tuning "
    "(paper settings) forgets less than fine-tuning",
    "continual",
    _continual(
      "protected subspace, after Adam (tau .9, true y; paper)",
      "fine-tune",
      "reproduced if lower",
    ),
  ),
]


def headline(results: dict[str, Result]) -> str:
  lines = [
    "| Method | Paper | Claim | Verdict at this scale | Evidence |",
    "|---|---|---|---|---|",
  ]
  for c in CLAIMS:
    r = results.get(c.benchmark) or load(c.benchmark)
    if r.data is None:
      verdict, evidence = "not run", f"no `results/{c.benchmark}.json`"
    else:
      try:
        verdict, evidence = c.check(r.data)
      except (
        KeyError,
        TypeError,
        ValueError,
        StopIteration,
        ZeroDivisionError,
      ) as e:
        verdict, evidence = (
          "results incomplete",
          (f"`{r.stem}.json` lacks {type(e).__name__}: {e}"),
        )
      if r.small:
        verdict += " (small run only)"
    lines.append(
      f"| {c.method} | {c.paper} | {c.claim} | {verdict} | "
      f"{evidence} ([{c.benchmark}](#{c.benchmark})) |"
    )
  return "\n".join(lines)


def section(r: Result, status: str | None) -> str:
  out = [f'<a id="{r.name}"></a>', f"## {r.name}", ""]
  out.append(
    f"Script: [`benchmarks/{r.name}.py`]({r.name}.py)"
    + (f"; this run: {status}" if status else "")
  )
  out.append("")
  if r.stem is None:
    out.append("**not run**: no results in `benchmarks/results/`.")
    return "\n".join(out)
  if r.small:
    out.append("*Only a `--small` smoke run exists: numbers are not evidence.*")
    out.append("")
  env = (r.data or {}).get("environment", {})
  if env:
    out.append(
      f"Measured {env.get('time_utc', '?')} on "
      f"{env.get('backend', '?')} ({env.get('cpu_count', '?')} CPU "
      f"cores), jax {env.get('jax', '?')}, optax "
      f"{env.get('optax', '?')}."
    )
    out.append("")
  out.append(r.markdown.strip() if r.markdown else "(no markdown table)")
  for png in sorted(RESULTS.glob(f"{r.stem}*.png")):
    out.append("")
    out.append(f"![{png.stem}](results/{png.name})")
  return "\n".join(out)


def write_report(statuses: dict[str, str], path: pathlib.Path) -> str:
  names = benchmark_names()
  results = {n: load(n) for n in names}
  table = headline(results)
  # README-ready copy of the headline table (the README quotes it).
  RESULTS.mkdir(parents=True, exist_ok=True)
  (RESULTS / "report_headline.md").write_text(
    table.replace("](#", "](benchmarks/REPORT.md#") + "\n"
  )
  parts = [
    "# fisher_optax: paper claims at small scale",
    "",
    "Generated by `python -m benchmarks.report` from "
    "`benchmarks/results/*.json`; do not edit by hand. Every number is a "
    "measurement on this repository's benchmarks (scikit-learn digits MLP, "
    "a small character-level transformer on `pydoc_data.topics`, synthetic "
    "shapes for speed), far smaller than the papers' settings. Verdicts are "
    "computed from the JSON by the rules stated in each row; a claim that "
    "did not reproduce here may still hold at the papers' scale. Timing "
    "ratios come from one process with interleaved rounds (medians) on a "
    "shared CPU.",
    "",
    "## Headline",
    "",
    table,
    "",
    "| Benchmark | Results used |",
    "|---|---|",
  ]
  for n in names:
    r = results[n]
    parts.append(
      f"| [{n}](#{n}) | "
      + (f"`results/{r.stem}.json`" if r.stem else "not run")
      + (f" ({statuses[n]})" if n in statuses else "")
      + " |"
    )
  parts.append("")
  for n in names:
    parts.append(section(results[n], statuses.get(n)))
    parts.append("")
  text = "\n".join(parts).rstrip() + "\n"
  path.write_text(text)
  return text


def main(argv: list[str]) -> None:
  del argv
  names = benchmark_names()
  unknown = sorted(set(FLAGS.only) - set(names))
  if unknown:
    raise app.UsageError(f"unknown benchmarks {unknown}; have {names}")
  statuses = {}
  if FLAGS.run:
    statuses = run_benchmarks(FLAGS.only or names, FLAGS.small, FLAGS.timeout)
  path = pathlib.Path(FLAGS.output) if FLAGS.output else HERE / "REPORT.md"
  write_report(statuses, path)
  print(f"[report] wrote {path}")


if __name__ == "__main__":
  # Accept the spelling ``--no-run`` too (absl's own is ``--norun``).
  app.run(
    main,
    argv=["--norun" if a in ("--no-run", "--no_run") else a for a in sys.argv],
  )
