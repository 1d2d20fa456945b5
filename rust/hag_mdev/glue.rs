// SPDX-License-Identifier: GPL-2.0-only
//! The only place where hag_mdev's Rust meets C.
//!
//! Rust-for-Linux 6.12 has no abstractions for miscdevice, file operations,
//! generic netlink, mdev or VFIO. `glue.c` holds their static tables and the
//! helpers that are C macros or inline functions; this file declares them,
//! receives their callbacks (the table [`RsOps`], built per driver type) and
//! turns both directions into safe
//! Rust: [`Registration`] owns the registered interfaces and the driver
//! state, and [`EventMessage`] builds and sends one netlink message.
//! Every `unsafe` block of the module is in this file.
//!
//! The dependency points one way, as in upstream Rust-for-Linux's
//! `rust/kernel/miscdevice.rs`: the glue knows the traits of what it calls
//! back ([`FileOps`] for `/dev/hag`, [`MdevParent`] and [`VfioDevice`] for
//! the vGPUs of the `hag-sim` type, [`GvtObserver`] for GVT-g's hooks), and
//! the module's logic implements them; nothing here names the logic. The
//! ABI structures it copies to and from userspace are the shared crates'
//! (`abi`) and VFIO's uapi, mirrored here ([`uapi`]).

use core::ffi::{c_char, c_int, c_long, c_uint, c_ulong, c_void};
use core::ptr;
use core::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use kernel::prelude::*;
use kernel::types::{AsBytes, FromBytes};
use kernel::sync::{Arc, ArcBorrow, Mutex};
use kernel::types::ForeignOwnable;
use kernel::uaccess::UserSlice;
use kernel::{new_mutex, pin_init};

use crate::abi;
use crate::audit::AddressSpace;
use crate::dirty;
use crate::handoff;

/// `/dev/hag`'s file operations. Each open has its own state
/// ([`Self::Opened`]), kept in the file's `private_data` from open to
/// release, as upstream's `MiscDevice::Ptr`.
pub(crate) trait FileOps {
    /// What one open keeps.
    type Opened: Send + Sync + 'static;
    /// The file was opened.
    fn open(&self) -> Result<Pin<KBox<Self::Opened>>>;
    /// An ioctl on it.
    fn ioctl(&self, opened: &Self::Opened, cmd: u32, arg: usize) -> Result;
    /// It was released (closed, or its process died).
    fn release(&self, opened: Pin<KBox<Self::Opened>>);
}

/// The mdev parent: vGPUs of the `hag-sim` type come and go.
pub(crate) trait MdevParent: VfioDevice {
    /// A vGPU was created through sysfs; returns it as its VFIO device
    /// reaches it (glue.c keeps the reference in the device until remove).
    fn vgpu_probe(&self, uuid: [u8; 16], handle: VgpuHandle) -> Result<Arc<Self::Vgpu>>;
    /// It is being removed (or its probe failed after `vgpu_probe`). The
    /// reference is dropped after this, once its work item is cancelled.
    fn vgpu_remove(&self, vgpu: &Self::Vgpu);
}

/// A vGPU's VFIO device, as a VMM uses it: hag-sim's own, or, for
/// migration and DMA logging only, a GVT-g vGPU's (kvmgt's device
/// delegates those to hag).
pub(crate) trait VfioDevice {
    /// A vGPU as its VFIO device reaches it: a counted reference in the
    /// device's data, borrowed for each callback.
    type Vgpu: Send + Sync + 'static;
    /// A migration data file's contents: the file's `private_data`.
    type MigFile: Send + Sync + 'static;
    /// The VMM opened (`true`) or closed the device.
    fn vgpu_open(&self, vgpu: &Self::Vgpu, open: bool);
    /// A region read or write; returns the bytes transferred.
    fn region_rw(&self, vgpu: &Self::Vgpu, user: UserSlice, count: usize, pos: u64, write: bool) -> Result<usize>;
    /// A device ioctl.
    fn device_ioctl(&self, vgpu: &Self::Vgpu, cmd: u32, arg: usize) -> Result<i64>;
    /// The vGPU's work item ran.
    fn tick(&self, vgpu: &Self::Vgpu);
    /// DMA logging starts over `ranges`.
    fn dma_log_start(&self, vgpu: &Self::Vgpu, ranges: &[dirty::Range]) -> Result;
    /// DMA logging stops.
    fn dma_log_stop(&self, vgpu: &Self::Vgpu) -> Result;
    /// Hands out (to `report`) and clears the dirty pages of a range.
    fn dma_log_report(&self, vgpu: &Self::Vgpu, iova: u64, length: u64, report: &mut dyn FnMut(u64)) -> Result;
    /// VFIO migration to `target` (`enum vfio_device_mig_state`) along
    /// the path `vdev` gives; the file the last arc opened, if any (made
    /// with [`mig_file`]).
    fn mig_set_state(&self, vgpu: &Self::Vgpu, vdev: &VfioDeviceRef<'_>, target: u32) -> Result<Option<File>>;
    /// The migration state.
    fn mig_state(&self, vgpu: &Self::Vgpu) -> u32;
    /// Bytes of a STOP_COPY snapshot of the vGPU.
    fn mig_data_bytes(&self, vgpu: &Self::Vgpu) -> Result<usize>;
    /// Back to RUNNING with no data session (a GVT-g device reset).
    fn mig_reset(&self, vgpu: &Self::Vgpu);
    /// The VMM reads a data file.
    fn mig_file_read(&self, file: &Self::MigFile, user: UserSlice, len: usize) -> Result<usize>;
    /// The VMM writes a data file.
    fn mig_file_write(&self, file: &Self::MigFile, user: UserSlice, len: usize) -> Result<usize>;
}

/// GVT-g's hooks (the i915 patch), for the vGPUs GVT runs.
pub(crate) trait GvtObserver: VfioDevice {
    /// GVT created (or had) a vGPU; returns it as kvmgt's VFIO device
    /// reaches it through hag (glue.c keeps the reference until removal).
    fn gvt_vgpu_added(&self, gvt_id: u32, ggtt_size: u64, vgpu: GvtVgpuPtr) -> Result<Arc<Self::Vgpu>>;
    /// GVT is destroying the vGPU at `vgpu`; `device` is the reference
    /// `gvt_vgpu_added` gave (`None` if it failed).
    fn gvt_vgpu_removed(&self, vgpu: usize, device: Option<Arc<Self::Vgpu>>);
    /// GVT scanned and shadowed workload `cookie` of the vGPU at `vgpu`
    /// (or the glue could not read what GVT passed, or GVT could not pass
    /// all of it: why).
    fn gvt_workload(
        &self,
        vgpu: usize,
        engine: u32,
        cookie: u64,
        workload: core::result::Result<GvtWorkload<'_>, &'static str>,
        translate: &mut GvtTranslate,
    );
    /// Workload `cookie` of the vGPU at `vgpu` will not write guest memory
    /// any more; `changed`: a PPGTT batch it ran differs from what was
    /// handed over.
    fn gvt_workload_done(&self, vgpu: usize, cookie: u64, changed: bool);
    /// Whether GVT should check, for the workloads of the vGPU at `vgpu`,
    /// that no PPGTT batch changed under them (it reads each back).
    fn gvt_batch_check(&self, vgpu: usize) -> bool;
    /// GVT itself wrote `len` bytes of the vGPU's guest memory at `gpa`.
    fn gvt_guest_written(&self, vgpu: usize, gpa: u64, len: u64);
    /// GVT mapped (`map`) or is unmapping `nr` guest pages from `gfn` for
    /// the vGPU's GPU.
    fn gvt_pages_mapped(&self, vgpu: usize, gfn: u64, nr: u64, map: bool);
    /// A GTT entry of the vGPU at `vgpu` now maps `nr` pages from `gfn`.
    fn gvt_gtt_mapped(&self, vgpu: usize, gfn: u64, nr: u64);
    /// The mappable GGTT range of the vGPU at `vgpu` maps, or mapped until
    /// now, `nr` pages from `gfn`: the guest's CPU may have written them
    /// through the aperture.
    fn gvt_aperture_mapped(&self, vgpu: usize, gfn: u64, nr: u64);
}

/// Everything the registered interfaces call back.
pub(crate) trait Driver: FileOps + MdevParent + VfioDevice + GvtObserver + Send + Sync + 'static {}

impl<T: FileOps + MdevParent + VfioDevice + GvtObserver + Send + Sync + 'static> Driver for T {}

/// The Rust callbacks glue.c calls, built for one driver type. Mirrors
/// `struct hag_rs_ops` in glue.h.
#[repr(C)]
pub(crate) struct RsOps {
    open: extern "C" fn(*const c_void, *mut *const c_void) -> c_int,
    ioctl: extern "C" fn(*const c_void, *const c_void, c_uint, c_ulong) -> c_long,
    release: extern "C" fn(*const c_void, *const c_void),
    vgpu_probe: extern "C" fn(*const c_void, *const u8, *mut CVgpu, *mut *const c_void) -> c_int,
    vgpu_remove: extern "C" fn(*const c_void, *const c_void),
    vgpu_put: extern "C" fn(*const c_void, *const c_void),
    vgpu_open: extern "C" fn(*const c_void, *const c_void, bool),
    vfio_rw: extern "C" fn(*const c_void, *const c_void, *mut u8, usize, u64, bool) -> c_long,
    vfio_ioctl: extern "C" fn(*const c_void, *const c_void, c_uint, c_ulong) -> c_long,
    vgpu_tick: extern "C" fn(*const c_void, *const c_void),
    dma_log_start: extern "C" fn(*const c_void, *const c_void, *const dirty::Range, u32) -> c_int,
    dma_log_stop: extern "C" fn(*const c_void, *const c_void) -> c_int,
    dma_log_report: extern "C" fn(*const c_void, *const c_void, u64, u64, *mut c_void) -> c_int,
    mig_set_state: extern "C" fn(*const c_void, *const c_void, *mut c_void, u32, *mut *mut c_void) -> c_int,
    mig_get_state: extern "C" fn(*const c_void, *const c_void) -> u32,
    mig_data_bytes: extern "C" fn(*const c_void, *const c_void) -> c_long,
    mig_reset: extern "C" fn(*const c_void, *const c_void),
    mig_file_read: extern "C" fn(*const c_void, *const c_void, *mut u8, usize) -> c_long,
    mig_file_write: extern "C" fn(*const c_void, *const c_void, *const u8, usize) -> c_long,
    mig_file_release: extern "C" fn(*const c_void, *const c_void),
    gvt_vgpu_added: extern "C" fn(*const c_void, *mut c_void, c_uint, *mut *const c_void) -> c_int,
    gvt_vgpu_removed: extern "C" fn(*const c_void, *mut c_void, *const c_void),
    gvt_workload: extern "C" fn(*const c_void, *const c_void, *mut c_void, *const CGvtWl),
    gvt_workload_done: extern "C" fn(*const c_void, *mut c_void, u64, bool),
    gvt_batch_check: extern "C" fn(*const c_void, *mut c_void) -> bool,
    gvt_guest_written: extern "C" fn(*const c_void, *mut c_void, u64, u64),
    gvt_pages_mapped: extern "C" fn(*const c_void, *mut c_void, u64, u64, bool),
    gvt_gtt_mapped: extern "C" fn(*const c_void, *mut c_void, u64, u64),
    gvt_aperture_mapped: extern "C" fn(*const c_void, *mut c_void, u64, u64),
}

/// The table for driver `T`, as upstream's `MiscdeviceVTable<T>` builds
/// `file_operations`: every entry is a callback monomorphised for `T`.
struct Vtable<T>(core::marker::PhantomData<T>);

impl<T: Driver> Vtable<T> {
    const OPS: RsOps = RsOps {
        open: open::<T>,
        ioctl: ioctl::<T>,
        release: release::<T>,
        vgpu_probe: vgpu_probe::<T>,
        vgpu_remove: vgpu_remove::<T>,
        vgpu_put: vgpu_put::<T>,
        vgpu_open: vgpu_open::<T>,
        vfio_rw: vfio_rw::<T>,
        vfio_ioctl: vfio_ioctl::<T>,
        vgpu_tick: vgpu_tick::<T>,
        dma_log_start: dma_log_start::<T>,
        dma_log_stop: dma_log_stop::<T>,
        dma_log_report: dma_log_report::<T>,
        mig_set_state: mig_set_state::<T>,
        mig_get_state: mig_get_state::<T>,
        mig_data_bytes: mig_data_bytes::<T>,
        mig_reset: mig_reset::<T>,
        mig_file_read: mig_file_read::<T>,
        mig_file_write: mig_file_write::<T>,
        mig_file_release: mig_file_release::<T>,
        gvt_vgpu_added: gvt_vgpu_added::<T>,
        gvt_vgpu_removed: gvt_vgpu_removed::<T>,
        gvt_workload: gvt_workload::<T>,
        gvt_workload_done: gvt_workload_done::<T>,
        gvt_batch_check: gvt_batch_check::<T>,
        gvt_guest_written: gvt_guest_written::<T>,
        gvt_pages_mapped: gvt_pages_mapped::<T>,
        gvt_gtt_mapped: gvt_gtt_mapped::<T>,
        gvt_aperture_mapped: gvt_aperture_mapped::<T>,
    };

