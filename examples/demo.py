# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""A tour of fisher_optax on scikit-learn's digits: ``python -m examples.demo``.

Run it from the repository root with the examples extra installed
(``pip install -e '.[examples]'``). In a minute or two on a laptop CPU it

1. trains the same MLP with AdamW and with the library's optimizers (FAdam,
   FISMO, Natural GaLore, M-FAC);
2. measures the Fisher of the trained model with the estimator engine: the
   kinds (empirical, Monte Carlo, exact) and structures (diagonal, top-k
   low rank, rank one), and how much of the Fisher each structure captures;
3. learns a second task (permuted pixels) with plain fine-tuning, diagonal
   EWC and rank-1 EWC, and reports how much of the first task survives;
4. merges the first-task and the fine-tuned model by Fisher merging and by
   plain averaging;
5. prunes 80% of the trained MLP's weights by OBS (M-FAC inverse Fisher)
   and by magnitude.

It prints one table per part and writes ``demo.png`` and ``demo.json`` to
``--out_dir``. ``--small`` runs a seconds-long version (used by the tests).
Each optimizer runs at the settings our benchmarks picked on digits (see
``benchmarks/REPORT.md`` and the README's "Choosing hyperparameters").
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import json
import pathlib
import time
from typing import Any

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fisher_optax
from fisher_optax import fisher

try:
  from examples.common import datasets
  from examples.common import models
except ImportError as _e:  # pragma: no cover - only without the extra
  raise ImportError(
    f"The demo needs the examples extra ({_e}): run "
    "`python -m pip install -e '.[examples]'` from the repository root."
  ) from _e

flags.DEFINE_integer("steps", 400, "Training steps per optimizer and task.")
flags.DEFINE_integer("batch_size", 64, "Mini-batch size.")
flags.DEFINE_integer("seed", 0, "Seed of the data split, inits and batches.")
flags.DEFINE_string("out_dir", "fisher_optax_demo", "Where plots and JSON go.")
flags.DEFINE_bool("small", False, "A seconds-long run (for tests).")
FLAGS = flags.FLAGS

PyTree = Any
_SIZES = (64, 128, 128, 10)
# M-FAC on the hidden kernels: window, damping and learning rate of a small
# sweep on the digits validation split.
_MFAC_WINDOW, _MFAC_DAMPING, _MFAC_LR = 32, 1e-2, 3e-2


def _progress(iterable, desc: str, total: int):
  try:
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover
    return iterable
  return tqdm(iterable, desc=desc, total=total, leave=False)


def _ce(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _train(
  apply_fn,
  params,
  tx,
  x,
  y,
  *,
  steps,
  batch_size,
  seed,
  desc,
  loss_extra: Callable[[PyTree], jax.Array] | None = None,
):
  """Trains with ``tx``.

  Returns:
    ``(params, losses, state, timing)`` with ``timing`` the seconds spent
    compiling the step (once) and the mean seconds per step after that.
  """

  def objective(p, xb, yb):
    value = _ce(apply_fn(p, xb), yb)
    return value + (loss_extra(p) if loss_extra else 0.0)

  @jax.jit
  def step(p, s, xb, yb):
    value, grads = jax.value_and_grad(objective)(p, xb, yb)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, value

  rng = np.random.default_rng(seed)
  state = tx.init(params)
  # Compiled ahead of time, so the table can tell compile from step time.
  t0 = time.perf_counter()
  compiled = step.lower(params, state, x[:batch_size], y[:batch_size]).compile()
  compile_s = time.perf_counter() - t0
  losses = []
  t0 = time.perf_counter()
  for _ in _progress(range(steps), desc, steps):
    idx = rng.integers(0, len(x), batch_size)
    params, state, value = compiled(params, state, x[idx], y[idx])
    losses.append(float(value))
  step_s = (time.perf_counter() - t0) / max(steps, 1)
  return params, np.asarray(losses), state, (compile_s, step_s)


# Evaluations and Fisher statistics are jitted: one compile per program,
# where op-by-op execution compiles every operation on its first call.
@functools.partial(jax.jit, static_argnums=0)
def _scores(apply_fn, params, x, y) -> tuple[jax.Array, jax.Array]:
  logits = apply_fn(params, x)
  return jnp.mean(jnp.argmax(logits, -1) == y), _ce(logits, y)


def _accuracy(apply_fn, params, x, y) -> float:
  return float(_scores(apply_fn, params, x, y)[0])


# -- 1. optimizers -----------------------------------------------------------


def _hidden(params: PyTree) -> PyTree:
  """True on the hidden layers' kernels; the output layer and biases: False.

  FISMO and M-FAC precondition these; the rest goes to Adam, as in
  ``optax.contrib.muon`` and in our benchmarks.
  """

  def pick(path, leaf):
    layer = path[1]  # params["layers"][i]
    index = getattr(layer, "key", getattr(layer, "idx", None))
    return leaf.ndim == 2 and index != len(_SIZES) - 2

  return jax.tree_util.tree_map_with_path(pick, params)


def optimizers() -> dict[str, optax.GradientTransformation]:
  """Each method at the settings our digits benchmarks picked."""
  not_hidden = lambda p: jax.tree.map(lambda m: not m, _hidden(p))
  fismo_dims = lambda p: jax.tree.map(
    lambda m: optax.contrib.MuonDimensionNumbers() if m else None,
    _hidden(p),
  )
  return {
    # AdamW and FAdam: best of a learning rate x weight decay grid.
    "AdamW (optax)": optax.adamw(3e-3, weight_decay=0.5),
    "FAdam": fisher_optax.fadam(3e-3, weight_decay=0.1),
    # FISMO: the hidden kernels at Muon's best digits lr, with the damping
    # small MLP classifiers want (10; language models want the default 1);
    # the output layer and biases take Adam at AdamW's lr. Over three seeds
    # of this demo it ties Muon (test NLL 0.064 against 0.066), where the
    # paper's unscaled step at damping 1 and lr 1e-3 gave 0.105.
    "FISMO": fisher_optax.fismo(
      3e-3,
      adam_learning_rate=3e-3,
      fismo_weight_dimension_numbers=fismo_dims,
      damping=10.0,
    ),
    # Natural GaLore: AdamW's lr with damping 1. Over three seeds of this
    # demo: test NLL 0.095 (GaLore 0.097); at damping 1e-2 0.103, at the
    # default 1e-3 0.131, and 0.41 at the default with the lr tripled.
    "Natural GaLore": fisher_optax.natural_galore(
      3e-3, rank=16, update_proj_gap=100, history_size=8, damping=1.0
    ),
    # M-FAC: an SGD-like step on the hidden kernels (its learning rate is
    # about 10x AdamW's), Adam on the rest.
    "M-FAC": optax.chain(
      optax.masked(
        optax.chain(
          fisher_optax.scale_by_mfac(
            window_size=_MFAC_WINDOW, damping=_MFAC_DAMPING
          ),
          optax.scale_by_learning_rate(_MFAC_LR),
        ),
        _hidden,
      ),
      optax.masked(optax.adam(3e-3), not_hidden),
    ),
  }


def part_optimizers(apply_fn, init, data, steps, batch_size, seed):
  (x, y), (xt, yt) = data["train"], data["test"]
  rows, curves, trained = [], {}, {}
  for name, tx in optimizers().items():
    params, losses, _, (compile_s, step_s) = _train(
      apply_fn,
      init,
      tx,
      x,
      y,
      steps=steps,
      batch_size=batch_size,
      seed=seed,
      desc=name,
    )
    curves[name] = losses
    trained[name] = params
    accuracy, nll = _scores(apply_fn, params, xt, yt)
    rows.append(
      {
        "optimizer": name,
        "test_accuracy": float(accuracy),
        "test_nll": float(nll),
        "final_train_loss": float(losses[-20:].mean()),
        "compile_s": compile_s,
        "ms_per_step": 1e3 * step_s,
      }
    )
  return rows, curves, trained


# -- 2. Fisher statistics ----------------------------------------------------


_KINDS = ("exact", "mc", "empirical", "batch_squared")


def part_fisher(apply_fn, params, data, seed, n_examples, rank):
  x, y = data["train"]
  batch = (x[:n_examples], y[:n_examples])
  cat = fisher.Categorical()
  flat = lambda t: jnp.concatenate([a.ravel() for a in jax.tree.leaves(t)])

  @jax.jit  # one program, not one compile per operation
  def statistics(params, batch):
    diags = {
      kind: fisher.diagonal(
        apply_fn,
        params,
        batch,
        likelihood=cat,
        kind=kind,
        num_samples=4,
        key=jax.random.key(seed),
      )
      for kind in _KINDS
    }
    top = fisher.low_rank(
      apply_fn, params, batch, likelihood=cat, kind="empirical", rank=rank
    )
    # Energies of the empirical Fisher F = G^T G / N, from its N x N Gram.
    pex = fisher.per_example_grads(
      lambda p, ex: _ce(apply_fn(p, ex[0][None]), ex[1][None]),
      params,
      batch,
      chunk_size=64,
    )
    g = jnp.concatenate(
      [a.reshape(a.shape[0], -1) for a in jax.tree.leaves(pex)], axis=1
    )
    spectrum = jnp.linalg.eigvalsh(g @ g.T / g.shape[0])[::-1]
    mean_dir = fisher.rank_one(
      apply_fn,
      params,
      batch,
      likelihood=cat,
      kind="empirical",
      direction="mean",
      scale="optimal",
    )
    return diags, top, spectrum, mean_dir

  diags, top, spectrum, mean_dir = statistics(params, batch)
  exact = flat(diags["exact"].diag)
  rel_err = {  # in _KINDS' order (jit returns a dict's keys sorted)
    k: float(
      jnp.linalg.norm(flat(diags[k].diag) - exact) / jnp.linalg.norm(exact)
    )
    for k in _KINDS
  }
  frob2 = float(jnp.sum(spectrum**2))
  diag_emp = flat(diags["empirical"].diag)
  v1 = flat(jax.tree.map(lambda v: v[0], top.eigvecs))
  mu = flat(mean_dir.eigvecs)
  summary = {
    "n_examples": int(n_examples),
    "n_params": int(exact.size),
    "relative_error_vs_exact_diagonal": rel_err,
    "trace": float(jnp.sum(spectrum)),
    "top_eigenvalues": [float(v) for v in top.eigvals],
    "energy_top_k": float(jnp.sum(top.eigvals**2) / frob2),
    "energy_diagonal": float(jnp.sum(diag_emp**2) / frob2),
    "top1_over_trace": float(spectrum[0] / jnp.sum(spectrum)),
    "cos_mean_grad_top_eigvec": float(jnp.abs(mu @ v1)),
  }
  return summary, np.asarray(spectrum)


# -- 3. continual learning and 4. merging -------------------------------------


def _permute(data, seed):
  perm = np.random.default_rng(seed + 1000).permutation(64)
  return {k: (x[:, perm], y) for k, (x, y) in data.items()}


@functools.partial(jax.jit, static_argnums=0)
def _exact_diagonal(apply_fn, params, batch) -> fisher.DiagonalFisher:
  return fisher.diagonal(
    apply_fn, params, batch, likelihood=fisher.Categorical(), kind="exact"
  )


def part_continual(
  apply_fn, params_a, data_a, steps, batch_size, seed, n_fisher
):
  data_b = _permute(data_a, seed)
  xa, ya = data_a["train"][0][:n_fisher], data_a["train"][1][:n_fisher]
  cat = fisher.Categorical()
  diag = _exact_diagonal(apply_fn, params_a, (xa, ya))
  r1 = jax.jit(
    functools.partial(
      fisher.rank_one,
      apply_fn,
      likelihood=cat,
      kind="empirical",
      direction="mean",
      scale="optimal",
    )
  )(params_a, (xa, ya))
  anchors = {
    "fine-tune": None,
    "EWC (diagonal, exact Fisher)": (
      fisher_optax.consolidate(
        fisher_optax.init_ewc_anchor(params_a, diagonal=True),
        params_a,
        diagonal=diag,
      ),
      100.0,
    ),
    "EWC (rank-1, c*)": (
      fisher_optax.consolidate(
        fisher_optax.init_ewc_anchor(params_a, diagonal=False, rank=1),
        params_a,
        low_rank=r1,
      ),
      1000.0,
    ),
  }
  rows, finals = [], {}
  for name, spec in anchors.items():
    tx = optax.adam(1e-3)
    if spec is not None:
      anchor, strength = spec
      tx = optax.chain(fisher_optax.add_ewc_gradient(strength, anchor), tx)
    params_b, _, _, _ = _train(
      apply_fn,
      params_a,
      tx,
      *data_b["train"],
      steps=steps,
      batch_size=batch_size,
      seed=seed + 1,
      desc=name,
    )
    finals[name] = params_b
    acc_a = _accuracy(apply_fn, params_b, *data_a["test"])
    acc_b = _accuracy(apply_fn, params_b, *data_b["test"])
    rows.append(
      {
        "method": name,
        "task_A_accuracy": acc_a,
        "task_B_accuracy": acc_b,
        "average": (acc_a + acc_b) / 2,
      }
    )
  return rows, finals, data_b


def part_merging(apply_fn, params_a, params_b, data_a, data_b, n_fisher):
  fishers = [
    _exact_diagonal(
      apply_fn, p, (d["train"][0][:n_fisher], d["train"][1][:n_fisher])
    ).diag
    for p, d in ((params_a, data_a), (params_b, data_b))
  ]

  def score(p, split):
    return (
      _accuracy(apply_fn, p, *data_a[split])
      + _accuracy(apply_fn, p, *data_b[split])
    ) / 2

  rows = []
  for name, f in (("plain average", None), ("Fisher merging", fishers)):
    search = fisher_optax.search_merge_weights(
      lambda p: score(p, "val"), [params_a, params_b], f, num_points=11
    )
    merged = fisher_optax.fisher_merge(
      [params_a, params_b], f, weights=search.best_weights
    )
    rows.append(
      {
        "merge": name,
        "weight_on_task_A": float(np.asarray(search.best_weights)[0]),
        "mean_test_accuracy": score(merged, "test"),
      }
    )
  return rows


# -- 5. pruning ----------------------------------------------------------------


def part_pruning(apply_fn, params, data, sparsity, seed, steps):
  x, y = data["train"]
  xt, yt = data["test"]
  kernels = jax.tree.map(lambda a: a.ndim == 2, params)
  rng = np.random.default_rng(seed)
  loss = lambda p, ex: _ce(apply_fn(p, ex[0][None]), ex[1][None])

  def grad_fn(p, step):
    del step
    idx = rng.integers(0, len(x), 128)
    return fisher.per_example_grads(loss, p, (x[idx], y[idx]), chunk_size=64)

  obs = fisher_optax.obs_prune(
    params,
    grad_fn,
    sparsity,
    prunable=kernels,
    steps=steps,
    block_size=128,
    damping=1e-4,
  )
  mag = fisher_optax.magnitude_prune(params, sparsity, prunable=kernels)
  return [
    {"pruning": "dense", "test_accuracy": _accuracy(apply_fn, params, xt, yt)},
    {
      "pruning": f"magnitude {sparsity:.0%}",
      "test_accuracy": _accuracy(apply_fn, mag.params, xt, yt),
    },
    {
      "pruning": f"OBS (M-FAC) {sparsity:.0%}",
      "test_accuracy": _accuracy(apply_fn, obs.params, xt, yt),
    },
  ]


_MC_NOTE = (
  "mc is unbiased but noisy: its 4 labels per example are sampled from a "
  "confident model, whose Fisher comes from rare wrong labels, so its error "
  "shrinks only like 1/sqrt(num_samples)."
)


# -- reporting -----------------------------------------------------------------


def _table(rows: list[dict[str, Any]]) -> str:
  keys = list(rows[0])
  fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)
  cells = [[fmt(r[k]) for k in keys] for r in rows]
  widths = [
    max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)
  ]
  line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths))
  return "\n".join(
    [line(keys), line(["-" * w for w in widths]), *(line(c) for c in cells)]
  )


