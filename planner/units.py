"""Sizes as people read them, in one place: messages, reports and the board side (which must import
nothing heavy) print them alike."""


def kib(nbytes: float) -> str:
    """A size as messages and reports print it: `487.2 KiB`."""
    return f"{nbytes / 1024:,.1f} KiB"
