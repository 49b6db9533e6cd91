"""Model FLOPs of the learner's work and the device's peak rate: what a step's
``learner_flops_per_s`` and ``learner_mfu`` are made of (ppo_ray.stats.StepResult.rates), and the
counts benchmarks/flops.py and benchmarks/gpu_step.py report (they import them from here:
one copy of the rules).

    shape = decoder_shape(model.config)     # None: not a decoder these rules count
    flops = update_flops(shape, prompt_lens, response_lens, ppo_epochs=4, lora_r=16,
                         lora_targets=ALL, value_model="separate", values_in_update=False,
                         recomputed=True)   # {"learner_forward": ..., "update": ...}
    peak = device_peak_flops(device, "bfloat16")   # FLOP/s; NaN where unknown

The rules (model FLOPs: the work the model needs, not what the kernels did):

    forward of n = p + r tokens   2 N n (N: the decoder's matmul parameters)
                                  + LoRA 2 r (in + out) n per adapted projection
                                  + causal attention 2 (heads x head_dim) n (n + 1) per layer
                                  + lm_head 2 H V per position whose logits are used
    backward                      the base weights are frozen, so only input gradients: 1x
                                  the forward's base and lm_head matmuls, 2x its LoRA
                                  matmuls (input and A/B gradients), 2x its attention
                                  matmuls (dQ, dK, dV, dP)

Real tokens only (prompt and response of every row; padding is waste, not work).
Recomputation (gradient checkpointing), norms, activations, the value head (H -> 1), the
sampler and the logprob math are not counted. The layer is a Llama-style decoder (separate
q, k, v, o projections, a gated MLP of gate, up and down projections): DECODER_TYPES are the
Hugging Face model types known to be one; another model's shape is None and its FLOPs NaN,
rather than a count of another architecture.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size")
# Hugging Face model types whose decoder layer these rules count (q/k/v/o + gated MLP).
DECODER_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def _shape(cfg: Mapping[str, Any]) -> dict[str, int]:
    """The shape fields of a decoder config's dict (head_dim defaults to hidden_size /
    num_attention_heads, num_key_value_heads to num_attention_heads); KeyError for a missing one."""
    cfg = dict(cfg)
    if not cfg.get("num_key_value_heads"):
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    if not cfg.get("head_dim"):
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    return {k: int(cfg[k]) for k in SHAPE_KEYS}


def model_shape(model_dir: str | os.PathLike) -> dict[str, int]:
    """The shape fields of a Hugging Face decoder's config.json (head_dim defaults to
    hidden_size / num_attention_heads, num_key_value_heads to num_attention_heads)."""
    return _shape(json.loads((Path(model_dir) / "config.json").read_text()))


def decoder_shape(config: Any) -> Optional[dict[str, int]]:
    """The shape of a loaded model's config (a transformers PretrainedConfig or its dict), or
    None where these rules do not count it: a model type outside DECODER_TYPES or a shape
    field missing."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if cfg.get("model_type") not in DECODER_TYPES:
        return None
    try:
        return _shape(cfg)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def _counts(shape: dict, prompt_lens: Sequence[int], response_lens: Sequence[int], lora_r: int,
            lora_targets: Sequence[str]) -> tuple[float, float, float, float]:
    """(base matmuls, LoRA, causal attention, lm_head at the response positions): one
    forward's FLOPs of the rows through a model of `shape` (the module docstring's rules)."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    proj = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    n_mat = layers * sum(i * o for i, o in proj.values())
    lora = layers * sum(2 * lora_r * (proj[t][0] + proj[t][1]) for t in lora_targets if t in proj)
    tokens = sum(p + r for p, r in zip(prompt_lens, response_lens))
    attn = layers * sum(2 * q * (p + r) * (p + r + 1) for p, r in zip(prompt_lens, response_lens))
    head = 2 * h * shape["vocab_size"] * sum(response_lens)
    return float(2 * n_mat * tokens), float(lora * tokens), float(attn), float(head)


def forward_flops(shape: dict, prompt_lens: Sequence[int], response_lens: Sequence[int], *, lora_r: int = 0,
                  lora_targets: Sequence[str] = (), logits: bool = True) -> float:
    """One forward of the rows (prompt p, response r tokens each) through a model of `shape`:
    base matmuls, LoRA, causal attention, and the lm_head at the response positions when
    `logits`."""
    base, lora, attn, head = _counts(shape, prompt_lens, response_lens, lora_r, lora_targets)
    return base + lora + attn + (head if logits else 0.0)


def learner_flops(shape: dict, prompt_lens: Sequence[int], response_lens: Sequence[int], ppo_epochs: int,
                  lora_r: int, lora_targets: Sequence[str], models: int = 2,
                  value_pass: bool = True, value_shape: Optional[dict] = None) -> dict[str, float]:
    """Model FLOPs of Learner.update on REAL tokens (padding counts as waste, not work), for
    the policy (`shape`) and, with `models` 2, a separate value model (`value_shape`, default
    the policy's; 1 model for ``value_model: shared`` or an estimator without a critic):
      forward     per model the base matmuls, LoRA and attention; the policy's lm_head on the
                  response positions (the value head, H -> 1, is left out: < 1e-5)
      backward    the base weights are frozen, so only input gradients: 1x the forward's base
                  and lm_head matmuls, 2x its LoRA matmuls (input and A/B gradients), 2x its
                  attention matmuls (dQ, dK, dV, dP); recomputation (checkpointing) not counted
    learner_forward = one forward of the models (the no-grad pass; value_pass=False: the
    policy's alone, a separate value model's old values coming from the update's first
    forward, Learner.values_in_update), update = ppo_epochs x (forward + backward).
    matmul_parameters: the policy's N; real_tokens: prompt + response tokens of the rows."""
    base, lora, attn, head = _counts(shape, prompt_lens, response_lens, lora_r, lora_targets)
    vbase, vlora, vattn, _ = (_counts(value_shape, prompt_lens, response_lens, lora_r, lora_targets)
                              if value_shape is not None else (base, lora, attn, head))
    value = models == 2
    policy_forward = base + lora + attn + head
    forward = policy_forward + (vbase + vlora + vattn if value else 0.0)
    no_grad = forward if value_pass or not value else policy_forward
    backward = base + 2 * lora + 2 * attn + head + (vbase + 2 * vlora + 2 * vattn if value else 0.0)
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    n_mat = layers * (h * q + 2 * h * kv + q * h + 3 * h * inter)
    return {"learner_forward": float(no_grad), "update": float(ppo_epochs * (forward + backward)),
            "matmul_parameters": float(n_mat), "real_tokens": float(sum(p + r for p, r in zip(prompt_lens,
                                                                                               response_lens)))}


VALUE_MODELS = ("none", "shared", "separate")


def update_flops(shape: dict, prompt_lens: Sequence[int], response_lens: Sequence[int], *, ppo_epochs: int,
                 lora_r: int, lora_targets: Sequence[str], value_model: str, values_in_update: bool,
                 recomputed: bool, value_shape: Optional[dict] = None) -> dict[str, float]:
    """{"learner_forward", "update"}: model FLOPs of one Learner.update as it ran.
    value_model: "none" (an estimator without a critic), "shared" (a head on the policy's
    trunk) or "separate" (its own backbone, of `value_shape`, default the policy's).
    values_in_update: the old values came from the PPO epochs' first value forward
    (Learner.values_in_update), so the no-grad pass ran no value model. recomputed: the
    policy's no-grad pass ran (Learner.recomputes_old_logprobs); without it (the generator's
    old logprobs) the pass ran the value model's trunk alone (no lm_head), or nothing."""
    if value_model not in VALUE_MODELS:
        raise ValueError(f"value_model {value_model!r}: one of {VALUE_MODELS}")
    separate = value_model == "separate"
    value_pass = not (separate and values_in_update)
    counts = learner_flops(shape, prompt_lens, response_lens, ppo_epochs, lora_r, lora_targets,
                           models=2 if separate else 1, value_pass=value_pass, value_shape=value_shape)
    if recomputed:
        no_grad = counts["learner_forward"]
    elif value_model == "none" or not value_pass:
        no_grad = 0.0
    else:  # the value model's trunk: the separate model's own, or the policy's (shared)
        trunk_shape = value_shape if separate and value_shape is not None else shape
        no_grad = sum(_counts(trunk_shape, prompt_lens, response_lens, lora_r, lora_targets)[:3])
    return {"learner_forward": float(no_grad), "update": counts["update"]}


# ----------------------------------------------------------------------------- the peak
# Dense (no sparsity) matrix rates per GPU, FLOP/s, by dtype, from NVIDIA's datasheets: H100
# SXM 989.4 TFLOP/s bf16/fp16 (1,979 with 2:4 sparsity), 67 fp32 (non-tensor: torch's float32
# matmuls unless TF32 is allowed); the H200 is the same GH100 chip at the same clocks. H100
# PCIe 756 / 51, the NVL cards (H100 NVL, H200 NVL) 835 / 60. A100 (SXM and PCIe) 312 / 19.5.
# A large bf16 matmul reaches ~790 TFLOP/s on an H100/H200 (benchmarks/RESULTS.md), so 100%
# MFU is out of reach by construction. The first key found in the device's name
# wins, so the specific names come before "H100".
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bfloat16": 756e12, "float16": 756e12, "float32": 51e12},
    "H100 NVL": {"bfloat16": 835e12, "float16": 835e12, "float32": 60e12},
    "H200 NVL": {"bfloat16": 835e12, "float16": 835e12, "float32": 60e12},
    "H100": {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 67e12},
    "H200": {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
}


def peak_flops(gpu_name: str, dtype: str = "bfloat16") -> Optional[float]:
    """The GPU's dense matrix rate in `dtype` (PEAK_FLOPS), None for a card not listed."""
    for key, rates in PEAK_FLOPS.items():
        if key in gpu_name:
            return rates.get(dtype)
    return None


def gemm_rate(n: int = 2048, dtype: str = "float32", device: str = "cpu", threads: Optional[int] = None,
              repeats: int = 5) -> dict:
    """The best of `repeats` timings of an n x n x n matmul (2 n^3 FLOPs) after one warm-up,
    with `threads` torch threads (default: every CPU this process may run on; restored
    after). Returns {"flops_per_s", "n", "dtype", "device", "threads", "seconds"}."""
    import torch

    threads = threads or len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(n, n, generator=gen, device=device, dtype=getattr(torch, dtype))
        b = torch.randn(n, n, generator=gen, device=device, dtype=getattr(torch, dtype))
        times = []
        for i in range(repeats + 1):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.mm(a, b)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if i:  # the first is the warm-up
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    best = min(times)
    return {"flops_per_s": 2.0 * n ** 3 / best, "n": n, "dtype": dtype, "device": device, "threads": threads,
            "seconds": best}


# The CPU's "peak": a 1024^3 float32 matmul, best of 3 after a warm-up, on the learner's
# threads: ~0.04 s on 2 cores (~340 GFLOP/s there, within 5% of a 2048^3 one's rate).
CPU_PEAK_GEMM = dict(n=1024, dtype="float32", repeats=3)


def device_peak_flops(device: Any, dtype: str, threads: Optional[int] = None) -> float:
    """The peak FLOP/s that learner_mfu divides by, for a learner on `device` computing in
    `dtype`: on a CUDA GPU the datasheet's dense rate (PEAK_FLOPS; NaN for a card not
    listed); on the CPU the measured rate of one large float32 matmul on `threads` (default
    torch's current count), CPU_PEAK_GEMM, whatever the learner's dtype (the CPU has no
    datasheet peak; a well-shaped GEMM is what its model FLOPs can reach at best); NaN on any
    other device."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return peak_flops(torch.cuda.get_device_name(device), dtype) or math.nan
    if device.type == "cpu":
        return gemm_rate(threads=threads or torch.get_num_threads(), **CPU_PEAK_GEMM)["flops_per_s"]
    return math.nan
