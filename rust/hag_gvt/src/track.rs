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
//! One more is counted in an overflow, which makes every read mark the
//! reachable set until as many unknown workloads are done as overflowed;
//! it never drops a workload.
//!
//! This file is included as a module by the kernel (`#[path]`): `core`
//! only, no allocation (the caller owns the page lists, `P`), never panics.

/// What a workload in flight may still write.
#[derive(Debug, PartialEq, Eq)]
pub enum Writes<P> {
    /// Exactly these guest frames (the audited write set).
    Pages(P),
    /// Any page the vGPU can reach (not modelled).
    Reachable,
}

/// The workloads of one vGPU handed over and not yet done.
#[derive(Debug)]
pub struct InFlight<P, const N: usize> {
    slots: [Option<(u64, Writes<P>)>; N],
    /// Workloads that found the table full.
    overflow: u32,
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
            overflow: 0,
        }
    }

    /// Workloads in flight, overflowed ones included.
    pub fn len(&self) -> usize {
        let used = self.slots.iter().filter(|s| s.is_some()).count();
        used.saturating_add(self.overflow as usize)
    }

    /// Whether no workload is in flight.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records workload `cookie`. If the table is full, the workload is
    /// counted as one that may write anything reachable, and `writes` is
    /// handed back for the caller to free.
    pub fn scanned(&mut self, cookie: u64, writes: Writes<P>) -> Option<Writes<P>> {
        match self.slots.iter_mut().find(|s| s.is_none()) {
            Some(slot) => {
                *slot = Some((cookie, writes));
                None
            }
            None => {
                self.overflow = self.overflow.saturating_add(1);
                Some(writes)
            }
        }
    }

    /// Workload `cookie` is done; returns what it recorded, for the
    /// caller to free. A cookie not in the table ends one overflowed
    /// workload, if there are any (one of them is the one that is done).
    pub fn done(&mut self, cookie: u64) -> Option<Writes<P>> {
        for slot in self.slots.iter_mut() {
            if matches!(slot, Some((c, _)) if *c == cookie) {
                return slot.take().map(|(_, writes)| writes);
            }
        }
        self.overflow = self.overflow.saturating_sub(1);
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
        self.overflow = 0;
    }
}

impl<P: core::ops::Deref<Target = [u64]>, const N: usize> InFlight<P, N> {
    /// After a read-and-clear: gives `mark` every frame of every audited
    /// workload still in flight, and says whether the reachable set must
    /// be marked too (a workload in flight was not modelled, or
    /// overflowed).
    pub fn remark(&self, mut mark: impl FnMut(u64)) -> Remark {
        let mut reachable = self.overflow > 0;
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
