"""mkdocs hook: citations by name, linked to the references page; readable Sphinx roles.

The docs cite papers by name ("Zhao 2026, eq. 4.19", "Ziyin et al. 2025, eq. 6"),
keeping the equation and section numbers of the copies the code was written
from.  ``CITATIONS`` is the one table of those names: the references page uses
its anchors, ``tests/test_docs.py`` uses it to compare the registry table with
``python -m teleopt list``, and this hook, on every rendered page,

* replaces the code's internal identifiers ``papers/000`` ... ``papers/004``
  (still in some docstrings) by the paper's name;
* links every citation name in running text to its entry on the references page;
* turns the Sphinx roles of the docstrings (:class:`~teleopt.site.Site`,
  :meth:`attach`, ...) into cross-references where the target is documented, and
  into plain code where it is not (they never fail the strict build).
"""

from __future__ import annotations

import html as html_lib
import importlib
import re
import sys
from pathlib import Path
from typing import Any

#: the checkout being documented comes first on the path (not another installed copy)
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: name used in the docs -> anchor on references.md
CITATIONS: dict[str, str] = {
    "Zhao et al. 2022": "zhao-et-al-2022",
    "Zhao et al. 2023": "zhao-et-al-2023",
    "Zhao et al. 2024a": "zhao-et-al-2024a",
    "Zhao et al. 2024b": "zhao-et-al-2024b",
    "Zhao 2026": "zhao-2026",
    "Ziyin et al. 2025": "ziyin-et-al-2025",
    "Gideoni 2023": "gideoni-2023",
    "Ashkboos et al. 2024a": "ashkboos-et-al-2024a",
    "Ashkboos et al. 2024b": "ashkboos-et-al-2024b",
    "Stock et al. 2019": "stock-et-al-2019",
    "Mishkin et al. 2024": "mishkin-et-al-2024",
    "Wu et al. 2025": "wu-et-al-2025",
    "Heo et al. 2021": "heo-et-al-2021",
    "Kimi Team 2025": "kimi-team-2025",
}

#: the identifiers the code cites (``papers/00N``) -> name in the docs
PAPERS: dict[str, str] = {
    "papers/000": "Zhao et al. 2024b",
    "papers/001": "Zhao 2026",
    "papers/002": "Zhao et al. 2023",
    "papers/003": "Ziyin et al. 2025",
    "papers/004": "Gideoni 2023",
}

REFERENCES_PAGE = "references.md"

_PAPER_RE = re.compile(r"papers/00[0-4]")
_NAME_RE = re.compile("|".join(re.escape(n) for n in sorted(CITATIONS, key=len, reverse=True)))
_ROLE_RE = re.compile(
    r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const|attribute|method|function):"
    r"<code>(~?)([\w.]+)(\(\))?(?:\s+&lt;([\w.]+)&gt;)?</code>"
)
_TOKEN_RE = re.compile(r"(<[^>]*>)")
_TAG_RE = re.compile(r"<(/?)([a-zA-Z][a-zA-Z0-9]*)")
#: inside these, citation names are not linked (no links in links, code or headings)
_NO_LINK = {"a", "autoref", "code", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "title"}


def cite(text: str) -> str:
    """``text`` with every ``papers/00N`` identifier replaced by the paper's name."""
    return _PAPER_RE.sub(lambda m: PAPERS[m.group(0)], text)


def _public_names() -> set[str]:
    try:
        return set(importlib.import_module("teleopt").__all__)
    except ImportError:  # pragma: no cover - the docs build imports the package it documents
        return set()


_TOP_LEVEL = _public_names()


def _role(match: re.Match[str]) -> str:
    short, target, call, explicit = match.group(1), match.group(2), match.group(3) or "", match.group(4)
    title = html_lib.escape((target.rsplit(".", 1)[-1] if short else target) + call)
    target = explicit or target  # :meth:`title <target>`
    if "." not in target:
        if target not in _TOP_LEVEL:  # a name relative to its docstring's object: no page anchor to guess
            return f"<code>{title}</code>"
        target = f"teleopt.{target}"
    return f'<autoref identifier="{html_lib.escape(target)}" optional><code>{title}</code></autoref>'


def link_citations(html: str, references_url: str | None) -> str:
    """Replace ``papers/00N`` by names everywhere and link names in running text to ``references_url``."""
    out: list[str] = []
    open_tags: list[str] = []
    for token in _TOKEN_RE.split(html):
        if not token:
            continue
        if token.startswith("<"):
            tag = _TAG_RE.match(token)
            if tag and not token.endswith("/>"):
                name = tag.group(2).lower()
                if tag.group(1):
                    if name in open_tags:
                        del open_tags[len(open_tags) - 1 - open_tags[::-1].index(name)]
                elif name in _NO_LINK:
                    open_tags.append(name)
            out.append(token)
            continue
        token = cite(token)
        if references_url is not None and not open_tags:
            token = _NAME_RE.sub(lambda m: f'<a href="{references_url}#{CITATIONS[m.group(0)]}">{m.group(0)}</a>', token)
        out.append(token)
    return "".join(out)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    html = _ROLE_RE.sub(_role, html)
    target = files.get_file_from_path(REFERENCES_PAGE)
    url = None if target is None or page.file.src_uri == REFERENCES_PAGE else target.url_relative_to(page.file)
    return link_citations(html, url)