    fn build() -> &'static RsOps {
        &Self::OPS
    }
}

/// Mirrors `struct hag_glue_config` in glue.c.
#[repr(C)]
struct GlueConfig {
    misc_name: *const c_char,
    parent_name: *const c_char,
    sim_type_name: *const c_char,
    sim_type_description: *const c_char,
    genl_name: *const c_char,
    genl_mcgrp_events: *const c_char,
    sim_max_instances: u32,
    genl_maxattr: u16,
    genl_pad_attr: u16,
    genl_version: u8,
}

/// Mirrors `struct hag_glue_msg` in glue.c.
#[repr(C)]
struct GlueMsg {
    skb: *mut c_void,
    hdr: *mut c_void,
}

/// `struct hag_vgpu` of glue.c, opaque here.
#[repr(C)]
pub(crate) struct CVgpu {
    _private: [u8; 0],
}

/// `struct eventfd_ctx`, opaque here.
#[repr(C)]
struct CEventfd {
    _private: [u8; 0],
}

extern "C" {
    fn hag_glue_dma_rw(vgpu: *mut CVgpu, gpa: u64, data: *mut c_void, len: u64, write: bool)
        -> c_int;
    fn hag_glue_kick(vgpu: *mut CVgpu, delay_ms: u32);
    fn hag_glue_eventfd_get(fd: c_int) -> *mut CEventfd;
    fn hag_glue_eventfd_signal(ctx: *mut CEventfd);
    fn hag_glue_eventfd_put(ctx: *mut CEventfd);
    fn hag_glue_hang_injection_allowed() -> bool;
    fn hag_glue_gpu_dirty_withheld() -> bool;
    fn hag_glue_test_hold_vgpu_ms() -> u32;
    fn hag_glue_msleep(ms: u32);
    fn hag_glue_fatal_signal_pending() -> bool;
    fn hag_glue_cond_resched();
    fn hag_glue_iova_bitmap_set(dirty: *mut c_void, iova: u64, length: u64);
    fn hag_glue_mig_data_corrupted() -> bool;
    fn hag_glue_mig_next_state(vdev: *mut c_void, cur: u32, target: u32, next: *mut u32) -> c_int;
    fn hag_glue_mig_file(migf: *const c_void, write: bool, filp: *mut *mut c_void) -> c_int;
    fn hag_glue_fput(filp: *mut c_void);
    fn hag_glue_register(ctx: *const c_void, ops: *const RsOps, cfg: *const GlueConfig) -> c_int;
    fn hag_glue_unregister();
    fn hag_glue_msg_new(msg: *mut GlueMsg, cmd: u8) -> c_int;
    fn hag_glue_msg_put_u32(msg: *mut GlueMsg, attr: u16, value: u32) -> c_int;
    fn hag_glue_msg_put_u64(msg: *mut GlueMsg, attr: u16, value: u64) -> c_int;
    fn hag_glue_msg_put_bytes(msg: *mut GlueMsg, attr: u16, data: *const c_void, len: u32)
        -> c_int;
    fn hag_glue_msg_multicast(msg: *mut GlueMsg) -> c_int;
    fn hag_glue_msg_cancel(msg: *mut GlueMsg);
}

const SIM_TYPE_DESCRIPTION_C: &[u8] = b"hag simulated GEN vGPU\0";

fn c_str(bytes: &'static [u8]) -> *const c_char {
    // The ABI's *_C constants are NUL-terminated (checked by its tests).
    bytes.as_ptr().cast()
}

/// The registered C interfaces, and the driver state their callbacks reach.
///
/// Dropping it unregisters everything before the state is freed, so no
/// callback can see freed state.
pub(crate) struct Registration<T: Driver> {
    state: Pin<KBox<T>>,
    gvt: GvtSupport,
}

