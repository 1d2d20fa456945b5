//! `hag-vmm`: a minimal VFIO-based VMM for testing hag without QEMU/KVM.
//!
//! It owns guest RAM (a [`guest_ram::GuestRam`]), attaches a `hag-sim`
//! mdev through VFIO the way QEMU does ([`vfio`], over the uapi in
//! [`vfio_sys`]), drives it with the guest GPU driver of the `guest-gpu`
//! crate, whose whole state lives in guest RAM ([`guest_gpu::driver`]),
//! runs that crate's GPU workloads, which check their own results
//! ([`guest_gpu::workloads`]), and checks hag's audit: every guest page the
//! GPU changed must be in hag's GPU dirty log ([`check`]). [`hostile`]
//! attacks the module instead: bad ioctls and region accesses, and fuzzed
//! command streams whose writes must stay inside the memory the guest gave.
//! `hag-vmm serve` ([`serve`]) runs the [`guest_gpu::frames`] workload as a
//! VM that a controller drives over the control socket whose protocol is
//! the `vmm-control` crate's.
//!
//! `unsafe` here is the VFIO ioctls ([`vfio_sys`]; the binary's migration
//! check adds `VFIO_DEVICE_FEATURE`) and one `fork` in [`hostile`]; the
//! guest RAM mapping's is in `guest-ram`, the control socket's (fds
//! received with `SCM_RIGHTS`) in `vmm-control`; `/dev/hag` is reached
//! through the `hag_dev` crate.

pub mod check;
pub mod hostile;
pub mod serve;
pub mod vfio;
pub mod vfio_sys;
