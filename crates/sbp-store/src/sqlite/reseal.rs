//! Re-sealing a SQLite database under the keyring's current key (`sbp store reseal`): every
//! content column, page by page in key order, each page one writer job that reads and rewrites it;
//! then the database stops recording the earlier keys, so they can be retired.

use rusqlite::types::Value;
use rusqlite::{Connection, params_from_iter};

use super::codec::db_err;
use crate::seal::{Column, Resealed, Sealer};
use crate::{StoreError, StoreResult};

/// Rows read and rewritten per writer job.
const PAGE: i64 = 256;

/// The columns that order a table's rows for paging (its primary key).
pub(crate) fn order(table: &str, key: &str) -> &'static [&'static str] {
    match (table, key) {
        ("messages" | "tether", _) => &["session_id", "seq"],
        (_, "session_id") => &["session_id"],
        (_, "key") => &["key"],
        (_, "cid") => &["cid"],
        _ => &["id"],
    }
}

/// One page of `table.column` after `after` (the order columns' values of the last row done):
/// rewrites the values that are plain or sealed under an earlier key, and notes (and leaves) the
/// ones that do not open, so one bad value does not stop the run. Returns what it did and the last
/// row's order values (`None`: the table is done).
pub(crate) fn reseal_page(
    conn: &Connection,
    seal: &Sealer,
    (column, table, name, key): (Column, &str, &str, &str),
    after: Option<&[Value]>,
) -> StoreResult<(Resealed, Option<Vec<Value>>)> {
    let order = order(table, key);
    let cols = order.join(", ");
    let marks = vec!["?"; order.len()].join(", ");
    let after_clause = match after {
        Some(_) => format!("AND ({cols}) > ({marks})"),
        None => String::new(),
    };
    let sql = format!(
        "SELECT {key}, {name}, {cols} FROM {table} WHERE {name} IS NOT NULL {after_clause} \
         ORDER BY {cols} LIMIT {PAGE}"
    );
    let rows: Vec<(String, Value, Vec<Value>)> = conn
        .prepare_cached(&sql)
        .and_then(|mut st| {
            st.query_map(params_from_iter(after.unwrap_or(&[])), |r| {
                let at = (0..order.len())
                    .map(|i| r.get::<_, Value>(2 + i))
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                Ok((r.get(0)?, r.get(1)?, at))
            })?
            .collect()
        })
        .map_err(db_err)?;
    let update = format!("UPDATE {table} SET {name} = ? WHERE ({cols}) = ({marks})");
    let mut done = Resealed::default();
    let mut rewritten = 0;
    for (row_key, stored, at) in &rows {
        let opened = match stored {
            Value::Text(text) => {
                if !seal.needs_reseal(Sealer::sealed_by(text)) {
                    continue;
                }
                seal.open(column, row_key, text.clone()).map(Opened::Text)
            }
            Value::Blob(bytes) => {
                if !seal.needs_reseal(Sealer::sealed_by_bytes(bytes)) {
                    continue;
                }
                seal.open_bytes(column, row_key, bytes.clone())
                    .map(Opened::Bytes)
            }
            _ => {
                return Err(StoreError::Backend(format!(
                    "{table}.{name} holds a value that is neither text nor bytes"
                )));
            }
        };
        let new = match opened {
            Ok(Opened::Text(plain)) => {
                Value::Text(seal.seal(column, row_key, &plain)?.into_owned())
            }
            Ok(Opened::Bytes(plain)) => {
                Value::Blob(seal.seal_bytes(column, row_key, &plain)?.into_owned())
            }
            Err(e) => {
                done.note_unopened(column.name(), row_name(at), e);
                continue;
            }
        };
        let params = std::iter::once(&new).chain(at.iter());
        conn.prepare_cached(&update)
            .and_then(|mut st| st.execute(params_from_iter(params)))
            .map_err(db_err)?;
        rewritten += 1;
    }
    done.add(column, rewritten);
    let next = match rows.len() as i64 {
        n if n < PAGE => None,
        _ => rows.last().map(|(_, _, at)| at.clone()),
    };
    Ok((done, next))
}

