"""Tolerances of the equality tests (pytest -m equality; STYLE.md item 17).

An equality test compares two computations of one quantity that differ only in the order
of their float operations: chunked vs one pass, a fused or merged kernel vs PEFT's,
micro-batches vs one batch, packed vs padded rows, compiled vs eager, vLLM vs HF. Another
CPU (another vector width: AVX-512, AVX2, or ATEN_CPU_CAPABILITY=default) changes that
order again, so the tolerance comes from the arithmetic, not from the numbers one machine
happened to give:

    rounding_tol = SAFETY * eps(dtype) * magnitude * sqrt(terms)

* eps: the dtype's machine epsilon (one unit in the last place of 1.0): float32 2^-23 =
  1.19e-7, bfloat16 2^-7, float64 2^-52.
* magnitude: the size of the values compared, or of the terms they are made of where those
  are larger (a logprob x - lse keeps the rounding of lse; an entropy lse - E[x] that of
  the logits): the largest |value| of the reference.
* terms: how many rounded additions feed one value: the reduction lengths along its path
  (a dot product's inner dimension, a softmax's vocabulary, a mean's count), summed over
  the layers it passes through. Rounding errors of independent signs add like a random
  walk, sqrt(terms): the usual rule of thumb (Higham, Accuracy and Stability of Numerical
  Algorithms); the worst-case bound, terms * eps, needs every error to have the same sign.
* SAFETY = 4: both computations round (x2), and the largest of many compared values sits
  in the tail of the error's distribution (x2).

Norm-wise comparisons of bfloat16 computations use rms_rel_tol: there the error is one
bfloat16 rounding per stored activation (the GEMMs accumulate in float32), not the sums.

A comparison that goes through Adam compares gradients, or runs with SGD (helpers.with_sgd,
test_stages): Adam's first step, lr * g / (|g| + eps), turns rounding on a near-zero gradient
entry into a step of up to ~lr; SGD's lr * g keeps it at lr times the gradient's rounding.

Exact equalities that hold by construction (the same code on the same inputs: a resume,
a retry, a cache that changes nothing) stay exact: they are not rounding questions.
"""

from __future__ import annotations

import math

import torch

EPS = {torch.float64: 2.0 ** -52, torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
SAFETY = 4.0


def rounding_tol(magnitude: float | torch.Tensor, terms: int = 1, dtype: torch.dtype = torch.float32) -> float:
    """Absolute tolerance of two computations of values of size `magnitude` (see the module
    docstring) that each went through `terms` rounded additions in `dtype`."""
    if isinstance(magnitude, torch.Tensor):
        magnitude = magnitude.detach().item()
    return SAFETY * EPS[dtype] * magnitude * math.sqrt(terms)


def rms_rel_tol(roundings: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """Tolerance of norm(a - b) / norm(b) for two computations that round each of
    `roundings` successive activations to `dtype` independently: one rounding's relative
    error is uniform in +-eps/2 (RMS eps / sqrt(12)), the difference of two such has RMS
    eps / sqrt(6), and `roundings` of them add like a random walk."""
    return SAFETY * EPS[dtype] * math.sqrt(roundings / 6)


def decoder_terms(hidden: int = 128, intermediate: int = 256, head_dim: int = 64, layers: int = 2,
                  seq: int = 64, vocab: int = 512) -> int:
    """The reduction lengths one token's logprob goes through in a Qwen3-style decoder
    (defaults: the embedded tiny model, sequences up to 64 tokens): per layer two RMSNorms
    (a mean of hidden squares each), the q/k/v and gate/up projections (hidden), q.k
    (head_dim), attention's weighted sum (seq), o_proj (heads x head_dim = hidden) and
    down_proj (intermediate); then the final norm, lm_head (hidden) and the log-softmax
    (vocab). The tiny model: 2560."""
    per_layer = 2 * hidden + hidden + head_dim + seq + hidden + intermediate
    return layers * per_layer + hidden + hidden + vocab


def grad_terms(tokens: int, forward: int | None = None) -> int:
    """A weight gradient's reductions: the backward runs the forward's reductions again
    (transposed), then sums one product per token."""
    forward = decoder_terms() if forward is None else forward
    return 2 * forward + tokens


def bf16_roundings(layers: int = 2) -> int:
    """bfloat16 roundings along one token's forward in a Qwen3-style decoder layer: the
    input norm, q (and its norm, rope), attention scores and output, o_proj, the residual
    add, the post-attention norm, gate, up, act * up, down_proj, the residual add (14);
    then the final norm and lm_head. The tiny model: 30."""
    return 14 * layers + 2


TINY_TERMS = decoder_terms()


# A sampled token's |logprob| on the tiny model stays under this (a token with logprob -20
# has probability 2e-9: never sampled in a test): the magnitude for comparisons where the
# logprobs themselves are not at hand (a step's gen_logprob_max_abs_diff, its ratio mean).
TINY_MAX_SAMPLED_LOGPROB = 20.0
# One sampled token's float32 logprob on the tiny model computed two ways (vLLM vs the
# learner, one engine call vs another): 4.8e-4; a mean of such differences is within it too.
TINY_LOGPROB_TOL = rounding_tol(TINY_MAX_SAMPLED_LOGPROB, TINY_TERMS)
