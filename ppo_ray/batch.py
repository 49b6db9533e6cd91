"""RolloutBatch: the typed tensors that pass between actors (through the Ray object store).

Layout (the one every role uses; OpenRLHF's `Experience` and the N+ TL;DR code use the same):

    prompt_ids    (B, P)  left-padded with pad_token_id      [pad pad p0 p1 p2]
    response_ids  (B, T)  right-padded with pad_token_id     [r0 r1 EOS pad pad]
    sequence      (B, P+T) = cat(prompt_ids, response_ids)

so every prompt ends at column P-1 and every response starts at column P, and the logits
that predict response token t sit at sequence column P-1+t. Masks are bool, True on real
tokens; a response is real up to and including its first EOS (pad is never EOS).

Also here, because they are about this layout and every role uses them: padding token
lists into it (`pad_rows`, `RolloutBatch.from_tokens`), moving it to a device
(`RolloutBatch.to`), trimming padding (`RolloutBatch.trimmed`, `TrimPlan`) and the
trimmed micro-batches of a scoring pass (`rollout_micro_batches`).

Trimming: drop prompt columns that are padding in every row (on the left) and response
columns that are padding in every row (on the right), keeping at least one response
column. Dropping prompt columns changes P but not the response columns, so a (B, T)
per-token tensor aligned with response_ids only loses right columns. TrimPlan keeps the
per-row extents on the host, so trimming a micro-batch never reads a device tensor back
(no per-micro-batch synchronisation).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence


def check_mask(mask: Tensor) -> Tensor:
    """`mask` itself, after checking it is bool (the one mask convention: True = real token)."""
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = real response token), got {mask.dtype}")
    return mask


def fresh_enough(sampled_version: int, learner_version: int, limit: int) -> bool:
    """The staleness rule, in one place (the driver and the learner): rollouts sampled with
    `sampled_version` may train a learner at `learner_version` when they are 0..`limit`
    versions behind it (never ahead)."""
    return 0 <= learner_version - sampled_version <= limit


def pad_rows(rows: Sequence[Sequence[int] | Sequence[float] | Tensor], value: int | float | bool, side: str,
             dtype: torch.dtype = torch.long, min_width: int = 0) -> Tensor:
    """(B, L) tensor of `rows` padded with `value` on `side` ("left" or "right") to the
    longest row (at least `min_width` columns); torch's pad_sequence does the padding."""
    padded = pad_sequence([torch.as_tensor(r, dtype=dtype) for r in rows], batch_first=True,
                          padding_value=value, padding_side=side)  # (B, L)
    if padded.shape[1] < min_width:
        extra = min_width - padded.shape[1]
        padded = torch.nn.functional.pad(padded, (extra, 0) if side == "left" else (0, extra), value=value)
    return padded


def _real(rows: Sequence[Sequence]) -> list[Tensor]:
    """True for every element of each row (the rows' masks before padding)."""
    return [torch.ones(len(r), dtype=torch.bool) for r in rows]


