//! The federation tests' network: each node a real `sbp serve` process with its own data dir,
//! an identity key the test wrote itself (so it can sign as any node), and a stable loopback
//! address in front of it ([`Relay`]) so that peers can pin each other before either starts and a
//! node keeps its URL across a restart.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Utc};
use sbp_protocol::federation::{FedClaims, IdentityKey, ProviderRecord, PublicKey, sign_fed_token};
use serde_json::{Map, Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use sbp_protocol::bundle::compute_cid;

use crate::support::{Sbp, WAIT, eventually, msg, reply_text, sbp_serve_in, send};

/// A loopback port the test owns, forwarding each connection to whichever port the node behind
/// it listens on now. Nodes are started with `--public-url` set to it, so their manifests, pins
/// and tracker records all name an address that outlives the process.
pub struct Relay {
    pub url: String,
    target: Arc<AtomicU16>,
    task: JoinHandle<()>,
}

impl Relay {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a relay port");
        let addr = listener.local_addr().expect("the relay's address");
        let target = Arc::new(AtomicU16::new(0));
        let to = target.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let port = to.load(Ordering::SeqCst);
                tokio::spawn(async move {
                    // Nothing behind (the node is down): the connection is closed at once, as a
                    // stopped host's would be refused.
                    if port == 0 {
                        return;
                    }
                    if let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", port)).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Self {
            url: format!("http://{addr}"),
            target,
            task,
        }
    }

    fn point_at(&self, port: u16) {
        self.target.store(port, Ordering::SeqCst);
    }

    /// The relay's port.
    pub fn port(&self) -> u16 {
        port_of(&self.url)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The port of `http://127.0.0.1:PORT`.
pub fn port_of(url: &str) -> u16 {
    url.rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .unwrap_or_else(|| panic!("no port in {url}"))
}

/// One federation node: its key, data dir, stable URL, and the process when running.
pub struct Node {
    pub name: String,
    /// The current identity key (the file `key_file` holds).
    pub key: IdentityKey,
    pub key_file: PathBuf,
    pub data_dir: PathBuf,
    /// The node's URL as peers see it (the relay's).
    pub url: String,
    /// Derived from the first key; the node's manifest must say the same.
    pub gateway_id: String,
    relay: Relay,
    args: Vec<String>,
    /// Environment variables the process gets (on top of a clean `SBP_*`-free environment).
    env: Vec<(String, String)>,
    gw: Option<Sbp>,
    _dir: tempfile::TempDir,
}

impl Node {
    /// A node named `name` whose key is made from `seed` (written as PKCS#8 PEM, mode 0600).
    pub async fn new(name: &str, seed: u8) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let data_dir = dir.path().join("data");
        let key_file = dir.path().join("identity.pem");
        let key = IdentityKey::from_seed([seed; 32]);
        std::fs::write(&key_file, key.to_pkcs8_pem().as_bytes()).expect("write the key");
        std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600))
            .expect("chmod the key");
        let relay = Relay::start().await;
        Self {
            name: name.to_owned(),
            gateway_id: key.public_key().derive_gateway_id(),
            key,
            key_file,
            data_dir,
            url: relay.url.clone(),
            relay,
            args: Vec::new(),
            env: Vec::new(),
            gw: None,
            _dir: dir,
        }
    }

    /// The port of the node's stable URL.
    pub fn relay_port(&self) -> u16 {
        self.relay.port()
    }

    /// `URL#KEY`: how another node pins this one (`--peer`, `--tracker`).
    pub fn pin(&self) -> String {
        format!("{}#{}", self.url, self.key.public_key().to_b64_spki())
    }

    pub fn public_key(&self) -> PublicKey {
        self.key.public_key()
    }

    /// Starts `sbp serve` with this node's key, URL and name, and `extra` (which must turn
    /// federation on); checks that its manifest names the expected gateway id.
    pub async fn start(&mut self, extra: &[&str]) {
        let mut args: Vec<String> = [
            "--federation-key",
            &self.key_file.display().to_string(),
            "--public-url",
            &self.url,
            "--gateway-name",
            &self.name,
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        self.args = args;
        self.spawn().await;
    }

    /// Sets (`Some`) or removes (`None`) an environment variable for the next start.
    pub fn set_env(&mut self, key: &str, value: Option<&str>) {
        self.env.retain(|(k, _)| k != key);
        if let Some(v) = value {
            self.env.push((key.to_owned(), v.to_owned()));
        }
    }

    /// Starts the process again with the same options and data dir.
    pub async fn restart(&mut self) {
        assert!(self.gw.is_none(), "{} is still running", self.name);
        self.spawn().await;
    }

    async fn spawn(&mut self) {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let mut cmd = sbp_serve_in(&self.data_dir, &args);
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        let mut gw = Sbp::spawn(cmd).await;
        self.relay.point_at(port_of(&gw.url));
        gw.url = self.url.clone();
        self.gw = Some(gw);
        let manifest = self.manifest().await;
        assert_eq!(
            manifest["gateway_id"], self.gateway_id,
            "{}: {manifest:?}",
            self.name
        );
    }

    /// `kill -9` the process; the relay then refuses connections until a restart.
    pub fn kill9(&mut self) {
        let mut gw = self.gw.take().expect("a running node");
        self.relay.point_at(0);
        gw.proc.kill9();
    }

    /// The running process, with `url` the node's (relay) URL.
    pub fn gw(&self) -> &Sbp {
        self.gw.as_ref().expect("a running node")
    }

    /// Reads the key file again (after `sbp federation rotate-key`).
    pub fn reload_key(&mut self) {
        let pem = std::fs::read_to_string(&self.key_file).expect("read the key file");
        self.key = IdentityKey::from_pkcs8_pem(&pem).expect("a PKCS#8 Ed25519 key");
    }

    /// `GET /.well-known/sbp`, expecting 200 and an object.
    pub async fn manifest(&self) -> Map<String, Value> {
        let (status, headers, body) = send(self.gw().get("/.well-known/sbp")).await;
        assert_eq!(status, 200, "{}: {body}", self.name);
        assert!(
            headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("application/json")),
            "{headers:?}"
        );
        object(body)
    }

    /// Waits until `tracker` vouches for this node (it registered there at start): before that,
    /// peers pinning only the tracker cannot trust it.
    pub async fn wait_vouched_by(&self, tracker: &Node) -> Map<String, Value> {
        let url = format!(
            "{}/v1/sbp/registry/gateways/{}",
            tracker.url, self.gateway_id
        );
        let http = &tracker.gw().http;
        eventually(
            WAIT,
            &format!("{} registered at the tracker", self.name),
            || {
                let req = http.get(&url);
                async move {
                    let (status, _, body) = send(req).await;
                    (status == 200).then(|| object(body))
                }
            },
        )
        .await
    }

    /// A valid federation token from this node to `aud` for `htm path` about `sub`.
    pub fn token(&self, aud: &str, sub: &str, htm: &str, path: &str) -> String {
        sign_fed_token(&claims(&self.gateway_id, aud, sub, htm, path), &self.key)
    }

    /// This node's provider record for `cid` at its own bundle endpoint, signed by it.
    pub fn record(&self, cid: &str, seq: u64, lifetime: chrono::Duration) -> Map<String, Value> {
        let now = Utc::now();
        ProviderRecord {
            gateway_id: self.gateway_id.clone(),
            bundle_cid: cid.to_owned(),
            bundle_url: self.bundle_url(cid),
            seq,
            issued_at: now,
            expires_at: now + lifetime,
        }
        .to_signed_map(&self.key)
    }

    /// Where this node serves bundle `cid`.
    pub fn bundle_url(&self, cid: &str) -> String {
        format!("{}/v1/sbp/bundles/{cid}", self.url)
    }

    /// `/metrics` as text.
    pub async fn metrics(&self) -> String {
        self.gw().metrics().await
    }
}

