"""Checkpoints and exact resume, on real Ray actors (vLLM generator, HF scorers, PEFT
learner) with the tiny model. (Actor failures: tests/test_faults.py.)

One trainer for the module (engine start dominates): a straight 4-step run with checkpoints
at steps 2 and 4 is the reference; every other test restores the step-2 checkpoint into a
fresh run directory and runs steps 3-4 again.

Tolerance: none. The run is float32 on the CPU, every prompt's sampling seed is
(run seed, step, prompt index), the PPO minibatch shuffle is seeded by (seed, version), and
a checkpoint carries the optimisers and RNG states bit for bit, so the resumed steps must
reproduce the straight run's metrics exactly (they do; a tolerance would hide a lost
optimiser state, which changes the losses by far more than rounding).
"""

from __future__ import annotations

import json
import shutil

import pytest

from ppo_ray.driver.checkpoint import CheckpointError
from ppo_ray.data import bundled_prompts
from helpers import assert_same_steps, from_step_two, metrics_steps, tiny_test_config
from exact import rerun_if_last_digits_differ

@pytest.fixture(scope="module")
def run(ray_session, tiny_model_dir, tmp_path_factory):
    """(trainer, straight history, run dir): 4 steps, checkpoints at 2 and 4; the linear
    learning-rate schedule, so that resume must restore it too."""
    from ppo_ray.trainer import PPOTrainer

    run_dir = tmp_path_factory.mktemp("straight")
    trainer = PPOTrainer(tiny_test_config(steps=4, checkpoint_every=2, batch_size=8, max_new_tokens=10,
                                          lr_scheduler="linear"), run_dir=run_dir)
    history = trainer.train(bundled_prompts(), metrics_path=run_dir / "metrics.jsonl", progress=False)
    yield trainer, history, run_dir
    trainer.shutdown()


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


@rerun_if_last_digits_differ
def test_resume_reproduces_the_straight_run(run, tmp_path):
    trainer, straight, run_dir = run
    from_step_two(trainer, run_dir, tmp_path)
    resumed = trainer.train(bundled_prompts(), metrics_path=tmp_path / "metrics.jsonl", progress=False)
    assert_same_steps(resumed, straight)
    assert metrics_steps(tmp_path / "metrics.jsonl") == [3, 4]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-000004"


def test_a_longer_run_follows_its_new_planned_total_and_says_so(run, tmp_path, caplog):
    """Resumed at step 2 with steps=6 (the run planned 4), and train() asked for 4 more steps
    than planned: the linear learning rate is that of a 6-step run from step 3 on (it was
    the 4-step decay, 0 from step 5), and the change is logged."""
    trainer, straight, run_dir = run
    lr = trainer.config.learning_rate  # times 1 - t / T: t and T count optimiser steps, in proportion to PPO steps
    assert [h["learning_rate"] for h in straight] == pytest.approx([lr * (1 - s / 4) for s in range(4)])
    base = trainer.config
    for how in ("resume", "train"):
        trainer.config = base.replace(steps=6) if how == "resume" else base
        new_dir = tmp_path / how
        try:
            with caplog.at_level("WARNING", logger="ppo_ray.trainer"):
                from_step_two(trainer, run_dir, new_dir)
                history = trainer.train(bundled_prompts(), steps=4, progress=False)
        finally:
            trainer.config = base
        assert [h["step"] for h in history] == [3, 4, 5, 6]
        assert [h["learning_rate"] for h in history] == pytest.approx([lr * (1 - s / 6) for s in range(2, 6)]), how
        assert "planned to reach 0 at step 4: from step 3 on it follows a run of 6 steps" in caplog.text, how
        caplog.clear()
        latest = json.loads((new_dir / "checkpoints" / "step-000006" / "trainer.json").read_text())
        assert latest["planned_steps"] == 6


def test_resume_refuses_another_config_or_dataset(run, tmp_path):
    from ppo_ray.driver.checkpoint import load_checkpoint

    trainer, _, run_dir = run
    with pytest.raises(CheckpointError, match=r"lora_r: checkpoint 16 vs now 8"):
        load_checkpoint(run_dir, trainer.config.replace(lora_r=8))
    from_step_two(trainer, run_dir, tmp_path)
    with pytest.raises(CheckpointError, match="different prompt list"):
        trainer.train(bundled_prompts()[:-1], steps=1, progress=False)
    assert trainer.step == 2


