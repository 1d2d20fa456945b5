"""Test hosts for hag: QEMU VMs booted from the test kernel, joined by a
private network, running scenario scripts.

A test host is `qemu-system-x86_64 -accel tcg` (this machine's /dev/kvm
cannot boot Linux; the binary scripts/build-qemu.sh builds, QEMU 10.0.2
with two fixes for TCG's nested SVM) with the test kernel and an initramfs holding busybox,
hag_mdev.ko, hagctl (with its shared libraries) and the guest scripts. Its
/init (guest/init) runs the scenario named on the kernel command line and
reports on the serial console, which goes to a log file here.

Hosts share two Ethernet segments (eth0, eth1): each QEMU sends its frames as
UDP datagrams to a hub socket on 127.0.0.1, and the hub forwards every frame
to all other hosts on that segment. Nothing leaves the loopback interface, and QEMU runs with
-nodefaults, so no host has user-mode networking.

With HAG_FLAVOUR=gvt, hosts boot the GVT-g kernel (scripts/build-kernel.sh
--flavour gvt, which reads the same variable) with the hag_mdev.ko that
`make gvt` built against it, and kvmgt.ko in the initramfs for lib.sh to
load before it; i915 finds no Intel GPU there, so no GVT-g device exists.

Every host's CPU is `-cpu max` less AVX2 and PCLMULQDQ (HOST_CPU): its
RDRAND seeds the kernel's random pool at boot, and it emulates AMD SVM, so
KVM works inside the hosts. A scenario
whose header says `# vms: yes` runs real VMs there (never TCG inside TCG);
its hosts get more memory, a distinct SMBIOS UUID each, and this machine's root directory read-only over 9p
(mount tag `hostroot`), from which lib.sh's `host_root_up` makes a writable
root with QEMU 10 and libvirt in it, as virtme-ng does. The VMs boot the
test kernel with the initramfs `build_vm_initramfs` writes (guest/vm-init
and hag-guest); their paths reach the host on its kernel command line
(`hag_vm_kernel=`, `hag_vm_initrd=`), as paths under that root, as is this
repository's (`hag_repo=`: build/deb's packages, say). A scenario
whose header also says `# debian: yes` gets the Debian guest's disk image
(scripts/build-guest-rootfs.sh, built here once and cached) the same way,
`hag_vm_debian=`; `# memory: MIB` sets its hosts' memory; `# apparmor:
yes` boots them with AppArmor on (`lsm=capability,apparmor`; the test
kernel has it built in, off by default).

A scenario loses a host for real by printing `HAG-KILL-HOST` on its console
(lib.sh's `lose_this_host`): the harness then SIGKILLs that host's QEMU
process at once, as a power cut would, and judges the host only on what it
logged before.

A host fences another as a power switch would: it prints
`HAG-FENCE-HOST N` on its console (the test hosts' fence agent,
guest/fence_haghost.sh, for Pacemaker), the harness SIGKILLs host N's QEMU
(if it still runs) and then answers `off hostN` on the asking host's
second serial port, which its /init appends to /tmp/hag-harness.said.

A live host beats on its second serial port (`NAME.hostI.beat`), through
which the harness pokes it every few seconds (POKE_SECONDS: an interrupt
that revives a host whose own was lost); one that stops for HANG_SECONDS
is hung: the harness records its vCPU's registers
from its HMP monitor, sends it an NMI (the kernel panics with a backtrace:
`unknown_nmi_panic`), and ends the run; the Result says it `hung`, as it
does when a host's VM stalled (lib.sh prints HAG-NESTED-STALL when a VM's
console stayed silent for 300 s). Once a host's script has failed, the
others get FAILED_GRACE_SECONDS to finish, and the run ends: the scenario
has failed, and a peer waiting for the failed host would otherwise wait
out the timeout.

Promises: every QEMU process a run starts is killed before the run returns,
whatever happened; a scenario passes only if every host's script exited 0
and no host's log shows a kernel BUG, WARNING, Oops or panic, or a taint
other than the out-of-tree module one.
"""

