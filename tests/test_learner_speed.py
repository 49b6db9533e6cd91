"""The learner's speed options compute what the plain path computes (float32, CPU).

Each option of ppo_ray.config's "learner speed" block is checked against the plain path
(all options at their defaults) on the embedded tiny Qwen3 with non-zero LoRA B matrices
(so the adapters matter), left-padded prompts and responses of different lengths:

* learner_layout=causal (rows moved to column 0, no attention mask) == masked;
* logprob_chunk_size (lm_head + logprobs a chunk of real tokens at a time, recomputed in
  the backward) == all positions at once, values and gradients;
* lora_kernel=fused == PEFT's LoRA forward, values and gradients, also with the casts
  cached across micro-batches; lora_kernel=merged (one GEMM with W + s B A, the factors'
  gradients by hand) likewise; rms_norm_kernel=fused == HF's RMSNorm;
* learner_sort_by_length (length-sorted micro-batches) and gradient_checkpointing give the
  same update;
* all of them together give the same update.

"The same" is float32 rounding of the tiny model's reductions (tests/tolerances.py): logprobs
within logprob_tol, gradients within rounding_tol(|g|, grad_terms); updates are taken with
SGD (helpers.with_sgd: Adam would turn rounding on a near-zero gradient entry into a
step of ~lr) and compared within update_tols.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from learner.learner import Learner
from learner.speed import chunked_rows, head_token_stats
from ppo_ray.batch import TrimPlan
from ppo_ray.config import ConfigError, PPOConfig
from ppo_ray.logprobs import logprobs_from_logits
from helpers import (FAST, assert_same_update, keep_experience, learner_with, logprob_tol, make_config, passes,
                     plain_pass_and_update, random_batch, rollout_inputs, token_mean_tol, update_tols, value_params,
                     with_sgd)
from tolerances import TINY_TERMS, bf16_roundings, grad_terms, rms_rel_tol, rounding_tol


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def batch(special):
    return random_batch(special, n=8, p=10, t=16, seed=3)


@pytest.fixture(scope="module")
def plain(tiny_path, batch):
    """The plain path's no-grad pass and one SGD update (from the same starting weights)."""
    return plain_pass_and_update(tiny_path, batch)


def test_causal_sequences_move_each_row_to_column_zero(special):
    batch = random_batch(special, n=5, p=6, t=4, seed=1)
    plan = TrimPlan.of(batch)
    length = plan.seq_len(range(5))
    ids, predict = batch.causal_sequences(length)
    for i in range(5):
        real = torch.cat([batch.prompt_ids[i][batch.prompt_mask[i]], batch.response_ids[i][batch.response_mask[i]]])
        assert ids[i, :len(real)].tolist() == real.tolist()  # real tokens first, in order
        p_i = int(batch.prompt_mask[i].sum())
        for t in range(int(batch.response_mask[i].sum())):
            assert int(predict[i, t]) == p_i - 1 + t  # the column that predicts response token t
            assert int(ids[i, predict[i, t] + 1]) == int(batch.response_ids[i, t])
    assert int(predict.max()) < length


@pytest.mark.equality
@pytest.mark.parametrize("options", [dict(learner_layout="causal"), dict(logprob_chunk_size=5),
                                     dict(lora_kernel="fused"), dict(lora_kernel="merged"),
                                     dict(rms_norm_kernel="fused"), dict(learner_sort_by_length=True), FAST],
                         ids=["causal", "chunked", "fused_lora", "merged_lora", "fused_norm", "sorted", "all"])
def test_no_grad_pass_equals_plain(tiny_path, plain, options):
    """Old logprobs (truncated), full logprobs, entropy and values of every real token, to
    the rounding of logprobs of this size (the entropy lse - E[x] is rounded at the same
    scale; the values come from a zero head)."""
    b, _, _, before, _, _ = plain
    got = passes(learner_with(tiny_path, **options), b)
    torch.testing.assert_close(got, before, atol=logprob_tol(before["full"], b.response_mask), rtol=0)


@pytest.mark.equality
@pytest.mark.parametrize("options", [dict(learner_layout="causal"), dict(logprob_chunk_size=5),
                                     dict(lora_kernel="fused"), dict(lora_kernel="merged"),
                                     dict(learner_sort_by_length=True), dict(gradient_checkpointing=True), FAST,
                                     dict(FAST, lora_kernel="merged", gradient_checkpointing=True)],
                         ids=["causal", "chunked", "fused_lora", "merged_lora", "sorted", "checkpointed", "all",
                              "all_merged_checkpointed"])
