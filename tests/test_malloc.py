"""cpu_malloc_keep's glibc settings in a real process: what a CPU-only actor keeps of the memory
it frees (for the next micro-batch, without faulting pages in again) and what it gives back.

Each check runs a fresh Python with the environment an actor of a CPU-only run gets
(ppo_ray.driver.hosts.cpu_share_env) and drives glibc's malloc directly (ctypes, chunks of 8 MiB
in one array: no Python object lands between them), reading the kernel's counters (RssAnon,
minor page faults). The numbers come from the settings themselves (MALLOC_ENV); none is a
measured constant. Each run allocates at most the trim threshold plus 256 MiB, for a moment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ppo_ray.config import PPOConfig

MIB, GIB = 2 ** 20, 2 ** 30
CHUNK = 8 * MIB  # a micro-batch's activation-sized allocation, below the mmap threshold

# Allocates `n` chunks, touches them, frees them last to first (so they merge into the
# heap's top), then allocates and touches `m` chunks: RssAnon (bytes) after each part and the
# minor faults of the second allocation.
PROBE = textwrap.dedent("""
    import ctypes, json, resource, sys
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, n, m, big = (int(a) for a in sys.argv[1:5])
    def anon():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    chunks = (ctypes.c_void_p * max(n, m, 1))()
    out = {"base": anon()}
    for i in range(n):
        chunks[i] = libc.malloc(size)
        ctypes.memset(chunks[i], 1, size)
    out["peak"] = anon()
    for i in reversed(range(n)):
        libc.free(chunks[i])
    out["after_free"] = anon()
    f0 = faults()
    for i in range(m):
        chunks[i] = libc.malloc(size)
        ctypes.memset(chunks[i], 1, size)
    out["again_faults"] = faults() - f0
    for i in reversed(range(m)):
        libc.free(chunks[i])
    if big:  # one allocation of `big` bytes, touched, then freed
        p = libc.malloc(big)
        ctypes.memset(p, 1, big)
        out["big_peak"] = anon()
        libc.free(p)
        out["big_after"] = anon()
    print(json.dumps(out))
""")


def actor_env() -> dict[str, str]:
    """This process's environment without MALLOC_* variables, plus what a CPU-only run's
    learner actor gets (cpu_share_env, computed without the driver's own MALLOC_* values)."""
    from ppo_ray.driver import hosts

    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("MALLOC_")}
    try:
        env = hosts.cpu_share_env(PPOConfig(), "learner")
    finally:
        os.environ.update(saved)
    return {**base, **env}


def probe(env: dict[str, str], n: int, m: int = 0, big: int = 0) -> dict[str, int]:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(CHUNK), str(n), str(m), str(big)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def settings() -> tuple[dict[str, str], int, int, int]:
    """(the actor's environment, mmap threshold, trim threshold, top pad), bytes."""
    from ppo_ray.driver.hosts import MALLOC_ENV

    env = actor_env()
    assert {k: env[k] for k in MALLOC_ENV} == MALLOC_ENV
    return (env, int(MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]), int(MALLOC_ENV["MALLOC_TRIM_THRESHOLD_"]),
            int(MALLOC_ENV["MALLOC_TOP_PAD_"]))


def test_memory_freed_below_the_trim_threshold_is_reused_without_page_faults(settings):
    """The speed: a micro-batch's worth of memory (half the trim threshold here), freed, is
    kept, so allocating it again faults in (almost) no page: under 2% of its pages."""
    env, _mmap, trim, _pad = settings
    n = trim // 2 // CHUNK
    r = probe(env, n, m=n)
    assert r["after_free"] - r["base"] >= 0.9 * n * CHUNK, r  # kept
    assert r["again_faults"] < 0.02 * n * CHUNK / 4096, r  # reused: no new pages


def test_a_process_keeps_at_most_the_trim_threshold_at_the_top_of_its_heap(settings):
    """The bound: free memory at the heap's top beyond the trim threshold is given back (glibc
    trims the top to MALLOC_TOP_PAD_ whenever a free leaves more than the threshold there), so
    after freeing the threshold plus 256 MiB the process holds at most the threshold more than
    before (plus one chunk freed after the last trim, and a page-rounding MiB)."""
    env, _mmap, trim, _pad = settings
    n = (trim + 256 * MIB) // CHUNK
    r = probe(env, n)
    assert r["peak"] - r["base"] >= n * CHUNK - MIB, r
    assert r["after_free"] - r["base"] <= trim + CHUNK + MIB, r


def test_an_allocation_above_the_mmap_threshold_is_given_back_when_freed(settings):
    """A tensor of MALLOC_MMAP_THRESHOLD_ or more that the heap's free top cannot hold is
    mmapped and unmapped on free: it pins nothing (logits, an embedding matrix, a checkpoint's
    large tensors). (One that fits in the free top is carved from it, and its memory returns
    to the top, which the trim threshold bounds.) Here: twice the threshold plus twice the top
    pad, more than a fresh process's top holds."""
    env, mmap, _trim, pad = settings
    big = 2 * mmap + 2 * pad
    r = probe(env, 0, big=big)
    assert r["big_peak"] - r["base"] >= big - MIB, r  # touched (RssAnon counts whole pages)
    assert r["big_after"] - r["base"] <= MIB, r


def test_glibc_defaults_fault_the_same_memory_in_again():
    """The contrast the settings exist for (cpu_malloc_keep false): with glibc's defaults the
    same 512 MiB, freed, is given back and allocating it again faults every page in anew."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    n = 512 * MIB // CHUNK
    r = probe(env, n, m=n)
    assert r["again_faults"] >= 0.9 * n * CHUNK / 4096, r


# The node the CPU defaults are sized for (the development VM, docs: /work/shared/ENVIRONMENT.md),
# and the largest CPU run measured on it: the Qwen3 preset on the CPU in float32, its PPO
# stage's peak PSS summed over the run's processes (benchmarks/RESULTS.md, "cpu_malloc_keep's
# memory"; a sizing requirement, not a tolerance).
NODE_GIB = 24.0
LARGEST_CPU_RUN_GIB = 18.5


def test_what_the_actors_may_keep_at_their_heaps_tops_fits_beside_the_largest_cpu_run(settings):
    """Each actor of a CPU-only run may keep up to the trim threshold (and the top pad) free at
    the top of its heap: a longer batch or another prompt set than the measured run's can leave
    that much more in each. Together it must fit in what the largest measured CPU run leaves of
    a 24 GiB node (a 4 GiB threshold with a 256 MiB pad would not: 4 x 4.25 GiB)."""
    _env, _mmap, trim, pad = settings
    cfg = PPOConfig()
    actors = cfg.num_generators + 2 + cfg.num_learners  # generators, reference, reward, learners
    assert actors * (trim + pad) <= (NODE_GIB - LARGEST_CPU_RUN_GIB) * GIB, (actors, trim, pad)
