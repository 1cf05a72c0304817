"""``kvtier fleet serve``: the fleet index over HTTP (see :mod:`kvtier.fleet` and :mod:`kvtier.fleet.http`).

Engines are named on the command line (``--engine NAME=tcp://host:port``, with
``--replay`` and ``--api`` for the same names). With ``--redis URL`` the index lives in
Redis for several routers: one ``kvtier fleet serve --redis URL --engine ...`` writes it,
any number of ``kvtier fleet serve --redis URL --read-only`` (or
:class:`~kvtier.fleet.index.FleetReader`) answer from it.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
from typing import Any

from kvtier.errors import ConfigError
from kvtier.fleet.hashing import ALGORITHMS, BlockHasher
from kvtier.user_files import os_error_text
from kvtier.validation import MAX_SECONDS, is_utf8_text

DEFAULT_PORT = 8600


def _named(text: str) -> tuple[str, str]:
    """An argparse type: ``NAME=VALUE``, both non-empty UTF-8 text (a name or an endpoint made of
    bytes that are not UTF-8 could be neither connected to nor answered in JSON)."""
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r:.200}")
    if not is_utf8_text(text):
        raise argparse.ArgumentTypeError(
            f"{text!r:.200} holds bytes that are not UTF-8: give the name and endpoint as text"
        )
    return name, value


def _positive(kind: type, maximum: float) -> Any:
    """An argparse type: a finite number of ``kind`` in (0, ``maximum``] (nan, inf and 1e400 are
    refused: they reached socket timeouts as a ValueError per connection)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not (math.isfinite(value) and 0 < value <= maximum):
            raise argparse.ArgumentTypeError(
                f"expected a positive {kind.__name__} of at most {maximum:,.0f}, got {text!r}"
            )
        return value

    return parse


def _text(text: str) -> str:
    """An argparse type: text that is UTF-8 (a host name, a key prefix or a topic made of bytes
    that are not UTF-8 can be neither listened on, sent to Redis nor matched against a topic)."""
    if not is_utf8_text(text):
        raise argparse.ArgumentTypeError(f"{text!r:.200} holds bytes that are not UTF-8: give text")
    return text


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in [0, 65535] (0 = any free port), got {text!r}")
    return int(text)


