//! `hagctl job` and `hagctl abort`: one VM's running protection, found by
//! its name (its directories, `vm_dirs`), shown or ended.
//!
//! A running `hagctl checkpoint` holds QEMU's QMP socket, so nothing else
//! may ask QEMU; it publishes its state in its status file instead
//! (`checkpoint-vgpuN.json`, rewritten at every change and epoch), and it
//! already ends protection cleanly on SIGTERM (ABORT to the backup, the
//! held output released once confirmed: docs/ha.md). `job` reads the
//! former, `abort` sends the latter and waits for the process to exit.

use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::checkpoint::{protection_lines, StatusFile};
use crate::vm_dirs::VmDirs;

/// Process `pid`'s command name and the fields of /proc/PID/stat after it
/// (the name may hold spaces and parentheses): state first.
fn stat(pid: u32) -> Option<(String, Vec<String>)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (open, close) = (stat.find('(')?, stat.rfind(')')?);
    let fields = stat[close + 1..]
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    Some((stat[open + 1..close].to_owned(), fields))
}

/// Whether `pid` is a running hagctl (not a zombie).
pub fn is_hagctl(pid: u32) -> bool {
    stat(pid)
        .is_some_and(|(name, fields)| name == "hagctl" && fields.first().is_some_and(|s| s != "Z"))
}

/// When process `pid` started, in clock ticks after boot (field 22 of
/// /proc/PID/stat): with the pid, it names one process for good.
pub fn process_start(pid: u32) -> Option<u64> {
    stat(pid)?.1.get(19)?.parse().ok()
}

/// Whether the checkpoint that wrote `st` still runs: its pid is a hagctl
/// that started when the status file says (older files carry no start).
fn still_runs(st: &StatusFile) -> bool {
    is_hagctl(st.pid) && (st.pid_start == 0 || process_start(st.pid) == Some(st.pid_start))
}

/// The backup's status in its runtime directory `dir`, if its process
/// runs.
fn running_backup(dir: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("backup.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let pid = v.get("pid")?.as_u64()?;
    is_hagctl(u32::try_from(pid).ok()?).then_some(v)
}

/// `hagctl job`: the VM's protection on this host: its checkpoints' status
/// (the primary) and its backup's state (the backup host), as text lines or
/// one JSON object `{checkpoints: [status…], backup: state|null}`.
pub fn job(dirs: &VmDirs, json: bool) -> anyhow::Result<String> {
    let checkpoints = protection_lines(&dirs.run);
    let backup = running_backup(&dirs.run);
    if checkpoints.is_empty() && backup.is_none() {
        anyhow::bail!(
            "no protection here: neither a hagctl checkpoint's nor a running hagctl backup's status in {}",
            dirs.run.display()
        );
    }
    if json {
        let cps: Vec<serde_json::Value> = checkpoints
            .iter()
            .map(|(st, line)| {
                let mut o = crate::checkpoint::protection_json(st, line);
                o["running"] = still_runs(st).into();
                o
            })
            .collect();
        return Ok(serde_json::json!({ "checkpoints": cps, "backup": backup }).to_string() + "\n");
    }
    let mut out = String::new();
    for (_, line) in &checkpoints {
        out += &format!("checkpoint: {line}\n");
    }
    if let Some(b) = backup {
        let field = |k: &str| b.get(k).map_or_else(|| "?".to_owned(), |v| v.to_string());
        out += &format!(
            "backup: {} (pid {}), listening on {}, generation {}, last applied epoch {}\n",
            b.get("state").and_then(|s| s.as_str()).unwrap_or("?"),
            field("pid"),
            b.get("listen").and_then(|s| s.as_str()).unwrap_or("?"),
            field("generation"),
            field("epoch"),
        );
    }
    Ok(out)
}

/// What this host is for one VM, in one word (`hagctl job --role`): what
/// a cluster manager's resource agent (scripts/pacemaker/vm) decides by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A running hagctl checkpoint protects the VM running here (or is
    /// trying to: syncing, or its backup unheard).
    Primary,
    /// This host's backup took the VM over: it runs here, as its child
    /// (and its --reprotect's checkpoint, if any, is not a primary's).
    TookOver,
    /// A backup stands by holding an acknowledged epoch: it can take over.
    StandbyHolding,
    /// A backup stands by with no epoch yet: a takeover would have nothing.
    Standby,
    /// Nothing of this VM's protection runs here.
    None,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Primary => "primary",
            Role::TookOver => "took-over",
            Role::StandbyHolding => "standby-holding",
            Role::Standby => "standby",
            Role::None => "none",
        })
    }
}

/// The role from what runs: the states of the running checkpoints, and
/// the running backup's state and last applied epoch. A checkpoint that
/// handed the VM over or was fenced stopped it: that is no primary.
fn role_of(checkpoint_states: &[&str], backup: Option<(&str, u64)>) -> Role {
    match backup {
        Some(("took-over", _)) => Role::TookOver,
        _ if checkpoint_states
            .iter()
            .any(|s| matches!(*s, "syncing" | "protected" | "unprotected")) =>
        {
            Role::Primary
        }
        Some((_, epoch)) if epoch > 0 => Role::StandbyHolding,
        Some(_) => Role::Standby,
        None => Role::None,
    }
}

