"""The managed-server proxy: an HTTP server that exposes ``ManagedServer`` sessions as
OpenAI-compatible APIs.

Agent frameworks that only speak the OpenAI API point their ``base_url`` at a session
(``http://proxy/{uuid}/v1``); the proxy records every token, mask and logprob, and the
environment reads the nodes back with ``GET /{uuid}/nodes``.

Endpoints: ``POST /sessions/create``, ``POST /{uuid}/v1/chat/completions``,
``POST /{uuid}/v1/chat/completions/render``, ``POST /{uuid}/v1/completions``,
``GET /{uuid}/v1/models``, ``GET /{uuid}/nodes``, ``POST /{uuid}/reset``, ``DELETE /{uuid}``,
``GET /sessions``, ``GET /servers``, ``POST /setup``, ``GET /v1/models``, ``GET /health``.
With ``"stream": true`` the chat and text completion routes answer server-sent events in
OpenAI's chunk format (``include_usage`` honoured), after the same generation, bounds and
node recording as a plain request; an error is still a JSON error with its status.
A session keeps only the nodes of answers it delivered: a client that disconnects cancels
its generation (the upstream request is dropped and its slot freed), and a request whose
client left before the answer's end has its nodes taken back (:mod:`.delivery`;
counted in ``/health`` as ``requests_abandoned`` and ``nodes_withdrawn``).
Errors use OpenAI's format ``{"error": {"message", "type", "param", "code"}}``. Status
classes: the client's mistake (a bad field, bad template input) is a 400 naming the field;
the inference server's fault (its 5xx, an answer that is not what the protocol says, too
large, a redirect, output that cannot be encoded) is a 502 of type ``upstream_error``; an
inference server's own 4xx keeps its status with type ``upstream_error``, except 401/403/407
and 404, which say the proxy's configuration is wrong (502), so they never look like the
proxy's own authentication errors; no healthy server is a 503, a timeout a 504.

Bounds (``SessionLimits``): at most ``--max-sessions`` sessions (429 when full), evicted
after ``--session-idle-s`` unused (counted in ``/health``), ``--max-session-nodes`` nodes
per session (429), ``--max-stored-tokens`` tokens over all sessions (503), inference server
answers of at most ``--max-upstream-mb`` (502 above). ``extra_body`` is merged into the
request before it is checked, so the bounds hold for what is sent upstream.

Security (docs/design.md, "Security model"): with an API key (``--api-key``, ``--api-key-file`` or
``ATROPOS_API_KEY``) every path but ``/health`` needs ``Authorization: Bearer KEY``
(OpenAI clients send it as their ``api_key``). ``POST /setup`` points the proxy at new
inference servers, so it is refused unless a key is configured, and only to hosts that
``--allow-upstream`` allows (default: loopback). Without a key, browser pages still cannot
drive the proxy: foreign ``Origin`` 403, non-loopback ``Host`` 403 on a loopback bind,
bodies that are not JSON 415.

Modules: :mod:`.app` (``create_app``: wiring only), :mod:`.routes` (the handlers, over the
:class:`~.state.ProxyState` on ``app.state.proxy``), :mod:`.state` (sessions and their
bounds), :mod:`.protocol` (request and answer models), :mod:`.generation` and
:mod:`.delivery` (one generation request, kept only when delivered), :mod:`.upstream`
(the upstream policy and status classes), :mod:`.streaming` (server-sent events). The
command is :mod:`atroposlib.cli.proxy`; run it as (the original's path)::

    python -m atroposlib.envs.server_handling.managed_server_proxy --config servers.json --port 9100

where ``servers.json`` is a list of ``APIServerConfig`` objects, or
``{"servers": [...], "tokenizer": "name-or-path", "tool_parser": "hermes"}``.
"""
