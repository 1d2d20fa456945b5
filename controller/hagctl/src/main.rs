//! `hagctl`: look at what the `hag_mdev` kernel module is doing.
//!
//! hag_mdev offers mediated vGPUs. hagctl is its userspace window: `status`
//! lists the vGPUs through the ioctls of `/dev/hag`, and `events` follows
//! the module's `hag` generic netlink family as vGPUs are created, opened,
//! hang or have commands rejected.
//!
//! Its promise:
//! - It speaks exactly one ABI, the one in `hag_abi` it was built with, and
//!   refuses a module (or a netlink family) of any other version instead of
//!   misreading it.
//! - Everything it receives from the kernel is checked before use; a
//!   malformed message is an error that says what was wrong, never a panic.
//! - Output is stable for scripts: `--json` gives one JSON object per line,
//!   and `events` flushes every line as it is printed.
//! - Any failure is one line on stderr, `hagctl: <what>: <why>` (stamped
//!   with the time when stderr is not a terminal, [`log`]; with
//!   `--json`, also one object on stdout), and an exit status that tells
//!   the outcomes a script must tell apart ([`exit`]: 1 for any other
//!   failure, 2 for a usage error).
//!
//! ```text
//! $ hagctl status
//! hag_mdev 0.1.0, ABI 3, features: sim
//! 1 vGPU
//!   ID  UUID                                  SOURCE  STATE  GFX-MEM
//!    1  83b8f4f2-509f-382f-3c1e-e6bfe0fa1001  sim     idle   64 MiB
//!       submissions 0, rejected 0, precise 0, fallback 0, commands 0, pages marked 0, interrupts 0, hangs 0, watchdog 2000 ms
//! $ hagctl events --count 1
//! vgpu-created vgpu=1 uuid=83b8f4f2-509f-382f-3c1e-e6bfe0fa1001 message="created"
//! ```
//!
//! `migrate` and `receive` move a VM with its vGPU to another host: a QEMU's
//! own migration, started, watched and reported over QMP (`--qmp`), or a
//! `hag-vmm` VM copied by hagctl itself (`--vm`). Both are written against
//! one VMM interface, [`vmm::Vmm`].
//!
//! All `unsafe` is in the shared `hag_dev` crate, around the `/dev/hag` ioctls.

mod admission;
mod backup;
mod checkpoint;
mod commands;
mod console;
mod events;
mod exit;
mod fence;
mod jobs;
mod libvirt_domain;
mod libvirt_hook;
mod libvirt_restore;
mod log;
mod migrate;
mod output;
mod page_cache;
mod pagehash;
mod plug;
mod primary;
mod replica;
mod reprotect;
mod schedule;
mod secure;
mod service;
mod stall;
mod standby_argv;
mod state_delta;
mod term;
mod test_switches;
mod units;
mod vm_dirs;
mod vm_shape;
// The VMM interface is whole; today's commands use only part of it (the
// QEMU checkpointing work is to use save_device_state; hag-vmm's pause is
// called through its client, for the workload's iteration).
#[cfg_attr(not(test), allow(dead_code))]
mod vmm;
mod vmm_migrate;
mod wire;
mod witness;

use crate::log::info;
use std::process::ExitCode;
use std::time::Duration;

/// Where the pre-shared key of a pair of hosts is, unless --key says.
const KEY_DEFAULT: &str = "/etc/hag/pair.key";

use clap::{ArgGroup, CommandFactory, FromArgMatches, Parser, Subcommand};
use hag_abi::abi;

const MIGRATE_HELP: &str = "\
Two ways to name the VM, one of them required:
  --qmp SOCKET  a QEMU (10 or later; usually under libvirt). QEMU migrates
                the VM itself; hagctl starts, watches and reports it.
  --vm SOCKET   a hag-vmm test VM; hagctl copies it with its own protocol.
Each mode's options say '--qmp:' or '--vm:' and are refused in the other.

WITH --qmp (QEMU)

What hagctl does: connects to QEMU's QMP socket (QEMU serves one client per
socket: under libvirt, give QEMU a second -qmp socket for hagctl); checks
that the VM is running or paused and not migrating; reads query-migrate's
blocked-reasons and, if there are any, refuses naming each; sets the
capabilities (return-path=on unless --capability return-path=off,
x-ignore-shared=off unless given, since a killed hagctl checkpoint leaves it
on, then each --capability in order), downtime-limit (--max-downtime, default 300 ms,
QEMU's own default), max-bandwidth (--bandwidth; default: QEMU's setting as
it is, 128 MiB/s in QEMU 10 unless changed) and each --parameter; then
'migrate' with uri tcp:HOST:PORT. QEMU's refusal of any of these is named.
A target that refuses the connection (not listening yet) is retried for
--connect-timeout.

What QEMU does: all the rest. It copies guest RAM in rounds while the VM
runs (KVM's dirty log; for a hag vGPU also the pages of its VFIO
DMA-logging report), pauses the VM once the rest fits in the downtime
limit, sends the last pages and the device state (the vGPU's context
through VFIO migration v2), and the target loads it and starts the VM.
With return-path the target tells the source whether it loaded everything,
after starting its VM; QEMU completes only then, and otherwise fails the
migration and resumes the source VM.

The VM must never run twice: after success the source QEMU is paused in
postmigrate, and hagctl ends it (QMP quit). --keep-source leaves it paused
instead (never 'cont' it while the target runs). With return-path off the
source cannot know that the target loaded the state, so hagctl leaves it
paused whatever the options, and says so.

SIGINT or SIGTERM (Ctrl-C) during the migration, or --cancel-after, sends
migrate_cancel: QEMU stops and the source VM runs on; hagctl reports its
run state and exits 1. A second signal exits at once (status 130). A
migration that completed before the cancel took is a success.

--copy-storage moves the VM's local disks too, as virsh migrate --live
--copy-storage-all does, with QEMU's own machinery; the target runs hagctl
receive --copy-storage. Before the migration, for each writable disk
(query-block; read-only disks and empty CD-ROMs need nothing) hagctl adds
an NBD client node (blockdev-add, driver nbd) for the target's NBD export
named by the disk's device id (vda), at --nbd (default: the --to host, port
10809; a target not serving yet is retried for --connect-timeout), checks
that it has the disk's virtual size, and mirrors the disk into it
(blockdev-mirror sync=full copy-mode=write-blocking, job hag-mirror-ID).
Progress on stderr until every mirror is ready:
  mirror at 2.1 s: vda 1.2 GiB of 8.00 GiB (running)
(--json: {\"elapsed_ms\", \"mirror\": [{\"disk\", \"job\", \"status\", \"copied\",
\"total\", \"error\"}]}). Then the migration runs as above; ready mirrors
write every guest write to both hosts, so they stay in sync. Once it
completed (the source paused), block-job-cancel completes each mirror
without pivoting (the source stays on its own disks), the NBD nodes are
deleted, which lets the target resume the VM, and the source QEMU is ended.
Any failure before that cancels the mirrors and deletes the NBD nodes: the
source VM runs on, on its own disks. Refused, naming the disk: a disk
device whose writes bypass QEMU's block layer (vhost-user-blk, …), a
writable disk without a device id, a target with no export of that name or
of another virtual size.

Other QEMU capabilities and parameters, by QEMU's names (see QEMU's
migrate-set-capabilities and migrate-set-parameters; those marked * must be
set on the target too, with hagctl receive --capability/--parameter):
  --capability multifd=on* with --parameter multifd-channels=N*
  --capability x-ignore-shared=on*  RAM in a shared backend is not sent
  --capability switchover-ack=on*   the target acknowledges VFIO precopy data
  --capability auto-converge=on     throttle vCPUs that dirty too fast
  --capability events=on            QEMU emits MIGRATION events
  --parameter avail-switchover-bandwidth=BYTES, multifd-compression=zstd*,
  tls-creds=ID (VALUE is JSON if it parses as JSON, else a string)

Progress on stderr, about once a second:
  migration active at 3.2 s: 12.0 MiB sent, 40.0 MiB of 64.0 MiB left, dirtying 1200 pages/s, round 3, expected downtime 120 ms, 136.4 Mbit/s
With --json each is one JSON object per line instead: {\"status\",
\"elapsed_ms\", \"transferred\", \"remaining\", \"total\", \"dirty_pages_rate\",
\"rounds\", \"expected_downtime_ms\", \"mbps\"}, null where QEMU says nothing yet.
hagctl's other stderr lines start with 'hagctl:'.

Report on stdout, QEMU's own figures (downtime, total-time, setup-time,
ram.transferred, ram.dirty-sync-count as rounds, ram.mbps):
  migrated to 192.0.2.11:7100 by QEMU 10.0.2 at vm.qmp: downtime 15 ms, total time 48 ms (setup 5 ms), 716.1 KiB transferred in 2 rounds, 136.4 Mbit/s
    RAM 64.5 MiB, 12.0 KiB sent during downtime, VFIO device state 1.0 MiB, downtime limit 300 ms
    source: QEMU ended (quit); the VM runs on the target only
JSON (--json): one object with to, vmm, status, downtime_ms,
total_time_ms, setup_time_ms, transferred_bytes, rounds, throughput_mbps,
ram_total_bytes, downtime_bytes, vfio_transferred_bytes, downtime_limit_ms,
max_bandwidth (bytes/s), capabilities [\"NAME=on|off\"], attempts, source
(quit, kept-paused, paused-no-return-path), and with --copy-storage disks
(each mirror as the migration started); null where QEMU said nothing.
Failure: one line with QEMU's error-desc (or each blocker) and what the
source VM does now, exit status 1.

WITH --vm (hag-vmm)

Iterative pre-copy of guest RAM: round 0 sends every non-zero page, each
later round the pages the VM's CPU dirtied (from the VMM) or its GPU dirtied
(from hag's dirty log), until a round would send at most --threshold-pages
or --max-rounds is reached. Then stop-and-copy: pause the VM, quiesce the
vGPU, send the last dirty pages, the vGPU context and the VM state; the
target restores them and resumes, and the source VM is stopped. Before the
target's acknowledgement, any failure resumes the source VM and discards
the target's.

Progress on stderr, one line per round:
  round 3: 412 pages, 1.6 MiB → 0.3 MiB compressed
Text report on stdout:
  migrated to 192.0.2.11:7100: downtime 84.2 ms (quiesce 1.3 ms), 3 rounds, …
    round 0 (precopy): 240 pages (0 zero; cpu 0, gpu 0), 0.9 MiB → 0.1 MiB on the wire, 210.4 ms
JSON report (--json): one object with downtime_ms, quiesce_ms, rounds,
per_round [{round, kind, pages, zero_pages, cpu_dirty, gpu_dirty, raw_bytes,
wire_bytes, ms}], total_pages, total_bytes, downtime_bytes, context_bytes,
vm_state_bytes, paused_at_iteration, gpu_dirty, total_ms.

--gpu-dirty says where the GPU's dirty pages come from (the report's
gpu_dirty_mode):
  audit  hag's audited GPU dirty log (the default);
  full   no tracking: during stop-and-copy, every guest page the vGPU's GTT
         maps (read from the saved vGPU context) is copied; the report then
         has gpu_full_copy true and gtt_pages (--gpu-full-copy is the same);
  hash   page hashing: each pre-copy round hashes every page of guest RAM,
         stop-and-copy every GTT-mapped page, and sends those whose hash
         changed since sent; the report has hashed_pages and hash_ms (also
         per round), the cost of it;
  none   ignore the GPU: pages only the GPU wrote are missed, which the
         workload's own check must catch (for tests; --no-gpu-dirty).
--no-compress sends every page raw (zero pages too) instead of LZ4.

--inject-fault damages the stream on purpose (for tests only):
corrupt-page flips a byte of the last PAGES frame of round 0 after its CRC
was computed; truncate-context sends half of the CONTEXT frame during
stop-and-copy and closes the connection. The target must refuse and discard
its VM, and the source VM must run on.";

const RECEIVE_HELP: &str = "\
Two ways to name the incoming VM, one of them required:
  --qmp SOCKET  a QEMU started with -incoming defer: QEMU receives the
                migration itself; hagctl has it listen, and waits.
  --vm SOCKET   a 'hag-vmm serve --incoming' VM: hagctl receives the stream.

WITH --qmp (QEMU)

hagctl checks that QEMU waits for a migration (run state inmigrate, no
migrate-incoming yet), sets each --capability and --parameter (the ones a
source setting needs on both sides: multifd, multifd-channels,
x-ignore-shared, switchover-ack, …), then issues migrate-incoming with uri
tcp:ADDR:PORT and exit-on-error false, so that a failed migration leaves
QEMU up to say why. On stderr: 'hagctl: QEMU … waits for a migration on
ADDR:PORT' (with the port QEMU got, for port 0). It then waits until
query-migrate says completed and query-status says running.

QEMU does the rest: it accepts the source's connection, loads RAM and the
device state (the vGPU's context through VFIO migration v2: a vGPU that
refuses a damaged state fails the load), starts the VM and tells the source
over the return path. A VM that arrives paused (QEMU started with -S, as
libvirt does, or the VM was paused on the source) is resumed with --cont,
and else waited for (someone else may 'cont' it).

A failed migration: hagctl prints QEMU's error-desc (QEMU's own log, its
stderr, names the device that refused), ends that QEMU (quit; --keep-failed
leaves it) and exits 1; the source VM runs on. --timeout (default: none)
ends the wait with exit status 1 and leaves QEMU as it is.

--copy-storage receives the VM's local disks from hagctl migrate
--copy-storage. QEMU must have been started with -S as well as -incoming
defer (hagctl refuses otherwise): without -S it would run the VM the moment
its RAM arrived, before the source finished mirroring the disks. Each disk
needs an image of the same virtual size at the path this QEMU opens (its
content is overwritten). Before listening for the migration, hagctl starts
QEMU's NBD server on --nbd (default: the --listen address, port 10809;
nbd-server-start) and exports each writable disk, writable, under its
device id (block-export-add; read-only disks and empty CD-ROMs are left
out). Once the migration completed, it waits until the source has let go of
every export (block-export-del mode=safe, retried within --timeout), stops
the NBD server (nbd-server-stop) and resumes the VM (cont). A failed
migration removes the exports.

