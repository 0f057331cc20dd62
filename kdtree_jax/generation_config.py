"""A checkpoint's recommended sampling settings, as Hugging Face's generation_config.json holds them.

A checkpoint directory may carry a generation_config.json beside its weights:

    {"do_sample": true, "temperature": 0.7, "top_p": 0.95, "top_k": 0, "repetition_penalty": 1.1}

The command line and the server start from these values and let the user override each one (a flag, or a request's
field). Keys read: temperature, top_p, top_k, repetition_penalty, presence_penalty, frequency_penalty, and
do_sample (false: greedy, whatever temperature says, as in Hugging Face). Other keys (max_length, eos_token_id, ...)
are ignored. No file: greedy without penalties (SamplingParams' defaults).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from kdtree_jax.speculative.sampling import SamplingParams

FILENAME = "generation_config.json"
KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def load(checkpoint: Optional[str]) -> dict:
    """The settings a checkpoint recommends ({} when it has no generation_config.json): a subset of KEYS, checked.
    A file that is not a JSON object of valid settings: ValueError naming the file."""
    if not checkpoint:
        return {}
    path = os.path.join(checkpoint, FILENAME)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object; got {type(raw).__name__}")
    values = {k: raw[k] for k in KEYS if raw.get(k) is not None}
    if raw.get("do_sample") is False:
        values["temperature"] = 0.0
    try:
        SamplingParams(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    return values


def resolve(recommended: dict, **given) -> SamplingParams:
    """The settings to use: each of `given` (keyword per KEYS) that is not None, else the checkpoint's recommendation
    (`load`), else the default. Raises ValueError on an invalid value."""
    unknown = set(given) - set(KEYS)
    if unknown:
        raise TypeError(f"unknown sampling settings: {sorted(unknown)}")
    return SamplingParams(**{**recommended, **{k: v for k, v in given.items() if v is not None}})


__all__ = ["FILENAME", "KEYS", "load", "resolve"]
