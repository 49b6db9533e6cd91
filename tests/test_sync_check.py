"""The sync check has no blind spot: a bad sync is caught in the step where it happens, in
every mode, the run repairs it (re-sync) and goes on exactly as a straight run would.

A bad sync is injected with BadSync (tests/fault_injection.py): generator-0's load after step 1 either
keeps the old weights while reporting the new version ("previous": a lost sync) or loads
the new weights with one LoRA B matrix nudged ("perturbed": a corrupted transfer). Before
the sync check, such a sync was caught only on fresh steps whose learner recomputed the old
logprobs; with max_staleness 1 (every step after the first is stale) or old_logprobs:
generator (checked at 1 of every old_logprobs_check_every versions) it went unseen.

Real Ray actors, vLLM and PEFT on the tiny model, float32 (tolerance 1e-3: generator and
learner agree to ~1e-6 there; the injected faults move the probe's logprobs by far more).
The default run covers the synchronous adapter-sync trainer (the session's shared one); the
other modes (overlap, generator old logprobs, merged sync) each need their own actors and
run with -m slow.
"""

from __future__ import annotations

import contextlib
import math

import pytest

import exact
from helpers import steps_of, tiny_test_config
from ppo_ray.data import bundled_prompts
from fault_injection import BadSync

KEYS = ("reward_mean", "kl", "policy_loss", "value_loss", "approx_kl", "clipfrac", "entropy",
        "explained_variance", "adapter_version", "response_tokens")
STEPS = 3


def three_steps(trainer, start, faults=()):
    trainer.restore(start)
    trainer.inject_faults(list(faults))
    return trainer.train(bundled_prompts(), steps=STEPS, progress=False)


def assert_same(repaired, straight):
    assert len(repaired) == len(straight)
    exact.assert_same(steps_of(repaired, KEYS), steps_of(straight, KEYS), "after a repaired bad sync vs straight")


def check_modes(trainer, start, kind):
    """Straight, then the bad sync under resync (caught at step 1, repaired, same metrics),
    then under warn (the injection is real: the probe's gap at step 1 is over the tolerance)."""
    base = trainer.config
    limit = base.logprob_gap_limit
    try:
        trainer.config = base.replace(logprob_gap_check="resync")
        straight = three_steps(trainer, start)
        repaired = three_steps(trainer, start, [BadSync(step=1, kind=kind)])
        trainer.config = base.replace(logprob_gap_check="warn")
        unrepaired = three_steps(trainer, start, [BadSync(step=1, kind=kind)])
    finally:
        trainer.config = base
        trainer.inject_faults([])
    assert [h["sync_resyncs"] for h in straight] == [0] * STEPS
    assert all(h["sync_probe_gap"] <= limit for h in straight)
    assert [h["sync_resyncs"] for h in repaired] == [1] + [0] * (STEPS - 1)  # caught in its step
    assert all(h["sync_probe_gap"] <= limit for h in repaired)  # the gap after the re-sync
    assert_same(repaired, straight)
    assert unrepaired[0]["sync_probe_gap"] > limit and unrepaired[0]["sync_resyncs"] == 0
    return straight, unrepaired


@pytest.mark.parametrize("kind", ["previous", "perturbed"])
@exact.rerun_if_last_digits_differ
def test_a_bad_sync_is_caught_in_its_step_and_repaired(tiny_trainer, kind):
    """Synchronous steps, the learner's old logprobs, adapter sync (the shared trainer)."""
    _, unrepaired = check_modes(tiny_trainer, tiny_trainer.initial_checkpoint, kind)
    # left alone (warn), the wrong generator sampled step 2: its rollouts fail the rollout check
    assert unrepaired[1]["gen_logprob_max_abs_diff"] > tiny_trainer.config.logprob_gap_limit


def test_a_failed_rollout_check_resyncs_and_samples_the_step_again(tiny_trainer, caplog):
    """The rollout check (fresh steps) acts too: a generator whose rollouts disagree with the
    learner is re-synced, checked, and the step sampled again; with a gap that no re-sync
    can mend (a tolerance below float32 agreement), the run stops with an error naming it."""
    from ppo_ray.trainer import LogprobGapError

    base = tiny_trainer.config
    tiny_trainer.restore(tiny_trainer.initial_checkpoint)
    try:
        tiny_trainer.config = base.replace(logprob_gap_check="resync", logprob_gap_tolerance=1e-12)
        with caplog.at_level("WARNING", logger="ppo_ray.trainer"), \
                pytest.raises(LogprobGapError, match="persists after a re-sync"):
            tiny_trainer.ppo_step(bundled_prompts()[:4])
    finally:
        tiny_trainer.config = base
    assert "re-syncing the generators to version 0 and sampling the step again" in caplog.text
    assert tiny_trainer.version == 0  # nothing committed


