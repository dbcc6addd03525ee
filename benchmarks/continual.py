# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Continual learning on permuted digits: EWC variants and protected subspaces.

The protocol of Kirkpatrick et al. (2017), scaled down. Five tasks (task
0 = identity, tasks 1-4 = seeded pixel permutations), one 10-way head, MLP
64-128-128-10 ReLU, Adam 1e-3, batch 32, ``--steps`` per task. After each
task the Fisher (or protected basis) is computed on that task's train split
and folded into the optimizer state with ``optax.tree.set``; the jitted
training step is the same for every task.

``R[t, i]`` = accuracy on task ``i`` after training task ``t``;
``ACC = mean_i R[T-1, i]``, ``FGT = mean_{i<T-1} max_{l<T-1} R[l, i] -
R[T-1, i]``. ``lambda`` is chosen per method on the *validation* split (best
mean validation ACC over seeds); test numbers are reported at that ``lambda``.
Every ``lambda`` of a grid trains in one ``vmap``.

Also measured: how rank-1 the Fisher is (top eigenvalue / trace, cosine of the
mean gradient with the top eigenvector), on the classifier after each task and
on a tiny denoising-diffusion MLP on digits across noise levels, where the
rank-1 EWC paper claims the Fisher is nearly rank one at low SNR.

Run from the repository root::

  python -m benchmarks.continual            # full run
  python -m benchmarks.continual --small    # smoke run (1 seed, 3 tasks)

The full run is about 12 methods x 3 seeds of 5 tasks and is dominated by
XLA compilation on CPU. On a busy machine split it into processes and merge::

  python -m benchmarks.continual --part ewc --seed_list 0   # ... 1, 2
  python -m benchmarks.continual --part proj --seed_list 0  # ... 1, 2
  python -m benchmarks.continual --part diffusion
  python -m benchmarks.continual --report_only
