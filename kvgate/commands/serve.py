"""`kvgate serve`: run the gateway from a config file, from flags, or both (flags win)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable

from aiohttp import web

from kvgate.api.admin import start_admin_listener
from kvgate.api.protocol import gateway_runner
from kvgate.api.routes import GATEWAY
from kvgate.app import build_app, reload
from kvgate.config import (
    Config,
    ConfigError,
    apply_overrides,
    parse_config,
    quick_config,
    read_tree,
)
from kvgate.logs import restore, write_logs_from_a_thread
from kvgate.request.tokenizers import TokenizerError
from kvgate.workers import PEERS, Peers, default_workers, private_site, supervise

log = logging.getLogger("kvgate")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML config file (see config/kvgate.yaml)")
    parser.add_argument("--upstream", action="append", metavar="URL",
                        help="a vLLM replica for the default pool (repeatable)")
    parser.add_argument("--long-upstream", action="append", metavar="URL",
                        help="a replica for the long-context pool (repeatable)")
    parser.add_argument("--long-threshold", type=int, metavar="TOKENS",
                        help="worst case (prompt + max_tokens) from which a request goes to the "
                             "long-context pool (default 16384)")
    parser.add_argument("--redis", metavar="URL", help="share state through this Redis")
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8080)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="processes serving the port (SO_REUSEPORT); default: one per core "
                             "with state.backend redis, 1 with the memory store")


def config_loader(args: argparse.Namespace) -> Callable[[], Config]:
    """Reads the file (if any) and applies the flags; called at start and on every SIGHUP."""

    def load() -> Config:
        if args.config:
            tree = read_tree(args.config)
        elif args.upstream:
            tree = quick_config(args.upstream)
        else:
            raise ConfigError(["give --config FILE or at least one --upstream URL"])
        tree = apply_overrides(
            tree, upstreams=args.upstream if args.config else None,
            long_upstreams=args.long_upstream, long_threshold=args.long_threshold,
            redis_url=args.redis,
            host=args.host, port=args.port,
        )
        return parse_config(tree)

    return load


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    replaced = write_logs_from_a_thread()  # a stalled stderr never stalls requests
    try:
        return _run(args)
    finally:
        restore(replaced)


def _run(args: argparse.Namespace) -> int:
    load = config_loader(args)
    try:
        config = load()
        app = build_app(config)
    except (ConfigError, TokenizerError) as exc:
        print(f"kvgate: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    workers = args.workers
    if workers is None:  # the endpoint picker listens in one process (docs/envoy.md)
        workers = 1 if config.server.epp.port is not None else default_workers(config.state.backend)
    refusal = workers_refusal(config, workers)
    if refusal is not None:
        print(f"kvgate: {refusal}", file=sys.stderr)
        return 2
    if workers > 1:
        return supervise(worker_argv(args), workers)
    if args.workers is None and config.state.backend != "redis":
        log.info("kvgate: one worker: the memory store keeps ledgers, budgets and sessions in "
                 "this process (state.backend: redis runs one worker per core)")  # fmt: skip
    _use_uvloop()
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(app, config, load))
    except OSError as exc:  # the port is taken, the address is not ours, ...
        where = f"{config.server.host}:{config.server.port}"
        print(f"kvgate: cannot listen on {where}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


async def serve(
    app: web.Application, config: Config, load: Callable[[], Config],
    started: Callable[[str], None] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM; SIGHUP reloads. Drains in-flight requests on the way out."""
    # kvgate writes its own access log line (kvgate.access, with the request's books)
    runner = gateway_runner(app, config.server, shutdown_timeout=config.server.drain_s)
    await runner.setup()
    peers = Peers.from_env()  # one of `--workers N`: share the port, and say where it is
    site = web.TCPSite(
        runner, config.server.host, config.server.port, reuse_port=peers is not None or None
    )
    await site.start()
    # with server.admin.port, /metrics lives on the admin listener: the workers' private
    # sites (where they fetch each other's figures) go there too
    admin = await start_admin_listener(app[GATEWAY], config, peers)
    if admin is not None:
        log.info("kvgate admin listening on %s", admin.addresses[0])
    if peers is not None:
        app[PEERS] = peers
        await private_site(admin or runner, peers)
    url = _url(site)
    log.info("kvgate listening on %s", url)
    if started is not None:
        started(url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    reloads: set[asyncio.Task[bool]] = set()  # held until done: a task nobody holds may vanish

    def on_sighup() -> None:
        task = asyncio.create_task(reload(app, load))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    with contextlib.suppress(NotImplementedError):
        loop.add_signal_handler(signal.SIGHUP, on_sighup)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("kvgate shutting down: draining for up to %.0fs", config.server.drain_s)
        await runner.cleanup()
        if admin is not None:
            await admin.cleanup()


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The `kvgate serve` flags each worker runs with: the parent's own."""
    argv: list[str] = []
    for flag, value in (("--config", args.config), ("--long-threshold", args.long_threshold),
                        ("--redis", args.redis), ("--host", args.host), ("--port", args.port),
                        ("--log-level", args.log_level)):  # fmt: skip
        if value is not None:
            argv += [flag, str(value)]
    for flag, values in (("--upstream", args.upstream), ("--long-upstream", args.long_upstream)):
        for value in values or ():
            argv += [flag, value]
    return argv


def workers_refusal(config: Config, workers: int) -> str | None:
    """Why `workers` processes cannot serve this config, or None."""
    if workers < 1:
        return "--workers must be at least 1"
    if workers > 1 and config.state.backend != "redis":
        return (f"--workers {workers} needs state.backend: redis (with the memory store each "
                "worker would keep its own ledgers and budgets: every limit times "
                f"{workers})")  # fmt: skip
    if workers > 1 and config.server.port == 0:
        return "--workers needs a fixed server.port (they all listen on it)"
    if workers > 1 and config.server.epp.port is not None:
        return (f"--workers {workers} with server.epp: the endpoint picker runs in one process "
                "(run more pods, each with --workers 1)")
    return None


def _url(site: web.TCPSite) -> str:
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    host, port = sockets[0].getsockname()[:2] if sockets else ("127.0.0.1", 0)
    return f"http://{host}:{port}"


def _use_uvloop() -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


