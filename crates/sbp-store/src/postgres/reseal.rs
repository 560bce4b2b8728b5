//! Re-sealing a PostgreSQL database under the keyring's current key (`sbp store reseal`): every
//! content column, page by page in key order, each page one transaction that locks its rows,
//! rewrites them and commits; then the database stops recording the earlier keys.

use super::codec::db_err;
use super::ops::{Tx, prep};
use crate::seal::{Column, Resealed, Sealer};
use crate::{StoreError, StoreResult};

/// Rows read and rewritten per transaction.
const PAGE: i64 = 256;

/// The columns that order a table's rows (its primary key), with their SQL types.
fn order(table: &str, key: &str) -> &'static [(&'static str, &'static str)] {
    match (table, key) {
        ("messages" | "tether", _) => &[("session_id", "uuid"), ("seq", "bigint")],
        (_, "session_id") => &[("session_id", "uuid")],
        (_, "key") => &[("key", "text")],
        (_, "cid") => &[("cid", "text")],
        _ => &[("id", "uuid")],
    }
}

/// One page of `table.column` after `after` (the order columns of the last row done, as text):
/// rewrites the values that are plain or sealed under an earlier key, and notes (and leaves) the
/// ones that do not open. Returns what it did and where the next page starts (`None`: the table
/// is done).
pub(crate) async fn reseal_page(
    tx: &Tx,
    seal: &Sealer,
    (column, table, name, key): (Column, &str, &str, &str),
    after: Option<Vec<String>>,
) -> StoreResult<(Resealed, Option<Vec<String>>)> {
    let order = order(table, key);
    let cols = order.iter().map(|(c, _)| *c).collect::<Vec<_>>().join(", ");
    let as_text = order
        .iter()
        .map(|(c, _)| format!("{c}::text"))
        .collect::<Vec<_>>()
        .join(", ");
    let marks = |from: usize| {
        order
            .iter()
            .enumerate()
            // Bound as text, so one parameter type serves every key column.
            .map(|(i, (_, t))| format!("${}::text::{t}", from + i))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let after_clause = match after {
        Some(_) => format!("AND ({cols}) > ({})", marks(1)),
        None => String::new(),
    };
    let bytes = column == Column::BundleBody;
    let select = format!(
        "SELECT {key}::text, {name}, {as_text} FROM {table} WHERE {name} IS NOT NULL \
         {after_clause} ORDER BY {cols} LIMIT {PAGE} FOR UPDATE"
    );
    let st = prep(tx, &select).await?;
    let after = after.unwrap_or_default();
    let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = after
        .iter()
        .map(|v| v as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect();
    let rows = tx.query(&st, &params).await.map_err(db_err)?;
    let update = prep(
        tx,
        &format!(
            "UPDATE {table} SET {name} = $1 WHERE ({cols}) = ({})",
            marks(2)
        ),
    )
    .await?;
    let mut done = Resealed::default();
    let mut rewritten = 0;
    let mut last = None;
    for row in &rows {
        let row_key: String = row.try_get(0).map_err(db_err)?;
        let at = (0..order.len())
            .map(|i| row.try_get::<_, String>(2 + i).map_err(db_err))
            .collect::<StoreResult<Vec<String>>>()?;
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = Vec::new();
        let new_text;
        let new_bytes;
        if bytes {
            let stored: Vec<u8> = row.try_get(1).map_err(db_err)?;
            if seal.needs_reseal(Sealer::sealed_by_bytes(&stored)) {
                match seal.open_bytes(column, &row_key, stored) {
                    Ok(plain) => {
                        new_bytes = seal.seal_bytes(column, &row_key, &plain)?.into_owned();
                        params.push(&new_bytes);
                    }
                    Err(e) => done.note_unopened(column.name(), at.join("/"), e),
                }
            }
        } else {
            let stored: String = row.try_get(1).map_err(db_err)?;
            if seal.needs_reseal(Sealer::sealed_by(&stored)) {
                match seal.open(column, &row_key, stored) {
                    Ok(plain) => {
                        new_text = seal.seal(column, &row_key, &plain)?.into_owned();
                        params.push(&new_text);
                    }
                    Err(e) => done.note_unopened(column.name(), at.join("/"), e),
                }
            }
        }
        if !params.is_empty() {
            params.extend(
                at.iter()
                    .map(|v| v as &(dyn tokio_postgres::types::ToSql + Sync)),
            );
            tx.execute(&update, &params).await.map_err(db_err)?;
            rewritten += 1;
        }
        last = Some(at);
    }
    let next = if (rows.len() as i64) < PAGE {
        None
    } else {
        last
    };
    done.add(column, rewritten);
    Ok((done, next))
}

/// After every column is resealed, in one transaction: stops every writer (the key record first,
/// which a writer's key check reads, then the content tables), scans that no value is sealed
/// under an earlier key (a gateway still on it may have written some during the reseal), then the
/// database records only the current key. `Ok(Err(n))`: `n` such values, nothing forgotten.
pub(crate) async fn forget_earlier_keys(tx: &Tx, seal: &Sealer) -> StoreResult<Result<u64, u64>> {
    let (current, (text_head, byte_head)) = seal
        .current()
        .zip(seal.current_heads())
        .ok_or_else(|| StoreError::Backend("a reseal needs an encryption key".to_owned()))?;
    let mut tables: Vec<&str> = crate::seal::SEALED_COLUMNS
        .iter()
        .map(|(_, t, _, _)| *t)
        .collect();
    tables.dedup();
    tx.batch_execute(&format!(
        "LOCK TABLE sealing_keys IN EXCLUSIVE MODE; LOCK TABLE {} IN SHARE MODE",
        tables.join(", ")
    ))
    .await
    .map_err(db_err)?;
    let prefix = crate::seal::PREFIX;
    let mut stale = 0;
    for &(column, table, name, _) in crate::seal::SEALED_COLUMNS {
        if column == Column::BundleBody {
            let rows = tx
                .query(
                    &format!(
                        "SELECT {name} FROM {table} WHERE substring({name} from 1 for 11) = $1 \
                         AND substring({name} from 1 for 15) <> $2"
                    ),
                    &[&prefix.as_bytes(), &byte_head],
                )
                .await
                .map_err(db_err)?;
            for row in rows {
                let v: Vec<u8> = row.try_get(0).map_err(db_err)?;
                stale += u64::from(seal.is_earlier(Sealer::sealed_by_bytes(&v)));
            }
        } else {
            let rows = tx
                .query(
                    &format!(
                        "SELECT {name} FROM {table} WHERE left({name}, 11) = $1 \
                         AND left({name}, 16) <> $2"
                    ),
                    &[&prefix, &text_head],
                )
                .await
                .map_err(db_err)?;
            for row in rows {
                let v: String = row.try_get(0).map_err(db_err)?;
                stale += u64::from(seal.is_earlier(Sealer::sealed_by(&v)));
            }
        }
    }
    if stale > 0 {
        return Ok(Err(stale));
    }
    let n = tx
        .execute(
            "DELETE FROM sealing_keys WHERE key_id <> $1",
            &[&current.to_string()],
        )
        .await
        .map_err(db_err)?;
    Ok(Ok(n))
}

/// With encryption on, on every replica heartbeat (and so within one heartbeat of a reseal
/// elsewhere): the current key must still be recorded; if a reseal retired it, this store refuses
/// to seal from then on (logged; the heartbeat itself goes on, so this replica is not taken for
/// dead and its reads keep working).
pub(crate) async fn check_current(
    c: &impl deadpool_postgres::GenericClient,
    seal: &Sealer,
) -> StoreResult<()> {
    let Some(current) = seal.current() else {
        return Ok(());
    };
    if seal.retired().is_some() {
        return Ok(());
    }
    let row = c
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM sealing_keys WHERE key_id = $1)",
            &[&current.to_string()],
        )
        .await
        .map_err(db_err)?;
    if row.try_get::<_, bool>(0).map_err(db_err)? {
        return Ok(());
    }
    seal.retire();
    tracing::error!(
        key_id = %current,
        "the current encryption key was retired by a reseal: nothing more is sealed; restart with the current key"
    );
    Ok(())
}

/// [`crate::TetherStore::record_sealing_tether`].
pub(crate) async fn record_tether(tx: &Tx, prefix: &str) -> StoreResult<()> {
    tx.execute(
        "INSERT INTO sealing_tethers (prefix) VALUES ($1) ON CONFLICT (prefix) DO NOTHING",
        &[&prefix],
    )
    .await
    .map_err(db_err)?;
    Ok(())
}

/// Whether a Redis tether seals under this keyring.
pub(crate) async fn has_tether(tx: &Tx) -> StoreResult<bool> {
    let row = tx
        .query_one("SELECT EXISTS (SELECT 1 FROM sealing_tethers)", &[])
        .await
        .map_err(db_err)?;
    row.try_get(0).map_err(db_err)
}
