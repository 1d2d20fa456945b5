//! The backup's replicas of a protected VM's disks: one raw file per
//! disk, `DIR/ID.raw` (ID the disk's device id), which the standby QEMU
//! opens at takeover.
//!
//! A replica always holds the disk as it was at the last acknowledged
//! epoch. An epoch's disk data (DISK_DATA) is staged in a file beside the
//! replicas as it arrives and written into them only at its EPOCH_END,
//! then synced (`fdatasync`) before the epoch is acknowledged: an epoch
//! cut off part-way leaves the replicas untouched, and no output the
//! primary releases depends on disk state a crash here could lose. While
//! the backup holds no checkpoint at all (a pairing's first
//! synchronisation), data goes straight into the replicas: there is
//! nothing to keep, and a disk-sized staging file is saved.
//!
//! An I/O error while writing the replicas at EPOCH_END leaves them part
//! old, part new: the caller drops the checkpoint rather than take over
//! onto such a disk.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use std::collections::BTreeSet;

use crate::wire::{
    disk_chunk_sum, zero_chunk_sum, DiskExtent, DiskInfo, DISK_DATA_MAX, MAX_PAYLOAD,
};

/// What an offset and length of disk data must be a multiple of (except
/// at the disk's end).
const SECTOR: u64 = 512;

/// A disk's replica file in `dir`.
pub fn replica_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.raw"))
}

/// The marker a protecting primary leaves beside each disk image it
/// protects (`IMAGE.hag-primary`): a backup that finds one beside a replica
/// is looking at the primary's own image, on storage both hosts share.
pub fn primary_marker(image: &Path) -> PathBuf {
    let mut name = image.as_os_str().to_owned();
    name.push(".hag-primary");
    PathBuf::from(name)
}

/// Why the replica at `path` must not be used: it is a protected
/// primary's own disk image (its marker is there).
pub fn shared_refusal(id: &str, path: &Path) -> Option<String> {
    let marker = primary_marker(path);
    let says = std::fs::read_to_string(&marker).ok()?;
    Some(format!(
        "disk {id}'s replica {} is the primary's own disk image ({} says: {}): \
         the backup must keep a replica of its own, on storage the primary does not use (--replica-dir)",
        path.display(),
        marker.display(),
        says.trim()
    ))
}

/// The files a QEMU command line names in `file=`, `filename=` or
/// `file.filename=` options.
fn named_files(command: &[String]) -> impl Iterator<Item = &str> {
    command.iter().flat_map(|a| {
        a.split(',').filter_map(|opt| {
            opt.strip_prefix("file=")
                .or_else(|| opt.strip_prefix("filename="))
                .or_else(|| opt.strip_prefix("file.filename="))
        })
    })
}

/// Makes, empty, the replicas in `dir` that the standby QEMU command line
/// names and that do not exist yet, so that it starts (a dry run) before
/// a primary has named its disks; their first synchronisation sizes them.
pub fn create_named(command: &[String], dir: &Path) -> Result<(), String> {
    for name in named_files(command) {
        let path = Path::new(name);
        if path.parent() != Some(dir) || !name.ends_with(".raw") {
            continue;
        }
        let id = name
            .rsplit('/')
            .next()
            .unwrap_or(name)
            .trim_end_matches(".raw");
        if let Some(why) = shared_refusal(id, path) {
            return Err(why);
        }
        if !path.exists() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            File::create(path).map_err(|e| format!("{name}: {e}"))?;
        }
    }
    Ok(())
}

/// Why the standby QEMU command line `command` would not run the VM on
/// the replica at `path` (it must name it, in a `file=`/`filename=`
/// option, as a raw image).
pub fn standby_refusal(command: &[String], id: &str, path: &Path) -> Option<String> {
    let path = path.to_string_lossy();
    let named = named_files(command).any(|f| f == path);
    (!named).then(|| {
        format!(
            "the standby QEMU would not open disk {id}'s replica: its command line must name {path} \
             as a raw image (-blockdev driver=file,filename={path},node-name=… \
             -blockdev driver=raw,file=…; or -drive file={path},format=raw,…), with the device id {id}"
        )
    })
}

