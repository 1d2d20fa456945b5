#!/usr/bin/env bash
# Builds hag's two Debian packages from this tree, into OUT (default
# build/deb):
#   hag_VERSION_amd64.deb (VERSION: the crate's, then +git and the commit)
#                                hagctl (a production build: no test
#       switches), its man pages and bash completion, the systemd units
#       hag-checkpoint@.service and hag-backup@.service (not enabled: a VM
#       needs its /etc/hag/VM.conf first) and hag-witness.service (for a
#       third host: its /etc/hag/witness.env first), the libvirt hook with
#       its installer and sample hag.conf (in /usr/share/hag/libvirt; the
#       package does not replace a host's hook: run its install.sh), and
#       the docs. `make install` installs the same files (PREFIX, DESTDIR).
#   hag-mdev-dkms_VERSION_all.deb  hag_mdev.ko's source under
#       /usr/src/hag-mdev-VERSION with scripts/dkms.conf: DKMS builds it
#       for each kernel that has Rust and VFIO mdev (see that file).
# Needs cargo and dpkg-deb; touches nothing outside this tree.
#
# usage: scripts/build-debs.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/deb}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' controller/hagctl/Cargo.toml | head -1)
[ -n "$version" ] || { echo "build-debs: no version in controller/hagctl/Cargo.toml" >&2; exit 1; }
# From a git tree, the commit's time and hash follow (0.1.0+git202612030512.ea83413):
# each build orders after the ones before it, as dpkg compares versions.
if commit=$(git log -1 --format='%cd.%h' --date=format:%Y%m%d%H%M 2>/dev/null); then
	version="$version+git$commit"
fi
rm -f "$out"/hag_*_amd64.deb "$out"/hag-mdev-dkms_*_all.deb
stage=$(mktemp -d build-debs.XXXXXX --tmpdir)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$out"

# --- hag: the userspace ---
root=$stage/hag
make --no-print-directory install DESTDIR="$root" PREFIX=/usr >/dev/null
size=$(du -sk "$root" | cut -f1)
mkdir -p "$root/DEBIAN"
cat >"$root/DEBIAN/control" <<EOF
Package: hag
Version: $version
Architecture: amd64
Maintainer: hag developers <hag@localhost>
Installed-Size: $size
Depends: libc6 (>= 2.36), libgcc-s1
Recommends: qemu-system-x86 (>= 1:10), qemu-utils, hag-mdev-dkms
Suggests: libvirt-daemon-system, libvirt-clients, pacemaker, pcs
Section: admin
Priority: optional
Description: high availability for VMs with mediated vGPUs
 hagctl migrates QEMU/KVM VMs with a hag vGPU, protects them with
 continuous checkpoints (memory, device and vGPU state, disks) to a
 backup host that takes over on a GPU hang or host loss, and drives the
 hag_mdev kernel module (packaged as hag-mdev-dkms). The libvirt hook
 is in /usr/share/hag/libvirt (install.sh puts it in place).
EOF
# systemd reads the new units (none is enabled: a VM needs its
# /etc/hag/VM.conf first), and /run/hag is made now rather than at the next
# boot (a domain's QMP socket may be there), as debhelper's scripts do.
for script in postinst postrm; do
	cat >"$root/DEBIAN/$script" <<'EOF'
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
	systemctl daemon-reload >/dev/null || true
fi
EOF
	chmod 0755 "$root/DEBIAN/$script"
done
# The AppArmor rules are the host's to adjust: dpkg keeps its changes.
echo /etc/apparmor.d/abstractions/libvirt-qemu.d/hag >"$root/DEBIAN/conffiles"
cat >>"$root/DEBIAN/postinst" <<'EOF'
if [ "$1" = configure ] && command -v systemd-tmpfiles >/dev/null; then
	systemd-tmpfiles --create hag.conf || true
fi
EOF
dpkg-deb --root-owner-group -Zxz --build "$root" "$out/hag_${version}_amd64.deb" >/dev/null
echo "build-debs: $out/hag_${version}_amd64.deb"

# --- hag-mdev-dkms: the module's source for DKMS ---
root=$stage/dkms
src=$root/usr/src/hag-mdev-$version
mkdir -p "$src"
# What the module's build reads: Kbuild, the module and the shared crates'
# sources that hag.rs includes by relative path (as make gvt copies them).
tar -c --exclude='*.o' --exclude='*.ko' --exclude='*.mod' --exclude='*.mod.c' --exclude='.*.cmd' \
	--exclude='*.d' --exclude='*.rmeta' --exclude=modules.order --exclude=Module.symvers \
	--exclude=.kernel-tree Kbuild rust/hag_mdev rust/hag_*/src | tar -C "$src" -x
sed "s/@VERSION@/$version/" scripts/dkms.conf >"$src/dkms.conf"
mkdir -p "$root/DEBIAN"
cat >"$root/DEBIAN/control" <<EOF
Package: hag-mdev-dkms
Version: $version
Architecture: all
Maintainer: hag developers <hag@localhost>
Depends: dkms
Section: kernel
Priority: optional
Description: hag_mdev kernel module (DKMS source)
 The hag_mdev module (Rust-for-Linux): command auditing and vGPU
 snapshots for Intel GVT-g, and the hag-sim vGPU. DKMS builds it for a
 kernel built with CONFIG_RUST and CONFIG_VFIO_MDEV, with the rustc that
 built that kernel (RUSTC= and BINDGEN= name them if they are not first
 on PATH).
EOF
cat >"$root/DEBIAN/postinst" <<EOF
#!/bin/sh
set -e
if [ "\$1" = configure ]; then
	dkms add -m hag-mdev -v $version >/dev/null 2>&1 || true
	# A kernel without Rust or mdev is skipped (BUILD_EXCLUSIVE_CONFIG).
	dkms autoinstall >/dev/null 2>&1 || echo "hag-mdev-dkms: not built for the running kernel: dkms status says why"
fi
EOF
cat >"$root/DEBIAN/prerm" <<EOF
#!/bin/sh
set -e
dkms remove -m hag-mdev -v $version --all >/dev/null 2>&1 || true
EOF
chmod 0755 "$root/DEBIAN/postinst" "$root/DEBIAN/prerm"
dpkg-deb --root-owner-group -Zxz --build "$root" "$out/hag-mdev-dkms_${version}_all.deb" >/dev/null
echo "build-debs: $out/hag-mdev-dkms_${version}_all.deb"
