"""Process and thread settings for a model replica: thread pinning and the one inference thread.

Every model call of a replica (warm-up included) runs on one dedicated thread. That is
what makes warm-up meaningful: per-thread caches (cuDNN's benchmark cache, TLS state of
compiled graphs) are filled on the thread that later serves, and no two model calls ever
race on module state (Mimi's streaming buffers, static KV caches).
"""
from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Iterator, TypeVar

T = TypeVar("T")
_DONE = object()


def pin_torch_threads(num_threads: int) -> None:
    """Give torch exactly ``num_threads`` intra-op threads (the replica's CPU share).

    Oversubscribing the cores across replica processes made the same step 20-60x slower
    on a 2-core machine, so every replica sets this at start, before any model work.
    """
    import torch

    num_threads = max(1, int(num_threads))
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    torch.set_num_threads(num_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set (interop threads can only be set once per process)


def keep_large_allocations(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Keep freed large tensors in the process heap instead of returning them to the OS (glibc only).

    glibc serves allocations above its mmap threshold (dynamic, at most 32 MB by default) with a
    fresh ``mmap`` and unmaps them on free, so a CPU model step that allocates the same big
    temporaries every time (a batch's STFT, the subsampling's activations: 5-15 MB each) can pay a
    page fault per 4 KB page, every step. ``load/bench_stt.py`` sets this for both engines it times
    (``--glibc-malloc-defaults`` to compare): NeMo's streaming pipeline ran ~26 % faster with it, our
    STT engine ~3 %. The cost is resident memory that stays at its peak, which a serving process
    reaches anyway. Returns False where the C library has no ``mallopt`` (musl, macOS) and nothing
    changes.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_TRIM_THRESHOLD, int(trim_threshold))) and bool(mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)))


def threads_for_cpu_share(num_cpus: float | None) -> int:
    """Torch threads for a replica that holds ``num_cpus`` logical CPUs (at least one)."""
    if not num_cpus:
        return 1
    return max(1, int(num_cpus))


class InferenceThread:
    """A single worker thread that runs every model call of one replica, in submission order."""

    def __init__(self, name: str, num_threads: int = 1):
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=pin_torch_threads, initargs=(num_threads,)
        )
        self.ident: int | None = self._executor.submit(threading.get_ident).result()

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the inference thread and wait for it (start-up and warm-up)."""
        if threading.get_ident() == self.ident:
            return fn(*args, **kwargs)
        return self._executor.submit(fn, *args, **kwargs).result()

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the inference thread without blocking the event loop."""
        loop = asyncio.get_running_loop()
        return await asyncio.wrap_future(self._executor.submit(fn, *args, **kwargs), loop=loop)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn`` on the inference thread without waiting (clean-up after cancellation)."""
        return self._executor.submit(fn, *args)

    async def iterate(self, make: Callable[..., Iterator[T]], *args: Any,
                      last: Callable[[Iterator[T]], T | None] | None = None, **kwargs: Any) -> AsyncIterator[T]:
        """Create an engine iterator and advance it one item at a time, all on this thread.

        Each ``next()`` is one executor call, so several streams interleave item by item.
        If the consumer stops early or is cancelled, the iterator is closed on this thread,
        which releases its state in the engine (KV cache, streaming buffers). ``last(it)``, if
        given, makes one more item from the exhausted iterator (e.g. why it stopped).
        """
        it = await self.open(make, *args, **kwargs)
        try:
            while True:
                item = await self.run(next, it, _DONE)
                if item is _DONE:
                    break
                yield item
            if last is not None and (item := last(it)) is not None:
                yield item
        finally:
            self.submit(getattr(it, "close", lambda: None))

    async def open(self, make: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``make(*args, **kwargs)`` on this thread, for something with a ``close()`` (a stream). If
        the caller is cancelled while ``make`` runs, what it then returns has no owner: it is closed
        on this thread as soon as it exists."""
        future = self._executor.submit(make, *args, **kwargs)
        try:
            return await asyncio.wrap_future(future, loop=asyncio.get_running_loop())
        except asyncio.CancelledError:
            future.add_done_callback(self._close_orphan)
            raise

    def _close_orphan(self, future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.submit(getattr(future.result(), "close", lambda: None))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