"""

from __future__ import annotations

import functools
import pickle
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
from examples.common import datasets
from examples.common import models
import fisher_optax
from fisher_optax import fisher

_SMALL = flags.DEFINE_bool("small", False, "seconds-long smoke run")
_SEEDS = flags.DEFINE_integer("seeds", 3, "number of seeds")
_STEPS = flags.DEFINE_integer("steps", 300, "training steps per task")
_TASKS = flags.DEFINE_integer("tasks", 5, "number of permuted tasks")
_NAME = flags.DEFINE_string("name", "continual", "results file stem")
_PART = flags.DEFINE_enum(
  "part",
  "all",
  ["all", "ewc", "proj", "diffusion"],
  "run one part (for parallel processes); merge with --report_only",
)
_SEED_LIST = flags.DEFINE_list(
  "seed_list", None, "run only these seeds (default: range(--seeds))"
)
_REPORT_ONLY = flags.DEFINE_bool(
  "report_only", False, "rebuild the report from the saved raw results"
)

BATCH = 32
LR = 1e-3
BATCHED_B = 128  # mini-batch size of the BATCHED (squared batch grad) Fisher
MAX_RANK = 512  # protected directions per leaf (PhysGuard)
N_SOURCE = 512  # source examples per task for the protected bases
N_TOP_EIG = 256  # examples for the top-eigenvector (Gram) rank-1 Fisher

# name -> (diagonal kind or None, rank-1 (direction, scale) or None, lambdas)
EWC_METHODS: dict[str, tuple[Any, Any, tuple[float, ...]]] = {
  "fine-tune": (None, None, (0.0,)),
  "diag EWC, exact": ("exact", None, (1e0, 1e1, 1e2, 1e3, 1e4)),
  "diag EWC, sampled (MC-1)": ("mc", None, (1e0, 1e1, 1e2, 1e3, 1e4)),
  "diag EWC, empirical": ("empirical", None, (1e0, 1e1, 1e2, 1e3, 1e4)),
  f"diag EWC, batched({BATCHED_B})": (
    "batched",
    None,
    (1e2, 1e3, 1e4, 1e5, 1e6),
  ),
  "rank-1 EWC, mean, unscaled": (
    None,
    ("mean", "none"),
    (1e2, 1e3, 1e4, 1e5, 1e6),
  ),
  "rank-1 EWC, mean, c*": (
    None,
    ("mean", "optimal"),
    (1e1, 1e2, 1e3, 1e4, 1e5),
  ),
  "rank-1 EWC, top eigvec (256 ex.)": (
    None,
    ("top_eig", "none"),
    (1e1, 1e2, 1e3, 1e4, 1e5),
  ),
  "diag exact + rank-1 c*": (
    "exact",
    ("mean", "optimal"),
    (1e0, 1e1, 1e2, 1e3, 1e4),
  ),
}
# name -> (placement, tau, labels)
PROJECTION_METHODS: dict[str, tuple[str, float, str]] = {
  "protected subspace, after Adam (tau .999, sampled y)": (
    "after",
    0.999,
    "sampled",
  ),
  "protected subspace, before Adam (tau .999, sampled y)": (
    "before",
    0.999,
    "sampled",
  ),
  "protected subspace, after Adam (tau .9, true y; paper)": (
    "after",
    0.9,
    "true",
  ),
}


def permuted_digits(seed: int, num_tasks: int) -> list[dict[str, Any]]:
  """Task 0 is the identity, tasks 1.. are seeded pixel permutations."""
  data = datasets.load_digits(seed=seed, standardize=False)  # x / 16
  rng = np.random.default_rng(1000 + seed)
  perms = [np.arange(64)] + [rng.permutation(64) for _ in range(num_tasks - 1)]
  return [{k: (x[:, p], y) for k, (x, y) in data.items()} for p in perms]


def forgetting(r: np.ndarray) -> float:
  t = r.shape[0]
  return float(
    np.mean([r[: t - 1, i].max() - r[t - 1, i] for i in range(t - 1)])
  )


class Runner:
  """Jitted, lambda-vmapped training and Fisher code for one model."""

  def __init__(self, apply_fn, steps: int):
    self.apply_fn = apply_fn
    self.steps = steps
    self.lik = fisher.Categorical()

  def loss(self, p, x, y):
    return common.cross_entropy(self.apply_fn(p, x), y)

  def one_loss(self, p, ex):
    x, y = ex
    return common.cross_entropy(self.apply_fn(p, x[None]), y[None])

  # -- training --------------------------------------------------------------

  @functools.partial(jax.jit, static_argnums=(0, 1))
  def train(self, tx_fn, params, state, lams, x, y, idx):
    """Trains every lambda's copy on one task; ``idx`` (steps, BATCH)."""

    def one(p, s, lam):
      tx = tx_fn(lam)

      def step(carry, i):
        p, s = carry
        g = jax.grad(self.loss)(p, x[i], y[i])
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), None

      return jax.lax.scan(step, (p, s), idx)[0]

    return jax.vmap(one)(params, state, lams)

  @functools.partial(jax.jit, static_argnums=0)
  def accuracy(self, params, x, y):
    return jax.vmap(lambda p: common.accuracy(self.apply_fn(p, x), y))(params)

  # -- Fisher statistics -------------------------------------------------------

  def diagonal(self, params, x, y, kind, key):
    if kind == "batched":  # mean over mini-batches of the squared batch grad
      n = (x.shape[0] // BATCHED_B) * BATCHED_B
      xb = x[:n].reshape(-1, BATCHED_B, x.shape[1])
      yb = y[:n].reshape(-1, BATCHED_B)
      diags = jax.lax.map(
        lambda b: (
          fisher.diagonal(
            self.apply_fn, params, b, likelihood=self.lik, kind="batch_squared"
          ).diag
        ),
        (xb, yb),
      )
      return jax.tree.map(lambda d: d.mean(0), diags)
    return fisher.diagonal(
      self.apply_fn,
      params,
      (x, y),
      likelihood=self.lik,
      kind=kind,
      key=key if kind == "mc" else None,
    ).diag

  @functools.partial(jax.jit, static_argnums=(0, 1, 2))
  def consolidate(self, diag_kind, rank1, params, state, x, y, key):
    """Folds the finished task into every lambda's EWC anchor."""

    def one(p, s):
      kwargs = {}
      if diag_kind is not None:
        kwargs["diagonal"] = self.diagonal(p, x, y, diag_kind, key)
      if rank1 is not None:
        direction, scale = rank1
        # The top eigenvector needs the N x N Gram: use N_TOP_EIG examples.
        n = N_TOP_EIG if direction == "top_eig" else x.shape[0]
        kwargs["low_rank"] = fisher.rank_one(
          self.apply_fn,
          p,
          (x[:n], y[:n]),
          likelihood=self.lik,
          kind="empirical",
          direction=direction,
          scale=scale,
        )
      anchor = fisher_optax.consolidate(
        optax.tree.get(s, "ewc_anchor"), p, **kwargs
      )
      return optax.tree.set(s, ewc_anchor=anchor)

    return jax.vmap(one)(params, state)

  @functools.partial(jax.jit, static_argnums=(0, 1))
  def protect(self, labels, tau, params, state, x, y, key):
    """Extends the protected bases with the finished task's gradients."""

    x, y = x[:N_SOURCE], y[:N_SOURCE]

    def one(p, s):
      if labels == "sampled":
        yy = jax.random.categorical(key, self.apply_fn(p, x))
      else:
        yy = y
      g = fisher.per_example_grads(self.one_loss, p, (x, yy), chunk_size=256)
      sub = fisher_optax.protected_subspace(
        g,
        max_rank=MAX_RANK,
        tau=tau,
        existing=optax.tree.get(s, "protected_subspace"),
      )
      return optax.tree.set(s, protected_subspace=sub)

    return jax.vmap(one)(params, state)

  @functools.partial(jax.jit, static_argnums=0)
  def rank_oneness(self, params, x, y):
    """Top eigenvalue / trace and |cos(mu, v_1)| of the empirical Fisher."""
    top = fisher.low_rank(
      self.apply_fn,
      params,
      (x, y),
      likelihood=self.lik,
      kind="empirical",
      rank=1,
    )
    diag = fisher.diagonal(
      self.apply_fn, params, (x, y), likelihood=self.lik, kind="empirical"
    )
    return _rank_oneness(top, diag)


def _rank_oneness(top, diag):
  trace = sum(jnp.sum(d) for d in jax.tree.leaves(diag.diag))
  mu = diag.mean_grad
  v = jax.tree.map(lambda e: e[0], top.eigvecs)
  dot = sum(
    jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(mu), jax.tree.leaves(v))
  )
  norm = jnp.sqrt(sum(jnp.sum(a * a) for a in jax.tree.leaves(mu)))
  return {
    "top_over_trace": top.eigvals[0] / trace,
    "cos_mean_top": jnp.abs(dot) / jnp.maximum(norm, 1e-30),
    "mean_sq_over_trace": norm**2 / trace,
  }


