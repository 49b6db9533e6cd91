"""Generator: vLLM rollouts with a hot-swapped LoRA adapter (the `adapter` sync mode).

Plain class, no Ray: ppo_ray.placement hosts it in a Ray actor. One engine (a
``vllm.LLM``) serves the frozen base model; the policy's LoRA A/B tensors arrive from the
learner after every update (``load_adapter``) and every later ``generate`` samples with
them. The batch records the adapter version it was sampled with, so staleness is checked,
not assumed (verl #7495 and PR #3821 shipped rollouts from the base model silently).

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
* LoRA. ``llm.llm_engine.add_lora`` loads and validates the adapter in the worker
  (``LRUCacheWorkerLoRAManager.add_adapter`` -> ``_load_adapter``: missing files,
  unexpected modules or a rank above ``max_lora_rank`` raise there), so a broken adapter
  fails in ``load_adapter``, not silently at the next generate. Requests then find it in
  the cache by ``lora_int_id`` and do not reread the files; the prefix-cache key includes
  the adapter's name and path, so KV blocks never leak across versions.
* Merged sync (``lora_sync="merged"``) changes the engine's weights in place, under a
  prefix cache whose keys know nothing of them: every load resets the cache (in both
  modes, see ``_reset_prefix_cache``; counted in ``retire_s``), so no KV block outlives the
  weights it was made with.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from ppo_ray.batch import RolloutBatch
from ppo_ray.config import MIN_TEMPERATURE, TRUNCATION_MODES, VLLM_LORA_RANKS, ConfigSlice, PPOConfig
from ppo_ray.data import encode_prompts, fit_prompt
from ppo_ray.modeling import LoraWeights, load_tokenizer, resolve_model_path, write_lora_adapter

# vLLM worker extension that merges LoRA weights in place (lora_sync="merged").
MERGED_WORKER = "actors.vllm_merge.MergedLoRAWorker"

# LoRA int ids must be unique per engine, and an engine may be shared by several
# Generators in one process (the tests do): a per-process counter, not per instance.
_LORA_IDS = itertools.count(1)


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


def _default_adapter_root() -> str:
    # /dev/shm: adapters are written and read once per step; RAM, not disk.
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class Generator:
    """vLLM rollouts for PPO, with the current LoRA version.

    ``version`` is the adapter version generate() uses now: 0 = the base model (no
    adapter) until the first ``load_adapter``.
    """

    # The config fields from_config reads: the generator actor gets only these (PPOConfig.slice).
    CONFIG_FIELDS = ("model_name", "dtype", "seed", "log_level", "max_prompt_length", "prompt_truncation",
                     "max_new_tokens", "temperature", "top_k", "top_p", "lora_r", "lora_sync", "vllm_kv_cache_gib",
                     "vllm_enforce_eager", "vllm_gpu_memory_utilization")

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
    ):
        """``llm``: a ``vllm.LLM`` built with logprobs_mode="processed_logprobs"
        (actors.vllm_engine.build_llm), and either enable_lora=True (``lora_sync="adapter"``:
        a LoRARequest per version; the engine may be shared) or
        worker_extension_cls=MERGED_WORKER (``lora_sync="merged"``: the LoRA is merged into
        the engine's own weights; the engine is this generator's alone).
        ``tokenizer``: the HF tokenizer of the model (loaded from ``model_dir`` if None).
        ``model_dir``: the base model directory (default: the one the engine serves).
        The LoRA rank, alpha and targets are not set here: they come with each adapter's
        weights (LoraWeights.spec, load_adapter).
        """
        model_config = llm.llm_engine.model_config
        if model_config.logprobs_mode != "processed_logprobs":
            raise ValueError(
                f"the vLLM engine has logprobs_mode={model_config.logprobs_mode!r}; the generator needs "
                "'processed_logprobs' (logprobs of the distribution actually sampled from)")
        if lora_sync not in ("adapter", "merged"):
            raise ValueError(f"lora_sync must be 'adapter' or 'merged', got {lora_sync!r}")
        if lora_sync == "adapter" and llm.llm_engine.vllm_config.lora_config is None:
            raise ValueError("the vLLM engine was built without enable_lora=True: it cannot take adapters")
        if lora_sync == "merged" and llm.llm_engine.vllm_config.parallel_config.worker_extension_cls != MERGED_WORKER:
            raise ValueError(f"lora_sync='merged' needs an engine built with worker_extension_cls={MERGED_WORKER!r}")
        if temperature < MIN_TEMPERATURE:  # vLLM clamps or samples greedily below it (ppo_ray.config)
            raise ValueError(f"temperature must be >= {MIN_TEMPERATURE} for PPO sampling, got {temperature}")
        if prompt_truncation not in TRUNCATION_MODES:
            raise ValueError(f"prompt_truncation must be one of {list(TRUNCATION_MODES)}, got {prompt_truncation!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.lora_sync = lora_sync

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

        # Every adapter version lives in its own subdirectory of this one; at most one
        # exists at a time (the current one).
        self.adapter_root = Path(tempfile.mkdtemp(prefix="ppo_ray_adapters_", dir=adapter_root or _default_adapter_root()))
        self.version = 0
        self._lora_request = None  # vllm LoRARequest of the current version; None = base model
        self._closed = False

    @classmethod
    def from_config(cls, cfg: PPOConfig | ConfigSlice, model_dir: str | os.PathLike | None = None, **engine_overrides: Any) -> "Generator":
        """Build the engine (actors.vllm_engine.build_llm) and the generator from a PPOConfig.

        ``model_dir`` defaults to the resolved ``cfg.model_name``. ``engine_overrides`` go to
        build_llm / vllm.LLM unchanged.
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
        if cfg.lora_sync == "merged":  # base-model kernels; the LoRA is merged into the weights
            engine.update(worker_extension_cls=MERGED_WORKER)
        else:
            engine.update(enable_lora=True, max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= cfg.lora_r),
                          max_loras=1)
        if not current_platform.is_cpu() and cfg.vllm_kv_cache_gib is None:
            # On the CPU this fraction would be of host memory: there build_llm's KV size rules.
            engine["gpu_memory_utilization"] = cfg.vllm_gpu_memory_utilization
        engine.update(engine_overrides)
        llm = build_llm(model_dir, **engine)
        return cls(
            llm, model_dir=model_dir,
            temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
            seed=cfg.seed, max_prompt_length=cfg.max_prompt_length, prompt_truncation=cfg.prompt_truncation,
            lora_sync=cfg.lora_sync,
        )

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
    def sampling_params(self, seed: int, probe: bool = False):
        """vLLM SamplingParams for one prompt: the PPO sampling settings and its own seed.
        `probe` (the sync check, see probe()): the same temperature with no top-k/top-p, and
        PROBE_NEW_TOKENS tokens."""
        from vllm import SamplingParams

        return SamplingParams(
            n=1, temperature=self.temperature, top_k=0 if probe or self.top_k <= 0 else self.top_k,
            top_p=1.0 if probe else self.top_p,
            max_tokens=min(PROBE_NEW_TOKENS, self.max_new_tokens) if probe else self.max_new_tokens, seed=seed,
            logprobs=0,  # just the sampled token's (processed) logprob
            ignore_eos=True, stop_token_ids=[self.eos_token_id],  # the tokenizer's EOS is the one stop token
            detokenize=False,  # we decode with the HF tokenizer, once, below
        )

    def probe(self, prompt_ids: Sequence[Sequence[int]]) -> RolloutBatch:
        """The sync check's probe (ppo_ray.trainer): sample the fixed probe prompts with the
        weights the engine holds now, at the PPO temperature without truncation, so that each
        sampled token's logprob is the full tempered softmax's, which the learner recomputes
        at the same version (Learner.sync_gap). Fixed seeds: the same weights give the same
        tokens on every replica."""
        return self.generate(prompt_ids, step=PROBE_SEED_STEP, probe=True)

    @torch.no_grad()
    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], step: int, prompt_offset: int = 0,
                 probe: bool = False) -> RolloutBatch:
        """Sample one response per prompt with the current adapter.

        ``prompts``: B texts, or B lists of token ids. ``step`` and ``prompt_offset``
        (this batch's first global prompt index, for replica splits) fix the per-prompt
        seeds: the same (seed, step, global index) gives the same response anywhere.

        Returns a RolloutBatch: prompt_ids (B, P) left-padded, response_ids (B, T)
        right-padded with pad (T = the longest response), response_mask True up to and
        including EOS, gen_logprobs (B, T) float32 (0 on padding), adapter_version.
        """
        from vllm.inputs import TokensPrompt

        self._check_open()
        prompt_ids, prompt_texts = self._encode(prompts)
        version, lora_request = self.version, self._lora_request
        params = [self.sampling_params(prompt_seed(self.seed, step, prompt_offset + i), probe)
                  for i in range(len(prompt_ids))]
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
        outputs = []
        for start, end in self._prefill_groups(prompt_ids):
            outputs += self.llm.generate(requests[start:end], params[start:end], use_tqdm=False,
                                         lora_request=lora_request)

        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        finish_reasons: list[str] = []
        for i, out in enumerate(outputs):
            c = out.outputs[0]
            ids = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise RuntimeError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} logprobs for "
                                   f"{len(ids)} tokens of prompt {prompt_offset + i}")
            # logprobs=0: each step's dict holds exactly the sampled token.
            lps = [step_lps[tok].logprob for tok, step_lps in zip(ids, c.logprobs)]
            if self.eos_token_id in ids[:-1]:
                raise RuntimeError(f"vLLM generated past EOS for prompt {prompt_offset + i}")
            ended = bool(ids) and ids[-1] == self.eos_token_id
            if c.finish_reason not in ("stop", "length") or (c.finish_reason == "stop") != ended:
                raise RuntimeError(f"prompt {prompt_offset + i}: vLLM finish_reason={c.finish_reason!r} but "
                                   f"response {'ends' if ended else 'does not end'} with EOS")
            responses.append(ids)
            logprobs.append(lps)
            finish_reasons.append(c.finish_reason)

        texts = self.tokenizer.batch_decode([r[:-1] if fr == "stop" else r for r, fr in zip(responses, finish_reasons)],
                                            skip_special_tokens=True)
        # vLLM stops at the first EOS: every returned token is real
        batch = RolloutBatch.from_tokens(prompt_ids, responses, self.pad_token_id, self.eos_token_id,
                                         gen_logprobs=logprobs, adapter_version=version,
                                         prompts=prompt_texts, responses=texts, finish_reasons=finish_reasons)
        if not torch.isfinite(batch.gen_logprobs).all():
            raise RuntimeError("vLLM returned a non-finite logprob for a sampled token")
        return batch

    @torch.no_grad()
    def _prefill_groups(self, prompt_ids: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
        """Split the batch so each llm.generate call's prompts prefill in ONE engine step.

        vLLM 0.32's CPU runner crashes ("CPU Generator does not use offset", then
        EngineDeadError) when a request with its own seed has its prefill chunked across
        steps (gpu_model_runner._bookkeeping_sync rewinds the seeded generator's offset,
        which CPU generators do not have). Keeping each call's prompt tokens within the
        scheduler's max_num_batched_tokens avoids chunking; the per-prompt seeds make the
        samples independent of the grouping.
        """
        budget = self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        groups, start, total = [], 0, 0
        for i, ids in enumerate(prompt_ids):
            if i > start and total + len(ids) > budget:
                groups.append((start, i))
                start, total = i, 0
            total += len(ids)
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
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False,
                                lora_request=self._lora_request)[0]
        # prompt_logprobs[j] is a dict {ids[j]: Logprob} for j >= 1 (None for the first token).
        rows = out.prompt_logprobs[len(prompt_ids):]
        return torch.tensor([row[tok].logprob for tok, row in zip(continuation_ids, rows)], dtype=torch.float32)

    # ------------------------------------------------------------------ LoRA sync
    def load_adapter(self, version: int, weights: LoraWeights, *, restore: bool = False) -> dict[str, float]:
        """Make LoRA ``version`` current: write it, register it with the engine, retire the old one.

        ``weights``: the learner's adapter (Learner.lora_weights): PEFT
        ``get_peft_model_state_dict(model)`` tensors (adapter_model.safetensors keys, e.g.
        ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``: A (r, in),
        B (out, r)) and the spec (r, lora_alpha, targets) that says what they mean: the
        adapter_config.json and the merge's scaling come from it. ``version`` must be above
        the current one.

        Returns timings in seconds: write_s (safetensors + adapter_config.json into a
        /dev/shm temp dir), register_s (engine add_lora: the worker reads and validates
        it), retire_s (remove the previous adapter and its files); and the bytes written.
        A failing load leaves the previous version current. ``restore=True`` accepts any
        version >= 0 (the trainer rolling back to a checkpoint after a learner restart).
        """
        from vllm.lora.request import LoRARequest

        self._check_open()
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"adapter version {version!r} is not an int >= 0")
        if version <= self.version and not restore:
            raise ValueError(f"adapter version {version!r} is not newer than the current version {self.version}: "
                             "versions must increase strictly (a stale or repeated sync)")
        weights = self._check_lora_weights(weights)
        if self.lora_sync == "merged":
            return self._merge(version, weights)

        t0 = time.perf_counter()
        path = Path(tempfile.mkdtemp(prefix=f"v{version}_", dir=self.adapter_root))
        try:
            write_lora_adapter(path, weights, base_model=self.model_dir)
            t1 = time.perf_counter()
            request = LoRARequest(f"v{version}", next(_LORA_IDS), str(path))
            # Load now (not lazily at the next generate), so a broken adapter fails here.
            if not self.llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vLLM did not register adapter v{version} (lora id {request.lora_int_id} taken?)")
        except Exception as e:
            shutil.rmtree(path, ignore_errors=True)
            raise RuntimeError(f"loading LoRA adapter version {version} into vLLM failed: {e}") from e
        t2 = time.perf_counter()

        previous, self._lora_request, self.version = self._lora_request, request, version
        if previous is not None:
            self._retire(previous)
        self._reset_prefix_cache(version)
        t3 = time.perf_counter()
        return {"write_s": t1 - t0, "register_s": t2 - t1, "retire_s": t3 - t2, "bytes": float(weights.nbytes)}

    def _merge(self, version: int, weights: LoraWeights) -> dict[str, float]:
        """lora_sync="merged": W = W0 + (alpha / r) B A into the engine's weights (actors.vllm_merge)."""
        t0 = time.perf_counter()
        try:
            from actors.vllm_merge import pack_tensors

            self.llm.collective_rpc("ppo_merge_lora",
                                    args=(pack_tensors(weights.tensors), weights.spec.scaling, self.model_dir))
        except Exception as e:
            raise RuntimeError(f"merging LoRA adapter version {version} into the vLLM weights failed: {e}") from e
        t1 = time.perf_counter()
        self._reset_prefix_cache(version)
        self.version = version
        return {"write_s": 0.0, "register_s": t1 - t0, "retire_s": time.perf_counter() - t1,
                "bytes": float(weights.nbytes)}

    def _reset_prefix_cache(self, version: int) -> None:
        """Empty vLLM's prefix cache after a new version is in place.

        Merged sync: the cache's block hashes cover the tokens, not the weights, so without
        a reset a prompt prefix seen under an earlier version would reuse KV computed with
        the old weights (vllm #9744; measured here: a 1-nat generator-vs-learner gap from the
        second step on). Adapter sync: the hashes include the adapter's name and path (a new
        directory per load), so no stale block is reused; the reset is for determinism:
        with an empty cache at every version, what a batch samples depends only on the
        version and the batch, not on what the engine generated before (KV read from the
        cache differs from KV computed in the batch by float rounding, ~1e-8 in the
        logprobs; a batch regenerated after a fault must equal the lost one bit for bit).
        The cost: no KV reuse across versions, which PPO (one rollout per prompt per step)
        does not have anyway. The offline engine runs no
        request between generate() calls, so the reset must succeed; vLLM returns False
        (and keeps the cache) while blocks are in use."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(f"after loading LoRA adapter version {version}: vLLM refused to reset its prefix "
                               "cache (requests still running?); its KV blocks would hold another policy's keys")

    def _check_lora_weights(self, weights: LoraWeights) -> LoraWeights:
        """The adapter with CPU, contiguous copies of its A/B tensors; their rank must be the
        spec's r (vLLM scales by lora_alpha / r from adapter_config.json, so a rank mismatch
        would be silent), and in adapter mode at most the engine's max_lora_rank."""
        r = weights.spec.r
        if not weights.tensors:
            raise ValueError("load_adapter got no LoRA weights")
        if self.lora_sync == "adapter":
            max_rank = self.llm.llm_engine.vllm_config.lora_config.max_lora_rank
            if r > max_rank:
                raise ValueError(f"the adapter's lora_r={r} is above the engine's max_lora_rank={max_rank}")
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

    def _retire(self, request) -> None:
        # The LRU cache may already have evicted it (max_loras=1): the return value is moot.
        self.llm.llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Generator is closed")

    def close(self) -> None:
        """Retire the current adapter and delete the adapter directory. The engine is not
        shut down (it may be shared); the generator cannot be used afterwards."""
        if self._lora_request is not None:
            self._retire(self._lora_request)
            self._lora_request = None
        shutil.rmtree(self.adapter_root, ignore_errors=True)
        self._closed = True
