# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Checkpoints of sharded states on 8 CPU devices, in its own process."""

from absl.testing import absltest

from tests import multidevice_util


class CheckpointMultiDeviceTest(absltest.TestCase):
  def test_sharded(self):
    multidevice_util.run_checks(self, "checkpoint_checks.py")


if __name__ == "__main__":
  absltest.main()
