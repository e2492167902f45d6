"""The result of detection: sites, what was skipped and why, and how much of the model they cover."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from teleopt.detection.certify import CertificationEntry
from teleopt.site import Site

__all__ = ["SkippedEntry", "SymmetryReport"]


@dataclass(frozen=True)
class SkippedEntry:
    """Something detection did not turn into a site, and why (an unknown op, a degraded attention, ...)."""

    kind: str
    where: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "where": self.where, "reason": self.reason}


@dataclass
class SymmetryReport:
    """Symmetry sites of a model (``teleopt.find_symmetries``), with what was skipped and the coverage.

    Attributes
    ----------
    sites:
        The detected :class:`~teleopt.site.Site` objects, bound by qualified names of
        ``model.state_dict()`` entries; each acts in place (``Site.apply_``).
    skipped:
        Ops, modules, attention blocks and sites that were left out, with the reason.
    frozen:
        For every parameter no continuous site acts on: why (the first blocking op per axis).
    coverage:
        Fraction of the model's parameter entries acted on by at least one continuous site.
    coverage_exact:
        The same for exact continuous sites only (without the eps-approximate BatchNorm
        input scaling).
    parameters:
        Number of parameter entries of the model (shared tensors counted once).
    model:
        The model's class name.
    seconds:
        Wall-clock time of the detection (certification included).
    certification:
        One :class:`~teleopt.detection.certify.CertificationEntry` per site the rules
        proposed (``status`` "certified", "dropped", "demoted" or "unchecked", with the
        measured relative output error); empty when detection ran with ``certify=False``.
    certify_seconds:
        Wall-clock time of the certification.
    certified:
        Whether the sites were certified (``find_symmetries(..., certify=True)``).
    """

    sites: list[Site]
    skipped: list[SkippedEntry] = field(default_factory=list)
    frozen: dict[str, str] = field(default_factory=dict)
    coverage: float = 0.0
    coverage_exact: float = 0.0
    parameters: int = 0
    model: str = ""
    seconds: float = 0.0
    certification: list[CertificationEntry] = field(default_factory=list)
    certify_seconds: float = 0.0
    certified: bool = False

    @property
    def dropped(self) -> list[CertificationEntry]:
        """The proposed sites that failed certification, with their errors."""
        return [e for e in self.certification if e.status == "dropped"]

    @property
    def continuous_sites(self) -> list[Site]:
        """Sites of Lie groups (GL, positive scaling, translations): what teleportation moves along."""
        return [s for s in self.sites if s.action.continuous]

    @property
    def discrete_sites(self) -> list[Site]:
        """Sites of finite groups (permutations)."""
        return [s for s in self.sites if not s.action.continuous]

    def __getitem__(self, name: str) -> Site:
        for s in self.sites:
            if s.name == name:
                return s
        raise KeyError(f"no site named {name!r}; sites: {[s.name for s in self.sites][:8]}...")

    def __len__(self) -> int:
        return len(self.sites)

    def table(self, max_members: int = 3) -> str:
        """A readable table: site, action, group, members, exact/approximate."""
        rows = [("site", "action", "group", "members", "exactness")]
        for s in self.sites:
            names = list(dict.fromkeys(s.tensor_names))
            shown = ", ".join(names[:max_members]) + (f", ... (+{len(names) - max_members})" if len(names) > max_members else "")
            rows.append((s.name, s.action.name, s.action.group_name, f"{len(names)}: {shown}", s.action.exactness))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        widths[3] = min(widths[3], 90)
        lines = []
        for k, r in enumerate(rows):
            cells = [c if len(c) <= widths[i] else c[: widths[i] - 3] + "..." for i, c in enumerate(r)]
            lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: sites found, coverage, skipped entries, time."""
        n_cont = len(self.continuous_sites)
        return (
            f"{self.model}: {len(self.sites)} sites ({n_cont} continuous, {len(self.sites) - n_cont} discrete), "
            f"coverage {100 * self.coverage:.1f}% of {self.parameters} parameters ({100 * self.coverage_exact:.1f}% by exact sites), "
            f"{len(self.skipped)} skipped, {len(self.frozen)} parameters without a continuous site, {self.seconds:.2f} s"
            + (f" ({len(self.dropped)} sites dropped by certification, {self.certify_seconds:.2f} s)" if self.certified else "")
        )

    def __str__(self) -> str:
        parts = [self.summary(), "", self.table()]
        if self.skipped:
            parts += ["", "skipped:"] + [f"  [{e.kind}] {e.where}: {e.reason}" for e in self.skipped]
        return "\n".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (sites by tensor name); :meth:`from_dict` rebuilds the report."""
        return {
            "model": self.model,
            "sites": [s.to_dict() for s in self.sites],
            "skipped": [e.to_dict() for e in self.skipped],
            "frozen": dict(self.frozen),
            "coverage": self.coverage,
            "coverage_exact": self.coverage_exact,
            "parameters": self.parameters,
            "seconds": self.seconds,
            "certification": [e.to_dict() for e in self.certification],
            "certify_seconds": self.certify_seconds,
            "certified": self.certified,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SymmetryReport:
        """Inverse of :meth:`to_dict`; ``ValueError`` naming the entry for malformed data."""
        if not isinstance(data, dict):
            raise ValueError(f"a symmetry report is a dict, got {type(data).__name__}")
        sites = _sites_from(data)
        skipped = _skipped_from(data)
        frozen = _typed(data, "frozen", dict, {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in frozen.items()):
            raise ValueError("symmetry report: 'frozen' must map parameter names to reasons (strings)")
        numbers = _bounded_numbers_from(data)
        parameters = _typed(data, "parameters", int, 0)
        if parameters < 0:
            raise ValueError(f"symmetry report: parameters={parameters} is negative")
        certification = _certification_from(data)
        certify_seconds = float(_typed(data, "certify_seconds", (int, float), 0.0))
        if not certify_seconds >= 0.0:
            raise ValueError(f"symmetry report: certify_seconds={certify_seconds!r} is negative")
        return cls(
            sites=sites,
            skipped=skipped,
            frozen=dict(frozen),
            parameters=parameters,
            model=_typed(data, "model", str, ""),
            certification=certification,
            certify_seconds=certify_seconds,
            certified=_typed(data, "certified", bool, False),
            **numbers,
        )


def _sites_from(data: dict[str, Any]) -> list[Site]:
    """The sites of a report dict; ``ValueError`` naming the first malformed one."""
    if not isinstance(data.get("sites"), list):
        raise ValueError("a symmetry report needs 'sites', a list of site dicts")
    sites = []
    for number, entry in enumerate(data["sites"]):
        try:
            sites.append(Site.from_dict(entry))
        except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
            raise ValueError(f"symmetry report: site {number} is malformed ({type(e).__name__}: {e})") from e
    return sites


def _skipped_from(data: dict[str, Any]) -> list[SkippedEntry]:
    """The skipped entries of a report dict, each a dict of strings kind, where, reason; else ``ValueError``."""
    skipped = []
    for number, entry in enumerate(_typed(data, "skipped", list, [])):
        if not isinstance(entry, dict) or set(entry) != {"kind", "where", "reason"} or not all(isinstance(v, str) for v in entry.values()):
            raise ValueError(f"symmetry report: skipped entry {number} must be a dict of strings kind, where, reason")
        skipped.append(SkippedEntry(**entry))
    return skipped


def _bounded_numbers_from(data: dict[str, Any]) -> dict[str, float]:
    """``coverage`` and ``coverage_exact`` in [0, 1] and ``seconds`` >= 0, as floats; else ``ValueError``."""
    numbers = {}
    for key, low, high in (("coverage", 0.0, 1.0), ("coverage_exact", 0.0, 1.0), ("seconds", 0.0, math.inf)):
        value = _typed(data, key, (int, float), 0.0)
        if not (low <= value <= high) or math.isnan(value):
            raise ValueError(f"symmetry report: {key}={value!r} is outside [{low}, {high}]")
        numbers[key] = float(value)
    return numbers


def _certification_from(data: dict[str, Any]) -> list[CertificationEntry]:
    """The certification entries of a report dict; ``ValueError`` naming the first malformed one."""
    certification = []
    for number, entry in enumerate(_typed(data, "certification", list, [])):
        try:
            certification.append(CertificationEntry.from_dict(entry))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"symmetry report: certification entry {number} is malformed ({type(e).__name__}: {e})") from e
    return certification


def _typed(data: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    """``data[key]`` (or ``default``) when it has the type ``kind`` (bools are not numbers); else ``ValueError``."""
    value = data.get(key, default)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"symmetry report: {key!r} has type {type(value).__name__}")
    return value
