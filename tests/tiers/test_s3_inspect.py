"""``kvtier inspect`` for an S3 prefix (kvtier.tiers.s3_inspect) against moto, and S3 URLs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from s3_servers import MotoServer, put_plain, raw_client, s3_options

from kvtier.errors import ConfigError
from kvtier.keys import KVGeometry, Namespace, chain_ids
from kvtier.testing import run_job
from kvtier.tiers.base import TierContext
from kvtier.tiers.format import HEADER_SIZE
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.s3_inspect import inspect_prefix, options_from_url
from kvtier.tiers.s3_store import S3TierOptions

pytestmark = pytest.mark.s3

BLOCK = 32 * 1024
REPO = Path(__file__).resolve().parents[2]
_SCRIPT = Path(sys.executable).parent / "kvtier"
KVTIER = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "kvtier.cli"]


def test_urls_become_options() -> None:
    assert options_from_url("s3://kv-cache/team/a") == {"bucket": "kv-cache", "prefix": "team/a"}
    assert options_from_url("s3://kv-cache") == {"bucket": "kv-cache"}
    assert options_from_url("http://key:se%2Fcret@127.0.0.1:9000/kv/p") == {
        "endpoint": "http://127.0.0.1:9000", "allow_http": True, "bucket": "kv", "prefix": "p",
        "access_key_id": "key", "secret_access_key": "se/cret",
    }  # fmt: skip
    assert options_from_url("https://minio:9000/kv", region="eu-1")["region"] == "eu-1"
    for bad in ("s3:///x", "http://127.0.0.1:9000", "ftp://host/bucket"):
        with pytest.raises(ConfigError, match="s3 url"):
            options_from_url(bad)


def _fill(server: MotoServer, bucket: str, model: str, n: int) -> tuple[S3Tier, list[bytes]]:
    ns = Namespace(model, KVGeometry.from_block_bytes(BLOCK))
    rows = np.random.default_rng(0).integers(0, 256, (n, BLOCK), dtype=np.uint8)
    opts = {k: v for k, v in s3_options(server.endpoint, bucket, max_in_flight=4).items() if k != "type"}
    tier = S3Tier(TierContext(rows, BLOCK, ns), **opts)
    keys = chain_ids(range(n), ns)
    assert run_job(tier, keys, list(range(n)), False, 30).success
    return tier, keys


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "AWS_"))}
    return subprocess.run([*KVTIER, *args], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)


def test_inspect_counts_verifies_and_removes_corrupt_objects(s3_bucket: tuple[MotoServer, str]) -> None:
    import obstore as obs

    server, bucket = s3_bucket
    tier_a, keys_a = _fill(server, bucket, "model-a", 4)
    tier_b, _ = _fill(server, bucket, "model-b", 2)
    options = S3TierOptions(**{k: v for k, v in s3_options(server.endpoint, bucket).items() if k != "type"})
    raw = raw_client(server.endpoint, bucket)
    victim = tier_a.object_path(keys_a[0])
    body = bytearray(obs.get(raw, victim).bytes())
    body[HEADER_SIZE + 5] ^= 0xFF
    obs.put(raw, victim, bytes(body))
    obs.put(raw, f"kvtier/{tier_a.context.namespace.hexdigest}/stray.txt", b"x")
    tier_a.shutdown()
    tier_b.shutdown()

    report = inspect_prefix(options)
    assert report.ok and report.entries == 6 and report.bytes == 6 * (HEADER_SIZE + BLOCK)
    by_model = {ns.manifest["namespace"]["model_id"]: ns for ns in report.namespaces if ns.manifest}
    assert set(by_model) == {"model-a", "model-b"} and by_model["model-a"].foreign_files

    sampled = inspect_prefix(options, sample=1, seed=1)
    assert sum(ns.verified for ns in sampled.namespaces) == 2

    url = f"http://testing:testing@127.0.0.1:{server.port}/{bucket}"
    out = _run("inspect", url, "--verify")
    assert out.returncode == 1, out.stderr
    assert "s3 tier s3://" in out.stdout and "corrupt:      1" in out.stdout and victim in out.stdout
    out = _run("inspect", url, "--verify", "--remove-corrupt", "--json")
    data = json.loads(out.stdout)
    assert out.returncode == 1 and data["corrupt"] == 1
    assert inspect_prefix(options, verify=True).ok and inspect_prefix(options).entries == 5
    out = _run("inspect", url, "--namespace", tier_b.context.namespace.hexdigest[:6])
    assert out.returncode == 0 and "blocks:       2" in out.stdout and "1 namespace(s)" in out.stdout


def test_inspect_of_an_unreachable_endpoint_is_a_clear_error(tmp_path: Path) -> None:
    out = _run("inspect", "http://k:s@127.0.0.1:9/nobucket", "--json")
    assert out.returncode == 2 and "cannot list s3://nobucket/kvtier" in out.stderr


def test_bench_with_an_s3_tier(s3_bucket: tuple[MotoServer, str], private_shm: Path) -> None:
    server, bucket = s3_bucket
    out = _run(
        "bench", "--sessions", "6", "--max-turns", "3", "--model", "tiny", "--cpu-bytes", "2MiB",
        "--device-blocks", "100", "--prefill-tokens-per-s", "0", "--no-progress", "--no-fs",
        "--shm-dir", str(private_shm), "--s3", f"http://testing:testing@127.0.0.1:{server.port}/{bucket}/bench",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr + out.stdout
    assert "s3 " in out.stdout and "cpu -> s3 (cascade)" in out.stdout
    report = inspect_prefix(
        S3TierOptions(**{k: v for k, v in s3_options(server.endpoint, bucket, prefix="bench").items() if k != "type"})
    )
    assert report.entries > 0


def _paths(raw: object) -> set[str]:
    import obstore as obs

    return {meta["path"] for batch in obs.list(raw, prefix="kvtier/") for meta in batch}  # type: ignore[arg-type]


def _rewrite(raw: object, path: str, edit: Any) -> None:
    import obstore as obs

    obs.put(raw, path, edit(bytearray(obs.get(raw, path).bytes())))  # type: ignore[arg-type]


def _flip_payload(body: bytearray) -> bytes:
    body[HEADER_SIZE + 5] ^= 0xFF
    return bytes(body)


def _version_3(extra: bytes) -> Any:
    def edit(body: bytearray) -> bytes:
        body[8:12] = (3).to_bytes(4, "little")
        return bytes(body) + extra

    return edit


def test_remove_corrupt_keeps_another_releases_values(s3_bucket: tuple[MotoServer, str]) -> None:
    """Review D1: kvtier's magic with a format version this release cannot read is another
    release's value, kept whatever its size; only the proven-corrupt object goes."""
    server, bucket = s3_bucket
    tier, keys = _fill(server, bucket, "model-a", 3)
    tier.shutdown()
    raw = raw_client(server.endpoint, bucket)
    same, longer, broken = (tier.object_path(k) for k in keys)
    _rewrite(raw, same, _version_3(b""))
    _rewrite(raw, longer, _version_3(b"\0" * 100))
    _rewrite(raw, broken, _flip_payload)
    options = S3TierOptions(**{k: v for k, v in s3_options(server.endpoint, bucket).items() if k != "type"})

    report = inspect_prefix(options, verify=True, remove_corrupt=True)
    (ns,) = report.namespaces
    kept = {c.path: c.reason for c in ns.kept}
    assert ns.removed_corrupt == 1 and [c.path for c in ns.corrupt] == [broken] and set(kept) == {same, longer}
    assert "another release's (kept" in kept[same] and "another release's (kept" in kept[longer]
    # review s3b #8: counted apart from the proven-corrupt one, in the report and the JSON
    assert report.corrupt == 1 and report.kept == 2 and report.to_dict()["kept"] == 2
    left = _paths(raw)
    assert same in left and longer in left and broken not in left


