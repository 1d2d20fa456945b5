# hosts: 2
# timeout: 500
# The primary host is lost at a random point between epochs (its QEMU
# process killed by the harness); the backup takes over and the workload
# verifies. See guest/host_loss.sh.
KILL_AFTER_MS=$(($(od -An -N2 -tu2 /dev/urandom) % 2000))
. /hag/host_loss.sh
