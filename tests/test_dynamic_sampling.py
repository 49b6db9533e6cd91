"""DAPO's dynamic sampling (config dynamic_sampling; Yu et al. 2025, section 3.2, eq. 11).

Without Ray: the filter (learner.algos.varying_groups) equals a float64 loop on random groups
with NaN rows, one-value groups and ties; the choice of groups (ppo_ray.driver.inflight.pick_groups);
the joined reward stats; the config's rules; the console line.

On the real actors (one GRPO trainer for the module, a reward that is constant for marked
prompts and varies for the others, tests/reward_fns.py): a straight run of 3 steps whose
prompts are marked so that step 1 needs a second round, step 2 none and step 3 reaches the cap
and fills; each step trains on exactly the groups the rule picks (their scores are the reward's
known values), reports its rounds, kept share and filled groups, and the cursor holds every
prompt drawn. Then the run resumed at step 2 from its checkpoint, and step 3 retried after the
reward actor's death in its second round, each equal to the straight run's step 3 exactly.
With batches in flight (max_staleness 1, a second trainer): each batch's rounds come from its
own window of the cursor and stream while the learner trains on the step before, and the run
resumed at step 2 (whose step 3 runs its rounds as it starts) equals the straight one.
"""

from __future__ import annotations

import math

import pytest
import torch

from exact import assert_same, rerun_if_last_digits_differ
from helpers import restored_from_step_two
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
    from helpers import tiny_test_config

    with pytest.raises(ConfigError, match="dynamic_sampling.*samples_per_prompt >= 2"):
        tiny_test_config(dynamic_sampling=True)
    with pytest.raises(ConfigError, match="dynamic_sampling.*with max_staleness 1 needs lora_sync adapter or tensor"):
        tiny_test_config(dynamic_sampling=True, samples_per_prompt=2, max_staleness=1, lora_sync="merged")
    # with batches in flight auto keeps several versions on the CPU too (merged holds one)
    assert tiny_test_config(dynamic_sampling=True, samples_per_prompt=2, max_staleness=1).lora_sync_mode == "tensor"
    assert tiny_test_config(samples_per_prompt=2, max_staleness=1).lora_sync_mode == "merged"
    with pytest.raises(ConfigError, match="dynamic_sampling_max_rounds"):
        tiny_test_config(dynamic_sampling=True, samples_per_prompt=2, dynamic_sampling_max_rounds=-1)
    config = tiny_test_config(dynamic_sampling=True, samples_per_prompt=2, advantage_estimator="gae")
    assert config.dynamic_sampling_max_rounds == 4  # any estimator; the default cap


def test_the_step_line_and_record_show_dynamic_sampling_only_when_it_is_on():
    from dataclasses import replace

    from ppo_ray.logs import format_step
    from helpers import step_result

    off = step_result()
    assert "rounds" not in format_step(off) and not any(k.startswith("dynamic") for k in off.as_dict())
    assert "trained" not in format_step(off) and off["reward_trained_mean"] == off["reward_mean"]
    on = replace(off, dynamic_sampling=DynamicSampling(rounds=2, kept_frac=0.625, filled=0),
                 generated_rewards=[*off.rewards, *[r + 1.0 for r in off.rewards]])
    assert "  rounds 2 kept 62%  " in format_step(on)
    # one mean, one meaning: reward is every rollout generated, trained the rows trained on
    assert on["reward_mean"] == pytest.approx(off["reward_mean"] + 0.5) and on["reward_trained_mean"] == off["reward_mean"]
    assert f"reward {on['reward_mean']:+.4f}  trained {off['reward_mean']:+.4f}  kl " in format_step(on)
    assert "  rounds 3 kept 12% filled 3  " in format_step(replace(on, dynamic_sampling=DynamicSampling(3, 0.125, 3)))
    assert {k: v for k, v in on.as_dict().items() if k.startswith("dynamic")} == {
        "dynamic_sampling_rounds": 2, "dynamic_sampling_kept_frac": 0.625, "dynamic_sampling_filled": 0}


