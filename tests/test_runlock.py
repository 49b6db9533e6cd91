"""ppo_ray/runlock.py: one writer per run directory.

Two drivers used to be able to `--resume auto` the same directory at once (a RayJob re-applied
while the old driver lived, a double submit): both appended to metrics.jsonl and one could
delete the other's in-flight checkpoint. The holders here are real processes: a Python
subprocess that takes the lock and waits, killed with SIGKILL as a lost driver would be.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import launch_ppo, snapshot
from ppo_ray import runlock
from ppo_ray.runlock import LOCK_NAME, RunLock, RunLockError

ROOT = Path(__file__).resolve().parent.parent
HOLD = """
import sys, time
from ppo_ray.runlock import RunLock
lock = RunLock.acquire(sys.argv[1], ["holder"])
print("held", flush=True)
time.sleep(600)
"""


def hold(run_dir: Path) -> subprocess.Popen:
    """A process that holds run_dir's lock until killed (returned once it holds it)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert proc.stdout.readline().strip() == "held", "the holder did not take the lock"
    return proc


def test_a_second_driver_fails_at_once_naming_the_holder(tmp_path):
    proc = hold(tmp_path)
    try:
        with pytest.raises(RunLockError) as e:
            RunLock.acquire(tmp_path)
        assert f"pid {proc.pid}" in str(e.value) and socket.gethostname() in str(e.value)
        assert "command: holder" in str(e.value)
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_drivers_lock_is_taken_over(tmp_path, caplog):
    """SIGKILL (a lost driver) leaves the lock file; its pid no longer runs, so the next driver
    takes it over, saying whose it was, and releases it at the end."""
    proc = hold(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (tmp_path / LOCK_NAME).is_file()
    with caplog.at_level("WARNING", logger="ppo_ray.runlock"):
        lock = RunLock.acquire(tmp_path)
    assert f"pid {proc.pid}" in caplog.text and "no longer running" in caplog.text
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_another_hosts_lock_is_stale_only_when_its_heartbeat_is_old(tmp_path):
    """A shared volume: the holder's pid means nothing here, its heartbeat (the file's mtime)
    does. A fresh one refuses; one older than STALE_S is taken over."""
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({"host": "another-pod", "boot_id": "x", "pid_ns": "y", "pid": 1, "pid_start": "1",
                                "since_text": "2026-11-28 10:00:00 UTC", "argv": ["ppo-ray", "--resume", "auto"],
                                "token": "theirs"}))
    with pytest.raises(RunLockError, match="another host .*another-pod.*heartbeat is 0 s old"):
        RunLock.acquire(tmp_path)
    old = time.time() - runlock.STALE_S - 5
    os.utime(path, (old, old))
    lock = RunLock.acquire(tmp_path)
    assert json.loads(path.read_text())["token"] == lock.info["token"]
    lock.release()


def test_the_lock_is_reentrant_within_a_process_and_released_by_the_outermost(tmp_path):
    outer = RunLock.acquire(tmp_path)
    inner = RunLock.acquire(tmp_path)  # launch.py holds it; the PPOTrainer it builds takes it too
    assert inner is outer
    inner.release()
    assert (tmp_path / LOCK_NAME).is_file()
    outer.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_launch_refuses_a_run_directory_in_use_and_changes_nothing(old_run, capsys, no_ray_address):
    """launch.py --resume auto while another driver holds the directory: exit 2 naming it,
    the run directory as it was."""
    proc = hold(old_run)
    try:
        def files():  # the holder's own lock file aside: its heartbeat touches it
            return {k: v for k, v in snapshot(old_run).items() if k != LOCK_NAME}

        before = files()
        assert launch_ppo(old_run, "--resume", "auto") == 2
        err = capsys.readouterr().err
        assert "in use by another driver" in err and f"pid {proc.pid}" in err
        assert files() == before
    finally:
        proc.kill()
        proc.wait()
