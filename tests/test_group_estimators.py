"""The group estimators (learner.algos: grpo, rloo, reinforce_pp) and group sampling
(samples_per_prompt): each estimator equals a naive reference (Python loops, float64) on
random groups with random masks, equal groups and dropped rows; the config errors; the
batch's group ids through select / to / trimmed / cat / pickle; the generator's n samples
per prompt on the session's vLLM engine; one short PPOTrainer run with grpo."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from learner.algos import (GRPO_EPS, AdvantageInputs, advantage_estimator, check_group_size)
from ppo_ray.batch import RolloutBatch
from ppo_ray.config import ConfigError, PPOConfig
from tolerances import rounding_tol

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
WHITEN_EPS = 1e-8  # learner.algos.masked_whiten's default


def naive_advantages(rewards, mask, groups, kind: str, norm_std: bool = True) -> torch.Tensor:
    """The estimators' definitions, one row and one token at a time, in float64: the return of
    a row is the sum of its real tokens' rewards; a row without real tokens is dropped (out of
    every statistic, advantage 0); statistics over the valid rows of the group."""
    B, T = mask.shape
    R = [sum(float(rewards[i, t]) for t in range(T) if mask[i, t]) for i in range(B)]
    valid = [bool(mask[i].any()) for i in range(B)]
    adv = [0.0] * B
    for i in range(B):
        if not valid[i]:
            continue
        members = [j for j in range(B) if int(groups[j]) == int(groups[i]) and valid[j]]
        k = len(members)
        mean = sum(R[j] for j in members) / k
        if kind == "grpo":
            std = math.sqrt(sum((R[j] - mean) ** 2 for j in members) / (k - 1)) if k > 1 else 0.0
            adv[i] = (R[i] - mean) / (std + GRPO_EPS) if norm_std else R[i] - mean
        elif kind == "rloo":
            adv[i] = R[i] - sum(R[j] for j in members if j != i) / (k - 1) if k > 1 else 0.0
        else:  # reinforce_pp: group-mean baseline, then whitened over the batch's real tokens
            adv[i] = R[i] - mean
    out = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                out[i, t] = adv[i]
    if kind == "reinforce_pp":
        tokens = [out[i, t].item() for i in range(B) for t in range(T) if mask[i, t]]
        n = len(tokens)
        mu = sum(tokens) / n
        var = sum((x - mu) ** 2 for x in tokens) / (n - 1)
        for i in range(B):
            for t in range(T):
                if mask[i, t]:
                    out[i, t] = (out[i, t] - mu) / math.sqrt(var + WHITEN_EPS)
    return out


def random_groups(seed: int, T: int = 7):
    """Rewards (B, T) float32, mask (B, T) bool and group ids (B,) long: groups of 2-5 rows
    with scattered, non-contiguous ids (the estimators must read the ids, not the row order),
    random response lengths, NaN garbage on padding, and: one group of equal returns, one
    group with all rows but one dropped, one group entirely dropped, scattered dropped rows."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 6, (8,), generator=g).tolist()
    ids = torch.randperm(1000, generator=g)[: len(sizes)] * 7  # arbitrary distinct ids
    groups = torch.cat([torch.full((n,), int(i)) for n, i in zip(sizes, ids)])
    B = len(groups)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths.unsqueeze(1)
    rewards = torch.randn(B, T, generator=g) * 0.3
    rewards[:, -1] += torch.randn(B, generator=g)  # a "score" on the last column
    rows = [torch.nonzero(groups == int(i)).flatten().tolist() for i in ids]
    equal, lonely, gone = rows[0], rows[1], rows[2]
    for r in equal[1:]:  # equal returns: the same rewards on the same real tokens
        rewards[r], mask[r] = rewards[equal[0]], mask[equal[0]]
    mask[lonely[1:]] = False  # all but one row of this group dropped
    mask[gone] = False  # a whole group dropped
    others = [r for rs in rows[3:] for r in rs]
    drop = torch.rand(len(others), generator=g) < 0.15
    mask[[r for r, d in zip(others, drop.tolist()) if d]] = False
    rewards = torch.where(mask, rewards, torch.full_like(rewards, float("nan")))  # garbage on padding
    perm = torch.randperm(B, generator=g)  # rows of a group scattered through the batch
    return rewards[perm], mask[perm], groups[perm]


