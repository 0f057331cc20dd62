"""kdtree_jax.profiling: a compiled program's kernels attributed to the step's parts by named scope (CPU here;
on a GPU, decode_context's profiled rows exercise the same code)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax import profiling


def test_attributes_kernels_by_scope():
    """A toy program: each scope's work lands in its part, work outside every scope in "other", and a
    while loop's own thunk (which spans its body on a CPU) is not counted."""
    assert profiling.component_of("jit(decode_loop)/while/body/verify/moe/dot_general") == "moe"
    assert profiling.component_of("while/body/drafter/head/dot") == "drafter"  # the drafter's use of the head
    assert profiling.component_of("while/body/verify/add") == "dense"
    assert profiling.component_of("while/body/add") == "other"

    @jax.jit
    def program(x):
        def body(i, x):
            with jax.named_scope("verify"):
                with jax.named_scope("attention_op"):
                    x = jnp.tanh(x @ x)
                with jax.named_scope("moe"):
                    x = jnp.sin(x @ x.T)
            return x  # (an op out here would fuse with sin and carry its own, outer, op_name)
        return jax.lax.fori_loop(0, 4, body, x)

    x = jnp.asarray(np.random.default_rng(0).normal(size=(192, 192)), jnp.float32)
    compiled = program.lower(x).compile()
    compiled(x).block_until_ready()
    prof = profiling.profile_call(compiled, (x,), steps=4)
    parts = prof["components_ms"]
    assert parts["attention"] > 0 and parts["moe"] > 0
    assert prof["kernel_sum_ms"] == pytest.approx(sum(parts.values()))
    assert 0 < prof["busy_ms"] <= prof["kernel_sum_ms"] + 1e-9
    assert parts["attention"] + parts["moe"] > 0.5 * prof["kernel_sum_ms"]  # the loop thunk is not in "other"


def test_places_library_kernels_by_schedule():
    """A kernel that names no instruction (a cuBLAS GEMM inside a CUDA graph) takes the part of the library
    calls scheduled between its resolved neighbours; this project's own custom calls are not candidates."""
    hlo = profiling.HloIndex("""HloModule jit_step, is_scheduled=true

%body.1 (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  %fusion.1 = f32[] fusion(f32[] %p), kind=kLoop, calls=%fc.1, metadata={op_name="jit(step)/while/body/verify/head/mul"}
  %custom-call.2 = (f32[], s8[4]{0}) custom-call(f32[] %fusion.1), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/while/body/verify/head/dot_general"}
  %custom-call.3 = f32[] custom-call(f32[] %fusion.1), custom_call_target="kdtree_verify_attention", metadata={op_name="jit(step)/while/body/verify/attention_op/op"}
  %fusion.4 = f32[] fusion(f32[] %custom-call.3), kind=kLoop, calls=%fc.4, metadata={op_name="jit(step)/while/body/accept/add"}
  %custom-call.5 = f32[] custom-call(f32[] %fusion.4), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/while/body/drafter/dot"}
  %custom-call.6 = f32[] custom-call(f32[] %custom-call.5), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/while/body/verify/moe/dot"}
  ROOT %fusion.7 = f32[] fusion(f32[] %custom-call.6), kind=kLoop, calls=%fc.7, metadata={op_name="jit(step)/while/body/verify/moe/add"}
}
""")
    assert hlo.opcode["custom-call.2"] == "custom-call" and hlo.by_kernel["fusion_4"] == "fusion.4"
    ms = 1_000_000
    events = [("Stream #1", 0 * ms, 1 * ms, "fusion_1", None, "command_buffer_3"),
              ("Stream #1", 1 * ms, 3 * ms, "nvjet_tst_gemm", None, "command_buffer_3"),
              ("Stream #1", 3 * ms, 7 * ms, "verify_attention_wide_kernel", None, "command_buffer_3"),
              ("Stream #1", 7 * ms, 8 * ms, "fusion_4", None, "command_buffer_3"),
              ("Stream #1", 8 * ms, 10 * ms, "sm90_xmma_gemm", None, "command_buffer_3"),  # two parts' calls between
              ("Stream #1", 10 * ms, 11 * ms, "fusion_7", None, "command_buffer_3")]
    parts, how, families, ops = profiling.attribute(events, hlo)
    assert parts["head"] == 3 * ms  # fusion.1 and the GEMM the schedule places in the head
    assert parts["attention"] == 4 * ms and parts["tree_accept_commit"] == 1 * ms
    assert parts["moe"] == 3 * ms  # fusion.7, and the ambiguous GEMM by its next kernel
    assert how == {"kernel name": 3 * ms, "schedule": 2 * ms, "own kernel": 4 * ms, "next kernel": 2 * ms}
    assert families["head"] == {"fusion": [1 * ms, 1], "nvjet_tst_gemm": [2 * ms, 1]}
    # By the op each kernel serves (its instruction's op_name, layer numbers dropped); "?" when only placed.
    assert ops["head"] == {"fusion <- body/verify/head/mul": [1 * ms, 1], "nvjet_tst_gemm <- ?": [2 * ms, 1]}
    assert ops["moe"] == {"fusion <- body/verify/moe/add": [1 * ms, 1], "sm90_xmma_gemm <- ?": [2 * ms, 1]}
    assert profiling.op_family("jit(step)/while/body/verify/layers_12/mla/dot_general.3") == "verify/layers/mla/dot_general"
    assert profiling.kernel_family("void (anonymous namespace)::moe_gate_up_kernel<true, 4>((anonymous namespace)::Params)") \
        == "moe_gate_up_kernel<true, 4>"


