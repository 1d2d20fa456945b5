//! The QEMU a backup starts to take a QEMU VM over (`hagctl backup --
//! QEMU ARGS…`), and the same start as a dry run when a primary pairs, so
//! that a backup that could not take over says so then (no QEMU, no such
//! vGPU, a RAM size QEMU refuses), not at takeover.
//!
//! The operator's command line describes the VM as on the primary (its
//! devices, the vGPU's vfio-pci device with this host's mdev, its network
//! and console); hagctl adds what makes it a standby:
//! `-object memory-backend-file,id=hag-ram,size=…,mem-path=/proc/PID/fd/N,share=on
//! -machine memory-backend=hag-ram` (guest RAM *is* the backup's standby
//! image: nothing is copied at takeover), `-qmp` on a socket of its own,
//! `-incoming defer` and `-S`. At takeover, `migrate-incoming` with
//! `x-ignore-shared` reads the last acknowledged epoch's device state (the
//! vGPU's VFIO state restored into this host's vGPU) from a pipe; the VM
//! stays paused until `cont`, after the primary was fenced.

use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use super::qemu::Qemu;
use super::qemu_copy::wait_state;
use super::{MigrationSettings, RunKind, Vmm};
use crate::vm_shape::VmShape;

/// How long QEMU may take to start and answer QMP.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long loading an epoch's device state may take.
const LOAD_TIMEOUT: Duration = Duration::from_secs(120);

/// A standby QEMU, started, waiting for its device state.
pub struct Standby {
    /// The process (killed with this backup: PR_SET_PDEATHSIG).
    pub child: Child,
    /// Its QMP connection.
    pub qemu: Qemu,
    /// Its log (stdout and stderr).
    pub log: PathBuf,
}

/// The arguments hagctl adds to the operator's QEMU command line: guest
/// RAM, under the primary's backend id `ram_id`, is the file `ram_path`.
pub fn standby_args(ram_id: &str, ram_path: &str, ram_size: u64, qmp: &Path) -> Vec<String> {
    vec![
        "-object".into(),
        format!("memory-backend-file,id={ram_id},size={ram_size},mem-path={ram_path},share=on"),
        "-machine".into(),
        format!("memory-backend={ram_id}"),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", qmp.display()),
        "-incoming".into(),
        "defer".into(),
        "-S".into(),
    ]
}

/// Has the process `cmd` starts killed (SIGKILL) when this one dies: a VM a
/// backup started must not outlive the controller that fences it.
pub fn dies_with_this_process(cmd: &mut Command) {
    // SAFETY: the closure runs in the child between fork and exec and
    // calls only prctl(2), which is async-signal-safe; it allocates
    // nothing and touches no lock.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(std::io::Error::from)
        });
    }
}

/// The last lines of QEMU's log, for an error message.
fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(3)..].join(" / ")
}

/// Starts `command` (QEMU and its arguments) as a standby whose guest RAM
/// (backend `ram_id`) is the file at `ram_path` (`ram_size` bytes); its QMP
/// socket and log go in `dir` under `name`.
pub fn start(
    command: &[String],
    ram_id: &str,
    ram_path: &str,
    ram_size: u64,
    dir: &Path,
    name: &str,
) -> Result<Standby, String> {
    let (program, args) = command
        .split_first()
        .ok_or_else(|| "no QEMU command line".to_owned())?;
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let qmp = dir.join(format!("{name}.qmp"));
    let log = dir.join(format!("{name}.log"));
    let _ = std::fs::remove_file(&qmp);
    let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = out.try_clone().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .args(standby_args(ram_id, ram_path, ram_size, &qmp))
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    // A standby left running by a dead backup is an unmanaged second copy
    // of the VM.
    dies_with_this_process(&mut cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {program}: {e}"))?;
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("{program} exited ({status}): {}", log_tail(&log)));
        }
        if qmp.exists() {
            // Loading an epoch keeps QEMU's main loop (and QMP) busy until
            // it is done: its commands get the load's time.
            if let Ok(mut qemu) = Qemu::connect(&qmp, LOAD_TIMEOUT) {
                let st = qemu.run_state().map_err(|e| e.to_string())?;
                if st.kind != RunKind::Incoming {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!("the standby QEMU is {st}, not inmigrate"));
                }
                return Ok(Standby { child, qemu, log });
            }
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "{program} did not answer QMP within {} s: {}",
                START_TIMEOUT.as_secs(),
                log_tail(&log)
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether `command` can start a standby of `ram_size` bytes here, and
/// the shape of the VM it starts: it is started on a scratch file of that
/// size (never the image: nothing may touch it but epochs), read and quit.
pub fn dry_run(command: &[String], ram_size: u64, dir: &Path) -> Result<VmShape, String> {
    use nix::sys::memfd::{memfd_create, MFdFlags};
    let fd = memfd_create(c"hag-dry-run-ram", MFdFlags::MFD_CLOEXEC).map_err(|e| e.to_string())?;
    let len = i64::try_from(ram_size).map_err(|_| format!("RAM size {ram_size}"))?;
    nix::unistd::ftruncate(&fd, len).map_err(|e| e.to_string())?;
    let path = proc_fd_path(fd.as_fd());
    let mut s = start(command, "hag-dry-run-ram", &path, ram_size, dir, "dry-run")?;
    let shape = VmShape::read(s.qemu.qmp());
    let _ = s.qemu.quit();
    let _ = s.child.wait();
    shape.map_err(|e| format!("cannot read the standby VM's devices: {e}"))
}

