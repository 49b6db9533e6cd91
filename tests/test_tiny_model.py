"""The embedded tiny model: determinism, tokenizer, HF/PEFT loading, HF-vs-vLLM agreement."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import subprocess
import sys

import pytest
import torch

from ppo_ray import tiny_model
from ppo_ray.atomic import temp_prefix
from ppo_ray.tiny_model import EOS_TOKEN, PAD_TOKEN, PRESETS, build_tiny_model
from tolerances import TINY_TERMS, rounding_tol

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
LOGPROB_ATOL = 1e-4
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _file_hashes(d: pathlib.Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def _tldr_prompt(ex: dict[str, str]) -> str:
    return f"SUBREDDIT: r/{ex['subreddit']}\n\nTITLE: {ex['title']}\n\nPOST: {ex['post']}\n\nTL;DR:"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts_ids(tokenizer):
    """Three prompts of different lengths (a few, ~100 and ~300 tokens)."""
    ex = tiny_model.tldr_examples()[0]
    long_text = " ".join(tiny_model.corpus_documents()[40:48])
    long_ids = tokenizer(long_text, truncation=True, max_length=300)["input_ids"]
    ids = [tokenizer("Hello there")["input_ids"], tokenizer(_tldr_prompt(ex))["input_ids"], long_ids]
    assert len({len(i) for i in ids}) == 3
    return ids


# --------------------------------------------------------------------------- building


@pytest.mark.slow  # ~75 s; the committed default model has its own slow rebuild test
def test_rebuild_is_bit_identical(tiny_model_dir, tmp_path):
    """Rebuilding into two fresh directories gives the same bytes as the cached build."""
    ref = _file_hashes(tiny_model_dir)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(ref)

    rng_before = torch.get_rng_state()
    a = build_tiny_model(tmp_path / "a")
    assert torch.equal(rng_before, torch.get_rng_state()), "building must not touch the global torch RNG"
    b = build_tiny_model(tmp_path / "b")
    assert a == tmp_path / "a" and b == tmp_path / "b"
    assert _file_hashes(a) == ref
    assert _file_hashes(b) == ref


def test_tokenizer_training_is_deterministic_across_processes():
    """The BPE trainer uses hash maps with per-process random seeds; its output must not
    depend on them. (Weights come from a seeded torch.Generator; the full cross-process
    rebuild is ``python -m ppo_ray.tiny_model --out DIR`` twice, checked by hand.)"""
    code = (
        "import hashlib; from ppo_ray.tiny_model import _train_tokenizer, PRESETS; "
        "print(hashlib.sha256(_train_tokenizer(PRESETS['tiny']).to_str().encode()).hexdigest())"
    )
    ref = hashlib.sha256(tiny_model._train_tokenizer(PRESETS["tiny"]).to_str().encode()).hexdigest()
    for hash_seed in ("1", "777"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(REPO_ROOT))
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=120, check=True)
        assert out.stdout.strip() == ref


def test_cache_reuse_and_layout(tiny_model_dir, tmp_path):
    info = json.loads((tiny_model_dir / tiny_model.BUILD_INFO_FILE).read_text())
    digest = tiny_model.content_hash("tiny")
    assert info["content_hash"] == digest
    assert tiny_model_dir.name == f"qwen3-tiny-{digest[:16]}"
    assert not [p for p in tiny_model_dir.parent.iterdir() if p.name.startswith(temp_prefix(tiny_model_dir))]
    mtime = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model() == tiny_model_dir  # cached: returned as is
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == mtime
    assert tiny_model.content_hash("small") != digest

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x.txt").write_text("not a model")
    with pytest.raises(FileExistsError):
        build_tiny_model(foreign)
    with pytest.raises(ValueError):
        build_tiny_model(tmp_path / "c", size="huge")


def test_config_matches_preset(tiny_model_dir, hf_model):
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    preset = PRESETS["tiny"]
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "head_dim", "max_position_embeddings", "tie_word_embeddings"):
        assert cfg[k] == preset[k], k
    assert cfg["head_dim"] == 64  # vLLM CPU attention requirement
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"] and gen["pad_token_id"] == cfg["pad_token_id"]
    assert cfg["pad_token_id"] != cfg["eos_token_id"]
    assert sum(p.numel() for p in hf_model.parameters()) == 361_344
    # The tiny preset is pretrained (the random init is only its starting point): the
    # build records it, and the weights moved away from the init (std 0.02, norms 1).
    info = json.loads((tiny_model_dir / tiny_model.BUILD_INFO_FILE).read_text())
    assert preset["pretrain_steps"] > 0 and info["pretrain"]["steps"] == preset["pretrain_steps"]
    assert info["preset"]["pretrain_steps"] == preset["pretrain_steps"]
    assert not torch.all(hf_model.model.norm.weight == 1)
    assert all(torch.isfinite(p).all() for p in hf_model.parameters())
    assert PRESETS["small"]["pretrain_steps"] == 0  # benchmarks only: stays random


def test_corpus_tldr_examples():
    exs = tiny_model.tldr_examples()
    assert len(exs) >= 30
    assert len({e["subreddit"] for e in exs}) >= 10
    text = tiny_model.corpus_text()
    assert 20_000 <= len(text.encode()) <= 60_000
    for e in exs:
        assert all(e.values())
        assert f"{_tldr_prompt(e)} {e['summary']}" in text


def _generic_prompts() -> list[str]:
    return ["Hello", "Hello there", "TL;DR:", "The quick brown fox jumps over the lazy dog, and then",
            "SUBREDDIT: r/relationships\n\nTITLE: My friend never calls back\n\nPOST: We used to talk every day.\n\nTL;DR:"]


def test_tiny_model_is_pretrained(hf_model, tokenizer, tiny_model_dir):
    """The pretraining made a real (small) LM: corpus loss far below ln(512), the pad
    token (absent from the data) negligible, EOS after a finished document."""
    import math

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    loss_sum = ent_sum = 0.0
    n = 0
    max_p_pad = 0.0
    with torch.no_grad():
        for doc in tiny_model.corpus_documents():
            ids = torch.tensor([tokenizer(doc)["input_ids"] + [eos]])
            logp = torch.log_softmax(hf_model(ids).logits[0, :-1].double(), dim=-1)
            loss_sum += -logp.gather(-1, ids[0, 1:, None]).sum().item()
            ent_sum += -(logp.exp() * logp).sum().item()
            max_p_pad = max(max_p_pad, logp[:, pad].exp().max().item())
            n += ids.shape[1] - 1
    loss, entropy = loss_sum / n, ent_sum / n
    print(f"corpus loss {loss:.3f}, entropy {entropy:.3f} (ln 512 = {math.log(512):.3f}), max P(pad) {max_p_pad:.1e}")
    assert loss < 2.6 < math.log(512)
    assert 1.5 < entropy < 3.5  # confident, but not collapsed
    assert max_p_pad < 1e-2
    info = json.loads((tiny_model_dir / tiny_model.BUILD_INFO_FILE).read_text())["pretrain"]
    assert info["corpus_loss_before"] > 6.0 and abs(info["corpus_loss_after"] - loss) < 1e-3

    # At the end of prompts (where generation starts) pad is negligible.
    prompts = [_tldr_prompt(e) for e in tiny_model.tldr_examples()] + _generic_prompts()
    p_eos_after_summary = []
    with torch.no_grad():
        for text in prompts:
            probs = torch.softmax(hf_model(torch.tensor([tokenizer(text)["input_ids"]])).logits[0, -1], dim=-1)
            assert probs[pad].item() < 1e-3, text
        # A finished TL;DR document is followed by EOS.
        for e in tiny_model.tldr_examples():
            ids = tokenizer(f"{_tldr_prompt(e)} {e['summary']}")["input_ids"]
            p_eos_after_summary.append(torch.softmax(hf_model(torch.tensor([ids])).logits[0, -1], dim=-1)[eos].item())
    assert sum(p_eos_after_summary) / len(p_eos_after_summary) > 0.5

    # Greedy decoding is not degenerate: many distinct tokens, no pad.
    ids = tokenizer(prompts[0])["input_ids"]
    out = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    new = out[0, len(ids):].tolist()
    assert len(set(new)) > 8 and pad not in new, tokenizer.decode(new)


# --------------------------------------------------------------------------- tokenizer


def test_special_tokens(tokenizer, tiny_model_dir):
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token == PAD_TOKEN
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.eos_token_id == cfg["eos_token_id"] and tokenizer.pad_token_id == cfg["pad_token_id"]
    assert tokenizer.bos_token is None
    assert len(tokenizer) == cfg["vocab_size"]
    # Both are single tokens, at the end of the vocabulary (never id 0).
    assert tokenizer.encode(EOS_TOKEN, add_special_tokens=False) == [tokenizer.eos_token_id]
    assert tokenizer.encode(PAD_TOKEN, add_special_tokens=False) == [tokenizer.pad_token_id]
    assert {tokenizer.eos_token_id, tokenizer.pad_token_id} == {cfg["vocab_size"] - 2, cfg["vocab_size"] - 1}
    # Nothing is added around the text (no BOS/EOS), like Qwen3.
    assert tokenizer("hi")["input_ids"] == tokenizer.encode("hi", add_special_tokens=False)
    assert tokenizer.padding_side == "right"
    assert tokenizer.model_max_length == cfg["max_position_embeddings"]


def test_padding_uses_pad_token(tokenizer):
    batch = tokenizer(["a", "a much longer piece of text"], padding=True)
    short_ids, short_mask = batch["input_ids"][0], batch["attention_mask"][0]
    n = sum(short_mask)
    assert short_ids[n:] == [tokenizer.pad_token_id] * (len(short_ids) - n)
    assert short_mask[:n] == [1] * n


def test_unicode_round_trip(tokenizer):
    rnd = random.Random(0)
    samples = [
        "", " ", "  leading and trailing  ", "tabs\tand\r\nnewlines\n\n",
        "café naïve crème brûlée", "e\u0301 (decomposed) vs \u00e9", "日本語のテキスト", "Ελληνικά", "עברית",
        "emoji 🤖🚀👩🏽‍💻", "\x00\x01 control", "zero\u200bwidth", f"text {EOS_TOKEN} inside",
    ]
    # Random code points from across the Unicode range (no surrogates).
    for _ in range(20):
        cps = [rnd.choice([rnd.randint(0x20, 0x7E), rnd.randint(0xA0, 0xD7FF), rnd.randint(0xE000, 0x10FFFF)])
               for _ in range(rnd.randint(1, 40))]
        samples.append("".join(map(chr, cps)))
    for s in samples:
        ids = tokenizer.encode(s, add_special_tokens=False)
        assert all(0 <= i < len(tokenizer) for i in ids)
        assert tokenizer.decode(ids) == s, repr(s)


def test_tldr_prompt_tokenizes(tokenizer):
    ex = tiny_model.tldr_examples()[3]
    prompt = _tldr_prompt(ex)
    ids = tokenizer(prompt)["input_ids"]
    assert tokenizer.decode(ids) == prompt
    assert tokenizer.pad_token_id not in ids and tokenizer.eos_token_id not in ids
    # The BPE learned the format: far fewer tokens than bytes.
    assert len(ids) < len(prompt.encode()) / 2
    full = prompt + " " + ex["summary"] + EOS_TOKEN
    full_ids = tokenizer(full)["input_ids"]
    assert full_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(full_ids, skip_special_tokens=True) == prompt + " " + ex["summary"]


# --------------------------------------------------------------------------- HF / PEFT loading


def test_causal_lm_loads(hf_model, tokenizer):
    assert hf_model.dtype == torch.float32
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()  # tied
    batch = tokenizer(["Hello there", "TL;DR: the cat sat on the mat"], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = hf_model(**batch)
    assert out.logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(out.logits).all()


@pytest.mark.equality
def test_sequence_classification_loads(tiny_model_dir, tokenizer):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32).eval()
    assert rm.config.pad_token_id == tokenizer.pad_token_id
    texts = ["short one", "a somewhat longer text that needs no padding at all"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        scores = rm(**batch).logits
        single = rm(**tokenizer(texts[:1], return_tensors="pt")).logits
    assert scores.shape == (2, 1)
    # The score is read at the last non-pad token, so right padding does not change it
    # (beyond the rounding of the tiny model's reductions at the scores' size).
    torch.testing.assert_close(scores[:1], single, rtol=0, atol=rounding_tol(scores.abs().max(), TINY_TERMS))


@pytest.mark.equality
def test_peft_lora_loads(hf_model, tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model

    base = type(hf_model).from_pretrained(hf_model.name_or_path, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, lora_dropout=0.0))
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    for t in LORA_TARGETS:
        assert any(f".{t}.lora_A" in n for n in trainable), t
    ids = tokenizer(["Hello there"], return_tensors="pt")
    with torch.no_grad():
        ref = hf_model(**ids).logits
        out = peft_model(**ids).logits
    # B = 0 at init: PEFT's forward adds zeros to the base model's (rounding of its reductions at most)
    torch.testing.assert_close(out, ref, rtol=0, atol=rounding_tol(ref.abs().max(), TINY_TERMS))
    loss = peft_model(**ids, labels=ids["input_ids"]).loss
    loss.backward()
    peft_model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


# --------------------------------------------------------------------------- HF vs vLLM


def _hf_token_logprobs(model, prompt_ids, gen_ids, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + gen_ids])).logits[0].float()
    logits = logits[len(prompt_ids) - 1 : -1] / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(gen_ids)[:, None])[:, 0]


def _vllm_token_logprobs(completion):
    return torch.tensor([lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs)])


def _hf_greedy(model, prompt_ids, n):
    ids = list(prompt_ids)
    margins = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            top2 = torch.topk(logits, 2)
            margins.append((top2.values[0] - top2.values[1]).item())
            ids.append(int(top2.indices[0]))
    return ids[len(prompt_ids):], min(margins)


def test_vllm_greedy_matches_hf(vllm_llm, hf_model, prompts_ids):
    from vllm import SamplingParams

    n = 16
    sp = SamplingParams(temperature=0.0, max_tokens=n, logprobs=0, ignore_eos=True)
    outs = vllm_llm.generate([{"prompt_token_ids": p} for p in prompts_ids], sp, use_tqdm=False)
    max_diff = 0.0
    for p, out in zip(prompts_ids, outs):
        c = out.outputs[0]
        hf_ids, margin = _hf_greedy(hf_model, p, n)
        assert list(c.token_ids) == hf_ids, f"greedy mismatch (smallest top-2 logit margin {margin:.2e})"
        assert len(set(hf_ids)) > 3, hf_ids  # the pretrained model's greedy output is non-trivial
        diff = (_vllm_token_logprobs(c) - _hf_token_logprobs(hf_model, p, hf_ids)).abs().max().item()
        max_diff = max(max_diff, diff)
    print(f"greedy: max |logprob HF - vLLM| = {max_diff:.3e}")
    assert max_diff < LOGPROB_ATOL


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_sampled_logprobs_match_hf(vllm_llm, hf_model, prompts_ids, temperature):
    """Sampled tokens' processed logprobs == HF log_softmax(logits / T) of those tokens."""
    from vllm import SamplingParams

    n = 16
    params = [SamplingParams(temperature=temperature, max_tokens=n, logprobs=0, seed=1000 + i, ignore_eos=True)
              for i in range(len(prompts_ids))]
    outs = vllm_llm.generate([{"prompt_token_ids": p} for p in prompts_ids], params, use_tqdm=False)
    again = vllm_llm.generate([{"prompt_token_ids": p} for p in prompts_ids], params, use_tqdm=False)
    max_diff = 0.0
    distinct = set()
    for p, out, out2 in zip(prompts_ids, outs, again):
        c = out.outputs[0]
        assert len(c.token_ids) == n
        assert list(c.token_ids) == list(out2.outputs[0].token_ids)  # seeded: reproducible
        distinct.update(c.token_ids)
        diff = (_vllm_token_logprobs(c) - _hf_token_logprobs(hf_model, p, list(c.token_ids), temperature)).abs().max().item()
        max_diff = max(max_diff, diff)
    assert len(distinct) > 5  # really sampled, not a repeated token
    print(f"T={temperature}: max |logprob HF - vLLM| = {max_diff:.3e}")
    assert max_diff < LOGPROB_ATOL


