"""Issue 15's input checks and options, without Ray: the context-length error (before any
actor starts, and before launch.py writes anything), vllm_enforce_eager's default, the
trust notice of config files (--help, and the reward functions a --resume imports).
apply_chat_template's tests are in test_data.py.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

import launch
from ppo_ray.config import PPOConfig
from ppo_ray.modeling import ContextLengthError, check_context_length
from ppo_ray.paths import resolve_model_path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def short_model(tmp_path_factory) -> Path:
    """The tiny model with a context window of 64 positions (config.json's
    max_position_embeddings): weights unchanged, only the limit the checks read."""
    src = Path(resolve_model_path("embedded:tiny"))
    dst = tmp_path_factory.mktemp("short") / "model"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ----------------------------------------------------------------------------- context length
def test_context_length_error_names_both_fields_and_the_limit(short_model):
    check_context_length(48, 16, {"model_name": str(short_model)})  # 64 fits exactly
    with pytest.raises(ContextLengthError) as info:
        check_context_length(60, 16, {"model_name": str(short_model)})
    message = str(info.value)
    assert f"model_name {str(short_model)!r} has max_position_embeddings=64" in message
    assert "max_prompt_length (60) + max_new_tokens (16) = 76" in message and "at most 64" in message
    check_context_length(4096, 4096, {"model_name": "some-org/not-downloaded"})  # unknown: left to the hub load


def test_trainer_refuses_a_short_model_before_ray(short_model, monkeypatch):
    """PPOTrainer checks every model's window before init_ray (no actor, no Ray)."""
    import ppo_ray.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "init_ray", lambda **kw: pytest.fail("Ray started"))
    config = PPOConfig.from_yaml(TINY, model_name=str(short_model), max_prompt_length=60, max_new_tokens=16)
    with pytest.raises(ContextLengthError, match=r"max_prompt_length \(60\) \+ max_new_tokens \(16\) = 76"):
        trainer_module.PPOTrainer(config)


def test_launch_refuses_a_short_model_before_writing(short_model, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = launch.main(["ppo", "--config", str(TINY), "--model_name", str(short_model), "--max_prompt_length", "60",
                        "--max_new_tokens", "16", "--run_dir", str(run_dir)])
    assert code == 2 and not run_dir.exists()
    err = capsys.readouterr().err
    assert err.startswith("error: model_name") and "max_position_embeddings=64" in err and "Traceback" not in err
    # the pipeline checks the base model before SFT, too
    code = launch.main(["sft", "--model_name", str(short_model), "--max_prompt_length", "60", "--max_new_tokens",
                        "16", "--run_dir", str(run_dir)])
    assert code == 2 and not run_dir.exists() and "max_position_embeddings=64" in capsys.readouterr().err


def test_launch_checks_a_hub_models_context_before_any_stage(short_model, tmp_path, local_hub):
    """On a fresh node nothing is in the HF cache: the preflight fetches the hub model's
    config.json (from a stand-in hub on 127.0.0.1, through huggingface_hub as from the real
    one) and names the context-length problem before SFT and RM would have run for hours."""
    import subprocess
    import sys

    repo = local_hub.root / "some-org" / "short-model"
    repo.mkdir(parents=True)
    shutil.copy(short_model / "config.json", repo / "config.json")  # only what the check needs
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--model_name", "some-org/short-model", "--max_prompt_length", "60",
         "--max_new_tokens", "16", "--run_dir", str(run_dir)],
        env=local_hub.env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "error: model_name 'some-org/short-model' has max_position_embeddings=64" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and not run_dir.exists()
    assert any(p.endswith("/some-org/short-model/resolve/main/config.json") for p in local_hub.requests)
    # offline (the suite's own setting) and not cached: the check is skipped with a warning, not an error
    check_context_length(4096, 4096, {"model_name": "some-org/short-model"})


# ----------------------------------------------------------------------------- vLLM eager mode
@pytest.mark.heavy("Generator.from_config imports vLLM")
def test_vllm_enforce_eager_default_eager_on_cpu_graphs_on_gpu(monkeypatch):
    from actors import vllm_engine
    from actors.generator import Generator

    assert vllm_engine.resolve_enforce_eager(None, on_cpu=True) is True
    assert vllm_engine.resolve_enforce_eager(None, on_cpu=False) is False
    assert vllm_engine.resolve_enforce_eager(True, on_cpu=False) is True
    assert vllm_engine.resolve_enforce_eager(False, on_cpu=True) is False
    seen = {}

    def fake_build_llm(model_dir, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(vllm_engine, "build_llm", fake_build_llm)
    for value in (None, True, False):
        with pytest.raises(RuntimeError, match="stop here"):
            Generator.from_config(PPOConfig.from_yaml(TINY, vllm_enforce_eager=value), "unused")
        assert seen["enforce_eager"] is value  # the config's choice reaches build_llm, resolved there


# ----------------------------------------------------------------------------- trusted configs
def test_help_says_config_files_are_trusted(capsys):
    assert launch.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "Trusted input: a config file" in out and "reward_funcs is\nimported and run" in out
    assert "its reward_funcs are imported and run" in out and "--log_level str" in out


def test_resume_names_the_reward_functions_it_will_import(tmp_path, caplog):
    """--resume reloads the checkpoint's saved config: the reward functions it imports are named
    before anything is imported (here one that does not exist: the run then stops, exit 2)."""
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints" / "step-000001"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text("{}")  # enough for resolve_checkpoint (an unverified old one)
    (run_dir / "checkpoints" / "latest").write_text("step-000001\n")
    config = PPOConfig.from_yaml(TINY, reward_funcs=["ppo_ray.rewards:letter_e_fraction", "my_rewards:secret_sauce"],
                                 reward_weights=[1.0, 1.0])
    config.to_yaml(ckpt / "config.yaml")
    with caplog.at_level(logging.WARNING):
        code = launch.main(["ppo", "--resume", str(run_dir)])
    assert code == 2
    notice = [r.getMessage() for r in caplog.records if "reward functions" in r.getMessage()]
    assert notice and "ppo_ray.rewards:letter_e_fraction, my_rewards:secret_sauce" in notice[0]
    assert "trusted input" in notice[0]


def test_a_stage_that_asks_for_gpus_the_cluster_lacks_fails_fast(ray_session, tmp_path):
    """The SFT stage's task reserves the learner's GPUs by default: on a cluster without GPUs
    that is a ClusterError naming the stage and the fields, before anything trains."""
    from learner.stages import TrainSettings
    from ppo_ray.driver.cluster import ClusterError
    from ppo_ray.driver.stage_tasks import run_stage

    config = PPOConfig.from_yaml(TINY, learner_num_gpus=0.5, placement_timeout_s=5.0)
    with pytest.raises(ClusterError, match=r"asks for 0.5 GPUs for the sft stage's task \(stage_num_gpus, by "
                                           r"default learner_num_gpus\) but the Ray cluster has 0"):
        run_stage(config, "sft", resolve_model_path("embedded:tiny"), ([[1, 2]], [[3, 4]]), TrainSettings(),
                  tmp_path / "sft")
    assert not (tmp_path / "sft").exists()
