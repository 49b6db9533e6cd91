"""Reward scorer: a reward model and/or reward functions, combined with weights.

Plain class, no Ray: ppo_ray.placement hosts it in a Ray actor.

- A reward model is an AutoModelForSequenceClassification with num_labels=1; its score is
  read at the last real token of prompt + response (the EOS when the response has one,
  never a pad: trl #3750 placed rewards on the pad after EOS). A causal LM (or any
  checkpoint without trained `score` weights) is refused, not loaded with a random head:
  its "rewards" would be noise and PPO would train on them without a sign of trouble
  (ppo_ray.rewards.check_reward_sources reads config.json before any actor starts, and
  again here; load_reward_model checks the weights).
- A reward function is named "package.module:function" and called as
  fn(prompts: list[str], completions: list[str]) -> list[float] (ppo_ray.rewards.RewardFn).
- Scores are summed with weights (reward model first, then functions, in config order).
- missing_eos_penalty (N+ / TRL): a response cut at max_new_tokens without EOS gets that
  score instead of the model's.
- overlong_buffer (DAPO's soft overlong punishment): a response longer than
  max_new_tokens - overlong_buffer tokens gets a penalty added, linear to -overlong_penalty at
  max_new_tokens; its mean is the source "overlong_penalty".
- A non-finite score is an error naming the source and the prompt index, or, with
  nonfinite="drop", the sample's score becomes NaN, which the learner masks out and counts.
"""

from __future__ import annotations

import math
import time
from typing import Optional, Sequence

import torch
from torch import Tensor

from ppo_ray.batch import RolloutBatch
from ppo_ray.config import REWARD, ConfigSlice, PPOConfig, role_fields
from ppo_ray.modeling import load_reward_model, pick_device, reward_scores
from ppo_ray.rewards import RewardError, RewardFn, check_reward_sources
from ppo_ray.stats import RewardStats


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, factor: float) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), (B,) float32 from (B,) response
    lengths in tokens: 0 up to max_new_tokens - buffer, then -(length - (max_new_tokens -
    buffer)) / buffer * factor, -factor at max_new_tokens (verl's overlong_reward in
    verl/workers/reward_manager/dapo.py: min(-exceed_len / buffer_len * penalty_factor, 0))."""
    exceed = lengths.float() - (max_new_tokens - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0)


class RewardScorer:
    # The config fields from_config reads (and log_level, scorer_torch_threads: its actor
    # host's): the reward actor gets only these (PPOConfig.slice).
    CONFIG_FIELDS = role_fields(REWARD)

    def __init__(self, reward_model_name: Optional[str] = None, reward_funcs: Sequence[str] = (),
                 weights: Sequence[float] = (), *, missing_eos_penalty: Optional[float] = None,
                 nonfinite: str = "error", dtype: str = "float32", micro_batch_size: int = 8,
                 device: Optional[str] = None, max_new_tokens: int = 0, overlong_buffer: int = 0,
                 overlong_penalty: float = 1.0):
        self.funcs = check_reward_sources(reward_model_name, reward_funcs, weights)
        self.device = pick_device(device)  # the GPU Ray gave this actor (scorer_num_gpus), else the CPU
        self.model = load_reward_model(reward_model_name, dtype).to(self.device) if reward_model_name else None
        self.weights = list(weights) if weights else [1.0] * (len(self.funcs) + (self.model is not None))
        self.missing_eos_penalty = missing_eos_penalty
        if overlong_buffer and not 0 < overlong_buffer < max_new_tokens:
            raise ValueError(f"overlong_buffer {overlong_buffer} must be in (0, max_new_tokens={max_new_tokens})")
        self.max_new_tokens, self.overlong_buffer, self.overlong_penalty = max_new_tokens, overlong_buffer, overlong_penalty
        self.nonfinite = nonfinite
        self.micro_batch_size = micro_batch_size

    @classmethod
    def from_config(cls, cfg: PPOConfig | ConfigSlice, reward_model_dir: Optional[str],
                    device: Optional[str] = None) -> "RewardScorer":
        """The reward scorer of `reward_model_dir` (the resolved reward_model_name, None for
        functions only) and cfg's reward functions, as `cfg` sets it up."""
        return cls(reward_model_dir, cfg.reward_funcs, cfg.reward_weights, missing_eos_penalty=cfg.missing_eos_penalty,
                   nonfinite=cfg.nonfinite_reward, dtype=cfg.dtype, micro_batch_size=cfg.micro_batch_size,
                   device=device, max_new_tokens=cfg.max_new_tokens, overlong_buffer=cfg.overlong_buffer,
                   overlong_penalty=cfg.overlong_penalty)

    def model_scores(self, batch: RolloutBatch) -> Tensor:
        """(B,) float32 reward-model scores at the last real token."""
        return reward_scores(self.model, batch, self.micro_batch_size, self.device)

    def function_scores(self, spec: str, fn: RewardFn, batch: RolloutBatch) -> Tensor:
        n = len(batch)
        try:
            values = fn(list(batch.prompts), list(batch.responses))
        except Exception as e:  # a user function: report which one and what it raised
            raise RewardError(f"reward function {spec!r} raised {type(e).__name__}: {e}") from e
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError) as e:
            raise RewardError(f"reward function {spec!r} must return a list of {n} numbers: {e}") from e
        if len(values) != n:
            raise RewardError(f"reward function {spec!r} returned {len(values)} values for {n} prompts")
        return torch.tensor(values, dtype=torch.float32)

    def score(self, batch: RolloutBatch) -> tuple[Tensor, RewardStats]:
        """(B,) float32 combined scores, and small stats (per-source means, drops, seconds)."""
        t0 = time.perf_counter()
        sources: list[tuple[str, Tensor]] = []
        if self.model is not None:
            sources.append(("reward_model", self.model_scores(batch)))
        sources += [(spec, self.function_scores(spec, fn, batch)) for spec, fn in self.funcs]

        total = torch.zeros(len(batch))
        means: dict[str, float] = {}
        for (name, values), w in zip(sources, self.weights):
            bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
            if bad and self.nonfinite == "error":
                raise RewardError(f"reward source {name!r} gave non-finite score {values[bad[0]].item()} "
                                  f"for prompt index {bad[0]} ({len(bad)} non-finite in all)")
            total = total + w * values
            finite = values[torch.isfinite(values)]
            means[name] = float(finite.mean()) if len(finite) else math.nan
        if self.missing_eos_penalty is not None:
            total = torch.where(batch.has_eos, total, torch.full_like(total, self.missing_eos_penalty))
        if self.overlong_buffer:
            penalty = overlong_penalty(batch.response_lengths, self.max_new_tokens, self.overlong_buffer,
                                       self.overlong_penalty)
            total = total + penalty
            means["overlong_penalty"] = float(penalty.mean())
        dropped = float((~torch.isfinite(total)).sum())
        total = torch.where(torch.isfinite(total), total, torch.full_like(total, math.nan))
        return total, RewardStats(means, dropped, seconds=time.perf_counter() - t0)
