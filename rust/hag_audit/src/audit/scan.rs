//! The walk over one submission: ring, batches, nesting, loops, limits.
//! What a batch start or end does, and what a start of an audited batch
//! means, is [`flow`]'s, which executors follow too.
//!
//! Control flow is followed with an explicit state machine and a fixed-size
//! return stack, never recursion. A batch entry (address space, address and
//! level) already audited in this submission is not scanned again: its commands are already
//! in the sink, and wherever it is entered from it can only run those same
//! commands before it returns (to the continuation the auditor scans next)
//! or loops forever (which the watchdog catches). So the walk is bounded by
//! `max_batches` entries and `max_commands` commands.
//!
//! A batch started from the ring fixes the address space of every batch it
//! leads to (chained or second-level starts must name the same space), so
//! one `space` per ring batch start is all the state address spaces need.

use super::decode::{self, Shape, MAX_FIXED};
use super::flow;
use super::{
    AddressSpace, AuditConfig, AuditError, AuditSink, AuditSummary, Command, GfxMemory, Op, Reason,
    ValidatedCommand, MAX_BATCHES, MAX_BATCH_DEPTH,
};

/// Where the next command is read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cursor {
    /// Dword index into the submitted ring slice.
    Ring(usize),
    /// Graphics address in a batch buffer (in `Scan::space`).
    Batch(u64),
}

/// Audits one submission.
///
/// `ring` holds the commands between the ring's head and tail (a wrapped
/// ring is passed as one slice, its two parts joined); `ring_gfx_addr` is
/// the graphics address of `ring[0]`, used to label commands and errors.
/// Batch buffers are read through `mem`. Each validated command goes to
/// `sink` in execution order; on `Err` the caller must discard what the sink
/// received (see [`AuditSink`]).
///
/// Work is bounded by `cfg.max_commands` commands, each at most 257 dwords.
pub fn audit<M: GfxMemory, S: AuditSink>(
    ring: &[u32],
    ring_gfx_addr: u64,
    cfg: &AuditConfig<'_>,
    mem: &mut M,
    sink: &mut S,
) -> Result<AuditSummary, AuditError> {
    cfg.check().map_err(|reason| AuditError {
        space: AddressSpace::Ggtt,
        gfx_addr: 0,
        header: None,
        reason,
    })?;
    let mut scan = Scan {
        ring,
        ring_gfx_addr,
        cfg,
        mem,
        sink,
        cursor: Cursor::Ring(0),
        level: 0,
        space: AddressSpace::Ggtt,
        ring_return: 0,
        ret: [0; MAX_BATCH_DEPTH as usize + 1],
        visited: [0; MAX_BATCHES],
        nvisited: 0,
        entries: 0,
        summary: AuditSummary::default(),
    };
    scan.run()
}

struct Scan<'r, 'c, M, S> {
    ring: &'r [u32],
    ring_gfx_addr: u64,
    cfg: &'c AuditConfig<'c>,
    mem: &'r mut M,
    sink: &'r mut S,
    cursor: Cursor,
    /// Current batch level (0: the ring).
    level: u8,
    /// Address space of the batches at levels 1 and up (set by the ring's
    /// batch start; the ring itself is GGTT).
    space: AddressSpace,
    /// Ring index to resume at when the level-1 batch ends.
    ring_return: usize,
    /// `ret[l]`: address to resume at when the batch at level `l` (>= 2) ends.
    ret: [u64; MAX_BATCH_DEPTH as usize + 1],
    /// Batch entries followed: address | PPGTT << 48 | level << 56.
    visited: [u64; MAX_BATCHES],
    nvisited: usize,
    /// Validated commands handed to the sink.
    entries: u32,
    summary: AuditSummary,
}

/// An error at the command being scanned.
struct At {
    space: AddressSpace,
    gfx_addr: u64,
    header: Option<u32>,
}

impl At {
    fn err(&self, reason: Reason) -> AuditError {
        AuditError {
            space: self.space,
            gfx_addr: self.gfx_addr,
            header: self.header,
            reason,
        }
    }
}

fn dwords_to_bytes(n: u32) -> u64 {
    u64::from(n) * 4
}

impl<M: GfxMemory, S: AuditSink> Scan<'_, '_, M, S> {
    fn run(&mut self) -> Result<AuditSummary, AuditError> {
        // Each turn scans one command or ends; commands are capped by
        // `max_commands`, so the loop is bounded.
        loop {
            if matches!(self.cursor, Cursor::Ring(i) if i >= self.ring.len()) {
                return Ok(self.summary);
            }
            let mut at = At {
                space: self.cursor_space(),
                gfx_addr: self.cursor_addr()?,
                header: None,
            };
            if self.summary.commands >= self.cfg.max_commands {
                return Err(at.err(Reason::TooManyCommands {
                    limit: self.cfg.max_commands,
                }));
            }
            self.summary.commands += 1;
            let mut hdr = [0u32; 1];
            self.read(0, 1, &mut hdr).map_err(|r| at.err(r))?;
            let header = hdr[0];
            at.header = Some(header);
            self.step(header, &at).map_err(|r| at.err(r))?;
        }
    }

