"""Comments and docstrings in ``teleopt/`` state contracts; measured figures live in the docs.

Benchmark figures in code go stale without anyone noticing; they belong in
``docs/performance.md`` (or ``docs/reproductions.md`` and ``benchmarks/``), dated and
re-measurable.  The pattern is conservative: durations, sizes in bytes, speed ratios,
"Nx the parameters" memory ratios, seed counts of an experiment's outcome and
overhead shares.  Tolerances, exponents and counts from the math pass.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "teleopt"

FIGURE = re.compile(
    r"""
      \b\d+(?:\.\d+)?\s?(?:ms|us|µs|ns)\b                          # a duration
    | \b\d+(?:\.\d+)?\s?[KMG]i?B\b                                # a size in bytes
    | \b\d+(?:\.\d+)?x\s(?:faster|slower)\b | \bspeed-?ups?\sof\b    # a speed ratio
    | \b\d+\.\d+x\s(?:the|its)\s(?:parameters|gradients?)\b          # a measured memory ratio
    | \b\d+\sof\s\d+\s(?:\w+\s)?seeds\b | \bmedian\sof\s\d+\sseeds\b  # an experiment's outcome
    | \b\d+(?:\.\d+)?\s?%\sof\s(?:an?\s)?(?:iteration|step)\b       # an overhead share
    """,
    re.X,
)


def comments_and_docstrings(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and every line of every docstring."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            if isinstance(body[0].value.value, str):
                for i, line in enumerate(body[0].value.value.splitlines()):
                    yield body[0].lineno + i, line


def figures(source: str) -> list[str]:
    return [f"line {line}: {text.strip()}" for line, text in comments_and_docstrings(source) if FIGURE.search(text)]


def test_comments_and_docstrings_quote_no_benchmark_figures():
    found = {str(p.relative_to(PACKAGE.parent)): f for p in sorted(PACKAGE.rglob("*.py")) if (f := figures(p.read_text()))}
    assert not found, f"measured figures in comments or docstrings (move them to docs/performance.md): {found}"


def test_the_pattern_flags_measurements_and_passes_the_math():
    flagged = [
        "# 8.4 -> 0.6 ms (2-core CPU)",
        "# a fresh 16 MB on mlp-10M",
        "# on 2 cores 5x faster for a 768 x 3072 weight",
        "# vit_tiny's coordinates are 0.1x its parameters",
        "# 2 of 4 seeds left one generator out",
        "# which cost 34 us a forward (6% of an iteration)",
        '"""Timing: 2 of the 8 us a step adds."""',
    ]
    passed = [
        "# a failure by less than 100x below float64 is re-run",
        "# about 30x for beta2 = 0.999",
        "# rtol 1e-10 leaves four orders of margin",
        "# the state is 3x the parameters under Adam",
        "# the papers' 3x teleport learning rate",
        "x = '12 ms'  # a string in code is not a comment",
    ]
    assert all(figures(line) for line in flagged)
    assert not any(figures(line) for line in passed)
