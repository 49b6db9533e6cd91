"""The SFT and reward-model stages on a small split of the bundled task (no Ray)."""

from __future__ import annotations

import pytest
import torch

from learner.stages import (TrainSettings, load_reward_model_for_training, preference_accuracy, rm_backward, sft_backward,
                            sft_loss, train_reward_model, train_sft)
from ppo_ray.batch import RolloutBatch
from ppo_ray.modeling import load_causal_lm, load_tokenizer
from ppo_ray.tasks.tldr_synth import generate_task
from tolerances import TINY_TERMS, grad_terms, rounding_tol


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
        before = float(sft_loss(load_causal_lm(str(tiny_model_dir)), RolloutBatch.from_tokens(vq, vr, tok.pad_token_id, tok.eos_token_id)))
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


# --------------------------------------------------------------------------- device, gradient accumulation


def test_train_settings_device_and_micro_batch_size():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert TrainSettings().torch_device().type == expected  # "auto"
    assert TrainSettings(device="cpu").torch_device() == torch.device("cpu")
    with pytest.raises(ValueError, match="micro_batch_size"):
        TrainSettings(micro_batch_size=0)


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def accumulation_tols(loss: torch.Tensor, grads: dict, tokens: int) -> tuple[float, float]:
    """(loss, gradient) tolerances of micro-batched vs one-batch float32 computations
    (tests/tolerances.py): the loss is a mean over `tokens` of per-token losses that went
    through the tiny model's reductions; every gradient entry is within the rounding of the
    largest one, through the backward's reductions and a sum over the tokens."""
    g_max = max(g.abs().max() for g in grads.values())
    return rounding_tol(loss.abs(), TINY_TERMS + tokens), rounding_tol(g_max, grad_terms(tokens))


@pytest.mark.equality
def test_sft_accumulated_gradient_equals_the_full_batch_gradient(tiny_model_dir, task):
    """Micro-batches of 3 and of 1 rows (each trimmed to its own length, weighted by its share
    of the step's response tokens) give the gradient and loss of one forward over all 8 rows
    (float32 rounding: accumulation_tols)."""
    tok = load_tokenizer(str(tiny_model_dir))
    rows = task["train"][:8]
    q = encode(tok, [e["prompt"] for e in rows])
    r = [x + [tok.eos_token_id] for x in encode(tok, [e["summary"] for e in rows])]
    assert len({len(x) for x in r}) > 1  # unequal lengths: a plain mean of micro-batch means would be wrong
    model = load_causal_lm(str(tiny_model_dir)).train()
    cpu = torch.device("cpu")
    results = {m: (sft_backward(model, q, r, list(range(8)), tok.pad_token_id, tok.eos_token_id, m, cpu),
                   grads(model)) for m in (None, 3, 1)}
    full_loss, full_grads = results[None]
    # one micro-batch is sft_loss itself: the same ops on the same rows, exactly
    assert torch.equal(full_loss, sft_loss(model, RolloutBatch.from_tokens(q, r, tok.pad_token_id, tok.eos_token_id).trimmed()).detach())
    loss_tol, grad_tol = accumulation_tols(full_loss, full_grads, sum(map(len, r)))
    for m in (3, 1):
        loss, g = results[m]
        torch.testing.assert_close(loss, full_loss, atol=loss_tol, rtol=0, msg=lambda msg, m=m: f"micro {m}: {msg}")
        torch.testing.assert_close(g, full_grads, atol=grad_tol, rtol=0, msg=lambda msg, m=m: f"micro {m}: {msg}")


@pytest.mark.equality
def test_rm_accumulated_gradient_equals_the_full_batch_gradient(tiny_model_dir, task):
    """The reward model's pairwise loss in micro-batches of 4 and 1 pairs == one batch of 6
    (float32 rounding: accumulation_tols); the accuracy is a count, the same exactly (no
    pair's two scores lie within rounding of each other here)."""
    tok = load_tokenizer(str(tiny_model_dir))
    rows = task["train"][:6]
    eos = tok.eos_token_id
    q = encode(tok, [e["prompt"] for e in rows])
    c = [x + [eos] for x in encode(tok, [e["chosen"] for e in rows])]
    rj = [x + [eos] for x in encode(tok, [e["rejected"] for e in rows])]
    model, _ = load_reward_model_for_training(str(tiny_model_dir), "float32", seed=0)
    model.train()
    cpu = torch.device("cpu")
    results = {m: (*rm_backward(model, q, c, rj, list(range(6)), tok.pad_token_id, eos, m, cpu), grads(model))
               for m in (None, 4, 1)}
    full_loss, full_acc, full_grads = results[None]
    loss_tol, grad_tol = accumulation_tols(full_loss, full_grads, sum(map(len, c)) + sum(map(len, rj)))
    for m in (4, 1):
        loss, acc, g = results[m]
        assert float(acc) == float(full_acc), m
        torch.testing.assert_close(loss, full_loss, atol=loss_tol, rtol=0, msg=lambda msg, m=m: f"micro {m}: {msg}")
        torch.testing.assert_close(g, full_grads, atol=grad_tol, rtol=0, msg=lambda msg, m=m: f"micro {m}: {msg}")


