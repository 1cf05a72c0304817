"""The docs site builds strictly, every page is in the nav, and what the pages state is what the code does.

Command blocks marked runnable in the pages (an HTML comment ``<!-- runnable -->`` or
``<!-- runnable: output -->`` right before a fenced block) run in ``test_readme.py``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
MKDOCS_YML = REPO / "mkdocs.yml"

needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None,
    reason="mkdocs is not installed: pip install -e '.[docs]' (CI's .ci/run installs it, so this runs there)",
)


def _nav_pages(entries: Any) -> list[str]:
    """Every page file named in a mkdocs ``nav`` (nested sections included)."""
    pages: list[str] = []
    for entry in entries if isinstance(entries, list) else [entries]:
        if isinstance(entry, str):
            pages.append(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                pages.extend(_nav_pages(value) if isinstance(value, (list, dict)) else [value])
    return pages


def _mkdocs_config() -> dict[str, Any]:
    config = yaml.safe_load(MKDOCS_YML.read_text())
    assert isinstance(config, dict)
    return config


def _site_pages() -> set[str]:
    """Markdown files the site is built from (``exclude_docs`` patterns left out)."""
    excluded = [p.strip().strip("/") for p in str(_mkdocs_config().get("exclude_docs", "")).splitlines() if p.strip()]
    pages = set()
    for path in DOCS.rglob("*.md"):
        rel = path.relative_to(DOCS).as_posix()
        if not any(rel == e or rel.startswith(e + "/") for e in excluded):
            pages.add(rel)
    return pages


def test_every_page_is_reachable_from_the_nav_and_every_nav_entry_exists() -> None:
    nav = _nav_pages(_mkdocs_config()["nav"])
    assert len(nav) == len(set(nav)), f"pages listed twice in the nav: {sorted(p for p in nav if nav.count(p) > 1)}"
    pages = _site_pages()
    assert pages - set(nav) == set(), "pages outside the nav (orphans)"
    assert set(nav) - pages == set(), "nav entries without a page"
    assert nav[0] == "index.md", "the first page of the nav is the home page"


def _build(docs_dir: Path, config_file: Path, site_dir: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config_file),
           "--site-dir", str(site_dir)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=config_file.parent,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})  # fmt: skip


@needs_mkdocs
def test_mkdocs_build_strict_passes_and_renders_the_api_reference(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = _build(DOCS, MKDOCS_YML, site)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    for page in _nav_pages(_mkdocs_config()["nav"]):
        built = site / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert built.is_file(), f"{page} was not built"
    api = (site / "api" / "index.html").read_text()
    # mkdocstrings rendered the docstrings, not just the headings
    assert "lookup_prefix" in api and "Reserve CPU rows for a device" in api
    raw_role = re.search(r":(class|meth|func|attr|mod|exc):<code>", api)
    assert not raw_role, "a Sphinx role shown raw (hooks/sphinx_roles.py)"
    assert (site / "grafana-kvtier.json").is_file(), "the Grafana dashboard is published with the site"


@needs_mkdocs
@pytest.mark.slow
def test_mkdocs_strict_fails_on_an_orphan_page_and_a_broken_link(tmp_path: Path) -> None:
    """The checks above can fail: a copy of the site with one orphan page and one dead link is refused."""
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(MKDOCS_YML, tmp_path / "mkdocs.yml")
    shutil.copytree(REPO / "src", tmp_path / "src")  # mkdocstrings reads the package from paths: [src]
    shutil.copytree(REPO / "hooks", tmp_path / "hooks")
    (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n")
    tiers = tmp_path / "docs" / "tiers.md"
    tiers.write_text(tiers.read_text() + "\nSee [nowhere](no-such-page.md).\n")
    done = _build(tmp_path / "docs", tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "orphan.md" in done.stderr and "no-such-page.md" in done.stderr, done.stderr


# -- what the pages state is what the code does -------------------------------------------------------


def _exported_metrics() -> dict[str, set[str]]:
    """Family name -> the label values of direction/result/state seen, from a real exporter."""
    from kvtier import KVGeometry, Namespace, RequestContext, TieringManager
    from kvtier.metrics import KvtierMetrics

    ns = Namespace("docs-metrics", KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, tokens_per_block=16))
    with tempfile.TemporaryDirectory() as tmp:
        mgr = TieringManager.create(namespace=ns, num_cpu_blocks=8, shm_dir=tmp,
                                    tiers=[{"type": "fs", "root": f"{tmp}/fs", "max_bytes": 1 << 24,
                                            "admission": "learned"}])  # fmt: skip
        try:
            for i in range(4):  # cascades the fs tier completes: its store latency average gets measured
                keys = [bytes([i + 1]) * 32]
                mgr.prepare_store(keys)
                mgr.complete_store(keys)
                mgr.on_schedule_end()
            deadline = time.monotonic() + 30
            while mgr.jobs_in_flight() and time.monotonic() < deadline:
                time.sleep(0.01)
                mgr.on_schedule_end()
            mgr.request_control(RequestContext("docs-bad-params", params={"kvtier_load_tiers": "nonsense"}))
            metrics = KvtierMetrics()
            metrics.update(mgr, transfer={"device_to_cpu": (1, 0.1), "cpu_to_device": (2, 0.2)})
            text = metrics.render().decode()
        finally:
            mgr.shutdown()
    families: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = re.sub(r"_(bucket|count|sum|created)$", "", line.split("{")[0].split(" ")[0])
            values = re.findall(r'direction="([^"]*)"', line)
            families.setdefault(name, set()).update(values)
    return families


def _table_after(text: str, header_start: str) -> list[str]:
    start = text.index(header_start)
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_operations_metrics_table_matches_what_the_exporter_serves() -> None:
    """Regression: the table said direction write/read for device copies, exported as device_to_cpu/cpu_to_device."""
    rows = _table_after((DOCS / "operations.md").read_text(), "| metric (prefix `kvtier_`)")
    documented: dict[str, str] = {}
    for row in rows:
        names_cell = row.split("|")[1]
        for name in re.findall(r"`([a-z_]+)`", names_cell):
            documented["kvtier_" + name] = row
    exported = _exported_metrics()
    assert set(documented) == set(exported), set(documented) ^ set(exported)
    for name, directions in exported.items():
        for direction in directions:
            assert re.search(rf'[`"]{direction}[`"]', documented[name]), (
                f"{name}: direction {direction!r} not in its row"
            )


def test_store_dropped_is_documented_as_what_it_counts(tmp_path: Path) -> None:
    """Regression (review, 2026-12-03): the troubleshooting table said ``store_dropped`` grows while a
    breaker is open; it also counts stores shed at a full write queue, with the breaker closed."""
    from kvtier import KVGeometry, Namespace, TieringManager

    ns = Namespace("docs-shed", KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, tokens_per_block=16))
    mgr = TieringManager.create(namespace=ns, num_cpu_blocks=256, shm_dir=tmp_path,
                                tiers=[{"type": "memory", "max_queued_stores": 1}])  # fmt: skip
    try:
        for request in range(8):
            keys = [bytes([request + 1, i + 1]) * 16 for i in range(16)]
            mgr.prepare_store(keys)
            mgr.complete_store(keys)
            mgr.on_schedule_end()
        tier = mgr.stats().tier("1:memory")
    finally:
        mgr.shutdown()
    assert tier.health == "closed" and tier.failures["store_dropped"] > 0, (tier.health, tier.failures)
    assert tier.failures["cascade_job_failed"] > 0  # the shed jobs are reported failed too
    operations = (DOCS / "operations.md").read_text()
    row = next(line for line in operations.splitlines() if line.startswith('| `failures_total{kind="store_dropped"}`'))
    assert "breaker was open" in row and "max_queued_stores" in row and "cascade_job_failed" in row, row
    metrics_row = _table_after(operations, "| metric (prefix `kvtier_`)")
    failures = next(line for line in metrics_row if line.startswith("| `failures_total`"))
    assert "max_queued_stores" in failures and "out of service" in failures, failures


def _vllm_metric_names() -> dict[str, str]:
    """``vllm:kvtier_*`` family names the vLLM reporter declares -> kind, read from its source (no vLLM needed)."""
    tree = ast.parse((REPO / "src" / "kvtier" / "integrations" / "vllm" / "stats.py").read_text())
    kinds = {"_COUNTERS": "counter", "_GAUGES": "gauge", "_HISTOGRAMS": "histogram"}
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in kinds:
            assert isinstance(node.value, ast.Dict)
            for key in node.value.keys:
                assert isinstance(key, ast.Constant)
                names["vllm:kvtier_" + key.value] = kinds[node.target.id]
    assert len(names) > 10
    return names


def test_vllm_metrics_table_names_every_series_the_reporter_declares() -> None:
    rows = _table_after((DOCS / "vllm.md").read_text(), "| metric | labels | meaning |")
    documented = set()
    for row in rows:
        for name in re.findall(r"`(vllm:kvtier_[a-z_{},]+)`", row.split("|")[1]):
            brace = re.search(r"\{([a-z_,]+)\}", name)
            options = brace.group(1).split(",") if brace else [""]
            documented.update(re.sub(r"\{[a-z_,]+\}", o, name) for o in options)
    declared = _vllm_metric_names()
    expected = {n + "_total" if kind == "counter" else n for n, kind in declared.items()}
    assert documented == expected, documented ^ expected


def test_families_vllm_does_not_serve_are_named_as_kvtiers_exporters_only() -> None:
    """Regression (review, 2026-12-03): the docs said vLLM's /metrics has "the same figures", but the
    admission and policy families are not declared by the vLLM reporter."""
    text = " ".join((DOCS / "operations.md").read_text().split())
    only = text[text.index("Only in kvtier's exporter:") :].split(". ")[0]
    in_vllm = {"kvtier_" + re.sub(r"^vllm:kvtier_", "", name) for name in _vllm_metric_names()}
    in_vllm |= {name.replace("kvtier_lookup", "kvtier_tier_lookup") for name in in_vllm}
    absent = {re.sub(r"_total$", "", name) for name in _exported_metrics()} - in_vllm
    assert absent, "every family is under vLLM too: drop the sentence"
    for name in sorted(absent):
        short = name.removeprefix("kvtier_")
        prefix = short.split("_")[0]
        assert f"`{short}`" in only or f"`{prefix}_*`" in only, f"{name} is not named as exporter-only: {only}"


def test_the_masks_of_secrets_are_the_ones_config_show_prints() -> None:
    """Regression (review, 2026-12-03): the S3 keys are shown as ``**********`` (pydantic's SecretStr),
    the docs said ``***`` for every secret."""
    tiers = json.dumps([{"type": "s3", "bucket": "bkt", "endpoint": "http://127.0.0.1:9", "allow_http": True,
                         "access_key_id": "AKIAEXAMPLE", "secret_access_key": "sekrit"},
                        {"type": "redis", "url": "redis://user:hunter2@127.0.0.1:9"}])  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "config", "show", "--tiers", tiers],
                         capture_output=True, text=True, timeout=60, check=False, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "AKIAEXAMPLE" not in out.stdout and "sekrit" not in out.stdout and "hunter2" not in out.stdout
    assert '"secret_access_key": "**********"' in out.stdout and "user:***@" in out.stdout, out.stdout
    text = " ".join((DOCS / "operations.md").read_text().split())
    assert "show `***` (the S3 keys `**********`)" in text


def test_grafana_dashboard_queries_only_series_vllm_exports() -> None:
    dashboard = json.loads((DOCS / "grafana-kvtier.json").read_text())
    declared = _vllm_metric_names()
    exported = set()
    for name, kind in declared.items():
        exported |= {name + "_total"} if kind == "counter" else {name + s for s in ("_bucket", "_sum", "_count")}
        exported |= {name} if kind == "gauge" else set()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    used = {m for e in exprs for m in re.findall(r"vllm:kvtier_[a-z_]+", e)}
    assert used, "the dashboard queries nothing"
    assert used <= exported, f"series vLLM does not export: {sorted(used - exported)}"
    covered = {re.sub(r"_(total|bucket|sum|count)$", "", m) for m in used}
    missing = {n for n in declared if n not in covered and "extra" not in n}
    assert not missing, f"series without a panel: {sorted(missing)}"


def test_grafana_dashboard_converted_as_documented_queries_only_series_kvtiers_exporter_serves() -> None:
    """Regression (review, 2026-12-03): the two documented substitutions left the async-lookup panels on
    ``kvtier_lookup_async_seconds``, which kvtier's exporter does not serve (it is ``kvtier_tier_lookup_...``)."""
    text = " ".join((DOCS / "operations.md").read_text().split())
    sentence = text[text.index("For kvtier's own exporter (") :].split(" in the queries.")[0]
    substitutions = re.findall(r"`([^`]+)` by `([^`]+)`", sentence)
    assert ("vllm:kvtier_", "kvtier_") in substitutions, sentence
    dashboard = json.loads((DOCS / "grafana-kvtier.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    for old, new in substitutions:
        exprs = [e.replace(old, new) for e in exprs]
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"\bkvtier_[a-z_]+", e)}
    assert used, "the dashboard queries nothing"
    missing = used - set(_exported_metrics())
    assert not missing, f"series kvtier's exporter does not serve: {sorted(missing)}"
    # kvtier's exporter has no model_name label: the variable lists nothing and must match every series.
    model = next(v for v in dashboard["templating"]["list"] if v["name"] == "model_name")
    assert model["includeAll"] and model["allValue"] == ".*"


def test_every_class_and_function_in_the_api_reference_has_its_own_docstring() -> None:
    """Regression (review, 2026-12-03): ``::: kvtier.policies.EvictionPolicy`` rendered a class
    without a description (the class to subclass for ``policy: package.module:Class``)."""
    import importlib
    import inspect

    names = re.findall(r"^::: ([\w.]+)", (DOCS / "api.md").read_text(), re.M)
    assert "kvtier.policies.EvictionPolicy" in names
    bare = []
    for name in names:
        module, _, attr = name.rpartition(".")
        try:
            obj: Any = importlib.import_module(name)
        except ImportError:
            obj = getattr(importlib.import_module(module), attr)
        doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
        if not (doc or "").strip():
            bare.append(name)
    assert not bare, f"no docstring of their own: {bare}"


def test_architecture_page_lists_the_layers_contract_of_pyproject() -> None:
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["type"] == "layers")
    text = (DOCS / "architecture.md").read_text()
    assert "```text\n" + "\n".join(layers) + "\n```" in text


