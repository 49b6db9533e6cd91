"""RolloutBatch: layout, reshaping and the seeds' state-action view."""

import pytest
import torch

from ppo_ray.batch import RolloutBatch, RowPick, TrimPlan, gather, pad_rows

PAD, EOS = 9, 8


def make(prompts, responses, version=0):
    """prompts/responses: lists of token lists; builds the left/right padded layout."""
    p = max(map(len, prompts))
    t = max(map(len, responses))
    pid = torch.tensor([[PAD] * (p - len(x)) + x for x in prompts])
    rid = torch.tensor([x + [PAD] * (t - len(x)) for x in responses])
    pm = torch.tensor([[False] * (p - len(x)) + [True] * len(x) for x in prompts])
    rm = torch.tensor([[True] * len(x) + [False] * (t - len(x)) for x in responses])
    lp = torch.where(rm, -torch.rand(rm.shape), 0.0)
    return RolloutBatch(pid, pm, rid, rm, lp, version, PAD, EOS,
                        prompts=[str(x) for x in prompts], responses=[str(x) for x in responses],
                        finish_reasons=["stop" if x[-1] == EOS else "length" for x in responses])


def test_sequences_positions_and_eos():
    b = make([[1, 2, 3], [4]], [[5, EOS], [6, 7, 1]])
    ids, att, pos = b.sequences()
    assert ids.tolist() == [[1, 2, 3, 5, EOS, PAD], [PAD, PAD, 4, 6, 7, 1]]
    assert pos.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert att[1].tolist() == [False, False, True, True, True, True]
    assert b.has_eos.tolist() == [True, False]
    assert b.response_lengths.tolist() == [2, 3]


def test_from_tokens_builds_the_layout():
    """RolloutBatch.from_tokens (pad_sequence underneath) gives the hand-built layout of make()."""
    prompts, responses = [[1, 2, 3], [4]], [[5, EOS], [6, 7, 1]]
    want = make(prompts, responses, version=3)
    lps = [want.gen_logprobs[i, :len(r)].tolist() for i, r in enumerate(responses)]
    got = RolloutBatch.from_tokens(prompts, responses, PAD, EOS, gen_logprobs=lps, adapter_version=3,
                                   prompts=want.prompts, responses=want.responses, finish_reasons=want.finish_reasons)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "gen_logprobs"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.adapter_version, got.prompts, got.finish_reasons) == (3, want.prompts, want.finish_reasons)
    # no logprobs: zeros; all responses empty: still one (padding) response column
    empty = RolloutBatch.from_tokens([[1], [2, 3]], [[], []], PAD, EOS)
    assert empty.response_ids.tolist() == [[PAD], [PAD]] and not empty.response_mask.any()
    assert empty.gen_logprobs.tolist() == [[0.0], [0.0]]
    assert pad_rows([[1], [2, 3]], 0, "left", min_width=3).tolist() == [[0, 0, 1], [0, 2, 3]]


def test_trimmed_widths_come_from_the_trim_plan():
    b = make([[1, 2, 3], [4], [5, 6]], [[5, EOS], [6, 7, 1, EOS], [2]])
    plan = TrimPlan.of(b)
    for rows in ([0], [1], [2], [1, 2], [0, 1, 2]):
        sub = b.select(rows)
        assert sub.trimmed().prompt_ids.shape[1] == max(len(([1, 2, 3], [4], [5, 6])[i]) for i in rows)
        p_keep, t_keep = plan.widths(rows)
        assert torch.equal(sub.trimmed().response_ids, sub.trimmed(p_keep, t_keep).response_ids)
        assert torch.equal(sub.trimmed().prompt_ids, b.select(rows).prompt_ids[:, p_keep:])


def test_pad_equal_to_eos_is_refused():
    b = make([[1]], [[2]])
    with pytest.raises(ValueError, match="pad_token_id equals eos_token_id"):
        RolloutBatch(b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, b.gen_logprobs, 0, 3, 3)


def test_shape_mismatch_is_named():
    b = make([[1]], [[2, 3]])
    with pytest.raises(ValueError, match="shapes disagree"):
        RolloutBatch(b.prompt_ids, b.prompt_mask, b.response_ids[:, :1], b.response_mask, b.gen_logprobs, 0, PAD, EOS)


def test_cat_select_trim_round_trip():
    a = make([[1, 2, 3], [4]], [[5, EOS], [6]])
    c = make([[7, 7]], [[1, 2, 3, 4, EOS]])
    both = RolloutBatch.cat([a, c])
    assert both.prompt_ids.shape == (3, 3) and both.response_ids.shape == (3, 5)
    assert both.prompts == a.prompts + c.prompts
    back = both.select([2]).trimmed()
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "gen_logprobs"):
        assert torch.equal(getattr(back, name), getattr(c, name)), name
    first = both.select([0, 1]).trimmed()
    assert torch.equal(first.response_ids, a.response_ids) and torch.equal(first.prompt_ids, a.prompt_ids)


