"""Diagnostics of the bundled-task pipeline's stages, by the gold judge (evaluation only).

Single process (HF generate, no Ray, no vLLM), so `launch.py sft` and `launch.py rm` report
them on their own. Nothing here feeds training or picks anything: the judge reads samples
and the numbers go into the stage's report.

- ``sft_copy_report``: the SFT policy's greedy summaries of held-out posts, fact by fact
  (tldr_synth.copy_accuracy: person, event, quantity right / wrong / missing). The
  capability check of issue 13: SFT on ideal references must state all three facts right
  in >= 95% of posts (``launch.py sft --bundled_ideal_fraction 1.0``).
- ``reward_model_report``: whether the reward model can guide PPO. Its validation accuracy
  by preference-pair kind, and best-of-n on the SFT policy's own samples (the measurement
  of benchmarks/RESULTS.md): for each held-out prompt n samples at the PPO temperature;
  the mean gold of a random sample, of the sample the reward model scores highest, and of
  the one the judge scores highest (the ceiling). If the RM's pick is no better than a
  random sample, PPO against it can only exploit its noise.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch

from ppo_ray.batch import pad_rows


def hf_sample(model, tok, prompts: Sequence[str], *, n: int = 1, temperature: float = 0.0,
              max_new_tokens: int, seed: int = 0, batch_size: int = 64) -> tuple[list[list[str]], list[list[bool]]]:
    """`n` responses per prompt with HF generate (temperature 0: greedy; else pure
    temperature sampling, no top-k / top-p, as the default PPO sampler). Returns per prompt
    the decoded texts (without EOS) and whether each ended with EOS. Seeded (`seed`)."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    texts: list[list[str]] = [[] for _ in prompts]
    ended: list[list[bool]] = [[] for _ in prompts]
    gen = dict(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)
    if temperature > 0:
        gen.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, num_return_sequences=n)
    else:
        gen.update(do_sample=False)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for start in range(0, len(prompts), batch_size):
            chunk = list(prompts[start:start + batch_size])
            ids = [tok(p, add_special_tokens=False)["input_ids"] for p in chunk]
            input_ids = pad_rows(ids, pad, "left")  # (B, P) left-padded
            mask = pad_rows([[1] * len(x) for x in ids], 0, "left")  # (B, P)
            out = model.generate(input_ids=input_ids, attention_mask=mask, **gen)[:, input_ids.shape[1]:]  # (B * n, T)
            for row, resp in enumerate(out.tolist()):
                i = start + row // (n if temperature > 0 else 1)
                stop = resp.index(eos) if eos in resp else None
                kept = resp[:stop] if stop is not None else [t for t in resp if t != pad]
                texts[i].append(tok.decode(kept, skip_special_tokens=True))
                ended[i].append(stop is not None)
    return texts, ended


def sft_copy_report(model_dir: str, rows: Sequence[dict], max_new_tokens: int) -> dict:
    """Greedy summaries of `rows` (prompts_*.jsonl rows: prompt, facts) by the model in
    `model_dir`: tldr_synth.copy_accuracy plus the mean gold score."""
    from ppo_ray.modeling import load_causal_lm, load_tokenizer
    from ppo_ray.tasks.tldr_synth import copy_accuracy, gold_score

    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir)
    texts, ended = hf_sample(model, tok, [r["prompt"] for r in rows], max_new_tokens=max_new_tokens)
    summaries = [t[0] for t in texts]
    golds = [gold_score(r, s, e[0]) for r, s, e in zip(rows, summaries, ended)]
    return {**copy_accuracy(rows, summaries), "gold": sum(golds) / len(golds), "decoding": "greedy"}


def accuracy_by_kind(correct: Sequence[bool], kinds: Sequence[str]) -> dict[str, dict]:
    """{kind: {"accuracy", "n"}} of per-pair correctness, kinds sorted."""
    groups: dict[str, list[bool]] = defaultdict(list)
    for c, k in zip(correct, kinds):
        groups[k].append(bool(c))
    return {k: {"accuracy": sum(v) / len(v), "n": len(v)} for k, v in sorted(groups.items())}


