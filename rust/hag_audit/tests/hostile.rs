//! Hostile input: every way a guest can get a command wrong is rejected with
//! the offending numbers, and nothing panics.

mod common;

use common::*;
use hag_audit::audit::AddressSpace::{Ggtt, Ppgtt};
use hag_audit::audit::{
    audit, encode, AuditConfig, Command, NoSink, Reason, SliceMemory, WriteRange, WriteSet,
    MAX_GFX_MEM_SIZE,
};

fn reason(ring: &[u32]) -> Reason {
    let (r, _) = run(ring);
    r.expect_err("should be rejected").reason
}

/// One valid instance of every multi-dword command.
fn samples() -> Vec<Vec<u32>> {
    let r = encode::BlitRect {
        base: 0x10_0000,
        pitch: 0x100,
        x: 0,
        y: 0,
    };
    vec![
        encode::store_data_imm(0x1000, 1).to_vec(),
        encode::store_qword_imm(0x1000, 1).to_vec(),
        encode::store_data_index(8, 1).to_vec(),
        encode::store_qword_index(8, 1).to_vec(),
        encode::load_register_imm(0x2600, 1).to_vec(),
        encode::store_register_mem(0x2600, 0x1000).to_vec(),
        encode::load_register_mem(0x2600, 0x1000).to_vec(),
        encode::copy_mem_mem(0x1000, 0x2000).to_vec(),
        encode::atomic(0x1000, 4, 0).to_vec(),
        encode::atomic_inline(0x1000, 4, 0, [0; 8]).to_vec(),
        encode::flush_dw_store(0x1000, 1).to_vec(),
        encode::flush_dw_store_qword(0x1000, 1).to_vec(),
        encode::pipe_control_write_imm(0, 0x1000, 1).to_vec(),
        encode::semaphore_wait(0x1000, 1, 0).to_vec(),
        encode::xy_color_blt(r, 4, 4, 4, 0).to_vec(),
        encode::xy_src_copy_blt(r, r, 4, 4, 4).to_vec(),
        encode::xy_fast_copy_blt(r, r, 4, 4, 4).to_vec(),
        encode::batch_buffer_start(0x1000, false).to_vec(),
    ]
}

#[test]
fn every_truncation_in_the_ring() {
    for s in samples() {
        for have in 1..s.len() {
            assert_eq!(
                reason(&s[..have]),
                Reason::Truncated {
                    need: s.len() as u32,
                    have: have as u32
                },
                "{s:08x?} cut to {have}"
            );
        }
    }
}

#[test]
fn command_running_off_the_end_of_graphics_memory() {
    // A batch whose last command straddles the end of graphics memory.
    let cfg = AuditConfig::new(0x10_0000, 0);
    let start = 0x10_0000 - 8;
    let mut mem = Mem::new();
    mem.put(start, &encode::store_data_imm(0x1000, 1)[..2]);
    let ring = encode::batch_buffer_start(start, false);
    let (r, _) = run_with(&ring, &cfg, &mut mem);
    assert_eq!(
        r.unwrap_err().reason,
        Reason::AddressOutOfRange {
            space: Ggtt,
            addr: start,
            len: 16,
            limit: 0x10_0000
        }
    );
}

