"""The learner's speed path: how per-token stats are computed, not which.

`SpeedPath` applies the config's learner speed options (ppo_ray.config's "learner speed"
block) to the learner's models and computes a micro-batch's per-token stats the way they
say: the no-grad pass's (`rollout_stats`) and the training forward's (`train_stats`). The
learner asks for those and does not know which path or kernels ran. Its pieces:
`head_token_stats` (the lm_head and the logprob math on hidden rows, compiled under
learner_compile) and `chunked_rows` (a memory utility: a function over row-aligned inputs
evaluated a chunk of rows at a time, each chunk an activation checkpoint).
tests/test_learner_speed.py holds every path to the plain one within float rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.utils.checkpoint
from torch import Tensor

from ppo_ray.batch import RolloutBatch, TrimPlan
from ppo_ray.logprobs import entropy_from_logits, logprobs_from_logits, token_stats_from_logits
from ppo_ray.modeling import causal_response_hidden, response_hidden, response_logits


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


class SpeedPath:
    """The learner's speed options (ppo_ray.config's "learner speed" block: learner_layout,
    learner_sort_by_length, logprob_chunk_size, lora_kernel, rms_norm_kernel,
    gradient_checkpointing, learner_compile, learner_compile_scope) applied to its models,
    and the per-token stats of a micro-batch computed the way they say. The learner asks for
    "the stats of this micro-batch" (rollout_stats in the no-grad pass, train_stats in the
    PPO epochs) and does not know which path or kernels ran; the plain path (all options at
    their defaults: logits from the CausalLM's own forward) is one of them.
    tests/test_learner_speed.py holds every path to the plain one within float rounding."""

    def __init__(self, config, policy: torch.nn.Module, value_model: Optional[torch.nn.Module], shared: bool):
        self.config, self.policy, self.value_model, self.shared = config, policy, value_model, shared
        self._compiled: Optional[str] = None
        self.configure()

    def configure(self, config=None) -> None:
        """Apply the config's speed options (`config`: a changed one, from then on). With all
        of them at their defaults nothing changes: the policy's logits come from its own
        forward (response_logits). Called again after a config change (Learner.reconfigure:
        benchmarks switch options on one learner); compiling is for good."""
        if config is not None:
            self.config = config
        from learner.kernels import fuse_lora_linears, fuse_rms_norms

        cfg = self.config
        policy_base = self.policy.get_base_model()  # the CausalLM, LoRA layers inside
        # the value model's decoder (e.g. Qwen3Model); none with a shared trunk
        value_base = self.value_model.backbone.get_base_model() if self.value_model is not None and not self.shared else None
        self.decoder = policy_base.get_decoder()
        self.lm_head = policy_base.get_output_embeddings()
        self.causal = cfg.learner_layout == "causal"
        # the plain path: logits from the CausalLM's forward, all positions at once (a shared
        # trunk needs the hidden states themselves: the decoder path)
        self.plain_logits = not self.causal and cfg.logprob_chunk_size == 0 and not self.shared
        for model in [m for m in (self.policy, self.value_model) if m is not None]:
            fuse_lora_linears(model, cfg.lora_kernel)
            fuse_rms_norms(model, cfg.rms_norm_kernel == "fused")
        bases = [policy_base] if value_base is None else [policy_base, value_base]
        for model in bases:
            if cfg.gradient_checkpointing:
                # non-reentrant: the frozen embeddings' outputs need no requires_grad hook (PEFT)
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            elif model.is_gradient_checkpointing:
                model.gradient_checkpointing_disable()
        if cfg.learner_compile:
            compiled = self._compiled
            if compiled is None:
                for decoder in [base.get_decoder() for base in bases]:
                    if cfg.learner_compile_scope == "decoder":
                        # One graph per model's forward (and one for its backward): one guard check
                        # and one wrapper call per micro-batch instead of one per layer.
                        decoder.compile(dynamic=True)
                    else:
                        # Per decoder layer: one graph serves all layers of both models (same code
                        # and shapes), dynamic in the sequence length so new widths do not recompile.
                        for layer in decoder.layers:
                            layer.compile(dynamic=True)
                self._compiled = cfg.learner_compile_scope
            elif compiled != cfg.learner_compile_scope:
                raise ValueError(f"learner_compile_scope: this learner's models are compiled per {compiled}; "
                                 f"it cannot change to {cfg.learner_compile_scope!r} (build a new Learner)")
        # lm_head + the per-token logprob math (learner_compile: one fused graph per stats set
        # instead of a float32 pass per op over each chunk's (c, V) logits; 1.10x on the GPU)
        self.head_stats = head_token_stats
        if cfg.learner_compile:
            self.head_stats = torch.compile(head_token_stats, dynamic=True)
        self.token_counts = [0, 0]  # (positions computed, real tokens) of the current update

    def count(self, plan: TrimPlan, rows: list[int]) -> None:
        done, real = plan.cost(rows, self.causal)
        self.token_counts[0] += done
        self.token_counts[1] += real

    def policy_hidden(self, micro: RolloutBatch, seq_len: int) -> Tensor:
        """(b, t, H) the policy's last hidden states that predict micro's response tokens."""
        if self.causal:
            return causal_response_hidden(self.decoder, micro, seq_len)
        return response_hidden(self.decoder, micro)

    def values(self, micro: RolloutBatch, seq_len: int) -> Tensor:
        """(b, t) float32 V(s_t) of micro's response positions (garbage on padding), from the
        value model's own backbone (value_model: separate)."""
        return self.value_model(micro, causal_len=seq_len if self.causal else None)

    def policy_token_stats(self, micro: RolloutBatch, seq_len: int, n_response: int, *, truncated: bool = False,
                            full: bool = False, entropy: bool = False, values: bool = False) -> list[Tensor]:
        """Per-token (b, t) float32 stats of the policy at micro's response tokens, 0 on
        padding, in this order (those asked for): truncated + tempered logprobs (the
        sampling distribution), full-softmax logprobs at temperature, entropy at temperature,
        and (value_model: shared) the values V(s_t) from the value head on the same hidden
        states: one trunk forward for both.

        The path the speed options take: hidden states from the decoder (either layout),
        then lm_head and the logprob math on the real response positions only (the rows'
        extents, `n_response` of them, a host count: no sync), `logprob_chunk_size` of them
        at a time (learner.speed.chunked_rows). Equal to the plain path's values up to float
        rounding (tests/test_learner_speed.py)."""
        cfg = self.config
        hidden = self.policy_hidden(micro, seq_len)  # (b, t, H)
        b, t, _ = hidden.shape
        mask = micro.response_mask  # (b, t)
        cols = torch.arange(t, device=mask.device)
        ends = torch.where(mask, cols + 1, torch.zeros((), dtype=cols.dtype, device=mask.device)).amax(dim=1)  # (b,)
        extent = cols[None, :] < ends[:, None]  # (b, t) each row up to its last real token
        index = torch.nonzero_static(extent.reshape(-1), size=n_response).squeeze(-1)  # (n,) no sync
        h = hidden.reshape(b * t, -1).index_select(0, index)  # (n, H)
        tokens = micro.response_ids.reshape(-1).index_select(0, index)  # (n,)
        lm_head, head_stats = self.lm_head, self.head_stats
        what = (cfg.temperature, cfg.top_k, cfg.top_p, truncated, full, entropy)

        def per_token(h: Tensor, tokens: Tensor) -> tuple[Tensor, ...]:
            if head_stats is not head_token_stats and type(lm_head) is torch.nn.Linear and lm_head.bias is None:
                return head_stats(h, lm_head.weight, tokens, *what)  # compiled, the lm_head's GEMM inside
            return head_token_stats(lm_head(h), None, tokens, *what)  # eager (or e.g. a LoRA-adapted lm_head)

        zero = torch.zeros((), device=mask.device)
        out = []
        if truncated or full or entropy:
            out = [torch.where(mask, torch.zeros(b * t, device=mask.device).index_put((index,), v).view(b, t), zero)
                   for v in chunked_rows(per_token, cfg.logprob_chunk_size, h, tokens)]
        if values:
            out.append(torch.where(mask, self.value_model(hidden), zero))  # (b, t) float32
        return out

    def rollout_stats(self, micro: RolloutBatch, seq_len: int, n_response: int, *, logprobs: bool = False,
                      full: bool = False, entropy: bool = False, values: bool = False) -> dict[str, Tensor]:
        """The no-grad pass's (b, t) float32 stats of micro's response tokens, 0 on padding, by
        name (those asked for): "logprobs" (truncated + tempered: the sampling distribution),
        "full_logprobs" (full softmax at temperature), "entropy", and "values" V(s_t) from
        the critic (a shared trunk's head on the same forward, or the value model's own)."""
        cfg = self.config
        mask = micro.response_mask
        out: dict[str, Tensor] = {}
        shared_values = values and self.shared  # from the same trunk forward as the logprobs
        if (logprobs or full or entropy or shared_values) and not self.plain_logits:
            stats = iter(self.policy_token_stats(micro, seq_len, n_response, truncated=logprobs, full=full,
                                                 entropy=entropy, values=shared_values))
            for name, wanted in (("logprobs", logprobs), ("full_logprobs", full), ("entropy", entropy),
                                 ("values", shared_values)):
                if wanted:
                    out[name] = next(stats)
        elif logprobs or full or entropy:
            logits = response_logits(self.policy, micro)  # (b, t, V)
            if logprobs:
                out["logprobs"] = logprobs_from_logits(logits, micro.response_ids, cfg.temperature, cfg.top_k,
                                                       cfg.top_p, mask=mask)
            if full:
                out["full_logprobs"] = logprobs_from_logits(logits, micro.response_ids, cfg.temperature, mask=mask)
            if entropy:
                out["entropy"] = entropy_from_logits(logits, mask, cfg.temperature)
            del logits
        if values and not self.shared:
            v = self.values(micro, seq_len)  # (b, t)
            out["values"] = torch.where(mask, v, torch.zeros((), device=v.device))
        return out

    def train_stats(self, micro: RolloutBatch, seq_len: int, n_response: int, policy_mask: Tensor, mask: Tensor,
                    entropy: bool) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """The training forward's (b, t) float32 stats (with grad): the truncated + tempered
        logprobs of the sampled tokens (0 outside policy_mask), the entropy (entropy: else
        None), and with a shared trunk the values from the same forward (else None)."""
        cfg = self.config
        if self.plain_logits:
            logits = response_logits(self.policy, micro)  # (b, t, V), train mode
            logp = logprobs_from_logits(logits, micro.response_ids, cfg.temperature, cfg.top_k, cfg.top_p,
                                        mask=policy_mask)  # (b, t) float32
            ent = entropy_from_logits(logits, mask, cfg.temperature) if entropy else None  # (b, t)
            del logits
            return logp, ent, None
        stats = self.policy_token_stats(micro, seq_len, n_response, truncated=True, entropy=entropy,
                                        values=self.shared)
        logp = torch.where(policy_mask, stats[0], torch.zeros((), device=stats[0].device))  # (b, t)
        return logp, (stats[1] if entropy else None), (stats[-1] if self.shared else None)
