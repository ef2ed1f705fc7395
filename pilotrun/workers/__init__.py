"""Fresh processes for the gates that must not share memory with the pilot: restore, resume, reload_eval.

Each worker is started with ``python -m pilotrun.workers.<name>`` (a new interpreter,
not a fork), rebuilds what it needs from files, and writes its result as JSON.
"""
