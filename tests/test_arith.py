"""ppo_ray/tasks/arith.py: the verifiable task's data, its verifier and pass@k."""

from __future__ import annotations

import itertools
import json

import pytest

from ppo_ray.rewards import RewardError
from ppo_ray.tasks.arith import is_right, operands, pass_at_k, units_carry, verify, write_task


SMALL = {"sft_train": 300, "sft_validation": 20, "prompts_train": 300, "prompts_validation": 20, "prompts_test": 50}


def test_the_splits_are_deterministic_disjoint_and_right(tmp_path):
    a = write_task(tmp_path / "a", seed=3, digits=2, sizes=SMALL)
    b = write_task(tmp_path / "b", seed=3, digits=2, sizes=SMALL)
    assert {name: p.read_bytes() for name, p in a.items()} == {name: p.read_bytes() for name, p in b.items()}
    c = write_task(tmp_path / "c", seed=4, digits=2, sizes=SMALL)
    assert a["prompts_test.jsonl"].read_bytes() != c["prompts_test.jsonl"].read_bytes()
    seen = {}
    for name, path in a.items():
        for row in map(json.loads, path.read_text().splitlines()):
            x, y = operands(row["prompt"])
            assert 10 <= x <= 99 and 10 <= y <= 99
            assert row["answer"] == str(x + y - 10 * row.get("slip", False))
            key = (min(x, y), max(x, y))
            assert seen.setdefault(key, name) == name, f"{row['prompt']} is in {seen[key]} and {name}"
    assert len(a["sft_train.jsonl"].read_text().splitlines()) == 300


@pytest.mark.parametrize("slip", [0.0, 0.6, 1.0])
def test_the_sft_annotator_forgets_the_units_carry_at_its_rate(tmp_path, slip):
    """SFT answers slip (a + b - 10) only where the units digits carry, at about carry_slip of
    those; the prompts' answers are always the true sums."""
    paths = write_task(tmp_path, seed=1, digits=2, carry_slip=slip, sizes=SMALL)
    rows = [json.loads(line) for line in paths["sft_train.jsonl"].read_text().splitlines()]
    carry = [r for r in rows if units_carry(*operands(r["prompt"]))]
    assert not any(r["slip"] for r in rows if not units_carry(*operands(r["prompt"])))
    rate = sum(r["slip"] for r in carry) / len(carry)
    assert rate == slip if slip in (0.0, 1.0) else abs(rate - slip) < 4 * (slip * (1 - slip) / len(carry)) ** 0.5
    for r in carry:
        a, b = operands(r["prompt"])
        assert r["answer"] == str(a + b - 10 * r["slip"])
        assert is_right(r["prompt"], r["answer"], "stop") is not r["slip"]
    for r in map(json.loads, paths["prompts_test.jsonl"].read_text().splitlines()):
        assert is_right(r["prompt"], r["answer"], "stop")


@pytest.mark.parametrize("completion, right", [
    ("936", True), (" 936 ", True), ("936\n", True), ("0936", False), ("93", False), ("9 36", False),
    ("936.0", False), ("-936", False), ("", False), ("nine", False), ("9360", False)])
def test_the_verifier_takes_exactly_the_sum(completion, right):
    assert is_right("347+589=", completion, "stop") is right
    assert verify(["347+589="], [completion], finish_reasons=["stop"]) == [1.0 if right else 0.0]


@pytest.mark.parametrize("completion", ["936", "936\n\n", " 936"])
def test_an_answer_cut_off_without_eos_is_no_answer(completion):
    """The module's rule, "the sum followed by EOS": the right digits cut off at max_new_tokens
    (finish reason "length") are wrong, for the reward as for pass@1 and pass@k (is_right)."""
    assert not is_right("347+589=", completion, "length")
    assert verify(["347+589=", "347+589="], [completion, completion], finish_reasons=["length", "stop"]) == [0.0, 1.0]


