"""The bundled multi-turn task (issue 58): multi-digit products with a calculator tool.

A prompt is ``"{a}*{b}="`` with a ``digits[0]``-digit and a ``digits[1]``-digit operand; the
embedded model cannot multiply them unaided (benchmarks/tool_margin.py measures it). The
policy may call a calculator: a turn that ends with ``<calc>EXPR</calc>`` (the episode's stop
string) is answered by the environment with ``<out>VALUE</out>``; a turn without a call is the
final answer, right when it is exactly the product (surrounding whitespace ignored). An
episode that uses the tool is two model turns and the calculator's, about 35 tokens after the
prompt:

    347*58=  <calc>347*58</calc>  <out>20126</out>  20126<EOS>
    prompt   model                env               model

No spaces anywhere: the byte-level tokenizer of the embedded models writes each digit as its
own token when no space precedes it, and ``<``, ``out``, ``>`` as tokens of their own, so the
model copies the operands and the observation's digits one by one (and an observation's
first token never merges with the action's last: they are tokenised apart anyway).

Like arith's, the SFT data comes from a sloppy annotator: with probability ``p_tool`` a trace
calls the calculator, reads its output and writes the product; otherwise the annotator
guesses (:func:`guess`: an estimate, the product's first two digits and zeros after them,
never the product itself). A model fine-tuned on it calls the tool on about p_tool
of its samples and guesses, wrong, on the others; its greedy answer is a guess. RL with the
environment's reward (1 for the right product) finds that the tool route is the one that
pays: the margin it closes (issue 58: "RL with the verifier learns to call the tool and use
its answer").

- :class:`Calculator` (``environment: calculator``, ppo_ray.environments.BUILTIN) is the
  environment: the tool, and the final answer's judge. An expression is integers joined by
  ``+ - *``, parsed (:func:`calculate`), never eval'ed; a malformed or oversized one is
  answered ``<out>error</out>`` (a tool call, and a tool error).
- :func:`write_task` writes the splits as JSONL: ``sft_{train,validation}.jsonl`` (prompt;
  ``segments``: the trace as [["model" | "env", text], ...], so that SFT keeps the
  observation's tokens out of its loss, ppo_ray.tasks.pipeline.sft_ids; ``transcript``: the
  same text joined, for readers; ``answer``: the trace's final answer, a guess where ``tool``
  is false; ``product``: the true product) and ``prompts_{train,validation,test}.jsonl``
  (prompt, answer: the true product). No problem is in two splits.
- :func:`verify` scores a finished transcript from its text (the final answer after the last
  observation, then the episode's end): the environment's rule for a reader of transcripts
  (eval_samples.jsonl, held_out.jsonl). It is not the task's verifier: the PPO stage adds a
  verifier's score to the environment's, and the environment's alone is the reward here.
- :data:`TASK` (``task: tool-mul``) is the task: data, stages sft and ppo, SFT on segments
  (``sft_segments``), the evaluation from the trainer's episodes (pass@1 greedy, pass@k,
  tool-call rate, turns per episode) and report.json's numbers with samples.md (whole
  transcripts, the model's and the environment's turns marked).

Deterministic: the same arguments write byte-identical files; the calculator's answers depend
on the action alone. Importing this module has no side effects and imports nothing heavy.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Optional, Sequence

from ppo_ray.rewards import RewardError
from ppo_ray.tasks.arith import pass_at_k
from ppo_ray.tasks.base import Task

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"   # a tool call; CALL_CLOSE is the episode's stop string
OUT_OPEN, OUT_CLOSE = "<out>", "</out>"       # the calculator's answer
ERROR_OBSERVATION = f"{OUT_OPEN}error{OUT_CLOSE}"
# what the calculator takes: a short expression of a few moderate integers (its value then has
# at most MAX_TERMS * MAX_DIGITS digits: no expression can make the environment slow)
MAX_EXPR_CHARS = 64
MAX_TERMS = 8
MAX_DIGITS = 12
EXPRESSION = re.compile(r"[0-9]+(?:[+\-*][0-9]+)*")  # ASCII digits only (\d takes other scripts' too)
ANSWER = re.compile(r"^-?[0-9]+$")


class ExprError(ValueError):
    """An expression the calculator does not take (the message says why)."""


def prompt_of(a: int, b: int) -> str:
    return f"{a}*{b}="


def call_of(expression: str) -> str:
    return f"{CALL_OPEN}{expression}{CALL_CLOSE}"


def observation_of(value: int) -> str:
    return f"{OUT_OPEN}{value}{OUT_CLOSE}"


def calculate(expression: str) -> int:
    """The value of integers joined by + - * (the usual precedence: * first), whitespace
    ignored. Parsed, never eval'ed; ExprError for anything else (a unary sign, parentheses,
    another operator, an empty expression) and for one longer than MAX_EXPR_CHARS characters,
    with more than MAX_TERMS integers or an integer of more than MAX_DIGITS digits."""
    text = re.sub(r"\s+", "", expression)
    if len(text) > MAX_EXPR_CHARS:
        raise ExprError(f"longer than {MAX_EXPR_CHARS} characters")
    if EXPRESSION.fullmatch(text) is None:
        raise ExprError("not integers joined by + - *")
    numbers = re.findall(r"[0-9]+", text)
    if len(numbers) > MAX_TERMS:
        raise ExprError(f"more than {MAX_TERMS} integers")
    if any(len(n) > MAX_DIGITS for n in numbers):
        raise ExprError(f"an integer of more than {MAX_DIGITS} digits")
    total = 0
    for sign, term in re.findall(r"([+\-]?)([^+\-]+)", text):  # sums of products
        value = 1
        for factor in term.split("*"):
            value *= int(factor)
        total += -value if sign == "-" else value
    return total


def tool_expression(action: str) -> Optional[str]:
    """The expression of a tool call: the text between the last CALL_OPEN and the CALL_CLOSE
    that ends the action (whitespace after it ignored); "" where the action ends with
    CALL_CLOSE but opens no call (a malformed call). None: the action is no tool call (a final
    answer)."""
    text = action.rstrip()
    if not text.endswith(CALL_CLOSE):
        return None
    body = text[: -len(CALL_CLOSE)]
    start = body.rfind(CALL_OPEN)
    return "" if start < 0 else body[start + len(CALL_OPEN):]


class Calculator:
    """The task's environment (docs/ENVIRONMENTS.md's contract, with the info dict): a turn
    that ends with ``<calc>EXPR</calc>`` is a tool call, answered ``<out>VALUE</out>`` (or
    ERROR_OBSERVATION for an expression :func:`calculate` refuses, a tool error), reward 0, the
    episode goes on. Any other turn is the final answer: done, reward 1.0 when it is exactly
    the row's ``answer`` (whitespace around it ignored), else 0.0. The seed is not used: the
    environment is a function of the actions."""

    stop_strings = (CALL_CLOSE,)
    max_turns = 3  # two calls and an answer; the episode's token budget is the config's

    def reset(self, row: dict, seed: int) -> str:
        if "answer" not in row:
            raise KeyError(f"the calculator's row has no column 'answer' (columns: {sorted(row)})")
        self.answer = str(row["answer"]).strip()
        return ""

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        expression = tool_expression(action)
        if expression is None:
            return "", float(action.strip() == self.answer), True, {"tool_call": False, "tool_error": False}
        try:
            observation, error = observation_of(calculate(expression)), False
        except ExprError:
            observation, error = ERROR_OBSERVATION, True
        return observation, 0.0, False, {"tool_call": True, "tool_error": error}


# ----------------------------------------------------------------------------- the rule on a transcript's text
def final_answer(completion: str) -> str:
    """The transcript's final answer: its text after the last observation (OUT_CLOSE), or the
    whole text where there is none (an answer without a tool call), stripped."""
    return completion.rpartition(OUT_CLOSE)[2].strip()


def is_right(completion: str, finish_reason: str, answer: str | int) -> bool:
    """The environment's rule on a finished transcript's text: the episode ended on its own
    (`finish_reason` "stop": the final answer given, not cut at max_turns or the token budget)
    and its final answer is exactly `answer`."""
    return finish_reason == "stop" and final_answer(completion) == str(answer).strip()


def verify(prompts: list[str], completions: list[str], *, finish_reasons: list[str],
           answer: list[str]) -> list[float]:
    """The rule with a reward function's signature: 1.0 where the transcript's final answer is
    the row's product and the episode ended on its own (is_right), else 0.0. A completion is the
    whole transcript after the prompt, the environment's observations included (the generator's
    response text)."""
    if not len(prompts) == len(completions) == len(finish_reasons) == len(answer):
        raise RewardError(f"tool-mul verifier: {len(prompts)} prompts but {len(completions)} completions, "
                          f"{len(finish_reasons)} finish reasons and {len(answer)} answers")
    for p, a in zip(prompts, answer):
        if ANSWER.match(str(a).strip()) is None:
            raise RewardError(f"tool-mul verifier: the answer {a!r} of {p[:60]!r} is not an integer")
    return [float(is_right(c, f, a)) for c, f, a in zip(completions, finish_reasons, answer)]


# ----------------------------------------------------------------------------- the data
# The margin (benchmarks/tool_margin.py, 3 seeds): SFT 5 epochs on these splits leaves greedy
# pass@1 0.055-0.095 (the model guesses; it calls the tool on 5-10% of problems) while its samples
# that call the tool are right 72-88% of the time. p_tool 0.3 made the tool the greedy choice on
# 40% of problems (pass@1 0.39): "<" then beats every single first digit of a guess.
DIGITS = (3, 2)  # the operands' digits: 4-5 digit products, which the embedded model cannot compute
P_TOOL = 0.2     # the annotator's share of traces that call the calculator
SPLITS = {"sft_train": 3000, "sft_validation": 100, "prompts_train": 1000, "prompts_validation": 200,
          "prompts_test": 200}


def guess(product: int) -> int:
    """The sloppy annotator's guess at a product: an estimate with its number of digits and its
    first two digits, zeros after them (20126 -> 20000); never the product itself (a product
    that is its own estimate, 10000, is guessed 11000; one of one or two digits one off)."""
    digits = str(product)
    if len(digits) <= 2:
        return product + (1 if product % 10 != 9 else -1)
    estimate = int(digits[:2]) * 10 ** (len(digits) - 2)
    if estimate != product:
        return estimate
    return estimate + 10 ** (len(digits) - 2) * (1 if digits[1] != "9" else -1)


def trace(a: int, b: int, use_tool: bool) -> list[list[str]]:
    """The annotator's transcript of one problem as segments [who, text]: with the tool, the
    call, the calculator's observation (what Calculator.step answers) and the product; without,
    one guess."""
    if not use_tool:
        return [["model", str(guess(a * b))]]
    expression = f"{a}*{b}"
    return [["model", call_of(expression)], ["env", observation_of(calculate(expression))], ["model", str(a * b)]]


def _problems(rng: random.Random, n: int, digits: tuple[int, int], taken: set) -> list[tuple[int, int]]:
    (lo_a, hi_a), (lo_b, hi_b) = [(10 ** (d - 1), 10 ** d - 1) for d in digits]
    exist = (hi_a - lo_a + 1) * (hi_b - lo_b + 1) // (2 if digits[0] == digits[1] else 1)
    if len(taken) + n > 0.98 * exist:  # rejection sampling needs some slack
        raise ValueError(f"{len(taken) + n} distinct problems is too many for {digits[0]}- by {digits[1]}-digit "
                         f"operands (about {exist} exist)")
    out = []
    while len(out) < n:
        a, b = rng.randint(lo_a, hi_a), rng.randint(lo_b, hi_b)
        key = (min(a, b), max(a, b))  # a*b and b*a are one problem
        if key in taken:
            continue
        taken.add(key)
        out.append((a, b))
    return out


def write_task(out_dir: str | Path, seed: int = 0, digits: tuple[int, int] = DIGITS, p_tool: float = P_TOOL,
               sizes: dict[str, int] | None = None) -> dict[str, Path]:
    """Write the splits (SPLITS' names and sizes, or `sizes`) under `out_dir` as JSONL; returns
    {file name: path}. Prompt rows are {id, prompt, answer: the product}; SFT rows {id, prompt,
    segments, transcript, answer: the trace's final answer, tool: whether the trace calls the
    calculator (probability `p_tool`), product}. Every problem is in one split only."""
    if len(digits) != 2 or min(digits) < 1:
        raise ValueError(f"digits must be two operand lengths >= 1, got {digits}")
    if not 0.0 <= p_tool <= 1.0:
        raise ValueError(f"p_tool must be in [0, 1], got {p_tool}")
    sizes = {**SPLITS, **(sizes or {})}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"tool-mul-{seed}-{digits[0]}x{digits[1]}")
    taken: set = set()
    paths = {}
    for name, n in sizes.items():
        rows = []
        for i, (a, b) in enumerate(_problems(rng, n, tuple(digits), taken)):
            row = {"id": f"{name}-{i}", "prompt": prompt_of(a, b), "answer": str(a * b)}
            if name.startswith("sft"):
                use_tool = rng.random() < p_tool
                segments = trace(a, b, use_tool)
                row = {**row, "segments": segments, "transcript": "".join(text for _, text in segments),
                       "answer": segments[-1][1], "tool": use_tool, "product": str(a * b)}
            rows.append(row)
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths[path.name] = path
    return paths


# ----------------------------------------------------------------------------- the evaluation
def episode_record(rows: Sequence[dict], greedy: Sequence, sampled: Sequence, k: int) -> dict:
    """One policy's evaluation as JSON-able per-problem lists, from its episodes
    (ppo_ray.stats.EpisodeSummary, or anything with score, end, turns, tool_calls, tool_errors
    and segments): `greedy` one per row, `sampled` k per row, contiguous. An episode is right
    when it ended with the environment's done and its score is 1 (the final answer was the
    product)."""
    if len(greedy) != len(rows) or len(sampled) != k * len(rows):
        raise ValueError(f"{len(rows)} problems need {len(rows)} greedy and {k * len(rows)} sampled episodes "
                         f"(k={k}), got {len(greedy)} and {len(sampled)}")

    def right(ep) -> bool:
        return ep.end == "done" and ep.score == 1.0

    def segments(ep) -> list[list[str]]:
        return [[who, text] for who, text in ep.segments]

    per_row = [sampled[i * k:(i + 1) * k] for i in range(len(rows))]
    return {"greedy": ["".join(text for _, text in ep.segments) for ep in greedy],
            "greedy_segments": [segments(ep) for ep in greedy],
            "greedy_right": [right(ep) for ep in greedy],
            "greedy_turns": [ep.turns for ep in greedy],
            "greedy_tool_calls": [ep.tool_calls for ep in greedy],
            "greedy_end": [ep.end for ep in greedy],
            "samples_segments": [[segments(ep) for ep in eps] for eps in per_row],
            "samples_right": [[right(ep) for ep in eps] for eps in per_row],
            "samples_turns": [[ep.turns for ep in eps] for eps in per_row],
            "samples_tool_calls": [[ep.tool_calls for ep in eps] for eps in per_row],
            "samples_tool_errors": [[ep.tool_errors for ep in eps] for eps in per_row],
            "samples_end": [[ep.end for ep in eps] for eps in per_row],
            "right": [sum(right(ep) for ep in eps) for eps in per_row]}


def tool_rates(res: dict, k: int) -> dict[str, float]:
    """One policy's numbers from episode_record: pass1 (greedy), pass<k> (Chen et al.'s unbiased
    estimator over the k samples), sample_accuracy, tool_call_rate (the share of sampled episodes
    with at least one tool call; greedy_tool_call_rate: of the greedy ones), turns (model turns
    per sampled episode), tool_errors (per sampled episode) and tool_accuracy (the share right
    of the sampled episodes that called the tool; left out where none did)."""
    if any(len(r) != k for r in res["samples_right"]):
        raise ValueError(f"pass@{k} needs {k} samples per problem (eval_k={k}); the evaluation has "
                         f"{sorted({len(r) for r in res['samples_right']})}")
    right = [x for r in res["samples_right"] for x in r]
    calls = [x for r in res["samples_tool_calls"] for x in r]
    n = len(right)
    out = {"pass1": sum(res["greedy_right"]) / len(res["greedy_right"]),
           f"pass{k}": sum(pass_at_k(k, c, k) for c in res["right"]) / len(res["right"]),
           "sample_accuracy": sum(right) / n,
           "tool_call_rate": sum(c > 0 for c in calls) / n,
           "greedy_tool_call_rate": sum(c > 0 for c in res["greedy_tool_calls"]) / len(res["greedy_tool_calls"]),
           "turns": sum(x for r in res["samples_turns"] for x in r) / n,
           "tool_errors": sum(x for r in res["samples_tool_errors"] for x in r) / n}
    tool_right = [r for r, c in zip(right, calls) if c > 0]
    if tool_right:
        out["tool_accuracy"] = sum(tool_right) / len(tool_right)
    return out


def tool_numbers(tag: str, k: int, after: dict, before: Optional[dict] = None, before_name: str = "sft") -> dict:
    """<rate>_<tag>_<before_name> and <rate>_<tag>_rl, keys as in report.json; the two
    evaluations must be of the same problems."""
    if before is not None and len(before["greedy_right"]) != len(after["greedy_right"]):
        raise ValueError(f"the {before_name.upper()} and RL evaluations of split {tag!r} are of "
                         f"{len(before['greedy_right'])} and {len(after['greedy_right'])} problems")
    pairs = ([(before_name, before)] if before is not None else []) + [("rl", after)]
    return {f"{name}_{tag}_{who}": value for who, res in pairs for name, value in tool_rates(res, k).items()}


def transcript_md(segments: Sequence[Sequence[str]]) -> str:
    """A transcript on one line, each turn marked: **model** `...` then **env** `...`."""
    def code(text: str) -> str:
        text = text.replace("\n", "\\n")
        fence = "``" if "`" in text else "`"
        return f"{fence}{text}{fence}" if text else "(empty)"

    return " → ".join(f"**{who}** {code(text)}" for who, text in segments) or "(no turn)"


def write_tool_samples(path: Path, rows: Sequence[dict], before: dict, after: dict, k: int,
                       before_name: str = "sft", n: int = 20) -> None:
    """samples.md: held-out problems with each policy's greedy transcript (turns marked), whether
    it was right, and how many of its k samples were right and called the tool."""
    who = before_name.upper()
    lines = [f"# Held-out problems before ({who}) and after RL", "",
             "Greedy transcripts after the prompt; **model** turns are the policy's, **env** the calculator's.", ""]
    for i, row in enumerate(rows[:n]):
        lines.append(f"## {i}. `{row['prompt']}` (answer {row.get('answer', '-')})")
        lines.append("")
        for name, res in ((who, before), ("RL", after)):
            mark = "right" if res["greedy_right"][i] else "wrong"
            tools = sum(c > 0 for c in res["samples_tool_calls"][i])
            lines.append(f"- {name} ({mark}; {res['right'][i]}/{k} samples right, {tools}/{k} called the tool): "
                         f"{transcript_md(res['greedy_segments'][i])}")
        lines.append("")
    path.write_text("\n".join(lines))


def tool_report(run_dir: Path, metrics: Path, k: int, test_rows: list[dict], val_rows: list[dict], sft: dict,
                rl: dict, rl_val: dict, before_name: str = "sft") -> dict:
    """report.json's numbers of task tool-mul and the files behind them (held_out.jsonl: every
    held-out episode's record; samples.md; curves.png); a part that fails is said (report_part)."""
    from ppo_ray.tasks.pipeline import HELD_OUT, final_rewards, plot_curves, read_metrics, report_part

    history = read_metrics(metrics)
    errors: dict = {}
    report = {**(report_part(errors, "test split's numbers", lambda: tool_numbers("test", k, rl, sft, before_name))
                 or {}),
              **(report_part(errors, "validation split's numbers",
                             lambda: tool_numbers("val", k, rl_val, sft["val"], before_name)) or {})}
    report.update({"final_kl": history[-1]["kl"], **final_rewards(history),
                   "rl_steps": len(history), "eval_prompts": len(test_rows), "eval_k": k})

    def held_out() -> None:
        with open(run_dir / HELD_OUT, "w") as f:
            for split, rows, before, after in (("test", test_rows, sft, rl), ("val", val_rows, sft["val"], rl_val)):
                for i, row in enumerate(rows):
                    line = {"split": split, "index": i, "prompt": row["prompt"], "answer": row["answer"]}
                    for who, res in ((before_name, before), ("rl", after)):
                        line.update({f"{who}_{key}": value[i] for key, value in res.items() if isinstance(value, list)})
                    f.write(json.dumps(line) + "\n")

    report_part(errors, HELD_OUT, held_out)
    report_part(errors, "samples.md", lambda: write_tool_samples(run_dir / "samples.md", test_rows, sft, rl, k,
                                                                 before_name))
    report_part(errors, "curves.png", lambda: plot_curves(
        metrics, run_dir / "curves.png", report.get(f"pass1_val_{before_name}"), gold_key="pass1_val",
        gold_title="pass@1 (held-out validation, greedy)", reward_title="environment reward (share right)",
        before="SFT"))
    if errors:
        report["report_errors"] = errors
    return report