def test_remove_corrupt_keeps_objects_whose_read_failed(
    s3_bucket: tuple[MotoServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review D2: a GET answered 403 (no kms:Decrypt, an archived object) or 503 proves nothing:
    the object is listed as unreadable and kept."""
    import obstore as obs
    from obstore.exceptions import GenericError, PermissionDeniedError

    server, bucket = s3_bucket
    tier, keys = _fill(server, bucket, "model-a", 3)
    tier.shutdown()
    denied, throttled = tier.object_path(keys[0]), tier.object_path(keys[1])
    real_get = obs.get
    failures = {
        denied: PermissionDeniedError("Error performing GET: status code: 403 <Code>AccessDenied</Code>"),
        throttled: GenericError("Error performing GET: status code: 503 <Code>SlowDown</Code>"),
    }

    def failing_get(store: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        if path in failures:
            raise failures[path]
        return real_get(store, path, *args, **kwargs)

    monkeypatch.setattr(obs, "get", failing_get)
    options = S3TierOptions(**{k: v for k, v in s3_options(server.endpoint, bucket).items() if k != "type"})
    report = inspect_prefix(options, verify=True, remove_corrupt=True)
    (ns,) = report.namespaces
    assert ns.removed_corrupt == 0 and {c.path for c in ns.unreadable} == {denied, throttled}
    assert all("unreadable" in c.reason and "kept" in c.reason for c in ns.unreadable), ns.unreadable
    # review s3b #8: not counted as corrupt; the check is incomplete, so the report is not ok
    assert report.corrupt == 0 and report.unreadable == 2 and not report.ok and ns.verified == 1
    assert {denied, throttled} <= _paths(raw_client(server.endpoint, bucket))


@pytest.mark.parametrize("planted", ["layout", "digest", "header", "value_format", "value_format_bool"])
def test_remove_corrupt_never_trusts_an_unusable_manifest(s3_bucket: tuple[MotoServer, str], planted: str) -> None:
    """Review D3: a manifest of another layout, header size or namespace does not size the
    blocks; they are judged by their own header, and nothing in that namespace is removed.
    Regression (2026-12-04): a manifest of a value format this release cannot read, which the
    tier refuses, was reported usable."""
    server, bucket = s3_bucket
    tier, keys = _fill(server, bucket, "model-a", 3)
    tier.shutdown()
    raw = raw_client(server.endpoint, bucket)
    manifest_path = f"kvtier/{tier.context.namespace.hexdigest}/manifest.json"
    changes = {
        "layout": {"kvtier_s3_layout": 2, "header_bytes": 256},
        "digest": {"namespace_digest": "0" * 32, "block_bytes": 1234},
        "header": {"header_bytes": 256},
        "value_format": {"value_format_version": 3},
        "value_format_bool": {"value_format_version": True},
    }[planted]
    _rewrite(raw, manifest_path, lambda body: json.dumps({**json.loads(bytes(body)), **changes}).encode())
    broken = tier.object_path(keys[0])
    _rewrite(raw, broken, _flip_payload)
    options = S3TierOptions(**{k: v for k, v in s3_options(server.endpoint, bucket).items() if k != "type"})

    (ns,) = inspect_prefix(options, verify=True, remove_corrupt=True).namespaces
    assert ns.manifest_error is not None and ns.removed_corrupt == 0
    assert [c.path for c in ns.corrupt] == [broken] and "no usable manifest" in ns.corrupt[0].reason
    assert {tier.object_path(k) for k in keys} <= _paths(raw)


@pytest.mark.parametrize("value_format", [1, 2.0])
def test_inspect_takes_the_manifests_the_tier_takes(s3_bucket: tuple[MotoServer, str], value_format: Any) -> None:
    """Review (2026-12-04): inspect and the tier judged a manifest's value format apart (format 1,
    which the tier takes and rewrites; 2.0, which it takes as JSON compares it)."""
    server, bucket = s3_bucket
    tier, _ = _fill(server, bucket, "model-a", 2)
    tier.shutdown()
    raw = raw_client(server.endpoint, bucket)
    manifest_path = f"kvtier/{tier.context.namespace.hexdigest}/manifest.json"
    _rewrite(raw, manifest_path, lambda body: json.dumps(
        {**json.loads(bytes(body)), "value_format_version": value_format}).encode())  # fmt: skip
    options = S3TierOptions(**{k: v for k, v in s3_options(server.endpoint, bucket).items() if k != "type"})
    (ns,) = inspect_prefix(options, verify=True).namespaces
    assert ns.manifest_error is None and ns.verified == 2 and not ns.corrupt, ns.manifest_error
    again, _ = _fill(server, bucket, "model-a", 2)  # the tier serves the namespace too
    again.shutdown()


@pytest.mark.parametrize(
    "url",
    [
        "http://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY@127.0.0.1:9000/kv-cache",
        "http://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI?K7MDENG#bPxRfiCYEXAMPLEKEY@127.0.0.1:9000/kv-cache",
        "s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY@kv-cache/p",
    ],
)
def test_a_secret_with_a_slash_in_the_url_is_never_echoed(url: str) -> None:
    """Review S1: an unencoded '/', '?' or '#' in the secret split the URL before anything could
    redact it, and validation echoed the pieces; now it is refused naming the fix."""
    with pytest.raises(ConfigError) as raised:
        options_from_url(url)
    text = str(raised.value)
    assert not any(piece in text for piece in ("wJalrXUtnFEMI", "K7MDENG", "bPxRfiCYEXAMPLEKEY")), text
    assert "percent-encode" in text or "carries credentials" in text
    out = _run("inspect", url)
    assert out.returncode == 2 and "K7MDENG" not in out.stdout + out.stderr, out.stderr
    assert "wJalrXUtnFEMI" not in out.stdout + out.stderr and "bPxRfiCYEXAMPLEKEY" not in out.stdout + out.stderr


@pytest.mark.parametrize(
    "url",
    [
        "http:/AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY@127.0.0.1:9000/kv-cache",
        "http:AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY@127.0.0.1:9000/kv-cache",
        "HTTPS:/AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY@127.0.0.1:9000/kv-cache",
        # review s3c #3: a '://' later, inside the credentials, was taken for the scheme's
        "http:/AKIAIOSFODNN7EXAMPLE://wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY@127.0.0.1:9000/kv-cache/p",
        "http:/AKIAIOSFODNN7EXAMPLE:a://wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY@127.0.0.1:9000/kv-cache",
        " s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY@127.0.0.1:9000/kv-cache",
    ],
)
def test_a_url_missing_a_slash_of_its_scheme_never_echoes_the_credentials(url: str) -> None:
    """Review s3b #4: 'http:/key:secret@host/bkt' has no netloc, so the userinfo landed in the path
    and bench --s3 echoed it as bucket and prefix, and inspect as a directory that did not exist."""
    pieces = ("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI", "K7MDENG", "bPxRfiCYEXAMPLEKEY")
    with pytest.raises(ConfigError, match="no '://'") as raised:
        options_from_url(url)
    assert not any(piece in str(raised.value) for piece in pieces), raised.value
    for args in (["inspect", url], ["bench", "--s3", url, "--no-progress"]):
        out = _run(*args)
        shown = out.stdout + out.stderr
        assert out.returncode == 2 and "127.0.0.1:9000" in shown, shown
        assert not any(piece in shown for piece in pieces), shown


def test_inspect_reports_foreign_names_the_client_cannot_parse(s3_bucket: tuple[MotoServer, str]) -> None:
    """Review U4: one object named 'a//b', 'a/./b' or 'a/../b' under the prefix (another
    application's, in a shared bucket) made inspect exit 2 ("cannot list"), inspecting nothing."""
    server, bucket = s3_bucket
    tier, _ = _fill(server, bucket, "model-a", 3)
    tier.shutdown()
    ns_dir = f"kvtier/{tier.context.namespace.hexdigest}"
    planted = ["kvtier/x//y", f"{ns_dir}/x/./y", f"{ns_dir}/q/../z"]
    for name in planted:
        put_plain(server.endpoint, bucket, name)
    options = S3TierOptions(**{k: v for k, v in s3_options(server.endpoint, bucket).items() if k != "type"})
    report = inspect_prefix(options, verify=True, remove_corrupt=True)
    by_digest = {ns.digest: ns for ns in report.namespaces}
    ours = by_digest[tier.context.namespace.hexdigest]
    assert ours.entries == 3 and ours.verified == 3 and not ours.corrupt and ours.manifest_error is None
    foreign = {path for ns in report.namespaces for path in ns.foreign_files} | set(report.foreign_entries)
    assert all(any(name.startswith(shown) for shown in foreign) for name in planted), foreign  # or its folder
    url = f"http://testing:testing@127.0.0.1:{server.port}/{bucket}"
    out = _run("inspect", url, "--verify")
    # Every block was listed and verified: the foreign names are reported, not a failure (2026-12-05).
    assert out.returncode == 0 and "blocks:       3" in out.stdout, out.stdout + out.stderr
    assert "foreign entries: 1" in out.stdout and "foreign files: 2" in out.stdout, out.stdout


def test_a_consoles_folder_markers_and_foreign_folders_are_listed_not_failed(
    s3_bucket: tuple[MotoServer, str],
) -> None:
    """Regression (2026-12-05): the S3 console's "Create folder" puts a zero-byte 'kvtier/' object;
    it, and any other application's folder beside the namespaces ('kvtier/backups/...'), made a
    namespace report "not a kvtier namespace" and inspect exit 1 with every block fine (an fs
    root's foreign entries were always skipped). They are listed as foreign entries now, never
    touched; a namespace's own problems still fail it."""
    import obstore as obs

    server, bucket = s3_bucket
    tier, _ = _fill(server, bucket, "model-a", 3)
    tier.shutdown()
    planted = {"kvtier/": b"", "kvtier/backups/": b"", "kvtier/backups/2026.tar": b"x" * 100}
    raw = raw_client(server.endpoint, bucket)
    for name, body in planted.items():
        if name.endswith("/"):  # (a folder marker's name is one obstore will not write)
            put_plain(server.endpoint, bucket, name, body)
        else:
            obs.put(raw, name, body)
    options = S3TierOptions(**{k: v for k, v in s3_options(server.endpoint, bucket).items() if k != "type"})
    report = inspect_prefix(options, verify=True, remove_corrupt=True)
    assert report.ok and report.entries == 3 and [ns.digest for ns in report.namespaces] == [
        tier.context.namespace.hexdigest
    ]
    assert all(any(name.rstrip("/") == shown.rstrip("/") for shown in report.foreign_entries) for name in planted), (
        report.foreign_entries
    )
    assert report.to_dict()["foreign_entries"] == report.foreign_entries
    assert bytes(obs.get(raw, "kvtier/backups/2026.tar").bytes()) == b"x" * 100
    url = f"http://testing:testing@127.0.0.1:{server.port}/{bucket}"
    out = _run("inspect", url, "--verify", "--remove-corrupt")
    assert out.returncode == 0 and "foreign entries: 3 (outside any kvtier namespace: left alone)" in out.stdout, (
        out.stdout + out.stderr
    )
    only = inspect_prefix(options, namespace=tier.context.namespace.hexdigest[:4])
    assert only.ok and only.foreign_entries == []


def test_remove_corrupt_keeps_self_verifying_blocks_when_the_manifest_block_bytes_is_wrong(
    s3_bucket: tuple[MotoServer, str],
) -> None:
    """Review s3b #1: a manifest whose block_bytes alone is wrong (a flipped digit, a hand edit)
    condemned every block by size although each block's own header and checksum verify. Such
    blocks are kept and the manifest is named the suspect; a block that fails its own checks goes."""
    server, bucket = s3_bucket
    tier, keys = _fill(server, bucket, "model-a", 3)
    tier.shutdown()
    raw = raw_client(server.endpoint, bucket)
    manifest_path = f"kvtier/{tier.context.namespace.hexdigest}/manifest.json"
    wrong = {"block_bytes": BLOCK + 1000}
    _rewrite(raw, manifest_path, lambda body: json.dumps({**json.loads(bytes(body)), **wrong}).encode())
    broken = tier.object_path(keys[0])
    _rewrite(raw, broken, _flip_payload)
    options = S3TierOptions(**{k: v for k, v in s3_options(server.endpoint, bucket).items() if k != "type"})

    (ns,) = inspect_prefix(options, verify=True, remove_corrupt=True).namespaces
    reasons = {c.path: c.reason for c in ns.corrupt + ns.kept}
    assert ns.removed_corrupt == 1 and [c.path for c in ns.corrupt] == [broken] and "checksum" in reasons[broken]
    kept = {tier.object_path(k) for k in keys[1:]}
    assert kept == {c.path for c in ns.kept} and all("manifest is suspect" in reasons[p] for p in kept), reasons
    assert kept <= _paths(raw) and broken not in _paths(raw)


@pytest.mark.parametrize("truncate_to", [1000, 10])
def test_remove_corrupt_judges_the_object_read_not_the_listing(
    s3_bucket: tuple[MotoServer, str], monkeypatch: pytest.MonkeyPatch, truncate_to: int
) -> None:
    """Review s3b #2: a block torn when listed and re-stored valid by an engine before inspect read
    it was deleted on the listing's size (one listed under 16 bytes without being read at all)."""
    import obstore as obs

    server, bucket = s3_bucket
    tier, keys = _fill(server, bucket, "model-a", 3)
    tier.shutdown()
    raw = raw_client(server.endpoint, bucket)
    victim = tier.object_path(keys[0])
    valid = bytes(obs.get(raw, victim).bytes())
    obs.put(raw, victim, valid[:truncate_to])
    restored: list[str] = []

    def restore_first(real: Any) -> Any:
        def call(store: Any, path: str, *args: Any, **kwargs: Any) -> Any:
            if path == victim and not restored:
                restored.append(path)
                obs.put(raw, victim, valid)  # an engine re-stores the block after the listing
            return real(store, path, *args, **kwargs)

        return call

    monkeypatch.setattr(obs, "get", restore_first(obs.get))
    monkeypatch.setattr(obs, "get_range", restore_first(obs.get_range))
    options = S3TierOptions(**{k: v for k, v in s3_options(server.endpoint, bucket).items() if k != "type"})
    (ns,) = inspect_prefix(options, verify=True, remove_corrupt=True).namespaces
    assert ns.removed_corrupt == 0 and not ns.corrupt, ns.corrupt
    assert victim in _paths(raw) and bytes(obs.get(raw, victim).bytes()) == valid


def test_remove_corrupt_keeps_an_object_changed_between_its_read_and_the_delete(
    s3_bucket: tuple[MotoServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review s3b #2, the fs rule "only if the file is still the one that failed": an object
    re-stored after inspect read it corrupt is kept (a HEAD before the DELETE compares ETag and size)."""
    import obstore as obs

    server, bucket = s3_bucket
    tier, keys = _fill(server, bucket, "model-a", 2)
    tier.shutdown()
    raw = raw_client(server.endpoint, bucket)
    victim, other = tier.object_path(keys[0]), tier.object_path(keys[1])
    valid = bytes(obs.get(raw, victim).bytes())
    _rewrite(raw, victim, _flip_payload)
    _rewrite(raw, other, _flip_payload)
    real_delete = obs.delete

    def restore_then_delete(store: Any, paths: Any) -> None:
        if paths == victim:
            obs.put(raw, victim, valid)
        real_delete(store, paths)

    real_head = obs.head

    def restore_then_head(store: Any, path: str) -> Any:
        if path == victim:
            obs.put(raw, victim, valid)  # an engine re-stores the block after inspect read it
        return real_head(store, path)

    monkeypatch.setattr(obs, "head", restore_then_head)
    monkeypatch.setattr(obs, "delete", restore_then_delete)
    options = S3TierOptions(**{k: v for k, v in s3_options(server.endpoint, bucket).items() if k != "type"})
    (ns,) = inspect_prefix(options, verify=True, remove_corrupt=True).namespaces
    reasons = {c.path: c.reason for c in ns.corrupt}
    assert ns.removed_corrupt == 1 and "changed since it was read" in reasons[victim], reasons
    assert victim in _paths(raw) and bytes(obs.get(raw, victim).bytes()) == valid
    assert other not in _paths(raw)


@pytest.mark.parametrize("planted", ["kvtier//x", "kvtier/{ns}//x", "kvtier/{ns}/{shard}//x", "kvtier/./x"])
def test_an_unparseable_foreign_name_hides_nothing_beside_it(s3_bucket: tuple[MotoServer, str], planted: str) -> None:
    """Review s3b #5: a folder level that cannot be listed (a foreign 'kvtier//x') was given up
    whole: at the root every namespace vanished ("0 blocks"), in a namespace its manifest, in a
    shard that shard's blocks. The parseable names beside it are now listed."""
    server, bucket = s3_bucket
    tier, keys = _fill(server, bucket, "model-a", 6)
    tier.shutdown()
    digest = tier.context.namespace.hexdigest
    name = planted.format(ns=digest, shard=keys[0].hex()[:2])
    put_plain(server.endpoint, bucket, name)
    options = S3TierOptions(**{k: v for k, v in s3_options(server.endpoint, bucket).items() if k != "type"})
    report = inspect_prefix(options, verify=True)
    ours = {ns.digest: ns for ns in report.namespaces}[digest]
    assert ours.entries == 6 and ours.verified == 6 and ours.manifest_error is None and not ours.corrupt, ours
    foreign = {path for ns in report.namespaces for path in ns.foreign_files} | set(report.foreign_entries)
    assert any(name.startswith(shown) for shown in foreign), foreign


def test_a_listing_that_stops_is_reported_not_shown_as_empty(
    s3_bucket: tuple[MotoServer, str],
) -> None:
    """Review s3b #5: where the names past an unparseable folder cannot be listed either (a second
    one further on), inspect says which folder was not listed and exits non-zero."""
    server, bucket = s3_bucket
    tier, _ = _fill(server, bucket, "model-a", 3)
    tier.shutdown()
    digest = tier.context.namespace.hexdigest
    put_plain(server.endpoint, bucket, "kvtier//x")
    put_plain(server.endpoint, bucket, f"kvtier/{digest}/zz//y")
    options = S3TierOptions(**{k: v for k, v in s3_options(server.endpoint, bucket).items() if k != "type"})
    report = inspect_prefix(options, verify=True)
    assert not report.ok
    errors = [ns.manifest_error or "" for ns in report.namespaces]
    assert any("not listed: kvtier/" in e for e in errors), errors


def _inspect_with_get(
    server: MotoServer, bucket: str, monkeypatch: pytest.MonkeyPatch, answer: Any, **kwargs: Any
) -> tuple[Any, dict[str, int]]:
    """Inspect (``verify=True``, ``kwargs``) while each GET first calls ``answer(path)``, whose int
    replaces the size the GET answers (None: the real one); the result's body can only be streamed.
    Returns the report and how many body bytes were taken from each path."""
    import obstore as obs

    real_get = obs.get
    streamed: dict[str, int] = {}

    class Taken:  # a GET result whose body is counted as it is taken; never taken whole
        def __init__(self, path: str, result: Any, claimed: int | None) -> None:
            self.path, self.real = path, result
            self.meta = dict(result.meta, size=claimed if claimed is not None else result.meta["size"])

        def bytes(self) -> Any:
            raise AssertionError(f"{self.path} read whole")

        def stream(self, min_chunk_size: int = 1 << 20) -> Any:
            for chunk in self.real.stream(min_chunk_size=min(min_chunk_size, 4096)):
                for at in range(0, len(chunk), 4096):  # (obstore's chunks may be larger than asked)
                    piece = bytes(memoryview(chunk)[at : at + 4096])
                    streamed[self.path] = streamed.get(self.path, 0) + len(piece)
                    yield piece

    def get(store: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        claimed = answer(path)
        return Taken(path, real_get(store, path, *args, **kwargs), claimed)

    monkeypatch.setattr(obs, "get", get)
    options = S3TierOptions(**{k: v for k, v in s3_options(server.endpoint, bucket).items() if k != "type"})
    return inspect_prefix(options, verify=True, **kwargs), streamed


def test_objects_larger_than_any_block_kvtier_writes_are_never_read_whole(
    s3_bucket: tuple[MotoServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review harden #3: without a usable manifest, inspect read every listed object whole into
    memory whatever its size (a foreign object of many GiB in a shared bucket exhausts memory).
    One listed above the largest object kvtier writes is not fetched; one that grew past it after
    the listing, or whose body runs past it, is not read on; each is reported unreadable and kept
    (not proven corrupt), and the other blocks are still verified."""
    import obstore as obs

    import kvtier.tiers.s3_inspect as s3_inspect

    server, bucket = s3_bucket
    tier, keys = _fill(server, bucket, "model-a", 5)
    tier.shutdown()
    raw = raw_client(server.endpoint, bucket)
    obs.delete(raw, f"kvtier/{tier.context.namespace.hexdigest}/manifest.json")  # no usable manifest
    listed_big, grown, lying, *fine = (tier.object_path(k) for k in keys)
    bound = HEADER_SIZE + BLOCK  # a block of this namespace is exactly that large
    monkeypatch.setattr(s3_inspect, "MAX_OBJECT_BYTES", bound)
    huge = b"\0" * (4 * bound)
    obs.put(raw, listed_big, huge)
    got: list[str] = []

    def answer(path: str) -> int | None:
        got.append(path)
        if path == grown:
            obs.put(raw, grown, huge)  # re-stored after the listing, far larger
        if path == lying:
            obs.put(raw, lying, huge)
            return bound  # a server whose size says one thing and whose body another
        return None

    report, streamed = _inspect_with_get(server, bucket, monkeypatch, answer, remove_corrupt=True)
    (ns,) = report.namespaces
    unreadable = {c.path: c.reason for c in ns.unreadable}
    # before the fix: each of the three read whole (and judged corrupt, kept only for want of a manifest)
    assert set(unreadable) == {listed_big, grown, lying} and not ns.corrupt and not ns.kept, ns
    assert all("largest object kvtier writes" in r and "kept" in r for r in unreadable.values()), unreadable
    assert listed_big not in got and grown not in streamed  # never fetched; fetched, its body never taken
    assert bound < streamed[lying] <= bound + 4096  # the body was taken until past the bound, no further
    assert ns.verified == len(fine) and ns.removed_corrupt == 0 and not report.ok
    assert {listed_big, grown, lying, *fine} <= _paths(raw)


@pytest.mark.parametrize("lie", [False, True])
def test_a_manifest_re_stored_larger_after_the_listing_is_never_read_whole(
    s3_bucket: tuple[MotoServer, str], monkeypatch: pytest.MonkeyPatch, lie: bool
) -> None:
    """Review s3c #1: only the listed size of manifest.json was checked, then the GET's body was
    read whole: one replaced by a 300 MiB object after the listing grew inspect by 300 MiB. Now the
    size the GET answers is checked and the body is streamed no further than MAX_MANIFEST_BYTES
    (also when a server answers a small size and sends more); the manifest is reported too large."""
    import obstore as obs

    from kvtier.tiers.s3_store import MAX_MANIFEST_BYTES

    server, bucket = s3_bucket
    tier, _ = _fill(server, bucket, "model-a", 2)
    tier.shutdown()
    raw = raw_client(server.endpoint, bucket)
    manifest = f"kvtier/{tier.context.namespace.hexdigest}/manifest.json"
    big = b"{" * (8 * MAX_MANIFEST_BYTES)

    def answer(path: str) -> int | None:
        if path != manifest:
            return None
        obs.put(raw, manifest, big)  # re-stored after the listing, far larger
        return 100 if lie else None  # a server whose size says one thing and whose body another

    report, streamed = _inspect_with_get(server, bucket, monkeypatch, answer)
    (ns,) = report.namespaces
    assert ns.manifest_error is not None and "more than a manifest holds" in ns.manifest_error, ns.manifest_error
    assert ("ran past" if lie else "the GET answered") in ns.manifest_error
    assert streamed.get(manifest, 0) <= MAX_MANIFEST_BYTES + 4096, streamed
    assert ns.manifest is None and ns.verified == 2 and not ns.corrupt


def test_a_manifest_whose_block_bytes_self_verifying_blocks_contradict_fails_inspect(
    s3_bucket: tuple[MotoServer, str],
) -> None:
    """Review s3c #4: a manifest whose block_bytes disagrees with blocks whose own header and
    checksum verify (engines refuse the namespace) was reported as N blocks 'kept', no manifest
    problem, exit 0. Now the namespace's manifest error says so, and inspect exits 1."""
    server, bucket = s3_bucket
    tier, keys = _fill(server, bucket, "model-a", 3)
    tier.shutdown()
    raw = raw_client(server.endpoint, bucket)
    manifest_path = f"kvtier/{tier.context.namespace.hexdigest}/manifest.json"
    wrong = {"block_bytes": 2 * BLOCK}
    _rewrite(raw, manifest_path, lambda body: json.dumps({**json.loads(bytes(body)), **wrong}).encode())
    options = S3TierOptions(**{k: v for k, v in s3_options(server.endpoint, bucket).items() if k != "type"})

    report = inspect_prefix(options, verify=True)
    (ns,) = report.namespaces
    assert len(ns.kept) == 3 and not ns.corrupt and not report.ok
    assert ns.manifest_error == (
        f"manifest block_bytes={2 * BLOCK} disagrees with 3 self-verifying block(s) of {BLOCK} bytes: engines "
        "refuse this namespace (correct the manifest, or delete it: the next engine writes it anew)"
    )
    (sampled,) = inspect_prefix(options, sample=1, seed=0).namespaces
    assert sampled.manifest_error is not None and "1 self-verifying block(s)" in sampled.manifest_error
    out = _run("inspect", f"http://testing:testing@127.0.0.1:{server.port}/{bucket}/kvtier", "--verify")
    assert out.returncode == 1 and f"manifest block_bytes={2 * BLOCK} disagrees" in out.stdout, out.stdout + out.stderr
    assert {tier.object_path(k) for k in keys} <= _paths(raw)  # nothing deleted


def test_a_get_that_claims_a_huge_size_costs_only_the_bytes_it_sends(
    s3_bucket: tuple[MotoServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review s3c: a bounded read allocated (and zeroed) the size the GET answered before any
    byte came: a server or object that says 256 MiB (or 5 GiB, under the bound) and sends one
    block cost that much memory. Memory now follows the bytes received; the block is judged."""
    import tracemalloc

    server, bucket = s3_bucket
    tier, keys = _fill(server, bucket, "model-a", 2)
    tier.shutdown()
    lying = tier.object_path(keys[0])
    claimed = 256 << 20

    tracemalloc.start()
    try:
        report, streamed = _inspect_with_get(server, bucket, monkeypatch, lambda p: claimed if p == lying else None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"traced peak {peak} bytes"  # before the fix: over 256 MiB
    (ns,) = report.namespaces
    assert streamed[lying] == HEADER_SIZE + BLOCK and ns.verified == 2 and report.ok, ns


def test_verify_streams_each_block_and_never_holds_a_large_object_whole(s3_bucket: tuple[MotoServer, str]) -> None:
    """Audit (redis/s3, hostile store): --verify held each object it judged whole in memory, up
    to the 5 GiB a single PUT may write, so an object of GiB planted under a block's name in a
    shared bucket cost as much memory. Blocks are now judged as they stream (header kept, the rest
    hashed): memory of one chunk. The planted object is still proven corrupt and removed, a
    block with one flipped payload byte too, and the good block verifies."""
    import tracemalloc

    import obstore as obs

    server, bucket = s3_bucket
    tier, keys = _fill(server, bucket, "model-a", 3)
    tier.shutdown()
    raw = raw_client(server.endpoint, bucket)
    planted, flipped, good = (tier.object_path(k) for k in keys)
    obs.put(raw, planted, b"\x07" * (48 << 20), use_multipart=False)
    value = bytearray(obs.get(raw, flipped).bytes())
    value[HEADER_SIZE + 5] ^= 0xFF
    obs.put(raw, flipped, bytes(value), use_multipart=False)
    options = S3TierOptions(**{k: v for k, v in s3_options(server.endpoint, bucket).items() if k != "type"})

    tracemalloc.start()
    try:
        report = inspect_prefix(options, verify=True, remove_corrupt=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"traced peak {peak} bytes"  # before the fix: over 48 MiB
    (ns,) = report.namespaces
    reasons = {c.path: c.reason for c in ns.corrupt}
    assert set(reasons) == {planted, flipped} and ns.removed_corrupt == 2 and ns.verified == 3, ns
    assert reasons[planted].startswith(f"size {48 << 20}, expected {HEADER_SIZE + BLOCK}: bad magic"), reasons
    assert reasons[flipped] == "payload checksum mismatch", reasons
    assert _paths(raw) >= {good} and not _paths(raw) & {planted, flipped}
