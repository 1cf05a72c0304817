"""Talking to an S3-compatible store: the S3 tier's options, clients, key layout and manifest.

Layout of a bucket (``prefix`` defaults to ``kvtier``)::

    <prefix>/<namespace hex>/manifest.json        what the namespace holds (checked at start)
    <prefix>/<namespace hex>/<2 hex>/<key hex>    one object per block: 128-byte header + payload

The two hex characters (the key's first byte) spread objects over 256 key
prefixes, since S3 limits request rates per prefix (about 3,500 writes and
5,500 reads per second). Objects are written with one plain PUT each (no
multipart upload, so nothing half-written can linger) and are self-describing
(:mod:`kvtier.tiers.format`), so any reader verifies them end to end.

Clients are obstore's (Rust ``object_store``): they release the GIL, accept a
list of buffers as one body, retry with exponential backoff and jitter, and
read credentials from the standard chain (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, web identity, ECS
container credentials, EC2 instance metadata) unless keys are given. Payload
signing and SDK checksums are off: kvtier's header checksum is the integrity
check (``checksum`` turns S3's on as well). obstore is imported only when a
client is built, so these options are importable without it.
"""

from __future__ import annotations

import ipaddress
import json
import re
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.tiers.format import FORMAT_VERSION, HEADER_SIZE, MAX_KEY_BYTES
from kvtier.tiers.options import TierOptions

if TYPE_CHECKING:
    from obstore.store import S3Store

LAYOUT_VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 * 1024
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9!_.*'()\-]+(/[A-Za-z0-9!_.*'()\-]+)*$")
_OBJECT_RE = re.compile(rf"^[0-9a-f]{{2}}/([0-9a-f]{{2,{2 * MAX_KEY_BYTES}}})$")


