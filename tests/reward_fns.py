"""Reward functions for tests of bad reward behaviour (imported inside Ray actors)."""

import math


def raises(prompts, completions):
    raise RuntimeError("this reward function always fails")


def wrong_length(prompts, completions):
    return [0.0] * (len(completions) + 1)


def nan_at_two(prompts, completions):
    return [math.nan if i == 2 else 1.0 for i in range(len(completions))]


def not_numbers(prompts, completions):
    return ["good"] * len(completions)


# tests/test_launch.py's reward-actor kill during the in-run evaluation: the environment of
# the launch (which its Ray workers inherit) names a folder and the evaluation's row count.
EVAL_MARKER_ENV, EVAL_ROWS_ENV = "PPO_RAY_TEST_EVAL_MARKER", "PPO_RAY_TEST_EVAL_ROWS"
EVAL_PID_FILE = "eval-score.pid"


def e_fraction_held_in_eval(prompts, completions):
    """ppo_ray.rewards.letter_e_fraction, except once: with EVAL_MARKER_ENV set, the first call
    that scores EVAL_ROWS_ENV rows (the evaluation's: eval_samples differs from the step's
    batch) writes this process's pid to <marker>/eval-score.pid and waits there to be killed.
    The restarted actor's redo finds the file and scores. Without the variables: plain."""
    import os
    import time
    from pathlib import Path

    from ppo_ray.rewards import letter_e_fraction

    folder, rows = os.environ.get(EVAL_MARKER_ENV), int(os.environ.get(EVAL_ROWS_ENV, "-1"))
    if folder and len(completions) == rows and not (Path(folder) / EVAL_PID_FILE).exists():
        tmp = Path(folder) / f".{EVAL_PID_FILE}.{os.getpid()}"
        tmp.write_text(str(os.getpid()))
        tmp.rename(Path(folder) / EVAL_PID_FILE)
        deadline = time.monotonic() + 600  # the test's SIGKILL ends this; past it, the test has failed already
        while time.monotonic() < deadline:
            time.sleep(0.1)
    return letter_e_fraction(prompts, completions)


# tests/test_deadlines.py's hanging reward function: the driver and the reward actor run on
# this machine and agree on the file (the actor's process is killed and restarted in between).
HANG_FILE = "ppo-ray-test-hang-reward"


def hang_file():
    import tempfile
    from pathlib import Path

    return Path(tempfile.gettempdir()) / HANG_FILE


def e_fraction_or_hang(prompts, completions):
    """ppo_ray.rewards.letter_e_fraction, except while hang_file() exists: then the call never
    returns (as a reward function stuck on a lock or a socket). A file that says "once" is
    removed first, so the call after the hung one (in the restarted actor) scores; "always"
    stays."""
    import threading

    from ppo_ray.rewards import letter_e_fraction

    path = hang_file()
    if path.exists():
        if path.read_text().strip() == "once":
            path.unlink()
        threading.Event().wait()  # forever: only the deadline's kill ends it
    return letter_e_fraction(prompts, completions)


# The reward pool's tests (tests/test_reward_pool.py): responses "r<i>" score i exactly; the
# row whose response is "r3" sleeps, raises or returns NaN.
def row_number(completion: str) -> float:
    return float(completion[1:])


def sleeps_on_r3(prompts, completions):
    import time

    if "r3" in completions:
        time.sleep(600)  # past any test's reward_timeout_s: the pool kills this worker
    return [row_number(c) for c in completions]


def raises_on_r3(prompts, completions):
    if "r3" in completions:
        raise ValueError("row r3 is bad")
    return [row_number(c) for c in completions]


def nan_on_r3(prompts, completions):
    return [math.nan if c == "r3" else row_number(c) for c in completions]


def numbers(prompts, completions):
    return [row_number(c) for c in completions]


# Reward functions that take the finish reasons (actors.reward.reward_columns): by naming them,
# or with **kwargs (which gets every column).
def ended_with_eos(prompts, completions, *, finish_reasons):
    return [1.0 if f == "stop" else 0.0 for f in finish_reasons]


def numbers_plus_ten_at_eos(prompts, completions, **columns):
    return [row_number(c) + 10.0 * (f == "stop") for c, f in zip(completions, columns["finish_reasons"])]


# tests/test_dynamic_sampling.py: a group's scores are equal when its prompt holds SAME_MARK, and
# differ otherwise (each row scores its position in the score call).
SAME_MARK = "SAME "


ALL_VARY_FILE = "ppo-ray-test-all-vary"  # in the temp folder: while it exists, no prompt counts as marked


def same_for_marked_prompts(prompts, completions):
    import tempfile
    from pathlib import Path

    marked = not (Path(tempfile.gettempdir()) / ALL_VARY_FILE).exists()
    return [1.0 if marked and SAME_MARK in p else float(i) for i, p in enumerate(prompts)]


# A reward function that takes a dataset column (PPOTrainer's rows: ppo_ray.data.PromptColumns):
# tests/test_columns.py's and the scorers' prompts start with their row's id, "#<id> ".
def row_id(prompts, completions, *, id):  # noqa: A002 - the dataset's column is called id
    """Each row's `id` column, where its prompt starts with "#<id> ", else -1: a value that
    reached another prompt's row scores -1."""
    return [float(i) if p.startswith(f"#{i} ") else -1.0 for p, i in zip(prompts, id)]
