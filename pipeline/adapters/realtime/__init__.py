"""The OpenAI Realtime protocol: a second wire adapter over the conversation core (docs/realtime.md)."""
