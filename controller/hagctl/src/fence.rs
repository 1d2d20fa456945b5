//! `hagctl backup --fence-peer CMD`: the operator's own fencing, run
//! before a takeover, as DRBD runs its fence-peer handler before it
//! promotes. The takeover goes on only if the command succeeds in time:
//! it says the old primary can no longer run the VM (its host powered off
//! through a fence agent, its storage or network cut). A command that
//! fails, or does not end within its timeout (then killed), leaves the
//! primary unfenced and the backup standing by with its checkpoint; the
//! next decision runs it again.
//!
//! The command runs as `sh -c CMD` with the takeover's facts in its
//! environment ([`FenceFacts::env`]), its output forwarded to hagctl's
//! stderr line by line.

use crate::log::info;
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The operator's fence command and how long it may take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FencePeer {
    /// Run by `sh -c`.
    pub command: String,
    /// Killed, and failed, past this.
    pub timeout: Duration,
}

/// What the command is told about the takeover it fences for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FenceFacts {
    /// The primary's address, as its data connection came from (empty if
    /// none was ever heard).
    pub peer: String,
    /// The address this backup listens on.
    pub listen: String,
    /// The generation the takeover will store.
    pub generation: u64,
    /// The epoch it resumes.
    pub epoch: u64,
    /// Why it takes over.
    pub reason: String,
}

impl FenceFacts {
    /// The variables the command sees.
    pub fn env(&self) -> [(&'static str, String); 5] {
        [
            ("HAG_PEER", self.peer.clone()),
            ("HAG_LISTEN", self.listen.clone()),
            ("HAG_GENERATION", self.generation.to_string()),
            ("HAG_EPOCH", self.epoch.to_string()),
            ("HAG_REASON", self.reason.clone()),
        ]
    }
}

/// How often a running command is looked at.
const POLL: Duration = Duration::from_millis(20);
/// How long its output may still come after it ended.
const READERS_GRACE: Duration = Duration::from_millis(500);

impl FencePeer {
    /// Runs the command; `Ok` only if it exited 0 within the timeout.
    pub fn run(&self, facts: &FenceFacts) -> Result<(), String> {
        let t = Instant::now();
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(&self.command)
            .envs(facts.env())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("--fence-peer: cannot run sh -c '{}': {e}", self.command))?;
        let forward = |pipe: Option<Box<dyn Read + Send>>| {
            pipe.map(|p| {
                std::thread::spawn(move || {
                    for line in BufReader::new(p).lines().map_while(Result::ok) {
                        info!("fence-peer: {line}");
                    }
                })
            })
        };
        let readers = [
            forward(
                child
                    .stdout
                    .take()
                    .map(|p| Box::new(p) as Box<dyn Read + Send>),
            ),
            forward(
                child
                    .stderr
                    .take()
                    .map(|p| Box::new(p) as Box<dyn Read + Send>),
            ),
        ];
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Ok(status),
                Ok(None) if t.elapsed() >= self.timeout => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break Err(format!(
                        "--fence-peer did not end within {:.0} s (killed)",
                        self.timeout.as_secs_f64()
                    ));
                }
                Ok(None) => std::thread::sleep(POLL),
                Err(e) => break Err(format!("--fence-peer: waiting for it: {e}")),
            }
        };
        // Its last lines before the verdict; but a command that left a
        // child holding its output (backgrounded) must not hold the
        // takeover: readers still busy after a moment are left to finish.
        let grace = Instant::now() + READERS_GRACE;
        let readers: Vec<_> = readers.into_iter().flatten().collect();
        while readers.iter().any(|r| !r.is_finished()) && Instant::now() < grace {
            std::thread::sleep(POLL);
        }
        for r in readers.into_iter().filter(|r| r.is_finished()) {
            let _ = r.join();
        }
        let status = status?;
        if status.success() {
            info!(
                "fence-peer succeeded in {:.0} ms: the primary {} is fenced",
                t.elapsed().as_secs_f64() * 1e3,
                if facts.peer.is_empty() {
                    "(never heard)"
                } else {
                    &facts.peer
                }
            );
            Ok(())
        } else {
            Err(format!("--fence-peer failed ({status})"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fence(command: &str, timeout_ms: u64) -> FencePeer {
        FencePeer {
            command: command.into(),
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    fn facts() -> FenceFacts {
        FenceFacts {
            peer: "192.0.2.10".into(),
            listen: "192.0.2.11:7200".into(),
            generation: 3,
            epoch: 41,
            reason: "the primary was silent for 3.0 s".into(),
        }
    }

    #[test]
    fn only_a_command_that_exits_0_in_time_fences() {
        assert_eq!(fence("true", 5000).run(&facts()), Ok(()));
        let e = fence("echo no power switch >&2; exit 3", 5000)
            .run(&facts())
            .unwrap_err();
        assert!(e.contains("failed") && e.contains('3'), "{e}");
        let t = Instant::now();
        let e = fence("sleep 5", 200).run(&facts()).unwrap_err();
        assert!(e.contains("did not end within"), "{e}");
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "not killed at its timeout"
        );
    }

    #[test]
    fn the_command_sees_the_takeovers_facts() {
        let check = r#"test "$HAG_PEER" = 192.0.2.10 && test "$HAG_LISTEN" = 192.0.2.11:7200 &&
            test "$HAG_GENERATION" = 3 && test "$HAG_EPOCH" = 41 &&
            test "$HAG_REASON" = "the primary was silent for 3.0 s""#;
        assert_eq!(fence(check, 5000).run(&facts()), Ok(()));
    }

    #[test]
    fn a_backgrounded_child_does_not_hold_the_takeover_past_the_timeout() {
        // The shell exits 0 at once; its child keeps stdout open.
        let t = Instant::now();
        assert_eq!(fence("sleep 5 & exit 0", 10_000).run(&facts()), Ok(()));
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "waited for the child's output"
        );
    }
}