def test_update_equals_plain(tiny_path, plain, options):
    """Two PPO epochs x two minibatches x micro-batches of 2 (SGD): every stat and the new
    adapter equal the plain path's (float32, float summation order only: update_tols)."""
    b, ref, scores, _, stats, weights = plain
    assert stats.clipfrac == 0 and stats.vf_clipfrac == 0  # with_sgd's premise: no ratio at a clip end
    fast_stats, fast_weights = with_sgd(learner_with(tiny_path, **options)).update(b, ref, scores)
    assert_same_update((fast_stats, fast_weights.tensors), (stats, weights), update_tols(make_config(), b, weights))


@pytest.mark.equality
def test_checkpointed_and_chunked_gradients_equal_plain(tiny_path, plain):
    """One micro-batch's policy + value loss gradients, with every speed option and
    gradient checkpointing, equal the plain path's."""
    b, ref, scores, _, _, _ = plain

    def grads(**options) -> dict:
        # update() builds the Experience; SGD at lr 0 leaves the weights as they were, so
        # both gradients are taken at the same weights (Adam's steps would differ by ~lr)
        learner = with_sgd(learner_with(tiny_path, **options), lr=0.0)
        kept = keep_experience(learner)
        learner.update(b, ref, scores)
        from learner.buffer import ExperienceBuffer

        exp = kept[-1]
        buffer = ExperienceBuffer(exp, len(exp), 4, TrimPlan.of(exp.rollouts), sort=learner.config.learner_sort_by_length)
        learner.policy.train()
        learner.value_model.train()
        norm = exp.mask.sum().float()
        for rows in buffer.micro_rows(torch.arange(len(exp))):
            learner.optimiser.micro_backward(buffer.micro_batch(rows), norm, norm)
        return {n: p.grad.clone() for n, p in [*learner.policy.named_parameters(),
                                              *learner.value_model.named_parameters()] if p.requires_grad}

    base, fast = grads(), grads(**FAST, gradient_checkpointing=True)
    assert base.keys() == fast.keys()
    g_max = max(g.abs().max().item() for g in base.values())
    assert g_max > 1e-4  # the gradients are not all zero
    # the largest gradient's rounding through the model's reductions and the batch's tokens
    torch.testing.assert_close(fast, base, atol=rounding_tol(g_max, grad_terms(int(b.response_mask.sum()))), rtol=0)


@pytest.mark.equality
def test_chunked_rows_equal_one_pass_values_and_gradients():
    """Logprobs of 23 rows through a 16 x 50 head, in chunks of 5 rows and in one pass:
    values to their rounding (reductions of 16 and 50 terms at the size of logits /
    temperature, which the log-sum-exp carries), the hidden states' gradient to its own (the
    backward's reductions again)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g)
    tokens = (hidden @ weight.T).topk(3).indices[:, 2].detach()  # inside the top-10 support

    def fn(h, tok):
        logits = h @ weight.T  # (c, V)
        return logprobs_from_logits(logits, tok, 0.7, top_k=10), logprobs_from_logits(logits, tok, 0.7)

    full = fn(hidden, tokens)
    grad_full = torch.autograd.grad(sum(x.sum() for x in full), hidden)[0]
    chunked = chunked_rows(fn, 5, hidden, tokens)
    grad_chunked = torch.autograd.grad(sum(x.sum() for x in chunked), hidden)[0]
    terms = 16 + 50  # h @ W.T, then the log-softmax over 50 tokens
    scale = (hidden @ weight.T).abs().max() / 0.7  # logits / temperature
    for a, b in zip(full, chunked):
        torch.testing.assert_close(b, a, atol=rounding_tol(scale, terms), rtol=0)
    torch.testing.assert_close(grad_chunked, grad_full, atol=rounding_tol(grad_full.abs().max(), 2 * terms), rtol=0)


@pytest.mark.equality
@pytest.mark.heavy("torch.compile: tens of seconds of compilation on 2 cores")
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (10, 0.9)], ids=["full", "truncated"])
def test_compiled_head_stats_equal_eager_values_and_gradients(top_k, top_p):
    """learner_compile's lm_head + logprob math (one torch.compile graph, dynamic widths)
    equals the eager ops, chunked and checkpointed as the learner runs it: the truncated and
    full logprobs and the entropy, and the hidden states' gradient (float32), to the rounding
    of reductions of 16 (h @ W.T) and 50 terms (the vocabulary) at the size of logits /
    temperature (a logprob x - lse and the entropy lse - E[x] are rounded at that size), the
    gradient at its own."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g)
    rank = 2 if top_p == 1.0 else 0  # a sampled token inside the truncated support
    tokens = (hidden @ weight.T).topk(3).indices[:, rank].detach()
    what = (0.7, top_k, top_p, True, True, True)
    compiled = torch.compile(head_token_stats, dynamic=True)
    results = []
    for fn in (head_token_stats, compiled):
        out = chunked_rows(lambda h, tok: fn(h, weight, tok, *what), 5, hidden, tokens)  # widths 5 and 3
        grad = torch.autograd.grad(sum(x.sum() for x in out), hidden)[0]
        results.append((*[x.detach() for x in out], grad))
    assert all(torch.isfinite(x).all() for x in results[0])
    terms = 16 + 50
    scale = (hidden @ weight.T).abs().max() / 0.7  # logits / temperature
    for a, b in zip(results[0][:-1], results[1][:-1]):
        torch.testing.assert_close(b, a, atol=rounding_tol(scale, terms), rtol=0)
    grad, grad_compiled = results[0][-1], results[1][-1]
    # the gradient sums, over the vocabulary, terms up to (x - E[x]) W / temperature (the
    # entropy's; a logprob's have (onehot - p) <= 1 in place of x - E[x])
    grad_scale = scale * weight.abs().max() / 0.7
    torch.testing.assert_close(grad_compiled, grad, atol=rounding_tol(grad_scale, 2 * terms), rtol=0)


