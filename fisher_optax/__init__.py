# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""fisher_optax: Fisher-information methods as composable optax transforms.

The public API is flat, like optax's: ``fisher_optax.fadam``,
``fisher_optax.scale_by_fismo``, ``fisher_optax.fisher.diagonal`` and so on.
The Fisher estimator engine lives in :mod:`fisher_optax.fisher`. Modules
with optional dependencies are imported explicitly: :mod:`fisher_optax.flax`
(Flax adapters) and :mod:`fisher_optax.checkpoint` (orbax); the command
line is ``python -m fisher_optax.merge`` (``fisher-merge``).
"""

__version__ = "0.1.0.dev0"

from fisher_optax import fisher

# Gradient accumulation with a Fisher over every micro-batch (_accumulation.py)
from fisher_optax._accumulation import AccumulateFisherState
from fisher_optax._accumulation import accumulate_fisher

# EWC penalties (_ewc.py)
from fisher_optax._ewc import AddEWCGradientState
from fisher_optax._ewc import DiagonalEWC
from fisher_optax._ewc import EWCAnchor
from fisher_optax._ewc import LowRankEWC
from fisher_optax._ewc import add_ewc_gradient
from fisher_optax._ewc import consolidate
from fisher_optax._ewc import ewc_gradient
from fisher_optax._ewc import ewc_penalty
from fisher_optax._ewc import init_ewc_anchor

# FAdam (_fadam.py)
from fisher_optax._fadam import FAdamState
from fisher_optax._fadam import fadam
from fisher_optax._fadam import scale_by_fadam

# FISMO (_fismo.py)
from fisher_optax._fismo import FISMODimensionNumbers
from fisher_optax._fismo import FISMOState
from fisher_optax._fismo import fismo
from fisher_optax._fismo import scale_by_fismo

# Fisher-weighted SVD (_fwsvd.py)
from fisher_optax._fwsvd import fisher_weighted_svd
from fisher_optax._fwsvd import generalized_fwsvd

# Fisher merging (_merging.py)
from fisher_optax._merging import FisherMergeAccumulator
from fisher_optax._merging import FisherMergeState
from fisher_optax._merging import MergeWeightSearch
from fisher_optax._merging import fisher_merge
from fisher_optax._merging import fisher_merge_accumulator
from fisher_optax._merging import merge_weight_candidates
from fisher_optax._merging import search_merge_weights

# M-FAC and the windowed Woodbury Fisher preconditioner (_mfac.py)
from fisher_optax._mfac import MFACState
from fisher_optax._mfac import WoodburyFisherState
from fisher_optax._mfac import mfac
from fisher_optax._mfac import scale_by_mfac
from fisher_optax._mfac import scale_by_woodbury_fisher

# Natural GaLore (_natural_galore.py)
from fisher_optax._natural_galore import NaturalGaLoreState
from fisher_optax._natural_galore import natural_galore
from fisher_optax._natural_galore import scale_by_natural_galore

# OBS pruning (_obs.py)
from fisher_optax._obs import ObsPruneResult
from fisher_optax._obs import group_obs_update
from fisher_optax._obs import magnitude_prune
from fisher_optax._obs import obs_prune
from fisher_optax._obs import obs_saliency

# Protected-subspace fine-tuning (PhysGuard) (_physguard.py)
from fisher_optax._physguard import ProjectOutSubspaceState
from fisher_optax._physguard import ProtectedSubspace
from fisher_optax._physguard import init_protected_subspace
from fisher_optax._physguard import physguard
from fisher_optax._physguard import project_out_subspace
from fisher_optax._physguard import protected_subspace

__all__ = [
  "__version__",
  "fisher",
  # Gradient accumulation
  "accumulate_fisher",
  "AccumulateFisherState",
  # FAdam
  "fadam",
  "FAdamState",
  "scale_by_fadam",
  # FISMO
  "fismo",
  "FISMODimensionNumbers",
  "FISMOState",
  "scale_by_fismo",
  # Natural GaLore and the Woodbury Fisher preconditioner
  "natural_galore",
  "NaturalGaLoreState",
  "scale_by_natural_galore",
  "scale_by_woodbury_fisher",
  "WoodburyFisherState",
  # EWC penalties
  "add_ewc_gradient",
  "AddEWCGradientState",
  "consolidate",
  "DiagonalEWC",
  "ewc_gradient",
  "ewc_penalty",
  "EWCAnchor",
  "init_ewc_anchor",
  "LowRankEWC",
  # Protected-subspace fine-tuning (PhysGuard)
  "init_protected_subspace",
  "physguard",
  "project_out_subspace",
  "ProjectOutSubspaceState",
  "protected_subspace",
  "ProtectedSubspace",
  # Fisher merging
  "fisher_merge",
  "fisher_merge_accumulator",
  "FisherMergeAccumulator",
  "FisherMergeState",
  "merge_weight_candidates",
  "MergeWeightSearch",
  "search_merge_weights",
  # M-FAC
  "mfac",
  "MFACState",
  "scale_by_mfac",
  # OBS pruning
  "group_obs_update",
  "magnitude_prune",
  "obs_prune",
  "obs_saliency",
  "ObsPruneResult",
  # Fisher-weighted SVD
  "fisher_weighted_svd",
  "generalized_fwsvd",
]

# Old names, served with a FisherOptaxDeprecationWarning (not in __all__).
__getattr__ = fisher.validation.module_getattr(
  __name__,
  {
    # FISMO
    "FismoDimensionNumbers": (
      "fisher_optax.FISMODimensionNumbers",
      FISMODimensionNumbers,
    ),
    "FismoState": ("fisher_optax.FISMOState", FISMOState),
  },
)
