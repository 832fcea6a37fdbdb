"""``python -m worker``: a KV pool owner serving the data plane."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from worker.config import WorkerSettings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m worker",
        description="Serve one pool of paged KV memory (CuPy kernels on a GPU, torch on a CPU): sizes the pool "
                    "from --kv-memory, registers it with --allocator (retrying until it is up) and heartbeats. "
                    "With --model (a preset: tiny-llama, small-llama, tiny-llama-long (a 128k position range) with weights drawn from --model-seed; "
                    "smollm2-135m, SmolLM2-135M-Instruct converted once from its GGUF into $KVSERVICE_MODEL_CACHE) it also "
                    "runs the model (the Forward RPC), and the pool's layers, KV heads, head dim and dtype are "
                    "the model's (--num-layers, --num-kv-heads, --head-dim, --dtype are then ignored).")
    WorkerSettings.add_arguments(parser)
    parser.add_argument("--port-file", help="write the bound port and the pool id to this file once serving")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = WorkerSettings.from_args(args)
    except ValueError as exc:
        print(f"python -m worker: {exc}", file=sys.stderr)
        return 2
    from worker.server import serve   # torch loads here, after the arguments are checked

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(serve(settings, args.port_file))
    except (OSError, ValueError, RuntimeError) as exc:
        logging.getLogger("worker").error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 0
