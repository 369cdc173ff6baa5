"""The run summary says what was trained: LoRA (rank, alpha, modules) or full fine-tuning."""

from __future__ import annotations

import json

from example_trainer.launch.launcher import training_description
from example_trainer.launch.run_config import RunConfig
from example_trainer.launch.summary import write_summary


def test_lora_modes_name_the_adapter_and_the_others_say_full_fine_tuning():
    lora = RunConfig(
        weight_bridge_mode="lora_only",
        trainer={"lora_r": 8, "lora_alpha": 16, "lora_target_modules": ["q_proj", "o_proj"]},
    )
    assert training_description(lora) == (
        "LoRA (peft; r 8, alpha 16, on q_proj, o_proj; weight_bridge_mode lora_only)"
    )
    assert training_description(RunConfig(weight_bridge_mode="lora_restart")).startswith(
        "LoRA (peft; r 16, alpha 32, on q_proj, v_proj;"
    )
    assert training_description(RunConfig()) == "full fine-tuning (weight_bridge_mode http_reload)"


def test_summary_md_and_json_carry_the_training_line(tmp_path):
    write_summary(tmp_path, 0, [], 0.0, None, training="full fine-tuning (x)")
    assert json.loads((tmp_path / "summary.json").read_text())["training"] == "full fine-tuning (x)"
    assert "- training: full fine-tuning (x)" in (tmp_path / "summary.md").read_text()
    write_summary(tmp_path, 0, [], 0.0, None)
    assert "training" not in json.loads((tmp_path / "summary.json").read_text())
