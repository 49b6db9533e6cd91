"""ppo_ray.tasks.tldr: the real TL;DR data path, on small local files in the hub schemas (no network)."""

from __future__ import annotations

import copy
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppo_ray.tasks import tldr
from ppo_ray.data import encode_prompts
from ppo_ray.tasks.tldr import (PreferenceExample, ResponseTooLongError, SFTExample, TLDRDataError, format_query,
                          format_response, load_preferences, load_prompts, load_queries, load_sft)


@pytest.fixture(scope="module")
def tok():
    from ppo_ray.modeling import load_tokenizer
    from ppo_ray.tiny_model import build_tiny_model

    return load_tokenizer(str(build_tiny_model()))


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


P1 = "I have been with my partner for two years and we live together in a small flat."
P2 = ("Lately she has been working late every night and we barely talk. When I bring it up she says "
      "she is tired and that I am overreacting, and then we go to bed without talking at all.")
P3 = "Should I push for a real conversation this weekend or give her some space until things calm down?"
LONG_POST = f"{P1}\n\n{P2}\n\n{P3}"


def sft_rows():
    return [
        {"id": "t3_a", "subreddit": "relationships", "title": "My partner and I barely talk",
         "post": LONG_POST, "summary": "partner works late, we barely talk, push or wait?"},
        {"id": "t3_b", "subreddit": "AskReddit", "title": "What is a small thing that made your day?",
         "post": "A stranger paid for my coffee this morning.", "summary": "a stranger paid for my coffee"},
        {"id": "t3_c", "subreddit": "personalfinance", "title": "Should I pay off my car early?",
         "post": "I have a car loan at 4 percent and some savings.\nI also have no other debt.",
         "summary": "  pay off a 4% car loan early or keep savings?\n"},
    ]


def comparison_rows():
    """The openai/summarize_from_feedback "comparisons" schema, nested, including a CNN/DM row."""
    def row(i, post, texts, choice, batch="batch3"):
        return {
            "info": {"id": f"t3_{i}", "post": post, "title": f"Title {i}", "subreddit": "relationships",
                     "site": None, "article": None},
            "summaries": [{"text": texts[0], "policy": "sup2", "note": None},
                          {"text": texts[1], "policy": "ref", "note": "ok"}],
            "choice": choice, "worker": "w1", "batch": batch, "split": "train", "extra": {"confidence": 7},
        }

    cnndm = row(9, None, [" a news summary", " another one"], 0, batch="cnndm0")
    cnndm["info"].update(article="The article text.", subreddit=None, site="cnn")
    return [
        row(0, LONG_POST, [" partner works late, we barely talk", " we don't talk anymore"], 1),
        row(1, "A stranger paid for my coffee this morning.", [" coffee paid by stranger", " nice day"], 0),
        cnndm,
        row(3, "My cat knocks everything off the table at night.", [" cat knocks things over", " cat"], 1),
    ]


def write(path, rows):
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- formatting


def test_prompt_format_exact(tok):
    q = format_query(tok, "AskReddit", "A title", "Line one.\nLine two.")
    assert q.text == "SUBREDDIT: r/AskReddit\n\nTITLE: A title\n\nPOST: Line one.\nLine two.\n\nTL;DR:"
    assert q.ids == enc(tok, q.text)
    assert q.cut == "none" and q.post == "Line one.\nLine two."


def test_truncation_cuts_post_at_last_newline(tok):
    full = format_query(tok, "relationships", "T", LONG_POST)
    two = enc(tok, tldr.TLDR_PROMPT.format(subreddit="relationships", title="T", post=f"{P1}\n\n{P2}"))
    one = enc(tok, tldr.TLDR_PROMPT.format(subreddit="relationships", title="T", post=P1))
    assert len(one) < len(two) < len(full.ids)

    q = format_query(tok, "relationships", "T", LONG_POST, max_query_length=len(two))
    assert q.cut == "newline"
    assert q.post == f"{P1}\n\n{P2}"  # whole paragraphs, never mid-paragraph
    assert LONG_POST[len(q.post)] == "\n"
    assert q.text.endswith(f"{P2}\n\nTL;DR:") and q.ids == two and len(q.ids) <= len(two)

    # The recipe removes one "\n" per step (post[:post.rindex("\n")]): between paragraphs
    # separated by "\n\n" the first cut leaves one trailing newline, exactly as it does.
    q = format_query(tok, "relationships", "T", LONG_POST, max_query_length=len(two) - 1)
    assert q.post == P1 + "\n" and q.text.endswith(f"{P1}\n\n\nTL;DR:") and len(q.ids) < len(two)
    q = format_query(tok, "relationships", "T", LONG_POST, max_query_length=len(one))
    assert q.post == P1 and q.ids == one and q.text.endswith(f"{P1}\n\nTL;DR:")
    assert q.text.startswith("SUBREDDIT: r/relationships\n\nTITLE: T\n\nPOST: ")


