"""The loss-side options of issue 30: the off-policy correction of the generator/learner
mismatch (is_correction tis | mis, per token or sequence), the mismatch statistics,
dual-clip PPO and the KL in the loss (kl_in_loss).

Each formula against a naive reference (Python loops in float64); then the learner: with
generator == learner every correction is exactly none, and with an injected mismatch the
corrected gradient equals the importance-weighted loss's gradient computed by hand.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace


import pytest
import torch

from learner.algos import (IS_CORRECTIONS, IS_LEVELS, importance_ratio, importance_weights, kl_penalty, mismatch_stats,
                           outside_is_band)
from learner.losses import ppo_clip_loss
from learner.buffer import ExperienceBuffer
from learner.learner import Learner
from mismatch import OUTLIER, injected_mismatch
from ppo_ray import config as config_module
from ppo_ray.batch import TrimPlan
from ppo_ray.config import ConfigError, PPOConfig
from helpers import (assert_grads_close, keep_experience, logprob_tol, make_config, policy_grads, random_batch,
                     rollout_inputs, with_sgd)
from tolerances import grad_terms, rounding_tol


def random_tokens(b=6, t=7, seed=0, spread=0.3):
    """learner and generator logprobs (float64) that differ by ~spread nats, a ragged mask
    (row 0 full, one row empty)."""
    g = torch.Generator().manual_seed(seed)
    learner = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    gen = learner + spread * torch.randn(b, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0], lengths[-1] = t, 0
    mask = torch.arange(t) < lengths[:, None]
    return learner, gen, mask


# ---------------------------------------------------------------------- the formulas
def naive_weights(learner, gen, mask, correction, cap, level):
    """importance_weights by loops: (weights or None, kept mask) as nested lists."""
    b, t = mask.shape
    weights = [[0.0] * t for _ in range(b)]
    keep = [[False] * t for _ in range(b)]
    for i in range(b):
        row_log = sum(float(learner[i, j] - gen[i, j]) for j in range(t) if mask[i, j])
        for j in range(t):
            if not mask[i, j]:
                continue
            w = math.exp(row_log if level == "sequence" else float(learner[i, j] - gen[i, j]))
            weights[i][j] = min(w, cap)
            keep[i][j] = correction != "mis" or 1 / cap <= w <= cap
    return (weights if correction == "tis" else None), keep


@pytest.mark.parametrize("level", IS_LEVELS)
@pytest.mark.parametrize("correction", IS_CORRECTIONS)
def test_importance_weights_equal_the_naive_reference(correction, level):
    learner, gen, mask = random_tokens(spread=0.6)
    weights, keep = importance_weights(learner, gen, mask, correction, 1.5, level)
    want_w, want_keep = naive_weights(learner, gen, mask, correction, 1.5, level)
    assert keep.tolist() == want_keep
    if want_w is None:
        assert weights is None
    else:
        torch.testing.assert_close(weights, torch.tensor(want_w, dtype=torch.float64), rtol=1e-12, atol=0)
    if correction == "mis":  # the premise: some tokens (rows) are in, some out
        assert 0 < int(keep.sum()) < int(mask.sum())


@pytest.mark.parametrize("level", IS_LEVELS)
def test_equal_logprobs_leave_every_correction_exactly_none(level):
    learner, _, mask = random_tokens()
    for correction in ("tis", "mis"):
        weights, keep = importance_weights(learner, learner.clone(), mask, correction, 2.0, level)
        assert torch.equal(keep, mask)
        if weights is not None:
            assert torch.equal(weights, mask.double())  # exactly 1 on every real token


def test_mismatch_stats_equal_the_naive_reference():
    learner, gen, mask = random_tokens(spread=0.1)
    got = mismatch_stats(learner, gen, mask)
    pairs = [(float(learner[i, j]), float(gen[i, j])) for i, j in mask.nonzero().tolist()]
    outside = sum(not (0.9 <= math.exp(a - b) <= 1.1) for a, b in pairs) / len(pairs)
    assert 0 < outside < 1  # the premise: some inside the band, some outside
    assert got["mismatch_outside_frac"].item() == pytest.approx(outside, abs=1e-12)
    assert got["mismatch_log_ratio_abs"].item() == pytest.approx(sum(abs(a - b) for a, b in pairs) / len(pairs),
                                                                 rel=1e-12)


@pytest.mark.parametrize("level", IS_LEVELS)
def test_the_ratio_and_its_band_equal_the_naive_reference(level):
    """importance_ratio (per token, or the row's product) and outside_is_band (the tokens of
    the mask whose ratio is outside [1/C, C]) against loops; padding is never outside."""
    learner, gen, mask = random_tokens(spread=0.6)
    w = importance_ratio(learner, gen, mask, level)
    outside = outside_is_band(w, mask, 1.5)
    _, keep = naive_weights(learner, gen, mask, "mis", 1.5, level)  # mis keeps what is inside
    for i, j in [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1])]:
        row = sum(float(learner[i, k] - gen[i, k]) for k in range(mask.shape[1]) if mask[i, k])
        want = math.exp(row if level == "sequence" else float(learner[i, j] - gen[i, j])) if mask[i, j] else 1.0
        assert float(w[i, j]) == pytest.approx(want, rel=1e-12)
        assert bool(outside[i, j]) == (bool(mask[i, j]) and not keep[i][j])
    assert 0 < int(outside.sum()) < int(mask.sum())  # the premise: some in, some out


def naive_dual_clip_loss(logprobs, old, adv, mask, eps, c, weights):
    total, n = 0.0, 0
    for i, j in mask.nonzero().tolist():
        r = math.exp(float(logprobs[i, j] - old[i, j]))
        a = float(adv[i, j])
        loss = max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))
        if c is not None and a < 0:
            loss = min(loss, -c * a)
        total += loss * (1.0 if weights is None else float(weights[i, j]))
        n += 1
    return total / n


@pytest.mark.parametrize("dual_clip", [None, 1.5])
@pytest.mark.parametrize("weighted", [False, True])
def test_ppo_clip_loss_with_dual_clip_and_weights_equals_the_naive_reference(dual_clip, weighted):
    g = torch.Generator().manual_seed(1)
    old, logprobs, mask = random_tokens(spread=0.8, seed=2)  # ratios far from 1: every branch is taken
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    weights = torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2 if weighted else None
    loss, stats = ppo_clip_loss(logprobs, old, adv, mask, 0.2, dual_clip=dual_clip, weights=weights)
    assert loss.item() == pytest.approx(naive_dual_clip_loss(logprobs, old, adv, mask, 0.2, dual_clip, weights),
                                        rel=1e-12)
    if dual_clip is None:
        assert stats.dual_clipfrac is None  # not reported when off
    else:
        assert 0 < stats.dual_clipfrac.item() < 1  # the bound was active on some tokens only


def test_weights_scale_each_tokens_gradient():
    """At ratio 1 the gradient w.r.t. a token's logprob is -w * A / N (REINFORCE, weighted)."""
    old, _, mask = random_tokens()
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    w = torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2
    logprobs = old.clone().requires_grad_(True)
    ppo_clip_loss(logprobs, old, adv, mask, 0.2, weights=w)[0].backward()
    want = torch.where(mask, -w * adv / mask.sum(), 0.0)
    torch.testing.assert_close(logprobs.grad, want, rtol=1e-12, atol=1e-15)


