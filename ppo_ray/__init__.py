"""ppo_ray: PPO RLHF fine-tuning of causal language models on Ray, with vLLM generation and PEFT LoRA."""