#[test]
fn addresses_at_and_over_the_limit() {
    let ok: &[(Vec<u32>, Vec<u32>, u64)] = &[
        (
            encode::store_data_imm(GFX - 4, 1).to_vec(),
            encode::store_data_imm(GFX, 1).to_vec(),
            4,
        ),
        (
            encode::store_qword_imm(GFX - 8, 1).to_vec(),
            encode::store_qword_imm(GFX, 1).to_vec(),
            8,
        ),
        (
            encode::store_register_mem(0x2600, GFX - 4).to_vec(),
            encode::store_register_mem(0x2600, GFX).to_vec(),
            4,
        ),
        (
            encode::load_register_mem(0x2600, GFX - 4).to_vec(),
            encode::load_register_mem(0x2600, GFX).to_vec(),
            4,
        ),
        (
            encode::copy_mem_mem(GFX - 4, 0).to_vec(),
            encode::copy_mem_mem(GFX, 0).to_vec(),
            4,
        ),
        (
            encode::copy_mem_mem(0, GFX - 4).to_vec(),
            encode::copy_mem_mem(0, GFX).to_vec(),
            4,
        ),
        (
            encode::atomic(GFX - 16, 0x44, 2).to_vec(),
            encode::atomic(GFX, 0x44, 2).to_vec(),
            16,
        ),
        (
            encode::flush_dw_store(GFX - 8, 1).to_vec(),
            encode::flush_dw_store(GFX, 1).to_vec(),
            8,
        ),
        (
            encode::pipe_control_timestamp(0, GFX - 8).to_vec(),
            encode::pipe_control_timestamp(0, GFX).to_vec(),
            8,
        ),
        (
            encode::semaphore_wait(GFX - 4, 0, 0).to_vec(),
            encode::semaphore_wait(GFX, 0, 0).to_vec(),
            4,
        ),
    ];
    for (good, bad, len) in ok {
        let (r, cmds) = run(good);
        r.unwrap_or_else(|e| panic!("{good:08x?}: {e}"));
        for c in &cmds {
            for w in c.kind.write_set().ranges() {
                assert!(w.end() <= GFX);
            }
        }
        assert_eq!(
            reason(bad),
            Reason::AddressOutOfRange {
                space: Ggtt,
                addr: GFX,
                len: *len,
                limit: GFX
            },
            "{bad:08x?}"
        );
    }
}

#[test]
fn address_arithmetic_overflow() {
    // Address high dword all ones: 0xffff_ffff_ffff_fffc + 4 overflows u64.
    let mut dw = encode::store_data_imm(0, 1);
    dw[1] = 0xffff_fffc;
    dw[2] = 0xffff_ffff;
    assert_eq!(
        reason(&dw),
        Reason::AddressOutOfRange {
            space: Ggtt,
            addr: u64::MAX - 3,
            len: 4,
            limit: GFX
        }
    );
    // Reserved high bits of the upper dword put the address out of range.
    let mut dw = encode::store_data_imm(0x1000, 1);
    dw[2] = 0x0001_0000;
    assert!(matches!(reason(&dw), Reason::AddressOutOfRange { .. }));
}

#[test]
fn huge_blits() {
    let big = encode::BlitRect {
        base: 0,
        pitch: 0x7fff,
        x: 0,
        y: 0,
    };
    // 32767 rows of 32767 pixels of 16 bytes: ~1 GiB, beyond 64 MiB.
    let dw = encode::xy_fast_copy_blt(big, big, 16, 0x7fff, 0x7fff);
    assert!(matches!(reason(&dw), Reason::AddressOutOfRange { .. }));
    // Near the top of a 2^48 address space, with the largest extents.
    let cfg = AuditConfig::new(MAX_GFX_MEM_SIZE, 0);
    let top = encode::BlitRect {
        base: MAX_GFX_MEM_SIZE - 0x1000,
        pitch: 0x7fff,
        x: 0x7ffe,
        y: 0x7ffe,
    };
    let dw = encode::xy_fast_copy_blt(top, big, 16, 1, 1);
    let (r, _) = run_with(&dw, &cfg, &mut Mem::new());
    assert!(matches!(
        r.unwrap_err().reason,
        Reason::AddressOutOfRange { .. }
    ));
    // Negative (bit 15) pitch and coordinates are refused.
    let mut dw = encode::xy_color_blt(big, 4, 1, 1, 0);
    dw[1] |= 0x8000;
    assert!(matches!(reason(&dw), Reason::BadField { .. }));
    let mut dw = encode::xy_color_blt(big, 4, 1, 1, 0);
    dw[2] = 0x8000_0000;
    assert!(matches!(reason(&dw), Reason::BadField { .. }));
    // Empty rectangles are refused.
    let dw = encode::xy_color_blt(big, 4, 0, 1, 0);
    assert!(matches!(reason(&dw), Reason::BadField { .. }));
    // Source outside memory.
    let far = encode::BlitRect { base: GFX, ..big };
    let dw = encode::xy_src_copy_blt(big, far, 4, 1, 1);
    assert!(matches!(reason(&dw), Reason::AddressOutOfRange { addr, .. } if addr == GFX));
}