Text report: 'received on ADDR:PORT by QEMU 10.0.2 at vm.qmp: migration
completed 1.2 s after listening (48 ms after the source began), VM running
here'. JSON (--json): {listen, vmm, status, run_state, resumed (by --cont),
waited_ms (listening to completed), transfer_ms (the source's first data to
completed, to within 100 ms), running_ms, and with --copy-storage disks
[device ids]}.

WITH --vm (hag-vmm)

Listens on ADDR:PORT for one `hagctl migrate`, writes the pages into the
incoming VM's guest RAM (hag-vmm serve --incoming), restores the vGPU
context into its vGPU, sets the VM state and resumes it. If the stream is
damaged, truncated or aborted, the incoming VM is told to quit.

Text report: 'received from ADDR: N rounds, P pages (Z zero), … VM resumed
here'. JSON (--json): {from, rounds, pages, zero_pages, context_bytes,
vm_state_bytes, bytes, resumed}.";

#[derive(Parser)]
#[command(
    name = "hagctl",
    about = "High availability for VMs with vGPUs: migrate them, protect them with \
             continuous checkpoints to a backup host, take over, and inspect the hag_mdev module",
    long_about = "High availability for VMs with vGPUs: migrate them (migrate, receive), \
                  protect them with continuous checkpoints to a backup host (checkpoint, \
                  backup), take over when their GPU hangs or their host is lost, and \
                  inspect the hag_mdev kernel module: its vGPUs (through /dev/hag) and its \
                  events (through the 'hag' generic netlink family).\n\n\
                  hagctl refuses a module built for another ABI version. On failure it prints \
                  one line, 'hagctl: <what>: <why>' (with --json also {\"error\": …, \
                  \"exit_status\": N} on stdout).",
    after_long_help = exit::HELP
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Print errors and warnings only (no progress lines)
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    /// Print debug lines too
    #[arg(short, long, global = true)]
    verbose: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Show the module's version and features, and list its vGPUs
    #[command(after_long_help = "\
Text output: a line 'hag_mdev VERSION, ABI N, features: LIST', a count, and a
table with the columns ID, UUID, SOURCE (sim, gvt), STATE (idle, open) and
GFX-MEM. Under each vGPU's row, a line of its counters (IOC_VGPU_STATS):
  submissions 8, rejected 0, precise 8, fallback 0, commands 528, pages marked 129, interrupts 8, hangs 0, watchdog 2000 ms
submissions are audited doorbell writes (GVT-g: workloads GVT handed over),
rejected those the auditor refused, precise the workloads whose write set was
modelled exactly, fallback those for which every page the vGPU can reach was
marked instead (GVT-g only: hag-sim rejects what it cannot model; a GVT-g
workload counts when GVT says it is done), commands those the engine ran,
pages marked the dirty-log markings of audited write sets, hangs the
watchdog's (or injected) hangs; watchdog is the vGPU's hang timeout. A vGPU
removed while hagctl reads shows 'no counters'.

