//! A takeover whose VM libvirt owns: the backup writes the last
//! acknowledged epoch as a libvirt save image and has libvirtd restore it
//! (`virsh restore FILE --paused`), so the survivor is the protected
//! domain, with its XML, that `virsh list`, `virsh shutdown` and `virsh
//! destroy` know.
//!
//! What makes that possible, from libvirt 11's and QEMU 10's sources:
//! - **The image.** libvirt's save format is a 92-byte header
//!   (`LibvirtQemudSave`, version 2, the XML's length, whether the domain
//!   ran, format 0 = raw, no cookie), the domain XML with its NUL, then
//!   QEMU's migration stream, which libvirt hands to a QEMU started with
//!   `-incoming defer` ([`save_image`]). It goes through a FIFO
//!   ([`Restore`]): libvirtd reads the header and XML, starts QEMU, and
//!   QEMU reads the stream only as the backup writes it.
//! - **Guest RAM is not in the stream.** The epoch's stream is
//!   `x-ignore-shared`'s: guest RAM is the standby image itself. The
//!   domain's RAM is a shared file backend (`<memoryBacking><source
//!   type='file'/>`), which libvirt places at
//!   `MEMORY_BACKING_DIR/ID-NAME/pc.ram` ([`ram_path`]); the hook, at
//!   `start` (after libvirt made that directory, before QEMU opens the
//!   file), makes it a symlink to the standby image, which the backup
//!   names in `/run/hag/VM/takeover.ram` ([`ram_marker`]). QEMU must read
//!   the stream with `x-ignore-shared` on, which libvirt does not know and
//!   QEMU 10 offers no `-global` for: the backup turns it on over hagctl's
//!   own QMP socket (the domain's `<hag:protect qmp-socket>`) once the
//!   restored QEMU answers there, before it writes the stream, and off
//!   again before the VM runs, so that a later `virsh migrate` carries
//!   guest RAM.
//! - **Disks are the replicas.** The image's XML is the domain's with each
//!   writable file disk's `<source file>` the backup's replica, raw, with
//!   no backing chain ([`on_replicas`]): the domain's own image on this
//!   host is a stale copy or missing. Once the VM runs, the domain's
//!   persistent definition is changed the same way, so that its next
//!   `virsh start` boots from the disk it was running on.
//! - The rest is the QEMU takeover's: the VM stays paused until the old
//!   primary is fenced, then `virsh resume`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::standby_argv::ReplicatedDisk;
use crate::vmm::qemu::Qemu;
use crate::vmm::qemu_copy::ignore_shared;

/// libvirt's save image magic and the version it writes.
const MAGIC: &[u8; 16] = b"LibvirtQemudSave";
const VERSION: u32 = 2;
/// The header: the magic, five u32 fields, fourteen unused u32s.
pub const HEADER_BYTES: usize = 16 + 5 * 4 + 14 * 4;

/// A libvirt save image of a domain that ran: `xml` and QEMU's migration
/// `stream`, uncompressed.
pub fn save_image(xml: &str, stream: &[u8]) -> Vec<u8> {
    let data_len = xml.len() as u32 + 1;
    let mut out = Vec::with_capacity(HEADER_BYTES + xml.len() + 1 + stream.len());
    out.extend_from_slice(MAGIC);
    // version, data_len, was_running, format (raw), cookieOffset (none)
    for field in [VERSION, data_len, 1, 0, 0] {
        out.extend_from_slice(&field.to_le_bytes());
    }
    out.resize(HEADER_BYTES, 0);
    out.extend_from_slice(xml.as_bytes());
    out.push(0);
    out.extend_from_slice(stream);
    out
}

/// Where libvirt puts the guest RAM file of a domain with a file memory
/// backing: `MEMORY_BACKING_DIR/ID-NAME/pc.ram`, NAME cut to 20 bytes
/// (libvirt's short name).
pub fn ram_path(memory_backing_dir: &Path, id: u32, name: &str) -> PathBuf {
    let mut cut = name.len().min(20);
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    memory_backing_dir
        .join(format!("{id}-{}", &name[..cut]))
        .join("pc.ram")
}