def test_cat_refuses_mixed_versions():
    with pytest.raises(ValueError, match="different adapter versions"):
        RolloutBatch.cat([make([[1]], [[2]], version=1), make([[1]], [[2]], version=2)])


def test_staleness_rule():
    """Rollouts may be 0 .. max_staleness versions behind the learner; never ahead."""
    from ppo_ray.batch import fresh_enough

    assert fresh_enough(1, 3, 2) and not fresh_enough(0, 3, 2)
    assert fresh_enough(3, 3, 0) and not fresh_enough(2, 3, 0)
    assert fresh_enough(2, 3, 1) and not fresh_enough(1, 3, 1)
    assert not fresh_enough(4, 3, 1)  # sampled with a newer adapter than the learner holds


def test_token_versions_follow_the_rows_and_columns():
    """partial_rollout continue: each token's version travels with its token through select,
    trimmed, to and cat (a batch without them reads as its adapter_version everywhere)."""
    prompts, responses = [[1, 2], [3]], [[5, 6, 7, EOS], [6]]
    got = RolloutBatch.from_tokens(prompts, responses, PAD, EOS, adapter_version=2,
                                   token_versions=[[2, 2, 3, 3], [2]])
    assert got.token_versions.shape == got.response_ids.shape and got.token_versions[0].tolist() == [2, 2, 3, 3]
    assert got.select([1, 0]).token_versions[1].tolist() == [2, 2, 3, 3]
    assert got.trimmed(0, 3).token_versions.tolist()[0] == [2, 2, 3]
    assert got.to("cpu").token_versions is not None
    plain = RolloutBatch.from_tokens([[4]], [[7, 7, 7, 7, 7]], PAD, EOS, adapter_version=2)
    assert plain.token_versions is None and plain.versions_of_tokens().tolist() == [[2] * 5]
    both = RolloutBatch.cat([got, plain])
    real = [row[mask].tolist() for row, mask in zip(both.token_versions, both.response_mask)]
    assert real == [[2, 2, 3, 3], [2], [2] * 5]
    with pytest.raises(ValueError, match=r"token_versions must be a \(B, T\)"):
        RolloutBatch(got.prompt_ids, got.prompt_mask, got.response_ids, got.response_mask, got.gen_logprobs, 2,
                     PAD, EOS, token_versions=torch.zeros(2, 1, dtype=torch.long))


def test_a_row_pick_takes_the_named_rows_of_each_round_in_order():
    """Dynamic sampling names the rows a step trains on by index (RowPick): the actor that
    takes the rounds' replica batches builds the batch from them. Each picked row is the row of
    its round at that index, token for token (widths re-padded to the picked rows'), rounds in
    order; a pick that does not fit the parts it is given is refused, naming the counts."""
    def part(prompts, responses, groups):
        return RolloutBatch.from_tokens(prompts, responses, pad_token_id=9, eos_token_id=0, groups=groups,
                                        gen_logprobs=[[-0.5 * (i + 1)] * len(r) for i, r in enumerate(responses)],
                                        responses=[str(r) for r in responses], finish_reasons=["stop"] * len(groups))

    round0 = [part([[1, 2], [3]], [[4, 0], [5, 6, 0]], [0, 0]), part([[7]], [[8, 8, 8, 0]], [1])]
    round1 = [part([[2, 2, 2]], [[3, 0]], [2]), part([[4], [5, 5]], [[6], [7, 0]], [3, 3])]
    pick = RowPick(parts=(2, 2), rows=((2, 0), (1, 2)))
    got = pick.apply(round0 + round1)
    assert len(pick) == 4 and len(got) == 4
    want = [(RolloutBatch.cat(round0), 2), (RolloutBatch.cat(round0), 0), (RolloutBatch.cat(round1), 1),
            (RolloutBatch.cat(round1), 2)]
    for row, (batch, i) in enumerate(want):
        for name in ("prompt_ids", "response_ids", "gen_logprobs"):
            mask = batch.prompt_mask if name == "prompt_ids" else batch.response_mask
            got_mask = got.prompt_mask if name == "prompt_ids" else got.response_mask
            assert getattr(got, name)[row][got_mask[row]].tolist() == getattr(batch, name)[i][mask[i]].tolist()
    assert got.groups.tolist() == [1, 0, 3, 3] and got.responses == ["[8, 8, 8, 0]", "[4, 0]", "[6]", "[7, 0]"]
    assert gather(round0) is not None and len(gather(round0)) == 3 and len(gather(round0 + round1, pick)) == 4
    with pytest.raises(ValueError, match=r"RowPick over 4 parts \(\[2, 2\] per round\) got 3"):
        pick.apply(round0 + round1[:1])
    with pytest.raises(ValueError, match="each round needs parts and rows"):
        RowPick(parts=(2, 2), rows=((0,), ()))
