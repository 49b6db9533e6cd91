"""An injected generator/learner mismatch, for tests of the off-policy correction and the
logprob checks (imported inside the generator's Ray actor, so it imports little).

The CPU engine computes in float32, where vLLM's and the learner's logprobs of a sampled
token agree to ~1e-6: the bfloat16 mismatch that is_correction exists for does not happen
here, so tests put one into the generator's logprobs: `injected_mismatch` on a batch, or
`install` on a generator actor's host (its rollouts only: the sync check's probe is left
alone), undone by `remove`. No branch in the production step.
"""

from __future__ import annotations

from dataclasses import replace

import torch

OUTLIER = 1.0  # nats: a ratio of e > is_cap 2, the one token the correction caps or drops
NOISE = 0.05   # nats: every other token, as bfloat16 rounding moves them (within log 2 = 0.69)


def injected_mismatch(batch, outlier: float = OUTLIER, noise: float = NOISE, seed: int = 0):
    """`batch` (a RolloutBatch) with its generator logprobs below the engine's: every real
    token's by up to `noise` nats, and the first token of row 0 by exactly `outlier` nats. The
    largest gap to the learner is then `outlier`, and one token is outside the correction's
    band [1/2, 2]. Lower logprobs stay logprobs (<= 0)."""
    g = torch.Generator().manual_seed(seed)
    shift = -noise * torch.rand(batch.gen_logprobs.shape, generator=g)  # (B, T)
    shift[0, 0] = -outlier
    return replace(batch, gen_logprobs=torch.where(batch.response_mask, batch.gen_logprobs + shift, 0.0))


def install(host) -> None:
    """Make the generator behind a GeneratorHost (ppo_ray.driver.hosts) return its rollouts with
    injected_mismatch (seeded by the step); the probe's batches are unchanged. Run it in the
    actor (helpers.on_actor); a restarted actor comes back without it."""
    generator = host.generator
    generate = type(generator).generate.__get__(generator)

    def mismatched(prompts, step, prompt_offset=0, probe=False, **options):
        batch = generate(prompts, step, prompt_offset=prompt_offset, probe=probe, **options)
        return batch if probe else injected_mismatch(batch, seed=step)

    generator.generate = mismatched  # an instance attribute: Generator.probe calls it too


def remove(host) -> None:
    """Undo `install`."""
    vars(host.generator).pop("generate", None)
