"""Reward scorer: a reward model and/or reward functions, combined with weights.

Plain class, no Ray: ppo_ray.placement hosts it in a Ray actor.

- A reward model is an AutoModelForSequenceClassification with num_labels=1; its score is
  read at the last real token of prompt + response (the EOS when the response has one,
  never a pad: trl #3750 placed rewards on the pad after EOS). A causal LM (or any
  checkpoint without trained `score` weights) is refused, not loaded with a random head:
  its "rewards" would be noise and PPO would train on them without a sign of trouble
  (check_reward_model reads config.json before any actor starts; load_reward_model
  checks the weights).
- A reward function is named "package.module:function" and called as
  fn(prompts: list[str], completions: list[str]) -> list[float]. It is imported only from
  the module path the user named (never from data).
- Scores are summed with weights (reward model first, then functions, in config order).
- missing_eos_penalty (N+ / TRL): a response cut at max_new_tokens without EOS gets that
  score instead of the model's.
- A non-finite score is an error naming the source and the prompt index, or, with
  nonfinite="drop", the sample's score becomes NaN, which the learner masks out and counts.
"""

from __future__ import annotations

import importlib
import math
import time
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from learner.buffer import rollouts_to
from ppo_ray.batch import RolloutBatch
from ppo_ray.modeling import last_token_hidden, load_reward_model, pick_device, resolve_model_path

RewardFn = Callable[[list[str], list[str]], Sequence[float]]


class RewardError(ValueError):
    """A reward source failed or returned unusable values; the message names it."""


def import_reward_fn(spec: str) -> RewardFn:
    """Import "package.module:function" (only that module, as the user named it)."""
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise RewardError(f"reward function {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(f"reward function {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise RewardError(f"reward function {spec!r}: module {module_name!r} has no callable {fn_name!r}")
    return fn


def check_reward_model(name: str) -> None:
    """Cheap checks of reward_model_name from its config.json alone (no weights loaded), so a
    path that is not a reward model fails before any actor starts: a directory without
    config.json or a file (FileNotFoundError, from resolve_model_path), an unreadable config
    (RewardError "is not a loadable model"), num_labels != 1, or a checkpoint saved as
    anything but *ForSequenceClassification (a causal LM: RewardError)."""
    from transformers import AutoConfig

    path = resolve_model_path(name)
    try:
        cfg = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise RewardError(f"reward model {name!r} is not a loadable model: {e}") from e
    archs = list(getattr(cfg, "architectures", None) or [])
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise RewardError(
            f"reward model {name!r} is a {'/'.join(archs)} checkpoint, not a sequence-classification reward "
            "model: loading it as one would give it a randomly initialised score head, whose scores are noise. "
            "Name a checkpoint saved from AutoModelForSequenceClassification (num_labels=1), e.g. the rm/ "
            "directory of `launch.py rm`")
    # after the architecture: transformers gives a config without id2label num_labels=2
    if getattr(cfg, "num_labels", 1) != 1:
        raise RewardError(f"reward model {name!r} has num_labels={cfg.num_labels}; a reward model needs 1")


class RewardScorer:
    def __init__(self, reward_model_name: Optional[str] = None, reward_funcs: Sequence[str] = (),
                 weights: Sequence[float] = (), *, missing_eos_penalty: Optional[float] = None,
                 nonfinite: str = "error", dtype: str = "float32", micro_batch_size: int = 8,
                 device: Optional[str] = None):
        if reward_model_name is None and not reward_funcs:
            raise RewardError("no reward source: set reward_model_name and/or reward_funcs")
        if reward_model_name:
            check_reward_model(reward_model_name)
        self.device = pick_device(device)  # the GPU Ray gave this actor (scorer_num_gpus), else the CPU
        self.model = load_reward_model(reward_model_name, dtype).to(self.device) if reward_model_name else None
        self.funcs = [(spec, import_reward_fn(spec)) for spec in reward_funcs]
        n = len(self.funcs) + (self.model is not None)
        self.weights = list(weights) if weights else [1.0] * n
        if len(self.weights) != n:
            raise RewardError(f"reward_weights has {len(self.weights)} entries for {n} reward sources")
        self.missing_eos_penalty = missing_eos_penalty
        self.nonfinite = nonfinite
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def model_scores(self, batch: RolloutBatch) -> Tensor:
        """(B,) float32 reward-model scores at the last real token."""
        backbone = getattr(self.model, self.model.base_model_prefix)
        out = []
        for start in range(0, len(batch), self.micro_batch_size):
            micro = batch.select(range(start, min(start + self.micro_batch_size, len(batch)))).trimmed()
            hidden = last_token_hidden(backbone, rollouts_to(micro, self.device))  # (b, H)
            out.append(self.model.score(hidden).float().squeeze(-1).cpu())         # (b,)
        return torch.cat(out)

    def function_scores(self, spec: str, fn: RewardFn, batch: RolloutBatch) -> Tensor:
        n = len(batch)
        try:
            values = fn(list(batch.prompts), list(batch.responses))
        except Exception as e:  # a user function: report which one and what it raised
            raise RewardError(f"reward function {spec!r} raised {type(e).__name__}: {e}") from e
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError) as e:
            raise RewardError(f"reward function {spec!r} must return a list of {n} numbers: {e}") from e
        if len(values) != n:
            raise RewardError(f"reward function {spec!r} returned {len(values)} values for {n} prompts")
        return torch.tensor(values, dtype=torch.float32)

    def score(self, batch: RolloutBatch) -> tuple[Tensor, dict]:
        """(B,) float32 combined scores, and small stats (per-source means, seconds, drops)."""
        t0 = time.perf_counter()
        sources: list[tuple[str, Tensor]] = []
        if self.model is not None:
            sources.append(("reward_model", self.model_scores(batch)))
        sources += [(spec, self.function_scores(spec, fn, batch)) for spec, fn in self.funcs]

        total = torch.zeros(len(batch))
        stats: dict[str, float] = {}
        for (name, values), w in zip(sources, self.weights):
            bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
            if bad and self.nonfinite == "error":
                raise RewardError(f"reward source {name!r} gave non-finite score {values[bad[0]].item()} "
                                  f"for prompt index {bad[0]} ({len(bad)} non-finite in all)")
            total = total + w * values
            finite = values[torch.isfinite(values)]
            stats[f"score/{name}"] = float(finite.mean()) if len(finite) else math.nan
        if self.missing_eos_penalty is not None:
            total = torch.where(batch.has_eos, total, torch.full_like(total, self.missing_eos_penalty))
        stats["dropped_nonfinite"] = float((~torch.isfinite(total)).sum())
        total = torch.where(torch.isfinite(total), total, torch.full_like(total, math.nan))
        stats["reward_s"] = time.perf_counter() - t0
        return total, stats
