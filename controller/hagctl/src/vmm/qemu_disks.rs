//! A protected QEMU VM's writable disks, captured at each epoch's pause as
//! a point-in-time delta with QEMU's own incremental-backup machinery
//! (docs/interop/bitmaps.rst), and read after the VM resumes.
//!
//! Each disk carries dirty bitmaps named `hag-eN`: the one added at
//! capture `N` records the guest's writes from that pause on. A capture,
//! with the VM paused, is one QMP `transaction`: add `hag-eN` (active),
//! disable the previous one, merge every bitmap not yet covered by an
//! acknowledged epoch into a temporary `hag-xN`, and start a
//! `blockdev-backup` job (`sync=bitmap`, `bitmap-mode=never`) of exactly
//! those clusters into a fresh qcow2 file. A backup job copies a cluster
//! out before the guest overwrites it, so the file ends holding the
//! clusters as they were at the pause, whatever the guest writes after
//! it resumes: the pause grows by the metadata step, never by the delta's
//! size. Once the job has concluded, `qemu-img map` of the file lists
//! the clusters it holds (data at a file offset, or zero) and hagctl reads
//! them from the file itself.
//!
//! The capture comes after the epoch's device-state save, which (being a
//! migration) inactivates every block node at its end: hagctl activates
//! them again (`blockdev-set-active`) while the VM is still paused, so the
//! disks are captured exactly as the saved state left them.
//!
//! A capture that is never acknowledged leaves its bitmaps in place, so
//! the next one merges them again: nothing written between two
//! acknowledged epochs is left out. The first capture of a session is a
//! full one (`sync=full`, taken while the VM runs: the bitmap that starts
//! with it catches every later write), so a backup that holds nothing of
//! the disk receives all of it.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::qmp::{Qmp, QmpError};
use crate::wire::{is_disk_id, DiskExtent as Extent, DISK_DATA_MAX as EXTENT_MAX, DISK_ID_MAX};

/// A writable disk of the VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Disk {
    /// Its device's id (`vda`; libvirt's `virtio-disk0`): what names its
    /// replica on the backup.
    pub id: String,
    /// The block node its device writes (QEMU's `node-name`).
    pub node: String,
    /// Its virtual size, bytes.
    pub size: u64,
    /// The image file its writes go to, where QEMU names one.
    pub image: Option<PathBuf>,
}

/// Device types whose writes never pass through QEMU's block layer, so
/// no dirty bitmap sees them, and why.
const UNTRACKED: &[(&str, &str)] = &[
    ("vhost-user-blk", "a vhost-user back end writes its disk"),
    ("vhost-user-scsi", "a vhost-user back end writes its disks"),
    (
        "vhost-scsi",
        "the host kernel's vhost-scsi writes its disks",
    ),
    (
        "scsi-generic",
        "SCSI commands pass through to a host device",
    ),
    ("scsi-block", "SCSI commands pass through to a host device"),
];

/// The VM's devices, `(id or QOM path, QOM type)`, from `qom-list` of
/// `/machine/peripheral` and `/machine/peripheral-anon`.
pub fn devices(qmp: &mut Qmp) -> Result<Vec<(String, String)>, String> {
    let mut devices = Vec::new();
    for base in ["/machine/peripheral", "/machine/peripheral-anon"] {
        let list = qmp
            .execute("qom-list", Some(json!({ "path": base })))
            .map_err(|e| format!("qom-list {base}: {e}"))?;
        for child in list.as_array().into_iter().flatten() {
            let name = child.get("name").and_then(Value::as_str).unwrap_or("?");
            let ty = child.get("type").and_then(Value::as_str).unwrap_or("");
            if let Some(ty) = ty.strip_prefix("child<").and_then(|t| t.strip_suffix('>')) {
                devices.push((name.to_owned(), ty.to_owned()));
            }
        }
    }
    Ok(devices)
}

/// The devices among `devices` (`(id or QOM path, QOM type)`) whose disk
/// writes hagctl cannot see, each as a sentence naming it and saying it
/// cannot be `done` ("protected", "mirrored").
pub fn untracked(devices: &[(String, String)], done: &str) -> Vec<String> {
    devices
        .iter()
        .filter_map(|(name, ty)| {
            let (_, why) = UNTRACKED.iter().find(|(k, _)| ty.starts_with(k))?;
            Some(format!(
                "disk device {name} ({ty}) cannot be {done}: {why}, unseen by QEMU's dirty bitmaps \
                 (use a virtio-blk, virtio-scsi or IDE/AHCI device on a QEMU block node)"
            ))
        })
        .collect()
}

