//! Federation (L6) from the command line: the `sbp serve` options that turn it on, the node's
//! Ed25519 identity key file (generated at first start, PKCS#8 PEM, 0600) with the keys it rotated
//! away from, and `sbp federation rotate-key|public-key`.
//!
//! Key files: the current key is `<data-dir>/federation.key` (or `--federation-key FILE`); a
//! rotation moves it to `FILE.<key_id>.old` and records it, with the time it stops verifying, in
//! `FILE.rotation.json`, which `sbp serve` reads to list it in the manifest's `old_keys`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use sbp_gateway::config::{FederationConfig, OldIdentityKey, PeerSpec};
use sbp_gateway::ratelimit::parse_limit;
use sbp_protocol::federation::{IdentityKey, Role};
use serde::{Deserialize, Serialize};

/// The file name of the identity key in the data directory.
const KEY_FILE: &str = "federation.key";
/// How long a rotated-away key keeps verifying, unless `--old-key-ttl` says otherwise.
const DEFAULT_OLD_KEY_TTL: Duration = Duration::from_secs(7 * 86_400);
/// The longest an announced record may live at a tracker (the 24 h).
const MAX_ANNOUNCE_TTL: Duration = Duration::from_secs(86_400);

/// `sbp serve` options of federation (flattened into `ServeArgs`).
#[derive(Debug, Args, Default)]
pub struct FederationArgs {
    /// Federation role: `gateway` (hosts sessions, serves bundles by CID), `tracker` (only
    /// indexes which gateway holds which bundle; serves no session), or `both`. Giving it, or any
    /// of --peer, --tracker, --peer-srv, turns federation (L6) on. [default: gateway when on]
    #[arg(long, env = "SBP_ROLE")]
    pub role: Option<String>,
    /// A peer gateway: `URL[#KEY]`, KEY being its manifest's `public_key` (pins it; without a pin
    /// it is trusted only through a pinned tracker or --federation-tofu). Repeatable;
    /// comma-separated in the environment.
    #[arg(long = "peer", env = "SBP_PEERS", value_delimiter = ',')]
    pub peers: Vec<String>,
    /// A tracker: `URL[#KEY]` as for --peer. Repeatable; comma-separated in the environment.
    #[arg(long = "tracker", env = "SBP_TRACKERS", value_delimiter = ',')]
    pub trackers: Vec<String>,
    /// Find peers in DNS: the SRV records `_sbp._tcp.DOMAIN`. Repeatable.
    #[arg(long = "peer-srv", env = "SBP_PEER_SRV", value_delimiter = ',')]
    pub peer_srv: Vec<String>,
    /// The DNS server (HOST:PORT) SRV lookups ask. [default: the system's]
    #[arg(long, env = "SBP_DNS_SERVER")]
    pub dns_server: Option<String>,
    /// The node's Ed25519 identity key (PKCS#8 PEM; `openssl genpkey -algorithm ed25519`).
    /// Replicas of one deployment share it. [default: generated at first start and kept in
    /// <data-dir>/federation.key]
    #[arg(long, env = "SBP_FEDERATION_KEY", value_name = "FILE")]
    pub federation_key: Option<PathBuf>,
    /// Trust a peer's key the first time its manifest is seen (a later change needs a valid
    /// `old_signature`). Off: only pinned peers and peers a pinned tracker vouches for.
    #[arg(long, env = "SBP_FEDERATION_TOFU")]
    pub federation_tofu: bool,
    /// Talk plain http to peers that are not on loopback (private networks, tests).
    #[arg(long, env = "SBP_FEDERATION_ALLOW_HTTP")]
    pub federation_allow_http: bool,
    /// Announce every export's bundle to the trackers (otherwise only exports that ask with
    /// `"announce": true`).
    #[arg(long, env = "SBP_ANNOUNCE_EXPORTS")]
    pub announce_exports: bool,
    /// `gateway_name` in the manifest. [default: the host name]
    #[arg(long, env = "SBP_GATEWAY_NAME")]
    pub gateway_name: Option<String>,
    /// Lifetime of a record announced to a tracker, at most 24h (an export announced again, or
    /// exported again, is announced anew). [default: 24h]
    #[arg(long, env = "SBP_ANNOUNCE_TTL")]
    pub announce_ttl: Option<String>,
    /// (tracker) Records one gateway may hold. [default: 10000]
    #[arg(long, env = "SBP_TRACKER_MAX_RECORDS")]
    pub tracker_max_records: Option<u64>,
    /// (tracker) Announces one gateway may make, as COUNT/s|m|h[,BURST]; 0 turns it off.
    /// [default: 10/s,10]
    #[arg(long, env = "SBP_TRACKER_ANNOUNCE_RATE")]
    pub tracker_announce_rate: Option<String>,
    /// Seconds a handover lease holds a session for the gateway taking it. [default: 30]
    #[arg(long, env = "SBP_HANDOVER_LEASE", hide = true)]
    pub handover_lease: Option<f64>,
}