# ------------------------------------------------------------------ files: damage and moves
def _small_checkpoints(tmp_path, steps=(1, 2), **config):
    """Checkpoints of a fresh tiny learner (no Ray) at `steps` in tmp_path/run."""
    import torch

    from learner.learner import Learner
    from ppo_ray.driver.checkpoint import save_checkpoint
    from ppo_ray.config import PPOConfig
    from ppo_ray.paths import resolve_model_path

    run_dir = tmp_path / "run"
    cfg = PPOConfig(model_name="embedded:tiny", lora_r=4, lora_alpha=8, **config)
    learner = Learner(cfg, resolve_model_path(cfg.model_name))
    for step in steps:
        save_checkpoint(run_dir, config=cfg, learner_state=learner.state_dict(), model_dir="base",
                        trainer_state={"step": step, "order": [step], "data_rng": torch.Generator().get_state()})
    return run_dir, cfg


def test_a_damaged_checkpoint_is_named_and_the_newest_intact_one_is_used(tmp_path, caplog):
    from ppo_ray.driver.checkpoint import load_checkpoint

    run_dir, cfg = _small_checkpoints(tmp_path)
    latest = run_dir / "checkpoints" / "step-000002"
    value = latest / "value.safetensors"
    value.write_bytes(value.read_bytes()[: value.stat().st_size // 2])  # as an interrupted copy leaves it
    with caplog.at_level("WARNING", logger="ppo_ray.driver.checkpoint"):
        ckpt, _, state = load_checkpoint(run_dir, cfg)
    assert ckpt.name == "step-000001" and state["step"] == 1
    assert "value.safetensors fails its sha256 checksum" in caplog.text and "step-000001" in caplog.text
    # the damaged checkpoint itself, asked for by name: an error naming the file
    with pytest.raises(CheckpointError, match=r"step-000002/value.safetensors fails its sha256 checksum"):
        load_checkpoint(latest, cfg)
    (run_dir / "checkpoints" / "step-000001" / "trainer.json").unlink()
    with pytest.raises(CheckpointError, match=r"no intact checkpoint .*step-000001 is incomplete: no trainer.json"):
        load_checkpoint(run_dir, cfg)


def test_a_moved_run_directory_resumes(tmp_path):
    """The pipeline's PPO config names parts of the run directory (model_name = <run>/sft):
    the checkpoint stores them relative to it, so a copy elsewhere resumes (it was refused:
    "model_name: checkpoint 'runs/<time>/sft' vs now '/elsewhere/sft'")."""
    import yaml

    from ppo_ray.driver.checkpoint import load_checkpoint

    run_dir = tmp_path / "run"
    run_dir, cfg = _small_checkpoints(tmp_path, steps=(1,), dataset=str(tmp_path / "run" / "data" / "p.jsonl"))
    cfg = cfg.replace(model_name=str(run_dir / "sft"))  # as pipeline.ppo_config writes it
    from ppo_ray.driver.checkpoint import save_checkpoint
    _, learner_state, trainer_state = load_checkpoint(run_dir)
    save_checkpoint(run_dir, config=cfg, learner_state=learner_state, model_dir="base",
                    trainer_state={**trainer_state, "step": 2})
    saved = yaml.safe_load((run_dir / "checkpoints" / "step-000002" / "config.yaml").read_text())
    assert saved["model_name"] == "${run_dir}/sft" and saved["dataset"] == "${run_dir}/data/p.jsonl"
    elsewhere = tmp_path / "mounted" / "elsewhere"
    shutil.copytree(run_dir, elsewhere)
    moved = cfg.replace(model_name=str(elsewhere / "sft"), dataset=str(elsewhere / "data" / "p.jsonl"))
    ckpt, _, state = load_checkpoint(elsewhere, moved)
    assert ckpt.parent.parent == elsewhere and state["step"] == 2
    with pytest.raises(CheckpointError, match="model_name"):  # another model is still another model
        load_checkpoint(elsewhere, moved.replace(model_name=str(tmp_path / "other" / "sft")))


def test_real_runs_checkpoint_periodically_by_default():
    from ppo_ray.config import PPOConfig

    cfg = PPOConfig()
    assert cfg.checkpoint_every > 0 and cfg.checkpoint_every_minutes > 0 and cfg.keep_checkpoints >= 1


def test_the_time_rule_checkpoints_without_the_step_rule(run, tmp_path):
    trainer, _, run_dir = run
    from_step_two(trainer, run_dir, tmp_path)
    base = trainer.config
    trainer.config = base.replace(checkpoint_every=0, checkpoint_every_minutes=1e-9, keep_checkpoints=5)
    try:
        trainer.train(bundled_prompts(), progress=False)
    finally:
        trainer.config = base
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert names == ["step-000002", "step-000003", "step-000004"]
