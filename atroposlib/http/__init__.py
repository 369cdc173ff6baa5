"""The HTTP layer every server we ship shares (run-api, serve-model, the proxy, view-run),
and the HTTP client stack our processes use to reach them.

One module per job:

* :mod:`~atroposlib.http.asgi`: the ASGI types (Starlette's);
* :mod:`~atroposlib.http.answers`: writing whole answers, the two error shapes;
* :mod:`~atroposlib.http.body`: reading request bodies under a size bound, an in-flight
  budget and a stall timeout, and the body layer built on it;
* :mod:`~atroposlib.http.security`: the browser guard and bearer auth;
* :mod:`~atroposlib.http.server`: :func:`~atroposlib.http.server.build_server`, the one
  stack (guard -> CORS -> auth -> size limit) in front of every server;
* :mod:`~atroposlib.http.transport`: the write-coalescing, bounded uvicorn protocol;
* :mod:`~atroposlib.http.headers`: header names our servers and clients agree on;
* :mod:`~atroposlib.http.openai_protocol`: the OpenAI request models, and
  :mod:`~atroposlib.http.openai_errors`, the error envelope (imported through it);
* :mod:`~atroposlib.http.client_session`: the one client stack, ``aiohttp`` sessions with
  our bounds (proxies and ``SSL_CERT_FILE`` from the environment, answers bounded, the
  errors of an answer that is not HTTP), and :mod:`~atroposlib.http.httpx_transport`, the
  same stack under ``httpx``'s interface (the environments' rollout-API calls);
* :mod:`~atroposlib.http.trainer_client`: the trainer's side of the rollout API (register,
  pull and acknowledge batches), shared by the example trainer, the tools and the fake trainer.

This package imports nothing from ``atroposlib`` outside it and ``atroposlib.utils``.
"""
