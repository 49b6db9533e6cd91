"""A bundled, deterministic Reddit-TL;DR-style task and its gold judge.

The embedded default job runs SFT -> reward model -> PPO on a 2-core CPU with a
3.4M-parameter model (ppo_ray/tldr_model.py), so it needs a summarisation task that such
a model can learn in minutes and that can be scored without a human or an LLM judge. This module builds one
from templates, and a programmatic GOLD JUDGE for it. Pure Python, no torch.

Public API::

    generate_task(seed=0, n_train=2000, n_val=200, n_test=200, ideal_fraction=1.0) -> {"train"|"validation"|"test": [example]}
    write_task(out_dir, seed=0, n_train=2000, n_val=200, n_test=200, ideal_fraction=1.0) -> {file name: Path}
    pretraining_documents(n, seed=0, ideal_fraction=1.0) -> [str]   # the embedded model's corpus part
    in_pretraining_pool(subreddit, person, template, quantity) -> bool
    gold_details(example, summary, ended_with_eos) -> GoldScore
    gold_score(example, summary, ended_with_eos) -> float            # in [0, 1]
    gold_compare(example, a, b, eos_a=True, eos_b=True) -> 1 | 0 | -1
    win_rate(scores_a, scores_b) -> float                            # gold scores; ties count half
    fact_outcomes(example, summary) -> {"person"|"event"|"quantity": "right"|"wrong"|"missing"}
    copy_accuracy(examples, summaries) -> {fact: {right, wrong, missing, right_when_stated}, "all_right", "n"}

The task
--------
Each post is about one PERSON (``"my sister"``), one EVENT that person caused
(``"lost her job"``) and one QUANTITY (``"3 weeks"``, ``"$300"``, ``"4 times"``). Those
three are the example's ``facts``; the reference summary states all three and nothing
else, always as ``" {Person} {event with quantity}."``, e.g. ``" My sister lost her job
3 weeks ago."``. Five subreddits (relationships, personalfinance, dogs, jobs,
legaladvice) have their own people (6-10 each) and events (10-13 each); the quantity
comes from the event's kind (time: 2-9 days/weeks/months/years "ago"; money:
$200-$900; count: 2-9 times). A post is 2-5 sentences: the key sentence(s) in one of
four forms ("My sister lost her job 3 weeks ago." / "So my sister ..." / "This is about
my sister. She lost her job ..." / "My sister, who is 31, lost ..."), 0-3 distractor
sentences in random places that are NOT key facts (another person of the same
subreddit: "My brother thinks I am overreacting."; another quantity: "We have been
close for 4 years."; an age, a feeling, a place) and a closing question. A summary must
therefore depend on the post: taking the person or the number from the wrong sentence
is as bad as omitting it. Titles (6 forms) name at most the person and the event, never
the quantity, so copying the title is not a good summary.

Lengths suit the tiny model's byte-level BPE tokenizer (512 tokens, ~2 characters per
token on this text): a prompt is at most ``MAX_PROMPT_CHARS`` characters (distractors
are dropped until it fits), which is <= 120 tokens; reference summaries are 5-9 words,
11-20 tokens (tests measure both). No two examples, within or across splits, share a
(subreddit, person, event, quantity) tuple, so no test post was seen in training; and the
splits are disjoint on the (subreddit, person, event) combination (``combo_splits``: test
and validation each draw from their own 15% of each subreddit's combinations, train from
the other 70%), so no test post's person did its event in a train post (before issue 30,
195 of 200 test posts shared the combination with a train post). The test split is drawn
first, then validation, then train, from one ``random.Random(seed)``, and the combinations
depend on the seed alone: changing ``n_train`` leaves the evaluation splits unchanged.

Two pools of facts: a fixed hash puts about one (subreddit, person, event template,
quantity) tuple in three into the PRETRAINING pool (``in_pretraining_pool``).
``generate_task`` draws only from the other, the task pool, for every seed;
``pretraining_documents`` (the embedded model's pretraining corpus) only from the
pretraining pool. So no SFT, validation or test post of any seed shares its facts with a
pretraining document, while every person and event is seen in pretraining with other
quantities. (Splitting by person and event instead, so that the task's person-event pairs
are never seen in pretraining, copied about as well: quantities 90% right after SFT on
ideal references, against 88% for this split; benchmarks/RESULTS.md, issue 13.)

Reference quality (``ideal_fraction``, config ``bundled_ideal_fraction``): by default
(``generate_task``'s own, and ``PPOConfig``'s) every reference is the ideal summary; the
default job (configs/tldr-tiny.yaml) uses ``DEFAULT_IDEAL_FRACTION`` = 0.3. Real TL;DRs are written by the posters and are of mixed
quality, which is why RLHF can beat SFT on them; with ``ideal_fraction < 1`` each
reference is ideal with that probability and otherwise leaves one fact out, as a poster
might (the person as a pronoun, no quantity, or the title copied; gold about 1/3-2/3, nothing
made up). The posts, facts and preference pairs do not change (the references draw from
their own random stream). benchmarks/RESULTS.md has what PPO does with it.

Formats are the real task's (Huang et al. 2024, "The N+ Implementation Details of RLHF
with PPO"): ``prompt == ppo_ray.data.TLDR_PROMPT.format(subreddit=, title=, post=)``;
``summary``, ``chosen`` and ``rejected`` start with a space and carry NO EOS (the code
that tokenizes them appends EOS: the recipe's response is ``" " + summary + EOS``).

Preference pairs: ``chosen`` is a correct summary in one of three forms (the reference's,
"... Help?", "So ..."), ``rejected`` one of these failure kinds (``kind`` column):
``omit`` (the person replaced by a pronoun, or the quantity left out), ``wrong`` (the
person, event or quantity replaced by one that is not in the post), ``distractor`` (the
person or quantity of a distractor sentence), ``ramble`` (the summary followed by the
rest of the post: too long), ``title`` (the title copied), and ``close`` (both imperfect:
chosen omits the quantity, rejected also replaces the person by a pronoun). The two
sides pick their forms independently, so length is a weak cue: over the train split
chosen is the longer of the two ~56% of the time (``wrong``/``distractor`` pairs ~50%,
``omit``/``close`` ~80%, ``title`` ~60%, ``ramble`` 0%). Every pair has
``gold(chosen) > gold(rejected)`` (checked at generation). Train has one pair per post,
its kind drawn by ``_PAIR_WEIGHTS`` (distractor pairs, possible on about half the posts,
weighted up by issue 30: ~15% of train pairs, was ~6%); the validation and test splits
carry pairs of every kind the post can give (``pairs``; one per distractor value for
``distractor``), >= 100 of each kind on 200 posts, which the preference files of those
splits hold, so the reward model's accuracy by kind is measured on enough pairs.

The gold judge
--------------
``gold_score = clip(coverage - 0.5 * n_wrong - 0.05 * n_extra_words - 0.1 * n_repeats, 0, 1)``,
and 0 when the summary did not end with EOS:

* ``coverage``: the fraction of the example's facts found in the summary,
  case-insensitively on words (``$?[a-z0-9]+``). A fact with a digit (the quantity) must
  appear as that exact word sequence (``"3 weeks"``, ``"$300"``); any other fact needs
  all its content words (its words minus ``STOPWORDS``: ``"lost her job"`` -> {lost,
  job}) in any order, so pronouns do not matter.
* One value per slot (issue 30): the summary's values of a slot are the persons and
  events of the fixed slot tables (all subreddits) whose content words are all in the
  summary, and its quantities ("<number> <unit>" with a unit in ``UNITS``, or
  "$<number>"). ``n_wrong`` counts every value other than the key fact's, in the post or
  not (a distractor's person or quantity is as wrong as a made-up one), and a key fact
  counts for ``coverage`` only when it is the only value of its slot. So hedging, listing
  every candidate of the post, gets no credit for the slot and 0.5 off per other candidate.
* ``n_extra_words``: words beyond ``MAX_WORDS`` (12; references have 5-9).
* ``n_repeats``: repeated content words (each non-stopword occurrence after its first),
  so degenerate repetition (":) :) :)", OpenRLHF #236-style reward hacks) costs.
* No EOS means the summary was cut off at the generation limit; like the N+ recipe's
  "score replaced by -1", it gets the minimum, 0.

Ideal reference summaries score 1.0; e.g. for the post above "My sister lost her job." is
2/3, "My sister lost her job 5 weeks ago." 2/3 - 0.5 = 1/6, "My brother lost his job
3 weeks ago." also 1/6 when the brother is in a distractor sentence (in the post, but not
the fact), and "My sister and my brother lost her job 3 weeks ago." 1/6 too (hedging).

Training never sees this judge: SFT learns from the reference summaries, the reward
model from the preference pairs, PPO from the reward model. The judge is held out so
that PPO's gain is measured by something PPO did not optimise. When PPO over-optimises
the learned reward (longer outputs, repetition, slot values the RM happens to like), the
RM's score keeps rising while the gold score falls: the over-optimisation curve of Gao
et al. 2022, visible on a CPU.

Importing this module has no side effects.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from ppo_ray.data import TLDR_PROMPT

__all__ = [
    "DEFAULT_IDEAL_FRACTION",
    "MAX_PROMPT_CHARS",
    "MAX_WORDS",
    "FACT_NAMES",
    "SPLITS",
    "STOPWORDS",
    "UNITS",
    "GoldScore",
    "copy_accuracy",
    "fact_alternatives",
    "fact_outcomes",
    "combo_splits",
    "generate_task",
    "in_pretraining_pool",
    "pretraining_documents",
    "gold_compare",
    "gold_details",
    "gold_score",
    "win_rate",
    "write_task",
]

SPLITS = ("train", "validation", "test")

# The default job's reference quality (config bundled_ideal_fraction, configs/tldr-tiny.yaml;
# a test keeps the two equal): 30% of the posters' TL;DRs state every key fact, the rest
# leave one out. generate_task's own default stays 1.0.
DEFAULT_IDEAL_FRACTION = 0.3

# Prompt budget in characters, so that the generator needs no tokenizer: <= 120 tokens
# with the tiny model's tokenizer (tests measure it).
MAX_PROMPT_CHARS = 220

# Gold judge constants (module docstring).
MAX_WORDS = 12
WRONG_PENALTY = 0.5
EXTRA_WORD_PENALTY = 0.05
REPEAT_PENALTY = 0.1

STOPWORDS = frozenset(
    "a about again ago am an and are at be been but by can do does for from go he her him his "
    "how i in is it its just lot me my no not now of on or our she so that the their them they "
    "this to up us was we what with you your".split())

# --------------------------------------------------------------------------- slot tables
# People: (phrase, gender). Events: (template, quantity kind); "{pos}" is the person's
# possessive pronoun, "{q}" the quantity. Time events end in "{q} ago"; in a title or a
# fact the quantity is dropped (time) or replaced by _VAGUE (money, count).

_PRONOUNS = {"f": ("she", "her", "her"), "m": ("he", "his", "him")}  # subject, possessive, object
_VAGUE = {"money": "a lot", "count": "again"}
_TIME_UNITS = ("days", "weeks", "months", "years")
UNITS = frozenset(_TIME_UNITS + ("times",))

_SUBREDDITS: dict[str, dict] = {
    "relationships": {
        "people": [("my sister", "f"), ("my brother", "m"), ("my mom", "f"), ("my dad", "m"), ("my wife", "f"),
                   ("my bf", "m"), ("my gf", "f"), ("my friend", "m"), ("my cousin", "f"), ("my aunt", "f")],
        "events": [("lost {pos} job {q} ago", "time"), ("quit {pos} job {q} ago", "time"),
                   ("moved out {q} ago", "time"), ("ghosted me {q} ago", "time"), ("called me fat {q} ago", "time"),
                   ("took my car {q} ago", "time"), ("broke my phone {q} ago", "time"),
                   ("cancelled our plans {q}", "count"), ("lied about {pos} age {q}", "count"),
                   ("started a fight {q}", "count"), ("spent {q} on games", "money")],
        "distractors": ["{Other} says I should let it go.", "{Other} thinks I am overreacting.",
                        "We have been close for {dq}.", "I am {me_age} and {subj} is {age}."],
        "questions": ["How do I talk to {obj} about it?", "Am I wrong to be upset?",
                      "What should I do?", "Should I let it go?"],
    },
    "personalfinance": {
        "people": [("my dad", "m"), ("my mom", "f"), ("my aunt", "f"), ("my uncle", "m"), ("my sister", "f"),
                   ("my brother", "m"), ("my friend", "m"), ("my son", "m")],
        "events": [("owes me {q} for a trip", "money"), ("borrowed {q} for rent", "money"),
                   ("lost {q} on crypto", "money"), ("charged {q} to my card", "money"),
                   ("took {q} from my savings", "money"), ("wants {q} for a car", "money"),
                   ("sold my bike for {q}", "money"), ("stole {q} from me", "money"),
                   ("spent {q} on shoes", "money"), ("missed rent {q}", "count"), ("paid rent late {q}", "count"),
                   ("got laid off {q} ago", "time"), ("maxed out my card {q} ago", "time")],
        "distractors": ["{Other} says I should drop it.", "I make {mq} a week.",
                        "I am {me_age} and on a tight budget.", "{Other} thinks I am too soft."],
        "questions": ["Should I ask for the money back?", "What are my options?", "How do I handle this?"],
    },
    "dogs": {
        "people": [("my dog", "m"), ("my lab", "m"), ("my pug", "f"), ("my pup", "m"), ("my mutt", "f"),
                   ("my poodle", "f"), ("my husky", "m"), ("my corgi", "f")],
        "events": [("ate a sock {q} ago", "time"), ("bit a kid {q} ago", "time"), ("got fleas {q} ago", "time"),
                   ("started limping {q} ago", "time"), ("stopped eating {q} ago", "time"),
                   ("peed on the bed {q}", "count"), ("chewed my shoes {q}", "count"), ("ran off {q}", "count"),
                   ("threw up on the rug {q}", "count"), ("needs surgery for {q}", "money")],
        "distractors": ["{Other} is fine though.", "We got {obj} from a shelter.",
                        "{Subj} is {age} years old.", "I feel {feeling}."],
        "questions": ["Should I take {obj} to the vet?", "Is this normal?", "What should I do?"],
        "ages": (2, 12),
    },
    "jobs": {
        "people": [("my boss", "m"), ("my manager", "f"), ("my lead", "f"), ("my coworker", "m"),
                   ("my client", "f"), ("my mentor", "f"), ("my intern", "m")],
        "events": [("cut my hours {q} ago", "time"), ("lost my files {q} ago", "time"), ("cut my pay {q} ago", "time"),
                   ("moved my shift {q}", "count"), ("made me work late {q}", "count"), ("yelled at me {q}", "count"),
                   ("mocked me {q}", "count"), ("blamed me {q}", "count"), ("read my email {q}", "count"),
                   ("took my lunch {q}", "count"), ("lied to HR {q}", "count"), ("docked {q} from my pay", "money")],
        "distractors": ["I have worked here {dq}.", "{Other} says to keep my head down.",
                        "I like the rest of the team.", "I feel {feeling}."],
        "questions": ["Should I talk to HR?", "Should I quit?", "How do I handle this?"],
    },
    "legaladvice": {
        "people": [("my landlord", "m"), ("my neighbor", "f"), ("my tenant", "f"), ("my ex", "m"),
                   ("my renter", "f"), ("my host", "m")],
        "events": [("towed my car {q} ago", "time"), ("dented my car {q} ago", "time"), ("cut my tree {q} ago", "time"),
                   ("hid my mail {q} ago", "time"), ("egged my car {q}", "count"),
                   ("cut off my water {q}", "count"), ("raised the rent {q}", "count"),
                   ("sent me a bill for {q}", "money"), ("sued me for {q}", "money"), ("fined me {q}", "money"),
                   ("kept {q} of my rent", "money")],
        "distractors": ["I have lived here {dq}.", "{Other} saw the whole thing.",
                        "I live in {state}.", "I am {me_age}."],
        "questions": ["Do I need a lawyer?", "What are my rights here?", "Can I take {obj} to court?"],
    },
}

_FEELINGS = ("stressed", "hurt", "angry", "confused", "anxious", "sad", "tired")
_STATES = ("Ohio", "Texas", "Utah", "Maine", "Iowa", "Oregon")
_SHORT_QUESTIONS = ("Advice?", "Help?", "What now?")

_TITLES = ("Need advice about {p}", "{P} {title_event}", "{P} {title_event}, what now?",
           "Is it normal that {p} {title_event}?", "Help with {p}", "Not sure what to do about {p}")
_KEY_FORMS = ("{P} {E}.", "So {p} {E}.", "This is about {p}. {Subj} {E}.", "{P}, who is {age}, {E}.")
# Summary forms: "{W}"/"{w}" is who (capitalised or not), "{E}" the event. The reference is
# always the first; chosen and rejected summaries draw their forms independently, so
# that their lengths differ both ways (the RM must not learn "longer is better").
_SUMMARY_FORMS = ("{W} {E}.", "{W} {E}. {short_q}", "So {w} {E}.")

_WORD_RE = re.compile(r"\$?[a-z0-9]+")  # "$300" is one word (a quantity on its own)
_POST_RE = re.compile(r"\n\nPOST: (.*)\n\nTL;DR:", re.S)


def _words(text: str) -> list[str]:
    return _WORD_RE.findall(text.lower())


def _content(text: str) -> frozenset[str]:
    """Content words: the words of `text` minus STOPWORDS (all of them if none is left)."""
    ws = _words(text)
    return frozenset(w for w in ws if w not in STOPWORDS) or frozenset(ws)


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _event_phrase(template: str, pos: str, q: str) -> str:
    return template.format(pos=pos, q=q)


def _event_fact(template: str, kind: str, pos: str) -> str:
    """The event without its quantity: "lost her job", "borrowed a lot for rent"."""
    if kind == "time":
        return template.replace(" {q} ago", "").format(pos=pos)
    return template.format(pos=pos, q=_VAGUE[kind])


# The judge's fixed vocabulary of slot values: content-word sets of every person and
# event of every subreddit (pronoun-free, so "lost her job" and "lost his job" are one).
_PERSON_KEYS = tuple(sorted({_content(p) for s in _SUBREDDITS.values() for p, _ in s["people"]}, key=sorted))
_EVENT_KEYS = tuple(sorted({_content(_event_fact(t, k, "their")) for s in _SUBREDDITS.values()
                            for t, k in s["events"]}, key=sorted))


def _quantity(rng: random.Random, kind: str) -> str:
    if kind == "time":
        return f"{rng.randint(2, 9)} {rng.choice(_TIME_UNITS)}"
    if kind == "money":
        return f"${rng.randint(2, 9)}00"
    return f"{rng.randint(2, 9)} times"


def _other_quantity(rng: random.Random, kind: str, not_this: str) -> str:
    while True:
        q = _quantity(rng, kind)
        if q != not_this:
            return q


# --------------------------------------------------------------------------- the judge


@dataclass(frozen=True)
class GoldScore:
    """The gold judge's verdict on one summary and its parts (module docstring)."""

    score: float  # in [0, 1]
    coverage: float  # fraction of the example's facts stated
    n_wrong: int  # slot values stated that are not in the post
    n_extra_words: int  # words beyond MAX_WORDS
    n_repeats: int  # repeated content words
    ended_with_eos: bool


