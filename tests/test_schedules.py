"""The adaptive KL controller (kl_target, kl_horizon) and the PPO learning-rate schedule
(lr_scheduler), in the Learner itself (no Ray, no vLLM).

The KL test runs the tiny preset (configs/tiny.yaml: the embedded tiny model, the
letter-"e" reward x 10, lr 3e-3) as a PPO loop with HF generate as the sampler and the
policy's own base (adapter disabled) as the reference, twice from the same seed with targets
below and above the KL the preset reaches: 2 x 20 steps, about 20 s on the 2-core
development VM.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from learner.algos import adaptive_kl_coef, response_mask_from_ids
from learner.learner import Learner
from ppo_ray.batch import RolloutBatch
from ppo_ray.config import PPOConfig
from ppo_ray.data import bundled_prompts, encode_prompts
from ppo_ray.modeling import load_tokenizer
from ppo_ray.paths import resolve_model_path
from ppo_ray.rewards import letter_e_fraction
from tolerances import rounding_tol

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's matmuls are too small for intra-op threads
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_path() -> str:
    return resolve_model_path("embedded:tiny")


def tiny_preset(**overrides) -> PPOConfig:
    # short prompts keep the loop fast; the rest is the preset's
    base = dict(batch_size=8, max_new_tokens=12, max_prompt_length=48, steps=8)
    base.update(overrides)
    return PPOConfig.from_yaml(ROOT / "configs" / "tiny.yaml", **base)


# ----------------------------------------------------------------------------- the rule
def test_adaptive_kl_rule_moves_beta_toward_the_target_and_is_clipped():
    # KL above the target raises beta, below lowers it; the error is clipped to +-20%
    assert adaptive_kl_coef(0.1, kl=6.0, target=6.0, horizon=10000, n_steps=512) == 0.1
    up = adaptive_kl_coef(0.1, kl=6.6, target=6.0, horizon=10000, n_steps=512)
    assert up == pytest.approx(0.1 * (1 + 0.1 * 512 / 10000))
    down = adaptive_kl_coef(0.1, kl=3.0, target=6.0, horizon=10000, n_steps=512)
    assert down == pytest.approx(0.1 * (1 - 0.2 * 512 / 10000))  # -50% clipped to -20%
    assert adaptive_kl_coef(0.1, kl=100.0, target=6.0, horizon=512, n_steps=512) == pytest.approx(0.12)


# ----------------------------------------------------------------------------- tiny preset
def ppo_loop(cfg: PPOConfig, path: str, steps: int) -> list[dict]:
    """`steps` PPO updates of a Learner: rollouts sampled with HF generate from the policy,
    the reference = the policy's base (LoRA disabled), scores = the preset's reward."""
    learner = Learner(cfg, path)
    tok = load_tokenizer(path)
    prompts = bundled_prompts()
    history = []
    for step in range(steps):
        texts = [prompts[(step * cfg.batch_size + i) % len(prompts)] for i in range(cfg.batch_size)]
        ids = encode_prompts(tok, texts, cfg.max_prompt_length, "left")
        p = max(map(len, ids))
        prompt_ids = torch.tensor([[tok.pad_token_id] * (p - len(x)) + x for x in ids])  # (B, P) left-padded
        prompt_mask = prompt_ids != tok.pad_token_id
        torch.manual_seed(1000 + step)
        with torch.no_grad():
            out = learner.policy.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask.long(), do_sample=True,
                temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        response_ids = out[:, p:]
        mask = response_mask_from_ids(response_ids, tok.eos_token_id, tok.pad_token_id)
        response_ids = torch.where(mask, response_ids, tok.pad_token_id)
        batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                             response_mask=mask, gen_logprobs=torch.zeros(response_ids.shape),
                             adapter_version=learner.version, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
        logprobs = learner.rollout_scores(batch, logprobs=True).logprobs.cpu()
        batch = replace(batch, gen_logprobs=torch.where(torch.isfinite(logprobs), logprobs, 0.0))
        with learner.policy.disable_adapter():
            ref = learner.rollout_scores(batch, full=True).full_logprobs.cpu()
        completions = tok.batch_decode([r[m] for r, m in zip(response_ids, mask)], skip_special_tokens=True)
        scores = 10.0 * torch.tensor(letter_e_fraction(texts, completions))
        stats, _ = learner.update(batch, ref, scores)
        history.append(stats)
    return history


def test_adaptive_kl_controller_moves_kl_toward_the_target_on_the_tiny_preset(tiny_path):
    """Two runs of the tiny preset from the same seed and the same starting coefficient
    (0.5), one with a target far below the KL the preset reaches (0.5 nats), one far above
    it (25): the controller raises beta in the first and lowers it in the second, step by
    step (at most 20% a step: kl_horizon = batch size), each step's beta is the one that
    shapes that step's rewards, and the first run's KL ends lower, i.e. each run's KL moves
    toward its target relative to the other.

    Rounding (another CPU) changes the sampled trajectories from the first steps on, so the
    test asserts what holds on any trajectory: the rule applied to each step's KL, its
    direction (the KL is far from both targets after the first step: the side is never a
    rounding question), and the shaping identity shaped_reward_mean = score_mean - beta * kl
    of every step (float32 rounding of sums over T tokens and B rows). The KL comparison is a
    property of the trajectory: per-step KL is noisy (+-2 nats from step to step) and the
    betas part slowly (x1.2 against x0.8 a step), so 10 steps could not tell (the last 4
    steps' mean KL of the low-target run was 0.61 to 0.98 of the other's over six sampling
    seeds). It compares the means of the last 8 of 20 steps, when the betas are ~1000x apart
    (~10 vs ~0.01): 0.31 to 0.67 of the other's over the same six seeds (0.65 with this
    test's), and it must be below 0.9. A beta that did not reach the rewards gives both runs
    the same trajectory (equal KL); one with the wrong sign, a higher KL: both fail."""
    steps, horizon = 20, 8
    low = ppo_loop(tiny_preset(kl_coef=0.5, kl_target=0.5, kl_horizon=horizon), tiny_path, steps)
    high = ppo_loop(tiny_preset(kl_coef=0.5, kl_target=25.0, kl_horizon=horizon), tiny_path, steps)
    preset = tiny_preset()
    terms = preset.max_new_tokens + preset.batch_size  # a row's sum over its tokens, then the mean over rows
    for run, target in ((low, 0.5), (high, 25.0)):
        kls, betas = [h.kl for h in run], [h.kl_coef for h in run]
        assert betas[0] == 0.5
        for b0, b1, kl in zip(betas, betas[1:], kls):  # the rule, applied after every step
            assert b1 == pytest.approx(adaptive_kl_coef(b0, kl, target, horizon, 8))
            assert (b1 > b0) if kl > target else (b1 < b0), (target, kls, betas)
        for h in run:  # the step's beta shapes its rewards: per row, score - beta * sum_t KL_t
            size = abs(h.score_mean) + h.kl_coef * abs(h.kl)
            assert h.shaped_reward_mean == pytest.approx(h.score_mean - h.kl_coef * h.kl, abs=rounding_tol(size, terms))
    # the first step (KL 0, both below target) lowers both betas alike; then they part
    assert low[-1].kl_coef > 1.0 > 0.1 > high[-1].kl_coef
    late_low = sum(h.kl for h in low[-8:]) / 8
    late_high = sum(h.kl for h in high[-8:]) / 8
    assert late_low < 0.9 * late_high, ([h.kl for h in low], [h.kl for h in high])


# ----------------------------------------------------------------------------- lr schedule
def test_linear_lr_decays_to_zero_and_resumes_from_a_checkpoint(tiny_path, tmp_path):
    """lr_scheduler: linear ticks once per optimiser step (steps x ppo_epochs x minibatches
    in all: here 3 x 2 x 2 = 12) to 0 at the run's end, for both optimisers; a checkpoint
    holds the schedule, so a learner restored from it continues where it was."""
    from ppo_ray.driver.checkpoint import load_checkpoint, save_checkpoint

    cfg = tiny_preset(lr_scheduler="linear", steps=3, batch_size=4, mini_batch_size=2, micro_batch_size=2,
                      ppo_epochs=2, max_new_tokens=6)
    a = Learner(cfg, tiny_path)
    inputs = [_random_inputs(a, tiny_path, seed) for seed in range(3)]
    lrs = []
    for i, (batch, ref, scores) in enumerate(inputs):
        if i == 1:
            save_checkpoint(tmp_path, config=cfg, learner_state=a.state_dict(), model_dir=tiny_path,
                            trainer_state={"step": 1, "order": [], "data_rng": torch.Generator().get_state()})
        stats, _ = a.update(replace(batch, adapter_version=a.version), ref, scores)
        lrs.append(stats.learning_rate)
    total = 3 * 2 * 2
    assert lrs == pytest.approx([cfg.learning_rate * (1 - k / total) for k in (0, 4, 8)])
    assert a.optimiser.policy_optimizer.param_groups[0]["lr"] == 0.0 and a.optimiser.value_optimizer.param_groups[0]["lr"] == 0.0

    b = Learner(cfg, tiny_path)
    _, state, _ = load_checkpoint(tmp_path, cfg)
    b.load_state_dict(state)
    stats, _ = b.update(replace(inputs[1][0], adapter_version=b.version), *inputs[1][1:])
    assert stats.learning_rate == pytest.approx(lrs[1])
    assert b.optimiser.value_optimizer.param_groups[0]["lr"] == pytest.approx(cfg.value_learning_rate * (1 - 8 / total))

    constant = Learner(tiny_preset(steps=3, batch_size=4, mini_batch_size=2, micro_batch_size=2), tiny_path)
    stats, _ = constant.update(*_random_inputs(constant, tiny_path, 0))
    assert stats.learning_rate == cfg.learning_rate
    assert constant.optimiser.policy_optimizer.param_groups[0]["lr"] == cfg.learning_rate  # the default: constant


def _random_inputs(learner: Learner, path: str, seed: int) -> tuple:
    """(batch, ref logprobs, scores): random tokens with the learner's own logprobs as the
    generator's, a reference a little off them, random scores."""
    tok = load_tokenizer(path)
    g = torch.Generator().manual_seed(seed)
    b, p, t = learner.config.batch_size, 6, learner.config.max_new_tokens
    vocab = tok.eos_token_id  # ids below the special tokens
    prompt_ids = torch.randint(0, vocab, (b, p), generator=g)
    response_ids = torch.randint(0, vocab, (b, t), generator=g)
    batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=torch.ones(b, p, dtype=torch.bool),
                         response_ids=response_ids, response_mask=torch.ones(b, t, dtype=torch.bool),
                         gen_logprobs=torch.zeros(b, t), adapter_version=learner.version,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    logprobs = learner.rollout_scores(batch, logprobs=True).logprobs.cpu()
    batch = replace(batch, gen_logprobs=torch.where(torch.isfinite(logprobs), logprobs, 0.0))
    ref = learner.rollout_scores(batch, full=True).full_logprobs.cpu() + 0.1 * torch.randn(b, t, generator=g)
    return batch, ref, torch.randn(b, generator=g)


