"""SIGTERM (what `ray job stop` sends the driver) and SIGINT (Ctrl-C) unwind launch.py once Ray is up.

ray.init installs its own SIGTERM handler (sys.exit(15), after the core worker prints a stack),
replacing launch.py's; on 2026-11-27 a SIGTERM during the PPO stage aborted the driver (exit -6)
instead of exit 130 with the resume hint (found by benchmarks/qwen3_preset_cpu.py's time limit).
ppo_ray.driver.cluster.init_ray now puts a caller's handlers back. (One Ctrl-C to a launch.py that
inherited SIGINT ignored: tests/test_launch.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from helpers import RUN_MARKER, tagged_processes, wait_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.heavy("starts Ray in a subprocess")
def test_init_ray_keeps_the_callers_stop_handlers(tmp_path):
    """In a fresh process started with SIGINT ignored (as `launch.py &` from a script is):
    inside ppo_ray.driver.interrupts.stop_on_signals, the handlers of SIGINT and SIGTERM are still
    its handler after init_ray, and each signal then raises KeyboardInterrupt; on the way
    out the inherited dispositions are back."""
    script = textwrap.dedent("""
        import os, signal
        from ppo_ray.driver.cluster import init_ray
        from ppo_ray.driver.interrupts import stop_on_signals
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        with stop_on_signals():
            handler = signal.getsignal(signal.SIGINT)
            init_ray()
            for s in (signal.SIGINT, signal.SIGTERM):
                assert signal.getsignal(s) is handler, (s, signal.getsignal(s))
                try:
                    os.kill(os.getpid(), s)  # the handler runs before the next statement
                    raise SystemExit(f"{s!r} did not raise KeyboardInterrupt")
                except KeyboardInterrupt:
                    print("unwound", s.name)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    """)
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.split()[-4:] == ["unwound", "SIGINT", "unwound", "SIGTERM"], proc.stdout[-2000:]


@pytest.mark.slow
def test_sigterm_during_ppo_exits_130_with_the_checkpoint_and_stops_ray(tmp_path):
    """launch.py ppo on the tiny preset, SIGTERM to the driver alone after its first checkpoint:
    exit 130, the resume hint naming the checkpoint, and none of its processes left."""
    tag = uuid.uuid4().hex
    run = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": "", RUN_MARKER: tag}
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
