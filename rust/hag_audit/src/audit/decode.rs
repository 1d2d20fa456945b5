//! Decoding and validation of one command, given its dwords.
//!
//! Checks run in a fixed order: length field, then named refusals, then
//! reserved bits, then field values and alignment, then address ranges,
//! then registers. All arithmetic on guest values is checked.
//!
//! Each command is decoded knowing where it runs (`batch`: `None` in the
//! ring, else the address space of the batch), since that decides the
//! address space of its memory operands.

use super::opcodes::*;
use super::{
    AddressSpace, AuditConfig, Blit, BlitKind, Command, PostSync, Reason, Surface, HWSP_SIZE,
};

/// Longest fixed-length command (MI_ATOMIC with inline data).
pub(super) const MAX_FIXED: usize = 11;

/// How many dwords a command takes, from its header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Shape {
    /// A fixed number of dwords (at most [`MAX_FIXED`]), header included.
    Fixed(u32),
    /// MI_LOAD_REGISTER_IMM: a header then `pairs` register/value pairs.
    Lri {
        /// Number of pairs (1 to 128).
        pairs: u32,
        /// Byte write disables.
        byte_disable: u8,
    },
}

fn expect_len(field: u32, expected: u32) -> Result<Shape, Reason> {
    let len = field.saturating_add(2);
    if len == expected {
        Ok(Shape::Fixed(expected))
    } else {
        Err(Reason::BadLength { len, expected })
    }
}

/// The shape of a command: checks its length field.
pub(super) fn shape(op: Op, header: u32) -> Result<Shape, Reason> {
    let len8 = header & LEN_MASK_8;
    match op {
        Op::Noop | Op::UserInterrupt | Op::ArbCheck | Op::ArbOnOff | Op::BatchEnd => {
            Ok(Shape::Fixed(1))
        }
        Op::BatchStart => expect_len(len8, MI_BB_START_DWORDS),
        Op::SemaphoreWait => expect_len(len8, MI_SEMAPHORE_WAIT_DWORDS),
        Op::StoreDataImm => {
            let expected = if header & MI_SDI_QWORD != 0 { 5 } else { 4 };
            expect_len(header & LEN_MASK_10, expected)
        }
        Op::StoreDataIndex => {
            let expected = if header & MI_SDX_QWORD != 0 { 4 } else { 3 };
            expect_len(len8, expected)
        }
        Op::LoadRegisterImm => {
            if len8.is_multiple_of(2) {
                return Err(Reason::BadLength {
                    len: len8 + 2,
                    expected: len8 + 3,
                });
            }
            Ok(Shape::Lri {
                pairs: len8.div_ceil(2),
                byte_disable: ((header >> MI_LRI_BYTE_DISABLE_SHIFT) & 0xf) as u8,
            })
        }
        Op::StoreRegisterMem => expect_len(len8, MI_SRM_DWORDS),
        Op::LoadRegisterMem => expect_len(len8, MI_LRM_DWORDS),
        Op::FlushDw => {
            let len = (header & LEN_MASK_6) + 2;
            if len == 4 || len == 5 {
                Ok(Shape::Fixed(len))
            } else {
                Err(Reason::BadLength { len, expected: 4 })
            }
        }
        Op::CopyMemMem => expect_len(len8, MI_COPY_MEM_MEM_DWORDS),
        Op::Atomic => {
            let expected = if header & MI_ATOMIC_INLINE != 0 {
                MI_ATOMIC_INLINE_DWORDS
            } else {
                MI_ATOMIC_DWORDS
            };
            expect_len(len8, expected)
        }
        Op::PipeControl => expect_len(len8, PIPE_CONTROL_DWORDS),
        Op::XyColorBlt => expect_len(len8, XY_COLOR_BLT_DWORDS),
        Op::XySrcCopyBlt => expect_len(len8, XY_SRC_COPY_BLT_DWORDS),
        Op::XyFastCopyBlt => expect_len(len8, XY_FAST_COPY_BLT_DWORDS),
    }
}

/// Bits of an MI header that identify the command (client and opcode).
const MI_ID_BITS: u32 = 0xff80_0000;
/// Bits of a 2D header that identify the command.
const BLT_ID_BITS: u32 = 0xffc0_0000;

