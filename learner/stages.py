"""The two stages before PPO: supervised fine-tuning (SFT) and a Bradley-Terry reward model.

Both are plain single-process training loops (no Ray): on the embedded default they take
seconds to a minute on the CPU; on the real path they run on one GPU. Both write a normal
HF directory (safetensors weights + tokenizer) that the PPO stage loads by path.

- SFT: a full fine-tune of the base model on (prompt, " " + summary + EOS), the loss on the
  response tokens only. The result is the policy's starting point AND the frozen reference.
- Reward model: AutoModelForSequenceClassification (num_labels=1) initialised from the SFT
  model (N+ recipe), head init N(0, 1/sqrt(H+1)); loss -log sigmoid(r_chosen - r_rejected)
  with each score read at the last real token (the EOS); reports validation accuracy.

Batches reuse the RolloutBatch layout (left-padded prompt, right-padded response) so the
same forward helpers as the PPO roles score them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from learner.algos import logprobs_from_logits, masked_mean
from ppo_ray.batch import RolloutBatch
from ppo_ray.modeling import DTYPES, last_token_hidden, load_causal_lm, load_tokenizer, response_logits


@dataclass
class TrainSettings:
    epochs: int = 1
    learning_rate: float = 1e-4
    batch_size: int = 16
    seed: int = 0
    max_grad_norm: float = 1.0
    dtype: str = "float32"
    progress: bool = True


def pack(queries: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad: int, eos: int) -> RolloutBatch:
    """Token lists -> a RolloutBatch (prompts left-padded, responses right-padded)."""
    p = max(map(len, queries))
    t = max(map(len, responses))
    return RolloutBatch(
        prompt_ids=torch.tensor([[pad] * (p - len(q)) + list(q) for q in queries]),
        prompt_mask=torch.tensor([[False] * (p - len(q)) + [True] * len(q) for q in queries]),
        response_ids=torch.tensor([list(r) + [pad] * (t - len(r)) for r in responses]),
        response_mask=torch.tensor([[True] * len(r) + [False] * (t - len(r)) for r in responses]),
        gen_logprobs=torch.zeros(len(queries), t), adapter_version=0, pad_token_id=pad, eos_token_id=eos)


def _batches(n: int, batch_size: int, gen: torch.Generator) -> list[list[int]]:
    order = torch.randperm(n, generator=gen).tolist()
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def _save(model, tokenizer, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _step(model, loss: Tensor, opt, sched, max_grad_norm: float) -> None:
    """Backward, clip, optimiser and schedule step, zero the gradients."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True)


# ----------------------------------------------------------------------------- SFT
def sft_loss(model, batch: RolloutBatch) -> Tensor:
    """Mean negative log-likelihood of the response tokens (EOS included)."""
    logits = response_logits(model, batch)  # (B, T, V)
    logp = logprobs_from_logits(logits, batch.response_ids, 1.0, mask=batch.response_mask)  # (B, T)
    return -masked_mean(logp, batch.response_mask)


def train_sft(base_model: str, queries: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
              out_dir: str | Path, settings: TrainSettings,
              val: tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]] | None = None) -> dict:
    """Full fine-tune on (query ids, response ids incl. EOS); writes the SFT checkpoint."""
    torch.manual_seed(settings.seed)
    tok = load_tokenizer(base_model)
    model = load_causal_lm(base_model, settings.dtype)
    pad, eos = tok.pad_token_id, tok.eos_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    gen = torch.Generator().manual_seed(settings.seed)
    steps = settings.epochs * math.ceil(len(queries) / settings.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / max(steps, 1)))
    t0, losses = time.perf_counter(), []
    bar = _bar(steps, "SFT", settings.progress)
    model.train()
    for _ in range(settings.epochs):
        for rows in _batches(len(queries), settings.batch_size, gen):
            batch = pack([queries[i] for i in rows], [responses[i] for i in rows], pad, eos).trimmed()
            loss = sft_loss(model, batch)
            _step(model, loss, opt, sched, settings.max_grad_norm)
            losses.append(loss.detach())
            bar.update(1)
            if len(losses) % 10 == 0:
                bar.set_postfix(loss=f"{float(losses[-1]):.3f}")
    bar.close()
    model.eval()
    stats = {"sft_train_loss_first": float(losses[0]), "sft_train_loss_last": float(torch.stack(losses[-10:]).mean()),
             "sft_steps": len(losses), "sft_seconds": time.perf_counter() - t0}
    if val is not None:
        with torch.no_grad():
            vq, vr = val
            vals = [sft_loss(model, pack(vq[i:i + 64], vr[i:i + 64], pad, eos).trimmed())
                    for i in range(0, len(vq), 64)]
        stats["sft_val_loss"] = float(torch.stack(vals).mean())
    _save(model, tok, Path(out_dir))
    return stats


