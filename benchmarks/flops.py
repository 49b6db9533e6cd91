"""The FLOP floor of a PPO step: the machine's matrix-multiply rate, each phase's model FLOPs
on the real tokens, and how close a measured phase came to doing them at that rate.

    rate = gemm_rate()                                    # FLOP/s of a large fp32 matmul here
    flops = step_flops(shapes, prompt_lens, response_lens, config)   # {phase: FLOPs}
    floor = {phase: f / rate for phase, f in flops.items()}          # seconds at the GEMM rate

The floor of a phase is its FLOPs at the rate of one large square matmul on the same device
and threads: work that is all GEMM at the best shape cannot run faster, so measured seconds /
floor >= 1 in practice, and floor / measured (``fraction``) says how much of the machine a
phase used. Counts (benchmarks.gpu_step.learner_flops for the learner; the same rules here):

    forward of n = p + r tokens   2 N n (N: the decoder's matmul parameters)
                                  + LoRA 2 r (in + out) n per adapted projection
                                  + causal attention 2 (heads x head_dim) n (n + 1) per layer
                                  + lm_head 2 H V per position whose logits are used
    generate    the policy's forward over prompt + response with its LoRA, logits at the r
                response positions (a KV-cached decode computes the same products)
    reference   the reference's forward (no LoRA), logits at the r response positions
    reward      the reward model's forward (its own shape), no lm_head (a 1-output score head)
    learner_forward, update   learner_flops: the no-grad pass of the policy and (separate
                value model) the value model of the policy's shape; ppo_epochs x (forward +
                backward), backward = input gradients of the frozen base only (1x its matmuls,
                2x LoRA and attention)

Padding, recomputation (gradient checkpointing), norms, activations and the sampler are not
counted: they are overhead against the floor, as the padding is.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional, Sequence

SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size")


def model_shape(model_dir: str | os.PathLike) -> dict[str, int]:
    """The shape fields of a Hugging Face decoder's config.json (head_dim defaults to
    hidden_size / num_attention_heads, num_key_value_heads to num_attention_heads)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    if not cfg.get("head_dim"):
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    return {k: int(cfg[k]) for k in SHAPE_KEYS}


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
                  value_pass: bool = True) -> dict[str, float]:
    """Model FLOPs of Learner.update on REAL tokens (padding counts as waste, not work), for
    `models` models of the policy's shape (policy and value model; 1 for ``value_model:
    shared`` or an estimator without a critic):
      forward     per model the base matmuls, LoRA and attention; the policy's lm_head on the
                  response positions (the value head, H -> 1, is left out: < 1e-5)
      backward    the base weights are frozen, so only input gradients: 1x the forward's base
                  and lm_head matmuls, 2x its LoRA matmuls (input and A/B gradients), 2x its
                  attention matmuls (dQ, dK, dV, dP); recomputation (checkpointing) not counted
    learner_forward = one forward of the models (the no-grad pass; value_pass=False: the
    policy's alone, a separate value model's old values coming from the update's first
    forward, Learner.values_in_update), update = ppo_epochs x (forward + backward)."""
    base, lora, attn, head = _counts(shape, prompt_lens, response_lens, lora_r, lora_targets)
    forward = models * (base + lora + attn) + head
    no_grad = forward if value_pass or models == 1 else base + lora + attn + head
    backward = models * (base + 2 * lora + 2 * attn) + head
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    n_mat = layers * (h * q + 2 * h * kv + q * h + 3 * h * inter)
    return {"learner_forward": float(no_grad), "update": float(ppo_epochs * (forward + backward)),
            "matmul_parameters": float(n_mat), "real_tokens": float(sum(p + r for p, r in zip(prompt_lens,
                                                                                               response_lens)))}


def step_flops(shapes: dict[str, dict], prompt_lens: Sequence[int], response_lens: Sequence[int], config,
               recomputed: bool = True) -> dict:
    """{phase: FLOPs} of one PPO step (generate, reference, reward, learner_forward, update)
    on these rows. `shapes`: "policy" (also the reference's and the value model's shape) and
    "reward" (None: the reward comes from functions, 0 FLOPs). recomputed=False: the step took
    the generator's old logprobs (old_logprobs: generator, between check versions), so the
    learner's no-grad pass ran the value model alone (the trunk, no lm_head), or nothing when
    the old values came from the update's first forward too (old_values: update)."""
    from learner.algos import advantage_estimator

    policy, targets = shapes["policy"], list(config.lora_target_modules)
    estimator = advantage_estimator(config.advantage_estimator)
    critic = estimator.needs_critic
    models = 2 if critic and config.value_model == "separate" else 1
    # Learner.values_in_update on a batch of batch_size rows
    value_pass = not (models == 2 and estimator.per_row and config.old_values_source == "update")
    learner = learner_flops(policy, prompt_lens, response_lens, config.ppo_epochs, config.lora_r, targets,
                            models=models, value_pass=value_pass)
    trunk = sum(_counts(policy, prompt_lens, response_lens, config.lora_r, targets)[:3])
    return {
        "generate": forward_flops(policy, prompt_lens, response_lens, lora_r=config.lora_r, lora_targets=targets),
        "reference": forward_flops(policy, prompt_lens, response_lens),
        "reward": (forward_flops(shapes["reward"], prompt_lens, response_lens, logits=False)
                   if shapes.get("reward") else 0.0),
        "learner_forward": learner["learner_forward"] if recomputed else (trunk if critic and value_pass else 0.0),
        "update": learner["update"],
    }


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


def floor_report(flops_per_step: Sequence[dict], seconds_per_step: Sequence[dict], rate: float) -> dict:
    """Per phase over the timed steps: total FLOPs, the floor (FLOPs / rate), the measured
    seconds, achieved FLOP/s and the fraction of the floor (floor / measured); and the same
    for the phases together ("step": the five phases' FLOPs against the whole step's seconds).
    The reference and reward scorers run at the same time, each on its share of the cores, so
    each one's fraction against the whole machine's rate reads low; "scorers" counts the two
    together against the wall time they share (the slower one's, per step)."""
    out = {}
    for phase in flops_per_step[0]:
        flop = sum(f[phase] for f in flops_per_step)
        seconds = sum(s[phase] for s in seconds_per_step)
        out[phase] = _row(flop, seconds, rate)
    if "reference" in out and "reward" in out:
        out["scorers"] = _row(out["reference"]["flop"] + out["reward"]["flop"],
                              sum(max(s["reference"], s["reward"]) for s in seconds_per_step), rate)
    total = sum(sum(f.values()) for f in flops_per_step)
    out["step"] = _row(total, sum(s["step"] for s in seconds_per_step), rate)
    return out


def _row(flop: float, seconds: float, rate: float) -> dict:
    return {"flop": flop, "floor_s": flop / rate, "measured_s": seconds,
            "achieved_flops_per_s": flop / seconds if seconds > 0 else None,
            "fraction_of_floor": (flop / rate) / seconds if seconds > 0 and flop > 0 else None}
