"""Continuity: state a request carries between steps must come back as it was left.

- A recurrent or convolution state's hash before step t equals its hash after the
  request's previous step (``Lk.gdn.state_before`` vs ``state_after``).
- The KV row written for position p (``Lk.attn.kv_written``) equals that cache column
  re-read at the request's next step (``kv_prev`` of the row at p + 1).
- Metadata: host and device computed-token counters agree; the tokens the scheduler
  planned for a request equal the tokens the forward's metadata gives it (query length),
  and the kernels' sequence length equals the computed tokens plus the planned ones.

Violations name the checkpoint (layer), the slot, the request and the position.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from enginetap.tap.analysis.files import RankTap, StepRecord

__all__ = ["Violation", "check_continuity", "check_metadata", "metadata_checked"]

_BEFORE = re.compile(r"^(.*)\.(state|conv)_before$")


@dataclass
class Violation:
    kind: str
    """``state``, ``conv``, ``kv``; metadata: ``counters``, ``query_len``, ``seq_len``."""
    step: int
    checkpoint: str
    key: str
    position: int
    slot: int | None
    detail: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _last_row_of(step: StepRecord) -> dict[str, int]:
    last: dict[str, int] = {}
    for i, row in enumerate(step.rows):
        last[row["key"]] = i
    return last


def _slot(groups: dict[str, str], row: dict[str, Any], layer: str, kind: str) -> Any:
    """The row's slot in ``layer``'s cache group (``kind``: ``kv`` or ``state``); the
    first group's where the engine has one group or names none."""
    per_group = row.get(f"{kind}_groups") or {}
    group = groups.get(layer)
    return per_group[group] if group in per_group else row.get(f"{kind}_slot")


def _check_states(step: StepRecord, after: dict[tuple[str, str], tuple[int, str]],
                  out: list[Violation], groups: dict[str, str]) -> None:
    index = {name: c for c, name in enumerate(step.checkpoints)}
    last = _last_row_of(step)
    for c, name in enumerate(step.checkpoints):
        match = _BEFORE.match(name)
        if match is None:
            continue
        for key, i in last.items():
            seen = after.get((f"{match.group(1)}.{match.group(2)}", key))
            if seen is not None and seen[1] != step.hashes[c][i]:
                row = step.rows[i]
                out.append(Violation(match.group(2), step.step, name, key, row["pos"],
                                     _slot(groups, row, match.group(1), "state"),
                                     f"differs from its hash after step {seen[0]}"))
    for name, c in index.items():
        if name.endswith(("state_after", "conv_after")):
            label = name.rsplit("_", 1)[0]
            for key, i in last.items():
                after[(label, key)] = (step.step, step.hashes[c][i])


def _check_kv(step: StepRecord, written: dict[tuple[str, str, int], tuple[int, str, Any]],
              out: list[Violation], groups: dict[str, str]) -> None:
    for c, name in enumerate(step.checkpoints):
        if name.endswith(".kv_prev"):
            layer = name[:-len(".kv_prev")]
            for i, row in enumerate(step.rows):
                seen = written.get((layer, row["key"], row["pos"] - 1))
                if seen is not None and seen[0] < step.step and seen[1] != step.hashes[c][i]:
                    out.append(Violation("kv", step.step, f"{layer}.kv_written", row["key"],
                                         row["pos"] - 1, seen[2],
                                         f"KV row written at step {seen[0]} changed by step "
                                         f"{step.step}"))
    for c, name in enumerate(step.checkpoints):
        if name.endswith(".kv_written"):
            layer = name[:-len(".kv_written")]
            for i, row in enumerate(step.rows):
                written[(layer, row["key"], row["pos"])] = (step.step, step.hashes[c][i],
                                                           _slot(groups, row, layer, "kv"))


def check_continuity(rank: RankTap) -> list[Violation]:
    """Every state and KV continuity violation of one rank, in step order."""
    out: list[Violation] = []
    after: dict[tuple[str, str], tuple[int, str]] = {}
    written: dict[tuple[str, str, int], tuple[int, str, Any]] = {}
    groups = rank.header.get("cache_groups") or {}
    for step in rank.steps:
        _check_states(step, after, out, groups)
        _check_kv(step, written, out, groups)
    return out


def _row_metadata(row: dict[str, Any]) -> list[tuple[str, str]]:
    """(kind, detail) of every metadata disagreement of one row."""
    found = []
    host, device = row.get("computed_host"), row.get("computed_device")
    if device is not None and device != host:
        found.append(("counters", f"host {host} vs device {device}"))
    planned, query, seq = row.get("planned"), row.get("query_len"), row.get("seq_len")
    if planned is not None and query is not None and planned != query:
        found.append(("query_len", f"planned {planned} token(s), the forward's metadata "
                                   f"gives {query}"))
    if planned is not None and seq is not None and host is not None and seq != host + planned:
        found.append(("seq_len", f"kernels' sequence length {seq}, expected {host} computed "
                                 f"+ {planned} planned = {host + planned}"))
    return found


def metadata_checked(rank: RankTap) -> dict[str, int]:
    """How many tapped rows carried each metadata check's inputs (a clean check over no
    rows says nothing)."""
    rows = [row for step in rank.steps for row in step.rows]
    return {"counters": sum(r.get("computed_device") is not None for r in rows),
            "lengths": sum(r.get("planned") is not None and r.get("query_len") is not None
                           for r in rows)}


def check_metadata(rank: RankTap) -> list[Violation]:
    """Rows whose counters or lengths disagree (one violation per request, step and kind)."""
    out = []
    for step in rank.steps:
        seen: set[tuple[str, str]] = set()
        for row in step.rows:
            for kind, detail in _row_metadata(row):
                if (row["key"], kind) not in seen:
                    seen.add((row["key"], kind))
                    out.append(Violation(kind, step.step, "rows", row["key"], row["pos"],
                                         row.get("kv_slot"), detail))
    return out