def test_the_config_takes_the_corrections_from_the_math():
    fields = {f.name: f for f in dataclasses.fields(config_module.PPOConfig)}
    assert fields["is_correction"].metadata["choices"] is IS_CORRECTIONS
    assert fields["is_level"].metadata["choices"] is IS_LEVELS


@pytest.mark.parametrize("changes, message", [
    (dict(is_correction="tis", old_logprobs="generator", top_k=0, top_p=1.0),
     r"'is_correction' = 'tis' is invalid: needs old_logprobs: learner"),
    (dict(is_correction="both"), r"'is_correction' = 'both' is invalid: must be one of \['none', 'tis', 'mis'\]"),
    (dict(is_level="batch"), r"'is_level' = 'batch' is invalid"),
    (dict(is_cap=1.0), r"'is_cap' = 1.0 is invalid: must be > 1"),
    (dict(dual_clip=1.0), r"'dual_clip' = 1.0 is invalid: must be >= 1 \+ clip_epsilon = 1.2 or null"),
    (dict(dual_clip=1.15), r"'dual_clip' = 1.15 is invalid: must be >= 1 \+ clip_epsilon = 1.2 or null"),
    (dict(dual_clip=1.25, clip_epsilon=0.3), r"'dual_clip' = 1.25 is invalid: must be >= 1 \+ clip_epsilon = 1.3"),
    (dict(dual_clip=math.inf), r"'dual_clip' = inf is invalid"),
    (dict(kl_in_loss=True, top_k=50), r"'kl_in_loss' = True is invalid: needs untruncated sampling"),
])
def test_bad_options_name_themselves(changes, message):
    with pytest.raises(ConfigError, match=message):
        PPOConfig(**changes)


