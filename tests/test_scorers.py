"""The reference and reward scorers as plain classes (no Ray), on the tiny model; a reward
function that raises, returns NaN, the wrong number of values or not numbers is a RewardError
naming it (issue 5, item 8)."""

from __future__ import annotations

import math

import pytest
import torch

from actors.reference import ReferenceScorer
from actors.reward import RewardScorer
from ppo_ray.batch import RolloutBatch
from ppo_ray.rewards import RewardError, import_reward_fn
from tolerances import TINY_TERMS, rounding_tol


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from ppo_ray.modeling import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model_dir, tmp_path_factory):
    """A sequence-classification reward model over the tiny base (random score head)."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1)
    with torch.no_grad():
        rm.score.weight.normal_(0, 1.0)  # scores of order 1, so differences are visible
    out = tmp_path_factory.mktemp("rm")
    rm.save_pretrained(out)
    return str(out)


def batch_of(tok, pairs, pad_extra=(0, 0)):
    """[(prompt text, response text, ends_with_eos)] -> padded RolloutBatch (+ extra padding)."""
    prompts = [tok(p)["input_ids"] for p, _, _ in pairs]
    responses = [tok(r)["input_ids"] + ([tok.eos_token_id] if eos else []) for _, r, eos in pairs]
    p = max(map(len, prompts)) + pad_extra[0]
    t = max(map(len, responses)) + pad_extra[1]
    pad = tok.pad_token_id
    return RolloutBatch(
        prompt_ids=torch.tensor([[pad] * (p - len(x)) + x for x in prompts]),
        prompt_mask=torch.tensor([[False] * (p - len(x)) + [True] * len(x) for x in prompts]),
        response_ids=torch.tensor([x + [pad] * (t - len(x)) for x in responses]),
        response_mask=torch.tensor([[True] * len(x) + [False] * (t - len(x)) for x in responses]),
        gen_logprobs=torch.zeros(len(pairs), t), adapter_version=0, pad_token_id=pad,
        eos_token_id=tok.eos_token_id, prompts=[p for p, _, _ in pairs], responses=[r for _, r, _ in pairs])


PAIRS = [
    ("SUBREDDIT: r/cooking\n\nTITLE: rice\n\nPOST: my rice burns\n\nTL;DR:", " rice burns", True),
    ("SUBREDDIT: r/jobs\n\nTITLE: raise\n\nPOST: asked for a raise and got it after two years of work\n\nTL;DR:",
     " got a raise after asking", False),
    ("Short prompt", " and a much longer response that keeps going for a while", True),
]


@pytest.mark.equality
def test_reference_logprobs_match_hf_and_ignore_padding(tiny_model_dir, tok):
    """The scorer's batched, padded forward vs HF on each unpadded row, and vs more padding:
    float32 rounding of the tiny model's reductions at the size of the logprobs."""
    from ppo_ray.logprobs import logprobs_from_logits
    from ppo_ray.modeling import load_causal_lm

    ref = ReferenceScorer(str(tiny_model_dir), temperature=0.7, micro_batch_size=2)
    batch = batch_of(tok, PAIRS)
    lp, stats = ref.logprobs(batch)
    assert stats.seconds > 0  # the call times itself: no second call asks how long it took
    assert lp.shape == batch.response_ids.shape and (lp[~batch.response_mask] == 0).all()
    model = load_causal_lm(str(tiny_model_dir))
    for i, (p, r, eos) in enumerate(PAIRS):  # unpadded, one row at a time
        ids = tok(p)["input_ids"]
        resp = batch.response_ids[i][batch.response_mask[i]]
        with torch.no_grad():
            logits = model(torch.tensor([ids + resp.tolist()])).logits[0, len(ids) - 1:-1]
        want = logprobs_from_logits(logits[None], resp[None], 0.7)[0]
        torch.testing.assert_close(lp[i][batch.response_mask[i]], want, atol=rounding_tol(want.abs().max(), TINY_TERMS),
                                   rtol=0)
    padded, _ = ref.logprobs(batch_of(tok, PAIRS, pad_extra=(5, 4)))
    torch.testing.assert_close(padded[:, : lp.shape[1]], lp, atol=rounding_tol(lp.abs().max(), TINY_TERMS), rtol=0)


@pytest.mark.equality
def test_reward_model_scores_at_last_real_token(reward_model_dir, tok):
    """The scorer's batched, padded scores vs HF on each unpadded sequence, and vs more
    padding: float32 rounding of the tiny model's reductions at the size of the scores."""
    from transformers import AutoModelForSequenceClassification

    scorer = RewardScorer(reward_model_dir, micro_batch_size=2)
    batch = batch_of(tok, PAIRS)
    scores, stats = scorer.score(batch)
    hf = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    for i, (p, r, eos) in enumerate(PAIRS):  # HF on the unpadded sequence: its last token
        ids = tok(p)["input_ids"] + batch.response_ids[i][batch.response_mask[i]].tolist()
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, 0]
        assert abs(float(scores[i]) - float(want)) < rounding_tol(scores.abs().max(), TINY_TERMS), (scores, want)
    assert scores.std() > 1e-3  # the scores differ: not read at a shared pad position
    padded, _ = scorer.score(batch_of(tok, PAIRS, pad_extra=(3, 6)))
    torch.testing.assert_close(padded, scores, atol=rounding_tol(scores.abs().max(), TINY_TERMS), rtol=0)
    # the logged mean and this one: a float32 mean of the same 3 scores, summed in another order
    assert stats.source_means["reward_model"] == pytest.approx(float(scores.mean()),
                                                              abs=rounding_tol(scores.abs().max(), 3))
    assert list(stats.parts()) == ["score/reward_model", "dropped_nonfinite"] and stats.seconds > 0


