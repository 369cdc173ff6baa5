"""A tiny verifiers 0.4 taskset for the ``VerifiersEnv`` tests: offline, deterministic.

Each task asks for a short reply; the scorer gives 1.0 to a reply that contains the
expected word and otherwise half the fraction of the reply's characters that are letters
(so the tiny model's near-random text still scores a spread of values, and a group is
never all ties). verifiers imports a taskset as a top-level module: put
``tests/environments`` on ``PYTHONPATH`` and name taskset id ``vf_v1_tasks``. It needs
verifiers 0.4 (``.venv-verifiers``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import verifiers.v1 as vf

__all__ = ["EchoTaskset"]

WORDS = ["apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon"]


def _event_loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class EchoConfig(vf.TasksetConfig):
    """How many tasks the taskset yields and which word list offset it starts from;
    ``refuse_event_loop`` makes loading fail on a thread that runs an event loop."""

    size: int = 4
    offset: int = 0
    refuse_event_loop: bool = False


class EchoData(vf.TaskData):
    """The word the reply should contain."""

    answer: str


class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
    """One "say the word" task."""

    @vf.reward
    async def says_word(self, task: EchoData, trace: vf.Trace) -> float:
        """1.0 when the reply contains the word, else the share of letters in it."""
        reply = trace.last_reply or ""
        if task.answer in reply.lower():
            return 1.0
        if not reply:
            return 0.0
        return round(0.5 * sum(c.isalpha() for c in reply) / len(reply), 4)


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    """``size`` tasks, task i asking for ``WORDS[(offset + i) % len(WORDS)]``."""

    def load(self) -> Iterator[EchoTask]:
        if self.config.refuse_event_loop and _event_loop_running():
            raise RuntimeError("the taskset was loaded on the event loop's thread")
        for i in range(self.config.size):
            word = WORDS[(self.config.offset + i) % len(WORDS)]
            yield EchoTask(
                EchoData(
                    prompt=f"Say the word {word}.",
                    system_prompt="Answer with one word.",
                    answer=word,
                    name=f"echo-{word}",
                ),
                self.config.task,
            )
