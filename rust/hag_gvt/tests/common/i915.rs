//! Dwords and rings as i915 6.12 emits them in a GVT-g guest (Gen8/Gen9,
//! `gt/gen8_engine_cs.c`, `intel_gpu_commands.h`): the framing every
//! hand-off test and the Mesa corpus wrap their batches in.
#![allow(dead_code)]

/// MI_ARB_ON_OFF | MI_ARB_ENABLE.
pub const MI_ARB_ENABLE: u32 = 0x0400_0001;
/// MI_ARB_ON_OFF | MI_ARB_DISABLE.
pub const MI_ARB_DISABLE: u32 = 0x0400_0000;
/// MI_BATCH_BUFFER_START_GEN8 with bit 8: the batch is in the PPGTT.
pub const MI_BB_START_PPGTT: u32 = 0x1880_0101;
/// MI_STORE_DWORD_IMM_GEN4 without MI_USE_GGTT: a PPGTT address.
pub const MI_SDI_PPGTT: u32 = 0x1000_0002;
/// GFX_OP_PIPE_CONTROL(6).
pub const PIPE_CONTROL: u32 = 0x7a00_0004;
pub const PC_QW_WRITE: u32 = 1 << 14;
pub const PC_GLOBAL_GTT: u32 = 1 << 24;
pub const PC_CS_STALL: u32 = 1 << 20;
pub const PC_FLUSH_ENABLE: u32 = 1 << 7;
/// 3DSTATE_VS (Gen8: 9 dwords), which hag's auditor does not model.
pub const STATE_VS: u32 = 0x7810_0007;
pub const MI_BB_END: u32 = 0x0500_0000;
pub const MI_NOOP: u32 = 0;
pub const MI_USER_INTERRUPT: u32 = 0x0100_0000;

/// The engine's status page.
pub const HWSP: u64 = 0x5000;

/// The seqno slot of the request's timeline: a GGTT page of its own.
pub const SEQNO: u64 = 0x6080;
pub const SEQNO_GFN: u64 = 0x50;
pub const HWSP_GFN: u64 = 0x77;
/// `I915_GEM_HWS_PREEMPT_ADDR`: the preemption semaphore in the engine's
/// status page.
pub const HWS_PREEMPT_ADDR: u64 = 0x32 * 4;
/// `LRC_PPHWSP_SCRATCH_ADDR`: the status-page slot i915's flushes write.
pub const PPHWSP_SCRATCH_ADDR: u32 = 0x34 * 4;
pub const MI_ARB_CHECK: u32 = 0x0280_0000;
/// MI_STORE_DWORD_IMM_GEN4 | MI_USE_GGTT.
pub const MI_SDI_GGTT: u32 = 0x1040_0002;
/// MI_SEMAPHORE_WAIT | MI_SEMAPHORE_GLOBAL_GTT | MI_SEMAPHORE_POLL |
/// MI_SEMAPHORE_SAD_EQ_SDD.
pub const MI_SEMAPHORE_WAIT_GGTT_POLL_EQ: u32 = 0x0e40_c002;
/// MI_FLUSH_DW + 1 (4 dwords).
pub const MI_FLUSH_DW: u32 = 0x1300_0002;
pub const MI_FLUSH_DW_STORE_INDEX: u32 = 1 << 21;
pub const MI_FLUSH_DW_OP_STOREDW: u32 = 1 << 14;
pub const MI_INVALIDATE_TLB: u32 = 1 << 18;
pub const MI_FLUSH_DW_USE_GTT: u32 = 1 << 2;
pub const PC_STORE_DATA_INDEX: u32 = 1 << 21;
pub const PC_TLB_INVALIDATE: u32 = 1 << 18;
pub const PC_RENDER_TARGET_CACHE_FLUSH: u32 = 1 << 12;
pub const PC_INSTRUCTION_CACHE_INVALIDATE: u32 = 1 << 11;
pub const PC_TEXTURE_CACHE_INVALIDATE: u32 = 1 << 10;
pub const PC_DC_FLUSH_ENABLE: u32 = 1 << 5;
pub const PC_VF_CACHE_INVALIDATE: u32 = 1 << 4;
pub const PC_CONST_CACHE_INVALIDATE: u32 = 1 << 3;
pub const PC_STATE_CACHE_INVALIDATE: u32 = 1 << 2;
pub const PC_DEPTH_CACHE_FLUSH: u32 = 1 << 0;

/// `gen8_emit_flush_rcs(rq, EMIT_INVALIDATE)` on Gen9, which
/// `execlists_request_alloc` emits at the start of every request: the
/// VF-invalidate workaround's null PIPE_CONTROL, then the invalidating one
/// with a qword write to the status page's scratch slot (store data index,
/// no GGTT bit).
pub fn rcs_invalidate() -> Vec<u32> {
    vec![
        PIPE_CONTROL,
        0,
        0,
        0,
        0,
        0,
        PIPE_CONTROL,
        PC_CS_STALL
            | PC_TLB_INVALIDATE
            | PC_INSTRUCTION_CACHE_INVALIDATE
            | PC_TEXTURE_CACHE_INVALIDATE
            | PC_VF_CACHE_INVALIDATE
            | PC_CONST_CACHE_INVALIDATE
            | PC_STATE_CACHE_INVALIDATE
            | PC_QW_WRITE
            | PC_STORE_DATA_INDEX,
        PPHWSP_SCRATCH_ADDR,
        0,
        0,
        0,
    ]
}

