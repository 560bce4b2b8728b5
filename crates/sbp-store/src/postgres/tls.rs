//! TLS to PostgreSQL on rustls (aws-lc-rs, the provider the rest of the workspace uses):
//! tokio-postgres's `MakeTlsConnect` over a `ClientConfig` whose certificate check is the one the
//! URL's `sslmode` asks for, the CA and client files read and checked at start, and the
//! `tls-server-end-point` channel binding SCRAM uses.

use std::fmt;
use std::future::Future;
use std::io::{self, Read as _};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::client::danger::{
    HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier,
};
use tokio_rustls::rustls::client::{
    WebPkiServerVerifier, verify_server_cert_signed_by_trust_anchor,
};
use tokio_rustls::rustls::crypto::{
    CryptoProvider, WebPkiSupportedAlgorithms, verify_tls12_signature, verify_tls13_signature,
};
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio_rustls::rustls::server::ParsedCertificate;
use tokio_rustls::rustls::{self, ClientConfig, DigitallySignedStruct, RootCertStore};

/// A CA bundle, certificate or key file larger than this is refused (the system's whole bundle
/// is about 200 KiB).
const MAX_PEM_BYTES: u64 = 4 << 20;

/// The certificate check of a TLS connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    /// Encrypted, any certificate (`prefer` and `require` without `sslrootcert`).
    Nothing,
    /// The chain must lead to a CA of the file (`verify-ca`, and `prefer` / `require` with
    /// `sslrootcert`, as libpq does).
    Chain(PathBuf),
    /// The chain must lead to a CA of the file, or of the system's store (`None`), and the
    /// certificate must name the host (`verify-full`).
    ChainAndName(Option<PathBuf>),
}

/// Why the TLS settings of the URL cannot be used (at start, before any connection).
#[derive(Debug, thiserror::Error)]
pub enum TlsFileError {
    #[error("reading {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: String,
        source: io::Error,
    },
    #[error("{what} {path} is larger than {MAX_PEM_BYTES} bytes")]
    TooLarge { what: &'static str, path: String },
    #[error("{what} {path} holds no PEM certificate")]
    NoCertificate { what: &'static str, path: String },
    #[error("{what} {path}: a certificate cannot be used: {reason}")]
    BadCertificate {
        what: &'static str,
        path: String,
        reason: String,
    },
    #[error("sslkey {path} holds no PEM private key (an encrypted key is not supported)")]
    NoKey { path: String },
    #[error(
        "sslkey {path} is readable by others (mode {mode:04o}): make it 0600 (0640 when owned by root)"
    )]
    KeyNotPrivate { path: String, mode: u32 },
    #[error(
        "no CA certificate found in the system's store for sslmode=verify-full: install the \
         ca-certificates package or give sslrootcert=PATH"
    )]
    NoSystemRoots,
    #[error("sslcert and sslkey cannot be used together: {0}")]
    ClientCert(rustls::Error),
    #[error("TLS settings: {0}")]
    Rustls(rustls::Error),
}

/// Why a TLS connection to the server failed (the handshake's error, under tokio-postgres's).
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The server's certificate failed the check the URL asks for.
    #[error("the server's certificate was not accepted ({check}): {refused}")]
    Certificate {
        check: Arc<str>,
        refused: rustls::Error,
    },
    #[error(
        "verify-full needs a host name or IP address to check the certificate against, got {0:?}"
    )]
    NoName(String),
    #[error("TLS handshake: {0}")]
    Io(io::Error),
}

/// The TLS side of every connection of one URL: cheap to clone.
#[derive(Clone)]
pub struct MakeRustls {
    config: Arc<ClientConfig>,
    check_names: bool,
    /// What the check is, for errors: `sslmode=verify-full with the CAs of /path`.
    check: Arc<str>,
}

impl fmt::Debug for MakeRustls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MakeRustls")
            .field("check", &self.check)
            .finish_non_exhaustive()
    }
}

