"""learner/losses.py: the policy-loss registry, the objective that composes the shared terms with
any loss, and GSPO, a loss added by its registration alone (its parameter reaches the config,
the CLI, --help, docs/CONFIG.md and the learner's slice from there)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from learner.buffer import ExperienceBuffer
from learner.learner import Learner
from learner.losses import (POLICY_LOSSES, LossInputs, PolicyLossStats, policy_loss, policy_objective,
                            register_policy_loss)
from ppo_ray.batch import TrimPlan
from ppo_ray.config import ConfigError, ConfigParser, PPOConfig, field_docs, role_fields
from helpers import (assert_grads_close, keep_experience, make_config, policy_grads, random_batch, rollout_inputs,
                     with_sgd)
from tolerances import rounding_tol

F64 = torch.float64


def random_rows(b=8, t=9, seed=0, spread=0.1):
    """(logprobs with grad, old logprobs, per-row advantages broadcast over (B, T), mask): rows of
    different lengths, garbage on padding, sequence ratios a few percent off 1."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3
    logprobs = old + spread * torch.randn(b, t, generator=g, dtype=F64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    logprobs = torch.where(mask, logprobs, torch.full_like(logprobs, float("nan")))  # garbage where masked
    adv = torch.randn(b, 1, generator=g, dtype=F64).expand(b, t).clone()
    return logprobs.requires_grad_(True), old, adv, mask


def naive_gspo(logprobs, old, adv, mask, eps, agg, eps_high=None):
    """GSPO's sequence objective written out per response: s_i = exp(mean_t (logp - logp_old))
    with its gradient through every token, loss_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps, 1 +
    eps_high)) on each of the row's tokens (eps_high None: eps), aggregated by token (token_mean)
    or by response (seq_mean_token_mean)."""
    eps_high = eps if eps_high is None else eps_high
    total, n_tokens, n_rows = 0.0, 0, 0
    for i in range(len(mask)):
        m = mask[i]
        if not m.any():
            continue
        s = torch.exp((logprobs[i][m] - old[i][m]).mean())
        a = adv[i][m][0]
        loss_i = torch.maximum(-a * s, -a * s.clamp(1 - eps, 1 + eps_high))
        total = total + (loss_i * int(m.sum()) if agg == "token_mean" else loss_i)
        n_tokens, n_rows = n_tokens + int(m.sum()), n_rows + 1
    return total / (n_tokens if agg == "token_mean" else n_rows)


def gspo_objective(logprobs, old, adv, mask, eps, agg="token_mean", eps_high=None):
    return policy_objective(POLICY_LOSSES["gspo"], LossInputs(logprobs, old, adv, mask, 0.2),
                            {"gspo_clip_epsilon": eps, "gspo_clip_epsilon_high": eps_high}, loss_agg=agg)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("seed", range(3))
def test_gspo_equals_the_naive_sequence_objective_value_and_gradient(seed, agg):
    """With one advantage per response (GRPO's) GSPO-token's loss and gradient are the sequence
    objective's, eq. 5 vs eq. 7 of the paper; eps 0.02 clips some responses and not others."""
    logprobs, old, adv, mask = random_rows(seed=seed)
    loss, stats, kl = gspo_objective(logprobs, old, adv, mask, 0.02, agg)
    loss.backward()
    got = logprobs.grad.clone()
    logprobs.grad = None
    want = naive_gspo(logprobs, old, adv, mask, 0.02, agg)
    want.backward()
    tol = rounding_tol(1.0, int(mask.sum()), torch.float64)
    assert loss.item() == pytest.approx(want.item(), abs=tol)
    torch.testing.assert_close(torch.where(mask, got, 0.0), torch.where(mask, logprobs.grad, 0.0), atol=tol, rtol=0)
    assert 0 < stats.clipfrac.item() < 1 and kl is None  # some responses clipped, not all


@pytest.mark.parametrize("seed", range(3))
def test_gspo_takes_its_own_lower_and_upper_bound(seed):
    """gspo_clip_epsilon below and gspo_clip_epsilon_high above (the paper's 3e-4 and 4e-4 are
    such a pair; here 0.01 and 0.03, where these rows' sequence ratios leave both bands): the
    loss and gradient are the naive objective's with [1 - 0.01, 1 + 0.03], and differ from the
    symmetric clip's, which gspo_clip_epsilon_high None keeps."""
    logprobs, old, adv, mask = random_rows(seed=seed)
    loss, stats, _ = gspo_objective(logprobs, old, adv, mask, 0.01, eps_high=0.03)
    loss.backward()
    got = logprobs.grad.clone()
    logprobs.grad = None
    want = naive_gspo(logprobs, old, adv, mask, 0.01, "token_mean", eps_high=0.03)
    want.backward()
    tol = rounding_tol(1.0, int(mask.sum()), torch.float64)
    assert loss.item() == pytest.approx(want.item(), abs=tol)
    torch.testing.assert_close(torch.where(mask, got, 0.0), torch.where(mask, logprobs.grad, 0.0), atol=tol, rtol=0)
    symmetric, _, _ = gspo_objective(logprobs, old, adv, mask, 0.01)
    assert abs(symmetric.item() - loss.item()) > 100 * tol
    assert symmetric.item() == gspo_objective(logprobs, old, adv, mask, 0.01, eps_high=0.01)[0].item()


def test_gspo_at_ratio_one_is_ppo_clips_gradient():
    """Before any update (pi = pi_old) every ratio is 1: GSPO's gradient is -A_t / N per token,
    PPO-clip's too (REINFORCE), also with per-token advantages."""
    logprobs, old, _, mask = random_rows(seed=4)
    logprobs = torch.where(mask, old, logprobs.detach()).requires_grad_(True)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    grads = {}
    for name, params in (("gspo", {"gspo_clip_epsilon": 4e-4}), ("ppo_clip", {"dual_clip": None})):
        logprobs.grad = None
        loss, stats, _ = policy_objective(policy_loss(name), LossInputs(logprobs, old, adv, mask, 0.2), params,
                                          loss_agg="token_mean")
        loss.backward()
        grads[name] = torch.where(mask, logprobs.grad, 0.0)
        assert stats.ratio_mean.item() == 1.0 and stats.clipfrac.item() == 0.0
    torch.testing.assert_close(grads["gspo"], grads["ppo_clip"], atol=1e-15, rtol=0)
    torch.testing.assert_close(grads["gspo"], torch.where(mask, -adv / mask.sum(), 0.0), atol=1e-15, rtol=0)


def test_a_clipped_response_gets_no_gradient_on_any_token():
    """A response whose sequence ratio left the band on the side its advantage pushes toward
    is clipped whole: no token of it gets a gradient (PPO-clip would still move its tokens whose
    own ratio is inside). A token outside the support (logprob -inf) gets none either."""
    old = torch.zeros(3, 4, dtype=F64)
    # row 0: every token's ratio 1.1, A > 0: clipped; row 1: tokens 0.5 and 1.6 (mean log ratio
    # about -0.11), A < 0: clipped; row 2: inside the band, one token outside the support
    logprobs = torch.tensor([[math.log(1.1)] * 4, [math.log(0.5), math.log(1.6), 0.0, 0.0],
                             [0.01, -0.01, -math.inf, 0.0]], dtype=F64).requires_grad_(True)
    mask = torch.tensor([[True] * 4, [True, True, False, False], [True, True, True, False]])
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4, [1.0] * 4], dtype=F64)
    loss, stats, _ = gspo_objective(logprobs, old, adv, mask, 0.05)
    loss.backward()
    assert torch.isfinite(loss)
    grad = logprobs.grad
    assert (grad[0] == 0).all() and (grad[1] == 0).all()
    assert (grad[2, :2] != 0).all() and grad[2, 2] == 0
    assert stats.clipfrac.item() == pytest.approx(6 / 9) and stats.outside_support_frac.item() == pytest.approx(1 / 9)


