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
