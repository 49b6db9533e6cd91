"""The task registry (ppo_ray/tasks/base.py): config.task names a registered task or a
"module:object" of one's own; bad names are errors that say what is wrong; and a task written
in one file outside the project runs through launch.py, every stage, with no edit of ppo-ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import ROOT

# A task of one's own, in one file: copy the number. Its data writer, its verifier (the row's
# `answer` column, as the ground-truth columns reach a reward function), its evaluation and report.
USER_TASK = '''
"""Copy the number: the prompt "47>" asks for "47" then EOS."""
import json
import random
from pathlib import Path

from ppo_ray.tasks.base import Task
from ppo_ray.tasks.evaluation import generate, mean
from ppo_ray.tasks.pipeline import final_rewards, plot_curves, read_metrics

SIZES = {"sft_train": 128, "sft_validation": 8, "prompts_train": 32, "prompts_validation": 8, "prompts_test": 8}


def verify(prompts, completions, *, finish_reasons, answer):
    """1.0 for the row's answer followed by EOS, else 0.0."""
    return [1.0 if f == "stop" and c.strip() == a else 0.0 for c, f, a in zip(completions, finish_reasons, answer)]


class CopyNumber(Task):
    name = "copy-number"
    stages = ("sft", "ppo")
    sft_target = "answer"
    verifier = verify

    def data_spec(self, config):
        return {"task": config.task, "seed": config.seed}

    def write_data(self, data_dir, config):
        rng = random.Random(config.seed)
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        for split, n in SIZES.items():
            numbers = [rng.randint(10, 99) for _ in range(n)]
            rows = [{"id": f"{split}-{i}", "prompt": f"{x}>", "answer": str(x)} for i, x in enumerate(numbers)]
            (Path(data_dir) / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))

    def evaluate(self, trainer, cfg, rows, *, label=None):
        out = generate(trainer, rows, greedy=True, label=label)
        right = verify([r["prompt"] for r in rows], out.texts, finish_reasons=out.finish_reasons,
                       answer=[r["answer"] for r in rows])
        return {"texts": out.texts, "finish_reasons": out.finish_reasons, "right": right}

    def periodic(self, trainer, cfg, rows):
        return {"exact_val": mean(self.evaluate(trainer, cfg, rows)["right"])}

    def report(self, run_dir, metrics, cfg, test_rows, val_rows, sft, after, after_val):
        history = read_metrics(metrics)
        with open(Path(run_dir) / "held_out.jsonl", "w") as f:
            for i, row in enumerate(test_rows):
                f.write(json.dumps({"index": i, **row, **{f"{who}{key}": res[name][i] for who, res in
                                    (("sft", sft), ("ppo", after)) for key, name in
                                    (("", "texts"), ("_finish", "finish_reasons"))}}) + "\\n")
        plot_curves(metrics, Path(run_dir) / "curves.png", mean(sft["val"]["right"]), gold_key="exact_val",
                    gold_title="exact copies (validation, greedy)", reward_title="verifier reward")
        return {"exact_test_sft": mean(sft["right"]), "exact_test_ppo": mean(after["right"]),
                "exact_val_sft": mean(sft["val"]["right"]), "exact_val_ppo": mean(after_val["right"]),
                **final_rewards(history), "ppo_steps": len(history), "eval_prompts": len(test_rows)}


