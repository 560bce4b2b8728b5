//! The connection URL and connecting. libpq's TLS parameters (`sslmode` up to verify-ca and
//! verify-full, `sslrootcert`, `sslcert`, `sslkey`) are taken out of the URL and checked here:
//! tokio-postgres knows only disable / prefer / require and verifies no certificate. The rest of
//! the URL is tokio-postgres's. Every connection (the pool's, and [`connect`]'s) goes through
//! [`Connector`], which also gives `prefer` libpq's second try without TLS.

use std::path::PathBuf;

use deadpool_postgres::Connect;
use tokio::task::JoinHandle;
use tokio_postgres::config::{Host, SslMode as WireMode};

use super::codec::describe;
use super::tls::{Check, HandshakeError, MakeRustls, TlsFileError};
use crate::{StoreError, StoreResult};

/// libpq's `sslmode`, less `allow`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// Plaintext only.
    Disable,
    /// TLS when the server offers it (no certificate check unless `sslrootcert` is given),
    /// plaintext otherwise: libpq's default.
    Prefer,
    /// TLS or no connection; the certificate checked only against `sslrootcert` when given.
    Require,
    /// TLS, the certificate's chain checked against `sslrootcert`.
    VerifyCa,
    /// TLS, the chain checked and the certificate naming the host.
    VerifyFull,
}

