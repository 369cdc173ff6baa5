"""The offline tiny model kit: tokenizer package data, deterministic builds, safe caching."""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.util
import json
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from atroposlib.tiny_model import build_tiny_model, ensure_tiny_model, load_tiny_tokenizer
from atroposlib.tiny_model.__main__ import main as tiny_main
from atroposlib.tiny_model.tokenizer import SPECIAL_TOKENS, TOKENIZER_JSON

ROOT = Path(__file__).resolve().parents[2]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tokenizer_is_small_package_data_with_chatml_specials():
    assert TOKENIZER_JSON.exists()
    assert TOKENIZER_JSON.stat().st_size < 400_000
    tok = load_tiny_tokenizer()
    assert 1000 <= len(tok) <= 4096
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for token, _special in SPECIAL_TOKENS:
        assert len(tok.encode(token)) == 1, token


def test_tokenizer_roundtrips_arbitrary_unicode_bytes():
    tok = load_tiny_tokenizer()
    text = "Ünïcödé 漢字 🙂 \t\n  tabs and  spaces \\boxed{-3.5}"
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_is_compact_on_demo_text():
    tok = load_tiny_tokenizer()
    # Digits are split one per token; words of the demo tasks are single tokens.
    assert len(tok.encode("How many apples does Alice have now?")) <= 9
    assert len(tok.encode(" the answer is")) == 3


def test_chat_template_renders_tools_and_generation_prompt():
    tok = load_tiny_tokenizer()
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    msgs = [
        {"role": "user", "content": "2+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"e": "2+2"}}}
            ],
        },
        {"role": "tool", "content": "4"},
    ]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert '"name": "calculator"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "calculator", "arguments": {"e": "2+2"}}\n</tool_call>' in text
    assert "<tool_response>\n4\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\n2+2?<|im_end|>\n"


def test_build_is_deterministic_for_a_seed(tmp_path):
    a = Path(build_tiny_model(tmp_path / "a", seed=5, num_hidden_layers=1))
    b = Path(build_tiny_model(tmp_path / "b", seed=5, num_hidden_layers=1))
    c = Path(build_tiny_model(tmp_path / "c", seed=6, num_hidden_layers=1))
    assert _digest(a / "model.safetensors") == _digest(b / "model.safetensors")
    assert _digest(a / "model.safetensors") != _digest(c / "model.safetensors")


@pytest.mark.parametrize("arch,cls", [("qwen2", "Qwen2ForCausalLM"), ("llama", "LlamaForCausalLM")])
def test_built_model_loads_with_auto_classes_and_generates(tmp_path, arch, cls):
    path = build_tiny_model(
        tmp_path / arch,
        seed=1,
        arch=arch,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == cls
    assert model.config.hidden_size == 32
    assert tok.encode("What is 7 * 8?") == load_tiny_tokenizer().encode("What is 7 * 8?")
    ids = torch.tensor([tok.encode("Hello")])
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (1, ids.shape[1] + 4)


def test_build_rejects_unknown_arch_and_size_fields(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path / "x", arch="gpt9")
    with pytest.raises(ValueError, match="hidden_sise"):
        build_tiny_model(tmp_path / "y", hidden_sise=3)


def test_ensure_is_cached_and_safe_under_concurrent_callers(tmp_path):
    target = tmp_path / "cache" / "tiny"
    barrier = threading.Barrier(3)

    def build() -> str:
        barrier.wait()
        return ensure_tiny_model(target, seed=2)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: build(), range(3)))
    assert paths == [str(target)] * 3
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny"]  # no temp dirs left
    meta = json.loads((target / "tiny_model_meta.json").read_text())
    assert meta["seed"] == 2
    AutoModelForCausalLM.from_pretrained(target)
    before = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(target, seed=2) == str(target)
    assert (target / "model.safetensors").stat().st_mtime_ns == before  # not rebuilt


def test_ensure_rebuilds_a_stale_or_broken_cache(tmp_path):
    target = tmp_path / "tiny"
    target.mkdir()
    (target / "config.json").write_text("{}")
    ensure_tiny_model(target, seed=0)
    AutoModelForCausalLM.from_pretrained(target)


def test_cli_builds_into_out_dir(tmp_path, capsys):
    out = tmp_path / "cli"
    tiny_main(["--out", str(out), "--arch", "llama", "--num-hidden-layers", "1", "--seed", "4"])
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    with pytest.raises(SystemExit):
        tiny_main(["--arch", "llama"])  # a non-default build needs --out


def test_build_script_reproduces_the_shipped_tokenizer():
    spec = importlib.util.spec_from_file_location(
        "build_tiny_tokenizer", ROOT / "scripts" / "build_tiny_tokenizer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    trained = json.loads(module.train_tokenizer().to_str())
    assert trained == json.loads(TOKENIZER_JSON.read_text())


def test_default_cache_is_keyed_by_the_transformers_major_version(tmp_path, monkeypatch):
    """A directory written by one major version is never handed to another: the
    default path names the major, and a directory whose meta records another major
    is rebuilt."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    monkeypatch.setenv("ATROPOS_TINY_MODEL_CACHE", str(tmp_path))
    path = Path(ensure_tiny_model(seed=5))
    assert path == tmp_path / f"tiny-model-5-tf{major}"
    meta_file = path / "tiny_model_meta.json"
    meta = json.loads(meta_file.read_text())
    assert meta["transformers_major"] == major
    meta["transformers_major"] = major + 1  # as if another major had written it
    meta_file.write_text(json.dumps(meta))
    assert ensure_tiny_model(seed=5) == str(path)
    assert json.loads(meta_file.read_text())["transformers_major"] == major  # rebuilt


@pytest.mark.smoke
def test_tokenizer_files_name_a_class_both_majors_load(tmp_path):
    """transformers 5 writes ``TokenizersBackend``, which 4.x cannot load; the kit writes
    ``PreTrainedTokenizerFast``, which both load to the same tokens."""
    path = build_tiny_model(tmp_path / "m", seed=1)
    config = json.loads((Path(path) / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.encode("2 + 3 = 5") == load_tiny_tokenizer().encode("2 + 3 = 5")
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False
    )
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