def _post_of(example: Mapping) -> str:
    if "post" in example:
        return example["post"]
    m = _POST_RE.search(example["prompt"])
    if m is None:
        raise ValueError(f"example has no 'post' and its prompt is not in the TL;DR format: {example['prompt']!r:.80}")
    return m.group(1)


def _has_phrase(ws: Sequence[str], phrase: Sequence[str]) -> bool:
    """Whether the words `phrase` occur contiguously in the words `ws`."""
    return f" {' '.join(phrase)} " in f" {' '.join(ws)} "


@functools.lru_cache(maxsize=4096)
def _fact_words(fact: str) -> tuple[tuple[str, ...], frozenset[str], bool]:
    """A fact's words, content words, and whether it is a quantity (has a digit); cached."""
    return tuple(_words(fact)), _content(fact), any(ch.isdigit() for ch in fact)


def _fact_present(fact: str, ws: Sequence[str], wset: frozenset[str]) -> bool:
    fw, content, is_quantity = _fact_words(fact)
    if is_quantity:  # a quantity: the exact words, in order ("3 weeks", "$300")
        return _has_phrase(ws, fw)
    return content <= wset


def _quantities(ws: Sequence[str]) -> set[str]:
    """The quantities stated: "<number> <unit>" word pairs and "$<number>" words."""
    return ({f"{a} {b}" for a, b in zip(ws, ws[1:]) if b in UNITS and a.isdigit()}
            | {w for w in ws if w[0] == "$"})


