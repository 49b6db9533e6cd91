"""Reference (SFT) scorer: a frozen causal LM that returns per-token logprobs of responses.

Plain class, no Ray: ppo_ray.driver.hosts hosts it in a Ray actor. The KL penalty compares
the policy's and this model's full-softmax logprobs at the sampling temperature (no
top-k/top-p truncation: a truncated reference gives -inf for tokens outside its nucleus,
and the KL to the SFT model is defined on the full distributions).
"""

from __future__ import annotations

import time
from typing import Optional

import torch
from torch import Tensor

from ppo_ray.batch import RolloutBatch, rollout_micro_batches
from ppo_ray.config import REFERENCE, ConfigSlice, PPOConfig, role_fields
from ppo_ray.logprobs import logprobs_from_logits
from ppo_ray.modeling import load_causal_lm, pick_device, response_logits
from ppo_ray.stats import ReferenceStats


@torch.no_grad()
def full_response_logprobs(model, batch: RolloutBatch, temperature: float, micro_batch_size: int,
                           device: torch.device | str) -> Tensor:
    """(B, T) float32 CPU full-softmax logprobs at `temperature` of batch.response_ids under
    `model` (on `device`), over trimmed micro-batches; 0 on padding."""
    out = torch.zeros(batch.response_ids.shape, dtype=torch.float32)  # (B, T)
    for rows, micro in rollout_micro_batches(batch, micro_batch_size):
        micro = micro.to(device)
        logits = response_logits(model, micro)  # (b, t, V)
        t = micro.response_ids.shape[1]
        out[rows, :t] = logprobs_from_logits(logits, micro.response_ids, temperature,
                                             mask=micro.response_mask).cpu()
    return out


class ReferenceScorer:
    # The config fields from_config reads (and log_level, scorer_torch_threads: its actor
    # host's): the reference actor gets only these (PPOConfig.slice).
    CONFIG_FIELDS = role_fields(REFERENCE)

    def __init__(self, model_name: str, *, temperature: float = 1.0, dtype: str = "float32",
                 micro_batch_size: int = 8, device: Optional[str] = None):
        self.device = pick_device(device)  # the GPU Ray gave this actor (scorer_num_gpus), else the CPU
        self.model = load_causal_lm(model_name, dtype).to(self.device)
        self.model.requires_grad_(False)
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size

    @classmethod
    def from_config(cls, cfg: PPOConfig | ConfigSlice, model_dir: str, device: Optional[str] = None) -> "ReferenceScorer":
        """The reference scorer of `model_dir` (the resolved ref_model_name) as `cfg` sets it up."""
        return cls(model_dir, temperature=cfg.temperature, dtype=cfg.dtype, micro_batch_size=cfg.micro_batch_size,
                   device=device)

    def logprobs(self, batch: RolloutBatch) -> tuple[Tensor, ReferenceStats]:
        """(B, T) float32 logprobs of batch.response_ids under the reference (0 on padding),
        and the call's stats (its seconds)."""
        t0 = time.perf_counter()
        out = full_response_logprobs(self.model, batch, self.temperature, self.micro_batch_size, self.device)
        return out, ReferenceStats(seconds=time.perf_counter() - t0)
