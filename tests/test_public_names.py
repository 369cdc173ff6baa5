"""Every public name the original exposes is importable from the same module path (docs/design.md, "Differences from the original")."""

from __future__ import annotations

import importlib
import inspect

import pytest

PUBLIC_NAMES = {
    "atroposlib.api": ["app"],
    "atroposlib.api.server": ["app"],
    "atroposlib.api.utils": [
        "find_groups_summing_to_target",
        "grab_exact_from_heterogeneous_queue",
        "grab_batch_with_minimum_allocations",
    ],
    "atroposlib.envs.base": [
        "BaseEnv",
        "BaseEnvConfig",
        "ScoredDataGroup",
        "ScoredDataItem",
        "EvalHandlingEnum",
    ],
    "atroposlib.envs.constants": [
        "ENV_NAMESPACE",
        "OPENAI_NAMESPACE",
        "SERVER_MANAGER_NAMESPACE",
        "NAMESPACE_SEP",
    ],
    "atroposlib.envs.eval": ["EvalBase", "eval_runner", "pass_at_k", "evaluate_log"],
    "atroposlib.envs.teacher_distillation_env": [
        "TeacherDistillationEnv",
        "TeacherDistillationConfig",
    ],
    "atroposlib.envs.reward_fns": [
        "RewardFunction",
        "RewardRegistry",
        "CombinedReward",
        "registry",
    ],
    "atroposlib.envs.server_handling.server_baseline": [
        "APIServer",
        "ServerBaseline",
        "APIServerConfig",
        "ReasoningConfig",
        "AsyncSemWithAdaptiveWeight",
        "OpenaiConfig",
    ],
    "atroposlib.envs.server_handling.server_manager": ["ServerManager", "ServerManagerConfig"],
    "atroposlib.envs.server_handling.openai_server": ["OpenAIServer", "resolve_openai_configs"],
    "atroposlib.envs.server_handling.vllm_server": ["VLLMServer"],
    "atroposlib.envs.server_handling.sglang_server": ["SGLangServer"],
    "atroposlib.envs.server_handling.trl_vllm_server": ["TrlVllmServer"],
    "atroposlib.envs.server_handling.server_harness": ["ServerHarness"],
    "atroposlib.envs.server_handling.managed_server": [
        "ManagedServer",
        "SequenceNode",
        "DummyManagedServer",
        "ManagedServerAdapter",
    ],
    "atroposlib.envs.server_handling.managed_server_proxy": ["create_app"],
    "atroposlib.envs.server_handling.proxy_client": [],
    "atroposlib.envs.server_handling.tool_call_translator": [],
    "atroposlib.utils.tokenize_for_trainer": ["tokenize_for_trainer"],
    "atroposlib.utils.advantages": [
        "allclose_to_first",
        "compute_stats",
        "compute_discounted_returns",
        "compute_grpo_process_supervision_advantages",
    ],
    "atroposlib.utils.cli": ["merge_dicts", "get_double_dash_flags"],
    "atroposlib.utils.io": ["parse_http_response"],
    "atroposlib.utils.metrics": ["get_std_min_max_avg"],
    "atroposlib.utils.display": [],
    "atroposlib.utils.best_of_n_selection": ["select_best_index"],
    "atroposlib.utils.force_diverse_samples": ["generate_with_diverse_first_tokens"],
    "atroposlib.utils.message_history_utils": [
        "strip_thinking",
        "truncate_thinking",
        "ensure_trajectory_token_limit",
    ],
    "atroposlib.utils.tool_call_parser": [],
    "atroposlib.frontend.jsonl2html": ["generate_html", "create_html_for_group"],
    "atroposlib.type_definitions": [
        "Message",
        "Item",
        "UUID",
        "AgentStep",
        "AgentHistory",
        "Observation",
        "GameStep",
        "GameHistory",
        "EvaluationConfigGeneral",
        "EvaluationResults",
        "EvaluationMetrics",
        "EvaluationSample",
    ],
    "atroposlib.cli.run_api": ["main"],
    "example_trainer.config": ["TrainingConfig"],
    "example_trainer.training": ["compute_grpo_loss"],
    "example_trainer.api": ["check_atropos_api", "register_trainer", "get_batch"],
    "helpers.length_penalties": [
        "ThresholdLengthPenaltyConfig",
        "ThresholdLengthPenaltyCalculator",
    ],
}


@pytest.mark.parametrize("module_name", sorted(PUBLIC_NAMES))
def test_public_names_import_from_the_original_paths(module_name):
    module = importlib.import_module(module_name)
    missing = [n for n in PUBLIC_NAMES[module_name] if not hasattr(module, n)]
    assert not missing, f"{module_name} lacks {missing}"


def test_openai_config_is_an_alias_of_api_server_config():
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig, OpenaiConfig

    assert OpenaiConfig is APIServerConfig


def test_api_app_is_one_instance_at_both_paths():
    import atroposlib.api
    import atroposlib.api.server

    assert atroposlib.api.app is atroposlib.api.server.app


def test_server_manager_signature_matches_the_original():
    from atroposlib.envs.server_handling.server_manager import ServerManager

    params = inspect.signature(ServerManager.__init__).parameters
    expected = {
        "configs": inspect.Parameter.empty,
        "slurm": False,
        "testing": False,
        "max_n_completions": 8,
        "reasoning_config": None,
        "proxy_url": None,
        "use_proxy": False,
        "tool_parser": None,
    }
    for name, default in expected.items():
        assert name in params, name
        assert params[name].default == default, name


def test_server_baseline_defaults_match_the_original():
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig, ServerBaseline

    base = ServerBaseline()
    assert (base.timeout, base.num_max_requests_at_once, base.num_requests_for_eval) == (
        1200,
        512,
        64,
    )
    assert (base.model_name, base.rolling_buffer_length, base.server_type, base.tokenizer_name) == (
        "default",
        1000,
        "openai",
        "none",
    )
    cfg = APIServerConfig()
    assert (cfg.api_key, cfg.base_url, cfg.n_kwarg_is_ignored, cfg.health_check) == (
        "",
        "",
        False,
        True,
    )
