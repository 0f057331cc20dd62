"""What each kernel of a compiled decode step computes, from an XLA dump.

A step profile (kdtree_jax/profiling.py) names a kernel by its fusion and the op_name of the fusion's root; some
fusions carry no op_name (`gemm_fusion_dot <- ?`: 26 of them, 0.21 ms of the K2 T = 1 step on an H200), and a
fusion's name does not say which weights it reads. This reads the after-optimizations HLO of the program that holds
the decode loop and prints, for every fusion and custom call in it: the instruction name (what the profile shows),
its output and operand shapes, and the op_names of the ops fused into it.

    XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" \\
        python benchmarks/decode_context.py --layers 2 --steps 2 --contexts 4096 --nodes 1 --impls auto --profile none
    python ffi/tools/step_fusions.py /tmp/hlo --match gemm_fusion_dot,input_concatenate_fusion
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys

HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+?)\s+([\w\-]+)\((.*?)\)(.*)$")
OP_NAME = re.compile(r'op_name="([^"]*)"')
CALLS = re.compile(r"calls=%?([\w.\-]+)")


def step_module(dump_dir: str) -> str:
    """The largest after-optimizations module whose while loop runs the model's attention (the named scope
    `attention_op`, model/mla.py): the decode loop, not a parameter initialiser's random-bits loop."""
    files = glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
    if not files:
        sys.exit(f"step_fusions: no *after_optimizations.txt in {dump_dir} (dump with --xla_dump_hlo_as_text)")
    steps = [f for f in files if " while(" in (text := open(f).read()) and "attention_op" in text]
    if not steps:
        sys.exit(f"step_fusions: no module in {dump_dir} runs a decode loop (a while loop with attention_op)")
    return max(steps, key=os.path.getsize)


def parse(text: str):
    """computation name -> [(name, shape, opcode, operands, rest)], and instruction name -> shape."""
    comps, shapes, current = {}, {}, None
    for line in text.splitlines():
        header = HEADER.match(line)
        if header:
            current = comps.setdefault(header.group(1), [])
            continue
        m = INSTR.match(line)
        if m and current is not None:
            name, shape, opcode, operands, rest = m.groups()
            current.append((name, shape, opcode, operands, rest))
            shapes[name] = shape
    return comps, shapes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump_dir")
    parser.add_argument("--match", default="", help="comma list: only instructions whose name holds one of these")
    args = parser.parse_args(argv)
    path = step_module(args.dump_dir)
    comps, shapes = parse(open(path).read())
    wanted = [w for w in args.match.split(",") if w]
    print(f"# {os.path.basename(path)}")
    for comp, instrs in comps.items():
        for name, shape, opcode, operands, rest in instrs:
            if opcode not in ("fusion", "custom-call") or (wanted and not any(w in name for w in wanted)):
                continue
            operand_shapes = [shapes.get(o.strip().lstrip("%"), "?") for o in operands.split(",") if o.strip()]
            own = OP_NAME.search(rest)
            called = CALLS.search(rest)
            fused = []
            for _, _, _, _, inner in comps.get(called.group(1), []) if called else []:
                op = OP_NAME.search(inner)
                if op and op.group(1) not in fused:
                    fused.append(op.group(1))
            print(f"{name} [{comp}] -> {shape} <- ({', '.join(operand_shapes)})")
            print(f"    op_name: {own.group(1) if own else '?'}")
            for op in fused[:6]:
                print(f"    fused: {op}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # piped into head
        sys.exit(0)
