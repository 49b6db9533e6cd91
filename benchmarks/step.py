"""Step benchmark: per-phase seconds of our PPO step, and of a single-process baseline, in one run.

    python -m benchmarks.step [--preset tiny|small|peer|peer-small] [--steps K] [--warmup W] [--batch_size B]
        [--max_new_tokens T] [--num_generators N] [--baseline | --no-baseline] [--out FILE.json]
        [--wait_for_load L] [--<any PPOConfig field> VALUE ...]

What runs, in order:

1. **Ours.** A PPOTrainer on the preset (Ray actors: vLLM generator replica(s), reference
   scorer, reward scorer, PEFT-LoRA learner), W warm-up steps, then K timed steps. Every
   step gets a fixed batch of B prompts (the bundled TL;DR-style prompts, cycled), the
   same batches the baseline gets. After the steps the actors' peak memory is read, then
   the trainer and (a local) Ray are shut down, so the baseline has the machine to itself.
2. **Baseline** (``--baseline``, the default): the same model, batch, response length,
   reward and PPO math in ONE process, TRL-style, no Ray and no vLLM: HF ``generate``
   with the policy (base + PEFT LoRA, sampling with the same temperature / top-k /
   top-p), reference logprobs from the same policy with the adapter disabled (TRL's and
   verl's ``ref_in_actor`` for PEFT), the reward by the same ``actors.reward.RewardScorer``,
   then ``learner.learner.Learner.update`` itself (the very PPO code our learner actor
   runs). So the measured difference is the rollout engine and the distribution. torch
   uses every CPU this process may run on (``torch.set_num_threads(len(sched_getaffinity))``),
   as a single-process trainer would; the number is in the JSON (``baseline.torch_threads``).
3. JSON on stdout (and in ``--out``): per-phase seconds (median / min / max over the K
   steps and every step's values), generated tokens/s, samples/s, peak memory per actor,
   and ``ratio``: our median step time / the baseline's, overall and per phase.
4. **The FLOP floor** (``gemm``, ``ours.floor``; benchmarks/flops.py): before anything
   runs, the rate of a 2048^3 fp32 matmul on every CPU this process may use; per timed step
   (synchronous mode) the model FLOPs of each phase on its real tokens (generate, reference,
   reward, learner_forward, update; forward 2 N per token plus LoRA, attention and the
   lm_head, the frozen base's backward as input gradients only); per phase over the K steps,
   FLOPs / that rate (the floor), achieved FLOP/s and ``fraction_of_floor`` = floor /
   measured seconds; "scorers" = the reference and reward together against the wall time
   they share (they run at the same time, each on its share of the cores). The learner's
   value model is counted at the policy's shape.

Phases of our step (PPOTrainer.ppo_step's ``time/*`` keys; every actor times its own work):

    generate         slowest generator replica's generate() (vLLM, current LoRA)
    reference        reference scorer's logprobs()
    reward           reward scorer's score()
    learner_forward  the learner's no-grad pass (old logprobs, values) before the epochs
    update           the rest of Learner.update: KL, GAE, the PPO epochs, stats
                     (learner_forward + update = the learner's whole update() call)
    prefetch_wait    overlap mode only (0 otherwise): the driver waiting for the next
                     step's generation after the learner finished
    sync             the LoRA sync, end to end as the driver waits for it, split into
      sync_transfer  sync - sync_engine: the A/B tensors through the object store to the
                     generator, plus the actor call (measured as the remainder)
      sync_engine    sync_write + sync_register: the generator writes the adapter to
                     /dev/shm and vLLM registers it (add_lora) and drops the old one
    sync_check       the sync check after it: every replica samples the probe, the learner
                     recomputes its logprobs (re-syncs, if any, included)
    overhead         step - critical path: everything no actor times (driver tokenisation,
                     Ray scheduling, moving the rollouts from the generator to the scorers
                     and the learner, the driver's ray.get of the results)
    step             the driver's wall time of ppo_step

The critical path follows the data dependencies of today's synchronous step: generate,
then reference and reward concurrently (the learner's update() takes both as arguments,
so it starts when the later one is done), then the learner, then the sync:
``critical = generate + max(reference, reward) + learner_forward + update + sync + sync_check``.
In overlap mode (``--max_staleness 1`` or more; the steps then run through
``PPOTrainer.train``, which draws its own batches of the same prompts) a step's rollouts were
generated during the previous step, so ``critical = max(reference, reward) + learner_forward
+ update + prefetch_wait + sync + sync_check``.

The baseline has the same phases; its sync is 0 (the policy it samples with IS the one it
trains) and its overhead is step - the sum of its phases (batch building, tokenising).

Peak memory: each actor's VmHWM (peak resident set) from /proc/self/status, read inside
the actor through Ray's ``__ray_call__`` (the actor classes are not changed), plus the sum
of the VmHWM of its descendant processes (the vLLM engine core runs in a child of the
generator actor and holds the model and KV cache there); a sum of peaks is an upper bound
of the peak of the sum. Beside it, glibc malloc's own account after the last step
(``malloc_mib``, from mallinfo2 over all arenas: ``heap`` the heaps' size, ``in_use`` the live
allocations in them, ``free`` the free memory malloc keeps in them, ``top`` the part of it at
the top that a trim could return, ``mmapped`` the live allocations served by mmap) and the
``MALLOC_*`` variables the actor runs with (PPOConfig.cpu_malloc_keep). The peak of the
sum over the run's processes, per role: ``python -m benchmarks.memory -- python -m
benchmarks.step ...`` (benchmarks/memory.py). The baseline's peak is this process's VmHWM after resetting it
(``/proc/self/clear_refs``) just before the baseline starts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.clock import DeviceClock
from ppo_ray.machine import machine_info  # benchmarks.scaling, async_compare and trl_peer import it from here

REPO = Path(__file__).resolve().parent.parent
BASE_CONFIG = REPO / "configs" / "tiny.yaml"

# Presets on top of configs/tiny.yaml (2 PPO epochs, micro-batch 8, LoRA r=16 on all 7
# projections, top_k 50 / top_p 0.95, programmatic reward ppo_ray.rewards:letter_e_fraction).
PRESETS: dict[str, dict[str, Any]] = {
    # The embedded 361K-parameter pretrained model: 16 prompts x up to 16 tokens.
    "tiny": {},
    # The embedded 25M-parameter Qwen3-architecture model (random weights: it almost never
    # samples EOS, so every response runs to max_new_tokens and generation is as long as it
    # can be; there is no min_tokens / ignore-EOS switch in the generator). 32 prompts x 64
    # tokens; prompts are ~145 of its tokens (103-217).
    "small": {"model_name": "embedded:small", "batch_size": 32, "max_new_tokens": 64, "vllm_kv_cache_gib": 1.0},
    # The work of issue 16's comparison with a single-process trainer (TRL 1.12's PPOTrainer;
    # rerun by python -m benchmarks.peer, TRL's side in benchmarks/trl_peer.py): the tiny
    # policy, 64 prompts cut to their last 60 tokens, 16 new tokens at temperature 0.7 (no
    # top-k/top-p), 1 PPO epoch over 1 minibatch, a reward model and a value model of the
    # policy's shape (separate, not shared). The reward model is the tiny model with a
    # 1-label score head (random, seeded), written once to the cache ($PPO_RAY_CACHE or
    # ~/.cache/ppo_ray): speed does not depend on it.
    "peer": {"batch_size": 64, "max_new_tokens": 16, "max_prompt_length": 60, "prompt_truncation": "left",
             "temperature": 0.7, "top_k": 0, "top_p": 1.0, "ppo_epochs": 1, "micro_batch_size": 32,
             "reward_funcs": [], "reward_weights": [], "reward_model_name": "@tiny-reward-model",
             "value_model": "separate"},
}
# The same work on the embedded 25M model (compute-bound where "peer" is overhead-bound;
# issue 33's peer comparison, python -m benchmarks.peer): its reward model is the small
# model with a 1-label score head, built like the tiny one.
PRESETS["peer-small"] = {**PRESETS["peer"], "model_name": "embedded:small", "reward_model_name": "@small-reward-model"}
TINY_REWARD_MODEL = "@tiny-reward-model"
SMALL_REWARD_MODEL = "@small-reward-model"
REWARD_MODEL_SENTINELS = {TINY_REWARD_MODEL: "tiny", SMALL_REWARD_MODEL: "small"}  # sentinel -> embedded size


def tiny_reward_model() -> str:
    """The tiny model as a sequence classifier (num_labels 1, score head seeded random):
    built once into the model cache, then reused. Returns its directory."""
    return peer_reward_model("tiny")


def peer_reward_model(size: str = "tiny") -> str:
    """The embedded `size` model ("tiny" or "small") as a sequence classifier (num_labels 1,
    score head seeded random): built once into the model cache, then reused. Returns its
    directory. Also the reward model (and the value model's initialisation) of TRL's side of
    the peer comparison (benchmarks/trl_peer.py): the same files on both sides."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from ppo_ray.atomic import atomic_dir
    from ppo_ray.modeling import load_tokenizer
    from ppo_ray.paths import resolve_model_path
    from ppo_ray.tiny_model import default_cache_dir

    base = resolve_model_path(f"embedded:{size}")
    out = default_cache_dir() / f"{Path(base).name}-reward-seed0"  # the base's name holds its content hash
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        rm = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
        rm.config.pad_token_id = load_tokenizer(base).pad_token_id
        with atomic_dir(out, keep_existing=lambda: (out / "config.json").is_file()) as tmp:
            rm.save_pretrained(tmp, safe_serialization=True)
            load_tokenizer(base).save_pretrained(tmp)
    return str(out)

PHASES = ("generate", "reference", "reward", "learner_forward", "update", "prefetch_wait", "sync", "sync_transfer",
          "sync_engine", "sync_write", "sync_register", "overhead", "step")


# ----------------------------------------------------------------------------- config, data
def build_config(preset: str, argv: Sequence[str] = ()):
    """configs/tiny.yaml + the preset's fields + `--field value` overrides (PPOConfig's CLI rules)."""
    from ppo_ray.config import PPOConfig, parse_overrides

    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    values = {k: (peer_reward_model(REWARD_MODEL_SENTINELS[v]) if isinstance(v, str) and v in REWARD_MODEL_SENTINELS
                  else v) for k, v in PRESETS[preset].items()}
    preset_args = [a for k, v in values.items() for a in (f"--{k}", json.dumps(v) if not isinstance(v, str) else v)]
    config, positional = parse_overrides(["--config", str(BASE_CONFIG), *preset_args, *argv])
    if positional:
        raise SystemExit(f"unexpected arguments {positional}")
    assert isinstance(config, PPOConfig)
    return config


def prompt_batches(n_steps: int, batch_size: int) -> list[list[str]]:
    """n_steps fixed batches of the bundled prompts, cycled (38 prompts: larger batches
    repeat some; every rollout still gets its own sampling seed)."""
    from ppo_ray.data import bundled_prompts

    prompts = bundled_prompts()
    return [[prompts[(s * batch_size + j) % len(prompts)] for j in range(batch_size)] for s in range(n_steps)]


# ----------------------------------------------------------------------------- statistics
def spread(values: Sequence[float]) -> dict[str, float]:
    vals = [float(v) for v in values]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def summarise(per_step: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """{key: {median, min, max}} over the steps, for every numeric key of the per-step dicts."""
    return {k: spread([s[k] for s in per_step]) for k in per_step[0]}


def ours_phases(out, overlap: bool = False) -> dict[str, float]:
    """One ppo_step result (ppo_ray.stats.StepResult) -> the phases of the module docstring
    (seconds) and throughput. overlap: the step's rollouts were generated during the previous
    step (overlap mode), so generation is off its critical path and prefetch_wait (the driver
    waiting for the next step's generation after the learner finished) is on it."""
    t = out.timing
    gen, ref, rew = t.generate_s, t.reference_s, t.reward_s
    fwd = t.learner_forward_s
    upd = t.update_s - fwd  # the learner's update_s includes its forward
    sync, write, register = t.sync_s, t.sync_write_s, t.sync_register_s
    check = t.sync_check_s
    wait = t.prefetch_wait_s
    step = t.step_s
    critical = (0.0 if overlap else gen) + max(ref, rew) + fwd + upd + wait + sync + check
    tokens = float(out.response_tokens)
    return {
        "generate": gen, "reference": ref, "reward": rew, "learner_forward": fwd, "update": upd,
        "prefetch_wait": wait, "sync": sync, "sync_check": check, "sync_transfer": sync - write - register,
        "sync_engine": write + register, "sync_write": write, "sync_register": register,
        "overhead": step - critical, "step": step,
        "response_tokens": tokens, "tokens_per_s": tokens / step, "samples_per_s": len(out.rewards) / step,
        "generate_tokens_per_s": tokens / gen if gen > 0 else math.nan,
    }


# ----------------------------------------------------------------------------- machine state
def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def wait_for_load(max_load: Optional[float], poll_s: float = 30.0, timeout_s: float = 1200.0) -> dict:
    """Wait until the 1-minute load average is below max_load (polling), up to timeout_s.
    The machine is shared: a benchmark measured while others run is wrong, so record it."""
    t0 = time.monotonic()
    waited = False
    if max_load is not None:
        while os.getloadavg()[0] >= max_load and time.monotonic() - t0 < timeout_s:
            waited = True
            print(f"[benchmarks] load average {load_average()} >= {max_load}: waiting {poll_s:.0f} s", file=sys.stderr,
                  flush=True)
            time.sleep(poll_s)
    return {"load_average": load_average(), "waited_s": round(time.monotonic() - t0, 1) if waited else 0.0,
            "below_threshold": max_load is None or os.getloadavg()[0] < max_load}


def _status_kib(pid: int | str, field: str) -> Optional[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def actor_memory(roles) -> dict[str, dict]:
    """Peak memory of every actor (see the module docstring), read inside each actor."""
    import ray

    def probe(_instance):  # runs in the actor; nested, so Ray pickles it by value
        import os as _os

        import psutil
        import torch as _torch

        def hwm(pid):
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            return int(line.split()[1])
            except OSError:
                return 0
            return 0

        def malloc_state():  # glibc's own account (mallinfo2, glibc >= 2.33), all arenas; None elsewhere
            import ctypes

            class MallInfo2(ctypes.Structure):
                _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                                 "usmblks", "fsmblks", "uordblks", "fordblks",
                                                                 "keepcost")]
            try:
                fn = ctypes.CDLL(None).mallinfo2
            except (OSError, AttributeError):
                return None
            fn.restype = MallInfo2
            m = fn()
            return {"heap_kib": m.arena // 1024, "in_use_kib": m.uordblks // 1024, "free_kib": m.fordblks // 1024,
                    "top_kib": m.keepcost // 1024, "mmapped_kib": m.hblkhd // 1024}

        children = psutil.Process().children(recursive=True)
        return {"pid": _os.getpid(), "peak_rss_kib": hwm("self"),
                "children_peak_rss_kib": sum(hwm(c.pid) for c in children), "children": len(children),
                "torch_threads": _torch.get_num_threads(), "omp_num_threads": _os.environ.get("OMP_NUM_THREADS"),
                "malloc": malloc_state(),
                "malloc_env": {k: v for k, v in _os.environ.items() if k.startswith("MALLOC_")}}

    names = roles.names()
    raw = ray.get([a.__ray_call__.remote(probe) for a in roles.all()])
    out = {}
    for name, r in zip(names, raw):
        out[name] = {"pid": r["pid"], "peak_rss_mib": round(r["peak_rss_kib"] / 1024, 1),
                     "children_peak_rss_mib": round(r["children_peak_rss_kib"] / 1024, 1),
                     "children": r["children"], "torch_threads": r["torch_threads"],
                     "omp_num_threads": r["omp_num_threads"], "malloc_env": r["malloc_env"],
                     "malloc_mib": None if r["malloc"] is None else
                     {k.removesuffix("_kib"): round(v / 1024, 1) for k, v in r["malloc"].items()}}
    driver = _status_kib("self", "VmHWM")
    out["driver"] = {"peak_rss_mib": round(driver / 1024, 1) if driver else None}
    return out


# ----------------------------------------------------------------------------- ours
def connect_ray() -> bool:
    """A local Ray without the dashboard (it costs start-up time and CPU while measuring),
    unless RAY_ADDRESS names a cluster. Returns True when this process started Ray."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        from ppo_ray.driver.cluster import init_ray

        init_ray()
        return False
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    ray.init(include_dashboard=False, log_to_driver=True)
    return True


def measure_trainer(trainer, batches: Sequence[Sequence[str]], warmup: int) -> dict:
    """Run len(batches) steps on a built trainer; the first `warmup` are not recorded.

    Synchronous mode: ppo_step on each fixed batch. Overlap mode (config.max_staleness >= 1):
    PPOTrainer.train over the same prompts (it draws its own batches of batch_size from them
    and generates step k+1 while the learner trains on step k)."""
    overlap = bool(getattr(trainer.config, "max_staleness", 0))
    if overlap:
        flat = [p for batch in batches for p in batch]
        outs = trainer.train(flat, steps=len(batches), progress=False)
    else:
        outs = []
        for i, batch in enumerate(batches):
            outs.append(trainer.ppo_step(batch))
            print(f"[benchmarks] ours: step {i + 1}/{len(batches)}{' (warm-up)' if i < warmup else ''} "
                  f"{outs[-1].timing.step_s:.2f} s", file=sys.stderr, flush=True)
    per_step = [ours_phases(out, overlap) for out in outs[warmup:]]
    result = {"per_step": per_step, "summary": summarise(per_step), "overlap": overlap}
    if not overlap:  # train() draws its own batches: the rows of a step are not known here
        result["flops_per_step"] = [count_flops(trainer, batch, out) for batch, out in zip(batches[warmup:],
                                                                                        outs[warmup:])]
    return result


def count_flops(trainer, prompts: Sequence[str], out) -> dict[str, float]:
    """benchmarks.flops.step_flops of one step: its prompts as the trainer encodes them, its
    rollouts' response lengths (each prompt samples_per_prompt times, in order)."""
    from benchmarks.flops import model_shape, step_flops

    prompt_lens = [len(ids) for ids in trainer.feed.encode(prompts)]
    n = len(out.response_lengths) // max(len(prompt_lens), 1)
    prompt_lens = [p for p in prompt_lens for _ in range(n)]
    shapes = {"policy": model_shape(trainer.model_dir),
              "reward": model_shape(trainer.reward_model_dir) if trainer.reward_model_dir else None}
    cfg = trainer.config
    # the learner ran the policy's no-grad pass unless the generator's logprobs stood in (the
    # version it updated from, adapter_version - 1, is not a check version: Learner.recomputes_old_logprobs)
    recomputed = cfg.old_logprobs_source == "learner" or (out.adapter_version - 1) % cfg.old_logprobs_check_every == 0
    return step_flops(shapes, prompt_lens, out.response_lengths, cfg, recomputed=recomputed)


def run_ours(config, batches: Sequence[Sequence[str]], warmup: int, trainer=None) -> dict:
    """Our step on `config` (a PPOTrainer built here and shut down after, with a local Ray
    started and stopped here when none is running), or on a `trainer` the caller owns (it
    must have been built with `config`; it is left running)."""
    import ray

    from ppo_ray.trainer import PPOTrainer

    if trainer is not None:
        result = measure_trainer(trainer, batches, warmup)
        result["memory"] = actor_memory(trainer.roles)
        result["startup_s"] = None
        return result
    started_ray = connect_ray()
    t0 = time.perf_counter()
    trainer = PPOTrainer(config)
    startup = time.perf_counter() - t0
    try:
        result = measure_trainer(trainer, batches, warmup)
        result["memory"] = actor_memory(trainer.roles)
    finally:
        trainer.shutdown()
        if started_ray:
            ray.shutdown()
    result["startup_s"] = startup
    return result


# ----------------------------------------------------------------------------- baseline
class Baseline:
    """One process, no Ray, no vLLM: HF generate -> reference (adapter disabled) -> reward ->
    Learner.update, on the same config (TRL-style PPO with a PEFT policy)."""

    def __init__(self, config, device: str = "cpu"):
        from actors.reward import RewardScorer
        from learner.learner import Learner
        from ppo_ray.modeling import load_tokenizer
        from ppo_ray.paths import resolve_model_path

        self.config = config
        self.device = device
        self.generate_cache: Optional[str] = None  # HF generate's cache_implementation (None: its default)
        model_dir = resolve_model_path(config.model_name)
        value_dir = resolve_model_path(config.value_model_name) if config.value_model_name else None
        self.tokenizer = load_tokenizer(model_dir)
        self.learner = Learner(config, model_dir, value_dir, device=device)
        self.reward = RewardScorer.from_config(config, config.reward_model_name, device=device)

    def generate(self, prompts: Sequence[str], step: int, prompt_ids: Optional[Sequence[Sequence[int]]] = None):
        """HF generate with the policy (its current LoRA) -> RolloutBatch in our layout (CPU
        tensors). `prompt_ids`: token ids to use instead of encoding `prompts`."""
        import torch

        from ppo_ray.batch import RolloutBatch
        from ppo_ray.data import encode_prompts

        cfg, tok = self.config, self.tokenizer
        pad, eos = int(tok.pad_token_id), int(tok.eos_token_id)
        ids = ([list(x) for x in prompt_ids] if prompt_ids is not None
               else encode_prompts(tok, list(prompts), cfg.max_prompt_length, cfg.prompt_truncation))
        b, p = len(ids), max(len(x) for x in ids)
        prompt_ids = torch.full((b, p), pad, dtype=torch.long)  # (B, P) left-padded
        prompt_mask = torch.zeros((b, p), dtype=torch.bool)
        for i, x in enumerate(ids):
            prompt_ids[i, p - len(x):] = torch.tensor(x)
            prompt_mask[i, p - len(x):] = True
        torch.manual_seed(cfg.seed * 1_000_003 + step)
        policy = self.learner.policy
        policy.eval()
        # learner_compile compiles the policy's decoder layers for the learner's shapes; every
        # new decode shape would recompile them (the real generator is vLLM, not compiled here)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            out = policy.generate(
                input_ids=prompt_ids.to(self.device), attention_mask=prompt_mask.long().to(self.device), do_sample=True,
                temperature=cfg.temperature, top_k=cfg.top_k if cfg.top_k > 0 else 0, top_p=cfg.top_p,
                max_new_tokens=cfg.max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                output_scores=True, return_dict_in_generate=True,
                **({"cache_implementation": self.generate_cache} if self.generate_cache else {}))
        response = out.sequences[:, p:]  # (B, T) HF pads finished rows with pad
        t = response.shape[1]
        # The processed scores (after temperature / top-k / top-p) are what was sampled from;
        # one step at a time (all of them at once are B x T x V float32: 16.5 GB at B=512).
        scores = list(out.scores)
        del out
        logprobs = torch.empty(response.shape, dtype=torch.float32, device=response.device)
        for j in range(t):
            logprobs[:, j] = torch.log_softmax(scores[j].float(), dim=-1).gather(-1, response[:, j:j + 1]).squeeze(-1)
            scores[j] = None  # freed as we go
        logprobs, response = logprobs.cpu(), response.cpu()
        is_eos = response == eos
        first_eos = torch.where(is_eos, torch.arange(t), torch.full_like(response, t)).amin(dim=1)  # (B,)
        response_mask = torch.arange(t)[None, :] <= first_eos[:, None]  # up to and including EOS
        gen_logprobs = torch.where(response_mask, logprobs, torch.zeros(()))
        has_eos = first_eos < t
        lengths = response_mask.sum(dim=1)
        texts = tok.batch_decode([r[: int(n) - int(e)].tolist() for r, n, e in zip(response, lengths, has_eos)],
                                 skip_special_tokens=True)
        return RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=torch.where(response_mask, response, pad),
            response_mask=response_mask, gen_logprobs=gen_logprobs, adapter_version=self.learner.version,
            pad_token_id=pad, eos_token_id=eos, prompts=list(prompts), responses=texts,
            finish_reasons=["stop" if e else "length" for e in has_eos.tolist()])

    def reference_logprobs(self, batch):
        """(B, T) full-softmax logprobs at temperature of the base model (adapter disabled),
        by the reference actor's own code (actors.reference.full_response_logprobs)."""
        from actors.reference import full_response_logprobs

        cfg, policy = self.config, self.learner.policy
        with policy.disable_adapter():
            return full_response_logprobs(policy, batch, cfg.temperature, cfg.micro_batch_size, self.device)

    def step(self, prompts: Sequence[str], step: int,
             prompt_ids: Optional[Sequence[Sequence[int]]] = None) -> dict[str, float]:
        sync = DeviceClock(self.device).now  # phase boundaries wait for the GPU's queued work
        t0 = time.perf_counter()
        batch = self.generate(prompts, step, prompt_ids)
        t1 = sync()
        ref = self.reference_logprobs(batch)
        t2 = sync()
        scores, _ = self.reward.score(batch)
        t3 = sync()
        stats, _weights = self.learner.update(batch, ref, scores)
        t4 = sync()
        tokens = float(batch.response_mask.sum())
        step_s = t4 - t0
        fwd = stats.learner_forward_s
        phases = {"generate": t1 - t0, "reference": t2 - t1, "reward": t3 - t2, "learner_forward": fwd,
                  "update": (t4 - t3) - fwd, "sync": 0.0, "step": step_s}
        phases["overhead"] = step_s - sum(phases[k] for k in ("generate", "reference", "reward", "learner_forward",
                                                               "update"))
        phases.update(response_tokens=tokens, tokens_per_s=tokens / step_s, samples_per_s=len(prompts) / step_s,
                      generate_tokens_per_s=tokens / phases["generate"])
        return phases


