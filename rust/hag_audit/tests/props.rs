//! Property tests: random dword streams never panic and everything accepted
//! stays inside its address space (graphics memory or the PPGTT); encode →
//! decode round-trips in both spaces.

mod common;

use std::collections::BTreeSet;

use common::*;
use hag_audit::audit::AddressSpace::{Ggtt, Ppgtt};
use hag_audit::audit::{
    audit, encode, pages_of, AddressSpace, AuditConfig, Blit, BlitKind, Command, PostSync,
    SliceMemory, Strided, Surface, WriteRange, WriteSet,
};
use proptest::prelude::*;

/// Small graphics memory so random addresses often land near the limit.
const SMALL: u64 = 0x2_0000;
/// A PPGTT of another size, so that mixing the two limits up shows.
const SMALL_PPGTT: u64 = 0x3_0000;

/// An address near the interesting region: inside, at or past the end.
fn addr() -> impl Strategy<Value = u64> {
    prop_oneof![
        (0..SMALL / 4).prop_map(|d| d * 4),
        (SMALL - 64..SMALL + 64).prop_map(|a| a & !3),
        (SMALL_PPGTT - 64..SMALL_PPGTT + 64).prop_map(|a| a & !3),
        any::<u64>(),
    ]
}

/// A chunk of a command stream: garbage, or a mostly-valid command.
fn chunk() -> impl Strategy<Value = Vec<u32>> {
    let rect =
        || {
            (addr(), 0u16..0x200, 0u16..64, 0u16..64)
                .prop_map(|(base, pitch, x, y)| encode::BlitRect { base, pitch, x, y })
        };
    prop_oneof![
        prop::collection::vec(any::<u32>(), 1..8),
        Just(encode::noop().to_vec()),
        Just(encode::arb_check().to_vec()),
        any::<bool>().prop_map(|on| encode::arb_on_off(on).to_vec()),
        Just(encode::batch_buffer_end().to_vec()),
        (addr(), any::<bool>())
            .prop_map(|(a, s)| encode::batch_buffer_start(a % 0x1_0000, s).to_vec()),
        (addr(), any::<bool>()).prop_map(|(a, s)| encode::batch_buffer_start(a, s).to_vec()),
        (addr(), any::<bool>()).prop_map(|(a, s)| encode::batch_buffer_start_ppgtt(
            a % 0x1_0000,
            s
        )
        .to_vec()),
        (addr(), any::<u32>())
            .prop_map(|(a, v)| encode::ppgtt(encode::store_data_imm(a, v)).to_vec()),
        (addr(), addr()).prop_map(|(d, s)| encode::ppgtt(encode::copy_mem_mem(d, s)).to_vec()),
        (any::<u32>(), addr(), any::<u64>()).prop_map(|(f, a, v)| {
            encode::ppgtt(encode::pipe_control_write_imm(f, a, v)).to_vec()
        }),
        (addr(), any::<u32>()).prop_map(|(a, v)| encode::store_data_imm(a, v).to_vec()),
        (addr(), any::<u64>()).prop_map(|(a, v)| encode::store_qword_imm(a, v).to_vec()),
        (any::<u16>(), any::<u32>()).prop_map(|(o, v)| encode::store_data_index(o, v).to_vec()),
        (
            prop::sample::select(vec![0x2600u32, 0x2604, 0x20d8, 0x2000]),
            any::<u32>()
        )
            .prop_map(|(r, v)| encode::load_register_imm(r, v).to_vec()),
        addr().prop_map(|a| encode::store_register_mem(0x2600, a).to_vec()),
        (addr(), addr()).prop_map(|(d, s)| encode::copy_mem_mem(d, s).to_vec()),
        (addr(), any::<u8>(), 0u8..4).prop_map(|(a, o, s)| encode::atomic(a, o, s).to_vec()),
        (addr(), any::<u32>()).prop_map(|(a, v)| encode::flush_dw_store(a, v).to_vec()),
        (any::<u32>(), addr(), any::<u64>())
            .prop_map(|(f, a, v)| encode::pipe_control_write_imm(f, a, v).to_vec()),
        (addr(), any::<u32>(), any::<u8>())
            .prop_map(|(a, d, c)| encode::semaphore_wait(a, d, c).to_vec()),
        (
            rect(),
            any::<u8>(),
            any::<u16>(),
            any::<u16>(),
            any::<u32>()
        )
            .prop_map(|(r, b, w, h, c)| encode::xy_color_blt(r, b, w % 300, h % 300, c).to_vec()),
        (rect(), rect(), any::<u8>(), any::<u16>(), any::<u16>()).prop_map(|(d, s, b, w, h)| {
            encode::xy_src_copy_blt(d, s, b, w % 300, h % 300).to_vec()
        }),
        (rect(), rect(), any::<u8>(), any::<u16>(), any::<u16>())
            .prop_map(|(d, s, b, w, h)| encode::xy_fast_copy_blt(d, s, b, w, h).to_vec()),
    ]
}

