"""The ``hp-ckpt`` console script: one parser, one subcommand module per command.

Exit status: 0 success (checkpoint sound, checkpoints equal); 1 a finding
(``verify`` found problems, ``diff`` found differences); 2 bad usage or an
error (not a checkpoint, unreadable input), reported as one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from hyper_parallel.cli import convert_cmd, diff_cmd, export_ms_cmd, import_cmd, inspect_cmd, list_cmd, verify_cmd
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError

__all__ = ["build_parser", "main", "EXIT_OK", "EXIT_FINDING", "EXIT_ERROR"]

#: Success: the checkpoint is sound, or the checkpoints are equal.
EXIT_OK = 0
#: ``verify`` found problems, or ``diff`` found differences.
EXIT_FINDING = 1
#: Bad usage, or the input is not a (readable) checkpoint.
EXIT_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    """Return the ``hp-ckpt`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="hp-ckpt",
        description="Inspect, list, verify, convert, import and compare hyper_parallel distributed checkpoints.",
        epilog="Exit status: 0 ok/equal, 1 problems or differences found, 2 usage error or not a checkpoint.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module in (inspect_cmd, list_cmd, verify_cmd, convert_cmd, import_cmd, export_ms_cmd, diff_cmd):
        module.register(subparsers)
    return parser


def _one_line(exc: BaseException) -> str:
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return text or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hp-ckpt`` with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Errors are caught here: a :class:`CheckpointError` or an OS error prints
    one line ``hp-ckpt: error: ...`` on stderr and returns 2.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # --help (0) or bad usage (2): argparse already printed
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_ERROR
    try:
        return int(args.func(args))
    except (CheckpointError, OSError) as exc:
        print(f"hp-ckpt {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("hp-ckpt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
