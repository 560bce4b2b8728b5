//! TLS to the test PostgreSQL server, whose certificate (for localhost, 127.0.0.1 and ::1) comes
//! from the test CA `scripts/services.sh` made: each `sslmode` against the real server, what the
//! server itself says of the connection (`pg_stat_ssl`), what is refused and how it is told, a
//! proxy standing for a server without TLS, the server's Unix socket, and a TLS front presenting
//! the certificates people make for themselves (`front.rs`).

mod front;

use std::net::SocketAddr;
use std::sync::Arc;

use sbp_store::postgres::{PostgresOptions, PostgresStore, SslMode, connect};
use sbp_store::{Store, StoreError};
use sbp_test_support::{test_database_url, test_pg_tls};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

use crate::postgres::TestSchema;
use crate::suite;

use self::front::{Front, Seen};

/// `url` with `params` added to its query.
fn with(url: &str, params: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{params}")
}

/// The test database's user, port and name, for URLs to another host name or address.
fn parts() -> (String, u16, String) {
    let config: tokio_postgres::Config = test_database_url().parse().expect("test url");
    (
        config.get_user().unwrap_or("postgres").to_owned(),
        config.get_ports().first().copied().unwrap_or(5432),
        config.get_dbname().unwrap_or("test").to_owned(),
    )
}

/// `postgres://USER@HOST:PORT/DB?PARAMS` on the test database.
fn url_to(host: &str, port: Option<u16>, params: &str) -> String {
    let (user, default_port, db) = parts();
    let port = port.unwrap_or(default_port);
    format!("postgres://{user}@{host}:{port}/{db}?{params}")
}

/// What the server says of one connection to `url`: encrypted, and the client certificate's DN.
async fn server_view(url: &str) -> Result<(bool, Option<String>), String> {
    let (client, conn) = connect(url).await.map_err(|e| e.to_string())?;
    let row = client
        .query_one(
            "SELECT ssl, client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?;
    drop(client);
    let _ = conn.await;
    Ok((row.get(0), row.get(1)))
}

/// Options whose schema does not exist: a store that opened by mistake fails to migrate, with
/// another error than the one a test expects, and leaves nothing behind.
fn nowhere() -> PostgresOptions {
    PostgresOptions {
        max_connections: 2,
        schema: Some("sbp_tls_never_created".to_owned()),
        ..PostgresOptions::default()
    }
}

async fn open_error(url: &str) -> String {
    match PostgresStore::open(url, nowhere()).await {
        Err(StoreError::Backend(m)) => m,
        Err(e) => panic!("unexpected error {e:?}"),
        Ok(_) => panic!("{url} must not open"),
    }
}

/// verify-full with the server's CA: the store works (a conformance case runs over it), its
/// connections are encrypted as the server sees them, by name (127.0.0.1, an IP address in the
/// certificate) and by DNS name (localhost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_with_the_servers_ca_encrypts_and_the_store_works() {
    let tls = test_pg_tls();
    let schema = TestSchema::create().await;
    let params = format!("sslmode=verify-full&sslrootcert={}", tls.ca.display());
    let store = PostgresStore::open(&with(&schema.url, &params), schema.options())
        .await
        .expect("verify-full with the server's CA opens");
    assert_eq!(store.ssl_mode(), SslMode::VerifyFull);
    assert!(store.encrypted().await.expect("pg_stat_ssl"), "encrypted");
    let store: Arc<dyn Store> = Arc::new(store);
    schema.run(suite::create_get_find_by_token(store)).await;

    let (ip, _) = server_view(&url_to("127.0.0.1", None, &params))
        .await
        .expect("127.0.0.1 is in the certificate");
    assert!(ip);
    let by_name = format!("hostaddr=127.0.0.1&{params}");
    let (named, _) = server_view(&url_to("localhost", None, &by_name))
        .await
        .expect("localhost is in the certificate");
    assert!(named);
}

