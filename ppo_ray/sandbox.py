"""A local sandbox for untrusted Python code (a language model's tool call): run_python runs the
code in a fresh interpreter, with limits, and returns what it printed and why it stopped.

Each call gets a fresh temporary directory (the code's cwd, HOME and TMPDIR; removed afterwards)
holding the code as main.py, a minimal environment (PATH, HOME, TMPDIR, LANG: nothing of the
caller's, so no token or key in os.environ reaches the code) and this process tree:

    run_python (the caller)  -- reads stdout and stderr incrementally, keeps output_bytes of each,
     |                          drains the rest; kills the whole tree if the supervisor overruns
     +- supervisor          `python -I -S <this file> supervise <config>`: sets up the isolation,
         |                   keeps the wall-clock limit, reports how the code ended on a status pipe
         +- [init]           namespace mode only: pid 1 of the new PID namespace
             +- worker      `PYTHONHASHSEED=0 python -s -S -B -u -c <_BOOTSTRAP>`: rlimits set, the
                             audit hook installed, then main.py executed as __main__

The supervisor runs under -I (isolated: no PYTHON* variables, no user site, no script dir on
sys.path) and -S (no site: the standard library only, never the caller's site-packages). The
worker gets the same isolation by other means, because -I also ignores PYTHONHASHSEED: str
hashes, and so the order a set of strings prints in, would differ from call to call, and an
environment that replays a tool call (a worker rebuilt after a restart) must see the same
output. Its environment is the minimal one above plus PYTHONHASHSEED=0 (built here, so none of
the caller's PYTHON* variables can reach it; the bootstrap removes the variable from
os.environ, so the code sees only the four), -s (no user site), -S, and the bootstrap drops
the cwd entry that -c puts first on sys.path (what -I's -P does; Python 3.10 has no -P).
main.py's own directory is put on sys.path, as `python main.py` would. The code reaches the
worker as a file; the caller never evaluates it.

Two isolation modes; isolation_available() probes once per process which one this machine
allows (the namespace mode, run on a trivial program, must start this same interpreter).

* "namespaces": new user, PID, network and mount namespaces (unshare through ctypes: Python
  3.11 has no os.unshare). As root the supervisor first prepares a private mount namespace,
  then drops to uid/gid SANDBOX_UID (nobody) and creates the user namespace as that uid (the
  code sees uid _NS_ID); a caller that is not root keeps its own uid. What holds, in the kernel:
  - network: the new network namespace has only a loopback, and it is down: no connection
    anywhere, 127.0.0.1 included; the host's abstract unix sockets are out of reach too;
  - processes: RLIMIT_NPROC = max_processes (+_NS_OVERHEAD: the supervisor and init share the
    namespace's per-uid count), enforced because the uid is not root (the kernel exempts
    uid 0: as root the limit would not hold). It counts threads as well. A fork bomb gets
    EAGAIN. The code sees only its own PID namespace (a fresh /proc), and when the worker
    exits, or the wall time ends (the supervisor kills init), the kernel kills every process
    left in the namespace: nothing outlives the call;
  - files: the uid reads only what is world-readable and writes only what is world-writable;
    /tmp, /var/tmp and /dev/shm are replaced by small empty tmpfs (host temp files, other
    runs' directories and unix sockets such as Ray's are not there); the directory itself is
    a tmpfs of _DIR_BYTES that vanishes with the namespace (no disk to fill). A Python
    installation under a directory the uid may not search (e.g. /root/.pyenv) is bound back
    in over an empty tmpfs, so nothing else of that directory shows;
  - the audit hook below too (defence in depth), and no_new_privs (no setuid gains).
* "fallback" (no user namespaces, e.g. a container whose seccomp filter forbids unshare):
  rlimits, a process-tree supervisor and the audit hook. The supervisor is a child subreaper,
  so every process the code starts stays in its tree and is killed when the worker exits or
  the wall time ends. As root it drops to SANDBOX_UID where that uid can run the interpreter
  (probed once); else the code runs as the caller, root included, and only the hook stands
  between the code and the host. The hook stops the code's Python-level actions; it is not a
  security boundary against a determined attacker: built-in modules can be re-created, and
  some functions raise no audit event (os.mknod, os.chroot, os.setpriority, ...: device nodes
  are refused when opened instead). No network namespace: only the hook refuses sockets.

The audit hook (sys.addaudithook, installed by _BOOTSTRAP before main.py runs; both modes):
- files: reads only under the sandbox directory, the Python installation (sys.prefix,
  base_prefix, the exec prefixes, the stdlib paths: what imports need), /dev/null, /dev/zero,
  /dev/urandom, /dev/random and /proc/<own pid>; writes (rename, remove, mkdir, chmod, ...)
  only under the sandbox directory (and /dev/null); no os.open of a directory (a directory fd
  would let dir_fd-relative paths escape the check; the fd-based shutil.rmtree is switched off
  for that), no symlinks, no device nodes, no extension module from outside the installation;
- processes: os.fork up to max_processes in the sandbox's tree; no exec of any program
  (os.exec*, posix_spawn, os.system, subprocess: an exec'd program would carry no hook);
  signals only to the code's own processes; no rlimit changes, no subinterpreters;
- network: sockets other than AF_UNIX, connect, bind, sendto, sendmsg and name lookups refused;
- modules: ctypes, _sqlite3 (ATTACH DATABASE opens files unseen), readline (history files),
  _dbm/_gdbm, _ssl, _tkinter, the subinterpreter modules; _posixsubprocess.fork_exec refused.
A refused action raises PermissionError (ImportError for an import) in the code, naming it.

Limits (SandboxLimits): RLIMIT_CPU (cpu_s, rounded up to whole seconds; per process, so a tree
of processes can use more, up to the wall time), RLIMIT_AS (memory_mb: a big allocation raises
MemoryError), RLIMIT_FSIZE (_DIR_BYTES per file), RLIMIT_CORE 0, and the wall-clock limit,
kept by the supervisor (the caller kills the tree _GRACE_S later if the supervisor is stuck).
Output: stdout and stderr each keep their first output_bytes, then "[truncated]"; the rest is
read and dropped, so a child printing gigabytes neither blocks nor fills the caller's memory.
The worker's output is unbuffered (-u): what it printed before a timeout is kept.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

SANDBOX_UID = 65534          # nobody: the uid the code runs as when the caller is root (where it can)
_NS_ID = 1000                # the code's uid and gid inside the user namespace
_DIR_BYTES = 64 * 1024 ** 2  # RLIMIT_FSIZE, and the size of the namespace mode's directory tmpfs
_MASK_BYTES = 1024 ** 2      # each tmpfs over /tmp, /var/tmp, /dev/shm in the namespace mode
_GRACE_S = 3.0               # beyond wall_s: the caller's backstop over the supervisor's own limit
_NS_OVERHEAD = 2             # processes in the user namespace's count besides the code's: supervisor, init
DIR_PREFIX = "ppo-ray-sandbox-"
_CHUNK = 65536
_TAIL = 512                  # bytes of stderr's end kept to recognise a MemoryError
_PATH = "/usr/local/bin:/usr/bin:/bin"
_HASH_SEED = "0"             # the worker's PYTHONHASHSEED: the same str hashes (set order) in every call


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: float = 2.0          # RLIMIT_CPU of each process (rounded up to whole seconds)
    wall_s: float = 5.0         # wall-clock limit; the whole process tree is killed at it
    memory_mb: int = 512        # RLIMIT_AS
    output_bytes: int = 4096    # stdout and stderr, each: kept up to this, then "[truncated]"
    max_processes: int = 16     # processes (in the namespace mode threads too) the code may have at once

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"SandboxLimits.{name} must be a finite number of seconds > 0, got {value!r}")
        for name in ("memory_mb", "output_bytes", "max_processes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be an int > 0, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: Optional[int]    # the code's exit status; -N if signal N killed it; None: timeout, setup failure
    error: Optional[str]        # None when it exited 0; else why not ("timeout (wall 5 s)", "exit code 1", ...)
    wall_s: float
    isolation: str              # what contained it: "namespaces(user,pid,net,mount)+uid(65534)+rlimits+audit", ...

    def observation(self) -> str:
        """The text an environment returns to the model: stdout, then stderr and the error, if any."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append("[stderr]\n" + self.stderr.rstrip("\n"))
        if self.error:
            parts.append(f"[error: {self.error}]")
        return "\n".join(parts) if parts else "[no output]"


