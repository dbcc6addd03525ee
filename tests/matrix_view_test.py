# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Tests for the shared dimension-numbers module (fisher_optax._matrix_view)."""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import GaLoreDimensionNumbers
from optax.contrib import MuonDimensionNumbers

from fisher_optax import _matrix_view as matrix_view

DN = MuonDimensionNumbers


class ResolveTest(parameterized.TestCase):
  def test_none_gives_rank_two_leaves_the_default(self):
    tree = {"w": jnp.zeros((4, 3)), "k": jnp.zeros((2, 4, 3)), "b": 0.0}
    dims = matrix_view.resolve(None, tree)
    # jax.tree.leaves order: b, k, w.
    self.assertEqual(dims, [None, None, DN()])
    dims = matrix_view.resolve(None, tree, kind=GaLoreDimensionNumbers)
    self.assertIsInstance(dims[2], GaLoreDimensionNumbers)

  def test_single_spec_goes_to_every_matrix_leaf(self):
    tree = {
      "a": jnp.zeros((4, 3)),
      "b": jnp.zeros((3,)),
      "c": jnp.zeros((5, 2)),
    }
    spec = DN(-1, 0)
    self.assertEqual(matrix_view.resolve(spec, tree), [spec, None, spec])

  def test_single_spec_is_validated_against_every_leaf(self):
    tree = {"a": jnp.zeros((2, 4, 3)), "b": jnp.zeros((4, 3))}
    with self.assertRaisesRegex(ValueError, r"\['b'\].*out of range"):
      matrix_view.resolve(DN(1, 2), tree)

  def test_prefix_tree_and_callable(self):
    tree = {"enc": {"w": jnp.zeros((4, 3)), "v": jnp.zeros((2, 2))}, "b": 0.0}
    spec = {"enc": DN(), "b": None}
    self.assertEqual(matrix_view.resolve(spec, tree), [None, DN(), DN()])
    self.assertEqual(
      matrix_view.resolve(lambda _: spec, tree), [None, DN(), DN()]
    )

  def test_masked_nodes_have_no_entry(self):
    tree = {"w": jnp.zeros((4, 3)), "m": optax.MaskedNode()}
    self.assertEqual(matrix_view.resolve({"w": DN(), "m": None}, tree), [DN()])

  def test_errors(self):
    tree = {"w": jnp.zeros((4, 3)), "b": jnp.zeros((3,))}
    cases = [
      ({"w": DN(), "b": DN()}, r"\['b'\].*rank >= 2"),
      ({"w": DN(0, 0), "b": None}, r"\['w'\].*disjoint"),
      ({"w": DN((0, 0), 1), "b": None}, "disjoint"),
      ({"w": DN((), 1), "b": None}, "non-empty"),
      ({"w": DN(0, 2), "b": None}, r"\['w'\].*out of range"),
      ({"w": DN(-3, 1), "b": None}, "out of range"),
      ({"w": DN(0, -2), "b": None}, "disjoint"),  # -2 is axis 0: no wrap.
      ({"w": DN()}, "weight_dimension_numbers.*structure"),
      ({"w": 3, "b": None}, "MuonDimensionNumbers"),
    ]
    for spec, pattern in cases:
      with self.subTest(spec=str(spec)):
        with self.assertRaisesRegex(ValueError, pattern):
          matrix_view.resolve(spec, tree)

  def test_batch_axes_can_be_forbidden(self):
    tree = {"k": jnp.zeros((2, 4, 3))}
    matrix_view.resolve({"k": DN(1, 2)}, tree)  # batch axis 0: fine.
    with self.assertRaisesRegex(ValueError, r"split all 3 axes.*\(0,\)"):
      matrix_view.resolve({"k": DN(1, 2)}, tree, batch_axes=False)
    matrix_view.resolve({"k": DN((0, 1), 2)}, tree, batch_axes=False)


