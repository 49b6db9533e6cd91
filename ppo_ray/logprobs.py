"""Token log-probs and entropy under the distribution the generator samples from.

Shared by the reference scorer (actors/reference.py), the learner (learner/learner.py)
and the SFT stage (learner/stages.py), so it sits in the bottom layer; the PPO math that
uses its outputs stays in learner/algos.py. Pure tensor functions, with the conventions of
learner/algos.py: shapes ``(B, T)`` / ``(B, T, V)``, bool masks (True = real token),
garbage at masked positions never reaches an output or a gradient.

Reference: [vLLM] ``vllm/v1/sample/sampler.py`` and
``vllm/v1/sample/ops/topk_topp_sampler.py`` (vLLM 0.32), which :func:`logprobs_from_logits`
mirrors op for op. The temperature floor is ppo_ray.config.MIN_TEMPERATURE (one home: the
config, the generator and this module read it).
"""

from __future__ import annotations

import torch

from ppo_ray.batch import check_mask
from ppo_ray.config import MIN_TEMPERATURE

Tensor = torch.Tensor


def _float_scaled_logits(
    logits: Tensor, temperature: float, mask: Tensor | None
) -> tuple[Tensor, bool]:
    """float32 ``logits / temperature``, rows at masked positions replaced by 0.

    Makes at most one (B, T, V) copy: ``.float()`` of bf16 input is the copy and the
    rest happens in place on it; float32 input is copied once by the first op that needs
    to change it. Returns ``(x, owned)``; ``owned`` = x is such a private copy (safe to
    modify in place), False when x is the caller's ``logits`` itself.
    """
    if temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature must be >= {MIN_TEMPERATURE} (got {temperature}): vLLM treats "
            "temperature < 1e-5 as greedy and clamps (0, 1e-2) up to 1e-2, neither of "
            "which is a sampling distribution to take log-probs under"
        )
    x = logits.float()  # vLLM: logits.to(torch.float32) before any processing
    owned = x is not logits
    if temperature != 1.0:
        # vLLM Sampler.apply_temperature divides by a float32 *tensor* (true division).
        # Divide by a float32 device tensor too: a Python scalar divisor may be turned
        # into multiplication by its reciprocal (CUDA), which rounds differently.
        temp = torch.full((1,), temperature, dtype=torch.float32, device=x.device)
        x = x.div_(temp) if owned else x / temp
        owned = True
    if mask is not None:
        # Padding rows may hold NaN/inf logits; a uniform row keeps log_softmax and its
        # backward finite there (their gradient is then exactly 0, not 0 * NaN).
        keep_row = check_mask(mask).unsqueeze(-1)
        if owned:
            x = x.masked_fill_(~keep_row, 0.0)
        else:
            x = torch.where(keep_row, x, torch.zeros((), dtype=x.dtype, device=x.device))
            owned = True
    return x, owned