/// `hagctl job --role`: this host's role for the VM whose files are in
/// `dirs`.
pub fn role(dirs: &VmDirs) -> Role {
    let running: Vec<StatusFile> = protection_lines(&dirs.run)
        .into_iter()
        .map(|(st, _)| st)
        .filter(still_runs)
        .collect();
    let states: Vec<&str> = running.iter().map(|st| st.state.as_str()).collect();
    let backup = running_backup(&dirs.run);
    let backup = backup.as_ref().map(|b| {
        (
            b.get("state").and_then(|s| s.as_str()).unwrap_or(""),
            b.get("epoch").and_then(|e| e.as_u64()).unwrap_or(0),
        )
    });
    role_of(&states, backup)
}

/// `hagctl abort`: ends the VM's running protections on this host as
/// SIGTERM does (ABORT to the backup; the held output released once it
/// confirms, the VM stopped if it does not) and waits up to `timeout` for
/// each `hagctl checkpoint` to exit. The VM runs on unprotected.
pub fn abort(dirs: &VmDirs, timeout: Duration) -> anyhow::Result<String> {
    let running: Vec<StatusFile> = protection_lines(&dirs.run)
        .into_iter()
        .map(|(st, _)| st)
        .filter(still_runs)
        .collect();
    if running.is_empty() {
        anyhow::bail!(
            "no running hagctl checkpoint has its status in {}",
            dirs.run.display()
        );
    }
    // Every one is told first: one that is slow to end must not keep the
    // others protected.
    let t0 = Instant::now();
    for st in &running {
        let pid = i32::try_from(st.pid)
            .map_err(|_| anyhow::anyhow!("pid {} in the status file is not a pid", st.pid))?;
        kill(Pid::from_raw(pid), Signal::SIGTERM)
            .map_err(|e| anyhow::anyhow!("signalling hagctl checkpoint pid {pid}: {e}"))?;
    }
    let mut out = String::new();
    for st in &running {
        while still_runs(st) {
            if t0.elapsed() > timeout {
                anyhow::bail!(
                    "{out}hagctl checkpoint pid {} (vGPU {}) still runs {:.0} s after SIGTERM",
                    st.pid,
                    st.vgpu_id,
                    timeout.as_secs_f64()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        out += &format!(
            "protection of vGPU {} ended: hagctl checkpoint pid {} exited {:.1} s after SIGTERM; its report (in its output) says whether the backup confirmed the end (ended: the VM runs on) or not (vm-stopped)\n",
            st.vgpu_id,
            st.pid,
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process_state(pid: u32) -> Option<char> {
        stat(pid)?.1.first()?.chars().next()
    }

    #[test]
    fn a_process_is_named_by_its_pid_and_start() {
        let me = std::process::id();
        let start = process_start(me).expect("this process's start");
        let st = |pid_start| StatusFile {
            pid: me,
            pid_start,
            ..StatusFile::default()
        };
        // The test binary is not called hagctl: never "running", however
        // its start matches; process_state reads it as running (R or S).
        assert!(!still_runs(&st(start)));
        assert!(matches!(process_state(me), Some('R' | 'S')));
        assert_ne!(
            process_start(1),
            Some(start),
            "pid 1 started before this test"
        );
    }

    /// A backup that took over owns the VM, whatever checkpoint (its
    /// --reprotect) runs beside it; a stopped primary is none; a standby
    /// can take over only once it holds an epoch.
    #[test]
    fn a_role_is_read_from_what_runs() {
        assert_eq!(role_of(&[], None), Role::None);
        assert_eq!(role_of(&["protected"], None), Role::Primary);
        assert_eq!(role_of(&["unprotected"], None), Role::Primary);
        assert_eq!(role_of(&["handed-over"], None), Role::None);
        assert_eq!(role_of(&["fenced"], Some(("standby", 0))), Role::Standby);
        assert_eq!(
            role_of(&["protected"], Some(("took-over", 9))),
            Role::TookOver
        );
        assert_eq!(role_of(&[], Some(("standby", 0))), Role::Standby);
        assert_eq!(role_of(&[], Some(("standby", 4))), Role::StandbyHolding);
        assert_eq!(Role::StandbyHolding.to_string(), "standby-holding");
    }

    #[test]
    fn nothing_running_is_said_with_both_directories() {
        let base = std::env::temp_dir().join(format!("hag-jobs-{}", std::process::id()));
        let dirs = VmDirs {
            run: base.join("run"),
            state: base.join("state"),
        };
        let e = job(&dirs, false).unwrap_err().to_string();
        assert!(e.contains("no protection here") && e.contains("run"), "{e}");
        let e = abort(&dirs, Duration::from_millis(10))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no running hagctl checkpoint"), "{e}");
        // A backup status whose pid is not a hagctl is not running.
        std::fs::create_dir_all(&dirs.run).unwrap();
        std::fs::write(
            dirs.run.join("backup.json"),
            r#"{"pid":1,"state":"standby","generation":2,"epoch":9}"#,
        )
        .unwrap();
        assert!(running_backup(&dirs.run).is_none());
        assert_eq!(role(&dirs), Role::None);
        let _ = std::fs::remove_dir_all(&base);
    }
}
