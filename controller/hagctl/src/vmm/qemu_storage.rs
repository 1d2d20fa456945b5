//! `--copy-storage`: a QEMU VM's local disks moved along with its live
//! migration, as `virsh migrate --live --copy-storage-all` moves them,
//! with QEMU's own machinery (QEMU's docs/interop/live-block-operations.rst).
//!
//! The target QEMU (started with `-S -incoming defer`) serves each of its
//! writable disks over NBD (`nbd-server-start`, then `block-export-add`,
//! writable, the export named by the disk device's id) before it listens
//! for the migration. The source adds an NBD client node for each of its
//! writable disks (`blockdev-add`, driver `nbd`, the export of the same
//! name) and mirrors the disk into it (`blockdev-mirror`, `sync=full`,
//! `copy-mode=write-blocking`: once the mirror is `ready`, a guest write
//! completes only when both copies hold it, so the mirror converges under
//! any write load). Once every mirror is ready the RAM migration starts.
//! When it has completed (the source paused in `postmigrate`),
//! `block-job-cancel` on each ready mirror completes it without pivoting:
//! the target holds exactly what the source holds and the source stays on
//! its own disk (`job-complete` would switch the source to the NBD copy).
//! The source then deletes its NBD nodes, which lets the target's
//! `block-export-del` (mode `safe`) succeed; the target stops its NBD
//! server and only then resumes the VM.
//!
//! Before the migration completed, any failure cancels the mirrors and
//! deletes the NBD nodes: the source VM runs on, on its own disks.

use crate::log::info;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::qemu_disks::{devices, end_job, untracked, writable_disks, Disk};
use super::qmp::{Qmp, QmpError};
use super::{DiskCopy, MigrationAddress};

/// The NBD port when `--nbd` does not say (IANA's, and libvirt's default).
pub const NBD_PORT: u16 = 10809;

/// How long the last copy of each mirror may take once the migration
/// completed: the mirrors were in sync, so it is what the guest wrote
/// during the last moments, normally nothing.
const FINISH_TIMEOUT: Duration = Duration::from_secs(120);

/// The NBD address: `given` (`--nbd`), else the migration address's host
/// with port [`NBD_PORT`].
pub fn nbd_address(
    given: Option<MigrationAddress>,
    migration: &MigrationAddress,
) -> MigrationAddress {
    given.unwrap_or_else(|| match migration {
        MigrationAddress::Tcp { host, .. } => MigrationAddress::Tcp {
            host: host.clone(),
            port: NBD_PORT,
        },
    })
}

/// The mirror job of disk `id`.
pub fn job_id(id: &str) -> String {
    format!("hag-mirror-{id}")
}

/// The NBD client node of disk `id` on the source.
pub fn nbd_node(id: &str) -> String {
    format!("hag-nbd-{id}")
}

/// The NBD export (its id; its name is the disk's id) of disk `id` on the
/// target.
pub fn export_id(id: &str) -> String {
    format!("hag-export-{id}")
}

/// Whether QEMU's command line (`/proc/PID/cmdline`: NUL-separated) has
/// `-S`: the VM does not run until told (`cont`), after an incoming
/// migration too.
pub fn started_paused(cmdline: &[u8]) -> bool {
    cmdline
        .split(|b| *b == 0)
        .any(|arg| arg == b"-S" || arg == b"--S")
}

