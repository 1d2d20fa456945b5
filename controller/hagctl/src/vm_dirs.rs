//! Where hagctl keeps a protected VM's files.
//!
//! Two kinds, kept apart because they must outlive different things:
//! - **runtime** (`--status-dir`, default `/run/hag`): status files that
//!   `hagctl status` and `hagctl job` read (`checkpoint-vgpuN.json`,
//!   `backup.json`), `hagctl takeover`'s and `confirm-backup-down`'s
//!   requests, the standby QEMU's QMP socket and log. They describe running
//!   processes, so a reboot rightly removes them (`/run` is tmpfs).
//! - **state** (`--state-dir`, default `/var/lib/hag`): the backup's
//!   fencing generation (`generation.json`), which must survive a reboot (a
//!   backup that came back at generation 0 would no longer fence a
//!   partitioned old primary), and the disks' replicas and deltas.
//!
//! `--name VM` gives a VM a directory of each kind of its own
//! (`/run/hag/VM/`, `/var/lib/hag/VM/`), so several VMs protected on one
//! host, or several backups on one backup host, never share a file. The
//! name is the libvirt domain's for a domain; it must be a valid file name
//! and a valid systemd instance name without escaping (what the
//! `hag-backup@VM.service` units are named by).

use std::path::PathBuf;

/// The host-wide runtime directory; a named VM's is below it.
pub const RUN_ROOT: &str = "/run/hag";
/// The host-wide state directory; a named VM's is below it.
pub const STATE_ROOT: &str = "/var/lib/hag";

/// A VM's name as hagctl files it: 1-64 of `A-Z a-z 0-9 _ . -`, not
/// starting with `.` or `-` (a file name, and a systemd instance name that
/// needs no escaping).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmName(String);

impl VmName {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for VmName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for VmName {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-');
        if s.is_empty() || s.len() > 64 {
            return Err(format!(
                "VM name '{s}': 1 to 64 characters, not {}",
                s.len()
            ));
        }
        if let Some(bad) = s.chars().find(|&c| !allowed(c)) {
            return Err(format!(
                "VM name '{s}': '{bad}' is not allowed (letters, digits, _ . - only)"
            ));
        }
        if s.starts_with(['.', '-']) {
            return Err(format!("VM name '{s}' may not start with '.' or '-'"));
        }
        Ok(VmName(s.to_owned()))
    }
}

/// The flags that place a VM's files, shared by every command that uses
/// them (checkpoint, backup, takeover, confirm-backup-down).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct VmDirArgs {
    /// The VM's name (a libvirt domain's name): its files go in
    /// /run/hag/VM/ and /var/lib/hag/VM/, apart from any other VM's
    #[arg(long, value_name = "VM")]
    pub name: Option<VmName>,
    /// Runtime files (status, requests, sockets) [default: /run/hag, or
    /// /run/hag/VM with --name]
    #[arg(long, value_name = "DIR")]
    pub status_dir: Option<PathBuf>,
    /// State that survives a reboot (the backup's fencing generation, disk
    /// replicas and deltas) [default: /var/lib/hag, or /var/lib/hag/VM with
    /// --name]
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
}

/// A VM's two directories, resolved from [`VmDirArgs`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmDirs {
    /// Runtime files.
    pub run: PathBuf,
    /// State that survives a reboot.
    pub state: PathBuf,
}

impl VmDirArgs {
    /// The directories: those given, else the VM's own under the roots,
    /// else the roots.
    pub fn resolve(&self) -> VmDirs {
        let below = |root: &str| match &self.name {
            Some(name) => PathBuf::from(root).join(name.as_str()),
            None => PathBuf::from(root),
        };
        VmDirs {
            run: self.status_dir.clone().unwrap_or_else(|| below(RUN_ROOT)),
            state: self.state_dir.clone().unwrap_or_else(|| below(STATE_ROOT)),
        }
    }
}

impl VmDirs {
    /// Where the backup keeps the replicas of the VM's disks.
    pub fn replicas(&self) -> PathBuf {
        self.state.join("replicas")
    }

    /// Where the primary keeps the VM's disk deltas until they are sent.
    pub fn deltas(&self) -> PathBuf {
        self.state.join("deltas")
    }
}

/// Every runtime directory `hagctl status` looks in, with the VM it
/// belongs to: the host-wide one (no name) and each named VM's below it.
pub fn runtime_dirs() -> Vec<(Option<VmName>, PathBuf)> {
    let root = PathBuf::from(RUN_ROOT);
    let mut named: Vec<(Option<VmName>, PathBuf)> = std::fs::read_dir(&root)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| {
            let name = e.file_name().to_str()?.parse::<VmName>().ok()?;
            Some((Some(name), e.path()))
        })
        .collect();
    named.sort_by(|a, b| a.1.cmp(&b.1));
    std::iter::once((None, root)).chain(named).collect()
}

/// Writes `value` to `path` whole (a temporary file renamed over it), and
/// with `durable`, synced with its directory first.
pub fn write_json(
    path: &std::path::Path,
    value: &serde_json::Value,
    durable: bool,
) -> Result<(), String> {
    use std::io::Write as _;
    let io = |e: std::io::Error| format!("{}: {e}", path.display());
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    std::fs::create_dir_all(dir).map_err(io)?;
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("state")
    ));
    {
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all((value.to_string() + "\n").as_bytes())
            .map_err(io)?;
        if durable {
            f.sync_all().map_err(io)?;
        }
    }
    std::fs::rename(&tmp, path).map_err(io)?;
    if durable {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_plain_file_and_unit_names() {
        for ok in ["web1", "db.prod", "a_b-c", "X"] {
            assert_eq!(ok.parse::<VmName>().unwrap().as_str(), ok);
        }
        for (bad, why) in [
            ("", "1 to 64"),
            ("../etc", "'/' is not allowed"),
            ("a b", "' ' is not allowed"),
            ("a+b", "'+' is not allowed"),
            (".hidden", "may not start"),
            ("-x", "may not start"),
            ("dom\u{e9}", "'\u{e9}' is not allowed"),
        ] {
            let e = bad.parse::<VmName>().unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        assert!("a".repeat(65).parse::<VmName>().is_err());
    }

    #[test]
    fn a_named_vm_has_its_own_directories_and_flags_win() {
        let host = VmDirArgs::default().resolve();
        assert_eq!(host.run, PathBuf::from("/run/hag"));
        assert_eq!(host.state, PathBuf::from("/var/lib/hag"));
        assert_eq!(host.replicas(), PathBuf::from("/var/lib/hag/replicas"));
        let named = VmDirArgs {
            name: Some("web1".parse().unwrap()),
            ..Default::default()
        };
        let d = named.resolve();
        assert_eq!(d.run, PathBuf::from("/run/hag/web1"));
        assert_eq!(d.state, PathBuf::from("/var/lib/hag/web1"));
        assert_eq!(d.deltas(), PathBuf::from("/var/lib/hag/web1/deltas"));
        let given = VmDirArgs {
            status_dir: Some("/tmp/s".into()),
            ..named
        };
        assert_eq!(given.resolve().run, PathBuf::from("/tmp/s"));
        assert_eq!(given.resolve().state, PathBuf::from("/var/lib/hag/web1"));
    }
}