def test_policy_description_names_every_built_in_policy() -> None:
    """Regression: docs/configuration.md and --policy's help left out return-time, the default."""
    from kvtier.config import KvtierConfig
    from kvtier.policies import POLICIES

    description = KvtierConfig.model_fields["policy"].description or ""
    assert all(f"'{name}'" in description for name in POLICIES), description
    reference = (DOCS / "configuration.md").read_text()
    row = next(line for line in reference.splitlines() if line.startswith("| `policy` |"))
    assert all(f"'{name}'" in row for name in POLICIES), row


def test_config_show_help_points_at_nothing_below() -> None:
    """Regression: --tiers' help referred to 'the tier sections below', which only the reference has."""
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", "config", "show", "--help"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    help_text = " ".join(done.stdout.split())
    assert "--tiers" in help_text and "below)" not in help_text, help_text
    assert help_text.count("(see 'kvtier config reference')") >= 2  # --tiers and --backpressure


README = REPO / "README.md"


def _heading_anchors(page: Path) -> set[str]:
    """Anchors of a page's headings as MkDocs and GitHub write them (lower case, punctuation dropped)."""
    anchors = set()
    fenced = False
    for line in page.read_text().splitlines():
        fenced = fenced != line.startswith("```")
        if not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", title)))
    return anchors


