# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Scaling out: one training step on every device with `jax.sharding`
#
# The same jitted FAdam step and the same Fisher estimate run on one CPU,
# eight (forced) CPU devices, a GPU or a TPU host: the batch is sharded over
# a 1-D mesh axis `"data"`, parameters are replicated (`--shard_params`
# shards each parameter's first axis over the same axis, FSDP style), and
# XLA inserts the all-reduces. Nothing in the step mentions devices.
#
# On CPU the example asks for `--cpu_devices` (default 8) host devices, unless
# `XLA_FLAGS=--xla_force_host_platform_device_count=N` already set them; on a
# GPU or TPU runtime, install the accelerator jax wheel first
# (`pip install -U "jax[cuda12]"` or `"jax[tpu]"`) and it uses every
# accelerator. Run as a script: `python examples/scaling_out.py`.

# %%
import os
import pathlib
import time

import _notebook
from absl import flags
from common import datasets
from common import models
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import matplotlib.pyplot as plt
import numpy as np
import optax
from tqdm.auto import tqdm

import fisher_optax
from fisher_optax import fisher

flags.DEFINE_integer("steps", 300, "Training steps.")
flags.DEFINE_integer("per_device_batch", 16, "Examples per device per step.")
flags.DEFINE_integer(
  "cpu_devices", 8, "Host devices to ask for on CPU (0: leave JAX's default)."
)
flags.DEFINE_bool(
  "shard_params",
  False,
  "Shard parameters (FSDP style) instead of replicating them.",
)
flags.DEFINE_integer("seed", 0, "Seed of the split, the init and the batches.")
flags.DEFINE_string("out_dir", "example_outputs", "Where plots are written.")
flags.DEFINE_bool("small", False, "Tiny run (CI): few steps.")
FLAGS = flags.FLAGS


# %% [markdown]
# ## Devices and the mesh
# `jax_num_cpu_devices` only affects the CPU backend and must be set before
# JAX starts, so it is the first thing `main` does.


# %%
def request_cpu_devices(n: int) -> None:
  if n and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
  ):
    try:
      jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:  # JAX already started (e.g. a reused kernel).
      print(f"keeping the current devices: {e}")


def param_spec(leaf, n: int, shard: bool) -> P:
  """FSDP: the first axis divisible by the device count, else replicated."""
  if shard:
    for axis, size in enumerate(leaf.shape):
      if size % n == 0:
        return P(*([None] * axis + ["data"]))
  return P()


# %% [markdown]
# ## One step, written for one device
# The loss, the FAdam update and the Fisher estimate are ordinary jitted
# functions. Sharded inputs make them data-parallel.


# %%
def make_fns(apply_fn, tx):
  def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(
      apply_fn(params, x), y
    ).mean()

  @jax.jit
  def step(params, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  @jax.jit
  def fisher_diag(params, x, y):
    return fisher.diagonal(
      apply_fn, params, (x, y), likelihood=fisher.Categorical(), kind="exact"
    ).diag

  return step, fisher_diag


# %%
def main(argv):
  del argv
  request_cpu_devices(FLAGS.cpu_devices)
  n = jax.device_count()
  print(
    f"{n} {jax.default_backend()} device(s): "
    f"{[d.device_kind for d in jax.devices()][:4]}..."
  )
  # Auto axes: XLA's partitioner picks the intermediate shardings (Explicit
  # axes would ask us to annotate the FSDP matmuls by hand).
  mesh = jax.make_mesh(
    (n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  with jax.set_mesh(mesh):
    run_on_mesh(mesh, n)


def run_on_mesh(mesh, n):
  data_sharding = NamedSharding(mesh, P("data"))
  steps = 20 if FLAGS.small else FLAGS.steps
  batch = FLAGS.per_device_batch * n

  data = datasets.load_digits(seed=FLAGS.seed)
  apply_fn, params = models.digits_mlp(FLAGS.seed)
  specs = jax.tree.map(lambda p: param_spec(p, n, FLAGS.shard_params), params)
  params = jax.tree.map(
    lambda p, s: jax.device_put(p, NamedSharding(mesh, s)), params, specs
  )
  tx = fisher_optax.fadam(3e-3, weight_decay=1e-4)
  state = tx.init(params)  # optimizer state follows the param shardings
  step, fisher_diag = make_fns(apply_fn, tx)

  x, y = data["train"]
  rng = np.random.default_rng(FLAGS.seed)
  losses = []
  start = time.perf_counter()
  for _ in tqdm(range(steps), desc=f"FAdam on {n} device(s)", leave=False):
    idx = rng.integers(0, len(x), batch)
    xb = jax.device_put(x[idx], data_sharding)
    yb = jax.device_put(y[idx], data_sharding)
    params, state, loss = step(params, state, xb, yb)
    losses.append(float(loss))
  seconds = time.perf_counter() - start
  kernel = params["layers"][0]["kernel"]
  print(
    f"{steps} steps of global batch {batch} in {seconds:.1f} s; "
    f"first kernel sharding: {kernel.sharding.spec}"
  )

  # The Fisher of the trained model over a batch sharded across devices,
  # checked against the same estimate from unsharded (one-device) inputs.
  n_fisher = (min(len(x), 64 if FLAGS.small else 1024) // n) * n
  xs = jax.device_put(x[:n_fisher], data_sharding)
  ys = jax.device_put(y[:n_fisher], data_sharding)
  diag = fisher_diag(params, xs, ys)
  local = jax.device_get(params)
  ref = fisher_diag(local, x[:n_fisher], y[:n_fisher])
  err = max(
    float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
    for a, b in zip(jax.tree.leaves(jax.device_get(diag)), jax.tree.leaves(ref))
  )
  print(
    f"exact diagonal Fisher over {n_fisher} examples on {n} device(s); "
    f"max relative difference to one device: {err:.2e}"
  )
  acc = float(
    jnp.mean(
      jnp.argmax(apply_fn(local, data["test"][0]), -1) == data["test"][1]
    )
  )
  print(f"test accuracy {acc:.3f}")

  out = pathlib.Path(FLAGS.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
  ax1.plot(losses)
  ax1.set(
    xlabel="step",
    ylabel="train loss",
    yscale="log",
    title=f"FAdam, batch sharded over {n} device(s)",
  )
  names = [
    jax.tree_util.keystr(k)
    for k, _ in jax.tree_util.tree_leaves_with_path(diag)
  ]
  ax2.bar(
    range(len(names)), [float(jnp.mean(v)) for v in jax.tree.leaves(diag)]
  )
  ax2.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=6)
  ax2.set(
    ylabel="mean diagonal Fisher",
    yscale="log",
    title="Fisher per parameter leaf",
  )
  fig.tight_layout()
  path = out / "scaling_out.png"
  _notebook.show(fig, path)
  print(f"wrote {path} ({n} {jax.default_backend()} device(s))")


# %%
if __name__ == "__main__":
  _notebook.run(main)