class S3TierOptions(TierOptions):
    """S3-compatible object store tier (``type: s3``): AWS S3, MinIO, Ceph RGW, R2, GCS's S3 API."""

    bucket: str = Field(description="Bucket name (it must exist; kvtier never creates or deletes buckets).")
    prefix: str = Field(default="kvtier", description="Key prefix inside the bucket: <prefix>/<namespace>/...")
    endpoint: str | None = Field(
        default=None,
        description="http(s)://host:port of an S3-compatible server; None = AWS S3 in 'region'.",
    )
    region: str | None = Field(
        default=None,
        description="Region (signing scope; the AWS endpoint when no endpoint). None = AWS_REGION, else us-east-1.",
    )
    path_style: bool | None = Field(
        default=None,
        description="Path-style addressing (host/bucket/key). None = auto: path-style for any "
        "endpoint except *.amazonaws.com (MinIO, Ceph, IP and localhost endpoints need it).",
    )
    allow_http: bool = Field(default=False, description="Allow a plain http:// endpoint (no TLS).")
    ca_file: str | None = Field(
        default=None, description="PEM file of extra CA certificates to trust (a private CA); system roots stay."
    )
    access_key_id: SecretStr | None = Field(
        default=None, description="Access key; None = the standard credential chain (env, web identity, IMDS)."
    )
    secret_access_key: SecretStr | None = Field(default=None, description="Secret key (with access_key_id).")
    session_token: SecretStr | None = Field(default=None, description="Session token of temporary credentials.")
    max_in_flight: int = Field(
        default=32, ge=1, le=512, description="Concurrent requests (I/O threads); a quarter serve only reads."
    )
    max_queued_stores: int = Field(
        default=256, ge=1, description="Blocks waiting to be uploaded beyond which stores are shed."
    )
    request_timeout: float = Field(default=10.0, gt=0, description="Seconds per HTTP request (connect to body end).")
    connect_timeout: float = Field(default=2.0, gt=0, description="Seconds to establish a connection.")
    job_timeout: float = Field(
        default=30.0,
        gt=0,
        description="Deadline of a job after submission; retries (with backoff) stop in time to meet it.",
    )
    max_retries: int = Field(default=4, ge=0, description="Retries of a failed request (5xx, connection errors).")
    check_timeout: float = Field(
        default=1.0, gt=0, description="Deadline of one step's batched existence checks (HEADs); then MISS."
    )
    hit_seconds: float = Field(default=3600.0, gt=0, description="How long a known-present key answers HIT.")
    miss_seconds: float = Field(
        default=2.0, ge=0.5, description="How long a known-absent key answers MISS (other engines write too)."
    )
    failure_threshold: int = Field(
        default=3, ge=1, description="Consecutive failures that take the tier out of service."
    )
    open_seconds: float = Field(default=2.0, gt=0, description="Seconds out of service before a probe.")
    checksum: Literal["sha256", "crc64nvme"] | None = Field(
        default=None, description="Also let S3 check each upload with this checksum (kvtier checks every read anyway)."
    )
    create_only: bool = Field(
        default=False, description="Upload with If-None-Match: * (never overwrite an existing object)."
    )
    warm_start: bool = Field(
        default=False, description="List the namespace in the background at start so known blocks answer HIT at once."
    )
    max_index_entries: int = Field(
        default=4_000_000, ge=1024, description="Known-present keys remembered (about 200 bytes each)."
    )

    @field_validator("bucket")
    @classmethod
    def _bucket(cls, value: str) -> str:
        if not _BUCKET_RE.match(value) or ".." in value:
            raise ValueError(f"bucket {value!r} is not a valid bucket name (3-63 of a-z 0-9 . -)")
        return value

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        value = value.strip("/")
        if not _PREFIX_RE.match(value) or any(part in (".", "..") for part in value.split("/")):
            raise ValueError(f"prefix {value!r} must be non-empty path segments of letters, digits and !_.*'()-")
        return value

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"endpoint {value!r} must look like https://host[:port] or http://host[:port]")
        if parts.path not in ("", "/") or parts.query:
            raise ValueError(f"endpoint {value!r} must not have a path: give the bucket as 'bucket'")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _consistent(self) -> S3TierOptions:
        if self.endpoint and self.endpoint.startswith("http://") and not self.allow_http:
            raise ValueError(f"endpoint {self.endpoint} is plain http: set allow_http: true or use https://")
        if self.job_timeout <= self.request_timeout:
            raise ValueError(
                f"job_timeout ({self.job_timeout}s) must exceed request_timeout ({self.request_timeout}s): "
                "retries must fit inside a job's deadline"
            )
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("give both access_key_id and secret_access_key, or neither (standard chain)")
        if self.ca_file is not None and not Path(self.ca_file).is_file():
            raise ValueError(f"ca_file {self.ca_file!r} is not a readable file")
        if self.hit_seconds < self.miss_seconds:
            raise ValueError("hit_seconds must be >= miss_seconds")
        return self

    @property
    def uses_path_style(self) -> bool:
        if self.path_style is not None:
            return self.path_style
        if self.endpoint is None:
            return False
        host = urlsplit(self.endpoint).hostname or ""
        return not host.endswith(".amazonaws.com")

    def url(self) -> str:
        """``s3://bucket/prefix`` (for logs and describe)."""
        return f"s3://{self.bucket}/{self.prefix}"


def is_local_host(host: str) -> bool:
    """True for localhost and IP literals (they cannot carry a bucket in a virtual host name)."""
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def open_store(options: S3TierOptions, *, quick: bool = False) -> S3Store:
    """An obstore client for ``options``.

    ``quick`` builds the client of existence checks and probes: no retries and
    ``check_timeout`` per request, so a dead server is noticed within one
    deadline. The data client retries (backoff with jitter) within
    ``job_timeout - request_timeout`` seconds, so a job's last attempt ends
    before its deadline.
    """
    try:
        from obstore.store import S3Store
    except ImportError as exc:
        raise ConfigError("the s3 tier needs obstore: pip install 'kvtier[s3]'") from exc
    timeout = options.check_timeout if quick else options.request_timeout
    client: dict[str, Any] = {
        "timeout": timedelta(seconds=timeout),
        "connect_timeout": timedelta(seconds=min(options.connect_timeout, timeout)),
        "allow_http": options.allow_http,
        "pool_idle_timeout": timedelta(seconds=60),
    }
    if options.ca_file is not None:
        client["root_certificate"] = Path(options.ca_file).read_bytes()
    retry: dict[str, Any] = {
        "max_retries": 0 if quick else options.max_retries,
        "retry_timeout": timedelta(seconds=max(0.1, options.job_timeout - options.request_timeout)),
        "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2), "base": 2},
    }
    config: dict[str, Any] = {
        "unsigned_payload": True,
        "virtual_hosted_style_request": not options.uses_path_style,
    }
    if options.region is not None:
        config["region"] = options.region
    if options.endpoint is not None:
        endpoint = options.endpoint
        if not options.uses_path_style:
            parts = urlsplit(endpoint)
            host = parts.hostname or ""
            if is_local_host(host):
                raise ConfigError(
                    f"s3 endpoint {endpoint} is an IP or localhost: virtual-hosted addressing cannot work; "
                    "leave path_style unset or set it true"
                )
            if not host.startswith(options.bucket + "."):
                endpoint = parts._replace(netloc=f"{options.bucket}.{parts.netloc}").geturl()
        config["endpoint"] = endpoint
    if options.checksum is not None and not quick:
        config["checksum_algorithm"] = options.checksum
    for name in ("access_key_id", "secret_access_key", "session_token"):
        secret = getattr(options, name)
        if secret is not None:
            config[name] = secret.get_secret_value()
    return S3Store(options.bucket, config=config, client_options=client, retry_config=retry)  # type: ignore[arg-type]