import gzip
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# Every host's CPU: -cpu max, whose RDRAND seeds the kernel's random pool
# at boot (without it the pool took up to 309 s to seed on a busy machine,
# and anything calling getrandom(2), hagctl's Noise handshake, blocked that
# long) and whose emulated AMD SVM runs KVM; without AVX2 and PCLMULQDQ,
# which TCG emulates slower than the SSE2 and table code software picks
# without them: under qemu-x86_64, hagctl's ChaCha20-Poly1305 sealed
# 10 MiB in 547 ms with AVX2 and 141 ms without, and crc32fast took 34 ms
# with PCLMULQDQ and 9 ms without (natively both are the fast ones). A
# real host's hagctl uses both; in a test host they made encryption most
# of the sender's time. HAG_HOST_CPU overrides it.
HOST_CPU = "max,-avx2,-pclmulqdq"

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "qemu-tests"

# Taint bit 12 ('O'): an out-of-tree module was loaded, which hag_mdev is.
TAINT_OUT_OF_TREE = 1 << 12
KERNEL_TROUBLE = re.compile(
    r"(BUG:|WARNING:|Oops|Kernel panic|general protection fault|Call Trace:|UBSAN:|KASAN:)"
)


@dataclass
class Build:
    """The built artefacts a test host is made of."""

    kernel_tree: Path
    module: Path
    hagctl: Path
    vmm: Path
    guest: Path
    # The test hosts' QEMU (scripts/build-qemu.sh: 10.0.2 with two TCG
    # fixes for nested SVM); the VMs inside them run Debian's.
    qemu: Path
    # In-tree modules hag_mdev.ko needs loaded first (besides mdev.ko).
    needs: list = field(default_factory=list)

    @property
    def plug_gate(self):
        return self.hagctl.parent / "examples/plug_gate"

    @property
    def bzimage(self):
        return self.kernel_tree / "arch/x86/boot/bzImage"

    @staticmethod
    def find():
        # HAG_FLAVOUR picks the kernel (build-kernel.sh reads it too) and the
        # module built against it: test (rust/hag_mdev), gvt or debug (each
        # in build/<flavour>-module/).
        flavour = os.environ.get("HAG_FLAVOUR", "test")
        gvt = flavour == "gvt"
        tree = Path(subprocess.run(
            [str(ROOT / "scripts/build-kernel.sh"), "--print-dir"],
            check=True, capture_output=True, text=True,
        ).stdout.strip())
        build = Build(
            kernel_tree=tree,
            # HAG_MODULE_KO: another build of the module (a clean checkout's).
            module=Path(os.environ.get("HAG_MODULE_KO") or
                        ROOT / (f"build/{flavour}-module/rust/hag_mdev/hag_mdev.ko" if flavour in ("gvt", "debug")
                                else "rust/hag_mdev/hag_mdev.ko")),
            hagctl=ROOT / "controller/target/release/hagctl",
            vmm=ROOT / "controller/target/release/hag-vmm",
            guest=Path(os.environ.get("HAG_GUEST_BIN", ROOT / "controller/target/release/hag-guest")),
            # HAG_HOST_QEMU: another qemu-system-x86_64 (Debian's, to compare).
            qemu=Path(os.environ.get("HAG_HOST_QEMU") or subprocess.run(
                [str(ROOT / "scripts/build-qemu.sh"), "--print-path"],
                check=True, capture_output=True, text=True,
            ).stdout.strip()),
            needs=[tree / "drivers/gpu/drm/i915/kvmgt.ko"] if gvt else [],
        )
        make = f"make {flavour} controller" if flavour in ("gvt", "debug") else "make"
        for path in (build.bzimage, build.module, build.hagctl, build.vmm, build.guest, build.qemu, *build.needs):
            if not path.exists():
                raise SystemExit(f"qemu-tests: {path} missing: run `{make}` first")
        return build


def shared_libraries(binary):
    """The shared libraries `binary` loads, as ldd resolves them here."""
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
    libs = []
    for line in out.splitlines():
        m = re.search(r"(/\S+) \(0x", line)
        if m:
            libs.append(Path(m.group(1)))
    return libs


def copy_with_libraries(binary, root, dest):
    """Copies `binary` to `root`/`dest` with the shared libraries it loads."""
    shutil.copy2(binary, root / dest)
    for lib in shared_libraries(binary):
        target = root / lib.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib.resolve(), target)


def write_cpio_gz(root, dest):
    cpio = subprocess.run(
        "find . | sort | cpio -o -H newc --quiet -R 0:0",
        shell=True, cwd=root, check=True, capture_output=True,
    ).stdout
    with gzip.open(dest, "wb", compresslevel=1) as f:
        f.write(cpio)