/// The same options from the TOML file (`peers = [...]`, `trackers = [...]`, ...).
#[derive(Debug, Default, Deserialize)]
pub struct FederationFile {
    pub role: Option<String>,
    pub peers: Option<Vec<String>>,
    pub trackers: Option<Vec<String>>,
    pub peer_srv: Option<Vec<String>>,
    pub dns_server: Option<String>,
    pub federation_key: Option<PathBuf>,
    pub federation_tofu: Option<bool>,
    pub federation_allow_http: Option<bool>,
    pub announce_exports: Option<bool>,
    pub gateway_name: Option<String>,
    pub announce_ttl: Option<String>,
    pub tracker_max_records: Option<u64>,
    pub tracker_announce_rate: Option<String>,
    pub handover_lease: Option<f64>,
}

/// Federation as resolved from flags, variables and file; the key is read by [`load`] at start.
#[derive(Debug, Clone)]
pub struct FederationSettings {
    pub role: Role,
    pub key_file: Option<PathBuf>,
    pub gateway_name: Option<String>,
    pub peers: Vec<PeerSpec>,
    pub trackers: Vec<PeerSpec>,
    pub peer_srv: Vec<String>,
    pub dns_server: Option<std::net::SocketAddr>,
    pub tofu: bool,
    pub allow_http: bool,
    pub announce_exports: bool,
    pub announce_ttl: Duration,
    pub tracker_max_records: u64,
    pub tracker_announce_rate: Option<sbp_gateway::Rate>,
    pub handover_lease: Duration,
}

fn list(flag: Vec<String>, file: Option<Vec<String>>) -> Vec<String> {
    let mut v: Vec<String> = flag
        .into_iter()
        .chain(file.unwrap_or_default())
        .map(|s| s.trim().to_owned())
        .collect();
    v.retain(|s| !s.is_empty());
    v
}

fn specs(flag: &str, items: Vec<String>) -> anyhow::Result<Vec<PeerSpec>> {
    items
        .iter()
        .map(|p| p.parse().map_err(|e| anyhow::anyhow!("--{flag}: {e}")))
        .collect()
}