JSON output (--json), one object:
  {\"abi_version\": 3, \"module_version\": \"0.1.0\", \"features\": [\"sim\"],
   \"vgpus\": [{\"id\": 1, \"uuid\": \"…\", \"source\": \"sim\", \"state\": \"idle\",
               \"gfx_mem_size\": 67108864,
               \"stats\": {\"submissions\": 8, \"rejected\": 0,
                         \"precise_workloads\": 8, \"fallback_workloads\": 0,
                         \"commands\": 528,
                         \"pages_marked\": 129, \"interrupts\": 8, \"hangs\": 0,
                         \"watchdog_ms\": 2000}}]}
gfx_mem_size is in bytes; stats is null for a vGPU removed while hagctl reads.")]
    Status {
        /// Print one JSON object instead of text
        #[arg(long)]
        json: bool,
    },
    /// Print the module's events as they happen, one line each
    #[command(after_long_help = "\
Events: vgpu-created, vgpu-removed, vgpu-hung, command-rejected, state-changed
(an event this hagctl does not know prints as 'unknown kind=N').

Text output, one line per event; absent fields are left out:
  vgpu-created vgpu=1 uuid=83b8f4f2-509f-382f-3c1e-e6bfe0fa1001 message=\"…\"

JSON output (--json), one object per line; absent fields are left out:
  {\"event\": \"vgpu-created\", \"vgpu\": 1, \"uuid\": \"…\", \"timestamp_ns\": 123,
   \"message\": \"…\"}
  timestamp_ns is the kernel's monotonic clock (ktime_get_ns); \"kind\" (the
  number) appears only when \"event\" is \"unknown\".

Once subscribed, hagctl prints 'hagctl: listening for hag events' on stderr.
Every line of stdout is flushed as soon as it is printed.")]
    Events {
        /// Print one JSON object per event instead of text
        #[arg(long)]
        json: bool,
        /// Exit (status 0) after N events
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        count: Option<u64>,
        /// Stop after DURATION (30s, 2m; a bare number is seconds); with
        /// --count, not having seen N events by then is an error
        #[arg(long, value_name = "DURATION", value_parser = units::seconds)]
        timeout: Option<Duration>,
    },
    /// Live-migrate a VM with its vGPU: a QEMU (--qmp) or a hag-vmm (--vm)
    #[command(group(ArgGroup::new("source").required(true).args(["vm", "qmp"])))]
    #[command(after_long_help = MIGRATE_HELP)]
    Migrate {
        /// Control socket of the source hag-vmm VM (hag-vmm serve --control)
        #[arg(long, value_name = "SOCKET")]
        vm: Option<std::path::PathBuf>,
        /// QMP socket of the source QEMU (QEMU migrates the VM itself)
        #[arg(long, value_name = "SOCKET")]
        qmp: Option<std::path::PathBuf>,
        /// The target: where `hagctl receive` listens (or has QEMU listen)
        #[arg(long, value_name = "HOST:PORT")]
        to: String,
        /// --vm: most rounds, the stop-and-copy one included (at least 2)
        #[arg(long, value_name = "N", default_value_t = 8, conflicts_with = "qmp",
              value_parser = clap::value_parser!(u32).range(2..=1000))]
        max_rounds: u32,
        /// --vm: stop and copy once at most this many pages are dirty
        #[arg(long, value_name = "N", default_value_t = 256, conflicts_with = "qmp")]
        threshold_pages: u64,
        /// --vm: how long the vGPU may take to go idle at stop time
        #[arg(long, value_name = "MS", default_value_t = 2000, conflicts_with = "qmp",
              value_parser = clap::value_parser!(u32).range(1..=i64::from(abi::QUIESCE_MAX_MS)))]
        quiesce_timeout_ms: u32,
        /// --vm: where the GPU's dirty pages come from: audit, full, hash, none
        #[arg(long, value_name = "MODE", value_enum, default_value_t = migrate::GpuDirty::Audit,
              conflicts_with = "qmp")]
        gpu_dirty: migrate::GpuDirty,
        /// Same as --gpu-dirty none
        #[arg(long, conflicts_with_all = ["gpu_dirty", "gpu_full_copy", "qmp"], hide_short_help = true)]
        no_gpu_dirty: bool,
        /// Same as --gpu-dirty full
        #[arg(long, conflicts_with_all = ["gpu_dirty", "qmp"], hide_short_help = true)]
        gpu_full_copy: bool,
        /// --vm: send pages raw instead of LZ4-compressed (baseline)
        #[arg(long, conflicts_with = "qmp")]
        no_compress: bool,
        #[command(flatten)]
        test: test_switches::Migrate,
        /// --vm: the pre-shared key file this host and the target hold
        /// (hagctl keygen makes one)
        #[arg(long, value_name = "FILE", default_value = KEY_DEFAULT, conflicts_with = "qmp")]
        key: std::path::PathBuf,
        /// Keep trying to reach the target for DURATION (a bare number is
        /// seconds; --qmp: retry while the target refuses the connection)
        #[arg(long, value_name = "DURATION", default_value = "30", value_parser = units::seconds)]
        connect_timeout: Duration,
        /// The longest pause wanted for the last round (300ms, 1s; a bare
        /// number is ms, as QEMU's downtime-limit, at most 2000 s; --vm:
        /// stop and copy once the remaining pages fit in it at the
        /// measured bandwidth)
        #[arg(long, value_name = "DURATION", default_value = "300", value_parser = max_downtime)]
        max_downtime: Duration,
        /// Bandwidth limit (QEMU's max-bandwidth) per second: 100 (a bare
        /// number is MiB/s, as virsh's), 512K, 1.5G/s, 100MB/s; default:
        /// QEMU's setting (--vm: unlimited)
        #[arg(long, value_name = "RATE", value_parser = units::rate)]
        bandwidth: Option<u64>,
        /// --qmp: set a migration capability, NAME=on|off (repeatable)
        #[arg(long, value_name = "NAME=on|off", conflicts_with = "vm",
              value_parser = vmm_migrate::parse_capability)]
        capability: Vec<(String, bool)>,
        /// --qmp: set a migration parameter, NAME=VALUE (repeatable)
        #[arg(long, value_name = "NAME=VALUE", conflicts_with = "vm",
              value_parser = vmm_migrate::parse_parameter)]
        parameter: Vec<(String, serde_json::Value)>,
        /// --qmp: leave the source QEMU paused (postmigrate) after success
        /// instead of ending it
        #[arg(long, conflicts_with = "vm")]
        keep_source: bool,
        /// --qmp: cancel a migration still running after DURATION
        /// (migrate_cancel: the VM runs on here; not virsh migrate
        /// --timeout, which suspends the VM so that it can finish)
        #[arg(long, value_name = "DURATION", conflicts_with = "vm", value_parser = units::seconds)]
        cancel_after: Option<Duration>,
        /// --qmp: copy the VM's local disks too: mirror each writable disk
        /// to the target's NBD export of the same name (hagctl receive
        /// --copy-storage) before migrating, as virsh migrate
        /// --copy-storage-all does
        #[arg(long, conflicts_with = "vm")]
        copy_storage: bool,
        /// --copy-storage: where the target serves the disks over NBD
        /// (default: the --to host, port 10809)
        #[arg(long, value_name = "HOST:PORT", requires = "copy_storage",
              value_parser = vmm::MigrationAddress::parse_tcp)]
        nbd: Option<vmm::MigrationAddress>,
        /// Print the report as one JSON object (--qmp: progress too, as
        /// JSON lines on stderr)
        #[arg(long)]
        json: bool,
    },
    /// Protect a VM (QEMU/KVM or hag-vmm) with continuous checkpoints to a `hagctl backup`
    #[command(after_long_help = "\
The first checkpoint is a full copy while the VM runs (pre-copy rounds, as
in migrate), then an epoch. Every --interval, an epoch: pause the VM,
quiesce the vGPU, copy the pages the CPU and the GPU dirtied since the last
epoch, the vGPU context and the VM state, resume the vGPU and the VM, then
stream the epoch and wait for the backup's acknowledgement (the VM runs
meanwhile). The VM's output is held until the epoch it belongs to is
acknowledged: a hag-vmm VM's console (its --progress lines and PASS/FAIL
line); a QEMU VM's network packets on --plug's interface and its serial
console with --console (released to --console-log), from the first epoch
on: during the first synchronisation nothing could be taken over, so
they flow.

Per epoch, on stderr:
  epoch 12: pause 14.2 ms (quiesce 0.3), 310 pages (cpu 200, gpu 150; 180 as deltas), 0.31 MiB, acked in 9.8 ms
A page the backup already holds as hagctl last sent it (kept in
--page-cache, as QEMU's XBZRLE cache) goes as the LZ4 block of its XOR
with those bytes where that is smaller: a page dirtied again in a few
bytes costs tens of bytes, not a compressed page.
A vgpu-hung event for the VM's vGPU (or its hang counter moving) stops the VM
and tells the backup to take over from the last acknowledged epoch. A
backup answering with a newer generation took over: the VM is stopped. A
backup silent past --failover-timeout (the backup's own, told at pairing)
leaves the VM running unprotected with its output still held: the backup
may still hear this host, or take over from its last checkpoint, so
nothing it did not acknowledge goes out (docs/ha.md). hagctl retries every
--interval and resynchronises; the next acknowledged epoch releases.
SIGINT/SIGTERM end protection: ABORT on every connection; once the backup
confirms it discarded its checkpoint the output is released and the VM runs
on unprotected (outcome ended); unconfirmed within the failover timeout,
the VM is stopped (outcome vm-stopped). Every connection to the backup is
authenticated and encrypted with the pair's key (--key; hagctl keygen).
--heartbeat-addr adds heartbeat paths (another network to the backup's
--heartbeat-listen), kept up whether or not the checkpoint stream is: a
backup still hearing the primary on one does not take over when the data
link fails (a partition), and waits for the primary to resynchronise.
The state is in STATUS_DIR/checkpoint-vgpuN.json ('hagctl status' shows it;
with --name VM, STATUS_DIR is /run/hag/VM).

--gpu-dirty (audit, full, hash) and --no-compress choose the baselines of
the evaluation as in migrate: full copies every GTT-mapped page at every
epoch, hash hashes them at every epoch and sends the changed ones.

Report on stdout when it ends (--json: one object with outcome, detail,
generation, epochs, syncs, sync_bytes, pause_ms_mean, pause_ms_max,
ack_ms_mean, epoch_bytes, gpu_dirty_mode, compress, per_epoch [{epoch,
pause_ms, quiesce_ms, stop_ms, dirty_ms, state_ms, copy_ms, resume_ms,
pages, delta_pages, cpu_dirty, gpu_dirty, bytes, raw_bytes, ack_ms, iteration,
released, gpu_bytes_written, hashed_pages, hash_ms}] for the last 1000
epochs, per_epoch_dropped the older ones; the totals count every epoch).
The pause's steps:
stop_ms pausing the VM, quiesce_ms the vGPU going idle, dirty_ms collecting
the dirty logs, state_ms the VM's device state, copy_ms the dirty pages,
resume_ms resuming. gpu_bytes_written is what the vGPU's engine wrote
since the last epoch (hag-sim's counter). released: console lines let out
(hag-vmm), or how many output gates let something out (QEMU). outcome: finished, finished-unconfirmed (the VM
finished but the backup did not confirm the end: it may still resume the
last epoch), ended, handed-over, fenced, stop-failed or vm-stopped; hagctl
exits 4 on finished-unconfirmed, 3 on fenced and 5 on stop-failed.")]
    #[command(group(ArgGroup::new("protected").required(true).args(["vm", "qmp"])))]
    Checkpoint {
        /// Control socket of a hag-vmm VM (hag-vmm serve --control)
        #[arg(long, value_name = "SOCKET")]
        vm: Option<std::path::PathBuf>,
        /// QMP socket of a QEMU VM (hagctl's own -qmp socket; guest RAM in a
        /// shared memory backend, one hag vGPU as vfio-pci)
        #[arg(long, value_name = "SOCKET")]
        qmp: Option<std::path::PathBuf>,
        /// --qmp: hold the VM's network output on this interface (its packets
        /// leave this host by its egress: sch_plug, released per
        /// acknowledged epoch)
        // (conflicts_with: clap did not enforce `requires = "qmp"` with
        // --vm, a member of the same required group, given.)
        #[arg(long, value_name = "IFNAME", requires = "qmp", conflicts_with = "vm")]
        plug: Option<String>,
        /// --qmp: hold the VM's serial console, a QEMU socket chardev
        /// (-chardev socket,id=con0,path=SOCKET,server=on,wait=off -serial
        /// chardev:con0), released per acknowledged epoch to --console-log
        #[arg(long, value_name = "SOCKET", requires_all = ["qmp", "console_log"], conflicts_with = "vm")]
        console: Option<std::path::PathBuf>,
        /// The file the console's released output is appended to
        #[arg(long, value_name = "FILE", requires = "console")]
        console_log: Option<std::path::PathBuf>,
        #[command(flatten)]
        test: test_switches::Checkpoint,
        /// Where a QEMU VM's disk deltas wait between their capture and
        /// their sending (a directory per QEMU process; the first
        /// synchronisation's holds a copy of each disk's allocated data)
        /// [default: STATE_DIR/deltas]
        #[arg(long, value_name = "DIR", requires = "qmp")]
        delta_dir: Option<std::path::PathBuf>,
        /// Where `hagctl backup` listens
        #[arg(long, value_name = "HOST:PORT")]
        backup: String,
        /// Another address of the backup (its --heartbeat-listen, on another
        /// network) to send heartbeats on (repeatable)
        #[arg(long, value_name = "HOST:PORT")]
        heartbeat_addr: Vec<String>,
        /// Time between epochs (2s, 500ms; a bare number is seconds)
        #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = units::seconds)]
        interval: Duration,
        /// Backup silence before the VM runs on unprotected
        #[arg(long, value_name = "DURATION", default_value = "3", value_parser = units::seconds)]
        failover_timeout: Duration,
        /// This primary's generation (after a takeover, the new pair's)
        #[arg(long, value_name = "N", default_value_t = 0)]
        generation: u64,
        /// How long the vGPU may take to go idle at each epoch
        #[arg(long, value_name = "MS", default_value_t = 2000,
              value_parser = clap::value_parser!(u32).range(1..=i64::from(abi::QUIESCE_MAX_MS)))]
        quiesce_timeout_ms: u32,
        /// Pre-copy rounds at most for the first checkpoint
        #[arg(long, value_name = "N", default_value_t = 8,
              value_parser = clap::value_parser!(u32).range(2..=1000))]
        max_rounds: u32,
        /// Pre-copy ends once at most this many pages are dirty
        #[arg(long, value_name = "N", default_value_t = 256)]
        threshold_pages: u64,
        /// Where the GPU's dirty pages come from: audit, full, hash
        #[arg(long, value_name = "MODE", default_value = "audit", value_parser = checkpoint_gpu_dirty)]
        gpu_dirty: migrate::GpuDirty,
        /// Send pages raw instead of LZ4-compressed (baseline)
        #[arg(long)]
        no_compress: bool,
        /// Memory for the pages the backup holds, as last sent: an epoch's
        /// page found there goes as a delta against it (QEMU's
        /// xbzrle-cache-size; 0: every page whole)
        #[arg(long, value_name = "SIZE", default_value = "64MiB", value_parser = units::size_or_zero)]
        page_cache: u64,
        /// Keep trying to reach the backup at start for DURATION
        #[arg(long, value_name = "DURATION", default_value = "30", value_parser = units::seconds)]
        connect_timeout: Duration,
        #[command(flatten)]
        dirs: vm_dirs::VmDirArgs,
        /// Do not read /etc/hag/VM.conf or the libvirt domain's
        /// /run/hag/VM/libvirt.conf for --name VM
        #[arg(long)]
        no_config: bool,
        /// The pre-shared key file this host and the backup hold
        #[arg(long, value_name = "FILE", default_value = KEY_DEFAULT)]
        key: std::path::PathBuf,
        #[command(flatten)]
        witness: witness::WitnessArgs,
        /// Print one JSON object instead of text
        #[arg(long)]
        json: bool,
    },
    /// Stand by for a `hagctl checkpoint` primary and take over its VM
    #[command(after_long_help = "\
