"""ppo_ray/driver/metrics.py: Prometheus names for the step's keys, and what TrainingMetrics.record_step
sets (finite numbers only). Ray's metric objects work without a Ray session, so no Ray starts;
what reaches a head's Prometheus endpoint is test_deploy.py's test_submitted_job_exports_ppo_metrics.
"""

from __future__ import annotations

import re

from ppo_ray.driver.metrics import STEP_GAUGES, TrainingMetrics, metric_name

PROM_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def test_metric_names_are_prometheus_names_and_bad_values_are_skipped():
    for key in STEP_GAUGES:
        assert PROM_NAME.fullmatch(metric_name(key)), key
    assert metric_name("time/sync_write_s") == "ppo_time_sync_write_s"
    recorded = TrainingMetrics(run="unit").record_step({
        "step": 3, "kl": 0.5, "reward_mean": float("nan"), "clipfrac": float("inf"), "policy_loss": None,
        "adapter_version": 3, "generated_texts": ["x"], "time/generate_s": 1.25, "time/sync_s": float("nan")})
    assert recorded == {"ppo_step": 3.0, "ppo_kl": 0.5, "ppo_adapter_version": 3.0,
                        "ppo_phase_seconds{phase=generate}": 1.25}


def test_record_step_sets_only_finite_numbers_and_phase_keys_of_the_time_s_form():
    recorded = TrainingMetrics(run="unit").record_step({
        "step": True, "kl": "0.5", "entropy": 2, "time/generate": 1.0, "timing/x_s": 2.0, "time/sync_s": 3})
    # a bool is not a number here; "time/generate" lacks the _s suffix, "timing/x_s" the time/ prefix
    assert recorded == {"ppo_entropy": 2.0, "ppo_phase_seconds{phase=sync}": 3.0}


def test_metric_name_replaces_what_prometheus_does_not_allow():
    assert metric_name("eval/gold-val score") == "ppo_eval_gold_val_score"


def test_every_step_gauge_is_a_key_of_the_step_result():
    """A gauge whose key no step produces would never be set: every STEP_GAUGES key is in
    StepResult.as_dict() (the evaluation keys arrive through its `extra`, at evaluation steps)."""
    from ppo_ray.stats import DynamicSampling, EpisodeStats
    from helpers import step_result

    record = step_result().as_dict()
    dynamic = {"dynamic_sampling_rounds", "dynamic_sampling_kept_frac", "dynamic_sampling_filled"}
    episodes = {"episode_turns_mean", "episode_tool_calls_mean", "episode_tool_call_rate", "episode_env_seconds",
                "episode_env_token_frac"}  # with an environment (EpisodeStats)
    assert set(STEP_GAUGES) - set(record) == {"gold_val", "eval_reward_mean", *dynamic, *episodes}
    assert episodes <= set(step_result(episodes=EpisodeStats.of([])).as_dict())
    # dynamic sampling's keys come with its stats (config dynamic_sampling), and are gauges
    record = step_result(dynamic_sampling=DynamicSampling(rounds=2, kept_frac=0.625, filled=0)).as_dict()
    assert set(STEP_GAUGES) - set(record) == {"gold_val", "eval_reward_mean", *episodes}
    assert TrainingMetrics(run="unit").record_step({k: record[k] for k in dynamic}) == {
        "ppo_dynamic_sampling_rounds": 2.0, "ppo_dynamic_sampling_kept_frac": 0.625, "ppo_dynamic_sampling_filled": 0.0}


def test_response_length_eos_grad_norm_and_memory_gauges():
    recorded = TrainingMetrics(run="unit").record_step({
        "response_length_mean": 12.5, "response_length_max": 32.0, "no_eos_frac": 0.25, "policy_grad_norm": 0.5,
        "value_grad_norm": 2.0, "learner_peak_memory_gib": float("nan")})  # NaN: a learner without CUDA
    assert recorded == {"ppo_response_length_mean": 12.5, "ppo_response_length_max": 32.0, "ppo_no_eos_frac": 0.25,
                        "ppo_policy_grad_norm": 0.5, "ppo_value_grad_norm": 2.0}


def test_throughput_gauges():
    """The step's rates are gauges; an MFU without a known peak (NaN) is not exported."""
    recorded = TrainingMetrics(run="unit").record_step({
        "rollout_tokens_per_s": 400.0, "learner_tokens_per_s": 120.0, "learner_flops_per_s": 2.5e10,
        "learner_mfu": float("nan"), "queue_depth": 0.0})
    assert recorded == {"ppo_rollout_tokens_per_s": 400.0, "ppo_learner_tokens_per_s": 120.0,
                        "ppo_learner_flops_per_s": 2.5e10, "ppo_queue_depth": 0.0}


def test_reward_failures_are_counted_by_kind():
    """A step with guarded reward calls counts its failures (the reward_<kind> keys > 0); a step
    without them (the default path: no such keys) counts nothing."""
    metrics = TrainingMetrics(run="unit", reward_failures=True)  # the series exist at 0
    recorded = metrics.record_step({"reward_timeouts": 2.0, "reward_exceptions": 0.0, "reward_nonfinite": 1.0,
                                    "reward_rows_dropped": 1.0, "reward_rows_fixed_score": 0.0,
                                    "reward_retry_calls": 2.0})
    assert recorded == {"ppo_reward_failures{kind=timeout}": 2.0, "ppo_reward_failures{kind=nonfinite}": 1.0,
                        "ppo_reward_failures{kind=row_dropped}": 1.0, "ppo_reward_failures{kind=retry_call}": 2.0}
    assert TrainingMetrics(run="unit").record_step({"step": 1}) == {"ppo_step": 1.0}
