"""The tests' guard of the demo's ports: configurations moved off them, and the ports held."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
import yaml

from infermeter.config import DEFAULT_CONFIG, Config
from infermeter.serving import free_port
from tests.demo_ports import hold
from tests.ports import embedded_addresses, off_demo_ports


def test_embedded_addresses_include_defaults_the_file_leaves_out():
    """The dashboard's and the autoscaler's ports (code defaults) are found beside the file's."""
    found = {port for _, port in embedded_addresses()}
    assert {18001, 18102, 19401, 19500, 19600}.issubset(found)  # written in defaults.yaml
    assert {19700, 19800}.issubset(found)  # defaults of config.py


def test_a_moved_configuration_names_no_demo_address():
    """Every address is moved, defaults included, and billing's listen and url stay one server."""
    moved = Config.model_validate(off_demo_ports(yaml.safe_load(DEFAULT_CONFIG.read_text())))
    dump = yaml.safe_dump(moved.model_dump(mode="json"))
    for host, port in embedded_addresses():
        assert f"{host}:{port}" not in dump
    assert moved.billing.url == f"http://{moved.billing.listen}"


def test_a_test_that_reaches_a_held_port_is_named():
    """A request to a held port is noted with its method, path and address."""
    port = free_port()
    with hold([("127.0.0.1", port)]) as contacts:
        with pytest.raises(httpx.HTTPStatusError):
            httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).raise_for_status()
        assert f"GET /metrics on 127.0.0.1:{port}" in contacts.since(0)


def test_a_contact_from_outside_this_session_is_not_blamed_on_a_test():
    """A process outside this session's tree (another session's fleet) is set apart, not blamed."""
    port = free_port()
    # Forks and lets its parent exit, so the process that connects descends from nobody here.
    code = (
        "import os, sys, time, urllib.request\n"
        "if os.fork():\n    sys.exit(0)\n"
        "time.sleep(0.5)\n"
        "try:\n"
        f"    urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=5)\n"
        "except Exception:\n    pass\n"
    )
    with hold([("127.0.0.1", port)]) as contacts:
        subprocess.run([sys.executable, "-c", code], check=True)
        deadline = time.monotonic() + 30
        while len(contacts.outside) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert contacts.since(0) == []
    assert contacts.outside[1] == f"GET /metrics on 127.0.0.1:{port}"
    assert contacts.outside[0].startswith(f"a connection to 127.0.0.1:{port} from pid ")
