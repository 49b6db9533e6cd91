"""What one PPO step reports, typed: the learner's statistics, a generator's LoRA sync and the
trainer's step result.

    stats, weights = learner.update(batch, ref_logprobs, scores)   # LearnerStats
    result = trainer.ppo_step(prompts)                              # StepResult
    result.learner.policy_loss, result.timing.update_s, result.rewards
    result["policy_loss"], result["generated_texts"]                # the seeds' keys still work

Each name means one thing: the learner's mean shaped return per sequence is
`shaped_reward_mean`, the reward actor's mean score is the step's `reward_mean`.
`StepResult.as_dict()` is the one flattening (the metrics JSONL, TensorBoard, Prometheus
and the console line all take it, or its scalars); its keys are the JSONL's columns.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass(frozen=True)
class LearnerStats:
    """One Learner.update: means over real tokens (over minibatches for losses and norms)."""

    # step 7, the PPO epochs
    policy_loss: float
    value_loss: float
    approx_kl: float
    clipfrac: float
    ratio_mean: float
    outside_support_frac: float
    vf_clipfrac: float
    policy_grad_norm: float          # before clipping
    value_grad_norm: float
    first_minibatch_ratio_mean: float  # before any optimiser step; 1 with no dropout
    # steps 1-6, the rollouts
    entropy: float                   # of the rollout policy, per token
    explained_variance: float        # old values vs returns
    kl: float                        # mean over sequences of sum_t KL_t
    kl_per_token: float
    score_mean: float                # the scores the learner got (rows kept)
    shaped_reward_mean: float        # score - beta * KL, summed per sequence, before whitening
    advantage_mean: float            # raw, before whitening
    return_mean: float
    value_mean: float
    # checks
    gen_logprob_max_abs_diff: float  # generator vs learner logprob of the sampled tokens (NaN: stale rollouts)
    truncated_tokens: float          # sampled tokens outside the learner's top-k/top-p support
    behaviour_logprob_gap: float     # mean |learner - behaviour| logprob (overlap mode's distance)
    dropped_samples: float           # non-finite scores dropped (nonfinite_reward: drop)
    # counts, settings and seconds
    tokens: float                    # real response tokens
    padded_token_ratio: float        # tokens the learner's forwards computed / real tokens
    stale_versions: float            # how many versions behind the rollouts were
    kl_coef: float                   # the beta this step used (adaptive KL moves the next one)
    learning_rate: float             # the policy's lr at the step's first optimiser step
    learner_forward_s: float         # step 1's no-grad pass
    update_s: float                  # the whole update, forward included
    learner_peak_memory_gib: float   # torch.cuda.max_memory_allocated during the update (NaN: not on CUDA)
    version: int                     # the adapter version after the update

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SyncReport:
    """One generator's load of a LoRA version (Generator.load_adapter, actors.lora_sync)."""

    version: int              # the adapter version the generator holds after the load
    write_s: float            # the adapter's files written (adapter mode; 0 when merged)
    register_s: float         # the engine took it: add_lora (adapter) or the in-place merge (merged)
    retire_s: float           # the previous version retired and the prefix cache reset
    nbytes: float             # the LoRA tensors' bytes (a float: the metrics' lora_sync_bytes)


@dataclass(frozen=True)
class StepTiming:
    """Seconds of one step's phases, as the driver and the actors measured them."""

    generate_s: float         # the slowest generator replica
    reference_s: float
    reward_s: float
    learner_forward_s: float
    update_s: float
    sync_s: float             # the committed adapter to every replica, waited for
    sync_check_s: float       # the sync check after it (probe rollouts + the learner's logprobs; re-syncs)
    prefetch_wait_s: float    # overlap mode: the wait for the next step's rollouts after the update
    sync_write_s: float       # the generators' part of the sync: writing the adapter ...
    sync_register_s: float    # ... and registering it with vLLM (and retiring the old one)
    step_s: float             # the whole step, on the driver's clock


@dataclass
class StepResult(Mapping):
    """One committed PPO step. A read-only Mapping over as_dict(), so the seeds'
    `results['generated_texts']`, `results['rewards']`, `results['policy_loss']` hold."""

    step: int
    generated_texts: list[str]
    finish_reasons: list[str]           # per rollout: "stop" (ended with EOS) or "length" (cut at max_new_tokens)
    rewards: list[float]                # the reward actor's combined score per rollout (NaN: dropped)
    learner: LearnerStats
    reward_parts: dict[str, float]      # score/<source> means and dropped_nonfinite
    adapter_version: int                # the version the generators hold after the sync
    timing: StepTiming
    lora_sync_bytes: int
    response_lengths: list[int]         # tokens per rollout, EOS included (the generators' response masks)
    sync_probe_gap: float = math.nan    # the sync check's largest generator-vs-learner probe gap (NaN: off)
    sync_resyncs: int = 0               # re-syncs the step needed (a failed sync check or rollout check)
    extra: dict[str, Any] = field(default_factory=dict)  # evaluations merged in by train()

    @property
    def reward_mean(self) -> float:
        finite = [r for r in self.rewards if math.isfinite(r)]
        return sum(finite) / len(finite) if finite else math.nan

    @property
    def response_tokens(self) -> int:
        return sum(self.response_lengths)

    @property
    def response_length_mean(self) -> float:
        n = len(self.response_lengths)
        return self.response_tokens / n if n else math.nan

    @property
    def response_length_max(self) -> float:
        return float(max(self.response_lengths)) if self.response_lengths else math.nan

    @property
    def no_eos_frac(self) -> float:
        """The fraction of rollouts cut at max_new_tokens without EOS (the generator's
        finish_reason "length"; it checks that "stop" means the response ends with EOS)."""
        n = len(self.finish_reasons)
        return sum(f == "length" for f in self.finish_reasons) / n if n else math.nan

    @property
    def tokens_per_s(self) -> float:
        wall = self.timing.step_s
        return self.response_tokens / wall if wall > 0 else math.nan

    def as_dict(self) -> dict[str, Any]:
        """The flat record: the metrics JSONL's line (lists included)."""
        return {
            "step": self.step,
            "generated_texts": self.generated_texts,
            "finish_reasons": self.finish_reasons,
            "rewards": self.rewards,
            "reward_mean": self.reward_mean,
            **self.learner.as_dict(),
            **self.reward_parts,
            "adapter_version": self.adapter_version,
            **{f"time/{k}": v for k, v in dataclasses.asdict(self.timing).items()},
            "lora_sync_bytes": self.lora_sync_bytes,
            "sync_probe_gap": self.sync_probe_gap,
            "sync_resyncs": self.sync_resyncs,
            "tokens_per_s": self.tokens_per_s,
            "response_tokens": self.response_tokens,
            "response_lengths": self.response_lengths,
            "response_length_mean": self.response_length_mean,
            "response_length_max": self.response_length_max,
            "no_eos_frac": self.no_eos_frac,
            **self.extra,
        }

    def scalars(self) -> dict[str, Any]:
        """as_dict() without the per-rollout lists: what the metrics sinks record."""
        return {k: v for k, v in self.as_dict().items() if not isinstance(v, (list, dict))}

    # Mapping: read-only access by the flat record's keys
    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())
