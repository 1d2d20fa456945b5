//! The user/kernel ABI of hag, defined once.
//!
//! The kernel module `hag_mdev` includes [`abi`] as a module of its own
//! (`#[path]`), and `hagctl` depends on this crate, so both sides compile the
//! same ioctl numbers, `#[repr(C)]` structures, netlink names and attribute
//! numbers and cannot drift. Anything that changes the layout or meaning of
//! what crosses the boundary bumps [`abi::ABI_VERSION`]; both sides refuse to
//! talk to a peer of another version.
//!
//! ```
//! use hag_abi::abi::{HagVersion, ABI_VERSION, IOC_VERSION};
//! let v = HagVersion::default();
//! assert_eq!(core::mem::size_of_val(&v), 48);
//! assert_ne!(IOC_VERSION, 0);
//! assert_eq!(ABI_VERSION, 3);
//! ```
#![no_std]

pub mod abi;
pub mod sim_regs;
pub mod snapshot;
