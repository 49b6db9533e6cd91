"""Learner (policy LoRA + value model, PPO update), ValueModel and ExperienceBuffer.

No Ray, no vLLM: the embedded tiny Qwen3, rollouts built by hand (random tokens, left-padded
prompts of different lengths, right-padded responses, some ending in EOS) or sampled from
the policy itself with HF generate; gen_logprobs are the learner's own logprobs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import replace

import pytest
import torch

from learner.buffer import Experience, ExperienceBuffer
from learner.flops import decoder_shape, update_flops
from ppo_ray.batch import TrimPlan, rollout_micro_batches
from learner.learner import Learner, StaleRolloutsError, disable_dropout
from learner.value_model import ValueModel
from ppo_ray.batch import RolloutBatch
from ppo_ray.config import PPOConfig
from ppo_ray.modeling import LoraSpec
from helpers import (MEASURED_STATS, TINY_MODEL, assert_same_update, keep_experience, logprob_tol, make_config,
                     max_abs_diff, random_batch, rollout_inputs, token_mean_tol, update_tols, value_params, with_sgd)
from tolerances import TINY_TERMS, rounding_tol

STAT_KEYS = {
    "policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "ratio_mean",
    "first_minibatch_ratio_mean", "vf_clipfrac", "explained_variance", "kl", "kl_per_token",
    "score_mean", "shaped_reward_mean", "advantage_mean", "return_mean", "value_mean",
    "policy_grad_norm", "value_grad_norm", "gen_logprob_max_abs_diff", "truncated_tokens", "gen_logprob_gap_tokens",
    "dropped_samples", "tokens", "learner_forward_s", "update_s", "version", "outside_support_frac",
    "behaviour_logprob_gap", "stale_versions", "padded_token_ratio", "kl_coef", "learning_rate",
    "learner_peak_memory_gib", "mismatch_outside_frac", "mismatch_log_ratio_abs", "learner_flops",
    "learner_peak_flops_per_s",
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matmuls are too small for intra-op threads: one thread is ~5x
    faster on a shared 2-core machine (and deterministic reductions either way)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def sampled_batch(learner: Learner, special, n=8, p=10, t=16, seed=0, full_length=False) -> RolloutBatch:
    """Rollouts sampled from the learner's policy with HF generate (the config's temperature,
    top-k and top-p), then cut to random lengths (prefixes of samples are samples)."""
    from learner.algos import response_mask_from_ids

    eos, pad = special
    cfg = learner.config
    prompts = random_batch(special, n=n, p=p, t=1, seed=seed)
    torch.manual_seed(seed)  # generate samples with the global RNG
    with torch.no_grad():
        out = learner.policy.generate(
            input_ids=prompts.prompt_ids, attention_mask=prompts.prompt_mask.long(), do_sample=True,
            temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, max_new_tokens=t,
            min_new_tokens=t, pad_token_id=pad, eos_token_id=eos)
    response_ids = out[:, p:]
    mask = response_mask_from_ids(response_ids, eos, pad)
    g = torch.Generator().manual_seed(seed + 1)
    cut = torch.randint(1, response_ids.shape[1] + 1, (n,), generator=g)
    if full_length:
        cut[:] = response_ids.shape[1]
    cut[0] = response_ids.shape[1]
    mask &= torch.arange(response_ids.shape[1]) < cut[:, None]
    response_ids = torch.where(mask, response_ids, pad)
    batch = replace(prompts, response_ids=response_ids, response_mask=mask,
                    gen_logprobs=torch.zeros(response_ids.shape), adapter_version=learner.version)
    # HF generate's cached logits differ from a full forward by float rounding, so a token
    # sampled at the top-k/top-p boundary can fall outside the learner's truncation (-inf).
    # Cut such rows just before it: the tests below then need no tolerance for it.
    logprobs = learner.rollout_scores(batch, logprobs=True).logprobs.cpu()
    bad = batch.response_mask & ~torch.isfinite(logprobs)
    first_bad = torch.where(bad, torch.arange(bad.shape[1]), bad.shape[1]).amin(dim=1)
    mask = batch.response_mask & (torch.arange(bad.shape[1]) < first_bad[:, None])
    batch = replace(batch, response_ids=torch.where(mask, batch.response_ids, pad), response_mask=mask)
    return replace(batch, gen_logprobs=torch.where(mask, logprobs, 0.0))


# ------------------------------------------------------------------ the update
def test_a_cpu_peak_timed_under_load_is_raised_to_the_rate_an_update_reached(tiny_path, special):
    """The CPU's peak FLOP/s is one matmul timed at the first update; timed while other
    processes held the cores it is too low, and learner_mfu read 130-170% (a DAPO run beside
    three others, 2026-11-29). An update that computes faster than the peak raises it to its own
    rate, so learner_mfu never exceeds 1; a peak above the update's rate stays as it was."""
    from ppo_ray.stats import StepResult, StepTiming

    learner = Learner(make_config(), tiny_path)
    learner._peak_flops = 1.0  # "measured" while the cores were busy: 1 FLOP/s
    stats, _ = learner.update(*rollout_inputs(learner, random_batch(special)))
    rate = stats.learner_flops / stats.update_s
    assert stats.learner_peak_flops_per_s == pytest.approx(rate) and learner.peak_flops_per_s() == pytest.approx(rate)
    timing = StepTiming(**{f.name: 0.0 for f in dataclasses.fields(StepTiming)} | {"update_s": stats.update_s})
    assert StepResult.rates(timing, stats, 1)["learner_mfu"] == pytest.approx(1.0)
    learner._peak_flops = high = 1e30
    stats, _ = learner.update(*rollout_inputs(learner, random_batch(special)))
    assert stats.learner_peak_flops_per_s == high