def test_dependent_launch_counts_from_predecessor_end():
    """Programmatic dependent launch: a kernel recorded from its launch, while its predecessor on the stream
    still runs, counts only from that predecessor's end, so one stream's parts add up to the union of its
    kernels; a kernel on another stream that runs meanwhile keeps its overlap."""
    hlo = profiling.HloIndex("")
    us = 1_000
    events = [("Stream #7", 0 * us, 10 * us, "fusion_1", "jit(step)/while/body/verify/add", None),
              ("Stream #7", 10 * us, 40 * us, "verify_attention_wide_kernel", None, None),
              ("Stream #7", 12 * us, 45 * us, "verify_merge_splits_kernel", None, None),  # waits to 40
              ("Stream #7", 45 * us, 50 * us, "moe_gate_up_kernel", None, None),
              ("Stream #7", 46 * us, 48 * us, "moe_down_kernel", None, None)]  # inside its predecessor
    parts, how, families, ops = profiling.attribute(events, hlo)
    assert families["attention"] == {"verify_attention_wide_kernel": [30 * us, 1],
                                      "verify_merge_splits_kernel": [5 * us, 1]}
    assert families["moe"] == {"moe_gate_up_kernel": [5 * us, 1], "moe_down_kernel": [0, 1]}
    assert parts["attention"] == 35 * us and parts["dense"] == 10 * us
    assert sum(parts.values()) == profiling.busy_ns(events) == 50 * us
    clipped = profiling.clip_to_streams(events)
    assert [e[1:3] for e in clipped] == [(0, 10 * us), (10 * us, 40 * us), (40 * us, 45 * us),
                                         (45 * us, 50 * us), (50 * us, 50 * us)]
    assert profiling.clip_to_streams(clipped) == clipped
    assert profiling.busy_ns(clipped) == profiling.busy_ns(events)

    # Two streams: a kernel on stream 9 that runs during the attention kernel is not clipped by stream 7.
    both = events + [("Stream #9", 15 * us, 35 * us, "fusion_2", "jit(step)/while/body/drafter/dot", None),
                     ("Stream #9", 30 * us, 38 * us, "fusion_3", "jit(step)/while/body/drafter/add", None)]
    parts, _, families, _ = profiling.attribute(both, hlo)
    assert parts["attention"] == 35 * us and parts["drafter"] == (20 + 3) * us  # fusion_3 from 35 on its stream
    assert sum(parts.values()) == 73 * us > profiling.busy_ns(both) == 50 * us


