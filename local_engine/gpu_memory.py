"""How much of one GPU each embedded engine takes: estimates from the model's config and
the split into vLLM's ``gpu_memory_utilization`` per engine (pure functions).

vLLM's accounting (``vllm.v1.worker.gpu_worker.Worker.determine_available_memory``,
0.32): an engine may use ``gpu_memory_utilization x total`` bytes of the GPU; after
loading the weights it profiles one forward pass of ``max_num_batched_tokens`` tokens
("Memory profiling takes ... weights memory ...") and gives the rest of its share to the
KV cache ("Available KV cache memory: N GiB"). At start it refuses a share larger than
the memory then free, so a second engine at vLLM's default share (0.92) cannot start.

Estimate of one engine (:func:`estimate`), in bytes:

* **weights** -- parameters x dtype bytes, the parameters counted from ``config.json``
  for decoder-only transformers (embeddings, attention with grouped KV heads, a gated
  MLP, mixture-of-experts counted per expert; :meth:`ModelShape.parameters`);
* **KV cache** -- ``num_layers x 2 x num_kv_heads x head_dim x dtype bytes`` per token
  (vLLM's full-attention page size per token) x the tokens the plan gives the engine:
  ``max_model_len`` for each request the proxy sends at once (``--max-concurrency``);
* **activation margin** -- the profiled forward pass (a step's tokens x the widest
  activations: hidden states and the gated MLP's ``2 x intermediate`` output) plus the
  sampler's float32 logits for ``max_num_seqs`` rows, plus a fixed allowance for what
  torch does not count (the CUDA context, cuBLAS workspaces, CUDA graphs).

:func:`split` turns the estimates into shares that sum under 1 with headroom kept for
the other engines' CUDA contexts; :func:`check_kv` compares the plan with the KV cache
vLLM reports it allocated once the engine has started.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowlift.errors import ConfigError

MiB = 1 << 20
GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
NON_TORCH_BYTES = 1 * GiB  # CUDA context, cuBLAS/NCCL workspaces, not seen by torch
CUDA_GRAPH_BYTES = 1 * GiB  # vLLM's captured graphs (0.5-1 GiB reported for 7-8B models)
CONTEXT_BYTES = 640 * MiB  # another process's CUDA context on the same GPU
HEADROOM_FRACTION = 0.04  # of the GPU, never handed out (driver, fragmentation)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes of a decoder-only transformer that memory depends on (``config.json``).

    Attributes:
        num_layers: ``num_hidden_layers``.
        hidden_size: ``hidden_size``.
        num_attention_heads: query heads.
        num_kv_heads: key/value heads (``num_key_value_heads``; grouped-query attention).
        head_dim: ``head_dim``, else ``hidden_size / num_attention_heads``.
        intermediate_size: the MLP's inner width (per expert for mixture-of-experts).
        vocab_size: ``vocab_size``.
        tie_word_embeddings: the output layer shares the embedding matrix.
        num_experts: MLP experts per layer (1: a dense model).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    num_experts: int = 1

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """Read a ``config.json`` (a multimodal model's ``text_config`` when present).

        Raises:
            ConfigError: a size is missing (``param`` names the key).
        """
        c = dict(config.get("text_config") or config)

        def need(*keys: str) -> int:
            for key in keys:
                if isinstance(c.get(key), int):
                    return int(c[key])
            raise ConfigError(f"the model's config.json has no {keys[0]}: cannot size it",
                              param=keys[0])

        heads = need("num_attention_heads", "n_head")
        hidden = need("hidden_size", "n_embd")
        return cls(
            num_layers=need("num_hidden_layers", "n_layer"), hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads),
            intermediate_size=int(c.get("moe_intermediate_size")
                                  or c.get("intermediate_size") or 4 * hidden),
            vocab_size=need("vocab_size"),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            num_experts=int(c.get("num_local_experts") or c.get("num_experts") or 1))

    def parameters(self) -> int:
        """Parameters: embeddings (twice unless tied), per layer the q/k/v/o projections
        (k and v over ``num_kv_heads``), a gated MLP (gate, up, down) per expert and two
        norms, and the final norm."""
        h, d = self.hidden_size, self.head_dim
        attention = h * d * (2 * self.num_attention_heads + 2 * self.num_kv_heads)
        mlp = 3 * h * self.intermediate_size * self.num_experts
        router = h * self.num_experts if self.num_experts > 1 else 0
        layer = attention + mlp + router + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embeddings + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes per token: layers x 2 (K and V) x KV heads x head dim x bytes."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes


def model_parameters(model_dir: str | Path) -> int | None:
    """The parameter count of the checkpoint in ``model_dir`` (:meth:`ModelShape.parameters`
    over its ``config.json``), or None when there is none or it lacks a size."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        return ModelShape.from_config(config).parameters()
    except (OSError, ValueError, ConfigError, AttributeError):
        return None


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """One engine's GPU memory, in bytes (see the module docstring).

    Attributes:
        weights: parameters x dtype bytes.
        kv_cache: KV bytes per token x ``kv_tokens``.
        activations: the profiled step's peak, the sampler's logits and the non-torch
            allowance.
        kv_tokens: the tokens of KV cache planned.
        kv_bytes_per_token: from :meth:`ModelShape.kv_bytes_per_token`.
    """

    weights: int
    kv_cache: int
    activations: int
    kv_tokens: int
    kv_bytes_per_token: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a float dtype name.

    Raises:
        ConfigError: not one of float32, bfloat16, float16 (``param="--dtype"``).
    """
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"cannot size a {dtype!r} model: use float32, bfloat16 or "
                          "float16", param="--dtype")
    return DTYPE_BYTES[dtype]


def estimate(shape: ModelShape, dtype: str, *, max_model_len: int, concurrency: int,
             max_num_seqs: int, max_num_batched_tokens: int,
             cuda_graphs: bool = True) -> MemoryEstimate:
    """One engine's memory on a GPU (see the module docstring for each part).

    Args:
        shape: the model's sizes.
        dtype: weights, activations and KV cache dtype.
        max_model_len: context in tokens.
        concurrency: requests the proxy sends the engine at once; the KV cache is
            planned for that many full contexts (at least one: vLLM refuses less).
        max_num_seqs: rows of the sampler's logits.
        max_num_batched_tokens: tokens of the profiled step.
        cuda_graphs: graphs captured (their memory counts).
    """
    width = dtype_bytes(dtype)
    per_token = shape.kv_bytes_per_token(width)
    tokens = max_model_len * max(1, concurrency)
    forward = max_num_batched_tokens * (4 * shape.hidden_size + 2 * shape.intermediate_size) * width
    logits = max_num_seqs * shape.vocab_size * 4 * 2  # float32 logits and probabilities
    fixed = NON_TORCH_BYTES + (CUDA_GRAPH_BYTES if cuda_graphs else 0)
    return MemoryEstimate(weights=shape.parameters() * width, kv_cache=per_token * tokens,
                          activations=forward + logits + fixed, kv_tokens=tokens,
                          kv_bytes_per_token=per_token)


def headroom_bytes(total_bytes: int, engines: int) -> int:
    """GPU memory never handed out: a share of the GPU plus one CUDA context per engine
    (each engine's own context exists before vLLM checks the memory free, and a
    sleeping engine keeps its context)."""
    return int(total_bytes * HEADROOM_FRACTION) + engines * CONTEXT_BYTES


def split(total_bytes: int, needs: Mapping[str, int], *,
          budget_bytes: int | None = None) -> dict[str, float]:
    """Each engine's ``gpu_memory_utilization``.

    * No budget (every engine loaded at once): the memory left after the headroom is
      shared in proportion to the needs, so the shares sum to ``1 - headroom/total``
      and each engine's KV cache grows with its share of the spare memory.
    * With a residency budget (``--memory-budget-mb``; the residency manager keeps the
      loaded engines' needs within it): each engine gets exactly its need, so any set
      the manager loads together fits.

    Args:
        total_bytes: the GPU's memory.
        needs: engine -> :attr:`MemoryEstimate.total`.
        budget_bytes: the residency budget, None without one.

    Returns:
        engine -> share of ``total_bytes`` (rounded down to 1e-4).

    Raises:
        ConfigError: the engines do not fit the GPU together (no budget), the budget is
            larger than the GPU minus the headroom, or one engine alone does not fit.
    """
    usable = total_bytes - headroom_bytes(total_bytes, len(needs))
    if budget_bytes is not None and budget_bytes > usable:
        raise ConfigError(
            f"--memory-budget-mb is {gib(budget_bytes)} but the GPU has {gib(usable)} for "
            f"{len(needs)} engine(s) after headroom: lower it", param="--memory-budget-mb")
    too_big = {m: n for m, n in needs.items() if n > usable}
    if too_big:
        name, need = next(iter(too_big.items()))
        raise ConfigError(f"model {name} needs ~{gib(need)} of GPU memory; {gib(usable)} "
                          "is usable: lower --max-model-len or --max-concurrency",
                          param="--max-model-len")
    wanted = sum(needs.values())
    if budget_bytes is None and wanted > usable:
        raise ConfigError(
            f"the models need ~{gib(wanted)} of GPU memory together; {gib(usable)} is "
            "usable: give --memory-budget-mb to load them in turn, or lower "
            "--max-model-len or --max-concurrency", param="--memory-budget-mb")
    scale = 1.0 if budget_bytes is not None else usable / wanted
    return {m: math.floor(n * scale / total_bytes * 1e4) / 1e4 for m, n in needs.items()}


def gib(nbytes: float) -> str:
    """``nbytes`` as GiB for a message: ``"12.3 GiB"``."""
    return f"{nbytes / GiB:.1f} GiB"


@dataclass(frozen=True, slots=True)
class KvCheck:
    """The plan's KV cache against what vLLM allocated.

    Attributes:
        planned_tokens: tokens the plan sized the engine for.
        vllm_tokens: ``num_gpu_blocks x block_size`` as the engine reports them.
        ratio: ``vllm_tokens / planned_tokens``.
        ok: vLLM holds at least 75% of the plan (the estimate is within 25%, or high).
        message: one line for the log.
    """

    planned_tokens: int
    vllm_tokens: int
    ratio: float
    ok: bool
    message: str


def check_kv(planned_tokens: int, num_gpu_blocks: int, block_size: int) -> KvCheck:
    """Compare the plan with vLLM's own figure (``cache_config.num_gpu_blocks``, set
    from the engine core's profiling: "Available KV cache memory" / block bytes).

    A ratio under 0.75 means the estimate left vLLM less KV cache than planned (the
    weights or activations took more than estimated): requests will queue or be
    preempted earlier than the plan assumed.
    """
    got = num_gpu_blocks * block_size
    ratio = got / planned_tokens if planned_tokens else math.inf
    ok = ratio >= 0.75
    verdict = "as planned" if ok else "LESS than planned: the memory estimate is low"
    return KvCheck(planned_tokens, got, ratio, ok,
                   f"vLLM's KV cache holds {got} tokens for {planned_tokens} planned "
                   f"({ratio:.2f}x, {verdict})")
