"""One writer per run directory: an exclusive lock held for a driver's lifetime.

    with RunLock.acquire(run_dir):     # RunLockError naming the holder when another driver has it
        ...                            # plan, move aside, train, checkpoint, report

The lock is the file ``<run_dir>/.ppo-ray.lock``, created with O_EXCL (one creator wins,
on a local disk and on NFS alike) and holding who took it: host, pid, the pid's start time,
the boot id and PID namespace (so a reused pid or a rebooted node is not mistaken for the
holder), the time it was taken and the command. While held, a daemon thread touches the
file every HEARTBEAT_S seconds (the heartbeat). A read or a touch that fails (NFS ESTALE, EIO)
is tried again at the next beat: only a lock file that is gone or names another holder (another
token) means the lock is lost. The heartbeat records that, and the holder asks before it writes
(RunLock.check: the trainer before every metrics line and, reading the file once more, before
every checkpoint): a driver whose lock was taken over stops with RunLockLost, naming the lock
file and its holder now, and writes nothing more.

It is released on every exit the process survives (the context's end, an exception, Ctrl-C,
SIGTERM unwinding, the interpreter's exit). A driver that cannot release it (SIGKILL, a lost
node or pod) leaves it behind, stale, and the next driver takes it over:
- on the same host (same hostname, boot and PID namespace): when the holder's pid is not
  running, or runs another process (its start time differs);
- from another host (a shared volume: NFS, a Kubernetes volume re-mounted by a new pod, where
  the holder's pid means nothing here): when its heartbeat is older than STALE_S seconds.
A holder that is alive makes a second driver fail at once, naming it (host, pid, start time,
command) and how old its heartbeat is. So a re-applied RayJob whose old driver pod is gone
takes the run over once the old heartbeat has aged (STALE_S), and a double submit while the
first driver lives is refused before it touches anything.

Within one process the lock is re-entrant: launch.py holds it for the whole command and the
PPOTrainer it builds (which takes it too, for users of the Python API) nests inside.

Bottom layer: imports the standard library only.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

LOCK_NAME = ".ppo-ray.lock"
HEARTBEAT_S = 10.0   # how often a holder touches its lock file
STALE_S = 60.0       # another host's lock whose heartbeat is older than this is taken over


class RunLockError(RuntimeError):
    """Another live driver holds the run directory (the message names it)."""


class RunLockLost(RunLockError):
    """This driver's lock was taken over (or its file removed) while it ran: it stops, writing
    nothing more into the run directory (the message names the lock file and its holder now)."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), or
    None when no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after the command name; 22 is the 20th of them


def _me() -> dict:
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid_ns": _pid_namespace(), "pid": os.getpid(),
            "pid_start": _start_time(os.getpid()), "since": time.time(),
            "since_text": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "token": uuid.uuid4().hex}


def _same_machine(holder: dict, me: dict) -> bool:
    return all(holder.get(k) == me[k] for k in ("host", "boot_id", "pid_ns"))


def describe(holder: dict) -> str:
    cmd = " ".join(holder.get("argv") or [])[:200]
    return (f"host {holder.get('host')!r}, pid {holder.get('pid')}, started {holder.get('since_text', '?')}"
            + (f", command: {cmd}" if cmd else ""))


# Locks this process holds: resolved path -> (RunLock, depth)
_HELD: dict[Path, list] = {}
_HELD_GUARD = threading.Lock()


