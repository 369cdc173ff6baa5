"""An environment file whose ``collect_trajectories`` always raises (a broken reward parser)."""

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig


class RaisingEnv(BaseEnv):
    name = "raising"

    @classmethod
    def config_init(cls):
        return (
            BaseEnvConfig(group_size=2, use_wandb=False, wandb_name="raising", total_steps=5),
            APIServerConfig(model_name="m", base_url="http://localhost:9001/v1", api_key="x"),
        )

    async def setup(self):
        self.calls = 0

    async def get_next_item(self):
        return {"question": "1+1"}

    async def collect_trajectories(self, item):
        self.calls += 1
        raise ValueError(f"broken reward parser (call {self.calls})")

    async def evaluate(self, *args, **kwargs):
        return None


if __name__ == "__main__":
    RaisingEnv.cli()
