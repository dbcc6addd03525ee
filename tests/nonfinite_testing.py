# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Checks of the one non-finite policy for a transform's own test module.

The guards exist because LAPACK's SVD/eigh on a matrix holding an infinity
need not terminate on XLA:CPU: a step with such a gradient must never reach
a decomposition (the call would hang), and a finite gradient whose
statistics overflow (1e30 squared) must not either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any

# Steps the policy skips (state unchanged but for notfinite_count).
BAD_VALUES = {"nan": jnp.nan, "+inf": jnp.inf, "-inf": -jnp.inf, "1e30": 1e30}
# Steps that must go through with finite updates and state.
GOOD_VALUES = {"zero": 0.0, "1e-30": 1e-30}


def split_counts(state: PyTree) -> tuple[list[int], list[Any]]:
  """``(notfinite counts, every other leaf)`` of a (chained) state."""
  counts, rest = [], []
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    if getattr(path[-1], "name", None) == "notfinite_count":
      counts.append(int(leaf))
    else:
      rest.append(leaf)
  return counts, rest


def _spoil(grads: PyTree, value: float, whole: bool) -> PyTree:
  def spoil(g):
    if whole:
      return jnp.full_like(g, value)
    return g.at[(0,) * g.ndim].set(value) if g.size else g

  leaves, treedef = jax.tree.flatten(grads)
  if whole:
    return treedef.unflatten([spoil(g) for g in leaves])
  # One element of the last non-empty leaf.
  last = max(i for i, g in enumerate(leaves) if g.size)
  return treedef.unflatten(
    [spoil(g) if i == last else g for i, g in enumerate(leaves)]
  )


def check_policy(
  test: Any,
  tx: optax.GradientTransformation,
  params: PyTree,
  grads: PyTree,
  *,
  steps_before: Sequence[int] = (1,),
  extra: Callable[[PyTree], dict[str, Any]] | None = None,
  overflows: bool = True,
) -> None:
  """Bad and good gradients after ``steps_before`` good steps.

  Per value: the call returns; a bad step leaves the state unchanged but for
  its ``notfinite_count`` (incremented); zero and 1e-30 gradients give
  finite updates and state; the next good step's updates are finite; under
  :func:`optax.apply_if_finite` the params stay finite.

  Args:
    test: the ``TestCase``.
    tx: the transform.
    params: parameters.
    grads: a good gradient.
    steps_before: numbers of good steps before the bad one (e.g. a refresh
      step and a step between refreshes).
    extra: ``grads -> extra keyword arguments`` of ``update``.
    overflows: whether 1e30 gradients overflow the transform's statistics
      (a bad step); ``False`` for a transform without squares (a good one).
  """
  extra = extra or (lambda g: {})
  update = jax.jit(lambda g, s, p: tx.update(g, s, p, **extra(g)))
  safe = optax.apply_if_finite(tx, max_consecutive_errors=10**6)
  safe_update = jax.jit(lambda g, s, p: safe.update(g, s, p, **extra(g)))
  for before in steps_before:
    state = tx.init(params)
    for _ in range(before):
      _, state = update(grads, state, params)
    bad = dict(BAD_VALUES)
    good = dict(GOOD_VALUES)
    if not overflows:
      good["1e30"] = bad.pop("1e30")
    for label, value in {**bad, **good}.items():
      for whole in (True, False) if label in bad else (True,):
        with test.subTest(value=label, whole=whole, steps_before=before):
          spoiled = _spoil(grads, value, whole)
          updates, new_state = update(spoiled, state, params)
          counts, rest = split_counts(state)
          new_counts, new_rest = split_counts(new_state)
          if label in bad:
            chex.assert_trees_all_equal(new_rest, rest)
            test.assertTrue(all(n >= c for n, c in zip(new_counts, counts)))
            test.assertGreater(sum(new_counts), sum(counts))
            if not np.isfinite(value):
              test.assertFalse(bool(_all_finite(updates)))
            # Nothing else moves the params on a skipped step (a weight
            # decay after the method, another partition).
            for u in jax.tree.leaves(updates):
              np.testing.assert_array_equal(
                jnp.where(jnp.isnan(u), 0.0, u), jnp.zeros_like(u)
              )
          else:
            chex.assert_tree_all_finite((updates, new_state))
            test.assertEqual(new_counts, counts)
          updates, after = update(grads, new_state, params)
          chex.assert_tree_all_finite((updates, after))
          # apply_if_finite around the transform: params never NaN.
          p, s = params, safe.init(params)
          for g in (grads, spoiled, grads):
            u, s = safe_update(g, s, p)
            p = optax.apply_updates(p, u)
          chex.assert_tree_all_finite(p)


def _all_finite(tree: PyTree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves))


def donated_step_temp(
  tx: optax.GradientTransformation, params: PyTree, grads: PyTree
) -> int:
  """XLA temp bytes of a jitted ``update`` + ``apply_updates``, params and
  state donated: what a policy's (or a step's) temporaries cost."""

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  compiled = (
    jax.jit(step, donate_argnums=(0, 1))
    .lower(params, tx.init(params), grads)
    .compile()
  )
  return compiled.memory_analysis().temp_size_in_bytes