# ----------------------------------------------------------------------------- the caller's side
_PROBE_LOCK = threading.Lock()
_PROBED: dict[str, Any] = {}  # "namespaces": (ok, why not); "fallback_uid": a uid or None


def isolation_available() -> str:
    """The isolation run_python uses on this machine (probed once per process, then cached):
    "namespaces(user,pid,net,mount)+..." where user namespaces work, else the fallback's "...rlimits+audit"."""
    if _namespaces_ok():
        return _label("namespaces", _namespace_uid(), audit=True)
    return _label("fallback", _fallback_uid(), audit=True)


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, stdin: str = "",
               _force_fallback: bool = False, _audit: bool = True) -> SandboxResult:
    """Run `code` in a fresh sandboxed interpreter (the module doc) with `stdin` as its standard
    input; nothing the code does raises here. `_force_fallback` (tests) takes the fallback even
    where namespaces work; `_audit=False` (tests) leaves the audit hook out, to show what the
    kernel alone holds in the namespace mode."""
    if not isinstance(code, str):
        raise TypeError(f"run_python: code must be a str, got {type(code).__name__}")
    if not isinstance(stdin, str):
        raise TypeError(f"run_python: stdin must be a str, got {type(stdin).__name__}")
    if not isinstance(limits, SandboxLimits):
        raise TypeError(f"run_python: limits must be a SandboxLimits, got {type(limits).__name__}")
    if not _force_fallback and _namespaces_ok():
        return _run(code, limits, stdin, "namespaces", _namespace_uid(), _audit)
    if not _audit:
        raise ValueError("run_python: _audit=False only in the namespace mode (the fallback's only guard is the hook)")
    return _run(code, limits, stdin, "fallback", _fallback_uid(), _audit)


