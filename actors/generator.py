"""Generator: vLLM rollouts with a hot-swapped LoRA version.

Plain class, no Ray: ppo_ray.driver.hosts hosts it in a Ray actor. One engine (a
``vllm.LLM``) serves the frozen base model; the policy's LoRA A/B tensors arrive from the
learner after every update (``load_adapter``) and every later ``generate`` samples with
them. How they get into the engine is the sync mode's (config ``lora_sync``: a class in
``actors.lora_sync`` that owns the engine arguments, the load and the prefix-cache
handling). The batch records the adapter version it was sampled with, so staleness is
checked, not assumed (verl #7495 and PR #3821 shipped rollouts from the base model silently).

What vLLM 0.32 does, read from its source and checked by tests/test_generator.py:

* EOS. The scheduler stops a request when its last sampled token is a stop token
  (``vllm/v1/core/sched/utils.py:check_stop``); the stop token stays in
  ``CompletionOutput.token_ids`` (only the text omits it), ``finish_reason`` is "stop",
  otherwise "length" at ``max_tokens``. We sample with ``ignore_eos=True`` plus
  ``stop_token_ids=[eos]`` so the tokenizer's EOS is the ONE stop token: with plain
  ``ignore_eos=False`` vLLM also stops on every ``eos_token_id`` listed in the model's
  generation_config.json (``SamplingParams.update_from_generation_config``), tokens the
  RolloutBatch mask (one ``eos_token_id``) would not know.
* Every token vLLM returns is real (``response_mask`` comes from its lengths, not from
  ``ids != pad``): a model can sample the pad token (an untrained one does), and
  it is then an action like any other. Consumers use ``response_mask``.
* Sampled-token logprobs. With the engine built with
  ``logprobs_mode="processed_logprobs"`` and ``SamplingParams(logprobs=0)``,
  ``Sampler.forward`` / ``TopKTopPSampler.forward_cpu`` (``vllm/v1/sample/sampler.py``,
  ``vllm/v1/sample/ops/topk_topp_sampler.py``) return exactly one entry per step: the
  sampled token's ``log_softmax(truncate_topk_topp(logits_f32 / temperature))``, which
  ``ppo_ray.logprobs.logprobs_from_logits`` reproduces.
* Prompt logprobs (``sequence_logprobs``) IGNORE temperature, top-k, top-p and the
  logprobs mode's "processed" part: ``GPUModelRunner._get_prompt_logprobs_dict``
  (``vllm/v1/worker/gpu_model_runner.py``, also the CPU runner's) computes
  ``log_softmax(logits, float32)`` of the raw logits ("prompt tokens skip sampling
  processors"). So they equal ``logprobs_from_logits(logits, tokens, temperature=1.0)``
  with no truncation. Requests with prompt logprobs skip reading the prefix cache.
* LoRA, and the prefix cache after a load: per sync mode, in ``actors.lora_sync``.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import Tensor

from ppo_ray.batch import RolloutBatch
from actors.lora_sync import sync_class
from ppo_ray.config import GENERATOR, MIN_TEMPERATURE, TRUNCATION_MODES, ConfigSlice, PPOConfig, role_fields
from ppo_ray.data import encode_prompts, fit_prompt
from ppo_ray.modeling import LoraWeights, load_tokenizer
from ppo_ray.paths import resolve_model_path
from ppo_ray.stats import SyncReport

if TYPE_CHECKING:
    from ppo_ray.environments import Episode, EpisodeLimits


PROBE_NEW_TOKENS = 4          # tokens each probe prompt samples (Generator.probe)
PROBE_SEED_STEP = 10**9 + 2  # the probe's sampling seeds' step index: no training or eval step uses it


def prompt_seed(run_seed: int, step: int, index: int) -> int:
    """Per-prompt sampling seed from (run seed, step, global prompt index).

    A hash, so that identical prompts in a batch get different samples, the same prompt
    index gets the same seed on any replica, and nearby (seed, step, index) triples are
    not correlated. 63 bits: fits the int64 of torch.Generator.manual_seed.
    """
    digest = hashlib.blake2b(f"{run_seed}:{step}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def segment_seed(run_seed: int, step: int, index: int, sample: int, segment: int) -> int:
    """The sampling seed of segment `segment` >= 1 of sample `sample` of prompt `index` under
    partial_rollout continue (segment 0 is the whole response's seed, prompt_seed): a hash
    like prompt_seed's, of its own domain."""
    digest = hashlib.blake2b(f"{run_seed}:{step}:{index}:{sample}:{segment}".encode(), digest_size=8,
                             person=b"ppo-ray-segment").digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def episode_limits(cfg: PPOConfig | ConfigSlice) -> "EpisodeLimits":
    """The config's episode limits (env_max_*; None = max_new_tokens)."""
    from ppo_ray.environments import EpisodeLimits

    budget = cfg.env_max_episode_tokens or cfg.max_new_tokens
    return EpisodeLimits(max_turns=cfg.env_max_turns, max_episode_tokens=budget,
                         max_turn_tokens=min(cfg.env_max_turn_tokens or budget, budget))


# How long a partial rollout waits for its next adapter version to be loaded (the driver loads
# every version into every replica after its step; a longer wait means the run has stopped).
VERSION_WAIT_S = 3600.0


def _default_adapter_root() -> str:
    # /dev/shm: adapters are written and read once per step; RAM, not disk.
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class Generator:
    """vLLM rollouts for PPO, with the current LoRA version.

    ``version`` is the adapter version generate() uses by default, the newest held: 0 = the
    base model (no adapter) until the first ``load_adapter``. ``versions`` are those held:
    one, or with max_staleness k up to k + 1 (adapter and tensor sync; generate(version=)).
    """

    # The config fields from_config reads: the generator actor gets only these (PPOConfig.slice;
    # each field declares its roles, ppo_ray.config.knob).
    CONFIG_FIELDS = role_fields(GENERATOR)

    def __init__(
        self,
        llm,
        tokenizer=None,
        *,
        model_dir: str | os.PathLike | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        max_new_tokens: int = 16,
        seed: int = 0,
        max_prompt_length: int = 512,
        prompt_truncation: str = "error",
        adapter_root: str | os.PathLike | None = None,
        lora_sync: str = "adapter",
        max_staleness: int = 0,
        streaming: bool = False,
        environment: Optional[str] = None,
        episode_limits: Optional["EpisodeLimits"] = None,
        env_runner: Any = None,
        env_failure: str = "error",
        env_failure_score: float = 0.0,
    ):
        """``llm``: a ``vllm.LLM`` built with logprobs_mode="processed_logprobs"
        (actors.vllm_engine.build_llm) and the engine arguments of the sync mode ``lora_sync``
        (actors.lora_sync: ``adapter``, enable_lora=True, a LoRARequest per version, the
        engine may be shared; ``merged``, the LoRA merged into the engine's own weights, the
        engine is this generator's alone).
        ``tokenizer``: the HF tokenizer of the model (loaded from ``model_dir`` if None).
        ``model_dir``: the base model directory (default: the one the engine serves).
        The LoRA rank, alpha and targets are not set here: they come with each adapter's
        weights (LoraWeights.spec, load_adapter).
        ``environment``: a multi-turn environment (config.environment; generate_episodes), with
        ``episode_limits``, ``env_runner`` (where its calls run: the environment workers, an
        ppo_ray.environments.EnvRunner; None = this process) and the failure policy
        (reward_failure, reward_failure_score).
        """
        model_config = llm.llm_engine.model_config
        if model_config.logprobs_mode != "processed_logprobs":
            raise ValueError(
                f"the vLLM engine has logprobs_mode={model_config.logprobs_mode!r}; the generator needs "
                "'processed_logprobs' (logprobs of the distribution actually sampled from)")
        mode = sync_class(lora_sync)  # a ValueError naming an unknown mode
        mode.check_engine(llm)
        lora_config = llm.llm_engine.vllm_config.lora_config
        # a mode that holds several versions keeps the k + 1 of the batches in flight alive (one
        # that holds one runs its batches one after another; the config refuses k >= 2 for it)
        alive = mode.capabilities.versions_alive(max_staleness)
        if alive > 1 and lora_config is not None and lora_config.max_loras < alive:
            raise ValueError(f"max_staleness {max_staleness} needs {max_staleness + 1} adapter versions alive, but the "
                             f"vLLM engine holds {lora_config.max_loras if lora_config else 1} (max_loras)")
        if temperature < MIN_TEMPERATURE:  # vLLM clamps or samples greedily below it (ppo_ray.config)
            raise ValueError(f"temperature must be >= {MIN_TEMPERATURE} for PPO sampling, got {temperature}")
        if prompt_truncation not in TRUNCATION_MODES:
            raise ValueError(f"prompt_truncation must be one of {list(TRUNCATION_MODES)}, got {prompt_truncation!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")

        self.llm = llm
        self.model_dir = str(model_dir) if model_dir is not None else str(model_config.model)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.model_dir)
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self.eos_token_id = int(self.tokenizer.eos_token_id)
        self.vocab_size = int(model_config.get_vocab_size())
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.max_new_tokens = int(max_new_tokens)
        self.seed = int(seed)
        self.max_prompt_length = int(max_prompt_length)
        self.prompt_truncation = prompt_truncation

        # The sync mode's files (adapter mode: every version in its own subdirectory of this
        # one; at most one exists at a time, the current one).
        self.adapter_root = Path(tempfile.mkdtemp(prefix="ppo_ray_adapters_", dir=adapter_root or _default_adapter_root()))
        self.sync = mode(llm, self.model_dir, self.adapter_root)  # the LoRA sync mode (actors.lora_sync)
        # streaming: one thread owns the engine and runs every caller's batches at once
        # (actors.engine_loop); otherwise each generate() is one llm.generate, a barrier
        self._loop = None
        if streaming:
            from actors.engine_loop import EngineLoop
            from vllm.platforms import current_platform

            if not mode.capabilities.streams:
                raise ValueError(f"lora_sync={lora_sync!r} holds one set of weights: it cannot stream batches of "
                                 "several adapter versions")
            scheduler = llm.llm_engine.vllm_config.scheduler_config
            if current_platform.is_cpu() and scheduler.enable_chunked_prefill:
                raise ValueError("a streaming generator on the CPU needs an engine built with "
                                 "enable_chunked_prefill=False (vLLM's CPU runner crashes on a seeded request "
                                 "whose prefill is chunked)")
            self.sync.streaming = True
            self._loop = EngineLoop(llm.llm_engine)
        # the versions held, as the last load left them, for partial rollouts waiting on one
        # (set on the engine's thread, read under the condition by the actor's other threads)
        self._held_changed = threading.Condition()
        self._held_now: frozenset = frozenset(self.versions)
        self._waiting: list[int] = []  # the versions partial rollouts wait for now, one entry per waiting call
        self._closed = False
        # multi-turn episodes (generate_episodes)
        from ppo_ray.environments import FAILURES, EpisodeLimits

        if env_failure not in FAILURES:
            raise ValueError(f"env_failure {env_failure!r} must be one of {list(FAILURES)}")
        self.environment = environment
        self.episode_limits = episode_limits or EpisodeLimits(max_episode_tokens=self.max_new_tokens,
                                                              max_turn_tokens=self.max_new_tokens)
        self.env_runner, self.env_failure, self.env_failure_score = env_runner, env_failure, float(env_failure_score)
        self._episode_calls = itertools.count()

    @classmethod
    def from_config(cls, cfg: PPOConfig | ConfigSlice, model_dir: str | os.PathLike | None = None,
                    env_runner: Any = None, **engine_overrides: Any) -> "Generator":
        """Build the engine (actors.vllm_engine.build_llm) and the generator from a PPOConfig.

        ``model_dir`` defaults to the resolved ``cfg.model_name``. ``env_runner``: where the
        environment's calls run (the host's environment workers; None = here). ``engine_overrides``
        go to build_llm / vllm.LLM unchanged.
        """
        from actors.vllm_engine import build_llm
        from vllm.platforms import current_platform

        model_dir = str(model_dir) if model_dir is not None else resolve_model_path(cfg.model_name)
        engine: dict[str, Any] = dict(
            dtype=cfg.dtype, seed=cfg.seed, max_model_len=cfg.max_prompt_length + cfg.max_new_tokens,
            kv_cache_gib=cfg.vllm_kv_cache_gib, logprobs_mode="processed_logprobs",
            enforce_eager=cfg.vllm_enforce_eager,
            use_tqdm_on_load=cfg.log_level == "debug",  # the weight loader's progress bar
        )
        mode = sync_class(cfg.lora_sync_mode)
        engine.update(mode.engine_args(cfg.lora_r, versions=mode.capabilities.versions_alive(cfg.max_staleness)))
        if cfg.streams_rollouts and current_platform.is_cpu():
            engine["enable_chunked_prefill"] = False  # actors.engine_loop
        if not current_platform.is_cpu() and cfg.vllm_kv_cache_gib is None:
            # On the CPU this fraction would be of host memory: there build_llm's KV size rules.
            engine["gpu_memory_utilization"] = cfg.vllm_gpu_memory_utilization
        engine.update(engine_overrides)
        llm = build_llm(model_dir, **engine)
        return cls(
            llm, model_dir=model_dir,
            temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
            seed=cfg.seed, max_prompt_length=cfg.max_prompt_length, prompt_truncation=cfg.prompt_truncation,
            lora_sync=cfg.lora_sync_mode, max_staleness=cfg.max_staleness, streaming=cfg.streams_rollouts,
            environment=cfg.environment, episode_limits=episode_limits(cfg), env_runner=env_runner,
            env_failure=cfg.reward_failure, env_failure_score=cfg.reward_failure_score,
        )

    @property
    def version(self) -> int:
        """The newest adapter version held (0 = the base model, before any load)."""
        return self.versions[-1]

    @property
    def versions(self) -> list[int]:
        """The adapter versions held, ascending ([0], the base model, before any load)."""
        return self.sync.versions or [0]

    def _lora_request(self, version: Optional[int]):
        """What vLLM samples `version` with (None = the newest held); a KeyError naming the
        held versions when it is not held."""
        if version is None or (version == 0 and not self.sync.versions):
            return self.sync.lora_request
        return self.sync.request(version)

    # ------------------------------------------------------------------ prompts
    def _encode(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> tuple[list[list[int]], list[str]]:
        """Validated prompt token ids and texts. Texts go through encode_prompts; id lists
        are checked (non-empty, in-vocab ints) and length-limited by the same rule."""
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts: the prompt list is empty")
        if all(isinstance(p, str) for p in prompts):
            return encode_prompts(self.tokenizer, prompts, self.max_prompt_length, self.prompt_truncation), prompts
        ids_list: list[list[int]] = []
        for i, p in enumerate(prompts):
            if isinstance(p, str) or not isinstance(p, (list, tuple)):
                raise ValueError(f"prompt {i} is a {type(p).__name__}: pass all prompts as str or all as lists of token ids")
            ids = [int(t) for t in p]
            if not ids:
                raise ValueError(f"prompt {i} has no tokens")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
            ids_list.append(fit_prompt(ids, self.max_prompt_length, self.prompt_truncation, i))
        return ids_list, self.tokenizer.batch_decode(ids_list)

    # ------------------------------------------------------------------ rollouts
    def sampling_params(self, seed: int, probe: bool = False, n: int = 1, max_tokens: Optional[int] = None,
                        greedy: bool = False, stop: Sequence[str] = ()):
        """vLLM SamplingParams for one prompt: the PPO sampling settings and its own seed, `n`
        samples (vLLM gives sample j the seed `seed + j`: vllm/v1/engine/parallel_sampling.py),
        `max_tokens` (default max_new_tokens). `probe` (the sync check, see probe()): the same
        temperature with no top-k/top-p, and PROBE_NEW_TOKENS tokens. `greedy` (evaluation
        only, e.g. pass@1): temperature 0, vLLM's argmax decoding; its logprobs are then not the
        PPO sampling distribution's, so rollouts never use it. `stop`: strings that also end the
        response (an episode's model turn), kept in it; vLLM then detokenizes to find them."""
        from vllm import SamplingParams

        if max_tokens is None:
            max_tokens = min(PROBE_NEW_TOKENS, self.max_new_tokens) if probe else self.max_new_tokens
        return SamplingParams(
            n=n, temperature=0.0 if greedy else self.temperature, top_k=0 if probe or self.top_k <= 0 else self.top_k,
            top_p=1.0 if probe else self.top_p, max_tokens=max_tokens, seed=seed,
            logprobs=0,  # just the sampled token's (processed) logprob
            ignore_eos=True, stop_token_ids=[self.eos_token_id],  # the tokenizer's EOS is the one stop token
            detokenize=bool(stop),  # we decode with the HF tokenizer, once, below (stop strings need vLLM's)
            stop=list(stop) or None, include_stop_str_in_output=bool(stop),
        )

    def probe(self, prompt_ids: Sequence[Sequence[int]], version: Optional[int] = None) -> RolloutBatch:
        """The sync check's probe (ppo_ray.trainer): sample the fixed probe prompts with the
        weights the engine holds now, at the PPO temperature without truncation, so that each
        sampled token's logprob is the full tempered softmax's, which the learner recomputes
        at the same version (Learner.sync_gap). Fixed seeds: the same weights give the same
        tokens on every replica."""
        return self.generate(prompt_ids, step=PROBE_SEED_STEP, probe=True, version=version)

    @torch.no_grad()
    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], step: int, prompt_offset: int = 0,
                 probe: bool = False, samples_per_prompt: int = 1, version: Optional[int] = None,
                 segment_versions: Optional[Sequence[int]] = None, segment_tokens: int = 0,
                 greedy: bool = False) -> RolloutBatch:
        """Sample `samples_per_prompt` (n) responses per prompt with adapter `version` (one held;
        None = the newest), in one vLLM request per prompt (SamplingParams(n=n): the prompt is
        prefilled once).

        ``prompts``: N texts, or N lists of token ids. ``step`` and ``prompt_offset``
        (this batch's first global prompt index, for replica splits) fix the per-prompt
        seeds: the same (seed, step, global index) gives the same responses anywhere.

        Returns a RolloutBatch of B = N * n rows, the n samples of a prompt contiguous (rows
        i*n .. i*n+n-1 are prompt i's): prompt_ids (B, P) left-padded, response_ids (B, T)
        right-padded with pad (T = the longest response), response_mask True up to and
        including EOS, gen_logprobs (B, T) float32 (0 on padding), adapter_version, and
        groups (B,): each row's global prompt index (prompt_offset + i), so groups stay
        distinct when the replicas' batches are concatenated.

        Partial rollouts (config partial_rollout continue): with `segment_versions` [v_0, v_1,
        ...] (v_0 = `version`, ascending) and 0 < `segment_tokens` < max_new_tokens, a response's
        tokens [j c, (j + 1) c) (c = segment_tokens) are sampled with v_j (the last one for
        every later j): a response still going after its segment is submitted again, prompt +
        its tokens so far, with the next version and its own seed (segment_seed), waiting
        until that version is loaded if it is not yet. The batch records each token's version
        (token_versions). Needs a streaming generator (others run while one waits).

        ``greedy``: argmax decoding (temperature 0) for evaluation (sampling_params).
        """
        from vllm.inputs import TokensPrompt

        self._check_open()
        n = int(samples_per_prompt)
        if n < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        prompt_ids, prompt_texts = self._encode(prompts)
        lora_request = self._lora_request(version)
        version = self.version if version is None else version
        schedule = self._schedule(version, segment_versions, segment_tokens)
        if greedy and (probe or schedule or n > 1):
            raise ValueError("greedy decoding is for evaluation, one sample per prompt: not with the probe, a "
                             f"partial rollout or samples_per_prompt {n} > 1 (vLLM's greedy sampling takes n = 1)")
        params = [self.sampling_params(prompt_seed(self.seed, step, prompt_offset + i), probe, n,
                                       max_tokens=segment_tokens if schedule else None, greedy=greedy)
                  for i in range(len(prompt_ids))]
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
        outputs = self._run(requests, params, lora_request, prompt_ids, n)

        rows: list[list] = []  # [prompt index, sample index, token ids, logprobs, finish reason], n per prompt in order
        for i, out in enumerate(outputs):
            if len(out.outputs) != n:
                raise RuntimeError(f"vLLM returned {len(out.outputs)} samples for prompt {prompt_offset + i}, "
                                   f"asked for {n}")
            rows += [[i, c.index, *self._completion(c, prompt_offset + i)]
                     for c in sorted(out.outputs, key=lambda c: c.index)]
        token_versions = None
        if schedule:
            token_versions = [[version] * len(row[2]) for row in rows]
            self._continue(rows, token_versions, prompt_ids, step, prompt_offset, schedule, segment_tokens)
        responses = [row[2] for row in rows]
        finish_reasons = [row[4] for row in rows]
        texts = self.tokenizer.batch_decode([r[:-1] if fr == "stop" else r for r, fr in zip(responses, finish_reasons)],
                                            skip_special_tokens=True)
        # vLLM stops at the first EOS: every returned token is real
        prompt_of = [row[0] for row in rows]  # each row's prompt (n contiguous rows per prompt)
        batch = RolloutBatch.from_tokens([prompt_ids[i] for i in prompt_of], responses, self.pad_token_id,
                                         self.eos_token_id, gen_logprobs=[row[3] for row in rows],
                                         adapter_version=version, groups=[prompt_offset + i for i in prompt_of],
                                         token_versions=token_versions,
                                         prompts=[prompt_texts[i] for i in prompt_of], responses=texts,
                                         finish_reasons=finish_reasons)
        if not torch.isfinite(batch.gen_logprobs).all():
            raise RuntimeError("vLLM returned a non-finite logprob for a sampled token")
        return batch

    # ------------------------------------------------------------------ multi-turn episodes
    def generate_episodes(self, prompts: Sequence[str] | Sequence[Sequence[int]], step: int, prompt_offset: int = 0,
                          samples_per_prompt: int = 1, version: Optional[int] = None,
                          segment_versions: Optional[Sequence[int]] = None, segment_tokens: int = 0,
                          greedy: bool = False, *, rows: Optional[Sequence[dict]] = None,
                          environment: Optional[str] = None, limits: Optional["EpisodeLimits"] = None,
                          ) -> tuple[RolloutBatch, list["Episode"]]:
        """One episode per prompt and sample with the environment (ppo_ray.environments: the
        contract and the loop; `environment`/`limits` default to the generator's own, from the
        config): model turns sampled with adapter `version` (None = the newest), each from the
        exact token ids so far, the observations tokenised once and appended as environment
        tokens; `samples_per_prompt` (n) episodes per prompt, contiguous rows as generate's.
        `rows`: each prompt's dataset row (all its columns), which its environments are reset
        with ({} each when None). The environments run on the generator's environment workers
        (env_workers) or, without them, here. Sample s of prompt i: its environment is reset with
        (rows[i], prompt_seed + s), its first turn sampled with that seed (vLLM's seed of a
        prompt's sample s) and its turn j >= 1 with segment_seed(run seed, step, i, s, j): the
        same step replays the same episodes. `greedy`: argmax turns (evaluation).

        An environment call that fails (raises, breaks the contract, or runs past env_timeout_s
        on a worker) follows reward_failure: error raises EnvError naming the episode; score
        gives the episode reward_failure_score, drop NaN (masked out by the learner).

        Returns the RolloutBatch (one row per episode: the whole transcript after the prompt is
        the response; env_mask on the observations; gen_logprobs the sampled tokens', 0 on the
        environment's; env_rewards each episode's score; ended and the finish reason "stop"
        where the episode ended on its own (done, or EOS), else "length"; groups as generate's)
        and the episodes (turns, tool calls, how each ended, the transcript's segments)."""
        from vllm.inputs import TokensPrompt

        from ppo_ray.environments import LocalEnvRunner, Turn, load_environment, run_episodes

        self._check_open()
        if segment_versions is not None:  # (segment_tokens alone means nothing: it is read with them)
            raise ValueError("partial rollouts (partial_rollout continue) are not supported with an environment")
        environment = environment or self.environment
        if environment is None:
            raise ValueError("generate_episodes needs an environment (config.environment)")
        make_env = load_environment(environment)
        limits = (limits or self.episode_limits).of(make_env)
        prompt_ids, prompt_texts = self._encode(prompts)
        rows = [{} for _ in prompt_ids] if rows is None else list(rows)
        if len(rows) != len(prompt_ids):
            raise ValueError(f"generate_episodes: {len(rows)} rows for {len(prompt_ids)} prompts")
        lora_request = self._lora_request(version)
        version = self.version if version is None else version
        if limits.max_episode_tokens > self.max_new_tokens:
            raise ValueError(f"max_episode_tokens {limits.max_episode_tokens} > max_new_tokens {self.max_new_tokens}: "
                             "an episode's tokens after the prompt must fit the engine's context")

        def sample(requests: list) -> list[Turn]:
            params = [self.sampling_params(seed, max_tokens=max_tokens, stop=stops, greedy=greedy)
                      for _, seed, max_tokens, stops in requests]
            ids = [r[0] for r in requests]
            outputs = self._run([TokensPrompt(prompt_token_ids=x) for x in ids], params, lora_request, ids, 1)
            turns = []
            for k, out in enumerate(outputs):
                c = out.outputs[0]
                if c.finish_reason == "stop" and isinstance(c.stop_reason, str):  # a stop string, kept in the text
                    got = list(c.token_ids)
                    if c.logprobs is None or len(c.logprobs) != len(got) or self.eos_token_id in got:
                        raise RuntimeError(f"vLLM returned a bad stop-string turn for episode {prompt_offset + k}")
                    turns.append(Turn(got, [lp[t].logprob for t, lp in zip(got, c.logprobs)], "stop_string"))
                else:
                    turns.append(Turn(*self._completion(c, prompt_offset + k)))
            return turns

        n = int(samples_per_prompt)
        if n < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        of = [(i, s) for i in range(len(prompt_ids)) for s in range(n)]  # each episode's (prompt, sample)
        seeds = [prompt_seed(self.seed, step, prompt_offset + i) + s for i, s in of]
        own_workers = environment == self.environment and self.env_runner is not None
        runner = self.env_runner if own_workers else LocalEnvRunner(make_env)
        call = f"{os.getpid()}-{next(self._episode_calls)}"  # keys unique among the episodes alive on the workers
        episodes = run_episodes(
            [prompt_ids[i] for i, _ in of], [rows[i] for i, _ in of], seeds, runner, sample,
            encode=lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), limits=limits,
            turn_seed=lambda e, turn: (segment_seed(self.seed, step, prompt_offset + of[e][0], of[e][1], turn)
                                       if turn else seeds[e]),
            failure=self.env_failure, keys=[f"{call}/prompt-{prompt_offset + i}/sample-{s}" for i, s in of])
        failed_score = self.env_failure_score if self.env_failure == "score" else math.nan
        batch = RolloutBatch.from_tokens(
            [prompt_ids[i] for i, _ in of], [ep.ids for ep in episodes], self.pad_token_id, self.eos_token_id,
            gen_logprobs=[ep.logprobs for ep in episodes], adapter_version=version,
            groups=[prompt_offset + i for i, _ in of], env_masks=[ep.env for ep in episodes],
            env_rewards=[failed_score if ep.end == "failed" else ep.score for ep in episodes],
            ended=[ep.ended for ep in episodes],
            prompts=[prompt_texts[i] for i, _ in of], finish_reasons=["stop" if ep.ended else "length"
                                                                    for ep in episodes],
            responses=[self.tokenizer.decode([t for t in ep.ids if t != self.eos_token_id], skip_special_tokens=True)
                       for ep in episodes])
        if not torch.isfinite(batch.gen_logprobs).all():
            raise RuntimeError("vLLM returned a non-finite logprob for a sampled token")
        return batch, episodes

    def _completion(self, c, index: int) -> tuple[list[int], list[float], str]:
        """One vLLM CompletionOutput's (token ids, their logprobs, finish reason), checked."""
        ids = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} logprobs for "
                               f"{len(ids)} tokens of prompt {index}")
        # logprobs=0: each step's dict holds exactly the sampled token.
        lps = [step_lps[tok].logprob for tok, step_lps in zip(ids, c.logprobs)]
        if self.eos_token_id in ids[:-1]:
            raise RuntimeError(f"vLLM generated past EOS for prompt {index}")
        ended = bool(ids) and ids[-1] == self.eos_token_id
        if c.finish_reason not in ("stop", "length") or (c.finish_reason == "stop") != ended:
            raise RuntimeError(f"prompt {index}: vLLM finish_reason={c.finish_reason!r} but "
                               f"response {'ends' if ended else 'does not end'} with EOS")
        return ids, lps, c.finish_reason

    # ------------------------------------------------------------------ partial rollouts
    def _schedule(self, version: int, segment_versions: Optional[Sequence[int]], segment_tokens: int) -> list[int]:
        """The checked per-segment versions of a partial rollout, [] when the batch samples with
        `version` alone (no schedule, a schedule of one version, or segments as long as a response)."""
        if segment_versions is None:
            return []
        schedule = [int(v) for v in segment_versions]
        if not schedule or schedule[0] != version or any(b < a for a, b in zip(schedule, schedule[1:])):
            raise ValueError(f"segment_versions {schedule} must start at the batch's version {version} and not "
                             "decrease")
        if segment_tokens < 1:
            raise ValueError(f"segment_tokens must be >= 1 with segment_versions, got {segment_tokens}")
        if len(set(schedule)) == 1 or segment_tokens >= self.max_new_tokens:
            return []
        if self._loop is None:
            raise ValueError("partial rollouts need a streaming generator (Generator(streaming=True)): a response "
                             "waiting for its next version would block every other batch")
        return schedule

    def _continue(self, rows: list[list], token_versions: list[list[int]], prompt_ids: Sequence[Sequence[int]],
                  step: int, prompt_offset: int, schedule: list[int], segment_tokens: int) -> None:
        """Partial rollouts: segment after segment, every response cut at its segment's length
        (finish reason length before max_new_tokens) goes on with the next segment's version
        (generate's docstring); `rows` and `token_versions` grow in place."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        segment = 1
        while True:
            going = [r for r, row in enumerate(rows) if row[4] == "length" and len(row[2]) < self.max_new_tokens]
            if not going:
                return
            version = schedule[min(segment, len(schedule) - 1)]
            self._wait_for_version(version)
            lora_request = self._lora_request(version)
            requests = []
            for r in going:
                i, sample, ids = rows[r][:3]
                params = self.sampling_params(segment_seed(self.seed, step, prompt_offset + i, sample, segment),
                                              max_tokens=min(segment_tokens, self.max_new_tokens - len(ids)))
                params.output_kind = RequestOutputKind.FINAL_ONLY
                requests.append((TokensPrompt(prompt_token_ids=[*prompt_ids[i], *ids]), params, lora_request))
            for r, out in zip(going, self._loop.run(requests)):
                ids, lps, finish_reason = self._completion(out.outputs[0], prompt_offset + rows[r][0])
                rows[r][2] = rows[r][2] + ids
                rows[r][3] = rows[r][3] + lps
                rows[r][4] = finish_reason
                token_versions[r] += [version] * len(ids)
            segment += 1

    def _wait_for_version(self, version: int) -> None:
        """Block until adapter `version` is held (the driver loads every version into every
        replica after its step), at most VERSION_WAIT_S."""
        deadline = time.monotonic() + VERSION_WAIT_S
        with self._held_changed:
            self._waiting.append(version)
            try:
                while version not in self._held_now:
                    self._check_open()
                    if version < min(self._held_now):
                        raise RuntimeError(f"adapter version {version} was retired before a partial rollout that "
                                           f"needs it went on (held: {sorted(self._held_now)})")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"a partial rollout waited {VERSION_WAIT_S:.0f} s for adapter version "
                                           f"{version} (held: {sorted(self._held_now)})")
                    self._held_changed.wait(timeout=min(left, 5.0))
            finally:
                self._waiting.remove(version)

    @property
    def waiting_for(self) -> list[int]:
        """The adapter versions that partial rollouts are waiting for now (one entry per waiting
        generate call, ascending)."""
        with self._held_changed:
            return sorted(self._waiting)

    def _note_held(self) -> None:
        """After a load or retire: wake the partial rollouts waiting for a version."""
        with self._held_changed:
            self._held_now = frozenset(self.versions)
            self._held_changed.notify_all()

    def _run(self, requests: list, params: list, lora_request, prompt_ids: Sequence[Sequence[int]], n: int) -> list:
        """vLLM's final RequestOutputs of `requests`, in order: streamed into the engine with
        whatever else runs there (streaming), or one llm.generate per prefill group."""
        if self._loop is not None:
            from vllm.sampling_params import RequestOutputKind

            final = []
            for p in params:
                p = p.clone()
                p.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when it finishes
                final.append(p)
            return self._loop.run([(r, p, lora_request) for r, p in zip(requests, final)])
        outputs = []
        for start, end in self._prefill_groups(prompt_ids, n):
            outputs += self.llm.generate(requests[start:end], params[start:end], use_tqdm=False,
                                         lora_request=lora_request)
        return outputs

    @torch.no_grad()
    def _prefill_groups(self, prompt_ids: Sequence[Sequence[int]], n: int = 1) -> list[tuple[int, int]]:
        """Split the batch so each llm.generate call's prompts prefill in ONE engine step.

        vLLM 0.32's CPU runner crashes ("CPU Generator does not use offset", then
        EngineDeadError) when a request with its own seed has its prefill chunked across
        steps (gpu_model_runner._bookkeeping_sync rewinds the seeded generator's offset,
        which CPU generators do not have). Keeping each call's prompt tokens within the
        scheduler's max_num_batched_tokens avoids chunking; the per-prompt seeds make the
        samples independent of the grouping. A prompt sampled n times is n requests to the
        scheduler (vLLM fans SamplingParams(n) out into n child requests), so it counts n times.
        """
        budget = self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        groups, start, total = [], 0, 0
        for i, ids in enumerate(prompt_ids):
            if i > start and total + n * len(ids) > budget:
                groups.append((start, i))
                start, total = i, 0
            total += n * len(ids)
        groups.append((start, len(prompt_ids)))
        return groups

    def sequence_logprobs(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int]) -> Tensor:
        """The current policy's logprobs of a FIXED continuation: (len(continuation),) float32.

        Via vLLM prompt logprobs, which are ``log_softmax(raw logits)`` at temperature 1 with
        no top-k/top-p, whatever the sampling settings (see the module docstring); compare
        with ``logprobs_from_logits(logits, tokens, temperature=1.0)``. Used to verify that
        an adapter sync really changed what the engine computes.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_open()
        prompt_ids, continuation_ids = [int(t) for t in prompt_ids], [int(t) for t in continuation_ids]
        if not prompt_ids or not continuation_ids:
            raise ValueError("sequence_logprobs needs a non-empty prompt and continuation")
        ids = prompt_ids + continuation_ids
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, seed=0)
        out = self._run([TokensPrompt(prompt_token_ids=ids)], [params], self.sync.lora_request, [ids], 1)[0]
        # prompt_logprobs[j] is a dict {ids[j]: Logprob} for j >= 1 (None for the first token).
        rows = out.prompt_logprobs[len(prompt_ids):]
        return torch.tensor([row[tok].logprob for tok, row in zip(continuation_ids, rows)], dtype=torch.float32)

    # ------------------------------------------------------------------ LoRA sync
    def load_adapter(self, version: int, weights: LoraWeights, *, restore: bool = False,
                     retire_below: Optional[int] = None) -> SyncReport:
        """Make LoRA ``version`` current, by the sync mode (``self.sync``, actors.lora_sync).

        ``weights``: the learner's adapter (Learner.lora_weights): PEFT
        ``get_peft_model_state_dict(model)`` tensors (adapter_model.safetensors keys, e.g.
        ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``: A (r, in),
        B (out, r)) and the spec (r, lora_alpha, targets) that says what they mean: the
        adapter_config.json and the merge's scaling come from it. ``version`` must be above
        the current one.

        Returns the mode's SyncReport (seconds: adapter mode, write_s = safetensors +
        adapter_config.json into a /dev/shm temp dir, register_s = engine add_lora, the
        worker reads and validates it, retire_s = remove the previous adapter and its files
        and reset the prefix cache; and the bytes). A failing load leaves the previous
        version current. ``restore=True`` accepts any version >= 0 (the trainer rolling back
        to a checkpoint after a learner restart, or giving a restarted replica the versions
        that batches in flight need). ``retire_below``: first retire the held versions outside
        [retire_below, version] (max_staleness: no batch in flight needs them; a restore that
        starts afresh at `version` passes `version`).
        """
        self._check_open()
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"adapter version {version!r} is not an int >= 0")
        if version <= self.version and not restore:
            raise ValueError(f"adapter version {version!r} is not newer than the current version {self.version}: "
                             "versions must increase strictly (a stale or repeated sync)")
        weights = self._check_lora_weights(weights)

        def load() -> SyncReport:
            try:
                if retire_below is not None:
                    self.sync.retire([v for v in self.sync.versions if not retire_below <= v <= version])
                return self.sync.load(version, weights)
            finally:
                self._note_held()

        # streaming: between two engine steps, on the engine's thread
        return self._loop.call(load) if self._loop is not None else load()

    def _check_lora_weights(self, weights: LoraWeights) -> LoraWeights:
        """The adapter with CPU, contiguous copies of its A/B tensors; their rank must be the
        spec's r (vLLM scales by lora_alpha / r from adapter_config.json, so a rank mismatch
        would be silent), and one the sync mode's engine takes (adapter mode: at most its
        max_lora_rank)."""
        r = weights.spec.r
        if not weights.tensors:
            raise ValueError("load_adapter got no LoRA weights")
        self.sync.check_rank(r)
        out: dict[str, Tensor] = {}
        for k, v in weights.tensors.items():
            if not isinstance(v, Tensor):
                raise ValueError(f"LoRA weight {k!r} is a {type(v).__name__}, not a tensor")
            if k.endswith("lora_A.weight"):
                rank = v.shape[0]
            elif k.endswith("lora_B.weight"):
                rank = v.shape[1]
            else:
                raise ValueError(f"unexpected LoRA weight {k!r}: expected PEFT lora_A/lora_B keys "
                                 "(get_peft_model_state_dict)")
            if v.ndim != 2 or rank != r:
                raise ValueError(f"LoRA weight {k!r} has shape {tuple(v.shape)}, not rank lora_r={r} (its spec)")
            if not torch.isfinite(v).all():
                raise ValueError(f"LoRA weight {k!r} has non-finite values")
            out[k] = v.detach().to("cpu").contiguous()
        return LoraWeights(out, weights.spec)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Generator is closed")

    def close(self) -> None:
        """Release the sync mode's hold on the engine (adapter mode: retire the current
        adapter) and delete the adapter directory. The engine is not shut down (it may be
        shared); the generator cannot be used afterwards."""
        if self._loop is not None:
            self._loop.call(self.sync.close)
            self._loop.close()
        else:
            self.sync.close()
        shutil.rmtree(self.adapter_root, ignore_errors=True)
        self._closed = True
        self._note_held()  # a partial rollout waiting for a version fails
