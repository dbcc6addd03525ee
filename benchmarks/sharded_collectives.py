# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""What a sharded optimizer step moves between devices, against optax.

Each optimizer's jitted ``update`` + ``apply_updates`` (params and state
donated, the state built by an eager ``init`` so that it is sharded like the
params) is compiled for 8 devices, one weight matrix sharded along its rows
or its columns, under ``Auto`` axes (the partitioner chooses) and
``Explicit`` axes (``jax.set_mesh``: shardings are part of the types). From
the compiled HLO we count, per device, the elements each kind of collective
returns, and from ``memory_analysis()`` the step's temporary memory. Nothing
is timed: the numbers are the compiled program's, the same on any backend
(the devices are CPU host devices, 8 forced before JAX starts).

The program includes the branches that run only on refresh steps (Natural
GaLore's new basis, FISMO's roots), so a column is what the most expensive
step of the cycle moves.

Floor (what the maths needs to exchange, the leaf being ``m x n``, ``m <=
n``; per-device elements): AdamW and FAdam nothing leaf-sized (FAdam
all-reduces one mean square per leaf); M-FAC the ``m``-vector ``G g``
(a window sharded like the params); Natural GaLore's sketches a few
``n x (rank + 8)`` products and the ``m x rank`` projected gradient (the
window is replicated); FISMO ``ns_steps + 1`` all-reduced ``m x m`` Grams
of the shorter side. A gather of the whole leaf (``m n`` elements) is
above every floor. Run from the repository root::

  python -m benchmarks.sharded_collectives            # ~1 minute
  python -m benchmarks.sharded_collectives --small    # seconds
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  ).strip()

# pylint: disable=wrong-import-position
import collections  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
from typing import Any  # noqa: E402

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks import common  # noqa: E402
import fisher_optax  # noqa: E402

_SMALL = flags.DEFINE_bool("small", False, "A small leaf (smoke run).")
_OUT = flags.DEFINE_string("out_dir", None, "Results dir (default results/).")

NAME = "sharded_collectives"
_KINDS = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter")
_COLLECTIVE = re.compile(r"\s(" + "|".join(_KINDS) + r")(?:-start)?\(")


def collective_elements(hlo_text: str) -> dict[str, int]:
  """Per collective kind, the elements its ops return, summed over the
  program (an all-to-all's tuple counted whole)."""
  out: collections.Counter[str] = collections.Counter()
  for line in hlo_text.splitlines():
    found = _COLLECTIVE.search(line)
    if not found or "=" not in line[: found.start()]:
      continue
    result = line[: found.start()].split("=", 1)[1]
    for dims in re.findall(r"\w+\[([\d,]*)\]", result):
      out[found.group(1)] += math.prod(int(d) for d in dims.split(",") if d)
  return dict(out)


def _optimizers(rank: int) -> dict[str, tuple[Any, str]]:
  """name -> (transformation, the baseline it is read against)."""
  return {
    "optax.adamw": (optax.adamw(1e-3), "optax.adamw"),
    "fadam": (fisher_optax.fadam(1e-3), "optax.adamw"),
    "optax.adam": (optax.adam(1e-3), "optax.adam"),
    "mfac (m=16)": (fisher_optax.mfac(1e-3, window_size=16), "optax.adam"),
    "optax.contrib.muon": (optax.contrib.muon(1e-3), "optax.contrib.muon"),
    "fismo": (fisher_optax.fismo(1e-3), "optax.contrib.muon"),
    "optax.contrib.galore": (
      optax.contrib.galore(1e-3, rank=rank, update_proj_gap=200),
      "optax.contrib.galore",
    ),
    "natural_galore (exact)": (
      fisher_optax.natural_galore(1e-3, rank=rank, update_proj_gap=200),
      "optax.contrib.galore",
    ),
    "natural_galore (randomized)": (
      fisher_optax.natural_galore(
        1e-3, rank=rank, update_proj_gap=200, svd_method="randomized"
      ),
      "optax.contrib.galore",
    ),
  }


def floor(name: str, shape: tuple[int, int], rank: int) -> str:
  """What the maths must exchange, in leaves (the docstring's floors)."""
  m, n = sorted(shape)
  if name.startswith(("optax.adam", "fadam", "mfac")):
    return "0 (scalars, m-vectors)"
  if name == "optax.contrib.muon":
    return f"{5 * m / n:.2f} (5 Grams, all-reduced)"
  if name == "fismo":
    return f"{6 * m / n:.2f} (6 Grams, all-reduced)"
  if name.endswith("(randomized)"):
    return f"{(rank + 8) / m:.2f} per sketch product"
  return "1 (the SVD's matrix, gathered)"