# ----------------------------------------------------------------------------- the task
class ToolMulTask(Task):
    """``task: tool-mul``: SFT on the sloppy annotator's transcripts (segments: the calculator's
    observations out of the loss), then RL with the Calculator environment's reward; evaluated
    on the trainer's episodes (config.environment: calculator): pass@1 (greedy), pass@k, the
    tool-call rate and turns per episode; report.json's keys <rate>_<split>_sft / _rl."""

    name = "tool-mul"
    stages = ("sft", "ppo")
    sft_target = "transcript"   # the whole trace as text (readers; SFT reads sft_segments)
    sft_segments = "segments"   # SFT's targets as [who, text] segments: "env" ones out of the loss
    verifier = None             # the environment's reward is the score (a verifier's would be added to it)
    environment = "calculator"  # the episodes' environment (ppo_ray.environments.BUILTIN)
    policy_name = "rl"
    digits: tuple[int, int] = DIGITS
    p_tool: float = P_TOOL

    def data_spec(self, config) -> dict:
        return {"task": self.name, "seed": config.seed, "digits": list(self.digits), "p_tool": self.p_tool,
                "sizes": SPLITS}

    def write_data(self, data_dir: Path, config) -> None:
        write_task(data_dir, seed=config.seed, digits=self.digits, p_tool=self.p_tool)

    def eval_settings(self, cfg) -> dict:
        return {"eval_k": cfg.eval_k}

    def evaluate(self, trainer, cfg, rows, *, label: Optional[str] = None) -> dict:
        from ppo_ray.tasks.evaluation import generate

        k = cfg.eval_k
        greedy = generate(trainer, rows, greedy=True, label=label and f"{label}, greedy")
        drawn = generate(trainer, rows, samples_per_prompt=k, label=label and f"{label}, sampled")
        return episode_record(rows, _episodes(greedy), _episodes(drawn), k)

    def periodic(self, trainer, cfg, rows) -> dict:
        from ppo_ray.tasks.evaluation import generate

        episodes = _episodes(generate(trainer, rows, greedy=True))
        return {"pass1_val": sum(ep.end == "done" and ep.score == 1.0 for ep in episodes) / len(episodes),
                "tool_call_rate_val": sum(ep.tool_calls > 0 for ep in episodes) / len(episodes)}

    def report(self, run_dir: Path, metrics: Path, cfg, test_rows: list[dict], val_rows: list[dict], sft: dict,
               after: dict, after_val: dict) -> dict:
        return tool_report(run_dir, metrics, cfg.eval_k, test_rows, val_rows, sft, after, after_val,
                           before_name=self.before_name)

    def check_columns(self, rows, source: str) -> dict[str, str]:
        from ppo_ray.data import DataError

        for i, row in enumerate(rows):  # the calculator judges the final answer against it: no answer, no episode
            if ANSWER.match(str(row.get("answer", "")).strip()) is None:
                raise DataError(f"{source}: row {i}: task tool-mul needs each row's product in column 'answer' "
                                f"(got {row.get('answer')!r})")
        return {}

    def eval_numbers(self, tag: str, cfg, rows, after: dict, before: Optional[dict],
                     skipped: dict[str, str]) -> dict:
        return {**tool_numbers(tag, cfg.eval_k, after, before, self.before_name), "eval_k": cfg.eval_k}

    def eval_samples_md(self, path: Path, cfg, rows, after: dict, before: Optional[dict],
                        skipped: dict[str, str]) -> bool:
        if before is None:
            return False
        write_tool_samples(path, rows, before, after, cfg.eval_k, self.before_name)
        return True


def _episodes(responses) -> list:
    """The episodes of trainer.generate's Responses (config.environment set), checked."""
    if responses.episodes is None:
        raise ValueError("task tool-mul is evaluated on episodes: the trainer's config needs environment: calculator")
    return list(responses.episodes)


TASK = ToolMulTask()