fn stream(max: usize) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(chunk(), 0..max).prop_map(|c| c.concat())
}

/// Every address a command reads or writes, with its space and length.
fn accesses(c: &Command) -> Vec<(AddressSpace, u64, u64)> {
    let mut v: Vec<(AddressSpace, u64, u64)> = c
        .write_set()
        .ranges()
        .map(|w| (w.space, w.gfx_addr, w.len))
        .collect();
    match *c {
        Command::CopyMemMem { src_space, src, .. } => v.push((src_space, src, 4)),
        Command::LoadRegisterMem { space, addr, .. }
        | Command::SemaphoreWait { space, addr, .. }
        | Command::BatchStart { space, addr, .. } => v.push((space, addr, 4)),
        Command::Blit(Blit {
            src: Some(s),
            bpp,
            width,
            height,
            ..
        }) => {
            let e = s.rect(bpp, width, height).unwrap().extent().unwrap();
            v.push((e.space, e.gfx_addr, e.len));
        }
        _ => {}
    }
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn random_streams_never_panic_and_stay_inside(ring in stream(24), batch in stream(48),
                                                  with_ppgtt in any::<bool>(), mem_in_ppgtt in any::<bool>()) {
        // Batch memory: the random stream repeated over the first 64 KiB of
        // one space.
        let mut mem_dw = vec![0u32; 0x4000];
        if !batch.is_empty() {
            for (i, d) in mem_dw.iter_mut().enumerate() {
                *d = batch[i % batch.len()];
            }
        }
        let ppgtt_size = if with_ppgtt { SMALL_PPGTT } else { 0 };
        let cfg = AuditConfig {
            max_commands: 4096,
            ..AuditConfig::new(SMALL, 0x1000).with_registers(REGS).with_ppgtt(ppgtt_size)
        };
        let space = if mem_in_ppgtt { Ppgtt } else { Ggtt };
        let mut mem = SliceMemory { space, base: 0, dwords: &mem_dw };
        let mut sink = Sink::default();
        let r = audit(&ring, RING, &cfg, &mut mem, &mut sink);
        if let Ok(s) = r {
            prop_assert!(s.commands <= cfg.max_commands);
            prop_assert!(usize::try_from(s.batches).unwrap() <= cfg.max_batches);
        }
        let mut batch_space = Ggtt;
        for c in &sink.cmds {
            for (space, a, len) in accesses(&c.kind) {
                let limit = cfg.space_size(space);
                prop_assert!(limit > 0, "{c:?} uses a space the config refuses");
                prop_assert!(a.checked_add(len).is_some_and(|e| e <= limit), "{c:?}");
            }
            prop_assert!(c.level <= cfg.max_batch_depth);
            // The ring is GGTT; every batch level follows the ring's start,
            // and everything a PPGTT batch touches outside the status page
            // is PPGTT.
            if c.level == 0 {
                prop_assert_eq!(c.space, Ggtt);
            } else {
                prop_assert_eq!(c.space, batch_space);
            }
            if let Command::BatchStart { space, .. } = c.kind {
                if c.level == 0 {
                    batch_space = space;
                } else {
                    prop_assert_eq!(space, batch_space);
                }
            }
            if c.level > 0 && batch_space == Ppgtt {
                let ggtt = accesses(&c.kind).into_iter().filter(|a| a.0 == Ggtt).count();
                let hwsp = matches!(c.kind, Command::StoreDataIndex { .. }
                    | Command::FlushDw { .. } | Command::PipeControl { .. });
                prop_assert!(ggtt == 0 || hwsp, "{c:?}");
            }
        }
    }

    #[test]
    fn pure_garbage_never_panics(ring in prop::collection::vec(any::<u32>(), 0..64),
                                 mem_dw in prop::collection::vec(any::<u32>(), 0..256)) {
        let cfg = AuditConfig::new(0x1000, 0).with_ppgtt(0x2000);
        let space = if mem_dw.len() % 2 == 0 { Ggtt } else { Ppgtt };
        let mut mem = SliceMemory { space, base: 0, dwords: &mem_dw };
        let mut sink = Sink::default();
        let _ = audit(&ring, u64::MAX - 8, &cfg, &mut mem, &mut sink);
        for c in &sink.cmds {
            for (space, a, len) in accesses(&c.kind) {
                prop_assert!(a + len <= cfg.space_size(space));
            }
        }
    }

    #[test]
    fn store_and_copy_round_trip(a in 0..GFX / 8, b in 0..GFX / 4, v in any::<u64>(), reg in prop::sample::select(REGS.to_vec())) {
        let (q, d) = (a * 8, b * 4);
        let cases: Vec<(Vec<u32>, Command)> = vec![
            (encode::store_data_imm(d, v as u32).to_vec(), Command::StoreDataImm { space: Ggtt, addr: d, data: [v as u32, 0], qword: false }),
            (encode::store_qword_imm(q, v).to_vec(), Command::StoreDataImm { space: Ggtt, addr: q, data: [v as u32, (v >> 32) as u32], qword: true }),
            (encode::store_register_mem(reg, d).to_vec(), Command::StoreRegisterMem { space: Ggtt, reg, addr: d }),
            (encode::load_register_mem(reg, d).to_vec(), Command::LoadRegisterMem { space: Ggtt, reg, addr: d }),
            (encode::load_register_imm(reg, v as u32).to_vec(), Command::LoadRegisterImm { reg, value: v as u32, byte_disable: 0 }),
            (encode::copy_mem_mem(d, q).to_vec(), Command::CopyMemMem { dst_space: Ggtt, src_space: Ggtt, dst: d, src: q }),
            (encode::semaphore_wait(d, v as u32, 5).to_vec(), Command::SemaphoreWait { space: Ggtt, addr: d, data: v as u32, compare: 5, poll: true }),
            (encode::flush_dw_store(q, v as u32).to_vec(), Command::FlushDw { post_sync: PostSync::WriteImm { space: Ggtt, addr: q, data: [v as u32, 0] }, notify: false }),
            (encode::flush_dw_store_qword(q, v).to_vec(), Command::FlushDw { post_sync: PostSync::WriteImm { space: Ggtt, addr: q, data: [v as u32, (v >> 32) as u32] }, notify: false }),
            (encode::flush_dw_timestamp(q).to_vec(), Command::FlushDw { post_sync: PostSync::Timestamp { space: Ggtt, addr: q }, notify: false }),
            (encode::pipe_control_write_imm(0, q, v).to_vec(), Command::PipeControl { flags: 0x0100_4000, post_sync: PostSync::WriteImm { space: Ggtt, addr: q, data: [v as u32, (v >> 32) as u32] } }),
            (encode::pipe_control_timestamp(0, q).to_vec(), Command::PipeControl { flags: 0x0100_c000, post_sync: PostSync::Timestamp { space: Ggtt, addr: q } }),
        ];
        for (dw, want) in cases {
            let (r, cmds) = run(&dw);
            prop_assert!(r.is_ok(), "{dw:08x?}: {r:?}");
            prop_assert_eq!(cmds.len(), 1);
            prop_assert_eq!(cmds[0].kind, want);
        }
    }

    #[test]
    fn index_and_atomic_round_trip(off in 0u16..0x200, v in any::<u64>(), a in 0..GFX / 16,
                                   op in 0u8..0x60, size in 0u8..3, data in any::<[u32; 8]>()) {
        let off8 = off * 8;
        let (r, cmds) = run(&encode::store_qword_index(off8, v));
        prop_assert!(r.is_ok());
        prop_assert_eq!(cmds[0].kind, Command::StoreDataIndex { offset: off8, addr: HWSP + u64::from(off8), data: [v as u32, (v >> 32) as u32], qword: true });
        let (r, cmds) = run(&encode::flush_dw_store_index(off8, v as u32, true));
        prop_assert!(r.is_ok());
        prop_assert_eq!(cmds[0].kind.write_set(), WriteSet::Range(WriteRange { space: Ggtt, gfx_addr: HWSP + u64::from(off8), len: 8 }));
        let addr = a * 16;
        let len = [4u8, 8, 16][usize::from(size)].max([4u8, 8, 16][usize::from(op >> 5)]);
        let (r, cmds) = run(&encode::atomic_inline(addr, op, size, data));
        prop_assert!(r.is_ok(), "{r:?}");
        prop_assert_eq!(cmds[0].kind, Command::Atomic { space: Ggtt, addr, len, opcode: op, size, inline_data: Some(data) });
    }

    #[test]
    fn blit_round_trip(base in 0u64..GFX / 2, pitch in 0u16..0x2000, x in 0u16..0x400, y in 0u16..0x400,
                       w in 1u16..0x100, h in 1u16..0x100, sx in 0u16..0x400, sy in 0u16..0x400,
                       bpp_i in 0usize..5, color in any::<u32>()) {
        let bpp = [1u8, 2, 4, 8, 16][bpp_i];
        let legacy_bpp = [1u8, 2, 4, 4, 4][bpp_i];
        let d = encode::BlitRect { base, pitch, x, y };
        let s = encode::BlitRect { base: base / 2, pitch, x: sx, y: sy };
        let dst = Surface { space: Ggtt, base, pitch, x, y };
        let src = Surface { space: Ggtt, base: base / 2, pitch, x: sx, y: sy };
        let cases = [
            (encode::xy_color_blt(d, legacy_bpp, w, h, color).to_vec(),
             Blit { kind: BlitKind::Color, bpp: legacy_bpp, width: w, height: h, dst, src: None, rop: 0xf0, color }),
            (encode::xy_src_copy_blt(d, s, legacy_bpp, w, h).to_vec(),
             Blit { kind: BlitKind::SrcCopy, bpp: legacy_bpp, width: w, height: h, dst, src: Some(src), rop: 0xcc, color: 0 }),
            (encode::xy_fast_copy_blt(d, s, bpp, w, h).to_vec(),
             Blit { kind: BlitKind::FastCopy, bpp, width: w, height: h, dst, src: Some(src), rop: 0, color: 0 }),
        ];
        for (dw, want) in cases {
            let (r, cmds) = run(&dw);
            let ext = dst.rect(want.bpp, w, h).unwrap().extent().unwrap();
            if ext.end() > GFX {
                prop_assert!(r.is_err());
                continue;
            }
            prop_assert!(r.is_ok(), "{r:?}");
            prop_assert_eq!(cmds[0].kind, Command::Blit(want));
            // The rows are exactly the rectangle's bytes.
            let rows: Vec<_> = cmds[0].kind.write_set().ranges().collect();
            prop_assert_eq!(rows.len(), usize::from(h));
            for (i, r) in rows.iter().enumerate() {
                let row = u64::from(y) + i as u64;
                prop_assert_eq!(r.gfx_addr, base + row * u64::from(pitch) + u64::from(x) * u64::from(want.bpp));
                prop_assert_eq!(r.len, u64::from(w) * u64::from(want.bpp));
            }
        }
    }

    #[test]
    fn batch_start_round_trip(a in 0..GFX / 4, second in any::<bool>()) {
        let addr = a * 4;
        let mut mem = Mem::new();
        mem.put(0x10, &cat(&[&encode::batch_buffer_start(addr, second), &encode::batch_buffer_end()]));
        mem.put(addr, &encode::batch_buffer_end());
        let (r, cmds) = run_with(&encode::batch_buffer_start(0x10, false), &cfg(), &mut mem);
        prop_assert!(r.is_ok(), "{r:?}");
        let level = if second { 2 } else { 1 };
        prop_assert_eq!(cmds[1].kind, Command::BatchStart { space: Ggtt, addr, second_level: second, level, already_audited: addr == 0x10 && !second });
    }

    #[test]
    fn ppgtt_batch_round_trip(a in 0x40..PPGTT / 4 - 16, b in 0..PPGTT / 8, v in any::<u64>(), ggtt_bit in any::<bool>(), second in any::<bool>()) {
        // A PPGTT batch calls or chains to another anywhere in the PPGTT;
        // its stores are PPGTT with or without the GGTT bit.
        let (addr, q) = ((a * 4) & !0xf, b * 8);
        let store = encode::store_qword_imm(q, v);
        let store = if ggtt_bit { store } else { encode::ppgtt(store) };
        let mut mem = Mem::new();
        mem.put_ppgtt(0x10, &cat(&[&encode::batch_buffer_start_ppgtt(addr, second), &encode::batch_buffer_end()]));
        mem.put_ppgtt(addr, &cat(&[&store, &encode::batch_buffer_end()]));
        let (r, cmds) = run_with(&encode::batch_buffer_start_ppgtt(0x10, false), &ppgtt_cfg(), &mut mem);
        prop_assert!(r.is_ok(), "{r:?}");
        let level = if second { 2 } else { 1 };
        prop_assert_eq!(cmds[1].kind, Command::BatchStart { space: Ppgtt, addr, second_level: second, level, already_audited: false });
        prop_assert_eq!(cmds[2].kind, Command::StoreDataImm { space: Ppgtt, addr: q, data: [v as u32, (v >> 32) as u32], qword: true });
        prop_assert_eq!((cmds[2].space, cmds[2].level), (Ppgtt, level));
    }

    #[test]
    fn pages_cover_exactly(addr in any::<u64>(), len in 1u64..0x10_0000) {
        prop_assume!(addr.checked_add(len).is_some());
        let pages: Vec<u64> = pages_of(WriteRange { space: Ggtt, gfx_addr: addr, len }).collect();
        prop_assert_eq!(pages[0], addr / 4096);
        prop_assert_eq!(*pages.last().unwrap(), (addr + len - 1) / 4096);
        prop_assert!(pages.windows(2).all(|w| w[1] == w[0] + 1));
    }

    #[test]
    fn strided_pages_are_the_union_of_row_pages(base in 0u64..0x10_0000, row_bytes in 1u64..0x3000,
                                                pitch in 0u64..0x3000, rows in 1u64..40) {
        let s = WriteSet::Strided(Strided { space: Ggtt, base, row_bytes, pitch, rows });
        let mut want = BTreeSet::new();
        for i in 0..rows {
            want.extend(pages_of(WriteRange { space: Ggtt, gfx_addr: base + i * pitch, len: row_bytes }));
        }
        let got: Vec<u64> = s.pages().collect();
        prop_assert_eq!(got, want.into_iter().collect::<Vec<_>>());
    }

    #[test]
    fn page_runs_cover_every_page_in_bounded_steps(base in 0u64..0x100_0000, row_bytes in 1u64..0x3000,
                                                   pitch in prop_oneof![0u64..0x3000, 0x1000u64..0x2_0000],
                                                   rows in 1u64..600, max_steps in 1u32..300) {
        let s = WriteSet::Strided(Strided { space: Ggtt, base, row_bytes, pitch, rows });
        let want: BTreeSet<u64> = s.pages().collect();
        let runs: Vec<_> = s.page_runs(max_steps).collect();
        // Ascending, disjoint and not touching (merged), all in the set's space.
        prop_assert!(runs.iter().all(|r| r.first <= r.last && r.space == Ggtt));
        prop_assert!(runs.windows(2).all(|w| w[0].last + 1 < w[1].first), "{runs:?}");
        // At most one run per step, plus the final one.
        prop_assert!(runs.len() <= max_steps as usize + 1);
        let got: BTreeSet<u64> = runs.iter().flat_map(|r| r.first..=r.last).collect();
        // Never a page missed; the extent bounds what is claimed.
        prop_assert!(got.is_superset(&want));
        prop_assert_eq!(got.first(), want.first());
        prop_assert_eq!(got.last(), want.last());
        // Exact when every row could be walked, or when every page of the
        // extent is written anyway.
        if rows <= u64::from(max_steps) || pitch < 4096 || pitch.saturating_sub(row_bytes) < 4096 {
            prop_assert_eq!(got, want);
        }
    }
}

