# hosts: 2
# timeout: 900
# vms: yes
# As qemu_failover_gpu_hang, but host 0 is lost for real (the harness kills
# its QEMU) at a random point of an epoch interval after epoch 4: host 1
# hears nothing past its failover timeout, takes over from the last
# acknowledged epoch, and the guest must verify there; what the client saw
# before the loss must be a prefix of what it sees after, never contradicted.
FAULT=host-loss
GUEST_ARGS="--seconds=60,--mib=8,--cpu-mib=8,--progress=1"
check_backup() {
	takeover_verified "$1" 'the primary was silent for'
}
check_primary() { :; }
. /hag/qemu_protect_once.sh