@pytest.mark.equality
def test_combination_weights_and_missing_eos_penalty(reward_model_dir, tok):
    batch = batch_of(tok, PAIRS)
    rm_only, _ = RewardScorer(reward_model_dir).score(batch)
    fn = torch.tensor([-len(r) / 100.0 for _, r, _ in PAIRS])  # ppo_ray.rewards:brevity
    both, _ = RewardScorer(reward_model_dir, ["ppo_ray.rewards:brevity"], [0.5, 2.0]).score(batch)
    # the same scores, weighted and added in float32 there and here: a few roundings of the terms
    torch.testing.assert_close(both, 0.5 * rm_only + 2.0 * fn, atol=rounding_tol((0.5 * rm_only).abs().max()
                                                                                 + (2.0 * fn).abs().max(), 3), rtol=0)
    pen, _ = RewardScorer(None, ["ppo_ray.rewards:brevity"], missing_eos_penalty=-1.0).score(batch)
    assert pen.tolist() == pytest.approx([fn[0].item(), -1.0, fn[2].item()])  # row 1 has no EOS


def test_nonfinite_scores_error_or_drop(tok):
    batch = batch_of(tok, PAIRS)
    with pytest.raises(RewardError, match="non-finite score nan for prompt index 2"):
        RewardScorer(None, ["reward_fns:nan_at_two"]).score(batch)
    scores, stats = RewardScorer(None, ["reward_fns:nan_at_two"], nonfinite="drop").score(batch)
    assert math.isnan(scores[2]) and stats.dropped_nonfinite == 1.0 and scores[:2].tolist() == [1.0, 1.0]
    assert stats.source_means == {"reward_fns:nan_at_two": 1.0}  # the finite scores' mean


