# hag: high availability for virtualized GPUs.
#
#   make          build only (nothing installed): the test kernel and the test
#                 hosts' QEMU if they are not cached under $(HAG_CACHE),
#                 hag_mdev.ko and hagctl
#   make deps     install what building and testing need (Debian packages,
#                 bookworm-backports' QEMU and libvirt, bindgen): the test
#                 targets (test, demo, eval*) run it first
#   make install  hagctl (production build), its man pages and completion,
#                 the systemd units, the libvirt hook kit and the docs under
#                 $(DESTDIR)$(PREFIX)
#   make deb      the Debian packages hag and hag-mdev-dkms in build/deb
#   make demo     the main job: a VM with a vGPU migrated, protected by a backup,
#                 a GPU hang injected, the backup taking over
#   make test     userspace tests, fmt and clippy, every qemu-tests scenario,
#                 the evaluation harness's own tests, then `make gvt-test`, then
#                 `make debug-test` if the debug kernel is already cached; each
#                 step runs even if an earlier one failed, and the failed
#                 ones are named at the end
#   make eval     the evaluation (qemu-tests/eval/run, ~40 min, then the real-VM
#                 migration benchmark qemu-tests/eval/qemu-migration, the
#                 real-VM checkpoint benchmark qemu-tests/eval/qemu-checkpoint
#                 and the Debian guest's database benchmark
#                 qemu-tests/eval/qemu-database) into
#                 $(EVAL_OUT): report.md, results.json, plots; `make
#                 eval-quick` does the same in short; `make eval-report`
#                 redraws them
#   make gvt      the GVT-g kernel (scripts/gvt/ applied, cached) and
#                 hag_mdev.ko built against it in build/gvt-module/
#   make gvt-test the module-level qemu-tests scenarios on the GVT-g kernel
#   make debug    the debug kernel (scripts/kernel-debug.config: KASAN, KFENCE,
#                 UBSAN, lockdep, panic_on_warn; cached) and hag_mdev.ko built
#                 against it in build/debug-module/
#   make debug-test the module-level scenarios on the debug kernel
#
# The kernel's build system reads Kbuild (not this file) for the module.

export HAG_CACHE ?= /var/cache/hag
export HAG_TOOLS ?= $(HAG_CACHE)/tools
# install-deps.sh reports the toolchain choice once; the later steps need not.
export HAG_TOOLCHAIN_QUIET := 1
SHELL := /bin/bash
TOOLCHAIN := . scripts/toolchain.sh
MODULE := rust/hag_mdev/hag_mdev.ko
HAGCTL := controller/target/release/hagctl

.PHONY: all deps kernel host-qemu module controller check-userspace fuzz test demo clean \
	install hagctl-production deb package-check test-package-check \
	test-check-userspace test-production-module test-fuzz test-scenarios test-eval-selftest test-gvt-test \
	test-debug-test-if-cached \
	gvt-kernel gvt gvt-test production-module eval eval-quick eval-report debug-kernel debug debug-test

# Where `make eval` writes: the README links the plots in docs/eval.
EVAL_OUT ?= docs/eval

all: module controller host-qemu

deps:
	@scripts/install-deps.sh

kernel:
	@scripts/build-kernel.sh

# The test hosts' qemu-system-x86_64: Debian's QEMU 10.0.2 source with the
# TCG fixes in scripts/qemu/ (scripts/build-qemu.sh says why), cached.
host-qemu:
	@scripts/build-qemu.sh

# The kernel's build system decides itself whether the module is up to date,
# but only within one tree: its command lines use tree-relative paths, so
# objects built against another tree look current. A stamp naming the tree
# forces a clean build when the tree changes.
KDIR_STAMP := rust/hag_mdev/.kernel-tree
module: kernel
	@set -o pipefail; $(TOOLCHAIN) && kdir=$$(scripts/build-kernel.sh --print-dir) && \
	if [ "$$(cat $(KDIR_STAMP) 2>/dev/null)" != "$$kdir" ]; then \
		$(MAKE) -s -C "$$kdir" M=$(CURDIR) clean; echo "$$kdir" > $(KDIR_STAMP); fi && \
	$(MAKE) -s -C "$$kdir" M=$(CURDIR) HAG_TEST_SWITCHES=y RUSTC="$$RUSTC" BINDGEN="$$BINDGEN" modules 2>&1 | \
		{ grep -v 'Failed to run rustfmt' || true; } && \
	echo "built $(MODULE) against $$kdir"

