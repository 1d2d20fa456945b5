//! Golden encodings: dwords written by hand from the PRM (Broadwell/Skylake
//! "Command Reference: Instructions"; cross-checked with i915's
//! intel_gpu_commands.h), the encoder must produce them, and they must
//! decode to the expected command and write set.

mod common;

use common::*;
use hag_audit::audit::AddressSpace::{Ggtt, Ppgtt};
use hag_audit::audit::{
    encode, Blit, BlitKind, Command, PostSync, Strided, Surface, WriteRange, WriteSet,
};

/// Audits one ring-level command and returns it.
fn decode_one(dw: &[u32]) -> Command {
    let (r, cmds) = run(dw);
    r.unwrap_or_else(|e| panic!("{dw:08x?} rejected: {e}"));
    assert_eq!(cmds.len(), 1, "{cmds:?}");
    assert_eq!(cmds[0].gfx_addr, RING);
    assert_eq!(cmds[0].level, 0);
    cmds[0].kind
}

fn range(gfx_addr: u64, len: u64) -> WriteSet {
    WriteSet::Range(WriteRange {
        space: Ggtt,
        gfx_addr,
        len,
    })
}

#[test]
fn mi_noop() {
    // MI_NOOP: DW0 = 0 (opcode 0x00, client MI).
    let golden = [0x0000_0000];
    assert_eq!(encode::noop(), golden);
    assert_eq!(decode_one(&golden), Command::Noop);
    // Bit 22 with a NOP id is accepted.
    assert_eq!(decode_one(&[0x0040_1234]), Command::Noop);
    assert_eq!(Command::Noop.write_set(), WriteSet::None);
}

#[test]
fn mi_user_interrupt() {
    // MI_USER_INTERRUPT: opcode 0x02 << 23.
    let golden = [0x0100_0000];
    assert_eq!(encode::user_interrupt(), golden);
    assert_eq!(decode_one(&golden), Command::UserInterrupt);
}

#[test]
fn mi_arb_on_off() {
    // MI_ARB_ON_OFF: opcode 0x08 << 23, bit 0 enable. i915 emits both
    // around every batch start (gen8_emit_bb_start{,_noarb}) and enables
    // again in the final breadcrumb.
    let (on, off) = ([0x0400_0001], [0x0400_0000]);
    assert_eq!(encode::arb_on_off(true), on);
    assert_eq!(encode::arb_on_off(false), off);
    assert_eq!(decode_one(&on), Command::ArbOnOff { enable: true });
    assert_eq!(decode_one(&off), Command::ArbOnOff { enable: false });
    assert_eq!(
        Command::ArbOnOff { enable: true }.write_set(),
        WriteSet::None
    );
    assert_eq!(
        Command::ArbOnOff { enable: false }.write_set(),
        WriteSet::None
    );
}

#[test]
fn mi_arb_check() {
    // MI_ARB_CHECK: opcode 0x05 << 23, no fields (i915's preemption
    // points: init breadcrumb, busywait, wa tail).
    let golden = [0x0280_0000];
    assert_eq!(encode::arb_check(), golden);
    assert_eq!(decode_one(&golden), Command::ArbCheck);
    assert_eq!(Command::ArbCheck.write_set(), WriteSet::None);
}