Keeps a standby image of the primary's VM (guest RAM in a memfd, the last
acknowledged vGPU context and VM state); each epoch is applied whole and
then acknowledged. It does not run the VM until it takes over: when the
primary reports a vGPU hang, or is silent past --failover-timeout on every
heartbeat path (--listen and each --heartbeat-listen; silent on the data
link but heard on another path, the primary is alive: it waits). Then it
starts `VMM serve --incoming --mdev UUID --control SOCKET --ram-mib M`,
fills its RAM from the image, restores the context into this host's vGPU,
sets the VM state and resumes it, raising the generation, and prints
  takeover: generation 1, resumed from epoch 12 in 85.3 ms (…): REASON
(--json: {reason, generation, epoch, takeover_ms, start_vm_ms, fill_ms,
restore_ms, pages}). The VM's output follows on stdout; hagctl exits 0
when the VM taken over here ends well, 7 (naming its status) when it
fails. If the primary ends protection (its VM finished), it exits 0
without a takeover. Its status: STATUS_DIR/backup.json; its generation,
stored before each takeover's fence: STATE_DIR/generation.json; with --name
VM, STATE_DIR is /var/lib/hag/VM and STATUS_DIR /run/hag/VM.")]
    Backup {
        /// Address and port to listen on
        #[arg(long, value_name = "ADDR:PORT")]
        listen: String,
        /// Also listen here for the primary's heartbeats (another path, on
        /// another network; repeatable)
        #[arg(long, value_name = "ADDR:PORT")]
        heartbeat_listen: Vec<String>,
        /// This host's hag-sim mdev for a hag-vmm VM at takeover
        #[arg(long, value_name = "UUID", required_unless_present_any = ["qemu", "libvirt_domain"])]
        mdev: Option<String>,
        /// Control socket of the hag-vmm VM started at takeover [default:
        /// STATUS_DIR/hag-vmm.sock]
        #[arg(long, value_name = "SOCKET")]
        control: Option<std::path::PathBuf>,
        /// The VMM binary
        #[arg(long, value_name = "PATH", default_value = "hag-vmm")]
        vmm: std::path::PathBuf,
        /// Extra argument for `VMM serve` (repeatable)
        #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
        vmm_arg: Vec<String>,
        /// Primary silence before takeover
        #[arg(long, value_name = "DURATION", default_value = "3", value_parser = units::seconds)]
        failover_timeout: Duration,
        /// Generation to start at
        #[arg(long, value_name = "N", default_value_t = 0)]
        generation: u64,
        /// Where this backup's files go; its generation
        /// (STATE_DIR/generation.json) is read back at start: a restarted
        /// or rebooted backup never goes below a takeover
        #[command(flatten)]
        dirs: vm_dirs::VmDirArgs,
        /// Do not read /etc/hag/VM.conf or the libvirt domain's
        /// /run/hag/VM/libvirt.conf for --name VM
        #[arg(long)]
        no_config: bool,
        /// Where the replicas of a QEMU VM's writable disks are kept, one
        /// raw file per disk, DIR/ID.raw (ID: the disk's device id); the
        /// standby QEMU command line must open each [default:
        /// STATE_DIR/replicas]
        #[arg(long, value_name = "DIR")]
        replica_dir: Option<std::path::PathBuf>,
        /// The pre-shared key file this host and the primary hold
        #[arg(long, value_name = "FILE", default_value = KEY_DEFAULT)]
        key: std::path::PathBuf,
        /// Largest guest RAM a primary may ask for (a resync holds two
        /// images of it for a while): 16GiB, 512MiB, 4096 (MiB)
        #[arg(long, value_name = "SIZE", default_value = "16GiB", value_parser = units::size)]
        max_ram: u64,
        /// Authenticated connections open at once, at most (more are
        /// closed at once; handshakes have a pool of their own)
        #[arg(long, value_name = "N", default_value_t = 16,
              value_parser = clap::value_parser!(u64).range(2..=1024))]
        max_connections: u64,
        #[command(flatten)]
        test: test_switches::Backup,
        /// Print the takeover report as JSON
        #[arg(long)]
        json: bool,
        /// Fence the primary before every takeover: run `sh -c CMD` (with
        /// HAG_PEER, the primary's address, HAG_LISTEN, HAG_GENERATION,
        /// HAG_EPOCH and HAG_REASON in its environment); the takeover
        /// goes on only if it exits 0 within --fence-peer-timeout (as
        /// DRBD's fence-peer handler)
        #[arg(long, value_name = "CMD")]
        fence_peer: Option<String>,
        /// How long --fence-peer may run before it is killed and counted
        /// as failed
        #[arg(long, value_name = "DURATION", default_value = "60", value_parser = units::seconds,
              requires = "fence_peer")]
        fence_peer_timeout: Duration,
        /// What the primary's silence past --failover-timeout does:
        /// takeover, or hold (a cluster manager decides, and asks for the
        /// takeover with `hagctl takeover` once it fenced the primary; a
        /// forwarded GPU hang still takes over at once)
        #[arg(long, value_name = "WHAT", value_enum, default_value_t = backup::OnSilence::Takeover)]
        on_silence: backup::OnSilence,
        #[command(flatten)]
        witness: witness::WitnessArgs,
        /// Guest RAM of this VM from before, as a file (the old primary's
        /// RAM file when its host stands by again): a new session's image
        /// starts as it when this backup holds no checkpoint, and the
        /// primary sends only the pages that differ (checked by hashes)
        #[arg(long, value_name = "FILE")]
        ram_seed: Option<std::path::PathBuf>,
        /// After a takeover, protect the VM taken over here with the backup
        /// at HOST:PORT (the old primary's host once it stands by again, or
        /// another): `hagctl checkpoint --qmp` on it at the takeover's
        /// generation, started again every 5 s while that backup cannot be
        /// reached (QEMU standbys only)
        #[arg(long, value_name = "HOST:PORT")]
        reprotect: Option<String>,
        /// More `hagctl checkpoint` arguments for --reprotect, one
        /// shell-quoted string ("--interval 2s --plug vnet0-out")
        #[arg(
            long,
            value_name = "ARGS",
            requires = "reprotect",
            allow_hyphen_values = true
        )]
        reprotect_args: Option<String>,
        /// The standby's QEMU command line is the one libvirt would start
        /// this domain XML with (`virsh domxml-to-native qemu-argv`), each
        /// writable disk opening its replica in --replica-dir as raw; it
        /// is printed on stderr (instead of -- QEMU ARGS)
        #[arg(long, value_name = "DOMAIN.xml", conflicts_with = "qemu")]
        libvirt_domain: Option<std::path::PathBuf>,
        /// With --libvirt-domain: a takeover has libvirtd restore the domain
        /// (`virsh restore --paused` of the epoch written as a save image,
        /// guest RAM the standby image), so the survivor is that libvirt
        /// domain; the hook must be installed on this host
        /// (docs/libvirt.md)
        #[arg(long, requires = "libvirt_domain")]
        takeover_by_libvirt: bool,
        /// The libvirt connection URI virsh uses for --libvirt-domain
        /// (default: virsh's own)
        #[arg(
            long,
            value_name = "URI",
            requires = "libvirt_domain",
            conflicts_with = "qemu"
        )]
        libvirt_uri: Option<String>,
        /// After --: the QEMU command line of a QEMU VM's standby, as on the
        /// primary but with this host's mdev and each writable disk opening
        /// its replica (`hagctl standby-argv` writes that); hagctl adds its
        /// RAM backend, -qmp, -incoming defer and -S
        #[arg(last = true, value_name = "QEMU ARGS")]
        qemu: Vec<String>,
    },
    /// Print a QEMU command line with each writable disk opening its
    /// replica as raw: the standby's, for `hagctl backup -- …`
    #[command(after_long_help = "\
