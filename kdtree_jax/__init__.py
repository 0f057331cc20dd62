"""kdtree-jax: DDTree speculative decoding for MLA/MoE models (Kimi K2, DeepSeek-V3) in JAX.

The public API (DESIGN.md, "Public API"); README, tests and benchmarks use these names.
"""

from kdtree_jax import runtime  # runtime.configure(): before the first JAX computation (README, "Device-resident loop")
from kdtree_jax.checkpoint import load_checkpoint, load_sharded, save_checkpoint
from kdtree_jax.config import ModelConfig, RopeScaling
from kdtree_jax.decode import decode_step, forward_logits, init_model, prefill
from kdtree_jax.embedded import default_checkpoint
from kdtree_jax.kv_pool import KVCache, PoolExhaustedError, init_cache
from kdtree_jax.model.drafter import DrafterConfig, init_drafter
from kdtree_jax.ops import verify_attention
from kdtree_jax.sharding import make_mesh, shard_model
# `kdtree_jax.generate` is this function; importing the CLI submodule of the same name rebinds it to
# that module, which is callable with the same arguments (see generate.py).
from kdtree_jax.speculative.engine import GenerateResult, generate

__all__ = [
    "ModelConfig",
    "RopeScaling",
    "load_hf",
    "load_checkpoint",
    "save_checkpoint",
    "default_checkpoint",
    "init_model",
    "forward_logits",
    "prefill",
    "decode_step",
    "verify_attention",
    "KVCache",
    "init_cache",
    "PoolExhaustedError",
    "DrafterConfig",
    "init_drafter",
    "generate",
    "GenerateResult",
    "make_mesh",
    "shard_model",
    "load_sharded",
    "runtime",
]


def __getattr__(name):
    # Imported on first use so that `python -m kdtree_jax.convert_hf` does not find its own module
    # already imported by the package (runpy warns about that).
    if name == "load_hf":
        from kdtree_jax.convert_hf import load_hf

        return load_hf
    raise AttributeError(f"module 'kdtree_jax' has no attribute {name!r}")
