"""What a task is, and the registry the config's `task` names one from (docs/TASKS.md).

A task is one object, a subclass of :class:`Task`, that the pipeline (ppo_ray.tasks.pipeline)
and `launch.py eval` (ppo_ray.tasks.evaluate) ask for everything task-specific: its stages, its
data (the spec its files depend on, and their writer), its SFT targets, its reward (a verifier,
or the reward model its "rm" stage trains), its held-out evaluation and the report built from it.
The pipeline holds no branch on the task's name: a new task is one module.

The data a task writes into the run's data/ directory (write_data), as JSONL rows:
- sft_train.jsonl, sft_validation.jsonl: `prompt` and the SFT target column (Task.sft_target);
- preferences_train.jsonl, preferences_validation.jsonl (a task with an "rm" stage): `prompt`,
  `chosen`, `rejected`;
- prompts_train.jsonl (what PPO samples from), prompts_validation.jsonl, prompts_test.jsonl (the
  held-out rows, the first eval_size of each evaluated): `prompt` and any columns of its own,
  which reach a verifier as keyword arguments (ppo_ray.rewards.call_reward_fn: `answer=[...]`).

The registry is the config's TASKS (ppo_ray.config: name -> "module:object" or the Task), so
config.task's names come from it; `task: package.module:object` names a task that is in no
registry (a user's own, importable from PYTHONPATH). get_task resolves either.

Imports only the standard library at import time (ppo_ray.tasks.arith, which the reward scorer
imports for its verifier, stays light).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

STAGE_ORDER = ("sft", "rm", "ppo")  # the pipeline's stages (launch.py); a task runs these in this order


class TaskError(ValueError):
    """A task that cannot be used: not registered, not importable, not a Task, or inconsistent
    (the message names it)."""


class Task(ABC):
    """One task: declare the class attributes, implement the abstract methods; the others have
    defaults that a task may override. `config` is the pipeline's PPOConfig, `cfg` the PPO stage's
    (ppo_config: the SFT model as policy, the task's reward); `rows` are prompt rows (dicts with
    `prompt` and the task's columns)."""

    name: str = ""  # its name in errors and logs
    stages: tuple[str, ...] = ("sft", "ppo")  # in STAGE_ORDER; "rm" exactly when there is no verifier
    sft_target: str = "answer"  # the column of sft_*.jsonl that SFT learns to write after the prompt
    verifier: Optional[str | Callable] = None  # the reward: "module:function" (or the function), fn(prompts, completions, **columns)
    # a multi-turn environment (a registered name or "module:Class", ppo_ray.environments): its
    # episodes are the PPO stage's rollouts and its reward their score (a verifier's is added)
    environment: Optional[str] = None
    # a multi-turn task's SFT files: the column of [who, text] transcript segments ("model" | "env")
    # that SFT learns, the environment's segments out of its loss (pipeline.sft_ids); None: sft_target
    sft_segments: Optional[str] = None
    policy_name: str = "ppo"  # the trained policy's name in the report's keys (<number>_<split>_<policy_name>)
    before_name: str = "sft"  # the starting policy's: "base" for a task with no SFT stage (the base model)

    # ------------------------------------------------------------------ data
    @abstractmethod
    def data_spec(self, config) -> dict:
        """What the task's files depend on (the task's seed and parameters): kept as data/task.json,
        the fingerprint a later stage compares before it reuses the files."""

    @abstractmethod
    def write_data(self, data_dir: Path, config) -> None:
        """Write the splits (the module docstring's files) into data_dir, deterministically."""

    # ------------------------------------------------------------------ stage diagnostics
    def sft_report(self, config, run_dir: Path, data_dir: Path) -> dict:
        """Extra numbers of the SFT stage (its report), from run_dir/sft; none by default."""
        return {}

    def rm_report(self, config, run_dir: Path, data_dir: Path, correct: list) -> dict:
        """Extra numbers of the reward-model stage; `correct`: per validation pair, whether the
        reward model ranked it right. None by default."""
        return {}

    # ------------------------------------------------------------------ the held-out evaluation
    def eval_settings(self, cfg) -> dict:
        """The task's own settings its evaluation depends on besides the config's EVAL_FIELDS
        (pipeline.eval_settings: an SFT evaluation kept with other ones is evaluated again)."""
        return {}

    @abstractmethod
    def evaluate(self, trainer, cfg, rows: Sequence[dict], *, label: Optional[str] = None) -> dict:
        """One policy's evaluation of `rows`: a JSON-able dict of per-prompt lists (the SFT
        policy's is kept in eval-before-ppo.json). Use ppo_ray.tasks.evaluation's generate for the
        samples: the same seeds for every policy (paired numbers)."""

    def periodic(self, trainer, cfg, rows: Sequence[dict]) -> dict:
        """The numbers logged every eval_every PPO steps, on the validation rows (metrics.jsonl);
        none by default."""
        return {}

    def train_eval_prompts(self, rows: Sequence[dict]) -> Sequence:
        """What trainer.train samples for eval_samples.jsonl: the validation rows (their columns
        reach the verifier) by default."""
        return rows

    @abstractmethod
    def report(self, run_dir: Path, metrics: Path, cfg, test_rows: list[dict], val_rows: list[dict], sft: dict,
               after: dict, after_val: dict) -> dict:
        """report.json's numbers of the PPO stage (and the files behind them, e.g. samples.md) from
        the SFT policy's evaluation (`sft`, with the validation split's under "val") and the
        trained policy's of the test and validation rows."""

    # ------------------------------------------------------------------ `launch.py eval`
    def check_columns(self, rows: Sequence[dict], source: str) -> dict[str, str]:
        """Metrics that cannot be computed on `rows` (a prompts file without the task's
        columns): {metric: why}; a bad value is a DataError naming the row. None by default."""
        return {}

    def eval_policy(self, trainer, cfg, rows: Sequence[dict], *, label: str, skipped: dict[str, str],
                    score: bool) -> dict:
        """A policy's evaluation for `launch.py eval` (`skipped`: check_columns'; `score`: the
        run's reward model scores the samples too, as `reward`): evaluate() by default."""
        return self.evaluate(trainer, cfg, rows, label=label)

    def eval_numbers(self, tag: str, cfg, rows: Sequence[dict], after: dict, before: Optional[dict],
                     skipped: dict[str, str]) -> dict:
        """eval.json's numbers of split `tag` (the keys report.json has for it); none by default."""
        return {}

    def eval_samples_md(self, path: Path, cfg, rows: Sequence[dict], after: dict, before: Optional[dict],
                        skipped: dict[str, str]) -> bool:
        """Write `launch.py eval`'s samples.md the task's way; False: not written (the texts are)."""
        return False

    # ------------------------------------------------------------------ derived
    @property
    def verifier_spec(self) -> Optional[str]:
        """The verifier as a reward_funcs entry ("module:function")."""
        fn = getattr(self.verifier, "__func__", self.verifier)  # a function set on the class reads as a method
        if fn is None or isinstance(fn, str):
            return fn
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if not module or module == "__main__" or "<" in qualname:
            raise TaskError(f"task {self.name!r}: its verifier {fn!r} must be importable by name (a module-level "
                            "function of an importable module, or 'module:function')")
        return f"{module}:{qualname}"

    def check(self, named: Optional[str] = None) -> None:
        """The declarations agree (TaskError naming the task, as `named` names it, and the rule)."""
        who = named or self.name
        if not self.name:
            raise TaskError(f"{type(self).__name__}: a task needs a name")
        stages = tuple(self.stages)
        if [s for s in STAGE_ORDER if s in stages] != list(stages) or stages[-1:] != ("ppo",) \
                or (stages[:1] != ("sft",) and stages != ("ppo",)):
            raise TaskError(f"task {who!r}: stages {stages} must be ('ppo',) (RL from the base model) or start "
                            f"with 'sft', end with 'ppo' and keep the order {STAGE_ORDER}")
        if ("rm" in stages) == (self.verifier is not None or self.environment is not None):
            raise TaskError(f"task {who!r}: a task has a reward-model stage ('rm'), or a verifier and/or an environment "
                            f"(stages {stages}, verifier {self.verifier!r}, environment {self.environment!r})")
        if "sft" not in stages and self.before_name == "sft":
            raise TaskError(f"task {who!r}: with no SFT stage the starting policy is the base model: set "
                            "before_name (e.g. 'base')")
        if not self.sft_target or not isinstance(self.sft_target, str):
            raise TaskError(f"task {who!r}: sft_target must name the SFT files' target column")
        self.verifier_spec  # noqa: B018 - its check


def _registry() -> dict[str, Any]:
    from ppo_ray.config import TASKS  # the config layer's names (lazy: it imports torch)

    return TASKS


def register_task(task: Task, name: Optional[str] = None) -> Task:
    """Register `task` under `name` (default task.name) in this process: config.task may name it.
    A registered name is not taken twice. Returns the task (usable as a decorator on an instance)."""
    if not isinstance(task, Task):
        raise TaskError(f"register_task: {task!r} is not a ppo_ray.tasks.base.Task")
    task.check()
    name = name or task.name
    tasks = _registry()
    if name in tasks and tasks[name] is not task:
        raise TaskError(f"register_task: a task named {name!r} is registered already ({tasks[name]!r})")
    tasks[name] = task
    return task


def _import(spec: str, name: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise TaskError(f"task {name!r} must be a registered task ({', '.join(_registry())}) or "
                        "'package.module:object'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskError(f"task {name!r}: cannot import module {module_name!r}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TaskError(f"task {name!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def get_task(name: str) -> Task:
    """The task config.task names: a registered name, or "module:object" (a Task instance, or a
    Task subclass, which is instantiated). TaskError naming the value for anything else."""
    tasks = _registry()
    entry = tasks.get(name)
    if entry is None and ":" not in str(name):
        raise TaskError(f"task {name!r} is not registered (registered: {', '.join(tasks)}); a task of your own is "
                        "named as 'package.module:object'")
    obj = _import(entry if isinstance(entry, str) else name, name) if not isinstance(entry, Task) else entry
    if isinstance(obj, type) and issubclass(obj, Task):
        try:
            obj = obj()
        except TypeError as e:  # abstract methods left out, or an __init__ that needs arguments
            raise TaskError(f"task {name!r}: {obj.__name__}() cannot be made: {e}") from None
    if not isinstance(obj, Task):
        raise TaskError(f"task {name!r}: {type(obj).__name__} {obj!r:.80} is not a ppo_ray.tasks.base.Task "
                        "(subclass it: docs/TASKS.md)")
    obj.check(named=name)
    return obj
