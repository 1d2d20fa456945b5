# hosts: 2
# Two test hosts reach each other over both test networks: ICMP both ways
# on each, and a TCP connection from host 1 to host 0 carrying data.
me=$(host_ip "$HAG_HOST")
peer=$(host_ip $((1 - HAG_HOST)))
step "host $HAG_HOST ($me) pings $peer"
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable from $me"
ping -c 3 "$peer"
peer2=$(host_ip2 $((1 - HAG_HOST)))
step "host $HAG_HOST pings $peer2 on the second network"
wait_for 60 ping -c 1 -W 1 "$peer2" || fail "$peer2 unreachable on eth1"

if [ "$HAG_HOST" = 0 ]; then
	step "host 0 receives over TCP"
	nc -l -p 7000 >/tmp/received &
	listener=$!
	wait "$listener"
	expect_eq "received" "$(cat /tmp/received)" "hello from 192.0.2.11"
else
	step "host 1 sends over TCP"
	wait_for 60 sh -c "echo 'hello from $me' | nc $peer 7000" || fail "TCP to $peer:7000 failed"
fi
