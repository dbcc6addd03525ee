# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Examples, the demo and their shared toy data and models (not shipped).

Run the demo from the repository root as ``python -m examples.demo``; the
example scripts run as ``python examples/<name>.py`` (or as notebooks).
"""
