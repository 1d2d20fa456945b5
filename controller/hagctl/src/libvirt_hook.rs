//! `hagctl libvirt-hook`: libvirt's qemu hook (installed as
//! `/etc/libvirt/hooks/qemu`, a two-line script that runs this).
//!
//! libvirt runs the hook as `qemu DOMAIN OPERATION SUB-OP EXTRA` with the
//! domain XML on stdin. For a domain with an mdev hostdev of a hag vGPU and
//! a `<hag:protect>` element in its `<metadata>` ([`crate::libvirt_domain`]):
//! - `started`, `reconnect`: writes the element's settings to
//!   `/run/hag/VM/libvirt.conf` and starts protection, `hagctl checkpoint
//!   --name VM`, which reads that file. Under systemd that is
//!   `systemctl start --no-block hag-checkpoint@VM.service` (whose restart
//!   policy retries while the backup is unreachable); without systemd, a
//!   supervisor of the hook's own that does the same ([`supervise`]).
//! - `stopped`, `release`: ends it (the unit stopped; or the supervisor lets
//!   hagctl see the VM gone and end protection with its backup, SIGTERM
//!   after STOP_TIMEOUT).
//! - `migrate`, `restore`: marks the domain incoming, so that the
//!   protection `started` begins is retried until the VM runs.
//!
//! Its promise to libvirt: it never writes to stdout (for `migrate` and
//! `restore` libvirt would take that as a replacement domain XML), never
//! waits for hagctl, and always exits 0: hag missing or misconfigured leaves
//! the domain running unprotected, never failing to start. Every invocation
//! writes a line saying what it did and why to `LOG_DIR/libvirt-hook.log`.
//!
//! Host settings: `/etc/hag/hag.conf` (or `$HAG_CONF`), `KEY=VALUE` lines,
//! read, never executed.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::libvirt_domain::{self, Defaults, Domain, Settings, HAG_NS};
use crate::vm_dirs::RUN_ROOT;

/// The host's hook settings (`/etc/hag/hag.conf`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookConf {
    pub defaults: Defaults,
    /// libvirt's per-domain directories (for the hint naming its monitor).
    pub qemu_lib_dir: String,
    /// Seconds the supervisor gives hagctl to end by itself after a stop.
    pub stop_timeout: u64,
    /// Seconds an incoming domain's protection is retried until it runs.
    pub incoming_wait: u64,
    /// Seconds between tries while protection fails (exit status 1); 0: no retry.
    pub retry: u64,
    /// What the file had that is not a setting.
    pub ignored: Vec<String>,
}

impl Default for HookConf {
    fn default() -> Self {
        HookConf {
            defaults: Defaults {
                backup: None,
                interval: "2s".into(),
                failover_timeout: None,
                log_dir: "/var/log/hag".into(),
            },
            qemu_lib_dir: "/var/lib/libvirt/qemu".into(),
            stop_timeout: 15,
            incoming_wait: 600,
            retry: 30,
            ignored: Vec::new(),
        }
    }
}

impl HookConf {
    /// Reads `KEY=VALUE` lines (`#` comments; quotes around a value
    /// dropped); what is not a known setting goes to `ignored`.
    pub fn parse(text: &str) -> HookConf {
        let mut conf = HookConf::default();
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((key, value)) = line.split_once('=') else {
                conf.ignored.push(format!("'{line}'"));
                continue;
            };
            let value = value.trim();
            let value = [('"', '"'), ('\'', '\'')]
                .iter()
                .find_map(|(a, b)| value.strip_prefix(*a)?.strip_suffix(*b))
                .unwrap_or(value)
                .to_owned();
            let secs = |v: &str| v.parse::<u64>().ok();
            let d = &mut conf.defaults;
            let known = match key.trim() {
                // The hook script's own (which hagctl to run).
                "HAGCTL" => true,
                "LOG_DIR" => {
                    d.log_dir = value;
                    true
                }
                "QEMU_LIB_DIR" => {
                    conf.qemu_lib_dir = value;
                    true
                }
                "BACKUP" => {
                    d.backup = Some(value).filter(|v| !v.is_empty());
                    true
                }
                "INTERVAL" => {
                    d.interval = value;
                    true
                }
                "FAILOVER_TIMEOUT" => {
                    d.failover_timeout = Some(value).filter(|v| !v.is_empty());
                    true
                }
                "STOP_TIMEOUT" => secs(&value).map(|s| conf.stop_timeout = s).is_some(),
                "INCOMING_WAIT" => secs(&value).map(|s| conf.incoming_wait = s).is_some(),
                "RETRY" => secs(&value).map(|s| conf.retry = s).is_some(),
                _ => false,
            };
            if !known {
                conf.ignored.push(format!("'{line}'"));
            }
        }
        conf
    }

    fn load() -> (HookConf, PathBuf) {
        let path = std::env::var_os("HAG_CONF")
            .map_or_else(|| PathBuf::from("/etc/hag/hag.conf"), PathBuf::from);
        let text = fs::read_to_string(&path).unwrap_or_default();
        (HookConf::parse(&text), path)
    }
}