def test_vllm_lora_adapter_matches_hf_peft(vllm_llm, hf_model, prompts_ids, tmp_path):
    """The shared LoRA-enabled engine serves a PEFT adapter like HF+PEFT scores it."""
    from peft import LoraConfig, get_peft_model
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    base = type(hf_model).from_pretrained(hf_model.name_or_path, dtype=torch.float32).eval()
    peft_model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    peft_model.eval()
    peft_model.save_pretrained(tmp_path / "adapter")

    lora_id = 4242
    sp = SamplingParams(temperature=1.0, max_tokens=12, logprobs=0, seed=5, ignore_eos=True)
    try:
        outs = vllm_llm.generate([{"prompt_token_ids": p} for p in prompts_ids], sp, use_tqdm=False,
                                 lora_request=LoRARequest("test-adapter", lora_id, str(tmp_path / "adapter")))
    finally:
        vllm_llm.llm_engine.remove_lora(lora_id)
    max_diff = 0.0
    for p, out in zip(prompts_ids, outs):
        c = out.outputs[0]
        lp_peft = _hf_token_logprobs(peft_model, p, list(c.token_ids))
        lp_base = _hf_token_logprobs(hf_model, p, list(c.token_ids))
        assert (lp_peft - lp_base).abs().max().item() > 1e-3  # the adapter really changes the model
        max_diff = max(max_diff, (_vllm_token_logprobs(c) - lp_peft).abs().max().item())
    print(f"LoRA: max |logprob HF+PEFT - vLLM| = {max_diff:.3e}")
    assert max_diff < LOGPROB_ATOL
    assert lora_id not in vllm_llm.llm_engine.list_loras()


# --------------------------------------------------------------------------- small preset


@pytest.mark.slow
def test_small_preset_builds(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = build_tiny_model(tmp_path / "small", size="small")
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d)
    assert sum(p.numel() for p in model.parameters()) == 25_175_552
    assert len(tok) == model.config.vocab_size == 2048
    assert model.config.head_dim == 64 and model.config.num_key_value_heads == 2
    assert tok.pad_token_id != tok.eos_token_id
