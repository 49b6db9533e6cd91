"""Generator (vLLM + LoRA hot-swap) against HF/PEFT on the embedded tiny model.

One shared engine (the session fixture ``vllm_llm``); every Generator made here is closed,
so no adapter outlives its test.
"""

from __future__ import annotations

import os

import pytest
import torch

from ppo_ray.batch import RolloutBatch
from ppo_ray.config import ALL_PROJECTIONS
from ppo_ray.data import encode_prompts
from ppo_ray.modeling import LoraSpec, LoraWeights, load_causal_lm, load_tokenizer
from helpers import PROMPTS, continuation_logprobs, hf_logprobs, make_peft, randomize_lora
from tolerances import TINY_TERMS, rounding_tol


def tol(*logprobs: torch.Tensor) -> float:
    """Float32 logprobs of the tiny model computed two ways (vLLM vs HF + PEFT, or two engine
    calls): the rounding of its reductions at the size of the largest finite |logprob|."""
    return rounding_tol(max(x[torch.isfinite(x)].abs().max() for x in logprobs), TINY_TERMS)

@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return load_causal_lm(str(tiny_model_dir))


@pytest.fixture
def make_generator(vllm_llm, tokenizer, tiny_model_dir):
    from actors.generator import Generator

    made = []

    def make(**kw):
        settings = dict(model_dir=tiny_model_dir, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=16, seed=0,
                        max_prompt_length=64)
        settings.update(kw)
        gen = Generator(vllm_llm, tokenizer, **settings)
        made.append(gen)
        return gen

    yield make
    for gen in made:
        gen.close()


# ---------------------------------------------------------------------------- layout
def test_generate_layout(make_generator, tokenizer):
    # 32 rollouts x 64 tokens: the tiny model ends some summaries with EOS and runs on in
    # others, so both finish reasons show up (seeded, hence deterministic).
    gen = make_generator(max_new_tokens=64)
    prompts = PROMPTS * 8
    batch = gen.generate(prompts, step=0)
    b = len(prompts)
    enc = encode_prompts(tokenizer, prompts, 64)
    p = max(len(x) for x in enc)
    assert batch.prompt_ids.shape == (b, p) and batch.prompt_mask.dtype == torch.bool
    assert batch.response_ids.shape[0] == b and batch.response_ids.shape[1] <= 64
    assert batch.gen_logprobs.dtype == torch.float32
    assert batch.adapter_version == 0
    assert (batch.pad_token_id, batch.eos_token_id) == (tokenizer.pad_token_id, tokenizer.eos_token_id)
    assert batch.prompts == prompts and len(batch.responses) == len(batch.finish_reasons) == b

    for i in range(b):
        # prompts left-padded: pads then exactly the encoded prompt
        n = len(enc[i])
        assert batch.prompt_ids[i, p - n:].tolist() == enc[i]
        assert batch.prompt_mask[i].tolist() == [False] * (p - n) + [True] * n
        assert (batch.prompt_ids[i, : p - n] == tokenizer.pad_token_id).all()
        # responses right-padded; mask is a prefix; nothing real after the first EOS
        m = batch.response_mask[i]
        L = int(m.sum())
        assert L >= 1 and m[:L].all() and not m[L:].any()
        real = batch.response_ids[i, :L].tolist()
        assert (batch.response_ids[i, L:] == tokenizer.pad_token_id).all()
        assert (batch.gen_logprobs[i, L:] == 0).all() and (batch.gen_logprobs[i, :L] < 0).all()
        # (a model can sample the pad token: it is then a real token, as the mask says --
        # consumers use response_mask, never "ids != pad")
        assert tokenizer.eos_token_id not in real[:-1]
        if batch.finish_reasons[i] == "stop":
            assert real[-1] == tokenizer.eos_token_id
        else:
            assert batch.finish_reasons[i] == "length" and L == 64
        shown = real[:-1] if batch.finish_reasons[i] == "stop" else real
        assert batch.responses[i] == tokenizer.decode(shown, skip_special_tokens=True)
    assert batch.has_eos.tolist() == [r == "stop" for r in batch.finish_reasons]
    assert set(batch.finish_reasons) == {"stop", "length"}, "want both kinds of responses in this test"


