"""Where the time of one compiled program goes: its kernels, from a device trace, grouped by the model's parts.

    profile = profile_call(compiled, args, steps=8)    # {"components_ms": {...}, "busy_ms": ..., ...} per step

The program runs once under `jax.profiler` (CUPTI on a GPU); the trace is read back with
`jax.profiler.ProfileData` (no TensorBoard needed). Each kernel is traced to the XLA instruction it came
from, whose op_name (HLO metadata, from the compiled program's text: `HloIndex`) holds the `jax.named_scope`s
that the engine and model set around their parts (drafter, tree, verify, attention_op, moe, head, accept,
commit), so its time lands in one part (`component_of`). The instruction, in order of trust (`resolve`):
the trace's own stat (kernels launched one by one); else the kernel's name, which XLA derives from the fusion
it compiles (kernels replayed in a CUDA graph carry only the graph's command-buffer instruction); else, for
this project's FFI kernels, their names. A library kernel (cuBLAS inside a custom call) names nothing; the
schedule places it (`attribute`). On the H200 at edbe0cd, of a 25-layer step's 7.6 ms of kernels at 4k,
T = 9, 2.6 ms resolved by name, 4.9 ms were the FFI kernels and 0.15 ms needed their neighbours (0.6 ms of
28.6 at 200k, T = 33). A kernel that fuses ops of two parts lands in the outer one (its op_name is the fused ops'
common prefix, or on a CPU its root's): the MoE's final weighted sum fused with the residual add counts as
"dense". Such kernels are small.

Under programmatic dependent launch (runtime.py turns it on) a kernel's recorded start is its launch, which
can come before its predecessor on the stream has finished (it waits in `griddepcontrol.wait`), so its span
holds time that is its predecessor's. So each kernel counts only from the latest end of the kernels before it
on its own stream (`clip_to_streams`), while kernels on different streams keep their overlap.

Why a profile and not only components timed alone: alone, each part's loop is wall time, with its own
launch gaps and bookkeeping, and the parts summed to ~1.2x the step (decode_context at f57f08a, 25 layers,
H200). Inside the step the kernel times add up to at most the step; the rest ("idle") is the GPU waiting.
Only kernel durations are taken from the profiled run; the step time is the unprofiled one.
"""

from __future__ import annotations

import bisect
import glob
import re
import shutil
import tempfile

import jax

# (scope in the op_name path, component): the first scope found in a kernel's path decides. The drafter
# first: it calls the target's head and embedding inside its own scope.
SCOPES = (("drafter", "drafter"), ("attention_op", "attention"), ("moe", "moe"), ("head", "head"),
          ("tree", "tree_accept_commit"), ("accept", "tree_accept_commit"), ("commit", "tree_accept_commit"),
          ("verify", "dense"))
COMPONENTS = ("attention", "moe", "dense", "drafter", "head", "tree_accept_commit", "other")
# This project's CUDA kernels (FFI custom calls: XLA names no instruction after them).
OWN_KERNELS = ((re.compile(r"verify_attention|merge_splits"), "attention"),
               (re.compile(r"\bmoe_\w*kernel"), "moe"))

_ANNOTATION_NAME = re.compile(r"[#,]name=([^,#]+)")
_ANNOTATION_OP = re.compile(r"hlo_op=([^,#]+)")
# Control flow: on a CPU the thunk of a while loop spans its body's thunks (and would count them twice).
_CONTROL_FLOW = re.compile(r"^(while|conditional|call)(\.\d+)?$")
# Lines that tools derive from the kernels (absent from a raw trace, skipped if present: they would count twice).
_DERIVED_LINES = ("XLA Ops", "XLA Modules", "Steps", "Framework Ops", "Framework Name Scope", "Source code",
                  "XLA TraceMe", "Launch Stats")


def component_of(op_name: str) -> str:
    """The part (COMPONENTS) of an op_name path: that of the first entry of SCOPES whose scope is in the path."""
    parts = set(op_name.split("/"))
    for scope, component in SCOPES:
        if scope in parts:
            return component
    return "other"


