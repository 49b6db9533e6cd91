"""LoRA sync modes: how a new LoRA version gets into the generator's vLLM engine.

One class per mode (the config's ``lora_sync``), owning the three things a mode decides:

* its engine arguments (``engine_args``, what ``build_llm`` must be given) and the check
  that an engine was built with them (``check_engine``);
* its load (``load``): the learner's A/B tensors of version v into the engine, and what
  ``generate`` then passes vLLM (``lora_request``);
* its prefix-cache handling after a load (every mode here resets the cache: see
  ``LoraSync.reset_prefix_cache`` for why each needs it).

The registry is ``ppo_ray.config.SYNC_MODES`` (ppo_ray/config/sync_modes.py), name -> the
mode's "module:Class" and its capabilities, resolved here by ``sync_class``: the config takes
its choices from the registry's keys without importing vLLM or torch (and without importing
this layer), as vLLM's own model registry names its model classes by module and class and
imports one only when it is asked for. What a mode can hold (several adapter versions or one;
so whether it streams, its max_staleness limit) is its entry's SyncCapabilities, which each
class carries as ``capabilities``: the config, the generator and the driver ask that, never the
mode's name. A new mode (an NCCL broadcast on GPUs, say) is one class and one entry there.

Modes:

* ``adapter``: a vLLM ``LoRARequest`` per version. ``llm.llm_engine.add_lora`` loads and
  validates the adapter in the worker (``LRUCacheWorkerLoRAManager.add_adapter`` ->
  ``_load_adapter``: missing files, unexpected modules or a rank above ``max_lora_rank``
  raise there), so a broken adapter fails in the load, not silently at the next generate.
  Requests then find it in the cache by ``lora_int_id`` and do not reread the files; the
  prefix-cache key includes the adapter's name and path, so KV blocks never leak across
  versions. One adapter alive at a time, the previous one and its files retired; or, with
  max_staleness k, the k + 1 versions that batches in flight were sampled with (``versions``:
  the engine's max_loras is k + 1), each retired when the driver says no batch needs it
  (``retire``). The engine's adapter cache (max_cpu_loras) then has room for one more
  than that, so registering a version never evicts one still in use (an evicted adapter is
  read again from its path: a tensor-mode adapter has none).
* ``tensor``: as ``adapter``, but the A/B tensors reach the worker from memory (a vLLM worker
  extension, ``actors.vllm_lora``, registers them with ``LoRAModel.from_lora_tensors``): no
  file is written or read per version. The same checks as the file path (rank, bias, the
  modules), the same LoRA kernels, the same samples.
* ``merged``: W = W0 + (alpha / r) B A loaded into the engine's own weights by a vLLM worker
  extension (``actors.vllm_merge``): base-model generation speed, no LoRA kernels. It
  changes the weights in place, under a prefix cache whose keys know nothing of them: every
  load resets the cache, so no KV block outlives the weights it was made with.
"""

from __future__ import annotations

import importlib
import itertools
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Optional

from ppo_ray.config import SYNC_MODES, VLLM_LORA_RANKS, SyncCapabilities, sync_mode
from ppo_ray.modeling import LoraWeights, write_lora_adapter
from ppo_ray.stats import SyncReport

# The vLLM worker extensions: merging LoRA weights in place (lora_sync="merged"), and
# registering an adapter from tensors (lora_sync="tensor").
MERGED_WORKER = "actors.vllm_merge.MergedLoRAWorker"
TENSOR_WORKER = "actors.vllm_lora.TensorLoRAWorker"

# LoRA int ids must be unique per engine, and an engine may be shared by several
# Generators in one process (the tests do): a per-process counter, not per instance.
_LORA_IDS = itertools.count(1)


def sync_class(name: str) -> type["LoraSync"]:
    """The class registered as LoRA sync mode ``name`` (ppo_ray.config.SYNC_MODES); a
    ValueError naming the mode and the registered ones (ppo_ray.config.sync_mode)."""
    module, _, cls = sync_mode(name).cls.partition(":")
    return getattr(importlib.import_module(module), cls)


