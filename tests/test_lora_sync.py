"""The LoRA sync modes' registry and classes (actors/lora_sync.py), without an engine: the
config's choices are the registry's names, an unknown mode is a clear error, each mode's
engine arguments are pinned, and the config names the modes without importing vLLM or torch;
each class carries its registry entry's capabilities (ppo_ray/config/sync_modes.py), which the
config, the generator and the driver ask instead of testing a mode by its name (a scan of the
source shows none does).
The modes' loads against a real engine: tests/test_generator.py (adapter, tensor),
tests/test_vllm_merge.py (merged), tests/test_sync_check.py (both, in the trainer)."""

import ast
import inspect
import subprocess
import sys
from types import SimpleNamespace

import pytest

import actors.lora_sync
from actors.lora_sync import MERGED_WORKER, TENSOR_WORKER, AdapterSync, LoraSync, MergedSync, TensorSync, sync_class
from helpers import ROOT
from ppo_ray.config import LORA_SYNC_MODES, MAX_STALENESS, SYNC_MODES, ConfigError, PPOConfig, modes_with, sync_mode


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


# -------------------------------------------------- capabilities
def test_each_mode_class_carries_its_registry_entry():
    """One source of truth: a mode's class names its own entry of ppo_ray.config.SYNC_MODES, and
    the entry names that class."""
    assert list(SYNC_MODES) == list(LORA_SYNC_MODES)
    for name, entry in SYNC_MODES.items():
        cls = sync_class(name)
        assert cls.capabilities is entry and entry.name == name
        assert entry.cls == LORA_SYNC_MODES[name] == f"{cls.__module__}:{cls.__name__}"


def test_the_capabilities_of_each_mode():
    merged, adapter, tensor = (sync_mode(name) for name in ("merged", "adapter", "tensor"))
    for k in range(4):
        assert merged.versions_alive(k) == 1
        assert adapter.versions_alive(k) == tensor.versions_alive(k) == k + 1
        assert merged.oldest_kept(10, k) == 10  # merged weights: the loaded version only
        assert adapter.oldest_kept(10, k) == tensor.oldest_kept(10, k) == 10 - k
    assert merged.max_staleness_limit == 1 and adapter.max_staleness_limit is tensor.max_staleness_limit is None
    assert not merged.streams and adapter.streams and tensor.streams
    assert not merged.dynamic_sampling_with_staleness and adapter.dynamic_sampling_with_staleness
    assert modes_with("several_versions") == modes_with("streams") == ["adapter", "tensor"]
    with pytest.raises(ValueError, match=r"lora_sync: unknown mode 'nccl'; the modes are \['adapter', 'merged', 'tensor'\]"):
        sync_mode("nccl")


def test_every_max_staleness_the_config_allows_has_an_engine():
    """The versions a mode says are alive are what its engine arguments accept, for every
    max_staleness the config lets it run with (merged refuses more than one version)."""
    for name in SYNC_MODES:
        mode = sync_class(name)
        for k in range(MAX_STALENESS + 1):
            allowed = True
            try:
                PPOConfig(lora_sync=name, max_staleness=k)
            except ConfigError:
                allowed = False
            limit = mode.capabilities.max_staleness_limit
            assert allowed == (limit is None or k <= limit), (name, k)
            if allowed:
                versions = mode.capabilities.versions_alive(k)
                assert mode.engine_args(8, versions=versions).get("max_loras", 1) == versions
    with pytest.raises(ValueError, match="holds one adapter version, not 2"):
        MergedSync.engine_args(8, versions=2)