/// `None` when federation is off: none of --role, --peer, --tracker, --peer-srv given.
pub fn resolve(
    args: FederationArgs,
    file: FederationFile,
) -> anyhow::Result<Option<FederationSettings>> {
    let role = args.role.or(file.role);
    let peers = list(args.peers, file.peers);
    let trackers = list(args.trackers, file.trackers);
    let peer_srv = list(args.peer_srv, file.peer_srv);
    if role.is_none() && peers.is_empty() && trackers.is_empty() && peer_srv.is_empty() {
        return Ok(None);
    }
    let role = match role {
        None => Role::Gateway,
        Some(r) => Role::parse(r.trim())
            .ok_or_else(|| anyhow::anyhow!("--role must be gateway, tracker or both, got '{r}'"))?,
    };
    for domain in &peer_srv {
        if domain.len() > 253
            || domain.is_empty()
            || !domain
                .split('.')
                .filter(|l| !l.is_empty())
                .all(|l| l.len() <= 63 && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'))
        {
            bail!("--peer-srv: '{domain}' is not a domain name");
        }
    }
    let dns_server = match args.dns_server.or(file.dns_server) {
        None => None,
        Some(text) => Some(text.trim().parse().with_context(|| {
            format!("--dns-server: '{text}' is not an address like 127.0.0.1:53")
        })?),
    };
    let announce_ttl = match args.announce_ttl.or(file.announce_ttl) {
        None => MAX_ANNOUNCE_TTL,
        Some(text) => crate::config::duration("announce-ttl", &text)?
            .filter(|d| *d <= MAX_ANNOUNCE_TTL && *d >= Duration::from_secs(1))
            .ok_or_else(|| anyhow::anyhow!("--announce-ttl must be between 1s and 24h"))?,
    };
    let tracker_announce_rate = match args.tracker_announce_rate.or(file.tracker_announce_rate) {
        None => parse_limit("10/s,10").map_err(|e| anyhow::anyhow!("{e}"))?,
        Some(text) => {
            parse_limit(&text).map_err(|e| anyhow::anyhow!("--tracker-announce-rate: {e}"))?
        }
    };
    let tracker_max_records = args
        .tracker_max_records
        .or(file.tracker_max_records)
        .unwrap_or(10_000);
    if tracker_max_records == 0 {
        bail!("--tracker-max-records must be at least 1");
    }
    let lease = args.handover_lease.or(file.handover_lease).unwrap_or(30.0);
    if !(lease.is_finite() && (0.1..=3600.0).contains(&lease)) {
        bail!("--handover-lease must be between 0.1 and 3600 seconds");
    }
    Ok(Some(FederationSettings {
        role,
        key_file: args.federation_key.or(file.federation_key),
        gateway_name: args
            .gateway_name
            .or(file.gateway_name)
            .map(|n| n.trim().to_owned())
            .filter(|n| !n.is_empty()),
        peers: specs("peer", peers)?,
        trackers: specs("tracker", trackers)?,
        peer_srv,
        dns_server,
        tofu: args.federation_tofu || file.federation_tofu.unwrap_or(false),
        allow_http: args.federation_allow_http || file.federation_allow_http.unwrap_or(false),
        announce_exports: args.announce_exports || file.announce_exports.unwrap_or(false),
        announce_ttl,
        tracker_max_records,
        tracker_announce_rate,
        handover_lease: Duration::from_secs_f64(lease),
    }))
}

/// Reads (or, for the data directory's default file, generates) the identity key and the keys
/// rotated away from, into the gateway's federation config.
pub fn load(s: &FederationSettings, data_dir: &Path) -> anyhow::Result<FederationConfig> {
    let path = key_path(s.key_file.as_deref(), data_dir);
    let key = if path.exists() || s.key_file.is_some() {
        read_key(&path)?
    } else {
        crate::config::private_dir(data_dir)?;
        let key = generate();
        crate::config::write_private(&path, key.to_pkcs8_pem().as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
        tracing::info!(key_id = %key.key_id(), path = %path.display(), "generated the federation identity key");
        key
    };
    let rotated = read_rotation(&path)?;
    // The gateway id derives from the first key this node had, expired or not.
    let first_public_key = rotated
        .last()
        .map(|(k, _)| k.public_key())
        .unwrap_or_else(|| key.public_key());
    let old_keys = rotated
        .into_iter()
        .filter(|(_, expires_at)| *expires_at > Utc::now())
        .map(|(key, expires_at)| OldIdentityKey {
            key: Arc::new(key),
            expires_at,
        })
        .collect();
    Ok(FederationConfig {
        role: s.role,
        gateway_name: s.gateway_name.clone().unwrap_or_else(host_name),
        key: Arc::new(key),
        first_public_key,
        old_keys,
        peers: s.peers.clone(),
        trackers: s.trackers.clone(),
        peer_srv: s.peer_srv.clone(),
        dns_server: s.dns_server,
        tofu: s.tofu,
        allow_http: s.allow_http,
        announce_exports: s.announce_exports,
        announce_ttl: s.announce_ttl,
        tracker_max_records: s.tracker_max_records,
        tracker_announce_rate: s.tracker_announce_rate,
        handover_lease: s.handover_lease,
    })
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "sbp".to_owned())
}

fn key_path(configured: Option<&Path>, data_dir: &Path) -> PathBuf {
    configured
        .map(Path::to_path_buf)
        .unwrap_or_else(|| data_dir.join(KEY_FILE))
}

fn generate() -> IdentityKey {
    let mut seed = [0u8; 32];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut seed);
    let key = IdentityKey::from_seed(seed);
    seed.fill(0);
    key
}

