"""URLs and endpoints: refused at validation (never a panic or a hang later), shown without secrets.

A Redis URL or S3 endpoint (option, config file, KVTIER_* variable, AWS_ENDPOINT_URL)
with a bad port, host or scheme is a ConfigError when the options are validated,
before any thread starts, and ``kvtier config show`` refuses it too (exit 2, a few
lines, no traceback, no Rust panic text). AWS_ENDPOINT_URL(_S3) is honoured (http,
path style). A crash inside a native client (obstore's PanicException) takes the
tier out of service without killing its workers. Missing bucket, missing
credentials, unreachable endpoint: one line saying which. Passwords in URLs are
never echoed: errors, logs, describe(), config show.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from s3_servers import MotoServer, free_port

from kvtier.errors import ConfigError
from kvtier.keys import KVGeometry, Namespace, chain_ids
from kvtier.testing import make_namespace, new_job, run_job, wait_for, wait_results
from kvtier.tiers.base import HealthState, TierContext
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.registry import create_tier, validate_tier_options

SECRET = "s3cr3t-Pa55"
BLOCK = 4096

BAD_REDIS_URLS = [
    "redis://cache:99999/0", "redis://cache:0/0", "redis://cache:65536", "redis://cache:abc/0", "redis://cache:-1",
    "redis://cache:+80", "redis://cache:/0", "redis://:6379/0", "redis://", "redis:///0", "redis://1.2.3.4.5:6379",
    "redis://999.1.1.1:6379", "redis://cache%zz:6379", "redis://ca che:6379", "redis://h\u00e9llo:6379",
    "redis://-cache:6379", "redis://[::1:6379", "redis://[::g]:6379", "redis://cache\n:6379", "http://cache:6379",
    "ftp://cache", "cache:6379", "//cache:6379", "redis://cache:6379/x", "redis://cache:6379/-1",
    "redis://cache:6379/99999999999", "redis://cache:6379/0/1", "redis://cache:6379/0?socket_timeout=5",
    "redis://cache:6379/0?socket_connect_timeout=5", "redis://cache:6379/0?decode_responses=true",
    "redis://cache:6379/0?foo=bar", "redis://cache:6379/0?ssl_cert_reqs=none", "rediss://cache:6379/0?ssl_cert_reqs=maybe",
    "rediss://cache:6379/0?ssl_ca_certs=/nonexistent/ca.pem", "redis://cache:6379/0?db=1&db=2",
    "redis://cache:6379/0?db=x", "redis://cache:6379/0#frag", "unix://", "unix://host/tmp/redis.sock",
    "unix:///", f"redis://user:{SECRET}@cache:99999/0", f"redis://:{SECRET}@cache:6379/x",
    f"redis://cache:6379/0?password={SECRET}&db=x", f"rediss://u:{SECRET}@[::1:6379", "", "REDIS://cache:99999/0",
]  # fmt: skip

BAD_S3_ENDPOINTS = [
    "http://127.0.0.1:99999", "http://minio:0", "http://minio:65536", "http://minio:abc", "http://minio:",
    "http://:9000", "http://", "http://%zz:80", "http://mi nio:9000", "http://m\u00ednio:9000", "http://1.2.3.4.5:9000",
    "http://[::1:9000", "http://[fe80::1%25eth0]:9000", "https://minio:9000/bucket", "http://minio:9000?x=1",
    "http://minio:9000#f", "ftp://minio:9000", "minio:9000", "s3://minio", f"http://key:{SECRET}@minio:9000",
    f"https://{SECRET}@minio", "http://minio\t:9000",
]  # fmt: skip

BAD_REGIONS = ["us east 1", "us-east-1/x", "../x", "a" * 80, "é", "us-east-1\n"]
# Parts of every request's URL besides the endpoint: a newline or space here made obstore panic.
BAD_URL_PARTS = [("bucket", "kv-bucket\n"), ("bucket", "kv bucket"), ("bucket", "KV"), ("bucket", "kv..x"),
                 ("prefix", "kvtier\n"), ("prefix", "kv tier"), ("prefix", "a/../b"), ("prefix", "kv?x")]  # fmt: skip


def _s3(**options: Any) -> dict[str, Any]:
    return {"type": "s3", "bucket": "kv-endpoints", "allow_http": True, **options}


def _context() -> TierContext:
    ns = Namespace("endpoints-test", KVGeometry.from_block_bytes(BLOCK))
    return TierContext(np.zeros((4, BLOCK), dtype=np.uint8), BLOCK, ns)


@pytest.fixture(autouse=True)
def _no_aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT", "AWS_REGION", "AWS_DEFAULT_REGION",
                 "AWS_METADATA_ENDPOINT", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_STS_ENDPOINT",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)


def _refused(spec: dict[str, Any], option: str) -> str:
    """The ConfigError of validating ``spec`` (and of building it: no thread may start)."""
    with pytest.raises(ConfigError) as err:
        validate_tier_options(spec, where="tiers[0]")
    message = str(err.value)
    assert f"option '{option}'" in message, message
    threads = threading.active_count()
    with pytest.raises(ConfigError):
        create_tier(spec, _context())
    assert threading.active_count() == threads, "a thread started before the URL was refused"
    assert SECRET not in message and "panicked" not in message and "Traceback" not in message
    return message


@pytest.mark.parametrize("url", BAD_REDIS_URLS)
def test_bad_redis_urls_are_refused_at_validation(url: str) -> None:
    _refused({"type": "redis", "url": url}, "url")


@pytest.mark.parametrize(
    ("url", "taken"),
    [("REDIS://CACHE:1/0", "redis://CACHE:1/0"), ("Rediss://u:pw@h:6380", "rediss://u:pw@h:6380"),
     ("UNIX:///tmp/redis.sock", "unix:///tmp/redis.sock")],
)  # fmt: skip
def test_a_redis_url_scheme_in_any_case_is_taken_in_lower_case(url: str, taken: str) -> None:
    # regression (CI, 2026-12-04): 'REDIS://' was refused only because redis-py before 8.2 refused it
    # (8.2 takes it); the scheme is case-insensitive (RFC 3986) and redis-py is given it in lower case.
    from kvtier.tiers.redis import RedisTierOptions

    assert RedisTierOptions(url=url).url == taken


def test_redis_cluster_mode_needs_a_network_url() -> None:
    _refused({"type": "redis", "url": "unix:///tmp/redis.sock", "cluster": True}, "cluster")


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:6379/0", "redis://cache.internal/3", "rediss://u:p@cache:6380/0?ssl_cert_reqs=none",
     "redis://[::1]:6379", "unix:///run/redis/redis.sock?db=2", "redis://my_cache:6379/0"],
)  # fmt: skip
def test_good_redis_urls_pass(url: str) -> None:
    assert validate_tier_options({"type": "redis", "url": url})["url"] == url


@pytest.mark.parametrize("endpoint", BAD_S3_ENDPOINTS)
def test_bad_s3_endpoints_are_refused_at_validation(endpoint: str) -> None:
    _refused(_s3(endpoint=endpoint), "endpoint")


@pytest.mark.parametrize(
    ("variable", "value"),
    [("AWS_METADATA_ENDPOINT", "http://bad host:80"), ("AWS_METADATA_ENDPOINT", "http://169.254.169.254:99999"),
     ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://[::1/v2/creds"), ("AWS_STS_ENDPOINT", "ftp://sts.internal"),
     ("AWS_STS_ENDPOINT", "https://sts\u00e9.internal"), ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "v2 creds")],
)  # fmt: skip
def test_bad_credential_chain_urls_are_refused_when_the_chain_is_used(
    variable: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(variable, value)
    message = _refused(_s3(endpoint="http://127.0.0.1:9000"), "access_key_id")
    assert variable in message, message
    given = _s3(endpoint="http://127.0.0.1:9000", access_key_id="k", secret_access_key="s")
    assert validate_tier_options(given)  # explicit keys: the chain, and its URLs, are not used


@pytest.mark.parametrize("kind", ["garbage", "fifo", "directory", "missing", "empty"])
def test_a_ca_file_without_a_certificate_is_refused_without_blocking(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "ca.pem"
    if kind == "garbage":
        path.write_bytes(b"not a certificate\n" * 100)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    _refused(_s3(endpoint="https://127.0.0.1:9000", ca_file=str(path)), "ca_file")


def test_an_upper_case_http_endpoint_still_needs_allow_http() -> None:
    _refused({"type": "s3", "bucket": "kv-endpoints", "endpoint": "HTTP://127.0.0.1:9000"}, "allow_http")
    shown = validate_tier_options(_s3(endpoint="HTTPS://Minio.Internal:9000/"))
    assert shown["endpoint"] == "https://Minio.Internal:9000"


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"])
@pytest.mark.parametrize("endpoint", BAD_S3_ENDPOINTS[:12] + BAD_S3_ENDPOINTS[19:])
def test_bad_endpoints_in_the_environment_are_refused_by_name(
    variable: str, endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(variable, endpoint)
    message = _refused(_s3(), "endpoint")
    assert f"environment variable {variable}" in message, message


@pytest.mark.parametrize(("option", "value"), BAD_URL_PARTS)
def test_bad_bucket_and_prefix_are_refused(option: str, value: str) -> None:
    _refused({**_s3(endpoint="http://127.0.0.1:9000"), option: value}, option)


def test_a_redis_prefix_with_a_newline_is_refused() -> None:
    _refused({"type": "redis", "url": "redis://cache:6379/0", "prefix": "kvtier\n"}, "prefix")


@pytest.mark.parametrize("region", BAD_REGIONS)
def test_bad_regions_are_refused_from_the_option_and_the_environment(
    region: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _refused(_s3(region=region), "region")
    for variable in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        with monkeypatch.context() as env:
            env.setenv(variable, region)
            assert f"environment variable {variable}" in _refused(_s3(), "region")


@pytest.mark.parametrize(
    ("tiers", "env"),
    [
        ([{"type": "redis", "url": f"redis://u:{SECRET}@cache:99999/0"}], {}),
        ([{"type": "redis", "url": "redis://1.2.3.4.5:6379/0"}], {}),
        ([{"type": "s3", "bucket": "kv-x", "endpoint": f"http://k:{SECRET}@127.0.0.1:9000", "allow_http": True}], {}),
        ([{"type": "s3", "bucket": "kv-x", "endpoint": "http://127.0.0.1:99999", "allow_http": True}], {}),
        ([{"type": "s3", "bucket": "kv-x"}], {"AWS_ENDPOINT_URL": "http://127.0.0.1:99999"}),
        ([{"type": "s3", "bucket": "kv-x"}], {"AWS_ENDPOINT_URL_S3": "http://mi nio:9000"}),
        ([{"type": "s3", "bucket": "kv-x"}], {"AWS_REGION": "us east 1"}),
    ],
)
@pytest.mark.parametrize("via", ["flag", "env", "file"])
def test_config_show_refuses_them_in_a_few_lines(
    tiers: list[dict[str, Any]], env: dict[str, str], via: str, tmp_path: Path
) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "AWS_"))}
    environ.update(env)
    args = [sys.executable, "-m", "kvtier.cli", "config", "show"]
    if via == "flag":
        args += ["--tiers", json.dumps(tiers)]
    elif via == "env":
        environ["KVTIER_TIERS"] = json.dumps(tiers)
    else:
        (tmp_path / "kv.json").write_text(json.dumps({"tiers": tiers}))
        args += ["--config", str(tmp_path / "kv.json")]
    out = subprocess.run(args, capture_output=True, text=True, env=environ, timeout=60, check=False)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "Traceback" not in text and "panicked" not in text and SECRET not in text, text
    assert len(text.strip().splitlines()) <= 5, text
    assert "tiers[0]" in text


# --- secrets ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [f"redis://user:{SECRET}@h:1/0", f"redis://:{SECRET}@h/0", f"redis://{SECRET}@h", f"rediss://h/0?password={SECRET}",
     f"http://k:{SECRET}@h:9000/b", f"u:{SECRET}@h", f"redis://u:{SECRET}@[::1", f"redis://h/0?ssl_password={SECRET}&db=1",
     f"https://h:9000?X-Amz-Signature={SECRET}"],
)  # fmt: skip
def test_redact_url_hides_passwords_in_every_form(url: str) -> None:
    from kvtier.tiers.endpoints import redact_url

    shown = redact_url(url)
    assert SECRET not in shown and "***" in shown, shown


@pytest.mark.parametrize(
    ("url", "split"),
    [("s3://b/p", ("s3", "b/p")), ("HTTPS://h:9/b", ("HTTPS", "h:9/b")), ("git+ssh://h", ("git+ssh", "h")),
     (f"http://k:a://{SECRET}@h/b", ("http", f"k:a://{SECRET}@h/b")),
     (f"http:/KEYID://{SECRET}@h/b", None), (f"http:/KEYID:a://{SECRET}@h/b", None), (f" s3://k:{SECRET}@b", None),
     ("1s3://b", None), ("://b", None), ("/srv/kv", None), (f"u:{SECRET}@h", None)],
)  # fmt: skip
def test_split_scheme_takes_a_separator_only_after_a_clean_scheme(url: str, split: tuple[str, str] | None) -> None:
    """Review s3c #3: ``partition("://")`` took the '://' inside 'http:/KEYID://SECRET@host' for the
    scheme's, so the key id was shown as a scheme or bucket and the secret as a prefix."""
    from kvtier.tiers.endpoints import split_scheme

    assert split_scheme(url) == split