Each writable disk device (virtio-blk, scsi-hd, ide-hd, nvme, usb-storage
with a drive) gets its replica, DIR/ID.raw (ID: the device's id), opened as
a raw image: its format node (-blockdev, JSON or key=value) becomes
driver=raw with the format's own options and its backing chain dropped, its
file node's filename the replica; a -drive gets file=DIR/ID.raw,format=raw.
Read-only disks and CD-ROMs are left alone; everything else is printed as
it was, as one shell-quoted line. A writable disk device with no id, or a
disk on anything but a file (host_device, nbd, iscsi, ...), is an error
naming it. For a libvirt domain: hagctl backup --libvirt-domain does this
to virsh domxml-to-native's command line itself.")]
    StandbyArgv {
        /// Where the backup keeps the replicas (its --replica-dir)
        #[arg(long, value_name = "DIR", default_value = "/var/lib/hag/replicas")]
        replica_dir: std::path::PathBuf,
        /// After --: the VM's QEMU command line
        #[arg(last = true, required = true, value_name = "QEMU ARGS")]
        qemu: Vec<String>,
    },
    /// Ask a running `hagctl backup` to take over now: its primary has
    /// been fenced (by a cluster manager, or an operator who made sure
    /// its host is down)
    #[command(after_long_help = "\
For a backup run with --on-silence hold (a cluster manager decides), or to
take over before the failover timeout. The backup named VM (--name VM, or
the one whose files are in --status-dir and --state-dir) takes over from
its last acknowledged epoch,
after its --fence-peer if it has one; if the primary is heard after the
request, the takeover is given up (it is alive). Prints the new generation;
exits 6 with the backup's reason if it refused, 1 if it did not answer.")]
    Takeover {
        /// The backup's --name, or its --status-dir and --state-dir
        #[command(flatten)]
        dirs: vm_dirs::VmDirArgs,
        /// How long to wait for the takeover
        #[arg(long, value_name = "DURATION", default_value = "120", value_parser = units::seconds)]
        timeout: Duration,
    },
    /// Tell a running `hagctl checkpoint` that its backup is down for
    /// good (fenced, its host off): it releases the output it holds and
    /// ends protection, the VM running on
    #[command(after_long_help = "\
As `pcs stonith confirm` does for a cluster node: run it only once you know
the backup cannot resume the VM (its host is powered off, or fenced), since
the output released is then contradicted if it does. A primary that cannot
hear its backup holds its VM's output (never released on silence); this
releases it. Refused (exit status 6) while the backup acknowledges epochs. Afterwards the
VM runs unprotected: protect it again with a new hagctl checkpoint.")]
    ConfirmBackupDown {
        /// The checkpoint's --name
        #[arg(long, value_name = "VM")]
        name: Option<vm_dirs::VmName>,
        /// The checkpoint's --status-dir [default: /run/hag, or
        /// /run/hag/VM with --name]
        #[arg(long, value_name = "DIR")]
        status_dir: Option<std::path::PathBuf>,
        /// The protected vGPU's id (needed when DIR has several)
        #[arg(long, value_name = "ID")]
        vgpu: Option<u32>,
        /// How long to wait for the checkpoint's answer
        #[arg(long, value_name = "DURATION", default_value = "30", value_parser = units::seconds)]
        timeout: Duration,
    },
    /// Show one VM's protection on this host: its hagctl checkpoint's
    /// state and progress, or its hagctl backup's
    #[command(after_long_help = "\
Reads what the running processes publish (hagctl checkpoint holds QEMU's QMP
socket): STATUS_DIR/checkpoint-vgpuN.json and STATUS_DIR/backup.json; with
--name VM, STATUS_DIR is /run/hag/VM. --json: {checkpoints: [{pid,
vgpu_id, backup, state, last_epoch, ..., running, text}], backup: {pid,
state, listen, generation, epoch} or null}. Exits 1 if neither is there.
--role prints one word instead, and exits 0 whatever runs: primary (a
hagctl checkpoint protects the VM running here), took-over (this host's
backup took the VM over: it runs here), standby-holding (a backup stands by
with an acknowledged epoch: it can take over), standby (one with none yet)
or none (what Pacemaker's resource agent, ocf:hag:vm, asks).")]
    Job {
        #[command(flatten)]
        dirs: vm_dirs::VmDirArgs,
        /// Print one JSON object instead of text
        #[arg(long, conflicts_with = "role")]
        json: bool,
        /// Print this host's role for the VM, one word
        #[arg(long)]
        role: bool,
    },
    /// End one VM's protection cleanly: its hagctl checkpoint ends it with
    /// the backup (ABORT), and this waits for it to exit
    #[command(after_long_help = "\
As SIGTERM to hagctl checkpoint: once the backup confirms the end, the held
output is released and the VM runs on unprotected; if the backup does not
confirm in time, the VM is stopped (the backup may be taking over). Exits 1
if no hagctl checkpoint runs for the VM, or one still runs after --timeout.")]
    Abort {
        /// The checkpoint's --name, or its --status-dir
        #[command(flatten)]
        dirs: vm_dirs::VmDirArgs,
        /// How long to wait for each hagctl checkpoint to exit
        #[arg(long, value_name = "DURATION", default_value = "60", value_parser = units::seconds)]
        timeout: Duration,
    },
    /// libvirt's qemu hook: protect a domain with a <hag:protect> element
    /// while it runs (/etc/libvirt/hooks/qemu runs this)
    #[command(after_long_help = "\
libvirt runs its hook as `qemu DOMAIN OPERATION SUB-OP EXTRA` with the domain
XML on stdin. For a domain with a hag vGPU (an mdev hostdev) and
<hag:protect xmlns:hag='https://hag.example/1' backup='HOST:PORT' .../> in its
<metadata>: at started and reconnect, the element's settings go to
/run/hag/VM/libvirt.conf and `hagctl checkpoint --name VM` protects the domain
(under systemd: hag-checkpoint@VM.service; otherwise a supervisor that
retries every RETRY seconds while the backup is unreachable); at stopped and
release protection ends; migrate and restore mark the domain incoming. It
writes nothing to stdout, always exits 0, and logs one line per action to
LOG_DIR/libvirt-hook.log (/var/log/hag). Host defaults: /etc/hag/hag.conf
($HAG_CONF). VM is the domain's name, characters other than A-Z a-z 0-9 _ . -
as _. docs/libvirt.md has the attributes.")]
    LibvirtHook {
        /// The domain's name
        #[arg(value_name = "DOMAIN")]
        domain: String,
        /// libvirt's operation (prepare, start, started, stopped, release,
        /// migrate, restore, reconnect, attach)
        #[arg(value_name = "OPERATION", required_unless_present = "supervise")]
        operation: Option<String>,
        /// Its sub-operation (begin, end)
        #[arg(value_name = "SUB-OP")]
        sub_op: Option<String>,
        /// libvirt's extra argument (unused)
        #[arg(value_name = "EXTRA")]
        extra: Option<String>,
        /// Run the supervisor of DOMAIN's protection (started by the hook
        /// itself where systemd does not run)
        #[arg(long, hide = true, conflicts_with = "operation")]
        supervise: bool,
    },
    /// Print a completion script for SHELL (bash: save it as
    /// /usr/share/bash-completion/completions/hagctl)
    Completions {
        /// bash, zsh, fish, elvish or powershell
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write hagctl's man pages (hagctl.1, hagctl-SUBCOMMAND.1) into DIR
    Man {
        /// The directory (created if missing)
        #[arg(value_name = "DIR")]
        dir: std::path::PathBuf,
    },
    /// Be the witness of pairs of hosts: grant each contested VM to one
    /// side only
    #[command(after_long_help = "\
A primary and its backup given --witness HOST:PORT ask this host before
they act on each other's silence: the backup before it takes over, the
primary (unprotected past the failover timeout) before it releases its
held output and runs on. The first claim on a VM instance at a generation
wins; the other side's is refused (the backup then discards its
checkpoint, the primary stops its VM). Each decision is stored in
STATE_DIR/witness.json, synced, before it is answered; without that file
it refuses to start unless --new says this is a new witness. The witness holds
each pair's key (--key, repeatable; a connection is authenticated with one
of them, and only that pair's VMs can be claimed on it). It runs until
killed; its log says every claim and its answer.")]
    Witness {
        /// Address and port to listen on
        #[arg(long, value_name = "ADDR:PORT")]
        listen: String,
        /// The key file of a pair it serves (repeatable)
        #[arg(long, value_name = "FILE", required = true)]
        key: Vec<std::path::PathBuf>,
        /// Where its decisions are kept
        #[arg(long, value_name = "DIR", default_value = "/var/lib/hag/witness")]
        state_dir: std::path::PathBuf,
        /// Start a new witness: an empty book if STATE_DIR has none (without
        /// it, a missing book is an error: a witness that lost its
        /// decisions could decide a contest twice)
        #[arg(long)]
        new: bool,
    },
    /// Write a new pre-shared key for a pair of hosts (mode 0600; copy it
    /// to the other host by a trusted way)
    Keygen {
        /// The file to create (never overwritten); - prints the key on
        /// stdout instead
        #[arg(value_name = "FILE")]
        file: std::path::PathBuf,
    },
    /// For tests: declare a vGPU hung (module loaded with allow_hang_injection=1)
    #[command(hide = true)]
    InjectHang {
        /// The vGPU's id
        #[arg(long, value_name = "ID", required_unless_present = "mdev")]
        vgpu: Option<u32>,
        /// Or its mdev UUID
        #[arg(long, value_name = "UUID", conflicts_with = "vgpu")]
        mdev: Option<String>,
    },
    /// Receive one migration: into a QEMU (--qmp) or a hag-vmm (--vm)
    #[command(group(ArgGroup::new("target").required(true).args(["vm", "qmp"])))]
    #[command(after_long_help = RECEIVE_HELP)]
    Receive {
        /// Address and port to listen on (--qmp: QEMU listens; port 0: any)
        #[arg(long, value_name = "ADDR:PORT")]
        listen: String,
        /// Control socket of the incoming hag-vmm VM (hag-vmm serve --incoming)
        #[arg(long, value_name = "SOCKET")]
        vm: Option<std::path::PathBuf>,
        /// QMP socket of the incoming QEMU (started with -incoming defer)
        #[arg(long, value_name = "SOCKET")]
        qmp: Option<std::path::PathBuf>,
        /// --vm: the pre-shared key file this host and the source hold
        #[arg(long, value_name = "FILE", default_value = KEY_DEFAULT, conflicts_with = "qmp")]
        key: std::path::PathBuf,
        /// --qmp: give up after DURATION without a completed migration and
        /// a running VM (default: wait as long as it takes)
        #[arg(long, value_name = "DURATION", conflicts_with = "vm", value_parser = units::seconds)]
        timeout: Option<Duration>,
        /// --qmp: resume a VM that arrives paused (QEMU started with -S)
        #[arg(long, conflicts_with = "vm")]
        cont: bool,
        /// --qmp: set a migration capability on the target, NAME=on|off
        /// (repeatable)
        #[arg(long, value_name = "NAME=on|off", conflicts_with = "vm",
              value_parser = vmm_migrate::parse_capability)]
        capability: Vec<(String, bool)>,
        /// --qmp: set a migration parameter on the target, NAME=VALUE
        /// (repeatable)
        #[arg(long, value_name = "NAME=VALUE", conflicts_with = "vm",
              value_parser = vmm_migrate::parse_parameter)]
        parameter: Vec<(String, serde_json::Value)>,
        /// --qmp: leave a QEMU whose incoming migration failed running
        /// instead of ending it
        #[arg(long, conflicts_with = "vm")]
        keep_failed: bool,
        /// --qmp: receive the VM's local disks too: serve each writable disk
        /// over NBD for the source's mirrors (hagctl migrate
        /// --copy-storage), and resume the VM once the source let go of
        /// them (QEMU must be started with -S -incoming defer)
        #[arg(long, conflicts_with = "vm")]
        copy_storage: bool,
        /// --copy-storage: where to serve the disks over NBD (default: the
        /// --listen address, port 10809)
        #[arg(long, value_name = "HOST:PORT", requires = "copy_storage",
              value_parser = vmm::MigrationAddress::parse_tcp)]
        nbd: Option<vmm::MigrationAddress>,
        /// Print one JSON object instead of text
        #[arg(long)]
        json: bool,
    },
}

