"""Advantage estimators: learner.algos' registry (GAE the default), and an estimator without
a critic, registered here the way a new one is added (one function, one registration), run
through the real Learner (PEFT LoRA on the tiny model): no value model, no value loss, no
value statistics, and the advantages it computed are the ones the PPO loss used."""

from __future__ import annotations

import math
import re

import pytest
import torch

from learner.algos import (ADVANTAGE_ESTIMATORS, AdvantageInputs, advantage_estimator, compute_gae_advantages,
                           masked_whiten, register_estimator)
from learner.learner import Learner
from ppo_ray.stats import CRITIC_FIELDS
from helpers import keep_experience, make_config, random_batch, rollout_inputs

NAME = "test_return_to_go"


def return_to_go(inputs: AdvantageInputs) -> torch.Tensor:
    """REINFORCE's advantage without a baseline: the discounted sum of the shaped rewards
    from t to the end of the response, 0 on padding."""
    zero = torch.zeros((), dtype=inputs.rewards.dtype, device=inputs.rewards.device)
    r = torch.where(inputs.mask, inputs.rewards, zero)
    out, running = [], torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + inputs.gamma * running
        out.append(running)
    return torch.where(inputs.mask, torch.stack(out[::-1], dim=1), zero)


@pytest.fixture
def critic_free():
    """The estimator registered for one test, then removed (the registry is the process's)."""
    register_estimator(NAME, needs_critic=False, reads=("gamma", "whiten_rewards", "reward_shaping"))(return_to_go)
    yield NAME
    del ADVANTAGE_ESTIMATORS[NAME]


def test_gae_is_the_registered_default():
    from ppo_ray.config import PPOConfig

    assert PPOConfig().advantage_estimator == "gae"
    gae = advantage_estimator("gae")
    assert gae.needs_critic
    rewards, values = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    got = gae.fn(AdvantageInputs(rewards=rewards, mask=mask, scores=torch.zeros(3), values=values, gamma=0.9,
                                 lam=0.8))
    assert torch.equal(got, compute_gae_advantages(rewards, values, mask, 0.9, 0.8))


def test_unknown_and_twice_registered_names_are_clear_errors(critic_free):
    registered = sorted(ADVANTAGE_ESTIMATORS)
    assert {"gae", "grpo", "rloo", "reinforce_pp", NAME} <= set(registered)
    with pytest.raises(ValueError, match=r"unknown estimator 'gea'; registered: " + re.escape(str(registered))):
        advantage_estimator("gea")
    with pytest.raises(ValueError, match="'test_return_to_go' is already registered"):
        register_estimator(NAME, needs_critic=True)(lambda inputs: inputs.rewards)


def test_launch_refuses_an_unknown_estimator_before_anything_starts(tmp_path, capsys):
    import launch

    code = launch.main(["--config", "tiny", "--run_dir", str(tmp_path / "run"), "--advantage_estimator", "gea"])
    err = capsys.readouterr().err
    assert code == 2 and "'advantage_estimator' = 'gea' is invalid: must be one of ['gae', 'grpo'" in err, err
    assert not (tmp_path / "run").exists()


def test_a_critic_free_estimator_builds_no_value_model_and_reports_no_value_stats(tiny_path, special, critic_free):
    learner = Learner(make_config(advantage_estimator=critic_free), tiny_path)
    assert learner.value_model is None and learner.optimiser.value_params == [] and learner.optimiser.value_optimizer is None
    assert learner.models == [learner.policy] and len(learner.optimiser.schedulers) == 1
    kept = keep_experience(learner)
    batch, ref, scores = rollout_inputs(learner, random_batch(special))
    lora_before = learner.lora_weights().tensors
    stats, weights = learner.update(batch, ref, scores)

    for name in CRITIC_FIELDS:
        assert getattr(stats, name) is None, name
    flat = stats.as_dict()
    assert not set(CRITIC_FIELDS) & set(flat)
    assert all(math.isfinite(flat[k]) for k in ("policy_loss", "approx_kl", "kl", "advantage_mean", "entropy"))
    exp = kept[-1]
    assert exp.values is None and exp.returns is None
    # the advantages the loss used are the estimator's, whitened (whiten_advantages: on)
    raw = return_to_go(AdvantageInputs(rewards=exp.rewards, mask=exp.mask, scores=exp.scores, values=None,
                                       gamma=learner.config.gamma, lam=learner.config.lam))
    assert torch.allclose(exp.advantages, masked_whiten(raw, exp.mask), rtol=0, atol=1e-5)
    assert stats.advantage_mean == pytest.approx(float(raw[exp.mask].mean()), rel=1e-5, abs=1e-6)
    assert any(not torch.equal(lora_before[k], weights.tensors[k]) for k in lora_before)  # the policy learned

    # a checkpoint round trip: the policy's state only
    state = learner.state_dict()
    assert state.value == {} and state.value_optimizer is None and state.value_scheduler is None
    again = Learner(make_config(advantage_estimator=critic_free), tiny_path)
    again.load_state_dict(state)
    assert again.version == 1 and all(torch.equal(again.lora_weights().tensors[k], v)
                                      for k, v in weights.tensors.items())