#[derive(Debug)]
struct Replica {
    info: DiskInfo,
    path: PathBuf,
    file: File,
    /// Written since the last sync.
    dirty: bool,
    /// The sum of each chunk ([`disk_chunk_sum`]), once computed.
    sums: Option<Vec<[u8; 32]>>,
    /// Chunks written since their sum was computed.
    stale: BTreeSet<u64>,
}

/// An extent of the epoch in progress.
#[derive(Debug)]
struct Staged {
    disk: usize,
    offset: u64,
    len: u64,
    /// Where its bytes are in the staging file (`None`: zeroes).
    at: Option<u64>,
}

/// What [`Replicas::commit`] wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Committed {
    /// Bytes of data written.
    pub data: u64,
    /// Bytes zeroed.
    pub zero: u64,
}

/// The replicas of one VM's disks, and the epoch being staged.
#[derive(Debug)]
pub struct Replicas {
    dir: PathBuf,
    disks: Vec<Replica>,
    staged: Vec<Staged>,
    /// The staging file (made at the first staged data, unlinked).
    staging: Option<File>,
    staged_bytes: u64,
    /// Written straight in since the last commit.
    direct: Committed,
}

impl Replicas {
    /// Opens (or makes, sparse) the replicas of `disks` in `dir`. A
    /// replica of another size is refused unless `fresh` (no checkpoint
    /// depends on it), when it is resized.
    pub fn open(dir: &Path, disks: &[DiskInfo], fresh: bool) -> Result<Replicas, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mut out = Vec::with_capacity(disks.len());
        for info in disks {
            let path = replica_path(dir, &info.id);
            let io =
                |e: std::io::Error| format!("disk {}'s replica {}: {e}", info.id, path.display());
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(io)?;
            let len = file.metadata().map_err(io)?.len();
            if len != info.size {
                if !fresh {
                    return Err(format!(
                        "disk {}'s replica {} holds {len} bytes, the primary's disk {}: the checkpoint's disk changed size",
                        info.id,
                        path.display(),
                        info.size
                    ));
                }
                file.set_len(info.size).map_err(io)?;
            }
            out.push(Replica {
                info: info.clone(),
                path,
                file,
                dirty: false,
                sums: None,
                stale: BTreeSet::new(),
            });
        }
        Ok(Replicas {
            dir: dir.to_owned(),
            disks: out,
            staged: Vec::new(),
            staging: None,
            staged_bytes: 0,
            direct: Committed::default(),
        })
    }

    /// Whether these replicas are of `disks` (ids and sizes, in order).
    pub fn matches(&self, disks: &[DiskInfo]) -> bool {
        self.disks.len() == disks.len() && self.disks.iter().zip(disks).all(|(r, d)| r.info == *d)
    }

    fn check(&self, disk: u32, offset: u64, len: u64) -> Result<usize, String> {
        let i = disk as usize;
        let r = self.disks.get(i).ok_or_else(|| {
            format!(
                "disk data for disk {disk}, the session named {}",
                self.disks.len()
            )
        })?;
        let size = r.info.size;
        let end = offset.checked_add(len).filter(|&e| e <= size);
        let aligned = offset % SECTOR == 0 && (len % SECTOR == 0 || end == Some(size));
        if len == 0 || end.is_none() || !aligned {
            return Err(format!(
                "disk {}: {len} bytes at {offset} do not fit its {size} bytes in whole sectors",
                r.info.id
            ));
        }
        Ok(i)
    }

    /// Writes an extent into its replica now (no checkpoint to keep).
    pub fn write_direct(
        &mut self,
        disk: u32,
        offset: u64,
        extent: &DiskExtent,
    ) -> Result<(), String> {
        let i = self.check(disk, offset, extent.bytes())?;
        let r = &mut self.disks[i];
        put(r, offset, extent)?;
        match extent {
            DiskExtent::Data(b) => self.direct.data += b.len() as u64,
            DiskExtent::Zero(n) => self.direct.zero += n,
        }
        Ok(())
    }

    /// Stages an extent for the epoch in progress. The staging file holds
    /// at most the disks' size twice over (an epoch rewrites each block
    /// at most once; a resynchronisation's full copy and its first epoch
    /// can both be staged).
    pub fn stage(&mut self, disk: u32, offset: u64, extent: DiskExtent) -> Result<(), String> {
        let i = self.check(disk, offset, extent.bytes())?;
        let cap = self.disks.iter().map(|r| r.info.size).sum::<u64>() * 2;
        let at = match &extent {
            DiskExtent::Zero(_) => None,
            DiskExtent::Data(b) => {
                if self.staged_bytes + b.len() as u64 > cap {
                    return Err(format!(
                        "over {cap} bytes of disk data staged in one epoch, twice the disks' size"
                    ));
                }
                let f = match &mut self.staging {
                    Some(f) => f,
                    none => none.insert(staging_file(&self.dir)?),
                };
                f.write_all_at(b, self.staged_bytes)
                    .map_err(|e| format!("staging disk data in {}: {e}", self.dir.display()))?;
                let at = self.staged_bytes;
                self.staged_bytes += b.len() as u64;
                Some(at)
            }
        };
        self.staged.push(Staged {
            disk: i,
            offset,
            len: extent.bytes(),
            at,
        });
        Ok(())
    }

    /// The epoch ends: what it staged goes into the replicas, in arrival
    /// order, and every replica written is synced. An error leaves the
    /// replicas in no known state (see the module docs).
    pub fn commit(&mut self) -> Result<Committed, String> {
        let mut done = std::mem::take(&mut self.direct);
        let staged = std::mem::take(&mut self.staged);
        let mut buf = Vec::new();
        for s in &staged {
            let extent = match s.at {
                None => DiskExtent::Zero(s.len),
                Some(at) => {
                    let f = self
                        .staging
                        .as_ref()
                        .ok_or("staged data without a staging file")?;
                    buf.resize(s.len as usize, 0);
                    f.read_exact_at(&mut buf, at)
                        .map_err(|e| format!("reading staged disk data: {e}"))?;
                    DiskExtent::Data(std::mem::take(&mut buf))
                }
            };
            put(&mut self.disks[s.disk], s.offset, &extent)?;
            match extent {
                DiskExtent::Data(b) => {
                    done.data += b.len() as u64;
                    buf = b;
                }
                DiskExtent::Zero(n) => done.zero += n,
            }
        }
        for r in &mut self.disks {
            if r.dirty {
                r.file
                    .sync_data()
                    .map_err(|e| format!("syncing {}: {e}", r.path.display()))?;
                r.dirty = false;
            }
        }
        self.drop_staged();
        Ok(done)
    }

    /// What each replica holds, as a sum per [`DISK_DATA_MAX`]-byte chunk,
    /// for DISK_SUMS: computed once by reading the replica, then kept up
    /// to date for the chunks epochs write. A replica whose sums would
    /// not fit in one message gets none (its first copy is sent whole).
    pub fn sums(&mut self) -> Result<Vec<Vec<[u8; 32]>>, String> {
        let mut room = MAX_PAYLOAD as usize / 2;
        let mut out = Vec::with_capacity(self.disks.len());
        for r in &mut self.disks {
            let chunks = r.info.size.div_ceil(DISK_DATA_MAX as u64);
            let bytes = chunks as usize * 32;
            if bytes > room {
                out.push(Vec::new());
                continue;
            }
            room -= bytes;
            let todo: Vec<u64> = match &r.sums {
                None => (0..chunks).collect(),
                Some(_) => std::mem::take(&mut r.stale).into_iter().collect(),
            };
            let sums = r.sums.get_or_insert_with(|| vec![[0; 32]; chunks as usize]);
            let mut buf = vec![0u8; DISK_DATA_MAX];
            for k in todo {
                let at = k * DISK_DATA_MAX as u64;
                let n = (r.info.size - at).min(DISK_DATA_MAX as u64) as usize;
                // A replica is mostly holes (a 2 GiB disk with 400 MiB on
                // it): a whole chunk in one is not read.
                if n == DISK_DATA_MAX && in_hole(&r.file, at, n as u64) {
                    sums[k as usize] = zero_chunk_sum();
                    continue;
                }
                r.file
                    .read_exact_at(&mut buf[..n], at)
                    .map_err(|e| format!("reading {}: {e}", r.path.display()))?;
                sums[k as usize] = disk_chunk_sum(&buf[..n]);
            }
            r.stale.clear();
            out.push(sums.clone());
        }
        Ok(out)
    }

    /// Forgets the epoch in progress (its stream was cut off).
    pub fn drop_staged(&mut self) {
        self.staged.clear();
        self.staged_bytes = 0;
        if let Some(f) = &self.staging {
            let _ = f.set_len(0);
        }
    }
}

