# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""Sphinx configuration of the fisher_optax documentation.

Build (see BUILD.md): ``python -m sphinx -W --keep-going -b html docs
docs/_build/html``. Before Sphinx reads the sources this file writes
``docs/_generated/``: the API pages (one per topic, from the public names in
``fisher_optax.__all__`` and ``fisher_optax.fisher.__all__``, so a new public
name is documented without editing the docs), the example notebooks copied
from ``examples/`` (rendered, not executed) and the Fisher-structures figure.
"""

from __future__ import annotations

import importlib.util
import inspect
import pathlib
import shutil
import sys
import warnings

_DOCS = pathlib.Path(__file__).resolve().parent
_ROOT = _DOCS.parent
sys.path.insert(0, str(_ROOT))

import fisher_optax  # noqa: E402
from fisher_optax import fisher  # noqa: E402

project = "fisher_optax"
author = "fisher_optax authors"
copyright = "2026, fisher_optax authors"  # noqa: A001
release = fisher_optax.__version__

extensions = [
  "myst_nb",
  "sphinx.ext.autodoc",
  "sphinx.ext.mathjax",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "**.ipynb_checkpoints", "fisher_figure.py"]
html_theme = "alabaster"
html_title = "fisher_optax"
html_static_path: list[str] = []

# Docstrings are Google style with reST math.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# "Attributes:" as fields, so NamedTuple fields are not described twice.
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Signatures stay as written (``optax.ScalarOrSchedule``), not expanded.
autodoc_type_aliases: dict[str, str] = {}
add_module_names = False
# Unresolved cross references (jax, optax and numpy types) are not errors:
# the build runs offline, without intersphinx inventories.
nitpicky = False

# Notebooks: rendered as committed (no outputs), never executed.
nb_execution_mode = "off"
myst_enable_extensions = ["dollarmath", "amsmath"]
suppress_warnings = [
  # Notebooks' markdown may skip heading levels (H1 then H3).
  "myst.header",
]

# -- generated pages ------------------------------------------------------------

_GEN = _DOCS / "_generated"

# Topic pages: (file, title, private modules whose public names it lists).
_TOPICS = [
  (
    "optimizers",
    "Optimizers",
    (
      "fisher_optax._fadam",
      "fisher_optax._fismo",
      "fisher_optax._natural_galore",
      "fisher_optax._mfac",
      "fisher_optax._accumulation",
      # FISMODimensionNumbers is optax.contrib's MuonDimensionNumbers.
      "optax.contrib._muon",
    ),
  ),
  (
    "continual",
    "Continual learning: EWC and protected subspaces",
    ("fisher_optax._ewc", "fisher_optax._physguard"),
  ),
  (
    "compression",
    "Merging, pruning and compression",
    ("fisher_optax._merging", "fisher_optax._obs", "fisher_optax._fwsvd"),
  ),
]
_ENGINE_TOPICS = [
  (
    "fisher_estimators",
    "Fisher estimators",
    ("fisher_optax.fisher._estimators", "fisher_optax.fisher._per_example"),
  ),
  (
    "fisher_statistics",
    "Fisher statistics",
    ("fisher_optax.fisher._statistics", "fisher_optax.fisher._rank_one_sum"),
  ),
  (
    "fisher_likelihoods",
    "Likelihoods",
    ("fisher_optax.fisher._likelihoods",),
  ),
  (
    "fisher_transforms",
    "Estimator transforms",
    ("fisher_optax.fisher._transforms",),
  ),
]
# Public modules documented whole (name, title, needs).
_MODULES = [
  ("fisher_optax.fisher.linalg", "fisher_optax.fisher.linalg", None),
  ("fisher_optax.fisher.numerics", "fisher_optax.fisher.numerics", None),
  ("fisher_optax.fisher.validation", "fisher_optax.fisher.validation", None),
  ("fisher_optax.flax", "fisher_optax.flax (Flax adapters)", "flax"),
  ("fisher_optax.checkpoint", "fisher_optax.checkpoint", "orbax"),
  ("fisher_optax.merge", "fisher_optax.merge (command line)", None),
]


def _public(module, prefix: str) -> list[tuple[str, object]]:
  """(documented name, object) of ``module.__all__``; deprecated aliases
  (their access warns) are left out."""
  out = []
  for name in module.__all__:
    with warnings.catch_warnings():
      warnings.simplefilter("error", DeprecationWarning)
      try:
        obj = getattr(module, name)
      except DeprecationWarning:
        continue
    if inspect.ismodule(obj) or name.startswith("__"):
      continue
    out.append((prefix + name, obj))
  return out


def _directive(qualname: str, obj) -> str:
  if inspect.isclass(obj):
    if issubclass(obj, tuple) and hasattr(obj, "_fields"):
      # NamedTuple states: the fields are documented in the class docstring.
      return f".. autoclass:: {qualname}\n"
    return f".. autoclass:: {qualname}\n   :members:\n"
  if callable(obj):
    return f".. autofunction:: {qualname}\n"
  return f".. autodata:: {qualname}\n"


def _summary(obj) -> str:
  """The docstring's first sentence (a period inside ``literal`` does not
  end it, unlike autosummary's extraction)."""
  para = (inspect.getdoc(obj) or "").split("\n\n")[0]
  para = " ".join(para.split())
  for i, char in enumerate(para):
    if char == "." and para[:i].count("``") % 2 == 0:
      if i + 1 == len(para) or para[i + 1] == " ":
        return para[: i + 1]
  return para


