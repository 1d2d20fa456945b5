//! Workloads in flight: what each may still write, until GVT says it is
//! done.
//!
//! GVT hands hag a workload when it has scanned it, before the GPU runs
//! it, and says when it is done (`workload_done`: completed and its
//! context written back, or dropped). A read-and-clear of the dirty log in
//! between hands the workload's pages out before the GPU may have written
//! them, so after every read-and-clear the pages of every workload still in
//! flight are marked again ([`InFlight::remark`]). A workload hag could not
//! model may write any page the vGPU can reach (the pages GVT mapped for
//! it); while one is in flight, the reader marks that whole set again.
//!
//! The table has room for `N` workloads (GVT queues a few per engine).
//! A workload that finds it full is remembered by its cookie alone, as one
//! that may write anything reachable, until it is done; a done for a
//! cookie the table never saw (scanned before hag registered) ends nothing.
//! Past `N` such, the table can no longer tell when they end: every read
//! marks the reachable set until the table is cleared. It never drops a
//! workload.
//!
//! The table also counts how each workload was covered ([`Coverage`]):
//! precisely, by its own audited write set, or by the fallback, the
//! reachable set. It decides both, so the counts say what was marked.
//!
//! [`Reach`] is the bounded set that stands in for the write set of work
//! hag cannot model: every guest page GVT has mapped for the vGPU's GPU.
//!
//! This file is included as a module by the kernel (`#[path]`): `core`
//! only, no allocation (the caller owns the page lists, `P`, and the
//! frame storage, [`FrameCounts`]), never panics.

/// What a workload in flight may still write.
#[derive(Debug, PartialEq, Eq)]
pub enum Writes<P> {
    /// Exactly these guest frames (the audited write set).
    Pages(P),
    /// Any page the vGPU can reach (not modelled).
    Reachable,
}

/// How the workloads of one vGPU were covered, as `IOC_VGPU_STATS`
/// reports them. A workload counts once its cover is final: a fallback
/// when it is recorded as [`Writes::Reachable`] or finds the table full
/// (the reachable set is marked then), or when it is done after GVT saw
/// its PPGTT batch changed; precise when it is done with its audited
/// pages and nothing changed. So `precise + fallback` is the workloads
/// handed over less those audited and still in flight (and those a
/// [`InFlight::clear`] forgot).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Coverage {
    /// Workloads whose own audited write set was all that was marked.
    pub precise: u64,
    /// Workloads for which the reachable set was marked instead.
    pub fallback: u64,
}

/// The workloads of one vGPU handed over and not yet done.
#[derive(Debug)]
pub struct InFlight<P, const N: usize> {
    slots: [Option<(u64, Writes<P>)>; N],
    /// When each slot's workload was scanned ([`InFlight::now`] then).
    slots_at: [u64; N],
    /// The cookies of workloads that found the table full.
    spilled: [Option<u64>; N],
    /// When each spilled workload was scanned.
    spilled_at: [u64; N],
    /// Workloads scanned so far: the clock of [`InFlight::now`].
    scans: u64,
    /// Workloads that found `spilled` full too: their ends cannot be
    /// told apart, so they count until [`InFlight::clear`].
    lost: u32,
    coverage: Coverage,
}

impl<P, const N: usize> Default for InFlight<P, N> {
    fn default() -> Self {
        Self::new()
    }
}

/// What [`InFlight::remark`] asks the caller to mark besides the pages it
/// gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Remark {
    /// Only the pages given.
    Pages,
    /// The reachable set too.
    Reachable,
}

impl<P, const N: usize> InFlight<P, N> {
    /// An empty table.
    pub const fn new() -> Self {
        InFlight {
            slots: [const { None }; N],
            slots_at: [0; N],
            spilled: [None; N],
            spilled_at: [0; N],
            scans: 0,
            lost: 0,
            coverage: Coverage {
                precise: 0,
                fallback: 0,
            },
        }
    }

    /// How the workloads so far were covered.
    pub fn coverage(&self) -> Coverage {
        self.coverage
    }

    /// Workloads in flight, overflowed ones included.
    pub fn len(&self) -> usize {
        let used = self.slots.iter().filter(|s| s.is_some()).count();
        let spilled = self.spilled.iter().filter(|s| s.is_some()).count();
        used.saturating_add(spilled)
            .saturating_add(self.lost as usize)
    }

    /// Whether no workload is in flight.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The table's clock: how many workloads were scanned so far. Something
    /// that happens now (a GTT entry remapped) concerns the workloads
    /// scanned before it: those with a time below `now()`.
    pub fn now(&self) -> u64 {
        self.scans
    }