/// `gen8_emit_flush_xcs(rq, EMIT_INVALIDATE)` on the blitter.
pub fn xcs_invalidate() -> Vec<u32> {
    vec![
        MI_FLUSH_DW | MI_FLUSH_DW_STORE_INDEX | MI_FLUSH_DW_OP_STOREDW | MI_INVALIDATE_TLB,
        PPHWSP_SCRATCH_ADDR,
        0,
        0,
    ]
}

/// `gen8_emit_init_breadcrumb`: seqno - 1 to the timeline, then a
/// preemption point.
pub fn init_breadcrumb(seqno: u32) -> Vec<u32> {
    vec![
        MI_SDI_GGTT,
        SEQNO as u32,
        0,
        seqno - 1,
        MI_NOOP,
        MI_ARB_CHECK,
    ]
}

/// `gen8_emit_bb_start_noarb`, what a vGPU guest uses (i915 gives engines
/// no preemption under `intel_vgpu_active`), or `gen8_emit_bb_start` with
/// preemption (bare metal); the batch is a user one (PPGTT, bit 8).
pub fn bb_start(batch_gma: u64, preemptible: bool) -> Vec<u32> {
    let (lo, hi) = (batch_gma as u32, (batch_gma >> 32) as u32);
    if preemptible {
        vec![
            MI_ARB_ENABLE,
            MI_BB_START_PPGTT,
            lo,
            hi,
            MI_ARB_DISABLE,
            MI_NOOP,
        ]
    } else {
        vec![MI_ARB_DISABLE, MI_BB_START_PPGTT, lo, hi]
    }
}

/// `gen8_emit_fini_breadcrumb_tail`: the interrupt, arbitration back on,
/// with semaphores (bare metal only) `emit_preempt_busywait` polling the
/// engine's status page, then `gen8_emit_wa_tail`.
pub fn fini_tail(semaphores: bool) -> Vec<u32> {
    let mut cs = vec![MI_USER_INTERRUPT, MI_ARB_ENABLE];
    if semaphores {
        cs.extend([
            MI_ARB_CHECK,
            MI_SEMAPHORE_WAIT_GGTT_POLL_EQ,
            0,
            (HWSP + HWS_PREEMPT_ADDR) as u32,
            0,
            MI_NOOP,
        ]);
    }
    cs.extend([MI_ARB_CHECK, MI_NOOP]);
    cs
}

/// `gen8_emit_fini_breadcrumb_rcs`: a flushing PIPE_CONTROL, then
/// `gen8_emit_ggtt_write_rcs` of the seqno.
pub fn fini_breadcrumb_rcs(seqno: u32, semaphores: bool) -> Vec<u32> {
    let mut cs = vec![
        PIPE_CONTROL,
        PC_CS_STALL
            | PC_TLB_INVALIDATE
            | PC_RENDER_TARGET_CACHE_FLUSH
            | PC_DEPTH_CACHE_FLUSH
            | PC_DC_FLUSH_ENABLE,
        0,
        0,
        0,
        0,
        PIPE_CONTROL,
        PC_FLUSH_ENABLE | PC_CS_STALL | PC_GLOBAL_GTT | PC_QW_WRITE,
        SEQNO as u32,
        0,
        seqno,
        0,
    ];
    cs.extend(fini_tail(semaphores));
    cs
}

/// `gen8_emit_fini_breadcrumb_xcs`: `gen8_emit_ggtt_write` (MI_FLUSH_DW
/// storing the seqno through the GGTT).
pub fn fini_breadcrumb_xcs(seqno: u32, semaphores: bool) -> Vec<u32> {
    let mut cs = vec![
        MI_FLUSH_DW | MI_FLUSH_DW_OP_STOREDW,
        SEQNO as u32 | MI_FLUSH_DW_USE_GTT,
        0,
        seqno,
    ];
    cs.extend(fini_tail(semaphores));
    cs
}

/// A render request: invalidate, initial breadcrumb, batch start, final
/// breadcrumb; as a vGPU guest emits it, or on bare metal.
pub fn render_request(batch_gma: u64, seqno: u32, bare_metal: bool) -> Vec<u32> {
    let mut ring = rcs_invalidate();
    ring.extend(init_breadcrumb(seqno));
    ring.extend(bb_start(batch_gma, bare_metal));
    ring.extend(fini_breadcrumb_rcs(seqno, bare_metal));
    ring
}

pub fn blitter_request(batch_gma: u64, seqno: u32, bare_metal: bool) -> Vec<u32> {
    let mut ring = xcs_invalidate();
    ring.extend(init_breadcrumb(seqno));
    ring.extend(bb_start(batch_gma, bare_metal));
    ring.extend(fini_breadcrumb_xcs(seqno, bare_metal));
    ring
}
