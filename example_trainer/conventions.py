"""What every module that handles a batch agrees on: the label of a position without a loss
and the error for a group that cannot be trained on.

A leaf: :mod:`example_trainer.data` (batch to tensors) and :mod:`example_trainer.distill`
(the teacher's rows of a group) both raise :class:`GroupError` and mask with
:data:`IGNORE_INDEX`, and :mod:`.data` calls :mod:`.distill`; both import these from here.
"""

from __future__ import annotations

IGNORE_INDEX = -100
"""The label of a position that carries no loss (a prompt token, padding); torch's
``cross_entropy`` default."""


class GroupError(ValueError):
    """A group of the batch that cannot be trained on; the message names the field."""
