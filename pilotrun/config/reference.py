"""The spec reference (docs/spec.md), generated from the fields' own declarations.

Every key is documented once, where it is declared (``config/sections.py``, the top level in ``config/spec.py``);
this module renders those declarations so the reference cannot drift from the code (a test compares the file).

Example::

    python -m pilotrun.config.reference > docs/spec.md
"""
from __future__ import annotations

from .schema import describe_fields
from .spec import Spec

HEADER = """# pilot.yaml reference

Every key a spec may hold, with its type, default and meaning — generated from the declarations in
`pilotrun/config/sections.py` and `pilotrun/config/spec.py` (`python -m pilotrun.config.reference > docs/spec.md`;
a test keeps this file equal to them). A wrong key or value stops the run with exit 2 and a message naming the key
and the fix.
`model` and `data` factories also receive any further keys of their section.

| key | type | default | meaning |
|---|---|---|---|
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """The whole reference as Markdown."""
    rows = [f"| `{name}` | {_cell(kind)} | {_cell(default and f'`{default}`')} | {_cell(text)} |"
            for name, kind, default, text in describe_fields(Spec)]
    return HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":  # pragma: no cover - exercised through the file it writes
    print(markdown(), end="")