def _stated_values(ws: Sequence[str], wset: frozenset[str]) -> dict[str, set]:
    """The values of each slot that a summary states, in the judge's keys: "person" and
    "event" the content-word sets of the slot tables' values whose words are all in the
    summary, "quantity" its quantities (:func:`_quantities`). The one home of "what the
    summary claims" for the judge and the fact-copy report."""
    return {"person": {k for k in _PERSON_KEYS if k <= wset},
            "event": {k for k in _EVENT_KEYS if k <= wset},
            "quantity": _quantities(ws)}


@functools.lru_cache(maxsize=4096)
def _key_values(facts: tuple[str, str, str]) -> dict[str, object]:
    """The example's key fact of each slot, in the keys of :func:`_stated_values` (cached:
    generate_task judges every candidate pair of a post against the same facts)."""
    person, event, quantity = facts
    return {"person": _content(person), "event": _content(event), "quantity": " ".join(_words(quantity))}


def _slot_verdicts(facts: Sequence[str], ws: Sequence[str], wset: frozenset[str]) -> dict[str, tuple[bool, int]]:
    """Per slot (person, event, quantity): (key fact credited, number of other values stated).

    One value per slot: every value the summary states other than the key one is wrong,
    whether or not the post holds it (a distractor's person or quantity counts like a made-up
    one), and the key fact is credited only when it is the only value of its slot the
    summary states. So listing every candidate (hedging) gets no credit for the slot and a
    penalty per wrong candidate (gold_score's docstring)."""
    stated, keys = _stated_values(ws, wset), _key_values(tuple(facts))
    out = {}
    for name, fact in zip(FACT_NAMES, facts):
        others = len(stated[name] - {keys[name]})
        out[name] = (_fact_present(fact, ws, wset) and others == 0, others)
    return out


