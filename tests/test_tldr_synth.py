"""The bundled synthetic TL;DR task: determinism, format, variety, the gold judge, lengths."""

from __future__ import annotations

import collections
import itertools

import pytest

from ppo_ray.tasks import tldr_synth as T
from ppo_ray.data import TLDR_PROMPT, read_rows
from ppo_ray.tasks.tldr_synth import (MAX_WORDS, SPLITS, generate_task, gold_compare, gold_details, gold_score, win_rate,
                                write_task)

# Token budgets with the tiny model's tokenizer (the module docstring's claims).
MAX_PROMPT_TOKENS = 120
MAX_SUMMARY_TOKENS = 20  # reference summaries, before EOS
MAX_CHOSEN_TOKENS = 26  # chosen may add "What now?" or "So"


@pytest.fixture(scope="module")
def task() -> dict[str, list[dict]]:
    return generate_task(seed=0)


def _all(task):
    return [ex for split in SPLITS for ex in task[split]]


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_task_other_seed_differs(task):
    assert generate_task(seed=0) == task
    other = generate_task(seed=1)
    assert other != task
    assert len({ex["post"] for ex in other["test"]} & {ex["post"] for ex in task["test"]}) < 20


def test_eval_splits_do_not_depend_on_n_train(task):
    small = generate_task(seed=0, n_train=10)
    assert small["test"] == task["test"] and small["validation"] == task["validation"]
    assert len(small["train"]) == 10


def test_write_task_is_byte_identical_and_readable(tmp_path, task):
    paths_a = write_task(tmp_path / "a", seed=0)
    paths_b = write_task(tmp_path / "b", seed=0)
    names = {f"{kind}_{split}.jsonl" for kind in ("sft", "preferences", "prompts") for split in SPLITS}
    assert set(paths_a) == set(paths_b) == names
    for name in names:
        assert paths_a[name].read_bytes() == paths_b[name].read_bytes(), name

    sft = read_rows(paths_a["sft_train.jsonl"])
    assert len(sft) == 2000
    assert set(sft[0]) == {"id", "subreddit", "title", "post", "summary", "prompt"}
    assert [r["summary"] for r in sft] == [ex["summary"] for ex in task["train"]]
    prefs = read_rows(paths_a["preferences_validation.jsonl"])
    assert set(prefs[0]) == {"id", "prompt", "chosen", "rejected", "kind"}
    # the evaluation splits' files: every pair of every post (generate_task's "pairs")
    assert [(r["chosen"], r["rejected"], r["kind"]) for r in prefs] == [
        (p["chosen"], p["rejected"], p["kind"]) for ex in task["validation"] for p in ex["pairs"]]
    assert len({r["id"] for r in prefs}) == len(prefs)
    train_prefs = read_rows(paths_a["preferences_train.jsonl"])
    assert [r["kind"] for r in train_prefs] == [ex["kind"] for ex in task["train"]]
    prompts = read_rows(paths_a["prompts_test.jsonl"])
    assert set(prompts[0]) == {"id", "prompt", "facts", "summary"}
    # The judge works on a prompts row (it reads the post back from the prompt).
    for row, ex in zip(prompts, task["test"]):
        assert gold_details(row, ex["rejected"], True) == gold_details(ex, ex["rejected"], True)


# --------------------------------------------------------------------------- format


def test_format(task):
    assert [len(task[s]) for s in SPLITS] == [2000, 200, 200]
    ids = [ex["id"] for ex in _all(task)]
    assert len(set(ids)) == len(ids)
    for ex in _all(task):
        assert ex["prompt"] == TLDR_PROMPT.format(subreddit=ex["subreddit"], title=ex["title"], post=ex["post"])
        assert ex["prompt"] == f"SUBREDDIT: r/{ex['subreddit']}\n\nTITLE: {ex['title']}\n\nPOST: {ex['post']}\n\nTL;DR:"
        for key in ("summary", "chosen", "rejected"):
            text = ex[key]
            assert text.startswith(" ") and not text.startswith("  ") and text == text.rstrip(), (key, text)
            assert "<|" not in text and "\n" not in text  # no EOS or other special text
        assert len(ex["facts"]) == 3 and all(isinstance(f, str) and f for f in ex["facts"])
        assert len(ex["prompt"]) <= T.MAX_PROMPT_CHARS


