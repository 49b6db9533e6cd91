"""max_staleness 2 with 2 generator replicas and adapters from memory (lora_sync: tensor), on a
trainer of its own (real vLLM engines, HF scorers, PEFT learner): the deterministic lag
(the batch of step t is sampled with version max(0, t - 1 - k)), several adapter versions
alive in each engine, and the guarantees of the synchronous step kept: a resume from a
checkpoint taken with batches in flight, and a generator, the learner or a scorer killed
while later steps' batches are generating, each leave the run equal to a straight one.

Equality is tests/test_faults.py's rule for stale steps: the samples equal, the numbers
within the tiny model's float32 logprob tolerance (the PPO ratio's denominator is vLLM's own
logprob of each sample, which its CPU kernels reproduce to ~1e-7, not bit for bit), the
adapters within 1% of one Adam step per step. A lost, doubled or re-versioned batch moves
them by orders of magnitude more.
"""

from __future__ import annotations

import json

import pytest
import ray

from fault_injection import Fault, arm_bad_sync
from ppo_ray.data import bundled_prompts
from helpers import FAULT_EVERY as EVERY, FAULT_STEPS as STEPS, assert_same_fault_run, fault_run

pytestmark = pytest.mark.usefixtures("ray_session")

K = 2  # max_staleness


@pytest.fixture(scope="module")
def async_run(ray_session, tiny_model_dir, tmp_path_factory):
    """(trainer, snapshot at step 0, the straight run's Outcome and run directory)."""
    from helpers import tiny_test_config
    from fault_injection import FaultyTrainer

    trainer = FaultyTrainer(tiny_test_config(max_staleness=K, num_generators=2, lora_sync="tensor",
                                             max_actor_restarts=20, eval_every=EVERY, checkpoint_every=EVERY,
                                             report_to=[]))
    try:
        trainer.run_dir = tmp_path_factory.mktemp("async-snapshot")
        snapshot = trainer.save_checkpoint()
        run_dir = tmp_path_factory.mktemp("async-straight")
        straight = fault_run(trainer, run_dir)
        yield trainer, snapshot, straight, run_dir
    finally:
        trainer.shutdown()


def test_the_lag_is_a_function_of_the_step_and_versions_retire(async_run):
    """Step t trains on a batch sampled with version max(0, t - 1 - k), so stale_versions is
    min(t - 1, k); each replica then holds the k + 1 versions a batch in flight can need, the
    older ones retired (the engine's max_loras is k + 1)."""
    trainer, _, straight, _ = async_run
    assert [h["stale_versions"] for h in straight.history] == [min(t, K) for t in range(STEPS)]
    # the batches drawn ahead while each step's learner trained (none past the run's last step)
    assert [h["queue_depth"] for h in straight.history] == [min(K, STEPS - 1 - t) for t in range(STEPS)]
    assert ray.get(trainer.roles.generators[0].__ray_call__.remote(lambda host: host.generator._loop is not None))
    assert [h["adapter_version"] for h in straight.history] == list(range(1, STEPS + 1))
    held = ray.get([g.versions.remote() for g in trainer.roles.generators])
    assert held == [list(range(max(0, trainer.version - K), trainer.version + 1))] * 2, held
    assert all(h["sync_probe_gap"] <= trainer.config.logprob_gap_limit for h in straight.history)


def test_a_resume_with_batches_in_flight_equals_the_straight_run(async_run, tmp_path):
    """The checkpoint of step EVERY keeps the adapters its batches in flight were sampled with
    (behaviour/); a resume draws those batches again and samples them with those versions."""
    trainer, _, straight, run_dir = async_run
    ckpt = run_dir / "checkpoints" / f"step-{EVERY:06d}"
    kept = json.loads((ckpt / "trainer.json").read_text())["behaviour_versions"]
    assert kept == list(range(max(0, EVERY - K), EVERY)), kept
    assert sorted(p.name for p in (ckpt / "behaviour").iterdir()) == [f"v{v:06d}" for v in kept]
    copy = tmp_path / "run"
    import shutil

    shutil.copytree(run_dir, copy)
    trainer.restore(copy / "checkpoints" / f"step-{EVERY:06d}")
    history = trainer.train(bundled_prompts(), steps=STEPS - EVERY, progress=False)
    want = straight.history[EVERY:]
    for g, w in zip(history, want):
        assert g.generated_texts == w.generated_texts, f"step {g['step']}: other samples"
        assert g["stale_versions"] == w["stale_versions"]
        for key in ("reward_mean", "kl", "policy_loss", "value_loss", "first_minibatch_ratio_mean"):
            assert abs(g[key] - w[key]) <= 1e-5 * (1 + abs(w[key])), (g["step"], key, g[key], w[key])


