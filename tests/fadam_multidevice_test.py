# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""FAdam under sharded jit on 8 CPU devices, in a process of its own."""

from absl.testing import absltest

from tests import multidevice_util


class FAdamMultiDeviceTest(absltest.TestCase):
  def test_sharded(self):
    multidevice_util.run_checks(self, "fadam_checks.py")


if __name__ == "__main__":
  absltest.main()
