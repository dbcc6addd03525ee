# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Loss per second: each fisher_optax optimizer vs its optax baseline on an LM.

A standard decoder-only transformer built from Flax NNX's own layers
(``nnx.Embed``, learned positions, pre-``nnx.LayerNorm`` blocks with
``nnx.MultiHeadAttention`` under a causal mask and a GELU MLP, final
LayerNorm, a linear head) learns byte-level text (vocab 256): the
concatenation of a sorted, deterministic list of CPython's own standard
library ``.py`` sources, split into train / validation / test as three
contiguous blocks (90/5/5).

Pairs, each at equal budgets (steps, lr grid size, seeds, data order):

* ``fisher_optax.fadam`` vs ``optax.adamw`` (both without weight decay);
* ``fisher_optax.fismo`` vs ``optax.contrib.muon``: only the hidden matrices
  (attention q/k/v/out kernels, MLP kernels) go to FISMO/Muon, through
  dimension numbers that view the 3-D attention kernels ``(d, heads,
  head_dim)`` as ``d x (heads*head_dim)`` and ``(heads, head_dim, d)`` as
  ``(heads*head_dim) x d``; embeddings, positions, head, norms and biases take
  Adam at AdamW's chosen lr. FISMO tunes on Muon's grid (it keeps Muon's
  step norm). ``--pairs ...,fismo_other_grafting`` adds FISMO with the
  grafting its default does not use (the evidence for that default);
* ``fisher_optax.natural_galore`` vs ``optax.contrib.galore``: the same hidden
  matrices projected at the same rank with the same dimension numbers;
* ``fisher_optax.mfac`` vs ``optax.adam``: M-FAC on the hidden matrices (it
  flattens every leaf into one parameter vector, so 3-D kernels need
  nothing), Adam at AdamW's lr on the rest (the README's recipe).

Protocol: each optimizer's lr is the best validation loss of a small grid
after ``--tune_steps`` on tuning seed 0; then ``--seeds`` paired seeds (shared
init and data order) at that lr, with validation loss every ``--eval_every``
steps. Wall-clock comes from a separate timing phase: each optimizer's whole
jitted train step (forward, backward, update; params and state donated) is
timed in interleaved rounds in one process (``common.time_ratios``) and the
median seconds per step converts steps to seconds. Loss at equal time uses,
per pair, the shorter of the two arms' total training times and interpolates
each curve there.

Run from the repository root::

  python -m benchmarks.lm_wallclock --small    # seconds (CI)
  python -m benchmarks.lm_wallclock --medium   # minutes
  python -m benchmarks.lm_wallclock            # full (5.7M params, < 1 h)
  # Train some optimizers again, reusing the stored runs of the others:
  python -m benchmarks.lm_wallclock --rerun fismo --pairs fadam,fismo
