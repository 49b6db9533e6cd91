"""ppo_ray/metrics.py: Prometheus names for the step's keys, and what TrainingMetrics.record_step
sets (finite numbers only). Ray's metric objects work without a Ray session, so no Ray starts;
what reaches a head's Prometheus endpoint is test_deploy.py's test_submitted_job_exports_ppo_metrics.
"""

from __future__ import annotations

import re

from ppo_ray.metrics import STEP_GAUGES, TrainingMetrics, metric_name

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
