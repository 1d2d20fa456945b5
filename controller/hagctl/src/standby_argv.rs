//! The standby's QEMU command line, made from the VM's own: every
//! writable disk opens its replica, `DIR/ID.raw` ([`replica_path`]), as a
//! raw image on the device with that id, as `hagctl backup` requires
//! ([`crate::replica::standby_refusal`]).
//!
//! [`standby_argv`] is pure: a QEMU argv in, the rewritten argv out, or an
//! error naming the disk it cannot rewrite. It reads what QEMU 10 takes and
//! libvirt 11 writes: `-blockdev` in JSON or key=value form, `-device` in
//! either form, and `-drive … ,if=none,id=D` used by a `-device …,drive=D`.
//! For each disk device (virtio-blk, scsi-hd, ide-hd, nvme, usb-storage)
//! with a writable drive:
//!
//! - its format node (qcow2, raw, …) becomes `driver=raw`, keeping only
//!   the options every node takes (`node-name`, `read-only`, `cache`,
//!   `discard`, …): a `backing` reference and the format's own options go,
//!   and the backing chain's nodes, which nothing references any more, are
//!   dropped from the command line;
//! - its file node opens the replica (`filename=DIR/ID.raw`), keeping its
//!   other options; a disk on any other protocol (host_device, nbd, iscsi,
//!   …) is an error, since a replica is a file;
//! - a `-drive` gets `file=DIR/ID.raw,format=raw` the same way.
//!
//! Read-only disks and drive-less devices (an empty CD-ROM) are left
//! alone; a writable disk device with no id is an error (the primary
//! refuses such a VM: its replica could not be named). Everything else,
//! and the order of the arguments, is kept as it was; a rewritten JSON
//! argument is written back compactly.
//!
//! One exception to the form: a rewritten node that names a replica's
//! file is written in key=value form (`driver=file,filename=…,
//! cache.direct=on`), since the backup's check of the command line
//! (`standby_refusal`, and the dry run's `create_named`) looks for the
//! replica in `filename=`/`file=` options. QEMU reads both forms alike.
//!
//! ```text
//! -blockdev {"driver":"file","filename":"/img/a.qcow2","node-name":"s1"}
//! -blockdev {"node-name":"f1","read-only":false,"driver":"qcow2","file":"s1","backing":"f2"}
//! -device {"driver":"virtio-blk-pci","drive":"f1","id":"virtio-disk0"}
//! ```
//! becomes (the nodes of `f2`'s chain dropped)
//! ```text
//! -blockdev driver=file,filename=/var/lib/hag/replicas/virtio-disk0.raw,node-name=s1
//! -blockdev {"node-name":"f1","read-only":false,"driver":"raw","file":"s1"}
//! -device {"driver":"virtio-blk-pci","drive":"f1","id":"virtio-disk0"}
//! ```
//!
//! [`libvirt_domain_argv`] gets a libvirt domain's command line from
//! `virsh domxml-to-native qemu-argv`, for `hagctl backup
//! --libvirt-domain`.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::replica::replica_path;
use crate::wire::{is_disk_id, DISK_ID_MAX};

/// The devices whose `drive` is a disk the guest writes (as the primary
/// sees it: a writable block node on a device with an id).
const DISK_DEVICES: &[&str] = &[
    "virtio-blk-pci",
    "virtio-blk-pci-transitional",
    "virtio-blk-pci-non-transitional",
    "virtio-blk-device",
    "virtio-blk-ccw",
    "scsi-hd",
    "ide-hd",
    "nvme",
    "nvme-ns",
    "usb-storage",
];

/// The options every block node takes (QAPI's BlockdevOptionsBase), plus
/// `file`: all a raw format node over the replica keeps.
const NODE_OPTIONS: &[&str] = &[
    "driver",
    "node-name",
    "file",
    "discard",
    "cache",
    "read-only",
    "auto-read-only",
    "force-share",
    "detect-zeroes",
];

/// The options of `-drive` that are not its format's: all a `-drive` of a
/// replica keeps (with those starting with [`DRIVE_OPTION_PREFIXES`]).
const DRIVE_OPTIONS: &[&str] = &[
    "file",
    "format",
    "driver",
    "if",
    "bus",
    "unit",
    "index",
    "media",
    "snapshot",
    "id",
    "serial",
    "addr",
    "werror",
    "rerror",
    "copy-on-read",
    "cache",
    "aio",
    "discard",
    "detect-zeroes",
    "read-only",
    "readonly",
    "auto-read-only",
    "force-share",
    "node-name",
    "group",
    "stats-account-invalid",
    "stats-account-failed",
];

/// Prefixes of `-drive` options that are not its format's: the file
/// node's (`file.locking`), the cache mode's and the I/O throttling's.
const DRIVE_OPTION_PREFIXES: &[&str] = &[
    "file.",
    "cache.",
    "throttling.",
    "bps",
    "iops",
    "stats-intervals",
];

/// Why a QEMU command line cannot be made a standby's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StandbyArgvError {
    #[error("{option} at the end of the command line has no value")]
    NoValue { option: String },
    #[error("{option} {value}: {why}")]
    Malformed {
        option: String,
        value: String,
        why: String,
    },
    #[error(
        "the writable disk on drive {drive} has no device id: give its device one \
         (-device …,id=NAME; libvirt names its disks), so that its replica can be named"
    )]
    NoId { drive: String },
    #[error(
        "disk device id '{id}' cannot name a replica (at most {DISK_ID_MAX} of A-Z a-z 0-9 . _ -)"
    )]
    BadId { id: String },
    #[error("disk {id}'s drive {drive} is neither a -blockdev node-name nor a -drive id of this command line")]
    UnknownDrive { id: String, drive: String },
    #[error(
        "disk {id} is on a {driver} node ({node}), not on a file: its replica is a file, \
         which only a 'file' node opens"
    )]
    NotAFile {
        id: String,
        node: String,
        driver: String,
    },
}

/// A writable disk [`standby`] gave its replica.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicatedDisk {
    /// Its device's id, which names the replica.
    pub id: String,
    /// The image file the VM's own command line opens for it.
    pub image: String,
    /// The file the standby opens instead.
    pub replica: PathBuf,
}

/// A standby's command line and the disks it opens replicas of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Standby {
    pub argv: Vec<String>,
    pub disks: Vec<ReplicatedDisk>,
}

/// The QEMU command line `argv` with each writable disk device opening
/// its replica in `dir` as a raw image (see the module's documentation).
pub fn standby_argv(argv: &[String], dir: &Path) -> Result<Vec<String>, StandbyArgvError> {
    standby(argv, dir).map(|s| s.argv)
}

