"""The built-in engine armed by the same ArmConfig as vLLM: from the environment, in a
fresh process, with the step recorder and a guard patch; outputs unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from enginetap.config import ARMING_VARS, ArmConfig
from enginetap.engines.hf import arm, disarm
from enginetap.errors import ConfigError

# A guard patch for transformers' Llama RMSNorm: the same math on row blocks (bit-exact).
PATCH = textwrap.dedent('''
    import torch
    from enginetap.guard import ExactPatch

    def by_rows(norm, hidden_states):
        def one(block):
            variance = block.float().pow(2).mean(-1, keepdim=True)
            normed = block.float() * torch.rsqrt(variance + norm.variance_epsilon)
            return norm.weight * normed.to(block.dtype)
        return torch.cat([one(b) for b in hidden_states.split(3, dim=-2)], dim=-2)

    def install():
        return ExactPatch("transformers.models.llama.modeling_llama:LlamaRMSNorm.forward",
                          by_rows, name="llama-rmsnorm-rows").install()
''')

RUN = textwrap.dedent('''
    import json, sys
    from enginetap.engines.hf import HFEngine, Request
    engine = HFEngine.from_builtin("llama")
    prompts = ["kernels and caches", "a longer prompt about batching many requests", "hi"]
    done = engine.generate([Request(request_id=f"q{i}", prompt=p, max_new_tokens=5)
                            for i, p in enumerate(prompts)])
    print(json.dumps({"tokens": [c.output_ids for c in done],
                      "prompts": [c.prompt_ids for c in done], "steps": engine.steps}))
''')


def _run(tmp_path: Path, armed: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ARMING_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    if armed:
        config = ArmConfig(enabled=True, capabilities=["step", "guard"], out_dir=tmp_path / "out",
                           options={"guard": {"patches": ["et_hf_guard_patch:install"]}})
        (tmp_path / "arm.json").write_text(config.model_dump_json())
        env["ENGINETAP_CONFIG"] = str(tmp_path / "arm.json")
    out = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "log": out.stderr}


def test_env_armed_engine_records_steps_proves_guard_and_keeps_tokens(tmp_path: Path):
    (tmp_path / "et_hf_guard_patch.py").write_text(PATCH)
    disarmed = _run(tmp_path, armed=False)
    armed = _run(tmp_path, armed=True)
    assert armed["tokens"] == disarmed["tokens"]
    assert "enginetap armed in the built-in transformers engine" in armed["log"]
    assert "not available" not in armed["log"]
    steps = [json.loads(line) for line in (tmp_path / "out/steps-rank0.jsonl").read_text().splitlines()]
    assert len(steps) == armed["steps"] and steps[0]["mode"] == "prefill"
    prefill = steps[0]["rows"]
    for i, prompt in enumerate(armed["prompts"]):
        rows = [r for r, rid in enumerate(prefill["request_ids"]) if rid == f"q{i}"]
        assert [prefill["token_ids"][r] for r in rows] == prompt
        assert [prefill["positions"][r] for r in rows] == list(range(len(prompt)))
    decisions = [json.loads(line) for line in (tmp_path / "out/guard-rank0.jsonl").read_text().splitlines()]
    assert decisions and {d["event"] for d in decisions} == {"decision"}
    assert {d["op"] for d in decisions} == {"llama-rmsnorm-rows"}
    assert all(d["chosen"] == "patched" for d in decisions), decisions
    assert not (tmp_path / "out" / "steps-rank1.jsonl").exists()


def test_arming_is_per_process_and_conflicts_are_refused(tmp_path: Path):
    assert arm(ArmConfig()) is None  # not enabled: nothing to arm
    first = ArmConfig(enabled=True, capabilities=["step"], out_dir=tmp_path / "a")
    try:
        armed = arm(first)
        assert armed is not None and arm(first) is armed
        assert armed.armed == [f"step (recording to {tmp_path / 'a' / 'steps-rank0.jsonl'})"]
        with pytest.raises(ConfigError, match="already armed"):
            arm(ArmConfig(enabled=True, capabilities=["step"], out_dir=tmp_path / "b"))
    finally:
        disarm()
    # Options and capability names are refused when the config is built, not when armed.
    with pytest.raises(ValidationError, match="recrod"):
        ArmConfig(enabled=True, options={"step": {"recrod": True}})
    with pytest.raises(ValidationError, match="unknown capability 'teleport'"):
        ArmConfig(enabled=True, capabilities=["teleport"])


EXPLICIT = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    from enginetap.config import ArmConfig
    from enginetap.engines.hf import HFEngine, Request
    out = Path(sys.argv[1])
    explicit = ArmConfig(enabled=True, capabilities=["guard"], out_dir=out / "explicit",
                         options={"guard": {"mode": "compare",
                                            "patches": ["et_hf_guard_patch:install"]}})
    engine = HFEngine.from_builtin("llama", arm=explicit)
    engine.generate([Request(request_id="x", prompt="kernels", max_new_tokens=2)])
    from enginetap.guard.options import active_guard_options
    options, config = active_guard_options()
    print(json.dumps({"mode": options.mode, "out": str(config.out_dir)}))
''')


def test_explicit_config_wins_over_the_environment_for_every_capability(tmp_path: Path):
    """The environment arms differently (other out dir, guard mode, no patches): the
    engine built with an explicit config follows the explicit one in every capability."""
    (tmp_path / "et_hf_guard_patch.py").write_text(PATCH)
    env_config = tmp_path / "env.json"
    env_config.write_text(json.dumps({"capabilities": ["guard"], "out_dir": str(tmp_path / "env"),
                                      "options": {"guard": {"mode": "off"}}}))
    env = {k: v for k, v in os.environ.items() if k not in ARMING_VARS}
    env.update(ENGINETAP="1", ENGINETAP_CONFIG=str(env_config),
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", EXPLICIT, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"mode": "compare", "out": str(tmp_path / "explicit")}
    assert (tmp_path / "explicit" / "steps-rank0.jsonl").is_file()
    # compare mode (the explicit config's) proves nothing, so it records no decision
    records = tmp_path / "explicit" / "guard-rank0.jsonl"
    assert not records.exists() or "decision" not in records.read_text()
    assert not (tmp_path / "env").exists()