fn read_key(path: &Path) -> anyhow::Result<IdentityKey> {
    warn_if_open(path);
    let pem = std::fs::read_to_string(path)
        .with_context(|| format!("reading the federation key {}", path.display()))?;
    IdentityKey::from_pkcs8_pem(&pem).map_err(|e| {
        anyhow::anyhow!(
            "{} is not an Ed25519 private key in PKCS#8 PEM: {e}",
            path.display()
        )
    })
}

/// Logs a key file that others may read (an operator's file is not changed: it may sit on a
/// read-only secret mount).
fn warn_if_open(path: &Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        if let Ok(meta) = std::fs::metadata(path)
            && meta.permissions().mode() & 0o077 != 0
        {
            tracing::warn!(path = %path.display(), "the federation key file is readable by others; make it 0600");
        }
    }
}

/// `FILE.rotation.json`: the keys rotated away from.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Rotation {
    old_keys: Vec<RotatedKey>,
}

#[derive(Debug, Serialize, Deserialize)]
struct RotatedKey {
    key_id: String,
    /// The PEM file, relative to the key file's directory.
    file: String,
    expires_at: DateTime<Utc>,
}

fn rotation_path(key: &Path) -> PathBuf {
    let mut name = key.file_name().unwrap_or_default().to_os_string();
    name.push(".rotation.json");
    key.with_file_name(name)
}

fn read_rotation_file(key: &Path) -> anyhow::Result<Rotation> {
    let path = rotation_path(key);
    if !path.exists() {
        return Ok(Rotation::default());
    }
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The rotated-away keys, newest first, expired ones included (the caller filters).
fn read_rotation(key: &Path) -> anyhow::Result<Vec<(IdentityKey, DateTime<Utc>)>> {
    let dir = key.parent().unwrap_or(Path::new("."));
    let mut out = Vec::new();
    for old in read_rotation_file(key)?.old_keys.into_iter().rev() {
        let k = read_key(&dir.join(&old.file))?;
        if k.key_id() != old.key_id {
            bail!(
                "{} holds key {}, not {} as {} says",
                old.file,
                k.key_id(),
                old.key_id,
                rotation_path(key).display()
            );
        }
        out.push((k, old.expires_at));
    }
    Ok(out)
}

#[derive(Debug, Subcommand)]
pub enum FederationCommand {
    /// Make a new identity key. The old one is kept as FILE.<key_id>.old and listed in the
    /// manifest's `old_keys` until --old-key-ttl has passed, and the manifest carries an
    /// `old_signature` by it, so peers that pinned it follow. Run it with the node stopped (or
    /// restart it after): `sbp serve` reads the keys at start. The gateway id does not change.
    RotateKey(KeyArgs),
    /// Print the node's `public_key` (what peers pin with `--peer URL#KEY`) and its key id.
    PublicKey(KeyArgs),
    /// Make the node's identity key now if it has none (as `sbp serve` would at its first
    /// start), then print its `public_key`: so pins can be handed out before the nodes start.
    Init(KeyArgs),
}

#[derive(Debug, Args)]
pub struct KeyArgs {
    /// The data directory whose federation.key to use. [default: ./sbp-data]
    #[arg(long, env = "SBP_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// The key file, when `sbp serve` is given --federation-key.
    #[arg(long, env = "SBP_FEDERATION_KEY", value_name = "FILE")]
    pub federation_key: Option<PathBuf>,
    /// (rotate-key) How long the old key keeps verifying: a number with s, m, h or d. [default: 7d]
    #[arg(long)]
    pub old_key_ttl: Option<String>,
}

impl KeyArgs {
    fn path(&self) -> PathBuf {
        let dir = self
            .data_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("sbp-data"));
        key_path(self.federation_key.as_deref(), &dir)
    }
}

