"""What the conversation refuses."""


class Refusal(Exception):
    """A command the conversation refuses, with nothing changed: the adapter tells its client
    (``code``, ``message``, and the field at fault where the protocol names one)."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
