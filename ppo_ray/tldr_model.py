"""The embedded model of the default job: a 3.4M-parameter Qwen3-architecture LM that copies facts.

The default pipeline (configs/tldr-tiny.yaml: SFT -> reward model -> PPO on the bundled
TL;DR-style task, ppo_ray/tasks/tldr_synth.py) needs a policy that copies a post's facts
reliably; the 361K-parameter test model of ppo_ray/tiny_model.py copies a post's quantity
right in only ~60% of its summaries (benchmarks/RESULTS.md). This module builds the
stronger one. Its output is COMMITTED in ``ppo_ray/assets/tldr_model/`` (about 14 MB), so a
fresh machine loads it as it loads any Hugging Face directory and never pays for the
pretraining; ``model_name: embedded:tldr`` names it (ppo_ray.paths.resolve_model_path).

Rebuild it (one command; 1973 s on the 2-CPU development VM, measured while a test run
shared its CPUs; the 2400-step preset before took 780 s alone)::

    python -m ppo_ray.tldr_model --out ppo_ray/assets/tldr_model

What it is (``PRESET``):

* Architecture: Qwen3, 4 layers, hidden 256, 4 attention heads and 2 KV heads of
  ``head_dim`` 64 (vLLM's CPU attention rejects smaller heads), MLP 768, tied embeddings,
  vocabulary 1024 (byte-level BPE, EOS and a distinct pad last, as the tiny model's:
  ppo_ray/tiny_model.py explains the tokenizer, the init and the file layout). Four layers
  because copying a word from the post takes two attention hops (find the earlier
  occurrence, copy what followed it); with 2 layers and hidden 128 the same corpus gives
  61.5% all-facts-right after SFT, with 4 layers at hidden 128 88.5% (issue 13).
* Corpus: the bundled corpus (ppo_ray/assets/tiny_corpus.txt) plus ``task_documents``
  task-format documents from ``tldr_synth.pretraining_documents``: a post and its poster's
  TL;DR. Their facts come from the pretraining pool of fact tuples, which no split of the
  task holds for any seed (tldr_synth.in_pretraining_pool), so no SFT, validation or test
  post was seen in pretraining. Their TL;DRs are the ideal ones (``task_ideal_fraction``
  1.0). The task's quality mix (0.3, as the default job's SFT references) was tried
  first, as issue 13 suggested, so that the base model would not already write complete
  summaries: that model did not learn to copy quantities (after SFT on ideal references,
  30.5% of quantities right, 69.5% a wrong number), while with ideal TL;DRs it is 88%
  (benchmarks/RESULTS.md). The misses of that model were almost all a distractor's number
  or unit taken for the key quantity ("started a fight 4 times. We have been close for 8
  years" -> "8 times"), so every pretraining post now holds a number outside the key
  sentence (``task_hard_fraction`` 1.0; the task's own posts: ~60%), and pretraining is
  twice as long (4800 steps): after SFT on ideal references all three facts are right in
  96% of 200 validation posts (quantity 97.5%); 4800 steps without the hard posts gave
  90.5%. What the base model knows does not decide what PPO can add:
  SFT on the default job's mixed references makes the policy leave facts out (the quantity
  in 39-42% of its test samples), and PPO has to win the complete summaries back from the
  reward model.
* Pretraining: ``pretrain_steps`` steps of ``pretrain_batch_docs`` documents, one per
  row, next-token loss, AdamW with warmup and cosine decay, the tied embedding at 5x the
  learning rate (tiny_model._pretrain, shared code).
* Determinism: the tokenizer, the init and the data order are seeded; training runs on
  ``pretrain_threads`` torch threads. The same command on the same machine type and
  library versions rebuilds the same bytes (the build info records both; float results
  can differ on another CPU or thread count, which is why the weights are committed
  rather than rebuilt on each machine).

``BUILD_INFO_FILE`` in the directory records the preset, the corpus digests, the library
versions, the build's wall time, machine and command, the pretraining statistics, and a
few known log-probabilities that tests/test_tldr_model.py recomputes from the committed
files.

This module sits above the PPO system, with the task it pretrains on (it imports
ppo_ray.tasks.tldr_synth): nothing below the task imports it.

Importing this module has no side effects (heavy libraries are imported lazily).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import pathlib
import platform
import sys
import time
from typing import Any

from ppo_ray import tiny_model
from ppo_ray.atomic import atomic_dir
# What configs name the model, and where its committed files lie: ppo_ray.paths' (a run
# resolves the name without importing this builder or the task).
from ppo_ray.paths import TLDR_MODEL_NAME as MODEL_NAME
from ppo_ray.paths import tldr_model_dir as model_dir

__all__ = ["BUILD_INFO_FILE", "MODEL_NAME", "PRESET", "build", "known_logprobs", "model_dir", "pretraining_corpus"]

BUILD_INFO_FILE = "ppo_ray_tldr_model.json"
# Bump when the builder's output changes for the same preset.
BUILDER_VERSION = 1

PRESET: dict[str, Any] = {
    **tiny_model._ARCH_COMMON,
    **tiny_model._PRETRAIN_COMMON,
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 768,
    "pretrain_steps": 4800,
    "pretrain_batch_docs": 16,
    "pretrain_warmup_steps": 50,
    "pretrain_threads": 2,
    "task_documents": 12000,  # tldr_synth.pretraining_documents(n, seed, ideal_fraction)
    "task_seed": 0,
    "task_ideal_fraction": 1.0,  # ideal TL;DRs (see the module docstring)
    "task_hard_fraction": 1.0,  # every post with a number outside the key sentence (see the docstring)
    "stats_documents": 400,  # corpus statistics in the build info: the first N documents
}

# Texts whose log-probabilities the build records and the test recomputes: a prompt of the
# task's test split (seed 0) with its ideal summary. Few and short: a cheap check that the
# committed weights, tokenizer and config are the ones the code expects.
_KNOWN_EXAMPLES = 3


def _preset() -> dict[str, Any]:
    return json.loads(json.dumps(PRESET))  # a deep copy


def pretraining_corpus(preset: dict[str, Any] | None = None) -> list[str]:
    """The pretraining documents: the bundled corpus, then the task-format documents."""
    from ppo_ray.tasks.tldr_synth import pretraining_documents

    p = preset or _preset()
    return tiny_model.corpus_documents() + pretraining_documents(
        p["task_documents"], seed=p["task_seed"], ideal_fraction=p["task_ideal_fraction"],
        hard_fraction=p["task_hard_fraction"])


def _digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\0")
    return h.hexdigest()


# The first three test posts of the task (seed 0) with their ideal summaries, as the task
# generated them when the committed model was built (issue 30 has since made the test split
# draw other posts): literal, so the check does not move with the task's generator.
_KNOWN_TEXTS = (
    ("SUBREDDIT: r/personalfinance\n\nTITLE: Help with my friend\n\nPOST: So my friend owes me $600 for a trip. "
     "My sister says I should drop it. What are my options?\n\nTL;DR:", " My friend owes me $600 for a trip."),
    ("SUBREDDIT: r/personalfinance\n\nTITLE: Need advice about my brother\n\nPOST: My brother, who is 54, missed "
     "rent 5 times. How do I handle this?\n\nTL;DR:", " My brother missed rent 5 times."),
    ("SUBREDDIT: r/legaladvice\n\nTITLE: Help with my renter\n\nPOST: This is about my renter. She sent me a bill "
     "for $300. What are my rights here?\n\nTL;DR:", " My renter sent me a bill for $300."),
)
assert len(_KNOWN_TEXTS) == _KNOWN_EXAMPLES


def _known_texts() -> list[tuple[str, str]]:
    """(prompt, response) pairs whose log-probabilities the build records (_KNOWN_TEXTS)."""
    return [tuple(t) for t in _KNOWN_TEXTS]


def known_logprobs(path: str | os.PathLike) -> list[float]:
    """Sum of the response tokens' log-probabilities (EOS included) of the known texts under
    the model in `path` (float32, CPU), one per text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt, response in _known_texts():
            q = tok(prompt, add_special_tokens=False)["input_ids"]
            r = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = torch.tensor([q + r])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), dim=-1)
            tgt = ids[0, 1:]
            out.append(round(float(logp.gather(-1, tgt[:, None])[len(q) - 1:].sum()), 6))
    return out


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def build(out_dir: str | os.PathLike) -> pathlib.Path:
    """Build the model into `out_dir` (created; an existing directory is replaced only when
    the build succeeds). Returns the directory."""
    import torch

    preset = _preset()
    target = pathlib.Path(out_dir).expanduser().absolute()
    t0 = time.time()
    with atomic_dir(target, replace=True) as tmp:
        docs = pretraining_corpus(preset)
        torch.set_num_threads(int(preset["pretrain_threads"]))  # also the tokenizer/init phase
        model, stats = tiny_model.build_model_files(tmp, preset, docs, stats_documents=preset["stats_documents"])
        seconds = round(time.time() - t0, 1)
        info = {
            "builder": "ppo_ray.tldr_model",
            "builder_version": BUILDER_VERSION,
            "preset": preset,
            "corpus_sha256": hashlib.sha256(tiny_model._corpus_bytes()).hexdigest(),
            "documents": len(docs),
            "documents_sha256": _digest(docs),
            "versions": tiny_model._library_versions(),
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "pretrain": stats,
            "build_seconds": seconds,
            "built_on": _machine(),
            "built_at": time.strftime("%Y-%m-%d", time.gmtime()),
            "command": "python -m ppo_ray.tldr_model " + " ".join(sys.argv[1:]),
            "known_logprobs": known_logprobs(tmp),
        }
        (tmp / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ppo_ray.tldr_model", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(model_dir()), help="output directory (default: the committed one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(build(args.out))


if __name__ == "__main__":
    main()
