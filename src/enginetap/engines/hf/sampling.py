"""Next-token choice: greedy, or seeded top-p sampling with one generator per request."""

from __future__ import annotations

import torch

__all__ = ["new_generator", "pick"]


def new_generator(seed: int | None) -> torch.Generator:
    """A CPU generator: sampling runs on the CPU so a seed gives the same draw on any device."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def _sample(logits: torch.Tensor, temperature: float, top_p: float,
            gen: torch.Generator) -> int:
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest head whose mass reaches top_p (always at least one token).
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def pick(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
         generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``[rows, vocab]``.

    Rows with temperature 0 take the argmax; the others draw once from their generator.
    """
    greedy = torch.argmax(logits, dim=-1).tolist()
    return [
        greedy[i] if t == 0 or gen is None else _sample(logits[i], t, p, gen)
        for i, (t, p, gen) in enumerate(zip(temperatures, top_ps, generators))
    ]