pub fn run(cmd: FederationCommand) -> anyhow::Result<()> {
    use std::io::Write as _;
    match cmd {
        FederationCommand::Init(args) => {
            let path = args.path();
            if !path.exists() {
                if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    crate::config::private_dir(dir)?;
                }
                let key = generate();
                crate::config::write_private(&path, key.to_pkcs8_pem().as_bytes())
                    .with_context(|| format!("writing {}", path.display()))?;
                eprintln!(
                    "federation key {} written to {}",
                    key.key_id(),
                    path.display()
                );
            }
            let key = read_key(&path)?;
            let mut out = std::io::stdout();
            writeln!(out, "{}", key.public_key().to_b64_spki())?;
            Ok(())
        }
        FederationCommand::PublicKey(args) => {
            let path = args.path();
            let key = read_key(&path)?;
            let mut out = std::io::stdout();
            writeln!(out, "{}", key.public_key().to_b64_spki())?;
            eprintln!("key id {} ({})", key.key_id(), path.display());
            Ok(())
        }
        FederationCommand::RotateKey(args) => {
            let ttl = match &args.old_key_ttl {
                None => DEFAULT_OLD_KEY_TTL,
                Some(t) => crate::config::duration("old-key-ttl", t)?
                    .ok_or_else(|| anyhow::anyhow!("--old-key-ttl must be more than 0"))?,
            };
            let path = args.path();
            let (old, new) = rotate(&path, ttl)?;
            eprintln!(
                "federation key rotated: {old} is kept until {} in the manifest's old_keys; the new key is {new}",
                (Utc::now() + chrono::Duration::from_std(ttl).unwrap_or_default()).to_rfc3339()
            );
            let mut out = std::io::stdout();
            writeln!(out, "{}", read_key(&path)?.public_key().to_b64_spki())?;
            Ok(())
        }
    }
}

