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

``--speed-only`` runs only the speed benchmarks (``SPEED``), each with
``--out_dir``, and writes one table of absolute median times, ratios to each
benchmark's baseline and the floors the benchmarks state (a benchmark may
store ``floors: {configuration: ratio}`` in its JSON), headed by the device
the run used: ``speed_<platform>.md`` and ``.json``. The benchmarks' own
results go to ``benchmarks/results/`` on CPU and ``benchmarks/results/
<platform>/`` on an accelerator, so a GPU or TPU run never overwrites the CPU
tables; with ``--small`` everything goes to a temporary folder (smoke numbers
are not results). ``--speed_out_dir`` chooses the folder.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import json
import math
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

from absl import app
from absl import flags
import numpy as np

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
flags.DEFINE_bool(
  "speed_only",
  False,
  "Run only the speed benchmarks; write speed_<platform>.md (one table).",
)
flags.DEFINE_string(
  "speed_out_dir",
  None,
  "Results folder for --speed-only (default: results/ on CPU, "
  "results/<platform>/ on an accelerator, a temporary folder with --small).",
)
FLAGS = flags.FLAGS

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
_NOT_BENCHMARKS = {"__init__", "common", "engine_models", "floors", "report"}


def benchmark_names() -> list[str]:
  return sorted(
    p.stem
    for p in HERE.glob("*.py")
    if p.stem not in _NOT_BENCHMARKS and not p.stem.startswith("_")
  )


