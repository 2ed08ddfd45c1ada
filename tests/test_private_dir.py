"""The compile cache and the metrics directory are used only when they are this user's alone
(pipeline/runtime/private_dir.py): a stranger's directory under /tmp is never loaded from."""
from __future__ import annotations

import os

import pytest

from pipeline import metrics

from pipeline.runtime import compile_cache

from pipeline.runtime import private_dir
from pipeline.runtime.private_dir import NotPrivate, ensure_private_dir


def test_a_missing_directory_is_made_private(tmp_path):
    path = ensure_private_dir(str(tmp_path / "cache" / "root"))
    assert os.stat(path).st_mode & 0o077 == 0


def test_a_strangers_directory_is_refused(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    monkeypatch.setattr(private_dir.os, "geteuid", lambda: os.stat(theirs).st_uid + 1)  # we are someone else
    with pytest.raises(NotPrivate, match="belongs to another user"):
        ensure_private_dir(str(theirs))


def test_a_directory_others_may_write_and_a_symlink_are_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(NotPrivate, match="written by other users"):
        ensure_private_dir(str(shared))
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(mine)
    with pytest.raises(NotPrivate, match="not a directory"):
        ensure_private_dir(str(tmp_path / "link"))


class Cfg:
    compile = True


def test_a_compile_cache_a_stranger_owns_is_not_loaded(tmp_path, monkeypatch):
    """A planted cache root: warm_start runs the plain load (no cache activated, nothing read)."""
    root = tmp_path / "planted"
    root.mkdir(mode=0o700)
    monkeypatch.setattr(private_dir.os, "geteuid", lambda: os.stat(root).st_uid + 1)
    load = lambda: "engine"  # noqa: E731
    assert compile_cache.warm_start("tts", Cfg(), load, root=str(root)) is load
    monkeypatch.undo()
    assert compile_cache.warm_start("tts", Cfg(), load, root=str(root)) is not load  # ours: used


def test_the_metrics_directory_must_be_private(tmp_path):
    shared = tmp_path / "metrics"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "stale.db").write_bytes(b"")
    with pytest.raises(NotPrivate):
        metrics.prepare_multiproc_dir(str(shared))
    assert (shared / "stale.db").exists()  # nothing touched
    shared.chmod(0o700)
    metrics.prepare_multiproc_dir(str(shared))
    assert not (shared / "stale.db").exists()