def test_the_sync_check_is_cheap_and_reported(tiny_trainer):
    """Its gap and seconds are in every step's record (metrics.jsonl, TensorBoard and the
    Prometheus gauge ppo_sync_probe_gap take it from there)."""
    from ppo_ray.driver.metrics import STEP_GAUGES

    out = tiny_trainer.ppo_step(bundled_prompts()[:4])
    assert 0.0 <= out["sync_probe_gap"] <= tiny_trainer.config.logprob_gap_limit
    assert out["sync_resyncs"] == 0 and out["time/sync_check_s"] > 0
    assert {"sync_probe_gap", "sync_resyncs"} <= set(STEP_GAUGES)
    base = tiny_trainer.config
    try:
        tiny_trainer.config = base.replace(logprob_gap_check="off")
        off = tiny_trainer.ppo_step(bundled_prompts()[:4])
    finally:
        tiny_trainer.config = base
    assert math.isnan(off["sync_probe_gap"]) and off["time/sync_check_s"] == 0.0


# CI runs the two modes that hold every mode's parts between them (overlap with the generator's
# logprobs and merged sync; tensor sync); the other six are marked matrix (`-m matrix`).
MODES = [
    pytest.param(dict(max_staleness=1, lora_sync="adapter"), id="overlap-learner-adapter",
                 marks=pytest.mark.matrix),
    pytest.param(dict(max_staleness=1, lora_sync="merged"), id="overlap-learner-merged",
                 marks=pytest.mark.matrix),
    pytest.param(dict(old_logprobs="generator", lora_sync="adapter"), id="sync-generator-adapter",
                 marks=pytest.mark.matrix),
    pytest.param(dict(old_logprobs="generator", lora_sync="merged"), id="sync-generator-merged",
                 marks=pytest.mark.matrix),
    pytest.param(dict(max_staleness=1, old_logprobs="generator", lora_sync="adapter"),
                 id="overlap-generator-adapter", marks=pytest.mark.matrix),
    pytest.param(dict(max_staleness=1, old_logprobs="generator", lora_sync="merged"),
                 id="overlap-generator-merged"),
    pytest.param(dict(lora_sync="merged"), id="sync-learner-merged", marks=pytest.mark.matrix),
    pytest.param(dict(lora_sync="tensor"), id="sync-learner-tensor"),
]


@pytest.mark.slow  # each mode starts its own actors (~1 min) and runs 9 steps per kind
@pytest.mark.parametrize("mode", MODES)
@exact.rerun_if_last_digits_differ
def test_every_mode_catches_and_repairs_a_bad_sync(ray_session, tiny_model_dir, tmp_path, mode):
    from fault_injection import FaultyTrainer

    if mode.get("old_logprobs") == "generator":
        mode = {**mode, "top_k": 0, "top_p": 1.0, "old_logprobs_check_every": 10}
    trainer = FaultyTrainer(tiny_test_config(**mode))
    try:
        trainer.run_dir = tmp_path
        start = trainer.save_checkpoint()
        trainer.run_dir = None
        for kind in ("previous", "perturbed"):
            check_modes(trainer, start, kind)
    finally:
        trainer.shutdown()


def test_the_rollout_check_counts_tokens_outside_the_learners_support():
    """A sampled token that the learner's top-k/top-p truncation drops has no logprob to
    compare: it was left out of the check's maximum. Now a step whose dropped share is over
    TRUNCATED_TOKENS_LIMIT fails the check even when the kept tokens agree."""
    from types import SimpleNamespace

    from ppo_ray.driver.sync_guard import SyncGuard
    from ppo_ray.trainer import TRUNCATED_TOKENS_LIMIT, LogprobGapError

    counted = []
    guard = SyncGuard(tiny_test_config(logprob_gap_check="error"), None, None,
                      SimpleNamespace(record_logprob_gap=counted.append), [], SimpleNamespace(step=4, version=4),
                      recover=lambda: None)
    stats = SimpleNamespace(gen_logprob_max_abs_diff=1e-6, tokens=1000.0, truncated_tokens=1000 * TRUNCATED_TOKENS_LIMIT,
                            gen_logprob_gap_tokens=0.0)
    guard.check_rollouts(stats)  # a boundary tie or two: fine
    stats.truncated_tokens += 1
    with pytest.raises(LogprobGapError, match="11 of its 1000 sampled tokens are outside the learner's"):
        guard.check_rollouts(stats)
    assert counted == [guard.config.lora_sync_mode]


