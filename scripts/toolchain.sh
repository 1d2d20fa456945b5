# Sourced by the build scripts: picks the Rust toolchain and bindgen the
# kernel needs and exports RUSTC, BINDGEN and a PATH with /usr/bin first.
#
# The kernel and every out-of-tree Rust module must be built with one rustc
# that has its library source (rust-src); Debian's rustc-web does, rustup's
# toolchain on these machines does not.

HAG_TOOLS=${HAG_TOOLS:-${HAG_CACHE:-/var/cache/hag}/tools}

RUSTC=/usr/bin/rustc
if [ ! -x "$RUSTC" ]; then
	echo "toolchain: /usr/bin/rustc missing: install rustc-web and rust-web-src (scripts/install-deps.sh)" >&2
	exit 1
fi
if [ ! -d "$("$RUSTC" --print sysroot)/lib/rustlib/src/rust/library/core" ]; then
	echo "toolchain: $RUSTC has no rust-src: install rust-web-src" >&2
	exit 1
fi
first_rustc=$(command -v rustc || true)
if [ -n "$first_rustc" ] && [ "$first_rustc" != /usr/bin/rustc ] &&
	[ ! -d "$(rustc --print sysroot)/lib/rustlib/src/rust/library/core" ] &&
	[ -z "${HAG_TOOLCHAIN_QUIET:-}" ]; then
	echo "toolchain: rustc at $(dirname "$first_rustc") has no rust-src; using /usr/bin/rustc" >&2
fi
export HAG_TOOLCHAIN_QUIET=1

BINDGEN=$HAG_TOOLS/bin/bindgen
if [ ! -x "$BINDGEN" ]; then
	if command -v bindgen >/dev/null; then
		echo "toolchain: bindgen $(bindgen --version | awk '{print $2}') at $(command -v bindgen) is older than the kernel's minimum 0.65.1, and $BINDGEN is missing: run scripts/install-deps.sh" >&2
	else
		echo "toolchain: $BINDGEN missing: run scripts/install-deps.sh" >&2
	fi
	exit 1
fi
PATH=/usr/bin:$HAG_TOOLS/bin:$PATH
export RUSTC BINDGEN PATH
