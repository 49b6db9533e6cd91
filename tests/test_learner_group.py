"""The data-parallel learner group (config.num_learners, Learner.join_group): two learner
actors (gloo, each on its shard of every minibatch, gradients all-reduced) give the same
update as one learner on the same rollouts.

Tolerance: float32 rounding (helpers.update_tols, tests/tolerances.py), with SGD in
every learner (SGDLearnerHost: Adam would turn the rounding on a near-zero gradient entry
into a step of ~lr). The members run their micro-batches over other rows than one learner
does, so each micro-batch is trimmed to other widths (the padding-invariance tests'
rounding), and the group sums gradients in another order (the micro-batching invariance
tests'); nothing else differs: the losses are divided by the WHOLE minibatch's token count
on every member, so uneven shards (6 rows in minibatches of 3, split 2+1 rows, rows of
different lengths) change nothing. The members agree with each other exactly (the same
all-reduced gradients, the same steps).
"""

from __future__ import annotations

import pytest
import ray
import torch
from peft import set_peft_model_state_dict

from exact import rerun_if_last_digits_differ
from learner.learner import Learner
from ppo_ray.driver.hosts import LearnerHost
from ppo_ray.driver.roles import Roles, form_learner_group
from helpers import (assert_same_update, make_config, max_abs_diff, random_batch, rollout_inputs, update_tols,
                     with_sgd)

STAT_KEYS = ("policy_loss", "value_loss", "approx_kl", "clipfrac", "kl", "entropy", "value_mean", "explained_variance",
             "policy_grad_norm", "value_grad_norm")


class SGDLearnerHost(LearnerHost):
    """A learner actor whose learner steps with SGD (helpers.with_sgd). Imported by the
    Ray workers from this module (the tests folder is on their PYTHONPATH: conftest)."""

    def __init__(self, config, model_dir, value_model_dir):
        super().__init__(config, model_dir, value_model_dir)
        with_sgd(self.learner)


def learner_actor(config, path):
    return ray.remote(SGDLearnerHost).options(num_cpus=0).remote(config, path, None)


@pytest.mark.equality
@pytest.mark.parametrize("old_logprobs, mini_batch_size", [("learner", 3), ("generator", 3), ("generator", None)],
                         ids=["learner", "generator", "values-in-update"])
def test_two_learners_update_like_one(ray_session, tiny_path, special, old_logprobs, mini_batch_size):
    """Also with old_logprobs: generator (check_every 2: step 0 recomputes, step 1 takes the
    rollouts' logprobs and the members run only the value model's pass), and with one
    minibatch per epoch (old_values auto: update): each member's first value forwards, on its
    rows, give those rows' old values, summed across the group; at step 1 no no-grad pass runs."""
    config = make_config(batch_size=6, mini_batch_size=mini_batch_size, micro_batch_size=2, ppo_epochs=2,
                         old_logprobs=old_logprobs, old_logprobs_check_every=2)
    assert config.old_values_source == ("update" if mini_batch_size is None else "forward")
    single = learner_actor(config, tiny_path)
    group = [learner_actor(config, tiny_path) for _ in range(2)]
    form_learner_group(Roles([], None, None, group))
    local = Learner(config, tiny_path)  # only to make rollouts with realistic logprobs
    try:
        for step in range(2):  # the second step starts from the first's optimiser state
            batch, ref, scores = rollout_inputs(local, random_batch(special, n=6, seed=10 + step), seed=step)
            batch = batch.__class__(**{**batch.__dict__, "adapter_version": step})
            s1, w1, _ = ray.get(single.update.remote(ref, scores, batch))
            s2, w2, _, s3, w3, _ = ray.get([r for a in group for r in a.update.remote(ref, scores, batch)])
            assert w3 is None, "only rank 0 exports the adapter"
            assert w1.spec == w2.spec
            assert_same_update((s2, w2.tensors), (s1, w1.tensors), update_tols(config, batch, w1.tensors, step + 1),
                               keys=STAT_KEYS)
            for key in STAT_KEYS:
                assert getattr(s2, key) == getattr(s3, key), key  # members agree exactly
            assert s1.tokens == s2.tokens and s2.version == s3.version == step + 1
            states = ray.get([single.state_dict.remote(), *[a.state_dict.remote() for a in group]])
            for part in ("policy", "value"):
                a, b, c = (s.policy.tensors if part == "policy" else s.value for s in states)
                tol = update_tols(config, batch, a, step + 1)["weights"]
                torch.testing.assert_close(b, a, atol=tol, rtol=0, msg=lambda m, part=part: f"{part}: {m}")
                assert max_abs_diff(b, c) == 0.0, part  # identical members
            # the next step's rollouts are sampled with the updated adapter
            set_peft_model_state_dict(local.policy, w1.tensors)
            local.version = step + 1
    finally:
        for actor in (single, *group):
            ray.kill(actor)


