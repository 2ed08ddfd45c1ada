"""Finding real checkpoints on disk: a local path or the Hugging Face cache, never a silent download.

Every real-profile model goes through :func:`require_pretrained`, so a checkpoint that is not
there is one clear startup error naming the model and the command that fetches it
(``hf download``, the CLI of huggingface-hub). The error says what failed: not on this machine
(:class:`MissingCheckpointError`), gated, no such repository, or another failure of the hub
client; a checkpoint that is there but cannot be read (a corrupt or partial download) is
reported by :func:`reading_checkpoint` around the code that loads it.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator


class CheckpointError(RuntimeError):
    """A real checkpoint could not be found or read; the message says which, and what to do."""


class MissingCheckpointError(CheckpointError):
    """A real checkpoint is not on this machine (neither a path nor in the Hugging Face cache)."""


def fetch_command(name: str) -> str:
    """The shell command that puts ``name`` into the Hugging Face cache."""
    return f"hf download {name}"


def require_pretrained(name_or_path: str, *, what: str, allow_patterns: list[str] | None = None) -> str:
    """Return a local directory (or file) holding ``name_or_path``.

    ``name_or_path`` is a local file/directory, or a Hugging Face repo id that must already be
    in the local cache (``HF_HOME``), unless ``GAPLESS_ALLOW_DOWNLOAD=1`` lets the hub fetch it.
    Raises :class:`MissingCheckpointError` when it is not there, :class:`CheckpointError` for any
    other failure (gated or unknown repository, network, a broken cache entry).
    """
    # Over 40 lines as one function: each way a checkpoint can be missing, with its own message.
    if os.path.exists(name_or_path):
        return name_or_path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    allow_download = os.environ.get("GAPLESS_ALLOW_DOWNLOAD", "0") == "1"
    name = repr(name_or_path)
    fetch = fetch_command(name_or_path)
    try:
        return snapshot_download(
            name_or_path, allow_patterns=allow_patterns, local_files_only=not allow_download
        )
    except LocalEntryNotFoundError as exc:  # not in the cache, and no download allowed
        raise MissingCheckpointError(
            f"{what} checkpoint {name} was not found locally (neither a path nor in the Hugging Face "
            f"cache). Fetch it with `{fetch}` (accept its licence on huggingface.co first if it is "
            f"gated), or set GAPLESS_ALLOW_DOWNLOAD=1 to let the server download it, or use the "
            f"tiny profile. {_cause(exc)}"
        ) from exc
    except GatedRepoError as exc:  # before RepositoryNotFoundError: it is a subclass of it
        raise CheckpointError(
            f"{what} checkpoint {name} is gated: accept its licence on https://huggingface.co/{name_or_path}, "
            f"log in with `hf auth login` (or set HF_TOKEN), then fetch it with `{fetch}`. {_cause(exc)}"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise CheckpointError(
            f"{what} checkpoint {name} is neither a local path nor a Hugging Face repository this "
            f"machine can see (a typo, or a private repository: log in with `hf auth login`). {_cause(exc)}"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - network, disk, a broken cache entry: say which
        raise CheckpointError(
            f"{what} checkpoint {name} could not be fetched from the Hugging Face cache"
            f"{' or hub' if allow_download else ''}. Try `{fetch}` to (re)fetch it. {_cause(exc)}"
        ) from exc


@contextmanager
def reading_checkpoint(what: str, name_or_path: str, path: str) -> Iterator[None]:
    """Around the code that reads a checkpoint found by :func:`require_pretrained`: a failure there
    (a truncated or corrupt file, a checkpoint of another architecture) becomes a
    :class:`CheckpointError` that says the checkpoint is there but unreadable."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported with what was being read
        again = (f"fetch it again with `{fetch_command(name_or_path)} --force-download`"
                 if not os.path.exists(name_or_path) else "replace it, or give another path")
        raise CheckpointError(
            f"{what} checkpoint {name_or_path!r} is on this machine ({path}) but could not be loaded "
            f"(a corrupt or partial download, or a checkpoint of another model?): {again}. "
            f"{_cause(exc)}"
        ) from exc


def _cause(exc: BaseException) -> str:
    return f"Cause: {type(exc).__name__}: {exc}"
