# hosts: 1
# Creating and removing a vGPU multicasts events on the hag netlink family,
# and hagctl events prints them (one JSON object per line); a listener
# without CAP_NET_ADMIN is refused.
load_hag
hagctl events --json --count 2 --timeout 60 >/tmp/events 2>/tmp/events.err &
listener=$!
wait_for 30 grep -q listening /tmp/events.err || fail "hagctl events did not subscribe: $(cat /tmp/events.err)"

uuid=$(new_uuid)
step "create and remove $uuid"
mdev_create "$uuid"
mdev_remove "$uuid"
wait "$listener" || fail "hagctl events failed: $(cat /tmp/events.err)"
cat /tmp/events
expect_eq "event lines" "$(wc -l </tmp/events)" 2
sed -n 1p /tmp/events | grep -q "\"event\":\"vgpu-created\".*\"uuid\":\"$uuid\"" || fail "first event is not vgpu-created for $uuid"
sed -n 2p /tmp/events | grep -q "\"event\":\"vgpu-removed\".*\"uuid\":\"$uuid\"" || fail "second event is not vgpu-removed for $uuid"

# The events group is as private as /dev/hag (0600): joining it needs
# CAP_NET_ADMIN, so an unprivileged user's listener is refused.
step "an unprivileged listener is refused"
mkdir -p /etc
# The initramfs root is the harness's private temporary directory (0700):
# let other users reach the shell and hagctl.
chmod 0755 / "$(dirname "$(command -v hagctl)")"
grep -q '^nobody:' /etc/passwd 2>/dev/null || echo 'nobody:x:65534:65534:nobody:/:/bin/sh' >>/etc/passwd
grep -q '^nogroup:' /etc/group 2>/dev/null || echo 'nogroup:x:65534:' >>/etc/group
if su -s /bin/sh nobody -c "$(command -v hagctl) events --json --count 1 --timeout 5" \
	>/tmp/unpriv 2>/tmp/unpriv.err; then
	fail "an unprivileged hagctl events subscribed: $(cat /tmp/unpriv.err)"
fi
cat /tmp/unpriv.err
grep -q listening /tmp/unpriv.err && fail "an unprivileged hagctl events said it was listening"
grep -q 'cannot join' /tmp/unpriv.err && grep -qi 'not permitted' /tmp/unpriv.err ||
	fail "the refusal is not a denied join of the events group: $(cat /tmp/unpriv.err)"
