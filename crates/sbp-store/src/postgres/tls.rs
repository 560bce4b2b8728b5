//! TLS to PostgreSQL on rustls (aws-lc-rs, the provider the rest of the workspace uses):
//! tokio-postgres's `MakeTlsConnect` over a `ClientConfig` whose certificate check is the one the
//! URL's `sslmode` asks for (webpki's, with what libpq also accepts: a certificate given as its
//! own root, a name in the Common Name), the CA and client files read and checked at start, and
//! the `tls-server-end-point` channel binding SCRAM uses.

use std::fmt;
use std::fs::{File, Metadata};
use std::future::Future;
use std::io::{self, Read as _};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::client::danger::{
    HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier,
};
use tokio_rustls::rustls::client::{verify_server_cert_signed_by_trust_anchor, verify_server_name};
use tokio_rustls::rustls::crypto::{
    CryptoProvider, WebPkiSupportedAlgorithms, verify_tls12_signature, verify_tls13_signature,
};
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio_rustls::rustls::server::ParsedCertificate;
use tokio_rustls::rustls::{
    self, CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore,
};

use super::x509;

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
    #[error("{what} {path} is not a regular file")]
    NotAFile { what: &'static str, path: String },
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
        let (verifier, what) = match check {
            Check::Nothing => (
                Verifier::new(None, Vec::new(), false, &provider),
                format!("sslmode={mode}, certificate not checked"),
            ),
            Check::Chain(path) => {
                let (roots, pinned) = roots_from(path)?;
                (
                    Verifier::new(Some(roots), pinned, false, &provider),
                    format!("sslmode={mode}, CAs of {}", path.display()),
                )
            }
            Check::ChainAndName(Some(path)) => {
                let (roots, pinned) = roots_from(path)?;
                (
                    Verifier::new(Some(roots), pinned, true, &provider),
                    format!("sslmode={mode}, CAs of {}", path.display()),
                )
            }
            Check::ChainAndName(None) => (
                Verifier::new(Some(system_roots()?), Vec::new(), true, &provider),
                format!("sslmode={mode}, the system's CAs"),
            ),
        };
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(TlsFileError::Rustls)?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier));
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

    /// Never fails: a host that is no name fails only if a handshake is attempted under
    /// verify-full (a Unix socket, whose host is "", never gets one: see `connect.rs`).
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

/// The certificate check libpq makes: the chain to a CA of `roots` (none: `prefer` and `require`
/// without `sslrootcert`), and with `names` the host's name in the certificate. As OpenSSL does
/// for libpq, a certificate byte-identical to one of the CA file is trusted as itself (a
/// self-signed server certificate given as its own `sslrootcert`, which webpki alone refuses
/// when it says CA:TRUE), its dates still checked. The handshake's signatures are always checked
/// against the certificate presented, which is what the channel binding then vouches for.
#[derive(Debug)]
struct Verifier {
    roots: Option<RootCertStore>,
    /// The CA file's certificates, as they were in the file.
    pinned: Vec<CertificateDer<'static>>,
    names: bool,
    algorithms: WebPkiSupportedAlgorithms,
}

