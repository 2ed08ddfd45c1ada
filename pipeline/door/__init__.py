"""The door: who may come in (auth, admission, per-client limits) and what a client may send before a session exists."""
