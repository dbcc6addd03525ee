# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Layer statistics on 8 CPU devices, in a process of their own."""

from absl.testing import absltest

from tests import multidevice_util


class TapsMultiDeviceTest(absltest.TestCase):
  def test_sharded(self):
    multidevice_util.run_checks(self, "fisher_taps_checks.py")


if __name__ == "__main__":
  absltest.main()