/// The name hagctl files a domain under: its name with what `VmName` does
/// not allow as `_`, at most 64 characters.
pub fn vm_key(domain: &str) -> String {
    let mut key: String = domain
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    if key.is_empty() {
        key.push('_');
    }
    if key.starts_with(['.', '-']) {
        key.replace_range(..1, "_");
    }
    key
}

/// One domain's files.
struct Paths {
    key: String,
    /// Protection wanted (removed to ask for its end).
    token: PathBuf,
    /// The supervisor's pid, while it runs.
    supervisor: PathBuf,
    /// The running `hagctl checkpoint`'s pid.
    pid: PathBuf,
    /// An incoming migration or restore was announced.
    incoming: PathBuf,
    /// The settings `hagctl checkpoint --name KEY` reads.
    settings: PathBuf,
    /// hagctl checkpoint's output (without systemd).
    checkpoint_log: PathBuf,
}

impl Paths {
    fn new(domain: &str, conf: &HookConf) -> Paths {
        let key = vm_key(domain);
        let run = Path::new(RUN_ROOT);
        let file = |ext: &str| run.join(format!("libvirt-{key}.{ext}"));
        Paths {
            token: file("protect"),
            supervisor: file("supervisor"),
            pid: file("pid"),
            incoming: file("incoming"),
            settings: crate::service::libvirt_settings(&key),
            checkpoint_log: Path::new(&conf.defaults.log_dir).join(format!("checkpoint-{key}.log")),
            key,
        }
    }

    fn read_pid(path: &Path) -> Option<i32> {
        fs::read_to_string(path).ok()?.trim().parse().ok()
    }
}

/// The hook's log: one line per thing it did.
struct Log {
    prefix: String,
    file: Option<File>,
}

impl Log {
    fn open(conf: &HookConf, domain: &str, op: &str, sub: &str) -> Log {
        let dir = Path::new(&conf.defaults.log_dir);
        let file = fs::create_dir_all(dir)
            .and_then(|()| {
                OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(dir.join("libvirt-hook.log"))
            })
            .ok();
        Log {
            prefix: format!("hag-hook[{}] {domain} {op}/{sub}", std::process::id()),
            file,
        }
    }

