# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The Fisher estimator engine (work in progress; see issue 2)."""