def _judge(facts: Sequence[str], post_ws: Sequence[str], summary: str, ended_with_eos: bool) -> GoldScore:
    ws = _words(summary)
    wset = frozenset(ws)
    verdicts = _slot_verdicts(facts, ws, wset)
    coverage = sum(credited for credited, _ in verdicts.values()) / len(facts) if facts else 0.0
    n_wrong = sum(others for _, others in verdicts.values())
    n_extra = max(0, len(ws) - MAX_WORDS)
    content = [w for w in ws if w not in STOPWORDS]
    n_repeats = len(content) - len(set(content))
    score = coverage - WRONG_PENALTY * n_wrong - EXTRA_WORD_PENALTY * n_extra - REPEAT_PENALTY * n_repeats
    score = min(1.0, max(0.0, score)) if ended_with_eos else 0.0
    return GoldScore(score=score, coverage=coverage, n_wrong=n_wrong, n_extra_words=n_extra,
                     n_repeats=n_repeats, ended_with_eos=bool(ended_with_eos))


def gold_details(example: Mapping, summary: str, ended_with_eos: bool) -> GoldScore:
    """The gold judge on one summary of one example, with its parts.

    `example` needs "facts" and either "post" or a TL;DR-format "prompt" (a row of
    ``sft_*``/``prompts_*`` files or an example of :func:`generate_task`). `summary` is
    the decoded response without EOS (leading space or not); `ended_with_eos` says
    whether the policy produced EOS (False: it was cut off at the length limit -> 0).
    """
    return _judge(example["facts"], _words(_post_of(example)), summary, ended_with_eos)