# $(call build_module_copy,DIR,FLAVOUR-ARGS,MAKE-VARS): hag_mdev.ko built
# from a copy of its sources in DIR against the kernel scripts/build-kernel.sh
# FLAVOUR-ARGS names, its output also in DIR/build.log.
define build_module_copy
$(TOOLCHAIN) && kdir=$$(scripts/build-kernel.sh $(2) --print-dir) && \
	kargs=$$(scripts/build-kernel.sh $(2) --print-make-args) && mkdir -p $(1) && \
	tar -c $(addprefix --exclude=,$(GVT_NOT_SOURCES)) $(GVT_SOURCES) | tar -C $(1) -x && \
	if [ "$$(cat $(1)/.kernel-tree 2>/dev/null)" != "$$kdir" ]; then \
		$(MAKE) -s -C "$$kdir" M=$(CURDIR)/$(1) $$kargs clean; echo "$$kdir" > $(1)/.kernel-tree; fi && \
	$(MAKE) -s -C "$$kdir" M=$(CURDIR)/$(1) $$kargs $(3) RUSTC="$$RUSTC" BINDGEN="$$BINDGEN" modules 2>&1 | \
		{ grep -v 'Failed to run rustfmt' || true; } | tee $(1)/build.log
endef

# GVT-g. The module is built from a copy of its sources (and of the shared
# crates' sources hag.rs includes by relative path) in its own directory,
# so that its objects never mix with those built against the test kernel.
# The build fails if the patches do not pass checkpatch --strict (but for
# its check of Fixes: commit ids, which needs the kernel's git history:
# the source package has none), if a symbol is unresolved or if GVT-g support did not get compiled in.
GVT_BUILD := build/gvt-module
GVT_MODULE := $(GVT_BUILD)/rust/hag_mdev/hag_mdev.ko
GVT_SOURCES = Kbuild rust/hag_mdev $(wildcard rust/hag_*/src)
GVT_NOT_SOURCES := '*.o' '*.ko' '*.mod' '*.mod.c' '.*.cmd' '*.d' '*.rmeta' \
	modules.order Module.symvers .kernel-tree

gvt-kernel: deps
	@scripts/build-kernel.sh --flavour gvt