def test_generate_token_id_prompts_and_truncation(make_generator, tokenizer):
    long_text = PROMPTS[0]
    ids = tokenizer(long_text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 8
    gen = make_generator(max_prompt_length=8, prompt_truncation="left", max_new_tokens=4)
    from_text = gen.generate([long_text], step=0)
    from_ids = gen.generate([ids], step=0)
    assert from_text.prompt_ids[0].tolist() == ids[-8:]  # the LAST tokens are kept
    assert torch.equal(from_text.response_ids, from_ids.response_ids)
    strict = make_generator(max_prompt_length=8, max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 is .* over max_prompt_length=8.*prompt_truncation: left"):
        strict.generate(["Hi", long_text], step=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        strict.generate([[1, 2, 10_000]], step=0)
    with pytest.raises(ValueError, match="no prompts"):
        strict.generate([], step=0)


# ---------------------------------------------------------------------------- logprobs
@pytest.mark.equality
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 50, 0.95)])
def test_gen_logprobs_match_hf(make_generator, hf_model, temperature, top_k, top_p):
    gen = make_generator(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=16)
    batch = gen.generate(PROMPTS * 2, step=1)
    ref = hf_logprobs(hf_model, batch, temperature, top_k, top_p)
    diff = (ref - batch.gen_logprobs).abs()[batch.response_mask]
    assert diff.max() < tol(ref[batch.response_mask]), f"max |vLLM - HF| logprob difference {diff.max():.2e}"
    if top_k:  # the truncation matters: the full-softmax logprobs are clearly different
        full = hf_logprobs(hf_model, batch, temperature)
        assert (full - batch.gen_logprobs).abs()[batch.response_mask].max() > 0.1


# ---------------------------------------------------------------------------- seeds
@pytest.mark.equality
def test_seeds(make_generator):
    gen = make_generator(max_new_tokens=12)
    copies = gen.generate([PROMPTS[1]] * 4, step=0)
    assert len({tuple(r.tolist()) for r in copies.response_ids}) == 4, "identical prompts must get different samples"

    a = gen.generate(PROMPTS, step=5)
    again = gen.generate(PROMPTS, step=5)
    other = gen.generate(PROMPTS, step=6)
    assert torch.equal(a.response_ids, again.response_ids) and torch.equal(a.gen_logprobs, again.gen_logprobs)
    assert not torch.equal(a.response_ids[:, :4], other.response_ids[:, :4])

    # Replica split: two generators with the same run seed, prompts split at index 2.
    replica = make_generator(max_new_tokens=12)
    parts = RolloutBatch.cat([gen.generate(PROMPTS[:2], step=5),
                              replica.generate(PROMPTS[2:], step=5, prompt_offset=2)])
    assert torch.equal(parts.response_ids, a.response_ids)
    assert torch.equal(parts.prompt_ids, a.prompt_ids) and torch.equal(parts.response_mask, a.response_mask)
    # the same samples in other batches: vLLM's CPU kernels round them differently
    torch.testing.assert_close(parts.gen_logprobs, a.gen_logprobs, rtol=0, atol=tol(a.gen_logprobs))
    assert parts.responses == a.responses

    other_seed = make_generator(max_new_tokens=12, seed=1).generate(PROMPTS, step=5)
    assert not torch.equal(other_seed.response_ids[:, :4], a.response_ids[:, :4])


def test_greedy_decoding_takes_the_models_argmax_whatever_the_seed(make_generator, hf_model):
    """greedy (evaluation's pass@1): every token is the HF model's argmax after the prompt and
    the tokens before it (within float32 rounding of the top two logits), the same for any
    step or seed; one sample per prompt, and not with the probe."""
    gen = make_generator(max_new_tokens=8)
    a = gen.generate(PROMPTS, step=5, greedy=True)
    b = make_generator(max_new_tokens=8, seed=3).generate(PROMPTS, step=9, greedy=True)
    assert torch.equal(a.response_ids, b.response_ids) and a.responses == b.responses
    with torch.no_grad():
        for i in range(len(b)):
            prompt = b.prompt_ids[i][b.prompt_mask[i]]
            resp = b.response_ids[i][b.response_mask[i]]
            logits = hf_model(torch.cat([prompt, resp]).unsqueeze(0)).logits[0, len(prompt) - 1:-1].float()
            top = logits.max(dim=-1).values
            chosen = logits.gather(1, resp.unsqueeze(1)).squeeze(1)
            assert (top - chosen <= tol(top)).all(), f"row {i}: a token is not the argmax"
    for bad in (dict(probe=True), dict(samples_per_prompt=2)):
        with pytest.raises(ValueError, match="greedy decoding is for evaluation, one sample per prompt"):
            gen.generate(PROMPTS, step=0, greedy=True, **bad)