impl Verifier {
    fn new(
        roots: Option<RootCertStore>,
        pinned: Vec<CertificateDer<'static>>,
        names: bool,
        provider: &CryptoProvider,
    ) -> Verifier {
        Verifier {
            roots,
            pinned,
            names,
            algorithms: provider.signature_verification_algorithms,
        }
    }
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(roots) = &self.roots else {
            return Ok(ServerCertVerified::assertion());
        };
        let cert = ParsedCertificate::try_from(end_entity)?;
        if self
            .pinned
            .iter()
            .any(|p| p.as_ref() == end_entity.as_ref())
        {
            check_dates(end_entity, now)?;
        } else {
            verify_server_cert_signed_by_trust_anchor(
                &cert,
                roots,
                intermediates,
                now,
                self.algorithms.all,
            )?;
        }
        if self.names {
            check_name(end_entity, &cert, server_name)?;
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

/// The validity dates of a certificate trusted as itself (webpki checks those of a chain).
fn check_dates(cert: &[u8], now: UnixTime) -> Result<(), rustls::Error> {
    let (not_before, not_after) = x509::validity(cert).ok_or(rustls::Error::InvalidCertificate(
        CertificateError::BadEncoding,
    ))?;
    let at =
        |secs: i64| UnixTime::since_unix_epoch(Duration::from_secs(secs.max(0).unsigned_abs()));
    let time = i64::try_from(now.as_secs()).unwrap_or(i64::MAX);
    if time < not_before {
        return Err(rustls::Error::InvalidCertificate(
            CertificateError::NotValidYetContext {
                time: now,
                not_before: at(not_before),
            },
        ));
    }
    if time > not_after {
        return Err(rustls::Error::InvalidCertificate(
            CertificateError::ExpiredContext {
                time: now,
                not_after: at(not_after),
            },
        ));
    }
    Ok(())
}

/// verify-full's name check as libpq makes it: the subjectAltName's DNS names or IP addresses
/// (webpki's check, case-insensitive), and the subject's Common Name when the certificate has
/// no subjectAltName of the host's kind (a DNS name for a host name, an IP address for an
/// address), which libpq accepts and webpki does not.
fn check_name(
    der: &[u8],
    cert: &ParsedCertificate<'_>,
    host: &ServerName<'_>,
) -> Result<(), rustls::Error> {
    let Err(refused) = verify_server_name(cert, host) else {
        return Ok(());
    };
    let by_cn = x509::alt_names(der).is_some_and(|alt| match host {
        ServerName::IpAddress(_) => !alt.ip,
        _ => !alt.dns,
    });
    let cn = x509::common_name(der).filter(|_| by_cn);
    if cn.is_some_and(|cn| cn_matches(cn, host)) {
        return Ok(());
    }
    Err(refused)
}

/// libpq's match of a Common Name: the host, ignoring ASCII case, or `*.rest` standing for one
/// more label (without a dot) in front of `rest`. An address is compared as text.
fn cn_matches(cn: &str, host: &ServerName<'_>) -> bool {
    let host = match host {
        ServerName::DnsName(name) => name.as_ref().to_owned(),
        ServerName::IpAddress(ip) => std::net::IpAddr::from(*ip).to_string(),
        _ => return false,
    };
    if cn.contains('\0') {
        return false;
    }
    if cn.eq_ignore_ascii_case(&host) {
        return true;
    }
    let Some(suffix) = cn.strip_prefix('*') else {
        return false;
    };
    // `suffix` is ".rest": the host must end with it, after a first label without a dot.
    suffix.len() > 1
        && suffix.starts_with('.')
        && host.len() > suffix.len()
        && host.is_char_boundary(host.len() - suffix.len())
        && host[host.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
        && !host[..host.len() - suffix.len()].contains('.')
}

/// Opens `path` once and reads it whole (bounded), with what `fstat` says of the file opened: a
/// file swapped between a check and the read cannot slip through. Only a regular file is read
/// (a FIFO or a device could block the start or never end; O_NONBLOCK keeps the open itself from
/// waiting on a FIFO).
fn read_file(what: &'static str, path: &Path) -> Result<(Vec<u8>, Metadata), TlsFileError> {
    let read_error = |source| TlsFileError::Read {
        what,
        path: path.display().to_string(),
        source,
    };
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file: File = options.open(path).map_err(read_error)?;
    let meta = file.metadata().map_err(read_error)?;
    if !meta.is_file() {
        return Err(TlsFileError::NotAFile {
            what,
            path: path.display().to_string(),
        });
    }
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
    Ok((bytes, meta))
}

fn certificates(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsFileError> {
    let (pem, _) = read_file(what, path)?;
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

/// The CA file's certificates as trust anchors, and as they are (for the certificate trusted as
/// itself).
fn roots_from(path: &Path) -> Result<(RootCertStore, Vec<CertificateDer<'static>>), TlsFileError> {
    let certs = certificates("sslrootcert", path)?;
    let mut roots = RootCertStore::empty();
    for cert in &certs {
        roots
            .add(cert.clone())
            .map_err(|e| TlsFileError::BadCertificate {
                what: "sslrootcert",
                path: path.display().to_string(),
                reason: e.to_string(),
            })?;
    }
    Ok((roots, certs))
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
/// less when root owns it, so a key shared through a group can be root's). The mode is the one
/// of the file read.
fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsFileError> {
    let (pem, meta) = read_file("sslkey", path)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt as _;
        let mode = meta.mode() & 0o7777;
        let allowed = if meta.uid() == 0 { 0o640 } else { 0o600 };
        if mode & 0o777 & !allowed != 0 {
            return Err(TlsFileError::KeyNotPrivate {
                path: path.display().to_string(),
                mode,
            });
        }
    }
    #[cfg(not(unix))]
    let _ = meta;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|_| TlsFileError::NoKey {
        path: path.display().to_string(),
    })
}

/// `tls-server-end-point` (RFC 5929): the certificate hashed with its signature's hash (see
/// [`x509::signature_hash`]). `None` when the signature has no such hash (Ed25519, Ed448) or it
/// cannot be told: SCRAM then runs without channel binding (tokio-postgres says so to the server,
/// which accepts it unless it demands binding).
pub(crate) fn server_end_point(cert: &[u8]) -> Option<Vec<u8>> {
    use sha2::{Digest as _, Sha224, Sha256, Sha384, Sha512};
    Some(match x509::signature_hash(cert)? {
        x509::Hash::Sha224 => Sha224::digest(cert).to_vec(),
        x509::Hash::Sha256 => Sha256::digest(cert).to_vec(),
        x509::Hash::Sha384 => Sha384::digest(cert).to_vec(),
        x509::Hash::Sha512 => Sha512::digest(cert).to_vec(),
    })
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

    /// Certificates rcgen cannot make, made once with OpenSSL 3.0 (`openssl req -x509 -nodes
    /// -keyout /dev/null -subj /CN=db.internal -days 36500` with `-newkey rsa:2048 -sha224`,
    /// `-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -sha224`, `-newkey rsa:2048 -sigopt
    /// rsa_padding_mode:pss -shaN`, `-newkey ed448`): SHA-224 binds with SHA-224, RSA-PSS with
    /// the hash of its parameters (SHA-256 for SHA-1, which OpenSSL leaves out as the default),
    /// Ed448 with none.
    #[test]
    fn channel_binding_of_sha224_rsa_pss_and_ed448_certificates() {
        use sha2::{Digest as _, Sha224, Sha256, Sha384, Sha512};
        let der = |pem: &str| {
            CertificateDer::from_pem_slice(pem.as_bytes())
                .expect("test vector")
                .to_vec()
        };
        type Digest = fn(&[u8]) -> Vec<u8>;
        let cases: [(&str, &str, Option<Digest>); 8] = [
            (
                "rsa-sha224",
                include_str!("testdata/rsa-sha224.pem"),
                Some(|d| Sha224::digest(d).to_vec()),
            ),
            (
                "ecdsa-sha224",
                include_str!("testdata/ecdsa-sha224.pem"),
                Some(|d| Sha224::digest(d).to_vec()),
            ),
            (
                "rsa-pss-sha1",
                include_str!("testdata/rsa-pss-sha1.pem"),
                Some(|d| Sha256::digest(d).to_vec()),
            ),
            (
                "rsa-pss-sha224",
                include_str!("testdata/rsa-pss-sha224.pem"),
                Some(|d| Sha224::digest(d).to_vec()),
            ),
            (
                "rsa-pss-sha256",
                include_str!("testdata/rsa-pss-sha256.pem"),
                Some(|d| Sha256::digest(d).to_vec()),
            ),
            (
                "rsa-pss-sha384",
                include_str!("testdata/rsa-pss-sha384.pem"),
                Some(|d| Sha384::digest(d).to_vec()),
            ),
            (
                "rsa-pss-sha512",
                include_str!("testdata/rsa-pss-sha512.pem"),
                Some(|d| Sha512::digest(d).to_vec()),
            ),
            ("ed448", include_str!("testdata/ed448.pem"), None),
        ];
        for (name, pem, digest) in cases {
            let cert = der(pem);
            assert_eq!(server_end_point(&cert), digest.map(|d| d(&cert)), "{name}");
        }
    }

    #[test]
    fn common_names_match_as_libpq_matches_them() {
        let dns = |s: &str| ServerName::try_from(s.to_owned()).expect("name");
        assert!(cn_matches("db.internal", &dns("db.internal")));
        assert!(cn_matches("DB.Internal", &dns("db.INTERNAL")));
        assert!(cn_matches("*.internal", &dns("db.internal")));
        assert!(cn_matches("*.Internal", &dns("DB.internal")));
        assert!(
            !cn_matches("*.internal", &dns("a.db.internal")),
            "one label"
        );
        assert!(!cn_matches("*.internal", &dns("internal")));
        assert!(!cn_matches("*", &dns("db")));
        assert!(!cn_matches("db.internal", &dns("db.internal.example")));
        assert!(!cn_matches("db.internal\0.evil", &dns("db.internal")));
        assert!(
            cn_matches("127.0.0.1", &dns("127.0.0.1")),
            "an address as text"
        );
        assert!(!cn_matches("127.0.0.1", &dns("127.0.0.2")));
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

        let e = MakeRustls::new("verify-ca", &Check::Chain(dir.path().to_owned()), None)
            .expect_err("a directory");
        assert!(matches!(e, TlsFileError::NotAFile { .. }), "{e}");
    }

    /// A FIFO as sslrootcert or sslkey is refused at once: neither opening it (no writer) nor
    /// reading it (never ends) holds the start (before, this test hung in the open).
    #[cfg(unix)]
    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().expect("dir");
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo runs");
        assert!(made.success());
        let e = MakeRustls::new("verify-ca", &Check::Chain(fifo.clone()), None)
            .expect_err("a FIFO CA file");
        assert!(matches!(e, TlsFileError::NotAFile { .. }), "{e}");
        assert!(e.to_string().contains("is not a regular file"), "{e}");
        let e = private_key(&fifo).expect_err("a FIFO key");
        assert!(matches!(e, TlsFileError::NotAFile { .. }), "{e}");
    }

    /// The verifier of `check` over the CA file `roots` (PEM).
    fn verifier(names: bool, roots: &str) -> Verifier {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("ca.pem");
        std::fs::write(&path, roots).expect("write");
        let (roots, pinned) = roots_from(&path).expect("roots");
        let provider = rustls::crypto::aws_lc_rs::default_provider();
        Verifier::new(Some(roots), pinned, names, &provider)
    }

    fn verify(v: &Verifier, cert: &CertificateDer<'_>, host: &str) -> Result<(), rustls::Error> {
        let name = ServerName::try_from(host.to_owned()).expect("name");
        v.verify_server_cert(cert, &[], &name, &[], UnixTime::now())
            .map(|_| ())
    }

    fn ca() -> (rcgen::Issuer<'static, rcgen::KeyPair>, String) {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "test CA");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let pem = params.self_signed(&key).expect("ca").pem();
        (rcgen::Issuer::new(params, key), pem)
    }

    /// PostgreSQL's quick recipe (`openssl req -new -x509 -subj /CN=host`: CA:TRUE under
    /// OpenSSL 3, no subjectAltName) given as its own sslrootcert: trusted as itself, by chain
    /// and by name (its CN), while its dates are still checked and a name it lacks refused.
    #[test]
    fn a_self_signed_ca_certificate_is_trusted_as_its_own_root() {
        let key = rcgen::KeyPair::generate().expect("key");
        let self_signed = |from: (i32, u8, u8), to: (i32, u8, u8)| {
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
            params.distinguished_name = rcgen::DistinguishedName::new();
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, "db.internal");
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params.not_before = rcgen::date_time_ymd(from.0, from.1, from.2);
            params.not_after = rcgen::date_time_ymd(to.0, to.1, to.2);
            params.self_signed(&key).expect("cert")
        };
        let cert = self_signed((2020, 1, 1), (2090, 1, 1));
        for names in [false, true] {
            let v = verifier(names, &cert.pem());
            verify(&v, cert.der(), "db.internal").expect("trusted as itself");
            verify(&v, cert.der(), "DB.Internal").expect("names ignore case");
        }
        let e = verify(&verifier(true, &cert.pem()), cert.der(), "other.internal")
            .expect_err("another name");
        assert!(
            matches!(
                e,
                rustls::Error::InvalidCertificate(CertificateError::NotValidForNameContext { .. })
            ),
            "{e:?}"
        );
        // Another CA in the file does not make the certificate trusted.
        let (_, other) = ca();
        let e = verify(&verifier(false, &other), cert.der(), "db.internal").expect_err("other");
        assert!(matches!(e, rustls::Error::InvalidCertificate(_)), "{e:?}");

        let expired = self_signed((2000, 1, 1), (2001, 1, 1));
        let e = verify(
            &verifier(false, &expired.pem()),
            expired.der(),
            "db.internal",
        )
        .expect_err("expired");
        assert!(
            matches!(
                e,
                rustls::Error::InvalidCertificate(CertificateError::ExpiredContext { .. })
            ),
            "{e:?}"
        );
        let future = self_signed((2090, 1, 1), (2091, 1, 1));
        let e = verify(&verifier(true, &future.pem()), future.der(), "db.internal")
            .expect_err("not yet valid");
        assert!(
            matches!(
                e,
                rustls::Error::InvalidCertificate(CertificateError::NotValidYetContext { .. })
            ),
            "{e:?}"
        );
    }

    /// verify-full falls back to the Common Name when the certificate has no subjectAltName of
    /// the host's kind, as libpq does, and only then.
    #[test]
    fn the_common_name_counts_without_a_subject_alt_name_of_the_hosts_kind() {
        let (issuer, ca_pem) = ca();
        let leaf = |sans: Vec<rcgen::SanType>, cn: &str| {
            let key = rcgen::KeyPair::generate().expect("key");
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
            params.subject_alt_names = sans;
            params.distinguished_name = rcgen::DistinguishedName::new();
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, cn);
            params.signed_by(&key, &issuer).expect("leaf")
        };
        let v = verifier(true, &ca_pem);
        let cn_only = leaf(Vec::new(), "*.internal");
        verify(&v, cn_only.der(), "db.internal").expect("CN wildcard");
        verify(&v, cn_only.der(), "DB.INTERNAL").expect("CN ignores case");
        verify(&v, cn_only.der(), "a.db.internal").expect_err("one label only");
        verify(&v, cn_only.der(), "127.0.0.1").expect_err("the CN names no address");

        let ip_cn = leaf(Vec::new(), "127.0.0.1");
        verify(&v, ip_cn.der(), "127.0.0.1").expect("an address as the CN");

        // A DNS name in the subjectAltName: the CN no longer counts for names...
        let dns = leaf(
            vec![rcgen::SanType::DnsName(
                "other.internal".try_into().expect("dns"),
            )],
            "db.internal",
        );
        verify(&v, dns.der(), "db.internal").expect_err("CN ignored beside a DNS SAN");
        verify(&v, dns.der(), "OTHER.internal").expect("SAN, case ignored");
        // ...but still for an address, the SAN holding none.
        let dns_ip_cn = leaf(
            vec![rcgen::SanType::DnsName(
                "other.internal".try_into().expect("dns"),
            )],
            "127.0.0.1",
        );
        verify(&v, dns_ip_cn.der(), "127.0.0.1").expect("no IP SAN: the CN");
        // Under verify-ca the name is not checked at all.
        verify(&verifier(false, &ca_pem), dns.der(), "db.internal").expect("verify-ca");
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
