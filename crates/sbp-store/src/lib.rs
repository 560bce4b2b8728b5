//! Storage for the SBP gateway: a set of traits (sessions, messages, snapshots, tether, turns,
//! idempotency, roaming, retention, federation, session holds and a tracker's registry) and one
//! implementation per backend. The engine makes every id and timestamp; a store saves what it is
//! given and performs each unit of work (`begin_turn`, `finish_turn`, ...) atomically.

mod codec;
pub mod federation;
pub mod postgres;
pub mod records;
pub mod redis_tether;
pub mod roaming;
pub mod seal;
pub mod sqlite;

pub use federation::*;
pub use records::*;
pub use roaming::*;

use async_trait::async_trait;
use sbp_protocol::{SessionStatus, SnapshotKind};
use uuid::Uuid;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StoreError {
    #[error("not found")]
    NotFound,
    /// The operation conflicts with stored state.
    #[error("conflict: {0}")]
    Conflict(ConflictKind),
    /// A roaming export was already consumed by another import.
    #[error("export already consumed")]
    Consumed,
    #[error("storage backend error: {0}")]
    Backend(String),
    /// Encryption at rest: a value that does not open, or (at open) a keyring that does not fit
    /// the database.
    #[error("encryption at rest: {0}")]
    Sealing(seal::SealError),
}

// Not `#[from]`: that would make the error its own source, and every report would say it twice.
impl From<seal::SealError> for StoreError {
    fn from(e: seal::SealError) -> Self {
        Self::Sealing(e)
    }
}

/// What a write conflicted with. The texts are what a caller may be shown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConflictKind {
    /// A record with this key exists already (a unique or primary key); the backend's words.
    #[error("{0}")]
    Duplicate(String),
    /// The Idempotency-Key is claimed already (a request in progress or done).
    #[error("idempotency key exists")]
    IdempotencyKeyClaimed,
    /// A retry names a key that is not a failed request of this session.
    #[error("idempotency key is not a failed request of this session")]
    IdempotencyKeyNotRetryable,
    /// A turn finishes under a key its session did not claim.
    #[error("idempotency key was not claimed by this session")]
    IdempotencyKeyNotHeld,
    /// The session's status does not allow the change.
    #[error("session status cannot change from {from} to {to}")]
    Transition {
        from: SessionStatus,
        to: SessionStatus,
    },
    /// Another write changed the session's status in between.
    #[error("session status changed concurrently to {0}")]
    StatusChanged(SessionStatus),
    /// The turn is not running in this session (failed by recovery, or another session's).
    #[error("turn is not running in this session")]
    TurnNotRunning,
    #[error("turn already finished")]
    TurnFinished,
    /// The write's own parts disagree (a caller bug).
    #[error("begin_turn: create.id differs from session_id")]
    CreatedIdDiffers,
    /// A turn of the session is running: it cannot move now.
    #[error("a turn of this session is running")]
    SessionBusy,
    /// The session is being handed over to another gateway (or adopted from one).
    #[error("this session is moving to another gateway")]
    SessionMoving,
    /// The session moved to another gateway, which holds it now.
    #[error("this session has moved to another gateway")]
    SessionMoved,
    /// The handover's lease expired, or the session is leased to another migration or gateway.
    #[error("the handover lease expired or belongs to another migration")]
    LeaseExpired,
}