gvt: gvt-kernel
	@set -o pipefail; $(TOOLCHAIN) && kdir=$$(scripts/build-kernel.sh --flavour gvt --print-dir) && \
	{ (cd "$$kdir" && perl scripts/checkpatch.pl --no-tree --strict --quiet --ignore UNKNOWN_COMMIT_ID \
		$(CURDIR)/scripts/gvt/*.patch) || \
		{ echo "gvt: scripts/gvt/ does not pass checkpatch (above)"; exit 1; }; } && \
	$(call build_module_copy,$(GVT_BUILD),--flavour gvt,HAG_TEST_SWITCHES=y) && \
	if grep -q 'undefined!' $(GVT_BUILD)/build.log; then \
		echo "gvt: hag_mdev.ko has unresolved symbols (above)"; exit 1; fi && \
	if ! nm -u $(GVT_MODULE) | grep -w intel_gvt_audit_register >/dev/null; then \
		echo "gvt: $(GVT_MODULE) was built without GVT-g support"; exit 1; fi && \
	echo "built $(GVT_MODULE) against $$kdir"

# The GVT-g kernel runs the module-level scenarios: the rest (two hosts,
# real VMs) exercise nothing that differs between the two kernels, and
# CI's time goes to real VMs on the test kernel. SCENARIOS="a b" runs
# those instead.
GVT_SCENARIOS := module_load_unload status_abi_version mdev_lifecycle sim_workloads \
	sim_hang_and_reject hostile_guest quiesce_under_load vfio_dma_logging vfio_migration_v2
gvt-test: gvt controller
	HAG_FLAVOUR=gvt qemu-tests/run $(or $(SCENARIOS),$(GVT_SCENARIOS))

# The debug kernel: the test kernel plus KASAN, KFENCE, UBSAN, lockdep and
# atomic-sleep checks, with panic_on_warn on its command line, so that any
# report fails the scenario. KASAN with Rust needs clang (LLVM=1, installed
# here if missing); the module is built from a copy as for GVT-g.
DEBUG_BUILD := build/debug-module
DEBUG_MODULE := $(DEBUG_BUILD)/rust/hag_mdev/hag_mdev.ko
DEBUG_SCENARIOS := module_load_unload status_abi_version mdev_lifecycle netlink_events \
	sim_workloads sim_hang_and_reject hostile_guest quiesce_under_load vfio_dma_logging \
	vfio_migration_v2 vfio_buffer_faults vgpu_removed_in_flight migrate_refusals \
	audit_catches_missed_write qemu_migrate_live

debug-kernel: deps
	@command -v clang >/dev/null && command -v ld.lld >/dev/null || \
		apt-get install -y -qq --no-install-recommends clang lld >/dev/null
	@scripts/build-kernel.sh --flavour debug

debug: debug-kernel
	@set -o pipefail; $(call build_module_copy,$(DEBUG_BUILD),--flavour debug,HAG_TEST_SWITCHES=y) && \
		echo "built $(DEBUG_MODULE) against $$kdir"

# What a production build leaves out: hag_mdev.ko built without
# HAG_TEST_SWITCHES (as a host's own build or DKMS would) must show none
# of the test builds' fault switches (rust/hag_mdev/glue.c); hagctl's
# are checked by its unit tests, run without the test-switches feature.
PRODUCTION_BUILD := build/production-module
PRODUCTION_MODULE := $(PRODUCTION_BUILD)/rust/hag_mdev/hag_mdev.ko
TEST_ONLY_PARAMS := withhold_gpu_dirty corrupt_mig_data test_hold_vgpu_ms
production-module: kernel
	@set -o pipefail; { $(call build_module_copy,$(PRODUCTION_BUILD),,) >/dev/null || \
		{ cat $(PRODUCTION_BUILD)/build.log; exit 1; }; } && \
	params=$$(/sbin/modinfo -F parm $(PRODUCTION_MODULE) | cut -d: -f1 | tr '\n' ' ') && \
	for p in $(TEST_ONLY_PARAMS); do case " $$params" in *" $$p "*) \
		echo "production-module: $(PRODUCTION_MODULE) has the test parameter $$p"; exit 1;; esac; done && \
	echo "production-module: $(PRODUCTION_MODULE)'s parameters: $$params(no test switch)"

debug-test: debug controller
	HAG_FLAVOUR=debug qemu-tests/run $(or $(SCENARIOS),$(DEBUG_SCENARIOS))

# On a fresh machine the debug kernel's build (33 min measured on this
# 2-core machine while other builds loaded it, 24 min of CPU) on top of the
# test and GVT-g kernels risks CI's 90 minutes for `make test`; with the
# kernel cached, debug-test takes about 4 minutes. So make test runs it
# only when the debug kernel is cached (`make debug` builds it).
DEBUG_IF_CACHED = if scripts/build-kernel.sh --flavour debug --cached-dir >/dev/null 2>&1; then \
	$(MAKE) debug-test; else echo "debug-test: skipped: the debug kernel is not cached (make debug-test builds it, 15-35 min)"; fi

# The test hosts' hagctl has the test switches (controller/hagctl/src/
# test_switches.rs); `cargo build --release` alone builds one without.
controller:
	@cd controller && cargo build --release --quiet --features hagctl/test-switches && \
		cargo build --release --quiet --features hagctl/test-switches -p hagctl --example plug_gate
	@echo "built $(HAGCTL)"

# What an operator installs (the units hag-checkpoint@VM.service and
# hag-backup@VM.service run hagctl with /etc/hag/VM.conf: scripts/systemd).
# hagctl is built without the test switches
# and copied out; the test hosts' build (with them) is then put back in
# controller/target/release. Cargo keeps both builds' objects apart (their
# features differ), so each switch costs a link, not a rebuild. The
# hook kit goes to PREFIX/share/hag/libvirt: a package must not replace a
# host's own libvirt hook, so its install.sh puts it in place. The module
# reaches a real host through DKMS (make deb's hag-mdev-dkms). The
# Pacemaker resource agent, ocf:hag:vm, goes to OCF_ROOT.
PREFIX ?= /usr/local
# Pacemaker looks for resource agents here whatever the PREFIX.
OCF_ROOT ?= /usr/lib/ocf
PRODUCTION_HAGCTL := build/production-hagctl/hagctl
hagctl-production:
	@cd controller && cargo build --release --quiet -p hagctl && \
		install -D -m 0755 target/release/hagctl ../$(PRODUCTION_HAGCTL) && \
		cargo build --release --quiet --features hagctl/test-switches

install: hagctl-production
	install -D -m 0755 $(PRODUCTION_HAGCTL) $(DESTDIR)$(PREFIX)/bin/hagctl
	install -d $(DESTDIR)$(PREFIX)/share/man/man1 $(DESTDIR)$(PREFIX)/share/bash-completion/completions
	$(PRODUCTION_HAGCTL) man $(DESTDIR)$(PREFIX)/share/man/man1
	gzip -9nf $(DESTDIR)$(PREFIX)/share/man/man1/hagctl*.1
	$(PRODUCTION_HAGCTL) completions bash >$(DESTDIR)$(PREFIX)/share/bash-completion/completions/hagctl
	install -D -m 0755 -t $(DESTDIR)$(PREFIX)/share/hag/libvirt scripts/libvirt/qemu scripts/libvirt/install.sh
	install -D -m 0644 -t $(DESTDIR)$(PREFIX)/share/hag/libvirt scripts/libvirt/hag.conf
	install -D -m 0644 -t $(DESTDIR)$(PREFIX)/share/doc/hag README.md docs/ha.md docs/libvirt.md \
		docs/gvt-g.md docs/sim-vgpu.md docs/pacemaker.md scripts/systemd/example.conf
	install -d $(DESTDIR)$(PREFIX)/lib/systemd/system
	for u in scripts/systemd/*.service; do \
		sed 's|/usr/bin/hagctl|$(PREFIX)/bin/hagctl|' $$u >$(DESTDIR)$(PREFIX)/lib/systemd/system/$${u##*/}; done
	install -D -m 0755 scripts/pacemaker/vm $(DESTDIR)$(OCF_ROOT)/resource.d/hag/vm
	# Where hagctl looks for each VM's file and the pairs' keys (root's only).
	install -d -m 0700 $(DESTDIR)/etc/hag
	# /run/hag at every boot (/run is a tmpfs): per-VM runtime files, and
	# where a domain's QMP socket for hagctl goes (docs/libvirt.md).
	install -D -m 0644 scripts/systemd/hag.tmpfiles $(DESTDIR)$(PREFIX)/lib/tmpfiles.d/hag.conf
	# What libvirt's AppArmor profile of a domain's QEMU must allow for
	# hagctl (docs/libvirt.md); libvirt's abstraction includes this directory.
	install -D -m 0644 scripts/apparmor/libvirt-qemu.d-hag $(DESTDIR)/etc/apparmor.d/abstractions/libvirt-qemu.d/hag

deb:
	@scripts/build-debs.sh build/deb

# The packages built and checked on this machine: their contents, and
# hag-mdev-dkms's source built by DKMS itself against the cached test
# kernel (in a private DKMS tree; nothing is installed here). The
# package_install scenario then installs hag into a test host.
package-check: deps kernel
	@scripts/build-debs.sh build/deb && $(TOOLCHAIN) && scripts/check-debs.sh build/deb \
		"$$(scripts/build-kernel.sh --print-dir)"

# Host-side checks of every userspace and shared crate.
check-userspace: deps
	cd rust && cargo fmt --check && cargo clippy --all-targets --quiet -- -D warnings && cargo test --quiet
	cd controller && cargo fmt --check && cargo clippy --all-targets --quiet -- -D warnings && \
		cargo clippy --all-targets --quiet --features hagctl/test-switches -- -D warnings && cargo test --quiet
	# Disk deltas, and a standby's VM shape, against a real QEMU on this
	# machine (TCG, no guest; seconds).
	cd controller && cargo test --quiet -p hagctl qemu_disk_ -- --ignored
	cd controller && cargo test --quiet -p hagctl vm_shape::tests::qemu -- --ignored
	qemu-tests/guest/client_check.py --self-test

# The auditor's fuzz target, bounded (FUZZ_SECONDS, default 60).
fuzz:
	scripts/fuzz.sh $(FUZZ_SECONDS)

# Every step runs whatever an earlier one did, so one run shows every
# failure; the target fails at the end, naming the steps that failed. Only
# the build (`all`) stops it: nothing after it can run without it.
# The GVT-g kernel (about 7 min alone, from a copy of the test kernel) and the Debian guest's image are
# built in the background at the lowest priority from the start, in the
# time the steps leave a core idle (test hosts wait on timers and on each
# other); gvt-test waits for the kernel, the first Debian scenario for the
# image (its lock). A failed background build is redone, visibly, by the
# step that needs it.
TEST_STEPS := check-userspace production-module package-check fuzz scenarios eval-selftest gvt-test debug-test-if-cached
test: deps all
	@mkdir -p build; \
	nice -n 19 scripts/build-kernel.sh --flavour gvt >build/gvt-kernel.log 2>&1 & gvt_kernel=$$!; \
	nice -n 19 scripts/build-guest-rootfs.sh >build/guest-rootfs.log 2>&1 & \
	failed=(); took=(); for step in $(TEST_STEPS); do \
		t0=$$(date +%s); \
		if [ "$$step" = gvt-test ]; then \
			wait $$gvt_kernel || echo "make test: the background GVT-g kernel build failed (build/gvt-kernel.log); gvt-test builds it again"; \
		fi; \
		echo "== make test: $$step"; \
		$(MAKE) --no-print-directory test-$$step || failed+=("$$step"); \
		took+=("$$step $$(($$(date +%s) - t0)) s"); \
	done; \
	wait; \
	( IFS=,; echo "make test: each step took: $${took[*]}" ); \
	if [ $${#failed[@]} -gt 0 ]; then echo "make test: FAILED: $${failed[*]}"; exit 1; fi; \
	echo "make test: every step passed ($(TEST_STEPS))"

test-check-userspace: check-userspace
test-fuzz: fuzz
test-production-module: production-module
test-package-check: package-check
test-scenarios:
	qemu-tests/run
test-eval-selftest:
	qemu-tests/eval/selftest
test-gvt-test: gvt-test
test-debug-test-if-cached:
	@$(DEBUG_IF_CACHED)

# Then the real-VM migration benchmark (qemu-tests/eval/qemu-migration):
# the same QEMU/KVM VM without a vGPU, with hag's, and with QEMU's fallback;
# then the real-VM checkpoint benchmark (qemu-tests/eval/qemu-checkpoint):
# a QEMU/KVM VM with its vCPU on a core of its own, unprotected and under
# hagctl checkpoint --qmp at 2 s and 500 ms and two ablations, as blocks
# between unprotected runs (6 per mode; 2 in eval-quick), the pause floor,
# takeover after a GPU hang and after host loss;
# then the database benchmark (qemu-tests/eval/qemu-database): the Debian
# guest's pgbench and a client's commit latency unprotected and protected
# at 2 s and 500 ms, its first synchronisation with and without a template,
# takeover after host loss.
eval: deps all
	qemu-tests/eval/run --out $(EVAL_OUT) --readme README.md
	qemu-tests/eval/qemu-migration --runs 5 --out $(EVAL_OUT) --readme README.md
	qemu-tests/eval/qemu-checkpoint --out $(EVAL_OUT) --readme README.md
	qemu-tests/eval/qemu-database --out $(EVAL_OUT) --readme README.md

eval-quick: deps all
	qemu-tests/eval/run --quick --out $(EVAL_OUT) --readme README.md
	qemu-tests/eval/qemu-migration --runs 3 --out $(EVAL_OUT) --readme README.md
	qemu-tests/eval/qemu-checkpoint --quick --out $(EVAL_OUT) --readme README.md
	qemu-tests/eval/qemu-database --quick --out $(EVAL_OUT) --readme README.md

eval-report: deps
	qemu-tests/eval/run --report-only --out $(EVAL_OUT) --readme README.md
	[ ! -e $(EVAL_OUT)/qemu-migration.json ] || \
		qemu-tests/eval/qemu-migration --report-only --out $(EVAL_OUT) --readme README.md
	[ ! -e $(EVAL_OUT)/qemu-checkpoint.json ] || \
		qemu-tests/eval/qemu-checkpoint --report-only --out $(EVAL_OUT) --readme README.md
	[ ! -e $(EVAL_OUT)/qemu-database.json ] || \
		qemu-tests/eval/qemu-database --report-only --out $(EVAL_OUT) --readme README.md

demo: deps all
	qemu-tests/demo

clean:
	@$(TOOLCHAIN) && kdir=$$(scripts/build-kernel.sh --cached-dir 2>/dev/null) && \
		$(MAKE) -s -C "$$kdir" M=$(CURDIR) clean || true
	cd controller && cargo clean
	cd rust && cargo clean
	rm -rf build

