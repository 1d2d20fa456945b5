//! The control socket of `hag-vmm serve`: how a controller (`hagctl
//! migrate`, `hagctl receive`) pauses and resumes the VM, reaches its guest
//! RAM, reads its CPU dirty log and moves its state.
//!
//! A unix stream socket at `--control PATH`. The controller sends one
//! request per line, a JSON object with a `"cmd"` field; the VM answers each
//! with one line, a JSON object whose `"ok"` is `true` (with the fields
//! below) or `false` with an `"error"` saying why. Requests on one
//! connection are answered in order; several connections may be open.
//!
//! | request | reply fields (besides `"ok": true`) |
//! | --- | --- |
//! | `{"cmd": "status"}` | `"state"`: `running`, `paused`, `incoming`, `finished` or `stopped`; `"iteration"`, `"iterations"`; once finished `"passed"` and `"result"` (the PASS/FAIL line) |
//! | `{"cmd": "pause"}` | `"state": "paused"`, `"iteration"`: the VM loop stopped at its next step boundary (GPU work may still be in flight) |
//! | `{"cmd": "resume"}` | `"state": "running"`; an `incoming` VM needs `set-state` first, and then continues from that state |
//! | `{"cmd": "ram"}` | `"size"` (bytes), `"page_size"` (4096); the guest RAM memfd comes with the reply as `SCM_RIGHTS` ancillary data |
//! | `{"cmd": "cpu-dirty"}` | `"pages"`: count; `"bitmap"`: hex of the little-endian u64 words of the bitmap (bit `i % 64` of word `i / 64` is guest page `i`) of pages the VM's CPU side wrote since the last `cpu-dirty`, which it clears |
//! | `{"cmd": "vgpu"}` | `"mdev"`: the mdev UUID, `"vgpu_id"`: hag's vGPU id |
//! | `{"cmd": "get-state"}` | `"vm_state"`: hex of the VM state bytes (paused only) |
//! | `{"cmd": "set-state", "vm_state": "…hex…"}` | nothing; paused or incoming only; the bytes are checked, and used on the next `resume` |
//! | `{"cmd": "hold-output", "hold": true}` | nothing; while held, the VM's console lines (`--progress` lines and the final PASS/FAIL line) are kept back until released (Remus output commit); `"hold": false` prints everything held and stops holding |
//! | `{"cmd": "mark-epoch", "epoch": N}` | `"released"`: lines tagged; tags the held lines not yet tagged with checkpoint epoch N (call it while the VM is paused or finished, when the epoch is captured) |
//! | `{"cmd": "release-output", "epoch": N}` | `"released"`: lines printed; prints the held lines of epochs up to N (once N is acknowledged by the backup). A finished VM exits only once its result line is released |
//! | `{"cmd": "finish"}` | `"iteration"`: the workload ends after the iterations done so far, at its next step boundary, verified as at its end (its PASS/FAIL line counts those); a test's way to end a fixed-length run once it has seen what it waits for; running or paused VMs only |
//! | `{"cmd": "quit"}` | `"state": "stopped"`, sent once the VM loop stopped and the VFIO device is closed; the process then exits 0 |
//!
//! An unknown or malformed request gets `"ok": false` and the connection
//! stays usable. [`VmClient`] is the controller's side.

