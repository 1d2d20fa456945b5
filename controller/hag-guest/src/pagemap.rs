//! Guest physical frames of this process's pages, from `/proc/self/pagemap`
//! (one little-endian u64 per virtual page: bit 63 present, bit 62
//! swapped, bits 0–54 the page frame number; the kernel shows frame numbers
//! only to a process with `CAP_SYS_ADMIN`, to others they read as 0).
//!
//! # Why the frames stay put
//!
//! The vGPU is told guest physical addresses (its GTT entries) once, at
//! setup, and writes them by DMA for the whole run, so every page of the
//! buffer must stay at the frame read here. Nothing pins them the way a
//! kernel driver would (`pin_user_pages(FOLL_LONGTERM)`); they stay
//! because nothing in this guest moves them:
//!
//! - the buffer is private anonymous memory, populated, written and locked
//!   ([`guest_ram::GuestRam::new_locked`]): it is never reclaimed, and
//!   never the shared zero page;
//! - the guest kernel (the test kernel, 6.12 from `tinyconfig`) has no
//!   swap (`CONFIG_SWAP` needs `CONFIG_BLOCK`, which it lacks) and no page
//!   migration at all: `CONFIG_MIGRATION` is off, because nothing that
//!   selects it is on (compaction, transparent huge pages, NUMA, CMA,
//!   memory hotplug, memory-failure recovery, virtio-balloon compaction);
//!   KSM is off too, and the guest has no IOMMU;
//! - the process never forks (no copy-on-write of the buffer) and never
//!   unmaps it before the end.
//!
//! What would break it: a guest kernel with `CONFIG_MIGRATION` (most
//! distribution kernels: `mlock` keeps a page resident but lets
//! compaction, with `vm.compact_unevictable_allowed` = 1 by default, THP
//! collapse, NUMA balancing, memory offlining or CMA move it to another
//! frame), or with KSM and the buffer `MADV_MERGEABLE`; the GPU would then
//! write a frame the buffer no longer has. `hag-guest` reads the frames
//! again at the end and fails the run if any page moved ([`moved`]).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::bail;
use guest_ram::PAGE_SIZE;

use crate::pci::os_error;

/// This process's page map.
pub const PAGEMAP: &str = "/proc/self/pagemap";

const PRESENT: u64 = 1 << 63;
const SWAPPED: u64 = 1 << 62;
const PFN_MASK: u64 = (1 << 55) - 1;

/// One decoded pagemap entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// Present at this page frame.
    Frame(u64),
    /// Present, frame number withheld (reads as 0: not `CAP_SYS_ADMIN`).
    Hidden,
    /// Swapped out.
    Swapped,
    /// Not present.
    Absent,
}

/// Decodes one pagemap entry.
pub fn decode(entry: u64) -> Entry {
    if entry & PRESENT != 0 {
        match entry & PFN_MASK {
            0 => Entry::Hidden,
            pfn => Entry::Frame(pfn),
        }
    } else if entry & SWAPPED != 0 {
        Entry::Swapped
    } else {
        Entry::Absent
    }
}

/// The frames of the `pages` pages from virtual address `addr` (page
/// aligned), read from the pagemap `file` (named `path` in errors).
pub fn frames_in(file: &File, path: &Path, addr: u64, pages: u64) -> anyhow::Result<Vec<u64>> {
    if addr % PAGE_SIZE != 0 {
        bail!("address {addr:#x} is not page aligned");
    }
    let mut raw = vec![0u8; (pages * 8) as usize];
    file.read_exact_at(&mut raw, addr / PAGE_SIZE * 8)
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot read {} at {:#x}: {}",
                path.display(),
                addr / PAGE_SIZE * 8,
                os_error(&e)
            )
        })?;
    let mut frames = Vec::with_capacity(pages as usize);
    for (p, b) in raw.chunks_exact(8).enumerate() {
        let entry = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
        let va = addr + p as u64 * PAGE_SIZE;
        match decode(entry) {
            Entry::Frame(pfn) => frames.push(pfn),
            Entry::Hidden => bail!(
                "page {p} at {va:#x} is present but {} shows its frame number as 0: only root \
                 (CAP_SYS_ADMIN) sees frame numbers, run hag-guest as root",
                path.display()
            ),
            Entry::Swapped => bail!(
                "page {p} at {va:#x} is swapped out although locked ({} entry {entry:#018x})",
                path.display()
            ),
            Entry::Absent => bail!(
                "page {p} at {va:#x} is not present although locked and written ({} entry {entry:#018x})",
                path.display()
            ),
        }
    }
    Ok(frames)
}

/// The frames of this process's `pages` pages from `addr`.
pub fn frames(addr: u64, pages: u64) -> anyhow::Result<Vec<u64>> {
    let path = Path::new(PAGEMAP);
    let file =
        File::open(path).map_err(|e| anyhow::anyhow!("cannot open {PAGEMAP}: {}", os_error(&e)))?;
    frames_in(&file, path, addr, pages)
}

