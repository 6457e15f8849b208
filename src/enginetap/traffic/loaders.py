"""Loaders for public trace formats: Mooncake JSONL and AgentX agentic shapes.

**Mooncake** (kvcache-ai/Mooncake, FAST'25 traces): one JSON object a line with
``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids`` (prefix blocks of
512 tokens). Fields beyond these four are ignored.

**AgentX** (the agentic shapes of seed 000): one JSON document with ``dataset``,
``revision``, ``profiles`` (single requests: ``label``, ``input_tokens``,
``output_tokens``, ``hash_ids``, ``block_size``, ``session_id``, optional
``cache_predecessor`` with its own ``hash_ids``/``input_tokens`` and a ``locator``) and
``overlap_profiles`` (``label``, ``session_id``, ``requests`` submitted together). Block
ids are per session. Other keys of a record (descriptive metadata) are ignored.

Every bad record is reported with its line number and the field at fault. Only regular
files of at most :data:`MAX_TRACE_BYTES` are read (a FIFO or ``/dev/zero`` is refused, not
waited on or read forever); JSON is parsed with depth and integer-size bounds
(:func:`~enginetap.core.untrusted_json.loads_bounded`), and token counts are bounded by
:data:`~enginetap.traffic.profile.MAX_TOKENS`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from enginetap.core.untrusted_json import MAX_INT_DIGITS, BadJson, loads_bounded
from enginetap.errors import TrafficError, describe_validation
from enginetap.traffic.profile import (
    MAX_TOKENS, MAX_TRACE_BYTES, CachePredecessor, OverlapGroup, RequestProfile, TrafficProfile,
    blocks_needed, read_trace_file)

__all__ = ["MAX_TRACE_BYTES", "MOONCAKE_BLOCK", "MooncakeRecord", "MooncakeTrace", "load_agentx",
           "load_mooncake"]

MOONCAKE_BLOCK = 512
"""Tokens per hash block in the Mooncake traces."""


class MooncakeRecord(BaseModel):
    """One request of a Mooncake trace."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    timestamp: int = Field(ge=0)
    """Arrival time in milliseconds, relative to the trace's start."""
    input_length: int = Field(ge=1, le=MAX_TOKENS)
    """Prompt tokens."""
    output_length: int = Field(ge=1, le=MAX_TOKENS)
    """Generated tokens."""
    hash_ids: list[int] = Field(min_length=1)
    """Prefix-block hashes, 512 tokens a block; equal ids are reusable KV blocks."""

    @model_validator(mode="after")
    def _validate_blocks(self) -> MooncakeRecord:
        need = blocks_needed(self.input_length, MOONCAKE_BLOCK)
        if len(self.hash_ids) != need:
            raise ValueError(f"hash_ids has {len(self.hash_ids)} blocks but input_length="
                             f"{self.input_length} needs {need} blocks of {MOONCAKE_BLOCK}")
        return self


@dataclass(frozen=True)
class MooncakeTrace:
    """A loaded Mooncake trace: its records (line numbers from 1) and file identity."""

    path: Path
    sha256: str
    records: list[MooncakeRecord]
    lines: list[int]

    def locator(self, index: int) -> str:
        """``name:line`` of record ``index`` (provenance)."""
        return f"{self.path.name}:{self.lines[index]}"


def _bad_record(path: Path, line: int, why: str, fix: str) -> TrafficError:
    return TrafficError(f"bad record at {path}:{line}", why, fix)


def load_mooncake(path: str | Path) -> MooncakeTrace:
    """Read a Mooncake JSONL trace (blank lines skipped).

    Raises:
        TrafficError: the file is unreadable or empty, or a line is not a JSON object or
            misses/mistypes a field (the message names the line and the field).
    """
    path = Path(path)
    raw = read_trace_file(path, "Mooncake trace")
    records: list[MooncakeRecord] = []
    lines: list[int] = []
    for number, text in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not text.strip():
            continue
        records.append(_mooncake_record(path, number, text))
        lines.append(number)
    if not records:
        raise TrafficError(f"Mooncake trace {path} has no records", "the file is empty",
                           "pass a JSONL file with one request per line")
    return MooncakeTrace(path, hashlib.sha256(raw).hexdigest(), records, lines)


def _mooncake_record(path: Path, number: int, text: str) -> MooncakeRecord:
    fix = "each line must be {timestamp, input_length, output_length, hash_ids}"
    try:
        data = loads_bounded(text)
    except BadJson as exc:
        raise _bad_record(path, number, str(exc), fix) from None
    if not isinstance(data, dict):
        raise _bad_record(path, number, f"a JSON {type(data).__name__}, not an object", fix)
    try:
        return MooncakeRecord.model_validate(data)
    except ValidationError as exc:
        raise _bad_record(path, number, describe_validation(exc), fix) from None