fn reserved(dword: u8, value: u32, allowed: u32) -> Result<(), Reason> {
    let bits = value & !allowed;
    if bits == 0 {
        Ok(())
    } else {
        Err(Reason::ReservedBits { dword, bits })
    }
}

fn unsupported(what: &'static str) -> Reason {
    Reason::Unsupported { what }
}

/// The address space of a memory operand whose "use global GTT" bit is
/// `ggtt_bit`, in a command running in `batch` (`None`: the ring).
///
/// A PPGTT batch is non-privileged: the hardware translates all its operands
/// through the PPGTT whatever the bit says (GVT-g's scanner likewise treats
/// them as PPGTT). Elsewhere the bit selects; a clear bit is refused when
/// the configuration has no PPGTT.
fn operand_space(
    ggtt_bit: bool,
    batch: Option<AddressSpace>,
    cfg: &AuditConfig<'_>,
) -> Result<AddressSpace, Reason> {
    if batch == Some(AddressSpace::Ppgtt) {
        Ok(AddressSpace::Ppgtt)
    } else if ggtt_bit {
        Ok(AddressSpace::Ggtt)
    } else if cfg.ppgtt_size == 0 {
        Err(unsupported(
            "PPGTT address space (only the global GTT is audited)",
        ))
    } else {
        Ok(AddressSpace::Ppgtt)
    }
}

fn aligned(addr: u64, align: u64) -> Result<(), Reason> {
    if addr.is_multiple_of(align) {
        Ok(())
    } else {
        Err(Reason::Misaligned { addr, align })
    }
}

/// Checks that `[addr, addr + len)` lies inside `space` (graphics memory
/// for the GGTT, `ppgtt_size` bytes for the PPGTT).
pub(super) fn in_range(
    space: AddressSpace,
    addr: u64,
    len: u64,
    cfg: &AuditConfig<'_>,
) -> Result<(), Reason> {
    let limit = cfg.space_size(space);
    match addr.checked_add(len) {
        Some(end) if end <= limit => Ok(()),
        _ => Err(Reason::AddressOutOfRange {
            space,
            addr,
            len,
            limit,
        }),
    }
}

fn register(reg: u32, cfg: &AuditConfig<'_>) -> Result<u32, Reason> {
    if cfg.register_allowed(reg) {
        Ok(reg)
    } else {
        Err(Reason::RegisterNotAllowed { reg })
    }
}

/// A 48-bit address from its low and high dwords (the high dword's upper
/// bits are kept, so a set reserved bit shows up as out of range).
const fn addr64(lo: u32, hi: u32) -> u64 {
    ((hi as u64) << 32) | lo as u64
}

/// An address in the hardware status page at `offset`, `len` bytes (the
/// status page is in the GGTT, whatever batch the command runs in).
fn hwsp(offset: u64, len: u64, cfg: &AuditConfig<'_>) -> Result<u64, Reason> {
    match offset.checked_add(len) {
        Some(end) if end <= HWSP_SIZE => {}
        _ => {
            return Err(Reason::BadField {
                field: "status page offset",
                value: offset,
            })
        }
    }
    let addr = cfg
        .hwsp_gfx_addr
        .checked_add(offset)
        .ok_or(Reason::AddressOutOfRange {
            space: AddressSpace::Ggtt,
            addr: cfg.hwsp_gfx_addr,
            len: offset,
            limit: cfg.gfx_mem_size,
        })?;
    in_range(AddressSpace::Ggtt, addr, len, cfg)?;
    Ok(addr)
}