def build_vm_initramfs(build, dest):
    """Writes the initramfs of a real VM's guest (a QEMU/KVM guest inside a
    test host): busybox, guest/vm-init as /init, and hag-guest, the guest
    GPU driver and workload."""
    with tempfile.TemporaryDirectory(prefix="hag-vm-initramfs-") as tmp:
        root = Path(tmp)
        for d in ("bin", "sbin", "usr/bin", "proc", "sys", "dev", "tmp"):
            (root / d).mkdir(parents=True, exist_ok=True)
        shutil.copy2("/bin/busybox", root / "bin/busybox")
        shutil.copy2(TESTS / "guest/vm-init", root / "init")
        os.chmod(root / "init", 0o755)
        copy_with_libraries(build.guest, root, "bin/hag-guest")
        write_cpio_gz(root, dest)


def build_initramfs(build, dest):
    """Writes a gzip'd newc cpio initramfs for test hosts to `dest`."""
    with tempfile.TemporaryDirectory(prefix="hag-initramfs-") as tmp:
        root = Path(tmp)
        for d in ("bin", "sbin", "usr/bin", "proc", "sys", "dev", "tmp", "hag/scenarios"):
            (root / d).mkdir(parents=True, exist_ok=True)
        shutil.copy2("/bin/busybox", root / "bin/busybox")
        shutil.copy2(TESTS / "guest/init", root / "init")
        for helper in sorted((TESTS / "guest").glob("*.sh")) + sorted((TESTS / "guest").glob("*.py")):
            shutil.copy2(helper, root / "hag" / helper.name)
        shutil.copy2(build.module, root / "hag/hag_mdev.ko")
        shutil.copy2(build.kernel_tree / "drivers/vfio/mdev/mdev.ko", root / "hag/mdev.ko")
        for module in build.needs:
            shutil.copy2(module, root / "hag" / module.name)
        for script in sorted((TESTS / "scenarios").glob("*.sh")):
            shutil.copy2(script, root / "hag/scenarios" / script.name)
        shutil.copy2(TESTS / "demo.sh", root / "hag/scenarios/demo.sh")
        # The libvirt hook, its installer and sample config (libvirt_hook.sh).
        shutil.copytree(ROOT / "scripts/libvirt", root / "hag/libvirt")
        copy_with_libraries(build.hagctl, root, "bin/hagctl")
        copy_with_libraries(build.vmm, root, "bin/hag-vmm")
        # hag-guest's --report and its client (`hag-guest listen`) also run
        # on test hosts; plug_gate, hagctl's example, drives the output gate
        # by hand (scenario output_plug), when it was built (make controller).
        copy_with_libraries(build.guest, root, "bin/hag-guest")
        if build.plug_gate.exists():
            copy_with_libraries(build.plug_gate, root, "bin/plug_gate")
        os.chmod(root / "init", 0o755)
        write_cpio_gz(root, dest)


def add_scenario_to_initramfs(initramfs, name, text):
    """Appends a gzip'd cpio member with scenario `name` (its text): the
    kernel unpacks concatenated archives in order. For scripts that make
    their scenario (the evaluation's)."""
    with tempfile.TemporaryDirectory(prefix="hag-scenario-") as tmp:
        root = Path(tmp)
        (root / "hag/scenarios").mkdir(parents=True)
        (root / f"hag/scenarios/{name}.sh").write_text(text)
        cpio = subprocess.run("find . | sort | cpio -o -H newc --quiet -R 0:0", shell=True, cwd=root,
                              check=True, capture_output=True).stdout
    with open(initramfs, "ab") as f:
        f.write(gzip.compress(cpio, compresslevel=1))


def run_made_scenario(build, name, text, logdir, on_output=None, placement=None):
    """Boots the hosts of a scenario a script made (`text`, run as `name`)
    with a fresh initramfs, as run_scenario; prints why a boot that did not
    end cleanly did not. Returns run_scenario's Result."""
    with tempfile.TemporaryDirectory(prefix=f"hag-{name}-") as tmp:
        script = Path(tmp) / f"{name}.sh"
        script.write_text(text)
        initramfs = Path(tmp) / "initramfs.cpio.gz"
        build_initramfs(build, initramfs)
        add_scenario_to_initramfs(initramfs, name, text)
        result = run_scenario(build, initramfs, script, logdir, on_output=on_output, placement=placement)
    if not result.passed:
        print(f"{name}: the boot did not end cleanly: " + "; ".join(result.reasons))
        print(f"  logs: {', '.join(str(h.log) for h in result.hosts)}")
    return result