@pytest.mark.equality
def test_fused_lora_equals_peft_with_cached_casts(tiny_path):
    """bfloat16 model, float32 adapters (PEFT's default): the fused forward's outputs and
    float32 adapter gradients match PEFT's up to bf16 rounding (norm-wise: rms_rel_tol of
    one rounding per activation along the forward, twice as many for the backward), well
    below the adapter's own effect; with the cast cache open over two micro-batches the
    gradients are the same as without it (the same ops on the same values: exact); with
    the adapter disabled it is the base model (exact)."""
    from learner.kernels import cached_casts, fuse_lora_linears
    from peft import LoraConfig, get_peft_model
    from ppo_ray.modeling import load_causal_lm

    def model():
        torch.manual_seed(0)
        m = get_peft_model(load_causal_lm(tiny_path, "bfloat16"), LoraConfig(r=4, lora_alpha=8, target_modules=[
            "q_proj", "v_proj", "down_proj"]))
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
        assert all(p.dtype == torch.float32 for n, p in m.named_parameters() if "lora_" in n)
        return m

    ids = torch.randint(0, 300, (2, 2, 9), generator=torch.Generator().manual_seed(1))

    def run(m, cache: bool):
        outs = []
        with cached_casts(m) if cache else torch.enable_grad():
            for x in ids:  # two micro-batches, one backward each
                logits = m(input_ids=x).logits.float()
                logits.square().mean().backward()
                outs.append(logits.detach())
        return outs, {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}

    peft_out, peft_grads = run(model(), cache=False)
    fused = model()
    assert fuse_lora_linears(fused) == 3 * 2  # 3 targets x 2 layers
    fused_out, fused_grads = run(fused, cache=False)
    fused2 = model()
    fuse_lora_linears(fused2)
    cached_out, cached_grads = run(fused2, cache=True)
    merged = model()
    assert fuse_lora_linears(merged, "merged") == 3 * 2
    merged_out, merged_grads = run(merged, cache=True)
    def rel(a, b) -> float:  # bf16 compute vs PEFT's float32 LoRA: equal up to bf16 rounding
        return float((a - b).norm() / b.norm())

    out_tol, grad_tol = rms_rel_tol(bf16_roundings()), rms_rel_tol(2 * bf16_roundings())
    for a, b, c in zip(fused_out, peft_out, merged_out):
        assert rel(a, b) < out_tol
        assert rel(c, b) < out_tol  # W + s B A rounded to bf16 once
    for k in peft_grads:
        assert rel(fused_grads[k], peft_grads[k]) < grad_tol, k
        assert rel(merged_grads[k], peft_grads[k]) < grad_tol, k
        assert torch.equal(cached_grads[k], fused_grads[k]), k  # the cache changes nothing
    assert fuse_lora_linears(merged, "peft") == 3 * 2 and "_lora_kernel" not in vars(merged.base_model.model.model
                                                                                        .layers[0].self_attn.q_proj)
    with torch.no_grad(), fused.disable_adapter():
        base_logits = fused(input_ids=ids[0]).logits
    with torch.no_grad():
        plain = load_causal_lm(tiny_path, "bfloat16")(input_ids=ids[0]).logits
    assert torch.equal(base_logits, plain)
    assert rel(plain.float(), peft_out[0]) > 2 * out_tol  # the adapter's effect: the tolerance resolves it


