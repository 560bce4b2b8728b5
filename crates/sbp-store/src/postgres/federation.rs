//! Gateway federation (L6) on PostgreSQL: the node's identity, trusted peers, the replay cache of
//! federation tokens, announcements and a tracker's registry. Each method is one statement
//! (committed on its own) or one transaction, so replicas sharing the database agree; nothing here
//! is sealed.

use async_trait::async_trait;
use deadpool_postgres::GenericClient;
use tokio_postgres::Row;

use super::PostgresStore;
use super::codec::{bad, col_u64, db_err, get, int, json, rows};
use super::ops::{Tx, prep};
use crate::{
    Announcement, FederationIdentity, FederationStore, PeerRecord, PeerSource, PutRecord,
    RegistryRecordRow, RegistryStore, StoreError, StoreResult, Sweep, Swept, Timestamp, VouchRow,
};

/// First key of the advisory lock that serialises `put_record` per gateway ("sbr" in ASCII); the
/// second is a hash of the gateway id.
const REGISTRY_LOCK_CLASS: i32 = 0x0073_6272;

fn identity_row(row: &Row) -> StoreResult<FederationIdentity> {
    Ok(FederationIdentity {
        gateway_id: get(row, 0)?,
        first_key_id: get(row, 1)?,
        created_at: get(row, 2)?,
    })
}

async fn identity(c: &impl GenericClient) -> StoreResult<Option<FederationIdentity>> {
    let st = prep(
        c,
        "SELECT gateway_id, first_key_id, created_at FROM federation_identity WHERE id = 1",
    )
    .await?;
    c.query_opt(&st, &[])
        .await
        .map_err(db_err)?
        .map(|r| identity_row(&r))
        .transpose()
}

/// Two statements in one transaction: an insert that a concurrent one makes wait and then do
/// nothing, and a read that (a statement of its own under READ COMMITTED) sees whichever
/// identity committed first.
async fn init_identity(
    tx: &Tx,
    gateway_id: &str,
    first_key_id: &str,
    now: &Timestamp,
) -> StoreResult<FederationIdentity> {
    let st = prep(
        tx,
        "INSERT INTO federation_identity (id, gateway_id, first_key_id, created_at) \
         VALUES (1, $1, $2, $3) ON CONFLICT (id) DO NOTHING",
    )
    .await?;
    tx.execute(&st, &[&gateway_id, &first_key_id, now])
        .await
        .map_err(db_err)?;
    identity(tx).await?.ok_or_else(|| {
        StoreError::Backend("federation identity missing right after its insert".to_owned())
    })
}

macro_rules! peer_cols {
    () => {
        "gateway_id, url, public_key, key_id, old_keys, source, verified_at, updated_at"
    };
}

fn peer_row(row: &Row) -> StoreResult<PeerRecord> {
    let old_keys: &str = get(row, 4)?;
    let source: &str = get(row, 5)?;
    Ok(PeerRecord {
        gateway_id: get(row, 0)?,
        url: get(row, 1)?,
        public_key: get(row, 2)?,
        key_id: get(row, 3)?,
        old_keys: serde_json::from_str(old_keys).map_err(|e| bad(4, format!("json: {e}")))?,
        source: PeerSource::parse(source)
            .ok_or_else(|| bad(5, format!("peer source {source:?}")))?,
        verified_at: get(row, 6)?,
        updated_at: get(row, 7)?,
    })
}

async fn upsert_peer(c: &impl GenericClient, p: &PeerRecord) -> StoreResult<()> {
    let st = prep(
        c,
        concat!(
            "INSERT INTO federation_peers (",
            peer_cols!(),
            ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
             ON CONFLICT (gateway_id) DO UPDATE SET url = excluded.url, \
             public_key = excluded.public_key, key_id = excluded.key_id, \
             old_keys = excluded.old_keys, source = excluded.source, \
             verified_at = excluded.verified_at, updated_at = excluded.updated_at"
        ),
    )
    .await?;
    let old_keys = json(&p.old_keys)?;
    c.execute(
        &st,
        &[
            &p.gateway_id,
            &p.url,
            &p.public_key,
            &p.key_id,
            &old_keys,
            &p.source.as_str(),
            &p.verified_at,
            &p.updated_at,
        ],
    )
    .await
    .map_err(db_err)?;
    Ok(())
}

