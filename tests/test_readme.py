"""The README's commands and snippets are the ones that work, and its API reference names every public name."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else len(README)]


def test_the_first_command_is_the_demo_and_ci_runs_the_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    assert commands[0] == 'pip install -e ".[demo]" && python -m teleopt demo'
    assert commands[1] == 'pip install -e ".[dev]" && python -m pytest'
    # CI runs the same two halves, in order, with its lint and type gates between them
    ci = "\n".join(line for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.lstrip().startswith("#"))
    install, run = commands[1].split(" && ")
    assert install in ci and run in ci and ci.index(install) < ci.index(run)
    extras = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"demo = \[[^\]]*scikit-learn[^\]]*matplotlib", extras), "the demo extra must bring what the demo imports"


SNIPPETS = re.findall(r"```python\n(.*?)```", README, re.S)


@pytest.mark.parametrize(
    "index",
    # the full conformance suite over every base optimizer takes ~20 s: run with the slow reproductions
    [pytest.param(i, marks=pytest.mark.slow) if "check_wrapper(" in snippet else i for i, snippet in enumerate(SNIPPETS)],
)
def test_python_snippets_run(index, tmp_path, monkeypatch):
    # a snippet whose first line is "# requires: a, b" is skipped when a or b is not installed
    required = re.match(r"# requires: ([\w, ]+)\n", SNIPPETS[index])
    for module in required.group(1).split(",") if required else ():
        pytest.importorskip(module.strip())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # transformers snippets build models from configs, never download
    monkeypatch.chdir(tmp_path)  # snippets may write files (checkpoints)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        namespace: dict = {"__name__": f"readme_snippet_{index}"}
        exec(compile(SNIPPETS[index], f"README.md python snippet {index}", "exec"), namespace)
        for name, value in list(namespace.items()):
            if name.startswith("test_") and callable(value):
                value()  # snippets that show a test also pass it
    finally:
        torch.set_num_threads(threads)


API_MODULES = [
    "teleopt",
    "teleopt.teleport",
    "teleopt.testing",
    "teleopt.testing.conformance",
    "teleopt.detection",
    "teleopt.integrations",
    "teleopt.discovery",
    "teleopt.datasets",
    "teleopt.demo",
    "teleopt.analysis",
    "teleopt.learned_teleport",
    "teleopt.checkpoint",
]


@pytest.mark.parametrize("module", API_MODULES)
def test_api_reference_names_every_public_name(module):
    try:
        mod = importlib.import_module(module)
    except ImportError:
        pytest.skip(f"{module} is not installed")
    api = _section("API reference")
    missing = [n for n in getattr(mod, "__all__", []) if not re.search(rf"`{re.escape(n)}\b", api)]
    assert not missing, f"README 'API reference' does not mention {module}: {missing}"
    for n in getattr(mod, "__all__", []):
        obj = getattr(mod, n)
        if callable(obj):
            assert (obj.__doc__ or "").strip(), f"{module}.{n} has no docstring"


def test_readme_sections_link_to_existing_files():
    for target in re.findall(r"\]\(((?:examples|benchmarks)/[^)#]+)\)", README):
        assert (ROOT / target).exists(), f"README links to missing {target}"
    for script in re.findall(r"`((?:teleport|syre)_[a-z_]+\.py)`", _section("Reproductions")):
        assert (ROOT / "benchmarks" / script).exists(), f"README lists missing benchmark {script}"
