//! The hand-off on recorded command streams: hag_audit's encoders for the
//! GGTT forms, and dwords as i915 emits them in a GVT-g guest (Gen8/Gen9,
//! `gt/gen8_engine_cs.c`) for the PPGTT forms and the ring around a batch.

use std::collections::BTreeMap;

use hag_gvt::audit::GfxMemory;
use hag_gvt::audit::{encode, AddressSpace, AuditError, Reason};
use hag_gvt::handoff::{
    hand_off, Limits, Outcome, ShadowBb, ShadowMemory, Translate, TranslateFault, Unmodelled,
    Workload, MAX_SHADOWS,
};

use AddressSpace::{Ggtt, Ppgtt};

mod common;
use common::i915::*;

/// The vGPU's GGTT in these tests: 256 MiB.
const GGTT_SIZE: u64 = 256 << 20;
/// Where the ring slice starts.
const RING: u64 = 0x10_0000;

/// A page table: graphics page → guest frame, per address space; logs
/// every lookup.
#[derive(Default)]
struct FakeGtt {
    /// Keyed by (PPGTT?, page).
    map: BTreeMap<(bool, u64), u64>,
    lookups: Vec<(AddressSpace, u64)>,
}

impl FakeGtt {
    fn map(mut self, space: AddressSpace, gma: u64, gfn: u64) -> Self {
        self.map.insert((space == Ppgtt, gma / 4096), gfn);
        self
    }
}

impl Translate for FakeGtt {
    fn gma_to_gfn(&mut self, space: AddressSpace, gma: u64) -> Result<u64, TranslateFault> {
        assert_eq!(gma % 4096, 0, "the hand-off translates page addresses");
        self.lookups.push((space, gma));
        self.map
            .get(&(space == Ppgtt, gma / 4096))
            .copied()
            .ok_or(TranslateFault)
    }
}

fn shadow(space: AddressSpace, gma: u64, bytes: &[u8]) -> ShadowBb<'_> {
    ShadowBb { space, gma, bytes }
}

fn bytes(dwords: &[u32]) -> Vec<u8> {
    dwords.iter().flat_map(|d| d.to_le_bytes()).collect()
}