# ---------------------------------------------------------------------- the registry and the config
def test_a_registered_losss_parameter_is_a_config_field_everywhere():
    assert set(POLICY_LOSSES) >= {"ppo_clip", "gspo"}
    config = PPOConfig(policy_loss="gspo", gspo_clip_epsilon=3e-4, loss_agg="seq_mean_token_mean")
    assert config.gspo_clip_epsilon == 3e-4 and PPOConfig().gspo_clip_epsilon == 4e-4
    assert PPOConfig.from_args(["--policy_loss", "gspo", "--gspo_clip_epsilon", "1e-3"]).gspo_clip_epsilon == 1e-3
    assert "gspo_clip_epsilon" in role_fields("learner") and "gspo_clip_epsilon" not in role_fields("generator")
    assert field_docs()["gspo_clip_epsilon"].startswith("gspo only: ")
    assert "--gspo_clip_epsilon" in ConfigParser().format_help()
    with pytest.raises(ConfigError, match=r"'gspo_clip_epsilon' = 0.0 is invalid: must be in \(0, 1\)"):
        PPOConfig(policy_loss="gspo", gspo_clip_epsilon=0.0)
    # another loss does not read it: set away from its default it is refused, not checked or passed on
    with pytest.raises(ConfigError, match=r"'gspo_clip_epsilon' = 0.0 is invalid: policy_loss 'ppo_clip' does not"):
        PPOConfig(gspo_clip_epsilon=0.0)
    paper = PPOConfig(policy_loss="gspo", gspo_clip_epsilon=3e-4, gspo_clip_epsilon_high=4e-4)  # Zheng et al.'s
    assert (paper.gspo_clip_epsilon, paper.gspo_clip_epsilon_high, PPOConfig().gspo_clip_epsilon_high) == \
        (3e-4, 4e-4, None)
    with pytest.raises(ConfigError, match=r"'policy_loss' = 'gpso' is invalid: must be one of \['ppo_clip', 'gspo'"):
        PPOConfig(policy_loss="gpso")
    with pytest.raises(ConfigError, match=r"'dual_clip' = 1.1 is invalid: must be >= 1 \+ clip_epsilon"):
        PPOConfig(dual_clip=1.1)


