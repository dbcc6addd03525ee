# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Settings for the test session (and the subprocesses it starts)."""

import importlib.util
import mmap
import os
import pathlib


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
