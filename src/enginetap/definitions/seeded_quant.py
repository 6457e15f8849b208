"""Building blocks of the seed-only families' synthetic inputs: quantized tensors, sparse
slot lists and page tables.

This module imports torch; the family modules import it only inside their generators, so
listing the families stays free of torch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from enginetap.errors import DefinitionError

__all__ = [
    "FP8_E4M3_MAX", "e8m0_bytes", "fp4_bytes", "normal", "padded_rows", "page_rows",
    "quantize_fp8", "require", "spread",
]

FP8_E4M3_MAX = 448.0


def require(family: str, axes: Mapping[str, int], condition: bool, rule: str) -> None:
    """Refuse var axes that break a rule of the family.

    Raises:
        DefinitionError: ``condition`` is false.
    """
    if not condition:
        raise DefinitionError(f"cannot generate inputs for {family!r} with axes {dict(axes)}",
                              f"they break the rule {rule}", "pass var axes that satisfy it")


def normal(shape: tuple[int, ...], gen: torch.Generator, device: str,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device).to(dtype)


def spread(shape: tuple[int, ...], gen: torch.Generator, device: str) -> torch.Tensor:
    """Positive factors around 1 (log-normal), so rows differ in magnitude and in scale."""
    return torch.exp(0.5 * torch.randn(shape, generator=gen, device=device))


def quantize_fp8(x: torch.Tensor, blocks: int,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3fn codes of ``x [..., d]`` and float32 scales ``[..., blocks]``.

    Each block's scale is its absolute maximum over 448 times a random factor in [1, 2):
    codes never saturate and no two scales are alike.
    """
    shaped = x.reshape(*x.shape[:-1], blocks, -1)
    peak = shaped.abs().amax(dim=-1).clamp(min=1e-6)
    scale = peak / FP8_E4M3_MAX * (1 + torch.rand(peak.shape, generator=gen, device=x.device))
    codes = (shaped / scale[..., None]).to(torch.float8_e4m3fn)
    return codes.reshape(x.shape), scale.to(torch.float32)


def fp4_bytes(shape: tuple[int, ...], gen: torch.Generator, device: str) -> torch.Tensor:
    """Random bytes (int8), each two packed e2m1 codes: every code, signs included, occurs."""
    raw = torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.int16)
    return raw.to(torch.uint8).view(torch.int8)


def e8m0_bytes(shape: tuple[int, ...], gen: torch.Generator, device: str,
               low: int = -3, high: int = 1) -> torch.Tensor:
    """E8M0 scale bytes (held in int8) for powers of two from ``2**low`` to ``2**high``.

    Exponents above 0 give bytes above 127, which int8 holds as negative numbers: readers
    must take the byte as unsigned.
    """
    raw = torch.randint(127 + low, 128 + high, shape, generator=gen, device=device,
                        dtype=torch.int16)
    return raw.to(torch.uint8).view(torch.int8)


def padded_rows(lengths: list[int], width: int, population: int, gen: torch.Generator,
                device: str) -> torch.Tensor:
    """Rows of ``width`` int32 ids, row ``r`` holding ``lengths[r]`` distinct ids drawn from
    ``range(population)`` followed by ``-1`` padding.

    Raises:
        DefinitionError: a row wants more ids than ``population`` or ``width`` allow.
    """
    if max(lengths, default=0) > min(population, width):
        raise DefinitionError("cannot draw distinct ids",
                              f"rows want up to {max(lengths)} of {population} ids "
                              f"in {width} places",
                              "give more pages (or a smaller top-k)")
    order = torch.rand((len(lengths), population), generator=gen, device=device).argsort(dim=-1)
    rows = torch.full((len(lengths), width), -1, dtype=torch.int32, device=device)
    rows[:, :min(width, population)] = order[:, :width].to(torch.int32)
    wanted = torch.tensor(lengths, device=device, dtype=torch.long)
    keep = torch.arange(width, device=device)[None, :] < wanted[:, None]
    return torch.where(keep, rows, torch.full_like(rows, -1))


def page_rows(entries: list[int], page_size: int, max_pages: int, num_pages: int,
              gen: torch.Generator, device: str) -> torch.Tensor:
    """Page-table rows ``[len(entries), max_pages]`` (int32): distinct physical pages in a
    random order for the pages that each row's ``entries`` (tokens or blocks) fill, then
    ``-1``.

    Raises:
        DefinitionError: a row needs more pages than ``max_pages`` or ``num_pages``.
    """
    needed = [-(-e // page_size) for e in entries]
    return padded_rows(needed, max_pages, num_pages, gen, device)