impl<T: Driver> Registration<T> {
    /// Registers `/dev/hag`, the `hag` netlink family and the mdev parent,
    /// and (if built with it) the GVT-g observer, all calling `state` back.
    pub(crate) fn new(state: Pin<KBox<T>>) -> Result<Self> {
        let cfg = GlueConfig {
            misc_name: c_str(abi::DEVICE_NAME_C),
            parent_name: c_str(abi::PARENT_NAME_C),
            sim_type_name: c_str(abi::SIM_TYPE_SYSFS_NAME_C),
            sim_type_description: c_str(SIM_TYPE_DESCRIPTION_C),
            genl_name: c_str(abi::GENL_NAME_C),
            genl_mcgrp_events: c_str(abi::GENL_MCGRP_EVENTS_C),
            sim_max_instances: abi::SIM_MAX_INSTANCES,
            genl_maxattr: abi::ATTR_MAX,
            genl_pad_attr: abi::ATTR_PAD,
            genl_version: abi::GENL_VERSION,
        };
        let ctx: *const T = &*state;
        // SAFETY: `cfg` lives across the call and its strings are 'static and
        // NUL-terminated (glue.c keeps only those pointers). The table is
        // 'static and built for `T`. `ctx` points into a pinned allocation
        // that `self` owns until `drop` has called `hag_glue_unregister`,
        // after which no callback runs.
        let ret = unsafe { hag_glue_register(ctx.cast(), Vtable::<T>::build(), &cfg) };
        if ret != 0 {
            return Err(Error::from_errno(ret));
        }
        // GVT may call back at once (for the vGPUs it already has), after
        // /dev/hag exists; unloading unregisters from GVT first.
        let gvt = gvt_register();
        Ok(Self { state, gvt })
    }

    /// What the module found of GVT-g at load.
    pub(crate) fn gvt(&self) -> GvtSupport {
        self.gvt
    }
}

impl<T: Driver> Drop for Registration<T> {
    fn drop(&mut self) {
        if let GvtSupport::Registered { .. } = self.gvt {
            // SAFETY: registered in `new`; this runs once. It waits for
            // GVT's calls in flight, so none sees the state after this.
            unsafe { hag_gvt_unregister() };
            GVT_REGISTERED.store(false, Ordering::Release);
        }
        // SAFETY: `new` registered successfully (a `Registration` exists
        // only then), and this runs once.
        unsafe { hag_glue_unregister() };
        // `self.state` is freed after this, with no interface left to
        // reach it.
        let _ = &self.state;
    }
}

/// Recovers the driver from the context pointer glue.c passes back.
///
/// # Safety
///
/// `ctx` must be the pointer a `Registration<T>` gave to
/// `hag_glue_register` (with the table built for this `T`), and the call
/// must happen while registered (glue.c only calls back then).
unsafe fn state<'a, T: Driver>(ctx: *const c_void) -> &'a T {
    // SAFETY: per this function's contract, `ctx` points to the pinned `T`
    // owned by the live `Registration<T>`.
    unsafe { &*ctx.cast::<T>() }
}

/// `/dev/hag` was opened: its state goes into `*opened` (the file's
/// `private_data`).
extern "C" fn open<T: Driver>(ctx: *const c_void, opened: *mut *const c_void) -> c_int {
    // SAFETY: called by glue.c's file operations, which exist only while
    // registered, with the registered context.
    let state = unsafe { state::<T>(ctx) };
    match state.open() {
        Ok(file) => {
            // SAFETY: glue.c passes a pointer to its local, valid for
            // writes; it stores the value in the file's private_data, which
            // `ioctl` borrows and `release` takes back.
            unsafe { opened.write(file.into_foreign()) };
            0
        }
        Err(e) => e.to_errno(),
    }
}

/// The `/dev/hag` state of an open file, borrowed for a call on it.
///
/// # Safety
///
/// `opened` must be what `open::<T>` stored for the file, and the file not
/// yet released (VFS does not release a file during a call on it).
unsafe fn opened<'a, T: Driver>(opened: *const c_void) -> Pin<&'a T::Opened> {
    // SAFETY: per this function's contract.
    unsafe { <Pin<KBox<T::Opened>> as ForeignOwnable>::borrow(opened) }
}

/// `/dev/hag` ioctl.
extern "C" fn ioctl<T: Driver>(ctx: *const c_void, opened: *const c_void, cmd: c_uint, arg: c_ulong) -> c_long {
    // SAFETY: called by glue.c's file operations while registered.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes the file's private_data during an ioctl on it.
    let file = unsafe { self::opened::<T>(opened) };
    match state.ioctl(file.get_ref(), cmd, arg as usize) {
        Ok(()) => 0,
        Err(e) => e.to_errno() as c_long,
    }
}

/// `/dev/hag` file released (closed, or its process died): what its opener
/// held goes.
extern "C" fn release<T: Driver>(ctx: *const c_void, opened: *const c_void) {
    // SAFETY: called by glue.c's file operations while registered.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes the file's private_data, which `open::<T>`
    // stored, once, at the file's release: ownership comes back here.
    let file = unsafe { <Pin<KBox<T::Opened>> as ForeignOwnable>::from_foreign(opened) };
    state.release(file);
}

/// The vGPU of a VFIO callback, borrowed for the call.
///
/// # Safety
///
/// `rs` must be a reference `vgpu_probe::<T>` or `gvt_vgpu_added::<T>`
/// handed out and not yet taken back (`vgpu_put::<T>`,
/// `gvt_vgpu_removed::<T>`): glue.c keeps it in the device and calls back
/// with it only in between.
unsafe fn vgpu<'a, T: Driver>(rs: *const c_void) -> ArcBorrow<'a, T::Vgpu> {
    // SAFETY: per this function's contract.
    unsafe { <Arc<T::Vgpu> as ForeignOwnable>::borrow(rs) }
}

/// mdev probe: a vGPU was created through sysfs. Its reference goes into
/// `*rs` (`struct hag_vgpu`'s).
extern "C" fn vgpu_probe<T: Driver>(
    ctx: *const c_void,
    uuid: *const u8,
    vgpu: *mut CVgpu,
    rs: *mut *const c_void,
) -> c_int {
    // SAFETY: called by glue.c's mdev probe while registered.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes the mdev's `guid_t` bytes, 16 bytes long and
    // valid for the call.
    let guid: [u8; 16] = unsafe { ptr::read(uuid.cast::<[u8; 16]>()) };
    let handle = VgpuHandle::new(vgpu);
    match state.vgpu_probe(abi::uuid_from_guid(guid), handle) {
        Ok(device) => {
            // SAFETY: `rs` points to the field of glue.c's vGPU struct,
            // valid for writes; glue.c passes it back until `vgpu_put`.
            unsafe { rs.write(device.into_foreign()) };
            0
        }
        Err(e) => e.to_errno(),
    }
}

/// mdev remove, or a failed probe after `vgpu_probe` succeeded.
extern "C" fn vgpu_remove<T: Driver>(ctx: *const c_void, rs: *const c_void) {
    // SAFETY: called by glue.c's mdev remove while registered.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes the reference `vgpu_probe` gave, before its put.
    state.vgpu_remove(&*unsafe { vgpu::<T>(rs) });
}

/// The end of a remove: glue.c no longer reaches the vGPU (no VFIO
/// access, its work item cancelled), and gives its reference back.
extern "C" fn vgpu_put<T: Driver>(_ctx: *const c_void, rs: *const c_void) {
    // SAFETY: glue.c passes the reference `vgpu_probe` gave, once, after
    // its last use: ownership comes back here.
    drop(unsafe { <Arc<T::Vgpu> as ForeignOwnable>::from_foreign(rs) });
}

/// A VMM opened or closed the vGPU's VFIO device.
extern "C" fn vgpu_open<T: Driver>(ctx: *const c_void, rs: *const c_void, open: bool) {
    // SAFETY: called by glue.c's VFIO device ops while registered.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes the device's reference (see `vgpu`).
    state.vgpu_open(&*unsafe { vgpu::<T>(rs) }, open);
}

/// A VMM read or wrote a VFIO region of the vGPU (`pos` encodes the region).
extern "C" fn vfio_rw<T: Driver>(
    ctx: *const c_void,
    rs: *const c_void,
    buf: *mut u8,
    count: usize,
    pos: u64,
    write: bool,
) -> c_long {
    // SAFETY: called by glue.c's VFIO device ops while registered.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes the device's reference (see `vgpu`).
    let vgpu = unsafe { vgpu::<T>(rs) };
    let user = UserSlice::new(buf as usize, count);
    match state.region_rw(&*vgpu, user, count, pos, write) {
        Ok(done) => c_long::try_from(done).unwrap_or(c_long::MAX),
        Err(e) => e.to_errno() as c_long,
    }
}