def test_padded_token_ratio_counts_the_layouts(tiny_path, plain, batch):
    """padded_token_ratio = positions computed / real tokens over the no-grad pass and the
    epochs: >= 1, and the sorted causal layout pays for less padding than the plain one."""
    b, ref, scores, _, stats, _ = plain
    fast_stats, _ = learner_with(tiny_path, learner_layout="causal", learner_sort_by_length=True).update(b, ref, scores)
    assert 1.0 <= fast_stats.padded_token_ratio < stats.padded_token_ratio
    plan = TrimPlan.of(b)
    rows = list(range(len(b)))
    done, real = plan.cost(rows, causal=False)
    assert real == int(b.prompt_mask.sum() + b.response_mask.sum())
    assert done == len(b) * (plan.prompt_len - min(plan.prompt_start) + max(plan.response_end))
    assert plan.cost(rows, causal=True)[0] == len(b) * max(plan.length(i) for i in rows)


def test_compile_option_compiles_every_decoder_layer(tiny_path, monkeypatch):
    """learner_compile wraps each decoder layer of both models (torch.compile itself is
    measured on the GPU, benchmarks/RESULTS.md; here only the wiring, without compiling)."""
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append((self, kw)))
    learner = Learner(make_config(learner_compile=True), tiny_path)
    layers = [*learner.speed.decoder.layers, *learner.value_model.backbone.get_base_model().layers]
    assert [m for m, _ in compiled] == layers and all(kw == {"dynamic": True} for _, kw in compiled)
    assert learner.speed.head_stats is not head_token_stats  # the lm_head + logprob math: torch.compile'd
    assert Learner(make_config(), tiny_path).speed.head_stats is head_token_stats


def test_compile_scope_decoder_compiles_each_models_decoder_once(tiny_path, monkeypatch):
    """learner_compile_scope: decoder wraps each model's whole decoder (one graph per
    forward), not its layers; the scope cannot change once compiled."""
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append((self, kw)))
    learner = Learner(make_config(learner_compile=True, learner_compile_scope="decoder"), tiny_path)
    decoders = [learner.speed.decoder, learner.value_model.backbone.get_base_model()]
    assert [m for m, _ in compiled] == decoders and all(kw == {"dynamic": True} for _, kw in compiled)
    learner.speed.configure()  # the same scope again: nothing more is compiled
    assert len(compiled) == 2
    with pytest.raises(ValueError, match="learner_compile_scope.*per decoder"):
        learner.reconfigure(learner.config.replace(learner_compile_scope="layer"))


@pytest.mark.slow
@pytest.mark.equality
@pytest.mark.parametrize("scope", ["decoder", "layer"])
def test_compiled_update_equals_plain(tiny_path, plain, scope):
    """A real torch.compile of the learner (~30-70 s on the CPU per scope): the SGD update
    with every speed option equals the plain path's (float32, update_tols)."""
    b, ref, scores, _, stats, weights = plain
    learner = with_sgd(learner_with(tiny_path, **FAST, learner_compile=True, learner_compile_scope=scope))
    fast_stats, fast_weights = learner.update(b, ref, scores)
    assert_same_update((fast_stats, fast_weights.tensors), (stats, weights), update_tols(make_config(), b, weights),
                       keys=("policy_loss", "value_loss"))


@pytest.mark.parametrize("options", [{}, FAST], ids=["plain", "all"])
def test_separate_value_model_runs_after_the_policys_backward(tiny_path, batch, options):
    """Memory: with a separate value model, each micro-batch's policy backward is done before
    the value model's forward starts (only one model's activations alive at a time)."""
    learner = learner_with(tiny_path, micro_batch_size=4, **options)
    b, ref, scores = rollout_inputs(learner, batch)
    policy_lora = [p for n, p in learner.policy.named_parameters() if p.requires_grad]
    seen = []

    def check(module, args):
        if module.training:  # the PPO epochs (the no-grad pass runs in eval mode)
            seen.append(all(p.grad is not None for p in policy_lora))

    learner.value_model.register_forward_pre_hook(check)
    learner.update(b, ref, scores)
    assert len(seen) >= 4 and all(seen)


def test_no_mask_only_where_every_layer_is_full_attention(tiny_path):
    from transformers import AutoConfig

    from ppo_ray.modeling import no_mask

    cfg = AutoConfig.from_pretrained(tiny_path)
    assert set(cfg.layer_types) == {"full_attention"} and no_mask(cfg) == {"full_attention": None}
    cfg.layer_types = ["sliding_attention", "full_attention"]
    assert no_mask(cfg) is None  # the model builds its sliding-window masks itself
    del cfg.layer_types
    assert no_mask(cfg) is None


@pytest.mark.parametrize("field, value", [("learner_layout", "packed"), ("lora_kernel", "triton"),
                                          ("rms_norm_kernel", "x"), ("logprob_chunk_size", -1),
                                          ("learner_compile_scope", "model")])
