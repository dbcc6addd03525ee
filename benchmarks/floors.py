# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Matmul flops of the optimizers' steps: the floors of the speed tables.

Kept apart from the scripts (no command-line flags) so that several of them
can share the counts. Each function counts the matrix products a steady step
needs on one ``m x n`` matrix leaf; elementwise work (moments, EMAs, norms)
is lower order and left out, as are the periodic refreshes (eigendecompositions,
SVDs), which are iterative and have no fixed count.
"""

from __future__ import annotations


def newton_schulz(shape: tuple[int, int], ns_steps: int = 5) -> int:
  """Muon's step: ``ns_steps`` Newton-Schulz iterations on an ``a x b``
  leaf (``a <= b``), ``X X^T``, ``A A`` and ``B X``: ``4 a^2 b + 2 a^3``
  each."""
  a, b = sorted(shape)
  return ns_steps * (4 * a * a * b + 2 * a**3)


def fismo_extra(
  shape: tuple[int, int],
  *,
  max_aspect_ratio: int = 2,
  momentum_space: str = "whitened",
) -> int:
  """What a FISMO step that reuses its cached roots adds to Muon's.

  Two-sided (FISMO's default plan when ``max(m, n) <= max_aspect_ratio *
  min(m, n)``): the two factor statistics with the Gauss-Seidel whitening
  (``4 m n^2 + 4 m^2 n``), whitening the gradient into momentum space
  (``2 m n^2``: its left product is the Gauss-Seidel one; the momentum on
  both sides with ``momentum_space="original"``, ``2 m^2 n`` more) and
  un-whitening the direction (``2 m^2 n + 2 m n^2``): ``14 m^3`` on a
  square leaf against Muon's ``30 m^3``. One-sided (the smaller side ``a``
  of an ``a x b`` leaf): statistic, whitening and un-whitening, ``6 a^2 b``.
  """
  m, n = shape
  a, b = sorted(shape)
  if b > max_aspect_ratio * a:
    return 6 * a * a * b
  extra = 4 * m * n * n + 4 * m * m * n + 2 * m * m * n + 2 * m * n * n
  extra += 2 * m * n * n
  if momentum_space == "original":
    extra += 2 * m * m * n
  return extra


def galore(shape: tuple[int, int], rank: int) -> int:
  """GaLore's step: the gradient projected and the update back, ``4 m n r``."""
  m, n = shape
  return 4 * m * n * min(rank, m, n)


def natural_galore_window(
  shape: tuple[int, int], rank: int, history_size: int
) -> int:
  """What Natural GaLore adds to GaLore's step: two passes over the
  window's ``s`` rows of ``r x min(m, n)`` (this step's Gram column, then
  the Woodbury correction), ``4 s r min(m, n)``; the ``s x s`` solve is
  lower order."""
  m, n = shape
  r = min(rank, m, n)
  return 4 * history_size * r * min(m, n)


def mfac(size: int, window_size: int) -> int:
  """M-FAC's inverse-Fisher product on a leaf of ``size`` elements: two
  passes over the ``m x d`` window (its dot products with the gradient,
  then their combination), ``4 m d``."""
  return 4 * window_size * size
