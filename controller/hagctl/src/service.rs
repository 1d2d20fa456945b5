//! hagctl as a service: a VM's configuration file, and systemd's
//! readiness protocol.
//!
//! **Configuration.** `hagctl checkpoint --name VM` and `hagctl backup
//! --name VM` first read `/etc/hag/VM.conf`, then `/run/hag/VM/libvirt.conf`
//! (the settings of a libvirt domain's `<hag:protect>`, written by the
//! libvirt hook when the domain starts), those that exist, unless
//! `--no-config` is given. A file's `[checkpoint]` or `[backup]` section
//! holds that command's long flags, one per line, as `flag = value`
//! (`interval = 2s`; a repeatable flag on several lines; `json = true` for a
//! flag without a value). They go before the command line's own arguments,
//! in that order, so the domain's XML wins over the host's file and an
//! argument on the command line over both (the command's flags override
//! themselves). This is what the units `hag-checkpoint@VM.service` and
//! `hag-backup@VM.service` run: everything about a VM is in its one file,
//! or in its domain XML.
//!
//! **Readiness.** Under systemd (`Type=notify`), hagctl says READY=1 once
//! it does its job (a checkpoint: the first epoch acknowledged; a backup:
//! listening) and STATUS= on every change of state, as `systemctl status`
//! shows. Outside systemd ($NOTIFY_SOCKET unset) this does nothing.

use crate::log::warning;
use std::ffi::OsString;
use std::path::Path;

/// Where the per-VM configuration files are.
pub const CONFIG_DIR: &str = "/etc/hag";

/// The subcommands that read a VM's configuration file.
const CONFIGURED: [&str; 2] = ["checkpoint", "backup"];

/// Where the libvirt hook puts a domain's `<hag:protect>` settings.
pub fn libvirt_settings(vm: &str) -> std::path::PathBuf {
    Path::new(crate::vm_dirs::RUN_ROOT)
        .join(vm)
        .join(LIBVIRT_SETTINGS)
}

const LIBVIRT_SETTINGS: &str = "libvirt.conf";

/// `args` (hagctl's, program name first) with the flags of `DIR/VM.conf`'s
/// and then `RUN/VM/libvirt.conf`'s section for the subcommand inserted
/// after it, if the command line names a VM with `--name` and those files
/// exist. Errors name the file and line.
pub fn with_config(args: Vec<OsString>, dir: &Path, run: &Path) -> Result<Vec<OsString>, String> {
    let Some(sub) = args.get(1).and_then(|a| a.to_str()) else {
        return Ok(args);
    };
    if !CONFIGURED.contains(&sub) {
        return Ok(args);
    }
    let (Some(name), false) = name_in(&args[2..]) else {
        return Ok(args);
    };
    // An invalid name is left to the parser, which says why.
    if name.parse::<crate::vm_dirs::VmName>().is_err() {
        return Ok(args);
    }
    let mut out = args[..2].to_vec();
    for path in [
        dir.join(format!("{name}.conf")),
        run.join(&name).join(LIBVIRT_SETTINGS),
    ] {
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        let flags = section_flags(&text, sub).map_err(|e| format!("{}: {e}", path.display()))?;
        out.extend(flags.into_iter().map(OsString::from));
    }
    out.extend_from_slice(&args[2..]);
    Ok(out)
}

/// The value of the last `--name` (or `--name=`) before any `--`, as the
/// parser takes it, and whether `--no-config` is there.
fn name_in(args: &[OsString]) -> (Option<String>, bool) {
    let mut words = args
        .iter()
        .map_while(|a| a.to_str())
        .take_while(|a| *a != "--");
    let (mut name, mut no_config) = (None, false);
    while let Some(w) = words.next() {
        if w == "--name" {
            name = words.next().map(str::to_owned);
        } else if let Some(v) = w.strip_prefix("--name=") {
            name = Some(v.to_owned());
        } else if w == "--no-config" {
            no_config = true;
        }
    }
    (name, no_config)
}

/// The flags of section `[sub]` of a configuration text, as arguments.
fn section_flags(text: &str, sub: &str) -> Result<Vec<String>, String> {
    let mut section = None;
    let mut flags = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = |what: String| format!("line {}: {what}", i + 1);
        if let Some(rest) = line.strip_prefix('[') {
            let s = rest
                .strip_suffix(']')
                .ok_or_else(|| at(format!("'{line}' is not a [section]")))?;
            if !CONFIGURED.contains(&s) {
                return Err(at(format!("unknown section [{s}] (checkpoint or backup)")));
            }
            section = Some(s.to_owned());
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .ok_or_else(|| at(format!("'{line}' is not 'flag = value'")))?;
        let (key, value) = (key.trim(), value.trim());
        let valid = !key.is_empty()
            && !key.starts_with('-')
            && key
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
        if !valid {
            return Err(at(format!(
                "'{key}' is not a flag's name (interval, heartbeat-addr, …)"
            )));
        }
        if key == "name" {
            return Err(at("the name is the file's, not a setting".to_owned()));
        }
        // `hagctl job`, `abort`, `takeover` find a VM's files by its name
        // alone: they do not read this file.
        if key == "status-dir" || key == "state-dir" {
            return Err(at(format!(
                "'{key}' cannot be set here: a named VM's directories are /run/hag/NAME and /var/lib/hag/NAME"
            )));
        }
        let Some(s) = &section else {
            return Err(at(format!("'{key}' comes before any [section]")));
        };
        if s != sub {
            continue;
        }
        match value {
            "true" => flags.push(format!("--{key}")),
            "false" => {}
            v => {
                flags.push(format!("--{key}"));
                flags.push(v.to_owned());
            }
        }
    }
    Ok(flags)
}

