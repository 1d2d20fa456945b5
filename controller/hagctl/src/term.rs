//! Fencing terms: which VM instance a primary protects, at which
//! generation, and whether a backup took over from it.
//!
//! A generation alone cannot tell a backup whether a primary that pairs
//! below its generation is the copy it took over from (which must stop) or
//! a new start of the VM (which must not). So a primary names its VM
//! instance, the VMM process it protects ([`Instance`]: this boot of this
//! host, that pid, that start time, alike for every hagctl run against that
//! process), in every HELLO and JOIN ([`Term`]). A backup keeps, durably with
//! its generation, the instances it took over from ([`Record`]); at each
//! pairing [`judge`] decides:
//!
//! - an instance taken over from is [`Verdict::Superseded`]: it is told the
//!   generation, and stops its VM;
//! - any other instance is [`Verdict::Current`]: it pairs, and adopts the
//!   backup's generation if it is newer than its own;
//! - a primary that names no instance (an older hagctl) is judged by
//!   generation alone, as before: below the backup's, superseded.
//!
//! So a restarted or rebooted backup neither fences a healthy new primary
//! (a VM started afresh after a takeover) nor forgets an old one (the copy
//! a partition left running reconnects, by any hagctl run, as the same
//! instance).

use std::time::Duration;

use crate::vm_dirs::VmName;

/// How many instances a backup remembers having taken over from (oldest
/// dropped first): one per takeover of this VM.
pub const REMEMBERED: usize = 64;

/// A VM instance: the VMM process that runs it, named across hosts and
/// reboots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Instance {
    /// The host's boot (`/proc/sys/kernel/random/boot_id`).
    pub boot: u128,
    /// The VMM's pid.
    pub pid: u32,
    /// Its start time, in clock ticks since boot (`/proc/PID/stat`).
    pub started: u64,
}

impl Instance {
    /// The instance of process `pid` on this host.
    pub fn of_process(pid: u32) -> Result<Instance, String> {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map_err(|e| {
            format!("cannot name this host's boot: /proc/sys/kernel/random/boot_id: {e}")
        })?;
        let boot = u128::from_str_radix(&boot.trim().replace('-', ""), 16)
            .map_err(|_| format!("this host's boot id '{}' is not a UUID", boot.trim()))?;
        let started = crate::jobs::process_start(pid)
            .ok_or_else(|| format!("cannot read the start time of the VMM (pid {pid})"))?;
        Ok(Instance { boot, pid, started })
    }

    /// One word for it (boot, pid and start time), as status files keep
    /// it.
    pub fn key(self) -> String {
        format!("{:032x}-{}-{}", self.boot, self.pid, self.started)
    }

    /// Its JSON form (what `generation.json` keeps).
    pub fn to_json(self) -> serde_json::Value {
        serde_json::json!({
            "boot": format!("{:032x}", self.boot),
            "pid": self.pid,
            "started": self.started,
        })
    }

    /// From its JSON form.
    pub fn from_json(v: &serde_json::Value) -> Option<Instance> {
        Some(Instance {
            boot: u128::from_str_radix(v.get("boot")?.as_str()?, 16).ok()?,
            pid: u32::try_from(v.get("pid")?.as_u64()?).ok()?,
            started: v.get("started")?.as_u64()?,
        })
    }
}

impl std::fmt::Display for Instance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "pid {} (started at {:.2} s) of boot {:08x}",
            self.pid,
            Duration::from_millis(self.started * 10).as_secs_f64(),
            self.boot >> 96
        )
    }
}

/// What a primary presents at pairing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Term {
    /// Its generation.
    pub generation: u64,
    /// The VM instance it protects.
    pub instance: Instance,
    /// The VM's name (`--name`), if it was given one.
    pub vm: Option<VmName>,
}

/// A backup's answer to a primary's term.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// It may pair (adopting the backup's generation if newer).
    Current,
    /// The backup took over from it: its VM must stop.
    Superseded,
}

/// The verdict of a backup at `ours` that took over from `superseded` on
/// a primary presenting `term` (`None`: an older hagctl that presents only
/// `generation`).
pub fn judge(ours: u64, superseded: &[Instance], term: Option<&Term>, generation: u64) -> Verdict {
    match term {
        Some(t) if superseded.contains(&t.instance) => Verdict::Superseded,
        Some(_) => Verdict::Current,
        None if generation < ours => Verdict::Superseded,
        None => Verdict::Current,
    }
}

/// Why a backup named `ours` must not pair with a primary presenting
/// `term`: both are named, differently (a primary pointed at another VM's
/// backup would have that backup take over with the wrong VM's command
/// line).
pub fn wrong_vm(ours: Option<&VmName>, term: Option<&Term>) -> Option<String> {
    let theirs = term?.vm.as_ref()?;
    let ours = ours?;
    (theirs != ours).then(|| {
        format!("this backup stands by for VM '{ours}', the primary protects VM '{theirs}' (--name): check the primary's --backup address")
    })
}

/// A backup's durable fencing state: its generation and the instances it
/// took over from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Record {
    /// The generation (raised by each takeover).
    pub generation: u64,
    /// The instances taken over from, oldest first.
    pub superseded: Vec<Instance>,
}

impl Record {
    /// A takeover to `generation` from `instance` (if the primary named
    /// it).
    pub fn take_over(&mut self, generation: u64, instance: Option<Instance>) {
        self.generation = generation;
        if let Some(i) = instance.filter(|i| !self.superseded.contains(i)) {
            self.superseded.push(i);
        }
        let excess = self.superseded.len().saturating_sub(REMEMBERED);
        self.superseded.drain(..excess);
    }

