"""The two stages before PPO: supervised fine-tuning (SFT) and a Bradley-Terry reward model.

Both are plain single-process training loops (no Ray here: the pipeline runs each as a Ray
task, ppo_ray.driver.stage_tasks.run_stage): on the embedded default they take seconds to a minute
on the CPU; on the real path they run on one GPU. Both write a normal
HF directory (safetensors weights + tokenizer) that the PPO stage loads by path.

- SFT: a full fine-tune of the base model on (prompt, " " + summary + EOS), the loss on the
  response tokens only (a multi-turn transcript's: the model's, its environment tokens out,
  as in PPO). The result is the policy's starting point AND the frozen reference.
- Reward model: AutoModelForSequenceClassification (num_labels=1) initialised from the SFT
  model (N+ recipe), head init N(0, 1/sqrt(H+1)); loss -log sigmoid(r_chosen - r_rejected)
  with each score read at the last real token (the EOS); reports validation accuracy.

Batches reuse the RolloutBatch layout (left-padded prompt, right-padded response) so the
same forward helpers as the PPO roles score them.

Device: TrainSettings.device ("auto" = cuda when available, else cpu) holds the model and each
micro-batch; rows are packed on the host. Gradient accumulation: an optimiser step over
batch_size rows runs as micro-batches of micro_batch_size rows (RM: pairs), each trimmed to
its own longest row, with each micro-batch's mean loss weighted by its share of the step's
tokens (SFT) or pairs (RM), so the accumulated gradient is the whole batch's (a single
micro-batch, the default, computes exactly the unaccumulated loss).
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from learner.algos import masked_mean
from ppo_ray.batch import RolloutBatch
from ppo_ray.logprobs import logprobs_from_logits
from ppo_ray.modeling import (DTYPES, load_causal_lm, load_tokenizer, pick_device, response_logits, reward_scores,
                              rm_scores)

log = logging.getLogger(__name__)


@dataclass
class TrainSettings:
    epochs: int = 1
    learning_rate: float = 1e-4
    batch_size: int = 16
    """Examples (RM: preference pairs) per optimiser step."""
    seed: int = 0
    max_grad_norm: float = 1.0
    dtype: str = "float32"
    progress: bool = True
    device: str = "auto"
    """Where the model trains: "auto" (cuda if available, else cpu), or a torch device name."""
    micro_batch_size: Optional[int] = None
    """Examples (RM: pairs) per forward/backward, accumulated up to batch_size; None = batch_size."""
    save_dtype: Optional[str] = None
    """Dtype of the saved weights; None = dtype. The pipeline saves in the PPO run's dtype, the
    one every PPO role loads them in: a float32 fine-tune of Qwen3-0.6B is then 1.2 GB, not
    2.4 GB, on disk and in the head's object store while PPO runs, with the same weights as
    PPO would have loaded (from_pretrained rounds to that dtype the same way)."""

    def __post_init__(self) -> None:
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or None, got {self.micro_batch_size}")

    def torch_device(self) -> torch.device:
        return pick_device(self.device)


def _batches(n: int, batch_size: int, gen: torch.Generator) -> list[list[int]]:
    order = torch.randperm(n, generator=gen).tolist()
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def _micro(rows: list[int], micro_batch_size: Optional[int]) -> list[list[int]]:
    """One optimiser step's rows split into micro-batches (one when micro_batch_size is None)."""
    m = micro_batch_size or len(rows)
    return [rows[i:i + m] for i in range(0, len(rows), m)]