@dataclass
class RunLock:
    path: Path
    info: dict
    lost: Optional[str] = None  # why this driver no longer holds it (the heartbeat's or check()'s finding)

    # ------------------------------------------------------------------ taking it
    @classmethod
    def acquire(cls, run_dir: str | Path, argv: Optional[list[str]] = None) -> "RunLock":
        """Take the lock of `run_dir` (created if missing), or return the one this process holds
        (re-entrant). RunLockError naming the holder when another live driver holds it; a stale
        lock (see the module doc) is taken over with a warning naming its holder."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = (run_dir / LOCK_NAME).resolve()
        with _HELD_GUARD:
            if path in _HELD:
                _HELD[path][1] += 1
                return _HELD[path][0]
            me = {**_me(), "argv": list(argv or [])}
            for _ in range(5):
                if cls._create(path, me):
                    lock = cls(path, me)
                    _HELD[path] = [lock, 1]
                    lock._start_heartbeat()
                    return lock
                cls._take_over_if_stale(path, me)
            raise RunLockError(f"could not take the lock {path}: other drivers keep taking it")

    @staticmethod
    def _create(path: Path, info: dict) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(info, indent=1))
            f.flush()
            os.fsync(f.fileno())
        return True

    @staticmethod
    def _read(path: Path) -> tuple[Optional[dict], Optional[float], str]:
        """(holder info or None when not JSON, the heartbeat's age in s or None when gone, raw
        text). A read that fails otherwise (NFS ESTALE, EIO) raises its OSError: it says nothing
        about who holds the lock."""
        try:
            text = path.read_text()
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return None, None, ""
        try:
            info = json.loads(text)
        except ValueError:
            info = None
        return (info if isinstance(info, dict) else None), age, text

    @classmethod
    def _take_over_if_stale(cls, path: Path, me: dict) -> None:
        """Remove `path` when its holder is gone (RunLockError naming a live holder)."""
        holder, age, text = cls._read(path)
        if age is None:  # released meanwhile: try again
            return
        if holder is not None and _same_machine(holder, me):
            pid = int(holder.get("pid", -1))
            alive = pid > 0 and _start_time(pid) is not None and _start_time(pid) == holder.get("pid_start")
            if alive:
                raise RunLockError(
                    f"run directory {path.parent} is in use by another driver ({describe(holder)}): one writer per "
                    "run directory. Wait for it to end, stop it (Ctrl-C, `ray job stop`), or pick another --run_dir")
            why = f"its driver ({describe(holder)}) is no longer running"
        elif age <= STALE_S:
            who = describe(holder) if holder is not None else "a lock being written, or unreadable"
            raise RunLockError(
                f"run directory {path.parent} is in use by a driver on another host ({who}; its heartbeat is "
                f"{age:.0f} s old): one writer per run directory. If that driver is gone (a lost node or pod), its "
                f"lock is taken over once its heartbeat is {STALE_S:.0f} s old: run the command again then")
        else:
            why = f"its heartbeat is {age:.0f} s old (> {STALE_S:.0f} s): {describe(holder) if holder else 'unreadable'}"
        # Take it over without racing another taker: move the file aside under a unique name,
        # and check it is the one judged stale (a taker that came first has written a new one).
        aside = path.with_name(f"{LOCK_NAME}.stale-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        if aside.read_text() != text:  # not the stale one: put it back (unless a new one exists)
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
            aside.unlink()
            return
        aside.unlink()
        log.warning("took over the run directory's lock %s: %s", path, why)

    # ------------------------------------------------------------------ holding it
    def _start_heartbeat(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ppo-ray-run-lock", daemon=True)
        self._thread.start()
        atexit.register(self._release_at_exit)

    def _beat(self) -> None:
        """Every HEARTBEAT_S seconds: read the lock file (lost when it is gone or names another
        holder: recorded, and the heartbeat ends) and touch it. A read or touch that fails is
        logged and tried again at the next beat; the touch is tried even when the read failed,
        so a flaky volume does not age the heartbeat toward STALE_S."""
        failures = 0
        while not self._stop.wait(HEARTBEAT_S):
            try:
                why = self._why_lost()
            except OSError as e:
                why, failures = None, failures + 1
                if failures == 1 or failures % 30 == 0:
                    log.warning("could not read the run directory's lock %s (%s; %d time(s) in a row): its heartbeat "
                                "goes on, and the lock counts as held until its file is gone or names another holder",
                                self.path, e, failures)
            else:
                failures = 0
            if why is not None:
                self._set_lost(why)
                return
            try:
                os.utime(self.path)
            except OSError as e:  # gone meanwhile: the next read says so
                log.warning("could not touch the run directory's lock %s (%s): tried again in %g s", self.path, e,
                            HEARTBEAT_S)

    def _why_lost(self) -> Optional[str]:
        """Why this driver no longer holds the lock (its file is gone, or names another holder),
        or None while the file is this driver's or cannot tell (not JSON: being written?).
        OSError when the file cannot be read: nothing is known."""
        holder, age, _ = self._read(self.path)
        if age is None:
            return "its lock file is gone (removed by someone else)"
        if holder is not None and holder.get("token") != self.info["token"]:
            return f"it is held now by {describe(holder)}"
        return None

    def _set_lost(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            log.error("the run directory's lock %s is no longer this driver's: %s. This driver writes nothing more "
                      "into %s (its next checkpoint or metrics line stops it)", self.path, why, self.path.parent)

    def check(self, *, read: bool = False) -> None:
        """RunLockLost when this driver has lost the lock: as the heartbeat found it (no I/O),
        and with `read` by reading the lock file now (before a checkpoint). A read that fails
        is not a loss (a warning; the heartbeat's finding stands). Call it before writing into
        the run directory."""
        if self.lost is None and read:
            try:
                why = self._why_lost()
            except OSError as e:
                log.warning("could not read the run directory's lock %s before writing (%s): going on", self.path, e)
            else:
                if why is not None:
                    self._set_lost(why)
        if self.lost is not None:
            raise RunLockLost(
                f"this driver lost the run directory's lock {self.path}: {self.lost}. It stopped before writing "
                f"more into {self.path.parent}: nothing more was written by it (one writer per run directory; the "
                "lock's holder now owns the run)")

    def held(self) -> bool:
        """The lock file names this driver now (False also when it cannot be read)."""
        try:
            holder, _, _ = self._read(self.path)
        except OSError as e:
            log.warning("could not read the run directory's lock %s (%s)", self.path, e)
            return False
        return holder is not None and holder.get("token") == self.info["token"]

    def release(self) -> None:
        """Give the lock up (the outermost holder in this process removes the file)."""
        with _HELD_GUARD:
            entry = _HELD.get(self.path)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _HELD[self.path]
        self._stop.set()
        if self.held():
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def _release_at_exit(self) -> None:
        with _HELD_GUARD:
            if self.path in _HELD:
                _HELD[self.path][1] = 1
        self.release()

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