def measure(
  tx: Any, shape: tuple[int, int], spec: P, axis_type: AxisType
) -> dict[str, Any] | None:
  """Collectives and temp of one compiled step; None if it does not compile
  (optax's Muon and GaLore under explicit axes)."""
  mesh = jax.sharding.Mesh(
    np.asarray(jax.devices("cpu")[:8]), ("x",), axis_types=(axis_type,)
  )
  rng = np.random.default_rng(0)
  with jax.set_mesh(mesh):
    put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
    params = {"w": put(jnp.asarray(rng.normal(size=shape), jnp.float32))}
    grads = {"w": put(jnp.asarray(rng.normal(size=shape), jnp.float32))}

    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    try:
      state = tx.init(params)
      compiled = (
        jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads)
      ).compile()
    except Exception as e:  # noqa: BLE001 - reported, not hidden
      if "ShardingTypeError" not in type(e).__name__:
        raise
      return None
  moved = collective_elements(compiled.as_text() or "")
  memory = compiled.memory_analysis()
  return {
    **{k: moved.get(k, 0) for k in _KINDS},
    "temp_mib": None if memory is None else memory.temp_size_in_bytes / 2**20,
  }


def _reading(rows: list[dict[str, Any]], leaf: int) -> str:
  """The paragraph under the table, from this run's rows."""
  get = lambda axes, spec, name: next(
    r
    for r in rows
    if (r["axes"], r["spec"], r["optimizer"]) == (axes, spec, name)
  )
  rows_spec = str(P("x", None))
  auto_fismo = get("Auto", rows_spec, "fismo")
  auto_muon = get("Auto", rows_spec, "optax.contrib.muon")
  explicit_fismo = get("Explicit", rows_spec, "fismo")
  return (
    "Reading: the elementwise and windowed methods (FAdam, M-FAC) exchange "
    "scalars only, as AdamW does. With the leaf sharded along its shorter "
    "side (rows here), under `Explicit` axes FISMO moves the leaf to its "
    "longer side (all-to-all) and all-reduces its Grams: "
    f"{explicit_fismo['all-gather'] / leaf:.2f} leaves gathered, "
    f"{explicit_fismo['all-reduce'] / leaf:.2f} all-reduced. Under `Auto` "
    "axes the step cannot see the leaf's sharding (it is not part of the "
    "types) and the partitioner "
    f"gathers {auto_fismo['all-gather'] / leaf:.2f} leaves "
    f"(`optax.contrib.muon`: {auto_muon['all-gather'] / leaf:.2f}); "
    "sharding such leaves along their longer side, or explicit axes, avoids "
    'it. Natural GaLore\'s sketched refresh (`svd_method="randomized"` or '
    '`"subspace"`) exchanges sketches only; the exact SVD gathers the '
    "matrix, as optax's GaLore does."
  )


def main(argv: list[str]) -> None:
  del argv
  shape, rank = ((64, 256), 8) if _SMALL.value else ((1024, 4096), 128)
  leaf = shape[0] * shape[1]
  rows, lines = [], []
  for axis_type in (AxisType.Auto, AxisType.Explicit):
    for spec in (P("x", None), P(None, "x")):
      for name, (tx, baseline) in _optimizers(rank).items():
        got = measure(tx, shape, spec, axis_type)
        row = {
          "axes": axis_type.name,
          "spec": str(spec),
          "optimizer": name,
          "baseline": baseline,
          **(got or {}),
          "compiles": got is not None,
        }
        rows.append(row)
        if got is None:
          cells = ["does not compile"] + [""] * 4
        else:
          cells = [
            f"{got['all-gather'] / leaf:.2f}",
            f"{got['all-reduce'] / leaf:.2f}",
            f"{got['all-to-all'] / leaf:.2f}",
            f"{got['reduce-scatter'] / leaf:.2f}",
            "n/a" if got["temp_mib"] is None else f"{got['temp_mib']:.1f}",
          ]
        lines.append(
          [axis_type.name, str(spec), name, *cells, floor(name, shape, rank)]
        )
  header = [
    "axes",
    "leaf sharding",
    "optimizer",
    "all-gather (leaves)",
    "all-reduce (leaves)",
    "all-to-all (leaves)",
    "reduce-scatter (leaves)",
    "XLA temp (MiB)",
    "floor (leaves)",
  ]
  md = (
    f"### Collectives of one sharded step ({shape[0]} x {shape[1]} float32 "
    f"leaf, 8 devices, rank {rank} for GaLore)\n\n"
    "Elements the step's collectives return per device, in units of the "
    f"leaf ({leaf} elements), from the compiled HLO (refresh branches "
    "included); temp from `memory_analysis()`. The floor is what the maths "
    "must exchange (the script's docstring): a whole leaf only for the "
    "exact SVD, which gathers its matrix. `does not compile`: under explicit "
    "axes optax's Muon raises a `ShardingTypeError` (a contraction over a "
    "sharded axis without an `out_sharding`), and its GaLore too (an SVD of "
    "a sharded matrix).\n\n" + common.markdown_table(header, lines)
  )
  md += "\n\n" + _reading(rows, leaf)
  print(md)
  common.write_results(
    NAME + ("_small" if _SMALL.value else ""),
    {"shape": shape, "rank": rank, "rows": rows},
    md,
    _OUT.value,
  )


if __name__ == "__main__":
  app.run(main)
