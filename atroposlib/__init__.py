"""atroposlib: LLM reinforcement-learning environments, a rollout API and a GRPO trainer."""

__version__ = "0.4.0"
