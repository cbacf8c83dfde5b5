-- wrk script for `make bench-scale`'s CPU readings: POSTs the chat bodies of a file in turn.
-- Environment: BODY_FILE (the bodies, one JSON document per line).

local requests = {}
local sent = 0

function init(args)
  -- Formatted here, not at load: wrk sets the Host header just before it calls init.
  for line in io.lines(os.getenv("BODY_FILE")) do
    requests[#requests + 1] = wrk.format("POST", "/v1/chat/completions",
                                         {["Content-Type"] = "application/json"}, line)
  end
end

function request()
  sent = sent + 1
  return requests[(sent - 1) % #requests + 1]
end
