"""The SGLang capture drift lock shipped with enginetap, and guard drift on SGLang
functions (no engine is started: SGLang's modules are imported and their sources hashed).

An SGLang whose sources differ from the ones the probes were written against (another
version) looks to the lock exactly like a lock pinned against another version: a digest
that no longer matches. Both the capture runtime (the drifted probe group is refused by
name, the others arm) and ``enginetap guard check`` (exit 1 naming each drifted function)
refuse it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang]

GDN_EXTEND = ("sglang.srt.layers.attention.linear.gdn_backend:"
              "GDNKernelDispatcher.extend")


@pytest.fixture(autouse=True)
def _cpu_engine(monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's modules read it at import


def test_the_shipped_lock_pins_every_target_and_matches_this_sglang():
    from enginetap.engines.sglang.probes import LOCK, LOCKED_TARGETS, PROBES
    from enginetap.engines.sglang.worker import SGLangHooks
    from enginetap.guard.lock import GuardLock

    lock = GuardLock.load(LOCK.file)
    assert {e.target for e in lock.entries} == set(LOCKED_TARGETS)
    kept, refused = LOCK.checked_probes()
    assert refused == {} and [p.name for p in kept] == [p.name for p in PROBES]
    assert SGLangHooks().engine_version() == "sglang 0.5.23"


def test_a_drifted_sglang_function_refuses_its_probes_by_name(tmp_path: Path, caplog):
    from enginetap.engines.sglang.probes import LOCK, PROBES

    data = json.loads(LOCK.file.read_text())
    for entry in data["entries"]:
        if entry["target"] == GDN_EXTEND:
            entry["digest"] = "0" * 64
    drifted = tmp_path / "capture.lock"
    drifted.write_text(json.dumps(data))
    with caplog.at_level(logging.ERROR, logger="enginetap.capture"):
        kept, refused = LOCK.checked_probes(drifted)
    assert set(refused) == {"sglang.gdn.extend", "sglang.gdn.decode"}
    assert all(GDN_EXTEND in why for why in refused.values())
    assert {p.name for p in kept} == {p.name for p in PROBES} - set(refused)
    assert "sglang.gdn.extend" in caplog.text and "SGLang serves on" in caplog.text


def test_guard_check_refuses_a_drifted_sglang_function(tmp_path: Path):
    from typer.testing import CliRunner

    from enginetap.cli.main import app
    from enginetap.engines.sglang.cpu.fixes import ROPE_CPU

    runner = CliRunner()
    lock = tmp_path / "sglang.lock"
    targets = [ROPE_CPU, GDN_EXTEND]
    pinned = runner.invoke(app, ["guard", "pin", *targets, "-o", str(lock)],
                           env={**os.environ, "COLUMNS": "200"})
    assert pinned.exit_code == 0, pinned.output
    data = json.loads(lock.read_text())
    assert {e["target"]: e["version"] for e in data["entries"]} == dict.fromkeys(targets,
                                                                                  "0.5.23")
    for entry in data["entries"]:
        if entry["target"] == GDN_EXTEND:
            entry["digest"] = "f" * 64  # pinned against another SGLang
    lock.write_text(json.dumps(data))
    refused = runner.invoke(app, ["guard", "check", str(lock)])
    assert refused.exit_code == 1, refused.output
    assert "DRIFT" in refused.output and "GDNKernelDispatcher.extend" in refused.output
    assert "get_rope_cpu" not in refused.output  # the unchanged one is not named
    assert f"1 of {len(targets)} target(s) drifted" in refused.output