/// [`standby_argv`], with the disks it rewrote.
pub fn standby(argv: &[String], dir: &Path) -> Result<Standby, StandbyArgvError> {
    let mut args = parse_args(argv)?;
    let referenced_before = references(&args);
    let nodes: HashMap<String, usize> = args
        .iter()
        .enumerate()
        .filter(|(_, a)| a.kind == Kind::Blockdev)
        .filter_map(|(i, a)| Some((a.opts.get("node-name")?, i)))
        .collect();
    let drives: HashMap<String, usize> = args
        .iter()
        .enumerate()
        .filter(|(_, a)| a.kind == Kind::Drive)
        .filter_map(|(i, a)| Some((a.opts.get("id")?, i)))
        .collect();
    let mut used_drives = HashSet::new();
    let mut disks = Vec::new();
    for i in 0..args.len() {
        let dev = &args[i];
        if dev.kind != Kind::Device
            || !DISK_DEVICES.contains(&dev.opts.device_driver().unwrap_or_default().as_str())
        {
            continue;
        }
        // A device with no drive: an empty CD-ROM or floppy.
        let Some(drive) = dev.opts.get("drive").filter(|d| !d.is_empty()) else {
            continue;
        };
        let id = dev.opts.get("id");
        if let Some(&n) = nodes.get(&drive) {
            disks.extend(rewrite_node(&mut args, n, &nodes, id, &drive, dir)?);
        } else if let Some(&d) = drives.get(&drive) {
            used_drives.insert(d);
            disks.extend(rewrite_drive(&mut args[d], id, &drive, dir)?);
        } else {
            return Err(StandbyArgvError::UnknownDrive {
                id: id.unwrap_or_else(|| "(no id)".into()),
                drive,
            });
        }
    }
    // A -drive no -device uses makes a device of its own, with no id,
    // unless if=none.
    for (i, a) in args.iter().enumerate() {
        if a.kind != Kind::Drive || used_drives.contains(&i) {
            continue;
        }
        let bus = a.opts.get("if").unwrap_or_else(|| "ide".into());
        if bus != "none" && drive_is_writable(&a.opts) {
            let name = a.opts.get("id").or_else(|| a.opts.get("file"));
            return Err(StandbyArgvError::NoId {
                drive: format!("-drive {} (if={bus})", name.unwrap_or_default()),
            });
        }
    }
    drop_orphans(&mut args, &referenced_before);
    Ok(Standby {
        argv: render(argv, &args),
        disks,
    })
}

/// The words of a command line printed by `virsh domxml-to-native
/// qemu-argv`: shell words, the environment assignments before the
/// program (`LC_ALL=C PATH=… HOME=…`) left out.
pub fn native_argv(text: &str) -> Result<Vec<String>, String> {
    let words = shell_words::split(text.trim())
        .map_err(|e| format!("cannot read its command line as shell words: {e}"))?;
    let argv: Vec<String> = words.into_iter().skip_while(|w| is_assignment(w)).collect();
    if argv.is_empty() {
        return Err(format!("no QEMU command in {:?}", text.trim()));
    }
    Ok(argv)
}

