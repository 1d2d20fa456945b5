//! The control flow of one submission: one model for the auditor, which
//! walks guest memory, and for an executor, which walks the auditor's list
//! of validated commands.
//!
//! The hardware's rules, which both follow:
//!
//! - The ring is level 0. `MI_BATCH_BUFFER_START` from the ring starts a
//!   batch at level 1 that returns to the ring after the start; from a
//!   batch, a second-level start *calls* (level + 1, returns after the
//!   start) and any other start *chains* (same level, the return stays
//!   where it was). `MI_BATCH_BUFFER_END` returns from the current level.
//!   A second-level start from the ring, an end in the ring and a level
//!   over the limit are refused ([`transfer`]).
//! - Running a batch entry (address space, address, level) until its level
//!   returns is the same every time: what it runs depends on memory only,
//!   never on where it will return to. So the auditor scans each entry
//!   once ([`entry_key`]) and, when a start names one it already scanned,
//!   lists the start (`already_audited`) and goes on as if the entry had
//!   returned: after a call with the command after it, after a chain with
//!   the continuation of the level it chains at.
//!
//! [`Exec`] runs the list the same way: a first start continues with the
//! listed body; a start of an audited entry jumps back to where that
//! entry's commands were first listed ([`Entries`]) and remembers, for the
//! level that entry returns from, the list index the auditor went on at.
//! A level whose return was listed right after its body ([`Return::Listed`])
//! continues after its `MI_BATCH_BUFFER_END`; one whose return had to be
//! remembered continues there. The property tests (`tests/flow.rs`) check
//! that for random valid streams the commands `Exec` runs are those the
//! hardware runs, in its order.

use super::{AddressSpace, Command, Reason, ValidatedCommand, MAX_BATCHES, MAX_BATCH_DEPTH};

/// What an `MI_BATCH_BUFFER_START` does to the level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transfer {
    /// A new level, `level`, that returns after the start.
    Call {
        /// The level the batch runs at.
        level: u8,
    },
    /// The same level, `level`: the return stays where it was.
    Chain {
        /// The level the batch runs at.
        level: u8,
    },
}

impl Transfer {
    /// The level the started batch runs at.
    pub const fn level(self) -> u8 {
        match self {
            Transfer::Call { level } | Transfer::Chain { level } => level,
        }
    }
}

/// What a batch start at level `level` (0: the ring) does, or why it is
/// refused.
pub fn transfer(level: u8, second_level: bool, max_depth: u8) -> Result<Transfer, Reason> {
    let t = if level == 0 {
        if second_level {
            return Err(Reason::Unsupported {
                what: "second-level batch started from the ring",
            });
        }
        Transfer::Call { level: 1 }
    } else if second_level {
        Transfer::Call {
            level: level.saturating_add(1),
        }
    } else {
        Transfer::Chain { level }
    };
    if t.level() > max_depth {
        return Err(Reason::BatchTooDeep {
            depth: t.level(),
            limit: max_depth,
        });
    }
    Ok(t)
}

/// The key of a batch entry: the same address in two spaces, or at two
/// levels, is two entries. Addresses are below 2^48 (checked against the
/// space's size), so the space fits in bit 48 and the level in the top byte.
pub const fn entry_key(space: AddressSpace, addr: u64, level: u8) -> u64 {
    let ppgtt = match space {
        AddressSpace::Ggtt => 0,
        AddressSpace::Ppgtt => 1,
    };
    addr | (ppgtt << 48) | ((level as u64) << 56)
}

/// Where each batch entry's commands start in a validated list: the index
/// after its first (not `already_audited`) start.
#[derive(Clone, Debug)]
pub struct Entries {
    keys: [u64; MAX_BATCHES],
    index: [usize; MAX_BATCHES],
    len: usize,
}

impl Entries {
    /// Indexes `cmds` (one pass). A list with more entries than
    /// [`MAX_BATCHES`] is not one the auditor made: those are left out,
    /// and starting them is an error.
    pub fn of(cmds: &[ValidatedCommand]) -> Self {
        let mut e = Entries {
            keys: [0; MAX_BATCHES],
            index: [0; MAX_BATCHES],
            len: 0,
        };
        for (i, c) in cmds.iter().enumerate() {
            if let Command::BatchStart {
                space,
                addr,
                level,
                already_audited: false,
                ..
            } = c.kind
            {
                if let (Some(k), Some(at)) = (e.keys.get_mut(e.len), e.index.get_mut(e.len)) {
                    *k = entry_key(space, addr, level);
                    *at = i + 1;
                    e.len += 1;
                }
            }
        }
        e
    }

