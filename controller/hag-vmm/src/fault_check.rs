//! `hag-vmm fault-check`: a VMM whose buffer faults forever must stall only
//! its own call (issue 23, item 12). The buffer of a VFIO access of vGPU A
//! is a page registered with userfaultfd and left missing, so the kernel's
//! copy from or to it waits in the fault until this tool resolves it. Once
//! the fault is reported (the call is in the kernel, waiting), every other
//! access must still answer: vGPU A's config space and BAR0, vGPU B, and
//! `/dev/hag`'s statistics of A (which take A's lock). A module that copied
//! with A's lock held would leave them waiting: after 10 s the check fails,
//! then resolves the fault so that every call ends.
//!
//! Three calls fault in turn: a BAR0 write (the copy in), a config read
//! (the copy out) and `VFIO_DEVICE_GET_INFO` (its argument). Resolved with
//! a zero page, each must then end as it would have: the write and the
//! read move 4 bytes, GET_INFO is refused (`argsz` 0: `EINVAL`).

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use guest_ram::GuestRam;
use hag_abi::sim_regs as r;
use hag_dev::Device;
use hag_vmm::vfio::VfioDevice;
use nix::errno::Errno;
use nix::libc;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

/// How long the other accesses may take while the fault waits: far past
/// what an answer takes, short of the scenario's patience.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);
const PAGE: usize = 4096;
/// `VFIO_DEVICE_GET_INFO`: `_IO(';', 100 + 7)`.
const VFIO_DEVICE_GET_INFO: libc::c_ulong = (b';' as libc::c_ulong) << 8 | 107;

/// `struct uffdio_api` and `struct uffdio_register`
/// (`include/uapi/linux/userfaultfd.h`).
#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}
#[repr(C)]
struct UffdioRegister {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}
const UFFD_API: u64 = 0xAA;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
nix::ioctl_readwrite!(uffdio_api, 0xAA, 0x3F, UffdioApi);
nix::ioctl_readwrite!(uffdio_register, 0xAA, 0x00, UffdioRegister);

/// One anonymous page, unmapped on drop.
struct Page(*mut libc::c_void);

// SAFETY: the page is plain memory owned by this value; the threads that
// share it only pass its address to the kernel.
unsafe impl Send for Page {}
// SAFETY: as for Send: no thread reads or writes it through the pointer.
unsafe impl Sync for Page {}

impl Page {
    fn new() -> anyhow::Result<Self> {
        // SAFETY: a fresh private anonymous mapping; nothing else refers to
        // the address it returns.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        ensure!(
            addr != libc::MAP_FAILED,
            "mmap of a page: {}",
            Errno::last()
        );
        Ok(Self(addr))
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        // SAFETY: the mapping `new` made, used by no thread any more (the
        // scoped threads that used it have been joined).
        unsafe { libc::munmap(self.0, PAGE) };
    }
}

/// A userfaultfd with `page` registered for missing-page faults: the page
/// has never been touched, so the first access to it, the kernel's too,
/// waits until the fault is resolved. Dropping it resolves every fault (the
/// kernel then maps a zero page).
fn register(page: &Page) -> anyhow::Result<OwnedFd> {
    // SAFETY: userfaultfd(2) takes flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        bail!(
            "userfaultfd: {} (the test kernel needs CONFIG_USERFAULTFD)",
            Errno::last()
        );
    }
    // SAFETY: the syscall returned a new fd that nothing else owns.
    let uffd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut api = UffdioApi {
        api: UFFD_API,
        features: 0,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API reads and writes the struct passed.
    unsafe { uffdio_api(uffd.as_raw_fd(), &mut api) }.context("UFFDIO_API")?;
    let mut reg = UffdioRegister {
        start: page.0 as u64,
        len: PAGE as u64,
        mode: UFFDIO_REGISTER_MODE_MISSING,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_REGISTER reads and writes the struct passed; the range
    // is the page's own mapping.
    unsafe { uffdio_register(uffd.as_raw_fd(), &mut reg) }.context("UFFDIO_REGISTER")?;
    Ok(uffd)
}

/// Waits until the kernel reports the fault on the page: the faulting call
/// is then inside the kernel, waiting.
fn wait_fault(uffd: &OwnedFd, page: &Page) -> anyhow::Result<()> {
    let mut fds = [PollFd::new(uffd.as_fd(), PollFlags::POLLIN)];
    let ready = poll(
        &mut fds,
        PollTimeout::from(ANSWER_WITHIN.as_millis() as u16),
    )?;
    ensure!(
        ready == 1,
        "the access never faulted on its buffer within {ANSWER_WITHIN:?}"
    );
    let mut msg = [0u8; 32];
    let n = nix::unistd::read(uffd, &mut msg).context("reading the userfaultfd")?;
    let address = u64::from_ne_bytes(msg[16..24].try_into()?);
    ensure!(
        n == 32 && msg[0] == UFFD_EVENT_PAGEFAULT && address & !(PAGE as u64 - 1) == page.0 as u64,
        "unexpected userfaultfd message {msg:?}"
    );
    Ok(())
}

/// The VFIO calls whose buffer is the faulting page.
#[derive(Clone, Copy, Debug)]
enum Call {
    Bar0Write,
    ConfigRead,
    GetInfo,
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::Bar0Write => "a BAR0 write (pwrite) from the buffer",
            Call::ConfigRead => "a config-space read (pread) into the buffer",
            Call::GetInfo => "VFIO_DEVICE_GET_INFO with its argument in the buffer",
        }
    }

    /// Makes the call on `vfio`; its result as a byte count or an errno.
    fn run(self, vfio: &VfioDevice, page: &Page) -> Result<isize, Errno> {
        let fd = vfio.device_fd().as_raw_fd();
        // SAFETY: each call gets the page's address as its buffer, a live
        // mapping of PAGE bytes, larger than any of these moves.
        let ret = unsafe {
            match self {
                Call::Bar0Write => libc::pwrite(
                    fd,
                    page.0,
                    4,
                    (vfio.bar0().offset + u64::from(r::GPR_BASE)) as i64,
                ),
                Call::ConfigRead => libc::pread(fd, page.0, 4, vfio.config().offset as i64),
                Call::GetInfo => libc::ioctl(fd, VFIO_DEVICE_GET_INFO, page.0) as isize,
            }
        };
        if ret < 0 {
            Err(Errno::last())
        } else {
            Ok(ret)
        }
    }

    /// What the call must end with once the zero page resolves its fault.
    fn expected(self) -> Result<isize, Errno> {
        match self {
            Call::Bar0Write | Call::ConfigRead => Ok(4),
            Call::GetInfo => Err(Errno::EINVAL),
        }
    }
}

