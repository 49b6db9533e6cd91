"""ppo_ray/stats.py: the typed step. StepResult's flat record (the JSONL's columns), its
read-only Mapping view for the seeds' keys, and the names that mean one thing."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from helpers import learner_stats, step_result
from ppo_ray.stats import StepResult


def test_the_seeds_keys_read_like_a_dict():
    result = step_result()
    assert result["generated_texts"] == ["a", "b", "c"]
    assert result["rewards"][0] == 1.0 and math.isnan(result["rewards"][1])
    assert result["policy_loss"] == result.learner.policy_loss == 0.0
    assert result["value_loss"] == result.learner.value_loss
    assert "time/update_s" in result and result.get("missing") is None
    with pytest.raises(KeyError):
        result["missing"]
    with pytest.raises(TypeError):
        result["kl"] = 0.0  # read-only: a step's record is what the step computed


def test_reward_mean_is_the_scores_and_shaped_reward_mean_the_learners():
    result = step_result(rewards=(1.0, float("nan"), 3.0))
    assert result.reward_mean == 2.0 == result["reward_mean"]  # NaN (a dropped sample) left out
    assert result["shaped_reward_mean"] == result.learner.shaped_reward_mean
    assert "reward_mean" not in result.learner.as_dict()
    assert math.isnan(step_result(rewards=(float("nan"),)).reward_mean)


def test_as_dict_is_the_flat_record_and_scalars_drop_the_lists():
    result = step_result()
    record = result.as_dict()
    assert record["time/step_s"] == 4.0 and record["tokens_per_s"] == 5.0
    assert record["score/reward_model"] == 2.0 and record["adapter_version"] == 3
    assert set(dataclasses.asdict(result.learner)) - {"loss_extra"} <= set(record)
    assert record["dual_clipfrac"] == 0.5 and "loss_extra" not in record  # a loss's own statistics, flat
    small = result.scalars()
    assert "generated_texts" not in small and "rewards" not in small and small["step"] == 3
    json.dumps(small)  # one JSONL line


def test_response_lengths_and_the_no_eos_fraction():
    result = dataclasses.replace(step_result(), finish_reasons=["stop", "length", "stop"])
    assert result["response_tokens"] == 20 and result["response_lengths"] == [4, 10, 6]
    assert (result["response_length_mean"], result["response_length_max"]) == (pytest.approx(20 / 3), 10.0)
    assert result["no_eos_frac"] == pytest.approx(1 / 3)
    small = result.scalars()
    assert "response_lengths" not in small and small["no_eos_frac"] == result.no_eos_frac
    empty = dataclasses.replace(result, generated_texts=[], finish_reasons=[], rewards=[], response_lengths=[])
    assert all(math.isnan(empty[k]) for k in ("response_length_mean", "response_length_max", "no_eos_frac"))


def test_extra_holds_the_evaluations_merged_by_train():
    result = step_result()
    result.extra.update(gold_val=0.9, eval_reward_mean=0.5)
    assert result["gold_val"] == 0.9 and result.scalars()["eval_reward_mean"] == 0.5
    assert len(result) == len(result.as_dict())


def test_generation_summaries_join_in_prompt_order_and_time_the_slowest_replica():
    from ppo_ray.batch import RolloutBatch
    from ppo_ray.stats import GenerationSummary

    batch = RolloutBatch.from_tokens([[5, 6], [7]], [[1, 2, 0], [3]], pad_token_id=9, eos_token_id=0,
                                     adapter_version=2, prompts=["p", "q"], responses=["ab", "c"],
                                     finish_reasons=["stop", "length"])
    first = GenerationSummary.of(batch, seconds=1.5)
    assert first.lengths == [3, 1] and first.texts == ["ab", "c"] and first.version == 2  # EOS counted
    second = GenerationSummary(["d"], ["stop"], [2], version=2, seconds=0.5)
    joined = GenerationSummary.join([first, second])
    assert joined.texts == ["ab", "c", "d"] and joined.finish_reasons == ["stop", "length", "stop"]
    assert joined.lengths == [3, 1, 2] and joined.seconds == 1.5
    with pytest.raises(ValueError, match=r"versions \[1, 2\]"):
        GenerationSummary.join([first, dataclasses.replace(second, version=1)])


def test_generation_summaries_carry_each_rows_group_id_through_join_and_select():
    """Dynamic sampling's filter reads each row's group id beside its score: the summary
    carries them (RolloutBatch.groups), in prompt order across replicas and through select."""
    from ppo_ray.batch import RolloutBatch
    from ppo_ray.stats import GenerationSummary

    def part(groups):
        n = len(groups)
        return RolloutBatch.from_tokens([[5]] * n, [[1, 0]] * n, pad_token_id=9, eos_token_id=0, groups=groups,
                                        responses=["a"] * n, finish_reasons=["stop"] * n)

    first, second = GenerationSummary.of(part([4, 4, 5, 5]), 1.0), GenerationSummary.of(part([6, 6]), 1.0)
    joined = GenerationSummary.join([first, second])
    assert joined.groups == [4, 4, 5, 5, 6, 6]
    assert joined.select([5, 0, 3]).groups == [6, 4, 5]
    plain = GenerationSummary.of(RolloutBatch.from_tokens([[5]], [[1, 0]], pad_token_id=9, eos_token_id=0,
                                                          responses=["a"], finish_reasons=["stop"]), 1.0)
    assert plain.groups == [] and plain.select([0]).groups == []


def test_reward_stats_give_the_step_its_score_columns():
    from ppo_ray.stats import RewardStats

    stats = RewardStats({"reward_model": 2.0, "pkg.mod:fn": 0.5}, dropped_nonfinite=1.0, seconds=0.25)
    # the JSONL's columns, in the order the step records them; the seconds go to time/reward_s
    assert list(stats.parts().items()) == [("score/reward_model", 2.0), ("score/pkg.mod:fn", 0.5),
                                           ("dropped_nonfinite", 1.0)]
    assert dataclasses.replace(step_result(), reward_parts=stats.parts())["score/pkg.mod:fn"] == 0.5


def test_step_rates_are_tokens_and_flops_per_second_of_each_phase():
    """StepResult.rates (the driver's _result): generation's tokens over generate_s (the
    slowest replica), the learner's trained tokens and model FLOPs over its update_s, MFU
    against its peak; NaN where a time is 0 or the peak or FLOPs unknown."""
    timing = step_result().timing  # generate_s 1.0, update_s 2.0
    learner = learner_stats(tokens=30.0, learner_flops=8e9, learner_peak_flops_per_s=1e11)
    rates = StepResult.rates(timing, learner, 20)
    assert rates == {"rollout_tokens_per_s": 20.0, "learner_tokens_per_s": 15.0, "learner_flops_per_s": 4e9,
                     "learner_mfu": 0.04}
    unknown = StepResult.rates(timing, learner_stats(tokens=30.0, learner_flops=8e9,
                                                     learner_peak_flops_per_s=math.nan), 20)
    assert math.isnan(unknown["learner_mfu"]) and unknown["learner_flops_per_s"] == 4e9
    assert math.isnan(StepResult.rates(timing, learner_stats(learner_flops=math.nan), 20)["learner_mfu"])
    untimed = StepResult.rates(dataclasses.replace(timing, generate_s=0.0, update_s=0.0), learner, 20)
    assert all(math.isnan(v) for v in untimed.values())
    # the record's columns; a StepResult made without them says NaN (0 for the queue), not a number
    record = dataclasses.replace(step_result(), **rates, queue_depth=1.0).scalars()
    assert {k: record[k] for k in (*rates, "queue_depth")} == {**rates, "queue_depth": 1.0}
    bare = step_result().as_dict()
    assert all(math.isnan(bare[k]) for k in rates) and bare["queue_depth"] == 0.0
    assert "learner_flops" in bare and "learner_peak_flops_per_s" in bare  # the learner's own, beside
