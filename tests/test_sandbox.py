"""ppo_ray/sandbox.py: untrusted Python code in a fresh, limited interpreter.

The hostile cases (an infinite loop, a fork bomb, an 8 GiB allocation, a connection to a server
on 127.0.0.1, writes outside the sandbox directory, reads of a run directory, the caller's
environment) each end in an error observation within a bounded time, and leave the host as it
was: no file written, no connection made, no process left, the caller's memory unchanged. Each
runs in every mode this machine allows:

- "namespaces": the default where user namespaces work (user, PID, network, mount namespaces,
  an unprivileged uid, rlimits, the audit hook);
- "kernel-only": the same without the audit hook (run_python's private _audit=False): what the
  kernel alone holds, as if the hook were bypassed;
- "fallback": rlimits, the supervisor and the audit hook only (the private _force_fallback=True),
  as on a machine without user namespaces.

Plus: ordinary code, stdin, the output cap, cleanup of the directory, the same output for the same
code (a fixed str hash seed), SandboxLimits' checks. The helpers that tell the host is as it was
are in tests/helpers.py (the code tool's tests use them too).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from helpers import (assert_no_leftovers, processes_now, rss_bytes, tcp_server, world_readable_secret,
                     world_writable_dir)
from ppo_ray.sandbox import SandboxLimits, SandboxResult, isolation_available, run_python

MODES = ("namespaces", "kernel-only", "fallback")
QUICK = SandboxLimits(cpu_s=1.0, wall_s=3.0)
BOUND_S = QUICK.wall_s + 3.0 + 2.0  # wall_s + the caller's grace + slack for a loaded machine


@pytest.fixture(params=MODES)
def sandbox(request):
    """run_python in one mode: call it as sandbox(code, limits, stdin=...)."""
    mode = request.param
    if mode != "fallback" and not isolation_available().startswith("namespaces"):
        pytest.skip(f"user namespaces are not available here ({isolation_available()})")

    def call(code: str, limits: SandboxLimits = QUICK, **kwargs) -> SandboxResult:
        result = run_python(code, limits, _force_fallback=mode == "fallback", _audit=mode != "kernel-only", **kwargs)
        assert result.isolation.startswith("namespaces") == (mode != "fallback"), result.isolation
        assert result.isolation.endswith("+audit") == (mode != "kernel-only"), result.isolation
        return result

    call.mode = mode
    return call


# ----------------------------------------------------------------------------- ordinary code
def test_ordinary_code_runs_and_prints(sandbox):
    result = sandbox("print(2 + 3)")
    assert (result.stdout, result.stderr, result.exit_code, result.error) == ("5\n", "", 0, None)
    assert result.observation() == "5"
    assert 0 < result.wall_s < BOUND_S  # a trivial call is quick (not asserted tighter on a loaded machine)


def test_stdin_is_the_codes_standard_input(sandbox):
    assert sandbox("print(input()[::-1])", stdin="abc\n").stdout == "cba\n"
    big = "x" * 1_000_000 + "\n"
    assert sandbox("import sys\nprint(len(sys.stdin.read()))", stdin=big).stdout == f"{len(big)}\n"
    ignored = sandbox("print('did not read it')", stdin=big)  # a child that never reads stdin does not block
    assert (ignored.stdout, ignored.error) == ("did not read it\n", None)


def test_errors_and_exit_codes_are_observations(sandbox):
    result = sandbox("import sys\nprint('before')\nsys.exit(3)")
    assert (result.exit_code, result.error) == (3, "exit code 3")
    assert result.observation() == "before\n[error: exit code 3]"
    result = sandbox("1 / 0")
    assert result.error == "exit code 1" and result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in result.stderr  # the bootstrap's frames are not in the traceback
    assert "SyntaxError" in sandbox("x = (").stderr


def test_output_is_capped_and_marked_and_drained(sandbox):
    limits = SandboxLimits(cpu_s=5.0, wall_s=20.0, output_bytes=1000)
    result = sandbox("import sys\nprint('x' * 10_000_000)\nsys.stderr.write('e' * 10_000_000)", limits)
    assert result.error is None and result.exit_code == 0
    assert result.stdout == "x" * 1000 + "\n[truncated]" and result.stderr == "e" * 1000 + "\n[truncated]"
    rss = rss_bytes()
    result = sandbox("import sys\nfor _ in range(100):\n    sys.stdout.write('y' * 1_000_000)\nprint('done')", limits)
    assert result.error is None and result.stdout.endswith("[truncated]") and len(result.stdout) < 1100
    assert rss_bytes() - rss < 50 * 1024 ** 2  # 100 MB read and dropped, not kept


def test_the_directory_is_fresh_private_and_removed(sandbox):
    before = set(Path(tempfile.gettempdir()).glob("ppo-ray-sandbox-*"))
    code = ("import os\nprint(os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR'], sorted(os.listdir('.')))\n"
            "open('out.txt', 'w').write('kept?')\nprint(open('out.txt').read())")
    first, second = sandbox(code), sandbox(code)
    assert first.stdout == second.stdout == "True ['main.py']\nkept?\n"  # nothing of the first call in the second
    assert set(Path(tempfile.gettempdir()).glob("ppo-ray-sandbox-*")) == before


def test_the_same_code_prints_the_same_in_every_call(sandbox):
    """The worker's str hash seed is fixed (-I would ignore PYTHONHASHSEED): a set of strings prints in
    one order, which a replayed tool call relies on. The code still sees only its four variables,
    and no cwd entry ('') on sys.path."""
    code = ("import os, sys\nprint({'apple', 'banana', 'cherry', 'date'}, hash('x'))\n"
            "print(sorted(os.environ))\nprint('' in sys.path)")
    first, second = sandbox(code), sandbox(code)
    assert first.error is None and first.stdout == second.stdout, (first, second)
    assert first.stdout.splitlines()[1:] == ["['HOME', 'LANG', 'PATH', 'TMPDIR']", "False"]


# ----------------------------------------------------------------------------- hostile code
def test_an_infinite_loop_is_stopped(sandbox):
    started = time.monotonic()
    result = sandbox("while True:\n    pass")
    assert time.monotonic() - started < BOUND_S
    assert result.error in ("cpu time limit (1 s)", "timeout (wall 3 s)"), result
    assert "[error: " in result.observation()


def test_the_wall_time_ends_the_whole_tree(sandbox):
    before = processes_now()
    code = ("import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(60)\n"
            "print('sleeping', flush=True)\ntime.sleep(60)")
    started = time.monotonic()
    result = sandbox(code, SandboxLimits(wall_s=1.0))
    assert time.monotonic() - started < 1.0 + 3.0 + 2.0
    assert (result.error, result.exit_code, result.stdout) == ("timeout (wall 1 s)", None, "sleeping\n")
    assert result.observation() == "sleeping\n[error: timeout (wall 1 s)]"
    assert_no_leftovers(before)


def test_a_fork_bomb_is_contained(sandbox):
    before = processes_now()
    started = time.monotonic()
    result = sandbox("import os\nwhile True:\n    os.fork()")
    assert time.monotonic() - started < BOUND_S
    assert result.error is not None and "[error: " in result.observation()
    assert_no_leftovers(before)
    assert subprocess.run(["true"], timeout=30).returncode == 0  # the host can still start a process


def test_max_processes_caps_the_processes_at_once(sandbox):
    code = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n"
            "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print(n, type(e).__name__)")
    result = sandbox(code, SandboxLimits(wall_s=10.0, max_processes=5))
    assert result.stdout == "4 BlockingIOError\n", result  # the code's own process and 4 more


def test_an_8_gib_allocation_fails_without_touching_the_host(sandbox):
    rss = rss_bytes()
    result = sandbox("x = bytearray(8 * 1024**3)\nprint('allocated')")
    assert "allocated" not in result.stdout
    assert result.error == "memory limit (512 MiB): MemoryError", result
    assert result.stderr.rstrip().endswith("MemoryError")
    assert rss_bytes() - rss < 50 * 1024 ** 2


def test_no_connection_to_a_server_on_127_0_0_1(sandbox):
    with tcp_server() as (port, accepted):
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "s.sendall(b'hello')\nprint('connected')")
        result = sandbox(code)
        udp = sandbox(f"import socket\nudp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                      f"udp.sendto(b'x', ('127.0.0.1', {port}))\nprint('sent')")
    assert "connected" not in result.stdout and result.error == "exit code 1", result
    assert "sent" not in udp.stdout and udp.error == "exit code 1", udp
    assert accepted == []


def test_no_write_outside_its_directory(sandbox, tmp_path):
    with world_writable_dir() as shared:
        targets = [tmp_path / "escape.txt", shared / "escape.txt"]
        for target in targets:
            code = (f"import os\ntarget = {str(target)!r}\nopen('mine.txt', 'w').write('x')\n"
                    "for attempt in (lambda: os.rename('mine.txt', target), lambda: os.link('mine.txt', target),\n"
                    "                lambda: os.symlink(target, 'link') or open('link', 'w').write('x')):\n"
                    "    try:\n        attempt()\n        print('escaped')\n    except OSError:\n        pass\n"
                    "open(target, 'w').write('escaped')\nprint('wrote it')")
            result = sandbox(code)
            assert "escaped" not in result.stdout and "wrote it" not in result.stdout, result
            assert result.error == "exit code 1" and "Error" in result.stderr, result
            assert not target.exists()
        assert sorted(p.name for p in shared.iterdir()) == []


def test_no_read_of_a_run_directory(sandbox, tmp_path):
    secret = "run-secret-d5f0c2"
    private = tmp_path / "run" / "secret.txt"
    private.parent.mkdir()
    private.write_text(secret)
    with world_readable_secret(secret) as readable:  # readable for any uid: only the sandbox keeps the code out
        for path in (private, readable):
            code = (f"import os\npath = {str(path)!r}\ntry:\n    print(os.listdir(os.path.dirname(path)))\n"
                    "except OSError as e:\n    print(type(e).__name__)\nprint(open(path).read())")
            result = sandbox(code)
            assert secret not in result.observation(), result
            assert result.error == "exit code 1", result


def test_the_callers_environment_does_not_reach_the_code(sandbox, monkeypatch):
    secret = "env-secret-8a1e77"
    monkeypatch.setenv("PPO_RAY_SANDBOX_TEST_SECRET", secret)
    code = (f"import os\nprint(sorted(os.environ))\nprint(open('/proc/self/environ', 'rb').read())\n"
            f"for pid in (os.getppid(), {os.getpid()}, 1):\n    try:\n"
            "        print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
            "    except OSError as e:\n        print(pid, type(e).__name__)\n"
            f"print(open('/proc/{os.getpid()}/environ').read())")
    result = sandbox(code)
    assert secret not in result.observation(), result
    assert result.stdout.splitlines()[0] == "['HOME', 'LANG', 'PATH', 'TMPDIR']"
    assert result.error == "exit code 1", result  # the caller's environ cannot be opened


# ----------------------------------------------------------------------------- the API
def test_limits_are_checked_and_name_the_field():
    for field, value in (("cpu_s", 0), ("wall_s", -1.0), ("wall_s", float("nan")), ("cpu_s", float("inf")),
                         ("memory_mb", 0), ("output_bytes", 1.5), ("max_processes", True), ("wall_s", "5")):
        with pytest.raises(ValueError, match=f"SandboxLimits.{field} "):
            SandboxLimits(**{field: value})
    with pytest.raises(TypeError, match="code must be a str"):
        run_python(b"print(1)")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="limits must be a SandboxLimits"):
        run_python("print(1)", {"wall_s": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="_audit=False only in the namespace mode"):
        run_python("print(1)", _force_fallback=True, _audit=False)


def test_isolation_is_probed_once_and_reported():
    label = isolation_available()
    assert label == isolation_available()
    assert label.startswith("namespaces(user,pid,net,mount)") or label.endswith("rlimits+audit")
    assert run_python("pass").isolation == label
