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
- :data:`TASK` (``task: arith``, ppo_ray.tasks.base) is the task the pipeline asks: its data
  spec and writer, stages sft and ppo, SFT targets (``answer``), the verifier as the reward,
  the evaluation (ppo_ray.tasks.evaluation.solve) and report.json's pass rates, with
  held_out.jsonl and samples.md (arith_report).
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
from ppo_ray.tasks.base import Task

PROMPT = re.compile(r"^(\d+)\+(\d+)=$")
ANSWER = re.compile(r"^\d+$")
# task arith-chat's question (an instruct model's user turn; the chat template wraps it)
CHAT_PROMPT = "What is {a} + {b}? Answer with the number only."
CHAT_QUESTION = re.compile(r"What is (\d+) \+ (\d+)\? Answer with the number only\.")
NUMBER = re.compile(r"\d+")


def prompt_of(a: int, b: int) -> str:
    return f"{a}+{b}="


def chat_prompt_of(a: int, b: int) -> str:
    return CHAT_PROMPT.format(a=a, b=b)


def operands(prompt: str) -> tuple[int, int]:
    """(a, b) of a task prompt: arith's "<a>+<b>=", or arith-chat's question anywhere in the
    text (the prompt a verifier sees is the chat-formatted one); a RewardError naming the prompt
    for anything else."""
    m = PROMPT.match(prompt.strip()) or CHAT_QUESTION.search(prompt)
    if m is None:
        raise RewardError(f"arith verifier: {prompt[:60]!r} is not an addition prompt ('<a>+<b>=' or "
                          f"{CHAT_PROMPT!r})")
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


def is_right_last_number(prompt: str, completion: str, finish_reason: str,
                         answer: Optional[str | int] = None) -> bool:
    """Task arith-chat's rule, GSM8K-style: the last number in the completion (a maximal run of
    digits) is the sum, and the completion ended with EOS (a reply cut off at max_new_tokens is
    no answer). "23 + 58 = 81." is right for 23 + 58; "81 or 82" and "8" are not."""
    numbers = NUMBER.findall(completion)
    return finish_reason == "stop" and bool(numbers) and int(numbers[-1]) == true_sum(prompt, answer)


def verify(prompts: list[str], completions: list[str], *, finish_reasons: list[str],
           answer: Optional[list[str]] = None) -> list[float]:
    """The task's reward function: 1.0 where the completion is the right sum and ended with EOS
    (is_right), else 0.0; `answer`: the rows' true sums (the dataset's column; a row's None: its
    prompt's). finish_reasons is required: the rule needs EOS, and the reward scorer always
    passes them."""
    return _verify(is_right, prompts, completions, finish_reasons, answer)


def verify_last_number(prompts: list[str], completions: list[str], *, finish_reasons: list[str],
                       answer: Optional[list[str]] = None) -> list[float]:
    """Task arith-chat's reward function: verify with is_right_last_number's rule."""
    return _verify(is_right_last_number, prompts, completions, finish_reasons, answer)


def _verify(rule, prompts, completions, finish_reasons, answer) -> list[float]:
    answers = [None] * len(prompts) if answer is None else answer
    if not len(prompts) == len(completions) == len(finish_reasons) == len(answers):
        counts = f" and {len(answer)} answers" if answer is not None else ""
        raise RewardError(f"arith verifier: {len(prompts)} prompts but {len(completions)} completions and "
                          f"{len(finish_reasons)} finish reasons{counts}")
    return [1.0 if rule(p, c, f, a) else 0.0 for p, c, f, a in zip(prompts, completions, finish_reasons, answers)]


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
               sizes: dict[str, int] | None = None, *, prompt=prompt_of, sft: bool = True) -> dict[str, Path]:
    """Write the splits (SPLITS' names and sizes, or `sizes`) under `out_dir` as JSONL rows
    {id, prompt, answer} (SFT rows also `slip`); returns {file name: path}. Every problem is in
    one split only. An SFT answer to a problem with a units carry is a + b - 10 (the carry
    forgotten) with probability `carry_slip`; the prompts' answers are the true sums.
    `prompt(a, b)` writes a problem's prompt; `sft` False leaves the SFT splits out (the same
    problems in the other splits: the SFT ones are drawn first either way)."""
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
            row = {"id": f"{name}-{i}", "prompt": prompt(a, b), "answer": str(a + b)}
            if name.startswith("sft"):
                row["slip"] = units_carry(a, b) and rng.random() < carry_slip
                row["answer"] = str(a + b - 10 * row["slip"])
            rows.append(row)
        if name.startswith("sft") and not sft:
            continue
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths[path.name] = path
    return paths