#[test]
fn tiling_and_unsupported_features_are_refused_by_name() {
    let r = encode::BlitRect {
        base: 0x1000,
        pitch: 0x100,
        x: 0,
        y: 0,
    };
    let cases: Vec<(Vec<u32>, &str)> = vec![
        (
            {
                let mut d = encode::xy_color_blt(r, 4, 1, 1, 0);
                d[0] |= 1 << 11;
                d.to_vec()
            },
            "tiled blit destination",
        ),
        (
            {
                let mut d = encode::xy_src_copy_blt(r, r, 4, 1, 1);
                d[0] |= 1 << 15;
                d.to_vec()
            },
            "tiled blit source",
        ),
        (
            {
                let mut d = encode::xy_fast_copy_blt(r, r, 4, 1, 1);
                d[0] |= 2 << 13;
                d.to_vec()
            },
            "tiled blit destination",
        ),
        (
            {
                let mut d = encode::store_data_imm(0x1000, 0);
                d[0] &= !(1 << 22);
                d.to_vec()
            },
            "PPGTT address space (only the global GTT is audited)",
        ),
        (
            {
                let mut d = encode::batch_buffer_start(0x1000, false);
                d[0] |= 1 << 8;
                d.to_vec()
            },
            "batch buffer in the PPGTT address space",
        ),
        (
            {
                let mut d = encode::batch_buffer_start(0x1000, false);
                d[0] |= 1 << 15;
                d.to_vec()
            },
            "predicated MI_BATCH_BUFFER_START",
        ),
        (
            {
                let mut d = encode::atomic(0x1000, 4, 0);
                d[0] |= 1 << 16;
                d.to_vec()
            },
            "MI_ATOMIC return data",
        ),
        (
            {
                let mut d = encode::pipe_control_write_imm(0, 0x1000, 0);
                d[1] |= 1 << 23;
                d.to_vec()
            },
            "PIPE_CONTROL LRI post-sync operation",
        ),
        (
            {
                let mut d = encode::store_data_index(8, 0);
                d[0] |= 1 << 22;
                d.to_vec()
            },
            "per-process hardware status page",
        ),
        (
            {
                let mut d = encode::store_data_imm(0x1000, 0);
                d[1] |= 1;
                d.to_vec()
            },
            "MI_STORE_DATA_IMM core mode",
        ),
        (
            encode::batch_buffer_start(0x1000, true).to_vec(),
            "second-level batch started from the ring",
        ),
        (
            encode::batch_buffer_end().to_vec(),
            "MI_BATCH_BUFFER_END in the ring",
        ),
    ];
    for (dw, what) in cases {
        assert_eq!(reason(&dw), Reason::Unsupported { what }, "{dw:08x?}");
    }
}

#[test]
fn unknown_opcodes_lengths_reserved_bits_alignment() {
    // MI_SEMAPHORE_MBOX (0x16), MI_LOAD_REGISTER_REG (0x2a), MI_UPDATE_GTT
    // (0x23), a 3D state command, client 1 and clients 4-7.
    for h in [
        0x0b00_0001u32,
        0x1500_0001,
        0x1180_0000,
        0x7800_0001,
        0x2000_0000,
        0x8000_0000,
        0xffff_ffff,
    ] {
        assert_eq!(reason(&[h, 0, 0, 0]), Reason::UnknownOpcode, "{h:#x}");
    }
    // Gen7 3-dword MI_STORE_DATA_IMM form (length 1) has the wrong length.
    assert_eq!(
        reason(&[0x1040_0001, 0x1000, 0]),
        Reason::BadLength {
            len: 3,
            expected: 4
        }
    );
    // Gen7 2-dword MI_BATCH_BUFFER_START.
    assert_eq!(
        reason(&[0x1880_0000, 0x1000]),
        Reason::BadLength {
            len: 2,
            expected: 3
        }
    );
    // LRI with an even length field.
    assert_eq!(
        reason(&[0x1100_0002, 0, 0, 0]),
        Reason::BadLength {
            len: 4,
            expected: 5
        }
    );
    // Reserved header bits.
    assert_eq!(
        reason(&[0x0100_0001]),
        Reason::ReservedBits { dword: 0, bits: 1 }
    );
    // Misaligned stores.
    assert_eq!(
        reason(&encode::store_qword_imm(0x1004, 0)),
        Reason::Misaligned {
            addr: 0x1004,
            align: 8
        }
    );
    assert_eq!(
        reason(&encode::atomic(0x1008, 0x44, 2)),
        Reason::Misaligned {
            addr: 0x1008,
            align: 16
        }
    );
    let mut d = encode::store_data_imm(0x1000, 0);
    d[1] |= 2;
    assert_eq!(
        reason(&d),
        Reason::Misaligned {
            addr: 0x1002,
            align: 4
        }
    );
    // MI_FLUSH_DW post-sync op 2 is reserved.
    let mut d = encode::flush_dw_store(0x1000, 0);
    d[0] |= 3 << 14;
    d[0] &= !(1 << 14);
    assert!(matches!(reason(&d), Reason::BadField { .. }));
    // Status page offsets past the page.
    let mut d = encode::store_data_index(0, 0);
    d[1] = 0x1000;
    assert_eq!(
        reason(&d),
        Reason::ReservedBits {
            dword: 1,
            bits: 0x1000
        }
    );
    let mut d = encode::flush_dw_store_index(0, 0, false);
    d[1] = 0x1000 | 4;
    assert!(matches!(reason(&d), Reason::BadField { .. }));
}

