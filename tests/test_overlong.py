"""DAPO's overlong handling (Yu et al. 2025, section 3.4): the soft overlong punishment in the
reward scorer (overlong_buffer, overlong_penalty) and overlong filtering in the learner's
experience (overlong_filter)."""

from __future__ import annotations

import pytest
import torch

from actors.reward import RewardScorer, overlong_penalty
from learner.learner import Learner
from ppo_ray.batch import RolloutBatch
from ppo_ray.config import ConfigError, PPOConfig
from helpers import keep_experience, make_config, random_batch, rollout_inputs

EOS, PAD = 1, 0


def verl_overlong_reward(length: int, max_resp_len: int, buffer_len: int, factor: float) -> float:
    """verl/workers/reward_manager/dapo.py, written out: expected_len = max_resp_len -
    buffer_len; exceed_len = length - expected_len; min(-exceed_len / buffer_len * factor, 0)."""
    exceed_len = length - (max_resp_len - buffer_len)
    return min(-exceed_len / buffer_len * factor, 0.0)


@pytest.mark.parametrize("buffer, factor", [(4, 1.0), (1, 0.5), (7, 2.0)])
def test_the_soft_overlong_punishment_is_verls_formula(buffer, factor):
    lengths = torch.arange(0, 9)
    got = overlong_penalty(lengths, 8, buffer, factor)
    want = [verl_overlong_reward(n, 8, buffer, factor) for n in range(9)]
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    assert got[8].item() == pytest.approx(-factor) and (got[: 8 - buffer + 1] == 0).all()


def batch(lengths: list[int], eos: list[bool]) -> RolloutBatch:
    responses = [[5] * (n - 1) + [EOS if e else 5] for n, e in zip(lengths, eos)]
    return RolloutBatch.from_tokens([[3, 4]] * len(lengths), responses, PAD, EOS, prompts=["p"] * len(lengths),
                                    responses=["x" * n for n in lengths])


def test_the_scorer_adds_the_penalty_and_reports_it_as_a_source():
    b = batch([2, 5, 6, 8], [True, True, True, False])  # max_new_tokens 8, buffer 4: from 5 tokens on
    plain, _ = RewardScorer(None, ["ppo_ray.rewards:brevity"]).score(b)
    scorer = RewardScorer(None, ["ppo_ray.rewards:brevity"], max_new_tokens=8, overlong_buffer=4, overlong_penalty=1.0)
    scores, stats = scorer.score(b)
    penalty = torch.tensor([0.0, -0.25, -0.5, -1.0])
    torch.testing.assert_close(scores, plain + penalty, rtol=0, atol=1e-6)
    assert stats.source_means["overlong_penalty"] == pytest.approx(-1.75 / 4)
    assert "score/overlong_penalty" in stats.parts()
    # with missing_eos_penalty the cut response gets both
    both, _ = RewardScorer(None, ["ppo_ray.rewards:brevity"], missing_eos_penalty=-1.0, max_new_tokens=8,
                           overlong_buffer=4).score(b)
    assert both[3].item() == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="overlong_buffer 8 must be in"):
        RewardScorer(None, ["ppo_ray.rewards:brevity"], max_new_tokens=8, overlong_buffer=8)


def test_the_config_checks_the_overlong_fields():
    with pytest.raises(ConfigError, match="'overlong_buffer' = 10 is invalid: must be < max_new_tokens=10"):
        PPOConfig(max_new_tokens=10, overlong_buffer=10)
    with pytest.raises(ConfigError, match="'overlong_penalty' = -1.0 is invalid: must be >= 0"):
        PPOConfig(overlong_penalty=-1.0)
    assert PPOConfig(max_new_tokens=10, overlong_buffer=4).overlong_buffer == 4


def test_overlong_filtering_leaves_responses_without_eos_out_of_the_policy_loss(tiny_path, special):
    """The rows cut without EOS have no policy-loss token; the others keep all of theirs; the
    stat is their share; and the policy's update does not depend on the cut rows' advantages."""
    cfg = make_config(overlong_filter=True, ppo_epochs=1, mini_batch_size=8, micro_batch_size=8)
    learner = Learner(cfg, tiny_path)
    kept = keep_experience(learner)
    b, ref, scores = rollout_inputs(learner, random_batch(special, seed=3), seed=3)
    stats, weights = learner.update(b, ref, scores)
    exp = kept[0]
    cut = ~b.has_eos
    assert cut.any() and (~cut).any()
    assert not exp.policy_mask[cut].any()
    assert torch.equal(exp.policy_mask[~cut], exp.mask[~cut])
    assert stats.overlong_filtered == pytest.approx(float(cut.float().mean()))
    assert "overlong_filtered" in stats.as_dict()
    # the same update with other scores for the cut rows moves the policy the same way: their
    # advantages are not in the loss (GAE's advantages are per row; whitening is over all
    # tokens, so the scores change it: compare with whitening off)
    cfg = cfg.replace(whiten_advantages=False)
    adapters = []
    for shift in (0.0, 5.0):
        learner = Learner(cfg, tiny_path)
        b2, ref2, s2 = rollout_inputs(learner, random_batch(special, seed=3), seed=3)
        s2 = torch.where(cut, s2 + shift, s2)
        adapters.append(learner.update(b2, ref2, s2)[1].tensors)
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
    assert PPOConfig().overlong_filter is False
