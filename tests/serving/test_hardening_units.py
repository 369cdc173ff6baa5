"""In-process checks of the hardening pieces: the template sandbox, template inputs, weight
roots, the prompt character bound, parameter conversion and the CLI flags."""

from __future__ import annotations

import math
import os

import pytest
from jinja2 import TemplateError
from jinja2.exceptions import SecurityError

from atroposlib.cli.serve_model import build_parser
from atroposlib.http.openai_protocol import Forbidden, InvalidRequest
from atroposlib.serving.chat_templates import ClientTemplateRenderer, split_template_kwargs
from atroposlib.serving.config import ServeModelConfig
from atroposlib.serving.loader import confine_weights_path, prompt_char_limit, weight_roots
from atroposlib.serving.protocol import MIN_TEMPERATURE, GenerateRequest
from atroposlib.serving.responses import MIN_LOGPROB, finite_logprob
from atroposlib.serving.template_worker import TemplateLimitError, render

MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello the"}]
SIMPLE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}[/]{% endfor %}"


def test_sandbox_renders_like_a_chat_template():
    tpl = (
        "{{ bos }}{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% if loop.index == 1 %}{% continue %}{% endif %}|{% endfor %}{{ tools|tojson }}"
    )
    out = render(tpl, {"messages": MSGS, "bos": "<s>", "tools": [{"a": "é"}]}, 10_000)
    assert out == '<s>hiHello the|[{"a": "é"}]'


def test_continue_final_message_cuts_after_the_last_content():
    assert render(SIMPLE, {"messages": MSGS}, 1000, continue_final_message=True) == (
        "[user]hi[/][assistant]Hello the"
    )
    with pytest.raises(TemplateError):
        render("nothing", {"messages": MSGS}, 1000, continue_final_message=True)


@pytest.mark.parametrize(
    "template,error",
    [
        ("{{ 'ab' * 600 }}", TemplateLimitError),
        ("{{ 600 * [1, 2] }}", TemplateLimitError),
        ("{% set s = 'x' * 600 %}{{ s + s }}", TemplateLimitError),
        ("{% for i in range(10) %}{{ 'x' * 200 }}{% endfor %}", TemplateLimitError),
        ("{{ 9 ** 99999 }}", SecurityError),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", SecurityError),
        ("{{ messages.append(1) }}", SecurityError),
        ("{{ raise_exception('bad role') }}", TemplateError),
    ],
)
def test_sandbox_refuses_before_building_large_or_unsafe_values(template, error):
    with pytest.raises(error):
        render(template, {"messages": []}, 1000)


def test_template_inputs_split_into_template_and_variables():
    assert split_template_kwargs({"enable_thinking": False}, None, False) == (
        None,
        {"enable_thinking": False},
    )
    assert split_template_kwargs({"chat_template": "x", "v": 1}, None, True) == ("x", {"v": 1})
    assert split_template_kwargs({"chat_template": "x"}, "y", True) == ("y", {})
    for kwargs, template, param in (
        ({"chat_template": "x"}, None, "chat_template_kwargs.chat_template"),
        (None, "x", "chat_template"),
        ({"return_dict": True}, None, "chat_template_kwargs.return_dict"),
        ({"not valid": 1}, None, "chat_template_kwargs"),
    ):
        with pytest.raises(InvalidRequest) as info:
            split_template_kwargs(kwargs, template, False)
        assert info.value.param == param


async def test_renderer_kills_an_overrunning_worker_and_recovers():
    renderer = ClientTemplateRenderer(timeout=0.5, max_chars=1000, workers=1)
    try:
        loop = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
        with pytest.raises(InvalidRequest, match="within 0.5s"):
            await renderer.render(loop, {})
        assert renderer.killed == 1 and not renderer._idle
        assert await renderer.render("{{ x }}!", {"x": "ok"}) == "ok!"
        worker = renderer._idle[0]
    finally:
        await renderer.close()
    assert worker.returncode is not None


def test_weights_path_must_resolve_inside_a_root(tmp_path):
    root = tmp_path / "ckpts"
    (root / "step_1").mkdir(parents=True)
    sibling = tmp_path / "ckpts-evil"
    sibling.mkdir()
    (root / "link").symlink_to(sibling)
    roots = [os.path.realpath(root)]
    assert confine_weights_path(str(root / "step_1"), roots) == os.path.realpath(root / "step_1")
    assert confine_weights_path(str(root / "not-yet"), roots).endswith("not-yet")
    for path in (sibling, root / "link", root / ".." / "ckpts-evil", "/", "relative/../../x"):
        with pytest.raises(Forbidden) as info:
            confine_weights_path(str(path), roots)
        assert info.value.status == 403 and info.value.param == "path"


def test_default_weight_roots_are_the_model_parent_and_the_flags(tmp_path):
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    extra = tmp_path / "run" / "checkpoints"
    config = ServeModelConfig(model=str(model), weights_root=[str(extra)])
    assert weight_roots(config) == [os.path.realpath(extra), os.path.realpath(model.parent)]
    assert weight_roots(ServeModelConfig(model="org/hub-name")) == []


def test_prompt_char_bound_never_refuses_what_fits(tokenizer):
    limit = prompt_char_limit(tokenizer, 64)
    assert limit is not None
    worst = max(tokenizer.get_vocab(), key=len)
    fits = tokenizer.convert_tokens_to_string([worst] * 63)
    assert len(fits) <= limit
    assert len(tokenizer.encode(fits, add_special_tokens=False)) < 64


def test_sampling_conversion_clamps_temperature_and_splits_integer_stops():
    body = GenerateRequest(
        prompt="x", temperature=1e-40, stop=["end", 7, 9], stop_token_ids=[9, 3], seed=2**64 - 1
    )
    params = body.sampling_params(8)
    assert params.temperature == MIN_TEMPERATURE
    assert params.stop == ["end"] and params.stop_token_ids == [9, 3, 7]
    assert GenerateRequest(prompt="x", temperature=0).sampling_params(8).temperature == 0
    assert GenerateRequest(prompt="x", stop=5).sampling_params(8).stop_token_ids == [5]


def test_logprobs_are_always_json_numbers():
    assert finite_logprob(-math.inf) == MIN_LOGPROB
    assert finite_logprob(math.nan) == MIN_LOGPROB
    assert finite_logprob(-0.5) == -0.5
    assert finite_logprob(1e-9) == 0.0


def test_security_flags_parse():
    ns = build_parser().parse_args(
        [
            "/m",
            "--weights-root",
            "/a",
            "--weights-root",
            "/b",
            "--cors-origin",
            "http://localhost:3000",
            "--allow-client-chat-template",
            "--client-template-timeout",
            "0.5",
            "--api-key-file",
            "/k",
        ]
    )
    config = ServeModelConfig(**vars(ns))
    assert config.weights_root == ["/a", "/b"]
    assert config.cors_origin == ["http://localhost:3000"]
    assert config.allow_client_chat_template is True
    assert config.client_template_timeout == 0.5 and config.api_key_file == "/k"
    defaults = ServeModelConfig(**vars(build_parser().parse_args(["/m"])))
    assert defaults.allow_client_chat_template is False and defaults.weights_root is None