@dataclass
class RolloutBatch:
    prompt_ids: Tensor      # (B, P) long, left-padded
    prompt_mask: Tensor     # (B, P) bool, True on real prompt tokens
    response_ids: Tensor    # (B, T) long, right-padded
    response_mask: Tensor   # (B, T) bool, True up to and including the first EOS
    gen_logprobs: Tensor    # (B, T) float32: the generator's logprob of each sampled token (0 on padding)
    adapter_version: int    # the LoRA version the generator sampled with
    pad_token_id: int
    eos_token_id: int
    prompts: list[str] = field(default_factory=list)         # B prompt texts
    responses: list[str] = field(default_factory=list)       # B decoded responses (up to EOS, EOS not shown)
    finish_reasons: list[str] = field(default_factory=list)  # B of "stop" (EOS) / "length"
    # (B,) long: the group of each row, its prompt's global index in the step (the generator's);
    # the samples_per_prompt samples of one prompt share it and are contiguous rows. None = not
    # known (a batch built by hand); the group estimators need it.
    groups: Optional[Tensor] = None
    # (B, T) long: the adapter version that sampled each response token (partial_rollout
    # continue: a response moves on to newer versions as it grows; values on padding mean
    # nothing). None = every token was sampled with adapter_version, which is in any case the
    # batch's oldest version (the one the staleness checks read).
    token_versions: Optional[Tensor] = None
    # (B, T) bool: True on environment tokens (a multi-turn episode's observations, appended
    # after the model's turns): real context the forward attends to, never trained on. They
    # are out of loss_mask, so out of the policy loss, the KL, the value targets, the
    # entropy and the sync check. None = every real response token is the model's.
    env_mask: Optional[Tensor] = None
    # (B,) float32: a multi-turn episode's environment reward, the sum of its steps' (NaN: a
    # failed episode dropped under reward_failure drop); the reward scorer adds it to the score.
    # None = no environment (single-turn rows).
    env_rewards: Optional[Tensor] = None
    # (B,) bool: the episode ended on its own (the environment's done, or the model's EOS), not
    # at max_turns, the token budget or a failure: what has_eos means for an episode. None = the
    # tokens tell (an EOS in the response).
    ended: Optional[Tensor] = None

    def __post_init__(self) -> None:
        b, p = self.prompt_ids.shape
        bt = self.response_ids.shape
        if self.prompt_mask.shape != (b, p) or bt[0] != b or self.response_mask.shape != bt \
                or self.gen_logprobs.shape != bt:
            raise ValueError(
                f"RolloutBatch shapes disagree: prompt_ids {tuple(self.prompt_ids.shape)}, prompt_mask "
                f"{tuple(self.prompt_mask.shape)}, response_ids {tuple(bt)}, response_mask "
                f"{tuple(self.response_mask.shape)}, gen_logprobs {tuple(self.gen_logprobs.shape)}")
        if self.groups is not None and (self.groups.shape != (b,) or self.groups.dtype != torch.long):
            raise ValueError(f"RolloutBatch.groups must be a (B,) = ({b},) long tensor, got "
                             f"{tuple(self.groups.shape)} {self.groups.dtype}")
        if self.token_versions is not None and (self.token_versions.shape != bt
                                                or self.token_versions.dtype != torch.long):
            raise ValueError(f"RolloutBatch.token_versions must be a (B, T) = {tuple(bt)} long tensor, got "
                             f"{tuple(self.token_versions.shape)} {self.token_versions.dtype}")
        if self.env_mask is not None:
            if self.env_mask.shape != bt or self.env_mask.dtype != torch.bool:
                raise ValueError(f"RolloutBatch.env_mask must be a (B, T) = {tuple(bt)} bool tensor, got "
                                 f"{tuple(self.env_mask.shape)} {self.env_mask.dtype}")
            if bool((self.env_mask & ~self.response_mask).any()):
                raise ValueError("RolloutBatch.env_mask marks padding: environment tokens must be real "
                                 "response tokens (response_mask True)")
        for name, dtype in (("env_rewards", torch.float32), ("ended", torch.bool)):
            value = getattr(self, name)
            if value is not None and (value.shape != (b,) or value.dtype != dtype):
                raise ValueError(f"RolloutBatch.{name} must be a (B,) = ({b},) {dtype} tensor, got "
                                 f"{tuple(value.shape)} {value.dtype}")
        if self.pad_token_id == self.eos_token_id:
            raise ValueError("pad_token_id equals eos_token_id: pad must be a distinct token")

    @staticmethod
    def from_tokens(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_token_id: int,
                    eos_token_id: int, gen_logprobs: Optional[Sequence[Sequence[float]]] = None,
                    adapter_version: int = 0, groups: Optional[Sequence[int]] = None,
                    token_versions: Optional[Sequence[Sequence[int]]] = None,
                    env_masks: Optional[Sequence[Sequence[bool]]] = None,
                    env_rewards: Optional[Sequence[float]] = None, ended: Optional[Sequence[bool]] = None,
                    **texts: list[str]) -> "RolloutBatch":
        """Token lists -> a RolloutBatch: prompts left-padded, responses right-padded (at
        least one response column), every given token real; gen_logprobs per response
        token (0 when not given, and on padding); `groups`: each row's group id (None = none);
        `token_versions`: each response token's adapter version (None = all adapter_version);
        `env_masks`: each response token's True = the environment's (None = all the model's);
        `env_rewards`, `ended`: each episode's (None = not episodes). `texts`: prompts, responses, finish_reasons."""
        response_t = pad_rows(response_ids, pad_token_id, "right", min_width=1)  # (B, T)
        t = response_t.shape[1]
        logprobs = (pad_rows(gen_logprobs, 0.0, "right", torch.float32, min_width=t) if gen_logprobs is not None
                    else torch.zeros(len(response_ids), t))
        if token_versions is not None:
            token_versions = torch.stack([
                torch.as_tensor(list(v) + [v[-1] if v else adapter_version] * (t - len(v)), dtype=torch.long)
                for v in token_versions]) if len(token_versions) else torch.zeros(0, t, dtype=torch.long)
        return RolloutBatch(
            prompt_ids=pad_rows(prompt_ids, pad_token_id, "left"),                                 # (B, P)
            prompt_mask=pad_rows(_real(prompt_ids), False, "left", torch.bool),                   # (B, P)
            response_ids=response_t,
            response_mask=pad_rows(_real(response_ids), False, "right", torch.bool, min_width=1),  # (B, T)
            gen_logprobs=logprobs,                                                                # (B, T)
            adapter_version=adapter_version, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
            groups=None if groups is None else torch.as_tensor(groups, dtype=torch.long),
            token_versions=token_versions,
            env_mask=None if env_masks is None else pad_rows(env_masks, False, "right", torch.bool, min_width=t),
            env_rewards=None if env_rewards is None else torch.tensor(list(env_rewards), dtype=torch.float32),
            ended=None if ended is None else torch.tensor(list(ended), dtype=torch.bool),
            **texts)

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[1]

    @property
    def loss_mask(self) -> Tensor:
        """(B, T) bool: the model's real response tokens, the ones trained on (response_mask
        without env_mask's environment tokens). The forward attends to all of response_mask."""
        return self.response_mask if self.env_mask is None else self.response_mask & ~self.env_mask

    @property
    def env_tokens(self) -> Tensor:
        """(B, T) bool: env_mask, or all False when the batch has none."""
        return torch.zeros_like(self.response_mask) if self.env_mask is None else self.env_mask

    @property
    def response_lengths(self) -> Tensor:
        return self.response_mask.sum(dim=1)  # (B,)

    def versions_of_tokens(self) -> Tensor:
        """(B, T) long: each response token's adapter version (token_versions, or adapter_version
        everywhere)."""
        if self.token_versions is not None:
            return self.token_versions
        return torch.full(self.response_ids.shape, self.adapter_version, dtype=torch.long,
                          device=self.response_ids.device)

    @property
    def has_eos(self) -> Tensor:
        """(B,) bool: the response ended with EOS (not cut at max_new_tokens); an episode: it
        ended on its own (`ended`: the environment's done or the model's EOS), not at a limit."""
        if self.ended is not None:
            return self.ended
        ends = self.response_mask & (self.response_ids == self.eos_token_id)
        return ends.any(dim=1)

    def sequences(self) -> tuple[Tensor, Tensor, Tensor]:
        """input_ids (B, P+T), attention_mask (B, P+T), position_ids (B, P+T) for one forward.

        Position ids count real tokens from 0 (as the generator saw them), so left padding
        does not shift positions.
        """
        input_ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)       # (B, P+T)
        attention_mask = torch.cat([self.prompt_mask, self.response_mask], dim=1)  # (B, P+T)
        position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)     # (B, P+T)
        return input_ids, attention_mask, position_ids

    def causal_sequences(self, length: int) -> tuple[Tensor, Tensor]:
        """The rows moved to the left edge, for a forward with no attention mask.

        Row i's real tokens are one contiguous run in cat(prompt, response): columns
        [P - p_i, P + r_i). Shifted to start at column 0, with whatever follows them
        (padding, or the end of the row repeated) after, a plain causal forward gives every
        real token exactly the attention and positions (0, 1, ...) of the masked forward
        over the left-padded layout: a causal query never sees the columns after it. So no
        attention mask is needed, and SDPA can run its causal flash kernel.

        Args:
            length: columns to keep, >= max_i (p_i + r_i) (host-side, so that building
                the layout never waits for the device).

        Returns:
            input_ids (B, length) long, and predict (B, T) long: the column whose output
            predicts response token t (p_i - 1 + t; clamped into [0, length) on padding,
            where it means nothing).
        """
        p = self.prompt_len
        seq = torch.cat([self.prompt_ids, self.response_ids], dim=1)                 # (B, P+T)
        start = p - self.prompt_mask.sum(dim=1, keepdim=True)                        # (B, 1) = P - p_i
        cols = torch.arange(length, device=seq.device)
        index = (start + cols).clamp(max=seq.shape[1] - 1)                           # (B, length)
        input_ids = seq.gather(1, index)                                             # (B, length)
        t = self.response_ids.shape[1]
        predict = (p - 1 - start) + torch.arange(t, device=seq.device)               # (B, T) = p_i - 1 + t
        return input_ids, predict.clamp(0, length - 1)

    # ------------------------------------------------------------------ reshaping
    def select(self, index: Tensor | Sequence[int]) -> "RolloutBatch":
        """Rows `index` (in that order)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        rows = idx.tolist()
        return replace(
            self,
            prompt_ids=self.prompt_ids[idx], prompt_mask=self.prompt_mask[idx],
            response_ids=self.response_ids[idx], response_mask=self.response_mask[idx],
            gen_logprobs=self.gen_logprobs[idx],
            prompts=[self.prompts[i] for i in rows] if self.prompts else [],
            responses=[self.responses[i] for i in rows] if self.responses else [],
            finish_reasons=[self.finish_reasons[i] for i in rows] if self.finish_reasons else [],
            groups=None if self.groups is None else self.groups[idx],
            token_versions=None if self.token_versions is None else self.token_versions[idx],
            env_mask=None if self.env_mask is None else self.env_mask[idx],
            env_rewards=None if self.env_rewards is None else self.env_rewards[idx],
            ended=None if self.ended is None else self.ended[idx],
        )

    def to(self, device: torch.device | str) -> "RolloutBatch":
        """The batch with its tensors on `device` (lists and ints unchanged)."""
        return replace(
            self,
            prompt_ids=self.prompt_ids.to(device), prompt_mask=self.prompt_mask.to(device),
            response_ids=self.response_ids.to(device), response_mask=self.response_mask.to(device),
            gen_logprobs=self.gen_logprobs.to(device),
            groups=None if self.groups is None else self.groups.to(device),
            token_versions=None if self.token_versions is None else self.token_versions.to(device),
            env_mask=None if self.env_mask is None else self.env_mask.to(device),
            env_rewards=None if self.env_rewards is None else self.env_rewards.to(device),
            ended=None if self.ended is None else self.ended.to(device),
        )

    def trimmed(self, p_keep: Optional[int] = None, t_keep: Optional[int] = None) -> "RolloutBatch":
        """Prompt columns from `p_keep` on, response columns [0, `t_keep`) (see the module
        docstring). Without widths, this batch's own (TrimPlan.widths over all its rows,
        which reads the masks to the host): a micro-batch pays only for its longest row."""
        if p_keep is None or t_keep is None:
            p_keep, t_keep = TrimPlan.of(self).widths(range(len(self)))
        return replace(
            self,
            prompt_ids=self.prompt_ids[:, p_keep:], prompt_mask=self.prompt_mask[:, p_keep:],
            response_ids=self.response_ids[:, :t_keep], response_mask=self.response_mask[:, :t_keep],
            gen_logprobs=self.gen_logprobs[:, :t_keep],
            token_versions=None if self.token_versions is None else self.token_versions[:, :t_keep],
            env_mask=None if self.env_mask is None else self.env_mask[:, :t_keep],
        )

    @staticmethod
    def cat(parts: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """Concatenate rows of several batches (e.g. one per generator replica), re-padding
        prompts on the left and responses on the right to common widths."""
        if not parts:
            raise ValueError("RolloutBatch.cat needs at least one batch")
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        versions = {b.adapter_version for b in parts}
        if len(versions) != 1:
            raise ValueError(f"cannot concatenate rollouts from different adapter versions {sorted(versions)}")
        has_groups = {b.groups is not None for b in parts}
        if len(has_groups) != 1:
            raise ValueError("cannot concatenate rollouts with group ids and rollouts without")
        if len({b.env_rewards is not None for b in parts}) != 1:
            raise ValueError("cannot concatenate episodes and single-turn rollouts")
        p = max(b.prompt_len for b in parts)
        t = max(b.response_ids.shape[1] for b in parts)
        pad = first.pad_token_id

        def left(x: Tensor, width: int, value) -> Tensor:
            return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

        def right(x: Tensor, width: int, value) -> Tensor:
            return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

        return replace(
            first,
            prompt_ids=torch.cat([left(b.prompt_ids, p, pad) for b in parts]),
            prompt_mask=torch.cat([left(b.prompt_mask, p, False) for b in parts]),
            response_ids=torch.cat([right(b.response_ids, t, pad) for b in parts]),
            response_mask=torch.cat([right(b.response_mask, t, False) for b in parts]),
            gen_logprobs=torch.cat([right(b.gen_logprobs, t, 0.0) for b in parts]),
            prompts=[s for b in parts for s in b.prompts],
            responses=[s for b in parts for s in b.responses],
            finish_reasons=[s for b in parts for s in b.finish_reasons],
            groups=torch.cat([b.groups for b in parts]) if first.groups is not None else None,
            token_versions=(torch.cat([right(b.versions_of_tokens(), t, 0) for b in parts])
                            if any(b.token_versions is not None for b in parts) else None),
            env_mask=(torch.cat([right(b.env_tokens, t, False) for b in parts])
                      if any(b.env_mask is not None for b in parts) else None),
            env_rewards=torch.cat([b.env_rewards for b in parts]) if first.env_rewards is not None else None,
            ended=torch.cat([b.ended for b in parts]) if first.ended is not None else None,
        )


@dataclass(frozen=True)
class Packing:
    """Each row's `mask` tokens moved, in order, to the row's left edge: a per-token
    recursion over a multi-turn transcript's model tokens (GAE's, the discounted returns')
    runs over them as one contiguous response, so an environment turn between two model
    turns is part of the transition (the next state's value is the next MODEL token's), not
    an end of the episode. For a mask that is already a prefix (single-turn rows) packing is
    the identity on the mask's tokens.

        packing = Packing.of(loss_mask)            # (B, T) bool
        a = packing.unpack(gae(packing.pack(r), packing.pack(v), packing.mask, ...))
    """

    order: Tensor  # (B, T) long: the column of the row that packed column j takes (mask's first)
    mask: Tensor   # (B, W) bool: the packed mask, W = the most mask tokens of a row (>= 1)

    @staticmethod
    def of(mask: Tensor) -> "Packing":
        mask = check_mask(mask)
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # (B, T) mask's columns first, in order
        width = max(int(mask.sum(dim=1).amax()) if mask.numel() else 0, 1)
        counts = mask.sum(dim=1, keepdim=True)
        return Packing(order=order, mask=torch.arange(width, device=mask.device)[None, :] < counts)

    def pack(self, x: Tensor) -> Tensor:
        """(B, T) -> (B, W): the mask's tokens of each row, in order; 0 past them."""
        packed = x.gather(1, self.order[:, :self.mask.shape[1]])
        return torch.where(self.mask, packed, torch.zeros((), dtype=x.dtype, device=x.device))

    def unpack(self, y: Tensor) -> Tensor:
        """(B, W) -> (B, T): each packed value back in its column; 0 off the mask."""
        b, width = self.mask.shape
        out = torch.zeros((b, self.order.shape[1]), dtype=y.dtype, device=y.device)
        zero = torch.zeros((), dtype=y.dtype, device=y.device)
        return out.scatter(1, self.order[:, :width], torch.where(self.mask, y, zero))