def test_idle_gaps_charged_to_the_kernels_around_them():
    """The step's idle time, gap by gap, charged to (the kernel that ended last, the kernel that starts): a kernel
    overlapping another (a second stream, or a dependent launch) leaves no gap, and the gaps add up to the span
    less the union of the kernels."""
    us = 1_000
    events = [("Stream #7", 0 * us, 10 * us, "fusion_1", None, None),
              ("Stream #7", 13 * us, 20 * us, "moe_pair_gate_up_kernel<true, 4>(Params)", None, None),  # 3 us gap
              ("Stream #9", 15 * us, 30 * us, "fusion_2", None, None),  # overlaps: no gap, ends last
              ("Stream #7", 31 * us, 40 * us, "fusion_3", None, None),  # 1 us after fusion_2
              ("Stream #7", 42 * us, 44 * us, "fusion_4", None, None)]  # 2 us after fusion_3
    gaps = profiling.idle_gaps(events)
    assert gaps == {"fusion -> moe_pair_gate_up_kernel<true, 4>": [3 * us, 1], "fusion -> fusion": [3 * us, 2]}
    assert sum(v[0] for v in gaps.values()) == 44 * us - profiling.busy_ns(events)


def test_kernels_outside_the_loop_count_once_a_call():
    """call_steps: a profiled run shorter than the call it stands for counts the kernels of the ENTRY computation
    (set-up before the loop) once a call, 1/call_steps a step, and the loop's kernels per profiled step."""
    @jax.jit
    def program(x):
        y = jnp.sin(x) * 3.0  # outside the loop: once a call
        return jax.lax.fori_loop(0, 2, lambda i, y: jnp.tanh(y @ y), y)

    x = jnp.asarray(np.random.default_rng(1).normal(size=(64, 64)), jnp.float32)
    compiled = program.lower(x).compile()
    compiled(x).block_until_ready()
    index = profiling.HloIndex(compiled.as_text())
    assert index.entry is not None and index.entry in index.order
    plain = profiling.profile_call(compiled, (x,), steps=2)
    weighed = profiling.profile_call(compiled, (x,), steps=2, call_steps=8)
    outside = weighed["outside_loops"]["kernels"]
    assert outside >= 1 and weighed["outside_loops"]["call_steps"] == 8
    total = plain["kernels_per_step"] * 2
    assert weighed["kernels_per_step"] == pytest.approx((total - outside) / 2 + outside / 8)
    assert 0 < weighed["busy_ms"] <= weighed["kernel_sum_ms"] + 1e-9


def test_loop_gaps_span_the_loop_body():
    """The idle inside a loop's steps: the span of the body's kernels, less the union of the kernels in it; what lies
    before the first (the loop's test, a named kernel of its condition, and the launch of its body graph after an
    unnamed control kernel) and the ENTRY computation's set-up are left out."""
    hlo = profiling.HloIndex("""HloModule jit_step, is_scheduled=true

%cond.1 (c: f32[]) -> pred[] {
  %c = f32[] parameter(0)
  ROOT %fusion.3 = pred[] fusion(f32[] %c), kind=kLoop, calls=%fc.3, metadata={op_name="jit(step)/while/cond/lt"}
}

%body.1 (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  %fusion.1 = f32[] fusion(f32[] %p), kind=kLoop, calls=%fc.1, metadata={op_name="jit(step)/while/body/verify/mul"}
  ROOT %fusion.2 = f32[] fusion(f32[] %fusion.1), kind=kLoop, calls=%fc.2, metadata={op_name="jit(step)/while/body/verify/moe/add"}
}

ENTRY %main.1 (a: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %fusion.4 = f32[] fusion(f32[] %a), kind=kLoop, calls=%fc.4, metadata={op_name="jit(step)/verify/transpose"}
  ROOT %while.1 = f32[] while(f32[] %fusion.4), condition=%cond.1, body=%body.1
}
""")
    ms = 1_000_000
    events = [("Stream #1", 0 * ms, 1 * ms, "fusion_4", None, None),
              ("Stream #1", 1 * ms, 2 * ms, "fusion_3", None, None),
              ("Stream #1", 2 * ms, 3 * ms, "set_while_condition", None, None),
              ("Stream #1", 5 * ms, 7 * ms, "fusion_1", None, None),
              ("Stream #1", 8 * ms, 9 * ms, "fusion_2", None, None),
              ("Stream #1", 9 * ms, 12 * ms, "fusion_1", None, None)]
    gaps = profiling.loop_gaps(events, hlo, steps=2)
    assert gaps == {"loop_span_ms": 3.5, "loop_idle_ms": 0.5}
