"""SIGTERM (what `ray job stop` sends the driver) unwinds launch.py like Ctrl-C once Ray is up.

ray.init installs its own SIGTERM handler (sys.exit(15), after the core worker prints a stack),
replacing launch.py's; on 2026-11-27 a SIGTERM during the PPO stage aborted the driver (exit -6)
instead of exit 130 with the resume hint (found by benchmarks/qwen3_preset_cpu.py's time limit).
ppo_ray.placement.init_ray now puts a caller's handler back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKER = "PPO_RAY_SIGTERM_TEST"  # tags the launch's processes (Ray's workers inherit it)


def wait_for(condition, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s} s")
        time.sleep(0.5)


def tagged_processes(tag: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"{MARKER}={tag}".encode() in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def test_init_ray_keeps_the_callers_sigterm_handler(tmp_path):
    """In a fresh process: a handler installed before init_ray is the handler after it, and a
    SIGTERM then raises the caller's KeyboardInterrupt."""
    script = textwrap.dedent("""
        import os, signal, sys
        def interrupt(signum, frame):
            raise KeyboardInterrupt(signum)
        signal.signal(signal.SIGTERM, interrupt)
        from ppo_ray.placement import init_ray
        init_ray()
        assert signal.getsignal(signal.SIGTERM) is interrupt, signal.getsignal(signal.SIGTERM)
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next statement
            raise SystemExit("SIGTERM did not raise the caller's KeyboardInterrupt")
        except KeyboardInterrupt:
            print("unwound")
    """)
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("unwound"), proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.slow
def test_sigterm_during_ppo_exits_130_with_the_checkpoint_and_stops_ray(tmp_path):
    """launch.py ppo on the tiny preset, SIGTERM to the driver alone after its first checkpoint:
    exit 130, the resume hint naming the checkpoint, and none of its processes left."""
    tag = uuid.uuid4().hex
    run = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": "", MARKER: tag}
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "ppo", "--config", "tiny", "--run_dir", str(run),
                             "--steps", "50", "--checkpoint_every", "1", "--batch_size", "4", "--micro_batch_size", "4"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (run / "checkpoints" / "latest").is_file(), 600, "first checkpoint", proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "[ppo-ray] interrupted: the last checkpoint is" in err and f"--resume {run}" in err
    wait_for(lambda: not tagged_processes(tag), 120, "exit of Ray's processes")
