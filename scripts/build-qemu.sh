#!/usr/bin/env bash
# Builds the test hosts' QEMU once, cached outside the work tree.
#
# Test hosts are QEMU with TCG (this machine's /dev/kvm cannot boot Linux)
# running real KVM VMs, that is TCG emulating AMD SVM. Debian's QEMU 10.0.2
# has two TCG bugs on that path (docs/testing.md, "The test hosts' QEMU"):
#   - helper_vmrun sets CPU_INTERRUPT_VIRQ in interrupt_request without the
#     BQL, a read-modify-write that can drop a wake-up another thread set
#     (an IPI or the APIC timer): a test host's CPU then halts with an
#     interrupt pending and is lost. Fixed upstream in 10.2 by atomic
#     updates; scripts/qemu/0001 is the minimal equivalent.
#   - helper_write_crN calls cpu_interrupt without the BQL when a nested
#     guest writes CR8 with a virtual interrupt pending (OVMF does): QEMU
#     aborts on its assertion. Not fixed upstream; scripts/qemu/0002.
# So test hosts run this build: Debian's 10.0.2 source (the same upstream
# release as the installed qemu-system-x86) with scripts/qemu/*.patch
# applied, only x86_64-softmmu, only the devices a test host uses
# (scripts/qemu/devices-x86_64-hag.mak), Debian's firmware packages read
# where Debian's QEMU reads them. The VMs inside test hosts keep Debian's
# QEMU and libvirt: KVM there, not TCG.
#
# The cache directory's name is a hash of the source's checksum, the
# patches, the device list, the configure arguments and a recipe number,
# so a changed input rebuilds and an unchanged one does not.
#
#   scripts/build-qemu.sh               build if needed
#   scripts/build-qemu.sh --print-path  build if needed, print the binary's path
#   scripts/build-qemu.sh --cached-path print the binary's path if built, else fail
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
HAG_CACHE=${HAG_CACHE:-/var/cache/hag}
mode=
case ${1:-} in
'') ;;
--print-path | --cached-path) mode=$1 ;;
*) echo "build-qemu: unknown argument $1" >&2; exit 2 ;;
esac

log() { echo "build-qemu: $*" >&2; }
die() { echo "build-qemu: $*" >&2; exit 1; }

# The upstream source as Debian ships it (+ds: without prebuilt firmware or
# bundled wheels), fetched from the archive's pool and checked against the
# checksum Debian's Sources index gives for it.
version=10.0.2
orig=qemu_$version+ds.orig.tar.xz
orig_url=http://deb.debian.org/debian/pool/main/q/qemu/$orig
orig_sha256=0901da33844a331bf8b3602b9c1fbd178e60b737c8e3ade678255bd090c9b9f1

# Bump when a change to this script changes what it builds.
recipe=1
configure_args=(
	--python=/usr/bin/python3
	--target-list=x86_64-softmmu
	--without-default-features --without-default-devices --with-devices-x86_64=hag
	--enable-kvm --enable-virtfs --enable-attr
	--disable-docs --disable-install-blobs
	# Where Debian's QEMU finds its firmware (qemu-system-data, seabios,
	# ipxe-qemu): the same packages serve this binary.
	--firmwarepath=/usr/share/qemu:/usr/share/seabios:/usr/lib/ipxe/qemu
)
shopt -s nullglob
patches=("$here"/qemu/*.patch)
shopt -u nullglob
devices=$here/qemu/devices-x86_64-hag.mak
key=$( { echo "$recipe $orig_sha256 ${configure_args[*]}"; cat "$devices";
	for p in "${patches[@]}"; do echo "$(basename "$p") $(sha256sum <"$p")"; done; } | sha256sum | cut -c1-16)
dir=$HAG_CACHE/qemu-$key
binary=$dir/bin/qemu-system-x86_64

if [ "$mode" = --cached-path ]; then
	[ -e "$dir/.built" ] && echo "$binary"
	exit $?
fi

# One build at a time: a second caller waits for the first and then finds
# the binary built.
mkdir -p "$HAG_CACHE"
exec 9>"$HAG_CACHE/.qemu-$key.lock"
flock 9
if [ ! -e "$dir/.built" ]; then
	tarball=$HAG_CACHE/src/$orig
	if ! echo "$orig_sha256  $tarball" | sha256sum -c --status 2>/dev/null; then
		log "fetching $orig_url"
		mkdir -p "$HAG_CACHE/src"
		curl -fsS --retry 3 -o "$tarball.part" "$orig_url" || die "could not fetch $orig_url"
		echo "$orig_sha256  $tarball.part" | sha256sum -c --status ||
			die "$orig_url does not have the expected SHA-256 $orig_sha256"
		mv "$tarball.part" "$tarball"
	fi
	log "building qemu-system-x86_64 $version with ${#patches[@]} patch(es) into $dir (on 2 cores about 3 minutes)"
	rm -rf "$dir"
	mkdir -p "$dir/src"
	tar -C "$dir/src" --strip-components=1 -xf "$tarball"
	for p in "${patches[@]}"; do
		out=$(patch -d "$dir/src" -p1 --dry-run -s -f <"$p" 2>&1) ||
			die "scripts/qemu/$(basename "$p") does not apply to QEMU $version: $out"
		patch -d "$dir/src" -p1 -s -f <"$p" >/dev/null
		log "applied $(basename "$p")"
	done
	cp "$devices" "$dir/src/configs/devices/x86_64-softmmu/hag.mak"
	# The +ds source lacks the EDK2 images meson lists whenever bzip2 is
	# installed; none is installed (--disable-install-blobs), empty ones
	# satisfy the list.
	for fd in $(grep -o "'edk2-[a-z0-9_-]*\.fd'" "$dir/src/pc-bios/meson.build" | tr -d "'"); do
		[ -e "$dir/src/pc-bios/$fd.bz2" ] || printf '' | bzip2 >"$dir/src/pc-bios/$fd.bz2"
	done
	mkdir -p "$dir/src/build"
	(cd "$dir/src/build" && ../configure --prefix="$dir" "${configure_args[@]}" >"$dir/configure.log" 2>&1) ||
		die "configure failed: $(tail -5 "$dir/configure.log")"
	ninja -C "$dir/src/build" -j"$(nproc)" qemu-system-x86_64 >"$dir/build.log" 2>&1 ||
		die "the build failed: $(grep -m5 -E 'error|FAILED' "$dir/build.log")"
	mkdir -p "$dir/bin"
	# Out of the build tree: there, QEMU looks for firmware in the tree.
	cp "$dir/src/build/qemu-system-x86_64" "$binary"
	"$binary" --version >/dev/null || die "$binary does not run"
	rm -rf "$dir/src"
	touch "$dir/.built"
	log "built $binary"
fi
[ "$mode" = --print-path ] && echo "$binary"
exit 0
