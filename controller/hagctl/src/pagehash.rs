//! Dirty detection by page hashing: the baseline that needs no help from
//! the GPU (`--gpu-dirty hash`), as page-hashing migration systems do it.
//!
//! [`PageHashes`] remembers a hash of every guest page as the peer last
//! received it. Each round or epoch, every page the GPU could have written
//! (the pages the vGPU's GTT maps, or all of guest RAM while no saved
//! context says which) is read and hashed again; a page whose hash changed
//! is dirty. Every page sent records its new hash, whoever dirtied it, so a
//! page the CPU log already sent is not found "changed" again.
//!
//! Its promise: a page whose bytes differ from what was last recorded is
//! reported, unless two different pages collide in the 64-bit hash (odds of
//! 2^-64 per changed page; a change confined to one 8-byte word always
//! changes the hash, since each step of the hash is a bijection of its
//! state). The cost (pages hashed, milliseconds) is reported, since it is
//! what this baseline pays instead of auditing.

use guest_ram::{GuestRam, RamError, PAGE_SIZE};

use crate::wire::PAGE;

/// Hash of one 4 KiB page: a multiply-rotate hash over its 8-byte words
/// (FxHash's step), finished with a murmur3-style avalanche.
pub fn page_hash(page: &[u8]) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    for w in page.chunks_exact(8) {
        let w = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        h = (h.rotate_left(5) ^ w).wrapping_mul(K);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

/// What one scan cost and found.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Scan {
    /// Pages read and hashed.
    pub hashed: u64,
    /// Of them, changed since recorded.
    pub changed: u64,
    /// Milliseconds the scan took.
    pub ms: f64,
}

/// The hash of every guest page as the peer has it.
#[derive(Clone, Debug)]
pub struct PageHashes {
    hashes: Vec<u64>,
}

impl PageHashes {
    /// `pages` pages, all zero (what a fresh peer holds).
    pub fn new(pages: u64) -> Self {
        let zero = page_hash(&[0u8; PAGE]);
        PageHashes {
            hashes: vec![zero; pages as usize],
        }
    }

    /// Records that the peer now has `bytes` as page `index`.
    pub fn record(&mut self, index: u64, bytes: &[u8]) {
        if let Some(h) = self.hashes.get_mut(index as usize) {
            *h = page_hash(bytes);
        }
    }

    /// Reads each of `candidates` through `read`, and returns those whose
    /// bytes changed since recorded (their new hash is not recorded: that
    /// happens when they are sent).
    pub fn changed<E>(
        &self,
        candidates: impl IntoIterator<Item = u64>,
        mut read: impl FnMut(u64, &mut [u8; PAGE]) -> Result<(), E>,
        scan: &mut Scan,
    ) -> Result<Vec<u64>, E> {
        let t = std::time::Instant::now();
        let mut buf = [0u8; PAGE];
        let mut out = Vec::new();
        for p in candidates {
            let Some(&old) = self.hashes.get(p as usize) else {
                continue;
            };
            read(p, &mut buf)?;
            scan.hashed += 1;
            if page_hash(&buf) != old {
                out.push(p);
            }
        }
        scan.changed += out.len() as u64;
        scan.ms += t.elapsed().as_secs_f64() * 1e3;
        Ok(out)
    }

    /// [`Self::changed`] over guest RAM.
    pub fn changed_in(
        &self,
        ram: &GuestRam,
        candidates: impl IntoIterator<Item = u64>,
        scan: &mut Scan,
    ) -> Result<Vec<u64>, RamError> {
        self.changed(candidates, |p, buf| ram.read(p * PAGE_SIZE, buf), scan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ram(pages: &[[u8; PAGE]]) -> impl FnMut(u64, &mut [u8; PAGE]) -> Result<(), ()> + '_ {
        move |p, buf| {
            *buf = *pages.get(p as usize).ok_or(())?;
            Ok(())
        }
    }

    #[test]
    fn a_fresh_peer_has_zero_pages() {
        let h = PageHashes::new(4);
        let mut pages = [[0u8; PAGE]; 4];
        pages[2][4095] = 1;
        let mut scan = Scan::default();
        assert_eq!(h.changed(0..4, ram(&pages), &mut scan), Ok(vec![2]));
        assert_eq!((scan.hashed, scan.changed), (4, 1));
    }

    #[test]
    fn every_single_byte_change_is_found_and_recording_clears_it() {
        let mut h = PageHashes::new(1);
        let mut page = [[0u8; PAGE]; 1];
        for (i, at) in [0usize, 7, 8, 2048, 4095].into_iter().enumerate() {
            page[0][at] ^= 0x80 | i as u8;
            let mut scan = Scan::default();
            assert_eq!(
                h.changed([0], ram(&page), &mut scan),
                Ok(vec![0]),
                "byte {at}"
            );
            h.record(0, &page[0]);
            assert_eq!(
                h.changed([0], ram(&page), &mut scan),
                Ok(vec![]),
                "byte {at}"
            );
        }
    }

    #[test]
    fn swapped_words_and_same_value_rewrites() {
        let mut a = [0u8; PAGE];
        a[..8].copy_from_slice(&1u64.to_le_bytes());
        a[8..16].copy_from_slice(&2u64.to_le_bytes());
        let mut b = a;
        b.copy_within(0..8, 8);
        b[..8].copy_from_slice(&2u64.to_le_bytes());
        assert_ne!(page_hash(&a), page_hash(&b), "word order matters");
        // A rewrite with the same bytes is not a change (the baseline cannot
        // see it, and need not).
        let mut h = PageHashes::new(1);
        h.record(0, &a);
        let mut scan = Scan::default();
        assert_eq!(h.changed([0], ram(&[a]), &mut scan), Ok(vec![]));
    }

    #[test]
    fn pages_out_of_range_and_read_errors() {
        let h = PageHashes::new(2);
        let pages = [[1u8; PAGE]; 2];
        let mut scan = Scan::default();
        assert_eq!(h.changed([1, 5, 0], ram(&pages), &mut scan), Ok(vec![1, 0]));
        assert_eq!(scan.hashed, 2);
        let short = [[1u8; PAGE]; 1];
        let h = PageHashes::new(4);
        assert_eq!(h.changed([0, 3], ram(&short), &mut scan), Err(()));
    }
}
