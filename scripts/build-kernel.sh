#!/usr/bin/env bash
# Prepares and builds a test kernel once, cached outside the work tree.
#
# The tree is Debian's linux-source-6.12 configured as tinyconfig plus a
# config fragment. Three flavours:
#   test  scripts/kernel-test.config (the default)
#   gvt   scripts/kernel-test.config + scripts/kernel-gvt.config (i915 with
#         GVT-g and KVMGT), with the patch series scripts/gvt/*.patch
#         applied in name order
#   debug scripts/kernel-test.config + scripts/kernel-debug.config (KASAN,
#         KFENCE, UBSAN, lockdep, atomic-sleep checks, panic_on_warn),
#         built with LLVM=1 (KASAN with Rust needs clang); a module for it
#         must be built with LLVM=1 too (--print-make-args says so)
# Each flavour builds in its own source copy (gvt starts from a copy of the
# built test tree when there is one). The cache directory's name
# is a hash of the fragment(s) (for gvt and debug, their settings only;
# for debug also clang's version), the patches,
# the source package version, the Rust and bindgen versions and a recipe
# number kept below, so a changed input rebuilds and an unchanged one does
# not.
#
#   scripts/build-kernel.sh [--flavour F]               build if needed
#   scripts/build-kernel.sh [--flavour F] --print-dir   build if needed, print
#                                                       the tree's path
#   scripts/build-kernel.sh [--flavour F] --cached-dir  print the tree's path
#                                                       if built, else fail
#   scripts/build-kernel.sh [--flavour F] --print-make-args
#                                                       print the make
#                                                       variables a module
#                                                       build needs (LLVM=1)
# The flavour may also come from $HAG_FLAVOUR.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
HAG_CACHE=${HAG_CACHE:-/var/cache/hag}
HAG_TOOLS=${HAG_TOOLS:-$HAG_CACHE/tools}
tarball=/usr/src/linux-source-6.12.tar.xz
flavour=${HAG_FLAVOUR:-test}
mode=
while [ $# -gt 0 ]; do
	case $1 in
	--flavour) flavour=${2:?--flavour needs a name}; shift 2 ;;
	--flavour=*) flavour=${1#--flavour=}; shift ;;
	--print-dir | --cached-dir | --print-make-args) mode=$1; shift ;;
	*) echo "build-kernel: unknown argument $1" >&2; exit 2 ;;
	esac
done

log() { echo "build-kernel: $*" >&2; }
die() { echo "build-kernel: $*" >&2; exit 1; }

. "$here/toolchain.sh"

[ -r "$tarball" ] || die "$tarball missing: install linux-source-6.12 (scripts/install-deps.sh)"
src_version=$(dpkg-query -W -f='${Version}' linux-source-6.12)

# Bump when a change to this script changes what it builds.
recipe=1
patches=()
make_args=()
seed=
case $flavour in
test)
	# The key is computed as it always was, so that cached test kernels
	# stay valid.
	fragment=${HAG_KERNEL_FRAGMENT:-$here/kernel-test.config}
	key=$( { cat "$fragment"; echo "$recipe $src_version"; "$RUSTC" --version; "$BINDGEN" --version; } |
		sha256sum | cut -c1-16)
	name=$(basename "$fragment" .config)
	;;
