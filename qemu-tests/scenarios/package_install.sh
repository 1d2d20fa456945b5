# hosts: 1
# timeout: 300
# vms: yes
# The hag package (scripts/build-debs.sh; make test's package-check step
# builds it first) installed with dpkg into a test host's root that has no
# hagctl: /usr/bin/hagctl is the production build (its --version says no
# test switches, and a test switch is refused as an unknown argument), its
# man pages, bash completion, docs and libvirt hook kit are where Debian
# looks for them, the packaged hagctl reads the loaded module's vGPUs, the
# kit's install.sh installs the hook into a root, and dpkg -r removes it
# all again.
load_hag
package_in_root
version=$(in_root hagctl --version)
echo "$version"
case "$version" in *test*) fail "the packaged hagctl has the test switches: $version" ;; esac
rc=0
in_root hagctl checkpoint --qmp /tmp/x.qmp --backup h:1 --test-withhold-cpu-dirty >/tmp/sw.out 2>&1 || rc=$?
cat /tmp/sw.out
expect_eq "a test switch's exit status (2: usage)" "$rc" 2
grep -q "unexpected argument '--test-withhold-cpu-dirty'" /tmp/sw.out || fail "the test switch was not refused as unknown"
for f in /usr/share/man/man1/hagctl.1.gz /usr/share/man/man1/hagctl-backup.1.gz \
	/usr/share/bash-completion/completions/hagctl /usr/share/doc/hag/README.md \
	/usr/share/hag/libvirt/qemu /usr/share/hag/libvirt/hag.conf; do
	[ -s "$HOST_ROOT$f" ] || fail "the package did not install $f"
done
zcat "$HOST_ROOT/usr/share/man/man1/hagctl-checkpoint.1.gz" | grep -q 'interval.*DURATION.*default: 2s' ||
	fail "hagctl-checkpoint(1) does not document --interval"
in_root /bin/bash -c '. /usr/share/bash-completion/completions/hagctl && complete -p hagctl' ||
	fail "the bash completion does not load"

step "the packaged hagctl on this host's module"
uuid=$(new_uuid)
mdev_create "$uuid"
in_root hagctl status >/tmp/status.out || fail "hagctl status: $(cat /tmp/status.out)"
cat /tmp/status.out
grep -q "$uuid" /tmp/status.out || fail "hagctl status does not list vGPU $uuid"

step "the hook kit installs the libvirt hook"
in_root /usr/share/hag/libvirt/install.sh --root /tmp/kit || fail "install.sh failed"
grep -q hag-libvirt-hook /tmp/kit/etc/libvirt/hooks/qemu || fail "no hag hook installed by the kit"
[ -f /tmp/kit/etc/hag/hag.conf ] || fail "no hag.conf installed by the kit"

step "dpkg -r hag"
in_root /usr/bin/dpkg -r hag || fail "dpkg -r failed"
! in_root /bin/sh -c 'command -v hagctl' || fail "hagctl is still installed after dpkg -r"
[ ! -e "$HOST_ROOT/usr/share/hag/libvirt/qemu" ] || fail "the hook kit is still there after dpkg -r"