/// A VMM issued an ioctl on the vGPU's VFIO device fd.
extern "C" fn vfio_ioctl<T: Driver>(ctx: *const c_void, rs: *const c_void, cmd: c_uint, arg: c_ulong) -> c_long {
    // SAFETY: called by glue.c's VFIO device ops while registered.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes the device's reference (see `vgpu`).
    let vgpu = unsafe { vgpu::<T>(rs) };
    match state.device_ioctl(&*vgpu, cmd, arg as usize) {
        Ok(ret) => ret,
        Err(e) => e.to_errno() as c_long,
    }
}

/// The vGPU's delayed work ran: an engine slice and the watchdog.
extern "C" fn vgpu_tick<T: Driver>(ctx: *const c_void, rs: *const c_void) {
    // SAFETY: glue.c cancels the work before the vGPU's reference is put
    // (and the state goes away), so this runs while registered with it.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: as above.
    state.tick(&*unsafe { vgpu::<T>(rs) });
}

/// VFIO DMA logging started on the vGPU over the VMM's ranges (glue.c
/// merged them to at most `HAG_LOG_MAX_RANGES`).
extern "C" fn dma_log_start<T: Driver>(
    ctx: *const c_void,
    rs: *const c_void,
    ranges: *const dirty::Range,
    count: u32,
) -> c_int {
    // SAFETY: called by glue.c's VFIO log ops while registered.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes the device's reference (see `vgpu`).
    let vgpu = unsafe { vgpu::<T>(rs) };
    if ranges.is_null() || count as usize > dirty::MAX_SPANS {
        return EINVAL.to_errno();
    }
    // SAFETY: glue.c passes `count` initialised `struct hag_log_range`s
    // (the layout of `dirty::Range`) in an array on its stack that outlives
    // this call; `count` is capped just above.
    let ranges = unsafe { core::slice::from_raw_parts(ranges, count as usize) };
    match state.dma_log_start(&*vgpu, ranges) {
        Ok(()) => 0,
        Err(e) => e.to_errno(),
    }
}

/// VFIO DMA logging stopped.
extern "C" fn dma_log_stop<T: Driver>(ctx: *const c_void, rs: *const c_void) -> c_int {
    // SAFETY: called by glue.c's VFIO log ops while registered.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes the device's reference (see `vgpu`).
    match state.dma_log_stop(&*unsafe { vgpu::<T>(rs) }) {
        Ok(()) => 0,
        Err(e) => e.to_errno(),
    }
}

/// VFIO asks for the dirty pages in `[iova, iova + length)`, to be set in
/// its `struct iova_bitmap` and cleared here.
extern "C" fn dma_log_report<T: Driver>(
    ctx: *const c_void,
    rs: *const c_void,
    iova: u64,
    length: u64,
    dirty: *mut c_void,
) -> c_int {
    // SAFETY: called by glue.c's VFIO log ops while registered.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes the device's reference (see `vgpu`).
    let vgpu = unsafe { vgpu::<T>(rs) };
    let mut report = |page_gpa: u64| {
        // SAFETY: `dirty` is the iova_bitmap VFIO passed for this call,
        // valid until we return; iova_bitmap_set ignores pages outside it.
        unsafe { hag_glue_iova_bitmap_set(dirty, page_gpa, abi::DIRTY_PAGE_SIZE) }
    };
    match state.dma_log_report(&*vgpu, iova, length, &mut report) {
        Ok(()) => 0,
        Err(e) => e.to_errno(),
    }
}

/// The VFIO device of a migration callback: asks VFIO's core for the next
/// arc of a path. Lives only for the callback.
pub(crate) struct VfioDeviceRef<'a> {
    vdev: *mut c_void,
    _callback: core::marker::PhantomData<&'a ()>,
}

impl VfioDeviceRef<'_> {
    /// The next state on VFIO's path from `cur` to `target`.
    pub(crate) fn next_state(&self, cur: u32, target: u32) -> Result<u32> {
        let mut next = 0;
        // SAFETY: `vdev` is the device VFIO passed to the migration callback
        // this value lives in; `next` is valid for writes.
        check(unsafe { hag_glue_mig_next_state(self.vdev, cur, target, &mut next) })?;
        Ok(next)
    }
}

/// A reference to an open file, put when dropped unless handed to VFIO.
pub(crate) struct File {
    filp: *mut c_void,
}

// SAFETY: a file reference may be put from any task.
unsafe impl Send for File {}

impl File {
    /// Gives the reference to C (VFIO installs it in the VMM's fd table).
    fn into_raw(self) -> *mut c_void {
        core::mem::ManuallyDrop::new(self).filp
    }
}

impl Drop for File {
    fn drop(&mut self) {
        // SAFETY: `self` owns one reference to the file.
        unsafe { hag_glue_fput(self.filp) };
    }
}

/// A VFIO migration data file whose contents are `contents`, for the VMM
/// to read (or, if `write`, to write); its release drops `contents`.
pub(crate) fn mig_file<T: Driver>(contents: Arc<T::MigFile>, write: bool) -> Result<File> {
    let migf = contents.into_foreign();
    let mut filp = ptr::null_mut();
    // SAFETY: `migf` is an `Arc<T::MigFile>` in foreign form; glue.c keeps
    // it in the new file's private_data and passes it only to
    // `mig_file_{read,write}::<T>`, which borrow it, and, at the file's
    // release, to `mig_file_release::<T>`, which takes it back. `filp` is
    // valid for writes.
    let ret = unsafe { hag_glue_mig_file(migf, write, &mut filp) };
    if ret != 0 {
        // SAFETY: no file was made: the reference is still ours.
        drop(unsafe { <Arc<T::MigFile> as ForeignOwnable>::from_foreign(migf) });
        return Err(Error::from_errno(ret));
    }
    Ok(File { filp })
}

/// VFIO migration: the device moves to `new_state` (`enum
/// vfio_device_mig_state`); the file the last arc opened goes into `*filp`.
extern "C" fn mig_set_state<T: Driver>(
    ctx: *const c_void,
    rs: *const c_void,
    vdev: *mut c_void,
    new_state: u32,
    filp: *mut *mut c_void,
) -> c_int {
    // SAFETY: called by glue.c's VFIO migration ops while registered.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes the device's reference (see `vgpu`).
    let vgpu = unsafe { vgpu::<T>(rs) };
    let vdev = VfioDeviceRef { vdev, _callback: core::marker::PhantomData };
    match state.mig_set_state(&*vgpu, &vdev, new_state) {
        Ok(file) => {
            if let Some(file) = file {
                // SAFETY: glue.c passes a pointer to its local, valid for
                // writes; it returns the reference to VFIO.
                unsafe { filp.write(file.into_raw()) };
            }
            0
        }
        Err(e) => e.to_errno(),
    }
}

/// VFIO migration: the device's state.
extern "C" fn mig_get_state<T: Driver>(ctx: *const c_void, rs: *const c_void) -> u32 {
    // SAFETY: called by glue.c's VFIO migration ops while registered.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes the device's reference (see `vgpu`).
    state.mig_state(&*unsafe { vgpu::<T>(rs) })
}

/// A size for glue.c, or a negative errno.
fn size_or_errno(size: Result<usize>) -> c_long {
    match size {
        Ok(bytes) => c_long::try_from(bytes).unwrap_or(-c_long::from(EFBIG.to_errno().abs())),
        Err(e) => c_long::from(e.to_errno()),
    }
}

/// VFIO migration: bytes of the vGPU's snapshot (the STOP_COPY file's).
extern "C" fn mig_data_bytes<T: Driver>(ctx: *const c_void, rs: *const c_void) -> c_long {
    // SAFETY: called by glue.c's VFIO migration ops while registered.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes the device's reference (see `vgpu`).
    size_or_errno(state.mig_data_bytes(&*unsafe { vgpu::<T>(rs) }))
}

/// A GVT-g device reset: migration back to RUNNING, no data session.
extern "C" fn mig_reset<T: Driver>(ctx: *const c_void, rs: *const c_void) {
    // SAFETY: called by glue.c's GVT trampolines while registered.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes the device's reference (see `vgpu`).
    state.mig_reset(&*unsafe { vgpu::<T>(rs) });
}

/// The contents of a migration data file, borrowed for a call on it.
///
/// # Safety
///
/// `migf` must be the private_data `mig_file::<T>` gave the file, and the
/// file not yet released.
unsafe fn mig_contents<'a, T: Driver>(migf: *const c_void) -> ArcBorrow<'a, T::MigFile> {
    // SAFETY: per this function's contract.
    unsafe { <Arc<T::MigFile> as ForeignOwnable>::borrow(migf) }
}