def _label(mode: str, uid: Optional[int], audit: bool) -> str:
    parts = ["namespaces(user,pid,net,mount)"] if mode == "namespaces" else []
    if uid is not None:
        parts.append(f"uid({uid})")
    parts.append("rlimits")
    if audit:
        parts.append("audit")
    return "+".join(parts)


def _namespace_uid() -> Optional[int]:
    """The uid the code gets in the namespace mode: SANDBOX_UID under root, else the caller's own (None)."""
    return SANDBOX_UID if os.geteuid() == 0 else None


def _probe(mode: str, uid: Optional[int]) -> tuple[bool, str]:
    """Whether `mode` (as `uid`) runs a trivial program on this very interpreter; else why not."""
    try:
        result = _run("import sys\nprint(sys.version)", SandboxLimits(wall_s=20.0), "", mode, uid, True)
    except OSError as e:
        return False, f"{type(e).__name__}: {e}"
    if result.error is None and result.stdout.strip() == sys.version:
        return True, ""
    return False, (f"{result.error or 'another interpreter ran'}: stdout {result.stdout[:200]!r}, "
                   f"stderr {result.stderr[-500:]!r}")


def _namespaces_ok() -> bool:
    with _PROBE_LOCK:
        if "namespaces" not in _PROBED:
            linux = sys.platform.startswith("linux")
            _PROBED["namespaces"] = _probe("namespaces", _namespace_uid()) if linux else (False, sys.platform)
        return _PROBED["namespaces"][0]


def _fallback_uid() -> Optional[int]:
    """SANDBOX_UID where the caller is root and that uid can run this interpreter (probed), else None."""
    with _PROBE_LOCK:
        if "fallback_uid" not in _PROBED:
            drop = os.geteuid() == 0 and _probe("fallback", SANDBOX_UID)[0]
            _PROBED["fallback_uid"] = SANDBOX_UID if drop else None
        return _PROBED["fallback_uid"]


class _Stream:
    """One output stream: its first `cap` bytes, its total length and its last _TAIL bytes."""

    def __init__(self, cap: int):
        self.cap, self.kept, self.total, self.tail = cap, bytearray(), 0, b""

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.cap - len(self.kept)
        if room > 0:
            self.kept += data[:room]
        self.tail = (self.tail + data[-_TAIL:])[-_TAIL:]

    def text(self) -> str:
        text = self.kept.decode("utf-8", "replace")
        return text + "\n[truncated]" if self.total > self.cap else text


def _python_roots() -> list[str]:
    """The directories the worker's interpreter needs: its binary's, its prefixes (stdlib, libpython)."""
    exe = os.path.realpath(sys.executable)
    roots = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(exe)) if p}
    roots.discard("/")
    return sorted(r for r in roots if not any(r != o and _within(r, o) for o in roots))