/// Decodes and validates a fixed-length command whose dwords (header first)
/// are in `dw`; `shape` already checked its length. `batch` is the address
/// space of the batch it runs in, `None` in the ring.
pub(super) fn decode(
    op: Op,
    dw: &[u32; MAX_FIXED],
    batch: Option<AddressSpace>,
    cfg: &AuditConfig<'_>,
) -> Result<Command, Reason> {
    let h = dw[0];
    match op {
        Op::Noop => {
            reserved(0, h, MI_ID_BITS | MI_NOOP_ALLOWED)?;
            Ok(Command::Noop)
        }
        Op::UserInterrupt => {
            reserved(0, h, MI_ID_BITS)?;
            Ok(Command::UserInterrupt)
        }
        Op::ArbCheck => {
            reserved(0, h, MI_ID_BITS)?;
            Ok(Command::ArbCheck)
        }
        Op::ArbOnOff => {
            reserved(0, h, MI_ID_BITS | MI_ARB_ENABLE)?;
            Ok(Command::ArbOnOff {
                enable: h & MI_ARB_ENABLE != 0,
            })
        }
        Op::BatchEnd => {
            reserved(0, h, MI_ID_BITS)?;
            Ok(Command::BatchEnd)
        }
        Op::BatchStart => {
            let space = if h & MI_BB_PPGTT == 0 {
                AddressSpace::Ggtt
            } else if cfg.ppgtt_size == 0 {
                return Err(unsupported("batch buffer in the PPGTT address space"));
            } else {
                AddressSpace::Ppgtt
            };
            // GVT-g takes the address space from the ring's batch start
            // only and ignores the bit on chained and second-level starts;
            // the hardware does not let a non-privileged batch become
            // privileged. A batch start that names another space than its
            // batch's is therefore ambiguous: refuse it.
            match (batch, space) {
                (Some(AddressSpace::Ppgtt), AddressSpace::Ggtt) => {
                    return Err(unsupported("GGTT batch started from a PPGTT batch"))
                }
                (Some(AddressSpace::Ggtt), AddressSpace::Ppgtt) => {
                    return Err(unsupported("PPGTT batch started from a GGTT batch"))
                }
                _ => {}
            }
            if h & MI_BB_PREDICATE != 0 {
                return Err(unsupported("predicated MI_BATCH_BUFFER_START"));
            }
            if h & MI_BB_ADD_OFFSET != 0 {
                return Err(unsupported("MI_BATCH_BUFFER_START add offset enable"));
            }
            reserved(
                0,
                h,
                MI_ID_BITS | MI_BB_SECOND_LEVEL | MI_BB_PPGTT | LEN_MASK_8,
            )?;
            let addr = addr64(dw[1], dw[2]);
            aligned(addr, 4)?;
            in_range(space, addr, 4, cfg)?;
            Ok(Command::BatchStart {
                space,
                addr,
                second_level: h & MI_BB_SECOND_LEVEL != 0,
                level: 0,
                already_audited: false,
            })
        }
        Op::SemaphoreWait => {
            let space = operand_space(h & MI_SEMAPHORE_GGTT != 0, batch, cfg)?;
            reserved(0, h, MI_ID_BITS | MI_SEMAPHORE_ALLOWED | LEN_MASK_8)?;
            let addr = addr64(dw[2], dw[3]);
            aligned(addr, 4)?;
            in_range(space, addr, 4, cfg)?;
            Ok(Command::SemaphoreWait {
                space,
                addr,
                data: dw[1],
                compare: ((h >> MI_SEMAPHORE_COMPARE_SHIFT) & 7) as u8,
                poll: h & MI_SEMAPHORE_POLL != 0,
            })
        }
        Op::StoreDataImm => {
            let space = operand_space(h & MI_SDI_GGTT != 0, batch, cfg)?;
            reserved(0, h, MI_ID_BITS | MI_SDI_GGTT | MI_SDI_QWORD | LEN_MASK_10)?;
            if dw[1] & MI_SDI_CORE_MODE != 0 {
                return Err(unsupported("MI_STORE_DATA_IMM core mode"));
            }
            let qword = h & MI_SDI_QWORD != 0;
            let len = if qword { 8 } else { 4 };
            let addr = addr64(dw[1], dw[2]);
            aligned(addr, len)?;
            in_range(space, addr, len, cfg)?;
            Ok(Command::StoreDataImm {
                space,
                addr,
                data: [dw[3], if qword { dw[4] } else { 0 }],
                qword,
            })
        }
        Op::StoreDataIndex => {
            if h & MI_SDX_PPHWSP != 0 {
                return Err(unsupported("per-process hardware status page"));
            }
            reserved(0, h, MI_ID_BITS | MI_SDX_QWORD | LEN_MASK_8)?;
            let qword = h & MI_SDX_QWORD != 0;
            let len = if qword { 8 } else { 4 };
            let offset = dw[1];
            aligned(u64::from(offset), len)?;
            reserved(1, offset, MI_SDX_OFFSET_MASK)?;
            let addr = hwsp(u64::from(offset), len, cfg)?;
            Ok(Command::StoreDataIndex {
                offset: (offset & MI_SDX_OFFSET_MASK) as u16,
                addr,
                data: [dw[2], if qword { dw[3] } else { 0 }],
                qword,
            })
        }
        Op::LoadRegisterImm => Err(unsupported("MI_LOAD_REGISTER_IMM outside the pair reader")),
        Op::StoreRegisterMem | Op::LoadRegisterMem => {
            let space = operand_space(h & MI_SRM_LRM_GGTT != 0, batch, cfg)?;
            reserved(
                0,
                h,
                MI_ID_BITS | MI_SRM_LRM_GGTT | MI_SRM_LRM_BIT21 | LEN_MASK_8,
            )?;
            let addr = addr64(dw[2], dw[3]);
            aligned(addr, 4)?;
            in_range(space, addr, 4, cfg)?;
            let reg = register(dw[1], cfg)?;
            Ok(if op == Op::StoreRegisterMem {
                Command::StoreRegisterMem { reg, space, addr }
            } else {
                Command::LoadRegisterMem { reg, space, addr }
            })
        }
        Op::CopyMemMem => {
            // Each operand has its own GGTT bit; a clear one is refused
            // first when there is no PPGTT, as before PPGTT support.
            let src_space = operand_space(h & MI_CMM_GGTT_SRC != 0, batch, cfg)?;
            let dst_space = operand_space(h & MI_CMM_GGTT_DST != 0, batch, cfg)?;
            reserved(
                0,
                h,
                MI_ID_BITS | MI_CMM_GGTT_SRC | MI_CMM_GGTT_DST | LEN_MASK_8,
            )?;
            let dst = addr64(dw[1], dw[2]);
            let src = addr64(dw[3], dw[4]);
            aligned(dst, 4)?;
            aligned(src, 4)?;
            in_range(dst_space, dst, 4, cfg)?;
            in_range(src_space, src, 4, cfg)?;
            Ok(Command::CopyMemMem {
                dst_space,
                dst,
                src_space,
                src,
            })
        }
        Op::Atomic => {
            if h & MI_ATOMIC_RETURN_DATA != 0 {
                return Err(unsupported("MI_ATOMIC return data"));
            }
            let space = operand_space(h & MI_ATOMIC_GGTT != 0, batch, cfg)?;
            reserved(
                0,
                h,
                MI_ID_BITS
                    | MI_ATOMIC_GGTT
                    | MI_ATOMIC_POST_SYNC
                    | (3 << MI_ATOMIC_SIZE_SHIFT)
                    | MI_ATOMIC_INLINE
                    | MI_ATOMIC_CS_STALL
                    | (0xff << MI_ATOMIC_OPCODE_SHIFT)
                    | LEN_MASK_8,
            )?;
            let size = (h >> MI_ATOMIC_SIZE_SHIFT) & 3;
            let opcode = (h >> MI_ATOMIC_OPCODE_SHIFT) & 0xff;
            // Bytes by the data size field and by the opcode's size class
            // (opcode bits 6:5); audit the larger, so neither can hide a write.
            let by_size = match size {
                0 => 4u8,
                1 => 8,
                2 => 16,
                _ => {
                    return Err(Reason::BadField {
                        field: "MI_ATOMIC data size",
                        value: u64::from(size),
                    })
                }
            };
            let by_opcode = match (opcode >> 5) & 7 {
                0 => 4u8,
                1 => 8,
                2 => 16,
                _ => {
                    return Err(Reason::BadField {
                        field: "MI_ATOMIC opcode",
                        value: u64::from(opcode),
                    })
                }
            };
            let len = by_size.max(by_opcode);
            let addr = addr64(dw[1], dw[2]);
            aligned(addr, u64::from(len))?;
            in_range(space, addr, u64::from(len), cfg)?;
            let inline_data = if h & MI_ATOMIC_INLINE != 0 {
                Some([dw[3], dw[4], dw[5], dw[6], dw[7], dw[8], dw[9], dw[10]])
            } else {
                None
            };
            Ok(Command::Atomic {
                space,
                addr,
                len,
                opcode: opcode as u8,
                size: size as u8,
                inline_data,
            })
        }
        Op::FlushDw => {
            reserved(0, h, MI_ID_BITS | MI_FLUSH_DW_ALLOWED | LEN_MASK_6)?;
            let op = (h >> MI_FLUSH_DW_OP_SHIFT) & 3;
            let qword = h & LEN_MASK_6 == 3;
            let data = [dw[3], if qword { dw[4] } else { 0 }];
            let post_sync = if op == POST_SYNC_NONE {
                PostSync::None
            } else {
                if op == POST_SYNC_DEPTH_COUNT {
                    return Err(Reason::BadField {
                        field: "MI_FLUSH_DW post-sync operation",
                        value: u64::from(op),
                    });
                }
                let (space, addr) = post_sync_addr(
                    h & MI_FLUSH_DW_STORE_INDEX != 0,
                    dw[1] & MI_FLUSH_DW_USE_GTT != 0,
                    dw[1] & !MI_FLUSH_DW_USE_GTT,
                    dw[2],
                    batch,
                    cfg,
                )?;
                if op == POST_SYNC_WRITE_IMM {
                    PostSync::WriteImm { space, addr, data }
                } else {
                    PostSync::Timestamp { space, addr }
                }
            };
            Ok(Command::FlushDw {
                post_sync,
                notify: h & MI_FLUSH_DW_NOTIFY != 0,
            })
        }
        Op::PipeControl => {
            reserved(0, h, PIPE_CONTROL_ID_MASK | LEN_MASK_8)?;
            let flags = dw[1];
            if flags & PC_LRI_POST_SYNC != 0 {
                return Err(unsupported("PIPE_CONTROL LRI post-sync operation"));
            }
            let op = (flags >> PC_POST_SYNC_SHIFT) & 3;
            let post_sync = if op == POST_SYNC_NONE {
                PostSync::None
            } else {
                let (space, addr) = post_sync_addr(
                    flags & PC_STORE_DATA_INDEX != 0,
                    flags & PC_GLOBAL_GTT != 0,
                    dw[2],
                    dw[3],
                    batch,
                    cfg,
                )?;
                match op {
                    POST_SYNC_WRITE_IMM => PostSync::WriteImm {
                        space,
                        addr,
                        data: [dw[4], dw[5]],
                    },
                    POST_SYNC_DEPTH_COUNT => PostSync::DepthCount { space, addr },
                    _ => PostSync::Timestamp { space, addr },
                }
            };
            Ok(Command::PipeControl { flags, post_sync })
        }
        Op::XyColorBlt | Op::XySrcCopyBlt | Op::XyFastCopyBlt => blit(op, dw, batch, cfg),
    }
}