def gold_score(example: Mapping, summary: str, ended_with_eos: bool) -> float:
    """The gold score in [0, 1] (see :func:`gold_details` and the module docstring).

    ``clip(coverage - 0.5 * n_wrong - 0.05 * n_extra_words - 0.1 * n_repeats, 0, 1)``, 0
    without EOS. The hedging rule (one value per slot): for each slot (person, event,
    quantity), every value the summary states other than the key fact is wrong (0.5 off),
    whether or not the post holds it, and the key fact counts for coverage only when it is
    the slot's only value. Hence, slot by slot: right (the key alone) > missing (no value,
    -1/3 of coverage) > wrong (one other value: -1/3 and -0.5) = hedging with one other
    candidate (the key and it: -1/3 and -0.5) > hedging with k >= 2 others (-1/3 and
    -0.5 k); a hedging summary of every candidate never scores above the summary that names
    one wrong candidate instead of the key, and is below 1.0 whenever the post has a
    second candidate.
    """
    return gold_details(example, summary, ended_with_eos).score


# Two gold scores within this are a tie: the judge's sums of fractions can differ in the
# last bits between summaries that score the same.
_TIE_EPS = 1e-9


def _compare_scores(x: float, y: float) -> int:
    """1 if gold score x beats y, -1 if it loses, 0 on a tie (|x - y| <= _TIE_EPS)."""
    d = x - y
    return 0 if abs(d) <= _TIE_EPS else (1 if d > 0 else -1)


def gold_compare(example: Mapping, a: str, b: str, eos_a: bool = True, eos_b: bool = True) -> int:
    """1 if summary `a` scores higher than `b` by the gold judge, -1 if lower, 0 on a tie."""
    return _compare_scores(gold_score(example, a, eos_a), gold_score(example, b, eos_b))


def win_rate(scores_a: Sequence[float], scores_b: Sequence[float]) -> float:
    """Fraction of examples where gold score `a` beats `b`; ties count half (the one home of
    the rule: the pipeline's win_rate_ppo_vs_sft and its validation twin call it).

    E.g. the gold scores of PPO vs SFT samples on the same test prompts, or of a policy vs
    the reference summaries. 0.5 means no difference.
    """
    n = len(scores_a)
    if not n or len(scores_b) != n:
        raise ValueError(f"win_rate needs equal non-zero lengths, got {n} and {len(scores_b)} scores")
    total = sum(_compare_scores(x, y) for x, y in zip(scores_a, scores_b))
    return 0.5 + 0.5 * total / n  # win = +1, tie = 0, loss = -1 -> (wins + ties / 2) / n


FACT_NAMES = ("person", "event", "quantity")


def fact_outcomes(example: Mapping, summary: str) -> dict[str, str]:
    """Per key fact ("person", "event", "quantity"): "right" (credited as the judge's
    coverage credits it: stated, and the only value of its slot stated), "wrong" (another
    value of that slot is stated: a person or event of the slot tables, or any quantity,
    in the post or not; hedging with the key fact among others is wrong too) or "missing".
    Evaluation only, like the judge."""
    ws = _words(summary)
    verdicts = _slot_verdicts(example["facts"], ws, frozenset(ws))
    return {name: "right" if credited else "wrong" if others else "missing"
            for name, (credited, others) in verdicts.items()}


def copy_accuracy(examples: Sequence[Mapping], summaries: Sequence[str]) -> dict:
    """Fact copying over summaries of `examples`: per fact the fractions right / wrong /
    missing and ``right_when_stated`` (right / (right + wrong)), and ``all_right``, the
    fraction of summaries with every fact right (see :func:`fact_outcomes`)."""
    if not examples or len(examples) != len(summaries):
        raise ValueError(f"copy_accuracy needs equal non-zero lengths, got {len(examples)} and {len(summaries)}")
    outcomes = [fact_outcomes(ex, s) for ex, s in zip(examples, summaries)]
    n = len(outcomes)
    report: dict = {}
    for name in FACT_NAMES:
        counts = {k: sum(o[name] == k for o in outcomes) for k in ("right", "wrong", "missing")}
        stated = counts["right"] + counts["wrong"]
        report[name] = {**{k: v / n for k, v in counts.items()},
                        "right_when_stated": counts["right"] / stated if stated else None}
    report["all_right"] = sum(all(v == "right" for v in o.values()) for o in outcomes) / n
    report["n"] = n
    return report


def fact_alternatives(example: Mapping) -> dict[str, list[str]]:
    """Other values of the person and quantity slots, for probing whether a model copies
    them from the post: every other person of the example's subreddit, and every other
    quantity of the same kind that shares the number or the unit ("3 weeks": "2 weeks" ..
    "9 weeks", "3 days", "3 months", "3 years"; "$300": "$200" .. "$900")."""
    person, _, q = example["facts"]
    people = [p for p, _ in _SUBREDDITS[example["subreddit"]]["people"] if p != person]
    if q.startswith("$"):
        quantities = [f"${n}00" for n in range(2, 10)]
    else:
        number, unit = q.split(" ")
        quantities = [f"{n} {unit}" for n in range(2, 10)] + [f"{number} {u}" for u in _TIME_UNITS
                                                               if unit in _TIME_UNITS]
    return {"person": people, "quantity": sorted(set(quantities) - {q})}


# --------------------------------------------------------------------------- the generator


# The tuples (subreddit, person, event template, quantity) are split once and for all into
# two pools: about one in PRETRAIN_POOL_SHARE belongs to the pretraining pool, whose posts
# only the embedded model's pretraining corpus uses (pretraining_documents), and the rest
# to the task pool, the only one generate_task draws from, for every seed (module docstring).
PRETRAIN_POOL_SHARE = 3


def in_pretraining_pool(subreddit: str, person: str, template: str, quantity: str) -> bool:
    """Whether the fact tuple belongs to the pretraining pool (a fixed hash of the tuple)."""
    digest = hashlib.sha256("|".join((subreddit, person, template, quantity)).encode()).digest()
    return digest[0] % PRETRAIN_POOL_SHARE == 0