def _run(code: str, limits: SandboxLimits, stdin: str, mode: str, uid: Optional[int], audit: bool) -> SandboxResult:
    started = time.monotonic()
    directory = os.path.realpath(tempfile.mkdtemp(prefix=DIR_PREFIX))
    proc = None
    try:
        code_path = os.path.join(directory, "main.py")
        with open(code_path, "w", encoding="utf-8") as f:
            f.write(code)
        if mode == "fallback" and uid is not None and uid != os.geteuid():
            for path in (directory, code_path):
                os.chown(path, uid, uid)
        env = {"PATH": _PATH, "HOME": directory, "TMPDIR": directory, "LANG": "C.UTF-8"}
        status_r, status_w = os.pipe()
        config = dict(mode=mode, dir=directory, uid=uid, audit=audit, wall_s=limits.wall_s, cpu_s=limits.cpu_s,
                      memory_mb=limits.memory_mb, max_processes=limits.max_processes, env=env, status_fd=status_w,
                      exe=os.path.realpath(sys.executable), python_roots=_python_roots())
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), "supervise",
                                     json.dumps(config)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, cwd="/", pass_fds=(status_w,),
                                    start_new_session=True)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        out, err, status, overran = _collect(proc, status_r, stdin.encode("utf-8"), limits,
                                             started + limits.wall_s + _GRACE_S)
        if overran:
            _kill_tree(proc.pid)
        try:
            proc.wait(timeout=_GRACE_S)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.wait()
    finally:
        if proc is not None and proc.poll() is None:  # an exception above: leave nothing running
            _kill_tree(proc.pid)
            proc.wait()
        _remove_tree(directory)
    exit_code, error = _outcome(status, overran, err, limits)
    if not status and not overran:
        error = f"the sandbox supervisor ended without a status (exit {proc.returncode}): {err.text()[-300:]!r}"
    return SandboxResult(out.text(), err.text(), exit_code, error, time.monotonic() - started,
                         _label(mode, uid, audit))


def _collect(proc: subprocess.Popen, status_r: int, stdin: bytes, limits: SandboxLimits,
             deadline: float) -> tuple[_Stream, _Stream, dict, bool]:
    """Feed stdin; read stdout, stderr and the status pipe until all three close, or the deadline
    passes (then True: the caller kills the tree). Returns both streams and the status fields."""
    out, err, status = _Stream(limits.output_bytes), _Stream(limits.output_bytes), _Stream(1 << 16)
    selector = selectors.DefaultSelector()
    readers = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, status_r: status}
    for fd, stream in readers.items():
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ, stream)
    writer, offset = proc.stdin.fileno(), 0
    if stdin:
        os.set_blocking(writer, False)
        selector.register(writer, selectors.EVENT_WRITE, None)
    else:
        proc.stdin.close()
    overran, open_readers = False, len(readers)
    try:
        while open_readers:
            left = deadline - time.monotonic()
            if left <= 0:
                overran = True
                break
            for key, _ in selector.select(left):
                if key.data is None:  # stdin: written as the code reads it; dropped once it exits
                    try:
                        offset += os.write(writer, stdin[offset:offset + _CHUNK])
                    except BlockingIOError:
                        continue
                    except OSError:  # BrokenPipeError: the code is gone, or closed its stdin
                        offset = len(stdin)
                    if offset >= len(stdin):
                        selector.unregister(writer)
                        proc.stdin.close()
                    continue
                try:
                    data = os.read(key.fd, _CHUNK)
                except BlockingIOError:
                    continue
                if data:
                    key.data.add(data)
                else:
                    selector.unregister(key.fd)
                    open_readers -= 1
    finally:
        selector.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except OSError:
                pass
        os.close(status_r)
    fields: dict = {}
    for line in bytes(status.kept).splitlines():
        try:
            fields.update(json.loads(line))
        except ValueError:
            continue
    return out, err, fields, overran


def _outcome(status: dict, overran: bool, err: _Stream, limits: SandboxLimits) -> tuple[Optional[int], Optional[str]]:
    """(exit_code, error) from the supervisor's status fields."""
    if "setup_error" in status:
        return None, f"sandbox setup failed: {status['setup_error']}"
    if overran or status.get("timeout"):
        return None, f"timeout (wall {limits.wall_s:g} s)"
    if "signal" in status:
        number = int(status["signal"])
        if number == signal.SIGXCPU:
            return -number, f"cpu time limit ({math.ceil(limits.cpu_s)} s)"
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = "unknown"
        return -number, f"killed by signal {number} ({name})"
    if "exit" in status:
        code = int(status["exit"])
        if code == 0:
            return 0, None
        if err.tail.rstrip().rsplit(b"\n", 1)[-1].startswith(b"MemoryError"):
            return code, f"memory limit ({limits.memory_mb} MiB): MemoryError"
        return code, f"exit code {code}"
    return None, None


