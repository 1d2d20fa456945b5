//! Address spaces: which commands write the GGTT and which the workload's
//! PPGTT, by the rules of the hardware and of GVT-g's scanner (i915
//! gvt/cmd_parser.c): a batch the ring starts with the address-space bit
//! (bit 8 of MI_BATCH_BUFFER_START) is non-privileged and all its operands
//! are PPGTT; elsewhere each command's "use global GTT" bit selects; the
//! status page is GGTT. Without a PPGTT in the configuration every PPGTT
//! operand is refused exactly as before PPGTT support.

mod common;

use common::*;
use hag_audit::audit::AddressSpace::{self, Ggtt, Ppgtt};
use hag_audit::audit::{
    audit, encode, AuditConfig, Command, GfxMemory, MemoryFault, PostSync, Reason, SliceMemory,
    Strided, WriteRange, WriteSet, MAX_GFX_MEM_SIZE,
};

/// Where test batches live, in either space.
const BB: u64 = 0x1_0000;

fn range(space: AddressSpace, gfx_addr: u64, len: u64) -> WriteSet {
    WriteSet::Range(WriteRange {
        space,
        gfx_addr,
        len,
    })
}

/// The write sets of the commands of a PPGTT batch at `BB` holding `body`,
/// started from the ring; checks every batch command is labelled PPGTT.
fn in_ppgtt_batch(body: &[u32]) -> Vec<WriteSet> {
    let mut mem = Mem::new();
    mem.put_ppgtt(BB, &cat(&[body, &encode::batch_buffer_end()]));
    let ring = encode::batch_buffer_start_ppgtt(BB, false);
    let (r, cmds) = run_with(&ring, &ppgtt_cfg(), &mut mem);
    r.unwrap_or_else(|e| panic!("{body:08x?} rejected: {e}"));
    assert_eq!(cmds[0].space, Ggtt, "the ring is GGTT");
    assert!(cmds[1..].iter().all(|c| c.space == Ppgtt && c.level == 1));
    cmds[1..cmds.len() - 1]
        .iter()
        .map(|c| c.kind.write_set())
        .collect()
}

/// Audits one command in the ring with `cfg` and returns it.
fn ring_one(dw: &[u32], cfg: &AuditConfig<'_>) -> Command {
    let (r, cmds) = run_with(dw, cfg, &mut Mem::new());
    r.unwrap_or_else(|e| panic!("{dw:08x?} rejected: {e}"));
    assert_eq!(cmds.len(), 1);
    assert_eq!(cmds[0].space, Ggtt);
    cmds[0].kind
}

#[test]
fn ppgtt_encodings() {
    // i915's gen8_emit_bb_start for a user batch: MI_BATCH_BUFFER_START_GEN8
    // | BIT(8) (address space indicator: PPGTT).
    assert_eq!(
        encode::batch_buffer_start_ppgtt(0x1_2345_6780, false),
        [0x1880_0101, 0x2345_6780, 0x0000_0001]
    );
    assert_eq!(
        encode::batch_buffer_start_ppgtt(0x1000, true),
        [0x18c0_0101, 0x1000, 0]
    );
    // encode::ppgtt clears exactly the GGTT bits.
    assert_eq!(
        encode::ppgtt(encode::store_data_imm(0x40, 1)),
        [0x1000_0002, 0x40, 0, 1]
    );
    assert_eq!(encode::ppgtt(encode::copy_mem_mem(8, 16))[0], 0x1700_0003);
    assert_eq!(encode::ppgtt(encode::flush_dw_store(8, 1))[1], 8);
    assert_eq!(
        encode::ppgtt(encode::pipe_control_write_imm(0, 8, 1))[1],
        0x0000_4000
    );
    // Nothing to clear: unchanged.
    for cmd in [
        encode::store_data_index(8, 1).to_vec(),
        encode::flush_dw_store_index(8, 1, false).to_vec(),
        encode::batch_buffer_start(0x1000, false).to_vec(),
        encode::noop().to_vec(),
    ] {
        assert_eq!(
            encode::ppgtt(<[u32; 1]>::try_from(&cmd[..1]).unwrap())[0],
            cmd[0]
        );
    }
    assert_eq!(encode::ppgtt::<0>([]), []);
}