impl MakeRustls {
    /// Reads the CA file (or the system's store) and the client certificate and key, and builds
    /// the client configuration. `mode` is the URL's `sslmode`, for error messages.
    pub fn new(
        mode: &str,
        check: &Check,
        client: Option<(&Path, &Path)>,
    ) -> Result<MakeRustls, TlsFileError> {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let (verifier, what): (Arc<dyn ServerCertVerifier>, String) = match check {
            Check::Nothing => (
                Arc::new(Verifier::new(None, &provider)),
                format!("sslmode={mode}, certificate not checked"),
            ),
            Check::Chain(path) => (
                Arc::new(Verifier::new(Some(Arc::new(roots_from(path)?)), &provider)),
                format!("sslmode={mode}, CAs of {}", path.display()),
            ),
            Check::ChainAndName(path) => {
                let (roots, from) = match path {
                    Some(path) => (roots_from(path)?, format!("CAs of {}", path.display())),
                    None => (system_roots()?, "the system's CAs".to_owned()),
                };
                let verifier =
                    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                        .build()
                        .map_err(|e| TlsFileError::Rustls(rustls::Error::General(e.to_string())))?;
                (verifier, format!("sslmode={mode}, {from}"))
            }
        };
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(TlsFileError::Rustls)?
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let mut config = match client {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = certificates("sslcert", cert)?;
                let key = private_key(key)?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(TlsFileError::ClientCert)?
            }
        };
        // PostgreSQL 17's name for its protocol; earlier servers ignore it.
        config.alpn_protocols = vec![b"postgresql".to_vec()];
        Ok(MakeRustls {
            config: Arc::new(config),
            check_names: matches!(check, Check::ChainAndName(_)),
            check: what.into(),
        })
    }
}

impl<S> MakeTlsConnect<S> for MakeRustls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnect;
    type Error = HandshakeError;

    /// Never fails: a host that is no name (a Unix socket's is "") fails only if a handshake
    /// is attempted under verify-full.
    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, HandshakeError> {
        let name = ServerName::try_from(domain.to_owned()).ok();
        Ok(RustlsConnect {
            config: self.config.clone(),
            name: name.ok_or_else(|| domain.to_owned()),
            check_names: self.check_names,
            check: self.check.clone(),
        })
    }
}

/// One handshake, for one host.
pub struct RustlsConnect {
    config: Arc<ClientConfig>,
    /// The host as a name to check (or the host as given, which is none).
    name: Result<ServerName<'static>, String>,
    check_names: bool,
    check: Arc<str>,
}

impl<S> TlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = HandshakeError;
    type Future = Pin<Box<dyn Future<Output = Result<RustlsStream<S>, HandshakeError>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let name = match self.name {
                Ok(name) => name,
                Err(given) if self.check_names => return Err(HandshakeError::NoName(given)),
                // Not checked: an address sends no SNI.
                Err(_) => ServerName::IpAddress(Ipv4Addr::UNSPECIFIED.into()),
            };
            let tls = TlsConnector::from(self.config)
                .connect(name, stream)
                .await
                .map_err(|e| handshake_error(e, &self.check))?;
            let binding = tls
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|chain| chain.first())
                .and_then(|cert| server_end_point(cert));
            Ok(RustlsStream { tls, binding })
        })
    }
}

/// A certificate refused by the verifier is told apart (rustls's error under tokio-rustls's
/// `io::Error`), so the message says which check refused it.
fn handshake_error(e: io::Error, check: &Arc<str>) -> HandshakeError {
    let refused = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .filter(|inner| {
            matches!(
                inner,
                rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented
            )
        })
        .cloned();
    match refused {
        Some(refused) => HandshakeError::Certificate {
            check: check.clone(),
            refused,
        },
        None => HandshakeError::Io(e),
    }
}

/// A TLS connection to the server.
pub struct RustlsStream<S> {
    tls: tokio_rustls::client::TlsStream<S>,
    binding: Option<Vec<u8>>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tls).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tls).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tls).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tls).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tls).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tls.is_write_vectored()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for RustlsStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        match &self.binding {
            Some(hash) => ChannelBinding::tls_server_end_point(hash.clone()),
            None => ChannelBinding::none(),
        }
    }
}