def _zoomed_bars(ax, labels, values, title, ylabel="test accuracy"):
  """Bars with their values written on them, on an axis zoomed to the data.

  Differences of a point or two are the claim here, so the axis starts just
  below the smallest bar (and says so) instead of at 0.
  """
  values = [float(v) for v in values]
  lo, hi = min(values), max(values)
  pad = max(0.25 * (hi - lo), 0.01)
  bars = ax.bar(labels, values, color=[f"C{i}" for i in range(len(values))])
  ax.bar_label(bars, fmt="%.3f", fontsize=8)
  ax.set_ylim(max(0.0, lo - 2 * pad), min(1.0, hi) + 1.5 * pad)
  ax.set(title=title, ylabel=f"{ylabel} (axis zoomed)")
  ax.tick_params(axis="x", labelsize=7)


def _figure(curves, spectrum, fisher_summary, continual, merging, pruning):
  """The demo's six panels, as a matplotlib figure."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(2, 3, figsize=(15, 8))
  ax = axes[0, 0]
  window = max(1, len(next(iter(curves.values()))) // 25)
  for name, losses in curves.items():
    ax.plot(np.convolve(losses, np.ones(window) / window, "valid"), label=name)
  ax.set(title="1. training loss (digits MLP)", xlabel="step", yscale="log")
  ax.legend(fontsize=8)
  ax = axes[0, 1]
  ax.semilogy(np.maximum(spectrum, 1e-12), ".")
  ax.set(
    title="2. empirical Fisher spectrum (per-example Gram)",
    xlabel="index",
    ylabel="eigenvalue",
  )
  ax = axes[0, 2]
  errs = fisher_summary["relative_error_vs_exact_diagonal"]
  bars = ax.bar(list(errs), list(errs.values()))
  ax.bar_label(bars, fmt="%.2f", fontsize=8)
  ax.set(
    title="2. diagonal: relative error vs exact Fisher",
    ylim=(0, 1.15 * max(errs.values())),
  )
  ax = axes[1, 0]
  names = [r["method"] for r in continual]
  for offset, key, label in (
    (-0.2, "task_A_accuracy", "task A (old)"),
    (0.2, "task_B_accuracy", "task B (new)"),
  ):
    bars = ax.bar(
      np.arange(len(names)) + offset,
      [r[key] for r in continual],
      0.4,
      label=label,
    )
    ax.bar_label(bars, fmt="%.2f", fontsize=7)
  ax.set_xticks(np.arange(len(names)), names, fontsize=7)
  # Head room above 1 keeps the legend clear of the bars.
  ax.set(title="3. continual learning: accuracy after task B", ylim=(0, 1.3))
  ax.set_yticks(np.linspace(0, 1, 6))
  ax.legend(fontsize=8, loc="upper center", ncol=2)
  _zoomed_bars(
    axes[1, 1],
    [r["merge"] for r in merging],
    [r["mean_test_accuracy"] for r in merging],
    "4. merging A and fine-tuned B: mean accuracy",
    ylabel="mean test accuracy",
  )
  _zoomed_bars(
    axes[1, 2],
    [r["pruning"] for r in pruning],
    [r["test_accuracy"] for r in pruning],
    "5. pruning without retraining",
  )
  fig.tight_layout()
  return fig


def _plot(path, *args):
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig = _figure(*args)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  small = FLAGS.small
  steps = 30 if small else FLAGS.steps
  n_fisher = 64 if small else 512
  seed = FLAGS.seed
  out = pathlib.Path(FLAGS.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  print(
    f"fisher_optax {fisher_optax.__version__} on {jax.device_count()} "
    f"{jax.default_backend()} device(s)"
  )

  data = datasets.load_digits(seed=seed)
  apply_fn, init = models.digits_mlp(seed, _SIZES)

  print(
    "\n1. Optimizers on the digits MLP "
    f"({steps} steps, batch {FLAGS.batch_size})"
  )
  opt_rows, curves, trained = part_optimizers(
    apply_fn, init, data, steps, FLAGS.batch_size, seed
  )
  print(_table(opt_rows))
  print(
    "compile_s: compiling the jitted train step, once; ms_per_step: the "
    "mean time of a step after that."
  )
  params = trained["AdamW (optax)"]

  # The per-example Gram of part 2 is N x N: 256 examples keep it quick.
  n_stats = min(n_fisher, 256)
  print(f"\n2. The Fisher of the AdamW-trained model ({n_stats} examples)")
  fisher_summary, spectrum = part_fisher(
    apply_fn, params, data, seed, n_stats, rank=16
  )
  print(
    _table(
      [
        {"kind": k, "rel. error vs exact diag": v}
        for k, v in fisher_summary["relative_error_vs_exact_diagonal"].items()
      ]
    )
  )
  print(_MC_NOTE)
  print(
    f"top-16 low rank captures {fisher_summary['energy_top_k']:.1%} of "
    f"||F||_F^2, the diagonal {fisher_summary['energy_diagonal']:.1%}; "
    f"lambda_1 / tr F = {fisher_summary['top1_over_trace']:.3f}, "
    f"|cos(mean grad, v_1)| = "
    f"{fisher_summary['cos_mean_grad_top_eigvec']:.3f}"
  )

  print("\n3. Continual learning: task A = digits, task B = permuted pixels")
  continual, finals, data_b = part_continual(
    apply_fn, params, data, steps, FLAGS.batch_size, seed, n_fisher
  )
  print(_table(continual))

  print("\n4. Merging the task-A model with its fine-tuned task-B version")
  merging = part_merging(
    apply_fn, params, finals["fine-tune"], data, data_b, n_fisher
  )
  print(_table(merging))

  print("\n5. Pruning 80% of the kernels without retraining")
  pruning = part_pruning(
    apply_fn, params, data, 0.8, seed, steps=4 if small else 16
  )
  print(_table(pruning))

  _plot(
    out / "demo.png",
    curves,
    spectrum,
    fisher_summary,
    continual,
    merging,
    pruning,
  )
  (out / "demo.json").write_text(
    json.dumps(
      {
        "optimizers": opt_rows,
        "fisher": fisher_summary,
        "continual": continual,
        "merging": merging,
        "pruning": pruning,
      },
      indent=2,
    )
    + "\n"
  )
  print(f"\nwrote {out / 'demo.png'} and {out / 'demo.json'}")


def run() -> None:
  app.run(main)


if __name__ == "__main__":
  run()
