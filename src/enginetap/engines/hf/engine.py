"""HFEngine: a small in-process engine over a transformers model, with real steps.

Not a serving engine: one ``generate`` call runs its requests as one batch, a prefill
step (left-padded, every prompt at once) then one decode step per new token for the
requests still running. There are no mixed steps. Each step publishes a
:class:`~enginetap.core.context.Step` around the model forward, so capture and tap code
sees the same step context it sees inside vLLM. The row layout is documented in
:mod:`enginetap.engines.hf.batch`.

Greedy decoding of a request gives the tokens transformers' ``generate`` gives, and the
same tokens whatever it is batched with (up to bf16 rounding across batch shapes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from enginetap.config import ArmConfig
from enginetap.core.context import Mode, Step, device_wait, publish
from enginetap.engines.hf.arming import arm as arm_process
from enginetap.engines.hf.batch import (Plan, Sequence, fill_valid_lengths, plan_decode,
                                        plan_prefill, read_valid_lengths)
from enginetap.engines.hf.prefix import LayerKV, PrefixCache
from enginetap.engines.hf.requests import Completion, Request, prompt_ids_of
from enginetap.engines.hf.sampling import new_generator, pick
from enginetap.errors import ConfigError

__all__ = ["HFEngine"]

ENGINE = "transformers"
MODES = ("eager", "compile", "graphs")


def _load(model_dir: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"cannot load a model from {model_dir}", "no config.json there",
                          "pass a model folder, or build one with `enginetap models build`")
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot load a model from {model_dir}", str(exc),
                          "check that the folder holds a transformers causal LM") from exc
    has_tokenizer = any((model_dir / f).is_file()
                        for f in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir) if has_tokenizer else None
    return model.to(device).eval(), tokenizer


def _eos_ids(model: Any) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


class HFEngine:
    """Batched greedy / seeded generation over a transformers model, one step at a time.

    Armed by the same :class:`~enginetap.config.ArmConfig` as vLLM (``arm=``, or the
    process's ``ENGINETAP_*`` arming by default; see :mod:`enginetap.engines.hf.arming`).
    ``compile=True`` (or a torch.compile backend's name) compiles its decoder stack; an
    armed tap then records inside the graph (docs/tap.md, *Under torch.compile*).
    ``mode="graphs"`` (CUDA only) decodes by replaying CUDA graphs over a static KV
    cache (:mod:`enginetap.engines.hf.graphs`); ``mode="compile"`` is ``compile=True``.

    Raises:
        ConfigError: ``model_dir`` holds no loadable transformers model, or the arming
            config is invalid or conflicts with the process's arming, or ``mode`` is
            unknown, or graphs mode is asked for off CUDA or for a recurrent model.
    """

    def __init__(self, model_dir: str | Path, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.bfloat16, prefix_cache_size: int = 16,
                 arm: ArmConfig | None = None, compile: bool | str = False,
                 mode: str = "eager") -> None:
        # Arm before the model is built (patches on layer classes must precede it):
        # ``arm`` or, by default, the process's ENGINETAP_* arming.
        self.arming = arm_process(arm)
        self.model_dir = Path(model_dir)
        model, tokenizer = _load(self.model_dir, torch.device(device), dtype)
        self._setup(model, tokenizer, prefix_cache_size)
        self._set_mode(mode, compile)

    @classmethod
    def from_loaded(cls, model: Any, tokenizer: Any = None, *, prefix_cache_size: int = 16,
                    arm: ArmConfig | None = None, compile: bool | str = False,
                    mode: str = "eager") -> HFEngine:
        """An engine over a transformers causal LM already in memory (benchmarks build
        real-width random-weight models on the device this way). Arming happens here,
        after the model was built: capabilities patch classes, so that is equivalent.

        Raises:
            ConfigError: the arming config is invalid or conflicts with the process's.
        """
        engine = cls.__new__(cls)
        engine.arming = arm_process(arm)
        engine.model_dir = Path(str(getattr(model.config, "_name_or_path", "") or "."))
        engine._setup(model.eval(), tokenizer, prefix_cache_size)
        engine._set_mode(mode, compile)
        return engine

    def _setup(self, model: Any, tokenizer: Any, prefix_cache_size: int) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        if self.arming is not None:
            self.arming.hooks.model_loaded(self.model)
        config = self.model.config
        self.vocab_size: int = config.vocab_size
        self.max_positions: int = config.max_position_embeddings
        self.pad_id: int = config.pad_token_id if config.pad_token_id is not None else 0
        self.eos_ids = _eos_ids(self.model)
        self.recurrent = "linear_attention" in (getattr(config, "layer_types", None) or [])
        self.prefix_cache = PrefixCache(prefix_cache_size)
        self._reusable: bool | None = None  # known after the first prefill shows the cache
        self._steps = 0

    def _set_mode(self, mode: str, compile: bool | str) -> None:
        if mode not in MODES:
            raise ConfigError(f"unknown engine mode {mode!r}", f"modes are {', '.join(MODES)}",
                              "pass mode='eager', 'compile' or 'graphs'")
        if mode == "compile" and not compile:
            compile = True
        self.mode = "compile" if compile else mode
        self.compiled = compile
        self._graphs: Any = None
        if compile:
            self._compile("inductor" if compile is True else compile)
        elif mode == "graphs":
            self._use_graphs()

    def _use_graphs(self) -> None:
        """Decode by CUDA-graph replay (:mod:`enginetap.engines.hf.graphs`); an armed tap
        hashes its checkpoints inside the graphs (:mod:`enginetap.tap.record.compiled`)."""
        from enginetap.engines.hf.graphs import GraphDecoder

        if self.device.type != "cuda":
            raise ConfigError("graphs mode needs a CUDA device", f"the model is on "
                              f"{self.device}", "pass device='cuda', or mode='eager'")
        tap = self._compiled_tap("cuda graphs", self.model.get_output_embeddings())
        self._graphs = GraphDecoder(self.model, tap.capturing if tap is not None else None)
        self._reusable = False  # a static cache: no prefix reuse

    def _compiled_tap(self, how: str, head: Any = None) -> Any:
        """An armed tap's checkpoints moved into the compiled or captured decoder stack."""
        if self.arming is None:
            return None
        from enginetap.tap.record.arming import TapInstall
        from enginetap.tap.record.compiled import CompiledTap

        for installed in self.arming.installed:
            if isinstance(installed, TapInstall):
                return CompiledTap(installed, self.model.model, self.device, how).attach(head)
        return None

    def _compile(self, backend: str) -> None:
        """torch.compile the decoder stack's forward (the model's ``model``: embeddings,
        layers, final norm) in place with ``backend`` (``compile=True``: inductor; a
        backend's name, e.g. ``"aot_eager"``: the same kernels as eager), dynamic shapes
        from the start (one graph for every batch and length); the LM head and sampling
        stay eager. An armed tap moves its checkpoints into the compiled graph
        (:mod:`enginetap.tap.record.compiled`)."""
        decoder = getattr(self.model, "model", None)
        if not isinstance(decoder, torch.nn.Module):
            raise ConfigError("cannot compile", f"{type(self.model).__name__} has no "
                              "decoder stack at .model", "run it with compile=False")
        self._compiled_tap("torch.compile")
        decoder.compile(backend=backend, dynamic=True)

    @classmethod
    def from_builtin(cls, name: str, *, seed: int = 0, **kwargs: Any) -> HFEngine:
        """An engine over built-in model ``name`` (built into the cache if needed).

        Raises:
            ConfigError: ``name`` is not a built-in model.
        """
        from enginetap.models import build_model

        return cls(build_model(name, seed=seed), **kwargs)

    @property
    def steps(self) -> int:
        """Real steps run so far (prefill and decode)."""
        return self._steps

    @property
    def prefix_reuse(self) -> bool:
        """Whether this model's cache allows prefix reuse (False until the first prefill)."""
        return bool(self._reusable)

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Run ``requests`` as one batch; completions come back in request order.

        Raises:
            ConfigError: a request is invalid (see :func:`prompt_ids_of`) or two share an id.
        """
        seqs = self._sequences(requests)
        if not seqs:
            return []
        with torch.inference_mode():
            self._run(seqs)
        return [self._completion(s) for s in seqs]

    def _sequences(self, requests: list[Request]) -> list[Sequence]:
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ConfigError("bad requests", "two requests share a request_id",
                              "give every request of a call its own id")
        seqs = []
        for slot, request in enumerate(requests):
            prompt = prompt_ids_of(request, self.tokenizer, self.vocab_size, self.max_positions)
            sampled = request.temperature > 0
            seqs.append(Sequence(request, slot, prompt,
                                 new_generator(request.seed) if sampled else None))
        if self._reusable:
            for seq in seqs:
                seq.reused, seq.prefix_kv = self.prefix_cache.lookup(seq.prompt)
        return seqs

    def _run(self, seqs: list[Sequence]) -> None:
        reused = max(s.reused for s in seqs)
        capacity = reused + max(len(s.suffix) for s in seqs) + max(
            s.request.max_new_tokens for s in seqs)
        plan = plan_prefill(seqs, self.pad_id, capacity, self.recurrent, self.device)
        past = self._assemble_prefix(seqs, reused) if reused else None
        if self._graphs is not None:
            past = self._graphs.cache_for(len(seqs), capacity)
        alive, mask, cache = self._step("prefill", plan, past, seqs, reused)
        while alive:
            plan = plan_decode(alive, mask, capacity, self.recurrent)
            alive, mask, cache = self._step("decode", plan, cache, alive, reused)

    def _step(self, mode: Mode, plan: Plan, past: Any, seqs: list[Sequence],
              reused: int) -> tuple[list[Sequence], torch.Tensor, Any]:
        """One published step: the forward, then sampling (the step ends after it)."""
        columns = plan.input_ids.shape[1]
        padded, extra = plan.input_ids.numel(), {"input_shape": list(plan.input_ids.shape)}
        if self._graphs is not None and mode == "decode":
            padded = self._graphs.load(plan.input_ids, plan.attention_mask,
                                       plan.position_ids, self.pad_id)
            extra["cuda_graph"] = padded  # its padding rows run, never as requests
            self._graphs.ready(padded)
        valid = ready = None
        step = Step(ENGINE, self._steps, mode, plan.rows, padded_tokens=padded, extra=extra)
        with publish(step):
            logits, cache = self._forward(plan, past, extra.get("cuda_graph"))
            if self.arming is not None:  # valid lengths cost a read of the mask: armed only
                # (read once the forward is queued: on a GPU the reads queue behind it
                # rather than delay it; the forward does not write the mask)
                valid = read_valid_lengths(plan.attention_mask, columns)
                if valid.is_pinned():
                    ready = torch.cuda.Event()
                    ready.record()
            if mode == "prefill":
                self._remember_prompts(seqs, cache, reused, plan.input_ids.shape[1])
            if self.device.type == "cuda":  # sampling blocks for the forward: listeners'
                device_wait()              # host work (last step's records) overlaps it
            alive, mask = self._advance(seqs, logits[:, -1, :], cache, plan.attention_mask)
            step.sampled = {s.request.request_id: s.output[-1] for s in seqs}
            if valid is not None:  # sampling waited for the device: the copy is done
                fill_valid_lengths(plan.rows, valid, columns, ready)
        self._steps += 1
        return alive, mask, cache

    def _forward(self, plan: Plan, past: Any, graph: int | None) -> tuple[torch.Tensor, Any]:
        """The step's forward: last-column logits ``[batch, 1, V]`` and the cache."""
        if graph is not None:
            return self._graphs.decode(graph, plan.input_ids.shape[0])
        if self._graphs is not None:
            return self._graphs.prefill(plan.input_ids, plan.attention_mask,
                                        plan.position_ids)
        out = self.model(input_ids=plan.input_ids, attention_mask=plan.attention_mask,
                         position_ids=plan.position_ids, past_key_values=past,
                         use_cache=True, logits_to_keep=1)
        return out.logits, out.past_key_values

    def _advance(self, seqs: list[Sequence], logits: torch.Tensor, cache: Any,
                 mask: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """Append one token per request; drop finished requests from the cache and mask."""
        tokens = pick(logits, [s.request.temperature for s in seqs],
                      [s.request.top_p for s in seqs], [s.generator for s in seqs])
        for seq, token in zip(seqs, tokens):
            seq.output.append(token)
            if token in self.eos_ids:
                seq.finish = "stop"
            elif len(seq.output) >= seq.request.max_new_tokens:
                seq.finish = "length"
        keep = [i for i, s in enumerate(seqs) if s.finish is None]
        if keep and len(keep) < len(seqs):
            index = torch.tensor(keep, dtype=torch.long, device=mask.device)
            # reorder_cache selects batch rows in every layer kind, recurrent state included.
            cache.reorder_cache(index)
            mask = mask.index_select(0, index)
        return [seqs[i] for i in keep], mask

    def _remember_prompts(self, seqs: list[Sequence], cache: Any, reused: int,
                          width: int) -> None:
        from transformers.cache_utils import DynamicLayer

        if self._reusable is None:
            self._reusable = all(type(layer) is DynamicLayer for layer in cache.layers)
        if not self._reusable or self.prefix_cache.capacity == 0:
            return
        for b, seq in enumerate(seqs):
            columns = list(range(reused - seq.reused, reused)) + list(
                range(reused + width - len(seq.suffix), reused + width))
            index = torch.tensor(columns, dtype=torch.long, device=self.device)
            kv = [(layer.keys[b].index_select(1, index), layer.values[b].index_select(1, index))
                  for layer in cache.layers]
            self.prefix_cache.store(seq.prompt, kv)

    def _assemble_prefix(self, seqs: list[Sequence], reused: int) -> Any:
        """A batch cache holding each request's reused prefix, right-aligned at column P."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        donor: LayerKV = next(s.prefix_kv for s in seqs if s.prefix_kv is not None)
        for layer_index, layer in enumerate(cache.layers):
            k0, v0 = donor[layer_index]
            keys = k0.new_zeros((len(seqs), k0.shape[0], reused, k0.shape[2]))
            values = v0.new_zeros((len(seqs), v0.shape[0], reused, v0.shape[2]))
            for b, seq in enumerate(seqs):
                if seq.prefix_kv is not None and seq.reused:
                    k, v = seq.prefix_kv[layer_index]
                    keys[b, :, reused - seq.reused:] = k[:, :seq.reused]
                    values[b, :, reused - seq.reused:] = v[:, :seq.reused]
            layer.update(keys, values)
        return cache

    def _completion(self, seq: Sequence) -> Completion:
        text = (self.tokenizer.decode(seq.output, skip_special_tokens=True)
                if self.tokenizer is not None else "")
        return Completion(seq.request.request_id, seq.prompt, list(seq.output), text,
                          seq.finish or "length")
