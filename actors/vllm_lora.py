"""The `tensor` LoRA sync, run inside vLLM's worker process(es): an adapter from memory, no file.

vLLM mixes ``TensorLoRAWorker`` into its Worker class (engine argument
``worker_extension_cls="actors.vllm_lora.TensorLoRAWorker"``), so the tensor sync mode
(``actors.lora_sync.TensorSync``) can call
``llm.collective_rpc("ppo_add_lora", args=(lora_int_id, pack_tensors(tensors), peft_config))``.
Only the A/B tensors cross the process boundary (raw bytes + shape + dtype, as the merged sync
sends them: no pickle, no callable shipped).

vLLM 0.32 has no public way to register an adapter from tensors: ``add_lora`` reads a PEFT
directory (``LRUCacheWorkerLoRAManager._load_adapter``: the config, then
``LoRAModel.from_local_checkpoint``, which reads the safetensors and hands them to
``LoRAModel.from_lora_tensors``). This worker method does what ``_load_adapter`` and
``add_adapter`` do with the tensors themselves: the config's legality (rank, bias), the check
that every tensor names a module vLLM serves LoRA on (the file path checks it through
``check_unexpected_modules``), ``from_lora_tensors``, then the cache (the previous adapter of
the same id goes, the oldest is evicted past capacity) and activation. A request then names the
adapter by a LoRARequest whose id is registered: vLLM finds it in the cache and never reads the
request's path (``add_adapter`` touches a registered id; it loads only an unknown one).
"""

from __future__ import annotations

from typing import Any

from actors.vllm_merge import unpack_tensors

TENSOR_WORKER = "actors.vllm_lora.TensorLoRAWorker"
# The lora_path of a request naming an adapter loaded from memory: never read while the id is
# registered (a load of an id vLLM no longer holds fails naming this path, not a wrong file).
NO_PATH = "ppo-ray:in-memory-adapter"


def expected_modules(adapter_manager) -> set[str]:
    """The module names vLLM accepts LoRA weights for (its packed modules unpacked): the set
    ``LRUCacheWorkerLoRAManager._load_adapter`` builds for the file path's check."""
    out: set[str] = set()
    for module in adapter_manager.supported_lora_modules:
        out.update(adapter_manager.packed_modules_mapping.get(module, [module]))
    return out


def unexpected_modules(keys, expected: set[str]) -> list[str]:
    """The PEFT keys (base_model.model.<module path>.lora_A.weight) whose module is not one vLLM
    serves LoRA on: an adapter trained for another architecture, or a renamed module."""
    out = []
    for key in keys:
        module = key.rsplit(".lora_", 1)[0]  # ...self_attn.q_proj
        if module.rsplit(".", 1)[-1] not in expected:
            out.append(module)
    return out


class TensorLoRAWorker:
    """A vLLM worker extension: register a LoRA adapter from tensors (see the module docstring)."""

    def ppo_add_lora(self, lora_int_id: int, packed: dict, peft_config: dict[str, Any]) -> bool:
        """Register the adapter ``lora_int_id`` from ``packed`` (pack_tensors' PEFT A/B tensors)
        and ``peft_config`` (its adapter_config.json as a dict); True when it is in the cache."""
        from vllm.lora.peft_helper import PEFTHelper

        manager = self.model_runner.lora_manager  # LRUCacheWorkerLoRAManager
        adapters = manager._adapter_manager
        tensors = unpack_tensors(packed)
        bad = unexpected_modules(tensors, expected_modules(adapters))
        if bad:
            raise ValueError(f"LoRA tensors for modules vLLM does not serve LoRA on: {bad[:3]} "
                             f"(it serves {sorted(expected_modules(adapters))})")
        helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
        helper.validate_legal(manager.lora_config)
        model = adapters.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = manager._lora_model_cls.from_lora_tensors(
            lora_model_id=lora_int_id, tensors=tensors, peft_helper=helper, device="cpu",
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        adapters.remove_adapter(lora.id)  # a reused id: its previous weights go
        if len(adapters) + 1 > adapters.capacity:
            adapters.remove_oldest_adapter()
        loaded = adapters.add_adapter(lora)
        adapters.activate_adapter(lora_int_id)
        return bool(loaded) or adapters.get_adapter(lora_int_id) is not None
