import atexit
import gc
import os
import shutil
import subprocess
import sys
import tempfile

# Eight CPU devices for the sharding tests; must be set before jax is imported anywhere.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = (_flags + " --xla_force_host_platform_device_count=8").strip()


# XLA:CPU compiled for compile time: LLVM at -O0 and the legacy elemental emitters instead of the MLIR fusion
# emitters (at -O0 those still run their own optimization pipeline). The suite compiles ~3,400 programs and most
# run a few steps on tiny models, so compiling was over half of a CI run: a tiny DDTree decode loop's compiles
# took 6.3 -> 1.7 s, a whole run 1,298 -> 748 s, every test passing (the bit-for-bit ones too: both sides of each
# comparison are compiled alike). The programs run slower (bfloat16 default-pair loops ~3x: the few runtime-bound
# tests are marked `xla_optimized`, below). Children (the CLI tests' processes) inherit the flags. Neither option
# is added when the user's XLA_FLAGS name either, or with a CUDA plugin installed (-O0 would apply to GPU kernels'
# code generation too).
def _cuda_plugin_installed() -> bool:
    from importlib import metadata

    names = ((d.metadata["Name"] or "").lower() for d in metadata.distributions())
    return any(name.startswith(("jax-cuda", "jax_cuda")) for name in names)


FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
FAST_COMPILE = not _cuda_plugin_installed() and not any(f.split("=")[0] in _flags for f in FAST_COMPILE_FLAGS)
if FAST_COMPILE:
    _flags += " " + " ".join(FAST_COMPILE_FLAGS)
# The CPU flags kdtree_jax.runtime.configure() sets (the CLI's and the server's processes set them), so that the
# suite's own process and the children it starts compile alike.
def _runtime_module():
    """kdtree_jax/runtime.py by its path: importing the package would import jax before XLA_FLAGS are final."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kdtree_jax", "runtime.py")
    spec = importlib.util.spec_from_file_location("_kdtree_jax_runtime_flags", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_flags += " " + " ".join(_runtime_module().cpu_flags(_flags))
os.environ["XLA_FLAGS"] = _flags.strip()

# One persistent compilation cache per test session, in a fresh temporary directory (removed at exit; never a
# directory from an earlier run, so a fresh CI clone and a local run behave alike). Identical programs compiled
# again by another jit object, another test or a child process (the CLI tests run `python -m kdtree_jax.generate`;
# the children inherit the variables) are read back instead of compiled. A child pytest reuses its parent's.
SESSION_CACHE = "KDTREE_JAX_TEST_COMPILATION_CACHE"
if not os.environ.get(SESSION_CACHE):
    os.environ[SESSION_CACHE] = tempfile.mkdtemp(prefix="kdtree_jax_test_xla_cache_")
    atexit.register(shutil.rmtree, os.environ[SESSION_CACHE], True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[SESSION_CACHE]
# The adaptive budget's measured cost models (kdtree_jax/speculative/cost_model.py) go to this session's directory,
# never the user's cache: every run measures its own, as a fresh clone does.
os.environ["KDTREE_JAX_CACHE"] = os.path.join(os.environ[SESSION_CACHE], "kdtree_jax_cache")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# Tests marked `xla_optimized` are runtime-bound (the bfloat16 default pair's row-invariant loops): their programs
# compile with XLA's default optimization, the two fast-compile options back at their defaults as per-compile
# overrides (what jax.jit(compiler_options=...) passes). JAX's caches are cleared whenever the mode changes, so no
# executable compiled in one mode serves a test of the other (the persistent cache's keys hold the overrides).
OPTIMIZED_OVERRIDES = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
_optimized = False


def _compile_optimized_when_marked():
    try:  # jax's internal: without it the marked tests run fast-compiled too (slower, same checks)
        from jax._src import compiler

        get_compile_options = compiler.get_compile_options
    except (ImportError, AttributeError):
        return

    def compile_options(*args, env_options_overrides=None, **kwargs):
        if _optimized:
            env_options_overrides = {**OPTIMIZED_OVERRIDES, **(env_options_overrides or {})}
        return get_compile_options(*args, env_options_overrides=env_options_overrides, **kwargs)

    compiler.get_compile_options = compile_options


if FAST_COMPILE:
    _compile_optimized_when_marked()


@pytest.fixture(autouse=True)
def _xla_optimized_when_marked(request):
    global _optimized
    want = FAST_COMPILE and request.node.get_closest_marker("xla_optimized") is not None
    if want != _optimized:
        from kdtree_jax.speculative import engine

        engine.clear_loops()  # their programs were compiled with the other options
        jax.clear_caches()
        _optimized = want
    yield


# XLA:CPU maps each executable it loads into a few memory mappings of its own (code, read-only and writable
# data: ~900 for one tiny-model decode loop), held for as long as JAX's caches hold the executable. A full-suite
# process compiles thousands of programs; once it reaches vm.max_map_count (65530 by default) an mmap inside the
# next compile fails and XLA:CPU segfaults (seen compiling tests/test_sharding.py's sharded decode loop, ~55% into
# the suite; reproduced alone by filling the map table first). After each test module, a process past half the
# limit drops JAX's caches: the executables and their mappings are freed, and what runs again is read back from
# the session's compilation cache above.
def memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:  # not Linux
        return 0


def max_memory_maps() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


def release_executables_if_many_maps(limit=None) -> bool:
    """Clear JAX's caches when the process holds more than `limit` (default: half of vm.max_map_count) memory
    mappings; True if it did."""
    if memory_maps() <= (max_memory_maps() // 2 if limit is None else limit):
        return False
    from kdtree_jax.speculative import engine

    engine.clear_loops()  # the chunked loops generate keeps hold their programs
    jax.clear_caches()
    gc.collect()
    return True


@pytest.fixture(autouse=True, scope="module")
def _bounded_memory_maps():
    yield
    release_executables_if_many_maps()


# Tests marked `slow` are deselected in a local run; CI runs them (.ci/run sets KDTREE_JAX_SLOW=1, as does any
# environment with CI set), and so does a run that names them (`-m slow`, or KDTREE_JAX_SLOW=1 by hand).
RUN_SLOW = bool(os.environ.get("KDTREE_JAX_SLOW") or os.environ.get("CI"))


def run_compute_sanitizer(tool: str, script: str, kernel_name: str) -> tuple[int, str]:
    """(exit status, output) of `python -c script` under compute-sanitizer's `tool` (exit status 3 on an error it
    finds); racecheck (shared-memory hazards) and synccheck (barrier misuse) instrument only the kernels whose names
    hold `kernel_name` (ours), memcheck every kernel. JAX allocates on demand, so the sanitizer sees real bounds."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    only_ours = ["--kernel-name", f"kns={kernel_name}"] if tool in ("racecheck", "synccheck") else []
    res = subprocess.run(["compute-sanitizer", "--tool", tool, "--error-exitcode", "3", *only_ours,
                          sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    return res.returncode, res.stdout + res.stderr


# What each tool prints when it found nothing (racecheck has a summary line of its own; memcheck and synccheck share one).
SANITIZER_CLEAN = {"memcheck": "ERROR SUMMARY: 0 errors", "synccheck": "ERROR SUMMARY: 0 errors",
                   "racecheck": "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"}


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
