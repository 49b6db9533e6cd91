"""Checkpoints written before a change still load and resume (issue 44: "the presets and every
checkpoint written by today's main load unchanged").

tests/data/checkpoint-v0 is a run directory with the checkpoint of a real run (launch.py ppo on
the `tiny` preset, one step) written by commit fc76bbe, before the config refactor; its
README.md has the command that rebuilds it. The tests here read it as a resume does: the
checkpoint is found and verified, its config.yaml becomes the same config field by field (the
${run_dir} path placed where the copy now is, fields it predates at their defaults), it is
compatible with the preset plus the run's options, and its learner state goes into a real
Learner on the tiny model bit for bit. No Ray, no vLLM, except the slow end-to-end resume.
The shipped presets' own round trip is here too (from_yaml, to_dict, from_dict).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ppo_ray.driver.checkpoint import (RUN_DIR, check_compatible, config_changes, load_checkpoint, resolve_checkpoint,
                                resumed_config, verify_checkpoint)
from ppo_ray.config import PRESETS_DIR, PPOConfig, preset_names

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "checkpoint-v0"
STEP = "step-000001"
# The options the run that wrote the fixture gave on top of the tiny preset (its README's
# command), but for --dataset: <run_dir>/prompts.jsonl, wherever the run directory is.
OPTIONS = dict(steps=1, batch_size=4, lora_r=4, checkpoint_every=1, vllm_kv_cache_gib=0.25)
CHECKPOINT_FILES = {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "config.yaml",
                    "optimizer.pt", "rng.pt", "trainer.json", "value.safetensors"}


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A copy of the fixture's run directory in a place of its own (never the one it was written in)."""
    return Path(shutil.copytree(FIXTURE, tmp_path / "moved" / "run"))


def saved_yaml(run_dir: Path) -> dict[str, Any]:
    return yaml.safe_load((run_dir / "checkpoints" / STEP / "config.yaml").read_text())


def localized(value: Any, run_dir: Path) -> Any:
    """A config.yaml value as a resume reads it: ${run_dir}/x -> <run_dir>/x."""
    if isinstance(value, str) and value.startswith(RUN_DIR):
        return str(run_dir / value[len(RUN_DIR):].lstrip("/"))
    return value


def preset_config(run_dir: Path) -> PPOConfig:
    """What the run's command line gives today: the tiny preset plus the run's options."""
    return PPOConfig.from_yaml("tiny", **OPTIONS, dataset=str(run_dir / "prompts.jsonl"))


