"""Pins the PPO math in learner/algos.py (CPU, fast); the token log-probs are in test_logprobs.py.

Hand-worked values, vectorised-vs-naive-loop equivalence on random right-padded
batches, and invariance to garbage at masked positions (values and gradients).
"""

from __future__ import annotations

import math

import pytest
import torch

from learner.algos import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_gae_advantages,
    compute_returns,
    compute_td_errors,
    explained_variance,
    first_true_indices,
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
    response_mask_from_ids,
    shape_rewards,
    value_loss,
)
from learner.losses import ppo_clip_loss
from ppo_ray.logprobs import entropy_from_logits, logprobs_from_logits
from tolerances import rounding_tol

F64 = torch.float64


def t64(x):
    return torch.tensor(x, dtype=F64)


def right_padded_mask(lengths, T):
    return torch.arange(T) < torch.as_tensor(lengths).unsqueeze(-1)


def random_lengths(gen, B, T):
    """Random response lengths in [0, T]; with B >= 2 row 0 is all padding, the last row full."""
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    if B >= 2:
        lengths[0] = 0
    lengths[-1] = T
    return lengths


def with_garbage(x, mask, gen):
    """x with masked positions replaced by NaN / +-inf / huge values."""
    choices = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30], dtype=x.dtype)
    idx = torch.randint(0, len(choices), x.shape, generator=gen)
    return torch.where(mask, x, choices[idx])


# ----------------------------------------------------------------------------------------
# naive per-sequence references (written independently of the implementation)
# ----------------------------------------------------------------------------------------


def naive_td(r, v, L, gamma):
    out = [0.0] * len(r)
    for t in range(L):
        v_next = float(v[t + 1]) if t + 1 < L else 0.0
        out[t] = float(r[t]) + gamma * v_next - float(v[t])
    return out


def naive_gae(r, v, L, gamma, lam):
    deltas = naive_td(r, v, L, gamma)
    out = [0.0] * len(r)
    for t in range(L):  # direct sum, not the recursion
        out[t] = sum((gamma * lam) ** i * deltas[t + i] for i in range(L - t))
    return out


def naive_shape(score, kl, L, beta, mode):
    out = [0.0] * len(kl)
    for t in range(L):
        if mode == "every_token":
            out[t] = float(score) - beta * float(kl[t])
        else:
            out[t] = -beta * float(kl[t]) + (float(score) if t == L - 1 else 0.0)
    return out


# ----------------------------------------------------------------------------------------
# masks
# ----------------------------------------------------------------------------------------


def test_first_true_indices():
    b = torch.tensor([[False, True, True], [False, False, False], [True, False, False]])
    assert first_true_indices(b).tolist() == [1, 3, 0]


@pytest.mark.parametrize(
    "ids, expected",
    [
        ([5, 2, 7, 0], [1, 1, 0, 0]),  # EOS mid-row: included, what follows excluded
        ([5, 2, 7, 8], [1, 1, 0, 0]),  # tokens after EOS excluded even if not pad
        ([5, 6, 7, 8], [1, 1, 1, 1]),  # no EOS, no pad: truncated at length, all real
        ([5, 6, 0, 0], [1, 1, 0, 0]),  # no EOS, pad right after content
        ([2, 0, 0, 0], [1, 0, 0, 0]),  # EOS at position 0
        ([0, 0, 0, 0], [0, 0, 0, 0]),  # empty response
        ([5, 6, 7, 2], [1, 1, 1, 1]),  # EOS at the last position
    ],
)
def test_response_mask_from_ids(ids, expected):
    m = response_mask_from_ids(torch.tensor([ids]), eos_token_id=2, pad_token_id=0)
    assert m.dtype == torch.bool
    assert m[0].long().tolist() == expected


def test_response_mask_pad_equals_eos_and_multiple_eos():
    ids = torch.tensor([[5, 2, 2, 2], [5, 6, 7, 8], [2, 2, 2, 2]])
    m = response_mask_from_ids(ids, eos_token_id=2, pad_token_id=2)
    assert m.long().tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    ids = torch.tensor([[5, 9, 7, 0], [5, 2, 9, 0], [5, 6, 0, 0]])
    m = response_mask_from_ids(ids, eos_token_id=[2, 9], pad_token_id=0)
    assert m.long().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]]