# ---------------------------------------------------------------------------------- real actors
STEPS = 3
PROMPTS_PER_STEP = 4  # batch_size 8 / samples_per_prompt 2
# Which drawn prompts (by draw position: round after round, step after step) get SAME_MARK:
# step 1: round 1 keeps 2 (positions 1, 3), round 2 keeps 3 (4, 6, 7): 2 rounds, 5 of 8 kept,
# the first 4 trained on and position 7 discarded; step 2: all 4 vary, 1 round; step 3: only
# position 13 varies in 2 rounds (the cap, dynamic_sampling_max_rounds 1): 3 constant groups
# (12, 14, 15) fill the batch.
MARKED = {0, 2, 5, 12, 14, 15, 16, 17, 18, 19}
# Per step: the rewards trained on (a varying group's rows score their positions in the round's
# score call, a marked group's 1.0), rounds, kept share, filled.
EXPECTED = [([2.0, 3.0, 6.0, 7.0, 0.0, 1.0, 4.0, 5.0], 2, 5 / 8, 0),
            ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], 1, 1.0, 0),
            ([1.0, 1.0, 2.0, 3.0, 1.0, 1.0, 1.0, 1.0], 2, 1 / 8, 3)]
KEYS = ("reward_mean", "kl", "policy_loss", "approx_kl", "clipfrac", "entropy", "score_mean", "adapter_version",
        "response_tokens", "dynamic_sampling_rounds", "dynamic_sampling_kept_frac", "dynamic_sampling_filled")


def marked_prompts(seed: int, positions: set[int] = MARKED) -> tuple[list[str], list[int]]:
    """The bundled prompts, those the run draws at `positions` with SAME_MARK in front, and
    the order the run's cursor draws them in (PromptCursor with the run seed)."""
    from ppo_ray.data import PromptCursor, bundled_prompts
    from reward_fns import SAME_MARK

    prompts = bundled_prompts()
    order = PromptCursor(seed).draw(len(prompts), len(prompts))
    marked = {order[i] for i in positions}
    return [SAME_MARK + p if i in marked else p for i, p in enumerate(prompts)], order


def steps_of(history) -> list[dict]:
    return [{"step": h["step"], **{k: h[k] for k in KEYS}, "rewards": h["rewards"],
             "generated_texts": h["generated_texts"]} for h in history]


def straight_run(tmp_path_factory, name: str, marked: set[int], before_train=None, **extra):
    """(trainer, its prompts, their draw order, the straight run's history, its run dir): GRPO
    with dynamic sampling (`extra` on top), STEPS steps, a checkpoint at step 2, the prompts
    drawn at `marked` positions marked. A FaultyTrainer (a PPOTrainer unless armed) for the
    retry tests; `before_train(trainer)` runs before it trains."""
    from helpers import tiny_test_config
    from fault_injection import FaultyTrainer

    config = tiny_test_config(advantage_estimator="grpo", samples_per_prompt=2, batch_size=8, max_new_tokens=8,
                              dynamic_sampling=True, dynamic_sampling_max_rounds=1, steps=STEPS,
                              checkpoint_every=2, report_to=[], reward_funcs=["reward_fns:same_for_marked_prompts"],
                              reward_weights=[1.0], **extra)
    prompts, order = marked_prompts(config.seed, marked)
    run_dir = tmp_path_factory.mktemp(name)
    trainer = FaultyTrainer(config, run_dir=run_dir)
    try:
        if before_train is not None:
            before_train(trainer)
        history = trainer.train(prompts, progress=False)
        yield trainer, prompts, order, history, run_dir
    finally:
        trainer.shutdown()


@pytest.fixture(scope="module")
def dynamic_run(ray_session, tiny_model_dir, tmp_path_factory):
    yield from straight_run(tmp_path_factory, "dynamic-straight", MARKED)


