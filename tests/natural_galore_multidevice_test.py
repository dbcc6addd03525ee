# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Runs the Natural GaLore sharding checks on 8 CPU devices."""

from absl.testing import absltest

from tests import multidevice_util


class NaturalGaLoreMultiDeviceTest(absltest.TestCase):
  def test_sharded_checks(self):
    multidevice_util.run_checks(self, "natural_galore_checks.py")


if __name__ == "__main__":
  absltest.main()