/// The writable disks in `query-block`'s answer. Read-only disks and
/// empty drives (a CD-ROM) need nothing; a writable disk whose device has
/// no id cannot be named to the backup and is refused, as is one QEMU
/// reports without a node name or a size.
pub fn writable_disks(query_block: &Value) -> Result<Vec<Disk>, String> {
    let list = query_block
        .as_array()
        .ok_or_else(|| format!("query-block returned {query_block}"))?;
    let mut disks = Vec::new();
    for entry in list {
        let Some(inserted) = entry.get("inserted") else {
            continue;
        };
        if inserted.get("ro").and_then(Value::as_bool) == Some(true) {
            continue;
        }
        let qdev = entry.get("qdev").and_then(Value::as_str).unwrap_or("");
        let drive = entry.get("device").and_then(Value::as_str).unwrap_or("");
        if qdev.is_empty() {
            // A drive no device uses: the guest cannot write it.
            continue;
        }
        let id = device_id(qdev).ok_or_else(|| {
            format!(
                "the writable disk of device {qdev} has no device id: give it one (-device …,id=NAME; \
                 libvirt names its disks) so that the backup can name its replica"
            )
        })?;
        if !is_disk_id(id) {
            return Err(format!(
                "disk device id '{id}' cannot name a replica (at most {DISK_ID_MAX} of A-Z a-z 0-9 . _ -)"
            ));
        }
        let node = inserted
            .get("node-name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| format!("disk {id}: QEMU names no block node for it"))?;
        let size = inserted
            .pointer("/image/virtual-size")
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("disk {id}: QEMU reports no virtual size"))?;
        if disks.iter().any(|d: &Disk| d.id == id) {
            return Err(format!("two writable disks with device id {id} ({drive})"));
        }
        let image = inserted
            .pointer("/image/filename")
            .and_then(Value::as_str)
            .filter(|f| f.starts_with('/'))
            .map(PathBuf::from);
        disks.push(Disk {
            id: id.to_owned(),
            node: node.to_owned(),
            size,
            image,
        });
    }
    Ok(disks)
}

/// The device id in a QOM path: `/machine/peripheral/ID` or one of its
/// children (`/machine/peripheral/ID/virtio-backend`); an anonymous
/// device (`/machine/peripheral-anon/…`) has none.
fn device_id(qdev: &str) -> Option<&str> {
    let rest = match qdev.strip_prefix("/machine/peripheral/") {
        Some(rest) => rest,
        // QEMU gives a bare id for some devices.
        None if !qdev.starts_with('/') => qdev,
        None => return None,
    };
    rest.split('/').next().filter(|s| !s.is_empty())
}

/// A cluster range of a delta file, as `qemu-img map` lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapped {
    /// Guest offset.
    pub start: u64,
    /// Bytes.
    pub length: u64,
    /// Where its data is in the file (`None`: it reads as zeroes).
    pub file_offset: Option<u64>,
}

/// The ranges a delta file holds, from `qemu-img map --output=json`: the
/// present ones (a full capture also names the absent ones, as zeroes:
/// it states the whole disk). Refuses a map that does not cover `size`
/// in order, or data hagctl cannot read from the file (compressed).
pub fn parse_map(map: &Value, size: u64, full: bool) -> Result<Vec<Mapped>, String> {
    let list = map
        .as_array()
        .ok_or_else(|| "qemu-img map did not print a list".to_owned())?;
    let mut at = 0u64;
    let mut out: Vec<Mapped> = Vec::new();
    for e in list {
        let num = |k: &str| {
            e.get(k)
                .and_then(Value::as_u64)
                .ok_or_else(|| format!("qemu-img map: an entry without {k}: {e}"))
        };
        let flag = |k: &str| e.get(k).and_then(Value::as_bool);
        let (start, length) = (num("start")?, num("length")?);
        if start != at || length == 0 || start.checked_add(length).is_none_or(|end| end > size) {
            return Err(format!(
                "qemu-img map: a range at {start}+{length} where {at} was due (disk of {size} bytes)"
            ));
        }
        at = start + length;
        let present = flag("present")
            .ok_or_else(|| format!("qemu-img map does not say what is present (too old?): {e}"))?;
        if flag("compressed") == Some(true) {
            return Err(format!("qemu-img map: compressed clusters at {start}"));
        }
        let file_offset = if flag("data") == Some(true) && flag("zero") != Some(true) {
            Some(num("offset")?)
        } else {
            None
        };
        if present || full {
            out.push(Mapped {
                start,
                length,
                file_offset: if present { file_offset } else { None },
            });
        }
    }
    if at != size {
        return Err(format!(
            "qemu-img map covers {at} of the disk's {size} bytes"
        ));
    }
    Ok(out)
}

/// The captures of one VM's disks (see the module docs).
pub struct DiskEpochs {
    disks: Vec<Disk>,
    /// Where the delta files go.
    dir: PathBuf,
    /// Bitmap numbers not yet covered by an acknowledged capture, oldest
    /// first; the last is the active one.
    live: Vec<u64>,
    /// The next bitmap number.
    seq: u64,
    /// The capture whose jobs run or whose files wait to be read.
    pending: Option<Capture>,
    /// Delta files made ready for the next capture.
    ready: Option<u64>,
    /// Read and not yet acknowledged: the bitmaps it covered.
    read: Option<Vec<u64>>,
    /// The next capture must be a full one: no full capture was read
    /// since the session began.
    needs_full: bool,
    /// The markers left beside the disks' images.
    markers: Vec<PathBuf>,
    /// What the backup's replicas hold (DISK_SUMS), for the next full copy.
    held: Vec<Vec<[u8; 32]>>,
    /// For tests: epochs' deltas are read but never sent (a session's
    /// full copy still is).
    pub withheld: bool,
}

struct Capture {
    seq: u64,
    full: bool,
    /// The bitmaps it merged.
    covers: Vec<u64>,
}

/// What a capture's reading sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeltaStats {
    /// Bytes of data sent.
    pub data_bytes: u64,
    /// Bytes stated as zeroes.
    pub zero_bytes: u64,
    /// Bytes of a full copy not sent: the backup held them.
    pub held_bytes: u64,
    /// Milliseconds the backup jobs took after the capture.
    pub job_ms: u64,
}