class HloIndex:
    """What a profile needs of a compiled module's HLO text: each instruction's op_name (its metadata), its
    opcode and custom-call target, and its place in its computation's printed order, which for a scheduled
    module (XLA:GPU prints one) is the order its kernels run in; `by_kernel`: XLA's kernel names (an
    instruction's name with "." and "-" as "_") -> instruction."""

    _INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
    _COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")

    def __init__(self, hlo_text: str):
        self.op_name, self.opcode, self.target, self.place, self.order = {}, {}, {}, {}, {}
        self.entry = None  # the ENTRY computation: its instructions run once a call, outside every loop
        self.conditions = set()  # while loops' condition computations: loop control, not a step's work
        computation = None
        for line in hlo_text.splitlines():
            if (m := self._COMPUTATION.match(line)) is not None:
                computation = m.group(2)
                self.order[computation] = []
                if m.group(1):
                    self.entry = computation
                continue
            if computation is None or (m := self._INSTR.match(line)) is None:
                continue
            name, rhs = m.groups()
            self.place[name] = (computation, len(self.order[computation]))
            self.order[computation].append(name)
            if (op := re.search(r"\s([a-z][a-z0-9\-]*)\(", " " + rhs)) is not None:
                self.opcode[name] = op.group(1)
            if (meta := re.search(r'op_name="([^"]*)"', rhs)) is not None:
                self.op_name[name] = meta.group(1)
            if (target := re.search(r'custom_call_target="([^"]+)"', rhs)) is not None:
                self.target[name] = target.group(1)
            if (cond := re.search(r"\bcondition=%?([\w.\-]+)", rhs)) is not None:
                self.conditions.add(cond.group(1))
        self.by_kernel = {re.sub(r"[.\-]", "_", k): k for k in self.place}

    def library_calls_between(self, first: str, last: str) -> list:
        """The custom calls scheduled strictly between two instructions of one computation, other than this
        project's own (their kernels are named): the candidates for a library kernel seen between them."""
        (comp_a, i), (comp_b, j) = self.place[first], self.place[last]
        if comp_a != comp_b or i >= j:
            return []
        return [n for n in self.order[comp_a][i + 1:j]
                if self.opcode.get(n) == "custom-call" and not self.target.get(n, "").startswith("kdtree_")]


def kernel_events(xspace_path: str, module_names=(), sample: int = 0):
    """([(line, start_ns, end_ns, kernel name, op_name or None, hlo_op or None)], [a few events' raw stats])
    of the trace's device kernels (GPU planes), or, on a CPU-only trace, of the XLA thunks of `module_names`
    (hlo_module stat). `line`: the trace line, one per CUDA stream ("Stream #13(...)") or host thread,
    prefixed by its plane's name where the trace has several planes. `sample`: how many distinct kernels'
    stats to return (to see what a trace holds)."""
    data = jax.profiler.ProfileData.from_file(xspace_path)
    planes = list(data.planes)
    devices = [p for p in planes if p.name.startswith("/device:GPU")]
    events, seen = [], {}
    scanned = devices or [p for p in planes if p.name.startswith("/host:CPU")]
    for plane in scanned:
        for line in plane.lines:
            if line.name in _DERIVED_LINES:
                continue
            # Every GPU's plane names its streams "Stream #N": the plane keeps two devices' streams apart.
            line_id = line.name if len(scanned) == 1 else f"{plane.name}/{line.name}"
            for ev in line.events:
                stats = dict(ev.stats)
                if len(seen) < sample and ev.name not in seen:
                    seen[ev.name] = {"line": line.name, **{k: str(v)[:160] for k, v in stats.items()}}
                hlo_op, op_name = stats.get("hlo_op"), None
                # Annotations nest ("XlaModule:#..#::Thunk:#..#::Thunk:#name=..,hlo_op=..#"): the innermost
                # one that names an instruction is the kernel's.
                segments = [seg for v in stats.values() if isinstance(v, str) for seg in v.split("::")]
                for seg in reversed(segments):
                    if (m := _ANNOTATION_OP.search(seg)) is not None:
                        hlo_op = hlo_op or m.group(1)
                        op_name = (n := _ANNOTATION_NAME.search(seg)) and n.group(1)
                        break
                if not devices and (hlo_op is None or _CONTROL_FLOW.match(hlo_op)
                                    or (module_names and stats.get("hlo_module") not in module_names)):
                    continue  # a host trace: only the program's own thunks, not its loops
                events.append((line_id, ev.start_ns, ev.end_ns, ev.name, op_name, hlo_op))
    return events, [{"kernel": k[:100], **v} for k, v in seen.items()]