#[test]
fn a_ppgtt_batch_writes_the_ppgtt_whatever_the_ggtt_bit_says() {
    // Encoders set the GGTT bits; in a non-privileged batch the hardware
    // uses the PPGTT anyway.
    let sets = in_ppgtt_batch(&cat(&[
        &encode::store_data_imm(0x2_0004, 7),
        &encode::ppgtt(encode::store_data_imm(0x2_0008, 7)),
        &encode::store_qword_imm(0x2_0010, 7),
        &encode::store_register_mem(0x2600, 0x2_0020),
        &encode::copy_mem_mem(0x2_0030, 0x2_0040),
        &encode::atomic(0x2_0050, 0x05, 0),
        &encode::flush_dw_store(0x2_0060, 1),
        &encode::flush_dw_timestamp(0x2_0068),
        &encode::pipe_control_write_imm(0, 0x2_0070, 1),
        &encode::pipe_control_timestamp(0, 0x2_0078),
        &encode::load_register_mem(0x2600, 0x2_0080),
        &encode::semaphore_wait(0x2_0090, 0, 4),
    ]));
    assert_eq!(
        sets,
        [
            range(Ppgtt, 0x2_0004, 4),
            range(Ppgtt, 0x2_0008, 4),
            range(Ppgtt, 0x2_0010, 8),
            range(Ppgtt, 0x2_0020, 4),
            range(Ppgtt, 0x2_0030, 4),
            range(Ppgtt, 0x2_0050, 4),
            range(Ppgtt, 0x2_0060, 8),
            range(Ppgtt, 0x2_0068, 8),
            range(Ppgtt, 0x2_0070, 8),
            range(Ppgtt, 0x2_0078, 8),
            WriteSet::None,
            WriteSet::None,
        ]
    );
}

#[test]
fn reads_in_a_ppgtt_batch_are_ppgtt_too() {
    let mut mem = Mem::new();
    mem.put_ppgtt(
        BB,
        &cat(&[
            &encode::copy_mem_mem(0x2_0030, 0x2_0040),
            &encode::load_register_mem(0x2600, 0x2_0080),
            &encode::semaphore_wait(0x2_0090, 0, 4),
            &encode::batch_buffer_end(),
        ]),
    );
    let (r, cmds) = run_with(
        &encode::batch_buffer_start_ppgtt(BB, false),
        &ppgtt_cfg(),
        &mut mem,
    );
    r.unwrap();
    let kinds: Vec<_> = cmds[1..4].iter().map(|c| c.kind).collect();
    assert_eq!(
        kinds,
        [
            Command::CopyMemMem {
                dst_space: Ppgtt,
                dst: 0x2_0030,
                src_space: Ppgtt,
                src: 0x2_0040
            },
            Command::LoadRegisterMem {
                reg: 0x2600,
                space: Ppgtt,
                addr: 0x2_0080
            },
            Command::SemaphoreWait {
                space: Ppgtt,
                addr: 0x2_0090,
                data: 0,
                compare: 4,
                poll: true
            },
        ]
    );
}

#[test]
fn the_status_page_is_ggtt_even_from_a_ppgtt_batch() {
    let sets = in_ppgtt_batch(&cat(&[
        &encode::store_data_index(0x40, 1),
        &encode::store_qword_index(0x48, 1),
        &encode::flush_dw_store_index(0x50, 1, false),
        &{
            // PIPE_CONTROL store data index (DW1 bit 21), GGTT bit clear.
            let mut pc = encode::ppgtt(encode::pipe_control_write_imm(0, 0x58, 1));
            pc[1] |= 1 << 21;
            pc
        },
    ]));
    assert_eq!(
        sets,
        [
            range(Ggtt, HWSP + 0x40, 4),
            range(Ggtt, HWSP + 0x48, 8),
            range(Ggtt, HWSP + 0x50, 8),
            range(Ggtt, HWSP + 0x58, 8),
        ]
    );
}

