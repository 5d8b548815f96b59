"""Ctrl-C and SIGTERM, made safe: an interrupt saves progress between steps, never in the middle of one.

torchrun and job schedulers stop a run with SIGTERM; a user presses Ctrl-C (SIGINT). Both become
KeyboardInterrupt, which the training loop catches to save a resume point. Inside `interrupts_deferred`, one that
arrives is held until the block ends, so the weights, the optimizer and the counters always move together.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interrupts_deferred():
    """Hold Ctrl-C and SIGTERM until the block ends, so a step is never half-applied when progress is saved.

    A signal that arrives meanwhile is only noted, and raised as KeyboardInterrupt once the block is done. (Blocking
    the signal with the thread's signal mask is not enough: torch's worker threads do not block it, the kernel
    may hand it to one of them, and Python then raises it in the main thread at once.)
    """
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if caught:
        raise KeyboardInterrupt


def sigterm_as_ctrl_c() -> None:
    """From now on SIGTERM raises KeyboardInterrupt, like Ctrl-C, so progress is saved first."""
    signal.signal(signal.SIGTERM, _raise_interrupt)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