def best_of_n(rm_scores: Sequence[Sequence[float]], golds: Sequence[Sequence[float]]) -> dict:
    """Best-of-n by the reward model vs a random sample vs the judge's pick, from per-prompt
    lists of n RM scores and n gold scores. ``pairwise_agreement``: over the sample pairs of
    a prompt whose gold differs, the fraction the RM orders as the judge does."""
    random_, rm_pick, oracle, agree, pairs = [], [], [], 0, 0
    for r, g in zip(rm_scores, golds):
        random_.append(sum(g) / len(g))
        rm_pick.append(g[max(range(len(r)), key=lambda j: r[j])])
        oracle.append(max(g))
        for a in range(len(g)):
            for b in range(a + 1, len(g)):
                if g[a] != g[b]:
                    pairs += 1
                    agree += (r[a] > r[b]) == (g[a] > g[b])
    k = len(golds)
    return {"n": len(golds[0]) if golds else 0, "prompts": k, "gold_random": sum(random_) / k,
            "gold_rm_pick": sum(rm_pick) / k, "gold_judge_pick": sum(oracle) / k,
            "pairwise_agreement": agree / pairs if pairs else None}


def reward_model_report(sft_dir: str, rm_dir: str, rows: Sequence[dict], *, n: int, temperature: float,
                        max_new_tokens: int, missing_eos_penalty: float | None, seed: int) -> dict:
    """Best-of-`n` on the SFT policy's samples of `rows` (see the module docstring). A sample
    without EOS gets `missing_eos_penalty` as its RM score, as in PPO."""
    from ppo_ray.batch import RolloutBatch
    from ppo_ray.modeling import load_causal_lm, load_reward_model, load_tokenizer, reward_scores
    from ppo_ray.tasks.tldr_synth import gold_score

    tok = load_tokenizer(sft_dir)
    policy = load_causal_lm(sft_dir)
    prompts = [r["prompt"] for r in rows]
    texts, ended = hf_sample(policy, tok, prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens,
                             seed=seed, batch_size=max(1, 128 // n))
    del policy
    rm = load_reward_model(rm_dir)
    queries, responses = [], []
    for p, ts in zip(prompts, texts):
        q = tok(p, add_special_tokens=False)["input_ids"]
        for t in ts:
            queries.append(q)
            responses.append(tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    batch = RolloutBatch.from_tokens(queries, responses, tok.pad_token_id, tok.eos_token_id)
    flat = reward_scores(rm, batch, 64, next(rm.parameters()).device).tolist()
    scores = [flat[i * n:(i + 1) * n] for i in range(len(prompts))]
    if missing_eos_penalty is not None:
        scores = [[s if e else missing_eos_penalty for s, e in zip(ss, es)] for ss, es in zip(scores, ended)]
    golds = [[gold_score(r, t, e) for t, e in zip(ts, es)] for r, ts, es in zip(rows, texts, ended)]
    return {**best_of_n(scores, golds), "temperature": temperature}


def copy_probe(model_dir: str, rows: Sequence[dict]) -> dict[str, float]:
    """Whether the model in `model_dir` copies a post's person and quantity, by likelihood
    alone (no decoding, no SFT needed): for each example (generate_task rows: prompt,
    facts, subreddit, and the ideal reference as `summary`), the ideal summary against the
    same summary with the person, or the quantity, replaced by each alternative of
    tldr_synth.fact_alternatives. Returns per slot the fraction of examples whose true
    summary (EOS included) is the most likely. Pretraining alone should make this high:
    the committed model's test checks it."""
    from ppo_ray.batch import RolloutBatch
    from ppo_ray.modeling import load_causal_lm, load_tokenizer, response_logits
    from ppo_ray.tasks.tldr_synth import fact_alternatives

    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir)
    out = {}
    for slot, index in (("person", 0), ("quantity", 2)):
        hits = 0
        for row in rows:
            true, summary = row["facts"][index], row["summary"]
            cased = true if true in summary else true[:1].upper() + true[1:]  # "My sister" at the start
            assert cased in summary, (cased, summary)
            alts = [a if cased == true else a[:1].upper() + a[1:] for a in fact_alternatives(row)[slot]]
            texts = [summary] + [summary.replace(cased, a, 1) for a in alts]
            q = tok(row["prompt"], add_special_tokens=False)["input_ids"]
            rs = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
            batch = RolloutBatch.from_tokens([q] * len(rs), rs, tok.pad_token_id, tok.eos_token_id)
            with torch.no_grad():
                logp = torch.log_softmax(response_logits(model, batch).float(), dim=-1)  # (N, T, V)
                token_logp = logp.gather(-1, batch.response_ids[..., None]).squeeze(-1)  # (N, T)
                total = torch.where(batch.response_mask, token_logp, 0.0).sum(-1)  # (N,)
            hits += int(total.argmax()) == 0
        out[slot] = hits / len(rows)
    return out
