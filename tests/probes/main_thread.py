"""Where the main thread is, seen from another thread: for probes whose background thread must
act at a point of the main thread's, not after a sleep that a loaded machine can outlast."""
import sys
import threading
import time

POLL_S = 0.01  # how often ``wait_until`` looks (not a duration anything relies on)


def waits_in(function: str) -> bool:
    """The main thread is blocked in a wait (its innermost frame in threading.py) with
    ``function`` on its stack (``sys._current_frames``: CPython's documented view of every
    thread's frame)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None or not frame.f_code.co_filename.endswith("threading.py"):
        return False
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def wait_until(condition) -> None:
    """Return once ``condition()`` is true."""
    while not condition():
        time.sleep(POLL_S)