impl SslMode {
    /// `require`, `verify-ca` and `verify-full`: TLS or no connection.
    pub fn requires_tls(self) -> bool {
        matches!(
            self,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// Why a connection URL is refused (before any connection is tried). No variant holds the URL,
/// which may hold a password.
#[derive(Debug, thiserror::Error)]
pub enum UrlError {
    #[error("a postgres:// or postgresql:// URL is expected")]
    NotAUrl,
    #[error("sslmode={0:?} is not one of disable, prefer, require, verify-ca, verify-full")]
    BadSslMode(String),
    #[error("sslmode=allow is not supported: use prefer (TLS when offered) or disable")]
    AllowUnsupported,
    #[error("{0} is given twice")]
    Repeated(&'static str),
    #[error("{0} is empty")]
    Empty(&'static str),
    #[error("{0}: bad percent-encoding or not UTF-8")]
    Encoding(&'static str),
    #[error("a URL parameter name: bad percent-encoding or not UTF-8")]
    KeyEncoding,
    #[error("sslcert and sslkey go together: give both")]
    CertWithoutKey,
    #[error(
        "sslmode=verify-ca needs sslrootcert=PATH: a chain checked against the system's public \
         CAs alone accepts any server holding any public certificate (use verify-full for those)"
    )]
    VerifyCaNeedsRootCert,
    #[error(
        "sslrootcert=system needs sslmode=verify-full (got {0}): the system's public CAs vouch \
         for names, so the name must be checked"
    )]
    SystemNeedsVerifyFull(&'static str),
    #[error(
        "sslmode={0} with a host list that mixes Unix sockets and TCP hosts: TLS is never used \
         on a socket (libpq ignores sslmode there), so the list would connect without it; list \
         only TCP hosts, or only sockets"
    )]
    SocketsAndTls(&'static str),
    #[error("{0}")]
    Parse(tokio_postgres::Error),
    #[error(transparent)]
    Tls(#[from] TlsFileError),
}

impl UrlError {
    /// The store's error for a URL refused at start.
    pub(crate) fn into_store(self) -> StoreError {
        match self {
            UrlError::Tls(e) => StoreError::Backend(format!("postgres TLS settings: {e}")),
            other => StoreError::Backend(format!("bad postgres url: {other}")),
        }
    }
}

/// The URL's TLS parameters, as given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsParams {
    pub mode: SslMode,
    /// `None` without `sslrootcert`; `Some(None)` for `sslrootcert=system`.
    pub root_cert: Option<Option<PathBuf>>,
    /// `sslcert` and `sslkey`.
    pub client: Option<(PathBuf, PathBuf)>,
}

impl TlsParams {
    /// The TLS parameters of `url`, checked with the rest of the URL without reading any file:
    /// for a configuration to be refused before anything starts.
    pub fn from_url(url: &str) -> Result<TlsParams, UrlError> {
        parse_url(url).map(|parsed| parsed.tls)
    }

    /// The certificate check libpq makes for these parameters.
    pub fn check(&self) -> Result<Check, UrlError> {
        let mode = self.mode;
        Ok(match (mode, &self.root_cert) {
            (SslMode::VerifyFull, Some(path)) => Check::ChainAndName(path.clone()),
            (SslMode::VerifyFull, None) => Check::ChainAndName(None),
            (_, Some(None)) => return Err(UrlError::SystemNeedsVerifyFull(mode.as_str())),
            (SslMode::VerifyCa, None) => return Err(UrlError::VerifyCaNeedsRootCert),
            // libpq checks the chain whenever it has a CA file, in prefer and require too.
            (_, Some(Some(path))) => Check::Chain(path.clone()),
            (_, None) => Check::Nothing,
        })
    }
}

/// A URL made ready to connect: tokio-postgres's configuration and the TLS side, files read.
#[derive(Clone)]
pub struct ConnectOptions {
    pub config: tokio_postgres::Config,
    pub tls: TlsParams,
    connector: MakeRustls,
}

impl std::fmt::Debug for ConnectOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // tokio-postgres's Debug leaves the password out.
        f.debug_struct("ConnectOptions")
            .field("config", &self.config)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

impl ConnectOptions {
    /// Parses `url` (`postgres://user[:password]@host[:port]/db[?param=value&...]`) and reads
    /// the CA, certificate and key files it names (blocking: see [`ConnectOptions::load`]).
    pub fn parse(url: &str) -> Result<ConnectOptions, UrlError> {
        let Parsed {
            config,
            tls,
            sockets_only,
        } = parse_url(url)?;
        if sockets_only && tls.mode.requires_tls() {
            tracing::info!(
                sslmode = tls.mode.as_str(),
                "postgres: every host is a Unix socket, where sslmode does not apply (as in \
                 libpq): connecting without TLS"
            );
        }
        let connector = if tls.mode == SslMode::Disable {
            // Never used (tokio-postgres asks for no TLS): libpq ignores the files then.
            MakeRustls::new(tls.mode.as_str(), &Check::Nothing, None)?
        } else {
            let client = tls.client.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
            MakeRustls::new(tls.mode.as_str(), &tls.check()?, client)?
        };
        Ok(ConnectOptions {
            config,
            tls,
            connector,
        })
    }

    /// [`ConnectOptions::parse`] on the blocking pool: the files (and the system's CA store)
    /// are read there, not on the async runtime's threads.
    pub async fn load(url: &str) -> StoreResult<ConnectOptions> {
        let url = url.to_owned();
        match tokio::task::spawn_blocking(move || ConnectOptions::parse(&url)).await {
            Ok(parsed) => parsed.map_err(UrlError::into_store),
            Err(e) => match e.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                Err(_) => Err(StoreError::Backend(
                    "reading the postgres TLS settings was cancelled".to_owned(),
                )),
            },
        }
    }

    /// What connects the pool's connections.
    pub(crate) fn connector(&self) -> Connector {
        Connector {
            tls: self.connector.clone(),
            prefer: self.tls.mode == SslMode::Prefer,
        }
    }
}

/// A URL parsed: tokio-postgres's configuration with libpq's rules it lacks applied, and the TLS
/// parameters. No file read yet.
pub(crate) struct Parsed {
    pub(crate) config: tokio_postgres::Config,
    tls: TlsParams,
    /// Every host is a Unix socket: no TLS, whatever `sslmode` says.
    sockets_only: bool,
}

/// Parses `url` as libpq reads it, its TLS parameters checked, without reading any file.
pub(crate) fn parse_url(url: &str) -> Result<Parsed, UrlError> {
    let (rest, tls) = split_tls_params(url)?;
    let mut config: tokio_postgres::Config = rest.parse().map_err(UrlError::Parse)?;
    // libpq names a host given only by `hostaddr` by its address, and checks the certificate
    // against that (verify-full: an IP address of the subjectAltName); tokio-postgres would have
    // no name and refuse any TLS handshake.
    if config.get_hosts().is_empty() {
        let addrs = config.get_hostaddrs().to_vec();
        for addr in addrs {
            config.host(addr.to_string());
        }
    }
    let (sockets, tcp) = host_kinds(&config);
    let sockets_only = sockets && !tcp;
    if sockets && tcp && tls.mode.requires_tls() {
        return Err(UrlError::SocketsAndTls(tls.mode.as_str()));
    }
    config.ssl_mode(match tls.mode {
        // libpq never asks for TLS on a socket (PostgreSQL offers none there).
        _ if sockets_only => WireMode::Disable,
        SslMode::Disable => WireMode::Disable,
        SslMode::Prefer => WireMode::Prefer,
        _ => WireMode::Require,
    });
    Ok(Parsed {
        config,
        tls,
        sockets_only,
    })
}

/// Whether the hosts include Unix sockets, and TCP hosts (a socket path with a `hostaddr` is
/// reached over TCP).
fn host_kinds(config: &tokio_postgres::Config) -> (bool, bool) {
    let addrs = config.get_hostaddrs();
    let (mut sockets, mut tcp) = (false, false);
    for (i, host) in config.get_hosts().iter().enumerate() {
        match host {
            #[cfg(unix)]
            Host::Unix(_) if addrs.get(i).is_none() => sockets = true,
            _ => tcp = true,
        }
    }
    (sockets, tcp)
}

/// `url` without its TLS parameters (for tokio-postgres), and those parameters.
pub(crate) fn split_tls_params(url: &str) -> Result<(String, TlsParams), UrlError> {
    let parts = url_parts(url)?;
    let (base, kept, tls) = match parts.query {
        None => (url, Vec::new(), params(None, None, None, None)?),
        Some(q) => {
            let (base, query) = (&url[..q], &url[q + 1..]);
            let mut kept: Vec<&str> = Vec::new();
            let mut found: [Option<String>; 4] = Default::default();
            const NAMES: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];
            for pair in query.split('&') {
                let (raw_key, raw_value) = pair.split_once('=').unwrap_or((pair, ""));
                let key = decode(raw_key).ok_or(UrlError::KeyEncoding)?;
                let Some(slot) = NAMES.iter().position(|n| *n == key) else {
                    kept.push(pair);
                    continue;
                };
                if found[slot].is_some() {
                    return Err(UrlError::Repeated(NAMES[slot]));
                }
                found[slot] = Some(decode(raw_value).ok_or(UrlError::Encoding(NAMES[slot]))?);
            }
            let [mode, root, cert, key] = found;
            (base, kept, params(mode, root, cert, key)?)
        }
    };
    let mut rest = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    // tokio-postgres takes everything up to the first '@' anywhere as the credentials; without
    // any, an '@' of the database name or of a parameter is encoded so that it reads them as
    // libpq does (it decodes both).
    if parts.credentials_end.is_none() && rest[parts.authority..].contains('@') {
        let encoded = rest[parts.authority..].replace('@', "%40");
        rest.replace_range(parts.authority.., &encoded);
    }
    Ok((rest, tls))
}