def test_dual_clip_at_1_plus_clip_epsilon_bounds_no_token_inside_the_trust_region():
    """The smallest dual_clip the config takes, 1 + clip_epsilon: a token with A < 0 is bounded
    (no gradient) only once its ratio is past 1 + clip_epsilon, outside the trust region, where
    PPO-clip alone leaves its loss -A rho unbounded. At 1.1 (refused) tokens with ratios in
    (1.1, 1.2], inside the trust region, would lose their gradient too."""
    assert PPOConfig(dual_clip=1.2).dual_clip == 1.2 and PPOConfig(dual_clip=1.3, clip_epsilon=0.3).dual_clip == 1.3
    ratios = torch.tensor([1.05, 1.15, 1.19, 1.5, 3.0], dtype=torch.float64)
    logprobs = ratios.log().unsqueeze(0).requires_grad_(True)
    old, adv, mask = torch.zeros(1, 5, dtype=torch.float64), -torch.ones(1, 5, dtype=torch.float64), torch.ones(1, 5, dtype=torch.bool)
    for c, bounded in ((1.2, [False, False, False, True, True]), (1.1, [False, True, True, True, True])):
        logprobs.grad = None
        ppo_clip_loss(logprobs, old, adv, mask, 0.2, dual_clip=c)[0].backward()
        assert (logprobs.grad[0] == 0).tolist() == bounded, c


# ---------------------------------------------------------------------- the learner
def update(tiny_path, batch, ref, scores, **options):
    learner = with_sgd(Learner(make_config(**options), tiny_path))
    stats, weights = learner.update(batch, ref, scores)
    return stats, weights.tensors


@pytest.mark.parametrize("options", [dict(is_correction="tis"), dict(is_correction="mis"),
                                     dict(is_correction="tis", is_level="sequence"),
                                     dict(is_correction="mis", is_level="sequence")],
                         ids=["tis", "mis", "tis_seq", "mis_seq"])
def test_with_generator_equal_to_learner_every_correction_is_none_bit_for_bit(tiny_path, special, options):
    """gen_logprobs are the learner's own (rollout_inputs), so every ratio is exactly 1."""
    batch, ref, scores = rollout_inputs(Learner(make_config(), tiny_path), random_batch(special))
    base_stats, base_weights = update(tiny_path, batch, ref, scores)
    stats, weights = update(tiny_path, batch, ref, scores, **options)
    assert base_stats.mismatch_outside_frac == 0 and base_stats.mismatch_log_ratio_abs == 0
    timed = {"learner_forward_s", "update_s", "learner_peak_memory_gib", "learner_peak_flops_per_s",
             "is_weight_mean", "is_masked_frac", "is_outside_frac"}
    got = {k: v for k, v in stats.as_dict().items() if k not in timed}
    assert got == {k: v for k, v in base_stats.as_dict().items() if k not in timed}
    assert all(torch.equal(weights[k], base_weights[k]) for k in base_weights)
    assert stats.is_weight_mean == 1.0 if options["is_correction"] == "tis" else stats.is_masked_frac == 0.0
    assert stats.is_outside_frac == 0.0 and base_stats.is_outside_frac is None


def hand_grads(learner, exp, weights, kl_coef=0.0) -> dict:
    """The same gradient from the formula written out: sum over kept tokens of
    w * max(-A r, -A clip(r)) (+ beta * k3 to the reference) / their count."""
    cfg = learner.config
    learner.policy.zero_grad(set_to_none=True)
    mb = ExperienceBuffer(exp, len(exp), len(exp), TrimPlan.of(exp.rollouts)).micro_batch(list(range(len(exp))))
    logp, _, _ = learner.speed.train_stats(mb.rollouts, mb.seq_len, mb.response_tokens, mb.policy_mask, mb.mask,
                                           entropy=False)
    keep = mb.policy_mask
    t = logp.shape[1]
    r = torch.exp(torch.where(keep, logp - mb.old_logprobs, 0.0))
    a = mb.advantages
    per_token = torch.maximum(-a * r, -a * r.clamp(1 - cfg.clip_epsilon, 1 + cfg.clip_epsilon))
    per_token = per_token * weights[:, :t].float()
    log_ref_ratio = torch.where(keep, mb.ref_logprobs - logp, 0.0).clamp(-20, 20)  # verl's low_var_kl clamps
    per_token = per_token + kl_coef * (torch.exp(log_ref_ratio) - log_ref_ratio - 1).clamp(max=10)
    (torch.where(keep, per_token, 0.0).sum() / keep.sum()).backward()
    return {n: p.grad.clone() for n, p in learner.policy.named_parameters() if p.requires_grad}


