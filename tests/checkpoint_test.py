# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Orbax save/restore of every optimizer state, and exact resumption.

The recipe under test (README, "Flax, accumulation and checkpoints")::

  from fisher_optax import checkpoint

  checkpoint.save(path, {"params": params, "opt_state": opt_state})
  # Later, in a fresh process: rebuild tx, restore against an abstract target
  # so NamedTuple states (and typed PRNG keys) come back as such.
  target = {"params": jax.eval_shape(init_params),
            "opt_state": jax.eval_shape(tx.init, params_like)}
  restored = checkpoint.restore(path, target)

For each transform we train 3 steps, checkpoint, rebuild the transform and
restore into it, train 3 more, and require the trajectory to equal an
uninterrupted 6-step run (to 1e-7, in practice bitwise).
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import textwrap

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import fisher_optax
from fisher_optax import _checkpoint_io
from fisher_optax import checkpoint
from fisher_optax import fisher
from fisher_optax import flax as fo_flax

_STEPS = 6
_SPLIT = 3


def _apply(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]


def _init_params() -> dict[str, jax.Array]:
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "w1": 0.5 * jax.random.normal(k1, (6, 4)),
    "b1": jnp.zeros((4,)),
    "w2": 0.5 * jax.random.normal(k2, (4, 3)),
  }


def _loss(params, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(
    _apply(params, x), y
  ).mean()


def _batch(step: int) -> tuple[jax.Array, jax.Array]:
  kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(1), step))
  return (jax.random.normal(kx, (8, 6)), jax.random.randint(ky, (8,), 0, 3))


# Anchors and subspaces are data a real restart would reload with the
# checkpoint; they are computed once here (jitted: eager is slow).
@functools.cache
def _anchor() -> fisher_optax.EWCAnchor:
  @jax.jit
  def make(params, batch):
    cat = fisher.Categorical()
    diag = fisher.diagonal(_apply, params, batch, likelihood=cat, kind="exact")
    r1 = fisher.rank_one(
      _apply,
      params,
      batch,
      likelihood=cat,
      kind="empirical",
      direction="mean",
      scale="optimal",
    )
    return fisher_optax.consolidate(
      fisher_optax.init_ewc_anchor(params, diagonal=True, rank=1),
      params,
      diagonal=diag,
      low_rank=r1,
    )

  return make(_init_params(), _batch(100))


def _ewc_adam() -> optax.GradientTransformation:
  return optax.chain(
    fisher_optax.add_ewc_gradient(0.5, _anchor()), optax.adam(1e-2)
  )


@functools.cache
def _subspace() -> fisher_optax.ProtectedSubspace:
  @jax.jit
  def make(params, x, y):
    g = fisher.per_example_grads(
      lambda p, ex: _loss(p, ex[0][None], ex[1][None]), params, (x, y)
    )
    return fisher_optax.protected_subspace(g, max_rank=2, tau=0.99)

  return make(_init_params(), *_batch(200))