use std::io::{IoSlice, IoSliceMut, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

use guest_ram::{GuestRam, PAGE_SIZE};

/// A request.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "cmd", rename_all = "kebab-case")]
pub enum Request {
    /// Run state and progress.
    Status,
    /// Stop the VM loop at its next step boundary.
    Pause,
    /// Continue (an incoming VM: start from the state set).
    Resume,
    /// Guest RAM size and memfd.
    Ram,
    /// Read and clear the CPU dirty bitmap.
    CpuDirty,
    /// The vGPU.
    Vgpu,
    /// The VM state bytes.
    GetState,
    /// Replace the VM state.
    SetState {
        /// Hex of the bytes.
        vm_state: String,
    },
    /// End the workload after the iterations done so far, verified.
    Finish,
    /// Stop the VM and close the vGPU.
    Quit,
    /// Hold (or stop holding and flush) the VM's console output.
    HoldOutput {
        /// Hold from now on; `false` prints everything held.
        hold: bool,
    },
    /// Tag the untagged held output with a checkpoint epoch.
    MarkEpoch {
        /// The epoch being captured.
        epoch: u64,
    },
    /// Print the held output of epochs up to `epoch`.
    ReleaseOutput {
        /// The last acknowledged epoch.
        epoch: u64,
    },
}

impl Request {
    /// The request's name on the wire.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Status => "status",
            Request::Pause => "pause",
            Request::Resume => "resume",
            Request::Ram => "ram",
            Request::CpuDirty => "cpu-dirty",
            Request::Vgpu => "vgpu",
            Request::GetState => "get-state",
            Request::SetState { .. } => "set-state",
            Request::Finish => "finish",
            Request::Quit => "quit",
            Request::HoldOutput { .. } => "hold-output",
            Request::MarkEpoch { .. } => "mark-epoch",
            Request::ReleaseOutput { .. } => "release-output",
        }
    }
}

/// A reply: `ok`, and the fields the request has.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Reply {
    /// The request was carried out.
    pub ok: bool,
    /// Why not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Run state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// Next iteration of the workload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iteration: Option<u32>,
    /// Iterations in all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iterations: Option<u32>,
    /// The workload's verification passed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passed: Option<bool>,
    /// The result line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// Guest RAM bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// Page size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_size: Option<u64>,
    /// Dirty pages in `bitmap`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pages: Option<u64>,
    /// Hex bitmap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bitmap: Option<String>,
    /// mdev UUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mdev: Option<String>,
    /// hag vGPU id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu_id: Option<u32>,
    /// Hex VM state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_state: Option<String>,
    /// Output lines tagged or released.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<u64>,
}

impl Reply {
    /// A success with no fields.
    pub fn ok() -> Self {
        Reply {
            ok: true,
            ..Reply::default()
        }
    }

    /// A refusal.
    pub fn err(error: impl Into<String>) -> Self {
        Reply {
            ok: false,
            error: Some(error.into()),
            ..Reply::default()
        }
    }
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(D[usize::from(b >> 4)] as char);
        s.push(D[usize::from(b & 15)] as char);
    }
    s
}

/// Bytes of hex text, or `None` if it is not hex of whole bytes.
pub fn unhex(text: &str) -> Option<Vec<u8>> {
    let t = text.as_bytes();
    if t.len() % 2 != 0 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    t.chunks_exact(2)
        .map(|p| Some((digit(p[0])? << 4) | digit(p[1])?))
        .collect()
}

/// Bitmap words as hex (little-endian bytes of each word).
pub fn bitmap_hex(words: &[u64]) -> String {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    hex(&bytes)
}

/// Bitmap words from [`bitmap_hex`] text.
pub fn bitmap_unhex(text: &str) -> Option<Vec<u64>> {
    let bytes = unhex(text)?;
    if bytes.len() % 8 != 0 {
        return None;
    }
    Some(
        bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect(),
    )
}

/// Longest reply line accepted.
const MAX_LINE: usize = 16 << 20;

