//! A QEMU's guest RAM from outside QEMU: the shared memory backend it maps
//! (`memory-backend-memfd` or `memory-backend-file` with `share=on`), and
//! the soft-dirty bits of that mapping in QEMU's page tables, which is how
//! hagctl learns which pages the guest's CPU wrote (as CRIU does for
//! incremental dumps).
//!
//! Soft-dirty bits (`/proc/PID/pagemap` bit 55, cleared by writing `4` to
//! `/proc/PID/clear_refs`) are set by every write through QEMU's mapping:
//! the guest's own (KVM faults the page in writable through it after a
//! clear write-protected it), QEMU's device emulation, vhost. A read and a
//! clear are two calls, so a write between them would be lost: they are
//! exact only while the VM is paused, and [`super::qemu_copy`] only reads
//! and clears them then.
//!
//! Guest-physical addresses are offsets into the backend only while all
//! RAM lies below the 32-bit PCI hole: q35 keeps RAM below 2816 MiB there
//! (above, it splits RAM at 2 GiB and maps the rest at 4 GiB), so larger
//! VMs are refused, saying so.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::OwnedFd;

use guest_ram::{GuestRam, PAGE_SIZE};

/// Guest RAM of at most this much is all below 4 GiB on q35 (and pc),
/// where a guest-physical address is the backend's offset.
pub const MAX_FLAT_RAM: u64 = 0xb000_0000;

/// Bit 55 of a pagemap entry: soft-dirty.
const SOFT_DIRTY: u64 = 1 << 55;

/// The mapping of guest RAM in a QEMU process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    /// QEMU's pid.
    pub pid: i32,
    /// First byte's address in QEMU.
    pub start: u64,
    /// Bytes.
    pub size: u64,
    /// What QEMU mapped (a path, or `/memfd:NAME (deleted)`).
    pub name: String,
}