def test_kl_coef_is_part_of_the_learner_state(tiny_path):
    """A learner restored from another's state (a retried step, a resumed run) continues with
    its adaptive coefficient, not the config's."""
    cfg = tiny_preset(kl_target=0.01, kl_horizon=4, steps=2, batch_size=4, mini_batch_size=4,
                      micro_batch_size=4, ppo_epochs=1, max_new_tokens=6)
    a = Learner(cfg, tiny_path)
    a.update(*_random_inputs(a, tiny_path, 0))
    assert a.kl_coef != cfg.kl_coef and math.isfinite(a.kl_coef)
    b = Learner(cfg, tiny_path)
    b.load_state_dict(a.state_dict())
    assert b.kl_coef == a.kl_coef


def test_the_linear_schedule_follows_the_runs_planned_total(tiny_path):
    """train() past config.steps used to train at learning rate 0 (the decay had ended),
    and a resume with another `steps` rescaled the decay silently. The schedule is now
    1 - t / T for the run's planned total T, which the driver passes with every update
    (planned_steps; it logs a change): here planned 2 steps, then extended to 4 after the
    second. The plan travels with the learner's state (a restored learner continues it)."""
    cfg = tiny_preset(lr_scheduler="linear", steps=2, batch_size=4, mini_batch_size=2, micro_batch_size=2,
                      ppo_epochs=2, max_new_tokens=6)
    a = Learner(cfg, tiny_path)
    ticks = 2 * 2  # optimiser steps per PPO step: ppo_epochs x minibatches
    lrs = []
    for step, planned in enumerate((None, None, 4, 4)):
        batch, ref, scores = _random_inputs(a, tiny_path, step)
        stats, _ = a.update(batch, ref, scores, planned_steps=planned)
        lrs.append(stats.learning_rate)
        if step == 2:
            state = a.state_dict()
    total = [2 * ticks] * 2 + [4 * ticks] * 2
    assert lrs == pytest.approx([cfg.learning_rate * (1 - step * ticks / t) for step, t in zip(range(4), total)])
    assert lrs[2] > 0 and lrs[3] > 0
    b = Learner(cfg, tiny_path)
    b.load_state_dict(state)
    stats, _ = b.update(*_random_inputs(b, tiny_path, 3))  # no planned_steps: the restored plan (4 steps)
    assert stats.learning_rate == pytest.approx(lrs[3])