fn qmp_err(disk: &str, what: &str, e: QmpError) -> String {
    format!("disk {disk}: {what}: {e}")
}

impl DiskEpochs {
    /// The disks of the VM behind `qmp`, checked: every writable disk can
    /// carry a dirty bitmap (one is added and removed) and no device
    /// writes a disk past QEMU's block layer. Leftover `hag-` bitmaps of
    /// an earlier hagctl are removed. Delta files go in `dir`.
    pub fn open(qmp: &mut Qmp, dir: &Path) -> Result<DiskEpochs, String> {
        if let Some(why) = untracked(&devices(qmp)?, "protected").into_iter().next() {
            return Err(why);
        }
        let answer = qmp
            .execute("query-block", None)
            .map_err(|e| format!("query-block: {e}"))?;
        let disks = writable_disks(&answer)?;
        let mut epochs = DiskEpochs {
            disks,
            dir: dir.to_owned(),
            live: Vec::new(),
            seq: 1,
            pending: None,
            ready: None,
            read: None,
            needs_full: true,
            markers: Vec::new(),
            held: Vec::new(),
            withheld: false,
        };
        for d in &epochs.disks {
            remove_hag_bitmaps(qmp, &d.node);
            let probe = json!({ "node": d.node, "name": "hag-probe" });
            qmp.execute("block-dirty-bitmap-add", Some(probe.clone()))
                .map_err(|e| {
                    format!(
                        "disk {} (node {}) cannot carry a dirty bitmap, so its writes cannot be tracked: {e}",
                        d.id, d.node
                    )
                })?;
            let _ = qmp.execute("block-dirty-bitmap-remove", Some(probe));
        }
        if !epochs.disks.is_empty() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            epochs.remove_files();
        }
        epochs.leave_markers();
        Ok(epochs)
    }

    /// Leaves a marker beside each disk's image, so that a backup that
    /// would take the image itself for its replica (shared storage)
    /// refuses to (`crate::replica::shared_refusal`). A directory this
    /// host cannot write loses only that check.
    fn leave_markers(&mut self) {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_default();
        for d in &self.disks {
            let Some(image) = &d.image else { continue };
            let marker = crate::replica::primary_marker(image);
            let text = format!(
                "hagctl checkpoint on {host} (pid {}) protects {} as disk {}\n",
                std::process::id(),
                image.display(),
                d.id
            );
            if std::fs::write(&marker, text).is_ok() {
                self.markers.push(marker);
            }
        }
    }

    /// The disks.
    pub fn disks(&self) -> &[Disk] {
        &self.disks
    }

    fn file(&self, seq: u64, i: usize) -> PathBuf {
        self.dir
            .join(format!("delta-{seq}-{}.qcow2", self.disks[i].id))
    }

    fn target(seq: u64, i: usize) -> String {
        format!("hag-t{seq}-{i}")
    }

    fn job(seq: u64, i: usize) -> String {
        format!("hag-j{seq}-{i}")
    }

    /// With the VM running: makes the next capture's delta files and adds
    /// them to QEMU as block nodes, so that the pause does only the
    /// capture itself.
    pub fn prepare(&mut self, qmp: &mut Qmp) -> Result<(), String> {
        if self.disks.is_empty() || self.ready == Some(self.seq) {
            return Ok(());
        }
        let seq = self.seq;
        for i in 0..self.disks.len() {
            let d = &self.disks[i];
            let file = self.file(seq, i);
            let size = d.size.to_string();
            qemu_img(
                &d.id,
                &["create", "-q", "-f", "qcow2", "-o", "cluster_size=65536"],
                &file,
                &[&size],
            )?;
            let args = json!({
                "driver": "qcow2",
                "node-name": Self::target(seq, i),
                "file": { "driver": "file", "filename": file.to_string_lossy() },
            });
            qmp.execute("blockdev-add", Some(args))
                .map_err(|e| qmp_err(&d.id, "adding its delta file", e))?;
        }
        self.ready = Some(seq);
        Ok(())
    }

    /// The point in time of the next delta, with the VM paused; a full
    /// capture (the first of a session, see [`DiskEpochs::needs_full`])
    /// may be taken while it runs. One transaction for all disks, so they
    /// are captured at one instant; if QEMU refuses it, nothing changed.
    /// A capture never read (its epoch was given up) is dropped; its
    /// bitmaps stay, and this one covers them again.
    pub fn capture(&mut self, qmp: &mut Qmp) -> Result<(), String> {
        if self.disks.is_empty() {
            return Ok(());
        }
        if let Some(old) = self.pending.take() {
            self.release(qmp, &old);
        }
        self.prepare(qmp)?;
        // The epoch's device-state save (a migration) ended by
        // inactivating every block node, as a migration hands its disks
        // over; the VM is still paused, so the disks are as they were, and
        // active again they can take the capture (`cont` would have
        // activated them anyway).
        qmp.execute("blockdev-set-active", Some(json!({ "active": true })))
            .map_err(|e| format!("re-activating the disks after the device state's save: {e}"))?;
        let full = self.needs_full;
        let seq = self.seq;
        let covers = if full { Vec::new() } else { self.live.clone() };
        let mut actions = Vec::new();
        for (i, d) in self.disks.iter().enumerate() {
            let bitmap = |n: u64| format!("hag-e{n}");
            actions.push(json!({ "type": "block-dirty-bitmap-add",
                "data": { "node": d.node, "name": bitmap(seq) } }));
            if let Some(&last) = self.live.last() {
                actions.push(json!({ "type": "block-dirty-bitmap-disable",
                    "data": { "node": d.node, "name": bitmap(last) } }));
            }
            let mut backup = json!({ "job-id": Self::job(seq, i), "device": d.node,
                "target": Self::target(seq, i), "auto-dismiss": false });
            if full {
                backup["sync"] = json!("full");
            } else {
                let merged = format!("hag-x{seq}");
                actions.push(json!({ "type": "block-dirty-bitmap-add",
                    "data": { "node": d.node, "name": merged, "disabled": true } }));
                actions.push(json!({ "type": "block-dirty-bitmap-merge",
                    "data": { "node": d.node, "target": merged,
                              "bitmaps": covers.iter().map(|&n| bitmap(n)).collect::<Vec<_>>() } }));
                backup["sync"] = json!("bitmap");
                backup["bitmap"] = json!(merged);
                backup["bitmap-mode"] = json!("never");
            }
            actions.push(json!({ "type": "blockdev-backup", "data": backup }));
        }
        qmp.execute("transaction", Some(json!({ "actions": actions })))
            .map_err(|e| format!("capturing the disks' delta: {e}"))?;
        self.seq += 1;
        self.ready = None;
        self.live.push(seq);
        self.pending = Some(Capture { seq, full, covers });
        Ok(())
    }

    /// Waits for the pending capture's jobs and hands its delta to `sink`
    /// (disk index, offset, extent), disk by disk in offset order; then
    /// removes its files. Nothing pending: nothing to do.
    pub fn read(
        &mut self,
        qmp: &mut Qmp,
        sink: &mut dyn FnMut(usize, u64, Extent) -> Result<(), String>,
    ) -> Result<DeltaStats, String> {
        let Some(cap) = self.pending.take() else {
            return Ok(DeltaStats::default());
        };
        let t0 = Instant::now();
        let mut stats = DeltaStats::default();
        let waited = self.wait_jobs(qmp, &cap);
        stats.job_ms = t0.elapsed().as_millis() as u64;
        // QEMU lets go of the files first: qemu-img may not open an
        // image QEMU holds open for writing.
        self.detach(qmp, &cap);
        let result = waited.and_then(|()| {
            (0..self.disks.len()).try_for_each(|i| self.read_file(&cap, i, &mut stats, sink))
        });
        self.forget(qmp, &cap);
        result?;
        if cap.full {
            self.needs_full = false;
        }
        self.read = Some(cap.covers);
        Ok(stats)
    }

    fn wait_jobs(&self, qmp: &mut Qmp, cap: &Capture) -> Result<(), String> {
        // A job copies what the guest wrote in one interval: minutes would
        // mean QEMU's I/O is stuck.
        let deadline = Instant::now() + Duration::from_secs(600);
        let mut nap = Duration::from_millis(2);
        loop {
            let jobs = qmp
                .execute("query-jobs", None)
                .map_err(|e| format!("query-jobs: {e}"))?;
            let ours: Vec<&Value> = jobs
                .as_array()
                .into_iter()
                .flatten()
                .filter(|j| {
                    j.get("id")
                        .and_then(Value::as_str)
                        .is_some_and(|id| id.starts_with(&format!("hag-j{}-", cap.seq)))
                })
                .collect();
            if let Some(failed) = ours.iter().find(|j| j.get("error").is_some()) {
                return Err(format!(
                    "copying a disk's delta failed: {}",
                    failed.get("error").and_then(Value::as_str).unwrap_or("?")
                ));
            }
            let done = ours
                .iter()
                .filter(|j| j.get("status").and_then(Value::as_str) == Some("concluded"))
                .count();
            if ours.len() < self.disks.len() {
                return Err(format!(
                    "QEMU lost {} of the disks' delta jobs",
                    self.disks.len() - ours.len()
                ));
            }
            if done == self.disks.len() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err("the disks' delta jobs did not end in 600 s".into());
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(50));
        }
    }

    fn read_file(
        &self,
        cap: &Capture,
        i: usize,
        stats: &mut DeltaStats,
        sink: &mut dyn FnMut(usize, u64, Extent) -> Result<(), String>,
    ) -> Result<(), String> {
        let d = &self.disks[i];
        let path = self.file(cap.seq, i);
        let out = qemu_img(&d.id, &["map", "--output=json", "-f", "qcow2"], &path, &[])?;
        let map: Value = serde_json::from_slice(&out)
            .map_err(|e| format!("disk {}: qemu-img map printed no JSON: {e}", d.id))?;
        let ranges =
            parse_map(&map, d.size, cap.full).map_err(|e| format!("disk {}: {e}", d.id))?;
        let file = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        // Withheld (a test): read, counted, not sent.
        let send = !self.withheld || cap.full;
        let held = Some(&self.held)
            .filter(|_| cap.full)
            .and_then(|h| h.get(i))
            .filter(|h| !h.is_empty());
        let mut filter = ChunkFilter::new(held.map(Vec::as_slice));
        let mut out = |start: u64, e: Extent| {
            match &e {
                Extent::Data(b) => stats.data_bytes += b.len() as u64,
                Extent::Zero(n) => stats.zero_bytes += n,
            }
            if send {
                sink(i, start, e)
            } else {
                Ok(())
            }
        };
        // Pieces of at most a chunk, never across a chunk's end, so that
        // a full copy is compared chunk by chunk with what the backup
        // holds.
        let chunk = EXTENT_MAX as u64;
        for r in ranges {
            let mut done = 0u64;
            while done < r.length {
                let start = r.start + done;
                let n = (r.length - done).min((start / chunk + 1) * chunk - start);
                let extent = match r.file_offset {
                    None => Extent::Zero(n),
                    Some(at) => {
                        let mut buf = vec![0u8; n as usize];
                        file.read_exact_at(&mut buf, at + done).map_err(|e| {
                            format!(
                                "{}: reading {n} bytes at {}: {e}",
                                path.display(),
                                at + done
                            )
                        })?;
                        Extent::Data(buf)
                    }
                };
                filter.push(start, extent, &mut out)?;
                done += n;
            }
        }
        filter.flush(&mut out)?;
        stats.held_bytes += filter.held_bytes;
        Ok(())
    }

    /// Ends a capture's jobs (a running one is cancelled and waited for)
    /// and closes its files in QEMU.
    fn detach(&self, qmp: &mut Qmp, cap: &Capture) {
        for i in 0..self.disks.len() {
            end_job(qmp, &Self::job(cap.seq, i));
            let _ = qmp.execute(
                "blockdev-del",
                Some(json!({ "node-name": Self::target(cap.seq, i) })),
            );
        }
    }

    /// Ends a capture's jobs, nodes, merged bitmap and files.
    fn release(&self, qmp: &mut Qmp, cap: &Capture) {
        self.detach(qmp, cap);
        self.forget(qmp, cap);
    }

    /// Removes a detached capture's merged bitmap and files.
    fn forget(&self, qmp: &mut Qmp, cap: &Capture) {
        for (i, d) in self.disks.iter().enumerate() {
            if !cap.full {
                let _ = qmp.execute(
                    "block-dirty-bitmap-remove",
                    Some(json!({ "node": d.node, "name": format!("hag-x{}", cap.seq) })),
                );
            }
            let _ = std::fs::remove_file(self.file(cap.seq, i));
        }
    }

    /// The backup acknowledged the epoch the last delta read went into:
    /// the bitmaps it covered are no longer needed.
    pub fn acknowledged(&mut self, qmp: &mut Qmp) {
        let Some(covers) = self.read.take() else {
            return;
        };
        for d in &self.disks {
            for n in &covers {
                let _ = qmp.execute(
                    "block-dirty-bitmap-remove",
                    Some(json!({ "node": d.node, "name": format!("hag-e{n}") })),
                );
            }
        }
        self.live.retain(|n| !covers.contains(n));
    }

    /// A new session, with a backup whose replicas hold what `held` sums
    /// (may be empty: nothing known): forget every bitmap; the next
    /// capture is a full one, which sends only chunks the backup does not
    /// hold.
    pub fn restart(&mut self, qmp: &mut Qmp, held: Vec<Vec<[u8; 32]>>) {
        self.held = held;
        if let Some(cap) = self.pending.take() {
            self.release(qmp, &cap);
        }
        self.read = None;
        for d in &self.disks {
            remove_hag_bitmaps(qmp, &d.node);
        }
        self.live.clear();
        self.needs_full = true;
    }

    /// Whether the next capture is a full one (taken while the VM runs).
    pub fn needs_full(&self) -> bool {
        self.needs_full && !self.disks.is_empty()
    }

    /// Protection ends: nothing of hagctl's stays in QEMU or on disk.
    pub fn close(&mut self, qmp: &mut Qmp) {
        self.restart(qmp, Vec::new());
        if let Some(seq) = self.ready.take() {
            for i in 0..self.disks.len() {
                let _ = qmp.execute(
                    "blockdev-del",
                    Some(json!({ "node-name": Self::target(seq, i) })),
                );
            }
        }
        self.remove_files();
        for m in self.markers.drain(..) {
            let _ = std::fs::remove_file(m);
        }
    }

    fn remove_files(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("delta-") && name.ends_with(".qcow2") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// A full copy's pieces, held chunk by chunk: a chunk whose sum is what
/// the backup already holds there is not sent. Without the backup's sums,
/// every piece goes straight out.
struct ChunkFilter<'a> {
    held: Option<&'a [[u8; 32]]>,
    index: u64,
    bytes: Vec<u8>,
    pieces: Vec<(u64, Extent)>,
    /// Bytes not sent: the backup held them.
    held_bytes: u64,
}