# Each factory is called afresh for the restored run: nothing is shared but
# the checkpoint.
_TRANSFORMS: dict[str, Callable[[], optax.GradientTransformation]] = {
  "fadam": lambda: fisher_optax.fadam(1e-2),
  "fadam_per_example": lambda: fisher_optax.fadam(
    1e-2, fisher_source="per_example"
  ),
  "inject_fadam": lambda: optax.inject_hyperparams(fisher_optax.fadam)(
    learning_rate=optax.linear_schedule(1e-2, 1e-3, 6)
  ),
  "fismo": lambda: fisher_optax.fismo(1e-2, precondition_interval=2),
  "natural_galore": lambda: fisher_optax.natural_galore(
    1e-2, rank=2, update_proj_gap=2, history_size=3, damping=1e-2
  ),
  "woodbury_fisher": lambda: fisher_optax.scale_by_woodbury_fisher(
    history_size=3, damping=1e-2
  ),
  "mfac": lambda: fisher_optax.mfac(1e-2, window_size=4, damping=1.0),
  "ewc": _ewc_adam,
  "physguard": lambda: fisher_optax.physguard(
    1e-2, max_rank=2, subspace=_subspace()
  ),
  "project_out_subspace": lambda: optax.chain(
    fisher_optax.project_out_subspace(2, subspace=_subspace()), optax.sgd(1e-1)
  ),
  "estimate_fisher_diag": lambda: optax.chain(
    fisher.estimate_fisher_diag(interval=2, decay=0.5), optax.sgd(1e-1)
  ),
  "estimate_fisher_diag_mc": lambda: optax.chain(
    fisher.estimate_fisher_diag(
      _apply, fisher.Categorical(), kind="mc", key=jax.random.key(3)
    ),
    optax.sgd(1e-1),
  ),
  "estimate_fisher_low_rank": lambda: optax.chain(
    fisher.estimate_fisher_low_rank(rank=2), optax.sgd(1e-1)
  ),
  "accumulate_fisher": lambda: fo_flax.accumulate_fisher(
    fisher_optax.fadam(1e-2, fisher_source="per_example"), every_k=2
  ),
  "multi_steps": lambda: optax.MultiSteps(
    fisher_optax.fadam(1e-2), 2
  ).gradient_transformation(),
}
# Extras each transform needs (default none); computing only these keeps
# the compiled steps small.
_EXTRAS = {
  "fadam_per_example": ("per_example_grads",),
  "estimate_fisher_diag": ("per_example_grads",),
  "estimate_fisher_diag_mc": ("batch",),
  "estimate_fisher_low_rank": ("per_example_grads",),
  "accumulate_fisher": ("per_example_grads",),
}


def _step_fn(tx: optax.GradientTransformation, extras: tuple[str, ...]):
  tx = optax.with_extra_args_support(tx)

  @jax.jit
  def step(params, state, x, y):
    grads = jax.grad(_loss)(params, x, y)
    available = {
      "per_example_grads": lambda: fisher.per_example_grads(
        lambda p, ex: _loss(p, ex[0][None], ex[1][None]), params, (x, y)
      ),
      "batch": lambda: (x, y),
      "obj_fn": lambda: lambda p: _loss(p, x, y),
    }
    kwargs = {k: available[k]() for k in extras}
    updates, state = tx.update(grads, state, params, **kwargs)
    return optax.apply_updates(params, updates), state

  return step


