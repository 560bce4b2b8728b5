// A TCP proxy for the browser scenarios: the page is loaded through it, so cutting it cuts the
// page's HTTP and WebSocket connections to the gateway, as a network drop would.

import net from 'node:net';

/** A TCP proxy on 127.0.0.1 to the gateway that can drop every connection and refuse new ones. */
export async function startProxy(target) {
  const { hostname, port } = new URL(target);
  const pairs = new Set();
  let blocked = false;
  const server = net.createServer((client) => {
    if (blocked) {
      client.destroy();
      return;
    }
    const upstream = net.connect(Number(port), hostname);
    const pair = { client, upstream };
    pairs.add(pair);
    const end = () => {
      client.destroy();
      upstream.destroy();
      pairs.delete(pair);
    };
    for (const s of [client, upstream]) {
      s.setNoDelay(true);
      s.on('error', end);
      s.on('close', end);
    }
    client.pipe(upstream);
    upstream.pipe(client);
  });
  await new Promise((resolve) => { server.listen(0, '127.0.0.1', resolve); });
  return {
    url: `http://127.0.0.1:${server.address().port}`,
    cut() {
      blocked = true;
      for (const { client, upstream } of pairs) {
        client.destroy();
        upstream.destroy();
      }
      pairs.clear();
    },
    open() {
      blocked = false;
    },
    close() {
      this.cut();
      server.close();
    },
  };
}
