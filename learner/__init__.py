"""Learner side of ppo-ray: the PPO math (``learner.algos``) and the training step."""