/// Finds, in `/proc/PID/maps` text, the shared mapping of `size` bytes at
/// file offset 0 (named `want`, if given): guest RAM's.
pub fn find_mapping(
    maps: &str,
    pid: i32,
    size: u64,
    want: Option<&str>,
) -> Result<Mapping, String> {
    let mut found = Vec::new();
    for line in maps.lines() {
        // Single spaces between the fields, padding before the name.
        let mut f = line.splitn(6, ' ');
        let (Some(range), Some(perms), Some(offset)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let name = f.nth(2).map(|n| n.trim_start().to_owned());
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        let at_zero = offset.bytes().all(|c| c == b'0');
        if b.wrapping_sub(a) != size || perms.as_bytes().get(3) != Some(&b's') || !at_zero {
            continue;
        }
        let name = name.unwrap_or_default();
        found.push(Mapping {
            pid,
            start: a,
            size,
            name,
        });
    }
    // The name QEMU opened may read otherwise here (QEMU in a chroot or
    // another mount namespace): it only picks among several.
    if found.len() > 1 {
        if let Some(w) = want {
            found.retain(|m| m.name == w || m.name.ends_with(w));
        }
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(format!(
            "QEMU (pid {pid}) has no shared mapping of {} MiB{}: is its guest RAM in a memory backend with share=on?",
            size >> 20,
            want.map(|w| format!(" (of {w})")).unwrap_or_default()
        )),
        n => Err(format!(
            "QEMU (pid {pid}) has {n} shared mappings of {} MiB; cannot tell which is guest RAM",
            size >> 20
        )),
    }
}

/// Sets bit `i % 64` of word `i / 64` for each pagemap entry `i` of
/// `entries` (little-endian u64s) that is soft-dirty.
pub fn soft_dirty_bitmap(entries: &[u8], bitmap: &mut [u64]) {
    for (i, e) in entries.chunks_exact(8).enumerate() {
        let e = u64::from_le_bytes(e.try_into().expect("8 bytes"));
        if e & SOFT_DIRTY != 0 {
            bitmap[i / 64] |= 1 << (i % 64);
        }
    }
}

/// Whether process `pid` maps a shared file of `size` bytes (guest RAM).
fn maps_ram(pid: i32, size: u64) -> bool {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    find_mapping(&maps, pid, size, None).is_ok()
}

/// The QEMU process that holds the VM's guest RAM (`size` bytes, shared)
/// for the QMP socket `peer` made: `peer` itself, or else (a process that
/// made the socket and handed on, as a daemonizing QEMU may) the one
/// process here that maps it.
pub fn vm_process(peer: i32, size: u64) -> Result<i32, String> {
    if maps_ram(peer, size) {
        return Ok(peer);
    }
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc")
        .map_err(|e| format!("/proc: {e}"))?
        .flatten()
    {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if pid != std::process::id() as i32 && maps_ram(pid, size) {
            found.push(pid);
        }
    }
    match found.as_slice() {
        [pid] => Ok(*pid),
        [] => Err(format!(
            "QEMU's QMP socket belongs to pid {peer}, which maps no shared {} MiB of guest RAM, nor does any other process here",
            size >> 20
        )),
        more => Err(format!(
            "QEMU's QMP socket belongs to pid {peer}, which maps no shared {} MiB of guest RAM; {} processes here do ({more:?}): cannot tell which is this VM",
            size >> 20,
            more.len(),
        )),
    }
}

impl Mapping {
    /// Finds guest RAM of `size` bytes in QEMU `pid` (named `want` if
    /// given) and maps it here.
    pub fn open(pid: i32, size: u64, want: Option<&str>) -> Result<(Mapping, GuestRam), String> {
        if size > MAX_FLAT_RAM {
            return Err(format!(
                "guest RAM of {} MiB lies partly above 4 GiB (q35 splits RAM over 2816 MiB); hagctl checkpoints VMs of at most {} MiB",
                size >> 20,
                MAX_FLAT_RAM >> 20
            ));
        }
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
            .map_err(|e| format!("/proc/{pid}/maps: {e}"))?;
        let m = find_mapping(&maps, pid, size, want)?;
        // map_files opens the very file QEMU mapped, a memfd included.
        let path = format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.start + size);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| format!("{path} ({}): {e}", m.name))?;
        let ram = GuestRam::map_fd(OwnedFd::from(file), size)
            .map_err(|e| format!("mapping QEMU's guest RAM ({}): {e}", m.name))?;
        Ok((m, ram))
    }

    /// The soft-dirty bits of guest RAM's pages, as bitmap words.
    pub fn read_soft_dirty(&self) -> Result<Vec<u64>, String> {
        let pages = self.size / PAGE_SIZE;
        let path = format!("/proc/{}/pagemap", self.pid);
        let mut f = File::open(&path).map_err(|e| format!("{path}: {e}"))?;
        let mut bitmap = vec![0u64; pages.div_ceil(64) as usize];
        let mut buf = vec![0u8; 8 * 4096];
        let mut done = 0u64;
        f.seek(SeekFrom::Start(self.start / PAGE_SIZE * 8))
            .map_err(|e| format!("{path}: {e}"))?;
        while done < pages {
            let n = (pages - done).min(4096) as usize;
            f.read_exact(&mut buf[..n * 8])
                .map_err(|e| format!("{path}: {e}"))?;
            let mut part = vec![0u64; n.div_ceil(64)];
            soft_dirty_bitmap(&buf[..n * 8], &mut part);
            // `done` is a multiple of 4096, so of 64.
            let w = (done / 64) as usize;
            for (i, word) in part.into_iter().enumerate() {
                bitmap[w + i] |= word;
            }
            done += n as u64;
        }
        Ok(bitmap)
    }

    /// Clears every soft-dirty bit of QEMU's address space.
    pub fn clear_soft_dirty(&self) -> Result<(), String> {
        let path = format!("/proc/{}/clear_refs", self.pid);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|mut f| f.write_all(b"4"))
            .map_err(|e| format!("{path}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0a00000-55d0c0b00000 r-xp 00000000 fd:01 1234                       /usr/bin/qemu-system-x86_64
7f0000000000-7f0010000000 rw-s 00000000 00:01 99                         /memfd:ram0 (deleted)
7f0010000000-7f0020000000 rw-p 00000000 00:00 0 
7f0020000000-7f0030000000 rw-s 00001000 00:01 98                         /dev/shm/other
7f0030000000-7f0030200000 rw-s 00000000 00:01 97                         /dev/shm/vm ram
";

    #[test]
    fn guest_ram_is_the_shared_mapping_of_its_size() {
        let m = find_mapping(MAPS, 7, 256 << 20, None).unwrap();
        assert_eq!(
            (m.start, m.name.as_str()),
            (0x7f00_0000_0000, "/memfd:ram0 (deleted)")
        );
        let m = find_mapping(MAPS, 7, 2 << 20, Some("/dev/shm/vm ram")).unwrap();
        assert_eq!(m.start, 0x7f00_3000_0000);
        // Private, or at an offset, does not count.
        let err = find_mapping(MAPS, 7, 128 << 20, None).unwrap_err();
        assert!(err.contains("no shared mapping of 128 MiB"), "{err}");
        // A name that reads otherwise (a chroot) still finds the only one.
        let m = find_mapping(MAPS, 7, 256 << 20, Some("/tmp/x")).unwrap();
        assert_eq!(m.start, 0x7f00_0000_0000);
        let twice =
            format!("{MAPS}7f0040000000-7f0050000000 rw-s 00000000 00:01 96    /hostroot/tmp/b\n");
        assert!(find_mapping(&twice, 7, 256 << 20, None)
            .unwrap_err()
            .contains("2 shared mappings"));
        let m = find_mapping(&twice, 7, 256 << 20, Some("/tmp/b")).unwrap();
        assert_eq!(m.start, 0x7f00_4000_0000);
    }

    #[test]
    fn soft_dirty_entries_become_bits() {
        let mut entries = vec![0u8; 8 * 130];
        for i in [0usize, 63, 64, 129] {
            entries[i * 8..i * 8 + 8].copy_from_slice(&(SOFT_DIRTY | 1 << 63 | 5).to_le_bytes());
        }
        // Present but clean.
        entries[8..16].copy_from_slice(&(1u64 << 63).to_le_bytes());
        let mut bitmap = vec![0u64; 3];
        soft_dirty_bitmap(&entries, &mut bitmap);
        assert_eq!(bitmap, vec![1 | 1 << 63, 1, 1 << 1]);
    }

    #[test]
    fn large_guests_are_refused_naming_the_limit() {
        let Err(err) = Mapping::open(1, 4 << 30, None) else {
            panic!("a 4 GiB guest was mapped")
        };
        assert!(err.contains("at most 2816 MiB"), "{err}");
    }
}
