"""The rollout API's name for the shared body layer: ``GZipRequestMiddleware``.

Every server's body bounds (size, in-flight budget, stall timeout, gzip inflation) are
:class:`atroposlib.http.body.BodyLimitMiddleware`, put in front of run-api by
:func:`atroposlib.http.server.build_server`; this module keeps the original's class name.
"""

from __future__ import annotations

from typing import Any

from atroposlib.http.asgi import ASGIApp
from atroposlib.http.body import BodyLimitMiddleware

__all__ = ["GZipRequestMiddleware"]


class GZipRequestMiddleware(BodyLimitMiddleware):
    """The original's name: inflates ``Content-Encoding: gzip`` request bodies (bad gzip →
    400), with the shared body bounds: bodies above ``max_bytes`` (default 256 MiB, run-api's
    ``--max-request-mb``; inflated size) get 413.

    Example::

        app = GZipRequestMiddleware(app)
    """

    def __init__(self, app: ASGIApp, max_bytes: int = 256 << 20, **kwargs: Any) -> None:
        super().__init__(app, max_bytes, inflate_gzip=True, **kwargs)
