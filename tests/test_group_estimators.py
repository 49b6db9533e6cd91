"""The group estimators (learner.algos: grpo, rloo, reinforce_pp) and group sampling
(samples_per_prompt): each estimator equals a naive reference (Python loops, float64) on
random groups with random masks, equal-score groups and dropped rows; the group statistics
are of the scores, the KL enters per token afterwards at kl_coef (an equal-score group's
advantage is its KL term); the config errors; the batch's group ids through select / to /
trimmed / cat / pickle; the generator's n samples per prompt on the session's vLLM engine;
one short PPOTrainer run with grpo."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from learner.algos import (GRPO_EPS, AdvantageInputs, advantage_estimator, check_group_size,
                           masked_whiten)
from ppo_ray.batch import RolloutBatch
from ppo_ray.config import ConfigError, PPOConfig
from tolerances import rounding_tol

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
WHITEN_EPS = 1e-8  # learner.algos.masked_whiten's default


def naive_advantages(scores, kl, mask, groups, kind: str, beta: float, norm_std: bool = True) -> torch.Tensor:
    """The estimators' definitions, one row and one token at a time, in float64: a row's
    score advantage from the scores of its group's valid rows (a row without real tokens is
    dropped: out of every statistic, advantage 0), then on each real token t the KL still
    to come, -beta * sum_{t' >= t} KL_t' (OpenRLHF's order)."""
    B, T = mask.shape
    valid = [bool(mask[i].any()) for i in range(B)]
    s = [float(scores[i]) for i in range(B)]
    score_adv = [0.0] * B
    for i in range(B):
        if not valid[i]:
            continue
        members = [j for j in range(B) if int(groups[j]) == int(groups[i]) and valid[j]]
        k = len(members)
        mean = sum(s[j] for j in members) / k
        if kind == "grpo":
            std = math.sqrt(sum((s[j] - mean) ** 2 for j in members) / (k - 1)) if k > 1 else 0.0
            score_adv[i] = (s[i] - mean) / (std + GRPO_EPS) if norm_std else s[i] - mean
        elif kind == "rloo":
            score_adv[i] = s[i] - sum(s[j] for j in members if j != i) / (k - 1) if k > 1 else 0.0
        else:  # reinforce_pp: group-mean baseline, then whitened over the batch's real tokens
            score_adv[i] = s[i] - mean
    out = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                to_go = sum(float(kl[i, u]) for u in range(t, T) if mask[i, u])
                out[i, t] = score_adv[i] - beta * to_go
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
    """Scores (B,), KL (B, T) float32, mask (B, T) bool and group ids (B,) long: groups of
    2-5 rows with scattered, non-contiguous ids (the estimators must read the ids, not the
    row order), random response lengths, NaN garbage on padding and on dropped rows' scores,
    and: one group of equal scores (its rows' KL and lengths differ), one group with all rows
    but one dropped, one group entirely dropped, scattered dropped rows."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 6, (8,), generator=g).tolist()
    ids = torch.randperm(1000, generator=g)[: len(sizes)] * 7  # arbitrary distinct ids
    groups = torch.cat([torch.full((n,), int(i)) for n, i in zip(sizes, ids)])
    B = len(groups)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths.unsqueeze(1)
    kl = torch.randn(B, T, generator=g) * 0.3
    scores = torch.randn(B, generator=g)
    rows = [torch.nonzero(groups == int(i)).flatten().tolist() for i in ids]
    equal, lonely, gone = rows[0], rows[1], rows[2]
    scores[equal] = float(scores[equal[0]])
    mask[lonely[1:]] = False  # all but one row of this group dropped
    mask[gone] = False  # a whole group dropped
    others = [r for rs in rows[3:] for r in rs]
    drop = torch.rand(len(others), generator=g) < 0.15
    mask[[r for r, d in zip(others, drop.tolist()) if d]] = False
    kl = torch.where(mask, kl, torch.full_like(kl, float("nan")))  # garbage on padding
    scores = torch.where(mask.any(dim=1), scores, torch.full_like(scores, float("nan")))  # and on dropped rows
    perm = torch.randperm(B, generator=g)  # rows of a group scattered through the batch
    return scores[perm], kl[perm], mask[perm], groups[perm]


def run(name: str, scores, kl, mask, groups, beta: float, norm_std: bool = True) -> torch.Tensor:
    """The estimator on these inputs. rewards are NaN: a group estimator must not read them
    (its statistics are of the scores, its per-token term of the KL)."""
    estimator = advantage_estimator(name)
    params = {"grpo_norm_std": norm_std} if name == "grpo" else {}  # grpo's own parameter (its Param)
    return estimator.fn(AdvantageInputs(
        rewards=torch.full(mask.shape, float("nan")), mask=mask, scores=scores, values=None, gamma=0.9, lam=0.8,
        groups=groups, kl=kl, kl_coef=beta), **params)


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("name,norm_std", [("grpo", True), ("grpo", False), ("rloo", True), ("reinforce_pp", True)])
@pytest.mark.parametrize("seed", range(5))
def test_each_estimator_equals_its_naive_reference(name, norm_std, seed, beta):
    scores, kl, mask, groups = random_groups(seed)
    got = run(name, scores, kl, mask, groups, beta, norm_std)
    want = naive_advantages(scores, kl, mask, groups, name, beta, norm_std)
    assert got.dtype == torch.float32 and got.shape == mask.shape
    assert torch.isfinite(got).all()
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))  # 0 on padding and dropped rows
    # grpo / rloo: float64 statistics and KL sums (up to T terms), one rounding to float32 at
    # the end; reinforce_pp then whitens in float32 over the batch's real tokens (a mean and
    # a variance of that many terms)
    terms = int(mask.sum()) if name == "reinforce_pp" else mask.shape[1]
    tol = rounding_tol(want.abs().max(), terms)
    assert torch.allclose(got.double(), want, rtol=0, atol=tol), (got.double() - want).abs().max()


def exact_kl_batch():
    """Two groups: rows 0-2 with equal scores and different KL and lengths, rows 3-4 with
    different scores. The KL values are multiples of 1/64 (sums of up to 4 of them are exact
    in any order), so the KL term -beta * sum_{t' >= t} KL_t' has one rounding, beta's."""
    scores = torch.tensor([0.5, 0.5, 0.5, 1.0, -2.0])
    kl = torch.tensor([[0.25, -0.125, 0.5, 0.0625], [1.5, 0.75, 0.0, 0.0], [0.015625, 0.0, 0.0, 0.0],
                       [0.5, 0.5, 0.25, 0.0], [-0.25, 0.125, 0.0, 0.0]])
    mask = torch.tensor([[True] * 4, [True, True, False, False], [True, False, False, False],
                         [True, True, True, False], [True, True, False, False]])
    kl = torch.where(mask, kl, torch.full_like(kl, float("nan")))
    to_go = torch.where(mask, torch.where(mask, kl, 0.0).double().flip(-1).cumsum(-1).flip(-1), 0.0)  # exact
    return scores, kl, mask, torch.tensor([4, 4, 4, 9, 9]), to_go


@pytest.mark.parametrize("name,norm_std", [("grpo", True), ("grpo", False), ("rloo", True)])
def test_an_equal_score_groups_advantage_is_its_kl_term_at_strength_kl_coef(name, norm_std):
    """The group statistics are of the scores: a group of equal scores has score advantage 0,
    and each token's advantage is exactly -kl_coef * (its KL to the response's end): 100 times
    larger at kl_coef 0.1 than at 0.001, and 0 at kl_coef 0. (With the KL inside the group
    statistics, as before, GRPO gave such a group about +-1 standard unit at every kl_coef but
    0.) The other group's score part is the scores' formula alone."""
    scores, kl, mask, groups, to_go = exact_kl_batch()
    adv = {beta: run(name, scores, kl, mask, groups, beta, norm_std) for beta in (0.1, 0.001, 0.0)}
    for beta, got in adv.items():
        assert torch.equal(got[:3], (-beta * to_go[:3]).float()), (beta, got[:3])
    assert torch.equal(adv[0.0][:3], torch.zeros(3, 4))
    real = mask[:3]
    assert (adv[0.1][:3][real] != 0).all()
    ratio = adv[0.1][:3][real].double() / adv[0.001][:3][real].double()
    assert torch.allclose(ratio, torch.full_like(ratio, 100.0), rtol=rounding_tol(1.0, 2), atol=0)  # two float32 roundings
    # rows 3-4: the scores' own advantage (the formula on the scores alone, kl_coef 0), plus the KL term
    want = naive_advantages(scores, kl, mask, groups, name, 0.0, norm_std)[3:]
    assert torch.allclose(adv[0.0][3:].double(), want, rtol=0, atol=rounding_tol(want.abs().max()))
    assert torch.allclose(adv[0.1][3:].double(), want - 0.1 * to_go[3:], rtol=0,
                          atol=rounding_tol((want - 0.1 * to_go[3:]).abs().max()))
    assert want[0, 0] > 0 > want[1, 0]


def test_reinforce_pp_is_dr_grpos_advantages_whitened():
    """REINFORCE++ (OpenRLHF's reinforce_baseline): the score minus its group's mean plus the
    KL term, whitened over the batch's tokens, i.e. Dr. GRPO's advantages whitened: its
    equal-score group gets its KL term whitened with the batch's statistics."""
    scores, kl, mask, groups, to_go = exact_kl_batch()
    for beta in (0.1, 0.0):
        dr_grpo = run("grpo", scores, kl, mask, groups, beta, norm_std=False)
        assert torch.equal(run("reinforce_pp", scores, kl, mask, groups, beta), masked_whiten(dr_grpo, mask))
    assert torch.equal(dr_grpo[:3], torch.zeros(3, 4))  # beta 0


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_groups_of_equal_scores_get_exactly_zero_without_a_kl(name):
    """0.1 three times: float rounding puts its mean off 0.1, which a std of ~1e-17 plus
    GRPO's eps would blow up to ~1e-11 (and in float32 to ~1e-2); equal scores give 0."""
    scores = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 1.0, 3.0])
    kl = torch.ones(7, 2)  # kl_coef 0: no KL term
    mask = torch.tensor([[True, False]] * 3 + [[True, True]] * 2 + [[True, False]] * 2)
    groups = torch.tensor([5, 5, 5, 9, 9, 2, 2])
    got = run(name, scores, kl, mask, groups, 0.0)
    assert torch.isfinite(got).all()
    if name != "reinforce_pp":  # whitening shifts every row by the batch mean
        assert torch.equal(got[:5], torch.zeros(5, 2))
        assert got[5, 0] < 0 < got[6, 0]
    else:
        assert got[0, 0] == got[1, 0] == got[2, 0] and got[3, 0] == got[4, 0] == got[3, 1]
    everything_equal = run(name, torch.full((4,), 0.1), torch.ones(4, 3), torch.ones(4, 3, dtype=torch.bool),
                           torch.tensor([0, 0, 1, 1]), 0.0)
    assert torch.equal(everything_equal, torch.zeros(4, 3))


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_dropped_rows_do_not_move_their_group(name):
    """A dropped row (nonfinite_reward: drop masks its response out; its score is 0 then)
    changes nothing for the rest of its group: the same as the group without that row."""
    scores, kl, mask, groups = random_groups(11)
    full = run(name, scores, kl, mask, groups, 0.1)
    dropped = mask.clone()
    victim = int(torch.nonzero(mask.any(dim=1)).flatten()[0])
    dropped[victim] = False
    keep = [i for i in range(len(mask)) if i != victim]
    with_drop = run(name, torch.where(dropped.any(dim=1), scores, 0.0), torch.where(dropped, kl, 0.0), dropped,
                    groups, 0.1)
    without_row = run(name, scores[keep], kl[keep], mask[keep], groups[keep], 0.1)
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
        run("grpo", torch.zeros(2), torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool), None, 0.1)
    with pytest.raises(ValueError, match="needs inputs.kl"):
        run("rloo", torch.zeros(2), None, torch.ones(2, 2, dtype=torch.bool), torch.zeros(2), 0.1)


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


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
@pytest.mark.parametrize("field,value", [("whiten_rewards", "true"), ("reward_shaping", "every_token")])
def test_reward_options_a_group_estimator_does_not_read_are_config_errors(name, field, value, tmp_path, capsys):
    """whiten_rewards and reward_shaping shape the per-token rewards GAE reads (gae's registration
    says it reads them); a group estimator reads the scores and the KL, so either would
    silently do nothing: the config refuses it (ppo_ray.config.ignored_knobs)."""
    import launch

    assert {"whiten_rewards", "reward_shaping"} <= set(advantage_estimator("gae").reads)
    assert not {"whiten_rewards", "reward_shaping"} & set(advantage_estimator(name).reads)
    code = launch.main(["--config", "tiny", "--run_dir", str(tmp_path / "run"), "--advantage_estimator", name,
                        "--samples_per_prompt", "2", f"--{field}", value])
    assert code == 2 and f"'{field}' = " in (err := capsys.readouterr().err), err
    assert f"advantage_estimator '{name}' does not read it (read by gae)" in err
    assert not (tmp_path / "run").exists()