async fn peer(c: &impl GenericClient, gateway_id: &str) -> StoreResult<Option<PeerRecord>> {
    let st = prep(
        c,
        concat!(
            "SELECT ",
            peer_cols!(),
            " FROM federation_peers WHERE gateway_id = $1"
        ),
    )
    .await?;
    c.query_opt(&st, &[&gateway_id])
        .await
        .map_err(db_err)?
        .map(|r| peer_row(&r))
        .transpose()
}

async fn peers(c: &impl GenericClient) -> StoreResult<Vec<PeerRecord>> {
    let st = prep(
        c,
        concat!(
            "SELECT ",
            peer_cols!(),
            " FROM federation_peers ORDER BY gateway_id"
        ),
    )
    .await?;
    rows(&c.query(&st, &[]).await.map_err(db_err)?, peer_row)
}

/// The primary key decides: of concurrent inserts of one (issuer, jti), whichever commits first
/// inserts and the others (waiting for it) change nothing.
async fn insert_jti(
    c: &impl GenericClient,
    issuer: &str,
    jti: &str,
    expires_at: &Timestamp,
) -> StoreResult<bool> {
    let st = prep(
        c,
        "INSERT INTO federation_jti (issuer, jti, expires_at) VALUES ($1, $2, $3) \
         ON CONFLICT (issuer, jti) DO NOTHING",
    )
    .await?;
    let inserted = c
        .execute(&st, &[&issuer, &jti, expires_at])
        .await
        .map_err(db_err)?;
    Ok(inserted == 1)
}

/// One statement: the upsert locks the announcement's row, so concurrent calls for one CID each
/// get a seq above the one before.
async fn next_announcement(
    c: &impl GenericClient,
    bundle_cid: &str,
    now_ms: u64,
    expires_at: &Timestamp,
    now: &Timestamp,
) -> StoreResult<u64> {
    let st = prep(
        c,
        "INSERT INTO announcements (bundle_cid, seq, expires_at, announced_at) \
         VALUES ($1, $2, $3, $4) ON CONFLICT (bundle_cid) DO UPDATE SET \
         seq = GREATEST(announcements.seq + 1, excluded.seq), expires_at = excluded.expires_at, \
         announced_at = excluded.announced_at RETURNING seq",
    )
    .await?;
    let floor = int(now_ms)?;
    let row = c
        .query_one(&st, &[&bundle_cid, &floor, expires_at, now])
        .await
        .map_err(db_err)?;
    col_u64(&row, 0)
}

async fn announcements_expiring_before(
    c: &impl GenericClient,
    before: &Timestamp,
) -> StoreResult<Vec<Announcement>> {
    let st = prep(
        c,
        "SELECT bundle_cid, seq, expires_at, announced_at FROM announcements \
         WHERE expires_at < $1 ORDER BY expires_at, bundle_cid",
    )
    .await?;
    let found = c.query(&st, &[before]).await.map_err(db_err)?;
    rows(&found, |r| {
        Ok(Announcement {
            bundle_cid: get(r, 0)?,
            seq: col_u64(r, 1)?,
            expires_at: get(r, 2)?,
            announced_at: get(r, 3)?,
        })
    })
}

macro_rules! record_cols {
    () => {
        "gateway_id, bundle_cid, bundle_url, seq, issued_at, expires_at, record"
    };
}

fn record_row(row: &Row) -> StoreResult<RegistryRecordRow> {
    Ok(RegistryRecordRow {
        gateway_id: get(row, 0)?,
        bundle_cid: get(row, 1)?,
        bundle_url: get(row, 2)?,
        seq: col_u64(row, 3)?,
        issued_at: get(row, 4)?,
        expires_at: get(row, 5)?,
        record: get(row, 6)?,
    })
}

async fn count_records(
    c: &impl GenericClient,
    gateway_id: &str,
    now: &Timestamp,
) -> StoreResult<u64> {
    let st = prep(
        c,
        "SELECT COUNT(*) FROM registry_records WHERE gateway_id = $1 AND expires_at > $2",
    )
    .await?;
    let row = c
        .query_one(&st, &[&gateway_id, now])
        .await
        .map_err(db_err)?;
    col_u64(&row, 0)
}

