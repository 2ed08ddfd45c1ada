"""Protocol adapters: each maps its wire's messages to the conversation core's commands, and the
core's events to its wire's messages, over one transport (``pipeline/connection.py``).

``wire.py``: what every adapter offers the connection; ``v1.py``: protocol v1 (docs/protocol.md,
binary msgpack); ``realtime.py``: the OpenAI Realtime protocol (docs/realtime.md, JSON events).
"""
