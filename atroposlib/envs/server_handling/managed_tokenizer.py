"""Which tokenizer a ``ManagedServer`` uses when none is given: the server's own, else the
one its config names."""

from __future__ import annotations

from typing import Any, Callable

from atroposlib.envs.server_handling._common import config_tokenizer_name, load_tokenizer


def own_tokenizer(server: Any) -> Any:
    """``server``'s own ``tokenizer`` attribute, or None when it has none or its lazily
    loaded one failed to load."""
    try:
        return getattr(server, "tokenizer", None)
    except ValueError:  # a backend whose lazily loaded tokenizer failed to load
        return None


def resolve_tokenizer(
    server: Any,
    load: Callable[[str], Any],
    missing: Callable[[], Exception],
    unloadable: Callable[[str], Exception],
) -> Any:
    """``server``'s own tokenizer, else ``load(name)`` of the one its config names
    (``tokenizer_name``, or ``model_name``): raises ``missing()`` when it names none and
    ``unloadable(name)`` when ``load`` gives None."""
    tokenizer = own_tokenizer(server)
    if tokenizer is not None:
        return tokenizer
    name = config_tokenizer_name(getattr(server, "config", None))
    if name is None:
        raise missing()
    tokenizer = load(name)
    if tokenizer is None:
        raise unloadable(name)
    return tokenizer


def server_tokenizer(server: Any) -> Any:
    """The tokenizer for ``server``: its own ``tokenizer`` attribute when it has one, else
    the one its config names (``tokenizer_name``, or ``model_name``); ValueError naming
    what was tried when there is none."""
    return resolve_tokenizer(
        server,
        load_tokenizer,
        lambda: ValueError(
            "ManagedServer needs a tokenizer: pass tokenizer=..., or use a server that has one "
            "or whose config names one (tokenizer_name or model_name)"
        ),
        lambda name: ValueError(
            f"ManagedServer could not load the tokenizer {name!r} named by the server config; "
            "pass tokenizer=..."
        ),
    )