def test_speed_options_are_validated(field, value):
    with pytest.raises(ConfigError, match=field):
        PPOConfig(**{field: value})


def test_defaults_are_the_options_measured_faster():
    """Issue 33: on by default the options measured faster on the CPU and on a GPU (the causal
    layout, merged LoRA, fused RMSNorm; benchmarks/RESULTS.md); the others off. old_logprobs
    auto takes the generator's only where they are proven equal (untruncated float32 sampling,
    the synchronous step, no is_correction)."""
    cfg = PPOConfig()
    assert (cfg.learner_layout, cfg.learner_sort_by_length, cfg.logprob_chunk_size, cfg.lora_kernel,
            cfg.rms_norm_kernel, cfg.gradient_checkpointing, cfg.learner_compile) == \
        ("causal", False, 0, "merged", "fused", False, False)
    assert cfg.old_logprobs == "auto" and cfg.old_logprobs_source == "learner"  # top_k 50, top_p 0.95
    untruncated = cfg.replace(top_k=0, top_p=1.0)
    assert untruncated.old_logprobs_source == "generator"
    for other in (dict(dtype="bfloat16"), dict(top_k=-1, top_p=0.9), dict(max_staleness=1),
                  dict(is_correction="tis")):
        assert untruncated.replace(**other).old_logprobs_source == "learner", other
    assert untruncated.replace(old_logprobs="learner").old_logprobs_source == "learner"


# ------------------------------------------------------------------ value_model: shared
def shared_learner(tiny_path, **options) -> Learner:
    """value_model: shared, with random LoRA B matrices and a random value head."""
    learner = learner_with(tiny_path, value_model="shared", **options)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        learner.value_model.head.weight.copy_(0.1 * torch.randn(learner.value_model.head.weight.shape, generator=g))
        learner.value_model.head.bias.fill_(0.3)
    return learner


@pytest.mark.equality
@pytest.mark.parametrize("options", [{}, FAST], ids=["plain", "fast"])
def test_shared_trunk_pass_equals_two_forwards(tiny_path, batch, options):
    """One trunk forward for logprobs and values == the policy's own forward (the plain
    path's logits) plus a second, independent forward for the hidden states under the head:
    the same weights give the same numbers, to the rounding of the tiny model's reductions."""
    learner = shared_learner(tiny_path, **options)
    b = replace(batch, adapter_version=0)
    out = passes(learner, b)
    mask = b.response_mask
    cfg = learner.config
    # 1. logprobs from the CausalLM's own forward (logits), as the separate-model learner computes them
    from ppo_ray.modeling import response_hidden, response_logits

    with torch.no_grad():
        logits = response_logits(learner.policy, b)  # (B, T, V)
        hidden = response_hidden(learner.policy.get_base_model().get_decoder(), b)  # (B, T, H), a second forward
    want_lp = logprobs_from_logits(logits, b.response_ids, cfg.temperature, cfg.top_k, cfg.top_p, mask=mask)
    want_v = learner.value_model.head(hidden.float()).squeeze(-1)
    assert (out["logprobs"] - want_lp)[mask].abs().max() < logprob_tol(want_lp, mask)
    assert (out["values"] - want_v)[mask].abs().max() < rounding_tol(want_v[mask].abs().max(), TINY_TERMS)
    assert (out["values"][~mask] == 0).all() and out["values"][mask].abs().max() > 0.1  # the head is not 0
    assert not hasattr(learner.value_model, "backbone")  # no second model in memory


# the spy below replaces optimizer.step, which torch's LR scheduler notices and warns about
@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden:UserWarning")
@pytest.mark.equality
def test_shared_trunk_update_trains_lora_with_the_weighted_value_loss(tiny_path, batch):
    """The value loss reaches the shared LoRA with weight vf_coef: the first LoRA gradient is
    g_policy + vf_coef * g_value, affine in vf_coef (checked at 0.1, 0.2, 0.3: g(0.3) -
    2 g(0.2) + g(0.1) = 0 up to four gradients' float32 rounding), with a g_value that is not
    0; the ratio still starts at 1 (up to the two passes' rounding)."""
    grads = {}
    for coef in (0.1, 0.2, 0.3):
        learner = shared_learner(tiny_path, vf_coef=coef, ppo_epochs=1, mini_batch_size=8, max_grad_norm=None)
        b, ref, scores = rollout_inputs(learner, batch)
        captured = {}
        original = learner.optimiser.policy_optimizer.step

        def spy(*a, **k):
            if not captured:
                captured.update({id(p): p.grad.detach().clone() for p in learner.optimiser.policy_params if p.grad is not None})
            return original(*a, **k)

        learner.optimiser.policy_optimizer.step = spy
        stats, _ = learner.update(b, ref, scores)
        assert stats.value_loss > 0
        assert abs(stats.first_minibatch_ratio_mean - 1) < token_mean_tol(b.gen_logprobs, b.response_mask)
        grads[coef] = torch.cat([g.reshape(-1) for g in captured.values()]).double()
    g_value = (grads[0.2] - grads[0.1]) / 0.1
    assert g_value.abs().max() > 1e-3 * grads[0.1].abs().max()
    # g(0.3) - g(0.1) - 0.2 g_value = g(0.3) - 2 g(0.2) + g(0.1): weights 1 + 2 + 1 on three
    # float32 gradients, each within the rounding of the largest gradient
    g_tol = rounding_tol(max(g.abs().max() for g in grads.values()), grad_terms(int(b.response_mask.sum())))
    assert (grads[0.3] - (grads[0.1] + 0.2 * g_value)).abs().max() < 4 * g_tol