def test_splits_are_disjoint(task):
    posts = {s: {ex["post"] for ex in task[s]} for s in SPLITS}
    facts = {s: {(ex["subreddit"], *ex["facts"]) for ex in task[s]} for s in SPLITS}
    for a, b in itertools.combinations(SPLITS, 2):
        assert not posts[a] & posts[b], (a, b)
        assert not facts[a] & facts[b], (a, b)


def test_splits_are_disjoint_on_the_combination(task):
    """Issue 30: no test or validation post shares (subreddit, person, event) with a train
    post, nor test with validation; the combinations come from combo_splits alone."""
    combos = {s: {(ex["subreddit"], ex["facts"][0], ex["facts"][1]) for ex in task[s]} for s in SPLITS}
    for a, b in itertools.combinations(SPLITS, 2):
        assert not combos[a] & combos[b], (a, b, sorted(combos[a] & combos[b])[:3])
    # each split's combinations are its share of combo_splits (pronoun-free event facts)
    table = T.combo_splits(0)
    for split in SPLITS:
        allowed = {(sub, p, T._event_fact(t, k, T._PRONOUNS[g][1])) for sub, cs in table[split].items()
                   for (p, g), (t, k) in cs}
        assert combos[split] <= allowed, split
    assert combos["train"] and len(combos["test"]) > 40 and len(combos["validation"]) > 40, {
        s: len(c) for s, c in combos.items()}


# --------------------------------------------------------------------------- variety


def test_variety(task):
    rows = _all(task)
    n = len(rows)
    assert len({ex["post"] for ex in rows}) == n
    assert len({(ex["subreddit"], *ex["facts"]) for ex in rows}) == n
    assert len({ex["title"] for ex in rows}) > 500
    assert len({ex["facts"][0] for ex in rows}) >= 25  # people
    assert len({ex["facts"][1] for ex in rows}) >= 50  # events
    assert len({ex["facts"][2] for ex in rows}) >= 40  # quantities
    by_sub = collections.Counter(ex["subreddit"] for ex in rows)
    assert len(by_sub) == 5 and min(by_sub.values()) > 0.12 * n
    n_sentences = collections.Counter(ex["post"].count(". ") + ex["post"].count("? ") + 1 for ex in rows)
    assert min(n_sentences) >= 2 and max(n_sentences) <= 5 and len(n_sentences) == 4, n_sentences
    # distractors: posts that name a second person or a second quantity
    n_two_people = sum(sum(k <= set(T._words(ex["post"])) for k in T._PERSON_KEYS) >= 2 for ex in rows)
    n_two_quantities = sum(len(T._quantities(T._words(ex["post"]))) >= 2 for ex in rows)
    assert n_two_people > 0.2 * n and n_two_quantities > 0.1 * n


def test_summaries_depend_on_the_post(task):
    rows = task["test"]
    scores_other = []
    for a, b in zip(rows, rows[1:] + rows[:1]):
        assert gold_score(a, a["summary"], True) == 1.0
        s = gold_score(b, a["summary"], True)
        assert s < 1.0, (a["summary"], b["post"])
        scores_other.append(s)
    assert sum(scores_other) / len(scores_other) < 0.15


# --------------------------------------------------------------------------- the gold judge

POST = ("My brother thinks I am overreacting. My sister lost her job 3 weeks ago. "
        "We have been close for 4 years. What should I do?")
EXAMPLE = {"post": POST, "facts": ["my sister", "lost her job", "3 weeks"]}
REF = " My sister lost her job 3 weeks ago."


