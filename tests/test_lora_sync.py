"""The LoRA sync modes' registry and classes (actors/lora_sync.py), without an engine: the
config's choices are the registry's names, an unknown mode is a clear error, each mode's
engine arguments are pinned, and the config names the modes without importing vLLM or torch.
The modes' loads against a real engine: tests/test_generator.py (adapter, tensor),
tests/test_vllm_merge.py (merged), tests/test_sync_check.py (both, in the trainer)."""

import inspect
import subprocess
import sys
from types import SimpleNamespace

import pytest

import actors.lora_sync
from actors.lora_sync import MERGED_WORKER, TENSOR_WORKER, AdapterSync, LoraSync, MergedSync, TensorSync, sync_class
from helpers import ROOT
from ppo_ray.config import LORA_SYNC_MODES, ConfigError, PPOConfig


def test_config_choices_are_the_registry_names():
    assert list(LORA_SYNC_MODES) == ["adapter", "merged", "tensor"]
    for name in LORA_SYNC_MODES:
        assert PPOConfig(lora_sync=name).lora_sync == name
        assert issubclass(sync_class(name), LoraSync)
    # every mode class in the module is registered under one name (a class added without its
    # registration line would be unreachable from the config)
    classes = {cls for _, cls in inspect.getmembers(actors.lora_sync, inspect.isclass)
               if issubclass(cls, LoraSync) and not inspect.isabstract(cls)}
    assert classes == {sync_class(name) for name in LORA_SYNC_MODES} == {AdapterSync, MergedSync, TensorSync}


def test_unknown_mode_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"'lora_sync' = 'nccl' is invalid: must be one of \['auto', 'adapter', 'merged', 'tensor'\]"):
        PPOConfig(lora_sync="nccl")
    with pytest.raises(ValueError, match=r"lora_sync: unknown mode 'nccl'; the modes are \['adapter', 'merged', 'tensor'\]"):
        sync_class("nccl")
    from actors.generator import Generator

    engine = SimpleNamespace(model_config=SimpleNamespace(logprobs_mode="processed_logprobs"))
    with pytest.raises(ValueError, match="unknown mode 'nccl'"):
        Generator(SimpleNamespace(llm_engine=engine), lora_sync="nccl")


def test_engine_args_of_each_mode():
    # adapter: vLLM's smallest max_lora_rank >= lora_r (ppo_ray.config.VLLM_LORA_RANKS), one adapter alive
    assert AdapterSync.engine_args(8) == dict(enable_lora=True, max_lora_rank=8, max_loras=1)
    assert AdapterSync.engine_args(9) == dict(enable_lora=True, max_lora_rank=16, max_loras=1)
    assert MergedSync.engine_args(8) == dict(worker_extension_cls=MERGED_WORKER)
    # tensor: adapter's, and the worker extension that registers an adapter from tensors
    assert TensorSync.engine_args(8) == dict(enable_lora=True, max_lora_rank=8, max_loras=1,
                                             worker_extension_cls=TENSOR_WORKER)


def test_each_mode_refuses_an_engine_built_for_another():
    def engine(lora_config, extension):
        return SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(
            lora_config=lora_config, parallel_config=SimpleNamespace(worker_extension_cls=extension))))

    for_adapter, for_merged = engine(SimpleNamespace(max_lora_rank=16), ""), engine(None, MERGED_WORKER)
    for_tensor = engine(SimpleNamespace(max_lora_rank=16), TENSOR_WORKER)
    AdapterSync.check_engine(for_adapter)
    AdapterSync.check_engine(for_tensor)  # the extension changes nothing for the file path
    MergedSync.check_engine(for_merged)
    TensorSync.check_engine(for_tensor)
    with pytest.raises(ValueError, match="lora_sync='tensor' needs an engine built with worker_extension_cls"):
        TensorSync.check_engine(for_adapter)
    with pytest.raises(ValueError, match="without enable_lora=True"):
        TensorSync.check_engine(engine(None, TENSOR_WORKER))
    with pytest.raises(ValueError, match="without enable_lora=True"):
        AdapterSync.check_engine(for_merged)
    with pytest.raises(ValueError, match="lora_sync='merged' needs an engine built with worker_extension_cls"):
        MergedSync.check_engine(for_adapter)


def test_config_names_the_modes_without_heavy_imports():
    """The config names the sync modes without importing vLLM or the actors (it imports torch
    through the registries of the PPO math, learner.algos and learner.losses)."""
    code = ("import sys, ppo_ray.config; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'actors')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