class _AgentXPredecessor(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_tokens: int = Field(le=MAX_TOKENS)
    hash_ids: list[int]
    locator: str | None = None


class _AgentXRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    label: str | None = None
    input_tokens: int = Field(le=MAX_TOKENS)
    output_tokens: int = Field(le=MAX_TOKENS)
    hash_ids: list[int]
    block_size: int = Field(le=MAX_TOKENS)
    session_id: str | None = None
    cache_predecessor: _AgentXPredecessor | None = None


class _AgentXSingle(_AgentXRequest):
    label: str


class _AgentXOverlap(BaseModel):
    model_config = ConfigDict(extra="ignore")

    label: str
    session_id: str | None = None
    requests: list[_AgentXRequest] = Field(min_length=2)


class _AgentXFile(BaseModel):
    model_config = ConfigDict(extra="ignore")

    dataset: str
    revision: str
    profiles: list[Any] = Field(default_factory=list)
    overlap_profiles: list[Any] = Field(default_factory=list)


def _line_of(text: str, label: str | None) -> int | None:
    """Line of the first ``"label": "<label>"`` in the file (JSON gives no positions)."""
    if not label:
        return None
    needle = json.dumps(label)
    for number, line in enumerate(text.splitlines(), 1):
        if '"label"' in line and needle in line:
            return number
    return None


def _request(rec: _AgentXRequest, label: str, session: str | None) -> RequestProfile:
    pred = rec.cache_predecessor
    return RequestProfile(
        label=label, input_tokens=rec.input_tokens, output_tokens=rec.output_tokens,
        hash_ids=rec.hash_ids, block_size=rec.block_size, session=session,
        cache_predecessor=None if pred is None else CachePredecessor(
            input_tokens=pred.input_tokens, hash_ids=pred.hash_ids, locator=pred.locator))


def _convert(path: Path, text: str, where: str, entry: Any, build: Any) -> Any:
    label = entry.get("label") if isinstance(entry, dict) else None
    if not isinstance(entry, dict):
        raise TrafficError(f"bad AgentX record {where} at {path}",
                           f"a JSON {type(entry).__name__}, not an object",
                           "each profile is an object with label, input_tokens, "
                           "output_tokens, hash_ids and block_size")
    try:
        return build(entry)
    except ValidationError as exc:
        line = _line_of(text, label if isinstance(label, str) else None)
        at = f"{path}:{line}" if line else str(path)
        raise TrafficError(f"bad AgentX record {where} (label {label!r}) at {at}",
                           describe_validation(exc), "fix the named fields") from None


_LONG_INT = re.compile(rf"\d{{{MAX_INT_DIGITS + 1},}}")


def _parse_agentx(path: Path, text: str) -> Any:
    try:
        return loads_bounded(text)
    except BadJson as exc:
        if exc.line is not None:
            raise TrafficError(f"AgentX file {path} line {exc.line} column {exc.column} is "
                               "not valid JSON", exc.msg, "fix the JSON syntax there") from None
        long_int = _LONG_INT.search(text)
        at = f"{path}:{text.count(chr(10), 0, long_int.start()) + 1}" if long_int else str(path)
        raise TrafficError(f"bad record at {at}", str(exc), "AgentX shapes hold token "
                           "counts and block ids, a few levels deep") from None


def _single(entry: dict[str, Any]) -> RequestProfile:
    rec = _AgentXSingle.model_validate(entry)
    return _request(rec, rec.label, rec.session_id)


def _overlap(entry: dict[str, Any]) -> OverlapGroup:
    group = _AgentXOverlap.model_validate(entry)
    members = [_request(r, r.label or f"{group.label}_{i}", group.session_id or r.session_id)
               for i, r in enumerate(group.requests)]
    return OverlapGroup(label=group.label, members=members)


def load_agentx(path: str | Path, *, seed: int = 0) -> TrafficProfile:
    """Read an AgentX shapes file into a :class:`TrafficProfile` (unscaled).

    Raises:
        TrafficError: unreadable or non-JSON file (line and column), a missing top-level
            key, or a bad record (its list index, label, line and field).
    """
    path = Path(path)
    raw = read_trace_file(path, "AgentX file")
    text = raw.decode("utf-8", errors="replace")
    data = _parse_agentx(path, text)
    try:
        doc = _AgentXFile.model_validate(data)
    except ValidationError as exc:
        raise TrafficError(f"AgentX file {path} is invalid", describe_validation(exc),
                           "it needs dataset, revision, profiles and overlap_profiles") from None
    requests = [_convert(path, text, f"profiles[{i}]", e, _single)
                for i, e in enumerate(doc.profiles)]
    groups = [_convert(path, text, f"overlap_profiles[{i}]", e, _overlap)
              for i, e in enumerate(doc.overlap_profiles)]
    digest = hashlib.sha256(raw).hexdigest()
    try:
        return TrafficProfile(
            name=path.stem, source=f"agentx:{doc.dataset}@{doc.revision} sha256={digest}",
            seed=seed, requests=requests, overlap_groups=groups,
            notes=["AgentX shapes; prompts rebuilt from hash blocks per session over "
                   "enginetap's authored corpus (original text unavailable)."])
    except ValidationError as exc:
        raise TrafficError(f"AgentX file {path} is invalid", describe_validation(exc),
                           "give every profile and overlap profile its own label") from None
