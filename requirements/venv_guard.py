"""make's guard before its $(STAMP) rule touches $(VENV): a VENV= outside this checkout whose kvcert is installed
editable from another checkout that still exists is refused in one line, because `pip install -e .` from here would
re-point it at this checkout (and the rule's rebuild on a changed lock would delete it), breaking the other
checkout's `import kvcert` once this one is gone.

Refused rather than installed non-editable there: that would not break the other checkout's import, but it would
silently swap that checkout's code for this one's. Allowed: this checkout's own environment (any VENV inside it), an
environment without kvcert or with kvcert installed non-editable, one with kvcert installed editable from this
checkout, and one with kvcert installed editable from a folder that no longer exists (nothing depends on it).

Usage (the Makefile runs it with the base interpreter, stdlib only, `-I` so nothing from the tree is imported):
    python -I requirements/venv_guard.py VENV CHECKOUT     # exit 1 and one line on stderr when refused
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse


def editable_source(venv: Path) -> Path | None:
    """The folder kvcert is installed editable from in the environment `venv` (its direct_url.json, PEP 610), or
    None: kvcert not installed there, or installed from a wheel or an archive."""
    venv = Path(venv)
    for record in sorted(venv.glob("lib/python*/site-packages/kvcert-*.dist-info/direct_url.json")):
        try:
            info = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(info, dict):
            continue
        url, dir_info = str(info.get("url", "")), info.get("dir_info")
        if isinstance(dir_info, dict) and dir_info.get("editable") and url.startswith("file:"):
            return Path(unquote(urlparse(url).path))
    return None


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def refusal(venv: str | Path, checkout: str | Path) -> str | None:
    """The one-line error for make VENV=<venv> run in <checkout>, or None when the rule may go on."""
    checkout = Path(checkout).resolve()
    target = Path(venv).expanduser()
    target = (target if target.is_absolute() else checkout / target).resolve()
    if _inside(target, checkout):
        return None
    source = editable_source(target)
    if source is None or not source.exists() or source.resolve() == checkout:
        return None
    return (
        f"error: VENV={venv} has kvcert installed editable from {source}, another checkout; installing this one "
        f"({checkout}) there would break that checkout's `import kvcert`: run make in {source}, or give this "
        "checkout its own environment (make VENV=.venv, the default)"
    )


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -I requirements/venv_guard.py VENV CHECKOUT", file=sys.stderr)
        return 2
    message = refusal(*argv)
    if message:
        print(message, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
