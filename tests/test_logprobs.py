"""Pins the token log-probs of ppo_ray/logprobs.py (CPU, fast): logprobs_from_logits and
entropy_from_logits against log_softmax, against a brute-force emulation of vLLM's sampler
(temperature, top-k with ties, top-p), and against vLLM's own Sampler where vLLM is installed.

Tolerances (tests/tolerances.py): a float32 logprob x - lse or entropy lse - E[x] is
rounded at the size of the logits / temperature, through a reduction over the vocabulary:
lp_tol(logits, temperature)."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_ray.logprobs import entropy_from_logits, logprobs_from_logits, token_stats_from_logits
from tolerances import rounding_tol


def lp_tol(logits: torch.Tensor, temperature: float = 1.0) -> float:
    """Tolerance of a float32 logprob, entropy or probability sum computed from `logits`
    two ways: rounding at the size of logits / temperature (at least 1: the probabilities),
    through a reduction over the vocabulary."""
    return rounding_tol(max(logits.float().abs().max().item() / temperature, 1.0), logits.shape[-1])


def brute_vllm_logprobs(logits_row, temperature, top_k, top_p):
    """Per-row brute force of vLLM's rule, formulated from the top down in float64.

    top-k keeps every token whose logit is >= the k-th largest; top-p then keeps a token
    iff the (renormalised) mass of the tokens strictly more likely than it is < p (so
    the most likely token always stays). Log-probs renormalise over the kept set.
    Also returns the smallest distance of any "mass above" to p (to avoid ties with p).
    """
    x = [float(v) / temperature for v in logits_row]
    V = len(x)
    kept = set(range(V))
    if top_k is not None and 0 < top_k < V:
        kth = sorted(x, reverse=True)[top_k - 1]
        kept = {i for i in range(V) if x[i] >= kth}
    margin = float("inf")
    if top_p is not None and top_p < 1.0:
        mx = max(x[i] for i in kept)
        w = {i: math.exp(x[i] - mx) for i in kept}
        z = sum(w.values())
        keep_p = set()
        for i in kept:
            above = sum(w[j] for j in kept if x[j] > x[i]) / z
            margin = min(margin, abs(above - top_p))
            if above < top_p:
                keep_p.add(i)
        kept = keep_p
    mx = max(x[i] for i in kept)
    lse = mx + math.log(sum(math.exp(x[i] - mx) for i in kept))
    return [x[i] - lse if i in kept else -math.inf for i in range(V)], margin


def all_token_logprobs(logits, **kwargs):
    """(N, V) logits -> (N, V) log-probs of every vocab token via logprobs_from_logits."""
    N, V = logits.shape
    expanded = logits.unsqueeze(1).expand(N, V, V)  # (B=N, T=V, V)
    tokens = torch.arange(V).expand(N, V)
    return logprobs_from_logits(expanded, tokens, **kwargs)


@pytest.mark.equality
def test_logprobs_no_truncation_matches_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 11, generator=g) * 3
    tokens = torch.randint(0, 11, (3, 4), generator=g)
    for temp in (1.0, 0.7, 1.5):
        ref = torch.log_softmax(logits / temp, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        out = logprobs_from_logits(logits, tokens, temperature=temp)
        assert out.dtype == torch.float32 and out.shape == (3, 4)
        torch.testing.assert_close(out, ref, atol=lp_tol(logits, temp), rtol=0)
    # disabled truncation values behave like no truncation (vLLM: top_k 0/-1/>=V, top_p 1)
    base = logprobs_from_logits(logits, tokens)
    for kw in ({"top_k": 0}, {"top_k": -1}, {"top_k": 11}, {"top_k": 50}, {"top_p": 1.0}):
        torch.testing.assert_close(logprobs_from_logits(logits, tokens, **kw), base, atol=lp_tol(logits), rtol=0)


@pytest.mark.equality
def test_logprobs_gradient_matches_log_softmax():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 3, 9, generator=g) * 2).requires_grad_(True)
    tokens = torch.randint(0, 9, (2, 3), generator=g)
    logprobs_from_logits(logits, tokens, temperature=0.8).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    torch.log_softmax(logits / 0.8, -1).gather(-1, tokens.unsqueeze(-1)).sum().backward()
    # (onehot - softmax) / temperature: probabilities rounded through the softmax's sum
    torch.testing.assert_close(ours, logits.grad, atol=rounding_tol(1 / 0.8, logits.shape[-1]), rtol=0)


@pytest.mark.equality
def test_logprobs_bf16_computed_in_float32():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 5, 64, generator=g) * 4).to(torch.bfloat16)
    tokens = torch.randint(0, 64, (2, 5), generator=g)
    out = logprobs_from_logits(logits, tokens)
    assert out.dtype == torch.float32
    exact = torch.log_softmax(logits.double(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.double(), exact, atol=lp_tol(logits), rtol=0)  # float32, not bfloat16, rounding
    assert torch.equal(out, logprobs_from_logits(logits.float(), tokens))  # the same float32 ops
    # a bf16 log_softmax would be visibly off
    in_bf16 = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1).double()
    assert (in_bf16 - exact).abs().max() > 1e-3


@pytest.mark.equality
@pytest.mark.parametrize("seed", range(3))
def test_logprobs_top_k(seed):
    g = torch.Generator().manual_seed(seed)
    N, V, k = 5, 13, 4
    logits = torch.randn(N, V, generator=g) * 2
    lp = all_token_logprobs(logits, temperature=0.9, top_k=k)
    topk_idx = logits.topk(k, dim=-1).indices
    in_topk = torch.zeros(N, V, dtype=torch.bool).scatter_(-1, topk_idx, True)
    assert torch.isinf(lp[~in_topk]).all() and (lp[~in_topk] < 0).all()
    assert torch.isfinite(lp[in_topk]).all()
    tol = lp_tol(logits, 0.9)
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(N), atol=tol, rtol=0)  # renormalised over kept
    expected = torch.log_softmax((logits / 0.9).masked_fill(~in_topk, -math.inf), -1)
    torch.testing.assert_close(lp[in_topk], expected[in_topk], atol=tol, rtol=0)


def test_logprobs_top_k_ties_keep_all_tied():
    # vLLM (apply_top_k_top_p_pytorch / apply_top_k_only) masks logits < k-th largest:
    # tokens tied with the k-th largest logit all survive.
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0]])
    lp = all_token_logprobs(logits, top_k=2)
    assert torch.isfinite(lp[0]).tolist() == [True, False, True, True, False, True]
    assert lp.exp().sum().item() == pytest.approx(1.0, abs=lp_tol(logits), rel=0)
    lp = all_token_logprobs(logits, top_k=2, top_p=0.999)
    assert torch.isfinite(lp[0]).tolist() == [True, False, True, True, False, True]


@pytest.mark.equality
@pytest.mark.parametrize("seed", range(4))
def test_logprobs_top_p_and_top_k_top_p_match_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    checked = 0
    for trial in range(12):
        V = int(torch.randint(2, 40, (), generator=g))
        logits = torch.randn(3, V, generator=g) * float(torch.rand((), generator=g) * 4 + 0.2)
        temp = [1.0, 0.7, 1.3][trial % 3]
        top_p = [0.5, 0.8, 0.95, 0.3][trial % 4]
        top_k = [None, None, 3, 1, 10][trial % 5]
        brute = [brute_vllm_logprobs(row.tolist(), temp, top_k, top_p) for row in logits]
        if min(margin for _, margin in brute) < 1e-4:
            continue  # a cumulative mass within float noise of p (~rounding_tol(1, V) < 3e-6): ill-posed, skip
        lp = all_token_logprobs(logits, temperature=temp, top_k=top_k, top_p=top_p)
        expected = torch.tensor([row for row, _ in brute], dtype=torch.float32)
        assert torch.equal(torch.isinf(lp), torch.isinf(expected)), (trial, V, top_k, top_p)
        fin = torch.isfinite(expected)
        tol = lp_tol(logits, temp)  # float32 against the float64 brute force
        torch.testing.assert_close(lp[fin], expected[fin], atol=tol, rtol=0)
        torch.testing.assert_close(lp.exp().sum(-1), torch.ones(3), atol=tol, rtol=0)
        assert torch.isfinite(lp.max(-1).values).all()  # at least one token always kept
        checked += 1
    assert checked >= 8


def test_logprobs_top_p_keeps_at_least_one():
    logits = torch.tensor([[5.0, 0.0, -1.0]])  # top token has > 98% mass
    lp = all_token_logprobs(logits, top_p=0.01)
    assert torch.isfinite(lp[0]).tolist() == [True, False, False]
    assert lp[0, 0].item() == 0.0


def test_logprobs_invalid_args():
    logits, tokens = torch.randn(1, 2, 5), torch.zeros(1, 2, dtype=torch.long)
    for bad in ({"temperature": 0.0}, {"temperature": 1e-3}, {"top_p": 0.0}, {"top_p": 1.5},
                {"top_k": -2}, {"top_k": 2.5}):
        with pytest.raises(ValueError):
            logprobs_from_logits(logits, tokens, **bad)


@pytest.mark.equality
def test_entropy_from_logits():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 4, 10, generator=g) * 3
    m = torch.arange(4) < torch.tensor([4, 2]).unsqueeze(-1)  # rows of 4 and 2 real tokens
    for temp in (1.0, 0.5):
        h = entropy_from_logits(logits, m, temperature=temp)
        p = torch.softmax(logits.double() / temp, -1)
        ref = -(p * p.log()).sum(-1)
        assert h.dtype == torch.float32
        torch.testing.assert_close(h.double()[m], ref[m], atol=lp_tol(logits, temp), rtol=0)  # float32 vs float64
        assert (h[~m] == 0).all()
    one = torch.ones(1, 1, dtype=torch.bool)
    uniform = entropy_from_logits(torch.zeros(1, 1, 8, dtype=torch.bfloat16), one)
    assert uniform.item() == pytest.approx(math.log(8), abs=rounding_tol(math.log(8), 8), rel=0)


@pytest.mark.equality
@pytest.mark.parametrize("top_k,top_p", [(None, None), (0, 1.0), (4, None), (None, 0.8), (5, 0.9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_stats_equal_the_separate_functions(top_k, top_p, dtype):
    """token_stats_from_logits (the learner's head, its shared work done once) gives each
    subset of (truncated, full, entropy), in that order, equal to the separate functions:
    values bit for bit, the logits' gradients up to rounding."""
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(3, 5, 12, generator=g) * 3).to(dtype)
    tokens = logits.float().argmax(-1)  # always inside the truncated support
    mask = torch.ones(3, 5, dtype=torch.bool)
    separate = {"truncated": lambda x: logprobs_from_logits(x, tokens, 0.7, top_k, top_p),
                "full": lambda x: logprobs_from_logits(x, tokens, 0.7),
                "entropy": lambda x: entropy_from_logits(x, mask, 0.7)}
    for which in [("truncated",), ("full",), ("entropy",), ("truncated", "entropy"), ("truncated", "full", "entropy")]:
        results = []
        for fn in (lambda x: [separate[w](x) for w in which],
                   lambda x: token_stats_from_logits(x, tokens, 0.7, top_k, top_p, **{w: True for w in which})):
            x = logits.clone().requires_grad_(True)
            out = fn(x)
            grad = torch.autograd.grad(sum((o * (i + 1)).sum() for i, o in enumerate(out)), x)[0]
            results.append([*[o.detach() for o in out], grad.float()])
        assert len(results[1]) == len(which) + 1
        for a, b in zip(results[0][:-1], results[1][:-1]):
            assert torch.equal(a, b), which  # the same ops on the same float32 values
        a, b = results[0][-1], results[1][-1]  # the logits' gradients
        if dtype == torch.bfloat16:
            # the separate functions' gradients are bfloat16 (the logits' dtype), added in
            # bfloat16; the shared float32 copy adds them first and rounds once: up to one
            # bfloat16 rounding per function and per addition at the largest term's size
            atol = rounding_tol(a.abs().max(), 2 * len(which), torch.bfloat16)
        else:  # float32 sums over the vocabulary of terms up to (x - E[x]) / temperature
            atol = rounding_tol(2 * logits.float().abs().max() / 0.7, logits.shape[-1]) * len(which)
        assert a.dtype == b.dtype, which
        torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=lambda m: f"{which}: {m}")
    assert token_stats_from_logits(logits, tokens) == ()


