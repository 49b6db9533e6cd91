"""Monitoring a run: the per-step log line, TensorBoard event files read back with
TensorBoard's own reader, wandb (a stand-in module: the package is not installed here),
the eval samples, the run tag, the exported gauges and the Grafana dashboard.

The trainer test steps the suite's shared tiny trainer twice with a run directory (about
10 s); everything else runs without Ray.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import types
from pathlib import Path

import pytest

from ppo_ray.logs import format_step, quiet_env, setup_logging
from ppo_ray.metrics import GAP_COUNTER, PHASE_GAUGE, RETRY_COUNTER, STEP_GAUGES, metric_name
from ppo_ray.tracking import Trackers, read_run_file, samples_markdown, scalars

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "ppo-ray.json"


def read_events(log_dir: Path):
    """TensorBoard's own reader over every event file of a run (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def text_at(acc, tag: str) -> dict[int, str]:
    """Text summaries (add_text) by step: TensorBoard stores them as string tensors."""
    return {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)}


# ----------------------------------------------------------------------------- the console line
def test_one_log_line_per_step_names_the_numbers_a_user_watches():
    out = {"step": 3, "reward_mean": 0.5, "kl": 1.25, "kl_coef": 0.05, "policy_loss": -0.01, "value_loss": 0.2,
           "gold_val": 0.61, "time/step_s": 2.5, "tokens_per_s": 96.0}
    line = format_step(out, total=20)
    assert line == ("step 3/20  reward +0.5000  kl 1.2500  beta 0.05  policy_loss -0.0100  value_loss 0.2000  "
                    "gold_val 0.610  2.50 s  96 tok/s")
    not_evaluated = {k: v for k, v in out.items() if k != "gold_val"}
    assert "gold" not in format_step(not_evaluated) and format_step(not_evaluated).startswith("step 3  reward")


@pytest.fixture
def root_logger():
    """The root logger's and the libraries' levels and handlers, put back afterwards."""
    root = logging.getLogger()
    saved = root.level, list(root.handlers), {n: logging.getLogger(n).level for n in ("ray", "vllm")}
    yield root
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    for name, level in saved[2].items():
        logging.getLogger(name).setLevel(level)


def test_logging_setup_and_quiet_libraries(monkeypatch, capsys, root_logger):
    import io

    stream = io.StringIO()
    setup_logging("info", stream=stream)
    logging.getLogger("ppo_ray.trainer").info("hello")
    logging.getLogger("ray").info("ray's own start-up line")
    assert "INFO ppo_ray.trainer: hello" in stream.getvalue() and "start-up" not in stream.getvalue()
    setup_logging("warning", stream=stream)  # replaces its own handler, does not add a second
    assert root_logger.level == logging.WARNING and sum(getattr(h, "_ppo_ray", False) for h in root_logger.handlers) == 1
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert quiet_env("info")["VLLM_LOGGING_LEVEL"] == "ERROR" and quiet_env("debug")["VLLM_LOGGING_LEVEL"] == "INFO"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert quiet_env("info")["VLLM_LOGGING_LEVEL"] == "DEBUG"  # the user's own setting wins