def add_fleet_parser(sub: Any) -> None:
    p = sub.add_parser("fleet", help="a prefix index over engines' KV events, for KV-aware routers")
    fsub = p.add_subparsers(dest="fleet_command", metavar="{serve}")
    fsub.required = True
    s = fsub.add_parser(
        "serve",
        help="subscribe to engines' KV events and answer the longest cached prefix per engine and tier over HTTP",
        description="Subscribe to the engines' KV event streams (vLLM's ZMQ publisher with kvtier's "
        "stamped events) and answer POST /v1/prefix with the longest cached prefix per engine and tier. "
        "With --redis the index lives in Redis: one server writes it (with --engine), any number answer "
        "from it (--read-only).",
    )
    s.add_argument("--engine", action="append", type=_named, default=[], metavar="NAME=ENDPOINT",
                   help="an engine's KV events endpoint (vLLM --kv-events-config endpoint, e.g. tcp://10.0.0.1:5557); "
                   "repeat per engine")  # fmt: skip
    s.add_argument("--replay", action="append", type=_named, default=[], metavar="NAME=ENDPOINT",
                   help="the engine's replay endpoint (vLLM replay_endpoint): lost batches are fetched "
                   "from it")  # fmt: skip
    s.add_argument("--api", action="append", type=_named, default=[], metavar="NAME=URL",
                   help="the engine's OpenAI API base URL (http://host:port): used to ask for a snapshot when "
                   "events were lost")  # fmt: skip
    s.add_argument("--topic", type=_text, default=None,
                   help="the topic the engines publish on (vLLM's kv-events topic; default none)")  # fmt: skip
    s.add_argument("--host", type=_text, default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; no authentication)")  # fmt: skip
    s.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 = any free)")
    s.add_argument("--hash", choices=ALGORITHMS, default="sha256",
                   help="the engines' --prefix-caching-hash-algo (default sha256)")  # fmt: skip
    s.add_argument("--hash-seed", type=_text, default=None,
                   help="the engines' PYTHONHASHSEED, if they set one (default: vLLM's fixed seed)")  # fmt: skip
    s.add_argument("--tokens-per-hash", type=_positive(int, 1 << 20), default=None,
                   help="the engines' KV-cache block size (default: what their events say)")  # fmt: skip
    s.add_argument("--redis", default=None, metavar="URL", help="keep the index in Redis (shared by routers)")
    s.add_argument("--redis-prefix", type=_text, default=None,
                   help="key prefix in Redis (default kvtier-fleet; --redis only)")  # fmt: skip
    s.add_argument("--read-only", action="store_true",
                   help="with --redis: answer from the index another 'kvtier fleet serve' writes "
                   "(no --engine)")  # fmt: skip
    s.add_argument("--lag-seconds", type=_positive(float, MAX_SECONDS), default=5.0,
                   help="how far an engine's view of a shared store may lag other engines' changes (an fs "
                   "root's journal delay; on NFS its attribute cache); default 5")  # fmt: skip
    s.add_argument("--max-keys", type=_positive(int, 1 << 32), default=1 << 24,
                   help="most entries (a block key in one location) an in-memory index holds (about 200 bytes for a "
                   "key's first location, 80 for each further one; default 16777216): a "
                   "batch that would add more is skipped (but for its removals from shared stores) and its engine "
                   "is partial")  # fmt: skip
    s.add_argument("--max-body", type=_positive(int, 1 << 30), default=1 << 20, help="largest request body in bytes")
    s.add_argument("--max-blocks", type=_positive(int, 1 << 24), default=16384, help="longest prompt in blocks")
    s.add_argument("--request-timeout", type=_positive(float, 3600.0), default=5.0,
                   help="seconds a whole request (its line, headers and body) may take to arrive, from its first "
                   "byte or the previous answer; also how long a connection's answers may wait, in all, for a "
                   "client that has not read the ones before (default 5)")  # fmt: skip
    s.add_argument("--max-concurrent", type=_positive(int, 4096), default=32, help="requests answered at once")
    s.set_defaults(func=_cmd_fleet_serve)


def _endpoints(args: argparse.Namespace) -> list[Any]:
    from kvtier.fleet.subscriber import EngineEndpoint

    names = [name for name, _ in args.engine]
    if len(set(names)) != len(names):
        raise ConfigError(f"--engine names must be unique, got {names}")
    extras: dict[str, dict[str, str]] = {name: {} for name in names}
    for flag, pairs in (("replay", args.replay), ("api", args.api)):
        for name, value in pairs:
            if name not in extras:
                raise ConfigError(f"--{flag} {name}={value}: no --engine named {name!r} (engines: {names})")
            extras[name][flag] = value
    try:
        return [EngineEndpoint(name, events, topic=args.topic or "", **extras[name]) for name, events in args.engine]
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


DEFAULT_REDIS_PREFIX = "kvtier-fleet"