    fn line(&mut self, message: &str) {
        let now = humantime::format_rfc3339_seconds(std::time::SystemTime::now());
        let line = format!("{now} {}: {message}\n", self.prefix);
        if let Some(f) = &mut self.file {
            if f.write_all(line.as_bytes()).is_ok() {
                return;
            }
        }
        // Nowhere else to say it: syslog, if there is a logger.
        let _ = Command::new("logger")
            .args(["-t", "hag-hook", "--", line.trim_end()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// systemd runs this host (sd_booted(3)'s test).
fn systemd_runs() -> bool {
    Path::new("/run/systemd/system").is_dir()
}

/// `hagctl libvirt-hook DOMAIN OPERATION SUB-OP [EXTRA]`: never fails.
pub fn run(domain: &str, op: &str, sub: &str) {
    let (conf, conf_path) = HookConf::load();
    let mut log = Log::open(&conf, domain, op, sub);
    if !conf.ignored.is_empty() {
        log.line(&format!(
            "{}: ignored unknown or malformed lines: {}",
            conf_path.display(),
            conf.ignored.join(" ")
        ));
    }
    let paths = Paths::new(domain, &conf);
    // Read whatever the operation: libvirt writes the XML to every hook
    // call, and a hook that left it unread could fail libvirt's write.
    let xml = read_domain_xml();
    match op {
        "start" => link_takeover_ram(domain, xml, &conf, &mut log),
        "started" | "reconnect" if crate::libvirt_restore::ram_marker(domain).exists() => log.line(
            "restored by hagctl backup's takeover: left to it (it starts protection again once the VM runs)",
        ),
        "started" | "reconnect" => protect(domain, xml, &conf, &paths, &mut log),
        "stopped" | "release" => unprotect(&paths, &mut log),
        "migrate" | "restore" => {
            let marked = fs::create_dir_all(RUN_ROOT)
                .and_then(|()| fs::write(&paths.incoming, unix_now().to_string()));
            match marked {
                Ok(()) => log.line(&format!(
                    "incoming domain: marked {}, so 'started' retries hagctl checkpoint until the VM runs (up to {}s); domain XML unchanged",
                    paths.incoming.display(),
                    conf.incoming_wait
                )),
                Err(e) => log.line(&format!(
                    "incoming domain: cannot write {} ({e}); domain XML unchanged",
                    paths.incoming.display()
                )),
            }
        }
        _ => log.line(&format!("nothing to do for '{op}'")),
    }
}

/// `start` of a domain a takeover restores (`hagctl backup
/// --takeover-by-libvirt` named the standby image in
/// [`crate::libvirt_restore::ram_marker`]): libvirt has made the domain's
/// memory directory, and QEMU is about to open its RAM file there, which
/// becomes a symlink to the standby image, so that the restored VM's guest
/// RAM is the last acknowledged epoch's.
fn link_takeover_ram(domain: &str, xml: Result<String, String>, conf: &HookConf, log: &mut Log) {
    let marker = crate::libvirt_restore::ram_marker(domain);
    let Ok(target) = fs::read_to_string(&marker) else {
        return log.line("nothing to do for 'start'");
    };
    let Some(id) = xml
        .and_then(|x| libvirt_domain::parse(&x))
        .ok()
        .and_then(|d| d.id)
    else {
        return log.line("takeover restore: the domain XML names no id: its RAM is not linked (the restore will fail)");
    };
    let dir = Path::new(&conf.qemu_lib_dir).join("ram");
    let link = crate::libvirt_restore::ram_path(&dir, id, domain);
    let linked = link
        .parent()
        .map_or(Ok(()), fs::create_dir_all)
        .and_then(|()| match fs::remove_file(&link) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => std::os::unix::fs::symlink(target.trim(), &link),
        });
    match linked {
        Ok(()) => log.line(&format!(
            "takeover restore: guest RAM {} is the standby image {}",
            link.display(),
            target.trim()
        )),
        Err(e) => log.line(&format!(
            "takeover restore: cannot link {} to the standby image: {e}",
            link.display()
        )),
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The domain XML on stdin (empty if stdin is a terminal), at most 16 MiB.
fn read_domain_xml() -> Result<String, String> {
    if nix::unistd::isatty(std::io::stdin()).unwrap_or(false) {
        return Ok(String::new());
    }
    let mut xml = String::new();
    std::io::stdin()
        .take(16 << 20)
        .read_to_string(&mut xml)
        .map_err(|e| format!("cannot read the domain XML on stdin: {e}"))?;
    Ok(xml)
}

/// The mdev's type is one of hag's (`hag-*`).
fn is_hag_mdev(uuid: &str) -> bool {
    fs::read_link(format!("/sys/bus/mdev/devices/{uuid}/mdev_type"))
        .ok()
        .and_then(|t| {
            t.file_name()
                .map(|n| n.to_string_lossy().starts_with("hag-"))
        })
        .unwrap_or(false)
}

fn alive(pid: Option<i32>) -> bool {
    pid.is_some_and(|p| p > 0 && kill(Pid::from_raw(p), None).is_ok())
}

/// What `protect` checks before it starts anything, in order; `Err` is
/// the log line saying why the domain is left unprotected.
fn settings_for(
    domain: &str,
    xml: &Domain,
    conf: &HookConf,
    hag_mdev: impl Fn(&str) -> bool,
    have_dev: bool,
) -> Result<(Settings, Vec<String>), String> {
    if xml.mdevs.is_empty() {
        return Err(
            "left alone: the domain XML has no mdev hostdev (<hostdev type='mdev'>)".into(),
        );
    }
    let mdevs = xml.mdevs.join(" ");
    let Some(protect) = &xml.protect else {
        return Err(format!(
            "left alone: mdev {mdevs}, but no <hag:protect xmlns:hag='{HAG_NS}'> in <metadata>: hag protection not configured"
        ));
    };
    if !have_dev {
        return Err(
            "not protected: /dev/hag is missing (hag_mdev not loaded): the domain runs unprotected"
                .into(),
        );
    }
    let hag: Vec<String> = xml.mdevs.iter().filter(|u| hag_mdev(u)).cloned().collect();
    if hag.is_empty() {
        return Err(format!(
            "left alone: <hag:protect> is set, but no mdev of the domain ({mdevs}) is a hag vGPU (no hag-* mdev_type in /sys/bus/mdev/devices): unprotected"
        ));
    }
    let settings = protect.settings(domain, &conf.defaults).map_err(|e| {
        let monitor = match xml.id {
            Some(id) if e.contains("names no qmp-socket") => {
                format!(
                    " (libvirt's own monitor: {}/domain-{id}-*/monitor.sock)",
                    conf.qemu_lib_dir
                )
            }
            _ => String::new(),
        };
        format!("not protected: {e}{monitor}")
    })?;
    Ok((settings, hag))
}

/// Protects a domain a takeover restored on this host, as `started` would
/// have (it left the domain alone then, the takeover unfinished): `hagctl
/// backup --takeover-by-libvirt` calls it once the VM runs, with the live
/// domain XML and the takeover's generation, which the new protection
/// starts at. A backup that is this host (one address in `backup=`, the
/// host that took over) is not used: a VM is never its own backup.
pub fn protect_restored(domain: &str, xml: &str, generation: u64) {
    let (conf, _) = HookConf::load();
    let mut log = Log::open(&conf, domain, "takeover", "-");
    let paths = Paths::new(domain, &conf);
    protect_with(
        domain,
        Ok(xml.to_owned()),
        &conf,
        &paths,
        &mut log,
        Some(generation),
    );
}

fn protect(
    domain: &str,
    xml: Result<String, String>,
    conf: &HookConf,
    paths: &Paths,
    log: &mut Log,
) {
    protect_with(domain, xml, conf, paths, log, None);
}

/// `generation`: a restored domain's, from its takeover (none: the
/// protection's own, 0 or the backup's).
fn protect_with(
    domain: &str,
    xml: Result<String, String>,
    conf: &HookConf,
    paths: &Paths,
    log: &mut Log,
    generation: Option<u64>,
) {
    let xml = match xml.and_then(|x| libvirt_domain::parse(&x)) {
        Ok(xml) => xml,
        Err(e) => return log.line(&format!("not protected: {e}")),
    };
    let (settings, hag) = match settings_for(
        domain,
        &xml,
        conf,
        is_hag_mdev,
        Path::new("/dev/hag").exists(),
    ) {
        Ok(s) => s,
        Err(line) => return log.line(&line),
    };
    if generation.is_some()
        && libvirt_domain::is_this_host(libvirt_domain::host_of(&settings.backup))
    {
        return log.line(&format!(
            "not protected again: its backup {} is this host, which took it over (give backup='HOST0:PORT,HOST1:PORT' for a pair)",
            settings.backup
        ));
    }
    if let Err(e) = fs::create_dir_all(&conf.defaults.log_dir) {
        return log.line(&format!(
            "not protected: cannot create {}: {e}",
            conf.defaults.log_dir
        ));
    }
    let systemd = systemd_runs();
    if !systemd {
        if let Err(line) = may_start(Found::read(paths)) {
            return log.line(&line);
        }
        let _ = fs::remove_file(&paths.pid);
    }
    let written = paths
        .settings
        .parent()
        .map_or(Ok(()), fs::create_dir_all)
        .and_then(|()| {
            let mut text = settings.config_text(domain);
            if let Some(g) = generation {
                text.push_str(&format!("generation = {g}\n"));
            }
            fs::write(&paths.settings, text)
        });
    if let Err(e) = written {
        return log.line(&format!(
            "not protected: cannot write {}: {e}",
            paths.settings.display()
        ));
    }
    let what = format!(
        "protecting vGPU {}: hagctl checkpoint {} (--name {}, settings in {})",
        hag.join(" "),
        settings.describe(),
        paths.key,
        paths.settings.display()
    );
    if systemd {
        let unit = format!("hag-checkpoint@{}.service", paths.key);
        match systemctl(&["start", "--no-block", &unit]) {
            Ok(()) => log.line(&format!(
                "{what}; {unit} started (`systemctl status {unit}`)"
            )),
            Err(e) => log.line(&format!("not protected: systemctl start {unit}: {e}")),
        }
        return;
    }
    match spawn_supervisor(domain, paths) {
        Ok(pid) => {
            let how = if paths.incoming.exists() {
                format!(
                    " (incoming: retried until the VM runs, up to {}s)",
                    conf.incoming_wait
                )
            } else {
                String::new()
            };
            log.line(&format!(
                "{what}{how}; supervisor pid {pid}, pidfile {}, output {}",
                paths.pid.display(),
                paths.checkpoint_log.display()
            ));
        }
        Err(e) => log.line(&format!("not protected: cannot start the supervisor: {e}")),
    }
}

fn systemctl(args: &[&str]) -> Result<(), String> {
    let out = Command::new("systemctl")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "{}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    ))
}

/// Starts `hagctl libvirt-hook --supervise DOMAIN` detached from libvirt
/// (no inherited stdio: libvirt reads the hook's output until EOF).
fn spawn_supervisor(domain: &str, paths: &Paths) -> std::io::Result<u32> {
    fs::create_dir_all(RUN_ROOT)?;
    let out = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&paths.checkpoint_log)?;
    let err = out.try_clone()?;
    // Wanted before the supervisor starts: it runs while the token is there.
    fs::write(&paths.token, "wanted\n")?;
    let child = Command::new(std::env::current_exe()?)
        .args(["libvirt-hook", "--supervise", "--", domain])
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .inspect_err(|_| {
            let _ = fs::remove_file(&paths.token);
        })?;
    let pid = child.id();
    fs::write(&paths.supervisor, format!("{pid}\n"))?;
    Ok(pid)
}

fn unprotect(paths: &Paths, log: &mut Log) {
    let had_settings = paths.settings.exists();
    if systemd_runs() {
        let _ = fs::remove_file(&paths.incoming);
        if !had_settings {
            return log.line("not protected by this hook: nothing to stop");
        }
        let unit = format!("hag-checkpoint@{}.service", paths.key);
        match systemctl(&["stop", "--no-block", &unit]) {
            Ok(()) => log.line(&format!(
                "ending protection: {unit} stopped (hagctl ends protection with its backup)"
            )),
            Err(e) => log.line(&format!("systemctl stop {unit}: {e}")),
        }
        let _ = fs::remove_file(&paths.settings);
        return;
    }
    let found = Found::read(paths);
    let _ = fs::remove_file(&paths.token);
    let _ = fs::remove_file(&paths.incoming);
    let stop = at_stop(found);
    log.line(&stop.to_string());
    match stop {
        Stop::Asked { .. } | Stop::AlreadyEnding { .. } | Stop::NotOurs => {}
        Stop::Orphan { checkpoint } => {
            let _ = kill(Pid::from_raw(checkpoint), Signal::SIGTERM);
            let _ = fs::remove_file(&paths.pid);
        }
        Stop::Ended => {
            for f in [&paths.pid, &paths.supervisor, &paths.settings] {
                let _ = fs::remove_file(f);
            }
        }
    }
}

/// What the hook finds of a domain's protection by its own supervisor
/// (without systemd): the processes that still run, and the files.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Found {
    /// The supervisor's pid, if it runs.
    supervisor: Option<i32>,
    /// The running `hagctl checkpoint`'s pid, if it runs.
    checkpoint: Option<i32>,
    /// Protection is wanted (the token is there).
    wanted: bool,
    /// A pid file of a process that is gone, or the settings, is left.
    leftovers: bool,
}

impl Found {
    fn read(paths: &Paths) -> Found {
        let sup = Paths::read_pid(&paths.supervisor);
        let cp = Paths::read_pid(&paths.pid);
        Found {
            supervisor: sup.filter(|&p| alive(Some(p))),
            checkpoint: cp.filter(|&p| alive(Some(p))),
            wanted: paths.token.exists(),
            leftovers: sup.is_some() || cp.is_some() || paths.settings.exists(),
        }
    }
}

fn pid_text(pid: Option<i32>) -> String {
    pid.map_or("none".into(), |p| p.to_string())
}

/// At `started`: whether protection may start, or the log line saying
/// why not (it runs already, or the last one is still ending).
fn may_start(found: Found) -> Result<(), String> {
    match found {
        Found {
            supervisor: Some(sup),
            wanted: true,
            checkpoint,
            ..
        } => Err(format!(
            "already protected: supervisor pid {sup}, hagctl checkpoint pid {}: nothing started",
            pid_text(checkpoint)
        )),
        Found {
            supervisor: Some(sup),
            ..
        } => Err(format!(
            "not started: the previous protection (supervisor pid {sup}) is still ending; try again once it has (see the log)"
        )),
        Found {
            checkpoint: Some(cp),
            ..
        } => Err(format!(
            "already protected: hagctl checkpoint pid {cp} runs without its supervisor: nothing started"
        )),
        _ => Ok(()),
    }
}

/// At `stopped` or `release`: what ending the protection takes.
#[derive(Debug, PartialEq, Eq)]
enum Stop {
    /// The supervisor lets hagctl see the VM gone (SIGTERM after the stop
    /// timeout).
    Asked {
        supervisor: i32,
        checkpoint: Option<i32>,
    },
    /// Asked already (`release` after `stopped`).
    AlreadyEnding {
        supervisor: i32,
        checkpoint: Option<i32>,
    },
    /// hagctl runs without its supervisor: SIGTERM now.
    Orphan {
        checkpoint: i32,
    },
    /// Nothing runs any more: files to clear.
    Ended,
    NotOurs,
}

fn at_stop(found: Found) -> Stop {
    match found {
        Found {
            supervisor: Some(supervisor),
            checkpoint,
            wanted,
            ..
        } => {
            if wanted {
                Stop::Asked {
                    supervisor,
                    checkpoint,
                }
            } else {
                Stop::AlreadyEnding {
                    supervisor,
                    checkpoint,
                }
            }
        }
        Found {
            checkpoint: Some(checkpoint),
            ..
        } => Stop::Orphan { checkpoint },
        Found {
            leftovers: true, ..
        } => Stop::Ended,
        _ => Stop::NotOurs,
    }
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Stop::Asked { supervisor, checkpoint } => write!(
                f,
                "ending protection: supervisor pid {supervisor} lets hagctl checkpoint pid {} see the VM gone and end protection with its backup (SIGTERM after the stop timeout)",
                pid_text(checkpoint)
            ),
            Stop::AlreadyEnding { supervisor, checkpoint } => write!(
                f,
                "protection already ending: supervisor pid {supervisor} waits for hagctl checkpoint pid {}",
                pid_text(checkpoint)
            ),
            Stop::Orphan { checkpoint } => write!(
                f,
                "ending protection: hagctl checkpoint pid {checkpoint} runs without its supervisor: SIGTERM (its backup may take over)"
            ),
            Stop::Ended => f.write_str("protection had already ended: nothing to stop"),
            Stop::NotOurs => f.write_str("not protected by this hook: nothing to stop"),
        }
    }
}

/// What the supervisor does once `hagctl checkpoint` has exited.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    /// The domain is still arriving (migration, restore): again in 2 s.
    RetryIncoming,
    /// Protection failed in a way that may pass (status 1: the backup
    /// unreachable or restarting): again after RETRY seconds.
    Retry,
    End,
}

