"""Throwaway TLS certificates for tests of TLS connections (Redis, S3): a module of its own,
with a name no other test folder uses, so any test module can import it whatever order pytest
collects the folders in (``conftest`` is one name in many folders)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def make_test_certificates(certs: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it: ``(ca.crt, server.crt, server.key)``.

    Skips the test when no ``openssl`` binary is installed.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not found on PATH; it is needed to make test certificates")
    certs.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = certs / "ca.key", certs / "ca.crt"
    key, csr, crt, ext = certs / "server.key", certs / "server.csr", certs / "server.crt", certs / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    for args in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca_crt),
         "-days", "2", "-subj", "/CN=kvtier-test-ca"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key), "-CAcreateserial",
         "-out", str(crt), "-days", "2", "-extfile", str(ext)],
    ):  # fmt: skip
        subprocess.run([openssl, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    return ca_crt, crt, key
