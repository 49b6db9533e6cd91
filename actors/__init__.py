"""Ray actors of the PPO pipeline and the helpers they share.

``actors.vllm_engine`` is the one place that builds a vLLM engine (``build_llm``),
with CPU-safe settings when no CUDA device is present.
"""