/// Every command of a Linux 6.12 i915 request on Gen8/Gen9 execlists, as
/// `gt/gen8_engine_cs.c` writes it, decoded one by one with its write set.
#[test]
fn i915_gen8_request_commands() {
    let seqno = 0x6080;
    let cases: [(&[u32], WriteSet); 11] = [
        // gen8_emit_flush_rcs(EMIT_INVALIDATE), Gen9 VF workaround: a null
        // PIPE_CONTROL.
        (&[0x7a00_0004, 0, 0, 0, 0, 0], WriteSet::None),
        // ... then CS stall, invalidates, qword write, store data index at
        // LRC_PPHWSP_SCRATCH_ADDR (0xd0).
        (
            &[0x7a00_0004, 0x0034_4c1c, 0xd0, 0, 0, 0],
            range(HWSP + 0xd0, 8),
        ),
        // gen8_emit_flush_rcs(EMIT_FLUSH): CS stall and cache flushes; the
        // scratch offset is there but without a post-sync operation
        // nothing is written.
        (&[0x7a00_0004, 0x0010_10a1, 0xd0, 0, 0, 0], WriteSet::None),
        // gen8_emit_flush_xcs(EMIT_INVALIDATE): MI_FLUSH_DW + 1, store
        // index, post-sync dword store, TLB invalidate.
        (&[0x1324_4002, 0xd0, 0, 0], range(HWSP + 0xd0, 8)),
        // gen8_emit_init_breadcrumb: MI_STORE_DWORD_IMM_GEN4 | MI_USE_GGTT.
        (&[0x1040_0002, seqno as u32, 0, 41], range(seqno, 4)),
        // gen8_emit_fini_breadcrumb_rcs: a flushing PIPE_CONTROL ...
        (&[0x7a00_0004, 0x0014_1021, 0, 0, 0, 0], WriteSet::None),
        // ... and gen8_emit_ggtt_write_rcs: flush enable, CS stall, GGTT,
        // qword write.
        (
            &[0x7a00_0004, 0x0110_4080, seqno as u32, 0, 42, 0],
            range(seqno, 8),
        ),
        // gen8_emit_fini_breadcrumb_xcs: gen8_emit_ggtt_write, a 4-dword
        // MI_FLUSH_DW storing a dword through the GGTT (audited as the
        // qword every post-sync write is).
        (&[0x1300_4002, seqno as u32 | 4, 0, 42], range(seqno, 8)),
        // emit_preempt_busywait: poll the status page's preemption slot.
        (&[0x0e40_c002, 0, (HWSP + 0xc8) as u32, 0], WriteSet::None),
        // The tail: MI_USER_INTERRUPT, MI_ARB_ON_OFF | MI_ARB_ENABLE.
        (&[0x0100_0000], WriteSet::None),
        (&[0x0400_0001], WriteSet::None),
    ];
    for (dw, expected) in cases {
        assert_eq!(decode_one(dw).write_set(), expected, "{dw:08x?}");
    }
}

#[test]
fn mi_batch_buffer_start_and_end() {
    // MI_BATCH_BUFFER_START (Gen8): opcode 0x31 << 23, length 1 (3 dwords),
    // DW1 address 31:2, DW2 address 47:32. Bit 22: second level.
    let first = [0x1880_0001, 0x0001_0000, 0x0000_0000];
    let second = [0x18c0_0001, 0x0002_0000, 0x0000_0000];
    // MI_BATCH_BUFFER_END: opcode 0x0a << 23.
    let end = [0x0500_0000];
    assert_eq!(encode::batch_buffer_start(0x1_0000, false), first);
    assert_eq!(encode::batch_buffer_start(0x2_0000, true), second);
    assert_eq!(encode::batch_buffer_end(), end);

    let mut mem = Mem::new();
    mem.put(0x1_0000, &cat(&[&second, &end]));
    mem.put(0x2_0000, &end);
    let (r, cmds) = run_with(&first, &cfg(), &mut mem);
    let s = r.unwrap();
    assert_eq!((s.batches, s.max_depth, s.commands), (2, 2, 4));
    let kinds: Vec<_> = cmds.iter().map(|c| (c.gfx_addr, c.level, c.kind)).collect();
    assert_eq!(
        kinds,
        [
            (
                RING,
                0,
                Command::BatchStart {
                    space: Ggtt,
                    addr: 0x1_0000,
                    second_level: false,
                    level: 1,
                    already_audited: false
                }
            ),
            (
                0x1_0000,
                1,
                Command::BatchStart {
                    space: Ggtt,
                    addr: 0x2_0000,
                    second_level: true,
                    level: 2,
                    already_audited: false
                }
            ),
            (0x2_0000, 2, Command::BatchEnd),
            (0x1_000c, 1, Command::BatchEnd),
        ]
    );
    assert!(cmds.iter().all(|c| c.kind.write_set() == WriteSet::None));
}

