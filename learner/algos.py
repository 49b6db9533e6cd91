"""PPO-for-RLHF math as pure tensor functions.

Conventions used by every function in this module:

* Shapes: ``B`` = batch of responses, ``T`` = response length (padded), ``V`` = vocab.
  Per-token quantities are ``(B, T)``; sequence-level quantities are ``(B,)``.
* One mask convention: ``mask`` is a **bool** tensor ``(B, T)`` over response tokens,
  ``True`` = real response token. Responses are right padded; a response ends at its
  first EOS, and that EOS is a real token (``True``). Build it with
  :func:`response_mask_from_ids`.
* Values at masked positions never influence any output (value or gradient): inputs are
  selected with ``torch.where`` rather than multiplied by the mask, because
  ``0 * nan == nan`` and ``0 * inf == nan``, and padding may hold garbage (a model's
  logits/values at pad positions, -inf logprobs of pad tokens, ...). Outputs at masked
  positions are 0 unless a docstring says otherwise.
* Reductions over tokens go through :func:`masked_mean` (or :func:`agg_loss`, which
  uses it), which returns 0 instead of NaN for an all-False mask.
* Nothing here reads a tensor back to the host (no ``.item()``), logs, or takes a
  config object; hyper-parameters are plain Python numbers. This module imports only
  torch (and the standard library).
* Advantage estimators are registered by name (:func:`register_estimator`; GAE the
  default): the config's ``advantage_estimator`` picks one, and one that needs no critic
  gets no value model. Each declares the shared knobs it reads (``reads``), so the config
  refuses the ones it would ignore; so do the policy losses (learner/losses.py) and the loss
  aggregations (``LOSS_AGG_MODES``).

References cited in comments:

* [N+] Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO: A Case Study
  on TL;DR Summarization" (and its code, ``vwxyzjn/summarize_from_feedback_details``).
* [CleanRL] ``vwxyzjn/cleanrl`` ``ppo.py`` (approx-KL, clipfrac, explained variance).
* [Schulman] J. Schulman, "Approximating KL Divergence" (2020 blog post): k1/k2/k3.
* [GAE] Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
  Advantage Estimation".
* [PPO] Schulman et al. 2017, "Proximal Policy Optimization Algorithms".
* [DualClip] Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
  Reinforcement Learning", eq. 5: the dual-clip bound for negative advantages.
* [TIS] Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training" (the truncated importance weight of the sampler/trainer mismatch; verl's and
  OpenRLHF's rollout correction).
* [TRL] ``huggingface/trl`` ``core.py`` / ``ppo_trainer.py`` (masked_whiten, value clip).
* [Ziegler] Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
  section 2.2: the adaptive KL coefficient (OpenRLHF ``AdaptiveKLController``, verl
  ``AdaptiveKLController``, TRL's ``adap_kl_ctrl``).

Token log-probs and entropy under the sampler's distribution (``logprobs_from_logits``,
``entropy_from_logits``, the vLLM sampler emulation) live in ``ppo_ray/logprobs.py``: the
reference scorer uses them too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

Tensor = torch.Tensor

# The choices of the enumerated options this module implements, their one home (ppo_ray.config
# takes its fields' choices from here and from the registries below):
KL_KINDS = ("k1", "k2", "k3")                           # kl_penalty; config kl_estimator
REWARD_MODES = ("last_token", "every_token")            # shape_rewards; config reward_shaping
# agg_loss's modes (config loss_agg), each with the shared knobs (config fields) it reads: the
# config refuses the others' set away from their defaults (ppo_ray.config.ignored_knobs).
LOSS_AGG_MODES: dict[str, tuple[str, ...]] = {
    "token_mean": (), "seq_mean_token_mean": (), "seq_mean_token_sum": (),
    "token_sum_norm": ("loss_agg_tokens",),
}
IS_CORRECTIONS = ("none", "tis", "mis")                 # importance_weights; config is_correction
IS_LEVELS = ("token", "sequence")                       # importance_weights; config is_level


@dataclass(frozen=True)
class Param:
    """One knob of a registered estimator or policy loss, declared once, at its registration.

    It becomes the PPOConfig field ``name`` (a YAML key, a ``--name`` option, a row of
    ``--help`` and docs/CONFIG.md, in the learner's config slice), and the learner passes its
    value to the function it belongs to as the keyword argument ``name``. ``check(value, **others)``
    returns why a value is invalid (or None): the config calls it with the fields named by its
    keyword-only parameters (``def check(c, *, clip_epsilon)``) when the owner is selected.
    ``must_match``: a resume must keep the value (it changes what the checkpoint's training
    meant). While its owner is not selected the value is neither checked nor used.
    """

    name: str
    type: object           # float, int, bool, str, or Optional[...] of one
    default: object
    doc: str
    check: Optional[Callable[..., Optional[str]]] = None
    must_match: bool = False


def check_mask(mask: Tensor) -> Tensor:
    """`mask` itself, after checking it is bool (the one mask convention: True = real token)."""
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = real response token), got {mask.dtype}")
    return mask



# --------------------------------------------------------------------------------------
# masks and reductions
# --------------------------------------------------------------------------------------


def first_true_indices(bools: Tensor) -> Tensor:
    """Index of the first ``True`` along the last dim.

    Args:
        bools: bool ``(..., T)``.

    Returns:
        long ``(...)``: index of the first True in each row, or ``T`` if the row has
        none. Same trick as [N+] ``first_true_indices`` (min over index-or-T), no loop.
    """
    row_len = bools.size(-1)
    idx = torch.arange(row_len, device=bools.device)
    not_true = torch.full_like(idx, row_len)
    return torch.where(bools, idx, not_true).amin(dim=-1)


def response_mask_from_ids(
    response_ids: Tensor,
    eos_token_id: int | Sequence[int] | None,
    pad_token_id: int | None,
) -> Tensor:
    """Bool response mask from right-padded response token ids.

    Args:
        response_ids: long ``(B, T)``, each row a generated response right padded with
            ``pad_token_id``.
        eos_token_id: id (or ids, e.g. several stop tokens) that end a response; None if
            responses have no EOS.
        pad_token_id: padding id, or None if there is no padding.

    Returns:
        bool ``(B, T)``: True from position 0 up to and including the first EOS; False
        after it. A row without EOS is real up to its first pad (its length), i.e. all
        tokens before the first pad. A pad before the first EOS ends the response.

        If ``pad_token_id`` is also an EOS id (e.g. GPT-2, where pad = eos), the first
        occurrence of it is read as the EOS and included; later ones are padding.
    """
    B, T = response_ids.shape
    device = response_ids.device
    if eos_token_id is None:
        eos_ids: list[int] = []
    elif isinstance(eos_token_id, int):
        eos_ids = [eos_token_id]
    else:
        eos_ids = [int(e) for e in eos_token_id]
    no_hit = torch.full((B,), T, dtype=torch.long, device=device)
    if eos_ids:
        is_eos = torch.isin(response_ids, torch.tensor(eos_ids, device=device))
        # +1: the EOS itself is part of the response (it is sampled and gets reward/KL).
        end_eos = first_true_indices(is_eos) + 1
    else:
        end_eos = no_hit + 1
    if pad_token_id is not None and pad_token_id not in eos_ids:
        end_pad = first_true_indices(response_ids == pad_token_id)
    else:
        end_pad = no_hit
    end = torch.minimum(torch.minimum(end_eos, end_pad), no_hit)  # (B,) exclusive end
    return torch.arange(T, device=device) < end.unsqueeze(-1)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of ``x`` over the True positions of ``mask``.

    Args:
        x: ``(B, T)`` (any shape ``mask`` broadcasts to).
        mask: bool, True = include.
        dim: reduce over these dims; None = over all elements (a 0-dim tensor).

    Returns:
        The masked mean; 0 (not NaN) where no position is True. Masked entries of ``x``
        (even NaN/inf) do not affect the value or the gradient.
    """
    mask = check_mask(mask).expand_as(x)
    total = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        total, count = total.sum(), mask.sum()
    else:
        total, count = total.sum(dim), mask.sum(dim)
    # clamp: an all-False mask gives 0 / 1 = 0 instead of 0 / 0 = NaN.
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all True positions of ``mask`` (a 0-dim tensor).

    Args:
        x: ``(B, T)``.
        mask: bool ``(B, T)``, True = include.
        unbiased: Bessel's correction (divide by n - 1), as [TRL] ``masked_var``.

    Returns:
        The variance; 0 when fewer than 1 (biased) or 2 (unbiased) positions are True
        (where TRL raises, we return 0 so a degenerate micro-batch cannot NaN a run).
    """
    mask = check_mask(mask).expand_as(x)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    x = torch.where(mask, x, zero)
    mean = masked_mean(x, mask)
    centered = torch.where(mask, x - mean, zero)
    n = mask.sum().to(x.dtype)
    denom = (n - 1) if unbiased else n
    return centered.square().sum() / denom.clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Whiten ``x`` with the mean/std of its real tokens (batch-level statistics).

    ``(x - mean) / sqrt(var + eps)`` with mean and unbiased var over all True positions,
    as [TRL] ``masked_whiten`` / [N+] (advantage whitening, detail "normalize
    advantages"). ``shift_mean=False`` adds the mean back (only rescale), which [N+]
    uses for rewards. Statistics are over this tensor only: under data parallelism each
    shard whitens with its own statistics unless the caller gathers them.

    Args:
        x: ``(B, T)``.
        mask: bool ``(B, T)``, True = real token.

    Returns:
        ``(B, T)``, 0 at masked positions.
    """
    mask = check_mask(mask).expand_as(x)
    # Select first: in (x - mean) * rsqrt(var) the backward multiplies the incoming
    # gradient (0 at masked positions) by x - mean, and 0 * nan = nan would reach var.
    x = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros((), dtype=x.dtype, device=x.device))


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str = "token_mean",
    normalizer: float | Tensor | None = None,
    norm_tokens: int | None = None,
) -> Tensor:
    """Aggregate a per-token loss ``(B, T)`` into a scalar.

    Modes (verl's ``agg_loss`` names them with hyphens: verl/trainer/ppo/core_algos.py):
        ``"token_mean"``: mean over all real tokens of the batch (every token weighs the
        same, long responses weigh more) -- [N+]/[TRL], DAPO's token-level loss. With
        ``normalizer``: sum over real tokens / normalizer.
        ``"seq_mean_token_mean"``: per-row mean over its real tokens, then mean over rows
        that have at least one real token (every response weighs the same: GRPO's
        1/|o_i|). With ``normalizer``: sum of those row means / normalizer.
        ``"seq_mean_token_sum"``: per-row sum over its real tokens, then mean over rows
        that have at least one real token (a response weighs by its length, the batch by
        its rows). With ``normalizer``: sum of those row sums / normalizer.
        ``"token_sum_norm"``: sum over all real tokens / (B * ``norm_tokens``), a constant
        per row (Dr. GRPO, Liu et al. 2025: the generation budget; TRL's ``dr_grpo``
        divides by rows x max_completion_length; verl's seq-mean-token-sum-norm by the
        padded length alone). ``norm_tokens`` is required without ``normalizer``. With
        ``normalizer``: sum over real tokens / normalizer.

    ``normalizer`` (float or 0-dim tensor, > 0) is for gradient accumulation over
    micro-batches / data-parallel shards: pass the full batch's total: its real tokens
    (token_mean), its non-empty rows (seq_mean_*), or its rows x norm_tokens
    (token_sum_norm), and the sum of the micro-batch losses equals the full-batch loss
    (value and gradient).

    Args:
        loss_mat: ``(B, T)`` per-token loss.
        mask: bool ``(B, T)``, True = real token. Masked entries never matter.

    Returns:
        0-dim tensor.
    """
    mask = check_mask(mask)
    if mode == "token_mean":
        if normalizer is None:
            return masked_mean(loss_mat, mask)
        zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
        return torch.where(mask, loss_mat, zero).sum() / normalizer
    if mode == "seq_mean_token_mean":
        row_mean = masked_mean(loss_mat, mask, dim=-1)  # (B,), 0 for empty rows
        nonempty = mask.any(dim=-1)
        if normalizer is None:
            return masked_mean(row_mean, nonempty)
        zero = torch.zeros((), dtype=row_mean.dtype, device=row_mean.device)
        return torch.where(nonempty, row_mean, zero).sum() / normalizer
    if mode == "seq_mean_token_sum":
        zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
        row_sum = torch.where(mask, loss_mat, zero).sum(dim=-1)  # (B,), 0 for empty rows
        nonempty = mask.any(dim=-1)
        if normalizer is None:
            return masked_mean(row_sum, nonempty)
        return torch.where(nonempty, row_sum, zero).sum() / normalizer
    if mode == "token_sum_norm":
        if normalizer is None:
            if norm_tokens is None or norm_tokens < 1:
                raise ValueError(f"loss_agg token_sum_norm needs norm_tokens >= 1 (the constant per row), "
                                 f"got {norm_tokens!r}")
            normalizer = mask.shape[0] * norm_tokens
        zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
        return torch.where(mask, loss_mat, zero).sum() / normalizer
    raise ValueError(f"unknown loss_agg mode {mode!r}; valid: {list(LOSS_AGG_MODES)}")