class Hub:
    """An Ethernet hub over UDP on loopback: forwards each datagram from one
    host's QEMU to every other host's."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.members = set()
        self.stopping = False
        self.thread = threading.Thread(target=self._forward, daemon=True)
        self.thread.start()

    def add_member(self, port):
        self.members.add(("127.0.0.1", port))

    def _forward(self):
        while not self.stopping:
            ready, _, _ = select.select([self.sock], [], [], 0.2)
            if not ready:
                continue
            try:
                frame, sender = self.sock.recvfrom(65536)
            except OSError:
                return
            for member in self.members:
                if member != sender:
                    self.sock.sendto(frame, member)

    def close(self):
        self.stopping = True
        self.thread.join()
        self.sock.close()


def exit_on_termination():
    """Turns SIGTERM and SIGHUP into SystemExit, so the `finally` blocks
    that kill the QEMU processes run when the runner itself is stopped."""
    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def free_udp_port():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A live host's /init beats every 5 s on its second serial port; one silent
# this long is hung (TCG, or the test kernel), not slow: its scenario is
# ended at once, with where its vCPU was, instead of at its timeout (CI
# once lost 30 min to a host that went silent mid-scenario).
HANG_SECONDS = float(os.environ.get("HAG_HANG_SECONDS", "240"))
# How often a host of several CPUs is checked for one that stopped for good
# (Host.lost_cpu).
LOST_CPU_SECONDS = 30.0
# The harness writes a byte to that port this often: its receive interrupt
# wakes a host whose own interrupt was lost. QEMU before 10.2 updates a
# vCPU's pending-interrupt word from two threads without atomics (fixed by
# commits 87511341c30d and 27e76d010104); a lost timer interrupt while a
# nested guest spins without exits stops the host for good.
POKE_SECONDS = 3.0
# A host whose script failed fails its scenario whatever the others do:
# they get this long to print their own account, then the run ends. A peer
# waiting for the failed host would otherwise wait out the whole timeout
# (up to 50 min of CI's 90).
FAILED_GRACE_SECONDS = 30.0
SCRIPT_END = re.compile(r"HAG-SCENARIO-END rc=(\d+)")
FENCE_REQUEST = re.compile(r"HAG-FENCE-HOST (\d+)")
KILL_REQUEST = re.compile(r"HAG-KILL-HOST")


@dataclass
class Host:
    index: int
    log: Path
    process: subprocess.Popen = None
    killed: bool = False
    # The heartbeat's file (the second serial port's log), that port's
    # socket (the pokes) and the HMP monitor's socket.
    beat: Path = None
    beat_socket: Path = None
    monitor: Path = None
    _poke: socket.socket = None
    _poked_at: float = 0.0
    # How far `requests` has read the log, and the end of what it read
    # (a request split between two reads is seen whole).
    _read_to: int = 0
    _read_tail: str = ""
    pokes: int = 0
    # What the harness found when this host stopped beating, and the test
    # kernel's System.map to name where its vCPU was.
    hang: str = ""
    # Why the run ended before this host's script did, if another host's
    # script failed.
    stopped_by: str = ""
    system_map: Path = None
    # Its vCPUs, and what lost_cpu saw at its last check (the halted CPUs
    # whose timer interrupt was pending) and when it checks next: the
    # boot's first minute is not checked.
    cpus: int = 1
    _timer_pending: set = field(default_factory=set)
    _lost_cpu_due: float = field(default_factory=lambda: time.monotonic() + 60)

    def text(self):
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def finished(self):
        return self.killed or "HAG-TAINT" in self.text() or self.process.poll() is not None

    def script_failed(self):
        """Whether this host's script ended with a nonzero status."""
        end = SCRIPT_END.search(self.text())
        return end is not None and end.group(1) != "0"

    def requests(self):
        """What this host's console asked of the harness since the last
        call: whether to be lost (`HAG-KILL-HOST`), and the hosts to fence
        (`HAG-FENCE-HOST N`), in order. Reads only what was added."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self._read_to)
                raw = f.read()
        except FileNotFoundError:
            return False, []
        self._read_to += len(raw)
        text, seen = self._read_tail + raw.decode(errors="replace"), len(self._read_tail)
        self._read_tail = text[-64:]
        lose = any(m.end() > seen for m in KILL_REQUEST.finditer(text))
        fence = [int(m.group(1)) for m in FENCE_REQUEST.finditer(text) if m.end() > seen]
        return lose, fence

    def kill(self):
        """Pulls the plug: SIGKILL to the host's QEMU."""
        if not self.killed:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.killed = True

    def tell(self, line):
        """A line on this host's second serial port (/tmp/hag-harness.said)."""
        self.send_port(line.encode() + b"\n")

    def poke(self):
        """Every POKE_SECONDS, a byte into the host's second serial port
        (its /init reads and drops them; one that exited refuses it)."""
        if time.monotonic() - self._poked_at < POKE_SECONDS or self.killed:
            return
        self._poked_at = time.monotonic()
        if self.send_port(b"\n"):
            self.pokes += 1
            self.drain_poke()

    def send_port(self, data):
        """Writes `data` to the host's second serial port, connecting to it
        first if need be; whether it went (a host that exited refuses)."""
        try:
            if self._poke is None:
                self._poke = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._poke.setblocking(False)
                self._poke.connect(str(self.beat_socket))
            self._poke.send(data)
            return True
        except OSError:
            self.close_poke()
            return False

    def drain_poke(self):
        """Reads and drops what the host wrote to the port while connected
        (its beats also go to the log file). Left unread, they fill the
        socket: QEMU writes the port's bytes one at a time, each costs a
        buffer's worth of the socket's memory, and after some 300 bytes
        (200 s of beats) the port stops transmitting and the host, though
        well, stops beating (CI lost its Debian scenarios to this)."""
        while True:
            try:
                if not self._poke.recv(4096):
                    raise ConnectionResetError("the host closed its heartbeat port")
            except BlockingIOError:
                return

    def close_poke(self):
        if self._poke is not None:
            self._poke.close()
            self._poke = None

    def silent_for(self):
        """Seconds since this host's last heartbeat, once past HANG_SECONDS
        (0 before that, before its first beat, and once it has finished:
        boot and shutdown do not beat)."""
        try:
            beat = self.beat.stat()
        except (AttributeError, FileNotFoundError):
            return 0.0
        silent = time.time() - beat.st_mtime
        # Last, as it reads the whole serial log: only for a silent host.
        if beat.st_size == 0 or silent < HANG_SECONDS or self.finished():
            return 0.0
        return silent

    def lost_cpu(self):
        """For a host of several CPUs, checked every LOST_CPU_SECONDS: a
        CPU that was halted with its timer interrupt (vector 236) pending
        at two checks in a row, described; else None. Under QEMU 10.0's
        TCG such a CPU of a host running nested KVM guests never runs
        again (IPIs, serial pokes and NMIs leave it halted), while its
        other CPUs keep the heartbeat going: the host is as good as hung,
        but only a scenario's timeout would end it."""
        if self.cpus < 2 or self.killed or time.monotonic() < self._lost_cpu_due:
            return None
        self._lost_cpu_due = time.monotonic() + LOST_CPU_SECONDS
        halted = {i for i, line in enumerate(l for l in hmp(self.monitor, "info registers -a").splitlines()
                                             if l.startswith("RIP=")) if "HLT=1" in line}
        stuck = set()
        for cpu in halted:
            irr = next((l.split()[1:] for l in hmp(self.monitor, f"info lapic {cpu}").splitlines()
                        if l.startswith("IRR")), [])
            if "236" in irr:
                stuck.add(cpu)
        lost, self._timer_pending = stuck & self._timer_pending, stuck
        if not lost:
            return None
        return (f"CPU {min(lost)} halted with its timer interrupt pending at two checks "
                f"{LOST_CPU_SECONDS:.0f} s apart: it never runs again (QEMU 10.0 TCG)")

    def diagnose_hang(self, silent):
        """Records where a host that stopped beating is, then ends it: its
        vCPU's registers twice (HMP `info registers`: a vCPU in a nested
        guest shows that guest's state), then an NMI, on which the test
        kernel (booted with unknown_nmi_panic) panics with a backtrace of
        what it was running, if it still runs at all."""
        lines = [silent if isinstance(silent, str) else
                 f"no heartbeat for {silent:.0f} s: the host hung "
                 f"({self.pokes} serial interrupts sent to it in all, every {POKE_SECONDS:.0f} s)"]
        for _ in range(2):
            regs = hmp(self.monitor, "info registers")
            for line in regs.splitlines():
                if line.startswith("RIP="):
                    lines.append(f"{line} ({kernel_symbol(self.system_map, line[4:20])})")
                elif line.startswith(("CS ", "CR0=", "EFER=")):
                    lines.append(line)
            time.sleep(1)
        # Pending (IRR) and in-service (ISR) vectors: 236 pending is
        # Linux's timer, undelivered.
        lines += [f"LAPIC {l.strip()}" for l in hmp(self.monitor, "info lapic").splitlines()
                  if l.strip().startswith(("IRR", "ISR", "LVT0", "LVTT"))]
        before = len(self.text())
        hmp(self.monitor, "nmi")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.process.poll() is None:
            time.sleep(0.5)
        answered = "Kernel panic" in self.text()[before:]
        lines.append("its kernel answered the NMI (its backtrace is above)" if answered
                     else "its kernel did not answer an NMI in 20 s")
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.hang = "; ".join([lines[0], *(l for l in lines if l.startswith("RIP="))][:2] + [lines[-1]])
        with open(self.log, "a") as log:
            log.write("".join(f"\nHAG-HARNESS {l}" for l in lines) + "\n")


