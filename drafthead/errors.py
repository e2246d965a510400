"""Errors a user can fix (a bad recipe, path, data set or head) and how the command lines report them.

Each is also the built-in exception a caller would catch for it (ValueError, FileNotFoundError), so library code
can raise these without changing what its callers see. The command lines print a UserError as one line and exit
with status 2; any other exception is an internal error and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable


class UserError(Exception):
    """A problem with the user's input; the message names it and says how to fix it."""


class RecipeError(UserError, ValueError):
    """A recipe key or value that is not allowed."""


class PathNotFound(UserError, FileNotFoundError):
    """A file or folder the user named does not exist (or is not what it should be)."""


class DataError(UserError, ValueError):
    """Input data that cannot be used (malformed records, too little data, features that do not match)."""


class HeadMismatchError(UserError, ValueError):
    """A draft head that does not fit the target it is used with."""


class DeviceError(UserError, ValueError):
    """A device that this machine does not have (e.g. cuda where torch sees no GPU)."""


def run_main(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> int:
    """Run a command line's `main(argv)`: a UserError is printed as `error: <message>` (exit status 2); `--debug`
    anywhere in argv (or DRAFTHEAD_DEBUG=1) shows its traceback too."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("DRAFTHEAD_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    try:
        return main(argv) or 0
    except UserError as error:
        if debug:
            traceback.print_exc()
        print(f"error: {error}", file=sys.stderr)
        return 2