type Out<'a> = dyn FnMut(u64, Extent) -> Result<(), String> + 'a;

impl<'a> ChunkFilter<'a> {
    fn new(held: Option<&'a [[u8; 32]]>) -> Self {
        ChunkFilter {
            held,
            index: 0,
            bytes: Vec::new(),
            pieces: Vec::new(),
            held_bytes: 0,
        }
    }

    /// A piece at `start`, within one chunk.
    fn push(&mut self, start: u64, e: Extent, out: &mut Out<'_>) -> Result<(), String> {
        if self.held.is_none() {
            return out(start, e);
        }
        let index = start / EXTENT_MAX as u64;
        if index != self.index {
            self.flush(out)?;
            self.index = index;
        }
        match &e {
            Extent::Data(b) => self.bytes.extend_from_slice(b),
            Extent::Zero(n) => self.bytes.resize(self.bytes.len() + *n as usize, 0),
        }
        self.pieces.push((start, e));
        Ok(())
    }

    /// The sum of the chunk so far. A whole chunk the map says is zeroes
    /// (most of a disk: a 2 GiB disk with 450 MiB on it) is not hashed:
    /// under emulation hashing 1.6 GiB of zeroes took about a minute.
    fn sum(&self) -> [u8; 32] {
        let zeroes = self
            .pieces
            .iter()
            .all(|(_, e)| matches!(e, Extent::Zero(_)));
        if zeroes && self.bytes.len() == EXTENT_MAX {
            crate::wire::zero_chunk_sum()
        } else {
            crate::wire::disk_chunk_sum(&self.bytes)
        }
    }

