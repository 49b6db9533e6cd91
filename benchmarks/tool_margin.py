"""The margin of task tool-mul before RL (issue 58): how much an SFT model leaves for RL to close.

SFT the embedded model (learner.stages.train_sft, as `launch.py sft` does, without Ray) on the
sloppy annotator's transcripts (ppo_ray.tasks.tool_mul.write_task; segments encoded as the
pipeline encodes them, ppo_ray.tasks.pipeline.encode_segments, the calculator's observations
out of the loss), then run episodes with the Calculator on held-out problems through
ppo_ray.environments.run_episodes, sampled with HF (HFSampler below: a KV-cached loop over the
exact token ids, no vLLM), and print:

- greedy pass@1 and the greedy episodes' tool-call rate;
- at the temperature, k samples per problem: the share right, the tool-call rate, the share
  right of the samples that called the tool (the route RL can learn to take) and of those that
  did not (the guesses), turns and tokens per episode, tool errors.

A big margin: a low greedy pass@1 (the model mostly guesses) and tool-route samples mostly
right.

    # the task's defaults: 3- by 2-digit problems, p_tool 0.2, 3000 SFT rows
    .venv/bin/python -m benchmarks.tool_margin --seed 0 --epochs 5

Measured 2026-12-08 on the 2-core development VM (float32, 1 torch thread; other engineers'
runs beside it), SFT lr 1e-3, batch 16, 200 held-out test problems, k = 8 at temperature 1,
max_turn_tokens 24, max_episode_tokens 64. pass@1: greedy; greedy / sampled calls: the share of
greedy / sampled episodes that called the tool; tool right / guess right: the share right of the
samples that did / did not; any right: problems with a right sample among their 8:

| seed | p_tool | epochs | SFT s | pass@1 | greedy calls | sampled calls | tool right | guess right | any right |
|---|---|---|---|---|---|---|---|---|---|
| 0 | 0.2 | 5 | 147 | 0.095 | 0.095 | 0.180 | 0.878 | 0.000 | 0.700 |
| 1 | 0.2 | 5 | 151 | 0.055 | 0.055 | 0.148 | 0.831 | 0.000 | 0.595 |
| 2 | 0.2 | 5 | 149 | 0.065 | 0.080 | 0.200 | 0.722 | 0.000 | 0.630 |
| 0 | 0.3 | 5 | 154 | 0.390 | 0.405 | 0.283 | 0.839 | 0.000 | 0.770 |
| 0 | 0.2 | 3 | 92 | 0.100 | 0.100 | 0.172 | 0.622 | 0.000 | 0.565 |

Turns per sampled episode 1.15-1.20 and 8-10 tokens after the prompt (a tool episode: 2 turns,
~35 tokens); tool errors 0.3-0.8% of episodes; every episode ended with the environment's done.
The tool route's failures at temperature 1 are a wrong call (4-9%) and a wrong copy of the
observation (9-24%); greedy, the tool route is right on 81-100% of the problems where it is
taken. Episodes: 1-7 s for 200 greedy and 1600 sampled. A torch with 2 threads beside another
busy process was 8x slower (5.4 s against 0.66 s per SFT step): hence --threads 1.

RL on the three p_tool 0.2 / 5-epoch SFT models: the PPO stage of configs/tool-tiny.yaml
(ppo_ray.tasks.pipeline.run_ppo, vLLM on the CPU; GRPO, 30 steps of 16 problems x 8 episodes,
env_workers 0), the same seeds' data; 200 test problems, test pass@1 SFT -> RL 0.095 -> 0.975,
0.055 -> 0.970, 0.065 -> 0.935 (validation 0.105 -> 0.965, 0.050 -> 0.930, 0.085 -> 0.900);
pass@8 0.64-0.71 -> 0.94-0.97; tool-call rate 0.15-0.20 -> 0.99; turns 1.15-1.21 -> 1.99-2.03;
the RL stage 94-103 s, evaluations included. The tool-call rate passes 0.9 by step 10 of 30.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

from ppo_ray.environments import EpisodeLimits, Turn, run_episodes
from ppo_ray.tasks.tool_mul import DIGITS, P_TOOL, SPLITS, Calculator, observation_of, write_task


class HFSampler:
    """ppo_ray.environments' Sampler over an HF causal LM: each request (exact ids so far,
    seed, max tokens, stop strings) continued token by token with a KV cache, in batches of
    `batch` requests (left-padded; position ids count real tokens, as the generator's do).
    A turn ends at EOS ("stop", EOS kept as its last id), when its text contains a stop string
    ("stop_string") or at its max tokens ("length"). Greedy: argmax; else sampling at
    `temperature` with one torch.Generator per request, seeded by the request's seed."""

    def __init__(self, model, tok, *, greedy: bool, temperature: float = 1.0, batch: int = 512):
        self.model, self.tok, self.greedy, self.temperature, self.batch = model, tok, greedy, temperature, batch

    def __call__(self, requests: list[tuple[list[int], int, int, tuple[str, ...]]]) -> list[Turn]:
        turns: list[Turn] = []
        for start in range(0, len(requests), self.batch):
            turns += self._run(requests[start:start + self.batch])
        return turns

    @torch.no_grad()
    def _run(self, requests) -> list[Turn]:
        tok, b = self.tok, len(requests)
        width = max(len(r[0]) for r in requests)
        input_ids = torch.full((b, width), tok.pad_token_id, dtype=torch.long)  # (B, L) left-padded
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, (ids, *_rest) in enumerate(requests):
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            mask[i, width - len(ids):] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # (B, L)
        gens = [torch.Generator().manual_seed(int(seed)) for _, seed, _, _ in requests]
        ids: list[list[int]] = [[] for _ in requests]
        lps: list[list[float]] = [[] for _ in requests]
        finish: list[str] = [""] * b
        past, step_ids, step_pos = None, input_ids, positions
        for _ in range(max(r[2] for r in requests)):
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=past,
                             use_cache=True)
            past = out.past_key_values
            logp = torch.log_softmax(out.logits[:, -1].float() / (1.0 if self.greedy else self.temperature), dim=-1)
            chosen = logp.argmax(dim=-1) if self.greedy else None  # (B,)
            nxt = torch.full((b, 1), tok.pad_token_id, dtype=torch.long)
            for i, (_, _, max_tokens, stops) in enumerate(requests):
                if finish[i]:
                    continue
                t = int(chosen[i]) if chosen is not None else \
                    int(torch.multinomial(logp[i].exp(), 1, generator=gens[i]))
                ids[i].append(t)
                lps[i].append(float(logp[i, t]))
                nxt[i, 0] = t
                if t == tok.eos_token_id:
                    finish[i] = "stop"
                elif stops and any(s in tok.decode(ids[i], skip_special_tokens=True) for s in stops):
                    finish[i] = "stop_string"
                elif len(ids[i]) >= max_tokens:
                    finish[i] = "length"
            if all(finish):
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long)], dim=1)  # (B, L + t)
            step_ids, step_pos = nxt, step_pos[:, -1:] + 1
        return [Turn(i, lp, f) for i, lp, f in zip(ids, lps, finish)]