def test_non_bool_mask_rejected():
    with pytest.raises(TypeError):
        masked_mean(torch.ones(2, 3), torch.ones(2, 3))


# ----------------------------------------------------------------------------------------
# reductions and whitening
# ----------------------------------------------------------------------------------------


def test_masked_mean_known_and_all_false():
    x = t64([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    m = torch.tensor([[True, True, False], [True, False, True]])
    assert masked_mean(x, m).item() == pytest.approx(13.0 / 4)
    assert masked_mean(x, m, dim=-1).tolist() == pytest.approx([1.5, 5.0])
    none = torch.zeros_like(m)
    x = x.clone().requires_grad_(True)
    out = masked_mean(x, none)
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert masked_mean(x.detach(), none, dim=-1).tolist() == [0.0, 0.0]


def test_masked_var_and_whiten_known():
    x = t64([[1.0, 2.0, 3.0], [4.0, float("nan"), -1e30]])
    m = torch.tensor([[True, True, True], [True, False, False]])
    assert masked_var(x, m).item() == pytest.approx(5.0 / 3)  # unbiased
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(1.25)
    std = math.sqrt(5.0 / 3)
    w = masked_whiten(x, m)
    expected = [[-1.5 / std, -0.5 / std, 0.5 / std], [1.5 / std, 0.0, 0.0]]
    assert torch.allclose(w, t64(expected), atol=1e-7)
    w = masked_whiten(x, m, shift_mean=False)
    expected = [[2.5 - 1.5 / std, 2.5 - 0.5 / std, 2.5 + 0.5 / std], [2.5 + 1.5 / std, 0.0, 0.0]]
    assert torch.allclose(w, t64(expected), atol=1e-7)
    # whitened real tokens: mean 0, unbiased var ~1
    assert masked_mean(masked_whiten(x, m), m).item() == pytest.approx(0.0, abs=1e-12)
    assert masked_var(masked_whiten(x, m), m).item() == pytest.approx(1.0, abs=1e-6)


def test_masked_var_degenerate():
    x = t64([[3.0, float("nan")]])
    assert masked_var(x, torch.tensor([[True, False]])).item() == 0.0
    assert masked_var(x, torch.tensor([[False, False]])).item() == 0.0
    w = masked_whiten(x, torch.tensor([[False, False]]))
    assert torch.equal(w, torch.zeros_like(w))


def test_agg_loss_modes():
    loss_mat = t64([[1.0, 2.0, 3.0], [10.0, float("nan"), 7.0], [float("inf"), 1.0, 1.0]])
    m = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    assert agg_loss(loss_mat, m, "token_mean").item() == pytest.approx(16.0 / 4)
    assert agg_loss(loss_mat, m, "seq_mean_token_mean").item() == pytest.approx((2.0 + 10.0) / 2)
    assert agg_loss(loss_mat, m, "token_mean", normalizer=8).item() == pytest.approx(2.0)
    assert agg_loss(loss_mat, m, "seq_mean_token_mean", normalizer=4.0).item() == pytest.approx(3.0)
    assert agg_loss(loss_mat, m, "seq_mean_token_sum").item() == pytest.approx((6.0 + 10.0) / 2)
    assert agg_loss(loss_mat, m, "seq_mean_token_sum", normalizer=4.0).item() == pytest.approx(4.0)
    assert agg_loss(loss_mat, m, "token_sum_norm", norm_tokens=4).item() == pytest.approx(16.0 / (3 * 4))
    assert agg_loss(loss_mat, m, "token_sum_norm", normalizer=32).item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="token_sum_norm needs norm_tokens >= 1"):
        agg_loss(loss_mat, m, "token_sum_norm")
    with pytest.raises(ValueError, match="bogus"):
        agg_loss(loss_mat, m, "bogus")


# ----------------------------------------------------------------------------------------
# KL, reward shaping, TD / GAE / returns: known values
# ----------------------------------------------------------------------------------------


def test_kl_kinds_known_values():
    logp, ref = t64([math.log(0.5)]), t64([math.log(0.25)])
    assert kl_penalty(logp, ref).item() == pytest.approx(math.log(2))  # default k1
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    # k3 = r - log r - 1 with r = pi_ref / pi = 0.5
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + math.log(2) - 1)


