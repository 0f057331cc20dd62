"""The server's start-up, shared by `python -m kdtree_jax.serve` in one process and by its engine process
(`--engine-process`, engine_process.py): the mesh, the checkpoint's load, the scheduler, its warm-up (compiles, the
cost model), and what the HTTP side needs to know of them (`Summary`). Bad flags or a bad checkpoint are one line on
stderr and SystemExit (status 2, or 1 for a corrupt file)."""

from __future__ import annotations

import dataclasses
import os
import sys
import time

# The interpreter's switch interval in the server's process (seconds; Python's default is 5 ms). The decode thread
# and the event loop share the GIL, and a thread that asks for it while the other runs Python waits up to this long;
# a chunk's launch and read release and retake it many times. On an H100 (benchmarks/serve_dispatch.py, 84299ca), with
# another thread running Python all the time, a chunk's launch took 12.2 ms and its launch-and-read cycle 177 ms at
# 5 ms, 2.8 and 17 ms at 0.5 ms, against 2.2 and 2.8 ms with no other thread.
SWITCH_INTERVAL_S = 0.0005


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _target_config(checkpoint: str):
    """The target's ModelConfig, read from the checkpoint's metadata alone (no weights), or None when it cannot be read
    (the load then says what is wrong with the checkpoint)."""
    from kdtree_jax.checkpoint import read_metadata
    from kdtree_jax.config import ModelConfig

    try:
        if os.path.exists(os.path.join(checkpoint, "config.json")):
            return ModelConfig.from_hf_config(checkpoint)
        return ModelConfig.from_dict(read_metadata(checkpoint)["target"]["config"])
    except Exception:  # noqa: BLE001 - reported by load_models, with the checkpoint's own wording
        return None


def serving_mesh(mesh, layout: str, checkpoint: str):
    """The jax Mesh --mesh asks for (None: one device, unsharded), or a one-line error, before any weight is read: more
    devices than are visible, or a size that does not divide what the layout splits (the sizes that do are named)."""
    import jax

    from kdtree_jax.sharding import divisibility_problems, make_mesh, mesh_sizes

    devices = jax.devices()
    visible = len(devices)
    n = visible if mesh == "all" else mesh
    asked = f"--mesh {mesh}" + (f" ({n} devices)" if mesh == "all" else "")
    if n > visible:
        hint = (f" (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} makes {n} host devices)"
                if jax.default_backend() == "cpu" else "")
        _fail(f"{asked}: only {visible} {devices[0].platform} device{'s' if visible > 1 else ''} visible; pick N in "
              f"[1, {visible}] or 'all'{hint}")
    cfg = _target_config(checkpoint)
    if cfg is not None:
        problems = divisibility_problems(cfg, n, layout)
        if problems:
            allowed = mesh_sizes(cfg, layout, visible)
            other = "ep" if layout == "tp" else "tp"
            also = [m for m in mesh_sizes(cfg, other, visible) if m not in allowed]
            _fail(f"{asked} with --layout {layout}: {n} does not divide " + ", ".join(problems)
                  + f"; with {visible} visible devices --mesh may be {', '.join(map(str, allowed))}"
                  + (f" (--layout {other} also takes {', '.join(map(str, also))})" if also else ""))
    return None if n == 1 else make_mesh(n)


def scheduler_settings(args, budget, calibration_prompt: tuple, recommended_tree_temperature: float):
    """The scheduler's Settings from the command line (budget: --budget after --no-speculative and the drafter)."""
    from kdtree_jax.serve.scheduler import Settings

    return Settings(max_batch=args.max_batch, max_len=args.max_len, budget=budget, menu=args.menu,
                    calibrate=args.calibrate, adaptive_row_programs=args.lone_row_programs,
                    calibration_prompt=calibration_prompt, topk=args.topk,
                    tree_temperature=args.tree_temperature or recommended_tree_temperature,
                    chunk_steps=args.chunk_steps or Settings.chunk_steps, max_queue=args.max_queue,
                    warmup_prompt_tokens=args.warmup_prompt_tokens)


