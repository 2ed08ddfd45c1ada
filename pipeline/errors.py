"""The error codes of a conversation: one catalogue for the core and every protocol adapter.

Each is a stable string a client may branch on (docs/protocol.md "Errors", docs/realtime.md
"Limits"). The core raises or reports these; an adapter puts them on its wire (v1's ``error``
message, the Realtime ``error`` event) and adds only the codes of its own framing (v1's in
pipeline/adapters/v1/protocol.py, such as ``bad_msgpack``; the Realtime ones in pipeline/adapters/realtime/client_events.py,
such as ``invalid_json``). The HTTP refusals before a session exists are pipeline/door/admission.py's.
"""
from __future__ import annotations

# A spoken turn and the recogniser
E_NO_FREE_SLOT = "no_free_slot"        # the recogniser is full: this spoken turn is dropped; the session stays open
E_TURN_TOO_LONG = "turn_too_long"      # a spoken turn (or an item's audio) reached max_turn_s
E_AUDIO_TOO_FAST = "audio_too_fast"    # audio over max_audio_rate x real time, sustained: dropped (told once) or refused
# What a client asks for
E_ITEM_TOO_LARGE = "item_too_large"    # an item over MAX_ITEM_CHARS (pipeline/conversation/history.py)
E_RATE_LIMITED = "rate_limited"        # replies asked for over max_replies_per_minute; refused, nothing started
E_BAD_SETTING = "bad_setting"          # a session.update / response setting is unknown or bad; nothing changes
E_TOOL_RESULT_TOO_LARGE = "tool_result_too_large"  # a tool's output over 16 KiB; the call stays pending
E_INVALID_VALUE = "invalid_value"      # a field of a command is bad (the Realtime protocol's name); nothing changes
E_ITEM_NOT_FOUND = "item_not_found"    # a command names an item this conversation does not have
E_ACTIVE_RESPONSE = "conversation_already_has_active_response"  # a reply asked for while one runs
E_CANCEL_NOT_ACTIVE = "response_cancel_not_active"  # a cancel with no (such) reply running
E_NO_OPEN_TURN = "no_open_turn"        # a turn's end asked for with no audio since the last turn (Realtime: commit empty)
# The session's life
E_IDLE_TIMEOUT = "idle_timeout"        # nothing sent either way for idle_timeout_s; the session is closed (1000)
E_SERVER_BUSY = "server_busy"          # the gateway holds max_sessions sessions, or the TTS's line is full
E_BAD_OPTION = "bad_option"            # a session option in the URL query is unknown or bad; closed (1008)
E_RESUME_REFUSED = "resume_refused"    # ?resume= with a token that resumes nothing (expired, used, forged); closed (1008)
E_SESSION_REPLACED = "session_replaced"  # a newer connection resumed this session; this one is closed (4001)
# The server's side
E_ENGINE_UNAVAILABLE = "engine_unavailable"  # a model replica failed or did not answer in time; the session stays open
E_INTERNAL = "internal"                # a server fault while handling this session

# WebSocket close codes, the same on every wire
CLOSE_NORMAL = 1000
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_INTERNAL_ERROR = 1011
CLOSE_POLICY_VIOLATION = 1008
CLOSE_SESSION_REPLACED = 4001  # the session was resumed by a newer connection: do not reconnect
CLOSE_SERVICE_RESTART = 1012  # a draining gateway replica: resume elsewhere (going_away came first)

# Codes of the client's own making (the Realtime protocol calls them invalid_request_error)
CLIENT_CAUSED = frozenset({E_TURN_TOO_LONG, E_BAD_SETTING, E_AUDIO_TOO_FAST, E_ITEM_TOO_LARGE, E_RATE_LIMITED,
                           E_TOOL_RESULT_TOO_LARGE, E_INVALID_VALUE, E_ITEM_NOT_FOUND, E_ACTIVE_RESPONSE,
                           E_CANCEL_NOT_ACTIVE})
