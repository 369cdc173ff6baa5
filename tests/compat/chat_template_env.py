"""An environment file that tokenises with ``apply_chat_template(..., tokenize=True)`` itself.

Under transformers 5 that call returns a ``BatchEncoding``, not a list of ids,
and the masks here are a numpy array: the runtime must turn both into lists of
ints before writing or sending the group, never into their text.
"""

from typing import Tuple

import numpy as np

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer


class ChatTemplateEnv(BaseEnv):
    name = "chat_template"

    @classmethod
    def config_init(cls):
        return (
            BaseEnvConfig(group_size=2, use_wandb=False, wandb_name="chat_template", total_steps=2),
            APIServerConfig(model_name="m", base_url="http://localhost:9001/v1", api_key="x"),
        )

    async def setup(self):
        self.n = 0

    async def get_next_item(self):
        self.n += 1
        return f"{self.n}+{self.n}="

    async def collect_trajectories(self, item) -> Tuple[ScoredDataGroup, list]:
        chat = [{"role": "user", "content": item}]
        completion = await self.server.chat_completion(
            messages=chat, n=self.config.group_size, max_tokens=5
        )
        group = ScoredDataGroup(tokens=[], masks=[], scores=[])
        for i, choice in enumerate(completion.choices):
            full = chat + [{"role": "assistant", "content": choice.message.content}]
            group["tokens"].append(self.tokenizer.apply_chat_template(full, tokenize=True))
            group["masks"].append(np.asarray(tokenize_for_trainer(self.tokenizer, full)["masks"]))
            group["scores"].append(float(i))
        return group, []

    async def evaluate(self, *args, **kwargs):
        return None


if __name__ == "__main__":
    ChatTemplateEnv.cli()
