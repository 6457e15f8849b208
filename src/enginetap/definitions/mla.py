"""Multi-head latent attention families: ``mla_paged_decode`` and ``mla_paged_prefill``
(DeepSeek-V2/V3, absorbed form).

In the absorbed form the up-projections are folded into the query and the output, so every
head attends the shared latent cache: keys are ``[ckv, kpe]`` and values are ``ckv``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from enginetap.definitions.attention import (
    PAGE_LIST,
    PAGED_CONTRACT,
    indptr,
    paged_axes,
    paged_layout,
    random_input,
    split_lengths,
)
from enginetap.definitions.base import Template, Tensor, const, dtype_param, var

if TYPE_CHECKING:
    import torch

    from enginetap.dataset.schema import Definition

__all__ = ["MLA_PAGED_DECODE", "MLA_PAGED_PREFILL"]

_LATENT_CONSTS = {"num_qo_heads": const("query heads (per rank)"),
                  "head_dim_ckv": const("latent (kv_lora_rank) size"),
                  "head_dim_kpe": const("rope key size (qk_rope_head_dim)"),
                  "page_size": const("tokens per page")}
_LATENT_CACHE = {"ckv_cache": Tensor(("num_pages", "page_size", "head_dim_ckv"), "{dtype}"),
                 "kpe_cache": Tensor(("num_pages", "page_size", "head_dim_kpe"), "{dtype}")}


def _generate(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
              device: str) -> dict[str, Any]:
    consts = definition.const_axes
    layout = paged_layout(axes, consts["page_size"], gen, device)
    names = ("q_nope", "q_pe", "ckv_cache", "kpe_cache")
    tensors = {n: random_input(definition, n, axes, gen, device) for n in names}
    # Unit-variance logits for unit-variance inputs.
    scale = (consts["head_dim_ckv"] + consts["head_dim_kpe"]) ** -0.5
    return {**tensors, **layout, "sm_scale": scale}


MLA_PAGED_DECODE = Template(
    family="mla_paged_decode",
    op_type="mla_paged",
    name="mla_paged_decode_h{num_qo_heads}_ckv{head_dim_ckv}_kpe{head_dim_kpe}_ps{page_size}"
         "_{dtype}",
    description=(
        "Absorbed MLA decode (one query per request) over a paged latent cache: logits = "
        "sm_scale * (q_nope.ckv + q_pe.kpe), output = softmax(logits) @ ckv, lse in base 2. "
        "Request b reads pages kv_indices[kv_indptr[b]:kv_indptr[b+1]], the last one holding "
        "kv_last_page_len[b] tokens." + PAGED_CONTRACT + " vLLM CPU: CPUMLAImpl.forward_mqa "
        "(v1/attention/backends/mla/cpu_mla.py) -> ops.mla_decode_kvcache_cpu(out, q, kv_cache, "
        "scale, block_tables, seq_lens): q[..., :head_dim_ckv] -> q_nope, q[..., head_dim_ckv:] -> "
        "q_pe, kv_cache[..., :head_dim_ckv] -> ckv_cache, kv_cache[..., head_dim_ckv:] -> "
        "kpe_cache, block_tables rows -> kv_indices, seq_lens -> kv_indptr / kv_last_page_len, "
        "scale -> sm_scale, out -> output (lse: not exposed, so not stored). AMX machines run amx_mla.py's forward_mqa "
        "instead, same math. transformers runs MLA un-absorbed on a dense cache, not this form."),
    axes={"batch_size": var("requests"), "len_indptr": var("requests + 1"),
          "num_pages": var("pages in the cache"), "num_kv_indices": var("pages in use"),
          **_LATENT_CONSTS},
    inputs={"q_nope": Tensor(("batch_size", "num_qo_heads", "head_dim_ckv"), "{dtype}",
                             "query in latent space (W_UK absorbed)"),
            "q_pe": Tensor(("batch_size", "num_qo_heads", "head_dim_kpe"), "{dtype}",
                           "rotary part of the query"),
            **_LATENT_CACHE,
            **PAGE_LIST,
            "sm_scale": Tensor(None, "float32", "softmax scale of the un-absorbed head size")},
    outputs={"output": Tensor(("batch_size", "num_qo_heads", "head_dim_ckv"), "{dtype}",
                              "attention output in latent space (before W_UV)"),
             "lse": Tensor(("batch_size", "num_qo_heads"), "float32", "log-sum-exp, base 2")},
    reference="mla_paged_decode.py",
    generate=_generate,
    **dtype_param(),
    constraints=("len_indptr == batch_size + 1",),
    engines=("vllm",),
    example={"num_qo_heads": 4, "head_dim_ckv": 512, "head_dim_kpe": 64, "page_size": 16},
    example_axes={"batch_size": 3, "len_indptr": 4, "num_pages": 12, "num_kv_indices": 7},
    workload_axes=paged_axes,
)


def _generate_prefill(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
                      device: str) -> dict[str, Any]:
    """Random pages (every request has some), then ``total_q`` queries split so that each
    request gets 1..its token count (a cached prefix is what remains)."""
    import torch

    from enginetap.errors import DefinitionError

    consts, batch = definition.const_axes, axes["batch_size"]
    page_size = consts["page_size"]
    pages = split_lengths(axes["num_kv_indices"], batch, gen, device)
    last = torch.randint(1, page_size + 1, (batch,), generator=gen, device=device)
    lengths = [(p - 1) * page_size + int(n) for p, n in zip(pages, last.tolist())]
    queries, spare = [1] * batch, axes["total_q"] - batch
    if spare < 0 or spare > sum(lengths) - batch:
        raise DefinitionError("inconsistent var axes", f"total_q={axes['total_q']} for "
                              f"{batch} requests of {lengths} tokens",
                              "give each request 1..its token count of queries")
    for b in torch.randperm(batch, generator=gen, device=device).tolist():
        take = min(spare, lengths[b] - 1)
        queries[b], spare = queries[b] + take, spare - take
    chosen = torch.randperm(axes["num_pages"], generator=gen, device=device)
    names = ("q_nope", "q_pe", "ckv_cache", "kpe_cache")
    tensors = {n: random_input(definition, n, axes, gen, device) for n in names}
    scale = (consts["head_dim_ckv"] + consts["head_dim_kpe"]) ** -0.5
    return {**tensors, "qo_indptr": indptr(queries, device),
            "kv_indptr": indptr(pages, device),
            "kv_indices": chosen[:axes["num_kv_indices"]].to(torch.int32),
            "kv_last_page_len": last.to(torch.int32), "sm_scale": scale}


def _prefill_axes(consts: Mapping[str, int], index: int) -> dict[str, int]:
    """A long prefill with a cached prefix, several short ones, one request of one token;
    enough pages for the queries at any page size (prefixes are what the pages hold
    beyond them)."""
    batch, total_q, prefix = ((2, 40, 30), (4, 9, 20), (1, 1, 0), (3, 100, 5))[index % 4]
    used = batch + -(-(total_q + prefix) // consts["page_size"])
    return {"batch_size": batch, "len_indptr": batch + 1, "total_q": total_q,
            "num_pages": used + 3, "num_kv_indices": used}


MLA_PAGED_PREFILL = Template(
    family="mla_paged_prefill",
    op_type="mla_paged",
    name="mla_paged_prefill_causal_h{num_qo_heads}_ckv{head_dim_ckv}_kpe{head_dim_kpe}"
         "_ps{page_size}_{dtype}",
    description=(
        "Absorbed MLA prefill (causal, prefix-aware) over a paged latent cache: logits = "
        "sm_scale * (q_nope.ckv + q_pe.kpe), output = softmax(logits) @ ckv, lse in base 2. "
        "Request b owns n = qo_indptr[b+1] - qo_indptr[b] query rows and P pages "
        "kv_indices[kv_indptr[b]:kv_indptr[b+1]], all full but the last, which holds "
        "kv_last_page_len[b] tokens: its L = (P - 1) * page_size + kv_last_page_len[b] "
        "tokens are its cached prefix followed by its n new tokens. Its n queries are its "
        "last n tokens: query i (0-based) attends tokens 0 .. L - n + i, so every query "
        "attends at least one token; its output depends on those tokens only (latents of "
        "later tokens never reach it, even non-finite ones). Valid input: a request with "
        "queries has pages, kv_last_page_len[b] in 1..page_size and n <= L (anything else "
        "is refused, not guessed at); a request with no queries (n = 0, pages or not) "
        "produces no rows and its pages and kv_last_page_len are not read. lse is the "
        "base-2 log-sum-exp of each query row's logits; vLLM's kernel does not return it, "
        "so workloads captured from vLLM store output only and replay reports lse as not "
        "exposed by this engine. vLLM CPU on AMX machines: "
        "AMXMLAImpl.forward_mha (v1/attention/backends/mla/amx_mla.py) absorbs W_UK into "
        "the query and calls ops.cpu_mla_extend(q_extend, k_extend, v_extend, o_extend, "
        "k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, extend_seq_lens, "
        "extend_start_loc, ...): q_extend[..., :head_dim_ckv] -> q_nope, the rest -> q_pe; "
        "each request's cached prefix (k_buffer rows at req_to_token) followed by its new "
        "tokens (k_extend) -> pages of ckv_cache / kpe_cache; o_extend -> output (lse: not "
        "exposed). "
        "W_UV is applied after, outside this op."),
    axes={"batch_size": var("requests"), "len_indptr": var("requests + 1"),
          "total_q": var("query tokens of all requests"),
          "num_pages": var("pages in the cache"), "num_kv_indices": var("pages in use"),
          **_LATENT_CONSTS},
    inputs={"q_nope": Tensor(("total_q", "num_qo_heads", "head_dim_ckv"), "{dtype}",
                             "query in latent space (W_UK absorbed)"),
            "q_pe": Tensor(("total_q", "num_qo_heads", "head_dim_kpe"), "{dtype}",
                           "rotary part of the query"),
            **_LATENT_CACHE,
            "qo_indptr": Tensor(("len_indptr",), "int32", "query row offsets per request"),
            **PAGE_LIST,
            "sm_scale": Tensor(None, "float32", "softmax scale of the un-absorbed head size")},
    outputs={"output": Tensor(("total_q", "num_qo_heads", "head_dim_ckv"), "{dtype}",
                              "attention output in latent space (before W_UV)"),
             "lse": Tensor(("total_q", "num_qo_heads"), "float32", "log-sum-exp, base 2")},
    reference="mla_paged_prefill.py",
    generate=_generate_prefill,
    **dtype_param(),
    constraints=("len_indptr == batch_size + 1",),
    engines=("vllm",),
    example={"num_qo_heads": 4, "head_dim_ckv": 512, "head_dim_kpe": 64, "page_size": 16},
    example_axes={"batch_size": 2, "len_indptr": 3, "total_q": 40, "num_pages": 10,
                  "num_kv_indices": 6},
    workload_axes=_prefill_axes,
)
