"""The adaptive budget's cost model: what a decode step costs on this device, measured, cached, interpolated.

A point is one calibration of a compiled adaptive loop (engine.calibrate): at a batch size B and a mean context L,
the time of an autoregressive step (no drafter) and of each drafting menu budget's whole step, each timed over a few
chunks of the very programs that will decode (one per menu entry; `PolicyState.force` selects one, so calibrating
compiles nothing). With a point it also keeps the calibration run's acceptance (the
policy's bins and predicted tokens per budget), the prior of later runs.

Points are cached per model pair, device, and loop settings in one JSON file under the user's cache directory
($KDTREE_JAX_CACHE, else $XDG_CACHE_HOME/kdtree_jax, else ~/.cache/kdtree_jax), in `cost_models/`. A request at
(B, L) uses a point of the same B within a factor 2 of L when there is one (calibrating otherwise, or when asked);
the costs it gives the loop are interpolated in L between the nearest points of that B (linearly, with the slope
carried into the loop so that a long decode's growing context is priced), extrapolated flat beyond them.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from pathlib import Path
from typing import Optional

import numpy as np

from kdtree_jax.runtime import cache_dir

FORMAT_VERSION = 1
CONTEXT_TOLERANCE = 2.0  # a cached point serves contexts within this factor of its own


def fingerprint(target, drafter, spec) -> dict:
    """What a step's cost depends on besides (B, L): the models, the device, the loop's static settings."""
    import jax

    from kdtree_jax.sharding import layout_of

    mesh = getattr(target, "mesh", None)
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    return {
        "format": FORMAT_VERSION,
        "backend": jax.default_backend(),
        "device": devices[0].device_kind,
        "devices": len(devices),
        "layout": layout_of(target) if mesh is not None else None,  # tp and ep split the step's work differently
        "jax": jax.__version__,
        "target": target.cfg.to_dict() if hasattr(target.cfg, "to_dict") else repr(target.cfg),
        "target_dtype": str(target.dtype),
        "drafter": drafter.cfg.to_dict() if hasattr(drafter.cfg, "to_dict") else repr(drafter.cfg),
        "drafter_dtype": str(getattr(drafter, "dtype", "")),
        "menu": list(spec.menu),
        "topk": spec.topk,
        "sampled": spec.sampled,
        "penalties": spec.penalties,
        "impl": spec.impl,
        "row_invariant": spec.row_invariant,
    }


class CostModel:
    """Measured step costs of one (models, device, loop settings), as calibration points; see the module docstring.

        model = CostModel.load(fingerprint(target, drafter, spec))   # the cached points, if any
        point = model.lookup(batch, context)                         # None: calibrate (engine.calibrate)
        model.add(point); model.save()
        costs = model.costs(batch, context)                          # for budget_policy.init_state
    """

    def __init__(self, key: dict, points: Optional[list] = None, path: Optional[Path] = None):
        self.key = key
        self.points = list(points or [])
        self.path = path

    @staticmethod
    def file_for(key: dict) -> Path:
        digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return cache_dir() / "cost_models" / f"{key.get('backend', 'x')}_{digest}.json"

    @classmethod
    def load(cls, key: dict) -> "CostModel":
        """The cached model for this key (no points when none is cached or the file is unreadable)."""
        path = cls.file_for(key)
        points = []
        try:
            data = json.loads(path.read_text())
            if data.get("key") == json.loads(json.dumps(key, default=str)):
                points = data.get("points", [])
        except (OSError, ValueError):
            pass
        return cls(key, points, path)

    def save(self) -> None:
        """Write the points to the cache (a warning, not an error, when the directory is not writable)."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"key": self.key, "points": self.points}, indent=1, default=str))
            tmp.replace(self.path)
        except OSError as e:
            warnings.warn(f"could not cache the budget cost model at {self.path}: {e}", RuntimeWarning, stacklevel=2)

    def add(self, point: dict) -> None:
        """A new calibration point; it replaces one of the same batch at a context within 10%."""
        self.points = [p for p in self.points
                       if not (p["batch"] == point["batch"] and _close(p["context"], point["context"], 1.1))]
        self.points.append(point)

    def lookup(self, batch: int, context: float) -> Optional[dict]:
        """The cached point of this batch nearest in context, if within CONTEXT_TOLERANCE; else None."""
        same = [p for p in self.points if p["batch"] == batch and _close(p["context"], context, CONTEXT_TOLERANCE)]
        if not same:
            return None
        return min(same, key=lambda p: abs(np.log(max(p["context"], 1) / max(context, 1))))

    def costs(self, batch: int, context: float) -> dict:
        """Step costs at (batch, context) for `budget_policy.init_state`: cost_ar, cost_draft, cost_verify [M],
        cost_slope [M + 1] (ms per context token), context0; with the nearest point's acceptance prior."""
        same = sorted((p for p in self.points if p["batch"] == batch), key=lambda p: p["context"])
        if not same:
            raise ValueError(f"no calibration point for batch {batch}")

        def vector(p):  # menu entries' full step cost (drafter included for entries > 0), then AR
            return np.asarray(p["cost_verify"] + [p["cost_ar"]], np.float64), p["cost_draft"]

        below = [p for p in same if p["context"] <= context]
        above = [p for p in same if p["context"] > context]
        nearest = min(same, key=lambda p: abs(p["context"] - context))
        if below and above:
            lo, hi = below[-1], above[0]
        elif len(same) >= 2:
            lo, hi = (same[-2], same[-1]) if not above else (same[0], same[1])
        else:
            lo = hi = nearest
        v_lo, d_lo = vector(lo)
        v_hi, d_hi = vector(hi)
        span = hi["context"] - lo["context"]
        slope = (v_hi - v_lo) / span if span > 0 else np.zeros_like(v_lo)
        slope = np.maximum(slope, 0.0)  # a step never gets cheaper with more context; noise says otherwise
        if lo is not hi and lo["context"] <= context <= hi["context"]:
            at = v_lo + slope * (context - lo["context"])
            draft = d_lo + (d_hi - d_lo) * (context - lo["context"]) / span
        else:  # flat outside the measured range, from the nearest point (the slope still prices growth)
            at, draft = vector(nearest)
        return {"cost_ar": float(at[-1]), "cost_draft": float(max(draft, 0.0)),
                "cost_verify": at[:-1].tolist(), "cost_slope": slope.tolist(), "context0": float(context),
                "bin_ratio": nearest.get("bin_ratio"), "expected": nearest.get("expected"),
                "slowest": nearest.get("slowest")}