/// The VMM reads a migration data file (a stream: no position).
extern "C" fn mig_file_read<T: Driver>(ctx: *const c_void, migf: *const c_void, buf: *mut u8, len: usize) -> c_long {
    // SAFETY: the file holds a reference on the module, which stays
    // registered while it is open.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes the file's private_data during a read of it.
    let contents = unsafe { mig_contents::<T>(migf) };
    size_or_errno(state.mig_file_read(&*contents, UserSlice::new(buf as usize, len), len))
}

/// The VMM writes a migration data file.
extern "C" fn mig_file_write<T: Driver>(ctx: *const c_void, migf: *const c_void, buf: *const u8, len: usize) -> c_long {
    // SAFETY: as in `mig_file_read`.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes the file's private_data during a write to it.
    let contents = unsafe { mig_contents::<T>(migf) };
    size_or_errno(state.mig_file_write(&*contents, UserSlice::new(buf as usize, len), len))
}

/// A migration data file was released: its contents' reference comes back.
extern "C" fn mig_file_release<T: Driver>(_ctx: *const c_void, migf: *const c_void) {
    // SAFETY: glue.c passes the private_data `mig_file::<T>` gave the file,
    // once, at its release.
    drop(unsafe { <Arc<T::MigFile> as ForeignOwnable>::from_foreign(migf) });
}

/// The C side of one vGPU: DMA to its VM's memory and its work item.
///
/// The C object lives from probe until glue.c's remove has called
/// the table's `vgpu_remove` (after stopping VFIO access and cancelling the
/// work), but `Arc<Vgpu>` clones may outlive that (a quiesce holds one for
/// up to a minute, any `/dev/hag` ioctl one across its user copies). So the
/// pointer is cleared at remove ([`Self::forget`]), with the vGPU's mutex
/// held, and every use checks it with that mutex held: a use either runs
/// before the remove finishes with the object, or finds nothing to use.
/// The logic takes the vGPU's mutex only through a lock that checks
/// [`Self::is_live`] first, so a clone that outlives the remove reaches
/// neither the C object nor the device model (`ENODEV`).
pub(crate) struct VgpuHandle {
    vgpu: AtomicPtr<CVgpu>,
}

impl VgpuHandle {
    fn new(vgpu: *mut CVgpu) -> Self {
        Self { vgpu: AtomicPtr::new(vgpu) }
    }

    /// The C object, unless removed. The caller holds the vGPU's mutex
    /// across its use of the pointer, which [`Self::forget`] also holds.
    fn live(&self) -> Result<*mut CVgpu> {
        let vgpu = self.vgpu.load(Ordering::Acquire);
        if vgpu.is_null() {
            Err(ENODEV)
        } else {
            Ok(vgpu)
        }
    }

    /// Whether the vGPU is still there (not yet removed). With the vGPU's
    /// mutex held the answer stays true until it is released.
    pub(crate) fn is_live(&self) -> bool {
        self.live().is_ok()
    }

    /// The vGPU is being removed: no use reaches the C object from now on.
    /// Called with the vGPU's mutex held.
    pub(crate) fn forget(&self) {
        self.vgpu.store(ptr::null_mut(), Ordering::Release);
    }
}

/// What a simulated vGPU's device model reaches outside itself: its VM's
/// memory (VFIO DMA) and its work item. Only the vGPU's lock
/// ([`crate::vgpu::Vgpu::lock`]) makes one, for a use under the mutex it
/// holds, the mutex [`VgpuHandle::forget`] also holds: so a use either runs
/// before a remove finishes with the C object or finds it gone (`ENODEV`).
/// (`Vgpu`'s handle is private to the vGPU table's module, so nothing else
/// can make one.)
pub(crate) struct VgpuIo<'a> {
    handle: &'a VgpuHandle,
}

impl<'a> VgpuIo<'a> {
    /// For `handle`'s vGPU, whose mutex the caller holds for as long as
    /// this lives.
    pub(crate) fn new(handle: &'a VgpuHandle) -> Self {
        Self { handle }
    }

    /// Reads guest memory at guest physical `gpa` through the VM's VFIO
    /// DMA mappings. Fails (`EINVAL`, `EFAULT`) if the range is not mapped,
    /// `ENODEV` once removed. Only while the VFIO device is open: the device
    /// model checks.
    pub(crate) fn dma_read(&self, gpa: u64, out: &mut [u8]) -> Result {
        let vgpu = self.handle.live()?;
        // SAFETY: `vgpu` is live (not yet forgotten, and the mutex held
        // while `self` lives keeps it so for the call); `out` is valid for
        // writes of its length for the duration of the call.
        let ret =
            unsafe { hag_glue_dma_rw(vgpu, gpa, out.as_mut_ptr().cast(), out.len() as u64, false) };
        check(ret)
    }

    /// Writes guest memory; as [`Self::dma_read`].
    pub(crate) fn dma_write(&self, gpa: u64, data: &[u8]) -> Result {
        let vgpu = self.handle.live()?;
        // SAFETY: as in `dma_read`; with `write` set, vfio_dma_rw only reads
        // `data`.
        let ret = unsafe {
            hag_glue_dma_rw(vgpu, gpa, data.as_ptr().cast_mut().cast(), data.len() as u64, true)
        };
        check(ret)
    }

    /// Schedules the vGPU's tick in `delay_ms` (now, if 0); an already
    /// scheduled tick is moved. Nothing once removed.
    pub(crate) fn kick(&self, delay_ms: u32) {
        let Ok(vgpu) = self.handle.live() else { return };
        // SAFETY: `vgpu` is live (as in `dma_read`) and its work was
        // initialised at probe.
        unsafe { hag_glue_kick(vgpu, delay_ms) };
    }
}

/// The module parameter `allow_hang_injection`.
pub(crate) fn hang_injection_allowed() -> bool {
    // SAFETY: reads a module parameter; no preconditions.
    unsafe { hag_glue_hang_injection_allowed() }
}

/// The test-only module parameter `withhold_gpu_dirty`.
pub(crate) fn gpu_dirty_withheld() -> bool {
    // SAFETY: reads a module parameter; no preconditions.
    unsafe { hag_glue_gpu_dirty_withheld() }
}

/// The test-only module parameter `corrupt_mig_data`: a byte of every
/// VFIO migration snapshot this host hands out is flipped.
pub(crate) fn mig_data_corrupted() -> bool {
    // SAFETY: reads a module parameter; no preconditions.
    unsafe { hag_glue_mig_data_corrupted() }
}

/// The test-only module parameter `test_hold_vgpu_ms` (at most 10 s).
pub(crate) fn test_hold_vgpu_ms() -> u32 {
    // SAFETY: reads a module parameter; no preconditions.
    unsafe { hag_glue_test_hold_vgpu_ms() }
}

/// Sleeps (process context only).
pub(crate) fn msleep(ms: u32) {
    // SAFETY: the callers are ioctls, which run in process context.
    unsafe { hag_glue_msleep(ms) }
}

/// Whether the calling task was killed (SIGKILL, or a fatal signal): a
/// wait in its syscall must end so that it can exit.
pub(crate) fn fatal_signal_pending() -> bool {
    // SAFETY: reads the current task's pending signals; the callers run
    // in process context (an ioctl), so `current` is their task.
    unsafe { hag_glue_fatal_signal_pending() }
}

/// Lets other tasks run if this one has run long (process context only;
/// a sleeping lock such as the vGPU's mutex may be held).
pub(crate) fn cond_resched() {
    // SAFETY: every caller runs in process context (an ioctl, a VFIO
    // access or the vGPU's work item) and holds no spinlock.
    unsafe { hag_glue_cond_resched() }
}

/// A reference to an eventfd a VMM gave for an interrupt.
pub(crate) struct EventFd {
    ctx: *mut CEventfd,
}

// SAFETY: eventfd contexts are reference counted and signalled from any
// context by design.
unsafe impl Send for EventFd {}
// SAFETY: as above.
unsafe impl Sync for EventFd {}

impl EventFd {
    /// Takes a reference to the eventfd behind file descriptor `fd` of the
    /// calling process.
    pub(crate) fn from_fd(fd: i32) -> Result<Self> {
        // SAFETY: any fd value is accepted; a bad one gives NULL.
        let ctx = unsafe { hag_glue_eventfd_get(fd) };
        if ctx.is_null() {
            return Err(EBADF);
        }
        Ok(Self { ctx })
    }

