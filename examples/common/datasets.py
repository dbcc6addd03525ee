# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Small real datasets that need no download, for the demo, examples and benchmarks.

* :func:`load_digits` — scikit-learn's 8x8 handwritten digits (1,797 images,
  bundled with scikit-learn), split and standardised.
* :func:`load_pydoc_topics` — the ~0.46M characters of ``pydoc_data.topics``
  that ship with CPython, as integer ids for character-level language models.

Both are deterministic given a seed; nothing is fetched from the network.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

Split = tuple[np.ndarray, np.ndarray]


def load_digits(
  seed: int = 0,
  split: tuple[float, float, float] = (0.6, 0.2, 0.2),
  standardize: bool = True,
) -> dict[str, Split]:
  """Returns stratified ``train``/``val``/``test`` splits of the digits data.

  Args:
    seed: seed of the stratified shuffle.
    split: fractions of train, validation and test; must sum to 1. A zero
      validation fraction gives an empty ``val`` split.
    standardize: subtract the training mean and divide by the training
      standard deviation per pixel (constant pixels are left at 0);
      otherwise pixels are scaled to [0, 1] (``x / 16``).

  Returns:
    A dict mapping split name to ``(x, y)`` with ``x`` float32 ``[N, 64]``
    and ``y`` int32 ``[N]`` in 0..9.
  """
  if len(split) != 3 or abs(sum(split) - 1.0) > 1e-6 or min(split) < 0:
    raise ValueError(
      f"split must be 3 non-negative fractions summing to 1, got {split}."
    )
  try:
    from sklearn import datasets as sk_datasets  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # pragma: no cover - exercised without sklearn only
    raise ImportError(
      "load_digits needs scikit-learn: pip install 'fisher_optax[examples]'"
    ) from e
  bunch = sk_datasets.load_digits()
  x = bunch.data.astype(np.float32)
  y = bunch.target.astype(np.int32)
  rng = np.random.default_rng(seed)
  parts: dict[str, list[np.ndarray]] = {"train": [], "val": [], "test": []}
  for c in np.unique(y):
    idx = rng.permutation(np.flatnonzero(y == c))
    n_train = int(round(split[0] * len(idx)))
    n_val = int(round(split[1] * len(idx)))
    parts["train"].append(idx[:n_train])
    parts["val"].append(idx[n_train : n_train + n_val])
    parts["test"].append(idx[n_train + n_val :])
  out: dict[str, Split] = {}
  train_idx = np.concatenate(parts["train"])
  if standardize:
    mean = x[train_idx].mean(0)
    std = x[train_idx].std(0)
    scale = np.where(std > 0, std, 1.0)
    transform = lambda a: np.where(std > 0, (a - mean) / scale, 0.0)
  else:
    transform = lambda a: a / 16.0
  for name, chunks in parts.items():
    idx = (
      rng.permutation(np.concatenate(chunks))
      if chunks
      else np.zeros(0, np.int64)
    )
    out[name] = (transform(x[idx]).astype(np.float32), y[idx])
  return out


def load_pydoc_topics() -> tuple[np.ndarray, list[str]]:
  """Returns ``(ids, vocab)``: the text of ``pydoc_data.topics`` as char ids.

  The topics are concatenated in sorted key order, so the result is the same
  on every machine with the same CPython minor version.
  """
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top

  text = "\n".join(topics.topics[k] for k in sorted(topics.topics))
  vocab = sorted(set(text))
  lookup = {ch: i for i, ch in enumerate(vocab)}
  ids = np.fromiter(
    (lookup[ch] for ch in text), dtype=np.int32, count=len(text)
  )
  return ids, vocab


def char_split(
  ids: np.ndarray, val_fraction: float = 0.1
) -> tuple[np.ndarray, np.ndarray]:
  """Splits a char-id stream into train and (final ``val_fraction``) validation."""
  if not 0 < val_fraction < 1:
    raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
  cut = int(len(ids) * (1 - val_fraction))
  return ids[:cut], ids[cut:]


def char_batches(
  ids: np.ndarray, batch_size: int, context: int, seed: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Yields random ``(inputs, targets)`` windows forever, each ``[B, context]``.

  ``targets`` are ``inputs`` shifted by one character. The stream is a pure
  function of ``seed``, so paired comparisons see the same data order.
  """
  if len(ids) <= context + 1:
    raise ValueError("the id stream is shorter than one context window.")
  rng = np.random.default_rng(seed)
  offsets = np.arange(context + 1)
  while True:
    starts = rng.integers(0, len(ids) - context - 1, size=batch_size)
    windows = ids[starts[:, None] + offsets[None, :]]
    yield windows[:, :-1], windows[:, 1:]


def char_eval_windows(
  ids: np.ndarray, context: int, max_windows: int = 256
) -> tuple[np.ndarray, np.ndarray]:
  """Non-overlapping evaluation windows ``(inputs, targets)`` from the start."""
  n = min(max_windows, (len(ids) - 1) // context)
  if n < 1:
    raise ValueError("the id stream is shorter than one context window.")
  x = ids[: n * context].reshape(n, context)
  y = ids[1 : n * context + 1].reshape(n, context)
  return x, y
