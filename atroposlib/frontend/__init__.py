"""Inspection and export of rollouts.

- ``jsonl2html``: static HTML report of a rollouts jsonl (``process`` writes one).
- ``rollouts``: reading, validating and indexing scored groups (pure).
- ``viewer`` / ``viewer_app``: the ``view-run`` browser (HTML pieces; the Gradio apps).
- ``export`` / ``dataset_gen`` / ``generators``: SFT and DPO dataset building (pure selection and
  formatting; the run; the command line) for ``atropos-sft-gen`` / ``atropos-dpo-gen``.
- ``api_client``: the trainer-side client of the rollout API these tools use, and their API options.
- ``trainer_helpers``: the original tools' module-level helpers, which ``atroposlib.cli`` re-exports.
"""