/// A backup must never miss a page: `none` is for migration tests only.
fn checkpoint_gpu_dirty(text: &str) -> Result<migrate::GpuDirty, String> {
    use clap::ValueEnum;
    match migrate::GpuDirty::from_str(text, false)? {
        migrate::GpuDirty::None => {
            Err("'none' would miss GPU writes; use audit, full or hash".into())
        }
        mode => Ok(mode),
    }
}

/// `--max-downtime`: QEMU's downtime-limit is whole ms, at most 2000 s.
fn max_downtime(text: &str) -> Result<Duration, String> {
    let d = units::millis(text)?;
    if d < Duration::from_millis(1) || d > Duration::from_secs(2000) {
        return Err(format!("'{text}': the downtime limit is 1 ms to 2000 s"));
    }
    Ok(d)
}

fn cli() -> Cli {
    let args = service::with_config(
        std::env::args_os().collect(),
        std::path::Path::new(service::CONFIG_DIR),
        std::path::Path::new(vm_dirs::RUN_ROOT),
    )
    .unwrap_or_else(|e| {
        info!("{e}");
        // A usage error, as clap's own (its exit status 2).
        std::process::exit(2)
    });
    let matches = command().get_matches_from(args);
    Cli::from_arg_matches(&matches).unwrap_or_else(|err| err.exit())
}

/// hagctl's command line, as --help, the completions and the man pages
/// show it.
fn command() -> clap::Command {
    // The ABI version is part of the answer to "which hagctl is this?", and
    // clap only takes a version string it can keep.
    let version: &'static str = Box::leak(
        format!(
            "{} (hag ABI {}{})",
            env!("CARGO_PKG_VERSION"),
            abi::ABI_VERSION,
            if test_switches::COMPILED {
                ", with the test switches"
            } else {
                ""
            }
        )
        .into_boxed_str(),
    );
    // A VM's configuration file comes first and the command line's own
    // arguments win (service.rs).
    Cli::command().version(version).args_override_self(true)
}

/// Prints a command's report: one JSON object, or its `text`.
fn print_report(json: bool, report: &impl serde::Serialize, text: String) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        print!("{text}");
    }
    Ok(())
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Status { json } => commands::status(json)?,
        Command::Events {
            json,
            count,
            timeout,
        } => commands::events(&commands::EventsOptions {
            json,
            count,
            timeout,
        })?,
        Command::Migrate {
            vm,
            qmp,
            to,
            max_rounds,
            threshold_pages,
            quiesce_timeout_ms,
            gpu_dirty,
            no_gpu_dirty,
            gpu_full_copy,
            no_compress,
            test,
            key,
            connect_timeout,
            max_downtime,
            bandwidth,
            capability,
            parameter,
            keep_source,
            cancel_after,
            copy_storage,
            nbd,
            json,
        } => match (vm, qmp) {
            (_, Some(qmp)) => {
                let to = vmm::MigrationAddress::parse_tcp(&to).map_err(anyhow::Error::msg)?;
                let opts = vmm_migrate::VmmMigrateOptions {
                    copy_storage: copy_storage.then(|| vmm::qemu_storage::nbd_address(nbd, &to)),
                    to,
                    settings: vmm::MigrationSettings {
                        downtime_limit_ms: Some(max_downtime.as_millis() as u64),
                        max_bandwidth: bandwidth,
                        capabilities: capability,
                        parameters: parameter,
                    },
                    keep_source,
                    connect_timeout,
                    timeout: cancel_after,
                    json,
                    progress_every: Duration::from_secs(1),
                };
                // Before any other thread: they all inherit the mask.
                let stop = vmm_migrate::watch_stop_signals()?;
                let mut qemu = vmm::qemu::Qemu::connect(&qmp, vmm::qmp::DEFAULT_TIMEOUT)?;
                let report = vmm_migrate::migrate(&mut qemu, &opts, &stop)?;
                print_report(json, &report, report.text())?;
            }
            (Some(vm), None) => {
                let gpu_dirty = if no_gpu_dirty {
                    migrate::GpuDirty::None
                } else if gpu_full_copy {
                    migrate::GpuDirty::Full
                } else {
                    gpu_dirty
                };
                let report = migrate::migrate(&migrate::MigrateOptions {
                    vm,
                    to,
                    max_rounds,
                    threshold_pages,
                    quiesce_timeout_ms,
                    gpu_dirty,
                    compress: !no_compress,
                    connect_timeout,
                    inject_fault: test.inject_fault(),
                    key,
                    max_downtime,
                    bandwidth,
                    stop: Some(vmm_migrate::watch_stop_signals()?),
                })?;
                print_report(json, &report, report.text())?;
            }
            (None, None) => anyhow::bail!("--vm or --qmp is needed"),
        },
        Command::Checkpoint {
            vm,
            qmp,
            plug,
            console,
            console_log,
            test,
            delta_dir,
            backup,
            heartbeat_addr,
            interval,
            failover_timeout,
            generation,
            quiesce_timeout_ms,
            max_rounds,
            threshold_pages,
            gpu_dirty,
            no_compress,
            page_cache,
            connect_timeout,
            dirs,
            no_config: _,
            key,
            witness,
            json,
        } => {
            let vm_name = dirs.name.clone();
            let dirs = dirs.resolve();
            // Before any other thread: they all inherit the mask.
            let vm = match (vm, qmp) {
                (Some(path), _) => checkpoint::VmAt::HagVmm(path),
                (None, Some(qmp)) => {
                    if gpu_dirty != migrate::GpuDirty::Audit {
                        use clap::ValueEnum;
                        let name = gpu_dirty
                            .to_possible_value()
                            .map_or_else(String::new, |v| v.get_name().to_owned());
                        anyhow::bail!("--gpu-dirty {name} needs the vGPU's context outside the VMM's stream: with --qmp only audit works");
                    }
                    checkpoint::VmAt::Qemu {
                        qmp,
                        plug,
                        console: console.zip(console_log),
                        withhold_cpu_dirty: test.withhold_cpu_dirty(),
                        withhold_disk_delta: test.withhold_disk_delta(),
                        delta_dir: delta_dir.unwrap_or_else(|| dirs.deltas()),
                    }
                }
                (None, None) => anyhow::bail!("--vm or --qmp is needed"),
            };
            let stop = vmm_migrate::watch_stop_signals_for("ending protection")?;
            let report = checkpoint::checkpoint(
                &checkpoint::CheckpointOptions {
                    gpu_dirty,
                    compress: !no_compress,
                    page_cache,
                    vm,
                    backup,
                    heartbeat_addrs: heartbeat_addr,
                    interval,
                    failover_timeout,
                    generation,
                    quiesce_timeout_ms,
                    max_rounds,
                    threshold_pages,
                    connect_timeout,
                    status_dir: dirs.run,
                    vm_name,
                    key,
                    witness: witness.get(),
                    ablation: test.ablation(),
                },
                stop,
            )?;
            print_report(json, &report, report.text())?;
            if let Some(status) = exit::checkpoint_outcome(&report.outcome) {
                return Err(exit::with_status(status, report.detail));
            }
        }
        Command::Backup {
            listen,
            heartbeat_listen,
            mdev,
            control,
            vmm,
            vmm_arg,
            failover_timeout,
            generation,
            dirs,
            no_config: _,
            replica_dir,
            key,
            max_ram,
            max_connections,
            test,
            json,
            fence_peer,
            fence_peer_timeout,
            on_silence,
            witness,
            ram_seed,
            reprotect,
            reprotect_args,
            takeover_by_libvirt,
            libvirt_domain,
            libvirt_uri,
            qemu,
        } => {
            let vm_name = dirs.name.clone();
            let dirs = dirs.resolve();
            let replica_dir = replica_dir.unwrap_or_else(|| dirs.replicas());
            if takeover_by_libvirt && reprotect.is_some() {
                anyhow::bail!("--reprotect and --takeover-by-libvirt: a domain libvirt restored is protected again by the hook's configuration, not by this backup");
            }
            let standby = match &libvirt_domain {
                Some(xml) => {
                    let argv = standby_argv::libvirt_domain_argv(xml, libvirt_uri.as_deref())
                        .map_err(anyhow::Error::msg)?;
                    let standby = standby_argv::standby(&argv, &replica_dir).map_err(|e| {
                        anyhow::anyhow!("the standby's command line from {}: {e}", xml.display())
                    })?;
                    info!(
                        "the standby's QEMU command line: {}",
                        shell_words::join(&standby.argv)
                    );
                    standby
                }
                None => standby_argv::Standby {
                    argv: qemu,
                    disks: Vec::new(),
                },
            };
            let libvirt_owned = takeover_by_libvirt.then(|| libvirt_restore::Owned {
                xml: libvirt_domain.clone().unwrap_or_default(),
                uri: libvirt_uri.clone(),
                replicas: standby.disks,
            });
            if let Some(owned) = &libvirt_owned {
                // Said now, not at the takeover.
                owned.facts().map_err(anyhow::Error::msg)?;
            }
            let qemu = standby.argv;
            if reprotect.is_some() && qemu.is_empty() {
                anyhow::bail!("--reprotect protects a QEMU VM taken over here: give the standby's QEMU command line (-- QEMU ARGS or --libvirt-domain)");
            }
            let reprotect_args = match &reprotect_args {
                Some(a) => shell_words::split(a)
                    .map_err(|e| anyhow::anyhow!("--reprotect-args '{a}': {e}"))?,
                None => Vec::new(),
            };
            let status = backup::backup(&backup::BackupOptions {
                listen,
                heartbeat_listen,
                mdev: mdev.unwrap_or_default(),
                qemu,
                control: control.unwrap_or_else(|| dirs.run.join("hag-vmm.sock")),
                vmm,
                vmm_args: vmm_arg,
                failover_timeout,
                generation,
                status_dir: dirs.run,
                state_dir: dirs.state,
                vm_name: vm_name.clone(),
                replica_dir,
                json,
                key,
                max_ram,
                max_connections: max_connections as usize,
                test_fault_file: test.fault_file(),
                fence_peer: fence_peer.map(|command| fence::FencePeer {
                    command,
                    timeout: fence_peer_timeout,
                }),
                on_silence,
                witness: witness.get(),
                reprotect: reprotect.map(|to| (to, reprotect_args)),
                ram_seed,
                libvirt_owned,
            })?;
            if let Some(status) = status {
                if !status.success() {
                    return Err(exit::with_status(
                        exit::Status::VmFailed,
                        format!("the VM resumed here ended with {status}"),
                    ));
                }
            }
        }
        Command::ConfirmBackupDown {
            name,
            status_dir,
            vgpu,
            timeout,
        } => {
            let dirs = vm_dirs::VmDirArgs {
                name,
                status_dir,
                state_dir: None,
            }
            .resolve();
            println!(
                "{}",
                checkpoint::confirm_backup_down(&dirs.run, vgpu, timeout)?
            );
        }
        Command::Job {
            dirs, role: true, ..
        } => println!("{}", jobs::role(&dirs.resolve())),
        Command::Job { dirs, json, .. } => print!("{}", jobs::job(&dirs.resolve(), json)?),
        Command::Abort { dirs, timeout } => print!("{}", jobs::abort(&dirs.resolve(), timeout)?),
        Command::Takeover { dirs, timeout } => {
            let generation = backup::request_takeover(&dirs.resolve(), timeout)?;
            println!("took over: generation {generation}");
        }
        Command::StandbyArgv { replica_dir, qemu } => {
            let argv = standby_argv::standby_argv(&qemu, &replica_dir)?;
            println!("{}", shell_words::join(&argv));
        }
        Command::LibvirtHook {
            domain,
            supervise: true,
            ..
        } => libvirt_hook::supervise(&domain),
        Command::LibvirtHook {
            domain,
            operation,
            sub_op,
            ..
        } => libvirt_hook::run(
            &domain,
            operation.as_deref().unwrap_or_default(),
            sub_op.as_deref().unwrap_or("-"),
        ),
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut command(), "hagctl", &mut std::io::stdout());
        }
        Command::Man { dir } => {
            std::fs::create_dir_all(&dir)
                .and_then(|()| clap_mangen::generate_to(command(), &dir))
                .map_err(|e| {
                    anyhow::anyhow!("cannot write the man pages into {}: {e}", dir.display())
                })?;
            info!("wrote the man pages into {}", dir.display());
        }
        Command::Keygen { file } if file.as_os_str() == "-" => {
            println!("{}", secure::Key::generate()?.to_hex());
        }
        Command::Witness {
            listen,
            key,
            state_dir,
            new,
        } => {
            witness::serve(
                &witness::WitnessOptions {
                    listen,
                    keys: key,
                    state_dir,
                    new,
                },
                |addr| crate::service::notify(true, &format!("witness on {addr}")),
            )?;
        }
        Command::Keygen { file } => {
            secure::Key::generate()
                .and_then(|k| k.write_new(&file))
                .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", file.display()))?;
            info!("wrote a new key to {}", file.display());
        }
        Command::InjectHang { vgpu, mdev } => {
            let dev = hag_dev::Device::open()?;
            dev.version()?;
            let id = match (vgpu, mdev) {
                (Some(id), _) => id,
                (None, Some(uuid)) => dev.find_vgpu(&uuid)?.id,
                (None, None) => anyhow::bail!("--vgpu or --mdev is needed"),
            };
            dev.inject_hang(id)?;
            info!("vGPU {id} declared hung");
        }
        Command::Receive {
            listen,
            vm,
            qmp,
            timeout,
            cont,
            capability,
            parameter,
            keep_failed,
            copy_storage,
            nbd,
            key,
            json,
        } => match (vm, qmp) {
            (_, Some(qmp)) => {
                let listen =
                    vmm::MigrationAddress::parse_tcp(&listen).map_err(anyhow::Error::msg)?;
                let opts = vmm_migrate::VmmReceiveOptions {
                    copy_storage: copy_storage
                        .then(|| vmm::qemu_storage::nbd_address(nbd, &listen)),
                    listen,
                    settings: vmm::MigrationSettings {
                        capabilities: capability,
                        parameters: parameter,
                        ..vmm::MigrationSettings::default()
                    },
                    timeout,
                    cont,
                    keep_failed,
                };
                let mut qemu = vmm::qemu::Qemu::connect(&qmp, vmm::qmp::DEFAULT_TIMEOUT)?;
                let report = vmm_migrate::receive(&mut qemu, &opts)?;
                print_report(json, &report, report.text())?;
            }
            (Some(vm), None) => {
                let report = migrate::receive(&migrate::ReceiveOptions { listen, vm, key })?;
                print_report(json, &report, report.text())?;
            }
            (None, None) => anyhow::bail!("--vm or --qmp is needed"),
        },
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = cli();
    log::init(cli.quiet, cli.verbose);
    let json = cli.command.json();
    match run(cli) {
        Ok(()) => ExitCode::from(exit::Status::Success as u8),
        Err(err) => {
            let status = exit::status_of(&err);
            log::error!("{err:#}");
            if json {
                // A script reading --json output gets the failure there too.
                println!("{}", error_json(&err, status));
            }
            ExitCode::from(status as u8)
        }
    }
}

