//! TLS served directly (rustls on aws-lc-rs): the certificate chain and key from PEM files, loaded
//! at start (a bad pair stops the start) and loaded again when the files change or on SIGHUP; a
//! pair that fails to load then is logged and the one in use is kept. Handshakes in progress keep
//! the certificate they started with; new ones get the new one.

use std::fmt;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_util::sync::CancellationToken;

use crate::config::TlsFiles;

/// Why a certificate and key could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} holds no PEM certificate")]
    NoCertificate { path: String },
    #[error("{path} holds no PEM private key")]
    NoKey { path: String },
    #[error("the certificate and key cannot be used together: {0}")]
    Rustls(#[from] rustls::Error),
}

/// Loads and checks `files` (what `serve` does at start), so a caller can refuse to start before
/// announcing an address.
pub fn check(files: &TlsFiles) -> Result<(), TlsError> {
    load(files, &provider()).map(|_| ())
}

/// The TLS side of the edge: the acceptor and the certificate it presents.
pub(crate) struct Tls {
    acceptor: TlsAcceptor,
    certs: Arc<Reloading>,
}

impl Tls {
    pub fn new(files: &TlsFiles) -> Result<Self, TlsError> {
        let provider = Arc::new(provider());
        let (key, digest) = load(files, &provider)?;
        let certs = Arc::new(Reloading {
            files: files.clone(),
            provider: provider.clone(),
            current: RwLock::new(Arc::new(key)),
            digest: Mutex::new(digest),
        });
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(certs.clone());
        // HTTP/1.1 only: the edge's limits count connections, and HTTP/2 would carry many
        // requests on one (clients that still send its preface are served).
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            certs,
        })
    }

    pub fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }

    /// Reloads the files when their content changed (checked every `every`) or on SIGHUP, until
    /// `stop`.
    pub async fn watch(&self, every: Duration, stop: CancellationToken) {
        let mut hangups = hangups();
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let asked = tokio::select! {
                _ = stop.cancelled() => return,
                _ = ticks.tick() => false,
                _ = next_hangup(&mut hangups) => true,
            };
            self.certs.reload(asked);
        }
    }
}

#[cfg(unix)]
type Hangups = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Hangups = ();

#[cfg(unix)]
fn hangups() -> Hangups {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; TLS files are reloaded when they change");
            None
        }
    }
}

#[cfg(not(unix))]
fn hangups() -> Hangups {}

#[cfg(unix)]
async fn next_hangup(h: &mut Hangups) {
    match h {
        Some(s) => {
            if s.recv().await.is_none() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

#[cfg(not(unix))]
async fn next_hangup(_: &mut Hangups) {
    std::future::pending().await
}

fn provider() -> CryptoProvider {
    rustls::crypto::aws_lc_rs::default_provider()
}

/// The certificate in use, replaced when the files change.
struct Reloading {
    files: TlsFiles,
    provider: Arc<CryptoProvider>,
    current: RwLock<Arc<CertifiedKey>>,
    /// SHA-256 of the files' content last loaded (or last found unusable).
    digest: Mutex<[u8; 32]>,
}

impl fmt::Debug for Reloading {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reloading")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl ResolvesServerCert for Reloading {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        // A panic while replacing leaves the previous value whole.
        Some(
            self.current
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        )
    }
}

impl Reloading {
    /// Loads the files again if their content changed (or `asked`, on SIGHUP).
    fn reload(&self, asked: bool) {
        let digest = match digest(&self.files) {
            Ok(d) => d,
            Err(e) => {
                tracing::error!(error = %e, "TLS files unreadable; the certificate in use is kept");
                return;
            }
        };
        {
            let mut last = self.digest.lock().unwrap_or_else(PoisonError::into_inner);
            if *last == digest && !asked {
                return;
            }
            *last = digest;
        }
        match load(&self.files, &self.provider) {
            Ok((key, _)) => {
                *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(key);
                tracing::info!(cert = %self.files.cert.display(), "TLS certificate reloaded");
            }
            Err(e) => {
                tracing::error!(error = %e, "TLS certificate not reloaded; the one in use is kept");
            }
        }
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.display().to_string(),
        source,
    })
}

fn digest(files: &TlsFiles) -> Result<[u8; 32], TlsError> {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(read(&files.cert)?);
    h.update(read(&files.key)?);
    Ok(h.finalize().into())
}

/// The chain and key of `files`, checked to belong together, and the files' digest.
fn load(files: &TlsFiles, provider: &CryptoProvider) -> Result<(CertifiedKey, [u8; 32]), TlsError> {
    let cert_pem = read(&files.cert)?;
    let key_pem = read(&files.key)?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
        .filter_map(Result::ok)
        .collect();
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: files.cert.display().to_string(),
        });
    }
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| TlsError::NoKey {
        path: files.key.display().to_string(),
    })?;
    let certified = CertifiedKey::from_der(chain, key, provider)?;
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(&cert_pem);
    h.update(&key_pem);
    Ok((certified, h.finalize().into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Pair {
        cert: String,
        key: String,
    }

    fn pair() -> Pair {
        let c =
            rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("self-signed");
        Pair {
            cert: c.cert.pem(),
            key: c.signing_key.serialize_pem(),
        }
    }

    fn files(dir: &tempfile::TempDir) -> TlsFiles {
        TlsFiles {
            cert: dir.path().join("cert.pem"),
            key: dir.path().join("key.pem"),
        }
    }

    fn serial(c: &Reloading) -> Vec<u8> {
        c.current.read().expect("lock").cert[0].as_ref().to_vec()
    }

    #[test]
    fn a_pair_is_checked_and_a_bad_one_on_reload_keeps_the_one_in_use() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = files(&dir);
        assert!(matches!(check(&f), Err(TlsError::Read { .. })));
        let (a, b) = (pair(), pair());
        std::fs::write(&f.cert, &a.cert).expect("write");
        std::fs::write(&f.key, "not a key").expect("write");
        assert!(matches!(check(&f), Err(TlsError::NoKey { .. })));
        std::fs::write(&f.key, &b.key).expect("write");
        assert!(
            matches!(check(&f), Err(TlsError::Rustls(_))),
            "a key of another certificate"
        );
        std::fs::write(&f.key, &a.key).expect("write");
        check(&f).expect("a matching pair");

        let tls = Tls::new(&f).expect("loads");
        let first = serial(&tls.certs);
        // Unchanged files: nothing to do. A mismatched pair: kept. A good new pair: taken.
        tls.certs.reload(false);
        assert_eq!(serial(&tls.certs), first);
        std::fs::write(&f.cert, &b.cert).expect("write");
        tls.certs.reload(false);
        assert_eq!(
            serial(&tls.certs),
            first,
            "the mismatched pair is not taken"
        );
        std::fs::write(&f.key, &b.key).expect("write");
        tls.certs.reload(false);
        assert_ne!(serial(&tls.certs), first, "the renewed pair is taken");
    }
}
