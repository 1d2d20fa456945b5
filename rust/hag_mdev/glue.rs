// SPDX-License-Identifier: GPL-2.0-only
//! The only place where hag_mdev's Rust meets C.
//!
//! Rust-for-Linux 6.12 has no abstractions for miscdevice, file operations,
//! generic netlink, mdev or VFIO. `glue.c` holds their static tables and the
//! helpers that are C macros or inline functions; this file declares them,
//! receives their callbacks (`hag_rs_*`) and turns both directions into safe
//! Rust: [`Registration`] owns the registered interfaces and the module
//! [`State`], and [`EventMessage`] builds and sends one netlink message.
//! Every `unsafe` block of the module is in this file.

use core::ffi::{c_char, c_int, c_long, c_uint, c_ulong, c_void};
use core::ptr;

use kernel::prelude::*;
use kernel::types::{AsBytes, FromBytes};
use kernel::uaccess::UserSlice;

use crate::abi;
use crate::sim::vfio;
use crate::State;

/// Mirrors `struct hag_glue_config` in glue.c.
#[repr(C)]
struct GlueConfig {
    misc_name: *const c_char,
    parent_name: *const c_char,
    sim_type_name: *const c_char,
    sim_type_description: *const c_char,
    genl_name: *const c_char,
    genl_mcgrp_events: *const c_char,
    mig_data_bytes: usize,
    mig_max_bytes: usize,
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
    fn hag_glue_msleep(ms: u32);
    fn hag_glue_iova_bitmap_set(dirty: *mut c_void, iova: u64, length: u64);
    fn hag_glue_register(ctx: *const c_void, cfg: *const GlueConfig) -> c_int;
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

/// The registered C interfaces, and the state their callbacks reach.
///
/// Dropping it unregisters everything before the state is freed, so no
/// callback can see freed state.
pub(crate) struct Registration {
    state: Pin<KBox<State>>,
}

impl Registration {
    /// Registers `/dev/hag`, the `hag` netlink family and the mdev parent.
    pub(crate) fn new(state: Pin<KBox<State>>) -> Result<Self> {
        let cfg = GlueConfig {
            misc_name: c_str(abi::DEVICE_NAME_C),
            parent_name: c_str(abi::PARENT_NAME_C),
            sim_type_name: c_str(abi::SIM_TYPE_SYSFS_NAME_C),
            sim_type_description: c_str(SIM_TYPE_DESCRIPTION_C),
            genl_name: c_str(abi::GENL_NAME_C),
            genl_mcgrp_events: c_str(abi::GENL_MCGRP_EVENTS_C),
            mig_data_bytes: crate::sim::SNAPSHOT_BYTES,
            mig_max_bytes: abi::CONTEXT_MAX_BYTES as usize,
            sim_max_instances: abi::SIM_MAX_INSTANCES,
            genl_maxattr: abi::ATTR_MAX,
            genl_pad_attr: abi::ATTR_PAD,
            genl_version: abi::GENL_VERSION,
        };
        let ctx: *const State = &*state;
        // SAFETY: `cfg` lives across the call and its strings are 'static and
        // NUL-terminated (glue.c keeps only those pointers). `ctx` points
        // into a pinned allocation that `self` owns until `drop` has called
        // `hag_glue_unregister`, after which no callback runs.
        let ret = unsafe { hag_glue_register(ctx.cast(), &cfg) };
        if ret != 0 {
            return Err(Error::from_errno(ret));
        }
        Ok(Self { state })
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // SAFETY: `new` registered successfully (a `Registration` exists
        // only then), and this runs once.
        unsafe { hag_glue_unregister() };
        // `self.state` is freed after this, with no interface left to reach it.
        let _ = &self.state;
    }
}

/// Recovers the state from the context pointer glue.c passes back.
///
/// # Safety
///
/// `ctx` must be the pointer given to `hag_glue_register`, and the call must
/// happen while registered (glue.c only calls back then).
unsafe fn state<'a>(ctx: *const c_void) -> &'a State {
    // SAFETY: per this function's contract, `ctx` points to the pinned
    // `State` owned by the live `Registration`.
    unsafe { &*ctx.cast::<State>() }
}

/// `/dev/hag` ioctl.
#[no_mangle]
extern "C" fn hag_rs_ioctl(ctx: *const c_void, cmd: c_uint, arg: c_ulong) -> c_long {
    // SAFETY: called by glue.c's file operations, which exist only while
    // registered, with the registered context.
    let state = unsafe { state(ctx) };
    match crate::control::ioctl(state, cmd, arg as usize) {
        Ok(()) => 0,
        Err(e) => e.to_errno() as c_long,
    }
}

/// mdev probe: a vGPU was created through sysfs.
#[no_mangle]
extern "C" fn hag_rs_vgpu_probe(
    ctx: *const c_void,
    uuid: *const u8,
    vgpu: *mut CVgpu,
    id: *mut u32,
) -> c_int {
    // SAFETY: called by glue.c's mdev probe while registered.
    let state = unsafe { state(ctx) };
    // SAFETY: glue.c passes the mdev's `guid_t` bytes, 16 bytes long and
    // valid for the call.
    let guid: [u8; 16] = unsafe { ptr::read(uuid.cast::<[u8; 16]>()) };
    let handle = VgpuHandle { vgpu };
    match state.vgpu_created(abi::uuid_from_guid(guid), handle) {
        Ok(new_id) => {
            // SAFETY: `id` points to the `u32` field of glue.c's vGPU struct.
            unsafe { id.write(new_id) };
            0
        }
        Err(e) => e.to_errno(),
    }
}

/// mdev remove, or a failed probe after `hag_rs_vgpu_probe` succeeded.
#[no_mangle]
extern "C" fn hag_rs_vgpu_remove(ctx: *const c_void, id: u32) {
    // SAFETY: called by glue.c's mdev remove while registered.
    unsafe { state(ctx) }.vgpu_removed(id);
}

/// A VMM read or wrote a VFIO region of the vGPU (`pos` encodes the region).
#[no_mangle]
extern "C" fn hag_rs_vfio_rw(
    ctx: *const c_void,
    id: u32,
    buf: *mut u8,
    count: usize,
    pos: u64,
    write: bool,
) -> c_long {
    // SAFETY: called by glue.c's VFIO device ops while registered.
    let state = unsafe { state(ctx) };
    let user = UserSlice::new(buf as usize, count);
    match state.vfio_rw(id, user, count, pos, write) {
        Ok(done) => c_long::try_from(done).unwrap_or(c_long::MAX),
        Err(e) => e.to_errno() as c_long,
    }
}

/// A VMM issued an ioctl on the vGPU's VFIO device fd.
#[no_mangle]
extern "C" fn hag_rs_vfio_ioctl(ctx: *const c_void, id: u32, cmd: c_uint, arg: c_ulong) -> c_long {
    // SAFETY: called by glue.c's VFIO device ops while registered.
    let state = unsafe { state(ctx) };
    match state.vfio_ioctl(id, cmd, arg as usize) {
        Ok(ret) => ret,
        Err(e) => e.to_errno() as c_long,
    }
}

/// The vGPU's delayed work ran: an engine slice and the watchdog.
#[no_mangle]
extern "C" fn hag_rs_vgpu_tick(ctx: *const c_void, id: u32) {
    // SAFETY: glue.c cancels the work before the vGPU (and the state)
    // goes away, so this runs while registered.
    unsafe { state(ctx) }.vgpu_tick(id);
}

/// VFIO DMA logging started on the vGPU (glue.c passes the span of the
/// VMM's ranges).
#[no_mangle]
extern "C" fn hag_rs_dma_log_start(ctx: *const c_void, id: u32, iova: u64, length: u64) -> c_int {
    // SAFETY: called by glue.c's VFIO log ops while registered.
    let state = unsafe { state(ctx) };
    match state.dma_log_start(id, iova, length) {
        Ok(()) => 0,
        Err(e) => e.to_errno(),
    }
}

/// VFIO DMA logging stopped.
#[no_mangle]
extern "C" fn hag_rs_dma_log_stop(ctx: *const c_void, id: u32) -> c_int {
    // SAFETY: called by glue.c's VFIO log ops while registered.
    let state = unsafe { state(ctx) };
    match state.dma_log_stop(id) {
        Ok(()) => 0,
        Err(e) => e.to_errno(),
    }
}

/// VFIO asks for the dirty pages in `[iova, iova + length)`, to be set in
/// its `struct iova_bitmap` and cleared here.
#[no_mangle]
extern "C" fn hag_rs_dma_log_report(
    ctx: *const c_void,
    id: u32,
    iova: u64,
    length: u64,
    dirty: *mut c_void,
) -> c_int {
    // SAFETY: called by glue.c's VFIO log ops while registered.
    let state = unsafe { state(ctx) };
    let mut report = |page_gpa: u64| {
        // SAFETY: `dirty` is the iova_bitmap VFIO passed for this call,
        // valid until we return; iova_bitmap_set ignores pages outside it.
        unsafe { hag_glue_iova_bitmap_set(dirty, page_gpa, abi::DIRTY_PAGE_SIZE) }
    };
    match state.dma_log_report(id, iova, length, &mut report) {
        Ok(()) => 0,
        Err(e) => e.to_errno(),
    }
}

/// What glue.c does for a VFIO migration arc once Rust has acted on it.
/// Mirrors `enum hag_mig_action` in glue.h.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(i32)]
pub(crate) enum MigAction {
    /// Nothing more.
    None = 0,
    /// Take the snapshot (`hag_rs_mig_save`) into a new file to read.
    Save = 1,
    /// Open a file the VMM writes a snapshot into.
    Resume = 2,
    /// Load what was written (`hag_rs_mig_restore`), then close the file.
    Load = 3,
    /// End the data session.
    Close = 4,
}

/// VFIO migration: the device moves from `cur` to `next`, one arc that
/// `vfio_mig_get_next_state` chose (`enum vfio_device_mig_state` values).
/// Returns a [`MigAction`] for glue.c, or a negative errno.
#[no_mangle]
extern "C" fn hag_rs_mig_step(ctx: *const c_void, id: u32, cur: u32, next: u32) -> c_int {
    // SAFETY: called by glue.c's VFIO migration ops while registered.
    let state = unsafe { state(ctx) };
    match state.mig_step(id, cur, next) {
        Ok(action) => action as c_int,
        Err(e) => e.to_errno(),
    }
}

/// VFIO migration, STOP to STOP_COPY: writes the vGPU's snapshot into the
/// `cap` bytes at `buf`; returns the bytes used or a negative errno.
#[no_mangle]
extern "C" fn hag_rs_mig_save(ctx: *const c_void, id: u32, buf: *mut u8, cap: usize) -> c_long {
    // SAFETY: called by glue.c's VFIO migration ops while registered.
    let state = unsafe { state(ctx) };
    // SAFETY: glue.c passes the kvmalloc'd buffer of a migration file it
    // has just made, `cap` bytes long, which nothing else reaches before
    // this returns (the file is not installed in any fd table yet).
    let out = unsafe { core::slice::from_raw_parts_mut(buf, cap) };
    match state.mig_save(id, out) {
        Ok(used) => c_long::try_from(used).unwrap_or(c_long::MAX),
        Err(e) => e.to_errno() as c_long,
    }
}

/// VFIO migration, RESUMING to STOP: loads the `len` bytes at `buf` the VMM
/// wrote. 0 or a negative errno (the vGPU is then unchanged).
#[no_mangle]
extern "C" fn hag_rs_mig_restore(ctx: *const c_void, id: u32, buf: *const u8, len: usize) -> c_int {
    // SAFETY: called by glue.c's VFIO migration ops while registered.
    let state = unsafe { state(ctx) };
    // SAFETY: glue.c passes the migration file's kvmalloc'd (non-NULL)
    // buffer and the bytes written into it, at most its size, and holds
    // the file's lock across the call, so no write changes it meanwhile.
    let bytes = unsafe { core::slice::from_raw_parts(buf, len) };
    match state.mig_restore(id, bytes) {
        Ok(()) => 0,
        Err(e) => e.to_errno(),
    }
}

/// VFIO migration state back to RUNNING without a transition (device
/// close or reset): the vGPU is let go.
#[no_mangle]
extern "C" fn hag_rs_mig_reset(ctx: *const c_void, id: u32) {
    // SAFETY: called by glue.c's VFIO device ops while registered.
    unsafe { state(ctx) }.mig_reset(id);
}

/// The C side of one vGPU: DMA to its VM's memory and its work item.
///
/// Valid from probe until `hag_rs_vgpu_remove`, which glue.c calls after it
/// has stopped VFIO access and cancelled the work; the table drops the handle
/// then.
pub(crate) struct VgpuHandle {
    vgpu: *mut CVgpu,
}

// SAFETY: the C object is usable from any thread; concurrent use is
// serialised by the vGPU's mutex (DMA) or by the workqueue (kick).
unsafe impl Send for VgpuHandle {}
// SAFETY: as above.
unsafe impl Sync for VgpuHandle {}

impl VgpuHandle {
    /// Reads guest memory at guest physical `gpa` through the VM's VFIO
    /// DMA mappings. Fails (`EINVAL`, `EFAULT`) if the range is not mapped.
    /// Only while the VFIO device is open: the caller checks.
    pub(crate) fn dma_read(&self, gpa: u64, out: &mut [u8]) -> Result {
        // SAFETY: `self.vgpu` is live (see the type's docs); `out` is valid
        // for writes of its length for the duration of the call.
        let ret = unsafe {
            hag_glue_dma_rw(self.vgpu, gpa, out.as_mut_ptr().cast(), out.len() as u64, false)
        };
        check(ret)
    }