@pytest.mark.equality
def test_update_runs_and_changes_only_lora(tiny_path, special):
    learner = Learner(make_config(), tiny_path)
    kept = keep_experience(learner)
    with torch.no_grad():  # a head that is not 0, so the old values below say something
        learner.value_model.head.weight.copy_(torch.randn(learner.value_model.head.weight.shape,
                                                          generator=torch.Generator().manual_seed(7)))
    batch, ref, scores = rollout_inputs(learner, random_batch(special))
    value_model_before = copy.deepcopy(learner.value_model)
    base_before = {n: p.detach().clone() for n, p in learner.policy.named_parameters() if not p.requires_grad}
    vbase_before = {n: p.detach().clone() for n, p in learner.value_model.named_parameters()
                    if not p.requires_grad}
    lora_before = learner.lora_weights().tensors
    head_before = learner.value_model.head.weight.detach().clone()
    assert learner.version == 0

    stats, adapter = learner.update(batch, ref, scores)
    weights = adapter.tensors

    assert set(stats.as_dict()) == STAT_KEYS
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for k, v in stats.as_dict().items()
               if k not in MEASURED_STATS), stats
    cuda = learner.device.type == "cuda"
    assert stats.learner_peak_memory_gib > 0 if cuda else math.isnan(stats.learner_peak_memory_gib)
    assert learner.version == 1 and stats.version == 1
    assert stats.tokens == float(batch.response_mask.sum())
    # the update's model FLOPs (learner.flops, counted by hand in test_flops.py) on its real
    # tokens, of the passes it ran (version 0: the policy's no-grad pass; the value model's
    # unless its old values came from the update); the CPU's peak is a measured matmul rate
    shape = decoder_shape(learner.policy.get_base_model().config)
    flops = update_flops(shape, batch.prompt_mask.sum(1).tolist(), batch.response_mask.sum(1).tolist(),
                         ppo_epochs=learner.config.ppo_epochs, lora_r=learner.config.lora_r,
                         lora_targets=learner.config.lora_target_modules, value_model="separate",
                         values_in_update=learner.values_in_update(len(batch)), recomputed=True)
    assert stats.learner_flops == flops["learner_forward"] + flops["update"] > 0
    if not cuda:
        assert stats.learner_peak_flops_per_s > 0
    assert stats.truncated_tokens == 0 and stats.gen_logprob_gap_tokens == 0
    # the generator's logprobs (here the learner's own, from logprobs()) vs the update's pass
    assert stats.gen_logprob_max_abs_diff < logprob_tol(batch.gen_logprobs, batch.response_mask)
    assert stats.kl != 0.0
    # The wiring of steps 2-6, against computations that share no code with the learner's.
    exp, mask = kept[-1], batch.response_mask
    check_wiring(learner.config, value_model_before, batch, scores, exp)
    # Exported adapter: PEFT key format, CPU, contiguous copies, and it changed.
    assert weights.keys() == lora_before.keys()
    assert all(k.startswith("base_model.model.") and (".lora_A.weight" in k or ".lora_B.weight" in k)
               for k in weights)
    assert all(v.device.type == "cpu" and v.is_contiguous() for v in weights.values())
    assert max_abs_diff(weights, lora_before) > 0
    assert all(weights[k].data_ptr() != p.data_ptr() for k, p in learner.lora_weights().tensors.items())
    # Only LoRA (and the value head) moved; base weights are bit-identical.
    for n, p in learner.policy.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base_before[n]), n
    for n, p in learner.value_model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, vbase_before[n]), n
    assert not torch.equal(learner.value_model.head.weight, head_before)
    # ... and it travels with its spec, read from the policy's PEFT config
    assert adapter.spec == LoraSpec(4, 8, tuple(sorted(learner.config.lora_target_modules)), 0.0)


def check_wiring(cfg: PPOConfig, vm: ValueModel, batch: RolloutBatch, scores, exp) -> None:
    """Steps 2-6 of the update, recomputed row by row with plain loops:
    * rewards: -beta * KL_t on every real token, plus the score on the row's LAST real token
      (an index found here, not the learner's), 0 on padding;
    * old values: V(s_t) from `vm` (the value model before the update) run on the unpadded
      state prompt + response[:t] alone (no batch, no padding, no position-id arithmetic),
      0 on padding;
    * advantages: GAE by the reverse loop of the paper (delta_t = r_t + gamma V_{t+1} - V_t,
      A_t = delta_t + gamma lam A_{t+1}, nothing after the last real token), returns
      A_t + V_t, then whitened with the mean and unbiased std of all real tokens.
    The learner computes in float32, the loops here in float64 from the learner's own float32
    inputs (KL_t, values): tolerances from float32 rounding (tests/tolerances.py)."""
    beta, gamma, lam = cfg.kl_coef, cfg.gamma, cfg.lam
    mask = batch.response_mask
    raw = torch.zeros_like(exp.advantages, dtype=torch.float64)
    for i in range(len(batch)):
        n = int(mask[i].sum())
        last = max(t for t in range(mask.shape[1]) if mask[i, t])
        assert n == last + 1  # responses are right-padded
        want = [-beta * float(exp.kl[i, t]) for t in range(n)]
        want[last] += float(scores[i])
        want = torch.tensor(want, dtype=torch.float64)
        # -beta * KL_t (+ score): two float32 roundings, at the size of the score and beta KL_t
        size = abs(float(scores[i])) + beta * exp.kl[i, :n].abs().max()
        torch.testing.assert_close(exp.rewards[i, :n].double(), want, rtol=0, atol=rounding_tol(size, 2))
        assert (exp.rewards[i, n:] == 0).all() and (exp.values[i, n:] == 0).all()
        prompt = batch.prompt_ids[i][batch.prompt_mask[i]].tolist()
        response = batch.response_ids[i, :n].tolist()
        if i < 3:  # the forward per state is slow-ish: three rows, every state
            with torch.no_grad():
                alone = []
                for t in range(n):
                    ids = torch.tensor([prompt + response[:t]])
                    hidden = vm.backbone(input_ids=ids, use_cache=False).last_hidden_state[0, -1]
                    alone.append(vm.head(hidden.float()).reshape(()))
            # one state alone vs the batch's padded forward: the tiny decoder's reductions, at
            # the size of the largest value (the head's dot product cancels: its terms are larger)
            values_tol = rounding_tol(exp.values[mask].abs().max(), TINY_TERMS)
            torch.testing.assert_close(exp.values[i, :n], torch.stack(alone), rtol=0, atol=values_tol)
        adv, values = 0.0, exp.values[i].double()
        for t in reversed(range(n)):
            next_value = float(values[t + 1]) if t + 1 < n else 0.0
            delta = float(exp.rewards[i, t]) + gamma * next_value - float(values[t])
            adv = delta + gamma * lam * adv
            raw[i, t] = adv
    # GAE's reverse recursion: up to 2T float32 roundings (delta_t, then A_t) of terms as large
    # as the rewards, the values and the returns (delta_t = r_t + gamma V_t+1 - V_t cancels)
    want = (raw + exp.values.double())[mask]
    t_max = mask.shape[1]
    size = max(want.abs().max(), exp.values[mask].abs().max(), exp.rewards[mask].abs().max())
    returns_tol = rounding_tol(size, 2 * t_max)
    torch.testing.assert_close(exp.returns.double()[mask], want, rtol=0, atol=returns_tol)
    real = raw[mask]
    whitened = (raw - real.mean()) / real.std(unbiased=True)
    # the raw advantages' rounding (as the returns') divided by their std, plus the rounding
    # of the mean and variance over all real tokens at the size of the whitened values
    whiten_tol = (returns_tol / real.std().item()
                  + rounding_tol(whitened[mask].abs().max(), int(mask.sum())))
    torch.testing.assert_close(exp.advantages.double()[mask], whitened[mask], rtol=0, atol=whiten_tol)
    assert (exp.advantages[~mask] == 0).all()


