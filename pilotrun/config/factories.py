"""Importing a user's ``model.factory`` / ``data.factory`` ("module:function") from the spec's folder.

The folder goes first on ``sys.path``, so a module beside the spec wins over an installed one of the same name;
a module of that name imported earlier from elsewhere (often the standard library) is :class:`ShadowedModule`.
Two specs in one process (campaigns, tests) each get their own folder's module (README, "Your own model and
data").

Example::

    build = import_factory("toy:build_model", spec.folder)
    model = build(spec.model.factory_mapping())

Both the import and the call run under :func:`factory_guard`: ``pilot.factory_timeout`` bounds them, and a
``KeyboardInterrupt`` the user's code raises itself (no signal arrived) is its failure, not a stop.
"""
from __future__ import annotations

import contextlib
import importlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class ShadowedModule(ImportError):
    """A module beside the spec has the name of a module Python already imported from elsewhere."""


_FACTORY_MODULES: dict[str, Path] = {}  # top-level module name -> spec folder it was imported from


def _forget_other_folder(top: str, folder: Path) -> None:
    """Drop what another spec folder's factories brought in: the factory's module and every module imported from that
    folder with it (a factory module importing its sibling ``toylm`` there), so that this folder's own are imported.
    Run between two specs in one process (the Python API, the test suite), a sibling left behind shadowed this
    folder's module of the same name."""
    others = {f for f in _FACTORY_MODULES.values() if f != folder}
    if not others:
        return
    prefixes = tuple({p for f in others for p in (str(f) + "/", str(f.resolve()) + "/")})
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and file.startswith(prefixes):
            del sys.modules[name]
    if _FACTORY_MODULES.get(top) in others:  # a namespace package has no __file__ for the sweep above
        for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[name]
    for f in others:
        if str(f) in sys.path:
            sys.path.remove(str(f))
    for name in [t for t, f in _FACTORY_MODULES.items() if f in others]:
        del _FACTORY_MODULES[name]


def import_factory(target: str, folder: Path) -> Any:
    """Import 'module:function' relative to the spec folder (README, "Your own model and data"). Raises what the
    import raises (ModuleNotFoundError, AttributeError, the module's own errors) or :class:`ShadowedModule`."""
    module_name, _, func_name = target.partition(":")
    top = module_name.split(".")[0]
    _forget_other_folder(top, folder)
    if str(folder) in sys.path:
        sys.path.remove(str(folder))
    sys.path.insert(0, str(folder))
    module = importlib.import_module(module_name)
    local = [folder / f"{top}.py", folder / top / "__init__.py"]
    top_file = getattr(sys.modules.get(top), "__file__", None) or "built-in"
    if any(x.exists() for x in local) and (top_file == "built-in"
                                           or not Path(top_file).resolve().is_relative_to(folder.resolve())):
        raise ShadowedModule(
            f"{top!r} resolved to {top_file}, not to {next(x for x in local if x.exists())}: a module of that name was "
            f"already imported (often the standard library); rename your file"
        )
    _FACTORY_MODULES[top] = folder
    obj = module
    for part in func_name.split("."):
        obj = getattr(obj, part)
    return obj


class FactoryTimeout(Exception):
    """A factory's import or call did not finish within ``pilot.factory_timeout`` seconds."""


class FactoryInterrupt(Exception):
    """User code raised ``KeyboardInterrupt`` though no stop signal arrived: the code's own failure, not a stop."""


class _Expired(BaseException):
    """Raised by the alarm inside user code; a BaseException, so the code's own ``except Exception`` cannot keep it."""


# Stop signals whose Python handlers the guard chains to record that one arrived (SIGHUP only where it exists).
_STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))
_REPEAT_SECONDS = 1.0  # after the first alarm, again every second: user code that swallowed one still stops


@contextlib.contextmanager
def factory_guard(what: str, seconds: float | None) -> Iterator[None]:
    """Run user factory code (``what``: its import or call, for the message) for at most ``seconds``.

    Past the limit :class:`FactoryTimeout` is raised in the main thread (an interval timer: SIGALRM); a
    ``KeyboardInterrupt`` that no stop signal caused (user code raised it) becomes :class:`FactoryInterrupt`, while
    a real Ctrl-C or SIGTERM still propagates as it was raised. Off the main thread nothing can interrupt the code:
    it runs without a limit. An outer interval timer that ends first is left as it is, and a later one is put back
    with the time it had left."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signalled: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}

    def chained(signum, frame):
        signalled.append(signum)
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)

    for sig, handler in previous.items():
        if callable(handler):
            signal.signal(sig, chained)
    outer = signal.getitimer(signal.ITIMER_REAL)
    limit = seconds if seconds is not None and not 0 < outer[0] <= seconds else 0.0  # 0: not timed here
    timed = limit > 0
    old_alarm = signal.getsignal(signal.SIGALRM)
    started = time.monotonic()
    if timed:
        def on_alarm(signum, frame):
            raise _Expired(_where(frame))

        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit, _REPEAT_SECONDS)
    try:
        yield
    except _Expired as exc:
        raise FactoryTimeout(f"{what} did not finish within {seconds:g} s (pilot.factory_timeout; stopped {exc}): "
                             "a factory must "
                             "not loop or block; make it faster (fewer examples, a smaller model), or raise "
                             "pilot.factory_timeout if it needs longer") from None
    except KeyboardInterrupt as exc:
        if signalled:
            raise
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        at = f" ({_where(tb.tb_frame, tb.tb_lineno)})" if tb is not None else ""
        raise FactoryInterrupt(f"{what} raised KeyboardInterrupt{at} though no stop signal was sent; raise an "
                               "exception instead (a KeyboardInterrupt would end pilotrun as Ctrl-C does)") from exc
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_alarm)
            if outer[0] > 0:
                signal.setitimer(signal.ITIMER_REAL, max(outer[0] - (time.monotonic() - started), 1e-3), outer[1])
        for sig, handler in previous.items():
            if callable(handler):
                signal.signal(sig, handler)


def _where(frame, line: int | None = None) -> str:
    return f"at {Path(frame.f_code.co_filename).name}:{line or frame.f_lineno} in {frame.f_code.co_name}"