#[test]
fn blits_write_the_space_of_their_batch() {
    let r = encode::BlitRect {
        base: 0x4_0000,
        pitch: 0x100,
        x: 1,
        y: 2,
    };
    let blit = encode::xy_src_copy_blt(r, r, 4, 3, 2);
    let want = |space| {
        WriteSet::Strided(Strided {
            space,
            base: 0x4_0204,
            row_bytes: 12,
            pitch: 0x100,
            rows: 2,
        })
    };
    assert_eq!(in_ppgtt_batch(&blit), [want(Ppgtt)]);
    // The source follows the batch too.
    let mut mem = Mem::new();
    mem.put_ppgtt(BB, &cat(&[&blit, &encode::batch_buffer_end()]));
    let (res, cmds) = run_with(
        &encode::batch_buffer_start_ppgtt(BB, false),
        &ppgtt_cfg(),
        &mut mem,
    );
    res.unwrap();
    let Command::Blit(b) = cmds[1].kind else {
        panic!("{cmds:?}")
    };
    assert_eq!((b.dst.space, b.src.unwrap().space), (Ppgtt, Ppgtt));
    // In the ring and in GGTT batches blits are GGTT, PPGTT or not.
    assert_eq!(ring_one(&blit, &ppgtt_cfg()).write_set(), want(Ggtt));
    let mut mem = Mem::new();
    mem.put(BB, &cat(&[&blit, &encode::batch_buffer_end()]));
    let (res, cmds) = run_with(
        &encode::batch_buffer_start(BB, false),
        &ppgtt_cfg(),
        &mut mem,
    );
    res.unwrap();
    assert_eq!(cmds[1].kind.write_set(), want(Ggtt));
}

#[test]
fn in_the_ring_the_ggtt_bit_selects() {
    let cfg = ppgtt_cfg();
    let c = ring_one(&encode::store_data_imm(0x2000, 1), &cfg);
    assert_eq!(c.write_set(), range(Ggtt, 0x2000, 4));
    // Without the bit: PPGTT, and PPGTT addresses may lie past the GGTT.
    let c = ring_one(
        &encode::ppgtt(encode::store_data_imm(GFX + 0x2000, 1)),
        &cfg,
    );
    assert_eq!(c.write_set(), range(Ppgtt, GFX + 0x2000, 4));
    for (cmd, want) in [
        (
            encode::ppgtt(encode::store_register_mem(0x2600, 0x40)).to_vec(),
            range(Ppgtt, 0x40, 4),
        ),
        (
            encode::ppgtt(encode::atomic(0x40, 0x05, 0)).to_vec(),
            range(Ppgtt, 0x40, 4),
        ),
        (
            encode::ppgtt(encode::flush_dw_store(0x40, 1)).to_vec(),
            range(Ppgtt, 0x40, 8),
        ),
        (
            encode::ppgtt(encode::pipe_control_timestamp(0, 0x40)).to_vec(),
            range(Ppgtt, 0x40, 8),
        ),
        (
            encode::flush_dw_store_index(0x40, 1, false).to_vec(),
            range(Ggtt, HWSP + 0x40, 8),
        ),
    ] {
        assert_eq!(ring_one(&cmd, &cfg).write_set(), want, "{cmd:08x?}");
    }
    // MI_COPY_MEM_MEM has one bit per operand.
    let mut cmm = encode::copy_mem_mem(0x40, GFX + 0x80);
    cmm[0] &= !(1 << 22);
    assert_eq!(
        ring_one(&cmm, &cfg),
        Command::CopyMemMem {
            dst_space: Ggtt,
            dst: 0x40,
            src_space: Ppgtt,
            src: GFX + 0x80
        }
    );
}

#[test]
fn a_clear_ggtt_bit_is_refused_without_a_ppgtt() {
    let refused = Reason::Unsupported {
        what: "PPGTT address space (only the global GTT is audited)",
    };
    let mut cmm_dst = encode::copy_mem_mem(0x40, 0x80);
    cmm_dst[0] &= !(1 << 21);
    for cmd in [
        encode::ppgtt(encode::store_data_imm(0x40, 1)).to_vec(),
        encode::ppgtt(encode::store_register_mem(0x2600, 0x40)).to_vec(),
        encode::ppgtt(encode::load_register_mem(0x2600, 0x40)).to_vec(),
        encode::ppgtt(encode::copy_mem_mem(0x40, 0x80)).to_vec(),
        cmm_dst.to_vec(),
        encode::ppgtt(encode::atomic(0x40, 0x05, 0)).to_vec(),
        encode::ppgtt(encode::semaphore_wait(0x40, 0, 0)).to_vec(),
        encode::ppgtt(encode::flush_dw_store(0x40, 1)).to_vec(),
        encode::ppgtt(encode::pipe_control_write_imm(0, 0x40, 1)).to_vec(),
    ] {
        let (r, cmds) = run(&cmd);
        assert_eq!(r.unwrap_err().reason, refused, "{cmd:08x?}");
        assert!(cmds.is_empty());
    }
    // The same in a GGTT batch, where the bit also selects.
    let mut mem = Mem::new();
    mem.put(
        BB,
        &cat(&[
            &encode::ppgtt(encode::store_data_imm(0x40, 1)),
            &encode::batch_buffer_end(),
        ]),
    );
    let (r, _) = run_with(&encode::batch_buffer_start(BB, false), &cfg(), &mut mem);
    let e = r.unwrap_err();
    assert_eq!((e.space, e.gfx_addr, e.reason), (Ggtt, BB, refused));
    // And a PPGTT batch, by the message it always had.
    let (r, _) = run(&encode::batch_buffer_start_ppgtt(BB, false));
    assert_eq!(
        r.unwrap_err().to_string(),
        "MI_BATCH_BUFFER_START at 0x1000: unsupported: batch buffer in the PPGTT address space"
    );
}