/// Sends `line` (which ends in a newline) on `stream` with `fd` attached
/// as `SCM_RIGHTS`.
pub fn send_with_fd(stream: &UnixStream, line: &[u8], fd: BorrowedFd<'_>) -> std::io::Result<()> {
    let fds = [fd.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    let iov = [IoSlice::new(line)];
    let sent = sendmsg::<()>(stream.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None)
        .map_err(std::io::Error::from)?;
    // The fd went with the first byte; the rest goes plainly.
    (&*stream).write_all(&line[sent..])
}

/// Why a control request failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// No VM listens there.
    #[error("cannot connect to the VM's control socket {path}")]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// What connect said.
        #[source]
        source: std::io::Error,
    },
    /// Reading or writing the socket failed.
    #[error("control socket {path}: '{request}' failed")]
    Io {
        /// The socket path.
        path: PathBuf,
        /// The request.
        request: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The VM answered something this client cannot use.
    #[error("control socket {path}: bad reply to '{request}': {what}")]
    Protocol {
        /// The socket path.
        path: PathBuf,
        /// The request.
        request: &'static str,
        /// What was wrong.
        what: String,
    },
    /// The VM refused the request.
    #[error("the VM refused '{request}': {error}")]
    Refused {
        /// The request.
        request: &'static str,
        /// The VM's reason.
        error: String,
    },
}

/// The VM's state, as `status` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmStatus {
    /// `running`, `paused`, `incoming`, `finished`, `stopped`.
    pub state: String,
    /// Next iteration.
    pub iteration: u32,
    /// Iterations in all.
    pub iterations: u32,
    /// Once finished: the verification passed.
    pub passed: Option<bool>,
    /// Once finished: the result line.
    pub result: Option<String>,
}

/// A controller's connection to a VM's control socket.
pub struct VmClient {
    stream: UnixStream,
    path: PathBuf,
    pending: Vec<u8>,
}

impl VmClient {
    /// The pid of the VMM at the other end (`SO_PEERCRED`: the process
    /// that made the listening socket).
    pub fn peer_pid(&self) -> nix::Result<u32> {
        nix::sys::socket::getsockopt(&self.stream, nix::sys::socket::sockopt::PeerCredentials)
            .map(|c| c.pid().unsigned_abs())
    }

