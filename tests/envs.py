"""Environments for the tests of multi-turn episodes (imported inside Ray actors: the tests folder
is on the workers' PYTHONPATH, conftest.ray_session), following ppo_ray.environments' contract.

Steps: `row["turns"]` model turns (default 2), each ended by "." (a stop string) or EOS; each
step's reward is the share of the letter "e" in the action (ppo_ray.rewards.letter_e_fraction's
rule: a score that varies); the observation " ok." after every step but the last. Its faults,
named by the row (the tests' fault injection, from outside the product):
- `hang_turn` n: step n (1-based) sleeps for an hour, a stuck environment;
- `crash_file` path: if the file exists, step 1 deletes it and exits its process (os._exit),
  as a segfault would: once;
- `kill_pid_file` path: if the file exists, step 1 reads a pid from it, deletes it and
  SIGKILLs that process (the generator, mid-episode): once.
"""

from __future__ import annotations

import os
import signal
import time


def e_share(text: str) -> float:
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c == "e" for c in letters) / len(letters) if letters else 0.0


def expected_score(segments) -> float:
    """What Steps gives an episode with these ("model" | "env", text) segments: every model turn
    is stepped, its reward the e-share of its text."""
    return sum(e_share(text) for role, text in segments if role == "model")


class Steps:
    stop_strings = (".",)
    max_turns = 3

    def reset(self, row: dict, seed: int) -> str:
        self.row, self.turn = row, 0
        return ""

    def step(self, action: str) -> tuple[str, float, bool]:
        self.turn += 1
        row = self.row
        if row.get("hang_turn") == self.turn:
            time.sleep(3600)
        if self.turn == 1 and row.get("crash_file") and os.path.exists(row["crash_file"]):
            os.unlink(row["crash_file"])
            os._exit(1)
        if self.turn == 1 and row.get("kill_pid_file") and os.path.exists(row["kill_pid_file"]):
            with open(row["kill_pid_file"]) as f:
                pid = int(f.read())
            os.unlink(row["kill_pid_file"])
            os.kill(pid, signal.SIGKILL)
        done = self.turn >= int(row.get("turns", 2))
        return ("" if done else " ok."), e_share(action), done