@pytest.mark.equality
def test_shared_trunk_micro_batching_and_fast_options_give_the_same_update(tiny_path, batch):
    """Micro-batches of 2, 4 and 3 with every speed option: the same SGD update (adapter,
    value head and stats within update_tols)."""
    results = []
    for options in ({"micro_batch_size": 2}, {"micro_batch_size": 4}, {"micro_batch_size": 3, **FAST}):
        learner = with_sgd(shared_learner(tiny_path, **options))
        b, ref, scores = rollout_inputs(learner, batch)
        stats, weights = learner.update(b, ref, scores)
        results.append((stats, {**weights.tensors, "head": learner.value_model.head.weight.detach().clone()}))
    first, *rest = results
    tols = update_tols(learner.config, b, first[1])
    for result in rest:
        assert_same_update(result, first, tols, keys=("policy_loss", "value_loss", "approx_kl", "explained_variance"))


def test_shared_trunk_refuses_a_value_model_of_its_own():
    with pytest.raises(ConfigError, match="value_model_name.*must be null with value_model: shared"):
        PPOConfig(value_model="shared", value_model_name="rm")
    with pytest.raises(ConfigError, match="value_model"):
        PPOConfig(value_model="twin")


def test_merged_lora_runs_in_the_learners_forwards(tiny_path, plain, monkeypatch):
    """lora_kernel=merged is not silently PEFT's or the fused path: the no-grad pass and the
    PPO epochs go through _MergedLoRA (dropout is off in the learner's forwards by default)."""
    import learner.kernels as kernels

    calls = []
    apply = kernels._MergedLoRA.apply
    monkeypatch.setattr(kernels._MergedLoRA, "apply", lambda *a: calls.append(torch.is_grad_enabled()) or apply(*a))
    b, ref, scores, _, _, _ = plain
    learner_with(tiny_path, lora_kernel="merged").update(b, ref, scores)
    assert False in calls and True in calls  # the no-grad pass and the epochs


def test_lora_export_in_one_flat_copy_equals_per_tensor_copies():
    """learner._tensors_to_cpu's one-transfer path (what a GPU learner takes): the same values,
    shapes, dtypes and key order as per-tensor copies, each tensor contiguous with its own
    storage (safetensors refuses shared storage) and not the source's."""
    from learner.learner import _tensors_to_cpu as _to_cpu

    g = torch.Generator().manual_seed(0)
    src = {"a": torch.randn(4, 3, generator=g), "b": torch.randn(2, 5, generator=g).t(),
           "c": torch.randn(7, generator=g).to(torch.bfloat16), "d": torch.randn(3, 1, generator=g)}
    flat, plain = _to_cpu(src, flat=True), _to_cpu(src)
    assert list(flat) == list(src) == list(plain)
    for k in src:
        assert torch.equal(flat[k], src[k]) and torch.equal(plain[k], src[k])
        assert flat[k].dtype == src[k].dtype and flat[k].is_contiguous()
        assert flat[k].untyped_storage().data_ptr() != src[k].untyped_storage().data_ptr()
    ptrs = [flat[k].untyped_storage().data_ptr() for k in flat]
    assert len(set(ptrs)) == len(ptrs)


