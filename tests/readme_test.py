# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The README's Python snippets run, in order, in one namespace; its claims
that can be checked cheaply are."""

import pathlib
import re
import tempfile

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fisher_optax

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_README = _ROOT / "README.md"


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

  def test_natural_galore_arguments_train_digits(self):
    # The README's natural_galore(...) call, as written, learns digits.
    from examples.common import datasets  # pylint: disable=g-import-not-at-top
    from examples.common import models  # pylint: disable=g-import-not-at-top

    call = re.search(
      r"fisher_optax\.natural_galore\((.*?)\)\n", _README.read_text(), re.S
    )
    self.assertIsNotNone(call)
    tx = eval(  # pylint: disable=eval-used
      f"fisher_optax.natural_galore({call.group(1)})",
      {"fisher_optax": fisher_optax},
    )
    data = datasets.load_digits(seed=0)
    apply_fn, params = models.digits_mlp(0, (64, 128, 128, 10))

    def loss(p, x, y):
      logits = apply_fn(p, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(p, s, x, y):
      updates, s = tx.update(jax.grad(loss)(p, x, y), s, p)
      return optax.apply_updates(p, updates), s

    (x, y), (xv, yv) = data["train"], data["val"]
    rng = np.random.default_rng(0)
    state = tx.init(params)
    for _ in range(100):
      idx = rng.integers(0, len(x), 64)
      params, state = step(params, state, x[idx], y[idx])
    accuracy = float(jnp.mean(jnp.argmax(apply_fn(params, xv), -1) == yv))
    self.assertGreater(accuracy, 0.85)

  def test_verdict_table_is_the_reports(self):
    # The README shows the verdicts benchmarks.report derived, not a copy
    # that drifts: the table must equal the report's headline file.
    headline = (_ROOT / "benchmarks/results/report_headline.md").read_text()
    self.assertIn(headline.strip(), _README.read_text())

  def test_run_times_are_stated_once(self):
    readme = _README.read_text()
    build = (_ROOT / "BUILD.md").read_text()
    stated = re.findall(r"about \d+ (?:s|minutes) on 2 cores", readme)
    self.assertLen(stated, 2, "the demo's and the tests' run time, once each")
    self.assertEmpty(re.findall(r"\d+ (?:s|minutes) on 2 cores", build))
    self.assertIn("README.md#set-up-two-commands", build)

  def test_each_paper_is_cited_with_one_year(self):
    # arXiv id -> years, from README links and docstring references.
    years: dict[str, set[str]] = {}
    names: dict[str, set[str]] = {}
    readme = _README.read_text()
    for name, year, arxiv in re.findall(
      r"\[([A-Z][^\]]*?) (\d{4})\]\(https://arxiv\.org/abs/([\d.]+)\)", readme
    ):
      years.setdefault(arxiv, set()).add(year)
      names.setdefault(name.replace("et al.", "et al"), set()).add(year)
    for path in sorted((_ROOT / "fisher_optax").rglob("*.py")):
      for arxiv, year in re.findall(
        r"arxiv\.org/abs/([\d.]+)>`_,? (\d{4})", path.read_text()
      ):
        years.setdefault(arxiv, set()).add(year)
    # Unlinked "Name et al YEAR" cells of the README and the report tables.
    report = (_ROOT / "benchmarks" / "REPORT.md").read_text()
    for text in (readme, report):
      for name, year in re.findall(r"\| ([A-Z][\w&. ]*?) (\d{4}) \|", text):
        key = name.replace("et al.", "et al")
        if key in names:
          names[key].add(year)
    self.assertNotEmpty(years)
    for key, found in {**years, **names}.items():
      self.assertLen(found, 1, f"{key} is cited as {sorted(found)}")


if __name__ == "__main__":
  absltest.main()
