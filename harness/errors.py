"""kvbench's own error type for the user's mistakes and capacity limits.

``UserError`` is raised for anything the person running kvbench can fix (a bad option, a
budget too small, a missing file); its message says what to change. The CLI prints it
without a traceback and exits 2. Everything else is a bug or an environment problem
(exit 1, traceback). It derives from ValueError so existing ``except ValueError`` callers
keep working while code moves over to it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(ValueError):
    """A mistake in the run's inputs (config, files, budget): the message says the fix."""


def interruptible(main: Callable[[], int], name: str) -> int:
    """``main()``'s exit status, or 130 with one line on stderr when Ctrl-C stops it (a
    KeyboardInterrupt's traceback is not an answer): what a command's ``__main__`` runs."""
    try:
        return main()
    except KeyboardInterrupt:
        print(f"{name}: interrupted (Ctrl-C); nothing more was written", file=sys.stderr)
        return 130