def test_a_resume_applies_the_configs_rates_and_fixed_kl_coef_over_the_restored_state(tiny_path):
    """A resume with --learning_rate, --value_learning_rate, --lr_scheduler or a fixed --kl_coef
    used to be shadowed without a word by the restored Adam/schedule state and KL coefficient.
    The restored state keeps its position (the schedule's tick, Adam's moments); the rates, the
    schedule's kind and a fixed coefficient are the config's. An adaptive coefficient
    (kl_target) is the controller's state and continues."""
    base = dict(steps=4, batch_size=4, mini_batch_size=2, micro_batch_size=2, ppo_epochs=2, max_new_tokens=6)
    a = Learner(tiny_preset(**base), tiny_path)
    a.update(*_random_inputs(a, tiny_path, 0))
    state = a.state_dict()
    ticks = 2 * 2  # one PPO step done: ppo_epochs x minibatches optimiser steps
    cfg = tiny_preset(**base, learning_rate=1e-4, value_learning_rate=2e-4, lr_scheduler="linear", kl_coef=0.3)
    b = Learner(cfg, tiny_path)
    b.load_state_dict(state)
    assert b.kl_coef == 0.3  # the config's fixed coefficient (the checkpoint's was the preset's)
    factor = 1 - ticks / (4 * ticks)  # linear, from the restored tick, over the run's 4 planned steps
    assert b.optimiser.policy_optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 * factor)
    assert b.optimiser.value_optimizer.param_groups[0]["lr"] == pytest.approx(2e-4 * factor)
    assert b.optimiser.schedulers[0].last_epoch == ticks  # the position is the state's
    stats, _ = b.update(*_random_inputs(b, tiny_path, 1))
    assert stats.learning_rate == pytest.approx(1e-4 * factor)

    adaptive = tiny_preset(**base, kl_target=0.01, kl_horizon=4)
    c = Learner(adaptive, tiny_path)
    c.update(*_random_inputs(c, tiny_path, 0))
    d = Learner(adaptive, tiny_path)
    d.load_state_dict(c.state_dict())
    assert d.kl_coef == c.kl_coef != adaptive.kl_coef
