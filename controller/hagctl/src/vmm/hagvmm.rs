//! The [`Vmm`] driver for `hag-vmm serve`, over its control socket
//! ([`vmm_control`]).
//!
//! hag-vmm hands hagctl what QEMU keeps to itself, its guest RAM (a memfd)
//! and its CPU dirty log, and has no migration of its own: hagctl copies
//! the VM itself (`hagctl migrate --vm`, `crate::wire`). Its device state
//! is the VM state bytes of `get-state` (the vGPU's context is read through
//! `/dev/hag`, not from the VMM).

use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::Path;

use guest_ram::GuestRam;
use vmm_control::VmClient;

use super::copy::{CopyVm, VmStatus};
use super::{Feature, RunKind, RunState, SavedState, Vmm, VmmError};
use crate::wire::VmmKind;

/// A `hag-vmm serve` VM.
pub struct HagVmm {
    client: VmClient,
}

/// What hag-vmm's `status` states mean.
pub fn run_state(state: &str) -> RunState {
    let kind = match state {
        "running" => RunKind::Running,
        "paused" => RunKind::Paused,
        "incoming" => RunKind::Incoming,
        "finished" => RunKind::Finished,
        _ => RunKind::Stopped,
    };
    RunState::new(kind, state)
}

impl HagVmm {
    /// Connects to the control socket at `path`.
    pub fn connect(path: &Path) -> Result<HagVmm, VmmError> {
        Ok(HagVmm::new(VmClient::connect(path)?))
    }

    /// The driver over an open control connection.
    pub fn new(client: VmClient) -> HagVmm {
        HagVmm { client }
    }

    /// The control connection, for what only hag-vmm has (the workload's
    /// iteration, output holding, `get-state`).
    pub fn client(&mut self) -> &mut VmClient {
        &mut self.client
    }

    /// The control connection back.
    pub fn into_client(self) -> VmClient {
        self.client
    }
}

const MIGRATE_HINT: &str = "hag-vmm does not migrate itself: `hagctl migrate --vm` and \
                            `hagctl receive --vm` copy its RAM, vGPU context and state";

impl Vmm for HagVmm {
    fn describe(&self) -> String {
        format!("hag-vmm at {}", self.client.path().display())
    }

    fn features(&self) -> &'static [Feature] {
        &[
            Feature::RunState,
            Feature::Pause,
            Feature::Resume,
            Feature::Quit,
            Feature::SaveDeviceState,
            Feature::GuestMemory,
            Feature::CpuDirtyLog,
        ]
    }

    fn unsupported(&self, feature: Feature) -> VmmError {
        VmmError::Unsupported {
            vmm: self.describe(),
            feature,
            hint: match feature {
                Feature::Migrate | Feature::Incoming => MIGRATE_HINT,
                _ => "",
            },
        }
    }

    fn run_state(&mut self) -> Result<RunState, VmmError> {
        Ok(run_state(&self.client.status()?.state))
    }

    fn pause(&mut self) -> Result<(), VmmError> {
        self.client.pause().map(|_| ()).map_err(Into::into)
    }

    fn resume(&mut self) -> Result<(), VmmError> {
        self.client.resume().map_err(Into::into)
    }

    fn quit(&mut self) -> Result<(), VmmError> {
        self.client.quit().map_err(Into::into)
    }

    fn save_device_state(&mut self, into: OwnedFd) -> Result<SavedState, VmmError> {
        let state = self.client.get_state()?;
        let mut out = std::fs::File::from(into);
        out.write_all(&state)
            .and_then(|()| out.flush())
            .map_err(|source| VmmError::Io {
                what: format!("writing {} bytes of hag-vmm VM state", state.len()),
                source,
            })?;
        Ok(SavedState {
            bytes: Some(state.len() as u64),
        })
    }

    fn guest_memory(&mut self) -> Result<GuestRam, VmmError> {
        self.client.ram().map_err(Into::into)
    }

    fn cpu_dirty_log(&mut self) -> Result<Vec<u64>, VmmError> {
        self.client.cpu_dirty().map_err(Into::into)
    }
}

impl CopyVm for HagVmm {
    fn kind(&self) -> VmmKind {
        VmmKind::HagVmm
    }

