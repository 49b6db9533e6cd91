"""ppo_ray/attribution.py and Learner.attribution: the seeds' SA pairs as a view of one step.

The learner's view of a few rows equals, number for number, the tensors its update computed
(its Experience, taken with Learner.experience_hook) and what its own functions compute from
them (learner.algos: shaped rewards, TD errors, GAE, returns, the group baselines), exactly:
the view copies tensors, it computes nothing of its own but the TD errors and the baseline,
with the functions the estimator uses, so no tolerance applies. Then the JSONL line round
trip and the token texts, without a model.
"""

from __future__ import annotations

import json
import math

import torch
from helpers import keep_experience, make_config, rollout_inputs
from tolerances import rounding_tol

from learner.algos import (AdvantageInputs, advantage_estimator, compute_gae_advantages, compute_returns,
                           compute_td_errors, masked_whiten, shape_rewards)
from ppo_ray.attribution import AttributionRows, RolloutAttribution, SAPair, _texts, sa_pairs


def decode(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


def _learner_step(tiny_path, special, **overrides):
    from dataclasses import replace

    from helpers import random_batch
    from learner.learner import Learner

    learner = Learner(make_config(**overrides), tiny_path)
    kept = keep_experience(learner)
    batch = random_batch(special, n=8, p=6, t=8, seed=3)
    if learner.estimator.needs_groups:
        batch = replace(batch, groups=torch.tensor([10, 10, 11, 11, 12, 12, 13, 13]))
    batch, ref, scores = rollout_inputs(learner, batch, seed=3)
    assert learner.attribution([0]) is None  # no update yet
    learner.update(batch, ref, scores)
    return learner, kept[0], scores


def _check_pairs(view: list[RolloutAttribution], exp, rows: list[int]) -> None:
    for r, i in zip(view, rows):
        n = int(exp.mask[i].sum())
        assert r.row == i and len(r.pairs) == n
        assert [p.action_id for p in r.pairs] == exp.rollouts.response_ids[i, :n].tolist()
        assert r.score == float(exp.scores[i])
        for t, p in enumerate(r.pairs):
            assert p.position == t and p.state == "".join(q.action for q in r.pairs[:t])
            assert p.logprob == float(exp.rollouts.gen_logprobs[i, t])
            assert p.old_logprob == float(exp.old_logprobs[i, t])
            assert p.ref_logprob == float(exp.ref_logprobs[i, t])
            assert p.kl == float(exp.kl[i, t])
            assert p.reward == float(exp.rewards[i, t])
            assert p.advantage == float(exp.advantages[i, t])
            assert p.in_loss == bool(exp.policy_mask[i, t])


def test_the_view_is_the_learners_tensors_of_the_step(tiny_path, special):
    """GAE: every number of every SA pair equals the update's own tensor; shaped rewards, TD
    errors, GAE, returns and whitening computed again with learner.algos from the step's
    KL, scores and values give the same numbers, bit for bit."""
    learner, exp, scores = _learner_step(tiny_path, special)
    cfg = learner.config
    rows = [0, 3, 5]
    tensors = learner.attribution(rows)
    view = sa_pairs(tensors, decode, step=1)
    _check_pairs(view, exp, rows)
    mask = exp.mask
    rewards = shape_rewards(exp.scores, exp.kl, mask, learner.kl_coef, cfg.reward_shaping)
    assert torch.equal(rewards, exp.rewards)
    td = compute_td_errors(rewards, exp.values, mask, cfg.gamma)
    raw = compute_gae_advantages(rewards, exp.values, mask, cfg.gamma, cfg.lam)
    returns = compute_returns(raw, exp.values, mask)
    advantages = masked_whiten(raw, mask)
    assert torch.equal(returns, exp.returns) and torch.equal(advantages, exp.advantages)
    for r, i in zip(view, rows):
        assert r.baseline is None and r.estimator == "gae" and r.whitened and r.kl_coef == learner.kl_coef
        for t, p in enumerate(r.pairs):
            assert p.value == float(exp.values[i, t])
            assert p.td_error == float(td[i, t])
            assert p.return_ == float(returns[i, t])
    # the JSONL line gives the same rollout back (floats as JSON: repr, exact)
    again = [RolloutAttribution.from_dict(json.loads(json.dumps(r.as_dict()))) for r in view]
    assert again == view


def test_a_group_estimator_shows_its_baseline_and_no_value(tiny_path, special):
    learner, exp, scores = _learner_step(tiny_path, special, advantage_estimator="rloo", samples_per_prompt=2,
                                         batch_size=8)
    rows = [0, 1, 2]
    view = sa_pairs(learner.attribution(rows), decode)
    _check_pairs(view, exp, rows)
    s = exp.scores.double().tolist()
    for r, i in zip(view, rows):
        other = i ^ 1  # the other sample of its prompt (groups of two contiguous rows)
        assert r.group == 10 + i // 2 and r.baseline == s[other] and not r.whitened
        assert all(p.value is None and p.td_error is None and p.return_ is None for p in r.pairs)
    # the registered baseline is the one the estimator subtracts: RLOO's advantage is score - baseline,
    # computed in float64 both ways and rounded to float32 once (one rounding at the scores' size)
    est = advantage_estimator("rloo")
    inputs = AdvantageInputs(rewards=exp.rewards, mask=exp.mask, scores=exp.scores, values=None, gamma=1.0, lam=1.0,
                             groups=exp.rollouts.groups, kl=torch.zeros_like(exp.kl), kl_coef=0.0)
    adv = est.fn(inputs)[:, 0].double()
    want = exp.scores.double() - est.baseline(inputs)
    assert (adv - want).abs().max() <= rounding_tol(exp.scores.abs().max(), terms=2)


def test_asking_for_the_view_changes_nothing_of_the_next_step(tiny_path, special):
    """Two learners of one seed take the same two updates; one is asked for the view between
    them: the second update's statistics and the adapters after it are equal, bit for bit
    (float32 on the CPU, one thread: the same computation)."""
    from helpers import MEASURED_STATS, random_batch
    from learner.learner import Learner

    def two_updates(ask: bool):
        learner = Learner(make_config(), tiny_path)
        out = []
        for seed in (3, 4):
            batch, ref, scores = rollout_inputs(learner, random_batch(special, n=8, p=6, t=8, seed=seed,
                                                                      version=learner.version), seed=seed)
            stats, weights = learner.update(batch, ref, scores)
            if ask and seed == 3:
                assert learner.attribution([0, 7]) is not None
            out.append((stats, weights))
        return out

    asked, plain = two_updates(True), two_updates(False)
    for (s1, w1), (s2, w2) in zip(asked, plain):
        a, b = s1.as_dict(), s2.as_dict()
        for key in [k for k in a if k.endswith("_s") or k in MEASURED_STATS or k.startswith("learner_mfu")]:
            a.pop(key), b.pop(key)
        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
        assert all(torch.equal(w1.tensors[k], w2.tensors[k]) for k in w1.tensors)


def test_bad_rows_are_named(tiny_path, special):
    import pytest

    learner, _, _ = _learner_step(tiny_path, special)
    with pytest.raises(ValueError, match=r"rows \[8\] are outside the step's batch of 8"):
        learner.attribution([1, 8])


# ----------------------------------------------------------------------------- without a model
def hand_rows(critic: bool = True) -> AttributionRows:
    """Two rollouts by hand, the second with one token less (padding past it)."""
    f = lambda *rows: torch.tensor(rows, dtype=torch.float32)  # noqa: E731
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return AttributionRows(
        rows=[0, 1], version=2, prompt_ids=torch.tensor([[0, 5, 6], [7, 8, 9]]),
        prompt_mask=torch.tensor([[False, True, True], [True, True, True]]),
        response_ids=torch.tensor([[11, 12, 2], [13, 2, 0]]), mask=mask, loss_mask=mask.clone(),
        gen_logprobs=f([-1.0, -2.0, -0.5], [-0.25, -3.0, 0.0]), old_logprobs=f([-1.0, -2.0, -0.5], [-0.25, -3.0, 0]),
        ref_logprobs=f([-1.5, -2.0, -0.25], [-0.5, -1.0, 0.0]), kl=f([0.5, 0.0, -0.25], [0.25, -2.0, 0.0]),
        rewards=f([-0.025, 0.0, 1.0125], [-0.0125, -0.9, 0.0]), advantages=f([0.5, -0.25, 1.5], [-1.0, -2.0, 0.0]),
        scores=f(1.0, -1.0), values=f([0.1, 0.2, 0.3], [0.0, 0.5, 0.0]) if critic else None,
        td_errors=f([0.1, 0.1, 0.7], [0.5, -1.4, 0.0]) if critic else None,
        returns=f([0.9, 0.8, 1.0], [-0.9, -0.9, 0.0]) if critic else None,
        baselines=None if critic else torch.tensor([0.0, math.nan], dtype=torch.float64),
        groups=None if critic else torch.tensor([4, 5]), estimator="gae" if critic else "grpo", kl_coef=0.05,
        whitened=critic)


def test_sa_pairs_of_hand_made_rows_and_their_json_line():
    view = sa_pairs(hand_rows(), decode, step=3)
    assert [len(r.pairs) for r in view] == [3, 2]
    assert view[0].prompt == "<5><6>" and view[0].response == "<11><12><2>"
    assert view[1].pairs[1] == SAPair(1, "<13>", 2, "<2>", -3.0, -3.0, -1.0, -2.0, float(torch.tensor(-0.9)), 0.5,
                                      float(torch.tensor(-1.4)), -2.0, float(torch.tensor(-0.9)), True)
    line = view[0].as_dict()
    assert line["step"] == 3 and line["return"] == [p.return_ for p in view[0].pairs] and "state" not in line
    assert RolloutAttribution.from_dict(json.loads(json.dumps(line))) == view[0]
    free = sa_pairs(hand_rows(critic=False), decode)
    assert free[0].baseline == 0.0 and free[1].baseline is None and free[1].group == 5  # NaN: no baseline
    assert all(p.value is None for r in free for p in r.pairs)
    assert RolloutAttribution.from_dict(json.loads(json.dumps(free[1].as_dict()))) == free[1]


def test_token_texts_are_what_each_token_adds_to_the_decoded_text():
    """A byte-level token that only starts a character adds nothing, the one completing it adds
    the character (a per-token decode would show two replacement characters): the texts join
    to the decoded response."""
    pieces = {1: b"a", 2: b"\xc3", 3: b"\xa9", 4: b" b"}

    def byte_decode(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    assert _texts([1, 2, 3, 4], byte_decode) == ["a", "", "é", " b"]
    assert _texts([1, 2], byte_decode) == ["a", "\ufffd"]  # a response cut mid-character shows what decode shows


def test_the_held_out_view_is_the_references_logprobs_and_kl_of_the_samples(tiny_path, special):
    """An evaluation's held-out samples (ReferenceHost.held_out, the plain class: no Ray): the
    view of rows [5, 1] of two replica parts holds their generator logprobs, the reference's
    logprobs of them (the reference's own call on those rows) and KL_t of the two with the
    configured estimator, exactly; no learner number."""
    from learner.algos import kl_penalty
    from ppo_ray.batch import RolloutBatch
    from ppo_ray.driver.hosts import ReferenceHost

    from helpers import random_batch

    config = make_config()
    host = ReferenceHost(config.slice("reference"), tiny_path)
    batch = random_batch(special, n=8, p=6, t=8, seed=5)
    parts = [batch.select(list(range(4))), batch.select(list(range(4, 8)))]
    view = host.held_out(*parts, rows=[5, 1], kl_estimator="k3")
    picked = RolloutBatch.cat(parts).select([5, 1])
    ref, _ = host.scorer.logprobs(picked)
    kl = kl_penalty(picked.gen_logprobs.float(), ref.float(), "k3", mask=picked.response_mask)
    assert view.held_out and view.rows == [5, 1] and view.version == batch.adapter_version
    for name in ("old_logprobs", "rewards", "advantages", "loss_mask", "scores", "values", "baselines"):
        assert getattr(view, name) is None, name
    out = sa_pairs(view, decode, step=4)
    for r, i in zip(out, (5, 1)):
        n = int(batch.response_mask[i].sum())
        assert r.held_out and r.step == 4 and r.row == i and len(r.pairs) == n
        assert [p.action_id for p in r.pairs] == batch.response_ids[i, :n].tolist()
        j = (5, 1).index(i)
        assert [p.logprob for p in r.pairs] == batch.gen_logprobs[i, :n].float().tolist()
        assert [p.ref_logprob for p in r.pairs] == ref[j, :n].tolist()
        assert [p.kl for p in r.pairs] == kl[j, :n].tolist()
        assert all(p.advantage is None and p.reward is None and p.old_logprob is None and not p.in_loss
                   for p in r.pairs)
        line = json.loads(json.dumps({**r.as_dict(), "score": 0.5}))
        back = RolloutAttribution.from_dict(line)
        assert back.held_out and back.pairs == r.pairs and back.score == 0.5
    old = {k: v for k, v in out[0].as_dict().items() if k != "held_out"}  # a line from before the field
    assert not RolloutAttribution.from_dict(old).held_out
