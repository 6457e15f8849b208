"""Prompt rebuilding: deterministic per (seed, session, block), exact lengths, valid ids."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from enginetap.errors import TrafficError
from enginetap.traffic import PromptBuilder, RequestProfile, builtin_profile
from enginetap.traffic.prompts import corpus_sha256, input_sha256
from enginetap.traffic.scaling import all_requests


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from enginetap.models import build_model

    return AutoTokenizer.from_pretrained(build_model("llama"))


def _digest_of_builtin(seed: int) -> str:
    builder = PromptBuilder(seed, vocab_size=512)
    ids = [t for r in all_requests(builtin_profile("mooncake-tiny")) for t in builder.request(r)]
    return input_sha256(ids)


_OTHER_PROCESS = """
from enginetap.traffic import PromptBuilder, builtin_profile
from enginetap.traffic.prompts import input_sha256
from enginetap.traffic.scaling import all_requests
builder = PromptBuilder(3, vocab_size=512)
print(input_sha256([t for r in all_requests(builtin_profile("mooncake-tiny"))
                    for t in builder.request(r)]))
"""


def test_same_profile_gives_the_same_ids_in_another_process() -> None:
    # A fresh interpreter has a different str-hash seed: only sha256-based choices agree.
    other = subprocess.run([sys.executable, "-c", _OTHER_PROCESS], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": "12345", "PYTHONPATH":
                                            ":".join(sys.path)})
    assert other.stdout.strip() == _digest_of_builtin(3)
    assert _digest_of_builtin(3) != _digest_of_builtin(4)


def test_blocks_are_stable_distinct_and_namespaced_by_session() -> None:
    builder = PromptBuilder(0, vocab_size=512)
    again = PromptBuilder(0, vocab_size=512)
    blocks = [tuple(builder.block(i, 16)) for i in range(50)]
    assert blocks == [tuple(again.block(i, 16)) for i in range(50)]
    assert len(set(blocks)) == 50
    assert builder.block(3, 16, "s1") != builder.block(3, 16, "s2")
    assert builder.block(3, 16) != PromptBuilder(1, vocab_size=512).block(3, 16)


def test_prompts_have_exact_lengths_and_share_their_shared_blocks() -> None:
    builder = PromptBuilder(0, vocab_size=512)
    a = builder.tokens([0, 5, 6], 21, 8)
    b = builder.tokens([0, 5, 7, 8], 25, 8)
    assert (len(a), len(b)) == (21, 25)
    assert a[:16] == b[:16] and a[16:] != b[16:21]
    assert a[16:] == builder.block(6, 8)[:5]  # the partial last block is cut short
    with pytest.raises(TrafficError, match="do not tile"):
        builder.tokens([0, 1], 30, 8)


def test_vocab_only_ids_avoid_special_ids_and_stay_in_range() -> None:
    for vocab in (512, 100, 4):
        stream = PromptBuilder(0, vocab_size=vocab).stream
        assert min(stream) >= 3 and max(stream) < vocab
    with pytest.raises(TrafficError, match="vocabulary of 3 ids"):
        PromptBuilder(0, vocab_size=3)
    with pytest.raises(TrafficError, match="no tokenizer and no vocab_size"):
        PromptBuilder(0)


def test_tokenizer_ids_are_corpus_text_without_special_tokens(tokenizer) -> None:
    builder = PromptBuilder(0, tokenizer=tokenizer, vocab_size=512)
    assert not set(builder.stream) & set(tokenizer.all_special_ids)
    assert max(builder.stream) < 512
    request = RequestProfile(label="r", input_tokens=40, output_tokens=1,
                             hash_ids=[0, 1, 2], block_size=16)
    ids = builder.request(request)
    assert len(ids) == 40
    text = tokenizer.decode(ids)
    assert any(word in text for word in ("the", "cache", "tool", "Tool", "partition"))
    with pytest.raises(TrafficError, match="outside the model's vocabulary"):
        PromptBuilder(0, tokenizer=tokenizer, vocab_size=100)


def test_provenance_records_seed_and_corpus_hash() -> None:
    record = PromptBuilder(9, vocab_size=512).provenance()
    assert record["seed"] == 9 and record["corpus_sha256"] == corpus_sha256()
    assert len(corpus_sha256()) == 64
    json.dumps(record)


def test_golden_blocks_pin_the_rebuilding_method() -> None:
    # Changing the offset rule, the byte folding or the corpus changes every rebuilt
    # prompt (and so every captured workload's inputs): this pin makes that visible.
    builder = PromptBuilder(0, vocab_size=512)
    assert builder.block(0, 8) == [112, 114, 118, 119, 35, 114, 105, 35]
    assert builder.block(12345, 8, "s") == [118, 118, 49, 115, 124, 49, 35, 76]