/// Moves the key at `path` aside, records it in the rotation file and writes a new key.
/// Returns (old key id, new key id).
fn rotate(path: &Path, ttl: Duration) -> anyhow::Result<(String, String)> {
    let old = read_key(path)?;
    let old_id = old.key_id();
    let dir = path.parent().unwrap_or(Path::new("."));
    let file_name = format!(
        "{}.{old_id}.old",
        path.file_name().unwrap_or_default().to_string_lossy()
    );
    let aside = dir.join(&file_name);
    if aside.exists() {
        bail!(
            "{} exists already: was this key rotated before?",
            aside.display()
        );
    }
    let mut rotation = read_rotation_file(path)?;
    let now = Utc::now();
    rotation.old_keys.retain(|k| k.expires_at > now);
    rotation.old_keys.push(RotatedKey {
        key_id: old_id.clone(),
        file: file_name,
        expires_at: now + chrono::Duration::from_std(ttl).context("--old-key-ttl is too long")?,
    });
    crate::config::write_private(&aside, old.to_pkcs8_pem().as_bytes())
        .with_context(|| format!("writing {}", aside.display()))?;
    let rotation_file = rotation_path(path);
    let tmp = rotation_file.with_extension("json.tmp");
    let _ = std::fs::remove_file(&tmp);
    crate::config::write_private(&tmp, serde_json::to_string_pretty(&rotation)?.as_bytes())
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &rotation_file)
        .with_context(|| format!("writing {}", rotation_file.display()))?;
    let new = generate();
    let new_id = new.key_id();
    let tmp = path.with_extension("key.tmp");
    let _ = std::fs::remove_file(&tmp);
    crate::config::write_private(&tmp, new.to_pkcs8_pem().as_bytes())
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))?;
    Ok((old_id, new_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_unless_a_federation_option_is_given() {
        let none = resolve(FederationArgs::default(), FederationFile::default()).expect("off");
        assert!(none.is_none());
        let on = resolve(
            FederationArgs {
                peers: vec![format!(
                    "http://127.0.0.1:9/#{}",
                    generate().public_key().to_b64_spki()
                )],
                ..FederationArgs::default()
            },
            FederationFile::default(),
        )
        .expect("valid")
        .expect("on");
        assert_eq!(on.role, Role::Gateway);
        assert_eq!(on.peers[0].url, "http://127.0.0.1:9");
        assert!(on.peers[0].pin.is_some());
        let bad = resolve(
            FederationArgs {
                role: Some("relay".into()),
                ..FederationArgs::default()
            },
            FederationFile::default(),
        );
        assert!(bad.is_err());
        let bad_pin = resolve(
            FederationArgs {
                trackers: vec!["https://t.example#not-a-key".into()],
                ..FederationArgs::default()
            },
            FederationFile::default(),
        );
        assert!(bad_pin.is_err());
    }

    #[test]
    fn the_key_is_generated_private_then_kept_and_rotation_lists_the_old_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let settings = resolve(
            FederationArgs {
                role: Some("both".into()),
                ..FederationArgs::default()
            },
            FederationFile::default(),
        )
        .expect("valid")
        .expect("on");
        let first = load(&settings, dir.path()).expect("generated");
        let path = dir.path().join(KEY_FILE);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&path).expect("key").permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
        }
        let again = load(&settings, dir.path()).expect("kept");
        assert_eq!(first.key.key_id(), again.key.key_id());
        assert!(again.old_keys.is_empty());

        let (old, new) = rotate(&path, Duration::from_secs(3600)).expect("rotated");
        assert_eq!(old, first.key.key_id());
        let rotated = load(&settings, dir.path()).expect("after rotation");
        assert_eq!(rotated.key.key_id(), new);
        assert_ne!(new, old);
        assert_eq!(rotated.old_keys.len(), 1);
        assert_eq!(rotated.old_keys[0].key.key_id(), old);

        // A second rotation keeps both old keys, newest first.
        let (second_old, _) = rotate(&path, Duration::from_secs(3600)).expect("rotated twice");
        let twice = load(&settings, dir.path()).expect("after two rotations");
        let ids: Vec<String> = twice.old_keys.iter().map(|k| k.key.key_id()).collect();
        assert_eq!(ids, vec![second_old, old]);
    }

    #[test]
    fn a_given_key_file_must_exist_and_be_a_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("nope.pem");
        let settings = FederationSettings {
            key_file: Some(missing),
            ..resolve(
                FederationArgs {
                    role: Some("gateway".into()),
                    ..FederationArgs::default()
                },
                FederationFile::default(),
            )
            .expect("valid")
            .expect("on")
        };
        assert!(load(&settings, dir.path()).is_err());
        let junk = dir.path().join("junk.pem");
        std::fs::write(
            &junk,
            "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        )
        .expect("write");
        let settings = FederationSettings {
            key_file: Some(junk),
            ..settings
        };
        assert!(load(&settings, dir.path()).is_err());
    }
}