def _make_post(rng: random.Random, subreddit: str, used: set, pretraining: bool = False,
               combos: Sequence[tuple] | None = None) -> dict:
    """One example without its summaries; its (subreddit, person, event, quantity) is not in
    `used` and is in the task pool (`pretraining`: the pretraining pool). `combos`: the
    ((person, gender), (template, kind)) pairs of `subreddit` it may use (None: any; the
    pretraining corpus draws exactly as it did when the embedded model was built).

    Private keys (leading "_") keep what the summaries are built from.
    """
    table = _SUBREDDITS[subreddit]
    for _ in range(1000):
        if combos is None:
            person, gender = rng.choice(table["people"])
            template, kind = rng.choice(table["events"])
        else:
            (person, gender), (template, kind) = rng.choice(combos)
        q = _quantity(rng, kind)
        if (subreddit, person, template, q) not in used and in_pretraining_pool(
                subreddit, person, template, q) == pretraining:
            used.add((subreddit, person, template, q))
            break
    else:
        raise ValueError(f"r/{subreddit}: ran out of distinct (person, event, quantity) tuples; ask for fewer examples")
    subj, pos, obj = _PRONOUNS[gender]
    others = [p for p, _ in table["people"] if p != person]
    slots = {
        "p": person, "P": _cap(person), "subj": subj, "Subj": _cap(subj), "obj": obj,
        "E": _event_phrase(template, pos, q), "title_event": _event_fact(template, kind, pos),
        "age": rng.randint(*table.get("ages", (19, 60))),
        "me_age": rng.randint(19, 45), "feeling": rng.choice(_FEELINGS), "state": rng.choice(_STATES),
        # distractor quantities: never the key one ("4 years" when the key is "3 weeks")
        "dq": _other_quantity(rng, "time", q), "mq": _other_quantity(rng, "money", q),
    }
    facts = [person, slots["title_event"], q]
    title = rng.choice(_TITLES).format(**slots)
    key = rng.choice(_KEY_FORMS).format(**slots)
    question = rng.choice(table["questions"]).format(**slots)
    # 0-3 distractors (at most 5 sentences in all), each at a random place before the
    # question; dropped (last first) while the prompt is over budget. The key sentence(s)
    # and the question always stay.
    sentences = [key]
    n_key = key.count(". ") + 1
    for d in rng.sample(table["distractors"], min(rng.randint(0, 3), 4 - n_key)):
        other = rng.choice(others)  # each distractor its own other person
        sentences.insert(rng.randint(0, len(sentences)), d.format(Other=_cap(other), **slots))
    while True:
        post = " ".join(sentences + [question])
        prompt = TLDR_PROMPT.format(subreddit=subreddit, title=title, post=post)
        if len(prompt) <= MAX_PROMPT_CHARS or sentences == [key]:
            break
        sentences.remove(next(s for s in reversed(sentences) if s != key))
    return {"subreddit": subreddit, "title": title, "post": post, "prompt": prompt, "facts": facts,
            "_slots": slots, "_qkind": kind, "_template": template, "_pos": pos, "_others": others,
            "_extra": [s for s in sentences if s != key] + [question]}


def _summary(rng: random.Random, who: str, event: str, form: str | None = None) -> str:
    """" {who} {event}." in `form` (default: a random one of _SUMMARY_FORMS)."""
    form = form or rng.choice(_SUMMARY_FORMS)
    return " " + form.format(W=_cap(who), w=who, E=event, short_q=rng.choice(_SHORT_QUESTIONS))


_PAIR_KINDS = ("omit", "wrong", "distractor", "ramble", "title", "close", "garble")
# before fallbacks (distractor often has none). "garble" (a misspelt fact word) is the error
# a small SFT policy actually makes; without it the reward model never sees that failure
# and PPO has nothing to push against it (measured: RM scores of SFT samples saturated).
# "distractor" is possible on about half the posts only, so its weight is high: at 0.1
# (before issue 30) the RM trained on ~6% distractor pairs and preferred the distractor on
# validation (accuracy 0.25 on 12 pairs); at 0.3, ~15% (benchmarks/RESULTS.md, issue 30).
_PAIR_WEIGHTS = (0.12, 0.18, 0.3, 0.08, 0.04, 0.08, 0.2)


def _garble(rng: random.Random, word: str) -> str:
    """One character dropped, doubled or two swapped (a misspelling)."""
    i = rng.randrange(len(word))
    op = rng.choice(("drop", "double", "swap") if len(word) > 2 else ("double",))
    if op == "drop":
        return word[:i] + word[i + 1:]
    if op == "double":
        return word[:i] + word[i] + word[i:]
    i = min(i, len(word) - 2)
    return word[:i] + word[i + 1] + word[i] + word[i + 2:]


def _distractor_summaries(rng: random.Random, ex: dict) -> list[str]:
    """Every summary that takes the person or the quantity of one of the post's distractor
    sentences (the key event kept), one per distractor value; [] when the post has none."""
    s, post_ws = ex["_slots"], _words(ex["post"])
    options = [_summary(rng, p, s["E"]) for p in ex["_others"] if _has_phrase(post_ws, _words(p))]
    alt_q = {"time": s["dq"], "money": s["mq"]}.get(ex["_qkind"])
    if alt_q is not None and _has_phrase(post_ws, _words(alt_q)):
        options.append(_summary(rng, s["p"], _event_phrase(ex["_template"], ex["_pos"], alt_q)))
    return options


