"""The helpers that more than one test module uses: one home for each (a test module imports
helpers from here or from the topic modules beside it, never from another test module or from
conftest.py; tests/test_tests.py checks it). Fixtures are in conftest.py.

* paths, and launch.py commands that must be rejected: ``ROOT``, ``TINY``, ``snapshot``,
  ``launch_ppo``, ``tiny_test_config`` (configs/tiny.yaml with small, fast settings);
* a launched run's processes and waiting on a condition: ``tagged_processes``, ``wait_for``;
* TensorBoard's reader: ``read_events``, ``text_at``;
* the learner's tests, without Ray: ``make_config``, ``random_batch``, ``rollout_inputs``,
  ``keep_experience``, ``with_sgd``, the tolerances of two computations of one update
  (``logprob_tol``, ``update_tols``, ``assert_same_update``) and of a policy gradient;
* HF and PEFT beside vLLM: ``PROMPTS``, ``hf_logprobs``, ``make_peft``, ``randomize_lora``;
* the learner's speed options: ``PLAIN``, ``FAST``, ``learner_with``, ``passes``;
* a Llama-architecture model built locally: ``tiny_llama``, ``write_tiny_llama``;
* an export served by vLLM's OpenAI-compatible server on 127.0.0.1: ``Server`` (``free_port``, ``post``),
  and what it is compared with: ``greedy`` (a model's greedy decode by full forwards), ``same_until_a_near_tie``;
* a typed step to write and read: ``learner_stats``, ``step_result``;
* the Ray tests: ``on_actor``, a resume compared with the straight run (``steps_of``, ...),
  a fault case's run and its comparison (``fault_run``, ``assert_same_fault_run``);
* stand-ins for the supervisor's roles and metrics: ``FakeRoles``, ``FakeMetrics``;
* untrusted code's hostile cases (the sandbox's and the code tool's tests): the host left as it was
  (``sandbox_processes``, ``assert_no_leftovers``, ``rss_bytes``), a server on 127.0.0.1 that
  counts its connections (``tcp_server``), places any uid may write or read (``world_writable_dir``,
  ``world_readable_secret``).

The topic modules beside it: tolerances.py (the equality tests' tolerances), exact.py (exact
comparisons of runs), fault_injection.py and mismatch.py (the fault and mismatch injections, which
Ray's workers import), reward_fns.py (reward functions a config names, imported by Ray workers),
report_run_dirs.py (run directories as the pipeline leaves them, for the report page's tests),
layers.py (the product's layers, for test_layers.py and test_architecture_doc.py) and
cluster_scenario.py (a script the cluster test runs as its own process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from exact import assert_same
from learner.buffer import Experience, ExperienceBuffer
from ppo_ray.batch import RolloutBatch, TrimPlan
from ppo_ray.config import ALL_PROJECTIONS, PPOConfig
from ppo_ray.data import bundled_prompts
from ppo_ray.logprobs import logprobs_from_logits
from ppo_ray.modeling import LoraSpec, LoraWeights, load_causal_lm, response_logits
from ppo_ray.stats import LearnerStats, StepResult, StepTiming
from tolerances import TINY_LOGPROB_TOL, TINY_TERMS, grad_terms, rounding_tol

if TYPE_CHECKING:
    from learner.learner import Learner


# --------------------------------------------------------------------------- paths, rejected commands
TESTS_DIR = pathlib.Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent
TINY = ROOT / "configs" / "tiny.yaml"


def snapshot(directory: pathlib.Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `directory`: relative path -> (bytes, mtime_ns)."""
    return {str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def launch_ppo(run: pathlib.Path, *args: str) -> int:
    """launch.py ppo on configs/tiny.yaml (a programmatic reward) in `run`, RAY_ADDRESS unset."""
    import launch

    return launch.main(["ppo", "--config", str(TINY), "--run_dir", str(run), *args])


def tiny_test_config(**overrides):
    """configs/tiny.yaml with small, fast settings for tests."""
    # logprob_gap_check: error: a generator that samples from another policy than the
    # learner's (stale KV, a lost sync) fails the test instead of a warning in its log.
    base = dict(batch_size=8, max_new_tokens=12, ppo_epochs=2, micro_batch_size=4,
                prompt_truncation="error", max_prompt_length=400, vllm_kv_cache_gib=0.25,
                logprob_gap_check="error")
    base.update(overrides)
    return PPOConfig.from_yaml(TESTS_DIR.parent / "configs" / "tiny.yaml", **base)


# --------------------------------------------------------------------------- a run's processes
RUN_MARKER = "PPO_RAY_RUN_TEST"  # set in a launched run's environment: Ray's processes and workers inherit it


def tagged_processes(tag: str) -> list[int]:
    """Pids of the processes whose environment has RUN_MARKER=tag (a launch.py subprocess and
    the Ray processes it started)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"{RUN_MARKER}={tag}".encode() in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def wait_for(condition, timeout_s: float, what: str, proc=None) -> None:
    """Wait until condition() holds (AssertionError naming `what` after timeout_s, or as soon as
    the subprocess `proc` exits)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s} s")
        time.sleep(0.5)