    /// Adds 1 to the eventfd's counter, waking its reader.
    pub(crate) fn signal(&self) {
        // SAFETY: `self.ctx` holds a reference until `drop`.
        unsafe { hag_glue_eventfd_signal(self.ctx) };
    }
}

impl Drop for EventFd {
    fn drop(&mut self) {
        // SAFETY: drops the reference `from_fd` took.
        unsafe { hag_glue_eventfd_put(self.ctx) };
    }
}

// The ABI structures cross to and from userspace as raw bytes.
//
// SAFETY (all of them): each is `#[repr(C)]`, made only of integers and integer
// arrays, with explicit padding fields (hag_abi's layout tests fix their
// sizes), so every byte pattern is a valid value and no byte is uninitialised.
unsafe impl FromBytes for abi::HagVgpuList {}
// SAFETY: see above.
unsafe impl AsBytes for abi::HagVgpuList {}
// SAFETY: see above.
unsafe impl AsBytes for abi::HagVersion {}
// SAFETY: see above.
unsafe impl AsBytes for abi::HagVgpuInfo {}
// SAFETY: see above.
unsafe impl FromBytes for abi::HagVgpuRef {}
// SAFETY: see above.
unsafe impl FromBytes for abi::HagDirtyStart {}
// SAFETY: see above.
unsafe impl FromBytes for abi::HagDirtyRead {}
// SAFETY: see above.
unsafe impl AsBytes for abi::HagDirtyRead {}
// SAFETY: see above.
unsafe impl FromBytes for abi::HagVgpuStats {}
// SAFETY: see above.
unsafe impl AsBytes for abi::HagVgpuStats {}
// SAFETY: see above.
unsafe impl FromBytes for abi::HagWatchdog {}
// SAFETY: see above.
unsafe impl FromBytes for abi::HagQuiesce {}
// SAFETY: see above.
unsafe impl FromBytes for abi::HagContextBuf {}
// SAFETY: see above.
unsafe impl AsBytes for abi::HagContextBuf {}
/// VFIO's uapi structures (`include/uapi/linux/vfio.h`) that the VFIO
/// device ioctls read and write.
pub(crate) mod uapi {
    /// `struct vfio_device_info` up to `num_irqs` (the part every kernel has).
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    pub(crate) struct DeviceInfo {
        pub(crate) argsz: u32,
        pub(crate) flags: u32,
        pub(crate) num_regions: u32,
        pub(crate) num_irqs: u32,
    }

    /// `struct vfio_region_info`.
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    pub(crate) struct RegionInfo {
        pub(crate) argsz: u32,
        pub(crate) flags: u32,
        pub(crate) index: u32,
        pub(crate) cap_offset: u32,
        pub(crate) size: u64,
        pub(crate) offset: u64,
    }

    /// `struct vfio_irq_info`.
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    pub(crate) struct IrqInfo {
        pub(crate) argsz: u32,
        pub(crate) flags: u32,
        pub(crate) index: u32,
        pub(crate) count: u32,
    }

    /// `struct vfio_irq_set` without its trailing `data[]`.
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    pub(crate) struct IrqSet {
        pub(crate) argsz: u32,
        pub(crate) flags: u32,
        pub(crate) index: u32,
        pub(crate) start: u32,
        pub(crate) count: u32,
    }
}

// SAFETY: see above; these mirror VFIO's uapi structures, all u32 and u64
// fields with no padding.
unsafe impl FromBytes for uapi::DeviceInfo {}
// SAFETY: see above.
unsafe impl AsBytes for uapi::DeviceInfo {}
// SAFETY: see above.
unsafe impl FromBytes for uapi::RegionInfo {}
// SAFETY: see above.
unsafe impl AsBytes for uapi::RegionInfo {}
// SAFETY: see above.
unsafe impl FromBytes for uapi::IrqInfo {}
// SAFETY: see above.
unsafe impl AsBytes for uapi::IrqInfo {}
// SAFETY: see above.
unsafe impl FromBytes for uapi::IrqSet {}

/// One generic netlink message of the `hag` family, multicast to the
/// events group by [`EventMessage::send`]; dropped unsent, it is freed.
pub(crate) struct EventMessage {
    msg: GlueMsg,
}

fn check(ret: c_int) -> Result {
    if ret == 0 {
        Ok(())
    } else {
        Err(Error::from_errno(ret))
    }
}

impl EventMessage {
    /// Starts a message with genetlink command `cmd`.
    pub(crate) fn new(cmd: u8) -> Result<Self> {
        let mut msg = GlueMsg {
            skb: ptr::null_mut(),
            hdr: ptr::null_mut(),
        };
        // SAFETY: `msg` is valid for writes; on success glue.c stored an
        // skb it allocated, which `Self` now owns.
        check(unsafe { hag_glue_msg_new(&mut msg, cmd) })?;
        Ok(Self { msg })
    }

    /// Appends a u32 attribute.
    pub(crate) fn put_u32(&mut self, attr: u16, value: u32) -> Result {
        // SAFETY: `self.msg` holds a live skb from `hag_glue_msg_new`.
        check(unsafe { hag_glue_msg_put_u32(&mut self.msg, attr, value) })
    }

    /// Appends a u64 attribute, 64-bit aligned.
    pub(crate) fn put_u64(&mut self, attr: u16, value: u64) -> Result {
        // SAFETY: as in `put_u32`.
        check(unsafe { hag_glue_msg_put_u64(&mut self.msg, attr, value) })
    }

    /// Appends a binary attribute.
    pub(crate) fn put_bytes(&mut self, attr: u16, data: &[u8]) -> Result {
        let len = u32::try_from(data.len()).map_err(|_| EINVAL)?;
        // SAFETY: as in `put_u32`; `data` is valid for `len` bytes and
        // nla_put copies it.
        check(unsafe { hag_glue_msg_put_bytes(&mut self.msg, attr, data.as_ptr().cast(), len) })
    }

    /// Multicasts the message to the events group. Nobody listening is
    /// not an error: events are notifications.
    pub(crate) fn send(self) -> Result {
        let mut this = core::mem::ManuallyDrop::new(self);
        // SAFETY: the skb is live and owned by `this`; glue.c's multicast
        // consumes it whatever the outcome, so it is not freed again (the
        // `ManuallyDrop` skips `Drop`).
        let ret = unsafe { hag_glue_msg_multicast(&mut this.msg) };
        if ret == ESRCH.to_errno() {
            return Ok(());
        }
        check(ret)
    }
}

impl Drop for EventMessage {
    fn drop(&mut self) {
        // SAFETY: the skb is live (not sent: `send` skips this) and owned
        // by `self`.
        unsafe { hag_glue_msg_cancel(&mut self.msg) };
    }
}

// ---- GVT-g: the hook interface of the i915 patch, flattened by glue.c
// (/work/notes/gvt-interface.md). glue.c builds the real functions when the
// kernel has the patch and stubs (-ENODEV, 0) otherwise.

/// Mirrors `struct hag_gvt_wl` in glue.h: one workload GVT scanned.
#[repr(C)]
pub(crate) struct CGvtWl {
    cookie: u64,
    engine: u32,
    incomplete: u32,
    ring: *const u32,
    ring_bytes: u32,
    nr_bbs: u32,
    ring_gma: u64,
    hwsp_gma: u64,
    bbs: *const CGvtBb,
    indirect_ctx: *const u32,
    indirect_ctx_bytes: u32,
    pad: u32,
    indirect_ctx_gma: u64,
}

/// Mirrors `struct hag_gvt_bb` in glue.h: one batch buffer GVT shadowed.
#[repr(C)]
pub(crate) struct CGvtBb {
    gma: u64,
    va: *const c_void,
    size: u32,
    ppgtt: u32,
}

extern "C" {
    fn hag_gvt_compiled_in() -> bool;
    fn hag_gvt_register() -> c_int;
    fn hag_gvt_unregister();
    fn hag_gvt_nr_devices() -> c_uint;
    fn hag_gvt_gma_to_gfn(wl: *const c_void, gma: u64, ppgtt: u32, gfn: *mut u64) -> c_int;
    fn hag_gvt_ggtt_size(vgpu: *mut c_void) -> u64;
    fn hag_gvt_wait_idle(vgpu: *mut c_void) -> c_int;
    fn hag_gvt_mark_aperture(vgpu: *mut c_void);
    fn hag_gvt_part_size(vgpu: *mut c_void, part: u32) -> c_long;
    fn hag_gvt_save_part(vgpu: *mut c_void, part: u32, buf: *mut c_void, len: usize) -> c_int;
    fn hag_gvt_check_part(vgpu: *mut c_void, part: u32, buf: *const c_void, len: usize) -> c_int;
    fn hag_gvt_restore_part(vgpu: *mut c_void, part: u32, buf: *const c_void, len: usize)
        -> c_int;
}