def test_under_top_p_a_few_tokens_at_the_nucleus_edge_pass_the_rollout_check():
    """Where the top-k-renormalised cumulative probability meets top_p within rounding, the
    learner and vLLM can keep nuclei that differ by one edge token, and the sampled token's
    logprob is renormalised over masses that differ by that token's (measured: one token of 512
    off by 5.4e-3, the cumulative sum 0.9500000477, which stopped a 40-step run). Under top_p < 1
    such a token passes, within logprob_gap_tolerance + log(1 / top_p), and counts with the ones
    outside the support toward TRUNCATED_TOKENS_LIMIT; untruncated sampling keeps the plain rule."""
    from types import SimpleNamespace

    from ppo_ray.driver.sync_guard import SyncGuard
    from ppo_ray.trainer import LogprobGapError

    def check(stats, **changes):
        config = tiny_test_config(logprob_gap_check="error", **changes)
        assert config.is_correction == "none"
        SyncGuard(config, None, None, SimpleNamespace(record_logprob_gap=lambda _: None), [],
                  SimpleNamespace(step=37, version=37), recover=lambda: None).check_rollouts(stats)

    stats = SimpleNamespace(gen_logprob_max_abs_diff=5.4e-3, tokens=512.0, truncated_tokens=0.0, gen_logprob_gap_tokens=1.0)
    assert tiny_test_config().top_p == 0.95
    check(stats)
    with pytest.raises(LogprobGapError, match=r"by up to 0.0054 nats \(logprob_gap_tolerance 0.001 for float32\)"):
        check(stats, top_p=1.0, top_k=0)
    stats.gen_logprob_gap_tokens = 6.0  # 6 of 512: over 1%
    with pytest.raises(LogprobGapError, match="6 over the tolerance"):
        check(stats)
    stats.gen_logprob_gap_tokens, stats.truncated_tokens = 3.0, 3.0  # they count together
    with pytest.raises(LogprobGapError, match="3 of its 512 sampled tokens are outside"):
        check(stats)
    stats.gen_logprob_gap_tokens, stats.truncated_tokens = 1.0, 0.0
    stats.gen_logprob_max_abs_diff = 1e-3 + math.log(1 / 0.95) + 1e-4  # beyond what an edge token can move
    with pytest.raises(LogprobGapError):
        check(stats)


# ------------------------------------------------------------------ the checks under is_correction
def test_under_is_correction_the_rollout_check_tests_the_share_outside_the_band():
    """With is_correction the rollout check holds is_outside_frac (the share of tokens whose
    ratio is outside [1/is_cap, is_cap]) to logprob_gap_outside_tolerance, not the largest gap
    of one token: one token 1 nat off among a thousand (bfloat16 tolerance 0.25) passes under
    tis and mis and stops a run without a correction; a share over the limit stops either."""
    from types import SimpleNamespace

    from ppo_ray.driver.sync_guard import SyncGuard
    from ppo_ray.trainer import LogprobGapError

    counted = []

    def guard(**changes):
        config = tiny_test_config(logprob_gap_check="error", logprob_gap_tolerance=0.25, **changes)
        return SyncGuard(config, None, None, SimpleNamespace(record_logprob_gap=counted.append), [],
                         SimpleNamespace(step=4, version=4), recover=lambda: None)

    stats = SimpleNamespace(gen_logprob_max_abs_diff=1.0, tokens=1000.0, truncated_tokens=0.0, is_outside_frac=0.001,
                            gen_logprob_gap_tokens=1.0)
    guard(is_correction="tis").check_rollouts(stats)
    guard(is_correction="mis", is_level="sequence").check_rollouts(stats)
    assert counted == []
    with pytest.raises(LogprobGapError, match=r"by up to 1 nats \(logprob_gap_tolerance 0.25 for float32, plus up to "
                                              r"0.0513 at the top_p edge"):
        guard().check_rollouts(stats)
    stats.is_outside_frac = 0.051
    with pytest.raises(LogprobGapError, match=r"by more than a factor is_cap 2 on 5\.1% of its tokens \(is_correction "
                                              r"tis: logprob_gap_outside_tolerance 5\.0%; largest gap 1 nats\)"):
        guard(is_correction="tis").check_rollouts(stats)
    guard(is_correction="tis", logprob_gap_outside_tolerance=0.06).check_rollouts(stats)
    stats.is_outside_frac, stats.truncated_tokens = 0.0, 11.0  # the support rule holds under a correction too
    with pytest.raises(LogprobGapError, match="11 of its 1000 sampled tokens are outside the learner's"):
        guard(is_correction="tis").check_rollouts(stats)


