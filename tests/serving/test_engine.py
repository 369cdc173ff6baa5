"""The engine in-process: slot cache correctness under churn, chunked prefill, the
admission queue, and failures that stay with the request that caused them."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from atroposlib.http.openai_protocol import InvalidRequest
from atroposlib.serving.engine import Engine, TokenEvent
from atroposlib.serving.sampling import SamplingParams
from tests.serving.support import direct_logprobs, direct_prompt_logprobs


@pytest.fixture
async def make_engine(local_model, tokenizer):
    engines: list[Engine] = []

    async def make(**kwargs) -> Engine:
        kwargs.setdefault("max_model_len", 512)
        engine = Engine(local_model, tokenizer, **kwargs)
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()


def _direct_top(model, prompt: list[int], tokens: list[int], k: int) -> list[list[int]]:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.topk(logits, k, dim=-1).indices.tolist()


async def test_cache_matches_full_forward_as_sequences_join_and_leave(
    make_engine, local_model, tokenizer
):
    """Prompts of different lengths arrive at different times, wait for one of three
    slots, are prefilled in 8-token chunks, fork (n=2) and finish at different
    lengths, so rows keep moving between slots: every token's logprob and top-5
    still equal a plain forward pass over the whole text."""
    engine = await make_engine(max_num_seqs=3, max_prefill_tokens=8)
    storage = engine.kv.kv.data_ptr()
    texts = [
        "Hi",
        "What is 12 + 30? Think step by step, then answer.",
        "Zoe has 7 marbles and loses 2.",
        "Count: one two three four five six seven eight nine ten eleven twelve",
        "ok",
        "The quick brown fox",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    params = [
        SamplingParams(
            n=2 if i % 3 == 1 else 1,
            max_tokens=3 + 5 * (i % 4),
            temperature=0.0 if i == 4 else 1.0,
            seed=i,
            ignore_eos=True,
            logprobs=5,
            prompt_logprobs=1 if i == 3 else None,
        )
        for i in range(len(prompts))
    ]

    async def one(i: int):
        await asyncio.sleep(0.015 * i)
        return await engine.generate(prompts[i], params[i])

    results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    assert engine.kv.kv.data_ptr() == storage  # written in place, never reallocated
    assert engine.prefill_passes > 2 and engine.running == 0
    for prompt, prm, res in zip(prompts, params, results, strict=True):
        assert [len(o.token_ids) for o in res.outputs] == [prm.max_tokens] * prm.n
        for out in res.outputs:
            want = direct_logprobs(local_model, prompt, out.token_ids)
            assert max(abs(a - b) for a, b in zip(out.logprobs, want, strict=True)) < 1e-4
            tops = [[tid for tid, _ in step] for step in out.top_logprobs]
            assert tops == _direct_top(local_model, prompt, out.token_ids, 5)
    assert results[1].outputs[0].token_ids != results[1].outputs[1].token_ids
    long_prompt = results[3].prompt_logprobs
    assert long_prompt is not None and long_prompt[0] is None
    got = [entry[tok] for entry, tok in zip(long_prompt[1:], prompts[3][1:], strict=True)]
    want = direct_prompt_logprobs(local_model, prompts[3])
    assert len(prompts[3]) > 8 and max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


async def test_long_prompt_is_prefilled_in_chunks_while_a_decode_keeps_going(
    make_engine, local_model, tokenizer
):
    """A 200-token prompt with --max-prefill-tokens 16 takes 13 steps to prefill; a
    sequence already decoding gets a token in each of them instead of waiting."""
    engine = await make_engine(max_prefill_tokens=16)
    events: list[tuple[str, int]] = []
    long_ids = tokenizer.encode("one two three four five six seven eight nine ten " * 20)[:200]
    assert len(long_ids) == 200

    def listen(name):
        return lambda ev: events.append((name, ev.index))

    runner = asyncio.create_task(
        engine.generate(
            tokenizer.encode("Hello"),
            SamplingParams(max_tokens=120, ignore_eos=True),
            listener=listen("short"),
        )
    )
    while len(events) < 3:
        await asyncio.sleep(0.005)
    mark = len(events)
    long_res = await engine.generate(
        long_ids, SamplingParams(max_tokens=2, ignore_eos=True), listener=listen("long")
    )
    await runner
    first_long = next(i for i, (name, _) in enumerate(events) if name == "long")
    between = sum(1 for name, _ in events[mark:first_long] if name == "short")
    assert between >= 200 // 16 - 1  # old engine: the whole prompt in one step, ~1 token
    want = direct_logprobs(local_model, long_ids, long_res.outputs[0].token_ids)
    assert max(abs(a - b) for a, b in zip(long_res.outputs[0].logprobs, want, strict=True)) < 1e-4


async def test_requests_beyond_the_cache_wait_their_turn(make_engine, tokenizer):
    engine = await make_engine(max_num_seqs=2)
    prompt = tokenizer.encode("Tell me a story")
    peak = 0

    async def watch():
        nonlocal peak
        while True:
            peak = max(peak, engine.running)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    try:
        results = await asyncio.gather(
            *(
                engine.generate(prompt, SamplingParams(n=1 + i % 2, max_tokens=12, ignore_eos=True))
                for i in range(6)
            )
        )
    finally:
        watcher.cancel()
    assert [len(r.outputs) for r in results] == [1, 2] * 3
    assert all(len(o.token_ids) == 12 for r in results for o in r.outputs)
    assert peak == 2 and engine.cache_info()["sequences"] == 2
    with pytest.raises(InvalidRequest) as err:
        await engine.generate(prompt, SamplingParams(n=3, max_tokens=2))
    assert err.value.param == "n"


async def test_out_of_range_sampling_values_fail_only_their_request(make_engine, tokenizer):
    engine = await make_engine()
    prompt = tokenizer.encode("Hi there")
    good = asyncio.create_task(
        engine.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    )
    for bad in (SamplingParams(top_k=2**63, max_tokens=4), SamplingParams(seed=2**64)):
        with pytest.raises(InvalidRequest):
            await engine.generate(prompt, bad)
    assert len((await good).outputs[0].token_ids) == 20


async def test_a_sampling_failure_fails_only_that_request(make_engine, tokenizer):
    """A sampler that raises whenever one poisoned sequence is in its batch: the
    batch is re-sampled row by row, the poisoned request gets the error, and the
    others (streamed and not) finish with all their tokens."""
    engine = await make_engine()
    real = engine._sample

    def faulty(logits, params, gens, histories, tensors):
        if any(p.temperature == 0.777 for p in params):
            raise RuntimeError("injected sampling fault")
        return real(logits, params, gens, histories, tensors)

    engine._sample = faulty
    prompt = tokenizer.encode("Once upon a time")
    streamed: list[TokenEvent] = []
    others = [
        asyncio.create_task(
            engine.generate(
                prompt,
                SamplingParams(n=2, max_tokens=30, ignore_eos=True),
                listener=streamed.append if i == 0 else None,
            )
        )
        for i in range(3)
    ]
    while engine.generated_tokens < 10:
        await asyncio.sleep(0.005)
    with pytest.raises(RuntimeError, match="injected"):  # 60 s: a hang guard only
        await asyncio.wait_for(
            engine.generate(prompt, SamplingParams(temperature=0.777, max_tokens=30)), 60
        )
    results = await asyncio.wait_for(asyncio.gather(*others), 60)
    assert all(len(o.token_ids) == 30 for r in results for o in r.outputs)
    assert len(streamed) == 60 and sum(ev.finish_reason == "length" for ev in streamed) == 2


async def test_a_lost_forward_pass_fails_its_requests_at_once_and_serving_goes_on(
    make_engine, local_model, tokenizer, monkeypatch
):
    engine = await make_engine()
    prompt = tokenizer.encode("Once upon a time")
    forward = type(local_model).forward
    armed = {"on": False}

    def broken(self, *args, **kwargs):
        ids = kwargs.get("input_ids")
        if armed["on"] and ids is not None and ids.shape[1] == 1:
            armed["on"] = False
            raise RuntimeError("injected device fault")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(local_model), "forward", broken)
    streamed: list[TokenEvent] = []
    running = [
        asyncio.create_task(
            engine.generate(
                prompt,
                SamplingParams(max_tokens=200, ignore_eos=True),
                listener=streamed.append if i == 0 else None,
            )
        )
        for i in range(3)
    ]
    while engine.generated_tokens < 6:
        await asyncio.sleep(0.005)
    armed["on"] = True
    done, pending = await asyncio.wait(running, timeout=10)
    assert not pending
    assert all("injected" in str(t.exception()) for t in done)
    assert streamed and all(ev.finish_reason is None for ev in streamed)
    after = await asyncio.wait_for(engine.generate(prompt, SamplingParams(max_tokens=5)), 30)
    assert len(after.outputs[0].token_ids) == 5 and engine.running == 0


def test_health_reports_the_kv_cache(served, local_model):
    info = httpx.get(f"{served.url}/health", timeout=10).json()["kv_cache"]
    cfg = local_model.config
    per_seq = (
        2
        * cfg.num_hidden_layers
        * cfg.num_key_value_heads
        * (cfg.hidden_size // cfg.num_attention_heads)
        * info["max_model_len"]
        * 4
    )
    assert info["sequences"] == 256 and info["sized_by"] == "--max-num-seqs"
    assert info["bytes_per_sequence"] == per_seq
    assert info["bytes"] == per_seq * (256 + 2)
    assert info["device"] == "cpu" and info["max_prefill_tokens"] == 2048


async def test_bfloat16_cache_keeps_logprobs_within_bf16_tolerance(tiny_model_dir, tokenizer):
    """The cache takes the model's dtype (bf16 here, on CPU); logprobs stay within bf16
    rounding of a direct bf16 forward pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    engine = Engine(model, tokenizer, max_model_len=256, max_num_seqs=4, max_prefill_tokens=8)
    assert engine.kv.kv.dtype == torch.bfloat16
    await engine.start()
    try:
        prompts = [tokenizer.encode("Hi"), tokenizer.encode("What is 12 + 30? Think it over.")]
        results = await asyncio.gather(
            *(engine.generate(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts)
        )
    finally:
        await engine.stop()
    for prompt, res in zip(prompts, results, strict=True):
        out = res.outputs[0]
        want = direct_logprobs(model, prompt, out.token_ids)
        assert max(abs(a - b) for a, b in zip(out.logprobs, want, strict=True)) < 0.02


async def test_weight_swap_restarts_a_prompt_that_is_halfway_prefilled(
    local_model, tokenizer, tiny_model_dir
):
    """A prompt prefilled in chunks when new weights arrive (drain timeout 0) starts over
    on the new weights: its answer carries version 1 and matches the new model."""
    from transformers import AutoModelForCausalLM

    new_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in new_model.parameters():
            p.mul_(1.5)
    engine = Engine(
        local_model,
        tokenizer,
        max_model_len=512,
        max_prefill_tokens=4,
        swap_drain_timeout=0.0,
        loader=lambda path: new_model,
    )
    await engine.start()
    try:
        ids = tokenizer.encode("one two three four five six seven eight nine ten " * 20)[:300]
        job = asyncio.create_task(engine.generate(ids, SamplingParams(max_tokens=3)))
        while engine.prefill_passes < 3:
            await asyncio.sleep(0.001)
        assert engine.running == 1  # prefilling, not yet decoding
        info = await engine.update_weights("new")
        res = await job
    finally:
        await engine.stop()
    assert info["version"] == res.version == 1 and engine.restarted == 1
    want = direct_logprobs(new_model, ids, res.outputs[0].token_ids)
    assert max(abs(a - b) for a, b in zip(res.outputs[0].logprobs, want, strict=True)) < 1e-4
