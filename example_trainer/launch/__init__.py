"""``atropos-grpo-run``'s pieces: what to run (:mod:`.run_config`), the processes and their
supervision (:mod:`.launcher`, :mod:`.processes`, :mod:`.supervision`,
:mod:`.inference_process`), the warm-up (:mod:`.warmup`), evaluation (:mod:`.evaluation`),
the live view (:mod:`.status`) and the results on disk (:mod:`.summary`).

The command itself stays at the original's path, :mod:`example_trainer.run`.
"""
