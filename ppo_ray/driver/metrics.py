"""Per-step training metrics through Ray's metrics system, for Prometheus and the dashboard.

    metrics = TrainingMetrics(run=trainer.namespace, roles=["generator-0", "learner"],
                              lora_sync="merged")      # after ray.init; the counters at 0
    metrics.record_step(out)                           # out = PPOTrainer.ppo_step(...)
    metrics.record_retry("generator")                  # a caller retried a failed actor call
    metrics.record_logprob_gap("merged")               # a step failed the generator-vs-learner check

A step with guarded reward calls (reward_workers, reward_failure, a verifier) also counts its
failures: `ppo_reward_failures{kind=timeout|exception|nonfinite|row_dropped|row_fixed_score|
retry_call}`, from the step's reward_<kind> keys; a step with episodes (environment) counts its
environment failures and tool errors: `ppo_env_failures{kind=timeout|exception|tool_error}`.

Each node's Ray exports what its processes record on that node's Prometheus endpoint
(`ray start --metrics-export-port P` -> http://<node>:P/metrics), with Ray's `ray_` prefix:
`ppo_reward_mean` is scraped as `ray_ppo_reward_mean`, the counter `ppo_retries` as
`ray_ppo_retries_total`. Every series carries the tag `run` (the trainer's Ray namespace),
so several runs on one cluster stay apart. Measured on Ray 2.60: metrics set in the driver
(the `ray job submit` entrypoint or a plain `ray.init()` script) are exported like an
actor's, so the driver records them itself, no metrics actor is needed; a finished job's
series disappear from the endpoint some seconds after it exits; a NaN gauge is not
exported at all (record_step skips non-finite values, so a series keeps its last finite
value).

Besides the driver's Ray plumbing (ppo_ray.driver.cluster, hosts, creation, ...) and ppo_ray.driver.roles,
this module imports ray (its metrics API only); the trainer owns the one instance of a run.
"""

from __future__ import annotations

import math
import re
from typing import Mapping, Sequence

from ray.util.metrics import Counter, Gauge