def run_method(
  runner, tasks, params0, seed, steps, *, lams, tx_fn, end_fn, probe=None
):
  """Trains the task sequence for every lambda; returns R on val and test."""
  n_tasks = len(tasks)
  lams = jnp.asarray(lams, jnp.float32)
  l = lams.shape[0]
  params = jax.tree.map(lambda p: jnp.broadcast_to(p, (l,) + p.shape), params0)
  state = jax.vmap(lambda p: tx_fn(0.0).init(p))(params)
  r = {s: np.zeros((l, n_tasks, n_tasks)) for s in ("val", "test")}
  rng = np.random.default_rng(seed)
  for t, task in enumerate(tasks):
    x, y = (jnp.asarray(a) for a in task["train"])
    idx = jnp.asarray(rng.integers(0, x.shape[0], (steps, BATCH)))
    params, state = runner.train(tx_fn, params, state, lams, x, y, idx)
    for split in ("val", "test"):
      for i, other in enumerate(tasks):
        r[split][:, t, i] = np.asarray(
          runner.accuracy(params, *map(jnp.asarray, other[split]))
        )
    if probe is not None:
      probe(t, params, x, y)
    if t < n_tasks - 1 and end_fn is not None:
      state = end_fn(params, state, x, y, jax.random.key(seed * 100 + t))
  return r


_TX_CACHE: dict[Any, Any] = {}


def cached_tx_fn(key, make):
  # The same Python callable for the same method keeps jit caches warm.
  if key not in _TX_CACHE:
    _TX_CACHE[key] = make
  return _TX_CACHE[key]