def perturbed(batch, seed=5, spread=0.3):
    """The generator's logprobs off the learner's by ~spread nats (an injected mismatch)."""
    g = torch.Generator().manual_seed(seed)
    noise = spread * torch.randn(batch.gen_logprobs.shape, generator=g)
    return replace(batch, gen_logprobs=torch.where(batch.response_mask, batch.gen_logprobs + noise, 0.0))


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_with_an_injected_mismatch_the_gradient_is_the_importance_weighted_one(tiny_path, special, correction):
    learner = Learner(make_config(is_correction=correction, is_cap=1.2), tiny_path)
    batch, ref, scores = rollout_inputs(learner, random_batch(special))
    batch = perturbed(batch)
    kept = keep_experience(learner)
    stats = with_sgd(learner, lr=0.0).update(batch, ref, scores)[0]  # lr 0: the weights stay where they were
    exp = kept[-1]
    # the weights by hand, in float64 from the inputs: min(pi_learner / pi_generator, C), or
    # the tokens whose ratio is inside [1/C, C]
    ratio = torch.exp(exp.old_logprobs.double() - batch.gen_logprobs.double())
    real = batch.response_mask
    assert 0.5 < stats.mismatch_outside_frac < 1  # the injected mismatch is seen
    if correction == "tis":
        weights = torch.where(real, ratio.clamp(max=1.2), 0.0)
        assert stats.is_weight_mean == pytest.approx(weights[real].mean().item(), rel=1e-5)
        assert torch.equal(exp.policy_mask, real)
    else:
        inside = real & (ratio >= 1 / 1.2) & (ratio <= 1.2)
        assert 0 < int(inside.sum()) < int(real.sum())
        assert torch.equal(exp.policy_mask, inside)
        weights = inside.double()
    assert_grads_close(policy_grads(learner, exp), hand_grads(learner, exp, weights), int(real.sum()))
    # and the correction changed the gradient: the uncorrected one differs by far more than rounding
    plain = hand_grads(learner, replace(exp, policy_mask=real, is_weights=None), real.double())
    got = policy_grads(learner, exp)
    assert max((got[k] - plain[k]).abs().max().item() for k in got) > 100 * rounding_tol(
        max(g.abs().max().item() for g in plain.values()), grad_terms(int(real.sum())))


@pytest.mark.parametrize("options", [dict(is_correction="tis"), dict(is_correction="mis", is_level="sequence")],
                         ids=["tis", "mis_seq"])
def test_is_outside_frac_counts_the_tokens_outside_the_band(tiny_path, special, options):
    """The statistic the rollout check tests under a correction: with a bfloat16-like mismatch
    on every token and one token far off (tests/mismatch.py), the largest gap is the outlier's
    (1 nat, four times bfloat16's tolerance), the share outside [1/is_cap, is_cap] one
    token's. Per token also with is_level sequence (there MIS drops whole responses:
    is_masked_frac is larger)."""
    learner = Learner(make_config(**options), tiny_path)
    batch, ref, scores = rollout_inputs(learner, random_batch(special))
    stats = with_sgd(learner, lr=0.0).update(injected_mismatch(batch), ref, scores)[0]
    tokens = int(batch.response_mask.sum())
    # the outlier, computed from the learner's logprobs twice over (the same pass), and shifted: float32 rounding
    assert stats.gen_logprob_max_abs_diff == pytest.approx(OUTLIER, abs=logprob_tol(batch.gen_logprobs,
                                                                                  batch.response_mask))
    assert stats.is_outside_frac == pytest.approx(1 / tokens, rel=1e-6)
    if options["is_correction"] == "mis":
        assert stats.is_masked_frac > stats.is_outside_frac