def episodes(model, tok, rows: Sequence[dict], *, k: int, greedy: bool, temperature: float, limits: EpisodeLimits,
             seed: int):
    """k episodes per row (contiguous), the Calculator resetting with each row."""
    prompt_ids = [tok(row["prompt"], add_special_tokens=False)["input_ids"] for row in rows for _ in range(k)]
    flat_rows = [row for row in rows for _ in range(k)]
    seeds = [seed * 1_000_003 + i for i in range(len(flat_rows))]
    eps = run_episodes(prompt_ids, flat_rows, seeds, Calculator, HFSampler(model, tok, greedy=greedy,
                                                                           temperature=temperature),
                       encode=lambda text: tok.encode(text, add_special_tokens=False),
                       decode=lambda ids: tok.decode(ids, skip_special_tokens=True), limits=limits.of(Calculator),
                       turn_seed=lambda e, turn: seeds[e] * 7 + turn)
    for ep, row in zip(eps, flat_rows):
        ep.row = row  # for the numbers below
    return eps


def ep_product(ep) -> str:
    return ep.row["answer"]


def copied(ep) -> bool:
    """The final answer is the last observation's value (whatever the call was)."""
    seen = [text for who, text in ep.segments if who == "env"]
    final = ep.segments[-1][1].strip() if ep.segments and ep.segments[-1][0] == "model" else None
    return bool(seen) and final is not None and seen[-1] == f"<out>{final}</out>"


def right(ep) -> bool:
    return ep.end == "done" and ep.score == 1.0


