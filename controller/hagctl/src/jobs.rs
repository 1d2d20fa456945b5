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

/// Whether `pid` is a running hagctl (not a reused pid).
fn is_hagctl(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "hagctl")
}

/// The backup's stored state in `dir`, if its process runs.
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
    let backup = running_backup(&dirs.state);
    if checkpoints.is_empty() && backup.is_none() {
        anyhow::bail!(
            "no protection here: no hagctl checkpoint status in {} and no running hagctl backup's state in {}",
            dirs.run.display(),
            dirs.state.display()
        );
    }
    if json {
        let cps: Vec<serde_json::Value> = checkpoints
            .iter()
            .map(|(st, line)| {
                let mut o = serde_json::to_value(st).unwrap_or_default();
                o["text"] = line.clone().into();
                o["running"] = is_hagctl(st.pid).into();
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

/// `hagctl abort`: ends the VM's running protections on this host as
/// SIGTERM does (ABORT to the backup; the held output released once it
/// confirms, the VM stopped if it does not) and waits up to `timeout` for
/// each `hagctl checkpoint` to exit. The VM runs on unprotected.
pub fn abort(dirs: &VmDirs, timeout: Duration) -> anyhow::Result<String> {
    let running: Vec<StatusFile> = protection_lines(&dirs.run)
        .into_iter()
        .map(|(st, _)| st)
        .filter(|st| is_hagctl(st.pid))
        .collect();
    if running.is_empty() {
        anyhow::bail!(
            "no running hagctl checkpoint has its status in {}",
            dirs.run.display()
        );
    }
    let mut out = String::new();
    for st in running {
        let t0 = Instant::now();
        let pid = i32::try_from(st.pid)
            .map_err(|_| anyhow::anyhow!("pid {} in the status file is not a pid", st.pid))?;
        kill(Pid::from_raw(pid), Signal::SIGTERM)
            .map_err(|e| anyhow::anyhow!("signalling hagctl checkpoint pid {pid}: {e}"))?;
        while is_hagctl(st.pid) {
            if t0.elapsed() > timeout {
                anyhow::bail!(
                    "hagctl checkpoint pid {pid} (vGPU {}) still runs {:.0} s after SIGTERM",
                    st.vgpu_id,
                    timeout.as_secs_f64()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        out += &format!(
            "protection of vGPU {} ended: hagctl checkpoint pid {pid} exited {:.1} s after SIGTERM (its report is in its output)\n",
            st.vgpu_id,
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_running_is_said_with_both_directories() {
        let base = std::env::temp_dir().join(format!("hag-jobs-{}", std::process::id()));
        let dirs = VmDirs {
            run: base.join("run"),
            state: base.join("state"),
        };
        let e = job(&dirs, false).unwrap_err().to_string();
        assert!(e.contains("run") && e.contains("state"), "{e}");
        let e = abort(&dirs, Duration::from_millis(10))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no running hagctl checkpoint"), "{e}");
        // A backup state whose pid is not a hagctl is not running.
        std::fs::create_dir_all(&dirs.state).unwrap();
        std::fs::write(
            dirs.state.join("backup.json"),
            r#"{"pid":1,"state":"standby","generation":2,"epoch":9}"#,
        )
        .unwrap();
        assert!(running_backup(&dirs.state).is_none());
        let _ = std::fs::remove_dir_all(&base);
    }
}