def test_no_newline_fallback_cuts_at_a_word(tok):
    post = P2 + " " + P3  # one paragraph, no newline
    limit = len(enc(tok, tldr.TLDR_PROMPT.format(subreddit="s", title="t", post=P2))) - 3
    q = format_query(tok, "s", "t", post, max_query_length=limit)
    assert q.cut == "fallback" and len(q.ids) <= limit and q.ids == enc(tok, q.text)
    assert q.text == f"SUBREDDIT: r/s\n\nTITLE: t\n\nPOST: {q.post}\n\nTL;DR:"
    assert post.startswith(q.post) and post[len(q.post)] == " "  # cut at a word boundary
    next_word = post[len(q.post):].split()[0]
    longer = enc(tok, tldr.TLDR_PROMPT.format(subreddit="s", title="t", post=q.post + " " + next_word))
    assert len(longer) > limit  # the longest word prefix that fits

    word = "x" * 400  # no whitespace either: character cut
    q = format_query(tok, "s", "t", word, max_query_length=40)
    assert q.cut == "fallback" and len(q.ids) <= 40 and word.startswith(q.post) and q.text.endswith("\n\nTL;DR:")

    with pytest.raises(ValueError, match="subreddit and title alone do not fit"):
        format_query(tok, "s", "a very long title " * 20, "post", max_query_length=20)


def test_response_leading_space_eos_and_length_rule(tok):
    ids = format_response(tok, "  she works late, we barely talk \n")
    assert ids == enc(tok, " she works late, we barely talk") + [tok.eos_token_id]
    assert tok.decode(ids[:-1]) == " she works late, we barely talk"
    assert format_response(tok, " already spaced") == enc(tok, " already spaced") + [tok.eos_token_id]
    n = len(ids)
    assert format_response(tok, "she works late, we barely talk", max_response_length=n) == ids
    with pytest.raises(ResponseTooLongError) as e:
        format_response(tok, "she works late, we barely talk", max_response_length=n - 1)
    assert e.value.length == n and f"{n} tokens" in str(e.value)
    with pytest.raises(ValueError, match="empty"):
        format_response(tok, "  \n")


def test_eos_distinct_from_pad_and_pad_never_appears(tok, tmp_path):
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    data = load_sft(write(tmp_path / "sft.jsonl", sft_rows()), "train", tok)
    for ex in data:
        assert tok.pad_token_id not in ex.input_ids
        assert tok.eos_token_id not in ex.query_ids
        assert ex.response_ids[-1] == tok.eos_token_id and tok.eos_token_id not in ex.response_ids[:-1]
    prefs = load_preferences(write(tmp_path / "cmp.jsonl", comparison_rows()), "train", tok)
    for ex in prefs:
        for ids in (ex.chosen_input_ids, ex.rejected_input_ids):
            assert tok.pad_token_id not in ids and ids.count(tok.eos_token_id) == 1 and ids[-1] == tok.eos_token_id
    rows = sft_rows()
    rows[1]["post"] = "text with a literal <|pad|> in it"
    with pytest.raises(TLDRDataError, match=r"sft2\.jsonl: row 1 column 'post': .*pad token"):
        load_sft(write(tmp_path / "sft2.jsonl", rows), "train", tok)
    rows = sft_rows()
    rows[2]["summary"] = "ends early <|endoftext|>"
    with pytest.raises(TLDRDataError, match=r"sft3\.jsonl: row 2 column 'summary': .*EOS token"):
        load_sft(write(tmp_path / "sft3.jsonl", rows), "train", tok)


# --------------------------------------------------------------------------- loaders


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_load_sft(tok, tmp_path, suffix):
    path = write(tmp_path / f"sft{suffix}", sft_rows())
    data = load_sft(path, "train", tok, max_query_length=120)
    assert data.source == str(path) and data.rows == 3 and len(data) == 3 and not data.dropped
    for ex, row in zip(data, sft_rows()):
        assert isinstance(ex, SFTExample) and ex.id == row["id"]
        q = format_query(tok, row["subreddit"], row["title"], row["post"], max_query_length=120)
        assert (ex.query_ids, ex.query_text, ex.query_cut) == (q.ids, q.text, q.cut)
        assert ex.response_ids == format_response(tok, row["summary"])
        assert ex.response_text == " " + row["summary"].strip()
        assert ex.input_ids == ex.query_ids + ex.response_ids
        assert ex.labels == [-100] * len(ex.query_ids) + ex.response_ids
    assert data[0].query_cut == "newline" and data.query_cuts == {"newline": 1}