def share(xs: list[bool]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def numbers(eps, k: int) -> dict:
    tool = [ep for ep in eps if ep.tool_calls > 0]
    guess = [ep for ep in eps if ep.tool_calls == 0]
    return {"right": share([right(ep) for ep in eps]),
            "tool_call_rate": share([ep.tool_calls > 0 for ep in eps]),
            "right_with_tool": share([right(ep) for ep in tool]),
            "right_without_tool": share([right(ep) for ep in guess]),
            # the tool route's failures: a wrong call, or a wrong copy of a right observation
            "call_right": share([any(who == "env" and text == observation_of(int(ep_product(ep)))
                                     for who, text in ep.segments) for ep in tool]),
            "answer_is_last_observation": share([copied(ep) for ep in tool]),
            "turns": sum(ep.turns for ep in eps) / len(eps),
            "tokens": sum(len(ep.ids) for ep in eps) / len(eps),
            "tool_errors": sum(ep.tool_errors for ep in eps) / len(eps),
            "ends": {end: sum(ep.end == end for ep in eps) for end in sorted({ep.end for ep in eps})},
            "problems_with_a_right_sample": share([any(right(ep) for ep in eps[i:i + k])
                                                   for i in range(0, len(eps), k)]) if k > 1 else None}


def main(argv: Sequence[str] | None = None) -> dict:
    from learner.stages import TrainSettings, train_sft
    from ppo_ray.data import read_rows
    from ppo_ray.modeling import load_causal_lm, load_tokenizer
    from ppo_ray.paths import resolve_model_path
    from ppo_ray.tasks.pipeline import encode_segments

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded:tldr")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--p_tool", type=float, default=P_TOOL)
    ap.add_argument("--digits", type=int, nargs=2, default=DIGITS)
    ap.add_argument("--sft_rows", type=int, default=SPLITS["sft_train"])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--eval_rows", type=int, default=200)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max_turn_tokens", type=int, default=24)
    ap.add_argument("--max_episode_tokens", type=int, default=64)
    ap.add_argument("--sft_dir", default=None, help="an SFT checkpoint to evaluate (no training)")
    ap.add_argument("--out", default=None, help="where the data and SFT checkpoint go (default: a temp dir)")
    ap.add_argument("--json", default=None, help="append the numbers as a JSON line to this file")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 on a shared machine (2 threads beside another busy process: 8x slower)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    out = Path(args.out or tempfile.mkdtemp(prefix="tool-margin-"))
    data = out / "data"
    write_task(data, seed=args.seed, digits=tuple(args.digits), p_tool=args.p_tool,
               sizes={"sft_train": args.sft_rows})
    base = resolve_model_path(args.model)
    tok = load_tokenizer(base)
    result: dict = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "out")},
                    "total_seconds": None}
    t_start = time.perf_counter()
    sft_dir = Path(args.sft_dir) if args.sft_dir else out / "sft"
    if not args.sft_dir:
        train, val = read_rows(data / "sft_train.jsonl"), read_rows(data / "sft_validation.jsonl")
        q, r, env = encode_segments(tok, [x["prompt"] for x in train], [x["segments"] for x in train], "sft_train")
        vq, vr, venv = encode_segments(tok, [x["prompt"] for x in val], [x["segments"] for x in val], "sft_val")
        settings = TrainSettings(epochs=args.epochs, learning_rate=args.lr, batch_size=args.batch_size,
                                 seed=args.seed, device="cpu", progress=False)
        result["sft"] = train_sft(base, q, r, sft_dir, settings, val=(vq, vr, venv), env_masks=env)
        result["sft"]["tool_share_of_traces"] = share([x["tool"] for x in train])
        print(f"SFT: {result['sft']['sft_steps']} steps, loss {result['sft']['sft_train_loss_first']:.3f} -> "
              f"{result['sft']['sft_train_loss_last']:.3f}, val {result['sft']['sft_val_loss']:.3f}, "
              f"{result['sft']['sft_seconds']:.0f} s", flush=True)
    model = load_causal_lm(str(sft_dir)).eval()
    rows = read_rows(data / "prompts_test.jsonl")[: args.eval_rows]
    limits = EpisodeLimits(max_turns=3, max_episode_tokens=args.max_episode_tokens,
                           max_turn_tokens=args.max_turn_tokens)
    t0 = time.perf_counter()
    greedy = episodes(model, tok, rows, k=1, greedy=True, temperature=1.0, limits=limits, seed=args.seed)
    result["greedy"] = numbers(greedy, 1)
    result["greedy_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sampled = episodes(model, tok, rows, k=args.k, greedy=False, temperature=args.temperature, limits=limits,
                       seed=args.seed)
    result["sampled"] = numbers(sampled, args.k)
    result["sampled_seconds"] = time.perf_counter() - t0
    result["examples"] = [[list(s) for s in ep.segments] for ep in sampled[: 4 * args.k: args.k]]
    g, s = result["greedy"], result["sampled"]
    print(f"greedy ({len(rows)} problems, {result['greedy_seconds']:.0f} s): pass@1 {g['right']:.3f}, tool-call rate "
          f"{g['tool_call_rate']:.3f}, right with the tool {g['right_with_tool']:.3f}, turns {g['turns']:.2f}, "
          f"tokens {g['tokens']:.1f}")
    print(f"sampled (k={args.k}, T={args.temperature}, {result['sampled_seconds']:.0f} s): right {s['right']:.3f}, "
          f"tool-call rate {s['tool_call_rate']:.3f}, right with the tool {s['right_with_tool']:.3f} (call right "
          f"{s['call_right']:.3f}, answer = last observation {s['answer_is_last_observation']:.3f}), without "
          f"{s['right_without_tool']:.3f}, problems with a right sample {s['problems_with_a_right_sample']:.3f}, "
          f"turns {s['turns']:.2f}, tokens {s['tokens']:.1f}, tool errors {s['tool_errors']:.3f}, ends {s['ends']}")
    for ex in result["examples"]:
        print("  example:", ex)
    result["total_seconds"] = time.perf_counter() - t_start
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
