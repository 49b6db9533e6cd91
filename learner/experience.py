"""The experience of one PPO step (the seeds' steps 3, 5 and 7-9), from the learner's no-grad pass.

Given the rollouts, the learner's scores of them (`RolloutScores`: step 2's old logprobs,
full-softmax logprobs and entropy, and with a critic step 6's values), the reference
logprobs and the sequence scores (step 4), `make_experience` computes, numbered as the
seeds' eleven steps:

3. the per-token KL to the reference, KL_t (k1 = logp - logp_ref by default);
5. the shaped rewards: the score on the last real token, -beta * KL_t on every token, and
   optionally their whitening (scale only, N+; off by default);
7-9. the advantages from the configured estimator (learner.algos' registry: GAE by default,
   TD errors then GAE over the shaped rewards; a group estimator's statistics are of the
   scores, with the KL added per token afterwards) and, with a critic, the returns
   G_t = A_t + V_t; optionally the advantages' whitening over the step's real tokens;

the generator/learner mismatch of the sampled tokens and, with is_correction, its
off-policy correction (learner.algos.importance_weights: TIS weights, or MIS's smaller
policy mask; the share of tokens outside its band, is_outside_frac, which the trainer's
rollout check tests under a correction); and the rollouts' statistics (0-dim tensors: the
learner reads them back in its one host sync). The optimisation (steps 10-11) is the
learner's (learner.optimise).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from learner.algos import (AdvantageEstimator, AdvantageInputs, compute_returns, explained_variance,
                           importance_ratio, importance_weights, kl_penalty, masked_mean, masked_whiten, mismatch_stats,
                           outside_is_band, shape_rewards)
from learner.buffer import Experience
from ppo_ray.batch import Packing, RolloutBatch


# (rows, their (b, t) old values) -> their (b, t) returns: make_experience's gift to a value_pass
ReturnsOf = Callable[[list[int], Tensor], Tensor]


@dataclass
class RolloutScores:
    """The learner's no-grad view of a batch (steps 2 and 6); fields not asked for are None."""

    logprobs: Optional[Tensor]       # (B, T) float32 truncated + tempered (the sampling distribution)
    full_logprobs: Optional[Tensor]  # (B, T) float32 full softmax at temperature (for the KL)
    entropy: Optional[Tensor]        # (B, T) float32 entropy of softmax(logits / temperature)
    values: Optional[Tensor]         # (B, T) float32 V(s_t); None without a critic


def estimate(estimator: AdvantageEstimator, inputs: AdvantageInputs, params: dict,
             packing: Optional[Packing]) -> Tensor:
    """The estimator's (B, T) advantages; with `packing` (a multi-turn batch: environment
    tokens between the model's turns) computed over each row's model tokens packed into one
    contiguous response (ppo_ray.batch.Packing), then put back in their columns, 0 on the
    environment's: GAE's recursion and the TD errors' next value skip the environment's
    turns, as the transition from one model token to the next includes them."""
    if packing is None:
        return estimator.fn(inputs, **params)
    pack = lambda x: None if x is None else packing.pack(x)  # noqa: E731
    packed = dataclasses.replace(inputs, rewards=pack(inputs.rewards), mask=packing.mask,
                                 values=pack(inputs.values), kl=pack(inputs.kl))
    return packing.unpack(estimator.fn(packed, **params))


def score_tensors(scores: RolloutScores) -> list[Optional[Tensor]]:
    """The fields in order, as the tensors themselves (dataclasses.astuple would copy them)."""
    return [getattr(scores, f.name) for f in dataclasses.fields(scores)]


