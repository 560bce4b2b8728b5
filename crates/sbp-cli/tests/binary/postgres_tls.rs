//! `sbp serve` on PostgreSQL over TLS: verify-full against the test server's CA serves
//! completions on encrypted connections; the wrong CA stops the start with a clear message.

use serde_json::json;

use crate::support::{
    STARTUP, Sbp, msg, psql, reply_text, run_to_end, sbp_serve_in, tcp_ports_to, test_database_url,
    test_pg_tls, unique_suffix,
};

/// `--database 'postgres://...?sslmode=verify-full&sslrootcert=CA'`: a completion is served and
/// stored, and every connection the gateway holds to PostgreSQL is encrypted as the server sees
/// it (`pg_stat_ssl` of the backends at the gateway's local ports). The same URL with a CA that
/// did not sign the server's certificate exits non-zero, saying the certificate was not
/// accepted, and never prints the password.
#[tokio::test]
async fn serves_over_postgres_with_verify_full_and_refuses_the_wrong_ca() {
    let tls = test_pg_tls();
    let base = test_database_url();
    let schema = format!("sbp_bin_{}", unique_suffix());
    psql(&base, &format!("CREATE SCHEMA {schema}"));
    let url = |ca: &std::path::Path| {
        format!(
            "{base}?options=-c%20search_path%3D{schema}&sslmode=verify-full&sslrootcert={}",
            ca.display()
        )
    };

    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &["--database", &url(&tls.ca)]).await;
    let (status, _, body) = gw.chat(None, json!([msg("user", "over TLS")])).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(reply_text(&body), "Echo: over TLS");

    let options = sbp_store::postgres::ConnectOptions::parse(&base).expect("test url");
    let port = options.config.get_ports().first().copied().unwrap_or(5432);
    let ports: Vec<i32> = tcp_ports_to(gw.proc.pid(), port)
        .into_iter()
        .map(i32::from)
        .collect();
    assert!(!ports.is_empty(), "the gateway holds connections");
    let (client, conn) = sbp_store::postgres::connect(&base).await.expect("admin");
    let seen: Vec<bool> = client
        .query(
            "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
             WHERE a.client_port = ANY($1)",
            &[&ports],
        )
        .await
        .expect("pg_stat_ssl")
        .iter()
        .map(|r| r.get(0))
        .collect();
    drop(client);
    let _ = conn.await;
    assert_eq!(seen.len(), ports.len(), "{seen:?} for {ports:?}");
    assert!(seen.iter().all(|ssl| *ssl), "{seen:?}");
    drop(gw);

    let wrong = url(&tls.wrong_ca).replacen("://postgres@", "://postgres:hunter2@", 1);
    assert!(
        wrong.contains("hunter2"),
        "the test URL names the user postgres"
    );
    let other = tempfile::tempdir().expect("tempdir");
    let (code, out, err) =
        run_to_end(sbp_serve_in(other.path(), &["--database", &wrong]), STARTUP).await;
    assert!(code.is_some_and(|c| c != 0), "exit {code:?}: {err}");
    assert!(err.contains("certificate was not accepted"), "{err}");
    assert!(err.contains("UnknownIssuer"), "{err}");
    assert!(
        !err.contains("hunter2") && !out.contains("hunter2"),
        "{out}{err}"
    );
    assert!(!out.contains("listening"), "{out}");
    psql(&base, &format!("DROP SCHEMA {schema} CASCADE"));
}