def _close(a: float, b: float, factor: float) -> bool:
    a, b = max(float(a), 1.0), max(float(b), 1.0)
    return max(a, b) / min(a, b) <= factor


def make_point(batch: int, context: float, menu, step_ms: dict, *, bin_ratio=None, expected=None, slowest=None,
               steps: int = 0) -> dict:
    """A calibration point from measured step times: step_ms["ar"] (an autoregressive step, no drafter) and
    step_ms[i] for each drafting menu entry i (its whole step, the drafter included: cost_draft is 0 and a budget 0
    entry costs the autoregressive step). Entries not measured (None: pruned as unable to beat autoregressive
    decoding even if every drafted token were accepted) cost +inf."""
    ar = float(step_ms["ar"])
    draft = 0.0
    verify = []
    for i, b in enumerate(menu):
        t = step_ms.get(i)
        if b == 0:
            verify.append(ar)
        elif t is None:
            verify.append(1e30)
        else:
            verify.append(max(float(t), 1e-6))
    return {"batch": int(batch), "context": float(context), "cost_ar": ar, "cost_draft": draft,
            "cost_verify": verify, "measured_ms": {str(k): v for k, v in step_ms.items()},
            "bin_ratio": None if bin_ratio is None else [float(x) for x in bin_ratio],
            "expected": None if expected is None else [float(x) for x in expected],
            "slowest": None if slowest is None else [float(x) for x in slowest],
            "steps_per_timing": int(steps), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
