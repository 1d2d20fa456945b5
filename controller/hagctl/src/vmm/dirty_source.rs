//! Whether soft-dirty bits see every write to a QEMU VM's guest RAM on
//! this host: checked before hagctl protects the VM, and again while it
//! does ([`QEMU's side`](super::qemu_copy)). docs/ha.md, "The CPU dirty
//! source", says why hag keeps soft-dirty bits rather than userfaultfd.
//!
//! A soft-dirty bit lives in a page table entry of QEMU's: it records a
//! write only if the write goes through that entry and the entry is not
//! dropped before hagctl reads it. So the bits are complete only when:
//! - the kernel keeps them (without `CONFIG_MEM_SOFT_DIRTY`, or on arm64,
//!   `clear_refs` succeeds and every bit reads 0): [`self_test`] writes a
//!   page of its own and must see that write and no other;
//! - the host never reclaims guest RAM: reclaim (memory pressure,
//!   `MADV_PAGEOUT`) drops a shared file page's entry and the bit with it,
//!   while the page keeps the guest's write. Locked RAM (QEMU
//!   `-overcommit mem-lock=on`, libvirt `<locked/>`) is never reclaimed,
//!   and `MADV_DONTNEED` on it fails rather than dropping entries;
//! - the pages are 4 KiB: on hugetlbfs the bit is only the mapping's, and
//!   `clear_refs` clears it;
//! - no other process writes the file: a write through another process's
//!   mapping (virtiofsd, a vhost-user back end, ivshmem) or a `write(2)`
//!   to it sets no bit of QEMU's ([`other_holders`]);
//! - guest RAM is the one backend hagctl copies, and no device writes it
//!   behind QEMU's page tables (a passed-through PCI device's DMA):
//!   checked where QEMU's configuration is read.

use std::os::unix::fs::MetadataExt;

use guest_ram::{GuestRam, PAGE_SIZE};

use super::shared_ram::Mapping;

/// What `/proc/PID/smaps` says of the mapping of guest RAM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RamVma {
    /// `KernelPageSize`, in KiB.
    pub page_kib: u64,
    /// `VmFlags`' two-letter codes (`lo`: locked, `ht`: hugetlb).
    pub flags: Vec<String>,
}

/// The entry of the mapping that starts at `start` in smaps text.
pub fn ram_vma(smaps: &str, start: u64) -> Result<RamVma, String> {
    let head = format!("{start:x}-");
    let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&head));
    if lines.next().is_none() {
        return Err(format!("smaps has no mapping at {start:#x}"));
    }
    let mut page_kib = None;
    let mut flags = None;
    for line in lines {
        if let Some(v) = line.strip_prefix("KernelPageSize:") {
            page_kib = v.trim().trim_end_matches("kB").trim().parse().ok();
        } else if let Some(v) = line.strip_prefix("VmFlags:") {
            flags = Some(v.split_whitespace().map(str::to_owned).collect());
            // The last field of an entry.
            break;
        }
    }
    match (page_kib, flags) {
        (Some(page_kib), Some(flags)) => Ok(RamVma { page_kib, flags }),
        _ => Err(format!(
            "smaps' entry at {start:#x} has no KernelPageSize or VmFlags"
        )),
    }
}

impl RamVma {
    fn has(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }

    /// Why soft-dirty bits cannot be trusted on this mapping, if they
    /// cannot.
    pub fn refusal(&self) -> Option<String> {
        if self.has("ht") || self.page_kib != 4 {
            return Some(format!(
                "guest RAM is in {} KiB huge pages (hugetlbfs): the kernel keeps a soft-dirty bit there only per mapping, \
                 and clearing it loses every page's; back guest RAM with 4 KiB pages (a file on tmpfs or a disk)",
                self.page_kib
            ));
        }
        if !self.has("lo") {
            return Some(
                "guest RAM is not locked in memory: when the host reclaims a page of it, the page's soft-dirty bit \
                 (the record that the guest wrote it) is dropped with its page table entry, and that write would never \
                 reach the backup; lock it: QEMU -overcommit mem-lock=on (libvirt: <memoryBacking><locked/></memoryBacking>)"
                    .into(),
            );
        }
        None
    }
}