gvt)
	fragment=$(mktemp)
	trap 'rm -f "$fragment"' EXIT
	cat "$here/kernel-test.config" "$here/kernel-gvt.config" >"$fragment"
	shopt -s nullglob
	patches=("$here"/gvt/*.patch)
	shopt -u nullglob
	[ ${#patches[@]} -gt 0 ] || die "no patches in $here/gvt"
	# Keyed on the settings, not the comments, so that editing an
	# explanation does not cost a kernel build.
	key=$( { grep -E '^CONFIG_|^# CONFIG_' "$fragment"; echo "$recipe $src_version"; "$RUSTC" --version;
		"$BINDGEN" --version; for p in "${patches[@]}"; do echo "$(basename "$p") $(sha256sum <"$p")"; done; } |
		sha256sum | cut -c1-16)
	name=kernel-gvt
	# The test kernel's built tree, if there is one: the GVT-g kernel is
	# that kernel plus i915, so it is built incrementally from a copy of
	# it (kbuild rebuilds what the changed settings and the patches touch;
	# about a third of a whole build's time).
	seed=$(env -u HAG_KERNEL_FRAGMENT "$here/build-kernel.sh" --flavour test --cached-dir 2>/dev/null || true)
	;;
debug)
	make_args=(LLVM=1)
	fragment=$(mktemp)
	trap 'rm -f "$fragment"' EXIT
	# On top of the test kernel's fragment (HAG_KERNEL_FRAGMENT's, if set).
	cat "${HAG_KERNEL_FRAGMENT:-$here/kernel-test.config}" "$here/kernel-debug.config" >"$fragment"
	key=$( { grep -E '^CONFIG_|^# CONFIG_' "$fragment"; echo "$recipe $src_version ${make_args[*]}";
		"$RUSTC" --version; "$BINDGEN" --version; clang --version 2>/dev/null | head -1; } |
		sha256sum | cut -c1-16)
	name=kernel-debug
	;;
*) die "unknown flavour '$flavour' (test, gvt or debug)" ;;
esac
if [ "$mode" = --print-make-args ]; then
	echo "${make_args[*]}"
	exit 0
fi
if [ "${make_args[*]}" = LLVM=1 ]; then
	command -v clang >/dev/null && command -v ld.lld >/dev/null ||
		die "the $flavour flavour is built with clang and lld: apt-get install clang lld"
fi
dir=$HAG_CACHE/$name-$key
tree=$dir/linux

if [ "$mode" = --cached-dir ]; then
	[ -e "$dir/.built" ] && echo "$tree"
	exit $?
fi
# One build per tree at a time: a second caller waits for the first and
# then finds the tree built.
mkdir -p "$HAG_CACHE"
exec 9>"$HAG_CACHE/.$name-$key.lock"
flock 9
if [ ! -e "$dir/.built" ]; then
	log "building $name kernel $src_version into $dir (on 2 cores about 6 minutes, gvt about 7 from the test kernel's tree or 15 alone, debug about 20)"
	rm -rf "$dir"
	mkdir -p "$dir"
	if [ -n "${seed:-}" ]; then
		log "starting from a copy of the test kernel's tree $seed"
		cp -a "$seed" "$tree"
	else
		tar -C "$dir" -xf "$tarball"
		mv "$dir/linux-source-6.12" "$tree"
	fi
	for p in "${patches[@]}"; do
		# A dry run first, so that a patch that no longer applies leaves
		# no half-patched file behind and is named.
		out=$(patch -d "$tree" -p1 --dry-run -s -f <"$p" 2>&1) ||
			die "scripts/gvt/$(basename "$p") does not apply to linux-source-6.12 $src_version: $out"
		patch -d "$tree" -p1 -s -f <"$p" >/dev/null
		log "applied $(basename "$p")"
	done
	kmake() { make -C "$tree" -s -j"$(nproc)" RUSTC="$RUSTC" BINDGEN="$BINDGEN" ${make_args[@]+"${make_args[@]}"} "$@"; }
	kmake rustavailable >/dev/null || die "the kernel says Rust is not available: $(kmake rustavailable 2>&1 | tail -3)"
	kmake tinyconfig >/dev/null
	"$tree/scripts/kconfig/merge_config.sh" -m -O "$tree" "$tree/.config" "$fragment" >/dev/null
	kmake olddefconfig >/dev/null
	# Kconfig drops symbols whose dependencies are unmet without a word; say which.
	missing=$(grep -E '^CONFIG_[A-Z0-9_]+=' "$fragment" | while read -r line; do
		grep -qx "$line" "$tree/.config" || echo "$line"; done)
	[ -z "$missing" ] || die "the config fragment did not take effect for: $(echo $missing)"
	{ kmake bzImage modules 2>&1; echo $? >"$dir/.make-status"; } |
		grep -v -e '^  [A-Z]' -e 'Failed to run rustfmt' >&2 || true
	[ "$(cat "$dir/.make-status")" = 0 ] && [ -f "$tree/arch/x86/boot/bzImage" ] ||
		die "the $name kernel build failed (see above)"
	touch "$dir/.built"
	log "built $tree/arch/x86/boot/bzImage"
fi
[ "$mode" = --print-dir ] && echo "$tree"
exit 0
