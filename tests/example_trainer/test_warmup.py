"""The cached supervised warm-up: early stop on a score, cache hit on rerun, prompt masking."""

from __future__ import annotations

import json

from environments.arithmetic_server import sft_examples
from example_trainer.launch.warmup import encode_example, sft_warmup


def test_warmup_stops_at_score_and_is_cached(tiny_model_dir, tmp_path):
    calls = []

    def score(model, tok):
        calls.append(1)
        return 0.1 * len(calls)

    out = sft_warmup(
        str(tiny_model_dir),
        sft_examples(64),
        tmp_path / "w",
        steps=50,
        lr=1e-3,
        batch_size=8,
        score_fn=score,
        stop_at_score=0.3,
        check_every=2,
    )
    marker = json.loads((tmp_path / "w" / "warmup.json").read_text())
    assert marker["steps"] == 6 and marker["score"] >= 0.3 and len(calls) == 3
    again = sft_warmup(
        str(tiny_model_dir),
        sft_examples(64),
        tmp_path / "w",
        steps=50,
        lr=1e-3,
        batch_size=8,
        score_fn=score,
        stop_at_score=0.3,
        check_every=2,
    )
    assert again == out and len(calls) == 3  # cache hit: no training, no scoring


def test_encoded_example_trains_only_on_answer_and_eos(tiny_tokenizer):
    ids, labels = encode_example(tiny_tokenizer, [{"role": "user", "content": "3+4="}], "7")
    n_prompt = labels.count(-100)
    assert ids[n_prompt:] == labels[n_prompt:]
    assert labels[-1] == tiny_tokenizer.eos_token_id
    assert tiny_tokenizer.decode(ids[n_prompt:-1]) == "7"