class LoraSync(ABC):
    """One generator's LoRA sync mode over its vLLM engine ``llm``.

    ``model_dir``: the base model the engine serves; ``scratch_dir``: a directory the
    generator owns (and deletes on close) where a mode may write files.
    """

    def __init__(self, llm, model_dir: str, scratch_dir: Path):
        self.llm = llm
        self.model_dir = model_dir
        self.scratch_dir = scratch_dir
        # A streaming generator (actors.engine_loop) loads while other versions' requests run:
        # the prefix cache is then reset only when the engine is idle (reset_prefix_cache).
        self.streaming = False

    # What the mode can hold (several versions or one), its registry entry: each class names its own.
    capabilities: SyncCapabilities

    # How many adapter versions the mode can hold at once: 1, or the engine's max_loras
    # (AdapterSync.capacity).
    capacity = 1

    @classmethod
    @abstractmethod
    def engine_args(cls, lora_r: int, versions: int = 1) -> dict[str, Any]:
        """The build_llm arguments this mode needs, for adapters of rank up to ``lora_r`` and
        ``versions`` versions alive at once (max_staleness + 1)."""

    @classmethod
    @abstractmethod
    def check_engine(cls, llm) -> None:
        """A ValueError unless ``llm`` was built with this mode's engine arguments."""

    @property
    def lora_request(self):
        """What generate() passes vLLM as ``lora_request`` for the newest version: None = the
        engine's own weights."""
        return None

    @property
    def versions(self) -> list[int]:
        """The adapter versions held (ascending); empty until the first load."""
        return []

    def request(self, version: int):
        """``lora_request`` of a held ``version`` (a KeyError naming the held ones otherwise)."""
        if version not in self.versions:
            raise KeyError(f"adapter version {version} is not held (held: {self.versions})")
        return self.lora_request

    def retire(self, versions: list[int]) -> None:
        """Retire these held versions (no batch needs them any more)."""

    def check_rank(self, r: int) -> None:
        """A ValueError if this engine cannot take adapters of rank ``r`` (before any load)."""

    @abstractmethod
    def load(self, version: int, weights: LoraWeights) -> SyncReport:
        """Make ``weights`` (checked: CPU, contiguous, rank = spec.r) what the engine samples
        with, and reset the prefix cache. A failing load leaves the previous version in place."""

    def close(self) -> None:
        """Release what the mode holds in the engine. The engine stays (it may be shared)."""

    def reset_prefix_cache(self, version: int) -> None:
        """Empty vLLM's prefix cache after a new version is in place.

        Merged sync: the cache's block hashes cover the tokens, not the weights, so without
        a reset a prompt prefix seen under an earlier version would reuse KV computed with
        the old weights (vllm #9744; measured here: a 1-nat generator-vs-learner gap from the
        second step on). Adapter sync: the hashes include the adapter's name and path (a new
        directory per load), so no stale block is reused; the reset is for determinism:
        with an empty cache at every version, what a batch samples depends only on the
        version and the batch, not on what the engine generated before (KV read from the
        cache differs from KV computed in the batch by float rounding, ~1e-8 in the
        logprobs; a batch regenerated after a fault must equal the lost one bit for bit).
        The cost: no KV reuse across versions, which PPO (one rollout per prompt per step)
        does not have anyway. The offline engine runs no
        request between generate() calls, so the reset must succeed; vLLM returns False
        (and keeps the cache) while blocks are in use."""
        if self.streaming and self.llm.llm_engine.has_unfinished_requests():
            # requests of earlier versions still run; the cache's keys hold each registration's
            # name and path, so no version reads another's blocks (merged sync does not stream)
            return
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(f"after loading LoRA adapter version {version}: vLLM refused to reset its prefix "
                               "cache (requests still running?); its KV blocks would hold another policy's keys")