#[test]
fn in_a_ggtt_batch_the_ggtt_bit_selects() {
    let mut mem = Mem::new();
    mem.put(
        BB,
        &cat(&[
            &encode::store_data_imm(0x40, 1),
            &encode::ppgtt(encode::store_data_imm(0x40, 1)),
            &encode::batch_buffer_end(),
        ]),
    );
    let (r, cmds) = run_with(
        &encode::batch_buffer_start(BB, false),
        &ppgtt_cfg(),
        &mut mem,
    );
    r.unwrap();
    assert!(cmds.iter().all(|c| c.space == Ggtt));
    assert_eq!(cmds[1].kind.write_set(), range(Ggtt, 0x40, 4));
    assert_eq!(cmds[2].kind.write_set(), range(Ppgtt, 0x40, 4));
}

#[test]
fn ppgtt_batches_chain_and_call_ppgtt_batches_and_return() {
    // Ring → PPGTT batch A (calls B, second level, then chains to C) →
    // ring again, whose commands are GGTT.
    let (a, b, c) = (BB, BB + 0x100, BB + 0x200);
    let mut mem = Mem::new();
    mem.put_ppgtt(
        a,
        &cat(&[
            &encode::batch_buffer_start_ppgtt(b, true),
            &encode::store_data_imm(0x40, 1),
            &encode::batch_buffer_start_ppgtt(c, false),
        ]),
    );
    mem.put_ppgtt(
        b,
        &cat(&[
            &encode::store_data_imm(0x80, 1),
            &encode::batch_buffer_end(),
        ]),
    );
    mem.put_ppgtt(
        c,
        &cat(&[
            &encode::store_data_imm(0xc0, 1),
            &encode::batch_buffer_end(),
        ]),
    );
    let ring = cat(&[
        &encode::batch_buffer_start_ppgtt(a, false),
        &encode::store_data_imm(0x100, 1),
    ]);
    let (r, cmds) = run_with(&ring, &ppgtt_cfg(), &mut mem);
    let s = r.unwrap();
    assert_eq!((s.batches, s.max_depth), (3, 2));
    let got: Vec<_> = cmds
        .iter()
        .map(|c| (c.space, c.gfx_addr, c.level, c.kind.write_set()))
        .collect();
    assert_eq!(
        got,
        [
            (Ggtt, RING, 0, WriteSet::None),
            (Ppgtt, a, 1, WriteSet::None),
            (Ppgtt, b, 2, range(Ppgtt, 0x80, 4)),
            (Ppgtt, b + 16, 2, WriteSet::None),
            (Ppgtt, a + 12, 1, range(Ppgtt, 0x40, 4)),
            (Ppgtt, a + 28, 1, WriteSet::None),
            (Ppgtt, c, 1, range(Ppgtt, 0xc0, 4)),
            (Ppgtt, c + 16, 1, WriteSet::None),
            (Ggtt, RING + 12, 0, range(Ggtt, 0x100, 4)),
        ]
    );
    assert!(matches!(
        cmds[1].kind,
        Command::BatchStart {
            space: Ppgtt,
            second_level: true,
            level: 2,
            ..
        }
    ));
}