impl ConflictKind {
    /// Whether the conflict is about an Idempotency-Key.
    pub fn is_idempotency(&self) -> bool {
        matches!(
            self,
            Self::IdempotencyKeyClaimed
                | Self::IdempotencyKeyNotRetryable
                | Self::IdempotencyKeyNotHeld
        )
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

#[async_trait]
pub trait SessionStore: Send + Sync {
    async fn create_session(&self, session: NewSession) -> StoreResult<()>;
    async fn get_session(&self, id: Uuid) -> StoreResult<Option<SessionRecord>>;
    async fn find_session_by_token(&self, token_hash: &str) -> StoreResult<Option<SessionRecord>>;
    /// The most recently updated `suspended` session of an agent.
    async fn latest_suspended_for_agent(
        &self,
        agent_id: &str,
    ) -> StoreResult<Option<SessionRecord>>;
    /// Changes the status when `SessionStatus::can_transition` allows it; returns the previous status.
    /// A forbidden change is `Conflict` and changes nothing.
    async fn update_status(
        &self,
        id: Uuid,
        to: SessionStatus,
        now: Timestamp,
    ) -> StoreResult<SessionStatus>;
    /// Marks the session as having had a surface: from now on undelivered turns are tethered.
    /// Optionally moves `suspended` -> `running` in the same write (a surface attached).
    async fn mark_attached(&self, id: Uuid, now: Timestamp) -> StoreResult<SessionRecord>;
    /// `running` -> `suspended` in one write (the surface left); any other status is left alone.
    /// Whether the session was running.
    async fn suspend_if_running(&self, id: Uuid, now: Timestamp) -> StoreResult<bool>;
    async fn count_sessions_by_status(&self) -> StoreResult<Vec<(SessionStatus, u64)>>;
    /// A page of sessions as `query` says, at most `query.limit`.
    async fn list_sessions(&self, query: SessionQuery) -> StoreResult<Vec<SessionRecord>>;
    /// Erases the session and everything that holds its content, in one write: its messages,
    /// snapshots, tether entries (a Redis tether's stream too), turns, idempotency records (with
    /// their response bodies), memory and hold; its exports, and the bundles of those exports and
    /// the ones that came in with it (an import's or a move's) that no other export or session
    /// refers to, with their announcements. The lineage links of the session keep only their ids
    /// (label and reason are cleared), and a foreign export it consumed stays as the record of
    /// the token's single use, without its label. `NotFound` without the session;
    /// `Conflict(SessionMoving)` while a handover leases it (unexpired) or it is arriving; a copy
    /// left behind by a move away is erased. A turn of the session still running finds no session
    /// when it writes again, so nothing of it is written after the erasure.
    async fn delete_session(&self, id: Uuid, now: Timestamp) -> StoreResult<()>;
}

#[async_trait]
pub trait MessageStore: Send + Sync {
    /// Messages with `seq > after` (all when `after` is None), oldest first, at most `limit`.
    async fn list_messages(
        &self,
        session_id: Uuid,
        after: Option<u64>,
        limit: u32,
    ) -> StoreResult<Vec<MessageRecord>>;
    /// The whole transcript, oldest first.
    async fn history(&self, session_id: Uuid) -> StoreResult<Vec<MessageRecord>>;
}

#[async_trait]
pub trait SnapshotStore: Send + Sync {
    /// The latest snapshot, of one kind or of any kind.
    async fn latest_snapshot(
        &self,
        session_id: Uuid,
        kind: Option<SnapshotKind>,
    ) -> StoreResult<Option<SnapshotRecord>>;
    async fn get_snapshot(&self, id: Uuid) -> StoreResult<Option<SnapshotRecord>>;
    async fn list_snapshots(
        &self,
        session_id: Uuid,
        limit: u32,
    ) -> StoreResult<Vec<SnapshotRecord>>;
}

#[async_trait]
pub trait TetherStore: Send + Sync {
    /// Undelivered turns with `seq > after`, oldest first, at most `limit`.
    async fn tether_pending(
        &self,
        session_id: Uuid,
        after: Option<u64>,
        limit: u32,
    ) -> StoreResult<Vec<TetherEntry>>;
    async fn tether_count(&self, session_id: Uuid) -> StoreResult<u64>;
    /// The highest seq ever issued to the session (0: none yet; `NotFound` without the session). A
    /// surface's position beyond it did not come from this session's history.
    async fn tether_issued(&self, session_id: Uuid) -> StoreResult<u64>;
    /// Removes every entry with `seq <= up_to`; returns how many were removed.
    async fn tether_ack(&self, session_id: Uuid, up_to: u64) -> StoreResult<u64>;
    /// Removes the listed entries (delivered to a surface that does not ACK).
    async fn tether_remove(&self, session_id: Uuid, seqs: &[u64]) -> StoreResult<u64>;
    async fn tether_depth_total(&self) -> StoreResult<u64>;
    /// Records that a Redis tether with this key prefix seals under the store's keyring, so a
    /// reseal without it keeps the earlier keys. Backends without a key record ignore it.
    async fn record_sealing_tether(&self, _prefix: &str) -> StoreResult<()> {
        Ok(())
    }
}

/// The atomic units of work of a turn.
#[async_trait]
pub trait TurnStore: Send + Sync {
    /// Creates the session when `create` is set, records the turn as running, appends the new messages,
    /// applies the status/last_task changes, writes the pre_action snapshot and claims the idempotency
    /// key: all or nothing. A claimed key is `Conflict`. Hands the new messages back as given (the
    /// engine sends them upstream and keeps no copy meanwhile; a new session's cached transcript is
    /// built from them).
    async fn begin_turn(&self, begin: BeginTurn) -> StoreResult<BeginTurnOutcome>;
    /// Appends the reply (or a pushed turn), counts the step, writes snapshots, enqueues the tether
    /// entry and completes the turn and its idempotency record: all or nothing.
    async fn finish_turn(&self, finish: FinishTurn) -> StoreResult<FinishTurnOutcome>;
    /// Appends messages and writes snapshots for a turn that is still running (`Conflict` if it is
    /// not): all or nothing. The agent loop records each tool round with it.
    async fn record_progress(&self, progress: TurnProgress) -> StoreResult<TurnProgressOutcome>;
    /// Marks the turn failed (the messages of `begin_turn` stay) and the idempotency record retryable.
    async fn fail_turn(&self, fail: FailTurn) -> StoreResult<()>;
    /// After a restart: every turn still `running` is marked failed. Returns the affected turns.
    /// Only for a gateway that is the store's sole user: with replicas, use
    /// [`TurnStore::recover_orphaned_turns`], which leaves the turns of live replicas alone.
    async fn recover_interrupted_turns(&self, now: Timestamp) -> StoreResult<Vec<TurnRecord>>;
    /// Records that `replica` is alive at `now` (creates its row, or moves its `heartbeat_at`).
    async fn replica_heartbeat(&self, replica: &str, now: Timestamp) -> StoreResult<()>;
    /// Fails, like [`TurnStore::recover_interrupted_turns`] (same error text, idempotency keys made
    /// retryable), every `running` turn whose owner is `None`, has never heartbeated, or last
    /// heartbeated before `stale_before`; turns of replicas with a later heartbeat are untouched.
    /// Also forgets the replicas that last heartbeated before `stale_before` and own no running
    /// turn any more. One transaction; returns the failed turns.
    async fn recover_orphaned_turns(
        &self,
        now: Timestamp,
        stale_before: Timestamp,
    ) -> StoreResult<Vec<TurnRecord>>;
    async fn get_turn(&self, turn_id: Uuid) -> StoreResult<Option<TurnRecord>>;
}

#[async_trait]
pub trait IdempotencyStore: Send + Sync {
    async fn get_idempotency(&self, key: &str) -> StoreResult<Option<IdempotencyRecord>>;
}

/// L3 roaming: bundles by CID, exports, sessions adopted with a history, lineage, session memory.
#[async_trait]
pub trait RoamingStore: Send + Sync {
    /// Stores the bundle (kept when its CID is already there) and the export row in one write;
    /// `NotFound` when the exported session is not (or no longer) stored here.
    async fn create_export(&self, export: NewExport, bundle: NewBundle) -> StoreResult<()>;
    async fn get_export(&self, id: Uuid) -> StoreResult<Option<ExportRecord>>;
    /// The bundle's bytes exactly as stored.
    async fn get_bundle(&self, cid: &str) -> StoreResult<Option<Vec<u8>>>;
    /// A peer gateway redeems the token of export `id` (federation): consumed now and recorded as
    /// redeemed by `by`, unless it was consumed already; a repeat by the same peer after
    /// `retry_after` (a retry after a lost answer) is `AlreadyByThisPeer`. `NotFound` when no
    /// such export exists.
    async fn redeem_export(
        &self,
        id: Uuid,
        by: &str,
        now: Timestamp,
        retry_after: Timestamp,
    ) -> StoreResult<RedeemOutcome>;
    /// Creates a session with its history and records its provenance: all or nothing (see
    /// [`AdoptSession`]). The single-use check of `consume_export` happens inside this write, so of
    /// many concurrent imports of one token exactly one succeeds.
    async fn adopt_session(&self, adopt: AdoptSession) -> StoreResult<AdoptOutcome>;
    async fn lineage(&self, session_id: Uuid) -> StoreResult<Lineage>;
    async fn get_memory(&self, session_id: Uuid) -> StoreResult<Option<MemoryRecord>>;
    /// Replaces the session's memory document; `NotFound` without the session.
    async fn put_memory(
        &self,
        session_id: Uuid,
        schema_id: String,
        payload: serde_json::Value,
        now: Timestamp,
    ) -> StoreResult<MemoryRecord>;
}

/// What a retention sweep removes: each cut-off is "older than this", `None` keeps everything.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Sweep {
    /// Exports that expired, or were consumed by a single-use import, before it (their tokens
    /// cannot import any more); then the bundles no export refers to that were stored before it.
    pub exports_before: Option<Timestamp>,
    /// Snapshots written before it, except each session's latest (what a recovery resumes from).
    pub snapshots_before: Option<Timestamp>,
    /// Rows that carry their own expiry and serve no one after it: federation tokens in the replay
    /// cache, a tracker's registry records and a gateway's announcements, whose `expires_at` is
    /// before it (the caller gives its "now").
    pub expired_before: Option<Timestamp>,
}

/// What a sweep removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Swept {
    pub exports: u64,
    pub bundles: u64,
    pub snapshots: u64,
    /// Federation tokens (`jti`) of the replay cache.
    pub jti: u64,
    pub registry_records: u64,
    pub announcements: u64,
}