def _pair(rng: random.Random, ex: dict, kind: str) -> tuple[str, str] | None:
    """(chosen, rejected) of failure `kind`, or None when this post cannot give that kind."""
    s, table = ex["_slots"], _SUBREDDITS[ex["subreddit"]]
    who, event, no_q = s["p"], s["E"], s["title_event"]  # no_q: the event without its quantity
    post_ws = _words(ex["post"])
    chosen = _summary(rng, who, event)
    if kind == "omit":  # the person (a pronoun instead) or the quantity left out
        return chosen, rng.choice([_summary(rng, s["subj"], event), _summary(rng, who, no_q)])
    if kind == "wrong":  # one slot replaced by a value that is not in the post
        slot = rng.choice(("person", "event", "quantity"))
        if slot == "person":
            absent = [p for p, _ in table["people"] if not _content(p) <= set(post_ws)]
            return (chosen, _summary(rng, rng.choice(absent), event)) if absent else None
        if slot == "event":  # same quantity where the kinds match: only the event differs
            t, k = rng.choice([e for e in table["events"] if e[0] != ex["_template"]])
            q = ex["facts"][2] if k == ex["_qkind"] else _quantity(rng, k)
            return chosen, _summary(rng, who, _event_phrase(t, ex["_pos"], q))
        in_post = _quantities(post_ws)
        wrong_q = next(q for q in iter(lambda: _quantity(rng, ex["_qkind"]), None) if q not in in_post)
        return chosen, _summary(rng, who, _event_phrase(ex["_template"], ex["_pos"], wrong_q))
    if kind == "distractor":  # the person or quantity of a distractor sentence
        options = _distractor_summaries(rng, ex)
        return (chosen, rng.choice(options)) if options else None
    if kind == "ramble":  # right, then the rest of the post: too long
        return chosen, _summary(rng, who, event, _SUMMARY_FORMS[0]) + " " + " ".join(ex["_extra"])
    if kind == "title":
        return chosen, " " + ex["title"]
    if kind == "garble":  # a content word of a fact misspelt (same length, same shape)
        words = chosen.split(" ")
        candidates = [i for i, w in enumerate(words) if len(w.strip(".,?!")) > 3 and w.strip(".,?!").isalpha()]
        if not candidates:
            return None
        i = rng.choice(candidates)
        core = words[i].strip(".,?!")
        words[i] = words[i].replace(core, _garble(rng, core))
        return chosen, " ".join(words)
    if kind == "close":  # both imperfect, same shape: one fact missing vs two
        return _summary(rng, who, no_q), _summary(rng, s["subj"], no_q)
    raise ValueError(f"unknown pair kind {kind!r}")


def _with_pair(rng: random.Random, ex: dict) -> dict:
    """Add chosen, rejected and kind; a kind this post cannot give (or whose pair would not
    be strictly ordered by the gold judge) falls back to the others in a random order."""
    first = rng.choices(_PAIR_KINDS, weights=_PAIR_WEIGHTS)[0]
    rest = [k for k in _PAIR_KINDS if k != first]
    rng.shuffle(rest)
    post_ws = _words(ex["post"])
    for kind in [first] + rest:
        pair = _pair(rng, ex, kind)
        if pair is None:
            continue
        chosen, rejected = pair
        if _judge(ex["facts"], post_ws, chosen, True).score > _judge(ex["facts"], post_ws, rejected, True).score:
            ex["chosen"], ex["rejected"], ex["kind"] = chosen, rejected, kind
            return ex
    raise AssertionError(f"no valid preference pair for {ex['post']!r}")  # pragma: no cover


def _eval_pairs(rng: random.Random, ex: dict) -> list[dict]:
    """Preference pairs of every kind the post can give, for the evaluation splits: one per
    kind, and one per distractor value for ``distractor`` (the rarest kind: about half the
    posts have a distractor sentence with a person or a quantity of the key's kind), so that
    the reward model's accuracy by kind rests on >= 100 pairs of each on 200 posts. Only
    pairs the gold judge orders strictly, as in _with_pair."""
    post_ws = _words(ex["post"])
    out = []
    for kind in _PAIR_KINDS:
        if kind == "distractor":
            chosen = _summary(rng, ex["_slots"]["p"], ex["_slots"]["E"])
            pairs = [(chosen, r) for r in _distractor_summaries(rng, ex)]
        else:
            pairs = [p for p in [_pair(rng, ex, kind)] if p is not None]
        for chosen, rejected in pairs:
            if _judge(ex["facts"], post_ws, chosen, True).score > _judge(ex["facts"], post_ws, rejected, True).score:
                out.append({"chosen": chosen, "rejected": rejected, "kind": kind})
    return out


_FLAW_KINDS = ("pronoun", "no_quantity", "title")  # what an imperfect poster's TL;DR leaves out


def _flawed_summary(rng: random.Random, ex: dict) -> str:
    """A poster's TL;DR that leaves a fact out: the person as a pronoun, no quantity, or
    the title copied."""
    s = ex["_slots"]
    kind = rng.choice(_FLAW_KINDS)
    if kind == "pronoun":
        return _summary(rng, s["subj"], s["E"], _SUMMARY_FORMS[0])
    if kind == "no_quantity":
        return _summary(rng, s["p"], s["title_event"], _SUMMARY_FORMS[0])
    return " " + ex["title"]


# The evaluation splits' share of the (subreddit, person, event) combinations: test and
# validation each draw from their own COMBO_SHARES of them, train from the rest, so no test
# or validation post shares its person-event combination with a train post (nor test with
# validation). Assigned per (subreddit, quantity kind), so that each split gets its share
# of the quantities too (time events have 32 quantities, money and count 8).
EVAL_COMBO_SHARE = 0.15


def combo_splits(seed: int) -> dict[str, dict[str, list[tuple]]]:
    """{split: {subreddit: [((person, gender), (template, kind))]}}: the disjoint sets of
    (person, event) combinations each split of `generate_task(seed)` draws from. Test and
    validation get EVAL_COMBO_SHARE of each (subreddit, quantity kind)'s combinations each
    (at least one), train the rest; a seed-local shuffle, so it depends on nothing but
    `seed` (not on n_train)."""
    rng = random.Random(f"{seed}-combinations")
    out: dict[str, dict[str, list[tuple]]] = {split: {} for split in SPLITS}
    for subreddit in sorted(_SUBREDDITS):
        table = _SUBREDDITS[subreddit]
        for split in SPLITS:
            out[split][subreddit] = []
        for kind in ("time", "money", "count"):
            combos = [(p, e) for p in table["people"] for e in table["events"] if e[1] == kind]
            rng.shuffle(combos)
            n_eval = max(1, round(EVAL_COMBO_SHARE * len(combos)))
            out["test"][subreddit] += combos[:n_eval]
            out["validation"][subreddit] += combos[n_eval:2 * n_eval]
            out["train"][subreddit] += combos[2 * n_eval:]
    return out


