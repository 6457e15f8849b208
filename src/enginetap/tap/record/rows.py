"""Which rows a step taps, what is recorded about each, and the token prefix they carry.

A row is tapped when its request key passes the filters; the last ``max_rows`` such rows
of the batch are kept (the decode rows of a mixed batch sit last). Per tapped row the
record holds the step context's metadata and a hash of the request's token ids up to and
including the row's own token, kept per request across steps: pairs are rows whose
prefixes match, verified on token ids, never assumed from positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from enginetap.core.context import Step

__all__ = ["FlatBatch", "PrefixTracker", "fill_late_lengths", "row_records", "select_rows"]

_PRIME = (1 << 61) - 1
_BASE = 1_000_003


def select_rows(step: Step, filters: list[str], max_rows: int) -> list[int]:
    """Row indices of ``step`` to tap: those whose key contains every filter, last first
    cut to ``max_rows`` (returned in batch order)."""
    keys = step.rows.keys
    wanted = [f for f in filters if f]
    if not wanted:  # the usual case, every step: no test per row
        return list(range(max(0, len(keys) - max_rows), len(keys)))
    picked = [i for i, key in enumerate(keys) if all(f in key for f in wanted)]
    return picked[-max_rows:]


@dataclass
class PrefixTracker:
    """Per request key: the next position expected and the hash of the tokens before it."""

    seen: dict[str, tuple[int, int]] = field(default_factory=dict)

    def update(self, step: Step) -> list[int | None]:
        """Prefix hash of every row of ``step`` (None where earlier tokens were never seen,
        e.g. a prefix taken from a cache)."""
        out: list[int | None] = []
        rows = step.rows
        for key, pos, tok in zip(rows.keys, rows.positions, rows.token_ids):
            before = self.seen.get(key)
            if pos == 0:
                h: int | None = 0
            elif before is not None and before[0] == pos:
                h = before[1]
            else:
                out.append(None)
                self.seen.pop(key, None)
                continue
            assert h is not None
            h = (h * _BASE + tok + 1) % _PRIME
            self.seen[key] = (pos + 1, h)
            out.append(h)
        return out


def _column(values: list[int] | None, i: int) -> int | None:
    return None if values is None else values[i]


def fill_late_lengths(records: list[dict[str, Any]], step: Step) -> None:
    """Valid lengths an engine fills only when the step's forward is done (the built-in
    engine on a GPU: reading them earlier would stop the host for the device), copied
    into records picked before that."""
    rows = step.rows
    for record in records:
        i = record["row"]
        if record["query_len"] is None:
            record["query_len"] = _column(rows.query_lens, i)
        if record["seq_len"] is None:
            record["seq_len"] = _column(rows.seq_lens, i)


def row_records(step: Step, picked: list[int], prefixes: list[int | None]) -> list[dict[str, Any]]:
    """The metadata of each tapped row, as written to the tap file (per-group slots
    only where the engine has several cache groups of a kind). Runs every step for every
    tapped row: each column is read once (an absent one as all None)."""
    rows = step.rows
    index = rows.token_index
    groups = {name: g for name, g in (("kv_groups", rows.kv_groups),
                                      ("state_groups", rows.state_groups)) if g and len(g) > 1}
    keys, ids, positions, tokens = rows.keys, rows.request_ids, rows.positions, rows.token_ids
    host, n = rows.computed_host, len(keys)
    device, kv, state, planned, query, seq = (
        [None] * n if c is None else c
        for c in (rows.computed_device, rows.kv_slots, rows.state_slots, rows.planned_tokens,
                  rows.query_lens, rows.seq_lens))
    out = []
    for i in picked:
        prefix = prefixes[i]
        record = {"row": i, "key": keys[i], "request_id": ids[i], "pos": positions[i],
                  "tok": tokens[i], "computed_host": host[i], "computed_device": device[i],
                  "kv_slot": kv[i], "state_slot": state[i],
                  "token_index": i if index is None else index[i], "planned": planned[i],
                  "query_len": query[i], "seq_len": seq[i],
                  "prefix": None if prefix is None else f"{prefix:016x}"}
        for name, per_group in groups.items():
            record[name] = {group: slots[i] for group, slots in per_group.items()}
        out.append(record)
    return out


class FlatBatch:
    """Per step: each tapped row's and each tapped request's index among the batch's
    requests, for engines that lay a batch out flat (a request's rows contiguous, requests
    in batch order: vLLM, SGLang). ``read`` recomputes only when the step changed."""

    def __init__(self) -> None:
        self._step: Any = None
        self.of_rows: list[int] = []
        self.of_requests: list[int] = []

    def read(self, recorder: Any) -> FlatBatch:
        """``recorder``: the tap recorder (its ``step`` and tapped ``rows``)."""
        if recorder.step is not self._step:
            self._step = recorder.step
            starts = recorder.step.rows.query_start
            order = {s: n for n, s in enumerate(sorted(set(starts)))}
            self.of_rows = [order[starts[r["row"]]] for r in recorder.rows]
            last = {r["key"]: n for n, r in enumerate(recorder.rows)}
            self.of_requests = [self.of_rows[n] for n in last.values()]
        return self