def budget_notice(target, drafter, budget, *, max_batch: int, topk: int, prompt) -> None:
    """A `warning:` line on stderr when a fixed --budget is more than this device runs at a useful speed at --max-batch
    rows (validation.budget_warning: the cached cost model's step cost, else the tree's size against the drafter's
    candidates), as `python -m kdtree_jax.generate` says it; the server still starts. prompt: the calibration prompt
    (the context the cost model's points are measured at). No device work."""
    from kdtree_jax.speculative import validation

    message = validation.budget_warning(target, drafter, [list(prompt)] * max_batch, budget=budget, topk=topk,
                                        sampled=True, penalties=True)  # the bucket's one program serves any settings
    if message:
        print(f"warning: --{message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Summary:
    """What the HTTP process needs of the started engine: the request limits, the start-up line, /health's info."""

    vocab_size: int
    context: int  # the model's max_position_embeddings
    settings: object  # the scheduler's Settings
    num_nodes: int
    depth: int
    info: dict  # /health and /v1/models' decoding fields
    model_name: str
    description: str
    serving: str  # the start-up line's middle, e.g. "speculative, adaptive DDTree budget from {0, 4} ..."
    compiles: int


class StartupStopped(Exception):
    """A signal came during the start-up; the message names the phase it stopped (the model's load, the warm-up)."""


@dataclasses.dataclass
class Engine:
    """A started scheduler with what the HTTP side needs of it (start_engine)."""

    scheduler: object
    metrics: object
    tokenizer: object
    summary: Summary


def start_engine(args, stop_asked=lambda: False) -> Engine:
    """Load the checkpoint, make the scheduler and run its warm-up (compiles, the cost model), in this process: the
    server's own (in-process) or the engine process's (engine_process.engine_main). stop_asked() true at a check
    (after the load, during the warm-up) stops there: StartupStopped. Bad flags or a bad checkpoint: SystemExit with
    its one line printed."""
    from kdtree_jax import runtime
    from kdtree_jax.generate import checkpoint_dir, load_models, notice
    from kdtree_jax.serve.metrics import Metrics
    from kdtree_jax.serve.scheduler import CALIBRATION_TEXT, Scheduler, compile_count
    from kdtree_jax.speculative import tree as trees
    from kdtree_jax.speculative import validation

    runtime.configure()  # before JAX starts: on a GPU, command buffers keep the decode loop on the device
    if not args.no_compile_cache:  # a restart reads the warm-up's programs back instead of compiling them again
        runtime.use_compilation_cache()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    t0 = time.perf_counter()
    mesh = serving_mesh(args.mesh, args.layout, checkpoint_dir(args.checkpoint))
    print("[loading the model ...]", file=sys.stderr, flush=True)
    target, drafter, tokenizer, description, recommended = load_models(args.checkpoint, args.dtype, mesh, args.layout)
    mesh = getattr(target, "mesh", None)  # what /health and the start-up lines report: the model as loaded
    if mesh is not None:
        description += f", {args.layout} over {mesh.size} {mesh.devices.flat[0].platform} devices"
    if stop_asked():
        raise StartupStopped("while loading the model")
    budget = 0 if args.no_speculative else args.budget
    if drafter is not None and budget not in (0, "auto"):
        limit = min(trees.max_ddtree_budget(drafter.cfg.depth, args.topk), validation.MAX_TREE_NODES - 1)
        if budget > limit:
            _fail(f"--budget must be <= {limit} for this drafter and --topk {args.topk}; got {budget}")
    elif drafter is None and budget != 0:
        notice("the checkpoint has no drafter: serving autoregressively")
    settings = scheduler_settings(args, budget, tuple(tokenizer.encode(CALIBRATION_TEXT)), recommended)
    metrics = Metrics()
    scheduler = Scheduler(target, drafter, settings, metrics, say=lambda line: print(line, file=sys.stderr, flush=True))
    if scheduler.max_tokens_for(1) < 1:
        _fail(f"--max-len {args.max_len} leaves no room for a token after a 1-token prompt and a "
              f"{scheduler.num_nodes}-node verify tree")
    if drafter is not None and budget not in (0, "auto"):
        budget_notice(target, drafter, budget, max_batch=args.max_batch, topk=args.topk,
                      prompt=scheduler.calibration_prompt())
    name = args.model_name or (os.path.basename(os.path.normpath(args.checkpoint)) if args.checkpoint
                               else "default" if drafter is not None and "random" not in description else "tiny-random")
    info = {"decoding": "speculative" if scheduler.speculative else "autoregressive",
            "budget": ("auto" if scheduler.menu else scheduler.budget) if scheduler.speculative else 0,
            "topk": args.topk, "tree_temperature": settings.tree_temperature, "max_batch": args.max_batch,
            "max_len": args.max_len, "mesh": 1 if mesh is None else mesh.size}
    if mesh is not None:
        info["layout"] = args.layout
    if scheduler.menu:
        info["budget_menu"] = list(scheduler.menu)
    if not args.no_warmup:
        print(f"[{description}; loaded in {time.perf_counter() - t0:.1f} s; compiling ...]", file=sys.stderr,
              flush=True)
    # The warm-up runs on the decode thread (which owns every JAX call): this thread stays free to take a signal
    # at once instead of after the compile in flight, and the thread leaves at its next safe point when stopped.
    scheduler.start(warmup=not args.no_warmup)
    while not scheduler.ready.wait(0.1) and not stop_asked():
        pass
    if stop_asked():  # the decode thread leaves after the compile in flight
        phase = "during the warm-up" if not scheduler.ready.is_set() else "during the start-up"
        scheduler.stop(drain=False, timeout=None)
        raise StartupStopped(phase)
    if scheduler.warmup_error is not None:
        scheduler.stop(drain=False, timeout=None)
        raise scheduler.warmup_error
    if scheduler.menu:
        bucket = scheduler.bucket  # made by the warm-up (none with --no-warmup)
        cost_info = bucket.cost_info if bucket is not None else None
        source = ("" if cost_info is None else " (cost model measured now)" if cost_info["calibrated"] else
                  " (cost model from the cache)")
        menu = "{" + ", ".join(map(str, scheduler.menu)) + "}"
        shape = (f"adaptive DDTree budget from {menu}{source}" if bucket is None or bucket.refusal is None else
                 f"no DDTree budget of {menu} pays here{source}")
    else:
        shape = f"DDTree budget {scheduler.budget}"
    serving = (info["decoding"] + (f", {shape}, topk {args.topk}, tree temperature {settings.tree_temperature:g}"
                                   if scheduler.speculative else "")
               + f"; max batch {args.max_batch}, {args.max_len} positions a row"
               + ("" if mesh is None else f"; {args.layout} over {mesh.size} devices"))
    summary = Summary(vocab_size=target.cfg.vocab_size, context=target.cfg.max_position_embeddings,
                      settings=settings, num_nodes=scheduler.num_nodes, depth=scheduler.depth, info=info,
                      model_name=name, description=description, serving=serving, compiles=compile_count())
    return Engine(scheduler, metrics, tokenizer, summary)


