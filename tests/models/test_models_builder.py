"""Built-in tiny models: byte-identical builds, seeds, cache reuse, loading in transformers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from enginetap.errors import ConfigError, EnginetapError
from enginetap.models import MODEL_NAMES, build_model, default_model_dir, model_config
from enginetap.models.builder import MARKER

EXPECTED_FILES = {
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", MARKER,
}


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_same_name_and_seed_give_identical_bytes(name: str, tmp_path: Path) -> None:
    first = build_model(name, out_dir=tmp_path / "a", seed=3)
    second = build_model(name, out_dir=tmp_path / "b", seed=3)
    assert set(file_hashes(first)) == EXPECTED_FILES
    assert file_hashes(first) == file_hashes(second)
    config = json.loads((first / "config.json").read_text())
    assert config == model_config(name)


def test_golden_bytes_of_llama_seed0(tmp_path: Path) -> None:
    # Pinned on two machines (transformers 5.17 and 5.19): a change here must bump
    # BUILDER_VERSION, since cached folders elsewhere would no longer match a fresh build.
    hashes = file_hashes(build_model("llama", out_dir=tmp_path / "g", seed=0))
    assert hashes["model.safetensors"] == (
        "ec135f53d6936f1072bad92c1a8667e1daeb34b120d019736d0457c0e5d5bfdc")
    assert hashes["tokenizer.json"] == (
        "02bc3e3edf05c92f36fe29359b892a1f2ee82aeca063a15e488643076721466f")


def test_different_seed_gives_different_weights(tmp_path: Path) -> None:
    a = load_file(build_model("qwen3_moe", out_dir=tmp_path / "s0", seed=0) / "model.safetensors")
    b = load_file(build_model("qwen3_moe", out_dir=tmp_path / "s1", seed=1) / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == torch.bfloat16
        assert not torch.equal(a[key], b[key]), key


def test_no_weight_is_constant(tmp_path: Path) -> None:
    weights = load_file(build_model("qwen3_next", out_dir=tmp_path / "m") / "model.safetensors")
    for key, tensor in weights.items():
        assert tensor.float().std() > 0, key
    norm = weights["model.layers.0.linear_attn.norm.weight"].float()
    assert 0.9 < norm.mean() < 1.1  # the gated norm scales by its weight directly


def test_cache_is_reused_and_force_rebuilds(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINETAP_CACHE", str(tmp_path / "cache"))
    path = build_model("llama")
    assert path == default_model_dir("llama") and path.parent == tmp_path / "cache" / "models"
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns, weights.stat().st_ino
    assert build_model("llama") == path
    assert (weights.stat().st_mtime_ns, weights.stat().st_ino) == stamp
    build_model("llama", force=True)
    assert weights.stat().st_ino != stamp[1]
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".partial")]


def test_damaged_build_in_the_cache_is_rebuilt(tmp_path: Path, monkeypatch) -> None:
    # In enginetap's own cache a damaged build is repaired; in a folder the user chose
    # (--out) an edited file is the user's and is refused without --force
    # (tests/hostile/test_hostile_files_models.py).
    monkeypatch.setenv("ENGINETAP_CACHE", str(tmp_path))
    path = build_model("llama")
    good = file_hashes(path)
    (path / "tokenizer.json").write_text("{}")
    assert build_model("llama") == path
    assert file_hashes(path) == good


def test_unknown_name_lists_the_names(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        build_model("gpt5", out_dir=tmp_path / "m")
    for name in MODEL_NAMES:
        assert name in str(info.value)
    assert not (tmp_path / "m").exists()


def test_refuses_to_overwrite_foreign_or_other_model_folders(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(EnginetapError, match="not a folder enginetap built"):
        build_model("llama", out_dir=foreign, force=True)
    assert (foreign / "notes.txt").read_text() == "keep me"
    other = build_model("qwen3", out_dir=tmp_path / "other")
    with pytest.raises(EnginetapError, match="--force"):
        build_model("llama", out_dir=other)
    assert json.loads((build_model("llama", out_dir=other, force=True) / MARKER).read_text())[
        "name"] == "llama"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_loads_in_transformers_and_generates_varied_tokens(name: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_model(name)  # the shared default cache: built once across runs
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    batch = tokenizer(["the cache is split into blocks"], return_tensors="pt")
    assert batch.input_ids[0, 0].item() == 1
    assert tokenizer.decode(batch.input_ids[0], skip_special_tokens=True) == \
        "the cache is split into blocks"
    out = model.generate(**batch, max_new_tokens=8, do_sample=False)
    new = out[0, batch.input_ids.shape[1]:].tolist()
    assert len(new) == 8 and len(set(new)) > 1
