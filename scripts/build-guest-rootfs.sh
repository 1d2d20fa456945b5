#!/usr/bin/env bash
# Builds the Debian 12 guest of the disk scenarios (issue 19): a root
# filesystem from Debian's own packages (mmdebstrap), ext4 in a qcow2
# image (only its used clusters allocated), booted by the test kernel from
# a virtio-blk disk with systemd, PostgreSQL 15 as the service that
# matters, and a unit for hag-guest's GPU workload. The image is cached
# under $HAG_CACHE like the kernels, keyed on this script (its package list
# and configuration are all here). A scenario never writes it: the VM's
# disk is a qcow2 overlay on it, and the VM's initramfs (vm-init, given
# hag_root=/dev/vda) puts what changes per run, the hag-guest binary and
# its arguments, into that overlay before it switches to the disk's root.
#
#   scripts/build-guest-rootfs.sh             build if not cached; print the image
#   scripts/build-guest-rootfs.sh --cached    print the image if cached, else fail
#
# The guest: host name hag-guest; eth0 203.0.113.50/24 (/etc/hag-vm-ip, set by vm-init);
# root logs in on ttyS0 without a password (a test guest on a closed test
# network); PostgreSQL listens on eth0 and trusts 203.0.113.0/24, with a
# database `hag` owned by role `hag`; hag-guest.service runs
# /usr/local/bin/hag-guest with the words of /etc/hag-guest.args, on the
# console as vm-init's guests say it (HAG-GUEST-READY, HAG-GUEST-RESULT,
# HAG-GUEST-EXIT rc=N), and powers nothing off. A test shuts the guest
# down cleanly over the network: PostgreSQL's superuser writes the file
# /var/lib/postgresql/hag-shutdown (COPY ... TO), and hag-shutdown.path
# has systemd power it off (the test kernel then halts). Documentation, manual pages
# and translations are left out (dpkg path-exclude): every byte of the
# image is copied at a VM's first synchronisation.
set -euo pipefail