@dataclass(frozen=True)
class RowPick:
    """Rows of several rounds' batches, named by index: dynamic sampling's choice, which the
    driver sends to the actors that take the batch (the reference, the learners) in place of
    the batch itself, so the rollouts never pass through the driver. The parts a call receives
    are the rounds' replica batches in order: the first `parts[0]` are round 0's, and so on.

        batch = pick.apply(parts)   # RolloutBatch.cat of each round's rows `rows[r]`, in order
    """

    parts: tuple[int, ...]              # per round, how many of the parts are its (replica batches)
    rows: tuple[tuple[int, ...], ...]   # per round, the rows picked (of the round's batch), in order

    def __post_init__(self) -> None:
        if len(self.parts) != len(self.rows) or not self.rows or not all(self.rows) or min(self.parts) < 1:
            raise ValueError(f"RowPick: {len(self.parts)} rounds of parts {list(self.parts)} and "
                             f"{len(self.rows)} of rows, each round needs parts and rows")

    def __len__(self) -> int:
        return sum(len(r) for r in self.rows)

    def apply(self, parts: Sequence[RolloutBatch]) -> RolloutBatch:
        """The picked rows: each round's batch (its parts concatenated) restricted to its rows,
        the rounds concatenated in order."""
        if len(parts) != sum(self.parts):
            raise ValueError(f"RowPick over {sum(self.parts)} parts ({list(self.parts)} per round) got {len(parts)}")
        out, start = [], 0
        for n, rows in zip(self.parts, self.rows):
            out.append(RolloutBatch.cat(parts[start:start + n]).select(list(rows)))
            start += n
        return RolloutBatch.cat(out)