/// Claims valid now for two minutes, with a fresh `jti`.
pub fn claims(iss: &str, aud: &str, sub: &str, htm: &str, htu: &str) -> FedClaims {
    let iat = Utc::now().timestamp();
    FedClaims {
        iss: iss.to_owned(),
        aud: aud.to_owned(),
        sub: sub.to_owned(),
        htm: htm.to_owned(),
        htu: htu.to_owned(),
        iat,
        exp: iat + 120,
        jti: uuid::Uuid::new_v4().simple().to_string(),
    }
}

/// The claims as the JSON object a token carries.
pub fn claims_object(c: &FedClaims) -> Map<String, Value> {
    object(json!({
        "iss": c.iss, "aud": c.aud, "sub": c.sub, "htm": c.htm, "htu": c.htu,
        "iat": c.iat, "exp": c.exp, "jti": c.jti,
    }))
}

/// A compact JWS of any header and payload, signed by `sign` over `header.payload`: for tokens
/// the gateway must refuse.
pub fn compact(header: &Value, payload: &Value, sign: impl FnOnce(&[u8]) -> Vec<u8>) -> String {
    let mut token = URL_SAFE_NO_PAD.encode(header.to_string());
    token.push('.');
    token.push_str(&URL_SAFE_NO_PAD.encode(payload.to_string()));
    let signature = sign(token.as_bytes());
    token.push('.');
    token.push_str(&URL_SAFE_NO_PAD.encode(signature));
    token
}

