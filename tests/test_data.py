"""ppo_ray/data.py: where prompts come from (read_rows, column, load_prompts), their checks
(empty, over-long, no chat template) and their encoding (encode_prompts, fit_prompt,
chat_format). Errors name the file, the column and the row. Fast: no Ray, no actors;
launch.py runs in-process and stops before Ray starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import launch
from helpers import PROMPTS, TINY, launch_ppo, snapshot
from ppo_ray.config import PPOConfig
from ppo_ray.data import encode_prompts
from ppo_ray.paths import resolve_model_path

CHAT = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
GOOD_PROMPT = "SUBREDDIT: r/advice\n\nTITLE: help\n\nPOST: my bike broke\n\nTL;DR:"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from ppo_ray.modeling import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


# -------------------------------------------------- bad data (issue 5, items 1b, 4, 5, 6)
def test_bad_data_files(tmp_path, tok):
    from ppo_ray.data import DataError, load_prompts

    def load(dataset: str, **kw):
        return load_prompts(PPOConfig(dataset=dataset, **kw), tok)

    with pytest.raises(FileNotFoundError, match="data file '.*nope.jsonl' does not exist"):
        load(str(tmp_path / "nope.jsonl"))
    # a name only a local path looks like is not looked up on the hub
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load("./no_such_prompts")
    (tmp_path / "folder").mkdir()
    with pytest.raises(FileNotFoundError, match="is not a file"):
        load(str(tmp_path / "folder"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"prompt": GOOD_PROMPT}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"broken.jsonl: line 2 is not valid JSON"):
        load(str(broken))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl: cannot be read as UTF-8 JSONL"):
        load(str(tmp_path / "latin1.jsonl"))
    (tmp_path / "bad.parquet").write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match=r"bad.parquet: cannot be read as parquet"):
        load(str(tmp_path / "bad.parquet"))
    (tmp_path / "p.csv").write_text("prompt\nhello\n")
    with pytest.raises(DataError, match=r"unsupported format '.csv'"):
        load(str(tmp_path / "p.csv"))


def test_missing_prompt_column(tmp_path):
    from ppo_ray.data import DataError, load_prompts

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": GOOD_PROMPT}, {"text": GOOD_PROMPT, "id": 1}])
    with pytest.raises(DataError, match=r"p.jsonl: row 1 has no column 'prompt' \(columns: \['id', 'text'\]\)"):
        load_prompts(PPOConfig(dataset=str(path)))
    with pytest.raises(DataError, match=r"row 0 has no column 'query'"):
        load_prompts(PPOConfig(dataset=str(path), prompt_column="query"))
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": GOOD_PROMPT}, {"prompt": 7}])
    with pytest.raises(DataError, match=r"row 1 column 'prompt' is a int, not a str"):
        load_prompts(PPOConfig(dataset=str(path)))


def test_empty_and_overlong_prompts_found_at_load(tmp_path, tok, monkeypatch):
    """Found when the dataset is loaded (every row, not only the first batch's), with the row index."""
    from ppo_ray import data
    from ppo_ray.data import DataError, load_prompts

    monkeypatch.setattr(data, "CHECK_CHUNK", 2)  # row indices stay global across chunks
    long_prompt = GOOD_PROMPT.replace("my bike broke", "my bike broke again " * 60)
    n_long = len(tok(long_prompt, add_special_tokens=False)["input_ids"])
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"prompt": GOOD_PROMPT}] * 4 + [{"prompt": "  \n"}])
    with pytest.raises(DataError, match=r"empty.jsonl' column 'prompt': prompt 4 is empty or whitespace only"):
        load_prompts(PPOConfig(dataset=str(empty)), tok)
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": GOOD_PROMPT}] * 3 + [{"prompt": long_prompt}])
    cfg = PPOConfig(dataset=str(long), max_prompt_length=64, prompt_truncation="error")
    with pytest.raises(DataError, match=rf"prompt 3 is {n_long} tokens long, over max_prompt_length=64"):
        load_prompts(cfg, tok)
    assert len(load_prompts(cfg.replace(prompt_truncation="left"), tok)) == 4  # truncation: fine
    assert len(load_prompts(cfg.replace(max_prompt_length=n_long), tok)) == 4  # at the limit: fine
    write_jsonl(tmp_path / "none.jsonl", [])
    with pytest.raises(DataError, match="has no rows"):
        load_prompts(PPOConfig(dataset=str(tmp_path / "none.jsonl")), tok)


