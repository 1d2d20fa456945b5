//! The pages the backup holds, as the primary last sent them: what an
//! epoch's page is sent as a delta against (`PageData::Xor`).
//!
//! A checkpointed VM dirties many of the same pages every epoch (timers,
//! kernel stacks, a database's hot blocks), each changed in a few bytes;
//! the XOR of a page with the copy the backup already holds is mostly
//! zeroes and compresses to a few dozen bytes where the page itself
//! compresses to one or two KiB. QEMU's XBZRLE makes the same bet with a
//! cache of the same shape (`xbzrle-cache-size`, 64 MiB by default).
//!
//! The promise the wire relies on: a page in the cache holds exactly the
//! bytes the backup's committed image holds for it. So pages go in only
//! once the epoch that carried them is acknowledged (the backup commits an
//! epoch before it acknowledges it and before it reads the next one), and
//! the whole cache is forgotten whenever that cannot be known: a new
//! session or resynchronisation, and an epoch that failed after any of it
//! went out (the backup may have committed it with its ack lost).
//!
//! Direct-mapped: page `gfn` can only live in slot `gfn % slots`, so a
//! lookup is one comparison and the memory is fixed at creation. A miss
//! costs nothing but the delta: the page goes as it would without one.

use crate::wire::PAGE;

/// A slot no page occupies.
const EMPTY: u64 = u64::MAX;

pub struct PageCache {
    /// The page in each slot, or [`EMPTY`].
    tags: Vec<u64>,
    /// `tags.len()` pages of bytes.
    data: Vec<u8>,
}

impl PageCache {
    /// A cache of `bytes` (rounded down to whole pages; 0: never holds a
    /// page, so every page goes whole). The memory is reserved lazily by
    /// the kernel as slots fill.
    pub fn new(bytes: u64) -> PageCache {
        let slots = usize::try_from(bytes / PAGE as u64).unwrap_or(usize::MAX / PAGE);
        PageCache {
            tags: vec![EMPTY; slots],
            data: vec![0; slots * PAGE],
        }
    }

    /// Page `gfn`'s bytes as the backup holds them, if they are here.
    pub fn get(&self, gfn: u64) -> Option<&[u8]> {
        let slot = self.slot(gfn)?;
        (self.tags[slot] == gfn).then(|| &self.data[slot * PAGE..(slot + 1) * PAGE])
    }

    /// Records that the backup holds `bytes` for page `gfn` (evicting
    /// whatever shared its slot).
    pub fn put(&mut self, gfn: u64, bytes: &[u8]) {
        debug_assert_eq!(bytes.len(), PAGE);
        if let Some(slot) = self.slot(gfn) {
            self.tags[slot] = gfn;
            self.data[slot * PAGE..(slot + 1) * PAGE].copy_from_slice(bytes);
        }
    }

    /// Forgets every page (the backup's image may no longer match).
    pub fn clear(&mut self) {
        self.tags.fill(EMPTY);
    }

    /// Pages it can hold.
    #[cfg(test)]
    pub fn slots(&self) -> usize {
        self.tags.len()
    }

    fn slot(&self, gfn: u64) -> Option<usize> {
        let n = self.tags.len() as u64;
        (n > 0 && gfn != EMPTY).then(|| (gfn % n) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_is_found_until_its_slot_is_taken_or_the_cache_cleared() {
        let mut c = PageCache::new(4 * PAGE as u64 + 100);
        assert_eq!(c.slots(), 4);
        assert!(c.get(1).is_none());
        c.put(1, &[1; PAGE]);
        c.put(2, &[2; PAGE]);
        assert_eq!(c.get(1), Some(&[1u8; PAGE][..]));
        // 5 shares 1's slot: 1 is gone, never answered with 5's bytes.
        c.put(5, &[5; PAGE]);
        assert!(c.get(1).is_none());
        assert_eq!(c.get(5), Some(&[5u8; PAGE][..]));
        assert_eq!(c.get(2), Some(&[2u8; PAGE][..]));
        c.clear();
        assert!(c.get(2).is_none() && c.get(5).is_none());
    }

    #[test]
    fn an_empty_cache_holds_nothing() {
        let mut c = PageCache::new(PAGE as u64 - 1);
        assert_eq!(c.slots(), 0);
        c.put(3, &[3; PAGE]);
        assert!(c.get(3).is_none());
        // The marker of an empty slot is never a page's number.
        let mut c = PageCache::new(PAGE as u64);
        c.put(u64::MAX, &[9; PAGE]);
        assert!(c.get(u64::MAX).is_none());
    }
}