    fn status(&mut self) -> Result<VmStatus, VmmError> {
        let st = self.client.status()?;
        Ok(match st.state.as_str() {
            "running" => VmStatus::Running {
                iteration: st.iteration,
            },
            "finished" => VmStatus::Finished {
                passed: st.passed == Some(true),
                result: st.result.unwrap_or_default(),
            },
            _ => VmStatus::Other(st.state),
        })
    }

    fn pause_at(&mut self) -> Result<u32, VmmError> {
        self.client.pause().map_err(Into::into)
    }

    fn vm_state(&mut self) -> Result<Vec<u8>, VmmError> {
        self.client.get_state().map_err(Into::into)
    }

    fn hold_output(&mut self, on: bool) -> Result<(), String> {
        self.client.hold_output(on).map_err(|e| e.to_string())
    }

    fn mark_epoch(&mut self, epoch: u64) -> Result<(), String> {
        self.client
            .mark_epoch(epoch)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    fn release_output(&mut self, epoch: u64) -> Result<u64, String> {
        self.client.release_output(epoch).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::os::unix::net::UnixListener;
    use vmm_control::{bitmap_hex, hex, Reply};

    #[test]
    fn states_map() {
        assert!(run_state("running").is_running());
        assert_eq!(run_state("paused").kind, RunKind::Paused);
        assert_eq!(run_state("incoming").kind, RunKind::Incoming);
        assert_eq!(run_state("finished").kind, RunKind::Finished);
        assert_eq!(run_state("stopped").kind, RunKind::Stopped);
        assert_eq!(run_state("paused").to_string(), "paused");
    }

    /// A fake `hag-vmm serve` answering status, pause, get-state and
    /// cpu-dirty.
    #[test]
    fn drives_the_control_protocol() {
        let dir = std::env::temp_dir().join(format!("hagctl-hagvmm-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("vm.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            let mut w = s.try_clone().unwrap();
            let mut seen = Vec::new();
            for line in BufReader::new(s).lines() {
                let Ok(line) = line else { break };
                let req: serde_json::Value = serde_json::from_str(&line).unwrap();
                let cmd = req["cmd"].as_str().unwrap().to_owned();
                let reply = match cmd.as_str() {
                    "status" => Reply {
                        state: Some("running".into()),
                        ..Reply::ok()
                    },
                    "pause" => Reply {
                        state: Some("paused".into()),
                        iteration: Some(4),
                        ..Reply::ok()
                    },
                    "get-state" => Reply {
                        vm_state: Some(hex(b"state!")),
                        ..Reply::ok()
                    },
                    "cpu-dirty" => Reply {
                        pages: Some(2),
                        bitmap: Some(bitmap_hex(&[0b101])),
                        ..Reply::ok()
                    },
                    _ => Reply::err("no"),
                };
                seen.push(cmd);
                let mut out = serde_json::to_vec(&reply).unwrap();
                out.push(b'\n');
                w.write_all(&out).unwrap();
            }
            seen
        });
        let mut vm = HagVmm::connect(&path).unwrap();
        assert!(vm.describe().starts_with("hag-vmm at "));
        assert!(vm.run_state().unwrap().is_running());
        vm.pause().unwrap();
        let (r, w) = nix::unistd::pipe().unwrap();
        assert_eq!(vm.save_device_state(w).unwrap().bytes, Some(6));
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut std::fs::File::from(r), &mut got).unwrap();
        assert_eq!(got, b"state!");
        assert_eq!(vm.cpu_dirty_log().unwrap(), [0b101]);
        let e = vm.resume().unwrap_err();
        assert_eq!(e.to_string(), "the VM refused 'resume': no");
        // What hag-vmm lacks is said, with what to use instead.
        assert!(!vm.supports(Feature::Migrate));
        let addr = super::super::MigrationAddress::parse_tcp("h:1").unwrap();
        let e = vm
            .start_migration(&addr, &Default::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot migrate the VM itself"), "{e}");
        assert!(e.contains("hagctl migrate --vm"), "{e}");
        drop(vm);
        assert_eq!(
            server.join().unwrap(),
            ["status", "pause", "get-state", "cpu-dirty", "resume"]
        );
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_dir(&dir);
    }
}
