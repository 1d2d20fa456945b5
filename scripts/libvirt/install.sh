#!/bin/sh
# Installs hag's libvirt qemu hook (scripts/libvirt/qemu) and a sample
# /etc/hag/hag.conf. See docs/libvirt.md.
#
# usage: install.sh [--root DIR] [--dropin] [--force] [--uninstall]
#   --root DIR    install under DIR instead of / (staging, packaging, tests)
#   --dropin      install as /etc/libvirt/hooks/qemu.d/50-hag (libvirt >= 6.5
#                 runs every script there), for a host that already has a
#                 qemu hook of its own
#   --force       replace an /etc/libvirt/hooks/qemu that is not hag's
#   --uninstall   remove hag's hook (only a file that carries hag's marker);
#                 hag.conf and the logs stay
# libvirt notices a new hook script only when it starts: restart libvirtd
# (or virtqemud) afterwards.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
root=
dropin=
force=
uninstall=
MARKER=hag-libvirt-hook

die() {
	echo "install.sh: $*" >&2
	exit 1
}

while [ $# -gt 0 ]; do
	case "$1" in
	--root)
		[ $# -ge 2 ] || die "--root needs a directory"
		root=${2%/}
		shift 2
		;;
	--dropin) dropin=1 && shift ;;
	--force) force=1 && shift ;;
	--uninstall) uninstall=1 && shift ;;
	-h | --help)
		sed -n '2,/^set -eu/p' "$0" | sed '$d; s/^# \{0,1\}//'
		exit 0
		;;
	*) die "unknown argument '$1' (try --help)" ;;
	esac
done

hooks=$root/etc/libvirt/hooks
main_hook=$hooks/qemu
dropin_hook=$hooks/qemu.d/50-hag
conf=$root/etc/hag/hag.conf

ours() { [ -f "$1" ] && grep -q "$MARKER" "$1"; }

if [ -n "$uninstall" ]; then
	for f in "$main_hook" "$dropin_hook"; do
		if ours "$f"; then
			rm -f "$f"
			echo "removed $f"
		elif [ -e "$f" ]; then
			echo "left $f: not hag's hook"
		fi
	done
	echo "kept $conf and the logs; restart libvirtd (or virtqemud) so it forgets the hook"
	exit 0
fi

[ -f "$here/qemu" ] || die "$here/qemu missing"
if [ -n "$dropin" ]; then
	target=$dropin_hook
elif [ -e "$main_hook" ] && ! ours "$main_hook" && [ -z "$force" ]; then
	die "$main_hook exists and is not hag's: use --dropin (libvirt >= 6.5), merge it by hand, or --force"
else
	target=$main_hook
fi

mkdir -p "$(dirname "$target")"
cp "$here/qemu" "$target.hag-new"
chmod 0755 "$target.hag-new"
mv -f "$target.hag-new" "$target"
echo "installed $target"
if [ -n "$dropin" ] && ours "$main_hook"; then
	rm -f "$main_hook"
	echo "removed hag's older $main_hook (now $target)"
fi

mkdir -p "$(dirname "$conf")"
if [ -e "$conf" ]; then
	echo "kept $conf"
else
	cp "$here/hag.conf" "$conf"
	chmod 0644 "$conf"
	echo "installed $conf (every setting commented out: the defaults)"
fi
mkdir -p "$root/var/log/hag"
chmod 0750 "$root/var/log/hag"

command -v hagctl >/dev/null 2>&1 ||
	echo "note: no hagctl on PATH: set HAGCTL in $conf, or the hook leaves domains unprotected"
echo "restart libvirtd (or virtqemud) for libvirt to run the hook"
