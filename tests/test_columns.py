"""A dataset's columns reach the reward functions through the trainer (issue 56, part 3: ground
truth reaches the verifier), on the real actors.

One GRPO trainer with dynamic sampling for the module, rows {"prompt": "#<id> <post>", "id":
<id>, "note": ...} and two reward functions: reward_fns.row_id (the row's `id` column where
the prompt starts with it, else -1: a value that reached another prompt's rows would show) and
ppo_ray.rewards.letter_e_fraction, a two-argument function, at weight 0 beside it. Every group
scores alike, so each step draws its extra round (dynamic_sampling_max_rounds 1) and fills
the batch with its first round: the scores of every rollout generated are the ids of the
prompts the cursor drew, round after round, and so say which columns each score call got.
A straight run of 3 steps; step 3 again after a resume from step 2's checkpoint, and after the
reward actor's death as it scores step 3's extra round; the eval samples, generate(score=True)
and ppo_step on rows; ppo_step on strings, which the column function refuses by name.

Scores are small integers (ids) plus 0 x a fraction: exact in float32, compared exactly.
"""

from __future__ import annotations

import pytest

from exact import assert_same, rerun_if_last_digits_differ
from helpers import restored_from_step_two

pytestmark = pytest.mark.usefixtures("ray_session")

STEPS = 3
PROMPTS_PER_STEP = 4  # batch_size 8 / samples_per_prompt 2
EVAL_ROWS = 4


def id_rows() -> list[dict]:
    """The bundled prompts as rows: "#<id> " in front of each (reward_fns.row_id's mark), the id
    column, and a column no reward function takes."""
    from ppo_ray.data import bundled_prompts

    return [{"prompt": f"#{i} {p}", "id": i, "note": f"row {i}"} for i, p in enumerate(bundled_prompts())]


def ids_of(rows: list[int]) -> list[float]:
    """The scores of these prompts' rollouts: their ids, each for its 2 samples."""
    return [float(i) for i in rows for _ in range(2)]


def steps_of(history) -> list[dict]:
    keys = ("reward_mean", "kl", "policy_loss", "approx_kl", "entropy", "adapter_version", "response_tokens")
    return [{"step": h["step"], **{k: h[k] for k in keys}, "rewards": h.rewards,
             "generated_rewards": h.generated_rewards, "generated_texts": h.generated_texts} for h in history]


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """(trainer, rows, the cursor's draw order, the straight run's history, its run dir)."""
    from helpers import tiny_test_config
    from fault_injection import FaultyTrainer
    from ppo_ray.data import PromptCursor

    config = tiny_test_config(advantage_estimator="grpo", samples_per_prompt=2, batch_size=8, max_new_tokens=6,
                              dynamic_sampling=True, dynamic_sampling_max_rounds=1, steps=STEPS, checkpoint_every=2,
                              report_to=[], eval_every=STEPS, eval_samples=EVAL_ROWS,
                              reward_funcs=["reward_fns:row_id", "ppo_ray.rewards:letter_e_fraction"],
                              reward_weights=[1.0, 0.0])
    rows = id_rows()
    order = PromptCursor(config.seed).draw(len(rows), len(rows))
    run_dir = tmp_path_factory.mktemp("columns-straight")
    trainer = FaultyTrainer(config, run_dir=run_dir)
    try:
        history = trainer.train(rows, progress=False, eval_prompts=rows[:EVAL_ROWS])
        yield trainer, rows, order, history, run_dir
    finally:
        trainer.shutdown()


def test_each_score_call_gets_its_prompts_columns(run):
    """Every rollout of every round scores its own prompt's id (none -1): the first round's
    columns and the extra round's, which the cursor drew after it; the batch trained on is the
    first round's (every group is constant: the fill); the two-argument function beside the
    column one scored the same rows; the eval samples' rows got their columns too. Only the
    column a reward function takes travels (`note` does not)."""
    trainer, rows, order, history, _ = run
    for h in history:
        start = (h.step - 1) * 2 * PROMPTS_PER_STEP
        first, extra = order[start:start + PROMPTS_PER_STEP], order[start + PROMPTS_PER_STEP:start + 8]
        assert h.generated_rewards == ids_of(first) + ids_of(extra), h.step
        assert h.rewards == ids_of(first)
        assert h.dynamic_sampling.rounds == 2
        assert 0.0 < h.reward_parts["score/ppo_ray.rewards:letter_e_fraction"] < 1.0
    assert history[-1].extra["eval_reward_mean"] == sum(range(EVAL_ROWS)) / EVAL_ROWS
    assert list(trainer.feed.columns(trainer.feed.rows(rows)).values) == ["id"]


@rerun_if_last_digits_differ
def test_a_resumed_step_gets_the_same_columns(run, tmp_path):
    """Resumed at step 2, step 3's two rounds (drawn again from the checkpoint's cursor) score
    the same ids, and the step equals the straight run's exactly."""
    trainer, rows, _, straight, run_dir = run
    resumed = restored_from_step_two(trainer, run_dir, tmp_path).train(rows, progress=False)
    assert_same(steps_of(resumed), steps_of(straight[2:]), "resumed vs straight")


@rerun_if_last_digits_differ
def test_a_retried_step_gets_the_same_columns(run, tmp_path):
    """The reward actor dies as it is asked to score step 3's extra round: the retry sends that
    round's columns again (they are the round's, kept with its prompts), and the step equals
    the straight run's exactly."""
    from fault_injection import arm_fault

    trainer, rows, _, straight, run_dir = run
    restored_from_step_two(trainer, run_dir, tmp_path)
    before = len(trainer.retries)
    arm_fault(trainer.roles, "reward", "score", "before", call=2)
    got = trainer.train(rows, progress=False)
    assert [(r["step"], r["role"]) for r in trainer.retries[before:]] == [(3, "reward")]
    assert_same(steps_of(got), steps_of(straight[2:]), "retried vs straight")


def test_generate_and_ppo_step_take_rows_and_a_column_function_names_what_strings_lack(run):
    """generate(score=True) on rows, at an index_offset (the chunks of an evaluation), and
    ppo_step on rows score each sample by its own row's id; ppo_step on plain strings (no id)
    fails naming the function and the column, and leaves the trainer at its version."""
    from ppo_ray.rewards import RewardError

    trainer, rows, _, _, _ = run
    out = trainer.generate(rows[5:8], score=True, samples_per_prompt=2, index_offset=5)
    assert out.rewards == ids_of([5, 6, 7])
    # launch.py eval's and the PPO stage's sampler: rows keyed "prompt" keep their columns
    from ppo_ray.tasks import evaluation

    sampled = evaluation.sample(trainer, [{"prompt": r["prompt"], "id": r["id"]} for r in rows[5:8]], score=True)
    assert sampled["reward"] == [5.0, 6.0, 7.0]
    step = trainer.ppo_step(rows[10:14])
    assert step.rewards == ids_of([10, 11, 12, 13]) and step.dynamic_sampling.rounds == 1
    version = trainer.version
    with pytest.raises(RewardError, match=r"'reward_fns:row_id' raised TypeError: .*'id'"):
        trainer.ppo_step([row["prompt"] for row in rows[:4]])
    assert trainer.version == version