def run_benchmarks(
  names: list[str],
  small: bool,
  timeout: int,
  out_dir: pathlib.Path | None = None,
) -> dict[str, str]:
  """Runs each benchmark as ``python -m benchmarks.<name>``; returns status."""
  status = {}
  for name in names:
    cmd = [sys.executable, "-m", f"benchmarks.{name}"]
    cmd += ["--small"] if small else []
    cmd += [f"--out_dir={out_dir}"] if out_dir else []
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
  # The seeds' mean at the last step, at each optimizer's chosen lr (the
  # tuning sweep's losses are from a shorter run).
  final = {
    k: sum(run[last] for run in runs) / len(runs)
    for k, runs in d["curves"].items()
  }
  ok = r["mean"] - 2 * r["se"] > 0
  return (
    REPRODUCED if ok else NOT_REPRODUCED,
    f"val loss GaLore − Natural GaLore at step {last} = "
    f"{r['mean']:+.4f} ± {r['se']:.4f} (se); mean val loss at step {last}: "
    + ", ".join(f"{k} {v:.3f}" for k, v in final.items())
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


# The optimizers that the loss-per-second benchmark trains against their
# baselines, by the method name used in CLAIMS.
_WALLCLOCK_PAIRS = {
  "FAdam": "fadam",
  "FISMO": "fismo",
  "Natural GaLore": "natural_galore",
  "M-FAC": "mfac",
}


def equal_time_cell(method: str, r: Result) -> str:
  """Validation loss of ``method`` minus its baseline's at equal wall-clock
  time on the transformer LM (``lm_wallclock``), paired over seeds."""
  key = _WALLCLOCK_PAIRS.get(method)
  if key is None:
    return "—"
  if r.data is None:
    return "not run"
  try:
    ours, base = r.data["pairs"][key]
    pair = r.data["equal_time"][key]
    a = np.asarray(pair[ours]["loss_at_equal_time"], float)
    b = np.asarray(pair[base]["loss_at_equal_time"], float)
  except (KeyError, TypeError, ValueError):
    return f"`{r.stem}.json` incomplete"
  diff = a - b
  se = float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else 0.0
  small = " (small run only)" if r.small else ""
  return (
    f"{ours} − {base}: {diff.mean():+.3f} ± {se:.3f} (n={len(diff)}, "
    f"{pair['equal_time_s']:.0f} s){small}"
  )


def headline(results: dict[str, Result]) -> str:
  lines = [
    "| Method | Paper | Claim | Verdict at this scale | Evidence "
    "| At equal wall-clock (LM val loss) |",
    "|---|---|---|---|---|---|",
  ]
  wallclock = results.get("lm_wallclock") or load("lm_wallclock")
  shown: set[str] = set()
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
    # Once per method, on its first claim.
    cell = "—" if c.method in shown else equal_time_cell(c.method, wallclock)
    shown.add(c.method)
    lines.append(
      f"| {c.method} | {c.paper} | {c.claim} | {verdict} | "
      f"{evidence} ([{c.benchmark}](#{c.benchmark})) | {cell} |"
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
    if png.stem.endswith("_small"):  # --small smoke runs: not tracked
      continue
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


# -- speed table (--speed-only) ---------------------------------------------


@dataclasses.dataclass
class SpeedRow:
  """One timed configuration against the baseline of its benchmark."""

  config: str
  median_s: float
  baseline: str
  baseline_s: float
  ratio: float
  floor: float | None = None


def _floor(d: dict[str, Any], name: str) -> float | None:
  return d.get("floors", {}).get(name)


def _timing_rows(
  d: dict[str, Any],
  timings: dict[str, dict[str, float]],
  baseline: str,
  label: Callable[[str], str],
  floors: dict[str, Any] | None = None,
) -> list[SpeedRow]:
  """Rows of a ``common.time_ratios`` result, the baseline's own left out."""
  base = timings[baseline]["median_s"]
  return [
    SpeedRow(
      label(name),
      t["median_s"],
      baseline,
      base,
      t["ratio"],
      (floors or {}).get(name, _floor(d, name)),
    )
    for name, t in timings.items()
    if name != baseline
  ]


def _fadam_speed_rows(d: dict[str, Any]) -> list[SpeedRow]:
  # Older results store only FAdam's floor.
  floors = d.get("floors") or {"fisher_optax.fadam": d.get("floor_ratio")}
  size = f"{d['n_params'] / 1e6:.1f}M params"
  return _timing_rows(
    d,
    d["timings"],
    "optax.adamw",
    lambda n: f"{n}, donated step, {size}",
    floors,
  ) + _timing_rows(
    d,
    d["plain_update_timings"],
    "optax.adamw",
    lambda n: f"{n}, plain jitted update, {size}",
    floors,
  )


def _physguard_speed_rows(d: dict[str, Any]) -> list[SpeedRow]:
  a, b = d["shape"]
  return _timing_rows(
    d,
    d["timings"],
    "optax.adamw",
    lambda n: f"{n}, donated step, {a}x{b} leaf, rank {d['rank']}",
    d["floors"],
  )


def _fismo_speed_rows(d: dict[str, Any]) -> list[SpeedRow]:
  shapes = ", ".join(f"{a}x{b}" for a, b in d["shapes"])
  return _timing_rows(d, d["timings"], "muon", lambda n: f"{n}, {shapes}")


def _mfac_floor(m: int) -> float:
  # The benchmark's floor, (2 m + 4) / 7 passes over d (mfac_scaling.py).
  return (2 * m + 4) / 7


def _mfac_rows(d: dict[str, Any]) -> list[SpeedRow]:
  rows, seen = [], set()
  for r in d["d_sweep"] + d["m_sweep"]:
    if (r["d"], r["m"]) in seen:
      continue
    seen.add((r["d"], r["m"]))
    rows.append(
      SpeedRow(
        f"scale_by_mfac step, d={r['d']}, m={r['m']}",
        r["mfac_median_s"],
        "optax.adam",
        r["adam_median_s"],
        r["mfac_ratio"],
        _mfac_floor(r["m"]),
      )
    )
  s = d["single_leaf"]
  rows.append(
    SpeedRow(
      f"mfac(window_size={s['m']}), one leaf d={s['d']}, donated",
      s["mfac_median_s"],
      "optax.adam",
      s["adam_median_s"],
      s["mfac_ratio"],
      s["floor_ratio"],
    )
  )
  return rows


def _natural_galore_rows(d: dict[str, Any]) -> list[SpeedRow]:
  sp = d["speed"]
  rows = []
  for phase, timings in sp["timings"].items():
    rows += _timing_rows(
      d,
      timings,
      "galore",
      lambda n, phase=phase: (
        f"{n}, {phase} step, rank {sp['rank']}, s={sp['history_size']}"
      ),
      # The flop floors are the steady step's; a refresh is an SVD.
      floors=sp.get("floors", {}) if phase == "steady" else {},
    )
  return rows


def _fisher_engine_rows(d: dict[str, Any]) -> list[SpeedRow]:
  # Memory-only rows (``--memory_only``, the large batches) have no times.
  base = {
    (r["model"], r["batch"]): r["median_s"]
    for r in d["rows"]
    if r["estimator"] == "batch gradient" and r.get("median_s") is not None
  }
  return [
    SpeedRow(
      f"{r['model']} B={r['batch']}: {r['estimator']}",
      r["median_s"],
      "batch gradient",
      base[r["model"], r["batch"]],
      r["ratio"],
      r.get("floor"),
    )
    for r in d["rows"]
    if r["estimator"] != "batch gradient"
    and r.get("ratio") is not None
    and (r["model"], r["batch"]) in base
  ]


# The benchmarks that time steps against a baseline, and how to read their
# JSON. Each accepts --small and --out_dir.
SPEED: dict[str, Callable[[dict[str, Any]], list[SpeedRow]]] = {
  "fadam_speed": _fadam_speed_rows,
  "fismo_speed": _fismo_speed_rows,
  "mfac_scaling": _mfac_rows,
  "natural_galore_memory_speed": _natural_galore_rows,
  "physguard_speed": _physguard_speed_rows,
  "fisher_engine": _fisher_engine_rows,
}


def probe_device() -> dict[str, Any]:
  """The device the benchmarks will use, asked in a child process.

  A child, so that this process never holds an accelerator the benchmarks
  need (JAX preallocates most of a GPU's memory).
  """
  code = (
    "import json, jax; d = jax.devices()[0]; print(json.dumps({"
    "'platform': d.platform, 'device_kind': d.device_kind, "
    "'device_count': jax.device_count(), 'jax': jax.__version__}))"
  )
  out = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  return json.loads(out.strip().splitlines()[-1])


def _load_json(
  out_dir: pathlib.Path, name: str, small: bool
) -> tuple[str, dict[str, Any] | None]:
  """``(file name, data)`` of a benchmark's results, ``data`` None if none."""
  for stem in (f"{name}_small", name) if small else (name,):
    path = out_dir / f"{stem}.json"
    if path.exists():
      return path.name, json.loads(path.read_text())
  return f"{name}.json", None


def _ms(s: float) -> str:
  return f"{1e3 * s:.3g}"


def speed_table(
  out_dir: pathlib.Path,
  device: dict[str, Any],
  statuses: dict[str, str],
  small: bool,
) -> tuple[str, dict[str, Any]]:
  """The combined markdown table and its JSON, from the benchmarks' JSON."""
  lines = [
    f"# Speed on {device['device_kind']} ({device['platform']}, "
    f"{device['device_count']} device(s)), jax {device['jax']}"
    + (" — `--small` smoke run, not results" if small else ""),
    "",
    "Generated by `python -m benchmarks.report --speed-only` from the speed "
    "benchmarks' JSON in `"
    + (
      str(out_dir.relative_to(HERE.parent))
      if out_dir.is_relative_to(HERE.parent)
      else str(out_dir)
    )
    + "`. Times are medians of interleaved rounds in one process; the ratio "
    "is the median of per-round ratios to the benchmark's baseline (so it "
    "need not equal the quotient of the two medians). The floor is the "
    "ratio the benchmark states as the least its method's work allows "
    "(passes over memory); — where it states none. Rows merged from "
    "several runs (`fisher_engine --merge`) keep the ratio to the baseline "
    "timed in their own run; the baseline column shows the last run's.",
    "",
    "| benchmark | configuration | median (ms) | baseline | baseline "
    "median (ms) | ratio | floor | backend | measured (UTC) |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  records = []
  for name, extract in SPEED.items():
    status = statuses.get(name, "")
    if status and not status.startswith("ok"):
      lines.append(f"| {name} | {status} | | | | | | | |")
      continue
    file, data = _load_json(out_dir, name, small)
    if data is None:
      lines.append(f"| {name} | not run (no results) | | | | | | | |")
      continue
    env = data.get("environment", {})
    try:
      rows = extract(data)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
      lines.append(
        f"| {name} | `{file}` lacks {type(e).__name__}: {e} | | | | | | | |"
      )
      continue
    for r in rows:
      floor = "—" if r.floor is None else f"{r.floor:.2f}x"
      lines.append(
        f"| {name} | {r.config} | {_ms(r.median_s)} | {r.baseline} | "
        f"{_ms(r.baseline_s)} | {r.ratio:.2f}x | {floor} | "
        f"{env.get('backend', '?')} | {env.get('time_utc', '?')} |"
      )
      records.append({"benchmark": name, **dataclasses.asdict(r)})
  return "\n".join(lines) + "\n", {
    "device": device,
    "small": small,
    "statuses": statuses,
    "rows": records,
  }


def run_speed(small: bool, run: bool, timeout: int) -> pathlib.Path:
  """``--speed-only``: runs the speed benchmarks, writes the one table."""
  device = probe_device()
  platform = device["platform"]
  if FLAGS.speed_out_dir:
    out_dir = pathlib.Path(FLAGS.speed_out_dir).resolve()
  elif small:
    out_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"speed_{platform}_"))
  else:
    out_dir = RESULTS if platform == "cpu" else RESULTS / platform
  # The table lands next to the CPU tables unless the results went elsewhere.
  table_dir = out_dir if FLAGS.speed_out_dir or small else RESULTS
  print(f"[report] device {device}; results in {out_dir}", flush=True)
  statuses = {}
  if run:
    statuses = run_benchmarks(list(SPEED), small, timeout, out_dir)
  text, data = speed_table(out_dir, device, statuses, small)
  stem = f"speed_{platform}" + ("_small" if small else "")
  table_dir.mkdir(parents=True, exist_ok=True)
  (table_dir / f"{stem}.md").write_text(text)
  (table_dir / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
  print(text)
  return table_dir / f"{stem}.md"


def main(argv: list[str]) -> None:
  del argv
  if FLAGS.speed_only:
    path = run_speed(FLAGS.small, FLAGS.run, FLAGS.timeout)
    print(f"[report] wrote {path}")
    return
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


def _absl_argv(argv: list[str]) -> list[str]:
  """Accepts ``--speed-only`` for ``--speed_only`` and ``--no-run``/``--no_run``
  for absl's ``--norun``."""
  out = []
  for a in argv:
    if a.startswith("--"):
      name, eq, value = a[2:].partition("=")
      a = "--" + name.replace("-", "_") + eq + value
    out.append("--norun" if a == "--no_run" else a)
  return out


if __name__ == "__main__":
  app.run(main, argv=_absl_argv(sys.argv))