    /// Where the entry's commands start in the list.
    pub fn find(&self, space: AddressSpace, addr: u64, level: u8) -> Option<usize> {
        let key = entry_key(space, addr, level);
        let n = self.keys.get(..self.len)?.iter().position(|&k| k == key)?;
        self.index.get(n).copied()
    }
}

/// Where a level continues when it returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Return {
    /// With the command listed after the level's `MI_BATCH_BUFFER_END`
    /// (its body was listed where it ran).
    Listed,
    /// At this list index.
    At(usize),
}

/// Why [`Exec`] cannot go on: the list is not one the auditor produced
/// (a kernel treats it as the auditor's bug, never as the guest's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowError {
    /// A command's level is not the level the walk is at.
    LevelMismatch {
        /// List index.
        index: usize,
    },
    /// A start of an audited entry the list does not hold.
    UnknownEntry {
        /// List index.
        index: usize,
    },
    /// An end in the ring, a level over [`MAX_BATCH_DEPTH`], or the list
    /// ending inside a batch.
    BadNesting {
        /// List index.
        index: usize,
    },
}

/// An executor's position in a validated list, and its return stack.
#[derive(Clone, Debug)]
pub struct Exec {
    pc: usize,
    level: u8,
    /// `returns[l]`: where level `l` continues when it returns.
    returns: [Return; MAX_BATCH_DEPTH as usize + 1],
    entries: Entries,
}

impl Exec {
    /// A walk from the first command of `cmds`.
    pub fn new(cmds: &[ValidatedCommand]) -> Self {
        Exec {
            pc: 0,
            level: 0,
            returns: [Return::Listed; MAX_BATCH_DEPTH as usize + 1],
            entries: Entries::of(cmds),
        }
    }

    /// The index of the command to run next, `None` when the submission
    /// has ended (the list is done, back in the ring).
    pub fn current(&self, cmds: &[ValidatedCommand]) -> Result<Option<usize>, FlowError> {
        if self.pc < cmds.len() {
            Ok(Some(self.pc))
        } else if self.level == 0 {
            Ok(None)
        } else {
            Err(FlowError::BadNesting { index: self.pc })
        }
    }

    /// The level the walk is at (0: the ring).
    pub fn level(&self) -> u8 {
        self.level
    }

    /// Moves past the command at [`Self::current`], which the executor has
    /// run to its end.
    pub fn advance(&mut self, cmds: &[ValidatedCommand]) -> Result<(), FlowError> {
        let index = self.pc;
        let cmd = cmds.get(index).ok_or(FlowError::BadNesting { index })?;
        if cmd.level != self.level {
            return Err(FlowError::LevelMismatch { index });
        }
        let bad = FlowError::BadNesting { index };
        match cmd.kind {
            Command::BatchStart {
                space,
                addr,
                second_level,
                level,
                already_audited,
            } => {
                let t = transfer(self.level, second_level, MAX_BATCH_DEPTH).map_err(|_| bad)?;
                if t.level() != level {
                    return Err(FlowError::LevelMismatch { index });
                }
                let slot = self.returns.get_mut(usize::from(level)).ok_or(bad)?;
                if already_audited {
                    let start = self
                        .entries
                        .find(space, addr, level)
                        .ok_or(FlowError::UnknownEntry { index })?;
                    // The auditor went on at index + 1 as if the entry had
                    // returned: that is where this level returns to, unless
                    // a chain keeps a return already remembered.
                    match (t, *slot) {
                        (Transfer::Chain { .. }, Return::At(_)) => {}
                        _ => *slot = Return::At(index + 1),
                    }
                    self.pc = start;
                } else {
                    if let Transfer::Call { .. } = t {
                        *slot = Return::Listed;
                    }
                    self.pc = index + 1;
                }
                self.level = level;
            }
            Command::BatchEnd => {
                let back = *self.returns.get(usize::from(self.level)).ok_or(bad)?;
                self.level = self.level.checked_sub(1).ok_or(bad)?;
                self.pc = match back {
                    Return::Listed => index + 1,
                    Return::At(to) => to,
                };
            }
            _ => self.pc = index + 1,
        }
        Ok(())
    }
}
