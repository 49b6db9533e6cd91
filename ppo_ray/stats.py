"""What the actors report (generation, reference, reward, a generator's LoRA sync) and what
one PPO step reports, typed.

    batch, summary = generator_host.generate(prompt_ids, GenerateRequest(step, offset))  # GenerationSummary
    logprobs, ref_stats = reference.logprobs(batch)                 # ReferenceStats
    scores, reward_stats = scorer.score(batch)                      # RewardStats
    stats, weights = learner.update(batch, ref_logprobs, scores)   # LearnerStats
    result = trainer.ppo_step(prompts)                              # StepResult
    result.learner.policy_loss, result.timing.update_s, result.rewards
    result["policy_loss"], result["generated_texts"]                # the seeds' keys still work

Each name means one thing: the learner's mean shaped return per sequence is
`shaped_reward_mean`, the reward actor's mean score is the step's `reward_mean`.
`StepResult.as_dict()` is the one flattening (the metrics JSONL, TensorBoard, Prometheus
and the console line all take it, or its scalars); its keys are the JSONL's columns.

One timing convention: an actor measures its own call in its own process
(time.perf_counter around the work) and returns the seconds in the call's typed result
(`seconds` here; the learner's phases as LearnerStats.learner_forward_s and update_s), so
the driver never makes a second call to ask how long the first one took.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

if TYPE_CHECKING:
    import torch

    from ppo_ray.attribution import AttributionRows
    from ppo_ray.batch import RolloutBatch
    from ppo_ray.modeling import LoraWeights


@dataclass(frozen=True)
class GenerateRequest:
    """One generate call's options: the trainer (or the in-flight pipeline) makes it, and it
    travels unchanged through PPORoles.generate (which sets each replica's `prompt_offset`,
    part()) and GeneratorHost.generate to Generator.generate, whose parameters its fields
    are. A new sampling option is one field here and its use in Generator.generate.

    step: the seed step (each prompt's seed is prompt_seed(seed, step, its global index));
    prompt_offset: the global index of the call's first prompt; version: the adapter version
    the replica must hold (StateLostError otherwise; None: its newest); samples_per_prompt:
    contiguous samples per prompt; segment_versions / segment_tokens: a partial rollout's
    versions and segment length; greedy: argmax decoding, for evaluation only; rows: with an
    environment (config.environment), each prompt's dataset row, which its episodes' environments
    are reset with (Generator.generate_episodes); None without one."""

    step: int
    prompt_offset: int = 0
    version: Optional[int] = None
    samples_per_prompt: int = 1
    segment_versions: Optional[tuple[int, ...]] = None
    segment_tokens: int = 0
    greedy: bool = False
    rows: Optional[tuple[dict, ...]] = None

    def part(self, start: int, end: Optional[int] = None) -> "GenerateRequest":
        """The request of a replica's chunk of prompts [start, end) of the call's."""
        rows = None if self.rows is None else self.rows[start:end]
        return dataclasses.replace(self, prompt_offset=self.prompt_offset + start, rows=rows)

    def options(self) -> dict[str, Any]:
        """Generator.generate's keyword arguments (the sampling options; rows go to
        generate_episodes only)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "rows"}


@dataclass(frozen=True)
class EpisodeSummary:
    """One multi-turn episode as the driver sees it (ppo_ray.environments.Episode, small): its
    environment score (the sum of its steps' rewards; NaN: failed and dropped), turns, tool calls
    and errors, how it ended, the environment's seconds and tokens, and the transcript's segments
    ("model" | "env", text) for samples.md and report.html."""

    score: float
    turns: int
    tool_calls: int
    tool_errors: int
    end: str                                  # "done", "eos", "max_turns", "budget", "failed"
    failure: str = ""                         # end "failed": "timeout" or "exception"
    env_seconds: float = 0.0
    env_tokens: int = 0
    model_tokens: int = 0
    segments: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, ep, score: float) -> "EpisodeSummary":
        """From an ppo_ray.environments.Episode, with the score the failure policy gave it."""
        env_tokens = sum(ep.env)
        return cls(score=score, turns=ep.turns, tool_calls=ep.tool_calls, tool_errors=ep.tool_errors, end=ep.end,
                   failure=ep.failure, env_seconds=ep.env_seconds, env_tokens=env_tokens,
                   model_tokens=len(ep.ids) - env_tokens, segments=tuple(tuple(s) for s in ep.segments))