/// The header of a federation token signed by the key `kid`.
pub fn fed_header(kid: &str) -> Value {
    json!({"alg": "EdDSA", "typ": "sbp-fed+jwt", "kid": kid})
}

pub fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        other => panic!("not a JSON object: {other}"),
    }
}

/// A session with two turns mentioning `words`; returns (id, token).
pub async fn conversation(gw: &Sbp, words: &str) -> (String, String) {
    let first = format!("first turn: {words}");
    let (status, token, body) = gw.chat(None, json!([msg("user", &first)])).await;
    assert_eq!(status, 200, "{body}");
    let token = token.expect("a new session's token");
    let id = body["sbp"]["session_id"]
        .as_str()
        .expect("sbp.session_id")
        .to_owned();
    let reply = reply_text(&body);
    let (status, _, body) = gw
        .chat(
            Some(&token),
            json!([
                msg("user", &first),
                msg("assistant", &reply),
                msg("user", &format!("second turn: {words}"))
            ]),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    (id, token)
}

/// `POST /v1/sbp/sessions/{id}/export` with `body`, expecting 201.
pub async fn export(gw: &Sbp, id: &str, token: &str, body: Value) -> Value {
    let (status, _, v) = send(
        gw.post(&format!("/v1/sbp/sessions/{id}/export"), &body)
            .header("x-session-token", token),
    )
    .await;
    assert_eq!(status, 201, "export: {v}");
    assert!(
        v["bundle_cid"]
            .as_str()
            .is_some_and(sbp_protocol::bundle::is_cid),
        "{v}"
    );
    v
}

/// `POST /v1/sbp/sessions/import` with `body`: (status, body).
pub async fn import(gw: &Sbp, body: Value) -> (u16, Value) {
    let (status, _, v) = send(gw.post("/v1/sbp/sessions/import", &body)).await;
    (status, v)
}

/// An import's new session: (id, token).
pub fn imported(v: &Value) -> (String, String) {
    (
        v["session_id"].as_str().expect("session_id").to_owned(),
        v["session_token"]
            .as_str()
            .expect("session_token")
            .to_owned(),
    )
}

/// The value of one series in Prometheus text (`name{label="value"}`), 0 when absent.
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0.0)
}