def run_baseline(config, batches: Sequence[Sequence[str]], warmup: int, threads: Optional[int] = None) -> dict:
    """The baseline on the same batches (torch threads set for the run, then restored)."""
    import torch

    threads = threads or len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        reset = reset_peak_rss()
        t0 = time.perf_counter()
        baseline = Baseline(config)
        startup = time.perf_counter() - t0
        per_step = []
        for i, batch in enumerate(batches):
            phases = baseline.step(batch, i)
            print(f"[benchmarks] baseline: step {i + 1}/{len(batches)}{' (warm-up)' if i < warmup else ''} "
                  f"{phases['step']:.2f} s", file=sys.stderr, flush=True)
            if i >= warmup:
                per_step.append(phases)
        peak = _status_kib("self", "VmHWM")
    finally:
        torch.set_num_threads(before)
    return {"per_step": per_step, "summary": summarise(per_step), "startup_s": startup, "torch_threads": threads,
            "memory": {"process": {"peak_rss_mib": round(peak / 1024, 1) if peak else None,
                                   "peak_reset_before": reset}}}


# ----------------------------------------------------------------------------- report
def ratios(ours: dict, base: dict) -> dict:
    """ours median / baseline median, for the step and every phase both have (> 0)."""
    out = {}
    for k in ("step", "generate", "reference", "reward", "learner_forward", "update", "tokens_per_s"):
        a, b = ours["summary"][k]["median"], base["summary"][k]["median"]
        out[k] = a / b if b > 0 else None
    return out


