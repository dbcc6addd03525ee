# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Settings for the test session (and the subprocesses it starts)."""

import os

# The tests compile far more than they compute: at test sizes, XLA:CPU's
# backend optimisation is most of each compile and buys no run time. Float
# semantics are unchanged. Set before any backend starts; subprocesses
# (examples, multi-device modules) inherit it. An explicit level in XLA_FLAGS
# wins.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
  os.environ["XLA_FLAGS"] = (
    f"{_flags} --xla_backend_optimization_level=0".strip()
  )