/// MI_ARB_ON_OFF and MI_ARB_CHECK take no bits besides their opcode (and
/// the enable bit); the Gen12 forms of MI_SEMAPHORE_WAIT and the MI
/// commands next to them that i915 does not emit on Gen8/Gen9 stay refused.
#[test]
fn arbitration_and_neighbours() {
    for bit in 1..23 {
        assert_eq!(
            reason(&[0x0400_0000 | (1 << bit)]),
            Reason::ReservedBits {
                dword: 0,
                bits: 1 << bit
            },
            "MI_ARB_ON_OFF bit {bit}"
        );
    }
    for bit in 0..23 {
        assert_eq!(
            reason(&[0x0280_0000 | (1 << bit)]),
            Reason::ReservedBits {
                dword: 0,
                bits: 1 << bit
            },
            "MI_ARB_CHECK bit {bit}"
        );
    }
    let (r, _) = run(&[0x0400_0003]);
    assert_eq!(
        r.unwrap_err().to_string(),
        "MI_ARB_ON_OFF at 0x1000: reserved bits 0x2 set in dword 0"
    );
    let (r, _) = run(&[0, 0x0280_0000, 0x0281_0000]);
    assert_eq!(
        r.unwrap_err().to_string(),
        "MI_ARB_CHECK at 0x1008: reserved bits 0x10000 set in dword 0"
    );
    // MI_SET_PREDICATE (0x01), MI_WAIT_FOR_EVENT (0x03), MI_REPORT_HEAD
    // (0x07), MI_SUSPEND_FLUSH (0x0b), MI_SET_APPID (0x0e).
    for h in [
        0x0080_0000u32,
        0x0180_0000,
        0x0380_0000,
        0x0580_0000,
        0x0700_0000,
    ] {
        assert_eq!(reason(&[h]), Reason::UnknownOpcode, "{h:#x}");
    }
    // Gen12 MI_SEMAPHORE_WAIT: register poll (bit 16), token form (5
    // dwords).
    let mut d = encode::semaphore_wait(HWSP + 0xc8, 0, 4);
    d[0] |= 1 << 16;
    assert_eq!(
        reason(&d),
        Reason::ReservedBits {
            dword: 0,
            bits: 1 << 16
        }
    );
    assert_eq!(
        reason(&[0x0e40_c003, 0, 0xb000, 0, 0]),
        Reason::BadLength {
            len: 5,
            expected: 4
        }
    );
    // A semaphore in the PPGTT (no GGTT bit) with no PPGTT configured.
    let mut d = encode::semaphore_wait(0xb000, 0, 4);
    d[0] &= !(1 << 22);
    assert!(matches!(reason(&d), Reason::Unsupported { .. }));
    // PIPE_CONTROL's LRI post-sync operation writes a register: refused.
    let mut d = encode::pipe_control(1 << 20);
    d[1] |= 1 << 23;
    assert_eq!(
        reason(&d),
        Reason::Unsupported {
            what: "PIPE_CONTROL LRI post-sync operation"
        }
    );
    // i915's store-index writes must stay inside the status page.
    let mut d = [0x1324_4002, 0xd0, 0, 0];
    d[1] = 0xff8 + 8;
    assert!(matches!(reason(&d), Reason::BadField { .. }));
    let d = [0x7a00_0004, 0x0034_4c1c, 0x1000, 0, 0, 0];
    assert!(matches!(reason(&d), Reason::BadField { .. }));
}

