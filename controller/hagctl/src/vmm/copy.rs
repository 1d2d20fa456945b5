//! What hagctl's own copy loop needs of a VM, beyond [`Vmm`]: the loop that
//! checkpoints a VM to a backup (`crate::checkpoint`) and migrates a
//! hag-vmm VM (`crate::migrate`) copies guest RAM itself, so it needs the
//! VM's RAM and CPU dirty log ([`Vmm::guest_memory`],
//! [`Vmm::cpu_dirty_log`]), its device state while paused, and a way to hold
//! the VM's output until the epoch that produced it is acknowledged.
//!
//! Two VMs implement it: hag-vmm's ([`super::hagvmm::HagVmm`]: output is
//! its console, held by hag-vmm itself) and QEMU's
//! ([`super::qemu_copy::QemuVm`]: RAM from a shared memory backend, CPU
//! dirty pages from soft-dirty bits, device state from an `x-ignore-shared`
//! migration, output held by an [`OutputGate`] on its network).

use super::qemu_disks::DeltaStats;
use super::{Vmm, VmmError};
use crate::wire::{DiskExtent, DiskInfo, VmmKind};

/// Where [`CopyVm::read_disks`] puts a delta: (disk index, offset,
/// extent).
pub type DiskSink<'a> = dyn FnMut(usize, u64, DiskExtent) -> Result<(), String> + 'a;

/// Where the VM stands when an epoch begins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmStatus {
    /// Its vCPUs run; `iteration` is the guest workload's, where the VMM
    /// knows it (hag-vmm), else 0.
    Running {
        /// The workload's iteration.
        iteration: u32,
    },
    /// The guest's work ended by itself (hag-vmm: `finished`).
    Finished {
        /// It verified.
        passed: bool,
        /// Its result line.
        result: String,
    },
    /// Anything else, in the VMM's word (paused by someone else, shut
    /// down, gone).
    Other(String),
    /// The VM died without being shut down (its VMM was killed or
    /// crashed, or failed internally): a failure the backup takes over
    /// from, not an end of protection.
    Crashed(String),
    /// It runs, but can no longer be protected (memory was hot-plugged,
    /// another process writes its RAM): protection ends, saying why.
    Unprotectable(String),
    /// Someone else (libvirt's `virsh migrate`) is migrating it, or has:
    /// protection ends here, and the VM must never be resumed here by
    /// hagctl (it runs, or will, where it lands).
    MigratingAway(String),
}

/// What holds a VM's output back until its epoch is acknowledged (for a
/// QEMU VM, `sch_plug` on the interface its packets leave by, and its
/// console: [`crate::console::ConsoleGate`]).
pub trait OutputGate {
    /// An epoch boundary, taken while the VM is paused: what the VM sent
    /// so far belongs to `epoch` (or an earlier one).
    fn mark(&mut self, epoch: u64) -> Result<(), String>;
    /// `epoch` was acknowledged: the output of it and of every earlier
    /// epoch goes out. Returns whether anything went out.
    fn release(&mut self, epoch: u64) -> Result<bool, String>;
    /// Protection ended: let everything out, and stop holding.
    fn release_all(&mut self) -> Result<(), String>;
    /// The VM is stopped for good (fenced, handed over, crashed): what is
    /// held may never go out; drop it and take the gate away.
    fn discard(&mut self) -> Result<(), String> {
        Ok(())
    }
}

/// A VM whose RAM hagctl copies itself (see the module docs).
pub trait CopyVm: Vmm {
    /// Which VMM: what its device state holds, and what a backup needs.
    fn kind(&self) -> VmmKind;

    /// Where the VM stands now.
    fn status(&mut self) -> Result<VmStatus, VmmError>;

    /// Pauses the VM; returns the guest workload's iteration where the
    /// VMM knows it (0 otherwise).
    fn pause_at(&mut self) -> Result<u32, VmmError> {
        self.pause().map(|()| 0)
    }

    /// Whether pausing also stops the vGPU and waits for it to go idle
    /// (QEMU moves it to VFIO's STOP), so hag's own quiesce is not needed.
    fn pause_stops_vgpu(&self) -> bool {
        false
    }

    /// With the VM paused: its device state for an epoch or a
    /// stop-and-copy round (hag-vmm: its state bytes, the vGPU context
    /// being read through `/dev/hag`; QEMU: its migration stream without
    /// shared RAM, the vGPU's state inside).
    fn vm_state(&mut self) -> Result<Vec<u8>, VmmError>;

    /// With the VM paused by hagctl and an epoch's save failed: whether a
    /// migration hagctl did not start is under way or done, in which case
    /// hagctl must not resume the VM (a paused VM's migration converges at
    /// once, and a `cont` after it completed would run it on two hosts).
    fn migrating_away(&mut self) -> Option<String> {
        None
    }

    /// Starts (`true`) or stops holding the VM's output.
    fn hold_output(&mut self, on: bool) -> Result<(), String>;

    /// The VM is stopped for good: [`OutputGate::discard`] on each gate.
    fn discard_output(&mut self) -> Result<(), String> {
        Ok(())
    }

    /// The output so far belongs to `epoch`, being captured.
    fn mark_epoch(&mut self, epoch: u64) -> Result<(), String>;

    /// `epoch` was acknowledged: its output (and all before it) goes out.
    /// Returns how much was released, in the gate's unit (console lines;
    /// epochs for a network gate).
    fn release_output(&mut self, epoch: u64) -> Result<u64, String>;

    /// The VM's writable disks, replicated with its memory (none: a VM
    /// without disks, or a VMM whose disks hagctl does not see).
    fn disks(&self) -> Vec<DiskInfo> {
        Vec::new()
    }

    /// With the VM running: makes ready what the next disk capture needs
    /// (so that the pause holds only the capture itself).
    fn prepare_disks(&mut self) -> Result<(), VmmError> {
        Ok(())
    }

    /// The disks' point in time: with the VM paused for an epoch, or
    /// running for a session's first, full copy (after
    /// [`CopyVm::restart_disks`]).
    fn capture_disks(&mut self) -> Result<(), VmmError> {
        Ok(())
    }

    /// After the VM resumed: the captured disk delta, into `sink`.
    fn read_disks(&mut self, sink: &mut DiskSink<'_>) -> Result<DeltaStats, VmmError> {
        let _ = sink;
        Ok(DeltaStats::default())
    }

    /// The epoch the last delta went into was acknowledged.
    fn disks_acknowledged(&mut self) {}

    /// A new session with the backup, whose replicas hold what `held`
    /// sums (DISK_SUMS): the next disk capture is a full copy, which sends
    /// only the chunks whose sums differ.
    fn restart_disks(&mut self, held: Vec<Vec<[u8; 32]>>) {
        let _ = held;
    }
}
