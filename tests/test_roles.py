"""ppo_ray/driver/roles.py: the role names in Roles.all()'s order and how prompts are split across
generator replicas (the actor calls themselves run in test_trainer / test_faults)."""

from __future__ import annotations

import pytest

from ppo_ray.driver.roles import role_names, split_evenly


def test_role_names_follow_roles_all_order():
    assert role_names(2, 1) == ["generator-0", "generator-1", "reference", "reward", "learner"]
    assert role_names(1, 2) == ["generator-0", "reference", "reward", "learner-0", "learner-1"]


@pytest.mark.parametrize("n,parts,expected", [
    (10, 3, [(0, 4), (4, 7), (7, 10)]),  # the first n % parts chunks get one more
    (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),  # more parts than items: empty tail chunks
    (6, 1, [(0, 6)]),
])
def test_split_evenly_covers_every_item_once_in_order(n, parts, expected):
    assert split_evenly(n, parts) == expected
