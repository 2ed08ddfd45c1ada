"""Finding real checkpoints on disk: a local path or the Hugging Face cache, never a silent download.

Every real-profile model goes through :func:`require_pretrained`, so a missing checkpoint
is one clear startup error naming the model and the command that fetches it.
"""
from __future__ import annotations

import os


class MissingCheckpointError(RuntimeError):
    """A real checkpoint is not on this machine."""


def require_pretrained(name_or_path: str, *, what: str, allow_patterns: list[str] | None = None) -> str:
    """Return a local directory (or file) holding ``name_or_path``.

    ``name_or_path`` is a local file/directory, or a Hugging Face repo id that must already be
    in the local cache (``HF_HOME``), unless ``GAPLESS_ALLOW_DOWNLOAD=1`` lets the hub fetch it.
    """
    if os.path.exists(name_or_path):
        return name_or_path
    from huggingface_hub import snapshot_download

    allow_download = os.environ.get("GAPLESS_ALLOW_DOWNLOAD", "0") == "1"
    try:
        return snapshot_download(
            name_or_path, allow_patterns=allow_patterns, local_files_only=not allow_download
        )
    except Exception as exc:  # noqa: BLE001 - any failure here means "not available"
        raise MissingCheckpointError(
            f"{what} checkpoint {name_or_path!r} was not found locally "
            f"(neither a path nor in the Hugging Face cache). Fetch it with "
            f"`hf download {name_or_path}` (accept its licence on huggingface.co "
            f"first if it is gated), or set GAPLESS_ALLOW_DOWNLOAD=1 to let the server download it, "
            f"or use the tiny profile. Cause: {type(exc).__name__}: {exc}"
        ) from exc