/// Each disk's mirror job in `query-jobs`' answer; a disk whose job is not
/// listed has status `absent`.
pub fn parse_jobs(query_jobs: &Value, disks: &[String]) -> Result<Vec<DiskCopy>, String> {
    let list = query_jobs
        .as_array()
        .ok_or_else(|| format!("query-jobs returned {query_jobs}"))?;
    Ok(disks
        .iter()
        .map(|disk| {
            let job = job_id(disk);
            let found = list
                .iter()
                .find(|j| j.get("id").and_then(Value::as_str) == Some(job.as_str()));
            let num = |k: &str| found.and_then(|j| j.get(k)).and_then(Value::as_u64);
            DiskCopy {
                disk: disk.clone(),
                status: found
                    .and_then(|j| j.get("status"))
                    .and_then(Value::as_str)
                    .unwrap_or("absent")
                    .to_owned(),
                copied: num("current-progress").unwrap_or(0),
                total: num("total-progress").unwrap_or(0),
                error: found
                    .and_then(|j| j.get("error"))
                    .and_then(Value::as_str)
                    .map(str::to_owned),
                job,
            }
        })
        .collect())
}

/// Why a mirror that should still run (before hagctl completes it) does
/// not: it failed, ended, or is gone.
pub fn copy_failure(copy: &DiskCopy) -> Option<String> {
    let (disk, job) = (&copy.disk, &copy.job);
    if let Some(e) = &copy.error {
        return Some(format!(
            "the mirror of disk {disk} (job {job}) failed: QEMU: {e}"
        ));
    }
    match copy.status.as_str() {
        "absent" => Some(format!(
            "the mirror of disk {disk} (job {job}) is gone: another QMP client ended it"
        )),
        "aborting" | "concluded" | "null" => Some(format!(
            "the mirror of disk {disk} (job {job}) ended before the migration (status {})",
            copy.status
        )),
        _ => None,
    }
}

/// Refuses a target disk whose virtual size is not the source's.
pub fn check_size(disk: &Disk, target: Option<u64>, nbd: &MigrationAddress) -> Result<(), String> {
    match target {
        Some(t) if t == disk.size => Ok(()),
        Some(t) => Err(format!(
            "disk {id} is {size} bytes here but the target's NBD export '{id}' at {nbd} is {t} \
             bytes: give the target an image of the same virtual size (qemu-img create -f qcow2 \
             IMAGE {size}; qemu-img resize IMAGE {size})",
            id = disk.id,
            size = disk.size
        )),
        None => Err(format!(
            "disk {}: QEMU reports no size for the target's NBD export at {nbd}",
            disk.id
        )),
    }
}

/// The writable disks to copy. Refuses, naming it, a disk device whose
/// writes pass QEMU's block layer by (vhost-user-blk, …): no mirror sees
/// them.
fn disks_to_copy(qmp: &mut Qmp) -> Result<Vec<Disk>, String> {
    if let Some(why) = untracked(&devices(qmp)?, "mirrored").into_iter().next() {
        return Err(why);
    }
    let answer = qmp
        .execute("query-block", None)
        .map_err(|e| format!("query-block: {e}"))?;
    writable_disks(&answer)
}

/// The virtual size of block node `node`.
fn node_size(qmp: &mut Qmp, node: &str) -> Result<Option<u64>, String> {
    let nodes = qmp
        .execute("query-named-block-nodes", Some(json!({ "flat": true })))
        .map_err(|e| format!("query-named-block-nodes: {e}"))?;
    Ok(nodes
        .as_array()
        .into_iter()
        .flatten()
        .find(|n| n.get("node-name").and_then(Value::as_str) == Some(node))
        .and_then(|n| n.pointer("/image/virtual-size"))
        .and_then(Value::as_u64))
}

/// QEMU's `InetSocketAddress` for `addr`.
fn inet(addr: &MigrationAddress) -> Value {
    match addr {
        MigrationAddress::Tcp { host, port } => json!({ "host": host, "port": port.to_string() }),
    }
}

/// QEMU's `blockdev-add` error when the target does not serve the export
/// (yet): nothing listens, or no export of that name.
fn not_served_yet(desc: &str) -> bool {
    desc.contains("Connection refused") || desc.contains("export")
}