def same(a: Any, b: Any) -> bool:
    """Equal nested state (dicts, lists, tensors bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_the_fixture_is_small_portable_and_fully_checksummed():
    """Under 1 MiB; no absolute path but PEFT's base_model_name_or_path metadata (which no
    loader reads); the run's prompts named relative to the run directory; checksums.json
    covers every file of the checkpoint (else verify_checkpoint could pass on a file it
    never checks)."""
    files = [p for p in FIXTURE.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 1 << 20
    ckpt = FIXTURE / "checkpoints" / STEP
    assert (FIXTURE / "checkpoints" / "latest").read_text().strip() == STEP
    for p in files:
        if p.suffix in (".json", ".yaml", ".jsonl") or p.name == "latest":  # what loaders read
            lines = [x for x in p.read_text().splitlines() if any(s in x for s in ('"/', " /", "'/"))]
            if p == ckpt / "adapter" / "adapter_config.json":
                assert [json.loads("{" + x.rstrip(",") + "}").keys() for x in lines] == [{"base_model_name_or_path"}]
            else:
                assert lines == [], p
    assert saved_yaml(FIXTURE)["dataset"] == "${run_dir}/prompts.jsonl"
    assert set(json.loads((ckpt / "checksums.json").read_text())) == CHECKPOINT_FILES
    assert {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} == CHECKPOINT_FILES | {
        "checksums.json"}


def test_old_checkpoint_is_found_and_verified(run_dir, caplog):
    """The run directory resolves (through `latest`, with no warning: no fallback, no file
    unverified) to its checkpoint, whose files all pass their checksums."""
    caplog.set_level("WARNING", logger="ppo_ray.driver.checkpoint")
    ckpt = resolve_checkpoint(run_dir)
    assert ckpt == run_dir / "checkpoints" / STEP
    verify_checkpoint(ckpt)
    assert resolve_checkpoint(ckpt) == ckpt
    assert [r.getMessage() for r in caplog.records] == []


def test_old_config_yaml_resumes_as_the_same_config(run_dir):
    """resumed_config reads every key of the old config.yaml as the field of that name with
    that value (the ${run_dir} path placed in the copy's run directory), or a renamed key as
    its new field (ppo_ray.config.RENAMED: overlap_generation false is max_staleness 0); no
    other key is unknown (a field removed would stop every old checkpoint's resume), and a
    field the checkpoint predates takes its default."""
    from ppo_ray.config import RENAMED

    data = saved_yaml(run_dir)
    names = PPOConfig.field_names()
    assert sorted(set(data) - set(names)) == ["overlap_generation"]
    for old, (new, translate) in RENAMED.items():
        data[new] = translate(data.pop(old))
    assert data["max_staleness"] == 0
    cfg = resumed_config(run_dir / "checkpoints" / STEP, run_dir)
    differ = {k: (v, getattr(cfg, k)) for k, v in data.items() if getattr(cfg, k) != localized(v, run_dir)}
    assert differ == {}
    assert cfg.dataset == str(run_dir / "prompts.jsonl")
    defaults = PPOConfig()
    newer = {k: getattr(cfg, k) for k in names if k not in data and getattr(cfg, k) != getattr(defaults, k)}
    assert newer == {}


def test_old_checkpoint_is_compatible_with_the_preset_and_the_runs_options(run_dir):
    """The tiny preset plus the run's command-line options, as a resume command gives them
    today, is the checkpoint's config exactly (no change for a resume to name) and passes the
    compatibility check and the model fingerprints (load_checkpoint with that config)."""
    ckpt = run_dir / "checkpoints" / STEP
    saved = resumed_config(ckpt, run_dir)
    now = preset_config(run_dir)
    check_compatible(saved, now, ckpt)
    assert config_changes(saved, now) == []
    assert load_checkpoint(run_dir, now)[0] == ckpt


def test_old_learner_state_loads_into_a_learner_bit_for_bit(run_dir):
    """load_checkpoint gives the trainer's state (step, version, data cursor, lineage, the
    prompts' fingerprint, which still matches prompts.jsonl) and the learner's; a Learner on
    the tiny model, built from the resumed config, accepts it, and then holds the saved policy
    adapter, value tensors, optimiser and schedule states exactly (one Learner on the tiny model: under a second once imported)."""
    from safetensors.torch import load_file

    from learner.learner import Learner
    from ppo_ray.data import load_prompts, prompts_fingerprint
    from ppo_ray.paths import resolve_model_path

    ckpt = run_dir / "checkpoints" / STEP
    cfg = resumed_config(ckpt, run_dir)
    where, state, trainer_state = load_checkpoint(run_dir, cfg)
    meta = json.loads((ckpt / "trainer.json").read_text())
    assert where == ckpt
    assert trainer_state["step"] == 1 and trainer_state["planned_steps"] == 1 and state.version == 1
    assert {k: trainer_state[k] for k in meta} == meta  # run_id, checkpoint_id, order, fingerprints, ...
    assert sorted(trainer_state["order"]) == sorted(set(trainer_state["order"])) and len(trainer_state["order"]) == 4
    assert isinstance(trainer_state["data_rng"], torch.Tensor) and trainer_state["data_rng"].dtype == torch.uint8
    assert trainer_state["prompts_sha256"] == prompts_fingerprint(load_prompts(cfg))
    assert same(state.policy.tensors, load_file(str(ckpt / "adapter" / "adapter_model.safetensors")))
    assert same(state.value, load_file(str(ckpt / "value.safetensors")))
    assert (state.policy.spec.r, state.policy.spec.lora_alpha) == (4, 32)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's matmuls: faster on one thread on a shared machine
    try:
        learner = Learner(cfg, resolve_model_path(cfg.model_name))
        fresh = learner.lora_weights().tensors
        assert not same(fresh, state.policy.tensors)  # the load below is what makes them equal
        learner.load_state_dict(state)
    finally:
        torch.set_num_threads(threads)
    now = learner.state_dict()
    assert now.version == 1
    assert now.policy.spec == state.policy.spec
    assert same(now.policy.tensors, state.policy.tensors)
    assert same(now.value, state.value)
    assert same(now.policy_optimizer, state.policy_optimizer)
    assert same(now.value_optimizer, state.value_optimizer)
    assert same(now.policy_scheduler, state.policy_scheduler)
    assert same(now.value_scheduler, state.value_scheduler)
    assert now.kl_coef == state.kl_coef == cfg.kl_coef


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_round_trips(name, tmp_path):
    """Each shipped preset: every key it sets is the field of that name with that value, and
    its config goes through to_dict/from_dict and to_yaml/from_yaml to an equal config."""
    data = yaml.safe_load((PRESETS_DIR / f"{name}.yaml").read_text())
    cfg = PPOConfig.from_yaml(name)
    assert {k: (v, getattr(cfg, k)) for k, v in data.items() if getattr(cfg, k) != v} == {}
    assert PPOConfig.from_dict(cfg.to_dict()) == cfg
    assert dataclasses.asdict(PPOConfig.from_dict(cfg.to_dict())) == cfg.to_dict()
    cfg.to_yaml(tmp_path / "c.yaml")
    assert PPOConfig.from_yaml(tmp_path / "c.yaml") == cfg


@pytest.mark.slow
def test_old_checkpoint_resumes_with_launch(run_dir):
    """End to end: `launch.py ppo --resume RUN --steps 2` on the copy continues the old run
    for one step: the new checkpoint continues the old one's lineage, the resume names no
    config change (steps is the run-length option it was given), and metrics.jsonl gets step
    2. Slow (32-48 s on 2 shared CPU cores: Ray and a vLLM engine)."""
    old = json.loads((run_dir / "checkpoints" / STEP / "trainer.json").read_text())
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "ppo", "--resume", str(run_dir), "--steps", "2"],
                          cwd=run_dir.parent, env={**os.environ, "RAY_ADDRESS": ""}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / STEP} (step 1, adapter version 1)" in proc.stderr
    assert "changes to its config" not in proc.stderr
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000002"
    new = json.loads((run_dir / "checkpoints" / "step-000002" / "trainer.json").read_text())
    assert (new["run_id"], new["parent"], new["parent_id"]) == (old["run_id"], STEP, old["checkpoint_id"])
    assert new["version"] == 2
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [2]
