# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Matrix roots and polar factors for Kronecker-factored preconditioners.

Every function acts on the last two axes and broadcasts over leading (batch)
axes, so a stack of same-shaped matrices is one batched call.

* :func:`newton_schulz_polar`: the polar factor :math:`U V^\top` of a
  matrix by Newton-Schulz, Muon's orthogonalisation (coefficients
  :data:`QUINTIC_NS_COEFFS` as in ``optax.contrib.muon``, or the classical
  :data:`CUBIC_NS_COEFFS`).
* :func:`matrix_inverse_root_eigh`: the symmetric inverse ``p``-th root of a
  positive semi-definite matrix by an eigendecomposition, with a relative
  eigenvalue floor.
* :func:`matrix_inverse_root_newton`: the same root by a coupled Newton
  iteration (matmuls only), optionally warm-started from a previous root;
  returns a :class:`NewtonRootResult` with the residual, so a caller can
  keep its old root when the iteration fails.
* :func:`cholesky_whitening`: a triangular whitening factor
  :math:`W = L^{-\top}` (:math:`W^\top A W = I`), the cheapest of the three.

FISMO (:func:`fisher_optax.scale_by_fismo`) whitens gradients with these
roots and orthogonalises its momentum with :func:`newton_schulz_polar`.

Example:
  >>> import jax.numpy as jnp
  >>> from fisher_optax import _matrix_roots as roots
  >>> a = jnp.array([[4.0, 0.0], [0.0, 1.0]])
  >>> w = roots.matrix_inverse_root_eigh(a)  # a^{-1/2}
  >>> bool(jnp.allclose(w @ a @ w, jnp.eye(2), atol=1e-5))
  True
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fisher_optax.fisher import linalg
from fisher_optax.fisher import numerics

_HIGHEST = jax.lax.Precision.HIGHEST

# optax.contrib.muon's quintic Newton-Schulz coefficients (Jordan, 2024): fast
# but only approximately orthogonal (singular values end in ~[0.7, 1.2]).
QUINTIC_NS_COEFFS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
# The classical cubic iteration X <- 1.5 X - 0.5 X X^T X: slow start but
# converges quadratically to the exact polar factor U V^T.
CUBIC_NS_COEFFS: tuple[float, float, float] = (1.5, -0.5, 0.0)


def _batched_eye(a: jax.Array, dtype: Any = None) -> jax.Array:
  n = a.shape[-1]
  eye = jnp.eye(n, dtype=dtype or a.dtype)
  return jnp.broadcast_to(eye, a.shape[:-2] + (n, n))


