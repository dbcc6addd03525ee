# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Toy data and models shared by the demo, the examples and the benchmarks.

They are not part of the library (the wheel ships ``fisher_optax`` only):

* :mod:`examples.common.datasets` — small real datasets that need no
  download (scikit-learn's digits, ``pydoc_data.topics``);
* :mod:`examples.common.models` — small Flax NNX reference models, used
  functionally as ``(apply_fn, params)``.

From the repository root import them as ``from examples.common import
datasets``; the example scripts, which run from ``examples/``, import
``from common import datasets``.
"""
