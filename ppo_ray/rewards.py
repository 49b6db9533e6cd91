"""Small programmatic reward functions, named in configs as "ppo_ray.rewards:<name>".

Each takes (prompts, completions) and returns one float per completion. They are for
smoke runs and tests of the loop itself (a signal any policy can climb); the bundled
TL;DR task's reward model and gold judge live with the task.
"""

from __future__ import annotations


def letter_e_fraction(prompts: list[str], completions: list[str]) -> list[float]:
    """Fraction of the completion's characters that are the letter "e" (0 for empty)."""
    return [c.count("e") / len(c) if c else 0.0 for c in completions]


def brevity(prompts: list[str], completions: list[str]) -> list[float]:
    """Minus the completion's length in characters divided by 100 (shorter is better)."""
    return [-len(c) / 100.0 for c in completions]
