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
    _keys: list[str] = field(default_factory=list)
    _next: list[int] = field(default_factory=list)
    _hashes: list[int | None] = field(default_factory=list)
    """The last step's keys (all distinct), each row's next position and prefix hash
    (what :attr:`seen` holds for each key); empty where its keys were not distinct."""

    def update(self, step: Step) -> list[int | None]:
        """Prefix hash of every row of ``step`` (None where earlier tokens were never seen,
        e.g. a prefix taken from a cache)."""
        rows = step.rows
        keys, positions, tokens = rows.keys, rows.positions, rows.token_ids
        if positions == self._next and keys == self._keys and None not in self._hashes:
            # a decode step of the last step's requests, in its order, each one further:
            # every row continues its key's hash (what the loop below would find in seen)
            out: list[int | None] = [(h * _BASE + tok + 1) % _PRIME  # type: ignore[operator]
                                     for h, tok in zip(self._hashes, tokens)]
            following = [pos + 1 for pos in positions]
            self.seen.update(zip(keys, zip(following, out)))  # type: ignore[arg-type]
            self._next, self._hashes = following, out
            return out
        out = []
        for key, pos, tok in zip(keys, positions, tokens):
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
        distinct = len(set(keys)) == len(keys)
        self._keys = list(keys) if distinct else []
        self._next = [pos + 1 for pos in positions] if distinct else []
        self._hashes = out if distinct else []
        return out


def fill_late_lengths(records: list[dict[str, Any]], step: Step) -> None:
    """Valid lengths an engine fills only when the step's forward is done (the built-in
    engine on a GPU: reading them earlier would stop the host for the device), copied
    into records picked before that."""
    rows = step.rows
    for name, column in (("query_len", rows.query_lens), ("seq_len", rows.seq_lens)):
        if column is not None:
            for record in records:
                if record[name] is None:
                    record[name] = column[record["row"]]


def row_records(step: Step, picked: list[int], prefixes: list[int | None]) -> list[dict[str, Any]]:
    """The metadata of each tapped row, as written to the tap file (per-group slots
    only where the engine has several cache groups of a kind). Runs every step for every
    tapped row: each column is read once (an absent one as all None), as a slice where
    the rows picked are consecutive (no request filter: every step)."""
    rows = step.rows
    lo, hi = (picked[0], picked[-1] + 1) if picked else (0, 0)
    if picked and picked == list(range(lo, hi)):

        def take(column: list[Any] | None) -> list[Any]:
            return [None] * (hi - lo) if column is None else column[lo:hi]
    else:
        def take(column: list[Any] | None) -> list[Any]:
            return [None] * len(picked) if column is None else [column[i] for i in picked]
    index = take(rows.token_index) if rows.token_index is not None else picked
    out = [{"row": i, "key": key, "request_id": request_id, "pos": pos, "tok": tok,
            "computed_host": host, "computed_device": device, "kv_slot": kv,
            "state_slot": state, "token_index": token_index, "planned": planned,
            "query_len": query, "seq_len": seq,
            "prefix": None if prefix is None else f"{prefix:016x}"}
           for i, key, request_id, pos, tok, host, device, kv, state, token_index, planned,
           query, seq, prefix in zip(
               picked, take(rows.keys), take(rows.request_ids), take(rows.positions),
               take(rows.token_ids), take(rows.computed_host), take(rows.computed_device),
               take(rows.kv_slots), take(rows.state_slots), index,
               take(rows.planned_tokens), take(rows.query_lens), take(rows.seq_lens),
               take(prefixes))]
    groups = {name: g for name, g in (("kv_groups", rows.kv_groups),
                                      ("state_groups", rows.state_groups)) if g and len(g) > 1}
    for name, per_group in groups.items():
        for record in out:
            i = record["row"]
            record[name] = {group: slots[i] for group, slots in per_group.items()}
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
