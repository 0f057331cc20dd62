"""Model check of the warp-specialised kernel's hand-offs (verify_attention_ws_kernel in ffi/verify_attention.cu),
without a GPU: the score warps and the value warps as two processes that run the kernel's sequence of named-barrier
operations and buffer accesses, under random interleavings, for every split length n up to --max-tiles.

Barrier semantics (PTX bar.sync / bar.arrive with a thread count): a barrier's phase completes when the arrivals
reach the count (here both roles' 128 threads: two role-arrivals); bar.sync arrives and waits for the phase,
bar.arrive arrives and goes on; arrivals past a completed phase start the next one.  The check fails on a
deadlock, on a barrier phase left incomplete at the end, on a stage or P buffer overwritten before its reader is
done with it, and on a read of a stage or P buffer that does not hold the expected tile.  A transcription of the
kernel's loop structure: keep it in step with the kernel.

    python ffi/tools/check_ws_protocol.py [--max-tiles 12] [--runs 300]
"""
import argparse
import random

RING, LEAD = 4, 2          # WsConfig::kRing, kLead
P_FULL, P_EMPTY, STAGE_EMPTY = 3, 5, 7  # barrier ids (+ buffer parity)
COUNT = 2                  # two role-arrivals complete a phase (256 threads)


def scorer(n):
    """The score warps' operations, in program order (the prologue copies tiles 0 .. LEAD - 1)."""
    for t in range(min(LEAD, n)):
        yield ("write_stage", t % RING, t)
    for i in range(n):
        if i >= RING - LEAD:
            yield ("sync", STAGE_EMPTY + (i & 1))
        if i + LEAD < n:
            yield ("write_stage", (i + LEAD) % RING, i + LEAD)   # the refill copies (landed by iteration i + LEAD)
        yield ("read_stage", i % RING, i)                       # Q·Kᵀ of tile i
        if i >= 2:
            yield ("sync", P_EMPTY + (i & 1))
        yield ("write_p", i & 1, i)
        yield ("arrive", P_FULL + (i & 1))


def value(n):
    for j in range(n):
        yield ("sync", P_FULL + (j & 1))
        yield ("read_p", j & 1, j)
        yield ("read_stage", j % RING, j)                       # P·V of tile j
        yield ("done_p", j & 1, j)
        yield ("done_stage", j % RING, j)
        if j + 2 < n:
            yield ("arrive", P_EMPTY + (j & 1))
            yield ("arrive", STAGE_EMPTY + (j & 1))


def run(n, rng):
    procs = {"score": scorer(n), "value": value(n)}
    pending = {name: next(gen, None) for name, gen in procs.items()}
    arrivals = {}            # barrier id -> arrivals in the current phase
    waiting = {}             # role -> (barrier id, phase it waits for)
    phase = {}               # barrier id -> completed phases
    stage = {}               # stage -> tile it holds
    stage_readers = {}       # stage -> set of roles that must still read it (tile)
    p_buf, p_unread = {}, {}

    def arrive(bid):
        arrivals[bid] = arrivals.get(bid, 0) + 1
        if arrivals[bid] == COUNT:
            arrivals[bid] = 0
            phase[bid] = phase.get(bid, 0) + 1

    steps = 0
    while any(op is not None for op in pending.values()):
        steps += 1
        runnable = []
        for name, op in pending.items():
            if name in waiting:
                bid, ph = waiting[name]
                if phase.get(bid, 0) >= ph:
                    del waiting[name]
                else:
                    continue
            if op is not None:
                runnable.append(name)
        if not runnable:
            if not waiting:
                break
            raise AssertionError(f"n={n}: deadlock, waiting {waiting}, arrivals {arrivals}")
        name = rng.choice(runnable)
        op = pending[name]
        kind = op[0]
        if kind == "sync":
            bid = op[1]
            target = phase.get(bid, 0) + 1
            arrive(bid)
            waiting[name] = (bid, target)
        elif kind == "arrive":
            arrive(op[1])
        elif kind == "write_stage":
            s, t = op[1], op[2]
            assert not stage_readers.get(s), f"n={n}: stage {s} refilled with tile {t} before {stage_readers[s]} done with tile {stage.get(s)}"
            stage[s] = t
            stage_readers[s] = {"score", "value"}
        elif kind == "read_stage":
            s, t = op[1], op[2]
            assert stage.get(s) == t, f"n={n}: {name} reads tile {t} from stage {s}, which holds {stage.get(s)}"
            if name == "score":
                stage_readers[s].discard("score")
        elif kind == "done_stage":
            stage_readers[op[1]].discard("value")
        elif kind == "write_p":
            b, t = op[1], op[2]
            assert not p_unread.get(b), f"n={n}: P buffer {b} overwritten with P({t}) before P({p_buf.get(b)}) was read"
            p_buf[b], p_unread[b] = t, True
        elif kind == "read_p":
            b, t = op[1], op[2]
            assert p_buf.get(b) == t, f"n={n}: value reads P({t}) from buffer {b}, which holds P({p_buf.get(b)})"
        elif kind == "done_p":
            p_unread[op[1]] = False
        pending[name] = next(procs[name], None)
    assert not waiting, f"n={n}: ended with {waiting} waiting"
    assert all(v == 0 for v in arrivals.values()), f"n={n}: barrier phases left incomplete at the end: {arrivals}"
    return steps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tiles", type=int, default=12)
    ap.add_argument("--runs", type=int, default=300, help="random interleavings per split length")
    args = ap.parse_args()
    rng = random.Random(0)
    for n in range(args.max_tiles + 1):
        for _ in range(args.runs):
            run(n, rng)
    print(f"ok: n = 0 .. {args.max_tiles}, {args.runs} interleavings each")


if __name__ == "__main__":
    main()
