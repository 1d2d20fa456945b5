"""The checkpoint benchmark's placement: the protected VM's vCPU on a core
of its own, as on a real host where hagctl, QEMU's other threads and the
backup never take the VM's CPU.

On this machine the VM's vCPU is a thread of a KVM QEMU inside test host
0, whose own vCPUs are TCG threads of the outer QEMU. The placement:

- outer core 1 runs only test host 0's "CPU 1/TCG" thread;
- outer core 0 runs everything else: host 0's "CPU 0/TCG" (at a higher
  priority, nice -5), both hosts' main loops and I/O threads, host 1, the
  harness and its network hub, and every other process on the machine
  (moved there for the run, put back after);
- inside host 0 (kernel command line `isolcpus=1 irqaffinity=0`), its
  CPU 1 runs only the VM's vCPU thread, which the scenario pins there
  (`taskset`); hagctl, QEMU's other threads and the kernel's work stay on
  CPU 0. (`nohz_full` would also stop the tick on CPU 1; the test kernel
  has no NO_HZ_FULL, so the tick stays.)

A run is only as good as its isolation, so it is measured: `mark(label)`
takes a snapshot of the CPU time of every task that last ran on outer core
1 but the pinned thread, and of core 1's interrupt time, and
`interference(a, b)` is their growth between two marks as a share of the
time between them. (Not core 1's busy time less the thread's: /proc/stat
counts ticks, a task's time is its scheduler runtime, and the two differ
by more than the 2 % looked for.) The benchmark rejects a window where it
is over 2 %.
"""

import os
import re
import threading
import time

VM_CORE = 1
REST_CORE = 0
# The test host's vCPU that runs the VM's vCPU (its CPU 1, isolated).
VM_HOST_THREAD = "CPU 1/TCG"
BOOST_THREAD = "CPU 0/TCG"
HOST_WORDS = " isolcpus=1 irqaffinity=0 hag_placement=1"


def _tasks(pid):
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _comm(pid, tid):
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(pid, tid):
    """(utime + stime in clock ticks, the CPU it last ran on) of a task."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12]), int(fields[36])
    except (OSError, IndexError, ValueError):
        return None


def _irq_ticks(core):
    """irq + softirq clock ticks of one core, from /proc/stat."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith(f"cpu{core} "):
                v = [int(x) for x in line.split()[1:]]
                return v[5] + v[6]
    raise RuntimeError(f"no cpu{core} in /proc/stat")


def others_on(core, but):
    """{tid: CPU ticks} of every task that last ran on `core`, except
    `but`."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        for tid in _tasks(pid):
            st = _stat(pid, tid)
            if st and st[1] == core and tid != but:
                out[tid] = st[0]
    return out


def share(others0, others1, irq0, irq1, seconds, hz=100):
    """The share of `seconds` that tasks other than the VM's (their ticks
    at two marks; one new since the first counts whole) and interrupts
    took."""
    if seconds <= 0:
        return None
    ticks = sum(t - others0.get(tid, 0) for tid, t in others1.items()) + (irq1 - irq0)
    return max(0, ticks) / hz / seconds


class Placement:
    def __init__(self):
        if (os.cpu_count() or 1) < 2:
            raise RuntimeError("the placement needs two cores")
        self.vm_thread = None  # (pid, tid)
        self.saved = {}  # tid -> its affinity before the run
        self.marks = {}
        # {item id: share of outer core 1 that went elsewhere in its window}
        self.outer = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = None
        self.problem = None

    def host_words(self, index):
        return HOST_WORDS if index == 0 else ""

    def started(self, pids):
        self.pids = pids
        self.thread = threading.Thread(target=self._keep, daemon=True)
        self.thread.start()

    def _pin(self, tid, cores):
        try:
            old = os.sched_getaffinity(tid)
            if old != cores:
                os.sched_setaffinity(tid, cores)
                self.saved.setdefault(tid, old)
        except OSError:
            pass  # gone, or a per-CPU kernel thread

    def _place(self):
        host0 = self.pids[0]
        if self.vm_thread is None:
            names = {t: _comm(host0, t) for t in _tasks(host0)}
            vm = [t for t, n in names.items() if n == VM_HOST_THREAD]
            if not vm:
                return
            self.vm_thread = (host0, vm[0])
            for t, n in names.items():
                if n == BOOST_THREAD:
                    try:
                        os.setpriority(os.PRIO_PROCESS, t, -5)
                    except OSError as e:
                        self.problem = f"cannot raise {BOOST_THREAD}'s priority: {e}"
        self._pin(self.vm_thread[1], {VM_CORE})
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            for tid in _tasks(pid):
                if tid != self.vm_thread[1]:
                    self._pin(tid, {REST_CORE})

    def _keep(self):
        # New threads and processes appear all the time (QEMU's I/O
        # workers, the harness's commands): every 2 s they go to core 0.
        while not self.stopping.is_set():
            with self.lock:
                self._place()
            self.stopping.wait(2)

    def mark(self, label):
        """A snapshot at `label` of what else ran on outer core 1."""
        if self.vm_thread is None:
            return
        self.marks[label] = (time.monotonic(), others_on(VM_CORE, self.vm_thread[1]), _irq_ticks(VM_CORE))

    def window_line(self, tag, line):
        """Marks the start or end of an item's window as test host 0 says it
        ("TAGW0 ID" / "TAGW1 ID"); at its end, keeps the item's outer
        interference in `self.outer`."""
        w = re.match(rf"{tag}W([01]) (\d+)", line)
        if not w:
            return
        i = int(w.group(2))
        self.mark((w.group(1), i))
        if w.group(1) == "1":
            self.outer[i] = self.interference(("0", i), ("1", i))

    def interference(self, a, b):
        """The share of outer core 1 between marks `a` and `b` that went to
        anything but the VM's host vCPU thread (None: a mark is missing)."""
        if a not in self.marks or b not in self.marks:
            return None
        (t0, o0, i0), (t1, o1, i1) = self.marks[a], self.marks[b]
        return share(o0, o1, i0, i1, t1 - t0, os.sysconf("SC_CLK_TCK"))

    def stop(self):
        self.stopping.set()
        if self.thread:
            self.thread.join()
        for tid, cores in self.saved.items():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:
                pass
        # Tasks started during the run inherited core 0 alone: every core
        # again. (A task on core 0 alone by choice before the run cannot be
        # told apart from them; per-CPU kernel threads refuse the change.)
        everything = set(range(os.cpu_count() or 1))
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            for tid in _tasks(pid):
                try:
                    if tid not in self.saved and os.sched_getaffinity(tid) == {REST_CORE}:
                        os.sched_setaffinity(tid, everything)
                except OSError:
                    pass