    /// Address space of the cursor: the ring is GGTT.
    fn cursor_space(&self) -> AddressSpace {
        match self.cursor {
            Cursor::Ring(_) => AddressSpace::Ggtt,
            Cursor::Batch(_) => self.space,
        }
    }

    /// Address space of the batch the cursor is in, `None` in the ring.
    fn batch_space(&self) -> Option<AddressSpace> {
        match self.cursor {
            Cursor::Ring(_) => None,
            Cursor::Batch(_) => Some(self.space),
        }
    }

    /// Graphics address of the cursor.
    fn cursor_addr(&self) -> Result<u64, AuditError> {
        match self.cursor {
            Cursor::Batch(a) => Ok(a),
            Cursor::Ring(i) => u64::try_from(i)
                .ok()
                .and_then(|i| i.checked_mul(4))
                .and_then(|off| self.ring_gfx_addr.checked_add(off))
                .ok_or(AuditError {
                    space: AddressSpace::Ggtt,
                    gfx_addr: self.ring_gfx_addr,
                    header: None,
                    reason: Reason::BadField {
                        field: "ring address",
                        value: self.ring_gfx_addr,
                    },
                }),
        }
    }

    /// Checks that the command's `need` dwords are all there: in the ring
    /// slice, or inside the batch's address space.
    fn available(&self, need: u32) -> Result<(), Reason> {
        match self.cursor {
            Cursor::Ring(i) => {
                let have = self.ring.len().saturating_sub(i);
                if usize::try_from(need).map_or(true, |n| n > have) {
                    return Err(Reason::Truncated {
                        need,
                        have: u32::try_from(have).unwrap_or(u32::MAX),
                    });
                }
                Ok(())
            }
            Cursor::Batch(a) => decode::in_range(self.space, a, dwords_to_bytes(need), self.cfg),
        }
    }

    /// Reads `out.len()` dwords starting `skip` dwords after the cursor;
    /// `need` is the command's whole length, for the error.
    fn read(&mut self, skip: u32, need: u32, out: &mut [u32]) -> Result<(), Reason> {
        self.available(need)?;
        match self.cursor {
            Cursor::Ring(i) => {
                let start = usize::try_from(skip).ok().and_then(|s| i.checked_add(s));
                let src = start
                    .and_then(|s| Some(s..s.checked_add(out.len())?))
                    .and_then(|r| self.ring.get(r))
                    .ok_or(Reason::Truncated {
                        need,
                        have: u32::try_from(self.ring.len().saturating_sub(i)).unwrap_or(u32::MAX),
                    })?;
                for (o, s) in out.iter_mut().zip(src) {
                    *o = *s;
                }
                Ok(())
            }
            Cursor::Batch(a) => {
                let space = self.space;
                let addr =
                    a.checked_add(dwords_to_bytes(skip))
                        .ok_or(Reason::AddressOutOfRange {
                            space,
                            addr: a,
                            len: dwords_to_bytes(need),
                            limit: self.cfg.space_size(space),
                        })?;
                let len = u64::try_from(out.len())
                    .unwrap_or(u64::MAX)
                    .saturating_mul(4);
                decode::in_range(space, addr, len, self.cfg)?;
                self.mem
                    .read_dwords(space, addr, out)
                    .map_err(|f| Reason::MemoryFault {
                        space,
                        addr: f.gfx_addr,
                    })
            }
        }
    }

    /// Moves the cursor `n` dwords on.
    fn advance(&mut self, n: u32) -> Result<(), Reason> {
        self.cursor = match self.cursor {
            Cursor::Ring(i) => Cursor::Ring(
                usize::try_from(n)
                    .ok()
                    .and_then(|n| i.checked_add(n))
                    .ok_or(Reason::BadField {
                        field: "ring position",
                        value: u64::from(n),
                    })?,
            ),
            Cursor::Batch(a) => Cursor::Batch(a.checked_add(dwords_to_bytes(n)).ok_or(
                Reason::AddressOutOfRange {
                    space: self.space,
                    addr: a,
                    len: dwords_to_bytes(n),
                    limit: self.cfg.space_size(self.space),
                },
            )?),
        };
        Ok(())
    }

    fn emit(&mut self, at: &At, kind: Command) -> Result<(), Reason> {
        if self.entries >= self.cfg.max_entries {
            return Err(Reason::TooManyEntries {
                limit: self.cfg.max_entries,
            });
        }
        self.entries += 1;
        let cmd = ValidatedCommand {
            space: at.space,
            gfx_addr: at.gfx_addr,
            level: self.level,
            kind,
        };
        self.sink.command(&cmd).map_err(|_| Reason::SinkFull)
    }

