"""RolloutBatch: the typed tensors that pass between actors (through the Ray object store).

Layout (the one every role uses; OpenRLHF's `Experience` and the N+ TL;DR code use the same):

    prompt_ids    (B, P)  left-padded with pad_token_id      [pad pad p0 p1 p2]
    response_ids  (B, T)  right-padded with pad_token_id     [r0 r1 EOS pad pad]
    sequence      (B, P+T) = cat(prompt_ids, response_ids)

so every prompt ends at column P-1 and every response starts at column P, and the logits
that predict response token t sit at sequence column P-1+t. Masks are bool, True on real
tokens; a response is real up to and including its first EOS (pad is never EOS).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch
from torch import Tensor


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

    def __post_init__(self) -> None:
        b, p = self.prompt_ids.shape
        bt = self.response_ids.shape
        if self.prompt_mask.shape != (b, p) or bt[0] != b or self.response_mask.shape != bt \
                or self.gen_logprobs.shape != bt:
            raise ValueError(
                f"RolloutBatch shapes disagree: prompt_ids {tuple(self.prompt_ids.shape)}, prompt_mask "
                f"{tuple(self.prompt_mask.shape)}, response_ids {tuple(bt)}, response_mask "
                f"{tuple(self.response_mask.shape)}, gen_logprobs {tuple(self.gen_logprobs.shape)}")
        if self.pad_token_id == self.eos_token_id:
            raise ValueError("pad_token_id equals eos_token_id: pad must be a distinct token")

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[1]

    @property
    def response_lengths(self) -> Tensor:
        return self.response_mask.sum(dim=1)  # (B,)

    @property
    def has_eos(self) -> Tensor:
        """(B,) bool: the response ended with EOS (not cut at max_new_tokens)."""
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
        )

    def trimmed(self) -> "RolloutBatch":
        """Drop prompt columns that are padding in every row (left) and response columns
        that are padding in every row (right): a micro-batch pays only for its longest row."""
        p_keep = int(self.prompt_mask.any(dim=0).nonzero().min()) if self.prompt_mask.any() else self.prompt_len
        t_keep = int(self.response_mask.any(dim=0).nonzero().max()) + 1 if self.response_mask.any() else 1
        return replace(
            self,
            prompt_ids=self.prompt_ids[:, p_keep:], prompt_mask=self.prompt_mask[:, p_keep:],
            response_ids=self.response_ids[:, :t_keep], response_mask=self.response_mask[:, :t_keep],
            gen_logprobs=self.gen_logprobs[:, :t_keep],
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
        )

    # ------------------------------------------------------------------ inspection
    def to_sa_pairs(self, tokenizer=None, **per_token: Tensor) -> list[dict]:
        """The seeds' per-token (state, action) view, for inspection and export only.

        One dict per real response token: prompt index, t, the state (prompt ids + the
        response so far), the action (token id, and its text if a tokenizer is given),
        the generator's logprob, and any extra (B, T) tensors passed by name (e.g.
        ref_logprobs=..., kl=..., values=..., advantages=..., returns=...).
        """
        pairs = []
        for i in range(len(self)):
            prompt = self.prompt_ids[i][self.prompt_mask[i]].tolist()
            resp = self.response_ids[i][self.response_mask[i]].tolist()
            for t, action in enumerate(resp):
                pair = {
                    "prompt_index": i, "t": t, "state": prompt + resp[:t], "action": action,
                    "logprob": float(self.gen_logprobs[i, t]),
                }
                if tokenizer is not None:
                    pair["action_text"] = tokenizer.decode([action])
                for name, x in per_token.items():
                    pair[name] = float(x[i, t])
                pairs.append(pair)
        return pairs