/// A process other than QEMU and hagctl that holds guest RAM's file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// Its pid.
    pub pid: i32,
    /// Its command name.
    pub comm: String,
    /// `maps` or `has open`.
    pub how: &'static str,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} ({}) {} it", self.pid, self.comm, self.how)
    }
}

/// Whether a `/proc/PID/maps` line maps the file `(dev, ino)`: its fourth
/// field is `MAJOR:MINOR` in hex, its fifth the inode.
pub fn maps_line_is(line: &str, dev: (u64, u64), ino: u64) -> bool {
    let mut f = line.split_whitespace().skip(3);
    let (Some(d), Some(i)) = (f.next(), f.next()) else {
        return false;
    };
    let Some((ma, mi)) = d.split_once(':') else {
        return false;
    };
    let parsed = (u64::from_str_radix(ma, 16), u64::from_str_radix(mi, 16));
    parsed == (Ok(dev.0), Ok(dev.1)) && i.parse() == Ok(ino)
}

/// Every process here, but those in `allowed`, that maps the file
/// `(dev, ino)` or has it open.
pub fn other_holders(dev: u64, ino: u64, allowed: &[i32]) -> Vec<Holder> {
    let numbers = (nix::sys::stat::major(dev), nix::sys::stat::minor(dev));
    let mut found = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return found;
    };
    for e in procs.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if allowed.contains(&pid) {
            continue;
        }
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
        let how = if maps.lines().any(|l| maps_line_is(l, numbers, ino)) {
            Some("maps")
        } else {
            let fds = std::fs::read_dir(format!("/proc/{pid}/fd"));
            let open = fds.into_iter().flatten().flatten().any(|fd| {
                std::fs::metadata(fd.path()).is_ok_and(|m| m.dev() == dev && m.ino() == ino)
            });
            open.then_some("has open")
        };
        if let Some(how) = how {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            found.push(Holder {
                pid,
                comm: comm.trim().to_owned(),
                how,
            });
        }
    }
    found
}

/// What [`self_test`] saw of its two pages: soft-dirty after the clear,
/// and after it wrote the second one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelfTest {
    /// The bits right after `clear_refs`.
    pub cleared: [bool; 2],
    /// The bits after a write to page 1.
    pub written: [bool; 2],
}

impl SelfTest {
    /// Whether the kernel's bits saw exactly that write.
    pub fn verdict(self) -> Result<(), String> {
        if self.cleared != [false, false] {
            return Err(format!(
                "clear_refs left soft-dirty bits set ({:?}): this kernel does not clear them",
                self.cleared
            ));
        }
        match self.written {
            [false, true] => Ok(()),
            [_, false] => Err(
                "a page written after clear_refs has no soft-dirty bit: this kernel does not keep them \
                 (CONFIG_MEM_SOFT_DIRTY, x86-64 only), so hagctl would copy no page the guest's CPU writes"
                    .into(),
            ),
            [true, true] => Err(
                "a page nobody wrote after clear_refs reads soft-dirty: this kernel's bits say nothing".into(),
            ),
        }
    }
}