class AdapterSync(LoraSync):
    """lora_sync="adapter": each version is a PEFT adapter directory under ``scratch_dir``,
    registered with the engine as a LoRARequest; the previous one and its files are retired."""

    capabilities = SYNC_MODES["adapter"]

    def __init__(self, llm, model_dir: str, scratch_dir: Path):
        super().__init__(llm, model_dir, scratch_dir)
        self._held: dict[int, Any] = {}  # version -> its vllm LoRARequest, ascending
        self.capacity = int(llm.llm_engine.vllm_config.lora_config.max_loras)

    @classmethod
    def engine_args(cls, lora_r: int, versions: int = 1) -> dict[str, Any]:
        args = dict(enable_lora=True, max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= lora_r),
                    max_loras=int(versions))
        if versions > 1:  # room to register the next version before the oldest is retired
            args["max_cpu_loras"] = int(versions) + 1
        return args

    @classmethod
    def check_engine(cls, llm) -> None:
        if llm.llm_engine.vllm_config.lora_config is None:
            raise ValueError("the vLLM engine was built without enable_lora=True: it cannot take adapters")

    @property
    def lora_request(self):
        return self._held[max(self._held)] if self._held else None

    @property
    def versions(self) -> list[int]:
        return sorted(self._held)

    def request(self, version: int):
        if version not in self._held:
            raise KeyError(f"adapter version {version} is not held (held: {self.versions})")
        return self._held[version]

    def retire(self, versions: list[int]) -> None:
        for v in [v for v in versions if v in self._held]:
            self._retire(self._held.pop(v))

    def check_rank(self, r: int) -> None:
        max_rank = self.llm.llm_engine.vllm_config.lora_config.max_lora_rank
        if r > max_rank:
            raise ValueError(f"the adapter's lora_r={r} is above the engine's max_lora_rank={max_rank}")

    def load(self, version: int, weights: LoraWeights) -> SyncReport:
        """Write the adapter (safetensors + adapter_config.json), register it (add_lora: the
        worker reads and validates it now), retire the previous one and its files."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        path = Path(tempfile.mkdtemp(prefix=f"v{version}_", dir=self.scratch_dir))
        try:
            write_lora_adapter(path, weights, base_model=self.model_dir)
            t1 = time.perf_counter()
            lora_id = next(_LORA_IDS)
            request = LoRARequest(f"v{version}-{lora_id}", lora_id, str(path))
            # Load now (not lazily at the next generate), so a broken adapter fails here.
            if not self.llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vLLM did not register adapter v{version} (lora id {request.lora_int_id} taken?)")
        except Exception as e:
            shutil.rmtree(path, ignore_errors=True)
            raise RuntimeError(f"loading LoRA adapter version {version} into vLLM failed: {e}") from e
        t2 = time.perf_counter()
        self._make_current(request, version)
        t3 = time.perf_counter()
        return SyncReport(version=version, write_s=t1 - t0, register_s=t2 - t1, retire_s=t3 - t2,
                          nbytes=float(weights.nbytes))

    def _make_current(self, request, version: int) -> None:
        """`request` (registered) is held as `version`, replacing an earlier registration of that
        version; beyond the capacity the oldest versions are retired (one version alive: the
        previous one). The prefix cache is reset."""
        if version in self._held:
            self._retire(self._held.pop(version))
        self._held[version] = request
        for old in [v for v in sorted(self._held) if v != version][:max(0, len(self._held) - self.capacity)]:
            self._retire(self._held.pop(old))
        self.reset_prefix_cache(version)

    def _retire(self, request) -> None:
        # The LRU cache may already have evicted it (max_loras=1): the return value is moot.
        self.llm.llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def close(self) -> None:
        self.retire(list(self._held))


class TensorSync(AdapterSync):
    """lora_sync="tensor": each version a vLLM adapter registered from the learner's tensors in
    the worker (actors.vllm_lora.TensorLoRAWorker), nothing on disk; requests name it by a
    LoRARequest whose id is registered (its path is never read). The previous one is retired."""

    capabilities = SYNC_MODES["tensor"]

    @classmethod
    def engine_args(cls, lora_r: int, versions: int = 1) -> dict[str, Any]:
        return dict(AdapterSync.engine_args(lora_r, versions), worker_extension_cls=TENSOR_WORKER)

    @classmethod
    def check_engine(cls, llm) -> None:
        AdapterSync.check_engine(llm)
        if llm.llm_engine.vllm_config.parallel_config.worker_extension_cls != TENSOR_WORKER:
            raise ValueError(f"lora_sync='tensor' needs an engine built with worker_extension_cls={TENSOR_WORKER!r}")

    def load(self, version: int, weights: LoraWeights) -> SyncReport:
        """Register the tensors in the worker(s) (validated there as a file would be), retire
        the previous adapter, reset the prefix cache."""
        import json

        from vllm.lora.request import LoRARequest

        from actors.vllm_lora import NO_PATH
        from actors.vllm_merge import pack_tensors

        t0 = time.perf_counter()
        lora_id = next(_LORA_IDS)  # the name, with the path part of the prefix-cache key: one per registration
        request = LoRARequest(f"v{version}-{lora_id}", lora_id, NO_PATH)
        # adapter_config.json's content, as vLLM would read it (sets as lists)
        config = json.loads(json.dumps(weights.spec.peft_config(self.model_dir).to_dict(), default=sorted))
        try:
            loaded = self.llm.collective_rpc("ppo_add_lora", args=(request.lora_int_id, pack_tensors(weights.tensors),
                                                                   config))
            if not all(loaded):
                raise RuntimeError(f"vLLM did not register adapter v{version} (lora id {request.lora_int_id})")
        except Exception as e:
            self.llm.llm_engine.remove_lora(request.lora_int_id)  # a worker that took it before another failed
            raise RuntimeError(f"loading LoRA adapter version {version} into vLLM from memory failed: {e}") from e
        t1 = time.perf_counter()
        self._make_current(request, version)
        t2 = time.perf_counter()
        return SyncReport(version=version, write_s=0.0, register_s=t1 - t0, retire_s=t2 - t1,
                          nbytes=float(weights.nbytes))

    def _retire(self, request) -> None:
        self.llm.llm_engine.remove_lora(request.lora_int_id)  # nothing on disk


class MergedSync(LoraSync):
    """lora_sync="merged": W = W0 + (alpha / r) B A into the engine's weights (actors.vllm_merge);
    generation then samples with the engine's own weights (no LoRARequest). The engine is this
    generator's alone."""

    capabilities = SYNC_MODES["merged"]

    def __init__(self, llm, model_dir: str, scratch_dir: Path):
        super().__init__(llm, model_dir, scratch_dir)
        self._version: Optional[int] = None  # the merged version; None until the first load

    @classmethod
    def engine_args(cls, lora_r: int, versions: int = 1) -> dict[str, Any]:
        if versions > 1:
            raise ValueError(f"lora_sync='merged' holds one adapter version, not {versions} (max_staleness "
                             f"{versions - 1}): use adapter or tensor")
        return dict(worker_extension_cls=MERGED_WORKER)  # base-model kernels; the LoRA is merged into the weights

    @property
    def versions(self) -> list[int]:
        return [] if self._version is None else [self._version]

    @classmethod
    def check_engine(cls, llm) -> None:
        if llm.llm_engine.vllm_config.parallel_config.worker_extension_cls != MERGED_WORKER:
            raise ValueError(f"lora_sync='merged' needs an engine built with worker_extension_cls={MERGED_WORKER!r}")

    def load(self, version: int, weights: LoraWeights) -> SyncReport:
        """Merge in the engine's worker(s), from the kept base weights (nothing drifts)."""
        t0 = time.perf_counter()
        try:
            from actors.vllm_merge import pack_tensors

            self.llm.collective_rpc("ppo_merge_lora",
                                    args=(pack_tensors(weights.tensors), weights.spec.scaling, self.model_dir))
        except Exception as e:
            raise RuntimeError(f"merging LoRA adapter version {version} into the vLLM weights failed: {e}") from e
        t1 = time.perf_counter()
        self._version = version
        self.reset_prefix_cache(version)
        return SyncReport(version=version, write_s=0.0, register_s=t1 - t0, retire_s=time.perf_counter() - t1,
                          nbytes=float(weights.nbytes))
