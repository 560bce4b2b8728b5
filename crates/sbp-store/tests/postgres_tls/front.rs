//! A TLS front to the test PostgreSQL server: it answers PostgreSQL's SSLRequest with 'S',
//! terminates TLS with a certificate the test chose (rustls), and relays the connection to the
//! real server, so a client that accepts the certificate gets a working connection. It tells
//! the test what each connection did (TLS, a handshake the client refused, plaintext).

use std::sync::Arc;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Mutex, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::rustls::{self, ServerConfig};

/// What one connection to the front did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Seen {
    /// TLS with the front's certificate, then relayed to the server.
    Tls,
    /// The client asked for TLS and did not finish the handshake (it refused the certificate).
    TlsRefused,
    /// No TLS asked for: relayed to the server as it came.
    Plain,
}

pub struct Front {
    pub port: u16,
    seen: Mutex<mpsc::UnboundedReceiver<Seen>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Front {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Front {
    /// Serves `chain` (leaf first) with `key` on a loopback port, relaying to the server at
    /// 127.0.0.1:`pg_port`.
    pub async fn start(
        chain: Vec<CertificateDer<'static>>,
        key: &rcgen::KeyPair,
        pg_port: u16,
    ) -> Front {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .expect("the front's certificate");
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            let mut relays = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                relays.spawn(relay(client, acceptor.clone(), pg_port, tx.clone()));
            }
        });
        Front {
            port,
            seen: Mutex::new(rx),
            task,
        }
    }

    /// The next `n` connections' outcomes, sorted (waits for them: a refused handshake is known
    /// to the front only when the client's alert or close arrives).
    pub async fn seen(&self, n: usize) -> Vec<Seen> {
        let mut rx = self.seen.lock().await;
        let mut seen = Vec::with_capacity(n);
        for _ in 0..n {
            seen.push(rx.recv().await.expect("the front runs"));
        }
        seen.sort();
        seen
    }
}

async fn relay(
    mut client: TcpStream,
    acceptor: TlsAcceptor,
    pg_port: u16,
    seen: mpsc::UnboundedSender<Seen>,
) {
    const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
    let mut first = [0u8; 8];
    if client.read_exact(&mut first).await.is_err() {
        return;
    }
    let Ok(mut server) = TcpStream::connect(("127.0.0.1", pg_port)).await else {
        return;
    };
    if first != SSL_REQUEST {
        let _ = seen.send(Seen::Plain);
        if server.write_all(&first).await.is_ok() {
            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
        }
        return;
    }
    if client.write_all(b"S").await.is_err() {
        return;
    }
    match acceptor.accept(client).await {
        Ok(mut tls) => {
            let _ = seen.send(Seen::Tls);
            let _ = tokio::io::copy_bidirectional(&mut tls, &mut server).await;
        }
        Err(_) => {
            let _ = seen.send(Seen::TlsRefused);
        }
    }
}