#[test]
fn a_batch_start_may_not_change_address_space() {
    // GVT-g ignores the bit below the ring and the hardware does not let a
    // non-privileged batch start a privileged one: refused, by name.
    let mut mem = Mem::new();
    mem.put_ppgtt(BB, &encode::batch_buffer_start(BB + 0x100, true));
    let (r, _) = run_with(
        &encode::batch_buffer_start_ppgtt(BB, false),
        &ppgtt_cfg(),
        &mut mem,
    );
    assert_eq!(
        r.unwrap_err().to_string(),
        "MI_BATCH_BUFFER_START at PPGTT 0x10000: unsupported: GGTT batch started from a PPGTT batch"
    );
    let mut mem = Mem::new();
    mem.put(BB, &encode::batch_buffer_start_ppgtt(BB + 0x100, false));
    let (r, _) = run_with(
        &encode::batch_buffer_start(BB, false),
        &ppgtt_cfg(),
        &mut mem,
    );
    assert_eq!(
        r.unwrap_err().to_string(),
        "MI_BATCH_BUFFER_START at 0x10000: unsupported: PPGTT batch started from a GGTT batch"
    );
}

#[test]
fn the_visited_set_tells_the_spaces_apart() {
    // The same address in both spaces holds two different batches: both
    // are scanned, each from its own space.
    let mut mem = Mem::new();
    mem.put(
        BB,
        &cat(&[
            &encode::store_data_imm(0x40, 1),
            &encode::batch_buffer_end(),
        ]),
    );
    mem.put_ppgtt(
        BB,
        &cat(&[
            &encode::store_data_imm(0x80, 1),
            &encode::batch_buffer_end(),
        ]),
    );
    let ring = cat(&[
        &encode::batch_buffer_start(BB, false),
        &encode::batch_buffer_start_ppgtt(BB, false),
        &encode::batch_buffer_start_ppgtt(BB, false),
    ]);
    let (r, cmds) = run_with(&ring, &ppgtt_cfg(), &mut mem);
    let s = r.unwrap();
    assert_eq!((s.batches, s.revisits), (2, 1));
    let writes: Vec<_> = cmds
        .iter()
        .map(|c| c.kind.write_set())
        .filter(|w| !w.is_empty())
        .collect();
    assert_eq!(writes, [range(Ggtt, 0x40, 4), range(Ppgtt, 0x80, 4)]);
    assert!(matches!(
        cmds.last().unwrap().kind,
        Command::BatchStart {
            space: Ppgtt,
            already_audited: true,
            ..
        }
    ));
}

#[test]
fn ppgtt_addresses_must_lie_inside_the_ppgtt() {
    let cfg = ppgtt_cfg();
    // The last dword fits; one more does not, and the error says PPGTT.
    ring_one(&encode::ppgtt(encode::store_data_imm(PPGTT - 4, 1)), &cfg);
    let (r, _) = run_with(
        &encode::ppgtt(encode::store_data_imm(PPGTT, 1)),
        &cfg,
        &mut Mem::new(),
    );
    let e = r.unwrap_err();
    assert_eq!(
        e.reason,
        Reason::AddressOutOfRange {
            space: Ppgtt,
            addr: PPGTT,
            len: 4,
            limit: PPGTT
        }
    );
    assert_eq!(
        e.to_string(),
        "MI_STORE_DATA_IMM at 0x1000: PPGTT address 0x100000000+4 outside the PPGTT of 0x100000000 bytes"
    );
    // A PPGTT batch start past the end.
    let (r, _) = run_with(
        &encode::batch_buffer_start_ppgtt(PPGTT, false),
        &cfg,
        &mut Mem::new(),
    );
    assert_eq!(
        r.unwrap_err().to_string(),
        "MI_BATCH_BUFFER_START at 0x1000: PPGTT address 0x100000000+4 outside the PPGTT of 0x100000000 bytes"
    );
    // A blit rectangle crossing the end of the PPGTT, in a PPGTT batch.
    let rect = encode::BlitRect {
        base: PPGTT - 0x100,
        pitch: 0x100,
        x: 0,
        y: 0,
    };
    let mut mem = Mem::new();
    mem.put_ppgtt(BB, &encode::xy_color_blt(rect, 4, 4, 2, 0));
    let (r, _) = run_with(&encode::batch_buffer_start_ppgtt(BB, false), &cfg, &mut mem);
    assert_eq!(
        r.unwrap_err().reason,
        Reason::AddressOutOfRange {
            space: Ppgtt,
            addr: PPGTT - 0x100,
            len: 0x110,
            limit: PPGTT
        }
    );
    // A command running off the end of the PPGTT.
    let mut mem = Mem::new();
    mem.put_ppgtt(PPGTT - 8, &encode::store_data_imm(0x40, 1)[..2]);
    let (r, _) = run_with(
        &encode::batch_buffer_start_ppgtt(PPGTT - 8, false),
        &cfg,
        &mut mem,
    );
    let e = r.unwrap_err();
    assert_eq!((e.space, e.gfx_addr), (Ppgtt, PPGTT - 8));
    assert_eq!(
        e.reason,
        Reason::AddressOutOfRange {
            space: Ppgtt,
            addr: PPGTT - 8,
            len: 16,
            limit: PPGTT
        }
    );
    // GGTT limits are unchanged: a GGTT store past graphics memory.
    let (r, _) = run_with(&encode::store_data_imm(GFX, 1), &cfg, &mut Mem::new());
    assert_eq!(
        r.unwrap_err().to_string(),
        "MI_STORE_DATA_IMM at 0x1000: address 0x4000000+4 outside graphics memory of 0x4000000 bytes"
    );
}

