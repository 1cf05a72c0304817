"""Offline inspection of an S3 tier prefix (``kvtier inspect s3://bucket/prefix``).

Lists ``<prefix>/`` once, groups objects by namespace, reads each namespace's
manifest, and counts blocks and bytes. With ``verify`` it reads blocks back
(all of them, or a random sample per namespace) and checks each against the
header it must carry: namespace digest (from the path), key (from the object
name), payload length (from the manifest) and xxh3 checksum. Nothing read is
evaluated. ``remove_corrupt`` deletes only the objects proven corrupt, the same
rule as the fs tier's inspect: never an object whose read failed (403, 5xx, a
timeout prove nothing), never another release's value (kvtier's magic with a
format version this one cannot read: its writer can read it), and nothing in a
namespace without a usable manifest (missing, unreadable, another namespace's,
another layout's or header size): blocks there are judged by their own header
alone and kept. Each block is judged from one GET of the whole object, never from
the listing's size; a block whose own header and checksum verify is kept even if
its size disagrees with the manifest, and the manifest is then the suspect: the
namespace's ``manifest_error`` says so (engines refuse such a namespace), so the
report is not ok. An object proven corrupt by its own header or checksum is deleted
only if a HEAD just before the DELETE still shows the ETag and size read (S3 has
no delete-if-unchanged obstore can send).

Memory stays bounded by one chunk of a GET's body (:data:`STREAM_CHUNK`), whatever
the bucket holds: a block is judged as it streams (its header kept, the rest
hashed, never held whole). An object larger than the largest one kvtier writes
(:data:`MAX_OBJECT_BYTES`, S3's 5 GiB limit on one PUT) is not read: listed larger,
it is not fetched; answered larger by its GET (re-stored since the listing) or with
a body running past it, it is not read on. Either is reported ``unreadable`` (not
checked) and kept: a shared bucket may hold a foreign object of any size. A manifest is held
to :data:`MAX_MANIFEST_BYTES` the same way (listed, answered or streamed larger: not
read on, reported as the namespace's manifest error).

Blocking and single-threaded; meant for an operator's shell, never for an engine.
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from typing import Any
from urllib.parse import unquote, urlsplit

from kvtier.errors import ConfigError, CorruptValueError, ForeignFormatError
from kvtier.tiers.endpoints import redact_url, split_scheme
from kvtier.tiers.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    PREFIX_SIZE,
    decode_header,
    foreign_format,
    older_readable_format,
    payload_hasher,
    verify_digest,
)
from kvtier.tiers.fs_layout import CorruptEntry, NamespaceReport, RootReport
from kvtier.tiers.s3_store import (
    LAYOUT_VERSION,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_OBJECT_BYTES,
    STREAM_CHUNK,
    S3TierOptions,
    bounded_body,
    key_of_path,
    list_objects,
    open_store,
    parse_manifest,
    short_error,
)

_NAMESPACE_RE = re.compile(r"^[0-9a-f]{32}\Z")
_SUSPECT_MANIFEST = "(kept: the manifest is suspect)"


def options_from_url(url: str, **overrides: Any) -> dict[str, Any]:
    """S3 tier options from a URL; ``overrides`` (e.g. ``region``) win.

    * ``s3://bucket[/prefix]``: AWS S3, credentials from the standard chain;
    * ``http[s]://[key:secret@]host:port/bucket[/prefix]``: an S3-compatible
      endpoint, path-style; ``http`` implies ``allow_http``.
    """
    shown = redact_url(url)
    split = split_scheme(url)  # None for 'http:/KEY://SECRET@host': that '://' is inside the credentials
    if split is None:
        if "@" in url:  # 'http:/key:secret@host/...': no netloc, so nothing would redact the userinfo
            shown = "***@" + redact_url(url.rsplit("@", 1)[1])
        raise ConfigError(
            f"s3 url {shown!r} has no '://' right after its scheme: write s3://bucket/prefix or "
            "http(s)://[key:secret@]host:port/bucket/prefix (key and secret percent-encoded)"
        )
    scheme, rest = split
    if "@" in rest:  # '@' is in no bucket or prefix: everything before the last one is userinfo
        shown = f"{scheme}://***@{redact_url(rest.rsplit('@', 1)[1])}"
        if scheme.lower() == "s3":  # urlsplit lower-cases the scheme: 'S3://' is s3:// too
            raise ConfigError(
                f"s3 url {shown!r} carries credentials: s3:// uses the standard AWS chain; give an endpoint "
                "URL http(s)://key:secret@host:port/bucket for explicit keys"
            )
        if any(c in rest.rsplit("@", 1)[0] for c in "/?#"):
            raise ConfigError(
                f"s3 url {shown!r}: the key or secret holds an unencoded '/', '?' or '#': "
                "percent-encode it (%2F, %3F, %23)"
            )
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ConfigError(f"s3 url {shown!r} is malformed ({exc}): use s3://bucket/prefix") from None
    path = [unquote(p) for p in parts.path.split("/") if p]
    options: dict[str, Any] = {}
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ConfigError(f"s3 url {shown!r} needs a bucket: s3://bucket/prefix")
        if ":" in parts.netloc:  # urlsplit would drop a port, and lower-case the name (another bucket)
            raise ConfigError(f"s3 url {shown!r}: s3://bucket/prefix takes no port; for an endpoint give "
                              "http(s)://host:port/bucket/prefix")  # fmt: skip
        options["bucket"] = parts.netloc
    elif parts.scheme in ("http", "https"):
        if not path:
            raise ConfigError(f"s3 url {shown!r} needs a bucket after the endpoint: http://host:port/bucket/prefix")
        netloc = parts.netloc.rsplit("@", 1)[-1]
        options["endpoint"] = f"{parts.scheme}://{netloc}"
        options["allow_http"] = parts.scheme == "http"
        options["bucket"] = path.pop(0)
        if parts.username is not None:
            options["access_key_id"] = unquote(parts.username)
            options["secret_access_key"] = unquote(parts.password or "")
    else:
        raise ConfigError(f"s3 url {shown!r}: use s3://bucket/prefix or http(s)://host:port/bucket/prefix")
    if path:
        options["prefix"] = "/".join(path)
    options.update(overrides)
    return options


def inspect_prefix(
    options: S3TierOptions,
    *,
    namespace: str | None = None,
    verify: bool = False,
    sample: int | None = None,
    remove_corrupt: bool = False,
    seed: int | None = None,
) -> RootReport:
    """Summarize the kvtier objects under ``options.prefix`` (see the module docstring).

    ``verify`` reads every block; ``sample`` reads that many random blocks per
    namespace instead. ``namespace`` keeps only digests starting with it.
    """
    store = open_store(options)
    root = f"s3://{options.bucket}/{options.prefix}"
    groups: dict[str, dict[str, int]] = defaultdict(dict)
    unlisted: list[str] = []
    missed: list[str] = []
    try:
        for batch in list_objects(store, options.prefix + "/", unlisted, shards_at=1, missed=missed):
            for meta in batch:
                rest = meta["path"][len(options.prefix) + 1 :]
                groups[rest.split("/", 1)[0]][meta["path"]] = int(meta["size"])
    except Exception as exc:
        raise ConfigError(f"cannot list {root}: {short_error(exc)}") from None
    for name in unlisted:  # another application's object: foreign, reported, never touched
        rest = name[len(options.prefix) + 1 :] if name.startswith(options.prefix + "/") else name
        groups[rest.split("/", 1)[0]].setdefault(name, -1)
    reports = []
    foreign: list[str] = []  # outside any namespace (another application's, a folder marker): listed, not failed
    rng = random.Random(seed)
    for digest in sorted(groups):
        if namespace is not None and not digest.startswith(namespace):
            continue
        if not _NAMESPACE_RE.match(digest):
            foreign += groups[digest]
            continue
        objects = list(groups[digest].items())
        reports.append(_namespace_report(store, options, digest, objects, verify, sample, remove_corrupt, rng))
    for folder in missed:  # never an empty store or a missing manifest: the report says what was not listed
        path = folder.split(" (", 1)[0]  # ("<folder>/ (listing stopped at ...)": see list_objects)
        first = path[len(options.prefix) + 1 :].split("/", 1)[0] if path.startswith(options.prefix + "/") else ""
        if first and not _NAMESPACE_RE.match(first):  # in a foreign folder: nothing of kvtier's is hidden there
            if namespace is None:
                foreign.append(folder)
            continue
        reports.append(NamespaceReport(
            digest=folder, path=f"s3://{options.bucket}/{folder}", manifest=None,
            manifest_error=f"not listed: {folder} (a foreign name the S3 client cannot parse is in the way)",
            entries=0, bytes=0, verified=0, corrupt=[], removed_corrupt=0, foreign_files=[],
            temp_files_live=0, temp_files_stale=0,
        ))  # fmt: skip
    return RootReport(root, reports, foreign_entries=foreign)


def _namespace_report(
    store: Any,
    options: S3TierOptions,
    digest: str,
    objects: list[tuple[str, int]],
    verify: bool,
    sample: int | None,
    remove_corrupt: bool,
    rng: random.Random,
) -> NamespaceReport:
    ns_prefix = f"{options.prefix}/{digest}"
    report = NamespaceReport(
        digest=digest, path=f"s3://{options.bucket}/{ns_prefix}", manifest=None, manifest_error=None,
        entries=0, bytes=0, verified=0, corrupt=[], removed_corrupt=0, foreign_files=[],
        temp_files_live=0, temp_files_stale=0,
    )  # fmt: skip
    blocks: list[tuple[str, bytes, int]] = []
    for path, size in objects:
        key = key_of_path(ns_prefix, path)
        if path == f"{ns_prefix}/{MANIFEST}":
            report.manifest, report.manifest_error = _read_manifest(store, path, size, digest)
        elif key is None:
            report.foreign_files.append(path)
        else:
            blocks.append((path, key, size))
            report.entries += 1
            report.bytes += size
    if report.manifest is None and report.manifest_error is None:
        report.manifest_error = "no manifest"
    # Only a manifest that passed every check sizes the blocks and allows removal.
    block_bytes = report.manifest.get("block_bytes") if report.manifest and report.manifest_error is None else None
    chosen = blocks if verify else (rng.sample(blocks, min(sample, len(blocks))) if sample else [])
    disagreeing: list[int] = []  # sizes of self-verifying blocks the manifest's block_bytes does not fit
    for path, key, listed in chosen:
        if listed > MAX_OBJECT_BYTES:  # not fetched at all: it could be any size
            report.unreadable.append(CorruptEntry(path, _too_large(f"listed at {listed} bytes")))
            continue
        reason, proven, judged = _check_block(store, path, key, bytes.fromhex(digest), block_bytes)
        if reason is None:
            report.verified += 1
            continue
        if judged is None:  # the read failed: nothing was checked
            report.unreadable.append(CorruptEntry(path, reason))
            continue
        report.verified += 1
        if not proven:  # another release's value, or a self-verifying block of a suspect manifest
            report.kept.append(CorruptEntry(path, reason))
            if reason.endswith(_SUSPECT_MANIFEST):
                disagreeing.append(int(judged["size"]) - HEADER_SIZE)
            continue
        if block_bytes is None:
            reason, proven = f"{reason} (kept: the namespace has no usable manifest)", False
        report.corrupt.append(CorruptEntry(path, reason))
        if remove_corrupt and proven:
            kept = _delete_if_unchanged(store, path, judged)
            if kept is None:
                report.removed_corrupt += 1
            else:
                report.corrupt[-1].reason += f" ({kept})"
    if disagreeing:
        sizes = " or ".join(str(n) for n in sorted(set(disagreeing)))
        report.manifest_error = (
            f"manifest block_bytes={block_bytes} disagrees with {len(disagreeing)} self-verifying "
            f"block(s) of {sizes} bytes: engines refuse this namespace (correct the manifest, or delete it: "
            "the next engine writes it anew)"
        )
    return report


def _read_manifest(store: Any, path: str, size: int, digest: str) -> tuple[dict[str, Any] | None, str | None]:
    import obstore as obs

    if size > MAX_MANIFEST_BYTES:
        return None, f"manifest is {size} bytes"
    try:  # bounded by the GET, not the listing: it may have been re-stored larger since
        body = bounded_body(obs.get(store, path), MAX_MANIFEST_BYTES)
    except Exception as exc:
        return None, f"manifest not read: {short_error(exc)}"
    if isinstance(body, str):
        return None, f"manifest too large, not read on: {body}, more than a manifest holds ({MAX_MANIFEST_BYTES})"
    try:
        manifest = parse_manifest(bytes(body))
    except ValueError as exc:
        return None, f"manifest unreadable: {exc}"
    if manifest.get("namespace_digest") != digest:
        return manifest, f"manifest names namespace {manifest.get('namespace_digest')!r}"
    layout, header_bytes, block_bytes = (manifest.get(k) for k in ("kvtier_s3_layout", "header_bytes", "block_bytes"))
    if layout != LAYOUT_VERSION:
        return manifest, f"manifest is of layout {layout!r}, this release reads {LAYOUT_VERSION}: another release's"
    if header_bytes != HEADER_SIZE:
        return manifest, f"manifest says header_bytes={header_bytes!r}, this release reads {HEADER_SIZE}"
    value_format = manifest.get("value_format_version")
    # As the tier judges it: its own format (compared as JSON values are), or an older one it reads.
    if value_format != FORMAT_VERSION and not older_readable_format(value_format):
        return manifest, (f"manifest says value_format_version={value_format!r}, this release writes "
                          f"{FORMAT_VERSION}: another release's namespace, its engines refuse it")  # fmt: skip
    if not isinstance(block_bytes, int) or isinstance(block_bytes, bool) or block_bytes <= 0:
        return manifest, f"manifest has no usable block_bytes (got {block_bytes!r})"
    return manifest, None


def _check_block(
    store: Any, path: str, key: bytes, namespace: bytes, block_bytes: int | None
) -> tuple[str | None, bool, Any]:
    """``(None, False, meta)`` if the object holds a valid value for ``key``; else why not, whether
    that proves it corrupt, and the metadata of the object read (None if the read failed, or
    stopped at :data:`MAX_OBJECT_BYTES`).

    Everything is judged from one GET of the whole object, never from the listing (an engine may
    have re-stored the object since), as it streams (:func:`_stream_block`: memory of one chunk,
    whatever its size). A failed read or another release's format proves nothing;
    nor does a size that disagrees with the manifest when the object's own header (magic, version,
    namespace, key, payload length) and checksum verify: the manifest is then the suspect (kept).
    """
    import obstore as obs

    expected = None if block_bytes is None else HEADER_SIZE + block_bytes
    try:
        result = obs.get(store, path)
        meta = result.meta
        streamed = _stream_block(result, MAX_OBJECT_BYTES)
    except Exception as exc:
        return f"unreadable: {short_error(exc)} (kept: a failed read proves nothing)", False, None
    if isinstance(streamed, str):
        return _too_large(streamed), False, None
    head, size, digest = streamed
    version = foreign_format(head[:PREFIX_SIZE])
    if version is not None:
        return f"value format version {version}: another release's (kept: not proven corrupt)", False, meta
    try:
        header = decode_header(head, namespace=namespace, key=key)  # its own header
        verify_digest(header, size - HEADER_SIZE, digest)
    except ForeignFormatError as exc:
        return f"{exc} (kept: not proven corrupt)", False, meta
    except CorruptValueError as exc:
        if expected is not None and size != expected:
            return f"size {size}, expected {expected}: {exc}", True, meta
        return str(exc), True, meta
    if expected is not None and size != expected:
        return (
            f"size {size}, the manifest's block_bytes says {expected}, but its own header and checksum "
            f"verify {_SUSPECT_MANIFEST}"
        ), False, meta
    return None, False, meta


def _stream_block(result: Any, limit: int) -> tuple[bytes, int, int] | str:
    """``(first HEADER_SIZE bytes, size, xxh3 of the bytes after them)`` of the body of a GET
    ``result``, taken chunk by chunk: memory of one chunk, never the body (a shared bucket may hold
    an object of GiB under a block's name). Or, reading no further, what showed the object larger
    than ``limit``: the size the GET answered, or its body running past it (as :func:`bounded_body`)."""
    size = int(result.meta["size"])
    if size > limit:
        return f"the GET answered {size} bytes"
    head = bytearray()
    hasher = payload_hasher()
    filled = 0
    for chunk in result.stream(min_chunk_size=min(STREAM_CHUNK, limit)):
        view = memoryview(chunk).cast("B")
        n = view.nbytes
        if filled + n > limit:
            return f"its body ran past {limit} bytes (the GET said {size})"
        take = min(n, HEADER_SIZE - len(head))
        if take > 0:
            head += view[:take]
        if n > take:
            hasher.update(view[take:])
        filled += n
    return bytes(head), filled, int(hasher.intdigest())


def _too_large(seen: str) -> str:
    return (f"not read: {seen}, more than the largest object kvtier writes ({MAX_OBJECT_BYTES} bytes) "
            "(kept: not proven corrupt)")  # fmt: skip


def _delete_if_unchanged(store: Any, path: str, judged: Any) -> str | None:
    """Delete ``path`` only if it is still the object judged (same ETag, size and version as the
    GET that judged it): None when deleted, else why it was kept. S3 has no delete-if-unchanged
    that obstore can send, so a HEAD just before the DELETE stands in for one; an object re-stored
    between that HEAD and the DELETE (one request apart) is still lost, and a live engine then
    misses once and stores the block again."""
    import obstore as obs

    try:
        now = obs.head(store, path)
    except FileNotFoundError:
        return "gone before the delete"
    except Exception as exc:
        return f"kept: not re-checked before the delete ({short_error(exc)})"
    fields = ("e_tag", "size", "version") if judged.get("e_tag") else ("size", "version", "last_modified")
    if any(now.get(f) != judged.get(f) for f in fields):
        return "kept: changed since it was read (re-stored by an engine?)"
    try:
        obs.delete(store, path)
    except Exception as exc:
        return f"delete failed: {short_error(exc)}"
    return None


__all__ = ["inspect_prefix", "options_from_url"]
