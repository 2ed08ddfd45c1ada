"""Protocol v1 (docs/protocol.md): msgpack frames over a WebSocket, its adapter and its URL options."""
