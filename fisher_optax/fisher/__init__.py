# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The Fisher estimator engine: which Fisher (``kind``) x which structure.

**Contract.** The model is any ``apply_fn(params, inputs) -> outputs`` whose
output is one array with the batch axis first, and whose examples do not
interact (no training-mode batch norm): a Flax Linen ``model.apply``, an NNX
``lambda state, x: nnx.merge(graphdef, state)(x)``, or a plain function. A
*likelihood* says what the outputs parameterise: :class:`Categorical` logits,
:class:`Gaussian` means with a fixed ``sigma``, :class:`Bernoulli` logits,
:class:`HeteroscedasticGaussian` ``(mean, log variance)`` pairs. The batch is
always ``batch = (inputs, targets)``; ``inputs`` may be any pytree of arrays
with a common leading axis.

**Kinds.** ``empirical`` (dataset labels), ``mc`` (``num_samples`` labels
drawn from the model, explicit ``key``), ``exact`` (closed-form expectation;
equal to the GGN for the canonical ones, categorical, Bernoulli and
fixed-variance Gaussian; for :class:`HeteroscedasticGaussian` the GGN
depends on the targets and equals it only in expectation),
``batch_squared`` (the square of the mean gradient, Adam/FAdam's
quantity; explicit only). A bare per-example loss ``likelihood=lambda out,
y: ...`` defines no distribution, so it allows only ``empirical`` and
``batch_squared``.

