# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The conformance table: every public transform x every check.

Each row is a :class:`tests.conformance.Case`; each test method runs one check
of ``tests/conformance.py`` on every row. Transforms that take no learning
rate (``scale_by_*``, penalties, estimators, projections) are trained in a
chain with what follows them in practice. A new public transform gets a row
here; ``test_every_public_transform_has_a_row`` fails until it does.
"""

from __future__ import annotations

import inspect

from absl.testing import absltest
from absl.testing import parameterized
import optax
import pytest

import fisher_optax
from fisher_optax import fisher
from tests import conformance

Case = conformance.Case
_pe = conformance.per_example_grads

# Fewer steps for transforms whose convergence the method tests cover.
_SHORT = {
  "parabola": 1000,
  "rosenbrock": 3000,
  "matrix_parabola": 1000,
  "mixed_tensors": 1000,
}
_NO_ROSENBROCK = {k: v for k, v in _SHORT.items() if k != "rosenbrock"}


def _accumulated_fadam(learning_rate, every_k=2):
  """FAdam on the Fisher of every micro-batch (two per update)."""
  inner = fisher_optax.fadam(
    learning_rate, weight_decay=1e-3, fisher_source="per_example"
  )
  return fisher_optax.accumulate_fisher(inner, every_k)


CASES = (
  # FAdam
  Case(
    "fadam",
    fisher_optax.fadam,
    {"weight_decay": 1e-3},
    injectable=(
      "learning_rate",
      "b1",
      "b2",
      "weight_decay",
      "eps",
      "clip",
    ),
    # p's default (None: a square root) stays static; a number is injected
    # (tests/fadam_test.py).
    target_learning_rate={"rosenbrock": 3e-3},
  ),
  Case(
    "fadam_per_example",
    fisher_optax.fadam,
    {"weight_decay": 1e-3, "fisher_source": "per_example"},
    injectable=("learning_rate", "b1", "b2", "weight_decay"),
    target_learning_rate={"rosenbrock": 3e-3},
    extras=_pe,
  ),
  Case(
    "scale_by_fadam",
    fisher_optax.scale_by_fadam,
    {"weight_decay": 0.0},
    then=optax.scale_by_learning_rate,
    injectable=("b1", "b2", "eps", "clip"),
    target_learning_rate={"rosenbrock": 3e-3},
  ),
  Case(
    "accumulate_fisher",
    _accumulated_fadam,
    {"every_k": 2},
    injectable=("learning_rate",),
    static_args=("every_k",),
    # Two micro-batches per update: half the updates of the other rows.
    target_learning_rate={"rosenbrock": 3e-3, "parabola": 3e-2},
    extras=_pe,
    covers="accumulate_fisher",
  ),
  # FISMO
  Case(
    "fismo",
    fisher_optax.fismo,
    {"weight_decay": 1e-4, "precondition_interval": 2},
    injectable=(
      "learning_rate",
      "beta",
      "gamma",
      "damping",
      "weight_decay",
      "precondition_interval",
      "ns_steps",
    ),
    target_learning_rate={"rosenbrock": 3e-3},
  ),
  Case(
    "scale_by_fismo",
    fisher_optax.scale_by_fismo,
    {"precondition_interval": 2},
    then=optax.scale_by_learning_rate,
    injectable=("beta", "gamma", "damping", "ns_steps"),
    target_learning_rate={"rosenbrock": 3e-3},
    # Unscaled Newton-Schulz output: array vs Python-float hyperparameters
    # round differently (about 4e-6 on entries of size 0.5).
    inject_tol=1e-4,
  ),
  # Natural GaLore and the windowed Woodbury preconditioner
  Case(
    "natural_galore",
    fisher_optax.natural_galore,
    {"rank": 2, "history_size": 3, "damping": 1e-2},
    injectable=("learning_rate", "damping", "weight_decay", "scale"),
    static_args=("rank", "history_size", "svd_power_iterations"),
    target_learning_rate={"rosenbrock": 3e-3},
  ),
  Case(
    "scale_by_natural_galore",
    fisher_optax.scale_by_natural_galore,
    {"rank": 2, "history_size": 3, "damping": 1.0, "normalize_output": True},
    then=optax.scale_by_learning_rate,
    learning_rate=0.1,
    steps=_SHORT,
    injectable=("damping", "scale"),
    static_args=("rank", "history_size", "svd_power_iterations"),
    target_learning_rate={"rosenbrock": 1e-3},
  ),
  Case(
    "scale_by_woodbury_fisher",
    fisher_optax.scale_by_woodbury_fisher,
    {"history_size": 3, "damping": 10.0, "normalize_output": True},
    then=optax.scale_by_learning_rate,
    learning_rate=0.1,
    steps=dict(_SHORT, rosenbrock=10000),
    injectable=("damping",),
    static_args=("history_size",),
    target_learning_rate={"rosenbrock": 2e-3},
  ),
  # M-FAC
  Case(
    "mfac",
    fisher_optax.mfac,
    {"window_size": 4, "damping": 10.0, "momentum": 0.5},
    learning_rate=0.1,
    steps=dict(_SHORT, rosenbrock=5000),
    injectable=("learning_rate", "damping", "momentum", "weight_decay"),
    static_args=("window_size",),
    # Far from the optimum a rank-one empirical Fisher takes steps ~ lr / |g|.
    target_learning_rate={"parabola": 0.2},
  ),
  Case(
    "scale_by_mfac",
    fisher_optax.scale_by_mfac,
    {"window_size": 4, "damping": 10.0},
    then=optax.scale_by_learning_rate,
    learning_rate=1.0,
    steps=_SHORT,
    injectable=("damping",),
    static_args=("window_size",),
    target_learning_rate={"rosenbrock": 3e-2},
  ),
  # PhysGuard (empty protected subspace: Adam)
  Case(
    "physguard",
    fisher_optax.physguard,
    {"max_rank": 2},
    learning_rate=0.1,
    steps=_SHORT,
    injectable=("learning_rate", "alpha", "b1", "b2", "eps", "weight_decay"),
    static_args=("max_rank",),
    target_learning_rate={"rosenbrock": 1e-2},
  ),
  Case(
    "project_out_subspace",
    fisher_optax.project_out_subspace,
    {"max_rank": 2},
    then=optax.adam,
    learning_rate=0.1,
    steps=_SHORT,
    injectable=("alpha",),
    static_args=("max_rank",),
    target_learning_rate={"rosenbrock": 1e-2},
  ),
  # EWC (empty anchor: the chain is Adam)
  Case(
    "add_ewc_gradient",
    fisher_optax.add_ewc_gradient,
    {"strength": 0.5},
    then=optax.adam,
    learning_rate=0.1,
    steps=_SHORT,
    injectable=("strength",),
    static_args=("rank",),
    target_learning_rate={"rosenbrock": 1e-2},
  ),
  # Estimator transforms: the statistic rides along in the state.
  Case(
    "estimate_fisher_diag",
    fisher.estimate_fisher_diag,
    {"decay": 0.5},
    then=optax.sgd,
    learning_rate=0.1,
    steps=_NO_ROSENBROCK,
    injectable=("decay",),
    static_args=("num_samples", "interval"),
    extras=_pe,
  ),
  Case(
    "estimate_fisher_low_rank",
    fisher.estimate_fisher_low_rank,
    {"rank": 2},
    then=optax.sgd,
    learning_rate=0.1,
    steps=_NO_ROSENBROCK,
    static_args=("rank", "num_samples", "interval"),
    extras=_pe,
  ),
)

_ROWS = [(case.name, case) for case in CASES]

# Per-example sources that are not rows of their own, for test_masked.
_PER_EXAMPLE = {"fisher_source": "per_example"}
_MASKED_ONLY = [
  (case.name, case)
  for case in (
    Case("fismo_per_example", fisher_optax.fismo, _PER_EXAMPLE, extras=_pe),
    Case(
      "mfac_per_example",
      fisher_optax.mfac,
      {"window_size": 4, **_PER_EXAMPLE},
      extras=_pe,
    ),
    Case(
      "natural_galore_per_example",
      fisher_optax.natural_galore,
      {"rank": 2, **_PER_EXAMPLE},
      extras=_pe,
    ),
    Case(
      "woodbury_fisher_per_example",
      fisher_optax.scale_by_woodbury_fisher,
      _PER_EXAMPLE,
      then=optax.scale_by_learning_rate,
      extras=_pe,
    ),
  )
]

# Public names that return a transform but are not rows, with the reason.
_NOT_TRANSFORMS = {
  "fisher_merge_accumulator": "a merge accumulator (init, add, finalize)",
}


def _public_transform_names() -> set[str]:
  names = set()
  for module, prefix in ((fisher_optax, ""), (fisher, "fisher.")):
    for name in module.__all__:
      obj = getattr(module, name)
      if not inspect.isfunction(obj) or name in _NOT_TRANSFORMS:
        continue
      returns = str(inspect.signature(obj).return_annotation)
      if "GradientTransformation" in returns:
        names.add(prefix + name)
  return names


def _public_name(factory) -> str:
  in_engine = factory.__module__.startswith("fisher_optax.fisher")
  return ("fisher." if in_engine else "") + factory.__name__


class ConformanceTableTest(absltest.TestCase):
  def test_every_public_transform_has_a_row(self):
    covered = {case.covers or _public_name(case.factory) for case in CASES}
    self.assertEmpty(
      _public_transform_names() - covered, "public transforms without a row"
    )


class ConformanceTest(parameterized.TestCase):
  @parameterized.named_parameters(*_ROWS)
  def test_converges(self, case):
    conformance.check_converges(self, case)

  @parameterized.named_parameters(*_ROWS)
  def test_ignores_unknown_extras_and_no_recompile(self, case):
    conformance.check_ignores_unknown_extras_and_no_recompile(self, case)

  @parameterized.named_parameters(*_ROWS)
  def test_learning_rate_schedule(self, case):
    conformance.check_learning_rate_schedule(self, case)

  @parameterized.named_parameters(*_ROWS)
  def test_inject_hyperparams(self, case):
    conformance.check_inject_hyperparams(self, case)

  @parameterized.named_parameters(*_ROWS)
  def test_inject_hyperparams_low_precision(self, case):
    conformance.check_inject_hyperparams_low_precision(self, case)

  @parameterized.named_parameters(*_ROWS)
  def test_preserves_dtype_under_cond(self, case):
    conformance.check_preserves_dtype_under_cond(self, case)

  @parameterized.named_parameters(*_ROWS)
  def test_multisteps_first_ministep_is_zero(self, case):
    conformance.check_multisteps_first_ministep_is_zero(self, case)

  @parameterized.named_parameters(*_ROWS)
  def test_init_on_shape_dtype_struct(self, case):
    conformance.check_init_on_shape_dtype_struct(self, case)

  @parameterized.named_parameters(*_ROWS)
  def test_refuses_non_real_params(self, case):
    conformance.check_refuses_non_real_params(self, case)

  @parameterized.named_parameters(*_ROWS)
  def test_map_params(self, case):
    conformance.check_map_params(self, case)

  @parameterized.named_parameters(*_ROWS, *_MASKED_ONLY)
  def test_masked(self, case):
    conformance.check_masked(self, case)

  # A non-finite gradient must not hang a solve: a per-test limit.
  @parameterized.named_parameters(*_ROWS)
  @pytest.mark.timeout(240)
  def test_nonfinite_gradients(self, case):
    conformance.check_nonfinite_gradients(self, case)


if __name__ == "__main__":
  absltest.main()