def _vllm_top_k_top_p_keep(x: Tensor, top_k: int | None, top_p: float | None) -> Tensor:
    """Which vocab entries survive vLLM's top-k/top-p truncation (bool, shape of ``x``).

    Mirrors ``apply_top_k_top_p_pytorch`` / ``apply_top_k_only`` from
    ``vllm/v1/sample/ops/topk_topp_sampler.py`` (vLLM 0.32) op for op on rows of
    ``x`` (float32, already temperature-scaled); see :func:`logprobs_from_logits`.
    """
    V = x.size(-1)
    rows = x.reshape(-1, V)
    if top_p is None:
        # apply_top_k_only (the path vLLM takes for top-k without top-p on CPU; the sort
        # path below computes the same threshold): mask logits strictly below the k-th
        # largest logit, so every token tied with the k-th largest is kept (>= k kept).
        kth = rows.topk(top_k, dim=-1).values[:, top_k - 1 :]
        keep = ~(rows < kth)
        return keep.reshape(x.shape)

    logits_sort, logits_idx = rows.sort(dim=-1, descending=False)
    keep_sort = torch.ones_like(logits_sort, dtype=torch.bool)
    if top_k is not None:
        # Ascending sort: the k-th largest logit is at index V - k; drop strictly smaller.
        kth = logits_sort[:, V - top_k : V - top_k + 1]
        below = logits_sort < kth
        logits_sort.masked_fill_(below, float("-inf"))
        keep_sort &= ~below
    # Top-p over the temperature-scaled, top-k-truncated distribution (renormalised by
    # this softmax). Ascending cumulative mass; drop a token when the mass at or below
    # it is <= 1 - p, i.e. keep the smallest top set whose mass reaches p. vLLM's p is a
    # float32 tensor, so 1 - p is computed in float32 here too.
    probs_sum = logits_sort.softmax(dim=-1)
    probs_sum = torch.cumsum(probs_sum, dim=-1, out=probs_sum)
    one_minus_p = 1 - torch.full((1, 1), top_p, dtype=torch.float32, device=x.device)
    top_p_drop = probs_sum <= one_minus_p
    top_p_drop[:, -1] = False  # vLLM: "at least one" -- the largest logit always stays
    keep_sort &= ~top_p_drop
    # Back to vocab order (vLLM scatters the masked sorted logits back with logits_idx).
    keep = torch.empty_like(keep_sort).scatter_(-1, logits_idx, keep_sort)
    return keep.reshape(x.shape)


