"""Project files a user or packager reads: licence, citation, version in one place."""

from __future__ import annotations

import re
from pathlib import Path

import teleopt

ROOT = Path(__file__).resolve().parents[1]


def test_license_is_the_one_pyproject_declares():
    assert 'license = { text = "MIT" }' in (ROOT / "pyproject.toml").read_text()
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")


def test_citation_names_the_package_version():
    match = re.search(r"^version: (\S+)$", (ROOT / "CITATION.cff").read_text(), re.M)
    assert match is not None and match.group(1) == teleopt.__version__


def test_version_is_written_once_in_the_package():
    """pyproject reads teleopt/_version.py; no other module spells the version out."""
    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()
    spelled = [p for p in (ROOT / "teleopt").rglob("*.py") if teleopt.__version__ in p.read_text()]
    assert spelled == [ROOT / "teleopt" / "_version.py"]


def test_changelog_keeps_a_changelog_with_an_unreleased_section():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog") and "keepachangelog.com" in text
    assert "## [Unreleased]" in text
    sections = re.findall(r"^### (\w+)$", text, re.M)
    assert sections and set(sections) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def _toml_table(name: str) -> dict[str, str]:
    """``key = "value"`` lines of one table of pyproject.toml (tomllib is not in Python 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    body = re.search(rf"^\[{re.escape(name)}\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert body is not None, f"pyproject.toml has no [{name}]"
    return dict(re.findall(r'^([\w-]+) = "([^"]*)"', body.group(1), re.M))


def test_pyproject_names_project_urls_that_exist():
    urls = _toml_table("project.urls")
    assert {"Homepage", "Documentation"} <= set(urls)
    for value in urls.values():  # no public host yet: documents of the source tree
        assert value.startswith("https://") or (ROOT / value).is_file(), value


def _install_lines() -> list[tuple[str, str]]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").glob("*.py"))]
    return [
        (f"{f.relative_to(ROOT)}:{n}", line) for f in files for n, line in enumerate(f.read_text().splitlines(), 1) if "pip install" in line
    ]


def test_documented_installs_name_a_source_not_a_package_index():
    """teleopt is on no package index: every documented install of it names a clone, a wheel or a VCS URL."""
    extras = set(
        re.findall(r"^(\w+) = \[", (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0], re.M)
    )
    by_name = re.compile(r"""pip install (?:-\w+ )*(["']?)teleopt(?:\[[\w,]+\])?\1(?=\s|`|$)(?!\s+@)""")
    for where, line in _install_lines():
        assert not by_name.search(line), f"{where}: {line.strip()}"
        for spec in re.findall(r"teleopt[^\s\"'`]*\[([\w,]+)\]", line):
            assert set(spec.split(",")) <= extras, f"{where}: unknown extra in {line.strip()}"


def test_the_documented_wheel_install_is_the_one_ci_runs():
    install = (ROOT / "docs" / "install.md").read_text()
    script = (ROOT / ".ci" / "downstream.sh").read_text()
    assert "python -m pip wheel --no-deps -w dist /path/to/teleopt" in install
    assert 'pip install "$(ls dist/teleopt-*.whl)[testing]"' in install
    assert "python -m pip wheel --no-deps" in script and 'pip install --quiet "${wheel}[testing]"' in script
    assert "bash .ci/downstream.sh" in (ROOT / ".ci" / "run").read_text()
