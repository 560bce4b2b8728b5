"""Gateway CPU per durable turn for sessions preloaded with N messages (BENCHMARKS.md, "Turn cost
and session length"): each worker creates its session with one request carrying N-1 messages,
then continues it with one new user message per turn (X-Session-Token) on a keep-alive connection.
With RATE set (turns per second, all workers together), each worker paces its turns so that
sessions of every length are measured at the same turn rate (the store's group commit then
batches alike). Usage: python3 long_sessions.py GATEWAY_PID HOST:PORT N [workers] [seconds]
(scripts/bench-long-sessions.sh runs it)"""
import http.client, json, os, sys, threading, time
pid, addr, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
workers = int(sys.argv[4]) if len(sys.argv) > 4 else 16
secs = float(sys.argv[5]) if len(sys.argv) > 5 else 10
rate = float(os.environ.get("RATE", "0"))
host, port = addr.split(":")
def cpu():
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
def post(c, body, token=None):
    h = {"content-type": "application/json"}
    if token: h["x-session-token"] = token
    c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=h)
    r = c.getresponse(); data = r.read()
    assert r.status == 200, (r.status, data[:300])
    return r
counts = [0] * workers
stop = time.time() + 10**9
start_evt = threading.Barrier(workers + 1)
def work(i):
    global stop
    c = http.client.HTTPConnection(host, int(port))
    msgs = []
    for k in range(max(n - 2, 0)):
        role = "user" if k % 2 == 0 else "assistant"
        msgs.append({"role": role, "content": f"preloaded message {k} of worker {i}, a sentence of ordinary length."})
    msgs.append({"role": "user", "content": f"worker {i} starts"})
    r = post(c, {"model": "bench-model", "messages": msgs})
    token = r.getheader("x-session-token")
    start_evt.wait()
    k = 0
    t0 = time.time()
    while time.time() < stop:
        if rate > 0:
            # Worker i's turn k is due at t0 + (k + i / workers) * workers / rate.
            due = t0 + (k + i / workers) * workers / rate
            if due > time.time():
                time.sleep(due - time.time())
        post(c, {"model": "bench-model", "messages": [{"role": "user", "content": f"worker {i} turn {k}"}]}, token)
        k += 1
        counts[i] += 1
ts = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(workers)]
for t in ts: t.start()
start_evt.wait()
c0, t0, n0 = cpu(), time.time(), sum(counts)
time.sleep(secs)
c1, t1, n1 = cpu(), time.time(), sum(counts)
stop = 0
turns = n1 - n0
print(json.dumps({"preloaded": n, "turns": turns, "turns_per_s": round(turns / (t1 - t0), 1),
                  "gateway_cpu_us_per_turn": round((c1 - c0) / turns * 1e6, 1)}))