TASK = CopyNumber()
'''


def _user_task(tmp_path, module: str = "mytask_module", text: str = USER_TASK):
    (tmp_path / "pkg").mkdir(exist_ok=True)
    (tmp_path / "pkg" / f"{module}.py").write_text(textwrap.dedent(text))
    return tmp_path / "pkg"


@pytest.fixture
def user_task_path(tmp_path, monkeypatch):
    path = _user_task(tmp_path)
    monkeypatch.syspath_prepend(str(path))
    yield path
    sys.modules.pop("mytask_module", None)


def test_the_registered_tasks_declare_their_stages_data_and_reward():
    from ppo_ray.config import TASKS
    from ppo_ray.tasks.base import get_task

    assert set(TASKS) >= {"tldr", "arith"}
    tldr, arith = get_task("tldr"), get_task("arith")
    assert tldr.stages == ("sft", "rm", "ppo") and tldr.verifier is None and tldr.sft_target == "summary"
    assert arith.stages == ("sft", "ppo") and arith.verifier_spec == "ppo_ray.tasks.arith:verify"
    assert arith.sft_target == "answer" and arith.policy_name == "rl"
    assert get_task("ppo_ray.tasks.arith:TASK") is arith  # the same object by its import path
    assert get_task("ppo_ray.tasks.arith:ArithTask").name == "arith"  # a Task class is instantiated
    chat = get_task("arith-chat")  # RL from the base model: no SFT stage, the base as "before"
    assert chat.stages == ("ppo",) and chat.before_name == "base"
    assert chat.verifier_spec == "ppo_ray.tasks.arith:verify_last_number"


@pytest.mark.parametrize("value, expected", [
    ("summarise", "'task' = 'summarise' is invalid: must be a registered task (tldr, arith"),
    ("a b:c", "'task' = 'a b:c' is invalid"),
    ("mod:", "'task' = 'mod:' is invalid"),
])
def test_a_task_name_that_is_neither_registered_nor_module_object_is_named(value, expected):
    from ppo_ray.config import ConfigError, PPOConfig

    with pytest.raises(ConfigError) as e:
        PPOConfig(task=value)
    assert expected in str(e.value)


def test_a_module_object_that_does_not_import_or_is_no_task_is_named(tmp_path, monkeypatch):
    from ppo_ray.tasks.base import Task, TaskError, get_task

    path = _user_task(tmp_path, "not_tasks", '''
        from ppo_ray.tasks.base import Task

        NUMBER = 3

        class Bad(Task):
            name = "bad"
            stages = ("sft", "rm", "ppo")
            verifier = "not_tasks:NUMBER"  # a reward-model stage and a verifier: one too many
            data_spec = write_data = evaluate = report = lambda self, *a, **k: {}

        class Abstract(Task):
            name = "abstract"

        class NoSFT(Bad):  # RL from the base model, but its report would call the base "sft"
            stages = ("ppo",)

        class RMFirst(Bad):
            stages = ("rm", "ppo")
        ''')
    monkeypatch.syspath_prepend(str(path))
    cases = {"no_such_module_here:TASK": "cannot import module 'no_such_module_here'",
             "not_tasks:TASK": "module 'not_tasks' has no 'TASK'",
             "not_tasks:NUMBER": "int 3 is not a ppo_ray.tasks.base.Task",
             "not_tasks:Bad": "a task has a reward-model stage ('rm'), or a verifier and/or an environment",
             "not_tasks:Abstract": "Abstract() cannot be made: Can't instantiate abstract class",
             "not_tasks:NoSFT": "with no SFT stage the starting policy is the base model: set before_name",
             "not_tasks:RMFirst": "stages ('rm', 'ppo') must be ('ppo',) (RL from the base model) or start with"}
    for spec, expected in cases.items():
        with pytest.raises(TaskError) as e:
            get_task(spec)
        assert f"task {spec!r}" in str(e.value) and expected in str(e.value), (spec, str(e.value))
    with pytest.raises(TaskError, match="'summarise' is not registered \\(registered: tldr, arith"):
        get_task("summarise")

    class Incomplete(Task):  # its data, evaluation and report left out: not a task yet
        name = "x"
    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


def test_a_registered_task_is_a_config_choice(user_task_path):
    import mytask_module

    from ppo_ray.config import TASKS, PPOConfig
    from ppo_ray.tasks.base import TaskError, get_task, register_task

    try:
        register_task(mytask_module.TASK)
        assert PPOConfig(task="copy-number").task == "copy-number"
        assert get_task("copy-number") is mytask_module.TASK
        with pytest.raises(TaskError, match="registered already"):
            register_task(get_task("arith"), name="copy-number")
    finally:
        TASKS.pop("copy-number", None)
    assert get_task("mytask_module:TASK").verifier_spec == "mytask_module:verify"


def test_the_users_task_writes_its_data_and_declares_its_ppo_config(user_task_path, tmp_path):
    """The pipeline's steps before any actor: the task's files and stamp, its SFT targets, the
    PPO stage's reward (its verifier) and prompts."""
    from ppo_ray.config import PPOConfig
    from ppo_ray.tasks import pipeline

    config = PPOConfig.from_yaml("arith-tiny", task="mytask_module:TASK")
    assert pipeline.task_stages(config) == ("sft", "ppo")
    data = pipeline.write_data(config, tmp_path / "run")
    assert json.loads((data / pipeline.DATA_STAMP).read_text()) == {"task": "mytask_module:TASK", "seed": 0}
    assert sorted(p.name for p in data.glob("*.jsonl")) == sorted(
        f"{s}.jsonl" for s in ("sft_train", "sft_validation", "prompts_train", "prompts_validation", "prompts_test"))
    cfg = pipeline.ppo_config(config, tmp_path / "run", data)
    assert cfg.reward_funcs == ["mytask_module:verify"] and cfg.reward_model_name is None
    assert cfg.dataset == str(data / "prompts_train.jsonl")
    with pytest.raises(ValueError, match="needs the reward-model stage, which task mytask_module:TASK does not"):
        pipeline.ppo_config(config.replace(advantage_estimator="gae", value_model_name="rm"), tmp_path / "run", data)


def test_launch_names_a_task_it_cannot_use_and_writes_nothing(tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ""}
    for task, expected in (("nowhere_module:TASK", "task 'nowhere_module:TASK': cannot import module"),
                           ("summarise", "'task' = 'summarise' is invalid: must be a registered task (tldr, arith")):
        proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--task", task, "--run_dir",
                               str(tmp_path / "run")], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and expected in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists(), "a rejected command must not write a run directory"


@pytest.mark.heavy("runs every stage of a user's task through Ray and vLLM")
def test_a_task_in_one_file_outside_the_project_runs_through_launch(tmp_path):
    """`task: mytask_module:TASK` with its folder on PYTHONPATH: data -> SFT -> RL with the task's
    verifier -> its evaluation, in report.json and report.html; nothing of ppo-ray edited."""
    path = _user_task(tmp_path)
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": os.pathsep.join(
        [str(path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--config", "arith-tiny", "--task", "mytask_module:TASK",
         "--run_dir", str(run_dir), "--steps", "2", "--sft_epochs", "1", "--eval_size", "8", "--eval_every", "1",
         "--batch_size", "32", "--micro_batch_size", "32", "--vllm_kv_cache_gib", "0.25"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == report
    assert not (run_dir / "rm").exists() and "sft_val_loss" in report and report["ppo_steps"] == 2
    # the report's numbers are the held-out samples', recomputed here by the task's own rule
    held = [json.loads(x) for x in (run_dir / "held_out.jsonl").read_text().splitlines()]
    assert len(held) == report["eval_prompts"] == 8
    before = json.loads((run_dir / "eval-before-ppo.json").read_text())
    assert [h["sft"] for h in held] == before["texts"]  # the SFT policy's evaluation, kept before training
    sys.path.insert(0, str(path))
    try:
        from mytask_module import verify
    finally:
        sys.path.remove(str(path))
        sys.modules.pop("mytask_module", None)
    for who in ("sft", "ppo"):
        right = verify([h["prompt"] for h in held], [h[who] for h in held],
                       finish_reasons=[h[f"{who}_finish"] for h in held], answer=[h["answer"] for h in held])
        assert report[f"exact_test_{who}"] == sum(right) / 8, who
    for key in ("exact_test_sft", "exact_test_ppo", "exact_val_sft", "exact_val_ppo", "final_reward"):
        assert 0.0 <= report[key] <= 1.0, key
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(0 <= m["exact_val"] <= 1 for m in metrics)
    assert all(m["score/mytask_module:verify"] == m["reward_mean"] for m in metrics)  # its verifier was the reward
    assert json.loads((run_dir / "data" / "task.json").read_text()) == {"task": "mytask_module:TASK", "seed": 0}
    page = (run_dir / "report.html").read_text()
    assert "exact" in page and "mytask_module:TASK" in page
    for name in ("curves.png", "sft/model.safetensors", "adapter/adapter_model.safetensors"):
        assert (run_dir / name).is_file(), name


def test_launch_runs_only_the_stages_of_a_task_without_sft(tmp_path, capsys, monkeypatch):
    """Task arith-chat has stage ppo only: `launch.py sft` is refused naming its stages, and
    `launch.py ppo` needs no sft/ directory (it gets past that check to the next, an
    unreachable Ray address); a chat template is refused where a stage trains on plain text."""
    import launch

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # no cluster there: nothing starts
    run = tmp_path / "run"
    assert launch.main(["sft", "--config", "smollm2-arith", "--run_dir", str(run)]) == 2
    assert "task 'arith-chat' has no stage 'sft'; its stages: ppo" in capsys.readouterr().err
    assert launch.main(["ppo", "--config", "smollm2-arith", "--run_dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "needs" not in err and "127.0.0.1:1" in err, err
    assert launch.main(["--config", "arith-tiny", "--apply_chat_template", "true", "--run_dir", str(run)]) == 2
    assert "stage 'sft' trains on plain text" in capsys.readouterr().err
    assert not run.exists()
