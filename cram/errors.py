"""The one exception type for mistakes a user can fix, and the way recipes report it."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


class UserError(Exception):
    """Bad input from the user: the message is one sentence that names the fix."""


def run_cli(main: Callable[[], object]) -> None:
    """Run a recipe's `main`, turning a `UserError` into one line on stderr and exit status 2.

    Under a multi-process launch every process meets the same bad input; only rank 0 prints it.
    """
    try:
        main()
    except UserError as err:
        message = str(err).rstrip()
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {message}{'' if message.endswith('.') else '.'}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
