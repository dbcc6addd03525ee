# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The README's Python snippets run, in order, in one namespace."""

import pathlib
import re
import tempfile

from absl.testing import absltest

_README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


class ReadmeTest(absltest.TestCase):
  def test_python_snippets_run(self):
    blocks = re.findall(r"```python\n(.*?)```", _README.read_text(), re.DOTALL)
    self.assertGreaterEqual(len(blocks), 6)
    with tempfile.TemporaryDirectory() as tmp:
      namespace = {"path": str(pathlib.Path(tmp) / "opt_state")}
      for i, block in enumerate(blocks):
        try:
          exec(compile(block, f"README.md block {i}", "exec"), namespace)  # pylint: disable=exec-used
        except Exception as e:  # pylint: disable=broad-except
          self.fail(f"README python block {i} failed: {e!r}\n{block}")
    # The quick start really stepped: parameters moved from zero.
    self.assertTrue(float(abs(namespace["params"]["w"]).sum()) > 0)


if __name__ == "__main__":
  absltest.main()
