"""Phone carriers' media streams (docs/phone.md): the adapter, each carrier's messages, the webhook, call control."""
