"""Fixtures that run real Redis servers on free loopback ports.

``redis_server`` starts a fresh ``redis-server`` per test (no persistence) and
can be killed with SIGKILL and restarted on the same port. ``redis_cluster``
starts a 3-node Redis Cluster (no replicas) once per module. Both skip with a
clear reason when no ``redis-server`` binary is installed
(``apt-get install -y redis-server``).
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_servers import _SKIP_REASON, REDIS_CLI, REDIS_SERVER, RedisServer, _free_port, _start_server
from tls_certificates import make_test_certificates


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh standalone redis-server on a free loopback port."""
    if REDIS_SERVER is None:
        pytest.skip(_SKIP_REASON)
    server = _start_server(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[object]:
    """Start servers with extra arguments: ``redis_server_factory("--maxmemory", "8mb")``."""
    if REDIS_SERVER is None:
        pytest.skip(_SKIP_REASON)
    servers: list[RedisServer] = []

    def start(*extra_args: str) -> RedisServer:
        server = _start_server(tmp_path / f"redis-{len(servers)}", tuple(extra_args))
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def redis_tls_server(tmp_path: Path) -> Iterator[tuple[RedisServer, str]]:
    """A redis-server with a TLS port too (self-signed CA); yields ``(server, rediss_url)``."""
    if REDIS_SERVER is None:
        pytest.skip(_SKIP_REASON)
    ca_crt, crt, key = make_test_certificates(tmp_path / "certs")
    tls_port = _free_port()
    server = _start_server(
        tmp_path / "redis-tls",
        (
            "--tls-port",
            str(tls_port),
            "--tls-cert-file",
            str(crt),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(ca_crt),
            "--tls-auth-clients",
            "no",
        ),
    )
    try:
        yield server, f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={ca_crt}&ssl_cert_reqs=required"
    finally:
        server.stop()


class RedisCluster3:
    """Three cluster-enabled redis-servers joined into one cluster (no replicas)."""

    def __init__(self, nodes: list[RedisServer]) -> None:
        self.nodes = nodes

    @property
    def url(self) -> str:
        return self.nodes[0].url.rsplit("/", 1)[0]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _cluster_ok(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"CLUSTER INFO\r\n")
            data = s.recv(4096)
            return b"cluster_state:ok" in data
    except OSError:
        return False


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster3]:
    """A 3-node Redis Cluster on loopback ports, shared by one test module."""
    if REDIS_SERVER is None:
        pytest.skip(_SKIP_REASON)
    if REDIS_CLI is None:
        pytest.skip("redis-cli not found on PATH (it ships with redis-server / redis-tools)")
    root = tmp_path_factory.mktemp("redis-cluster")
    nodes: list[RedisServer] = []
    cluster = RedisCluster3(nodes)
    try:
        for i in range(3):
            node_dir = root / f"node{i}"
            nodes.append(
                _start_server(
                    node_dir,
                    (
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(node_dir / "nodes.conf"),
                        "--cluster-node-timeout",
                        "2000",
                    ),
                )
            )
        subprocess.run(
            [
                REDIS_CLI,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=30,
        )
        deadline = time.monotonic() + 15
        while not all(_cluster_ok(n.port) for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("redis cluster did not reach cluster_state:ok within 15s")
            time.sleep(0.05)
        yield cluster
    finally:
        cluster.stop()


# --- S3: moto in a separate process, and the fault-injecting stub (s3_servers.py) ---------------

from s3_servers import MotoServer, S3Stub, moto_available, start_moto  # noqa: E402

_MOTO_SKIP = "moto is not installed; install the test extra: pip install -e '.[test]' (moto[s3], flask, flask-cors)"


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto S3 server process per session on a free loopback port (tests use fresh buckets)."""
    if not moto_available():
        pytest.skip(_MOTO_SKIP)
    server = start_moto(tmp_path_factory.mktemp("moto"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(moto_server: MotoServer) -> tuple[MotoServer, str]:
    """``(server, bucket)``: a fresh, empty bucket on the session's moto server (restarted if a test killed it)."""
    if moto_server.proc is None or moto_server.proc.poll() is not None:
        moto_server.start()
    return moto_server, moto_server.create_bucket()


@pytest.fixture
def own_moto(tmp_path: Path) -> Iterator[MotoServer]:
    """A moto server of this test alone (to kill, pause and restart)."""
    if not moto_available():
        pytest.skip(_MOTO_SKIP)
    server = start_moto(tmp_path / "moto")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_stub() -> Iterator[S3Stub]:
    stub = S3Stub()
    try:
        yield stub
    finally:
        stub.close()