# ----------------------------------------------------------------------------------------
# against vLLM's own sampler function (no engine: 40 cases in ~1.5 s; importing vLLM takes
# ~9 s, paid once per session by whichever test imports it first, the engine tests anyway)
# ----------------------------------------------------------------------------------------


@pytest.mark.equality
@pytest.mark.heavy("vLLM's sampler")
def test_logprobs_match_vllm_processed_logprobs():
    # vllm is a hard dependency (the generator): an import error here is a broken install,
    # which must fail, not skip the only check against vLLM's own sampler
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    def vllm_processed(logits2d, temperature, top_k, top_p):
        N, V = logits2d.shape
        if top_k is not None and not (0 < top_k < V):
            top_k = None if top_p is None else V  # InputBatch stores disabled top-k as V
        md = SamplingMetadata(
            temperature=torch.full((N,), temperature, dtype=torch.float32),
            all_greedy=False, all_random=True,
            top_p=None if top_p is None else torch.full((N,), top_p, dtype=torch.float32),
            top_k=None if top_k is None else torch.full((N,), top_k, dtype=torch.int32),
            generators={}, max_num_logprobs=0, no_penalties=True, prompt_token_ids=None,
            frequency_penalties=torch.zeros(N), presence_penalties=torch.zeros(N),
            repetition_penalties=torch.ones(N), output_token_ids=[[] for _ in range(N)],
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
        )
        _, lp = Sampler(logprobs_mode="processed_logprobs").sample(logits2d.float().clone(), md)
        return lp

    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        V = int(torch.randint(3, 64, (), generator=g))
        if trial % 3 == 2:  # heavy ties
            logits = torch.randint(-3, 3, (4, V), generator=g).float()
        else:
            logits = torch.randn(4, V, generator=g) * float(torch.rand((), generator=g) * 5 + 0.1)
        if trial % 2:
            logits = logits.bfloat16()
        temp = [1.0, 0.7, 1.3][trial % 3]
        top_k = [None, 1, 3, 50][trial % 4]
        top_p = [None, 0.9, 0.5, 0.95, 0.99][trial % 5]
        ref = vllm_processed(logits, temp, top_k, top_p)
        ours = all_token_logprobs(logits, temperature=temp, top_k=top_k, top_p=top_p)
        assert torch.equal(torch.isinf(ref), torch.isinf(ours)), trial
        fin = torch.isfinite(ref)
        torch.testing.assert_close(ours[fin], ref[fin], atol=lp_tol(logits, temp), rtol=0, msg=f"trial {trial}")
