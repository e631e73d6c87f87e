"""Counting XLA compilations: a `CompileCounter` per runner, not a process-wide tally.

JAX reports every executable it builds (a backend compile, or a load from the
persistent compilation cache) through `jax.monitoring`, on the thread that asked
for it. A counter registers its own listener when it is made (and drops it when it
is garbage-collected) and keeps one tally per thread, so a span measured on one
thread (`begin()` ... `end()`, e.g. around one engine step) counts only the
compiles that thread caused.

What it tells apart: two engines driven from different threads (a server thread
and a batch thread, say) never see each other's compiles, nor compiles of other
code on other threads. What it cannot: two engines stepped alternately on one
thread share that thread's tally, but a span covers only its own step (steps do
not interleave on a thread); compiles that a step causes on another thread (none
do today) are not in its span; `total` counts every thread, so it includes other
engines' compiles made during the counter's life (used for the warm-up figure, as
warm-up compiles on a thread pool).
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
