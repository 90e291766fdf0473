"""Study storage URLs as planner shows them: never with their password.

A PostgreSQL or MySQL URL may carry `user:password@`; planner writes the URL it used into
plan.json and the reports and names it in error lines, so every such place goes through `redact`.
"""

from __future__ import annotations

import re


def redact(url: str) -> str:
    """A storage URL fit to print or write: its password replaced by `***` (SQLAlchemy's own
    rendering). Pass the password by environment instead (`PGPASSWORD`, a `~/.pgpass`, MySQL's
    option files): a URL without one leaves nothing to hide."""
    if "://" not in url:
        return url  # a journal file path
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not parseable as a URL: hide whatever sits between user: and @
        return re.sub(r"(://[^/@:]*):[^/@]*@", r"\1:***@", url)


def _password(url: str) -> str | None:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).password if "://" in url else None
    except Exception:
        return None


def scrubbed(exc: BaseException, url: str) -> str:
    """A storage error's first line, with the URL's password scrubbed from it should a driver echo it."""
    text = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
    secret = _password(url)
    return text.replace(secret, "***") if secret else text