#[test]
fn a_full_48_bit_ppgtt() {
    let cfg = cfg().with_ppgtt(MAX_GFX_MEM_SIZE);
    let top = MAX_GFX_MEM_SIZE - 8;
    assert_eq!(
        ring_one(&encode::ppgtt(encode::store_qword_imm(top, 1)), &cfg).write_set(),
        range(Ppgtt, top, 8)
    );
    let mut over = encode::ppgtt(encode::store_qword_imm(0, 1));
    over[2] = 0x1_0000; // address bit 48
    let (r, _) = run_with(&over, &cfg, &mut Mem::new());
    assert!(matches!(
        r.unwrap_err().reason,
        Reason::AddressOutOfRange { space: Ppgtt, .. }
    ));
    let (r, _) = run_with(&[0], &cfg.with_ppgtt(MAX_GFX_MEM_SIZE + 1), &mut Mem::new());
    assert_eq!(
        r.unwrap_err().to_string(),
        "bad audit configuration: ppgtt_size must be at most 2^48 bytes"
    );
}

#[test]
fn batches_are_read_from_their_own_space() {
    // The batch exists only in the GGTT; a PPGTT start faults, by space.
    let mut mem = Mem::new();
    mem.put(BB, &encode::batch_buffer_end());
    let (r, _) = run_with(
        &encode::batch_buffer_start_ppgtt(BB, false),
        &ppgtt_cfg(),
        &mut mem,
    );
    let e = r.unwrap_err();
    assert_eq!(
        e.reason,
        Reason::MemoryFault {
            space: Ppgtt,
            addr: BB
        }
    );
    assert_eq!(
        e.to_string(),
        "command at PPGTT 0x10000: PPGTT address 0x10000 could not be read"
    );
    // SliceMemory is mapped in one space only.
    let dw = [0u32; 4];
    let mut slice = SliceMemory {
        space: Ppgtt,
        base: 0,
        dwords: &dw,
    };
    let mut out = [1u32; 2];
    assert_eq!(slice.read_dwords(Ppgtt, 8, &mut out), Ok(()));
    assert_eq!(
        slice.read_dwords(Ggtt, 8, &mut out),
        Err(MemoryFault { gfx_addr: 8 })
    );
    let batch = cat(&[
        &encode::store_data_imm(0x40, 1),
        &encode::batch_buffer_end(),
    ]);
    let mut slice = SliceMemory {
        space: Ppgtt,
        base: BB,
        dwords: &batch,
    };
    let s = audit(
        &encode::batch_buffer_start_ppgtt(BB, false),
        RING,
        &ppgtt_cfg(),
        &mut slice,
        &mut Sink::default(),
    )
    .unwrap();
    assert_eq!(s.batches, 1);
}

#[test]
fn post_sync_destinations_carry_their_space() {
    let c = ring_one(
        &encode::ppgtt(encode::pipe_control_write_imm(0, 0x40, 7)),
        &ppgtt_cfg(),
    );
    let Command::PipeControl { post_sync, .. } = c else {
        panic!("{c:?}")
    };
    assert_eq!(
        post_sync,
        PostSync::WriteImm {
            space: Ppgtt,
            addr: 0x40,
            data: [7, 0]
        }
    );
    assert_eq!(post_sync.dest(), Some((Ppgtt, 0x40)));
    assert_eq!(post_sync.addr(), Some(0x40));
    assert_eq!(PostSync::None.dest(), None);
}
