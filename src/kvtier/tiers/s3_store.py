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
import os
import re
import stat
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator

from kvtier.errors import ConfigError
from kvtier.failures import describe_error, is_native_crash
from kvtier.keys import BlockKey
from kvtier.tiers.endpoints import parse_endpoint, redact_url
from kvtier.tiers.format import FORMAT_VERSION, HEADER_SIZE, MAX_KEY_BYTES
from kvtier.tiers.options import QueueLength, Seconds, TierOptions

if TYPE_CHECKING:
    from obstore.store import S3Store

LAYOUT_VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 * 1024
MAX_OBJECT_BYTES = 5 << 30
"""The largest object the S3 tier can write: it PUTs each block (header and payload) as one plain
PUT, never multipart, and S3 refuses a single PUT over 5 GiB. A larger object under a tier prefix
is not a block kvtier wrote; offline inspection never reads one (it could be any size)."""
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]\Z")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9!_.*'()\-]+(/[A-Za-z0-9!_.*'()\-]+)*\Z")
MAX_OBJECT_NAME_BYTES = 1024
"""S3's limit on an object name (its key), in UTF-8 bytes."""
MAX_PREFIX_CHARS = MAX_OBJECT_NAME_BYTES - len("/") - 32 - len("/") - 2 - len("/") - 2 * MAX_KEY_BYTES
"""The longest ``prefix`` whose object names (``<prefix>/<namespace hex>/<2 hex>/<key hex>``,
keys of up to :data:`MAX_KEY_BYTES`) all fit in :data:`MAX_OBJECT_NAME_BYTES`."""
_OBJECT_RE = re.compile(rf"^[0-9a-f]{{2}}/([0-9a-f]{{2,{2 * MAX_KEY_BYTES}}})\Z")


