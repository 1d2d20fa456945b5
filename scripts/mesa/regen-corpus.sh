#!/bin/bash
# Regenerates rust/hag_gvt/tests/mesa/: batches of Mesa's own Intel drivers
# (iris for GLES, anv for Vulkan; Mesa 22.3.6 from Debian 12's source
# package, which ships no drm-shim) run on Mesa's noop Intel shim
# (intel_stub_gpu, platform skl) with drm-shim-capture.patch, which writes
# every execbuffer2 with its objects. extract.py keeps the batches GVT-g
# would shadow and the objects' addresses.
#
# Mesa is built once into $HAG_CACHE/mesa (default /var/cache/hag/mesa;
# about 15 minutes on 2 cores, at nice 19). Needs deb-src lines for
# bookworm in the apt sources (apt-get source), and installs the build
# dependencies it uses.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
HAG_CACHE=${HAG_CACHE:-/var/cache/hag}
mesa=$HAG_CACHE/mesa
version=22.3.6
out=$repo/rust/hag_gvt/tests/mesa
# Debian's python3 has mako; a pyenv or venv one first in PATH may not.
export PATH=/usr/bin:/bin:$PATH

log() { echo "regen-corpus: $*" >&2; }

if [ ! -e "$mesa/install/.built" ]; then
	apt-get install -y -qq meson ninja-build python3-mako python3-ply \
		libdrm-dev glslang-tools libzstd-dev libexpat1-dev zlib1g-dev \
		bison flex dpkg-dev >/dev/null
	mkdir -p "$mesa"
	if [ ! -d "$mesa/mesa-$version" ]; then
		(cd "$mesa" && apt-get source -qq "mesa=$version-*") ||
			{ log "apt-get source mesa failed: add deb-src lines for bookworm (Types: deb-src in /etc/apt/sources.list.d/) and apt-get update"; exit 1; }
		patch -d "$mesa/mesa-$version" -p1 <"$here/drm-shim-capture.patch"
	fi
	rm -rf "$mesa/build"
	(cd "$mesa/mesa-$version" && nice -n 19 meson setup "$mesa/build" \
		-Dprefix="$mesa/install" -Dbuildtype=release \
		-Dtools=drm-shim,intel -Dgallium-drivers=iris -Dvulkan-drivers=intel \
		-Dllvm=disabled -Dplatforms= -Dglx=disabled -Degl=enabled -Dgbm=disabled \
		-Dgles1=disabled -Dgles2=enabled -Dglvnd=false -Dshared-glapi=enabled \
		-Dvalgrind=disabled -Dlibunwind=disabled -Dlmsensors=disabled \
		-Dgallium-va=disabled -Dgallium-vdpau=disabled -Dgallium-xa=disabled \
		-Dgallium-nine=false -Dgallium-opencl=disabled -Dgallium-omx=disabled \
		-Dvideo-codecs= -Dbuild-tests=false -Dintel-clc=disabled -Ddri3=disabled \
		-Dxlib-lease=disabled -Dzstd=enabled >/dev/null)
	log "building Mesa $version into $mesa (about 15 minutes on 2 cores)"
	nice -n 19 ninja -C "$mesa/build" -j"$(nproc)" install >/dev/null
	touch "$mesa/install/.built"
fi

lib=$mesa/install/lib/x86_64-linux-gnu
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
glslangValidator -V --vn COMPUTE_SPV -o "$work/vk_work_spv.h" "$here/vk_work.comp" >/dev/null
gcc -O1 -o "$work/gles_work" "$here/gles_work.c" -I"$mesa/install/include" \
	-L"$lib" -lEGL -lGLESv2 -Wl,-rpath,"$lib"
gcc -O1 -o "$work/vk_work" "$here/vk_work.c" -I"$work" -I"$mesa/mesa-$version/include" -ldl

mkdir -p "$work/iris" "$work/anv"
HAG_CAPTURE_DIR=$work/iris LD_PRELOAD=$lib/libintel_noop_drm_shim.so \
	LIBGL_DRIVERS_PATH=$lib/dri "$work/gles_work" >/dev/null
HAG_CAPTURE_DIR=$work/anv LD_PRELOAD=$lib/libintel_noop_drm_shim.so \
	ANV_ICD=$lib/libvulkan_intel.so "$work/vk_work" >/dev/null

mkdir -p "$out"
rm -f "$out"/*.bin
for driver in iris anv; do
	for f in "$work/$driver"/*.bin; do
		python3 "$here/extract.py" "$out/$driver-$(basename "$f")" "$f"
	done
done
log "wrote $(ls "$out" | wc -l) workloads, $(du -sh "$out" | cut -f1), into $out"
