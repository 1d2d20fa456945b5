// SPDX-License-Identifier: GPL-2.0-only
//! A vGPU's GPU dirty log: one bit per 4 KiB guest page of the ranges a VMM
//! asked to log (/dev/hag's log has one; VFIO's up to [`MAX_SPANS`]).
//!
//! Bits are set by the audit, for every page a submission may write, before
//! the engine runs it; `read_and_clear` hands them out and clears them in one
//! step under the vGPU's lock, so a bit set concurrently lands either in this
//! read or in the next one, never in neither.

use kernel::prelude::*;

use crate::abi;

/// The most ranges one log covers (glue.h's `HAG_LOG_MAX_RANGES`).
pub(crate) const MAX_SPANS: usize = 4;

/// `[gpa, gpa + size)` of guest physical addresses, as a VMM asked to log
/// it; the layout of glue.h's `struct hag_log_range`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Range {
    pub(crate) gpa: u64,
    pub(crate) size: u64,
}

/// One logged range: its pages' bits start at word `word` of the bitmap.
#[derive(Clone, Copy)]
struct Span {
    gpa: u64,
    pages: u64,
    word: usize,
}

impl Span {
    /// The page index within this span of `gpa`, if it falls in it.
    fn page_of(&self, gpa: u64) -> Option<u64> {
        let page = gpa.checked_sub(self.gpa)? / abi::DIRTY_PAGE_SIZE;
        (page < self.pages).then_some(page)
    }
}

/// A bitmap per range, one after the other in `words`: a VMM that logs RAM
/// below 4 GiB and above it, with a 64-bit PCI hole near the top of the
/// address space, pays for its RAM, not for the gaps.
pub(crate) struct DirtyLog {
    spans: KVec<Span>,
    words: KVVec<u64>,
}

impl DirtyLog {
    /// A clear log of `[gpa, gpa + size)`, after checking the ioctl's values.
    pub(crate) fn new(gpa: u64, size: u64) -> Result<Self> {
        Self::with_ranges(&[Range { gpa, size }])
    }

    /// A clear log of `ranges` (1 to [`MAX_SPANS`], each page-aligned and
    /// non-empty, in ascending order without overlap, together at most
    /// [`abi::DIRTY_MAX_BYTES`]: the bitmaps' memory is bounded whatever
    /// the VMM asks).
    pub(crate) fn with_ranges(ranges: &[Range]) -> Result<Self> {
        let page = abi::DIRTY_PAGE_SIZE;
        if ranges.is_empty() || ranges.len() > MAX_SPANS {
            return Err(EINVAL);
        }
        let mut spans = KVec::with_capacity(ranges.len(), GFP_KERNEL)?;
        let (mut total, mut words, mut next_free) = (0u64, 0usize, 0u64);
        for r in ranges {
            let end = r.gpa.checked_add(r.size).ok_or(EINVAL)?;
            if r.gpa % page != 0 || r.size % page != 0 || r.size == 0 || r.gpa < next_free {
                return Err(EINVAL);
            }
            total = total.checked_add(r.size).ok_or(EINVAL)?;
            if total > abi::DIRTY_MAX_BYTES {
                return Err(EINVAL);
            }
            let pages = r.size / page;
            spans.push(Span { gpa: r.gpa, pages, word: words }, GFP_KERNEL)?;
            // Each span starts on a word of its own, so its bits never
            // share a word with another's.
            words += usize::try_from(pages.div_ceil(64)).map_err(|_| EINVAL)?;
            next_free = end;
        }
        Ok(Self {
            spans,
            words: KVVec::from_elem(0u64, words, GFP_KERNEL)?,
        })
    }

    /// Bytes of bitmap a reader must provide.
    pub(crate) fn bitmap_bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// Marks the page holding guest physical address `gpa`, if logged.
    pub(crate) fn mark(&mut self, gpa: u64) -> bool {
        let Some((span, page)) = self.spans.iter().find_map(|s| Some((*s, s.page_of(gpa)?))) else {
            return false;
        };
        // page < span.pages, so the word is inside the span's words.
        if let Some(word) = self.words.get_mut(span.word + (page / 64) as usize) {
            *word |= 1 << (page % 64);
        }
        true
    }

    /// Marks every logged page; returns how many there are. Bits past each
    /// range's last page stay clear, so counts of dirty pages stay exact.
    pub(crate) fn mark_all(&mut self) -> u64 {
        let mut marked = 0;
        for span in self.spans.iter() {
            let mut left = span.pages;
            for word in self.words.iter_mut().skip(span.word).take(span.pages.div_ceil(64) as usize) {
                *word = if left >= 64 { u64::MAX } else { (1u64 << left) - 1 };
                left = left.saturating_sub(64);
            }
            marked += span.pages;
        }
        marked
    }

    /// Calls `report` with the guest physical address of every dirty page
    /// in `[gpa, gpa + len)` and clears those bits.
    pub(crate) fn drain_range(&mut self, gpa: u64, len: u64, report: &mut dyn FnMut(u64)) {
        let page = abi::DIRTY_PAGE_SIZE;
        let last = gpa.saturating_add(len);
        for span in self.spans.iter() {
            let first = gpa.saturating_sub(span.gpa) / page;
            let end = last.saturating_sub(span.gpa).div_ceil(page).min(span.pages);
            // QEMU asks for all of a 4 GiB range on every sync, so clean
            // words are skipped whole: the work is one step per 64 pages.
            let mut index = first;
            while index < end {
                let Some(word) = self.words.get_mut(span.word + (index / 64) as usize) else { break };
                if *word == 0 {
                    index = (index / 64 + 1) * 64;
                    continue;
                }
                let bit = 1u64 << (index % 64);
                if *word & bit != 0 {
                    *word &= !bit;
                    report(span.gpa + index * page);
                }
                index += 1;
            }
        }
    }

    /// Moves the dirty bits of `[gpa, gpa + len)` into a log of its own
    /// (same ranges) and clears them here: VFIO's report sets them in the
    /// VMM's bitmap, whose pages it pins on first touch and which may
    /// fault, so that happens from the copy, without the vGPU's lock.
    pub(crate) fn take_range(&mut self, gpa: u64, len: u64) -> Result<DirtyLog> {
        let mut spans = KVec::with_capacity(self.spans.len(), GFP_KERNEL)?;
        for span in self.spans.iter() {
            spans.push(*span, GFP_KERNEL)?;
        }
        let mut taken = DirtyLog {
            spans,
            words: KVVec::from_elem(0u64, self.words.len(), GFP_KERNEL)?,
        };
        self.drain_range(gpa, len, &mut |page_gpa| {
            taken.mark(page_gpa);
        });
        Ok(taken)
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
