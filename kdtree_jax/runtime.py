"""What the decode loop needs from XLA, set before JAX starts its backends: `configure()`.

On a GPU, XLA runs a `lax.while_loop` from the host unless a command buffer captures it: every iteration it copies
the loop's predicate to the host and launches the body's kernels again, one host round trip per decode step. With
command buffers for WHILE and CONDITIONAL, XLA records the loop as one CUDA graph with conditional nodes, and the
steps of a chunk (kdtree_jax.speculative.engine.ChunkedLoop) run without the host. XLA reads its flags once, when
the first backend starts (the first array or computation, not `import jax`), so:

    import kdtree_jax.runtime
    kdtree_jax.runtime.configure()   # before the first JAX computation of the process
    import kdtree_jax                 # ... and use it as usual

The package's entry points (`python -m kdtree_jax.generate`, the benchmarks) call it themselves. On a CPU it turns
off XLA's YNNPACK library fusions (CPU_FLAGS: XLA's own dots were up to 1.6x faster for the decode loop's few-row
products; the GPU flags concern only the GPU compiler). It leaves XLA_FLAGS alone if they already choose command buffers
(`--xla_gpu_enable_command_buffer`), and adds no command buffers with KDTREE_JAX_COMMAND_BUFFERS=0. It also turns on
programmatic dependent launch (`--xla_gpu_enable_pdl=true`, LAUNCH_FLAGS) unless XLA_FLAGS name it.

`configure(row_invariant=True)` also sets the flags a row-invariant decode needs (greedy speculative output bit for
bit the autoregressive one, SpecConfig.row_invariant; kdtree_jax/model/row_invariant.py): Triton GEMMs and GEMM
autotuning off (XLA then takes cuBLAS's heuristic algorithm for a shape instead of timing candidates per row count)
and no excess precision (XLA otherwise keeps bfloat16 intermediates in float32 inside its fusions, and where it fuses
depends on the shapes; this one also applies on a CPU). These slow every program of the process, so they are opt-in;
`row_invariant_configured()` says whether they are in effect.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path

# XLA's command-buffer types: the default set (fusions, cuBLAS/cuBLASLt calls, custom calls such as the verify
# kernel and the expert MLP, both marked command-buffer compatible) plus control flow. min_graph_size 1: capture
# even a loop body of one kernel (the default, 5, leaves small programs to the host).
COMMAND_BUFFER_TYPES = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "WHILE", "CONDITIONAL")
COMMAND_BUFFER_FLAGS = (f"--xla_gpu_enable_command_buffer={','.join(COMMAND_BUFFER_TYPES)} "
                        "--xla_gpu_graph_min_graph_size=1")
ENV_SWITCH = "KDTREE_JAX_COMMAND_BUFFERS"
ROW_INVARIANT_FLAGS = (("xla_gpu_enable_triton_gemm", "false"), ("xla_gpu_autotune_level", "0"),
                       ("xla_allow_excess_precision", "false"))
# Programmatic dependent launch (a Hopper-and-later feature; only an H200 was at hand to check it): a kernel may start
# while the one before it finishes and waits only where it reads that kernel's results, which hides most of the ~1 us gap
# between dependent kernels of a CUDA graph. A decode step is ~900 small kernels: on the H200 the Kimi-K2 TP8-rank
# step (25 layers, 64k) went 4.63 -> 4.26 ms at T = 1 and 9.33 -> 9.12 ms at T = 9 with it (bb6a90d,
# benchmarks/results/history/decode_context_h200_25layers_64k_pdl_ab_bb6a90d_{nopdl,pdl}.md). The verify kernels and the
# MoE ops' kernels take part (ffi/pdl.cuh; the MoE ops since 23f2872: the K2 step at T = 9 -0.32 ms,
# benchmarks/results/history/k2_step_ab_h200_session20.md); the top-k kernel launches plainly.
LAUNCH_FLAGS = (("xla_gpu_enable_pdl", "true"),)
# XLA aborts on a flag it does not know; 0.10.2 is the oldest jaxlib checked to have this one (pyproject allows 0.10).
LAUNCH_FLAGS_SINCE = (0, 10, 2)
# XLA:CPU hands dots, reductions and element-wise ops to YNNPACK "library fusions" (jaxlib 0.10.2's default), which on
# this project's 2-core CPU ran the products of a few rows several times slower than XLA's own dots: the default pair
# (float32, 16 prompts x 64 tokens, two alternating rounds, ebefe8f) decoded autoregressively at batch 1 235 / 261 ->
# 275 / 260 tok/s and at batch 16 782 / 587 -> 988 / 960, DDTree 4 143 / 116 -> 192 / 193 and 382 / 303 -> 457 / 465
# with them off (benchmarks/results/history/cpu_ynn_fusions_ab.md). The empty list turns them off. Only for the jaxlib
# versions checked to know the flag ([since, before)): it is an experimental one, and XLA aborts on a flag it does not
# know.
CPU_FLAGS = (("xla_cpu_experimental_ynn_fusion_type", ""),)
CPU_FLAGS_JAXLIB = ((0, 10, 2), (0, 11))


def _jaxlib_version() -> tuple:
    """jaxlib's version as a tuple of ints, read without starting a backend ((0,) if unknown)."""
    try:
        from importlib.metadata import version
        return tuple(int(p) for p in re.findall(r"\d+", version("jaxlib"))[:3])
    except Exception:  # noqa: BLE001 - not installed as a distribution: assume the oldest
        return (0,)


