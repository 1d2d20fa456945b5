//! What the libvirt hook needs from a domain's XML, read with a real XML
//! parser, and the protection settings its `<hag:protect>` element asks
//! for, checked before anything is started.
//!
//! ```xml
//! <metadata>
//!   <hag:protect xmlns:hag="https://hag.example/1" backup="192.0.2.12:7200"
//!                interval="2s" qmp-socket="/run/hag/web1.qmp" plug="vnet0"/>
//! </metadata>
//! ```
//!
//! The settings become the `[checkpoint]` section of a configuration file
//! (`/run/hag/VM/libvirt.conf`) that `hagctl checkpoint --name VM` reads
//! (src/service.rs), so the hook and the systemd unit start protection
//! from the same file.

use std::fmt::Write as _;
use std::path::Path;

/// The namespace of hag's element in a domain's `<metadata>`.
pub const HAG_NS: &str = "https://hag.example/1";

/// The parts of a domain XML the hook looks at.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Domain {
    /// The running domain's id (`<domain id='N'>`).
    pub id: Option<u32>,
    /// Each `<hostdev type='mdev'>`'s `<source><address uuid=…>`.
    pub mdevs: Vec<String>,
    /// The attributes of `<hag:protect>` in `<metadata>`, if there is one.
    pub protect: Option<Protect>,
    /// Each `<interface>` (told apart by MAC address: see
    /// `standby_argv::with_bridged_netdevs`).
    pub interfaces: Vec<Interface>,
}

/// A `<interface>`: where its packets go on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    /// Its `type` (`bridge`, `network`, `direct`, `user`, …).
    pub kind: String,
    /// `<source bridge=…>` or `<source network=…>`, whichever it has.
    pub source: Option<String>,
    /// `<mac address=…>`, if written.
    pub mac: Option<String>,
}

/// `<hag:protect>`'s attributes, as written (checked by [`Protect::settings`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Protect {
    pub backup: Option<String>,
    pub interval: Option<String>,
    pub failover_timeout: Option<String>,
    pub vm_socket: Option<String>,
    pub qmp_socket: Option<String>,
    pub plug: Option<String>,
    pub console_socket: Option<String>,
    pub console_log: Option<String>,
    pub key: Option<String>,
    pub heartbeat_addr: Option<String>,
    pub witness: Option<String>,
}

/// Reads a domain XML as libvirt hands it to a hook.
pub fn parse(xml: &str) -> Result<Domain, String> {
    let doc = roxmltree::Document::parse(xml)
        .map_err(|e| format!("the domain XML does not parse: {e}"))?;
    let root = doc.root_element();
    if root.tag_name().name() != "domain" {
        return Err(format!(
            "the XML's root is <{}>, not <domain>",
            root.tag_name().name()
        ));
    }
    let mut domain = Domain {
        id: root.attribute("id").and_then(|id| id.parse().ok()),
        ..Domain::default()
    };
    if let Some(devices) = child(root, "devices") {
        for hostdev in devices
            .children()
            .filter(|n| n.has_tag_name("hostdev") && n.attribute("type") == Some("mdev"))
        {
            let uuid = child(hostdev, "source")
                .and_then(|s| child(s, "address"))
                .and_then(|a| a.attribute("uuid"));
            if let Some(uuid) = uuid {
                domain.mdevs.push(uuid.to_owned());
            }
        }
        for interface in devices.children().filter(|n| n.has_tag_name("interface")) {
            let source = child(interface, "source");
            domain.interfaces.push(Interface {
                kind: interface.attribute("type").unwrap_or_default().to_owned(),
                source: source
                    .and_then(|s| s.attribute("bridge").or_else(|| s.attribute("network")))
                    .map(str::to_owned),
                mac: child(interface, "mac")
                    .and_then(|m| m.attribute("address"))
                    .map(str::to_owned),
            });
        }
    }
    let protect = child(root, "metadata").and_then(|m| {
        m.children().find(|n| {
            n.is_element()
                && n.tag_name().namespace() == Some(HAG_NS)
                && n.tag_name().name() == "protect"
        })
    });
    domain.protect = protect.map(|p| {
        let attr = |name: &str| p.attribute(name).map(str::to_owned);
        Protect {
            backup: attr("backup"),
            interval: attr("interval"),
            failover_timeout: attr("failover-timeout"),
            vm_socket: attr("vm-socket"),
            qmp_socket: attr("qmp-socket"),
            plug: attr("plug"),
            console_socket: attr("console-socket"),
            console_log: attr("console-log"),
            key: attr("key"),
            heartbeat_addr: attr("heartbeat-addr"),
            witness: attr("witness"),
        }
    });
    Ok(domain)
}