def test_k3_is_clamped_as_the_peers_clamp_it():
    """verl's low_var_kl (and OpenRLHF's k3): log(pi_ref / pi) clamped to [-20, 20], then k3 to
    at most 10. Unclamped, a token the reference finds e^25 times likelier than the policy
    gives k3 = 7.2e10 and a gradient of the same size; clamped, 10 and no gradient. Inside the
    clamp, k3 and its gradient (1 - pi_ref / pi w.r.t. log pi) are Schulman's."""
    log_r = t64([25.0, 2.0, 0.5, -3.0, -25.0, -math.inf])  # log(pi_ref / pi)
    logp = torch.zeros(6, dtype=F64, requires_grad=True)
    k3 = kl_penalty(logp, logp.detach() + log_r, "k3")
    want = [10.0, math.exp(2.0) - 3.0, math.exp(0.5) - 1.5, math.exp(-3.0) + 2.0, 10.0, 10.0]
    assert k3.detach().tolist() == pytest.approx(want, rel=1e-12)
    k3.sum().backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 1 - math.exp(2.0), 1 - math.exp(0.5), 1 - math.exp(-3.0), 0.0,
                                                0.0], rel=1e-12)
    # float32 as the learner computes it: finite, and 10 at the far token
    far = kl_penalty(torch.zeros(2), torch.tensor([25.0, 0.0]), "k3")
    assert far.tolist() == [10.0, 0.0]


def test_kl_properties():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 16, generator=g, dtype=F64) * 3
    b = torch.randn(64, 16, generator=g, dtype=F64) * 3
    assert (kl_penalty(a, b, "k3") >= 0).all()
    assert (kl_penalty(a, b, "k2") >= 0).all()
    tiny = a + 1e-9
    assert (kl_penalty(a, tiny, "k3") >= 0).all()
    for kind in ("k1", "k2", "k3"):
        assert torch.equal(kl_penalty(a, a, kind), torch.zeros_like(a))
    with pytest.raises(ValueError, match="'k4'") as err:
        kl_penalty(a, b, "k4")
    assert "k1" in str(err.value) and "k3" in str(err.value)


def test_shape_rewards_known_values():
    scores = t64([2.0, -1.0, 5.0])
    kl = t64([[0.1, 0.2, 0.3], [0.5, -0.5, 9.0], [1.0, 1.0, 1.0]])
    m = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    r = shape_rewards(scores, kl, m, kl_coef=0.1)  # default last_token
    expected = [[-0.01, -0.02, 1.97], [-0.05, -0.95, 0.0], [0.0, 0.0, 0.0]]
    assert torch.allclose(r, t64(expected), atol=1e-12)
    r = shape_rewards(scores, kl, m, kl_coef=0.1, mode="every_token")
    expected = [[1.99, 1.98, 1.97], [-1.05, -0.95, 0.0], [0.0, 0.0, 0.0]]
    assert torch.allclose(r, t64(expected), atol=1e-12)
    with pytest.raises(ValueError, match="sparse"):
        shape_rewards(scores, kl, m, 0.1, mode="sparse")


def test_td_errors_terminal_and_gae_known_values():
    # T=3, gamma=0.9, lam=0.8 worked by hand; row 1 ends after 2 tokens (garbage after).
    gamma, lam = 0.9, 0.8
    rewards = t64([[1.0, 0.0, 2.0], [1.0, 0.0, float("nan")]])
    values = t64([[0.5, 0.2, 0.4], [0.5, 0.2, float("inf")]])
    m = torch.tensor([[True, True, True], [True, True, False]])
    # row 0: d0 = 1 + .9*.2 - .5 = .68, d1 = 0 + .9*.4 - .2 = .16, d2 = 2 + 0 - .4 = 1.6
    # row 1: d0 = .68, d1 = 0 + 0 (terminal: V after the last real token is 0) - .2 = -.2
    deltas = compute_td_errors(rewards, values, m, gamma)
    assert torch.allclose(deltas, t64([[0.68, 0.16, 1.6], [0.68, -0.2, 0.0]]), atol=1e-12)
    # gl = .72: A2 = 1.6, A1 = .16 + .72*1.6 = 1.312, A0 = .68 + .72*1.312 = 1.62464
    # row 1: A1 = -.2, A0 = .68 + .72*(-.2) = .536
    adv = compute_gae_advantages(rewards, values, m, gamma, lam)
    assert torch.allclose(adv, t64([[1.62464, 1.312, 1.6], [0.536, -0.2, 0.0]]), atol=1e-12)
    ret = compute_returns(adv, values, m)
    assert torch.allclose(ret, t64([[2.12464, 1.512, 2.0], [1.036, 0.0, 0.0]]), atol=1e-12)


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    g = torch.Generator().manual_seed(3)
    B, T = 4, 7
    m = right_padded_mask([0, 3, 5, 7], T)
    rewards = torch.randn(B, T, generator=g, dtype=F64)
    values = torch.randn(B, T, generator=g, dtype=F64)
    adv = compute_gae_advantages(rewards, values, m, 1.0, 1.0)
    r0 = torch.where(m, rewards, 0.0)
    to_go = r0.flip(-1).cumsum(-1).flip(-1)
    assert torch.allclose(adv, torch.where(m, to_go - values, 0.0), atol=1e-12)
    # and the returns are then the reward-to-go itself
    assert torch.allclose(compute_returns(adv, values, m), torch.where(m, to_go, 0.0), atol=1e-12)


