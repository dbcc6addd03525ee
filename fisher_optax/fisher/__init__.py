# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The Fisher estimator engine (work in progress; see issue 2)."""

# -- M-FAC static inverse (_rank_one_sum.py, issue 9) --
from fisher_optax.fisher._rank_one_sum import RankOneSumFisher
from fisher_optax.fisher._rank_one_sum import sum_of_rank_one