/// A failure as `--json` prints it: one object on stdout.
fn error_json(err: &anyhow::Error, status: exit::Status) -> serde_json::Value {
    serde_json::json!({
        "error": format!("{err:#}"),
        "exit_status": status as u8,
    })
}

impl Command {
    /// Whether the command was asked for JSON output.
    fn json(&self) -> bool {
        match self {
            Command::Status { json }
            | Command::Events { json, .. }
            | Command::Migrate { json, .. }
            | Command::Checkpoint { json, .. }
            | Command::Backup { json, .. }
            | Command::Receive { json, .. }
            | Command::Job { json, .. } => *json,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn a_json_failure_is_one_object_with_its_status() {
        let err = exit::with_status(
            exit::Status::Refused,
            "the backup did not take over: no epoch",
        );
        let status = exit::status_of(&err);
        assert_eq!(
            error_json(&err.context("takeover"), status),
            serde_json::json!({
                "error": "takeover: the backup did not take over: no epoch",
                "exit_status": 6,
            })
        );
    }

    #[test]
    fn completions_and_man_pages_come_from_the_command_line() {
        let mut bash = Vec::new();
        clap_complete::generate(
            clap_complete::Shell::Bash,
            &mut command(),
            "hagctl",
            &mut bash,
        );
        let bash = String::from_utf8(bash).unwrap();
        for word in [
            "checkpoint",
            "--failover-timeout",
            "--cancel-after",
            "confirm-backup-down",
        ] {
            assert!(bash.contains(word), "{word}");
        }
        let dir = std::env::temp_dir().join(format!("hagctl-man-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        clap_mangen::generate_to(command(), &dir).unwrap();
        let page = std::fs::read_to_string(dir.join("hagctl-checkpoint.1")).unwrap();
        assert!(page.contains("failover\\-timeout"), "{page}");
        let top = std::fs::read_to_string(dir.join("hagctl.1")).unwrap();
        assert!(top.contains("Exit status"), "{top}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn test_switches_parse_only_in_a_test_build() {
        let parse = |args: &[&str]| Cli::try_parse_from(args.iter().copied());
        let cp = ["hagctl", "checkpoint", "--qmp", "vm.qmp", "--backup", "h:1"];
        let mig = ["hagctl", "migrate", "--vm", "s", "--to", "h:1"];
        let bk = ["hagctl", "backup", "--listen", "h:1", "--mdev", "u"];
        for args in [
            [&cp[..], &["--test-withhold-cpu-dirty"]].concat(),
            [&cp[..], &["--test-withhold-disk-delta"]].concat(),
            [&mig[..], &["--inject-fault", "corrupt-page"]].concat(),
            [&bk[..], &["--test-fault-file", "f"]].concat(),
        ] {
            assert_eq!(
                parse(&args).is_ok(),
                test_switches::COMPILED,
                "{}",
                args.join(" ")
            );
        }
        assert!(parse(&bk).is_ok(), "{}", bk.join(" "));
    }

    #[test]
    fn gpu_dirty_modes_parse() {
        let parse = |args: &[&str]| Cli::try_parse_from(args.iter().copied());
        let mig = ["hagctl", "migrate", "--vm", "s", "--to", "h:1"];
        let Command::Migrate { gpu_dirty, .. } = parse(&mig).unwrap().command else {
            panic!("not migrate");
        };
        assert_eq!(gpu_dirty, migrate::GpuDirty::Audit);
        for (flag, mode) in [
            ("hash", migrate::GpuDirty::Hash),
            ("none", migrate::GpuDirty::None),
        ] {
            let args = [&mig[..], &["--gpu-dirty", flag, "--no-compress"]].concat();
            let Command::Migrate {
                gpu_dirty,
                no_compress,
                ..
            } = parse(&args).unwrap().command
            else {
                panic!("not migrate");
            };
            assert_eq!((gpu_dirty, no_compress), (mode, true));
        }
        // The old spellings stay, and do not combine with the new one.
        assert!(parse(&[&mig[..], &["--gpu-full-copy"]].concat()).is_ok());
        assert!(parse(&[&mig[..], &["--gpu-full-copy", "--gpu-dirty", "hash"]].concat()).is_err());
        let cp = ["hagctl", "checkpoint", "--vm", "s", "--backup", "h:1"];
        let Command::Checkpoint { gpu_dirty, .. } =
            parse(&[&cp[..], &["--gpu-dirty", "full"]].concat())
                .unwrap()
                .command
        else {
            panic!("not checkpoint");
        };
        assert_eq!(gpu_dirty, migrate::GpuDirty::Full);
        // A backup fed by a log that ignores the GPU would miss writes.
        assert!(parse(&[&cp[..], &["--gpu-dirty", "none"]].concat()).is_err());
    }

    #[test]
    fn copy_storage_flags_parse() {
        let parse = |args: &[&str]| Cli::try_parse_from(args.iter().copied());
        let mig = ["hagctl", "migrate", "--qmp", "vm.qmp", "--to", "h:1"];
        let Command::Migrate {
            copy_storage, nbd, ..
        } = parse(&[&mig[..], &["--copy-storage", "--nbd", "[::1]:10810"]].concat())
            .unwrap()
            .command
        else {
            panic!("not migrate");
        };
        assert!(copy_storage);
        assert_eq!(nbd.unwrap().to_string(), "[::1]:10810");
        // --nbd only with --copy-storage; neither with --vm; a bad address
        // is named.
        assert!(parse(&[&mig[..], &["--nbd", "h:2"]].concat()).is_err());
        assert!(parse(&[
            "hagctl",
            "migrate",
            "--vm",
            "s",
            "--to",
            "h:1",
            "--copy-storage"
        ])
        .is_err());
        let e = parse(&[&mig[..], &["--copy-storage", "--nbd", "nohost"]].concat())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("'nohost' is not HOST:PORT"), "{e}");
        let rcv = [
            "hagctl",
            "receive",
            "--qmp",
            "vm.qmp",
            "--listen",
            "0.0.0.0:7100",
        ];
        let Command::Receive {
            copy_storage, nbd, ..
        } = parse(&[&rcv[..], &["--copy-storage"]].concat())
            .unwrap()
            .command
        else {
            panic!("not receive");
        };
        assert!(copy_storage && nbd.is_none());
        assert!(parse(&[
            "hagctl",
            "receive",
            "--vm",
            "s",
            "--listen",
            "h:1",
            "--copy-storage"
        ])
        .is_err());
    }

    #[test]
    fn qmp_and_vm_are_two_exclusive_ways_to_name_the_vm() {
        let parse = |args: &[&str]| Cli::try_parse_from(args.iter().copied());
        let Command::Migrate {
            qmp,
            vm,
            max_downtime,
            bandwidth,
            capability,
            parameter,
            keep_source,
            cancel_after,
            ..
        } = parse(&[
            "hagctl",
            "migrate",
            "--qmp",
            "vm.qmp",
            "--to",
            "h:1",
            "--bandwidth",
            "512KiB",
            "--capability",
            "x-ignore-shared=on",
            "--capability",
            "events=off",
            "--parameter",
            "multifd-channels=4",
        ])
        .unwrap()
        .command
        else {
            panic!("not migrate");
        };
        assert_eq!(qmp.as_deref(), Some(std::path::Path::new("vm.qmp")));
        assert!(vm.is_none());
        // QEMU's own default downtime limit.
        assert_eq!(max_downtime, Duration::from_millis(300));
        assert_eq!(bandwidth, Some(512 << 10));
        assert_eq!(
            capability,
            [
                ("x-ignore-shared".to_owned(), true),
                ("events".to_owned(), false)
            ]
        );
        assert_eq!(parameter, [("multifd-channels".to_owned(), 4.into())]);
        assert!(!keep_source && cancel_after.is_none());
        // One of the two, not both, not neither.
        assert!(parse(&["hagctl", "migrate", "--to", "h:1"]).is_err());
        assert!(parse(&["hagctl", "migrate", "--vm", "s", "--qmp", "q", "--to", "h:1"]).is_err());
        // Each mode's options are refused in the other.
        let qmp = ["hagctl", "migrate", "--qmp", "q", "--to", "h:1"];
        let vm = ["hagctl", "migrate", "--vm", "s", "--to", "h:1"];
        for flag in [
            &["--max-rounds", "3"][..],
            &["--no-compress"],
            &["--gpu-dirty", "hash"],
        ] {
            assert!(parse(&[&qmp[..], flag].concat()).is_err(), "{flag:?}");
            assert!(parse(&[&vm[..], flag].concat()).is_ok(), "{flag:?}");
        }
        for flag in [&["--max-downtime", "100"][..], &["--bandwidth", "10"]] {
            assert!(parse(&[&vm[..], flag].concat()).is_ok(), "{flag:?}");
            assert!(parse(&[&qmp[..], flag].concat()).is_ok(), "{flag:?}");
        }
        for flag in [
            &["--keep-source"][..],
            &["--capability", "events=on"],
            &["--cancel-after", "5"],
        ] {
            assert!(parse(&[&vm[..], flag].concat()).is_err(), "{flag:?}");
            assert!(parse(&[&qmp[..], flag].concat()).is_ok(), "{flag:?}");
        }
        assert!(parse(&[&qmp[..], &["--capability", "events"]].concat()).is_err());
        assert!(parse(&[&qmp[..], &["--max-downtime", "0"]].concat()).is_err());
        // One grammar: units where the issue found them refused, and
        // virsh's --timeout (suspend) not mistaken for a cancel.
        for flags in [
            &["--max-downtime", "300ms"][..],
            &["--max-downtime", "1.5s"],
            &["--cancel-after", "30s"],
            &["--connect-timeout", "1m"],
            &["--bandwidth", "100MB/s"],
        ] {
            assert!(parse(&[&qmp[..], flags].concat()).is_ok(), "{flags:?}");
        }
        assert!(parse(&[&qmp[..], &["--timeout", "30"]].concat()).is_err());
        let bk = ["hagctl", "backup", "--listen", "h:1", "--mdev", "u"];
        let Command::Backup {
            max_ram,
            failover_timeout,
            ..
        } = parse(
            &[
                &bk[..],
                &["--max-ram", "16GB", "--failover-timeout", "2500ms"],
            ]
            .concat(),
        )
        .unwrap()
        .command
        else {
            panic!("not backup");
        };
        assert_eq!(max_ram, 16_000_000_000);
        assert_eq!(failover_timeout, Duration::from_millis(2500));
        // receive, the same way.
        let Command::Receive {
            qmp, timeout, cont, ..
        } = parse(&[
            "hagctl",
            "receive",
            "--qmp",
            "q",
            "--listen",
            "0.0.0.0:7100",
            "--timeout",
            "30",
            "--cont",
        ])
        .unwrap()
        .command
        else {
            panic!("not receive");
        };
        assert!(qmp.is_some() && cont);
        assert_eq!(timeout, Some(Duration::from_secs(30)));
        assert!(parse(&["hagctl", "receive", "--listen", "a:1"]).is_err());
        assert!(parse(&["hagctl", "receive", "--listen", "a:1", "--vm", "s", "--cont"]).is_err());
        assert!(parse(&["hagctl", "receive", "--listen", "a:1", "--vm", "s"]).is_ok());
    }

    /// Issue 22: `--plug` with `--vm` was accepted and did nothing (a
    /// hag-vmm VM holds its own output).
    #[test]
    fn qemu_only_options_are_refused_with_a_hag_vmm_vm() {
        let parse = |args: &[&str]| Cli::try_parse_from(args.iter().copied());
        let base = ["hagctl", "checkpoint", "--backup", "b:7200"];
        let plug = parse(&[&base[..], &["--vm", "/x", "--plug", "eth0"]].concat());
        let e = plug.err().expect("--vm --plug accepted");
        assert!(e.to_string().contains("--plug"), "{e}");
        assert!(parse(&[&base[..], &["--qmp", "/x", "--plug", "eth0"]].concat()).is_ok());
        let console = ["--console", "/c", "--console-log", "/l"];
        let e = parse(&[&base[..], &["--vm", "/x"], &console[..]].concat()).err();
        assert!(e
            .expect("--vm --console accepted")
            .to_string()
            .contains("--console"));
    }

    #[test]
    fn backup_takes_a_libvirt_domain_instead_of_a_command_line() {
        let parse = |args: &[&str]| Cli::try_parse_from(args.iter().copied());
        let backup = ["hagctl", "backup", "--listen", "0.0.0.0:7200"];
        let Command::Backup {
            libvirt_domain,
            libvirt_uri,
            qemu,
            mdev,
            replica_dir,
            ..
        } = parse(
            &[
                &backup[..],
                &[
                    "--libvirt-domain",
                    "vm.xml",
                    "--libvirt-uri",
                    "qemu:///system",
                ],
            ]
            .concat(),
        )
        .unwrap()
        .command
        else {
            panic!("not backup");
        };
        assert_eq!(
            libvirt_domain.as_deref(),
            Some(std::path::Path::new("vm.xml"))
        );
        assert_eq!(libvirt_uri.as_deref(), Some("qemu:///system"));
        assert!(qemu.is_empty() && mdev.is_none());
        assert_eq!(
            replica_dir, None,
            "the state directory's replicas/ by default"
        );
        // Not both ways to give the command line; a URI only for a domain;
        // with neither, a hag-vmm standby's --mdev.
        assert!(
            parse(&[&backup[..], &["--libvirt-domain", "vm.xml", "--", "qemu"]].concat()).is_err()
        );
        assert!(parse(
            &[
                &backup[..],
                &["--libvirt-uri", "qemu:///system", "--", "qemu"]
            ]
            .concat()
        )
        .is_err());
        assert!(parse(&backup).is_err());
        assert!(parse(&[&backup[..], &["--", "qemu", "-m", "512"]].concat()).is_ok());

        let Command::StandbyArgv { replica_dir, qemu } = parse(&[
            "hagctl",
            "standby-argv",
            "--replica-dir",
            "/srv/replicas",
            "--",
            "qemu",
            "-drive",
            "file=/img/a.qcow2,if=none,id=d",
        ])
        .unwrap()
        .command
        else {
            panic!("not standby-argv");
        };
        assert_eq!(replica_dir, std::path::Path::new("/srv/replicas"));
        assert_eq!(qemu, ["qemu", "-drive", "file=/img/a.qcow2,if=none,id=d"]);
        assert!(parse(&["hagctl", "standby-argv"]).is_err());
    }
}
