//! Gateway federation (L6) on SQLite: the node's identity, trusted peers, the replay cache of
//! federation tokens, announcements and a tracker's registry. Each method is one job of the writer
//! (so one transaction, serialised with every other write) or one read; nothing here is sealed.

use async_trait::async_trait;
use rusqlite::{Connection, OptionalExtension, Row, params};

use super::SqliteStore;
use super::codec::{bad, col_ts, col_u64, db_err, int, json, ts};
use crate::{
    Announcement, FederationIdentity, FederationStore, PeerRecord, PeerSource, PutRecord,
    RegistryRecordRow, RegistryStore, StoreError, StoreResult, Sweep, Swept, Timestamp, VouchRow,
};

fn identity_row(row: &Row<'_>) -> rusqlite::Result<FederationIdentity> {
    Ok(FederationIdentity {
        gateway_id: row.get(0)?,
        first_key_id: row.get(1)?,
        created_at: col_ts(row, 2)?,
    })
}

fn identity(conn: &Connection) -> StoreResult<Option<FederationIdentity>> {
    conn.prepare_cached(
        "SELECT gateway_id, first_key_id, created_at FROM federation_identity WHERE id = 1",
    )
    .and_then(|mut st| st.query_row([], identity_row).optional())
    .map_err(db_err)
}

/// Inserts the one identity row unless it exists, then reads what is stored: the writer runs
/// jobs one at a time, so the first identity written is the one every later call gets.
fn init_identity(
    conn: &Connection,
    gateway_id: &str,
    first_key_id: &str,
    now: &Timestamp,
) -> StoreResult<FederationIdentity> {
    conn.prepare_cached(
        "INSERT INTO federation_identity (id, gateway_id, first_key_id, created_at) \
         VALUES (1, ?1, ?2, ?3) ON CONFLICT (id) DO NOTHING",
    )
    .and_then(|mut st| st.execute(params![gateway_id, first_key_id, ts(now)]))
    .map_err(db_err)?;
    identity(conn)?.ok_or_else(|| {
        StoreError::Backend("federation identity missing right after its insert".to_owned())
    })
}

const PEER_COLS: &str =
    "gateway_id, url, public_key, key_id, old_keys, source, verified_at, updated_at";

fn peer_row(row: &Row<'_>) -> rusqlite::Result<PeerRecord> {
    let old_keys: String = row.get(4)?;
    let source: String = row.get(5)?;
    Ok(PeerRecord {
        gateway_id: row.get(0)?,
        url: row.get(1)?,
        public_key: row.get(2)?,
        key_id: row.get(3)?,
        old_keys: serde_json::from_str(&old_keys).map_err(|e| bad(4, format!("json: {e}")))?,
        source: PeerSource::parse(&source)
            .ok_or_else(|| bad(5, format!("peer source {source:?}")))?,
        verified_at: col_ts(row, 6)?,
        updated_at: col_ts(row, 7)?,
    })
}

fn upsert_peer(conn: &Connection, p: &PeerRecord) -> StoreResult<()> {
    let old_keys = json(&p.old_keys)?;
    conn.prepare_cached(&format!(
        "INSERT INTO federation_peers ({PEER_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) \
         ON CONFLICT (gateway_id) DO UPDATE SET url = excluded.url, \
         public_key = excluded.public_key, key_id = excluded.key_id, \
         old_keys = excluded.old_keys, source = excluded.source, \
         verified_at = excluded.verified_at, updated_at = excluded.updated_at"
    ))
    .and_then(|mut st| {
        st.execute(params![
            p.gateway_id,
            p.url,
            p.public_key,
            p.key_id,
            old_keys,
            p.source.as_str(),
            ts(&p.verified_at),
            ts(&p.updated_at),
        ])
    })
    .map_err(db_err)?;
    Ok(())
}