def test_unknown_and_twice_registered_losses_are_clear_errors():
    with pytest.raises(ValueError, match=r"unknown loss 'gpso'; registered: \[.*'gspo'.*'ppo_clip'"):
        policy_loss("gpso")
    with pytest.raises(ValueError, match="'ppo_clip' is already registered"):
        register_policy_loss("ppo_clip")(lambda inputs: None)
    with pytest.raises(TypeError, match="stats must be a PolicyLossStats subclass"):
        register_policy_loss("x", stats=dict)
    assert issubclass(POLICY_LOSSES["gspo"].stats, PolicyLossStats)


# ---------------------------------------------------------------------- in the learner
def test_gspo_in_the_learner_is_the_sequence_objectives_gradient(tiny_path, special):
    """A real Learner (tiny Qwen3, PEFT LoRA) with policy_loss: gspo: the policy's gradient of a
    micro-batch whose old logprobs are off the policy's equals the gradient of the sequence
    objective written out (naive_gspo) on the same forward, with one advantage per response;
    and the update reports GSPO's stats under the names every loss reports."""
    learner = Learner(make_config(policy_loss="gspo", gspo_clip_epsilon=0.02), tiny_path)
    batch, ref, scores = rollout_inputs(learner, random_batch(special))
    kept = keep_experience(learner)
    stats = with_sgd(learner, lr=0.0).update(batch, ref, scores)[0]
    assert stats.first_minibatch_ratio_mean == pytest.approx(1.0, abs=1e-5) and stats.loss_extra == {}
    exp = kept[-1]
    g = torch.Generator().manual_seed(3)
    noise = 0.05 * torch.randn(exp.old_logprobs.shape, generator=g)
    row_adv = exp.advantages.sum(1, keepdim=True) / exp.policy_mask.sum(1, keepdim=True).clamp(min=1)
    exp = replace(exp, old_logprobs=torch.where(exp.policy_mask, exp.old_logprobs + noise, 0.0),
                  advantages=torch.where(exp.policy_mask, row_adv.expand_as(exp.advantages), 0.0))
    got = policy_grads(learner, exp)

    learner.policy.zero_grad(set_to_none=True)
    mb = ExperienceBuffer(exp, len(exp), len(exp), TrimPlan.of(exp.rollouts)).micro_batch(list(range(len(exp))))
    logp, _, _ = learner.speed.train_stats(mb.rollouts, mb.seq_len, mb.response_tokens, mb.policy_mask, mb.mask,
                                           entropy=False)
    naive_gspo(logp, mb.old_logprobs, mb.advantages, mb.policy_mask, 0.02, "token_mean").backward()
    want = {n: p.grad.clone() for n, p in learner.policy.named_parameters() if p.requires_grad}
    assert_grads_close(got, want, int(exp.policy_mask.sum()))