# ------------------------------------------------------------------ old_logprobs: generator
@pytest.mark.equality
@pytest.mark.parametrize("options", [{}, FAST, {"value_model": "shared", **FAST}], ids=["plain", "fast", "shared"])
def test_generator_old_logprobs_skip_the_policys_pass_and_give_the_same_update(tiny_path, batch, options):
    """old_logprobs: generator, with the generator's logprobs equal to the learner's (as vLLM's
    are in float32, to ~5e-6): three SGD updates equal old_logprobs: learner's (stats and new
    adapters within update_tols), and at the version between two checks (check_every 2:
    versions 0 and 2 recompute) no-grad pass computes no policy logits (lm_head; with separate
    models no policy decoder either). Its entropy stat is then the sampled tokens' mean
    -logprob (a float32 mean of the same values, summed in another order), and the
    generator-vs-learner gap is not measured (NaN)."""
    shared = options.get("value_model") == "shared"
    runs = {}
    for mode in ("learner", "generator"):
        make = shared_learner if shared else learner_with
        opts = {k: v for k, v in options.items() if k != "value_model"} if shared else options
        learner = with_sgd(make(tiny_path, old_logprobs=mode, old_logprobs_check_every=2, **opts))
        no_grad_calls = {"lm_head": 0, "decoder": 0}
        for name, module in (("lm_head", learner.speed.lm_head), ("decoder", learner.speed.decoder)):
            module.register_forward_hook(
                lambda m, a, o, name=name: no_grad_calls.__setitem__(name, no_grad_calls[name]
                                                                     + (not torch.is_grad_enabled())))
        runs[mode] = []
        for version in range(3):
            b, ref, scores = rollout_inputs(learner, batch, seed=version)  # gen_logprobs = the learner's
            for name in no_grad_calls:
                no_grad_calls[name] = 0
            stats, weights = learner.update(b, ref, scores)
            gen = b.gen_logprobs[b.response_mask]
            tols = update_tols(learner.config, b, weights.tensors, updates=version + 1)
            mean_tol = rounding_tol(gen.abs().max(), gen.numel())  # one float32 mean, summed in another order
            runs[mode].append((stats, weights.tensors, dict(no_grad_calls), -gen.mean().item(), tols, mean_tol))
    for version, ((s_l, w_l, calls_l, *_), (s_g, w_g, calls_g, estimate, tols, mean_tol)) in enumerate(
            zip(runs["learner"], runs["generator"])):
        assert_same_update((s_g, w_g), (s_l, w_l), tols, keys=(
            "policy_loss", "value_loss", "approx_kl", "clipfrac", "kl", "kl_per_token", "explained_variance",
            "shaped_reward_mean", "advantage_mean", "return_mean", "value_mean", "first_minibatch_ratio_mean",
            "policy_grad_norm", "value_grad_norm"))
        assert calls_l["lm_head"] > 0 and math.isfinite(s_l.gen_logprob_max_abs_diff)
        if version == 1:  # between checks: the generator's logprobs
            assert calls_g["lm_head"] == 0 and (shared or calls_g["decoder"] == 0)
            assert math.isnan(s_g.gen_logprob_max_abs_diff) and s_g.behaviour_logprob_gap == 0
            assert s_g.entropy == pytest.approx(estimate, abs=mean_tol)
        else:  # a check: the learner recomputes, as with old_logprobs: learner
            assert calls_g == calls_l
            assert s_g.gen_logprob_max_abs_diff < tols["logprob"]
            assert s_g.entropy == pytest.approx(s_l.entropy, abs=tols["logprob"])


# ------------------------------------------------------------------ old_values: update
@pytest.mark.equality
@pytest.mark.parametrize("options, model", [({}, "tiny_path"), (FAST, "tiny_path"), ({}, "attention_dropout_path")],
                         ids=["plain", "fast", "attention_dropout"])
def test_old_values_from_the_update_skip_the_value_pass_and_give_the_same_update(request, batch, options, model):
    """old_values: update (one minibatch per epoch, 2 epochs): the value model's no-grad pass
    does not run, its first training forward gives the old values, and three SGD updates
    equal old_values: forward's: the stats, both models' new weights and each update's
    experience (old values, returns, advantages) within update_tols. The two differ only in
    float rounding: values from a training forward instead of a no-grad one, and the value
    gradient summed before the policy's instead of between its micro-batches. Also for a
    model whose config has attention_dropout 0.3 (test_learner.attention_dropout_path): the
    training forward is dropout-free there too, or its values would be a dropout sample."""
    runs = {}
    for mode in ("forward", "update"):
        learner = with_sgd(learner_with(request.getfixturevalue(model), old_values=mode, mini_batch_size=None,
                                        **options))
        with torch.no_grad():  # a head that is not 0, so the old values say something from the first update
            learner.value_model.head.weight.copy_(0.1 * torch.randn(learner.value_model.head.weight.shape,
                                                                    generator=torch.Generator().manual_seed(7)))
        assert learner.values_in_update(len(batch)) == (mode == "update")
        kept = keep_experience(learner)
        no_grad_values = [0]
        learner.value_model.register_forward_hook(
            lambda m, a, o: no_grad_values.__setitem__(0, no_grad_values[0] + (not torch.is_grad_enabled())))
        runs[mode] = []
        for version in range(3):
            b, ref, scores = rollout_inputs(learner, batch, seed=version)
            no_grad_values[0] = 0
            stats, weights = learner.update(b, ref, scores)
            tols = update_tols(learner.config, b, weights.tensors, updates=version + 1)
            runs[mode].append((stats, {**weights.tensors, **value_params(learner)}, no_grad_values[0], tols))
        runs[mode] = [(*run, exp) for run, exp in zip(runs[mode], kept)]
    for (s_f, w_f, calls_f, _, e_f), (s_u, w_u, calls_u, tols, e_u) in zip(runs["forward"], runs["update"]):
        assert calls_f > 0 and calls_u == 0
        for name in ("values", "returns", "advantages", "rewards"):
            atol = tols["row"] if name in ("returns", "advantages") else tols["logprob"]
            torch.testing.assert_close(getattr(e_u, name), getattr(e_f, name), atol=atol, rtol=0,
                                       msg=lambda m, name=name: f"experience.{name}: {m}")
        assert_same_update((s_u, w_u), (s_f, w_f), tols)