#[test]
fn mi_batch_buffer_start_ppgtt() {
    // Bit 8, the address space indicator: the batch is in the PPGTT and
    // runs non-privileged (i915's gen8_emit_bb_start sets it for every user
    // batch: MI_BATCH_BUFFER_START_GEN8 | BIT(8)).
    let golden = [0x1880_0101, 0x0001_0000, 0x0000_0000];
    assert_eq!(encode::batch_buffer_start_ppgtt(0x1_0000, false), golden);
    let mut mem = Mem::new();
    mem.put_ppgtt(0x1_0000, &encode::batch_buffer_end());
    let (r, cmds) = run_with(&golden, &ppgtt_cfg(), &mut mem);
    r.unwrap();
    assert_eq!(
        cmds[0].kind,
        Command::BatchStart {
            space: Ppgtt,
            addr: 0x1_0000,
            second_level: false,
            level: 1,
            already_audited: false
        }
    );
    assert_eq!((cmds[1].space, cmds[1].gfx_addr), (Ppgtt, 0x1_0000));
}

#[test]
fn mi_store_data_imm() {
    // MI_STORE_DATA_IMM (Gen8): opcode 0x20 << 23, bit 22 use GGTT, length 2
    // (4 dwords); DW1 address 31:2, DW2 address 47:32, DW3 data.
    let golden = [0x1040_0002, 0x0001_2340, 0x0000_0000, 0xdead_beef];
    assert_eq!(encode::store_data_imm(0x1_2340, 0xdead_beef), golden);
    let c = decode_one(&golden);
    assert_eq!(
        c,
        Command::StoreDataImm {
            space: Ggtt,
            addr: 0x1_2340,
            data: [0xdead_beef, 0],
            qword: false
        }
    );
    assert_eq!(c.write_set(), range(0x1_2340, 4));

    // Qword form: bit 21 "Store Qword", length 3 (5 dwords).
    let golden = [
        0x1060_0003,
        0x0001_2348,
        0x0000_0000,
        0x1111_1111,
        0x2222_2222,
    ];
    assert_eq!(
        encode::store_qword_imm(0x1_2348, 0x2222_2222_1111_1111),
        golden
    );
    let c = decode_one(&golden);
    assert_eq!(
        c,
        Command::StoreDataImm {
            space: Ggtt,
            addr: 0x1_2348,
            data: [0x1111_1111, 0x2222_2222],
            qword: true
        }
    );
    assert_eq!(c.write_set(), range(0x1_2348, 8));
}

#[test]
fn mi_store_data_index() {
    // MI_STORE_DATA_INDEX: opcode 0x21 << 23, length 1 (3 dwords); DW1
    // offset 11:2 into the hardware status page, DW2 data.
    let golden = [0x1080_0001, 0x0000_0100, 0x0000_0007];
    assert_eq!(encode::store_data_index(0x100, 7), golden);
    let c = decode_one(&golden);
    assert_eq!(
        c,
        Command::StoreDataIndex {
            offset: 0x100,
            addr: HWSP + 0x100,
            data: [7, 0],
            qword: false
        }
    );
    assert_eq!(c.write_set(), range(HWSP + 0x100, 4));

    // Qword: bit 21, length 2 (4 dwords).
    let golden = [0x10a0_0002, 0x0000_0ff8, 0x0000_0001, 0x0000_0002];
    assert_eq!(encode::store_qword_index(0xff8, 0x2_0000_0001), golden);
    let c = decode_one(&golden);
    assert_eq!(c.write_set(), range(HWSP + 0xff8, 8));
}