# ----------------------------------------------------------------------------------------
# vectorised == naive loop, random shapes / seeds / right-padded masks
# ----------------------------------------------------------------------------------------


@pytest.mark.equality
@pytest.mark.parametrize("seed", range(6))
def test_vectorised_matches_naive(seed):
    """The vectorised float64 functions equal the naive Python loops (float64 too), to the
    rounding of a recursion over T steps (TD error, then GAE: 2T roundings) of terms as large
    as the rewards, values and advantages; reward shaping to two roundings."""
    g = torch.Generator().manual_seed(seed)
    for B in range(1, 6):
        for T in range(1, 10):
            lengths = random_lengths(g, B, T)
            m = right_padded_mask(lengths, T)
            rewards = torch.randn(B, T, generator=g, dtype=F64)
            values = torch.randn(B, T, generator=g, dtype=F64)
            kl = torch.randn(B, T, generator=g, dtype=F64)
            scores = torch.randn(B, generator=g, dtype=F64)
            gamma = float(torch.rand((), generator=g, dtype=F64)) * 0.5 + 0.5
            lam = float(torch.rand((), generator=g, dtype=F64))
            beta = float(torch.rand((), generator=g, dtype=F64))

            deltas = compute_td_errors(rewards, values, m, gamma)
            adv = compute_gae_advantages(rewards, values, m, gamma, lam)
            ret = compute_returns(adv, values, m)
            shaped = {
                mode: shape_rewards(scores, kl, m, beta, mode)
                for mode in ("last_token", "every_token")
            }
            size = max(rewards.abs().max(), values.abs().max(), adv.abs().max(), ret.abs().max())
            gae_tol = rounding_tol(size, 2 * T, torch.float64)
            shape_tol = rounding_tol(max(scores.abs().max(), beta * kl.abs().max()), 2, torch.float64)
            for b in range(B):
                L = int(lengths[b])
                exp_d = naive_td(rewards[b], values[b], L, gamma)
                exp_a = naive_gae(rewards[b], values[b], L, gamma, lam)
                exp_g = [exp_a[t] + float(values[b, t]) if t < L else 0.0 for t in range(T)]
                torch.testing.assert_close(deltas[b], t64(exp_d), atol=gae_tol, rtol=0, msg=str((B, T, b)))
                torch.testing.assert_close(adv[b], t64(exp_a), atol=gae_tol, rtol=0, msg=str((B, T, b)))
                torch.testing.assert_close(ret[b], t64(exp_g), atol=gae_tol, rtol=0, msg=str((B, T, b)))
                for mode, out in shaped.items():
                    exp_r = naive_shape(scores[b], kl[b], L, beta, mode)
                    torch.testing.assert_close(out[b], t64(exp_r), atol=shape_tol, rtol=0, msg=str((mode, B, T, b)))


# ----------------------------------------------------------------------------------------
# PPO policy loss
# ----------------------------------------------------------------------------------------


