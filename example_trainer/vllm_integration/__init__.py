"""The pieces behind vLLM: the routes and request bridge of
``python -m example_trainer.vllm_api_server`` (:mod:`.routes`, :mod:`.bridge`), and the
trainer's clients for vLLM's own server: in-place weight reloads (:mod:`.weights`) and LoRA
adapters (:mod:`.lora`).

The original's paths stay where they were: :mod:`example_trainer.vllm_api_server`,
:mod:`example_trainer.vllm_manager` and :mod:`example_trainer.vllm_patching`.
"""