/// Tells systemd the service's state: `ready` once it does its job, and
/// `status` as `systemctl status` shows it. Nothing outside systemd.
pub fn notify(ready: bool, status: &str) {
    use sd_notify::NotifyState;
    let status = NotifyState::Status(status);
    let result = if ready {
        sd_notify::notify(false, &[NotifyState::Ready, status])
    } else {
        sd_notify::notify(false, &[status])
    };
    // Lost readiness is systemd's timeout to report; it never stops hagctl.
    if let Err(e) = result {
        warning!("telling systemd: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(words: &[&str]) -> Vec<OsString> {
        words.iter().map(OsString::from).collect()
    }

    fn dir_with(name: &str, text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("hag-conf-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("{name}.conf")), text).unwrap();
        dir
    }

    const WEB1: &str = "\
# web1: protected from host a to host b
[checkpoint]
qmp = /run/hag/web1.qmp
backup = b.example:7200
heartbeat-addr = 10.1.0.2:7201
heartbeat-addr = 10.2.0.2:7201
interval = 2s
json = true
[backup]
listen = 0.0.0.0:7200
";

    #[test]
    fn a_named_vm_gets_its_sections_flags_before_the_command_lines() {
        let dir = dir_with("web1", WEB1);
        let got = with_config(
            args(&["hagctl", "checkpoint", "--name", "web1", "--interval", "1s"]),
            &dir,
            &dir,
        )
        .unwrap();
        assert_eq!(
            got,
            args(&[
                "hagctl",
                "checkpoint",
                "--qmp",
                "/run/hag/web1.qmp",
                "--backup",
                "b.example:7200",
                "--heartbeat-addr",
                "10.1.0.2:7201",
                "--heartbeat-addr",
                "10.2.0.2:7201",
                "--interval",
                "2s",
                "--json",
                "--name",
                "web1",
                "--interval",
                "1s"
            ])
        );
        let got = with_config(args(&["hagctl", "backup", "--name=web1"]), &dir, &dir).unwrap();
        assert_eq!(
            got,
            args(&[
                "hagctl",
                "backup",
                "--listen",
                "0.0.0.0:7200",
                "--name=web1"
            ])
        );
        // The last --name is the one the parser keeps.
        let two = args(&["hagctl", "backup", "--name", "x", "--name", "web1"]);
        let got = with_config(two, &dir, &dir).unwrap();
        assert_eq!(got[2..4], args(&["--listen", "0.0.0.0:7200"])[..]);
        // No name, another command, no file, a name after --, --no-config:
        // unchanged.
        for words in [
            &["hagctl", "checkpoint", "--name", "web1", "--no-config"][..],
            &["hagctl", "checkpoint", "--qmp", "x"][..],
            &["hagctl", "status", "--name", "web1"][..],
            &["hagctl", "checkpoint", "--name", "web2"][..],
            &[
                "hagctl", "backup", "--listen", "a:1", "--", "qemu", "--name", "web1",
            ][..],
        ] {
            assert_eq!(with_config(args(words), &dir, &dir).unwrap(), args(words));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_bad_file_is_refused_naming_its_line() {
        for (text, want) in [
            (
                "interval = 2s\n",
                "line 1: 'interval' comes before any [section]",
            ),
            (
                "[checkpoint]\ninterval 2s\n",
                "line 2: 'interval 2s' is not 'flag = value'",
            ),
            ("[restore]\n", "line 1: unknown section [restore]"),
            (
                "[checkpoint]\n--interval = 2s\n",
                "line 2: '--interval' is not a flag's name",
            ),
            ("[backup]\nname = x\n", "line 2: the name is the file's"),
            (
                "[checkpoint]\nstate-dir = /x\n",
                "line 2: 'state-dir' cannot be set here",
            ),
        ] {
            let dir = dir_with("bad", text);
            let e = with_config(args(&["hagctl", "checkpoint", "--name", "bad"]), &dir, &dir)
                .unwrap_err();
            assert!(e.contains(want) && e.contains("bad.conf"), "{text:?}: {e}");
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    /// Under systemd, READY=1 and the status reach $NOTIFY_SOCKET as one
    /// datagram (systemd's own protocol, read here as systemd reads it).
    #[test]
    fn systemd_hears_readiness_and_status() {
        let dir = std::env::temp_dir().join(format!("hag-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify.sock");
        let sock = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        // No other test reads or writes NOTIFY_SOCKET.
        std::env::set_var("NOTIFY_SOCKET", &path);
        notify(true, "vGPU 3: protected");
        notify(false, "vGPU 3: unprotected: the backup is silent");
        std::env::remove_var("NOTIFY_SOCKET");
        let mut buf = [0u8; 256];
        let n = sock.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=vGPU 3: protected\n");
        let n = sock.recv(&mut buf).unwrap();
        assert_eq!(
            &buf[..n],
            b"STATUS=vGPU 3: unprotected: the backup is silent\n"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// What the parser makes of the expanded arguments: the command line's
    /// own flag wins over the file's.
    #[test]
    fn the_command_line_wins_over_the_file() {
        use clap::FromArgMatches;
        let dir = dir_with("web3", WEB1);
        let argv = with_config(
            args(&[
                "hagctl",
                "checkpoint",
                "--name",
                "web3",
                "--interval",
                "500ms",
            ]),
            &dir,
            &dir,
        )
        .unwrap();
        let m = crate::command().try_get_matches_from(argv).unwrap();
        let cli = crate::Cli::from_arg_matches(&m).unwrap();
        let crate::Command::Checkpoint {
            interval,
            heartbeat_addr,
            json,
            ..
        } = cli.command
        else {
            panic!("not checkpoint")
        };
        assert_eq!(interval, std::time::Duration::from_millis(500));
        assert_eq!(heartbeat_addr.len(), 2);
        assert!(json);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