#[test]
fn mi_load_register_imm() {
    // MI_LOAD_REGISTER_IMM: opcode 0x22 << 23, length 2n-1; pairs follow.
    let golden = [0x1100_0001, 0x0000_2600, 0x0000_0005];
    assert_eq!(encode::load_register_imm(0x2600, 5), golden);
    assert_eq!(
        decode_one(&golden),
        Command::LoadRegisterImm {
            reg: 0x2600,
            value: 5,
            byte_disable: 0
        }
    );
    // Two pairs (length 3), byte write disables 0b0011: two commands.
    let two = [0x1100_0303, 0x2600, 1, 0x2604, 2];
    assert_eq!(encode::load_register_imm_header(2), 0x1100_0003);
    let (r, cmds) = run(&two);
    assert_eq!(r.unwrap().commands, 1);
    let got: Vec<_> = cmds.iter().map(|c| c.kind).collect();
    assert_eq!(
        got,
        [
            Command::LoadRegisterImm {
                reg: 0x2600,
                value: 1,
                byte_disable: 3
            },
            Command::LoadRegisterImm {
                reg: 0x2604,
                value: 2,
                byte_disable: 3
            }
        ]
    );
    assert!(cmds.iter().all(|c| c.gfx_addr == RING));
}

#[test]
fn mi_store_and_load_register_mem() {
    // MI_STORE_REGISTER_MEM (Gen8): opcode 0x24 << 23, bit 22 GGTT, length 2.
    let srm = [0x1240_0002, 0x0000_20d8, 0x0000_5000, 0x0000_0000];
    assert_eq!(encode::store_register_mem(0x20d8, 0x5000), srm);
    let c = decode_one(&srm);
    assert_eq!(
        c,
        Command::StoreRegisterMem {
            space: Ggtt,
            reg: 0x20d8,
            addr: 0x5000
        }
    );
    assert_eq!(c.write_set(), range(0x5000, 4));
    // MI_LOAD_REGISTER_MEM (Gen8): opcode 0x29 << 23, bit 22 GGTT, length 2.
    let lrm = [0x14c0_0002, 0x0000_2600, 0x0000_5004, 0x0000_0000];
    assert_eq!(encode::load_register_mem(0x2600, 0x5004), lrm);
    let c = decode_one(&lrm);
    assert_eq!(
        c,
        Command::LoadRegisterMem {
            space: Ggtt,
            reg: 0x2600,
            addr: 0x5004
        }
    );
    assert_eq!(c.write_set(), WriteSet::None);
}

#[test]
fn mi_copy_mem_mem() {
    // MI_COPY_MEM_MEM: opcode 0x2e << 23, bits 22/21 GGTT source/destination,
    // length 3; DW1-2 destination, DW3-4 source.
    let golden = [
        0x1760_0003,
        0x0000_6000,
        0x0000_0000,
        0x0000_7000,
        0x0000_0000,
    ];
    assert_eq!(encode::copy_mem_mem(0x6000, 0x7000), golden);
    let c = decode_one(&golden);
    assert_eq!(
        c,
        Command::CopyMemMem {
            dst_space: Ggtt,
            src_space: Ggtt,
            dst: 0x6000,
            src: 0x7000
        }
    );
    assert_eq!(c.write_set(), range(0x6000, 4));
}

#[test]
fn mi_atomic() {
    // MI_ATOMIC: opcode 0x2f << 23, bit 22 GGTT, 20:19 data size, 15:8
    // opcode (0x04 = 4-byte MOVE, i915's MI_ATOMIC_MOVE), length 1.
    let golden = [0x17c0_0401, 0x0000_8000, 0x0000_0000];
    assert_eq!(encode::atomic(0x8000, 0x04, 0), golden);
    let c = decode_one(&golden);
    assert_eq!(
        c,
        Command::Atomic {
            space: Ggtt,
            addr: 0x8000,
            len: 4,
            opcode: 4,
            size: 0,
            inline_data: None
        }
    );
    assert_eq!(c.write_set(), range(0x8000, 4));
    // Qword data size (bits 20:19 = 1), inline data (bit 18), length 9.
    let mut golden = [0u32; 11];
    golden[..3].copy_from_slice(&[0x17cc_2409, 0x0000_8008, 0x0000_0000]);
    golden[3] = 9;
    assert_eq!(
        encode::atomic_inline(0x8008, 0x24, 1, [9, 0, 0, 0, 0, 0, 0, 0]),
        golden
    );
    let c = decode_one(&golden);
    assert_eq!(c.write_set(), range(0x8008, 8));
    // Octword (size 2): 16 bytes.
    let c = decode_one(&encode::atomic(0x8010, 0x44, 2));
    assert_eq!(c.write_set(), range(0x8010, 16));
    // A dword size with a qword-class opcode is audited as 8 bytes.
    let c = decode_one(&encode::atomic(0x8018, 0x24, 0));
    assert_eq!(c.write_set(), range(0x8018, 8));
}