def test_each_step_trains_on_the_groups_the_rule_picks_and_reports_them(dynamic_run):
    """Every step's learner batch is batch_size rows whose scores (the ones the filter saw: the
    learner's score_mean is their mean) are those of the first varying groups in generation
    order, filled by the first constant groups only at the cap; the rounds, the kept share
    and the filled groups are reported, in the record and the metrics; the cursor holds
    every prompt drawn, extra rounds included (the next prompts are the ones after them)."""
    trainer, prompts, order, history, _ = dynamic_run
    assert [h.step for h in history] == [1, 2, 3]
    for h, (rewards, rounds, kept, filled) in zip(history, EXPECTED):
        assert h.rewards == rewards and len(h.generated_texts) == len(h.response_lengths) == 8
        assert h.learner.score_mean == pytest.approx(sum(rewards) / 8, rel=1e-6)  # float32 sum of 8 small ints
        pairs = [rewards[i:i + 2] for i in range(0, 8, 2)]
        assert sum(a == b for a, b in pairs) == filled  # every group varies unless filled
        assert h.dynamic_sampling == DynamicSampling(rounds=rounds, kept_frac=kept, filled=filled)
        assert (h["dynamic_sampling_rounds"], h["dynamic_sampling_kept_frac"], h["dynamic_sampling_filled"]) == (
            rounds, kept, filled)
    drawn = sum(r for _, r, _, _ in EXPECTED) * PROMPTS_PER_STEP
    assert drawn == 20 and trainer.cursor.order == order[drawn:]
    # reward_mean is every rollout generated (all rounds), reward_trained_mean the kept rows'
    start = 0
    for h, (rewards, rounds, _, _) in zip(history, EXPECTED):
        generated = []
        for r in range(rounds):  # a round's row i (of 8: 4 prompts x 2) scores 1.0 if its prompt is marked, else i
            positions = range(start + r * PROMPTS_PER_STEP, start + (r + 1) * PROMPTS_PER_STEP)
            generated += [1.0 if p in MARKED else float(2 * j + k) for j, p in enumerate(positions) for k in (0, 1)]
        start += rounds * PROMPTS_PER_STEP
        assert h.generated_rewards == generated
        assert h["reward_mean"] == pytest.approx(sum(generated) / len(generated))
        assert h["reward_trained_mean"] == pytest.approx(sum(rewards) / 8)


@rerun_if_last_digits_differ
def test_a_resumed_run_equals_the_straight_one(dynamic_run, tmp_path):
    """Resumed at step 2 (whose cursor holds step 1's extra round), step 3 (an extra round and a
    fill) equals the straight run's exactly, and leaves the cursor where the straight run did."""
    trainer, prompts, order, straight, run_dir = dynamic_run
    resumed = restored_from_step_two(trainer, run_dir, tmp_path).train(prompts, progress=False)
    assert_same(steps_of(resumed), steps_of(straight[2:]), "resumed vs straight")
    assert trainer.cursor.order == order[20:]


@rerun_if_last_digits_differ
def test_a_step_retried_after_a_death_in_its_extra_round_equals_the_straight_one(dynamic_run, tmp_path):
    """The reward actor dies as it is asked to score step 3's second round: the retry reuses the
    recorded rounds (the first one's scores, the second one's prompts and samples), draws no
    prompt again, and the step equals the straight run's."""
    _a_death_in_the_extra_round(dynamic_run, tmp_path, "reward", "score")


@pytest.mark.slow  # a generator restart starts a vLLM engine (~1 min on 2 cores)
@rerun_if_last_digits_differ
def test_a_generator_lost_with_the_extra_rounds_samples_regenerates_them_exactly(dynamic_run, tmp_path):
    """The generator dies once it has sampled step 3's second round, before returning it: the
    round is sampled again with its own seeds on the restarted generator, and the step equals
    the straight run's."""
    _a_death_in_the_extra_round(dynamic_run, tmp_path, "generator-0", "generate", when="after")


