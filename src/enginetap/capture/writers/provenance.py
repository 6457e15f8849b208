"""Provenance receipts: where each captured workload came from.

The static part (model, config hash, engine and version, command line, the environment
variables that shape the engine and enginetap) is gathered once per process; each
workload adds its request keys and labels, step, mode, layer, rank, the probe and target,
the variant it filled, and every note its adapter made about changed layouts.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

from enginetap import __version__
from enginetap.dataset.schema import Receipt

__all__ = ["ENV_PREFIXES", "Facts", "PendingReceipt", "Provenance", "model_identity"]

ENV_PREFIXES = ("ENGINETAP", "VLLM_", "TRANSFORMERS_", "HF_", "OMP_", "CUDA_VISIBLE", "TORCH_")
"""Environment variables recorded: they change what the engine runs."""


def model_identity(model: Any) -> dict[str, str]:
    """The model's path and a hash of its config (sorted JSON of ``model.config``)."""
    config = getattr(model, "config", None)
    as_dict = config.to_dict() if hasattr(config, "to_dict") else {}
    text = json.dumps(as_dict, sort_keys=True, default=str)
    return {"model": str(getattr(config, "_name_or_path", "") or ""),
            "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "model_type": str(as_dict.get("model_type", ""))}


class Provenance:
    """Receipts for one armed process."""

    def __init__(self, engine: str, engine_version: str, rank: int, world_size: int) -> None:
        self.engine, self.engine_version = engine, engine_version
        self.rank, self.world_size = rank, world_size
        self.model: dict[str, str] = {}
        self.static = {
            "command_line": list(sys.argv),
            "environment": {k: v for k, v in sorted(os.environ.items())
                            if k.startswith(ENV_PREFIXES)},
            "python": sys.version.split()[0],
        }

    def state(self) -> dict[str, Any]:
        """What :meth:`restore` needs to make the same receipts in another process."""
        return {"engine": self.engine, "engine_version": self.engine_version,
                "rank": self.rank, "world_size": self.world_size, "model": self.model,
                "static": self.static}

    @classmethod
    def restore(cls, state: dict[str, Any]) -> Provenance:
        made = cls.__new__(cls)
        made.engine, made.engine_version = state["engine"], state["engine_version"]
        made.rank, made.world_size = state["rank"], state["world_size"]
        made.model, made.static = state["model"], state["static"]
        return made

    def receipt(self, facts: Facts, labels: dict[str, dict[str, Any]]) -> Receipt:
        """The workload's receipt (built on the writer thread)."""
        return Receipt(
            source=f"capture:{self.engine}", engine=self.engine,
            engine_version=self.engine_version,
            created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(),
            model=self.model.get("model"), request_ids=facts.keys, step=facts.step,
            mode=facts.mode, layer=facts.layer[1] if facts.layer else None, rank=self.rank,
            world_size=self.world_size, enginetap_version=__version__,
            notes={**self.static, "model": self.model, "probe": facts.probe,
                   "target": facts.target,
                   "module": facts.layer[0] if facts.layer else None,
                   "variant": dict(zip(("mode", "tokens_bucket", "cached_prefix",
                                        "requests_bucket", "layer"), facts.variant)),
                   "requests": {k: labels.get(k, {}) for k in facts.keys},
                   "rows": facts.rows, "step_rows": facts.step_rows,
                   "adapter": facts.notes,
                   # Declared outputs this engine does not expose: not stored, so replay
                   # compares the others (all absent: an inputs-only workload).
                   "not_exposed": {name: "not exposed by this engine"
                                   for name in facts.not_exposed}})


@dataclass(frozen=True)
class Facts:
    """The per-workload part of a receipt, captured on the engine thread."""

    step: int
    mode: str
    keys: list[str]
    layer: tuple[str, str] | None
    probe: str
    target: str
    variant: tuple
    rows: int
    step_rows: int
    notes: list[str]
    not_exposed: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Facts:
        """The inverse of the JSON a dataclass becomes (tuples came back as lists)."""
        layer = data["layer"]
        return cls(**{**data, "layer": tuple(layer) if layer is not None else None,
                      "variant": tuple(data["variant"])})


class _Labels(Protocol):
    def refresh(self) -> None: ...

    def peek(self, key: str) -> dict[str, Any]: ...


@dataclass(frozen=True)
class PendingReceipt:
    """A workload's receipt, made when called (by whoever writes the workload): the
    thread writer calls it; the writer process sends ``facts``, the labels of its
    requests and the provenance's :meth:`~Provenance.state` to its child instead, where
    the same receipt is made."""

    provenance: Provenance
    facts: Facts
    labels: _Labels

    def __call__(self) -> Receipt:
        self.labels.refresh()  # the labels file looked at once, not once per request
        return self.provenance.receipt(self.facts, self.labels_now())

    def labels_now(self) -> dict[str, dict[str, Any]]:
        """The labels of the workload's requests as last read (no look at the file)."""
        return {k: self.labels.peek(k) for k in self.facts.keys}
