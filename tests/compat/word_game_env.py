"""An environment file in the original's style: its own config subclass, no ``env_config_cls``.

``config_init()`` returns a ``WordGameConfig``; the fields it adds (``debug_mode``,
``dictionary_path``, ``starting_level``, ``task_name``) must be ``--env.*`` flags,
YAML keys and attributes of ``self.config``. Only ``atroposlib`` is imported, as in
a user's checkout.
"""

from typing import List, Optional, Tuple

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer


class WordGameConfig(BaseEnvConfig):
    debug_mode: bool = False
    dictionary_path: Optional[str] = None  # noqa: UP045 - written as the original envs are
    starting_level: int = 1
    task_name: str = "word_game"


class WordGameEnv(BaseEnv):
    name = "word_game"

    @classmethod
    def config_init(cls) -> Tuple[WordGameConfig, List[APIServerConfig]]:
        env_config = WordGameConfig(
            group_size=2,
            use_wandb=False,
            wandb_name="word_game",
            total_steps=2,
            steps_per_eval=0,
            max_token_length=256,
            starting_level=3,
        )
        server_configs = [
            APIServerConfig(
                model_name="word-model",
                base_url="http://localhost:9001/v1",
                api_key="x",
                num_requests_for_eval=4,
            )
        ]
        return env_config, server_configs

    async def setup(self):
        self.words = ["apple", "river", "stone", "cloud"]
        if self.config.dictionary_path:
            with open(self.config.dictionary_path) as fh:
                self.words = [w.strip() for w in fh if w.strip()]
        self.level = self.config.starting_level
        self.iter = 0

    async def get_next_item(self):
        word = self.words[self.iter % len(self.words)]
        self.iter += 1
        return word

    async def collect_trajectories(self, item) -> Tuple[ScoredDataGroup, list]:
        chat = [{"role": "user", "content": f"Level {self.level}: say a word like {item}."}]
        completion = await self.server.chat_completion(
            messages=chat, n=self.config.group_size, max_tokens=6, temperature=1.0
        )
        scores = ScoredDataGroup(tokens=[], masks=[], scores=[])
        for i, choice in enumerate(completion.choices):
            out = tokenize_for_trainer(
                self.tokenizer, chat + [{"role": "assistant", "content": choice.message.content}]
            )
            scores["tokens"].append(out["tokens"])
            scores["masks"].append(out["masks"])
            scores["scores"].append(1.0 if i % 2 == 0 else -1.0)
        if self.config.debug_mode:
            print(f"[{self.config.task_name}] debug: item {item} at level {self.level}", flush=True)
        return scores, []

    async def evaluate(self, *args, **kwargs):
        return None


if __name__ == "__main__":
    WordGameEnv.cli()