def _weight(event) -> float:
    """How many times an event counts (`profile_call` weighs the kernels outside the loops; 1 otherwise)."""
    return event[6] if len(event) > 6 else 1.0


def computation_of(event, hlo: HloIndex):
    """The HLO computation a kernel's instruction sits in, or None where the kernel names no instruction (library
    kernels, and this project's FFI kernels replayed in a CUDA graph)."""
    instr = resolve(event, hlo)[2] or (event[5] if event[5] in hlo.place else None)
    return None if instr is None else hlo.place[instr][0]


def outside_loops(event, hlo: HloIndex) -> bool:
    """Whether a kernel comes from the program's ENTRY computation, outside every loop: work a call does once
    (set-up before its loop, results after it) whatever the number of steps its loop runs."""
    return hlo.entry is not None and computation_of(event, hlo) == hlo.entry


def loop_gaps(events, hlo: HloIndex, steps: int) -> dict:
    """The device's own idle time inside a loop's steps: from the first to the last kernel of a loop's body (a
    kernel that names a part of the step, outside the ENTRY computation and every loop condition), that span less
    the union of every kernel in it, per step ("loop_span_ms", "loop_idle_ms"). What the span leaves out, the call's
    set-up, the loop's first test and the launch of its body (a conditional node's body graph: ~1-3 ms in a
    profiled call on an H200, once a call), and what follows the last step, is the call's, not the steps'."""
    def in_body(ev):
        computation = computation_of(ev, hlo)
        if computation is None:  # this project's FFI kernels name no instruction under a graph: they are a part's
            return resolve(ev, hlo)[0] is not None
        return computation != hlo.entry and computation not in hlo.conditions
    body = [ev for ev in events if in_body(ev)]
    if not body:
        return {}
    lo, hi = min(ev[1] for ev in body), max(ev[2] for ev in body)
    within = [(ev[0], max(ev[1], lo), min(ev[2], hi)) for ev in events if ev[2] > lo and ev[1] < hi]
    return {"loop_span_ms": (hi - lo) / steps / 1e6, "loop_idle_ms": (hi - lo - busy_ns(within)) / steps / 1e6}


def busy_ns(events) -> float:
    """Length of the union of the events' intervals (kernels that overlap count once)."""
    total, end = 0.0, None
    for start, stop in sorted((e[1], e[2]) for e in events):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def idle_gaps(events) -> dict:
    """{"kernel before -> kernel after": [idle ns, gaps]} over the times when no kernel runs, on the union of
    every stream: each gap between the end of the kernels so far and the next kernel's start is charged to the
    pair of kernel families around it (the one that ended last, the one that starts), so that the launch gaps a
    step's idle time is made of can be traced to the kernels (and custom calls or loop iterations) that cause them."""
    gaps, end, last = {}, None, None
    for ev in sorted(events, key=lambda e: (e[1], e[2])):
        start, stop, name = ev[1], ev[2], kernel_family(ev[3])
        if end is not None and start > end:
            entry = gaps.setdefault(f"{last} -> {name}", [0.0, 0])
            entry[0] += start - end
            entry[1] += 1
        if end is None or stop > end:
            end, last = stop, name
    return gaps


def clip_to_streams(events) -> list:
    """The events, in order of line then start, each one's interval [start, end] moved to [max(start, t),
    max(end, t)], t the latest end of the events before it on its line (stream): a kernel launched as a
    programmatic dependent is recorded from its launch, while it still waits for its predecessor. On one
    line the clipped durations add up to the union of the intervals; lines (streams) are clipped apart, so
    kernels that run concurrently on two streams keep their overlap."""
    out, latest = [], {}
    for ev in sorted(events, key=lambda e: (e[0], e[1], e[2])):
        line, start, end = ev[:3]
        t = latest.get(line, start)
        # Moving the end too keeps a kernel recorded inside its predecessor's span (a nested CPU thunk)
        # after it, at zero length, so the order of the starts stays the order of the launches.
        out.append((line, max(start, t), max(end, t), *ev[3:]))
        latest[line] = max(end, t)
    return out