# ----------------------------------------------------------------------------- TensorBoard
def test_tensorboard_resume_purges_the_steps_after_the_checkpoint(tmp_path):
    """A run logs steps 1-3, is resumed from a step-2 checkpoint and logs 3-4 again:
    TensorBoard's reader shows each step once, step 3 from the resumed run."""
    first = Trackers.open(tmp_path, ["tensorboard"], {"seed": 0}, "ppo-first", first_step=1)
    for step in (1, 2, 3):
        first.log_step({"step": step, "reward_mean": float(step), "time/step_s": 1.0})
    first.close()
    second = Trackers.open(tmp_path, ["tensorboard"], {"seed": 0}, "ppo-second", first_step=3)
    for step in (3, 4):
        second.log_step({"step": step, "reward_mean": 10.0 * step, "time/step_s": 1.0})
    second.close()
    acc = read_events(tmp_path / "tensorboard")
    assert [(e.step, e.value) for e in acc.Scalars("train/reward_mean")] == [(1, 1.0), (2, 2.0), (3, 30.0),
                                                                             (4, 40.0)]
    assert text_at(acc, "run/tag/text_summary") == {0: "ppo-first"}


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
                 "train/tokens_per_s", "eval/eval_reward_mean"):
        assert name in acc.Tags()["scalars"], name

    rows = [json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [last["step"]] * 3 and [r["prompt"] for r in rows] == prompts[:3]
    assert all(isinstance(r["reward"], float) and isinstance(r["response"], str) for r in rows)
    assert last["eval_reward_mean"] == pytest.approx(sum(r["reward"] for r in rows) / 3)
    table = text_at(acc, "eval/samples/text_summary")[last["step"]]
    assert table.startswith("| prompt | response | reward |") and rows[0]["response"].replace("|", "\\|")[:20] in table

    assert read_run_file(tmp_path)["run_tag"] == trainer.namespace and trainer.namespace.startswith("ppo-")


# ----------------------------------------------------------------------------- wandb
class FakeWandb(types.ModuleType):
    """The slice of the wandb API the trackers use, recording the calls."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logs, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        run = types.SimpleNamespace(id=kwargs.get("id") or "abc123")
        run.log = lambda values, step: self.logs.append((step, values))
        run.finish = lambda: setattr(self, "finished", self.finished + 1)
        return run

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data


def test_wandb_gets_the_config_the_steps_and_the_samples_and_resumes_its_run(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "my-project")
    trackers = Trackers.open(tmp_path, ["wandb"], {"kl_coef": 0.05}, "ppo-1234", first_step=1)
    trackers.log_step({"step": 1, "reward_mean": 0.5, "generated_texts": ["x"], "kl": float("nan")})
    trackers.log_samples(1, [{"prompt": "p", "response": "r", "reward": 1.0}])
    trackers.close()
    assert fake.inits[0]["project"] == "my-project" and fake.inits[0]["config"]["run_tag"] == "ppo-1234"
    assert fake.logs[0] == (1, {"train/reward_mean": 0.5})  # no texts, no NaN
    table = fake.logs[1][1]["eval/samples"]
    assert table.columns == ["prompt", "response", "reward"] and table.data == [["p", "r", 1.0]]
    assert fake.finished == 1 and read_run_file(tmp_path)["wandb_id"] == "abc123"
    Trackers.open(tmp_path, ["wandb"], {}, "ppo-5678", first_step=2).close()  # a resumed run
    assert fake.inits[1]["id"] == "abc123" and fake.inits[1]["resume"] == "allow"


def test_a_missing_tracker_package_is_named_before_anything_starts(monkeypatch):
    from ppo_ray.tracking import TrackerError, check_trackers

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(TrackerError, match=r"report_to names 'wandb', but the package 'wandb' is not installed "
                                           r"\(pip install wandb\)"):
        check_trackers(["tensorboard", "wandb"])
    check_trackers(["tensorboard"])


def test_samples_table_escapes_cells():
    assert samples_markdown([{"prompt": "a|b\nc", "response": "r", "reward": 0.25}]) == (
        "| prompt | response | reward |\n|---|---|---|\n| a\\|b c | r | 0.2500 |")


# ----------------------------------------------------------------------------- Grafana
def exported_metrics() -> set[str]:
    """Every series name the driver exports (Ray adds ray_; counters get _total)."""
    names = {f"ray_{metric_name(key)}" for key in STEP_GAUGES}
    return names | {f"ray_{PHASE_GAUGE}", f"ray_{RETRY_COUNTER}_total", f"ray_{GAP_COUNTER}_total"}


def test_grafana_dashboard_parses_and_names_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    named = {m for e in exprs for m in re.findall(r"\bray_ppo_\w+", e)}
    exported = exported_metrics()
    assert named <= exported, f"the dashboard names metrics nobody exports: {sorted(named - exported)}"
    assert exported <= named, f"exported metrics without a panel: {sorted(exported - named)}"
    # every query is of one run, chosen by the dashboard's variable (the run tag)
    assert all('run=~"$run"' in e for e in exprs if "ray_ppo_" in e), exprs
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["run"]["query"]["query"] == "label_values(ray_ppo_step, run)"
    assert variables["datasource"]["type"] == "datasource"
    # one row per group the issue names, each with panels under it
    rows = [p["title"] for p in dashboard["panels"] if p.get("type") == "row"]
    assert rows == ["Reward and KL", "Losses and PPO diagnostics", "Phase seconds", "Throughput", "Retries and checks"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "ppo-ray"
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