#[test]
fn disallowed_registers() {
    // Second pair names a register not on the list: the sink saw the first
    // pair, which the caller must discard with the rest.
    let ring = [0x1100_0003, 0x2600, 1, 0x2000, 2];
    let (r, cmds) = run(&ring);
    assert_eq!(
        r.unwrap_err().reason,
        Reason::RegisterNotAllowed { reg: 0x2000 }
    );
    assert_eq!(cmds.len(), 1);
    assert_eq!(
        reason(&encode::store_register_mem(0x2030, 0x1000)),
        Reason::RegisterNotAllowed { reg: 0x2030 }
    );
    assert_eq!(
        reason(&encode::load_register_mem(0x2030, 0x1000)),
        Reason::RegisterNotAllowed { reg: 0x2030 }
    );
    // No list: nothing allowed.
    let cfg = AuditConfig::new(GFX, HWSP);
    let (r, _) = run_with(&encode::load_register_imm(0x2600, 0), &cfg, &mut Mem::new());
    assert_eq!(
        r.unwrap_err().reason,
        Reason::RegisterNotAllowed { reg: 0x2600 }
    );
}

#[test]
fn batch_depth_exceeded() {
    let mut mem = Mem::new();
    mem.put(
        0x1_0000,
        &cat(&[
            &encode::batch_buffer_start(0x2_0000, true),
            &encode::batch_buffer_end(),
        ]),
    );
    mem.put(
        0x2_0000,
        &cat(&[
            &encode::batch_buffer_start(0x3_0000, true),
            &encode::batch_buffer_end(),
        ]),
    );
    mem.put(0x3_0000, &encode::batch_buffer_end());
    let ring = encode::batch_buffer_start(0x1_0000, false);
    let (r, _) = run_with(&ring, &cfg(), &mut mem.clone());
    assert_eq!(r.unwrap().max_depth, 3);
    let shallow = AuditConfig {
        max_batch_depth: 2,
        ..cfg()
    };
    let (r, _) = run_with(&ring, &shallow, &mut mem);
    let e = r.unwrap_err();
    assert_eq!(e.reason, Reason::BatchTooDeep { depth: 3, limit: 2 });
    assert_eq!(e.gfx_addr, 0x2_0000);
}

#[test]
fn self_chaining_batch_is_accepted_once() {
    // The batch stores, then jumps to itself: a hang for the GPU, one pass
    // for the auditor.
    let b = 0x1_0000;
    let mut mem = Mem::new();
    mem.put(
        b,
        &cat(&[
            &encode::store_data_imm(0x5000, 1),
            &encode::batch_buffer_start(b, false),
        ]),
    );
    let ring = cat(&[
        &encode::batch_buffer_start(b, false),
        &encode::user_interrupt(),
    ]);
    let (r, cmds) = run_with(&ring, &cfg(), &mut mem);
    let s = r.unwrap();
    assert_eq!((s.batches, s.revisits, s.commands), (1, 1, 4));
    let kinds: Vec<_> = cmds.iter().map(|c| c.kind).collect();
    assert_eq!(
        kinds[2],
        Command::BatchStart {
            space: Ggtt,
            addr: b,
            second_level: false,
            level: 1,
            already_audited: true
        }
    );
    // The ring after the batch is still audited.
    assert_eq!(kinds[3], Command::UserInterrupt);
}

#[test]
fn self_calling_batch_hits_the_depth_limit() {
    let b = 0x1_0000;
    let mut mem = Mem::new();
    mem.put(
        b,
        &cat(&[
            &encode::batch_buffer_start(b, true),
            &encode::batch_buffer_end(),
        ]),
    );
    let (r, _) = run_with(&encode::batch_buffer_start(b, false), &cfg(), &mut mem);
    assert_eq!(
        r.unwrap_err().reason,
        Reason::BatchTooDeep { depth: 4, limit: 3 }
    );
}