def _remove_tree(directory: str) -> None:
    """Remove the sandbox directory, whatever modes the code left on what it wrote there."""
    try:
        shutil.rmtree(directory)
    except OSError:
        for parent, dirs, _ in os.walk(directory):
            for name in dirs:
                try:
                    os.chmod(os.path.join(parent, name), 0o700)
                except OSError:
                    pass
        shutil.rmtree(directory, ignore_errors=True)


# ----------------------------------------------------------------------------- process trees (both sides)
def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process this /proc shows."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            table[int(name)] = (int(fields[1]), fields[0].decode())
    return table


def _descendants(root: int, table: Optional[dict] = None) -> list[int]:
    table = _process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def _kill_tree(root: int) -> None:
    """SIGKILL `root` and everything under it (a snapshot, taken twice for late forks)."""
    for _ in range(2):
        for pid in [*_descendants(root), root]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


# ----------------------------------------------------------------------------- the supervisor (its own interpreter)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38


class _Libc:
    """The libc calls Python 3.11's os lacks: unshare, mount, prctl (errors name the call)."""

    def __init__(self) -> None:
        import ctypes

        self.ctypes, self.lib = ctypes, ctypes.CDLL(None, use_errno=True)

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            errno = self.ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    def unshare(self, flags: int) -> None:
        self._check(self.lib.unshare(flags), f"unshare({flags:#x})")

    def mount(self, source: Optional[str], target: str, fstype: Optional[str], flags: int,
              options: Optional[str] = None) -> None:
        def enc(s: Optional[str]) -> Optional[bytes]:
            return None if s is None else os.fsencode(s)

        self._check(self.lib.mount(enc(source), enc(target), enc(fstype), self.ctypes.c_ulong(flags), enc(options)),
                    f"mount {source!r} on {target!r} ({fstype}, {options})")

    def prctl(self, option: int, value: int) -> None:
        self._check(self.lib.prctl(option, self.ctypes.c_ulong(value), 0, 0, 0), f"prctl({option}, {value})")


def _report(cfg: dict, **fields: Any) -> None:
    os.write(cfg["status_fd"], (json.dumps(fields) + "\n").encode())


def _supervise(cfg: dict) -> int:
    cfg["started"] = time.monotonic()
    os.set_inheritable(cfg["status_fd"], False)  # kept by forks, closed by the worker's exec
    try:
        if cfg["mode"] == "namespaces":
            _supervise_namespaces(cfg)
        else:
            _supervise_fallback(cfg)
        return 0
    except Exception as e:  # noqa: BLE001 - a setup failure is the call's result, named
        _report(cfg, setup_error=f"{type(e).__name__}: {e}")
        return 1


def _drop_to(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _within(path: str, base: str) -> bool:
    return path == base or path.startswith(base.rstrip("/") + "/")


def _blocked_ancestor(root: str) -> Optional[str]:
    """The outermost directory above `root` that others may not search (hiding root from the uid)."""
    path = ""
    for part in root.strip("/").split("/")[:-1]:
        path += "/" + part
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return path
    return None


def _prepare_mounts(libc: _Libc, cfg: dict, code: bytes, owner: Optional[int]) -> None:
    """In a private mount namespace: empty tmpfs over the temp directories (and, for `owner`, over
    the directories that hide the Python installation from it), the installation bound back in,
    then the sandbox directory as a tmpfs of _DIR_BYTES holding main.py."""
    masks = {os.path.realpath(d): 0o1777 for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(d)}
    if owner is not None:
        for root in cfg["python_roots"]:
            blocked = _blocked_ancestor(root)
            if blocked:
                masks.setdefault(blocked, 0o755)
    hidden = {root: os.open(root, os.O_PATH | os.O_DIRECTORY) for root in cfg["python_roots"]
              if any(_within(root, m) for m in masks)}  # opened before the masks cover them
    for mask in sorted(masks, key=len):
        if not any(other != mask and _within(mask, other) for other in masks):  # else under an outer mask
            libc.mount("tmpfs", mask, "tmpfs", MS_NOSUID | MS_NODEV, f"size={_MASK_BYTES},mode={masks[mask]:o}")
    for root, fd in hidden.items():
        os.makedirs(root, exist_ok=True)
        libc.mount(f"/proc/self/fd/{fd}", root, None, MS_BIND | MS_REC)
        os.close(fd)
    directory = cfg["dir"]
    os.makedirs(directory, exist_ok=True)
    ids = f",uid={owner},gid={owner}" if owner is not None else ""
    libc.mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, f"size={_DIR_BYTES},mode=0700{ids}")
    path = os.path.join(directory, "main.py")
    with open(path, "wb") as f:
        f.write(code)
    if owner is not None:
        os.chown(path, owner, owner)


