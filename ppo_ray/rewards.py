"""Reward sources: the reward-function type, the one check of a config's reward sources,
and small programmatic reward functions, named in configs as "ppo_ray.rewards:<name>".

A reward function is named "package.module:function" and called as
fn(prompts: list[str], completions: list[str]) -> list[float]: one float per completion.
It is imported only from the module path the user named (never from data).

`check_reward_sources` is the one home of the reward-source checks: launch.py (before
anything is written), PPOTrainer (before any actor starts) and the reward actor
(actors/reward.py) all call it, and every problem it finds is a RewardError naming the bad
source (a reward-model path that is not a model directory is a FileNotFoundError from
ppo_ray.paths.resolve_model_path, like every model path).

This module imports nothing heavy at import time (a reward function named here is imported
by the reward actor and by launch.py's checks); the reward model's check loads transformers
when called. The functions at the bottom are for smoke runs and tests of the loop itself (a
signal any policy can climb); the bundled TL;DR task's reward model and gold judge live
with the task.
"""

from __future__ import annotations

import importlib
from typing import Callable, Optional, Sequence

from ppo_ray.paths import resolve_model_path

RewardFn = Callable[[list[str], list[str]], Sequence[float]]


class RewardError(ValueError):
    """A reward source failed or returned unusable values; the message names it."""


def import_reward_fn(spec: str) -> RewardFn:
    """Import "package.module:function" (only that module, as the user named it)."""
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise RewardError(f"reward function {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(f"reward function {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise RewardError(f"reward function {spec!r}: module {module_name!r} has no callable {fn_name!r}")
    return fn


def check_reward_model(name: str) -> None:
    """Cheap checks of reward_model_name from its config.json alone (no weights loaded), so a
    path that is not a reward model fails before any actor starts: a directory without
    config.json or a file (FileNotFoundError, from resolve_model_path), an unreadable config
    (RewardError "is not a loadable model"), num_labels != 1, or a checkpoint saved as
    anything but *ForSequenceClassification (a causal LM: RewardError)."""
    from transformers import AutoConfig

    path = resolve_model_path(name)
    try:
        cfg = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise RewardError(f"reward model {name!r} is not a loadable model: {e}") from e
    archs = list(getattr(cfg, "architectures", None) or [])
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise RewardError(
            f"reward model {name!r} is a {'/'.join(archs)} checkpoint, not a sequence-classification reward "
            "model: loading it as one would give it a randomly initialised score head, whose scores are noise. "
            "Name a checkpoint saved from AutoModelForSequenceClassification (num_labels=1), e.g. the rm/ "
            "directory of `launch.py rm`")
    # after the architecture: transformers gives a config without id2label num_labels=2
    if getattr(cfg, "num_labels", 1) != 1:
        raise RewardError(f"reward model {name!r} has num_labels={cfg.num_labels}; a reward model needs 1")


def check_reward_sources(reward_model_name: Optional[str], reward_funcs: Sequence[str],
                         reward_weights: Sequence[float] = ()) -> list[tuple[str, RewardFn]]:
    """The reward sources' checks, in one place (launch.py, PPOTrainer and the reward actor
    call it): at least one source, every reward function imports, the reward model is one
    (check_reward_model: its config.json, no weights loaded), and reward_weights, when given,
    has one weight per source (reward model first, then reward_funcs). Returns the imported
    functions as (spec, fn) in config order; raises RewardError naming the bad source."""
    if reward_model_name is None and not reward_funcs:
        raise RewardError("no reward source: set reward_model_name and/or reward_funcs in the config")
    funcs = [(spec, import_reward_fn(spec)) for spec in reward_funcs]
    if reward_model_name is not None:
        check_reward_model(reward_model_name)
    n = len(funcs) + (reward_model_name is not None)
    if reward_weights and len(reward_weights) != n:
        raise RewardError(f"reward_weights has {len(reward_weights)} entries for {n} reward sources "
                          "(reward model first, then reward_funcs)")
    return funcs


# ----------------------------------------------------------------------------- reward functions
def letter_e_fraction(prompts: list[str], completions: list[str]) -> list[float]:
    """Fraction of the completion's characters that are the letter "e" (0 for empty)."""
    return [c.count("e") / len(c) if c else 0.0 for c in completions]


def brevity(prompts: list[str], completions: list[str]) -> list[float]:
    """Minus the completion's length in characters divided by 100 (shorter is better)."""
    return [-len(c) / 100.0 for c in completions]
