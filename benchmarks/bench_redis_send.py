"""Where the Redis tier's store time goes: its send path alone, with the checksum, and with the
checksum computed ahead on another thread, against a raw redis-py pipeline, same run, same server.

    .venv/bin/python benchmarks/bench_redis_send.py            # starts redis-server on a free port

No tier, no I/O threads, no jobs: one connection, ``--values`` SETs of ``--value-kib`` values
sent the way :class:`~kvtier.tiers.redis.RedisTier` sends them (one scatter-gather ``sendmsg``
per value from a CPU-row-like array, ``send_pieces``), then every reply read. Variants:

* ``raw``: redis-py pipeline of ready-made ``bytes`` values (the baseline of bench_redis.py);
* ``send``: the tier's send path with a ready header (no checksum);
* ``send+hash``: the same, each header built with ``encode_header`` (the payload's xxh3) just
  before its value is sent, as the tier does;
* ``send+hash-ahead``: the headers computed on a helper thread ahead of the sends.

Rounds alternate the variants; the figure is the median GB/s over rounds and its ratio to
``raw``. On a 2-core VM the server takes one core, so a checksum pass cannot hide behind the
sends: this separates the cost of the wire path from the cost of the checksum.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import redis

from bench_redis import redis_server
from kvtier.tiers.format import HEADER_SIZE, encode_header
from kvtier.tiers.redis_protocol import Piece, RespReader, SetEncoder, send_pieces

NAMESPACE = b"bench-send-path!"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--value-kib", type=int, default=2048, help="payload KiB per value (default 2048)")
    parser.add_argument("--values", type=int, default=64, help="values per round (default 64)")
    parser.add_argument("--rounds", type=int, default=11, help="rounds; the median is kept (default 11)")
    args = parser.parse_args()
    payload_bytes = args.value_kib * 1024
    n = args.values
    rng = np.random.default_rng(0)
    values = [rng.integers(0, 256, HEADER_SIZE + payload_bytes, dtype=np.uint8).tobytes() for _ in range(n)]
    rows = rng.integers(0, 256, (n, payload_bytes), dtype=np.uint8)
    keys = [b"bench-send:%06d" % i for i in range(n)]
    ready_headers = [encode_header(NAMESPACE, k, rows[i].data) for i, k in enumerate(keys)]
    encoder = SetEncoder(HEADER_SIZE + payload_bytes)

    with redis_server() as url, ThreadPoolExecutor(1, thread_name_prefix="bench-hash") as hasher:
        client = redis.Redis.from_url(url)
        tier_client = redis.Redis.from_url(url, socket_timeout=5.0)  # the tier's sockets have timeouts
        conn = tier_client.connection_pool.get_connection()
        conn.connect()
        sock = conn._sock
        assert sock is not None

        def raw() -> None:
            pipe = client.pipeline(transaction=False)
            for i, k in enumerate(keys):
                pipe.set(k, values[i])
            pipe.execute()

        def tier_like(header: Callable[[int], bytes]) -> Callable[[], None]:
            def run() -> None:
                for i, k in enumerate(keys):
                    out: list[Piece] = []
                    encoder.pack(out, k, header(i), rows[i].data)
                    send_pieces(sock, out)
                reader = RespReader(sock)
                for _ in keys:
                    reply = reader.read_reply()
                    if reply != b"OK" and reply != "OK":
                        raise SystemExit(f"SET answered {reply!r}")

            return run

        def ahead() -> None:
            futures = [hasher.submit(encode_header, NAMESPACE, k, rows[i].data) for i, k in enumerate(keys)]
            tier_like(lambda i: futures[i].result())()

        variants: dict[str, Callable[[], None]] = {
            "raw": raw,
            "send": tier_like(lambda i: ready_headers[i]),
            "send+hash": tier_like(lambda i: encode_header(NAMESPACE, keys[i], rows[i].data)),
            "send+hash-ahead": ahead,
        }
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.rounds):
            order = list(variants.items())
            for name, run in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - t0)
        conn.disconnect()
        client.flushdb()
        client.close()
        tier_client.close()

    total = n * (HEADER_SIZE + payload_bytes)
    base = total / statistics.median(seconds["raw"]) / 1e9
    print(f"{n} SETs of {args.value_kib} KiB per round, median of {args.rounds} alternating rounds")
    print(f"{'variant':<16} {'GB/s':>6} {'/ raw':>6}")
    for name, times in seconds.items():
        rate = total / statistics.median(times) / 1e9
        print(f"{name:<16} {rate:>6.2f} {rate / base:>5.2f}x")


if __name__ == "__main__":
    main()
