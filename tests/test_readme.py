"""The README's and the docs pages' commands and python snippets are the ones that work.

Every ```python block of ``README.md`` and ``docs/*.md`` runs, in a temporary working
directory (snippets write checkpoints), with one torch thread; a snippet that defines
``test_*`` functions also passes them.  An HTML comment on the line before a block
says what the block needs::

    <!-- snippet: requires timm, hypothesis -->   skipped when a module is missing
    <!-- snippet: slow -->                        run with the slow reproductions
    <!-- snippet: skip (why) -->                  shown only, never run
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_BLOCK = re.compile(r"(?:<!--\s*snippet:\s*(?P<directive>.*?)\s*-->\s*\n)?```python\n(?P<code>.*?)```", re.S)


def snippets(path: Path) -> list[tuple[str, str]]:
    """``(directive, code)`` of every python block in ``path``; directive is "" when there is none."""
    return [(m.group("directive") or "", m.group("code")) for m in _BLOCK.finditer(path.read_text())]


def _params():
    for path in PAGES:
        name = path.relative_to(ROOT).as_posix()
        for index, (directive, code) in enumerate(snippets(path)):
            marks = [pytest.mark.slow] if directive == "slow" else []
            yield pytest.param(name, index, directive, code, id=f"{name}[{index}]", marks=marks)


def run_snippet(name: str, index: int, code: str) -> str:
    """Run one snippet (and the tests it defines) with one torch thread; returns what it printed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = io.StringIO()
    try:
        namespace: dict = {"__name__": "snippet_" + re.sub(r"\W", "_", name) + f"_{index}"}
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"{name} python snippet {index}", "exec"), namespace)
            for key, value in list(namespace.items()):
                if key.startswith("test_") and callable(value):
                    value()  # snippets that show a test also pass it
    finally:
        torch.set_num_threads(threads)
    return out.getvalue()


@pytest.mark.parametrize(("name", "index", "directive", "code"), list(_params()))
def test_python_snippets_run(name, index, directive, code, tmp_path, monkeypatch):
    if directive.startswith("skip"):
        pytest.skip(f"{name} snippet {index}: {directive}")
    if directive.startswith("requires"):
        for module in directive.removeprefix("requires").replace(",", " ").split():
            pytest.importorskip(module)
    elif directive not in ("", "slow"):
        raise AssertionError(f"{name} snippet {index}: unknown directive {directive!r} (requires ..., slow, skip)")
    monkeypatch.chdir(tmp_path)  # snippets may write files (checkpoints)
    run_snippet(name, index, code)
    assert not any(ROOT.glob("*.pt")), "a snippet wrote into the repository"


def test_the_first_command_is_the_demo_and_ci_runs_the_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    assert commands[0] == 'pip install -e ".[demo]" && python -m teleopt demo'
    assert commands[1] == 'pip install -e ".[dev]" && python -m pytest'
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for part in commands[1].split(" && "):  # CI installs, then runs lint, types and docs, then the suite
        assert part in ci, f".ci/run must run {part!r} on a line of its own"
    extras = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"demo = \[[^\]]*scikit-learn[^\]]*matplotlib", extras), "the demo extra must bring what the demo imports"


def _normalised(text: str) -> list[str]:
    """Lines with every number replaced by #: the shape of the output, not its timings."""
    return [re.sub(r"\d+(\.\d+)?", "#", line).rstrip() for line in text.strip().splitlines()]


def test_the_integration_prints_what_the_readme_shows(tmp_path, monkeypatch):
    expected = README.split("<!-- expected-output -->\n```\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    printed = run_snippet("README.md", 0, snippets(ROOT / "README.md")[0][1])
    assert _normalised(printed) == _normalised(expected)


def test_readme_is_short_and_links_to_existing_files():
    assert len(README.splitlines()) <= 200, "the README is the front page: details go to docs/"
    for target in re.findall(r"\]\(((?!https?:)[^)#]+)(?:#[^)]*)?\)", README):
        assert (ROOT / target).exists(), f"README links to missing {target}"


def test_readme_cites_papers_by_name():
    assert not re.search(r"papers/00\d", README), "cite papers by name (docs/references.md), not by papers/00N"