class CheckpointTest(parameterized.TestCase):
  @parameterized.named_parameters(*[(n, n) for n in _TRANSFORMS])
  def test_restore_resumes_exact_trajectory(self, name):
    factory = _TRANSFORMS[name]
    extras = _EXTRAS.get(name, ())
    params0 = _init_params()
    tx = factory()
    step = _step_fn(tx, extras)
    params, state = params0, tx.init(params0)
    reference = []
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "ckpt"
      for t in range(_STEPS):
        if t == _SPLIT:
          checkpoint.save(path, {"params": params, "opt_state": state})
        params, state = step(params, state, *_batch(t))
        reference.append(params)
      # A fresh transform and state, as in a new process.
      fresh_tx = factory()
      target = {
        "params": jax.eval_shape(_init_params),
        "opt_state": jax.eval_shape(fresh_tx.init, params0),
      }
      restored = checkpoint.restore(path, target)

    chex.assert_trees_all_equal_structs(
      restored["opt_state"], target["opt_state"]
    )
    self.assertIsInstance(restored["opt_state"], type(target["opt_state"]))
    fresh_step = _step_fn(fresh_tx, extras)
    params, state = restored["params"], restored["opt_state"]
    for t in range(_SPLIT, _STEPS):
      params, state = fresh_step(params, state, *_batch(t))
      chex.assert_trees_all_close(
        params,
        reference[t],
        atol=1e-7,
        rtol=0,
        custom_message=f"{name} step {t + 1}",
      )
    # The run must move the parameters, or the comparison is vacuous.
    moved = max(
      float(jnp.max(jnp.abs(a - b)))
      for a, b in zip(
        jax.tree.leaves(reference[-1]), jax.tree.leaves(reference[_SPLIT - 1])
      )
    )
    self.assertGreater(moved, 1e-5)

  def test_without_target_namedtuples_are_lost(self):
    """Why the recipe needs the abstract target."""
    params = _init_params()
    state = fisher_optax.fadam(1e-2).init(params)
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "ckpt"
      with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, state)
        ckptr.wait_until_finished()
        untyped = ckptr.restore(path)
    self.assertNotIsInstance(untyped, type(state))

  def test_merge_accumulator_state_resumes(self):
    acc = fisher_optax.fisher_merge_accumulator()
    acc = acc._replace(init=jax.jit(acc.init), add=jax.jit(acc.add))
    models = [
      jax.tree.map(lambda p, i=i: p + 0.1 * i, _init_params()) for i in range(4)
    ]
    fishers = [
      jax.tree.map(lambda p, i=i: jnp.abs(p) + 0.01 * (i + 1), m)
      for i, m in enumerate(models)
    ]
    full = acc.init(models[0], fishers[0])
    for m, f in zip(models[1:], fishers[1:]):
      full = acc.add(full, m, f)
    state = acc.add(acc.init(models[0], fishers[0]), models[1], fishers[1])
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "acc"
      checkpoint.save(path, state)
      state = checkpoint.restore(
        path, jax.eval_shape(acc.init, models[0], fishers[0])
      )
    for m, f in zip(models[2:], fishers[2:]):
      state = acc.add(state, m, f)
    chex.assert_trees_all_close(
      acc.finalize(state), acc.finalize(full), atol=1e-7, rtol=0
    )
    self.assertFalse(
      np.allclose(
        np.asarray(acc.finalize(full)["w1"]), np.asarray(models[0]["w1"])
      )
    )


