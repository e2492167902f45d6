"""The docs site covers the package: every public name, every cited paper, every script it names.

``mkdocs build --strict`` (in ``.ci/run``) catches broken links, anchors and
cross-references; these tests check what a build cannot: that the generated API
reference renders every public name, that the API overview mentions each of them,
that citations by name resolve to an entry of the references page, and that the
files the pages point to exist.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
API = DOCS / "api"
PAGES = sorted(DOCS.rglob("*.md"))

#: the modules whose public names the API reference documents
API_MODULES = [
    "teleopt",
    "teleopt.teleport",
    "teleopt.testing",
    "teleopt.testing.conformance",
    "teleopt.detection",
    "teleopt.discovery",
    "teleopt.datasets",
    "teleopt.demo",
    "teleopt.analysis",
    "teleopt.learned_teleport",
    "teleopt.integrations",
    "teleopt.checkpoint",
]


def _hook(name: str) -> ModuleType:
    """A module of ``docs/_hooks`` (the mkdocs hook and the griffe extension), loaded by path."""
    spec = importlib.util.spec_from_file_location(f"docs_hooks_{name}", DOCS / "_hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _griffe_package():
    """The ``teleopt`` package as griffe (and so mkdocstrings) sees it, with the docs' extension."""
    griffe = pytest.importorskip("griffe")
    extension = _hook("lazy_exports").LazyExports()
    return griffe.load("teleopt", search_paths=[str(ROOT)], extensions=griffe.load_extensions(extension))


def _import(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.skip(f"{module} is not installed")


@pytest.mark.parametrize("module", API_MODULES)
def test_api_overview_names_every_public_name(module):
    mod = _import(module)
    overview = (API / "index.md").read_text()
    missing = [n for n in mod.__all__ if not re.search(rf"`{re.escape(n)}\b", overview)]
    assert not missing, f"docs/api/index.md does not mention {module}: {missing}"
    for n in mod.__all__:
        obj = getattr(mod, n)
        if callable(obj):
            assert (obj.__doc__ or "").strip(), f"{module}.{n} has no docstring"


@pytest.mark.parametrize("module", API_MODULES)
def test_generated_api_reference_renders_every_public_name(module):
    """Each module has a ``::: module`` block, and mkdocstrings sees its whole ``__all__``.

    mkdocstrings renders the members a module exports; teleopt's lazy packages build
    ``__all__`` from a table that static analysis cannot read, which the docs'
    griffe extension fills in.  Submodules are not rendered as members: an exported
    submodule needs its own ``:::`` block.
    """
    package = _griffe_package()
    mod = _import(module)
    reference = "\n".join(p.read_text() for p in sorted(API.glob("*.md")))
    assert re.search(rf"^::: {re.escape(module)}$", reference, re.M), f"no '::: {module}' in docs/api/"
    loaded = package if module == "teleopt" else package[module.removeprefix("teleopt.")]
    exports = {str(e) for e in loaded.exports or ()}
    public = [n for n in mod.__all__ if not n.startswith("_")]  # dunders (__version__) are filtered out
    assert set(public) <= exports, f"griffe does not see these exports of {module}: {sorted(set(public) - exports)}"
    for n in public:
        assert n in loaded.members, f"{module}.{n} is exported but griffe cannot find it"
        if isinstance(getattr(mod, n), ModuleType):
            assert re.search(rf"^::: {re.escape(module)}\.{n}$", reference, re.M), f"submodule {module}.{n} needs a ':::' block"


def test_every_citation_name_has_an_entry_on_the_references_page():
    citations = _hook("citations")
    headings = re.findall(r"^### (.+)$", (DOCS / "references.md").read_text(), re.M)
    slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-"): h for h in headings}
    for name, anchor in citations.CITATIONS.items():
        assert slugs.get(anchor) == name, f"references.md needs a heading '### {name}' (anchor #{anchor})"
    assert set(citations.PAPERS.values()) <= set(citations.CITATIONS)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_pages_cite_papers_by_name(page):
    assert not re.search(r"papers/00\d", page.read_text()), "cite papers by name (see docs/references.md)"


def test_code_cites_papers_by_name():
    """Docstrings and comments cite "Zhao 2026, eq. 4.19", not the repository's ``papers/00N`` files."""
    sources = [f for sub in ("teleopt", "benchmarks", "examples") for f in (ROOT / sub).rglob("*.py")]
    assert len(sources) > 50  # the tree was found
    bad = [f.relative_to(ROOT).as_posix() for f in sources if re.search(r"papers/00\d", f.read_text())]
    assert bad == [], "cite papers by name (see docs/references.md)"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_files_the_pages_name_exist(page):
    text = page.read_text()
    for path in re.findall(r"`((?:examples|benchmarks|tests|teleopt|docs_snippets)/[\w./-]+)`", text):
        assert (ROOT / path).exists(), f"{page.name} names missing {path}"
    for script in re.findall(
        r"`(?:python benchmarks/)?((?:teleport|syre|learn)_[a-z_]+\.py|coverage\.py|conserved\.py|discovery\.py|ensemble\.py|invariance\.py)`",
        text,
    ):
        assert (ROOT / "benchmarks" / script).exists(), f"{page.name} names missing benchmark {script}"
    for example in re.findall(r"`(0\d_[a-z_]+\.py)`", text):
        assert (ROOT / "examples" / example).exists(), f"{page.name} names missing example {example}"


def test_every_example_is_in_the_examples_table_with_what_it_needs():
    table = (DOCS / "examples.md").read_text()
    for script in sorted((ROOT / "examples").glob("*.py")):
        row = next((line for line in table.splitlines() if f"`{script.name}`" in line), None)
        assert row is not None, f"docs/examples.md has no row for {script.name}"
        assert row.count("|") >= 4, f"{script.name}: the row must say what the example needs"
        assert "Needs:" in (script.read_text().split('"""')[1]), f"{script.name}: the docstring must say what to install"