def generate_task(seed: int = 0, n_train: int = 2000, n_val: int = 200, n_test: int = 200,
                  ideal_fraction: float = 1.0) -> dict[str, list[dict]]:
    """The task's splits {"train", "validation", "test"}: lists of examples.

    Each example: {"id", "subreddit", "title", "post", "prompt", "summary", "facts",
    "chosen", "rejected", "kind"}. `summary` (the reference), `chosen` and `rejected`
    start with a space and have no EOS. `kind` is the rejected summary's failure kind.
    `summary` is the ideal one with probability `ideal_fraction` (in [0, 1]), else a
    poster's TL;DR that leaves a fact out (module docstring).
    Deterministic in `seed` (one local random.Random); test is drawn first, then
    validation, then train, so the evaluation splits do not depend on n_train. The slot
    tables hold ~7,600 distinct (subreddit, person, event, quantity) tuples, ~5,100 of them
    in the task pool (the rest are the pretraining corpus'); up to ~3,300 examples in all
    are fine, more may raise ValueError (a subreddit runs out).
    """
    if not 0.0 <= ideal_fraction <= 1.0:
        raise ValueError(f"ideal_fraction must be in [0, 1], got {ideal_fraction!r}")
    rng = random.Random(seed)
    ref_rng = random.Random(f"{seed}-references")  # its own stream: posts and pairs do not depend on it
    pair_rng = random.Random(f"{seed}-evaluation-pairs")  # the evaluation splits' pairs of every kind
    used: set = set()
    subreddits = sorted(_SUBREDDITS)
    combos = combo_splits(seed)
    out: dict[str, list[dict]] = {}
    for split, n in (("test", n_test), ("validation", n_val), ("train", n_train)):
        rows = []
        for i in range(n):
            subreddit = rng.choice(subreddits)
            ex = _make_post(rng, subreddit, used, combos=combos[split][subreddit])
            ideal = _summary(rng, ex["_slots"]["p"], ex["_slots"]["E"], _SUMMARY_FORMS[0])
            ex = _with_pair(rng, ex)
            ex["summary"] = ideal if ref_rng.random() < ideal_fraction else _flawed_summary(ref_rng, ex)
            row = {"id": f"synth{seed}-{split}-{i:05d}", "subreddit": ex["subreddit"], "title": ex["title"],
                   "post": ex["post"], "prompt": ex["prompt"], "summary": ex["summary"], "facts": ex["facts"],
                   "chosen": ex["chosen"], "rejected": ex["rejected"], "kind": ex["kind"]}
            if split != "train":
                row["pairs"] = _eval_pairs(pair_rng, ex)
            rows.append(row)
        out[split] = rows
    return {split: out[split] for split in SPLITS}


def pretraining_documents(n: int, seed: int = 0, ideal_fraction: float = 1.0,
                          hard_fraction: float = 0.0) -> list[str]:
    """`n` task-format documents for pretraining the embedded model: a post of the
    PRETRAINING pool (never a tuple any generate_task split can hold) in the prompt format,
    followed by its poster's TL;DR, ideal with probability `ideal_fraction` and otherwise
    leaving a fact out, as generate_task's references do; no EOS (the builder appends it).

    `hard_fraction`: the share of posts that must hold a number outside the key sentence
    (a distractor's "I have worked here 4 years", "I make $200 a week", an age): a drawn
    post without one is redrawn with this probability. The task's own posts have such a
    number in ~60% of cases; the summaries' copy errors are almost all that number taken
    for the key quantity (benchmarks/RESULTS.md), so the embedded model is pretrained on
    them more often.

    The pool holds ~2,500 tuples, so a tuple comes back in several posts (each time with
    its own title, sentences and distractors): the posts are drawn in rounds, each round
    using a tuple at most once. Deterministic in (n, seed, ideal_fraction).
    """
    for name, value in (("ideal_fraction", ideal_fraction), ("hard_fraction", hard_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    rng = random.Random(f"pretraining-{seed}")
    ref_rng = random.Random(f"pretraining-{seed}-references")
    subreddits = sorted(_SUBREDDITS)
    used: set = set()
    docs: list[str] = []
    while len(docs) < n:
        try:
            ex = _make_post(rng, rng.choice(subreddits), used, pretraining=True)
        except ValueError:  # a subreddit's share of the pool is used up: a new round
            used = set()
            continue
        if hard_fraction and rng.random() < hard_fraction and not any(
                any(ch.isdigit() for ch in sentence) for sentence in ex["_extra"]):
            continue  # redrawn: no number outside the key sentence
        ideal = _summary(rng, ex["_slots"]["p"], ex["_slots"]["E"], _SUMMARY_FORMS[0])
        docs.append(ex["prompt"] + (ideal if ref_rng.random() < ideal_fraction else _flawed_summary(ref_rng, ex)))
    return docs


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_task(out_dir: str | Path, seed: int = 0, n_train: int = 2000, n_val: int = 200,
               n_test: int = 200, ideal_fraction: float = 1.0) -> dict[str, Path]:
    """Write the task as JSONL files under `out_dir` (created); returns {file name: path}.

    Per split (train, validation, test):

    * ``sft_{split}.jsonl``: id, subreddit, title, post, summary (the columns of
      ``vwxyzjn/summarize_from_feedback_tldr_3_filtered``) and prompt;
    * ``preferences_{split}.jsonl``: id, prompt, chosen, rejected, kind;
    * ``prompts_{split}.jsonl``: id, prompt, facts, summary (the reference): what PPO
      samples from and what the gold judge needs (:func:`gold_score` reads the post
      back from the prompt).

    Deterministic: the same arguments write byte-identical files.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    task = generate_task(seed=seed, n_train=n_train, n_val=n_val, n_test=n_test, ideal_fraction=ideal_fraction)
    columns = {
        "sft": ("id", "subreddit", "title", "post", "summary", "prompt"),
        "preferences": ("id", "prompt", "chosen", "rejected", "kind"),
        "prompts": ("id", "prompt", "facts", "summary"),
    }
    paths = {}
    for split, rows in task.items():
        for name, cols in columns.items():
            path = out / f"{name}_{split}.jsonl"
            if name == "preferences" and split != "train":  # every kind the post can give (generate_task)
                table = [{"id": f"{row['id']}-{j}", "prompt": row["prompt"], **pair}
                         for row in rows for j, pair in enumerate(row["pairs"])]
            else:
                table = [{c: row[c] for c in cols} for row in rows]
            _write_jsonl(path, table)
            paths[path.name] = path
    return paths