**Structures.** :func:`diagonal`, :func:`low_rank` (global or per leaf),
:func:`rank_one`, :func:`kronecker` (and, from a bare per-example loss or
given per-example gradients, :func:`diagonal_from_loss`,
:func:`diagonal_from_grads`, :func:`low_rank_from_grads`); each returns a
registered pytree (:class:`DiagonalFisher`, :class:`LowRankFisher`,
:class:`KroneckerFisher`) of float32 *means* with ``count``, ``kind`` and the
mean loss gradient ``mean_grad`` from the same pass.
:func:`sum_of_rank_one` factors the damped mean of ``m`` stacked gradients'
outer products once (M-FAC's statistic, :class:`RankOneSumFisher`).

**One interface.** Every statistic is a :class:`FisherStatistic`: ``F v``
(``matvec``), ``v^T F v`` (``quadratic_form``), ``(F + damping I)^{-1} v``
(``solve(v, damping)``), the diagonal of that inverse (``inverse_diag``),
``count``, ``kind`` and a finite check (``is_finite()``). A
:class:`RankOneSumFisher` carries the damping it was factored with, so its
``solve`` and ``inverse_diag`` take ``damping=None``.

**Transforms.** :func:`estimate_fisher_diag` and
:func:`estimate_fisher_low_rank` keep a statistic in the optimizer state,
refreshed every ``interval`` steps from a ``per_example_grads=`` or
``batch=(inputs, targets)`` extra argument, so it can feed other transforms
in a chain.

**Where the Fisher comes from: ``fisher_source``.** One keyword and two
values across every transform that can take its Fisher from either place:

- ``"batch"``: from the mini-batch mean gradient the transform receives as
  ``updates``: squared (FAdam), a window of past ones (M-FAC, the windowed
  Woodbury preconditioner, Natural GaLore), or factor statistics (FISMO).
  Needs no extra argument.
- ``"per_example"``: from per-example gradients passed in ``update`` as the
  extra argument ``per_example_grads=`` (the updates' tree with a leading
  batch axis, e.g. from :func:`per_example_grads`).

The transforms that take it are ``fadam``/``scale_by_fadam``,
``fismo``/``scale_by_fismo``, ``mfac``/``scale_by_mfac``, the windowed
Woodbury preconditioner and ``natural_galore``/``scale_by_natural_galore``.
Older spellings keep working with a ``FisherOptaxDeprecationWarning``: the
keywords ``gradients=`` (M-FAC) and ``window_source=`` (Woodbury, Natural
GaLore), and the values ``"batch_squared"``, ``"mean"`` and ``"history"``
(all meaning ``"batch"``). The estimator transforms above are not switched
by ``fisher_source``: they use whichever extra argument is given, and their
``batch=`` is the data ``(inputs, targets)`` the model is run on.

**Bad inputs.** Shapes and dtypes are checked at trace time, so a
mismatch is a ``ValueError``/``TypeError`` before anything runs: each
likelihood checks its targets against the model output
(:meth:`Likelihood.check`: integer labels ``(B, ...)`` for ``Categorical``
logits ``(B, ..., C)``, targets of exactly the output's shape for
``Gaussian`` and ``Bernoulli``, ``(mean, log variance)`` pairs for
``HeteroscedasticGaussian`` under every kind; nothing is broadcast), and an
empty batch is refused. Values cannot be checked at trace time, so a label
out of range (``-1``, or ``C`` and above for ``C`` classes) makes the
statistic NaN instead of raising, under ``jit`` too: its ``is_finite()`` is
False (it covers ``mean_grad``), so no consumer takes it for a good one
(pass it to :func:`jax.experimental.checkify.check` under ``checkify`` to
make it an error). NaN or infinite inputs, and finite ones whose statistic overflows,
also give statistics whose ``is_finite()`` is False; no decomposition of
the engine (``eigh`` of a Gram, Cholesky) ever runs on a non-finite
matrix. Statistics are float32 (float64 for float64 inputs under x64),
also for bf16 and float16 models: values are widened before they are
squared. The estimator transforms skip a non-finite step, keep their
statistic and count it in ``notfinite_count``.

**Paths.** ``method="auto"`` uses layer statistics (zero taps on the
outputs of products with a parameter, embeddings and elementwise scales and
shifts) where they apply and the generic per-example path
(:func:`per_example_grads`-style ``vmap`` of VJPs, chunked by
``chunk_size``) elsewhere; both give the same numbers. :func:`coverage`
says which path each leaf takes and why (leaves ``apply_fn`` never reads
are ``"unused"``: zero statistics, no work); a
:class:`FisherFallbackWarning` says so once when more than a tenth of the
parameters it uses fall back. Both paths
need output ``n`` to depend on input ``n`` only: a model that combines the
examples of a batch (a BatchNorm normalising by the batch's statistics)
has no per-example gradients, and every estimator warns
(:class:`FisherMixedExamplesWarning`) naming the operation that does, where
it can follow the examples through the model (see the warning). They
also need ``apply_fn`` to be deterministic: the per-example path runs the
model on one example at a time, so an active dropout would draw other masks
there than in the batch, and the same mask for every example; the same
warning says so where random values drawn for each example meet the
examples (run estimators with ``deterministic=True``, as Fisher estimates
usually are, or give each example its own mask as
:func:`fisher_optax.flax.nnx_per_example_grads` does). The MC kind's labels
do not depend on the path: example ``n`` draws them from
``jax.random.fold_in(key, n)``.

**Derivatives.** Every statistic, ``mean_grad`` included, is a
differentiable function of ``params`` on both paths: ``jax.grad`` through
an estimate differentiates the model's Jacobian and the likelihood's output
cotangents alike (the MC kind's sampled labels are constants). Wrap
``params`` in :func:`jax.lax.stop_gradient` where an estimate is meant as a
constant.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from fisher_optax import fisher
  >>> def apply_fn(params, x):  # (B, 3) -> (B, 2) logits
  ...   return jnp.tanh(x @ params["w1"]) @ params["w2"]
  >>> params = {"w1": jnp.ones((3, 4)) / 2, "w2": jnp.ones((4, 2)) / 4}
  >>> x, y = jax.random.normal(jax.random.key(0), (8, 3)), jnp.arange(8) % 2
  >>> stat = fisher.diagonal(apply_fn, params, (x, y),
  ...                        likelihood=fisher.Categorical(), kind="exact")
  >>> stat.diag["w1"].shape, stat.mean_grad["w2"].shape, int(stat.count)
  ((3, 4), (4, 2), 8)
  >>> top = fisher.low_rank(apply_fn, params, (x, y),
  ...                       likelihood=fisher.Categorical(), kind="mc",
  ...                       key=jax.random.key(1), rank=4)
  >>> isinstance(top, fisher.FisherStatistic), top.kind
  (True, 'mc')
  >>> step = top.solve(stat.mean_grad, damping=1e-3)  # (F + 1e-3 I)^{-1} g
  >>> bool(top.is_finite())
  True
"""

from fisher_optax.fisher import linalg as linalg
from fisher_optax.fisher import numerics as numerics
from fisher_optax.fisher import validation as validation
from fisher_optax.fisher._estimators import diagonal
from fisher_optax.fisher._estimators import diagonal_from_grads
from fisher_optax.fisher._estimators import diagonal_from_loss
from fisher_optax.fisher._estimators import kronecker
from fisher_optax.fisher._estimators import low_rank
from fisher_optax.fisher._estimators import low_rank_from_grads
from fisher_optax.fisher._estimators import rank_one
from fisher_optax.fisher._likelihoods import KINDS
from fisher_optax.fisher._likelihoods import Bernoulli
from fisher_optax.fisher._likelihoods import Categorical
from fisher_optax.fisher._likelihoods import Gaussian
from fisher_optax.fisher._likelihoods import HeteroscedasticGaussian
from fisher_optax.fisher._likelihoods import Likelihood
from fisher_optax.fisher._likelihoods import LossLikelihood
from fisher_optax.fisher._per_example import per_example_grads
from fisher_optax.fisher._rank_one_sum import RankOneSumFisher
from fisher_optax.fisher._rank_one_sum import sum_of_rank_one
from fisher_optax.fisher._statistics import DiagonalFisher
from fisher_optax.fisher._statistics import FisherStatistic
from fisher_optax.fisher._statistics import KroneckerFisher
from fisher_optax.fisher._statistics import LowRankFisher
from fisher_optax.fisher._taps import FisherFallbackWarning
from fisher_optax.fisher._taps import FisherMixedExamplesWarning
from fisher_optax.fisher._taps import LeafCoverage
from fisher_optax.fisher._taps import coverage
from fisher_optax.fisher._transforms import EstimateFisherDiagState
from fisher_optax.fisher._transforms import EstimateFisherLowRankState
from fisher_optax.fisher._transforms import estimate_fisher_diag
from fisher_optax.fisher._transforms import estimate_fisher_low_rank
from fisher_optax.fisher._transforms import get_fisher_diag
from fisher_optax.fisher._transforms import get_fisher_low_rank

__all__ = [
  "KINDS",
  "Bernoulli",
  "Categorical",
  "DiagonalFisher",
  "EstimateFisherDiagState",
  "EstimateFisherLowRankState",
  "FisherFallbackWarning",
  "FisherMixedExamplesWarning",
  "FisherStatistic",
  "Gaussian",
  "HeteroscedasticGaussian",
  "KroneckerFisher",
  "LeafCoverage",
  "Likelihood",
  "LossLikelihood",
  "LowRankFisher",
  "RankOneSumFisher",
  "coverage",
  "diagonal",
  "diagonal_from_grads",
  "diagonal_from_loss",
  "estimate_fisher_diag",
  "estimate_fisher_low_rank",
  "get_fisher_diag",
  "get_fisher_low_rank",
  "kronecker",
  "low_rank",
  "low_rank_from_grads",
  "per_example_grads",
  "rank_one",
  "sum_of_rank_one",
]