def test_dr_grpo_refuses_the_per_response_mean_aggregation():
    """grpo_norm_std: false is Dr. GRPO, which also drops GRPO's per-response 1/|o_i| length
    normalisation: seq_mean_token_mean is that normalisation, so the pair is refused, naming
    both fields; the length-free aggregations pass. GRPO with std keeps any aggregation; another
    estimator refuses the field set to false (it would not read it)."""
    grpo = dict(advantage_estimator="grpo", samples_per_prompt=2)
    with pytest.raises(ConfigError, match=r"'grpo_norm_std' = False is invalid: false \(Dr. GRPO\) needs loss_agg: "
                                          r"token_sum_norm, token_mean or seq_mean_token_sum \(got "
                                          r"seq_mean_token_mean\).*1/\|o_i\|"):
        PPOConfig(**grpo, grpo_norm_std=False, loss_agg="seq_mean_token_mean")
    assert PPOConfig(**grpo, grpo_norm_std=False).loss_agg == "token_mean"
    for agg in ("token_sum_norm", "seq_mean_token_sum"):
        assert PPOConfig(**grpo, grpo_norm_std=False, loss_agg=agg).loss_agg == agg
    PPOConfig(**grpo, loss_agg="seq_mean_token_mean")  # the original GRPO's aggregation
    with pytest.raises(ConfigError, match="'grpo_norm_std' = False is invalid: advantage_estimator 'rloo' does not "
                                          r"read it \(read by grpo\)"):  # another estimator's knob: refused
        PPOConfig(advantage_estimator="rloo", samples_per_prompt=2, grpo_norm_std=False)