def _a_death_in_the_extra_round(dynamic_run, tmp_path, role: str, method: str, when: str = "before") -> None:
    from fault_injection import arm_fault

    trainer, prompts, order, straight, run_dir = dynamic_run
    restored_from_step_two(trainer, run_dir, tmp_path)
    before = len(trainer.retries)
    arm_fault(trainer.roles, role, method, when, call=2)  # step 3's second call: its extra round's
    got = trainer.train(prompts, progress=False)
    assert [(r["step"], r["role"]) for r in trainer.retries[before:]] == [(3, role)]
    assert_same(steps_of(got), steps_of(straight[2:]), f"{role} lost in the extra round vs straight")
    assert trainer.cursor.order == order[20:]


@rerun_if_last_digits_differ
def test_a_resampled_step_that_needs_fewer_rounds_puts_their_prompts_back(dynamic_run, tmp_path):
    """Step 3 draws its extra round; then the rollout check fails (a LogprobGapError under
    logprob_gap_check resync, injected here) and the step is sampled again after the re-sync.
    Its samples now score differently (the reward no longer sees marks: every group varies),
    so the retry needs its first round only: the extra round's prompts go back to the cursor,
    and are the next step's."""
    import tempfile
    from pathlib import Path

    from ppo_ray.trainer import LogprobGapError
    from reward_fns import ALL_VARY_FILE

    trainer, prompts, order, _, run_dir = dynamic_run
    restored_from_step_two(trainer, run_dir, tmp_path)
    flag = Path(tempfile.gettempdir()) / ALL_VARY_FILE
    check, failed = trainer.guard.check_rollouts, []

    def fails_once(stats):
        if not failed:
            failed.append(stats)
            flag.touch()  # the resampled step's scores differ from the first attempt's
            raise LogprobGapError("injected: the rollouts came from another policy")
        return check(stats)

    base = trainer.config
    trainer.guard.check_rollouts = fails_once
    trainer.config = base.replace(logprob_gap_check="resync")
    try:
        got = trainer.train(prompts, progress=False)
    finally:
        del trainer.guard.check_rollouts
        trainer.config = base
        flag.unlink(missing_ok=True)
    assert failed and got[0].step == 3 and got[0].dynamic_sampling.rounds == 1 and got[0].sync_resyncs == 1
    assert trainer.cursor.order == order[16:]  # steps 1-2: 3 rounds; step 3: 1 round; nothing else taken


# ------------------------------------------------------------- with batches in flight (windows)
# max_staleness 1: each batch draws its window of (1 + 1) x 4 positions at once, step t's is
# [8 (t - 1), 8 t): its first round the first 4, its extra round the next 4, both sampled with
# the batch's version (0, 0, 1). Step 1: round 1 keeps 2 (positions 2, 3), round 2 keeps 3
# (5, 6, 7); step 2: round 1 keeps 3 (9, 10, 11), round 2 at version 0 after version 1 was
# loaded, its first group (12) completing the batch; step 3: only position 19 varies in 2
# rounds, and 16, 17, 18 fill the batch.
MARKED_WINDOWS = {0, 1, 4, 8, 16, 17, 18, 20, 21, 22, 23}
EXPECTED_WINDOWS = [([4.0, 5.0, 6.0, 7.0, 2.0, 3.0, 4.0, 5.0], 2, 5 / 8, 0),
                    ([2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 0.0, 1.0], 2, 7 / 8, 0),
                    ([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 6.0, 7.0], 2, 1 / 8, 3)]


def every_round_in_flight(trainer) -> None:
    """The pipeline's while_learning as the step calls it (it returns once the learner's update
    is done), then once more with no update to wait for: every batch in flight then has all
    its rounds before its step starts, however fast the learner is, so the streamed rounds
    are a fixed set (the test below counts them)."""
    pipeline = trainer.pipeline
    as_the_step_calls = pipeline.while_learning

    def stream(update_refs):
        as_the_step_calls(update_refs)
        as_the_step_calls([])

    pipeline.while_learning = stream