/// The destination of a post-sync write (a qword, qword aligned): an offset
/// into the status page (GGTT), or an address in the space the GGTT bit
/// `global` selects.
fn post_sync_addr(
    index: bool,
    global: bool,
    lo: u32,
    hi: u32,
    batch: Option<AddressSpace>,
    cfg: &AuditConfig<'_>,
) -> Result<(AddressSpace, u64), Reason> {
    let addr = addr64(lo, hi);
    aligned(addr, PostSync::BYTES)?;
    if index {
        Ok((AddressSpace::Ggtt, hwsp(addr, PostSync::BYTES, cfg)?))
    } else {
        let space = operand_space(global, batch, cfg)?;
        in_range(space, addr, PostSync::BYTES, cfg)?;
        Ok((space, addr))
    }
}

/// A 16-bit blit field (coordinate or pitch) that must not have bit 15 set:
/// the PRM makes some of them signed, and negative ones are refused.
fn u15(value: u32, field: &'static str) -> Result<u16, Reason> {
    let v = value & 0xffff;
    if v & 0x8000 != 0 {
        return Err(Reason::BadField {
            field,
            value: u64::from(v),
        });
    }
    Ok(v as u16)
}

/// A blit: its surfaces are in the space of the batch it runs in (the
/// blitter commands have no GGTT bit; the ring is GGTT).
fn blit(
    op: Op,
    dw: &[u32; MAX_FIXED],
    batch: Option<AddressSpace>,
    cfg: &AuditConfig<'_>,
) -> Result<Command, Reason> {
    let h = dw[0];
    let space = batch.unwrap_or(AddressSpace::Ggtt);
    let (kind, bpp) = match op {
        Op::XyColorBlt => {
            if h & XY_DST_TILED != 0 {
                return Err(unsupported("tiled blit destination"));
            }
            reserved(0, h, BLT_ID_BITS | XY_WRITE_RGBA | LEN_MASK_8)?;
            (BlitKind::Color, xy_bpp(dw[1] >> XY_DEPTH_SHIFT))
        }
        Op::XySrcCopyBlt => {
            if h & XY_DST_TILED != 0 {
                return Err(unsupported("tiled blit destination"));
            }
            if h & XY_SRC_TILED != 0 {
                return Err(unsupported("tiled blit source"));
            }
            reserved(0, h, BLT_ID_BITS | XY_WRITE_RGBA | LEN_MASK_8)?;
            (BlitKind::SrcCopy, xy_bpp(dw[1] >> XY_DEPTH_SHIFT))
        }
        _ => {
            if h & XY_FAST_DST_TILING != 0 {
                return Err(unsupported("tiled blit destination"));
            }
            if h & XY_FAST_SRC_TILING != 0 {
                return Err(unsupported("tiled blit source"));
            }
            reserved(0, h, BLT_ID_BITS | LEN_MASK_8)?;
            let depth = (dw[1] & XY_FAST_DEPTH_MASK) >> 24;
            let bpp = fast_bpp(depth).ok_or(Reason::BadField {
                field: "XY_FAST_COPY_BLT color depth",
                value: u64::from(depth),
            })?;
            (BlitKind::FastCopy, bpp)
        }
    };
    let x1 = u15(dw[2], "blit destination X1")?;
    let y1 = u15(dw[2] >> 16, "blit destination Y1")?;
    let x2 = u15(dw[3], "blit destination X2")?;
    let y2 = u15(dw[3] >> 16, "blit destination Y2")?;
    let (width, height) = match (x2.checked_sub(x1), y2.checked_sub(y1)) {
        (Some(w), Some(hgt)) if w > 0 && hgt > 0 => (w, hgt),
        _ => {
            return Err(Reason::BadField {
                field: "blit rectangle (X2 <= X1 or Y2 <= Y1)",
                value: u64::from(dw[3]),
            })
        }
    };
    let dst = Surface {
        space,
        base: addr64(dw[4], dw[5]),
        pitch: u15(dw[1], "blit destination pitch")?,
        x: x1,
        y: y1,
    };
    let src = if kind == BlitKind::Color {
        None
    } else {
        Some(Surface {
            space,
            base: addr64(dw[8], dw[9]),
            pitch: u15(dw[7], "blit source pitch")?,
            x: u15(dw[6], "blit source X1")?,
            y: u15(dw[6] >> 16, "blit source Y1")?,
        })
    };
    surface_in_range(&dst, bpp, width, height, cfg)?;
    if let Some(s) = &src {
        surface_in_range(s, bpp, width, height, cfg)?;
    }
    let (rop, color) = match kind {
        BlitKind::Color => (((dw[1] >> XY_ROP_SHIFT) & 0xff) as u8, dw[6]),
        BlitKind::SrcCopy => (((dw[1] >> XY_ROP_SHIFT) & 0xff) as u8, 0),
        BlitKind::FastCopy => (0, 0),
    };
    Ok(Command::Blit(Blit {
        kind,
        bpp,
        width,
        height,
        dst,
        src,
        rop,
        color,
    }))
}

fn surface_in_range(
    s: &Surface,
    bpp: u8,
    width: u16,
    height: u16,
    cfg: &AuditConfig<'_>,
) -> Result<(), Reason> {
    let overflow = Reason::AddressOutOfRange {
        space: s.space,
        addr: s.base,
        len: u64::MAX,
        limit: cfg.space_size(s.space),
    };
    let rect = s.rect(bpp, width, height).ok_or(overflow)?;
    let extent = rect.extent().ok_or(overflow)?;
    in_range(s.space, extent.gfx_addr, extent.len, cfg)
}
