"""ppo_ray/driver/runlock.py: one writer per run directory.

Two drivers used to be able to `--resume auto` the same directory at once (a RayJob re-applied
while the old driver lived, a double submit): both appended to metrics.jsonl and one could
delete the other's in-flight checkpoint. The holders here are real processes: a Python
subprocess that takes the lock and waits, killed with SIGKILL as a lost driver would be.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import launch_ppo, snapshot, wait_for
from ppo_ray.driver import runlock
from ppo_ray.driver.runlock import LOCK_NAME, RunLock, RunLockError, RunLockLost

ROOT = Path(__file__).resolve().parent.parent
HOLD = """
import sys, time
from ppo_ray.driver.runlock import RunLock
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
    with caplog.at_level("WARNING", logger="ppo_ray.driver.runlock"):
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


# --------------------------------------------------------------------------- holding it
OTHER_HOLDER = {"host": "another-pod", "boot_id": "x", "pid_ns": "y", "pid": 7, "pid_start": "1",
                "since_text": "2026-12-01 09:00:00 UTC", "argv": ["ppo-ray", "--resume", "auto"], "token": "theirs"}


def take_over(path: Path) -> None:
    """What another host's driver leaves once it has taken the lock over: its own lock file."""
    path.write_text(json.dumps(OTHER_HOLDER))


@pytest.fixture
def quick_heartbeat(monkeypatch):
    """A heartbeat every 10 ms (read at every beat: the semantics of HEARTBEAT_S kept)."""
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.01)


def test_the_heartbeat_survives_transient_errors_and_keeps_the_lock_fresh(tmp_path, monkeypatch, quick_heartbeat):
    """NFS: a read of the lock file or a touch of it fails now and then (ESTALE, EIO). Each
    failure is tried again at the next beat; none ends the heartbeat or counts as a lost lock,
    and the file stays fresh (an aged heartbeat is what lets another host take the lock over)."""
    path = (tmp_path / LOCK_NAME).resolve()
    left = {"read": 3, "utime": 3}
    read_text, utime = Path.read_text, os.utime

    def failing(kind: str, target) -> bool:
        if threading.current_thread().name == "ppo-ray-run-lock" and Path(target) == path and left[kind]:
            left[kind] -= 1
            return True
        return False

    def flaky_read(self, *args, **kwargs):
        if failing("read", self):
            raise OSError(errno.ESTALE, "Stale file handle", str(self))
        return read_text(self, *args, **kwargs)

    def flaky_utime(target, *args, **kwargs):
        if failing("utime", target):
            raise OSError(errno.EIO, "Input/output error", str(target))
        return utime(target, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", flaky_read)
    monkeypatch.setattr(os, "utime", flaky_utime)
    lock = RunLock.acquire(tmp_path)
    try:
        wait_for(lambda: not any(left.values()), 60, "the heartbeat's reads and touches through the injected errors")
        old = time.time() - 3600
        utime(path, (old, old))  # an hour old: only a heartbeat after the errors makes it fresh again
        wait_for(lambda: time.time() - path.stat().st_mtime < runlock.STALE_S, 60, "a heartbeat after the errors")
        assert lock._thread.is_alive() and lock.lost is None
        lock.check(read=True)  # still this driver's
        assert json.loads(read_text(path))["token"] == lock.info["token"]
    finally:
        lock.release()
    assert not path.exists()


def test_a_failed_read_before_a_checkpoint_is_not_a_loss(tmp_path, monkeypatch):
    lock = RunLock.acquire(tmp_path)
    try:
        def broken(self, *args, **kwargs):
            raise OSError(errno.ESTALE, "Stale file handle", str(self))

        with monkeypatch.context() as m:
            m.setattr(Path, "read_text", broken)
            lock.check(read=True)
        assert lock.lost is None
    finally:
        lock.release()


@pytest.mark.parametrize("how", ["taken over", "removed"])
def test_a_lock_taken_over_or_removed_is_lost_and_the_next_write_stops(tmp_path, quick_heartbeat, how):
    """Another driver's lock file (another token) or none at all: the heartbeat records the loss
    and ends, and check() (the trainer's, before each metrics line and checkpoint) raises
    RunLockLost naming the lock file and who holds it now. The other driver's file is left to it."""
    path = tmp_path / LOCK_NAME
    lock = RunLock.acquire(tmp_path)
    try:
        if how == "taken over":
            take_over(path)
        else:
            path.unlink()
        wait_for(lambda: lock.lost is not None, 60, "the heartbeat finding the lock lost")
        lock._thread.join(60)
        assert not lock._thread.is_alive()
        with pytest.raises(RunLockLost) as e:
            lock.check()
        message = str(e.value)
        assert str(path.resolve()) in message and "nothing more was written" in message
        assert ("another-pod" in message and "pid 7" in message) if how == "taken over" else "gone" in message
        assert isinstance(e.value, RunLockError)
    finally:
        lock.release()
    if how == "taken over":
        assert json.loads(path.read_text())["token"] == "theirs"


def test_a_checkpoints_read_finds_a_loss_the_heartbeat_has_not_seen_yet(tmp_path, monkeypatch):
    """The read before a checkpoint does not wait for the heartbeat (here: none within the test)."""
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 3600.0)
    path = tmp_path / LOCK_NAME
    lock = RunLock.acquire(tmp_path)
    try:
        take_over(path)
        lock.check()  # without a read: what the heartbeat knows (nothing yet)
        with pytest.raises(RunLockLost, match="another-pod"):
            lock.check(read=True)
        with pytest.raises(RunLockLost):  # recorded: every later check raises without reading
            lock.check()
    finally:
        lock.release()


def test_a_trainer_whose_lock_is_taken_over_writes_no_metrics_line_or_checkpoint(tiny_trainer, tmp_path,
                                                                                   quick_heartbeat):
    """A real trainer (Ray, vLLM, the learner) in a run directory. Another driver takes its lock
    over during a step (here: in the step's evaluation, after the step committed and before its
    metrics line): the heartbeat finds it, the metrics line of that step is not written (train()
    raises RunLockLost), and a checkpoint asked for afterwards (its own read of the lock file)
    raises too and writes nothing."""
    from ppo_ray.data import bundled_prompts

    run_dir = tmp_path / "run"
    lock = RunLock.acquire(run_dir)
    metrics = run_dir / "metrics.jsonl"
    tiny_trainer.run_dir, tiny_trainer._lock = run_dir, lock

    def evaluate(trainer, step: int) -> dict:
        take_over(run_dir / LOCK_NAME)
        wait_for(lambda: lock.lost is not None, 60, "the heartbeat finding the lock taken over")
        return {}

    try:
        with pytest.raises(RunLockLost, match="another-pod"):
            tiny_trainer.train(bundled_prompts()[:16], steps=1, progress=False, metrics_path=metrics,
                               evaluate=evaluate)
        assert not metrics.exists() or not metrics.read_text().strip()
        with pytest.raises(RunLockLost, match="nothing more was written"):
            tiny_trainer.save_checkpoint()
        assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
        assert json.loads((run_dir / LOCK_NAME).read_text())["token"] == "theirs"
    finally:
        tiny_trainer.run_dir, tiny_trainer._lock = None, None
        lock.release()