def resolve(event, hlo: HloIndex):
    """(component, how, instruction or None) of one kernel, or (None, None, None): by XLA's annotation (its
    op_name path), by the instruction it names, by its kernel name (XLA names a fusion's kernel after the
    instruction), or, for this project's own CUDA kernels (FFI custom calls), by their names."""
    name, op_name, hlo_op = event[3:6]
    if op_name:
        return component_of(op_name), "annotation", hlo_op if hlo_op in hlo.place else None
    if hlo_op in hlo.op_name:
        return component_of(hlo.op_name[hlo_op]), "instruction", hlo_op
    for key in (name, re.sub(r"_\d+$", "", name)):
        if key in hlo.by_kernel and hlo.by_kernel[key] in hlo.op_name:
            instr = hlo.by_kernel[key]
            return component_of(hlo.op_name[instr]), "kernel name", instr
    for pattern, component in OWN_KERNELS:
        if pattern.search(name):
            return component, "own kernel", None
    return None, None, None


def kernel_family(name: str) -> str:
    """A kernel name without its instance numbers ("loop_add_fusion_12", "ynn_fusion.3" -> "..._fusion") or its parameter
    list, so that one kernel's instances in every layer add up."""
    if name.endswith(")"):  # a C++ kernel: cut its final (parameter) group
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    return re.sub(r"([._]\d+)+$", "", name)[:80]  # GPU kernels "fusion_12", CPU thunks "fusion.12"


def op_family(op_name: str, keep: int = 4) -> str:
    """An op_name path's last `keep` scopes without instance or layer numbers ("jit(f)/while/body/layers_3/
    mla/q_a_proj/dot_general" -> "layers/mla/q_a_proj/dot_general"), so one op's kernels in every layer add up."""
    parts = [re.sub(r"[._]?\d+$", "", p) for p in op_name.split("/") if p and not p.startswith(("jit(", "pjit("))]
    return "/".join(parts[-keep:])


def attribute(events, hlo: HloIndex):
    """({component: kernel ns}, {how: kernel ns}, {component: {kernel family: [ns, count]}},
    {component: {"kernel family <- op family": [ns, count]}}) over the events.

    A kernel that names nothing (a library GEMM that a custom call ran inside a CUDA graph) is placed by the
    schedule: between the instructions of the nearest resolved kernels before and after it on its stream,
    the library calls scheduled there; if they all belong to one part, it is that part's ("schedule").
    Failing that, it takes the part of the next resolved kernel on its stream (else the previous one).
    Each kernel's time is its span after `clip_to_streams`."""
    out, how_ns, families = dict.fromkeys(COMPONENTS, 0.0), {}, {c: {} for c in COMPONENTS}
    ops = {c: {} for c in COMPONENTS}
    by_line = {}
    for ev in clip_to_streams(events):
        by_line.setdefault(ev[0], []).append(ev)
    for line_events in by_line.values():
        resolved = [resolve(ev, hlo) for ev in line_events]
        placed = [i for i, r in enumerate(resolved) if r[2] is not None]  # ascending
        for i, (component, _, _) in enumerate(resolved):
            if component is not None:
                continue
            k = bisect.bisect_left(placed, i)  # placed[k - 1] < i < placed[k]: i itself is not placed
            if 0 < k < len(placed):
                calls = hlo.library_calls_between(resolved[placed[k - 1]][2], resolved[placed[k]][2])
                parts = {component_of(hlo.op_name.get(c, "")) for c in calls}
                if len(parts) == 1:
                    resolved[i] = (parts.pop(), "schedule", None)
        following = None
        for i in range(len(resolved) - 1, -1, -1):  # the next resolved component, scanning backwards
            if resolved[i][0] is None:
                resolved[i] = (following, "next kernel", None) if following else resolved[i]
            else:
                following = resolved[i][0]
        last = None
        for i, (component, how, _) in enumerate(resolved):
            if component is None:
                component, how = (last or "other"), ("previous kernel" if last else "none")
            last = component
            ns = (line_events[i][2] - line_events[i][1]) * _weight(line_events[i])
            out[component] += ns
            how_ns[how] = how_ns.get(how, 0.0) + ns
            kernel = kernel_family(line_events[i][3])
            instr = resolved[i][2]
            op = op_family(hlo.op_name[instr]) if instr in hlo.op_name else "?"
            for table, key in ((families, kernel), (ops, f"{kernel} <- {op}")):
                entry = table[component].setdefault(key, [0.0, 0])
                entry[0] += ns
                entry[1] += _weight(line_events[i])
    return out, how_ns, families, ops


