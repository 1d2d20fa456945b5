//! `guest-gpu`: the guest side of a `hag-sim` vGPU, shared by `hag-vmm`
//! (which attaches the vGPU through VFIO and is its own guest) and
//! `hag-guest` (a process inside a real VM that reaches it through a
//! mapped PCI BAR).
//!
//! [`driver`] is the guest GPU driver, whose whole state lives in guest
//! RAM (a [`guest_ram::GuestRam`]) and which reaches the device only
//! through its [`driver::Registers`]; [`workloads`] are GPU workloads that
//! check their own results, and [`frames`] is the long-running workload
//! made to be migrated. With the feature `fake` (tests only), the module
//! `fake` is a double of the device to run them on without the kernel
//! module.

pub mod driver;
#[cfg(any(test, feature = "fake"))]
pub mod fake;
pub mod frames;
pub mod workloads;
