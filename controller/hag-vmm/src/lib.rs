//! `hag-vmm`: a minimal VFIO-based VMM for testing hag without QEMU/KVM.
//!
//! It owns guest RAM ([`ram`]), attaches a `hag-sim` mdev through VFIO the
//! way QEMU does ([`vfio`], over the uapi in [`vfio_sys`]), drives it with a
//! built-in guest GPU driver whose whole state lives in guest RAM
//! ([`driver`]), runs GPU workloads that check their own results
//! ([`workloads`]), and checks hag's audit: every guest page the GPU
//! changed must be in hag's GPU dirty log ([`check`]). [`hostile`] attacks
//! the module instead: bad ioctls and region accesses, and fuzzed command
//! streams whose writes must stay inside the memory the guest gave.
//!
//! `unsafe` is confined to [`vfio_sys`] (the VFIO ioctls) and [`ram`] (the
//! guest RAM mapping); `/dev/hag` is reached through the `hag_dev` crate.

pub mod check;
pub mod control;
pub mod driver;
#[cfg(test)]
mod fake;
pub mod frames;
pub mod hostile;
pub mod ram;
pub mod serve;
pub mod vfio;
pub mod vfio_sys;
pub mod workloads;
