# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Runs tests/multidevice/fismo_checks.py on 8 CPU devices."""

from absl.testing import absltest

from tests import multidevice_util


class FismoMultiDeviceTest(absltest.TestCase):
  def test_sharded_checks(self):
    multidevice_util.run_checks(self, "fismo_checks.py")


if __name__ == "__main__":
  absltest.main()
