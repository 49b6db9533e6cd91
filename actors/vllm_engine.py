"""The one place that builds a vLLM engine.

``build_llm(model_dir, ...)`` returns a ``vllm.LLM`` with settings that work on the
CPU-only development/CI machines and sane ones on a GPU. vLLM is imported lazily
inside the function, so importing this module is cheap and has no side effects.

vLLM starts its engine core and worker as *spawned* processes: build the engine
inside a function, a fixture, a Ray actor or under ``if __name__ == "__main__":``,
never at import time of a module that a spawned child re-imports.

Settings and why (see also /work/shared/ENVIRONMENT.md):

``dtype="float32"``
    The learner scores tokens in float32; the generator then returns the same
    logprobs (matched to ~1e-6 on the CPU). ``"bfloat16"`` is faster on CPUs with
    AVX512-BF16 and on GPUs, at the cost of generator/learner logprob agreement.
``logprobs_mode="processed_logprobs"``
    ``SamplingParams(logprobs=0)`` then returns the log-probability of the sampled
    token under the distribution it was actually sampled from (after temperature
    and any top-k/top-p; vLLM's own default ``raw_logprobs`` is before them). For
    an all-greedy batch (temperature 0) vLLM returns plain ``log_softmax(logits)``
    (temperature treated as 1). With top-k/top-p the processed logprobs are
    renormalised over the kept tokens, so a PPO learner must then apply the same
    truncation (or sample with temperature only).
``enforce_eager=None`` (config.vllm_enforce_eager)
    None = eager on the CPU, graphs on a GPU. Eager: no torch.compile/CUDA-graph capture,
    a much faster engine start, and on the CPU (no CUDA graphs there; LoRA forces eager
    mode anyway) the tested path. On a GPU, CUDA graphs are a large part of vLLM's decode
    speed for small models, at the cost of a slower start (capture); ``True`` forces eager.
``kv_cache_gib``
    Passed as ``kv_cache_memory_bytes`` (works on CPU and GPU). On the CPU the
    default (unless ``VLLM_CPU_KVCACHE_SPACE`` is set, which then wins) is what the
    model needs for ``max_num_seqs`` (256) full-length sequences, read from its
    ``config.json``, capped at ``CPU_MAX_DEFAULT_KV_CACHE_GIB`` (2 GiB): 0.25 GiB for
    the tiny test model. vLLM's own default (``gpu_memory_utilization=0.92`` of
    *host* memory) fails at start on a shared machine; an explicit size also lets
    the eager CPU worker skip its warm-up pass; and a small cache starts faster
    (measured: 2 GiB adds ~3 s to the engine start on 2 cores, 0.25 GiB ~0.1 s). On a GPU the default is
    ``gpu_memory_utilization=GPU_DEFAULT_MEMORY_UTILIZATION`` (0.5: leaves room for a
    learner on the same card; pass ``gpu_memory_utilization=0.9`` for a dedicated one).
CPU thread binding
    vLLM's default (``VLLM_CPU_OMP_THREADS_BIND=auto``) reserves a core for its
    scheduler process and uses one hyper-thread per physical core, which on a
    2-core machine leaves the model one thread. Binding the worker's OpenMP threads
    to all CPUs this process may run on measured ~1.5x faster generation (5.0 s ->
    3.3 s for 64x53 tokens on the 25M model). Done only when the variable is not
    already set (set ``VLLM_CPU_OMP_THREADS_BIND`` yourself, e.g. per Ray actor, to
    override; ``nobind`` disables binding). The variable is set only while the
    engine starts, then restored. It reaches only an engine whose worker runs in a spawned
    process (vLLM 0.32 applies it when it spawns the worker): an in-process engine (below)
    computes on its process's own torch threads, which its caller sets before building it
    (ppo_ray.driver.hosts.GeneratorHost: the CPU rule; with Ray's OMP_NUM_THREADS=1 the 25M
    model's generation took 2.87 s for 64x76 tokens, with 2 threads 1.93 s).
The engine core's process
    vLLM's default is kept here: the V1 engine core (and on the CPU its worker) run in
    spawned processes. ppo_ray.driver.creation starts a CPU-only generator actor with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` instead (unless the driver's environment sets it),
    so its engine core runs in the actor's own process. Measured on the 2-core VM
    (``benchmarks.generate_cpu``, the tiny model, 64 prompts x 16 tokens): ``generate``
    0.33-0.34 s -> 0.18-0.23 s, engine start 21-22 s -> 4 s; in the trainer 45 -> 22 s of
    start. Not the default for every caller, because in-process vLLM changes its process:
    after binding its threads the CPU worker makes ``torch.set_num_threads`` a no-op, and it
    seeds the global random generators. That is harmless in an actor that only generates,
    and wrong in a test session or a script that also trains.
``enable_lora`` / ``max_lora_rank`` / ``max_loras``
    Needed to serve PEFT adapters with ``LoRARequest``. An engine built with LoRA
    enabled gives the same outputs as without when no adapter is requested.
``seed``
    Engine seed (per-request seeds go in ``SamplingParams(seed=...)``).
``**extra``
    Passed to ``vllm.LLM`` unchanged and override everything above.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["CPU_MAX_DEFAULT_KV_CACHE_GIB", "GPU_DEFAULT_MEMORY_UTILIZATION", "build_llm", "cpu_bind_list",
           "resolve_enforce_eager"]

CPU_MAX_DEFAULT_KV_CACHE_GIB = 2.0
_CPU_DEFAULT_MAX_NUM_SEQS = 256  # vLLM's CPU default for the LLM class
GPU_DEFAULT_MEMORY_UTILIZATION = 0.5

_GIB = 1 << 30


def resolve_enforce_eager(enforce_eager: bool | None, on_cpu: bool) -> bool:
    """vLLM's enforce_eager: an explicit choice as given; None = eager on the CPU, CUDA graphs
    (False) on a GPU."""
    return on_cpu if enforce_eager is None else bool(enforce_eager)


def cpu_bind_list() -> str:
    """This process's allowed CPUs as a vLLM id list, e.g. ``"0-1"`` or ``"0-3,8"``."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = list(range(os.cpu_count() or 1))
    ranges: list[str] = []
    start = prev = cpus[0]
    for c in cpus[1:] + [None]:  # type: ignore[list-item]
        if c is not None and c == prev + 1:
            prev = c
            continue
        ranges.append(f"{start}-{prev}" if prev != start else f"{start}")
        if c is not None:
            start = prev = c
    return ",".join(ranges)