class LeafPlanTest(parameterized.TestCase):
  @parameterized.parameters(
    ((4, 3), DN(), (1, 4, 3)),
    ((4, 3), DN(1, 0), (1, 3, 4)),
    ((2, 3, 4, 5), DN((0, 1, 2), 3), (1, 24, 5)),
    ((2, 3, 4, 5), DN(3, (0, 2)), (3, 5, 8)),
    ((6, 4, 3), DN(-2, -1), (6, 4, 3)),
  )
  def test_round_trip(self, shape, dims, stacked):
    p = matrix_view.plan(shape, dims)
    self.assertEqual(p.stacked_shape, stacked)
    self.assertEqual((p.batch, p.rows, p.cols), stacked)
    x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    mats = p.to_matrices(x)
    self.assertEqual(mats.shape, stacked)
    np.testing.assert_array_equal(p.from_matrix(mats), x)
    if not p.batch_axes:
      np.testing.assert_array_equal(p.to_matrix(x), mats[0])
      np.testing.assert_array_equal(p.from_matrix(p.to_matrix(x)), x)

  def test_matrix_entries(self):
    # Rows: the reduction axes in order, columns: the output axes.
    x = jnp.arange(2 * 3 * 4.0).reshape(2, 3, 4)
    p = matrix_view.plan(x.shape, DN(2, (0, 1)))
    np.testing.assert_array_equal(p.to_matrix(x), x.reshape(6, 4).T)
    p = matrix_view.plan(x.shape, DN(1, 2))
    np.testing.assert_array_equal(p.to_matrices(x), x)
    with self.assertRaisesRegex(ValueError, "to_matrices"):
      p.to_matrix(x)

  def test_to_matrices_vmaps_over_a_leading_axis(self):
    x = jnp.arange(5 * 4 * 3.0).reshape(5, 4, 3)
    p = matrix_view.plan((4, 3), DN(1, 0))
    out = jax.vmap(p.to_matrices)(x)
    np.testing.assert_array_equal(out[:, 0], jnp.swapaxes(x, 1, 2))

  def test_numpy_integer_axes_are_ints(self):
    for dims, want in (
      (GaLoreDimensionNumbers(np.int64(0), np.int32(1)), ((0,), (1,))),
      (DN((np.int64(0), np.int8(1)), np.int64(-1)), ((0, 1), (2,))),
    ):
      with self.subTest(dims=str(dims)):
        shape = (4, 3) if len(want[0]) == 1 else (2, 4, 3)
        p = matrix_view.plan(shape, dims)
        self.assertEqual((p.reduction_axes, p.output_axes), want)
        for a in p.reduction_axes + p.output_axes:
          self.assertIs(type(a), int)
        hash(p)
    tree = {"w": jnp.zeros((4, 3))}
    plan = matrix_view.plans({"w": DN(np.int64(1), np.uint8(0))}, tree)[0]
    assert plan is not None
    self.assertEqual(plan.matrix_shape, (3, 4))

  def test_non_integer_axes_name_the_leaf(self):
    tree = {"w": jnp.zeros((4, 3))}
    for dims in (
      DN(0.0, 1),
      DN(np.float32(0), 1),
      DN((0, 1.5), 1),
      DN(None, 1),
      DN(True, 0),
      DN(np.bool_(True), 0),
    ):
      with self.subTest(dims=str(dims)):
        with self.assertRaisesRegex(ValueError, r"\['w'\].*non-integer"):
          matrix_view.resolve({"w": dims}, tree)

  def test_plans(self):
    tree = {"w": jnp.zeros((4, 3)), "b": jnp.zeros((3,))}
    b_plan, w_plan = matrix_view.plans(None, tree)
    self.assertIsNone(b_plan)
    assert w_plan is not None
    self.assertEqual(w_plan.matrix_shape, (4, 3))
    hash(w_plan)  # Static: usable as a jit cache key.


if __name__ == "__main__":
  absltest.main()
