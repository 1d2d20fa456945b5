#!/bin/sh
# fence_haghost: a fence agent (the fence-agents API Pacemaker's fencer
# uses: key=value lines on stdin, or -o ACTION -n PLUG) for hag's test
# hosts, which really powers one off. The plug is a test host's node name,
# hostN: `off` prints HAG-FENCE-HOST N on this host's console, the harness
# (qemu-tests/harness.py) SIGKILLs that host's QEMU and answers `off hostN`
# on this host's second serial port (/tmp/hag-harness.said); only then is
# the host off. A host cannot be powered on again: `on` fails, `reboot`
# is `off` (fenced is what matters). Test hosts only: scenarios copy it to
# /usr/sbin/fence_haghost in the host's root.
action=reboot plug=
while [ $# -gt 0 ]; do
	case $1 in
	-o | --action) action=$2; shift ;;
	-n | --plug) plug=$2; shift ;;
	--action=*) action=${1#*=} ;;
	--plug=*) plug=${1#*=} ;;
	esac
	shift
done
if [ ! -t 0 ]; then
	while IFS='=' read -r key value; do
		case $key in
		action | option) action=$value ;;
		plug | port | nodename) [ -n "$plug" ] || plug=$value ;;
		esac
	done
fi
said=/tmp/hag-harness.said
log() { echo "$(date -u +%FT%T.%3NZ) fence_haghost[$$] $*" >>/var/log/fence_haghost.log; }

metadata() {
	cat <<'XML'
<?xml version="1.0" ?>
<resource-agent name="fence_haghost" shortdesc="Fence agent for hag's test hosts: the harness kills the host's QEMU">
<longdesc>Powers a hag test host off for real: the qemu-tests harness SIGKILLs its QEMU process and confirms it. Test hosts only.</longdesc>
<parameters>
	<parameter name="action" unique="0" required="1">
		<getopt mixed="-o, --action=[action]"/>
		<content type="string" default="reboot"/>
		<shortdesc lang="en">Fencing action</shortdesc>
	</parameter>
	<parameter name="plug" unique="0" required="1" obsoletes="port">
		<getopt mixed="-n, --plug=[hostN]"/>
		<content type="string"/>
		<shortdesc lang="en">The test host to fence (host0, host1, ...)</shortdesc>
	</parameter>
	<parameter name="port" unique="0" required="0" deprecated="1">
		<getopt mixed="-n, --plug=[hostN]"/>
		<content type="string"/>
		<shortdesc lang="en">The test host to fence</shortdesc>
	</parameter>
</parameters>
<actions>
	<action name="off"/>
	<action name="reboot"/>
	<action name="status"/>
	<action name="list"/>
	<action name="monitor"/>
	<action name="metadata"/>
	<action name="validate-all"/>
</actions>
</resource-agent>
XML
}

is_off() { grep -qx "off $1" "$said" 2>/dev/null; }

case $action in
metadata)
	metadata
	exit 0
	;;
monitor | validate-all)
	exit 0
	;;
list)
	n=0
	hosts=$(sed -n "s/.*hag_hosts=\([0-9]*\).*/\1/p" /proc/cmdline)
	while [ "$n" -lt "${hosts:-2}" ]; do
		echo "host$n"
		n=$((n + 1))
	done
	exit 0
	;;
esac

case $plug in
host[0-9]*) n=${plug#host} ;;
*)
	log "no test host named '$plug' (action $action)"
	exit 1
	;;
esac
case $action in
status)
	is_off "$plug" && exit 2
	exit 0
	;;
off | reboot)
	log "$action $plug: asking the harness"
	echo "HAG-FENCE-HOST $n" >/dev/ttyS0
	i=0
	until is_off "$plug"; do
		i=$((i + 1))
		[ "$i" -lt 600 ] || { log "$plug: the harness did not confirm in 60 s"; exit 1; }
		sleep 0.1
	done
	log "$plug is off (the harness killed its QEMU)"
	exit 0
	;;
*)
	log "action $action is not supported"
	exit 1
	;;
esac
