"""What the tap keeps from one decode step to the next (the prefix tracker's last step,
the rows' device lists) against a batch whose composition changes between steps: the
prefixes and row lists are those computed afresh, every step."""

from __future__ import annotations

import random
from typing import Any

import torch

from enginetap.core.context import Step, StepRows
from enginetap.tap.record.ledger import StepLedger
from enginetap.tap.record.rows import _BASE, _PRIME, PrefixTracker, row_records, select_rows


def _fresh(seen: dict[str, tuple[int, int]], keys: list[str], positions: list[int],
           tokens: list[int]) -> list[int | None]:
    """The prefix hashes of one step, row by row (the definition, no carried state)."""
    out: list[int | None] = []
    for key, pos, tok in zip(keys, positions, tokens):
        before = seen.get(key)
        if pos == 0:
            h = 0
        elif before is not None and before[0] == pos:
            h = before[1]
        else:
            out.append(None)
            seen.pop(key, None)
            continue
        h = (h * _BASE + tok + 1) % _PRIME
        seen[key] = (pos + 1, h)
        out.append(h)
    return out


def _step(n: int, rows: list[tuple[str, int, int]]) -> Step:
    keys = [k for k, _, _ in rows]
    return Step("transformers", n, "decode", StepRows(
        request_ids=[f"id-{k}" for k in keys], positions=[p for _, p, _ in rows],
        token_ids=[t for _, _, t in rows], query_start=list(range(len(rows))),
        computed_host=[p for _, p, _ in rows], request_keys=keys,
        token_index=[3 * i for i in range(len(rows))]))


def _script() -> list[list[tuple[str, int, int]]]:
    """A batch of decode steps changing composition between runs of steady decode: a
    request finishing, one joining (a mixed step), a reorder, a step skipped for one
    request, another request at the same place and position, two rows of one request
    in two steps, one joining mid-sequence (a prefix-cache hit: never seen from 0),
    requests restarting from 0."""
    rnd = random.Random(3)

    def decode(at: dict[str, int]) -> list[tuple[str, int, int]]:
        return [(k, p, rnd.randrange(1000)) for k, p in at.items()]

    steps = [[("a", i, rnd.randrange(1000)) for i in range(4)] +
             [("b", i, rnd.randrange(1000)) for i in range(3)]]
    at = {"a": 4, "b": 3}
    for change in range(12):
        for _ in range(3):  # steady decode: the carried path
            steps.append(decode(at))
            at = {k: p + 1 for k, p in at.items()}
        if change == 0:
            del at["a"]  # finished
        elif change == 1:  # joined: its prefill in a mixed step
            steps.append([("c", i, rnd.randrange(1000)) for i in range(2)] + decode(at))
            at = {k: p + 1 for k, p in at.items()} | {"c": 2}
        elif change == 2:
            at = dict(reversed(list(at.items())))  # the same requests, another order
        elif change == 3:
            at["b"] += 1  # one request skipped a step: unseen from here
        elif change in (4, 6, 10):  # restarts from its first token: hashed from here
            at[{4: "b", 6: "x", 10: "d"}[change]] = 0
        elif change == 5:  # another request where c was, at c's next position: unseen
            at = {("x" if k == "c" else k): p for k, p in at.items()}
        elif change == 7:  # two rows of b, twice, each one further
            for _ in range(2):
                steps.append(decode(at) + [("b", at["b"] + 1, rnd.randrange(1000))])
                at = {k: p + 1 for k, p in at.items()}
        elif change == 8:
            del at["b"]
        elif change == 9:
            at["d"] = 40  # joined from a cached prefix
        elif change == 11:
            at["e"] = 0
    return steps


def test_prefix_tracker_equals_the_definition_as_the_batch_changes() -> None:
    tracker, seen = PrefixTracker(), {}
    carried = unseen = 0
    for n, rows in enumerate(_script()):
        step = _step(n, rows)
        keys, positions = step.rows.keys, step.rows.positions
        expected = _fresh(seen, keys, positions, step.rows.token_ids)
        carried += positions == tracker._next and keys == tracker._keys
        assert tracker.update(step) == expected, (n, rows)
        assert tracker.seen == seen
        unseen += expected.count(None)
    assert carried >= 20  # the carried path ran (steady decode), not only the loop
    assert unseen >= 3  # and rows without a prefix (d joined mid-sequence) went through it


def test_row_lists_kept_only_while_they_are_the_same() -> None:
    cpu = torch.device("cpu")
    previous: StepLedger | None = None
    tracker = PrefixTracker()
    kept = 0
    for n, rows in enumerate(_script()):
        step = _step(n, rows)
        prefixes = tracker.update(step)
        for filters in ([None, None], ["a", None]) if n % 5 == 0 else ([None, None],):
            picked = select_rows(step, filters, 64)
            if not picked:
                continue
            ledger = StepLedger()
            records = row_records(step, picked, prefixes)
            assert records == _records(step, picked, prefixes)
            ledger.pick(records, previous)
            for what, values in (("rows", ledger.token_index),
                                 ("requests", ledger.request_token_index),
                                 ("inverse", ledger.request_of_row)):
                if previous is not None and (what, cpu) in previous.index \
                        and ledger.index.get((what, cpu)) is previous.index[(what, cpu)]:
                    kept += 1
                assert ledger.device_list(what, cpu).tolist() == values
            keys = [r["key"] for r in records]
            last = {k: i for i, k in enumerate(keys)}
            assert ledger.request_token_index == [ledger.token_index[i] for i in last.values()]
            assert ledger.request_of_row == [list(last).index(k) for k in keys]
            previous = ledger.carried()
    assert kept >= 20


def _records(step: Step, picked: list[int], prefixes: list[int | None]) -> list[dict[str, Any]]:
    rows = step.rows
    return [{"row": i, "key": rows.keys[i], "request_id": rows.request_ids[i],
             "pos": rows.positions[i], "tok": rows.token_ids[i],
             "computed_host": rows.computed_host[i], "computed_device": None, "kv_slot": None,
             "state_slot": None, "token_index": rows.token_index[i], "planned": None,
             "query_len": None, "seq_len": None,
             "prefix": None if prefixes[i] is None else f"{prefixes[i]:016x}"} for i in picked]