#[test]
fn page_runs_of_a_huge_pitch_zero_blit_are_one_row() {
    // 65535 rows of one byte at pitch 0: one page, one run, one step.
    let s = WriteSet::Strided(Strided {
        space: Ggtt,
        base: 0x5000,
        row_bytes: 1,
        pitch: 0,
        rows: 0xffff,
    });
    let runs: Vec<_> = s.page_runs(1).collect();
    assert_eq!(runs.len(), 1);
    assert_eq!((runs[0].first, runs[0].last), (5, 5));
    // Ranges and empty sets.
    let r = WriteSet::Range(WriteRange {
        space: Ppgtt,
        gfx_addr: 0x1ffc,
        len: 8,
    });
    let runs: Vec<_> = r.page_runs(1).collect();
    assert_eq!(runs.len(), 1);
    assert_eq!((runs[0].space, runs[0].first, runs[0].last), (Ppgtt, 1, 2));
    assert_eq!(WriteSet::None.page_runs(4).count(), 0);
}

#[test]
fn blit_rows_repeat_only_when_every_row_writes_the_same() {
    let surf = |base, pitch| Surface {
        space: Ggtt,
        base,
        pitch,
        x: 0,
        y: 0,
    };
    let blit = |kind, dst, src| Blit {
        kind,
        bpp: 1,
        width: 4,
        height: 100,
        dst,
        src,
        rop: 0,
        color: 7,
    };
    // A fill at pitch 0: one row is the whole blit.
    assert!(blit(BlitKind::Color, surf(0x1000, 0), None).rows_repeat());
    assert!(!blit(BlitKind::Color, surf(0x1000, 4), None).rows_repeat());
    // A copy of a pitch-0 source row, apart from the destination.
    assert!(blit(BlitKind::SrcCopy, surf(0x1000, 0), Some(surf(0x2000, 0))).rows_repeat());
    // Rows read different bytes, or may read what the last row wrote.
    assert!(!blit(BlitKind::SrcCopy, surf(0x1000, 0), Some(surf(0x2000, 1))).rows_repeat());
    assert!(!blit(BlitKind::FastCopy, surf(0x1000, 0), Some(surf(0x1002, 0))).rows_repeat());
    assert!(blit(BlitKind::FastCopy, surf(0x1000, 0), Some(surf(0x1004, 0))).rows_repeat());
    // XY_COLOR_BLT carries no source: a fill whatever `src` says.
    assert!(blit(BlitKind::Color, surf(0x1000, 0), Some(surf(0x1000, 1))).rows_repeat());
}