@pytest.mark.parametrize("case,message", [
    ("missing", "data file '{path}' does not exist"),
    ("broken", "{path}: line 2 is not valid JSON"),
    ("no_column", "{path}: row 0 has no column 'prompt'"),
    ("empty", "prompt 1 is empty or whitespace only"),
    ("long", "prompt 0 is "),
])
def test_launch_rejects_bad_data_before_writing(tmp_path, old_run, capsys, no_ray_address, case, message):
    path = tmp_path / f"{case}.jsonl"
    if case == "broken":
        path.write_text(json.dumps({"prompt": GOOD_PROMPT}) + "\n{\n")
    elif case == "no_column":
        write_jsonl(path, [{"text": GOOD_PROMPT}])
    elif case == "empty":
        write_jsonl(path, [{"prompt": GOOD_PROMPT}, {"prompt": ""}])
    elif case == "long":
        write_jsonl(path, [{"prompt": "word " * 400}])
    before = snapshot(old_run)
    code = launch_ppo(old_run, "--dataset", str(path), "--prompt_truncation", "error", "--max_prompt_length", "64")
    err = capsys.readouterr().err
    assert code == 2, err
    assert message.format(path=path) in err and "Traceback" not in err
    assert snapshot(old_run) == before


# -------------------------------------------------- encoding (encode_prompts, fit_prompt)
def test_encode_prompts_errors(tok):
    with pytest.raises(ValueError, match="no prompts"):
        encode_prompts(tok, [], 8)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        encode_prompts(tok, ["ok", "  \n"], 8)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        encode_prompts(tok, [""], 8)
    with pytest.raises(ValueError, match="prompt 1 is a int"):
        encode_prompts(tok, ["ok", 3], 8)
    text = PROMPTS[2]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n = len(ids)
    with pytest.raises(ValueError, match=f"prompt 1 is {n} tokens long, over max_prompt_length=5.*prompt_truncation: left"):
        encode_prompts(tok, ["Hi", text], 5)
    assert encode_prompts(tok, ["Hi", text], 5, truncation="left")[1] == ids[-5:]
    assert encode_prompts(tok, [text], n) == [ids]  # exactly at the limit is fine
    with pytest.raises(ValueError, match="truncation"):
        encode_prompts(tok, [text], 5, truncation="right")


# -------------------------------------------------- chat template (issue 15)
def test_apply_chat_template_formats_each_prompt_as_a_user_turn():
    from ppo_ray.data import check_chat_template, encode_prompts
    from ppo_ray.modeling import load_tokenizer

    tok = load_tokenizer(resolve_model_path("embedded:tiny"))
    with pytest.raises(ValueError, match="has no chat template"):
        check_chat_template(tok, "embedded:tiny")
    tok.chat_template = CHAT
    check_chat_template(tok, "embedded:tiny")
    prompts = ["Summarise: the cat sat.", "TL;DR:"]
    plain = encode_prompts(tok, prompts, 256)
    chat = encode_prompts(tok, prompts, 256, chat_template=True)
    expected = [tok(f"<|user|>{p}\n<|assistant|>", add_special_tokens=False)["input_ids"] for p in prompts]
    assert chat == expected and chat != plain
    # max_prompt_length counts the template's tokens
    with pytest.raises(ValueError, match="prompt 0 is"):
        encode_prompts(tok, prompts, len(plain[0]), chat_template=True)


def test_apply_chat_template_is_checked_at_load_and_refused_for_the_pipeline(capsys, tmp_path):
    from ppo_ray.data import load_prompts
    from ppo_ray.modeling import load_tokenizer

    config = PPOConfig.from_yaml(TINY, apply_chat_template=True)
    tok = load_tokenizer(resolve_model_path("embedded:tiny"))
    with pytest.raises(ValueError, match="apply_chat_template is true but the tokenizer of 'embedded:tiny' has no"):
        load_prompts(config, tok)
    tok.chat_template = CHAT
    assert len(load_prompts(config, tok)) > 0
    code = launch.main(["sft", "--apply_chat_template", "true", "--run_dir", str(tmp_path / "r")])
    assert code == 2 and "apply_chat_template formats the PPO prompts" in capsys.readouterr().err


# -------------------------------------------------- the rules as pure functions
def test_fit_prompt_keeps_a_prompt_at_the_limit_cuts_left_or_names_the_prompt():
    from ppo_ray.data import fit_prompt

    ids = [11, 12, 13, 14, 15]
    assert fit_prompt(ids, 5, "error", 0) == ids
    assert fit_prompt(ids, 3, "left", 0) == [13, 14, 15]  # the end sits next to the response
    with pytest.raises(ValueError, match=r"^prompt 7 is 5 tokens long, over max_prompt_length=3;"):
        fit_prompt(ids, 3, "error", 7)


def test_encode_prompts_rejects_a_single_str_and_names_rows_with_the_offset(tok):
    with pytest.raises(ValueError, match="a single str"):
        encode_prompts(tok, GOOD_PROMPT, 64)
    with pytest.raises(ValueError, match="max_prompt_length must be >= 1, got 0"):
        encode_prompts(tok, [GOOD_PROMPT], 0)
    with pytest.raises(ValueError, match="prompt 41 is empty"):  # a chunk of a larger list
        encode_prompts(tok, [GOOD_PROMPT, " "], 64, index_offset=40)