def test_load_sft_same_from_jsonl_parquet_and_split_directory(tok, tmp_path):
    a = load_sft(write(tmp_path / "a.jsonl", sft_rows()), "train", tok)
    b = load_sft(write(tmp_path / "b.parquet", sft_rows()), "train", tok)
    (tmp_path / "d").mkdir()
    write(tmp_path / "d" / "validation.parquet", sft_rows()[:2])
    c = load_sft(tmp_path / "d", "validation", tok)
    assert a.examples == b.examples and c.examples == a.examples[:2]
    assert c.source.endswith("validation.parquet")
    with pytest.raises(FileNotFoundError, match="test"):
        load_sft(tmp_path / "d", "test", tok)


def test_long_response_dropped_and_counted_or_error(tok, tmp_path):
    rows = sft_rows()
    rows[1]["summary"] = "word " * 80
    path = write(tmp_path / "sft.jsonl", rows)
    data = load_sft(path, "train", tok)
    assert [ex.id for ex in data] == ["t3_a", "t3_c"] and data.dropped == {"response_too_long": 1}
    assert data.rows == 3
    with pytest.raises(TLDRDataError, match=rf"{path}: row 1 column 'summary': response is \d+ tokens"):
        load_sft(path, "train", tok, long_responses="error")
    with pytest.raises(ValueError, match="long_responses"):
        load_sft(path, "train", tok, long_responses="truncate")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_load_preferences(tok, tmp_path, suffix):
    path = write(tmp_path / f"cmp{suffix}", comparison_rows())
    data = load_preferences(path, "validation", tok)
    assert data.rows == 4 and len(data) == 3 and data.dropped == {"cnndm": 1}
    kept = [r for r in comparison_rows() if r["batch"] != "cnndm0"]
    for ex, row in zip(data, kept):
        assert isinstance(ex, PreferenceExample) and ex.id == row["info"]["id"]
        c = row["choice"]
        chosen, rejected = row["summaries"][c], row["summaries"][1 - c]
        q = format_query(tok, row["info"]["subreddit"], row["info"]["title"], row["info"]["post"])
        assert ex.query_ids == q.ids and ex.query_text == q.text
        assert ex.chosen_ids == format_response(tok, chosen["text"], 169)
        assert ex.rejected_ids == format_response(tok, rejected["text"], 169)
        assert ex.chosen_text == " " + chosen["text"].strip()
        assert (ex.chosen_policy, ex.rejected_policy) == (chosen["policy"], rejected["policy"])
    with pytest.raises(TLDRDataError, match=rf"{path}: row 2 column 'info.post': is a CNN/DM row"):
        load_preferences(path, "validation", tok, cnndm="error")


def test_load_prompts_reencode_to_the_same_ids(tok, tmp_path):
    rows = [{k: v for k, v in r.items() if k != "summary"} for r in sft_rows()]  # summary not needed
    path = write(tmp_path / "prompts.parquet", rows)
    texts = load_prompts(path, "train", tok, max_query_length=120)
    queries = load_queries(path, "train", tok, max_query_length=120)
    assert texts == [q.text for q in queries] and queries.query_cuts == {"newline": 1}
    assert encode_prompts(tok, texts, 120) == [q.ids for q in queries]
    assert all(t.endswith("\n\nTL;DR:") for t in texts)
    assert load_prompts(path, "train", tok, max_rows=2) == [q.text for q in load_queries(path, "train", tok)][:2]


def test_hub_path_passes_id_config_and_split(tok, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        rows = comparison_rows() if len(args) > 1 else sft_rows()
        return datasets.Dataset.from_list(copy.deepcopy(rows))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    prefs = load_preferences(tldr.PREFERENCE_DATASET, "validation", tok)
    sft = load_sft(tldr.SFT_DATASET, "train", tok)
    assert calls == [(("openai/summarize_from_feedback", "comparisons"), {"split": "validation"}),
                     (("vwxyzjn/summarize_from_feedback_tldr_3_filtered",), {"split": "train"})]
    local = load_preferences(write(tmp_path / "c.jsonl", comparison_rows()), "validation", tok)
    assert prefs.examples == local.examples and prefs.dropped == {"cnndm": 1}
    assert sft.examples == load_sft(write(tmp_path / "s.jsonl", sft_rows()), "train", tok).examples
    assert prefs.source == "dataset 'openai/summarize_from_feedback' config 'comparisons' split 'validation'"

    bad = comparison_rows()
    bad[1]["choice"] = 2
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list(bad))
    with pytest.raises(TLDRDataError, match=r"dataset 'openai/summarize_from_feedback' config 'comparisons' "
                                            r"split 'train': row 1 column 'choice': is 2, not 0 or 1"):
        load_preferences(tldr.PREFERENCE_DATASET, "train", tok)


# --------------------------------------------------------------------------- bad rows

def _del(key):
    return lambda r: r.pop(key)