fn peer(conn: &Connection, gateway_id: &str) -> StoreResult<Option<PeerRecord>> {
    conn.prepare_cached(&format!(
        "SELECT {PEER_COLS} FROM federation_peers WHERE gateway_id = ?1"
    ))
    .and_then(|mut st| st.query_row([gateway_id], peer_row).optional())
    .map_err(db_err)
}

fn peers(conn: &Connection) -> StoreResult<Vec<PeerRecord>> {
    conn.prepare_cached(&format!(
        "SELECT {PEER_COLS} FROM federation_peers ORDER BY gateway_id"
    ))
    .and_then(|mut st| st.query_map([], peer_row)?.collect())
    .map_err(db_err)
}

/// The primary key decides: of two inserts of one (issuer, jti), the second changes nothing.
fn insert_jti(
    conn: &Connection,
    issuer: &str,
    jti: &str,
    expires_at: &Timestamp,
) -> StoreResult<bool> {
    conn.prepare_cached(
        "INSERT INTO federation_jti (issuer, jti, expires_at) VALUES (?1, ?2, ?3) \
         ON CONFLICT (issuer, jti) DO NOTHING",
    )
    .and_then(|mut st| st.execute(params![issuer, jti, ts(expires_at)]))
    .map(|inserted| inserted == 1)
    .map_err(db_err)
}

fn next_announcement(
    conn: &Connection,
    bundle_cid: &str,
    now_ms: u64,
    expires_at: &Timestamp,
    now: &Timestamp,
) -> StoreResult<u64> {
    let floor = int(now_ms)?;
    conn.prepare_cached(
        "INSERT INTO announcements (bundle_cid, seq, expires_at, announced_at) \
         VALUES (?1, ?2, ?3, ?4) ON CONFLICT (bundle_cid) DO UPDATE SET \
         seq = MAX(announcements.seq + 1, excluded.seq), expires_at = excluded.expires_at, \
         announced_at = excluded.announced_at RETURNING seq",
    )
    .and_then(|mut st| {
        st.query_row(params![bundle_cid, floor, ts(expires_at), ts(now)], |r| {
            col_u64(r, 0)
        })
    })
    .map_err(db_err)
}

fn announcements_expiring_before(
    conn: &Connection,
    before: &Timestamp,
) -> StoreResult<Vec<Announcement>> {
    conn.prepare_cached(
        "SELECT bundle_cid, seq, expires_at, announced_at FROM announcements \
         WHERE expires_at < ?1 ORDER BY expires_at, bundle_cid",
    )
    .and_then(|mut st| {
        st.query_map([ts(before)], |r| {
            Ok(Announcement {
                bundle_cid: r.get(0)?,
                seq: col_u64(r, 1)?,
                expires_at: col_ts(r, 2)?,
                announced_at: col_ts(r, 3)?,
            })
        })?
        .collect()
    })
    .map_err(db_err)
}

const RECORD_COLS: &str = "gateway_id, bundle_cid, bundle_url, seq, issued_at, expires_at, record";

fn record_row(row: &Row<'_>) -> rusqlite::Result<RegistryRecordRow> {
    Ok(RegistryRecordRow {
        gateway_id: row.get(0)?,
        bundle_cid: row.get(1)?,
        bundle_url: row.get(2)?,
        seq: col_u64(row, 3)?,
        issued_at: col_ts(row, 4)?,
        expires_at: col_ts(row, 5)?,
        record: row.get(6)?,
    })
}

fn count_records(conn: &Connection, gateway_id: &str, now: &Timestamp) -> StoreResult<u64> {
    conn.prepare_cached(
        "SELECT COUNT(*) FROM registry_records WHERE gateway_id = ?1 AND expires_at > ?2",
    )
    .and_then(|mut st| st.query_row(params![gateway_id, ts(now)], |r| col_u64(r, 0)))
    .map_err(db_err)
}