# --------------------------------------------------------------------------- TensorBoard
def read_events(log_dir: pathlib.Path):
    """TensorBoard's own reader over every event file of a run (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def text_at(acc, tag: str) -> dict[int, str]:
    """Text summaries (add_text) by step: TensorBoard stores them as string tensors."""
    return {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)}


# --------------------------------------------------------------------------- the learner, without Ray
TINY_MODEL = "embedded:tiny"  # the learner tests' model_name (the fixture tiny_path: its directory)
# CUDA's allocator peak: NaN on the CPU; the device's peak FLOP/s: measured on the CPU, NaN on an unlisted GPU
MEASURED_STATS = ("learner_peak_memory_gib", "learner_peak_flops_per_s")


def make_config(**overrides) -> PPOConfig:
    """The learner tests' config with `overrides` on top (PPOConfig.replace: an override that selects
    a critic-free estimator leaves value_learning_rate, which it does not read, at its default)."""
    base = PPOConfig(model_name=TINY_MODEL, lora_r=4, lora_alpha=8, lora_dropout=0.0, batch_size=8, mini_batch_size=4,
                     micro_batch_size=2, ppo_epochs=2, learning_rate=1e-3, value_learning_rate=1e-3,
                     temperature=0.7, top_k=0, top_p=1.0, kl_coef=0.05, seed=0,
                     old_logprobs="learner")  # the seeds' step 2; tests of the generator's set it
    return base.replace(**overrides)


def random_batch(special, n=8, p=10, t=16, seed=0, version=0) -> RolloutBatch:
    """Random tokens: prompts of 2..p tokens left-padded, responses of 1..t tokens
    right-padded (row 0 full length), about half ending in EOS."""
    eos, pad = special
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, p + 1, (n,), generator=g)
    prompt_mask = torch.arange(p) >= (p - plen)[:, None]                                   # (n, p)
    prompt_ids = torch.where(prompt_mask, torch.randint(0, eos, (n, p), generator=g), pad)
    rlen = torch.randint(1, t + 1, (n,), generator=g)
    rlen[0] = t
    response_mask = torch.arange(t) < rlen[:, None]                                       # (n, t)
    response_ids = torch.where(response_mask, torch.randint(0, eos, (n, t), generator=g), pad)
    ends_eos = torch.rand(n, generator=g) < 0.5
    rows = torch.arange(n)[ends_eos]
    response_ids[rows, rlen[ends_eos] - 1] = eos
    return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, torch.zeros(n, t), version,
                        pad_token_id=pad, eos_token_id=eos)


def rollout_inputs(learner: Learner, batch: RolloutBatch, seed=0):
    """gen_logprobs from the learner, reference = the learner's full logprobs plus noise
    (a nonzero KL), random scores."""
    batch = replace(batch, gen_logprobs=learner.rollout_scores(batch, logprobs=True).logprobs.cpu(), adapter_version=learner.version)
    g = torch.Generator().manual_seed(seed)
    ref = learner.rollout_scores(batch, full=True).full_logprobs.cpu() + 0.1 * torch.randn(batch.response_ids.shape, generator=g)
    ref = torch.where(batch.response_mask, ref, 0.0)
    scores = torch.randn(len(batch), generator=g)
    return batch, ref, scores


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def value_params(learner: Learner) -> dict:
    return {n: p.detach().clone() for n, p in learner.value_model.named_parameters() if p.requires_grad}


# --------------------------------------------------------------------------- the learner's speed options
# The plain path: the options off (the defaults are the measured-faster ones, issue 33).
PLAIN = dict(learner_layout="masked", lora_kernel="peft", rms_norm_kernel="hf")
FAST = dict(learner_layout="causal", learner_sort_by_length=True, lora_kernel="fused", rms_norm_kernel="fused",
            logprob_chunk_size=7)


def learner_with(model_path, **options) -> Learner:
    """A learner (make_config with the speed `options` over PLAIN) on `model_path` whose LoRA B
    matrices are random (B = 0 would hide the adapters)."""
    from learner.learner import Learner

    learner = Learner(make_config(**{**PLAIN, **options}), model_path)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in [*learner.policy.named_parameters(), *learner.value_model.named_parameters()]:
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return learner


def passes(learner: Learner, batch) -> dict:
    """The no-grad pass's per-token stats of every kind, by name."""
    out = learner.rollout_scores(batch, logprobs=True, full=True, entropy=True, values=True)
    return {"logprobs": out.logprobs, "full": out.full_logprobs, "entropy": out.entropy, "values": out.values}


