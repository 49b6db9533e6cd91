"""DAPO's dynamic sampling (config dynamic_sampling; Yu et al. 2025, section 3.2, eq. 11).

Without Ray: the filter (learner.algos.varying_groups) equals a float64 loop on random groups
with NaN rows, one-value groups and ties; the choice of groups (ppo_ray.trainer.pick_groups);
the joined reward stats; the config's rules; the console line.

On the real actors (one GRPO trainer for the module, a reward that is constant for marked
prompts and varies for the others, tests/reward_fns.py): a straight run of 3 steps whose
prompts are marked so that step 1 needs a second round, step 2 none and step 3 reaches the cap
and fills; each step trains on exactly the groups the rule picks (their scores are the reward's
known values), reports its rounds, kept share and filled groups, and the cursor holds every
prompt drawn. Then the run resumed at step 2 from its checkpoint, and step 3 retried after the
reward actor's death in its second round, each equal to the straight run's step 3 exactly.
"""

from __future__ import annotations

import logging
import math
import shutil

import pytest
import torch

from learner.algos import varying_groups
from ppo_ray.config import ConfigError
from ppo_ray.stats import DynamicSampling, RewardFailures, RewardStats
from ppo_ray.trainer import pick_groups


# ---------------------------------------------------------------------------------- the filter
def naive_varying(scores, groups) -> list[bool]:
    """Per row: its group has two finite scores that differ (Python floats: float64)."""
    s, g = [float(x) for x in scores], [int(x) for x in groups]
    out = []
    for i in range(len(s)):
        finite = [s[j] for j in range(len(s)) if g[j] == g[i] and math.isfinite(s[j])]
        out.append(len(finite) >= 2 and max(finite) > min(finite))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_varying_groups_equals_a_float64_loop(seed):
    """Random groups of 1-5 rows with scattered ids (not contiguous: the filter reads the ids),
    scores from a few values (ties and constant groups are common), NaN and inf rows."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 6, (12,), generator=g).tolist()
    ids = torch.randperm(500, generator=g)[: len(sizes)] * 3
    groups = torch.cat([torch.full((n,), int(i)) for n, i in zip(sizes, ids)])
    perm = torch.randperm(len(groups), generator=g)
    groups = groups[perm]
    scores = torch.randint(0, 3, (len(groups),), generator=g).float() / 2
    bad = torch.rand(len(groups), generator=g) < 0.2
    scores[bad] = torch.tensor([math.nan, math.inf, -math.inf])[torch.randint(0, 3, (int(bad.sum()),), generator=g)]
    got = varying_groups(scores, groups)
    assert got.dtype == torch.bool and got.shape == scores.shape
    assert got.tolist() == naive_varying(scores, groups)


def test_varying_groups_edge_cases():
    nan = math.nan
    scores = torch.tensor([1.0, 1.0,      # equal: constant
                           1.0, nan,      # one finite score: constant
                           nan, nan,      # none finite: constant
                           2.0, 2.0, 3.0,  # a tie and one different: varies
                           5.0,           # a group of one: constant
                           0.0, nan, 1.0,  # NaN between two that differ: varies
                           1.0, 1.0 + 2 ** -23])  # one float32 ulp apart: varies (compared exactly)
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 3, 4, 5, 5, 5, 6, 6])
    assert varying_groups(scores, groups).tolist() == [False] * 6 + [True] * 3 + [False] + [True] * 5
    with pytest.raises(ValueError, match="alike"):
        varying_groups(scores, groups[:-1])


def test_pick_groups_takes_the_first_varying_then_fills_with_the_first_constant():
    #            0      1     2      3     4     5      6     7
    varies = [False, True, False, True, True, False, True, True]
    assert pick_groups(varies, 4) == ([1, 3, 4, 6], 0)         # the varying group 7 is discarded
    assert pick_groups(varies[:4], 4) == ([0, 1, 2, 3], 2)     # the cap: both constant ones fill
    assert pick_groups([False] * 8, 4) == ([0, 1, 2, 3], 4)
    assert pick_groups([True, False, False, False, True], 2) == ([0, 4], 0)
    with pytest.raises(ValueError):
        pick_groups([True], 2)


def test_reward_stats_of_several_rounds_join_weighted_by_rows():
    a = RewardStats({"fn": 1.0, "rm": math.nan}, dropped_nonfinite=1.0, seconds=0.5,
                    failures=RewardFailures(timeouts=1.0))
    b = RewardStats({"fn": 4.0, "rm": 2.0}, dropped_nonfinite=2.0, seconds=0.25, failures=None)
    joined = RewardStats.join([a, b], [8, 4])
    assert joined.source_means == {"fn": (8 * 1.0 + 4 * 4.0) / 12, "rm": 2.0}
    assert joined.dropped_nonfinite == 3.0 and joined.seconds == 0.75 and joined.failures.timeouts == 1.0
    assert RewardStats.join([a], [8]) is a


def test_the_config_rules(tmp_path):
    from conftest import tiny_test_config

    with pytest.raises(ConfigError, match="dynamic_sampling.*samples_per_prompt >= 2"):
        tiny_test_config(dynamic_sampling=True)
    with pytest.raises(ConfigError, match="dynamic_sampling.*max_staleness 0"):
        tiny_test_config(dynamic_sampling=True, samples_per_prompt=2, max_staleness=1, lora_sync="tensor")
    with pytest.raises(ConfigError, match="dynamic_sampling_max_rounds"):
        tiny_test_config(dynamic_sampling=True, samples_per_prompt=2, dynamic_sampling_max_rounds=-1)
    config = tiny_test_config(dynamic_sampling=True, samples_per_prompt=2, advantage_estimator="gae")
    assert config.dynamic_sampling_max_rounds == 4  # any estimator; the default cap


def test_the_step_line_and_record_show_dynamic_sampling_only_when_it_is_on():
    from dataclasses import replace

    from ppo_ray.logs import format_step
    from test_stats import step_result

    off = step_result()
    assert "rounds" not in format_step(off) and not any(k.startswith("dynamic") for k in off.as_dict())
    on = replace(off, dynamic_sampling=DynamicSampling(rounds=2, kept_frac=0.625, filled=0))
    assert "  rounds 2 kept 62%  " in format_step(on)
    assert "  rounds 3 kept 12% filled 3  " in format_step(replace(on, dynamic_sampling=DynamicSampling(3, 0.125, 3)))
    assert {k: v for k, v in on.as_dict().items() if k.startswith("dynamic")} == {
        "dynamic_sampling_rounds": 2, "dynamic_sampling_kept_frac": 0.625, "dynamic_sampling_filled": 0}
