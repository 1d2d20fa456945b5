//! The CPU half of the workload: a region of this process's memory that the
//! CPU rewrites every iteration, so the VM dirties guest memory with its
//! CPU too (which only KVM tracks; nothing here reports it).
//!
//! Iteration `i` rewrites `K` whole pages (`--cpu-pages`): write number
//! `t = i·K + j` (`j < K`) goes to page `t mod P` of the region's `P`
//! pages, cycling through the region, so each page is rewritten every
//! `P / K` iterations and the last writer of every page follows from the
//! number of iterations alone ([`CpuRegion::last_writer`]). A page holds
//! [`word`]`(i, page, d)` in dword `d`: the iteration in dword 0, the page
//! in dword 1, the rest a hash of all three, so a page left as an older
//! iteration wrote it (a CPU write lost by a migration), a page of another
//! page, or a torn page all differ from the model.

use anyhow::{bail, Context};
use guest_gpu::frames::Mismatches;
use guest_ram::{GuestRam, PAGE_SIZE};

/// Dwords per page.
const DWORDS: usize = (PAGE_SIZE / 4) as usize;

/// Dword `d` of page `page` as iteration `i` writes it (never zero past
/// dword 1).
pub fn word(i: u32, page: u64, d: usize) -> u32 {
    match d {
        0 => i,
        1 => page as u32,
        _ => {
            // splitmix64's finaliser over (iteration, page, dword).
            let mut x = (u64::from(i) << 32 | (page & 0xffff_ffff))
                ^ (d as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (x ^ (x >> 31)) as u32 | 1
        }
    }
}

/// Page `page` as iteration `i` writes it.
fn page_image(i: u32, page: u64, out: &mut [u8]) {
    for (d, b) in out.chunks_exact_mut(4).enumerate() {
        b.copy_from_slice(&word(i, page, d).to_le_bytes());
    }
}

/// The region and its write pattern.
pub struct CpuRegion {
    mem: GuestRam,
    per_iteration: u64,
}

impl CpuRegion {
    /// A zeroed region of `pages` pages, `per_iteration` of them rewritten
    /// each iteration (1 to `pages`). Locked, so that a lack of memory
    /// shows now rather than as an OOM kill mid-run.
    pub fn new(pages: u64, per_iteration: u64) -> anyhow::Result<Self> {
        if per_iteration == 0 || per_iteration > pages {
            bail!("{per_iteration} pages per iteration of a region of {pages} pages: must be 1 to {pages}");
        }
        let mem = GuestRam::new_locked(pages * PAGE_SIZE)?;
        Ok(CpuRegion { mem, per_iteration })
    }

    /// Pages in the region.
    pub fn pages(&self) -> u64 {
        self.mem.pages()
    }

    /// Pages rewritten per iteration.
    pub fn per_iteration(&self) -> u64 {
        self.per_iteration
    }

    /// Writes iteration `i`'s pages.
    pub fn write(&self, i: u32) -> anyhow::Result<()> {
        let mut image = vec![0u8; PAGE_SIZE as usize];
        for j in 0..self.per_iteration {
            let page = (u64::from(i) * self.per_iteration + j) % self.pages();
            page_image(i, page, &mut image);
            self.mem.write(page * PAGE_SIZE, &image)?;
        }
        Ok(())
    }

    /// The last of iterations `0..n` that wrote page `page`, if any.
    pub fn last_writer(&self, page: u64, n: u32) -> Option<u32> {
        let writes = u64::from(n) * self.per_iteration;
        let p = self.pages();
        if page >= p || page >= writes {
            return None;
        }
        // The last write number t < writes with t mod p = page.
        let t = page + (writes - 1 - page) / p * p;
        Some((t / self.per_iteration) as u32)
    }

    /// Checks every page against the model after iterations `0..n`: the
    /// pattern of its last writer, or zero if none wrote it.
    pub fn check(&self, n: u32) -> anyhow::Result<Mismatches> {
        let mut found = Mismatches::default();
        let mut page = vec![0u8; PAGE_SIZE as usize];
        let mut want = vec![0u8; PAGE_SIZE as usize];
        for p in 0..self.pages() {
            self.mem
                .read(p * PAGE_SIZE, &mut page)
                .context("CPU region")?;
            let last = self.last_writer(p, n);
            match last {
                Some(i) => page_image(i, p, &mut want),
                None => want.fill(0),
            }
            if page == want {
                continue;
            }
            found.add("CPU region page", || {
                let d = (0..DWORDS)
                    .find(|d| page[4 * d..4 * d + 4] != want[4 * d..4 * d + 4])
                    .unwrap_or(0);
                let dword = |b: &[u8]| {
                    u32::from_le_bytes([b[4 * d], b[4 * d + 1], b[4 * d + 2], b[4 * d + 3]])
                };
                let expected = match last {
                    Some(i) => format!("last written by iteration {i}"),
                    None => "never written".to_string(),
                };
                format!(
                    "CPU region page {p} dword {d} (offset {:#x}) is {:#010x}, expected {:#010x}: \
                     the page was {expected} but holds {}",
                    p * PAGE_SIZE + 4 * d as u64,
                    dword(&page),
                    dword(&want),
                    describe(&page, p)
                )
            });
        }
        Ok(found)
    }

    /// The region's memory (tests corrupt it).
    #[cfg(test)]
    pub(crate) fn mem(&self) -> &GuestRam {
        &self.mem
    }
}

/// What a page of the region holds, in words.
fn describe(page: &[u8], p: u64) -> String {
    if page.iter().all(|&b| b == 0) {
        return "zeros".to_string();
    }
    let d = |k: usize| {
        u32::from_le_bytes([
            page[4 * k],
            page[4 * k + 1],
            page[4 * k + 2],
            page[4 * k + 3],
        ])
    };
    let (i, of) = (d(0), u64::from(d(1)));
    let mut image = vec![0u8; page.len()];
    page_image(i, of, &mut image);
    if image == page {
        if of == p & 0xffff_ffff {
            format!("iteration {i}'s write")
        } else {
            format!("iteration {i}'s write of page {of}")
        }
    } else {
        format!("neither zeros nor a whole write (dwords 0, 1: {i:#x}, {of:#x})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn brute_last_writer(pages: u64, k: u64, page: u64, n: u32) -> Option<u32> {
        (0..n).rfind(|&i| (0..k).any(|j| (u64::from(i) * k + j) % pages == page))
    }

    #[test]
    fn last_writer_follows_the_cycle() {
        for (pages, k) in [(1, 1), (5, 1), (8, 3), (16, 16), (7, 2)] {
            let region = CpuRegion::new(pages, k).unwrap();
            for n in 0..40 {
                for page in 0..pages {
                    assert_eq!(
                        region.last_writer(page, n),
                        brute_last_writer(pages, k, page, n),
                        "{pages} pages, {k} per iteration, page {page}, {n} iterations"
                    );
                }
            }
            assert_eq!(region.last_writer(pages, 40), None);
        }
        assert!(CpuRegion::new(4, 0).is_err());
        assert!(CpuRegion::new(4, 5).is_err());
    }

    #[test]
    fn words_differ_by_iteration_page_and_dword() {
        assert_eq!(word(7, 3, 0), 7);
        assert_eq!(word(7, 3, 1), 3);
        assert_ne!(word(7, 3, 2), word(8, 3, 2));
        assert_ne!(word(7, 3, 2), word(7, 4, 2));
        assert_ne!(word(7, 3, 2), word(7, 3, 3));
        assert!((2..DWORDS).all(|d| word(0, 0, d) != 0));
    }

    /// Runs `n` iterations on a region of 8 pages, 3 per iteration.
    fn ran(n: u32) -> CpuRegion {
        let region = CpuRegion::new(8, 3).unwrap();
        for i in 0..n {
            region.write(i).unwrap();
        }
        region
    }

    #[test]
    fn the_model_matches_a_run_and_catches_a_stale_page() {
        // 2 iterations: pages 0-5 written, 6 and 7 still zero.
        assert!(ran(2).check(2).unwrap().is_empty());
        let region = ran(50);
        assert!(region.check(50).unwrap().is_empty());
        // 50 iterations are not 49: the model knows the last writers.
        let found = region.check(49).unwrap();
        assert_eq!(found.counts, vec![("CPU region page", 3)]);

        // Page 5, last written by iteration 49 (write 149 = 18 * 8 + 5),
        // rolled back to iteration 47's write (write 141): a lost CPU write.
        let p = 5;
        assert_eq!(region.last_writer(p, 50), Some(49));
        assert_eq!(region.last_writer(p, 49), Some(47));
        let mut old = vec![0u8; PAGE_SIZE as usize];
        page_image(47, p, &mut old);
        region.mem().write(p * PAGE_SIZE, &old).unwrap();
        let found = region.check(50).unwrap();
        assert_eq!(found.counts, vec![("CPU region page", 1)]);
        assert_eq!(
            found.first.as_deref(),
            Some(
                "CPU region page 5 dword 0 (offset 0x5000) is 0x0000002f, expected 0x00000031: \
                 the page was last written by iteration 49 but holds iteration 47's write"
            )
        );
        assert_eq!(
            found.to_string(),
            format!(
                "{} (1 mismatch: 1 CPU region page)",
                found.first.as_ref().unwrap()
            )
        );

        // One torn dword in page 2, and page 7 zeroed.
        let region = ran(50);
        region.mem().write_u32(2 * PAGE_SIZE + 0x800, 0).unwrap();
        region.mem().write(7 * PAGE_SIZE, &[0u8; 4096]).unwrap();
        let found = region.check(50).unwrap();
        assert_eq!(found.total(), 2);
        let first = found.first.unwrap();
        assert!(
            first.starts_with(
                "CPU region page 2 dword 512 (offset 0x2800) is 0x00000000, expected 0x"
            ),
            "{first}"
        );
        assert!(
            first.ends_with("but holds neither zeros nor a whole write (dwords 0, 1: 0x30, 0x2)"),
            "{first}"
        );
        let region = ran(50);
        region.mem().write(7 * PAGE_SIZE, &[0u8; 4096]).unwrap();
        let first = region.check(50).unwrap().first.unwrap();
        assert!(
            first.ends_with("the page was last written by iteration 47 but holds zeros"),
            "{first}"
        );
        // A page that should be zero but is not.
        let region = ran(2);
        region.mem().write_u32(7 * PAGE_SIZE, 1).unwrap();
        let first = region.check(2).unwrap().first.unwrap();
        assert!(
            first.contains("the page was never written but holds"),
            "{first}"
        );
    }
}