@pytest.mark.equality
def test_a_member_without_rows_in_a_minibatch_still_steps(ray_session, tiny_path, special):
    """3 rows, minibatches of 1: the second member has no rows in any minibatch; the update
    still equals one learner's (its zero gradients are summed in)."""
    config = make_config(batch_size=3, mini_batch_size=1, micro_batch_size=1, ppo_epochs=1)
    single = learner_actor(config, tiny_path)
    group = [learner_actor(config, tiny_path) for _ in range(2)]
    form_learner_group(Roles([], None, None, group))
    local = Learner(config, tiny_path)
    try:
        batch, ref, scores = rollout_inputs(local, random_batch(special, n=3, seed=3), seed=3)
        s1, w1, _ = ray.get(single.update.remote(ref, scores, batch))
        s2, w2, _, _, _, _ = ray.get([r for a in group for r in a.update.remote(ref, scores, batch)])
        assert_same_update((s2, w2.tensors), (s1, w1.tensors), update_tols(config, batch, w1.tensors),
                           keys=("policy_loss",))
    finally:
        for actor in (single, *group):
            ray.kill(actor)


@pytest.mark.slow
@pytest.mark.parametrize("when", [pytest.param("before", marks=pytest.mark.matrix), "after"])
@rerun_if_last_digits_differ
def test_a_group_member_dying_in_the_update_leaves_the_run_as_straight(ray_session, tiny_model_dir, tmp_path, when):
    """A PPOTrainer with two learners: a straight 4-step run (checkpoints at 2 and 4), then
    the step-2 checkpoint restored and learner-1 dying in step 3's update, before or after
    its share of the work (after: learner-0 has stepped, alive, when the failure shows). The
    trainer waits for the restart, re-forms the group, restores both members from the
    committed state (no checkpoint read) and retries step 3: every step once in
    metrics.jsonl, the same numbers as the straight run (no tolerance)."""
    from helpers import tiny_test_config
    from ppo_ray.data import bundled_prompts
    from fault_injection import Fault, FaultyTrainer
    from helpers import assert_same_steps, from_step_two, metrics_steps

    straight_dir = tmp_path / "straight"
    straight_dir.mkdir()
    trainer = FaultyTrainer(tiny_test_config(steps=4, checkpoint_every=2, batch_size=8, max_new_tokens=10,
                                             num_learners=2, learner_num_cpus=0.5), run_dir=straight_dir)
    try:
        assert trainer.roles.names()[-2:] == ["learner-0", "learner-1"]
        straight = trainer.train(bundled_prompts(), metrics_path=straight_dir / "metrics.jsonl", progress=False)
        resumed_dir = tmp_path / "resumed"
        from_step_two(trainer, straight_dir, resumed_dir)
        trainer.inject_faults([Fault("learner-1", 3, "update", when)])
        resumed = trainer.train(bundled_prompts(), metrics_path=resumed_dir / "metrics.jsonl", progress=False)
        assert trainer.retries and trainer.retries[0]["role"] == "learner-1", trainer.retries
        assert_same_steps(resumed, straight)
        assert metrics_steps(resumed_dir / "metrics.jsonl") == [3, 4]
        versions = ray.get([learner.version.remote() for learner in trainer.roles.learners])
        assert versions == [trainer.version, trainer.version] == [4, 4]
    finally:
        trainer.shutdown()
