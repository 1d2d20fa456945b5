#!/usr/bin/env bash
# Builds the Debian 12 guest of the disk scenarios (issue 19): a root
# filesystem from Debian's own packages (mmdebstrap), ext4 in a sparse raw
# image, booted by the test kernel from a virtio-blk disk (root=/dev/vda)
# with systemd, PostgreSQL 15 as the service that matters, and a unit for
# hag-guest's GPU workload. The image is cached under $HAG_CACHE like the
# kernels, keyed on this script (its package list and configuration are
# all here); a scenario copies it and writes what changes per run (the
# hag-guest binary, its arguments) into the copy with debugfs, never into
# the cache.
#
#   scripts/build-guest-rootfs.sh             build if not cached; print the image
#   scripts/build-guest-rootfs.sh --cached    print the image if cached, else fail
#
# The guest: host name hag-guest; eth0 203.0.113.50/24 (systemd-networkd);
# root logs in on ttyS0 without a password (a test guest on a closed test
# network); PostgreSQL listens on eth0 and trusts 203.0.113.0/24, with a
# database `hag` owned by role `hag`; hag-guest.service runs
# /usr/local/bin/hag-guest with the words of /etc/hag-guest.args and
# powers nothing off.
set -euo pipefail

HAG_CACHE=${HAG_CACHE:-/var/cache/hag}
MIRROR=${HAG_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SIZE=2G

key=$(sha256sum "$0" | cut -c1-16)
dir=$HAG_CACHE/guest-debian-$key
img=$dir/root.raw

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
for tool in mmdebstrap mke2fs; do
	command -v "$tool" >/dev/null || {
		echo "build-guest-rootfs: installing $tool" >&2
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap e2fsprogs >/dev/null
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
mmdebstrap --quiet --variant=minbase --include="$(
	IFS=,
	echo "${packages[*]}"
)" bookworm "$root" "$MIRROR" >&2

# The guest's configuration.
echo hag-guest >"$root/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 hag-guest\n' >"$root/etc/hosts"
printf '/dev/vda / ext4 defaults 0 1\n' >"$root/etc/fstab"
mkdir -p "$root/etc/systemd/network"
cat >"$root/etc/systemd/network/eth0.network" <<'EOF'
[Match]
Name=eth0

[Network]
Address=203.0.113.50/24
EOF
chroot "$root" systemctl enable systemd-networkd.service >/dev/null 2>&1
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
cat >"$root/etc/systemd/system/hag-db-setup.service" <<'EOF'
[Unit]
Description=The hag database and role (once)
After=postgresql.service
Requires=postgresql.service
ConditionPathExists=!/var/lib/postgresql/hag-db-ready

[Service]
Type=oneshot
User=postgres
ExecStart=/usr/bin/psql -v ON_ERROR_STOP=1 -c "CREATE ROLE hag LOGIN" -c "CREATE DATABASE hag OWNER hag"
ExecStart=/usr/bin/touch /var/lib/postgresql/hag-db-ready

[Install]
WantedBy=multi-user.target
EOF
cat >"$root/etc/systemd/system/hag-guest.service" <<'EOF'
[Unit]
Description=hag-guest: the GPU and CPU workload on the hag vGPU
ConditionPathExists=/usr/local/bin/hag-guest

[Service]
Type=simple
EnvironmentFile=-/etc/hag-guest.env
ExecStart=/bin/sh -c 'exec /usr/local/bin/hag-guest $(cat /etc/hag-guest.args 2>/dev/null)'
StandardOutput=journal+console

[Install]
WantedBy=multi-user.target
EOF
chroot "$root" systemctl enable hag-db-setup.service hag-guest.service >/dev/null 2>&1
# Nothing waits for a network that is not there, and no timer writes the
# disk on its own between epochs.
chroot "$root" systemctl mask systemd-networkd-wait-online.service apt-daily.timer \
	apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer man-db.timer >/dev/null 2>&1 || true
rm -f "$root/etc/machine-id"
touch "$root/etc/machine-id"

mkdir -p "$dir"
mke2fs -q -t ext4 -L hagroot -d "$root" "$work/root.raw" "$SIZE"
mv "$work/root.raw" "$img"
echo "build-guest-rootfs: $(du -h --apparent-size "$img" | cut -f1) image, $(du -h "$img" | cut -f1) allocated" >&2
echo "$img"
