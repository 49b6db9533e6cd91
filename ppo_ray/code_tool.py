"""The built-in Python tool (`environment: python`): the model writes code, ppo_ray.sandbox runs
it, and what it printed is the next observation; a turn without code is the final answer.

The format the model must write (its prompt says so; the stop string ends a turn at the tag):

    I will add them up. <python>
    print(sum(range(1, 101)))
    </python>                       -> observation "\\n<output>\\n5050\\n</output>\\n", reward 0
    The sum is 5050.                -> done, reward 1.0 where the row's answer is 5050

A turn's tool call is its last <python>CODE</python> block (the turn ends at "</python>", so
it is usually the only one). CODE, dedented and without the blank lines around it (a
traceback's line 1 is its first line), runs in a fresh sandboxed interpreter under
PythonTool.limits (a class attribute: subclass to change it): 2 CPU seconds, 5 s of wall
clock, 512 MiB of address space, 16 processes, 1 KiB each of stdout and stderr, no network,
a fresh directory and none of the caller's environment (ppo_ray/sandbox.py: namespaces where
the machine allows, else rlimits and an audit hook). The observation is what the code
printed, then its stderr and the error, if any ("[error: timeout (wall 5 s)]", "[error: exit
code 1]" after a traceback): an error is an observation like any other, the episode goes on,
and the step's info says tool_error. A tool call's reward is 0. A turn with no tool call ends
the episode: reward 1.0 where the row has an "answer" and the turn's last number (a maximal
run of ASCII digits, with its minus sign) equals it, else 0.0; an answer that is not an
integer fails the episode's reset, naming it. Nothing of the row or the action is evaluated
in this process: code runs only in the sandbox.

Determinism: a replayed episode (a retried step, a worker rebuilt after a restart) calls the
sandbox again, so the same code must print the same observation. It does for deterministic
code: the sandbox fixes the str hash seed (a set of strings prints in the same order every
time), and the sandbox directory's random name (in a traceback, os.getcwd()) reads "/sandbox"
here. Not for code that reads the clock, `random` (seeded from os.urandom), object addresses
(id(), a default repr), or whose end is a limit: an endless loop stops at the CPU limit, or on
a loaded machine at the wall clock, having printed more or less by then.

Bottom layer: the standard library and ppo_ray.sandbox only.
"""

from __future__ import annotations

import math
import numbers
import re
import textwrap
from typing import Optional

from ppo_ray.sandbox import DIR_PREFIX, SandboxLimits, SandboxResult, run_python

OPEN, CLOSE = "<python>", "</python>"
NUMBER = re.compile(r"-?[0-9]+")                 # a number in the final answer: its last one counts
# the sandbox directory (mkdtemp's random name), with the path above it where there is one
_SANDBOX_DIR = re.compile(r"(?:(?:/[^/\s'\"]+)*/)?" + re.escape(DIR_PREFIX) + r"[a-z0-9_]+")


def tool_call(action: str) -> Optional[str]:
    """The code of the action's last <python>CODE</python> block, dedented, its blank lines around
    dropped (a traceback's line 1 is the code's first line); None: no tool call."""
    end = action.rfind(CLOSE)
    start = action.rfind(OPEN, 0, end) if end >= 0 else -1
    if start < 0:
        return None
    return textwrap.dedent(action[start + len(OPEN):end]).strip("\n")


def observation(result: SandboxResult) -> str:
    """What the model reads after its tool call: the sandbox's observation (output, stderr, error)
    in <output> tags, the sandbox directory's random path shown as "/sandbox"."""
    return f"\n<output>\n{_SANDBOX_DIR.sub('/sandbox', result.observation())}\n</output>\n"


def row_answer(row: dict) -> Optional[int]:
    """The row's "answer" as an integer; None where it has none. An answer that is not an integer
    (a number of digits, an integer type, an integral float) is a ValueError naming it: no final answer
    could ever match it."""
    value = row.get("answer")
    if value is None:
        return None
    if isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]+\s*", value):
        return int(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # numpy's too
        return int(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise ValueError(f"python tool: the row's answer {value!r} is not an integer (the final answer's last "
                     "number is compared with it)")


def answer_reward(action: str, answer: Optional[int]) -> float:
    """1.0 where there is an answer and the action's last number equals it, else 0.0."""
    numbers = NUMBER.findall(action)
    return float(answer is not None and bool(numbers) and int(numbers[-1]) == answer)


class PythonTool:
    """The environment (the module doc): reset keeps the row's answer; step runs a tool call in the
    sandbox, or scores the final answer."""

    stop_strings = (CLOSE,)
    max_turns = 4
    limits = SandboxLimits(cpu_s=2.0, wall_s=5.0, memory_mb=512, output_bytes=1024, max_processes=16)

    def reset(self, row: dict, seed: int) -> str:
        self.answer = row_answer(row)
        return ""

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        code = tool_call(action)
        if code is None:
            return "", answer_reward(action, self.answer), True, {"tool_call": False}
        result = run_python(code, self.limits)
        return observation(result), 0.0, False, {"tool_call": True, "tool_error": result.error is not None}
