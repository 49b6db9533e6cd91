"""A leaner forward for PEFT's LoRA Linear layers (``lora_kernel: fused``).

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

A and B stay float32 master weights (the optimiser's); they are cast per forward (r x in
and out x r elements, negligible), and their gradients come back in float32. With a
float32 model it is PEFT's computation with the addition folded into the GEMM (equal up to
float rounding: tests/test_learner_speed.py). Only vanilla LoRA on nn.Linear is handled
(no DoRA, no lora_bias, one active adapter); other cases fall back to PEFT's forward.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor


def _fused_forward(self, x: Tensor, *args, **kwargs) -> Tensor:
    adapters = self.active_adapters
    if (self.disable_adapters or self.merged or len(adapters) != 1 or kwargs.get("adapter_names") is not None
            or adapters[0] not in self.lora_A):
        return type(self).forward(self, x, *args, **kwargs)  # PEFT's own path
    name = adapters[0]
    kwargs.pop("adapter_names", None)
    result = self.base_layer(x, *args, **kwargs)  # (..., out) in the base's dtype
    dtype = result.dtype
    a = self.lora_A[name].weight.to(dtype)  # (r, in)
    b = self.lora_B[name].weight.to(dtype)  # (out, r)
    xa = torch.nn.functional.linear(self.lora_dropout[name](x).to(dtype), a)  # (..., r)
    out = torch.addmm(result.reshape(-1, result.shape[-1]), xa.reshape(-1, xa.shape[-1]), b.t(),
                      alpha=self.scaling[name])  # (N, out) = result + s * xa @ B^T
    return out.view(result.shape)


def fuse_lora_linears(model: torch.nn.Module, fused: bool = True) -> int:
    """Give every PEFT LoRA ``Linear`` in ``model`` the fused forward (an instance-level
    override; PEFT's merge / unmerge / disable_adapter still work, the last by falling back
    to PEFT's forward), or with ``fused=False`` take it away again. Returns how many layers
    were changed; refuses LoRA variants."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    n = 0
    for module_name, module in model.named_modules():
        if not isinstance(module, LoraLinear):
            continue
        if not fused:
            n += module.__dict__.pop("forward", None) is not None
            continue
        if getattr(module, "lora_variant", None) or any(getattr(module, "lora_bias", {}).values()) \
                or any(getattr(module, "use_dora", {}).values()):
            raise ValueError(f"lora_kernel=fused handles vanilla LoRA only; {module_name} uses a variant "
                             f"(DoRA / lora_bias): use lora_kernel=peft")
        module.forward = types.MethodType(_fused_forward, module)
        n += 1
    return n
