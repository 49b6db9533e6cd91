"""Prompt data: where prompts come from, and their validation and encoding; a dataset's
other columns, which reach the reward functions as keyword lists (TRL's convention:
fn(prompts, completions, **columns)): PromptRows (the prompts as the trainer takes them) and
PromptColumns (a batch's columns on their way to the reward actor).

Bottom layer: imports only ppo_ray.config (the truncation modes, the data file suffixes) and
ppo_ray.tiny_model (for the bundled prompts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ppo_ray.config import DATA_FILE_SUFFIXES, TRUNCATION_MODES

CHECK_CHUNK = 4096  # prompts tokenized at a time by load_prompts' check


class DataError(ValueError):
    """A prompt data file or dataset that cannot be used; the message names it (and the row)."""


def check_chat_template(tokenizer, model_name: str) -> None:
    """apply_chat_template needs a tokenizer that has a chat template (DataError naming the model:
    launch.py's preflight reports it before anything runs)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"apply_chat_template is true but the tokenizer of {model_name!r} has no chat template "
                         "(a base model?): set apply_chat_template: false, or use an instruct model's tokenizer")


def chat_format(tokenizer, prompts: Sequence[str]) -> list[str]:
    """Each prompt as one user message through the tokenizer's chat template, with the
    template's generation prompt (the assistant turn's opening) after it."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in prompts]


def encode_prompts(tokenizer, prompts: Sequence[str], max_prompt_length: int,
                   truncation: str = "error", *, index_offset: int = 0, chat_template: bool = False) -> list[list[int]]:
    """Validate and tokenize prompt texts: B texts -> B lists of token ids.

    No special tokens are added (Qwen3 base adds none; a BOS here would be a token the
    learner's and reference's forwards must also see, so prompts carry their own).
    Every problem is a ValueError naming the bad prompt's index:

    * an empty list; a prompt that is not a str, or is empty / whitespace only;
    * a prompt longer than ``max_prompt_length`` tokens with ``truncation="error"``.

    ``truncation="left"`` keeps the LAST ``max_prompt_length`` tokens: the end of a prompt
    (e.g. "TL;DR:") sits next to the response and matters most (the N+ recipe cuts the
    post, never the instruction). Nothing is mangled silently. ``index_offset`` is added to
    the indices in messages (a chunk of a larger list). ``chat_template`` formats each prompt
    with the tokenizer's chat template first (chat_format; config.apply_chat_template), and
    max_prompt_length then counts the template's tokens too.
    """
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"prompt truncation must be one of {list(TRUNCATION_MODES)}, got {truncation!r}")
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of strings, got a single str")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts: the prompt list is empty")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise ValueError(f"prompt {index_offset + i} is a {type(p).__name__}, not a str: {p!r:.80}")
        if not p.strip():
            raise ValueError(f"prompt {index_offset + i} is empty or whitespace only: {p!r}")

    if chat_template:
        prompts = chat_format(tokenizer, prompts)
    # the template's special tokens (<|im_start|>, ...) are parsed from the text as tokens
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    return [fit_prompt(list(ids), max_prompt_length, truncation, index_offset + i) for i, ids in enumerate(encoded)]


def fit_prompt(ids: list[int], max_prompt_length: int, truncation: str, index: int) -> list[int]:
    """The prompt-length rule, in one place (encode_prompts and the generator's token-id
    prompts): a prompt over ``max_prompt_length`` tokens is an error naming prompt `index`,
    or with ``truncation="left"`` keeps its last ``max_prompt_length`` tokens."""
    if len(ids) <= max_prompt_length:
        return ids
    if truncation != "left":
        raise ValueError(
            f"prompt {index} is {len(ids)} tokens long, over max_prompt_length={max_prompt_length}; "
            "shorten it, raise max_prompt_length, or set prompt_truncation: left "
            "(keeps the last max_prompt_length tokens)")
    return ids[-max_prompt_length:]


TLDR_PROMPT = "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"


def bundled_prompts() -> list[str]:
    """The TL;DR-format prompts of the bundled corpus (no hub needed)."""
    from ppo_ray.tiny_model import tldr_examples

    return [TLDR_PROMPT.format(**ex) for ex in tldr_examples()]


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a local JSONL (one object per line) or parquet file; errors name the file and row
    (FileNotFoundError for a missing file, DataError for one that cannot be read or parsed)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data file {str(p)!r} does not exist")
    if not p.is_file():
        raise FileNotFoundError(f"data file {str(p)!r} is not a file")
    if p.suffix in (".jsonl", ".json"):
        rows = []
        try:
            with p.open(encoding="utf-8") as f:
                for n, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{p}: line {n} is not valid JSON: {e}") from e
                    if not isinstance(row, dict):
                        raise DataError(f"{p}: line {n} is a {type(row).__name__}, not an object")
                    rows.append(row)
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{p}: cannot be read as UTF-8 JSONL: {e}") from e
        return rows
    if p.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(p).to_pylist()
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"{p}: cannot be read as parquet: {e}") from e
    raise DataError(f"data file {str(p)!r}: unsupported format {p.suffix!r} (use .jsonl or .parquet)")


def column(rows: list[dict], name: str, source: str) -> list[str]:
    """The str values of column `name`; a missing or non-str value is an error naming the row."""
    out = []
    for i, row in enumerate(rows):
        if name not in row:
            raise DataError(f"{source}: row {i} has no column {name!r} (columns: {sorted(row)})")
        if not isinstance(row[name], str):
            raise DataError(f"{source}: row {i} column {name!r} is a {type(row[name]).__name__}, not a str")
        out.append(row[name])
    return out


# The names a reward function's call already gives its arguments: its two positional ones and the
# batch's own column (actors.reward.reward_columns: finish_reasons). A dataset column may not
# take one of them (it would shadow it, or be shadowed).
RESERVED_COLUMNS = ("prompts", "completions", "finish_reasons")


def check_columns(columns: dict[str, list], source: str) -> None:
    """A dataset's columns as reward functions get them, checked: str names, none of
    RESERVED_COLUMNS, and every value JSON (the HTTP verifier sends them as JSON; a reward
    worker gets them as they are). DataError naming `source`, the column and the row."""
    for name, values in columns.items():
        if not isinstance(name, str):
            raise DataError(f"{source}: column {name!r} is named by a {type(name).__name__}: a column's name is a "
                            "reward function's keyword, a str")
        if name in RESERVED_COLUMNS:
            raise DataError(f"{source}: column {name!r} has the name of an argument every reward function is "
                            f"given ({', '.join(RESERVED_COLUMNS)}): rename the column")
        try:
            json.dumps(values)
        except (TypeError, ValueError):
            for i, value in enumerate(values):
                try:
                    json.dumps(value)
                except (TypeError, ValueError) as e:
                    raise DataError(f"{source}: row {i} column {name!r}: a {type(value).__name__} value, not JSON "
                                    f"({e}); reward functions get a dataset's columns as JSON values") from None
            raise


@dataclass(frozen=True)
class PromptRows:
    """Prompts as the trainer takes them (prompt_rows): the texts, and the dataset's other
    columns, per column one JSON value per prompt, in the prompts' order (empty for plain
    strings)."""

    texts: list[str]
    columns: dict[str, list]

    def __len__(self) -> int:
        return len(self.texts)

    def part(self, start: int, end: int) -> "PromptRows":
        """Prompts [start, end) with their columns."""
        return PromptRows(self.texts[start:end], {name: v[start:end] for name, v in self.columns.items()})


def prompt_rows(prompts, prompt_column: str = "prompt", source: str = "prompts") -> PromptRows:
    """`prompts` as PromptRows: a list of strings (no columns), or of rows (dicts) whose
    `prompt_column` holds the text and whose other keys are its columns (check_columns); a row
    that lacks a column another row has gets None there, as `datasets` reads such JSONL. A list
    of both strings and rows, or a row without the prompt column, is a DataError naming the
    row and `source`. The texts are checked where they are encoded (encode_prompts)."""
    if isinstance(prompts, PromptRows):
        return prompts
    if isinstance(prompts, (str, dict)):
        raise DataError(f"{source}: prompts must be a list of strings or of rows (dicts), got a single "
                        f"{type(prompts).__name__}")
    prompts = list(prompts)
    rows = [isinstance(p, dict) for p in prompts]
    if not any(rows):
        return PromptRows(prompts, {})
    if not all(rows):
        i = rows.index(False)
        raise DataError(f"{source}: prompt {i} is a {type(prompts[i]).__name__} and prompt {rows.index(True)} a row "
                        "(dict): give strings or rows, not both")
    texts = column(prompts, prompt_column, source)
    names = dict.fromkeys(name for row in prompts for name in row if name != prompt_column)  # first seen first
    columns = {name: [row.get(name) for row in prompts] for name in names}
    check_columns(columns, source)
    return PromptRows(texts, columns)


@dataclass(frozen=True)
class PromptColumns:
    """A batch's dataset columns as they travel with its score call to the reward actor: per
    column, one value per prompt, the prompt of group id `first + i` at position i (the batch's
    group ids, RolloutBatch.groups, are its prompts' global indices in the call). `rows` spreads
    them over the batch's rows by those ids: each of a prompt's samples_per_prompt rows gets its
    prompt's values, whatever the rows' order."""

    values: dict[str, list]
    first: int = 0

    def __post_init__(self) -> None:
        lengths = {name: len(v) for name, v in self.values.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"PromptColumns: the columns have different lengths {lengths}")

    def __len__(self) -> int:
        return next(iter(len(v) for v in self.values.values()), 0)

    def dicts(self) -> tuple[dict, ...]:
        """One dict per prompt, in order: its value of every column (an environment's rows)."""
        return tuple({name: v[i] for name, v in self.values.items()} for i in range(len(self)))

    def take(self, positions: Sequence[int], first: int = 0) -> "PromptColumns":
        """The values at `positions` (in that order), the first of them for group id `first`."""
        return PromptColumns({name: [v[i] for i in positions] for name, v in self.values.items()}, first)

    def rows(self, groups: Sequence[int]) -> dict[str, list]:
        """Per column, the value of each row's prompt (its group id in `groups`, (B,)); a group
        id outside [first, first + len) is a ValueError naming it."""
        n = len(self)
        positions = [g - self.first for g in groups]
        bad = [g for g, i in zip(groups, positions) if not 0 <= i < n]
        if bad:
            raise ValueError(f"the batch's group id {bad[0]} has no dataset columns (they cover the prompts of "
                             f"group ids {self.first}..{self.first + n - 1})")
        return {name: [v[i] for i in positions] for name, v in self.values.items()}


def _is_local_path(name: str) -> bool:
    """A dataset name that can only be a local path: a data-file suffix, an existing path, or a
    path no hub id looks like (absolute, ./ ../ ~, or more than one '/': hub ids are
    "name" or "org/name"). Such a name that does not exist is a FileNotFoundError, not a
    hub lookup that fails with a network error."""
    return (Path(name).suffix in DATA_FILE_SUFFIXES or Path(name).exists() or name.startswith(("/", ".", "~"))
            or name.count("/") > 1)


def load_prompts(config, tokenizer=None) -> list[str] | list[dict]:
    """Prompts named by config.dataset: "bundled" (texts), a local .jsonl/.parquet file, or a
    hub dataset id (loaded with `datasets`, split "train"): its rows, config.prompt_column the
    prompt text and every other column one the reward functions may take (prompt_rows: a
    column named like one of their own arguments, or a value that is not JSON, is an error
    naming the column and the dataset). PPOTrainer.train takes either form.

    With a `tokenizer`, every prompt is also checked as the trainer will encode it
    (encode_prompts: empty prompts, and prompts over config.max_prompt_length with
    prompt_truncation "error"), so a bad row stops the run before any actor starts instead
    of at the step that first draws it. Errors are DataError naming the dataset and row.
    """
    name = config.dataset
    if name == "bundled":
        prompts = bundled_prompts()
    elif _is_local_path(name):
        prompts = read_rows(Path(name).expanduser())
    else:
        import datasets

        ds = datasets.load_dataset(name, split="train")
        if config.prompt_column not in ds.column_names:
            raise DataError(f"dataset {name!r} has no column {config.prompt_column!r} (columns: {ds.column_names})")
        prompts = ds.to_list()
    texts = prompt_rows(prompts, config.prompt_column, name).texts
    if tokenizer is not None:
        if config.apply_chat_template:
            check_chat_template(tokenizer, config.model_name)
        if not texts:
            raise DataError(f"dataset {name!r} has no rows")
        try:  # in chunks: the ids of a whole dataset would be GBs of Python ints
            for start in range(0, len(texts), CHECK_CHUNK):
                encode_prompts(tokenizer, texts[start:start + CHECK_CHUNK], config.max_prompt_length,
                               config.prompt_truncation, index_offset=start,
                               chat_template=config.apply_chat_template)
        except ValueError as e:  # "prompt i ...": i is the row index in the dataset
            raise DataError(f"dataset {name!r} column {config.prompt_column!r}: {e}") from e
    return prompts


class PromptCursor:
    """Which prompts the next batches hold: the rest of this epoch's shuffled order and the
    RNG (seeded with the run seed) that shuffles the next epoch. Checkpointed with the run,
    with the fingerprint of the prompt list it indexes."""

    def __init__(self, seed: int):
        import torch

        self.order: list[int] = []
        self.rng = torch.Generator().manual_seed(seed)

    def draw(self, n_prompts: int, batch_size: int) -> list[int]:
        """`batch_size` prompt indices, drawn without replacement, reshuffled every epoch."""
        import torch

        while len(self.order) < batch_size:
            self.order += torch.randperm(n_prompts, generator=self.rng).tolist()
        rows, self.order = self.order[:batch_size], self.order[batch_size:]
        return rows

    def state(self) -> tuple:
        """(order, RNG state): what a checkpoint keeps and set_state puts back."""
        return list(self.order), self.rng.get_state()

    def set_state(self, state: tuple) -> None:
        self.order = list(state[0])
        self.rng.set_state(state[1])


def prompts_fingerprint(prompts, prompt_column: str = "prompt") -> str:
    """sha256 of a prompt list (its length and every prompt text; rows: their `prompt_column`,
    prompt_rows): the identity of the list a PromptCursor indexes, checked when a checkpointed
    run resumes. The rows' other columns are not part of it: a run's checkpoints from before
    they reached the reward functions resume on the same rows."""
    import hashlib

    prompts = prompt_rows(prompts, prompt_column).texts
    h = hashlib.sha256(str(len(prompts)).encode())
    for p in prompts:
        h.update(hashlib.sha256(p.encode()).digest())
    return h.hexdigest()
