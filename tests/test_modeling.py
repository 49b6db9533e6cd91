"""load_tokenizer's pad choice for tokenizers whose pad is missing or equals EOS (the Qwen base
tokenizers: pad_token == eos_token == "<|endoftext|>"), on local copies of the embedded tiny
model's tokenizer rewritten into that shape (no network)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from ppo_ray.modeling import PAD_CANDIDATES, load_tokenizer
from ppo_ray.tiny_model import EOS_TOKEN, PAD_TOKEN

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")


def qwen_like(src: Path, dest: Path, pad_as: str | None, special: bool = False, pad_field=EOS_TOKEN,
              with_model: bool = False) -> Path:
    """A copy of the tiny tokenizer whose tokenizer_config names `pad_field` as pad (EOS, as
    Qwen3-0.6B-Base does, or None) and whose own pad token (same id) is renamed `pad_as`
    (special flag `special`; Qwen's "<|fim_pad|>" is special=False), or removed (None).
    `with_model`: the tiny model's weights too, its config.json without a pad_token_id."""
    dest.mkdir(parents=True)
    tj = json.loads((src / "tokenizer.json").read_text())
    kept = []
    for t in tj["added_tokens"]:
        if t["content"] == PAD_TOKEN:
            if pad_as is None:
                continue
            t.update(content=pad_as, special=special)
        kept.append(t)
    tj["added_tokens"] = kept
    (dest / "tokenizer.json").write_text(json.dumps(tj))
    tc = json.loads((src / "tokenizer_config.json").read_text())
    tc["pad_token"] = pad_field
    (dest / "tokenizer_config.json").write_text(json.dumps(tc))
    for name in MODEL_FILES if with_model else ():
        shutil.copy(src / name, dest / name)
    config = json.loads((src / "config.json").read_text())
    config.pop("pad_token_id")  # the model config names no pad either: the stages must write it
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize("special", [False, True])
def test_pad_equal_to_eos_gets_fim_pad_and_says_so(tiny_model_dir, tmp_path, caplog, special):
    d = qwen_like(tiny_model_dir, tmp_path / "tok", "<|fim_pad|>", special=special)
    with caplog.at_level(logging.WARNING, logger="ppo_ray.modeling"):
        tok = load_tokenizer(str(d))
    fim = tok.convert_tokens_to_ids("<|fim_pad|>")
    assert tok.pad_token == "<|fim_pad|>" and tok.pad_token_id == fim != tok.eos_token_id
    assert tok.eos_token == EOS_TOKEN
    assert len(tok) == len(load_tokenizer(str(tiny_model_dir)))  # no token added: same vocabulary
    assert "'<|fim_pad|>'" in caplog.text and f"id {fim}" in caplog.text and "EOS" in caplog.text


def test_missing_pad_gets_one_too(tiny_model_dir, tmp_path):
    d = qwen_like(tiny_model_dir, tmp_path / "tok", "<|vision_pad|>", pad_field=None)
    assert load_tokenizer(str(d)).pad_token == "<|vision_pad|>"


def test_preference_order_and_fallback_to_an_unused_special_token(tiny_model_dir, tmp_path):
    assert PAD_CANDIDATES.index("<|fim_pad|>") < PAD_CANDIDATES.index("<|vision_pad|>")
    d = qwen_like(tiny_model_dir, tmp_path / "tok", "<|reserved_7|>", special=True)
    assert load_tokenizer(str(d)).pad_token == "<|reserved_7|>"
    # a non-special added token is text a model may write (Qwen's "<think>"): never picked
    d = qwen_like(tiny_model_dir, tmp_path / "tok2", "<think>", special=False)
    with pytest.raises(ValueError, match="no existing token can serve"):
        load_tokenizer(str(d))


def test_no_candidate_is_refused_naming_the_tokenizer(tiny_model_dir, tmp_path):
    d = qwen_like(tiny_model_dir, tmp_path / "tok", None)
    with pytest.raises(ValueError) as err:
        load_tokenizer(str(d))
    msg = str(err.value)
    assert repr(str(d)) in msg and "'<|endoftext|>'" in msg and "set a pad token" in msg
    assert "<|fim_pad|>" in msg  # says what was looked for


def test_a_tokenizer_with_its_own_pad_is_left_alone(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="ppo_ray.modeling"):
        tok = load_tokenizer(str(tiny_model_dir))
    assert tok.pad_token == PAD_TOKEN and not caplog.text


def test_sft_and_rm_checkpoints_keep_the_chosen_pad(tiny_model_dir, tmp_path):
    """The SFT stage on a pad == EOS model writes the chosen pad into its checkpoint, so the
    RM and PPO stages, which load the SFT directory, get the same pad without choosing again."""
    from learner.stages import TrainSettings, train_reward_model, train_sft

    base = qwen_like(tiny_model_dir, tmp_path / "base", "<|fim_pad|>", with_model=True)
    tok = load_tokenizer(str(base))
    q = [tok(f"post {i} TL;DR:", add_special_tokens=False)["input_ids"] for i in range(6)]
    r = [tok(f" short {i}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for i in range(6)]
    settings = TrainSettings(epochs=1, batch_size=3, progress=False)
    train_sft(str(base), q, r, tmp_path / "sft", settings)
    train_reward_model(str(tmp_path / "sft"), q, r, [x[:1] + [tok.eos_token_id] for x in r], tmp_path / "rm",
                       settings)
    for stage in ("sft", "rm"):
        out = tmp_path / stage
        assert json.loads((out / "tokenizer_config.json").read_text())["pad_token"] == "<|fim_pad|>", stage
        assert json.loads((out / "config.json").read_text())["pad_token_id"] == tok.pad_token_id, stage
        saved = load_tokenizer(str(out))
        assert (saved.pad_token_id, saved.eos_token_id) == (tok.pad_token_id, tok.eos_token_id), stage


def test_lora_adapter_written_with_peft_config_loads_in_peft_with_its_spec(tiny_model_dir, tmp_path):
    """write_lora_adapter: adapter_config.json is PEFT's own (LoraConfig.save_pretrained) from
    the spec that travels with the tensors; PeftModel loads the directory with that r, alpha
    and targets and the same tensors, and read_lora_adapter gives back what was written."""
    import torch
    from peft import PeftModel, get_peft_model, get_peft_model_state_dict

    from ppo_ray.modeling import LoraSpec, LoraWeights, load_causal_lm, read_lora_adapter, write_lora_adapter

    spec = LoraSpec(r=4, lora_alpha=12, target_modules=("q_proj", "v_proj"), lora_dropout=0.1)
    model = get_peft_model(load_causal_lm(str(tiny_model_dir)), spec.peft_config())
    g = torch.Generator().manual_seed(0)
    weights = LoraWeights({k: torch.randn(v.shape, generator=g) for k, v in get_peft_model_state_dict(model).items()},
                          LoraSpec.of(model.peft_config["default"]))
    assert weights.spec == spec
    path = write_lora_adapter(tmp_path / "adapter", weights, base_model=str(tiny_model_dir))

    config = json.loads((path / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 12)
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"] and config["base_model_name_or_path"] == str(tiny_model_dir)
    loaded = PeftModel.from_pretrained(load_causal_lm(str(tiny_model_dir)), str(path))
    assert LoraSpec.of(loaded.peft_config["default"]) == spec
    state = get_peft_model_state_dict(loaded)
    assert state.keys() == weights.tensors.keys() and all(torch.equal(state[k], v) for k, v in weights.tensors.items())
    back = read_lora_adapter(path)
    assert back.spec == spec and all(torch.equal(back.tensors[k], v) for k, v in weights.tensors.items())
    assert back.nbytes == weights.nbytes == sum(v.numel() * 4 for v in weights.tensors.values())
