"""Built-in traffic profiles and prompt sets are discoverable: `enginetap traffic list`
names each with what it is (checked against the profile it builds), the shipped Mooncake
sample's path, the prompt-file format; a trace passed without its prefix is named."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from enginetap.cli.capture import capture
from enginetap.cli.tap import PROMPTS_HELP
from enginetap.errors import TrafficError
from enginetap.jobs.tap import BUILTIN_PROMPTS, PROMPTS_ABOUT, load_prompts
from enginetap.traffic.profile import save_profile
from enginetap.traffic.scaling import all_requests
from enginetap.traffic.sources import (BUILTIN_PROFILES, PROFILE_ABOUT, builtin_profile,
                                       packaged_trace, packaged_trace_path, resolve_profile)

AGENTX = Path(__file__).parent / "data" / "agentx_shapes.json"


def _list() -> str:
    done = subprocess.run([sys.executable, "-m", "enginetap.cli.main", "traffic", "list"],
                          capture_output=True, text=True, timeout=120)  # a pipe: no TTY
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
def test_each_profile_is_what_its_description_says(name: str) -> None:
    about, profile = PROFILE_ABOUT[name], builtin_profile(name)
    requests = list(all_requests(profile))
    context = int(re.search(r"(\d+) positions", about).group(1))
    output = int(re.search(r"(\d+) output tokens", about).group(1))
    assert max(r.output_tokens for r in requests) == output
    assert all(r.input_tokens + r.output_tokens <= context for r in requests)
    group = re.search(r"overlapping group of (\d+)", about)
    assert [len(g.members) for g in profile.overlap_groups] == [int(group.group(1))]
    arrivals = re.search(r"(\d+) arrivals", about)
    if arrivals:
        assert [len(r.members) for r in profile.replays] == [int(arrivals.group(1))]
    reused = any(r.cache_predecessor is not None for r in profile.requests)
    assert reused == ("reused prefix" in about)


def test_the_profiles_differ_in_what_they_stress() -> None:
    short, long = builtin_profile("chat-short"), builtin_profile("agentic-long")
    longest = {n: max(r.input_tokens for r in all_requests(builtin_profile(n)))
               for n in BUILTIN_PROFILES}
    assert longest["chat-short"] <= 512 < longest["agentic-long"]
    # the halves split the sample at its median: no line in both (the median line aside)
    lines = [{r.source for r in all_requests(p)} for p in (short, long)]
    assert len(lines[0] & lines[1]) <= 1
    # a model with a longer context gets longer agentic requests, chat stays short
    assert max(r.input_tokens for r in all_requests(builtin_profile("agentic-long", 4096))
               ) > longest["agentic-long"]
    assert max(r.input_tokens for r in all_requests(builtin_profile("chat-short", 4096))
               ) <= 512


def test_traffic_list_names_profiles_sample_prompt_sets_and_format() -> None:
    out = _list()
    for name in BUILTIN_PROFILES:
        assert f"  {name}" in out and PROFILE_ABOUT[name] in out
    for name in BUILTIN_PROMPTS:
        assert f"  {name}" in out and PROMPTS_ABOUT[name] in out
    assert str(packaged_trace_path()) in out and packaged_trace_path().is_file()
    assert packaged_trace().path == packaged_trace_path()
    assert "mooncake:FILE" in out and "agentx:FILE" in out and '{"prompt": "..."}' in out
    # what tap run's help promises exists, and every built-in set is in it
    assert all(f"{name}:" in PROMPTS_HELP for name in BUILTIN_PROMPTS)
    assert set(PROMPTS_ABOUT) == set(BUILTIN_PROMPTS)
    assert all(load_prompts(f"builtin:{name}") for name in BUILTIN_PROMPTS)


def test_capture_help_names_every_builtin_profile() -> None:
    import typing

    hints = typing.get_type_hints(capture, include_extras=True)
    help_text = hints["profile"].__metadata__[0].help
    assert all(name in help_text for name in BUILTIN_PROFILES)


@pytest.mark.parametrize(("spec", "prefix"), [
    (str(packaged_trace_path()), "mooncake:"), (str(AGENTX), "agentx:")])
def test_a_trace_without_its_prefix_suggests_it(spec: str, prefix: str) -> None:
    with pytest.raises(TrafficError) as info:
        resolve_profile(spec)
    assert f"pass {prefix}{spec}" in str(info.value) and "not valid JSON" not in str(info.value)
    assert resolve_profile(prefix + spec).requests  # and the suggestion works


def test_a_broken_saved_profile_keeps_its_own_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TrafficError, match="not valid JSON"):
        resolve_profile(str(bad))
    good = save_profile(builtin_profile("chat-short"), tmp_path / "p.json")
    assert resolve_profile(str(good)).name == "chat-short"


def test_cli_suggests_the_prefix_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "enginetap.cli.main", "traffic", "show",
                           str(packaged_trace_path())], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"Fix: pass mooncake:{packaged_trace_path()}" in done.stderr
