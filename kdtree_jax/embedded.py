"""The embedded default pair: the small trained target, drafter and tokenizer that kdtree-jax ships.

checkpoints/README.md says how it was trained and what it decodes like.

    import kdtree_jax
    target, drafter, tokenizer = kdtree_jax.load_checkpoint(kdtree_jax.default_checkpoint())

A wheel (`pip install .`) carries the pair inside the package, in kdtree_jax/checkpoints/default (ffi/CMakeLists.txt
installs it there); an editable install (`pip install -e .`) or a source checkout reads the repository's
checkpoints/default in place. Either way the path does not depend on the working directory.
"""

from __future__ import annotations

import os

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_PLACES = (
    os.path.join(_PACKAGE, "checkpoints", "default"),  # a wheel
    os.path.join(os.path.dirname(_PACKAGE), "checkpoints", "default"),  # a checkout: editable install, or no install
)
_MARKER = "kdtree_checkpoint.json"  # save_checkpoint writes it last: a directory without it is not a whole pair


def default_checkpoint(required: bool = True) -> str | None:
    """The embedded default pair's directory (absolute), for `load_checkpoint` or `--checkpoint`.

    Where this install carries no pair: FileNotFoundError saying where it looked, or None with required=False."""
    for place in _PLACES:
        if os.path.isfile(os.path.join(place, _MARKER)):
            return place
    if not required:
        return None
    raise FileNotFoundError(f"the embedded default pair is missing (no {_MARKER} in {' or '.join(_PLACES)}): "
                            "reinstall kdtree-jax from a checkout that has checkpoints/default, or pass "
                            "--checkpoint DIR")