def _page(
  title: str, entries: list[tuple[str, object]], intro: str = ""
) -> str:
  lines = [title, "=" * len(title), ""]
  if intro:
    lines += [intro, ""]
  lines += [".. list-table::", "   :widths: 30 70", ""]
  for qualname, obj in entries:
    lines += [f"   * - :py:obj:`~{qualname}`", f"     - {_summary(obj)}"]
  lines += [""]
  for qualname, obj in entries:
    lines += [_directive(qualname, obj)]
  return "\n".join(lines)


# Constants carry no __module__: where they are defined.
_CONSTANTS = {"fisher_optax.fisher.KINDS": "fisher_optax.fisher._likelihoods"}


def _module_of(qualname: str, obj) -> str:
  return _CONSTANTS.get(qualname, getattr(obj, "__module__", "") or "")


def _write_api_pages() -> list[str]:
  """Writes one page per topic; every public name lands on exactly one."""
  api = _GEN / "api"
  api.mkdir(parents=True, exist_ok=True)
  entries = _public(fisher_optax, "fisher_optax.") + _public(
    fisher, "fisher_optax.fisher."
  )
  placed: set[str] = set()
  pages = []
  for topics, intro in (
    (_TOPICS, ""),
    (_ENGINE_TOPICS, "Part of the Fisher engine, :mod:`fisher_optax.fisher`."),
  ):
    for fname, title, modules in topics:
      chosen = [(q, o) for q, o in entries if _module_of(q, o) in modules]
      placed.update(q for q, _ in chosen)
      (api / f"{fname}.rst").write_text(_page(title, chosen, intro))
      pages.append(f"api/{fname}")
  rest = [(q, o) for q, o in entries if q not in placed]
  if rest:  # Public names of a module no topic lists yet.
    (api / "other.rst").write_text(_page("Other public names", rest))
    pages.append("api/other")
  for name, title, needs in _MODULES:
    if needs and importlib.util.find_spec(needs) is None:
      continue
    fname = name.replace("fisher_optax.", "").replace(".", "_")
    text = "\n".join(
      [
        title,
        "=" * len(title),
        "",
        f".. automodule:: {name}",
        "   :members:",
        # Names a module re-exports are documented where they are defined.
        "   :ignore-module-all:",
      ]
    )
    (api / f"{fname}.rst").write_text(text + "\n")
    pages.append(f"api/{fname}")
  index = ["API reference", "=============", "", ".. toctree::", ""]
  index += [f"   {p.removeprefix('api/')}" for p in pages]
  (api / "index.rst").write_text("\n".join(index) + "\n")
  return pages


def _copy_notebooks() -> None:
  out = _GEN / "examples"
  out.mkdir(parents=True, exist_ok=True)
  for nb in sorted((_ROOT / "examples").glob("*.ipynb")):
    shutil.copyfile(nb, out / nb.name)


def _draw_figure() -> None:
  spec = importlib.util.spec_from_file_location(
    "fisher_figure", _DOCS / "fisher_figure.py"
  )
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  module.render(_GEN / "fisher_structures.png")


if _GEN.exists():
  shutil.rmtree(_GEN)
_GEN.mkdir()
_write_api_pages()
_copy_notebooks()
_draw_figure()