/// The domain a takeover restores under libvirt: its XML (the backup's
/// `--libvirt-domain`), what hagctl needs from it, and virsh's connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owned {
    /// The domain XML file.
    pub xml: PathBuf,
    /// virsh's `--connect` URI (none: virsh's default).
    pub uri: Option<String>,
    /// The domain's writable disks and their replicas here.
    pub replicas: Vec<ReplicatedDisk>,
}

/// Domain XML `xml` with each writable file disk on its replica in
/// `replicas` (matched by its image, `<source file>`): the source is the
/// replica, the `<driver>`'s format `raw`, and any `<backingStore>` goes.
/// Read-only disks, CD-ROMs, floppies and disks with no source are left
/// alone; a writable file disk with no replica is an error naming it.
pub fn on_replicas(xml: &str, replicas: &[ReplicatedDisk]) -> Result<String, String> {
    let doc = roxmltree::Document::parse(xml).map_err(|e| e.to_string())?;
    // (range replaced, its replacement), applied from the end.
    let mut edits: Vec<(std::ops::Range<usize>, String)> = Vec::new();
    let disks = doc
        .root_element()
        .children()
        .filter(|n| n.has_tag_name("devices"))
        .flat_map(|d| d.children())
        .filter(|n| n.has_tag_name("disk"));
    for disk in disks {
        let child = |name: &str| disk.children().find(|n| n.has_tag_name(name));
        let device = disk.attribute("device").unwrap_or("disk");
        let Some((source, file)) =
            child("source").and_then(|s| Some((s, s.attribute_node("file")?)))
        else {
            continue;
        };
        if disk.attribute("type") != Some("file")
            || matches!(device, "cdrom" | "floppy")
            || child("readonly").is_some()
        {
            continue;
        }
        let image = file.value();
        let target = child("target")
            .and_then(|t| t.attribute("dev"))
            .unwrap_or("?");
        // A replica is a raw image of what the guest reads.
        if disk.descendants().any(|n| n.has_tag_name("encryption")) {
            return Err(format!(
                "disk {target} ({image}) is encrypted (<encryption>): its replica would hold it decrypted on this host; hag does not replicate encrypted disks"
            ));
        }
        if source.children().any(|n| n.has_tag_name("dataStore")) {
            return Err(format!(
                "disk {target} ({image}) keeps its data in a file of its own (<dataStore>): hag replicates the image, not that file"
            ));
        }
        let replica = replicas.iter().find(|r| r.image == image).ok_or_else(|| {
            format!(
                "disk {target} ({image}) has no replica in the standby's command line: a takeover would run it on a copy that is not the VM's"
            )
        })?;
        edits.push((
            file.range_value(),
            xml_attr(&replica.replica.to_string_lossy()),
        ));
        if let Some(driver) = child("driver") {
            match driver.attribute_node("type") {
                Some(t) => edits.push((t.range_value(), "raw".into())),
                None => {
                    let at = driver.range().start + "<driver".len();
                    edits.push((at..at, " type='raw'".into()));
                }
            }
            // qcow2's own settings, which libvirt refuses on a raw image.
            if let Some(a) = driver.attribute_node("discard_no_unref") {
                edits.push((a.range(), String::new()));
            }
            for cache in driver
                .children()
                .filter(|n| n.has_tag_name("metadata_cache"))
            {
                edits.push((cache.range(), String::new()));
            }
        }
        for backing in disk.children().filter(|n| n.has_tag_name("backingStore")) {
            edits.push((backing.range(), String::new()));
        }
    }
    edits.sort_by_key(|(range, _)| std::cmp::Reverse(range.start));
    let mut out = xml.to_owned();
    for (range, text) in edits {
        out.replace_range(range, &text);
    }
    Ok(out)
}