@dataclass(frozen=True)
class EpisodeStats:
    """A step's episodes in numbers (means over the episodes; rates over them): what the step's
    line, metrics.jsonl and Prometheus show (ppo_ray.driver.metrics)."""

    turns_mean: float
    tool_calls_mean: float       # tool calls per episode
    tool_call_rate: float        # the share of episodes with at least one tool call
    tool_errors: float           # in all
    timeouts: float              # episodes whose environment call ran past env_timeout_s
    exceptions: float            # episodes whose environment raised or broke the contract
    env_seconds: float           # the environment's own seconds, summed over the episodes
    env_token_frac: float        # environment tokens / all response tokens

    @classmethod
    def of(cls, episodes: Sequence[EpisodeSummary]) -> "EpisodeStats":
        n = max(len(episodes), 1)
        tokens = sum(e.env_tokens + e.model_tokens for e in episodes)
        return cls(turns_mean=sum(e.turns for e in episodes) / n,
                   tool_calls_mean=sum(e.tool_calls for e in episodes) / n,
                   tool_call_rate=sum(e.tool_calls > 0 for e in episodes) / n,
                   tool_errors=float(sum(e.tool_errors for e in episodes)),
                   timeouts=float(sum(e.failure == "timeout" for e in episodes)),
                   exceptions=float(sum(e.end == "failed" and e.failure != "timeout" for e in episodes)),
                   env_seconds=sum(e.env_seconds for e in episodes),
                   env_token_frac=sum(e.env_tokens for e in episodes) / tokens if tokens else 0.0)

    def as_dict(self) -> dict[str, float]:
        return {f"episode_{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class GenerationSummary:
    """What a generator replica's generate call sends the driver: the small part of its
    RolloutBatch (which stays in the object store for the other actors), and its seconds."""

    texts: list[str]             # decoded responses, EOS left out
    finish_reasons: list[str]    # per rollout: "stop" (ended with EOS) or "length"
    lengths: list[int]           # response tokens per rollout, EOS included (the response mask's row sums)
    version: int                 # the adapter version it sampled with
    seconds: float               # the generate call
    # per rollout, its group id (RolloutBatch.groups: rows of one id are one prompt's samples);
    # what dynamic sampling's filter reads beside the scores. Empty: the batch has none
    groups: list[int] = dataclasses.field(default_factory=list)
    # multi-turn: each rollout's episode (its row's); None: single-turn rollouts
    episodes: Optional[list[EpisodeSummary]] = None

    @classmethod
    def of(cls, batch: "RolloutBatch", seconds: float,
           episodes: Optional[list[EpisodeSummary]] = None) -> "GenerationSummary":
        return cls(texts=list(batch.responses), finish_reasons=list(batch.finish_reasons),
                   lengths=batch.response_mask.sum(dim=1).tolist(),  # (B,)
                   version=int(batch.adapter_version), seconds=seconds,
                   groups=[] if batch.groups is None else batch.groups.tolist(),  # (B,)
                   episodes=episodes)

    @classmethod
    def join(cls, parts: Sequence["GenerationSummary"]) -> "GenerationSummary":
        """The replicas' summaries as one, rows in prompt order (the replicas hold contiguous
        chunks); seconds of the slowest replica. The replicas must have sampled with one
        version (ValueError naming them otherwise)."""
        versions = sorted({p.version for p in parts})
        if len(versions) != 1:
            raise ValueError(f"generator replicas sampled with adapter versions {versions}, not one version")
        return cls(texts=[t for p in parts for t in p.texts],
                   finish_reasons=[f for p in parts for f in p.finish_reasons],
                   lengths=[n for p in parts for n in p.lengths], version=versions[0],
                   seconds=max(p.seconds for p in parts), groups=[g for p in parts for g in p.groups],
                   episodes=None if parts[0].episodes is None else [e for p in parts for e in p.episodes])

    def select(self, rows: Sequence[int]) -> "GenerationSummary":
        """Rows `rows` (in that order), seconds unchanged: the rows a step trains on
        (dynamic_sampling) out of those it generated."""
        return dataclasses.replace(self, texts=[self.texts[i] for i in rows],
                                   finish_reasons=[self.finish_reasons[i] for i in rows],
                                   lengths=[self.lengths[i] for i in rows],
                                   groups=[self.groups[i] for i in rows] if self.groups else [],
                                   episodes=None if self.episodes is None else [self.episodes[i] for i in rows])


@dataclass(frozen=True)
class ReferenceStats:
    """What the reference's logprobs call sends the driver beside its (B, T) logprobs."""

    seconds: float


@dataclass(frozen=True)
class RewardFailures:
    """What went wrong in one score call's guarded reward-function calls (actors.reward:
    reward workers, an HTTP verifier, or a reward_failure policy other than error), counted."""

    timeouts: float = 0.0          # calls past reward_timeout_s (a worker's: killed and replaced)
    exceptions: float = 0.0        # calls that raised, returned unusable values, whose worker died, or a
                                   # verifier request that failed after its retries
    nonfinite: float = 0.0         # function scores (row x function) that were NaN/inf: nonfinite_reward's rule
    rows_dropped: float = 0.0      # function scores (row x function) dropped by reward_failure: drop
    rows_fixed_score: float = 0.0  # function scores (row x function) set to reward_failure_score
    retry_calls: float = 0.0       # extra calls that isolated the failing rows of failed calls (bisection)

    def parts(self) -> dict[str, float]:
        """The counts as StepResult keys: reward_timeouts, reward_exceptions, ..."""
        return {f"reward_{name}": value for name, value in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class RewardStats:
    """What the reward actor's score call sends the driver beside its (B,) scores."""

    source_means: dict[str, float]  # per source ("reward_model", then each function's spec, in config
                                    # order): its mean finite score (NaN: none finite)
    dropped_nonfinite: float        # combined scores that were not finite (nonfinite_reward: drop)
    seconds: float
    failures: Optional[RewardFailures] = None  # guarded calls' failures; None: the calls were not guarded

    def parts(self) -> dict[str, float]:
        """StepResult.reward_parts: score/<source> means, then dropped_nonfinite, then (guarded
        calls only) the failure counts (RewardFailures.parts)."""
        return {**{f"score/{name}": mean for name, mean in self.source_means.items()},
                "dropped_nonfinite": self.dropped_nonfinite,
                **(self.failures.parts() if self.failures is not None else {})}

    @classmethod
    def join(cls, parts: Sequence["RewardStats"], rows: Sequence[int]) -> "RewardStats":
        """Several score calls' stats as one (dynamic_sampling's rounds, `rows` rows each): each
        source's mean weighted by the calls' rows (NaN means left out), counts and seconds
        summed."""
        if len(parts) == 1:
            return parts[0]
        means = {}
        for name in parts[0].source_means:
            pairs = [(p.source_means[name], n) for p, n in zip(parts, rows) if not math.isnan(p.source_means[name])]
            total = sum(n for _, n in pairs)
            means[name] = sum(m * n for m, n in pairs) / total if total else math.nan
        failures = [p.failures for p in parts if p.failures is not None]
        return cls(source_means=means, dropped_nonfinite=sum(p.dropped_nonfinite for p in parts),
                   seconds=sum(p.seconds for p in parts),
                   failures=RewardFailures(**{f.name: sum(getattr(x, f.name) for x in failures)
                                              for f in dataclasses.fields(RewardFailures)}) if failures else None)


@dataclass(frozen=True)
class DynamicSampling:
    """One step's dynamic sampling (config dynamic_sampling; ppo_ray.driver.inflight.Pipeline.dynamic_sampling)."""

    rounds: int        # generation rounds the step ran (1 = none beyond its first batch)
    kept_frac: float   # groups whose scores vary / groups generated, over the rounds
    filled: int        # groups trained on whose scores do not vary (the rounds' cap left too few varying)

    def as_dict(self) -> dict[str, float]:
        return {"dynamic_sampling_rounds": self.rounds, "dynamic_sampling_kept_frac": self.kept_frac,
                "dynamic_sampling_filled": self.filled}


@dataclass(frozen=True)
class Responses:
    """PPOTrainer.generate: the current policy's responses to some prompts, in their order."""

    texts: list[str]
    finish_reasons: list[str]         # "stop" (ended with EOS) or "length" (cut at max_new_tokens)
    version: int                      # the adapter version that sampled them
    rewards: Optional[list[float]] = None  # the reward actor's score per response (generate(score=True))
    held_out: Optional["AttributionRows"] = None  # generate(attribute=rows): those rows per token (ppo_ray.attribution)
    episodes: Optional[list[EpisodeSummary]] = None  # multi-turn (config.environment): each response's episode


@dataclass(frozen=True, kw_only=True)
class LearnerStats:
    """One Learner.update: means over real tokens (over minibatches for losses and norms).
    The critic's statistics (CRITIC_FIELDS) are None for an advantage estimator without a
    critic (no value model exists), an option's own statistics (kl_loss, is_*) None when it
    is off; as_dict() leaves None out."""

    # step 7, the PPO epochs
    policy_loss: float
    value_loss: Optional[float] = None
    approx_kl: float
    clipfrac: float
    ratio_mean: float
    outside_support_frac: float
    vf_clipfrac: Optional[float] = None
    policy_grad_norm: float          # before clipping
    value_grad_norm: Optional[float] = None
    first_minibatch_ratio_mean: float  # before any optimiser step: 1 up to rounding or the generator gap (old_logprobs)
    kl_loss: Optional[float] = None  # kl_in_loss: the loss's k3 KL term before beta (None: KL in the reward)
    # the policy loss's own statistics beyond the four every loss reports (its stats dataclass's
    # other fields, learner.losses; e.g. ppo_clip's dual_clipfrac with dual_clip set), by name
    loss_extra: dict[str, float] = dataclasses.field(default_factory=dict)
    # steps 1-6, the rollouts
    entropy: float                   # of the rollout policy, per token
    explained_variance: Optional[float] = None  # old values vs returns
    kl: float                        # mean over sequences of sum_t KL_t
    kl_per_token: float
    score_mean: float                # the scores the learner got (rows kept)
    shaped_reward_mean: float        # score - beta * KL, summed per sequence, before whitening
    advantage_mean: float            # raw, before whitening
    return_mean: Optional[float] = None
    value_mean: Optional[float] = None
    # checks
    gen_logprob_max_abs_diff: float  # generator vs learner logprob of the sampled tokens (NaN: stale rollouts)
    truncated_tokens: float          # sampled tokens outside the learner's top-k/top-p support
    gen_logprob_gap_tokens: float    # sampled tokens whose generator-learner gap is over logprob_gap_limit (NaN: stale)
    behaviour_logprob_gap: float     # mean |learner - behaviour| logprob (overlap mode's distance)
    mismatch_outside_frac: float     # tokens whose pi_learner / pi_generator is outside [0.9, 1.1] (NaN: not measured)
    mismatch_log_ratio_abs: float    # mean |log pi_learner - log pi_generator| (NaN: not measured)
    is_weight_mean: Optional[float] = None  # is_correction tis: the mean importance weight
    is_masked_frac: Optional[float] = None  # is_correction mis: tokens dropped from the policy loss
    is_outside_frac: Optional[float] = None  # is_correction: tokens whose own ratio is outside [1/is_cap, is_cap]
    overlong_filtered: Optional[float] = None  # overlong_filter: share of responses (no EOS) left out of the policy loss
    dropped_samples: float           # non-finite scores dropped (nonfinite_reward: drop)
    # counts, settings and seconds
    tokens: float                    # real response tokens
    padded_token_ratio: float        # tokens the learner's forwards computed / real tokens
    # model FLOPs of this update on the real prompt + response tokens (learner/flops.py's
    # rules: the no-grad pass that ran, ppo_epochs x forward + backward of the policy and the
    # value model; padding and recomputation not counted); a learner group's total. NaN: a
    # model those rules do not count (learner.flops.DECODER_TYPES)
    learner_flops: float
    # learner_mfu's denominator, FLOP/s: on a GPU the card's dense datasheet rate in the
    # learner's dtype (learner.flops.PEAK_FLOPS; NaN for a card not listed), on the CPU one
    # 1024^3 float32 matmul's measured rate on the learner's threads (timed once per learner,
    # at its first update); times the learner group's size
    learner_peak_flops_per_s: float
    stale_versions: float            # how many versions behind the rollouts were (mean over their tokens: partial_rollout continue)
    kl_coef: float                   # the beta this step used (adaptive KL moves the next one)
    learning_rate: float             # the policy's lr at the step's first optimiser step
    learner_forward_s: float         # the no-grad pass (steps 2 and 6)
    update_s: float                  # the whole update, forward included
    learner_peak_memory_gib: float   # torch.cuda.max_memory_allocated during the update (NaN: not on CUDA)
    version: int                     # the adapter version after the update

    def as_dict(self) -> dict[str, float]:
        """The fields in order (loss_extra's in its place, by their own names), without the
        critic's when there is none and without an option's when it is off."""
        out: dict[str, float] = {}
        for k, v in dataclasses.asdict(self).items():
            if k == "loss_extra":
                out.update(v)
            elif v is not None:
                out[k] = v
        return out


# The critic's statistics: present exactly when the advantage estimator has a critic.
CRITIC_FIELDS = ("value_loss", "vf_clipfrac", "value_grad_norm", "explained_variance", "return_mean", "value_mean")


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
    rewards: list[float]                # the reward actor's combined score per rollout trained on (NaN: dropped)
    learner: LearnerStats
    reward_parts: dict[str, float]      # score/<source> means, dropped_nonfinite (and reward_<failure> counts)
    adapter_version: int                # the version the generators hold after the sync
    timing: StepTiming
    lora_sync_bytes: int
    response_lengths: list[int]         # tokens per rollout, EOS included (the generators' response masks)
    sync_probe_gap: float = math.nan    # the sync check's largest generator-vs-learner probe gap (NaN: off)
    sync_resyncs: int = 0               # re-syncs the step needed (a failed sync check or rollout check)
    # throughput (StepResult.rates: how each is defined); NaN when not measured
    rollout_tokens_per_s: float = math.nan
    learner_tokens_per_s: float = math.nan
    learner_flops_per_s: float = math.nan
    learner_mfu: float = math.nan
    # rollout batches drawn and generating beyond the one this step trained on, while its
    # learner trained (max_staleness k: k, fewer at the run's end; 0 in the synchronous step)
    queue_depth: float = 0.0
    # dynamic_sampling's rounds, kept fraction and filled groups; None (no keys) when it is off
    dynamic_sampling: Optional[DynamicSampling] = None
    # dynamic_sampling: every rollout's score the step generated (every round's); None without
    # it, where the rollouts trained on are all the step generated
    generated_rewards: Optional[list[float]] = None
    # multi-turn (config.environment): the step's episodes in numbers, and each rollout's
    # transcript as ("model" | "env", text) segments; None without an environment
    episodes: Optional[EpisodeStats] = None
    transcripts: Optional[list[list[tuple[str, str]]]] = None
    extra: dict[str, Any] = field(default_factory=dict)  # evaluations merged in by train()

    @property
    def reward_mean(self) -> float:
        """The mean finite score of every rollout the policy generated in the step (under
        dynamic_sampling, of every round, not only the groups kept): the reward curve."""
        return _finite_mean(self.rewards if self.generated_rewards is None else self.generated_rewards)

    @property
    def reward_trained_mean(self) -> float:
        """The mean finite score of the rollouts the step trained on (`rewards`): reward_mean
        unless dynamic_sampling kept only some of what it generated."""
        return _finite_mean(self.rewards)

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

    @staticmethod
    def rates(timing: StepTiming, learner: LearnerStats, response_tokens: float) -> dict[str, float]:
        """A step's throughput (the fields of these names; NaN where a time is 0):

        rollout_tokens_per_s   the response tokens every generator replica made together /
                               generate_s (the slowest replica's seconds: the replicas run at once)
        learner_tokens_per_s   the real response tokens the learner trained on (LearnerStats.tokens:
                               the policy loss's tokens; prompts, padding and dropped rows not
                               counted) / the learner's whole update (update_s, its no-grad pass
                               included): comparable with rollout_tokens_per_s, token for token
        learner_flops_per_s    LearnerStats.learner_flops (prompt + response tokens through every
                               forward and backward) / update_s
        learner_mfu            learner_flops_per_s / LearnerStats.learner_peak_flops_per_s: the
                               fraction of a GPU's datasheet peak, or on the CPU of one large float32
                               matmul's measured rate; NaN where the peak or the FLOPs are unknown"""
        def per_s(amount: float, seconds: float) -> float:
            return amount / seconds if seconds > 0 else math.nan

        flops_per_s = per_s(learner.learner_flops, timing.update_s)
        peak = learner.learner_peak_flops_per_s
        return {"rollout_tokens_per_s": per_s(float(response_tokens), timing.generate_s),
                "learner_tokens_per_s": per_s(learner.tokens, timing.update_s),
                "learner_flops_per_s": flops_per_s,
                "learner_mfu": flops_per_s / peak if peak > 0 else math.nan}

    def as_dict(self) -> dict[str, Any]:
        """The flat record: the metrics JSONL's line (lists included)."""
        return {
            "step": self.step,
            "generated_texts": self.generated_texts,
            "finish_reasons": self.finish_reasons,
            "rewards": self.rewards,
            "reward_mean": self.reward_mean,
            "reward_trained_mean": self.reward_trained_mean,
            **self.learner.as_dict(),
            **self.reward_parts,
            "adapter_version": self.adapter_version,
            **{f"time/{k}": v for k, v in dataclasses.asdict(self.timing).items()},
            "lora_sync_bytes": self.lora_sync_bytes,
            "sync_probe_gap": self.sync_probe_gap,
            "sync_resyncs": self.sync_resyncs,
            "tokens_per_s": self.tokens_per_s,
            "rollout_tokens_per_s": self.rollout_tokens_per_s,
            "learner_tokens_per_s": self.learner_tokens_per_s,
            "learner_flops_per_s": self.learner_flops_per_s,
            "learner_mfu": self.learner_mfu,
            "queue_depth": self.queue_depth,
            **(self.dynamic_sampling.as_dict() if self.dynamic_sampling is not None else {}),
            **(self.episodes.as_dict() if self.episodes is not None else {}),
            **({"transcripts": self.transcripts} if self.transcripts is not None else {}),
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


def _finite_mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


@dataclass
class LearnerState:
    """What a resumed run needs of the learner to continue exactly (Learner.state_dict; the
    checkpoint's learner part, ppo_ray.driver.checkpoint): the policy adapter, the value model's
    trainable tensors by name ({} without a critic), the
    optimisers' and learning-rate schedules' own state dicts (the value model's None without
    a critic; the schedules and kl_coef None in checkpoints written before they existed: the
    learner keeps its fresh ones), the KL coefficient, the RNG states and the version. CPU
    tensors only."""

    version: int
    policy: LoraWeights
    value: dict[str, torch.Tensor]
    policy_optimizer: dict
    value_optimizer: Optional[dict]
    rng: torch.Tensor
    cuda_rng: list = field(default_factory=list)
    policy_scheduler: Optional[dict] = None
    value_scheduler: Optional[dict] = None
    kl_coef: Optional[float] = None