# ---------------------------------------------------------------------------- LoRA sync
def broken_adapters(w: LoraWeights) -> tuple[LoraWeights, LoraWeights]:
    """(an adapter of `w`'s shapes for a module vLLM serves no LoRA on, `w` at rank 32 = 4 x its
    rank: above the shared engine's max_lora_rank 16)."""
    bad = LoraWeights({k.replace("q_proj", "qq_proj"): v for k, v in w.tensors.items()}, w.spec)
    wide = LoraWeights({k: v.repeat(4, 1) if ".lora_A." in k else v.repeat(1, 4) for k, v in w.tensors.items()},
                       LoraSpec(4 * w.spec.r, 4 * w.spec.lora_alpha, w.spec.target_modules))
    return bad, wide


@pytest.mark.equality
def test_lora_sync(make_generator, tiny_model_dir, hf_model, tokenizer, vllm_llm):
    engine = vllm_llm.llm_engine
    gen = make_generator(max_new_tokens=16)
    peft_model = make_peft(tiny_model_dir)
    prompt = tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    cont = tokenizer(" My friend stopped calling me.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    # version 0 = base model: prompt logprobs are raw log_softmax at temperature 1
    base_lp = continuation_logprobs(hf_model, prompt, cont)
    assert (gen.sequence_logprobs(prompt, cont) - base_lp).abs().max() < tol(base_lp)

    w1 = randomize_lora(peft_model, seed=1)
    assert len(w1.tensors) == 2 * 7 * 2 and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in w1.tensors)
    assert w1.spec == LoraSpec(8, 16, tuple(sorted(ALL_PROJECTIONS)), 0.0)
    report = gen.load_adapter(1, w1)
    assert report.version == gen.version == 1 and report.nbytes == w1.nbytes
    assert min(report.write_s, report.register_s, report.retire_s) > 0
    assert set(engine.list_loras()) == {gen.sync.lora_request.lora_int_id}

    v1_lp = continuation_logprobs(peft_model, prompt, cont)
    got = gen.sequence_logprobs(prompt, cont)
    assert (got - v1_lp).abs().max() < tol(v1_lp)
    assert (got - base_lp).abs().max() > 0.05, "the adapter did not change the generator's policy"

    batch = gen.generate(PROMPTS * 2, step=2)
    assert batch.adapter_version == 1
    ref = hf_logprobs(peft_model, batch)
    diff = (ref - batch.gen_logprobs).abs()[batch.response_mask]
    assert diff.max() < tol(ref[batch.response_mask]), f"max |vLLM+LoRA - HF+PEFT| {diff.max():.2e}"

    # version 2 replaces version 1 everywhere
    old_id, old_dir = gen.sync.lora_request.lora_int_id, gen.sync.lora_request.lora_path
    w2 = randomize_lora(peft_model, seed=2)
    gen.load_adapter(2, w2)
    assert set(engine.list_loras()) == {gen.sync.lora_request.lora_int_id} and old_id not in set(engine.list_loras())
    assert [p.name for p in gen.adapter_root.iterdir()] == [gen.sync.lora_request.lora_path.rsplit("/", 1)[1]]
    assert not os.path.exists(old_dir)
    v2_lp = continuation_logprobs(peft_model, prompt, cont)
    assert (gen.sequence_logprobs(prompt, cont) - v2_lp).abs().max() < tol(v2_lp)
    assert (v2_lp - v1_lp).abs().max() > 0.05
    assert gen.generate(PROMPTS[:1], step=3).adapter_version == 2

    # stale or repeated versions are errors, and change nothing
    for stale in (2, 1, 0):
        with pytest.raises(ValueError, match="not newer than the current version 2"):
            gen.load_adapter(stale, w1)
    assert gen.version == 2

    # a broken adapter fails in load_adapter (not silently at the next generate)
    bad, wide = broken_adapters(w1)
    with pytest.raises(RuntimeError, match="version 3"):
        gen.load_adapter(3, bad)
    wrong_rank = LoraWeights({k: v[:4] if ".lora_A." in k else v[:, :4] for k, v in w1.tensors.items()}, w1.spec)
    with pytest.raises(ValueError, match="rank lora_r=8"):
        gen.load_adapter(3, wrong_rank)
    with pytest.raises(ValueError, match="lora_r=32 is above the engine's max_lora_rank=16"):
        gen.load_adapter(3, wide)
    assert gen.version == 2 and len(list(gen.adapter_root.iterdir())) == 1
    assert (gen.sequence_logprobs(prompt, cont) - v2_lp).abs().max() < tol(v2_lp)

    # many syncs: nothing accumulates in the engine or on disk
    for v in range(3, 13):
        gen.load_adapter(v, w1 if v % 2 else w2)
        assert len(set(engine.list_loras())) <= 1 and len(list(gen.adapter_root.iterdir())) == 1
    assert (gen.sequence_logprobs(prompt, cont) - v2_lp).abs().max() < tol(v2_lp)  # v12 = w2

    # r and alpha come with the weights: the same tensors with alpha x 2 are another policy,
    # the one PEFT computes with that config
    from peft import get_peft_model, set_peft_model_state_dict

    doubled = LoraWeights(w2.tensors, LoraSpec(8, 32, w2.spec.target_modules))
    peft_doubled = get_peft_model(load_causal_lm(str(tiny_model_dir)), doubled.spec.peft_config()).eval()
    set_peft_model_state_dict(peft_doubled, doubled.tensors)
    gen.load_adapter(13, doubled)
    v2_alpha_lp = continuation_logprobs(peft_doubled, prompt, cont)
    assert (gen.sequence_logprobs(prompt, cont) - v2_alpha_lp).abs().max() < tol(v2_alpha_lp)
    assert (v2_alpha_lp - v2_lp).abs().max() > 0.05

    # restore (a rollback to a checkpoint after a learner restart) may go back in versions
    gen.load_adapter(1, w1, restore=True)
    assert gen.version == 1 and len(list(gen.adapter_root.iterdir())) == 1
    assert (gen.sequence_logprobs(prompt, cont) - v1_lp).abs().max() < tol(v1_lp)

    gen.close()
    assert set(engine.list_loras()) == set() and not gen.adapter_root.exists()
    with pytest.raises(RuntimeError, match="closed"):
        gen.generate(PROMPTS, step=0)


