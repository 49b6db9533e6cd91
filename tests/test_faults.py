"""Actor faults at named points of a step (ppo_ray.faults) on the session's real trainer
(vLLM generator, HF scorers, PEFT learner): the run completes, and its per-step metrics,
samples and final adapter equal an uninterrupted run's exactly. No step is lost, doubled or
restarted, and no checkpoint is needed: the runs here have no run directory.

One snapshot of the session trainer (a checkpoint written once, restored before each run),
then STEPS steps straight, in each mode (synchronous and overlap_generation), as the
reference. Each case restores the snapshot, arms one fault (role x phase x before/after, or
an idle kill between calls) and runs the same steps. Tolerance: none in the synchronous
step (float32 on the CPU, seeded sampling, seeded shuffles, the learner's state restored
bit for bit, old logprobs recomputed by the learner). In overlap mode the PPO ratio's
denominator is the generator's own logprob of each sample, and vLLM's CPU kernels do not
reproduce those bit for bit from one call to the next (the same batch twice on one engine:
up to 7e-7 apart, measured), so there the samples must be equal and the numbers equal to
what such rounding allows: each old logprob within one float32 logprob tolerance of the
tiny model (TINY_LOGPROB_TOL, tests/tolerances.py), so a statistic built from them within
that tolerance times (1 + its size), and the adapter within 1% of one Adam step (lr) per
step (measured differences ~4e-8, i.e. ~1e-5 of a step). A lost or doubled step moves both
by orders of magnitude more.

The default run keeps one case per role (the reference and the reward scorer in the
synchronous step, the learner in and between updates, the generator in an overlap-mode
prefetch); the whole matrix is marked slow (a generator restart starts a vLLM engine).
"""

from __future__ import annotations

import pytest
import ray
import torch

from ppo_ray.data import bundled_prompts
from ppo_ray.faults import Fault
from tolerances import TINY_LOGPROB_TOL

pytestmark = pytest.mark.usefixtures("ray_session")

STEPS = 3  # faults hit the second step: the first one's commit exists, and in overlap mode
           # the second step's rollouts were prefetched by the first
KEYS = ("reward_mean", "kl", "policy_loss", "value_loss", "approx_kl", "clipfrac", "entropy",
        "explained_variance", "adapter_version", "response_tokens", "first_minibatch_ratio_mean")

# (role, phase, when, which step after the snapshot: 1..STEPS)
SYNC_CASES = [
    *[("generator-0", phase, when, 2) for phase in ("generate", "sync") for when in ("before", "after")],
    *[(role, "score", when, 2) for role in ("reference", "reward") for when in ("before", "after")],
    ("learner", "update", "before", 2), ("learner", "update", "after", 2),
    *[(role, "idle", "before", 2) for role in ("generator-0", "reference", "reward", "learner")],
]
OVERLAP_CASES = [
    ("generator-0", "generate", "before", 1), ("generator-0", "generate", "after", 1),  # the first step's own batch
    ("generator-0", "prefetch", "before", 2), ("generator-0", "prefetch", "after", 2),
    *[case for case in SYNC_CASES if case[1] != "generate"],
]
DEFAULT = {("sync", "reference", "score", "after"), ("sync", "reward", "score", "before"),
           ("sync", "learner", "update", "after"), ("sync", "learner", "idle", "before"),
           ("overlap", "generator-0", "prefetch", "after")}


def _cases():
    for mode, cases in (("sync", SYNC_CASES), ("overlap", OVERLAP_CASES)):
        for role, phase, when, offset in cases:
            marks = () if (mode, role, phase, when) in DEFAULT else (pytest.mark.slow,)
            yield pytest.param(mode, role, phase, when, offset, marks=marks,
                               id=f"{mode}-{role}-{phase}" + ("" if phase == "idle" else f"-{when}"))


def _final_adapter(trainer) -> dict:
    _, weights = trainer.roles.learner.current_weights.remote()
    return ray.get(weights).tensors


@pytest.fixture(scope="module")
def straight(tiny_trainer, tmp_path_factory):
    """(trainer, snapshot checkpoint, {mode: (history, final adapter)})."""
    trainer = tiny_trainer
    base = trainer.config
    trainer.run_dir = tmp_path_factory.mktemp("fault-snapshot")
    snapshot = trainer.save_checkpoint()
    trainer.run_dir = None  # the runs below write no checkpoint: recovery must not need one
    reference = {}
    for mode in ("sync", "overlap"):
        trainer.config = base.replace(overlap_generation=mode == "overlap")
        trainer.restore(snapshot)
        history = trainer.train(bundled_prompts(), steps=STEPS, progress=False)
        reference[mode] = (history, _final_adapter(trainer))
    yield trainer, snapshot, reference
    trainer.config = base


@pytest.mark.parametrize("mode,role,phase,when,offset", list(_cases()))
def test_a_fault_leaves_the_run_as_if_it_had_not_happened(straight, mode, role, phase, when, offset):
    trainer, snapshot, reference = straight
    trainer.config = trainer.config.replace(overlap_generation=mode == "overlap")
    trainer.restore(snapshot)
    start = trainer.step
    fault = Fault(role, start + offset, phase, when)
    trainer.inject_faults([fault])
    before = len(trainer.retries)
    try:
        history = trainer.train(bundled_prompts(), steps=STEPS, progress=False)
    finally:
        trainer.inject_faults([])
    failures = trainer.retries[before:]
    if phase != "idle" or role in ("generator-0", "learner"):
        # the fault fired, and its actor is the one the trainer saw fail (a restarted
        # generator or learner has lost its adapter: it must be noticed, not used)
        assert failures and failures[0]["role"] == role and failures[0]["step"] == start + offset, failures
    straight_history, straight_adapter = reference[mode]
    exact = mode == "sync"
    assert [h["step"] for h in history] == [start + i for i in range(1, STEPS + 1)]
    for got, want in zip(history, straight_history):
        for key in KEYS:
            same = got[key] == want[key] if exact else \
                abs(got[key] - want[key]) <= TINY_LOGPROB_TOL * (1 + abs(want[key]))
            assert same, f"{fault}: step {got['step']} {key}: {got[key]!r} vs {want[key]!r}"
        assert got["generated_texts"] == want["generated_texts"], f"{fault}: step {got['step']} samples differ"
    adapter = _final_adapter(trainer)
    assert adapter.keys() == straight_adapter.keys()
    for name, tensor in adapter.items():
        same = torch.equal(tensor, straight_adapter[name]) if exact else \
            torch.allclose(tensor, straight_adapter[name], rtol=0, atol=0.01 * trainer.config.learning_rate * STEPS)
        assert same, (f"{fault}: final adapter {name} differs by up to "
                      f"{(tensor - straight_adapter[name]).abs().max().item():.3g} (scale {tensor.abs().max().item():.3g})")
    # every generator holds the committed version (a restarted one was brought back to it)
    assert ray.get([g.version.remote() for g in trainer.roles.generators]) == [trainer.version]


def test_fault_specs_are_checked():
    with pytest.raises(ValueError, match="takes part in"):
        Fault("reference", 1, "update")
    with pytest.raises(ValueError, match="not one of"):
        Fault("critic", 1, "update")
    with pytest.raises(ValueError, match="when"):
        Fault("learner", 1, "update", "during")
    assert Fault("learner-1", 3, "update", "after").method == "update"
    assert Fault("generator-0", 3, "idle").method is None