# ppo_step output key -> help text. Prometheus names are built by `metric_name`.
STEP_GAUGES: dict[str, str] = {
    "step": "PPO steps completed in this run",
    "reward_mean": "mean score of every rollout the step generated (reward model and/or reward functions; under "
                   "dynamic_sampling every round's)",
    "reward_trained_mean": "mean score of the rollouts the step trained on (reward_mean unless dynamic_sampling kept "
                           "only some groups)",
    "kl": "mean per-sequence KL(policy || reference) of the step's rollouts (the sum of per-token KL)",
    "policy_loss": "PPO-clip policy loss, mean over the step's optimiser steps",
    "value_loss": "value loss, mean over the step's optimiser steps",
    "approx_kl": "approximate KL between the old and updated policy (PPO diagnostic)",
    "clipfrac": "fraction of tokens whose ratio was clipped",
    "entropy": "mean entropy of the policy over response tokens",
    "explained_variance": "explained variance of the value predictions",
    "policy_grad_norm": "policy gradient norm before clipping (max_grad_norm), mean over the step's optimiser steps",
    "value_grad_norm": "value gradient norm before clipping (max_grad_norm), mean over the step's optimiser steps",
    "tokens_per_s": "generated response tokens per second of step wall time",
    "rollout_tokens_per_s": "response tokens the generator replicas made together per second of generation (the "
                            "slowest replica's seconds, time/generate_s)",
    "learner_tokens_per_s": "real response tokens the learner trained on per second of its update (time/update_s, "
                            "its no-grad pass included)",
    "learner_flops_per_s": "the learner's achieved model FLOP/s: model FLOPs of its forwards and backwards on the real "
                           "prompt + response tokens per second of its update (learner/flops.py)",
    "learner_mfu": "learner_flops_per_s / the device's peak: a GPU's dense datasheet rate in the learner's dtype, or on "
                   "the CPU one large float32 matmul's measured rate (not set for an unlisted GPU)",
    "queue_depth": "rollout batches in flight beyond the one the step trained on, while its learner trained (0 .. max_staleness)",
    "dynamic_sampling_rounds": "dynamic_sampling: generation rounds the step ran (1 = none beyond its first batch)",
    "dynamic_sampling_kept_frac": "dynamic_sampling: groups whose scores vary / groups generated in the step",
    "dynamic_sampling_filled": "dynamic_sampling: groups of constant scores that filled the step's batch (the rounds' "
                               "cap left too few varying)",
    "episode_turns_mean": "environment: model turns per episode, mean over the step's episodes",
    "episode_tool_calls_mean": "environment: tool calls per episode, mean over the step's episodes",
    "episode_tool_call_rate": "environment: the share of the step's episodes with at least one tool call",
    "episode_env_seconds": "environment: the environments' own seconds in the step's episodes (resets and steps, summed)",
    "episode_env_token_frac": "environment: the environment's tokens / all response tokens of the step's episodes",
    "response_tokens": "response tokens generated in the step (EOS included, padding not)",
    "response_length_mean": "mean response length of the step's rollouts, in tokens (EOS included)",
    "response_length_max": "longest response of the step, in tokens (EOS included; max_new_tokens when one was cut)",
    "no_eos_frac": "fraction of the step's responses cut at max_new_tokens without EOS",
    "learner_peak_memory_gib": "peak CUDA memory allocated by the learner (rank 0) during the step's update, GiB "
                               "(torch.cuda.max_memory_allocated; not set without CUDA)",
    "adapter_version": "LoRA adapter version the generators hold after the step",
    "shaped_reward_mean": "mean per-sequence shaped return of the step: score - beta * summed KL",
    "kl_coef": "beta, the KL coefficient the step used (moves with the adaptive controller, kl_target)",
    "learning_rate": "the policy's learning rate at the step's first optimiser step (lr_scheduler)",
    "stale_versions": "adapter versions the step's rollouts were behind the learner (0 .. max_staleness; the mean over the response tokens)",
    "sync_probe_gap": "the sync check's largest |generator - learner| logprob of the probe tokens after the step's "
                      "sync, in nats (logprob_gap_tolerance bounds it)",
    "mismatch_outside_frac": "fraction of the step's sampled tokens whose probability ratio learner / generator (same "
                             "adapter version) is outside [0.9, 1.1]; NaN when not measured (stale or not recomputed)",
    "mismatch_log_ratio_abs": "mean |log pi_learner - log pi_generator| of the step's sampled tokens (same version)",
    "sync_resyncs": "re-syncs the step needed because a generator failed the sync check (0 in a healthy run)",
    "gold_val": "held-out gold-judge score of the policy, at evaluation steps (bundled task; keeps its last value)",
    "eval_reward_mean": "mean reward of the eval samples, at evaluation steps (keeps its last value)",
}
PHASE_PREFIX, PHASE_SUFFIX = "time/", "_s"
PHASE_GAUGE = "ppo_phase_seconds"  # one gauge, tagged phase=generate|reference|reward|...
RETRY_COUNTER = "ppo_retries"      # exported as ray_ppo_retries_total
GAP_COUNTER = "ppo_logprob_gap_exceeded"  # exported as ray_ppo_logprob_gap_exceeded_total
REWARD_FAILURE_COUNTER = "ppo_reward_failures"  # exported as ray_ppo_reward_failures_total{kind=...}
# kind -> the step's key (ppo_ray.stats.RewardFailures.parts: present with guarded reward calls)
REWARD_FAILURE_KINDS = {"timeout": "reward_timeouts", "exception": "reward_exceptions",
                        "nonfinite": "reward_nonfinite", "row_dropped": "reward_rows_dropped",
                        "row_fixed_score": "reward_rows_fixed_score", "retry_call": "reward_retry_calls"}
ENV_FAILURE_COUNTER = "ppo_env_failures"  # exported as ray_ppo_env_failures_total{kind=...}
# kind -> the step's key (ppo_ray.stats.EpisodeStats: present with an environment)
ENV_FAILURE_KINDS = {"timeout": "episode_timeouts", "exception": "episode_exceptions",
                     "tool_error": "episode_tool_errors"}

_PROM_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def metric_name(key: str) -> str:
    """`ppo_` + the key with every character Prometheus does not allow replaced by "_"
    ("time/generate_s" -> "ppo_time_generate_s"). Ray 2.60 accepts names with "/" or "-"
    without complaint, so the cleaning is ours."""
    name = "ppo_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
    assert _PROM_NAME.match(name), name
    return name


