# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""M-FAC cost scaling in d and m, and step time against optax.adam.

Three jitted callables are timed in interleaved rounds at every point
(``common.time_ratios``; medians, ratios within a round):

* ``ihvp``: ``F^{-1} v`` from a precomputed ``fisher.sum_of_rank_one`` factor
  (the paper's O(d m) product);
* ``mfac``: one ``scale_by_mfac`` update (ring-buffer push, new Gram row,
  m x m Cholesky, product: O(d m + m^3)), state donated;
* ``adam``: one ``optax.adam`` update on the same gradient (the baseline).

Sweeps: d at m = 32, and m at a fixed d. The paper claims cost linear in d;
we fit the log-log slope over the sweep. A last table times the optimizers
``fisher_optax.mfac(window_size=32)`` against ``optax.adam`` on one
2^20-parameter leaf, both with their state donated.

Floor: an M-FAC step must read the ``m x d`` window twice (the new Gram
column, which is also ``G g``, and the product ``G^T w``), about ``2 m + 4``
passes over ``d`` floats with the gradient, the written row and the output;
Adam reads ``g, mu, nu`` and writes ``mu, nu, u``, about 7. The floor ratio
``(2 m + 4) / 7`` is a memory-traffic bound: measured below it, Adam is not
memory-bound on that machine. Run from the repository root::

  python -m benchmarks.mfac_scaling            # full (a few minutes)
  python -m benchmarks.mfac_scaling --small    # seconds-long smoke run
"""

from __future__ import annotations

from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import common
import fisher_optax
from fisher_optax import fisher

_SMALL = flags.DEFINE_bool("small", False, "Tiny sizes, few rounds (smoke).")
_ROUNDS = flags.DEFINE_integer("rounds", 9, "Interleaved timing rounds.")
_INNER = flags.DEFINE_integer("inner", 3, "Calls per function per round.")
_OUT = flags.DEFINE_string("out_dir", None, "Results dir (default results/).")

NAME = "mfac_scaling"


def make_params(d: int) -> dict[str, jax.Array]:
  """A matrix and a vector leaf, d parameters in all."""
  cols = 256
  rows = (d - cols) // cols
  return {
    "kernel": jnp.zeros((rows, cols)),
    "bias": jnp.zeros((d - rows * cols,)),
  }


def measure(d: int, m: int, rounds: int, inner: int) -> dict[str, Any]:
  params = make_params(d)
  key = jax.random.key(d + m)
  grads_seq = jax.tree.map(
    lambda p: jax.random.normal(key, (m, *p.shape)), params
  )
  g = jax.tree.map(lambda x: x[0], grads_seq)

  factor = jax.jit(lambda gs: fisher.sum_of_rank_one(gs, 1e-3))(grads_seq)
  ihvp = jax.jit(lambda f, v: f.ihvp(v))

  mfac = fisher_optax.scale_by_mfac(m, 1e-3)
  adam = optax.adam(1e-3)
  mfac_update = jax.jit(mfac.update, donate_argnums=1)
  adam_update = jax.jit(adam.update, donate_argnums=1)
  states = {"mfac": mfac.init(params), "adam": adam.init(params)}
  # Fill the window so every timed step replaces a real row.
  for i in range(m):
    _, states["mfac"] = mfac_update(
      jax.tree.map(lambda x, i=i: x[i], grads_seq), states["mfac"]
    )

  def run_mfac():
    u, states["mfac"] = mfac_update(g, states["mfac"])
    return u

  def run_adam():
    u, states["adam"] = adam_update(g, states["adam"])
    return u

  res = common.time_ratios(
    {"adam": run_adam, "mfac": run_mfac, "ihvp": lambda: ihvp(factor, g)},
    baseline="adam",
    rounds=rounds,
    inner=inner,
  )
  state_bytes = common.tree_bytes(states["mfac"])
  return {
    "d": d,
    "m": m,
    "mfac_state_bytes": state_bytes,
    **{f"{k}_{q}": v[q] for k, v in res.items() for q in ("median_s", "ratio")},
  }


def floor_ratio(m: int) -> float:
  """Passes over d of an M-FAC step over those of an Adam step."""
  return (2 * m + 4) / 7


def measure_optimizers(d: int, m: int, rounds: int, inner: int) -> dict:
  """``fisher_optax.mfac`` vs ``optax.adam`` on one leaf, states donated."""
  params = jnp.zeros((d,))
  key = jax.random.key(d)
  g = jax.random.normal(key, (d,))
  runs, states, steps = {}, {}, {}
  for name, tx in (
    ("adam", optax.adam(1e-3)),
    ("mfac", fisher_optax.mfac(1e-3, window_size=m, damping=1e-3)),
  ):
    steps[name] = jax.jit(tx.update, donate_argnums=1)
    states[name] = tx.init(params)
    if name == "mfac":  # fill the window
      for i in range(m):
        _, states[name] = steps[name](g * (1.0 + i / m), states[name], params)

    def run(name=name):
      u, states[name] = steps[name](g, states[name], params)
      return u

    runs[name] = run
  compiled = steps["mfac"].lower(g, states["mfac"], params).compile()
  memory = compiled.memory_analysis()
  window_bytes = 4 * m * d
  res = common.time_ratios(runs, baseline="adam", rounds=rounds, inner=inner)
  return {
    "d": d,
    "m": m,
    "adam_median_s": res["adam"]["median_s"],
    "mfac_median_s": res["mfac"]["median_s"],
    "mfac_ratio": res["mfac"]["ratio"],
    "floor_ratio": floor_ratio(m),
    "temp_over_window": (
      memory.temp_size_in_bytes / window_bytes if memory else float("nan")
    ),
  }


def slope(xs, ys) -> float:
  """Least-squares slope of log(y) against log(x)."""
  return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def plot(d_rows, m_rows, path) -> bool:
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for rows, key, ax, label in (
    (d_rows, "d", axes[0], "d (m = 32)"),
    (m_rows, "m", axes[1], "m"),
  ):
    xs = [r[key] for r in rows]
    for name in ("ihvp", "mfac", "adam"):
      ax.loglog(xs, [r[f"{name}_median_s"] for r in rows], "o-", label=name)
    ax.set_xlabel(label)
    ax.set_ylabel("seconds per call (median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
  axes[0].set_title("cost vs d")
  axes[1].set_title(f"cost vs m (d = {m_rows[0]['d']})")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True


def main(argv):
  del argv
  small = _SMALL.value
  rounds, inner = (3, 2) if small else (_ROUNDS.value, _INNER.value)
  d_sweep = [2**12, 2**14] if small else [2**14, 2**16, 2**18, 2**20, 2**22]
  m_sweep = [8, 16] if small else [8, 16, 32, 64, 128]
  d_for_m = 2**12 if small else 2**18
  d_rows, m_rows = [], []
  for d in d_sweep:
    d_rows.append(measure(d, 32, rounds, inner))
    print(d_rows[-1], flush=True)
  for m in m_sweep:
    m_rows.append(measure(d_for_m, m, rounds, inner))
    print(m_rows[-1], flush=True)
  single = measure_optimizers(2**14 if small else 2**20, 32, rounds, inner)
  print(single, flush=True)

  ds = [r["d"] for r in d_rows]
  slopes = {
    name: slope(ds, [r[f"{name}_median_s"] for r in d_rows])
    for name in ("ihvp", "mfac", "adam")
  }
  ms = [r["m"] for r in m_rows]
  m_slopes = {
    name: slope(ms, [r[f"{name}_median_s"] for r in m_rows])
    for name in ("ihvp", "mfac")
  }
  name = NAME + ("_small" if small else "")
  plotted = plot(
    d_rows,
    m_rows,
    common.RESULTS_DIR / f"{name}.png"
    if _OUT.value is None
    else f"{_OUT.value}/{name}.png",
  )

  fmt_ms = lambda s: f"{1e3 * s:.2f}"
  rows = [
    [
      r["d"],
      r["m"],
      fmt_ms(r["ihvp_median_s"]),
      fmt_ms(r["mfac_median_s"]),
      fmt_ms(r["adam_median_s"]),
      f"{r['mfac_ratio']:.1f}x",
      f"{floor_ratio(r['m']):.1f}x",
      f"{r['mfac_state_bytes'] / 2**20:.1f}",
    ]
    for r in d_rows + m_rows
  ]
  table = common.markdown_table(
    [
      "d",
      "m",
      "ihvp (ms)",
      "M-FAC step (ms)",
      "adam step (ms)",
      "M-FAC / adam",
      "floor (passes)",
      "M-FAC state (MiB)",
    ],
    rows,
  )
  single_table = common.markdown_table(
    [
      "d (one leaf)",
      "m",
      "adam step (ms)",
      "mfac step (ms)",
      "mfac / adam",
      "floor (passes)",
      "XLA temp / window",
    ],
    [
      [
        single["d"],
        single["m"],
        fmt_ms(single["adam_median_s"]),
        fmt_ms(single["mfac_median_s"]),
        f"{single['mfac_ratio']:.1f}x",
        f"{single['floor_ratio']:.1f}x",
        f"{single['temp_over_window']:.3f}",
      ]
    ],
  )
  at32 = [r for r in d_rows if r["m"] == 32]
  md = (
    "### M-FAC cost scaling (CPU, medians of interleaved rounds)\n\n"
    f"log-log slope in d at m = 32: ihvp {slopes['ihvp']:.2f}, M-FAC step "
    f"{slopes['mfac']:.2f}, adam {slopes['adam']:.2f} (1.0 = linear). "
    f"Slope in m at d = {d_for_m}: ihvp {m_slopes['ihvp']:.2f}, M-FAC step "
    f"{m_slopes['mfac']:.2f}. M-FAC step / optax.adam step at m = 32: "
    + ", ".join(f"{r['mfac_ratio']:.1f}x (d = {r['d']})" for r in at32)
    + ". Absolute times are indicative only (shared 2-core machine). The "
    "floor column is (2 m + 4) / 7, the passes over d of an M-FAC step "
    "(two reads of the window) over an Adam step's.\n\n"
    + table
    + "\n\n`fisher_optax.mfac(window_size=32)` vs `optax.adam`, one leaf, "
    "states donated (`jax.jit(update, donate_argnums=1)`); XLA temp / "
    "window is the compiled step's scratch memory over the window's bytes "
    "(at least 1 when the step copies the window).\n\n"
    + single_table
    + "\n"
    + (f"\n![scaling]({name}.png)\n" if plotted else "")
  )
  path = common.write_results(
    name,
    {
      "d_sweep": d_rows,
      "m_sweep": m_rows,
      "slopes_d": slopes,
      "slopes_m": m_slopes,
      "single_leaf": single,
      "rounds": rounds,
      "inner": inner,
    },
    md,
    _OUT.value,
  )
  print(md)
  print("wrote", path)


if __name__ == "__main__":
  app.run(main)