    /// Scans the command whose header was just read.
    fn step(&mut self, header: u32, at: &At) -> Result<(), Reason> {
        let op = Op::from_header(header).ok_or(Reason::UnknownOpcode)?;
        match decode::shape(op, header)? {
            Shape::Lri {
                pairs,
                byte_disable,
            } => {
                reserved_lri(header)?;
                let need = pairs.saturating_mul(2).saturating_add(1);
                self.available(need)?;
                // At most 128 pairs (an 8-bit length field).
                for p in 0..pairs {
                    let mut pair = [0u32; 2];
                    self.read(1 + 2 * p, need, &mut pair)?;
                    let [reg, value] = pair;
                    if !self.cfg.register_allowed(reg) {
                        return Err(Reason::RegisterNotAllowed { reg });
                    }
                    self.emit(
                        at,
                        Command::LoadRegisterImm {
                            reg,
                            value,
                            byte_disable,
                        },
                    )?;
                }
                self.advance(need)
            }
            Shape::Fixed(n) => {
                let mut dw = [0u32; MAX_FIXED];
                let body = dw.get_mut(1..n as usize).ok_or(Reason::BadLength {
                    len: n,
                    expected: MAX_FIXED as u32,
                })?;
                self.available(n)?;
                if !body.is_empty() {
                    self.read(1, n, body)?;
                }
                dw[0] = header;
                match decode::decode(op, &dw, self.batch_space(), self.cfg)? {
                    Command::BatchStart {
                        space,
                        addr,
                        second_level,
                        ..
                    } => self.batch_start(at, space, addr, second_level, n),
                    Command::BatchEnd => {
                        if self.level == 0 {
                            return Err(Reason::Unsupported {
                                what: "MI_BATCH_BUFFER_END in the ring",
                            });
                        }
                        self.emit(at, Command::BatchEnd)?;
                        self.batch_return()
                    }
                    cmd => {
                        self.emit(at, cmd)?;
                        self.advance(n)
                    }
                }
            }
        }
    }

    /// Follows an MI_BATCH_BUFFER_START at `at` (of `n` dwords) to `addr` in
    /// `space` (decode checked that a start from a batch keeps its space).
    fn batch_start(
        &mut self,
        at: &At,
        space: AddressSpace,
        addr: u64,
        second_level: bool,
        n: u32,
    ) -> Result<(), Reason> {
        let from_ring = self.level == 0;
        let level = flow::transfer(self.level, second_level, self.cfg.max_batch_depth)?.level();
        let key = flow::entry_key(space, addr, level);
        let seen = self
            .visited
            .get(..self.nvisited)
            .is_some_and(|v| v.contains(&key));
        if !seen && self.nvisited >= self.cfg.max_batches {
            return Err(Reason::TooManyBatches {
                limit: self.cfg.max_batches,
            });
        }
        self.emit(
            at,
            Command::BatchStart {
                space,
                addr,
                second_level,
                level,
                already_audited: seen,
            },
        )?;
        if seen {
            // Its commands are audited; continue as if it returned.
            self.summary.revisits = self.summary.revisits.saturating_add(1);
            return if from_ring || second_level {
                self.advance(n)
            } else {
                self.batch_return()
            };
        }
        let slot = self
            .visited
            .get_mut(self.nvisited)
            .ok_or(Reason::TooManyBatches {
                limit: self.cfg.max_batches,
            })?;
        *slot = key;
        self.nvisited += 1;
        self.summary.batches = self.summary.batches.saturating_add(1);
        self.summary.max_depth = self.summary.max_depth.max(level);
        if from_ring {
            self.advance(n)?;
            if let Cursor::Ring(i) = self.cursor {
                self.ring_return = i;
            }
        } else if second_level {
            let back =
                at.gfx_addr
                    .checked_add(dwords_to_bytes(n))
                    .ok_or(Reason::AddressOutOfRange {
                        space: self.space,
                        addr: at.gfx_addr,
                        len: dwords_to_bytes(n),
                        limit: self.cfg.space_size(self.space),
                    })?;
            let slot = self
                .ret
                .get_mut(usize::from(level))
                .ok_or(Reason::BatchTooDeep {
                    depth: level,
                    limit: self.cfg.max_batch_depth,
                })?;
            *slot = back;
        }
        self.level = level;
        self.space = space;
        self.cursor = Cursor::Batch(addr);
        Ok(())
    }

    /// The batch at the current level ends: resume where it was started.
    fn batch_return(&mut self) -> Result<(), Reason> {
        match self.level {
            0 => Err(Reason::Unsupported {
                what: "MI_BATCH_BUFFER_END in the ring",
            }),
            1 => {
                self.level = 0;
                self.cursor = Cursor::Ring(self.ring_return);
                Ok(())
            }
            l => {
                let back = *self.ret.get(usize::from(l)).ok_or(Reason::BatchTooDeep {
                    depth: l,
                    limit: self.cfg.max_batch_depth,
                })?;
                self.level = l - 1;
                self.cursor = Cursor::Batch(back);
                Ok(())
            }
        }
    }
}

/// MI_LOAD_REGISTER_IMM header bits other than opcode, length, byte write
/// disables and force posted must be zero.
fn reserved_lri(header: u32) -> Result<(), Reason> {
    use super::opcodes::{LEN_MASK_8, MI_LRI_ALLOWED};
    let bits = header & !(0xff80_0000 | MI_LRI_ALLOWED | LEN_MASK_8);
    if bits == 0 {
        Ok(())
    } else {
        Err(Reason::ReservedBits { dword: 0, bits })
    }
}
