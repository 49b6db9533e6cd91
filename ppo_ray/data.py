"""Prompt data: validation and encoding of prompt texts.

Bottom layer: imports nothing of ours. (Datasets -- TL;DR, local JSONL/parquet, the
bundled task -- come here later.)
"""

from __future__ import annotations

from typing import Sequence

TRUNCATION_MODES = ("error", "left")


def encode_prompts(tokenizer, prompts: Sequence[str], max_prompt_length: int,
                   truncation: str = "error") -> list[list[int]]:
    """Validate and tokenize prompt texts: B texts -> B lists of token ids.

    No special tokens are added (Qwen3 base adds none; a BOS here would be a token the
    learner's and reference's forwards must also see, so prompts carry their own).
    Every problem is a ValueError naming the bad prompt's index:

    * an empty list; a prompt that is not a str, or is empty / whitespace only;
    * a prompt longer than ``max_prompt_length`` tokens with ``truncation="error"``.

    ``truncation="left"`` keeps the LAST ``max_prompt_length`` tokens: the end of a prompt
    (e.g. "TL;DR:") sits next to the response and matters most (the N+ recipe cuts the
    post, never the instruction). Nothing is mangled silently.
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
            raise ValueError(f"prompt {i} is a {type(p).__name__}, not a str: {p!r:.80}")
        if not p.strip():
            raise ValueError(f"prompt {i} is empty or whitespace only: {p!r}")

    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    out: list[list[int]] = []
    for i, ids in enumerate(encoded):
        ids = list(ids)
        if len(ids) > max_prompt_length:
            if truncation == "error":
                raise ValueError(
                    f"prompt {i} is {len(ids)} tokens long, over max_prompt_length={max_prompt_length}; "
                    "shorten it, raise max_prompt_length, or set prompt_truncation: left "
                    "(keeps the last max_prompt_length tokens)")
            ids = ids[-max_prompt_length:]
        out.append(ids)
    return out
