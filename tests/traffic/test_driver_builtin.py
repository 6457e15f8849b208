"""The built-in engine driver end to end on the tiny llama: warm-up hits, batches, receipts."""

from __future__ import annotations

import pytest
import torch

from enginetap.core import context
from enginetap.engines.hf import HFEngine
from enginetap.errors import TrafficError
from enginetap.traffic import (
    ArrivalReplay, BuiltinDriver, Driver, OverlapGroup, RequestProfile, TrafficProfile,
    builtin_profile, run_profile)
from enginetap.traffic.prompts import input_sha256


@pytest.fixture(scope="module")
def driver() -> BuiltinDriver:
    # float32: greedy tokens do not flip with the batch shape (see tests/engines/hf).
    return BuiltinDriver(HFEngine.from_builtin("llama", dtype=torch.float32))


def _req(label: str, ids: list[int], n: int, out: int = 3, **kw) -> RequestProfile:
    return RequestProfile(label=label, input_tokens=n, output_tokens=out, hash_ids=ids,
                          block_size=8, **kw)


PROFILE = TrafficProfile(
    name="hand", source="test", seed=1,
    requests=[
        _req("warm", [0, 1, 2, 3], 30,
             cache_predecessor={"input_tokens": 28, "hash_ids": [0, 1, 2, 9]}),
        _req("cold", [0, 1, 2, 3], 30),
    ],
    overlap_groups=[OverlapGroup(label="g", members=[
        _req("a", [0, 4], 12), _req("b", [0, 5, 6], 20, out=5), _req("c", [7], 6, out=2)])],
    replays=[ArrivalReplay(label="arr", time_scale=1.0, members=[
        _req("x", [0, 8], 10, arrival_s=0.0), _req("y", [0, 10], 16, arrival_s=0.05)])])


class _Steps:
    """Prefill steps seen through the step context: request ids and first-row computed."""

    def __init__(self) -> None:
        self.prefills: list[dict[str, int]] = []

    def __call__(self, step: context.Step) -> None:
        if step.mode == "prefill":
            first: dict[str, int] = {}
            for rid, done in zip(step.rows.request_ids, step.rows.computed_host):
                first.setdefault(rid, done)
            self.prefills.append(first)


@pytest.fixture(scope="module")
def run(driver: BuiltinDriver):
    steps = _Steps()
    sent: list[tuple[str, list[str]]] = []
    context.subscribe(on_begin=steps)
    try:
        report = run_profile(PROFILE, driver, progress=True, on_send=lambda unit, batch:
                             sent.append((unit, [s.key for s in batch])))
    finally:
        context.unsubscribe(steps)
    assert sent == [("warm", ["warm.warm"]), ("warm", ["warm.0"]), ("cold", ["cold.0"]),
                    ("g", ["g.0", "g.1", "g.2"]), ("arr", ["arr.0"]), ("arr", ["arr.1"])]
    return report, steps


def test_the_driver_has_the_shared_interface(driver: BuiltinDriver) -> None:
    assert isinstance(driver, Driver) and driver.max_context == 2048


def test_the_predecessor_warms_a_real_prefix_cache_hit(run) -> None:
    report, steps = run
    keys = [r.key for r in report.receipts]
    assert keys[:3] == ["warm.warm", "warm.0", "cold.0"]
    # Steps in order: predecessor, warm request, cold request (after a reset).
    assert steps.prefills[0] == {"warm.warm": 0}
    assert steps.prefills[1] == {"warm.0": 24}  # three shared 8-token blocks reused
    assert steps.prefills[2] == {"cold.0": 0}  # the reset dropped the warm prompts
    receipts = {r.key: r for r in report.receipts}
    assert receipts["warm.0"].cached_tokens == 24 and receipts["cold.0"].cached_tokens == 0
    assert receipts["warm.warm"].role == "predecessor" and receipts["warm.warm"].max_tokens == 1


def test_the_overlap_group_runs_as_one_batch_and_the_replay_in_waves(run) -> None:
    report, steps = run
    assert steps.prefills[3] == {"g.0": 0, "g.1": 0, "g.2": 0}
    assert steps.prefills[4] == {"arr.0": 0} and steps.prefills[5] == {"arr.1": 8}
    assert len(steps.prefills) == 6
    arrivals = [r for r in report.receipts if r.role == "arrival"]
    assert [r.arrival_s for r in arrivals] == [0.0, 0.05]
    assert arrivals[1].sent_s - arrivals[0].sent_s >= 0.05


def test_receipts_describe_what_was_sent(run, driver: BuiltinDriver) -> None:
    report, _ = run
    builder = driver.prompts(PROFILE.seed)
    assert report.prompts == builder.provenance() and report.prompts["seed"] == 1
    members = [r for r in report.receipts if r.unit == "g"]
    for receipt, member in zip(members, PROFILE.overlap_groups[0].members):
        ids = builder.request(member)
        assert receipt.input_sha256 == input_sha256(ids)
        assert receipt.input_tokens == member.input_tokens == len(ids)
        assert len(receipt.output_ids) <= member.output_tokens
        assert receipt.finish_reason in {"length", "stop"}
        assert receipt.latency_s > 0 and receipt.driver == "builtin"


def test_runs_are_reproducible(run, driver: BuiltinDriver) -> None:
    report, _ = run
    again = run_profile(PROFILE, driver, progress=False)
    assert [r.output_ids for r in again.receipts] == [r.output_ids for r in report.receipts]
    assert [r.input_sha256 for r in again.receipts] == [r.input_sha256 for r in report.receipts]


def test_a_profile_too_long_for_the_model_is_refused_before_sending(driver) -> None:
    too_long = builtin_profile("mooncake-tiny", max_context=4096)
    sent_before = driver.engine.steps
    with pytest.raises(TrafficError, match="does not fit.*the model has 2048"):
        run_profile(too_long, driver, progress=False)
    assert driver.engine.steps == sent_before


def test_the_builtin_mooncake_profile_runs_on_the_tiny_llama(driver: BuiltinDriver) -> None:
    profile = builtin_profile("mooncake-tiny")
    report = run_profile(profile, driver, progress=False)
    receipts = {r.key: r for r in report.receipts}
    assert len(receipts) == 19  # 8 singles, one predecessor, 4 overlap members, 6 arrivals
    reused = next(r for r in profile.requests if r.label == "fully_reused")
    pred = reused.cache_predecessor
    assert receipts["fully_reused.warm"].source == pred.locator
    assert receipts["fully_reused.0"].source == reused.source
    # Every full predecessor block but its last is reused from the warmed prefix cache.
    assert receipts["fully_reused.0"].cached_tokens == (len(pred.hash_ids) - 1) * reused.block_size
    assert all(r.input_tokens + r.max_tokens <= 2048 for r in report.receipts)