# --------------------------------------------------------------------------------------
# clip-higher and CISPO: float64 loops over tokens, written from the peers' formulas
# --------------------------------------------------------------------------------------


def loop_objective(logprobs, old, adv, mask, token_loss):
    """token_mean of token_loss(logp, logp_old, A) over the mask's tokens, one token at a time."""
    total, n = 0.0, 0
    for i in range(len(mask)):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                total = total + token_loss(logprobs[i, t], old[i, t], adv[i, t])
                n += 1
    return total / n


def value_and_grad(fn, logprobs):
    logprobs.grad = None
    loss = fn()
    loss.backward()
    grad = logprobs.grad.clone()
    logprobs.grad = None
    return loss.detach(), grad


def assert_same_objective(got, want, logprobs, mask):
    """Values and gradients of two objectives equal within float64 rounding of the token sum."""
    (lg, gg), (lw, gw) = value_and_grad(got, logprobs), value_and_grad(want, logprobs)
    n = int(mask.sum())
    assert lg.item() == pytest.approx(lw.item(), abs=rounding_tol(lw.abs().item() + 1, n, F64))
    torch.testing.assert_close(torch.where(mask, gg, 0.0), torch.where(mask, gw, 0.0),
                               atol=rounding_tol(gw[mask].abs().max().item() + 1e-3, n, F64), rtol=0)
    return gg


def objective(name, logprobs, old, adv, mask, params, eps=0.2):
    return lambda: policy_objective(POLICY_LOSSES[name], LossInputs(logprobs, old, adv, mask, eps), params,
                                    loss_agg="token_mean")[0]


@pytest.mark.parametrize("seed", range(3))
def test_clip_higher_equals_the_loop_reference(seed):
    """DAPO's clip-higher, as verl's compute_policy_loss_vanilla (verl/trainer/ppo/core_algos.py)
    writes it: -A * r against -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high), the larger
    one per token. eps_high 0.01 clips tokens above 1.01 that eps 0.2 would not."""
    logprobs, old, adv, mask = random_rows(seed=seed)
    adv = torch.randn(adv.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)  # per-token signs

    def token(lp, lo, a, low=0.2, high=0.01):
        r = torch.exp(lp - lo)
        return torch.maximum(-a * r, -a * torch.clamp(r, 1 - low, 1 + high))

    grad = assert_same_objective(objective("ppo_clip", logprobs, old, adv, mask, {"clip_epsilon_high": 0.01}),
                                 lambda: loop_objective(logprobs, old, adv, mask, token), logprobs, mask)
    ratio = torch.exp(logprobs.detach() - old)
    cut = mask & (adv > 0) & (ratio > 1.01)  # above the new upper bound: no gradient
    assert cut.any() and (grad[cut] == 0).all()
    kept = mask & (adv > 0) & (ratio < 1.01) & (ratio > 0.8)
    assert kept.any() and (grad[kept] != 0).all()
    # None is the symmetric clip
    symmetric = objective("ppo_clip", logprobs, old, adv, mask, {"clip_epsilon_high": None})
    assert_same_objective(symmetric, lambda: loop_objective(logprobs, old, adv, mask,
                                                            lambda a, b, c: token(a, b, c, 0.2, 0.2)), logprobs, mask)