def test_a_resume_checks_each_older_version_it_loads_again(async_run, tmp_path, caplog):
    """A resume gives every replica the versions of the batches in flight again (behaviour/),
    and each gets the sync check before it samples: the learner scores the probe with that
    version's adapter and takes its own back. generator-1's first load (the oldest version) is
    made a bad one (a LoRA B matrix nudged): under logprob_gap_check error the resume stops
    naming the replica and the version; under resync the check loads it again, and the resumed
    step samples what the straight run sampled."""
    import logging
    import re
    import shutil

    from ppo_ray.trainer import LogprobGapError

    trainer, _, straight, run_dir = async_run
    shutil.copytree(run_dir, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / f"step-{EVERY:06d}"
    oldest = json.loads((ckpt / "trainer.json").read_text())["behaviour_versions"][0]
    named = f"generator replica(s) [1], given adapter version {oldest} again"
    assert trainer.config.logprob_gap_check == "error"
    arm_bad_sync(trainer.roles, "generator-1", "perturbed")
    with pytest.raises(LogprobGapError, match=re.escape(named)):
        trainer.restore(ckpt)
    base = trainer.config
    trainer.config = base.replace(logprob_gap_check="resync")
    try:
        arm_bad_sync(trainer.roles, "generator-1", "perturbed")
        with caplog.at_level(logging.WARNING, logger="ppo_ray.trainer"):
            trainer.restore(ckpt)
        assert named in caplog.text, caplog.text
        assert "loading it again" in caplog.text and "persists" not in caplog.text
        (step,) = trainer.train(bundled_prompts(), steps=1, progress=False)
    finally:
        trainer.config = base
    want = straight.history[EVERY]
    assert step.generated_texts == want.generated_texts
    for key in ("kl", "policy_loss", "first_minibatch_ratio_mean"):  # the learner's own weights came back
        assert abs(step[key] - want[key]) <= 1e-5 * (1 + abs(want[key])), (key, step[key], want[key])


@pytest.mark.parametrize("role,phase,when,offset", [
    ("generator-1", "prefetch", "before", 1),  # dies before sampling the next step's batch
    ("generator-1", "prefetch", "after", 1),   # dies with it sampled
    ("learner", "update", "after", 2),         # an update lost while a batch is in flight
    ("reward", "score", "before", 2),
], ids=lambda v: str(v))
def test_an_actor_killed_mid_stream_leaves_the_run_as_if_it_had_not_happened(async_run, tmp_path, role, phase,
                                                                             when, offset):
    trainer, snapshot, straight, _ = async_run
    trainer.restore(snapshot)
    start = trainer.step
    before = len(trainer.retries)
    trainer.inject_faults([Fault(role, start + offset, phase, when)])
    try:
        got = fault_run(trainer, tmp_path)
    finally:
        trainer.inject_faults([])
    failures = trainer.retries[before:]
    assert failures and failures[0]["role"] == role, failures
    assert_same_fault_run(got, straight, False, role, trainer.config.learning_rate)
    held = ray.get([g.versions.remote() for g in trainer.roles.generators])
    assert all(h[-1] == trainer.version for h in held), held


def test_a_resume_under_merged_sync_and_max_staleness_1_equals_the_straight_run(tiny_trainer, tmp_path):
    """Merged sync holds one set of weights, so after a resume the batch that was in flight
    (sampled with the version before the checkpoint's) goes into the generator first, then the
    checkpoint's version: the resumed step equals the straight run's. On the session trainer
    (merged sync on the CPU)."""
    trainer = tiny_trainer
    base = trainer.config
    trainer.config = base.replace(max_staleness=1, eval_every=0, checkpoint_every=EVERY, report_to=[])
    assert trainer.config.lora_sync_mode == "merged"
    try:
        trainer.restore(trainer.initial_checkpoint)
        trainer.run_dir = tmp_path
        straight = trainer.train(bundled_prompts(), steps=EVERY + 1, progress=False)
        trainer.run_dir = None
        start = straight[0]["step"] - 1
        ckpt = tmp_path / "checkpoints" / f"step-{start + EVERY:06d}"
        assert json.loads((ckpt / "trainer.json").read_text())["behaviour_versions"] == [start + EVERY - 1]
        trainer.restore(ckpt)
        resumed = trainer.train(bundled_prompts(), steps=1, progress=False)
    finally:
        trainer.config = base
        trainer.run_dir = None
    want = straight[-1]
    got = resumed[0]
    assert got["step"] == want["step"] and got["stale_versions"] == want["stale_versions"] == 1
    assert got.generated_texts == want.generated_texts
    for key in ("reward_mean", "kl", "policy_loss", "value_loss", "first_minibatch_ratio_mean"):
        assert abs(got[key] - want[key]) <= 1e-5 * (1 + abs(want[key])), (key, got[key], want[key])


SEGMENT = 4  # partial_rollout_tokens in the continue cases (the test config samples up to 12 tokens)


@pytest.fixture(scope="module")
def continue_run(async_run, tmp_path_factory):
    """async_run's trainer under partial_rollout continue: its straight run from the snapshot."""
    trainer, snapshot, _, _ = async_run
    base = trainer.config
    trainer.config = base.replace(partial_rollout="continue", partial_rollout_tokens=SEGMENT)
    try:
        trainer.restore(snapshot)
        run_dir = tmp_path_factory.mktemp("continue-straight")
        yield trainer, snapshot, fault_run(trainer, run_dir), run_dir
    finally:
        trainer.config = base


@pytest.mark.slow  # a straight run of its own and a resume; tests/test_generator.py covers the rule fast
def test_a_partial_rollout_goes_on_with_newer_versions_and_resumes_exactly(continue_run, async_run, tmp_path):
    """partial_rollout continue: the batch of step t = 2 (version 0; its step's synchronous version
    is 2) samples its first SEGMENT tokens with version 0 and the rest with version 1, so its
    tokens are between 1 and 2 versions behind; the steps before have no newer version to go on
    with and equal the finish run's. A resume from the checkpoint of step EVERY, with that batch
    in flight, samples it again the same way."""
    trainer, _, straight, run_dir = continue_run
    finish = async_run[2]
    stale = [h["stale_versions"] for h in straight.history]
    assert stale[:2] == [0, 1] and 1 < stale[2] < 2, stale
    for got, want in zip(straight.history[:2], finish.history[:2]):
        assert got.generated_texts == want.generated_texts
    ckpt = run_dir / "checkpoints" / f"step-{EVERY:06d}"
    import shutil

    shutil.copytree(run_dir, tmp_path / "run")
    trainer.restore(tmp_path / "run" / "checkpoints" / ckpt.name)
    history = trainer.train(bundled_prompts(), steps=STEPS - EVERY, progress=False)
    for g, w in zip(history, straight.history[EVERY:]):
        assert g.generated_texts == w.generated_texts, f"step {g['step']}: other samples"
        assert g["stale_versions"] == w["stale_versions"]
        for key in ("reward_mean", "kl", "policy_loss", "value_loss", "first_minibatch_ratio_mean"):
            assert abs(g[key] - w[key]) <= 1e-5 * (1 + abs(w[key])), (g["step"], key, g[key], w[key])


@pytest.mark.slow
def test_a_generator_killed_during_partial_rollouts_leaves_the_run_as_if_it_had_not_happened(continue_run, tmp_path):
    """A replica dies before sampling the batches in flight (whose later segments wait for
    versions not trained yet): they are sampled again by the same rule, and the run equals the
    straight one."""
    trainer, snapshot, straight, _ = continue_run
    trainer.restore(snapshot)
    start = trainer.step
    before = len(trainer.retries)
    trainer.inject_faults([Fault("generator-1", start + 1, "prefetch", "before")])
    try:
        got = fault_run(trainer, tmp_path)
    finally:
        trainer.inject_faults([])
    failures = trainer.retries[before:]
    assert failures and failures[0]["role"] == "generator-1", failures
    assert_same_fault_run(got, straight, False, "generator-1", trainer.config.learning_rate)