#[test]
fn chain_into_audited_batch_returns_to_the_ring() {
    // X stores and ends; Y chains into X. The ring runs X, then Y, then
    // stores: everything after Y must still be audited.
    let (x, y) = (0x1_0000, 0x2_0000);
    let mut mem = Mem::new();
    mem.put(
        x,
        &cat(&[
            &encode::store_data_imm(0x5000, 1),
            &encode::batch_buffer_end(),
        ]),
    );
    mem.put(y, &encode::batch_buffer_start(x, false));
    let ring = cat(&[
        &encode::batch_buffer_start(x, false),
        &encode::batch_buffer_start(y, false),
        &encode::batch_buffer_start(x, false),
        &encode::store_data_imm(0x6000, 2),
    ]);
    let (r, cmds) = run_with(&ring, &cfg(), &mut mem);
    let s = r.unwrap();
    assert_eq!((s.batches, s.revisits), (2, 2));
    let writes: Vec<_> = cmds
        .iter()
        .flat_map(|c| c.kind.write_set().ranges())
        .map(|w| w.gfx_addr)
        .collect();
    assert_eq!(writes, [0x5000, 0x6000]);
    assert_eq!(cmds.last().unwrap().level, 0);
}

#[test]
fn second_level_returns_after_the_call() {
    let (b1, b2) = (0x1_0000, 0x2_0000);
    let mut mem = Mem::new();
    mem.put(
        b1,
        &cat(&[
            &encode::batch_buffer_start(b2, true),
            &encode::store_data_imm(0x5000, 1),
            &encode::batch_buffer_end(),
        ]),
    );
    mem.put(
        b2,
        &cat(&[
            &encode::store_data_imm(0x6000, 2),
            &encode::batch_buffer_end(),
        ]),
    );
    let ring = cat(&[
        &encode::batch_buffer_start(b1, false),
        &encode::store_data_imm(0x7000, 3),
    ]);
    let (r, cmds) = run_with(&ring, &cfg(), &mut mem);
    r.unwrap();
    let seq: Vec<_> = cmds
        .iter()
        .map(|c| {
            (
                c.level,
                c.kind.write_set().ranges().next().map(|w| w.gfx_addr),
            )
        })
        .collect();
    assert_eq!(
        seq,
        [
            (0, None),
            (1, None),
            (2, Some(0x6000)),
            (2, None),
            (1, Some(0x5000)),
            (1, None),
            (0, Some(0x7000))
        ]
    );
}

#[test]
fn command_count_limit() {
    let cfg = AuditConfig {
        max_commands: 5,
        ..cfg()
    };
    let ring = [0u32; 6];
    let (r, cmds) = run_with(&ring, &cfg, &mut Mem::new());
    let e = r.unwrap_err();
    assert_eq!(e.reason, Reason::TooManyCommands { limit: 5 });
    assert_eq!(e.gfx_addr, RING + 20);
    assert_eq!(cmds.len(), 5);
    let (r, _) = run_with(&ring[..5], &cfg, &mut Mem::new());
    assert_eq!(r.unwrap().commands, 5);
}

/// One MI_LOAD_REGISTER_IMM of `pairs` pairs on an allowed register.
fn lri(pairs: u8) -> Vec<u32> {
    let mut v = vec![encode::load_register_imm_header(pairs)];
    for i in 0..u32::from(pairs) {
        v.extend([0x2600, i]);
    }
    v
}