@pytest.mark.equality
def test_first_ratio_is_one_and_logprobs_match_direct_peft_forward(tiny_path, special):
    """Sampled with top-k (HF generate); the learner's truncated logprobs of the sampled
    tokens are finite, the first minibatch ratio is 1, and after an update the learner's
    logprobs equal a direct HF + PEFT forward with the exported adapter."""
    from peft import LoraConfig, TaskType, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    cfg = make_config(top_k=20, top_p=1.0, ppo_epochs=1, mini_batch_size=8, micro_batch_size=4)
    learner = Learner(cfg, tiny_path)
    kept = keep_experience(learner)
    batch = sampled_batch(learner, special)
    assert torch.isfinite(batch.gen_logprobs).all()
    _, ref, scores = rollout_inputs(learner, batch)
    full_before = learner.rollout_scores(batch, full=True).full_logprobs.cpu()
    stats, weights = learner.update(batch, ref, scores)
    assert stats.truncated_tokens == 0
    # the no-grad pass and the training forward: two computations of the same logprobs
    assert abs(stats.first_minibatch_ratio_mean - 1.0) < token_mean_tol(batch.gen_logprobs, batch.response_mask)
    # Old logprobs are the truncated sampling distribution; KL_t uses the full softmax.
    exp, mask = kept[-1], batch.response_mask
    lp_tol = logprob_tol(full_before, mask)  # logprobs() / full_logprobs() vs the update's pass
    assert (exp.old_logprobs - batch.gen_logprobs)[mask].abs().max() < lp_tol
    assert (full_before - batch.gen_logprobs)[mask].abs().max() > 1e-3  # truncation matters here
    assert (exp.kl - (full_before - ref))[mask].abs().max() < lp_tol

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_path), LoraConfig(
        r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=list(cfg.lora_target_modules),
        bias="none", task_type=TaskType.CAUSAL_LM)).eval()
    set_peft_model_state_dict(model, weights.tensors)
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)                      # (B, P+T)
    attn = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)
    pos = (attn.long().cumsum(1) - 1).clamp(min=0)
    p, t = batch.prompt_len, batch.response_ids.shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn.long(), position_ids=pos).logits[:, p - 1:p - 1 + t]
    logits = logits / cfg.temperature                                                    # (B, T, V)
    tok = batch.response_ids.clamp(max=logits.shape[-1] - 1).unsqueeze(-1)
    full = logits.log_softmax(-1).gather(-1, tok).squeeze(-1)
    kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]
    topk = logits.masked_fill(logits < kth, float("-inf")).log_softmax(-1).gather(-1, tok).squeeze(-1)
    mask = batch.response_mask
    # the learner's forward vs HF + PEFT's (attention mask, position ids): the decoder's rounding
    assert (learner.rollout_scores(batch, full=True).full_logprobs.cpu() - full)[mask].abs().max() < logprob_tol(full, mask)
    got = learner.rollout_scores(batch, logprobs=True).logprobs.cpu()
    # After the update some sampled tokens may have left the new top-k: -inf on both sides.
    # (At most one may differ: a logit within float rounding of the k-th largest.)
    assert (torch.isfinite(got[mask]) != torch.isfinite(topk[mask])).sum() <= 1
    finite = mask & torch.isfinite(topk) & torch.isfinite(got)
    assert (got - topk)[finite].abs().max() < logprob_tol(topk, finite)
    assert (got[~mask] == 0).all()


@pytest.mark.equality
def test_first_ratio_is_one_with_top_p_and_several_minibatches(tiny_path, special):
    cfg = make_config(top_k=30, top_p=0.9, ppo_epochs=2, mini_batch_size=4, micro_batch_size=3)
    learner = Learner(cfg, tiny_path)
    batch = sampled_batch(learner, special, seed=3)
    _, ref, scores = rollout_inputs(learner, batch)
    stats, _ = learner.update(batch, ref, scores)
    assert stats.truncated_tokens == 0
    first_tol = token_mean_tol(batch.gen_logprobs, batch.response_mask, rows=cfg.mini_batch_size)
    assert abs(stats.first_minibatch_ratio_mean - 1.0) < first_tol


