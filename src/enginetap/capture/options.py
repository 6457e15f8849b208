"""``options.capture`` of the arming config: what to capture, how to select, how to write.

Saved with the dataset (``enginetap/capture-config.json``), so a dataset says how it was
made. Selection policies are named and configured by data (:class:`SelectionPolicy`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["CaptureOptions", "DecodePick", "SelectionPolicy", "POLICIES"]

DecodePick = int | Literal["middle", "last"]


class SelectionPolicy(BaseModel):
    """Which steps and calls become workloads."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = "default"
    prefill: bool = True
    """Capture prefill (and mixed) steps."""
    decode_steps: list[DecodePick] = Field(default_factory=lambda: [0, 1, 3, "middle", "last"])
    """Per request, which of its decode steps are selected (0 = the first decode step;
    ``middle`` and ``last`` need the request's output length, from the request labels)."""
    per_variant: int = Field(default=1, ge=1)
    """Workloads kept per definition × variant (mode, token bucket, cached prefix, batch)."""
    per_definition: int = Field(default=24, ge=1)
    """Cap on workloads per definition."""
    per_layer: bool = False
    """Count the layer into the variant (one workload per layer, not per model)."""

    @field_validator("decode_steps")
    @classmethod
    def _non_negative(cls, value: list[DecodePick]) -> list[DecodePick]:
        bad = [v for v in value if isinstance(v, int) and v < 0]
        if bad:
            raise ValueError(f"decode steps count from 0; got {bad}")
        return value


POLICIES: dict[str, SelectionPolicy] = {
    "default": SelectionPolicy(),
    "prefill-only": SelectionPolicy(name="prefill-only", decode_steps=[]),
    "decode-only": SelectionPolicy(name="decode-only", prefill=False),
    "every-step": SelectionPolicy(name="every-step", decode_steps=list(range(64)) + ["last"],
                                  per_variant=4, per_definition=64),
    "per-layer": SelectionPolicy(name="per-layer", per_layer=True, per_definition=256),
}
"""Named policies (``--policy NAME``); a config may also give a policy object."""


class CaptureOptions(BaseModel):
    """The ``capture`` entry of ``ArmConfig.options``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    dataset: Path | None = None
    """Dataset root to write (None: ``<out_dir>/dataset``)."""
    definitions: list[str] = Field(default_factory=list)
    """Capture only these definition families or names (empty: every probe's)."""
    policy: str | SelectionPolicy = "default"
    """A policy name (:data:`POLICIES`) or a policy object."""
    budget_bytes: int = Field(default=256 << 20, ge=1 << 16)
    """Bytes of captured tensors held in memory before the writer catches up."""
    when_full: Literal["wait", "drop"] = "wait"
    """When the budget is full: the engine waits for the writer, or the workload is
    dropped (counted in the summary)."""
    labels_file: Path | None = None
    """JSON written by the traffic driver: request key → label, profile, output length
    (None: ``<out_dir>/capture-labels.json``). Re-read when it changes."""
    batch: int = Field(default=16, ge=1)
    """Workloads the writer commits at once."""
    writer: Literal["thread", "process"] = "thread"
    """Where the dataset work runs: a thread of the engine's process, or a child process
    that maps a shared ring the engine copies into (its Python then never holds the
    engine's GIL; see :mod:`enginetap.capture.writers.process`). On the H200 the two measure
    alike; on a 2-core CPU the child takes a core from the engine (docs/capture.md)."""
    switch_interval_s: float = Field(default=0.0005, ge=0.0, le=0.1)
    """While the writer has work, the interpreter's thread switch interval
    (``sys.setswitchinterval``) is at most this (0: left alone). The writer's checks and
    file work are Python, holding the GIL; whenever the engine thread releases it (every
    torch call does) it then waits up to this long to get it back, instead of Python's
    default 5 ms. Restored when the writer is idle."""

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str | SelectionPolicy) -> str | SelectionPolicy:
        if isinstance(value, str) and value not in POLICIES:
            raise ValueError(f"unknown policy {value!r}; named policies: {', '.join(POLICIES)}")
        return value

    def selection(self) -> SelectionPolicy:
        return POLICIES[self.policy] if isinstance(self.policy, str) else self.policy