/// The host's defaults for what a domain's `<hag:protect>` leaves out
/// (`/etc/hag/hag.conf`'s BACKUP, INTERVAL, FAILOVER_TIMEOUT).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Defaults {
    pub backup: Option<String>,
    pub interval: String,
    pub failover_timeout: Option<String>,
    /// Where a console's released output goes without `console-log`.
    pub log_dir: String,
}

/// How hagctl reaches the protected VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmSocket {
    /// hagctl's own QMP socket on the domain's QEMU.
    Qmp(String),
    /// A hag-vmm VM's control socket (tests).
    Vm(String),
}

/// A domain's protection settings, every value checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub socket: VmSocket,
    pub backup: String,
    pub interval: String,
    pub failover_timeout: Option<String>,
    pub plug: Option<String>,
    /// The console socket and the file its released output goes to.
    pub console: Option<(String, String)>,
    pub key: Option<String>,
    pub heartbeat_addrs: Vec<String>,
    /// The witness's HOST:PORT (its key: the pair's).
    pub witness: Option<String>,
}

impl Protect {
    /// The settings this element asks for on a host with `defaults`, for
    /// domain `name`; an error says which attribute is wrong and why.
    pub fn settings(&self, name: &str, defaults: &Defaults) -> Result<Settings, String> {
        let given = |v: &Option<String>| {
            v.as_deref()
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(str::to_owned)
        };
        for (attr, value) in [
            ("backup", &self.backup),
            ("interval", &self.interval),
            ("failover-timeout", &self.failover_timeout),
            ("vm-socket", &self.vm_socket),
            ("qmp-socket", &self.qmp_socket),
            ("plug", &self.plug),
            ("console-socket", &self.console_socket),
            ("console-log", &self.console_log),
            ("key", &self.key),
            ("heartbeat-addr", &self.heartbeat_addr),
            ("witness", &self.witness),
        ] {
            // Each value becomes one line of a configuration file.
            if value
                .as_deref()
                .is_some_and(|v| v.chars().any(char::is_control))
            {
                return Err(format!("{attr} has a control character (a line break?)"));
            }
        }
        let backups = given(&self.backup)
            .or_else(|| defaults.backup.clone())
            .ok_or("<hag:protect> has no backup='HOST:PORT' and hag.conf sets no BACKUP")?;
        let backup = pick_backup(&backups, is_this_host)?;
        let heartbeat_addrs: Vec<String> = given(&self.heartbeat_addr)
            .map(|list| list.split(',').map(|a| a.trim().to_owned()).collect())
            .unwrap_or_default();
        for addr in &heartbeat_addrs {
            check_addr("heartbeat-addr", addr)?;
        }
        let witness = given(&self.witness);
        if let Some(addr) = &witness {
            check_addr("witness", addr)?;
        }
        let interval = given(&self.interval).unwrap_or_else(|| defaults.interval.clone());
        crate::units::seconds(&interval).map_err(|e| format!("interval {e}"))?;
        let failover_timeout =
            given(&self.failover_timeout).or_else(|| defaults.failover_timeout.clone());
        if let Some(t) = &failover_timeout {
            crate::units::seconds(t).map_err(|e| format!("failover-timeout {e}"))?;
        }
        let key = given(&self.key);
        let (qmp, vm) = (given(&self.qmp_socket), given(&self.vm_socket));
        let console_socket = given(&self.console_socket);
        let console_log = given(&self.console_log);
        for (attr, path) in [
            ("key", &key),
            ("qmp-socket", &qmp),
            ("vm-socket", &vm),
            ("console-socket", &console_socket),
            ("console-log", &console_log),
        ] {
            if let Some(p) = path {
                if !Path::new(p).is_absolute() {
                    return Err(format!("{attr} '{p}' is not an absolute path"));
                }
            }
        }
        let plug = given(&self.plug);
        if let Some(p) = &plug {
            let ifname = p.len() < 16
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
            if !ifname {
                return Err(format!("plug '{p}' is not an interface name"));
            }
        }
        let console = match (console_socket, console_log) {
            (None, Some(_)) => return Err("console-log is set but console-socket is not".into()),
            (None, None) => None,
            (Some(s), log) => Some((
                s,
                log.unwrap_or_else(|| format!("{}/console-{name}.log", defaults.log_dir)),
            )),
        };
        let socket = match (qmp, vm) {
            (Some(q), _) => VmSocket::Qmp(q),
            (None, Some(v)) => {
                if console.is_some() {
                    return Err(
                        "console-socket needs qmp-socket (a hag-vmm VM holds its own console)"
                            .into(),
                    );
                }
                if plug.is_some() {
                    return Err("plug needs qmp-socket (a hag-vmm VM holds its own output)".into());
                }
                VmSocket::Vm(v)
            }
            (None, None) => {
                return Err("<hag:protect> names no qmp-socket: hagctl needs a QMP socket of its own (libvirt holds its monitor); add -qmp unix:PATH,server=on,wait=off through <qemu:commandline> and qmp-socket='PATH' (docs/libvirt.md)".into());
            }
        };
        Ok(Settings {
            socket,
            backup,
            interval,
            failover_timeout,
            plug,
            console,
            key,
            heartbeat_addrs,
            witness,
        })
    }
}

