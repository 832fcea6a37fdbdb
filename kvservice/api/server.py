"""``kvservice api``: the OpenAI-compatible HTTP API as a process of its own.

It is one more client of the allocator and the workers: an ``Engine`` with its own lease
(credentials from the ``KVSERVICE_*`` variables, as every client), serving HTTP with
uvicorn. ``/metrics`` is on the same port.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from pathlib import Path

from kvservice.common.grpc import write_port_file

log = logging.getLogger("kvservice.api")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``api`` subcommand's flags."""
    p.add_argument("--allocator", default=os.environ.get("KVSERVICE_ALLOCATOR", "127.0.0.1:50051"),
                   help="host:port of the allocator (default $KVSERVICE_ALLOCATOR or 127.0.0.1:50051); the "
                        "workers are its pools' addresses")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000; 0: any free port)")
    p.add_argument("--port-file", default="", help="write '<port>\\n<model>\\n<port>' here once serving")
    p.add_argument("--model-name", default="", help="the model's id in /v1/models (default: the workers' preset)")
    p.add_argument("--api-key-file", default="",
                   help="a file holding the API key every /v1 call must send as 'Authorization: Bearer <key>' "
                        "(default $KVSERVICE_API_KEY; neither: no key asked)")
    p.add_argument("--tls-cert", default="", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key", default="", help="... and this key")
    p.add_argument("--max-num-seqs", type=int, default=64, help="running sequences at most (default 64)")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests that may wait for KV blocks; one more gets 429 (default 64)")
    p.add_argument("--default-max-tokens", type=int, default=512,
                   help="a chat's max_tokens when the request gives none (default 512)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")


def _api_key(args: argparse.Namespace) -> str:
    if args.api_key_file:
        key = Path(args.api_key_file).read_text().strip()
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
        return key
    return os.environ.get("KVSERVICE_API_KEY", "").strip()


def main(args: argparse.Namespace) -> int:
    """Connects the engine, then serves until SIGINT / SIGTERM."""
    import uvicorn

    from kvservice.api.app import Settings, create_app
    from kvservice.engine import Engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if bool(args.tls_cert) != bool(args.tls_key):
        print("kvservice api: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    try:
        key = _api_key(args)
        engine = Engine(args.allocator, max_num_seqs=args.max_num_seqs, max_waiting=args.max_waiting)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"kvservice api: {exc}", file=sys.stderr)
        return 1
    try:
        engine.start()
        settings = Settings(model_name=args.model_name, api_key=key, default_max_tokens=args.default_max_tokens)
        app = create_app(engine, settings)
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        config = uvicorn.Config(app, log_level=args.log_level, ssl_certfile=args.tls_cert or None,
                                ssl_keyfile=args.tls_key or None, timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)
        port = sock.getsockname()[1]
        name = settings.model_name or engine.model.name
        log.info("serving %s on %s://%s:%d/v1 (allocator %s, lease %s, API key %s)", name,
                 "https" if args.tls_cert else "http", args.host, port, args.allocator, engine.client.lease_id,
                 "required" if key else "not required")
        asyncio.run(_serve(server, sock, lambda: args.port_file and write_port_file(args.port_file, port, name, port)))
        return 0
    finally:
        engine.close()


async def _serve(server, sock: socket.socket, ready) -> None:
    """Runs uvicorn on ``sock``; calls ``ready()`` once it accepts connections."""
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        ready()
    await task
