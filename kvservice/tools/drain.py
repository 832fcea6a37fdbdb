"""``kvservice drain POOL``: moves every sequence off a pool and unregisters it, so that its
worker can restart with no request lost (DESIGN §13; a rolling restart of a deployment).

The pool is marked as being drained (``DrainPool``): placement passes it over, creates and
migrations that name it are refused, Syncs grant no reserve there. Engines see it in the
pool list within a second: they give their reserve there back and move their sequences
to other pools (``Sequence.migrate``; a prompt not computed yet is computed elsewhere).
Once the pool holds no sequence, reserved block or read pin, it is unregistered
(``UnregisterPool``) and its worker, told so by its next heartbeat, stops. Progress is
printed every second; on ``--timeout`` the pool stays draining (``--undo`` takes it back)
and the command exits 1. Credentials: an admin's, from the environment (KVSERVICE_TOKEN,
or KVSERVICE_TLS_CA with an admin client certificate)."""

from __future__ import annotations

import argparse
import sys
import time

import grpc

from kvservice import errors
from kvservice.common.security import ClientCredentials
from kvservice.rpc import to_domain_error
from kvservice.v1 import allocator_pb2 as pb
from kvservice.v1 import allocator_pb2_grpc as pb_grpc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pool", help="the pool to drain (its worker's pool id)")
    p.add_argument("--target", default="127.0.0.1:50051", help="the allocator, host:port (default 127.0.0.1:50051)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the pool to empty (default 600)")
    p.add_argument("--force", action="store_true",
                   help="unregister at the timeout all the same, dropping what the pool still holds")
    p.add_argument("--undo", action="store_true", help="take a drain back: the pool takes sequences again")


def main(args: argparse.Namespace) -> int:
    try:
        with ClientCredentials.from_env().channel(args.target) as channel:
            return _drain(pb_grpc.AllocatorStub(channel), args)
    except grpc.RpcError as exc:
        err = to_domain_error(exc)
        print(f"kvservice drain: {args.pool}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


def _drain(stub: pb_grpc.AllocatorStub, args: argparse.Namespace) -> int:
    pool = stub.DrainPool(pb.DrainPoolRequest(pool_id=args.pool, undo=args.undo), timeout=10)
    if args.undo:
        print(f"pool {args.pool}: no longer draining")
        return 0
    print(f"pool {args.pool} (epoch {pool.epoch}): draining; waiting for its sequences to move", flush=True)
    start = time.monotonic()
    while True:
        stats = stub.GetPoolStats(pb.GetPoolStatsRequest(pool_id=args.pool), timeout=10)
        waited = time.monotonic() - start
        print(f"  {waited:5.1f} s: {stats.num_sequences} sequences, {stats.num_reserved_blocks} reserved blocks, "
              f"{stats.num_used_blocks} blocks in use", flush=True)
        if stats.num_sequences == 0 and stats.num_reserved_blocks == 0:
            try:
                gone = stub.UnregisterPool(pb.UnregisterPoolRequest(pool_id=args.pool), timeout=10)
                break
            except grpc.RpcError as exc:
                if not isinstance(to_domain_error(exc), errors.FailedPrecondition):   # (a pin still held)
                    raise
        if waited > args.timeout:
            if not args.force:
                print(f"pool {args.pool}: not empty after {args.timeout:g} s; it stays draining (--force drops what "
                      f"it holds, --undo takes the drain back)", file=sys.stderr)
                return 1
            gone = stub.UnregisterPool(pb.UnregisterPoolRequest(pool_id=args.pool, force=True), timeout=10)
            break
        time.sleep(1.0)
    print(f"pool {args.pool}: drained in {time.monotonic() - start:.1f} s and unregistered (epoch {gone.epoch}"
          + (f"; dropped {gone.num_sequences} sequences, {gone.num_reserved_blocks} reserved blocks" if args.force
             and (gone.num_sequences or gone.num_reserved_blocks) else "") + "); its worker stops at its next "
          "heartbeat", flush=True)
    return 0
