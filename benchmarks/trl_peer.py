"""TRL's PPOTrainer on the peer comparison's work: TRL's side of benchmarks.peer.

    bash benchmarks/trl_venv.sh     # once: .venv-trl (TRL 1.12 on .venv's torch/transformers)
    .venv-trl/bin/python -m benchmarks.trl_peer --size tiny|small [--steps K] [--warmup W]
        [--micro_batch_size M] [--out FILE.json]

Runs in .venv-trl, never in .venv: TRL is not a dependency of the project. It imports only
the torch/transformers parts of ppo_ray and benchmarks.step (no Ray, no vLLM).

The work is benchmarks.step's "peer" preset (``--size tiny``) or "peer-small" (``--size
small``), as TRL's users run PPOTrainer (trl/experimental/ppo, TRL's own TL;DR example):

- policy: the embedded model (ppo_ray.paths.resolve_model_path("embedded:<size>")), float32,
  fully fine-tuned (no LoRA: TRL's PPOTrainer as its example runs it); reference: a second
  copy of it;
- reward model: benchmarks.step.peer_reward_model(size), the very directory our reward
  actor loads (the base with a seeded 1-label score head); value model: the same reward
  model loaded again (TRL initialises the value model from the reward model), so of the
  policy's shape, as our separate value model;
- prompts: the bundled TL;DR-style prompts in benchmarks.step.prompt_batches' batches of 64,
  tokenised as our trainer does (ppo_ray.data.encode_prompts: no special tokens, the LAST 60
  tokens kept), left-padded;
- 16 new tokens at temperature 0.7, no top-k / top-p (TRL's sampling), responses truncated
  after the first EOS (stop_token "eos": ours stops at EOS too);
- 1 PPO epoch, 1 minibatch of all 64 rollouts (num_mini_batches 1), micro-batches of M
  (default 32, the preset's micro_batch_size) with gradient accumulation 64 / M: one
  optimiser step per PPO step;
- no evaluation, no sample generations, no saving, report_to none; torch uses every CPU this
  process may run on (as benchmarks.step's baseline).

Timing: PPOTrainer.train does one PPO step ("update": generate, reference / value / reward
forwards, GAE, the epoch, logging) per batch and calls the callbacks' on_step_end after each;
a step's seconds are the wall time from the previous on_step_end (the first: on_train_begin)
to its own. W warm-up steps then K timed ones (num_total_batches = W + K). JSON (stdout and
--out): framework, trl_version, torch_version, size, params, steps (the K seconds),
median_step_s, threads, machine, ...
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

BATCH_SIZE = 64
MAX_PROMPT_LENGTH = 60
MAX_NEW_TOKENS = 16
TEMPERATURE = 0.7
SIZES = ("tiny", "small")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trl_peer", description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="tiny",
                        help="the embedded model (tiny: the peer preset's, small: peer-small's)")
    parser.add_argument("--steps", type=int, default=10, help="timed PPO steps K")
    parser.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps W")
    parser.add_argument("--micro_batch_size", type=int, default=32,
                        help="per_device_train_batch_size; gradient accumulation = 64 / it (default 32, the preset's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: every CPU this process may use)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.micro_batch_size < 1 or BATCH_SIZE % args.micro_batch_size:
        parser.error(f"--micro_batch_size must divide {BATCH_SIZE}")
    return args


def peer_prompt_ids(tokenizer, n_steps: int) -> list[list[int]]:
    """The prompts of n_steps batches of 64 (benchmarks.step.prompt_batches), tokenised as our
    trainer tokenises them (encode_prompts, left truncation to the last 60 tokens)."""
    from benchmarks.step import prompt_batches
    from ppo_ray.data import encode_prompts

    return [ids for batch in prompt_batches(n_steps, BATCH_SIZE)
            for ids in encode_prompts(tokenizer, batch, MAX_PROMPT_LENGTH, "left")]


def build_trainer(size: str, n_steps: int, micro_batch_size: int, seed: int, output_dir: str, callbacks=()):
    """TRL's PPOTrainer on the work of the module docstring, for n_steps PPO steps."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from benchmarks.step import peer_reward_model
    from ppo_ray.modeling import load_tokenizer
    from ppo_ray.paths import resolve_model_path

    base = resolve_model_path(f"embedded:{size}")
    reward_dir = peer_reward_model(size)
    tokenizer = load_tokenizer(base)  # pad distinct from EOS, as our trainer's
    tokenizer.padding_side = "left"  # TRL generates from left-padded queries
    ids = peer_prompt_ids(tokenizer, n_steps)
    dataset = Dataset.from_dict({"input_ids": ids})

    f32 = torch.float32
    policy = AutoModelForCausalLM.from_pretrained(base, dtype=f32)
    ref_policy = AutoModelForCausalLM.from_pretrained(base, dtype=f32)
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_dir, num_labels=1, dtype=f32)
    value_model = AutoModelForSequenceClassification.from_pretrained(reward_dir, num_labels=1, dtype=f32)

    args = PPOConfig(
        output_dir=output_dir, report_to="none", save_strategy="no", eval_strategy="no", push_to_hub=False,
        bf16=False, fp16=False, seed=seed,
        per_device_train_batch_size=micro_batch_size, gradient_accumulation_steps=BATCH_SIZE // micro_batch_size,
        num_mini_batches=1, num_ppo_epochs=1, total_episodes=n_steps * BATCH_SIZE,
        local_rollout_forward_batch_size=BATCH_SIZE, response_length=MAX_NEW_TOKENS, temperature=TEMPERATURE,
        stop_token="eos", num_sample_generations=0,
    )
    trainer = PPOTrainer(
        args=args, processing_class=tokenizer, model=policy, ref_model=ref_policy, reward_model=reward_model,
        value_model=value_model, train_dataset=dataset, callbacks=list(callbacks),
    )
    assert args.batch_size == BATCH_SIZE and args.num_total_batches == n_steps, (args.batch_size,
                                                                                args.num_total_batches)
    return trainer, policy