# --------------------------------------------------------------------------------------
# KL, rewards, advantages
# --------------------------------------------------------------------------------------


K3_LOG_RATIO_CLAMP = 20.0  # k3's log(pi_ref / pi) is clamped to +-this before exp (verl's low_var_kl)
K3_CLAMP = 10.0            # k3 is clamped to at most this (verl's low_var_kl; OpenRLHF's compute_approx_kl)


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k1", mask: Tensor | None = None
) -> Tensor:
    """Per-token KL estimate between the policy and the reference (SFT) policy.

    With ``log_ratio = logprobs - ref_logprobs`` on tokens sampled from the policy
    ([Schulman] estimators of KL(pi || pi_ref)):

    * ``"k1"`` (default): ``log_ratio`` -- the seeds' ``KL_t = log pi(a|s) -
      log pi_sft(a|s)``; unbiased, can be negative per token ([N+], [TRL] "kl").
    * ``"k2"``: ``0.5 * log_ratio**2``; biased, non-negative, low variance.
    * ``"k3"``: ``exp(-log_ratio) - (-log_ratio) - 1`` = ``r - log r - 1`` with
      ``r = pi_ref / pi``; Schulman's unbiased, non-negative estimator. Computed with
      ``expm1`` so it stays >= 0 for tiny ratios. Clamped as verl's low_var_kl clamps it
      (core_algos.kl_penalty_forward: ``log r`` to [-20, 20], then k3 to at most 10;
      OpenRLHF's compute_approx_kl clamps its k3 to [-10, 10]): k3 grows like ``r``, so a
      token the reference finds far likelier than the policy (``log r = 25``: k3 = 7.2e10)
      would dominate a step's loss (kl_in_loss) or reward on its own. A clamped token has no
      gradient through k3 (``log r`` above ~2.6 or below -11), like the peers'.

    Args:
        logprobs, ref_logprobs: ``(B, T)``.
        kind: one of :data:`KL_KINDS`: ``"k1"``, ``"k2"`` or ``"k3"``.
        mask: optional bool ``(B, T)``; if given, the output is 0 at masked positions
            (otherwise it is elementwise, garbage in -> garbage out at those positions).

    Returns:
        ``(B, T)``.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {KL_KINDS}")
    log_ratio = logprobs - ref_logprobs
    if mask is not None:
        zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
        log_ratio = torch.where(check_mask(mask), log_ratio, zero)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    neg = (-log_ratio).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)  # log(pi_ref / pi)
    return (torch.expm1(neg) - neg).clamp(max=K3_CLAMP)  # = exp(neg) - neg - 1, k3 is 0 where masked


def shape_rewards(
    scores: Tensor,
    kl: Tensor,
    mask: Tensor,
    kl_coef: float | Tensor,
    mode: str = "last_token",
) -> Tensor:
    """Per-token rewards from sequence scores and a per-token KL penalty.

    Modes:
        ``"last_token"`` (default; [N+], [TRL], OpenRLHF): ``r_t = -kl_coef * KL_t`` on
        every real token, plus ``score`` on the last real token of the row (the
        reward model scores the whole response once).
        ``"every_token"``: the seeds' literal formula ``r'_t = R - beta * KL_t`` on every
        real token. Note this adds the score on every token, so the undiscounted return
        carries ``len(response) * R``: the score's weight grows with response length.

    Args:
        scores: ``(B,)`` sequence rewards R.
        kl: ``(B, T)`` per-token KL (e.g. :func:`kl_penalty`).
        mask: bool ``(B, T)``, True = real token.
        kl_coef: beta, float or tensor broadcastable to ``(B, T)`` (e.g. adaptive KL).

    Returns:
        ``(B, T)``; 0 at masked positions. A row with no real tokens is all zeros (its
        score is dropped: there is no token to carry it).
    """
    mask = check_mask(mask)
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    kl = torch.where(mask, kl, zero)  # select first (kl_coef may be a tensor with grad)
    score_bt = scores.to(kl.dtype).unsqueeze(-1).expand_as(kl)
    if mode == "last_token":
        T = mask.size(-1)
        # Last True index per row (T - 1 - first True of the flipped row); -1 if none,
        # which matches no position.
        last = (T - 1) - first_true_indices(mask.flip(-1))
        is_last = torch.arange(T, device=mask.device) == last.unsqueeze(-1)
        rewards = -kl_coef * kl + torch.where(is_last, score_bt, zero)
    elif mode == "every_token":
        rewards = score_bt - kl_coef * kl
    else:
        raise ValueError(f"unknown reward mode {mode!r}; valid: {REWARD_MODES}")
    return torch.where(mask, rewards, zero)


def adaptive_kl_coef(kl_coef: float, kl: float, target: float, horizon: int, n_steps: int) -> float:
    """The next KL coefficient of the adaptive controller [Ziegler] (section 2.2).

    ``e = clip(kl / target - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * n_steps / horizon)``.
    A measured KL above the target raises beta (a stronger penalty pulls the policy back
    toward the reference), below it lowers beta; the clip bounds the change per step.

    Args:
        kl_coef: beta used for the step just taken.
        kl: that step's measured KL to the reference, the mean over sequences of the
            summed per-token KL (the quantity ``target`` is in).
        target: the KL the controller steers toward (> 0).
        horizon: rollouts over which an error is corrected (larger = slower).
        n_steps: rollouts in the step just taken (the batch size), as in OpenRLHF and TRL.

    Returns:
        The coefficient for the next step (plain float: a per-step scalar, not a tensor).
    """
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_steps / horizon)


def compute_td_errors(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """TD errors ``delta_t = r_t + gamma * V_{t+1} - V_t``.

    ``V_{t+1}`` is taken as 0 when position ``t + 1`` is not a real token, i.e. after
    the last real token (the EOS is terminal; a response truncated at the length limit
    is treated as terminal too, as in [N+]). With right padding that is exactly "0
    at/after the last real token"; a hole inside a row would also act as a terminal.

    Args:
        rewards, values: ``(B, T)``; masked entries may be garbage.
        mask: bool ``(B, T)``, True = real token.
        gamma: discount.

    Returns:
        ``(B, T)``, 0 at masked positions.
    """
    mask = check_mask(mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    r = torch.where(mask, rewards, zero)
    v = torch.where(mask, values, zero)
    next_v = torch.cat([v[..., 1:], torch.zeros_like(v[..., :1])], dim=-1)
    return torch.where(mask, r + gamma * next_v - v, zero)


def compute_gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> Tensor:
    """Generalized Advantage Estimation ([GAE]): ``A_t = sum_i (gamma*lam)^i delta_{t+i}``.

    Computed with the reverse recursion ``A_t = delta_t + gamma*lam*A_{t+1}`` over T,
    vectorised over B, from :func:`compute_td_errors` (so ``V = 0`` past the end). The
    recursion restarts at masked positions (``A = 0`` there), consistent with the
    terminal rule of the TD errors. Returns raw advantages; whitening is
    :func:`masked_whiten`'s job. Call under ``torch.no_grad()`` in PPO (advantages are
    targets), though it is differentiable.

    Args:
        rewards, values: ``(B, T)``; masked entries may be garbage.
        mask: bool ``(B, T)``, True = real token.
        gamma, lam: discount and GAE lambda.

    Returns:
        ``(B, T)``, 0 at masked positions.
    """
    mask = check_mask(mask)
    deltas = compute_td_errors(rewards, values, mask, gamma)
    T = deltas.size(-1)
    zero = torch.zeros((), dtype=deltas.dtype, device=deltas.device)
    last = torch.zeros_like(deltas[..., 0])
    out = []
    for t in reversed(range(T)):  # reverse recursion over T is inherent to GAE
        last = torch.where(mask[..., t], deltas[..., t] + gamma * lam * last, zero)
        out.append(last)
    return torch.stack(out[::-1], dim=-1)


def compute_returns(advantages: Tensor, values: Tensor, mask: Tensor | None = None) -> Tensor:
    """Value targets ``G_t = A_t + V_t`` (the lambda-return when A is GAE, [N+]).

    Args:
        advantages: ``(B, T)`` raw (un-whitened) advantages.
        values: ``(B, T)`` values used to compute them.
        mask: optional bool ``(B, T)``; if given, 0 at masked positions (otherwise
            masked positions hold whatever ``A + V`` is there).

    Returns:
        ``(B, T)``.
    """
    returns = advantages + values
    if mask is None:
        return returns
    zero = torch.zeros((), dtype=returns.dtype, device=returns.device)
    return torch.where(check_mask(mask), returns, zero)


# --------------------------------------------------------------------------------------
# advantage estimators: one registry, GAE the default
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator may read: one step's tensors, all on one device.

    ``rewards`` are the shaped per-token rewards (:func:`shape_rewards`: the score on the
    last real token, ``-beta * KL_t`` on every token; scale-whitened when ``whiten_rewards``
    is on), what GAE reads; ``scores`` the raw sequence scores they were shaped from, and
    ``kl`` / ``kl_coef`` the per-token KL and the beta they were shaped with, what the group
    estimators read (their statistics are of the scores; the KL enters afterwards, per token:
    see "group baselines" below); ``values`` the old values ``V(s_t)`` of the critic, ``None``
    for an estimator registered with ``needs_critic=False`` (no value model exists then);
    ``groups`` the group id of each row (``RolloutBatch.groups``: the ``samples_per_prompt``
    samples of one prompt share one), never None for an estimator registered with
    ``needs_groups=True``, nor is ``kl``.
    """

    rewards: Tensor            # (B, T) float32, 0 on padding
    mask: Tensor               # (B, T) bool, True = real response token
    scores: Tensor             # (B,) float32 sequence scores (0 on dropped rows)
    values: Optional[Tensor]   # (B, T) float32 V_old(s_t), or None without a critic
    gamma: float
    lam: float
    groups: Optional[Tensor] = None  # (B,) long: rows with one id are samples of one prompt; None = no groups
    kl: Optional[Tensor] = None      # (B, T) float32 KL_t to the reference (kl_estimator), 0 on padding
    kl_coef: float = 0.0             # beta of the KL in the rewards (0 with kl_in_loss: the KL is in the loss)


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: ``fn(inputs) -> (B, T)`` raw advantages (0 on padding; the
    learner whitens them when ``whiten_advantages`` is on), and whether it needs a critic.
    With a critic the learner trains the value model on ``G_t = A_t + V_t``
    (:func:`compute_returns`); without one it builds no value model at all."""

    name: str
    fn: Callable[..., Tensor]   # fn(inputs, **{param.name: value for each of params})
    needs_critic: bool
    needs_groups: bool = False  # reads inputs.groups: needs samples_per_prompt >= MIN_GROUP_SIZE
    normalized: bool = False    # its advantages are on its method's own scale: whiten_advantages is not applied
    per_row: bool = False       # a row's advantages depend on that row's inputs alone (old_values: update needs it)
    params: tuple[Param, ...] = ()  # its own knobs (config fields), passed to fn as keywords
    reads: tuple[str, ...] = ()     # the shared knobs (config fields) it reads: register_estimator's, derived ones too
    # baseline(inputs) -> (B,) float64: the score each row's score is compared with (a group
    # estimator's; NaN where a row has none), for inspection only (ppo_ray.attribution); None
    # for an estimator without one (GAE's baseline is the critic's V(s_t), per token)
    baseline: Optional[Callable[[AdvantageInputs], Tensor]] = None


# A group baseline needs another sample of the same prompt: samples_per_prompt below this is a
# config error for an estimator registered with needs_groups (check_group_size).
MIN_GROUP_SIZE = 2

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}

# The value model's knobs (config fields): read by every estimator with a critic (it trains one),
# by none without (no value model exists then).
CRITIC_KNOBS = ("value_learning_rate", "value_clip", "vf_coef", "value_model", "value_model_name", "old_values")


def register_estimator(name: str, *, needs_critic: bool, needs_groups: bool = False, normalized: bool = False,
                       per_row: bool = False, params: Sequence[Param] = (), reads: Sequence[str] = (),
                       baseline: Optional[Callable[[AdvantageInputs], Tensor]] = None) -> Callable:
    """Decorator: register ``fn(inputs: AdvantageInputs, **params) -> Tensor`` as the advantage
    estimator ``name`` (the config's ``advantage_estimator``). A new estimator is one such
    function and this line above it; a name is registered once. ``needs_groups``: it reads
    ``inputs.groups`` (several samples per prompt); ``normalized``: its output is already
    scaled as its method defines, so the learner does not whiten it again; ``per_row``: a
    row's advantages depend on that row's inputs alone (then the value model's first training
    forward can give the old values, config old_values: update); ``params``: its own knobs
    (:class:`Param`: each one a config field, passed to ``fn`` as a keyword); ``reads``: the
    knobs shared with other estimators that its advantages depend on (``gamma`` and ``lam``
    read through ``inputs``; ``whiten_rewards`` and ``reward_shaping``, which shape
    ``inputs.rewards``); ``baseline``: what a group estimator compares each score with, (B,)
    per row (the per-token view shows it; no advantage is computed from it). Its ``reads`` also get CRITIC_KNOBS with a critic and
    ``whiten_advantages`` unless ``normalized``; the config refuses every other estimator's
    knob, set away from its default, while this one is selected (ppo_ray.config.ignored_knobs)."""
    derived = (*reads, *(CRITIC_KNOBS if needs_critic else ()), *(() if normalized else ("whiten_advantages",)))

    def register(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered "
                             f"({ADVANTAGE_ESTIMATORS[name].fn.__qualname__})")
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(name, fn, needs_critic, needs_groups, normalized,
                                                         per_row, tuple(params), tuple(dict.fromkeys(derived)),
                                                         baseline)
        return fn
    return register


def advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``; a ValueError naming the registered ones."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"advantage_estimator: unknown estimator {name!r}; registered: "
                         f"{sorted(ADVANTAGE_ESTIMATORS)} (learner/algos.py, register_estimator)") from None


@register_estimator("gae", needs_critic=True, per_row=True, reads=("gamma", "lam", "whiten_rewards", "reward_shaping"))
def gae_advantages(inputs: AdvantageInputs) -> Tensor:
    """[GAE] over the shaped rewards and the critic's old values (the seeds' step 5)."""
    return compute_gae_advantages(inputs.rewards, inputs.values, inputs.mask, inputs.gamma, inputs.lam)


def check_group_size(estimator: AdvantageEstimator, samples_per_prompt: int) -> None:
    """A ValueError naming both values when ``estimator`` needs groups and
    ``samples_per_prompt`` gives it fewer than MIN_GROUP_SIZE samples per prompt (the one
    home of the rule: the config calls it). The knobs an estimator does not read (gamma, lam,
    whiten_rewards and reward_shaping, which shape the per-token rewards GAE reads, the value
    model's) are its registration's ``reads``: the config refuses the others."""
    if estimator.needs_groups and samples_per_prompt < MIN_GROUP_SIZE:
        raise ValueError(f"advantage_estimator {estimator.name!r} compares the samples of one prompt and needs "
                         f"samples_per_prompt >= {MIN_GROUP_SIZE}, got samples_per_prompt={samples_per_prompt}")


# -- group baselines (GRPO, RLOO, REINFORCE++): the scores compared within a prompt's group ---
#
# A response's advantage at token t is its score's advantage within its group plus the KL
# penalty still to come: ``A_t = a(score) - kl_coef * sum_{t' >= t} KL_t'`` (undiscounted; gamma
# and lam do not apply). The group statistics (mean, std, leave-one-out) are of the scores
# alone, the RM / reward-function score of each response; the KL to the reference enters
# afterwards, per token, at strength kl_coef (0 with kl_in_loss, where the KL is a term of the
# loss instead). This is OpenRLHF's order (experience_maker.py, compute_advantages_and_returns:
# rloo / reinforce_baseline / group_norm / dr_grpo shape the sequence reward by its group, then
# compute_reward puts it on the last token with -kl_coef * KL_t on every token, and
# get_cumulative_returns sums them from t on with gamma 1). verl's use_kl_in_reward: True instead
# subtracts beta * KL_t from token_level_rewards before the estimator, whose GRPO / RLOO then read
# the sum (score - beta * sum KL) for the group statistics; its GRPO recipes keep the KL out of
# the reward (use_kl_in_reward: False, use_kl_loss: True: our kl_in_loss, where the two orders
# agree). With the KL inside the statistics, a group of equal scores (common with binary or
# saturated rewards) is ranked by its KL alone and scaled to about one standard unit by GRPO's
# std, whatever kl_coef is; here its advantage is the KL term itself, proportional to kl_coef.
#
# A row with no real token is a dropped sample (nonfinite_reward: drop masks its response out):
# it takes no part in its group's statistics and gets advantage 0, so its score cannot move its
# group's baseline. The statistics and the KL's sums are computed in float64 (a negligible cost)
# so that a group of equal scores gets a score advantage of exactly 0 and float32 rounding of
# the mean is not amplified by a small std; the advantages are rounded to float32 once, at the end.


def _group_scores(inputs: AdvantageInputs) -> tuple[Tensor, Tensor, Tensor, int]:
    """(scores (B,) float64, 0 on dropped rows; valid rows (B,) bool; dense group index (B,)
    long; number of groups)."""
    if inputs.groups is None:
        raise ValueError("a group estimator needs inputs.groups (RolloutBatch.groups: samples_per_prompt >= 2)")
    mask = check_mask(inputs.mask)
    valid = mask.any(dim=-1)  # (B,) False = dropped row
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    scores = torch.where(valid, inputs.scores.double(), zero)  # a dropped row's score may be garbage
    ids, dense = torch.unique(inputs.groups, return_inverse=True)
    return scores, valid, dense, ids.numel()


def _group_sum(x: Tensor, dense: Tensor, n_groups: int) -> Tensor:
    """(G,) per-group sums of the (B,) ``x``, by dense group index."""
    return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, dense, x)


def kl_to_go(kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """The KL penalty from each token to the end of its response: ``-kl_coef * sum_{t' >= t}
    KL_t'`` over the row's real tokens, undiscounted (OpenRLHF's get_cumulative_returns of
    its -kl_coef * KL_t rewards, with the gamma of 1 it sets for its group estimators).

    Args:
        kl: ``(B, T)`` per-token KL (:func:`kl_penalty`); masked entries may be garbage.
        mask: bool ``(B, T)``, True = real token.
        kl_coef: beta (0: no KL term).

    Returns:
        ``(B, T)`` float64, 0 at masked positions.
    """
    mask = check_mask(mask)
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    k = torch.where(mask, kl.double(), zero)
    to_go = k.flip(-1).cumsum(dim=-1).flip(-1)  # (B, T) sum from t to the row's end
    return torch.where(mask, -kl_coef * to_go, zero)


def _per_token(adv: Tensor, valid: Tensor, inputs: AdvantageInputs) -> Tensor:
    """(B,) float64 score advantages -> (B, T) float32: each real token gets its row's score
    advantage plus its KL to go (:func:`kl_to_go` at ``inputs.kl_coef``); 0 on padding and on
    dropped rows."""
    if inputs.kl is None:
        raise ValueError("a group estimator needs inputs.kl (the per-token KL_t of the reward; zeros with "
                         "kl_coef 0 for none)")
    mask = check_mask(inputs.mask)
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    adv = torch.where(valid, adv, zero)                                                  # (B,)
    per_token = adv.unsqueeze(-1) + kl_to_go(inputs.kl, mask, inputs.kl_coef)            # (B, T)
    return torch.where(mask, per_token, zero).float()


def group_mean_baseline(scores: Tensor, valid: Tensor, dense: Tensor, n_groups: int
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: (score - its group's mean, the group's unbiased std, the group's number of
    valid rows), all (B,), over the valid rows only. A group whose valid scores are all equal
    gets a deviation of exactly 0 (not the rounding of its mean); a group of one valid row
    has deviation 0 and std 0."""
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    r = torch.where(valid, scores, zero)
    count = _group_sum(valid.to(scores.dtype), dense, n_groups)                     # (G,)
    mean = _group_sum(r, dense, n_groups) / count.clamp(min=1)                      # (G,)
    dev = torch.where(valid, r - mean[dense], zero)                                 # (B,)
    # unbiased (Bessel) std, as verl (torch.std) and OpenRLHF (Tensor.std) compute GRPO's
    var = _group_sum(dev.square(), dense, n_groups) / (count - 1).clamp(min=1)      # (G,)
    hi, lo = _group_range(r, valid, dense, n_groups)
    same = (hi == lo)[dense]                                                        # (B,)
    dev = torch.where(same, zero, dev)
    return dev, var.sqrt()[dense], count[dense]


def group_mean(inputs: AdvantageInputs) -> Tensor:
    """(B,) float64: the mean score of each row's group over its valid rows, the baseline GRPO and
    REINFORCE++ subtract (the same sums as :func:`group_mean_baseline`); NaN on a dropped row."""
    scores, valid, dense, n_groups = _group_scores(inputs)
    count = _group_sum(valid.to(scores.dtype), dense, n_groups)                     # (G,)
    mean = _group_sum(scores, dense, n_groups) / count.clamp(min=1)                 # (G,)
    return torch.where(valid, mean[dense], torch.full((), math.nan, dtype=scores.dtype, device=scores.device))


def leave_one_out_mean(inputs: AdvantageInputs) -> Tensor:
    """(B,) float64: the mean score of the other valid rows of each row's group, RLOO's baseline;
    NaN on a dropped row and on a row alone in its group (no baseline: score advantage 0)."""
    scores, valid, dense, n_groups = _group_scores(inputs)
    count = _group_sum(valid.to(scores.dtype), dense, n_groups)[dense]             # (B,)
    others = _group_sum(scores, dense, n_groups)[dense] - scores                    # (B,)
    base = others / (count - 1).clamp(min=1)
    return torch.where(valid & (count > 1), base, torch.full((), math.nan, dtype=scores.dtype, device=scores.device))


def _group_range(x: Tensor, valid: Tensor, dense: Tensor, n_groups: int) -> tuple[Tensor, Tensor]:
    """(G,) per-group (max, min) of the (B,) ``x`` over the valid rows; a group without a
    valid row gets (-inf, inf)."""
    hi = torch.full((n_groups,), -math.inf, dtype=x.dtype, device=x.device).scatter_reduce_(
        0, dense, torch.where(valid, x, torch.full_like(x, -math.inf)), "amax")
    lo = torch.full((n_groups,), math.inf, dtype=x.dtype, device=x.device).scatter_reduce_(
        0, dense, torch.where(valid, x, torch.full_like(x, math.inf)), "amin")
    return hi, lo


def varying_groups(scores: Tensor, groups: Tensor) -> Tensor:
    """DAPO's dynamic-sampling filter (Yu et al. 2025, section 3.2, eq. 11: keep a prompt when
    0 < |{o_i correct}| < G, i.e. its group's rewards are not all equal; verl's
    recipe/dapo filter_groups on the sequence score): which rows belong to a group whose
    scores vary.

    A group baseline gives a group of equal scores a score advantage of exactly 0
    (group_mean_baseline): it carries no policy-gradient signal, only its KL term. Non-finite
    scores (rows dropped by nonfinite_reward / reward_failure: drop) take no part, as they
    take none in the baselines: a group varies when it has two finite scores that differ, so a
    group with fewer than two finite scores does not. Scores are compared exactly (in float64,
    which holds every float32 value): two scores that differ in the last bit differ.

    Args:
        scores: ``(B,)`` float sequence scores; NaN/inf = a dropped row.
        groups: ``(B,)`` long group ids (RolloutBatch.groups; rows of one id are samples of
            one prompt, in any order).

    Returns:
        ``(B,)`` bool: True on every row of a varying group.
    """
    if scores.shape != groups.shape or scores.dim() != 1:
        raise ValueError(f"varying_groups: scores {tuple(scores.shape)} and groups {tuple(groups.shape)} must be "
                         "(B,) alike")
    s = scores.double()
    finite = torch.isfinite(s)
    ids, dense = torch.unique(groups, return_inverse=True)
    hi, lo = _group_range(torch.where(finite, s, torch.zeros_like(s)), finite, dense, ids.numel())
    return (hi > lo)[dense]  # (B,); a group of one finite score has hi == lo, of none -inf > inf: False


GRPO_EPS = 1e-6  # verl's epsilon in compute_grpo_outcome_advantage


def _dr_grpo_check(norm_std: bool, *, loss_agg: str) -> Optional[str]:
    if norm_std or loss_agg != "seq_mean_token_mean":
        return None
    return (f"false (Dr. GRPO) needs loss_agg: token_sum_norm, token_mean or seq_mean_token_sum (got {loss_agg}): "
            "Dr. GRPO (Liu et al. 2025) removes both of GRPO's biases, the std division and the per-response "
            "1/|o_i| length normalisation, which seq_mean_token_mean applies (it favours long responses among "
            "those with negative advantages); token_sum_norm divides by a constant, the generation budget, as "
            "the paper does, seq_mean_token_sum by the rows alone, and token_mean by the minibatch's token count, "
            "the same for all its responses")


@register_estimator("grpo", needs_critic=False, needs_groups=True, normalized=True, baseline=group_mean, params=(
    Param("grpo_norm_std", bool, True, "grpo only: divide each group's centred scores by the group's std "
          "(unbiased, + 1e-6; GRPO); false = Dr. GRPO (no std division), which refuses loss_agg: "
          "seq_mean_token_mean (docs/ALGORITHMS.md, \"Advantage estimators and group sampling\").",
          check=_dr_grpo_check, must_match=True),))
def grpo_advantages(inputs: AdvantageInputs, *, grpo_norm_std: bool = True) -> Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath, "outcome supervision"): every real token of a
    response gets ``(s - mean_g(s)) / (std_g(s) + 1e-6)`` over the scores s of the valid
    responses of its group g, plus its KL to go (see the section comment). std is the unbiased
    (n - 1) one, as verl and OpenRLHF compute it, so their settings carry over.
    ``grpo_norm_std=False`` is Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like
    Training"): ``s - mean_g(s)``, no std division (it weights easy and hard prompts alike).
    Matches OpenRLHF's group_norm (its eps 1e-9) and dr_grpo; verl's grpo with the KL in the
    loss (use_kl_loss), not with use_kl_in_reward. A group of equal scores gets exactly its KL
    term (0 at kl_coef 0). Not whitened again by the learner."""
    scores, valid, dense, n_groups = _group_scores(inputs)
    dev, std, _ = group_mean_baseline(scores, valid, dense, n_groups)
    adv = dev / (std + GRPO_EPS) if grpo_norm_std else dev
    return _per_token(adv, valid, inputs)


@register_estimator("rloo", needs_critic=False, needs_groups=True, normalized=True, baseline=leave_one_out_mean)
def rloo_advantages(inputs: AdvantageInputs) -> Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"): the score ``s_i`` minus
    the mean of the other valid scores of its group, ``(k * s_i - sum_g s) / (k - 1)`` = ``k /
    (k - 1) * (s_i - mean_g s)`` with k valid rows, on every real token, plus its KL to go (see
    the section comment). A row alone in its group (its others dropped) has no baseline: score
    advantage 0. Matches OpenRLHF's rloo (not normalised, nor whitened by the learner); verl's
    rloo reads the KL-shaped sum under use_kl_in_reward. A group of equal scores gets exactly
    its KL term (0 at kl_coef 0)."""
    scores, valid, dense, n_groups = _group_scores(inputs)
    dev, _, count = group_mean_baseline(scores, valid, dense, n_groups)
    adv = torch.where(count > 1, dev * count / (count - 1).clamp(min=1), torch.zeros_like(dev))
    return _per_token(adv, valid, inputs)


@register_estimator("reinforce_pp", needs_critic=False, needs_groups=True, normalized=True, baseline=group_mean)
def reinforce_pp_advantages(inputs: AdvantageInputs) -> Tensor:
    """REINFORCE++ with a baseline (Hu 2025, "REINFORCE++"; OpenRLHF's reinforce_baseline, which
    this matches): ``s - mean_g(s)`` plus the KL to go on every real token (no std division: a
    group's scale is kept), then whitened over the batch's real tokens (:func:`masked_whiten`,
    its global statistics; OpenRLHF divides by the biased variance). Whitening is part of the
    method, so it happens whatever whiten_advantages says; a group of equal scores therefore
    gets its KL term whitened with the batch's mean and std, not the KL term itself (and not
    exactly 0 at kl_coef 0 unless every group's scores are equal)."""
    scores, valid, dense, n_groups = _group_scores(inputs)
    dev, _, _ = group_mean_baseline(scores, valid, dense, n_groups)
    return masked_whiten(_per_token(dev, valid, inputs), inputs.mask)


# --------------------------------------------------------------------------------------
# losses and diagnostics
# --------------------------------------------------------------------------------------


def importance_weights(
    logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, correction: str, cap: float, level: str = "token"
) -> tuple[Tensor | None, Tensor]:
    """Off-policy correction for the sampler/trainer mismatch: the sampled tokens come from
    the generator (``behaviour_logprobs``, e.g. vLLM's), the PPO ratio's denominator is the
    learner's ``logprobs`` of the same policy version; their ratio
    ``w = pi_learner / pi_generator`` is 1 up to the engines' numerical differences.

    * ``"none"``: ``(None, mask)``.
    * ``"tis"``, truncated importance sampling ([TIS] Yao et al. 2025): each token's loss is
      weighted by ``min(w, cap)``. Returns ``(weights, mask)``, weights 0 on masked tokens.
    * ``"mis"``, masked importance sampling: tokens whose ``w`` is outside
      ``[1 / cap, cap]`` leave the policy loss. Returns ``(None, mask & inside)``.

    ``level="sequence"``: ``w`` is the sequence's ratio, the product of its tokens' ratios
    (``exp`` of the summed log-ratios over real tokens), the same for every token of the
    row: TIS weights, and MIS keeps or drops, whole responses.

    With ``logprobs == behaviour_logprobs`` every ``w`` is exactly 1: TIS's weights are 1 and
    MIS keeps every token, so each correction computes exactly what ``"none"`` does.

    Args:
        logprobs, behaviour_logprobs: ``(B, T)`` finite on ``mask``.
        mask: bool ``(B, T)``, the tokens of the policy loss.
        correction: one of :data:`IS_CORRECTIONS`; cap: C > 1; level: one of :data:`IS_LEVELS`.
    """
    mask = check_mask(mask)
    if correction not in IS_CORRECTIONS or level not in IS_LEVELS:
        raise ValueError(f"importance_weights: correction {correction!r} must be one of {IS_CORRECTIONS} and "
                         f"level {level!r} one of {IS_LEVELS}")
    if correction == "none":
        return None, mask
    w = importance_ratio(logprobs, behaviour_logprobs, mask, level)  # (B, T)
    if correction == "tis":
        return torch.where(mask, torch.clamp(w, max=cap), torch.zeros((), dtype=w.dtype, device=w.device)), mask
    return None, mask & ~outside_is_band(w, mask, cap)


def importance_ratio(logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, level: str = "token") -> Tensor:
    """The off-policy correction's ratio ``w = pi_learner / pi_generator`` of each token of
    ``mask`` (``level="token"``), or of its response (``"sequence"``: ``exp`` of the row's
    summed log-ratios over ``mask``, the same for every token of the row); 1 off ``mask``.

    Args:
        logprobs, behaviour_logprobs: ``(B, T)`` finite on ``mask``; mask: bool ``(B, T)``.
    Returns: ``(B, T)`` in ``logprobs``' dtype.
    """
    mask = check_mask(mask)
    if level not in IS_LEVELS:
        raise ValueError(f"importance ratio: level {level!r} must be one of {IS_LEVELS}")
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_w = torch.where(mask, logprobs - behaviour_logprobs, zero)  # (B, T)
    if level == "sequence":
        log_w = torch.where(mask, log_w.sum(dim=1, keepdim=True), zero)  # (B, T): the row's log ratio
    return torch.exp(log_w)


def outside_is_band(w: Tensor, mask: Tensor, cap: float) -> Tensor:
    """The tokens of ``mask`` whose ratio ``w`` (:func:`importance_ratio`) is outside
    ``[1 / cap, cap]`` (bool ``(B, T)``; a NaN ratio is outside): those MIS drops, and those
    TIS caps (above ``cap``) or keeps with a weight under ``1 / cap``. Their share is the
    statistic the generator-vs-learner check tests when a correction is on (the trainer's
    rollout check): the correction absorbs a mismatch that moves few tokens this far.

    Args:
        w: ``(B, T)`` ratios; mask: bool ``(B, T)``; cap: C > 1.
    """
    return check_mask(mask) & ~((w >= 1.0 / cap) & (w <= cap))


def mismatch_stats(logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, band: float = 0.1) -> dict[str, Tensor]:
    """How far the sampler's token probabilities are from the trainer's, over ``mask``:
    ``"mismatch_outside_frac"``, the fraction of tokens whose ratio ``pi_learner /
    pi_generator`` is outside ``[1 - band, 1 + band]`` (verl #6280's measure: 9.9% of a
    bf16 Qwen2.5-0.5B's tokens at band 0.1), and ``"mismatch_log_ratio_abs"``, the mean
    ``|log ratio|`` (0-dim tensors)."""
    mask = check_mask(mask)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_w = torch.where(mask, logprobs - behaviour_logprobs, zero)
    w = torch.exp(log_w)
    outside = (w < 1.0 - band) | (w > 1.0 + band)
    return {"mismatch_outside_frac": masked_mean(outside.to(logprobs.dtype), mask),
            "mismatch_log_ratio_abs": masked_mean(log_w.abs(), mask)}


def value_loss(
    values: Tensor,
    returns: Tensor,
    mask: Tensor,
    old_values: Tensor | None = None,
    clip: float | None = None,
    loss_agg: str = "token_mean",
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Value-function loss ``0.5 * (V - G)^2``, optionally PPO-clipped.

    The 0.5 makes the gradient ``(V - G)`` ([N+], [TRL] ``vf_loss = 0.5 * ...``;
    ``vf_coef`` then weights it against the policy loss). With ``clip`` = c, the
    pessimistic PPO value clipping of OpenAI baselines / [N+]:
    ``max((V - G)^2, (clip(V, V_old - c, V_old + c) - G)^2)``.

    Args:
        values: ``(B, T)`` current value predictions (with grad).
        returns: ``(B, T)`` targets G.
        mask: bool ``(B, T)``, True = real token; masked entries may be garbage.
        old_values: ``(B, T)`` rollout-time values; required when ``clip`` is given.
        clip: value clip range c, or None for no clipping.
        loss_agg, normalizer: see :func:`agg_loss`.

    Returns:
        ``(loss, stats)``; ``stats["vf_clipfrac"]``: fraction of real tokens where the
        clipped term is the active (strictly larger) one; 0 without clipping.
    """
    mask = check_mask(mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(mask, values, zero)
    g = torch.where(mask, returns.to(values.dtype), zero)
    loss_unclipped = (v - g).square()
    if clip is None:
        loss_mat = loss_unclipped
        vf_clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        if old_values is None:
            raise ValueError("value_loss: clip needs old_values")
        v_old = torch.where(mask, old_values.to(values.dtype), zero)
        v_clipped = torch.clamp(v, v_old - clip, v_old + clip)
        loss_clipped = (v_clipped - g).square()
        loss_mat = torch.maximum(loss_unclipped, loss_clipped)
        with torch.no_grad():
            vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).to(values.dtype), mask)
    loss = 0.5 * agg_loss(loss_mat, mask, loss_agg, normalizer)
    return loss, {"vf_clipfrac": vf_clipfrac.detach()}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var[G - V] / Var[G]`` over real tokens ([CleanRL], population variances).

    1 = perfect value function, 0 = no better than a constant, < 0 = worse.

    Args:
        values, returns: ``(B, T)``.
        mask: bool ``(B, T)``, True = real token.

    Returns:
        0-dim tensor; NaN when ``Var[G] == 0`` (undefined, as in [CleanRL]/SB3).
    """
    mask = check_mask(mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(mask, values, zero)
    g = torch.where(mask, returns.to(values.dtype), zero)
    var_g = masked_var(g, mask, unbiased=False)
    var_res = masked_var(g - v, mask, unbiased=False)
    return torch.where(var_g == 0, torch.full_like(var_g, float("nan")), 1 - var_res / var_g)
