"""ppo_ray/code_tool.py: the built-in Python tool, through its environment API (reset, then step on
each model turn, as the episode loop calls it).

The hostile cases (an infinite loop, a fork bomb, an 8 GiB allocation, a connection to a server
on 127.0.0.1, a write outside the sandbox directory, a read of a run directory) each come back as
an error observation (tool_error) and the episode goes on; the call ends within the sandbox's
wall time and its grace, and the host is as it was. They run in the mode run_python picks here;
tests/test_sandbox.py runs the sandbox itself in every mode. Plus: ordinary code's output, the
final answer's reward, the same observation for the same code (replay), the step's info.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from helpers import (assert_no_leftovers, processes_now, rss_bytes, tcp_server, world_readable_secret,
                     world_writable_dir)
from ppo_ray.code_tool import PythonTool
from ppo_ray.environments import EnvCall, EnvHolder, EpisodeLimits, load_environment
from ppo_ray.sandbox import SandboxLimits, isolation_available

ROW = {"prompt": "What is 6 * 7?", "answer": "42"}
# the sandbox's own bound (its wall time, then the caller's 3 s grace) and slack for a loaded machine
BOUND_S = PythonTool.limits.wall_s + 3.0 + 5.0


def call(code: str, row: dict = ROW, tool: type = PythonTool) -> tuple[str, float, bool, dict]:
    """One tool call in a fresh episode: reset, then a turn that ends at the stop string."""
    env = tool()
    assert env.reset(dict(row), 0) == ""
    return env.step(f"Let me run it. <python>\n{code}\n</python>")


def hostile(code: str) -> str:
    """A hostile tool call: an error observation, the episode going on, within BOUND_S, and no
    process left behind. Returns the observation."""
    isolation_available()  # the once-per-process probe, outside the timed call
    before = processes_now()
    started = time.monotonic()
    observation, reward, done, info = call(code)
    assert time.monotonic() - started < BOUND_S
    assert (reward, done, info) == (0.0, False, {"tool_call": True, "tool_error": True}), observation
    assert observation.startswith("\n<output>\n") and observation.endswith("]\n</output>\n"), observation
    assert "\n[error: " in observation, observation
    assert_no_leftovers(before)
    return observation


def printed(observation: str) -> str:
    """The code's stdout in an observation (before its stderr and error)."""
    return observation.removeprefix("\n<output>\n").split("[stderr]")[0].split("[error: ")[0]


# ----------------------------------------------------------------------------- ordinary use
def test_ordinary_code_prints_its_output():
    assert call("print(2 + 3)") == ("\n<output>\n5\n</output>\n", 0.0, False, {"tool_call": True, "tool_error": False})
    assert call("x = 1") == ("\n<output>\n[no output]\n</output>\n", 0.0, False,
                             {"tool_call": True, "tool_error": False})
    env = PythonTool()
    env.reset(ROW, 0)  # the turn's last block runs; indented code is dedented
    assert env.step("<python>print(1)</python> no, <python>\n    print(2)\n</python>")[0] == "\n<output>\n2\n</output>\n"


def test_an_error_is_an_observation_and_the_episode_goes_on():
    observation, reward, done, info = call("print('before')\n1 / 0")
    assert (reward, done, info) == (0.0, False, {"tool_call": True, "tool_error": True})
    assert observation.startswith("\n<output>\nbefore\n[stderr]\nTraceback")
    assert 'File "/sandbox/main.py", line 2' in observation and "ppo-ray-sandbox-" not in observation
    assert observation.endswith("ZeroDivisionError: division by zero\n[error: exit code 1]\n</output>\n")


def test_the_final_answer_is_scored_against_the_rows_answer():
    def final(text: str, row: dict) -> tuple:
        env = PythonTool()
        env.reset(row, 0)
        return env.step(text)

    assert final("6 * 7 = 42.", ROW) == ("", 1.0, True, {"tool_call": False})
    assert final("It is 42, or maybe 43.", ROW) == ("", 0.0, True, {"tool_call": False})  # the last number
    assert final("No idea.", ROW)[1] == 0.0
    assert final("The answer is 1042", ROW)[1] == 0.0  # a maximal run of digits
    assert final("x = -5", {"answer": -5})[1] == 1.0 and final("x = 5", {"answer": -5})[1] == 0.0
    assert final("42", {"answer": 42.0})[1] == 1.0
    assert final("42", {"prompt": "no answer column"}) == ("", 0.0, True, {"tool_call": False})
    assert final("42", {"answer": None})[1] == 0.0
    for bad in ("4.2", "forty-two", True):
        with pytest.raises(ValueError, match=f"the row's answer {bad!r} is not an integer"):
            PythonTool().reset({"answer": bad}, 0)