def step_timer():
    """A TrainerCallback recording the wall seconds of each PPO step (see the module docstring)."""
    import torch
    from transformers import TrainerCallback

    def now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []
            self._last: Optional[float] = None

        def on_train_begin(self, args, state, control, **kwargs):
            self._last = now()

        def on_step_end(self, args, state, control, **kwargs):
            t = now()
            self.seconds.append(t - self._last)
            self._last = t
            print(f"[trl_peer] step {len(self.seconds)}: {self.seconds[-1]:.3f} s", file=sys.stderr, flush=True)

    return StepTimer()


def run(size: str, steps: int, warmup: int, micro_batch_size: int = 32, threads: Optional[int] = None,
        seed: int = 0) -> dict:
    import torch
    import transformers
    import trl

    from benchmarks.step import load_average, machine_info

    threads = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    load_before = load_average()
    timer = step_timer()
    output_dir = tempfile.mkdtemp(prefix="trl_peer_")  # TrainingArguments wants one; nothing is saved
    try:
        # TRL prints its metrics to stdout every step (tqdm.write): to stderr, so that stdout
        # is the JSON alone
        with contextlib.redirect_stdout(sys.stderr):
            t0 = time.perf_counter()
            trainer, policy = build_trainer(size, warmup + steps, micro_batch_size, seed, output_dir, [timer])
            startup = time.perf_counter() - t0
            params = sum(p.numel() for p in policy.parameters())
            trainer.train()
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    if len(timer.seconds) != warmup + steps:
        raise RuntimeError(f"TRL ran {len(timer.seconds)} steps, expected {warmup + steps}")
    timed = timer.seconds[warmup:]
    machine = machine_info()
    machine["versions"]["trl"] = trl.__version__
    return {
        "framework": "trl", "trl_version": trl.__version__, "torch_version": torch.__version__,
        "transformers_version": transformers.__version__, "size": size, "model_name": f"embedded:{size}",
        "params": params, "steps": timed, "warmup_steps": timer.seconds[:warmup],
        "median_step_s": statistics.median(timed), "min_step_s": min(timed), "max_step_s": max(timed),
        "startup_s": startup, "threads": threads, "torch_threads": torch.get_num_threads(),
        "work": {"batch_size": BATCH_SIZE, "max_prompt_length": MAX_PROMPT_LENGTH, "max_new_tokens": MAX_NEW_TOKENS,
                 "temperature": TEMPERATURE, "top_k": 0, "top_p": 1.0, "ppo_epochs": 1, "num_mini_batches": 1,
                 "micro_batch_size": micro_batch_size, "gradient_accumulation_steps": BATCH_SIZE // micro_batch_size,
                 "dtype": "float32", "fine_tune": "full", "stop_token": "eos", "seed": seed},
        "machine": machine, "load_before": load_before, "load_after": load_average(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def main(argv: Optional[Sequence[str]] = None) -> dict:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    args = parse_args(argv)
    result = run(args.size, args.steps, args.warmup, args.micro_batch_size, args.threads, args.seed)
    result["command"] = "python -m benchmarks.trl_peer " + " ".join(sys.argv[1:] if argv is None else argv)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    print(f"[trl_peer] {args.size}: {result['params']:,} parameters, median step {result['median_step_s']:.3f} s "
          f"over {args.steps} (TRL {result['trl_version']}, {result['threads']} threads)", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