/// `/proc/PID/fd/N` of one of this process's fds: a path another process
/// (QEMU) opens to reach the same file, a memfd included.
pub fn proc_fd_path(fd: std::os::fd::BorrowedFd<'_>) -> String {
    use std::os::fd::AsRawFd;
    format!("/proc/{}/fd/{}", std::process::id(), fd.as_raw_fd())
}

impl Standby {
    /// Loads `state` (an epoch's QEMU stream without shared RAM); the VM
    /// stays paused.
    pub fn load(&mut self, state: &[u8]) -> Result<(), String> {
        let qemu = &mut self.qemu;
        qemu.apply(&MigrationSettings {
            capabilities: vec![("x-ignore-shared".into(), true)],
            ..MigrationSettings::default()
        })
        .map_err(|e| e.to_string())?;
        let (r, w) = nix::unistd::pipe().map_err(|e| e.to_string())?;
        qemu.qmp()
            .execute_with_fd("getfd", Some(json!({ "fdname": "hag-epoch" })), r.as_fd())
            .map_err(|e| e.to_string())?;
        drop(r);
        let bytes = state.to_vec();
        let writer = std::thread::spawn(move || {
            let mut w = std::fs::File::from(w);
            // QEMU closing early (a refused stream) ends this with EPIPE.
            let _ = w.write_all(&bytes);
        });
        qemu.qmp()
            .execute("migrate-incoming", Some(json!({ "uri": "fd:hag-epoch" })))
            .map_err(|e| format!("migrate-incoming: {e}"))?;
        let deadline = Instant::now() + LOAD_TIMEOUT;
        let result = loop {
            let info = qemu.migration_info().map_err(|e| e.to_string())?;
            match info.status.as_str() {
                "completed" => break Ok(()),
                "failed" | "cancelled" => {
                    break Err(format!(
                        "QEMU refused the device state ({} bytes): {}",
                        state.len(),
                        info.error.unwrap_or_else(|| "no reason given".into())
                    ))
                }
                _ if Instant::now() >= deadline => {
                    break Err(format!(
                        "loading the device state took over {} s",
                        LOAD_TIMEOUT.as_secs()
                    ))
                }
                _ => std::thread::sleep(Duration::from_millis(5)),
            }
        };
        // QEMU closes the fd at the end of the load; a stream it left
        // unread must not hold the writer.
        let _ = qemu
            .qmp()
            .execute("closefd", Some(json!({ "fdname": "hag-epoch" })));
        let _ = writer.join();
        result.map_err(|e| format!("{e} (QEMU: {})", log_tail(&self.log)))?;
        // The VM that runs on after a takeover is migrated like any other
        // later (a failback): with its RAM.
        qemu.apply(&MigrationSettings {
            capabilities: vec![("x-ignore-shared".into(), false)],
            ..MigrationSettings::default()
        })
        .map_err(|e| e.to_string())?;
        let st = wait_state(qemu, Duration::from_secs(10), |s| s.kind == RunKind::Paused)
            .map_err(|e| e.to_string())?;
        if st.kind != RunKind::Paused {
            return Err(format!("after loading, the VM is {st}, not paused"));
        }
        Ok(())
    }

    /// Lets the loaded VM run.
    pub fn run(&mut self) -> Result<(), String> {
        self.qemu.resume().map_err(|e| e.to_string())?;
        let st = wait_state(&mut self.qemu, Duration::from_secs(10), |s| s.is_running())
            .map_err(|e| e.to_string())?;
        if !st.is_running() {
            return Err(format!("after cont, the VM is {st}"));
        }
        Ok(())
    }

    /// Ends a standby that will not run.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_standby_maps_the_image_and_waits_paused() {
        let args = standby_args(
            "pc.ram",
            "/proc/7/fd/9",
            256 << 20,
            Path::new("/run/hag/standby.qmp"),
        );
        assert_eq!(
            args.join(" "),
            "-object memory-backend-file,id=pc.ram,size=268435456,mem-path=/proc/7/fd/9,share=on \
             -machine memory-backend=pc.ram -qmp unix:/run/hag/standby.qmp,server=on,wait=off \
             -incoming defer -S"
        );
    }

    #[test]
    fn a_command_that_is_not_qemu_is_refused_with_its_output() {
        let dir = std::env::temp_dir().join(format!("hag-standby-test-{}", std::process::id()));
        let cmd = [
            "sh".to_owned(),
            "-c".into(),
            "echo no vGPU here >&2; exit 3".into(),
        ];
        let Err(err) = start(&cmd, "ram0", "/nonexistent", 4096, &dir, "t") else {
            panic!("sh passed for QEMU")
        };
        assert!(
            err.contains("exited") && err.contains("no vGPU here"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