def _set(key, value):
    return lambda r: r.__setitem__(key, value)


SFT_BAD = [  # (mutation of row 2, column, message, parquet-representable)
    ("missing id", _del("id"), "id", "missing", False),
    ("missing post", _del("post"), "post", "missing", False),
    ("null post", _set("post", None), "post", "is a NoneType", True),
    ("int title", _set("title", 5), "title", "is a int", False),
    ("empty post", _set("post", "  \n "), "post", "empty or whitespace-only", True),
    ("empty summary", _set("summary", ""), "summary", "empty or whitespace-only", True),
    ("list subreddit", _set("subreddit", ["a"]), "subreddit", "is a list", False),
]


def _cases(table):
    """Every case as JSONL; those one parquet schema can hold (no mixed types) also as parquet."""
    return [pytest.param(suffix, c, id=f"{c[0]}-{suffix[1:]}")
            for suffix in (".jsonl", ".parquet") for c in table if suffix == ".jsonl" or c[4]]


@pytest.mark.parametrize("suffix,case", _cases(SFT_BAD))
def test_sft_bad_rows_name_file_row_column(tok, tmp_path, case, suffix):
    _, mutate, col, msg, _ = case
    rows = sft_rows()
    mutate(rows[2])
    path = write(tmp_path / f"bad{suffix}", rows)
    with pytest.raises(TLDRDataError) as e:
        load_sft(path, "train", tok)
    assert str(e.value).startswith(f"{path}: row 2 column '{col}': ") and msg in str(e.value), str(e.value)


def _info(key, value=None, delete=False):
    def f(r):
        if delete:
            r["info"].pop(key)
        else:
            r["info"][key] = value
    return f


def _summary(k, key, value=None, delete=False):
    def f(r):
        if delete:
            r["summaries"][k].pop(key)
        else:
            r["summaries"][k][key] = value
    return f


PREF_BAD = [
    ("missing info", _del("info"), "info", "missing", False),
    ("info not object", _set("info", "t3_x"), "info", "is a str", False),
    ("missing info.post", _info("post", delete=True), "info.post", "missing", False),
    ("null info.post", _info("post", None), "info.post", "is a NoneType", True),
    ("empty info.post", _info("post", " "), "info.post", "empty or whitespace-only", True),
    ("int info.id", _info("id", 3), "info.id", "is a int", False),
    ("missing summaries", _del("summaries"), "summaries", "missing", False),
    ("one summary", lambda r: r["summaries"].pop(), "summaries", "has 1 summaries, not 2", True),
    ("three summaries", lambda r: r["summaries"].append(dict(r["summaries"][0])), "summaries",
     "has 3 summaries, not 2", True),
    ("empty summary text", _summary(1, "text", ""), "summaries[1].text", "empty or whitespace-only", True),
    ("missing summary text", _summary(0, "text", delete=True), "summaries[0].text", "missing", False),
    ("missing policy", _summary(1, "policy", delete=True), "summaries[1].policy", "missing", False),
    ("int note", _summary(0, "note", 4), "summaries[0].note", "is a int", False),
    ("summary not object", lambda r: r["summaries"].__setitem__(0, "text"), "summaries[0]", "is a str", False),
    ("choice 2", _set("choice", 2), "choice", "is 2, not 0 or 1", True),
    ("choice -1", _set("choice", -1), "choice", "is -1, not 0 or 1", True),
    ("choice str", _set("choice", "1"), "choice", "is a str", False),
    ("choice bool", _set("choice", True), "choice", "is a bool", False),
    ("missing choice", _del("choice"), "choice", "missing", False),
]


@pytest.mark.parametrize("suffix,case", _cases(PREF_BAD))
def test_preference_bad_rows_name_file_row_column(tok, tmp_path, case, suffix):
    _, mutate, col, msg, _ = case
    rows = comparison_rows()
    rows[2] = copy.deepcopy(rows[1])  # row 2 a TL;DR row (not the CNN/DM one)
    mutate(rows[2])
    path = write(tmp_path / f"bad{suffix}", rows)
    with pytest.raises(TLDRDataError) as e:
        load_preferences(path, "train", tok)
    assert str(e.value).startswith(f"{path}: row 2 column '{col}': ") and msg in str(e.value), str(e.value)


def test_row_not_an_object_and_title_too_long(tok, tmp_path):
    rows = sft_rows()
    path = tmp_path / "x.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + "[1, 2]\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"x\.jsonl: line 3 is a list, not an object"):  # read_rows: 1-based line
        load_sft(path, "train", tok)
    rows[1]["title"] = "long title words " * 30
    path = write(tmp_path / "t.jsonl", rows)
    with pytest.raises(TLDRDataError, match=r"t\.jsonl: row 1 column 'title': .*alone do not fit"):
        load_sft(path, "train", tok, max_query_length=45)
