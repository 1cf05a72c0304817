"""MkDocs hook: the API reference shows Sphinx cross-reference roles as plain code.

kvtier's docstrings use Sphinx roles (``:class:`~kvtier.telemetry.ManagerSnapshot```), which
mkdocstrings renders as the role's name followed by the code. This hook, run by ``mkdocs build``
(``hooks:`` in mkdocs.yml), drops the role and, for a ``~`` target, the module path, as Sphinx
would show them.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|exc|obj|const):<code>(~?)([^<]+)</code>")


def _plain(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    if "&lt;" in target:  # an explicit title: `Title <target>`
        return f"<code>{target.split('&lt;', 1)[0].strip()}</code>"
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def on_page_content(html: str, **_: Any) -> str:
    return _ROLE.sub(_plain, html)