/// Where the parts of a connection URL are.
struct UrlParts {
    /// Where what follows `postgres://` starts.
    authority: usize,
    /// The '@' ending the credentials, when there are any.
    credentials_end: Option<usize>,
    /// The '?' starting the parameters, when there are any.
    query: Option<usize>,
}

/// libpq's reading of the URL's shape: the credentials end at an '@' before the first '/' (an
/// '@' after it is part of the database name or of a parameter, and a '?' before it is part of
/// the password); the parameters start at the first '?' after the credentials.
fn url_parts(url: &str) -> Result<UrlParts, UrlError> {
    let after_scheme = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
        .ok_or(UrlError::NotAUrl)?;
    let authority = url.len() - after_scheme.len();
    let credentials_end = after_scheme
        .find(['@', '/'])
        .filter(|&i| after_scheme[i..].starts_with('@'))
        .map(|i| authority + i);
    let skip = credentials_end.map_or(authority, |at| at + 1);
    Ok(UrlParts {
        authority,
        credentials_end,
        query: url[skip..].find('?').map(|q| skip + q),
    })
}

/// Where the `?` of the URL's parameters is, if it has any.
pub(crate) fn query_start(url: &str) -> Result<Option<usize>, UrlError> {
    url_parts(url).map(|parts| parts.query)
}

