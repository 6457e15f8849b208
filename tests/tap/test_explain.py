"""``enginetap tap explain`` on the built-in engine: each planted cause gets its verdict,
the op is named, and REPRO replays showing the same difference.

The plants are test code, installed before the engine arms (so the tap, the re-run and the
calls made again all go through them), like the injections of ``test_faults.py``:

- a norm whose output depends on its batch row (``+ 0.01 * b``): batch-variant;
- an attention kernel that adds fresh noise on every call: nondeterministic;
- a gated-delta layer that, at one step, reads another request's recurrent-state slot:
  upstream, with the slot named.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from enginetap.cli.main import main
from enginetap.core.capability import current_arming
from enginetap.core.context import current_step
from enginetap.core.patching import PatchSet
from enginetap.dataset import Dataset
from enginetap.replay.runner import replay_dataset
from enginetap.tap.diff import diff_runs
from enginetap.tap.files import load_run
from enginetap.tap.run import record_run

SAME = ["the cache holds every key", "the cache holds every key", "kernels and caches"]
NORM = "transformers.models.llama.modeling_llama:LlamaRMSNorm.forward"
SDPA = "torch.nn.functional:scaled_dot_product_attention"
MLP = "transformers.models.llama.modeling_llama:LlamaMLP.forward"
GDN = "transformers.models.qwen3_next.modeling_qwen3_next:Qwen3NextGatedDeltaNet.forward"


def by_batch_row(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    if out.dim() == 3 and out.shape[0] > 1:
        out = out + 0.01 * torch.arange(out.shape[0], dtype=out.dtype)[:, None, None]
    return out


def noisy(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    return out + 1e-3 * torch.randn_like(out)


@pytest.fixture
def plant() -> Iterator[Any]:
    planted: list[PatchSet] = []

    def install(target: str, wrapper: Any) -> None:
        patches = PatchSet("test-plant")
        patches.add(target, wrapper)
        patches.install()
        planted.append(patches)

    yield install
    for patches in planted:
        patches.uninstall()


def explain(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what recording printed is not the command's
    argv = sys.argv
    sys.argv = ["enginetap", "tap", "explain", *args]
    try:
        with pytest.raises(SystemExit) as done:
            main()
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


def configs(repro: Path) -> dict[str, list[Any]]:
    """REPRO's workload lines by the configuration their receipt names."""
    dataset = Dataset(repro)
    found: dict[str, list[Any]] = {}
    for name in dataset.definitions():
        for line in dataset.workloads(name):
            notes = line.enginetap.receipt.notes  # type: ignore[union-attr]
            found.setdefault(notes["config"], []).append(line)
    return found


def engine_status(repro: Path) -> dict[str, str]:
    """uuid → the replay's verdict on the engine's stored outputs vs the reference."""
    report = replay_dataset(repro, repeats=1, warmup=0)
    return {w.uuid: w.status for d in report.definitions for w in d.workloads}


