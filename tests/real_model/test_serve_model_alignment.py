"""ManagedServer over ``atropos-serve-model`` on the real model (SmolLM2-135M-Instruct, fp32):
its 49k-token tokenizer, ChatML template and ``<|im_end|>`` end of turn.

The nodes ManagedServer records must be what the trainer can use as they are: their tokens
decode to the text the environment saw, the prompt's tokens are the tokenizer's own, the
output logprobs equal a plain HF forward pass over the same tokens (fp32, within 1e-3), a
reply ends at ``<|im_end|>`` with the token kept and the text stripped of it, and a second
turn extends the first turn's node.
"""

from __future__ import annotations

from typing import Any

import pytest

from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.server_manager import ServerManager

TOL = 1e-3
USER = [{"role": "user", "content": "What is 2+2? Answer with just the number."}]


def _manager(server: dict) -> ServerManager:
    return ServerManager(
        [
            APIServerConfig(
                base_url=server["base_url"],
                model_name=server["model"],
                server_type="vllm",
                timeout=600,
            )
        ]
    )


def _reference_logprobs(model: Any, tokens: list[int]) -> list[float]:
    """``log p(tokens[i] | tokens[:i])`` for i >= 1 from one plain forward pass."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp.gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1).tolist()


def _assert_node_matches_forward(node: Any, model: Any) -> int:
    """Every trained (unmasked) position's logprob equals the forward pass; returns how many."""
    assert len(node.tokens) == len(node.masked_tokens) == len(node.logprobs)
    ref = _reference_logprobs(model, node.tokens)
    checked = 0
    for i, (tok, masked) in enumerate(zip(node.tokens, node.masked_tokens, strict=True)):
        if masked == -100:
            assert node.logprobs[i] == 1.0
            continue
        assert masked == tok and i > 0
        assert node.logprobs[i] == pytest.approx(ref[i - 1], abs=TOL), (i, tok)
        checked += 1
    return checked


async def test_sampled_nodes_decode_to_their_text_and_match_a_forward_pass(
    real_serve_model, real_tokenizer, real_hf_model
):
    tok = real_tokenizer
    prompt = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    manager = _manager(real_serve_model)
    try:
        async with manager.managed_server(tokenizer=tok) as managed:
            await managed.chat_completion(messages=USER, n=3, max_tokens=16, temperature=1.0)
            nodes = managed.get_state()["nodes"]
    finally:
        await manager.close()
    assert len(nodes) == 3
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    assert tok.decode(prompt_ids) == prompt  # the prompt's tokens re-tokenize to the same text
    for node in nodes:
        assert node.tokens[: len(prompt_ids)] == prompt_ids
        assert node.masked_tokens[: len(prompt_ids)] == [-100] * len(prompt_ids)
        assert tok.decode(node.tokens) == node.full_text
        assert _assert_node_matches_forward(node, real_hf_model) >= 1


async def test_greedy_reply_stops_at_im_end_and_a_second_turn_extends_its_node(
    real_serve_model, real_tokenizer, real_hf_model
):
    tok = real_tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end
    manager = _manager(real_serve_model)
    try:
        async with manager.managed_server(tokenizer=tok) as managed:
            first = await managed.chat_completion(messages=USER, max_tokens=48, temperature=0.0)
            choice = first.choices[0]
            assert choice.finish_reason == "stop"
            assert "<|im_end|>" not in choice.message.content and choice.message.content
            (node1,) = managed.get_state()["nodes"]
            assert node1.tokens[-1] == im_end  # the sampled end of turn is kept for training
            assert node1.masked_tokens[-1] == im_end

            turn2 = USER + [
                {"role": "assistant", "content": choice.message.content},
                {"role": "user", "content": "And 3+3?"},
            ]
            await managed.chat_completion(messages=turn2, max_tokens=24, temperature=0.0)
            nodes = managed.get_state()["nodes"]
    finally:
        await manager.close()
    assert len(nodes) == 1  # extended in place, not a fresh node
    (node,) = nodes
    n1 = len(node1.tokens)
    assert node.tokens[:n1] == node1.tokens
    assert node.masked_tokens[:n1] == node1.masked_tokens
    assert node.logprobs[:n1] == node1.logprobs
    prompt2 = tok.apply_chat_template(turn2, tokenize=False, add_generation_prompt=True)
    assert tok.decode(node.tokens).startswith(prompt2)
    assert node.tokens.count(im_end) == prompt2.count("<|im_end|>") + (node.tokens[-1] == im_end)
    # Both turns' outputs are trained and both match the forward pass over the whole node.
    second = [i for i in range(n1, len(node.tokens)) if node.masked_tokens[i] != -100]
    assert second
    assert _assert_node_matches_forward(node, real_hf_model) == len(node1.tokens) - sum(
        m == -100 for m in node1.masked_tokens
    ) + len(second)
