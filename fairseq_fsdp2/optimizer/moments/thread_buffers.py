"""Buffers kept between calls, one per thread, all dropped at once at a run's end.

``threading.local`` keeps a value per thread but drops only the calling thread's; a run's end
(launch/run_context.py) must drop those of every thread that worked for it, a background save's
included, so that the process is left as the run found it. Entries of threads that ended go
with their thread objects.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Optional


class ThreadBuffers:
    """One value per thread (``get``, ``put``); ``clear`` drops every thread's."""

    def __init__(self) -> None:
        self._by_thread: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self) -> Optional[Any]:
        with self._lock:
            return self._by_thread.get(threading.current_thread())

    def put(self, value: Any) -> None:
        with self._lock:
            self._by_thread[threading.current_thread()] = value

    def clear(self) -> None:
        with self._lock:
            self._by_thread.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_thread)