# ---------------------------------------------------------------------------- prompts
def test_batch_larger_than_one_prefill_step(make_generator, vllm_llm):
    """More prompt tokens than the scheduler prefills in one step: vLLM 0.32 on the CPU
    crashes on chunked prefills of seeded requests, so the generator groups the batch;
    the samples must not depend on the grouping (per-prompt seeds)."""
    gen = make_generator(max_new_tokens=8, max_prompt_length=512)
    budget = vllm_llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    long_prompt = "SUBREDDIT: r/advice\n\nTITLE: a long one\n\nPOST: " + "we talked about it again. " * 40 + "\n\nTL;DR:"
    n_tokens = len(gen.tokenizer(long_prompt)["input_ids"])
    n = budget // n_tokens + 3  # the batch cannot prefill in one step
    prompts = [long_prompt] * n
    assert len(gen._prefill_groups([[0] * n_tokens] * n)) >= 2
    big = gen.generate(prompts, step=7)
    few = gen.generate(prompts[-2:], step=7, prompt_offset=n - 2)
    assert big.responses[-2:] == few.responses


@pytest.mark.equality
def test_tensor_sync_samples_what_adapter_sync_samples_with_no_file(make_generator, tiny_model_dir, hf_model,
                                                                     tokenizer, vllm_llm):
    """lora_sync tensor: the learner's tensors registered in vLLM's worker from memory. The
    same adapter gives the same samples and logprobs, bit for bit, as the file path (the same
    LoRA kernels on the same weights); nothing is written per version; a broken adapter fails
    in the load as the file path's does; many versions leave one adapter in the engine."""
    engine = vllm_llm.llm_engine
    peft_model = make_peft(tiny_model_dir)
    w1, w2 = randomize_lora(peft_model, seed=1), randomize_lora(peft_model, seed=2)
    by_file = make_generator(lora_sync="adapter")
    by_file.load_adapter(1, w1)
    want = by_file.generate(PROMPTS * 2, step=4)
    by_file.close()

    gen = make_generator(lora_sync="tensor")
    report = gen.load_adapter(1, w1)
    assert report.write_s == 0.0 and report.nbytes == w1.nbytes  # no file written
    assert list(gen.adapter_root.iterdir()) == []  # no file
    assert set(engine.list_loras()) == {gen.sync.lora_request.lora_int_id}
    got = gen.generate(PROMPTS * 2, step=4)
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.gen_logprobs, want.gen_logprobs)
    prompt = tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    cont = tokenizer(" My friend stopped calling me.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(peft_model, w1.tensors)  # randomize_lora left w2's values in it
    v1_lp = continuation_logprobs(peft_model, prompt, cont)
    assert (gen.sequence_logprobs(prompt, cont) - v1_lp).abs().max() < tol(v1_lp)

    # a broken adapter fails in the load and leaves version 1 in place
    bad, wide = broken_adapters(w1)
    with pytest.raises(RuntimeError, match="version 2 into vLLM from memory failed: .*qq_proj"):
        gen.load_adapter(2, bad)
    with pytest.raises(ValueError, match="lora_r=32 is above the engine's max_lora_rank=16"):
        gen.load_adapter(2, wide)
    assert gen.version == 1 and set(engine.list_loras()) == {gen.sync.lora_request.lora_int_id}
    assert (gen.sequence_logprobs(prompt, cont) - v1_lp).abs().max() < tol(v1_lp)

    for v in range(2, 9):  # versions replace each other: one adapter alive, nothing on disk
        gen.load_adapter(v, w1 if v % 2 else w2)
        assert len(set(engine.list_loras())) == 1 and list(gen.adapter_root.iterdir()) == []
    set_peft_model_state_dict(peft_model, w2.tensors)
    v2_lp = continuation_logprobs(peft_model, prompt, cont)
    assert (gen.sequence_logprobs(prompt, cont) - v2_lp).abs().max() < tol(v2_lp)  # version 8 = w2
    gen.close()
    assert set(engine.list_loras()) == set()


@pytest.fixture(scope="module")
def streaming_llm(tiny_model_dir):
    """An engine for a streaming generator: three adapter versions alive (max_staleness 2, tensor
    sync) and no chunked prefill (actors.engine_loop)."""
    from actors.lora_sync import TensorSync
    from actors.vllm_engine import build_llm

    llm = build_llm(tiny_model_dir, dtype="float32", seed=0, enable_chunked_prefill=False, max_model_len=128,
                    **TensorSync.engine_args(16, versions=3))
    yield llm
    try:
        llm.llm_engine.engine_core.shutdown(timeout=10)
    except Exception:  # pragma: no cover - best effort
        pass


def test_streaming_runs_the_batches_of_several_versions_at_once(streaming_llm, tokenizer, tiny_model_dir):
    """max_staleness: a streaming generator (actors.engine_loop) runs the batches of several
    adapter versions in one engine at once while another version loads. Each batch samples
    what it samples alone: the same tokens, its logprobs within the float32 rounding that the
    batch composition moves, and its own adapter (the same seeds under two versions give other
    samples). The driver's retirement leaves the versions asked for."""
    from concurrent.futures import ThreadPoolExecutor

    from actors.generator import Generator

    gen = Generator(streaming_llm, tokenizer, model_dir=tiny_model_dir, temperature=1.0, top_k=0, top_p=1.0,
                    max_new_tokens=24, seed=0, max_prompt_length=64, lora_sync="tensor", max_staleness=2,
                    streaming=True)
    try:
        peft_model = make_peft(tiny_model_dir)
        w1, w2, w3 = (randomize_lora(peft_model, seed=s) for s in (1, 2, 3))
        gen.load_adapter(1, w1)
        gen.load_adapter(2, w2)
        prompts = PROMPTS * 4
        alone = [gen.generate(prompts, step=1, version=v) for v in (1, 2)]
        assert gen._loop.peak_batches == 1
        assert not torch.equal(alone[0].response_ids, alone[1].response_ids)  # each version is its own policy
        with ThreadPoolExecutor(3) as pool:
            batches = [pool.submit(gen.generate, prompts, 1, version=v) for v in (1, 2)]
            loaded = pool.submit(gen.load_adapter, 3, w3)
            together = [b.result() for b in batches]
            assert loaded.result().version == 3
        assert gen._loop.peak_batches >= 2  # they shared engine steps
        for got, want, v in zip(together, alone, (1, 2)):
            assert got.adapter_version == v
            assert torch.equal(got.response_ids, want.response_ids), v
            assert (got.gen_logprobs - want.gen_logprobs).abs().max() <= tol(want.gen_logprobs), v
        assert gen.versions == [1, 2, 3]
        gen.load_adapter(4, w1, retire_below=2)
        assert gen.versions == [2, 3, 4] and len(streaming_llm.llm_engine.list_loras()) == 3
        with pytest.raises(KeyError, match=r"adapter version 1 is not held \(held: \[2, 3, 4\]\)"):
            gen.generate(prompts, step=1, version=1)
    finally:
        gen.close()


def test_a_partial_rollout_continues_on_the_next_version_when_it_arrives(streaming_llm, tokenizer, tiny_model_dir):
    """partial_rollout continue: a response's first segment_tokens tokens are sampled with the
    batch's version, the rest with the next one, which the generator waits for while it is not
    loaded. The first segment is the plain batch's own start (same seeds, same version); the
    tail's logprobs are the new version's (vLLM's prompt logprobs of the same tokens under it);
    each token's version is recorded."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from actors.generator import Generator

    c = 6
    gen = Generator(streaming_llm, tokenizer, model_dir=tiny_model_dir, temperature=1.0, top_k=0, top_p=1.0,
                    max_new_tokens=24, seed=0, max_prompt_length=64, lora_sync="tensor", max_staleness=2,
                    streaming=True)
    try:
        peft_model = make_peft(tiny_model_dir)
        w1, w2 = (randomize_lora(peft_model, seed=s) for s in (1, 2))
        gen.load_adapter(1, w1)
        plain = gen.generate(PROMPTS, step=3, version=1, samples_per_prompt=2)
        assert plain.token_versions is None
        # segments as long as a response, or one version: the plain batch
        same = gen.generate(PROMPTS, step=3, version=1, samples_per_prompt=2, segment_versions=[1, 2],
                            segment_tokens=24)
        assert torch.equal(same.response_ids, plain.response_ids) and same.token_versions is None
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(gen.generate, PROMPTS, 3, version=1, samples_per_prompt=2, segment_versions=[1, 2],
                                 segment_tokens=c)
            deadline = time.monotonic() + 120
            while gen.waiting_for != [2]:  # the first segments ran; the longer responses wait for version 2
                assert time.monotonic() < deadline and not future.done()
                time.sleep(0.05)
            assert gen._loop.idle() and not future.done()
            gen.load_adapter(2, w2)
            got = future.result(timeout=120)
        lengths = plain.response_lengths.tolist()
        assert max(lengths) > c  # some responses go on past their first segment
        versions = got.versions_of_tokens()
        for row, n in enumerate(got.response_lengths.tolist()):
            head = min(n, c)
            # the first segment: the plain batch's first tokens (a response that ends there, all of it)
            assert got.response_ids[row, :head].tolist() == plain.response_ids[row, :head].tolist(), row
            assert (got.gen_logprobs[row, :head] - plain.gen_logprobs[row, :head]).abs().max() <= \
                tol(plain.gen_logprobs[row, :head]), row
            assert versions[row, :n].tolist() == [1] * head + [2] * (n - head), row
            if lengths[row] <= c:
                assert n == lengths[row]
            if n > c:  # the tail: version 2's logprobs of those tokens
                ids = got.response_ids[row, :n].tolist()
                prompt = got.prompt_ids[row][got.prompt_mask[row]].tolist()
                want = gen.sequence_logprobs(prompt, ids)[c:]  # temperature 1, untruncated: the sampled ones
                assert (got.gen_logprobs[row, c:n] - want).abs().max() <= tol(want), row
        assert got.adapter_version == 1 and len(got) == len(plain)
        with pytest.raises(ValueError, match="must start at the batch's version 1"):
            gen.generate(PROMPTS, step=3, version=1, segment_versions=[2, 1], segment_tokens=c)
    finally:
        gen.close()


def test_a_streaming_generator_needs_an_engine_that_does_not_chunk_prefills(vllm_llm, tokenizer, tiny_model_dir):
    """On the CPU a seeded request whose prefill is chunked crashes vLLM's runner, and a stream of
    batches would be chunked: the shared engine (chunked prefill on) is refused, naming why."""
    from actors.generator import Generator

    with pytest.raises(ValueError, match="enable_chunked_prefill=False"):
        Generator(vllm_llm, tokenizer, model_dir=tiny_model_dir, lora_sync="tensor", streaming=True)
