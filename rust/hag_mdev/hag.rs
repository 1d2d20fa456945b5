// SPDX-License-Identifier: GPL-2.0-only
//! hag_mdev: GPU dirty tracking, vGPU snapshots and hang detection for
//! mediated vGPUs.
//!
//! On load the module registers `/dev/hag` (control ioctls), the `hag`
//! generic netlink family (events) and an mdev parent offering the simulated
//! vGPU type `hag-sim`. Its promise: whatever a guest or a caller sends, the
//! module answers with an error code, never a crash, and unloading leaves
//! nothing behind.
//!
//! Layout: [`glue`] is the one place that talks to C (and holds every
//! `unsafe` block); it calls back through traits that [`vgpu::State`]
//! implements, and names nothing above it; [`vgpu`] keeps the vGPU table; [`sim`] is the simulated
//! vGPU (registers, GTT, engine, VFIO protocol); [`migration`] VFIO
//! migration's state machine and data files, for both kinds of vGPU;
//! [`dirty`] its GPU dirty log;
//! [`control`] answers the `/dev/hag` ioctls; [`events`] sends netlink
//! events. [`abi`] and [`audit`] are the shared crates' sources (the ABI and
//! the command auditor), compiled in so kernel and userspace use the same
//! code; [`handoff`] is hag_gvt's, which [`gvt`] runs for every workload
//! i915's GVT-g hands over.

use kernel::prelude::*;

#[path = "../hag_abi/src/abi.rs"]
pub mod abi;
#[path = "../hag_abi/src/sim_regs.rs"]
pub mod sim_regs;
#[path = "../hag_abi/src/snapshot.rs"]
pub mod snapshot;
#[path = "../hag_audit/src/audit.rs"]
pub mod audit;
#[path = "../hag_gvt/src/handoff.rs"]
pub mod handoff;
#[path = "../hag_gvt/src/track.rs"]
pub mod track;
#[path = "../hag_ratelimit/src/budget.rs"]
pub mod ratelimit;
#[path = "../hag_ratelimit/src/backoff.rs"]
pub mod backoff;
mod control;
mod dirty;
mod events;
mod glue;
mod gvt;
mod migration;
mod sim;
mod vgpu;

pub(crate) use vgpu::State;

module! {
    type: HagModule,
    name: "hag_mdev",
    author: "hag developers",
    description: "hag: dirty tracking, snapshots and hang detection for mediated vGPUs",
    license: "GPL",
}

/// An error code that 6.12's `kernel::error::code` does not name (such as
/// `ETIMEDOUT` or `EPROTO`), from its `bindings` constant.
pub(crate) fn errno(code: u32) -> Error {
    Error::from_errno(-(code as i32))
}

/// The module version string reported by the version ioctl.
pub(crate) const MODULE_VERSION: &str = "0.1.0";

struct HagModule {
    _registration: glue::Registration<State>,
}

impl kernel::Module for HagModule {
    fn init(_module: &'static ThisModule) -> Result<Self> {
        let state = KBox::pin_init(State::new(), GFP_KERNEL)?;
        let registration = glue::Registration::new(state)?;
        pr_info!(
            "hag_mdev {} loaded: /dev/{}, netlink family '{}', mdev type '{}' (ABI {})\n",
            MODULE_VERSION,
            abi::DEVICE_NAME,
            abi::GENL_NAME,
            abi::SIM_TYPE_NAME,
            abi::ABI_VERSION
        );
        match registration.gvt() {
            glue::GvtSupport::NotCompiledIn => pr_info!("built without GVT-g support\n"),
            glue::GvtSupport::Registered { devices: 0 } => {
                pr_info!("GVT-g support compiled in, no GVT-g device present\n")
            }
            glue::GvtSupport::Registered { devices } => {
                pr_info!("GVT-g support compiled in, {} GVT-g device(s)\n", devices)
            }
            glue::GvtSupport::Failed(e) => pr_warn!(
                "GVT-g support compiled in, but GVT refused hag's hooks (error {}): GVT-g vGPUs are not tracked\n",
                e.to_errno()
            ),
        }
        Ok(Self {
            _registration: registration,
        })
    }
}

impl Drop for HagModule {
    fn drop(&mut self) {
        pr_info!("hag_mdev unloading\n");
    }
}