def test_secrets_are_never_echoed_by_describe_config_show_or_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvtier.config import describe_config, load_config

    tiers = [
        {"type": "redis", "url": f"redis://admin:{SECRET}@127.0.0.1:1/0"},
        {"type": "s3", "bucket": "kv-secret", "endpoint": "http://127.0.0.1:1", "allow_http": True,
         "access_key_id": "AKID", "secret_access_key": SECRET, "session_token": SECRET},
    ]  # fmt: skip
    info = describe_config(load_config(env={}, cli={"model": "tiny", "num_cpu_blocks": 4, "tiers": tiers}))
    assert SECRET not in json.dumps(info)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "AWS_"))}
    for extra in ([], ["--json"]):
        out = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "config", "show", "--tiers", json.dumps(tiers), *extra],
            capture_output=True, text=True, env=environ, timeout=60, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert SECRET not in out.stdout + out.stderr
    with caplog.at_level(logging.DEBUG):
        built = [create_tier({**t, "io_threads": 1} if t["type"] == "redis" else t, _context()) for t in tiers]
        try:
            for tier in built:
                assert SECRET not in json.dumps(tier.describe())
                wait_for(lambda t=tier: not t.health().serving, 20,  # type: ignore[misc]
                         "the unreachable tier goes out of service", tier.on_schedule_end)  # fmt: skip
                assert SECRET not in tier.health().detail
        finally:
            for tier in built:
                tier.shutdown()
    assert SECRET not in caplog.text


