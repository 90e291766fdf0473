"""Study storage URLs as planner shows them: never with their password.

A PostgreSQL or MySQL URL may carry `user:password@`; planner writes the URL it used into
plan.json and the reports and names it in error lines, so every such place goes through `redact`.
"""

from __future__ import annotations

import re


def redact(url: str | None) -> str:
    """A storage URL fit to print or write: its password replaced by `***` (SQLAlchemy's own
    rendering). Pass the password by environment instead (`PGPASSWORD`, a `~/.pgpass`, MySQL's
    option files): a URL without one leaves nothing to hide."""
    if url is None:
        return "memory"
    if "://" not in url:
        return url  # a journal file path
    from sqlalchemy.engine import make_url

    try:
        shown = make_url(url).render_as_string(hide_password=True)
    except Exception:  # not parseable as a URL: hide whatever sits between user: and @
        shown = re.sub(r"(://[^/@:]*):[^/@]*@", r"\1:***@", url)
    return _QUERY_SECRET.sub(r"\1***", shown)  # libpq and MySQL also take ?password=


_QUERY_SECRET = re.compile(r"([?&](?:password|passwd|pwd)=)[^&]*", re.IGNORECASE)


def _passwords(url: str | None) -> list[str]:
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url) if url and "://" in url else None
    except Exception:
        return []
    if parsed is None:
        return []
    found = [parsed.password] if parsed.password else []
    for key, value in parsed.query.items():
        if key.lower() in ("password", "passwd", "pwd"):
            found += [value] if isinstance(value, str) else list(value)
    return [str(v) for v in found if v]


def scrubbed(exc: BaseException, url: str | None) -> str:
    """A storage error's first line, with the URL's password scrubbed from it should a driver echo it."""
    text = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
    for secret in _passwords(url):
        text = text.replace(secret, "***")
    return text