def test_read_rows_skips_blank_lines_refuses_non_objects_and_reads_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ppo_ray.data import DataError, read_rows

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n   \n{"prompt": "b", "n": 2}\n')
    assert read_rows(path) == [{"prompt": "a"}, {"prompt": "b", "n": 2}]
    path.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"p.jsonl: line 2 is a list, not an object"):
        read_rows(path)
    pq.write_table(pa.table({"prompt": ["x", "y"], "n": [1, 2]}), tmp_path / "p.parquet")
    assert read_rows(tmp_path / "p.parquet") == [{"prompt": "x", "n": 1}, {"prompt": "y", "n": 2}]


@pytest.mark.parametrize("name,local", [
    ("org/name", False), ("name", False),  # hub ids
    ("a/b/c", True), ("./x", True), ("../x", True), ("~/x", True), ("/abs/x", True), ("x.jsonl", True),
    ("x.parquet", True),
])
def test_a_name_only_a_path_looks_like_is_not_looked_up_on_the_hub(name, local):
    from ppo_ray.data import _is_local_path

    assert _is_local_path(name) is local


# -------------------------------------------------- a dataset's other columns (issue 56, part 3)
def test_a_datasets_other_columns_are_kept_for_the_reward_functions(tmp_path, tok):
    """load_prompts keeps a file's rows: the prompt column the text, every other key a column
    (prompt_rows; a row lacking one gets None, as `datasets` reads it), in JSONL as in parquet
    and under another prompt_column; the bundled prompts stay strings. The list's fingerprint
    (what a checkpoint's cursor indexes) is its texts', with or without the columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ppo_ray.data import PromptRows, load_prompts, prompt_rows, prompts_fingerprint

    rows = [{"prompt": "1+2=", "answer": "3", "id": "a"}, {"prompt": "2+2=", "answer": "4"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    loaded = load_prompts(PPOConfig(dataset=str(path)), tok)
    assert loaded == rows
    assert prompt_rows(loaded) == PromptRows(["1+2=", "2+2="], {"answer": ["3", "4"], "id": ["a", None]})
    assert prompts_fingerprint(loaded) == prompts_fingerprint(["1+2=", "2+2="])
    pq.write_table(pa.table({"q": ["x", "y"], "n": [1, 2], "tags": [["a"], []]}), tmp_path / "p.parquet")
    loaded = load_prompts(PPOConfig(dataset=str(tmp_path / "p.parquet"), prompt_column="q"))
    assert prompt_rows(loaded, "q") == PromptRows(["x", "y"], {"n": [1, 2], "tags": [["a"], []]})
    assert prompt_rows(["a", "b"]) == PromptRows(["a", "b"], {})
    assert all(isinstance(p, str) for p in load_prompts(PPOConfig(dataset="bundled")))


@pytest.mark.parametrize("name", ["prompts", "completions", "finish_reasons"])
def test_a_column_named_like_a_reward_functions_argument_is_refused_naming_it_and_the_file(tmp_path, name):
    from ppo_ray.data import DataError, load_prompts

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+2=", name: "x"}])
    with pytest.raises(DataError, match=rf"p.jsonl: column '{name}' has the name of an argument every reward "
                                        r"function is given \(prompts, completions, finish_reasons\): rename"):
        load_prompts(PPOConfig(dataset=str(path)))


def test_columns_that_are_not_json_and_mixed_lists_are_refused_naming_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ppo_ray.data import DataError, load_prompts, prompt_rows

    pq.write_table(pa.table({"prompt": ["x", "y"], "blob": [None, b"\x00\x01"]}), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b.parquet: row 1 column 'blob': a bytes value, not JSON"):
        load_prompts(PPOConfig(dataset=str(tmp_path / "b.parquet")))
    with pytest.raises(DataError, match=r"prompts: prompt 1 is a str and prompt 0 a row \(dict\): give strings or "
                                        "rows, not both"):
        prompt_rows([{"prompt": "a"}, "b"])
    with pytest.raises(DataError, match=r"prompts: row 1 has no column 'prompt'"):
        prompt_rows([{"prompt": "a"}, {"text": "b"}])
    with pytest.raises(DataError, match="got a single dict"):
        prompt_rows({"prompt": "a"})
    with pytest.raises(DataError, match="prompts: column 3 is named by a int"):
        prompt_rows([{"prompt": "a", 3: "x"}])


def test_prompt_columns_reach_rows_by_group_id_not_row_order():
    """PromptColumns.rows: each row gets its prompt's values by its group id (first + position),
    whatever the rows' order; a group id without columns is an error naming it."""
    from ppo_ray.data import PromptColumns

    columns = PromptColumns({"answer": ["3", "4", "5"], "id": [7, 8, 9]}, first=4)
    assert columns.rows([6, 4, 4, 5]) == {"answer": ["5", "3", "3", "4"], "id": [9, 7, 7, 8]}
    assert columns.take([2, 0], first=10) == PromptColumns({"answer": ["5", "3"], "id": [9, 7]}, first=10)
    with pytest.raises(ValueError, match=r"group id 7 has no dataset columns \(they cover the prompts of group "
                                         r"ids 4..6\)"):
        columns.rows([4, 7])
    with pytest.raises(ValueError, match="different lengths"):
        PromptColumns({"a": [1], "b": [1, 2]})
