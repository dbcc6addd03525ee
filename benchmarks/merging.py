# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Fisher merging benchmark: robust fine-tuning on digits, and throughput.

A 64-64-10 tanh MLP is trained
on clean digits (the base), then fine-tuned on a shifted domain (images
transposed, or rolled by 2 pixels). Base and fine-tune are merged with

* plain averaging, ``lam * base + (1 - lam) * finetuned``, and
* Fisher merging (:func:`fisher_optax.fisher_merge`, exact Fishers of each
  model on its own training data, floor 1e-6 on every Fisher),

with ``lam`` picked per method on validation from the 19-point grid
0.05, 0.10, ..., 0.95. The score is the mean of clean and shifted test
accuracy; both methods use the same models and grid.

Throughput: a two-model merge of ~100M float32 parameters, jitted, against
a jitted plain weighted average of the same trees (ratio of median times in
interleaved rounds, one process).

Run from the repository root::

  python -m benchmarks.merging            # full (a few minutes)
  python -m benchmarks.merging --small    # seconds-long smoke run

Writes ``benchmarks/results/merging.{json,md}`` (``merging_small`` for
``--small``).
"""

from __future__ import annotations

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import common
from examples.common import datasets
import fisher_optax
from fisher_optax import fisher

_SMALL = flags.DEFINE_bool("small", False, "seconds-long smoke run")
_SEEDS = flags.DEFINE_integer("seeds", 5, "number of seeds for E1")
_BASE_STEPS = flags.DEFINE_integer("base_steps", 2000, "base training steps")
_FT_STEPS = flags.DEFINE_integer("ft_steps", 600, "fine-tuning steps")
_PARAMS_M = flags.DEFINE_float(
  "throughput_params_m", 100.0, "millions of parameters for throughput"
)
_ROUNDS = flags.DEFINE_integer("rounds", 9, "timing rounds")
_OUT_NAME = flags.DEFINE_string(
  "out_name", None, "results file stem (default merging / merging_small)"
)
_SKIP_THROUGHPUT = flags.DEFINE_bool(
  "skip_throughput", False, "run E1 only (e.g. for a sensitivity run)"
)

SHIFTS = ("transpose", "roll2")
GRID = np.round(np.linspace(0.05, 0.95, 19), 2)


def shift(x: np.ndarray, kind: str) -> np.ndarray:
  img = x.reshape(-1, 8, 8)
  if kind == "transpose":
    img = np.transpose(img, (0, 2, 1))
  elif kind == "roll2":
    img = np.roll(img, 2, axis=2)
  else:
    raise ValueError(kind)
  return img.reshape(-1, 64)


def train(apply_fn, params, x, y, steps, lr, seed):
  tx = optax.adam(lr)
  step = common.make_train_step(apply_fn, tx)
  opt_state = tx.init(params)
  batches = common.minibatches(x, y, 64, seed)
  for _ in range(steps):
    params, opt_state, _ = step(params, opt_state, next(batches))
  return params


def run_e1(seed: int, kind: str, base_steps: int, ft_steps: int):
  data = datasets.load_digits(seed=seed, standardize=False)
  (xtr, ytr), (xva, yva), (xte, yte) = data["train"], data["val"], data["test"]
  apply_fn, init = common.digits_mlp(
    seed, sizes=(64, 64, 10), activation="tanh"
  )
  base = train(apply_fn, init, xtr, ytr, base_steps, 3e-3, seed)
  xtr_s = shift(xtr, kind)
  finetuned = train(apply_fn, base, xtr_s, ytr, ft_steps, 1e-3, seed + 1)

  def fisher_of(params, x):
    return fisher.diagonal(
      apply_fn,
      params,
      (jnp.asarray(x), None),
      likelihood=fisher.Categorical(),
      kind="exact",
    ).diag

  fishers = [fisher_of(base, xtr), fisher_of(finetuned, xtr_s)]
  acc = jax.jit(lambda p, x, y: common.accuracy(apply_fn(p, x), y))

  def score(params, x, y):
    return 0.5 * (
      float(acc(params, x, y)) + float(acc(params, shift(x, kind), y))
    )

  candidates = np.stack([GRID, 1.0 - GRID], axis=1)
  models = [base, finetuned]
  out = {
    "seed": seed,
    "shift": kind,
    "base": score(base, xte, yte),
    "finetuned": score(finetuned, xte, yte),
  }
  for name, f in (("average", None), ("fisher", fishers)):
    search = fisher_optax.search_merge_weights(
      lambda p: score(p, xva, yva), models, f, candidates=candidates
    )
    best = fisher_optax.fisher_merge(models, f, search.best_weights)
    half = fisher_optax.fisher_merge(models, f, np.array([0.5, 0.5]))
    out[name] = score(best, xte, yte)
    out[f"{name}_lam"] = float(search.best_weights[0])
    out[f"{name}_half"] = score(half, xte, yte)
  return out


def run_throughput(params_m: float, rounds: int):
  n_leaves = 10
  per_leaf = int(params_m * 1e6) // n_leaves
  rows = 1024
  shape = (rows, max(1, per_leaf // rows))
  keys = iter(jax.random.split(jax.random.key(0), 4 * n_leaves))

  def tree(scale=1.0):
    return {
      f"w{i}": scale * jax.random.normal(next(keys), shape)
      for i in range(n_leaves)
    }

  models = [tree(), tree()]
  fishers = [jax.tree.map(jnp.abs, tree()), jax.tree.map(jnp.abs, tree())]
  weights = jnp.array([0.4, 0.6])
  n_params = sum(x.size for x in jax.tree.leaves(models[0]))

  plain = jax.jit(
    lambda ms, w: jax.tree.map(lambda a, b: w[0] * a + w[1] * b, *ms)
  )
  fmerge = jax.jit(lambda ms, fs, w: fisher_optax.fisher_merge(ms, fs, w))
  iso = jax.jit(lambda ms, w: fisher_optax.fisher_merge(ms, None, w))
  acc = fisher_optax.fisher_merge_accumulator()
  init, add = jax.jit(acc.init), jax.jit(acc.add, donate_argnums=0)

  def streaming():
    state = init(models[0], fishers[0], weights[0])
    state = add(state, models[1], fishers[1], weights[1])
    return acc.finalize(state)

  fns = {
    "plain_average": lambda: plain(models, weights),
    "fisher_merge": lambda: fmerge(models, fishers, weights),
    "fisher_merge_fishers_none": lambda: iso(models, weights),
    "accumulator_streaming": streaming,
  }
  timing = common.time_ratios(
    fns, "plain_average", rounds=rounds, inner=1, warmup=1
  )
  return {"params": n_params, "timing": timing}


def main(argv):
  del argv
  small = _SMALL.value
  seeds = 1 if small else _SEEDS.value
  base_steps = 200 if small else _BASE_STEPS.value
  ft_steps = 60 if small else _FT_STEPS.value
  params_m = 1.0 if small else _PARAMS_M.value
  rounds = 3 if small else _ROUNDS.value

  e1 = []
  for kind in SHIFTS:
    for seed in range(seeds):
      r = run_e1(seed, kind, base_steps, ft_steps)
      print(r, flush=True)
      e1.append(r)
  thr = None if _SKIP_THROUGHPUT.value else run_throughput(params_m, rounds)
  print(thr, flush=True)

  cols = (
    "base",
    "finetuned",
    "average_half",
    "fisher_half",
    "average",
    "fisher",
  )
  rows = []
  summary = {}
  for kind in SHIFTS:
    rs = [r for r in e1 if r["shift"] == kind]
    summary[kind] = {c: common.mean_std([r[c] for r in rs]) for c in cols}
    diff = common.paired_difference(
      [r["fisher"] for r in rs], [r["average"] for r in rs]
    )
    summary[kind]["fisher_minus_average"] = diff
    rows.append(
      [kind, len(rs)]
      + [common.fmt_mean_std([r[c] for r in rs], 3) for c in cols]
      + [f"{diff[0]:+.3f} ± {diff[1]:.3f}"]
    )
  header = (
    "shift",
    "seeds",
    "base",
    "fine-tuned",
    "average (λ=0.5)",
    "Fisher (λ=0.5)",
    "average (tuned λ)",
    "Fisher (tuned λ)",
    "Fisher − average (paired, ± s.e.)",
  )
  md_lines = [
    "### Fisher merging (E1: robust fine-tuning on digits)",
    "",
    "Mean of clean and shifted test accuracy (mean ± std over seeds) of a "
    "64-64-10 tanh MLP trained on clean digits and fine-tuned on a shifted "
    "domain, merged with its base; λ is the base's weight, tuned on "
    "validation over 0.05..0.95 (19 points). Exact Fishers on each model's "
    f"own training data, floor 1e-6; {base_steps} base and {ft_steps} "
    "fine-tuning Adam steps.",
    "",
    common.markdown_table(header, rows),
  ]
  if thr is not None:
    thr_rows = [
      [name, f"{v['ratio']:.2f}×", f"{v['median_s'] * 1e3:.0f} ms"]
      for name, v in thr["timing"].items()
    ]
    md_lines += [
      "",
      f"Merge throughput, two models of {thr['params'] / 1e6:.0f}M float32 "
      "parameters on CPU (ratio of median times to a jitted plain weighted "
      "average, interleaved rounds in one process):",
      "",
      common.markdown_table(("merge", "time ratio", "median time"), thr_rows),
    ]
  md = "\n".join(md_lines)
  name = _OUT_NAME.value or ("merging_small" if small else "merging")
  path = common.write_results(
    name,
    {
      "settings": {
        "seeds": seeds,
        "base_steps": base_steps,
        "ft_steps": ft_steps,
        "grid": GRID.tolist(),
        "rounds": rounds,
      },
      "e1": e1,
      "e1_summary": summary,
      "throughput": thr,
    },
    md,
  )
  print(md)
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