def test_the_same_code_gives_the_same_observation():
    """A replayed step (a worker rebuilt after a restart) reruns the code: a set of strings, a
    hash, the sandbox directory and a traceback read the same every time."""
    code = ("import os\nprint({'apple', 'banana', 'cherry', 'date', 'elder'})\nprint(hash('x'), os.getcwd())\n"
            "raise KeyError('k')")
    first, second = call(code), call(code)
    assert first == second and "KeyError: 'k'" in first[0], (first, second)
    assert "/sandbox\n" in first[0] and "ppo-ray-sandbox-" not in first[0]


def test_a_rebuilt_environment_replays_to_the_same_outcome():
    """Through EnvHolder, as an environment worker calls it: a holder that never saw the episode
    rebuilds the environment from the call's history (reset, then the earlier actions) and answers
    the last step as the holder that ran it all."""
    actions = ("<python>\ns = {'x', 'y', 'z', 'w'}\nprint(s)\n</python>", "<python>\nprint(sorted('cab'))\n</python>",
               "So 42.")
    live, rebuilt = EnvHolder(load_environment("python")), EnvHolder(load_environment("python"))
    live.call(EnvCall("e", ROW, 3))
    outcomes = [live.call(EnvCall("e", ROW, 3, actions[:n])) for n in (1, 2, 3)]
    assert [(o.tool_call, o.tool_error, o.done, o.reward) for o in outcomes] == [
        (True, False, False, 0.0), (True, False, False, 0.0), (False, False, True, 1.0)]
    again = rebuilt.call(EnvCall("e", ROW, 3, actions[:2]))
    assert (again.observation, rebuilt.replays) == (outcomes[1].observation, 1)


def test_the_tool_declares_its_stop_string_turns_and_limits():
    limits = EpisodeLimits().of(PythonTool())
    assert (limits.stop_strings, limits.max_turns) == (("</python>",), PythonTool.max_turns)
    assert load_environment("python") is PythonTool

    class Terse(PythonTool):  # the limits are a class attribute: a subclass changes them
        limits = SandboxLimits(output_bytes=8)

    assert call("print('a' * 100)", tool=Terse)[0] == "\n<output>\naaaaaaaa\n[truncated]\n</output>\n"


# ----------------------------------------------------------------------------- hostile code
def test_an_infinite_loop_is_stopped():
    observation = hostile("while True:\n    pass")
    assert "[error: cpu time limit (2 s)]" in observation or "[error: timeout (wall 5 s)]" in observation


def test_a_fork_bomb_is_contained():
    observation = hostile("import os\nwhile True:\n    os.fork()")
    assert printed(observation) == ""
    assert subprocess.run(["true"], timeout=30).returncode == 0  # the host can still start a process


def test_an_8_gib_allocation_fails_without_touching_the_host():
    rss = rss_bytes()
    observation = hostile("x = bytearray(8 * 1024**3)\nprint('allocated')")
    assert printed(observation) == "" and "[error: memory limit (512 MiB): MemoryError]" in observation
    assert rss_bytes() - rss < 50 * 1024 ** 2


def test_no_connection_to_a_server_on_127_0_0_1():
    with tcp_server() as (port, accepted):
        observation = hostile(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                              "s.sendall(b'hello')\nprint('connected')")
    assert printed(observation) == "" and "PermissionError" in observation
    assert accepted == []


def test_no_write_outside_the_sandbox_directory(tmp_path):
    with world_writable_dir() as shared:
        for target in (tmp_path / "escape.txt", shared / "escape.txt"):
            observation = hostile(f"open({str(target)!r}, 'w').write('escaped')\nprint('wrote it')")
            assert printed(observation) == "" and "Error" in observation
            assert not target.exists()
        assert list(shared.iterdir()) == []


def test_no_read_of_a_run_directory(tmp_path):
    secret = "run-secret-3c9b41"
    private = tmp_path / "run" / "secret.txt"
    private.parent.mkdir()
    private.write_text(secret)
    with world_readable_secret(secret) as readable:
        for path in (private, readable):
            code = (f"import os\npath = {str(path)!r}\ntry:\n    print(os.listdir(os.path.dirname(path)))\n"
                    "except OSError as e:\n    print(type(e).__name__)\nprint(open(path).read())")
            assert secret not in hostile(code)