/// `len` bytes at `offset` of `file` are all in a hole (no data there:
/// they read as zeroes). False where the filesystem cannot say.
fn in_hole(file: &File, offset: u64, len: u64) -> bool {
    use nix::unistd::{lseek, Whence};
    let Ok(at) = i64::try_from(offset) else {
        return false;
    };
    match lseek(file, at, Whence::SeekData) {
        Ok(data) => data as u64 >= offset + len,
        // Past the last data.
        Err(nix::errno::Errno::ENXIO) => true,
        Err(_) => false,
    }
}

/// Puts an extent into a replica: data written, zeroes as a hole.
fn put(r: &mut Replica, offset: u64, extent: &DiskExtent) -> Result<(), String> {
    let io = |e: std::io::Error| {
        format!(
            "writing disk {}'s replica {}: {e}",
            r.info.id,
            r.path.display()
        )
    };
    match extent {
        DiskExtent::Data(b) => r.file.write_all_at(b, offset).map_err(io)?,
        DiskExtent::Zero(n) => zero(&r.file, offset, *n).map_err(io)?,
    }
    r.dirty = true;
    if r.sums.is_some() {
        let chunk = DISK_DATA_MAX as u64;
        r.stale
            .extend(offset / chunk..(offset + extent.bytes()).div_ceil(chunk));
    }
    Ok(())
}

