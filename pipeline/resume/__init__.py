"""Conversations that outlive their connection: resume tokens, the snapshot store, and the keeper that feeds it."""