#[test]
fn entry_limit_counts_register_pairs_not_commands() {
    // 129 commands, far under max_commands, but 128 pairs each: the sink
    // would have to keep 16512 entries. What costs memory is limited.
    let cfg = AuditConfig {
        max_entries: 1000,
        ..cfg()
    };
    let one = lri(128);
    let ring: Vec<u32> = (0..129).flat_map(|_| one.iter().copied()).collect();
    let (r, cmds) = run_with(&ring, &cfg, &mut Mem::new());
    let e = r.unwrap_err();
    assert_eq!(e.reason, Reason::TooManyEntries { limit: 1000 });
    // The eighth LRI is the one that does not fit (7 * 128 = 896).
    assert_eq!(e.gfx_addr, RING + 7 * 4 * one.len() as u64);
    assert_eq!(cmds.len(), 1000);
    assert_eq!(
        e.to_string(),
        format!(
            "MI_LOAD_REGISTER_IMM at {:#x}: more than 1000 validated commands (register loads count per pair) in one submission",
            e.gfx_addr
        )
    );
    // Exactly at the limit passes.
    let exact: Vec<u32> = (0..125).flat_map(|_| lri(8)).collect();
    let (r, cmds) = run_with(&exact, &cfg, &mut Mem::new());
    assert_eq!(r.unwrap().commands, 125);
    assert_eq!(cmds.len(), 1000);
    // The default keeps a ring of 2 MiB of such loads (8160 commands,
    // over a million pairs) well under what a kernel can allocate.
    let big: Vec<u32> = (0..2040).flat_map(|_| lri(128)).collect();
    let (r, cmds) = run_with(&big, &common::cfg(), &mut Mem::new());
    assert_eq!(
        r.unwrap_err().reason,
        Reason::TooManyEntries {
            limit: AuditConfig::new(GFX, HWSP).max_entries
        }
    );
    assert!(cmds.len() * std::mem::size_of::<hag_audit::audit::ValidatedCommand>() <= 4 << 20);
}

#[test]
fn batch_count_limit() {
    // A chain through 70 distinct batches.
    let mut mem = Mem::new();
    for i in 0..70u64 {
        mem.put(
            0x1_0000 + i * 0x100,
            &encode::batch_buffer_start(0x1_0000 + (i + 1) * 0x100, false),
        );
    }
    let (r, _) = run_with(
        &encode::batch_buffer_start(0x1_0000, false),
        &cfg(),
        &mut mem,
    );
    assert_eq!(r.unwrap_err().reason, Reason::TooManyBatches { limit: 64 });
}

#[test]
fn memory_fault_and_unterminated_batch() {
    let (r, _) = run_with(
        &encode::batch_buffer_start(0x1_0000, false),
        &cfg(),
        &mut Mem::new(),
    );
    assert_eq!(
        r.unwrap_err().reason,
        Reason::MemoryFault {
            space: Ggtt,
            addr: 0x1_0000
        }
    );
    // A batch of NOOPs up to the end of a small graphics memory.
    let cfg = AuditConfig::new(0x2000, 0);
    let zeros = [0u32; 0x800];
    let mut mem = SliceMemory {
        space: Ggtt,
        base: 0,
        dwords: &zeros,
    };
    let e = audit(
        &encode::batch_buffer_start(0x1000, false),
        RING,
        &cfg,
        &mut mem,
        &mut NoSink,
    )
    .unwrap_err();
    assert_eq!(
        e.reason,
        Reason::AddressOutOfRange {
            space: Ggtt,
            addr: 0x2000,
            len: 4,
            limit: 0x2000
        }
    );
    assert_eq!(e.header, None);
}

#[test]
fn sink_full() {
    let mut sink = Sink {
        cap: Some(2),
        ..Sink::default()
    };
    let e = audit(&[0, 0, 0], RING, &cfg(), &mut Mem::new(), &mut sink).unwrap_err();
    assert_eq!(e.reason, Reason::SinkFull);
}

#[test]
fn bad_configs() {
    let bad = [
        AuditConfig::new(0, 0),
        AuditConfig::new(MAX_GFX_MEM_SIZE + 1, 0),
        AuditConfig::new(GFX, 0x10),
        AuditConfig::new(GFX, GFX),
        cfg().with_ppgtt(MAX_GFX_MEM_SIZE + 1),
        cfg().with_ppgtt(u64::MAX),
        AuditConfig {
            max_batch_depth: 0,
            ..cfg()
        },
        AuditConfig {
            max_batch_depth: 9,
            ..cfg()
        },
        AuditConfig {
            max_batches: 65,
            ..cfg()
        },
    ];
    for c in bad {
        let (r, _) = run_with(&[0], &c, &mut Mem::new());
        let e = r.unwrap_err();
        assert!(matches!(e.reason, Reason::BadConfig { .. }), "{c:?}");
        assert!(e.to_string().starts_with("bad audit configuration"));
    }
}

