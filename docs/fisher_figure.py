# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Draws the dense Fisher of a tiny MLP next to each structured approximation.

Run by ``docs/conf.py`` at build time (``python docs/fisher_figure.py
out.png`` draws it alone). Every panel is the dense matrix of one statistic,
read column by column through its ``matvec``, so the figure shows exactly
what the engine computes.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.flatten_util
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from fisher_optax import fisher  # noqa: E402


def _apply_fn(params, x):
  return jnp.tanh(x @ params["w1"]) @ params["w2"]


def _problem():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {
    "w1": jax.random.normal(k1, (3, 3)) / 2,
    "w2": jax.random.normal(k2, (3, 3)) / 2,
  }
  x = jax.random.normal(k3, (64, 3))
  y = jnp.arange(64) % 3
  return params, (x, y)


def _dense(params, matvec) -> jax.Array:
  """The matrix of ``matvec`` in the flattened parameter basis."""
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  cols = jax.vmap(
    lambda e: jax.flatten_util.ravel_pytree(matvec(unravel(e)))[0]
  )
  return cols(jnp.eye(flat.size)).T


def _dense_references(params, batch):
  """Exact and empirical Fisher, dense, straight from the definitions:
  ``mean_n J_n^T (diag(p_n) - p_n p_n^T) J_n`` and ``mean_n g_n g_n^T``."""
  x, y = batch
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  logits = lambda f, xi: _apply_fn(unravel(f), xi[None])[0]
  jac = jax.vmap(lambda xi: jax.jacobian(logits)(flat, xi))(x)  # (N, C, P)
  probs = jax.nn.softmax(jax.vmap(lambda xi: logits(flat, xi))(x))
  hess = jax.vmap(jnp.diag)(probs) - probs[:, :, None] * probs[:, None, :]
  exact = jnp.einsum("ncp,ncd,ndq->pq", jac, hess, jac) / x.shape[0]
  residual = probs - jax.nn.one_hot(y, probs.shape[-1])
  grads = jnp.einsum("ncp,nc->np", jac, residual)  # per-example gradients
  empirical = grads.T @ grads / x.shape[0]
  return exact, empirical, jax.vmap(unravel)(grads)


def panels() -> list[tuple[str, np.ndarray]]:
  """(title, dense matrix) of the exact and empirical Fisher and each
  structured approximation of the tiny MLP (one compiled program)."""
  titles = []

  def matrices(params, batch):  # titles are static: collected while tracing
    titled = _panels(params, batch)
    titles.extend(title for title, _ in titled)
    return [m for _, m in titled]

  dense = jax.jit(matrices)(*_problem())
  return [(title, np.asarray(m)) for title, m in zip(titles, dense)]


def _panels(params, batch) -> list[tuple[str, jax.Array]]:
  lik = fisher.Categorical()
  exact = dict(likelihood=lik, kind="exact")
  exact_dense, empirical_dense, grads = _dense_references(params, batch)
  first_row = [
    ("diagonal", fisher.diagonal(_apply_fn, params, batch, **exact)),
    ("Kronecker (K-FAC)", fisher.kronecker(_apply_fn, params, batch, **exact)),
    (
      "low rank (top 4)",
      fisher.low_rank(_apply_fn, params, batch, rank=4, **exact),
    ),
  ]
  second_row = [
    (
      "batch_squared diagonal",
      fisher.diagonal(
        _apply_fn, params, batch, likelihood=lik, kind="batch_squared"
      ),
    ),
    (
      "rank one (mean gradient)",
      fisher.rank_one(
        _apply_fn, params, batch, likelihood=lik, kind="empirical"
      ),
    ),
    (
      "sum of rank-one terms (8 gradients)",
      fisher.sum_of_rank_one(jax.tree.map(lambda g: g[:8], grads), 1e-3),
    ),
  ]
  dense = lambda rows: [(t, _dense(params, s.matvec)) for t, s in rows]
  return (
    [("exact Fisher (dense)", exact_dense)]
    + dense(first_row)
    + [("empirical Fisher (dense)", empirical_dense)]
    + dense(second_row)
  )


def render(path: str | pathlib.Path) -> None:
  """Draws the panels to ``path`` (PNG)."""
  items = panels()
  fig, axes = plt.subplots(2, 4, figsize=(12, 7))
  for ax, (title, mat) in zip(axes.ravel(), items):
    vmax = float(np.max(np.abs(mat))) or 1.0
    ax.imshow(mat, cmap="RdBu_r", vmin=-vmax, vmax=vmax)
    ax.set_title(title, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
  for ax in axes.ravel()[len(items) :]:
    ax.axis("off")
  fig.suptitle(
    "Fisher of a 3-3-3 tanh MLP (18 parameters, 64 examples): dense and "
    "structured",
    fontsize=10,
  )
  fig.tight_layout(rect=(0, 0, 1, 0.96), h_pad=2.0)
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  render(sys.argv[1] if len(sys.argv) > 1 else "fisher_structures.png")