/// Zeroes a range: a hole where the filesystem can punch one, else
/// written zeroes.
fn zero(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
    use nix::fcntl::{fallocate, FallocateFlags};
    let punch = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
    let (Ok(o), Ok(l)) = (i64::try_from(offset), i64::try_from(len)) else {
        return Err(std::io::ErrorKind::InvalidInput.into());
    };
    if fallocate(file, punch, o, l).is_ok() {
        return Ok(());
    }
    let zeroes = vec![0u8; 1 << 20];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(zeroes.len() as u64) as usize;
        file.write_all_at(&zeroes[..n], offset + done)?;
        done += n as u64;
    }
    Ok(())
}

/// An unlinked file in `dir` for staged data.
fn staging_file(dir: &Path) -> Result<File, String> {
    let path = dir.join(format!(".staging-{}", std::process::id()));
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let _ = std::fs::remove_file(&path);
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hag-replica-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn disk(id: &str, size: u64) -> DiskInfo {
        DiskInfo {
            id: id.into(),
            size,
        }
    }

    fn read(dir: &Path, id: &str, at: u64, n: usize) -> Vec<u8> {
        let f = File::open(replica_path(dir, id)).unwrap();
        let mut b = vec![0; n];
        f.read_exact_at(&mut b, at).unwrap();
        b
    }

    #[test]
    fn staged_data_reaches_the_replica_only_at_commit() {
        let d = dir("stage");
        let mut r = Replicas::open(&d, &[disk("vda", 1 << 20)], true).unwrap();
        r.write_direct(0, 0, &DiskExtent::Data(vec![1; 4096]))
            .unwrap();
        assert_eq!(
            r.commit().unwrap(),
            Committed {
                data: 4096,
                zero: 0
            }
        );
        r.stage(0, 0, DiskExtent::Data(vec![2; 512])).unwrap();
        r.stage(0, 4096, DiskExtent::Data(vec![3; 512])).unwrap();
        assert_eq!(read(&d, "vda", 0, 1), [1]);
        // Cut off: nothing of it stays.
        r.drop_staged();
        r.stage(0, 512, DiskExtent::Zero(512)).unwrap();
        r.stage(0, 0, DiskExtent::Data(vec![4; 512])).unwrap();
        // Later data for the same range wins.
        r.stage(0, 0, DiskExtent::Data(vec![5; 512])).unwrap();
        assert_eq!(
            r.commit().unwrap(),
            Committed {
                data: 1024,
                zero: 512
            }
        );
        assert_eq!(read(&d, "vda", 0, 1), [5]);
        assert_eq!(read(&d, "vda", 512, 512), vec![0; 512]);
        assert_eq!(read(&d, "vda", 1024, 1), [1]);
        assert_eq!(read(&d, "vda", 4096, 1), [0]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn sums_follow_what_the_replica_holds() {
        let d = dir("sums");
        let size = 2 * DISK_DATA_MAX as u64 + 4096;
        let mut r = Replicas::open(&d, &[disk("vda", size)], true).unwrap();
        let zero = disk_chunk_sum(&vec![0; DISK_DATA_MAX]);
        let tail = disk_chunk_sum(&[0; 4096]);
        assert_eq!(r.sums().unwrap(), vec![vec![zero, zero, tail]]);
        r.stage(0, DISK_DATA_MAX as u64, DiskExtent::Data(vec![7; 512]))
            .unwrap();
        // Staged is not held yet.
        assert_eq!(r.sums().unwrap()[0][1], zero);
        r.commit().unwrap();
        let mut want = vec![0u8; DISK_DATA_MAX];
        want[..512].fill(7);
        assert_eq!(
            r.sums().unwrap(),
            vec![vec![zero, disk_chunk_sum(&want), tail]]
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn extents_outside_the_disk_are_refused() {
        let d = dir("bounds");
        let mut r = Replicas::open(&d, &[disk("vda", 8192 + 100)], true).unwrap();
        for (disk, at, len) in [
            (1, 0, 512),
            (0, 8192, 512),
            (0, 100, 512),
            (0, 0, 100),
            (0, u64::MAX - 10, 512),
        ] {
            let e = r.stage(disk, at, DiskExtent::Zero(len)).unwrap_err();
            assert!(e.contains("disk"), "{e}");
        }
        // The disk's last partial sector is whole at its end.
        r.stage(0, 8192, DiskExtent::Data(vec![9; 100])).unwrap();
        r.commit().unwrap();
        assert_eq!(read(&d, "vda", 8192, 100), vec![9; 100]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_replica_of_another_size_is_kept_unless_fresh() {
        let d = dir("size");
        Replicas::open(&d, &[disk("vda", 4096)], true).unwrap();
        let e = Replicas::open(&d, &[disk("vda", 8192)], false)
            .err()
            .unwrap();
        assert!(e.contains("changed size"), "{e}");
        let r = Replicas::open(&d, &[disk("vda", 8192)], true).unwrap();
        assert!(r.matches(&[disk("vda", 8192)]) && !r.matches(&[disk("vdb", 8192)]));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_replica_beside_a_primary_marker_is_refused() {
        let d = dir("marker");
        std::fs::create_dir_all(&d).unwrap();
        let vda = replica_path(&d, "vda");
        let cmd = vec![
            "-drive".to_owned(),
            format!("file={},format=raw", vda.display()),
        ];
        create_named(&cmd, &d).unwrap();
        assert!(vda.exists() && shared_refusal("vda", &vda).is_none());
        std::fs::write(primary_marker(&vda), "hagctl checkpoint on host0\n").unwrap();
        let e = create_named(&cmd, &d).unwrap_err();
        assert!(
            e.contains("disk vda's replica") && e.contains("on host0"),
            "{e}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_standby_command_line_must_open_each_replica() {
        let p = Path::new("/var/lib/hag/replicas/vda.raw");
        let words = |s: &str| s.split(' ').map(str::to_owned).collect::<Vec<_>>();
        let ok = words("qemu -blockdev driver=file,filename=/var/lib/hag/replicas/vda.raw,node-name=f0 -blockdev driver=raw,file=f0,node-name=d0");
        assert_eq!(standby_refusal(&ok, "vda", p), None);
        let drive =
            words("qemu -drive file=/var/lib/hag/replicas/vda.raw,format=raw,if=none,id=d0");
        assert_eq!(standby_refusal(&drive, "vda", p), None);
        let other = words("qemu -drive file=/srv/vm/disk.qcow2,format=qcow2");
        let e = standby_refusal(&other, "vda", p).unwrap();
        assert!(
            e.contains("disk vda") && e.contains("/var/lib/hag/replicas/vda.raw"),
            "{e}"
        );
    }
}
