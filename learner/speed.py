"""The learner's speed path: how per-token stats are computed, not which.

`head_token_stats` (the lm_head and the logprob math on hidden rows, compiled under
learner_compile) and `chunked_rows` (a memory utility: a function over row-aligned inputs
evaluated a chunk of rows at a time, each chunk an activation checkpoint). The learner's
speed options (ppo_ray.config's "learner speed" block) choose between these and the plain
path; tests/test_learner_speed.py holds them to it within float rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.utils.checkpoint
from torch import Tensor

from ppo_ray.logprobs import token_stats_from_logits


def chunked_rows(fn, chunk_size: int, *inputs: Tensor) -> tuple[Tensor, ...]:
    """``fn(*inputs)`` computed ``chunk_size`` rows (dim 0) at a time, outputs concatenated.

    ``fn`` maps row-aligned inputs ``(n, ...)`` to a tuple of row-aligned outputs ``(n,
    ...)`` and must treat rows independently (e.g. hidden states -> lm_head -> per-token
    log-probs), so the result equals ``fn(*inputs)`` up to float rounding. With autograd
    on, each chunk is an activation checkpoint (``torch.utils.checkpoint``, non-reentrant):
    its intermediates (the ``(chunk, V)`` logits and their float32 copies) are freed after
    the forward and recomputed in the backward, so at most one chunk's exist at a time
    (Liger-Kernel's fused linear cross-entropy and verl's chunked entropy chunk the same
    way). ``chunk_size <= 0`` = one chunk, no checkpoint.
    """
    n = inputs[0].shape[0]
    if chunk_size <= 0 or n == 0:
        out = fn(*inputs)
        return out if isinstance(out, tuple) else (out,)
    parts = []
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
    for start in range(0, n, chunk_size):
        piece = [x[start: start + chunk_size] for x in inputs]
        if grad:
            out = torch.utils.checkpoint.checkpoint(fn, *piece, use_reentrant=False)
        else:
            out = fn(*piece)
        parts.append(out if isinstance(out, tuple) else (out,))
    return tuple(torch.cat(column) for column in zip(*parts))


def head_token_stats(h: Tensor, weight: Optional[Tensor], tokens: Tensor, temperature: float, top_k: Optional[int],
                     top_p: Optional[float], truncated: bool, full: bool, entropy: bool) -> tuple[Tensor, ...]:
    """The policy's per-token stats on (n, H) hidden rows: logits = h @ weight^T (the lm_head;
    `weight` None = `h` already holds the (n, V) logits), then those asked for, in this order:
    truncated + tempered logprobs of `tokens` (the sampling distribution), full-softmax
    logprobs at temperature, entropy at temperature; each float32 (n,).

    Module-level, with tensors and constants for arguments (no module), so that under
    learner_compile one compiled graph per stats set serves every chunk width and every
    learner of the process: the float32 copy, the temperature division, the log-sum-exp and
    the softmax fuse into a few passes over the (n, V) logits instead of one per op."""
    logits = h if weight is None else torch.nn.functional.linear(h, weight)  # (n, V) in the model's dtype
    return token_stats_from_logits(logits, tokens, temperature, top_k, top_p, truncated=truncated, full=full,
                                   entropy=entropy)
