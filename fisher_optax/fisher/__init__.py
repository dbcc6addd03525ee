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
equal to the GGN for these canonical likelihoods), ``batch_squared`` (the
square of the mean gradient, Adam/FAdam's quantity; explicit only). A bare
per-example loss ``likelihood=lambda out, y: ...`` defines no distribution,
so it allows only ``empirical`` and ``batch_squared``.

**Structures.** :func:`diagonal`, :func:`low_rank` (global or per leaf),
:func:`rank_one`, :func:`kronecker` (and, from a bare per-example loss or
given per-example gradients, :func:`diagonal_from_loss`,
:func:`diagonal_from_grads`, :func:`low_rank_from_grads`); each returns a registered pytree
(:class:`DiagonalFisher`, :class:`LowRankFisher`, :class:`KroneckerFisher`)
of float32 *means* with ``count``, ``kind`` and the mean loss gradient
``mean_grad`` from the same pass, with ``matvec``, ``quadratic_form`` and
``solve(v, damping)``.

**Transforms.** :func:`estimate_fisher_diag` and
:func:`estimate_fisher_low_rank` keep a statistic in the optimizer state,
refreshed every ``interval`` steps from a ``per_example_grads=`` or
``batch=`` extra argument, so it can feed other transforms in a chain.

**Paths.** ``method="auto"`` uses layer statistics (zero taps on dense and
embedding pre-activations) where they apply and the generic per-example path
(:func:`per_example_grads`-style ``vmap`` of VJPs, chunked by
``chunk_size``) elsewhere; both give the same numbers.

Example::

  import jax, jax.numpy as jnp
  from fisher_optax import fisher

  def apply_fn(params, x):                       # (B, 3) -> (B, 2) logits
    return jnp.tanh(x @ params["w1"]) @ params["w2"]

  params = {"w1": jnp.ones((3, 4)) / 2, "w2": jnp.ones((4, 2)) / 4}
  x, y = jax.random.normal(jax.random.key(0), (8, 3)), jnp.arange(8) % 2
  stat = fisher.diagonal(apply_fn, params, (x, y),
                         likelihood=fisher.Categorical(), kind="exact")
  stat.diag, stat.mean_grad, stat.count           # Fisher, gradient, N
  top = fisher.low_rank(apply_fn, params, (x, y),
                        likelihood=fisher.Categorical(), kind="mc",
                        key=jax.random.key(1), rank=4)
"""

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
from fisher_optax.fisher._statistics import KroneckerFisher
from fisher_optax.fisher._statistics import LowRankFisher
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
  "Gaussian",
  "HeteroscedasticGaussian",
  "KroneckerFisher",
  "Likelihood",
  "LossLikelihood",
  "LowRankFisher",
  "RankOneSumFisher",  # M-FAC static inverse (issue 9)
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