def newton_schulz_polar(
  x: jax.Array,
  coeffs: Any = QUINTIC_NS_COEFFS,
  steps: int | jax.Array = 5,
  eps: float | jax.Array = 1e-8,
) -> jax.Array:
  r"""Approximates the polar factor :math:`U V^\top` of ``x`` by Newton-Schulz.

  After Frobenius normalisation (so every singular value is at most one) the
  iteration applies the odd polynomial

  .. math::

    X \leftarrow a X + b (X X^\top) X + c (X X^\top)^2 X

  ``steps`` times, which maps each singular value ``s`` to ``p(s)`` and leaves
  the singular vectors alone. The arithmetic (normalisation, transposing wide
  to short-fat, one Gram per step) matches ``optax.contrib.muon`` exactly.

  Args:
    x: ``(..., m, n)`` matrices.
    coeffs: ``(a, b, c)``, or a sequence of such triples, one per step (then
      ``steps`` is ignored). :data:`QUINTIC_NS_COEFFS` (Muon's) or
      :data:`CUBIC_NS_COEFFS` (classical, exact in the limit).
    steps: number of iterations: an int, or an integer scalar array (then
      the iterations run as a loop of that many trips).
    eps: added to the Frobenius norm before dividing (a zero matrix gives
      zeros, whatever ``eps``).

  Returns:
    The (approximate) polar factor, shaped and typed like ``x``.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax import _matrix_roots as roots
    >>> x = jnp.diag(jnp.array([3.0, 1.0]))
    >>> o = roots.newton_schulz_polar(x, roots.CUBIC_NS_COEFFS, steps=30)
    >>> bool(jnp.allclose(o, jnp.eye(2), atol=1e-4))
    True

  References:
    Jordan, `Muon: An optimizer for hidden layers
    <https://kellerjordan.github.io/posts/muon/>`_, 2024

    Higham, `Functions of Matrices: Theory and Computation
    <https://doi.org/10.1137/1.9780898717778>`_, 2008 (ch. 8)
  """
  coeff_arr = jnp.asarray(coeffs)
  if coeff_arr.ndim not in (1, 2) or coeff_arr.shape[-1] != 3:
    raise ValueError(
      f"Newton-Schulz coefficients must have shape (3,) or (k, 3), got "
      f"{coeff_arr.shape}."
    )
  if x.ndim < 2:
    raise ValueError(f"newton_schulz_polar needs a matrix, got {x.shape}.")
  transposed = x.shape[-2] > x.shape[-1]
  if transposed:
    x = jnp.matrix_transpose(x)
  norm = jnp.linalg.norm(x, ord="fro", axis=(-2, -1), keepdims=True)
  # A zero matrix stays zero, also with eps = 0 (an injected float16 1e-8
  # rounds to it): 0/0 would skip every step of a model with such a leaf.
  x = jnp.where(norm > 0, x / jnp.where(norm > 0, norm + eps, 1), 0)
  coeff_arr = coeff_arr.astype(x.dtype)

  # Under explicit mesh axes the Gram is replicated and the iterate keeps
  # x's sharding; elsewhere both specs are None (XLA's choice).
  gram_spec = linalg.replicated_spec()
  x_spec = numerics.explicit_spec(x)

  def step(abc: jax.Array, x: jax.Array) -> jax.Array:
    gram = linalg.matmul(x, jnp.matrix_transpose(x), out_sharding=gram_spec)
    poly = abc[1] * gram + abc[2] * gram @ gram  # (c A) A, as optax.
    return abc[0] * x + linalg.matmul(poly, x, out_sharding=x_spec)

  if coeff_arr.ndim == 2:
    for i in range(coeff_arr.shape[0]):
      x = step(coeff_arr[i], x)
  elif isinstance(steps, int):
    for _ in range(steps):
      x = step(coeff_arr, x)
  else:  # a traced count (inject_hyperparams): a loop, as optax's muon
    x = jax.lax.fori_loop(0, steps, lambda _, y: step(coeff_arr, y), x)
  return jnp.matrix_transpose(x) if transposed else x


def _floor_eigenvalues(evals: jax.Array, floor: Any) -> jax.Array:
  mean = jnp.mean(jnp.maximum(evals, 0.0), axis=-1, keepdims=True)
  tiny = jnp.finfo(evals.dtype).tiny
  return jnp.maximum(evals, jnp.maximum(floor * mean, tiny))


def matrix_inverse_root_eigh(
  a: jax.Array, p: int = 2, *, floor: float | jax.Array = 1e-6
) -> jax.Array:
  r"""Returns the symmetric :math:`A^{-1/p}` of SPD matrices via ``eigh``.

  .. math::

    A = V \Lambda V^\top, \qquad
    A^{-1/p} = V \max(\Lambda, \epsilon \bar\lambda)^{-1/p} V^\top,

  where :math:`\bar\lambda = \operatorname{tr}(A)/n` is the mean eigenvalue,
  so the floor is scale-free (``floor=1e-6`` caps the condition number of the
  root's argument at 1e6, Distributed Shampoo's ``matrix_epsilon``).

  Args:
    a: ``(..., n, n)`` symmetric positive semi-definite matrices (symmetrised
      here first).
    p: the root, a static positive int.
    floor: relative eigenvalue floor.

  Returns:
    ``A^{-1/p}``, symmetric, same shape and dtype as ``a``.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax import _matrix_roots as roots
    >>> r = roots.matrix_inverse_root_eigh(jnp.diag(jnp.array([4.0, 1.0])))
    >>> [round(float(v), 3) for v in jnp.diag(r)]
    [0.5, 1.0]

  References:
    Anil et al, `Scalable Second Order Optimization for Deep Learning
    <https://arxiv.org/abs/2002.09018>`_, 2020
  """
  if isinstance(p, bool) or not isinstance(p, int) or p < 1:
    raise ValueError(f"p must be a positive static int, got {p!r}.")
  evals, evecs = jnp.linalg.eigh(linalg.symmetrize(a))
  evals = _floor_eigenvalues(evals, floor)
  scaled = evecs * (evals ** (-1.0 / p))[..., None, :]
  return linalg.symmetrize(
    jnp.matmul(scaled, jnp.matrix_transpose(evecs), precision=_HIGHEST)
  )