#[test]
fn mi_flush_dw() {
    // MI_FLUSH_DW: opcode 0x26 << 23, length 2 (4 dwords), no post-sync.
    let golden = [0x1300_0002, 0, 0, 0];
    assert_eq!(encode::flush_dw(), golden);
    let c = decode_one(&golden);
    assert_eq!(
        c,
        Command::FlushDw {
            post_sync: PostSync::None,
            notify: false
        }
    );
    assert_eq!(c.write_set(), WriteSet::None);
    // Post-sync write immediate (15:14 = 1); DW1 bit 2 = GGTT.
    let golden = [0x1300_4002, 0x0000_9004, 0x0000_0000, 0x0000_0042];
    assert_eq!(encode::flush_dw_store(0x9000, 0x42), golden);
    let c = decode_one(&golden);
    assert_eq!(
        c,
        Command::FlushDw {
            post_sync: PostSync::WriteImm {
                space: Ggtt,
                addr: 0x9000,
                data: [0x42, 0]
            },
            notify: false
        }
    );
    assert_eq!(c.write_set(), range(0x9000, 8));
    // Qword form, length 3.
    let golden = [0x1300_4003, 0x0000_9014, 0, 1, 2];
    assert_eq!(encode::flush_dw_store_qword(0x9010, 0x2_0000_0001), golden);
    assert_eq!(decode_one(&golden).write_set(), range(0x9010, 8));
    // Timestamp (15:14 = 3).
    let golden = [0x1300_c002, 0x0000_9024, 0, 0];
    assert_eq!(encode::flush_dw_timestamp(0x9020), golden);
    assert_eq!(decode_one(&golden).write_set(), range(0x9020, 8));
    // Store data index (bit 21) with notify (bit 8), as i915's breadcrumb.
    let golden = [0x1320_4102, 0x0000_0104, 0, 5];
    assert_eq!(encode::flush_dw_store_index(0x100, 5, true), golden);
    let c = decode_one(&golden);
    assert_eq!(
        c,
        Command::FlushDw {
            post_sync: PostSync::WriteImm {
                space: Ggtt,
                addr: HWSP + 0x100,
                data: [5, 0]
            },
            notify: true
        }
    );
}

#[test]
fn pipe_control() {
    // PIPE_CONTROL (Gen8): type 3, subtype 3, opcode 2 => 0x7a00_0000,
    // length 4 (6 dwords). DW1: CS stall (20), no post-sync.
    let golden = [0x7a00_0004, 0x0010_0000, 0, 0, 0, 0];
    assert_eq!(encode::pipe_control(1 << 20), golden);
    let c = decode_one(&golden);
    assert_eq!(
        c,
        Command::PipeControl {
            flags: 1 << 20,
            post_sync: PostSync::None
        }
    );
    assert_eq!(c.write_set(), WriteSet::None);
    // Write immediate (15:14 = 1) to a GGTT (bit 24) qword.
    let golden = [0x7a00_0004, 0x0110_4000, 0x0000_a000, 0, 0x1234, 0x5678];
    assert_eq!(
        encode::pipe_control_write_imm(1 << 20, 0xa000, 0x5678_0000_1234),
        golden
    );
    let c = decode_one(&golden);
    assert_eq!(
        c,
        Command::PipeControl {
            flags: 0x0110_4000,
            post_sync: PostSync::WriteImm {
                space: Ggtt,
                addr: 0xa000,
                data: [0x1234, 0x5678]
            }
        }
    );
    assert_eq!(c.write_set(), range(0xa000, 8));
    // Timestamp (15:14 = 3).
    let golden = [0x7a00_0004, 0x0110_c000, 0x0000_a008, 0, 0, 0];
    assert_eq!(encode::pipe_control_timestamp(1 << 20, 0xa008), golden);
    assert_eq!(decode_one(&golden).write_set(), range(0xa008, 8));
    // PS depth count (15:14 = 2).
    let c = decode_one(&[0x7a00_0004, 0x0100_8000, 0xa010, 0, 0, 0]);
    assert_eq!(c.write_set(), range(0xa010, 8));
    // Store data index (bit 21): offset into the status page.
    let c = decode_one(&[0x7a00_0004, 0x0020_4000, 0x40, 0, 1, 0]);
    assert_eq!(c.write_set(), range(HWSP + 0x40, 8));
}

