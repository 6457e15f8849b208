"""The built-in models' tokenizer: a 512-token byte-level BPE trained on our own corpus.

Training is deterministic (the BPE trainer breaks count ties by the pair itself), so the
same corpus always gives the same ``tokenizer.json`` bytes; the builder checks the files
it writes by hash, and the tests build twice and compare.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["PAD", "BOS", "EOS", "corpus_texts", "corpus_digest", "write_tokenizer"]

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
# Ids 0, 1, 2: the trainer numbers special tokens first, in this order.
_SPECIALS = (PAD, BOS, EOS)


def corpus_texts() -> list[str]:
    """The training corpus, one text per file, in file-name order."""
    folder = resources.files("enginetap.models").joinpath("corpus")
    names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".txt"))
    return [folder.joinpath(n).read_text(encoding="utf-8") for n in names]


def corpus_digest() -> str:
    """SHA-256 over the corpus texts (part of the model cache key)."""
    h = hashlib.sha256()
    for text in corpus_texts():
        h.update(text.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def _train(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Prompts start with BOS like the large models these mimic; both engines then agree.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def _dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_tokenizer(folder: Path, vocab_size: int, max_length: int) -> None:
    """Train the tokenizer and write the files ``AutoTokenizer`` (fast) loads.

    Raises:
        RuntimeError: training did not give ``vocab_size`` tokens with the special ids
            0/1/2 (the corpus is too small for the vocabulary).
    """
    tok = _train(vocab_size)
    ids = [tok.token_to_id(t) for t in _SPECIALS]
    if tok.get_vocab_size() != vocab_size or ids != [0, 1, 2]:
        raise RuntimeError(
            f"tokenizer training gave {tok.get_vocab_size()} tokens, special ids {ids}; "
            f"expected {vocab_size} tokens and ids [0, 1, 2]"
        )
    (folder / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    _dump(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "model_max_length": max_length,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
    })
    _dump(folder / "special_tokens_map.json",
          {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