/// Whether hag is registered with GVT-g: set from a successful
/// `hag_gvt_register` until `Registration::drop` has unregistered.
static GVT_REGISTERED: AtomicBool = AtomicBool::new(false);

/// What the module found of GVT-g at load, for the one load line.
#[derive(Clone, Copy)]
pub(crate) enum GvtSupport {
    /// The kernel was built without the i915 patch (or without KVMGT).
    NotCompiledIn,
    /// Registered with GVT, which had this many GVT-g devices.
    Registered { devices: u32 },
    /// Compiled in, but GVT refused the registration (another observer).
    Failed(Error),
}

/// Registers hag's ops with GVT, if the module was built with them.
fn gvt_register() -> GvtSupport {
    // SAFETY: no preconditions.
    if !unsafe { hag_gvt_compiled_in() } {
        return GvtSupport::NotCompiledIn;
    }
    // SAFETY: glue.c is registered (its context and table are set), so the
    // GVT trampolines GVT may call from now on reach the state, until
    // `Registration::drop` unregisters from GVT first.
    let ret = unsafe { hag_gvt_register() };
    if ret != 0 {
        return GvtSupport::Failed(Error::from_errno(ret));
    }
    GVT_REGISTERED.store(true, Ordering::Release);
    // SAFETY: no preconditions.
    let devices = unsafe { hag_gvt_nr_devices() };
    GvtSupport::Registered { devices }
}

/// Whether hag is registered with GVT-g (GVT-g vGPUs are tracked).
pub(crate) fn gvt_active() -> bool {
    GVT_REGISTERED.load(Ordering::Acquire)
}

/// Parts of a GVT-g vGPU's snapshot. Mirrors `enum hag_gvt_part` in glue.h.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u32)]
pub(crate) enum GvtPart {
    Vregs = 0,
    CfgSpace = 1,
    Ggtt = 2,
    Execlist = 3,
}

/// A GVT vGPU as a GVT callback passes it, to build its [`GvtHandle`] from.
pub(crate) struct GvtVgpuPtr(*mut c_void);

/// One workload GVT handed over, as read from GVT's callback.
pub(crate) struct GvtWorkload<'a> {
    /// GVT's scanned copy of the ring slice.
    pub(crate) ring: &'a [u32],
    /// Graphics address of `ring[0]`.
    pub(crate) ring_gma: u64,
    /// Graphics address of the status page.
    pub(crate) hwsp_gma: u64,
    /// The shadowed batch buffers.
    pub(crate) bbs: &'a [handoff::ShadowBb<'a>],
    /// The context's indirect context buffer, if GVT shadowed one.
    pub(crate) indirect_ctx: Option<handoff::IndirectCtx<'a>>,
}

/// GVT's `struct intel_vgpu`, as a pointer that may be sent between threads.
struct CGvtVgpu(*mut c_void);

// SAFETY: GVT's vGPU is a kernel object usable from any thread; hag only
// passes the pointer back to GVT's exported functions.
unsafe impl Send for CGvtVgpu {}

/// GVT's vGPU: valid from `vgpu_added` until `vgpu_removed`, after which
/// [`GvtHandle::forget`] has made every later use fail with `ENODEV`.
#[pin_data]
pub(crate) struct GvtHandle {
    /// The pointer's value, for finding the vGPU a callback names without
    /// taking `live` (held across `wait_idle`, which waits for workloads
    /// whose callbacks look the vGPU up).
    addr: usize,
    /// The pointer, NULL once GVT removed the vGPU. Held across every call
    /// into GVT made outside GVT's own callbacks.
    #[pin]
    live: Mutex<CGvtVgpu>,
}

impl GvtHandle {
    /// The handle of the vGPU a GVT callback passed.
    pub(crate) fn new(vgpu: GvtVgpuPtr) -> impl PinInit<Self> {
        let GvtVgpuPtr(vgpu) = vgpu;
        pin_init!(Self {
            addr: vgpu as usize,
            live <- new_mutex!(CGvtVgpu(vgpu), "hag_gvt_handle"),
        })
    }

    /// Whether this is the vGPU GVT passed as `vgpu`.
    pub(crate) fn is(&self, vgpu: usize) -> bool {
        self.addr == vgpu
    }

    /// Runs `call` with GVT's vGPU pointer, which stays valid until it
    /// returns; `ENODEV` once GVT removed the vGPU.
    fn with_live<R>(&self, call: impl FnOnce(*mut c_void) -> R) -> Result<R> {
        let live = self.live.lock();
        if live.0.is_null() {
            return Err(ENODEV);
        }
        // `forget` cannot run before `live` is released.
        Ok(call(live.0))
    }

    /// Waits until GVT has no workload of the vGPU queued or running
    /// (`intel_gvt_audit_wait_idle`: killable, `EBUSY` after 5 s, `EINTR`
    /// on a fatal signal). GVT deactivates (and so idles) a vGPU before
    /// removing it, so a removal waiting for this returns soon.
    pub(crate) fn wait_idle(&self) -> Result {
        // SAFETY: `with_live` passes a vGPU GVT has not removed.
        check(self.with_live(|vgpu| unsafe { hag_gvt_wait_idle(vgpu) })?)
    }

    /// Has GVT report, through `GvtObserver::gvt_aperture_mapped`, every
    /// guest page the vGPU's mappable GGTT range maps now
    /// (`intel_gvt_audit_mark_aperture`, under GVT's vGPU lock): the
    /// caller holds neither the table's lock nor the vGPU's, which that
    /// callback takes.
    pub(crate) fn mark_aperture(&self) -> Result {
        // SAFETY: `with_live` passes a vGPU GVT has not removed.
        self.with_live(|vgpu| unsafe { hag_gvt_mark_aperture(vgpu) })
    }

    /// Bytes of one part of the vGPU's snapshot.
    pub(crate) fn part_size(&self, part: GvtPart) -> Result<usize> {
        // SAFETY: `with_live` passes a vGPU GVT has not removed.
        let ret = self.with_live(|vgpu| unsafe { hag_gvt_part_size(vgpu, part as u32) })?;
        if ret < 0 {
            return Err(Error::from_errno(c_int::try_from(ret).unwrap_or(-(EINVAL.to_errno()))));
        }
        usize::try_from(ret).map_err(|_| EINVAL)
    }

    /// Saves one part of the snapshot into `out` (of its `part_size`).
    pub(crate) fn save_part(&self, part: GvtPart, out: &mut [u8]) -> Result {
        let (buf, len) = (out.as_mut_ptr().cast::<c_void>(), out.len());
        // SAFETY: a vGPU GVT has not removed; `buf` is valid for writes of
        // `len` bytes for the call.
        check(self.with_live(|vgpu| unsafe { hag_gvt_save_part(vgpu, part as u32, buf, len) })?)
    }

    /// Whether GVT would restore this part: the checks `restore_part`
    /// makes before it changes anything, changing nothing.
    pub(crate) fn check_part(&self, part: GvtPart, bytes: &[u8]) -> Result {
        let (buf, len) = (bytes.as_ptr().cast::<c_void>(), bytes.len());
        // SAFETY: a vGPU GVT has not removed; `buf` is valid for reads of
        // `len` bytes for the call.
        check(self.with_live(|vgpu| unsafe { hag_gvt_check_part(vgpu, part as u32, buf, len) })?)
    }

    /// Restores one part (GVT checks it, and refuses once the vGPU ran).
    pub(crate) fn restore_part(&self, part: GvtPart, bytes: &[u8]) -> Result {
        let (buf, len) = (bytes.as_ptr().cast::<c_void>(), bytes.len());
        // SAFETY: a vGPU GVT has not removed; `buf` is valid for reads of
        // `len` bytes for the call.
        check(self.with_live(|vgpu| unsafe { hag_gvt_restore_part(vgpu, part as u32, buf, len) })?)
    }

    /// GVT removed the vGPU: no call reaches it any more.
    pub(crate) fn forget(&self) {
        self.live.lock().0 = ptr::null_mut();
    }
}

/// Translates through GVT's GTT shadows for the workload being handed
/// over; exists only inside the `gvt_workload` callback.
pub(crate) struct GvtTranslate {
    wl: *const c_void,
}