/// `NAME=VALUE`, as a shell reads an environment assignment.
fn is_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(name, _)| {
        name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

/// `argv` without what ties libvirt's command line to a domain libvirt
/// runs, which a standby started by hagctl must not have: libvirt's
/// monitor (`-chardev …id=charmonitor` and its `-mon`), its master key
/// (`-object secret,id=masterKey0`, a file in the running domain's
/// directory) and the guest RAM backend `-machine memory-backend=` names
/// (hagctl's standby puts guest RAM on its standby image under the same
/// id). Options it cannot read are kept as they are.
pub fn without_libvirt_runtime(argv: &[String]) -> Vec<String> {
    let opts = |value: &str| Opts::parse(value).ok();
    let option = |word: &str| word.trim_start_matches('-').to_owned();
    let ram_backend = argv.windows(2).find_map(|w| {
        (option(&w[0]) == "machine")
            .then(|| opts(&w[1])?.get("memory-backend"))
            .flatten()
    });
    let object_type = |o: &Opts| match o {
        Opts::Json(_) => o.get("qom-type"),
        Opts::KeyValue(_) => o.device_driver(),
    };
    let libvirts = |flag: &str, value: &str| -> bool {
        let Some(o) = opts(value) else {
            return false;
        };
        match flag {
            "chardev" => o.get("id").as_deref() == Some("charmonitor"),
            "mon" => o.get("chardev").as_deref() == Some("charmonitor"),
            "object" => {
                let (kind, id) = (object_type(&o).unwrap_or_default(), o.get("id"));
                (kind == "secret" && id.as_deref() == Some("masterKey0"))
                    || (kind.starts_with("memory-backend-") && id.is_some() && id == ram_backend)
            }
            _ => false,
        }
    };
    let mut out = Vec::with_capacity(argv.len());
    let mut i = 0;
    while i < argv.len() {
        let flag = option(&argv[i]);
        if argv[i].starts_with('-') && i + 1 < argv.len() && libvirts(&flag, &argv[i + 1]) {
            i += 2;
            continue;
        }
        out.push(argv[i].clone());
        i += 1;
    }
    out
}

/// `argv` with each network backend that libvirt opens and passes as
/// file descriptors (`-netdev` with `fd` or `fds`: only a QEMU libvirt
/// starts has them) opened by QEMU itself, as a `bridge` backend (QEMU's
/// bridge helper: the host's `/etc/qemu/bridge.conf` must allow the
/// bridge) on the host bridge of the domain's `<interface>`. The
/// interface is found by the MAC address of the `-device` that uses the
/// backend; `bridge_of(MAC)` names its bridge, or says why a standby
/// cannot join one. Other backends are kept as they are.
pub fn with_bridged_netdevs(
    argv: &[String],
    bridge_of: impl Fn(&str) -> Result<String, String>,
) -> Result<Vec<String>, String> {
    let opts_of = |value: &str| Opts::parse(value).map_err(|e| format!("{value}: {e}"));
    let option = |word: &str| word.trim_start_matches('-').to_owned();
    let mut macs: HashMap<String, String> = HashMap::new();
    for w in argv.windows(2).filter(|w| option(&w[0]) == "device") {
        let dev = opts_of(&w[1])?;
        if let (Some(netdev), Some(mac)) = (dev.get("netdev"), dev.get("mac")) {
            macs.insert(netdev, mac.to_ascii_lowercase());
        }
    }
    let mut out = argv.to_vec();
    for i in 1..argv.len() {
        if option(&argv[i - 1]) != "netdev" || !argv[i - 1].starts_with('-') {
            continue;
        }
        let netdev = opts_of(&argv[i])?;
        if netdev.get("fd").is_none() && netdev.get("fds").is_none() {
            continue;
        }
        let id = netdev
            .get("id")
            .ok_or_else(|| format!("-netdev {} has no id", argv[i]))?;
        let mac = macs.get(&id).ok_or_else(|| {
            format!("-netdev {id}: no -device with a MAC address uses it, so no <interface> can be told for it")
        })?;
        let br = bridge_of(mac).map_err(|why| format!("the interface with MAC {mac}: {why}"))?;
        let bridged = match netdev {
            Opts::Json(_) => Opts::Json(vec![
                ("type".into(), Value::from("bridge")),
                ("br".into(), Value::from(br)),
                ("id".into(), Value::from(id)),
            ]),
            Opts::KeyValue(_) => Opts::KeyValue(vec![
                ("type".into(), Some("bridge".into())),
                ("br".into(), Some(br)),
                ("id".into(), Some(id)),
            ]),
        };
        out[i] = bridged.render();
    }
    Ok(out)
}

/// The QEMU command line libvirt would start the domain of the file `xml`
/// with: `virsh [--connect URI] domxml-to-native qemu-argv XML`, without
/// what ties it to a running domain ([`without_libvirt_runtime`]), and
/// its network interfaces on their host bridges
/// ([`with_bridged_netdevs`]).
pub fn libvirt_domain_argv(xml: &Path, uri: Option<&str>) -> Result<Vec<String>, String> {
    let what = format!("virsh domxml-to-native qemu-argv {}", xml.display());
    let text = virsh(uri, &["domxml-to-native", "qemu-argv"], Some(xml))
        .map_err(|e| format!("{what}: {e}"))?;
    let argv = native_argv(&text)
        .map(|argv| without_libvirt_runtime(&argv))
        .map_err(|e| format!("{what}: {e}"))?;
    let domain = std::fs::read_to_string(xml)
        .map_err(|e| format!("{}: {e}", xml.display()))
        .and_then(|text| crate::libvirt_domain::parse(&text))
        .map_err(|e| format!("{}: {e}", xml.display()))?;
    let bridge_of = |mac: &str| -> Result<String, String> {
        let interface = domain
            .interfaces
            .iter()
            .find(|i| {
                i.mac
                    .as_deref()
                    .is_some_and(|m| m.eq_ignore_ascii_case(mac))
            })
            .ok_or_else(|| format!("no <interface> of {} has it", xml.display()))?;
        let source = interface.source.clone();
        match (interface.kind.as_str(), source) {
            ("bridge", Some(bridge)) => Ok(bridge),
            ("network", Some(network)) => network_bridge(uri, &network),
            (kind, _) => Err(format!(
                "a standby started by hagctl joins only a host bridge (<interface type='bridge'>, or type='network' \
                 with a bridge), not <interface type='{kind}'>"
            )),
        }
    };
    with_bridged_netdevs(&argv, bridge_of)
}

/// The host bridge of libvirt network `network` (`<bridge name=…>` of
/// `virsh net-dumpxml`).
fn network_bridge(uri: Option<&str>, network: &str) -> Result<String, String> {
    let text = virsh(uri, &["net-dumpxml", network], None)
        .map_err(|e| format!("virsh net-dumpxml {network}: {e}"))?;
    let doc = roxmltree::Document::parse(&text)
        .map_err(|e| format!("virsh net-dumpxml {network}: {e}"))?;
    doc.descendants()
        .find(|n| n.has_tag_name("bridge"))
        .and_then(|b| b.attribute("name"))
        .map(str::to_owned)
        .ok_or_else(|| format!("libvirt network '{network}' has no bridge"))
}

/// What `virsh [--connect URI] ARGS [FILE]` prints, or what went wrong.
fn virsh(uri: Option<&str>, args: &[&str], file: Option<&Path>) -> Result<String, String> {
    let mut cmd = Command::new("virsh");
    if let Some(uri) = uri {
        cmd.args(["--connect", uri]);
    }
    cmd.args(args);
    if let Some(file) = file {
        cmd.arg(file);
    }
    let out = cmd.output().map_err(|e| format!("cannot run virsh: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    String::from_utf8(out.stdout).map_err(|_| "its output is not UTF-8".to_owned())
}

/// Rewrites the block node `n`, the drive of the disk device `id`, to
/// open the replica as raw: itself if it is a file node, else the file
/// node under it and it as the raw format node over that. `None`: a
/// read-only disk, left alone.
fn rewrite_node(
    args: &mut [Arg],
    n: usize,
    nodes: &HashMap<String, usize>,
    id: Option<String>,
    drive: &str,
    dir: &Path,
) -> Result<Option<ReplicatedDisk>, StandbyArgvError> {
    let top = &args[n].opts;
    if top.get("read-only").is_some_and(|v| is_true(&v)) {
        return Ok(None);
    }
    let id = disk_id(id, drive)?;
    let replica = replica_path(dir, &id);
    let path = replica.to_string_lossy().into_owned();
    let replicated = |image: Option<String>| ReplicatedDisk {
        id: id.clone(),
        image: image.unwrap_or_default(),
        replica: replica.clone(),
    };
    let driver = top.get("driver").unwrap_or_default();
    let not_a_file = |node: &str, driver: String| StandbyArgvError::NotAFile {
        id: id.clone(),
        node: node.to_owned(),
        driver,
    };
    if driver == "file" {
        // A raw image: libvirt puts the device straight on its file node.
        let disk = replicated(args[n].opts.get("filename"));
        args[n].opts.set("filename", &path);
        args[n].names_replica = true;
        return Ok(Some(disk));
    }
    let disk;
    match top.child("file") {
        Child::Ref(file) => {
            let &f = nodes
                .get(&file)
                .ok_or_else(|| not_a_file(&file, "(no -blockdev of that node-name)".to_owned()))?;
            let file_driver = args[f].opts.get("driver").unwrap_or_default();
            if file_driver != "file" {
                return Err(not_a_file(&file, file_driver));
            }
            disk = replicated(args[f].opts.get("filename"));
            args[f].opts.set("filename", &path);
            args[f].names_replica = true;
        }
        Child::Inline => {
            let file_driver = top.get("file.driver").unwrap_or_default();
            if file_driver != "file" {
                return Err(not_a_file(&format!("{drive}'s file"), file_driver));
            }
            disk = replicated(args[n].opts.get("file.filename"));
            args[n].opts.set("file.filename", &path);
            args[n].names_replica = true;
        }
        // A protocol node under the device: host_device, nbd, iscsi, …
        Child::None => return Err(not_a_file(drive, driver)),
    }
    let opts = &mut args[n].opts;
    opts.retain(|key| NODE_OPTIONS.contains(&first_segment(key)));
    opts.set("driver", "raw");
    args[n].changed = true;
    Ok(Some(disk))
}

/// Rewrites the `-drive` of the disk device `id` to open the replica as
/// raw. `None`: not a writable disk, left alone.
fn rewrite_drive(
    arg: &mut Arg,
    id: Option<String>,
    drive: &str,
    dir: &Path,
) -> Result<Option<ReplicatedDisk>, StandbyArgvError> {
    let opts = &mut arg.opts;
    if !drive_is_writable(opts) {
        return Ok(None);
    }
    let id = disk_id(id, drive)?;
    let file = opts.get("file.filename").or_else(|| opts.get("file"));
    let protocol = match opts.get("file.driver") {
        Some(driver) => Some(driver).filter(|d| d != "file"),
        None => file.as_deref().and_then(file_protocol),
    };
    if let Some(driver) = protocol {
        return Err(StandbyArgvError::NotAFile {
            id,
            node: format!("-drive {drive}"),
            driver,
        });
    }
    let replica = replica_path(dir, &id);
    let path = replica.to_string_lossy().into_owned();
    let image = file.unwrap_or_default();
    opts.retain(|key| {
        DRIVE_OPTIONS.contains(&key) || DRIVE_OPTION_PREFIXES.iter().any(|p| key.starts_with(p))
    });
    if opts.get("file.filename").is_some() {
        opts.set("file.filename", &path);
    } else {
        opts.set("file", &path);
    }
    if opts.get("driver").is_some() {
        opts.set("driver", "raw");
    } else {
        opts.set("format", "raw");
    }
    arg.changed = true;
    Ok(Some(ReplicatedDisk { id, image, replica }))
}

/// The protocol QEMU would open `-drive file=NAME` with, when not a
/// file: `nbd:…`, `iscsi://…`, or a host device under /dev.
fn file_protocol(name: &str) -> Option<String> {
    if let Some((protocol, _)) = name.split_once(':') {
        if !protocol.is_empty() && !protocol.contains('/') {
            return Some(protocol.to_owned());
        }
    }
    (name.starts_with("/dev/") && !name.starts_with("/dev/shm/")).then(|| "host_device".into())
}

/// Whether a `-drive` is a disk the guest can write (not read-only, not
/// a CD-ROM, not empty).
fn drive_is_writable(opts: &Opts) -> bool {
    let read_only = ["readonly", "read-only"]
        .iter()
        .any(|k| opts.get(k).is_some_and(|v| is_true(&v)));
    let cdrom = opts.get("media").as_deref() == Some("cdrom");
    let empty = opts.get("file").is_none() && opts.get("file.filename").is_none();
    !read_only && !cdrom && !empty
}

/// A writable disk device's id, which names its replica.
fn disk_id(id: Option<String>, drive: &str) -> Result<String, StandbyArgvError> {
    let id = id
        .filter(|i| !i.is_empty())
        .ok_or_else(|| StandbyArgvError::NoId {
            drive: drive.to_owned(),
        })?;
    if !is_disk_id(&id) {
        return Err(StandbyArgvError::BadId { id });
    }
    Ok(id)
}

/// QEMU's true, in a JSON or key=value option.
fn is_true(v: &str) -> bool {
    matches!(v, "on" | "true" | "yes" | "y")
}

fn first_segment(key: &str) -> &str {
    key.split('.').next().unwrap_or(key)
}

/// The node names referenced by the arguments (any option's value that
/// is a node-name, other than a node's own).
fn references(args: &[Arg]) -> HashSet<String> {
    args.iter()
        .filter(|a| !a.dropped)
        .flat_map(|a| a.opts.values())
        .filter(|(key, _)| key != "node-name" && key != "id")
        .map(|(_, value)| value)
        .collect()
}

/// Drops the -blockdev nodes that something referenced before the
/// rewrite and nothing does now (a replaced disk's backing chain), until
/// none is left.
fn drop_orphans(args: &mut [Arg], referenced_before: &HashSet<String>) {
    loop {
        let now = references(args);
        let mut dropped = false;
        for a in args.iter_mut() {
            if a.kind != Kind::Blockdev || a.dropped {
                continue;
            }
            if let Some(name) = a.opts.get("node-name") {
                if referenced_before.contains(&name) && !now.contains(&name) {
                    a.dropped = true;
                    dropped = true;
                }
            }
        }
        if !dropped {
            return;
        }
    }
}

/// `argv` with the changes of `args`.
fn render(argv: &[String], args: &[Arg]) -> Vec<String> {
    let by_value: HashMap<usize, &Arg> = args.iter().map(|a| (a.at, a)).collect();
    let mut out = Vec::with_capacity(argv.len());
    for (i, word) in argv.iter().enumerate() {
        let this = by_value.get(&i);
        let next = by_value.get(&(i + 1));
        if this.is_some_and(|a| a.dropped) || next.is_some_and(|a| a.dropped) {
            continue;
        }
        match this {
            Some(a) if a.names_replica => out.push(a.opts.to_key_value().render()),
            Some(a) if a.changed => out.push(a.opts.render()),
            _ => out.push(word.clone()),
        }
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Blockdev,
    Device,
    Drive,
}

/// A `-blockdev`, `-device` or `-drive` of the command line.
#[derive(Debug)]
struct Arg {
    kind: Kind,
    /// The index of its value in the argv.
    at: usize,
    opts: Opts,
    /// Its options were changed.
    changed: bool,
    /// It names a replica's file (written as key=value).
    names_replica: bool,
    /// It is left out.
    dropped: bool,
}

fn parse_args(argv: &[String]) -> Result<Vec<Arg>, StandbyArgvError> {
    let mut args = Vec::new();
    let mut i = 0;
    while i < argv.len() {
        // QEMU takes -opt and --opt alike.
        let option = argv[i].strip_prefix('-').unwrap_or("");
        let kind = match option.strip_prefix('-').unwrap_or(option) {
            "blockdev" => Kind::Blockdev,
            "device" => Kind::Device,
            "drive" => Kind::Drive,
            _ => {
                i += 1;
                continue;
            }
        };
        let value = argv.get(i + 1).ok_or_else(|| StandbyArgvError::NoValue {
            option: argv[i].clone(),
        })?;
        // -drive takes key=value only.
        let opts = if kind == Kind::Drive {
            Opts::KeyValue(split_key_values(value))
        } else {
            Opts::parse(value).map_err(|e| StandbyArgvError::Malformed {
                option: argv[i].clone(),
                value: value.clone(),
                why: e.to_string(),
            })?
        };
        args.push(Arg {
            kind,
            at: i + 1,
            opts,
            changed: false,
            names_replica: false,
            dropped: false,
        });
        i += 2;
    }
    Ok(args)
}

/// An option's value: a JSON object (its fields in their order), or
/// QEMU's `key=value,…` (a bare word: `-device`'s driver, or a flag).
#[derive(Clone, Debug, PartialEq)]
enum Opts {
    Json(Vec<(String, Value)>),
    KeyValue(Vec<(String, Option<String>)>),
}

/// How an option refers to a child node.
enum Child {
    /// By node-name.
    Ref(String),
    /// Defined in place (a JSON object, or `file.driver=…` options).
    Inline,
    None,
}

impl Opts {
    /// An option's value as QEMU reads it: JSON if it starts with `{`,
    /// else key=value.
    fn parse(value: &str) -> Result<Opts, serde_json::Error> {
        if value.starts_with('{') {
            serde_json::from_str::<Ordered>(value).map(|Ordered(fields)| Opts::Json(fields))
        } else {
            Ok(Opts::KeyValue(split_key_values(value)))
        }
    }

    /// The value of `key` (dotted for a nested one: `file.driver`) as a
    /// string, if a string, number or boolean (`on`/`off`).
    fn get(&self, key: &str) -> Option<String> {
        match self {
            Opts::Json(fields) => {
                let mut path = key.split('.');
                let first = path.next()?;
                let mut v = fields.iter().find(|(k, _)| k == first).map(|(_, v)| v)?;
                for step in path {
                    v = v.get(step)?;
                }
                scalar(v)
            }
            Opts::KeyValue(items) => items
                .iter()
                .find(|(k, v)| k == key && v.is_some())
                .and_then(|(_, v)| v.clone()),
        }
    }

    /// A `-device`'s driver (in key=value form, the first bare word).
    fn device_driver(&self) -> Option<String> {
        match self {
            Opts::Json(_) => self.get("driver"),
            Opts::KeyValue(items) => self.get("driver").or_else(|| {
                items
                    .first()
                    .filter(|(_, v)| v.is_none())
                    .map(|(k, _)| k.clone())
            }),
        }
    }

    fn child(&self, name: &str) -> Child {
        match self {
            Opts::Json(fields) => match fields.iter().find(|(k, _)| k == name) {
                Some((_, Value::String(s))) => Child::Ref(s.clone()),
                Some((_, Value::Object(_))) => Child::Inline,
                _ => Child::None,
            },
            Opts::KeyValue(items) => {
                let prefix = format!("{name}.");
                match self.get(name) {
                    Some(node) => Child::Ref(node),
                    None if items.iter().any(|(k, _)| k.starts_with(&prefix)) => Child::Inline,
                    None => Child::None,
                }
            }
        }
    }

    /// Sets the string `key` (dotted for a nested one), adding it at the
    /// end if it is not there.
    fn set(&mut self, key: &str, value: &str) {
        match self {
            Opts::Json(fields) => {
                let (first, rest) = key.split_once('.').unwrap_or((key, ""));
                let slot = match fields.iter_mut().find(|(k, _)| k == first) {
                    Some((_, v)) => v,
                    None => {
                        fields.push((first.to_owned(), Value::Null));
                        &mut fields.last_mut().expect("just pushed").1
                    }
                };
                let mut slot = slot;
                for step in rest.split('.').filter(|s| !s.is_empty()) {
                    if !slot.is_object() {
                        *slot = Value::Object(serde_json::Map::new());
                    }
                    slot = slot
                        .as_object_mut()
                        .expect("made an object")
                        .entry(step)
                        .or_insert(Value::Null);
                }
                *slot = Value::String(value.to_owned());
            }
            Opts::KeyValue(items) => match items.iter_mut().find(|(k, _)| k == key) {
                Some((_, v)) => *v = Some(value.to_owned()),
                None => items.push((key.to_owned(), Some(value.to_owned()))),
            },
        }
    }

    /// Keeps the options whose (top-level or dotted) key `keep` accepts.
    fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        match self {
            Opts::Json(fields) => fields.retain(|(k, _)| keep(k)),
            Opts::KeyValue(items) => items.retain(|(k, _)| keep(k)),
        }
    }

    /// Every string value with the (dotted) key it is at.
    fn values(&self) -> Vec<(String, String)> {
        match self {
            Opts::Json(fields) => {
                let mut out = Vec::new();
                for (k, v) in fields {
                    flatten(k, v, &mut out);
                }
                out.into_iter().filter_map(|(k, v)| Some((k, v?))).collect()
            }
            Opts::KeyValue(items) => items
                .iter()
                .filter_map(|(k, v)| Some((k.clone(), v.clone()?)))
                .collect(),
        }
    }

    /// The same options in key=value form (nested ones dotted), or as
    /// they are if one cannot be written so (a JSON null).
    fn to_key_value(&self) -> Opts {
        match self {
            Opts::Json(fields) => {
                let mut out = Vec::new();
                for (k, v) in fields {
                    flatten(k, v, &mut out);
                }
                if out.iter().any(|(_, v)| v.is_none()) {
                    return self.clone();
                }
                Opts::KeyValue(out)
            }
            Opts::KeyValue(_) => self.clone(),
        }
    }

    /// As QEMU reads it: compact JSON, or key=value with commas doubled.
    fn render(&self) -> String {
        match self {
            Opts::Json(fields) => {
                let fields: Vec<String> = fields
                    .iter()
                    .map(|(k, v)| format!("{}:{v}", Value::from(k.as_str())))
                    .collect();
                format!("{{{}}}", fields.join(","))
            }
            Opts::KeyValue(items) => items
                .iter()
                .map(|(k, v)| match v {
                    Some(v) => format!("{k}={}", v.replace(',', ",,")),
                    None => k.replace(',', ",,"),
                })
                .collect::<Vec<_>>()
                .join(","),
        }
    }
}

/// A JSON string, number or boolean as QEMU's key=value form writes it.
fn scalar(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Bool(b) => Some(if *b { "on" } else { "off" }.to_owned()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// `v` at `key` as dotted key=value pairs (a null: `None`).
fn flatten(key: &str, v: &Value, out: &mut Vec<(String, Option<String>)>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                flatten(&format!("{key}.{k}"), v, out);
            }
        }
        Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                flatten(&format!("{key}.{i}"), v, out);
            }
        }
        _ => out.push((key.to_owned(), scalar(v))),
    }
}

