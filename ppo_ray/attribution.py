"""The seeds' token attribution, as a view for inspection: one rollout's (state, action) pairs,
each with every number the step computed for its token.

The seeds build "SA pairs" step by step (generate_sequences, add_kl_to_sa_pairs,
add_values_to_sa_pairs, compute_gae_advantages). ppo-ray computes the same quantities as
batched (B, T) tensors (learner.experience.make_experience); this module turns a few rows of
them back into the seeds' per-token records, after the step and off its data path (the
design's rule: per-token dicts are a view, never what the step computes with):

    rows = trainer.attribution(4)          # the last update's first 4 rollouts (or None)
    for rollout in rows:
        for pair in rollout.pairs:         # SAPair: state, action, logprobs, KL_t, r_t, V, delta, A, G
            ...

`AttributionRows` is what the learner returns (Learner.attribution): the step's own tensors for
the chosen rows, on the CPU, no second forward. `sa_pairs(rows, decode)` turns them into
`RolloutAttribution`s with the token texts. At every evaluation the trainer appends them to
<run_dir>/attribution.jsonl (one line per rollout, `RolloutAttribution.as_dict`: per-token
columns), which report.html shows as a heat map.

A critic-free estimator (grpo, rloo, reinforce_pp) has no value, TD error nor return: those are
None, and the rollout carries its group's baseline (learner.algos' registry: the score it is
compared with) instead.

Held-out samples (the evaluation's eval_samples prompts, which no update trains on) have no
advantage, reward, value nor learner logprob: their view (`held_out_rows`, made on the
reference actor from the evaluation's own generation: one reference pass over those few rows,
at evaluation steps only) holds the generator's logprob of each sampled token, the reference's
and KL_t (kl_estimator of the two); the rest is None and `held_out` is True.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from ppo_ray.batch import RolloutBatch

ATTRIBUTION = "attribution.jsonl"  # in the run directory: one line per rollout, at each evaluation

# The per-token numbers of an SAPair, in the JSONL's column order (the field of each, and its column).
NUMBERS = ("logprob", "old_logprob", "ref_logprob", "kl", "reward", "value", "td_error", "advantage", "return_")


@dataclass
class AttributionRows:
    """A few rows of one update's per-token tensors (learner.buffer.Experience), on the CPU,
    trimmed to the rows' own widths. The layout is RolloutBatch's (left-padded prompts,
    right-padded responses); `mask` is True on real response tokens."""

    rows: list[int]             # N: the rows' indices in the step's batch
    version: int                # the adapter version that sampled them
    prompt_ids: Tensor          # (N, P) long, left-padded
    prompt_mask: Tensor         # (N, P) bool
    response_ids: Tensor        # (N, T) long, right-padded
    mask: Tensor                # (N, T) bool: real response tokens (a dropped row: none)
    loss_mask: Optional[Tensor]  # (N, T) bool: the tokens of the policy loss (Experience.policy_mask); None: held out
    gen_logprobs: Tensor        # (N, T) float32: the generator's (vLLM) logprob of each sampled token
    old_logprobs: Optional[Tensor]  # (N, T) float32: the PPO ratio's denominator (Experience.old_logprobs)
    ref_logprobs: Tensor        # (N, T) float32: the reference's logprob
    kl: Tensor                  # (N, T) float32: KL_t
    rewards: Optional[Tensor]   # (N, T) float32: the shaped reward r_t (whitened when whiten_rewards)
    advantages: Optional[Tensor]  # (N, T) float32: the policy loss's advantage (whitened when configured)
    scores: Optional[Tensor]    # (N,) float32: the sequence score (0 on a dropped row); None: not known here
    values: Optional[Tensor]    # (N, T) float32 V(s_t); None without a critic
    td_errors: Optional[Tensor]  # (N, T) float32 delta_t = r_t + gamma V_{t+1} - V_t; None without a critic
    returns: Optional[Tensor]   # (N, T) float32 G_t = A_t (raw) + V_t; None without a critic
    baselines: Optional[Tensor]  # (N,) float64: the group baseline of the score; None for an estimator without one
    groups: Optional[Tensor]    # (N,) long: the rows' group ids (RolloutBatch.groups); None = not known
    estimator: str              # advantage_estimator
    kl_coef: float              # beta of the KL in the rewards this step
    whitened: bool              # whether `advantages` were whitened (whiten_advantages, not a group estimator)
    held_out: bool = False      # an evaluation's held-out samples (held_out_rows): no update's numbers


@dataclass(frozen=True)
class SAPair:
    """One response token as the seeds' (state, action) pair. The state is the prompt followed
    by `state` (the response's text before this token); the action is the sampled token."""

    position: int               # t: the token's index in the response
    state: str                  # the response's text before the action (the prompt precedes it)
    action_id: int
    action: str                 # the action's text (what it adds to the decoded response)
    logprob: float              # log pi(a_t|s_t) as sampled (the generator, vLLM)
    old_logprob: Optional[float]  # log pi_old(a_t|s_t): the PPO ratio's denominator (the learner's, or the generator's)
    ref_logprob: float          # log pi_ref(a_t|s_t): the reference (SFT) model
    kl: float                   # KL_t (kl_estimator; k1 = logp - logp_ref)
    reward: Optional[float]     # r_t: -beta KL_t, plus the score on the last token; None: held out
    value: Optional[float]      # V(s_t); None without a critic
    td_error: Optional[float]   # delta_t; None without a critic
    advantage: Optional[float]  # A_t as the policy loss uses it; None: held out
    return_: Optional[float]    # G_t, the value model's target; None without a critic
    in_loss: bool               # whether the token is in the policy loss


@dataclass
class RolloutAttribution:
    """One rollout of a step and its SA pairs."""

    step: int                   # the PPO step whose update used it (0 = not known)
    row: int                    # its row in the step's batch
    version: int                # the adapter version that sampled it
    prompt: str
    response: str
    score: float
    baseline: Optional[float]   # the group baseline its score is compared with; None: no group estimator
    group: Optional[int]
    estimator: str
    kl_coef: float
    whitened: bool
    pairs: list[SAPair] = field(default_factory=list)
    held_out: bool = False      # a held-out evaluation sample (row: its index in the eval samples)

    def as_dict(self) -> dict:
        """One JSON line: the rollout's fields and a column per SAPair field (`state` is left
        out: it is the join of the earlier actions' texts)."""
        out = {k: getattr(self, k) for k in FIELDS}
        out["action_id"] = [p.action_id for p in self.pairs]
        out["action"] = [p.action for p in self.pairs]
        for name in NUMBERS:
            out[name.rstrip("_")] = [getattr(p, name) for p in self.pairs]
        out["in_loss"] = [p.in_loss for p in self.pairs]
        return out

    @staticmethod
    def from_dict(d: dict) -> "RolloutAttribution":
        """as_dict's line back (a missing column, e.g. value without a critic, is None)."""
        n = len(d["action_id"])
        columns = {name: d.get(name.rstrip("_")) or [None] * n for name in NUMBERS}
        pairs, state = [], ""
        for t in range(n):
            pairs.append(SAPair(t, state, d["action_id"][t], d["action"][t],
                                **{name: columns[name][t] for name in NUMBERS}, in_loss=bool(d["in_loss"][t])))
            state += d["action"][t]
        return RolloutAttribution(**{k: d.get(k) for k in FIELDS if k != "held_out"},
                                  held_out=bool(d.get("held_out", False)), pairs=pairs)


# RolloutAttribution's own fields in a JSON line (a line written before `held_out` existed reads as False).
FIELDS = ("step", "row", "version", "prompt", "response", "score", "baseline", "group", "estimator", "kl_coef",
          "whitened", "held_out")


def _texts(ids: list[int], decode: Callable[[list[int]], str]) -> list[str]:
    """Each token's text as what it adds to the decoded prefix: a byte-level token that only
    starts a character adds nothing (the prefix's trailing replacement characters are held
    back until the character completes), the one that completes it adds the character; so the
    texts join to the decoded response. A tokenizer that rewrites earlier text as the prefix
    grows (the prefix's text does not extend) gets the token's own decoding there."""
    out, before = [], ""
    for t in range(len(ids)):
        now = decode(ids[: t + 1])
        if t < len(ids) - 1:
            now = now.rstrip("\ufffd")
        out.append(now[len(before):] if now.startswith(before) else decode(ids[t: t + 1]))
        before = now
    return out


def _number(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None  # JSON has no NaN


def sa_pairs(rows: AttributionRows, decode: Callable[[list[int]], str], step: int = 0) -> list[RolloutAttribution]:
    """The rows' rollouts with their SA pairs (one per real response token), texts from `decode`
    (token ids -> text: a tokenizer's decode). `step`: the PPO step they belong to."""
    out = []
    lists = {name: None if getattr(rows, name) is None else getattr(rows, name).tolist() for name in
             ("gen_logprobs", "old_logprobs", "ref_logprobs", "kl", "rewards", "advantages", "loss_mask",
              "response_ids", "values", "td_errors", "returns")}
    for i, row in enumerate(rows.rows):
        n = int(rows.mask[i].sum())
        ids = lists["response_ids"][i][:n]
        texts = _texts(ids, decode)
        prompt = decode(rows.prompt_ids[i][rows.prompt_mask[i]].tolist())
        at = {k: (None if v is None else v[i]) for k, v in lists.items()}
        pairs = []
        for t in range(n):
            pick = {k: (None if v is None else v[t]) for k, v in at.items()}
            pairs.append(SAPair(t, "".join(texts[:t]), ids[t], texts[t], pick["gen_logprobs"], pick["old_logprobs"],
                                pick["ref_logprobs"], pick["kl"], pick["rewards"], pick["values"], pick["td_errors"],
                                pick["advantages"], pick["returns"], bool(pick["loss_mask"])))
        baseline = None if rows.baselines is None else _number(float(rows.baselines[i]))
        out.append(RolloutAttribution(
            step=step, row=row, version=rows.version, prompt=prompt, response="".join(texts),
            score=math.nan if rows.scores is None else float(rows.scores[i]), baseline=baseline,
            group=None if rows.groups is None else int(rows.groups[i]), estimator=rows.estimator,
            kl_coef=rows.kl_coef, whitened=rows.whitened, pairs=pairs, held_out=rows.held_out))
    return out


def held_out_rows(batch: RolloutBatch, ref_logprobs: Tensor, kl: Tensor, rows: Sequence[int]) -> AttributionRows:
    """An evaluation's held-out samples `rows` (`batch`, as the generator sampled them) as
    AttributionRows: the generator's and the reference's logprobs of each sampled token and
    KL_t (`kl`, of the two), all (B, T); no update used them, so the learner's numbers are
    None. On the CPU, trimmed to the longest response."""
    width = int(batch.response_mask.sum(dim=1).max()) if len(batch) else 0

    def cut(x: Tensor) -> Tensor:
        return x[:, :width].cpu()

    return AttributionRows(
        rows=list(rows), version=batch.adapter_version, prompt_ids=batch.prompt_ids.cpu(),
        prompt_mask=batch.prompt_mask.cpu(), response_ids=cut(batch.response_ids), mask=cut(batch.response_mask),
        loss_mask=None, gen_logprobs=cut(batch.gen_logprobs).float(), old_logprobs=None,
        ref_logprobs=cut(ref_logprobs).float(), kl=cut(kl).float(), rewards=None, advantages=None, scores=None,
        values=None, td_errors=None, returns=None, baselines=None, groups=None, estimator="", kl_coef=0.0,
        whitened=False, held_out=True)


def pick_rows(batch_size: int, n: int) -> list[int]:
    """The rows a step's attribution shows: the first `n` (a group estimator's samples of one
    prompt are contiguous rows, so they come together, baseline and all)."""
    return list(range(min(n, batch_size)))


def check_rows(rows: Sequence[int], batch_size: int) -> list[int]:
    """`rows` as a list, or a ValueError naming those outside the batch."""
    rows = [int(r) for r in rows]
    bad = [r for r in rows if not 0 <= r < batch_size]
    if bad:
        raise ValueError(f"attribution rows {bad} are outside the step's batch of {batch_size} rollouts")
    return rows


def select_rows(x: Optional[Tensor], rows: list[int]) -> Optional[Tensor]:
    """x's rows `rows` on the CPU (None stays None)."""
    return None if x is None else x[torch.as_tensor(rows, dtype=torch.long, device=x.device)].cpu()
