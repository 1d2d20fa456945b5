#!/usr/bin/env bash
# Prepares and builds the test kernel once, cached outside the work tree.
#
# The tree is Debian's linux-source-6.12 configured as tinyconfig plus
# scripts/kernel-test.config. The cache directory's name is a hash of the
# fragment, the source package version, the Rust and bindgen versions and
# a recipe number kept below, so a changed fragment rebuilds and an
# unchanged one does not.
#
#   scripts/build-kernel.sh            build if needed, print nothing else
#   scripts/build-kernel.sh --print-dir   build if needed, print the tree's path
#   scripts/build-kernel.sh --cached-dir  print the tree's path if it is built,
#                                         else fail (never builds)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
HAG_CACHE=${HAG_CACHE:-/var/cache/hag}
HAG_TOOLS=${HAG_TOOLS:-$HAG_CACHE/tools}
fragment=${HAG_KERNEL_FRAGMENT:-$here/kernel-test.config}
tarball=/usr/src/linux-source-6.12.tar.xz

log() { echo "build-kernel: $*" >&2; }
die() { echo "build-kernel: $*" >&2; exit 1; }

. "$here/toolchain.sh"

[ -r "$tarball" ] || die "$tarball missing: install linux-source-6.12 (scripts/install-deps.sh)"
src_version=$(dpkg-query -W -f='${Version}' linux-source-6.12)

# Bump when a change to this script changes what it builds.
recipe=1
key=$( { cat "$fragment"; echo "$recipe $src_version"; "$RUSTC" --version; "$BINDGEN" --version; } |
	sha256sum | cut -c1-16)
name=$(basename "$fragment" .config)
dir=$HAG_CACHE/$name-$key
tree=$dir/linux

if [ "${1:-}" = --cached-dir ]; then
	[ -e "$dir/.built" ] && echo "$tree"
	exit $?
fi
if [ ! -e "$dir/.built" ]; then
	log "building $name kernel $src_version into $dir (about 6 minutes on 2 cores)"
	rm -rf "$dir"
	mkdir -p "$dir"
	tar -C "$dir" -xf "$tarball"
	mv "$dir/linux-source-6.12" "$tree"
	kmake() { make -C "$tree" -s -j"$(nproc)" RUSTC="$RUSTC" BINDGEN="$BINDGEN" "$@"; }
	kmake rustavailable >/dev/null || die "the kernel says Rust is not available: $(kmake rustavailable 2>&1 | tail -3)"
	kmake tinyconfig >/dev/null
	"$tree/scripts/kconfig/merge_config.sh" -m -O "$tree" "$tree/.config" "$fragment" >/dev/null
	kmake olddefconfig >/dev/null
	# Kconfig drops symbols whose dependencies are unmet without a word; say which.
	missing=$(grep -E '^CONFIG_[A-Z0-9_]+=' "$fragment" | while read -r line; do
		grep -qx "$line" "$tree/.config" || echo "$line"; done)
	[ -z "$missing" ] || die "the config fragment did not take effect for: $(echo $missing)"
	kmake bzImage modules 2>&1 | grep -v -e '^  [A-Z]' -e 'Failed to run rustfmt' >&2 || true
	[ -f "$tree/arch/x86/boot/bzImage" ] || die "the kernel build failed (see above)"
	touch "$dir/.built"
	log "built $tree/arch/x86/boot/bzImage"
fi
[ "${1:-}" = --print-dir ] && echo "$tree"
exit 0
