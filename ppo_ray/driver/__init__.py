"""The driver layer: the PPO system on Ray below PPOTrainer (ppo_ray/trainer.py): the rollout
pipeline, the sync guard, the calls to the actors and their hosts, supervision, the cluster,
checkpoints, the run directory and where a step's numbers go (docs/ARCHITECTURE.md)."""