def test_the_verifier_gets_the_finish_reasons_from_the_reward_scorer():
    """ppo_ray.tasks.arith:verify as a config's reward function: the scorer passes the batch's
    finish reasons (it names them), so "46" cut off scores 0 and "46" then EOS scores 1."""
    from actors.reward import RewardScorer
    from ppo_ray.batch import RolloutBatch

    eos = 1
    batch = RolloutBatch.from_tokens([[5]] * 2, [[6, 6], [6, eos]], pad_token_id=0, eos_token_id=eos,
                                     prompts=["23+23=", "23+23="], responses=["46", "46"])
    scores, _ = RewardScorer(None, ["ppo_ray.tasks.arith:verify"]).score(batch)
    assert scores.tolist() == [0.0, 1.0]


def test_the_verifier_names_a_prompt_that_is_not_an_addition():
    with pytest.raises(RewardError, match="'Summarize this' is not an addition prompt"):
        verify(["Summarize this"], ["1"], finish_reasons=["stop"])
    with pytest.raises(RewardError, match="2 prompts but 1 completions and 2 finish reasons"):
        verify(["1+1=", "2+2="], ["2"], finish_reasons=["stop", "stop"])


@pytest.mark.parametrize("n, c, k", [(8, 0, 8), (8, 3, 8), (8, 3, 1), (8, 3, 4), (10, 1, 3), (5, 5, 2), (6, 2, 5)])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_right_sample(n, c, k):
    """Chen et al.'s estimator equals its definition: over every k-subset of the n samples
    (c of them right), the share that holds at least one right one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    want = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, n + 1)


def test_pass_rates_apply_the_verifiers_rule():
    """ppo_ray.tasks.evaluation.solve (pass@1, pass@k, as the RL stage and `launch.py eval`
    report them) counts an answer cut off without EOS as wrong, as the reward does."""
    from ppo_ray.stats import Responses
    from ppo_ray.tasks.evaluation import arith_rates, solve

    class Trainer:  # the two generate calls of solve: greedy, then k = 2 samples per prompt
        def generate(self, prompts, *, samples_per_prompt, greedy, score, index_offset):
            if greedy:
                return Responses(["46", "46"], ["stop", "length"], 0)
            return Responses(["46", "46", "46\n\n", "46"], ["length", "stop", "length", "length"], 0)

    res = solve(Trainer(), [{"prompt": "23+23="}, {"prompt": "23+23="}], 2)
    assert res["greedy_right"] == [True, False] and res["right"] == [1, 0]
    assert res["greedy_finish"] == ["stop", "length"] and res["samples_finish"] == [["length", "stop"],
                                                                                     ["length", "length"]]
    assert arith_rates(res, 2) == {"pass1": 0.5, "pass2": 0.5, "sample_accuracy": 0.25}


def test_the_verifier_compares_with_the_rows_answer_without_reading_the_prompt():
    """With the dataset's `answer` column the verifier compares with the row's answer and never
    parses the prompt (a prompt that is no addition scores by its answer); a row without one
    (None) and a call without the column read the prompt as before; the answer must be digits."""
    assert verify(["What is 2 and 3?", "2+2=", "2+2="], ["5", "4", "5"], finish_reasons=["stop"] * 3,
                  answer=["5", None, "5"]) == [1.0, 1.0, 1.0]
    assert verify(["2+2="], ["4"], finish_reasons=["stop"], answer=["5"]) == [0.0]  # the row's answer rules
    assert verify(["2+2="], ["4"], finish_reasons=["length"], answer=["4"]) == [0.0]  # and EOS still does
    assert is_right("anything", " 12 ", "stop", 12) and not is_right("anything", "012", "stop", "12")
    with pytest.raises(RewardError, match=r"the answer '1e3' of 'x' is not a number of digits"):
        verify(["x"], ["1000"], finish_reasons=["stop"], answer=["1e3"])
    with pytest.raises(RewardError, match="1 prompts but 1 completions and 1 finish reasons and 2 answers"):
        verify(["1+1="], ["2"], finish_reasons=["stop"], answer=["2", "2"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_rows_answers_are_the_sums_the_prompts_give(tmp_path, seed):
    """The arith preset's numbers do not change with the answers as ground truth: in every
    prompts_* row the RL stage and its evaluation read (the preset's data, its three seeds,
    the full splits), the answer is exactly the prompt's sum, so the verifier and is_right score
    every completion alike with and without it (the right sum, the annotator's slip, off by one,
    a leading zero, the right sum cut off)."""
    paths = write_task(tmp_path, seed=seed, digits=2, carry_slip=0.6)
    for name in ("prompts_train.jsonl", "prompts_validation.jsonl", "prompts_test.jsonl"):
        rows = [json.loads(line) for line in paths[name].read_text().splitlines()]
        assert all(row["answer"] == str(sum(operands(row["prompt"]))) for row in rows), name
        prompts, completions, reasons = [], [], []
        for row in rows:
            total = sum(operands(row["prompt"]))
            for text, reason in ((str(total), "stop"), (str(total - 10), "stop"), (str(total + 1), "stop"),
                                 (f"0{total}", "stop"), (str(total), "length")):
                prompts.append(row["prompt"])
                completions.append(text)
                reasons.append(reason)
        answers = [row["answer"] for row in rows for _ in range(5)]
        with_answers = verify(prompts, completions, finish_reasons=reasons, answer=answers)
        assert with_answers == verify(prompts, completions, finish_reasons=reasons)
        assert with_answers == [1.0, 0.0, 0.0, 0.0, 0.0] * len(rows)


def test_the_verifier_gets_the_answers_from_the_reward_scorer():
    """verify as a config's reward function on a batch with the dataset's `answer` column: the
    scorer passes it (verify names it), each row its prompt's, so the row's answer is the one
    compared with (here a problem whose prompt no longer says the sum)."""
    from actors.reward import RewardScorer
    from ppo_ray.batch import RolloutBatch
    from ppo_ray.data import PromptColumns

    eos = 1
    batch = RolloutBatch.from_tokens([[5]] * 4, [[6, eos]] * 4, pad_token_id=0, eos_token_id=eos, groups=[0, 0, 1, 1],
                                     prompts=["23+23=", "23+23=", "two plus two", "two plus two"],
                                     responses=["46", "45", "4", "5"])
    scores, _ = RewardScorer(None, ["ppo_ray.tasks.arith:verify"]).score(
        batch, PromptColumns({"answer": ["46", "4"], "id": ["a", "b"]}))
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0]


def test_pass_rates_read_the_rows_answers():
    """solve (pass@1 and pass@k) applies is_right with each row's `answer` when the rows have
    one: the same rule as the reward, the same ground truth (rows whose prompts hold no sum)."""
    from ppo_ray.stats import Responses
    from ppo_ray.tasks.evaluation import arith_rates, solve

    class Trainer:  # greedy, then k = 2 samples per problem
        def generate(self, prompts, *, samples_per_prompt, greedy, score, index_offset):
            if greedy:
                return Responses(["7", "7"], ["stop", "stop"], 0)
            return Responses(["7", "8", "7", "7"], ["stop", "stop", "stop", "length"], 0)

    rows = [{"prompt": "three and four", "answer": "7"}, {"prompt": "four and four", "answer": "8"}]
    res = solve(Trainer(), rows, 2)
    assert res["greedy_right"] == [True, False] and res["right"] == [1, 0]
    assert arith_rates(res, 2) == {"pass1": 0.5, "pass2": 0.5, "sample_accuracy": 0.25}


# -------------------------------------------------- task arith-chat (an instruct model from its baseline)
@pytest.mark.parametrize("completion, reason, right", [
    ("23 + 58 = 81.", "stop", True), ("81", "stop", True), ("The answer is 81", "stop", True),
    ("23 + 58 = 81", "length", False),  # cut off at max_new_tokens: no answer
    ("81 or 82", "stop", False), ("8", "stop", False), ("eighty-one", "stop", False), ("", "stop", False),
    ("23 + 58 = 810", "stop", False),  # a maximal run of digits, not a prefix of one
])
def test_arith_chat_scores_the_replys_last_number_then_eos(completion, reason, right):
    from ppo_ray.tasks.arith import chat_prompt_of, is_right_last_number, verify_last_number

    prompt = chat_prompt_of(23, 58)
    assert prompt == "What is 23 + 58? Answer with the number only."
    assert is_right_last_number(prompt, completion, reason) is right  # the prompt's sum
    assert verify_last_number(["x"], [completion], finish_reasons=[reason], answer=["81"]) == [float(right)]
    # what the verifier sees under apply_chat_template: the formatted prompt, its question inside
    chat = f"<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    assert operands(chat) == (23, 58) and is_right_last_number(chat, completion, reason) is right


def test_arith_chat_writes_arith_problems_as_questions_and_no_sft_splits(tmp_path):
    """The same operands per seed as task arith (its SFT problems drawn and left out), asked as
    the chat question; no SFT file, since the task has no SFT stage."""
    from ppo_ray.tasks.arith import chat_prompt_of

    bare = write_task(tmp_path / "bare", seed=2, digits=2, sizes=SMALL)
    chat = write_task(tmp_path / "chat", seed=2, digits=2, sizes=SMALL, prompt=chat_prompt_of, sft=False)
    assert sorted(chat) == ["prompts_test.jsonl", "prompts_train.jsonl", "prompts_validation.jsonl"]
    for name, path in chat.items():
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        want = [json.loads(line) for line in bare[name].read_text().splitlines()]
        assert [operands(r["prompt"]) for r in rows] == [operands(r["prompt"]) for r in want]
        assert [r["answer"] for r in rows] == [r["answer"] for r in want]
        assert all(r["prompt"] == chat_prompt_of(*operands(r["prompt"])) for r in rows)


def test_arith_chat_trains_the_base_model_and_reports_against_it(tmp_path):
    """The PPO stage's policy is the configured model itself (no SFT stage); its pass rates and
    samples name the starting policy "base"."""
    from ppo_ray.config import PPOConfig
    from ppo_ray.stats import Responses
    from ppo_ray.tasks import pipeline
    from ppo_ray.tasks.evaluation import arith_numbers, solve

    config = PPOConfig.from_yaml("smollm2-arith")
    task = pipeline.task_of(config)
    assert task.stages == ("ppo",) and task.before_name == "base" and config.apply_chat_template
    data = pipeline.write_data(config, tmp_path / "run")
    assert not list(data.glob("sft_*.jsonl"))
    cfg = pipeline.ppo_config(config, tmp_path / "run", data)
    assert cfg.model_name == "package:smollm2-135m-instruct" and cfg.ref_model_name is None
    assert cfg.reward_funcs == ["ppo_ray.tasks.arith:verify_last_number"]

    class Trainer:  # greedy, then k = 2 samples per prompt
        def generate(self, prompts, *, samples_per_prompt, greedy, score, index_offset):
            if greedy:
                return Responses(["2 + 2 = 4", "4"], ["stop", "length"], 0)
            return Responses(["4", "It is 4.", "5", "4"], ["stop", "stop", "stop", "length"], 0)

    rows = [{"prompt": "What is 2 + 2? Answer with the number only.", "answer": "4"}] * 2
    res = task.evaluate(Trainer(), cfg.replace(eval_k=2), rows)
    assert res["greedy_right"] == [True, False] and res["right"] == [2, 0]
    assert solve(Trainer(), rows, 2)["greedy_right"] == [False, False]  # arith's exact rule differs
    assert set(arith_numbers("test", 2, res, res, "base")) == {
        f"{m}_test_{who}" for m in ("pass1", "pass2", "sample_accuracy") for who in ("base", "rl")}
