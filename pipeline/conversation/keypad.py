"""Keys the caller presses (DTMF), routed to what waits for them.

A key is a user turn of its own ("(The caller pressed 1 on the keypad.)") unless the session's
keys go to a tool: then they are kept (at most ``2 * MAX_DIGITS``) for a ``collect_digits`` call,
whose result is the keys typed up to ``#``, or its ``max_digits`` of them. Keys typed before the
call are kept for it.
"""
from __future__ import annotations

MAX_DIGITS = 20  # what one collect_digits call may ask for


class Keypad:
    def __init__(self) -> None:
        self.keys = ""  # typed and not yet taken
        self.collecting: tuple[str, int] | None = None  # (call id, max digits) of the call waiting for keys

    def press(self, keys: str) -> tuple[str, str] | None:
        """Keys typed: (call id, its result) once a waiting call has its keys, else None."""
        self.keys = (self.keys + keys)[-2 * MAX_DIGITS:]
        return self._taken()

    def collect(self, call_id: str, max_digits: int) -> tuple[str, str] | None:
        """A collect_digits call waits for ``max_digits`` keys (or up to ``#``); as :meth:`press`."""
        self.collecting = (call_id, min(max(max_digits, 1), MAX_DIGITS))
        return self._taken()

    def cancelled(self, call_id: str) -> None:
        if self.collecting is not None and self.collecting[0] == call_id:
            self.collecting = None

    def _taken(self) -> tuple[str, str] | None:
        if self.collecting is None:
            return None
        call_id, count = self.collecting
        head, hash_key, tail = self.keys.partition("#")
        if len(head) >= count:
            digits, self.keys = head[:count], self.keys[count:]
        elif hash_key:
            digits, self.keys = head, tail
        else:
            return None
        self.collecting = None
        return call_id, digits or "(no digits: the caller pressed # alone)"
