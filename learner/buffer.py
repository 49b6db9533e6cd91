"""One PPO step's experience and the minibatch / micro-batch schedule over it.

`Experience` is the typed per-token data the learner computes from one RolloutBatch
(OpenRLHF's `Experience`, N+'s rollout tensors): every field is a tensor with a shape
comment, no string-keyed dicts on the data path. `ExperienceBuffer` shuffles its rows into
minibatches (one optimiser step each) and splits those into micro-batches (one
forward/backward each), trimming each micro-batch's padding.

Trimming (RolloutBatch.trimmed semantics): drop prompt columns that are padding in every
row of the micro-batch (on the left) and response columns that are padding in every row
(on the right). Dropping prompt columns changes P but not the response columns, so every
(B, T) per-token tensor only loses its right columns, consistently with response_ids. The
column counts come from per-row lengths kept on the host, so trimming a micro-batch never
reads a device tensor back (no per-micro-batch synchronisation).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Iterator, Sequence

import torch
from torch import Tensor

from ppo_ray.batch import RolloutBatch


# ---------------------------------------------------------------------- rollout helpers
def rollouts_to(batch: RolloutBatch, device: torch.device | str) -> RolloutBatch:
    """The batch with its tensors on `device` (lists and ints unchanged)."""
    return replace(
        batch,
        prompt_ids=batch.prompt_ids.to(device), prompt_mask=batch.prompt_mask.to(device),
        response_ids=batch.response_ids.to(device), response_mask=batch.response_mask.to(device),
        gen_logprobs=batch.gen_logprobs.to(device),
    )


@dataclass(frozen=True)
class TrimPlan:
    """Per-row extents, on the host, from which any subset's trimmed widths follow."""

    prompt_start: list[int]  # B: first real prompt column of each row (P if none)
    response_end: list[int]  # B: last real response column + 1 of each row (0 if none)
    prompt_len: int          # P
    response_len: int        # T

    @staticmethod
    def of(batch: RolloutBatch) -> "TrimPlan":
        """Read the masks once (one host transfer if they live on a device)."""
        pm, rm = batch.prompt_mask.cpu(), batch.response_mask.cpu()
        p, t = pm.shape[1], rm.shape[1]
        cols_p = torch.arange(p).expand_as(pm)
        cols_t = torch.arange(t).expand_as(rm)
        start = torch.where(pm, cols_p, torch.full_like(cols_p, p)).amin(dim=1) if p else torch.zeros(len(pm), dtype=torch.long)
        end = torch.where(rm, cols_t + 1, torch.zeros_like(cols_t)).amax(dim=1) if t else torch.zeros(len(rm), dtype=torch.long)
        return TrimPlan(start.tolist(), end.tolist(), p, t)

    def widths(self, rows: Sequence[int]) -> tuple[int, int]:
        """(first prompt column kept, response columns kept) for these rows, as
        RolloutBatch.trimmed computes them (at least one response column)."""
        p_keep = min(self.prompt_start[i] for i in rows)
        t_keep = max(1, max(self.response_end[i] for i in rows))
        return p_keep, t_keep

    def length(self, row: int) -> int:
        """Real tokens of a row: prompt + response up to its last real token."""
        return self.prompt_len - self.prompt_start[row] + self.response_end[row]

    def seq_len(self, rows: Sequence[int]) -> int:
        """The causal layout's width for these rows (RolloutBatch.causal_sequences): the
        longest row's real tokens, at least 1."""
        return max(1, max(self.length(i) for i in rows))

    def response_tokens(self, rows: Sequence[int]) -> int:
        """Response positions up to each row's last real token, summed over the rows."""
        return sum(self.response_end[i] for i in rows)

    def by_length(self, rows: Sequence[int]) -> list[int]:
        """The rows sorted by real length, longest first (stable), so that consecutive
        micro-batches hold rows of similar length and pay for little padding; longest first
        so the first micro-batch allocates the most memory the others then reuse."""
        return sorted(rows, key=lambda i: -self.length(i))

    def cost(self, rows: Sequence[int], causal: bool) -> tuple[int, int]:
        """(token positions a forward over these rows computes, real tokens among them):
        width x rows with the masked layout's trimmed widths or the causal layout's."""
        if causal:
            width = self.seq_len(rows)
        else:
            p_keep, t_keep = self.widths(rows)
            width = self.prompt_len - p_keep + t_keep
        return width * len(rows), sum(self.length(i) for i in rows)