CREDENTIAL_URL_VARIABLES = ("AWS_METADATA_ENDPOINT", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_STS_ENDPOINT")
"""Environment variables naming where the standard credential chain fetches credentials."""

ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
"""Environment variables that name an S3 endpoint when the ``endpoint`` option is unset, first wins."""

_REGION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")


def check_s3_endpoint(value: str, what: str) -> str:
    """``value`` without a trailing slash if it is ``http(s)://host[:port]``; else ValueError
    naming ``what`` (the option or environment variable) and the fix. Credentials in it are
    refused (and never shown): they go in ``access_key_id``/``secret_access_key``."""
    ep = parse_endpoint(value, what, ("http", "https"))
    where = f"{what} {redact_url(value)!r}"
    if ep.username is not None or ep.password is not None:
        raise ValueError(
            f"{where} carries credentials: give them as access_key_id/secret_access_key "
            "(or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY), not in the URL"
        )
    if ep.path not in ("", "/") or ep.query or "?" in value:
        raise ValueError(f"{where} must not have a path or query (http(s)://host[:port]): give the bucket as 'bucket'")
    return f"{ep.scheme}://{value.split('://', 1)[1].rstrip('/')}"  # the scheme in lower case


def check_ca_file(path: str) -> None:
    """ValueError unless ``path`` is a regular file (links followed: the operator named it;
    never waiting on a FIFO) with a PEM certificate in its first MiB."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"ca_file {path!r} is not a readable file ({exc.strerror or exc})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"ca_file {path!r} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        head = f.read(1 << 20)
    if b"-----BEGIN CERTIFICATE-----" not in head:
        raise ValueError(f"ca_file {path!r} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")


def environment_endpoint() -> tuple[str | None, str]:
    """The endpoint the environment names (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL`` or
    ``AWS_ENDPOINT``, first set wins) and that variable, checked like the option (ValueError
    naming the variable); ``(None, "AWS")`` when none is set."""
    for name in ENDPOINT_VARIABLES:
        value = os.environ.get(name)
        if value:
            return check_s3_endpoint(value, f"environment variable {name}"), name
    return None, "AWS"


def check_region(value: str, what: str) -> str:
    """``value`` if it can be a region (letters, digits, '-', '_'; it may become part of a host name)."""
    if not _REGION_RE.fullmatch(value):
        raise ValueError(f"{what} {value[:80]!r} is not a region name: use e.g. us-east-1")
    return value


class S3TierOptions(TierOptions):
    """S3-compatible object store tier (``type: s3``): AWS S3, MinIO, Ceph RGW, R2, GCS's S3 API."""

    bucket: str = Field(description="Bucket name (it must exist; kvtier never creates or deletes buckets).")
    prefix: str = Field(default="kvtier", description="Key prefix inside the bucket: <prefix>/<namespace>/...")
    endpoint: str | None = Field(
        default=None,
        validate_default=True,
        description="http(s)://host[:port] of an S3-compatible server. None: AWS_ENDPOINT_URL_S3 or "
        "AWS_ENDPOINT_URL from the environment (honoured as the AWS CLI does: http allowed, path-style), "
        "else AWS S3 in 'region'.",
    )
    region: str | None = Field(
        default=None,
        validate_default=True,
        description="Region (signing scope; the AWS endpoint when no endpoint). None = AWS_REGION, else us-east-1.",
    )
    path_style: bool | None = Field(
        default=None,
        description="Path-style addressing (host/bucket/key). None = auto: path-style for any "
        "endpoint except *.amazonaws.com (MinIO, Ceph, IP and localhost endpoints need it).",
    )
    allow_http: bool = Field(
        default=False, validate_default=True, description="Allow a plain http:// endpoint (no TLS)."
    )
    ca_file: str | None = Field(
        default=None, description="PEM file of extra CA certificates to trust (a private CA); system roots stay."
    )
    access_key_id: SecretStr | None = Field(
        default=None,
        validate_default=True,
        description="Access key; None = the standard credential chain (env, web identity, IMDS).",
    )
    secret_access_key: SecretStr | None = Field(default=None, description="Secret key (with access_key_id).")
    session_token: SecretStr | None = Field(default=None, description="Session token of temporary credentials.")
    max_in_flight: int = Field(
        default=32,
        ge=1,
        le=512,
        description="Concurrent requests: I/O threads (a quarter serve only reads), and as many for existence checks.",
    )
    max_queued_stores: QueueLength = Field(
        default=256, description="Blocks waiting to be uploaded beyond which stores are shed."
    )
    request_timeout: Seconds = Field(default=10.0, gt=0, description="Seconds per HTTP request (connect to body end).")
    connect_timeout: Seconds = Field(default=2.0, gt=0, description="Seconds to establish a connection.")
    job_timeout: Seconds = Field(
        default=30.0,
        gt=0,
        validate_default=True,
        description="Deadline of a job after submission; retries (with backoff) fit the time the job has left "
        "(work started late makes one attempt: at most request_timeout past the deadline).",
    )
    max_retries: int = Field(
        default=4, ge=0, le=100, description="Retries of a failed request (5xx, connection errors)."
    )
    check_timeout: Seconds = Field(
        default=1.0, gt=0, description="Deadline of one step's batched existence checks (HEADs); then MISS."
    )
    hit_seconds: Seconds = Field(default=3600.0, gt=0, description="How long a known-present key answers HIT.")
    miss_seconds: Seconds = Field(
        default=2.0,
        ge=0.5,
        validate_default=True,
        description="How long a known-absent key answers MISS (other engines write too).",
    )
    failure_threshold: int = Field(
        default=3, ge=1, le=1_000_000, description="Consecutive failures that take the tier out of service."
    )
    open_seconds: Seconds = Field(default=2.0, gt=0, description="Seconds out of service before a probe.")
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
        default=4_000_000, ge=1024, le=1 << 32, description="Known-present keys remembered (about 200 bytes each)."
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
        if len(value) > MAX_PREFIX_CHARS:
            raise ValueError(
                f"prefix is {len(value)} characters; at most {MAX_PREFIX_CHARS}, or object names "
                f"(<prefix>/<namespace>/<2 hex>/<key hex>) pass S3's {MAX_OBJECT_NAME_BYTES}-byte limit"
            )
        return value

    # validate_default: when unset, the environment variable that stands in for it is checked.
    @field_validator("endpoint", mode="after")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None:
            return check_s3_endpoint(value, "endpoint")
        environment_endpoint()
        return None

    @field_validator("ca_file", mode="after")
    @classmethod
    def _ca_file(cls, value: str | None) -> str | None:
        if value is not None:
            check_ca_file(value)
        return value

    @field_validator("region", mode="after")
    @classmethod
    def _region(cls, value: str | None) -> str | None:
        if value is not None:
            return check_region(value, "region")
        for name in ("AWS_REGION", "AWS_DEFAULT_REGION"):
            if os.environ.get(name):
                check_region(os.environ[name], f"environment variable {name}")
        return None

    @field_validator("access_key_id", mode="after")
    @classmethod
    def _credential_chain(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:  # the standard chain: the client fetches credentials from these URLs
            for name in CREDENTIAL_URL_VARIABLES:
                url = os.environ.get(name)
                if url:
                    what = f"environment variable {name} (credentials are fetched there)"
                    parse_endpoint(url, what, ("http", "https"))
            relative = os.environ.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
            if relative and (not relative.startswith("/") or re.search(r"[^\x21-\x7e]", relative)):
                raise ValueError(
                    f"environment variable AWS_CONTAINER_CREDENTIALS_RELATIVE_URI {redact_url(relative)!r} must be "
                    "a path such as /v2/credentials/..."
                )
        return value

    # Checks against an earlier field sit on the later one (validate_default), so the error names it.
    @field_validator("allow_http", mode="after")
    @classmethod
    def _http(cls, allow: bool, info: ValidationInfo) -> bool:
        endpoint = info.data.get("endpoint")
        if isinstance(endpoint, str) and endpoint.startswith("http://") and not allow:
            raise ValueError(f"endpoint {endpoint} is plain http: set allow_http: true or use https://")
        return allow

    @field_validator("job_timeout", mode="after")
    @classmethod
    def _job_timeout(cls, job_timeout: float, info: ValidationInfo) -> float:
        request_timeout = info.data.get("request_timeout")
        if request_timeout is not None and job_timeout <= request_timeout:
            raise ValueError(
                f"job_timeout ({job_timeout}s) must exceed request_timeout ({request_timeout}s): "
                "retries must fit inside a job's deadline"
            )
        return job_timeout

    @field_validator("miss_seconds", mode="after")
    @classmethod
    def _miss_seconds(cls, miss_seconds: float, info: ValidationInfo) -> float:
        hit_seconds = info.data.get("hit_seconds")
        if hit_seconds is not None and hit_seconds < miss_seconds:
            raise ValueError(f"hit_seconds ({hit_seconds}) must be >= miss_seconds ({miss_seconds})")
        return miss_seconds

    @model_validator(mode="after")
    def _consistent(self) -> S3TierOptions:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("give both access_key_id and secret_access_key, or neither (standard chain)")
        return self

    def endpoint_setting(self) -> tuple[str | None, str]:
        """The endpoint in use and where it comes from: the ``endpoint`` option, else
        ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT`` from the environment
        (checked like the option; ValueError naming the variable), else ``(None, "AWS")``."""
        if self.endpoint is not None:
            return self.endpoint, "endpoint"
        return environment_endpoint()

    @property
    def uses_path_style(self) -> bool:
        if self.path_style is not None:
            return self.path_style
        endpoint, _ = self.endpoint_setting()
        if endpoint is None:
            return False
        host = urlsplit(endpoint).hostname or ""
        return not host.endswith(".amazonaws.com")

    @property
    def uses_http(self) -> bool:
        """Plain http allowed: ``allow_http``, or an http endpoint from the environment (as the AWS CLI)."""
        endpoint, source = self.endpoint_setting()
        return self.allow_http or (source != "endpoint" and endpoint is not None and endpoint.startswith("http://"))

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


def open_store(options: S3TierOptions, *, quick: bool = False, retry_seconds: float | None = None) -> S3Store:
    """An obstore client for ``options``.

    ``quick`` builds the client of existence checks and probes: no retries and
    ``check_timeout`` per request, so a dead server is noticed within one
    deadline. The data client retries (backoff with jitter) within
    ``retry_seconds`` (default ``job_timeout - request_timeout``), so the last
    attempt of work started with that much time left ends before its deadline;
    ``retry_seconds=0`` makes one attempt.
    """
    try:
        from obstore.store import S3Store
    except ImportError as exc:
        raise ConfigError("the s3 tier needs obstore: pip install 'kvtier[s3]'") from exc
    timeout = options.check_timeout if quick else options.request_timeout
    client: dict[str, Any] = {
        "timeout": timedelta(seconds=timeout),
        "connect_timeout": timedelta(seconds=min(options.connect_timeout, timeout)),
        "allow_http": options.uses_http,
        "pool_idle_timeout": timedelta(seconds=60),
    }
    if options.ca_file is not None:
        client["root_certificate"] = Path(options.ca_file).read_bytes()
    budget = options.job_timeout - options.request_timeout if retry_seconds is None else retry_seconds
    retry: dict[str, Any] = {
        "max_retries": 0 if quick or budget <= 0 else options.max_retries,
        "retry_timeout": timedelta(seconds=max(0.1, budget)),
        "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2), "base": 2},
    }
    config: dict[str, Any] = {
        "unsigned_payload": True,
        "virtual_hosted_style_request": not options.uses_path_style,
    }
    if options.region is not None:
        config["region"] = options.region
    try:
        endpoint, _ = options.endpoint_setting()
    except ValueError as exc:  # the environment changed since the options were validated
        raise ConfigError(f"s3 tier: {exc}") from None
    if endpoint is not None:
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
        # Both names: obstore would let AWS_ENDPOINT_URL_S3 from the environment override 'endpoint'.
        config["endpoint"] = config["aws_endpoint_url_s3"] = endpoint
    if options.checksum is not None and not quick:
        config["checksum_algorithm"] = options.checksum
    for name in ("access_key_id", "secret_access_key", "session_token"):
        secret = getattr(options, name)
        if secret is not None:
            config[name] = secret.get_secret_value()
    try:
        return S3Store(options.bucket, config=config, client_options=client, retry_config=retry)  # type: ignore[arg-type]
    except Exception as exc:  # e.g. a bad AWS_* variable the client reads itself
        raise ConfigError(f"s3 tier: the S3 client refused its settings: {describe_error(exc)}") from None


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


_BAD_PATH = re.compile(r'Path "([^"]{0,1024})"')


def list_objects(
    store: S3Store,
    prefix: str,
    unlisted: list[str],
    shards_at: int | None = 0,
    missed: list[str] | None = None,
) -> Iterator[Sequence[Any]]:
    """Batches of the objects (``ObjectMeta``) under ``prefix`` (ending in ``/``), as ``obstore.list`` gives them,
    except that a foreign object whose name the client cannot parse (``a//b``, ``a/./b``: another
    application's, in a shared bucket) does not end the listing: the folder holding it is listed
    level by level around it, and the name (or the folder holding it, as the client's error
    says) goes to ``unlisted``. ``shards_at``: how many levels
    below ``prefix`` the namespace folders are (their manifest and 256 shards are read one by one
    when the folder itself cannot be listed). At any other level that cannot be listed, the names
    after the unparseable folder's (every kvtier name sorts after ``''``, ``.`` and ``..``) are
    listed from past it; if that listing fails too, the folder and where it stopped go to
    ``missed`` (or ``unlisted`` if None): what follows is not listed. An object may come twice:
    callers deduplicate.
    """
    import obstore as obs
    from obstore.exceptions import InvalidPathError

    try:
        yield from obs.list(store, prefix=prefix, chunk_size=1000)
        return
    except InvalidPathError:
        pass
    try:
        level = obs.list_with_delimiter(store, prefix=prefix)
    except InvalidPathError as exc:
        found = _BAD_PATH.search(str(exc))
        bad = found.group(1) if found else None
        unlisted.append(bad or f"{prefix}... (a name the S3 client cannot parse)")
        if shards_at == 0:  # a namespace folder: its manifest, then its shards one by one
            try:
                manifest = [obs.head(store, prefix + MANIFEST)]
            except FileNotFoundError:
                manifest = []
            if manifest:
                yield manifest
            for shard in range(256):
                yield from list_objects(store, f"{prefix}{shard:02x}/", unlisted, None, missed)
            return
        segment = bad[len(prefix) :].split("/", 1)[0] if bad and bad.startswith(prefix) else None
        if segment in ("", ".", ".."):  # '/' + 1 is '0': past every name in the unparseable folder
            try:
                yield from obs.list(store, prefix=prefix, offset=f"{prefix}{segment}0", chunk_size=1000)
                return
            except InvalidPathError as again:
                found = _BAD_PATH.search(str(again))
                stop = found.group(1) if found else "a name the S3 client cannot parse"
                (unlisted if missed is None else missed).append(f"{prefix} (listing stopped at {stop!r})")
                return
        (unlisted if missed is None else missed).append(f"{prefix} (cannot be listed: {short_error(exc)})")
        return
    if level["objects"]:
        yield level["objects"]
    for folder in level["common_prefixes"]:
        yield from list_objects(store, folder + "/", unlisted, None if not shards_at else shards_at - 1, missed)


def manifest_dict(namespace_digest: bytes, namespace_canonical: str, block_bytes: int) -> dict[str, Any]:
    return {
        "kvtier_s3_layout": LAYOUT_VERSION,
        "value_format_version": FORMAT_VERSION,
        "namespace_digest": namespace_digest.hex(),
        "namespace": json.loads(namespace_canonical),
        "block_bytes": block_bytes,
        "header_bytes": HEADER_SIZE,
    }


STREAM_CHUNK = 1 << 20
"""Bytes a bounded read asks the stream for at a time."""

PREALLOCATE_BYTES = 16 << 20
"""The most a bounded read allocates before the body's bytes arrive (it grows as they do)."""


def bounded_body(result: Any, limit: int) -> memoryview | str:
    """The body of a GET ``result``, or, reading no further, what showed it larger than ``limit``
    (e.g. :data:`MAX_OBJECT_BYTES`): the size the GET answered, or its body running past it.
    Memory held stays below ``limit`` plus one chunk of the stream, whatever the server sends.
    For reads of objects a shared bucket may hold anything under (inspect, the manifest check)."""
    size = int(result.meta["size"])
    if size > limit:
        return f"the GET answered {size} bytes"
    # Allocated as the body comes (the size answered is the server's word): one that says GiB
    # and sends a few bytes costs a few bytes, not GiB of zeroes.
    body = bytearray(min(size, PREALLOCATE_BYTES))
    filled = 0
    for chunk in result.stream(min_chunk_size=min(STREAM_CHUNK, limit)):
        n = len(chunk)
        if filled + n > limit:
            return f"its body ran past {limit} bytes (the GET said {size})"
        body[filled : filled + n] = chunk  # (grows the buffer where the body runs past it)
        filled += n
    return memoryview(body)[:filled]


def parse_manifest(raw: bytes) -> dict[str, Any]:
    """The manifest's JSON object (plain JSON only; nothing is evaluated); ValueError if malformed."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ValueError(f"manifest is {len(raw)} bytes (limit {MAX_MANIFEST_BYTES})")
    try:
        data = json.loads(raw.decode("utf-8"))
    except RecursionError:  # planted: thousands of nested arrays fit under the size limit
        raise ValueError("manifest is nested too deeply to be one") from None
    if not isinstance(data, dict):
        raise ValueError("manifest is not a JSON object")
    return data


def manifest_mismatch(found: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """The first field where ``found`` differs from ``expected``, described; None if they agree."""
    for name in expected:
        if found.get(name) != expected[name]:
            return f"{name}={found.get(name)!r}, this engine needs {expected[name]!r}"
    return None


ErrorKind = Literal[
    "crash", "no_bucket", "credentials", "refused", "unreachable", "timeout", "throttled", "server", "denied",
    "missing", "other",
]  # fmt: skip

TRIPPING: frozenset[ErrorKind] = frozenset({"crash", "no_bucket", "credentials", "refused", "unreachable"})
"""Failures that take the tier out of service at once: retrying soon cannot help."""

OUTCOME_UNKNOWN: frozenset[ErrorKind] = frozenset({"crash", "timeout", "server", "other"})
"""Failures after which a PUT may still have landed (the request may have reached the server):
the S3 tier checks such an upload again with a HEAD once in service."""

_PERFORMING = re.compile(r"Error performing (\w+) (\S+)")
_STATUS = re.compile(r"status code: (\d{3})")
_S3_CODE = re.compile(r"<Code>(\w{1,64})</Code>")
_UNREACHABLE = {"refused": "connection refused", "unreachable": "host not found or no route", "timeout": "timed out"}
_IMDS_HOSTS = ("169.254.169.254", "fd00:ec2::254", "[fd00:ec2::254]")
_IMDS_PATHS = ("/latest/api/token", "/latest/meta-data")
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s,\"')]+")
_NAMED = re.compile(r'(location |path: ")[^\s"]*')
_XML = re.compile(r"<\?xml.*?</Error>|<Error>.*?</Error>", re.DOTALL)


def _own_words(text: str) -> str:
    """An error's text without what names the bucket, prefix or key (URLs, object paths, the
    server's XML body): those may hold any word ('kv-credentials', 'NoSuchBucket-x')."""
    return _NAMED.sub(r"\1", _URL.sub("<url>", _XML.sub("<body>", text)))


def _asks_imds(text: str) -> bool:
    """True if a request in the error went to the instance metadata service (credentials)."""
    for url in _URL.findall(text):
        parts = urlsplit(url)
        if parts.netloc.rsplit("@", 1)[-1].rsplit(":", 1)[0] in _IMDS_HOSTS or parts.path.startswith(_IMDS_PATHS):
            return True
    return False


def classify_error(exc: BaseException) -> ErrorKind:
    """What an obstore error means, from its type, the HTTP status, the S3 ``<Code>`` and the
    client's own words; never from the bucket, prefix or key named in its URLs and paths."""
    if is_native_crash(exc):
        return "crash"
    text = str(exc)
    words = _own_words(text)
    found = _S3_CODE.search(text)
    code = found.group(1) if found else None
    if code == "NoSuchBucket":
        return "no_bucket"
    if _asks_imds(text) or "credential" in words.lower():
        return "credentials"
    if isinstance(exc, FileNotFoundError):
        return "missing"
    if "ConnectionRefused" in words or "Connection refused" in words:
        return "refused"
    if "TimedOut" in words or "kind: Timeout" in words or "timed out" in words.lower():
        return "timeout"
    if "dns error" in words or "kind: Connect" in words:
        return "unreachable"
    status = _STATUS.search(words)
    if code == "SlowDown" or (status is not None and status.group(1) == "503"):
        return "throttled"
    if status is not None and status.group(1).startswith("5"):
        return "server"
    if type(exc).__name__ in ("PermissionDeniedError", "UnauthenticatedError") or (
        status is not None and status.group(1) in ("401", "403")
    ):
        return "denied"
    return "other"


def range_refused(exc: BaseException) -> bool:
    """Did a ranged GET fail for its range alone: 416 (``InvalidRange``: an empty object has no
    byte to send), or a whole object sent back (200) to a store that ignores ranges? Both are
    one answer, never retried by the client."""
    text = str(exc)
    found = _S3_CODE.search(text)
    status = _STATUS.search(_own_words(text))
    if (found is not None and found.group(1) == "InvalidRange") or (status is not None and status.group(1) == "416"):
        return True
    return "non-partial response" in _own_words(text)


def conditional_write_unsupported(exc: BaseException) -> bool:
    """Did the server refuse an upload for its ``If-None-Match`` header (501 NotImplemented:
    a store without conditional writes)?"""
    text = str(exc)
    found = _S3_CODE.search(text)
    status = _STATUS.search(_own_words(text))
    if found is not None and found.group(1) == "NotImplemented":
        return True
    return status is not None and status.group(1) == "501"


def short_error(exc: BaseException) -> str:
    """One line saying what went wrong and what to do, from an obstore error: never its XML
    body, debug dump or a native crash's text."""
    kind = classify_error(exc)
    text = str(exc)
    call = _PERFORMING.search(text)
    target = urlsplit(call.group(2)) if call else None
    server = f"{target.scheme}://{target.netloc}" if target is not None and target.netloc else "the S3 endpoint"
    status = _STATUS.search(text)
    code = _S3_CODE.search(text)
    reply = " ".join(p for p in (status.group(1) if status else "", code.group(1) if code else "") if p)
    if kind == "crash":
        return describe_error(exc)
    if kind == "no_bucket":
        return f"the bucket does not exist ({server} answered 404 NoSuchBucket): create it or fix 'bucket'"
    if kind == "credentials":
        why = f"answered {reply}" if reply else "is unreachable"
        return (
            f"no S3 credentials: none given, and the instance metadata service ({server}) {why}: set "
            "access_key_id/secret_access_key or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
        )
    if kind in _UNREACHABLE:
        return f"{server} is unreachable ({_UNREACHABLE[kind]}): check 'endpoint' (or AWS_ENDPOINT_URL) and the network"
    if kind == "throttled":
        return f"{server} is throttling requests (503 SlowDown)"
    if kind == "denied":
        return f"access denied ({reply or 'forbidden'}): check the credentials and the bucket policy"
    first = describe_error(exc).split(" - ", 1)[0]
    for marker in ("<?xml", "<Error"):
        first = first.split(marker, 1)[0]
    return first.rstrip(" :") + (f" ({reply})" if reply else "")


__all__ = [
    "ENDPOINT_VARIABLES",
    "MANIFEST",
    "TRIPPING",
    "S3TierOptions",
    "bounded_body",
    "check_region",
    "check_s3_endpoint",
    "classify_error",
    "conditional_write_unsupported",
    "key_of_path",
    "list_objects",
    "manifest_dict",
    "manifest_mismatch",
    "namespace_prefix",
    "object_path",
    "open_store",
    "parse_manifest",
    "short_error",
]