def test_readme_is_a_short_front_page_whose_links_resolve() -> None:
    """Issue 24: the README is a front page of at most 200 lines, vLLM in its first screen, linking
    every docs page; every relative link lands on a file, and every anchor on a heading."""
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    first_screen = "\n".join(text.splitlines()[:40])
    assert "vllm serve" in first_screen and "KvtierOffloadingSpec" in first_screen
    links = re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", text)
    relative = [(path, anchor) for path, anchor in links if not re.match(r"[a-z]+:", path)]
    assert {path for path, _ in relative} >= {f"docs/{p}" for p in _nav_pages(_mkdocs_config()["nav"])}
    for path, anchor in relative:
        target = REPO / path if path else README
        assert target.is_file(), path
        if anchor:
            assert target.suffix == ".md" and anchor in _heading_anchors(target), f"{path}#{anchor}"


def test_vllm_page_lists_every_connector_key_the_integration_accepts() -> None:
    """'Every connector key': the table's keys are exactly what kv_connector_extra_config accepts."""
    from kvtier.integrations.vllm import config as vllm_config

    accepted = (vllm_config.VLLM_OWNED_KEYS | vllm_config.KVTIER_KEYS | vllm_config._INTEGRATION_KEYS
                | set(vllm_config._ALIASES))  # fmt: skip
    rows = _table_after((DOCS / "vllm.md").read_text(), "| key | meaning |")
    documented = {name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    assert documented == accepted, documented ^ accepted
