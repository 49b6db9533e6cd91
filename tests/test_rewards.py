"""ppo_ray/rewards.py: reward sources checked before anything starts. A reward model path
that is not a reward model (no config.json, a file, a broken config.json, num_labels != 1, a
causal LM), a reward function that does not import: errors naming the source, from
`check_reward_model` / `check_reward_sources`, at the top of `PPOTrainer.__init__` (before
Ray) and in launch.py (before writing). Fast: no Ray, no actors.

Decision (issue 5, item 7): a causal LM is refused as a reward model.
AutoModelForSequenceClassification would load it with a randomly initialised score head; its
scores are noise and PPO would train on them with no sign of trouble. A reward model is a
checkpoint saved from AutoModelForSequenceClassification (num_labels=1), such as
`launch.py rm`'s rm/.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import launch_ppo, snapshot, tiny_test_config


@pytest.fixture(scope="module")
def causal_lm_dir(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("causal") / "lm"
    shutil.copytree(tiny_model_dir, out)
    return out


def test_reward_model_paths_that_are_not_reward_models(tmp_path, causal_lm_dir):
    from ppo_ray.rewards import RewardError, check_reward_model

    with pytest.raises(FileNotFoundError, match="exists but is not a model directory"):
        check_reward_model(str(tmp_path))  # a directory without config.json
    weights = next(causal_lm_dir.glob("*.safetensors"))
    with pytest.raises(FileNotFoundError, match="exists but is not a model directory"):
        check_reward_model(str(weights))  # a file
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(RewardError, match="is not a loadable model"):
        check_reward_model(str(tmp_path))
    two = tmp_path / "two"
    shutil.copytree(causal_lm_dir, two)
    cfg = json.loads((two / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForSequenceClassification"],
                                                 "id2label": {"0": "a", "1": "b"}}))
    with pytest.raises(RewardError, match="num_labels=2; a reward model needs 1"):
        check_reward_model(str(two))


def test_causal_lm_checkpoint_is_not_a_reward_model(tmp_path, causal_lm_dir):
    from actors.reward import RewardScorer
    from ppo_ray.rewards import RewardError, check_reward_model
    from ppo_ray.modeling import load_reward_model

    with pytest.raises(RewardError, match=r"is a Qwen3ForCausalLM checkpoint, not a sequence-classification"):
        check_reward_model(str(causal_lm_dir))
    with pytest.raises(RewardError, match="Qwen3ForCausalLM"):
        RewardScorer(str(causal_lm_dir))  # the reward actor's constructor checks too
    # config.json claims a reward model, the weights have no score head: caught at load
    liar = tmp_path / "liar"
    shutil.copytree(causal_lm_dir, liar)
    cfg = json.loads((liar / "config.json").read_text())
    (liar / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForSequenceClassification"],
                                                  "id2label": {"0": "LABEL_0"}}))
    check_reward_model(str(liar))
    with pytest.raises(ValueError, match=r"has no trained score head \(missing from the checkpoint: \['score.weight'\]\)"):
        load_reward_model(str(liar))


def _fail_if_ray_starts(monkeypatch):
    import ppo_ray.trainer as trainer_module

    def boom(*a, **k):
        raise AssertionError("init_ray was called: the check came after Ray started")

    monkeypatch.setattr(trainer_module, "init_ray", boom)
    monkeypatch.setattr(trainer_module, "create_roles", boom)
    return trainer_module.PPOTrainer


@pytest.mark.parametrize("changes,error,match", [
    (dict(reward_funcs=["no_such_module_xyz:f"], reward_weights=[]), "RewardError", "cannot import module"),
    (dict(reward_funcs=["ppo_ray.rewards:nope"], reward_weights=[]), "RewardError", "has no callable 'nope'"),
    (dict(reward_funcs=[], reward_weights=[], reward_model_name="CAUSAL"), "RewardError", "Qwen3ForCausalLM"),
    (dict(reward_funcs=[], reward_weights=[], reward_model_name="DIR"), "FileNotFoundError", "not a model directory"),
    (dict(reward_funcs=[], reward_weights=[]), "RewardError", "no reward source"),
])
def test_trainer_checks_reward_sources_before_ray(monkeypatch, tmp_path, causal_lm_dir, changes, error, match):
    PPOTrainer = _fail_if_ray_starts(monkeypatch)
    if changes.get("reward_model_name") == "CAUSAL":
        changes["reward_model_name"] = str(causal_lm_dir)
    elif changes.get("reward_model_name") == "DIR":
        changes["reward_model_name"] = str(tmp_path)
    with pytest.raises(Exception, match=match) as info:
        PPOTrainer(tiny_test_config(**changes))
    assert type(info.value).__name__ == error


def test_launch_rejects_a_causal_lm_reward_model(old_run, causal_lm_dir, capsys, no_ray_address):
    before = snapshot(old_run)
    assert launch_ppo(old_run, "--reward_model_name", str(causal_lm_dir), "--reward_funcs", "[]",
                      "--reward_weights", "[]") == 2
    assert "Qwen3ForCausalLM checkpoint, not a sequence-classification reward model" in capsys.readouterr().err
    assert snapshot(old_run) == before
