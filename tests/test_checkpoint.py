"""Checkpoints, exact resume and surviving actor failures, on real Ray actors (vLLM generator,
HF scorers, PEFT learner) with the tiny model.

One trainer for the module (engine start dominates): a straight 4-step run with checkpoints
at steps 2 and 4 is the reference; every other test restores the step-2 checkpoint into a
fresh run directory and runs steps 3-4 again, with or without an actor killed mid-step.

Tolerance: none. The run is float32 on the CPU, every prompt's sampling seed is
(run seed, step, prompt index), the PPO minibatch shuffle is seeded by (seed, version), and
a checkpoint carries the optimisers and RNG states bit for bit, so the resumed steps must
reproduce the straight run's metrics exactly (they do; a tolerance would hide a lost
optimiser state, which changes the losses by far more than rounding).
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import ray

from ppo_ray.checkpoint import CheckpointError
from ppo_ray.data import bundled_prompts
from conftest import tiny_test_config

KEYS = ("reward_mean", "kl", "policy_loss", "value_loss", "approx_kl", "clipfrac", "entropy",
        "explained_variance", "adapter_version", "response_tokens")


@pytest.fixture(scope="module")
def run(ray_session, tiny_model_dir, tmp_path_factory):
    """(trainer, straight history, run dir): 4 steps, checkpoints at 2 and 4."""
    from ppo_ray.trainer import PPOTrainer

    run_dir = tmp_path_factory.mktemp("straight")
    trainer = PPOTrainer(tiny_test_config(steps=4, checkpoint_every=2, batch_size=8, max_new_tokens=10),
                         run_dir=run_dir)
    history = trainer.train(bundled_prompts(), metrics_path=run_dir / "metrics.jsonl", progress=False)
    yield trainer, history, run_dir
    trainer.shutdown()


def from_step_two(trainer, run_dir, new_dir):
    """A new run directory holding only the straight run's step-2 checkpoint; restore it."""
    (new_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-000002", new_dir / "checkpoints" / "step-000002")
    (new_dir / "checkpoints" / "latest").write_text("step-000002\n")
    trainer.run_dir = new_dir
    ckpt = trainer.restore(new_dir)
    assert ckpt.name == "step-000002" and trainer.step == 2 and trainer.version == 2


def metrics_steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def assert_same_steps(resumed, straight):
    assert [h["step"] for h in resumed] == [3, 4]
    for a, b in zip(resumed, straight[2:]):
        for k in KEYS:
            assert a[k] == b[k], f"step {a['step']} {k}: resumed {a[k]!r} vs straight {b[k]!r}"
        assert a["generated_texts"] == b["generated_texts"]


def test_checkpoints_written_and_kept(run):
    trainer, history, run_dir = run
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-000004"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002", "step-000004"]
    meta = json.loads((root / "step-000004" / "trainer.json").read_text())
    assert meta["step"] == 4 and meta["version"] == 4
    assert len(meta["order"]) == len(bundled_prompts()) - 4 * 8  # the data cursor: prompts left this epoch
    assert metrics_steps(run_dir / "metrics.jsonl") == [1, 2, 3, 4]
    # the checkpoint's adapter is the policy's: PEFT loads it on the base model
    from peft import PeftModel

    from ppo_ray.modeling import load_causal_lm

    model = PeftModel.from_pretrained(load_causal_lm(trainer.model_dir), str(root / "step-000004" / "adapter"))
    assert sum(p.abs().sum().item() for n, p in model.named_parameters() if "lora_B" in n) > 0


def test_resume_reproduces_the_straight_run(run, tmp_path):
    trainer, straight, run_dir = run
    from_step_two(trainer, run_dir, tmp_path)
    resumed = trainer.train(bundled_prompts(), metrics_path=tmp_path / "metrics.jsonl", progress=False)
    assert_same_steps(resumed, straight)
    assert metrics_steps(tmp_path / "metrics.jsonl") == [3, 4]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-000004"


def test_resume_refuses_another_config_or_dataset(run, tmp_path):
    from ppo_ray.checkpoint import load_checkpoint

    trainer, _, run_dir = run
    with pytest.raises(CheckpointError, match=r"lora_r: checkpoint 16 vs now 8"):
        load_checkpoint(run_dir, trainer.config.replace(lora_r=8))
    from_step_two(trainer, run_dir, tmp_path)
    with pytest.raises(CheckpointError, match="different prompt list"):
        trainer.train(bundled_prompts()[:-1], steps=1, progress=False)
    assert trainer.step == 2


def kill_during_next_step(trainer, actor, delay_s=0.3):
    """Kill `actor` (Ray may restart it) `delay_s` into the next ppo_step call."""
    started = threading.Event()
    original = trainer.ppo_step

    def marked(prompts):
        started.set()
        return original(prompts)

    trainer.ppo_step = marked

    def killer():
        started.wait(timeout=300)
        time.sleep(delay_s)
        ray.kill(actor, no_restart=False)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    return thread, original


@pytest.mark.parametrize("role", ["reference", "generator-0", "learner"])
def test_an_actor_killed_mid_step_is_restarted_and_the_run_completes(run, tmp_path, role):
    trainer, straight, run_dir = run
    from_step_two(trainer, run_dir, tmp_path)
    actor = {"reference": trainer.roles.reference, "generator-0": trainer.roles.generators[0],
             "learner": trainer.roles.learner}[role]
    before = len(trainer.retries)
    thread, original = kill_during_next_step(trainer, actor)
    try:
        resumed = trainer.train(bundled_prompts(), metrics_path=tmp_path / "metrics.jsonl", progress=False)
    finally:
        trainer.ppo_step = original
        thread.join(timeout=60)
    failures = trainer.retries[before:]
    assert failures and failures[0]["role"] == role and failures[0]["step"] == 3, failures
    # no lost and no duplicated step, and the same numbers as without the failure (a dead
    # learner rolled back to the step-2 checkpoint and redid step 3)
    assert_same_steps(resumed, straight)
    assert metrics_steps(tmp_path / "metrics.jsonl") == [3, 4]
