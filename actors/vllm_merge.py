"""The `merged` LoRA sync, run inside vLLM's worker process(es).

vLLM mixes ``MergedLoRAWorker`` into its Worker class (engine argument
``worker_extension_cls="actors.vllm_merge.MergedLoRAWorker"``), so the merged sync mode
(``actors.lora_sync.MergedSync``) can call
``llm.collective_rpc("ppo_merge_lora", args=(pack_tensors(tensors), scale, model_dir))``:
only the LoRA A/B tensors cross the process boundary, as raw bytes + shape + dtype through
vLLM's msgpack layer (no pickle, no callable shipped).

On the first call the worker reads the base weights of the LoRA target projections from
the model directory's safetensors (HF names, e.g. ``model.layers.0.self_attn.q_proj.weight``)
and keeps them on its device. Every call then loads ``W = W0 + scale * B @ A`` for each
target: on a GPU through the model's own ``load_weights`` (which maps q/k/v and gate/up
onto vLLM's fused qkv_proj / gate_up_proj shards); on the CPU, where vLLM packs each linear
weight for oneDNN and frees the original, by rebuilding the fused weight and packing it
again (``_load_cpu``). Merging from the kept W0 every time, rather than
adding the difference to the previous merge, means no rounding error builds up over a run,
and version 0 (B = 0) gives the base weights back bit for bit.

Cost: a second copy of the target projections' weights in the worker (the base model's
linear layers, most of its parameters), in exchange for generation at base-model speed
(no LoRA kernels). The merged weights are rounded to the engine dtype once; the learner's
PEFT forward keeps W0 and the low-rank path separate, so the two differ by that rounding.
"""

from __future__ import annotations

from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model."


def base_weight_name(peft_key: str) -> str:
    """PEFT adapter key -> the HF weight it modifies:
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight -> model.layers.0.self_attn.q_proj.weight"""
    name = peft_key[len(PEFT_PREFIX):] if peft_key.startswith(PEFT_PREFIX) else peft_key
    for part in (".lora_A.weight", ".lora_B.weight"):
        if name.endswith(part):
            return name[: -len(part)] + ".weight"
    raise ValueError(f"not a PEFT LoRA key: {peft_key!r}")


def read_base_weights(model_dir: str | Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The named tensors from a HF directory's *.safetensors files (CPU)."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in set(f.keys()) & (names - set(found)):
                found[key] = f.get_tensor(key)
    missing = names - set(found)
    if missing:
        raise ValueError(f"{model_dir}: no base weight for {sorted(missing)[:3]} (LoRA targets of another model?)")
    return found


def merged_weights(base: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], scale: float) -> list[tuple[str, torch.Tensor]]:
    """[(HF weight name, W0 + scale * B @ A)] in W0's dtype, computed in float32."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in lora.items():
        pairs.setdefault(base_weight_name(key), {})["A" if ".lora_A." in key else "B"] = value
    out = []
    for name, ab in sorted(pairs.items()):
        w0 = base[name]
        delta = ab["B"].to(w0.device, torch.float32) @ ab["A"].to(w0.device, torch.float32)
        out.append((name, (w0.float() + scale * delta).to(w0.dtype)))
    return out


_DTYPES = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}


def pack_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[bytes, list[int], str]]:
    """Tensors as (raw bytes, shape, dtype) for collective_rpc: vLLM's msgpack layer passes
    bytes through but hands nested tensors to the worker as lists."""
    out = {}
    for k, v in tensors.items():
        v = v.detach().to("cpu").contiguous()
        raw = v.view(torch.int16) if v.dtype == torch.bfloat16 else v  # numpy has no bfloat16
        out[k] = (raw.numpy().tobytes(), list(v.shape), str(v.dtype))
    return out


def unpack_tensors(packed: dict[str, tuple[bytes, list[int], str]]) -> dict[str, torch.Tensor]:
    return {k: torch.frombuffer(bytearray(raw), dtype=_DTYPES[dtype]).reshape(shape)
            for k, (raw, shape, dtype) in packed.items()}


def _packed_groups(model) -> dict[str, list[str]]:
    """HF projection -> the HF projections vLLM fuses with it (q_proj -> [q_proj, k_proj, v_proj])."""
    groups: dict[str, list[str]] = {}
    for parts in getattr(model, "packed_modules_mapping", {}).values():
        for part in parts:
            groups[part] = list(parts)
    return groups


def _load_cpu(model, merged: dict[str, torch.Tensor], base: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """vLLM on the CPU packs each linear layer's weight for oneDNN after loading and frees
    the original (load_weights cannot write into it again), so rebuild each touched layer's
    (fused) weight in the engine's `dtype`, set it, and let vLLM pack it again. The cast
    matters: the merge comes in the checkpoint's dtype (e.g. float32 files under a bfloat16
    engine), and a weight packed in another dtype than the activations gives garbage
    (non-finite logprobs). Tensor parallelism 1 only."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    packed = getattr(model, "packed_modules_mapping", {})
    for name, module in model.named_modules():
        if not hasattr(module, "cpu_linear"):
            continue
        prefix, _, leaf = name.rpartition(".")
        hf = [f"{prefix}.{part}.weight" for part in packed.get(leaf, [leaf])]
        if not any(n in merged for n in hf):
            continue
        fused = torch.cat([merged.get(n, base.get(n)) for n in hf], dim=0).to(dtype)
        module.weight = torch.nn.Parameter(fused.contiguous(), requires_grad=False)
        dispatch_cpu_unquantized_gemm(module, remove_weight=True)


class MergedLoRAWorker:
    """Mixed into vLLM's Worker (worker_extension_cls); methods are prefixed ppo_."""

    def ppo_merge_lora(self, packed: dict, scale: float, model_dir: str) -> int:
        from vllm.platforms import current_platform

        lora = unpack_tensors(packed)
        model = self.model_runner.get_model()
        targets = {base_weight_name(k) for k in lora}
        groups = _packed_groups(model)
        names = set(targets)
        for n in targets:  # fused partners of a target are needed to rebuild the fused weight
            prefix, _, proj = n[: -len(".weight")].rpartition(".")
            names |= {f"{prefix}.{p}.weight" for p in groups.get(proj, [proj])}
        base = getattr(self, "_ppo_base_weights", None)
        if base is None or not names <= set(base):
            device = self.model_runner.device if hasattr(self.model_runner, "device") else "cpu"
            base = {k: v.to(device) for k, v in read_base_weights(model_dir, names).items()}
            self._ppo_base_weights = base
        merged = merged_weights(base, lora, float(scale))
        if current_platform.is_cpu():
            if self.vllm_config.parallel_config.tensor_parallel_size != 1:
                raise ValueError("lora_sync='merged' on the CPU supports tensor_parallel_size 1 only")
            _load_cpu(model, dict(merged), base, self.vllm_config.model_config.dtype)
        else:
            model.load_weights(iter(merged))
        return len(merged)
