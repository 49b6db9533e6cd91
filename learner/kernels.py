"""Leaner forwards for the learner's models: PEFT's LoRA Linear layers (``lora_kernel:
fused | merged``) and the decoders' RMSNorms (``rms_norm_kernel: fused``).

Why (benchmarks/RESULTS.md, the learner profile of 2026-11-26 on an H100): the learner's
update is bound by the host issuing ~100k small kernels per update, not by the GPU's
arithmetic; both swaps below compute the same function with fewer, larger kernels.

LoRA

PEFT 0.21's ``lora.Linear.forward`` with a bfloat16 base and float32 adapter weights (PEFT
upcasts adapters to float32 by default, ``autocast_adapter_dtype=True``) does, per
projection::

    result = base(x)                              # bf16 (N, out)
    x = x.to(float32)                             # a float32 copy of the input
    result = result + lora_B(lora_A(x)) * s       # float32 (N, r) and three float32 (N, out)
    result = result.to(bfloat16)                  # and a cast back

so every one of the 7 projections x 28 layers x 2 models writes and reads several
float32 copies of its output (and autograd keeps the float32 input for the backward).
The LoRA FLOPs are ~1% of the projection's; these copies are not.

The fused forward computes the same function in the base layer's dtype::

    result = base(x)                              # (N, out)
    xa = x @ A^T                                  # (N, r), A cast to x's dtype
    result = addmm(result, xa, B^T, alpha=s)      # one GEMM whose epilogue adds the base output

A and B stay float32 master weights (the optimiser's); their casts to the compute dtype
(r x in and out x r elements) are kept while ``cached_casts`` is active: the learner opens
it around its no-grad pass and its PPO epochs and clears it after every optimiser step,
so 2 x 7 x 28 cast kernels per model forward become one set per minibatch. The
gradients still flow through the cast (its backward saves nothing, so one cast node serves
every micro-batch's backward) into the float32 parameters. With a
float32 model it is PEFT's computation with the addition folded into the GEMM (equal up to
float rounding: tests/test_learner_speed.py). Only vanilla LoRA on nn.Linear is handled
(no DoRA, no lora_bias, one active adapter); other cases fall back to PEFT's forward.

``merged`` goes one step further: the forward is one GEMM with the merged weight, and the
backward computes the adapters' gradients from the factors (``_MergedLoRA``)::

    W' = W + s B A                                # (out, in), one addmm per forward, rounded once
    result = x @ W'^T                             # no LoRA kernels in the forward at all
    backward: dx = g @ W'                         # the base and LoRA input gradients in one GEMM
              dB = s g^T (x A^T),  dA = s (g B)^T x

so per projection the forward loses the (N, r) GEMM and the addmm that reads and rewrites
the (N, out) output, and the backward loses the (N, in) LoRA input gradient and its sum
with the base's. In float32 it is PEFT's function up to float rounding; under bfloat16 the
forward sees W + s B A rounded to bfloat16 once (as mixed-precision full fine-tuning sees
its float32 master weights: a change of A, B below half a bfloat16 ulp of W is invisible
to the forward until it accumulates), while the gradients stay those of the factors and
the masters stay float32. Active LoRA dropout (the learner's PPO forwards run without it by
default, ``ppo_dropout``) falls back to the fused forward, whose dropout is on x only.
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator

import torch
from torch import Tensor

_FUSED_NORMS = ("Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm")  # weight * x / rms(x)


def _cast(self, which: str, name: str, dtype: torch.dtype) -> Tensor:
    """lora_A / lora_B[name].weight in `dtype`, from the cast cache when one is open."""
    weight = getattr(self, which)[name].weight
    if weight.dtype == dtype:
        return weight
    cache = self.__dict__.get("_cast_cache")
    if cache is None or torch.compiler.is_compiling():
        return weight.to(dtype)
    key = (which, name, dtype, torch.is_grad_enabled())  # a no-grad cast must not serve a grad forward
    if key not in cache:
        cache[key] = weight.to(dtype)
    return cache[key]


class _MergedLoRA(torch.autograd.Function):
    """y = x @ (W + s B A)^T + bias with the gradients of x, A and B (W and bias frozen);
    see the module docstring."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias, a: Tensor, b: Tensor, scale: float) -> Tensor:
        merged = torch.addmm(weight, b, a, alpha=scale)  # (out, in) in the weight's dtype
        ctx.save_for_backward(x, merged, a, b)
        ctx.scale = scale
        return torch.nn.functional.linear(x, merged, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, merged, a, b = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])  # (N, out)
        x2 = x.reshape(-1, x.shape[-1])  # (N, in)
        dx = (g @ merged).view(x.shape) if ctx.needs_input_grad[0] else None
        da = db = None
        if ctx.needs_input_grad[3] or ctx.needs_input_grad[4]:
            db = (g.t() @ (x2 @ a.t())).mul_(ctx.scale)  # (out, r) = s g^T (x A^T)
            da = ((g @ b).t() @ x2).mul_(ctx.scale)  # (r, in) = s (g B)^T x
        return dx, None, None, da, db, None