def trace_kernels(compiled, args, sample: int = 0):
    """(output, kernel events as `kernel_events` gives them, raw stats sample) of one run of compiled(*args)
    under the profiler. On a GPU the events are the program's device kernels with CUPTI's device timestamps."""
    hlo = compiled.as_text() or ""
    module_names = set(re.findall(r"^HloModule\s+([\w.\-]+)", hlo, re.M))
    trace_dir = tempfile.mkdtemp(prefix="step_profile_")
    try:
        jax.profiler.start_trace(trace_dir)
        try:
            output = jax.block_until_ready(compiled(*args))
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        if not paths:
            raise RuntimeError(f"the profiler wrote no trace under {trace_dir}")
        events, stats_sample = kernel_events(paths[0], module_names, sample)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    if not events:
        raise RuntimeError("the trace holds no kernel of the program")
    return output, events, stats_sample


def profile_call(compiled, args, steps: int = 1, sample: int = 0, steps_of=None, call_steps=None) -> dict:
    """Run compiled(*args) once under the profiler; kernel time per component per step (ms), the union of the
    kernel intervals per step ("busy_ms"), the kernel count, how the kernels were attributed ("resolved_ms"),
    and each component's largest kernel families ("top_kernels": [name, ms, launches] per step) and kernel families by
    the op they serve ("top_ops": "kernel family <- op family", the op_name's last scopes; "?" where none resolved). `compiled`: a jax Compiled (its HLO text maps instructions to
    op_names). sample: include that many kernels' raw stats; steps_of: a
    function of the program's output giving the steps to divide by (instead of `steps`); call_steps: the steps of
    the call the profile stands for, when the profiled run is shorter (a one-step run of a loop timed at eight steps
    a call): the kernels outside the program's loops (`outside_loops`) run once a call, so they count 1/call_steps
    a step instead of 1/steps ("outside_loops": their kernels and ms a call)."""
    output, events, stats_sample = trace_kernels(compiled, args, sample)  # attribute() clips them per stream
    if steps_of is not None:
        steps = max(int(steps_of(output)), 1)
    index = HloIndex(compiled.as_text() or "")
    once = [bool(call_steps) and outside_loops(ev, index) for ev in events]
    outside = [ev for ev, o in zip(events, once) if o]
    inside = [ev for ev, o in zip(events, once) if not o]
    if outside:
        weight = steps / call_steps
        events = inside + [(*ev[:6], weight) for ev in outside]
        busy = busy_ns(inside) + busy_ns(outside) * weight
        kernels = len(inside) + len(outside) * weight
    else:
        busy, kernels = busy_ns(events), len(events)
    by_component, how_ns, families, ops = attribute(events, index)

    def largest(tables, count):  # per component: its `count` largest entries, ms and launches per step
        return {c: [(name, round(ns / steps / 1e6, 4), round(n / steps, 1))
                    for name, (ns, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:count]]
                for c, table in tables.items() if table}
    result = {"source": "device kernels" if jax.default_backend() == "gpu" else "host thunks",
              "components_ms": {k: v / steps / 1e6 for k, v in by_component.items()},
              "kernel_sum_ms": sum(by_component.values()) / steps / 1e6,
              "busy_ms": busy / steps / 1e6,
              "steps": steps,
              "kernels_per_step": kernels / steps,
              "resolved_ms": {k: v / steps / 1e6 for k, v in how_ns.items()},
              "top_kernels": largest(families, 6),
              "top_ops": largest(ops, 12),
              "idle_gaps": largest({"idle": idle_gaps(events)}, 12).get("idle", [])}
    if call_steps:
        result["outside_loops"] = {"kernels": len(outside), "ms_per_call": busy_ns(outside) / 1e6, "call_steps": call_steps}
        result.update(loop_gaps(inside, index, steps))
    if sample:
        result["stats_sample"] = stats_sample
    return result