def namespace_prefix(prefix: str, namespace_hex: str) -> str:
    return f"{prefix}/{namespace_hex}"


def object_path(ns_prefix: str, key: BlockKey) -> str:
    """``<prefix>/<namespace hex>/<2 hex>/<key hex>``."""
    hexkey = key.hex()
    return f"{ns_prefix}/{hexkey[:2]}/{hexkey}"


def key_of_path(ns_prefix: str, path: str) -> BlockKey | None:
    """The block key an object path names, or None if it is not a block of this namespace."""
    if not path.startswith(ns_prefix + "/"):
        return None
    m = _OBJECT_RE.match(path[len(ns_prefix) + 1 :])
    if m is None or len(m.group(1)) % 2 or not path[len(ns_prefix) + 1 :].startswith(m.group(1)[:2]):
        return None
    return bytes.fromhex(m.group(1))


def manifest_dict(namespace_digest: bytes, namespace_canonical: str, block_bytes: int) -> dict[str, Any]:
    return {
        "kvtier_s3_layout": LAYOUT_VERSION,
        "value_format_version": FORMAT_VERSION,
        "namespace_digest": namespace_digest.hex(),
        "namespace": json.loads(namespace_canonical),
        "block_bytes": block_bytes,
        "header_bytes": HEADER_SIZE,
    }


def parse_manifest(raw: bytes) -> dict[str, Any]:
    """The manifest's JSON object (plain JSON only; nothing is evaluated); ValueError if malformed."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ValueError(f"manifest is {len(raw)} bytes (limit {MAX_MANIFEST_BYTES})")
    data = json.loads(raw.decode("utf-8"))
    if not isinstance(data, dict):
        raise ValueError("manifest is not a JSON object")
    return data


def manifest_mismatch(found: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """The first field where ``found`` differs from ``expected``, described; None if they agree."""
    for name in expected:
        if found.get(name) != expected[name]:
            return f"{name}={found.get(name)!r}, this engine needs {expected[name]!r}"
    return None


ErrorKind = Literal["refused", "timeout", "throttled", "server", "denied", "missing", "other"]


def classify_error(exc: BaseException) -> ErrorKind:
    """What an obstore error means for the breaker: refused connections open it at once."""
    if isinstance(exc, FileNotFoundError):
        return "missing"
    text = str(exc)
    if "ConnectionRefused" in text or "Connection refused" in text:
        return "refused"
    if "TimedOut" in text or "kind: Timeout" in text or "timed out" in text.lower():
        return "timeout"
    if "SlowDown" in text or "503" in text:
        return "throttled"
    if re.search(r"status code: 5\d\d", text):
        return "server"
    if type(exc).__name__ in ("PermissionDeniedError", "UnauthenticatedError") or re.search(
        r"status code: 40[13]", text
    ):
        return "denied"
    return "other"


def short_error(exc: BaseException) -> str:
    """The first line of an obstore error (a debug dump follows it) plus what it means."""
    from kvtier.tiers.jobs import describe_error

    kind = classify_error(exc)
    meaning = {
        "refused": " (connection refused)",
        "timeout": " (timed out)",
        "throttled": " (503 SlowDown: throttled)",
        "denied": " (access denied: check credentials and the IAM policy)",
    }.get(kind, "")
    return describe_error(exc) + meaning


__all__ = [
    "MANIFEST",
    "S3TierOptions",
    "classify_error",
    "key_of_path",
    "manifest_dict",
    "manifest_mismatch",
    "namespace_prefix",
    "object_path",
    "open_store",
    "parse_manifest",
    "short_error",
]