/// Why the source could not attach to the target's export of `disk`, and
/// what to do.
fn attach_error(disk: &str, nbd: &MigrationAddress, e: &QmpError) -> String {
    let desc = e.desc().unwrap_or_default();
    let hint = if desc.contains("Connection refused") {
        "nothing serves NBD there: run hagctl receive --copy-storage on the target first \
         (and give both sides the same --nbd)"
            .to_owned()
    } else if desc.contains("export") {
        format!(
            "the target exports no disk {disk}: its QEMU needs a writable disk with device id \
             {disk} (-device …,id={disk}), which hagctl receive --copy-storage exports"
        )
    } else {
        "is hagctl receive --copy-storage running on the target?".to_owned()
    };
    format!("disk {disk}: cannot attach to the target's NBD export '{disk}' at {nbd}: {e} ({hint})")
}

/// The source side: one NBD client node and one mirror per disk.
pub struct Mirrors {
    nbd: MigrationAddress,
    disks: Vec<String>,
    /// NBD client nodes added (deleted at the end).
    nodes: Vec<String>,
    /// Mirror jobs started.
    jobs: Vec<String>,
}

impl Mirrors {
    /// Attaches to the target's export of each writable disk at `nbd`
    /// (retrying a refused connection for `connect_timeout`), checks its
    /// size, and starts the disk's mirror into it. On failure, undoes what
    /// it did.
    pub fn start(
        qmp: &mut Qmp,
        nbd: &MigrationAddress,
        connect_timeout: Duration,
    ) -> Result<Mirrors, String> {
        let disks = disks_to_copy(qmp)?;
        let mut m = Mirrors {
            nbd: nbd.clone(),
            disks: Vec::new(),
            nodes: Vec::new(),
            jobs: Vec::new(),
        };
        let start = Instant::now();
        for d in &disks {
            if let Err(e) = m.add(qmp, d, start, connect_timeout) {
                let left = m.abort(qmp);
                return Err(if left.is_empty() {
                    e
                } else {
                    format!("{e}; undoing the mirrors left: {}", left.join("; "))
                });
            }
        }
        Ok(m)
    }

    fn add(
        &mut self,
        qmp: &mut Qmp,
        d: &Disk,
        start: Instant,
        connect_timeout: Duration,
    ) -> Result<(), String> {
        let node = nbd_node(&d.id);
        let mut args = json!({ "driver": "nbd", "node-name": node, "export": d.id });
        args["server"] = inet(&self.nbd);
        args["server"]["type"] = "inet".into();
        let mut said = false;
        loop {
            match qmp.execute("blockdev-add", Some(args.clone())) {
                Ok(_) => break,
                // The target may not serve it yet: both sides can be
                // started at once.
                Err(e)
                    if e.desc().is_some_and(not_served_yet)
                        && start.elapsed() < connect_timeout =>
                {
                    if !said {
                        said = true;
                        info!(
                            "waiting for the target's NBD export '{}' at {} ({})",
                            d.id,
                            self.nbd,
                            e.desc().unwrap_or_default()
                        );
                    }
                    std::thread::sleep(Duration::from_millis(250))
                }
                Err(e) => return Err(attach_error(&d.id, &self.nbd, &e)),
            }
        }
        self.nodes.push(node.clone());
        check_size(d, node_size(qmp, &node)?, &self.nbd)?;
        let job = job_id(&d.id);
        qmp.execute(
            "blockdev-mirror",
            Some(json!({
                "job-id": job,
                "device": d.node,
                "target": node,
                "sync": "full",
                "copy-mode": "write-blocking",
                "auto-finalize": true,
                "auto-dismiss": false,
            })),
        )
        .map_err(|e| {
            format!(
                "disk {}: cannot start its mirror (node {}) to the NBD export at {}: {e}",
                d.id, d.node, self.nbd
            )
        })?;
        self.jobs.push(job);
        self.disks.push(d.id.clone());
        Ok(())
    }

    /// The disks' ids.
    pub fn disks(&self) -> &[String] {
        &self.disks
    }