# ------------------------------------------------------------------ two computations of one update
# Tolerances: tests/tolerances.py. A logprob of the tiny model goes through TINY_TERMS
# reductions; its magnitude is the largest |logprob| compared (a likely token's x - lse is
# rounded at the size of lse, larger than its own: within the sqrt(terms) rule's margin).
SGD_LR = 3e-3


def keep_experience(learner: Learner) -> list[Experience]:
    """The Experience of each of `learner`'s next updates, in order (Learner.experience_hook)."""
    kept: list[Experience] = []
    learner.experience_hook = kept.append
    return kept


def with_sgd(learner: Learner, lr: float = SGD_LR) -> Learner:
    """`learner` stepping both models with plain SGD instead of Adam, for tests that compare
    two computations of an update. Adam's first step is lr * g / (|g| + eps): it turns a
    rounding-level difference on an entry whose gradient is near 0 into a step of up to ~lr.
    SGD moves every weight by lr * g, so two updates differ by lr times their gradients'
    rounding. lr 3e-3: on the tiny learner the ratios of the last minibatch stay within ~0.1
    of 1, far from the clip range's ends (a ratio within rounding of 1 +- clip_epsilon could
    be clipped in one computation and not in the other: a jump, not rounding)."""
    opt = learner.optimiser
    opt.policy_optimizer = torch.optim.SGD(opt.policy_params, lr=lr)
    if opt.critic:  # an estimator without a critic has no value model
        opt.value_optimizer = torch.optim.SGD(opt.value_params, lr=lr)
    opt.schedulers = opt.lr_schedulers()
    return learner


def plain_pass_and_update(model_path, batch) -> tuple:
    """The plain path's no-grad pass and one SGD update on `batch`, from a fresh learner of
    `model_path`: (batch, ref logprobs, scores, passes, stats, the new LoRA tensors), what the
    speed options' tests compare each option with."""
    learner = with_sgd(learner_with(model_path))
    b, ref, scores = rollout_inputs(learner, batch)
    before = passes(learner, b)
    stats, weights = learner.update(b, ref, scores)
    return b, ref, scores, before, stats, weights.tensors