def test_the_config_asks_the_capabilities():
    """streams_rollouts, the max_staleness limit and dynamic sampling under staleness follow the
    resolved mode's capabilities (auto resolves to merged on the CPU, tensor when several
    versions must be alive); the errors name the modes that would do."""
    assert PPOConfig(max_staleness=1).sync_capabilities is SYNC_MODES["merged"]
    assert not PPOConfig(max_staleness=1).streams_rollouts
    assert PPOConfig(max_staleness=1, lora_sync="tensor").streams_rollouts
    assert not PPOConfig(lora_sync="tensor").streams_rollouts  # max_staleness 0: nothing in flight
    assert PPOConfig(max_staleness=2).sync_capabilities is SYNC_MODES["tensor"]
    with pytest.raises(ConfigError, match="'max_staleness' = 2 is invalid: needs lora_sync adapter or tensor above 1: "
                                          "merged weights hold one adapter version, and max_staleness 2 keeps 3 alive"):
        PPOConfig(max_staleness=2, lora_sync="merged")
    with pytest.raises(ConfigError, match=r"with max_staleness 1 needs lora_sync adapter or tensor \(got merged\)"):
        PPOConfig(max_staleness=1, lora_sync="merged", dynamic_sampling=True, samples_per_prompt=2)
    PPOConfig(max_staleness=1, lora_sync="adapter", dynamic_sampling=True, samples_per_prompt=2)


# -------------------------------------------------- no mode tested by name outside its class
# The product's source (benchmarks/ pick their measured rows by the mode's name for a table: data, not a rule).
MODE_SOURCES = ("launch.py", "ppo_ray", "actors", "learner")


def named_mode_tests(path, rel: str) -> list[str]:
    """"file:line: source" of every comparison (==, !=, in, not in) between a sync mode's name
    (a string of SYNC_MODES, alone or in a tuple, list or set) and an expression that speaks of
    a sync mode (its source holds "sync": config.lora_sync_mode, a lora_sync argument)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]

        def names_a_mode(e) -> bool:
            if isinstance(e, ast.Constant):
                return e.value in SYNC_MODES
            return isinstance(e, (ast.Tuple, ast.List, ast.Set)) and any(names_a_mode(x) for x in e.elts)

        if any(names_a_mode(e) for e in operands) and any(
                "sync" in ast.unparse(e) for e in operands if not names_a_mode(e)):
            out.append((node.lineno, f"{rel}:{node.lineno}: {ast.unparse(node)}"))
    return [hit for _, hit in sorted(out)]


def mode_tests_in(root) -> list[str]:
    files = [root / "launch.py", *(p for d in MODE_SOURCES[1:] for p in sorted((root / d).rglob("*.py")))]
    return [hit for p in files for hit in named_mode_tests(p, p.relative_to(root).as_posix())
            if not hit.startswith("actors/lora_sync.py:")]


def test_no_sync_mode_is_tested_by_name_outside_its_class():
    """What a mode can do is asked of its capabilities (ppo_ray.config.SyncCapabilities), never
    read from its name: a new mode is then one class and one registry entry. export's
    `kind == "merged"` (an export kind) and the learner's `_lora_kernel == "merged"` (a kernel)
    are not sync modes and are not found."""
    assert mode_tests_in(ROOT) == []


def test_the_scan_finds_a_mode_tested_by_name(tmp_path):
    """Not vacuous: the comparisons the code had before the capabilities, planted in a copy of
    a module, are each found, with their file and line."""
    planted = tmp_path / "ppo_ray" / "planted.py"
    planted.parent.mkdir()
    planted.write_text("def f(self, cfg, lora_sync):\n"
                       "    a = self.config.lora_sync_mode == 'merged'\n"
                       "    b = lora_sync != \"merged\"\n"
                       "    c = cfg.lora_sync_mode in ('adapter', 'tensor')\n"
                       "    d = kind == 'merged'\n")
    (tmp_path / "launch.py").write_text("")
    for d in MODE_SOURCES[2:]:
        (tmp_path / d).mkdir()
    found = mode_tests_in(tmp_path)
    assert found == ["ppo_ray/planted.py:2: self.config.lora_sync_mode == 'merged'",
                     "ppo_ray/planted.py:3: lora_sync != 'merged'",
                     "ppo_ray/planted.py:4: cfg.lora_sync_mode in ('adapter', 'tensor')"], found