/// `text` as an XML attribute's value (in either quotes).
fn xml_attr(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('\'', "&apos;")
        .replace('"', "&quot;")
}

/// What a takeover needs from the domain XML: its name, its text, and
/// hagctl's own QMP socket (`<hag:protect qmp-socket=…>`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DomainFacts {
    pub name: String,
    pub xml: String,
    pub qmp: PathBuf,
}

impl Owned {
    /// Reads the domain XML and what a takeover needs from it; the XML
    /// is the one restored, with its disks on their replicas.
    pub fn facts(&self) -> Result<DomainFacts, String> {
        let xml = std::fs::read_to_string(&self.xml)
            .map_err(|e| format!("{}: {e}", self.xml.display()))?;
        let doc =
            roxmltree::Document::parse(&xml).map_err(|e| format!("{}: {e}", self.xml.display()))?;
        let name = doc
            .root_element()
            .children()
            .find(|n| n.has_tag_name("name"))
            .and_then(|n| n.text())
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| format!("{}: the domain has no <name>", self.xml.display()))?
            .to_owned();
        let qmp = crate::libvirt_domain::parse(&xml)?
            .protect
            .and_then(|p| p.qmp_socket)
            .ok_or_else(|| {
                format!(
                    "{}: a takeover under libvirt needs <hag:protect qmp-socket=…> (hagctl's own QMP socket of the domain's QEMU)",
                    self.xml.display()
                )
            })?;
        let xml = on_replicas(&xml, &self.replicas)
            .map_err(|e| format!("{}: {e}", self.xml.display()))?;
        Ok(DomainFacts {
            name,
            xml,
            qmp: PathBuf::from(qmp),
        })
    }

    /// Has domain `name`'s persistent definition name its replicas, as
    /// the running domain restored from [`DomainFacts::xml`] does, so that
    /// its next start boots from them; `file` holds the new definition
    /// (mode 0600: it has the definition's secrets, which `virsh define`
    /// must keep). `false`: the domain is transient, with no definition.
    pub fn define_on_replicas(&self, name: &str, file: &Path) -> Result<bool, String> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let info = self.virsh(&["dominfo", name])?;
        let persistent = info.lines().any(|l| {
            l.split_once(':')
                .is_some_and(|(k, v)| k.trim() == "Persistent" && v.trim() == "yes")
        });
        if !persistent {
            return Ok(false);
        }
        let xml = self.virsh(&["dumpxml", "--inactive", "--security-info", name])?;
        let xml = on_replicas(&xml, &self.replicas)
            .map_err(|e| format!("domain {name}'s definition: {e}"))?;
        let _ = std::fs::remove_file(file);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(file)
            .and_then(|mut f| f.write_all(xml.as_bytes()))
            .map_err(|e| format!("{}: {e}", file.display()))?;
        self.virsh(&["define", &file.display().to_string()])
            .map(|_| true)
    }

    /// `virsh ARGS` on this connection, not started.
    pub fn virsh_command(&self, args: &[&str]) -> std::process::Command {
        let mut cmd = std::process::Command::new("virsh");
        if let Some(uri) = &self.uri {
            cmd.args(["--connect", uri]);
        }
        cmd.args(args);
        cmd
    }

    /// Runs `virsh ARGS`; its stdout, or an error with its stderr.
    pub fn virsh(&self, args: &[&str]) -> Result<String, String> {
        let out = self
            .virsh_command(args)
            .output()
            .map_err(|e| format!("cannot run virsh: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "virsh {}: {}: {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// One restore: the save image streamed to libvirtd through a FIFO, so
/// that `x-ignore-shared` is on in the restored QEMU before its stream's
/// RAM section arrives (libvirt knows no such capability, and QEMU 10 has
/// no `-global` for it), and off again before the VM runs.
pub struct Restore<'a> {
    pub owned: &'a Owned,
    pub facts: &'a DomainFacts,
    /// Where the FIFO goes (the backup's status directory).
    pub fifo: &'a Path,
}

/// How long libvirtd may take to open the image, and QEMU to answer on
/// hagctl's QMP socket.
const RESTORE_START: Duration = Duration::from_secs(60);

impl Restore<'_> {
    /// `virsh restore FIFO --paused` of `stream` (the epoch's
    /// `x-ignore-shared` migration stream); returns once libvirt restored
    /// the domain, paused, with `x-ignore-shared` off.
    pub fn run(&self, stream: &[u8]) -> Result<(), String> {
        let _ = std::fs::remove_file(self.fifo);
        nix::unistd::mkfifo(
            self.fifo,
            nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
        )
        .map_err(|e| format!("mkfifo {}: {e}", self.fifo.display()))?;
        // A stale socket of an earlier QEMU would be connected to in vain.
        let _ = std::fs::remove_file(&self.facts.qmp);
        let path = self.fifo.display().to_string();
        let mut virsh = self.owned.virsh_command(&["restore", &path, "--paused"]);
        let mut child = virsh
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run virsh: {e}"))?;
        let fed = self.feed(&mut child, stream);
        let out = child
            .wait_with_output()
            .map_err(|e| format!("waiting for virsh restore: {e}"))?;
        let _ = std::fs::remove_file(self.fifo);
        if !out.status.success() {
            return Err(format!(
                "virsh restore {path} --paused: {}: {}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim(),
                fed.err()
                    .map(|e| format!(" (feeding it the image: {e})"))
                    .unwrap_or_default()
            ));
        }
        fed?;
        // Off before the VM runs: a later virsh migrate must carry RAM.
        let mut qemu =
            Qemu::connect(&self.facts.qmp, Duration::from_secs(10)).map_err(|e| e.to_string())?;
        qemu.apply(&ignore_shared(false))
            .map_err(|e| format!("turning x-ignore-shared off on the restored domain: {e}"))?;
        Ok(())
    }

    /// Feeds libvirt the image through the FIFO. libvirtd opens a save
    /// image twice (its metadata, then the image it hands to QEMU), so each
    /// reader gets the header and XML; the one still open when the
    /// restored QEMU answers on hagctl's QMP socket is QEMU's, which gets
    /// `x-ignore-shared` turned on and then the stream. A reader's close is
    /// seen through inotify, in order, however soon the next one opens; the
    /// next write end is opened before the last is closed, so that a reader
    /// already waiting never sees the end of the stream.
    fn feed(&self, virsh: &mut std::process::Child, stream: &[u8]) -> Result<(), String> {
        use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
        use std::io::Write;
        let deadline = Instant::now() + RESTORE_START;
        let header = save_image(&self.facts.xml, &[]);
        let closes = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .and_then(|i| {
                i.add_watch(self.fifo, AddWatchFlags::IN_CLOSE_NOWRITE)
                    .map(|_| i)
            })
            .map_err(|e| format!("inotify on {}: {e}", self.fifo.display()))?;
        let mut alive = || Instant::now() < deadline && virsh.try_wait().ok().flatten().is_none();
        let mut fifo = self.open_for_reader(&mut alive)?;
        loop {
            fifo.write_all(&header)
                .map_err(|e| format!("writing the save image's header: {e}"))?;
            let Some(mut qemu) = self.reader_is_qemu(&closes, &mut alive)? else {
                // That reader closed: the next one's end, then this one's
                // goes.
                fifo = self.open_for_reader(&mut alive)?;
                continue;
            };
            qemu.apply(&ignore_shared(true))
                .map_err(|e| format!("turning x-ignore-shared on in the restored QEMU: {e}"))?;
            // QEMU serves one client per QMP socket: hagctl's turn ends.
            drop(qemu);
            return fifo
                .write_all(stream)
                .map_err(|e| format!("writing the epoch's device state to libvirt: {e}"));
        }
    }

    /// The FIFO, opened for writing once a reader has it open.
    fn open_for_reader(&self, alive: &mut impl FnMut() -> bool) -> Result<std::fs::File, String> {
        use std::os::unix::fs::OpenOptionsExt;
        loop {
            // No reader yet: ENXIO, tried again.
            match std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(nix::libc::O_NONBLOCK)
                .open(self.fifo)
            {
                Ok(f) => {
                    set_blocking(&f).map_err(|e| format!("{}: {e}", self.fifo.display()))?;
                    return Ok(f);
                }
                Err(_) if alive() => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => {
                    return Err(format!(
                        "libvirtd never opened {}: {e}",
                        self.fifo.display()
                    ))
                }
            }
        }
    }

    /// Waits until a reader of the FIFO closes it (`None`: libvirt read
    /// the metadata) or the restored QEMU answers on hagctl's QMP socket.
    fn reader_is_qemu(
        &self,
        closes: &nix::sys::inotify::Inotify,
        alive: &mut impl FnMut() -> bool,
    ) -> Result<Option<Qemu>, String> {
        loop {
            if closes.read_events().is_ok_and(|events| !events.is_empty()) {
                return Ok(None);
            }
            if let Ok(qemu) = Qemu::connect(&self.facts.qmp, Duration::from_secs(5)) {
                return Ok(Some(qemu));
            }
            if !alive() {
                return Err("the restored QEMU never answered on hagctl's QMP socket".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn set_blocking(f: &std::fs::File) -> nix::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let flags = OFlag::from_bits_truncate(fcntl(f, FcntlArg::F_GETFL)?);
    fcntl(f, FcntlArg::F_SETFL(flags - OFlag::O_NONBLOCK)).map(|_| ())
}

/// Where the backup tells the hook which file a restored domain's guest
/// RAM is (`/run/hag/VM/takeover.ram`, VM: the domain's hook key).
pub fn ram_marker(domain: &str) -> PathBuf {
    Path::new(crate::vm_dirs::RUN_ROOT)
        .join(crate::libvirt_hook::vm_key(domain))
        .join("takeover.ram")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_image_is_libvirts_header_the_xml_and_the_stream() {
        let img = save_image("<domain/>", b"QEVM");
        assert_eq!(HEADER_BYTES, 92);
        assert_eq!(&img[..16], b"LibvirtQemudSave");
        let u32_at = |i: usize| u32::from_le_bytes(img[i..i + 4].try_into().unwrap());
        assert_eq!(
            (u32_at(16), u32_at(20), u32_at(24), u32_at(28), u32_at(32)),
            (2, 10, 1, 0, 0)
        );
        assert!(img[36..92].iter().all(|&b| b == 0));
        assert_eq!(&img[92..102], b"<domain/>\0");
        assert_eq!(&img[102..], b"QEVM");
    }

    #[test]
    fn writable_file_disks_run_on_their_replicas() {
        let xml = "<domain type='kvm'><name>vm</name><devices>\
            <disk type='file' device='disk'><driver name='qemu' type='qcow2' cache='none'/>\
            <source file='/img/a.qcow2'/><backingStore type='file'><format type='qcow2'/>\
            <source file='/img/base.qcow2'/></backingStore><target dev='vda' bus='virtio'/></disk>\
            <disk type=\"file\" device=\"disk\"><driver name=\"qemu\"/><source file=\"/img/b&amp;c.img\"/>\
            <target dev=\"sda\" bus=\"sata\"/></disk>\
            <disk type='file' device='disk'><source file='/img/ro.img'/><target dev='vdb'/><readonly/></disk>\
            <disk type='file' device='cdrom'><source file='/iso/x.iso'/><target dev='sdb'/></disk>\
            <disk type='block' device='disk'><source dev='/dev/sdz'/><target dev='vdc'/><readonly/></disk>\
            </devices></domain>";
        let replicas = [
            ReplicatedDisk {
                id: "virtio-disk0".into(),
                image: "/img/a.qcow2".into(),
                replica: "/var/lib/hag/vm/replicas/virtio-disk0.raw".into(),
            },
            ReplicatedDisk {
                id: "sata0-0-0".into(),
                image: "/img/b&c.img".into(),
                replica: "/r/it's.raw".into(),
            },
        ];
        let out = on_replicas(xml, &replicas).unwrap();
        assert_eq!(
            out,
            "<domain type='kvm'><name>vm</name><devices>\
            <disk type='file' device='disk'><driver name='qemu' type='raw' cache='none'/>\
            <source file='/var/lib/hag/vm/replicas/virtio-disk0.raw'/><target dev='vda' bus='virtio'/></disk>\
            <disk type=\"file\" device=\"disk\"><driver type='raw' name=\"qemu\"/><source file=\"/r/it&apos;s.raw\"/>\
            <target dev=\"sda\" bus=\"sata\"/></disk>\
            <disk type='file' device='disk'><source file='/img/ro.img'/><target dev='vdb'/><readonly/></disk>\
            <disk type='file' device='cdrom'><source file='/iso/x.iso'/><target dev='sdb'/></disk>\
            <disk type='block' device='disk'><source dev='/dev/sdz'/><target dev='vdc'/><readonly/></disk>\
            </devices></domain>"
        );
        // Its own rewrite, once on the replicas.
        let on = |image: &str, r: &ReplicatedDisk| ReplicatedDisk {
            image: image.into(),
            ..r.clone()
        };
        let again = [
            on("/var/lib/hag/vm/replicas/virtio-disk0.raw", &replicas[0]),
            on("/r/it's.raw", &replicas[1]),
        ];
        assert_eq!(on_replicas(&out, &again).unwrap(), out);
        let err = on_replicas(xml, &replicas[..1]).unwrap_err();
        assert!(
            err.contains("disk sda (/img/b&c.img) has no replica"),
            "{err}"
        );
        // qcow2's own settings go; an encrypted disk is refused.
        let qcow2 = "<domain><devices><disk type='file' device='disk'>\
            <driver name='qemu' type='qcow2' discard_no_unref='on'><metadata_cache><max_size unit='KiB'>1</max_size></metadata_cache></driver>\
            <source file='/img/a.qcow2'/><target dev='vda'/></disk></devices></domain>";
        assert_eq!(
            on_replicas(qcow2, &replicas).unwrap(),
            "<domain><devices><disk type='file' device='disk'>\
            <driver name='qemu' type='raw' ></driver>\
            <source file='/var/lib/hag/vm/replicas/virtio-disk0.raw'/><target dev='vda'/></disk></devices></domain>"
        );
        let encrypted =
            "<domain><devices><disk type='file' device='disk'><source file='/img/a.qcow2'>\
            <encryption format='luks'><secret type='passphrase' uuid='x'/></encryption></source>\
            <target dev='vda'/></disk></devices></domain>";
        let err = on_replicas(encrypted, &replicas).unwrap_err();
        assert!(
            err.contains("disk vda (/img/a.qcow2) is encrypted"),
            "{err}"
        );
    }

    #[test]
    fn the_ram_file_is_where_libvirt_puts_it() {
        let dir = Path::new("/var/lib/libvirt/qemu/ram");
        assert_eq!(
            ram_path(dir, 7, "gpu-guest"),
            Path::new("/var/lib/libvirt/qemu/ram/7-gpu-guest/pc.ram")
        );
        assert_eq!(
            ram_path(dir, 12, "a-very-long-domain-name-indeed"),
            Path::new("/var/lib/libvirt/qemu/ram/12-a-very-long-domain-n/pc.ram")
        );
    }
}