/// Retention: removing what no longer serves anyone, on the operator's schedule.
#[async_trait]
pub trait RetentionStore: Send + Sync {
    /// One sweep, in one write.
    async fn sweep(&self, sweep: Sweep) -> StoreResult<Swept>;
}

/// L6 gateway federation, the gateway's side: its identity, its trusted peers, the replay cache of
/// federation tokens and its announcements. Shared by the replicas of a deployment.
#[async_trait]
pub trait FederationStore: Send + Sync {
    /// Records the node's identity once; a second call with other values changes nothing and
    /// returns what is stored (the first key's id is the gateway id for ever; replicas race safely).
    async fn init_identity(
        &self,
        gateway_id: &str,
        first_key_id: &str,
        now: Timestamp,
    ) -> StoreResult<FederationIdentity>;
    async fn identity(&self) -> StoreResult<Option<FederationIdentity>>;
    /// Inserts the peer, or replaces every field of the one with its `gateway_id`.
    async fn upsert_peer(&self, peer: PeerRecord) -> StoreResult<()>;
    async fn peer(&self, gateway_id: &str) -> StoreResult<Option<PeerRecord>>;
    /// Every peer, by `gateway_id`.
    async fn peers(&self) -> StoreResult<Vec<PeerRecord>>;
    /// The replay cache: true when (issuer, jti) was not seen (and is now stored until
    /// expires_at), false when it was. Atomic across replicas and restarts. A row refuses its jti
    /// until a sweep removes it (after `expires_at`).
    async fn insert_jti(&self, issuer: &str, jti: &str, expires_at: Timestamp)
    -> StoreResult<bool>;
    /// Next seq for announcing `bundle_cid`: max(last + 1, now_ms), stored with its expiry,
    /// atomically.
    async fn next_announcement(
        &self,
        bundle_cid: &str,
        now_ms: u64,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> StoreResult<u64>;
    /// The announcements whose `expires_at` is before `before` (expired ones too), soonest first.
    async fn announcements_expiring_before(
        &self,
        before: Timestamp,
    ) -> StoreResult<Vec<Announcement>>;
}

/// L6 tracker: the providers' signed records by CID and what the tracker verified about each
/// gateway. A record is live while `now < expires_at`; an expired one is never returned, does not
/// count, and is treated as absent by [`RegistryStore::put_record`].
#[async_trait]
pub trait RegistryStore: Send + Sync {
    /// Higher seq replaces; equal seq with identical `record` bytes → Unchanged; equal seq with
    /// other bytes or lower seq → Stale; a new (gateway, cid) when the gateway already has
    /// `max_per_gateway` unexpired records → QuotaExceeded. One transaction.
    async fn put_record(
        &self,
        record: RegistryRecordRow,
        max_per_gateway: u64,
        now: Timestamp,
    ) -> StoreResult<PutRecord>;
    /// Unexpired records for a CID, newest seq first, at most `limit`.
    async fn records_for(
        &self,
        bundle_cid: &str,
        now: Timestamp,
        limit: u32,
    ) -> StoreResult<Vec<RegistryRecordRow>>;
    /// The gateway's unexpired records.
    async fn count_records(&self, gateway_id: &str, now: Timestamp) -> StoreResult<u64>;
    /// Inserts the vouch, or replaces the one with its `gateway_id`.
    async fn put_vouch(&self, vouch: VouchRow) -> StoreResult<()>;
    async fn vouch(&self, gateway_id: &str) -> StoreResult<Option<VouchRow>>;
}

/// L6 sessions that follow their surface: where a session is held, and the writes that move it
/// from one gateway (the origin: lease, then commit) to another (the target: adopt, then finish).
/// Each method is one transaction. While a session is leased (unexpired), adopted but unfinished,
/// or moved away, `begin_turn` and a pushed turn's `finish_turn` refuse it inside their own write
/// (`Conflict(SessionMoving)`, `Conflict(SessionMoved)`).
#[async_trait]
pub trait HoldStore: Send + Sync {
    /// The hold as stored (no row: `None`, which is home at epoch 0). An expired lease is
    /// reported as stored; callers compare `lease_expires_at` with their now.
    async fn hold(&self, session_id: Uuid) -> StoreResult<Option<HoldRow>>;
    /// Origin side: leases the session to `to_gateway` for a handover, `epoch + 1`. Refused with
    /// `Conflict(SessionBusy)` while a turn of the session is running, `Conflict(SessionMoving)`
    /// while another unexpired lease holds it (or an adoption here is unfinished),
    /// `Conflict(SessionMoved)` when it moved away; `NotFound` without the session. The same
    /// migration id and gateway again while its lease runs (a retry) returns that lease
    /// unchanged. An expired lease, or a session at home, is leased.
    async fn lease_handover(&self, req: LeaseRequest) -> StoreResult<HoldRow>;
    /// Origin side: the unexpired lease of this migration to `by_gateway` becomes `moved` (peer:
    /// the new holder), the session's tether entries are deleted (the new holder has them) and a
    /// lineage link `migrated_to` (id: the migration id; `from_session` = `to_session` = the
    /// session; `peer_gateway` = the new holder) is written. Once moved by this migration, a
    /// repeat returns the row. `Conflict(LeaseExpired)` when the lease expired or is another
    /// migration's or gateway's; `NotFound` without the session.
    async fn commit_handover(
        &self,
        session_id: Uuid,
        migration_id: Uuid,
        by_gateway: &str,
        now: Timestamp,
    ) -> StoreResult<HoldRow>;
    /// Leases that expired at or before `now` return to home (epoch kept); how many.
    async fn expire_leases(&self, now: Timestamp) -> StoreResult<u64>;
    /// Origin side: the lease of `migration_id` to `by_gateway`, still running, ends now (the
    /// gateway taking the session gave up: the session is home again, epoch kept). False when
    /// no such lease holds it (committed, expired, another migration's).
    async fn release_lease(
        &self,
        session_id: Uuid,
        migration_id: Uuid,
        by_gateway: &str,
        now: Timestamp,
    ) -> StoreResult<bool>;
    /// Target side: creates the session with the origin's id and `token_hash`, its messages,
    /// snapshot, memory and bundle as [`RoamingStore::adopt_session`] does, the tether entries
    /// under their seqs, the next tether seq `tether_next_seq` (or past the highest carried seq),
    /// and the hold `incoming` (epoch, peer = the origin, migration id). A session of this id that
    /// is held here as `moved` (a stale copy of an earlier visit) is deleted with everything of it
    /// first; any other is `Conflict(Duplicate)`.
    async fn adopt_migrated(&self, m: AdoptMigrated) -> StoreResult<SessionRecord>;
    /// Target side, once the origin committed (`ok`) or the move failed (`!ok`). `ok`: the
    /// `incoming` hold of this migration goes home (epoch and migration id kept, peer cleared) and
    /// a lineage link `migrated_from` (id: the migration id; `peer_gateway` = the origin) is
    /// written; already home after this migration: nothing to do; `Conflict(LeaseExpired)` when
    /// the hold is about another migration, `NotFound` without the session. `!ok`: the session
    /// is deleted with everything of it, only if its hold is `incoming` with this migration id;
    /// otherwise nothing happens.
    async fn finish_incoming(
        &self,
        session_id: Uuid,
        migration_id: Uuid,
        ok: bool,
        now: Timestamp,
    ) -> StoreResult<()>;
    /// Every hold in state `incoming` (to resolve at start: a crash between adopt and commit),
    /// oldest first.
    async fn incoming_holds(&self) -> StoreResult<Vec<HoldRow>>;
}

/// Everything the engine needs from a backend.
pub trait Store:
    SessionStore
    + MessageStore
    + SnapshotStore
    + TetherStore
    + TurnStore
    + IdempotencyStore
    + RoamingStore
    + RetentionStore
    + FederationStore
    + RegistryStore
    + HoldStore
{
}
impl<T> Store for T where
    T: SessionStore
        + MessageStore
        + SnapshotStore
        + TetherStore
        + TurnStore
        + IdempotencyStore
        + RoamingStore
        + RetentionStore
        + FederationStore
        + RegistryStore
        + HoldStore
{
}
