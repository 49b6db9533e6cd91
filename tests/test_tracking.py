"""ppo_ray/tracking.py without a trainer: TensorBoard event files read back with TensorBoard's
own reader (a resumed run purges the steps after its checkpoint), wandb (a stand-in module:
the package is not installed here), a missing tracker package named before anything starts,
the samples table. No Ray; the trainer's own writes are test_monitoring.py's.
"""

from __future__ import annotations

import sys
import types

import pytest

from helpers import read_events, text_at
from ppo_ray.tracking import Trackers, read_run_file, samples_markdown


# -------------------------------------------------- TensorBoard
@pytest.mark.parametrize("writers_before", [None, 9])
def test_tensorboard_resume_purges_the_steps_after_the_checkpoint(tmp_path, monkeypatch, writers_before):
    """A run logs steps 1-3, is resumed from a step-2 checkpoint and logs 3-4 again:
    TensorBoard's reader shows each step once, step 3 from the resumed run. With 9 writers
    opened before in this process, the two event files would be counters 9 and 10 of one
    second, whose names sort the resumed run's first (CI's failure of 2026-12-03): the
    trackers wait for a later second instead."""
    if writers_before is not None:
        from tensorboard.summary.writer import event_file_writer

        monkeypatch.setattr(event_file_writer._global_uid, "_value", writers_before)
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
    names = sorted(f.name for f in (tmp_path / "tensorboard").iterdir())
    assert len(names) == 2 and names[0].split(".")[3] < names[1].split(".")[3]  # seconds in name order


# -------------------------------------------------- wandb
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
    # defaults: the run directory's name, no group, no tags
    assert fake.inits[0]["name"] == tmp_path.name and fake.inits[0]["group"] is None and not fake.inits[0]["tags"]


def test_wandb_takes_project_name_group_and_tags_from_the_config(tmp_path, monkeypatch):
    from ppo_ray.config import PPOConfig

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "from-the-environment")  # the config's field wins
    config = PPOConfig(report_to=["wandb"], wandb_project="tldr", wandb_name="beta-0.05", wandb_group="kl-sweep",
                       wandb_tags="qwen3,lora").to_dict()
    Trackers.open(tmp_path, ["wandb"], config, "ppo-1234", first_step=1).close()
    init = fake.inits[0]
    assert (init["project"], init["name"], init["group"], init["tags"]) == ("tldr", "beta-0.05", "kl-sweep",
                                                                           ["qwen3", "lora"])
    assert init["config"]["wandb_group"] == "kl-sweep"


def test_a_missing_tracker_package_is_named_before_anything_starts(monkeypatch):
    from ppo_ray.tracking import TrackerError, check_trackers

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(TrackerError, match=r"report_to names 'wandb', but the package 'wandb' is not installed "
                                           r"\(pip install 'ppo-ray\[wandb\]'\)"):
        check_trackers(["tensorboard", "wandb"])
    check_trackers(["tensorboard"])


def test_samples_table_escapes_cells():
    assert samples_markdown([{"prompt": "a|b\nc", "response": "r", "reward": 0.25}]) == (
        "| prompt | response | reward |\n|---|---|---|\n| a\\|b c | r | 0.2500 |")
