import os

# Eight CPU devices for the sharding tests; must be set before jax is imported anywhere.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# Tests marked `slow` are deselected in a local run; CI runs them (.ci/run sets KDTREE_JAX_SLOW=1, as does any
# environment with CI set), and so does a run that names them (`-m slow`, or KDTREE_JAX_SLOW=1 by hand).
RUN_SLOW = bool(os.environ.get("KDTREE_JAX_SLOW") or os.environ.get("CI"))


def pytest_collection_modifyitems(config, items):
    if not RUN_SLOW and "slow" not in (config.getoption("markexpr") or ""):
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]
    has_gpu = jax.default_backend() == "gpu"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