fn params(
    mode: Option<String>,
    root: Option<String>,
    cert: Option<String>,
    key: Option<String>,
) -> Result<TlsParams, UrlError> {
    let mode = match mode.as_deref() {
        None | Some("prefer") => SslMode::Prefer,
        Some("disable") => SslMode::Disable,
        Some("require") => SslMode::Require,
        Some("verify-ca") => SslMode::VerifyCa,
        Some("verify-full") => SslMode::VerifyFull,
        Some("allow") => return Err(UrlError::AllowUnsupported),
        Some(other) => return Err(UrlError::BadSslMode(other.chars().take(40).collect())),
    };
    let path = |name: &'static str, value: String| {
        if value.is_empty() {
            Err(UrlError::Empty(name))
        } else {
            Ok(PathBuf::from(value))
        }
    };
    let root_cert = match root {
        None => None,
        Some(system) if system == "system" => Some(None),
        Some(file) => Some(Some(path("sslrootcert", file)?)),
    };
    let client = match (cert, key) {
        (None, None) => None,
        (Some(cert), Some(key)) => Some((path("sslcert", cert)?, path("sslkey", key)?)),
        _ => return Err(UrlError::CertWithoutKey),
    };
    let tls = TlsParams {
        mode,
        root_cert,
        client,
    };
    if mode != SslMode::Disable {
        tls.check()?;
    }
    Ok(tls)
}

/// Percent-decoding as libpq's URLs have it (`+` is a plus).
fn decode(raw: &str) -> Option<String> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            // from_str_radix alone would take a sign ("%+f").
            if !hex.iter().all(u8::is_ascii_hexdigit) {
                return None;
            }
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Opens the pool's connections with the URL's TLS settings; under `prefer`, a failed TLS
/// handshake is followed by one attempt without TLS, as libpq makes (a server that declines TLS
/// is connected to in plaintext by tokio-postgres itself).
#[derive(Clone)]
pub(crate) struct Connector {
    tls: MakeRustls,
    prefer: bool,
}

impl Connector {
    async fn open(
        &self,
        config: &tokio_postgres::Config,
    ) -> Result<(tokio_postgres::Client, JoinHandle<()>), tokio_postgres::Error> {
        let (client, connection) = match config.connect(self.tls.clone()).await {
            Err(e) if self.prefer && handshake_failed(&e) => {
                tracing::warn!(
                    error = %describe(&e),
                    "postgres TLS handshake failed; sslmode=prefer connects without TLS"
                );
                let mut plain = config.clone();
                plain.ssl_mode(WireMode::Disable);
                plain.connect(self.tls.clone()).await?
            }
            other => other?,
        };
        let task = tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::warn!(error = %describe(&e), "postgres connection ended with an error");
            }
        });
        Ok((client, task))
    }
}

impl Connect for Connector {
    fn connect(
        &self,
        pg_config: &tokio_postgres::Config,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<
                    Output = Result<
                        (tokio_postgres::Client, JoinHandle<()>),
                        tokio_postgres::Error,
                    >,
                > + Send
                + '_,
        >,
    > {
        let config = pg_config.clone();
        Box::pin(async move { self.open(&config).await })
    }
}

/// Whether the TLS handshake itself failed (not the server's refusal of TLS, nor anything after).
fn handshake_failed(e: &tokio_postgres::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if cause.is::<HandshakeError>() {
            return true;
        }
        source = cause.source();
    }
    false
}

/// One connection to `url` outside any pool, with its TLS settings (for the statements of
/// tools and tests: creating and dropping schemas). The task drives the connection and ends when
/// the client is dropped.
pub async fn connect(url: &str) -> StoreResult<(tokio_postgres::Client, JoinHandle<()>)> {
    let options = ConnectOptions::load(url).await?;
    options
        .connector()
        .open(&options.config)
        .await
        .map_err(|e| connect_error(&options.tls, e))
}