/// `status`: hagctl's exit code (None: killed by a signal). 3, 4 and 5 say
/// the VM must not simply be protected again (fenced, an unconfirmed end, a
/// failed stop), 2 a usage error, 0 an end.
fn after_exit(status: Option<i32>, wanted: bool, incoming_window: bool, retry_secs: u64) -> Next {
    match status {
        _ if !wanted => Next::End,
        Some(0) => Next::End,
        _ if incoming_window => Next::RetryIncoming,
        Some(1) if retry_secs > 0 => Next::Retry,
        _ => Next::End,
    }
}

/// While hagctl runs and protection is no longer wanted: the signal to
/// send now, if any. SIGTERM once `stop_timeout` has passed since the stop
/// was asked (hagctl ends protection with an ABORT), SIGKILL 5 s later.
fn stop_signal(
    unwanted_for: Option<Duration>,
    stop_timeout: Duration,
    sent: Option<Signal>,
) -> Option<Signal> {
    let t = unwanted_for?;
    match sent {
        None if t >= stop_timeout => Some(Signal::SIGTERM),
        Some(Signal::SIGTERM) if t >= stop_timeout + Duration::from_secs(5) => {
            Some(Signal::SIGKILL)
        }
        _ => None,
    }
}

/// `hagctl libvirt-hook --supervise DOMAIN`: runs `hagctl checkpoint --name
/// KEY` while the domain's protection is wanted, as [`after_exit`] says.
pub fn supervise(domain: &str) {
    let (conf, _) = HookConf::load();
    let mut log = Log::open(&conf, domain, "supervise", "-");
    let paths = Paths::new(domain, &conf);
    // Its own session: libvirt's signals to the hook's group are not its.
    let _ = nix::unistd::setsid();
    let _ = fs::write(&paths.supervisor, format!("{}\n", std::process::id()));
    let incoming_until = Instant::now() + Duration::from_secs(conf.incoming_wait);
    while paths.token.exists() {
        let started = Instant::now();
        println!(
            "=== {} hagctl checkpoint --name {} ({})",
            humantime::format_rfc3339_seconds(std::time::SystemTime::now()),
            paths.key,
            paths.settings.display()
        );
        let child = std::env::current_exe().and_then(|exe| {
            Command::new(exe)
                .args(["checkpoint", "--name", &paths.key])
                .stdin(Stdio::null())
                .spawn()
        });
        let mut child = match child {
            Ok(c) => c,
            Err(e) => {
                log.line(&format!("cannot start hagctl checkpoint: {e}"));
                break;
            }
        };
        let pid = child.id();
        let _ = fs::write(&paths.pid, format!("{pid}\n"));
        log.line(&format!("hagctl checkpoint started: pid {pid}"));
        let status = wait_while_wanted(&mut child, &paths, &conf, &mut log);
        if Paths::read_pid(&paths.pid) == Some(pid as i32) {
            let _ = fs::remove_file(&paths.pid);
        }
        let code = status.and_then(|s| s.code());
        let shown = status.map_or("unknown".into(), |s| match s.code() {
            Some(c) => c.to_string(),
            None => s.to_string(),
        });
        log.line(&format!(
            "hagctl checkpoint pid {pid} exited with status {shown} after {}s: {}",
            started.elapsed().as_secs(),
            last_line(&paths.checkpoint_log).unwrap_or_else(|| "no output".into())
        ));
        let incoming = paths.incoming.exists() && Instant::now() < incoming_until;
        match after_exit(code, paths.token.exists(), incoming, conf.retry) {
            Next::RetryIncoming => {
                log.line("the domain is incoming (migration or restore): retrying in 2s");
                std::thread::sleep(Duration::from_secs(2));
            }
            Next::Retry => {
                log.line(&format!(
                    "protection failed; retrying in {}s while the domain runs (RETRY in hag.conf)",
                    conf.retry
                ));
                for _ in 0..conf.retry {
                    if !paths.token.exists() {
                        break;
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            Next::End => break,
        }
    }
    for f in [&paths.token, &paths.incoming, &paths.settings] {
        let _ = fs::remove_file(f);
    }
    // Logged before the supervisor file goes: whoever waits for the file
    // to go then finds the line.
    log.line("protection ended");
    if Paths::read_pid(&paths.supervisor) == Some(std::process::id() as i32) {
        let _ = fs::remove_file(&paths.supervisor);
    }
}

fn wait_while_wanted(
    child: &mut Child,
    paths: &Paths,
    conf: &HookConf,
    log: &mut Log,
) -> Option<std::process::ExitStatus> {
    let pid = Pid::from_raw(child.id() as i32);
    let (mut unwanted_since, mut sent) = (None, None);
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) => {}
            Err(_) => return child.wait().ok(),
        }
        if !paths.token.exists() {
            let since = *unwanted_since.get_or_insert_with(Instant::now);
            if let Some(sig) = stop_signal(
                Some(since.elapsed()),
                Duration::from_secs(conf.stop_timeout),
                sent,
            ) {
                log.line(&match sig {
                    Signal::SIGTERM => format!(
                        "hagctl checkpoint pid {pid} still runs {}s after the stop: SIGTERM (it ends protection with its backup: ABORT, then its held output released once confirmed)",
                        conf.stop_timeout
                    ),
                    _ => format!("hagctl checkpoint pid {pid} ignored SIGTERM: SIGKILL"),
                });
                let _ = kill(pid, sig);
                sent = Some(sig);
            }
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The last line of hagctl checkpoint's output that is not the
/// supervisor's own `===` line.
fn last_line(path: &Path) -> Option<String> {
    let text = fs::read(path).ok()?;
    let tail = &text[text.len().saturating_sub(64 << 10)..];
    String::from_utf8_lossy(tail)
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty() && !l.starts_with("==="))
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hag_conf_is_read_not_run() {
        let conf = HookConf::parse(
            "# host defaults\nBACKUP=\"192.0.2.12:7200\"\nINTERVAL='1s'\nRETRY=3\nRETRY=often\n$(reboot)\nRUN_DIR=/tmp\n",
        );
        assert_eq!(conf.defaults.backup.as_deref(), Some("192.0.2.12:7200"));
        assert_eq!(conf.defaults.interval, "1s");
        assert_eq!(conf.retry, 3);
        assert_eq!(
            conf.ignored,
            ["'RETRY=often'", "'$(reboot)'", "'RUN_DIR=/tmp'"]
        );
    }

    #[test]
    fn a_domains_name_becomes_a_vm_name() {
        assert_eq!(vm_key("web1"), "web1");
        assert_eq!(vm_key("db server/2"), "db_server_2");
        assert_eq!(vm_key("-x"), "_x");
        assert_eq!(vm_key(""), "_");
        assert_eq!(vm_key(&"a".repeat(80)).len(), 64);
        for name in ["web1", "db server/2", "-x", "", ".hidden", "é"] {
            assert!(
                vm_key(name).parse::<crate::vm_dirs::VmName>().is_ok(),
                "{name}"
            );
        }
    }

    #[test]
    fn protection_is_retried_only_while_wanted_and_only_when_it_may_pass() {
        assert_eq!(after_exit(Some(1), true, false, 30), Next::Retry);
        assert_eq!(after_exit(Some(1), true, false, 0), Next::End);
        assert_eq!(after_exit(Some(1), false, true, 30), Next::End);
        assert_eq!(after_exit(Some(0), true, true, 30), Next::End);
        // Fenced, unconfirmed end, failed stop, usage: never again by itself.
        for code in [2, 3, 4, 5] {
            assert_eq!(after_exit(Some(code), true, false, 30), Next::End, "{code}");
        }
        assert_eq!(after_exit(Some(1), true, true, 0), Next::RetryIncoming);
        assert_eq!(after_exit(None, true, false, 30), Next::End);
    }

    #[test]
    fn a_start_never_runs_a_second_protection() {
        let found = |supervisor, checkpoint, wanted| Found {
            supervisor,
            checkpoint,
            wanted,
            leftovers: false,
        };
        assert_eq!(may_start(Found::default()), Ok(()));
        assert!(may_start(found(Some(9), Some(10), true))
            .unwrap_err()
            .starts_with("already protected: supervisor pid 9, hagctl checkpoint pid 10"));
        assert!(may_start(found(Some(9), None, false))
            .unwrap_err()
            .contains("is still ending"));
        assert!(may_start(found(None, Some(10), false))
            .unwrap_err()
            .contains("runs without its supervisor"));
        // Files of processes that are gone do not stop a start.
        assert_eq!(
            may_start(Found {
                leftovers: true,
                ..Found::default()
            }),
            Ok(())
        );
    }

    #[test]
    fn a_stop_ends_what_runs_and_clears_what_is_left() {
        let found = |supervisor, checkpoint, wanted, leftovers| Found {
            supervisor,
            checkpoint,
            wanted,
            leftovers,
        };
        assert_eq!(
            at_stop(found(Some(9), Some(10), true, true)),
            Stop::Asked {
                supervisor: 9,
                checkpoint: Some(10)
            }
        );
        assert_eq!(
            at_stop(found(Some(9), None, false, true)),
            Stop::AlreadyEnding {
                supervisor: 9,
                checkpoint: None
            }
        );
        assert_eq!(
            at_stop(found(None, Some(10), true, true)),
            Stop::Orphan { checkpoint: 10 }
        );
        assert_eq!(at_stop(found(None, None, true, true)), Stop::Ended);
        assert_eq!(at_stop(found(None, None, false, false)), Stop::NotOurs);
    }

    #[test]
    fn a_stop_waits_then_terms_then_kills() {
        let t = Duration::from_secs(15);
        let s = Duration::from_secs;
        assert_eq!(stop_signal(None, t, None), None);
        assert_eq!(stop_signal(Some(s(14)), t, None), None);
        assert_eq!(stop_signal(Some(s(15)), t, None), Some(Signal::SIGTERM));
        assert_eq!(stop_signal(Some(s(16)), t, Some(Signal::SIGTERM)), None);
        assert_eq!(
            stop_signal(Some(s(20)), t, Some(Signal::SIGTERM)),
            Some(Signal::SIGKILL)
        );
        assert_eq!(stop_signal(Some(s(30)), t, Some(Signal::SIGKILL)), None);
    }

    #[test]
    fn what_protect_checks_comes_in_order_with_its_reason() {
        let conf = HookConf::default();
        let with = |mdevs: &[&str], protect: bool| Domain {
            id: Some(3),
            mdevs: mdevs.iter().map(|s| s.to_string()).collect(),
            protect: protect.then(|| libvirt_domain::Protect {
                backup: Some("b:7200".into()),
                ..Default::default()
            }),
            interfaces: Vec::new(),
        };
        let hag = |u: &str| u == "hag0";
        let err = |d: &Domain, dev| settings_for("web1", d, &conf, hag, dev).unwrap_err();
        assert!(err(&with(&[], true), true).starts_with("left alone: the domain XML has no mdev"));
        assert!(err(&with(&["hag0"], false), true)
            .starts_with("left alone: mdev hag0, but no <hag:protect"));
        assert!(
            err(&with(&["hag0"], true), false).starts_with("not protected: /dev/hag is missing")
        );
        assert!(err(&with(&["other"], true), true)
            .starts_with("left alone: <hag:protect> is set, but no mdev"));
        let no_socket = err(&with(&["hag0"], true), true);
        assert!(no_socket.contains("names no qmp-socket"), "{no_socket}");
        assert!(no_socket
            .ends_with("(libvirt's own monitor: /var/lib/libvirt/qemu/domain-3-*/monitor.sock)"));
    }
}
