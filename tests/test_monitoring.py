"""Monitoring a run end to end: the trainer's TensorBoard event files read back with
TensorBoard's own reader, the eval samples, the run tag, and the Grafana dashboard against
the exported gauges. The modules' own tests: test_logs.py (the per-step log line),
test_tracking.py (TensorBoard resume, wandb, the samples table), test_metrics.py.

The trainer test steps the suite's shared tiny trainer twice with a run directory (about
10 s); the dashboard test runs without Ray.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import read_events, text_at
from ppo_ray.driver.metrics import (ENV_FAILURE_COUNTER, GAP_COUNTER, PHASE_GAUGE, REWARD_FAILURE_COUNTER, RETRY_COUNTER,
                                    STEP_GAUGES, metric_name)
from ppo_ray.tracking import read_run_file, scalars

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "ppo-ray.json"


# ----------------------------------------------------------------------------- TensorBoard
def test_train_writes_tensorboard_eval_samples_and_the_run_tag(tiny_trainer, tmp_path):
    """Two steps of the shared tiny trainer with a run directory: every scalar of
    metrics.jsonl is in the event files at its step (read back with TensorBoard's reader),
    the eval samples (the last step is an evaluation) are in eval_samples.jsonl and in the
    text tab, and run.json names the run tag that labels the Prometheus series."""
    from ppo_ray.data import bundled_prompts

    trainer = tiny_trainer
    prompts = bundled_prompts()
    trainer.run_dir = tmp_path
    try:
        history = trainer.train(prompts, steps=2, metrics_path=tmp_path / "metrics.jsonl", eval_prompts=prompts[:3],
                                progress=False)
    finally:
        trainer.run_dir = None
    last = history[-1]
    acc = read_events(tmp_path / "tensorboard")
    logged = {line["step"]: line for line in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert sorted(logged) == [h["step"] for h in history]
    for step, line in logged.items():
        for name, value in scalars(line).items():
            events = {e.step: e.value for e in acc.Scalars(name)}
            assert events[step] == pytest.approx(value, rel=1e-6, abs=1e-9), (name, step)
    for name in ("train/reward_mean", "train/kl", "train/policy_loss", "train/value_loss", "time/step_s",
                 "train/tokens_per_s", "eval/eval_reward_mean", "train/response_length_max", "train/no_eos_frac",
                 "train/policy_grad_norm", "train/rollout_tokens_per_s", "train/learner_tokens_per_s",
                 "train/learner_flops_per_s", "train/learner_mfu", "train/queue_depth", "train/learner_flops"):
        assert name in acc.Tags()["scalars"], name
    # the response lengths come from the generators' masks: one per rollout, a response cut
    # without EOS is max_new_tokens long, one with EOS at most that
    lengths, reasons, cap = last["response_lengths"], last["finish_reasons"], trainer.config.max_new_tokens
    assert len(lengths) == len(reasons) == len(last["rewards"]) and sum(lengths) == last["response_tokens"]
    assert all(n == cap if r == "length" else 1 <= n <= cap for n, r in zip(lengths, reasons)), (lengths, reasons)
    assert last["no_eos_frac"] == reasons.count("length") / len(reasons)

    rows = [json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    # the shared trainer may start at any step: the first step evaluates too when eval_every divides it
    every = trainer.config.eval_every
    evaluated = [h["step"] for h in history if (every and h["step"] % every == 0) or h is last]
    assert [r["step"] for r in rows] == [s for s in evaluated for _ in range(3)]
    assert [r["prompt"] for r in rows] == prompts[:3] * len(evaluated)
    rows = rows[-3:]  # the last step's
    assert all(isinstance(r["reward"], float) and isinstance(r["response"], str) for r in rows)
    assert last["eval_reward_mean"] == pytest.approx(sum(r["reward"] for r in rows) / 3)
    table = text_at(acc, "eval/samples/text_summary")[last["step"]]
    # a cell as samples_markdown writes it: | escaped, newlines as spaces (a sampled response may hold both)
    assert table.startswith("| prompt | response | reward |") and \
        rows[0]["response"].replace("|", "\\|").replace("\n", " ")[:20] in table

    assert read_run_file(tmp_path)["run_tag"] == trainer.namespace and trainer.namespace.startswith("ppo-")


def test_the_run_tag_is_ppo_ray_run_tag_when_set(monkeypatch):
    """deploy/submit.sh hands the job its run tag (PPO_RAY_RUN_TAG, also in the submission id);
    a tag that cannot name a Ray namespace and a Prometheus label is refused, naming the
    variable; unset, a fresh ppo-<8 hex> each time."""
    from ppo_ray.driver.runlog import RUN_TAG_ENV, new_run_tag

    monkeypatch.delenv(RUN_TAG_ENV, raising=False)
    first, second = new_run_tag(), new_run_tag()
    assert re.fullmatch(r"ppo-[0-9a-f]{8}", first) and first != second
    monkeypatch.setenv(RUN_TAG_ENV, "ppo-1a2b3c4d")
    assert new_run_tag() == "ppo-1a2b3c4d"
    for bad in ("my run", "-x", "a/b", "x" * 64):
        monkeypatch.setenv(RUN_TAG_ENV, bad)
        with pytest.raises(ValueError, match=rf"PPO_RAY_RUN_TAG={re.escape(repr(bad))} is not a run tag"):
            new_run_tag()


def test_actor_calls_are_labelled_by_their_seed_step():
    """The generator's and the reward actor's log lines name the call: a training step
    (1-based), the eval samples, or PPOTrainer.generate's samples."""
    from ppo_ray.driver.roles import EVAL_SEED_STEP, SAMPLING_SEED_STEP, call_label

    assert [call_label(s) for s in (0, 41, SAMPLING_SEED_STEP, EVAL_SEED_STEP)] == ["step 1", "step 42", "samples",
                                                                                    "eval"]


# ----------------------------------------------------------------------------- Grafana
def exported_metrics() -> set[str]:
    """Every series name the driver exports (Ray adds ray_; counters get _total)."""
    names = {f"ray_{metric_name(key)}" for key in STEP_GAUGES}
    return names | {f"ray_{PHASE_GAUGE}", f"ray_{RETRY_COUNTER}_total", f"ray_{GAP_COUNTER}_total",
                    f"ray_{REWARD_FAILURE_COUNTER}_total", f"ray_{ENV_FAILURE_COUNTER}_total"}


def ray_dashboard_filters() -> set[str]:
    """The label filters Ray's own default Grafana dashboard puts in every query (Ray 2.60:
    ray/dashboard/modules/metrics/dashboards/default_dashboard_panels.py)."""
    from ray.dashboard.modules.metrics.dashboards.default_dashboard_panels import default_dashboard_config

    return set(default_dashboard_config.standard_global_filters)


def test_grafana_dashboard_parses_and_names_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    named = {m for e in exprs for m in re.findall(r"\bray_ppo_\w+", e)}
    exported = exported_metrics()
    assert named <= exported, f"the dashboard names metrics nobody exports: {sorted(named - exported)}"
    assert exported <= named, f"exported metrics without a panel: {sorted(exported - named)}"
    # every query is of one run, chosen by the dashboard's variable (the run tag), within the
    # cluster and the session chosen as Ray's own dashboards filter them (their global filters:
    # the ray_io_cluster label KubeRay's PodMonitor adds and the SessionName label Ray adds)
    ray_filters = ray_dashboard_filters()
    assert ray_filters == {'SessionName=~"$SessionName"', 'ray_io_cluster=~"$Cluster"'}, ray_filters
    for e in exprs:
        assert 'run=~"$run"' in e and all(f in e for f in ray_filters), e
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["run"]["query"]["query"] == (
        'label_values(ray_ppo_step{SessionName=~"$SessionName", ray_io_cluster=~"$Cluster"}, run)')
    assert variables["SessionName"]["query"]["query"] == (
        'label_values(ray_ppo_step{ray_io_cluster=~"$Cluster"}, SessionName)')
    assert variables["Cluster"]["query"]["query"] == "label_values(ray_ppo_step, ray_io_cluster)"
    # All = any value; for Cluster also none (outside Kubernetes no PodMonitor adds the label), as in Ray's
    assert variables["Cluster"]["allValue"] == ".*" and variables["SessionName"]["allValue"] == ".+"
    assert all(variables[name]["includeAll"] and variables[name]["type"] == "query"
               for name in ("Cluster", "SessionName", "run"))
    assert variables["datasource"]["type"] == "datasource"
    # one row per group the issue names, each with panels under it
    rows = [p["title"] for p in dashboard["panels"] if p.get("type") == "row"]
    assert rows == ["Reward and KL", "Losses and PPO diagnostics", "Phase seconds", "Throughput", "Retries and checks"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "ppo-ray"
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