def run(name: str, rewards, mask, groups, norm_std: bool = True) -> torch.Tensor:
    return advantage_estimator(name).fn(AdvantageInputs(
        rewards=rewards, mask=mask, scores=torch.zeros(len(mask)), values=None, gamma=0.9, lam=0.8,
        groups=groups, grpo_norm_std=norm_std))


@pytest.mark.parametrize("name,norm_std", [("grpo", True), ("grpo", False), ("rloo", True), ("reinforce_pp", True)])
@pytest.mark.parametrize("seed", range(5))
def test_each_estimator_equals_its_naive_reference(name, norm_std, seed):
    rewards, mask, groups = random_groups(seed)
    got = run(name, rewards, mask, groups, norm_std)
    want = naive_advantages(rewards, mask, groups, name, norm_std)
    assert got.dtype == torch.float32 and got.shape == mask.shape
    assert torch.isfinite(got).all()
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))  # 0 on padding and dropped rows
    # grpo / rloo: float64 statistics and one rounding to float32 at the end (the returns sum
    # T terms); reinforce_pp then whitens in float32 over the batch's real tokens (a mean and a
    # variance of that many terms)
    terms = int(mask.sum()) if name == "reinforce_pp" else mask.shape[1]
    tol = rounding_tol(want.abs().max(), terms)
    assert torch.allclose(got.double(), want, rtol=0, atol=tol), (got.double() - want).abs().max()


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_groups_of_equal_returns_get_exactly_zero(name):
    """0.1 three times: float rounding puts its mean off 0.1, which a std of ~1e-17 plus
    GRPO's eps would blow up to ~1e-11 (and in float32 to ~1e-2); equal returns give 0."""
    rewards = torch.tensor([[0.1, 0.0]] * 3 + [[0.7, 0.2]] * 2 + [[1.0, 0.0], [3.0, 0.0]])
    mask = torch.tensor([[True, False]] * 3 + [[True, True]] * 2 + [[True, False]] * 2)
    groups = torch.tensor([5, 5, 5, 9, 9, 2, 2])
    got = run(name, rewards, mask, groups)
    assert torch.isfinite(got).all()
    if name != "reinforce_pp":  # whitening shifts every row by the batch mean
        assert torch.equal(got[:5], torch.zeros(5, 2))
        assert got[5, 0] < 0 < got[6, 0]
    else:
        assert got[0, 0] == got[1, 0] == got[2, 0] and got[3, 0] == got[4, 0] == got[3, 1]
    everything_equal = run(name, torch.full((4, 3), 0.1), torch.ones(4, 3, dtype=torch.bool),
                           torch.tensor([0, 0, 1, 1]))
    assert torch.equal(everything_equal, torch.zeros(4, 3))


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_dropped_rows_do_not_move_their_group(name):
    """A dropped row (nonfinite_reward: drop masks its response out; its score is 0 then)
    changes nothing for the rest of its group: the same as the group without that row."""
    rewards, mask, groups = random_groups(11)
    full = run(name, rewards, mask, groups)
    dropped = mask.clone()
    victim = int(torch.nonzero(mask.any(dim=1)).flatten()[0])
    dropped[victim] = False
    keep = [i for i in range(len(mask)) if i != victim]
    with_drop = run(name, torch.where(dropped, rewards, torch.zeros(())), dropped, groups)
    without_row = run(name, rewards[keep], mask[keep], groups[keep])
    assert torch.equal(with_drop[victim], torch.zeros_like(with_drop[victim]))
    tol = rounding_tol(full.abs().max(), int(mask.sum()))
    assert torch.allclose(with_drop[keep], without_row, rtol=0, atol=tol)


def test_the_registry_entries():
    for name in GROUP_ESTIMATORS:
        est = advantage_estimator(name)
        assert not est.needs_critic and est.needs_groups and est.normalized
    gae = advantage_estimator("gae")
    assert gae.needs_critic and not gae.needs_groups and not gae.normalized
    with pytest.raises(ValueError, match="needs the group ids|needs inputs.groups"):
        run("grpo", torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool), None)