def logprobs_from_logits(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Log-probs of ``tokens`` under the sampling distribution vLLM samples from.

    ``log softmax(truncate(logits / temperature))[tokens]`` in float32, equal (up to
    float rounding of the final log-softmax, ~1e-6) to what vLLM returns with
    ``logprobs_mode="processed_logprobs"`` for the same logits and sampling params.

    Mirrors vLLM 0.32: ``Sampler.forward`` / ``Sampler.sample`` /
    ``Sampler.apply_temperature`` (``vllm/v1/sample/sampler.py``): logits to float32,
    divide by temperature; then ``TopKTopPSampler.forward_native`` / ``forward_cpu`` ->
    ``apply_top_k_top_p`` -> ``apply_top_k_top_p_pytorch`` / ``apply_top_k_only``
    (``vllm/v1/sample/ops/topk_topp_sampler.py``): top-k, then top-p over the
    top-k-truncated, temperature-scaled distribution; dropped tokens get -inf logits;
    then ``log_softmax(dim=-1, dtype=float32)`` renormalises over the kept tokens.
    Semantics copied:

    * top-k keeps every token whose logit is >= the k-th largest logit (ties with the
      k-th are all kept, so possibly more than k). ``top_k`` in ``{None, 0, -1}`` or
      ``>= V`` disables it (vLLM ``InputBatch.add_request``).
    * top-p sorts ascending, cumsums the softmax, drops tokens with cumulative mass
      ``<= 1 - p`` (float32), and always keeps the largest-logit token (vLLM's "at
      least one"). ``top_p`` of None or 1.0 disables it.

    Known divergence: on CUDA builds with Triton, vLLM uses
    ``apply_top_k_top_p_triton`` (``ops/topk_topp_triton.py``), which keeps *exactly* k
    tokens on ties at the k-th logit (lowest vocab index first), picks the top-p cut by
    a pivot search, and rounds differently; it can disagree with this reference only for
    tokens exactly at the truncation boundary. A sampled token dropped by our mask gets
    logprob -inf.

    Not mirrored (must be off in the rollout engine): min_p, penalties, logit bias,
    bad words, allowed-token lists, custom logits processors; greedy sampling
    (temperature < 1e-2 raises ValueError).

    Args:
        logits: float ``(B, T, V)`` (bf16/fp16/fp32); position ``t`` predicts
            ``tokens[:, t]`` (the caller has already shifted by one).
        tokens: long ``(B, T)``.
        temperature: sampling temperature (> 0).
        top_k, top_p: vLLM's sampling params.
        mask: optional bool ``(B, T)``, True = real token; if given, logits and tokens at
            masked positions are ignored (may be garbage/out of range) and the output
            there is 0 with zero gradient.

    Returns:
        float32 ``(B, T)``.

    Memory: without truncation, one float32 copy of the logits at most (only for
    non-fp32 input or temperature != 1) plus the log-sum-exp workspace -- log-probs come
    from ``gather - logsumexp``, the full log-softmax is never materialised. With top-p,
    the sort needs (B, T, V) values + indices, as in vLLM.
    """
    V = logits.size(-1)
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1
    ):
        raise ValueError(f"top_k must be an int: 0 or -1 (off) or >= 1, got {top_k!r}")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    use_k = top_k is not None and 0 < top_k < V
    use_p = top_p is not None and top_p < 1.0

    x, owned = _float_scaled_logits(logits, temperature, mask)
    tokens = tokens.long()
    if mask is not None:
        tokens = torch.where(mask, tokens, torch.zeros_like(tokens))  # pads may be >= V
    if use_k or use_p:
        with torch.no_grad():
            keep = _vllm_top_k_top_p_keep(
                x.detach(), top_k if use_k else None, top_p if use_p else None
            )
        # Dropped tokens -> -inf, exactly like vLLM's masked logits; the log-sum-exp
        # below then renormalises over the kept tokens. Gradient flows to kept logits.
        x = x.masked_fill_(~keep, float("-inf")) if owned else x.masked_fill(~keep, float("-inf"))
    token_logits = x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    logp = token_logits - torch.logsumexp(x, dim=-1)
    if mask is not None:
        logp = torch.where(mask, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    return logp


def entropy_from_logits(logits: Tensor, mask: Tensor, temperature: float = 1.0) -> Tensor:
    """Per-token entropy of ``softmax(logits / temperature)`` (no top-k/top-p).

    ``H = logsumexp(x) - sum_v softmax(x)_v * x_v``, computed in float32. The caller
    reduces it, e.g. ``masked_mean(entropy, mask)``.

    Args:
        logits: float ``(B, T, V)``.
        mask: bool ``(B, T)``, True = real token; masked rows may hold garbage.

    Returns:
        float32 ``(B, T)``, 0 at masked positions (with zero gradient there).
    """
    x, _ = _float_scaled_logits(logits, temperature, mask)
    probs = torch.softmax(x, dim=-1)
    # einsum contracts V without materialising probs * x.
    entropy = torch.logsumexp(x, dim=-1) - torch.einsum("...v,...v->...", probs, x)
    return torch.where(mask, entropy, torch.zeros((), dtype=entropy.dtype, device=entropy.device))


def token_stats_from_logits(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    *,
    truncated: bool = False,
    full: bool = False,
    entropy: bool = False,
) -> tuple[Tensor, ...]:
    """Those asked for, in this order: :func:`logprobs_from_logits` with ``top_k`` /
    ``top_p`` (the sampling distribution), the same without truncation (the full softmax at
    temperature), :func:`entropy_from_logits`; each float32, of ``logits``' leading shape.
    No mask: every position is real (the learner passes only real response positions).

    Equal to calling those functions one by one (the same ops on the same float32 values:
    bit for bit in the forward), with the work they share done once: one float32 copy of
    ``logits / temperature``, one log-sum-exp for the full logprobs and the entropy, and the
    truncated logprobs taken from the full ones when top-k / top-p are off (they are the
    same distribution then). Separate calls pass over the ``(..., V)`` logits about three
    times as often.
    """
    V = logits.size(-1)
    cut = (top_k is not None and 0 < top_k < V) or (top_p is not None and top_p < 1.0)
    out: list[Tensor] = []
    if truncated and cut:
        out.append(logprobs_from_logits(logits, tokens, temperature, top_k, top_p))
    if not (full or entropy or (truncated and not cut)):
        return tuple(out)
    x, _ = _float_scaled_logits(logits, temperature, None)
    lse = torch.logsumexp(x, dim=-1)
    if full or (truncated and not cut):
        logp = x.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1) - lse
        if truncated and not cut:
            out.append(logp)
        if full:
            out.append(logp)
    if entropy:
        probs = torch.softmax(x, dim=-1)  # entropy_from_logits' ops, so its rounding too
        out.append(lse - torch.einsum("...v,...v->...", probs, x))
    return tuple(out)