def diffusion_rank_oneness(
  seed: int, steps: int, n: int, ts: tuple[int, ...]
) -> list[dict[str, float]]:
  """Rank-1-ness of a tiny DDPM eps-MLP's per-example-loss Fisher vs t."""
  data = datasets.load_digits(seed=seed, standardize=False)
  x = jnp.asarray(data["train"][0] / 8.0 - 1.0)  # pixels in [-1, 1]
  big_t = 1000
  betas = jnp.linspace(1e-4, 0.02, big_t)
  abar = jnp.cumprod(1.0 - betas)
  apply_fn, params = models.functional(
    models.MLP((64 + 32, 256, 256, 64), activation="silu", rngs=nnx.Rngs(seed))
  )

  def embed(t):
    freqs = jnp.exp(-jnp.log(1e4) * jnp.arange(16) / 16)
    ang = t[..., None].astype(jnp.float32) * freqs
    return jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], -1)

  def eps_pred(p, xt, t):
    return apply_fn(p, jnp.concatenate([xt, embed(t)], -1))

  def noisy(x0, t, eps):
    a = abar[t][..., None]
    return jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * eps

  def loss(p, x0, t, eps):
    return jnp.mean(jnp.square(eps_pred(p, noisy(x0, t, eps), t) - eps))

  tx = optax.adam(1e-3)

  @jax.jit
  def train(p, key):
    def step(carry, k):
      p, s = carry
      k1, k2, k3 = jax.random.split(k, 3)
      i = jax.random.randint(k1, (128,), 0, x.shape[0])
      t = jax.random.randint(k2, (128,), 0, big_t)
      eps = jax.random.normal(k3, (128, 64))
      g = jax.grad(loss)(p, x[i], t, eps)
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None

    return jax.lax.scan(step, (p, tx.init(p)), jax.random.split(key, steps))[0][
      0
    ]

  params = train(params, jax.random.key(seed))

  def one_loss(p, ex):
    x0, t, eps = ex
    return loss(p, x0[None], t[None], eps[None])

  @functools.partial(jax.jit, static_argnums=0)
  def measure(t_value, key):
    k1, k2 = jax.random.split(key)
    x0 = x[:n]
    if t_value < 0:  # the paper's protocol: each example its own t ~ U
      t = jax.random.randint(k1, (n,), 0, big_t)
    else:
      t = jnp.full((n,), t_value)
    eps = jax.random.normal(k2, (n, 64))
    g = fisher.per_example_grads(one_loss, params, (x0, t, eps), chunk_size=128)
    return _rank_oneness(
      fisher.low_rank_from_grads(g, rank=1), fisher.diagonal_from_grads(g)
    )

  out = []
  for t_value in ts:
    m = {k: float(v) for k, v in measure(t_value, jax.random.key(7)).items()}
    if t_value >= 0:
      a = float(abar[t_value])
      m["snr"] = a / (1 - a)
    m["t"] = t_value
    out.append(m)
  return out


def main(argv):
  del argv
  small = _SMALL.value
  seeds = 1 if small else _SEEDS.value
  steps = 40 if small else _STEPS.value
  n_tasks = 3 if small else _TASKS.value
  ewc_methods = EWC_METHODS
  proj_methods = PROJECTION_METHODS
  if small:
    ewc_methods = {k: (d, r, l[:2]) for k, (d, r, l) in EWC_METHODS.items()}
  t0 = time.time()

  part = _PART.value
  seed_list = (
    [int(s) for s in _SEED_LIST.value]
    if _SEED_LIST.value
    else list(range(seeds))
  )
  tag = part + (
    "" if _SEED_LIST.value is None else "_s" + "_".join(map(str, seed_list))
  )
  raw_path = common.RESULTS_DIR / f"{_NAME.value}_raw_{tag}.pkl"
  if _REPORT_ONLY.value:
    report(**merge_raw(_NAME.value), small=small, t0=t0)
    return
  if part in ("proj", "diffusion"):
    ewc_methods = {}
  if part in ("ewc", "diffusion"):
    proj_methods = {}
  results: dict[str, dict[str, Any]] = {}
  rank1_cls: list[dict[str, Any]] = []
  # One apply_fn (and Runner) for all seeds, so every jit compiles once.
  apply_fn, _ = models.digits_mlp(0, activation="relu")
  runner = Runner(apply_fn, steps)
  for seed in seed_list if part != "diffusion" else []:
    tasks = permuted_digits(seed, n_tasks)
    _, params0 = models.digits_mlp(seed, activation="relu")
    for name, (diag_kind, rank1, lams) in ewc_methods.items():
      has_diag = diag_kind is not None or rank1 is None
      rank = (n_tasks - 1) if rank1 is not None else 0
      tx_fn = cached_tx_fn(
        ("ewc", has_diag, rank),
        lambda lam, d=has_diag, k=rank: optax.chain(
          fisher_optax.add_ewc_gradient(lam, diagonal=d, rank=k), optax.adam(LR)
        ),
      )
      end_fn, probe = None, None
      if lams != (0.0,):

        def end_fn(p, s, x, y, key, d_kind=diag_kind, rank1=rank1):
          return runner.consolidate(d_kind, rank1, p, s, x, y, key)
      else:

        def probe(t, p, x, y, seed=seed):
          # Rank-1-ness of the classifier's Fisher after each task (FT run).
          m = runner.rank_oneness(jax.tree.map(lambda a: a[0], p), x, y)
          rank1_cls.append(
            {"seed": seed, "task": t, **{k: float(v) for k, v in m.items()}}
          )

      ts = time.time()
      r = run_method(
        runner,
        tasks,
        params0,
        seed,
        steps,
        lams=lams,
        tx_fn=tx_fn,
        end_fn=end_fn,
        probe=probe,
      )
      results.setdefault(name, {"lams": list(lams), "R": []})["R"].append(r)
      print(f"seed {seed} {name}: {time.time() - ts:.1f}s", flush=True)
    for name, (placement, tau, labels) in proj_methods.items():
      tx_fn = cached_tx_fn(
        ("proj", placement),
        lambda lam, pl=placement: fisher_optax.physguard(
          LR, max_rank=MAX_RANK, placement=pl
        ),
      )

      def end_fn(p, s, x, y, key, labels=labels, tau=tau):
        return runner.protect(labels, tau, p, s, x, y, key)

      ts = time.time()
      r = run_method(
        runner,
        tasks,
        params0,
        seed,
        steps,
        lams=(0.0,),
        tx_fn=tx_fn,
        end_fn=end_fn,
      )
      results.setdefault(name, {"lams": [None], "R": []})["R"].append(r)
      print(f"seed {seed} {name}: {time.time() - ts:.1f}s", flush=True)

  diff_steps = 100 if small else 2000
  diff_n = 64 if small else 256
  diff_ts = (-1, 10, 250, 500, 750, 999)
  diffusion = []
  if part in ("all", "diffusion"):
    diffusion = [diffusion_rank_oneness(0, diff_steps, diff_n, diff_ts)]
  raw = dict(
    results=results,
    rank1_cls=rank1_cls,
    diffusion=diffusion,
    diff_settings=(diff_steps, diff_n, diff_ts),
    seeds=seeds,
    steps=steps,
    n_tasks=n_tasks,
    seed_list=seed_list,
  )
  raw_path.parent.mkdir(parents=True, exist_ok=True)
  with open(raw_path, "wb") as f:  # lets --report_only rebuild the report
    pickle.dump(raw, f)
  if part == "all":
    report(**merge_raw(_NAME.value), small=small, t0=t0)


