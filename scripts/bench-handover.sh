#!/usr/bin/env bash
# Times sessions moving between two local gateways: a session of N messages and T tethered turns
# on A, its surface attaching on B (ATTACH_SESSION → SESSION_ATTACHED), then back on A.
set -e
# The WebSocket client the timing uses.
python3 -c "import websockets" 2>/dev/null || pip install --quiet websockets
SBP=${SBP:-$(cd "$(dirname "$0")/.." && pwd)/target/release/sbp}
N=${N:-200}; T=${T:-5}; ROUNDS=${ROUNDS:-10}
D=$(mktemp -d); cd $D
KA=$($SBP federation init --data-dir a 2>/dev/null); KB=$($SBP federation init --data-dir b 2>/dev/null)
$SBP serve --listen 127.0.0.1:7101 --data-dir a --peer "http://127.0.0.1:7102#$KB" --rate-limit-ip 0 --rate-limit-session 0 > a.log 2>&1 &
$SBP serve --listen 127.0.0.1:7102 --data-dir b --peer "http://127.0.0.1:7101#$KA" --rate-limit-ip 0 --rate-limit-session 0 > b.log 2>&1 &
trap 'kill $(jobs -p) 2>/dev/null; rm -rf '$D EXIT
until curl -sf 127.0.0.1:7102/healthz >/dev/null && curl -sf 127.0.0.1:7101/healthz >/dev/null; do sleep 0.1; done
python3 - "$N" "$T" "$ROUNDS" <<'PY'
import asyncio, json, sys, time, urllib.request, websockets
n, t, rounds = map(int, sys.argv[1:])
def post(url, body, tok=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type":"application/json", **({"x-session-token": tok} if tok else {})})
    with urllib.request.urlopen(req) as r:
        return r.status, dict(r.headers), json.loads(r.read() or b"{}")
times = []
for r in range(rounds):
    _, h, _ = post("http://127.0.0.1:7101/v1/chat/completions", {"messages":[{"role":"user","content":"m0"}],"sbp":{}})
    sid, tok = h["x-session-id"], h["x-session-token"]
    msgs = [{"role":"user","content":"m0"}]
    for i in range(1, n // 2):
        post("http://127.0.0.1:7101/v1/chat/completions", {"messages":[{"role":"user","content":f"message {i} " + "x"*200}]}, tok)
    for i in range(t):
        post(f"http://127.0.0.1:7101/v1/sbp/sessions/{sid}/turns", {"role":"assistant","content":f"tethered {i}"}, tok)
    async def attach(port):
        async with websockets.connect(f"ws://127.0.0.1:{port}/v1/sbp/ws/{sid}", max_size=None) as ws:
            t0 = time.perf_counter()
            await ws.send(json.dumps({"type":"ATTACH_SESSION","session_id":sid,"session_token":tok,"surface_context":{"surface_id":"p","device_type":"phone"}}))
            f = json.loads(await ws.recv())
            dt = time.perf_counter() - t0
            assert f["type"] == "SESSION_ATTACHED", f
            return dt, f["queued_turns"]
    there, q = asyncio.run(attach(7102))
    back, _ = asyncio.run(attach(7101))
    times.append((there, back, q))
ths = sorted(x[0] for x in times); bks = sorted(x[1] for x in times)
print(f"{rounds} sessions of {n} messages + {t} tethered turns (queued on arrival: {times[0][2]})")
print(f"A->B attach with handover: median {ths[len(ths)//2]*1000:.1f} ms, max {ths[-1]*1000:.1f} ms")
print(f"B->A attach with handover: median {bks[len(bks)//2]*1000:.1f} ms, max {bks[-1]*1000:.1f} ms")
PY