def _power_iteration_max_eig(a: jax.Array, iters: int) -> jax.Array:
  """Largest eigenvalue of PSD ``a`` (..., n, n); a slight underestimate."""
  # On a / max|a|: the vectors' norms of a 1e20-scaled matrix overflow.
  scale = jnp.max(jnp.abs(a), axis=(-2, -1))
  scale = jnp.where(scale > 0, scale, 1.0)
  a = a / scale[..., None, None]
  v = jnp.ones(a.shape[:-1], a.dtype) / jnp.sqrt(a.shape[-1])
  v = v + 1e-3 * jnp.cos(jnp.arange(a.shape[-1], dtype=a.dtype))

  def body(_, v):
    w = jnp.einsum("...ij,...j->...i", a, v, precision=_HIGHEST)
    return w / (jnp.linalg.norm(w, axis=-1, keepdims=True) + 1e-30)

  v = jax.lax.fori_loop(0, iters, body, v)
  av = jnp.einsum("...ij,...j->...i", a, v, precision=_HIGHEST)
  rayleigh = jnp.sum(v * av, axis=-1) / jnp.maximum(
    jnp.sum(v * v, axis=-1), 1e-30
  )
  return rayleigh * scale


class NewtonRootResult(NamedTuple):
  """Result of :func:`matrix_inverse_root_newton`.

  Attributes:
    root: ``H`` with ``H^T A H ~= I`` (p=2) or ``H ~= A^{-1/p}``.
    error: per matrix, for p=2 the true residual ``max |H^T A H - I|``
      (``A`` with its ridge), recomputed from ``H`` at exit; for other
      ``p`` the iteration's ``max |M - I|``, which in floating point drifts
      from the residual for nearly singular ``A`` (a residual of 1.25 read
      as 1e-7 for a rank-2 64 x 64 matrix in float32).
    iterations: iterations taken (the batch runs until all converge).
  """

  root: jax.Array
  error: jax.Array
  iterations: jax.Array


def matrix_inverse_root_newton(
  a: jax.Array,
  p: int = 2,
  *,
  init: jax.Array | None = None,
  floor: float | jax.Array = 1e-6,
  max_iters: int = 30,
  tol: float = 1e-4,
  power_iters: int = 10,
) -> NewtonRootResult:
  r"""Matrix inverse p-th root by a coupled Newton iteration (matmuls only).

  With :math:`M_0 = H_0^{p} A` scaled so that its spectrum lies in
  :math:`(0, 1]`, iterate

  .. math::

    T_k = \tfrac{1}{p}\bigl((p+1) I - M_k\bigr), \quad
    M_{k+1} = T_k^{p} M_k, \quad H_{k+1} = H_k T_k,

  until :math:`\max|M_k - I| <` ``tol``. From :math:`H_0 = c I` every iterate
  is a polynomial in ``A`` and :math:`H_k \to A^{-1/p}`, the symmetric root.

  **Warm start** (``init``, ``p == 2`` only): with :math:`H_0` the previous
  root and :math:`M_0 = H_0^\top A H_0`, the update
  :math:`M_{k+1} = T_k M_k T_k` keeps the invariant
  :math:`M_k = H_k^\top A H_k`, so :math:`H_k` converges to a *whitening
  factor* of ``A`` (:math:`H H^\top = A^{-1}`); it equals :math:`A^{-1/2}`
  up to an orthogonal factor that is the identity when ``init`` commutes with
  ``A``. A warm start near the answer needs far fewer iterations than a
  cold start from the identity.

  ``A`` gets a ridge of ``floor`` times its mean eigenvalue first. The scale
  comes from a few power iterations. At p=2 ``M`` converges for spectra in
  :math:`(0, 5)`, but an eigenvalue of the scaled ``M_0`` above 3 makes
  :math:`T_0` negative there and flips that direction's sign in ``H``: an
  underestimate of the top eigenvalue by more than 3x (a start vector
  nearly orthogonal to its eigenvector) gives a root that is not positive
  definite.

  Args:
    a: ``(..., n, n)`` symmetric positive semi-definite matrices.
    p: the root, a static positive int.
    init: optional ``(..., n, n)`` warm start (p=2 only); symmetrise it first
      for the best result.
    floor: relative ridge, as in :func:`matrix_inverse_root_eigh`.
    max_iters: iteration cap (a ``lax.while_loop``, so converged batches stop
      early).
    tol: convergence threshold on ``max |M - I|``.
    power_iters: power-iteration steps for the spectral scale.

  Returns:
    A :class:`NewtonRootResult`; check ``error`` and fall back (e.g. keep the
    previous root) if it is large or not finite.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax import _matrix_roots as roots
    >>> a = jnp.diag(jnp.array([4.0, 1.0]))
    >>> res = roots.matrix_inverse_root_newton(a)
    >>> [round(float(v), 3) for v in jnp.diag(res.root)]
    [0.5, 1.0]
    >>> bool(res.error < 1e-4)  # converged: below the default tol
    True

  References:
    Guo & Higham, `A Schur-Newton Method for the Matrix p'th Root and its
    Inverse <https://doi.org/10.1137/050643374>`_, 2006

    Anil et al, `Scalable Second Order Optimization for Deep Learning
    <https://arxiv.org/abs/2002.09018>`_, 2020
  """
  if isinstance(p, bool) or not isinstance(p, int) or p < 1:
    raise ValueError(f"p must be a positive static int, got {p!r}.")
  if init is not None and p != 2:
    raise ValueError("A warm start (init) is only supported for p=2.")
  a = linalg.symmetrize(a)
  eye = _batched_eye(a)
  mean = jnp.trace(a, axis1=-2, axis2=-1)[..., None, None] / a.shape[-1]
  a = a + jnp.maximum(floor * mean, jnp.finfo(a.dtype).tiny) * eye
  mm = lambda x, y: jnp.matmul(x, y, precision=_HIGHEST)

  if init is None:
    h0 = eye
    m0 = a
  else:
    h0 = init.astype(a.dtype)
    m0 = linalg.symmetrize(mm(jnp.matrix_transpose(h0), mm(a, h0)))
  # Scale: M0 / c with c ~ lambda_max(M0), H0 * c^{-1/p}.
  c = _power_iteration_max_eig(m0, power_iters)
  c = jnp.where(jnp.isfinite(c) & (c > 0), c, 1.0)[..., None, None]
  m0 = m0 / c
  h0 = h0 * c ** (-1.0 / p)

  def error(m):
    # Infinite where m is not finite (XLA:CPU's max of NaNs can read -inf).
    finite = jnp.all(jnp.isfinite(m), axis=(-2, -1))
    return jnp.where(finite, jnp.max(jnp.abs(m - eye), axis=(-2, -1)), jnp.inf)

  def cond(carry):
    i, _, _, err = carry
    return (i < max_iters) & jnp.any(err > tol)

  def body(carry):
    i, m, h, _ = carry
    t = ((p + 1) * eye - m) / p
    if init is not None:  # p == 2, keep M symmetric: M <- T M T.
      m = linalg.symmetrize(mm(t, mm(m, t)))
    else:
      tp = t
      for _ in range(p - 1):
        tp = mm(tp, t)
      m = mm(tp, m)
    h = mm(h, t)
    return i + 1, m, h, error(m)

  i, m, h, err = jax.lax.while_loop(
    cond, body, (jnp.zeros([], jnp.int32), m0, h0, error(m0))
  )
  del m
  if init is None:
    h = linalg.symmetrize(h)
  if p == 2:  # M drifts from H^T A H: the residual itself, two matmuls.
    err = error(mm(jnp.matrix_transpose(h), mm(a, h)))
  return NewtonRootResult(root=h, error=err, iterations=i)


