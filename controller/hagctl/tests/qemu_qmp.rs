//! `hagctl migrate --qmp` and `hagctl receive --qmp` against real QEMU 10
//! processes on this machine: TCG, q35, 64 MiB, no devices, no guest but
//! the firmware, QMP on unix sockets, migration over 127.0.0.1 only.
//!
//! These start QEMU, so they are ignored by a plain `cargo test`; run them
//! with
//!
//! ```text
//! cargo test -p hagctl --test qemu_qmp -- --ignored --nocapture
//! ```
//!
//! Each skips itself (passing) when `qemu-system-x86_64` is missing or
//! older than 10. Never `-accel kvm` here, and no user-mode networking.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// QEMU's version, if it is 10 or later.
fn qemu_10() -> Option<String> {
    let out = Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text.split("version ").nth(1)?.split_whitespace().next()?;
    let major: u32 = version.split('.').next()?.parse().ok()?;
    (major >= 10).then(|| version.to_owned())
}

macro_rules! need_qemu {
    () => {
        match qemu_10() {
            Some(v) => v,
            None => {
                eprintln!("skipped: no qemu-system-x86_64 10 or later");
                return;
            }
        }
    };
}

/// A scratch directory, removed at the end.
struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("hagctl-qmp-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A QEMU process, killed when dropped.
struct Qemu {
    child: Child,
    qmp: PathBuf,
    log: PathBuf,
}

impl Qemu {
    fn start(dir: &Dir, name: &str, extra: &[&str]) -> Qemu {
        let qmp = dir.0.join(format!("{name}.qmp"));
        let log = dir.0.join(format!("{name}.log"));
        let child = Command::new("qemu-system-x86_64")
            .args([
                "-accel",
                "tcg",
                "-machine",
                "q35",
                "-m",
                "64",
                "-nodefaults",
            ])
            .args(["-display", "none", "-qmp"])
            .arg(format!("unix:{},server=on,wait=off", qmp.display()))
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start qemu-system-x86_64");
        let q = Qemu { child, qmp, log };
        let t = Instant::now();
        while UnixStream::connect(&q.qmp).is_err() {
            assert!(t.elapsed() < Duration::from_secs(20), "no QMP socket");
            std::thread::sleep(Duration::from_millis(20));
        }
        q
    }

    /// One QMP command on a connection of its own: the reply's `return`
    /// (or `error`) object.
    fn qmp(&self, command: &str) -> Value {
        qmp_once(&self.qmp, command)
    }

    fn status(&self) -> String {
        self.qmp("query-status")["status"]
            .as_str()
            .unwrap_or("?")
            .to_owned()
    }

    /// Waits up to `timeout` for the process to end.
    fn exited_within(&mut self, timeout: Duration) -> bool {
        let t = Instant::now();
        while t.elapsed() < timeout {
            if self.child.try_wait().unwrap().is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn qmp_once(path: &Path, command: &str) -> Value {
    let s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut w = s.try_clone().unwrap();
    let mut lines = BufReader::new(s).lines();
    let mut reply = |w: &mut UnixStream, cmd: &str| -> Value {
        writeln!(w, "{}", json!({"execute": cmd})).unwrap();
        loop {
            let v: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
            if let Some(r) = v.get("return").or_else(|| v.get("error")) {
                return r.clone();
            }
        }
    };
    reply(&mut w, "qmp_capabilities");
    reply(&mut w, command)
}

/// Arguments giving a VM 64 MiB of RAM named `ram0`: filled from a file
/// of pseudo-random bytes (private mapping) for a source, so that all of
/// it is sent and a bandwidth limit makes the migration last; plain for a
/// target.
fn ram0(dir: &Dir, random: bool) -> Vec<String> {
    let backend = if random {
        let path = dir.0.join("ram0.img");
        if !path.exists() {
            let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
            let mut bytes = Vec::with_capacity(64 << 20);
            while bytes.len() < 64 << 20 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                bytes.extend_from_slice(&x.to_le_bytes());
            }
            std::fs::write(&path, bytes).unwrap();
        }
        format!(
            "memory-backend-file,id=ram0,size=64M,share=off,mem-path={}",
            path.display()
        )
    } else {
        "memory-backend-ram,id=ram0,size=64M".to_owned()
    };
    vec![
        "-object".into(),
        backend,
        "-machine".into(),
        "memory-backend=ram0".into(),
    ]
}

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn hagctl(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hagctl"));
    c.args(args).stdin(Stdio::null());
    c
}

fn spawn(args: &[&str]) -> Child {
    hagctl(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn show(what: &str, out: &Output) {
    eprintln!(
        "--- {what}: {}\nstdout:\n{}stderr:\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
}

#[test]
#[ignore = "starts QEMU 10 processes"]
fn migrates_and_ends_the_source_then_keeps_it_on_request() {
    let version = need_qemu!();
    let dir = Dir::new("ok");
    let mut src = Qemu::start(&dir, "src", &args(&ram0(&dir, true)));
    let mut dst_args = ram0(&dir, false);
    dst_args.extend(["-incoming".into(), "defer".into()]);
    let dst = Qemu::start(&dir, "dst", &args(&dst_args));
    assert_eq!(src.status(), "running");
    assert_eq!(dst.status(), "inmigrate");
    let port = free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let dst_qmp = dst.qmp.display().to_string();
    let src_qmp = src.qmp.display().to_string();
    let receive = spawn(&[
        "receive",
        "--qmp",
        &dst_qmp,
        "--listen",
        &listen,
        "--timeout",
        "60",
        "--json",
    ]);
    // 64 MiB of RAM that is not zero pages, at 16 MiB/s: about 4 s, long
    // enough for progress lines.
    let t = Instant::now();
    let migrate = hagctl(&[
        "migrate",
        "--qmp",
        &src_qmp,
        "--to",
        &listen,
        "--json",
        "--bandwidth",
        "16",
    ])
    .output()
    .unwrap();
    let wall = t.elapsed();
    let receive = receive.wait_with_output().unwrap();
    show("migrate", &migrate);
    show("receive", &receive);
    assert!(migrate.status.success());
    assert!(receive.status.success());
    let report: Value = serde_json::from_slice(&migrate.stdout).unwrap();
    assert_eq!(report["status"], "completed");
    assert_eq!(report["source"], "quit");
    assert_eq!(report["to"], listen.as_str());
    assert!(report["vmm"]
        .as_str()
        .unwrap()
        .starts_with(&format!("QEMU {version}")));
    for key in [
        "downtime_ms",
        "total_time_ms",
        "setup_time_ms",
        "transferred_bytes",
        "rounds",
    ] {
        assert!(report[key].as_u64().is_some(), "{key} missing: {report}");
    }
    assert!(report["throughput_mbps"].as_f64().is_some());
    assert_eq!(report["downtime_limit_ms"], 300);
    assert_eq!(report["max_bandwidth"], 16 << 20);
    assert!(report["transferred_bytes"].as_u64().unwrap() > 60 << 20);
    assert_eq!(
        report["capabilities"],
        json!(["return-path=on", "x-ignore-shared=off"])
    );
    // Progress: JSON objects, one per line, about once a second.
    let progress: Vec<Value> = text(&migrate.stderr)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(!progress.is_empty(), "no progress lines");
    assert!(progress.iter().all(|p| p["status"].is_string()));
    let got: Value = serde_json::from_slice(&receive.stdout).unwrap();
    assert_eq!(got["status"], "completed");
    assert_eq!(got["run_state"], "running");
    assert_eq!(got["listen"], listen.as_str());
    // The source QEMU is gone, the target runs: one VM.
    assert!(
        src.exited_within(Duration::from_secs(10)),
        "source QEMU still there"
    );
    assert_eq!(dst.status(), "running");
    eprintln!(
        "MEASURED first hop: hagctl migrate took {wall:?}; QEMU: downtime {} ms, total {} ms, \
         setup {} ms, {} bytes in {} rounds, {:.2} Mbit/s; {} progress lines; target waited {} ms",
        report["downtime_ms"],
        report["total_time_ms"],
        report["setup_time_ms"],
        report["transferred_bytes"],
        report["rounds"],
        report["throughput_mbps"].as_f64().unwrap_or(0.0),
        progress.len(),
        got["waited_ms"]
    );

    // Second hop, text output, --keep-source: the old target stays paused.
    let dst2 = Qemu::start(&dir, "dst2", &args(&dst_args));
    let port = free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let dst2_qmp = dst2.qmp.display().to_string();
    let receive = spawn(&[
        "receive",
        "--qmp",
        &dst2_qmp,
        "--listen",
        &listen,
        "--timeout",
        "60",
    ]);
    let migrate = hagctl(&[
        "migrate",
        "--qmp",
        &dst_qmp,
        "--to",
        &listen,
        "--keep-source",
        "--max-downtime",
        "100",
        "--capability",
        "events=on",
    ])
    .output()
    .unwrap();
    let receive = receive.wait_with_output().unwrap();
    show("migrate --keep-source", &migrate);
    show("receive (text)", &receive);
    assert!(migrate.status.success() && receive.status.success());
    let out = text(&migrate.stdout);
    assert!(
        out.starts_with(&format!("migrated to {listen} by QEMU {version}")),
        "{out}"
    );
    assert!(out.contains("downtime limit 100 ms"), "{out}");
    assert!(
        out.contains("source: kept paused in postmigrate (--keep-source)"),
        "{out}"
    );
    assert!(text(&receive.stdout).starts_with(&format!("received on {listen} by QEMU")));
    assert!(text(&receive.stdout).contains("VM running here"));
    assert_eq!(dst.status(), "postmigrate");
    assert_eq!(dst2.status(), "running");
    // And the kept source is not migrated a second time.
    let again = hagctl(&["migrate", "--qmp", &dst_qmp, "--to", &listen])
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(1));
    assert!(text(&again.stderr).contains("migrated away already"));
}

#[test]
#[ignore = "starts QEMU 10 processes"]
fn refuses_a_blocked_vm_naming_the_blocker() {
    let _ = need_qemu!();
    let dir = Dir::new("blocked");
    // ivshmem in peer mode (the default) blocks migration in QEMU 10.
    let src = Qemu::start(
        &dir,
        "src",
        &[
            "-object",
            "memory-backend-memfd,id=hm,size=1M,share=on",
            "-device",
            "ivshmem-plain,memdev=hm",
        ],
    );
    let port = free_port().to_string();
    let to = format!("127.0.0.1:{port}");
    let src_qmp = src.qmp.display().to_string();
    let out = hagctl(&["migrate", "--qmp", &src_qmp, "--to", &to])
        .output()
        .unwrap();
    show("migrate (blocked)", &out);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("cannot migrate this VM: 1 blocker: \"Migration is disabled when using feature 'peer mode' in device 'ivshmem'\""), "{err}");
    assert!(out.stdout.is_empty());
    // Nothing was started: the VM runs, no migration was attempted.
    assert_eq!(src.status(), "running");
    assert_eq!(src.qmp("query-migrate").get("status"), None);
}

#[test]
#[ignore = "starts QEMU 10 processes"]
fn qemus_refusal_of_a_capability_is_named() {
    let _ = need_qemu!();
    let dir = Dir::new("cap");
    let src = Qemu::start(&dir, "src", &[]);
    let src_qmp = src.qmp.display().to_string();
    let out = hagctl(&[
        "migrate",
        "--qmp",
        &src_qmp,
        "--to",
        "127.0.0.1:1",
        "--capability",
        "postcopy-preempt=on",
    ])
    .output()
    .unwrap();
    show("migrate (bad capability)", &out);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr)
            .contains("refused to start the migration: Postcopy preempt requires postcopy-ram"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(src.status(), "running");
}

#[test]
#[ignore = "starts QEMU 10 processes"]
fn a_target_that_refuses_the_state_fails_both_sides() {
    let _ = need_qemu!();
    let dir = Dir::new("refused");
    let src = Qemu::start(&dir, "src", &[]);
    // A target with more RAM cannot load the source's RAM block: its load
    // fails as a vGPU's refusal of a damaged state would.
    let mut dst = Qemu::start(&dir, "dst", &["-incoming", "defer", "-m", "128"]);
    let port = free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let dst_qmp = dst.qmp.display().to_string();
    let src_qmp = src.qmp.display().to_string();
    let receive = spawn(&[
        "receive",
        "--qmp",
        &dst_qmp,
        "--listen",
        &listen,
        "--timeout",
        "60",
    ]);
    let migrate = hagctl(&["migrate", "--qmp", &src_qmp, "--to", &listen])
        .output()
        .unwrap();
    let receive = receive.wait_with_output().unwrap();
    show("migrate (target refuses)", &migrate);
    show("receive (refuses)", &receive);
    assert_eq!(receive.status.code(), Some(1));
    let err = text(&receive.stderr);
    assert!(err.contains("the incoming migration on"), "{err}");
    assert!(
        err.contains("failed: QEMU: load of migration failed"),
        "{err}"
    );
    assert!(err.contains("the incoming QEMU was ended (quit)"), "{err}");
    assert_eq!(migrate.status.code(), Some(1));
    let err = text(&migrate.stderr);
    assert!(err.contains("failed: QEMU: "), "{err}");
    assert!(
        err.contains("the source VM runs on (run state running)"),
        "{err}"
    );
    assert_eq!(src.status(), "running");
    assert!(dst.exited_within(Duration::from_secs(10)));
    // QEMU's own log says which part it refused.
    eprintln!("target QEMU's log:\n{}", dst.log());
}

#[test]
#[ignore = "starts QEMU 10 processes"]
fn sigint_cancels_and_the_source_runs_on() {
    let _ = need_qemu!();
    let dir = Dir::new("sigint");
    let src = Qemu::start(&dir, "src", &args(&ram0(&dir, true)));
    let mut dst_args = ram0(&dir, false);
    dst_args.extend(["-incoming".into(), "defer".into()]);
    let dst = Qemu::start(&dir, "dst", &args(&dst_args));
    let port = free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let dst_qmp = dst.qmp.display().to_string();
    let src_qmp = src.qmp.display().to_string();
    let receive = spawn(&[
        "receive",
        "--qmp",
        &dst_qmp,
        "--listen",
        &listen,
        "--timeout",
        "60",
    ]);
    // 64 MiB at 4 MiB/s: some 16 s, plenty of time to interrupt.
    let mut migrate = spawn(&[
        "migrate",
        "--qmp",
        &src_qmp,
        "--to",
        &listen,
        "--bandwidth",
        "4",
    ]);
    let stderr = migrate.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let mut seen = Vec::new();
    // Wait for the first progress line of an active migration.
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push(line.clone());
        if line.starts_with("migration active") {
            break;
        }
    }
    let t = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(migrate.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    seen.extend(lines.map(|l| l.unwrap()));
    let status = migrate.wait().unwrap();
    let took = t.elapsed();
    let receive = receive.wait_with_output().unwrap();
    let err = seen.join("\n");
    eprintln!("--- migrate (SIGINT): {status}\nstderr:\n{err}");
    show("receive (cancelled)", &receive);
    assert_eq!(status.code(), Some(1));
    assert!(
        err.contains("cancelled on a signal (migrate_cancel)"),
        "{err}"
    );
    assert!(
        err.contains("the source VM runs on (run state running)"),
        "{err}"
    );
    assert_eq!(src.status(), "running");
    assert_eq!(receive.status.code(), Some(1));
    eprintln!("MEASURED SIGINT to hagctl's exit: {took:?}");
}
