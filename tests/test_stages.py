"""The SFT and reward-model stages on a small split of the bundled task (no Ray)."""

from __future__ import annotations

import pytest
import torch

from learner.stages import TrainSettings, pack, preference_accuracy, sft_loss, train_reward_model, train_sft
from ppo_ray.modeling import load_causal_lm, load_tokenizer
from ppo_ray.tldr_synth import generate_task


@pytest.fixture(scope="module")
def task():
    return generate_task(seed=3, n_train=160, n_val=64, n_test=8)


def encode(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def sft_dir(tiny_model_dir, task, tmp_path_factory):
    tok = load_tokenizer(str(tiny_model_dir))
    q = encode(tok, [e["prompt"] for e in task["train"]])
    r = [x + [tok.eos_token_id] for x in encode(tok, [e["summary"] for e in task["train"]])]
    vq = encode(tok, [e["prompt"] for e in task["validation"]])
    vr = [x + [tok.eos_token_id] for x in encode(tok, [e["summary"] for e in task["validation"]])]
    out = tmp_path_factory.mktemp("sft")
    settings = TrainSettings(epochs=2, learning_rate=1e-3, batch_size=16, progress=False)
    with torch.no_grad():  # the base model's held-out loss, for comparison
        before = float(sft_loss(load_causal_lm(str(tiny_model_dir)), pack(vq, vr, tok.pad_token_id, tok.eos_token_id)))
    stats = train_sft(str(tiny_model_dir), q, r, out, settings, val=(vq, vr))
    return out, before, stats


def test_sft_lowers_held_out_loss_and_writes_a_checkpoint(sft_dir, tiny_model_dir):
    out, val_before, stats = sft_dir
    assert stats["sft_val_loss"] < 0.7 * val_before, (val_before, stats)
    model = load_causal_lm(str(out))  # a normal HF directory, safetensors weights
    base = load_causal_lm(str(tiny_model_dir))
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    changed = [not torch.equal(a, b) for a, b in zip(model.state_dict().values(), base.state_dict().values())]
    assert any(changed)


def test_reward_model_beats_chance_on_held_out_pairs(sft_dir, task, tmp_path):
    out, _, _ = sft_dir
    tok = load_tokenizer(str(out))
    eos = tok.eos_token_id

    def pairs(split):
        rows = task[split]
        q = encode(tok, [e["prompt"] for e in rows])
        c = [x + [eos] for x in encode(tok, [e["chosen"] for e in rows])]
        r = [x + [eos] for x in encode(tok, [e["rejected"] for e in rows])]
        return q, c, r

    settings = TrainSettings(epochs=2, learning_rate=3e-4, batch_size=16, progress=False)
    stats = train_reward_model(str(out), *pairs("train"), tmp_path / "rm", settings, val=pairs("validation"))
    assert stats["rm_val_accuracy"] > 0.6, stats
    # the saved model loads as a reward model and gives the same accuracy
    from actors.reward import RewardScorer

    scorer = RewardScorer(str(tmp_path / "rm"))
    acc = preference_accuracy(scorer.model, *pairs("validation"), pad=tok.pad_token_id, eos=eos)
    assert acc == pytest.approx(stats["rm_val_accuracy"])
