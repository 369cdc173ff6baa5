"""Reward functions, selectable by name from YAML through :data:`registry`.

Importing this package registers the built-in rewards: ``accuracy``,
``cascading_r1_math``, ``chandas_meter``, ``combined``, ``cosine_scaled``,
``crossword_format``, ``format``, ``r1``, ``reasoning_steps`` and ``repetition_penalty``.
"""

from atroposlib.envs.reward_fns.accuracy_reward import AccuracyReward
from atroposlib.envs.reward_fns.cascading_r1_math_reward import CascadingR1MathReward
from atroposlib.envs.reward_fns.chandas_meter_reward import ChandasMeterReward
from atroposlib.envs.reward_fns.combined_reward import CombinedReward
from atroposlib.envs.reward_fns.cosine_scaled_reward import CosineScaledReward
from atroposlib.envs.reward_fns.crossword_format_reward import CrosswordFormatReward
from atroposlib.envs.reward_fns.format_reward import FormatReward
from atroposlib.envs.reward_fns.r1_reward import R1Reward
from atroposlib.envs.reward_fns.reasoning_steps_reward import ReasoningStepsReward
from atroposlib.envs.reward_fns.registry import RewardRegistry, registry
from atroposlib.envs.reward_fns.repetition_penalty_reward import RepetitionPenaltyReward
from atroposlib.envs.reward_fns.reward_function import RewardFunction

__all__ = [
    "AccuracyReward",
    "CascadingR1MathReward",
    "ChandasMeterReward",
    "CombinedReward",
    "CosineScaledReward",
    "CrosswordFormatReward",
    "FormatReward",
    "R1Reward",
    "ReasoningStepsReward",
    "RepetitionPenaltyReward",
    "RewardFunction",
    "RewardRegistry",
    "registry",
]
