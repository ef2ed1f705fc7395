"""Write docs/reference/cli.md: every command's ``--help``, taken from the parser the ``pilotrun`` command builds.

    python docs/gen_cli.py > docs/reference/cli.md

tests/test_docs.py keeps the file equal to this script's output, so a flag added to a command without regenerating
the page fails a test. The width is fixed (argparse wraps at the terminal's), so the page does not depend on who
ran the script."""
from __future__ import annotations

import argparse
import os

os.environ["COLUMNS"] = "110"  # argparse reads the width when a help is formatted: fixed, for a stable page

from pilotrun.cli import build_parser  # noqa: E402
from pilotrun.cli.common import COMMANDS  # noqa: E402

HEADER = """# Command line

Every command's `--help`, generated from the parser `pilotrun` itself builds (`python docs/gen_cli.py >
docs/reference/cli.md`; `tests/test_docs.py` fails when this page and the parser differ). Exit codes:
[exit codes](exit-codes.md).
"""


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _block(title: str, level: int, parser: argparse.ArgumentParser) -> list[str]:
    out = [f"{'#' * level} `{title}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for verb, child in _subparsers(parser).items():
        out += _block(f"{title} {verb}", level + 1, child)
    return out


def markdown() -> str:
    lines = [HEADER, "```text", build_parser().format_help().rstrip(), "```", ""]
    for name in COMMANDS:
        lines += _block(f"pilotrun {name}", 2, _subparsers(build_parser(name))[name])
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