def test_ppo_loss_at_ratio_one_is_reinforce_gradient():
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    m = right_padded_mask([6, 0, 2, 5], T)
    old = torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    logp = old.clone().requires_grad_(True)
    loss, stats = ppo_clip_loss(logp, old, adv, m, clip_epsilon=0.2)
    loss.backward()
    N = int(m.sum())
    assert torch.allclose(logp.grad, torch.where(m, -adv / N, 0.0), atol=1e-12)
    assert loss.item() == pytest.approx(-(torch.where(m, adv, 0.0).sum() / N).item())
    assert stats.clipfrac.item() == 0.0
    assert stats.approx_kl.item() == 0.0
    assert stats.ratio_mean.item() == 1.0


def _single_token_ppo(log_ratio, adv, eps=0.2):
    logp = t64([[log_ratio]]).requires_grad_(True)
    loss, stats = ppo_clip_loss(logp, t64([[0.0]]), t64([[adv]]), torch.tensor([[True]]), eps)
    loss.backward()
    return loss.item(), logp.grad.item(), stats.clipfrac.item()


@pytest.mark.parametrize(
    "log_ratio, adv, exp_loss, grad_zero, clipped",
    [
        # A > 0: clipped (flat) only above 1 + eps
        (0.1, 1.0, -math.exp(0.1), False, 0.0),
        (1.0, 1.0, -1.2, True, 1.0),
        (-1.0, 1.0, -math.exp(-1.0), False, 0.0),
        # A < 0: clipped (flat) only below 1 - eps
        (0.1, -1.0, math.exp(0.1), False, 0.0),
        (1.0, -1.0, math.e, False, 0.0),
        (-1.0, -1.0, 0.8, True, 1.0),
    ],
)
def test_ppo_clip_known_values(log_ratio, adv, exp_loss, grad_zero, clipped):
    # ratios e^0.1, e, 1/e with advantage +-1, eps = 0.2 (torchtune-style cases)
    loss, grad, clipfrac = _single_token_ppo(log_ratio, adv)
    assert loss == pytest.approx(exp_loss)
    if grad_zero:
        assert grad == 0.0
    else:
        # unclipped branch active: d(-A * rho)/d logp = -A * rho
        assert grad == pytest.approx(-adv * math.exp(log_ratio))
    assert clipfrac == clipped


def test_ppo_clip_engages_exactly_outside_range():
    eps = 0.2
    ratios = torch.linspace(0.3, 2.0, 171, dtype=F64)
    ratios = ratios[((ratios - (1 - eps)).abs() > 1e-6) & ((ratios - (1 + eps)).abs() > 1e-6)]
    n = len(ratios)
    m = torch.ones(2, n, dtype=torch.bool)
    adv = torch.stack([torch.ones(n, dtype=F64), -torch.ones(n, dtype=F64)])
    logp = torch.log(ratios).expand(2, n).clone().requires_grad_(True)
    loss, stats = ppo_clip_loss(logp, torch.zeros(2, n, dtype=F64), adv, m, eps)
    loss.backward()
    zero_grad = logp.grad == 0
    assert torch.equal(zero_grad[0], ratios > 1 + eps)  # A > 0
    assert torch.equal(zero_grad[1], ratios < 1 - eps)  # A < 0
    expected_clipfrac = ((ratios > 1 + eps).sum() + (ratios < 1 - eps).sum()).item() / (2 * n)
    assert stats.clipfrac.item() == pytest.approx(expected_clipfrac)


def test_ppo_stats_known():
    logp = t64([[math.log(2.0), math.log(0.5), 7.0]])
    m = torch.tensor([[True, True, False]])
    _, stats = ppo_clip_loss(logp, torch.zeros(1, 3, dtype=F64), t64([[1.0, 1.0, 1.0]]), m, 0.2)
    assert stats.ratio_mean.item() == pytest.approx(1.25)
    # CleanRL approx_kl: mean((rho - 1) - log rho)
    exp_kl = ((2 - 1 - math.log(2)) + (0.5 - 1 + math.log(2))) / 2
    assert stats.approx_kl.item() == pytest.approx(exp_kl)
    assert stats.clipfrac.item() == pytest.approx(0.5)  # ratio 2 clipped for A > 0
    assert stats.outside_support_frac.item() == 0.0 and stats.dual_clipfrac is None  # dual_clip off
    _, empty = ppo_clip_loss(logp, logp, t64([[1.0, 1.0, 1.0]]), torch.zeros_like(m), 0.2)
    assert [name for name, _ in empty.items()] == ["approx_kl", "clipfrac", "ratio_mean", "outside_support_frac"]
    assert all(v.item() == 0.0 for _, v in empty.items())