def test_reward_sources_are_checked(tmp_path, tiny_model_dir):
    with pytest.raises(RewardError, match="no reward source"):
        RewardScorer(None, [])
    with pytest.raises(RewardError, match="cannot import module 'no_such_module_xyz'"):
        import_reward_fn("no_such_module_xyz:f")
    with pytest.raises(RewardError, match="has no callable 'nope'"):
        import_reward_fn("ppo_ray.rewards:nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a loadable model"):
        RewardScorer(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        RewardScorer(str(tmp_path.parent))


# -------------------------------------------------- bad reward functions (issue 5, item 8)
def _texts_batch(n: int):
    from ppo_ray.batch import RolloutBatch

    return RolloutBatch(
        prompt_ids=torch.full((n, 2), 5), prompt_mask=torch.ones(n, 2, dtype=torch.bool),
        response_ids=torch.full((n, 3), 6), response_mask=torch.ones(n, 3, dtype=torch.bool),
        gen_logprobs=torch.zeros(n, 3), adapter_version=0, pad_token_id=0, eos_token_id=1,
        prompts=[f"p{i}" for i in range(n)], responses=[f"r{i}" for i in range(n)])


@pytest.mark.parametrize("fn,match", [
    ("reward_fns:raises", r"reward function 'reward_fns:raises' raised RuntimeError: this reward function always fails"),
    ("reward_fns:wrong_length", r"reward function 'reward_fns:wrong_length' returned 9 values for 8 prompts"),
    ("reward_fns:nan_at_two", r"reward source 'reward_fns:nan_at_two' gave non-finite score nan for prompt index 2"),
    ("reward_fns:not_numbers", r"reward function 'reward_fns:not_numbers' must return a list of 8 numbers"),
])
def test_bad_reward_functions_without_ray(fn, match):
    from actors.reward import RewardScorer
    from ppo_ray.rewards import RewardError

    with pytest.raises(RewardError, match=match):
        RewardScorer(None, [fn]).score(_texts_batch(8))


def test_a_dropped_row_stays_dropped_whatever_the_penalties():
    """reward_failure drop with missing_eos_penalty and overlong_buffer: the row whose call fails
    (r3, cut off without EOS at max_new_tokens) keeps its NaN, so the learner masks it out
    (learner.Learner._drop_nonfinite; tests/test_learner.py::test_nonfinite_scores_dropped_and_counted)
    and the count of dropped rows is the rows it drops; the other rows get their penalties."""
    eos = 1
    batch = RolloutBatch.from_tokens([[5, 5]] * 4, [[6, eos], [6, 6, 6, 6], [6, eos], [6, 6, 6, 6]], pad_token_id=0,
                                     eos_token_id=eos, prompts=[f"p{i}" for i in range(4)],
                                     responses=[f"r{i}" for i in range(4)])
    scorer = RewardScorer(None, ["reward_fns:raises_on_r3"], failure="drop", nonfinite="drop", missing_eos_penalty=-1.0,
                          max_new_tokens=4, overlong_buffer=2, overlong_penalty=1.0)
    scores, stats = scorer.score(batch)
    assert math.isnan(scores[3])
    # r1: no EOS (-1 in place of its score 1), 2 tokens past max_new_tokens - overlong_buffer (-1 more)
    assert scores[:3].tolist() == [0.0, -2.0, 2.0]
    assert stats.failures.rows_dropped == 1.0 and stats.dropped_nonfinite == 1.0


@pytest.mark.parametrize("guarded", [False, True], ids=["plain call", "guarded calls"])
def test_reward_functions_get_the_finish_reasons_they_ask_for(guarded):
    """finish_reasons ("stop": ended with EOS, "length": cut off) reach a function that names
    them and one with **kwargs, in row order, on the plain call and on guarded calls (chunks of
    3 rows here); a function that takes neither is called with (prompts, completions) alone."""
    eos = 1
    responses = [[6, eos], [6, 6, 6], [eos], [6, 6, 6], [6, 6, eos]]
    batch = RolloutBatch.from_tokens([[5, 5]] * 5, responses, pad_token_id=0, eos_token_id=eos,
                                     prompts=[f"p{i}" for i in range(5)], responses=[f"r{i}" for i in range(5)])
    options = dict(failure="score", chunk_size=3) if guarded else {}
    stop = [1.0, 0.0, 1.0, 0.0, 1.0]
    for fn, want in (("reward_fns:ended_with_eos", stop),
                     ("reward_fns:numbers_plus_ten_at_eos", [i + 10.0 * s for i, s in enumerate(stop)]),
                     ("reward_fns:numbers", [float(i) for i in range(5)])):
        scorer = RewardScorer(None, [fn], **options)
        assert scorer.guarded is guarded
        scores, stats = scorer.score(batch)
        assert scores.tolist() == want, fn
        assert stats.failures is None or stats.failures.exceptions == 0.0


@pytest.mark.parametrize("guarded", [False, True], ids=["plain call", "guarded calls"])
def test_reward_functions_get_the_dataset_columns_of_each_rows_prompt(guarded):
    """A batch's dataset columns (ppo_ray.data.PromptColumns: one value per prompt, by group id)
    reach a function that names one as each row's prompt's value, found by the row's group id
    and not by row order (the groups here are neither contiguous from 0 nor in order), on the
    plain call and on guarded calls (chunks of 4 rows, which cut a group); a two-argument
    function and one with **kwargs get their usual arguments beside them."""
    from actors.reward import reward_columns
    from ppo_ray.data import RESERVED_COLUMNS, PromptColumns

    eos = 1
    groups = [12, 12, 10, 10, 11, 11]
    ids = {10: 100, 11: 101, 12: 102}
    batch = RolloutBatch.from_tokens([[5, 5]] * 6, [[6, eos], [6, 6], [eos], [6, 6], [6, eos], [6]], pad_token_id=0,
                                     eos_token_id=eos, groups=groups,
                                     prompts=[f"#{ids[g]} p{g}" for g in groups], responses=[f"r{i}" for i in range(6)])
    columns = PromptColumns({"id": [100, 101, 102], "note": ["a", "b", "c"]}, first=10)
    per_row = reward_columns(batch, columns)
    assert per_row == {"finish_reasons": ["stop", "length", "stop", "length", "stop", "length"],
                       "id": [102, 102, 100, 100, 101, 101], "note": ["c", "c", "a", "a", "b", "b"]}
    assert "finish_reasons" in RESERVED_COLUMNS  # a dataset column can never shadow the batch's own
    options = dict(failure="score", chunk_size=4) if guarded else {}
    for fn, want in (("reward_fns:row_id", [102.0, 102.0, 100.0, 100.0, 101.0, 101.0]),
                     ("reward_fns:numbers", [float(i) for i in range(6)]),
                     ("reward_fns:numbers_plus_ten_at_eos", [i + 10.0 * (i % 2 == 0) for i in range(6)])):
        scorer = RewardScorer(None, [fn], **options)
        assert scorer.guarded is guarded
        scores, stats = scorer.score(batch, columns)
        assert scores.tolist() == want, fn
        assert stats.failures is None or stats.failures.exceptions == 0.0
    # without the column the function names, it fails naming itself and the column
    with pytest.raises(RewardError, match=r"'reward_fns:row_id' raised TypeError: .*'id'"):
        RewardScorer(None, ["reward_fns:row_id"]).score(batch)
    # a batch without group ids cannot be matched to its prompts' columns: said, not guessed by row order
    no_groups = RolloutBatch.from_tokens([[5]], [[6]], pad_token_id=0, eos_token_id=eos, prompts=["#100 p"],
                                         responses=["r0"])
    with pytest.raises(ValueError, match="by its group ids, and this batch has none"):
        RewardScorer(None, ["reward_fns:row_id"]).score(no_groups, columns)
