# hosts: 1
# hagctl and the module agree on the ABI version (3: the stats carry
# precise and fallback workload counts), and hagctl refuses
# cleanly (one line, non-zero) when the module is not loaded.
step "hagctl without the module"
if out=$(hagctl status 2>&1); then fail "hagctl status succeeded without the module: $out"; fi
echo "$out"
expect_eq "error lines" "$(echo "$out" | wc -l)" 1
echo "$out" | grep -q "not loaded" || fail "error does not say the module is not loaded: $out"

step "hagctl with the module"
load_hag
hagctl status
json=$(hagctl status --json)
echo "$json"
echo "$json" | grep -q '"abi_version":3' || fail "status --json does not report ABI 3: $json"
echo "$json" | grep -q '"vgpus":\[\]' || fail "fresh module should have no vGPUs: $json"

step "ABI 3's stats fields reach hagctl"
uuid=$(new_uuid)
mdev_create "$uuid"
json=$(hagctl status --json)
echo "$json"
echo "$json" | grep -q '"rejected":0,"precise_workloads":0,"fallback_workloads":0,' ||
	fail "a new vGPU's stats lack precise/fallback counts of 0: $json"
hagctl status | grep -q "^ *submissions 0, rejected 0, precise 0, fallback 0, commands 0," ||
	fail "text status lacks the precise/fallback counts"
mdev_remove "$uuid"

step "hagctl events without the module"
unload_hag
if out=$(hagctl events --timeout 1 2>&1); then fail "hagctl events succeeded without the module"; fi
echo "$out"
echo "$out" | grep -q "not registered\|not loaded" || fail "events error unclear: $out"
