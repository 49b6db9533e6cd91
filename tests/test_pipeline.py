"""ppo_ray/pipeline.py without Ray: the bundled task's data written for a run, the PPO stage's
config, the cached before-training evaluation, the report files (samples.md, curves.png).
The stages themselves run end to end in test_launch.py and test_tldr_path.py.
"""

from __future__ import annotations

import json


def test_pipeline_writes_the_configured_reference_quality(tmp_path):
    from ppo_ray.config import PPOConfig
    from ppo_ray.pipeline import write_data

    ideal = [json.loads(x)["summary"] for x in
             (write_data(PPOConfig(), tmp_path / "a") / "sft_train.jsonl").read_text().splitlines()]
    mixed = [json.loads(x)["summary"] for x in
             (write_data(PPOConfig(bundled_ideal_fraction=0.3), tmp_path / "b") / "sft_train.jsonl")
             .read_text().splitlines()]
    assert len(ideal) == len(mixed) and 0.25 < sum(a == b for a, b in zip(ideal, mixed)) / len(ideal) < 0.35
