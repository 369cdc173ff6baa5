"""``envs`` has no import circle, not even one the type checker sees: the runner, the
``process``/``evaluate`` modes and the CLI see an environment through ``EnvHooks`` (and
``offline`` sees the runner through ``RunnerView``), which ``BaseEnv`` and ``EnvRunner``
satisfy; the original's one-line hand-offs to the runner are one visible mixin."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import atroposlib.envs as envs_package
from atroposlib.envs.base import BaseEnv
from atroposlib.envs.handoffs import RunnerHandoffs
from atroposlib.envs.hooks import EnvHooks, RunnerView
from atroposlib.envs.runner import EnvRunner

ENVS = Path(envs_package.__file__).parent


def _imports(path: Path) -> set[str]:
    """Every ``atroposlib.envs.X`` module ``path`` imports, ``TYPE_CHECKING`` and functions too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "atroposlib.envs":
                found |= {f"atroposlib.envs.{a.name}" for a in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {
        ".".join(name.split(".")[:3])
        for name in found
        if name.startswith("atroposlib.envs.") and name.count(".") >= 2
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_modules_of_envs_import_each_other_without_a_circle_type_level_included():
    graph = {
        f"atroposlib.envs.{path.stem}": _imports(path) - {"atroposlib.envs.server_handling"}
        for path in ENVS.glob("*.py")
        if path.stem != "__init__"
    }
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    assert "atroposlib.envs.base" not in graph["atroposlib.envs.runner"]
    assert "atroposlib.envs.runner" not in graph["atroposlib.envs.offline"]
    loop = {f"atroposlib.envs.{m}" for m in ("base", "runner", "offline", "cli", "handoffs")}
    assert not graph["atroposlib.envs.hooks"] & loop


def _members(protocol: type) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, _ in inspect.getmembers(protocol) if not n.startswith("__")}
    return {n for n in names if not n.startswith(("_is_", "_abc"))}


def test_base_env_has_every_member_the_loop_uses_and_the_runner_every_one_offline_uses(
    tmp_path,
):
    from tests.envs.trivial_env import TrivialEnv  # a concrete env, built offline

    env = TrivialEnv.__new__(TrivialEnv)
    TrivialEnv.__init__(env, *TrivialEnv.config_init(), testing=True)
    missing = sorted(name for name in _members(EnvHooks) if not hasattr(env, name))
    assert not missing, missing
    runner = EnvRunner(env)
    missing = sorted(name for name in _members(RunnerView) if not hasattr(runner, name))
    assert not missing, missing


def test_the_hand_offs_are_one_mixin_of_one_liners_that_base_env_inherits():
    assert issubclass(BaseEnv, RunnerHandoffs)
    for name, member in vars(RunnerHandoffs).items():
        if name.startswith("__") or name == "runner":
            continue
        functions = (
            [f for f in (member.fget, member.fset) if f]
            if isinstance(member, property)
            else [member]
        )
        for function in functions:
            body = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0].body
            body = [
                s
                for s in body
                if not isinstance(s, ast.Expr) or not isinstance(s.value, ast.Constant)
            ]
            assert len(body) == 1, name
            assert name not in vars(BaseEnv), f"{name} is defined on BaseEnv too"