/// The seq rule against the live record of the same gateway and CID, else the quota; the writer
/// runs one job at a time, so nothing changes between the reads and the write.
fn put_record(
    conn: &Connection,
    r: &RegistryRecordRow,
    max_per_gateway: u64,
    now: &Timestamp,
) -> StoreResult<PutRecord> {
    let seq = int(r.seq)?;
    let live: Option<(i64, String)> = conn
        .prepare_cached(
            "SELECT seq, record FROM registry_records \
             WHERE gateway_id = ?1 AND bundle_cid = ?2 AND expires_at > ?3",
        )
        .and_then(|mut st| {
            st.query_row(params![r.gateway_id, r.bundle_cid, ts(now)], |row| {
                Ok((row.get(0)?, row.get(1)?))
            })
            .optional()
        })
        .map_err(db_err)?;
    let outcome = match live {
        Some((stored, _)) if seq > stored => PutRecord::Replaced,
        Some((stored, bytes)) if seq == stored && bytes == r.record => {
            return Ok(PutRecord::Unchanged);
        }
        Some(_) => return Ok(PutRecord::Stale),
        // An expired record of this gateway and CID counts for nothing and is overwritten.
        None if count_records(conn, &r.gateway_id, now)? >= max_per_gateway => {
            return Ok(PutRecord::QuotaExceeded);
        }
        None => PutRecord::Inserted,
    };
    conn.prepare_cached(&format!(
        "INSERT INTO registry_records ({RECORD_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) \
         ON CONFLICT (gateway_id, bundle_cid) DO UPDATE SET bundle_url = excluded.bundle_url, \
         seq = excluded.seq, issued_at = excluded.issued_at, expires_at = excluded.expires_at, \
         record = excluded.record"
    ))
    .and_then(|mut st| {
        st.execute(params![
            r.gateway_id,
            r.bundle_cid,
            r.bundle_url,
            seq,
            ts(&r.issued_at),
            ts(&r.expires_at),
            r.record,
        ])
    })
    .map_err(db_err)?;
    Ok(outcome)
}

fn records_for(
    conn: &Connection,
    bundle_cid: &str,
    now: &Timestamp,
    limit: u32,
) -> StoreResult<Vec<RegistryRecordRow>> {
    conn.prepare_cached(&format!(
        "SELECT {RECORD_COLS} FROM registry_records WHERE bundle_cid = ?1 AND expires_at > ?2 \
         ORDER BY seq DESC, gateway_id LIMIT ?3"
    ))
    .and_then(|mut st| {
        st.query_map(params![bundle_cid, ts(now), i64::from(limit)], record_row)?
            .collect()
    })
    .map_err(db_err)
}

fn put_vouch(conn: &Connection, v: &VouchRow) -> StoreResult<()> {
    conn.prepare_cached(
        "INSERT INTO registry_gateways (gateway_id, gateway_url, public_key, key_id, verified_at) \
         VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (gateway_id) DO UPDATE SET \
         gateway_url = excluded.gateway_url, public_key = excluded.public_key, \
         key_id = excluded.key_id, verified_at = excluded.verified_at",
    )
    .and_then(|mut st| {
        st.execute(params![
            v.gateway_id,
            v.gateway_url,
            v.public_key,
            v.key_id,
            ts(&v.verified_at),
        ])
    })
    .map_err(db_err)?;
    Ok(())
}

fn vouch(conn: &Connection, gateway_id: &str) -> StoreResult<Option<VouchRow>> {
    conn.prepare_cached(
        "SELECT gateway_id, gateway_url, public_key, key_id, verified_at FROM registry_gateways \
         WHERE gateway_id = ?1",
    )
    .and_then(|mut st| {
        st.query_row([gateway_id], |r| {
            Ok(VouchRow {
                gateway_id: r.get(0)?,
                gateway_url: r.get(1)?,
                public_key: r.get(2)?,
                key_id: r.get(3)?,
                verified_at: col_ts(r, 4)?,
            })
        })
        .optional()
    })
    .map_err(db_err)
}