@pytest.mark.parametrize("low", [None, 0.05])
@pytest.mark.parametrize("seed", range(3))
def test_cispo_equals_the_loop_reference(seed, low):
    """CISPO as SkyRL's compute_policy_loss_cispo (skyrl_train/utils/ppo_utils.py) writes it:
    -A * clamp(r, 1 - eps_low, 1 + eps_high).detach() * logp, MiniMax-M1 eq. 4 (eps_low None:
    no lower bound, the paper's). A token whose weight was clipped keeps its gradient -w * A,
    which PPO-clip would have zeroed."""
    logprobs, old, adv, mask = random_rows(seed=seed)
    adv = torch.randn(adv.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    high = 0.02

    def token(lp, lo, a):
        w = math.exp(lp.item() - lo.item())  # a plain number: no gradient through the weight
        w = min(w, 1 + high) if low is None else min(max(w, 1 - low), 1 + high)
        return -a * w * lp

    params = {"cispo_epsilon_high": high, "cispo_epsilon_low": low}
    grad = assert_same_objective(objective("cispo", logprobs, old, adv, mask, params),
                                 lambda: loop_objective(logprobs, old, adv, mask, token), logprobs, mask)
    ratio = torch.exp(logprobs.detach() - old)
    n = int(mask.sum())
    clipped = mask & (ratio > 1 + high)
    assert clipped.any()
    torch.testing.assert_close(grad[clipped], -(1 + high) * adv[clipped] / n, rtol=1e-12, atol=0)
    if low is not None:
        below = mask & (ratio < 1 - low)
        assert below.any()
        torch.testing.assert_close(grad[below], -(1 - low) * adv[below] / n, rtol=1e-12, atol=0)
    _, stats, _ = policy_objective(POLICY_LOSSES["cispo"], LossInputs(logprobs, old, adv, mask, 0.2), params,
                                   loss_agg="token_mean")
    outside = clipped | (mask & (ratio < 1 - low)) if low is not None else clipped
    assert stats.clipfrac.item() == pytest.approx(float(outside.sum()) / n)


def test_cispo_at_ratio_one_is_ppo_clips_gradient_and_ignores_tokens_outside_the_support():
    """At r = 1 CISPO's gradient is REINFORCE's, -A per token, as PPO-clip's; a token whose new
    logprob is -inf (outside a truncated support) adds 0 and gets no gradient."""
    logprobs, old, adv, mask = random_rows(seed=5, spread=0.0)
    cispo_grad = value_and_grad(objective("cispo", logprobs, old, adv, mask, {}), logprobs)[1]
    clip_grad = value_and_grad(objective("ppo_clip", logprobs, old, adv, mask, {}), logprobs)[1]
    torch.testing.assert_close(torch.where(mask, cispo_grad, 0.0), torch.where(mask, clip_grad, 0.0),
                               atol=rounding_tol(adv.abs().max(), 1, F64), rtol=0)
    lp = logprobs.detach().clone()
    lp[0, 0] = -math.inf
    lp.requires_grad_(True)
    loss, grad = value_and_grad(objective("cispo", lp, old, adv, mask, {}), lp)
    assert math.isfinite(loss.item()) and grad[0, 0] == 0 and torch.isfinite(grad[mask]).all()


def test_clip_higher_and_cispo_bounds_are_checked_by_the_config():
    with pytest.raises(ConfigError, match="'clip_epsilon_high' = -0.1 is invalid: must be > 0 or null"):
        PPOConfig(clip_epsilon_high=-0.1)
    with pytest.raises(ConfigError, match=r"'dual_clip' = 1.25 is invalid: must be >= 1 \+ clip_epsilon_high = 1.28"):
        PPOConfig(clip_epsilon_high=0.28, dual_clip=1.25)
    with pytest.raises(ConfigError, match="'cispo_epsilon_low' = 1.5 is invalid: must be in"):
        PPOConfig(policy_loss="cispo", cispo_epsilon_low=1.5)
    with pytest.raises(ConfigError, match="'cispo_epsilon_high' = 0.0 is invalid: must be > 0"):
        PPOConfig(policy_loss="cispo", cispo_epsilon_high=0.0)
    PPOConfig(clip_epsilon_high=0.28, dual_clip=3.0)