/// Writes a page of shared file memory here and checks that its
/// soft-dirty bit, and no other, says so (this process's bits: clearing
/// them costs it a few write faults, nothing else).
pub fn self_test() -> Result<(), String> {
    let err = |e: guest_ram::RamError| format!("soft-dirty self-test: {e}");
    let ram = GuestRam::new_memfd(2 * PAGE_SIZE).map_err(err)?;
    // Both present first: a missing page would read clean either way.
    ram.write(0, &[1]).map_err(err)?;
    ram.write(PAGE_SIZE, &[1]).map_err(err)?;
    let me = Mapping {
        pid: std::process::id() as i32,
        start: ram.host_addr(),
        size: 2 * PAGE_SIZE,
        name: "soft-dirty self-test".into(),
    };
    let bits = |m: &Mapping| -> Result<[bool; 2], String> {
        let w = m.read_soft_dirty()?;
        Ok([w[0] & 1 != 0, w[0] & 2 != 0])
    };
    me.clear_soft_dirty()?;
    let cleared = bits(&me)?;
    ram.write(PAGE_SIZE, &[2]).map_err(err)?;
    let written = bits(&me)?;
    SelfTest { cleared, written }.verdict()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
7f0000000000-7f0010000000 rw-s 00000000 00:1d 42                         /tmp/vm.ram
Size:             262144 kB
KernelPageSize:        4 kB
MMUPageSize:           4 kB
Locked:           262144 kB
VmFlags: rd wr sh mr mw me ms lo sd
7f0010000000-7f0020000000 rw-s 00000000 00:1e 43                         /dev/hugepages/vm.ram
Size:             262144 kB
KernelPageSize:     2048 kB
VmFlags: rd wr sh mr mw me ms de ht sd
7f0020000000-7f0030000000 rw-s 00000000 00:1d 44                         /tmp/other.ram
KernelPageSize:        4 kB
VmFlags: rd wr sh mr mw me ms sd
";

    #[test]
    fn locked_small_pages_pass_and_the_rest_is_refused_saying_why() {
        let locked = ram_vma(SMAPS, 0x7f00_0000_0000).unwrap();
        assert_eq!(locked.page_kib, 4);
        assert_eq!(locked.refusal(), None);
        let huge = ram_vma(SMAPS, 0x7f00_1000_0000).unwrap().refusal().unwrap();
        assert!(huge.contains("2048 KiB huge pages (hugetlbfs)"), "{huge}");
        let unlocked = ram_vma(SMAPS, 0x7f00_2000_0000).unwrap().refusal().unwrap();
        assert!(
            unlocked.contains("not locked") && unlocked.contains("mem-lock=on"),
            "{unlocked}"
        );
        assert!(ram_vma(SMAPS, 0x1000)
            .unwrap_err()
            .contains("no mapping at 0x1000"));
    }

    #[test]
    fn maps_lines_are_matched_by_device_and_inode() {
        let line = "7f0000000000-7f0010000000 rw-s 00000000 00:1d 42    /tmp/vm.ram";
        assert!(maps_line_is(line, (0, 0x1d), 42));
        assert!(!maps_line_is(line, (0, 0x1d), 4));
        assert!(!maps_line_is(line, (0, 0x1e), 42));
        assert!(maps_line_is("a-b r--p 0 103:2 7", (0x103, 2), 7));
        assert!(!maps_line_is("garbage", (0, 0), 0));
    }

    #[test]
    fn the_self_test_passes_only_a_kernel_that_saw_exactly_the_write() {
        let good = SelfTest {
            cleared: [false, false],
            written: [false, true],
        };
        assert_eq!(good.verdict(), Ok(()));
        // A kernel without CONFIG_MEM_SOFT_DIRTY: every bit reads 0.
        let none = SelfTest {
            written: [false, false],
            ..good
        };
        assert!(none
            .verdict()
            .unwrap_err()
            .contains("CONFIG_MEM_SOFT_DIRTY"));
        let stuck = SelfTest {
            cleared: [true, true],
            written: [true, true],
        };
        assert!(stuck.verdict().unwrap_err().contains("does not clear"));
        let noisy = SelfTest {
            written: [true, true],
            ..good
        };
        assert!(noisy.verdict().unwrap_err().contains("nobody wrote"));
    }

    #[test]
    fn this_kernel_passes_the_self_test_or_says_why_not() {
        // This machine's kernel may lack soft-dirty bits (Debian's has
        // them on x86-64; the test hosts' does): either way the answer is
        // a verdict, never a panic, and a refusal names what is missing.
        if let Err(e) = self_test() {
            assert!(e.contains("soft-dirty") || e.contains("clear_refs"), "{e}");
        }
    }
}