/// Every access that must answer while A's call waits in its fault.
fn others(a: &VfioDevice, b: &VfioDevice, hag: &Device, a_id: u32) -> anyhow::Result<()> {
    a.config_read(0).context("vGPU A's config space")?;
    let mut word = [0u8; 4];
    nix::sys::uio::pread(a.device_fd(), &mut word, a.bar0().offset as i64)
        .context("vGPU A's BAR0")?;
    b.config_read(0).context("vGPU B's config space")?;
    hag.vgpu_stats(a_id)
        .context("/dev/hag's statistics of vGPU A")?;
    Ok(())
}

pub fn fault_check(mdev_a: &str, mdev_b: &str) -> anyhow::Result<()> {
    let ram_a = GuestRam::with_mib(16)?;
    let a =
        VfioDevice::attach(mdev_a, &ram_a).with_context(|| format!("attaching vGPU A {mdev_a}"))?;
    let ram_b = GuestRam::with_mib(16)?;
    let b =
        VfioDevice::attach(mdev_b, &ram_b).with_context(|| format!("attaching vGPU B {mdev_b}"))?;
    let hag = Device::open()?;
    let a_id = hag.find_vgpu(mdev_a)?.id;
    for call in [Call::Bar0Write, Call::ConfigRead, Call::GetInfo] {
        let page = Page::new()?;
        let uffd = register(&page)?;
        let (answered, ended) = thread::scope(|s| -> anyhow::Result<_> {
            let stuck = s.spawn(|| call.run(&a, &page));
            let waiting = wait_fault(&uffd, &page);
            let (tx, rx) = mpsc::channel();
            let (a, b, hag) = (&a, &b, &hag);
            s.spawn(move || tx.send(others(a, b, hag, a_id)));
            let answered = waiting.map(|()| rx.recv_timeout(ANSWER_WITHIN));
            // Resolves the fault whatever happened, so that every call ends.
            drop(uffd);
            let ended = stuck.join().expect("the faulting call's thread panicked");
            Ok((answered?, ended))
        })?;
        match answered {
            Ok(Ok(())) => {}
            Ok(Err(e)) => bail!("{}: while it waited in its fault, {e:#}", call.name()),
            Err(_) => bail!(
                "{}: while it waited in its fault, the other accesses did not answer within {ANSWER_WITHIN:?} \
                 (the module touches the VMM's memory with the vGPU's lock held)",
                call.name()
            ),
        }
        ensure!(
            ended == call.expected(),
            "{}: ended with {ended:?} once its fault was resolved, not {:?}",
            call.name(),
            call.expected()
        );
        println!(
            "ok: {}: waited in its fault while vGPU A's config and BAR0, vGPU B and /dev/hag answered; then {ended:?}",
            call.name()
        );
    }
    println!("PASS fault-check: 3 calls faulting on their buffer stalled only themselves");
    Ok(())
}