@pytest.mark.parametrize("overrides, match", [
    ({"mini_batch_size": 4}, r"'old_values' .*one minibatch per epoch .*got 4"),
    ({"value_model": "shared"}, r"'old_values' .*value_model: separate"),
    ({"ppo_dropout": True}, r"'old_values' .*ppo_dropout: false"),
])
def test_old_values_update_refuses_what_it_cannot_do(overrides, match):
    with pytest.raises(ConfigError, match=match):
        make_config(old_values="update", **{"mini_batch_size": None, **overrides})


def test_old_values_auto_takes_the_update_where_it_applies():
    assert make_config(mini_batch_size=None).old_values_source == "update"
    assert make_config(mini_batch_size=8).old_values_source == "update"  # batch_size 8
    assert make_config(mini_batch_size=4).old_values_source == "forward"
    assert make_config(mini_batch_size=None, ppo_dropout=True).old_values_source == "forward"
    assert make_config(mini_batch_size=None, value_model="shared").old_values_source == "forward"
    assert make_config(mini_batch_size=None, old_values="forward").old_values_source == "forward"


def test_generator_old_logprobs_refuse_non_finite_generator_logprobs(tiny_path, batch):
    learner = learner_with(tiny_path, old_logprobs="generator")
    learner.version = 1  # between checks (every 10)
    b, ref, scores = rollout_inputs(learner, batch)
    gen = b.gen_logprobs.clone()
    gen[3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"generator's logprobs are not finite .* rows \[3\]"):
        learner.update(replace(b, gen_logprobs=gen), ref, scores)


@pytest.mark.equality
def test_generator_old_logprobs_with_stale_rollouts(tiny_path, batch):
    """max_staleness 1: rollouts one version behind, between checks: the ratio's
    denominator and KL_t use the generator's (behaviour) logprobs; nothing of the current
    policy is recomputed, so the behaviour gap is not measured."""
    learner = learner_with(tiny_path, old_logprobs="generator", max_staleness=1)
    b, ref, scores = rollout_inputs(learner, batch)  # sampled at version 0
    learner.update(b, ref, scores)  # version 0 -> 1 (a check)
    stats, _ = learner.update(b, ref, scores)  # version 1, rollouts of version 0
    assert stats.stale_versions == 1 and math.isnan(stats.behaviour_logprob_gap)
    assert math.isnan(stats.gen_logprob_max_abs_diff)
    assert all(math.isfinite(getattr(stats, k)) for k in ("policy_loss", "value_loss", "kl", "entropy"))
    gen = b.gen_logprobs[b.response_mask]
    # the sampled tokens' mean -logprob: one float32 mean, summed in another order
    assert stats.entropy == pytest.approx(-gen.mean().item(), abs=rounding_tol(gen.abs().max(), gen.numel()))


@pytest.mark.parametrize("overrides, match", [
    ({"top_k": 50, "top_p": 1.0}, r"'old_logprobs' .*untruncated sampling .*top_k=50"),
    ({"top_k": 0, "top_p": 0.95}, r"'old_logprobs' .*top_p=0.95"),
    ({"top_k": 0, "top_p": 1.0, "dtype": "bfloat16"}, r"'old_logprobs' .*float32 \(got bfloat16\)"),
    ({"old_logprobs": "learner", "old_logprobs_check_every": 0}, r"'old_logprobs_check_every' .*must be >= 1"),
])
def test_generator_old_logprobs_are_validated(overrides, match):
    with pytest.raises(ConfigError, match=match):
        PPOConfig(**{"old_logprobs": "generator", **overrides})
    PPOConfig(old_logprobs="generator", top_k=-1, top_p=1.0)  # -1 is off too
