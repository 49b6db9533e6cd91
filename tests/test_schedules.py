"""The adaptive KL controller (kl_target, kl_horizon) and the PPO learning-rate schedule
(lr_scheduler), in the Learner itself (no Ray, no vLLM).

The KL test runs the tiny preset (configs/tiny.yaml: the embedded tiny model, the
letter-"e" reward x 10, lr 3e-3, kl_coef 0.05) as a PPO loop with HF generate as the
sampler and the policy's own base (adapter disabled) as the reference, twice from the same
seed: with the fixed kl_coef the KL to the reference climbs past 1 nat within a few steps;
with kl_target set the controller raises the coefficient and holds the KL closer to the
target. About 15 s on the 2-core development VM.
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
from ppo_ray.modeling import load_tokenizer, resolve_model_path
from ppo_ray.rewards import letter_e_fraction

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
        logprobs = learner.logprobs(batch)
        batch = replace(batch, gen_logprobs=torch.where(torch.isfinite(logprobs), logprobs, 0.0))
        with learner.policy.disable_adapter():
            ref = learner.full_logprobs(batch)
        completions = tok.batch_decode([r[m] for r, m in zip(response_ids, mask)], skip_special_tokens=True)
        scores = 10.0 * torch.tensor(letter_e_fraction(texts, completions))
        stats, _ = learner.update(batch, ref, scores)
        history.append(stats)
    return history


def test_adaptive_kl_controller_moves_kl_toward_the_target_on_the_tiny_preset(tiny_path):
    steps, target = 8, 0.5
    fixed = ppo_loop(tiny_preset(), tiny_path, steps)
    # kl_horizon of a few rollouts: a fast controller, so a short run shows its effect
    adaptive = ppo_loop(tiny_preset(kl_target=target, kl_horizon=8), tiny_path, steps)
    kl_fixed = [h["kl"] for h in fixed]
    kl_adaptive = [h["kl"] for h in adaptive]
    betas = [h["kl_coef"] for h in adaptive]
    assert all(h["kl_coef"] == 0.05 for h in fixed), "kl_target unset: the seeds' fixed coefficient"
    # the same first step (same seed, same beta), then the controller acts
    assert kl_adaptive[0] == pytest.approx(kl_fixed[0], abs=1e-6) and betas[0] == 0.05
    assert max(kl_fixed[-3:]) > 2 * target, f"the fixed run should overshoot the target: {kl_fixed}"
    # while the KL is above the target the coefficient rises, step after step
    for b0, b1, kl in zip(betas, betas[1:], kl_adaptive):
        assert (b1 > b0) if kl > target else (b1 < b0), (betas, kl_adaptive)
    # ... and the last steps' KL is closer to the target than the fixed coefficient's
    late_fixed = sum(kl_fixed[-3:]) / 3
    late_adaptive = sum(kl_adaptive[-3:]) / 3
    assert abs(late_adaptive - target) < abs(late_fixed - target) and late_adaptive < late_fixed, \
        (kl_fixed, kl_adaptive, betas)


# ----------------------------------------------------------------------------- lr schedule
def test_linear_lr_decays_to_zero_and_resumes_from_a_checkpoint(tiny_path, tmp_path):
    """lr_scheduler: linear ticks once per optimiser step (steps x ppo_epochs x minibatches
    in all: here 3 x 2 x 2 = 12) to 0 at the run's end, for both optimisers; a checkpoint
    holds the schedule, so a learner restored from it continues where it was."""
    from ppo_ray.checkpoint import load_checkpoint, save_checkpoint

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
        lrs.append(stats["learning_rate"])
    total = 3 * 2 * 2
    assert lrs == pytest.approx([cfg.learning_rate * (1 - k / total) for k in (0, 4, 8)])
    assert a.policy_optimizer.param_groups[0]["lr"] == 0.0 and a.value_optimizer.param_groups[0]["lr"] == 0.0

    b = Learner(cfg, tiny_path)
    _, state, _ = load_checkpoint(tmp_path, cfg)
    b.load_state_dict(state)
    stats, _ = b.update(replace(inputs[1][0], adapter_version=b.version), *inputs[1][1:])
    assert stats["learning_rate"] == pytest.approx(lrs[1])
    assert b.value_optimizer.param_groups[0]["lr"] == pytest.approx(cfg.value_learning_rate * (1 - 8 / total))

    constant = Learner(tiny_preset(steps=3, batch_size=4, mini_batch_size=2, micro_batch_size=2), tiny_path)
    stats, _ = constant.update(*_random_inputs(constant, tiny_path, 0))
    assert stats["learning_rate"] == cfg.learning_rate
    assert constant.policy_optimizer.param_groups[0]["lr"] == cfg.learning_rate  # the default: constant


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
    logprobs = learner.logprobs(batch)
    batch = replace(batch, gen_logprobs=torch.where(torch.isfinite(logprobs), logprobs, 0.0))
    ref = learner.full_logprobs(batch) + 0.1 * torch.randn(b, t, generator=g)
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
