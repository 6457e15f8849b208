"""The capture runtime on the built-in engine: selection, copies, writer, failures, CLI.

Probes themselves (fidelity per family) are tested beside their tables; these tests pin
what every probe relies on: unselected steps copy nothing, a capture never changes the
engine's tokens, a write error stops capture but not the engine, a failing probe disarms
itself, and bad input is refused before anything is written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from enginetap.capture.writers import copy as capture_copy
from enginetap.config import ArmConfig
from enginetap.core.context import subscribe, unsubscribe
from enginetap.dataset import Dataset, validate_dataset
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm
from enginetap.replay import replay_dataset

PROMPTS = ["kernels and caches meet the scheduler", "a shorter prompt", "hi"]
WRITERS = ["thread", "process"]
"""Where the capture writer's dataset work runs: the engine's process, or a child."""


def _requests(new: int = 6) -> list[Request]:
    return [Request(request_id=f"r{i}", prompt=p, max_new_tokens=new)
            for i, p in enumerate(PROMPTS)]


def _armed(tmp_path: Path, **capture: object) -> ArmConfig:
    return ArmConfig(enabled=True, capabilities=["capture"], out_dir=tmp_path / "run",
                     options={"capture": {"dataset": str(tmp_path / "ds"), **capture}})


@pytest.fixture
def armed_engine(tmp_path):
    engines = []

    def make(**capture: object) -> HFEngine:
        engines.append(HFEngine.from_builtin("llama", arm=_armed(tmp_path, **capture)))
        return engines[-1]

    yield make
    disarm()


@pytest.mark.parametrize("writer", WRITERS)
def test_armed_capture_keeps_tokens_and_replays(tmp_path, armed_engine, writer):
    disarmed = [c.output_ids for c in HFEngine.from_builtin("llama").generate(_requests())]
    engine = armed_engine(writer=writer)
    armed = [c.output_ids for c in engine.generate(_requests())]
    disarm()
    assert armed == disarmed
    summary = json.loads((tmp_path / "run" / "capture-summary-rank0.json").read_text())
    assert summary["written"] > 0 and not summary["disabled_probes"]
    assert validate_dataset(tmp_path / "ds") == []
    report = replay_dataset(tmp_path / "ds", progress=False)
    assert report.ok
    line = Dataset(tmp_path / "ds").workloads(next(iter(Dataset(tmp_path / "ds").definitions())))[0]
    receipt = line.enginetap.receipt
    assert receipt.source == "capture:the built-in transformers engine"
    assert receipt.layer and receipt.notes["probe"] and receipt.notes["adapter"]
    assert set(receipt.request_ids) <= {"r0", "r1", "r2"}
    assert receipt.notes["model"]["config_sha256"]


def test_the_process_writer_stores_what_the_thread_writer_stores(tmp_path):
    """The same capture written by the writer thread and by the writer process: the same
    workloads, bit for bit, with the same receipts but for their times."""
    import torch

    stored = {}
    for writer in WRITERS:
        engine = HFEngine.from_builtin("llama", arm=_armed(tmp_path / writer, writer=writer))
        engine.generate(_requests())
        disarm()
        dataset = Dataset(tmp_path / writer / "ds")
        assert validate_dataset(dataset.root) == []
        found = {}
        for name in dataset.definitions():
            for line in dataset.workloads(name):
                r = line.enginetap.receipt
                found[(name, r.step, r.layer, tuple(r.request_ids))] = (
                    dataset.load_inputs(line), dataset.load_outputs(line),
                    r.model_dump(exclude={"created_at"}))
        stored[writer] = found
    thread, process = stored["thread"], stored["process"]
    assert thread and set(thread) == set(process)
    for key, (inputs, outputs, receipt) in thread.items():
        other_inputs, other_outputs, other_receipt = process[key]
        assert receipt == other_receipt
        for mine, theirs in ((inputs, other_inputs), (outputs, other_outputs)):
            assert set(mine) == set(theirs)
            for name, value in mine.items():
                if isinstance(value, torch.Tensor):
                    assert value.dtype == theirs[name].dtype
                    assert torch.equal(value.view(torch.uint8), theirs[name].view(torch.uint8))
                else:
                    assert value == theirs[name]


def test_unselected_steps_copy_no_tensor(tmp_path, armed_engine):
    engine = armed_engine(policy="prefill-only")
    copies: dict[int, tuple[str, int, int]] = {}

    def begin(step):
        copies[step.step] = (step.mode, capture_copy.STATS.tensors, 0)

    def end(step):
        mode, before, _ = copies[step.step]
        copies[step.step] = (mode, before, capture_copy.STATS.tensors)

    subscribe(on_begin=begin, on_end=end)
    try:
        engine.generate(_requests())
    finally:
        unsubscribe(begin)
        unsubscribe(end)
    decode = [after - before for mode, before, after in copies.values() if mode == "decode"]
    prefill = [after - before for mode, before, after in copies.values() if mode == "prefill"]
    assert len(decode) == 5 and decode == [0] * 5
    assert prefill and prefill[0] > 0


def test_decode_picks_follow_the_policy_and_labels(tmp_path, armed_engine):
    from enginetap.capture.labels import write_labels

    write_labels(tmp_path / "run" / "capture-labels.json",
                 {f"r{i}": {"output_tokens": 9} for i in range(3)})
    engine = armed_engine(policy={"name": "t", "prefill": False, "decode_steps": [2, "last"],
                                  "per_variant": 8})
    engine.generate(_requests(new=9))
    disarm()
    steps = {l.enginetap.receipt.step for name in Dataset(tmp_path / "ds").definitions()
             for l in Dataset(tmp_path / "ds").workloads(name)}
    # prefill is step 0; decode index d runs in step d + 1; 8 decodes: picks 2 and 7
    assert steps == {3, 8}


def test_selector_picks_per_request_with_labels_that_arrive_late(tmp_path):
    """Each request's decode index counts on its own; middle/last come from its label,
    also when the label file is written after the request started decoding; a request
    without a label gets the numbered picks only."""
    import os

    from enginetap.capture.labels import RequestLabels, write_labels
    from enginetap.capture.options import SelectionPolicy
    from enginetap.capture.selection import Selector
    from enginetap.core.context import Step, StepRows

    labels_file = tmp_path / "labels.json"
    selector = Selector(SelectionPolicy(name="t", prefill=False,
                                        decode_steps=[1, "middle", "last"]),
                        RequestLabels(labels_file))
    chosen: dict[str, list[int]] = {"a": [], "b": [], "c": []}

    def step(number: int, keys: list[str]) -> None:
        rows = StepRows(request_ids=keys, positions=[0] * len(keys),
                        token_ids=[0] * len(keys), query_start=list(range(len(keys))),
                        computed_host=[0] * len(keys))
        s = Step("test", number, "decode", rows)
        selector.on_begin(s)
        if selector.selected(s):
            for key in keys:
                chosen[key].append(selector.decode_index[key])
        selector.on_end(s)

    step(0, ["a", "b", "c"])  # no label file yet
    write_labels(labels_file, {"a": {"output_tokens": 9}})  # 8 decodes: middle 3, last 7
    os.utime(labels_file, (1, 1))  # a modification time unlike any seen before
    for number in range(1, 4):
        step(number, ["a", "b", "c"])
    write_labels(labels_file, {"a": {"output_tokens": 9}, "b": {"output_tokens": 7}})
    os.utime(labels_file, (2, 2))  # b: 6 decodes: middle 2 (already past), last 5
    for number in range(4, 9):
        step(number, ["a", "b", "c"] if number < 6 else ["a"])
    # a step is selected when any of its requests is at a pick: the indices it ran at
    assert chosen["a"] == [1, 3, 5, 7]  # 1 (numbered), 3 (middle), 5 (b's last), 7 (last)
    assert chosen["b"] == [1, 3, 5]
    assert chosen["c"] == [1, 3, 5]
    assert selector.skipped_steps == 5


@pytest.mark.parametrize("writer", WRITERS)
def test_a_write_error_stops_capture_and_the_engine_goes_on(tmp_path, armed_engine, writer):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "blob").write_text("a file where the blob folder belongs")
    disarmed = [c.output_ids for c in HFEngine.from_builtin("llama").generate(_requests())]
    engine = armed_engine(writer=writer)
    assert [c.output_ids for c in engine.generate(_requests())] == disarmed
    disarm()
    summary = json.loads((tmp_path / "run" / "capture-summary-rank0.json").read_text())
    assert summary["write_error"] and summary["written"] == 0
    assert summary["dropped_after_write_error"] > 0


def test_a_failing_probe_disarms_itself_and_is_counted(tmp_path, armed_engine, monkeypatch):
    from enginetap.engines.hf import probes

    def broken(call):
        raise RuntimeError("adapter bug")

    broken_probe = probes.Probe("test.broken", "rmsnorm", probes.PROBES[0].define, broken,
                                suffix="RMSNorm")
    monkeypatch.setattr(probes, "PROBES", [broken_probe])
    disarmed = [c.output_ids for c in HFEngine.from_builtin("llama").generate(_requests())]
    engine = armed_engine()
    assert [c.output_ids for c in engine.generate(_requests())] == disarmed
    disarm()
    summary = json.loads((tmp_path / "run" / "capture-summary-rank0.json").read_text())
    assert summary["probe_failures"] == {"test.broken": 1}
    assert "adapter bug" in summary["disabled_probes"]["test.broken"]


@pytest.mark.parametrize("writer", WRITERS)
def test_a_failed_device_check_refuses_the_workload_and_disables_its_probe(
        tmp_path, armed_engine, monkeypatch, writer):
    # Adapters check what they assume on the device (no host wait); the writer reads the
    # flags before writing. A failed one: the workload is refused, its probe disabled.
    import dataclasses

    import torch

    from enginetap.engines.hf import probes

    real = next(p for p in probes.PROBES if p.family == "rmsnorm")

    def adapt(call):
        extracted = real.adapt(call)
        if extracted is not None:
            held = (extracted.inputs["hidden_states"] == extracted.inputs["hidden_states"])
            extracted.checks.append((held.all(), "a check that holds"))
            extracted.checks.append((torch.tensor(False), "the test's broken assumption"))
        return extracted

    monkeypatch.setattr(probes, "PROBES", [dataclasses.replace(real, adapt=adapt)])
    disarmed = [c.output_ids for c in HFEngine.from_builtin("llama").generate(_requests())]
    engine = armed_engine(writer=writer)
    assert [c.output_ids for c in engine.generate(_requests())] == disarmed
    disarm()
    summary = json.loads((tmp_path / "run" / "capture-summary-rank0.json").read_text())
    assert summary["written"] == 0 and summary["refused_by_dataset"] >= 1
    assert "the adapter's check failed: the test's broken assumption" in \
        summary["disabled_probes"][real.name]


@pytest.mark.parametrize("writer", WRITERS)
def test_a_workload_the_dataset_refuses_is_left_out_alone(tmp_path, armed_engine,
                                                         monkeypatch, writer):
    """A refused record in a batch of several (an adapter bug: a norm's output lost its
    last column): only it is left out and its probe disabled; the batch's other workloads
    are written and capture goes on (the dataset refuses a batch as a whole, the writer
    then finds which record it was)."""
    import dataclasses

    from enginetap.engines.hf import probes

    real = next(p for p in probes.PROBES if p.family == "rmsnorm")

    def adapt(call):
        extracted = real.adapt(call)
        if extracted is not None:
            extracted.outputs["output"] = extracted.outputs["output"][..., :-1].contiguous()
        return extracted

    broken = dataclasses.replace(real, name="test.rmsnorm-cut", adapt=adapt)
    monkeypatch.setattr(probes, "PROBES", [broken, *[p for p in probes.PROBES if p is not real]])
    disarmed = [c.output_ids for c in HFEngine.from_builtin("llama").generate(_requests())]
    engine = armed_engine(writer=writer)
    assert [c.output_ids for c in engine.generate(_requests())] == disarmed
    disarm()
    summary = json.loads((tmp_path / "run" / "capture-summary-rank0.json").read_text())
    assert summary["refused_by_dataset"] >= 1 and summary["written"] > 0
    assert not summary["write_error"]
    assert "storing its workload" in summary["disabled_probes"]["test.rmsnorm-cut"]
    assert validate_dataset(tmp_path / "ds") == []


def test_repeated_kv_heads_are_checked_on_the_device() -> None:
    import torch

    from enginetap.engines.hf.probes.attention import _kv_heads

    kv = torch.randn(2, 2, 40, 4, dtype=torch.bfloat16)
    repeated = kv.repeat_interleave(3, dim=1)  # transformers' repeat_kv
    checks: list = []
    kept = _kv_heads(repeated, 2, [], "key", checks)
    assert torch.equal(kept, kv) and bool(checks[0][0])
    # the check reads columns 0, 16, 32 and the last one, every head, every byte
    for column in (0, 16, 39):
        changed = repeated.clone()
        changed[1, 4, column, 1] += 1  # one element of one repeated head differs
        checks = []
        _kv_heads(changed, 2, [], "value", checks)
        assert not bool(checks[0][0])
        assert "not 2 kv heads each repeated 3 times" in checks[0][1]
    # heads that are not repeats at all (another projection each) are found
    checks = []
    _kv_heads(torch.randn(2, 6, 40, 4, dtype=torch.bfloat16), 2, [], "key", checks)
    assert not bool(checks[0][0])


def test_captured_dataset_loads_in_flashinfer_bench(tmp_path, armed_engine):
    data = pytest.importorskip("flashinfer_bench.data")
    armed_engine().generate(_requests())
    disarm()
    traces = data.TraceSet.from_path(str(tmp_path / "ds"))
    assert set(traces.definitions) == set(Dataset(tmp_path / "ds").definitions())
    assert sum(len(w) for w in traces.workloads.values()) > 0


# ------------------------------------------------------------------------- CLI
def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "enginetap.cli.main", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("case", ["profile", "definition", "out", "model"])
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, case):
    args = ["capture", "--model", "builtin:llama", "--out", str(tmp_path / "ds")]
    if case == "profile":
        (tmp_path / "p.json").write_text('{"name": "x", "requests": [{"label": 3}]}')
        args += ["--profile", str(tmp_path / "p.json")]
    elif case == "definition":
        args += ["--definitions", "no_such_family"]
    elif case == "out":
        (tmp_path / "ds").write_text("a file")
    else:
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "config.json").write_text("{}")
        args[2] = str(tmp_path / "m")
    out = _cli(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error:" in out.stderr and "Traceback" not in out.stderr
    if case != "out":
        ds = tmp_path / "ds"
        # refused before the engine: nothing written, or a run marked failed
        status = ds / "enginetap" / "capture-run.json"
        assert not (ds / "definitions").exists()
        assert not status.exists() or json.loads(status.read_text())["status"] == "failed"


def test_cli_captures_under_a_mooncake_profile_and_reports(tmp_path):
    out = _cli("capture", "--model", "builtin:llama", "--out", str(tmp_path / "ds"),
               "--max-output-tokens", "8", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "captured into" in out.stdout and "enginetap replay" in out.stdout
    run = json.loads((tmp_path / "ds" / "enginetap" / "capture-run.json").read_text())
    assert run["status"] == "complete" and run["profile"] == "builtin:mooncake-tiny"
    labels = json.loads((tmp_path / "ds" / "enginetap" / "capture-labels.json").read_text())
    assert any(v["role"] == "predecessor" for v in labels.values())
    ds = Dataset(tmp_path / "ds")
    receipts = [l.enginetap.receipt for n in ds.definitions() for l in ds.workloads(n)]
    labelled = [r for r in receipts if any(v for v in r.notes["requests"].values())]
    assert labelled and all(r.notes["requests"][k].get("profile") == "mooncake-tiny"
                            for r in labelled for k in r.request_ids)
    # the step log holds the selected steps only (``options.step.record: "selected"``):
    # every step a workload came from, and with the steps not selected, all of them (the
    # last step is a selected "last" decode step)
    logged = [json.loads(line)["step"] for line in
              (tmp_path / "ds" / "enginetap" / "steps-rank0.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "ds" / "enginetap" / "capture-summary-rank0.json")
                         .read_text())
    assert logged == sorted(set(logged)) and {r.step for r in receipts} <= set(logged)
    assert summary["steps_not_selected"] > 0
    assert len(logged) + summary["steps_not_selected"] == logged[-1] + 1
    assert replay_dataset(tmp_path / "ds", progress=False).ok


def _reached(patch) -> bool:
    """Whether a call through ``patch``'s class attribute meets its wrapper."""
    found = vars(patch._owner).get(patch.target.attribute)
    while found is not None:
        if found is patch._installed_wrapper:
            return True
        found = getattr(found, "__wrapped__", None)
    return False


