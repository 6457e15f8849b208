"""What ``tap explain`` found (:func:`enginetap.jobs.explain.explain` returns it; the verdict,
:mod:`enginetap.jobs.explain_verdict`, fills it in)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from enginetap.tap.analysis.culprit import Culprit

__all__ = ["ExplainResult"]


@dataclass
class ExplainResult:
    culprit: Culprit
    op: str
    definition: str
    verdict: str
    evidence: list[str] = field(default_factory=list)
    repro: Path | None = None
    workloads: int = 0
    kind: str = ""
    """``upstream``, ``batch-variant``, ``nondeterministic``, ``wrong-row``, ``after-op``
    (the probed op agrees; an unprobed op after it in the module differs) or ``none``
    (not reproduced)."""
    records: list[Any] = field(default_factory=list, repr=False)
    """The calls made again (:class:`~enginetap.jobs.explain_verdict.Config`)."""
    candidates: list[str] = field(default_factory=list)
    """What each ``--solution`` did on the calls made again."""

    def to_json(self) -> dict[str, Any]:
        return {"finding": self.culprit.describe(), "op": self.op, "definition": self.definition,
                "kind": self.kind, "verdict": self.verdict, "evidence": self.evidence,
                "repro": str(self.repro) if self.repro else None, "workloads": self.workloads,
                "candidates": self.candidates}
