"""lora_sync="merged": the LoRA merged into the vLLM engine's own weights (actors/vllm_merge.py).

The merge math against PEFT's own merge (no vLLM), then a Generator on an engine of its own
(worker_extension_cls, no LoRA kernels) against HF + PEFT: same logprobs as the learner's
PEFT forward for every version, and version 0 gives the base model back.

Tolerances (tests/tolerances.py): vLLM's CPU kernels and HF + PEFT are two float32
computations of the tiny model's logprobs (logprob_tol); the merge W + s B A is rounded
through a reduction over the rank.
"""

from __future__ import annotations

import pytest
import torch

from ppo_ray.modeling import LoraWeights
from helpers import PROMPTS, continuation_logprobs, hf_logprobs, make_peft, randomize_lora
from tolerances import TINY_TERMS, rounding_tol


def logprob_tol(*logprobs: torch.Tensor) -> float:
    """Tolerance of the tiny model's float32 logprobs computed by vLLM and by HF + PEFT: the
    rounding of its reductions at the size of the largest finite |logprob| given."""
    return rounding_tol(max(x[torch.isfinite(x)].abs().max() for x in logprobs), TINY_TERMS)


@pytest.mark.equality
def test_merged_weights_equal_peft_merge(tiny_model_dir):
    from actors.vllm_merge import base_weight_name, merged_weights, read_base_weights

    peft_model = make_peft(tiny_model_dir)
    lora = randomize_lora(peft_model, seed=5)
    names = {base_weight_name(k) for k in lora.tensors}
    assert "model.layers.0.self_attn.q_proj.weight" in names and len(names) == 14
    base = read_base_weights(tiny_model_dir, names)
    merged = dict(merged_weights(base, lora.tensors, scale=lora.spec.scaling))
    assert lora.spec.scaling == 16 / 8
    reference = peft_model.merge_and_unload().state_dict()
    for name, w in merged.items():
        # W + s (B @ A): r products summed, scaled, added, at the size of W and of s B A
        size = max(base[name].abs().max(), (reference[name] - base[name]).abs().max())
        torch.testing.assert_close(w, reference[name], atol=rounding_tol(size, lora.spec.r + 2), rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")
    with pytest.raises(ValueError, match="no base weight"):
        read_base_weights(tiny_model_dir, {"model.layers.9.self_attn.q_proj.weight"})


@pytest.fixture(scope="module")
def merged_generator(tiny_model_dir):
    from actors.generator import Generator
    from actors.lora_sync import MergedSync
    from actors.vllm_engine import build_llm

    llm = build_llm(tiny_model_dir, dtype="float32", seed=0, **MergedSync.engine_args(lora_r=8))
    gen = Generator(llm, model_dir=tiny_model_dir, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=16,
                    seed=0, max_prompt_length=64, lora_sync="merged")
    yield gen
    gen.close()
    try:
        llm.llm_engine.engine_core.shutdown(timeout=10)
    except Exception:  # pragma: no cover - best effort
        pass


@pytest.mark.equality
def test_merged_sync_matches_peft(merged_generator, tiny_model_dir):
    from ppo_ray.modeling import load_causal_lm, load_tokenizer

    gen = merged_generator
    tok = load_tokenizer(str(tiny_model_dir))
    hf = load_causal_lm(str(tiny_model_dir))
    peft_model = make_peft(tiny_model_dir)
    prompt = tok(PROMPTS[0], add_special_tokens=False)["input_ids"]
    cont = tok(" My friend stopped calling me.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    base_lp = continuation_logprobs(hf, prompt, cont)
    assert (gen.sequence_logprobs(prompt, cont) - base_lp).abs().max() < logprob_tol(base_lp)

    w = randomize_lora(peft_model, seed=1)
    zero = LoraWeights({k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in w.tensors.items()}, w.spec)
    for version, seed in ((1, 1), (2, 2)):
        w = randomize_lora(peft_model, seed=seed)
        out = gen.load_adapter(version, w)
        assert gen.version == out.version == version and out.nbytes > 0 and out.write_s == 0.0
        assert gen.sync.lora_request is None
        lp = continuation_logprobs(peft_model, prompt, cont)
        got = gen.sequence_logprobs(prompt, cont)
        assert (got - lp).abs().max() < logprob_tol(lp) and (got - base_lp).abs().max() > 0.05
        batch = gen.generate(PROMPTS * 2, step=version)
        assert batch.adapter_version == version
        diff = (hf_logprobs(peft_model, batch) - batch.gen_logprobs).abs()[batch.response_mask]
        tol = logprob_tol(batch.gen_logprobs[batch.response_mask])
        assert diff.max() < tol, f"max |vLLM merged - HF+PEFT| {diff.max():.2e} (tolerance {tol:.2e})"

    # back to version 0 (B = 0, a learner restarted without a checkpoint): the base weights exactly
    gen.load_adapter(0, zero, restore=True)
    assert gen.version == 0
    assert (gen.sequence_logprobs(prompt, cont) - base_lp).abs().max() < logprob_tol(base_lp)
    with pytest.raises(ValueError, match="not newer"):
        gen.load_adapter(0, zero)


# Prompts over two KV blocks (the CPU block is 128 tokens; GPUs use 16): whole blocks of them
# are cached by the first generate and would be reused by the second.
LONG_PROMPTS = ["SUBREDDIT: r/advice\n\nTITLE: the same long post twice\n\nPOST: " + f"story {i}: "
                + "we talked about it again and again, for weeks. " * 24 + "\n\nTL;DR:" for i in range(3)]


@pytest.mark.equality
@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_sampled_logprobs_after_a_sync_use_the_new_weights_on_cached_prompts(
        mode, vllm_llm, merged_generator, tiny_model_dir):
    """generate, sync a new version, generate the SAME long prompts again: the sampled
    tokens' logprobs must be the new version's (HF + PEFT), not KV from the old weights'
    prefix cache. Before the merged sync reset the cache, the gap here was ~1 nat."""
    from actors.generator import Generator

    llm = vllm_llm if mode == "adapter" else merged_generator.llm
    gen = Generator(llm, model_dir=tiny_model_dir, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=12,
                    seed=0, max_prompt_length=512, lora_sync=mode)
    try:
        block = llm.llm_engine.vllm_config.cache_config.block_size
        lengths = [len(ids) for ids in gen._encode(LONG_PROMPTS)[0]]
        assert min(lengths) >= 2 * block, (lengths, block)
        peft_model = make_peft(tiny_model_dir)
        gen.load_adapter(1, randomize_lora(peft_model, seed=11))
        gen.generate(LONG_PROMPTS, step=0)  # fills the prefix cache under version 1
        gen.load_adapter(2, randomize_lora(peft_model, seed=12))  # peft_model now holds version 2
        batch = gen.generate(LONG_PROMPTS, step=1)
        assert batch.adapter_version == 2
        diff = (hf_logprobs(peft_model, batch) - batch.gen_logprobs).abs()[batch.response_mask]
        tol = logprob_tol(batch.gen_logprobs[batch.response_mask])
        assert diff.max() < tol, f"{mode}: max |vLLM - HF+PEFT| at the new version {diff.max():.2e} (tolerance {tol:.2e})"
    finally:
        gen.close()


def test_merged_sync_into_a_bfloat16_engine_from_float32_files(tiny_model_dir):
    """A bfloat16 engine on float32 safetensors (the main job's SFT model under --dtype
    bfloat16): the merge is cast to the engine's dtype before vLLM packs it again. Without
    the cast the CPU engine packed float32 weights for bfloat16 activations and sampled
    tokens with non-finite logprobs from the first synced version on."""
    from actors.generator import Generator
    from actors.lora_sync import MergedSync
    from actors.vllm_engine import build_llm
    from ppo_ray.modeling import load_causal_lm, load_tokenizer

    llm = build_llm(tiny_model_dir, dtype="bfloat16", seed=0, **MergedSync.engine_args(lora_r=8))
    gen = Generator(llm, model_dir=tiny_model_dir, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=16,
                    seed=0, max_prompt_length=64, lora_sync="merged")
    try:
        tok = load_tokenizer(str(tiny_model_dir))
        prompt = tok(PROMPTS[0], add_special_tokens=False)["input_ids"]
        cont = tok(" My friend stopped calling me.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        base_lp = continuation_logprobs(load_causal_lm(str(tiny_model_dir)), prompt, cont)  # float32
        peft_model = make_peft(tiny_model_dir)
        gen.load_adapter(1, randomize_lora(peft_model, seed=1))
        got = gen.sequence_logprobs(prompt, cont)
        want = continuation_logprobs(peft_model, prompt, cont)  # float32 HF + PEFT, version 1
        assert torch.isfinite(got).all()
        # bfloat16 rounding only: far closer to the adapted model than to the base
        assert (got - want).abs().mean() < 0.25 * (got - base_lp).abs().mean(), (got, want, base_lp)
        batch = gen.generate(PROMPTS * 2, step=1)  # raises on a non-finite sampled logprob
        assert batch.adapter_version == 1 and torch.isfinite(batch.gen_logprobs[batch.response_mask]).all()
    finally:
        gen.close()
        try:
            llm.llm_engine.engine_core.shutdown(timeout=10)
        except Exception:  # pragma: no cover - best effort
            pass