def cpu_flags(flags: str) -> list[str]:
    """The CPU_FLAGS that XLA_FLAGS `flags` do not name yet, where this jaxlib is one checked to know them."""
    since, before = CPU_FLAGS_JAXLIB
    if not since <= _jaxlib_version() < before:
        return []
    return [f"--{name}={value}" for name, value in CPU_FLAGS if not _flag_values(name, flags)]


def _flag_values(name: str, flags: str) -> list[str]:
    """The values XLA_FLAGS give `--name` (`--name=v`; a bare `--name` counts as "true"), in order."""
    return [m.group(1) if m.group(1) is not None else "true"
            for m in re.finditer(rf"--{re.escape(name)}(?:=(\S*))?(?=\s|$)", flags)]


def cache_dir() -> Path:
    """This project's cache directory: $KDTREE_JAX_CACHE, else $XDG_CACHE_HOME/kdtree_jax, else ~/.cache/kdtree_jax
    (the cost models, cost_model.py; the command lines' compiled programs, `use_compilation_cache`)."""
    root = os.environ.get("KDTREE_JAX_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kdtree_jax"


# Programs that compile faster than this are not worth a file each (JAX's default is 1 s; on the 2-core CPU the CLI's
# run of the embedded pair took 10.8 s uncached, 7.4 s with JAX's default and 6.0 s with every program cached).
CACHE_MIN_COMPILE_S = 0.2


def use_compilation_cache() -> str:
    """Turn on JAX's persistent compilation cache for this process under cache_dir()/jax_compilation_cache, so that
    the next run of `python -m kdtree_jax.generate` or `python -m kdtree_jax.serve` reads its compiled programs back
    instead of compiling them again. The user's own cache wins: with JAX_COMPILATION_CACHE_DIR (or
    jax_compilation_cache_dir) set, that directory stays. Call it before the first compile. -> the directory."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    path = str(cache_dir() / "jax_compilation_cache")
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_S)
    return path


def backends_started() -> bool:
    """Whether JAX has started a backend in this process (after which XLA_FLAGS are no longer read)."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(bridge is not None and bridge.backends_are_initialized())


def configure(command_buffers: bool | None = None, row_invariant: bool = False, overlap_launches: bool = True) -> bool:
    """Set XLA_FLAGS so that the decode loop's while loop runs inside a command buffer on a GPU, with
    `overlap_launches` programmatic dependent launch (LAUNCH_FLAGS), and with `row_invariant` the flags a
    row-invariant decode needs (ROW_INVARIANT_FLAGS); on a CPU, XLA's YNNPACK fusions off (CPU_FLAGS, `cpu_flags`).
    Call it before the process's first JAX computation.
    command_buffers: None reads KDTREE_JAX_COMMAND_BUFFERS (default on); False leaves XLA_FLAGS' command buffers as
    they are. A flag XLA_FLAGS already name is the user's choice and left alone. Returns whether the command-buffer
    flags are in XLA_FLAGS now (set here or before)."""
    if command_buffers is None:
        command_buffers = os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")
    flags = os.environ.get("XLA_FLAGS", "")
    users_buffers = "--xla_gpu_enable_command_buffer" in flags  # the user's own choice wins
    add = [COMMAND_BUFFER_FLAGS] if command_buffers and not users_buffers else []
    if overlap_launches and _jaxlib_version() >= LAUNCH_FLAGS_SINCE:
        add += [f"--{name}={value}" for name, value in LAUNCH_FLAGS if not _flag_values(name, flags)]
    if row_invariant:
        add += [f"--{name}={value}" for name, value in ROW_INVARIANT_FLAGS if not _flag_values(name, flags)]
    add += cpu_flags(flags)
    if add and backends_started():
        warnings.warn("kdtree_jax.runtime.configure() ran after JAX started its backends: XLA has read its flags "
                      "already, so on a GPU a decode loop may copy its predicate to the host every step"
                      + (" and rows may depend on the pass's row count" if row_invariant else "")
                      + "; call it before the first JAX computation", RuntimeWarning, stacklevel=2)
        return bool(command_buffers and users_buffers and command_buffers_configured())
    if add:
        os.environ["XLA_FLAGS"] = " ".join([flags] + add).strip()
    if not command_buffers:
        return False
    return command_buffers_configured() if users_buffers else True


def command_buffers_configured() -> bool:
    """Whether XLA_FLAGS let a command buffer capture while loops (what XLA read, if its backend has started
    since XLA_FLAGS last changed)."""
    match = re.findall(r"--xla_gpu_enable_command_buffer=(\S*)", os.environ.get("XLA_FLAGS", ""))
    return bool(match) and "WHILE" in match[-1].upper().split(",")


def row_invariant_configured() -> bool:
    """Whether XLA_FLAGS hold every flag of ROW_INVARIANT_FLAGS with its value (what XLA read, if its backend has
    started since XLA_FLAGS last changed)."""
    flags = os.environ.get("XLA_FLAGS", "")
    for name, value in ROW_INVARIANT_FLAGS:
        given = _flag_values(name, flags)
        if not given or given[-1].lower() not in ((value, "0") if value == "false" else (value,)):
            return False
    return True


def host_driven_loops(hlo_text: str, configured: bool | None = None) -> int | None:
    """While loops of a compiled program (`Compiled.as_text()`) that no command buffer captures, or None when the
    text cannot say. On a GPU each such loop runs from the host, its predicate copied to the host every iteration.
    XLA versions that form command buffers as an HLO pass outline a captured loop into a computation named
    `command_buffer...` (or called by an instruction of that name), and those are counted here. Newer ones (jaxlib
    0.11) convert the program's thunks after the HLO: their text shows no command buffer at all even where the loop
    is captured (on an H200 XLA's log said "WhileThunk: while.22" for the engine's chunk loop, whose HLO has no
    command_buffer), so a text without one, from a process that asked for loop capture (`configured`, default
    `command_buffers_configured()`), gives None. On a CPU every loop counts (the CPU runs them from the host, in host
    memory, where that costs nothing)."""
    if configured is None:
        configured = command_buffers_configured()
    if configured and "command_buffer" not in hlo_text:
        return None
    computations, current = {}, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$", line)
        if header:
            current = computations.setdefault(header.group(1), [])
        elif current is not None and line.strip() and line.strip() != "}":
            current.append(line)
    calls = {name: set() for name in computations}
    roots, loops = set(), []
    for name, lines in computations.items():
        if name.startswith("command_buffer"):
            roots.add(name)
        for line in lines:
            called = set(re.findall(r"(?:to_apply|body|condition|calls)=%?([\w.\-]+)", line))
            for group in re.findall(r"(?:branch_computations|called_computations)=\{([^}]*)\}", line):
                called |= {c.strip().lstrip("%") for c in group.split(",") if c.strip()}
            calls[name] |= called
            instr = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
            if instr and instr.group(1).startswith("command_buffer"):
                roots |= called
            if re.search(r"\swhile\(", line) and "body=" in line:
                loops.append(name)
    captured, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name not in captured:
            captured.add(name)
            stack.extend(calls.get(name, ()))
    return sum(1 for name in loops if name not in captured)
