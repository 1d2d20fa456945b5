#!/usr/bin/env bash
# Checks the packages scripts/build-debs.sh made in DIR: that hag holds
# what an operator needs (a hagctl without the test switches, its man
# pages and completion, the systemd units as systemd-analyze verify reads
# them, the hook kit, the docs) and that DKMS itself builds
# hag-mdev-dkms's source against the kernel tree KDIR (its own private
# DKMS tree in a temporary directory: nothing is installed on this
# machine). RUSTC and BINDGEN, if set, are the toolchain KDIR was built
# with (scripts/toolchain.sh sets them). make package-check runs it.
#
# usage: scripts/check-debs.sh DIR KDIR
set -euo pipefail
dir=$1 kdir=$2
fail() {
	echo "check-debs: $*" >&2
	exit 1
}
hag=$(ls "$dir"/hag_*_amd64.deb 2>/dev/null | head -1)
dkms_deb=$(ls "$dir"/hag-mdev-dkms_*_all.deb 2>/dev/null | head -1)
[ -n "$hag" ] && [ -n "$dkms_deb" ] || fail "no packages in $dir (scripts/build-debs.sh makes them)"
work=$(mktemp -d --tmpdir check-debs.XXXXXX)
trap 'rm -rf "$work"' EXIT

contents=$(dpkg-deb -c "$hag" | awk '{print $NF}')
for f in ./usr/bin/hagctl ./usr/share/man/man1/hagctl.1.gz ./usr/share/man/man1/hagctl-checkpoint.1.gz \
	./usr/share/bash-completion/completions/hagctl ./usr/share/hag/libvirt/qemu \
	./usr/share/hag/libvirt/install.sh ./usr/share/hag/libvirt/hag.conf ./usr/share/doc/hag/ha.md \
	./usr/lib/systemd/system/hag-checkpoint@.service ./usr/lib/systemd/system/hag-backup@.service \
	./usr/lib/systemd/system/hag-witness.service ./usr/share/doc/hag/example.conf \
	./usr/lib/ocf/resource.d/hag/vm ./usr/share/doc/hag/pacemaker.md; do
	grep -qx -- "$f" <<<"$contents" || fail "$hag lacks $f"
done
dpkg-deb -x "$hag" "$work/hag"
version=$("$work/hag/usr/bin/hagctl" --version)
case "$version" in
*test*) fail "the packaged hagctl has the test switches: '$version'" ;;
esac
# The units as systemd reads them (an instance of each template, running
# the extracted hagctl); a warning about one of them fails the check.
mkdir -p "$work/units"
for u in "$work"/hag/usr/lib/systemd/system/hag-*@.service; do
	name=${u##*/}
	sed "s|/usr/bin/hagctl|$work/hag/usr/bin/hagctl|" "$u" >"$work/units/${name%@.service}@web1.service"
done
sed "s|/usr/bin/hagctl|$work/hag/usr/bin/hagctl|" "$work/hag/usr/lib/systemd/system/hag-witness.service" \
	>"$work/units/hag-witness.service"
ls "$work"/units/*.service >/dev/null 2>&1 || fail "$hag has no systemd units"
verify=$(systemd-analyze verify --man=no "$work"/units/*.service 2>&1) ||
	fail "systemd-analyze verify: $verify"
if grep -q "hag-[a-z]*@web1.service\|hag-witness.service" <<<"$verify"; then
	fail "systemd-analyze verify warns about hag's units: $verify"
fi
# The resource agent's meta-data against resource-agents' schema for it.
ra=$work/hag/usr/lib/ocf/resource.d/hag/vm
OCF_ROOT=/usr/lib/ocf "$ra" meta-data >"$work/vm.xml" || fail "$ra meta-data failed"
xmllint --noout --relaxng /usr/share/resource-agents/metadata.rng "$work/vm.xml" 2>"$work/vm.err" ||
	fail "ocf:hag:vm's meta-data does not validate: $(cat "$work/vm.err")"
echo "check-debs: $(basename "$hag"): $version, $(wc -l <<<"$contents") paths"

dpkg-deb -x "$dkms_deb" "$work/dkms"
src=$(ls -d "$work"/dkms/usr/src/hag-mdev-* | head -1)
[ -f "$src/dkms.conf" ] || fail "$dkms_deb has no dkms.conf"
pkgver=${src##*/hag-mdev-}
kver=$(make -s -C "$kdir" kernelrelease)
mkdir -p "$work/tree"
# dkms reads ${kernel_source_dir}/.config for BUILD_EXCLUSIVE_CONFIG and
# runs dkms.conf's MAKE with RUSTC and BINDGEN from this environment.
if ! dkms build --dkmstree "$work/tree" --sourcetree "$work/dkms/usr/src" -m hag-mdev -v "$pkgver" \
	-k "$kver" --kernelsourcedir "$kdir" >"$work/dkms.log" 2>&1; then
	cat "$work/dkms.log"
	cat "$work/tree/hag-mdev/$pkgver/build/make.log" 2>/dev/null || true
	fail "dkms build of hag-mdev $pkgver against $kdir failed"
fi
ko=$(find "$work/tree/hag-mdev/$pkgver/$kver" -name 'hag_mdev.ko*' | head -1)
[ -n "$ko" ] || fail "dkms built no hag_mdev.ko (log: $(tail -5 "$work/dkms.log"))"
params=$(/sbin/modinfo -F parm "$ko" | cut -d: -f1 | tr '\n' ' ')
for p in withhold_gpu_dirty corrupt_mig_data test_hold_vgpu_ms; do
	case " $params" in *" $p "*) fail "the DKMS-built module has the test parameter $p" ;; esac
done
echo "check-debs: $(basename "$dkms_deb"): dkms built ${ko##*/} for $kver (parameters: $params)"
