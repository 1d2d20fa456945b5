//! What a guest sees of its virtual machine: the machine type, the vCPUs
//! (count, model and CPUID feature words) and every device the command
//! line (or a hot-plug) made, with its type, bus and PCI address. (Not
//! `query-pci`: it follows the bus numbers the guest's firmware
//! programmed, so a standby that has not booted shows nothing behind a
//! bridge or root port.)
//! A protecting primary sends its QEMU VM's shape in its HELLO; the backup
//! reads the same from the standby it starts as a dry run and refuses the
//! pairing when they differ, naming each difference. At takeover the
//! guest resumes on the standby: a device the primary did not have would
//! run from its reset state under a guest that never probed it, a missing
//! one fails the load (QEMU: "Unknown savevm section"), and a CPU with
//! fewer features kills the guest at its next use of one. QEMU itself
//! checks only what the stream holds, and only when the takeover loads it.
//!
//! Host-side parts (disk files, chardevs, netdev back ends, the mdev's
//! sysfs path, the memory backend's file) differ between the hosts by
//! design and are not part of the shape.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::vmm::qmp::Qmp;

/// Largest encoded shape a HELLO may carry (a VM with hundreds of devices
/// stays well under it).
pub const MAX_ENCODED: usize = 64 * 1024;

/// A VM's guest-visible configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmShape {
    /// The machine's QOM type (`pc-q35-10.0-machine`).
    pub machine: String,
    /// How many vCPUs.
    pub cpus: u32,
    /// The first vCPU's QOM type (`host-x86_64-cpu`).
    pub cpu_model: String,
    /// Its CPUID feature words.
    pub cpu_features: Vec<FeatureWord>,
    /// Every device the command line made, by name.
    pub devices: Vec<Device>,
}

/// One CPUID register's feature bits.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FeatureWord {
    /// CPUID leaf.
    pub eax: u32,
    /// Sub-leaf, where the leaf has them.
    pub ecx: Option<u32>,
    /// `EAX`..`EDX`.
    pub register: String,
    /// The bits.
    pub bits: u64,
}

/// One device the command line made.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Device {
    /// Its id, or `peripheral-anon/device[N]` for one without (QEMU
    /// numbers those in creation order, which the command line decides).
    pub name: String,
    /// Its QOM type (`virtio-net-pci`).
    pub kind: String,
    /// The bus it sits on (`/machine/q35/pcie.0`: QEMU's own name, known
    /// before the guest's firmware has numbered any bus).
    pub bus: String,
    /// Its PCI device and function (devfn), for a PCI device.
    pub devfn: Option<u32>,
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} on {}", self.kind, self.bus)?;
        if let Some(devfn) = self.devfn {
            write!(f, " at {:02x}.{}", devfn >> 3, devfn & 7)?;
        }
        Ok(())
    }
}

impl FeatureWord {
    fn name(&self) -> String {
        match self.ecx {
            Some(ecx) => format!("CPUID[{:#x},{ecx:#x}].{}", self.eax, self.register),
            None => format!("CPUID[{:#x}].{}", self.eax, self.register),
        }
    }
}

impl VmShape {
    /// Reads the shape of the VM behind `qmp`.
    pub fn read(qmp: &mut Qmp) -> Result<VmShape, String> {
        let machine = string(&qom_get(qmp, "/machine", "type")?)?;
        let cpus = qmp
            .execute("query-cpus-fast", None)
            .map_err(|e| format!("query-cpus-fast: {e}"))?;
        let cpus = cpus.as_array().ok_or("query-cpus-fast: not a list")?;
        let cpu = cpus
            .iter()
            .min_by_key(|c| c["cpu-index"].as_u64())
            .and_then(|c| c["qom-path"].as_str())
            .ok_or("query-cpus-fast: no vCPU")?;
        let cpu_model = string(&qom_get(qmp, cpu, "type")?)?;
        // Only x86 CPUs have feature words; elsewhere the model says it.
        let cpu_features = match qom_get(qmp, cpu, "feature-words") {
            Ok(v) => feature_words(&v)?,
            Err(_) => Vec::new(),
        };
        let mut devices = Vec::new();
        for (container, named) in [
            ("/machine/peripheral", true),
            ("/machine/peripheral-anon", false),
        ] {
            let list = qmp
                .execute("qom-list", Some(json!({ "path": container })))
                .map_err(|e| format!("qom-list {container}: {e}"))?;
            for (child, kind) in children(&list) {
                let path = format!("{container}/{child}");
                devices.push(Device {
                    name: if named {
                        child
                    } else {
                        format!("peripheral-anon/{child}")
                    },
                    kind,
                    bus: qom_get(qmp, &path, "parent_bus")
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default(),
                    devfn: qom_get(qmp, &path, "addr")
                        .ok()
                        .and_then(|v| v.as_u64())
                        .and_then(|a| u32::try_from(a).ok()),
                });
            }
        }
        devices.sort();
        Ok(VmShape {
            machine,
            cpus: u32::try_from(cpus.len()).unwrap_or(u32::MAX),
            cpu_model,
            cpu_features,
            devices,
        })
    }

