"""The tasks, on top of the PPO system: what a run trains on and how it is judged.

- ``tldr_synth``: the bundled synthetic TL;DR-style task (deterministic posts, SFT and
  preference data, prompts) and its gold judge (evaluation only, never a training signal).
- ``tldr``: the real Reddit TL;DR formatting and loaders (hub ids or local JSONL/parquet in
  the SFT and preference schemas).
- ``tldr_eval``: the reward model's diagnostics on the bundled task (accuracy by pair kind,
  best-of-n).
- ``pipeline``: SFT -> reward model -> PPO -> report, as launch.py's stages run it.

They import the layers below (ppo_ray's bottom modules, the trainer, placement); nothing
below imports them.
"""