@torch.no_grad()
def make_experience(batch: RolloutBatch, fwd: RolloutScores, ref_logprobs: Tensor, scores: Tensor, *, config,
                    kl_coef: float, estimator: AdvantageEstimator, stale: int, recomputed: bool,
                    rows_kept: Tensor, value_pass: Optional[Callable[[ReturnsOf], Tensor]] = None,
                    gap_limit: float = math.inf) -> tuple[Experience, dict[str, Tensor]]:
    """Steps 3, 5 and 7-9 on one device (batch, fwd, ref_logprobs (B, T) and scores (B,) all on it).

    Args:
        config: the learner's config (kl_estimator, reward_shaping, whiten_rewards,
            whiten_advantages, gamma, lam, and the estimator's own parameters).
        kl_coef: this step's beta.
        estimator: the advantage estimator; with ``needs_critic`` fwd.values are the critic's.
        stale: how many versions behind the learner the rollouts are (max_staleness). The PPO
            ratio's denominator is then the behaviour policy that sampled them (the generator's
            logprobs, same temperature and truncation): PPO's trust region is around what was
            sampled. With is_correction it is instead the learner's own logprobs at the update's
            start (the proximal policy, decoupled PPO: Hilton et al. 2021, AReaL), and the
            correction's weights (tis) or mask (mis) are pi_proximal / pi_behaviour, so the
            trust region is around the current policy and the staleness is importance-weighted.
        recomputed: whether fwd's logprobs are the learner's own (else the generator's).
        rows_kept: (B,) bool, the rows whose score was finite.
        value_pass: with a critic and no fwd.values (old_values: update), what gives the old
            values once the rewards are shaped: called with `returns_of(rows, old_values)`
            (those rows' (b, t) returns from their (b, t) old values; the estimator is
            per_row), it trains the value model on them and returns the (B, T) old values.

    Returns:
        (the Experience, the rollouts' statistics by LearnerStats field name).
    """
    mask = batch.loss_mask  # (B, T) bool: the model's tokens (a multi-turn batch's environment tokens are context)
    packing = None if batch.env_mask is None else Packing.of(mask)
    zero = torch.zeros((), device=mask.device)
    decoupled = bool(stale) and config.is_correction != "none" and recomputed  # proximal = the learner's own
    behaviour = batch.gen_logprobs.float() if stale and not decoupled else fwd.logprobs
    finite_old = torch.isfinite(behaviour)
    policy_mask = mask & finite_old  # tokens with a defined PPO ratio
    old_logprobs = torch.where(policy_mask, behaviour, zero)
    if recomputed:
        behaviour_gap = masked_mean((fwd.logprobs - behaviour).abs(), policy_mask & torch.isfinite(fwd.logprobs))
    else:  # the behaviour policy's logprobs are all there is: 0 by definition, unknown if stale
        behaviour_gap = torch.full((), math.nan if stale else 0.0, device=mask.device)
    values = fwd.values  # None without a critic
    # 3. KL_t between policy and reference (k1 = logp - logp_ref by default).
    kl = kl_penalty(fwd.full_logprobs, ref_logprobs, config.kl_estimator, mask=mask)  # (B, T)
    # 5. Shaped rewards: score on the last real token, -beta * KL_t on every token (kl_in_loss:
    #    the scores alone; the KL is then a term of the policy loss, learner.optimise).
    reward_kl_coef = 0.0 if config.kl_in_loss else kl_coef  # beta of the KL in the reward
    rewards = shape_rewards(scores, kl, mask, reward_kl_coef, config.reward_shaping)  # (B, T)
    reward_sums = rewards.sum(dim=1)  # (B,) before any whitening, for the stats
    # 5 (option). Reward whitening (scale only, N+; off by default).
    if config.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    # 7-9. Advantages (raw) from the estimator (GAE: TD errors -> GAE), and with a critic
    #    its targets, the returns G_t = A_t + V_t.
    #    A group estimator (needs_groups) reads the batch's group ids, the scores for its
    #    group statistics and KL_t at reward_kl_coef for the per-token KL it adds afterwards,
    #    not the shaped rewards (learner.algos, "group baselines").
    params = {p.name: getattr(config, p.name) for p in estimator.params}  # its own knobs (learner.algos.Param)
    if estimator.needs_critic and values is None:  # old_values: update
        if value_pass is None or not estimator.per_row:
            why = ("no value_pass was given" if value_pass is None else
                   f"estimator {estimator.name!r} is not per_row (its returns need every row's values)")
            raise ValueError(f"make_experience: the critic's old values are missing (fwd.values is None) and {why}")

        def returns_of(rows: list[int], old_values: Tensor) -> Tensor:
            t = old_values.shape[1]
            m = mask[rows, :t]
            a = estimate(estimator, AdvantageInputs(rewards=rewards[rows, :t], mask=m, scores=scores[rows],
                                                    values=old_values, gamma=config.gamma, lam=config.lam,
                                                    kl=kl[rows, :t], kl_coef=reward_kl_coef),
                         params, None if packing is None else Packing.of(m))
            return compute_returns(a, old_values, m)

        values = value_pass(returns_of)
    if estimator.needs_groups and batch.groups is None:
        raise ValueError(f"advantage_estimator {estimator.name!r} needs the rollouts' group ids "
                         "(RolloutBatch.groups, set by the generator); this batch has none")
    advantages = estimate(estimator, AdvantageInputs(rewards=rewards, mask=mask, scores=scores, values=values,
                                                     gamma=config.gamma, lam=config.lam, groups=batch.groups,
                                                     kl=kl, kl_coef=reward_kl_coef), params, packing)
    returns = compute_returns(advantages, values, mask) if estimator.needs_critic else None
    raw_advantage_mean = masked_mean(advantages, mask)
    # 8 (option). Advantage whitening over the step's real tokens (not for an estimator whose
    #    advantages are on its method's own scale: GRPO, RLOO, REINFORCE++).
    if config.whiten_advantages and not estimator.normalized:
        advantages = masked_whiten(advantages, mask)

    # The generator vs the learner on the same version's sampled tokens: the mismatch, and
    # (is_correction) the off-policy correction's weights or its mask: for stale rollouts
    # (decoupled) against the behaviour policy, which also absorbs the mismatch. The mismatch is
    # not measured (NaN) for stale rollouts (the current policy is not the one that sampled;
    # behaviour_logprob_gap measures that distance) or when nothing was recomputed to compare
    # with (config refuses is_correction there).
    gen = torch.where(policy_mask, batch.gen_logprobs.float(), zero)  # (B, T) the sampler's, 0 off the policy's tokens
    gen_diff = torch.where(policy_mask, (gen - fwd.logprobs).abs(), zero)
    mismatch = mismatch_stats(old_logprobs, gen, policy_mask)
    if stale or not recomputed:
        gen_diff = torch.full((), math.nan, device=mask.device)
        mismatch = {k: gen_diff for k in mismatch}
    is_weights, policy_mask_is = importance_weights(old_logprobs, gen, policy_mask, config.is_correction,
                                                    config.is_cap, config.is_level)
    loss_mask = policy_mask_is  # the policy loss's tokens
    if config.overlong_filter:  # DAPO's overlong filtering: responses cut without EOS leave the policy loss
        loss_mask = policy_mask_is & batch.has_eos.unsqueeze(1)
    experience = Experience(
        rollouts=batch, mask=mask, policy_mask=loss_mask, scores=scores, old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs, kl=kl, rewards=rewards, values=values, advantages=advantages, returns=returns,
        is_weights=is_weights)
    stats = {
        "entropy": masked_mean(fwd.entropy, mask),
        "kl": masked_mean(kl.sum(dim=1), rows_kept),
        "kl_per_token": masked_mean(kl, mask),
        "score_mean": masked_mean(scores, rows_kept),
        "shaped_reward_mean": masked_mean(reward_sums, rows_kept),
        "advantage_mean": raw_advantage_mean,
        "gen_logprob_max_abs_diff": gen_diff.amax(),
        "gen_logprob_gap_tokens": (gen_diff > gap_limit).sum().float() if gen_diff.dim() else gen_diff,
        "truncated_tokens": (mask & ~finite_old).sum(),
        "behaviour_logprob_gap": behaviour_gap,
        **mismatch,
    }
    if config.overlong_filter:
        stats["overlong_filtered"] = masked_mean((~batch.has_eos).float(), mask.any(dim=1))
    if config.is_correction == "tis":
        stats["is_weight_mean"] = masked_mean(is_weights, policy_mask)
    elif config.is_correction == "mis":
        stats["is_masked_frac"] = masked_mean((policy_mask & ~policy_mask_is).float(), policy_mask)
    if config.is_correction != "none":
        # The share of the policy loss's tokens whose ratio is outside [1/is_cap, is_cap]: what the
        # correction drops, caps or all but drops. The trainer's rollout check tests it instead of
        # the largest gap of one token (ppo_ray.driver.sync_guard.rollout_gap). Per token whatever
        # is_level: a response's ratio drifts with its length even when each token is close.
        w = importance_ratio(old_logprobs, gen, policy_mask, "token")  # (B, T)
        stats["is_outside_frac"] = masked_mean(outside_is_band(w, policy_mask, config.is_cap).float(), policy_mask)
    if estimator.needs_critic:
        stats.update(explained_variance=explained_variance(values, returns, mask),
                     return_mean=masked_mean(returns, mask), value_mean=masked_mean(values, mask))
    return experience, stats