#[test]
fn mi_semaphore_wait() {
    // MI_SEMAPHORE_WAIT (Gen8): opcode 0x1c << 23, bit 22 GGTT, bit 15
    // polling, 14:12 compare (4: SAD == SDD), length 2.
    let golden = [0x0e40_c002, 0x0000_0001, 0x0000_b000, 0x0000_0000];
    assert_eq!(encode::semaphore_wait(0xb000, 1, 4), golden);
    let c = decode_one(&golden);
    assert_eq!(
        c,
        Command::SemaphoreWait {
            space: Ggtt,
            addr: 0xb000,
            data: 1,
            compare: 4,
            poll: true
        }
    );
    assert_eq!(c.write_set(), WriteSet::None);
}

fn rect(base: u64, pitch: u16, x: u16, y: u16) -> encode::BlitRect {
    encode::BlitRect { base, pitch, x, y }
}

#[test]
fn xy_color_blt() {
    // XY_COLOR_BLT (Gen8): client 2, opcode 0x50 << 22, bits 21:20 write
    // RGBA, length 5 (7 dwords). DW1: depth 32 (3 << 24), ROP 0xf0, pitch
    // 0x1000. DW2 Y1:X1 = (2, 4), DW3 Y2:X2 = (5, 20), DW4-5 base, DW6 color.
    let golden = [
        0x5430_0005,
        0x03f0_1000,
        0x0002_0004,
        0x0005_0014,
        0x0010_0000,
        0x0000_0000,
        0x00ff_00ff,
    ];
    assert_eq!(
        encode::xy_color_blt(rect(0x10_0000, 0x1000, 4, 2), 4, 16, 3, 0x00ff_00ff),
        golden
    );
    let c = decode_one(&golden);
    assert_eq!(
        c,
        Command::Blit(Blit {
            kind: BlitKind::Color,
            bpp: 4,
            width: 16,
            height: 3,
            dst: Surface {
                space: Ggtt,
                base: 0x10_0000,
                pitch: 0x1000,
                x: 4,
                y: 2
            },
            src: None,
            rop: 0xf0,
            color: 0x00ff_00ff
        })
    );
    // Rows 2..5 of a 4 KiB pitch, 64 bytes each from x = 4 * 4 bytes.
    let ws = c.write_set();
    assert_eq!(
        ws,
        WriteSet::Strided(Strided {
            space: Ggtt,
            base: 0x10_0000 + 2 * 0x1000 + 16,
            row_bytes: 64,
            pitch: 0x1000,
            rows: 3
        })
    );
    let rows: Vec<_> = ws.ranges().collect();
    assert_eq!(
        rows,
        [
            WriteRange {
                space: Ggtt,
                gfx_addr: 0x10_2010,
                len: 64
            },
            WriteRange {
                space: Ggtt,
                gfx_addr: 0x10_3010,
                len: 64
            },
            WriteRange {
                space: Ggtt,
                gfx_addr: 0x10_4010,
                len: 64
            }
        ]
    );
    assert_eq!(ws.pages().collect::<Vec<_>>(), [0x102, 0x103, 0x104]);
}

