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