def _supervise_namespaces(cfg: dict) -> None:
    libc = _Libc()
    with open(os.path.join(cfg["dir"], "main.py"), "rb") as f:
        code = f.read()
    uid = cfg["uid"]
    privileged = uid is not None and os.geteuid() == 0
    if privileged:  # the mounts as real root; then the unprivileged uid creates the user namespace
        libc.unshare(CLONE_NEWNS)
        libc.mount(None, "/", None, MS_REC | MS_PRIVATE)
        _prepare_mounts(libc, cfg, code, owner=uid)
        _drop_to(uid)
        libc.prctl(PR_SET_DUMPABLE, 1)  # the uid change gave /proc/self to root: the maps below need it ours
        outer_uid = outer_gid = uid
    else:
        outer_uid, outer_gid = os.geteuid(), os.getegid()
    libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{_NS_ID} {outer_uid} 1"),
                       ("gid_map", f"{_NS_ID} {outer_gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    if not privileged:
        libc.mount(None, "/", None, MS_REC | MS_PRIVATE)
        _prepare_mounts(libc, cfg, code, owner=None)
    init = os.fork()
    if init == 0:  # pid 1 of the new PID namespace: when it exits, the kernel kills the rest
        try:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            libc.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            worker = _spawn_worker(cfg, libc, nproc=cfg["max_processes"] + _NS_OVERHEAD)
            while True:  # reap everything; stop with the worker
                pid, wait_status = os.waitpid(-1, 0)
                if pid == worker:
                    _report(cfg, **_decode(wait_status))
                    break
        except BaseException as e:  # noqa: BLE001 - never back into the supervisor's code
            _report(cfg, setup_error=f"the namespace's init: {type(e).__name__}: {e}")
        finally:
            os._exit(0)
    deadline, delay = cfg["started"] + cfg["wall_s"], 0.001
    while os.waitpid(init, os.WNOHANG)[0] == 0:
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(init, signal.SIGKILL)
            _report(cfg, timeout=True)
            os.waitpid(init, 0)
            break
        time.sleep(min(left, delay))
        delay = min(delay * 2, 0.02)


def _supervise_fallback(cfg: dict) -> None:
    try:
        libc: Optional[_Libc] = _Libc()
    except (ImportError, OSError):
        libc = None
    if cfg["uid"] is not None and cfg["uid"] != os.geteuid():
        _drop_to(cfg["uid"])
    if libc is not None:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1)  # the code's orphans become ours: the tree stays whole
    worker = _spawn_worker(cfg, libc, nproc=None)
    deadline, delay, result = cfg["started"] + cfg["wall_s"], 0.001, None
    while result is None:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == worker:
            result = _decode(wait_status)
        elif pid == 0:
            left = deadline - time.monotonic()
            if left <= 0:
                _report(cfg, timeout=True)
                break
            time.sleep(min(left, delay))
            delay = min(delay * 2, 0.02)
    _end_descendants()
    if result is not None:
        _report(cfg, **result)


def _end_descendants() -> None:
    """Kill and reap every process under this one (a subreaper: the code's orphans are ours too)."""
    me = os.getpid()
    for _ in range(10000):
        table = _process_table()
        live = [pid for pid in _descendants(me, table) if table[pid][1] != "Z"]
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not live:
            return
        time.sleep(0.001)


def _decode(wait_status: int) -> dict:
    if os.WIFSIGNALED(wait_status):
        return {"signal": os.WTERMSIG(wait_status)}
    return {"exit": os.waitstatus_to_exitcode(wait_status)}


