"""The commit stamp written beside training runs and benchmark results."""

import re

from kdtree_jax.provenance import git_commit


def test_environment_names_the_commit(monkeypatch):
    monkeypatch.setenv("KDTREE_COMMIT", "abc1234")
    assert git_commit() == "abc1234" and git_commit(short=False) == "abc1234"


def test_git_head_otherwise(monkeypatch):
    monkeypatch.delenv("KDTREE_COMMIT", raising=False)
    short, full = git_commit(), git_commit(short=False)
    assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?|unknown", short)
    if short != "unknown":
        assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", full) and full.startswith(short.split("+")[0])