def trim_rollouts(batch: RolloutBatch, p_keep: int, t_keep: int) -> RolloutBatch:
    return replace(
        batch,
        prompt_ids=batch.prompt_ids[:, p_keep:], prompt_mask=batch.prompt_mask[:, p_keep:],
        response_ids=batch.response_ids[:, :t_keep], response_mask=batch.response_mask[:, :t_keep],
        gen_logprobs=batch.gen_logprobs[:, :t_keep],
    )


def split_rows(index: Tensor, size: int) -> list[Tensor]:
    """Consecutive chunks of `size` rows of a 1-D index tensor (the last may be shorter)."""
    return list(torch.split(index, size))


def rollout_micro_batches(batch: RolloutBatch, size: int, plan: TrimPlan | None = None,
                          sort: bool = False) -> Iterator[tuple[list[int], RolloutBatch]]:
    """(rows, trimmed micro-batch) over rows 0..B-1, `size` rows at a time: the no-grad
    scoring pass before the PPO epochs. In row order, or longest first (`sort`,
    TrimPlan.by_length); the caller writes results back by `rows`."""
    plan = plan or TrimPlan.of(batch)
    order = plan.by_length(range(len(batch))) if sort else list(range(len(batch)))
    for chunk in split_rows(torch.tensor(order, dtype=torch.long), size):
        rows = chunk.tolist()
        p_keep, t_keep = plan.widths(rows)
        yield rows, trim_rollouts(batch.select(rows), p_keep, t_keep)


# ---------------------------------------------------------------------- experience
@dataclass
class Experience:
    """One step's rollouts and the per-token tensors the learner derives from them."""

    rollouts: RolloutBatch  # prompt_ids (B, P), response_ids (B, T), masks, gen_logprobs
    mask: Tensor            # (B, T) bool: real response tokens (= rollouts.response_mask; dropped rows all False)
    policy_mask: Tensor     # (B, T) bool: mask & finite old_logprobs (the tokens the PPO-clip loss sees)
    scores: Tensor          # (B,) float32 sequence scores (0 on dropped rows)
    old_logprobs: Tensor    # (B, T) float32 log pi_old(a_t|s_t), truncated + tempered like the sampler
    ref_logprobs: Tensor    # (B, T) float32 log pi_ref(a_t|s_t), full softmax at temperature
    kl: Tensor              # (B, T) float32 KL_t estimate (0 on padding)
    rewards: Tensor         # (B, T) float32 shaped (and optionally whitened) per-token rewards
    values: Tensor          # (B, T) float32 V_old(s_t)
    advantages: Tensor      # (B, T) float32 GAE advantages (whitened if configured)
    returns: Tensor         # (B, T) float32 G_t = A_t (raw) + V_old(s_t)
    seq_len: int = 0        # host: the longest row's real tokens (the causal layout's width); 0 = not known
    response_tokens: int = 0  # host: sum over rows of (last real response column + 1); 0 = not known

    def __len__(self) -> int:
        return len(self.rollouts)

    def _per_token(self) -> list[str]:
        return [f.name for f in fields(self) if f.name not in ("rollouts", "scores", "seq_len", "response_tokens")]

    def select(self, rows: Sequence[int]) -> "Experience":
        """Rows `rows` (in that order); the host counts are not known for a subset (0)."""
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.mask.device)
        return replace(self, rollouts=self.rollouts.select(rows), scores=self.scores[idx], seq_len=0, response_tokens=0,
                       **{name: getattr(self, name)[idx] for name in self._per_token()})

    def trimmed(self, p_keep: int, t_keep: int) -> "Experience":
        """Prompt columns from p_keep on, response columns [0, t_keep): the response
        tensors lose only right columns, consistently with response_ids."""
        return replace(self, rollouts=trim_rollouts(self.rollouts, p_keep, t_keep),
                       **{name: getattr(self, name)[:, :t_keep] for name in self._per_token()})


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
        rows = minibatch.tolist()
        if self.sort:
            rows = self.plan.by_length(rows)
        return [rows[i: i + self.micro_batch_size] for i in range(0, len(rows), self.micro_batch_size)]

    def micro_batch(self, rows: Sequence[int]) -> Experience:
        """These rows, trimmed to their own widths, with their host counts."""
        return replace(self.experience.select(rows).trimmed(*self.plan.widths(rows)),
                       seq_len=self.plan.seq_len(rows), response_tokens=self.plan.response_tokens(rows))

    def micro_batches(self, minibatch: Tensor) -> Iterator[Experience]:
        """The micro-batches of micro_rows (micro_batch of each)."""
        for rows in self.micro_rows(minibatch):
            yield self.micro_batch(rows)
