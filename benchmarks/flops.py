"""The FLOP floor of a PPO step: the machine's matrix-multiply rate, each phase's model FLOPs
on the real tokens, and how close a measured phase came to doing them at that rate.

    rate = gemm_rate()                                    # FLOP/s of a large fp32 matmul here
    flops = step_flops(shapes, prompt_lens, response_lens, config)   # {phase: FLOPs}
    floor = {phase: f / rate for phase, f in flops.items()}          # seconds at the GEMM rate

The floor of a phase is its FLOPs at the rate of one large square matmul on the same device
and threads: work that is all GEMM at the best shape cannot run faster, so measured seconds /
floor >= 1 in practice, and floor / measured (``fraction``) says how much of the machine a
phase used. The counts are the product's (learner/flops.py, whose learner_flops the learner
reports every step as its learner_flops stat); their rules:

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

from typing import Sequence

# The counts and the GEMM rate live in the product (the learner reports its own FLOPs per
# step, ppo_ray.stats.StepResult.rates): one copy of the rules, imported here.
from learner.flops import SHAPE_KEYS, forward_flops, gemm_rate, learner_flops, model_shape, update_flops  # noqa: F401


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
    value_model = config.value_model if estimator.needs_critic else "none"
    # Learner.values_in_update on a batch of batch_size rows
    values_in_update = value_model == "separate" and estimator.per_row and config.old_values_source == "update"
    learner = update_flops(policy, prompt_lens, response_lens, ppo_epochs=config.ppo_epochs, lora_r=config.lora_r,
                           lora_targets=targets, value_model=value_model, values_in_update=values_in_update,
                           recomputed=recomputed)
    return {
        "generate": forward_flops(policy, prompt_lens, response_lens, lora_r=config.lora_r, lora_targets=targets),
        "reference": forward_flops(policy, prompt_lens, response_lens),
        "reward": (forward_flops(shapes["reward"], prompt_lens, response_lens, logits=False)
                   if shapes.get("reward") else 0.0),
        "learner_forward": learner["learner_forward"],
        "update": learner["update"],
    }


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
