"""transformers' own output kept out of pilotrun's, without importing transformers for a job that never uses it.

transformers logs warnings and draws tqdm bars (while saving, for instance); a pilot and a trace print their own.
Importing transformers only to silence it cost every process of a plain PyTorch job about 1.5 s of CPU, and it did
not even hold: transformers' first import sets its logger back to WARNING. So :class:`QuietTransformers` quiets it
whenever it finds it imported, on entry and at each :meth:`~QuietTransformers.settle` (the pilot settles before
every gate, so after a load gate that imported it), and on exit puts back what it changed.

Example::

    with QuietTransformers() as quiet:
        for gate in gates:
            quiet.settle()
            gate.run()
"""
from __future__ import annotations

import contextlib
import sys
from types import TracebackType

from ..procs import import_noise_quieted


class QuietTransformers:
    """Errors only and no progress bars from transformers while inside; nothing imported to get there."""

    def __init__(self) -> None:
        self._verbosity: int | None = None
        self._bars = False
        self._noise = contextlib.ExitStack()

    def __enter__(self) -> QuietTransformers:
        self._noise.enter_context(import_noise_quieted())   # transformers' import wakes torchao (procs.py)
        self.settle()
        return self

    def settle(self) -> None:
        """Quiet transformers now if it has been imported since (once; a later call does nothing)."""
        hf = sys.modules.get("transformers.utils.logging")
        if self._verbosity is not None or hf is None:
            return
        # get_verbosity() first sets up transformers' root logger if its import has not yet: a level set on
        # logging.getLogger("transformers") before that would be overwritten.
        self._verbosity = hf.get_verbosity()
        self._bars = hf.is_progress_bar_enabled()
        hf.set_verbosity_error()
        hf.disable_progress_bar()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._noise.close()
        hf = sys.modules.get("transformers.utils.logging")
        if self._verbosity is None or hf is None:
            return
        hf.set_verbosity(self._verbosity)
        if self._bars:
            hf.enable_progress_bar()
        self._verbosity = None