def test_kl_in_loss_moves_the_kl_from_the_reward_to_the_loss(tiny_path, special):
    learner = Learner(make_config(kl_in_loss=True, kl_coef=0.3, mini_batch_size=8), tiny_path)  # one minibatch
    batch, ref, scores = rollout_inputs(learner, random_batch(special))
    kept = keep_experience(learner)
    stats = with_sgd(learner, lr=0.0).update(batch, ref, scores)[0]
    exp = kept[-1]
    assert stats.shaped_reward_mean == pytest.approx(stats.score_mean, rel=1e-6)  # no KL in the rewards
    assert stats.kl != 0 and stats.kl_loss > 0  # the rollouts' KL is still measured; k3 >= 0
    want_kl = kl_penalty(exp.old_logprobs, exp.ref_logprobs, "k3", mask=exp.policy_mask)
    assert stats.kl_loss == pytest.approx((want_kl.sum() / exp.policy_mask.sum()).item(), rel=1e-4)  # lr 0: each epoch the same
    ones = exp.policy_mask.double()
    assert_grads_close(policy_grads(learner, exp, 0.3), hand_grads(learner, exp, ones, 0.3),
                       int(exp.policy_mask.sum()))


def test_kl_in_loss_clamps_k3_so_one_token_cannot_dominate_the_step(tiny_path, special):
    """One token whose reference logprob is 25 nats above the policy's (pi_ref / pi = e^25):
    unclamped, its k3 of 7.2e10 would be the whole loss and its gradient. Clamped at 10 (verl's
    low_var_kl, OpenRLHF's k3) it adds 10 to the KL term's sum and nothing to the gradient: the
    gradient is the one with that token's reference equal to the policy (k3 = 0, whose
    gradient is 0 too), within rounding."""
    learner = Learner(make_config(kl_in_loss=True, kl_coef=0.3, mini_batch_size=8), tiny_path)
    batch, ref, scores = rollout_inputs(learner, random_batch(special))
    kept = keep_experience(learner)
    with_sgd(learner, lr=0.0).update(batch, ref, scores)
    exp = kept[-1]
    assert exp.policy_mask[0, 0]
    far_ref, near_ref = exp.ref_logprobs.clone(), exp.ref_logprobs.clone()
    far_ref[0, 0] = exp.old_logprobs[0, 0] + 25.0
    near_ref[0, 0] = exp.old_logprobs[0, 0]
    buffer = ExperienceBuffer(replace(exp, ref_logprobs=far_ref), len(exp), len(exp), TrimPlan.of(exp.rollouts))
    norm = exp.policy_mask.sum().float()
    learner.policy.zero_grad(set_to_none=True)
    learner.policy.train()
    loss, _, st = learner.optimiser.micro_backward(buffer.micro_batch(list(range(len(exp)))), norm, norm, 0.3)
    far = {n: p.grad.clone() for n, p in learner.policy.named_parameters() if p.requires_grad}
    others = kl_penalty(exp.old_logprobs, exp.ref_logprobs, "k3", mask=exp.policy_mask)
    others[0, 0] = 0.0
    assert st["kl_loss"].item() == pytest.approx((others.sum().item() + 10.0) / norm.item(), rel=1e-4)
    assert math.isfinite(loss.item()) and loss.item() < 10.0
    near = policy_grads(learner, replace(exp, ref_logprobs=near_ref), 0.3)
    assert_grads_close(far, near, int(exp.policy_mask.sum()))
    assert_grads_close(far, hand_grads(learner, replace(exp, ref_logprobs=far_ref), exp.policy_mask.double(), 0.3),
                       int(exp.policy_mask.sum()))


def test_dual_clip_bounds_the_loss_in_the_learner(tiny_path, special):
    """Rollouts whose old logprobs are far below the policy's (ratios >> 1) with negative
    advantages: dual_clip bounds those tokens, and the stat counts them."""
    learner = Learner(make_config(dual_clip=2.0, whiten_advantages=False), tiny_path)
    batch, ref, _ = rollout_inputs(learner, random_batch(special))
    scores = -torch.ones(len(batch)) * 5  # every advantage negative
    kept = keep_experience(learner)
    with_sgd(learner, lr=0.0).update(batch, ref, scores)
    exp = replace(kept[-1], old_logprobs=torch.where(kept[-1].policy_mask, kept[-1].old_logprobs - 2.0, 0.0))
    buffer = ExperienceBuffer(exp, len(exp), len(exp), TrimPlan.of(exp.rollouts))
    norm = exp.policy_mask.sum().float()
    learner.policy.train()
    _, _, st = learner.optimiser.micro_backward(buffer.micro_batch(list(range(len(exp)))), norm, norm)
    assert st["loss"].dual_clipfrac.item() > 0.5