@pytest.fixture(scope="module")
def tiny_path(tiny_model_dir):
    return str(tiny_model_dir)


def test_the_learner_refuses_a_group_estimator_without_groups(tiny_path):
    from learner.learner import Learner
    from helpers import make_config

    with pytest.raises(ValueError, match="samples_per_prompt >= 2"):
        Learner(make_config(advantage_estimator="grpo"), tiny_path)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_the_learner_uses_the_estimators_advantages_unwhitened_with_a_dropped_row(name, tiny_path):
    """Through the real Learner (PEFT LoRA on the tiny model): no value model, no value
    statistics; the PPO loss gets the estimator's advantages of the scores and the KL at the
    step's kl_coef as they are (whiten_advantages on, but not applied to these); a NaN score
    (nonfinite_reward: drop) leaves its row out of its group."""
    from dataclasses import replace

    from learner.learner import Learner
    from ppo_ray.stats import CRITIC_FIELDS
    from helpers import keep_experience, make_config, random_batch, rollout_inputs

    learner = Learner(make_config(advantage_estimator=name, samples_per_prompt=2, nonfinite_reward="drop"), tiny_path)
    assert learner.value_model is None and learner.config.whiten_advantages
    kept = keep_experience(learner)
    eos, pad = learner.policy.config.eos_token_id, learner.policy.config.pad_token_id
    batch = replace(random_batch((eos, pad)), groups=torch.arange(8) // 2)  # 4 prompts x 2 samples
    batch, ref, scores = rollout_inputs(learner, batch)
    scores[3] = float("nan")
    stats, _ = learner.update(batch, ref, scores)
    assert all(getattr(stats, k) is None for k in CRITIC_FIELDS) and stats.dropped_samples == 1
    exp, beta = kept[-1], learner.config.kl_coef
    assert torch.equal(exp.advantages, run(name, exp.scores, exp.kl, exp.mask, batch.groups, beta))
    want = naive_advantages(exp.scores, exp.kl, exp.mask, batch.groups, name, beta)
    terms = int(exp.mask.sum()) if name == "reinforce_pp" else exp.mask.shape[1]
    assert torch.allclose(exp.advantages.double(), want, rtol=0, atol=rounding_tol(want.abs().max(), terms))
    assert torch.equal(exp.advantages[3], torch.zeros_like(exp.advantages[3]))
    if name != "reinforce_pp":  # row 2 is alone in its group now: no baseline, its advantage is its KL term
        kl_term = naive_advantages(torch.zeros(8), exp.kl, exp.mask, batch.groups, name, beta)[2]
        assert (kl_term[exp.mask[2]] != 0).all()
        assert torch.allclose(exp.advantages[2].double(), kl_term, rtol=0, atol=rounding_tol(kl_term.abs().max(), 16))
    assert math.isfinite(stats.policy_loss)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_in_the_learner_an_equal_score_group_gets_the_kl_term_at_kl_coef(name, tiny_path):
    """The same rollouts updated at kl_coef 0.1, 0.001 and 0 (SGD at lr 0: the policy, so its
    KL to the reference, stays where it was), groups of 2 of which three have equal scores:
    their advantages (before REINFORCE++'s whitening) are -kl_coef * the KL from each token on,
    100 times larger at 0.1 than at 0.001, 0 at 0; the group of different scores keeps its
    scores' own advantage. With kl_in_loss the KL is not in the advantages at all."""
    from dataclasses import replace

    from learner.learner import Learner
    from helpers import keep_experience, make_config, random_batch, rollout_inputs, with_sgd

    learner = with_sgd(Learner(make_config(advantage_estimator=name, samples_per_prompt=2), tiny_path), lr=0.0)
    kept = keep_experience(learner)
    eos, pad = learner.policy.config.eos_token_id, learner.policy.config.pad_token_id
    batch = replace(random_batch((eos, pad)), groups=torch.arange(8) // 2)  # 4 prompts x 2 samples
    batch, ref, _ = rollout_inputs(learner, batch)
    scores = torch.tensor([1.0, 1.0, -0.5, -0.5, 2.0, 0.0, 0.25, 0.25])  # group 2 (rows 4, 5) differs
    equal = torch.tensor([0, 1, 2, 3, 6, 7])
    adv = {}
    for beta in (0.1, 0.001, 0.0):
        learner.kl_coef = beta
        learner.update(replace(batch, adapter_version=learner.version), ref, scores)
        exp = kept[-1]
        assert torch.equal(exp.kl, kept[0].kl)  # lr 0: the same policy, the same KL
        mask = exp.mask
        kl_term = naive_advantages(torch.zeros(8), exp.kl, mask, batch.groups, "rloo", beta)  # -beta * KL to go
        adv[beta] = exp.advantages
        if name == "reinforce_pp":  # whitened: the pre-whitening advantages are Dr. GRPO's (see above)
            score_part = naive_advantages(scores, torch.zeros_like(exp.kl), mask, batch.groups, "grpo", 0.0, False)
            want = naive_advantages(scores, exp.kl, mask, batch.groups, name, beta)
            assert torch.allclose(exp.advantages.double(), want, rtol=0,
                                  atol=rounding_tol(want.abs().max(), int(mask.sum())))
            assert torch.equal(score_part[equal], torch.zeros(6, mask.shape[1], dtype=torch.float64))
            continue
        got = exp.advantages.double()
        tol = rounding_tol(kl_term.abs().max())  # float64 sums, one float32 rounding
        assert torch.allclose(got[equal], kl_term[equal], rtol=0, atol=tol), (beta, (got - kl_term)[equal].abs().max())
        scores_only = naive_advantages(scores, exp.kl, mask, batch.groups, name, 0.0)
        assert torch.allclose(got[4:6], scores_only[4:6] + kl_term[4:6], rtol=0, atol=rounding_tol(got.abs().max()))
        assert scores_only[4, 0] > 0 > scores_only[5, 0]
    if name != "reinforce_pp":
        real = mask[equal]
        assert torch.equal(adv[0.0][equal], torch.zeros(6, mask.shape[1]))
        assert (adv[0.1][equal][real] != 0).all()
        ratio = adv[0.1][equal][real].double() / adv[0.001][equal][real].double()
        assert torch.allclose(ratio, torch.full_like(ratio, 100.0), rtol=rounding_tol(1.0, 2), atol=0)

    in_loss = Learner(make_config(advantage_estimator=name, samples_per_prompt=2, kl_in_loss=True, kl_coef=0.1),
                      tiny_path)
    kept = keep_experience(in_loss)
    in_loss.update(replace(batch, adapter_version=in_loss.version), ref, scores)
    exp = kept[-1]
    assert exp.kl.abs().sum() > 0
    assert torch.equal(exp.advantages, run(name, scores, torch.zeros_like(exp.kl), exp.mask, batch.groups, 0.0))


def test_batch_size_must_be_a_multiple_of_samples_per_prompt():
    with pytest.raises(ConfigError, match=r"'batch_size' = 6 is invalid: must be a multiple of "
                                          r"samples_per_prompt=4"):
        PPOConfig(batch_size=6, samples_per_prompt=4)
    with pytest.raises(ConfigError, match="'samples_per_prompt' = 0 is invalid: must be >= 1"):
        PPOConfig(samples_per_prompt=0)
    config = PPOConfig(batch_size=12, samples_per_prompt=4, advantage_estimator="grpo")
    assert config.prompts_per_step == 3 and PPOConfig().prompts_per_step == PPOConfig().batch_size
    assert PPOConfig.from_args(["--advantage_estimator", "grpo", "--samples_per_prompt", "2", "--grpo_norm_std",
                                "false"]).grpo_norm_std is False


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

    from helpers import tiny_test_config
    from ppo_ray.data import bundled_prompts
    from ppo_ray.stats import CRITIC_FIELDS
    from ppo_ray.trainer import PPOTrainer
    from helpers import on_actor

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