impl handoff::Translate for GvtTranslate {
    fn gma_to_gfn(&mut self, space: AddressSpace, gma: u64) -> Result<u64, handoff::TranslateFault> {
        let ppgtt = u32::from(space == AddressSpace::Ppgtt);
        let mut gfn = 0u64;
        // SAFETY: `self.wl` is the workload of the callback this value lives
        // in (see the type's docs), as `intel_gvt_audit_gma_to_gfn`
        // requires; `gfn` is valid for writes.
        let ret = unsafe { hag_gvt_gma_to_gfn(self.wl, gma, ppgtt, &mut gfn) };
        if ret == 0 {
            Ok(gfn)
        } else {
            Err(handoff::TranslateFault)
        }
    }
}

/// GVT created a vGPU (or had it when hag registered). The reference to
/// it that kvmgt's VFIO device reaches goes into `*rs`.
extern "C" fn gvt_vgpu_added<T: Driver>(
    ctx: *const c_void,
    vgpu: *mut c_void,
    id: c_uint,
    rs: *mut *const c_void,
) -> c_int {
    // SAFETY: glue.c's GVT trampolines run only while registered with GVT,
    // which is while registered, with the registered context.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: GVT passes a vGPU it has initialised, valid for the call.
    let ggtt_size = unsafe { hag_gvt_ggtt_size(vgpu) };
    match state.gvt_vgpu_added(id, ggtt_size, GvtVgpuPtr(vgpu)) {
        Ok(device) => {
            // SAFETY: `rs` points to the field of glue.c's record of the
            // vGPU, valid for writes; glue.c passes it back until
            // `gvt_vgpu_removed`.
            unsafe { rs.write(device.into_foreign()) };
            0
        }
        Err(e) => {
            pr_warn!("GVT vGPU {}: not tracked (error {}): its writes are not logged\n", id, e.to_errno());
            e.to_errno()
        }
    }
}

/// GVT is destroying a vGPU; `rs` is what `gvt_vgpu_added` gave (NULL if
/// it failed), given back.
extern "C" fn gvt_vgpu_removed<T: Driver>(ctx: *const c_void, vgpu: *mut c_void, rs: *const c_void) {
    // SAFETY: as in `gvt_vgpu_added`.
    let state = unsafe { state::<T>(ctx) };
    let device = (!rs.is_null()).then(|| {
        // SAFETY: a non-NULL `rs` is the reference `gvt_vgpu_added` gave,
        // passed back once, after GVT's last call for the vGPU.
        unsafe { <Arc<T::Vgpu> as ForeignOwnable>::from_foreign(rs) }
    });
    state.gvt_vgpu_removed(vgpu as usize, device);
}

/// GVT scanned and shadowed a workload of `vgpu` (under its vgpu_lock).
/// It cannot fail: GVT's scanner is the gate, hag only logs (see gvt.rs).
extern "C" fn gvt_workload<T: Driver>(ctx: *const c_void, wl: *const c_void, vgpu: *mut c_void, w: *const CGvtWl) {
    // SAFETY: as in `gvt_vgpu_added`.
    let state = unsafe { state::<T>(ctx) };
    // SAFETY: glue.c passes its description of the workload, valid for the
    // call.
    let w = unsafe { &*w };
    let mut translate = GvtTranslate { wl };
    let mut shadows = KVec::new();
    let workload = if w.incomplete != 0 {
        Err("GVT could not hand over all of it")
    } else {
        gvt_dwords(w.ring, w.ring_bytes, "the ring slice is not whole dwords").and_then(|ring| {
            gvt_shadows(w.bbs, w.nr_bbs, &mut shadows)?;
            let indirect_ctx = if w.indirect_ctx.is_null() {
                None
            } else {
                let dwords = gvt_dwords(w.indirect_ctx, w.indirect_ctx_bytes, "the indirect context is not whole dwords")?;
                Some(handoff::IndirectCtx { gma: w.indirect_ctx_gma, dwords })
            };
            Ok(GvtWorkload { ring, ring_gma: w.ring_gma, hwsp_gma: w.hwsp_gma, bbs: &shadows, indirect_ctx })
        })
    };
    state.gvt_workload(vgpu as usize, w.engine, w.cookie, workload, &mut translate);
}

/// A workload handed over is done (completed, or dropped unrun).
extern "C" fn gvt_workload_done<T: Driver>(ctx: *const c_void, vgpu: *mut c_void, cookie: u64, changed: bool) {
    // SAFETY: as in `gvt_vgpu_added`.
    unsafe { state::<T>(ctx) }.gvt_workload_done(vgpu as usize, cookie, changed);
}

/// Whether GVT should read a workload's PPGTT batches back at its end.
extern "C" fn gvt_batch_check<T: Driver>(ctx: *const c_void, vgpu: *mut c_void) -> bool {
    // SAFETY: as in `gvt_vgpu_added`.
    unsafe { state::<T>(ctx) }.gvt_batch_check(vgpu as usize)
}

/// A GTT entry now maps guest pages.
extern "C" fn gvt_gtt_mapped<T: Driver>(ctx: *const c_void, vgpu: *mut c_void, gfn: u64, nr: u64) {
    // SAFETY: as in `gvt_vgpu_added`.
    unsafe { state::<T>(ctx) }.gvt_gtt_mapped(vgpu as usize, gfn, nr);
}

/// The aperture maps, or mapped, guest pages.
extern "C" fn gvt_aperture_mapped<T: Driver>(ctx: *const c_void, vgpu: *mut c_void, gfn: u64, nr: u64) {
    // SAFETY: as in `gvt_vgpu_added`.
    unsafe { state::<T>(ctx) }.gvt_aperture_mapped(vgpu as usize, gfn, nr);
}

/// GVT wrote guest memory itself.
extern "C" fn gvt_guest_written<T: Driver>(ctx: *const c_void, vgpu: *mut c_void, gpa: u64, len: u64) {
    // SAFETY: as in `gvt_vgpu_added`.
    unsafe { state::<T>(ctx) }.gvt_guest_written(vgpu as usize, gpa, len);
}

/// GVT mapped or is unmapping guest pages for the GPU.
extern "C" fn gvt_pages_mapped<T: Driver>(ctx: *const c_void, vgpu: *mut c_void, gfn: u64, nr: u64, map: bool) {
    // SAFETY: as in `gvt_vgpu_added`.
    unsafe { state::<T>(ctx) }.gvt_pages_mapped(vgpu as usize, gfn, nr, map);
}

/// A command stream of a workload callback (the ring slice, the indirect
/// context); `not_dwords` if it is not whole dwords.
fn gvt_dwords<'a>(
    dwords: *const u32,
    bytes: u32,
    not_dwords: &'static str,
) -> core::result::Result<&'a [u32], &'static str> {
    if bytes % 4 != 0 || (dwords.is_null() && bytes != 0) {
        return Err(not_dwords);
    }
    if bytes == 0 {
        return Ok(&[]);
    }
    // SAFETY: glue.c passes GVT's scanned copy of the stream, `bytes` long
    // and dword aligned, which GVT neither frees nor changes while it holds
    // vgpu_lock across the callback; the slice does not outlive the
    // callback.
    Ok(unsafe { core::slice::from_raw_parts(dwords, bytes as usize / 4) })
}

/// The shadowed batch buffers of a workload callback, into `out`.
fn gvt_shadows<'a>(
    bbs: *const CGvtBb,
    nr_bbs: u32,
    out: &mut KVec<handoff::ShadowBb<'a>>,
) -> core::result::Result<(), &'static str> {
    let nr = nr_bbs as usize;
    if nr == 0 {
        return Ok(());
    }
    if nr > handoff::MAX_SHADOWS {
        return Err("more shadowed batch buffers than the hand-off takes");
    }
    if bbs.is_null() {
        return Err("no batch buffer array");
    }
    // SAFETY: glue.c passes its array of `nr_bbs` entries, valid for the
    // callback.
    let cbbs = unsafe { core::slice::from_raw_parts(bbs, nr) };
    out.reserve(nr, GFP_KERNEL).map_err(|_| "out of memory")?;
    for bb in cbbs {
        let bytes: &[u8] = if bb.size == 0 {
            &[]
        } else if bb.va.is_null() {
            return Err("a shadowed batch buffer has no copy");
        } else {
            // SAFETY: `va` is GVT's shadow copy of the batch buffer, `size`
            // bytes, freed only with the workload, after the callback.
            unsafe { core::slice::from_raw_parts(bb.va.cast::<u8>(), bb.size as usize) }
        };
        let space = if bb.ppgtt != 0 {
            AddressSpace::Ppgtt
        } else {
            AddressSpace::Ggtt
        };
        let shadow = handoff::ShadowBb { space, gma: bb.gma, bytes };
        out.push(shadow, GFP_KERNEL).map_err(|_| "out of memory")?;
    }
    Ok(())
}