@pytest.mark.equality
def test_train_sft_with_micro_batches_matches_one_batch(tiny_model_dir, task, tmp_path, monkeypatch):
    """TrainSettings.micro_batch_size reaches the SFT loop: one step over 8 rows in micro-batches
    of 3 gives the weights of one step over all 8, to float32 rounding. The loop's AdamW is
    replaced by SGD here: Adam's first step is lr * g / (|g| + eps), which turns the rounding
    on a near-zero gradient entry into a step of up to ~lr (1.5e-4 at lr 1e-3 on one CPU).
    SGD moves every weight by lr * g (g clipped to max_grad_norm: every entry within it), so
    the weights differ by lr times the gradients' rounding plus the rounding of the weight."""
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, lr, weight_decay: torch.optim.SGD(params, lr=lr))
    tok = load_tokenizer(str(tiny_model_dir))
    rows = task["train"][:8]
    q = encode(tok, [e["prompt"] for e in rows])
    r = [x + [tok.eos_token_id] for x in encode(tok, [e["summary"] for e in rows])]
    lr, weights = 0.1, []
    for m in (None, 3):
        settings = TrainSettings(batch_size=8, learning_rate=lr, micro_batch_size=m, device="cpu", progress=False)
        train_sft(str(tiny_model_dir), q, r, tmp_path / str(m), settings)
        weights.append(load_causal_lm(str(tmp_path / str(m))).state_dict())
    base = load_causal_lm(str(tiny_model_dir)).state_dict()
    w_max = max(w.abs().max() for w in base.values())
    tol = lr * rounding_tol(settings.max_grad_norm, grad_terms(sum(map(len, r)))) + rounding_tol(w_max)
    torch.testing.assert_close(weights[1], weights[0], atol=tol, rtol=0)
    assert max_diff(weights[0], base) > 100 * tol  # it did train, by far more than the tolerance


def test_a_float32_stage_is_saved_in_the_ppo_runs_dtype(tiny_model_dir, task, tmp_path):
    """stage_dtype float32, dtype bfloat16 (the Qwen3 preset): the stage trains in float32 and
    saves bfloat16, the weights every PPO role would have loaded (from_pretrained's rounding),
    at half the bytes on disk and in the object store."""
    from safetensors import safe_open

    tok = load_tokenizer(str(tiny_model_dir))
    rows = task["train"][:8]
    q = encode(tok, [e["prompt"] for e in rows])
    r = [x + [tok.eos_token_id] for x in encode(tok, [e["summary"] for e in rows])]
    for save_dtype in (None, "bfloat16"):
        settings = TrainSettings(batch_size=8, learning_rate=1e-3, device="cpu", progress=False, save_dtype=save_dtype)
        train_sft(str(tiny_model_dir), q, r, tmp_path / str(save_dtype), settings)
    with safe_open(str(tmp_path / "bfloat16" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    as_ppo_loads = load_causal_lm(str(tmp_path / "None"), "bfloat16").state_dict()
    saved = load_causal_lm(str(tmp_path / "bfloat16"), "bfloat16").state_dict()
    assert all(torch.equal(saved[k], as_ppo_loads[k]) for k in saved)  # the same computation: bit for bit
    sizes = [(tmp_path / d / "model.safetensors").stat().st_size for d in ("None", "bfloat16")]
    assert sizes[1] < 0.6 * sizes[0]


@pytest.mark.equality
@pytest.mark.parametrize("steps", [1, 3, 7, 10, 40, 137, 1000])
def test_stage_lr_schedule_is_the_hand_written_linear_decay(steps):
    """The stages' schedule (transformers' linear, no warmup) gives the lr of the hand-written
    LambdaLR it replaced, max(0, 1 - s / steps) x lr, at every step and past the end, to one
    unit in the last place of lr. Not bit for bit: transformers computes (steps - s) / steps,
    which rounds differently from 1 - s / steps in about a third of the steps."""
    import math

    from transformers import get_linear_schedule_with_warmup

    lr = 3e-4
    ours, old = (torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr) for _ in range(2))
    ours_sched = get_linear_schedule_with_warmup(ours, num_warmup_steps=0, num_training_steps=steps)
    old_sched = torch.optim.lr_scheduler.LambdaLR(old, lambda s: max(0.0, 1.0 - s / max(steps, 1)))
    for s in range(steps + 2):
        a, b = ours.param_groups[0]["lr"], old.param_groups[0]["lr"]
        assert abs(a - b) <= math.ulp(lr), (s, a, b)
        assert a == lr * max(0.0, (steps - s) / steps)
        ours.step(), old.step()
        ours_sched.step(), old_sched.step()
