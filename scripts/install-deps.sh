#!/usr/bin/env bash
# Installs what building and testing hag needs on Debian 12, and nothing that
# is already there. Safe to run repeatedly; `make` runs it first.
#
#   Debian packages: the kernel build (GCC, bison, flex, libelf, libssl, bc,
#   cpio), libclang for bindgen, Debian's Rust 1.96 with its library source
#   (the kernel needs rust-src, which rustup's toolchain here lacks), the
#   kernel source, busybox for test-host initramfs, QEMU for test hosts,
#   matplotlib for the evaluation's plots, Pacemaker, corosync and pcs for
#   the Pacemaker scenario (never started on this machine: test hosts run
#   them from its root).
#   QEMU 10 and libvirt 11 from bookworm-backports: the test hosts run real
#   VMs with them (Debian 12's QEMU 7.2 has only VFIO migration v1, which
#   kernel 6.12 removed). Only these packages are pinned to backports, so
#   nothing else (systemd, say) is upgraded from there.
#   The test hosts' QEMU (scripts/build-qemu.sh) builds from source with
#   meson 1.7 (QEMU 10 needs 1.5; Debian 12 has 1.0) and python3-pycotap
#   from bookworm-backports, pinned like QEMU, and ninja, GLib, zlib, libfdt.
#   bindgen-cli: Debian's 0.60 is older than the kernel's minimum 0.65.1, so
#   a pinned version is built from crates.io into $HAG_TOOLS.
set -euo pipefail

HAG_TOOLS=${HAG_TOOLS:-${HAG_CACHE:-/var/cache/hag}/tools}
BINDGEN_VERSION=0.71.1

packages=(
	build-essential bc bison flex libelf-dev libssl-dev cpio kmod xz-utils
	libclang-dev
	rustc-web rust-web-src cargo-web
	linux-source-6.12
	busybox-static qemu-system-x86 python3
	# qemu-img and qemu-storage-daemon: hagctl reads disk deltas with
	# qemu-img; the disk scenarios make images and a vhost-user-blk export
	qemu-utils
	# real VMs in the test hosts (from bookworm-backports, pinned below)
	libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients
	# UEFI firmware for a VM (qemu_migrate_ovmf)
	ovmf
	# the evaluation's plots (qemu-tests/eval)
	python3-matplotlib
	# the Debian guest's root filesystem (scripts/build-guest-rootfs.sh)
	# and its database's client and checks (pg_amcheck, e2fsck)
	mmdebstrap e2fsprogs postgresql-client-15 python3-psycopg2
	# make package-check: DKMS builds the packaged module's source, and
	# systemd-analyze verifies the units
	dkms systemd
	# Pacemaker in the test hosts (pacemaker_failover): two nodes, a
	# quorum device on a third, configured with pcs as docs/pacemaker.md
	# says
	pacemaker pacemaker-cli-utils corosync corosync-qdevice corosync-qnetd pcs
	# make package-check validates the resource agent's meta-data
	libxml2-utils
	# scripts/build-qemu.sh: the test hosts' QEMU (meson and pycotap from
	# bookworm-backports, pinned below)
	curl bzip2 pkg-config ninja-build meson python3-pycotap python3-venv
	libglib2.0-dev zlib1g-dev libfdt-dev
	# libvirt under AppArmor in a test host (quick_start): the parser of
	# libvirt's profiles (libvirt-daemon has them and virt-aa-helper)
	apparmor
)

# Backports, and a pin that takes just QEMU, libvirt, QEMU's firmware and
# the meson that builds the test hosts' QEMU from there.
backports_list=/etc/apt/sources.list.d/hag-backports.sources
backports_pin=/etc/apt/preferences.d/hag-backports
want_list='Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg'
want_pin='Package: qemu-system-x86 qemu-system-common qemu-system-data qemu-system-gui qemu-system-modules-* qemu-block-extra qemu-utils libvirt* seabios ipxe-qemu ovmf meson python3-pycotap
Pin: release n=bookworm-backports
Pin-Priority: 500'
if [ "$(cat "$backports_list" 2>/dev/null)" != "$want_list" ] || [ "$(cat "$backports_pin" 2>/dev/null)" != "$want_pin" ]; then
	echo "install-deps: adding bookworm-backports for QEMU 10 and libvirt 11 ($backports_list, $backports_pin)"
	printf '%s\n' "$want_list" >"$backports_list"
	printf '%s\n' "$want_pin" >"$backports_pin"
fi

missing=()
for p in "${packages[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
# A QEMU older than 10 (Debian 12's own 7.2) is replaced.
qemu_version=$(dpkg-query -W -f='${Version}' qemu-system-x86 2>/dev/null || true)
case $qemu_version in
'' | 1:10.* | 1:1[1-9].*) ;;
*) missing+=(qemu-system-x86) ;;
esac
# So is a meson older than QEMU 10's minimum 1.5 (Debian 12's own 1.0).
case $(dpkg-query -W -f='${Version}' meson 2>/dev/null || true) in
'' | 1.[5-9].* | 1.[1-9][0-9].*) ;;
*) missing+=(meson) ;;
esac
if ((${#missing[@]})); then
	echo "install-deps: installing Debian packages: ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	# The daemons these packages bring (corosync, pacemaker, pcsd,
	# libvirtd) are not started on this machine: the test hosts run their
	# own. policy-rc.d says so to the packages' scripts while they install.
	policy=/usr/sbin/policy-rc.d
	if [ ! -e "$policy" ]; then
		printf '#!/bin/sh\nexit 101\n' >"$policy"
		chmod +x "$policy"
		trap 'rm -f "$policy"' EXIT
	fi
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# bindgen: the kernel's scripts/min-tool-version.sh says 0.65.1 for 6.12.
have_bindgen() {
	[ -x "$HAG_TOOLS/bin/bindgen" ] &&
		"$HAG_TOOLS/bin/bindgen" --version 2>/dev/null | grep -q "bindgen $BINDGEN_VERSION"
}
if ! have_bindgen; then
	if command -v bindgen >/dev/null; then
		echo "install-deps: $(command -v bindgen) is $(bindgen --version 2>/dev/null | awk '{print $2}'), older than the kernel's minimum 0.65.1 or not the pinned $BINDGEN_VERSION; building bindgen-cli $BINDGEN_VERSION"
	else
		echo "install-deps: bindgen not found; building bindgen-cli $BINDGEN_VERSION (about 3 minutes)"
	fi
	mkdir -p "$HAG_TOOLS"
	# Debian's cargo (1.96) builds it; rustup's may be absent on a fresh machine.
	/usr/bin/cargo install -q bindgen-cli --version "$BINDGEN_VERSION" --locked --root "$HAG_TOOLS"
fi
# Says once, here, which rustc the kernel build will use and why.
(HAG_TOOLCHAIN_QUIET= . "$(dirname "$0")/toolchain.sh")
echo "install-deps: ok (bindgen $("$HAG_TOOLS/bin/bindgen" --version | awk '{print $2}'), rustc $(/usr/bin/rustc --version | awk '{print $2}'))"