@pytest.fixture(scope="module")
def windowed_run(ray_session, tiny_model_dir, tmp_path_factory):
    """dynamic_run's with max_staleness 1 (lora_sync auto: tensor) and MARKED_WINDOWS, every
    batch in flight streaming all its rounds while the learner trains on the step before."""
    yield from straight_run(tmp_path_factory, "windowed-straight", MARKED_WINDOWS, before_train=every_round_in_flight,
                            max_staleness=1)


def test_with_batches_in_flight_each_batch_takes_its_extra_rounds_from_its_window(windowed_run):
    """Under max_staleness 1 the rule is the synchronous step's, on each batch's own window:
    every step trains on the groups it picks there (their scores are the reward's known
    values, so a round drawn from anywhere else would show), with its rounds, kept share and
    filled groups; the steps from 2 on are one version behind; the cursor is 3 windows on.
    The rounds stream (Pipeline.while_learning): the batches of steps 2 and 3 were each
    generated and scored, both their rounds, while the learner trained on the step before
    (4 rounds; step 1's two ran as it started), and trained on the same groups as when a
    batch's rounds run at its step's start (the resumed run below)."""
    trainer, prompts, order, history, _ = windowed_run
    assert trainer.config.lora_sync_mode == "tensor"
    assert trainer.pipeline.streamed_rounds == 4
    assert [h.step for h in history] == [1, 2, 3] and [h["stale_versions"] for h in history] == [0.0, 1.0, 1.0]
    for h, (rewards, rounds, kept, filled) in zip(history, EXPECTED_WINDOWS):
        assert h.rewards == rewards and len(h.generated_texts) == 8
        assert h.dynamic_sampling == DynamicSampling(rounds=rounds, kept_frac=kept, filled=filled)
    assert trainer.cursor.order == order[3 * 8:]


@rerun_if_last_digits_differ
def test_with_batches_in_flight_a_resumed_run_equals_the_straight_one(windowed_run, tmp_path):
    """Resumed at step 2 (its checkpoint's cursor is the one before step 3's batch, which was
    in flight), step 3 draws the same window, generates the same two rounds with the same
    version and seeds, now as the step starts (nothing is in flight to stream: the straight
    run streamed them), and equals the straight run's exactly."""
    trainer, prompts, order, straight, run_dir = windowed_run
    resumed = restored_from_step_two(trainer, run_dir, tmp_path).train(prompts, progress=False)
    assert_same(steps_of(resumed), steps_of(straight[2:]), "resumed vs straight (windows)")
    assert trainer.cursor.order == order[3 * 8:]


def test_ppo_step_filters_and_fills_without_drawing(dynamic_run):
    """ppo_step(prompts) has no cursor to draw from: one round, its varying groups first in
    generation order and the constant ones filling (here 2 of 4 prompts are marked). The
    driver fetches scores, summaries and stats only: the picked rows are named by index to the
    actors, and no RolloutBatch is fetched or stored by the driver."""
    from reward_fns import SAME_MARK

    from ppo_ray.batch import RolloutBatch

    trainer, prompts, order, _, _ = dynamic_run
    cursor = trainer.cursor.state()
    plain = [p for p in prompts if SAME_MARK not in p]
    # the driver's side of the step, watched: what it fetches and what it puts into the store
    roles, seen = trainer.roles, []

    def watched(method):
        def call(value):
            out = method(value)
            seen.extend(out if isinstance(out, list) else [out])
            seen.extend(value if isinstance(value, list) else [value])
            return out
        return call

    roles.fetch, roles.store = watched(roles.fetch), watched(roles.store)
    try:
        out = trainer.ppo_step([SAME_MARK + plain[0], plain[1], SAME_MARK + plain[2], plain[3]])
    finally:
        del roles.fetch, roles.store
    # the rows are picked on the actors: no rollout batch reaches the driver or leaves it
    assert seen and not [v for v in seen if isinstance(v, RolloutBatch)]
    assert out.rewards == [1.0, 1.0, 2.0, 3.0, 1.0, 1.0, 6.0, 7.0]
    assert out.dynamic_sampling == DynamicSampling(rounds=1, kept_frac=0.5, filled=2)
    assert trainer.cursor.state()[0] == cursor[0]