# ----------------------------------------------------------------------------- the task
class ArithTask(Task):
    """``task: arith``: sft then RL with the verifier as the reward (no reward model), evaluated by
    pass@1 (greedy) and pass@k (ppo_ray.tasks.evaluation.solve, arith_rates); report.json's keys
    <rate>_<split>_sft / _rl, the files held_out.jsonl and samples.md."""

    name = "arith"
    stages = ("sft", "ppo")
    sft_target = "answer"
    verifier = "ppo_ray.tasks.arith:verify"  # reads each prompt row's `answer` column
    policy_name = "rl"
    rule = staticmethod(is_right)  # right or not: the verifier's rule, which the pass rates apply too

    def data_spec(self, config) -> dict:
        return {"task": "arith", "seed": config.seed, "digits": config.arith_digits,
                "carry_slip": config.arith_carry_slip}

    def write_data(self, data_dir: Path, config) -> None:
        write_task(data_dir, seed=config.seed, digits=config.arith_digits, carry_slip=config.arith_carry_slip)

    def eval_settings(self, cfg) -> dict:
        return {"eval_k": cfg.eval_k}

    def evaluate(self, trainer, cfg, rows, *, label: Optional[str] = None) -> dict:
        from ppo_ray.tasks.evaluation import solve

        return solve(trainer, rows, cfg.eval_k, label=label, rule=self.rule)

    def periodic(self, trainer, cfg, rows) -> dict:
        from ppo_ray.tasks.evaluation import arith_rates, solve

        k = cfg.eval_k
        return {"pass1_val": arith_rates(solve(trainer, rows, k, sampled=False, rule=self.rule), k)["pass1"]}

    def report(self, run_dir: Path, metrics: Path, cfg, test_rows: list[dict], val_rows: list[dict], sft: dict,
               after: dict, after_val: dict) -> dict:
        return arith_report(run_dir, metrics, cfg.eval_k, test_rows, val_rows, sft, after, after_val,
                            before_name=self.before_name)

    def check_columns(self, rows, source: str) -> dict[str, str]:
        why = arith_columns(rows, source)
        return {"pass_rates": why} if why else {}

    def eval_policy(self, trainer, cfg, rows, *, label: str, skipped: dict[str, str], score: bool) -> dict:
        from ppo_ray.tasks import evaluation as ev

        if "pass_rates" not in skipped:
            return ev.solve(trainer, rows, cfg.eval_k, label=label, rule=self.rule)
        # no answers: the samples only, greedy and sampled as for the pass rates
        prompts = ev.prompts_of(rows)
        k = cfg.eval_k
        greedy = ev.generate(trainer, prompts, greedy=True, label=f"{label}, greedy").texts
        texts = ev.generate(trainer, prompts, samples_per_prompt=k, label=f"{label}, sampled").texts
        return {"greedy": greedy, "samples": [texts[i * k:(i + 1) * k] for i in range(len(prompts))]}

    def eval_numbers(self, tag: str, cfg, rows, after: dict, before: Optional[dict],
                     skipped: dict[str, str]) -> dict:
        from ppo_ray.tasks import evaluation as ev

        if "pass_rates" in skipped:
            return {}
        k = cfg.eval_k
        out = ev.arith_numbers(tag, k, after, before, self.before_name)
        if before is not None:
            b, a = ev.arith_rates(before, k), ev.arith_rates(after, k)
            out.update({f"{name}_{tag}_rl_minus_{self.before_name}": a[name] - b[name] for name in a})
        out["eval_k"] = k
        return out

    def eval_samples_md(self, path: Path, cfg, rows, after: dict, before: Optional[dict],
                        skipped: dict[str, str]) -> bool:
        # a run of the verifiable task has an SFT stage: `before` is its policy's
        write_arith_samples(path, rows, before, after, cfg.eval_k, self.before_name)
        return True


TASK = ArithTask()


class ArithChatTask(ArithTask):
    """``task: arith-chat``: an instruct model RL-trained from its own baseline, with no SFT
    stage (the preset smollm2-arith; issue 56). The problems are arith's (the same operands
    per seed and digits; no SFT splits written), asked as CHAT_PROMPT's question in the
    model's chat format (apply_chat_template: true), and right by is_right_last_number (the
    reply's last number, then EOS). The report's "before" policy is the base model:
    <rate>_<split>_base and _rl."""

    name = "arith-chat"
    stages = ("ppo",)
    verifier = "ppo_ray.tasks.arith:verify_last_number"
    before_name = "base"
    rule = staticmethod(is_right_last_number)

    def data_spec(self, config) -> dict:
        return {"task": self.name, "seed": config.seed, "digits": config.arith_digits, "prompt": CHAT_PROMPT}

    def write_data(self, data_dir: Path, config) -> None:
        write_task(data_dir, seed=config.seed, digits=config.arith_digits, prompt=chat_prompt_of, sft=False)