def cholesky_whitening(
  a: jax.Array, *, floor: float | jax.Array = 1e-6
) -> jax.Array:
  r"""Returns the whitening factor :math:`W = L^{-\top}` of SPD ``a``.

  With :math:`A = L L^\top` (Cholesky), :math:`W W^\top = A^{-1}` and
  :math:`W^\top A W = I`; ``W^T x = L^{-1} x`` whitens. It is one Cholesky and
  one triangular inverse (about :math:`n^3/2` flops), far cheaper than an
  eigendecomposition, but ``W`` is triangular, not the symmetric root, so use
  it only where the result does not depend on which whitening is chosen.

  Args:
    a: ``(..., n, n)`` symmetric positive semi-definite matrices.
    floor: relative ridge, as in :func:`matrix_inverse_root_eigh`.

  Returns:
    Upper-triangular ``W``, same shape and dtype as ``a``.

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax import _matrix_roots as roots
    >>> a = jnp.array([[4.0, 2.0], [2.0, 3.0]])
    >>> w = roots.cholesky_whitening(a, floor=0.0)
    >>> bool(jnp.allclose(w.T @ a @ w, jnp.eye(2), atol=1e-5))
    True
  """
  a = linalg.symmetrize(a)
  eye = _batched_eye(a)
  mean = jnp.trace(a, axis1=-2, axis2=-1)[..., None, None] / a.shape[-1]
  a = a + jnp.maximum(floor * mean, jnp.finfo(a.dtype).tiny) * eye
  chol = jnp.linalg.cholesky(a)
  linv = jax.scipy.linalg.solve_triangular(chol, eye, lower=True)
  return jnp.matrix_transpose(linv)