@pytest.mark.parametrize("summary, expected", [
    (REF, 1.0),
    (" my SISTER lost HER job 3 weeks AGO", 1.0),  # case and punctuation do not matter
    (" Sister lost job, 3 weeks ago.", 1.0),
    (" My sister lost her job.", 2 / 3),  # quantity missing
    (" She lost her job 3 weeks ago.", 2 / 3),  # person missing
    (" My sister lost her job 5 weeks ago.", 2 / 3 - 0.5),  # wrong quantity
    (" My sister lost her job 3 months ago.", 2 / 3 - 0.5),  # wrong unit
    (" My mom lost her job 3 weeks ago.", 2 / 3 - 0.5),  # a person not in the post
    (" My sister quit her job 3 weeks ago.", 2 / 3 - 0.5),  # an event not in the post
    (" My brother lost his job 3 weeks ago.", 2 / 3 - 0.5),  # the distractor person: in the post, still wrong
    (" My sister lost her job 4 years ago.", 2 / 3 - 0.5),  # the distractor quantity
    (" My sister and my brother lost her job 3 weeks ago.", 2 / 3 - 0.5),  # hedging: the slot is not credited
    (" My sister lost her job 3 weeks or 4 years ago.", 2 / 3 - 0.5),
    (" My sister and my brother lost her job 3 weeks or 4 years ago.", 0.0),  # 1/3 - 2 * 0.5, clipped at 0
    (" My mom quit her job 5 weeks ago.", 0.0),  # clipped at 0
    (" My sister lost her job job job 3 weeks ago.", 1.0 - 2 * 0.1),  # repetition
    (REF + " I do not know what to do about it now.",  # 18 words, no other slot value
     1.0 - 0.05 * (18 - MAX_WORDS)),
    (REF + " My brother thinks I am overreacting. We have been close for 4 years.",  # the rest of the post
     0.0),
    (" My sister lost her job 3 weeks ago. What now?", 1.0),  # 10 words: within MAX_WORDS
    (" Help with my sister", 1 / 3),  # a title
    ("", 0.0),
])
def test_gold_known_values(summary, expected):
    assert gold_score(EXAMPLE, summary, True) == pytest.approx(expected)


def test_gold_no_eos_is_the_minimum():
    assert gold_score(EXAMPLE, REF, True) == 1.0
    assert gold_score(EXAMPLE, REF, False) == 0.0
    d = gold_details(EXAMPLE, REF, False)
    assert d.coverage == 1.0 and d.n_wrong == 0 and not d.ended_with_eos


def test_gold_money_and_counts():
    ex = {"post": "My dad borrowed $300 for rent. I make $500 a week. What are my options?",
          "facts": ["my dad", "borrowed a lot for rent", "$300"]}
    assert gold_score(ex, " My dad borrowed $300 for rent.", True) == 1.0
    assert gold_score(ex, " My dad borrowed $500 for rent.", True) == pytest.approx(2 / 3 - 0.5)  # in the post
    assert gold_score(ex, " My dad borrowed $700 for rent.", True) == pytest.approx(2 / 3 - 0.5)
    # two quantities: the key one is not credited, the other is wrong
    assert gold_score(ex, " My dad borrowed $300 for rent 4 times.", True) == pytest.approx(2 / 3 - 0.5)
    assert gold_score(ex, " My dad borrowed $300 or $500 for rent.", True) == pytest.approx(2 / 3 - 0.5)
    assert gold_details(ex, " My dad borrowed money.", True).coverage == pytest.approx(1 / 3)


def test_gold_compare_and_win_rate():
    assert gold_compare(EXAMPLE, REF, " My sister lost her job.") == 1
    assert gold_compare(EXAMPLE, " My sister lost her job.", REF) == -1
    assert gold_compare(EXAMPLE, REF, REF) == 0
    assert gold_compare(EXAMPLE, REF, " My sister lost her job.", eos_a=False) == -1
    exs = [EXAMPLE] * 4
    a = [REF, REF, " My sister lost her job.", REF]
    b = [" She lost her job.", REF, REF, REF]
    gold_a = [gold_score(ex, s, e) for ex, s, e in zip(exs, a, [True, True, True, False])]
    gold_b = [gold_score(ex, s, True) for ex, s in zip(exs, b)]
    # win, tie, loss, and a loss by cut-off: (1 + 0.5 + 0 + 0) / 4
    assert win_rate(gold_a, gold_b) == pytest.approx(1.5 / 4)
    assert win_rate(gold_b, gold_a) == pytest.approx(2.5 / 4)
    assert win_rate([0.3], [0.1 + 0.2]) == 0.5  # equal up to float rounding: a tie, as in gold_compare
    with pytest.raises(ValueError):
        win_rate(gold_a[:3], gold_b)


