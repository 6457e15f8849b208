"""Check recorded vLLM steps against what the requests really were, from outside the engine.

A request's sequence is its prompt followed by its generated tokens; row ``(request,
position)`` must feed the sequence's token at that position. Every position the engine
computed must appear exactly once over all steps, from the first uncached position up
to (not including) the last generated token, which is never fed back.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


def read_steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Request:
    prompt: list[int]
    output: list[int]

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class Seen:
    """What the steps showed, for the tests' own assertions."""

    modes: set[str] = field(default_factory=set)
    first_position: dict[str, int] = field(default_factory=dict)
    positions: dict[str, list[int]] = field(default_factory=dict)
    steps: int = 0


def check_steps(steps: list[dict], requests: dict[str, Request],
                name_of: Callable[[str], str]) -> Seen:
    """Assert every row of every step; ``name_of`` maps an engine request id to ours."""
    assert [s["step"] for s in steps] == list(range(len(steps))), "steps not numbered 0..n-1"
    seen = Seen(steps=len(steps))
    state_of_block: dict[tuple[str, int], int] = {}
    for step in steps:
        blocks = _blocks(step["rows"]["request_ids"])
        for rid, (begin, end) in blocks.items():
            name = name_of(rid)
            assert name in requests, f"step {step['step']}: unknown request {rid}"
            _check_block(step, begin, end, requests[name])
            positions = step["rows"]["positions"][begin:end]
            key = step["rows"]["request_keys"][begin]
            # the engine's id without vLLM's random suffix (and, for the OpenAI server's
            # "cmpl-<id>-<choice>", the id the client chose)
            stable = rid.rsplit("-", 1)[0]
            if stable.startswith("cmpl-"):
                stable = stable[len("cmpl-"):].rsplit("-", 1)[0]
            assert key == stable, f"request key {key} of {rid}"
            sequence, last = requests[name].sequence, positions[-1]
            if last + 1 >= len(requests[name].prompt) and last + 1 < len(sequence):
                # the step ends after sampling: the token sampled is the next one fed
                assert step["sampled"].get(key) == sequence[last + 1], (step["step"], name)
            seen.positions.setdefault(name, []).extend(positions)
            seen.first_position.setdefault(name, positions[0])
            if step["rows"]["state_slots"] is not None:
                # A request's recurrent state lives in one slot per KV block it is in.
                key = (name, positions[0] // step["kv_block_size"])
                slot = step["rows"]["state_slots"][begin]
                assert state_of_block.setdefault(key, slot) == slot, f"{name}: state slot moved"
        _check_step_slots(step, blocks)
        seen.modes.add(step["mode"])
        assert step["mode"] == _expected_mode(step, blocks, requests, name_of), step["step"]
    for name, positions in seen.positions.items():
        start, stop = seen.first_position[name], len(requests[name].sequence) - 1
        assert sorted(positions) == list(range(start, stop)), f"{name}: positions {positions}"
    return seen


def _blocks(request_ids: list[str]) -> dict[str, tuple[int, int]]:
    """Each request's rows form one contiguous block of the flattened batch."""
    blocks: dict[str, tuple[int, int]] = {}
    for i, rid in enumerate(request_ids):
        if rid in blocks:
            assert blocks[rid][1] == i, f"rows of {rid} are not contiguous"
            blocks[rid] = (blocks[rid][0], i + 1)
        else:
            blocks[rid] = (i, i + 1)
    return blocks


def _check_block(step: dict, begin: int, end: int, request: Request) -> None:
    rows = step["rows"]
    positions = rows["positions"][begin:end]
    first = positions[0]
    assert positions == list(range(first, first + end - begin)), "positions not consecutive"
    assert rows["token_ids"][begin:end] == request.sequence[first:first + end - begin]
    assert set(rows["query_start"][begin:end]) == {begin}
    assert set(rows["computed_host"][begin:end]) == {first}
    assert set(rows["computed_device"][begin:end]) == {first}


def _check_step_slots(step: dict, blocks: dict[str, tuple[int, int]]) -> None:
    rows, size = step["rows"], step["kv_block_size"]
    slots = rows["kv_slots"]
    assert rows["token_index"] == list(range(len(slots)))
    assert step["padded_tokens"] >= len(slots)
    assert rows["kv_groups"] and rows["kv_groups"][min(rows["kv_groups"])] == slots
    assert len(set(slots)) == len(slots), f"step {step['step']}: a KV slot written twice"
    assert all(s % size == p % size for s, p in zip(slots, rows["positions"])), "slot offsets"
    if rows["state_slots"] is not None:
        per_request = [set(rows["state_slots"][b:e]) for b, e in blocks.values()]
        assert all(len(s) == 1 for s in per_request), "a request with two state slots"
        flat = [next(iter(s)) for s in per_request]
        assert len(set(flat)) == len(flat) and min(flat) >= 0, f"state slots {flat}"


def _expected_mode(step: dict, blocks: dict[str, tuple[int, int]],
                   requests: dict[str, Request], name_of: Callable[[str], str]) -> str:
    positions = step["rows"]["positions"]
    prefill = [positions[b] < len(requests[name_of(rid)].prompt) for rid, (b, _) in blocks.items()]
    if all(prefill):
        return "prefill"
    return "mixed" if any(prefill) else "decode"