def kernel_symbol(system_map, address):
    """`symbol+0xoffset` of a hex `address` in the test kernel (which runs
    without KASLR, in the hosts and in their VMs alike), or `not in the
    kernel`."""
    try:
        addr = int(address, 16)
        best = None
        for line in system_map.read_text().splitlines():
            value, kind, name = line.split()[:3]
            if kind.lower() == "t" and int(value, 16) <= addr and (best is None or int(value, 16) > best[0]):
                best = (int(value, 16), name)
    except (OSError, ValueError, AttributeError):
        return "no System.map"
    if best is None or addr - best[0] > 1 << 20:
        return "not in the kernel"
    return f"{best[1]}+{addr - best[0]:#x}"


def hmp(socket_path, command, timeout=10):
    """Runs an HMP command on a QEMU monitor's Unix socket; its output, or
    what went wrong, as text."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(socket_path))
            out = b""

            def until_prompt():
                nonlocal out
                while not out.endswith(b"(qemu) "):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    out += chunk

            until_prompt()
            out = b""
            s.sendall(command.encode() + b"\n")
            until_prompt()
            return out.decode(errors="replace").replace("\r", "").removesuffix("(qemu) ")
    except OSError as e:
        return f"(monitor: {e})"


@dataclass
class Result:
    name: str
    passed: bool
    reasons: list = field(default_factory=list)
    hosts: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def hung(self):
        """A host stopped beating, or a VM in a host printed nothing for
        minutes (lib.sh's HAG-NESTED-STALL): the emulator or the test
        kernel hung, which says nothing about the scenario's verdict."""
        return any(h.hang or "HAG-NESTED-STALL" in h.text() for h in self.hosts)


def scenario_header(script, key, default):
    """Reads `# key: value` from a scenario's first lines (a number, or
    `yes`, read as 1)."""
    for line in script.read_text().splitlines()[:8]:
        m = re.match(rf"#\s*{key}:\s*(\d+|yes)\b", line)
        if m:
            return 1 if m.group(1) == "yes" else int(m.group(1))
    return default


# Memory of a test host that runs real VMs: two VMs of 256 MiB (one
# incoming), QEMU's and libvirtd's own, the tmpfs root overlay.
VM_HOST_MIB = 2048


def host_tsc_khz():
    """This machine's TSC frequency in kHz, which is what TCG's TSC runs at
    (its `cpu MHz`: these machines have a constant, known-frequency TSC)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("cpu MHz"):
            return round(float(line.split(":")[1]) * 1000)
    raise SystemExit("qemu-tests: no 'cpu MHz' in /proc/cpuinfo to give test hosts their TSC frequency")


def debian_guest_image():
    """The Debian guest's disk image (`# debian: yes`), built if not cached
    (a few minutes, once per version of its script)."""
    out = subprocess.run([ROOT / "scripts/build-guest-rootfs.sh"], check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return out.strip().splitlines()[-1]


def vm_host_args(index, vm_initramfs, build, debian_image=None):
    """QEMU arguments and kernel command-line words for a test host that
    runs real VMs (`# vms: yes`)."""
    args = [
        "-fsdev", "local,id=hostroot,path=/,readonly=on,security_model=none,multidevs=remap",
        "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
        # libvirt refuses to migrate to a host with its own UUID.
        "-smbios", f"type=1,uuid=8a6c0000-4a47-4000-8000-{index:012x}",
    ]
    # tsc_early_khz: the test kernel has neither HPET nor ACPI's PM timer,
    # so it calibrates the TSC against the PIT alone, which fails when the
    # machine is busy; the kernel then marks the TSC unstable with a
    # frequency of 0, and KVM, which needs that frequency for its guests'
    # clocks, retries a clock update forever: the VM never leaves its reset
    # vector. TCG's TSC is this machine's, so its frequency is given.
    words = (f" hag_vm_kernel={build.bzimage} hag_vm_initrd={vm_initramfs}"
             f" tsc_early_khz={host_tsc_khz()} hag_repo={ROOT}")
    if debian_image:
        words += f" hag_vm_debian={debian_image}"
    return args, words


def run_scenario(build, initramfs, script, logdir, on_output=None, placement=None):
    """Boots the hosts `script` asks for, runs it on each, and judges it.

    `on_output(host_index, text)`, if given, receives each host's serial
    output as it arrives. `placement`, if given, places the hosts' threads
    on the machine's cores (the checkpoint benchmark's
    `eval/placement.Placement`): `host_words(i)` adds to host i's kernel
    command line, `started(processes)` is called once they all run and
    `stop()` at the end."""
    name = script.stem
    n_hosts = scenario_header(script, "hosts", 1)
    # A scenario's timeout only bounds a hang, so it is scaled generously
    # (HAG_TIMEOUT_SCALE, default 2): the clock includes the hosts' boot,
    # and TCG on a loaded machine runs several times slower than quiet.
    timeout = scenario_header(script, "timeout", 300) * float(os.environ.get("HAG_TIMEOUT_SCALE", "2"))
    vms = scenario_header(script, "vms", 0)
    # One vCPU per host unless the script asks for more (`# cpus: N`).
    cpus = scenario_header(script, "cpus", 1)
    debian_image = debian_guest_image() if vms and scenario_header(script, "debian", 0) else None
    memory = scenario_header(script, "memory", VM_HOST_MIB if vms else 512)
    vm_initramfs = logdir / "vm-initramfs.cpio.gz"
    # Rebuilt when hag-guest or vm-init is newer.
    inputs = (build.guest, TESTS / "guest/vm-init")
    if vms and (not vm_initramfs.exists() or
                vm_initramfs.stat().st_mtime < max(p.stat().st_mtime for p in inputs)):
        build_vm_initramfs(build, vm_initramfs)
    start = time.monotonic()
    monitors = Path(tempfile.mkdtemp(prefix="hag-monitors-"))
    # Two independent segments: eth0 carries the data, eth1 is a second
    # path (for heartbeats), so a scenario can cut one link and keep the
    # other, as redundant cluster links allow.
    hubs = [Hub(), Hub()]
    hosts = []
    try:
        for i in range(n_hosts):
            host = Host(i, logdir / f"{name}.host{i}.log", beat=logdir / f"{name}.host{i}.beat",
                        beat_socket=monitors / f"beat{i}", monitor=monitors / f"host{i}",
                        system_map=build.kernel_tree / "System.map", cpus=cpus)
            host.log.unlink(missing_ok=True)
            host.beat.unlink(missing_ok=True)
            nics = []
            for n, hub in enumerate(hubs):
                port = free_udp_port()
                hub.add_member(port)
                nics += [
                    "-netdev", f"socket,id=net{n},udp=127.0.0.1:{hub.port},localaddr=127.0.0.1:{port}",
                    "-device", f"virtio-net-pci,netdev=net{n},mac=52:54:00:4a:{0x47 + n:02x}:{i:02x}",
                ]
            extra, words = vm_host_args(i, vm_initramfs.resolve(), build, debian_image) if vms else ([], "")
            if placement:
                words += placement.host_words(i)
            # AppArmor (in the test kernel, off by default) for a scenario
            # that runs libvirt under its confinement.
            if scenario_header(script, "apparmor", 0):
                words += " lsm=capability,apparmor"
            # HAG_HOST_APPEND: more kernel command line words for every host
            # (loglevel=5 shows a kernel BUG's stack, which quiet hides).
            words += "".join(" " + w for w in os.environ.get("HAG_HOST_APPEND", "").split())
            cmd = [
                # Threads named for what they run ("CPU 1/TCG"): the
                # benchmark's placement pins them by name.
                str(build.qemu), "-name", f"host{i},debug-threads=on",
                # HAG_HOST_ACCEL: e.g. tcg,thread=single (every vCPU of a
                # host in one thread; see Host.lost_cpu).
                "-accel", os.environ.get("HAG_HOST_ACCEL", "tcg"), "-m", str(memory),
                "-cpu", os.environ.get("HAG_HOST_CPU", HOST_CPU),
                "-smp", str(cpus), "-nodefaults", "-display", "none", "-no-reboot",
                "-monitor", f"unix:{host.monitor},server=on,wait=off",
                "-kernel", str(build.bzimage), "-initrd", str(initramfs),
                "-append", f"console=ttyS0 panic=-1 unknown_nmi_panic quiet loglevel=4 hag_scenario={name} "
                           f"hag_host={i} hag_hosts={n_hosts}{words}",
                "-serial", f"file:{host.log}",
                "-chardev", f"socket,id=beat,path={host.beat_socket},server=on,wait=off,logfile={host.beat}",
                "-serial", "chardev:beat",
            ] + extra + nics
            host.process = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=open(logdir / f"{name}.host{i}.qemu.err", "w"),
                start_new_session=True,
            )
            hosts.append(host)
        if placement:
            placement.started([h.process.pid for h in hosts])
        shown = [0] * n_hosts

        def show_new_output():
            for h in hosts:
                text = h.text()
                on_output(h.index, text[shown[h.index]:])
                shown[h.index] = len(text)

        failed_at = None
        next_failure_check = 0.0
        while time.monotonic() - start < timeout:
            if on_output:
                show_new_output()
            for h in hosts:
                lose, fence = h.requests() if not h.killed else (False, [])
                if lose:
                    h.kill()
                for n in fence:
                    if n < len(hosts):
                        hosts[n].kill()
                        h.tell(f"off host{n}")
                h.poke()
            hung = [h for h in hosts if h.silent_for() > HANG_SECONDS]
            for h in hung:
                h.diagnose_hang(h.silent_for())
            for h in hosts:
                lost = h.lost_cpu()
                if lost:
                    h.diagnose_hang(lost)
                    hung.append(h)
            if hung or all(h.finished() for h in hosts):
                break
            # Every 2 s, not every tick: it reads each host's whole log.
            now = time.monotonic()
            if failed_at is None and now >= next_failure_check:
                next_failure_check = now + 2
                failed = [h for h in hosts if not h.killed and h.script_failed()]
                if failed:
                    failed_at = now
                    for h in hosts:
                        h.stopped_by = f"host{failed[0].index}'s scenario failed"
            if failed_at is not None and now - failed_at > FAILED_GRACE_SECONDS:
                break
            time.sleep(0.2)
        # Give a host that printed its result a moment to reboot (exit).
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(h.process.poll() is None for h in hosts):
            time.sleep(0.1)
        if on_output:
            show_new_output()
    finally:
        if placement:
            placement.stop()
        for h in hosts:
            if h.process.poll() is None:
                os.killpg(h.process.pid, signal.SIGKILL)
            h.process.wait()
        for hub in hubs:
            hub.close()
        for h in hosts:
            h.close_poke()
        shutil.rmtree(monitors, ignore_errors=True)

    result = Result(name, True, hosts=hosts, seconds=time.monotonic() - start)
    for h in hosts:
        judge_host(h, result, timeout)
    result.passed = not result.reasons
    return result


def judge_host(host, result, timeout):
    text = host.text()
    who = f"host{host.index}"
    end = SCRIPT_END.search(text)
    if host.hang:
        result.reasons.append(f"{who}: {host.hang}")
    elif host.killed:
        pass  # lost on purpose: judged on its kernel log up to then
    elif not end and host.stopped_by:
        result.reasons.append(f"{who}: stopped {FAILED_GRACE_SECONDS:.0f} s after {host.stopped_by}")
    elif not end:
        result.reasons.append(f"{who}: scenario did not finish (timeout {timeout} s or crash)")
    elif end.group(1) != "0":
        result.reasons.append(f"{who}: scenario exited {end.group(1)}")
    trouble = KERNEL_TROUBLE.search(text)
    if trouble:
        line = text[text.rfind("\n", 0, trouble.start()) + 1:].split("\n", 1)[0]
        result.reasons.append(f"{who}: kernel trouble: {line.strip()}")
    taint = re.search(r"HAG-TAINT (\d+)", text)
    if taint and int(taint.group(1)) & ~TAINT_OUT_OF_TREE:
        result.reasons.append(f"{who}: kernel tainted {taint.group(1)} (only {TAINT_OUT_OF_TREE}, out-of-tree, is allowed)")
