"""The committed embedded model of the default job (ppo_ray/tldr_model.py): the files are what
the code expects, and the model copies facts from a post. Fast (< ~15 s): no vLLM, no build."""

from __future__ import annotations

import json
import os

import pytest

from ppo_ray import tldr_model
from ppo_ray.tiny_model import EOS_TOKEN, PAD_TOKEN

DIR = tldr_model.model_dir()
MAX_BYTES = 25 * 2**20  # issue 13: the committed model is at most 25 MB


@pytest.fixture(scope="module")
def info() -> dict:
    return json.loads((DIR / tldr_model.BUILD_INFO_FILE).read_text())


def test_committed_files_and_size():
    names = {p.name for p in DIR.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            tldr_model.BUILD_INFO_FILE} <= names, names
    assert sum(p.stat().st_size for p in DIR.iterdir()) <= MAX_BYTES


def test_resolves_by_name():
    from ppo_ray.paths import resolve_model_path

    assert resolve_model_path(tldr_model.MODEL_NAME) == str(DIR)


def test_config_is_the_preset(info):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(DIR)
    preset = tldr_model._preset()
    assert info["preset"] == preset, "the committed build's preset differs from PRESET: rebuild (module docstring)"
    assert info["builder_version"] == tldr_model.BUILDER_VERSION
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "head_dim", "tie_word_embeddings"):
        assert getattr(cfg, key) == preset[key], key
    assert cfg.head_dim == 64  # vLLM's CPU attention
    assert cfg.model_type == "qwen3"
    assert info["num_parameters"] == 3_410_688


def test_corpus_is_what_the_build_used(info):
    """The code still generates the documents the committed model was pretrained on."""
    docs = tldr_model.pretraining_corpus()
    assert len(docs) == info["documents"]
    assert tldr_model._digest(docs) == info["documents_sha256"]


def test_tokenizer():
    from transformers import AutoTokenizer

    from ppo_ray.modeling import load_tokenizer

    tok = AutoTokenizer.from_pretrained(DIR)
    assert len(tok) == 1024
    assert tok.convert_tokens_to_ids(EOS_TOKEN) == 1022 == tok.eos_token_id
    assert tok.convert_tokens_to_ids(PAD_TOKEN) == 1023 == tok.pad_token_id
    assert load_tokenizer(str(DIR)).pad_token_id == 1023  # no substitute pad needed
    text = "SUBREDDIT: r/dogs\n\nTITLE: Help with my pug\n\nPOST: My pug ate a sock 3 days ago. Ünïcødé?\n\nTL;DR:"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    plain = text.replace(" Ünïcødé?", "?")  # task text: a task-fit vocabulary, ~3+ characters per token
    assert len(tok(plain, add_special_tokens=False)["input_ids"]) < len(plain) / 2.5


@pytest.mark.heavy("runs the committed default model")
def test_known_logprobs(info):
    """The committed weights, tokenizer and config give the log-probabilities the build recorded."""
    assert tldr_model.known_logprobs(DIR) == pytest.approx(info["known_logprobs"], abs=1e-3)


def test_build_is_recorded(info):
    assert info["build_seconds"] > 0 and info["built_on"]["cpu"] and info["command"].startswith("python -m")
    assert set(info["versions"]) == {"torch", "transformers", "tokenizers", "safetensors"}


@pytest.mark.heavy("runs the committed default model on 40 posts (minutes on 2 cores)")
def test_pretrained_model_copies_facts():
    """Before any SFT, the model prefers the post's own person and quantity over every
    alternative (tldr_eval.copy_probe) on held-out validation posts."""
    from ppo_ray.tasks.tldr_eval import copy_probe
    from ppo_ray.tasks.tldr_synth import generate_task

    rows = generate_task(seed=0, n_train=0, n_val=40, n_test=0)["validation"]
    acc = copy_probe(str(DIR), rows)
    # committed model: person 1.0, quantity 0.875 (its misses are a distractor sentence's
    # number or unit); chance is 1 / (1 + alternatives), under 0.15
    assert acc["person"] >= 0.9 and acc["quantity"] >= 0.8, acc


@pytest.mark.slow
@pytest.mark.rebuild
def test_rebuild_gives_the_committed_weights(tmp_path, info):
    """The documented command rebuilds the committed bytes (about 26-33 minutes on 2 threads).
    A bit-for-bit claim, so only with the recorded library versions on the recorded CPU
    model: another CPU's vector kernels round the 4800 pretraining steps differently (the
    suite's equality tests are the cross-CPU claims; ENVIRONMENT.md), so there it is skipped
    with the reason, before the half hour is spent."""
    import hashlib

    from ppo_ray.tiny_model import _library_versions

    if _library_versions() != info["versions"]:
        pytest.skip(f"library versions {_library_versions()} differ from the build's {info['versions']}")
    here, there = tldr_model._machine()["cpu"], info["built_on"]["cpu"]
    if here != there:
        pytest.skip(f"a bit-for-bit rebuild is a claim for the recorded CPU ({there}); this is {here}")
    out = tldr_model.build(tmp_path / "m")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert hashlib.sha256((out / name).read_bytes()).digest() == hashlib.sha256(
            (DIR / name).read_bytes()).digest(), name
    assert os.path.getsize(out / "model.safetensors") == os.path.getsize(DIR / "model.safetensors")


def test_the_default_job_uses_this_model_and_mixed_references():
    """configs/tldr-tiny.yaml (the main job) names the committed model, and its reference
    quality is tldr_synth.DEFAULT_IDEAL_FRACTION (below 1: RLHF has something to learn)."""
    from pathlib import Path

    from ppo_ray.config import PPOConfig
    from ppo_ray.tasks.tldr_synth import DEFAULT_IDEAL_FRACTION

    config = PPOConfig.from_yaml(Path(__file__).resolve().parents[1] / "configs" / "tldr-tiny.yaml")
    assert config.model_name == tldr_model.MODEL_NAME
    assert config.bundled_ideal_fraction == DEFAULT_IDEAL_FRACTION < 1
    assert config.eval_size >= 200  # issue 13: at least 200 held-out prompts
