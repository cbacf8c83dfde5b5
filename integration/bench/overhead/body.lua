-- wrk script for the router-cost benchmark: POST OpenAI chat bodies of a fixed size.
-- Environment: BODY_BYTES (target size of the JSON body, e.g. 4096 or 30720),
--              BODY_VARIANTS (distinct bodies cycled through, default 16),
--              BODY_MODEL (model name, default Qwen/Qwen3-32B),
--              BODY_MAX_TOKENS (output tokens asked for, default 1),
--              BODY_STREAM (1: the answer is streamed as server-sent events; default not).
-- Every variant has its own system prompt (so a prefix-aware router sees several
-- prefixes, as in real traffic).

local size = tonumber(os.getenv("BODY_BYTES") or "4096")
local variants = tonumber(os.getenv("BODY_VARIANTS") or "16")
local model = os.getenv("BODY_MODEL") or "Qwen/Qwen3-32B"
local max_tokens = tonumber(os.getenv("BODY_MAX_TOKENS") or "1")
local stream = os.getenv("BODY_STREAM") == "1"

local words = {"alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
               "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa"}

local function filler(seed, n)
  local parts, len, i = {}, 0, 0
  while len < n do
    local w = words[((seed * 7 + i * 13) % #words) + 1] .. tostring((seed * 31 + i) % 997)
    parts[#parts + 1] = w
    len = len + #w + 1
    i = i + 1
  end
  return string.sub(table.concat(parts, " "), 1, n)
end

local bodies = {}
for v = 1, variants do
  local head = '{"model":"' .. model .. '","max_tokens":' .. max_tokens .. ',"stream":' ..
               tostring(stream) .. ',"messages":[' ..
               '{"role":"system","content":"tenant ' .. v .. ': '
  local tail = '"},{"role":"user","content":"question ' .. v .. '?"}]}'
  local pad = size - #head - #tail
  if pad < 0 then pad = 0 end
  bodies[v] = head .. filler(v, pad) .. tail
end

local n = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"

request = function()
  n = n + 1
  return wrk.format("POST", "/v1/chat/completions", nil, bodies[(n % variants) + 1])
end

-- Non-2xx answers are counted by wrk itself ("Non-2xx or 3xx responses").
