//! The guest's disk workload (`--disk DEV`): numbered records written one
//! after another to a block device, each written past the page cache
//! (`O_DIRECT`) and synced (`fdatasync`) before it counts: a database's
//! commit, in small. The count lives in guest memory, so a guest resumed
//! from a checkpoint on another host counts exactly the records of that
//! checkpoint, and every one of them must be on the disk it resumed with,
//! intact: a disk older than the memory misses some, and the check at the
//! end says which.
//!
//! Record `i` (from 1) fills the 4 KiB block at `i × 4 KiB`: a magic, `i`,
//! the run's random id, then bytes derived from both, so that a block of
//! an earlier run, of another record or torn part-way does not verify.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{bail, Context};

/// Bytes per record (and the alignment `O_DIRECT` needs).
pub const RECORD: usize = 4096;
const MAGIC: &[u8; 8] = b"HAGDISK1";
/// The size of a record file `--disk` makes.
pub const NEW_FILE_BYTES: u64 = 64 << 20;
/// Between two records: the writer commits about this often.
const PACE: Duration = Duration::from_millis(10);

#[repr(C, align(4096))]
struct Block([u8; RECORD]);

/// Record `index` of run `run`.
fn record(run: u64, index: u64) -> Block {
    let mut b = Block([0; RECORD]);
    b.0[..8].copy_from_slice(MAGIC);
    b.0[8..16].copy_from_slice(&index.to_le_bytes());
    b.0[16..24].copy_from_slice(&run.to_le_bytes());
    let mut x = run ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in b.0[24..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    b
}

/// The disk workload, running in a thread of its own.
pub struct DiskLog {
    file: Arc<File>,
    run: u64,
    committed: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<anyhow::Result<()>>>,
}

impl DiskLog {
    /// Starts writing records to the block device or file at `path`; a
    /// missing file is made, [`NEW_FILE_BYTES`] long (sparse: a record's
    /// block is allocated by its write, as a database's files grow).
    pub fn start(path: &Path) -> anyhow::Result<DiskLog> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(nix::libc::O_DIRECT)
            .open(path)
            .with_context(|| format!("--disk {}", path.display()))?;
        if file.metadata()?.is_file() && file.metadata()?.len() == 0 {
            file.set_len(NEW_FILE_BYTES)
                .with_context(|| format!("--disk {}: sizing it", path.display()))?;
        }
        let size = nix::unistd::lseek(&file, 0, nix::unistd::Whence::SeekEnd)
            .with_context(|| format!("--disk {}: its size", path.display()))?;
        let capacity = u64::try_from(size).unwrap_or(0) / RECORD as u64;
        if capacity < 2 {
            bail!("--disk {}: {size} bytes hold no record", path.display());
        }
        let mut seed = [0u8; 8];
        File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut seed))
            .context("/dev/urandom")?;
        let file = Arc::new(file);
        let committed = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let run = u64::from_le_bytes(seed);
        let thread = {
            let (file, committed, stop) = (file.clone(), committed.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut index = 1;
                while !stop.load(Ordering::Relaxed) && index < capacity {
                    let b = record(run, index);
                    file.write_all_at(&b.0, index * RECORD as u64)
                        .with_context(|| format!("writing disk record {index}"))?;
                    file.sync_data()
                        .with_context(|| format!("syncing disk record {index}"))?;
                    committed.store(index, Ordering::SeqCst);
                    index += 1;
                    std::thread::sleep(PACE);
                }
                Ok(())
            })
        };
        Ok(DiskLog {
            file,
            run,
            committed,
            stop,
            thread: Some(thread),
        })
    }

    /// Records committed so far.
    pub fn committed(&self) -> u64 {
        self.committed.load(Ordering::SeqCst)
    }

    /// Stops the writer and reads every committed record back; returns
    /// how many there were and what was wrong (empty: all intact).
    pub fn finish(mut self) -> anyhow::Result<(u64, Vec<String>)> {
        self.stop.store(true, Ordering::Relaxed);
        let mut failures = Vec::new();
        if let Some(t) = self.thread.take() {
            match t.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => failures.push(format!("disk: {e:#}")),
                Err(_) => failures.push("disk: the writer panicked".into()),
            }
        }
        let n = self.committed();
        let mut bad = Vec::new();
        let mut got = Block([0; RECORD]);
        for index in 1..=n {
            self.file
                .read_exact_at(&mut got.0, index * RECORD as u64)
                .with_context(|| format!("reading disk record {index}"))?;
            if got.0 != record(self.run, index).0 {
                bad.push(index);
            }
        }
        if let Some(&first) = bad.first() {
            let what = if got_magic(&self.file, first) {
                "holds other bytes"
            } else {
                "is missing"
            };
            failures.push(format!(
                "disk: {} of {n} committed records missing or wrong (first: record {first} {what}, last: {})",
                bad.len(),
                bad.last().copied().unwrap_or(first)
            ));
        }
        Ok((n, failures))
    }
}

/// Whether the block of record `index` starts with the magic.
fn got_magic(file: &File, index: u64) -> bool {
    let mut b = Block([0; RECORD]);
    file.read_exact_at(&mut b.0, index * RECORD as u64).is_ok() && b.0[..8] == *MAGIC
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_differ_by_index_and_run() {
        let a = record(7, 1);
        assert_eq!(&a.0[..8], MAGIC);
        assert_ne!(a.0, record(7, 2).0);
        assert_ne!(a.0, record(8, 1).0);
        assert_eq!(a.0, record(7, 1).0);
    }
}
