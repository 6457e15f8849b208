"""Sequence-parallel prefill inside real vLLM CPU at TP=2 on the built-in llama.

Four engine runs (one vLLM child each, ``VLLM_CPU_OMP_THREADS_BIND=nobind``: two CPU
workers on one NUMA node), every run the same workload (see ``sp_prefill_run.py``):

- ``drift``: a test guard patch swaps ``LlamaDecoderLayer.forward`` for a copy of its own
  source with one comment edited, so the lock refuses sp_prefill and vLLM serves its stock
  path; this run is also the stock reference the others are compared with (the copy runs
  the same statements as vLLM's function);
- ``exact``: bit-exact mode, with a test guard patch that makes rank 1's sharded path
  differ on chunks of 96 rows only;
- ``comm`` and ``shard``.

Tolerances: none. ``exact`` must match bit for bit; ``comm``/``shard`` greedy tokens must
match (their logprob differences are printed, not bounded: at TP=2 a reduce-scatter adds
the same two partial sums an all-reduce adds, so on these kernels they come out equal).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from enginetap.config import ARMING_VARS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HERE = Path(__file__).parent
RUN = HERE / "sp_prefill_run.py"
MIN_ROWS = 32
INJECT_ROWS = 96


@dataclass(frozen=True)
class Run:
    out: Path
    requests: dict[str, dict]
    log: str

    def records(self, rank: int) -> list[dict]:
        path = self.out / f"sp_prefill-rank{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    def prefills(self, rank: int) -> list[tuple[int, str, str]]:
        return [(r["rows"], r["path"], r["reason"]) for r in self.records(rank)
                if r["step_mode"] != "decode"]


def _run(model: Path, out: Path, options: dict, guard_patches: list[str],
         tap: bool = False) -> Run:
    out.mkdir(parents=True, exist_ok=True)
    capabilities = ["guard", "sp_prefill", *(["tap"] if tap else [])]
    config = {"enabled": True, "capabilities": capabilities, "out_dir": str(out),
              "options": {"guard": {"patches": guard_patches},
                          "sp_prefill": {"min_rows": MIN_ROWS, **options}}}
    (out / "arming.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items()
           if k not in ARMING_VARS and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    src = str(Path(__file__).parents[2] / "src")
    env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", ENGINETAP_CONFIG=str(out / "arming.json"),
               PYTHONPATH=os.pathsep.join([src, str(HERE), env.get("PYTHONPATH", "")]),
               SP_INJECT_ROWS=str(INJECT_ROWS), SP_DRIFT_DIR=str(out / "drifted"))
    log_path = out / "run.log"
    with log_path.open("wb") as sink:
        done = subprocess.run([sys.executable, str(RUN), str(model), str(out / "report.json")],
                              env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=500,
                              check=False)
    log = log_path.read_text(errors="replace")
    assert done.returncode == 0, f"vLLM run exited {done.returncode}:\n{log[-4000:]}"
    return Run(out, json.loads((out / "report.json").read_text())["requests"], log)


@pytest.fixture(scope="module")
def model() -> Path:
    from enginetap.models import build_model

    return build_model("llama")


@pytest.fixture(scope="module")
def stock(vllm_lock, model, tmp_path_factory) -> Run:
    return _run(model, tmp_path_factory.mktemp("drift"), {"mode": "exact"},
                ["sp_prefill_injections:drift_llama_layer"], tap=True)


@pytest.fixture(scope="module")
def exact(vllm_lock, model, tmp_path_factory) -> Run:
    return _run(model, tmp_path_factory.mktemp("exact"), {"mode": "exact"},
                ["sp_prefill_injections:fail_rank1"], tap=True)


@pytest.fixture(scope="module", params=["comm", "shard"])
def inexact(request, vllm_lock, model, tmp_path_factory) -> Run:
    mode = request.param
    return _run(model, tmp_path_factory.mktemp(mode), {"mode": mode}, [])


def test_a_drifted_source_is_refused_and_vllm_serves_stock(stock):
    for rank in (0, 1):
        refused = json.loads((stock.out / f"sp_prefill-refused-rank{rank}.json").read_text())
        changed = [p for p in refused["problems"] if "LlamaDecoderLayer.forward: changed" in p]
        assert changed, refused
    assert not list(stock.out.glob("sp_prefill-rank*.jsonl"))
    assert "sp_prefill (refused" in stock.log
    assert sorted(stock.requests) == list("abcdefg")
    assert all(len(r["tokens"]) == 4 for r in stock.requests.values())


def test_exact_mode_is_bit_identical_to_stock(stock, exact):
    assert exact.requests == stock.requests  # tokens and logprobs, compared as floats


def test_paths_taken_are_counted_the_same_on_both_ranks(exact):
    expected = [(64, "proof", ""), (INJECT_ROWS, "proof", ""), (20, "stock", "below_min_rows"),
                (33, "stock", "not_divisible"), (64, "sp", ""), (INJECT_ROWS, "fallback", "")]
    assert exact.prefills(0) == exact.prefills(1) == expected
    for rank in (0, 1):
        records = exact.records(rank)
        decodes = [r for r in records if r["step_mode"] == "decode"]
        assert decodes and {(r["path"], r["reason"]) for r in decodes} == {("stock", "decode")}
        (served,) = [r for r in records if r["path"] == "sp"]
        # Exact mode: all-reduce and keep this rank's rows; norms ran on half the rows.
        assert served["row_local_rows"] == 32
        assert set(served["bytes"]) == {"all_reduce", "all_gather"}


def test_a_rank_whose_self_check_fails_makes_both_fall_back(exact):
    decisions = {}
    for rank in (0, 1):
        lines = (exact.out / f"guard-rank{rank}.jsonl").read_text().splitlines()
        for event in map(json.loads, lines):
            if event["event"] == "decision":
                rows = int(event["key"].split("[")[1].split("]")[0])
                decisions[rank, rows] = (event["chosen"], event["local_exact"])
    assert decisions[0, 64] == decisions[1, 64] == ("patched", True)
    assert decisions[0, INJECT_ROWS] == ("stock", True)  # exact here, refused by rank 1
    assert decisions[1, INJECT_ROWS] == ("stock", False)
    assert list((exact.out / "sp_prefill-dumps").glob("*-rank1.safetensors"))


def test_tap_fingerprints_every_row_of_the_sharded_chunks(stock, exact):
    # Both runs are armed with tap. On a chunk served sharded, the per-rank shards
    # between sublayers are joined for tap, so its checkpoints are the stock run's, bit
    # for bit (exact mode), on both ranks.
    from enginetap.tap.analysis.files import load_run

    (served,) = [r["step"] for r in exact.records(0) if r["path"] == "sp"]
    for rank in (0, 1):
        ours = {s.step: s for s in load_run(exact.out).rank(rank).steps}[served]
        theirs = {s.step: s for s in load_run(stock.out).rank(rank).steps}[served]
        assert {"L1.in", "L0.attn.out", "L0.mlp.out", "L0.out"} <= set(ours.checkpoints)
        assert ours.checkpoints == theirs.checkpoints
        assert _row_keys(ours) == _row_keys(theirs) and len(ours.rows) == 64
        assert ours.hashes == theirs.hashes


def _row_keys(step) -> list[tuple]:
    # vLLM appends a random suffix to request ids; the request key drops it.
    return [(r["key"], r["pos"], r["tok"]) for r in step.rows]


def test_comm_and_shard_keep_greedy_tokens(stock, inexact):
    mode = inexact.out.name.rstrip("0123456789")
    tokens = {k: r["tokens"] for k, r in inexact.requests.items()}
    assert tokens == {k: r["tokens"] for k, r in stock.requests.items()}
    worst = max(abs(a - b) for k in tokens for a, b in
                zip(inexact.requests[k]["logprobs"], stock.requests[k]["logprobs"]))
    print(f"sp_prefill {mode}: largest logprob difference from stock {worst:.3g}")
    served = [r for r in inexact.records(0) if r["path"] == "sp"]
    assert [r["rows"] for r in served] == [64, INJECT_ROWS]
    kinds = {"reduce_scatter", "all_gather"}
    assert all(set(r["bytes"]) == kinds for r in served)
    # Transport only in comm mode; shard runs the norms on this rank's half.
    assert {r["row_local_rows"] for r in served} == (
        {64, INJECT_ROWS} if mode == "comm" else {32, INJECT_ROWS // 2})


@pytest.fixture(scope="module")
def deepseek(vllm_lock, tmp_path_factory) -> Run:
    from enginetap.models import build_model

    return _run(build_model("deepseek_v3"), tmp_path_factory.mktemp("deepseek"),
                {"mode": "shard", "compare": True}, [])


def test_deepseek_v3_sharded_forward_is_proven_bit_exact(deepseek):
    # shard mode, tolerance 0: a shape is served sharded only if its proof found the whole
    # forward (MLA attention, dense MLP in layer 0, MoE in layer 1) bit-identical to stock
    # on both ranks.
    expected = [(64, "proof", ""), (INJECT_ROWS, "proof", ""), (20, "stock", "below_min_rows"),
                (33, "stock", "not_divisible"), (64, "sp", ""), (INJECT_ROWS, "sp", "")]
    assert deepseek.prefills(0) == deepseek.prefills(1) == expected
    row_bytes = 128 * 2  # hidden 128, bf16
    for rank in (0, 1):
        for r in (r for r in deepseek.records(rank) if r["path"] == "sp"):
            # 2 layers x (attention o_proj + MLP/MoE) reduce-scattered; their 4 inputs and
            # the exit's output and residual all-gathered.
            assert r["bytes"] == {"reduce_scatter": 4 * r["rows"] * row_bytes,
                                  "all_gather": 6 * r["rows"] * row_bytes}
            assert r["row_local_rows"] == r["rows"] // 2
        # compare: every reduction site checked against the stock all-reduce, no difference.
        assert all(r["mismatches"] == [] for r in deepseek.records(rank))
    assert len(deepseek.requests) == 7
