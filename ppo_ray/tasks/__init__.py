"""The tasks, on top of the PPO system: what a run trains on and how it is judged.

- ``base``: the Task interface and the registry config.task names a task from (get_task,
  register_task; docs/TASKS.md).
- ``tldr_task``: task tldr (SFT, reward model, PPO on the bundled data; the gold judge's report).
- ``tldr_synth``: the bundled synthetic TL;DR-style task (deterministic posts, SFT and
  preference data, prompts) and its gold judge (evaluation only, never a training signal).
- ``tldr``: the real Reddit TL;DR formatting and loaders (hub ids or local JSONL/parquet in
  the SFT and preference schemas).
- ``tldr_eval``: the reward model's diagnostics on the bundled task (accuracy by pair kind,
  best-of-n).
- ``arith``: task arith, multi-digit addition scored by a verifier (RLVR).
- ``pipeline``: the stages on a task (SFT -> reward model -> PPO -> report), as launch.py runs them.
- ``evaluation``: how a policy is evaluated on held-out prompts, for the PPO stage and eval.
- ``evaluate``: ``launch.py eval RUN_DIR``, a finished run's checkpoint evaluated the same way.
- ``report_page``: the run's self-contained report.html.

They import the layers below (ppo_ray's bottom modules, the trainer, stage_tasks); nothing
below imports them.
"""