def merge_raw(name: str) -> dict[str, Any]:
  """Merges the raw results of the parts (and seeds) run separately."""
  merged: dict[str, Any] = {"results": {}, "rank1_cls": [], "diffusion": []}
  for path in sorted(common.RESULTS_DIR.glob(f"{name}_raw_*.pkl")):
    with open(path, "rb") as f:
      raw = pickle.load(f)
    for key in ("diff_settings", "steps", "n_tasks"):
      merged[key] = raw[key]
    for method, res in raw["results"].items():
      entry = merged["results"].setdefault(
        method, {"lams": res["lams"], "R": [], "seeds": []}
      )
      entry["R"].extend(res["R"])
      entry["seeds"].extend(raw["seed_list"])
    merged["rank1_cls"].extend(raw["rank1_cls"])
    merged["diffusion"].extend(raw["diffusion"])
  seeds = {len(r["R"]) for r in merged["results"].values()}
  merged["seeds"] = max(seeds) if seeds else 0
  return merged


def report(
  *,
  results,
  rank1_cls,
  diffusion,
  diff_settings,
  seeds,
  steps,
  n_tasks,
  small,
  t0,
):
  """Selects lambda on validation and writes JSON, markdown and the plot."""
  diff_steps, diff_n, diff_ts = diff_settings
  # -- lambda on validation, numbers on test ----------------------------------
  rows, summary = [], {}
  for name, res in results.items():
    rs = {s: np.stack([r[s] for r in res["R"]]) for s in ("val", "test")}
    val_acc = rs["val"][:, :, -1, :].mean(-1).mean(0)  # per lambda
    best = int(np.argmax(val_acc))
    acc = rs["test"][:, best, -1, :].mean(-1)
    fgt = np.array(
      [forgetting(rs["test"][s, best]) for s in range(rs["test"].shape[0])]
    )
    lam = res["lams"][best]
    edge = len(res["lams"]) > 1 and best in (0, len(res["lams"]) - 1)
    summary[name] = {
      "lambda": lam,
      "lambda_at_grid_edge": edge,
      "val_acc_per_lambda": val_acc.tolist(),
      "acc": acc.tolist(),
      "fgt": fgt.tolist(),
      "R_test_mean": rs["test"][:, best].mean(0).tolist(),
    }
    lam_txt = (
      "-"
      if lam is None or lam == 0
      else f"{lam:g}" + (" (edge)" if edge else "")
    )
    rows.append(
      (name, lam_txt, common.fmt_mean_std(acc, 3), common.fmt_mean_std(fgt, 3))
    )

  cls_rows = []
  for t in range(n_tasks):
    ms = [m for m in rank1_cls if m["task"] == t]
    cls_rows.append(
      (
        t,
        common.fmt_mean_std([m["top_over_trace"] for m in ms], 3),
        common.fmt_mean_std([m["cos_mean_top"] for m in ms], 3),
        common.fmt_mean_std([m["mean_sq_over_trace"] for m in ms], 4),
      )
    )

  diff_rows = []
  for j, t_value in enumerate(diff_ts):
    ms = [d[j] for d in diffusion]
    diff_rows.append(
      (
        "U{0..999} per example" if t_value < 0 else t_value,
        "-" if t_value < 0 else f"{ms[0]['snr']:.2e}",
        common.fmt_mean_std([m["top_over_trace"] for m in ms], 3),
        common.fmt_mean_std([m["cos_mean_top"] for m in ms], 3),
        common.fmt_mean_std([m["mean_sq_over_trace"] for m in ms], 4),
      )
    )

  plot_path = None
  try:
    plot_path = plot_matrices(summary, _NAME.value)
  except ImportError:
    pass

  md = [
    f"## Continual learning: permuted digits ({n_tasks} tasks, "
    f"{seeds} seed(s), {steps} steps/task)",
    "",
    "MLP 64-128-128-10 ReLU, Adam 1e-3, batch 32. lambda picked per "
    "method on validation ACC (mean over seeds), then test ACC / FGT "
    "(mean ± std over seeds). `(edge)`: best lambda at the grid edge. "
    "Penalty convention R = lambda/2 D^T F D (no 1/2 in Avalanche: "
    "lambda_ours = 2 lambda_avalanche). Multi-task: separate penalties "
    "(exact diagonal merge; one low-rank slot per task).",
    "",
    common.markdown_table(("method", "lambda", "ACC", "FGT"), rows),
    "",
    "### How rank-1 is the classifier's empirical Fisher "
    "(after each task, fine-tuning run)",
    "",
    common.markdown_table(
      ("after task", "lambda_1 / tr F", "abs cos(mu, v_1)", "‖mu‖² / tr F"),
      cls_rows,
    ),
    "",
    f"### Tiny DDPM eps-MLP on digits ({diff_steps} steps, N={diff_n} "
    "examples, per-example MSE loss)",
    "",
    common.markdown_table(
      ("t", "SNR", "lambda_1 / tr F", "abs cos(mu, v_1)", "‖mu‖² / tr F"),
      diff_rows,
    ),
    "",
  ]
  if plot_path:
    md.append(f"![accuracy matrices]({plot_path.name})")
  md.append(f"\nTotal time: {time.time() - t0:.0f} s.")
  data = {
    "settings": {
      "seeds": seeds,
      "steps": steps,
      "tasks": n_tasks,
      "batch": BATCH,
      "lr": LR,
      "max_rank": MAX_RANK,
      "batched_b": BATCHED_B,
      "small": small,
    },
    "methods": summary,
    "rank_oneness_classifier": rank1_cls,
    "rank_oneness_diffusion": diffusion,
  }
  path = common.write_results(_NAME.value, data, "\n".join(md))
  print("\n".join(md))
  print(f"wrote {path}", flush=True)


def plot_matrices(summary, name):
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  names = list(summary)
  cols = 4
  rows = -(-len(names) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows))
  for ax, n in zip(np.ravel(axes), names):
    r = np.asarray(summary[n]["R_test_mean"])
    ax.imshow(r, vmin=0, vmax=1, cmap="viridis")
    for (i, j), v in np.ndenumerate(r):
      ax.text(
        j,
        i,
        f"{v:.2f}",
        ha="center",
        va="center",
        fontsize=6,
        color="w" if v < 0.6 else "k",
      )
    ax.set_title(n, fontsize=7)
    ax.set_xlabel("eval task", fontsize=7)
    ax.set_ylabel("after task", fontsize=7)
    ax.tick_params(labelsize=6)
  for ax in np.ravel(axes)[len(names) :]:
    ax.axis("off")
  fig.tight_layout()
  path = common.RESULTS_DIR / f"{name}_accuracy_matrix.png"
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


if __name__ == "__main__":
  app.run(main)
