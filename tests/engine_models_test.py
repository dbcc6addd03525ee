# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The flop floors that benchmarks/fisher_engine.py prints next to its ratios."""

from __future__ import annotations

from absl.testing import absltest

from benchmarks import engine_models as fe


class FlopFloorsTest(absltest.TestCase):
  def test_one_dense_layer(self):
    # Gradient 2BP forward + 2BP weights (no cotangent to the input); the
    # diagonal adds 2BP; K-FAC 2B(k^2 + o^2).
    k, o, b = 6, 4, 3
    floors = fe.flop_floors([fe.Site(1, k, o, carries=False)], b)
    self.assertAlmostEqual(floors["diag empirical / auto"], 1.5)
    self.assertAlmostEqual(
      floors["kron (K-FAC) / auto"], 1 + (k * k + o * o) / (2 * k * o)
    )
    self.assertIn("top-8 low rank / auto", floors)

  def test_weight_sharing_multiplies_the_exact_diagonal(self):
    shared = fe.flop_floors([fe.Site(5, 3, 3)], 2)
    dense = fe.flop_floors([fe.Site(1, 3, 3)], 2)
    self.assertGreater(shared["diag exact / auto"], dense["diag exact / auto"])
    self.assertNotIn("top-8 low rank / auto", shared)

  def test_transformer_kfac_floor_by_hand(self):
    # Per block and position: 12 d^2 weights (q, k, v, out, the 4d MLP)
    # cost 6 x 12 d^2 flops in the gradient, attention scores 12 T d. The
    # factors: inputs d (q, k and v share it), d (out), d and 4d (MLP);
    # outputs d four times, 4d and d: 2 (1 + 1 + 1 + 16 + 4 + 16 + 1) d^2.
    # Plus the head (d -> 10, once) and the embedding (its output factor).
    _, params, in_shape = fe.make_model("transformer", small=False)
    sites, extra = fe.model_sites("transformer", params, in_shape)
    t, d, blocks = in_shape[0], 128, 2
    grad = blocks * (72 * t * d * d + 12 * t * t * d) + 6 * d * 10 + 4 * t * d
    kfac = blocks * 80 * t * d * d + 2 * t * d * d + 2 * (d * d + 100)
    floors = fe.flop_floors(sites, 4, **extra)
    self.assertAlmostEqual(
      floors["kron (K-FAC) / auto"], 1 + kfac / grad, places=6
    )

  def test_scanned_cnn_sites(self):
    # The plain CNN's sites, then two 3x3 16 -> 16 convs at 14 x 14 output
    # positions, whose forward runs again under remat.
    plain = fe.model_sites("cnn", *fe.make_model("cnn", small=False)[1:])
    _, params, in_shape = fe.make_model("cnn_scan", small=False)
    sites, extra = fe.model_sites("cnn_scan", params, in_shape)
    block = fe.Site(14 * 14, 9 * 16, 16)
    self.assertEqual(sites, plain[0] + [block, block])
    self.assertEqual(extra["fwd_other"], 2 * 2 * 14 * 14 * 9 * 16 * 16)
    self.assertEqual(plain[1], {"fwd_other": 0})


if __name__ == "__main__":
  absltest.main()