    /// Connects to the control socket at `path`.
    pub fn connect(path: &Path) -> Result<Self, ControlError> {
        let stream = UnixStream::connect(path).map_err(|source| ControlError::Connect {
            path: path.to_owned(),
            source,
        })?;
        // A VM that stops answering must not hang the controller forever.
        let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
        Ok(VmClient {
            stream,
            path: path.to_owned(),
            pending: Vec::new(),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sends `req` and returns the reply (checked to be `ok`) and any fds
    /// that came with it.
    pub fn call(&mut self, req: &Request) -> Result<(Reply, Vec<OwnedFd>), ControlError> {
        let name = req.name();
        let io = |source| ControlError::Io {
            path: self.path.clone(),
            request: name,
            source,
        };
        let mut line = serde_json::to_vec(req).unwrap_or_default();
        line.push(b'\n');
        (&self.stream).write_all(&line).map_err(io)?;
        let (text, fds) = self.read_line(name)?;
        let reply: Reply = serde_json::from_slice(&text).map_err(|e| ControlError::Protocol {
            path: self.path.clone(),
            request: name,
            what: format!("not a JSON reply: {e}"),
        })?;
        if !reply.ok {
            return Err(ControlError::Refused {
                request: name,
                error: reply.error.unwrap_or_else(|| "no reason given".into()),
            });
        }
        Ok((reply, fds))
    }

    fn read_line(&mut self, name: &'static str) -> Result<(Vec<u8>, Vec<OwnedFd>), ControlError> {
        let mut fds = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            if let Some(nl) = self.pending.iter().position(|&b| b == b'\n') {
                let rest = self.pending.split_off(nl + 1);
                let mut line = std::mem::replace(&mut self.pending, rest);
                line.pop();
                return Ok((line, fds));
            }
            if self.pending.len() > MAX_LINE {
                return Err(ControlError::Protocol {
                    path: self.path.clone(),
                    request: name,
                    what: format!("reply longer than {MAX_LINE} bytes"),
                });
            }
            let mut cmsg = nix::cmsg_space!([RawFd; 4]);
            let mut iov = [IoSliceMut::new(&mut buf)];
            let msg = recvmsg::<()>(
                self.stream.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            );
            let msg = match msg {
                Ok(m) => m,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    return Err(ControlError::Io {
                        path: self.path.clone(),
                        request: name,
                        source: e.into(),
                    })
                }
            };
            let n = msg.bytes;
            for c in msg.cmsgs().into_iter().flatten() {
                if let ControlMessageOwned::ScmRights(raw) = c {
                    for fd in raw {
                        // SAFETY: the kernel just installed `fd` in this
                        // process for this message (SCM_RIGHTS); nothing
                        // else owns it.
                        fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                    }
                }
            }
            if n == 0 {
                return Err(ControlError::Io {
                    path: self.path.clone(),
                    request: name,
                    source: std::io::ErrorKind::UnexpectedEof.into(),
                });
            }
            self.pending.extend_from_slice(&buf[..n]);
        }
    }

    fn missing(&self, request: &'static str, field: &str) -> ControlError {
        ControlError::Protocol {
            path: self.path.clone(),
            request,
            what: format!("no '{field}' in the reply"),
        }
    }

    /// `status`.
    pub fn status(&mut self) -> Result<VmStatus, ControlError> {
        let (r, _) = self.call(&Request::Status)?;
        Ok(VmStatus {
            state: r.state.ok_or_else(|| self.missing("status", "state"))?,
            iteration: r.iteration.unwrap_or(0),
            iterations: r.iterations.unwrap_or(0),
            passed: r.passed,
            result: r.result,
        })
    }

    /// `pause`: returns the iteration it stopped at.
    pub fn pause(&mut self) -> Result<u32, ControlError> {
        Ok(self.call(&Request::Pause)?.0.iteration.unwrap_or(0))
    }

    /// `resume`.
    pub fn resume(&mut self) -> Result<(), ControlError> {
        self.call(&Request::Resume).map(|_| ())
    }

    /// `quit`.
    pub fn quit(&mut self) -> Result<(), ControlError> {
        self.call(&Request::Quit).map(|_| ())
    }

    /// `ram`: maps the VM's guest RAM into this process.
    pub fn ram(&mut self) -> Result<GuestRam, ControlError> {
        let (r, mut fds) = self.call(&Request::Ram)?;
        let size = r.size.ok_or_else(|| self.missing("ram", "size"))?;
        if r.page_size != Some(PAGE_SIZE) {
            return Err(ControlError::Protocol {
                path: self.path.clone(),
                request: "ram",
                what: format!(
                    "page size {:?}, this controller uses {PAGE_SIZE}",
                    r.page_size
                ),
            });
        }
        let fd = fds
            .pop()
            .ok_or_else(|| self.missing("ram", "memfd (SCM_RIGHTS)"))?;
        GuestRam::map_fd(fd, size).map_err(|e| ControlError::Protocol {
            path: self.path.clone(),
            request: "ram",
            what: e.to_string(),
        })
    }

    /// `cpu-dirty`: the bitmap words (read and cleared in the VM).
    pub fn cpu_dirty(&mut self) -> Result<Vec<u64>, ControlError> {
        let (r, _) = self.call(&Request::CpuDirty)?;
        let text = r
            .bitmap
            .ok_or_else(|| self.missing("cpu-dirty", "bitmap"))?;
        bitmap_unhex(&text).ok_or_else(|| ControlError::Protocol {
            path: self.path.clone(),
            request: "cpu-dirty",
            what: "bitmap is not hex of u64 words".into(),
        })
    }

    /// `vgpu`: mdev UUID and hag vGPU id.
    pub fn vgpu(&mut self) -> Result<(String, u32), ControlError> {
        let (r, _) = self.call(&Request::Vgpu)?;
        Ok((
            r.mdev.ok_or_else(|| self.missing("vgpu", "mdev"))?,
            r.vgpu_id.ok_or_else(|| self.missing("vgpu", "vgpu_id"))?,
        ))
    }

    /// `get-state`.
    pub fn get_state(&mut self) -> Result<Vec<u8>, ControlError> {
        let (r, _) = self.call(&Request::GetState)?;
        let text = r
            .vm_state
            .ok_or_else(|| self.missing("get-state", "vm_state"))?;
        unhex(&text).ok_or_else(|| ControlError::Protocol {
            path: self.path.clone(),
            request: "get-state",
            what: "vm_state is not hex".into(),
        })
    }

    /// `hold-output`.
    pub fn hold_output(&mut self, hold: bool) -> Result<(), ControlError> {
        self.call(&Request::HoldOutput { hold }).map(|_| ())
    }

    /// `mark-epoch`: returns the lines tagged.
    pub fn mark_epoch(&mut self, epoch: u64) -> Result<u64, ControlError> {
        Ok(self
            .call(&Request::MarkEpoch { epoch })?
            .0
            .released
            .unwrap_or(0))
    }

    /// `release-output`: returns the lines printed.
    pub fn release_output(&mut self, epoch: u64) -> Result<u64, ControlError> {
        Ok(self
            .call(&Request::ReleaseOutput { epoch })?
            .0
            .released
            .unwrap_or(0))
    }

    /// `set-state`.
    pub fn set_state(&mut self, bytes: &[u8]) -> Result<(), ControlError> {
        self.call(&Request::SetState {
            vm_state: hex(bytes),
        })
        .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_have_the_documented_form() {
        assert_eq!(
            serde_json::to_string(&Request::CpuDirty).unwrap(),
            r#"{"cmd":"cpu-dirty"}"#
        );
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"cmd":"set-state","vm_state":"00ff"}"#).unwrap(),
            Request::SetState {
                vm_state: "00ff".into()
            }
        );
        assert!(serde_json::from_str::<Request>(r#"{"cmd":"reboot"}"#).is_err());
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"cmd":"release-output","epoch":7}"#).unwrap(),
            Request::ReleaseOutput { epoch: 7 }
        );
        assert_eq!(
            serde_json::to_string(&Request::HoldOutput { hold: true }).unwrap(),
            r#"{"cmd":"hold-output","hold":true}"#
        );
        assert_eq!(
            serde_json::to_string(&Reply::err("no")).unwrap(),
            r#"{"ok":false,"error":"no"}"#
        );
    }