def test_a_batch_position_dependent_norm_is_batch_variant(tmp_path: Path, plant: Any,
                                                          capsys: Any) -> None:
    plant(NORM, by_batch_row)
    record_run("builtin:llama", SAME, tmp_path / "run", batch_size=3, max_new_tokens=3)
    code, out, err = explain(capsys, str(tmp_path / "run"), "--out", str(tmp_path / "repro"),
                             "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["kind"] == "batch-variant", result
    assert "LlamaRMSNorm.forward" in result["verdict"] and "L0.in_norm" in result["verdict"]
    assert "positions 1, 2 of a batch of 3 copies" in result["verdict"]
    assert "rmsnorm" in result["op"] and result["finding"].startswith("pair p0/p1 at step 0")
    assert "the re-run split again at step 0 L0.in_norm.out" in result["evidence"]
    # catching the op's calls changed nothing: the re-run's tap equals the run's, row by row
    (same,) = diff_runs(load_run(tmp_path / "run"), load_run(tmp_path / "repro/enginetap/rerun-a"))
    assert same.rows_compared > 0 and not same.diverged
    lines, status = configs(tmp_path / "repro"), engine_status(tmp_path / "repro")
    # alone, the engine's norm is the reference's; at batch rows 1 and 2 it is not
    assert {status[line.workload.uuid] for line in lines["alone"]} == {"PASS"}
    assert {status[line.workload.uuid] for line in lines["copies"]} == {"FAIL"}
    assert {status[line.workload.uuid] for line in lines["recorded"]} == {"FAIL"}


def test_a_diff_of_batch_1_and_batch_3_names_the_batch_variant_norm(
        tmp_path: Path, plant: Any, capsys: Any) -> None:
    plant(NORM, by_batch_row)
    for batch in (1, 3):
        record_run("builtin:llama", SAME, tmp_path / f"b{batch}", batch_size=batch,
                   max_new_tokens=2)
    code, out, err = explain(capsys, str(tmp_path / "b1"), "--diff", str(tmp_path / "b3"),
                             "--request", "p2", "--out", str(tmp_path / "repro"), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["kind"] == "batch-variant", result
    assert "p2 in b3's inputs alone (batch 1) vs at positions 1, 2 of a batch of 3" \
        in result["verdict"]
    assert "p2 in b1: batch row 0 of 1 at step 4, 7 row(s) shared" in result["evidence"]
    assert "p2 in b3: batch row 2 of 3 at step 0, 7 row(s) shared" in result["evidence"]
    # both runs' calls are in REPRO: the batch-1 one is the reference's, the other is not
    status = engine_status(tmp_path / "repro")
    recorded = {line.enginetap.receipt.step: status[line.workload.uuid]
                for line in configs(tmp_path / "repro")["recorded"]}
    assert recorded == {4: "PASS", 0: "FAIL"}


def decode_by_batch_row(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    if out.shape[2] == 1 and out.shape[0] > 1:  # decode steps only: [B, heads, 1, dim]
        out = out + 0.01 * torch.arange(out.shape[0], dtype=out.dtype)[:, None, None, None]
    return out


def test_a_batch_position_dependent_decode_attention_is_batch_variant(
        tmp_path: Path, plant: Any, capsys: Any) -> None:
    plant(SDPA, decode_by_batch_row)
    record_run("builtin:llama", SAME, tmp_path / "run", batch_size=3, max_new_tokens=3,
               dtype="bfloat16")
    code, out, err = explain(capsys, str(tmp_path / "run"), "--request", "p1", "--out",
                             str(tmp_path / "repro"), "--solution", "torch:sdpa",
                             "--solution", "torch:flex", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["kind"] == "batch-variant", result
    assert result["definition"].startswith("gqa_paged_decode") and "L0.attn" in result["op"]
    assert "scaled_dot_product_attention" in result["verdict"]
    assert result["finding"].startswith("pair p0/p1 at step 1")  # the first decode step
    sdpa, flex = result["candidates"]
    # torch:sdpa attends request by request: the same bytes give the same bytes anywhere
    assert sdpa.startswith("torch:sdpa: batch-invariant on these bytes (alone = every one "
                           "of 3 positions, bit for bit); deterministic"), sdpa
    assert flex.startswith("torch:flex: "), flex
    status = engine_status(tmp_path / "repro")
    lines = configs(tmp_path / "repro")
    assert {status[line.workload.uuid] for line in lines["alone"]} == {"PASS"}
    assert {status[line.workload.uuid] for line in lines["copies"]} == {"FAIL"}


def test_a_difference_after_the_probed_kernel_is_placed_after_it(
        tmp_path: Path, plant: Any, capsys: Any) -> None:
    """The attention module's output depends on the batch row, its SDPA call does not:
    the kernel's inputs and outputs agree, the re-run splits again, so the cause lies in
    the module after the kernel, where no probe sees."""
    def attention_by_batch_row(wrapped, instance, args, kwargs):
        out, weights = wrapped(*args, **kwargs)
        return by_batch_row(lambda: out, None, (), {}), weights

    plant("transformers.models.llama.modeling_llama:LlamaAttention.forward",
          attention_by_batch_row)
    record_run("builtin:llama", SAME, tmp_path / "run", batch_size=3, max_new_tokens=2)
    code, out, err = explain(capsys, str(tmp_path / "run"), "--out", str(tmp_path / "repro"),
                             "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["kind"] == "after-op", result
    assert "inside L0.attn after the probed op" in result["verdict"]
    assert "the re-run split again at step 0 L0.attn.out" in result["evidence"]


def test_one_corrupted_row_is_named_against_the_reference(tmp_path: Path, plant: Any,
                                                          capsys: Any) -> None:
    """A norm that, in one step of the engine, writes a wrong value into batch row 1 only:
    called again (outside that step) it is right everywhere, so the verdict falls to the
    reference, which agrees with p0."""
    def corrupt_row_1(wrapped, instance, args, kwargs):
        out = wrapped(*args, **kwargs)
        step = current_step()
        if step is not None and step.step == 1 and out.dim() == 3 and out.shape[0] > 1:
            out = out.clone()
            out[1] += 0.5
        return out

    plant(NORM, corrupt_row_1)
    record_run("builtin:llama", SAME, tmp_path / "run", batch_size=3, max_new_tokens=3)
    code, out, err = explain(capsys, str(tmp_path / "run"), "--out", str(tmp_path / "repro"),
                             "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["kind"] == "wrong-row", result
    assert "the reference agrees with p0 (max abs 0)" in result["verdict"]
    assert "p1 is wrong by max abs 0.5" in result["verdict"]
    assert result["finding"].startswith("pair p0/p1 at step 1")


def test_an_unknown_solution_is_one_line(tmp_path: Path, plant: Any, capsys: Any) -> None:
    plant(NORM, by_batch_row)
    record_run("builtin:llama", SAME, tmp_path / "run", batch_size=3, max_new_tokens=2)
    code, _, err = explain(capsys, str(tmp_path / "run"), "--out", str(tmp_path / "repro"),
                           "--solution", "torch:nope")
    assert code == 2 and err.strip().count("\n") == 0
    assert "unknown built-in solution(s) torch:nope" in err


def test_run_to_run_noise_in_attention_is_nondeterministic(tmp_path: Path, plant: Any,
                                                           capsys: Any) -> None:
    plant(SDPA, noisy)
    record_run("builtin:llama", SAME, tmp_path / "run", batch_size=3, max_new_tokens=3)
    code, out, err = explain(capsys, str(tmp_path / "run"), "--pair", "p0/p1", "--out",
                             str(tmp_path / "repro"))
    assert code == 0, err
    verdict = next(line for line in out.splitlines() if line.startswith("verdict:"))
    assert "nondeterministic" in verdict and "scaled_dot_product_attention" in verdict
    assert "in L0.attn" in verdict
    assert "op: gqa_ragged_prefill" in out
    lines = configs(tmp_path / "repro")
    dataset = Dataset(tmp_path / "repro")
    first, again = lines["alone"][0], lines["alone again"][0]
    assert torch.equal(dataset.load_inputs(first)["q"], dataset.load_inputs(again)["q"])
    assert not torch.equal(dataset.load_outputs(first)["output"],
                           dataset.load_outputs(again)["output"])
    status = engine_status(tmp_path / "repro")
    assert status[first.workload.uuid] == status[again.workload.uuid] == "FAIL"


def test_a_state_read_from_another_requests_slot_is_upstream(tmp_path: Path, plant: Any,
                                                             capsys: Any) -> None:
    fault = 3

    def wrong_slot(wrapped, instance, args, kwargs):
        step, arming = current_step(), current_arming()
        cache = kwargs.get("cache_params")
        if (step is not None and step.step == fault and instance.layer_idx == 1
                and cache is not None and arming is not None
                and arming.out_dir.name in ("planted", "rerun-b")):
            states = cache.layers[1].recurrent_states[0]
            states[1].copy_(states[2])  # p1 reads p2's slot
        return wrapped(*args, **kwargs)

    plant(GDN, wrong_slot)
    for name in ("clean", "planted"):
        record_run("builtin:qwen3_next", SAME, tmp_path / name, batch_size=3,
                   max_new_tokens=5)
    code, out, err = explain(capsys, str(tmp_path / "clean"), "--diff",
                             str(tmp_path / "planted"), "--request", "p1", "--out",
                             str(tmp_path / "repro"), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["kind"] == "upstream", result
    assert "gdn_decode" in result["op"] and "in L1.gdn" in result["op"]
    assert "first differing input `state`" in result["verdict"]
    assert result["verdict"].endswith(
        "p1 in planted's `state` is p2's (slot 2, not its own slot 1)"), result["verdict"]
    assert f"request p1 at step {fault}" in result["finding"]
    lines = configs(tmp_path / "repro")
    dataset = Dataset(tmp_path / "repro")
    clean, planted = (dataset.load_inputs(line)["state"] for line in lines["recorded"])
    assert torch.equal(clean[0], planted[0]) and not torch.equal(clean[1], planted[1])
    assert torch.equal(planted[1], planted[2])  # the same difference, in REPRO's bytes
    # the kernel itself is right on what it was given: its bug is upstream
    assert set(engine_status(tmp_path / "repro").values()) == {"PASS"}


# ---------------------------------------------------------------------- bad input
def test_a_run_without_a_culprit_is_one_line(tmp_path: Path, capsys: Any) -> None:
    record_run("builtin:llama", SAME, tmp_path / "run", batch_size=3, max_new_tokens=2)
    run = str(tmp_path / "run")
    for args, message in (([], "no culprit for any pair"),
                          (["--pair", "p0/p1"], "no culprit for pair p0/p1"),
                          (["--request", "p2"], "no culprit for request p2"),
                          (["--diff", run], "no culprit for any request"),
                          (["--diff", run, "--request", "p1"], "no culprit for request p1")):
        code, _, err = explain(capsys, run, "--out", str(tmp_path / "repro"), *args)
        assert code == 2, (args, err)
        assert err.strip().count("\n") == 0 and message in err, (args, err)
        assert not (tmp_path / "repro").exists()


def test_a_culprit_no_probe_covers_is_one_line(tmp_path: Path, plant: Any,
                                               capsys: Any) -> None:
    def by_batch_row_mlp(wrapped, instance, args, kwargs):
        return by_batch_row(wrapped, instance, args, kwargs)

    plant(MLP, by_batch_row_mlp)
    record_run("builtin:llama", SAME, tmp_path / "run", batch_size=3, max_new_tokens=2)
    code, _, err = explain(capsys, str(tmp_path / "run"), "--out", str(tmp_path / "repro"))
    assert code == 2, err
    assert err.strip().count("\n") == 0, err
    assert "no capture probe covers L0.mlp.out on builtin:llama" in err
    assert not (tmp_path / "repro").exists()  # refused before anything was written


def _as_engine(run: Path, engine: str) -> None:
    path = run / "tap-rank0.jsonl"
    header, rest = path.read_text().split("\n", 1)
    record = json.loads(header)
    record["options"]["run"]["engine"] = engine  # as `tap run --engine ...` would write it
    path.write_text(json.dumps(record) + "\n" + rest)


def test_a_run_of_another_engine_is_one_line(tmp_path: Path, plant: Any,
                                             capsys: Any) -> None:
    plant(NORM, by_batch_row)
    for batch in (1, 3):
        record_run("builtin:llama", SAME, tmp_path / f"b{batch}", batch_size=batch,
                   max_new_tokens=2)
    _as_engine(tmp_path / "b3", "sglang")
    code, _, err = explain(capsys, str(tmp_path / "b3"), "--out", str(tmp_path / "repro"))
    assert code == 2 and err.strip().count("\n") == 0
    assert "cannot explain a run of engine 'sglang'" in err
    # vLLM is re-run once per process: a pair of one run, not a diff of two runs
    _as_engine(tmp_path / "b3", "vllm")
    _as_engine(tmp_path / "b1", "vllm")
    code, _, err = explain(capsys, str(tmp_path / "b1"), "--diff", str(tmp_path / "b3"),
                           "--request", "p2", "--out", str(tmp_path / "repro"))
    assert code == 2 and err.strip().count("\n") == 0
    assert "cannot explain this vLLM finding" in err
    assert not (tmp_path / "repro").exists()


def test_a_run_recorded_without_prompts_is_one_line(tmp_path: Path, capsys: Any) -> None:
    from enginetap.config import ArmConfig
    from enginetap.core.jsonl import close_all
    from enginetap.engines.hf import HFEngine, Request
    from enginetap.engines.hf.arming import disarm

    config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=tmp_path / "run",
                       options={"tap": {}, "step": {"record": False}})
    try:
        engine = HFEngine.from_builtin("llama", dtype=torch.float32, arm=config)
        engine.generate([Request(request_id="p0", prompt="decode", max_new_tokens=2)])
    finally:
        disarm()
        close_all()
    code, _, err = explain(capsys, str(tmp_path / "run"), "--out", str(tmp_path / "repro"))
    assert code == 2 and err.strip().count("\n") == 0
    assert "the run was recorded without its prompts" in err
    # nor as the other run of a diff: its prompts are needed to re-run it
    record_run("builtin:llama", ["decode"], tmp_path / "full", batch_size=1, max_new_tokens=2)
    code, _, err = explain(capsys, str(tmp_path / "full"), "--diff", str(tmp_path / "run"),
                           "--out", str(tmp_path / "repro"))
    assert code == 2 and err.strip().count("\n") == 0
    assert f"{tmp_path / 'run'}: the run was recorded without its prompts" in err
    assert not (tmp_path / "repro").exists()


@pytest.mark.parametrize("args,message", [
    (["--pair", "p0"], "is not A/B"),
    (["--pair", "p0/p1", "--diff", "x"], "--pair and --diff together"),
])
def test_bad_options_are_one_line(tmp_path: Path, capsys: Any, args: list[str],
                                  message: str) -> None:
    code, _, err = explain(capsys, str(tmp_path), "--out", str(tmp_path / "r"), *args)
    assert code == 2 and message in err and err.strip().count("\n") == 0


@pytest.mark.parametrize("checkpoint,module", [
    ("L3.attn.out", "L3.attn"), ("L1.gdn.state_before", "L1.gdn"), ("L3.out", "L3"),
    ("norm.out", "norm"), ("L0.moe.gate.out2", "L0.moe.gate"), ("L2.attn.core.out", "L2.attn.core"),
])
def test_a_checkpoint_names_its_module(checkpoint: str, module: str) -> None:
    from enginetap.tap.culprit import module_of

    assert module_of(checkpoint) == module