# --- AWS_ENDPOINT_URL honoured -----------------------------------------------------------------------


def _round_trip(spec: dict[str, Any]) -> dict[str, Any]:
    rows = np.random.default_rng(3).integers(0, 256, (4, BLOCK), dtype=np.uint8)
    ctx = TierContext(rows, BLOCK, make_namespace(BLOCK))
    tier = create_tier(spec, ctx)
    try:
        keys = chain_ids(range(2), ctx.namespace)
        assert run_job(tier, keys, [0, 1], False, 20).success
        result = run_job(tier, keys, [2, 3], True, 20)
        assert result.success, result.error
        assert np.array_equal(rows[2:4], rows[0:2])
        return tier.describe()
    finally:
        tier.shutdown()


@pytest.mark.s3
@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT"])
def test_aws_endpoint_url_is_honoured_with_http_and_path_style(
    variable: str, s3_bucket: tuple[MotoServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, bucket = s3_bucket
    monkeypatch.setenv(variable, server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    shown = _round_trip({"type": "s3", "bucket": bucket})  # no endpoint, no allow_http, no path_style
    assert shown["endpoint"] == server.endpoint and shown["endpoint_from"] == variable
    assert shown["path_style"] is True and shown["allow_http"] is True


@pytest.mark.s3
def test_the_endpoint_option_and_the_s3_variable_win(
    s3_bucket: tuple[MotoServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, bucket = s3_bucket
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint)
    creds = {"access_key_id": "testing", "secret_access_key": "testing"}
    assert _round_trip({"type": "s3", "bucket": bucket, **creds})["endpoint_from"] == "AWS_ENDPOINT_URL_S3"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", dead)  # the option beats every variable (obstore's own included)
    spec = {"type": "s3", "bucket": bucket, "endpoint": server.endpoint, "allow_http": True, **creds}
    assert _round_trip(spec)["endpoint_from"] == "endpoint"


# --- one line for the usual misconfigurations --------------------------------------------------------


class _Forbidden(http.server.BaseHTTPRequestHandler):
    """An instance metadata service that refuses everything (as outside EC2, or with IMDS off)."""

    def do_PUT(self) -> None:
        self.send_response(403)
        self.end_headers()
        self.wfile.write(b"<Error>forbidden</Error>")

    do_GET = do_PUT

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def forbidden_imds() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Forbidden)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def _out_of_service_detail(spec: dict[str, Any]) -> str:
    tier = create_tier({**spec, "open_seconds": 30}, TierContext(np.zeros((4, BLOCK), np.uint8), BLOCK,
                                                                   make_namespace(BLOCK)))  # fmt: skip
    try:
        wait_for(lambda: not tier.health().serving, 20, "the tier goes out of service", tier.on_schedule_end)
        return tier.health().detail
    finally:
        tier.shutdown()


@pytest.mark.s3
@pytest.mark.parametrize("case", ["missing bucket", "missing credentials", "unreachable", "wrong host"])
def test_usual_misconfigurations_say_which_in_one_line(
    case: str, s3_bucket: tuple[MotoServer, str], forbidden_imds: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, bucket = s3_bucket
    creds = {"access_key_id": "testing", "secret_access_key": "testing"}
    spec: dict[str, Any] = {"type": "s3", "bucket": bucket, "endpoint": server.endpoint, "allow_http": True, **creds}
    expected = {"missing bucket": "bucket does not exist", "missing credentials": "no S3 credentials",
                "unreachable": "unreachable (connection refused)", "wrong host": "unreachable"}[case]  # fmt: skip
    if case == "missing bucket":
        spec["bucket"] = "kv-no-such-bucket"
    elif case == "missing credentials":
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                     "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):  # fmt: skip
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("AWS_METADATA_ENDPOINT", forbidden_imds)
        del spec["access_key_id"], spec["secret_access_key"]
    elif case == "unreachable":
        spec["endpoint"] = f"http://127.0.0.1:{free_port()}"
    else:
        spec["endpoint"] = "http://no-such-host.invalid:9000"
    detail = _out_of_service_detail(spec)
    assert expected in detail, detail
    assert "\n" not in detail and "<?xml" not in detail and "<Error" not in detail and len(detail) < 400, detail


# --- native crashes ----------------------------------------------------------------------------------


class PanicException(BaseException):
    """Stands in for pyo3's PanicException: not an Exception, raised by native code on a bug."""


class CrashingTier(MemoryTier):
    tier_type = "crashing-memory"

    def _run(self, work: Any, local: Any) -> None:
        raise PanicException("called `Result::unwrap()` on an `Err` value: InvalidPort")


def test_a_native_crash_takes_the_tier_out_of_service_and_keeps_its_workers() -> None:
    rows = np.zeros((8, BLOCK), dtype=np.uint8)
    tier = CrashingTier(TierContext(rows, BLOCK, make_namespace(BLOCK)), io_threads=2)
    try:
        workers = list(tier._threads)
        keys = chain_ids(range(2), tier.context.namespace)
        job = new_job(keys, [0, 1], False)
        tier.submit_store(job)
        result = wait_results(tier, {job.job_id}, 10)[job.job_id]
        assert not result.success and result.error
        assert "unwrap" not in result.error and "InvalidPort" not in result.error
        assert tier.health().state is HealthState.OPEN and "unwrap" not in tier.health().detail
        assert all(t.is_alive() for t in workers) and len(workers) == 2, "a worker died of the crash"
        later = new_job(keys, [2, 3], True)
        tier.submit_load(later)
        assert not wait_results(tier, {later.job_id}, 10)[later.job_id].success  # answered at once, no hang
    finally:
        tier.shutdown()


@pytest.mark.s3
def test_an_obstore_panic_in_a_worker_does_not_hang_anything(capfd: pytest.CaptureFixture[str]) -> None:
    """An endpoint that slipped past validation (built without it) makes obstore panic on every
    request: the tier goes out of service within seconds, jobs fail, shutdown is clean."""
    from kvtier.tiers.s3 import S3Tier
    from kvtier.tiers.s3_store import S3TierOptions

    valid = S3TierOptions(bucket="kv-panic", endpoint="http://127.0.0.1:9000", allow_http=True, access_key_id="k",
                          secret_access_key="s", max_in_flight=2, open_seconds=30)  # fmt: skip
    unchecked = valid.model_copy(update={"endpoint": "http://127.0.0.1:99999"})  # what validation would refuse
    rows = np.zeros((8, BLOCK), dtype=np.uint8)
    tier = S3Tier(TierContext(rows, BLOCK, make_namespace(BLOCK)), unchecked)
    t0 = time.monotonic()
    try:
        wait_for(lambda: not tier.health().serving, 15, "the tier goes out of service", tier.on_schedule_end)
        assert "InvalidPort" not in tier.health().detail and "unwrap" not in tier.health().detail
        keys = chain_ids(range(2), tier.context.namespace)
        job = new_job(keys, [0, 1], True)
        tier.submit_load(job)
        assert not wait_results(tier, {job.job_id}, 10)[job.job_id].success
        assert all(t.is_alive() for t in tier._threads), "a worker died of the panic"
    finally:
        tier.shutdown()
    assert time.monotonic() - t0 < 30
