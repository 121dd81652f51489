-- wrk script for the middleware's requests per second: POST /things with a JSON body and
-- a new Idempotency-Key per request (each wrk thread its own prefix).
--   wrk -t1 -c32 -d10s -s python/examples/bench_wrk.lua http://127.0.0.1:8000
local counter = 0
local prefix = tostring(math.random(100000000, 999999999))

request = function()
  counter = counter + 1
  local key = string.format("wrk-%s-%012d", prefix, counter)
  return wrk.format("POST", "/things", {
    ["content-type"] = "application/json",
    ["idempotency-key"] = key,
  }, '{"amount":5000,"currency":"USD"}')
end