    /// The bytes a HELLO carries.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a shape is plain data")
    }

    /// Parses [`VmShape::encode`]'s bytes (the caller capped them).
    pub fn decode(bytes: &[u8]) -> Result<VmShape, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("not a VM shape: {e}"))
    }
}

fn qom_get(qmp: &mut Qmp, path: &str, property: &str) -> Result<Value, String> {
    qmp.execute(
        "qom-get",
        Some(json!({ "path": path, "property": property })),
    )
    .map_err(|e| format!("qom-get {path} {property}: {e}"))
}

fn string(v: &Value) -> Result<String, String> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("{v} is not a string"))
}

/// QEMU's `feature-words` property (X86CPUFeatureWordInfo list).
fn feature_words(v: &Value) -> Result<Vec<FeatureWord>, String> {
    let list = v.as_array().ok_or("feature-words: not a list")?;
    let mut words = list
        .iter()
        .map(|w| {
            let field = |name: &str| {
                w[name]
                    .as_u64()
                    .ok_or_else(|| format!("feature-words: no {name} in {w}"))
            };
            Ok(FeatureWord {
                eax: u32::try_from(field("cpuid-input-eax")?).map_err(|e| e.to_string())?,
                ecx: w["cpuid-input-ecx"].as_u64().map(|e| e as u32),
                register: string(&w["cpuid-register"])?,
                bits: field("features")?,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    words.sort();
    Ok(words)
}

/// The children a `qom-list` of a container names: `(name, QOM type)`.
fn children(list: &Value) -> Vec<(String, String)> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| {
            let kind = p["type"]
                .as_str()?
                .strip_prefix("child<")?
                .strip_suffix('>')?;
            Some((p["name"].as_str()?.to_owned(), kind.to_owned()))
        })
        .collect()
}

/// How the standby (`here`) differs from the primary's VM, one line per
/// difference; empty when the guest could not tell them apart.
pub fn differences(primary: &VmShape, here: &VmShape) -> Vec<String> {
    let mut out = Vec::new();
    let mut differ = |what: &str, p: &dyn std::fmt::Display, h: &dyn std::fmt::Display| {
        out.push(format!("{what}: {p} on the primary, {h} here"));
    };
    if primary.machine != here.machine {
        differ("machine type", &primary.machine, &here.machine);
    }
    if primary.cpus != here.cpus {
        differ("vCPUs", &primary.cpus, &here.cpus);
    }
    if primary.cpu_model != here.cpu_model {
        differ("CPU model", &primary.cpu_model, &here.cpu_model);
    }
    for p in &primary.cpu_features {
        let h = here
            .cpu_features
            .iter()
            .find(|h| (h.eax, h.ecx, &h.register) == (p.eax, p.ecx, &p.register))
            .map_or(0, |h| h.bits);
        if h != p.bits {
            differ(
                &format!("CPU features {}", p.name()),
                &format!("{:#x}", p.bits),
                &format!("{h:#x}"),
            );
        }
    }
    for h in &here.cpu_features {
        let known = primary
            .cpu_features
            .iter()
            .any(|p| (p.eax, p.ecx, &p.register) == (h.eax, h.ecx, &h.register));
        if !known && h.bits != 0 {
            differ(
                &format!("CPU features {}", h.name()),
                &"0x0",
                &format!("{:#x}", h.bits),
            );
        }
    }
    for p in &primary.devices {
        match here.devices.iter().find(|h| h.name == p.name) {
            None => differ(&format!("device {}", p.name), p, &"nothing"),
            Some(h) if h != p => differ(&format!("device {}", p.name), p, h),
            Some(_) => {}
        }
    }
    for h in &here.devices {
        if !primary.devices.iter().any(|p| p.name == h.name) {
            differ(&format!("device {}", h.name), &"nothing", h);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(name: &str, kind: &str, bus: &str, devfn: Option<u32>) -> Device {
        Device {
            name: name.into(),
            kind: kind.into(),
            bus: bus.into(),
            devfn,
        }
    }

    fn vm() -> VmShape {
        VmShape {
            machine: "pc-q35-10.0-machine".into(),
            cpus: 1,
            cpu_model: "host-x86_64-cpu".into(),
            cpu_features: feature_words(&json!([
                {"cpuid-register": "EDX", "cpuid-input-eax": 1, "features": 0x178bfbff_u64},
                {"cpuid-register": "EBX", "cpuid-input-eax": 7, "cpuid-input-ecx": 0, "features": 0x209_u64},
            ]))
            .unwrap(),
            devices: vec![
                device("net0", "virtio-net-pci", "/machine/q35/pcie.0", Some(0x18)),
                device("vgpu0", "vfio-pci", "/machine/peripheral/rp1/rp1", Some(0)),
                device("peripheral-anon/device[0]", "isa-serial", "/machine/unattached/device[2]/isa.0", None),
            ],
        }
    }

    #[test]
    fn the_same_vm_has_no_differences_and_survives_the_wire() {
        let a = vm();
        assert!(differences(&a, &a.clone()).is_empty());
        assert_eq!(VmShape::decode(&a.encode()).unwrap(), a);
        assert!(VmShape::decode(b"{\"machine\":1}").is_err());
        assert_eq!(
            children(&json!([{"name": "type", "type": "string"},
                             {"name": "rng0", "type": "child<virtio-rng-pci>"},
                             {"name": "rp1", "type": "link<pcie-root-port>"}])),
            [("rng0".to_owned(), "virtio-rng-pci".to_owned())]
        );
    }

    #[test]
    fn each_difference_is_named_with_both_sides() {
        let p = vm();
        let mut h = vm();
        h.machine = "pc-i440fx-10.0-machine".into();
        h.cpus = 2;
        h.cpu_features[1].bits = 0x9;
        h.devices[0].devfn = Some(0x20);
        h.devices.push(device(
            "rng0",
            "virtio-rng-pci",
            "/machine/q35/pcie.0",
            Some(0x28),
        ));
        h.devices.retain(|d| d.kind != "isa-serial");
        assert_eq!(
            differences(&p, &h),
            [
                "machine type: pc-q35-10.0-machine on the primary, pc-i440fx-10.0-machine here",
                "vCPUs: 1 on the primary, 2 here",
                "CPU features CPUID[0x7,0x0].EBX: 0x209 on the primary, 0x9 here",
                "device net0: virtio-net-pci on /machine/q35/pcie.0 at 03.0 on the primary, \
                 virtio-net-pci on /machine/q35/pcie.0 at 04.0 here",
                "device peripheral-anon/device[0]: isa-serial on /machine/unattached/device[2]/isa.0 \
                 on the primary, nothing here",
                "device rng0: nothing on the primary, virtio-rng-pci on /machine/q35/pcie.0 at 05.0 here",
            ]
        );
    }

    /// Real QEMU 10 on this machine (TCG, no guest): the shape of a
    /// standby as the backup's dry run reads it, for the same command line
    /// and for one with another CPU, a second vCPU and one more device.
    /// `cargo test -p hagctl vm_shape::tests::qemu -- --ignored`.
    #[test]
    #[ignore]
    fn qemu_standbys_of_the_same_and_of_another_vm() {
        let dir = std::env::temp_dir().join(format!("hag-vm-shape-{}", std::process::id()));
        let line = |extra: &[&str]| {
            let mut v: Vec<String> = [
                "qemu-system-x86_64",
                "-M",
                "q35",
                "-accel",
                "tcg",
                "-display",
                "none",
                "-nic",
                "none",
                "-serial",
                "none",
                "-cpu",
                "qemu64",
                "-device",
                "pcie-root-port,id=rp1,chassis=1",
                "-device",
                "virtio-rng-pci,id=rng0,bus=rp1",
                "-device",
                "virtio-rng-pci",
            ]
            .map(String::from)
            .to_vec();
            v.extend(extra.iter().map(|s| s.to_string()));
            v
        };
        let shape = |extra: &[&str]| {
            crate::vmm::qemu_standby::dry_run(&line(extra), 64 << 20, &dir).unwrap()
        };
        let primary = shape(&[]);
        assert_eq!(primary.cpu_model, "qemu64-x86_64-cpu");
        assert!(!primary.cpu_features.is_empty());
        let rng0 = primary.devices.iter().find(|d| d.name == "rng0").unwrap();
        assert_eq!(
            rng0.to_string(),
            "virtio-rng-pci on /machine/peripheral/rp1/rp1 at 00.0"
        );
        assert!(differences(&primary, &shape(&[])).is_empty());
        let other = shape(&[
            "-cpu",
            "qemu64,+aes",
            "-smp",
            "2",
            "-device",
            "virtio-rng-pci,id=rng1",
        ]);
        let d = differences(&primary, &other);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            d.contains(&"vCPUs: 1 on the primary, 2 here".to_owned()),
            "{d:?}"
        );
        assert!(
            d.iter()
                .any(|l| l.starts_with("CPU features CPUID[0x1].ECX: ")),
            "{d:?}"
        );
        assert!(
            d.iter().any(|l| l.starts_with(
                "device rng1: nothing on the primary, virtio-rng-pci on /machine/q35/pcie.0 at "
            )),
            "{d:?}"
        );
    }
}
