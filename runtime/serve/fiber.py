"""Fiber: a function run on its own thread in strict turns with the thread that resumes it.

A coroutine whose suspension points may sit deep inside the calls it makes, which a generator's
cannot: a decoding loop calls `target.forward` in the middle of a round, and the server's scheduler
wants that forward handed to it, to run with the other requests' rows. Only one of the two threads
runs at a time (two semaphores pass the turn), so the loop's code runs exactly as it would inline:
nothing it reads changes under it, and nothing runs beside it.
"""

from __future__ import annotations

import threading
from typing import Callable


class Cancelled(BaseException):
    """Raised at a closed fiber's suspension point: it unwinds the body (a BaseException, so no
    `except Exception` in the loop swallows it)."""


class Fiber:
    """Runs `body(suspend)` on its own thread, one turn per `resume`; `suspend(value)` ends a turn."""

    def __init__(self, body: Callable[[Callable[[object], object]], object], name: str = "fiber") -> None:
        self._body = body
        self._name = name
        self._go = threading.Semaphore(0)  # the fiber's turn
        self._back = threading.Semaphore(0)  # the resumer's turn
        self._thread: threading.Thread | None = None
        self._sent: object = None  # what the current resume hands to the suspended body
        self._out: object = None  # what the body handed to suspend
        self._closing = False
        self.done = False
        self.result: object = None  # the body's return value, once done
        self.error: BaseException | None = None  # what the body raised, once done (not Cancelled)

    def resume(self, value: object = None) -> object:
        """Run the body until it suspends (returns what it passed to suspend) or ends (then `done`; None)."""
        if self.done:
            raise RuntimeError("this fiber's body has ended; it cannot be resumed")
        self._sent = value
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
            self._thread.start()
        else:
            self._go.release()
        self._back.acquire()
        return self._out

    def suspend(self, value: object) -> object:
        """Called by the body on its thread: hand `value` to the resumer and wait for the next resume's value."""
        if self._closing:
            raise Cancelled()
        self._out = value
        self._back.release()
        self._go.acquire()
        if self._closing:
            raise Cancelled()
        return self._sent

    def close(self) -> None:
        """End a suspended body: Cancelled is raised at its suspension point and it unwinds (its finally
        blocks run); returns once its thread is done. A body never resumed is not started."""
        if self._thread is None or self.done:
            self.done = True
            return
        self._closing = True
        self._go.release()
        self._back.acquire()

    def _main(self) -> None:
        try:
            self.result = self._body(self.suspend)
        except Cancelled:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the resumer, which decides
            self.error = e
        finally:
            self.done = True
            self._out = None
            self._back.release()