/// `node`'s first child element `<name>` (in no namespace, as libvirt's own).
fn child<'a, 'i>(node: roxmltree::Node<'a, 'i>, name: &str) -> Option<roxmltree::Node<'a, 'i>> {
    node.children().find(|n| {
        n.is_element() && n.tag_name().name() == name && n.tag_name().namespace().is_none()
    })
}

/// The backup of a VM that may run on either host of a pair (or on any of
/// several): `backup='A:7200,B:7200'` names each host's backup, and the
/// first that is not `local` is this host's (a VM migrated from A to B is
/// protected by A's backup there). One address is taken as it is.
fn pick_backup(list: &str, local: impl Fn(&str) -> bool) -> Result<String, String> {
    let addrs: Vec<&str> = list.split(',').map(str::trim).collect();
    for addr in &addrs {
        check_addr("backup", addr)?;
    }
    match addrs[..] {
        [one] => Ok(one.to_owned()),
        _ => addrs
            .iter()
            .find(|a| !local(host_of(a)))
            .map(|a| (*a).to_owned())
            .ok_or_else(|| format!("every backup in '{list}' is an address of this host: a VM is never its own backup")),
    }
}

/// HOST of HOST:PORT (without an IPv6 address's brackets).
pub fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// Whether `host` (a name or an address) is one of this host's addresses:
/// a socket can be bound to it.
pub fn is_this_host(host: &str) -> bool {
    use std::net::{ToSocketAddrs, UdpSocket};
    let Ok(addrs) = (host, 0).to_socket_addrs() else {
        return false;
    };
    addrs
        .filter(|a| !a.ip().is_unspecified())
        .any(|a| UdpSocket::bind(a).is_ok())
}

/// HOST:PORT, `[IPv6]:PORT` too: the form hagctl's `--backup` takes.
fn check_addr(attr: &str, addr: &str) -> Result<(), String> {
    let bad = || format!("{attr} '{addr}' is not HOST:PORT");
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let host_ok = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '_'));
    if !host_ok || port.parse::<u16>().is_err() {
        return Err(bad());
    }
    Ok(())
}

impl Settings {
    /// The `[checkpoint]` section `hagctl checkpoint --name VM` reads.
    pub fn config_text(&self, domain: &str) -> String {
        let mut out = format!(
            "# Written by `hagctl libvirt-hook` from domain {domain}'s <hag:protect>\n# when libvirt started it; removed when it stops.\n[checkpoint]\n"
        );
        let mut line = |k: &str, v: &str| {
            let _ = writeln!(out, "{k} = {v}");
        };
        match &self.socket {
            VmSocket::Qmp(s) => line("qmp", s),
            VmSocket::Vm(s) => line("vm", s),
        }
        line("backup", &self.backup);
        line("interval", &self.interval);
        if let Some(t) = &self.failover_timeout {
            line("failover-timeout", t);
        }
        if let Some(p) = &self.plug {
            line("plug", p);
        }
        if let Some((socket, log)) = &self.console {
            line("console", socket);
            line("console-log", log);
        }
        if let Some(k) = &self.key {
            line("key", k);
        }
        for a in &self.heartbeat_addrs {
            line("heartbeat-addr", a);
        }
        if let Some(w) = &self.witness {
            line("witness", w);
        }
        out
    }

