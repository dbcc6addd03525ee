# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Settings for the test session (and the subprocesses it starts)."""

import atexit
import importlib.util
import mmap
import os
import pathlib
import shutil
import sys
import tempfile


def _xla_knows(flag: str) -> bool:
  """Whether this jaxlib's XLA defines ``flag``: XLA aborts on an unknown
  flag in XLA_FLAGS, so a flag that a later release drops is left out."""
  spec = importlib.util.find_spec("jaxlib")
  if spec is None or spec.origin is None:
    return False
  for lib in pathlib.Path(spec.origin).parent.glob("libjax_common*.so"):
    with (
      open(lib, "rb") as f,
      mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m,
    ):
      if m.find(flag.encode()) >= 0:
        return True
  return False


# The tests compile far more than they compute. At test sizes XLA:CPU's
# backend optimisation buys no run time, and its MLIR fusion emitters take
# about a third of each compile more than the older LLVM-IR emitters
# (measured on the taps tests: 104 s -> 65 s). Float semantics are unchanged;
# summation orders (hence rounding) may differ from the defaults. Set before
# any backend starts; subprocesses (examples, multi-device modules) inherit
# them. A setting already in XLA_FLAGS wins.
_flags = os.environ.get("XLA_FLAGS", "")
for _name, _value in (
  ("xla_backend_optimization_level", "0"),
  ("xla_cpu_use_fusion_emitters", "false"),
):
  if _name not in _flags and _xla_knows(_name):
    _flags = f"{_flags} --{_name}={_value}".strip()
os.environ["XLA_FLAGS"] = _flags

# Tests in different processes (xdist's workers, the examples, notebooks and
# multi-device modules) and tests with fresh closures compile many identical
# programs. JAX's persistent compilation cache, in one directory per test
# session that all of them share, compiles each once: a quarter of the
# suite's compiles were hits, 5-9% less wall time on 2 cores. A
# JAX_COMPILATION_CACHE_DIR already set wins and is kept, so that a rerun
# reuses it (BUILD.md).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix="fisher_optax_test_jax_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
# Cache every program, however small or quick to compile.
_CACHE_SETTINGS = (  # environment variable, JAX option, its type
  ("JAX_COMPILATION_CACHE_DIR", "jax_compilation_cache_dir", str),
  (
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "jax_persistent_cache_min_compile_time_secs",
    float,
  ),
  (
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
    "jax_persistent_cache_min_entry_size_bytes",
    int,
  ),
)
for _env, _, _ in _CACHE_SETTINGS[1:]:
  os.environ.setdefault(_env, "0")
if "jax" in sys.modules:  # a plugin imported it first: tell its config too
  import jax

  for _env, _option, _type in _CACHE_SETTINGS:
    jax.config.update(_option, _type(os.environ[_env]))