def _fused_forward(self, x: Tensor, *args, **kwargs) -> Tensor:
    adapters = self.active_adapters
    if (self.disable_adapters or self.merged or len(adapters) != 1 or kwargs.get("adapter_names") is not None
            or adapters[0] not in self.lora_A):
        return type(self).forward(self, x, *args, **kwargs)  # PEFT's own path
    name = adapters[0]
    kwargs.pop("adapter_names", None)
    base, drop = self.base_layer, self.lora_dropout[name]
    no_dropout = isinstance(drop, torch.nn.Identity) or (isinstance(drop, torch.nn.Dropout)
                                                          and (not drop.training or drop.p == 0))
    if (self.__dict__.get("_lora_kernel") == "merged" and no_dropout and not args and not kwargs
            and not base.weight.requires_grad and (base.bias is None or not base.bias.requires_grad)):
        dtype = base.weight.dtype
        return _MergedLoRA.apply(x.to(dtype), base.weight, base.bias, _cast(self, "lora_A", name, dtype),
                                 _cast(self, "lora_B", name, dtype), float(self.scaling[name]))
    result = self.base_layer(x, *args, **kwargs)  # (..., out) in the base's dtype
    dtype = result.dtype
    a = _cast(self, "lora_A", name, dtype)  # (r, in)
    b = _cast(self, "lora_B", name, dtype)  # (out, r)
    xa = torch.nn.functional.linear(self.lora_dropout[name](x).to(dtype), a)  # (..., r)
    out = torch.addmm(result.reshape(-1, result.shape[-1]), xa.reshape(-1, xa.shape[-1]), b.t(),
                      alpha=self.scaling[name])  # (N, out) = result + s * xa @ B^T
    return out.view(result.shape)


def fuse_lora_linears(model: torch.nn.Module, kernel: str = "fused") -> int:
    """Give every PEFT LoRA ``Linear`` in ``model`` the ``fused`` or ``merged`` forward (an
    instance-level override; PEFT's merge / unmerge / disable_adapter still work, the last by
    falling back to PEFT's forward), or with ``kernel="peft"`` take it away again. Returns
    how many layers were changed; refuses LoRA variants."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    if kernel not in ("peft", "fused", "merged"):
        raise ValueError(f"lora kernel must be peft, fused or merged, not {kernel!r}")
    n = 0
    for module_name, module in model.named_modules():
        if not isinstance(module, LoraLinear):
            continue
        if kernel == "peft":
            module.__dict__.pop("_lora_kernel", None)
            n += module.__dict__.pop("forward", None) is not None
            continue
        if getattr(module, "lora_variant", None) or any(getattr(module, "lora_bias", {}).values()) \
                or any(getattr(module, "use_dora", {}).values()):
            raise ValueError(f"lora_kernel={kernel} handles vanilla LoRA only; {module_name} uses a variant "
                             f"(DoRA / lora_bias): use lora_kernel=peft")
        module.forward = types.MethodType(_fused_forward, module)
        module.__dict__["_lora_kernel"] = kernel
        n += 1
    return n


def _lora_layers(models) -> Iterator[torch.nn.Module]:
    from peft.tuners.lora.layer import Linear as LoraLinear

    for model in models:
        for module in model.modules():
            if isinstance(module, LoraLinear):
                yield module


@contextlib.contextmanager
def cached_casts(*models: torch.nn.Module) -> Iterator[None]:
    """Within the block, fused LoRA layers of `models` cast each adapter weight once (per
    dtype and grad mode) and reuse it, until clear_casts: the caller clears after every
    change of the adapter weights (an optimiser step, a load). Dropped on exit."""
    layers = list(_lora_layers(models))
    for layer in layers:
        layer.__dict__["_cast_cache"] = {}
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("_cast_cache", None)


def clear_casts(*models: torch.nn.Module) -> None:
    """Forget the cached casts of `models`' fused LoRA layers (their weights changed)."""
    for layer in _lora_layers(models):
        cache = layer.__dict__.get("_cast_cache")
        if cache is not None:
            cache.clear()


def _fused_rms_norm_forward(self, hidden_states: Tensor) -> Tensor:
    # One fused kernel (torch.nn.functional.rms_norm: float32 statistics, weight applied
    # before the single rounding to the input dtype) for HF's to(float32), pow, mean, add,
    # rsqrt, mul, to(dtype), mul; equal in float32 up to rounding, within one rounding of
    # the input dtype otherwise.
    return torch.nn.functional.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight.to(hidden_states.dtype),
                                        self.variance_epsilon)


def fuse_rms_norms(model: torch.nn.Module, fused: bool = True) -> int:
    """Give every RMSNorm of the known ``weight * x / sqrt(mean(x^2) + eps)`` classes
    (_FUSED_NORMS) in `model` the fused forward, or take it away (`fused=False`). Returns
    how many modules were changed."""
    n = 0
    for module in model.modules():
        if type(module).__name__ not in _FUSED_NORMS:
            continue
        if not fused:
            n += module.__dict__.pop("forward", None) is not None
            continue
        module.forward = types.MethodType(_fused_rms_norm_forward, module)
        n += 1
    return n
