"""The embedded configuration's addresses, and configurations moved off them for tests.

A test that runs servers of the embedded (demo) configuration must not use the demo's ports:
``make demo`` may be running beside ``make test``, and a test that binds one of its ports fails,
while one that reaches one talks to the demo. ``off_demo_ports`` moves every address of the
embedded configuration that a configuration still uses, explicitly or by default, to a free
port; ``tests/demo_ports.py`` holds the demo's ports to prove that the tests keep off them.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from typing import Any

from infermeter.config import DEFAULT_CONFIG, Config, load_config
from infermeter.serving import free_port, host_port

__all__ = ["embedded_addresses", "off_demo_ports"]

KeyPath = tuple[str | int, ...]


def _leaves(value: Any, path: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, (*path, index))
    else:
        yield path, value


def _address(value: Any) -> tuple[str, int] | None:
    if not isinstance(value, str):
        return None
    try:
        return host_port(value)
    except ValueError:
        return None


@functools.cache
def embedded_addresses() -> frozenset[tuple[str, int]]:
    """Every ``(host, port)`` the embedded configuration names, its defaults included."""
    dump = load_config(DEFAULT_CONFIG, environ={}).model_dump(mode="json")
    return frozenset(a for _, v in _leaves(dump) if (a := _address(v)) is not None)


def off_demo_ports(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (a configuration mapping) with each demo address it uses moved to a free port.

    Values left to their defaults are set explicitly. One demo port maps to one free port, so
    ``billing.listen`` and ``billing.url`` still name the same server.
    """
    dump = Config.model_validate(copy.deepcopy(raw)).model_dump(mode="json")
    demo = embedded_addresses()
    moved: dict[tuple[str, int], int] = {}
    for path, value in _leaves(dump):
        address = _address(value)
        if address is None or address not in demo:
            continue
        port = moved.setdefault(address, free_port(address[0]))
        host = address[0]
        _set(raw, path, value.replace(f"{host}:{address[1]}", f"{host}:{port}", 1))
    return raw


def _set(raw: Any, path: KeyPath, value: str) -> None:
    *parents, last = path
    for key in parents:
        if isinstance(key, str) and key not in raw:
            raw[key] = {}
        raw = raw[key]
    raw[last] = value