/// Splits QEMU's `key=value,…` (`,,` is a comma in a value).
fn split_key_values(text: &str) -> Vec<(String, Option<String>)> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut chars = text.chars().peekable();
    loop {
        match chars.next() {
            Some(',') if chars.peek() == Some(&',') => {
                chars.next();
                word.push(',');
            }
            Some(',') => words.push(std::mem::take(&mut word)),
            None => {
                words.push(word);
                break;
            }
            Some(c) => word.push(c),
        }
    }
    words
        .into_iter()
        .map(|w| match w.split_once('=') {
            Some((k, v)) => (k.to_owned(), Some(v.to_owned())),
            None => (w, None),
        })
        .collect()
}

/// A JSON object's fields in their order.
struct Ordered(Vec<(String, Value)>);

impl<'de> serde::Deserialize<'de> for Ordered {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Ordered, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = Ordered;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Ordered, A::Error> {
                let mut fields = Vec::new();
                while let Some(field) = map.next_entry::<String, Value>()? {
                    fields.push(field);
                }
                Ok(Ordered(fields))
            }
        }
        d.deserialize_map(Fields)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replica::standby_refusal;

    const DIR: &str = "/var/lib/hag/replicas";

    fn argv(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| (*w).to_owned()).collect()
    }

    fn rewrite(words: &[&str]) -> Result<Vec<String>, StandbyArgvError> {
        standby_argv(&argv(words), Path::new(DIR))
    }

    /// The backup's own check: the standby opens disk `id`'s replica.
    fn opens_replica(cmd: &[String], id: &str) -> bool {
        standby_refusal(cmd, id, &replica_path(Path::new(DIR), id)).is_none()
    }

    #[test]
    fn a_libvirt_qcow2_disk_with_a_backing_chain_opens_its_replica_raw() {
        // As libvirt 11 writes it (virsh domxml-to-native), with a
        // two-node backing chain and a read-only raw disk beside it.
        let cmd = [
            "/usr/bin/qemu-system-x86_64",
            "-name",
            "guest=vm,debug-threads=on",
            "-blockdev",
            r#"{"driver":"file","filename":"/img/base.qcow2","node-name":"libvirt-2-storage","auto-read-only":true,"discard":"unmap"}"#,
            "-blockdev",
            r#"{"node-name":"libvirt-2-format","read-only":true,"discard":"unmap","driver":"qcow2","file":"libvirt-2-storage","backing":null}"#,
            "-blockdev",
            r#"{"driver":"file","filename":"/img/a.qcow2","node-name":"libvirt-1-storage","auto-read-only":true,"discard":"unmap","cache":{"direct":true,"no-flush":false}}"#,
            "-blockdev",
            r#"{"node-name":"libvirt-1-format","read-only":false,"discard":"unmap","cache":{"direct":true,"no-flush":false},"driver":"qcow2","file":"libvirt-1-storage","backing":"libvirt-2-format","l2-cache-size":1048576}"#,
            "-device",
            r#"{"driver":"virtio-blk-pci","bus":"pci.3","addr":"0x0","drive":"libvirt-1-format","id":"virtio-disk0","bootindex":1}"#,
            "-blockdev",
            r#"{"driver":"file","filename":"/img/ro.img","node-name":"libvirt-3-storage","read-only":true}"#,
            "-device",
            r#"{"driver":"virtio-blk-pci","bus":"pci.4","addr":"0x0","drive":"libvirt-3-storage","id":"virtio-disk1"}"#,
            "-msg",
            "timestamp=on",
        ];
        let out = rewrite(&cmd).unwrap();
        assert_eq!(
            out,
            argv(&[
                "/usr/bin/qemu-system-x86_64",
                "-name",
                "guest=vm,debug-threads=on",
                "-blockdev",
                "driver=file,filename=/var/lib/hag/replicas/virtio-disk0.raw,node-name=libvirt-1-storage,\
                 auto-read-only=on,discard=unmap,cache.direct=on,cache.no-flush=off",
                "-blockdev",
                r#"{"node-name":"libvirt-1-format","read-only":false,"discard":"unmap","cache":{"direct":true,"no-flush":false},"driver":"raw","file":"libvirt-1-storage"}"#,
            ]
            .into_iter()
            .chain(cmd[11..].iter().copied())
            .collect::<Vec<_>>())
        );
        assert!(opens_replica(&out, "virtio-disk0"));
        // The one writable disk, with the image it replaces.
        assert_eq!(
            standby(&argv(&cmd), Path::new(DIR)).unwrap().disks,
            [ReplicatedDisk {
                id: "virtio-disk0".into(),
                image: "/img/a.qcow2".into(),
                replica: PathBuf::from(DIR).join("virtio-disk0.raw"),
            }]
        );
        // A rewritten command line is its own rewrite.
        assert_eq!(standby_argv(&out, Path::new(DIR)).unwrap(), out);
    }

    #[test]
    fn a_libvirt_raw_disk_on_its_file_node_opens_its_replica() {
        let out = rewrite(&[
            "qemu",
            "-blockdev",
            r#"{"driver":"file","filename":"/img/data.raw","node-name":"libvirt-1-storage","read-only":false}"#,
            "-device",
            r#"{"driver":"scsi-hd","bus":"scsi0.0","drive":"libvirt-1-storage","id":"ua-data"}"#,
        ])
        .unwrap();
        assert_eq!(
            out[2],
            "driver=file,filename=/var/lib/hag/replicas/ua-data.raw,node-name=libvirt-1-storage,read-only=off"
        );
        assert!(opens_replica(&out, "ua-data"));
    }

    #[test]
    fn key_value_blockdevs_open_the_replica() {
        let out = rewrite(&[
            "qemu-system-x86_64",
            "-blockdev",
            "driver=file,filename=/tmp/vm-disk.qcow2,node-name=disk0-file",
            "-blockdev",
            "driver=qcow2,file=disk0-file,node-name=disk0,lazy-refcounts=on,cache.direct=on",
            "-device",
            "virtio-blk-pci,drive=disk0,id=vda",
        ])
        .unwrap();
        assert_eq!(
            out,
            argv(&[
                "qemu-system-x86_64",
                "-blockdev",
                "driver=file,filename=/var/lib/hag/replicas/vda.raw,node-name=disk0-file",
                "-blockdev",
                "driver=raw,file=disk0-file,node-name=disk0,cache.direct=on",
                "-device",
                "virtio-blk-pci,drive=disk0,id=vda",
            ])
        );
        assert!(opens_replica(&out, "vda"));
        // An inline file node, in either form.
        let out = rewrite(&[
            "qemu",
            "--blockdev",
            "driver=qcow2,file.driver=file,file.filename=/tmp/d.qcow2,node-name=d0",
            "-device",
            "driver=nvme,drive=d0,serial=s,id=nvme0",
        ])
        .unwrap();
        assert_eq!(
            out[2],
            "driver=raw,file.driver=file,file.filename=/var/lib/hag/replicas/nvme0.raw,node-name=d0"
        );
        let out = rewrite(&[
            "qemu",
            "-blockdev",
            r#"{"driver":"qcow2","node-name":"d0","file":{"driver":"file","filename":"/tmp/d.qcow2"}}"#,
            "-device",
            "usb-storage,drive=d0,id=stick",
        ])
        .unwrap();
        assert_eq!(
            out[2],
            "driver=raw,node-name=d0,file.driver=file,file.filename=/var/lib/hag/replicas/stick.raw"
        );
        assert!(opens_replica(&out, "stick"));
    }

    #[test]
    fn a_drive_opens_the_replica() {
        let out = rewrite(&[
            "qemu",
            "-drive",
            "file=/srv/vm.qcow2,format=qcow2,if=none,id=drive0,cache=none,l2-cache-size=4M",
            "-device",
            "ide-hd,drive=drive0,id=sata0",
        ])
        .unwrap();
        assert_eq!(
            out[2],
            "file=/var/lib/hag/replicas/sata0.raw,format=raw,if=none,id=drive0,cache=none"
        );
        assert!(opens_replica(&out, "sata0"));
        let disks = standby(
            &argv(&[
                "qemu",
                "-drive",
                "file=/srv/vm.qcow2,if=none,id=d",
                "-device",
                "ide-hd,drive=d,id=sata0",
            ]),
            Path::new(DIR),
        )
        .unwrap()
        .disks;
        assert_eq!(
            (disks[0].id.as_str(), disks[0].image.as_str()),
            ("sata0", "/srv/vm.qcow2")
        );
        // No format given: raw, said.
        let out = rewrite(&[
            "qemu",
            "-drive",
            "file=/srv/vm.img,if=none,id=d",
            "-device",
            "virtio-blk-pci,drive=d,id=vda",
        ])
        .unwrap();
        assert_eq!(
            out[2],
            "file=/var/lib/hag/replicas/vda.raw,if=none,id=d,format=raw"
        );
    }

    #[test]
    fn read_only_disks_and_empty_cdroms_are_left_alone() {
        let cmd = [
            "qemu",
            "-blockdev",
            "driver=file,filename=/img/ro.qcow2,node-name=f,read-only=on",
            "-blockdev",
            "driver=qcow2,file=f,node-name=d,read-only=on",
            "-device",
            "virtio-blk-pci,drive=d,id=vda",
            "-drive",
            "file=/img/seed.img,format=raw,if=none,id=seed,readonly=on",
            "-device",
            "virtio-blk-pci,drive=seed,id=vdb",
            "-drive",
            "file=/img/cd.iso,media=cdrom",
            "-device",
            r#"{"driver":"ide-cd","bus":"ide.0","id":"sata0-0-0"}"#,
            "-device",
            "scsi-hd,id=nodrive",
        ];
        assert_eq!(rewrite(&cmd).unwrap(), argv(&cmd));
    }

    #[test]
    fn a_command_line_without_disks_is_unchanged() {
        let cmd = [
            "qemu-system-x86_64",
            "-machine",
            "q35,accel=kvm",
            "-m",
            "2048",
            "-device",
            r#"{"driver":"pcie-root-port","port":8,"chassis":1,"id":"pci.1","bus":"pcie.0","multifunction":true,"addr":"0x1"}"#,
            "-device",
            "vfio-pci,sysfsdev=/sys/bus/mdev/devices/83b8f4f2-509f-382f-3c1e-e6bfe0fa1001",
            "-append",
            "console=ttyS0 -device x",
        ];
        assert_eq!(rewrite(&cmd).unwrap(), argv(&cmd));
    }

    #[test]
    fn a_writable_disk_without_an_id_is_refused_naming_its_drive() {
        let e = rewrite(&[
            "qemu",
            "-blockdev",
            "driver=file,filename=/img/a.qcow2,node-name=f",
            "-blockdev",
            "driver=qcow2,file=f,node-name=disk0",
            "-device",
            "virtio-blk-pci,drive=disk0",
        ])
        .unwrap_err();
        assert_eq!(
            e,
            StandbyArgvError::NoId {
                drive: "disk0".into()
            }
        );
        assert!(
            e.to_string().contains("drive disk0 has no device id"),
            "{e}"
        );
        // A -drive that makes a device of its own has none either.
        let e = rewrite(&["qemu", "-drive", "file=/img/a.qcow2,if=virtio"]).unwrap_err();
        assert!(
            e.to_string()
                .contains("drive -drive /img/a.qcow2 (if=virtio) has no device id"),
            "{e}"
        );
        // Nor can an id that is no file name name a replica.
        let e = rewrite(&[
            "qemu",
            "-drive",
            "file=/img/a,if=none,id=d",
            "-device",
            "virtio-blk-pci,drive=d,id=../x",
        ])
        .unwrap_err();
        assert_eq!(e, StandbyArgvError::BadId { id: "../x".into() });
    }

    #[test]
    fn a_disk_on_another_protocol_is_refused_naming_the_disk() {
        let e = rewrite(&[
            "qemu",
            "-blockdev",
            r#"{"driver":"host_device","filename":"/dev/sdb","node-name":"libvirt-1-storage"}"#,
            "-blockdev",
            r#"{"node-name":"libvirt-1-format","driver":"raw","file":"libvirt-1-storage"}"#,
            "-device",
            r#"{"driver":"virtio-blk-pci","drive":"libvirt-1-format","id":"virtio-disk0"}"#,
        ])
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "disk virtio-disk0 is on a host_device node (libvirt-1-storage), not on a file: \
             its replica is a file, which only a 'file' node opens"
        );
        let e = rewrite(&[
            "qemu",
            "-blockdev",
            "driver=nbd,server.type=inet,server.host=h,server.port=10809,export=vda,node-name=n",
            "-device",
            "virtio-blk-pci,drive=n,id=vda",
        ])
        .unwrap_err();
        assert!(
            matches!(&e, StandbyArgvError::NotAFile { id, driver, .. } if id == "vda" && driver == "nbd")
        );
        let e = rewrite(&[
            "qemu",
            "-drive",
            "file=iscsi://h/iqn.2000-01.x:t/0,if=none,id=d",
            "-device",
            "scsi-hd,drive=d,id=sda",
        ])
        .unwrap_err();
        assert!(
            matches!(&e, StandbyArgvError::NotAFile { id, driver, .. } if id == "sda" && driver == "iscsi")
        );
        let e = rewrite(&["qemu", "-device", "virtio-blk-pci,drive=nowhere,id=vda"]).unwrap_err();
        assert!(e.to_string().contains("disk vda's drive nowhere"), "{e}");
    }

    #[test]
    fn commas_in_values_are_kept_escaped() {
        let out = rewrite(&[
            "qemu",
            "-blockdev",
            "driver=file,filename=/img/a,,b.qcow2,node-name=f",
            "-blockdev",
            "driver=qcow2,file=f,node-name=d",
            "-device",
            "virtio-blk-pci,drive=d,id=vda",
            "-drive",
            "file=/img/x,,y.img,format=raw,if=none,id=e",
            "-device",
            "virtio-blk-pci,drive=e,id=vdb",
        ])
        .unwrap();
        assert_eq!(
            out[2],
            "driver=file,filename=/var/lib/hag/replicas/vda.raw,node-name=f"
        );
        assert_eq!(
            out[8],
            "file=/var/lib/hag/replicas/vdb.raw,format=raw,if=none,id=e"
        );
        // A replica directory with a comma: doubled, as QEMU reads it.
        let out = standby_argv(
            &argv(&[
                "qemu",
                "-drive",
                "file=/img/x.img,if=none,id=e",
                "-device",
                "virtio-blk-pci,drive=e,id=vdb",
            ]),
            Path::new("/srv/a,b"),
        )
        .unwrap();
        assert_eq!(out[2], "file=/srv/a,,b/vdb.raw,if=none,id=e,format=raw");
        assert_eq!(
            split_key_values("a=1,,2,,,b,c="),
            [
                ("a".to_owned(), Some("1,2,".to_owned())),
                ("b".to_owned(), None),
                ("c".to_owned(), Some(String::new()))
            ]
        );
    }

    #[test]
    fn a_malformed_or_cut_off_option_is_named() {
        let e = rewrite(&["qemu", "-blockdev", "{\"driver\":"]).unwrap_err();
        assert!(e.to_string().starts_with("-blockdev {\"driver\":: "), "{e}");
        let e = rewrite(&["qemu", "-device"]).unwrap_err();
        assert_eq!(
            e,
            StandbyArgvError::NoValue {
                option: "-device".into()
            }
        );
    }

    #[test]
    fn virsh_output_is_read_as_shell_words_without_its_environment() {
        let line = "LC_ALL=C PATH=/usr/bin:/bin HOME=/var/lib/libvirt/qemu/domain--1-vm \
                    XDG_CACHE_HOME=/x/.cache /usr/bin/qemu-system-x86_64 -name guest=vm \
                    -blockdev '{\"driver\":\"file\",\"filename\":\"/img/a b.qcow2\"}' -S\n";
        assert_eq!(
            native_argv(line).unwrap(),
            argv(&[
                "/usr/bin/qemu-system-x86_64",
                "-name",
                "guest=vm",
                "-blockdev",
                r#"{"driver":"file","filename":"/img/a b.qcow2"}"#,
                "-S",
            ])
        );
        // A line continued with a backslash, as libvirt's logs write it.
        assert_eq!(
            native_argv("LC_ALL=C qemu \\\n-m 512").unwrap(),
            argv(&["qemu", "-m", "512"])
        );
        assert!(native_argv("LC_ALL=C\n").is_err());
        assert!(native_argv("qemu '-m").is_err());
    }

    #[test]
    fn libvirts_passed_taps_join_their_interfaces_bridge() {
        let line = argv(&[
            "qemu-system-x86_64",
            "-netdev",
            r#"{"type":"tap","fd":"17","vhost":true,"vhostfd":"19","id":"hostnet0"}"#,
            "-device",
            r#"{"driver":"virtio-net-pci","netdev":"hostnet0","id":"net0","mac":"52:54:00:56:4D:01","bus":"pcie.0","addr":"0x2"}"#,
            "-netdev",
            "tap,fds=20:21,id=hostnet1",
            "-device",
            "e1000,netdev=hostnet1,id=net1,mac=52:54:00:00:00:02",
            "-netdev",
            r#"{"type":"user","id":"hostnet2"}"#,
            "-device",
            r#"{"driver":"virtio-net-pci","netdev":"hostnet2","id":"net2","mac":"52:54:00:00:00:03"}"#,
        ]);
        let bridges = |mac: &str| match mac {
            "52:54:00:56:4d:01" => Ok("br0".to_owned()),
            "52:54:00:00:00:02" => Ok("virbr0".to_owned()),
            _ => Err(format!("unknown {mac}")),
        };
        let out = with_bridged_netdevs(&line, bridges).unwrap();
        assert_eq!(out[2], r#"{"type":"bridge","br":"br0","id":"hostnet0"}"#);
        assert_eq!(out[6], "type=bridge,br=virbr0,id=hostnet1");
        // A backend QEMU opens itself is kept; so is everything else.
        assert_eq!(out[10], line[10]);
        assert_eq!(
            out.iter()
                .enumerate()
                .filter(|(i, w)| line[*i] != **w)
                .count(),
            2
        );
        // An interface a standby cannot join is named, with why.
        let none = |_: &str| Err("<interface type='direct'>".to_owned());
        let err = with_bridged_netdevs(&line, none).unwrap_err();
        assert!(
            err.contains("52:54:00:56:4d:01") && err.contains("direct"),
            "{err}"
        );
        // A backend no device with a MAC uses cannot be told.
        let orphan = argv(&["qemu-system-x86_64", "-netdev", "tap,fd=3,id=n9"]);
        assert!(with_bridged_netdevs(&orphan, bridges)
            .unwrap_err()
            .contains("n9"));
    }

    #[test]
    fn libvirts_monitor_master_key_and_ram_backend_are_left_out() {
        let line = argv(&[
            "/usr/bin/qemu-system-x86_64",
            "-name",
            "guest=gpu-guest,debug-threads=on",
            "-object",
            r#"{"qom-type":"secret","id":"masterKey0","format":"raw","file":"/var/lib/libvirt/qemu/domain-1-gpu-guest/master-key.aes"}"#,
            "-machine",
            "pc-q35-10.0,usb=off,dump-guest-core=off,memory-backend=pc.ram",
            "-object",
            r#"{"qom-type":"memory-backend-file","id":"pc.ram","mem-path":"/var/lib/libvirt/qemu/ram/1-gpu-guest/pc.ram","share":true,"prealloc":true,"size":536870912}"#,
            "-object",
            r#"{"qom-type":"memory-backend-ram","id":"other","size":1048576}"#,
            "-chardev",
            "socket,id=charmonitor,path=/var/lib/libvirt/qemu/domain-1-gpu-guest/monitor.sock,server=on,wait=off",
            "-mon",
            "chardev=charmonitor,id=monitor,mode=control",
            "-chardev",
            "socket,id=charserial0,path=/run/hag/gpu-guest.console,server=on,wait=off",
            "-S",
        ]);
        assert_eq!(
            without_libvirt_runtime(&line),
            argv(&[
                "/usr/bin/qemu-system-x86_64",
                "-name",
                "guest=gpu-guest,debug-threads=on",
                "-machine",
                "pc-q35-10.0,usb=off,dump-guest-core=off,memory-backend=pc.ram",
                "-object",
                r#"{"qom-type":"memory-backend-ram","id":"other","size":1048576}"#,
                "-chardev",
                "socket,id=charserial0,path=/run/hag/gpu-guest.console,server=on,wait=off",
                "-S",
            ])
        );
        // A command line of its own (the tests') is left as it is.
        let ours = argv(&[
            "qemu-system-x86_64",
            "-machine",
            "q35",
            "-object",
            "secret,id=s0,data=x",
        ]);
        assert_eq!(without_libvirt_runtime(&ours), ours);
    }
}
