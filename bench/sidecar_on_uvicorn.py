"""The sidecar served by plain uvicorn, which gives no raw writer: a ``--sidecar-launcher``.

The sidecar's own server (``sidecar.http_server``) gives each request the client connection's
raw writer; any other ASGI server gives only ``send`` and ``receive``, and the relay then sends
a stream's blocks as ASGI messages (``sidecar.send_writer``; before it, aiohttp's relay). This
serves the unchanged ``Sidecar`` app on uvicorn (httptools, uvloop, no infermeter guard), so
``bench.sidecar_overhead`` can measure that path:

    .venv/bin/python -m bench.sidecar_overhead --quick --sidecar-launcher bench/sidecar_on_uvicorn.py

It takes the arguments of ``infermeter sidecar`` (``--config``, ``--replica``, ``--listen``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import uvicorn

from infermeter.config import load_config
from infermeter.serving import host_port
from sidecar.app import Sidecar


def main(argv: Sequence[str] | None = None) -> None:
    """Serve the sidecar of ``--replica`` on plain uvicorn where it would listen."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("command", choices=["sidecar"])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--replica", required=True)
    parser.add_argument("--listen", required=True)
    args = parser.parse_args(argv)
    app = Sidecar(load_config(args.config), args.replica)
    host, port = host_port(args.listen)
    config = uvicorn.Config(
        app, host, port, loop="uvloop", http="httptools", lifespan="on", log_level="warning"
    )
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main(sys.argv[1:])
