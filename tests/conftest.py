# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Settings for the test session (and the subprocesses it starts)."""

import os

# The tests compile far more than they compute: at test sizes, XLA:CPU's
# backend optimisation is most of each compile and buys no run time. Float
# semantics are unchanged. Set before any backend starts; subprocesses
# (examples, multi-device modules) inherit it.
_FAST_COMPILE = "--xla_backend_optimization_level=0"
_flags = os.environ.get("XLA_FLAGS", "")
if _FAST_COMPILE not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} {_FAST_COMPILE}".strip()