    /// Whether every workload scanned before time `at` ([`InFlight::now`]
    /// then) is done. Never, while a workload that found the table and its
    /// spill full is counted: when it was scanned is not known.
    pub fn outlived(&self, at: u64) -> bool {
        if self.lost > 0 {
            return false;
        }
        let slots = self
            .slots
            .iter()
            .zip(&self.slots_at)
            .filter(|(s, _)| s.is_some());
        let spilled = self
            .spilled
            .iter()
            .zip(&self.spilled_at)
            .filter(|(s, _)| s.is_some());
        slots
            .map(|(_, &t)| t)
            .chain(spilled.map(|(_, &t)| t))
            .all(|t| t >= at)
    }

    /// Records workload `cookie`. If the table is full, the workload is
    /// counted as one that may write anything reachable (the caller marks
    /// the reachable set), and `writes` is handed back for the caller to
    /// free. A workload recorded as [`Writes::Reachable`], or overflowed,
    /// counts as a fallback now.
    pub fn scanned(&mut self, cookie: u64, writes: Writes<P>) -> Option<Writes<P>> {
        let reachable = matches!(writes, Writes::Reachable);
        let at = self.scans;
        self.scans = self.scans.saturating_add(1);
        let rest = match self.slots.iter().position(Option::is_none) {
            Some(i) => {
                self.slots[i] = Some((cookie, writes));
                self.slots_at[i] = at;
                None
            }
            None => {
                match self.spilled.iter().position(Option::is_none) {
                    Some(i) => {
                        self.spilled[i] = Some(cookie);
                        self.spilled_at[i] = at;
                    }
                    None => self.lost = self.lost.saturating_add(1),
                }
                Some(writes)
            }
        };
        if reachable || rest.is_some() {
            self.coverage.fallback = self.coverage.fallback.saturating_add(1);
        }
        rest
    }

    /// Workload `cookie` is done; returns what it recorded, for the
    /// caller to free. An overflowed workload ends by its cookie; a cookie
    /// the table never saw ends nothing.
    /// `changed`: GVT saw a PPGTT batch of it change after the scan (the
    /// caller marks the reachable set). A workload recorded with its
    /// pages counts now: precise, or a fallback if `changed`.
    pub fn done(&mut self, cookie: u64, changed: bool) -> Option<Writes<P>> {
        for slot in self.slots.iter_mut() {
            if matches!(slot, Some((c, _)) if *c == cookie) {
                let writes = slot.take().map(|(_, writes)| writes);
                if let Some(Writes::Pages(_)) = writes {
                    let count = if changed {
                        &mut self.coverage.fallback
                    } else {
                        &mut self.coverage.precise
                    };
                    *count = count.saturating_add(1);
                }
                return writes;
            }
        }
        if let Some(spill) = self.spilled.iter_mut().find(|s| **s == Some(cookie)) {
            *spill = None;
        }
        None
    }

    /// Forgets every workload (the vGPU is gone, or logging restarts with
    /// everything dirty); the caller frees what `free` is given.
    pub fn clear(&mut self, mut free: impl FnMut(Writes<P>)) {
        for slot in self.slots.iter_mut() {
            if let Some((_, writes)) = slot.take() {
                free(writes);
            }
        }
        self.spilled = [None; N];
        self.lost = 0;
    }
}

impl<P: core::ops::Deref<Target = [u64]>, const N: usize> InFlight<P, N> {
    /// After a read-and-clear: gives `mark` every frame of every audited
    /// workload still in flight, and says whether the reachable set must
    /// be marked too (a workload in flight was not modelled, or
    /// overflowed).
    pub fn remark(&self, mut mark: impl FnMut(u64)) -> Remark {
        let mut reachable = self.lost > 0 || self.spilled.iter().any(Option::is_some);
        for (_, writes) in self.slots.iter().flatten() {
            match writes {
                Writes::Pages(pages) => pages.iter().for_each(|&gfn| mark(gfn)),
                Writes::Reachable => reachable = true,
            }
        }
        if reachable {
            Remark::Reachable
        } else {
            Remark::Pages
        }
    }
}