class TrainingMetrics:
    """The gauges and counters of one training run. Create it after Ray is initialised, in
    the process that calls record_* (Ray's metric objects are per process)."""

    def __init__(self, run: str, roles: Sequence[str] = (), lora_sync: str | None = None,
                 reward_failures: bool = False, env_failures: bool = False):
        self.run = run
        tags = ("run",)
        self._gauges = {key: Gauge(metric_name(key), description=text, tag_keys=tags)
                        for key, text in STEP_GAUGES.items()}
        self._phases = Gauge(PHASE_GAUGE, description="seconds per step phase (the time/*_s keys of ppo_step)",
                             tag_keys=("run", "phase"))
        self._retries = Counter(RETRY_COUNTER, description="actor calls retried after a failure, by role",
                                tag_keys=("run", "role"))
        self._gaps = Counter(GAP_COUNTER, description="steps whose generator-vs-learner logprob check failed "
                             "(logprob_gap_tolerance; under is_correction the rollouts' share of tokens outside "
                             "the correction's band, logprob_gap_outside_tolerance): the generator sampled from "
                             "another policy",
                             tag_keys=("run", "lora_sync"))
        self._reward_failures = Counter(
            REWARD_FAILURE_COUNTER, description="guarded reward-function calls (reward_workers, reward_failure, "
            "verifiers) by kind: calls past reward_timeout_s (timeout) or that raised (exception), function scores "
            "that were NaN/inf (nonfinite), scores dropped (row_dropped) or set to reward_failure_score "
            "(row_fixed_score) by reward_failure, extra calls that isolated failing rows (retry_call)",
            tag_keys=("run", "kind"))
        self._env_failures = Counter(
            ENV_FAILURE_COUNTER, description="multi-turn episodes (environment) by kind: an environment call past "
            "env_timeout_s (timeout) or that raised or broke the contract (exception), each ending its episode "
            "(reward_failure decides its score); tool calls that reported an error (tool_error)",
            tag_keys=("run", "kind"))
        # Every counter's series exists from the start, at 0: a counter Ray has not seen
        # incremented is not exported at all, and Grafana shows "No data" for a healthy run.
        for role in roles:
            _zero(self._retries, {"run": run, "role": role})
        if lora_sync is not None:
            _zero(self._gaps, {"run": run, "lora_sync": lora_sync})
        if reward_failures:
            for kind in REWARD_FAILURE_KINDS:
                _zero(self._reward_failures, {"run": run, "kind": kind})
        if env_failures:
            for kind in ENV_FAILURE_KINDS:
                _zero(self._env_failures, {"run": run, "kind": kind})

    def record_step(self, out: Mapping[str, object]) -> dict[str, float]:
        """Set the gauges from one ppo_step output, and count its reward failures (the
        reward_<kind> keys, when present and > 0). Missing, non-numeric and non-finite values
        are skipped (Ray drops a NaN gauge from the export anyway). Returns what was set,
        keyed by metric name (phases as ppo_phase_seconds{phase=...}, reward failures as
        ppo_reward_failures{kind=...})."""
        recorded: dict[str, float] = {}
        tags = {"run": self.run}
        for key, gauge in self._gauges.items():
            value = _finite(out.get(key))
            if value is not None:
                gauge.set(value, tags=tags)
                recorded[metric_name(key)] = value
        for key, raw in out.items():
            if key.startswith(PHASE_PREFIX) and key.endswith(PHASE_SUFFIX):
                value = _finite(raw)
                if value is not None:
                    phase = key[len(PHASE_PREFIX):-len(PHASE_SUFFIX)]
                    self._phases.set(value, tags={"run": self.run, "phase": phase})
                    recorded[f"{PHASE_GAUGE}{{phase={phase}}}"] = value
        for kind, key in REWARD_FAILURE_KINDS.items():
            value = _finite(out.get(key))
            if value:  # Counter.inc refuses 0
                self._reward_failures.inc(value, tags={"run": self.run, "kind": kind})
                recorded[f"{REWARD_FAILURE_COUNTER}{{kind={kind}}}"] = value
        for kind, key in ENV_FAILURE_KINDS.items():
            value = _finite(out.get(key))
            if value:
                self._env_failures.inc(value, tags={"run": self.run, "kind": kind})
                recorded[f"{ENV_FAILURE_COUNTER}{{kind={kind}}}"] = value
        return recorded

    def record_logprob_gap(self, lora_sync: str) -> None:
        """Count a step whose generator-vs-learner logprob gap exceeded the tolerance
        (config.logprob_gap_check), tagged with the sync mode."""
        self._gaps.inc(1.0, tags={"run": self.run, "lora_sync": lora_sync})

    def record_retry(self, role: str, n: int = 1) -> None:
        """Count `n` retried calls to the actor `role` (generator-0, learner, reference, reward).
        The retry logic itself lives with the caller."""
        self._retries.inc(float(n), tags={"run": self.run, "role": role})


def _zero(counter: Counter, tags: dict[str, str]) -> None:
    """Export `counter`'s series with `tags` at 0. Counter.inc refuses 0 (Ray 2.60); the
    Metric._record under it takes it, and the series then reads 0.0 on the node's endpoint
    (measured). A Ray without it: the series appears at its first increment, as before."""
    record = getattr(counter, "_record", None)
    if callable(record):
        record(0.0, tags=tags)


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None