def describe(config) -> dict:
    keys = ("model_name", "batch_size", "max_new_tokens", "num_generators", "ppo_epochs", "micro_batch_size",
            "dtype", "lora_r", "lora_target_modules", "temperature", "top_k", "top_p", "reward_funcs",
            "max_prompt_length", "generator_num_cpus", "learner_num_cpus", "scorer_num_cpus", "vllm_kv_cache_gib",
            "lora_sync", "old_logprobs")
    out = {k: getattr(config, k) for k in (*keys, "max_staleness") if hasattr(config, k)}
    # what the auto fields resolved to on this run (lora_sync / old_logprobs "auto")
    return {**out, "lora_sync_mode": config.lora_sync_mode, "old_logprobs_source": config.old_logprobs_source}


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps K")
    parser.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps W")
    parser.add_argument("--batch_size", type=int, default=None, help="prompts per step (default: the preset's)")
    parser.add_argument("--max_new_tokens", type=int, default=None, help="response length (default: the preset's)")
    parser.add_argument("--num_generators", type=int, default=None, help="vLLM generator replicas")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the single-process HF baseline after ours (default: yes)")
    parser.add_argument("--baseline_threads", type=int, default=None,
                        help="torch threads of the baseline (default: every CPU this process may use)")
    parser.add_argument("--wait_for_load", type=float, default=None,
                        help="first wait (polling every 30 s, up to 20 min) until the 1-min load average is below this")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args, extra = parser.parse_known_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    for name in ("batch_size", "max_new_tokens", "num_generators"):
        if getattr(args, name) is not None:
            extra += [f"--{name}", str(getattr(args, name))]
    return args, extra