/// The chain check of `verify-ca` (and of `prefer` / `require` with a CA file), or none; the
/// handshake's signatures are always checked against the certificate presented, which is what
/// the channel binding then vouches for.
#[derive(Debug)]
struct Verifier {
    roots: Option<Arc<RootCertStore>>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl Verifier {
    fn new(roots: Option<Arc<RootCertStore>>, provider: &CryptoProvider) -> Verifier {
        Verifier {
            roots,
            algorithms: provider.signature_verification_algorithms,
        }
    }
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if let Some(roots) = &self.roots {
            let cert = ParsedCertificate::try_from(end_entity)?;
            verify_server_cert_signed_by_trust_anchor(
                &cert,
                roots,
                intermediates,
                now,
                self.algorithms.all,
            )?;
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

fn read_bounded(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsFileError> {
    let read_error = |source| TlsFileError::Read {
        what,
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    let mut bytes = Vec::new();
    file.take(MAX_PEM_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() as u64 > MAX_PEM_BYTES {
        return Err(TlsFileError::TooLarge {
            what,
            path: path.display().to_string(),
        });
    }
    Ok(bytes)
}

fn certificates(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsFileError> {
    let pem = read_bounded(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsFileError::BadCertificate {
            what,
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsFileError::NoCertificate {
            what,
            path: path.display().to_string(),
        });
    }
    Ok(certs)
}

fn roots_from(path: &Path) -> Result<RootCertStore, TlsFileError> {
    let mut roots = RootCertStore::empty();
    for cert in certificates("sslrootcert", path)? {
        roots.add(cert).map_err(|e| TlsFileError::BadCertificate {
            what: "sslrootcert",
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
    }
    Ok(roots)
}

fn system_roots() -> Result<RootCertStore, TlsFileError> {
    let found = rustls_native_certs::load_native_certs();
    for error in &found.errors {
        tracing::debug!(%error, "a system CA certificate could not be loaded");
    }
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        return Err(TlsFileError::NoSystemRoots);
    }
    Ok(roots)
}

/// The client's key, refused when others may read it (libpq's rule: 0600 or less, 0640 or
/// less when root owns it, so a key shared through a group can be root's).
fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsFileError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt as _;
        let meta = std::fs::metadata(path).map_err(|source| TlsFileError::Read {
            what: "sslkey",
            path: path.display().to_string(),
            source,
        })?;
        let mode = meta.mode() & 0o7777;
        let allowed = if meta.uid() == 0 { 0o640 } else { 0o600 };
        if mode & 0o777 & !allowed != 0 {
            return Err(TlsFileError::KeyNotPrivate {
                path: path.display().to_string(),
                mode,
            });
        }
    }
    let pem = read_bounded("sslkey", path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|_| TlsFileError::NoKey {
        path: path.display().to_string(),
    })
}

/// `tls-server-end-point` (RFC 5929): the certificate hashed with its signature's hash (SHA-256
/// for MD5 and SHA-1). `None` for signatures without one fixed hash (RSA-PSS, Ed25519), for which
/// PostgreSQL's server offers no channel binding either: SCRAM then runs without it.
pub(crate) fn server_end_point(cert: &[u8]) -> Option<Vec<u8>> {
    use sha2::{Digest as _, Sha256, Sha384, Sha512};
    // Certificate ::= SEQUENCE { tbsCertificate, signatureAlgorithm, signatureValue }
    let (certificate, _) = der(cert, 0x30)?;
    let (_tbs, rest) = der(certificate, 0x30)?;
    let (algorithm, _) = der(rest, 0x30)?;
    let (oid, _) = der(algorithm, 0x06)?;
    const RSA: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01];
    const ECDSA_SHA2: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03];
    const ECDSA_SHA1: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x01];
    let hash = match (oid.split_last(), oid) {
        (_, o) if o == ECDSA_SHA1 => 256,
        (Some((&last, head)), _) if head == RSA => match last {
            0x04 | 0x05 | 0x0b => 256, // MD5, SHA-1, SHA-256 with RSA
            0x0c => 384,
            0x0d => 512,
            _ => return None,
        },
        (Some((&last, head)), _) if head == ECDSA_SHA2 => match last {
            0x02 => 256,
            0x03 => 384,
            0x04 => 512,
            _ => return None,
        },
        _ => return None,
    };
    Some(match hash {
        256 => Sha256::digest(cert).to_vec(),
        384 => Sha384::digest(cert).to_vec(),
        _ => Sha512::digest(cert).to_vec(),
    })
}

/// The DER element with tag `tag` at the start of `input`: its contents and what follows it.
fn der(input: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (&found, rest) = input.split_first()?;
    if found != tag {
        return None;
    }
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let (bytes, rest) = rest.split_at(n);
        let len = bytes
            .iter()
            .fold(0usize, |len, b| (len << 8) | usize::from(*b));
        (len, rest)
    };
    (rest.len() >= len).then(|| rest.split_at(len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_with(alg: &'static rcgen::SignatureAlgorithm) -> Vec<u8> {
        let key = rcgen::KeyPair::generate_for(alg).expect("key");
        let params = rcgen::CertificateParams::new(vec!["db.internal".to_owned()]).expect("params");
        params.self_signed(&key).expect("cert").der().to_vec()
    }

    #[test]
    fn channel_binding_hashes_with_the_signatures_hash() {
        use sha2::{Digest as _, Sha256, Sha384};
        let p256 = cert_with(&rcgen::PKCS_ECDSA_P256_SHA256);
        assert_eq!(
            server_end_point(&p256),
            Some(Sha256::digest(&p256).to_vec())
        );
        let p384 = cert_with(&rcgen::PKCS_ECDSA_P384_SHA384);
        assert_eq!(
            server_end_point(&p384),
            Some(Sha384::digest(&p384).to_vec())
        );
        let ed = cert_with(&rcgen::PKCS_ED25519);
        assert_eq!(server_end_point(&ed), None, "Ed25519 has no binding");
        assert_eq!(server_end_point(&p256[..p256.len() / 2]), None, "cut short");
        assert_eq!(server_end_point(b""), None);
    }

    #[test]
    fn unreadable_and_empty_files_are_named() {
        let dir = tempfile::tempdir().expect("dir");
        let missing = dir.path().join("missing.crt");
        let e = MakeRustls::new(
            "verify-full",
            &Check::ChainAndName(Some(missing.clone())),
            None,
        )
        .expect_err("missing file");
        assert!(matches!(e, TlsFileError::Read { .. }), "{e}");
        assert!(
            e.to_string().contains(&missing.display().to_string()),
            "{e}"
        );

        let empty = dir.path().join("empty.crt");
        std::fs::write(&empty, "not a certificate\n").expect("write");
        let e = MakeRustls::new("verify-ca", &Check::Chain(empty), None).expect_err("no cert");
        assert!(matches!(e, TlsFileError::NoCertificate { .. }), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn a_client_key_others_can_read_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().expect("dir");
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["client".to_owned()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        let (cert_path, key_path) = (dir.path().join("c.crt"), dir.path().join("c.key"));
        std::fs::write(&cert_path, cert.pem()).expect("write");
        std::fs::write(&key_path, key.serialize_pem()).expect("write");
        std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let e = MakeRustls::new("require", &Check::Nothing, Some((&cert_path, &key_path)))
            .expect_err("0644 key");
        assert!(
            matches!(e, TlsFileError::KeyNotPrivate { mode: 0o644, .. }),
            "{e}"
        );
        std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        MakeRustls::new("require", &Check::Nothing, Some((&cert_path, &key_path)))
            .expect("a private key is taken");

        let other = rcgen::KeyPair::generate().expect("key");
        std::fs::write(&key_path, other.serialize_pem()).expect("write");
        let e = MakeRustls::new("require", &Check::Nothing, Some((&cert_path, &key_path)))
            .expect_err("a key of another certificate");
        assert!(matches!(e, TlsFileError::ClientCert(_)), "{e}");
    }
}