def _default_cpu_kv_cache_bytes(model_dir: str | os.PathLike, dtype: str, max_model_len: int | None, max_num_seqs: int) -> int:
    """KV bytes for ``max_num_seqs`` sequences of ``max_model_len`` tokens (capped)."""
    cap = int(CPU_MAX_DEFAULT_KV_CACHE_GIB * _GIB)
    try:
        with open(os.path.join(os.fspath(model_dir), "config.json")) as f:
            cfg = json.load(f)
        cfg = cfg.get("text_config", cfg)
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        seq_len = int(max_model_len or cfg.get("max_position_embeddings") or 4096)
        name = dtype if dtype != "auto" else str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    except (OSError, ValueError, KeyError, TypeError):
        return cap
    itemsize = 4 if "32" in str(name) else 2
    per_token = 2 * layers * kv_heads * head_dim * itemsize  # K and V
    tokens = max_num_seqs * seq_len
    return min(cap, per_token * tokens + (64 << 20))


@contextlib.contextmanager
def _temporary_env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def build_llm(
    model_dir: str | os.PathLike,
    *,
    dtype: str = "float32",
    seed: int = 0,
    enable_lora: bool = False,
    max_lora_rank: int = 16,
    max_loras: int = 1,
    max_model_len: int | None = None,
    enforce_eager: bool | None = None,
    kv_cache_gib: float | None = None,
    logprobs_mode: str = "processed_logprobs",
    **extra: Any,
):
    """Build a ``vllm.LLM`` over a local HF model directory (see the module docstring).

    Returns the ``vllm.LLM``. ``max_model_len=None`` uses the model's
    ``max_position_embeddings``.
    """
    import vllm
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    kwargs: dict[str, Any] = {
        "model": os.fspath(model_dir),
        "dtype": dtype,
        "seed": seed,
        "enforce_eager": resolve_enforce_eager(enforce_eager, on_cpu),
        "logprobs_mode": logprobs_mode,
    }
    if max_model_len is not None:
        kwargs["max_model_len"] = int(max_model_len)
    if enable_lora:
        kwargs.update(enable_lora=True, max_lora_rank=int(max_lora_rank), max_loras=int(max_loras))

    env: dict[str, str] = {}
    if on_cpu:
        if kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * _GIB)
        elif not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = _default_cpu_kv_cache_bytes(
                model_dir, dtype, max_model_len, int(extra.get("max_num_seqs") or _CPU_DEFAULT_MAX_NUM_SEQS)
            )
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_list()
    else:
        if kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * _GIB)
        else:
            kwargs["gpu_memory_utilization"] = GPU_DEFAULT_MEMORY_UTILIZATION

    kwargs.update(extra)
    if "kv_cache_memory_bytes" in extra or "gpu_memory_utilization" in extra:
        # An explicit choice by the caller replaces the default of the other knob.
        if "kv_cache_memory_bytes" not in extra and kv_cache_gib is None:
            kwargs.pop("kv_cache_memory_bytes", None)
        if "gpu_memory_utilization" not in extra:
            kwargs.pop("gpu_memory_utilization", None)

    with _temporary_env(env):
        return vllm.LLM(**kwargs)
