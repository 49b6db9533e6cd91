"""One PPO step's experience and the minibatch / micro-batch schedule over it.

`Experience` is the typed per-token data the learner computes from one RolloutBatch
(OpenRLHF's `Experience`, N+'s rollout tensors): every field is a tensor with a shape
comment, no string-keyed dicts on the data path. `ExperienceBuffer` shuffles its rows into
minibatches (one optimiser step each) and splits those into micro-batches (one
forward/backward each), trimming each micro-batch's padding as RolloutBatch.trimmed does
(ppo_ray/batch.py, with TrimPlan's host-side widths): every (B, T) per-token tensor loses
the same right columns as response_ids. Each field declares its kind (per token, per
sequence, host count) in its metadata, and select / trimmed go by that.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields, replace
from typing import Optional, Sequence

import torch
from torch import Tensor

from ppo_ray.batch import RolloutBatch, TrimPlan, split_rows


# ---------------------------------------------------------------------- experience
# What each Experience field is, declared at the field (its metadata "kind"): select() and
# trimmed() treat every field by its kind, so a new field says what it is once.
TOKEN = "per token"        # (B, T) tensor: rows selected, right columns trimmed with response_ids
SEQUENCE = "per sequence"  # (B,) tensor: rows selected
HOST = "host"              # a host count of the whole batch: unknown (0) for a subset
ROLLOUTS = "rollouts"      # the RolloutBatch, which selects and trims itself


def _kind(kind: str, **default) -> dataclasses.Field:
    return field(metadata={"kind": kind}, **default)


@dataclass
class Experience:
    """One step's rollouts and the per-token tensors the learner derives from them."""

    rollouts: RolloutBatch = _kind(ROLLOUTS)  # prompt_ids (B, P), response_ids (B, T), masks, gen_logprobs
    mask: Tensor = _kind(TOKEN)           # (B, T) bool: real response tokens (response_mask; dropped rows False)
    policy_mask: Tensor = _kind(TOKEN)    # (B, T) bool: mask & finite old_logprobs (the tokens the PPO-clip loss sees)
    scores: Tensor = _kind(SEQUENCE)      # (B,) float32 sequence scores (0 on dropped rows)
    old_logprobs: Tensor = _kind(TOKEN)   # (B, T) float32 log pi_old(a_t|s_t), truncated + tempered like the sampler
    ref_logprobs: Tensor = _kind(TOKEN)   # (B, T) float32 log pi_ref(a_t|s_t), full softmax at temperature
    kl: Tensor = _kind(TOKEN)             # (B, T) float32 KL_t estimate (0 on padding)
    rewards: Tensor = _kind(TOKEN)        # (B, T) float32 shaped (and optionally whitened) per-token rewards
    values: Optional[Tensor] = _kind(TOKEN)  # (B, T) float32 V_old(s_t); None: the estimator has no critic
    advantages: Tensor = _kind(TOKEN)     # (B, T) float32 the estimator's advantages (whitened if configured)
    returns: Optional[Tensor] = _kind(TOKEN)  # (B, T) float32 G_t = A_t (raw) + V_old(s_t); None without a critic
    is_weights: Optional[Tensor] = _kind(TOKEN, default=None)  # (B, T) float32 off-policy weights (tis); None = 1
    seq_len: int = _kind(HOST, default=0)  # the longest row's real tokens (the causal layout's width); 0 = not known
    response_tokens: int = _kind(HOST, default=0)  # sum over rows of (last real response column + 1); 0 = not known

    def __len__(self) -> int:
        return len(self.rollouts)

    def of_kind(self, kind: str) -> list[str]:
        """The names of the fields of `kind` that are there (values and returns are None
        without a critic, is_weights without is_correction tis)."""
        return [f.name for f in fields(self) if f.metadata["kind"] == kind and getattr(self, f.name) is not None]

    def select(self, rows: Sequence[int]) -> "Experience":
        """Rows `rows` (in that order); the host counts are not known for a subset (0)."""
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.mask.device)
        return replace(self, rollouts=self.rollouts.select(rows),
                       **{name: getattr(self, name)[idx] for name in self.of_kind(TOKEN) + self.of_kind(SEQUENCE)},
                       **{name: 0 for name in self.of_kind(HOST)})

    def trimmed(self, p_keep: int, t_keep: int) -> "Experience":
        """Prompt columns from p_keep on, response columns [0, t_keep): the response
        tensors lose only right columns, consistently with response_ids."""
        return replace(self, rollouts=self.rollouts.trimmed(p_keep, t_keep),
                       **{name: getattr(self, name)[:, :t_keep] for name in self.of_kind(TOKEN)})


def micro_row_groups(rows: list[int], plan: TrimPlan, micro_batch_size: int, sort: bool) -> list[list[int]]:
    """`rows` micro_batch_size at a time: in their order, or longest first (`sort`)."""
    if sort:
        rows = plan.by_length(rows)
    return [rows[i: i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]


class ExperienceBuffer:
    """Shuffled minibatches (seeded) and trimmed micro-batches over one Experience."""

    def __init__(self, experience: Experience, mini_batch_size: int, micro_batch_size: int,
                 plan: TrimPlan | None = None, sort: bool = False):
        if mini_batch_size < 1 or micro_batch_size < 1:
            raise ValueError(f"mini_batch_size ({mini_batch_size}) and micro_batch_size "
                             f"({micro_batch_size}) must be >= 1")
        self.experience = experience
        self.mini_batch_size = min(mini_batch_size, len(experience))
        self.micro_batch_size = min(micro_batch_size, self.mini_batch_size)
        self.plan = plan or TrimPlan.of(experience.rollouts)
        self.sort = sort

    def __len__(self) -> int:
        return len(self.experience)

    def minibatch_indices(self, generator: torch.Generator) -> list[Tensor]:
        """One epoch: a random permutation of the rows split into minibatches (CPU long)."""
        perm = torch.randperm(len(self), generator=generator)
        return split_rows(perm, self.mini_batch_size)

    def micro_rows(self, minibatch: Tensor) -> list[list[int]]:
        """The minibatch's rows, micro_batch_size at a time: in the minibatch's (shuffled)
        order, or longest first (`sort`). Gradient accumulation sums the micro-batches'
        losses, so the grouping changes the gradient only by float summation order."""
        return micro_row_groups(minibatch.tolist(), self.plan, self.micro_batch_size, self.sort)

    def micro_batch(self, rows: Sequence[int]) -> Experience:
        """These rows, trimmed to their own widths, with their host counts."""
        return replace(self.experience.select(rows).trimmed(*self.plan.widths(rows)),
                       seq_len=self.plan.seq_len(rows), response_tokens=self.plan.response_tokens(rows))
