//! TLS for tests: a self-signed certificate (rcgen) for `127.0.0.1` and `localhost`, its PEM files
//! (replaced atomically, as a certificate renewal does), and clients that trust only it: reqwest
//! for HTTPS, [`Ws`] for WSS, and a bare handshake.

use std::path::Path;
use std::sync::Arc;

use serde_json::{Value, json};
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};

use crate::{WAIT, Ws};

/// A self-signed certificate and its private key, PEM.
pub struct TestCert {
    pub cert_pem: String,
    pub key_pem: String,
}

impl TestCert {
    /// A new key and a certificate for `127.0.0.1` and `localhost`.
    pub fn new() -> Self {
        let names = vec!["127.0.0.1".to_owned(), "localhost".to_owned()];
        let certified = rcgen::generate_simple_self_signed(names).expect("self-signed certificate");
        Self {
            cert_pem: certified.cert.pem(),
            key_pem: certified.signing_key.serialize_pem(),
        }
    }

    /// Writes the certificate and key to `cert` and `key`, each replaced in one rename.
    pub fn write(&self, cert: &Path, key: &Path) {
        replace(cert, self.cert_pem.as_bytes());
        replace(key, self.key_pem.as_bytes());
    }

    /// A client configuration trusting this certificate only.
    pub fn client_config(&self) -> Arc<ClientConfig> {
        let mut roots = RootCertStore::empty();
        let der = CertificateDer::from_pem_slice(self.cert_pem.as_bytes()).expect("PEM cert");
        roots.add(der).expect("root added");
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        Arc::new(config)
    }

    /// An HTTPS client trusting this certificate only, opening a new connection per request (so
    /// each request sees the certificate the server presents now).
    pub fn https_client(&self) -> reqwest::Client {
        let cert = reqwest::Certificate::from_pem(self.cert_pem.as_bytes()).expect("PEM cert");
        reqwest::Client::builder()
            .no_proxy()
            .tls_certs_only([cert])
            .pool_max_idle_per_host(0)
            .build()
            .expect("https client")
    }

    /// Whether a TLS handshake with `addr` (`host:port`) succeeds trusting this certificate only.
    pub async fn handshake(&self, addr: &str) -> bool {
        let Ok(tcp) = tokio::net::TcpStream::connect(addr).await else {
            return false;
        };
        let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).to_owned();
        let name = ServerName::try_from(host).expect("server name");
        let connector = tokio_rustls::TlsConnector::from(self.client_config());
        matches!(
            tokio::time::timeout(WAIT, connector.connect(name, tcp)).await,
            Ok(Ok(_))
        )
    }
}

impl Default for TestCert {
    fn default() -> Self {
        Self::new()
    }
}

fn replace(path: &Path, bytes: &[u8]) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).expect("write the new file");
    std::fs::rename(&tmp, path).expect("rename it into place");
}

impl Ws {
    /// Opens a WebSocket over TLS at `url` (`wss://...`), trusting `cert` only.
    pub async fn connect_tls(url: &str, cert: &TestCert) -> Ws {
        let connector = tokio_tungstenite::Connector::Rustls(cert.client_config());
        let (stream, _) = tokio::time::timeout(
            WAIT,
            tokio_tungstenite::connect_async_tls_with_config(url, None, true, Some(connector)),
        )
        .await
        .expect("wss connect within the wait")
        .expect("wss connect");
        Ws { stream }
    }

    /// [`Ws::attach`] over TLS: `wss_base` is `wss://HOST:PORT`.
    pub async fn attach_tls(wss_base: &str, id: &str, token: &str, cert: &TestCert) -> (Ws, Value) {
        let mut ws = Self::connect_tls(&format!("{wss_base}/v1/sbp/ws/{id}"), cert).await;
        ws.send(json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token}))
            .await;
        let attached = ws.recv().await;
        assert_eq!(attached["type"], "SESSION_ATTACHED", "{attached}");
        (ws, attached)
    }
}
