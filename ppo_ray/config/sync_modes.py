"""The LoRA sync modes' registry: each mode's class and what the mode can do.

A mode's class lives in the actors layer (actors.lora_sync), named here as "module:Class" so
that the config names the modes without importing vLLM or the actors (actors.lora_sync.sync_class
imports it). What the config's checks, the generator and the driver need to know of a mode is
its SyncCapabilities, here: the classes point at their entry (``LoraSync.capabilities``), and no
caller tests a mode by its name. A new mode is one class and one entry in SYNC_MODES.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class SyncCapabilities:
    """One LoRA sync mode: its name, its class, and how many adapter versions it holds."""

    name: str
    cls: str  # "module:Class" in the actors layer
    # Whether a generator's engine holds several adapter versions at once: adapter and tensor
    # sync register one vLLM adapter per version; merged sync writes one version into the
    # engine's own weights.
    several_versions: bool

    def versions_alive(self, max_staleness: int) -> int:
        """The adapter versions each generator holds at once under max_staleness k: the k + 1
        that the batches in flight were sampled with, or 1."""
        return max_staleness + 1 if self.several_versions else 1

    def oldest_kept(self, version: int, max_staleness: int) -> int:
        """The oldest adapter version the generators keep once `version` is loaded: the oldest
        a batch in flight can need, or `version` itself for a mode that holds one."""
        return version - max_staleness if self.several_versions else version

    @property
    def max_staleness_limit(self) -> Optional[int]:
        """The largest max_staleness the mode serves (None: no limit of its own). A mode that
        holds one version serves 1: a generator's calls run in order, so the batch sampled
        ahead with the previous version is generated before the next version is loaded; at 2
        a batch would need a version the weights no longer hold."""
        return None if self.several_versions else 1

    @property
    def streams(self) -> bool:
        """Whether a generator can run the batches in flight through its engine at once
        (actors.engine_loop): they are of several versions, so only a mode that holds several."""
        return self.several_versions

    @property
    def dynamic_sampling_with_staleness(self) -> bool:
        """Whether dynamic sampling works with max_staleness >= 1: a batch's extra rounds are
        sampled with its own version, which must still be held once the next one is loaded."""
        return self.several_versions


SYNC_MODES: dict[str, SyncCapabilities] = {m.name: m for m in (
    # a vLLM LoRARequest per version
    SyncCapabilities("adapter", "actors.lora_sync:AdapterSync", several_versions=True),
    # W0 + scale * B @ A loaded into the engine's weights
    SyncCapabilities("merged", "actors.lora_sync:MergedSync", several_versions=False),
    # a LoRARequest per version, registered from memory (no file)
    SyncCapabilities("tensor", "actors.lora_sync:TensorSync", several_versions=True),
)}
# mode -> "module:Class", as the config has always named them
LORA_SYNC_MODES: dict[str, str] = {name: m.cls for name, m in SYNC_MODES.items()}


def sync_mode(name: str) -> SyncCapabilities:
    """The registered mode `name`; a ValueError naming it and the registered ones."""
    try:
        return SYNC_MODES[name]
    except (KeyError, TypeError):
        raise ValueError(f"lora_sync: unknown mode {name!r}; the modes are {list(SYNC_MODES)} "
                         "(ppo_ray.config.LORA_SYNC_MODES)") from None


def modes_with(capability: str) -> list[str]:
    """The registered modes whose `capability` (a SyncCapabilities attribute) is true, in
    registry order: what an error suggests instead of the chosen mode."""
    return [name for name, m in SYNC_MODES.items() if getattr(m, capability)]
