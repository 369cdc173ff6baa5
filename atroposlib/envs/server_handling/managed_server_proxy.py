"""The original's import path of the managed-server proxy, which is now its own package,
:mod:`atroposlib.proxy` (routes, state, streaming, upstream), with its command in
:mod:`atroposlib.cli.proxy`. This module only re-exports their names.

Run::

    python -m atroposlib.envs.server_handling.managed_server_proxy --config servers.json --port 9100
"""

import logging

from atroposlib.cli.proxy import load_config, main
from atroposlib.http.openai_protocol import ChatMessage
from atroposlib.proxy.app import OPEN_PATHS, create_app
from atroposlib.proxy.protocol import (
    DEFAULT_TOOL_PARSER,
    ChatCompletionProxyRequest,
    CompletionProxyRequest,
    RenderResponse,
    SessionCreateRequest,
    SessionCreateResponse,
    SetupRequest,
    openai_error,
)
from atroposlib.proxy.state import ProxyState, SessionLimits, SessionState
from atroposlib.proxy.upstream import UpstreamPolicy

__all__ = [
    "DEFAULT_TOOL_PARSER",
    "OPEN_PATHS",
    "ChatCompletionProxyRequest",
    "ChatMessage",
    "CompletionProxyRequest",
    "ProxyState",
    "RenderResponse",
    "SessionCreateRequest",
    "SessionCreateResponse",
    "SessionLimits",
    "SessionState",
    "SetupRequest",
    "UpstreamPolicy",
    "create_app",
    "load_config",
    "main",
    "openai_error",
]

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()
