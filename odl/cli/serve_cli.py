"""``odl-serve``: not yet implemented (see issue 3)."""

from __future__ import annotations

import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``odl-serve``; exits 2 until the command is implemented."""
    print("odl-serve: not yet implemented", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