/// In one transaction under the gateway's advisory lock, so concurrent announces of one gateway
/// (of new CIDs too, which no row lock would cover) take turns: the quota cannot be overrun and
/// the seq rule sees the record the one before wrote.
async fn put_record(
    tx: &Tx,
    r: &RegistryRecordRow,
    max_per_gateway: u64,
    now: &Timestamp,
) -> StoreResult<PutRecord> {
    let lock = prep(tx, "SELECT pg_advisory_xact_lock($1, hashtext($2))").await?;
    tx.execute(&lock, &[&REGISTRY_LOCK_CLASS, &r.gateway_id])
        .await
        .map_err(db_err)?;
    let seq = int(r.seq)?;
    let st = prep(
        tx,
        "SELECT seq, record FROM registry_records \
         WHERE gateway_id = $1 AND bundle_cid = $2 AND expires_at > $3",
    )
    .await?;
    let live = tx
        .query_opt(&st, &[&r.gateway_id, &r.bundle_cid, now])
        .await
        .map_err(db_err)?;
    let outcome = match live {
        Some(row) => {
            let stored: i64 = get(&row, 0)?;
            let bytes: &str = get(&row, 1)?;
            if seq > stored {
                PutRecord::Replaced
            } else if seq == stored && bytes == r.record {
                return Ok(PutRecord::Unchanged);
            } else {
                return Ok(PutRecord::Stale);
            }
        }
        // An expired record of this gateway and CID counts for nothing and is overwritten.
        None if count_records(tx, &r.gateway_id, now).await? >= max_per_gateway => {
            return Ok(PutRecord::QuotaExceeded);
        }
        None => PutRecord::Inserted,
    };
    let st = prep(
        tx,
        concat!(
            "INSERT INTO registry_records (",
            record_cols!(),
            ") VALUES ($1, $2, $3, $4, $5, $6, $7) \
             ON CONFLICT (gateway_id, bundle_cid) DO UPDATE SET bundle_url = excluded.bundle_url, \
             seq = excluded.seq, issued_at = excluded.issued_at, expires_at = excluded.expires_at, \
             record = excluded.record"
        ),
    )
    .await?;
    tx.execute(
        &st,
        &[
            &r.gateway_id,
            &r.bundle_cid,
            &r.bundle_url,
            &seq,
            &r.issued_at,
            &r.expires_at,
            &r.record,
        ],
    )
    .await
    .map_err(db_err)?;
    Ok(outcome)
}

async fn records_for(
    c: &impl GenericClient,
    bundle_cid: &str,
    now: &Timestamp,
    limit: u32,
) -> StoreResult<Vec<RegistryRecordRow>> {
    let st = prep(
        c,
        concat!(
            "SELECT ",
            record_cols!(),
            " FROM registry_records WHERE bundle_cid = $1 AND expires_at > $2 \
             ORDER BY seq DESC, gateway_id LIMIT $3"
        ),
    )
    .await?;
    let found = c
        .query(&st, &[&bundle_cid, now, &i64::from(limit)])
        .await
        .map_err(db_err)?;
    rows(&found, record_row)
}

async fn put_vouch(c: &impl GenericClient, v: &VouchRow) -> StoreResult<()> {
    let st = prep(
        c,
        "INSERT INTO registry_gateways (gateway_id, gateway_url, public_key, key_id, verified_at) \
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (gateway_id) DO UPDATE SET \
         gateway_url = excluded.gateway_url, public_key = excluded.public_key, \
         key_id = excluded.key_id, verified_at = excluded.verified_at",
    )
    .await?;
    c.execute(
        &st,
        &[
            &v.gateway_id,
            &v.gateway_url,
            &v.public_key,
            &v.key_id,
            &v.verified_at,
        ],
    )
    .await
    .map_err(db_err)?;
    Ok(())
}

