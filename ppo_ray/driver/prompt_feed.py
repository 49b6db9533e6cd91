"""The trainer's prompts (PPOTrainer.feed): strings, or rows whose config.prompt_column holds
the text and whose other keys are the dataset's columns (ppo_ray.data.prompt_rows), as texts
and the columns the reward functions take, encoded with the policy's tokenizer; and train()'s
prompt list, encoded once and identified by its texts, which the data cursor indexes."""

from __future__ import annotations

from typing import Optional, Sequence

from ppo_ray.driver.checkpoint import CheckpointError
from ppo_ray.data import PromptColumns, PromptCursor, PromptRows, encode_prompts, prompt_rows, prompts_fingerprint
from ppo_ray.rewards import columns_taken


def env_rows(config, columns: Optional[PromptColumns]) -> Optional[tuple[dict, ...]]:
    """The rows an environment's episodes are reset with (GenerateRequest.rows), from a batch's
    columns (PromptFeed.columns, which with an environment holds every column and the prompt
    text); None without an environment."""
    if config.environment is None or columns is None:
        return None
    return columns.dicts()


class PromptFeed:
    def __init__(self, config, tokenizer, reward_fns: Sequence):
        self.config, self.tokenizer = config, tokenizer
        self._reward_fns = list(reward_fns)  # which dataset columns to send (columns)
        self.key: Optional[str] = None  # fingerprint of the list the cursor indexes
        self._ids: tuple[Optional[str], list[list[int]]] = (None, [])  # (fingerprint, its prompts encoded once)
        self.from_checkpoint = False  # the cursor indexes a restored checkpoint's list (key)

    def rows(self, prompts) -> PromptRows:
        """Prompts as texts and columns (strings, or rows keyed by config.prompt_column)."""
        return prompt_rows(prompts, self.config.prompt_column)

    def columns(self, rows: PromptRows, first: int = 0) -> Optional[PromptColumns]:
        """The columns of `rows` that some reward function takes (its signature names them, or
        it has **kwargs: ppo_ray.rewards.columns_taken, the rule the reward side applies to each
        function), the first row for group id `first`; None when none does (a reward model
        alone reads none): the score call then carries nothing more than before. With an
        environment (config.environment), every column and the prompt's text (under
        config.prompt_column): its episodes are reset with the whole row (env_rows)."""
        if self.config.environment is not None:
            return PromptColumns({self.config.prompt_column: list(rows.texts), **rows.columns}, first)
        taken = {name for fn in self._reward_fns for name in columns_taken(fn, list(rows.columns))}
        values = {name: v for name, v in rows.columns.items() if name in taken}
        return PromptColumns(values, first) if values else None

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        cfg = self.config
        return encode_prompts(self.tokenizer, list(texts), cfg.max_prompt_length, cfg.prompt_truncation,
                              chat_template=cfg.apply_chat_template)

    def use(self, prompts: Sequence[str] | Sequence[dict], cursor: PromptCursor
            ) -> tuple[list[list[int]], Optional[PromptColumns]]:
        """train()'s list: its prompts encoded (and checked: a bad prompt is named by its index)
        once, not at every step, and its rows' columns (the reward functions'). A new list
        starts a new epoch over it (`cursor`), except after restoring a checkpoint, whose cursor
        indexes its own list (CheckpointError). The list's identity is its texts'
        (prompts_fingerprint)."""
        if not prompts:
            raise ValueError("train() needs a non-empty list of prompts")
        rows = self.rows(prompts)
        key = prompts_fingerprint(rows)
        if self._ids[0] != key:
            self._ids = (key, self.encode(rows.texts))
        if self.key is not None and self.key != key:
            if self.from_checkpoint:
                raise CheckpointError(f"train() got a different prompt list ({len(prompts)} prompts) from the one "
                                      "the checkpoint's data cursor indexes: resume with the run's dataset")
            cursor.order = []  # a new prompt list: a new epoch over it
        self.key, self.from_checkpoint = key, False
        return self._ids[1], self.columns(rows)

    def restored(self, key: Optional[str]) -> None:
        """A checkpoint's cursor indexes the list whose fingerprint is `key` (None: an old
        checkpoint that did not record it: any list goes)."""
        self.key, self.from_checkpoint = key, key is not None
