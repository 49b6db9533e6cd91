"""Policy losses as pure tensor functions: one registry, the PPO clip the default.

The conventions are learner.algos' (shapes ``(B, T)`` per token, a bool ``mask`` with True =
real token, masked entries never matter, no host reads, no config object: plain numbers).

A policy loss is one function and its registration::

    @register_policy_loss("name", params=(Param("name_knob", float, 0.1, "what it does"),))
    def name_loss(inputs: LossInputs, *, name_knob: float) -> tuple[Tensor, PolicyLossStats]:
        ...  # (B, T) per-token loss (to minimise) and its statistics

The config's ``policy_loss`` selects it by name; each of its ``params`` becomes a config field
(CLI option, YAML key, --help and docs/CONFIG.md row, the learner's slice) whose value the
learner passes as the keyword of that name. A loss also declares the knobs it shares with other
losses and reads (``reads``: ``clip_epsilon``, which ``LossInputs`` carries to every loss, is
ppo_clip's): while it is selected, the config refuses every other loss's knob and param set away
from its default (ppo_ray.config.ignored_knobs), instead of ignoring it. What every loss shares is composed with it in one
place, :func:`policy_objective`: the off-policy correction's per-token weights (``is_correction``:
TIS weights, or MIS's smaller mask, already in ``inputs.mask``), the aggregation (``loss_agg``),
the KL-to-reference term (``kl_in_loss``) and the entropy bonus (``entropy_coef``).

A loss's statistics are its own dataclass (a subclass of :class:`PolicyLossStats`): every field
a 0-dim tensor, the mean over the call's ``inputs.mask`` tokens (the optimiser weighs each call
by its token count and reports the step's means under the fields' names), or None where an
option is off (left out of the step's statistics).

References: [PPO] Schulman et al. 2017, eq. 7; [DualClip] Ye et al. 2020, eq. 5; [GSPO] Zheng et
al. 2025, "Group Sequence Policy Optimization", eqs. 5-7; [DAPO] Yu et al. 2025, "DAPO: An
Open-Source LLM Reinforcement Learning System at Scale", eq. 10 (clip-higher); [CISPO] MiniMax
2025, "MiniMax-M1", eqs. 4-5; [CleanRL] ppo.py (approx_kl, clipfrac).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from learner.algos import Param, agg_loss, check_mask, kl_penalty, masked_mean

Tensor = torch.Tensor


@dataclass(frozen=True)
class LossInputs:
    """What a policy loss may read: one micro-batch's tensors, all on one device."""

    logprobs: Tensor      # (B, T) the current policy's logprobs of the sampled tokens, with grad; -inf = outside support
    old_logprobs: Tensor  # (B, T) the rollout policy's (the ratio's denominator), finite on mask
    advantages: Tensor    # (B, T) float32 (usually whitened)
    mask: Tensor          # (B, T) bool: the tokens of the policy loss
    clip_epsilon: float   # the trust region's eps (config clip_epsilon)