def benchmark(config, *, steps: int, warmup: int, baseline: bool = True, baseline_threads: Optional[int] = None,
              preset: str = "", command: str = "", max_load: Optional[float] = None, trainer=None) -> dict:
    """The whole run (ours, then the baseline) as one JSON-able dict. `trainer`: see run_ours."""
    batches = prompt_batches(warmup + steps, config.batch_size)
    result: dict[str, Any] = {
        "command": command, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(), "preset": preset, "config": describe(config), "steps": steps, "warmup": warmup,
    }
    result["load_before"] = wait_for_load(max_load)
    from benchmarks.flops import floor_report, gemm_rate

    result["gemm"] = gemm_rate()  # the floor's rate: a large fp32 matmul on every CPU here
    result["ours"] = run_ours(config, batches, warmup, trainer)
    result["load_after_ours"] = load_average()
    if result["ours"].get("flops_per_step"):
        result["ours"]["floor"] = floor_report(result["ours"]["flops_per_step"], result["ours"]["per_step"],
                                               result["gemm"]["flops_per_s"])
    if baseline:
        result["baseline"] = run_baseline(config, batches, warmup, baseline_threads)
        result["load_after_baseline"] = load_average()
        result["ratio"] = ratios(result["ours"], result["baseline"])
    return result


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args, extra = parse_args(argv)
    config = build_config(args.preset, extra)
    if config.num_generators > 1 and not any(a.startswith("--generator_num_cpus") for a in extra):
        # Make N replicas fit beside the learner on a small machine (they share the cores anyway).
        config = config.replace(generator_num_cpus=round(1.0 / config.num_generators, 3))
    command = "python -m benchmarks.step " + " ".join(sys.argv[1:] if argv is None else argv)
    result = benchmark(config, steps=args.steps, warmup=args.warmup, baseline=args.baseline,
                       baseline_threads=args.baseline_threads, preset=args.preset, command=command.strip(),
                       max_load=args.wait_for_load)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    print(format_summary(result), file=sys.stderr)
    return result