def gather(parts: Sequence[RolloutBatch], pick: Optional[RowPick] = None) -> RolloutBatch:
    """The batch a call's parts make: all their rows (RolloutBatch.cat), or `pick`'s."""
    return RolloutBatch.cat(parts) if pick is None else pick.apply(parts)


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
        """(first prompt column kept, response columns kept) for these rows: the first
        column any of them has a real prompt token in (P if none), and their last real
        response column + 1 (at least one response column)."""
        p_keep = min((self.prompt_start[i] for i in rows), default=self.prompt_len)
        t_keep = max(1, max((self.response_end[i] for i in rows), default=0))
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


def split_rows(index: Tensor, size: int) -> list[Tensor]:
    """Consecutive chunks of `size` rows of a 1-D index tensor (the last may be shorter)."""
    return list(torch.split(index, size))


def rollout_micro_batches(batch: RolloutBatch, size: int, plan: TrimPlan | None = None,
                          sort: bool = False) -> Iterator[tuple[list[int], RolloutBatch]]:
    """(rows, trimmed micro-batch) over rows 0..B-1, `size` rows at a time: a no-grad
    scoring pass (the reference and reward scorers, the learner's pass before the PPO
    epochs). In row order, or longest first (`sort`, TrimPlan.by_length); the caller
    writes results back by `rows`."""
    plan = plan or TrimPlan.of(batch)
    order = plan.by_length(range(len(batch))) if sort else list(range(len(batch)))
    for chunk in split_rows(torch.tensor(order, dtype=torch.long), size):
        rows = chunk.tolist()
        yield rows, batch.select(rows).trimmed(*plan.widths(rows))
