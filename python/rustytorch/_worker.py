"""A worker process of a job launched from Python: ``python -m rustytorch._worker --join ADDR``.

Runs the same code as ``rtx worker`` (same arguments and environment variables).
"""

import sys

from . import _rustytorch


def main(argv=None) -> int:
    try:
        _rustytorch.worker_main(list(sys.argv[1:] if argv is None else argv))
    except _rustytorch.RustytorchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