/// Pages whose frame differs between `before` and `now`, with both
/// frames: `(page, before, now)`.
pub fn moved(before: &[u64], now: &[u64]) -> Vec<(u64, u64, u64)> {
    before
        .iter()
        .zip(now)
        .enumerate()
        .filter(|(_, (b, n))| b != n)
        .map(|(p, (b, n))| (p as u64, *b, *n))
        .collect()
}

/// Fails unless the system's page size is the 4 KiB this program (and
/// the pagemap arithmetic) assumes.
pub fn check_page_size() -> anyhow::Result<()> {
    use nix::unistd::{sysconf, SysconfVar};
    match sysconf(SysconfVar::PAGE_SIZE) {
        Ok(Some(size)) if size as u64 == PAGE_SIZE => Ok(()),
        other => bail!("page size is {other:?}, hag-guest needs {PAGE_SIZE}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_decode() {
        assert_eq!(decode(PRESENT | 0x1234), Entry::Frame(0x1234));
        // Soft-dirty (55), exclusive (56) and file/shared (61) bits are not
        // part of the frame number.
        let flags = (1 << 55) | (1 << 56) | (1 << 61);
        assert_eq!(decode(PRESENT | flags | PFN_MASK), Entry::Frame(PFN_MASK));
        assert_eq!(decode(PRESENT | flags), Entry::Hidden);
        assert_eq!(decode(PRESENT), Entry::Hidden);
        assert_eq!(decode(SWAPPED | 0x55), Entry::Swapped);
        assert_eq!(decode(0), Entry::Absent);
        assert_eq!(decode(1 << 55), Entry::Absent);
    }

    fn pagemap_file(name: &str, entries: &[(u64, u64)]) -> (std::path::PathBuf, File) {
        let path = std::env::temp_dir().join(format!("hag-guest-{}-{name}", std::process::id()));
        let mut bytes = vec![0u8; 0x20 * 8];
        for (vpn, e) in entries {
            bytes[*vpn as usize * 8..][..8].copy_from_slice(&e.to_le_bytes());
        }
        std::fs::write(&path, bytes).unwrap();
        let file = File::open(&path).unwrap();
        (path, file)
    }

    #[test]
    fn frames_are_read_at_the_pages_entries() {
        let entries = [
            (0x10, PRESENT | 7),
            (0x11, PRESENT | 3),
            (0x12, PRESENT | 0x99),
        ];
        let (path, file) = pagemap_file("read", &entries);
        assert_eq!(
            frames_in(&file, &path, 0x10000, 3).unwrap(),
            vec![7, 3, 0x99]
        );
        assert_eq!(frames_in(&file, &path, 0x11000, 1).unwrap(), vec![3]);
        let err = frames_in(&file, &path, 0x11000, 3).unwrap_err().to_string();
        assert!(err.starts_with("page 2 at 0x13000 is not present"), "{err}");
        assert!(frames_in(&file, &path, 0x10800, 1).is_err());
        let err = frames_in(&file, &path, 0x1f000, 2).unwrap_err().to_string();
        assert!(err.contains("cannot read"), "{err}");
        std::fs::remove_file(&path).unwrap();

        let (path, file) = pagemap_file("hidden", &[(0, PRESENT | 5), (1, PRESENT)]);
        let err = frames_in(&file, &path, 0, 2).unwrap_err().to_string();
        assert!(err.starts_with("page 1 at 0x1000 is present but "), "{err}");
        assert!(err.ends_with("shows its frame number as 0: only root (CAP_SYS_ADMIN) sees frame numbers, run hag-guest as root"), "{err}");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn moved_pages_are_listed() {
        assert!(moved(&[1, 2, 3], &[1, 2, 3]).is_empty());
        assert_eq!(moved(&[1, 2, 3], &[1, 9, 3]), vec![(1, 2, 9)]);
    }

    /// Locked memory, as hag-guest takes it, on this machine: as root
    /// every page has a frame of its own, and they stay; otherwise the
    /// error says to run as root.
    #[test]
    fn locked_memory_has_frames_of_its_own() {
        let ram = guest_ram::GuestRam::new_locked(16 * PAGE_SIZE).unwrap();
        match frames(ram.host_addr(), ram.pages()) {
            Ok(f) => {
                assert_eq!(f.len(), 16);
                let again = frames(ram.host_addr(), ram.pages()).unwrap();
                assert!(moved(&f, &again).is_empty());
                let ram = ram.with_frames(f.clone()).unwrap();
                assert_eq!(ram.frame(3), Some(f[3]));
            }
            Err(e) => assert!(e.to_string().ends_with("run hag-guest as root"), "{e}"),
        }
    }

    #[test]
    fn this_system_has_4k_pages() {
        check_page_size().unwrap();
    }
}
