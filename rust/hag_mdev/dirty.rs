// SPDX-License-Identifier: GPL-2.0-only
//! A vGPU's GPU dirty log: one bit per 4 KiB guest page of the range a VMM
//! asked to log.
//!
//! Bits are set by the audit, for every page a submission may write, before
//! the engine runs it; `read_and_clear` hands them out and clears them in one
//! step under the vGPU's lock, so a bit set concurrently lands either in this
//! read or in the next one, never in neither.

use kernel::prelude::*;

use crate::abi;

pub(crate) struct DirtyLog {
    gpa: u64,
    pages: u64,
    words: KVVec<u64>,
}

impl DirtyLog {
    /// A clear log of `[gpa, gpa + size)`, after checking the ioctl's values.
    pub(crate) fn new(gpa: u64, size: u64) -> Result<Self> {
        let page = abi::DIRTY_PAGE_SIZE;
        if gpa % page != 0 || size % page != 0 || size == 0 || size > abi::DIRTY_MAX_BYTES {
            return Err(EINVAL);
        }
        gpa.checked_add(size).ok_or(EINVAL)?;
        let pages = size / page;
        let words = usize::try_from(pages.div_ceil(64)).map_err(|_| EINVAL)?;
        Ok(Self {
            gpa,
            pages,
            words: KVVec::from_elem(0u64, words, GFP_KERNEL)?,
        })
    }

    /// Bytes of bitmap a reader must provide.
    pub(crate) fn bitmap_bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// Marks the page holding guest physical address `gpa`, if logged.
    pub(crate) fn mark(&mut self, gpa: u64) -> bool {
        let Some(offset) = gpa.checked_sub(self.gpa) else {
            return false;
        };
        let page = offset / abi::DIRTY_PAGE_SIZE;
        if page >= self.pages {
            return false;
        }
        // page < pages, so the word index is inside `words`.
        if let Some(word) = self.words.get_mut((page / 64) as usize) {
            *word |= 1 << (page % 64);
        }
        true
    }

    /// Marks every logged page; returns how many there are. Bits past the
    /// last page stay clear, so counts of dirty pages stay exact.
    pub(crate) fn mark_all(&mut self) -> u64 {
        for word in self.words.iter_mut() {
            *word = u64::MAX;
        }
        let tail = self.pages % 64;
        if tail != 0 {
            if let Some(last) = self.words.last_mut() {
                *last = (1u64 << tail) - 1;
            }
        }
        self.pages
    }

    /// Calls `report` with the guest physical address of every dirty page
    /// in `[gpa, gpa + len)` and clears those bits.
    pub(crate) fn drain_range(&mut self, gpa: u64, len: u64, report: &mut dyn FnMut(u64)) {
        let page = abi::DIRTY_PAGE_SIZE;
        let first = gpa.saturating_sub(self.gpa) / page;
        let end = gpa.saturating_add(len).saturating_sub(self.gpa).div_ceil(page).min(self.pages);
        // QEMU asks for all of a 4 GiB range on every sync, so clean words
        // are skipped whole: the work is one step per 64 pages.
        let mut index = first;
        while index < end {
            let Some(word) = self.words.get_mut((index / 64) as usize) else { break };
            if *word == 0 {
                index = (index / 64 + 1) * 64;
                continue;
            }
            let bit = 1u64 << (index % 64);
            if *word & bit != 0 {
                *word &= !bit;
                report(self.gpa + index * page);
            }
            index += 1;
        }
    }

    /// ORs bits taken by [`Self::read_and_clear`] back in (when handing
    /// them out failed).
    pub(crate) fn merge(&mut self, words: &[u64]) {
        for (word, bits) in self.words.iter_mut().zip(words) {
            *word |= bits;
        }
    }

    /// Moves the bits into `out` (resized to fit) and clears them; returns
    /// how many pages were dirty.
    pub(crate) fn read_and_clear(&mut self, out: &mut KVVec<u64>) -> Result<u64> {
        out.extend_from_slice(&self.words, GFP_KERNEL)?;
        let mut dirty = 0;
        for word in self.words.iter_mut() {
            dirty += u64::from(word.count_ones());
            *word = 0;
        }
        Ok(dirty)
    }
}
