"""The tap file's schema: what the recorder writes and the analysis reads, one line each.

A tap file (``tap-rank<r>.jsonl``) is one :class:`TapHeader` line, then one :class:`TapStep`
line per recorded step. The writer builds its records with :func:`header_record` and
:func:`step_record` (fields in the order of these models, so the bytes on disk are what
they were before the schema existed); the reader validates every line through the models.
Neither side imports the other: this module needs pydantic only (no torch).

Fields the writer always writes but a reader does not need are optional, so hand-made
files of the minimal shape (kind, format and version; a step's rows, checkpoints and
hashes) stay readable. Unknown fields are kept (a newer writer's additions are ignored by
the analysis, not refused).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["FORMAT", "HASH_DIGITS", "MAX_WORLD", "RUN_FILE", "SamplerRow", "TapHeader",
           "TapRow", "TapStep", "VERSION", "header_record", "step_record"]

FORMAT = "enginetap-tap"
VERSION = 2
"""2: each checkpoint's hashes are one hex string, 16 digits per tapped row (1 wrote a
list of strings: 64 Python string builds per checkpoint cost more than the tap itself)."""

RUN_FILE = "tap-run.json"
"""What ``enginetap tap run`` was asked (engine, model, prompts, sizes), beside the tap
files: ``enginetap tap report`` builds its next commands from it."""

HASH_DIGITS = 16
"""Hex digits of one row's hash (64 bits)."""

MAX_WORLD = 1 << 16
"""The largest world size a header may declare (every rank writes its own file)."""

_RECORD = ConfigDict(strict=True, extra="allow", use_attribute_docstrings=True)


class TapHeader(BaseModel):
    """The first line of a tap file: what recorded it, and how."""

    model_config = _RECORD

    step: int | None = None
    """Stamped by the per-rank writer: -1 (before the first step)."""
    rank: int | None = None
    """Stamped by the per-rank writer."""
    kind: Literal["header"]
    format: Literal["enginetap-tap"]
    version: Literal[2]
    engine: str | None = None
    """The engine's own name (``transformers``, ``vllm``, ``sglang``)."""
    engine_version: str | None = None
    world_size: int | None = Field(None, ge=1, le=MAX_WORLD)
    """Ranks of the run: each writes its own file, a reader needs them all."""
    tp_size: int | None = None
    kv_block_size: int | None = None
    models: list[dict[str, Any]] = Field(default_factory=list)
    """The models the tap saw loaded (one object each)."""
    cache_groups: dict[str, Any] | None = None
    """Layer name to KV cache group, where the engine has several."""
    options: dict[str, Any] | None = None
    """The tap options the run was armed with (``options.tap``; ``run``: what the job
    that recorded it was asked)."""
    compiled: bool | str | None = None
    """False when eager; else how the model was compiled (``torch.compile``, vLLM's mode)."""
    cuda_graphs: bool | None = None
    eager: bool | None = None
    torch: str | None = None
    host: str | None = None
    not_placed: list[str] | None = None
    """Compiled runs: checkpoints that could not be placed in the graph."""


class TapRow(BaseModel):
    """One tapped token row of a step."""

    model_config = _RECORD

    row: int | None = None
    """Its index in the step's flat batch."""
    key: str
    """The request's key (``tap run``: ``p<index>``)."""
    request_id: str | None = None
    pos: int
    """The token's position in its request."""
    tok: int | None = None
    computed_host: int | None = None
    computed_device: int | None = None
    kv_slot: int | None = None
    state_slot: int | None = None
    token_index: int | None = None
    planned: int | None = None
    query_len: int | None = None
    seq_len: int | None = None
    prefix: str | None = None
    """Hash of the request's tokens up to and including this one (16 hex digits): rows of
    two requests with the same prefix computed the same function of the same tokens."""
    kv_groups: dict[str, int] | None = None
    """Per KV cache group: the row's slot (only where there are several groups)."""
    state_groups: dict[str, int] | None = None


class SamplerRow(BaseModel):
    """The logits of one tapped row: top two values and their tokens."""

    model_config = _RECORD

    argmax: int
    runner_up: int | None = None
    top1: float | None = None
    top2: float | None = None
    gap: float
    """``top1 - top2``: how close greedy sampling came to another token."""


class TapStep(BaseModel):
    """One line per recorded step: every checkpoint's hash of every tapped row."""

    model_config = _RECORD

    step: int
    rank: int | None = None
    kind: Literal["step"] = "step"
    mode: str
    """``prefill``, ``decode`` or ``mixed``, as the engine's step context says."""
    engine: str | None = None
    rows: list[TapRow]
    checkpoints: list[str]
    """Names in the order of ``hashes``."""
    sampled: dict[str, int] | None = None
    """Request id to the token sampled this step."""
    dropped: list[Any] | None = None
    """Checkpoints left out of this step: deferred tensors modified in place before step
    end (only written when there are some)."""
    hashes: list[str]
    """Per checkpoint: :data:`HASH_DIGITS` hex digits per row, rows in order."""
    sampler: list[SamplerRow] | None = None

    @model_validator(mode="after")
    def _validate_hashes(self) -> TapStep:
        width = HASH_DIGITS * len(self.rows)
        if len(self.hashes) != len(self.checkpoints) or any(len(h) != width
                                                            for h in self.hashes):
            raise ValueError(f"hashes do not match checkpoints x rows ({len(self.checkpoints)} "
                             f"checkpoints, {len(self.rows)} rows)")
        return self


_WRITTEN = {model: [n for n in model.model_fields if n not in ("step", "rank")]
            for model in (TapHeader, TapStep)}
"""The fields the tap's writer hands over, in order (the per-rank writer stamps step and
rank in front)."""
_KNOWN = {model: frozenset(order) for model, order in _WRITTEN.items()}


def header_record(**fields: Any) -> dict[str, Any]:
    """The header line as the writer hands it to the per-rank writer: ``fields`` (those of
    :class:`TapHeader` after ``version``) in the schema's order, after kind, format and
    version. Builds the dict only (no validation: the writer runs in the engine's process).

    Raises:
        TypeError: a field the schema does not have.
    """
    return _ordered(TapHeader, {"kind": "header", "format": FORMAT, "version": VERSION,
                                **fields})


def step_record(**fields: Any) -> dict[str, Any]:
    """A step line as the writer hands it over (called every step: a dict in the schema's
    order, nothing checked); ``dropped`` is left out when there are none.

    Raises:
        TypeError: a field the schema does not have.
    """
    if not fields.get("dropped", True):
        del fields["dropped"]
    return _ordered(TapStep, {"kind": "step", **fields})


def _ordered(model: type[BaseModel], fields: dict[str, Any]) -> dict[str, Any]:
    unknown = fields.keys() - _KNOWN[model]
    if unknown:
        raise TypeError(f"{model.__name__} has no field(s) {', '.join(sorted(unknown))}")
    return {name: fields[name] for name in _WRITTEN[model] if name in fields}