@contextlib.contextmanager
def mismatched_generators(trainer):
    """Every generator's rollouts carry tests/mismatch.py's injected mismatch (every token up
    to 0.05 nats below the engine's logprob, the first token of each batch 1 nat below) while
    inside; the sync check's probe is left alone."""
    import mismatch
    from helpers import on_actor

    for generator in trainer.roles.generators:
        on_actor(generator, mismatch.install)
    try:
        yield
    finally:
        for generator in trainer.roles.generators:
            on_actor(generator, mismatch.remove)


def test_a_mismatch_the_correction_absorbs_stops_a_run_without_correction(tiny_trainer):
    """The injected mismatch (one token 1 nat off per step, the others within bfloat16's
    rounding) on the shared trainer (is_correction: none), at bfloat16's tolerance 0.25: its
    one token's gap stops the step (logprob_gap_check: error), and nothing is committed. The
    same injection leaves an is_correction run going (the next test)."""
    from ppo_ray.trainer import LogprobGapError

    base = tiny_trainer.config
    version = tiny_trainer.version
    assert base.is_correction == "none"
    try:
        tiny_trainer.config = base.replace(logprob_gap_tolerance=0.25, logprob_gap_check="error")
        with mismatched_generators(tiny_trainer), \
                pytest.raises(LogprobGapError, match=r"by up to 1 nats \(logprob_gap_tolerance 0.25 for float32, plus up"):
            tiny_trainer.ppo_step(bundled_prompts()[:8])
    finally:
        tiny_trainer.config = base
    assert tiny_trainer.version == version


def test_with_tis_a_mismatch_it_absorbs_goes_on_and_a_lost_sync_still_stops_the_run(ray_session, tiny_model_dir):
    """is_correction: tis on the real system (its own actors), with the injected mismatch at
    bfloat16's tolerance 0.25 and logprob_gap_check: error. Each step's largest gap is the 1-nat
    token, over the tolerance, but the share of tokens outside [1/2, 2] is that one token's,
    which TIS caps: two steps go on, none re-synced. Without the mismatch, a lost sync
    (BadSync previous) still stops the run, at float32's tolerance: the sync check's probe
    keeps the largest-gap rule under is_correction."""
    from fault_injection import FaultyTrainer
    from ppo_ray.trainer import LogprobGapError

    trainer = FaultyTrainer(tiny_test_config(is_correction="tis"))
    try:
        base = trainer.config
        trainer.config = base.replace(logprob_gap_tolerance=0.25)
        with mismatched_generators(trainer):
            history = trainer.train(bundled_prompts(), steps=2, progress=False)
        assert [h["adapter_version"] for h in history] == [1, 2]
        for h in history:
            assert h["gen_logprob_max_abs_diff"] > 0.25 and h["sync_resyncs"] == 0
            # the one 1-nat token of the step's policy-loss tokens (the others' ratios are within e^0.05)
            assert h["is_outside_frac"] == pytest.approx(1 / (h["tokens"] - h["truncated_tokens"]), rel=1e-6)
            assert h["is_outside_frac"] <= base.logprob_gap_outside_tolerance
            assert h["is_weight_mean"] > 1.0  # the generator's logprobs are lower: TIS weights > 1, capped at 2
        trainer.config = base
        trainer.inject_faults([BadSync(step=trainer.step + 1, kind="previous")])
        with pytest.raises(LogprobGapError, match=r"after step 3: .*the sync did not deliver the learner's policy"):
            trainer.ppo_step(bundled_prompts()[:8])
    finally:
        trainer.shutdown()