def format_summary(result: dict) -> str:
    """A short human-readable table (stderr), the JSON being on stdout."""
    rows = ["phase                median s (ours)   median s (baseline)   ours/baseline"]
    base = result.get("baseline")
    for k in (*PHASES, "tokens_per_s"):
        a = result["ours"]["summary"][k]["median"]
        b = base["summary"][k]["median"] if base and k in base["summary"] else None
        b_text = "" if b is None else f"{b:.4f}"
        r_text = "" if not b else f"{a / b:.2f}"
        rows.append(f"{k:<20} {a:>12.4f}   {b_text:>18}   {r_text:>12}")
    floor = result["ours"].get("floor")
    if floor:
        gemm = result["gemm"]
        rows += ["", f"the FLOP floor (ours): a {gemm['n']}^3 {gemm['dtype']} matmul runs at "
                     f"{gemm['flops_per_s'] / 1e9:.1f} GFLOP/s on {gemm['threads']} threads",
                 "phase                    GFLOP   floor s   measured s   GFLOP/s   fraction of floor"]
        for phase, row in floor.items():
            frac = row["fraction_of_floor"]
            rows.append(f"{phase:<20} {row['flop'] / 1e9:>10.2f} {row['floor_s']:>9.3f} {row['measured_s']:>12.3f} "
                        f"{(row['achieved_flops_per_s'] or 0) / 1e9:>9.1f}   {'-' if frac is None else f'{frac:.0%}'}")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
