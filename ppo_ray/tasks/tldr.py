"""The real Reddit TL;DR data of the N+ recipe: loading, validation and formatting.

Imports only ppo_ray.data (``datasets`` lazily, for hub ids). No torch.

Sources
-------
Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO: a case study on TL;DR
summarization", and its code vwxyzjn/summarize_from_feedback_details
(``summarize_from_feedback_details/tldr_dataset.py``: ``TaskQueryHParams`` /
``process_query``), itself a port of openai/summarize-from-feedback ``tasks.py``.

Data (a hub id, or local files in the same schema, see ``load_sft``):

* SFT / PPO prompts: ``vwxyzjn/summarize_from_feedback_tldr_3_filtered``, columns
  ``id, subreddit, title, post, summary`` (all str; splits train / validation / test).
* Preferences: ``openai/summarize_from_feedback`` config ``"comparisons"``, columns
  ``info{id, post, title, subreddit, site, article}``, ``summaries[{text, policy, note}]``
  (two of them), ``choice`` (0/1, the index of the preferred summary), plus ``worker``,
  ``batch``, ``split``, ``extra`` (unused here). Its validation split also holds CNN/DM
  rows (``batch`` in ``CNNDM_BATCHES``; ``info.post`` is null and ``info.article`` holds
  the text). The recipe formats those with a different prompt; here they are skipped and
  counted (``cnndm="skip"``, the default) or are an error (``cnndm="error"``).

Rules implemented (recipe -> here)
----------------------------------
* Query text: ``SUBREDDIT: r/{subreddit}\\n\\nTITLE: {title}\\n\\nPOST: {post}\\n\\nTL;DR:``
  (``ppo_ray.data.TLDR_PROMPT``), tokenized without special tokens.
* Query length 512: while the tokenized prompt is longer than ``max_query_length``, the
  post is cut at its last ``"\\n"`` (the newline itself removed: ``post[:post.rindex("\\n")]``,
  exactly the recipe's loop, so a post cut between paragraphs may end in one ``"\\n"``).
  The subreddit, title and the ``\\n\\nTL;DR:`` tail are never cut.
* Differs: when no newline is left and the prompt is still too long, the recipe drops the
  post's last CHARACTER and re-tokenizes, repeatedly; here the post is cut at a word
  (whitespace) boundary instead -- the longest word prefix that fits, found by bisection --
  and, only if not even its first word fits, at a character boundary. ``Query.cut`` says
  which rule applied ("none" / "newline" / "fallback"); loaders count them. A prompt that
  does not fit even with an empty post is an error (the recipe raises too).
* Differs: the recipe left-pads every query to exactly 512 tokens with a new pad token;
  here queries are returned unpadded (``RolloutBatch`` left-pads per batch, to the longest
  prompt of the batch; positions count real tokens only, so the model sees the same thing).
* Response: ``" " + summary.strip()`` tokenized, then the EOS id appended (the recipe
  appends the ``<|endoftext|>`` string; the SFT summaries have no leading space, the
  comparison texts have one: both end up with exactly one; ``strip`` also removes trailing
  whitespace, which the recipe keeps). Lengths count the EOS.
* SFT responses <= 53 tokens (the recipe's ``max_sft_response_length``); preference responses
  <= 169 (``max_rm_response_length``). The recipe computed those as the dataset maxima for
  Pythia's tokenizer; with another tokenizer a few may be longer: ``long_responses="drop"``
  (default, counted in ``TLDRData.dropped``) or ``"error"``.
* Preferences: chosen = ``summaries[choice]``, rejected = ``summaries[1 - choice]``, both
  with the same query (the recipe's ``process_response_data``).
* PPO prompts are the SFT dataset's queries (the recipe's PPO reads the SFT dataset's
  ``query_token``); ``load_prompts`` returns their texts, which ``ppo_ray.data.encode_prompts``
  re-encodes to exactly the same ids.
* Differs: token ids are kept separate (query / response) rather than re-tokenizing the
  concatenated string as the recipe's SFT/RM columns do; ``input_ids`` is their
  concatenation, the sequence PPO rollouts also produce.
* Pad never appears in any returned ids, and EOS only as the last response token; text
  that tokenizes to the pad or EOS token (a literal ``<|endoftext|>`` in a post) is an error.

Errors
------
Every bad row is a ``TLDRDataError`` (a ValueError) naming the file (or dataset id, config
and split), the 0-based row index and the column, e.g.
``data/train.jsonl: row 3 column 'info.post': is an empty or whitespace-only str``.
Bad rows: a row that is not an object, a missing column, a wrong type (``id``, ``subreddit``,
``title``, ``post``, ``summary``, ``info.*``, ``summaries[k].text``/``.policy`` must be str,
``summaries[k].note`` str or null, ``choice`` an int), an empty post / summary / summary
text, a ``choice`` outside {0, 1}, a ``summaries`` that is not a list of length 2.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Iterable, Iterator, NamedTuple, Optional, Sequence, TypeVar

from ppo_ray.config import DATA_FILE_SUFFIXES
from ppo_ray.data import TLDR_PROMPT, read_rows

log = logging.getLogger(__name__)

SFT_DATASET = "vwxyzjn/summarize_from_feedback_tldr_3_filtered"
PREFERENCE_DATASET = "openai/summarize_from_feedback"
PREFERENCE_CONFIG = "comparisons"
CNNDM_BATCHES = ("batch0_cnndm", "cnndm0", "cnndm2")  # the recipe's list

MAX_QUERY_LENGTH = 512
MAX_SFT_RESPONSE_LENGTH = 53
MAX_RM_RESPONSE_LENGTH = 169

LONG_RESPONSE_MODES = ("drop", "error")
CNNDM_MODES = ("skip", "error")
_CHUNK = 1024  # rows tokenized per batched tokenizer call


class TLDRDataError(ValueError):
    """A bad row or value; the message names the source, row and column."""


class ResponseTooLongError(ValueError):
    """A formatted response (with EOS) longer than max_response_length tokens."""

    def __init__(self, length: int, max_response_length: int):
        self.length = length
        self.max_response_length = max_response_length
        super().__init__(f"response is {length} tokens (with EOS), over max_response_length={max_response_length}")


class Query(NamedTuple):
    """A formatted query: unpadded ids, the exact text they encode, and how the post was cut."""

    ids: list[int]
    text: str
    cut: str  # "none" | "newline" | "fallback"
    post: str  # the (possibly cut) post inside `text`


@dataclass(frozen=True)
class SFTExample:
    id: str
    query_ids: list[int]
    response_ids: list[int]  # " " + summary.strip(), then EOS
    query_text: str
    response_text: str  # " " + summary.strip() (no EOS)
    query_cut: str
    row: int  # 0-based row index in the source

    @property
    def input_ids(self) -> list[int]:
        return self.query_ids + self.response_ids

    @property
    def labels(self) -> list[int]:
        """-100 on the query, the response ids (EOS included) on the response."""
        return [-100] * len(self.query_ids) + self.response_ids


@dataclass(frozen=True)
class PreferenceExample:
    id: str
    query_ids: list[int]
    chosen_ids: list[int]  # each " " + text.strip(), then EOS
    rejected_ids: list[int]
    query_text: str
    chosen_text: str
    rejected_text: str
    chosen_policy: str
    rejected_policy: str
    query_cut: str
    row: int

    @property
    def chosen_input_ids(self) -> list[int]:
        return self.query_ids + self.chosen_ids

    @property
    def rejected_input_ids(self) -> list[int]:
        return self.query_ids + self.rejected_ids


T = TypeVar("T")


@dataclass
class TLDRData(Generic[T]):
    """The examples of one load, list-like, with what was dropped and cut (counts)."""

    examples: list[T]
    source: str
    rows: int  # rows read
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows
    query_cuts: dict[str, int] = field(default_factory=dict)  # "newline"/"fallback" -> rows

    def __len__(self) -> int:
        return len(self.examples)

    def __iter__(self) -> Iterator[T]:
        return iter(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


# --------------------------------------------------------------------------- formatting


def _check_tokenizer(tokenizer) -> None:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id: TL;DR responses end with EOS")
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError(f"the tokenizer's pad_token_id == eos_token_id == {tokenizer.eos_token_id}: "
                         "the recipe needs a pad token distinct from EOS")


def _encode_many(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def _encode(tokenizer, text: str) -> list[int]:
    return _encode_many(tokenizer, [text])[0]


def _prompt(subreddit: str, title: str, post: str) -> str:
    return TLDR_PROMPT.format(subreddit=subreddit, title=title, post=post)


class _FieldError(ValueError):
    """A formatting problem and the field (subreddit / title / post / summary) it comes from."""

    def __init__(self, column: str, message: str):
        self.column = column
        super().__init__(message)


def _check_no_special(tokenizer, ids: list[int], fields: dict[str, str]) -> None:
    """Neither pad nor EOS among `ids` (the encoding of `fields`' text); the error names the
    field holding the special token's literal text."""
    for tid, name in ((tokenizer.pad_token_id, "pad"), (tokenizer.eos_token_id, "EOS")):
        if tid is not None and tid in ids:
            lit = tokenizer.decode([tid])
            col = next((k for k, v in fields.items() if lit and lit in v), next(iter(fields)))
            raise _FieldError(col, f"{col} contains the {name} token (id {tid}, text {lit!r}); "
                                   "remove the literal special-token text from the data")


def _fallback_cut(tokenizer, subreddit: str, title: str, post: str, max_len: int) -> tuple[str, list[int]]:
    """Longest word-boundary prefix of `post` whose prompt fits (bisection); if no whole word
    fits, the longest character prefix of the first word; error if even "" does not fit."""

    def fit(p: str) -> Optional[list[int]]:
        ids = _encode(tokenizer, _prompt(subreddit, title, p))
        return ids if len(ids) <= max_len else None

    empty = _encode(tokenizer, _prompt(subreddit, title, ""))
    if len(empty) > max_len:
        raise _FieldError("title", f"the prompt with an empty post is {len(empty)} tokens, over "
                                   f"max_query_length={max_len}: subreddit and title alone do not fit")

    def bisect(cuts: list[int]) -> Optional[tuple[str, list[int]]]:
        # last index k with fit(post[:cuts[k]]) assuming fit is monotone in k; only prefixes
        # that were tested to fit are ever returned.
        lo, hi, best = 0, len(cuts) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            ids = fit(post[:cuts[mid]])
            if ids is not None:
                best, lo = (post[:cuts[mid]], ids), mid + 1
            else:
                hi = mid - 1
        return best

    word_ends = [m.end() for m in re.finditer(r"\S+", post)]
    best = bisect(word_ends)
    if best is None and word_ends:
        first = re.search(r"\S", post).start()
        best = bisect(list(range(first + 1, word_ends[0])))
    return best if best is not None else ("", empty)


def _fit_query(tokenizer, subreddit: str, title: str, post: str, max_len: int,
               ids: Optional[list[int]] = None) -> Query:
    text = _prompt(subreddit, title, post)
    ids = _encode(tokenizer, text) if ids is None else ids
    cut = "none"
    while len(ids) > max_len and "\n" in post:  # the recipe's rule: cut at the last newline
        post = post[:post.rindex("\n")]
        cut = "newline"
        text = _prompt(subreddit, title, post)
        ids = _encode(tokenizer, text)
    if len(ids) > max_len:  # no newline left: last resort, cut at a word boundary
        post, ids = _fallback_cut(tokenizer, subreddit, title, post, max_len)
        cut = "fallback"
        text = _prompt(subreddit, title, post)
    _check_no_special(tokenizer, ids, {"post": post, "title": title, "subreddit": subreddit})
    return Query(ids=ids, text=text, cut=cut, post=post)


def _check_str(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")


def format_query(tokenizer, subreddit: str, title: str, post: str,
                 max_query_length: int = MAX_QUERY_LENGTH) -> Query:
    """The recipe's query: unpadded ids (len <= max_query_length), the text, the cut applied."""
    _check_tokenizer(tokenizer)
    for name, value in (("subreddit", subreddit), ("title", title), ("post", post)):
        _check_str(name, value)
    if max_query_length < 1:
        raise ValueError(f"max_query_length must be >= 1, got {max_query_length}")
    return _fit_query(tokenizer, subreddit, title, post, max_query_length)


def response_text(summary: str) -> str:
    """``" " + summary.strip()``: the response text (without EOS)."""
    _check_str("summary", summary)
    if not summary.strip():
        raise ValueError("summary is empty or whitespace only")
    return " " + summary.strip()


def _finish_response(tokenizer, body_ids: list[int], max_len: int) -> list[int]:
    _check_no_special(tokenizer, body_ids, {"summary": ""})
    ids = body_ids + [tokenizer.eos_token_id]
    if len(ids) > max_len:
        raise ResponseTooLongError(len(ids), max_len)
    return ids


def format_response(tokenizer, summary: str, max_response_length: int = MAX_SFT_RESPONSE_LENGTH) -> list[int]:
    """Ids of ``" " + summary.strip()`` then EOS; ResponseTooLongError when longer than
    max_response_length tokens (EOS counted)."""
    _check_tokenizer(tokenizer)
    if max_response_length < 2:
        raise ValueError(f"max_response_length must be >= 2 (a token and EOS), got {max_response_length}")
    return _finish_response(tokenizer, _encode(tokenizer, response_text(summary)), max_response_length)


# --------------------------------------------------------------------------- reading rows


def _is_local(source: str) -> bool:
    p = Path(source)
    return p.suffix in DATA_FILE_SUFFIXES or p.exists()


def _open(source: str | Path, split: str, config_name: Optional[str],
          max_rows: Optional[int]) -> tuple[str, int, Iterable[Any]]:
    """(label for errors, number of rows, rows). A local file is read whole (split ignored);
    a local directory reads `{split}.jsonl` / `.parquet` / `.json` in it; anything else is a
    hub id loaded with datasets.load_dataset(source[, config_name], split=split)."""
    source = str(source)
    if _is_local(source):
        path = Path(source)
        if path.is_dir():
            found = [path / f"{split}{s}" for s in DATA_FILE_SUFFIXES if (path / f"{split}{s}").is_file()]
            if not found:
                raise FileNotFoundError(f"data directory {source!r} has no {split}.jsonl / {split}.parquet / "
                                        f"{split}.json for split {split!r}")
            path = found[0]
        try:
            rows = read_rows(path)
        except ValueError as e:  # a JSONL line that is not an object, an unreadable parquet file
            raise TLDRDataError(str(e) if str(path) in str(e) else f"{path}: {e}") from e
        if max_rows is not None:
            rows = rows[:max_rows]
        return str(path), len(rows), rows
    import datasets

    label = f"dataset {source!r}" + (f" config {config_name!r}" if config_name else "") + f" split {split!r}"
    args = (source, config_name) if config_name else (source,)
    ds = datasets.load_dataset(*args, split=split)
    if max_rows is not None:
        ds = ds.select(range(min(max_rows, len(ds))))
    return label, len(ds), ds


def _err(label: str, i: int, col: Optional[str], problem: str) -> TLDRDataError:
    where = f"{label}: row {i}" + (f" column {col!r}" if col else "")
    return TLDRDataError(f"{where}: {problem}")


def _field(obj: Any, key: str, col: str, label: str, i: int, *, nonempty: bool = False,
           nullable: bool = False, kind: type = str) -> Any:
    if not isinstance(obj, dict):
        raise _err(label, i, col.rsplit(".", 1)[0] if "." in col else None,
                   f"is a {type(obj).__name__}, not an object")
    if key not in obj:
        raise _err(label, i, col, f"missing (columns: {sorted(obj)})")
    v = obj[key]
    if v is None and nullable:
        return None
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise _err(label, i, col, f"is a {type(v).__name__} ({v!r:.60}), not a {kind.__name__}")
    if nonempty and not v.strip():
        raise _err(label, i, col, "is an empty or whitespace-only str")
    return v


def _chunks(rows: Iterable[Any], size: int = _CHUNK) -> Iterator[list[tuple[int, Any]]]:
    chunk: list[tuple[int, Any]] = []
    for i, row in enumerate(rows):
        chunk.append((i, row))
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _check_mode(name: str, value: str, modes: Sequence[str]) -> None:
    if value not in modes:
        raise ValueError(f"{name} must be one of {list(modes)}, got {value!r}")


def _queries(tokenizer, label: str, items: list[tuple[int, str, str, str]], max_len: int,
             prefix: str = "") -> list[Query]:
    """Batched first tokenization; only the over-long prompts are cut one by one. Errors name
    the column as `prefix` + field ("info." for the comparisons)."""
    first = _encode_many(tokenizer, [_prompt(s, t, p) for _, s, t, p in items])
    out = []
    for (i, s, t, p), ids in zip(items, first):
        try:
            out.append(_fit_query(tokenizer, s, t, p, max_len, ids))
        except _FieldError as e:
            raise _err(label, i, prefix + e.column, str(e)) from e
    return out


def _log_summary(data: TLDRData) -> None:
    if data.dropped:
        log.warning("%s: kept %d of %d rows; dropped %s", data.source, len(data), data.rows, data.dropped)
    if data.query_cuts:
        log.info("%s: queries cut to fit: %s", data.source, data.query_cuts)


def _sft_fields(row: Any, i: int, label: str, need_summary: bool) -> tuple:
    if not isinstance(row, dict):
        raise _err(label, i, None, f"is a {type(row).__name__}, not an object")
    ex_id = _field(row, "id", "id", label, i)
    subreddit = _field(row, "subreddit", "subreddit", label, i)
    title = _field(row, "title", "title", label, i)
    post = _field(row, "post", "post", label, i, nonempty=True)
    summary = _field(row, "summary", "summary", label, i, nonempty=True) if need_summary else None
    return ex_id, subreddit, title, post, summary


def _validate_lengths(max_query_length: int, max_response_length: Optional[int]) -> None:
    if max_query_length < 1:
        raise ValueError(f"max_query_length must be >= 1, got {max_query_length}")
    if max_response_length is not None and max_response_length < 2:
        raise ValueError(f"max_response_length must be >= 2 (a token and EOS), got {max_response_length}")


# --------------------------------------------------------------------------- loaders


def load_sft(source: str | Path, split: str, tokenizer, *, max_query_length: int = MAX_QUERY_LENGTH,
             max_response_length: int = MAX_SFT_RESPONSE_LENGTH, long_responses: str = "drop",
             max_rows: Optional[int] = None) -> TLDRData[SFTExample]:
    """SFT examples from the SFT schema (``id, subreddit, title, post, summary``).

    `source`: a hub id (default data: ``SFT_DATASET``), a local .jsonl/.json/.parquet file
    (split ignored) or a directory holding ``{split}.jsonl``/``.parquet``. Responses longer
    than `max_response_length` (EOS counted) are dropped and counted under
    ``"response_too_long"`` (``long_responses="drop"``) or are an error (``"error"``).
    `max_rows`: read only the first rows.
    """
    _check_tokenizer(tokenizer)
    _check_mode("long_responses", long_responses, LONG_RESPONSE_MODES)
    _validate_lengths(max_query_length, max_response_length)
    label, n_rows, rows = _open(source, split, None, max_rows)
    data: TLDRData[SFTExample] = TLDRData([], label, n_rows)
    for chunk in _chunks(rows):
        fields = [(i, *_sft_fields(row, i, label, True)) for i, row in chunk]
        queries = _queries(tokenizer, label, [(i, s, t, p) for i, _, s, t, p, _ in fields], max_query_length)
        texts = [response_text(f[5]) for f in fields]
        bodies = _encode_many(tokenizer, texts)
        for (i, ex_id, *_), q, text, body in zip(fields, queries, texts, bodies):
            try:
                resp = _finish_response(tokenizer, body, max_response_length)
            except ResponseTooLongError as e:
                if long_responses == "error":
                    raise _err(label, i, "summary", f"{e}; raise max_response_length or pass "
                                                    "long_responses='drop'") from e
                data.dropped["response_too_long"] = data.dropped.get("response_too_long", 0) + 1
                continue
            except ValueError as e:
                raise _err(label, i, "summary", str(e)) from e
            if q.cut != "none":
                data.query_cuts[q.cut] = data.query_cuts.get(q.cut, 0) + 1
            data.examples.append(SFTExample(id=ex_id, query_ids=q.ids, response_ids=resp, query_text=q.text,
                                            response_text=text, query_cut=q.cut, row=i))
    _log_summary(data)
    return data


def load_prompts(source: str | Path, split: str, tokenizer, *, max_query_length: int = MAX_QUERY_LENGTH,
                 max_rows: Optional[int] = None) -> list[str]:
    """PPO prompt texts from the SFT schema (``subreddit, title, post``; ``id`` checked,
    ``summary`` not needed), each formatted and cut to fit `max_query_length` tokens.
    ``ppo_ray.data.encode_prompts`` encodes each to exactly its ``format_query`` ids."""
    return [q.text for q in load_queries(source, split, tokenizer, max_query_length=max_query_length,
                                         max_rows=max_rows)]


def load_queries(source: str | Path, split: str, tokenizer, *, max_query_length: int = MAX_QUERY_LENGTH,
                 max_rows: Optional[int] = None) -> TLDRData[Query]:
    """As load_prompts, but the Query records (ids, text, cut, post) with the cut counts."""
    _check_tokenizer(tokenizer)
    _validate_lengths(max_query_length, None)
    label, n_rows, rows = _open(source, split, None, max_rows)
    data: TLDRData[Query] = TLDRData([], label, n_rows)
    for chunk in _chunks(rows):
        fields = [(i, *_sft_fields(row, i, label, False)) for i, row in chunk]
        for q in _queries(tokenizer, label, [(i, s, t, p) for i, _, s, t, p, _ in fields], max_query_length):
            if q.cut != "none":
                data.query_cuts[q.cut] = data.query_cuts.get(q.cut, 0) + 1
            data.examples.append(q)
    _log_summary(data)
    return data


def _is_cnndm(row: dict) -> bool:
    info = row.get("info")
    return row.get("batch") in CNNDM_BATCHES or (
        isinstance(info, dict) and info.get("post") is None and isinstance(info.get("article"), str))


def _preference_fields(row: Any, i: int, label: str) -> tuple:
    if not isinstance(row, dict):
        raise _err(label, i, None, f"is a {type(row).__name__}, not an object")
    info = _field(row, "info", "info", label, i, kind=dict)
    ex_id = _field(info, "id", "info.id", label, i)
    post = _field(info, "post", "info.post", label, i, nonempty=True)
    title = _field(info, "title", "info.title", label, i)
    subreddit = _field(info, "subreddit", "info.subreddit", label, i)
    summaries = _field(row, "summaries", "summaries", label, i, kind=list)
    if len(summaries) != 2:
        raise _err(label, i, "summaries", f"has {len(summaries)} summaries, not 2")
    for k, s in enumerate(summaries):
        _field(s, "text", f"summaries[{k}].text", label, i, nonempty=True)
        _field(s, "policy", f"summaries[{k}].policy", label, i)
        _field(s, "note", f"summaries[{k}].note", label, i, nullable=True)
    choice = _field(row, "choice", "choice", label, i, kind=int)
    if choice not in (0, 1):
        raise _err(label, i, "choice", f"is {choice}, not 0 or 1")
    return ex_id, subreddit, title, post, summaries[choice], summaries[1 - choice], choice


def load_preferences(source: str | Path, split: str, tokenizer, *, config_name: Optional[str] = PREFERENCE_CONFIG,
                     max_query_length: int = MAX_QUERY_LENGTH, max_response_length: int = MAX_RM_RESPONSE_LENGTH,
                     long_responses: str = "drop", cnndm: str = "skip",
                     max_rows: Optional[int] = None) -> TLDRData[PreferenceExample]:
    """Preference pairs from the comparisons schema (``info{id, post, title, subreddit}``,
    ``summaries[{text, policy, note}]`` x2, ``choice``): chosen = summaries[choice].

    `source` as in load_sft; a hub id is loaded with `config_name` (default "comparisons";
    None for a dataset without configs). CNN/DM rows (``batch`` in CNNDM_BATCHES, or a null
    ``info.post`` with an ``info.article``) are skipped and counted under ``"cnndm"``
    (``cnndm="skip"``) or are an error (``"error"``). A pair with either response over
    `max_response_length` tokens (EOS counted) is dropped, counted under
    ``"response_too_long"``, or is an error (``long_responses="error"``).
    """
    _check_tokenizer(tokenizer)
    _check_mode("long_responses", long_responses, LONG_RESPONSE_MODES)
    _check_mode("cnndm", cnndm, CNNDM_MODES)
    _validate_lengths(max_query_length, max_response_length)
    label, n_rows, rows = _open(source, split, config_name, max_rows)
    data: TLDRData[PreferenceExample] = TLDRData([], label, n_rows)
    for chunk in _chunks(rows):
        fields = []
        for i, row in chunk:
            if isinstance(row, dict) and _is_cnndm(row):
                if cnndm == "error":
                    raise _err(label, i, "info.post", f"is a CNN/DM row (batch {row.get('batch')!r}, an "
                                                      "'article' instead of a post); pass cnndm='skip'")
                data.dropped["cnndm"] = data.dropped.get("cnndm", 0) + 1
                continue
            fields.append((i, *_preference_fields(row, i, label)))
        queries = _queries(tokenizer, label, [(f[0], f[2], f[3], f[4]) for f in fields], max_query_length,
                           prefix="info.")
        texts = [(response_text(f[5]["text"]), response_text(f[6]["text"])) for f in fields]
        bodies = _encode_many(tokenizer, [t for pair in texts for t in pair])
        for n, (f, q, (chosen_text, rejected_text)) in enumerate(zip(fields, queries, texts)):
            i, ex_id, _, _, _, chosen, rejected, choice = f
            resp = []
            for j, (which, k) in enumerate((("chosen", choice), ("rejected", 1 - choice))):
                try:
                    resp.append(_finish_response(tokenizer, bodies[2 * n + j], max_response_length))
                except ResponseTooLongError as e:
                    if long_responses == "error":
                        raise _err(label, i, f"summaries[{k}].text",
                                   f"({which}) {e}; raise max_response_length or pass long_responses='drop'") from e
                    break
                except ValueError as e:
                    raise _err(label, i, f"summaries[{k}].text", str(e)) from e
            if len(resp) < 2:
                data.dropped["response_too_long"] = data.dropped.get("response_too_long", 0) + 1
                continue
            if q.cut != "none":
                data.query_cuts[q.cut] = data.query_cuts.get(q.cut, 0) + 1
            data.examples.append(PreferenceExample(
                id=ex_id, query_ids=q.ids, chosen_ids=resp[0], rejected_ids=resp[1], query_text=q.text,
                chosen_text=chosen_text, rejected_text=rejected_text, chosen_policy=chosen["policy"],
                rejected_policy=rejected["policy"], query_cut=q.cut, row=i))
    _log_summary(data)
    return data