def _spawn_worker(cfg: dict, libc: Optional[_Libc], nproc: Optional[int]) -> int:
    """Fork the worker: its rlimits, the sandbox directory, then exec the interpreter on _BOOTSTRAP."""
    import resource

    pid = os.fork()
    if pid:
        return pid
    try:
        os.chdir(cfg["dir"])
        cpu, memory = math.ceil(cfg["cpu_s"]), cfg["memory_mb"] * 1024 ** 2
        limits = [(resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (memory, memory)),
                  (resource.RLIMIT_FSIZE, (_DIR_BYTES, _DIR_BYTES)), (resource.RLIMIT_CORE, (0, 0))]
        if nproc is not None:
            limits.append((resource.RLIMIT_NPROC, (nproc, nproc)))
        for which, value in limits:
            resource.setrlimit(which, value)
        if libc is not None:
            libc.prctl(PR_SET_NO_NEW_PRIVS, 1)
        # not -I: it ignores PYTHONHASHSEED (the module doc); the environment is ours alone, -s and
        # the bootstrap do the rest of what -I would
        argv = [cfg["exe"], "-s", "-S", "-B", "-u", "-c", _BOOTSTRAP, cfg["dir"], str(cfg["max_processes"]),
                "1" if cfg["audit"] else "0"]
        os.execve(cfg["exe"], argv, {**cfg["env"], "PYTHONHASHSEED": _HASH_SEED})
    except BaseException as e:  # noqa: BLE001 - the forked child never returns into the supervisor
        try:
            _report(cfg, setup_error=f"starting the interpreter {cfg['exe']}: {type(e).__name__}: {e}")
        finally:
            os._exit(127)
    return 0  # not reached