CHAT_TASK = ArithChatTask()


def arith_columns(rows: list[dict], source: str) -> Optional[str]:
    """Why the verifier's pass rates cannot be computed on `rows` (no `answer` column), or None.
    A row whose answer is not its problem's sum, or whose prompt is no problem, is bad input."""
    from ppo_ray.data import DataError

    missing = [i for i, row in enumerate(rows) if "answer" not in row]
    if missing:
        return f"{source}: row {missing[0]} has no column 'answer' ({len(missing)} of {len(rows)} rows lack it)"
    for i, row in enumerate(rows):
        try:
            a, b = operands(row["prompt"])
        except RewardError as e:
            raise DataError(f"{source}: row {i}: {e}") from None
        if str(row["answer"]).strip() != str(a + b):
            raise DataError(f"{source}: row {i}: answer {row['answer']!r} is not {a}+{b} = {a + b}")
    return None


def arith_report(run_dir: Path, metrics: Path, k: int, test_rows: list[dict], val_rows: list[dict], sft: dict,
                 rl: dict, rl_val: dict, before_name: str = "sft") -> dict:
    """report.json's pass rates of task arith (ppo_ray.tasks.evaluation, which `launch.py eval`
    calls too) and the files behind them; a part that fails is said (report_part), the rest written."""
    from ppo_ray.tasks.evaluation import arith_numbers
    from ppo_ray.tasks.pipeline import HELD_OUT, final_rewards, plot_curves, read_metrics, report_part

    history = read_metrics(metrics)
    errors: dict = {}
    report = {**(report_part(errors, "test split's pass rates",
                             lambda: arith_numbers("test", k, rl, sft, before_name)) or {}),
              **(report_part(errors, "validation split's pass rates",
                             lambda: arith_numbers("val", k, rl_val, sft["val"], before_name)) or {})}
    report.update({"final_kl": history[-1]["kl"], **final_rewards(history),
                   "rl_steps": len(history), "eval_prompts": len(test_rows), "eval_k": k})
    report_part(errors, HELD_OUT, lambda: write_arith_held_out(
        run_dir / HELD_OUT, {"test": (test_rows, sft, rl), "val": (val_rows, sft["val"], rl_val)}, before_name))
    report_part(errors, "samples.md", lambda: write_arith_samples(run_dir / "samples.md", test_rows, sft, rl, k,
                                                                  before_name))
    report_part(errors, "curves.png", lambda: plot_curves(
        metrics, run_dir / "curves.png", report.get(f"pass1_val_{before_name}"), gold_key="pass1_val",
        gold_title="pass@1 (held-out validation, greedy)", reward_title="verifier reward (share right)",
        before="SFT" if before_name == "sft" else f"{before_name} model"))
    if errors:
        report["report_errors"] = errors
    return report


def write_arith_held_out(path: Path, splits: dict[str, tuple[list[dict], dict, dict]],
                         before_name: str = "sft") -> None:
    """Every held-out sample behind task arith's report: per split ("test", "val": rows, the SFT
    (or base) policy's solve(), the RL policy's) and problem, the greedy answers and the k samples."""
    with open(path, "w") as f:
        for split, (rows, before, after) in splits.items():
            for i, row in enumerate(rows):
                line = {"split": split, "index": i, "prompt": row["prompt"], "answer": row["answer"]}
                for who, res in ((before_name, before), ("rl", after)):  # with the finish reasons: right needs EOS
                    line.update({f"{who}_{key}": res[key][i]
                                 for key in ("greedy", "greedy_finish", "samples", "samples_finish")})
                f.write(json.dumps(line) + "\n")


def write_arith_samples(path: Path, rows, sft: dict, rl: dict, k: int, before_name: str = "sft", n: int = 20) -> None:
    """samples.md of task arith: held-out problems with the SFT and RL greedy answers and how
    many of k samples were right (`sft`, `rl`: ppo_ray.tasks.evaluation.solve() results; `-`
    where the verifier did not score: `launch.py eval` on problems without their answers)."""
    def cell(text: str) -> str:
        return repr(text).replace("|", "\\|")

    def right(res: dict, i: int) -> str:
        return f"{res['right'][i]}/{k}" if "right" in res else "-"

    who = before_name.upper()
    lines = [f"| # | problem | answer | {who} greedy | {who} right of k | RL greedy | RL right of k |",
             "|---|---|---|---|---|---|---|"]
    for i, row in enumerate(rows[:n]):
        lines.append(f"| {i} | {row['prompt']} | {row.get('answer', '')} | {cell(sft['greedy'][i])} | {right(sft, i)} | "
                     f"{cell(rl['greedy'][i])} | {right(rl, i)} |")
    path.write_text(f"# Held-out problems before ({who}) and after RL\n\n" + "\n".join(lines) + "\n")
