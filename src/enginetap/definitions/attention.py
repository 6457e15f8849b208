"""Grouped-query attention families: ``gqa_ragged_prefill`` and ``gqa_paged_decode``.

Shapes and input names follow FlashInfer's definitions (NHD layouts, ``*_indptr`` int32, lse in
base 2) so that flashinfer-bench reads our datasets as its own. This module also holds the
synthetic-layout helpers the other families share: variable lengths and paged KV tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from enginetap.definitions.base import Template, Tensor, const, dtype_param, var
from enginetap.errors import DefinitionError

if TYPE_CHECKING:
    import torch

    from enginetap.dataset.schema import Definition

__all__ = [
    "GQA_PAGED_DECODE", "GQA_RAGGED_PREFILL", "PAGED_CONTRACT", "PAGE_LIST", "indptr",
    "paged_axes",
    "paged_layout", "random_input",
    "split_lengths",
]


def random_input(definition: Definition, name: str, axes: Mapping[str, int],
                 gen: torch.Generator, device: str) -> torch.Tensor:
    """Standard-normal values for input ``name``, in its declared shape and dtype."""
    import torch

    spec = definition.inputs[name]
    shape = definition.shape_of(spec, dict(axes)) or ()
    return torch.randn(shape, generator=gen, device=device).to(getattr(torch, spec.dtype))


def split_lengths(total: int, parts: int, gen: torch.Generator, device: str,
                  minimum: int = 1) -> list[int]:
    """``parts`` random lengths, each ``>= minimum``, summing to ``total`` (uniform over splits).

    Raises:
        DefinitionError: ``parts < 1`` or ``total < parts * minimum``.
    """
    import torch

    extra = total - parts * minimum
    if parts < 1 or extra < 0:
        raise DefinitionError(
            f"cannot split {total} tokens into {parts} sequences", f"each needs at least {minimum}",
            "choose var axes with enough tokens (or pages) for every sequence")
    # Stars and bars: parts - 1 bars among extra + parts - 1 slots.
    slots = extra + parts - 1
    bars = sorted(torch.randperm(slots, generator=gen, device=device)[: parts - 1].tolist())
    edges = [-1, *bars, slots]
    return [edges[i + 1] - edges[i] - 1 + minimum for i in range(parts)]


def indptr(lengths: Sequence[int], device: str) -> torch.Tensor:
    """Exclusive prefix sums ``[0, l0, l0 + l1, ...]`` as int32."""
    import torch

    out = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    out[1:] = torch.tensor(list(lengths), dtype=torch.int32, device=device).cumsum(0)
    return out


def _check_batch(axes: Mapping[str, int]) -> int:
    batch = axes["batch_size"]
    if axes["len_indptr"] != batch + 1:
        raise DefinitionError(
            "inconsistent var axes", f"len_indptr={axes['len_indptr']} but batch_size={batch}",
            "set len_indptr = batch_size + 1")
    return batch


def paged_layout(axes: Mapping[str, int], page_size: int, gen: torch.Generator,
                 device: str) -> dict[str, torch.Tensor]:
    """Random page tables: ``kv_indptr``, ``kv_indices`` (distinct, shuffled), ``kv_last_page_len``.

    Reads the var axes ``batch_size``, ``len_indptr``, ``num_pages`` and ``num_kv_indices``;
    every request gets at least one page, except request 1 when there are 5 or more.

    Raises:
        DefinitionError: the axes do not describe a valid layout.
    """
    import torch

    batch, used, pages = _check_batch(axes), axes["num_kv_indices"], axes["num_pages"]
    if used > pages:
        raise DefinitionError(
            "inconsistent var axes", f"num_kv_indices={used} > num_pages={pages}",
            "give the cache at least as many pages as the requests use")
    if batch >= 5 and used >= batch - 1:
        # A request without pages (its kv_last_page_len is ignored), legal and easy to get wrong.
        per_request = split_lengths(used, batch - 1, gen, device)
        per_request.insert(1, 0)
    else:
        per_request = split_lengths(used, batch, gen, device)
    last = torch.randint(1, page_size + 1, (batch,), generator=gen, device=device)
    chosen = torch.randperm(pages, generator=gen, device=device)[:used]
    return {"kv_indptr": indptr(per_request, device), "kv_indices": chosen.to(torch.int32),
            "kv_last_page_len": last.to(torch.int32)}


def _ragged_axes(consts: Mapping[str, int], index: int) -> dict[str, int]:
    """Prefix-cached prefill, a one-token request, a fresh prefill, many small requests."""
    total_q, total_kv, requests = ((21, 45, 3), (1, 9, 1), (40, 40, 2), (7, 30, 5))[index % 4]
    return {"total_q": total_q, "total_kv": total_kv, "len_indptr": requests + 1}


def paged_axes(consts: Mapping[str, int], index: int) -> dict[str, int]:
    """Var axes of paged decode workloads: one request, many (one without pages), all
    pages in use."""
    batch, pages, used = ((3, 12, 7), (1, 4, 1), (6, 20, 13), (2, 9, 9))[index % 4]
    return {"batch_size": batch, "len_indptr": batch + 1, "num_pages": pages,
            "num_kv_indices": used}


def _generate_ragged(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
                     device: str) -> dict[str, Any]:
    batch, total_q, total_kv = axes["len_indptr"] - 1, axes["total_q"], axes["total_kv"]
    if total_kv < total_q:
        raise DefinitionError(
            "inconsistent var axes", f"total_kv={total_kv} < total_q={total_q}",
            "every request needs at least as many keys as queries (queries end its kv)")
    q_lens = split_lengths(total_q, batch, gen, device)
    # Some requests get a cached prefix: kv_len = q_len + prefix, prefix >= 0.
    prefixes = split_lengths(total_kv - total_q, batch, gen, device, minimum=0)
    head_dim = definition.const_axes["head_dim"]
    return {**{n: random_input(definition, n, axes, gen, device) for n in ("q", "k", "v")},
            "qo_indptr": indptr(q_lens, device),
            "kv_indptr": indptr([a + b for a, b in zip(q_lens, prefixes)], device),
            "sm_scale": head_dim ** -0.5}


def _generate_paged(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
                    device: str) -> dict[str, Any]:
    consts = definition.const_axes
    layout = paged_layout(axes, consts["page_size"], gen, device)
    names = ("q", "k_cache", "v_cache")
    tensors = {n: random_input(definition, n, axes, gen, device) for n in names}
    return {**tensors, **layout, "sm_scale": consts["head_dim"] ** -0.5}


_ROUNDING_NOTE = (
    "Rounding: float32 softmax and P @ V, the output rounded once. transformers' bf16 SDPA "
    "on CPU instead rounds exp(logits - row max) to bf16 before P @ V and divides by the "
    "float32 sum after (its stored bytes differ from this reference on a quarter to a third "
    "of elements, measured on qwen3_next), within the compare rule; no family names that "
    "scheme yet.")

PAGE_LIST = {"kv_indptr": Tensor(("len_indptr",), "int32", "page offsets per request"),
             "kv_indices": Tensor(("num_kv_indices",), "int32", "page ids, in token order"),
             "kv_last_page_len": Tensor(("batch_size",), "int32", "tokens in each last page")}
"""The inputs of a FlashInfer-style page list (``kv_indptr``, ``kv_indices``,
``kv_last_page_len``), as every paged family declares them."""
PAGED_CONTRACT = (" kv_last_page_len[b] is in 1..page_size for a request with pages; a request "
          "without pages (kv_indptr[b] == kv_indptr[b+1]) attends nothing: output 0, lse "
          "-inf, its kv_last_page_len ignored. A row's output depends only on the tokens it "
          "attends (values of keys it does not attend never reach it, even non-finite ones).")

_HEADS = {"num_qo_heads": const("query heads (per rank)"),
          "num_kv_heads": const("key/value heads (per rank)"),
          "head_dim": const("head size")}

GQA_RAGGED_PREFILL = Template(
    family="gqa_ragged_prefill",
    op_type="gqa_ragged",
    name="gqa_ragged_prefill_causal_h{num_qo_heads}_kv{num_kv_heads}_d{head_dim}_{dtype}",
    description=(
        "Causal GQA over packed requests; each request's queries are the last q_len positions "
        "of its kv (kv_len >= q_len, so prefix-cached prefill fits); query i of a request attends "
        "keys j <= i + kv_len - q_len, and later keys' values never reach it (even "
        "non-finite ones). lse = log2 sum exp(logits). "
        "vLLM CPU: CPUAttentionBackendImpl.forward (v1/attention/backends/cpu_attn.py): query -> "
        "q, attn_metadata.query_start_loc -> qo_indptr, seq_lens -> kv_indptr (prefix sums); k/v "
        "are each request's cached keys/values (the kernel packs its cache per ISA, so read them "
        "at do_kv_cache_update), self.scale -> sm_scale. transformers: the "
        "attention interface (eager/sdpa) with causal mask, one request per batch row. "
        "Neither engine returns lse: their workloads store output only, and the capture "
        "receipt and replay report say lse is not exposed by this engine. " +
        _ROUNDING_NOTE),
    axes={"total_q": var("query tokens of all requests"),
          "total_kv": var("key/value tokens of all requests"),
          "len_indptr": var("requests + 1"), **_HEADS},
    inputs={"q": Tensor(("total_q", "num_qo_heads", "head_dim"), "{dtype}"),
            "k": Tensor(("total_kv", "num_kv_heads", "head_dim"), "{dtype}"),
            "v": Tensor(("total_kv", "num_kv_heads", "head_dim"), "{dtype}"),
            "qo_indptr": Tensor(("len_indptr",), "int32", "query offsets per request"),
            "kv_indptr": Tensor(("len_indptr",), "int32", "key/value offsets per request"),
            "sm_scale": Tensor(None, "float32", "softmax scale, usually head_dim ** -0.5")},
    outputs={"output": Tensor(("total_q", "num_qo_heads", "head_dim"), "{dtype}"),
             "lse": Tensor(("total_q", "num_qo_heads"), "float32", "log-sum-exp, base 2")},
    reference="gqa_ragged_prefill.py",
    generate=_generate_ragged,
    **dtype_param(),
    constraints=("total_q <= total_kv", "num_qo_heads % num_kv_heads == 0"),
    engines=("transformers", "vllm"),
    example={"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 32},
    example_axes={"total_q": 21, "total_kv": 45, "len_indptr": 4},
    workload_axes=_ragged_axes,
)

GQA_PAGED_DECODE = Template(
    family="gqa_paged_decode",
    op_type="gqa_paged",
    name="gqa_paged_decode_h{num_qo_heads}_kv{num_kv_heads}_d{head_dim}_ps{page_size}_{dtype}",
    description=(
        "GQA decode (one query per request) over an NHD paged cache [num_pages, page_size, "
        "num_kv_heads, head_dim]; request b reads pages kv_indices[kv_indptr[b]:kv_indptr[b+1]], "
        "the last one holding kv_last_page_len[b] tokens. lse = log2 sum exp(logits)."
        + PAGED_CONTRACT + " vLLM CPU: "
        "CPUAttentionBackendImpl.forward on decode steps: block_table rows -> kv_indices, seq_lens "
        "-> kv_indptr / kv_last_page_len, block_size -> page_size, self.scale -> sm_scale; its "
        "cache is ISA-packed, so pages are rebuilt from the keys/values of do_kv_cache_update. "
        "transformers: generate_batch's paged attention (paged cache, one token per request). "
        "Neither engine returns lse: their workloads store output only, and the capture "
        "receipt and replay report say lse is not exposed by this engine. " +
        _ROUNDING_NOTE),
    axes={"batch_size": var("requests"), "len_indptr": var("requests + 1"),
          "num_pages": var("pages in the cache"), "num_kv_indices": var("pages in use"),
          "page_size": const("tokens per page"), **_HEADS},
    inputs={"q": Tensor(("batch_size", "num_qo_heads", "head_dim"), "{dtype}"),
            "k_cache": Tensor(("num_pages", "page_size", "num_kv_heads", "head_dim"), "{dtype}"),
            "v_cache": Tensor(("num_pages", "page_size", "num_kv_heads", "head_dim"), "{dtype}"),
            **PAGE_LIST,
            "sm_scale": Tensor(None, "float32", "softmax scale, usually head_dim ** -0.5")},
    outputs={"output": Tensor(("batch_size", "num_qo_heads", "head_dim"), "{dtype}"),
             "lse": Tensor(("batch_size", "num_qo_heads"), "float32", "log-sum-exp, base 2")},
    reference="gqa_paged_decode.py",
    generate=_generate_paged,
    **dtype_param(),
    constraints=("len_indptr == batch_size + 1", "num_qo_heads % num_kv_heads == 0"),
    engines=("transformers", "vllm"),
    example={"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 32, "page_size": 16},
    example_axes={"batch_size": 3, "len_indptr": 4, "num_pages": 12, "num_kv_indices": 7},
    workload_axes=paged_axes,
)