# ----------------------------------------------------------------------------- the worker's bootstrap
# `PYTHONHASHSEED=0 python -s -S -B -u -c _BOOTSTRAP <dir> <max_processes> <audit 0/1>`: installs the
# audit hook (the module doc), then runs <dir>/main.py as __main__. Self-contained, standard library only.
_BOOTSTRAP = r'''
import os, sys

if sys.path[:1] == [""]:  # -c's cwd entry, before anything is imported (-I's -P, without -I)
    del sys.path[0]
os.environ.pop("PYTHONHASHSEED", None)  # read at startup; the code sees only the minimal environment


def _guard(home, cap):
    import _imp, _thread, _posixsubprocess, posix
    realpath, join, isdir, getcwd, getpid, fsdecode = (os.path.realpath, os.path.join, os.path.isdir, os.getcwd,
                                                       os.getpid, os.fsdecode)
    roots = sorted({realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                          *sys.path) if p} - {"/"})
    devices = frozenset(("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"))
    extensions = tuple(_imp.extension_suffixes())
    denied_modules = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "_sqlite3", "readline", "_dbm", "_gdbm",
                                "_ssl", "_tkinter", "_xxsubinterpreters", "_xxinterpchannels"))
    exec_events = frozenset(("os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
                             "os.startfile"))
    write_events = frozenset(("os.mkdir", "os.remove", "os.rmdir", "os.chmod", "os.chown", "os.truncate",
                              "os.utime", "os.setxattr", "os.removexattr", "os.chflags", "os.lchflags",
                              "os.lchmod"))
    list_events = frozenset(("os.listdir", "os.scandir", "os.listxattr", "os.getxattr"))
    refused_events = {"os.symlink": "creating a symlink", "os.killpg": "signalling a process group",
                      "resource.setrlimit": "changing an rlimit", "resource.prlimit": "changing an rlimit",
                      "cpython.PyInterpreterState_New": "a subinterpreter"}
    writing = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    local = _thread._local()

    def within(path, base):
        return path == base or path.startswith(base.rstrip("/") + "/")

    def resolve(path):
        if path is None:
            path = "."
        if isinstance(path, int):
            return None  # an open fd: what it names was checked when it was opened
        return realpath(join(getcwd(), fsdecode(path)))

    def readable(path):
        return (within(path, home) or path in devices or any(within(path, r) for r in roots)
                or within(path, "/proc/%d" % getpid()))

    def writable(path):
        return within(path, home) or path == "/dev/null"

    def refuse(what, why="", error=PermissionError):
        raise error("sandbox: %s is not allowed%s" % (what, why))

    def check_write(path, what):
        p = resolve(path)
        if p is not None and not writable(p):
            refuse("%s of %r" % (what, p), " (only the sandbox directory %s is writable)" % home)

    def tree():
        """The live pids under this sandbox's root (the supervisor, or the namespace's init)."""
        children = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open("/proc/" + name + "/stat", "rb") as f:
                        fields = f.read().rsplit(b")", 1)[1].split()
                except (OSError, IndexError):
                    continue
                if fields[0] != b"Z":
                    children.setdefault(int(fields[1]), []).append(int(name))
        found, todo = set(), [top]
        while todo:
            for child in children.get(todo.pop(), ()):
                if child not in found:
                    found.add(child)
                    todo.append(child)
        return found

    def check(event, args):
        if event == "open":
            path, mode, flags = args
            p = resolve(path)
            if p is None:
                return
            if mode is None and (flags & getattr(os, "O_DIRECTORY", 0) or isdir(p)):
                refuse("os.open of the directory %r" % p)
            if within(p, home):
                try:
                    kind = os.stat(p).st_mode & 0o170000
                except OSError:
                    kind = 0
                if kind in (0o060000, 0o020000):  # a block or character device node
                    refuse("opening the device node %r" % p)
            if flags & writing or (mode is not None and any(c in mode for c in "wax+")):
                if not writable(p):
                    refuse("writing %r" % p, " (only the sandbox directory %s is writable)" % home)
            elif not readable(p):
                refuse("reading %r" % p, " (only the sandbox directory and the Python installation are readable)")
        elif event in list_events:
            p = resolve(args[0])
            if p is not None and not readable(p):
                refuse("listing %r" % p)
        elif event in write_events:
            check_write(args[0], event)
        elif event in ("os.rename", "os.link"):
            check_write(args[0], event)
            check_write(args[1], event)
        elif event in ("os.fork", "os.forkpty"):
            if len(tree()) >= cap:
                raise BlockingIOError(11, "sandbox: at most %d processes at once (max_processes)" % cap)
        elif event in exec_events:
            refuse("running another program (%s)" % event)
        elif event == "os.kill":
            pid = args[0]
            if pid != getpid() and (pid <= 0 or pid not in tree()):
                refuse("signalling pid %d" % pid, " (only the code's own processes)")
        elif event == "socket.__new__":
            if args[1] != 1:  # only AF_UNIX (socketpair; its connect and bind are refused below)
                refuse("creating a network socket")
        elif event.startswith("socket.") and event != "socket.gethostname":
            refuse("network access (%s)" % event)
        elif event.startswith("ctypes."):
            refuse("ctypes (%s)" % event)
        elif event == "import":
            module, filename = args[0], args[1]
            if module.partition(".")[0] in denied_modules:
                refuse("importing %s" % module, error=ImportError)
            if filename and filename.endswith(extensions) and not any(within(realpath(filename), r) for r in roots):
                refuse("loading the extension module %r" % filename, " (only the Python installation's)",
                       error=ImportError)
        elif event in refused_events:
            refuse(refused_events[event])

    def hook(event, args):
        if getattr(local, "busy", False):  # the hook's own /proc reads
            return
        local.busy = True
        try:
            check(event, args)
        finally:
            local.busy = False

    def no_fork_exec(*args, **kwargs):
        raise PermissionError("sandbox: running another program (_posixsubprocess.fork_exec) is not allowed")

    def pidfd_open(pid, flags=0, _real=getattr(posix, "pidfd_open", None)):
        if pid != getpid() and pid not in tree():
            refuse("pidfd_open of pid %d" % pid, " (only the code's own processes)")
        return _real(pid, flags)

    top = os.getppid()
    _posixsubprocess.fork_exec = no_fork_exec
    if hasattr(posix, "pidfd_open"):  # signal.pidfd_send_signal raises no audit event: guard the pidfd
        posix.pidfd_open = os.pidfd_open = pidfd_open
    import shutil
    shutil._use_fd_functions = False  # rmtree without directory fds (refused above)
    sys.addaudithook(hook)


def _main(home, cap, audit):
    path = os.path.join(home, "main.py")
    with open(path, "rb") as f:
        source = f.read()
    if audit:
        _guard(home, cap)
    module = type(sys)("__main__")
    module.__file__, module.__builtins__ = path, __builtins__
    sys.modules["__main__"], sys.argv = module, [path]
    sys.path.insert(0, home)
    try:
        exec(compile(source, path, "exec"), module.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # the traceback without the bootstrap's frames (and the hook's)
        kept, tb = [], e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_globals is not globals():
                kept.append(tb)
            tb = tb.tb_next
        tb = None
        for t in reversed(kept):
            tb = type(t)(tb, t.tb_frame, t.tb_lasti, t.tb_lineno)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(1)


_main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1")
'''


if __name__ == "__main__":
    # `python -I -S sandbox.py supervise <config json>`: the supervisor, started by run_python
    if len(sys.argv) != 3 or sys.argv[1] != "supervise":
        sys.exit("usage: python -I -S sandbox.py supervise <config json> (run_python starts it)")
    sys.exit(_supervise(json.loads(sys.argv[2])))