/// Runs the hand-off; returns the outcome and the frames in sink order.
fn run(ring: &[u32], bbs: &[ShadowBb<'_>], gtt: &mut FakeGtt) -> (Outcome, Vec<u64>) {
    run_with(ring, bbs, gtt, &Limits::DEFAULT)
}

fn run_with(
    ring: &[u32],
    bbs: &[ShadowBb<'_>],
    gtt: &mut FakeGtt,
    limits: &Limits,
) -> (Outcome, Vec<u64>) {
    let wl = Workload {
        ring,
        ring_gma: RING,
        hwsp_gma: HWSP,
        bbs,
        ggtt_size: GGTT_SIZE,
        indirect_ctx: None,
    };
    let mut gfns = Vec::new();
    let outcome = hand_off(&wl, limits, gtt, &mut |gfn| gfns.push(gfn));
    (outcome, gfns)
}

fn refused(outcome: Outcome) -> AuditError {
    match outcome {
        Outcome::Unmodelled {
            reason: Unmodelled::Refused(e),
        } => e,
        other => panic!("expected an audit refusal, got {other:?}"),
    }
}

/// A ring of GGTT commands from hag_audit's encoders: a store, a flush
/// with a post-sync write and a status-page store.
#[test]
fn ggtt_ring_commands() {
    let mut ring = Vec::new();
    ring.extend(encode::store_data_imm(0x2_0004, 1));
    ring.extend(encode::flush_dw_store(0x3_1008, 2));
    ring.extend(encode::store_data_index(0x40, 3));
    ring.extend(encode::user_interrupt());
    let mut gtt = FakeGtt::default()
        .map(Ggtt, 0x2_0000, 0x900)
        .map(Ggtt, 0x3_1000, 0x901)
        .map(Ggtt, HWSP, 0x77);
    let (outcome, gfns) = run(&ring, &[], &mut gtt);
    assert_eq!(
        outcome,
        Outcome::Audited {
            pages: 3,
            commands: 4
        }
    );
    assert_eq!(gfns, [0x900, 0x901, 0x77]);
}

/// A simplified i915 request on the render ring (`gen8_emit_bb_start`,
/// `gen8_emit_fini_breadcrumb_rcs`): the batch start framed by arbitration
/// on/off, and the breadcrumb (a PIPE_CONTROL writing the seqno to the
/// timeline's status page in the GGTT, then the user interrupt). The user
/// batch lives in the context's PPGTT. The full sequences are in
/// `i915_render_submission` and `i915_blitter_submission`.
fn i915_request(batch_gma: u64, seqno_gma: u64) -> Vec<u32> {
    vec![
        MI_ARB_ENABLE,
        MI_BB_START_PPGTT,
        batch_gma as u32,
        (batch_gma >> 32) as u32,
        MI_ARB_DISABLE,
        MI_NOOP,
        // gen8_emit_ggtt_write_rcs()
        PIPE_CONTROL,
        PC_FLUSH_ENABLE | PC_CS_STALL | PC_QW_WRITE | PC_GLOBAL_GTT,
        seqno_gma as u32,
        0,
        42,
        0,
        MI_USER_INTERRUPT,
        MI_ARB_ENABLE,
    ]
}

/// The user batch: a PIPE_CONTROL post-sync write and a store, both to
/// PPGTT addresses (no GGTT bit), then the end.
fn user_batch(query_gma: u64, fence_gma: u64) -> Vec<u32> {
    vec![
        PIPE_CONTROL,
        PC_CS_STALL | PC_QW_WRITE,
        query_gma as u32,
        (query_gma >> 32) as u32,
        1,
        0,
        MI_SDI_PPGTT,
        fence_gma as u32,
        (fence_gma >> 32) as u32,
        7,
        MI_BB_END,
        MI_NOOP,
    ]
}

#[test]
fn i915_request_with_ppgtt_batch() {
    let batch_gma = 0x7fff_0000_0000;
    let batch = bytes(&user_batch(0x7fff_1000_0ff8, 0x7fff_2000_0010));
    let bbs = [shadow(Ppgtt, batch_gma, &batch)];
    let ring = i915_request(batch_gma, 0x6080);
    let mut gtt = FakeGtt::default()
        .map(Ppgtt, 0x7fff_1000_0000, 0x1_0001)
        .map(Ppgtt, 0x7fff_2000_0000, 0x1_0002)
        .map(Ggtt, 0x6000, 0x50);
    let (outcome, gfns) = run(&ring, &bbs, &mut gtt);
    assert_eq!(
        outcome,
        Outcome::Audited {
            pages: 3,
            commands: 10
        }
    );
    // Execution order: the batch's two writes, then the breadcrumb.
    assert_eq!(gfns, [0x1_0001, 0x1_0002, 0x50]);
    assert_eq!(
        gtt.lookups,
        [
            (Ppgtt, 0x7fff_1000_0000),
            (Ppgtt, 0x7fff_2000_0000),
            (Ggtt, 0x6000)
        ]
    );
}

/// MI_ARB_ON_OFF (and MI_ARB_CHECK) write nothing: a request framed by
/// them has the same write set as one with MI_NOOPs in their place.
#[test]
fn arbitration_is_modelled() {
    let batch_gma = 0x7fff_0000_0000;
    let batch = bytes(&user_batch(0x7fff_1000_0ff8, 0x7fff_2000_0010));
    let bbs = [shadow(Ppgtt, batch_gma, &batch)];
    let with_arb = i915_request(batch_gma, 0x6080);
    assert!(with_arb.contains(&MI_ARB_ENABLE) && with_arb.contains(&MI_ARB_DISABLE));
    let mut with_noops = with_arb.clone();
    for dw in with_noops.iter_mut() {
        if *dw == MI_ARB_ENABLE || *dw == MI_ARB_DISABLE {
            *dw = MI_NOOP;
        }
    }
    let gtt = || {
        FakeGtt::default()
            .map(Ppgtt, 0x7fff_1000_0000, 0x1_0001)
            .map(Ppgtt, 0x7fff_2000_0000, 0x1_0002)
            .map(Ggtt, 0x6000, 0x50)
    };
    let arb = run(&with_arb, &bbs, &mut gtt());
    assert_eq!(
        arb.0,
        Outcome::Audited {
            pages: 3,
            commands: 10
        }
    );
    assert_eq!(arb, run(&with_noops, &bbs, &mut gtt()));
    let mut check = with_arb;
    check.extend([MI_ARB_CHECK, MI_NOOP]);
    assert_eq!(run(&check, &bbs, &mut gtt()).1, [0x1_0001, 0x1_0002, 0x50]);
}

// ---- Full request sequences, dword for dword as Linux 6.12 i915 emits
// them on Gen9 execlists (gt/gen8_engine_cs.c, gt/intel_execlists_submission.c,
// gem/i915_gem_execbuffer.c eb_request_submit), for a user context with its
// own timeline (`has_initial_breadcrumb`).

/// The pages of a render request with `user_batch`: the flush's scratch
/// write in the engine's status page (hag counts it there, in the guest's
/// HWSP, where GVT redirects status-page writes), the timeline's seqno page
/// (initial breadcrumb), the batch's two PPGTT pages, the seqno page again
/// (final breadcrumb).
#[test]
fn i915_render_submission() {
    let batch_gma = 0x7fff_0000_0000;
    let batch = bytes(&user_batch(0x7fff_1000_0ff8, 0x7fff_2000_0010));
    let bbs = [shadow(Ppgtt, batch_gma, &batch)];
    let gtt = || {
        FakeGtt::default()
            .map(Ppgtt, 0x7fff_1000_0000, 0x1_0001)
            .map(Ppgtt, 0x7fff_2000_0000, 0x1_0002)
            .map(Ggtt, SEQNO, SEQNO_GFN)
            .map(Ggtt, HWSP, HWSP_GFN)
    };
    for (bare_metal, commands) in [(false, 16), (true, 21)] {
        let ring = render_request(batch_gma, 42, bare_metal);
        let mut gtt = gtt();
        let (outcome, gfns) = run(&ring, &bbs, &mut gtt);
        assert_eq!(
            outcome,
            Outcome::Audited { pages: 5, commands },
            "{bare_metal}"
        );
        assert_eq!(gfns, [HWSP_GFN, SEQNO_GFN, 0x1_0001, 0x1_0002, SEQNO_GFN]);
        assert_eq!(
            gtt.lookups,
            [
                (Ggtt, HWSP),
                (Ggtt, SEQNO & !0xfff),
                (Ppgtt, 0x7fff_1000_0000),
                (Ppgtt, 0x7fff_2000_0000),
                (Ggtt, SEQNO & !0xfff),
            ]
        );
    }
}

/// A blitter request: the user batch copies a 16x4 rectangle of 32-bit
/// pixels (linear, PPGTT) and flushes with a PPGTT post-sync store.
#[test]
fn i915_blitter_submission() {
    let batch_gma = 0x7ffe_0000_0000;
    let dst = encode::BlitRect {
        base: 0x7ffe_1000_0000,
        pitch: 4096,
        x: 0,
        y: 0,
    };
    let src = encode::BlitRect {
        base: 0x7ffe_2000_0000,
        ..dst
    };
    let mut user = encode::xy_src_copy_blt(dst, src, 4, 16, 4).to_vec();
    // MI_FLUSH_DW + 1 with a post-sync dword store, no USE_GTT: PPGTT.
    user.extend([MI_FLUSH_DW | MI_FLUSH_DW_OP_STOREDW, 0x3000_0008, 0x7ffe, 9]);
    user.extend([MI_BB_END, MI_NOOP]);
    let batch = bytes(&user);
    let bbs = [shadow(Ppgtt, batch_gma, &batch)];
    let mut gtt = FakeGtt::default()
        .map(Ggtt, SEQNO, SEQNO_GFN)
        .map(Ggtt, HWSP, HWSP_GFN)
        .map(Ppgtt, 0x7ffe_3000_0000, 0x2_0003);
    for row in 0..4 {
        gtt = gtt.map(Ppgtt, 0x7ffe_1000_0000 + row * 4096, 0x2_0100 + row);
    }
    for (bare_metal, commands) in [(false, 14), (true, 19)] {
        let ring = blitter_request(batch_gma, 7, bare_metal);
        gtt.lookups.clear();
        let (outcome, gfns) = run(&ring, &bbs, &mut gtt);
        assert_eq!(
            outcome,
            Outcome::Audited { pages: 8, commands },
            "{bare_metal}"
        );
        assert_eq!(
            gfns,
            [HWSP_GFN, SEQNO_GFN, 0x2_0100, 0x2_0101, 0x2_0102, 0x2_0103, 0x2_0003, SEQNO_GFN]
        );
    }
}

/// The only MI_LOAD_REGISTER_IMM i915 puts in a Gen8/Gen9 ring,
/// `emit_pdps` (3-level PPGTTs), loads page-directory pointers: that would
/// move every later PPGTT write, so it stays unmodelled.
#[test]
fn page_directory_pointer_loads_stay_unmodelled() {
    // MI_LOAD_REGISTER_IMM(2) | MI_LRI_FORCE_POSTED: PDP0 upper, lower
    // (GEN8_RING_PDP_UDW/LDW of the render engine).
    let ring = [0x1100_1003, 0x2274, 0, 0x2270, 0x1_2000, MI_NOOP];
    let err = refused(run(&ring, &[], &mut FakeGtt::default()).0);
    assert_eq!(err.reason, Reason::RegisterNotAllowed { reg: 0x2274 });
}

/// The same graphics address in the two spaces is two different pages.
#[test]
fn ggtt_and_ppgtt_translate_separately() {
    let mut ring = Vec::new();
    ring.extend(encode::store_data_imm(0x2_0000, 1));
    ring.extend([MI_SDI_PPGTT, 0x2_0000, 0, 2]);
    ring.extend(encode::store_data_imm(0x2_0ffc, 3));
    let mut gtt = FakeGtt::default()
        .map(Ggtt, 0x2_0000, 0xa)
        .map(Ppgtt, 0x2_0000, 0xb);
    let (outcome, gfns) = run(&ring, &[], &mut gtt);
    assert_eq!(
        outcome,
        Outcome::Audited {
            pages: 3,
            commands: 3
        }
    );
    assert_eq!(gfns, [0xa, 0xb, 0xa]);
}

/// Repeats of the page (or frame) just handled are skipped; a page seen
/// before something else is handed over again (the sink dedups only
/// consecutive frames, which is what bounds its work).
#[test]
fn consecutive_pages_are_deduplicated() {
    let mut ring = Vec::new();
    ring.extend(encode::store_data_imm(0x2_0000, 1));
    ring.extend(encode::store_data_imm(0x2_0010, 2)); // same page
    ring.extend(encode::store_data_imm(0x4_0000, 3)); // another page, same frame
    ring.extend(encode::store_qword_imm(0x3_0ffc & !7, 4));
    let mut gtt = FakeGtt::default()
        .map(Ggtt, 0x2_0000, 0xa)
        .map(Ggtt, 0x4_0000, 0xa)
        .map(Ggtt, 0x3_0000, 0xc);
    let (outcome, gfns) = run(&ring, &[], &mut gtt);
    assert_eq!(
        outcome,
        Outcome::Audited {
            pages: 2,
            commands: 4
        }
    );
    assert_eq!(gfns, [0xa, 0xc]);
    // 0x2_0000 was translated once, 0x4_0000 once, 0x3_0000 once.
    assert_eq!(gtt.lookups.len(), 3);
}

/// A write that straddles a page boundary dirties both pages; a qword
/// store may not straddle (it must be 8-byte aligned), so a misaligned one
/// is not modelled and nothing is translated.
#[test]
fn straddling_write_marks_both_pages() {
    let dst = encode::BlitRect {
        base: 0x8_0ff0,
        pitch: 0x100,
        x: 0,
        y: 0,
    };
    let ring = encode::xy_color_blt(dst, 4, 8, 1, 0);
    let mut gtt = FakeGtt::default()
        .map(Ggtt, 0x8_0000, 0x10)
        .map(Ggtt, 0x8_1000, 0x33);
    let (outcome, gfns) = run(&ring, &[], &mut gtt);
    assert_eq!(
        outcome,
        Outcome::Audited {
            pages: 2,
            commands: 1
        }
    );
    assert_eq!(gfns, [0x10, 0x33]);

    // MI_STORE_DATA_IMM, Store Qword (bit 21), 5 dwords, at 0x8_0ffc.
    let ring = [(MI_SDI_PPGTT + 1) | 1 << 21, 0x8_0ffc, 0, 1, 2];
    gtt.lookups.clear();
    let err = refused(run(&ring, &[], &mut gtt).0);
    assert!(matches!(err.reason, Reason::Misaligned { .. }), "{err}");
    assert!(gtt.lookups.is_empty());
}

/// GVT joins a ring that wraps: the slice is contiguous even where a
/// command crossed the end of the ring buffer.
#[test]
fn ring_wrap_joined() {
    let ring_size = 0x4000u64;
    let head = ring_size - 8; // two dwords before the end
    let mut ring = Vec::new();
    ring.extend(encode::store_data_imm(0x9_0000, 1)); // crosses the end
    ring.extend(encode::store_data_imm(0xa_0000, 2));
    let mut gtt = FakeGtt::default()
        .map(Ggtt, 0x9_0000, 0x90)
        .map(Ggtt, 0xa_0000, 0xa0);
    let wl = Workload {
        ring: &ring,
        ring_gma: RING + head,
        hwsp_gma: HWSP,
        bbs: &[],
        ggtt_size: GGTT_SIZE,
        indirect_ctx: None,
    };
    let mut gfns = Vec::new();
    let outcome = hand_off(&wl, &Limits::DEFAULT, &mut gtt, &mut |g| gfns.push(g));
    assert_eq!(
        outcome,
        Outcome::Audited {
            pages: 2,
            commands: 2
        }
    );
    assert_eq!(gfns, [0x90, 0xa0]);
}

/// A batch with 3D state the auditor does not model: the workload is
/// unmodelled (GVT already accepted it), with the command named.
#[test]
fn state_commands_fall_back() {
    let batch_gma = 0x1_0000_0000;
    let mut batch = vec![STATE_VS, 0, 0, 0, 0, 0, 0, 0, 0];
    batch.extend([MI_BB_END, MI_NOOP]);
    let batch = bytes(&batch);
    let bbs = [shadow(Ppgtt, batch_gma, &batch)];
    let ring = i915_request(batch_gma, 0x6080);
    let mut gtt = FakeGtt::default().map(Ggtt, 0x6000, 0x50);
    let (outcome, _) = run(&ring, &bbs, &mut gtt);
    let err = refused(outcome);
    assert_eq!(err.gfx_addr, batch_gma);
    assert_eq!(err.header, Some(STATE_VS));
}

/// A written page GVT cannot translate: unmodelled, naming the page.
#[test]
fn translation_failure_falls_back() {
    let batch_gma = 0x20_0000;
    let batch = bytes(&user_batch(0x30_0000, 0x40_0000));
    let bbs = [shadow(Ppgtt, batch_gma, &batch)];
    let ring = i915_request(batch_gma, 0x6080);
    let mut gtt = FakeGtt::default()
        .map(Ppgtt, 0x30_0000, 0x300)
        .map(Ggtt, 0x6000, 0x50);
    let (outcome, gfns) = run(&ring, &bbs, &mut gtt);
    assert_eq!(
        outcome,
        Outcome::Unmodelled {
            reason: Unmodelled::Untranslatable {
                space: Ppgtt,
                gma: 0x40_0000
            }
        }
    );
    // What was handed over before the failure stays (it only adds pages).
    assert_eq!(gfns, [0x300]);
}

/// The PPGTT page table maps the page, but only in the other space.
#[test]
fn translation_is_per_space() {
    let ring = [MI_SDI_PPGTT, 0x2_0000, 0, 2];
    let mut gtt = FakeGtt::default().map(Ggtt, 0x2_0000, 0xa);
    let (outcome, gfns) = run(&ring, &[], &mut gtt);
    assert_eq!(
        outcome,
        Outcome::Unmodelled {
            reason: Unmodelled::Untranslatable {
                space: Ppgtt,
                gma: 0x2_0000
            }
        }
    );
    assert!(gfns.is_empty());
}

/// A batch GVT did not shadow (or shadowed in the other space, or shorter
/// than what the auditor reads) is never read from anywhere else.
#[test]
fn batch_outside_shadow_falls_back() {
    let batch = bytes(&user_batch(0x30_0000, 0x40_0000));
    let ring = i915_request(0x20_0000, 0x6080);
    let gtt = || {
        FakeGtt::default()
            .map(Ppgtt, 0x30_0000, 0x300)
            .map(Ppgtt, 0x40_0000, 0x400)
            .map(Ggtt, 0x6000, 0x50)
    };

    // Not shadowed at all.
    let err = refused(run(&ring, &[], &mut gtt()).0);
    assert!(
        matches!(
            err.reason,
            Reason::MemoryFault {
                space: Ppgtt,
                addr: 0x20_0000
            }
        ),
        "{err}"
    );

    // Shadowed, but as a GGTT buffer.
    let bbs = [shadow(Ggtt, 0x20_0000, &batch)];
    let err = refused(run(&ring, &bbs, &mut gtt()).0);
    assert!(matches!(err.reason, Reason::MemoryFault { .. }), "{err}");

    // Shadowed without its end: the auditor reads past the copy.
    let bbs = [shadow(Ppgtt, 0x20_0000, &batch[..40])];
    let err = refused(run(&ring, &bbs, &mut gtt()).0);
    assert!(matches!(err.reason, Reason::MemoryFault { .. }), "{err}");

    // The whole copy: audited.
    let bbs = [shadow(Ppgtt, 0x20_0000, &batch)];
    let (outcome, gfns) = run(&ring, &bbs, &mut gtt());
    assert_eq!(
        outcome,
        Outcome::Audited {
            pages: 3,
            commands: 10
        }
    );
    assert_eq!(gfns, [0x300, 0x400, 0x50]);
}

/// Two copies of overlapping guest bytes: the GPU would run both, the
/// auditor read one.
#[test]
fn overlapping_shadows_fall_back() {
    let batch = bytes(&user_batch(0x30_0000, 0x40_0000));
    let ring = i915_request(0x20_0000, 0x6080);
    let bbs = [
        shadow(Ppgtt, 0x20_0000, &batch),
        shadow(Ppgtt, 0x20_0010, &batch),
    ];
    let (outcome, gfns) = run(&ring, &bbs, &mut FakeGtt::default());
    assert_eq!(
        outcome,
        Outcome::Unmodelled {
            reason: Unmodelled::OverlappingShadows {
                first: 0x20_0000,
                second: 0x20_0010
            }
        }
    );
    assert!(gfns.is_empty());

    // The same addresses in different spaces do not overlap.
    let bbs = [
        shadow(Ppgtt, 0x20_0000, &batch),
        shadow(Ggtt, 0x20_0000, &batch),
    ];
    assert_eq!(ShadowMemory::new(&bbs).overlap(), None);
}

#[test]
fn too_many_shadows_fall_back() {
    let one = [0u8; 4];
    let bbs: Vec<ShadowBb<'_>> = (0..=MAX_SHADOWS as u64)
        .map(|i| shadow(Ggtt, i * 8, &one))
        .collect();
    let (outcome, _) = run(&encode::noop(), &bbs, &mut FakeGtt::default());
    assert_eq!(
        outcome,
        Outcome::Unmodelled {
            reason: Unmodelled::TooManyShadows {
                count: MAX_SHADOWS + 1
            }
        }
    );
}

/// A blit whose rows cover many pages: beyond the page limit the workload
/// is unmodelled, and the translations stop there.
#[test]
fn page_limit_falls_back() {
    let dst = encode::BlitRect {
        base: 0x100_0000,
        pitch: 0x1000,
        x: 0,
        y: 0,
    };
    let ring = encode::xy_color_blt(dst, 4, 16, 64, 0xffff_ffff);
    let mut gtt = FakeGtt::default();
    for page in 0..64 {
        gtt = gtt.map(Ggtt, 0x100_0000 + page * 0x1000, 0x5000 + page);
    }
    let (outcome, gfns) = run(&ring, &[], &mut gtt);
    assert_eq!(
        outcome,
        Outcome::Audited {
            pages: 64,
            commands: 1
        }
    );
    assert_eq!(gfns, (0x5000..0x5040).collect::<Vec<_>>());

    let limits = Limits {
        max_pages: 10,
        ..Limits::DEFAULT
    };
    gtt.lookups.clear();
    let (outcome, gfns) = run_with(&ring, &[], &mut gtt, &limits);
    assert_eq!(
        outcome,
        Outcome::Unmodelled {
            reason: Unmodelled::TooManyPages { limit: 10 }
        }
    );
    assert_eq!(gfns.len(), 10);
    assert_eq!(gtt.lookups.len(), 10);

    let limits = Limits {
        max_ranges: 5,
        ..Limits::DEFAULT
    };
    let (outcome, _) = run_with(&ring, &[], &mut gtt, &limits);
    assert_eq!(
        outcome,
        Outcome::Unmodelled {
            reason: Unmodelled::TooManyRanges { limit: 5 }
        }
    );
}

/// Writes past the vGPU's GGTT are refused by the auditor (GVT would not
/// have passed them either), in the PPGTT they are fine up to 2^48.
#[test]
fn ggtt_size_bounds_ggtt_only() {
    let ring = encode::store_data_imm(GGTT_SIZE, 1);
    let err = refused(run(&ring, &[], &mut FakeGtt::default()).0);
    assert!(
        matches!(err.reason, Reason::AddressOutOfRange { .. }),
        "{err}"
    );

    let high = (1u64 << 48) - 4096;
    let ring = [MI_SDI_PPGTT, high as u32, (high >> 32) as u32, 1];
    let mut gtt = FakeGtt::default().map(Ppgtt, high, 0xfff);
    let (outcome, gfns) = run(&ring, &[], &mut gtt);
    assert_eq!(
        outcome,
        Outcome::Audited {
            pages: 1,
            commands: 1
        }
    );
    assert_eq!(gfns, [0xfff]);
}

/// A status page outside the GGTT is a bad configuration: unmodelled, not
/// a failure.
#[test]
fn bad_status_page_falls_back() {
    let ring = encode::store_data_index(0, 1);
    let wl = Workload {
        ring: &ring,
        ring_gma: RING,
        hwsp_gma: GGTT_SIZE,
        bbs: &[],
        ggtt_size: GGTT_SIZE,
        indirect_ctx: None,
    };
    let outcome = hand_off(&wl, &Limits::DEFAULT, &mut FakeGtt::default(), &mut |_| {});
    let err = refused(outcome);
    assert!(matches!(err.reason, Reason::BadConfig { .. }), "{err}");
}

#[test]
fn shadow_memory_reads_inside_one_copy_only() {
    let a = bytes(&[1, 2, 3, 4]);
    let b = bytes(&[5, 6]);
    let bbs = [shadow(Ppgtt, 0x1000, &a), shadow(Ppgtt, 0x1010, &b)];
    let mut mem = ShadowMemory::new(&bbs);
    let mut out = [0u32; 2];
    mem.read_dwords(Ppgtt, 0x1008, &mut out).unwrap();
    assert_eq!(out, [3, 4]);
    mem.read_dwords(Ppgtt, 0x1010, &mut out).unwrap();
    assert_eq!(out, [5, 6]);
    // Across two adjacent copies: a fault, not a stitched read.
    assert!(mem.read_dwords(Ppgtt, 0x100c, &mut out).is_err());
    assert!(mem.read_dwords(Ggtt, 0x1000, &mut out).is_err());
    assert!(mem.read_dwords(Ppgtt, 0xffc, &mut out).is_err());
    assert!(mem.read_dwords(Ppgtt, u64::MAX - 3, &mut out).is_err());
    let mut none: [u32; 0] = [];
    assert!(mem.read_dwords(Ppgtt, 0x1000, &mut none).is_ok());
}

/// Garbage rings and batches never panic, and every outcome is one of the
/// two.
#[test]
fn garbage_never_panics() {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut gtt = FakeGtt::default();
    for page in 0..16 {
        gtt = gtt
            .map(Ggtt, page * 4096, page)
            .map(Ppgtt, page * 4096, 100 + page);
    }
    for _ in 0..3000 {
        let n = (next() % 24) as usize;
        // Mostly plausible headers with small addresses.
        let ring: Vec<u32> = (0..n)
            .map(|_| match next() % 4 {
                0 => (next() as u32) & 0xffff,
                1 => MI_SDI_PPGTT | (next() as u32 & 0x0040_0001),
                2 => {
                    [PIPE_CONTROL, MI_BB_START_PPGTT, MI_ARB_ENABLE, MI_BB_END][next() as usize % 4]
                }
                _ => next() as u32,
            })
            .collect();
        let batch = bytes(&ring);
        let bbs = [shadow(
            if next() % 2 == 0 { Ggtt } else { Ppgtt },
            (next() % 8) * 4096,
            &batch,
        )];
        let (outcome, gfns) = run(&ring, &bbs, &mut gtt);
        if let Outcome::Audited { pages, .. } = outcome {
            assert_eq!(pages as usize, gfns.len());
        }
    }
}

/// i915's Gen9 indirect context buffer (`gen9_init_indirectctx_bb`): its
/// MI_STORE_REGISTER_MEM to the GT scratch page is a write of the
/// workload (issue 15, item 3), audited with the registers i915 names.
#[test]
fn indirect_ctx_srm_is_audited() {
    const SCRATCH: u64 = 0x7_0100;
    const GEN8_L3SQCREG4: u32 = 0xb118;
    let ictx = [
        MI_ARB_DISABLE,
        0x1240_0002, // MI_STORE_REGISTER_MEM_GEN8 | MI_SRM_LRM_GLOBAL_GTT
        GEN8_L3SQCREG4,
        SCRATCH as u32,
        0,
        0x1100_0001, // MI_LOAD_REGISTER_IMM(1)
        GEN8_L3SQCREG4,
        0x4040_0000 | 1 << 21,
        PIPE_CONTROL,
        PC_CS_STALL | 1 << 5, // DC flush
        0,
        0,
        0,
        0,
        0x1480_0002, // MI_LOAD_REGISTER_MEM_GEN8 | MI_SRM_LRM_GLOBAL_GTT
        GEN8_L3SQCREG4,
        SCRATCH as u32,
        0,
        0x1100_0001,
        0x7014, // COMMON_SLICE_CHICKEN2
        0x0100_0000,
        MI_ARB_ENABLE,
    ];
    let ring = [MI_NOOP, MI_NOOP];
    let mut gtt = FakeGtt::default().map(Ggtt, SCRATCH & !0xfff, 0x4242);
    let wl = Workload {
        ring: &ring,
        ring_gma: RING,
        hwsp_gma: HWSP,
        bbs: &[],
        ggtt_size: GGTT_SIZE,
        indirect_ctx: Some(hag_gvt::handoff::IndirectCtx {
            gma: 0x6_0000,
            dwords: &ictx,
        }),
    };
    let mut gfns = Vec::new();
    let outcome = hand_off(&wl, &Limits::DEFAULT, &mut gtt, &mut |g| gfns.push(g));
    assert!(matches!(outcome, Outcome::Audited { .. }), "{outcome:?}");
    assert_eq!(gfns, [0x4242]);

    // A register i915 does not put there is not modelled.
    let mut bad = ictx;
    bad[2] = 0x2080; // a ring register
    let wl = Workload {
        indirect_ctx: Some(hag_gvt::handoff::IndirectCtx {
            gma: 0x6_0000,
            dwords: &bad,
        }),
        ..wl
    };
    let outcome = hand_off(&wl, &Limits::DEFAULT, &mut gtt, &mut |_| {});
    assert!(
        matches!(
            outcome,
            Outcome::Unmodelled {
                reason: Unmodelled::IndirectCtxRefused(_)
            }
        ),
        "{outcome:?}"
    );
}

/// A batch GVT shadowed that no stream the hand-off was given starts (as
/// the per-context batch of an indirect context, when the indirect
/// context is not handed over with its chaining batch start) may still
/// run: the workload is not modelled.
#[test]
fn unreached_shadow_is_unmodelled() {
    let batch = bytes(&[MI_SDI_GGTT, 0x9_0000, 0, 1, MI_BB_END]);
    let bbs = [shadow(Ggtt, 0x8_0000, &batch)];
    let ring = [MI_NOOP, MI_NOOP];
    let mut gtt = FakeGtt::default().map(Ggtt, 0x9_0000, 0x99);
    let (outcome, _) = run(&ring, &bbs, &mut gtt);
    assert_eq!(
        outcome,
        Outcome::Unmodelled {
            reason: Unmodelled::UnreachedShadow {
                space: Ggtt,
                gma: 0x8_0000
            }
        }
    );

    // Handed over with the indirect context that chains to it (GVT's
    // `combine_wa_ctx`: MI_BATCH_BUFFER_START, GGTT, after the buffer),
    // the same batch is audited.
    let ictx = [MI_NOOP, MI_NOOP, 0x1880_0001, 0x8_0000, 0];
    let wl = Workload {
        ring: &ring,
        ring_gma: RING,
        hwsp_gma: HWSP,
        bbs: &bbs,
        ggtt_size: GGTT_SIZE,
        indirect_ctx: Some(hag_gvt::handoff::IndirectCtx {
            gma: 0x6_0000,
            dwords: &ictx,
        }),
    };
    let mut gfns = Vec::new();
    let outcome = hand_off(&wl, &Limits::DEFAULT, &mut gtt, &mut |g| gfns.push(g));
    assert!(matches!(outcome, Outcome::Audited { .. }), "{outcome:?}");
    assert_eq!(gfns, [0x99]);
}