/// A certificate from another CA is refused at start, the error saying so and naming the CA
/// file, never the password; the same URL under verify-ca and require (which check the chain
/// when given a CA, as libpq does) is refused too, and so is verify-full with the system's CAs.
#[tokio::test]
async fn a_certificate_from_another_ca_is_refused() {
    let tls = test_pg_tls();
    for mode in ["verify-full", "verify-ca", "require"] {
        let url = url_to(
            "127.0.0.1",
            None,
            &format!("sslmode={mode}&sslrootcert={}", tls.wrong_ca.display()),
        )
        .replacen("@", ":hunter2@", 1);
        let m = open_error(&url).await;
        assert!(m.contains("certificate was not accepted"), "{mode}: {m}");
        assert!(m.contains("UnknownIssuer"), "{mode}: {m}");
        assert!(m.contains(&format!("sslmode={mode}")), "{mode}: {m}");
        assert!(
            m.contains(&tls.wrong_ca.display().to_string()),
            "{mode}: {m}"
        );
        assert!(!m.contains("hunter2"), "{mode}: {m}");
    }
    // Without sslrootcert, verify-full takes the system's CAs, which did not sign the test CA's
    // certificate (or, on a machine without any, says so).
    for params in [
        "sslmode=verify-full",
        "sslmode=verify-full&sslrootcert=system",
    ] {
        let m = open_error(&url_to("127.0.0.1", None, params)).await;
        assert!(
            (m.contains("the system's CAs") && m.contains("UnknownIssuer"))
                || m.contains("no CA certificate found in the system's store"),
            "{params}: {m}"
        );
    }
}

/// verify-full checks the name: the server's certificate names neither `wrong.example` nor
/// `127.0.0.2` (each reached at 127.0.0.1 through `hostaddr`), so verify-full refuses it for
/// either, a DNS name or an IP address, while verify-ca, which checks the chain only, connects.
#[tokio::test]
async fn verify_full_refuses_a_certificate_for_another_name() {
    let tls = test_pg_tls();
    let params = |mode: &str| {
        format!(
            "hostaddr=127.0.0.1&sslmode={mode}&sslrootcert={}",
            tls.ca.display()
        )
    };
    for host in ["wrong.example", "127.0.0.2"] {
        let m = open_error(&url_to(host, None, &params("verify-full"))).await;
        assert!(m.contains("certificate was not accepted"), "{m}");
        assert!(m.contains(&format!("not valid for name \"{host}\"")), "{m}");
    }

    let (encrypted, _) = server_view(&url_to("wrong.example", None, &params("verify-ca")))
        .await
        .expect("verify-ca checks no name");
    assert!(encrypted);
}

/// require connects without a CA, encrypted; disable is plaintext; prefer (and no sslmode, the
/// default) encrypts when the server offers TLS.
#[tokio::test]
async fn require_disable_and_prefer_as_libpq() {
    let base = test_database_url();
    let cases = [
        ("sslmode=require", true),
        ("sslmode=disable", false),
        ("sslmode=prefer", true),
        ("application_name=sbp-tls-test", true),
    ];
    for (params, want) in cases {
        let (encrypted, _) = server_view(&with(&base, params)).await.expect(params);
        assert_eq!(encrypted, want, "{params}");
    }
}

/// prefer with a CA that refuses the server's certificate falls back to plaintext, as libpq's
/// prefer retries without TLS after a failed handshake.
#[tokio::test]
async fn prefer_after_a_failed_handshake_connects_in_plaintext() {
    let tls = test_pg_tls();
    let url = url_to(
        "127.0.0.1",
        None,
        &format!("sslmode=prefer&sslrootcert={}", tls.wrong_ca.display()),
    );
    let (encrypted, _) = server_view(&url).await.expect("prefer falls back");
    assert!(!encrypted);
}

/// sslcert and sslkey: the client certificate reaches the server (which verifies it against the
/// test CA).
#[tokio::test]
async fn the_client_certificate_is_presented() {
    let tls = test_pg_tls();
    let params = format!(
        "sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
        tls.ca.display(),
        tls.client_cert.display(),
        tls.client_key.display()
    );
    let (encrypted, dn) = server_view(&url_to("127.0.0.1", None, &params))
        .await
        .expect("connects with a client certificate");
    assert!(encrypted);
    let dn = dn.expect("the server saw a client certificate");
    assert!(dn.contains("sbp-test-client"), "{dn}");
}

