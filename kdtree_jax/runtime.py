"""What the decode loop needs from XLA, set before JAX starts its backends: `configure()`.

On a GPU, XLA runs a `lax.while_loop` from the host unless a command buffer captures it: every iteration it copies
the loop's predicate to the host and launches the body's kernels again, one host round trip per decode step. With
command buffers for WHILE and CONDITIONAL, XLA records the loop as one CUDA graph with conditional nodes, and the
steps of a chunk (kdtree_jax.speculative.engine.ChunkedLoop) run without the host. XLA reads its flags once, when
the first backend starts (the first array or computation, not `import jax`), so:

    import kdtree_jax.runtime
    kdtree_jax.runtime.configure()   # before the first JAX computation of the process
    import kdtree_jax                 # ... and use it as usual

The package's entry points (`python -m kdtree_jax.generate`, the benchmarks) call it themselves. It changes nothing
on a CPU (the flags only concern the GPU compiler), leaves XLA_FLAGS alone if they already choose command buffers
(`--xla_gpu_enable_command_buffer`), and does nothing with KDTREE_JAX_COMMAND_BUFFERS=0.

It also sets the GEMM flags of issue 24 (row-invariant GEMMs): `--xla_gpu_enable_triton_gemm=false
--xla_gpu_autotune_level=0` (ROW_INVARIANT_GEMM_FLAGS), each unless XLA_FLAGS already name that flag. With them, and
the target's dense products on rows padded to a multiple of 64 (kdtree_jax/model/row_invariant.py), a token's row of
a product is bit for bit the same whatever the row count of the pass (H200, jax 0.11.2: every shape and row count
tried; neither alone did): the verify pass then computes each row as the one-token step does, which greedy
speculative decoding needs to equal autoregressive decoding. Off: configure(row_invariant_gemms=False) or
KDTREE_JAX_ROW_INVARIANT_GEMMS=0; `row_invariant_gemms_configured()` says whether they are in effect.
"""

from __future__ import annotations

import os
import re
import sys
import warnings

# XLA's command-buffer types: the default set (fusions, cuBLAS/cuBLASLt calls, custom calls such as the verify
# kernel and the expert MLP, both marked command-buffer compatible) plus control flow. min_graph_size 1: capture
# even a loop body of one kernel (the default, 5, leaves small programs to the host).
COMMAND_BUFFER_TYPES = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "WHILE", "CONDITIONAL")
COMMAND_BUFFER_FLAGS = (f"--xla_gpu_enable_command_buffer={','.join(COMMAND_BUFFER_TYPES)} "
                        "--xla_gpu_graph_min_graph_size=1")
ENV_SWITCH = "KDTREE_JAX_COMMAND_BUFFERS"

# Issue 24: GEMMs whose rows do not depend on the row count (with the model's row padding). Triton GEMMs off: XLA
# calls cuBLAS; autotuning off: XLA takes cuBLAS's heuristic algorithm for the shape instead of timing candidates
# per M (which picked different algorithms, and so reduction orders, for different row counts).
ROW_INVARIANT_GEMM_FLAGS = (("xla_gpu_enable_triton_gemm", "false"), ("xla_gpu_autotune_level", "0"))
GEMM_ENV_SWITCH = "KDTREE_JAX_ROW_INVARIANT_GEMMS"


def _switch(value: bool | None, env: str) -> bool:
    if value is None:
        return os.environ.get(env, "1").strip().lower() not in ("0", "false", "no", "off")
    return bool(value)


def _flag_values(name: str, flags: str) -> list[str]:
    """The values XLA_FLAGS give `--name` (`--name=v`; a bare `--name` counts as "true"), in order."""
    return [m.group(1) if m.group(1) is not None else "true"
            for m in re.finditer(rf"--{re.escape(name)}(?:=(\S*))?(?=\s|$)", flags)]


def backends_started() -> bool:
    """Whether JAX has started a backend in this process (after which XLA_FLAGS are no longer read)."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(bridge is not None and bridge.backends_are_initialized())


def configure(command_buffers: bool | None = None, row_invariant_gemms: bool | None = None) -> bool:
    """Set XLA_FLAGS so that the decode loop's while loop runs inside a command buffer on a GPU, and (issue 24) so
    that XLA's GEMMs are row-invariant with the model's row padding. Call it before the process's first JAX
    computation. command_buffers: None reads KDTREE_JAX_COMMAND_BUFFERS (default on); row_invariant_gemms: None
    reads KDTREE_JAX_ROW_INVARIANT_GEMMS (default on); False leaves those flags as XLA_FLAGS have them. A flag that
    XLA_FLAGS already name is the user's choice and left alone. Returns whether the command-buffer flags are in
    XLA_FLAGS now (set here or before); `row_invariant_gemms_configured()` says the same of the GEMM flags."""
    command_buffers = _switch(command_buffers, ENV_SWITCH)
    row_invariant_gemms = _switch(row_invariant_gemms, GEMM_ENV_SWITCH)
    flags = os.environ.get("XLA_FLAGS", "")
    add = []
    users_buffers = "--xla_gpu_enable_command_buffer" in flags  # the user's own choice wins
    if command_buffers and not users_buffers:
        add.append(COMMAND_BUFFER_FLAGS)
    if row_invariant_gemms:
        add += [f"--{name}={value}" for name, value in ROW_INVARIANT_GEMM_FLAGS if not _flag_values(name, flags)]
    if add and backends_started():
        warnings.warn("kdtree_jax.runtime.configure() ran after JAX started its backends: XLA has read its flags "
                      "already, so on a GPU a decode loop may copy its predicate to the host every step and GEMM "
                      "rows may depend on the row count (issue 24); call it before the first JAX computation",
                      RuntimeWarning, stacklevel=2)
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


def row_invariant_gemms_configured() -> bool:
    """Whether XLA_FLAGS turn Triton GEMMs and GEMM autotuning off (issue 24's row-invariant GEMMs; what XLA read,
    if its backend has started since XLA_FLAGS last changed)."""
    flags = os.environ.get("XLA_FLAGS", "")
    triton = _flag_values("xla_gpu_enable_triton_gemm", flags)
    autotune = _flag_values("xla_gpu_autotune_level", flags)
    return bool(triton and autotune) and triton[-1].lower() in ("false", "0") and autotune[-1] == "0"


def host_driven_loops(hlo_text: str) -> int:
    """While loops of a compiled program (`Compiled.as_text()`) that no command buffer captures. On a GPU each runs
    from the host, its predicate copied to the host every iteration; XLA outlines a captured loop into a computation
    named `command_buffer...` (or called by an instruction of that name). On a CPU every loop counts (the CPU runs
    them from the host, in host memory, where that costs nothing)."""
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