/// A failed first connection, with the `sslmode` it was made under.
pub(crate) fn connect_error(tls: &TlsParams, e: tokio_postgres::Error) -> StoreError {
    if e.as_db_error().is_some() {
        return super::codec::db_err(e);
    }
    StoreError::Backend(format!(
        "postgres (sslmode={}): {}",
        tls.mode.as_str(),
        describe(&e)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(url: &str) -> Result<(String, TlsParams), UrlError> {
        split_tls_params(url)
    }

    #[test]
    fn tls_parameters_are_taken_out_and_the_rest_kept() {
        let (rest, tls) = split(
            "postgres://u:p@h:5/db?application_name=x&sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&connect_timeout=3",
        )
        .expect("parses");
        assert_eq!(
            rest,
            "postgres://u:p@h:5/db?application_name=x&connect_timeout=3"
        );
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(tls.root_cert, Some(Some(PathBuf::from("/etc/ca.pem"))));

        let (rest, tls) = split("postgresql://h/db?sslmode=disable").expect("parses");
        assert_eq!(
            (rest.as_str(), tls.mode),
            ("postgresql://h/db", SslMode::Disable)
        );

        let (rest, tls) = split("postgres://h/db").expect("parses");
        assert_eq!(
            (rest.as_str(), tls.mode),
            ("postgres://h/db", SslMode::Prefer)
        );

        // A '?' in the password is not the start of the parameters.
        let (rest, tls) = split("postgres://u:p?sslmode=x@h/db?sslmode=require").expect("parses");
        assert_eq!(
            (rest.as_str(), tls.mode),
            ("postgres://u:p?sslmode=x@h/db", SslMode::Require)
        );
    }

    #[test]
    fn libpq_picks_the_check_from_the_mode_and_the_ca() {
        let check = |q: &str| split(&format!("postgres://h/db?{q}")).map(|(_, t)| t.check());
        let ca = || PathBuf::from("/ca.pem");
        assert_eq!(
            check("sslmode=require").expect("ok").expect("ok"),
            Check::Nothing
        );
        assert_eq!(
            check("sslmode=require&sslrootcert=/ca.pem")
                .expect("ok")
                .expect("ok"),
            Check::Chain(ca())
        );
        assert_eq!(
            check("sslmode=verify-ca&sslrootcert=/ca.pem")
                .expect("ok")
                .expect("ok"),
            Check::Chain(ca())
        );
        assert_eq!(
            check("sslmode=verify-full&sslrootcert=/ca.pem")
                .expect("ok")
                .expect("ok"),
            Check::ChainAndName(Some(ca()))
        );
        assert_eq!(
            check("sslmode=verify-full").expect("ok").expect("ok"),
            Check::ChainAndName(None)
        );
        assert_eq!(
            check("sslmode=verify-full&sslrootcert=system")
                .expect("ok")
                .expect("ok"),
            Check::ChainAndName(None)
        );
    }

    #[test]
    fn bad_tls_parameters_are_refused_by_name() {
        let err = |url: &str| split(url).expect_err(url).to_string();
        let e = err("postgres://u:hunter2@h/db?sslmode=verify_full");
        assert!(
            e.contains("sslmode=\"verify_full\" is not one of disable, prefer"),
            "{e}"
        );
        assert!(!e.contains("hunter2"), "{e}");
        assert!(err("postgres://h/db?sslmode=allow").contains("not supported"));
        assert!(err("postgres://h/db?sslmode=require&sslmode=disable").contains("twice"));
        assert!(err("postgres://h/db?sslmode=verify-ca").contains("needs sslrootcert"));
        assert!(
            err("postgres://h/db?sslmode=require&sslrootcert=system")
                .contains("needs sslmode=verify-full")
        );
        assert!(err("postgres://h/db?sslcert=/c.pem").contains("give both"));
        assert!(err("postgres://h/db?sslrootcert=").contains("empty"));
        assert!(err("postgres://h/db?sslrootcert=%zz").contains("percent-encoding"));
        assert!(err("host=h sslmode=require").contains("postgres:// or postgresql:// URL"));
        let long = "x".repeat(10_000);
        assert!(
            err(&format!("postgres://h/db?sslmode={long}")).len() < 200,
            "bounded"
        );
    }

    #[test]
    fn decoding_is_strict() {
        assert_eq!(decode("a%20b+c").as_deref(), Some("a b+c"));
        assert_eq!(decode("%2"), None);
        assert_eq!(decode("%ff"), None, "not UTF-8");
        assert_eq!(decode("%+f"), None, "a sign is no hex digit");
        assert_eq!(decode("%-1"), None);
        assert_eq!(decode("%2f%2F").as_deref(), Some("//"));
    }

    /// libpq ends the credentials at an '@' before the first '/' only: an '@' in a parameter of
    /// a URL without credentials is the parameter's (it used to be taken as the end of the
    /// credentials, and the TLS parameters silently dropped).
    #[test]
    fn an_at_sign_after_the_first_slash_is_no_credentials() {
        let tls = TlsParams::from_url(
            "postgres://db.internal/sbp?sslmode=verify-full&sslrootcert=/etc/ssl/ca@2024.pem",
        )
        .expect("parses");
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(
            tls.root_cert,
            Some(Some(PathBuf::from("/etc/ssl/ca@2024.pem")))
        );

        // What tokio-postgres is given reads as libpq reads the URL.
        let parsed = parse_url("postgres://db.internal/db@x?application_name=a@b&sslmode=disable")
            .expect("parses");
        let config = parsed.config;
        assert_eq!(config.get_user(), None);
        assert_eq!(config.get_hosts(), [Host::Tcp("db.internal".to_owned())]);
        assert_eq!(config.get_dbname(), Some("db@x"));
        assert_eq!(config.get_application_name(), Some("a@b"));

        // With credentials, a later '@' is left to tokio-postgres, which reads it as libpq.
        let parsed = parse_url("postgres://u:p%40ss@h/db?application_name=a@b").expect("parses");
        assert_eq!(parsed.config.get_user(), Some("u"));
        assert_eq!(parsed.config.get_password(), Some(&b"p@ss"[..]));
        assert_eq!(parsed.config.get_application_name(), Some("a@b"));
        assert_eq!(
            query_start("postgres://u:p?x@h/db?sslmode=require").expect("url"),
            Some(21)
        );
    }

    /// A host given only by `hostaddr` is named by its address (tokio-postgres would have no
    /// name for the TLS handshake and refuse it).
    #[test]
    fn a_hostaddr_alone_names_the_host() {
        let parsed =
            parse_url("postgres://u@/db?hostaddr=127.0.0.1,::1&sslmode=require").expect("parses");
        assert_eq!(
            parsed.config.get_hosts(),
            [
                Host::Tcp("127.0.0.1".to_owned()),
                Host::Tcp("::1".to_owned())
            ]
        );
        assert_eq!(parsed.config.get_hostaddrs().len(), 2);
        assert_eq!(parsed.config.get_ssl_mode(), WireMode::Require);
        // Given both, the host keeps its name.
        let parsed = parse_url("postgres://u@db.internal/db?hostaddr=127.0.0.1").expect("parses");
        assert_eq!(
            parsed.config.get_hosts(),
            [Host::Tcp("db.internal".to_owned())]
        );
    }

    /// Unix sockets: sslmode does not apply (no TLS is asked for, whatever the mode), and a list
    /// mixing sockets and TCP hosts under a mode that needs TLS is refused before connecting.
    #[cfg(unix)]
    #[test]
    fn sslmode_does_not_apply_to_unix_sockets() {
        for mode in ["require", "verify-ca", "verify-full", "prefer"] {
            let parsed = parse_url(&format!(
                "postgres://u@%2Fvar%2Frun%2Fpostgresql/db?sslmode={mode}&sslrootcert=/ca.pem"
            ))
            .expect(mode);
            assert!(parsed.sockets_only, "{mode}");
            assert_eq!(parsed.config.get_ssl_mode(), WireMode::Disable, "{mode}");
        }
        let e = parse_url("postgres://u@%2Ftmp,db.internal/db?sslmode=require")
            .err()
            .expect("mixed under require");
        assert!(matches!(e, UrlError::SocketsAndTls("require")), "{e}");
        assert!(
            e.to_string().contains("mixes Unix sockets and TCP hosts"),
            "{e}"
        );
        assert!(
            matches!(
                TlsParams::from_url(
                    "postgres://u@/db?host=/tmp&host=db.internal&sslmode=verify-full"
                ),
                Err(UrlError::SocketsAndTls("verify-full"))
            ),
            "checked with the configuration"
        );
        // prefer may mix: TLS where the host offers it.
        let parsed = parse_url("postgres://u@%2Ftmp,db.internal/db").expect("prefer");
        assert!(!parsed.sockets_only);
        assert_eq!(parsed.config.get_ssl_mode(), WireMode::Prefer);
        // A socket path with a hostaddr is reached over TCP.
        let parsed =
            parse_url("postgres://u@%2Ftmp/db?hostaddr=127.0.0.1&sslmode=require").expect("tcp");
        assert!(!parsed.sockets_only);
        assert_eq!(parsed.config.get_ssl_mode(), WireMode::Require);
    }
}