class CheckpointModuleTest(absltest.TestCase):
  def test_overwrite_and_atomicity(self):
    tree = {"a": jnp.arange(3.0), "empty": jnp.zeros((0, 2))}
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "ckpt"
      checkpoint.save(path, tree)
      with self.assertRaisesRegex(FileExistsError, "overwrite"):
        checkpoint.save(path, tree)
      # "no" is truthy: it replaced the checkpoint.
      with self.assertRaisesRegex(TypeError, "overwrite must be True or False"):
        checkpoint.save(path, {"a": jnp.zeros(3)}, overwrite="no")
      chex.assert_trees_all_equal(
        checkpoint.restore(path, jax.eval_shape(lambda: tree))["a"], tree["a"]
      )
      # A failing save (a leaf orbax cannot write) leaves the old checkpoint
      # in place and no temporary directory behind.
      with self.assertRaises(Exception):  # noqa: B017 (orbax raises its own types)
        checkpoint.save(path, {"a": object()}, overwrite=True)
      self.assertEqual(
        sorted(p.name for p in pathlib.Path(tmp).iterdir()), ["ckpt"]
      )
      checkpoint.save(
        path, {"a": jnp.ones(3), "empty": jnp.zeros((0, 2))}, overwrite=True
      )
      back = checkpoint.restore(path, jax.eval_shape(lambda: tree))
      chex.assert_trees_all_equal(
        back, {"a": jnp.ones(3), "empty": jnp.zeros((0, 2))}
      )

  def test_overwrite_refuses_what_save_did_not_write(self):
    tree = {"a": jnp.arange(3.0)}
    with tempfile.TemporaryDirectory() as tmp:
      user = pathlib.Path(tmp) / "results"
      user.mkdir()
      (user / "notes.txt").write_text("keep me")
      theirs = pathlib.Path(tmp) / "theirs"
      with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(theirs, tree)
        ckptr.wait_until_finished()
      before = sorted(str(p) for p in pathlib.Path(tmp).rglob("*"))
      for path in (user, theirs):
        with self.assertRaisesRegex(
          FileExistsError, "not written by fisher_optax.*overwrite=True"
        ):
          checkpoint.save(path, tree, overwrite=True)
      self.assertEqual(
        sorted(str(p) for p in pathlib.Path(tmp).rglob("*")), before
      )
      self.assertEqual((user / "notes.txt").read_text(), "keep me")

  def test_restore_verifies_checksums(self):
    tree = {"a": jnp.arange(64.0)}
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "ckpt"
      checkpoint.save(path, tree)
      self.assertTrue((path / _checkpoint_io.MANIFEST).is_file())
      target = jax.eval_shape(lambda: tree)
      chex.assert_trees_all_equal(checkpoint.restore(path, target), tree)
      data = max(
        (
          p
          for p in path.rglob("*")
          if p.is_file() and p.name != _checkpoint_io.MANIFEST
        ),
        key=lambda p: p.stat().st_size,
      )
      raw = bytearray(data.read_bytes())
      raw[len(raw) // 2] ^= 0x10
      data.write_bytes(bytes(raw))
      with self.assertRaisesRegex(ValueError, "does not match its SHA-256"):
        checkpoint.restore(path, target)

  def test_save_killed_mid_write_is_cleaned_by_the_next_save(self):
    script = textwrap.dedent(
      """
      import sys, time
      import jax.numpy as jnp
      from fisher_optax import _checkpoint_io, checkpoint

      def stall(*args, **kwargs):  # written, not yet moved into place
        print("writing", flush=True)
        time.sleep(600)

      _checkpoint_io.commit = stall
      checkpoint.save(sys.argv[1], {"a": jnp.arange(3.0)})
      """
    )
    root = pathlib.Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "ckpt"
      proc = subprocess.Popen(
        [sys.executable, "-c", script, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu"),
      )
      try:
        assert proc.stdout is not None
        self.assertEqual(proc.stdout.readline().strip(), "writing")
        os.kill(proc.pid, signal.SIGKILL)
      finally:
        proc.kill()
        proc.wait()
        if proc.stdout:
          proc.stdout.close()
      left = [p.name for p in pathlib.Path(tmp).iterdir()]
      self.assertTrue(left)
      self.assertTrue(all(n.startswith(".ckpt.tmp-") for n in left), left)
      checkpoint.save(path, {"a": jnp.ones(3)})
      self.assertEqual([p.name for p in pathlib.Path(tmp).iterdir()], ["ckpt"])
      chex.assert_trees_all_equal(
        checkpoint.restore(path, {"a": jnp.zeros(3)}), {"a": jnp.ones(3)}
      )

  def test_target_shapes_and_dtypes_are_checked(self):
    saved = {"w": jnp.arange(6.0), "e": jnp.zeros((0, 2))}
    cases = {
      "w.*float32\\[6\\].*float32\\[2, 3\\]": {
        "w": jnp.zeros((2, 3)),
        "e": jnp.zeros((0, 2)),
      },
      "w.*float32\\[6\\].*bfloat16\\[6\\]": {
        "w": jnp.zeros(6, jnp.bfloat16),
        "e": jnp.zeros((0, 2)),
      },
      # A zero-size target would have thrown the saved values away.
      "w.*float32\\[6\\].*float32\\[0\\]": {
        "w": jnp.zeros(0),
        "e": jnp.zeros((0, 2)),
      },
      # Saved as a zero-size placeholder: there is nothing to restore.
      "no array at 'e'": {"w": jnp.zeros(6), "e": jnp.zeros((3, 2))},
    }
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "ckpt"
      checkpoint.save(path, saved)
      for match, target in cases.items():
        with self.subTest(match=match):
          with self.assertRaisesRegex(ValueError, match):
            checkpoint.restore(path, jax.eval_shape(lambda t=target: t))
      chex.assert_trees_all_equal(
        checkpoint.restore(path, jax.eval_shape(lambda: saved)), saved
      )

  def test_python_scalar_leaves(self):
    # A fresh Linen TrainState's step is a Python int.
    tree = {"step": 0, "f": 0.5, "w": jnp.ones(2)}
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "ckpt"
      checkpoint.save(path, tree)
      restored = checkpoint.restore(path, tree)
    self.assertEqual(int(restored["step"]), 0)
    self.assertEqual(float(restored["f"]), 0.5)

  def test_python_number_targets_take_the_saved_dtype(self):
    # An int target truncated a saved 2.7 to 2 (orbax casts to the target).
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "ckpt"
      checkpoint.save(path, {"s": jnp.float32(2.7), "t": 0.5})
      for target in ({"s": 0, "t": 1}, {"s": True, "t": 0.5}):
        restored = checkpoint.restore(path, target)
        np.testing.assert_allclose(restored["s"], 2.7, rtol=1e-7)
        np.testing.assert_allclose(restored["t"], 0.5)

  def test_numpy_float64_leaves_round_trip(self):
    # Saved as float64, compared with the target as JAX holds it (float32
    # without x64): no target could be restored into.
    tree = {"w": np.arange(3.0), "i": np.arange(3)}
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "ckpt"
      checkpoint.save(path, tree)
      restored = checkpoint.restore(path, tree)
    np.testing.assert_array_equal(restored["w"], tree["w"])
    np.testing.assert_array_equal(restored["i"], tree["i"])

  def test_prng_key_targets_are_checked(self):
    key = jax.random.key(3)
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "ckpt"
      checkpoint.save(path, {"k": jax.random.split(key, 3), "f": jnp.ones(2)})
      bad = {
        # Key data (3, 2) restored into one key, or a float into a key.
        "key data uint32\\[2\\]": {"k": key, "f": jnp.ones(2)},
        "uint32\\[3, 4\\]": {
          "k": jax.random.split(jax.random.key(0, impl="rbg"), 3),
          "f": jnp.ones(2),
        },
        "'f' is float32\\[2\\].*key data": {
          "k": jax.random.split(key, 3),
          "f": key,
        },
      }
      for match, target in bad.items():
        with self.subTest(match=match):
          with self.assertRaisesRegex(ValueError, match):
            checkpoint.restore(path, jax.eval_shape(lambda t=target: t))
      restored = checkpoint.restore(
        path, {"k": jax.random.split(key, 3), "f": jnp.ones(2)}
      )
      chex.assert_trees_all_equal(
        jax.random.key_data(restored["k"]),
        jax.random.key_data(jax.random.split(key, 3)),
      )
      # A uint32 target takes the keys' data.
      data = checkpoint.restore(
        path, {"k": jnp.zeros((3, 2), jnp.uint32), "f": jnp.ones(2)}
      )
      self.assertEqual(data["k"].dtype, jnp.uint32)

  def test_prng_key_of_another_implementation_with_the_same_data(self):
    # rbg and unsafe_rbg keys both hold uint32[4]: only the implementation
    # tells them apart, and a restored key of the wrong one was returned.
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "ckpt"
      checkpoint.save(path, {"k": jax.random.key(0, impl="rbg")})
      target = {"k": jax.random.key(0, impl="unsafe_rbg")}
      with self.assertRaisesRegex(ValueError, "key<rbg> key where the target"):
        checkpoint.restore(path, jax.eval_shape(lambda: target))

  def test_orbax_save_tree_refuses_zero_size_arrays(self):
    with tempfile.TemporaryDirectory() as tmp:
      with self.assertRaisesRegex(ValueError, "zero-size.*msgpack"):
        _checkpoint_io.save_tree(
          pathlib.Path(tmp) / "out", {"e": np.zeros((0, 3))}, fmt="orbax"
        )

  def test_missing_checkpoint(self):
    with tempfile.TemporaryDirectory() as tmp:
      with self.assertRaises(FileNotFoundError):
        checkpoint.restore(pathlib.Path(tmp) / "nothing", {"a": jnp.ones(2)})


if __name__ == "__main__":
  absltest.main()