def _save(model, tokenizer, out_dir: Path, dtype: Optional[str] = None) -> None:
    """HF directory: weights (in `dtype` when given) and tokenizer. The model config names the
    tokenizer's pad (which load_tokenizer may have chosen for a pad == EOS tokenizer), so the
    next stage agrees."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if dtype is not None and DTYPES[dtype] != model.dtype:
        model = model.to(DTYPES[dtype])  # the last use of the trained model: cast in place
    model.config.pad_token_id = tokenizer.pad_token_id
    if model.can_generate():  # the causal LM (SFT) has a generation config, the reward model none
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _release(device: torch.device) -> None:
    """Return the stage's cached GPU memory: in `launch.py all` the PPO actors that follow share
    the GPU with this process, and vLLM checks at start-up that its share of the GPU is free."""
    if device.type == "cuda":
        gc.collect()  # any reference cycle still holding parameters
        torch.cuda.empty_cache()


def _step(model, opt, sched, max_grad_norm: float) -> None:
    """Clip the accumulated gradients, optimiser and schedule step, zero the gradients."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


class _Progress:
    """A stage's progress as log lines (about ten per stage, with the latest postfix), not a
    terminal bar: the stages run as Ray tasks whose output reaches the driver line by line."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.enabled, self.done, self.postfix = total, desc, enabled, 0, {}
        self.every = max(1, total // 10)
        self.t0 = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.enabled and (self.done % self.every == 0 or self.done == self.total):
            extra = "".join(f"  {k} {v}" for k, v in self.postfix.items())
            log.info("%s step %d/%d%s  %.0f s", self.desc, self.done, self.total, extra,
                     time.perf_counter() - self.t0)

    def set_postfix(self, **values: str) -> None:
        self.postfix = values

    def close(self) -> None:
        pass


def _bar(total: int, desc: str, enabled: bool) -> _Progress:
    return _Progress(total, desc, enabled)


def _train(model, n_rows: int, backward: Callable[[list[int]], dict[str, Tensor]], settings: TrainSettings,
           desc: str, postfix: Callable[[dict[str, list[Tensor]]], dict[str, str]]) -> dict[str, list[Tensor]]:
    """The stages' training loop: AdamW (no weight decay), the learning rate decayed linearly
    to 0 over the run, settings.epochs passes over `n_rows` rows in shuffled batches of
    settings.batch_size (the order from settings.seed alone). Per batch, `backward(rows)`
    accumulates the step's gradient and returns its detached statistics ({"loss": ...}); then
    one clipped optimiser step. Every 10 steps the progress line shows `postfix(history)`.
    Returns each statistic, one tensor per step; the model is left in eval mode."""
    from transformers import get_linear_schedule_with_warmup

    opt = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    gen = torch.Generator().manual_seed(settings.seed)
    steps = settings.epochs * math.ceil(n_rows / settings.batch_size)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=steps)
    history: dict[str, list[Tensor]] = {}
    bar = _bar(steps, desc, settings.progress)
    model.train()
    for _ in range(settings.epochs):
        for rows in _batches(n_rows, settings.batch_size, gen):
            stats = backward(rows)
            _step(model, opt, sched, settings.max_grad_norm)
            for name, value in stats.items():
                history.setdefault(name, []).append(value)
            bar.update(1)
            if len(history["loss"]) % 10 == 0:
                bar.set_postfix(**postfix(history))
    bar.close()
    model.eval()
    return history  # the optimiser and the schedule (which holds it) go with this frame


# ----------------------------------------------------------------------------- SFT
def sft_loss(model, batch: RolloutBatch) -> Tensor:
    """Mean negative log-likelihood of the model's response tokens (EOS included): loss_mask,
    which leaves out a transcript's environment tokens (batch.env_mask: a tool's observations,
    context the later tokens attend to, never a target; the response tokens where it is None)."""
    logits = response_logits(model, batch)  # (B, T, V)
    logp = logprobs_from_logits(logits, batch.response_ids, 1.0, mask=batch.loss_mask)  # (B, T)
    return -masked_mean(logp, batch.loss_mask)


EnvMasks = Optional[Sequence[Sequence[bool]]]  # per response token, True = the environment's (None: all the model's)


def _model_tokens(responses: Sequence[Sequence[int]], env_masks: EnvMasks, rows: Sequence[int]) -> int:
    """The SFT targets among `rows`' response tokens: all of them, less the environment's."""
    if env_masks is None:
        return sum(len(responses[i]) for i in rows)
    return sum(len(responses[i]) - sum(env_masks[i]) for i in rows)


def check_env_masks(responses: Sequence[Sequence[int]], env_masks: EnvMasks, what: str = "SFT") -> None:
    """Each env mask is its response's length and leaves the last token (EOS) to the model
    (ValueError naming the row)."""
    if env_masks is None:
        return
    if len(env_masks) != len(responses):
        raise ValueError(f"{what}: {len(env_masks)} env masks for {len(responses)} responses")
    for i, (r, m) in enumerate(zip(responses, env_masks)):
        if len(m) != len(r) or (m and m[-1]):
            raise ValueError(f"{what}: row {i}'s env mask has {len(m)} entries for {len(r)} response tokens, or "
                             "marks its last (EOS) as the environment's")


def sft_backward(model, queries: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], rows: list[int],
                 pad: int, eos: int, micro_batch_size: Optional[int], device: torch.device,
                 env_masks: EnvMasks = None) -> Tensor:
    """Accumulate the gradient of one step's SFT loss (the mean over `rows`' model tokens: the
    environment's, `env_masks`, are out) in micro-batches; returns the step's loss, detached,
    on `device`."""
    n_tokens = _model_tokens(responses, env_masks, rows)
    total = None
    for part in _micro(rows, micro_batch_size):
        batch = RolloutBatch.from_tokens([queries[i] for i in part], [responses[i] for i in part], pad, eos,
                                         env_masks=None if env_masks is None else [env_masks[i] for i in part]
                                         ).trimmed().to(device)
        # micro-batch token mean x its share of the step's tokens (exactly 1.0 for one micro-batch)
        loss = sft_loss(model, batch) * (_model_tokens(responses, env_masks, part) / n_tokens)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def train_sft(base_model: str, queries: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
              out_dir: str | Path, settings: TrainSettings, val: tuple | None = None,
              env_masks: EnvMasks = None) -> dict:
    """Full fine-tune on (query ids, response ids incl. EOS); writes the SFT checkpoint.
    `env_masks`: per response token, True on a transcript's environment tokens, which are out of
    the loss (None: every response token is a target); `val`: (queries, responses) or
    (queries, responses, env masks)."""
    check_env_masks(responses, env_masks)
    if val is not None:
        check_env_masks(val[1], val[2] if len(val) > 2 else None, "SFT validation")
    torch.manual_seed(settings.seed)
    device = settings.torch_device()
    tok = load_tokenizer(base_model)
    model = load_causal_lm(base_model, settings.dtype).to(device)
    pad, eos = tok.pad_token_id, tok.eos_token_id
    t0 = time.perf_counter()
    losses = _train(
        model, len(queries),
        lambda rows: {"loss": sft_backward(model, queries, responses, rows, pad, eos, settings.micro_batch_size,
                                           device, env_masks)},
        settings, "SFT", lambda h: {"loss": f"{float(h['loss'][-1]):.3f}"})["loss"]
    stats = {"sft_train_loss_first": float(losses[0]), "sft_train_loss_last": float(torch.stack(losses[-10:]).mean()),
             "sft_steps": len(losses), "sft_seconds": time.perf_counter() - t0}
    if val is not None:
        with torch.no_grad():
            vq, vr = val[:2]
            venv = val[2] if len(val) > 2 else None
            vals = [sft_loss(model, RolloutBatch.from_tokens(vq[i:i + 64], vr[i:i + 64], pad, eos,
                                                             env_masks=None if venv is None else venv[i:i + 64]
                                                             ).trimmed().to(device))
                    for i in range(0, len(vq), 64)]
        stats["sft_val_loss"] = float(torch.stack(vals).mean())
    _save(model, tok, Path(out_dir), settings.save_dtype)
    del model  # before _release: the parameters are what it gives back (the optimiser went with _train)
    _release(device)
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


def preference_correct(model, queries, chosen, rejected, pad: int, eos: int, batch_size: int = 64) -> list[bool]:
    """Per pair: whether the model scores chosen > rejected."""
    if not queries:
        return []
    device = next(model.parameters()).device
    rc = reward_scores(model, RolloutBatch.from_tokens(queries, chosen, pad, eos), batch_size, device)
    rr = reward_scores(model, RolloutBatch.from_tokens(queries, rejected, pad, eos), batch_size, device)
    return (rc > rr).tolist()


def preference_accuracy(model, queries, chosen, rejected, pad: int, eos: int, batch_size: int = 64) -> float:
    """Fraction of pairs scored chosen > rejected."""
    return sum(preference_correct(model, queries, chosen, rejected, pad, eos, batch_size)) / max(len(queries), 1)


def rm_backward(model, queries, chosen, rejected, rows: list[int], pad: int, eos: int,
                micro_batch_size: Optional[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """Accumulate the gradient of one step's Bradley-Terry loss (the mean over the pairs
    `rows`) in micro-batches of pairs; returns (the step's loss, the fraction of pairs with
    r_chosen > r_rejected), detached, on `device`."""
    total, wins = None, []
    for part in _micro(rows, micro_batch_size):
        q = [queries[i] for i in part]
        # chosen and rejected in one forward: 2b rows sharing the query padding
        batch = RolloutBatch.from_tokens(q + q, [chosen[i] for i in part] + [rejected[i] for i in part], pad,
                                         eos).trimmed()
        r = rm_scores(model, batch.to(device))  # (2b,)
        rc, rr = r[: len(part)], r[len(part):]
        # micro-batch mean x its share of the step's pairs (exactly 1.0 for one micro-batch)
        loss = -torch.nn.functional.logsigmoid(rc - rr).mean() * (len(part) / len(rows))
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
        wins.append((rc > rr).detach())
    return total, torch.cat(wins).float().mean()


def train_reward_model(base_model: str, queries, chosen, rejected, out_dir: str | Path, settings: TrainSettings,
                       val: tuple | None = None) -> dict:
    """Bradley-Terry on (query, chosen, rejected) id lists; writes the reward model."""
    torch.manual_seed(settings.seed)
    device = settings.torch_device()
    model, tok = load_reward_model_for_training(base_model, settings.dtype, settings.seed)
    model.to(device)
    pad, eos = tok.pad_token_id, tok.eos_token_id

    def backward(rows: list[int]) -> dict[str, Tensor]:
        loss, acc = rm_backward(model, queries, chosen, rejected, rows, pad, eos, settings.micro_batch_size, device)
        return {"loss": loss, "acc": acc}

    t0 = time.perf_counter()
    history = _train(model, len(queries), backward, settings, "RM", lambda h: {
        "loss": f"{float(h['loss'][-1]):.3f}", "acc": f"{float(torch.stack(h['acc'][-10:]).mean()):.2f}"})
    losses, accs = history["loss"], history["acc"]
    stats = {"rm_train_loss_last": float(torch.stack(losses[-10:]).mean()),
             "rm_train_accuracy_last": float(torch.stack(accs[-10:]).mean()),
             "rm_steps": len(losses), "rm_seconds": time.perf_counter() - t0}
    if val is not None:
        correct = preference_correct(model, *val, pad=pad, eos=eos)
        stats["rm_val_accuracy"] = sum(correct) / max(len(correct), 1)
        stats["rm_val_correct"] = correct  # per pair, for accuracy by pair kind (the caller pops it)
    _save(model, tok, Path(out_dir), settings.save_dtype)
    del model  # before _release: the parameters are what it gives back (the optimiser went with _train)
    _release(device)
    return stats
