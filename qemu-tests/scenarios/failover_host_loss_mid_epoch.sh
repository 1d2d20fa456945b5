# hosts: 2
# timeout: 500
# The primary host is lost about when its next epoch is in flight (1 s
# interval; timing under TCG varies): a half-received epoch must be
# discarded and the takeover made from the last acknowledged one. See
# guest/host_loss.sh.
KILL_AFTER_MS=1020
. /hag/host_loss.sh