# ----------------------------------------------------------------------------------------
# value loss, explained variance
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "v, v_old, g, exp_loss, exp_grad, exp_clipfrac",
    [
        # V moved past V_old + c toward G: clipped term larger -> active, grad 0
        (1.5, 1.0, 2.0, 0.5 * (1.2 - 2.0) ** 2, 0.0, 1.0),
        # within range: clip inactive, plain 0.5 * (V - G)^2
        (1.1, 1.0, 2.0, 0.5 * 0.9**2, 1.1 - 2.0, 0.0),
        # outside range but unclipped term larger (pessimistic max): unclipped gradient
        (1.5, 1.0, 0.0, 0.5 * 1.5**2, 1.5, 0.0),
        # below V_old - c, toward G: clipped term (0.8 - 0)^2 larger -> active, grad 0
        (0.5, 1.0, 0.0, 0.5 * 0.8**2, 0.0, 1.0),
        # below V_old - c, away from G: unclipped (0.5 - 2)^2 > (0.8 - 2)^2 -> unclipped grad
        (0.5, 1.0, 2.0, 0.5 * 1.5**2, 0.5 - 2.0, 0.0),
    ],
)
def test_value_loss_clip_known(v, v_old, g, exp_loss, exp_grad, exp_clipfrac):
    values = t64([[v]]).requires_grad_(True)
    mask = torch.tensor([[True]])
    loss, stats = value_loss(values, t64([[g]]), mask, old_values=t64([[v_old]]), clip=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(exp_loss)
    assert values.grad.item() == pytest.approx(exp_grad)
    assert stats["vf_clipfrac"].item() == exp_clipfrac


def test_value_loss_unclipped_and_inactive_clip():
    g = torch.Generator().manual_seed(1)
    B, T = 3, 5
    m = right_padded_mask([5, 2, 0], T)
    old = torch.randn(B, T, generator=g, dtype=F64)
    values = old + 0.05 * torch.randn(B, T, generator=g, dtype=F64)  # within clip range
    returns = torch.randn(B, T, generator=g, dtype=F64)
    plain, stats = value_loss(values, returns, m)
    mse = torch.where(m, (values - returns) ** 2, 0.0).sum() / m.sum()
    assert plain.item() == pytest.approx(0.5 * mse.item())
    assert stats["vf_clipfrac"].item() == 0.0
    clipped, stats = value_loss(values, returns, m, old_values=old, clip=0.5)
    assert clipped.item() == pytest.approx(plain.item())
    assert stats["vf_clipfrac"].item() == 0.0
    with pytest.raises(ValueError):
        value_loss(values, returns, m, clip=0.2)


def test_explained_variance():
    g = torch.Generator().manual_seed(2)
    m = right_padded_mask([4, 2, 0], 4)
    returns = torch.randn(3, 4, generator=g, dtype=F64)
    assert explained_variance(returns, returns, m).item() == pytest.approx(1.0)
    ev_zero = explained_variance(torch.zeros_like(returns), returns, m)
    assert ev_zero.item() == pytest.approx(0.0, abs=1e-12)
    v = torch.randn(3, 4, generator=g, dtype=F64)
    r, vv = returns[m], v[m]
    expected = 1 - torch.var(r - vv, unbiased=False) / torch.var(r, unbiased=False)
    assert explained_variance(v, returns, m).item() == pytest.approx(expected.item())
    assert math.isnan(explained_variance(v, torch.ones_like(v), m).item())


# ----------------------------------------------------------------------------------------
# normalizer: micro-batches sum to the full-batch loss
# ----------------------------------------------------------------------------------------


@pytest.mark.equality
@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_normalizer_micro_batches_equal_full_batch(loss_agg):
    """Three micro-batches with the full batch's normalizer sum to the full batch's loss and
    gradients (float64: the rounding of a sum over the batch's tokens)."""
    g = torch.Generator().manual_seed(4)
    B, T = 7, 6
    m = right_padded_mask([6, 0, 3, 1, 6, 4, 2], T)
    old = torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    cur = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    returns = torch.randn(B, T, generator=g, dtype=F64)
    vals = torch.randn(B, T, generator=g, dtype=F64)

    def run(slices, normalizer):
        logp = cur.clone().requires_grad_(True)
        values = vals.clone().requires_grad_(True)
        total = 0.0
        for sl in slices:
            pl, _ = ppo_clip_loss(logp[sl], old[sl], adv[sl], m[sl], 0.2, loss_agg, normalizer)
            vl, _ = value_loss(values[sl], returns[sl], m[sl], old_values=vals[sl] - 0.1, clip=0.2,
                               loss_agg=loss_agg, normalizer=normalizer)
            (pl + vl).backward()
            total = total + (pl + vl).item()
        return total, logp.grad, values.grad

    norm_tokens = 5  # token_sum_norm's constant per row
    n = {"token_mean": m.sum(), "token_sum_norm": B * norm_tokens}.get(loss_agg, m.any(-1).sum())
    full, g_logp, g_val = run([slice(0, B)], n if loss_agg == "token_sum_norm" else None)
    tokens = int(m.sum())
    # the loss's terms: -A * ratio and (V - R)^2 per token, before the division by n
    size = max((adv * cur.exp() / old.exp()).abs().max(), ((vals - returns).abs() + 0.2).square().max())
    for normalizer in (int(n), torch.tensor(float(n), dtype=F64)):
        micro, mg_logp, mg_val = run([slice(0, 2), slice(2, 3), slice(3, 7)], normalizer)
        assert micro == pytest.approx(full, abs=rounding_tol(size, tokens, torch.float64), rel=0)
        torch.testing.assert_close(mg_logp, g_logp, atol=rounding_tol(g_logp.abs().max(), tokens, torch.float64), rtol=0)
        torch.testing.assert_close(mg_val, g_val, atol=rounding_tol(g_val.abs().max(), tokens, torch.float64), rtol=0)


# ----------------------------------------------------------------------------------------
# garbage at masked positions changes nothing (values and gradients)
# ----------------------------------------------------------------------------------------


def _outputs_and_grads(fn, inputs):
    leaves = {
        k: v.clone().requires_grad_(True) if v.is_floating_point() else v
        for k, v in inputs.items()
    }
    out = fn(**leaves)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    flat = []
    for o in outs:  # a dict of stats, a loss's stats dataclass (its set fields) or a tensor
        flat.extend(o.values() if isinstance(o, dict) else [v for _, v in o.items()] if hasattr(o, "items") else [o])
    # a generic scalar objective over every output (masked outputs are 0 and finite)
    obj = sum((o.double() * (i + 1.3)).sum() for i, o in enumerate(flat) if o.requires_grad)
    grads = {}
    if torch.is_tensor(obj) and obj.requires_grad:
        obj.backward()
        grads = {k: v.grad for k, v in leaves.items() if v.is_floating_point()}
    return [o.detach() for o in flat], grads


def _check_garbage_invariance(fn, clean, garbage):
    outs_c, grads_c = _outputs_and_grads(fn, clean)
    outs_g, grads_g = _outputs_and_grads(fn, garbage)
    for a, b in zip(outs_c, outs_g):
        assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all()), (a, b)
    for k, gc in grads_c.items():
        gg = grads_g[k]
        if gc is None:
            assert gg is None
            continue
        assert torch.isfinite(gg).all(), k
        assert torch.equal(gc, gg), k


