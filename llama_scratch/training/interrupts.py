"""Ctrl-C and SIGTERM, made safe: an interrupt saves progress between steps, never in the middle of one.

torchrun and job schedulers stop a run with SIGTERM; a user presses Ctrl-C (SIGINT). Both become
KeyboardInterrupt, which the training loop catches to save a resume point. Inside `interrupts_deferred`, one that
arrives is held until the block ends, so the weights, the optimizer and the counters always move together.
While several processes train (`stops_noted`), a signal is only noted: the processes vote at each step's end and
stop together (loop.train_epoch), since a signal may reach one process alone, or reach them at different moments.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interrupts_deferred():
    """Hold Ctrl-C and SIGTERM until the block ends, so a step is never half-applied when progress is saved.

    A signal that arrives meanwhile is only noted, and once the block is done handed to the handler it replaced:
    Python's own and `sigterm_as_ctrl_c`'s raise KeyboardInterrupt, `stops_noted`'s notes it for a vote. (Blocking
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
    _hand_on(caught, previous)  # to the handler outside the block: noted (stops_noted), or raised


@contextlib.contextmanager
def stops_noted(several: bool) -> Iterator[Callable[[], bool]]:
    """While `several` processes train, Ctrl-C and SIGTERM are noted rather than raised; the block gets `asked()`,
    whether one was, which the loop puts to a vote at each step's end (Strategy.stop_agreed). A process raising
    alone, mid-step, would save through collectives the others never reach (a sharded save), or leave them
    waiting in the next one. A second Ctrl-C raises at once: the way out of a stuck run, without saving. A second
    SIGTERM does not: a scheduler (Slurm at the time limit, preemption) signals every process of the job and
    torchrun forwards its own, so each process can get two within one step, and all must still save. A process
    alone is left as it was (raised at once, or once a deferred block ends): it has no one to wait for."""
    if not several or threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    caught: list[int] = []

    def note(signum, frame) -> None:
        caught.append(signum)
        if signum == signal.SIGINT and caught.count(signal.SIGINT) > 1:  # a person pressing Ctrl-C again
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, note) for sig in _STOP_SIGNALS}
    try:
        yield lambda: bool(caught)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _hand_on(caught, previous)  # one that came after the last vote is not lost: stopped as outside training


def _hand_on(caught: list[int], previous: dict) -> None:
    """The signals caught inside a block, handed to the handlers it replaced (which raise, or note them); a handler
    that is not Python's (the default, or ignored) raises KeyboardInterrupt, as a Ctrl-C would."""
    for signum in caught:
        handler = previous[signum]
        if not callable(handler):
            raise KeyboardInterrupt
        handler(signum, None)


def sigterm_as_ctrl_c() -> None:
    """From now on SIGTERM raises KeyboardInterrupt, like Ctrl-C, so progress is saved first."""
    signal.signal(signal.SIGTERM, _raise_interrupt)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