    #[test]
    fn hex_round_trips() {
        assert_eq!(hex(&[0, 0xab, 0x10]), "00ab10");
        assert_eq!(unhex("00AB10"), Some(vec![0, 0xab, 0x10]));
        assert_eq!(unhex("0"), None);
        assert_eq!(unhex("zz"), None);
        let words = [1u64, 1 << 63];
        assert_eq!(bitmap_unhex(&bitmap_hex(&words)), Some(words.to_vec()));
        assert_eq!(bitmap_unhex("0011"), None);
    }

    #[test]
    fn a_reply_carries_an_fd() {
        let (a, b) = UnixStream::pair().unwrap();
        let ram = GuestRam::new_memfd(8 * PAGE_SIZE).unwrap();
        ram.write_u32(0x1000, 42).unwrap();
        let reply = Reply {
            size: Some(8 * PAGE_SIZE),
            page_size: Some(PAGE_SIZE),
            ..Reply::ok()
        };
        let mut line = serde_json::to_vec(&reply).unwrap();
        line.push(b'\n');
        send_with_fd(&a, &line, ram.fd().unwrap()).unwrap();
        let mut client = VmClient {
            stream: b,
            path: "test".into(),
            pending: Vec::new(),
        };
        let (text, mut fds) = client.read_line("ram").unwrap();
        assert_eq!(serde_json::from_slice::<Reply>(&text).unwrap(), reply);
        let other = GuestRam::map_fd(fds.pop().unwrap(), 8 * PAGE_SIZE).unwrap();
        assert_eq!(other.read_u32(0x1000).unwrap(), 42);
    }
}
