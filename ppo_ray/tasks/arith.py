"""The second bundled task: multi-digit addition, scored by a verifier (RLVR).

Like the TL;DR task's posters, whose references leave facts out, the SFT data here comes from
a sloppy annotator: where the units digits add up to 10 or more, the SFT answer forgets that
carry with probability ``carry_slip`` (the tens digit is one too small). A model fine-tuned
on it learns the slip as the likelier answer to such problems, while the right one stays in
its samples: the margin RL closes with the verifier, which knows the true sum (issue 46: "SFT
leaves a clear margin that RL can close"; benchmarks/RESULTS.md measures it).

A prompt is ``"{a}+{b}="`` with two ``digits``-digit operands; the answer is the decimal sum,
and the policy's response is right when it is exactly that number (surrounding whitespace
ignored) followed by EOS: a response cut off at max_new_tokens (finish reason "length") is no
answer, whatever its text ("46" and two newlines cut there is wrong, "46" then EOS right).
The byte-level tokenizer of the embedded models writes each digit as its own token when no
space precedes it (``"347+589="`` is 8 tokens), so the model sees the digits one by one.

- :func:`write_task` writes the splits as JSONL: ``sft_{train,validation}.jsonl`` (prompt,
  answer: the SFT warm start's targets, with the annotator's slips; ``slip``: whether this
  answer has one) and ``prompts_{train,validation,test}.jsonl`` (prompt, answer: the true sum;
  what RL samples from, and the held-out problems). No problem (an unordered pair of operands)
  is in two splits.
- :func:`verify` is the reward function (``ppo_ray.tasks.arith:verify``): 1.0 for the right
  sum followed by EOS, else 0.0. It takes the responses' ``finish_reasons`` and the dataset's
  ``answer`` column (the reward scorer passes the columns a function names:
  ppo_ray.rewards.call_reward_fn; the RL stage's prompt rows carry their true sums), and
  compares with the row's answer: ground truth from the data, not from the prompt. Without
  an answer (a caller that has none, a dataset of bare prompts) it reads the operands back
  from the prompt; a prompt that is not an addition is then a RewardError naming it.
  :func:`is_right` is the rule, which the evaluation's pass@1 and pass@k apply too
  (ppo_ray.tasks.evaluation.solve, with the held-out rows' answers).
- :func:`pass_at_k` is the unbiased pass@k estimator of Chen et al. 2021 (HumanEval, eq. 1)
  from n samples with c right.

Deterministic: the same arguments write byte-identical files. Importing this module has no
side effects and imports nothing heavy.
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from typing import Optional

from ppo_ray.rewards import RewardError

PROMPT = re.compile(r"^(\d+)\+(\d+)=$")
ANSWER = re.compile(r"^\d+$")


def prompt_of(a: int, b: int) -> str:
    return f"{a}+{b}="


def operands(prompt: str) -> tuple[int, int]:
    """(a, b) of a task prompt; a RewardError naming the prompt for anything else."""
    m = PROMPT.match(prompt.strip())
    if m is None:
        raise RewardError(f"arith verifier: {prompt[:60]!r} is not an addition prompt ('<a>+<b>=')")
    return int(m.group(1)), int(m.group(2))


def true_sum(prompt: str, answer: Optional[str | int] = None) -> int:
    """The problem's sum: the row's `answer` (a decimal string, or an int), or where there is
    none (None) a + b of the prompt (operands). An answer that is not a number of digits is a
    RewardError naming it and the prompt."""
    if answer is None:
        a, b = operands(prompt)
        return a + b
    text = str(answer).strip()
    if ANSWER.match(text) is None:
        raise RewardError(f"arith verifier: the answer {answer!r} of {prompt[:60]!r} is not a number of digits")
    return int(text)


def is_right(prompt: str, completion: str, finish_reason: str, answer: Optional[str | int] = None) -> bool:
    """The completion is exactly the sum (whitespace around it ignored) and ended with EOS
    (`finish_reason` "stop"; "length": cut off at max_new_tokens, no answer). The sum is the
    row's `answer` when given (the prompt is not read), else the prompt's (true_sum)."""
    total = true_sum(prompt, answer)
    text = completion.strip()
    return (finish_reason == "stop" and ANSWER.match(text) is not None and int(text) == total
            and (text == "0" or not text.startswith("0")))


def verify(prompts: list[str], completions: list[str], *, finish_reasons: list[str],
           answer: Optional[list[str]] = None) -> list[float]:
    """The task's reward function: 1.0 where the completion is the right sum and ended with EOS
    (is_right), else 0.0; `answer`: the rows' true sums (the dataset's column; a row's None: its
    prompt's). finish_reasons is required: the rule needs EOS, and the reward scorer always
    passes them."""
    answers = [None] * len(prompts) if answer is None else answer
    if not len(prompts) == len(completions) == len(finish_reasons) == len(answers):
        counts = f" and {len(answer)} answers" if answer is not None else ""
        raise RewardError(f"arith verifier: {len(prompts)} prompts but {len(completions)} completions and "
                          f"{len(finish_reasons)} finish reasons{counts}")
    return [1.0 if is_right(p, c, f, a) else 0.0 for p, c, f, a in zip(prompts, completions, finish_reasons, answers)]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are right (Chen et al. 2021, eq. 1):
    1 - C(n - c, k) / C(n, k); needs 1 <= k <= n."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _problems(rng: random.Random, n: int, digits: int, taken: set) -> list[tuple[int, int]]:
    lo, hi = 10 ** (digits - 1), 10 ** digits - 1
    span = hi - lo + 1
    if len(taken) + n > span * (span + 1) // 2 * 0.98:  # unordered pairs; rejection sampling needs some slack
        raise ValueError(f"{len(taken) + n} distinct problems is too many for {digits}-digit operands "
                         f"({span * (span + 1) // 2} exist)")
    out = []
    while len(out) < n:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        key = (min(a, b), max(a, b))
        if key in taken:
            continue
        taken.add(key)
        out.append((a, b))
    return out


SPLITS = {"sft_train": 2500, "sft_validation": 100, "prompts_train": 1000, "prompts_validation": 200,
          "prompts_test": 200}  # 4000 of the 4095 distinct 2-digit problems


def units_carry(a: int, b: int) -> bool:
    return a % 10 + b % 10 >= 10


def write_task(out_dir: str | Path, seed: int = 0, digits: int = 2, carry_slip: float = 0.6,
               sizes: dict[str, int] | None = None) -> dict[str, Path]:
    """Write the splits (SPLITS' names and sizes, or `sizes`) under `out_dir` as JSONL rows
    {id, prompt, answer} (SFT rows also `slip`); returns {file name: path}. Every problem is in
    one split only. An SFT answer to a problem with a units carry is a + b - 10 (the carry
    forgotten) with probability `carry_slip`; the prompts' answers are the true sums."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    if not 0.0 <= carry_slip <= 1.0:
        raise ValueError(f"carry_slip must be in [0, 1], got {carry_slip}")
    sizes = {**SPLITS, **(sizes or {})}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"arith-{seed}-{digits}")
    taken: set = set()
    paths = {}
    for name, n in sizes.items():
        rows = []
        for i, (a, b) in enumerate(_problems(rng, n, digits, taken)):
            row = {"id": f"{name}-{i}", "prompt": prompt_of(a, b), "answer": str(a + b)}
            if name.startswith("sft"):
                row["slip"] = units_carry(a, b) and rng.random() < carry_slip
                row["answer"] = str(a + b - 10 * row["slip"])
            rows.append(row)
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths[path.name] = path
    return paths

