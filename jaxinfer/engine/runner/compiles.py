"""Counting XLA compilations: a `CompileCounter` per runner, with a tally per thread
(JAX reports each build or cache load through `jax.monitoring` on the asking thread),
so engines driven from different threads never count each other's. What it tells
apart and what it cannot: docs/architecture.md#buckets.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import weakref

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileSpan:
    """Where a counted span began: its thread and that thread's tally then."""

    thread: int
    count: int


class CompileCounter:
    """XLA compilations seen since this counter was made, per thread and in total."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_thread: collections.Counter[int] = collections.Counter()
        ref = weakref.ref(self)

        def listener(event: str, duration: float, **kwargs: object) -> None:
            counter = ref()
            if counter is not None and event == COMPILE_EVENT:
                counter._record(threading.get_ident())

        jax.monitoring.register_event_duration_secs_listener(listener)
        self._finalizer = weakref.finalize(self, _unregister, listener)

    def _record(self, thread: int) -> None:
        with self._lock:
            self._by_thread[thread] += 1

    @property
    def total(self) -> int:
        """Compiles on every thread since the counter was made (other code's included)."""
        with self._lock:
            return sum(self._by_thread.values())

    def on_this_thread(self) -> int:
        """Compiles on the calling thread since the counter was made."""
        with self._lock:
            return self._by_thread[threading.get_ident()]

    def begin(self) -> CompileSpan:
        """Start a span on this thread; hand it to `end()` on the same thread."""
        return CompileSpan(thread=threading.get_ident(), count=self.on_this_thread())

    def end(self, span: CompileSpan) -> int:
        """Compiles on this thread since `span` began."""
        if span.thread != threading.get_ident():
            raise RuntimeError("a CompileCounter span must end on the thread it began on")
        return self.on_this_thread() - span.count

    def close(self) -> None:
        """Stop listening now (otherwise when the counter is garbage-collected)."""
        self._finalizer()


class CacheLoads:
    """Executables loaded from the persistent compilation cache while it is open (a
    context manager; every thread's loads count)."""

    def __init__(self) -> None:
        self.count = 0

    def _listener(self, event: str, **kwargs: object) -> None:
        if event == CACHE_HIT_EVENT:
            self.count += 1

    def __enter__(self) -> CacheLoads:
        jax.monitoring.register_event_listener(self._listener)
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(AssertionError, ValueError):
            jax.monitoring.unregister_event_listener(self._listener)


def _unregister(listener: object) -> None:
    with contextlib.suppress(AssertionError, ValueError):  # gone: clear_event_listeners
        jax.monitoring.unregister_event_duration_listener(listener)
