"""`oasiskv kvstore ...`: run a standalone store server until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from pydantic import ValidationError


def add_arguments_kvstore(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=7300, help="TCP port (0: any free port)")
    parser.add_argument("--advertise-host", default=None, help="address clients should use, if not --host")
    parser.add_argument("--capacity-gb", type=float, default=1.0, help="arena size in GiB (preallocated)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--ttl-s", type=float, default=600.0, help="free requests idle this long")
    parser.add_argument("--transport", choices=("nixl", "tcp"), default="nixl", help="data plane offered (nixl also serves tcp)")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    parser.add_argument("--no-hugepages", action="store_true", help="do not madvise huge pages for the arena")
    parser.add_argument("--no-prefault", action="store_true", help="do not touch the arena at start")
    parser.add_argument("--log-level", default="WARNING", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL"),
                        help="how much the store logs")


def run_kvstore(args: argparse.Namespace) -> int:
    from ..config_errors import describe
    from .config import KVStoreConfig
    from .errors import KVStoreError
    from .server import KVStoreServer

    logging.basicConfig(level=getattr(logging, args.log_level))
    try:
        config = KVStoreConfig(
            host=args.host, port=args.port, advertise_host=args.advertise_host,
            capacity_gb=args.capacity_gb, block_size=args.block_size, ttl_s=args.ttl_s,
            transport=args.transport, metrics_port=args.metrics_port,
            hugepages=not args.no_hugepages, prefault=not args.no_prefault,
        )
    except ValidationError as exc:
        print(f"oasiskv kvstore: invalid configuration: {describe(exc, args)}", file=sys.stderr)
        return 2
    try:
        server = KVStoreServer(config)
        address = server.start()
    except (OSError, KVStoreError, MemoryError) as exc:
        print(f"oasiskv kvstore: cannot start a {config.capacity_bytes / 2**30:g} GiB store on {config.host}:{config.port}"
              f"{f' (metrics on {config.metrics_port})' if config.metrics_port is not None else ''}: {_port_named(exc, config)}",
              file=sys.stderr)
        return 1

    def stop(signum: int, _frame: object) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # One machine-readable line: scripts and tests wait for it.
    print(
        f"READY {address} store_id={server.store_id} nixl={'yes' if server.serves_nixl else 'no'} "
        f"capacity_bytes={server.store.capacity_bytes}",
        flush=True,
    )
    server.serve_forever()
    return 0


def _port_named(error: BaseException, config) -> str:
    """An address-in-use error with the port it was about: the store's and its metrics' ports
    both bind at start, and the message did not say which was taken."""
    import errno
    import socket

    if not (isinstance(error, OSError) and error.errno == errno.EADDRINUSE):
        return str(error)
    for flag, port in (("--port", config.port), ("--metrics-port", config.metrics_port)):
        if not port:
            continue
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((config.host, port))
            except OSError:
                return f"{flag} {port} is in use ({error.strerror})"
    return str(error)
