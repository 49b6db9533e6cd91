"""The learner's wiring of every option that changes the update, checked against a
recomputation written here from the paper's formulas (no Ray, the tiny model).

learner/algos.py's own tests pin the pure functions; these check that Learner.update passes
each option to them. For one update (two PPO epochs of one minibatch and one micro-batch,
so the second optimiser step runs at a ratio away from 1 and the clips are active):

* the experience (steps 2-6): KL_t by the option's estimator, shaped rewards (last_token or
  every_token), reward whitening, GAE with the option's gamma and lambda, returns, whitened
  advantages: recomputed with loops from the old policy's full logprobs, the reference,
  the scores and the old values;
* each optimiser step's gradients (steps 7-8): a second learner with the same weights (the
  first one's, read at that step) computes the PPO-clip loss (clip_epsilon), the entropy
  bonus (entropy_coef), the value loss (value_clip) under the option's loss aggregation, and
  backpropagates; each model's gradient is clipped to max_grad_norm as torch's
  clip_grad_norm_ does. The learner's gradients (read by a spy on optimizer.step) must
  equal these, and their norms must be within max_grad_norm.

Every case also checks that its option matters: the recomputation with the option at its
default must differ from the one with the option set by far more than the tolerance, so a
learner that ignored the option would fail (checked by breaking each wiring once when this
file was written: value_clip -> None at the loss call, the entropy bonus's sign,
max_grad_norm ignored, kl_estimator ignored, clip_epsilon ignored, whiten_rewards ignored,
reward_shaping ignored, loss_agg ignored, gamma/lam swapped for the defaults).

missing_eos_penalty is not a learner option: the reward scorer applies it to the score
(tests/test_scorers.py::test_combination_weights_and_missing_eos_penalty).

Tolerances (tests/tolerances.py): float32 rounding of the tiny model's reductions at the size
of the values compared.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from learner.learner import Learner
from ppo_ray.batch import RolloutBatch
from ppo_ray.config import PPOConfig
from ppo_ray.logprobs import logprobs_from_logits
from ppo_ray.modeling import response_logits
from ppo_ray.paths import resolve_model_path
from tolerances import TINY_TERMS, grad_terms, rounding_tol

pytestmark = pytest.mark.equality

N, P, T = 8, 10, 12


@pytest.fixture(scope="module")
def tiny_path() -> str:
    return resolve_model_path("embedded:tiny")


def config(**overrides) -> PPOConfig:
    # One minibatch, one micro-batch, two epochs: two optimiser steps, the second at ratio != 1.
    # The learning rates move the ratios (median |log ratio| ~0.02 after one step) and the values
    # past small clip ranges in one step, but not all of them past the default ones.
    base = dict(model_name="embedded:tiny", lora_r=4, lora_alpha=8, lora_dropout=0.0, batch_size=N,
                mini_batch_size=N, micro_batch_size=N, ppo_epochs=2, learning_rate=3e-4, value_learning_rate=3e-2,
                temperature=0.7, top_k=0, top_p=1.0, kl_coef=0.05, seed=0)
    base.update(overrides)
    return PPOConfig(**base)


def inputs(learner: Learner) -> tuple[RolloutBatch, torch.Tensor, torch.Tensor]:
    """Random prompts and responses of varied lengths (right-padded; rows weigh differently
    under the two loss aggregations), the learner's own logprobs as the generator's, a
    reference a little off them, random scores."""
    cfg = learner.config
    g = torch.Generator().manual_seed(1)
    eos = learner.policy.config.eos_token_id
    pad = learner.policy.config.pad_token_id
    plen = torch.randint(2, P + 1, (N,), generator=g)
    prompt_mask = torch.arange(P) >= (P - plen)[:, None]                                 # (N, P)
    prompt_ids = torch.where(prompt_mask, torch.randint(0, eos, (N, P), generator=g), pad)
    rlen = torch.randint(2, T + 1, (N,), generator=g)
    rlen[0] = T
    response_mask = torch.arange(T) < rlen[:, None]                                     # (N, T)
    response_ids = torch.where(response_mask, torch.randint(0, eos, (N, T), generator=g), pad)
    batch = RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, torch.zeros(N, T), 0,
                         pad_token_id=pad, eos_token_id=eos)
    batch = replace(batch, gen_logprobs=learner.rollout_scores(batch, logprobs=True).logprobs.cpu())
    ref = torch.where(response_mask, learner.rollout_scores(batch, full=True).full_logprobs.cpu() + 0.3 * torch.randn(N, T, generator=g), 0.0)
    assert cfg.top_k == 0 and cfg.top_p == 1.0  # untruncated: every sampled token has a finite logprob
    return batch, ref, 2.0 * torch.randn(N, generator=g)


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def run_update(cfg: PPOConfig, path: str):
    """The learner's update, with a spy that reads both models' weights and (clipped)
    gradients at every optimiser step. Returns (learner, batch, ref, scores, steps, the
    update's Experience)."""
    learner = Learner(cfg, path)
    batch, ref, scores = inputs(learner)
    steps: list[dict] = []
    kept = []
    learner.experience_hook = kept.append

    def spy(optimizer, args, kwargs):  # before the policy's step; both gradients are final by then
        steps.append({name: {n: (p.detach().clone(), p.grad.detach().clone()) for n, p in trainable(model).items()}
                      for name, model in (("policy", learner.policy), ("value", learner.value_model))})

    learner.optimiser.policy_optimizer.register_step_pre_hook(spy)
    learner.update(batch, ref, scores)
    assert len(steps) == cfg.ppo_epochs
    return learner, batch, ref, scores, steps, kept[-1]


# ------------------------------------------------------------------ the recomputation
def expected_experience(cfg: PPOConfig, full_old: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor,
                        values: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Steps 2-6 with loops, in float64: KL_t, rewards, advantages (whitened), returns."""
    full_old, ref, values = full_old.double(), ref.double(), values.double()
    log_ratio = full_old - ref
    kl = {"k1": log_ratio, "k2": 0.5 * log_ratio ** 2, "k3": torch.exp(-log_ratio) + log_ratio - 1}[cfg.kl_estimator]
    kl = torch.where(mask, kl, 0.0)
    rewards = torch.zeros_like(kl)
    for i in range(len(mask)):
        n = int(mask[i].sum())
        for t in range(n):
            rewards[i, t] = -cfg.kl_coef * kl[i, t]
            if cfg.reward_shaping == "every_token" or t == n - 1:
                rewards[i, t] += float(scores[i])
    if cfg.whiten_rewards:  # scale only (N+): (r - mean) / std + mean
        real = rewards[mask]
        rewards = torch.where(mask, (rewards - real.mean()) / (real.var(unbiased=True) + 1e-8).sqrt() + real.mean(), 0.0)
    advantages = torch.zeros_like(rewards)
    for i in range(len(mask)):
        n, adv = int(mask[i].sum()), 0.0
        for t in reversed(range(n)):
            next_value = float(values[i, t + 1]) if t + 1 < n else 0.0
            adv = float(rewards[i, t]) + cfg.gamma * next_value - float(values[i, t]) + cfg.gamma * cfg.lam * adv
            advantages[i, t] = adv
    returns = torch.where(mask, advantages + values, 0.0)
    real = advantages[mask]
    whitened = torch.where(mask, (advantages - real.mean()) / (real.var(unbiased=True) + 1e-8).sqrt(), 0.0)
    return {"kl": kl, "rewards": rewards, "returns": returns, "advantages": whitened}


def aggregate(loss: torch.Tensor, mask: torch.Tensor, cfg: PPOConfig) -> torch.Tensor:
    """token_mean: every real token weighs the same; seq_mean_token_mean: every row does;
    seq_mean_token_sum: every row's sum, the mean over rows; token_sum_norm: the tokens' sum over
    rows x the constant per row (loss_agg_tokens, else max_new_tokens)."""
    mode = cfg.loss_agg
    if mode == "token_mean":
        return loss[mask].sum() / mask.sum()
    if mode == "token_sum_norm":
        return loss[mask].sum() / (len(mask) * (cfg.loss_agg_tokens or cfg.max_new_tokens))
    reduce = torch.mean if mode == "seq_mean_token_mean" else torch.sum
    rows = [reduce(loss[i][mask[i]]) for i in range(len(mask)) if mask[i].any()]
    return torch.stack(rows).mean()


def expected_gradients(cfg: PPOConfig, other: Learner, weights: dict, exp, batch: RolloutBatch) -> dict:
    """One optimiser step's gradients from the formulas: `other` (a learner with the same
    structure) set to `weights`, PPO-clip + entropy bonus and the (clipped) value loss on
    the whole minibatch, backpropagated, each model clipped to max_grad_norm."""
    for name, model in (("policy", other.policy), ("value", other.value_model)):
        params = trainable(model)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(weights[name][n][0])
                p.grad = None
    mask = exp.mask
    logits = response_logits(other.policy, batch)                                       # (N, T, V)
    logp = logprobs_from_logits(logits, batch.response_ids, cfg.temperature, cfg.top_k, cfg.top_p, mask=mask)
    ratio = torch.exp(torch.where(mask, logp - exp.old_logprobs, 0.0))
    adv = exp.advantages
    eps = cfg.clip_epsilon
    if cfg.policy_loss == "cispo":  # MiniMax-M1 eq. 4: REINFORCE weighted by sg(clip(ratio)), no lower bound
        pg = -ratio.detach().clamp(max=1 + cfg.cispo_epsilon_high) * adv * torch.where(mask, logp, 0.0)
    else:  # PPO-clip, with clip-higher's upper bound
        eps_high = eps if cfg.clip_epsilon_high is None else cfg.clip_epsilon_high
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps_high))
    policy_loss = aggregate(pg, mask, cfg)
    if cfg.entropy_coef:
        p = torch.softmax(logits.float() / cfg.temperature, dim=-1)
        entropy = -(p * torch.log_softmax(logits.float() / cfg.temperature, dim=-1)).sum(-1)   # (N, T)
        policy_loss = policy_loss - cfg.entropy_coef * aggregate(entropy, mask, cfg)
    policy_loss.backward()
    v = other.value_model(batch)                                                         # (N, T)
    v_loss = (v - exp.returns) ** 2
    if cfg.value_clip is not None:
        clipped = exp.values + (v - exp.values).clamp(-cfg.value_clip, cfg.value_clip)
        v_loss = torch.maximum(v_loss, (clipped - exp.returns) ** 2)
    (0.5 * aggregate(v_loss, mask, cfg)).backward()
    out = {}
    for name, model in (("policy", other.policy), ("value", other.value_model)):
        grads = {n: p.grad.detach().clone() for n, p in trainable(model).items()}
        norm = torch.cat([g.flatten() for g in grads.values()]).norm()
        if cfg.max_grad_norm is not None and norm > cfg.max_grad_norm:  # torch's rule: scale by max / (norm + 1e-6)
            grads = {n: g * (cfg.max_grad_norm / (norm + 1e-6)) for n, g in grads.items()}
        out[name] = grads
    return out


def grad_tol(grads: dict, tokens: int) -> float:
    return rounding_tol(max(g.abs().max() for g in grads.values()), grad_terms(tokens))


# ------------------------------------------------------------------ the cases
UNCLIPPED = {"max_grad_norm": None}
CASES = [
    pytest.param({}, {}, id="defaults"),  # value_clip 0.2, token_mean, k1, ...
    pytest.param({"value_clip": None}, {}, id="value_clip-off"),
    pytest.param({"value_clip": 0.01}, {}, id="value_clip-0.01"),
    pytest.param({"entropy_coef": 0.5}, {}, id="entropy_coef"),
    pytest.param({"kl_estimator": "k2"}, {}, id="kl-k2"),
    pytest.param({"kl_estimator": "k3"}, {}, id="kl-k3"),
    pytest.param({"clip_epsilon": 1e-4}, {}, id="clip_epsilon"),
    pytest.param({"whiten_rewards": True}, {}, id="whiten_rewards"),
    pytest.param({"reward_shaping": "every_token"}, {}, id="every_token"),
    pytest.param({"loss_agg": "seq_mean_token_mean"}, {}, id="seq_mean_token_mean"),
    # the aggregations below scale token_mean's gradient (all rows' tokens summed over another
    # count), which max_grad_norm's clip would undo: they run unclipped
    pytest.param({"loss_agg": "seq_mean_token_sum"}, UNCLIPPED, id="seq_mean_token_sum"),
    pytest.param({"loss_agg": "token_sum_norm"}, UNCLIPPED, id="token_sum_norm"),
    pytest.param({"loss_agg": "token_sum_norm", "loss_agg_tokens": 3}, UNCLIPPED, id="token_sum_norm-3"),
    pytest.param({"clip_epsilon_high": 1e-4}, {}, id="clip_epsilon_high"),
    pytest.param({"policy_loss": "cispo", "cispo_epsilon_high": 1e-3}, {}, id="cispo"),
    pytest.param({"gamma": 0.9, "lam": 0.7}, {}, id="gamma-lam"),
    pytest.param({"max_grad_norm": 1e-3}, {}, id="max_grad_norm"),
]


@pytest.mark.parametrize("option, base", CASES)
def test_update_follows_its_options(tiny_path, option, base):
    """option: the settings under test; base: other settings the case runs with (the
    comparison below sets only option's back to their defaults)."""
    cfg = config(**base, **option)
    learner, batch, ref, scores, steps, exp = run_update(cfg, tiny_path)
    mask = exp.mask
    other = Learner(cfg, tiny_path)  # same seed: the same initial weights as the learner's
    full_old = other.rollout_scores(batch, full=True).full_logprobs.cpu()  # the policy before the update, untruncated
    # (the old values themselves are checked state by state in tests/test_learner.py::check_wiring)

    # steps 2-6: the experience
    want = expected_experience(cfg, full_old, ref, scores, exp.values, mask)
    size = max(want["returns"].abs().max(), want["rewards"].abs().max(), full_old[mask].abs().max())
    tol = rounding_tol(size, TINY_TERMS + 2 * T)  # the logprobs' reductions, then GAE's 2T roundings
    for key in ("kl", "rewards", "returns"):
        torch.testing.assert_close(getattr(exp, key).double()[mask], want[key][mask], rtol=0, atol=tol, msg=key)
    adv_tol = tol / want["advantages"][mask].std().item() * 4 + rounding_tol(want["advantages"].abs().max(), N * T)
    torch.testing.assert_close(exp.advantages.double()[mask], want["advantages"][mask], rtol=0, atol=adv_tol)

    # steps 7-8: every optimiser step's gradients, after clipping
    tokens = int(mask.sum())
    for k, weights in enumerate(steps):
        expected = expected_gradients(cfg, other, weights, exp, batch)
        for name in ("policy", "value"):
            got = {n: g for n, (_, g) in weights[name].items()}
            tol = grad_tol(expected[name], tokens)
            for n, g in got.items():
                torch.testing.assert_close(g, expected[name][n], rtol=0, atol=tol, msg=f"step {k + 1} {name} {n}")
            if cfg.max_grad_norm is not None:
                norm = torch.cat([g.flatten() for g in got.values()]).norm().item()
                assert norm <= cfg.max_grad_norm * (1 + 1e-5), f"step {k + 1} {name} gradient norm {norm}"

    # The option matters: recomputed with it at its default, the experience or a step's
    # gradients move by far more than their tolerance, so a learner ignoring it would fail.
    if option:
        default = config(**base, **{k: getattr(PPOConfig, k) for k in option})
        default_exp = expected_experience(default, full_old, ref, scores, exp.values, mask)
        moved = [max((default_exp[k] - want[k]).abs()[mask].max().item() for k in want) / tol]
        for weights in steps:
            mine = expected_gradients(cfg, other, weights, exp, batch)
            theirs = expected_gradients(default, other, weights, replace_advantages(exp, default_exp), batch)
            moved += [max((theirs[m][n] - mine[m][n]).abs().max().item() for n in mine[m]) / grad_tol(mine[m], tokens)
                      for m in ("policy", "value")]
        assert max(moved) > 10, f"{option} changes nothing this test can see (in tolerances: {moved})"


def replace_advantages(exp, want: dict):
    """The experience with another option's advantages and returns (float32, as the learner's)."""
    return replace(exp, advantages=want["advantages"].float(), returns=want["returns"].float())