def test_unselected_steps_run_no_capture_or_scope_wrapper(tmp_path):
    """Outside selected steps the probes' and the module scope's gates are shut: their
    patches on class methods are off the classes (the classes hold the engine's own
    functions again), the rest are gated (wrapt calls the engine's function directly),
    so no wrapper of ours runs (the scope names no module); on selected steps both run.
    With tap armed too the same: the tap takes names from the scope's registry and never
    reads the running sublayer (its wrappers, stacked on the scope's, pin those on)."""
    from enginetap.core.scope import current_module

    seen: dict[tuple[int, str], set[bool]] = {}

    def spy(module, args):
        from enginetap.core.context import current_step

        step = current_step()
        if step is not None:
            seen.setdefault((step.step, step.mode), set()).add(current_module() is not None)

    for capabilities in (["capture"], ["capture", "tap"]):
        seen.clear()
        config = _armed(tmp_path / "-".join(capabilities), policy="prefill-only")
        config = config.model_copy(update={"capabilities": capabilities})
        engine = HFEngine.from_builtin("llama", arm=config)
        runtime = engine.arming.context.notes["capture"]
        handles = [m.register_forward_pre_hook(spy) for m in engine.model.modules()
                   if type(m).__name__.endswith("MLP")]
        gates: list[tuple[str, bool]] = []
        scope_patches = engine.arming.context.notes["scope"].gate._patches
        ours = [*runtime.patches.patches, *scope_patches]
        on_classes = [p for p in ours if isinstance(p._owner, type)]
        assert len(on_classes) > len(scope_patches) >= 4
        attached: list[tuple[str, list[bool], bool]] = []

        def gate_at_begin(step, runtime=runtime, gates=gates):  # after capture's listener
            gates.append((step.mode, runtime.gate.is_open))
            held = [_reached(p) for p in on_classes]
            attached.append((step.mode, held, all(p.attached == h
                                                  for p, h in zip(on_classes, held))))

        subscribe(on_begin=gate_at_begin)
        try:
            engine.generate(_requests(new=4))
        finally:
            for handle in handles:
                handle.remove()
            unsubscribe(gate_at_begin)
            disarm()
        modes = {mode for _, mode in seen}
        assert modes == {"prefill", "decode"}
        for (_, mode), inside in seen.items():
            if mode == "prefill":
                assert inside == {True}, (capabilities, mode)
            else:
                assert inside == {False}, (capabilities, mode)
        assert gates and all(is_open == (mode == "prefill") for mode, is_open in gates), gates
        assert all(agree for _, _, agree in attached)
        assert all(all(held) for mode, held, _ in attached if mode == "prefill")
        if capabilities == ["capture"]:  # nothing stacked on them: all off their classes
            assert not any(any(held) for mode, held, _ in attached if mode == "decode")
        else:  # the scope's are pinned under the tap's wrappers
            assert all(p.attached for p in scope_patches if isinstance(p._owner, type))


@pytest.mark.parametrize("interval", [0.0005, 0.0])
def test_the_writer_lowers_the_switch_interval_only_while_it_works(tmp_path, armed_engine,
                                                                   interval):
    import sys
    import threading
    import time

    before = sys.getswitchinterval()
    seen: set[float] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.add(sys.getswitchinterval())
            time.sleep(0.0002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        engine = armed_engine(switch_interval_s=interval)
        engine.generate(_requests())
        disarm()
    finally:
        stop.set()
        watcher.join()
    assert sys.getswitchinterval() == before
    assert seen == ({before, interval} if interval else {before})