@pytest.mark.parametrize("seed", range(3))
def test_masked_garbage_changes_nothing(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, V = 4, 5, 7
    m = right_padded_mask([5, 0, 3, 1], T)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    def garb(x):
        return with_garbage(x, m, g)

    lp, old, ref, adv, vals, rets, rew, kl = (rnd(B, T) for _ in range(8))
    scores = rnd(B)
    scores_g = scores.clone()
    scores_g[1] = float("nan")  # row 1 has no real token: its score must not leak

    cases = [
        (lambda x, mask: masked_mean(x, mask), {"x": lp}),
        (lambda x, mask: masked_mean(x, mask, dim=-1), {"x": lp}),
        (lambda x, mask: masked_var(x, mask), {"x": lp}),
        (lambda x, mask: masked_whiten(x, mask), {"x": lp}),
        (lambda x, mask: masked_whiten(x, mask, shift_mean=False), {"x": lp}),
        (lambda x, mask: agg_loss(x, mask, "token_mean"), {"x": lp}),
        (lambda x, mask: agg_loss(x, mask, "seq_mean_token_mean"), {"x": lp}),
        (lambda x, mask: agg_loss(x, mask, "token_mean", normalizer=11), {"x": lp}),
        (lambda x, mask: agg_loss(x, mask, "seq_mean_token_sum"), {"x": lp}),
        (lambda x, mask: agg_loss(x, mask, "token_sum_norm", norm_tokens=7), {"x": lp}),
        (lambda a, b, mask: kl_penalty(a, b, "k1", mask=mask), {"a": lp, "b": ref}),
        (lambda a, b, mask: kl_penalty(a, b, "k2", mask=mask), {"a": lp, "b": ref}),
        (lambda a, b, mask: kl_penalty(a, b, "k3", mask=mask), {"a": lp, "b": ref}),
        (lambda k, mask: shape_rewards(scores, k, mask, 0.05), {"k": kl}),
        (lambda k, mask: shape_rewards(scores, k, mask, 0.05, "every_token"), {"k": kl}),
        (lambda r, v, mask: compute_td_errors(r, v, mask, 0.95), {"r": rew, "v": vals}),
        (lambda r, v, mask: compute_gae_advantages(r, v, mask, 0.95, 0.9), {"r": rew, "v": vals}),
        (lambda a, v, mask: compute_returns(a, v, mask), {"a": adv, "v": vals}),
        (lambda a, b, c, mask: ppo_clip_loss(a, b, c, mask, 0.2), {"a": lp, "b": old, "c": adv}),
        (lambda a, b, c, mask: ppo_clip_loss(a, b, c, mask, 0.2, "seq_mean_token_mean"),
         {"a": lp, "b": old, "c": adv}),
        (lambda a, b, c, mask: ppo_clip_loss(a, b, c, mask, 0.2, normalizer=9.0),
         {"a": lp, "b": old, "c": adv}),
        (lambda v, r, mask: value_loss(v, r, mask), {"v": vals, "r": rets}),
        (lambda v, r, o, mask: value_loss(v, r, mask, old_values=o, clip=0.2),
         {"v": vals, "r": rets, "o": old}),
        (lambda v, r, mask: explained_variance(v, r, mask), {"v": vals, "r": rets}),
    ]
    for fn, inputs in cases:
        clean = dict(inputs, mask=m)
        garbage = {k: garb(v) for k, v in inputs.items()}
        garbage["mask"] = m
        _check_garbage_invariance(fn, clean, garbage)

    # shape_rewards: a NaN score on a row with no real token
    r_clean = shape_rewards(scores, kl, m, 0.05)
    assert torch.equal(r_clean, shape_rewards(scores_g, garb(kl), m, 0.05))

    # elementwise functions without a mask: unchanged at real positions
    for kind in ("k1", "k2", "k3"):
        a = kl_penalty(lp, ref, kind)
        b = kl_penalty(garb(lp), garb(ref), kind)
        assert torch.equal(a[m], b[m])
    assert torch.equal(compute_returns(adv, vals)[m], compute_returns(garb(adv), garb(vals))[m])

    # logits-based functions: NaN/inf logits rows and out-of-range tokens at pads
    logits = torch.randn(B, T, V, generator=g)
    bad_rows = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
    idx = torch.randint(0, 4, (B, T, V), generator=g)
    logits_g = torch.where(m.unsqueeze(-1), logits, bad_rows[idx])
    tokens = torch.randint(0, V, (B, T), generator=g)
    tokens_g = torch.where(m, tokens, torch.full_like(tokens, 10_000))
    truncations = (
        {}, {"temperature": 0.7}, {"top_k": 3}, {"top_p": 0.8}, {"top_k": 4, "top_p": 0.9}
    )
    for kwargs in truncations:
        _check_garbage_invariance(
            lambda lg, tok, mask: logprobs_from_logits(lg, tok, mask=mask, **kwargs),
            {"lg": logits, "tok": tokens, "mask": m},
            {"lg": logits_g, "tok": tokens_g, "mask": m},
        )
    for temp in (1.0, 0.6):
        _check_garbage_invariance(
            lambda lg, mask: entropy_from_logits(lg, mask, temperature=temp),
            {"lg": logits, "mask": m},
            {"lg": logits_g, "mask": m},
        )