def test_gold_needs_a_tldr_prompt_when_no_post():
    row = {"prompt": TLDR_PROMPT.format(subreddit="relationships", title="t", post=POST), "facts": EXAMPLE["facts"]}
    assert gold_details(row, " My mom lost her job.", True) == gold_details(EXAMPLE, " My mom lost her job.", True)
    with pytest.raises(ValueError, match="TL;DR format"):
        gold_score({"prompt": "hello", "facts": []}, REF, True)


def test_slot_values_are_distinguishable():
    """No slot value's content words are all inside another value, so naming the other
    one never counts as this one; every value has content words."""
    phrases = [p for t in T._SUBREDDITS.values() for p, _ in t["people"]]
    phrases += [T._event_fact(e, k, "their") for t in T._SUBREDDITS.values() for e, k in t["events"]]
    for a, b in itertools.permutations(set(phrases), 2):
        ka = T._content(a)
        assert ka and not set(ka) & T.STOPWORDS, a
        assert ka == T._content(b) or not ka <= set(T._words(b)), (a, b)


def test_only_the_key_event_is_in_the_post(task):
    """Naming any other event is always a hallucination (it is never in the post)."""
    for ex in _all(task):
        post = set(T._words(ex["post"]))
        present = [k for k in T._EVENT_KEYS if k <= post]
        assert present == [T._content(ex["facts"][1])], (ex["post"], present)


# --------------------------------------------------------------------------- preference pairs


def test_chosen_beats_rejected_and_kinds_behave(task):
    kinds = collections.Counter()
    for ex in _all(task):
        c = gold_details(ex, ex["chosen"], True)
        r = gold_details(ex, ex["rejected"], True)
        assert c.score > r.score, ex
        assert gold_score(ex, ex["summary"], True) == 1.0
        kinds[ex["kind"]] += 1
        k = ex["kind"]
        if k in ("omit", "wrong", "distractor", "ramble", "title"):
            assert c.score == 1.0
        if k == "omit":
            assert r.coverage == pytest.approx(2 / 3) and r.n_wrong == 0
        elif k == "wrong":
            assert r.n_wrong >= 1
        elif k == "distractor":  # a value of the post that is not the key fact: wrong (one value per slot)
            assert r.coverage == pytest.approx(2 / 3) and r.n_wrong == 1
        elif k == "ramble":  # the rest of the post: too long, and its distractor values are wrong
            assert r.n_extra_words > 0 or r.n_repeats > 0 or r.n_wrong > 0
        elif k == "title":
            assert ex["rejected"] == " " + ex["title"] and r.coverage < 1.0
        elif k == "close":
            assert c.coverage == pytest.approx(2 / 3) and r.coverage == pytest.approx(1 / 3)
    n = sum(kinds.values())
    assert set(kinds) == set(T._PAIR_KINDS)
    assert min(kinds.values()) > 0.03 * n, kinds


def test_evaluation_pairs_cover_every_kind(task):
    """The evaluation splits carry pairs of every kind the post can give (>= 100 of each kind
    on 200 posts, so the reward model's accuracy by kind is measured on enough pairs), each
    ordered by the judge; training keeps one pair per post, with enough distractor pairs."""
    for split in ("validation", "test"):
        kinds = collections.Counter()
        for ex in task[split]:
            for p in ex["pairs"]:
                assert gold_score(ex, p["chosen"], True) > gold_score(ex, p["rejected"], True), p
                kinds[p["kind"]] += 1
        assert set(kinds) == set(T._PAIR_KINDS) and min(kinds.values()) >= 100, (split, kinds)
    assert all("pairs" not in ex for ex in task["train"])
    train_kinds = collections.Counter(ex["kind"] for ex in task["train"])
    assert train_kinds["distractor"] > 0.1 * len(task["train"]), train_kinds


def _hedge(ex: dict, ideal: str) -> tuple[str, int]:
    """Every person and every quantity of the post in one summary, the key event with the
    key quantity kept: " My sister and my brother lost her job 3 weeks ago or 4 years."
    Returns it and the number of candidates (people + quantities of the post)."""
    post_ws = T._words(ex["post"])
    people = [p for p in dict.fromkeys(p for t in T._SUBREDDITS.values() for p, _ in t["people"])
              if T._has_phrase(post_ws, T._words(p))]
    person, _, quantity = ex["facts"]
    others_q = sorted(T._quantities(post_ws) - {quantity})
    event = ideal.strip().rstrip(".")[len(person):].strip()  # "lost her job 3 weeks ago"
    text = " " + " and ".join([person] + [p for p in people if p != person]) + " " + event
    return text + "".join(" or " + q for q in others_q) + ".", len(people) + len(T._quantities(post_ws))


