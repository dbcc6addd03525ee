# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for the merge command line and checkpoint I/O."""

import contextlib
import io
import os
import pathlib
import subprocess
import sys
import tempfile
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
        (self.x[idx], self.y[idx]),
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


if __name__ == "__main__":
  absltest.main()
