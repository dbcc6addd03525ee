# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Fisher merging of sharded models on 8 CPU devices, in its own process."""

from absl.testing import absltest

from tests import multidevice_util


class MergingMultiDeviceTest(absltest.TestCase):
  def test_sharded(self):
    multidevice_util.run_checks(self, "merging_checks.py")


if __name__ == "__main__":
  absltest.main()