# ------------------------------------------------------------------ the one rule
class _Gaps:
    """Stand-ins for Roles, the Supervisor and the metrics around a SyncGuard: the probe's gaps
    per replica come from `gaps` in turn (the last one repeats), loads are recorded."""

    def __init__(self, *gaps):
        self.gaps, self.loads, self.counted = list(gaps), [], []
        self.generators = ["g0", "g1"]

    def sync_gaps(self, probe_ids, version, weights=None, generators=None):
        gaps = self.gaps.pop(0) if len(self.gaps) > 1 else self.gaps[0]
        return gaps if generators is None else gaps[:len(generators)]

    def load_adapter(self, version, weights, restore=False, generators=None, retire_below=None):
        self.loads.append((version, list(generators or self.generators)))

    def run(self, fn, *, where, step, recover):
        return fn(0)

    def record_logprob_gap(self, mode):
        self.counted.append(mode)


def _guard(stand_in, check):
    from ppo_ray.driver.inflight import Committed
    from ppo_ray.driver.sync_guard import SyncGuard

    config = tiny_test_config(logprob_gap_check=check)
    return SyncGuard(config, stand_in, stand_in, stand_in, [[1, 2]], Committed(step=3, version=3, weights={3: "w3"}),
                     recover=lambda: None)


def test_one_rule_decides_for_the_probe_the_reload_and_the_rollouts(caplog):
    """verdict is the one resync/error/warn rule: the sync check (check), the check of a version
    loaded again (check_loaded) and the rollout check (check_rollouts, through resamples) all
    take it. resync re-syncs the failing replicas once and raises when the gap persists; error
    raises at once; warn logs and goes on; each failed check is counted."""
    from types import SimpleNamespace

    from ppo_ray.driver.sync_guard import LogprobGapError, verdict

    assert [verdict(c, a) for c in ("resync", "error", "warn") for a in (False, True)] == \
        ["resync", "error", "error", "error", "warn", "warn"]
    bad, good = [0.5, 0.0], [0.0, 0.0]
    # the sync check: one re-sync of replica 0 mends it; a gap that persists is an error
    roles = _Gaps(bad, good)
    guard = _guard(roles, "resync")
    assert guard.check(3).gap == 0.0 and roles.loads == [(3, ["g0"])] and guard.resyncs == 1
    with pytest.raises(LogprobGapError, match="persists after a re-sync"):
        _guard(_Gaps(bad), "resync").check(3)
    with pytest.raises(LogprobGapError) as raised:
        _guard(_Gaps(bad), "error").check(3)
    assert "persists" not in str(raised.value)
    with caplog.at_level("WARNING", logger="ppo_ray.trainer"):
        warned = _Gaps(bad)
        assert _guard(warned, "warn").check(3).gap == 0.5 and warned.loads == [] and len(warned.counted) == 1
    assert "the sync did not deliver" in caplog.text
    # a version loaded again: the same rule, with its own words
    roles = _Gaps(bad, good)
    guard = _guard(roles, "resync")
    guard.check_loaded(3, [0, 1])
    assert roles.loads == [(3, ["g0"])] and guard.resyncs == 1 and len(roles.counted) == 1
    with pytest.raises(LogprobGapError, match="persists after loading it again"):
        _guard(_Gaps(bad), "resync").check_loaded(3, [0, 1])
    _guard(_Gaps(bad), "warn").check_loaded(3, [0, 1])
    # the rollouts: resync raises for the step to re-sync and sample again, once per step
    stats = SimpleNamespace(gen_logprob_max_abs_diff=0.5, tokens=100.0, truncated_tokens=0.0,
                            gen_logprob_gap_tokens=1.0)
    guard = _guard(_Gaps(good), "resync")
    with pytest.raises(LogprobGapError) as raised:
        guard.check_rollouts(stats)
    assert guard.resamples(raised.value)
    guard.resyncs = 1
    assert not guard.resamples(raised.value) and not guard.resamples(RuntimeError("another failure"))
    assert not _guard(_Gaps(good), "error").resamples(raised.value)
    _guard(_Gaps(good), "warn").check_rollouts(stats)