"""

from __future__ import annotations

import glob
import inspect
import json
import math
import os
import pathlib
import time
from typing import Any

from absl import app
from absl import flags
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import common
from benchmarks import floors
from examples.common import datasets
from examples.common import models
import fisher_optax
from fisher_optax import _matrix_view

_SMALL = flags.DEFINE_bool("small", False, "A seconds-long smoke run (CI).")
_MEDIUM = flags.DEFINE_bool(
  "medium", False, "A reduced config that runs in minutes on 2 CPU cores."
)
_OUT_DIR = flags.DEFINE_string(
  "out_dir", None, "Output folder (default benchmarks/results)."
)
_SEEDS = flags.DEFINE_integer("seeds", None, "Paired seeds (override).")
_STEPS = flags.DEFINE_integer("steps", None, "Training steps (override).")
_TUNE_STEPS = flags.DEFINE_integer("tune_steps", None, "Sweep steps.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", None, "Evaluation period.")
_RETIME = flags.DEFINE_bool(
  "retime",
  False,
  "Only the timing phase again: the stored run's lrs, curves and test "
  "losses (same config) with new step times, tables rewritten.",
)
_PAIRS = flags.DEFINE_list(
  "pairs", ["fadam", "fismo", "natural_galore", "mfac"], "Pairs to run."
)
_RERUN = flags.DEFINE_list(
  "rerun",
  [],
  "Optimizers to sweep and train again; every other optimizer's lrs, "
  "curves and test losses are the stored run's (same config). All are "
  "timed again.",
)

# Configurations: model, data and budgets.
CONFIGS = {
  "small": dict(
    d=32, heads=2, layers=1, context=32, batch=8, files=20, steps=20,
    tune_steps=10, eval_every=10, seeds=1, grid_points=1, val_windows=16,
    time_rounds=3,
  ),
  "medium": dict(
    d=96, heads=4, layers=2, context=64, batch=16, files=150, steps=300,
    tune_steps=100, eval_every=50, seeds=3, grid_points=2, val_windows=64,
    time_rounds=7,
  ),
  "full": dict(
    d=256, heads=4, layers=7, context=64, batch=8, files=600, steps=400,
    tune_steps=100, eval_every=50, seeds=3, grid_points=4, val_windows=128,
    time_rounds=9,
  ),
}  # fmt: skip

# Optimizers whose runs are another's: optax.adam is optax.adamw at
# weight_decay=0 (how AdamW runs here), same grid, so its training curves are
# AdamW's. Each is still timed on its own.
SAME_RUNS = {"adam": "adamw"}

# (method, baseline) pairs, keyed by the fisher_optax method.
PAIRS = {
  "fadam": ("fadam", "adamw"),
  "fismo": ("fismo", "muon"),
  # Not run by default: FISMO with the other grafting choice than its
  # default's (the evidence for that default).
  "fismo_other_grafting": ("fismo_other_grafting", "muon"),
  "natural_galore": ("natural_galore", "galore"),
  "mfac": ("mfac", "adam"),
}
# lr grids centred on the README's "Choosing hyperparameters" values; the
# 2-point (medium) grid takes the first two, the 1-point (small) the second,
# the full config all four (the fourth extends the grid downwards: on the
# 5.7M model AdamW's best of the first three sat at the lower edge).
GRIDS = {
  "adamw": (1e-3, 3e-3, 1e-2, 3e-4),
  "adam": (1e-3, 3e-3, 1e-2, 3e-4),
  "fadam": (1e-3, 3e-3, 1e-2, 3e-4),
  "muon": (1e-2, 3e-2, 3e-3, 1e-3),
  # FISMO is documented to take Muon's learning rates: Muon's grid.
  "fismo": (1e-2, 3e-2, 3e-3, 1e-3),
  "fismo_other_grafting": (1e-2, 3e-2, 3e-3, 1e-3),
  "galore": (3e-3, 1e-2, 3e-2, 1e-3),
  "natural_galore": (3e-3, 1e-2, 3e-2, 1e-3),
  # Centred one step higher than at first: the best was the grid's top (0.1).
  "mfac": (3e-2, 1e-1, 3e-1, 1e-2),
}


def grid(name: str, points: int) -> tuple[float, ...]:
  g = GRIDS[name]
  return (g[1],) if points == 1 else g[:points]


# -- model -------------------------------------------------------------------


def _model(cfg: dict[str, Any], seed: int) -> models.CharTransformer:
  return models.CharTransformer(
    256,
    d=cfg["d"],
    heads=cfg["heads"],
    layers=cfg["layers"],
    ffn=4 * cfg["d"],
    context=cfg["context"],
    rngs=nnx.Rngs(seed),
  )


def transformer_lm(seed: int, cfg: dict[str, Any]):
  """``(apply_fn, params)`` of the benchmark's model for a config."""
  return models.functional(_model(cfg, seed))


def count_params(cfg: dict[str, Any]) -> int:
  """Parameter count of a config's model, without allocating it."""
  model = nnx.eval_shape(lambda: _model(cfg, 0))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model)))


def estimate_minutes(
  s_per_step: dict[str, float], cfg: dict[str, Any], n_params: int, to: dict
) -> float:
  """Minutes of ``to``'s training steps, scaled from measured steps by FLOPs.

  Crude: assumes step time proportional to parameters x tokens per step
  (ignores compile time, evaluation and the optimizers' non-linear costs).
  """
  flops = lambda c, n: n * c["batch"] * c["context"]
  scale = flops(to, count_params(to)) / flops(cfg, n_params)
  steps = to["steps"] * to["seeds"] + to["tune_steps"] * to["grid_points"]
  return scale * steps * sum(s_per_step.values()) / 60