    /// Each mirror's progress; a failed mirror is an error naming its disk.
    pub fn progress(&self, qmp: &mut Qmp) -> Result<Vec<DiskCopy>, String> {
        let jobs = qmp
            .execute("query-jobs", None)
            .map_err(|e| format!("query-jobs: {e}"))?;
        let copies = parse_jobs(&jobs, &self.disks)?;
        match copies.iter().find_map(copy_failure) {
            Some(why) => Err(why),
            None => Ok(copies),
        }
    }

    /// After the migration completed: completes each mirror without
    /// pivoting (`block-job-cancel` on a ready mirror), waits for it to
    /// conclude, dismisses it and deletes the NBD nodes.
    pub fn finish(mut self, qmp: &mut Qmp) -> Result<(), String> {
        for (disk, job) in self.disks.iter().zip(&self.jobs) {
            qmp.execute("block-job-cancel", Some(json!({ "device": job })))
                .map_err(|e| {
                    format!("disk {disk}: completing its mirror (block-job-cancel {job}): {e}")
                })?;
        }
        let deadline = Instant::now() + FINISH_TIMEOUT;
        loop {
            let jobs = qmp
                .execute("query-jobs", None)
                .map_err(|e| format!("query-jobs: {e}"))?;
            let copies = parse_jobs(&jobs, &self.disks)?;
            if let Some(c) = copies.iter().find(|c| c.error.is_some()) {
                return Err(copy_failure(c).unwrap_or_default());
            }
            if copies.iter().all(|c| c.status == "concluded") {
                break;
            }
            if Instant::now() > deadline {
                let busy: Vec<String> = copies
                    .iter()
                    .filter(|c| c.status != "concluded")
                    .map(|c| format!("{} ({})", c.disk, c.status))
                    .collect();
                return Err(format!(
                    "the mirrors of {} did not conclude within {} s of block-job-cancel",
                    busy.join(", "),
                    FINISH_TIMEOUT.as_secs()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        for job in std::mem::take(&mut self.jobs) {
            let _ = qmp.execute("job-dismiss", Some(json!({ "id": job })));
        }
        for node in std::mem::take(&mut self.nodes) {
            qmp.execute("blockdev-del", Some(json!({ "node-name": node })))
                .map_err(|e| format!("deleting the NBD node {node}: {e}"))?;
        }
        Ok(())
    }

    /// Cancels the mirrors and deletes the NBD nodes; returns what could
    /// not be undone (empty: all of it was).
    pub fn abort(&mut self, qmp: &mut Qmp) -> Vec<String> {
        for job in std::mem::take(&mut self.jobs) {
            end_job(qmp, &job);
        }
        let mut left = Vec::new();
        for node in std::mem::take(&mut self.nodes) {
            if let Err(e) = qmp.execute("blockdev-del", Some(json!({ "node-name": node }))) {
                left.push(format!("NBD node {node}: {e}"));
            }
        }
        left
    }
}

/// The target side: the NBD server and one export per disk.
pub struct Exports {
    /// Disks whose export is not yet removed.
    live: Vec<String>,
    /// The NBD server runs.
    serving: bool,
}

impl Exports {
    /// Starts the NBD server on `nbd` and exports each writable disk,
    /// writable, under its device id. On failure, undoes what it did.
    pub fn start(qmp: &mut Qmp, nbd: &MigrationAddress) -> Result<(Exports, Vec<String>), String> {
        let disks = disks_to_copy(qmp)?;
        let mut addr = json!({ "type": "inet" });
        addr["data"] = inet(nbd);
        qmp.execute("nbd-server-start", Some(json!({ "addr": addr })))
            .map_err(|e| format!("cannot serve NBD on {nbd}: {e}"))?;
        let mut x = Exports {
            live: Vec::new(),
            serving: true,
        };
        for d in &disks {
            let args = json!({
                "type": "nbd",
                "id": export_id(&d.id),
                "node-name": d.node,
                "name": d.id,
                "writable": true,
            });
            if let Err(e) = qmp.execute("block-export-add", Some(args)) {
                let _ = x.remove(qmp, true);
                return Err(format!(
                    "disk {}: cannot export its node {} over NBD at {nbd}: {e}",
                    d.id, d.node
                ));
            }
            x.live.push(d.id.clone());
        }
        let ids = x.live.clone();
        Ok((x, ids))
    }

    /// Removes each export no client uses (`force`: each, whatever uses
    /// it), then, once none is left, stops the NBD server; returns the
    /// disks whose export is still in use.
    pub fn remove(&mut self, qmp: &mut Qmp, force: bool) -> Result<Vec<String>, String> {
        let mode = if force { "hard" } else { "safe" };
        let mut busy = Vec::new();
        for disk in std::mem::take(&mut self.live) {
            let id = export_id(&disk);
            match qmp.execute("block-export-del", Some(json!({ "id": id, "mode": mode }))) {
                Ok(_) => {}
                Err(e) if e.desc().is_some_and(|d| d.contains("not found")) => {}
                Err(QmpError::Command { .. }) => busy.push(disk),
                Err(e) => {
                    busy.push(disk);
                    self.live = busy;
                    return Err(format!("block-export-del {id}: {e}"));
                }
            }
        }
        self.live = busy.clone();
        if busy.is_empty() && self.serving {
            qmp.execute("nbd-server-stop", None)
                .map_err(|e| format!("nbd-server-stop: {e}"))?;
            self.serving = false;
        }
        Ok(busy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nbd_address_defaults_to_the_migration_host() {
        let to = MigrationAddress::parse_tcp("192.0.2.11:7100").unwrap();
        assert_eq!(nbd_address(None, &to).to_string(), "192.0.2.11:10809");
        let v6 = MigrationAddress::parse_tcp("[::1]:7100").unwrap();
        assert_eq!(nbd_address(None, &v6).to_string(), "[::1]:10809");
        let given = MigrationAddress::parse_tcp("10.0.0.2:7000").unwrap();
        assert_eq!(nbd_address(Some(given.clone()), &to), given);
        assert_eq!(
            inet(&nbd_address(None, &v6)),
            json!({"host": "::1", "port": "10809"})
        );
    }

    #[test]
    fn disks_to_mirror_are_the_writable_ones() {
        // QEMU 10: a virtio disk, a read-only one, an empty CD-ROM.
        let answer = json!([
            { "device": "", "qdev": "/machine/peripheral/vda/virtio-backend", "locked": false,
              "inserted": { "ro": false, "node-name": "d0", "drv": "qcow2",
                            "image": { "virtual-size": 8388608, "filename": "/var/lib/vm/a.qcow2" } } },
            { "device": "", "qdev": "/machine/peripheral/vdb/virtio-backend",
              "inserted": { "ro": true, "node-name": "d1", "image": { "virtual-size": 512 } } },
            { "device": "ide2-cd0", "qdev": "/machine/peripheral/cd0", "removable": true,
              "tray_open": false },
        ]);
        let disks = writable_disks(&answer).unwrap();
        let ids: Vec<&str> = disks.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["vda"]);
        assert_eq!((disks[0].node.as_str(), disks[0].size), ("d0", 8 << 20));
    }

    #[test]
    fn only_dash_s_starts_paused() {
        let line = |args: &[&str]| args.join("\0").into_bytes();
        assert!(started_paused(&line(&[
            "qemu-system-x86_64",
            "-S",
            "-incoming",
            "defer"
        ])));
        assert!(started_paused(&line(&["qemu", "--S"])));
        assert!(!started_paused(&line(&["qemu", "-incoming", "defer"])));
        // -S inside another argument is not -S.
        assert!(!started_paused(&line(&[
            "qemu", "-name", "-S-vm", "-smp", "2"
        ])));
        assert!(!started_paused(b""));
    }

    #[test]
    fn job_progress_parses() {
        // QEMU 10's query-jobs while mirroring two disks, one ready.
        let v = json!([
            { "current-progress": 2097152, "status": "running", "total-progress": 8388608,
              "type": "mirror", "id": "hag-mirror-vda" },
            { "current-progress": 8388608, "status": "ready", "total-progress": 8388608,
              "type": "mirror", "id": "hag-mirror-vdb" },
            { "current-progress": 1, "status": "running", "total-progress": 2,
              "type": "backup", "id": "someone-else" },
        ]);
        let disks = ["vda".to_owned(), "vdb".to_owned(), "vdc".to_owned()];
        let c = parse_jobs(&v, &disks).unwrap();
        assert_eq!(
            c[0],
            DiskCopy {
                disk: "vda".into(),
                job: "hag-mirror-vda".into(),
                status: "running".into(),
                copied: 2 << 20,
                total: 8 << 20,
                error: None,
            }
        );
        assert!(!c[0].is_ready() && c[1].is_ready());
        assert_eq!(copy_failure(&c[0]), None);
        assert_eq!(copy_failure(&c[1]), None);
        assert_eq!(c[2].status, "absent");
        assert!(copy_failure(&c[2]).unwrap().contains("disk vdc"));
        assert!(parse_jobs(&json!({}), &disks).is_err());
        // A mirror whose target went away.
        let v = json!([{ "current-progress": 65536, "status": "concluded",
            "total-progress": 8388608, "type": "mirror", "id": "hag-mirror-vda",
            "error": "Input/output error" }]);
        let c = parse_jobs(&v, &disks[..1]).unwrap();
        assert_eq!(
            copy_failure(&c[0]).unwrap(),
            "the mirror of disk vda (job hag-mirror-vda) failed: QEMU: Input/output error"
        );
        let v = json!([{ "status": "concluded", "type": "mirror", "id": "hag-mirror-vda" }]);
        let c = parse_jobs(&v, &disks[..1]).unwrap();
        assert!(copy_failure(&c[0])
            .unwrap()
            .contains("ended before the migration"));
    }

    #[test]
    fn a_target_of_another_size_is_refused() {
        let disk = Disk {
            id: "vda".into(),
            node: "d0".into(),
            size: 8 << 20,
            image: None,
        };
        let nbd = MigrationAddress::parse_tcp("192.0.2.11:10809").unwrap();
        assert!(check_size(&disk, Some(8 << 20), &nbd).is_ok());
        let e = check_size(&disk, Some(4 << 20), &nbd).unwrap_err();
        assert!(e.starts_with("disk vda is 8388608 bytes here but the target's NBD export 'vda' at 192.0.2.11:10809 is 4194304 bytes"), "{e}");
        assert!(e.contains("qemu-img create -f qcow2 IMAGE 8388608"), "{e}");
        assert!(check_size(&disk, None, &nbd)
            .unwrap_err()
            .contains("disk vda"));
    }

    #[test]
    fn attach_errors_say_what_to_do() {
        let nbd = MigrationAddress::parse_tcp("127.0.0.1:10809").unwrap();
        let refused = QmpError::Command {
            command: "blockdev-add".into(),
            class: "GenericError".into(),
            desc: "Failed to connect to '127.0.0.1:10809': Connection refused".into(),
        };
        let e = attach_error("vda", &nbd, &refused);
        assert!(
            e.starts_with(
                "disk vda: cannot attach to the target's NBD export 'vda' at 127.0.0.1:10809"
            ),
            "{e}"
        );
        assert!(
            e.contains("run hagctl receive --copy-storage on the target first"),
            "{e}"
        );
        let missing = QmpError::Command {
            command: "blockdev-add".into(),
            class: "GenericError".into(),
            desc: "Requested export not available".into(),
        };
        let e = attach_error("vdb", &nbd, &missing);
        assert!(e.contains("the target exports no disk vdb"), "{e}");
        assert!(e.contains("id=vdb"), "{e}");
    }
}