def _cmd_fleet_serve(args: argparse.Namespace) -> int:
    from kvtier.fleet.http import FleetServer
    from kvtier.fleet.index import FleetReader
    from kvtier.fleet.masks import MemoryMasks, RedisMasks

    BlockHasher(args.hash, args.hash_seed, args.tokens_per_hash or 16)  # bad hashing settings fail now
    if args.read_only and (args.redis is None or args.engine):
        raise ConfigError("--read-only answers from an index in Redis another server writes: give --redis and "
                          "no --engine")  # fmt: skip
    if not args.read_only and not args.engine:
        raise ConfigError("give at least one --engine NAME=tcp://host:port (or --redis URL --read-only)")
    if args.redis_prefix is not None and args.redis is None:
        raise ConfigError("--redis-prefix names keys in Redis: give --redis URL too, or drop it")
    prefix = DEFAULT_REDIS_PREFIX if args.redis_prefix is None else args.redis_prefix
    masks: Any = MemoryMasks(max_keys=args.max_keys)
    if args.redis is not None:
        try:
            import redis
        except ImportError:
            raise ConfigError("--redis needs the redis package: pip install 'kvtier[redis]'") from None
        from kvtier.tiers.redis import check_redis_url

        try:  # the tier's check: a bad port, host or query named, the password never shown
            url = check_redis_url(args.redis, owned_fix="the fleet's connections time out after 5 s")
            client = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)
        except ValueError as exc:
            raise ConfigError(f"--redis is not a Redis URL the index can use: {exc}") from None
        try:
            # A writer restarted after a kill -9 waits out its former claim (writer_ttl).
            masks = RedisMasks(client, prefix, claim_wait=0.0 if args.read_only else 16.0)
        except ValueError as exc:
            raise ConfigError(f"--redis-prefix: {exc}") from None
    subscriber = None
    if args.read_only:
        answers: Any = FleetReader(masks)
    else:
        try:
            from kvtier.fleet.subscriber import FleetSubscriber
        except ImportError as exc:
            message = f"kvtier fleet serve needs pyzmq and msgspec ({exc}): pip install 'kvtier[fleet]'"
            raise ConfigError(message) from None
        endpoints = _endpoints(args)
        answers = _writer_index(masks, args)
        subscriber = FleetSubscriber(answers, endpoints)
    try:
        server = FleetServer(
            (args.host, args.port), answers, hashing=(args.hash, args.hash_seed), tokens_per_hash=args.tokens_per_hash,
            max_body=args.max_body, max_blocks=args.max_blocks, request_timeout=args.request_timeout,
            max_concurrent=args.max_concurrent,
            health=answers.store_failing if subscriber is None else _writer_health(subscriber),
        )  # fmt: skip
    except OSError as exc:  # the port is taken, the host is no address of this machine...
        if subscriber is not None:
            answers.close()
        raise ConfigError(f"cannot listen on {args.host}:{args.port} (--host, --port): {os_error_text(exc)}") from None
    stop = threading.Event()

    def _on_signal(signum: int, frame: Any) -> None:
        stop.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    # A SIGTERM the process inherited as ignored stays ignored, as for every kvtier command (and one
    # with a handler installed from C, which Python could not put back, is left alone).
    ignored = signal.getsignal(signal.SIGTERM) in (signal.SIG_IGN, None)
    previous = None if ignored else signal.signal(signal.SIGTERM, _on_signal)
    try:
        if subscriber is not None:
            subscriber.start()
        print(f"kvtier fleet: serving on {server.url}", flush=True)
        server.serve_forever(poll_interval=0.2)
    finally:
        if not ignored:
            signal.signal(signal.SIGTERM, previous)
        server.server_close()
        if subscriber is not None:
            subscriber.stop()
            answers.close()
    print("kvtier fleet: stopped", file=sys.stderr)
    return 0


def _writer_health(subscriber: Any) -> Any:
    """Why the writer no longer follows its engines (for ``GET /health``), or None: its subscriber
    thread stopped, another writer took the Redis prefix over, or the writer does not hold its claim
    on it or Redis has failed every write for a while (:meth:`~kvtier.fleet.index.FleetIndex.store_failing`)."""
    return lambda: subscriber.failure or subscriber.index.writer_lost or subscriber.index.store_failing()


def _writer_index(masks: Any, args: argparse.Namespace) -> Any:
    """The writer's index; with --redis it claims the prefix first (a Redis that does not
    answer, or another writer on the prefix, is a one-line error)."""
    from kvtier.fleet.index import FleetIndex

    if args.redis is None:
        return FleetIndex(masks=masks, lag_seconds=args.lag_seconds)
    import redis

    try:
        return FleetIndex(masks=masks, lag_seconds=args.lag_seconds)
    except redis.RedisError as exc:
        raise ConfigError(f"--redis: {exc}") from None  # (the URL may hold a password)