async fn vouch(c: &impl GenericClient, gateway_id: &str) -> StoreResult<Option<VouchRow>> {
    let st = prep(
        c,
        "SELECT gateway_id, gateway_url, public_key, key_id, verified_at FROM registry_gateways \
         WHERE gateway_id = $1",
    )
    .await?;
    c.query_opt(&st, &[&gateway_id])
        .await
        .map_err(db_err)?
        .map(|r| {
            Ok(VouchRow {
                gateway_id: get(&r, 0)?,
                gateway_url: get(&r, 1)?,
                public_key: get(&r, 2)?,
                key_id: get(&r, 3)?,
                verified_at: get(&r, 4)?,
            })
        })
        .transpose()
}

/// The federation part of a retention sweep, inside its transaction: rows whose own expiry is
/// before `sweep.expired_before`.
pub(crate) async fn sweep(tx: &Tx, sweep: &Sweep, swept: &mut Swept) -> StoreResult<()> {
    let Some(before) = &sweep.expired_before else {
        return Ok(());
    };
    swept.jti = delete_expired(tx, "federation_jti", before).await?;
    swept.registry_records = delete_expired(tx, "registry_records", before).await?;
    swept.announcements = delete_expired(tx, "announcements", before).await?;
    Ok(())
}

async fn delete_expired(tx: &Tx, table: &str, before: &Timestamp) -> StoreResult<u64> {
    let st = prep(tx, &format!("DELETE FROM {table} WHERE expires_at < $1")).await?;
    tx.execute(&st, &[before]).await.map_err(db_err)
}

#[async_trait]
impl FederationStore for PostgresStore {
    async fn init_identity(
        &self,
        gateway_id: &str,
        first_key_id: &str,
        now: Timestamp,
    ) -> StoreResult<FederationIdentity> {
        let (gateway_id, first_key_id) = (gateway_id.to_owned(), first_key_id.to_owned());
        self.write(move |tx| {
            Box::pin(async move { init_identity(tx, &gateway_id, &first_key_id, &now).await })
        })
        .await
    }

    async fn identity(&self) -> StoreResult<Option<FederationIdentity>> {
        identity(&self.client().await?).await
    }

    async fn upsert_peer(&self, peer: PeerRecord) -> StoreResult<()> {
        upsert_peer(&self.client().await?, &peer).await
    }

    async fn peer(&self, gateway_id: &str) -> StoreResult<Option<PeerRecord>> {
        peer(&self.client().await?, gateway_id).await
    }

    async fn peers(&self) -> StoreResult<Vec<PeerRecord>> {
        peers(&self.client().await?).await
    }

    async fn insert_jti(
        &self,
        issuer: &str,
        jti: &str,
        expires_at: Timestamp,
    ) -> StoreResult<bool> {
        insert_jti(&self.client().await?, issuer, jti, &expires_at).await
    }

    async fn next_announcement(
        &self,
        bundle_cid: &str,
        now_ms: u64,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> StoreResult<u64> {
        next_announcement(&self.client().await?, bundle_cid, now_ms, &expires_at, &now).await
    }

    async fn announcements_expiring_before(
        &self,
        before: Timestamp,
    ) -> StoreResult<Vec<Announcement>> {
        announcements_expiring_before(&self.client().await?, &before).await
    }
}

#[async_trait]
impl RegistryStore for PostgresStore {
    async fn put_record(
        &self,
        record: RegistryRecordRow,
        max_per_gateway: u64,
        now: Timestamp,
    ) -> StoreResult<PutRecord> {
        self.write(move |tx| {
            Box::pin(async move { put_record(tx, &record, max_per_gateway, &now).await })
        })
        .await
    }

    async fn records_for(
        &self,
        bundle_cid: &str,
        now: Timestamp,
        limit: u32,
    ) -> StoreResult<Vec<RegistryRecordRow>> {
        records_for(&self.client().await?, bundle_cid, &now, limit).await
    }

    async fn count_records(&self, gateway_id: &str, now: Timestamp) -> StoreResult<u64> {
        count_records(&self.client().await?, gateway_id, &now).await
    }

    async fn put_vouch(&self, vouch: VouchRow) -> StoreResult<()> {
        put_vouch(&self.client().await?, &vouch).await
    }

    async fn vouch(&self, gateway_id: &str) -> StoreResult<Option<VouchRow>> {
        vouch(&self.client().await?, gateway_id).await
    }
}
