"""Multi-turn episodes through PPOTrainer on real Ray actors, the real vLLM engine and real PEFT
LoRA (tiny model), with the environment on a Ray environment worker (env_workers 1): the step's
scores are the episodes' environment rewards, the step reports its episodes, a hanging
environment step is cut at env_timeout_s and the run goes on, and an environment worker or the
generator killed mid-episode leaves the step as if nothing had happened (the step is retried,
the environments rebuilt by replay: they are deterministic given (row, seed)).

The environment is tests/envs.py's Steps (its faults are named by the rows).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import ray

from envs import expected_score
from helpers import ROOT, tiny_test_config
from ppo_ray.data import bundled_prompts

pytestmark = pytest.mark.usefixtures("ray_session")

FAILED = -1.0  # reward_failure_score: a failed episode's score


def rows(n: int = 4, **columns) -> list[dict]:
    return [{"prompt": p, "turns": 2, **columns} for p in bundled_prompts()[:n]]


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, tmp_path_factory):
    from fault_injection import FaultyTrainer

    config = tiny_test_config(environment="envs:Steps", env_workers=1, env_timeout_s=3.0, reward_funcs=[],
                              reward_weights=[], advantage_estimator="grpo", samples_per_prompt=2, batch_size=8,
                              max_new_tokens=24, env_max_turn_tokens=8, ppo_epochs=1, reward_failure="score",
                              reward_failure_score=FAILED, max_actor_restarts=100, report_to=[])
    trainer = FaultyTrainer(config)
    trainer.run_dir = tmp_path_factory.mktemp("env-trainer-initial")
    trainer.initial_checkpoint = trainer.save_checkpoint()
    trainer.run_dir = None
    yield trainer
    trainer.shutdown()


def outcome(out) -> dict:
    """What a step is, to compare two runs of it: the samples, their scores, the update."""
    return {"texts": out["generated_texts"], "rewards": out["rewards"], "transcripts": out["transcripts"],
            **{k: out[k] for k in ("policy_loss", "kl", "entropy", "approx_kl", "episode_turns_mean",
                                   "episode_env_token_frac")}}


def test_a_step_of_episodes_scores_them_by_their_environment_and_reports_them(trainer):
    trainer.restore(trainer.initial_checkpoint)
    out = trainer.ppo_step(rows())
    assert len(out["transcripts"]) == len(out["rewards"]) == 8
    for segments, reward, text in zip(out["transcripts"], out["rewards"], out["generated_texts"]):
        # the score is the environment's (no reward function): its steps' rewards, summed (float32)
        assert reward == pytest.approx(expected_score(segments), abs=1e-6)
        assert segments[0][0] == "model" and "".join(t for _, t in segments) == text
        assert all(t == " ok." for role, t in segments if role == "env")
    assert 1.0 <= out["episode_turns_mean"] <= 2.0 and 0.0 < out["episode_env_token_frac"] < 1.0
    assert out["episode_timeouts"] == out["episode_exceptions"] == 0.0
    assert out["score/environment"] == pytest.approx(sum(out["rewards"]) / 8, abs=1e-6)
    # float32 and one epoch: the first minibatch's ratio is 1, and the sync check passed
    # (logprob_gap_check error: a gap beyond its tolerance fails the step)
    assert abs(out["first_minibatch_ratio_mean"] - 1.0) < 1e-4 and math.isfinite(out["sync_probe_gap"])


def test_a_hanging_environment_step_is_cut_at_its_limit_and_the_run_goes_on(trainer):
    """One prompt's environment hangs at its second step: its two episodes end at env_timeout_s
    with reward_failure_score, their worker is replaced, and the other episodes, which shared
    that worker, go on exactly as without the hang (rebuilt on the replacement by replay)."""
    trainer.restore(trainer.initial_checkpoint)
    straight = trainer.ppo_step(rows())
    trainer.restore(trainer.initial_checkpoint)
    stuck = rows()
    stuck[1]["hang_turn"] = 2
    before = trainer.version
    out = trainer.ppo_step(stuck)
    assert trainer.version == before + 1  # the step committed
    assert out["episode_timeouts"] == 2.0 and out["rewards"][2:4] == [FAILED, FAILED]
    assert out["rewards"][:2] + out["rewards"][4:] == straight["rewards"][:2] + straight["rewards"][4:]
    assert out["transcripts"][:2] + out["transcripts"][4:] == straight["transcripts"][:2] + straight["transcripts"][4:]
    nxt = trainer.ppo_step(rows())  # and the run goes on
    assert nxt["episode_timeouts"] == 0.0


def test_an_environment_worker_killed_mid_episode_leaves_the_step_as_if_nothing_happened(trainer, tmp_path):
    trainer.restore(trainer.initial_checkpoint)
    crash = tmp_path / "crash"
    straight = trainer.ppo_step(rows(crash_file=str(crash)))  # no file: no crash
    trainer.restore(trainer.initial_checkpoint)
    crash.write_text("")
    out = trainer.ppo_step(rows(crash_file=str(crash)))
    assert not crash.exists()  # it fired
    assert out["episode_exceptions"] == 0.0 and outcome(out) == outcome(straight)


@pytest.mark.slow  # a generator restart: a new vLLM engine (~1 minute on 2 cores)
def test_the_generator_killed_mid_episode_leaves_the_step_as_if_nothing_happened(trainer, tmp_path):
    trainer.restore(trainer.initial_checkpoint)
    kill = tmp_path / "kill-generator"
    straight = trainer.ppo_step(rows(kill_pid_file=str(kill)))
    trainer.restore(trainer.initial_checkpoint)
    generator = trainer.roles.generators[0]
    kill.write_text(str(ray.get(generator.__ray_call__.remote(lambda host: os.getpid()))))
    before = len(trainer.retries)
    out = trainer.ppo_step(rows(kill_pid_file=str(kill)))
    assert not kill.exists()
    assert [r["role"] for r in trainer.retries[before:]] == ["generator-0"]  # the step was retried once
    assert outcome(out) == outcome(straight)


# --------------------------------------------------------------------------- launch.py, a user's environment
@pytest.mark.heavy("runs launch.py ppo through Ray and vLLM")
@pytest.mark.parametrize("estimator", ["grpo", pytest.param("gae", marks=pytest.mark.slow)])
def test_an_environment_in_one_file_outside_the_project_runs_through_launch(tmp_path, estimator):
    """docs/ENVIRONMENTS.md's example environment, written to a file of the user's own, named by
    `--environment module:Class` with a prompts file whose `answer` column its reset reads:
    `launch.py ppo` trains on its episodes (no reward function: the environment's reward is the
    score) with GRPO and with PPO-GAE, and the run's metrics, samples and page hold them."""
    doc = (ROOT / "docs" / "ENVIRONMENTS.md").read_text(encoding="utf-8")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "myenv_module.py").write_text(re.search(r"```python\n(.*?)```", doc, re.S).group(1))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Guess my number, {i}: <guess>", "answer": i % 10}) + "\n"
                               for i in range(16)))
    run_dir = tmp_path / "run"
    group = ["--advantage_estimator", "grpo", "--samples_per_prompt", "2"] if estimator == "grpo" else []
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": os.pathsep.join(
        [str(tmp_path / "pkg"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "ppo", "--config", "tiny", "--environment", "myenv_module:Guess",
         "--reward_funcs", "[]", "--reward_weights", "[]", "--dataset", str(prompts), "--run_dir", str(run_dir),
         "--steps", "2", "--batch_size", "8", "--max_new_tokens", "24", "--env_max_turn_tokens", "8",
         "--eval_every", "2", "--eval_samples", "4", "--vllm_kv_cache_gib", "0.25", *group],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert 1.0 <= line["episode_turns_mean"] <= 3.0 and 0.0 <= line["episode_tool_call_rate"] <= 1.0
        assert line["score/environment"] == pytest.approx(line["reward_mean"], abs=1e-6)
    episodes = [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]
    assert [e["step"] for e in episodes] == [2] * 4  # the evaluated step's first eval_samples episodes
    assert all(seg[0] in ("model", "env") for e in episodes for seg in e["transcript"])
    evals = [json.loads(line) for line in (run_dir / "eval_samples.jsonl").read_text().splitlines()]
    assert len(evals) == 4 and all(e["transcript"] and e["turns"] >= 1 for e in evals)
    assert "Episodes of step 2" in (run_dir / "report.html").read_text()


@pytest.mark.slow  # SFT and RL of the bundled multi-turn task, shortened (~2 minutes on 2 cores)
def test_the_bundled_tool_task_runs_through_launch(tmp_path):
    """`launch.py --config tool-tiny`, shortened: SFT on the transcripts (the observations out of
    the loss, through the SFT stage's Ray task), RL on calculator episodes, the evaluation's
    tool-call rate and turns in report.json, whole transcripts in samples.md."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--config", "tool-tiny", "--run_dir", str(run_dir), "--steps", "2",
         "--sft_epochs", "1", "--data_max_rows", "320", "--eval_size", "8", "--eval_k", "2", "--eval_every", "2",
         "--vllm_kv_cache_gib", "0.25"],
        cwd=tmp_path, env={**os.environ, "RAY_ADDRESS": ""}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    for who in ("sft", "rl"):
        assert 0.0 <= report[f"pass1_test_{who}"] <= 1.0 and 1.0 <= report[f"turns_test_{who}"] <= 3.0
        assert 0.0 <= report[f"tool_call_rate_test_{who}"] <= 1.0
    assert report["rl_steps"] == 2
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("episode_tool_call_rate" in line for line in lines)
    # whole transcripts, turns marked (a model this briefly trained may not call the tool yet)
    assert "**model**" in (run_dir / "samples.md").read_text()
    held = [json.loads(line) for line in (run_dir / "held_out.jsonl").read_text().splitlines()]
    assert all(seg[0] in ("model", "env") for row in held for seg in row["sft_greedy_segments"])
