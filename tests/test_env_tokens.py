"""Environment tokens in a rollout (RolloutBatch.env_mask): a multi-turn transcript's
observations are context the forward attends to and nothing else. They get exactly zero
gradient, zero KL, no advantage, no value target and no reward; the per-token recursions
(GAE, the TD errors) run over the model's tokens as one contiguous response
(ppo_ray.batch.Packing), so an environment turn is part of the transition, not an episode end.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import keep_experience, make_config, policy_grads, random_batch, rollout_inputs
from learner.algos import AdvantageInputs, advantage_estimator, compute_gae_advantages
from learner.experience import estimate
from learner.learner import Learner
from ppo_ray.batch import Packing, RolloutBatch


def with_env_turns(batch: RolloutBatch) -> RolloutBatch:
    """`batch` with an environment turn in the middle of every response of 6+ tokens: columns
    [2, 5) of those rows are the environment's (and groups of 2 rows, for the group estimators)."""
    env = torch.zeros_like(batch.response_mask)
    long_rows = batch.response_mask.sum(dim=1) >= 6
    env[long_rows, 2:5] = True
    assert int(env.sum()) >= 6
    return replace(batch, env_mask=env, groups=torch.arange(len(batch)) // 2)


# --------------------------------------------------------------------------- the batch
def test_env_mask_is_checked_and_carried_through_select_trim_and_cat(special):
    batch = with_env_turns(random_batch(special))
    assert torch.equal(batch.loss_mask, batch.response_mask & ~batch.env_mask)
    with pytest.raises(ValueError, match="env_mask marks padding"):
        replace(batch, env_mask=~batch.response_mask | batch.env_mask)
    with pytest.raises(ValueError, match="env_mask must be a"):
        replace(batch, env_mask=batch.env_mask.long())
    picked = batch.select([3, 0])
    assert torch.equal(picked.env_mask, batch.env_mask[[3, 0]])
    assert torch.equal(batch.trimmed().env_mask, batch.env_mask[:, :batch.trimmed().response_ids.shape[1]])
    plain = random_batch(special, seed=1, t=8)
    both = RolloutBatch.cat([batch, replace(plain, groups=torch.arange(len(plain)))])
    assert torch.equal(both.env_mask[:len(batch)], batch.env_mask) and not both.env_mask[len(batch):].any()
    built = RolloutBatch.from_tokens([[5, 6]], [[1, 2, 3, 4]], special[1], special[0],
                                     env_masks=[[False, True, True, False]])
    assert built.env_mask.tolist() == [[False, True, True, False]]
    assert built.loss_mask.tolist() == [[True, False, False, True]]


def test_packing_moves_each_rows_mask_tokens_left_in_order_and_back():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(5, 9, generator=g) < 0.6
    mask[4] = False  # a row with no tokens
    x = torch.randn(5, 9, generator=g)
    packing = Packing.of(mask)
    packed = packing.pack(x)
    for i in range(5):
        n = int(mask[i].sum())
        assert torch.equal(packed[i, :n], x[i][mask[i]]) and not packed[i, n:].any()
        assert packing.mask[i].tolist() == [j < n for j in range(packing.mask.shape[1])]
    assert torch.equal(packing.unpack(packed), torch.where(mask, x, 0.0))
    prefix = torch.arange(9)[None, :] < torch.tensor([[3], [9]])  # single-turn rows: packing changes nothing
    assert torch.equal(Packing.of(prefix).unpack(Packing.of(prefix).pack(x[:2])), torch.where(prefix, x[:2], 0.0))
    assert torch.equal(Packing.of(prefix).pack(x[:2]), torch.where(prefix, x[:2], 0.0))


def test_gae_runs_over_the_model_tokens_across_an_environment_turn():
    """Model tokens at columns 0, 1 and 4 (the environment's at 2, 3), by hand: the TD error
    of column 1 bootstraps from V at column 4, the next state the policy acts in."""
    gamma, lam = 0.9, 0.8
    response = torch.tensor([[True] * 5])
    env = torch.tensor([[False, False, True, True, False]])
    loss_mask = response & ~env
    r = torch.tensor([[0.1, -0.2, 7.0, 7.0, 1.5]])
    v = torch.tensor([[0.3, 0.5, 9.0, 9.0, 0.2]])
    inputs = AdvantageInputs(rewards=torch.where(loss_mask, r, 0.0), mask=loss_mask, scores=torch.zeros(1),
                             values=torch.where(loss_mask, v, 0.0), gamma=gamma, lam=lam)
    got = estimate(advantage_estimator("gae"), inputs, {}, Packing.of(loss_mask))
    d4 = 1.5 - 0.2
    d1 = -0.2 + gamma * 0.2 - 0.5
    d0 = 0.1 + gamma * 0.5 - 0.3
    a4, a1 = d4, d1 + gamma * lam * d4
    want = torch.tensor([[d0 + gamma * lam * a1, a1, 0.0, 0.0, a4]])
    torch.testing.assert_close(got, want, rtol=0, atol=4 * torch.finfo(torch.float32).eps * 10)
    # and not what the unpacked recursion would give (it ends the episode at the environment's turn)
    assert not torch.allclose(got, compute_gae_advantages(inputs.rewards, inputs.values, loss_mask, gamma, lam))


# --------------------------------------------------------------------------- the learner
ESTIMATORS = [dict(), dict(advantage_estimator="grpo", samples_per_prompt=2)]


@pytest.mark.parametrize("overrides", ESTIMATORS, ids=["gae", "grpo"])
def test_environment_tokens_get_zero_gradient_zero_kl_and_no_advantage(tiny_path, special, overrides):
    cfg = make_config(kl_in_loss=True, entropy_coef=0.01, **overrides)  # every per-token term of the loss
    learner = Learner(cfg, tiny_path)
    kept = keep_experience(learner)
    batch, ref, scores = rollout_inputs(learner, with_env_turns(random_batch(special)))
    learner.update(batch, ref, scores)
    exp = kept[0]
    env = batch.env_mask
    for name in ("kl", "rewards", "advantages", "old_logprobs"):
        assert not getattr(exp, name)[env].any(), name
    if exp.returns is not None:
        assert not exp.returns[env].any() and not exp.values[env].any()
    assert not (exp.mask & env).any() and not (exp.policy_mask & env).any()
    assert exp.kl[exp.mask].abs().sum() > 0 and exp.advantages[exp.mask].abs().sum() > 0

    # the loss's gradient with respect to each token's logprob and entropy (the learner's own
    # forward, its outputs kept): exactly 0 on the environment's tokens, not on the model's
    outputs = []
    train_stats = learner.speed.train_stats

    def keep_grads(*args, **kwargs):
        out = train_stats(*args, **kwargs)
        for t in out[:2]:
            t.retain_grad()
        outputs.append(out)
        return out

    learner.speed.train_stats = keep_grads
    policy_grads(learner, exp, kl_coef=cfg.kl_coef)
    logp, ent = outputs[0][:2]
    t = logp.shape[1]
    assert (logp.grad[env[:, :t]] == 0).all() and (ent.grad[env[:, :t]] == 0).all()
    assert logp.grad[exp.mask[:, :t]].abs().sum() > 0 and ent.grad[exp.mask[:, :t]].abs().sum() > 0


@pytest.mark.parametrize("overrides", ESTIMATORS, ids=["gae", "grpo"])
def test_what_the_batch_holds_on_environment_tokens_but_their_ids_changes_nothing(tiny_path, special, overrides):
    """Garbage in the generator's and the reference's logprobs on environment tokens: the
    update is the same, bit for bit (they are read on the model's tokens only)."""
    cfg = make_config(**overrides)
    runs = []
    for garbage in (0.0, 1.0):
        learner = Learner(cfg, tiny_path)
        batch, ref, scores = rollout_inputs(learner, with_env_turns(random_batch(special)))
        noise = torch.where(batch.env_mask, 5.0 * garbage, 0.0)
        stats, adapter = learner.update(replace(batch, gen_logprobs=batch.gen_logprobs - noise), ref + noise, scores)
        runs.append((stats.as_dict(), adapter.tensors))
    (s0, w0), (s1, w1) = runs
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    assert {k: v for k, v in s0.items() if "time" not in k and not k.endswith("_s")} == \
        pytest.approx({k: v for k, v in s1.items() if "time" not in k and not k.endswith("_s")}, nan_ok=True)