#[test]
fn xy_src_copy_blt() {
    // XY_SRC_COPY_BLT (Gen8): opcode 0x53 << 22, write RGBA, length 8 (10
    // dwords). DW1: depth 32, ROP 0xcc (source copy), dst pitch 0x1000.
    // As i915's emit_copy for Gen8: a page-wide copy of 2 rows.
    let golden = [
        0x54f0_0008,
        0x03cc_1000,
        0x0000_0000,
        0x0002_0400,
        0x0020_0000,
        0x0000_0000,
        0x0000_0000,
        0x0000_1000,
        0x0030_0000,
        0x0000_0000,
    ];
    assert_eq!(
        encode::xy_src_copy_blt(
            rect(0x20_0000, 0x1000, 0, 0),
            rect(0x30_0000, 0x1000, 0, 0),
            4,
            0x400,
            2
        ),
        golden
    );
    let c = decode_one(&golden);
    let Command::Blit(b) = c else { panic!("{c:?}") };
    assert_eq!(
        (b.kind, b.bpp, b.width, b.height, b.rop),
        (BlitKind::SrcCopy, 4, 0x400, 2, 0xcc)
    );
    assert_eq!(
        b.src,
        Some(Surface {
            space: Ggtt,
            base: 0x30_0000,
            pitch: 0x1000,
            x: 0,
            y: 0
        })
    );
    assert_eq!(c.write_set().pages().collect::<Vec<_>>(), [0x200, 0x201]);
}

#[test]
fn xy_fast_copy_blt() {
    // XY_FAST_COPY_BLT (Gen9): opcode 0x42 << 22, length 8 (10 dwords), as
    // i915's Gen9 emit_copy: DW1 depth code 3 (32 bpp) | pitch 0x1000.
    let golden = [
        0x5080_0008,
        0x0300_1000,
        0x0000_0000,
        0x0004_0400,
        0x0040_0000,
        0x0000_0000,
        0x0000_0000,
        0x0000_1000,
        0x0050_0000,
        0x0000_0000,
    ];
    assert_eq!(
        encode::xy_fast_copy_blt(
            rect(0x40_0000, 0x1000, 0, 0),
            rect(0x50_0000, 0x1000, 0, 0),
            4,
            0x400,
            4
        ),
        golden
    );
    let c = decode_one(&golden);
    let Command::Blit(b) = c else { panic!("{c:?}") };
    assert_eq!(
        (b.kind, b.bpp, b.width, b.height),
        (BlitKind::FastCopy, 4, 0x400, 4)
    );
    assert_eq!(
        c.write_set().pages().collect::<Vec<_>>(),
        [0x400, 0x401, 0x402, 0x403]
    );
    // Depth codes 0, 1, 4, 5: 1, 2, 8, 16 bytes per pixel.
    for (code, bpp) in [(0u32, 1u8), (1, 2), (4, 8), (5, 16)] {
        let mut dw = golden;
        dw[1] = (code << 24) | 0x1000;
        let Command::Blit(b) = decode_one(&dw) else {
            panic!()
        };
        assert_eq!(b.bpp, bpp);
    }
}

#[test]
fn legacy_blit_depths() {
    // DW1 bits 25:24: 0 = 8 bpp, 1 = 565, 2 = 1555, 3 = 32 bpp.
    for (code, bpp) in [(0u32, 1u8), (1, 2), (2, 2), (3, 4)] {
        let mut dw = encode::xy_color_blt(rect(0x10_0000, 0x100, 0, 0), 4, 8, 1, 0);
        dw[1] = (dw[1] & !(3 << 24)) | (code << 24);
        let c = decode_one(&dw);
        let Command::Blit(b) = c else { panic!() };
        assert_eq!(b.bpp, bpp);
        assert_eq!(
            c.write_set(),
            WriteSet::Strided(Strided {
                space: Ggtt,
                base: 0x10_0000,
                row_bytes: 8 * u64::from(bpp),
                pitch: 0x100,
                rows: 1
            })
        );
    }
}