    /// The settings as `hagctl checkpoint`'s flags, for the hook's log.
    pub fn describe(&self) -> String {
        let mut out = match &self.socket {
            VmSocket::Qmp(s) => format!("--qmp {s}"),
            VmSocket::Vm(s) => format!("--vm {s}"),
        };
        let _ = write!(
            out,
            " --backup {} --interval {}",
            self.backup, self.interval
        );
        if let Some(t) = &self.failover_timeout {
            let _ = write!(out, " --failover-timeout {t}");
        }
        if let Some(p) = &self.plug {
            let _ = write!(out, " --plug {p}");
        }
        if let Some((s, l)) = &self.console {
            let _ = write!(out, " --console {s} --console-log {l}");
        }
        if let Some(k) = &self.key {
            let _ = write!(out, " --key {k}");
        }
        for a in &self.heartbeat_addrs {
            let _ = write!(out, " --heartbeat-addr {a}");
        }
        if let Some(w) = &self.witness {
            let _ = write!(out, " --witness {w}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIVE: &str = r#"<domain type='kvm' id='7'>
  <name>web1</name>
  <metadata>
    <libosinfo:libosinfo xmlns:libosinfo="http://libosinfo.org/xmlns/libvirt/domain/1.0">
      <libosinfo:os id="http://debian.org/debian/12"/>
    </libosinfo:libosinfo>
    <hag:protect xmlns:hag="https://hag.example/1" backup="192.0.2.12:7200" interval="1s"
        qmp-socket="/run/hag/web1.qmp" plug="vnet0" key="/etc/hag/web1.key"
        heartbeat-addr="198.51.100.12:7201, [2001:db8::12]:7201" witness="203.0.113.9:7300"/>
  </metadata>
  <devices>
    <hostdev mode='subsystem' type='pci'><source><address domain='0' bus='1' slot='0' function='0'/></source></hostdev>
    <hostdev mode='subsystem' type='mdev' model='vfio-pci'>
      <source><address uuid='83b8f4f2-509f-382f-3c1e-e6bfe0fa1001'/></source>
      <address type='pci' domain='0x0000' bus='0x07' slot='0x00' function='0x0'/>
    </hostdev>
    <interface type='bridge'>
      <mac address='52:54:00:56:4d:01'/>
      <source bridge='br0'/>
      <target dev='vnet0'/>
      <model type='virtio'/>
    </interface>
    <interface type='network'><source network='default'/><model type='virtio'/></interface>
  </devices>
</domain>"#;

    /// The settings of `xml`'s `<hag:protect>` on a host with [`defaults`].
    fn settings_of(xml: &str) -> Result<Settings, String> {
        parse(xml)
            .unwrap()
            .protect
            .unwrap()
            .settings("web1", &defaults())
    }

    fn defaults() -> Defaults {
        Defaults {
            backup: None,
            interval: "2s".into(),
            failover_timeout: None,
            log_dir: "/var/log/hag".into(),
        }
    }

    #[test]
    fn a_live_domain_xml_gives_its_id_mdevs_and_settings() {
        let d = parse(LIVE).unwrap();
        assert_eq!(d.id, Some(7));
        assert_eq!(d.mdevs, ["83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"]);
        assert_eq!(
            d.interfaces,
            [
                Interface {
                    kind: "bridge".into(),
                    source: Some("br0".into()),
                    mac: Some("52:54:00:56:4d:01".into())
                },
                Interface {
                    kind: "network".into(),
                    source: Some("default".into()),
                    mac: None
                },
            ]
        );
        let s = d.protect.unwrap().settings("web1", &defaults()).unwrap();
        assert_eq!(s.socket, VmSocket::Qmp("/run/hag/web1.qmp".into()));
        assert_eq!(
            s.heartbeat_addrs,
            ["198.51.100.12:7201", "[2001:db8::12]:7201"]
        );
        assert_eq!(
            s.config_text("web1").lines().skip(2).collect::<Vec<_>>(),
            [
                "[checkpoint]",
                "qmp = /run/hag/web1.qmp",
                "backup = 192.0.2.12:7200",
                "interval = 1s",
                "plug = vnet0",
                "key = /etc/hag/web1.key",
                "heartbeat-addr = 198.51.100.12:7201",
                "heartbeat-addr = [2001:db8::12]:7201",
                "witness = 203.0.113.9:7300",
            ]
        );
    }

    #[test]
    fn a_pair_names_each_hosts_backup_and_this_host_takes_the_other() {
        let on_a = |h: &str| h == "192.0.2.1";
        let on_b = |h: &str| h == "192.0.2.2";
        let pair = "192.0.2.1:7200, 192.0.2.2:7200";
        assert_eq!(pick_backup(pair, on_a).unwrap(), "192.0.2.2:7200");
        assert_eq!(pick_backup(pair, on_b).unwrap(), "192.0.2.1:7200");
        // One address is the backup wherever the VM runs.
        assert_eq!(
            pick_backup("192.0.2.1:7200", on_a).unwrap(),
            "192.0.2.1:7200"
        );
        let err = pick_backup("192.0.2.1:7200,192.0.2.1:7201", on_a).unwrap_err();
        assert!(err.contains("never its own backup"), "{err}");
        let err = pick_backup("192.0.2.1:7200,b.example", on_a).unwrap_err();
        assert!(err.contains("'b.example' is not HOST:PORT"), "{err}");
        assert_eq!(host_of("[2001:db8::1]:7200"), "2001:db8::1");
        assert!(is_this_host("127.0.0.1"));
        assert!(!is_this_host("192.0.2.1"));
    }

    #[test]
    fn protect_must_be_in_hags_namespace_whatever_its_prefix() {
        let other = LIVE.replace("https://hag.example/1", "https://other.example/");
        assert_eq!(parse(&other).unwrap().protect, None);
        let prefixed = LIVE
            .replace("hag:protect", "h:protect")
            .replace("xmlns:hag", "xmlns:h");
        assert!(parse(&prefixed).unwrap().protect.is_some());
    }

    #[test]
    fn entities_are_read_as_xml_reads_them() {
        let xml = LIVE.replace("/run/hag/web1.qmp", "/run/hag/a&amp;b.qmp");
        let s = settings_of(&xml).unwrap();
        assert_eq!(s.socket, VmSocket::Qmp("/run/hag/a&b.qmp".into()));
    }

    #[test]
    fn a_line_break_in_a_value_cannot_add_a_setting() {
        let xml = LIVE.replace("vnet0", "vnet0&#10;fence-peer = /bin/sh");
        let err = settings_of(&xml).unwrap_err();
        assert_eq!(err, "plug has a control character (a line break?)");
    }

    #[test]
    fn each_bad_value_is_named() {
        let cases = [
            (
                "192.0.2.12:7200",
                "192.0.2.12",
                "backup '192.0.2.12' is not HOST:PORT",
            ),
            (
                "interval=\"1s\"",
                "interval=\"often\"",
                "interval 'often' is not a duration",
            ),
            (
                "/etc/hag/web1.key",
                "web1.key",
                "key 'web1.key' is not an absolute path",
            ),
            (
                "vnet0",
                "a very long interface",
                "plug 'a very long interface' is not an interface name",
            ),
            ("qmp-socket", "vm-socket", "plug needs qmp-socket"),
            (
                "qmp-socket=\"/run/hag/web1.qmp\"",
                "",
                "names no qmp-socket",
            ),
        ];
        for (from, to, want) in cases {
            let xml = LIVE.replace(from, to);
            let err = settings_of(&xml).unwrap_err();
            assert!(
                err.starts_with(want) || err.contains(want),
                "{from} -> {to}: {err}"
            );
        }
    }

    #[test]
    fn the_hosts_defaults_fill_what_the_element_leaves_out() {
        let xml = LIVE.replace("backup=\"192.0.2.12:7200\" interval=\"1s\"", "");
        let protect = parse(&xml).unwrap().protect.unwrap();
        assert!(protect
            .settings("web1", &defaults())
            .unwrap_err()
            .contains("no backup="));
        let host = Defaults {
            backup: Some("b.example:7200".into()),
            ..defaults()
        };
        let s = protect.settings("web1", &host).unwrap();
        assert_eq!(
            (s.backup.as_str(), s.interval.as_str()),
            ("b.example:7200", "2s")
        );
    }

    #[test]
    fn a_console_log_defaults_to_the_log_dir() {
        let xml = LIVE.replace("plug=\"vnet0\"", "console-socket=\"/run/hag/web1.con\"");
        let s = settings_of(&xml).unwrap();
        assert_eq!(
            s.console,
            Some((
                "/run/hag/web1.con".into(),
                "/var/log/hag/console-web1.log".into()
            ))
        );
    }

    #[test]
    fn what_is_not_a_domain_is_refused() {
        assert!(parse("<domain><oops></domain>")
            .unwrap_err()
            .starts_with("the domain XML does not parse"));
        assert_eq!(
            parse("<network/>").unwrap_err(),
            "the XML's root is <network>, not <domain>"
        );
        assert_eq!(parse("<domain/>").unwrap(), Domain::default());
    }
}