/// A loopback proxy to the test server standing for a server without TLS: it answers
/// PostgreSQL's SSLRequest with 'N', as such a server does, then relays both ways.
async fn server_without_tls() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
    let (_, port, _) = parts();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        let mut relays = tokio::task::JoinSet::new();
        while let Ok((mut client, _)) = listener.accept().await {
            relays.spawn(async move {
                let mut first = [0u8; 8];
                if client.read_exact(&mut first).await.is_err() {
                    return;
                }
                let Ok(mut server) = TcpStream::connect(("127.0.0.1", port)).await else {
                    return;
                };
                let sent = if first == SSL_REQUEST {
                    client.write_all(b"N").await
                } else {
                    server.write_all(&first).await
                };
                if sent.is_ok() {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    (addr, task)
}

/// A server without TLS: prefer connects in plaintext; require and verify-full never fall back,
/// and say why.
#[tokio::test]
async fn a_server_without_tls_is_refused_unless_tls_is_only_preferred() {
    let tls = test_pg_tls();
    let (proxy, task) = server_without_tls().await;
    let (encrypted, _) = server_view(&url_to("127.0.0.1", Some(proxy.port()), "sslmode=prefer"))
        .await
        .expect("prefer takes plaintext");
    assert!(!encrypted);
    let verify = format!("sslmode=verify-full&sslrootcert={}", tls.ca.display());
    for params in ["sslmode=require", verify.as_str()] {
        let m = open_error(&url_to("127.0.0.1", Some(proxy.port()), params)).await;
        assert!(m.contains("server does not support TLS"), "{params}: {m}");
        assert!(
            m.contains("sslmode=verify-full") || m.contains("sslmode=require"),
            "{m}"
        );
    }
    task.abort();
}

/// A bad sslmode, a CA file that cannot be read, and a client key alone are refused at start,
/// each by name, and no error shows the password.
#[tokio::test]
async fn bad_tls_settings_are_refused_at_start_by_name() {
    let bad = [
        (
            "sslmode=verify-fulll",
            "sslmode=\"verify-fulll\" is not one of disable",
        ),
        (
            "sslmode=verify-full&sslrootcert=/nonexistent/ca.crt",
            "postgres TLS settings: reading sslrootcert /nonexistent/ca.crt",
        ),
        (
            "sslmode=require&sslkey=/tmp/k.pem",
            "sslcert and sslkey go together",
        ),
        ("sslmode=verify-ca", "sslmode=verify-ca needs sslrootcert"),
    ];
    for (params, want) in bad {
        let url = url_to("127.0.0.1", None, params).replacen("@", ":hunter2@", 1);
        let m = open_error(&url).await;
        assert!(m.contains(want), "{params}: {m}");
        assert!(!m.contains("hunter2"), "{params}: {m}");
    }
}

/// A URL with only `hostaddr` (no host name): libpq names the host by the address, so TLS is
/// used under prefer and require, and verify-full checks the address against the certificate
/// (127.0.0.1 is among its IP addresses). tokio-postgres alone had no name and refused the
/// handshake ("no hostname provided for TLS handshake").
#[tokio::test]
async fn a_host_given_only_by_its_address_gets_tls() {
    let tls = test_pg_tls();
    let (user, port, db) = parts();
    let verify = format!("sslmode=verify-full&sslrootcert={}", tls.ca.display());
    for params in ["sslmode=prefer", "sslmode=require", verify.as_str()] {
        let url = format!("postgres://{user}@/{db}?hostaddr=127.0.0.1&port={port}&{params}");
        let (encrypted, _) = server_view(&url).await.expect(params);
        assert!(encrypted, "{params}");
    }
}

/// The directory of the test server's Unix socket, as the server says (`unix_socket_directories`)
/// and as this machine has it.
async fn socket_dir() -> String {
    let (client, conn) = connect(&test_database_url()).await.expect("connects");
    let dirs: String = client
        .query_one("SELECT current_setting('unix_socket_directories')", &[])
        .await
        .expect("unix_socket_directories")
        .get(0);
    drop(client);
    let _ = conn.await;
    let (_, port, _) = parts();
    dirs.split(',')
        .map(|d| d.trim().to_owned())
        .find(|d| std::path::Path::new(&format!("{d}/.s.PGSQL.{port}")).exists())
        .unwrap_or_else(|| {
            panic!(
                "the test PostgreSQL server's Unix socket is not on this machine \
                 (unix_socket_directories = {dirs:?}): the socket tests need the local server"
            )
        })
}

/// A Unix socket never has TLS (PostgreSQL offers none there) and libpq ignores sslmode on it:
/// verify-full and require connect through the socket, unencrypted, instead of failing with
/// "server does not support TLS". A host list mixing a socket with a TCP host under a mode
/// that needs TLS is refused before connecting, saying why.
#[tokio::test]
async fn unix_sockets_connect_without_tls_whatever_the_sslmode() {
    let tls = test_pg_tls();
    let dir = socket_dir().await;
    let (user, port, db) = parts();
    let encoded = dir.replace('/', "%2F");
    let verify = format!("sslmode=verify-full&sslrootcert={}", tls.ca.display());
    for params in ["sslmode=require", verify.as_str(), "sslmode=prefer"] {
        let url = format!("postgres://{user}@{encoded}:{port}/{db}?{params}");
        let (encrypted, _) = server_view(&url).await.expect(params);
        assert!(!encrypted, "{params}: a socket has no TLS");
    }

    let mixed = format!("postgres://{user}@{encoded},127.0.0.1:{port}/{db}?sslmode=require");
    let m = open_error(&mixed).await;
    assert!(m.contains("mixes Unix sockets and TCP hosts"), "{m}");
    assert!(m.contains("sslmode=require"), "{m}");
}

/// A certificate made with rcgen for `names` (none: no subjectAltName) with Common Name `cn`,
/// self-signed as a CA, or signed by `issuer`.
fn certificate(
    names: &[&str],
    cn: &str,
    issuer: Option<&rcgen::Issuer<'_, rcgen::KeyPair>>,
) -> (rcgen::Certificate, rcgen::KeyPair) {
    let key = rcgen::KeyPair::generate().expect("key");
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let mut params = rcgen::CertificateParams::new(names).expect("params");
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, cn);
    let cert = match issuer {
        Some(issuer) => params.signed_by(&key, issuer).expect("leaf"),
        None => {
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params.self_signed(&key).expect("self-signed")
        }
    };
    (cert, key)
}

/// `postgres://USER@HOST:PORT/DB?hostaddr=127.0.0.1&PARAMS`: HOST reached at 127.0.0.1.
fn url_via(host: &str, port: u16, params: &str) -> String {
    let (user, _, db) = parts();
    format!("postgres://{user}@{host}:{port}/{db}?hostaddr=127.0.0.1&{params}")
}

/// PostgreSQL's documented quick set-up (`openssl req -new -x509 -subj /CN=host`, which under
/// OpenSSL 3 makes a CA:TRUE certificate without subjectAltName) with the certificate given as
/// its own sslrootcert: libpq accepts it, and so does every mode here, with TLS (prefer too,
/// where it used to fall back to plaintext); verify-full checks its name (the CN) and refuses
/// another.
#[tokio::test]
async fn a_self_signed_server_certificate_as_its_own_root_is_trusted() {
    let (_, pg_port, _) = parts();
    let (cert, key) = certificate(&[], "localhost", None);
    let dir = tempfile::tempdir().expect("dir");
    let root = dir.path().join("server.crt");
    std::fs::write(&root, cert.pem()).expect("write");
    let front = Front::start(vec![cert.der().clone()], &key, pg_port).await;
    for mode in ["verify-full", "verify-ca", "require", "prefer"] {
        let params = format!("sslmode={mode}&sslrootcert={}", root.display());
        let (client, conn) = connect(&url_via("localhost", front.port, &params))
            .await
            .unwrap_or_else(|e| panic!("{mode}: {e}"));
        client.simple_query("SELECT 1").await.expect(mode);
        drop(client);
        let _ = conn.await;
        assert_eq!(front.seen(1).await, [Seen::Tls], "{mode}");
    }

    let params = format!("sslmode=verify-full&sslrootcert={}", root.display());
    let m = open_error(&url_via("wrong.example", front.port, &params)).await;
    assert!(m.contains("certificate was not accepted"), "{m}");
    assert!(m.contains("not valid for name"), "{m}");
    assert_eq!(front.seen(1).await, [Seen::TlsRefused]);
}

/// verify-full with a certificate from a CA that names the host only in its Common Name (no
/// subjectAltName): libpq accepts it, case-insensitively, and so does verify-full here. A
/// certificate with a DNS subjectAltName is checked against that only (the CN no longer counts).
#[tokio::test]
async fn verify_full_takes_the_common_name_without_a_subject_alt_name() {
    let (_, pg_port, _) = parts();
    let ca_key = rcgen::KeyPair::generate().expect("key");
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    ca.distinguished_name = rcgen::DistinguishedName::new();
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "sbp front CA");
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let dir = tempfile::tempdir().expect("dir");
    let root = dir.path().join("ca.crt");
    std::fs::write(&root, ca.self_signed(&ca_key).expect("ca").pem()).expect("write");
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let params = format!("sslmode=verify-full&sslrootcert={}", root.display());

    let (cn_only, key) = certificate(&[], "localhost", Some(&issuer));
    let front = Front::start(vec![cn_only.der().clone()], &key, pg_port).await;
    for host in ["localhost", "LOCALHOST"] {
        let (client, conn) = connect(&url_via(host, front.port, &params))
            .await
            .unwrap_or_else(|e| panic!("{host}: {e}"));
        client.simple_query("SELECT 1").await.expect(host);
        drop(client);
        let _ = conn.await;
        assert_eq!(front.seen(1).await, [Seen::Tls], "{host}");
    }

    let (san, key) = certificate(&["db.example"], "localhost", Some(&issuer));
    let front = Front::start(vec![san.der().clone()], &key, pg_port).await;
    let m = open_error(&url_via("localhost", front.port, &params)).await;
    assert!(m.contains("not valid for name \"localhost\""), "{m}");
    assert_eq!(front.seen(1).await, [Seen::TlsRefused]);
}