@pytest.mark.equality
@pytest.mark.parametrize("ppo_dropout", [False, True])
def test_first_ratio_is_one_at_every_step_with_the_seeds_defaults(tiny_path, special, ppo_dropout):
    """PPOConfig's own defaults (the seeds': lora_dropout 0.1, top-k 50, top-p 0.95, 4 epochs):
    the old logprobs come from a dropout-free pass, so the PPO forward must be dropout-free
    too, or the first minibatch's ratio is off 1 before any update (1.00008 at step 2 here).
    ppo_dropout: true puts dropout back into the training forward: then it is not 1, by
    more than the rounding of the two passes (token_mean_tol: ~1e-5 here, dropout ~1e-4).
    The ratio's mean is signed, so a dropout draw can also land it within rounding of 1: under
    the causal layout's draw it is 7e-6 at step 2 and 1e-6 at step 3, although the update
    differs from the dropout-free one as much as under the masked layout (adapter weights
    1.4e-4 apart in both, measured); the dropout case therefore keeps the masked layout."""
    cfg = PPOConfig(model_name=TINY_MODEL, ppo_dropout=ppo_dropout, **({"learner_layout": "masked"} if ppo_dropout else {}))
    assert cfg.lora_dropout == 0.1
    learner = Learner(cfg, tiny_path)
    for step in range(2):
        batch = sampled_batch(learner, special, n=cfg.batch_size, t=cfg.max_new_tokens, seed=step)
        batch, ref, scores = rollout_inputs(learner, batch, seed=step)
        stats, _ = learner.update(batch, ref, scores)
        gap = abs(stats.first_minibatch_ratio_mean - 1.0)
        tol = token_mean_tol(batch.gen_logprobs, batch.response_mask, rows=cfg.effective_mini_batch_size)
        if ppo_dropout and step > 0:  # at step 1 LoRA B is 0: dropout on its input changes nothing
            assert gap > tol, f"step {step + 1}: dropout did not reach the PPO forward ({gap:.2e} <= {tol:.2e})"
        else:
            assert gap < tol, f"step {step + 1}: first minibatch ratio {stats.first_minibatch_ratio_mean!r}"


# ------------------------------------------------------------------ dropout off means off
TINY_SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
# Each architecture keeps its dropout in a different form (the config fields set > 0 here):
DROPOUT_MODELS = {
    "qwen3": ("Qwen3Config", dict(TINY_SHAPE, attention_dropout=0.3)),         # functional, a module float
    "llama": ("LlamaConfig", dict(TINY_SHAPE, attention_dropout=0.3)),
    "gpt2": ("GPT2Config", dict(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.3,
                                embd_pdrop=0.3, attn_pdrop=0.3)),              # nn.Dropout layers (and their .p)
    "opt": ("OPTConfig", dict(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
                              word_embed_proj_dim=32, max_position_embeddings=64, dropout=0.3,
                              attention_dropout=0.3, activation_dropout=0.3, layerdrop=0.5)),  # p=self.dropout
    "phi": ("PhiConfig", dict(TINY_SHAPE, num_key_value_heads=2, resid_pdrop=0.3, embd_pdrop=0.3,
                              attention_dropout=0.3)),
    "mixtral": ("MixtralConfig", dict(TINY_SHAPE, num_local_experts=4, num_experts_per_tok=2,
                                      router_jitter_noise=0.3, attention_dropout=0.3)),  # the router's jitter
}


@pytest.mark.parametrize("arch", sorted(DROPOUT_MODELS))
def test_disable_dropout_makes_train_mode_compute_what_eval_mode_does(arch):
    """disable_dropout on a randomly initialised tiny model of each architecture, whose config
    turns on its dropout (and other train-mode noise): train mode's logits, twice, are eval
    mode's. Same kernels on the same inputs once nothing random is left: equal bit for bit.
    Setting the dropout layers' p alone (TRL's disable_dropout) leaves all but gpt2's on."""
    import transformers

    name, fields = DROPOUT_MODELS[arch]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**fields))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    disable_dropout(model)
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
        model.train()
        got = [model(input_ids=ids).logits for _ in range(2)]
    assert all(torch.equal(g, want) for g in got), f"{arch}: max |train - eval| {(got[0] - want).abs().max():.3g}"
    assert all(v == 0.0 for k, v in vars(model.config).items() if isinstance(v, float) and "drop" in k)