    /// Writes guest memory; as [`Self::dma_read`].
    pub(crate) fn dma_write(&self, gpa: u64, data: &[u8]) -> Result {
        // SAFETY: as in `dma_read`; with `write` set, vfio_dma_rw only reads
        // `data`.
        let ret = unsafe {
            hag_glue_dma_rw(self.vgpu, gpa, data.as_ptr().cast_mut().cast(), data.len() as u64, true)
        };
        check(ret)
    }

    /// Schedules the vGPU's tick in `delay_ms` (now, if 0); an already
    /// scheduled tick is moved.
    pub(crate) fn kick(&self, delay_ms: u32) {
        // SAFETY: `self.vgpu` is live and its work was initialised at probe.
        unsafe { hag_glue_kick(self.vgpu, delay_ms) };
    }
}

/// The module parameter `allow_hang_injection`.
pub(crate) fn hang_injection_allowed() -> bool {
    // SAFETY: reads a module parameter; no preconditions.
    unsafe { hag_glue_hang_injection_allowed() }
}

/// Sleeps (process context only).
pub(crate) fn msleep(ms: u32) {
    // SAFETY: the callers are ioctls, which run in process context.
    unsafe { hag_glue_msleep(ms) }
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

/// A VMM opened or closed the vGPU's VFIO device.
#[no_mangle]
extern "C" fn hag_rs_vgpu_open(ctx: *const c_void, id: u32, open: bool) {
    // SAFETY: called by glue.c's VFIO device ops while registered.
    unsafe { state(ctx) }.vgpu_opened(id, open);
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
// SAFETY: see above; these mirror VFIO's uapi structures.
unsafe impl FromBytes for vfio::DeviceInfo {}
// SAFETY: see above.
unsafe impl AsBytes for vfio::DeviceInfo {}
// SAFETY: see above.
unsafe impl FromBytes for vfio::RegionInfo {}
// SAFETY: see above.
unsafe impl AsBytes for vfio::RegionInfo {}
// SAFETY: see above.
unsafe impl FromBytes for vfio::IrqInfo {}
// SAFETY: see above.
unsafe impl AsBytes for vfio::IrqInfo {}
// SAFETY: see above.
unsafe impl FromBytes for vfio::IrqSet {}

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