/// Whether any series of the family `name` is in the text.
pub fn has_family(text: &str, name: &str) -> bool {
    text.lines()
        .any(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
}

/// Reads an RFC 3339 time field.
pub fn time(v: &Value) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(v.as_str().unwrap_or_else(|| panic!("not a time: {v}")))
        .unwrap_or_else(|e| panic!("not an RFC 3339 time: {v}: {e}"))
        .with_timezone(&Utc)
}

/// A CID no node holds.
pub fn random_cid() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// Every file under `dir`, read whole (the SQLite database and its WAL).
pub fn files_under(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("read_dir") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if let Ok(bytes) = std::fs::read(&path) {
                out.push((path, bytes));
            }
        }
    }
    out
}

/// Whether `needle` occurs in `haystack`.
pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Registry records and answers the test signs live this long unless a case says otherwise.
pub fn hour() -> chrono::Duration {
    chrono::Duration::hours(1)
}

/// (status, `error.code`) of an answer.
pub fn status_code(status: u16, body: &Value) -> (u16, String) {
    (
        status,
        body["error"]["code"].as_str().unwrap_or("").to_owned(),
    )
}

/// An imported session's history: the original's, then the gateway's one note that says where
/// it came from.
pub fn same_history(imported: &[(String, String)], original: &[(String, String)]) {
    assert_eq!(
        imported.len(),
        original.len() + 1,
        "{imported:?}\nvs\n{original:?}"
    );
    assert_eq!(&imported[..original.len()], original);
    let (role, note) = &imported[original.len()];
    assert_eq!(role, "system", "{note}");
    assert!(note.contains("imported from"), "{note}");
}

/// Changes `from` to `to` inside the stored body of bundle `cid` (the gateway stopped), with
/// Python's sqlite3 module as the machine has it.
pub fn corrupt_bundle(db: &Path, cid: &str, from: &str, to: &str) {
    const SCRIPT: &str = "
import sqlite3, sys
db, cid, old, new = sys.argv[1:]
c = sqlite3.connect(db)
(body,) = c.execute('SELECT body FROM bundles WHERE cid = ?', (cid,)).fetchone()
if isinstance(body, str):
    changed = body.replace(old, new, 1)
else:
    changed = body.replace(old.encode(), new.encode(), 1)
assert changed != body, 'the text is in the stored bundle'
c.execute('UPDATE bundles SET body = ? WHERE cid = ?', (changed, cid))
c.commit()
";
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(SCRIPT)
        .arg(db)
        .args([cid, from, to])
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `GET path` on `gw` with the bearer `token`, if any.
pub fn bearer_get(gw: &Sbp, token: Option<&str>, path: &str) -> reqwest::RequestBuilder {
    let req = gw.get(path);
    match token {
        Some(t) => req.bearer_auth(t),
        None => req,
    }
}

/// A bundle export of a new session on `gw`: (cid, bundle bytes, session id, token).
pub async fn bundle_of(gw: &Sbp, words: &str) -> (String, Map<String, Value>, String, String) {
    let (id, token) = conversation(gw, words).await;
    let exported = export(gw, &id, &token, json!({"include_bundle": true})).await;
    let cid = exported["bundle_cid"].as_str().expect("cid").to_owned();
    let bundle = object(exported["bundle"].clone());
    assert_eq!(compute_cid(&bundle), cid);
    (cid, bundle, id, token)
}

/// The `sid` claim of a roaming token (read, not verified).
pub fn roaming_sid(token: &str) -> String {
    let payload = token.split('.').nth(1).expect("a JWT");
    let claims: Value = serde_json::from_slice(
        &URL_SAFE_NO_PAD
            .decode(payload.trim_end_matches('='))
            .expect("base64url"),
    )
    .expect("JSON claims");
    claims["sid"].as_str().expect("sid").to_owned()
}

/// The sessions the `sbp_sessions` gauge counts, all statuses.
pub fn sessions(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("sbp_sessions{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