enum Opened {
    Text(String),
    Bytes(Vec<u8>),
}

/// A row's primary key for a report: its columns' values joined with `/`.
fn row_name(at: &[Value]) -> String {
    at.iter()
        .map(|v| match v {
            Value::Text(t) => t.clone(),
            Value::Integer(i) => i.to_string(),
            other => format!("{other:?}"),
        })
        .collect::<Vec<_>>()
        .join("/")
}

/// After every column is resealed, in one write transaction (no other process writes meanwhile):
/// a last scan that no value is sealed under an earlier key (a gateway still on it may have
/// written some during the reseal), then the database records only the current key. `Ok(Err(n))`:
/// `n` such values, nothing forgotten.
pub(crate) fn forget_earlier_keys(
    conn: &Connection,
    seal: &Sealer,
) -> StoreResult<Result<u64, u64>> {
    let (current, (text_head, byte_head)) = seal
        .current()
        .zip(seal.current_heads())
        .ok_or_else(|| StoreError::Backend("a reseal needs an encryption key".to_owned()))?;
    let mut stale = 0;
    for &(_, table, name, _) in crate::seal::SEALED_COLUMNS {
        // Only values that do not start as the current key's do: after a reseal, next to none.
        let sql = format!(
            "SELECT {name} FROM {table} WHERE \
             (typeof({name}) = 'text' AND substr({name}, 1, 11) = ?1 AND substr({name}, 1, 16) <> ?2) \
             OR (typeof({name}) = 'blob' AND substr({name}, 1, 11) = CAST(?1 AS BLOB) \
                 AND substr({name}, 1, 15) <> ?3)"
        );
        let values: Vec<Value> = conn
            .prepare(&sql)
            .and_then(|mut st| {
                st.query_map(
                    rusqlite::params![crate::seal::PREFIX, text_head, byte_head],
                    |r| r.get(0),
                )?
                .collect()
            })
            .map_err(db_err)?;
        stale += values
            .iter()
            .filter(|v| match v {
                Value::Text(t) => seal.is_earlier(Sealer::sealed_by(t)),
                Value::Blob(b) => seal.is_earlier(Sealer::sealed_by_bytes(b)),
                _ => false,
            })
            .count() as u64;
    }
    if stale > 0 {
        return Ok(Err(stale));
    }
    let n = conn
        .execute(
            "DELETE FROM sealing_keys WHERE key_id <> ?1",
            [current.to_string()],
        )
        .map_err(db_err)?;
    Ok(Ok(n as u64))
}

/// Before every write job with encryption on: the current key must still be recorded. A reseal
/// elsewhere may have retired it (this process still seals under it): then nothing more is
/// written, and every later seal refuses too.
pub(crate) fn check_current(conn: &Connection, seal: &Sealer) -> StoreResult<()> {
    if let Some(e) = seal.retired() {
        return Err(e.into());
    }
    let Some(current) = seal.current() else {
        return Ok(());
    };
    let recorded: bool = conn
        .prepare_cached("SELECT EXISTS (SELECT 1 FROM sealing_keys WHERE key_id = ?1)")
        .and_then(|mut st| st.query_row([current.to_string()], |r| r.get(0)))
        .map_err(db_err)?;
    if recorded {
        return Ok(());
    }
    seal.retire();
    tracing::error!(key_id = %current, "the current encryption key was retired by a reseal");
    Err(crate::seal::SealError::Retired(current).into())
}

/// [`crate::TetherStore::record_sealing_tether`].
pub(crate) fn record_tether(conn: &Connection, prefix: &str) -> StoreResult<()> {
    conn.execute(
        "INSERT INTO sealing_tethers (prefix) VALUES (?1) ON CONFLICT (prefix) DO NOTHING",
        [prefix],
    )
    .map_err(db_err)?;
    Ok(())
}

/// Whether a Redis tether seals under this keyring.
pub(crate) fn has_tether(conn: &Connection) -> StoreResult<bool> {
    conn.query_row("SELECT EXISTS (SELECT 1 FROM sealing_tethers)", [], |r| {
        r.get(0)
    })
    .map_err(db_err)
}
