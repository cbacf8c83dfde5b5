-- The group-affinity oracle: an Envoy Lua filter that sends every prompt of a
-- shared-prefix group to one pod, dealing groups to pods round robin the
-- first time each is seen. It knows what no router can: that the workload is
-- made of groups whose prompts start alike, and that the groups carry equal
-- load. It is the benchmark's ceiling for prefix affinity, not a peer.
--
-- The harness prepends `local PODS = {"ip:port", ...}` (integration/bench/envoy_bench.py).
-- One Envoy worker (--concurrency 1) keeps one table of groups.

-- Bytes of the prompt that name its group: well inside any profile's shared
-- system prompt, and far past where two random ones can agree.
local KEY_BYTES = 200
local HEADER = "x-gateway-destination-endpoint"

local owner = {}
local dealt = 0

local function group_key(handle)
  local body = handle:body()
  if body == nil then
    return nil
  end
  local head = body:getBytes(0, math.min(body:length(), 4096))
  local _, stop = string.find(head, '"prompt"%s*:%s*"')
  if stop == nil then
    _, stop = string.find(head, '"content"%s*:%s*"')
  end
  if stop == nil then
    return nil
  end
  return string.sub(head, stop + 1, stop + KEY_BYTES)
end

function envoy_on_request(handle)
  local key = group_key(handle)
  if key == nil then
    -- No prompt: left to the cluster's fallback LB, as kvroute fails open.
    return
  end
  local pod = owner[key]
  if pod == nil then
    pod = PODS[(dealt % #PODS) + 1]
    dealt = dealt + 1
    owner[key] = pod
  end
  handle:headers():replace(HEADER, pod)
end
