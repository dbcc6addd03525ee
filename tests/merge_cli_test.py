# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for the merge command line and checkpoint I/O."""

import argparse
import contextlib
import io
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
from flax import serialization
import jax
import jax.numpy as jnp
import numpy as np

import fisher_optax
from fisher_optax import _checkpoint_io
from fisher_optax import checkpoint
from fisher_optax import fisher
from fisher_optax import merge

_ROOT = pathlib.Path(__file__).resolve().parent.parent


class _MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(4, 6, rngs=rngs)
    self.head = nnx.Linear(6, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.hidden(x)))


def make_model():
  """The factory the ``fisher`` subcommand imports in these tests."""
  return _MLP(nnx.Rngs(0))


class _DropoutMLP(_MLP):
  """An NNX model whose state holds a typed PRNG key (its dropout's)."""

  def __init__(self, rngs: nnx.Rngs):
    super().__init__(rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.head(self.drop(jnp.tanh(self.hidden(x))))


def make_dropout_model():
  return _DropoutMLP(nnx.Rngs(0))


def make_apply_fn():
  """A plain ``apply_fn`` factory over a dict of params."""
  return lambda p, x: jnp.tanh(x @ p["w"]) @ p["v"]


def make_apply_fn_and_template():
  """A ``(apply_fn, params)`` factory, as ``examples.common.models`` returns."""
  return make_apply_fn(), {
    "w": np.zeros((4, 5), np.float32),
    "v": np.zeros((5, 3), np.float32),
  }


def _params(seed):
  # The tree of nnx.to_pure_dict(nnx.state(_MLP(...))), built in numpy.
  rng = np.random.default_rng(seed)
  return {
    name: {
      "kernel": rng.normal(size=shape).astype(np.float32),
      "bias": rng.normal(size=shape[1:]).astype(np.float32),
    }
    for name, shape in (("hidden", (4, 6)), ("head", (6, 3)))
  }


def _fisher(seed, like):
  rng = np.random.default_rng(100 + seed)
  return jax.tree.map(
    lambda x: rng.exponential(size=x.shape).astype(np.float32), like
  )


def _save(path, tree):
  pathlib.Path(path).write_bytes(
    serialization.msgpack_serialize(jax.tree.map(np.asarray, tree))
  )
  return str(path)


def _run(argv):
  err = io.StringIO()
  with (
    contextlib.redirect_stderr(err),
    contextlib.redirect_stdout(io.StringIO()),
  ):
    code = merge.run(argv)
  return code, err.getvalue()


class MergeCliTest(parameterized.TestCase):
  def setUp(self):
    super().setUp()
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    self.dir = pathlib.Path(tmp.name)
    self.params = [_params(s) for s in range(3)]
    self.fishers = [_fisher(s, self.params[0]) for s in range(3)]
    self.model_files = [
      _save(self.dir / f"m{i}.msgpack", p) for i, p in enumerate(self.params)
    ]
    self.fisher_files = [
      _save(self.dir / f"f{i}.msgpack", f) for i, f in enumerate(self.fishers)
    ]

  def _merge_args(self, output, models=None, fishers=None):
    return [
      "merge",
      "--models",
      *(models or self.model_files[:2]),
      "--fishers",
      *(fishers or self.fisher_files[:2]),
      "--output",
      str(output),
    ]

  def assert_fails(self, argv, pattern, output):
    code, err = _run(argv)
    self.assertEqual(code, 1, err)
    self.assertRegex(err, pattern)
    self.assertFalse(os.path.exists(output))
    self.assertEqual(
      [p.name for p in self.dir.iterdir() if p.name.startswith(".")], []
    )

  def test_msgpack_round_trip_matches_library(self):
    out = self.dir / "merged.msgpack"
    code, err = _run(
      self._merge_args(out, self.model_files, self.fisher_files)
      + [
        "--weights",
        "0.5",
        "0.2",
        "0.3",
        "--floor-mode",
        "target",
        "--keep-target",
        "^head/",
      ]
    )
    self.assertEqual(code, 0, err)
    merged = _checkpoint_io.load_tree(out)
    mask = {"hidden": True, "head": False}
    expected = fisher_optax.fisher_merge(
      self.params,
      self.fishers,
      np.array([0.5, 0.2, 0.3]),
      floor_mode="target",
      merge_mask=mask,
    )
    chex.assert_trees_all_close(merged, expected, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal(merged["head"], self.params[0]["head"])

  def test_orbax_round_trip_and_target_index(self):
    orbax_model = self.dir / "m1_orbax"
    _checkpoint_io.save_tree(orbax_model, self.params[1])
    self.assertEqual(_checkpoint_io.detect_format(orbax_model), "orbax")
    out = self.dir / "merged"
    code, err = _run(
      self._merge_args(out, [self.model_files[0], str(orbax_model)])
      + ["--target-index", "1", "--normalize"]
    )
    self.assertEqual(code, 0, err)
    self.assertEqual(_checkpoint_io.detect_format(out), "orbax")
    expected = fisher_optax.fisher_merge(
      self.params[:2], self.fishers[:2], target_index=1, normalize=True
    )
    chex.assert_trees_all_close(
      _checkpoint_io.load_tree(out), expected, rtol=1e-5, atol=1e-6
    )

  def test_console_entry_point(self):
    # `python -m fisher_optax.merge` reaches run(): a bad weight count is
    # reported on stderr with exit status 1, before any heavy work.
    proc = subprocess.run(
      [
        sys.executable,
        "-m",
        "fisher_optax.merge",
        *self._merge_args(self.dir / "merged.msgpack"),
        "--weights",
        "1",
      ],
      cwd=_ROOT,
      capture_output=True,
      text=True,
      check=False,
      env=dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu"),
    )
    self.assertEqual(proc.returncode, 1, proc.stderr[-2000:])
    self.assertIn(
      "fisher-merge: error: Got 1 weights for 2 models", proc.stderr
    )

  def _bad(self, name, tree):
    return _save(self.dir / name, tree)

  def test_validation_errors_name_the_leaf_and_write_nothing(self):
    out = self.dir / "merged.msgpack"
    p, f = self.params[1], self.fishers[1]
    m0, f0 = self.model_files[0], self.fisher_files[0]

    def with_leaf(tree, value):
      return {**tree, "head": {**tree["head"], "kernel": value}}

    cases = [
      # (models, fishers, error pattern)
      (
        [m0, self._bad("missing.msgpack", {"hidden": p["hidden"]})],
        None,
        r"lacks leaf 'head/bias'",
      ),
      (
        [m0, self._bad("extra.msgpack", {**p, "extra": np.zeros(2)})],
        None,
        r"has leaf 'extra'",
      ),
      (
        [m0, self._bad("shape.msgpack", with_leaf(p, np.zeros((6, 4))))],
        None,
        r"'head/kernel' has shape \(6, 4\)",
      ),
      (
        [
          m0,
          self._bad(
            "dtype.msgpack",
            with_leaf(p, p["head"]["kernel"].astype(jnp.bfloat16)),
          ),
        ],
        None,
        r"'head/kernel' has dtype bfloat16",
      ),
      (
        [
          m0,
          self._bad(
            "nan.msgpack", with_leaf(p, np.full((6, 3), np.nan, np.float32))
          ),
        ],
        None,
        r"'head/kernel' has non-finite",
      ),
      (
        None,
        [
          f0,
          self._bad("fneg.msgpack", with_leaf(f, -np.ones((6, 3), np.float32))),
        ],
        r"18 negative entries",
      ),
      (
        None,
        [
          f0,
          self._bad(
            "finf.msgpack", with_leaf(f, np.full((6, 3), np.inf, np.float32))
          ),
        ],
        r"fneg|finf.*'head/kernel' has non-finite",
      ),
      (
        None,
        [
          f0,
          self._bad("fshape.msgpack", with_leaf(f, np.ones((3,), np.float32))),
        ],
        r"'head/kernel' has shape \(3,\)",
      ),
      (
        None,
        [
          f0,
          self._bad("fint.msgpack", with_leaf(f, np.ones((6, 3), np.int32))),
        ],
        r"Fisher must\s+be floating",
      ),
      (
        None,
        [f0, self._bad("fmissing.msgpack", {"head": f["head"]})],
        r"lacks leaf 'hidden/bias'",
      ),
    ]
    for models, fishers, pattern in cases:
      with self.subTest(pattern):
        self.assert_fails(self._merge_args(out, models, fishers), pattern, out)

  def test_argument_errors(self):
    out = self.dir / "merged.msgpack"
    args = self._merge_args(out)
    self.assert_fails(args + ["--weights", "1"], "2 models", out)
    self.assert_fails(args + ["--weights", "1", "-1"], "Weights", out)
    self.assert_fails(args + ["--weights", "0", "0"], "not all zero", out)
    self.assert_fails(args + ["--target-index", "2"], "target-index", out)
    self.assert_fails(args + ["--floor", "-1"], "floor", out)
    self.assert_fails(
      args + ["--keep-target", "nohead"], "matches no leaf", out
    )
    self.assert_fails(
      self._merge_args(out, fishers=self.fisher_files[:1]),
      "one\\s+Fisher per model",
      out,
    )

  def test_unknown_and_pickle_formats_are_refused(self):
    out = self.dir / "merged.msgpack"
    pkl = self.dir / "model.pkl"
    pkl.write_bytes(b"\x80\x04K\x01.")  # a pickle; must never be loaded
    self.assert_fails(
      self._merge_args(out, [self.model_files[0], str(pkl)]),
      "may be pickles",
      out,
    )
    odd = self.dir / "model.safetensors"
    odd.write_bytes(b"{}")
    self.assert_fails(
      self._merge_args(out, [self.model_files[0], str(odd)]),
      "Unknown checkpoint format",
      out,
    )
    plain_dir = self.dir / "not_a_checkpoint"
    plain_dir.mkdir()
    self.assert_fails(
      self._merge_args(out, [self.model_files[0], str(plain_dir)]),
      "not an orbax checkpoint",
      out,
    )
    garbage = self.dir / "garbage.msgpack"
    garbage.write_bytes(b"\xc1\xc1\xc1")
    self.assert_fails(
      self._merge_args(out, [self.model_files[0], str(garbage)]),
      "not a valid flax msgpack",
      out,
    )
    self.assert_fails(
      self._merge_args(self.dir / "out.txt"),
      "Cannot infer the output format",
      self.dir / "out.txt",
    )
    self.assert_fails(
      self._merge_args(out, [self.model_files[0], str(self.dir / "nope")]),
      "No checkpoint",
      out,
    )

  def test_existing_output_needs_overwrite(self):
    # An earlier output of the command (a foreign file is refused even with
    # --overwrite: test_overwrite_refuses_what_we_did_not_write).
    out = self.dir / "merged.msgpack"
    self.assertEqual(_run(self._merge_args(out, self.model_files[1:]))[0], 0)
    old = out.read_bytes()
    code, err = _run(self._merge_args(out))
    self.assertEqual(code, 1)
    self.assertIn("--overwrite", err)
    self.assertNotIn("overwrite=True", err)
    self.assertEqual(out.read_bytes(), old)
    code, err = _run(self._merge_args(out) + ["--overwrite"])
    self.assertEqual(code, 0, err)
    self.assertNotEqual(out.read_bytes(), old)

  @parameterized.parameters("merged.msgpack", "merged_dir")
  def test_crash_before_rename_leaves_no_output(self, name):
    out = self.dir / name
    with (
      mock.patch.object(
        _checkpoint_io, "commit", side_effect=KeyboardInterrupt
      ),
      self.assertRaises(KeyboardInterrupt),
    ):
      merge.run(self._merge_args(out))
    self.assertFalse(out.exists())
    self.assertEqual(
      [p.name for p in self.dir.iterdir() if p.name.startswith(".")], []
    )

  def test_crash_keeps_existing_output(self):
    out = self.dir / "merged.msgpack"
    self.assertEqual(_run(self._merge_args(out))[0], 0)
    before = out.read_bytes()
    with (
      mock.patch.object(
        _checkpoint_io, "commit", side_effect=KeyboardInterrupt
      ),
      self.assertRaises(KeyboardInterrupt),
    ):
      merge.run(
        self._merge_args(out, self.model_files[1:], self.fisher_files[1:])
        + ["--overwrite"]
      )
    self.assertEqual(out.read_bytes(), before)

  def test_failed_directory_swap_restores_old_output(self):
    out = self.dir / "merged_dir"
    _checkpoint_io.save_tree(out, self.params[0])
    real_rename = os.rename
    calls = []

    def flaky_rename(src, dst):
      calls.append(src)
      if len(calls) == 2:  # the rename of the new output into place
        raise OSError("disk full")
      return real_rename(src, dst)

    # The portable swap (move aside, rename, delete); Linux swaps with one
    # renameat2(RENAME_EXCHANGE), tested below.
    with (
      mock.patch.object(_checkpoint_io, "_renameat2", None),
      mock.patch.object(_checkpoint_io.os, "rename", flaky_rename),
    ):
      with self.assertRaisesRegex(OSError, "disk full"):
        _checkpoint_io.save_tree(out, self.params[1], overwrite=True)
    chex.assert_trees_all_equal(_checkpoint_io.load_tree(out), self.params[0])
    self.assertEqual(
      [p.name for p in self.dir.iterdir() if p.name.startswith(".")], []
    )


class FisherCommandTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    self.dir = pathlib.Path(tmp.name)
    rng = np.random.default_rng(0)
    self.x = rng.normal(size=(40, 4)).astype(np.float32)
    self.y = (np.arange(40) % 3).astype(np.int32)
    self.data = self.dir / "data.npz"
    np.savez(self.data, x=self.x, y=self.y)

  def test_nnx_model_fisher_matches_engine_and_merges(self):
    models = [_MLP(nnx.Rngs(seed)) for seed in (0, 1)]
    ckpts = [
      _save(self.dir / f"m{i}.msgpack", nnx.to_pure_dict(nnx.state(m)))
      for i, m in enumerate(models)
    ]
    out = self.dir / "f0.msgpack"
    code, err = _run(
      [
        "fisher",
        "--model",
        f"{__name__}:make_model",
        "--params",
        ckpts[0],
        "--data",
        str(self.data),
        "--output",
        str(out),
        "--batch-size",
        "20",
      ]
    )
    self.assertEqual(code, 0, err)
    graphdef, _ = nnx.split(models[0])
    exact = jax.jit(
      lambda s: (
        fisher.diagonal(
          lambda p, x: nnx.merge(graphdef, p)(x),
          s,
          (jnp.asarray(self.x), None),
          likelihood=fisher.Categorical(),
          kind="exact",
        ).diag
      )
    )
    expected = [nnx.to_pure_dict(exact(nnx.state(m))) for m in models]
    chex.assert_trees_all_close(
      _checkpoint_io.load_tree(out), expected[0], rtol=1e-5, atol=1e-7
    )
    # The Fisher file plugs straight into merge.
    f1 = _save(self.dir / "f1.msgpack", expected[1])
    merged = self.dir / "merged.msgpack"
    code, err = _run(
      [
        "merge",
        "--models",
        *ckpts,
        "--fishers",
        str(out),
        f1,
        "--output",
        str(merged),
      ]
    )
    self.assertEqual(code, 0, err)
    chex.assert_trees_all_close(
      _checkpoint_io.load_tree(merged),
      fisher_optax.fisher_merge(
        [nnx.to_pure_dict(nnx.state(m)) for m in models], expected
      ),
      rtol=1e-5,
      atol=1e-6,
    )

  def test_apply_fn_factory_and_subsampling(self):
    params = {
      "w": np.ones((4, 5), np.float32) / 3,
      "v": np.ones((5, 3), np.float32) / 5,
      "step": np.array(7, np.int32),
    }
    ckpt = _save(self.dir / "p.msgpack", params)
    out = self.dir / "f.msgpack"
    code, err = _run(
      [
        "fisher",
        "--model",
        f"{__name__}:make_apply_fn",
        "--params",
        ckpt,
        "--data",
        str(self.data),
        "--output",
        str(out),
        "--kind",
        "empirical",
        "--max-examples",
        "10",
        "--seed",
        "3",
      ]
    )
    self.assertEqual(code, 0, err)
    got = _checkpoint_io.load_tree(out)
    idx = np.sort(np.random.default_rng(3).choice(40, 10, replace=False))
    float_params = {"w": params["w"], "v": params["v"]}
    expected = jax.jit(
      lambda p: fisher.diagonal(
        make_apply_fn(),
        p,
        (self.x[idx], jnp.asarray(self.y[idx])),
        likelihood=fisher.Categorical(),
        kind="empirical",
      )
    )(float_params)
    chex.assert_trees_all_close(
      {"w": got["w"], "v": got["v"]}, expected.diag, rtol=1e-5
    )
    np.testing.assert_array_equal(got["step"], np.zeros((), np.float32))
    # The (apply_fn, params) form checks the checkpoint against the template.
    code, err = _run(
      [
        "fisher",
        "--model",
        f"{__name__}:make_apply_fn_and_template",
        "--params",
        ckpt,
        "--data",
        str(self.data),
        "--output",
        str(self.dir / "f2.msgpack"),
      ]
    )
    self.assertEqual(code, 1)
    self.assertIn("has leaf 'step'", err)

  def test_fisher_errors(self):
    ckpt = _save(self.dir / "m.msgpack", {"hidden": {"kernel": np.ones(2)}})
    out = self.dir / "f.msgpack"
    base = [
      "fisher",
      "--params",
      ckpt,
      "--data",
      str(self.data),
      "--output",
      str(out),
    ]
    for model, pattern in [
      ("no_colon", "package.module:factory"),
      (f"{__name__}:nope", "no attribute"),
      (f"{__name__}:make_model", "lacks parameter"),
    ]:
      with self.subTest(model):
        code, err = _run(base[:1] + ["--model", model] + base[1:])
        self.assertEqual(code, 1)
        self.assertRegex(err, pattern)
        self.assertFalse(out.exists())
    np.savez(self.dir / "nox.npz", inputs=self.x)
    code, err = _run(
      [
        "fisher",
        "--model",
        f"{__name__}:make_model",
        "--params",
        ckpt,
        "--data",
        str(self.dir / "nox.npz"),
        "--output",
        str(out),
      ]
    )
    self.assertEqual(code, 1)
    self.assertIn("no array 'x'", err)

  def _fisher_args(self, model, ckpt, data, out, *extra):
    return [
      "fisher",
      "--model",
      f"{__name__}:{model}",
      "--params",
      str(ckpt),
      "--data",
      str(data),
      "--output",
      str(out),
      *extra,
    ]

  def test_nnx_state_with_rng_keys_round_trips(self):
    # Saved the documented way (orbax, nnx.state), dropout's key included.
    models = [_DropoutMLP(nnx.Rngs(seed)) for seed in (0, 1)]
    ckpts = [self.dir / f"m{i}" for i in range(2)]
    for m, c in zip(models, ckpts):
      checkpoint.save(c, nnx.state(m))
    fishers = [self.dir / f"f{i}.msgpack" for i in range(2)]
    for c, f in zip(ckpts, fishers):
      code, err = _run(self._fisher_args("make_dropout_model", c, self.data, f))
      self.assertEqual(code, 0, err)
    flat = merge._flat(_checkpoint_io.load_tree(fishers[0]))
    self.assertTrue(flat["drop/rngs/key/value"].dtype == np.float32)
    np.testing.assert_array_equal(flat["drop/rngs/key/value"], 0.0)
    self.assertGreater(float(np.sum(flat["hidden/kernel/value"])), 0.0)
    out = self.dir / "merged"
    models_arg = ["--models", *map(str, ckpts), "--fishers", *map(str, fishers)]
    code, err = _run(["merge", *models_arg, "--output", str(out)])
    self.assertEqual(code, 0, err)
    merged = merge._flat(_checkpoint_io.load_tree(out))
    target = merge._flat(_checkpoint_io.load_tree(ckpts[0]))
    key = merged["drop/rngs/key/value"]  # the target's, still a typed key
    self.assertTrue(_checkpoint_io.is_key(key))
    np.testing.assert_array_equal(
      jax.random.key_data(key),
      jax.random.key_data(target["drop/rngs/key/value"]),
    )
    # flax msgpack cannot hold a typed key: a clear error, nothing written.
    code, err = _run(
      ["merge", *models_arg, "--output", str(self.dir / "m.msgpack")]
    )
    self.assertEqual(code, 1)
    self.assertIn("cannot hold typed PRNG key arrays", err)
    self.assertFalse((self.dir / "m.msgpack").exists())

  def test_exact_kind_ignores_the_files_labels(self):
    ckpt = _save(self.dir / "m.msgpack", _params(0))
    # Labels exact and mc never read: one-hot, strings, no labels at all.
    files = {
      "onehot": {"y": np.eye(3, dtype=np.float32)[self.y]},
      "strings": {"y": np.array(["a"] * 40)},
      "none": {},
    }
    got = {}
    for name, extra in files.items():
      data = self.dir / f"{name}.npz"
      np.savez(data, x=self.x, **extra)
      out = self.dir / f"f_{name}.msgpack"
      code, err = _run(self._fisher_args("make_model", ckpt, data, out))
      self.assertEqual(code, 0, err)
      got[name] = _checkpoint_io.load_tree(out)
    chex.assert_trees_all_equal(got["onehot"], got["none"])
    chex.assert_trees_all_equal(got["strings"], got["none"])
    # The empirical kind reads them, and says so when they are missing.
    out = self.dir / "f_emp.msgpack"
    code, err = _run(
      self._fisher_args(
        "make_model", ckpt, self.dir / "none.npz", out, "--kind", "empirical"
      )
    )
    self.assertEqual(code, 1)
    self.assertIn("--kind empirical needs targets 'y'", err)

  def test_data_that_is_not_an_npz_archive_is_a_clear_error(self):
    ckpt = _save(self.dir / "m.msgpack", _params(0))
    np.save(self.dir / "x.npy", self.x)
    for data in (self.dir / "x.npy", ckpt, self.dir / "missing.npz"):
      with self.subTest(pathlib.Path(data).name):
        out = self.dir / "f.msgpack"
        code, err = _run(self._fisher_args("make_model", ckpt, data, out))
        self.assertEqual(code, 1)
        self.assertTrue(err.startswith("fisher-merge: error: "), err)
        self.assertRegex(err, r"is not an \.npz archive|Cannot read")
        self.assertNotIn("Traceback", err)
        self.assertFalse(out.exists())

  def test_data_without_examples_is_a_clear_error(self):
    ckpt = _save(self.dir / "m.msgpack", _params(0))
    empty = self.dir / "empty.npz"
    np.savez(empty, x=np.zeros((0, 4), np.float32), y=np.zeros(0, np.int32))
    out = self.dir / "f.msgpack"
    code, err = _run(
      [
        "fisher",
        "--model",
        f"{__name__}:make_model",
        "--params",
        ckpt,
        "--data",
        str(empty),
        "--output",
        str(out),
      ]
    )
    self.assertEqual(code, 1)
    self.assertRegex(err, r"empty.npz' holds no examples: .*'x'.*\(0, 4\)")
    self.assertFalse(out.exists())


def _run_out(argv):
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
    code = merge.run(argv)
  return code, out.getvalue(), err.getvalue()


def _dot_files(d):
  return sorted(p.name for p in pathlib.Path(d).iterdir() if p.name[0] == ".")


def _flip_byte(path, offset=-1):
  data = bytearray(pathlib.Path(path).read_bytes())
  data[offset] ^= 0x01
  pathlib.Path(path).write_bytes(bytes(data))


def _largest_file(d):  # an array file of an orbax checkpoint
  return max(
    (
      p
      for p in pathlib.Path(d).rglob("*")
      if p.is_file() and p.name != _checkpoint_io.MANIFEST
    ),
    key=lambda p: p.stat().st_size,
  )


class WriterSafetyTest(parameterized.TestCase):
  """What the writers never destroy, and what a killed run leaves behind."""

  def setUp(self):
    super().setUp()
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    self.dir = pathlib.Path(tmp.name)
    self.params = [_params(s) for s in range(2)]
    self.models = []
    for i, p in enumerate(self.params):  # outputs of ours: with checksums
      self.models.append(str(self.dir / f"m{i}.msgpack"))
      _checkpoint_io.save_tree(self.models[-1], p)
    self.fishers = [
      _save(self.dir / f"f{i}.msgpack", _fisher(i, self.params[0]))
      for i in range(2)
    ]

  def _args(self, output, *extra):
    return [
      "merge",
      "--models",
      *self.models,
      "--fishers",
      *self.fishers,
      "--output",
      str(output),
      *extra,
    ]

  @parameterized.parameters("victim", "victim.msgpack")
  def test_overwrite_refuses_what_we_did_not_write(self, name):
    victim = self.dir / name
    if name.endswith(".msgpack"):  # a file another program wrote
      victim.write_bytes(b"user data")
    else:  # an ordinary directory holding a user's files
      victim.mkdir()
      (victim / "thesis.tex").write_text("years of work")
      (victim / "sub").mkdir()
      (victim / "sub" / "data.csv").write_text("1,2")
    before = sorted(
      (str(p), p.read_bytes() if p.is_file() else b"")
      for p in [victim, *victim.rglob("*")]
    )
    code, err = _run(self._args(victim, "--overwrite"))
    self.assertEqual(code, 1, err)
    self.assertIn("not written by fisher_optax", err)
    self.assertIn("--overwrite", err)
    self.assertNotIn("overwrite=True", err)
    after = sorted(
      (str(p), p.read_bytes() if p.is_file() else b"")
      for p in [victim, *victim.rglob("*")]
    )
    self.assertEqual(after, before)
    self.assertEqual(_dot_files(self.dir), [])

  def test_overwrite_refuses_an_orbax_checkpoint_we_did_not_write(self):
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    theirs = self.dir / "theirs"
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(theirs, self.params[1])
      ckptr.wait_until_finished()
    code, err = _run(self._args(theirs, "--overwrite"))
    self.assertEqual(code, 1, err)
    self.assertIn("no fisher_optax.sha256 inside", err)
    chex.assert_trees_all_equal(
      _checkpoint_io.load_tree(theirs), self.params[1]
    )

  @parameterized.parameters("merged.msgpack", "merged")
  def test_overwrite_replaces_our_output(self, name):
    out = self.dir / name
    self.assertEqual(_run(self._args(out, "--weights", "1", "0"))[0], 0)
    chex.assert_trees_all_close(_checkpoint_io.load_tree(out), self.params[0])
    code, err = _run(self._args(out, "--weights", "0", "1", "--overwrite"))
    self.assertEqual(code, 0, err)
    chex.assert_trees_all_close(_checkpoint_io.load_tree(out), self.params[1])
    self.assertTrue(_checkpoint_io.verify_checksums(out))
    self.assertEqual(_dot_files(self.dir), [])

  @parameterized.product(name=("merged.msgpack", "merged"), overwrite=(0, 1))
  def test_output_appearing_during_the_write_is_not_replaced(
    self, name, overwrite
  ):
    out = self.dir / name
    real_commit = _checkpoint_io.commit

    def racing_commit(tmp, path, **kwargs):
      # Another program creates the output after the existence check.
      if name.endswith(".msgpack"):
        path.write_bytes(b"theirs")
      else:
        path.mkdir()
        (path / "theirs.txt").write_bytes(b"theirs")
      return real_commit(tmp, path, **kwargs)

    with mock.patch.object(_checkpoint_io, "commit", racing_commit):
      code, err = _run(self._args(out, *["--overwrite"] * overwrite))
    self.assertEqual(code, 1, err)
    self.assertIn("not written by" if overwrite else "exists; pass", err)
    theirs = out if name.endswith(".msgpack") else out / "theirs.txt"
    self.assertEqual(theirs.read_bytes(), b"theirs")
    self.assertEqual(_dot_files(self.dir), [])
    self.assertFalse((self.dir / f"{name}.sha256").exists())

  def test_exclusive_directory_rename_without_renameat2(self):
    # The portable path refuses a non-empty directory that appeared.
    tmp, out = self.dir / ".new", self.dir / "out"
    tmp.mkdir()
    out.mkdir()
    (out / "f").write_text("x")
    with mock.patch.object(_checkpoint_io, "_renameat2", None):
      with self.assertRaises(FileExistsError):
        _checkpoint_io._place_new(tmp, out)
    self.assertEqual((out / "f").read_text(), "x")

  @parameterized.parameters("merged.msgpack", "merged")
  def test_sigkill_during_write_then_a_clean_run(self, name):
    out = self.dir / name
    script = textwrap.dedent(
      """
      import sys, time
      from fisher_optax import _checkpoint_io, merge

      def stall(*args, **kwargs):  # the output is written, not yet moved
        print("writing", flush=True)
        time.sleep(600)

      _checkpoint_io.commit = stall
      sys.exit(merge.run(sys.argv[1:]))
      """
    )
    proc = subprocess.Popen(
      [sys.executable, "-c", script, *self._args(out)],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu"),
    )
    try:
      line = proc.stdout.readline() if proc.stdout else ""
      self.assertEqual(line.strip(), "writing", proc.stderr)
      os.kill(proc.pid, signal.SIGKILL)
    finally:
      proc.kill()
      proc.wait()
      for f in (proc.stdout, proc.stderr):
        if f:
          f.close()
    self.assertEqual(proc.returncode, -signal.SIGKILL)
    leftovers = _dot_files(self.dir)
    self.assertTrue(leftovers)
    self.assertTrue(all(n.startswith(f".{name}.tmp-") for n in leftovers))
    self.assertFalse(out.exists())
    # The next run removes what the killed one left, and succeeds.
    code, err = _run(self._args(out))
    self.assertEqual(code, 0, err)
    self.assertEqual(_dot_files(self.dir), [])
    self.assertTrue(_checkpoint_io.verify_checksums(out))

  def test_sidecar_without_its_file(self):
    out = self.dir / "merged.msgpack"
    sidecar = self.dir / "merged.msgpack.sha256"
    sidecar.write_text("user notes\n")  # not ours: refused, kept
    code, err = _run(self._args(out))
    self.assertEqual(code, 1)
    self.assertIn("not a checksum file of fisher_optax", err)
    self.assertEqual(sidecar.read_text(), "user notes\n")
    sidecar.write_text(f"{'0' * 64}  merged.msgpack\n")  # ours; file deleted
    self.assertEqual(_run(self._args(out))[0], 0)
    self.assertTrue(_checkpoint_io.verify_checksums(out))

  def test_temporaries_of_a_live_writer_are_kept(self):
    live = self.dir / f".out.msgpack.tmp-{os.getpid()}-abc123"
    dead = self.dir / ".out.msgpack.tmp-999999999-abc123"
    other = self.dir / ".other.msgpack.tmp-999999999-abc123"
    for p in (live, dead, other):
      p.write_bytes(b"x")
    removed = _checkpoint_io.clean_leftovers(self.dir / "out.msgpack")
    self.assertEqual(removed, [dead.name])
    self.assertTrue(live.exists() and other.exists())

  def test_moved_aside_output_is_restored(self):
    # A kill between the two renames of the portable directory swap.
    out = self.dir / "ckpt"
    _checkpoint_io.save_tree(out, self.params[0])
    os.rename(out, self.dir / ".ckpt.old-999999999-abc123")
    self.assertEqual(
      _checkpoint_io.clean_leftovers(out), [".ckpt.old-999999999-abc123"]
    )
    chex.assert_trees_all_equal(_checkpoint_io.load_tree(out), self.params[0])

  @parameterized.parameters("merged.msgpack", "merged")
  def test_outputs_respect_the_umask(self, name):
    old = os.umask(0o027)
    try:
      self.assertEqual(_run(self._args(self.dir / name))[0], 0)
    finally:
      os.umask(old)
    out = self.dir / name
    files = (
      [out, self.dir / f"{name}.sha256"]
      if out.is_file()
      else [out / _checkpoint_io.MANIFEST]
    )
    for f in files:
      self.assertEqual(f.stat().st_mode & 0o777, 0o640, f)
    for f in out.rglob("*") if out.is_dir() else []:
      self.assertEqual(f.stat().st_mode & 0o027, 0, f)

  def test_finite_float64_beyond_float32_is_accepted(self):
    big = {"w": np.array([1e300, 2.0, -3.0])}
    models = [
      _save(self.dir / "a64.msgpack", big),
      _save(self.dir / "b64.msgpack", {"w": np.array([0.0, 4.0, 1.0])}),
    ]
    fishers = [
      _save(self.dir / "fa64.msgpack", {"w": np.array([1e300, 1.0, 3.0])}),
      _save(self.dir / "fb64.msgpack", {"w": np.array([1e300, 1.0, 1.0])}),
    ]
    out = self.dir / "m64.msgpack"
    code, err = _run(
      [
        "merge",
        "--models",
        *models,
        "--fishers",
        *fishers,
        "--output",
        str(out),
      ]
    )
    self.assertEqual(code, 0, err)
    merged = _checkpoint_io.load_tree(out)["w"]
    self.assertEqual(merged.dtype, np.float64)
    np.testing.assert_allclose(merged, [5e299, 3.0, -2.0], rtol=1e-12)
    # A float32 model cannot be merged with such a Fisher: a clear error.
    f32 = {"w": np.ones(3, np.float32)}
    models32 = [_save(self.dir / f"{i}32.msgpack", f32) for i in "ab"]
    code, err = _run(
      [
        "merge",
        "--models",
        *models32,
        "--fishers",
        *fishers,
        "--output",
        str(self.dir / "m32.msgpack"),
      ]
    )
    self.assertEqual(code, 1)
    self.assertIn("beyond float32", err)
    self.assertFalse((self.dir / "m32.msgpack").exists())

  def test_float64_models_are_merged_with_float64_weights(self):
    models = [
      _save(self.dir / "a64.msgpack", {"w": np.array([2.0, 0.1])}),
      _save(self.dir / "b64.msgpack", {"w": np.array([5.0, 0.7])}),
    ]
    ones = _save(self.dir / "f64.msgpack", {"w": np.ones(2)})
    out = self.dir / "m64.msgpack"
    merge.merge_checkpoints(models, [ones, ones], str(out), weights=[0.3, 0.7])
    merged = _checkpoint_io.load_tree(out)["w"]
    self.assertEqual(merged.dtype, np.float64)
    # float32 weights would be off by ~1e-8 relative.
    np.testing.assert_allclose(
      merged, [0.3 * 2.0 + 0.7 * 5.0, 0.3 * 0.1 + 0.7 * 0.7], rtol=1e-14
    )

  def test_tiny_weights_merge_as_fisher_merge(self):
    # Below float32's smallest normal number; scaled on the host first.
    models = [
      _save(self.dir / "a.msgpack", {"w": np.array([0.0], np.float32)}),
      _save(self.dir / "b.msgpack", {"w": np.array([1.0], np.float32)}),
    ]
    ones = _save(self.dir / "f.msgpack", {"w": np.ones(1, np.float32)})
    out = self.dir / "tiny.msgpack"
    merge.merge_checkpoints(
      models, [ones, ones], str(out), weights=[1e-39, 3e-39]
    )
    np.testing.assert_allclose(_checkpoint_io.load_tree(out)["w"], [0.75])

  @parameterized.parameters(np.nan, np.inf, -np.inf)
  def test_non_finite_fisher_is_refused_and_nothing_written(self, value):
    bad = jax.tree.map(np.copy, _fisher(1, self.params[0]))
    bad["hidden"]["bias"][2] = value
    fishers = [self.fishers[0], _save(self.dir / "bad.msgpack", bad)]
    out = self.dir / "merged.msgpack"
    code, err = _run(
      [
        "merge",
        "--models",
        *self.models,
        "--fishers",
        *fishers,
        "--output",
        str(out),
      ]
    )
    self.assertEqual(code, 1)
    self.assertRegex(err, r"bad.msgpack leaf 'hidden/bias' has non-finite")
    self.assertFalse(out.exists())
    self.assertEqual(_dot_files(self.dir), [])

  def test_non_finite_merged_result_is_not_written(self):
    nan = jax.tree.map(lambda x: np.full_like(x, np.nan), self.params[0])
    out = self.dir / "merged.msgpack"
    with mock.patch.object(merge, "_stream_merge", return_value=nan):
      code, err = _run(self._args(out))
    self.assertEqual(code, 1)
    self.assertIn("non-finite", err)
    self.assertFalse(out.exists())

  @parameterized.parameters("msgpack", "orbax")
  def test_flipped_byte_is_an_error(self, fmt):
    path = self.dir / ("m1.msgpack" if fmt == "msgpack" else "m1_orbax")
    if fmt == "orbax":
      _checkpoint_io.save_tree(path, self.params[1])
    self.assertTrue(_checkpoint_io.verify_checksums(path))
    if shutil.which("sha256sum"):  # the sidecar is sha256sum's format
      subprocess.run(
        ["sha256sum", "--quiet", "-c", _checkpoint_io.MANIFEST]
        if fmt == "orbax"
        else ["sha256sum", "--quiet", "-c", f"{path.name}.sha256"],
        cwd=path if fmt == "orbax" else self.dir,
        check=True,
      )
    _flip_byte(path if fmt == "msgpack" else _largest_file(path))
    out = self.dir / "merged.msgpack"
    code, err = _run(
      [
        "merge",
        "--models",
        self.models[0],
        str(path),
        "--fishers",
        *self.fishers,
        "--output",
        str(out),
      ]
    )
    self.assertEqual(code, 1)
    self.assertIn("does not match its SHA-256 checksum", err)
    self.assertFalse(out.exists())

  def test_damaged_or_incomplete_checksums_are_errors(self):
    sidecar = pathlib.Path(self.models[1] + ".sha256")
    sidecar.write_text("not a checksum\n")
    with self.assertRaisesRegex(_checkpoint_io.ChecksumError, "damaged"):
      _checkpoint_io.load_tree(self.models[1])
    ckpt = self.dir / "ck"
    _checkpoint_io.save_tree(ckpt, self.params[1])
    (ckpt / "_METADATA").unlink()
    with self.assertRaisesRegex(_checkpoint_io.ChecksumError, "missing"):
      _checkpoint_io.load_tree(ckpt)


class CommandLineTest(absltest.TestCase):
  """The console script, its help, its hints and its example recipe."""

  def setUp(self):
    super().setUp()
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    self.dir = pathlib.Path(tmp.name)

  def test_console_script_imports_model_from_current_directory(self):
    work = self.dir / "work"
    work.mkdir()
    (work / "mymodels.py").write_text(
      "import jax.numpy as jnp\n"
      "def make():\n"
      "  return lambda p, x: jnp.tanh(x @ p['w'])\n"
    )
    _save(work / "p.msgpack", {"w": np.ones((4, 3), np.float32) / 4})
    np.savez(work / "d.npz", x=np.ones((5, 4), np.float32))
    # The installed console script, else the wrapper pip writes for it.
    script = pathlib.Path(sysconfig.get_path("scripts")) / "fisher-merge"
    if not script.exists():
      script = self.dir / "bin" / "fisher-merge"
      script.parent.mkdir()
      script.write_text(
        "import sys\nfrom fisher_optax.merge import run\nsys.exit(run())\n"
      )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for cmd in (
      [sys.executable, str(script)],
      [sys.executable, "-m", "fisher_optax.merge"],
    ):
      out = f"f_{len(cmd)}.msgpack"
      proc = subprocess.run(
        [
          *cmd,
          "fisher",
          "--model",
          "mymodels:make",
          "--params",
          "p.msgpack",
          "--data",
          "d.npz",
          "--output",
          out,
        ],
        cwd=work,
        capture_output=True,
        text=True,
        check=False,
        env=dict(env, JAX_PLATFORMS="cpu"),
      )
      self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
      self.assertIn(f"wrote {out}", proc.stdout)
      self.assertTrue(_checkpoint_io.verify_checksums(work / out))

  def test_every_option_has_help_and_shows_its_default(self):
    parser = merge._parser()
    subparsers = next(
      a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    )
    for name, sub in subparsers.choices.items():
      text = sub.format_help()
      for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
          continue
        with self.subTest(f"{name} {action.dest}"):
          self.assertTrue(action.help, action.dest)
          if not action.required and action.option_strings:
            self.assertIn(
              "default", sub.formatter_class(name)._get_help_string(action)
            )
      self.assertNotIn("overwrite=True", text)

  def test_core_only_install_gets_a_hint(self):
    models = [str(self.dir / f"{i}.msgpack") for i in "ab"]
    for m in models:
      _save(m, {"w": np.ones(2, np.float32)})
    with mock.patch.dict(sys.modules, {"flax": None}):
      code, err = _run(
        [
          "merge",
          "--models",
          *models,
          "--fishers",
          *models,
          "--output",
          str(self.dir / "out.msgpack"),
        ]
      )
    self.assertEqual(code, 1)
    self.assertIn("pip install 'fisher_optax[flax]'", err)

  def test_example_recipe_end_to_end(self):
    outdir = self.dir / "try"
    code, out, err = _run_out(["example", str(outdir)])
    self.assertEqual(code, 0, err)
    commands = [
      line.strip()
      for line in out.splitlines()
      if line.strip().startswith("fisher-merge ")
    ]
    self.assertLen(commands, 3)
    for command in commands:  # exactly what the user is told to run
      code, out, err = _run_out(shlex.split(command)[1:])
      self.assertEqual(code, 0, f"{command}: {err}")
    models = [
      _checkpoint_io.load_tree(outdir / f"model_{n}.msgpack") for n in "ab"
    ]
    fishers = [
      _checkpoint_io.load_tree(outdir / f"fisher_{n}.msgpack") for n in "ab"
    ]
    merged = _checkpoint_io.load_tree(outdir / "merged.msgpack")
    chex.assert_trees_all_close(
      merged, fisher_optax.fisher_merge(models, fishers), rtol=1e-5, atol=1e-6
    )
    # The two models differ (trained on two tasks), and so does the merge.
    self.assertGreater(
      float(
        np.max(
          np.abs(models[0]["head"]["kernel"] - models[1]["head"]["kernel"])
        )
      ),
      1e-2,
    )
    # Each model fits its own task.
    apply_fn, _ = merge.example_model()
    for n, m in zip("ab", models):
      data = np.load(outdir / f"data_{n}.npz")
      acc = np.mean(np.argmax(apply_fn(m, data["x"]), 1) == data["y"])
      self.assertGreater(acc, 0.8, n)
    code, _, err = _run_out(["example", str(outdir)])
    self.assertEqual(code, 1)
    self.assertIn("not an empty directory", err)


if __name__ == "__main__":
  absltest.main()