def test_hedging_is_not_rewarded(task):
    """Issue 30: a summary listing every candidate scores below the correct one and no
    higher than the summary that names one wrong candidate instead of the key one; on no
    test post with more than one candidate does it score 1.0 (the old judge: 112 of 123)."""
    ex = EXAMPLE
    hedge = " My sister and my brother lost her job 3 weeks ago or 4 years."
    wrong = " My brother lost his job 3 weeks ago."
    assert gold_score(ex, hedge, True) < gold_score(ex, REF, True)
    assert gold_score(ex, hedge, True) <= gold_score(ex, wrong, True)
    out = T.fact_outcomes(ex, hedge)
    assert out == {"person": "wrong", "event": "right", "quantity": "wrong"}, out
    assert T.fact_outcomes(ex, wrong)["person"] == "wrong" and T.fact_outcomes(ex, REF)["person"] == "right"
    assert T.copy_accuracy([ex], [hedge])["all_right"] == 0.0
    n_multi = 0
    for ex in task["test"]:  # task: ideal references
        text, n = _hedge(ex, ex["summary"])
        if n > 2:
            n_multi += 1
            assert gold_score(ex, text, True) < 1.0, (ex["post"], text)
            assert T.fact_outcomes(ex, text) != {"person": "right", "event": "right", "quantity": "right"}
    assert n_multi > 50, n_multi


def test_length_is_a_weak_cue(task):
    rows = task["train"]
    longer = sum(len(ex["chosen"]) > len(ex["rejected"]) for ex in rows) / len(rows)
    assert 0.4 < longer < 0.7, longer
    hard = [ex for ex in rows if ex["kind"] in ("wrong", "distractor")]
    assert len(hard) > 0.25 * len(rows)
    balanced = sum(len(ex["chosen"]) > len(ex["rejected"]) for ex in hard) / len(hard)
    assert 0.35 < balanced < 0.65, balanced


def test_mixed_quality_references(task):
    """bundled_ideal_fraction: the posters' TL;DRs leave a fact out with probability 1 - f;
    everything else (posts, facts, pairs) is the ideal task's, and f=1 is that task."""
    mixed = generate_task(seed=0, ideal_fraction=0.3)
    assert generate_task(seed=0, ideal_fraction=0.3) == mixed  # deterministic
    assert generate_task(seed=0, ideal_fraction=1.0) == task
    n_ideal = 0
    for a, b in zip(_all(task), _all(mixed)):
        assert {k: v for k, v in a.items() if k != "summary"} == {k: v for k, v in b.items() if k != "summary"}
        d = gold_details(b, b["summary"], True)
        if b["summary"] == a["summary"]:
            n_ideal += 1
        else:  # a fact left out, nothing made up
            assert d.coverage < 1.0 and d.n_wrong == 0, b["summary"]
    assert 0.25 < n_ideal / len(_all(mixed)) < 0.35
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="ideal_fraction"):
            generate_task(seed=0, n_train=10, ideal_fraction=bad)


# --------------------------------------------------------------------------- token lengths


def test_token_lengths(task, tiny_model_dir):
    # The tiny model's tokenizer.json through `tokenizers` directly: it is the pipeline that
    # ppo_ray.modeling.load_tokenizer wraps verbatim (same ids; tiny_model docstring), and
    # it skips importing torch/transformers (~4 s of this file's < 5 s budget).
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    rows = _all(task)

    def n_tokens(key):
        return [len(e.ids) for e in tok.encode_batch([ex[key] for ex in rows], add_special_tokens=False)]

    assert max(n_tokens("prompt")) <= MAX_PROMPT_TOKENS
    assert max(n_tokens("summary")) <= MAX_SUMMARY_TOKENS
    assert max(n_tokens("chosen")) <= MAX_CHOSEN_TOKENS