# ----------------------------------------------------------------------------- reward model
def load_reward_model_for_training(base_model: str, dtype: str, seed: int):
    """AutoModelForSequenceClassification from a causal-LM checkpoint; head ~ N(0, 1/sqrt(H+1))."""
    from transformers import AutoModelForSequenceClassification

    tok = load_tokenizer(base_model)
    model = AutoModelForSequenceClassification.from_pretrained(base_model, num_labels=1, dtype=DTYPES[dtype])
    model.config.pad_token_id = tok.pad_token_id
    gen = torch.Generator().manual_seed(seed)
    h = model.score.weight.shape[1]
    with torch.no_grad():  # N+ recipe: reward head init std 1/sqrt(d_model + 1)
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=gen) / math.sqrt(h + 1))
    return model, tok


def rm_scores(model, batch: RolloutBatch) -> Tensor:
    """(B,) scores at each row's last real token."""
    backbone = getattr(model, model.base_model_prefix)
    return model.score(last_token_hidden(backbone, batch)).float().squeeze(-1)


def preference_accuracy(model, queries, chosen, rejected, pad: int, eos: int, batch_size: int = 64) -> float:
    correct = 0
    with torch.no_grad():
        for i in range(0, len(queries), batch_size):
            q = list(queries[i:i + batch_size])
            rc = rm_scores(model, pack(q, chosen[i:i + batch_size], pad, eos).trimmed())
            rr = rm_scores(model, pack(q, rejected[i:i + batch_size], pad, eos).trimmed())
            correct += int((rc > rr).sum())
    return correct / max(len(queries), 1)


def train_reward_model(base_model: str, queries, chosen, rejected, out_dir: str | Path, settings: TrainSettings,
                       val: tuple | None = None) -> dict:
    """Bradley-Terry on (query, chosen, rejected) id lists; writes the reward model."""
    torch.manual_seed(settings.seed)
    model, tok = load_reward_model_for_training(base_model, settings.dtype, settings.seed)
    pad, eos = tok.pad_token_id, tok.eos_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    gen = torch.Generator().manual_seed(settings.seed)
    steps = settings.epochs * math.ceil(len(queries) / settings.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / max(steps, 1)))
    t0, losses, accs = time.perf_counter(), [], []
    bar = _bar(steps, "RM", settings.progress)
    model.train()
    for _ in range(settings.epochs):
        for rows in _batches(len(queries), settings.batch_size, gen):
            q = [queries[i] for i in rows]
            # chosen and rejected in one forward: 2B rows sharing the query padding
            batch = pack(q + q, [chosen[i] for i in rows] + [rejected[i] for i in rows], pad, eos).trimmed()
            r = rm_scores(model, batch)  # (2B,)
            rc, rr = r[: len(rows)], r[len(rows):]
            loss = -torch.nn.functional.logsigmoid(rc - rr).mean()
            _step(model, loss, opt, sched, settings.max_grad_norm)
            losses.append(loss.detach())
            accs.append((rc > rr).float().mean().detach())
            bar.update(1)
            if len(losses) % 10 == 0:
                bar.set_postfix(loss=f"{float(losses[-1]):.3f}", acc=f"{float(torch.stack(accs[-10:]).mean()):.2f}")
    bar.close()
    model.eval()
    stats = {"rm_train_loss_last": float(torch.stack(losses[-10:]).mean()),
             "rm_train_accuracy_last": float(torch.stack(accs[-10:]).mean()),
             "rm_steps": len(losses), "rm_seconds": time.perf_counter() - t0}
    if val is not None:
        stats["rm_val_accuracy"] = preference_accuracy(model, *val, pad=pad, eos=eos)
    _save(model, tok, Path(out_dir))
    return stats
