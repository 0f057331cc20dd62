"""Which code produced a result: the commit stamp that training runs and benchmarks write beside their numbers."""

from __future__ import annotations

import os
import subprocess
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit(short: bool = True) -> str:
    """$KDTREE_COMMIT when set (a copy of the tree on a device machine can carry stale git metadata, so the
    caller passes the real commit in), else git's HEAD, with "+dirty" when tracked files have changes."""
    if os.environ.get("KDTREE_COMMIT"):
        return os.environ["KDTREE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", *(["--short"] if short else []), "HEAD"], cwd=_ROOT,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                               capture_output=True, text=True).stdout.strip()
        return (head or "unknown") + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def smoke_dir(name: str) -> str:
    """A fresh temporary directory for a benchmark's --smoke files (tiny configs, not results): a smoke run
    never writes into the repository, wherever it is run from. Scripts print where they wrote."""
    return tempfile.mkdtemp(prefix=f"{name}_smoke_")
