"""Rebuild prompts from hash blocks: deterministic token ids over an authored corpus.

Traces publish block hashes, never text. Each block is a window of our own corpus
(``corpus.txt`` beside this module: an invented coding-agent session) starting at an
offset drawn from ``sha256(seed, session, block id)``, so the same seed, session and block
id always give the same tokens, different ids almost always different ones, and a
prompt is exactly ``input_tokens`` long (its last block cut short where partial).

Token ids come from the model's tokenizer (the corpus encoded without special tokens) or,
for a model without one, from its vocabulary size alone: each corpus byte ``b`` maps to
``3 + b % (vocab_size - 3)``, leaving ids 0-2 (pad, BOS, EOS of the built-in models) out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import Any

from enginetap.errors import TrafficError
from enginetap.traffic.profile import CachePredecessor, RequestProfile

__all__ = ["PromptBuilder", "corpus_sha256", "corpus_text", "input_sha256"]

_RESERVED = 3  # ids 0, 1, 2: pad, BOS, EOS in the built-in models' vocabulary


def corpus_text() -> str:
    """The authored corpus the prompts are cut from."""
    return resources.files("enginetap.traffic").joinpath("corpus.txt").read_text(
        encoding="utf-8")


def corpus_sha256() -> str:
    """SHA-256 of the corpus bytes (provenance of every rebuilt prompt)."""
    return hashlib.sha256(corpus_text().encode("utf-8")).hexdigest()


def input_sha256(ids: Sequence[int]) -> str:
    """SHA-256 of a prompt's token ids (comma-separated decimal), as receipts record it."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def _stream_from_tokenizer(tokenizer: Any) -> list[int]:
    # Line by line: one long encode call trips the tokenizer's max-length warning.
    ids = [t for line in corpus_text().splitlines(keepends=True)
           for t in tokenizer.encode(line, add_special_tokens=False)]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return [t for t in ids if t not in special]


def _stream_from_vocab(vocab_size: int) -> list[int]:
    if vocab_size <= _RESERVED:
        raise TrafficError(f"cannot build prompts for a vocabulary of {vocab_size} ids",
                           f"ids 0..{_RESERVED - 1} are reserved for special tokens",
                           "pass the model's tokenizer or its real vocab_size")
    span = vocab_size - _RESERVED
    return [_RESERVED + b % span for b in corpus_text().encode("utf-8")]


class PromptBuilder:
    """Token ids for hash blocks: ``PromptBuilder(seed, tokenizer=tok)`` or ``vocab_size=``.

    Raises:
        TrafficError: neither a tokenizer nor a usable ``vocab_size`` is given, or the
            tokenizer gives ids outside ``vocab_size``.
    """

    def __init__(self, seed: int = 0, *, tokenizer: Any = None,
                 vocab_size: int | None = None) -> None:
        if tokenizer is None and vocab_size is None:
            raise TrafficError("cannot build prompts", "no tokenizer and no vocab_size given",
                               "pass the model's tokenizer or its vocab_size")
        self.seed = seed
        self.source = "tokenizer" if tokenizer is not None else f"vocab_size={vocab_size}"
        self.stream = (_stream_from_tokenizer(tokenizer) if tokenizer is not None
                       else _stream_from_vocab(int(vocab_size or 0)))
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stream):
            raise TrafficError("the tokenizer gives ids outside the model's vocabulary",
                               f"vocab_size is {vocab_size}", "pass the model's own tokenizer")

    def block(self, block_id: int, block_size: int, session: str | None = None) -> list[int]:
        """The ``block_size`` tokens of block ``block_id`` (in ``session``'s namespace)."""
        key = f"{self.seed}:{session or ''}:{block_id}".encode()
        start = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") % len(self.stream)
        n = len(self.stream)
        return [self.stream[(start + i) % n] for i in range(block_size)]

    def tokens(self, hash_ids: Sequence[int], input_tokens: int, block_size: int,
               session: str | None = None) -> list[int]:
        """The prompt of ``hash_ids``, exactly ``input_tokens`` long.

        Raises:
            TrafficError: the blocks do not tile ``input_tokens``.
        """
        if len(hash_ids) != -(-input_tokens // block_size):
            raise TrafficError("hash blocks do not tile the prompt",
                               f"{len(hash_ids)} blocks of {block_size} for {input_tokens} "
                               "tokens", "validate the profile before driving it")
        ids: list[int] = []
        for block_id in hash_ids:
            ids.extend(self.block(block_id, block_size, session))
        return ids[:input_tokens]

    def request(self, request: RequestProfile) -> list[int]:
        """The prompt of ``request``."""
        return self.tokens(request.hash_ids, request.input_tokens, request.block_size,
                           request.session)

    def predecessor(self, request: RequestProfile) -> list[int] | None:
        """The prompt of ``request``'s cache predecessor (None when it has none)."""
        pred: CachePredecessor | None = request.cache_predecessor
        if pred is None:
            return None
        return self.tokens(pred.hash_ids, pred.input_tokens, request.block_size,
                           request.session)

    def provenance(self) -> dict[str, Any]:
        """What a receipt records about how prompts were rebuilt."""
        return {"seed": self.seed, "corpus": "enginetap/traffic/corpus.txt",
                "corpus_sha256": corpus_sha256(), "token_source": self.source,
                "method": "hash block -> corpus window at sha256(seed:session:block) offset"}
