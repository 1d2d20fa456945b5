//! After a takeover, the VM taken over is protected again (`hagctl backup
//! --reprotect HOST:PORT`): the backup, which owns the taken-over QEMU,
//! runs `hagctl checkpoint --qmp` on it against the backup at HOST:PORT
//! (the old primary's host once it stands by again, or another host),
//! exactly as any primary is protected, and starts it again while that
//! backup cannot be reached. The new pair starts at the takeover's
//! generation, so the fenced old copy stays fenced.
//!
//! Why a child process and not the checkpoint loop in this one: the
//! checkpoint is the primary's code path as tested everywhere else (its
//! output gate, its crash and hang hand-over, its status file and `hagctl
//! job`), and it must find guest RAM held by QEMU alone, which it does
//! once this backup has closed its standby image (see [`run`]).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::log::{info, warning};

/// How long after a failed protection (its backup unreachable or not
/// standing by yet) the next one starts.
pub const RETRY: Duration = Duration::from_secs(5);

/// What re-protection needs to know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reprotect {
    /// The next backup, HOST:PORT.
    pub to: String,
    /// The taken-over QEMU's QMP socket (this backup's STATUS_DIR/takeover.qmp).
    pub qmp: PathBuf,
    /// The takeover's generation: the new pair's.
    pub generation: u64,
    /// The pair key.
    pub key: PathBuf,
    pub failover_timeout: Duration,
    /// The witness and its key, as this backup had them.
    pub witness: Option<(String, Option<PathBuf>)>,
    /// Where the checkpoint's runtime and durable files go.
    pub status_dir: PathBuf,
    pub state_dir: PathBuf,
    /// More `hagctl checkpoint` arguments (`--interval`, `--plug`, …).
    pub extra: Vec<String>,
}

impl Reprotect {
    /// `hagctl checkpoint`'s arguments.
    pub fn args(&self) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "checkpoint".into(),
            "--qmp".into(),
            self.qmp.display().to_string(),
            "--backup".into(),
            self.to.clone(),
            "--generation".into(),
            self.generation.to_string(),
            "--key".into(),
            self.key.display().to_string(),
            "--failover-timeout".into(),
            format!("{}ms", self.failover_timeout.as_millis()),
            "--status-dir".into(),
            self.status_dir.display().to_string(),
            "--state-dir".into(),
            self.state_dir.display().to_string(),
        ];
        if let Some((addr, key)) = &self.witness {
            a.extend(["--witness".into(), addr.clone()]);
            if let Some(k) = key {
                a.extend(["--witness-key".into(), k.display().to_string()]);
            }
        }
        a.extend(self.extra.iter().cloned());
        a
    }
}

/// What to do once a protection's `hagctl checkpoint` ended with `code`
/// (None: killed by a signal), the VM still running here.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// It could not protect the VM yet (status 1: the backup unreachable,
    /// not standing by, refusing): start it again after [`RETRY`].
    Retry,
    /// Protection ended for good: the VM finished, stopped, migrated away
    /// or was handed over (0), was fenced (3), could not be stopped (5),
    /// a usage error (2) or a kill. Nothing more is started.
    Stop,
}

/// [`Next`] for a checkpoint's exit code.
pub fn after(code: Option<i32>) -> Next {
    match code {
        Some(1) => Next::Retry,
        _ => Next::Stop,
    }
}

/// Protects the VM `vm` (the taken-over QEMU) as `how` says until it ends;
/// returns its exit status. The caller has closed its own descriptor of
/// guest RAM (the checkpoint refuses RAM another process holds).
pub fn run(how: &Reprotect, vm: &mut Child) -> std::io::Result<ExitStatus> {
    let exe = std::env::current_exe()?;
    let mut next_start = Instant::now();
    let mut checkpoint: Option<Child> = None;
    loop {
        if let Some(status) = vm.try_wait()? {
            // The checkpoint sees the VM gone and ends by itself.
            if let Some(mut c) = checkpoint.take() {
                let _ = c.wait();
            }
            return Ok(status);
        }
        match &mut checkpoint {
            Some(c) => {
                if let Some(st) = c.try_wait()? {
                    checkpoint = None;
                    match after(st.code()) {
                        Next::Retry => {
                            info!(
                                "re-protection with {} failed ({st}); trying again in {} s",
                                how.to,
                                RETRY.as_secs()
                            );
                            next_start = Instant::now() + RETRY;
                        }
                        Next::Stop => {
                            info!(
                                "re-protection with {} ended ({st}); the VM runs on here",
                                how.to
                            );
                            return vm.wait();
                        }
                    }
                }
            }
            None if Instant::now() >= next_start => {
                checkpoint = Some(start(&exe, how)?);
            }
            None => {}
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn start(exe: &Path, how: &Reprotect) -> std::io::Result<Child> {
    let args = how.args();
    info!(
        "re-protecting the VM taken over here: hagctl {}",
        shell_words::join(&args)
    );
    std::fs::create_dir_all(&how.status_dir)?;
    let child = Command::new(exe).args(&args).stdin(Stdio::null()).spawn();
    if let Err(e) = &child {
        warning!("cannot start hagctl checkpoint: {e}");
    }
    child
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_protection_that_could_not_start_is_retried() {
        assert_eq!(after(Some(1)), Next::Retry);
        for code in [Some(0), Some(2), Some(3), Some(4), Some(5), None] {
            assert_eq!(after(code), Next::Stop, "{code:?}");
        }
    }

    #[test]
    fn the_checkpoint_starts_at_the_takeovers_generation_with_the_pairs_key() {
        let r = Reprotect {
            to: "192.0.2.10:7200".into(),
            qmp: "/run/hag/web1/takeover.qmp".into(),
            generation: 2,
            key: "/etc/hag/web1.key".into(),
            failover_timeout: Duration::from_secs(3),
            witness: Some(("192.0.2.30:7300".into(), None)),
            status_dir: "/run/hag/web1/reprotect".into(),
            state_dir: "/var/lib/hag/web1/reprotect".into(),
            extra: vec!["--interval".into(), "1s".into()],
        };
        assert_eq!(
            shell_words::join(r.args()),
            "checkpoint --qmp /run/hag/web1/takeover.qmp --backup 192.0.2.10:7200 --generation 2 \
             --key /etc/hag/web1.key --failover-timeout 3000ms --status-dir /run/hag/web1/reprotect \
             --state-dir /var/lib/hag/web1/reprotect --witness 192.0.2.30:7300 --interval 1s"
        );
    }
}