    /// The `superseded` list in JSON.
    pub fn superseded_json(&self) -> serde_json::Value {
        self.superseded.iter().map(|i| i.to_json()).collect()
    }

    /// The `superseded` list of a JSON record (none if absent: a record
    /// from before instances were kept); an entry that does not parse is
    /// an error, as forgetting it could let its VM run twice.
    pub fn superseded_from_json(v: &serde_json::Value) -> Result<Vec<Instance>, String> {
        match v.get("superseded") {
            None => Ok(Vec::new()),
            Some(list) => list
                .as_array()
                .ok_or_else(|| format!("'superseded' is not a list: {list}"))?
                .iter()
                .map(|i| Instance::from_json(i).ok_or_else(|| format!("not an instance: {i}")))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instance(pid: u32) -> Instance {
        Instance {
            boot: 0x5f3a_0000_0000_0000_0000_0000_0000_0001,
            pid,
            started: 1234,
        }
    }

    fn verdict(r: &Record, term: Option<Term>, generation: u64) -> Verdict {
        judge(r.generation, &r.superseded, term.as_ref(), generation)
    }

    fn term(generation: u64, pid: u32) -> Option<Term> {
        Some(Term {
            generation,
            instance: instance(pid),
            vm: None,
        })
    }

    #[test]
    fn a_primary_of_another_vm_is_refused_only_when_both_are_named() {
        let named = |n: &str| -> Option<VmName> { Some(n.parse().unwrap()) };
        let mut t = term(0, 1).unwrap();
        assert_eq!(wrong_vm(named("web1").as_ref(), Some(&t)), None);
        t.vm = named("web1");
        assert_eq!(wrong_vm(named("web1").as_ref(), Some(&t)), None);
        assert_eq!(wrong_vm(None, Some(&t)), None);
        assert_eq!(wrong_vm(named("web1").as_ref(), None), None);
        let why = wrong_vm(named("db2").as_ref(), Some(&t)).unwrap();
        assert!(
            why.contains("for VM 'db2', the primary protects VM 'web1'"),
            "{why}"
        );
    }

    #[test]
    fn a_new_instance_below_the_generation_pairs() {
        let mut r = Record::default();
        r.take_over(1, Some(instance(100)));
        // The VM started afresh (another QEMU) after the takeover, its
        // hagctl at generation 0: not the copy taken over from.
        assert_eq!(verdict(&r, term(0, 200), 0), Verdict::Current);
    }

    #[test]
    fn the_instance_taken_over_from_is_superseded_whatever_it_says() {
        let mut r = Record::default();
        r.take_over(1, Some(instance(100)));
        assert_eq!(verdict(&r, term(0, 100), 0), Verdict::Superseded);
        // Even claiming a newer generation (a hagctl told --generation 5).
        assert_eq!(verdict(&r, term(5, 100), 5), Verdict::Superseded);
        // The same pid in another boot is another instance.
        let mut other = term(0, 100).unwrap();
        other.instance.boot += 1;
        assert_eq!(verdict(&r, Some(other.clone()), 0), Verdict::Current);
        // And a restarted process with the same pid (another start time).
        other.instance = Instance {
            started: 999,
            ..instance(100)
        };
        assert_eq!(verdict(&r, Some(other), 0), Verdict::Current);
    }

    #[test]
    fn a_primary_naming_no_instance_is_judged_by_generation() {
        let mut r = Record::default();
        assert_eq!(verdict(&r, None, 0), Verdict::Current);
        r.take_over(1, None);
        assert_eq!(verdict(&r, None, 0), Verdict::Superseded);
        assert_eq!(verdict(&r, None, 1), Verdict::Current);
    }

    #[test]
    fn takeovers_remember_each_instance_once_and_at_most_remembered() {
        let mut r = Record::default();
        r.take_over(1, Some(instance(1)));
        r.take_over(2, Some(instance(1)));
        assert_eq!(r.superseded, vec![instance(1)]);
        for g in 0..(REMEMBERED as u32 + 3) {
            r.take_over(u64::from(g) + 3, Some(instance(g + 10)));
        }
        assert_eq!(r.superseded.len(), REMEMBERED);
        assert_eq!(
            r.superseded[REMEMBERED - 1],
            instance(REMEMBERED as u32 + 12)
        );
        assert_eq!(r.generation, REMEMBERED as u64 + 5);
    }

    #[test]
    fn the_record_round_trips_through_json_and_refuses_garbage() {
        let mut r = Record::default();
        r.take_over(1, Some(instance(7)));
        let v = serde_json::json!({"generation": 1, "superseded": r.superseded_json()});
        assert_eq!(Record::superseded_from_json(&v), Ok(vec![instance(7)]));
        assert_eq!(
            Record::superseded_from_json(&serde_json::json!({"generation": 1})),
            Ok(vec![])
        );
        assert!(
            Record::superseded_from_json(&serde_json::json!({"superseded": [{"pid": 1}]}))
                .unwrap_err()
                .contains("not an instance")
        );
        assert!(Record::superseded_from_json(&serde_json::json!({"superseded": 3})).is_err());
    }

    #[test]
    fn this_process_is_an_instance() {
        let me = Instance::of_process(std::process::id()).unwrap();
        assert_eq!(me, Instance::of_process(std::process::id()).unwrap());
        assert_eq!(Instance::from_json(&me.to_json()), Some(me));
        assert!(Instance::of_process(u32::MAX).is_err());
    }
}