# ---------------------------------------------------------------------------------- config errors
@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_a_group_estimator_with_one_sample_per_prompt_is_a_config_error(name, tmp_path, capsys):
    import launch

    with pytest.raises(ValueError, match=rf"advantage_estimator '{name}'.*samples_per_prompt >= 2, got "
                                         r"samples_per_prompt=1"):
        check_group_size(advantage_estimator(name), 1)
    check_group_size(advantage_estimator(name), 2)
    check_group_size(advantage_estimator("gae"), 1)
    code = launch.main(["--config", "tiny", "--run_dir", str(tmp_path / "run"), "--advantage_estimator", name])
    assert code == 2 and "samples_per_prompt >= 2" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def tiny_path(tiny_model_dir):
    return str(tiny_model_dir)


def test_the_learner_refuses_a_group_estimator_without_groups(tiny_path):
    from learner.learner import Learner
    from test_learner import make_config

    with pytest.raises(ValueError, match="samples_per_prompt >= 2"):
        Learner(make_config(advantage_estimator="grpo"), tiny_path)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_the_learner_uses_the_estimators_advantages_unwhitened_with_a_dropped_row(name, tiny_path):
    """Through the real Learner (PEFT LoRA on the tiny model): no value model, no value
    statistics; the PPO loss gets the estimator's advantages of the shaped rewards as they are
    (whiten_advantages on, but not applied to these); a NaN score (nonfinite_reward: drop)
    leaves its row out of its group."""
    from dataclasses import replace

    from learner.learner import Learner
    from ppo_ray.stats import CRITIC_FIELDS
    from test_learner import keep_experience, make_config, random_batch, rollout_inputs

    learner = Learner(make_config(advantage_estimator=name, samples_per_prompt=2, nonfinite_reward="drop"), tiny_path)
    assert learner.value_model is None and learner.config.whiten_advantages
    kept = keep_experience(learner)
    eos, pad = learner.policy.config.eos_token_id, learner.policy.config.pad_token_id
    batch = replace(random_batch((eos, pad)), groups=torch.arange(8) // 2)  # 4 prompts x 2 samples
    batch, ref, scores = rollout_inputs(learner, batch)
    scores[3] = float("nan")
    stats, _ = learner.update(batch, ref, scores)
    assert all(getattr(stats, k) is None for k in CRITIC_FIELDS) and stats.dropped_samples == 1
    exp = kept[-1]
    assert torch.equal(exp.advantages, run(name, exp.rewards, exp.mask, batch.groups))
    assert torch.equal(exp.advantages[3], torch.zeros_like(exp.advantages[3]))
    if name != "reinforce_pp":  # row 2 is alone in its group now: no baseline, advantage 0
        assert torch.equal(exp.advantages[2], torch.zeros_like(exp.advantages[2]))
    assert math.isfinite(stats.policy_loss)


def test_batch_size_must_be_a_multiple_of_samples_per_prompt():
    with pytest.raises(ConfigError, match=r"'batch_size' = 6 is invalid: must be a multiple of "
                                          r"samples_per_prompt=4"):
        PPOConfig(batch_size=6, samples_per_prompt=4)
    with pytest.raises(ConfigError, match="'samples_per_prompt' = 0 is invalid: must be >= 1"):
        PPOConfig(samples_per_prompt=0)
    config = PPOConfig(batch_size=12, samples_per_prompt=4, advantage_estimator="grpo")
    assert config.prompts_per_step == 3 and PPOConfig().prompts_per_step == PPOConfig().batch_size
    assert PPOConfig.from_args(["--samples_per_prompt", "2", "--grpo_norm_std", "false"]).grpo_norm_std is False


# ---------------------------------------------------------------------------------- the batch
def test_group_ids_survive_select_to_trimmed_cat_and_pickle():
    a = RolloutBatch.from_tokens([[5, 6], [5, 6], [7]], [[1, 2, 3], [4], [9, 9]], pad_token_id=0, eos_token_id=3,
                                 groups=[0, 0, 1])
    b = RolloutBatch.from_tokens([[8, 8, 8]], [[1]], pad_token_id=0, eos_token_id=3, groups=[2])
    assert a.groups.dtype == torch.long and a.groups.tolist() == [0, 0, 1]
    assert a.select([2, 0]).groups.tolist() == [1, 0]
    assert a.to("cpu").groups.tolist() == [0, 0, 1]
    assert a.trimmed().groups.tolist() == [0, 0, 1]
    joined = RolloutBatch.cat([a, b])
    assert joined.groups.tolist() == [0, 0, 1, 2]
    assert pickle.loads(pickle.dumps(joined)).groups.tolist() == [0, 0, 1, 2]
    plain = RolloutBatch.from_tokens([[5]], [[1]], pad_token_id=0, eos_token_id=3)
    assert plain.groups is None and plain.select([0]).groups is None
    with pytest.raises(ValueError, match="with group ids and rollouts without"):
        RolloutBatch.cat([a, plain])
    with pytest.raises(ValueError, match="groups must be a"):
        RolloutBatch.from_tokens([[5]], [[1]], pad_token_id=0, eos_token_id=3, groups=[0, 1])


# ---------------------------------------------------------------------------------- the generator
def test_the_generator_samples_n_per_prompt_in_contiguous_groups(vllm_llm, tiny_model_dir):
    from actors.generator import Generator
    from ppo_ray.data import bundled_prompts

    gen = Generator(vllm_llm, model_dir=tiny_model_dir, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8,
                    seed=0, max_prompt_length=400)
    try:
        prompts = bundled_prompts()[:3]
        grouped = gen.generate(prompts, step=3, prompt_offset=10, samples_per_prompt=4)
        single = gen.generate(prompts, step=3, prompt_offset=10)
    finally:
        gen.close()
    assert len(grouped) == 12 and len(single) == 3
    assert grouped.groups.tolist() == [10] * 4 + [11] * 4 + [12] * 4
    assert single.groups.tolist() == [10, 11, 12]
    assert grouped.prompts == [p for p in prompts for _ in range(4)]
    for i in range(3):  # every row of a group holds its prompt
        rows = grouped.select(list(range(4 * i, 4 * i + 4)))
        real = rows.prompt_ids[rows.prompt_mask].view(4, -1)
        assert (real == single.select([i]).prompt_ids[single.select([i]).prompt_mask]).all()
    # the n samples of a prompt are different samples (16 x 8 tokens at temperature 1)
    assert len({tuple(r) for r in grouped.response_ids.tolist()}) > 3
    assert torch.isfinite(grouped.gen_logprobs).all() and grouped.response_mask.any(dim=1).all()


# ---------------------------------------------------------------------------------- a real run
@pytest.mark.usefixtures("ray_session")
def test_a_grpo_step_through_the_trainer_samples_groups_and_has_no_critic():
    import ray

    from conftest import tiny_test_config
    from ppo_ray.data import bundled_prompts
    from ppo_ray.stats import CRITIC_FIELDS
    from ppo_ray.trainer import PPOTrainer
    from test_trainer import on_actor

    trainer = PPOTrainer(tiny_test_config(advantage_estimator="grpo", samples_per_prompt=2, batch_size=4,
                                          micro_batch_size=4, max_new_tokens=8))
    try:
        assert on_actor(trainer.roles.learner, lambda host: host.learner.value_model is None)
        out = trainer.ppo_step(bundled_prompts()[:2])  # 2 prompts x 2 samples
        assert len(out.generated_texts) == len(out.rewards) == 4
        for name in CRITIC_FIELDS:
            assert getattr(out.learner, name) is None, name
        assert math.isfinite(out.learner.policy_loss) and out.adapter_version == 1
        # train() draws batch_size / samples_per_prompt prompts per step
        prompts = bundled_prompts()[:10]
        history = trainer.train(prompts, steps=1, progress=False)
        assert len(history) == 1 and len(history[0].generated_texts) == 4
        assert len(trainer.cursor.order) == len(prompts) - 2
        versions = ray.get([g.version.remote() for g in trainer.roles.generators])
        assert versions == [trainer.version] == [2]
    finally:
        trainer.shutdown()