    /// The chunk so far is complete: out, unless the backup holds it.
    fn flush(&mut self, out: &mut Out<'_>) -> Result<(), String> {
        let same = self.held.and_then(|h| h.get(self.index as usize)) == Some(&self.sum());
        let pieces = std::mem::take(&mut self.pieces);
        if same && !pieces.is_empty() {
            self.held_bytes += self.bytes.len() as u64;
        } else {
            for (start, e) in pieces {
                out(start, e)?;
            }
        }
        self.bytes.clear();
        Ok(())
    }
}

/// Runs `qemu-img ARGS FILE MORE` for disk `id`; returns its stdout, or
/// an error naming the disk, the command and what qemu-img said.
fn qemu_img(id: &str, args: &[&str], file: &Path, more: &[&str]) -> Result<Vec<u8>, String> {
    let what = || format!("disk {id}: qemu-img {} {}", args[0], file.display());
    let out = Command::new("qemu-img")
        .args(args)
        .arg(file)
        .args(more)
        .output()
        .map_err(|e| format!("{}: {e}", what()))?;
    if !out.status.success() {
        return Err(format!(
            "{}: {}",
            what(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(out.stdout)
}

/// Cancels job `id` if it still runs, waits (at most 10 s) until it has
/// concluded, and dismisses it.
pub(crate) fn end_job(qmp: &mut Qmp, id: &str) {
    let _ = qmp.execute("job-cancel", Some(json!({ "id": id })));
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let Ok(jobs) = qmp.execute("query-jobs", None) else {
            return;
        };
        let status = jobs
            .as_array()
            .into_iter()
            .flatten()
            .find(|j| j.get("id").and_then(Value::as_str) == Some(id))
            .and_then(|j| j.get("status").and_then(Value::as_str).map(str::to_owned));
        match status.as_deref() {
            None => return,
            Some("concluded") => break,
            Some(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    let _ = qmp.execute("job-dismiss", Some(json!({ "id": id })));
}

/// Removes every `hag-` bitmap of `node` (an earlier hagctl's).
fn remove_hag_bitmaps(qmp: &mut Qmp, node: &str) {
    let Ok(blocks) = qmp.execute("query-named-block-nodes", Some(json!({ "flat": true }))) else {
        return;
    };
    let names: Vec<String> = blocks
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b.get("node-name").and_then(Value::as_str) == Some(node))
        .flat_map(|b| {
            b.get("dirty-bitmaps")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|bm| bm.get("name").and_then(Value::as_str).map(str::to_owned))
        .filter(|n| n.starts_with("hag-"))
        .collect();
    for name in names {
        let _ = qmp.execute(
            "block-dirty-bitmap-remove",
            Some(json!({ "node": node, "name": name })),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writable_disks_are_found_and_named_by_device() {
        let answer = json!([
            { "device": "", "qdev": "/machine/peripheral/vda/virtio-backend",
              "inserted": { "ro": false, "node-name": "disk0",
                            "image": { "virtual-size": 67108864 } } },
            { "device": "ide2-cd0", "qdev": "/machine/peripheral/cd0",
              "inserted": { "ro": true, "node-name": "cd", "image": { "virtual-size": 1 } } },
            { "device": "floppy0", "qdev": "/machine/peripheral/fd0" },
            { "device": "spare", "qdev": "",
              "inserted": { "ro": false, "node-name": "spare", "image": { "virtual-size": 1 } } },
        ]);
        assert_eq!(
            writable_disks(&answer).unwrap(),
            vec![Disk {
                id: "vda".into(),
                node: "disk0".into(),
                size: 67108864,
                image: None,
            }]
        );
    }

    #[test]
    fn disks_that_cannot_be_named_are_refused() {
        let anon = json!([{ "qdev": "/machine/peripheral-anon/device[2]/virtio-backend",
            "inserted": { "ro": false, "node-name": "n", "image": { "virtual-size": 512 } } }]);
        let e = writable_disks(&anon).unwrap_err();
        assert!(e.contains("device[2]") && e.contains("id="), "{e}");
        let nameless = json!([{ "qdev": "/machine/peripheral/vda",
            "inserted": { "ro": false, "node-name": "", "image": { "virtual-size": 512 } } }]);
        assert!(writable_disks(&nameless).unwrap_err().contains("disk vda"));
        assert!(!is_disk_id("..") && !is_disk_id("a/b") && !is_disk_id(""));
        assert!(is_disk_id("virtio-disk0") && is_disk_id("ua-disk_1.x"));
    }

    #[test]
    fn devices_past_the_block_layer_are_named() {
        let found = untracked(
            &[
                ("vda".into(), "virtio-blk-pci".into()),
                ("vub0".into(), "vhost-user-blk-pci".into()),
                ("sg0".into(), "scsi-generic".into()),
            ],
            "protected",
        );
        assert_eq!(found.len(), 2);
        assert!(found[0].contains("cannot be protected"), "{}", found[0]);
        assert!(
            found[0].contains("vub0") && found[0].contains("vhost-user"),
            "{}",
            found[0]
        );
        assert!(found[1].contains("sg0"));
    }

    /// Against a real QEMU 10 on this machine (TCG, no guest: writes go
    /// through HMP's qemu-io, so the device shares its node): a full copy,
    /// then deltas that hold exactly what was written before each capture,
    /// as it was then. `cargo test -p hagctl qemu_disk_deltas -- --ignored`.
    #[test]
    #[ignore]
    fn qemu_disk_deltas() {
        use std::collections::BTreeMap;
        let dir = std::env::temp_dir().join(format!("hag-disk-deltas-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let disk = dir.join("disk.qcow2");
        let st = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&disk)
            .arg("8M")
            .status()
            .unwrap();
        assert!(st.success());
        let sock = dir.join("qmp.sock");
        struct Kill(std::process::Child);
        impl Drop for Kill {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let _qemu = Kill(
            Command::new("qemu-system-x86_64")
                .args([
                    "-machine",
                    "q35,accel=tcg",
                    "-display",
                    "none",
                    "-nodefaults",
                    "-S",
                ])
                .arg("-blockdev")
                .arg(format!(
                    "driver=file,filename={},node-name=f0",
                    disk.display()
                ))
                .args(["-blockdev", "driver=qcow2,file=f0,node-name=d0"])
                .args(["-device", "virtio-blk-pci,drive=d0,id=vda,share-rw=on"])
                .arg("-qmp")
                .arg(format!("unix:{},server=on,wait=off", sock.display()))
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut qmp = loop {
            match Qmp::connect(&sock, Duration::from_secs(10)) {
                Ok(q) => break q,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Err(e) => panic!("{e}"),
            }
        };
        let hmp = |qmp: &mut Qmp, cmd: &str| {
            let line = format!("qemu-io d0 \"{cmd}\"");
            let out = qmp
                .execute(
                    "human-monitor-command",
                    Some(json!({ "command-line": line })),
                )
                .unwrap();
            assert!(!out.as_str().unwrap_or("").contains("rror"), "{cmd}: {out}");
        };
        hmp(&mut qmp, "write -P 0x11 0 128k");
        let mut epochs = DiskEpochs::open(&mut qmp, &dir.join("deltas")).unwrap();
        assert_eq!(epochs.disks()[0].id, "vda");
        let read = |epochs: &mut DiskEpochs, qmp: &mut Qmp| {
            let mut got = BTreeMap::new();
            epochs
                .read(qmp, &mut |_, offset, e| {
                    got.insert(offset, e);
                    Ok(())
                })
                .unwrap();
            got
        };
        // The full copy states the whole disk.
        assert!(epochs.needs_full());
        epochs.capture(&mut qmp).unwrap();
        let full = read(&mut epochs, &mut qmp);
        let data: u64 = full
            .values()
            .filter(|e| matches!(e, Extent::Data(_)))
            .map(Extent::bytes)
            .sum();
        assert_eq!(full.values().map(Extent::bytes).sum::<u64>(), 8 << 20);
        assert!(data >= 128 << 10, "{data}");
        assert!(!epochs.needs_full());
        // A new session with a backup that holds all of it: a full copy
        // that sends nothing but the zeroes' ranges.
        let mut image = vec![0u8; 8 << 20];
        for (&at, e) in &full {
            if let Extent::Data(b) = e {
                image[at as usize..at as usize + b.len()].copy_from_slice(b);
            }
        }
        let held = image
            .chunks(EXTENT_MAX)
            .map(crate::wire::disk_chunk_sum)
            .collect();
        epochs.restart(&mut qmp, vec![held]);
        epochs.capture(&mut qmp).unwrap();
        let stats = epochs.read(&mut qmp, &mut |_, _, _| Ok(())).unwrap();
        assert_eq!(
            (stats.data_bytes, stats.zero_bytes, stats.held_bytes),
            (0, 0, 8 << 20)
        );
        hmp(&mut qmp, "write -P 0x22 1M 64k");
        hmp(&mut qmp, "write -z 2M 64k");
        epochs.prepare(&mut qmp).unwrap();
        // As in an epoch: the device state's save (a migration) inactivates
        // the disks first; the bitmaps must survive it.
        qmp.execute("migrate", Some(json!({ "uri": "exec:cat >/dev/null" })))
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let st = qmp.execute("query-migrate", None).unwrap();
            match st["status"].as_str() {
                Some("completed") => break,
                Some("failed") => panic!("{st}"),
                _ if Instant::now() > deadline => panic!("{st}"),
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        epochs.capture(&mut qmp).unwrap();
        // Written after the point in time: not in this delta.
        hmp(&mut qmp, "write -P 0x33 1M 64k");
        let d = read(&mut epochs, &mut qmp);
        assert_eq!(d.len(), 2, "{:?}", d.keys().collect::<Vec<_>>());
        assert_eq!(d[&(1 << 20)], Extent::Data(vec![0x22; 64 << 10]));
        assert_eq!(d[&(2 << 20)], Extent::Zero(64 << 10));
        // Not acknowledged: the next delta covers that interval again,
        // with today's bytes.
        epochs.capture(&mut qmp).unwrap();
        let d = read(&mut epochs, &mut qmp);
        assert_eq!(d[&(1 << 20)], Extent::Data(vec![0x33; 64 << 10]));
        assert!(d.contains_key(&(2 << 20)));
        epochs.acknowledged(&mut qmp);
        epochs.capture(&mut qmp).unwrap();
        assert!(read(&mut epochs, &mut qmp).is_empty());
        epochs.acknowledged(&mut qmp);
        // A capture given up (never read) is covered by the next one.
        hmp(&mut qmp, "write -P 0x44 3M 4k");
        epochs.capture(&mut qmp).unwrap();
        epochs.capture(&mut qmp).unwrap();
        let d = read(&mut epochs, &mut qmp);
        assert_eq!(d.len(), 1);
        assert!(matches!(&d[&(3 << 20)], Extent::Data(b) if b[..4096] == [0x44; 4096]));
        epochs.close(&mut qmp);
        // Nothing of hagctl's is left: no node, no bitmap, no file.
        let left = qmp
            .execute("query-named-block-nodes", Some(json!({ "flat": true })))
            .unwrap();
        for node in left.as_array().unwrap() {
            let name = node["node-name"].as_str().unwrap();
            assert!(!name.starts_with("hag-"), "node {name} is left");
            let bitmaps = node.get("dirty-bitmaps").and_then(Value::as_array);
            assert!(bitmaps.is_none_or(Vec::is_empty), "{node}");
        }
        assert_eq!(std::fs::read_dir(dir.join("deltas")).unwrap().count(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn delta_maps_list_what_is_present() {
        // What qemu-img 10 prints for a backup target (see the module docs).
        let map = json!([
            { "start": 0, "length": 1048576, "depth": 0, "present": false, "zero": true, "data": false, "compressed": false },
            { "start": 1048576, "length": 65536, "depth": 0, "present": true, "zero": false, "data": true, "compressed": false, "offset": 327680 },
            { "start": 1114112, "length": 983040, "depth": 0, "present": false, "zero": true, "data": false, "compressed": false },
            { "start": 2097152, "length": 65536, "depth": 0, "present": true, "zero": true, "data": false, "compressed": false },
            { "start": 2162688, "length": 64946176, "depth": 0, "present": false, "zero": true, "data": false, "compressed": false },
        ]);
        let size = 64 << 20;
        assert_eq!(
            parse_map(&map, size, false).unwrap(),
            vec![
                Mapped {
                    start: 1048576,
                    length: 65536,
                    file_offset: Some(327680)
                },
                Mapped {
                    start: 2097152,
                    length: 65536,
                    file_offset: None
                },
            ]
        );
        // A full capture states the whole disk.
        let full = parse_map(&map, size, true).unwrap();
        assert_eq!(full.len(), 5);
        assert_eq!(full.iter().map(|m| m.length).sum::<u64>(), size);
        // Gaps, overruns, old qemu-img and compressed clusters are refused.
        assert!(parse_map(&map, size - 1, false).is_err());
        assert!(parse_map(&map, size + 1, false)
            .unwrap_err()
            .contains("covers"));
        let gap =
            json!([{ "start": 512, "length": 512, "present": true, "zero": true, "data": false }]);
        assert!(parse_map(&gap, 1024, false)
            .unwrap_err()
            .contains("where 0 was due"));
        let old = json!([{ "start": 0, "length": 1024, "zero": true, "data": false }]);
        assert!(parse_map(&old, 1024, false)
            .unwrap_err()
            .contains("present"));
        let packed = json!([{ "start": 0, "length": 1024, "present": true, "data": true, "compressed": true, "offset": 0 }]);
        assert!(parse_map(&packed, 1024, false)
            .unwrap_err()
            .contains("compressed"));
    }

    #[test]
    fn a_full_copy_sends_only_chunks_the_backup_lacks() {
        let chunk = EXTENT_MAX as u64;
        let data = vec![7u8; EXTENT_MAX];
        let sum = crate::wire::disk_chunk_sum;
        // The backup holds chunk 0 as zeroes, chunk 1 as `data`, chunk 2 as
        // zeroes; the primary has zeroes (in two pieces), other data, and
        // data where the backup has zeroes.
        let held = [
            sum(&vec![0; EXTENT_MAX]),
            sum(&data),
            sum(&vec![0; EXTENT_MAX]),
        ];
        let mut filter = ChunkFilter::new(Some(&held));
        let mut sent = Vec::new();
        let mut out = |start: u64, e: Extent| {
            sent.push((start, e));
            Ok(())
        };
        let half = chunk / 2;
        filter.push(0, Extent::Zero(half), &mut out).unwrap();
        filter.push(half, Extent::Zero(half), &mut out).unwrap();
        filter
            .push(chunk, Extent::Data(vec![8; EXTENT_MAX]), &mut out)
            .unwrap();
        filter
            .push(2 * chunk, Extent::Zero(half), &mut out)
            .unwrap();
        filter
            .push(
                2 * chunk + half,
                Extent::Data(vec![1; EXTENT_MAX / 2]),
                &mut out,
            )
            .unwrap();
        filter.flush(&mut out).unwrap();
        let starts: Vec<u64> = sent.iter().map(|(s, _)| *s).collect();
        assert_eq!(starts, [chunk, 2 * chunk, 2 * chunk + half]);
        assert_eq!(filter.held_bytes, chunk);
    }
}