@dataclass(frozen=True)
class PolicyLossStats:
    """What every policy loss reports, each a mean over the call's tokens (0-dim tensors):
    approx_kl, the k3 estimate of KL(old || new) over the tokens still in support ([CleanRL]);
    clipfrac, the tokens whose clipped term is the active one; ratio_mean, of the ratio the loss
    clips; outside_support_frac, the tokens whose new logprob is -inf (dropped by top-k / top-p
    truncation after an update)."""

    approx_kl: Tensor
    clipfrac: Tensor
    ratio_mean: Tensor
    outside_support_frac: Tensor

    def items(self) -> list[tuple[str, Tensor]]:
        """(name, value) of the fields that are set, in order."""
        return [(f.name, v) for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None]


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss: ``fn(inputs, **params) -> ((B, T) loss, stats)``."""

    name: str
    fn: Callable[..., tuple[Tensor, PolicyLossStats]]
    params: tuple[Param, ...]
    stats: type  # a PolicyLossStats subclass: what fn returns
    reads: tuple[str, ...] = ()  # the shared knobs (config fields) it reads, e.g. clip_epsilon (inputs.clip_epsilon)


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, *, params: Sequence[Param] = (), stats: type = PolicyLossStats,
                         reads: Sequence[str] = ()) -> Callable:
    """Decorator: register ``fn(inputs: LossInputs, **params) -> (loss (B, T), stats)`` as the
    policy loss ``name`` (the config's ``policy_loss``). ``params``: its own knobs (each a config
    field, passed to fn as a keyword); ``stats``: the dataclass fn returns (PolicyLossStats or a
    subclass); ``reads``: the knobs shared with other losses that fn reads (``clip_epsilon``, from
    ``inputs``). The per-token loss is what one token contributes before the off-policy weights and
    the aggregation (:func:`policy_objective` applies both). A name is registered once."""
    if not (isinstance(stats, type) and issubclass(stats, PolicyLossStats)):
        raise TypeError(f"policy loss {name!r}: stats must be a PolicyLossStats subclass, got {stats!r}")

    def register(fn: Callable[..., tuple[Tensor, PolicyLossStats]]) -> Callable:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered ({POLICY_LOSSES[name].fn.__qualname__})")
        POLICY_LOSSES[name] = PolicyLoss(name, fn, tuple(params), stats, tuple(reads))
        return fn
    return register


def policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``; a ValueError naming the registered ones."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"policy_loss: unknown loss {name!r}; registered: {sorted(POLICY_LOSSES)} "
                         "(learner/losses.py, register_policy_loss)") from None


def policy_objective(loss: PolicyLoss, inputs: LossInputs, params: dict, *, loss_agg: str,
                     normalizer: float | Tensor | None = None, norm_tokens: Optional[int] = None,
                     is_weights: Optional[Tensor] = None,
                     kl_coef: float = 0.0, ref_logprobs: Optional[Tensor] = None,
                     entropy: Optional[Tensor] = None, entropy_coef: float = 0.0,
                     entropy_mask: Optional[Tensor] = None, entropy_normalizer: float | Tensor | None = None,
                     ) -> tuple[Tensor, PolicyLossStats, Optional[Tensor]]:
    """The policy's objective (to minimise) from any registered loss, the one place the shared
    terms compose with it:

        L = agg(w * loss(inputs)) + kl_coef * agg(k3(pi || pi_ref)) - entropy_coef * agg_e(H)

    * ``loss.fn(inputs, **params)``: the registered loss's ``(B, T)`` per-token loss and stats;
    * ``w`` = ``is_weights`` (``(B, T)``, no grad: TIS's truncated importance weights; None = 1;
      MIS instead leaves the dropped tokens out of ``inputs.mask``);
    * ``agg`` = :func:`learner.algos.agg_loss` over ``inputs.mask`` with ``loss_agg`` and
      ``normalizer`` (a minibatch's token or row count, for gradient accumulation), or
      ``norm_tokens`` (token_sum_norm's constant per row, without a normalizer);
    * the KL term (``ref_logprobs`` given: ``kl_in_loss``) is GRPO's k3 estimate of
      KL(policy || reference) with gradient through the policy's logprobs, clamped as
      :func:`learner.algos.kl_penalty` k3 is, aggregated like the loss;
    * the entropy bonus (``entropy`` given: ``(B, T)`` per-token entropy with grad) over
      ``entropy_mask`` (all real tokens) with ``entropy_normalizer``.

    Returns ``(L, the loss's stats, the KL term before kl_coef (detached) or None)``.
    """
    loss_mat, stats = loss.fn(inputs, **params)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.to(loss_mat.dtype)
    total = agg_loss(loss_mat, inputs.mask, loss_agg, normalizer, norm_tokens)
    kl_loss = None
    if ref_logprobs is not None:
        kl_loss = agg_loss(kl_penalty(inputs.logprobs, ref_logprobs, "k3", mask=inputs.mask), inputs.mask,
                           loss_agg, normalizer, norm_tokens)
        total = total + kl_coef * kl_loss
        kl_loss = kl_loss.detach()
    if entropy is not None:
        total = total - entropy_coef * agg_loss(entropy, entropy_mask, loss_agg, entropy_normalizer, norm_tokens)
    return total, stats, kl_loss


def _ratio_stats(logratio: Tensor, ratio: Tensor, clipped: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """PolicyLossStats' fields (no grad) from the per-token log ratio log(pi / pi_old) (approx_kl,
    outside_support_frac), the ratio the loss clips (ratio_mean) and where its clipped term is
    active (clipfrac). With top-k / top-p truncation the updated policy can drop a
    sampled token from its support (logprob -inf, ratio 0): the loss and its gradient stay finite,
    but k3 would be +inf there, so approx_kl is over the tokens still in support and the dropped
    ones are counted in outside_support_frac."""
    with torch.no_grad():
        logratio, ratio = logratio.detach(), ratio.detach()
        finite = torch.isfinite(logratio)
        return {"approx_kl": masked_mean((torch.exp(logratio) - 1) - logratio, mask & finite),
                "clipfrac": masked_mean(clipped.to(ratio.dtype), mask),
                "ratio_mean": masked_mean(ratio, mask),
                "outside_support_frac": masked_mean((~finite).to(ratio.dtype), mask)}


# --------------------------------------------------------------------------------------
# the PPO clip (the default), with dual clip as its parameter
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClipStats(PolicyLossStats):
    """PolicyLossStats and dual_clipfrac: the tokens whose loss dual_clip's bound replaced (None
    when dual_clip is off)."""

    dual_clipfrac: Optional[Tensor] = None


def _dual_clip_check(c: Optional[float], *, clip_epsilon: float, clip_epsilon_high: Optional[float]) -> Optional[str]:
    # Where A < 0 the bound -c * A replaces the PPO-clip loss -A * rho once rho > c: below
    # 1 + the upper clip it would cut the gradient of tokens inside the trust region.
    high, name = (clip_epsilon, "clip_epsilon") if clip_epsilon_high is None else (clip_epsilon_high, "clip_epsilon_high")
    if c is None or (math.isfinite(c) and c >= 1 + high):
        return None
    return (f"must be >= 1 + {name} = {1 + high:g} or null (null = off): a token with a negative "
            f"advantage and a ratio in (dual_clip, 1 + {name}], inside the trust region, would lose its "
            "gradient")


def _clip_high_check(eps_high: Optional[float]) -> Optional[str]:
    return None if eps_high is None or (math.isfinite(eps_high) and eps_high > 0) else "must be > 0 or null"


@register_policy_loss("ppo_clip", stats=ClipStats, reads=("clip_epsilon",), params=(
    Param("clip_epsilon_high", Optional[float], None,
          "ppo_clip only: the upper clip, so the ratio is clipped to [1 - clip_epsilon, 1 + clip_epsilon_high] "
          "(DAPO's clip-higher: 0.2 and 0.28). None = clip_epsilon, the symmetric clip (docs/ALGORITHMS.md, "
          "\"Policy losses\").", check=_clip_high_check),
    Param("dual_clip", Optional[float], None,
          "ppo_clip only: dual-clip PPO's c, which bounds each token's policy loss by -c * A where the advantage A "
          "is negative; c >= 1 + the upper clip. None = off, plain PPO-clip (docs/ALGORITHMS.md, \"Policy "
          "losses\").", check=_dual_clip_check),))
def ppo_clip(inputs: LossInputs, *, dual_clip: Optional[float] = None,
             clip_epsilon_high: Optional[float] = None) -> tuple[Tensor, ClipStats]:
    """PPO's clipped surrogate ([PPO] eq. 7) per token, to minimise:
    ``max(-A * rho, -A * clip(rho, 1 - eps, 1 + eps_high))`` with ``rho = exp(logp - logp_old)``
    ([N+], [TRL]); ``eps_high`` = clip_epsilon_high, or eps when None ([DAPO] eq. 10, clip-higher;
    verl's compute_policy_loss_vanilla in verl/trainer/ppo/core_algos.py clips the same way with
    clip_ratio_low / clip_ratio_high). At ``rho = 1`` its gradient w.r.t. ``logp`` is ``-A`` per
    token (REINFORCE).

    dual_clip: c >= 1 + eps, or None. Dual-clip PPO ([DualClip] eq. 5): where ``A < 0`` the
    loss is also bounded by ``-c * A``, so a token whose ratio has grown far above 1 (the new
    policy likes a bad action much more than the one that sampled it, e.g. off-policy data)
    cannot contribute an unbounded loss: ``min(max(-A*rho, -A*clip(rho)), -c*A)`` for A < 0.
    """
    mask = check_mask(inputs.mask)
    logprobs, eps = inputs.logprobs, inputs.clip_epsilon
    eps_high = eps if clip_epsilon_high is None else clip_epsilon_high
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logratio = torch.where(mask, logprobs - inputs.old_logprobs, zero)
    ratio = torch.exp(logratio)
    adv = torch.where(mask, inputs.advantages.to(logprobs.dtype), zero)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps, 1.0 + eps_high)
    loss_mat = torch.maximum(unclipped, clipped)
    dual_active = None
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual_active = (adv < 0) & (bound < loss_mat)
        loss_mat = torch.where(dual_active, bound, loss_mat)
    stats = ClipStats(**_ratio_stats(logratio, ratio, clipped > unclipped, mask),
                      dual_clipfrac=None if dual_active is None else masked_mean(dual_active.to(ratio.dtype), mask))
    return loss_mat, stats


def ppo_clip_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_epsilon: float,
                  loss_agg: str = "token_mean", normalizer: float | Tensor | None = None,
                  dual_clip: Optional[float] = None, weights: Optional[Tensor] = None) -> tuple[Tensor, ClipStats]:
    """The PPO clip's objective alone (:func:`policy_objective` with ``ppo_clip``, the TIS
    ``weights`` and no KL or entropy term): ``(loss, stats)``, loss a 0-dim tensor."""
    loss, stats, _ = policy_objective(POLICY_LOSSES["ppo_clip"],
                                      LossInputs(logprobs, old_logprobs, advantages, mask, clip_epsilon),
                                      {"dual_clip": dual_clip}, loss_agg=loss_agg, normalizer=normalizer,
                                      is_weights=weights)
    return loss, stats


# --------------------------------------------------------------------------------------
# GSPO: the sequence's ratio
# --------------------------------------------------------------------------------------

GSPO_LOG_RATIO_MAX = 10.0  # a sequence's log ratio is clamped to at most this before exp (verl clamps it too)


def _gspo_clip_check(eps: float) -> Optional[str]:
    return None if math.isfinite(eps) and 0 < eps < 1 else "must be in (0, 1)"


def _gspo_clip_high_check(eps: Optional[float]) -> Optional[str]:
    return None if eps is None or (math.isfinite(eps) and eps > 0) else "must be > 0 or null"


# The defaults stay the symmetric 4e-4 of before the upper bound had its own knob: every saved
# config records gspo_clip_epsilon: 0.0004, and a new default would turn that record into a
# knob set away from its default, which the config refuses for the other losses.
@register_policy_loss("gspo", params=(
    Param("gspo_clip_epsilon", float, 4e-4,
          "gspo only: GSPO's sequence ratio (the geometric mean of the response's token ratios) is clipped to "
          "[1 - gspo_clip_epsilon, 1 + gspo_clip_epsilon_high]; it moves far less than a token's ratio, so this is "
          "far smaller than clip_epsilon (docs/ALGORITHMS.md, \"Policy losses\").", check=_gspo_clip_check),
    Param("gspo_clip_epsilon_high", Optional[float], None,
          "gspo only: the upper bound of the sequence ratio's clip, 1 + this (the paper's 4e-4, with "
          "gspo_clip_epsilon 3e-4 below); None = gspo_clip_epsilon (the symmetric clip).",
          check=_gspo_clip_high_check),))
def gspo(inputs: LossInputs, *, gspo_clip_epsilon: float = 4e-4,
         gspo_clip_epsilon_high: Optional[float] = None) -> tuple[Tensor, PolicyLossStats]:
    """GSPO ([GSPO] eqs. 5-7, "GSPO-token"): one importance ratio per response, the geometric mean
    of its tokens' ratios, ``s_i = exp(mean_t log(pi(y_t) / pi_old(y_t)))`` over the row's tokens
    of ``inputs.mask``, clipped as PPO clips a token's: per token ``max(-A_t * s_it, -A_t *
    clip(s_it, 1 - eps, 1 + eps_high))`` with ``eps`` = gspo_clip_epsilon, ``eps_high`` =
    gspo_clip_epsilon_high (eps when None; the paper's bounds are 3e-4 and 4e-4, its eq. 5's
    "left and right clipping ranges") and ``s_it = sg(s_i) * pi(y_t) / sg(pi(y_t))``, whose value
    is ``s_i`` and whose gradient is ``s_i * grad log pi(y_t)``. With one advantage per response
    (the paper's, GRPO's) that is exactly the gradient of ``-A_i * s_i`` summed over the row's
    tokens; with per-token advantages (GAE) each token keeps its own ``A_t``. A whole response is
    clipped or not: clipfrac is the share of tokens in clipped responses, ratio_mean the tokens'
    mean of their response's ``s_i``. A token outside the support (logprob -inf after an update
    under top-k / top-p) takes no part in its response's mean and gets no gradient. ``log s_i``
    is clamped to at most GSPO_LOG_RATIO_MAX (a response whose probability grew e^10-fold per
    token), so the ratio stays finite.
    """
    mask = check_mask(inputs.mask)
    logprobs = inputs.logprobs
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    live = mask & torch.isfinite(logprobs)
    logratio = torch.where(mask, logprobs - inputs.old_logprobs, zero)  # (B, T), -inf outside the support
    live_logratio = torch.where(live, logratio, zero)
    seq_logratio = live_logratio.sum(dim=-1, keepdim=True) / live.sum(dim=-1, keepdim=True).clamp(min=1)  # (B, 1)
    live_logp = torch.where(live, logprobs, zero)
    log_s = (seq_logratio.detach() + live_logp - live_logp.detach()).clamp(max=GSPO_LOG_RATIO_MAX)  # (B, T)
    s = torch.exp(log_s)
    adv = torch.where(mask, inputs.advantages.to(logprobs.dtype), zero)
    unclipped = -adv * s
    eps_high = gspo_clip_epsilon if gspo_clip_epsilon_high is None else gspo_clip_epsilon_high
    clipped = -adv * torch.clamp(s, 1.0 - gspo_clip_epsilon, 1.0 + eps_high)
    loss_mat = torch.maximum(unclipped, clipped)
    return loss_mat, PolicyLossStats(**_ratio_stats(logratio, s, clipped > unclipped, mask))


# --------------------------------------------------------------------------------------
# CISPO: the clipped importance weight, out of the gradient
# --------------------------------------------------------------------------------------


def _cispo_low_check(eps: Optional[float]) -> Optional[str]:
    return None if eps is None or (math.isfinite(eps) and 0 <= eps <= 1) else "must be in [0, 1] or null"


def _cispo_high_check(eps: float) -> Optional[str]:
    return None if math.isfinite(eps) and eps > 0 else "must be > 0"


@register_policy_loss("cispo", params=(
    Param("cispo_epsilon_high", float, 5.0,
          "cispo only: the importance weight's upper bound is 1 + this (MiniMax-M1's eps_high; SkyRL's "
          "cispo_eps_clip_high, default 5). A token whose ratio is above it keeps its gradient, at weight 1 + "
          "this.", check=_cispo_high_check),
    Param("cispo_epsilon_low", Optional[float], None,
          "cispo only: the weight's lower bound is 1 - this; None = no lower bound (MiniMax-M1 sets eps_low large, "
          "so it never binds).", check=_cispo_low_check),))
def cispo(inputs: LossInputs, *, cispo_epsilon_high: float = 5.0,
          cispo_epsilon_low: Optional[float] = None) -> tuple[Tensor, PolicyLossStats]:
    """CISPO ([CISPO] eqs. 4-5) per token, to minimise: ``-sg(clip(rho, 1 - eps_low, 1 + eps_high)) *
    A * logp``, REINFORCE weighted by the clipped importance ratio ``rho = exp(logp - logp_old)``
    under a stop-gradient. Unlike PPO's clip, no token loses its gradient: a clipped one keeps
    ``-w * A`` at the bound's weight ``w`` (SkyRL's compute_policy_loss_cispo in
    skyrl_train/utils/ppo_utils.py and verl's in verl/trainer/ppo/core_algos.py compute the
    same). At ``rho = 1`` the gradient is ``-A`` per token, as PPO's. The loss's value carries
    ``logp`` and so is not comparable with PPO's. A token outside the support (logprob -inf
    after an update under top-k / top-p) contributes 0 and no gradient. clipfrac counts the
    tokens whose weight was clipped, ratio_mean the unclipped ratio's mean.
    """
    mask = check_mask(inputs.mask)
    logprobs = inputs.logprobs
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    live = mask & torch.isfinite(logprobs)
    logratio = torch.where(mask, logprobs - inputs.old_logprobs, zero)
    ratio = torch.exp(logratio)
    low = -math.inf if cispo_epsilon_low is None else 1.0 - cispo_epsilon_low
    weight = torch.clamp(ratio.detach(), min=low, max=1.0 + cispo_epsilon_high)
    adv = torch.where(mask, inputs.advantages.to(logprobs.dtype), zero)
    loss_mat = torch.where(live, -weight * adv * torch.where(live, logprobs, zero), zero)
    clipped = (ratio > 1.0 + cispo_epsilon_high) | (ratio < low)
    return loss_mat, PolicyLossStats(**_ratio_stats(logratio, ratio, clipped, mask))