def logprob_tol(logprobs: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Tolerance of one float32 logprob (or entropy, KL term) of the tiny model computed two
    ways: magnitude the largest finite |logprob| in `logprobs` (over `mask`), TINY_TERMS."""
    values = logprobs if mask is None else logprobs[mask]
    return rounding_tol(values[torch.isfinite(values)].abs().max(), TINY_TERMS)


def token_mean_tol(logprobs: torch.Tensor, mask: torch.Tensor, rows: int | None = None) -> float:
    """Tolerance of a mean over real tokens of the differences of two computations of one
    policy's logprobs (|ratio_mean - 1| where ratio = exp(logp - logp), a mean |logp - logp'|
    against another quantity): n differences of independent signs, each within logprob_tol,
    have a mean within logprob_tol / sqrt(n). n: the real tokens, or those of the `rows`
    shortest rows when the mean is over a minibatch of `rows` rows."""
    lengths = mask.sum(dim=1).sort().values
    n = int(lengths.sum() if rows is None else lengths[:rows].sum())
    return logprob_tol(logprobs, mask) / math.sqrt(n)


# stats that sum per-token terms over a row (up to T of them) before the mean over rows
ROW_SUM_STATS = ("kl", "shaped_reward_mean", "advantage_mean", "return_mean")
NORM_STATS = ("policy_grad_norm", "value_grad_norm")
# not a function of the numbers (learner_flops: of the passes a path runs)
TIMING_STATS = ("learner_forward_s", "update_s", "padded_token_ratio", "learner_flops", *MEASURED_STATS)


def update_tols(config: PPOConfig, batch: RolloutBatch, weights: dict, updates: int = 1,
                lr: float = SGD_LR) -> dict:
    """Tolerances of two computations of `updates` SGD updates (with_sgd) of the tiny learner
    on `batch` (its gen_logprobs: the learner's own), `weights` the reference's trained tensors:

    * logprob: one per-token float32 quantity (logprob_tol), which bounds the per-token means
      (policy and value loss, entropy, approx_kl, ratios, KL per token, values);
    * row: sums over up to T tokens per row (ROW_SUM_STATS), T x logprob;
    * norm_rtol: the gradient norms, relative: rounding of a gradient (grad_terms);
    * weights: each optimiser step moves a weight by lr x its clipped gradient (every entry
      within max_grad_norm), known to rounding_tol(max_grad_norm, grad_terms), plus the
      rounding of the weight itself, over ppo_epochs x minibatches steps per update."""
    assert config.max_grad_norm is not None, "the weights' tolerance needs the clipped gradient's bound"
    mask = batch.response_mask
    lp = logprob_tol(batch.gen_logprobs, mask)
    grad = rounding_tol(config.max_grad_norm, grad_terms(int(mask.sum())))
    steps = updates * config.ppo_epochs * (config.batch_size // config.effective_mini_batch_size)
    w_max = max(w.abs().max().item() for w in weights.values())
    return {"logprob": lp, "row": mask.shape[1] * lp, "norm_rtol": grad / config.max_grad_norm,
            "weights": steps * (lr * grad + rounding_tol(w_max))}


def assert_same_update(got: tuple, want: tuple, tols: dict, keys=None) -> None:
    """got, want: (LearnerStats, {name: trained tensor}); every stat (or `keys`) and tensor
    equal within update_tols."""
    (got_stats, got_w), (want_stats, want_w) = got, want
    torch.testing.assert_close(got_w, want_w, atol=tols["weights"], rtol=0)
    for key, value in want_stats.as_dict().items():
        if key in TIMING_STATS or (keys is not None and key not in keys):
            continue
        atol = tols["row"] if key in ROW_SUM_STATS else tols["logprob"]
        rtol = tols["norm_rtol"] if key in NORM_STATS else 0.0
        torch.testing.assert_close(getattr(got_stats, key), value, atol=atol, rtol=rtol, equal_nan=True,
                                   msg=lambda m, key=key: f"{key}: {m}")


def policy_grads(learner, exp, kl_coef=0.0) -> dict:
    """The policy's gradient of one micro-batch holding every row (learner.optimise)."""
    buffer = ExperienceBuffer(exp, len(exp), len(exp), TrimPlan.of(exp.rollouts))
    learner.policy.zero_grad(set_to_none=True)
    learner.policy.train()
    norm = exp.policy_mask.sum().float()
    learner.optimiser.micro_backward(buffer.micro_batch(list(range(len(exp)))), norm, exp.mask.sum().float(), kl_coef)
    return {n: p.grad.clone() for n, p in learner.policy.named_parameters() if p.requires_grad}


def assert_grads_close(got: dict, want: dict, tokens: int) -> None:
    g_max = max(g.abs().max().item() for g in want.values())
    assert g_max > 1e-4  # not all zero
    torch.testing.assert_close(got, want, atol=rounding_tol(g_max, grad_terms(tokens)), rtol=0)


# --------------------------------------------------------------------------- HF and PEFT beside vLLM
PROMPTS = [
    "SUBREDDIT: r/relationships\n\nTITLE: My friend never calls back\n\nPOST: We used to talk every day.\n\nTL;DR:",
    "Hello",
    "The quick brown fox jumps over the lazy dog, and then",
    "TL;DR:",
]


def hf_logprobs(model, batch: RolloutBatch, temperature=1.0, top_k=None, top_p=None) -> torch.Tensor:
    with torch.no_grad():
        logits = response_logits(model, batch)  # (B, T, V)
    return logprobs_from_logits(logits, batch.response_ids, temperature, top_k, top_p, mask=batch.response_mask)


def continuation_logprobs(model, prompt_ids, cont_ids) -> torch.Tensor:
    """Raw (temperature 1, untruncated) logprobs of cont_ids after prompt_ids: (len(cont),)."""
    ids = torch.tensor([prompt_ids + cont_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits  # (1, L, V)
    p = len(prompt_ids)
    return logprobs_from_logits(logits[:, p - 1:-1], ids[:, p:], 1.0)[0]


def make_peft(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    base = load_causal_lm(str(tiny_model_dir))
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=list(ALL_PROJECTIONS), lora_dropout=0.0)
    return get_peft_model(base, cfg).eval()


def randomize_lora(model, seed: int) -> LoraWeights:
    """Random non-zero A and B (PEFT starts with B = 0, i.e. no change); returns the
    adapter as the learner ships it (state dict and spec)."""
    from peft import get_peft_model_state_dict

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    return LoraWeights({k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()},
                       LoraSpec.of(model.peft_config["default"]))


# --------------------------------------------------------------------------- a tiny Llama
def tiny_llama(tokenizer_dir: Path, *, seed: int = 0):
    """A tiny random LlamaForCausalLM with SmolLM2-135M-Instruct's layout in miniature (2 layers,
    hidden 128, 2 heads x 64 (vLLM's CPU attention needs 64), 1 KV head: grouped-query
    attention, tied embeddings) over `tokenizer_dir`'s vocabulary and special tokens; weights
    N(0, 0.1^2), so logits of a few units. Returns (model in eval mode, its token list by id)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]})
    tokens = sorted(vocab, key=vocab.get)
    eos, pad = vocab["<|endoftext|>"], vocab["<|pad|>"]
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos,
                         pad_token_id=pad)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim >= 2:
                    p.normal_(0.0, 0.1)  # logits of a few units: sampled tokens' logprobs well inside -20
    return model, tokens


def write_tiny_llama(dest: Path, tokenizer_dir: Path, *, seed: int = 0) -> Path:
    """tiny_llama saved as an HF directory at `dest` (safetensors) with `tokenizer_dir`'s
    tokenizer files: a local Llama-architecture model, no hub."""
    model, _ = tiny_llama(tokenizer_dir, seed=seed)
    model.save_pretrained(dest)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
            shutil.copy(f, dest / f.name)
    return dest


# --------------------------------------------------------------------------- vLLM's OpenAI server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


class Server:
    """vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`) on
    127.0.0.1 and a free port, on the CPU, as actors/vllm_engine.py configures vLLM there:
    float32, eager, a small explicit KV cache, OpenMP threads bound to this process's CPUs.
    Its own process group, so that stop() ends the API server and its engine-core process."""

    def __init__(self, model: Path, log: Path, *extra: str):
        from actors.vllm_engine import cpu_bind_list

        self.port = free_port()
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpu_bind_list()),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.log, self.log_file = log, open(log, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(self.port), "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes",
             str(256 << 20), "--max-model-len", "256", "--seed", "0", *extra],
            stdout=self.log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout_s: float = 600) -> float:
        """Seconds from start until /v1/models answers (AssertionError with the log's tail if
        the server exits or does not answer within timeout_s)."""
        deadline = self.started + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM's server exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=5):
                    return time.monotonic() - self.started
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"vLLM's server did not answer within {timeout_s} s:\n{self.log.read_text()[-3000:]}")

    def complete(self, model: str, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy completion token ids (temperature 0, EOS ignored: a fixed length to compare)."""
        out = post(self.port, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True, "logprobs": 1,
                                                  "return_tokens_as_token_ids": True})
        return [int(t.removeprefix("token_id:")) for t in out["choices"][0]["logprobs"]["tokens"]]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        try:  # the engine core shares the group: anything left of it goes too
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log_file.close()


@torch.no_grad()
def greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float], float]:
    """The greedy continuation by full forwards (no cache, no generate() settings); at each step
    the gap between the best and the second-best logit (a near tie may flip between two correct
    computations); and the largest |logit| seen (the magnitude of their rounding)."""
    ids, gaps, logit_max = list(prompt), [], 0.0
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        top = logits.topk(2)
        gaps.append((top.values[0] - top.values[1]).item())
        logit_max = max(logit_max, logits.abs().max().item())
        ids.append(int(top.indices[0]))
    return ids[len(prompt):], gaps, logit_max


def same_until_a_near_tie(got: list[int], want: list[int], gaps: list[float], tol: float) -> int:
    """Equal token for token, except that at a step where the reference's best two tokens are
    within rounding (gap <= tol) the two may part, and nothing after that is compared. Returns
    how many tokens were compared."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if gaps[i] <= tol:
            return i
        assert a == b, f"token {i}: {a} != {b} (reference margin {gaps[i]:.3g} > {tol:.3g}); {got} vs {want}"
    return len(got)


# --------------------------------------------------------------------------- a typed step
def learner_stats(**changes) -> LearnerStats:
    values = {f.name: float(i) for i, f in enumerate(dataclasses.fields(LearnerStats))}
    values["version"] = 3
    values["loss_extra"] = {"dual_clipfrac": 0.5}  # a loss's own statistic (learner.losses)
    return LearnerStats(**{**values, **changes})


def step_result(rewards=(1.0, float("nan"), 3.0), **changes) -> StepResult:
    timing = StepTiming(generate_s=1.0, reference_s=0.5, reward_s=0.25, learner_forward_s=0.5, update_s=2.0,
                        sync_s=0.1, sync_check_s=0.05, prefetch_wait_s=0.0, sync_write_s=0.02, sync_register_s=0.03,
                        step_s=4.0)
    return StepResult(step=3, generated_texts=["a", "b", "c"], finish_reasons=["stop"] * 3, rewards=list(rewards),
                      learner=learner_stats(), reward_parts={"score/reward_model": 2.0, "dropped_nonfinite": 1.0},
                      adapter_version=3, timing=timing, lora_sync_bytes=1024, response_lengths=[4, 10, 6], **changes)


# --------------------------------------------------------------------------- the Ray tests
def on_actor(actor, fn, *args):
    """fn(the actor's host object, *args) run in the actor (Ray's __ray_call__; ObjectRef
    arguments arrive as their values): tests reach the plain objects behind the hosts
    without host methods that only tests would call."""
    import ray

    return ray.get(actor.__ray_call__.remote(fn, *args))


# A resume compared with the straight run (tests/test_checkpoint.py's, and the learner group's)
STEP_KEYS = ("reward_mean", "kl", "policy_loss", "value_loss", "approx_kl", "clipfrac", "entropy",
             "explained_variance", "adapter_version", "response_tokens", "learning_rate")


def from_step_two(trainer, run_dir, new_dir):
    """A new run directory holding only the straight run's step-2 checkpoint; restore it."""
    (new_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-000002", new_dir / "checkpoints" / "step-000002")
    (new_dir / "checkpoints" / "latest").write_text("step-000002\n")
    trainer.run_dir = new_dir
    ckpt = trainer.restore(new_dir)
    assert ckpt.name == "step-000002" and trainer.step == 2 and trainer.version == 2


def metrics_steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def steps_of(history, keys=STEP_KEYS) -> list[dict]:
    """What an exact comparison of steps compares: each step's `keys` and samples."""
    return [{"step": h["step"], **{k: h[k] for k in keys}, "generated_texts": h["generated_texts"]} for h in history]


def assert_same_steps(resumed, straight):
    assert [h["step"] for h in resumed] == [3, 4]
    assert_same(steps_of(resumed), steps_of(straight[2:]), "resumed vs straight")


# A fault case's run and its comparison with the straight one (tests/test_faults.py's, and the
# stale steps' of tests/test_async.py)
FAULT_STEPS = 3  # faults hit the second step: the first one's commit exists, and in overlap mode
                 # the second step's rollouts were prefetched by the first
FAULT_EVERY = 2  # the second step evaluates and checkpoints (and the last): a fault there is followed by a step
FAULT_KEYS = ("reward_mean", "kl", "policy_loss", "value_loss", "approx_kl", "clipfrac", "entropy",
              "explained_variance", "adapter_version", "response_tokens", "first_minibatch_ratio_mean",
              "eval_reward_mean")


@dataclass
class FaultRunOutcome:
    history: list                 # StepResults
    eval_rows: list[dict]         # <run_dir>/eval_samples.jsonl
    checkpoints: dict[str, dict]  # name -> {file: sha256} of its learner-state files (not trainer.json, config.yaml)
    checkpoint_adapters: dict[str, dict]  # name -> the checkpoint's policy LoRA tensors
    saved_adapter: dict           # save_adapter's tensors
    live_adapter: Optional[dict]  # the learner's weights at the end


def adapter_tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def live_adapter(trainer) -> dict:
    import ray

    _, weights = trainer.roles.learner.current_weights.remote()
    return ray.get(weights).tensors


def fault_run(trainer, run_dir: Path, live: bool = True) -> FaultRunOutcome:
    """FAULT_STEPS steps with evaluations and checkpoints into `run_dir`, then save_adapter; with
    `live`, the learner's own weights then (not after a kill at save_adapter: the learner is
    lost, and the trainer's next call would restore it)."""
    trainer.run_dir = run_dir
    try:
        history = trainer.train(bundled_prompts(), steps=FAULT_STEPS, progress=False, eval_prompts=bundled_prompts())
        saved = trainer.save_adapter(run_dir / "adapter")
    finally:
        trainer.run_dir = None
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    return FaultRunOutcome(
        history, [json.loads(line) for line in (run_dir / "eval_samples.jsonl").read_text().splitlines()],
        {c.name: {f: h for f, h in json.loads((c / "checksums.json").read_text()).items()
                  if f not in ("trainer.json", "config.yaml")} for c in checkpoints},
        {c.name: adapter_tensors(c / "adapter") for c in checkpoints}, adapter_tensors(saved),
        live_adapter(trainer) if live else None)


def _comparable(outcome: FaultRunOutcome, live: bool) -> dict:
    """What an exact comparison compares (tests/exact.py): the steps' FAULT_KEYS and samples, the
    evaluations' rows, the adapters (the checkpoints', the saved one, the live one if `live`)."""
    return {"history": [{**{k: h[k] for k in FAULT_KEYS if k in h}, "generated_texts": h["generated_texts"]}
                        for h in outcome.history],
            "eval": outcome.eval_rows, "checkpoint adapters": outcome.checkpoint_adapters,
            "saved adapter": outcome.saved_adapter, **({"final adapter": outcome.live_adapter} if live else {})}


def assert_same_fault_run(got: FaultRunOutcome, want: FaultRunOutcome, exact: bool, what, lr: float) -> None:
    assert [h["step"] for h in got.history] == [h["step"] for h in want.history]
    assert got.checkpoints.keys() == want.checkpoints.keys()
    if exact:  # the learner state's files follow from the floats (a rerun when only their last digits differ)
        live = got.live_adapter is not None
        assert_same(_comparable(got, live), _comparable(want, live), str(what),
                    derived={"checkpoints' learner state": (got.checkpoints, want.checkpoints)})
        return
    for g, w in zip(got.history, want.history):
        for key in FAULT_KEYS:
            if key not in w:
                assert key not in g, f"{what}: step {g['step']} has {key} that the straight run has not"
                continue
            same = abs(g[key] - w[key]) <= TINY_LOGPROB_TOL * (1 + abs(w[key]))
            assert same, f"{what}: step {g['step']} {key}: {g[key]!r} vs {w[key]!r}"
        assert g["generated_texts"] == w["generated_texts"], f"{what}: step {g['step']} samples differ"
    assert got.eval_rows == want.eval_rows, f"{what}: the eval samples differ"
    adapters = [*[(f"checkpoint {n}", got.checkpoint_adapters[n], want.checkpoint_adapters[n])
                  for n in want.checkpoint_adapters], ("saved adapter", got.saved_adapter, want.saved_adapter)]
    if got.live_adapter is not None:
        adapters.append(("final adapter", got.live_adapter, want.live_adapter))
    for name, a, b in adapters:
        assert a.keys() == b.keys(), f"{what}: {name}: other tensors"
        for key, tensor in a.items():
            same = torch.allclose(tensor, b[key], rtol=0, atol=0.01 * lr * FAULT_STEPS)
            assert same, (f"{what}: {name} {key} differs by up to {(tensor - b[key]).abs().max().item():.3g} "
                          f"(scale {tensor.abs().max().item():.3g})")


# --------------------------------------------------------------------------- the supervisor's stand-ins
class FakeRoles:
    def __init__(self):
        self.restarts = []

    def role_of(self, error):
        return getattr(error, "role", "unknown")

    def restarted(self, role):
        self.restarts.append(role)


class FakeMetrics:
    def __init__(self):
        self.retried = []

    def record_retry(self, role):
        self.retried.append(role)


def restored_from_step_two(trainer, run_dir: Path, new_dir: Path):
    """`trainer` restored into a new run directory `new_dir` holding only `run_dir`'s step-2
    checkpoint (a straight run's): at step 2 and version 2."""
    (new_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-000002", new_dir / "checkpoints" / "step-000002")
    (new_dir / "checkpoints" / "latest").write_text("step-000002\n")
    trainer.run_dir = new_dir
    trainer.restore(new_dir)
    assert trainer.step == 2 and trainer.version == 2
    return trainer


# ------------------------------------------------------------------ a run's token attribution
def assert_attribution(run_dir: Path, steps: list[int], rows: int, critic: bool, kl_estimator: str = "k1") -> None:
    """<run_dir>/attribution.jsonl holds `rows` rollouts of each evaluated step in `steps`, each
    a consistent per-token view (ppo_ray.attribution), then that evaluation's first `rows` eval
    samples (held out: the responses, up to a final EOS, and rewards of eval_samples.jsonl, KL_t
    of their logprobs and no learner number), and report.html shows the last step's rollouts and
    held-out samples as a heat map: one token span per SA pair, with the colour toggle."""
    import torch

    from learner.algos import kl_penalty
    from ppo_ray.attribution import ATTRIBUTION, RolloutAttribution

    every = [json.loads(x) for x in (run_dir / ATTRIBUTION).read_text().splitlines()]
    lines = [r for r in every if not r["held_out"]]
    assert [(r["step"], r["row"]) for r in lines] == [(s, i) for s in steps for i in range(rows)]
    for line in lines:
        r = RolloutAttribution.from_dict(line)
        assert r.pairs and "".join(p.action for p in r.pairs) == r.response and r.version == r.step - 1
        for p in r.pairs:
            assert all(math.isfinite(x) for x in (p.logprob, p.old_logprob, p.ref_logprob, p.kl, p.reward, p.advantage))
            assert (p.value is not None) == critic and (p.return_ is not None) == critic
        assert (r.baseline is None) == critic
    held = [RolloutAttribution.from_dict(r) for r in every if r["held_out"]]
    samples = [json.loads(x) for x in (run_dir / "eval_samples.jsonl").read_text().splitlines()]
    assert [(r.step, r.row) for r in held] == [(s, i) for s in steps for i in range(rows)]
    for r in held:
        sample = [x for x in samples if x["step"] == r.step][r.row]
        # the view's text is every sampled token's; the sample's drops a final EOS (special token)
        assert "".join(p.action for p in r.pairs) == r.response and r.response.startswith(sample["response"])
        assert r.response[len(sample["response"]):] in ("", r.pairs[-1].action)
        assert r.score == sample["reward"] and r.version == r.step
        got = torch.tensor([[p.logprob for p in r.pairs]]), torch.tensor([[p.ref_logprob for p in r.pairs]])
        assert [p.kl for p in r.pairs] == kl_penalty(*got, kl_estimator).tolist()[0]
        assert all(p.advantage is None and p.reward is None and p.value is None for p in r.pairs)
    page = (run_dir / "report.html").read_text()
    last = [x for x in lines if x["step"] == steps[-1]]
    assert "<h2>Token attribution</h2>" in page and 'id="attr-kl"' in page
    shown = last + [x for x in every if x["held_out"] and x["step"] == steps[-1]]
    assert page.count('<span class="tok') == sum(len(x["action_id"]) for x in shown)


# ------------------------------------------------------------------ untrusted code (ppo_ray.sandbox)
def sandbox_processes() -> set[int]:
    """Live processes of any sandbox: the supervisor's or the worker's command line names its directory."""
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if b"ppo-ray-sandbox-" in cmdline:
                found.add(int(name))
    return found


def children_of(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(b")", 1)[1].split()[1]) == pid:
                found.append(int(name))
    return found


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def processes_now() -> set[int]:
    """Every sandbox process and every child of this process now (a session's Ray, started by an
    earlier test, has children of this process that are none of a sandbox's business)."""
    return sandbox_processes() | set(children_of(os.getpid()))


def assert_no_leftovers(before: set[int]) -> None:
    """No sandbox process and no child of this process but those in `before` (processes_now())."""
    deadline = time.monotonic() + 2.0  # SIGKILLed processes may take a moment to be gone
    while processes_now() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() - before == set()
    assert set(children_of(os.getpid())) - before == set()


@contextlib.contextmanager
def tcp_server() -> Iterator[tuple[int, list]]:
    """A TCP server on 127.0.0.1 accepting in a thread: yields (its port, the connections it
    accepted, a list that grows as it accepts); stopped and closed on exit."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.1)
    port, accepted, stop = server.getsockname()[1], [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except OSError:  # socket.timeout: look at stop again
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield port, accepted
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()


@contextlib.contextmanager
def world_writable_dir() -> Iterator[Path]:
    """An empty directory any uid may write to (only the sandbox, not file modes, keeps code out);
    removed with what is in it on exit."""
    directory = Path(tempfile.mkdtemp(prefix="test-sandbox-outside-"))
    directory.chmod(0o777)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def world_readable_secret(secret: str) -> Iterator[Path]:
    """A file holding `secret` that any uid may read, in a directory any uid may list (a run
    directory as a careless umask leaves it); removed on exit."""
    path = Path(tempfile.mkdtemp(prefix="test-sandbox-run-")) / "secret.txt"
    path.parent.chmod(0o755)
    path.write_text(secret)
    path.chmod(0o644)
    try:
        yield path
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