def test_disable_dropout_keeps_the_adapters_own_lora_dropout(tiny_path):
    """The PEFT layers' dropout is off, their config (saved with the adapter) keeps its value."""
    learner = Learner(make_config(lora_dropout=0.1), tiny_path)
    assert learner.policy.peft_config["default"].lora_dropout == 0.1
    assert learner.lora_weights().spec.lora_dropout == 0.1
    drops = [m for m in learner.policy.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(m.p == 0.0 for m in drops)


@pytest.mark.equality
@pytest.mark.parametrize("ppo_dropout", [False, True])
def test_first_ratio_is_one_with_the_models_attention_dropout(attention_dropout_path, special, ppo_dropout):
    """A model whose config has attention_dropout 0.3 (no nn.Dropout layer holds it): the old
    logprobs come from the eval-mode pass, the PPO forward runs in train mode, so the first
    minibatch's ratio is 1 within the two passes' rounding only if disable_dropout reaches the
    attention's functional dropout. With ppo_dropout: true it is the model's dropout, on
    purpose, and the ratio is off 1 from the first step (0.92 and 1.19 at steps 1 and 2 here:
    the base model's attention drops, whatever the adapter)."""
    cfg = make_config(ppo_dropout=ppo_dropout, mini_batch_size=8)
    learner = Learner(cfg, attention_dropout_path)
    assert learner.policy.config.attention_dropout == (0.3 if ppo_dropout else 0.0)
    for step in range(2):
        batch = sampled_batch(learner, special, seed=step)
        batch, ref, scores = rollout_inputs(learner, batch, seed=step)
        stats, _ = learner.update(batch, ref, scores)
        gap = abs(stats.first_minibatch_ratio_mean - 1.0)
        tol = token_mean_tol(batch.gen_logprobs, batch.response_mask, rows=cfg.effective_mini_batch_size)
        if ppo_dropout:
            assert gap > tol, f"step {step + 1}: the attention dropout did not reach the PPO forward"
        else:
            assert gap < tol, f"step {step + 1}: first minibatch ratio {stats.first_minibatch_ratio_mean!r}"


def test_the_sync_gap_of_an_older_version_uses_its_weights_and_gives_the_learners_back(tiny_path, special):
    """The sync check of a version loaded again into a restarted replica (ppo_ray.driver.sync_guard's
    SyncGuard.check_loaded): the learner, a version further on, scores the probe with the older adapter
    (the gap is 0 against that version's own logprobs, and not against its own), then holds its
    own weights again, bit for bit."""
    learner = Learner(make_config(), tiny_path)
    batch, ref, scores = rollout_inputs(learner, random_batch(special))
    full = learner.rollout_scores(batch, full=True).full_logprobs.cpu()
    probe = replace(batch, gen_logprobs=full)  # what a replica holding version 0 would sample and report
    v0 = learner.lora_weights()
    learner.update(batch, ref, scores)
    v1 = learner.lora_weights().tensors
    assert learner.sync_gap(probe) > 1e-3  # the learner has moved on
    assert learner.sync_gap(probe, v0) == 0.0  # the same forward with version 0's tensors
    assert all(torch.equal(t, v1[k]) for k, t in learner.lora_weights().tensors.items())


def test_stale_version_is_an_error_naming_both_versions(tiny_path, special):
    learner = Learner(make_config(), tiny_path)
    batch, ref, scores = rollout_inputs(learner, random_batch(special))
    with pytest.raises(StaleRolloutsError, match=r"version 3.*version 0"):
        learner.update(replace(batch, adapter_version=3), ref, scores)
    assert learner.version == 0
    learner.update(batch, ref, scores)
    with pytest.raises(StaleRolloutsError, match=r"version 0.*version 1"):
        learner.update(batch, ref, scores)  # the same rollouts again: now stale


def test_bad_inputs_are_clear_errors(tiny_path, special):
    learner = Learner(make_config(nonfinite_reward="error"), tiny_path)
    batch, ref, scores = rollout_inputs(learner, random_batch(special))
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        learner.update(batch, ref[:, :-1], scores)
    with pytest.raises(ValueError, match="scores has shape"):
        learner.update(batch, ref, scores[:-1])
    bad = scores.clone()
    bad[5] = math.nan
    with pytest.raises(ValueError, match=r"prompts \[5\]"):
        learner.update(batch, ref, bad)
    assert learner.version == 0


def test_nonfinite_scores_dropped_and_counted(tiny_path, special):
    learner = Learner(make_config(nonfinite_reward="drop"), tiny_path)
    kept = keep_experience(learner)
    batch, ref, scores = rollout_inputs(learner, random_batch(special))
    scores[2] = math.nan
    stats, _ = learner.update(batch, ref, scores)
    assert stats.dropped_samples == 1
    assert all(math.isfinite(v) for k, v in stats.as_dict().items() if k not in MEASURED_STATS), stats
    exp = kept[-1]
    assert not exp.mask[2].any() and (exp.advantages[2] == 0).all() and (exp.returns[2] == 0).all()


# ------------------------------------------------------------------ invariances
def pad_batch(batch: RolloutBatch, ref: torch.Tensor, extra_p: int, extra_t: int):
    """The same rollouts with extra all-padding columns: prompts on the left, responses on the right."""
    f = torch.nn.functional
    pad = batch.pad_token_id
    padded = replace(
        batch,
        prompt_ids=f.pad(batch.prompt_ids, (extra_p, 0), value=pad),
        prompt_mask=f.pad(batch.prompt_mask, (extra_p, 0), value=False),
        response_ids=f.pad(batch.response_ids, (0, extra_t), value=pad),
        response_mask=f.pad(batch.response_mask, (0, extra_t), value=False),
        gen_logprobs=f.pad(batch.gen_logprobs, (0, extra_t), value=0.0))
    return padded, f.pad(ref, (0, extra_t), value=0.0)


@pytest.mark.equality
def test_padding_invariance(tiny_path, special):
    """Extra padding columns change the forwards' shapes, not their numbers beyond rounding
    (SGD updates: with_sgd; tolerances: update_tols)."""
    cfg = make_config(mini_batch_size=8, micro_batch_size=8)  # one micro-batch holds every row
    a, b = with_sgd(Learner(cfg, tiny_path)), with_sgd(Learner(cfg, tiny_path))
    kept_a, kept_b = keep_experience(a), keep_experience(b)
    batch, ref, scores = rollout_inputs(a, random_batch(special))
    padded, ref_padded = pad_batch(batch, ref, extra_p=5, extra_t=7)
    stats_a, w_a = a.update(batch, ref, scores)
    stats_b, w_b = b.update(padded, ref_padded, scores)
    t = batch.response_ids.shape[1]
    ea, eb = kept_a[-1], kept_b[-1]
    mask = batch.response_mask
    weights_a = {**w_a.tensors, **value_params(a)}
    tols = update_tols(cfg, batch, weights_a)
    raw_std = (ea.returns - ea.values)[mask].std().item()  # the advantages are whitened by it
    for name, tol in (("old_logprobs", tols["logprob"]), ("kl", tols["logprob"]), ("rewards", tols["logprob"]),
                      ("values", tols["logprob"]), ("returns", tols["row"]), ("advantages", tols["row"] / raw_std)):
        x, y = getattr(ea, name), getattr(eb, name)
        torch.testing.assert_close(y[:, :t], x, atol=tol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
        assert (y[:, t:] == 0).all(), name
    assert_same_update((stats_b, {**w_b.tensors, **value_params(b)}), (stats_a, weights_a), tols,
                       keys=("policy_loss", "value_loss", "kl", "advantage_mean", "first_minibatch_ratio_mean"))


@pytest.mark.equality
def test_micro_batching_invariance(tiny_path, special):
    """Gradient accumulation over micro-batches of 1 row equals one micro-batch of the whole
    minibatch (each micro-batch is trimmed to its own length, so the forwards differ; SGD
    updates: with_sgd; tolerances: update_tols)."""
    results = []
    for micro in (1, 4):
        cfg = make_config(mini_batch_size=4, micro_batch_size=micro, ppo_epochs=2)
        learner = with_sgd(Learner(cfg, tiny_path))
        batch, ref, scores = rollout_inputs(learner, random_batch(special, seed=1), seed=1)
        stats, w = learner.update(batch, ref, scores)
        results.append((stats, {**w.tensors, **value_params(learner)}))
    assert_same_update(results[0], results[1], update_tols(cfg, batch, results[1][1]),
                       keys=("policy_loss", "value_loss"))


@pytest.mark.equality
def test_seq_mean_token_mean_micro_batching_invariance(tiny_path, special):
    results = []
    for micro in (1, 4):
        cfg = make_config(mini_batch_size=4, micro_batch_size=micro, loss_agg="seq_mean_token_mean")
        learner = with_sgd(Learner(cfg, tiny_path))
        batch, ref, scores = rollout_inputs(learner, random_batch(special, seed=2), seed=2)
        stats, w = learner.update(batch, ref, scores)
        results.append((stats, {**w.tensors, **value_params(learner)}))
    assert_same_update(results[0], results[1], update_tols(cfg, batch, results[1][1]), keys=())


def test_determinism_same_seed_same_weights(tiny_path, special):
    """Dropout on (seeded at init), several minibatches: two learners agree bit for bit."""
    cfg = make_config(lora_dropout=0.1, ppo_epochs=2, mini_batch_size=4, micro_batch_size=2, seed=7)
    results = []
    for _ in range(2):
        learner = Learner(cfg, tiny_path)
        batch, ref, scores = rollout_inputs(learner, random_batch(special, seed=4), seed=4)
        stats, w = learner.update(batch, ref, scores)
        batch2, ref2, scores2 = rollout_inputs(learner, random_batch(special, seed=5), seed=5)
        stats2, w2 = learner.update(batch2, ref2, scores2)
        results.append((w2.tensors, value_params(learner), stats2))
    (wa, va, sa), (wb, vb, sb) = results
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all(torch.equal(va[k], vb[k]) for k in va)
    assert sa.policy_loss == sb.policy_loss
    other = Learner(cfg.replace(seed=8), tiny_path)
    assert max_abs_diff(other.lora_weights().tensors, Learner(cfg, tiny_path).lora_weights().tensors) > 0


def test_positive_score_raises_those_rows_logprob(tiny_path, special):
    """Policy-gradient sign: rows whose first response token is even score +1, the others
    -1; repeated updates on those rollouts raise the rewarded rows' logprob relative to the
    others (and in absolute terms)."""
    learner = Learner(make_config(kl_coef=0.0, learning_rate=3e-3, ppo_epochs=2, mini_batch_size=8,
                                  micro_batch_size=8, gamma=1.0, lam=1.0), tiny_path)
    batch = random_batch(special, seed=6)
    good = batch.response_ids[:, 0] % 2 == 0
    assert 0 < good.sum() < len(batch)
    scores = torch.where(good, 1.0, -1.0)
    ref = learner.rollout_scores(batch, full=True).full_logprobs.cpu()

    def seq_logprob(b):
        return learner.rollout_scores(b, logprobs=True).logprobs.cpu().sum(dim=1)  # (B,)

    start = seq_logprob(batch)
    for _ in range(4):
        batch = replace(batch, adapter_version=learner.version)
        batch = replace(batch, gen_logprobs=learner.rollout_scores(batch, logprobs=True).logprobs.cpu())
        learner.update(batch, ref, scores)
    delta = seq_logprob(batch) - start
    assert delta[good].mean() > 0.0
    assert delta[good].mean() > delta[~good].mean() + 0.1


# ------------------------------------------------------------------ value model
def test_value_model_init_from_causal_lm_is_zero(tiny_path):
    kw = dict(lora_r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    torch.manual_seed(0)
    a = ValueModel(tiny_path, seed=1, **kw)
    torch.manual_seed(0)
    b = ValueModel(tiny_path, seed=1, **kw)
    assert not a.from_reward_model
    hidden = a.head.in_features
    w = a.head.weight
    assert torch.equal(w, b.head.weight) and (a.head.bias == 0).all()
    # zero head: V = 0 at the start (see learner/value_model.py for why not a random head)
    assert w.shape == (1, hidden) and (w == 0).all()
    trainable = {n for n, p in a.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("head.") for n in trainable)


@pytest.mark.equality
def test_value_model_init_from_reward_model(tiny_path, special, tmp_path):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(3)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_path, num_labels=1)
    rm.config.pad_token_id = special[1]
    rm.save_pretrained(tmp_path / "rm")
    vm = ValueModel(str(tmp_path / "rm"), lora_r=4, lora_alpha=8, lora_dropout=0.0,
                    target_modules=["q_proj"])
    assert vm.from_reward_model
    assert torch.equal(vm.head.weight, rm.score.weight) and (vm.head.bias == 0).all()
    # With B = 0 the LoRA is a no-op: V(s_t) is the RM's score head on the RM's hidden state.
    batch = random_batch(special, n=3)
    values = vm(batch)
    p = batch.prompt_len
    ids, attn, pos = batch.sequences()
    with torch.no_grad():
        h = rm.model(input_ids=ids, attention_mask=attn.long(), position_ids=pos).last_hidden_state
        expect = rm.score(h)[:, p - 1:p - 1 + batch.response_ids.shape[1], 0]
    # PEFT's forward (B = 0) and the value head vs the RM's own modules: the decoder's rounding
    mask = batch.response_mask
    assert (values - expect)[mask].abs().max() < rounding_tol(expect[mask].abs().max(), TINY_TERMS)
    learner = Learner(make_config(), tiny_path, value_model_path=str(tmp_path / "rm"))
    assert learner.value_model.from_reward_model


# ------------------------------------------------------------------ buffer
def test_every_experience_field_says_what_it_is():
    """Each Experience field declares its kind where it is declared (per token, per sequence,
    a host count, the rollouts), and select / trimmed treat it by that: a new field needs
    no list elsewhere."""
    from dataclasses import fields

    from learner.buffer import HOST, ROLLOUTS, SEQUENCE, TOKEN

    kinds = {f.name: f.metadata.get("kind") for f in fields(Experience)}
    assert set(kinds.values()) == {TOKEN, SEQUENCE, HOST, ROLLOUTS}, kinds
    assert kinds["scores"] == SEQUENCE and kinds["advantages"] == TOKEN and kinds["seq_len"] == HOST


def test_buffer_micro_batches_trim_like_rollout_batch(special):
    batch = random_batch(special, n=7, p=9, t=12, seed=9)
    b, t = batch.response_ids.shape
    per_token = {name: torch.randn(b, t) for name in
                 ("old_logprobs", "ref_logprobs", "kl", "rewards", "values", "advantages", "returns")}
    exp = Experience(rollouts=batch, mask=batch.response_mask, policy_mask=batch.response_mask,
                     scores=torch.randn(b), **per_token)
    buf = ExperienceBuffer(exp, mini_batch_size=4, micro_batch_size=3)
    minis = buf.minibatch_indices(torch.Generator().manual_seed(0))
    assert [len(m) for m in minis] == [4, 3]
    assert sorted(torch.cat(minis).tolist()) == list(range(b))
    again = buf.minibatch_indices(torch.Generator().manual_seed(0))
    assert all(torch.equal(x, y) for x, y in zip(minis, again))
    for mini in minis:
        rows_seen = []
        for micro, chunk in zip(map(buf.micro_batch, buf.micro_rows(mini)), torch.split(mini, 3)):
            rows = chunk.tolist()
            rows_seen += rows
            expect = batch.select(rows).trimmed()
            assert torch.equal(micro.rollouts.prompt_ids, expect.prompt_ids)
            assert torch.equal(micro.rollouts.response_ids, expect.response_ids)
            assert torch.equal(micro.mask, expect.response_mask)
            tk = expect.response_ids.shape[1]
            for name, full in per_token.items():
                assert torch.equal(getattr(micro, name), full[rows, :tk]), name
            assert torch.equal(micro.scores, exp.scores[rows])  # per sequence: rows only
        assert rows_seen == mini.tolist()
    for rows, micro in rollout_micro_batches(batch, 3, TrimPlan.of(batch)):
        expect = batch.select(rows).trimmed()
        assert torch.equal(micro.prompt_ids, expect.prompt_ids)
        assert torch.equal(micro.response_mask, expect.response_mask)


# ------------------------------------------------------------------ checkpoints
def test_state_dict_through_a_checkpoint_resumes_bit_for_bit(tiny_path, special, tmp_path):
    """Dropout on (so the RNG state matters), two updates: learner A runs both; learner B
    is a fresh learner that loads A's state after update 1 from a checkpoint on disk
    (safetensors + weights_only torch.load) and runs update 2. Same weights, same stats."""
    from ppo_ray.driver.checkpoint import load_checkpoint, save_checkpoint

    cfg = make_config(lora_dropout=0.1, ppo_dropout=True, seed=3)
    a = Learner(cfg, tiny_path)
    a.update(*rollout_inputs(a, random_batch(special, seed=1), seed=1))
    save_checkpoint(tmp_path, config=cfg, learner_state=a.state_dict(), model_dir=tiny_path,
                    trainer_state={"step": 1, "order": [3, 1], "data_rng": torch.Generator().get_state()})
    inputs = rollout_inputs(a, random_batch(special, seed=2), seed=2)
    stats_a, w_a = a.update(*inputs)

    b = Learner(cfg, tiny_path)
    _, learner_state, trainer_state = load_checkpoint(tmp_path, cfg)
    assert trainer_state["step"] == 1 and trainer_state["order"] == [3, 1] and learner_state.version == 1
    b.load_state_dict(learner_state)
    assert b.version == 1
    stats_b, w_b = b.update(*inputs)
    assert all(torch.equal(w_a.tensors[k], w_b.tensors[k]) for k in w_a.tensors)
    assert all(torch.equal(x, y) for x, y in zip(value_params(a).values(), value_params(b).values()))
    assert stats_a.policy_loss == stats_b.policy_loss and stats_a.value_loss == stats_b.value_loss


def test_checkpoint_of_another_shape_or_config_is_refused(tiny_path, special, tmp_path):
    from learner.learner import CheckpointMismatchError
    from ppo_ray.driver.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    cfg = make_config()
    a = Learner(cfg, tiny_path)
    save_checkpoint(tmp_path, config=cfg, learner_state=a.state_dict(), model_dir=tiny_path,
                    trainer_state={"step": 0, "order": [], "data_rng": torch.Generator().get_state()})
    with pytest.raises(CheckpointError, match=r"lora_r: checkpoint 4 vs now 8"):
        load_checkpoint(tmp_path, cfg.replace(lora_r=8))
    # the tensors themselves are checked too (e.g. a checkpoint loaded without its config)
    _, state, _ = load_checkpoint(tmp_path)
    wide = Learner(cfg.replace(lora_r=8, lora_alpha=16), tiny_path)
    before = wide.lora_weights().tensors
    with pytest.raises(CheckpointMismatchError, match=r"shape .* lora_r"):
        wide.load_state_dict(state)
    assert max_abs_diff(before, wide.lora_weights().tensors) == 0  # nothing changed
    # the adapter's spec travels with it (adapter_config.json): another alpha is refused too
    assert state.policy.spec == a.lora_weights().spec
    strong = Learner(cfg.replace(lora_alpha=16), tiny_path)
    with pytest.raises(CheckpointMismatchError, match="lora_alpha=8.*lora_alpha=16"):
        strong.load_state_dict(state)
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        load_checkpoint(tmp_path / "checkpoints" / "step-000000" / "adapter")


def test_a_crash_while_writing_keeps_the_latest_checkpoint(tiny_path, tmp_path, monkeypatch):
    from ppo_ray.driver.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint

    cfg = make_config()
    a = Learner(cfg, tiny_path)
    state = {"order": [], "data_rng": torch.Generator().get_state()}
    first = save_checkpoint(tmp_path, config=cfg, learner_state=a.state_dict(), model_dir=tiny_path,
                            trainer_state={**state, "step": 1})

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, config=cfg, learner_state=a.state_dict(), model_dir=tiny_path,
                        trainer_state={**state, "step": 2})
    monkeypatch.undo()
    assert resolve_checkpoint(tmp_path) == first
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-000001"]
    assert load_checkpoint(tmp_path, cfg)[2]["step"] == 1


# ------------------------------------------------------------------ overlap mode
@pytest.mark.equality
def test_overlap_mode_takes_one_version_stale_rollouts_with_behaviour_logprobs(tiny_path, special):
    """max_staleness 1: a batch sampled with version v-1 is accepted (v-2 is not), the
    PPO ratio's denominator is the generator's logprobs (the behaviour policy), and the
    staleness is reported."""
    cfg = make_config(max_staleness=1, learning_rate=3e-3)
    learner = Learner(cfg, tiny_path)
    kept = keep_experience(learner)
    stale_batch, ref, scores = rollout_inputs(learner, sampled_batch(learner, special, seed=3), seed=3)  # v0
    learner.update(*rollout_inputs(learner, sampled_batch(learner, special, seed=4), seed=4))  # -> v1
    assert learner.version == 1 and stale_batch.adapter_version == 0

    current = learner.rollout_scores(stale_batch, logprobs=True).logprobs.cpu()
    stats, _ = learner.update(stale_batch, ref, scores)
    exp = kept[-1]
    m = exp.policy_mask
    assert torch.equal(exp.old_logprobs[m], stale_batch.gen_logprobs[m])  # behaviour, not current
    assert stats.stale_versions == 1.0
    gap = (current - stale_batch.gen_logprobs)[m].abs().mean().item()
    # the update's pass vs logprobs() above: a mean over tokens of two computations' differences
    assert gap > 1e-3 and stats.behaviour_logprob_gap == pytest.approx(gap, abs=token_mean_tol(current, m))
    assert abs(stats.first_minibatch_ratio_mean - 1.0) > 1e-4  # pi_current / pi_behaviour != 1
    assert math.isnan(stats.gen_logprob_max_abs_diff)

    with pytest.raises(StaleRolloutsError, match="version 0 but the learner is at version 2"):
        learner.update(stale_batch, ref, scores)  # two versions behind
    sync = Learner(make_config(), tiny_path)
    sync.update(*rollout_inputs(sync, sampled_batch(sync, special, seed=4), seed=4))
    with pytest.raises(StaleRolloutsError, match="stale rollouts"):
        sync.update(stale_batch, ref, scores)  # the synchronous mode takes none


@pytest.mark.equality
def test_a_stale_step_with_a_correction_is_decoupled_ppo(tiny_path, special):
    """max_staleness 1 with is_correction tis: a stale step's PPO ratio is taken against the
    learner's own logprobs at the update's start (the proximal policy), and each token's loss is
    weighted by min(pi_proximal / pi_behaviour, is_cap), the behaviour policy being the one that
    sampled (decoupled PPO); the weights are reported."""
    cfg = make_config(max_staleness=1, learning_rate=3e-3, is_correction="tis", old_logprobs="learner")
    learner = Learner(cfg, tiny_path)
    kept = keep_experience(learner)
    stale_batch, ref, scores = rollout_inputs(learner, sampled_batch(learner, special, seed=3), seed=3)  # v0
    learner.update(*rollout_inputs(learner, sampled_batch(learner, special, seed=4), seed=4))  # -> v1
    current = learner.rollout_scores(stale_batch, logprobs=True).logprobs.cpu()
    stats, _ = learner.update(stale_batch, ref, scores)
    exp = kept[-1]
    m = exp.policy_mask
    tol = rounding_tol(current[m].abs().max().item(), TINY_TERMS)  # two forwards of the same weights
    assert (exp.old_logprobs[m] - current[m]).abs().max() <= tol  # proximal: the current policy
    assert (current - stale_batch.gen_logprobs)[m].abs().mean() > 1e-3  # one version apart
    want = torch.exp(exp.old_logprobs - stale_batch.gen_logprobs).clamp(max=cfg.is_cap)
    assert torch.allclose(exp.is_weights[m], want[m], rtol=1e-6, atol=0)
    assert stats.is_weight_mean == pytest.approx(want[m].mean().item(), rel=1e-5)
    assert stats.first_minibatch_ratio_mean == pytest.approx(1.0, abs=token_mean_tol(current, m))
    assert stats.stale_versions == 1.0 and math.isnan(stats.gen_logprob_max_abs_diff)


@pytest.mark.equality
def test_fresh_rollouts_report_zero_staleness(tiny_path, special):
    learner = Learner(make_config(max_staleness=1), tiny_path)
    batch, ref, scores = rollout_inputs(learner, sampled_batch(learner, special, seed=5), seed=5)
    stats, _ = learner.update(batch, ref, scores)
    assert stats.stale_versions == 0.0 and stats.behaviour_logprob_gap == 0.0
    first_tol = token_mean_tol(batch.gen_logprobs, batch.response_mask, rows=learner.config.effective_mini_batch_size)
    assert stats.first_minibatch_ratio_mean == pytest.approx(1.0, abs=first_tol)
