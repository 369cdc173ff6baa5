"""``--persist`` group commit: the posts of one event-loop turn share one SQLite transaction.

An ingest route applies its group in memory with ``defer=True`` and then awaits
:meth:`GroupCommit.wait`. The first waiter schedules one commit with ``call_soon``, so it
runs after the other requests that are ready in the same turn; every post applied by
then is committed by that one transaction, and each is answered only once it is done.
A client is never told ``received`` for a group that is not on disk; a failed commit
answers every post of the group with the storage error.
"""

from __future__ import annotations

import asyncio
import logging

from atroposlib.api.errors import StorageError
from atroposlib.api.store import RolloutStore

logger = logging.getLogger(__name__)

__all__ = ["GroupCommit"]


class GroupCommit:
    """Commits the store's deferred ingest changes once per event-loop turn."""

    def __init__(self, store: RolloutStore) -> None:
        self.store = store
        self._commit: asyncio.Future | None = None

    async def wait(self) -> None:
        """Return once the deferred changes made so far are committed; raise their error."""
        ticket = self.store.pending_ticket
        if ticket is None:  # nothing deferred: in memory, or already committed
            return
        if self._commit is None:
            loop = asyncio.get_running_loop()
            self._commit = loop.create_future()
            loop.call_soon(self._run)
        # Shielded: a client that goes away must not cancel the commit the others wait for.
        await asyncio.shield(self._commit)
        if ticket.error is not None:
            raise ticket.error

    def _run(self) -> None:
        done, self._commit = self._commit, None
        try:
            self.store.flush()
        except StorageError:
            pass  # the tickets carry it to every waiting post
        except Exception:  # also carried by the tickets; logged here, as nobody else sees it
            logger.exception("group commit failed")
        finally:
            if done is not None and not done.done():
                done.set_result(None)