def step_floors(
  names: list[str], params: Any, loss: Any, x: Any, y: Any, cfg: dict
) -> dict[str, float]:
  """Each optimizer's train-step flops over AdamW's: the floor of its time.

  The batch gradient's flops come from XLA's cost analysis of the compiled
  gradient; the optimizers' matrix products from ``benchmarks/floors.py`` on
  the hidden matrices they take (as routed by :func:`make_tx`). Elementwise
  updates (Adam's, FAdam's) and periodic refreshes (FISMO's roots, GaLore's
  SVD) are not counted, so Adam's and FAdam's floor is 1.
  """
  compiled = jax.jit(jax.value_and_grad(loss)).lower(params, x, y).compile()
  analysis = compiled.cost_analysis()
  if not analysis or "flops" not in analysis:
    raise RuntimeError(f"no flop count from XLA on {jax.default_backend()}")
  grad = float(analysis["flops"])
  rank = max(4, cfg["d"] // 8)
  # The matrices as the optimizers view them (the same dimension numbers).
  dims = models.hidden_dims(params, optax.contrib.MuonDimensionNumbers)
  mats = [
    view.matrix_shape
    for view in _matrix_view.plans(dims, params)
    if view is not None
  ]
  muon = sum(floors.newton_schulz(m) for m in mats)
  galore = sum(floors.galore(m, rank) for m in mats)
  extra = {
    "muon": muon,
    "fismo": muon + sum(floors.fismo_extra(m) for m in mats),
    "galore": galore,
    "natural_galore": galore
    + sum(floors.natural_galore_window(m, rank, 8) for m in mats),
    "mfac": sum(floors.mfac(math.prod(m), 32) for m in mats),
  }
  extra["fismo_other_grafting"] = extra["fismo"]
  return {n: (grad + extra.get(n, 0)) / grad for n in names}


# -- data --------------------------------------------------------------------


def stdlib_bytes(files: int) -> tuple[np.ndarray, list[str]]:
  """Bytes of the first ``files`` stdlib ``.py`` sources, sorted by path."""
  root = pathlib.Path(os.path.dirname(os.__file__))
  paths = sorted(
    p
    for p in glob.glob(str(root / "**" / "*.py"), recursive=True)
    if "site-packages" not in p and "dist-packages" not in p
  )[:files]
  data = b"\n".join(pathlib.Path(p).read_bytes() for p in paths)
  rel = [os.path.relpath(p, root) for p in paths]
  return np.frombuffer(data, np.uint8).astype(np.int32), rel


def split(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Contiguous 90/5/5 train / validation / test blocks."""
  a, b = int(0.9 * len(ids)), int(0.95 * len(ids))
  return ids[:a], ids[a:b], ids[b:]


# -- optimizers --------------------------------------------------------------


def make_tx(
  name: str, params: Any, adam_lr: float, cfg: dict[str, Any]
) -> optax.GradientTransformation:
  """``name``'s optimizer with an injected (traced) learning rate."""
  rank = max(4, cfg["d"] // 8)
  if name == "adamw":
    return optax.inject_hyperparams(optax.adamw)(1e-3, weight_decay=0.0)
  if name == "adam":
    return optax.inject_hyperparams(optax.adam)(1e-3)
  if name == "fadam":
    return optax.inject_hyperparams(fisher_optax.fadam)(1e-3, weight_decay=0.0)
  if name in ("muon", "fismo", "fismo_other_grafting"):
    dims = models.hidden_dims(params, optax.contrib.MuonDimensionNumbers)
    if name == "muon":
      return optax.inject_hyperparams(
        optax.contrib.muon, static_args=("ns_steps", "nesterov")
      )(
        1e-2,
        nesterov=True,
        adam_learning_rate=adam_lr,
        muon_weight_dimension_numbers=dims,
      )
    kw = {}
    if name == "fismo_other_grafting":
      default = inspect.signature(fisher_optax.fismo).parameters["grafting"]
      kw["grafting"] = "none" if default.default == "muon_norm" else "muon_norm"
    return optax.inject_hyperparams(
      fisher_optax.fismo,
      static_args=(
        "ns_steps",
        "max_precond_dim",
        "max_aspect_ratio",
        "grafting",
      ),
    )(
      1e-3,
      adam_learning_rate=adam_lr,
      fismo_weight_dimension_numbers=dims,
      **kw,
    )
  if name in ("galore", "natural_galore"):
    dims = models.hidden_dims(params, optax.contrib.GaLoreDimensionNumbers)
    kw = dict(
      rank=rank, update_proj_gap=100, scale=1.0, weight_dimension_numbers=dims
    )
    static = ("rank", "update_proj_gap", "weight_dimension_numbers")
    if name == "galore":
      return optax.inject_hyperparams(optax.contrib.galore, static_args=static)(
        1e-2, **kw
      )
    return optax.inject_hyperparams(
      fisher_optax.natural_galore,
      static_args=static + ("history_size", "svd_power_iterations"),
    )(1e-2, history_size=8, damping=1e-3, **kw)
  if name == "mfac":
    labels = jax.tree.map(
      lambda a: "adam" if a is None else "mfac",
      models.hidden_axes(params),
      is_leaf=lambda a: a is None or isinstance(a, tuple),
    )

    def mfac_hidden(learning_rate):
      return optax.multi_transform(
        {
          "mfac": fisher_optax.mfac(
            learning_rate, window_size=32, damping=1e-2
          ),
          "adam": optax.adam(adam_lr),
        },
        labels,
      )

    return optax.inject_hyperparams(mfac_hidden)(3e-2)
  raise ValueError(f"unknown optimizer {name!r}")


# -- training ----------------------------------------------------------------


class Trainer:
  """One compiled, donated train step per optimizer, for training and timing.

  Training runs the same jitted step as the timing phase, one call per step
  (a scan would compile a second program per optimizer).
  """

  def __init__(self, tx, loss, val):
    self.tx, self.loss, self.val = tx, loss, val

    def step(p, s, x, y):
      value, g = jax.value_and_grad(loss)(p, x, y)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s, value

    self.step = jax.jit(step, donate_argnums=(0, 1))

  def init(self, params, lr):
    state = self.tx.init(params)
    state.hyperparams["learning_rate"] = jnp.asarray(
      lr, state.hyperparams["learning_rate"].dtype
    )
    return state

  def train(self, params, lr, xs, ys, steps, every):
    """Validation loss at steps 0, every, 2 every, ..., steps; final params."""
    state = self.init(params, lr)
    curve = [float(self.loss(params, *self.val))]
    for i in range(steps):
      params, state, _ = self.step(params, state, xs[i], ys[i])
      if (i + 1) % every == 0:
        curve.append(float(self.loss(params, *self.val)))
    return curve, params


def _fmt(xs, digits: int = 3) -> str:
  return common.fmt_mean_se(xs, digits)


def _plot(curves, times, eval_steps, pairs, out: pathlib.Path, name: str):
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  for kind in ("steps", "time"):
    fig, axes = plt.subplots(
      1, len(pairs), figsize=(4 * len(pairs), 3.3), squeeze=False
    )
    for ax, key in zip(axes[0], pairs):
      for arm in PAIRS[key]:
        c = np.asarray(curves[arm], float)
        mean = c.mean(0)
        se = c.std(0, ddof=1) / math.sqrt(len(c)) if len(c) > 1 else 0 * mean
        x = np.asarray(eval_steps, float)
        if kind == "time":
          x = x * times[arm]
        ax.plot(x, mean, label=arm)
        ax.fill_between(x, mean - se, mean + se, alpha=0.2)
      ax.set_xlabel("step" if kind == "steps" else "seconds (timed step)")
      ax.set_ylabel("val loss (nats/byte)")
      ax.set_title(" vs ".join(PAIRS[key]))
      ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{name}_{kind}.png", dpi=100)
    plt.close(fig)


def main(argv: Any) -> None:
  del argv
  label = "small" if _SMALL.value else "medium" if _MEDIUM.value else "full"
  cfg = dict(CONFIGS[label])
  for key, flag in (
    ("seeds", _SEEDS),
    ("steps", _STEPS),
    ("tune_steps", _TUNE_STEPS),
    ("eval_every", _EVAL_EVERY),
  ):
    if flag.value is not None:
      cfg[key] = flag.value
  if cfg["steps"] % cfg["eval_every"] or cfg["tune_steps"] % cfg["eval_every"]:
    raise ValueError("steps and tune_steps must be multiples of eval_every.")
  pairs = [p for p in _PAIRS.value if p in PAIRS]
  out = pathlib.Path(_OUT_DIR.value) if _OUT_DIR.value else common.RESULTS_DIR
  out.mkdir(parents=True, exist_ok=True)
  t_start = time.perf_counter()

  ids, files = stdlib_bytes(cfg["files"])
  train_ids, val_ids, test_ids = split(ids)
  val = tuple(
    jnp.asarray(a)
    for a in datasets.char_eval_windows(
      val_ids, cfg["context"], cfg["val_windows"]
    )
  )
  test = tuple(
    jnp.asarray(a)
    for a in datasets.char_eval_windows(
      test_ids, cfg["context"], cfg["val_windows"]
    )
  )
  apply_fn, params0 = transformer_lm(0, cfg)
  n_params = sum(x.size for x in jax.tree.leaves(params0))
  print(
    f"config {label}: {n_params / 1e6:.2f}M params, {len(ids)} bytes from "
    f"{len(files)} stdlib files ({files[0]} .. {files[-1]})",
    flush=True,
  )

  def data(seed: int, n: int):
    batches = datasets.char_batches(
      train_ids, cfg["batch"], cfg["context"], seed=seed
    )
    xs, ys = zip(*(next(batches) for _ in range(n)))
    return jnp.asarray(np.stack(xs)), jnp.asarray(np.stack(ys))

  loss = jax.jit(
    lambda p, x, y: common.cross_entropy(apply_fn(p, x), y)
  )  # shared by all optimizers: compiled once
  names = [n for key in pairs for n in PAIRS[key]]
  # AdamW is tuned first: its lr is the Adam lr of the routed methods.
  order = ["adamw"] + [n for n in names if n != "adamw"]
  trainers: dict[str, Trainer] = {}
  sweep: dict[str, dict[float, float]] = {}
  best: dict[str, float] = {}
  stem = "lm_wallclock" + ("" if label != "small" else "_small")
  rerun = set(_RERUN.value)
  stored = (
    json.loads((out / f"{stem}.json").read_text())
    if _RETIME.value or rerun
    else None
  )
  if stored is not None and stored["config"]["n_params"] != n_params:
    raise ValueError("--retime and --rerun need the stored run's config.")
  if stored is None or rerun:
    xs, ys = data(0, cfg["tune_steps"])
  for name in order:
    adam_lr = best.get("adamw", 3e-3)
    trainers[name] = Trainer(make_tx(name, params0, adam_lr, cfg), loss, val)
    if stored is not None and name not in rerun:
      sweep[name] = {float(k): v for k, v in stored["sweep"][name].items()}
      best[name] = stored["best_lr"][name]
      continue
    if SAME_RUNS.get(name) in sweep:
      sweep[name] = dict(sweep[SAME_RUNS[name]])
      best[name] = best[SAME_RUNS[name]]
      continue
    sweep[name] = {}
    for lr in grid(name, cfg["grid_points"]):
      curve, _ = trainers[name].train(
        transformer_lm(0, cfg)[1],
        lr,
        xs,
        ys,
        cfg["tune_steps"],
        cfg["eval_every"],
      )
      sweep[name][lr] = curve[-1] if np.isfinite(curve[-1]) else float("inf")
      print(
        f"sweep {name} lr={lr:g}: {curve[-1]:.4f} "
        f"({time.perf_counter() - t_start:.0f} s)",
        flush=True,
      )
    best[name] = min(sweep[name], key=lambda lr, s=sweep[name]: s[lr])
  names = order if "adamw" in names else order[1:]

  # Timing phase: each whole jitted train step, donated, interleaved rounds.
  xb, yb = data(12345, 1)
  xb, yb = xb[0], yb[0]

  def timed(name):
    holder = [transformer_lm(0, cfg)[1]]
    holder.append(trainers[name].init(holder[0], best[name]))

    def call():
      holder[0], holder[1], value = trainers[name].step(
        holder[0], holder[1], xb, yb
      )
      return value

    return call

  timing = common.time_ratios(
    {n: timed(n) for n in names},
    baseline=names[0],
    rounds=cfg["time_rounds"],
    inner=2,
    warmup=2,
  )
  s_per_step = {n: timing[n]["median_s"] for n in names}
  floor = step_floors(names, transformer_lm(0, cfg)[1], loss, xb, yb, cfg)
  floor = {n: v / floor[names[0]] for n, v in floor.items()}  # as timed
  for n in names:
    print(f"timing {n}: {1e3 * s_per_step[n]:.1f} ms/step", flush=True)
  full = CONFIGS["full"]
  full_minutes = estimate_minutes(s_per_step, cfg, n_params, full)
  print(
    f"estimate: the full config ({count_params(full) / 1e6:.1f}M params) "
    f"needs ~{full_minutes:.0f} min of training steps on this machine "
    "(FLOP-scaled from the timing phase)",
    flush=True,
  )

  # Paired seeds at each optimizer's best lr.
  seeds = list(range(1, cfg["seeds"] + 1))
  curves: dict[str, list[list[float]]] = {n: [] for n in names}
  test_loss: dict[str, list[float]] = {n: [] for n in names}
  if stored is not None:
    for n in names:
      if n not in rerun:
        curves[n] = stored["val_curves"][n]
        test_loss[n] = stored["test_loss"][n]
  for seed in seeds if stored is None or rerun else []:
    xs, ys = data(seed, cfg["steps"])
    for name in names:
      if stored is not None and name not in rerun:
        continue
      if SAME_RUNS.get(name) in names:
        curves[name].append(curves[SAME_RUNS[name]][-1])
        test_loss[name].append(test_loss[SAME_RUNS[name]][-1])
        continue
      curve, params = trainers[name].train(
        transformer_lm(seed, cfg)[1],
        best[name],
        xs,
        ys,
        cfg["steps"],
        cfg["eval_every"],
      )
      curves[name].append(curve)
      test_loss[name].append(float(loss(params, *test)))
      print(f"seed {seed} {name}: val {curve[-1]:.4f}", flush=True)
  eval_steps = list(range(0, cfg["steps"] + 1, cfg["eval_every"]))
  elapsed = time.perf_counter() - t_start

  # Tables.
  marks = [s for s in eval_steps if s][-3:]
  rows_steps, rows_time, pair_data = [], [], {}
  for key in pairs:
    method, base = PAIRS[key]
    horizon = min(s_per_step[n] * cfg["steps"] for n in (method, base))
    pair_data[key] = {"equal_time_s": horizon}
    for name in (method, base):
      c = np.asarray(curves[name], float)
      at = [c[:, eval_steps.index(s)] for s in marks]
      t = np.asarray(eval_steps, float) * s_per_step[name]
      at_time = [float(np.interp(horizon, t, row)) for row in c]
      pair_data[key][name] = {"loss_at_equal_time": at_time}
      rows_steps.append(
        [key, name, f"{best[name]:g}"]
        + [_fmt(a) for a in at]
        + [_fmt(test_loss[name])]
      )
      rows_time.append(
        [
          key,
          name,
          f"{1e3 * s_per_step[name]:.1f}",
          f"{timing[name]['ratio']:.2f}",
          f"{floor[name]:.2f}",
          f"{horizon:.1f}",
          f"{horizon / s_per_step[name]:.0f}",
          _fmt(at_time),
        ]
      )
  table_steps = common.markdown_table(
    ["pair", "optimizer", "lr"]
    + [f"val loss @ step {s}" for s in marks]
    + [f"test loss @ step {cfg['steps']}"],
    rows_steps,
  )
  table_time = common.markdown_table(
    [
      "pair",
      "optimizer",
      "ms/step (timed)",
      f"time vs {names[0]}",
      "floor (flops)",
      "equal time (s)",
      "steps in it",
      "val loss at equal time",
    ],
    rows_time,
  )
  full_est = sum(s_per_step.values()) * (
    cfg["steps"] * len(seeds) + cfg["tune_steps"] * max(1, cfg["grid_points"])
  )
  notes = [
    f"Config `{label}`"
    + (
      " (with overrides)"
      if any(f.value is not None for f in (_SEEDS, _STEPS, _TUNE_STEPS))
      else ""
    )
    + f": {cfg}. {n_params / 1e6:.2f}M parameters; byte-level (vocab 256) "
    f"text of the first {len(files)} CPython stdlib `.py` files in sorted "
    f"path order ({len(ids)} bytes; 90/5/5 contiguous train/val/test).",
    "Model: `nnx.Embed` + learned positions, pre-`nnx.LayerNorm` blocks with "
    "causal `nnx.MultiHeadAttention` and a 4d GELU MLP, final LayerNorm, "
    "linear head.",
    "Routing: FISMO/Muon and Natural GaLore/GaLore take the hidden "
    "matrices (attention q/k/v kernels viewed as d x (heads*head_dim), the "
    "out kernel as (heads*head_dim) x d, MLP kernels) via dimension numbers; "
    f"GaLore rank {max(4, cfg['d'] // 8)}, T=100, Natural GaLore s=8, "
    "damping 1e-3. M-FAC (window 32, damping 1e-2) takes the same hidden "
    "matrices (it flattens every leaf, so 3-D kernels need nothing); "
    "everything else takes Adam at AdamW's chosen lr. AdamW and FAdam run "
    "without weight decay, so `optax.adam` is `optax.adamw` here: Adam's "
    "sweep and training curves are AdamW's runs (it is timed on its own).",
    "Each lr is the best validation loss of its grid "
    f"{ {n: grid(n, cfg['grid_points']) for n in names} } after "
    f"{cfg['tune_steps']} steps on tuning seed 0; then {len(seeds)} paired "
    "seeds (shared init and data order). Losses: nats/byte on "
    f"{len(val[0])} validation windows, mean ± standard error over seeds.",
    "Wall-clock: a separate timing phase times each optimizer's whole "
    "jitted train step (forward, backward, update; params and state "
    f"donated) in {cfg['time_rounds']} interleaved rounds in one process; "
    "the median s/step converts steps to seconds (training calls the same "
    "step but is not what is timed). Loss at equal time "
    "interpolates each seed's validation curve at the shorter of the "
    "pair's two total training times. Shared 2-core CPU: absolute ms are "
    "indicative, ratios more reliable. Floor: the step's matrix-product "
    f"flops over {names[0]}'s, the batch gradient's from XLA's cost "
    "analysis and the optimizer's on the hidden matrices it takes "
    "(`benchmarks/floors.py`); elementwise updates and the periodic "
    "refreshes (FISMO's roots, GaLore's SVD) are not counted."
    + (
      f" Sweeps and training runs of {', '.join(sorted(rerun))} made again "
      "with `--rerun` (the other optimizers' lrs and losses are the stored "
      "run's, same seeds and data); every step timed again."
      if rerun
      else " Step times re-measured with `--retime` (the training runs, lrs "
      "and losses are the stored run's)."
      if stored is not None
      else ""
    ),
  ]
  md = "\n\n".join(
    [
      "## Loss per second on a Flax transformer LM (byte-level stdlib text)",
      *notes,
      "### Loss at equal steps",
      table_steps,
      "### Loss at equal time",
      table_time,
      f"Total wall time {elapsed:.0f} s ({jax.default_backend()}). Estimated "
      f"steps-only cost of this config from the timing phase: "
      f"{full_est / 60:.1f} min; the full config "
      f"({count_params(CONFIGS['full']) / 1e6:.1f}M params), FLOP-scaled from "
      f"the same timings: ~{full_minutes:.0f} min.",
    ]
  )
  name = "lm_wallclock" + ("" if label != "small" else "_small")
  common.write_results(
    name,
    {
      "config": dict(cfg, label=label, n_params=n_params, files=len(files)),
      "pairs": {k: PAIRS[k] for k in pairs},
      "sweep": {n: {str(k): v for k, v in s.items()} for n, s in sweep.items()},
      "best_lr": best,
      "timing": timing,
      "floor_flops": floor,
      "eval_steps": eval_steps,
      "val_curves": curves,
      "test_loss": test_loss,
      "equal_time": pair_data,
    },
    md,
    out_dir=out,
  )
  _plot(curves, s_per_step, eval_steps, pairs, out, name)
  print(md)
  print(f"wrote {os.path.relpath(out / name)}.{{md,json}}")


if __name__ == "__main__":
  app.run(main)