/// The federation part of a retention sweep, inside its write: rows whose own expiry is before
/// `sweep.expired_before`.
pub(crate) fn sweep(conn: &Connection, sweep: &Sweep, swept: &mut Swept) -> StoreResult<()> {
    let Some(before) = &sweep.expired_before else {
        return Ok(());
    };
    let before = ts(before);
    let delete = |sql: &str| -> StoreResult<u64> {
        conn.prepare_cached(sql)
            .and_then(|mut st| st.execute([&before]))
            .map(|n| n as u64)
            .map_err(db_err)
    };
    swept.jti = delete("DELETE FROM federation_jti WHERE expires_at < ?1")?;
    swept.registry_records = delete("DELETE FROM registry_records WHERE expires_at < ?1")?;
    swept.announcements = delete("DELETE FROM announcements WHERE expires_at < ?1")?;
    Ok(())
}

#[async_trait]
impl FederationStore for SqliteStore {
    async fn init_identity(
        &self,
        gateway_id: &str,
        first_key_id: &str,
        now: Timestamp,
    ) -> StoreResult<FederationIdentity> {
        let (gateway_id, first_key_id) = (gateway_id.to_owned(), first_key_id.to_owned());
        self.write(move |c, _| init_identity(c, &gateway_id, &first_key_id, &now))
            .await
    }

    async fn identity(&self) -> StoreResult<Option<FederationIdentity>> {
        self.read(|c, _| identity(c)).await
    }

    async fn upsert_peer(&self, peer: PeerRecord) -> StoreResult<()> {
        self.write(move |c, _| upsert_peer(c, &peer)).await
    }

    async fn peer(&self, gateway_id: &str) -> StoreResult<Option<PeerRecord>> {
        let gateway_id = gateway_id.to_owned();
        self.read(move |c, _| peer(c, &gateway_id)).await
    }

    async fn peers(&self) -> StoreResult<Vec<PeerRecord>> {
        self.read(|c, _| peers(c)).await
    }

    async fn insert_jti(
        &self,
        issuer: &str,
        jti: &str,
        expires_at: Timestamp,
    ) -> StoreResult<bool> {
        let (issuer, jti) = (issuer.to_owned(), jti.to_owned());
        self.write(move |c, _| insert_jti(c, &issuer, &jti, &expires_at))
            .await
    }

    async fn next_announcement(
        &self,
        bundle_cid: &str,
        now_ms: u64,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> StoreResult<u64> {
        let bundle_cid = bundle_cid.to_owned();
        self.write(move |c, _| next_announcement(c, &bundle_cid, now_ms, &expires_at, &now))
            .await
    }

    async fn announcements_expiring_before(
        &self,
        before: Timestamp,
    ) -> StoreResult<Vec<Announcement>> {
        self.read(move |c, _| announcements_expiring_before(c, &before))
            .await
    }
}

#[async_trait]
impl RegistryStore for SqliteStore {
    async fn put_record(
        &self,
        record: RegistryRecordRow,
        max_per_gateway: u64,
        now: Timestamp,
    ) -> StoreResult<PutRecord> {
        self.write(move |c, _| put_record(c, &record, max_per_gateway, &now))
            .await
    }

    async fn records_for(
        &self,
        bundle_cid: &str,
        now: Timestamp,
        limit: u32,
    ) -> StoreResult<Vec<RegistryRecordRow>> {
        let bundle_cid = bundle_cid.to_owned();
        self.read(move |c, _| records_for(c, &bundle_cid, &now, limit))
            .await
    }

    async fn count_records(&self, gateway_id: &str, now: Timestamp) -> StoreResult<u64> {
        let gateway_id = gateway_id.to_owned();
        self.read(move |c, _| count_records(c, &gateway_id, &now))
            .await
    }

    async fn put_vouch(&self, vouch: VouchRow) -> StoreResult<()> {
        self.write(move |c, _| put_vouch(c, &vouch)).await
    }

    async fn vouch(&self, gateway_id: &str) -> StoreResult<Option<VouchRow>> {
        let gateway_id = gateway_id.to_owned();
        self.read(move |c, _| vouch(c, &gateway_id)).await
    }
}
