"""Directories only this user may write: the compile cache (whose pickled artifacts and compiled
kernels a process loads and runs) and the metrics directory (whose files every process of the app
writes and the scrape reads).

Both live under /tmp by default, where anyone can create a path first. A directory is used only
if it is a real directory (not a symlink), owned by this user, and writable by nobody else; one
that does not exist yet is made with mode 0700.
"""
from __future__ import annotations

import os
import stat


class NotPrivate(Exception):
    """The directory is not this user's alone: ``str()`` says why and what to do."""


def ensure_private_dir(path: str) -> str:
    """Make ``path`` (mode 0700) if it is missing, and check it is this user's alone; returns
    it, or raises NotPrivate."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NotPrivate(f"{path} is not a directory (a symlink or a file): remove it or choose another path")
    if st.st_uid != os.geteuid():
        raise NotPrivate(f"{path} belongs to another user (uid {st.st_uid}, this process runs as {os.geteuid()}): "
                         "choose a path of your own")
    if st.st_mode & 0o022:
        raise NotPrivate(f"{path} may be written by other users (mode {stat.S_IMODE(st.st_mode):03o}): "
                         f"`chmod go-w {path}` or choose another path")
    return path