/// Guest frames with how many of GVT's mappings hold each: the storage of
/// [`Reach`] (the kernel's is an rbtree, tests use a map).
pub trait FrameCounts {
    /// The count of `gfn`, if it is held.
    fn count_mut(&mut self, gfn: u64) -> Option<&mut u32>;
    /// Holds `gfn` once; false if there was no memory for it.
    fn insert(&mut self, gfn: u64) -> bool;
    /// Lets `gfn` go.
    fn remove(&mut self, gfn: u64);
    /// Every frame held.
    fn for_each(&self, f: &mut dyn FnMut(u64));
    /// How many frames are held.
    fn len(&self) -> usize;
    /// Whether none is.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Most pages one map report may name (GVT maps 4 KiB, 64 KiB and 2 MiB
/// pages); a larger one makes [`Reach`] lose track.
pub const MAX_MAP_PAGES: u64 = 512;

/// What a [`Reach`] asks the caller to mark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Marked {
    /// The frames given to the caller, and that is all the GPU can reach.
    Frames(u64),
    /// The set is not known any more: mark everything.
    Everything,
}

/// The reachable set of a vGPU: every guest page GVT has mapped for its
/// GPU (GVT's `pages_mapped` reports), which bounds what a workload hag
/// cannot model may write. A page is held while any mapping holds it, and
/// is marked when the last mapping goes, since the GPU may have written it
/// until then.
///
/// The set can be 10^5-10^6 frames, and walking it happens under the
/// vGPU's lock, so it is walked at most once per dirty log per read cycle:
/// [`Reach::cover`] marks it in the logs that do not hold it yet (the
/// caller names its logs by bit), and remembers that they do until their
/// bits are taken ([`Reach::taken`]); meanwhile a frame mapped is marked
/// in them as it is mapped ([`Reach::map`]), so they keep holding it.
#[derive(Debug)]
pub struct Reach<M> {
    pages: M,
    lost: bool,
    /// The logs (a bit each) that hold every frame of the set.
    covered: u8,
}

impl<M: FrameCounts> Reach<M> {
    /// An empty set in `pages`.
    pub fn new(pages: M) -> Self {
        Reach {
            pages,
            lost: false,
            covered: 0,
        }
    }

    /// Marks the set, in one walk, in those of the logs `logs` (a bit
    /// each) that do not hold it yet: `mark(gfn, which)` marks `gfn` in
    /// the logs of `which`. Returns `which` and what the walk found
    /// ([`Marked::Everything`]: the caller marks those logs whole), or
    /// `None` if every log asked for holds the set already. They hold it
    /// from then on, until [`Reach::taken`].
    pub fn cover(&mut self, logs: u8, mut mark: impl FnMut(u64, u8)) -> Option<(u8, Marked)> {
        let which = logs & !self.covered;
        if which == 0 {
            return None;
        }
        self.covered |= which;
        Some((which, self.mark(|gfn| mark(gfn, which))))
    }

    /// The bits of the logs `logs` were taken (read and cleared, a range
    /// of them reported) or the logs replaced: they no longer hold the set.
    pub fn taken(&mut self, logs: u8) {
        self.covered &= !logs;
    }

    /// Whether the set is not known any more (a map report could not be
    /// recorded).
    pub fn lost(&self) -> bool {
        self.lost
    }

    /// Frames held.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether no frame is held.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// GVT mapped `nr` pages from `gfn`. Each goes to `mark` with the logs
    /// that hold the set ([`Reach::cover`]), if any, so that they go on
    /// holding it.
    pub fn map(&mut self, gfn: u64, nr: u64, mut mark: impl FnMut(u64, u8)) {
        if nr > MAX_MAP_PAGES {
            self.set_lost();
            return;
        }
        for page in gfn..gfn.saturating_add(nr) {
            if let Some(count) = self.pages.count_mut(page) {
                *count = count.saturating_add(1);
            } else if !self.pages.insert(page) {
                self.set_lost();
            }
            if self.covered != 0 {
                mark(page, self.covered);
            }
        }
    }

    /// The set is not known any more: no log holds "everything" yet.
    fn set_lost(&mut self) {
        if !self.lost {
            self.lost = true;
            self.covered = 0;
        }
    }

    /// GVT unmaps `nr` pages from `gfn`: each goes to `mark` (the GPU may
    /// have written it until now), and is let go once no mapping holds it.
    pub fn unmap(&mut self, gfn: u64, nr: u64, mut mark: impl FnMut(u64)) {
        for page in gfn..gfn.saturating_add(nr.min(MAX_MAP_PAGES)) {
            if let Some(count) = self.pages.count_mut(page) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    self.pages.remove(page);
                }
            }
            mark(page);
        }
    }

    /// Gives `mark` every frame the GPU can reach, or says to mark
    /// everything.
    pub fn mark(&self, mut mark: impl FnMut(u64)) -> Marked {
        if self.lost {
            return Marked::Everything;
        }
        let mut n = 0u64;
        self.pages.for_each(&mut |gfn| {
            mark(gfn);
            n += 1;
        });
        Marked::Frames(n)
    }
}