#[test]
fn messages_name_the_command_and_the_numbers() {
    let (r, _) = run(&encode::store_qword_imm(GFX - 8 + 8, 0));
    assert_eq!(
        r.unwrap_err().to_string(),
        "MI_STORE_DATA_IMM at 0x1000: address 0x4000000+8 outside graphics memory of 0x4000000 bytes"
    );
    let (r, _) = run(&cat(&[&[0], &encode::load_register_imm(0x40, 0)]));
    assert_eq!(
        r.unwrap_err().to_string(),
        "MI_LOAD_REGISTER_IMM at 0x1004: register 0x40 is not on the allow list"
    );
    let (r, _) = run(&[0x7800_0001, 0, 0]);
    assert_eq!(
        r.unwrap_err().to_string(),
        "command 0x78000001 at 0x1000: unknown or unsupported opcode"
    );
    let (r, _) = run(&encode::batch_buffer_end());
    assert_eq!(
        r.unwrap_err().to_string(),
        "MI_BATCH_BUFFER_END at 0x1000: unsupported: MI_BATCH_BUFFER_END in the ring"
    );
}

#[test]
fn hostile_ppgtt_batches() {
    let cfg = ppgtt_cfg();
    // Addresses with every high bit set: out of range, no overflow.
    let mut huge = encode::ppgtt(encode::store_qword_imm(0, 1));
    huge[1] = 0xffff_fff8;
    huge[2] = 0xffff_ffff;
    let (r, _) = run_with(&huge, &cfg, &mut Mem::new());
    assert_eq!(
        r.unwrap_err().reason,
        Reason::AddressOutOfRange {
            space: Ppgtt,
            addr: u64::MAX - 7,
            len: 8,
            limit: PPGTT
        }
    );
    let mut start = encode::batch_buffer_start_ppgtt(0, false);
    start[1] = 0xffff_fffc;
    start[2] = 0xffff_ffff;
    let (r, _) = run_with(&start, &cfg, &mut Mem::new());
    assert!(matches!(
        r.unwrap_err().reason,
        Reason::AddressOutOfRange { space: Ppgtt, .. }
    ));

    // A self-chaining PPGTT batch: one pass, then the ring goes on in the
    // GGTT.
    let b = 0x1_0000;
    let mut mem = Mem::new();
    mem.put_ppgtt(
        b,
        &cat(&[
            &encode::store_data_imm(0x5000, 1),
            &encode::batch_buffer_start_ppgtt(b, false),
        ]),
    );
    let ring = cat(&[
        &encode::batch_buffer_start_ppgtt(b, false),
        &encode::store_data_imm(0x6000, 1),
    ]);
    let (r, cmds) = run_with(&ring, &cfg, &mut mem);
    let s = r.unwrap();
    assert_eq!((s.batches, s.revisits, s.commands), (1, 1, 4));
    assert_eq!(cmds[3].space, Ggtt);
    assert_eq!(
        cmds[3].kind.write_set(),
        WriteSet::Range(WriteRange {
            space: Ggtt,
            gfx_addr: 0x6000,
            len: 4
        })
    );

    // A self-calling PPGTT batch hits the depth limit.
    let mut mem = Mem::new();
    mem.put_ppgtt(
        b,
        &cat(&[
            &encode::batch_buffer_start_ppgtt(b, true),
            &encode::batch_buffer_end(),
        ]),
    );
    let (r, _) = run_with(&encode::batch_buffer_start_ppgtt(b, false), &cfg, &mut mem);
    let e = r.unwrap_err();
    assert_eq!(e.reason, Reason::BatchTooDeep { depth: 4, limit: 3 });
    assert_eq!((e.space, e.gfx_addr), (Ppgtt, b));

    // The batch limit counts both spaces: 40 GGTT and 40 PPGTT batches at
    // the same addresses are 80 distinct batches.
    let mut mem = Mem::new();
    let mut ring = Vec::new();
    for i in 0..40u64 {
        let a = 0x1_0000 + i * 0x100;
        mem.put(a, &encode::batch_buffer_end());
        mem.put_ppgtt(a, &encode::batch_buffer_end());
        ring.extend(encode::batch_buffer_start(a, false));
        ring.extend(encode::batch_buffer_start_ppgtt(a, false));
    }
    let (r, cmds) = run_with(&ring, &cfg, &mut mem);
    assert_eq!(r.unwrap_err().reason, Reason::TooManyBatches { limit: 64 });
    assert_eq!(
        cmds.iter().filter(|c| c.kind == Command::BatchEnd).count(),
        64
    );
}
