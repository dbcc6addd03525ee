# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The optimizers' flop counts in benchmarks/floors.py against XLA's."""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import optax

from benchmarks import floors
import fisher_optax
from fisher_optax import _matrix_roots


def _flops(fn, *args) -> float:
  return float(jax.jit(fn).lower(*args).compile().cost_analysis()["flops"])


class FloorsTest(parameterized.TestCase):
  @parameterized.parameters((256, 256), (128, 512), (512, 128))
  def test_newton_schulz_is_muons_step(self, m, n):
    params = {"w": jnp.zeros((m, n))}
    muon = optax.contrib.scale_by_muon(
      nesterov=False,
      weight_dimension_numbers={"w": optax.contrib.MuonDimensionNumbers()},
    )
    xla = _flops(muon.update, params, muon.init(params))
    # The rest is elementwise: a few flops per element of the leaf.
    self.assertBetween(xla / floors.newton_schulz((m, n)), 1.0, 1.05)

  @parameterized.product(
    shape=((256, 256), (128, 512), (512, 128)),
    momentum_space=("whitened", "original"),
  )
  def test_fismo_cached_step(self, shape, momentum_space):
    params = {"w": jnp.zeros(shape)}
    grads = {"w": jax.random.normal(jax.random.key(0), shape)}
    tx = fisher_optax.scale_by_fismo(
      precondition_interval=2,
      momentum_space=momentum_space,
      root_method="eigh",
    )
    state = tx.init(params)
    for _ in range(3):
      _, state = jax.jit(tx.update)(grads, state)
    xla = _flops(tx.update, grads, state)
    # XLA counts the refresh branch of the step's cond too, though a cached
    # step does not run it: each root rebuilt from its factor's eigh.
    a, b = sorted(shape)
    sides = list(shape) if b <= 2 * a else [a]
    root = lambda f: _matrix_roots.matrix_inverse_root_eigh(f, 2, floor=1e-6)
    xla -= sum(_flops(root, jnp.eye(d)) for d in sides)
    count = floors.newton_schulz(shape) + floors.fismo_extra(
      shape, momentum_space=momentum_space
    )
    # The rest is elementwise (leaf and factors), a few percent at these
    # sizes; one product missing from the count would be 7% or more.
    self.assertBetween(xla / count, 1.0, 1.05)
    # Without the extra products, the count would be far off.
    self.assertGreater(xla / floors.newton_schulz(shape), 1.2)

  def test_galore_and_window(self):
    self.assertEqual(floors.galore((8, 6), 4), 4 * 8 * 6 * 4)
    self.assertEqual(floors.galore((8, 6), 16), 4 * 8 * 6 * 6)
    self.assertEqual(floors.natural_galore_window((8, 6), 4, 3), 4 * 3 * 4 * 6)
    self.assertEqual(floors.mfac(100, 32), 4 * 32 * 100)


if __name__ == "__main__":
  absltest.main()
