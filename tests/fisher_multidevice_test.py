# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Runs tests/multidevice/fisher_checks.py on 8 CPU devices."""

from absl.testing import absltest

from tests import multidevice_util


class FisherMultiDeviceTest(absltest.TestCase):
  def test_eight_devices_match_one(self):
    multidevice_util.run_checks(self, "fisher_checks.py")


if __name__ == "__main__":
  absltest.main()