HAG_CACHE=${HAG_CACHE:-/var/cache/hag}
MIRROR=${HAG_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SIZE=2G

key=$(sha256sum "$0" | cut -c1-16)
dir=$HAG_CACHE/guest-debian-$key
img=$dir/root.qcow2

if [ -s "$img" ]; then
	echo "$img"
	exit 0
fi
if [ "${1:-}" = --cached ]; then
	echo "build-guest-rootfs: not cached: $img" >&2
	exit 1
fi

mkdir -p "$HAG_CACHE"
exec 9>"$HAG_CACHE/.guest-debian-$key.lock"
flock 9
if [ -s "$img" ]; then
	echo "$img"
	exit 0
fi
for tool in mmdebstrap mke2fs qemu-img; do
	command -v "$tool" >/dev/null || {
		echo "build-guest-rootfs: $tool missing (make deps installs it)" >&2
		exit 1
	}
done

packages=(
	systemd-sysv udev dbus iproute2 procps kmod e2fsprogs
	postgresql-15 postgresql-client-15 postgresql-contrib
)

work=$(mktemp -d "${TMPDIR:-/tmp}/hag-guest-rootfs.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/root
echo "build-guest-rootfs: Debian 12 with ${packages[*]} (mmdebstrap from $MIRROR, a few minutes)" >&2
mmdebstrap --quiet --variant=minbase \
	--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
	--dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
	--include="$(
	IFS=,
	echo "${packages[*]}"
)" bookworm "$root" "$MIRROR" >&2

# The guest's configuration.
echo hag-guest >"$root/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 hag-guest\n' >"$root/etc/hosts"
printf '/dev/vda / ext4 defaults 0 1\n' >"$root/etc/fstab"
# eth0's address, set by the initramfs (vm-init) before it switches to
# this root, as an initramfs's ip= does: systemd-networkd took 12 s of an
# emulated boot to bring up one static address.
echo 203.0.113.50/24 >"$root/etc/hag-vm-ip"
chroot "$root" passwd -d root >/dev/null
mkdir -p "$root/etc/systemd/system/serial-getty@ttyS0.service.d"
cat >"$root/etc/systemd/system/serial-getty@ttyS0.service.d/autologin.conf" <<'EOF'
[Service]
ExecStart=
ExecStart=-/sbin/agetty --autologin root --keep-baud 115200,57600,38400,9600 %I $TERM
EOF
pg=$root/etc/postgresql/15/main
echo "listen_addresses = '*'" >>"$pg/postgresql.conf"
echo "host all all 203.0.113.0/24 trust" >>"$pg/pg_hba.conf"
# The database and role, made here by PostgreSQL in single-user mode (no
# server, no socket): every boot of the image is a first boot (a fresh
# overlay), and making them there took 12 s of the guest's one vCPU.
# One statement per line (each its own transaction: CREATE DATABASE
# refuses a block), any error fatal; its dynamic shared memory in files of
# the data directory (the chroot's /dev/shm is not a tmpfs postgres may
# write).
printf 'CREATE ROLE hag LOGIN\nCREATE DATABASE hag OWNER hag\n' |
	chroot "$root" runuser -u postgres -- /usr/lib/postgresql/15/bin/postgres --single \
		-D /var/lib/postgresql/15/main -c config_file=/etc/postgresql/15/main/postgresql.conf \
		-c dynamic_shared_memory_type=mmap -c exit_on_error=on postgres >&2
cat >"$root/etc/systemd/system/hag-guest.service" <<'EOF'
[Unit]
Description=hag-guest: the GPU and CPU workload on the hag vGPU
ConditionPathExists=/usr/local/bin/hag-guest
After=postgresql.service

[Service]
Type=exec
ExecStart=/bin/sh -c 'exec /usr/local/bin/hag-guest $(cat /etc/hag-guest.args 2>/dev/null)'
ExecStopPost=/bin/sh -c 'echo "HAG-GUEST-EXIT rc=$$EXIT_STATUS" >/dev/console'
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=multi-user.target
EOF
cat >"$root/etc/systemd/system/hag-shutdown.path" <<'EOF'
[Unit]
Description=A clean shutdown, asked for by PostgreSQL's superuser

[Path]
PathExists=/var/lib/postgresql/hag-shutdown

[Install]
WantedBy=multi-user.target
EOF
cat >"$root/etc/systemd/system/hag-shutdown.service" <<'EOF'
[Unit]
Description=A clean shutdown, asked for by PostgreSQL's superuser

[Service]
Type=oneshot
ExecStart=/bin/rm -f /var/lib/postgresql/hag-shutdown
ExecStart=/bin/systemctl poweroff --no-block
EOF
chroot "$root" systemctl enable hag-guest.service hag-shutdown.path >/dev/null 2>&1
# No network manager (vm-init has set eth0 up before systemd starts), no
# timer that writes the disk on its own between epochs; e2scrub_reap (15
# s of the boot's one vCPU) has no snapshots to reap. Nothing here needs
# D-Bus or logind (systemctl reaches systemd over its private socket; no
# one logs in but the serial console's autologin), a VGA console (there
# is none) or the modules the modprobe@ units load (built in or absent).
# In a test host, where the guest's vCPU is emulated, the boot to
# HAG-GUEST-READY went from 67 s to about 45 s without them.
chroot "$root" systemctl mask systemd-networkd.service systemd-networkd-wait-online.service systemd-network-generator.service apt-daily.timer \
	apt-daily-upgrade.timer e2scrub_all.timer e2scrub_reap.service fstrim.timer man-db.timer \
	dbus.socket dbus.service systemd-logind.service getty@tty1.service \
	modprobe@configfs.service modprobe@dm_mod.service modprobe@drm.service \
	modprobe@efi_pstore.service modprobe@fuse.service modprobe@loop.service >/dev/null 2>&1 || true
rm -f "$root/etc/machine-id"
touch "$root/etc/machine-id"

mkdir -p "$dir"
mke2fs -q -t ext4 -L hagroot -d "$root" "$work/root.raw" "$SIZE"
qemu-img convert -O qcow2 "$work/root.raw" "$work/root.qcow2"
mv "$work/root.qcow2" "$img"
echo "build-guest-rootfs: a $SIZE disk, $(du -h "$img" | cut -f1) in its image" >&2
echo "$img"
