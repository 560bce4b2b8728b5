//! The machine's PostgreSQL and Redis for tests (started by `scripts/services.sh`; URLs from the
//! variables `scripts/test.sh` exports), and cleaning up after a case that used them even when it
//! failed.

use std::future::Future;

/// The test database (`SBP_TEST_DATABASE_URL`; by default what `scripts/test.sh` exports, so a
/// plain `cargo test` works where `scripts/services.sh` has started PostgreSQL).
pub fn test_database_url() -> String {
    std::env::var("SBP_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// The TLS files of the test PostgreSQL server, which `scripts/services.sh` makes side by side.
#[derive(Debug, Clone)]
pub struct PgTestTls {
    /// The CA of the server's certificate (valid for `localhost`, `127.0.0.1` and `::1`).
    pub ca: std::path::PathBuf,
    /// A CA unrelated to the server's certificate.
    pub wrong_ca: std::path::PathBuf,
    /// A client certificate from `ca` (CN `sbp-test-client`), which the server verifies.
    pub client_cert: std::path::PathBuf,
    /// Its key (0600, owned by the user who ran `scripts/services.sh`).
    pub client_key: std::path::PathBuf,
}

/// The test server's TLS files: the CA `SBP_TEST_PG_CA` names (by default what
/// `scripts/test.sh` exports) and its siblings. Fails the test (never skips it) when the CA is
/// not there.
pub fn test_pg_tls() -> PgTestTls {
    let ca = std::path::PathBuf::from(
        std::env::var("SBP_TEST_PG_CA")
            .unwrap_or_else(|_| "/var/lib/postgresql/sbp-test-tls/ca.crt".into()),
    );
    assert!(
        ca.is_file(),
        "the test PostgreSQL CA {} is missing: run `bash scripts/services.sh` to make it and \
         give the server its certificate, or set SBP_TEST_PG_CA",
        ca.display()
    );
    let sibling = |name: &str| ca.with_file_name(name);
    PgTestTls {
        wrong_ca: sibling("wrong-ca.crt"),
        client_cert: sibling("client.crt"),
        client_key: sibling("client.key"),
        ca,
    }
}

/// The test Redis (`SBP_TEST_REDIS_URL`; by default what `scripts/test.sh` exports).
pub fn test_redis_url() -> String {
    std::env::var("SBP_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// Deletes every key of the Redis at `url` that starts with `prefix` (SCAN, so a large Redis is
/// not blocked). Blocking: for `Drop`, which cannot await.
pub fn delete_prefix_blocking(url: &str, prefix: &str) -> redis::RedisResult<()> {
    let mut con = redis::Client::open(url)?.get_connection()?;
    let pattern = format!("{prefix}*");
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query(&mut con)?;
        if !keys.is_empty() {
            redis::cmd("DEL").arg(&keys).query::<()>(&mut con)?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// [`delete_prefix_blocking`] off the async runtime's threads.
pub async fn delete_prefix(url: &str, prefix: &str) -> redis::RedisResult<()> {
    let (url, prefix) = (url.to_owned(), prefix.to_owned());
    tokio::task::spawn_blocking(move || delete_prefix_blocking(&url, &prefix))
        .await
        .expect("the key clean-up task does not panic")
}

/// Runs `case` in a task of its own (so its panic is caught), then `clean_up` (drop a schema,
/// delete a key prefix), then passes the case's panic on: a failed case leaves nothing behind.
pub async fn run_then_clean_up<C, K>(case: C, clean_up: K)
where
    C: Future<Output = ()> + Send + 'static,
    K: Future<Output = ()>,
{
    let outcome = tokio::spawn(case).await;
    clean_up.await;
    if let Err(e) = outcome {
        match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => panic!("case did not finish: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the machine's Redis: every key under the prefix goes (more than one SCAN page),
    /// a key that only shares its beginning with the prefix's stays.
    #[tokio::test]
    async fn delete_prefix_deletes_exactly_the_prefix() {
        let url = test_redis_url();
        let prefix = format!("sbptest:support:{}:", std::process::id());
        let mut con = redis::Client::open(url.as_str())
            .and_then(|c| c.get_connection())
            .expect("the test Redis (scripts/services.sh starts it)");
        for i in 0..2500 {
            redis::cmd("SET")
                .arg(format!("{prefix}{i}"))
                .arg(i)
                .query::<()>(&mut con)
                .expect("SET");
        }
        let neighbour = format!("{}x", prefix.trim_end_matches(':'));
        redis::cmd("SET")
            .arg(&neighbour)
            .arg(1)
            .query::<()>(&mut con)
            .expect("SET");

        delete_prefix(&url, &prefix).await.expect("delete");

        let left: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}*"))
            .query(&mut con)
            .expect("KEYS");
        assert!(left.is_empty(), "{} keys left", left.len());
        let kept: bool = redis::cmd("EXISTS")
            .arg(&neighbour)
            .query(&mut con)
            .expect("EXISTS");
        assert!(kept, "a key outside the prefix was deleted");
        redis::cmd("DEL")
            .arg(&neighbour)
            .query::<()>(&mut con)
            .expect("DEL");
    }
}
