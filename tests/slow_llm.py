"""A slow LLM for tests whose reply must outlast its first clause: the tiny engine, each token
taking ``delay_s`` longer on the inference thread, as a large model would."""
from __future__ import annotations

import time


class SlowStream:
    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def __iter__(self) -> "SlowStream":
        return self

    def __next__(self):
        item = next(self.inner)
        time.sleep(self.delay_s)
        return item

    def __getattr__(self, name):  # close(), finish_reason, generated, ... are the stream's own
        return getattr(self.inner, name)


class SlowLLM:
    def __init__(self, engine, delay_s: float):
        self.engine, self.delay_s = engine, delay_s

    def stream(self, *args, **kwargs) -> SlowStream:
        return SlowStream(self.engine.stream(*args, **kwargs), self.delay_s)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def slowed(backends, delay_s: float):
    """``backends`` (LocalBackends) with its LLM engine slowed by ``delay_s`` a token."""
    backends.llm.engine = SlowLLM(backends.llm.engine, delay_s)
    return backends
