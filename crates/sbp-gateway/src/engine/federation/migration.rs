//! A session follows its surface: when a surface attaches here with the id and token of a
//! session another gateway holds, this gateway takes it over before answering, with the same id
//! and token, its whole history and its pending Tether turns under their seqs.
//!
//! Origin side (the holder): `locate` says whether it holds the session; `grant_handover` checks
//! the surface's token, leases the session to the asking gateway (epoch + 1, turns refused while
//! the lease runs), stores its bundle and answers a signed envelope; `commit_handover` marks it
//! moved (the lease's gateway only), after which it answers where the session went.
//!
//! Target side: `pull_session` locates the holder among the peers, asks for the handover,
//! fetches the bundle by the envelope's CID (recomputed), adopts it, commits, and only then lets
//! the attach continue; all of it before the attach deadline. A commit whose outcome is unknown
//! leaves the adopted copy `incoming`, resolved by retrying the commit (idempotent) later.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sbp_protocol::ErrorCode;
use sbp_protocol::federation::{
    HandoverCommit, HandoverEnvelope, HandoverTetherEntry, verify_object,
};
use sbp_store::{HoldState, LeaseRequest, TetherEntry};
use serde_json::{Map, Value, json};
use uuid::Uuid;

use super::Federation;
use crate::config::GatewayConfig;
use crate::error::{Error, FedError};
use crate::federation::auth::Caller;
use crate::federation::client::PeerError;
use crate::federation::trust::{TrustError, TrustedPeer};
use crate::metrics::fed;

/// How many `moved` answers a locate follows.
const MAX_HOPS: usize = 3;

/// Why a session could not be brought here.
#[derive(Debug, Clone, PartialEq)]
pub enum PullError {
    /// No peer holds it: the surface hears SESSION_NOT_FOUND (4004).
    NotHeld,
    /// The holder refused the surface's token (4003).
    Forbidden,
    /// The holder could not hand it over now (a turn runs, another gateway is taking it, it or a
    /// peer is unreachable, the deadline passed): the surface should retry (1013).
    TryAgain(String),
}

/// With `--enable-test-hooks`, a pause (milliseconds) between adopting a moved session and
/// committing it, so end-to-end tests can kill the target mid-handover.
const TEST_PAUSE_ENV: &str = "SBP_TEST_HANDOVER_PAUSE_MS";

fn test_handover_pause(config: &GatewayConfig) -> Option<Duration> {
    if !config.enable_test_hooks {
        return None;
    }
    let ms = std::env::var(TEST_PAUSE_ENV)
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(Duration::from_millis(ms))
}

/// The paths of the migration routes, for tokens' `htu`.
pub fn locate_path(id: Uuid) -> String {
    format!("/v1/sbp/federation/sessions/{id}")
}

pub fn handover_path(id: Uuid) -> String {
    format!("/v1/sbp/federation/sessions/{id}/handover")
}

pub fn abort_path(id: Uuid, migration_id: Uuid) -> String {
    format!("/v1/sbp/federation/sessions/{id}/handover/{migration_id}/abort")
}

pub fn commit_path(id: Uuid, migration_id: Uuid) -> String {
    format!("/v1/sbp/federation/sessions/{id}/handover/{migration_id}/commit")
}

/// The `error.code` of an answer's envelope.
fn error_code(body: &[u8]) -> String {
    serde_json::from_slice::<sbp_protocol::ErrorBody>(body)
        .map(|b| b.error.code)
        .unwrap_or_default()
}

/// Whether `a` is the holder's signed confirmation of this commit.
fn committed(
    a: &crate::federation::client::Answer,
    holder: &TrustedPeer,
    id: Uuid,
    migration_id: Uuid,
) -> bool {
    let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(&a.body) else {
        return false;
    };
    holder.live_keys().any(|k| verify_object(&obj, k).is_ok())
        && HandoverCommit::read(&obj).is_ok_and(|c| {
            c.session_id == id
                && c.migration_id == migration_id
                && c.state == HandoverCommit::COMMITTED
        })
}

/// The stored tether item as the envelope carries it.
fn tether_item(e: &TetherEntry) -> HandoverTetherEntry {
    let mut entry = Map::new();
    entry.insert("role".into(), json!(e.role));
    entry.insert("content".into(), json!(e.content));
    entry.insert("model_used".into(), json!(e.model_used));
    entry.insert(
        "created_at".into(),
        json!(sbp_protocol::time::iso(&e.created_at)),
    );
    entry.insert("chunk_id".into(), json!(e.chunk_id));
    HandoverTetherEntry { seq: e.seq, entry }
}

/// A carried tether item back to what the store writes.
fn new_tether_entry(h: &HandoverTetherEntry) -> Option<(u64, sbp_store::NewTetherEntry)> {
    let text = |k: &str| h.entry.get(k).and_then(Value::as_str).map(str::to_owned);
    let created_at = text("created_at")
        .and_then(|t| DateTime::parse_from_rfc3339(&t).ok())
        .map(|t| t.with_timezone(&Utc))
        .unwrap_or_else(Utc::now);
    Some((
        h.seq,
        sbp_store::NewTetherEntry {
            role: text("role")?,
            content: text("content"),
            model_used: text("model_used"),
            created_at,
            chunk_id: text("chunk_id")
                .and_then(|c| Uuid::parse_str(&c).ok())
                .unwrap_or_else(Uuid::now_v7),
        },
    ))
}

impl Federation {
    /// Where session `id` is, as this gateway knows: held here, or moved (and to whom).
    /// With a `challenge` from gateway `asker`, a `held` answer carries `holder_proof`: proof that
    /// this gateway keeps the session's token hash, so the asker sends the surface's token only
    /// to the real holder.
    pub async fn session_location(
        &self,
        id: Uuid,
        challenge: Option<(&str, &str)>,
    ) -> Result<Option<Map<String, Value>>, Error> {
        let inner = self.on()?;
        let Some(session) = inner.store.get_session(id).await? else {
            return Ok(None);
        };
        let hold = inner.store.hold(id).await?;
        let own = inner.identity.gateway_id().to_owned();
        let base = inner.identity.base_url().unwrap_or_default().to_owned();
        let mut out = Map::new();
        out.insert("session_id".into(), json!(id));
        match hold {
            Some(h) if h.state == HoldState::Moved => {
                out.insert("state".into(), json!("moved"));
                out.insert("gateway_id".into(), json!(h.peer_gateway));
                out.insert("gateway_url".into(), json!(h.peer_url));
                out.insert("epoch".into(), json!(h.epoch));
                out.insert(
                    "moved_at".into(),
                    json!(sbp_protocol::time::iso(&h.updated_at)),
                );
            }
            Some(h) if h.state == HoldState::Incoming => {
                out.insert("state".into(), json!("incoming"));
                out.insert("epoch".into(), json!(h.epoch));
            }
            other => {
                out.insert("state".into(), json!("held"));
                if let Some((challenge, asker)) = challenge {
                    let sid = id.to_string();
                    out.insert(
                        "holder_proof".into(),
                        json!(crate::auth::holder_proof(
                            &session.token_hash,
                            &["holder", &sid, challenge, &own, asker],
                        )),
                    );
                }
                out.insert("gateway_id".into(), json!(own));
                out.insert("gateway_url".into(), json!(base));
                out.insert("epoch".into(), json!(other.map(|h| h.epoch).unwrap_or(0)));
            }
        }
        Ok(Some(out))
    }

    /// Whether session `id` is not (or not yet) this gateway's: moved away, still arriving, or
    /// not stored here at all (a copy dropped after a refused commit may still have its token
    /// cached by the attach's token check).
    pub async fn is_away(&self, id: Uuid) -> Result<bool, sbp_store::StoreError> {
        let Some(inner) = &self.inner else {
            return Ok(false);
        };
        if let Some(h) = inner.store.hold(id).await? {
            return Ok(h.state == HoldState::Moved || h.state == HoldState::Incoming);
        }
        Ok(inner.store.get_session(id).await?.is_none())
    }

    /// For reads of a session's own record and lineage: refused only while it is arriving here
    /// (a move away still answers, saying where it went).
    pub async fn guard_read(&self, id: Uuid) -> Result<(), Error> {
        let Some(inner) = &self.inner else {
            return Ok(());
        };
        match inner.store.hold(id).await? {
            Some(h) if h.state == HoldState::Incoming => {
                Err(FedError::SessionMoving { retry_after: 1 }.into())
            }
            _ => Ok(()),
        }
    }

    /// Refuses work on a session that moved away or is being handed over (federation on).
    pub async fn guard(&self, id: Uuid) -> Result<(), Error> {
        let Some(inner) = &self.inner else {
            return Ok(());
        };
        let Some(h) = inner.store.hold(id).await? else {
            return Ok(());
        };
        let now = Utc::now();
        match h.state {
            HoldState::Moved => Err(FedError::SessionMoved {
                gateway_id: h.peer_gateway.unwrap_or_default(),
                gateway_url: h.peer_url.unwrap_or_default(),
            }
            .into()),
            // Arriving here: usable once its holder committed the move.
            HoldState::Incoming => Err(FedError::SessionMoving { retry_after: 1 }.into()),
            HoldState::Leased if h.lease_expires_at.is_some_and(|t| t > now) => {
                let left = h
                    .lease_expires_at
                    .map(|t| (t - now).num_seconds().max(1) as u64)
                    .unwrap_or(1);
                Err(FedError::SessionMoving {
                    retry_after: left.min(30),
                }
                .into())
            }
            _ => Ok(()),
        }
    }

    /// `POST /v1/sbp/federation/sessions/{id}/handover` from `caller`, for the surface holding
    /// `session_token`: the signed envelope.
    pub async fn grant_handover(
        &self,
        caller: &Caller,
        id: Uuid,
        session_token: &str,
        migration_id: Uuid,
    ) -> Result<Map<String, Value>, Error> {
        let inner = self.on()?;
        let count = |outcome: &'static str| {
            inner.metrics.federation.count(fed::HANDOVERS, outcome);
        };
        let Some(session) = inner.store.get_session(id).await? else {
            count("origin_not_found");
            return Err(Error::session_not_found(id));
        };
        let holds_token = crate::auth::token_matches(session_token, &session.token_hash);
        if !holds_token {
            count("origin_forbidden");
            return Err(Error::forbidden(
                "the session token does not match this session",
            ));
        }
        if let Some(h) = inner.store.hold(id).await?
            && h.state == HoldState::Moved
        {
            count("origin_moved");
            return Err(FedError::SessionMoved {
                gateway_id: h.peer_gateway.unwrap_or_default(),
                gateway_url: h.peer_url.unwrap_or_default(),
            }
            .into());
        }
        let peer = inner
            .directory
            .known(&caller.gateway_id)
            .ok_or_else(|| FedError::Untrusted("unknown peer".into()))?;
        let now = Utc::now();
        let lease = chrono::Duration::from_std(self.lease_duration())
            .unwrap_or(chrono::Duration::seconds(30));
        let hold = match inner
            .store
            .lease_handover(LeaseRequest {
                session_id: id,
                to_gateway: caller.gateway_id.clone(),
                to_url: peer.url.clone(),
                migration_id,
                now,
                until: now + lease,
            })
            .await
        {
            Ok(h) => h,
            Err(e) => {
                count("origin_refused");
                return Err(e.into());
            }
        };
        let exported = inner.roaming.handover_bundle(&session).await?;
        let pending = inner.store.tether_pending(id, None, u32::MAX).await?;
        let issued = inner.store.tether_issued(id).await?;
        count("origin_granted");
        Ok(HandoverEnvelope {
            session_id: id,
            migration_id,
            epoch: hold.epoch,
            from_gateway: inner.identity.gateway_id().to_owned(),
            to_gateway: caller.gateway_id.clone(),
            bundle_cid: exported,
            token_hash: session.token_hash.clone(),
            agent_id: Some(session.agent_id.clone()),
            tether: pending.iter().map(tether_item).collect(),
            next_seq: issued + 1,
            lease_expires_at: hold.lease_expires_at.unwrap_or(now + lease),
            issued_at: now,
        }
        .to_signed_map(inner.identity.key()))
    }

    /// `POST .../handover/{migration_id}/commit` from `caller` (the lease's gateway): the session
    /// is moved; surfaces still attached here are displaced.
    pub async fn commit_handover(
        &self,
        caller: &Caller,
        id: Uuid,
        migration_id: Uuid,
    ) -> Result<Map<String, Value>, Error> {
        let inner = self.on()?;
        let hold = match inner
            .store
            .commit_handover(id, migration_id, &caller.gateway_id, Utc::now())
            .await
        {
            Ok(h) => h,
            Err(e) => {
                inner
                    .metrics
                    .federation
                    .count(fed::HANDOVERS, "origin_commit_refused");
                return Err(e.into());
            }
        };
        inner
            .metrics
            .federation
            .count(fed::HANDOVERS, "origin_committed");
        tracing::info!(session_id = %id, to = %caller.gateway_id, epoch = hold.epoch, "session moved to another gateway");
        Ok(HandoverCommit {
            session_id: id,
            migration_id,
            epoch: hold.epoch,
            state: HandoverCommit::COMMITTED.to_owned(),
        }
        .to_signed_map(inner.identity.key()))
    }

    /// The largest session this gateway takes over: what its own limits let a session grow to
    /// (a bundle or envelope carries at most that, plus its envelope).
    fn handover_cap(&self) -> usize {
        self.inner.as_ref().map_or(8 << 20, |i| {
            // A bundle escapes non-ASCII text as JSON `\uXXXX` (up to 6 bytes a character):
            // three times the stored bytes covers ordinary text.
            let session = usize::try_from(i.config.limits.max_session_bytes).unwrap_or(usize::MAX);
            session
                .saturating_mul(3)
                .saturating_add(1 << 20)
                .max(i.config.max_body_bytes)
        })
    }

    /// `POST .../handover/{migration_id}/abort` from the lease's gateway: it gave up, the
    /// session is home again at once (instead of when the lease runs out).
    pub async fn abort_handover(
        &self,
        caller: &Caller,
        id: Uuid,
        migration_id: Uuid,
    ) -> Result<bool, Error> {
        let inner = self.on()?;
        let released = inner
            .store
            .release_lease(id, migration_id, &caller.gateway_id, Utc::now())
            .await?;
        if released {
            inner
                .metrics
                .federation
                .count(fed::HANDOVERS, "origin_aborted");
        }
        Ok(released)
    }

    /// Tells `holder` this gateway gave up a handover it was granted (best effort: the lease
    /// runs out anyway).
    async fn abort_at(&self, holder: &TrustedPeer, id: Uuid, migration_id: Uuid) {
        let Some(inner) = &self.inner else {
            return;
        };
        let path = abort_path(id, migration_id);
        let url = format!("{}{path}", holder.url);
        let token = inner
            .identity
            .token(&holder.gateway_id, &id.to_string(), "POST", &path);
        if let Err(e) = inner
            .directory
            .client()
            .post_within(
                &url,
                Some(&token),
                &json!({}),
                16 << 10,
                Duration::from_secs(2),
            )
            .await
        {
            tracing::info!(session_id = %id, error = %e, "releasing a handover lease failed; it expires");
        }
    }

    fn lease_duration(&self) -> Duration {
        self.inner
            .as_ref()
            .and_then(|i| i.config.federation.as_ref())
            .map(|f| f.handover_lease)
            .unwrap_or(Duration::from_secs(30))
    }

    /// The peers that may hold a session: where it went last (when it moved from here), the
    /// static peers and the SRV peers that host sessions; and how many could not be reached (a
    /// peer that is down may be the one holding it).
    async fn session_candidates(&self, id: Uuid) -> (Vec<TrustedPeer>, usize) {
        let Some(inner) = &self.inner else {
            return (Vec::new(), 0);
        };
        let mut out: Vec<TrustedPeer> = Vec::new();
        let mut unreachable = 0;
        let mut urls: Vec<String> = Vec::new();
        if let Ok(Some(h)) = inner.store.hold(id).await
            && h.state == HoldState::Moved
            && let Some(url) = h.peer_url
        {
            urls.push(url);
        }
        urls.extend(inner.directory.peer_urls());
        // Learned at once, each bounded by the client's timeout: a silent peer costs one timeout,
        // not one per peer.
        let learned =
            futures::future::join_all(urls.iter().map(|u| inner.directory.at_url(u))).await;
        for (url, got) in urls.iter().zip(learned) {
            match got {
                Ok(p) => {
                    if p.role.hosts_sessions() && !out.iter().any(|o| o.gateway_id == p.gateway_id)
                    {
                        out.push(p);
                    }
                }
                // Only a peer that could not be reached may be the holder we cannot see; one that
                // answered but is not usable (refused URL, no manifest, untrusted) is not.
                Err(TrustError::Peer(e @ PeerError::Unreachable { .. })) => {
                    tracing::info!(peer = %url, error = %e, "a peer that may hold the session is unreachable");
                    unreachable += 1;
                }
                Err(_) => {}
            }
        }
        for p in self.srv_peers().await {
            if !out.iter().any(|o| o.gateway_id == p.gateway_id) {
                out.push(p);
            }
        }
        (out, unreachable)
    }

    /// Asks `peer` where session `id` is: its answer, `Ok(None)` when it does not know the
    /// session, `Err` when it could not be asked.
    async fn ask_location(
        &self,
        peer: &TrustedPeer,
        id: Uuid,
        challenge: &str,
    ) -> Result<Option<Map<String, Value>>, ()> {
        let inner = self.inner.as_ref().ok_or(())?;
        let path = locate_path(id);
        let url = format!("{}{path}?challenge={challenge}", peer.url);
        let token = inner
            .identity
            .token(&peer.gateway_id, &id.to_string(), "GET", &path);
        let a = inner
            .directory
            .client()
            .get(&url, Some(&token), 16 << 10)
            .await
            .map_err(|_| ())?;
        match a.status {
            200 => a.object(&url).map(Some).map_err(|_| ()),
            // Not known there, or not to us (the peer does not trust this gateway).
            404 | 401 | 403 => Ok(None),
            _ => Err(()),
        }
    }

    /// Whether `answer` proves that `peer` holds the session whose token hashes to `token_hash`.
    fn proves_holding(
        &self,
        answer: &Map<String, Value>,
        peer: &TrustedPeer,
        id: Uuid,
        challenge: &str,
        token_hash: &str,
    ) -> bool {
        let Some(inner) = &self.inner else {
            return false;
        };
        let sid = id.to_string();
        let proved = answer
            .get("holder_proof")
            .and_then(Value::as_str)
            .is_some_and(|p| {
                crate::auth::holder_proof_matches(
                    p,
                    token_hash,
                    &[
                        "holder",
                        &sid,
                        challenge,
                        &peer.gateway_id,
                        inner.identity.gateway_id(),
                    ],
                )
            });
        if !proved {
            tracing::warn!(peer = %peer.url, session_id = %id, "a peer claims to hold a session it cannot prove it holds");
        }
        proved
    }

    /// The gateway holding session `id`, following `moved` answers. `TryAgain` when a peer that
    /// may hold it could not be asked, or the session is arriving somewhere (a move in progress).
    async fn find_holder(&self, id: Uuid, token_hash: &str) -> Result<TrustedPeer, PullError> {
        let Some(inner) = self.inner.as_ref() else {
            return Err(PullError::NotHeld);
        };
        let challenge = uuid::Uuid::new_v4().simple().to_string();
        let busy = || PullError::TryAgain("the session is moving; try again".into());
        let (candidates, mut unreachable) = self.session_candidates(id).await;
        let answers = futures::future::join_all(
            candidates
                .iter()
                .map(|p| self.ask_location(p, id, &challenge)),
        )
        .await;
        let mut next: Option<String> = None;
        let mut arriving = false;
        let mut unproven = false;
        for (peer, answer) in candidates.iter().zip(answers) {
            let a = match answer {
                Ok(Some(a)) => a,
                Ok(None) => continue,
                Err(()) => {
                    unreachable += 1;
                    continue;
                }
            };
            match a.get("state").and_then(Value::as_str) {
                Some("held") if self.proves_holding(&a, peer, id, &challenge, token_hash) => {
                    return Ok(peer.clone());
                }
                // Held there, but not by this token's hash: a wrong token (or a peer that only
                // claims the session). Nothing is sent; the surface hears 4003.
                Some("held") => unproven = true,
                Some("incoming") => arriving = true,
                Some("moved") => {
                    next = a
                        .get("gateway_id")
                        .and_then(Value::as_str)
                        .map(str::to_owned)
                        .or(next);
                }
                _ => {}
            }
        }
        // Follow where it moved to, among trusted gateways only.
        let mut hops = 0;
        while let Some(gateway_id) = next.take() {
            hops += 1;
            if hops > MAX_HOPS || gateway_id == inner.identity.gateway_id() {
                break;
            }
            let peer = match inner.directory.known(&gateway_id) {
                Some(p) => p,
                None => match inner.directory.via_trackers(&gateway_id).await {
                    Some(p) => p,
                    None => return Err(busy()),
                },
            };
            match self.ask_location(&peer, id, &challenge).await {
                Ok(Some(a)) => match a.get("state").and_then(Value::as_str) {
                    Some("held") if self.proves_holding(&a, &peer, id, &challenge, token_hash) => {
                        return Ok(peer);
                    }
                    Some("held") => return Err(PullError::Forbidden),
                    Some("moved") => {
                        next = a
                            .get("gateway_id")
                            .and_then(Value::as_str)
                            .map(str::to_owned);
                    }
                    _ => return Err(busy()),
                },
                // Moved there and not known there: it is arriving, or that gateway is down.
                Ok(None) | Err(()) => return Err(busy()),
            }
        }
        if arriving {
            return Err(busy());
        }
        if unproven {
            return Err(PullError::Forbidden);
        }
        if unreachable > 0 {
            return Err(PullError::TryAgain(
                "a peer that may hold the session could not be reached".into(),
            ));
        }
        Err(PullError::NotHeld)
    }

    /// Brings session `id` here from the gateway that holds it, for a surface presenting
    /// `session_token`; everything before `deadline`.
    pub async fn pull_session(
        &self,
        id: Uuid,
        session_token: &str,
        deadline: tokio::time::Instant,
    ) -> Result<(), PullError> {
        let Some(inner) = &self.inner else {
            return Err(PullError::NotHeld);
        };
        let count = |outcome: &'static str| inner.metrics.federation.count(fed::HANDOVERS, outcome);
        // A copy adopted earlier whose commit's outcome is unknown is resolved first.
        if let Ok(Some(h)) = inner.store.hold(id).await
            && h.state == HoldState::Incoming
        {
            return self.resolve_incoming(id, h, deadline).await;
        }
        let Ok(holder) = tokio::time::timeout_at(
            deadline,
            self.find_holder(id, &crate::auth::hash_token(session_token)),
        )
        .await
        else {
            count("target_timeout");
            return Err(PullError::TryAgain("locating the session timed out".into()));
        };
        let holder = holder.inspect_err(|e| {
            if *e == PullError::Forbidden {
                count("target_forbidden");
            }
        })?;
        let migration_id = Uuid::now_v7();
        let envelope = match tokio::time::timeout_at(
            deadline,
            self.ask_handover(&holder, id, session_token, migration_id),
        )
        .await
        {
            Ok(r) => r?,
            Err(_) => {
                count("target_timeout");
                return Err(PullError::TryAgain("the handover timed out".into()));
            }
        };
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let bundle = match tokio::time::timeout_at(
            deadline,
            self.fetch_within(&holder, &envelope.bundle_cid, self.handover_cap(), left),
        )
        .await
        {
            Ok(super::bundles::Attempt::Got(v)) => v,
            Ok(_) => {
                count("target_bad_bundle");
                self.abort_at(&holder, id, migration_id).await;
                return Err(PullError::TryAgain(
                    "the holder did not serve the session's bundle".into(),
                ));
            }
            Err(_) => {
                count("target_timeout");
                self.abort_at(&holder, id, migration_id).await;
                return Err(PullError::TryAgain("fetching the bundle timed out".into()));
            }
        };
        let tether: Vec<(u64, sbp_store::NewTetherEntry)> = envelope
            .tether
            .iter()
            .filter_map(new_tether_entry)
            .collect();
        if let Err(e) = inner
            .roaming
            .adopt_migrated(bundle, &envelope, tether, &holder.gateway_id, &holder.url)
            .await
        {
            count("target_adopt_failed");
            tracing::warn!(session_id = %id, error = %e, "adopting a migrated session failed");
            self.abort_at(&holder, id, migration_id).await;
            return Err(PullError::TryAgain(
                "the session could not be adopted".into(),
            ));
        }
        if let Some(pause) = test_handover_pause(&inner.config) {
            tracing::warn!(session_id = %id, %migration_id, pause_ms = pause.as_millis() as u64, "test hook: handover paused between adopt and commit");
            tokio::time::sleep(pause).await;
        }
        self.commit_at(&holder, id, migration_id, deadline).await
    }

    /// Commits the handover at `holder` (retried on a lost answer until `deadline`), then makes
    /// the adopted copy this gateway's own; a refused commit drops it.
    async fn commit_at(
        &self,
        holder: &TrustedPeer,
        id: Uuid,
        migration_id: Uuid,
        deadline: tokio::time::Instant,
    ) -> Result<(), PullError> {
        let Some(inner) = &self.inner else {
            return Err(PullError::NotHeld);
        };
        let count = |outcome: &'static str| inner.metrics.federation.count(fed::HANDOVERS, outcome);
        let path = commit_path(id, migration_id);
        let url = format!("{}{path}", holder.url);
        loop {
            let token = inner
                .identity
                .token(&holder.gateway_id, &id.to_string(), "POST", &path);
            let sent = tokio::time::timeout_at(
                deadline,
                inner
                    .directory
                    .client()
                    .post(&url, Some(&token), &json!({}), 16 << 10),
            )
            .await;
            let code = |a: &crate::federation::client::Answer| error_code(&a.body);
            match sent {
                Ok(Ok(a)) if a.status == 200 && committed(&a, holder, id, migration_id) => {
                    if let Err(e) = inner
                        .store
                        .finish_incoming(id, migration_id, true, Utc::now())
                        .await
                    {
                        tracing::error!(session_id = %id, error = %e, "finishing a migrated session");
                        return Err(PullError::TryAgain("the session could not be kept".into()));
                    }
                    count("target_committed");
                    tracing::info!(session_id = %id, from = %holder.gateway_id, "session moved here");
                    return Ok(());
                }
                // Only a definitive refusal drops the copy: the lease is gone, or the holder
                // no longer knows the session. Anything else (a proxy's 5xx, a 429, a 401 from
                // a clock) may hide a commit that went through: keep the copy `incoming`.
                Ok(Ok(a))
                    if (a.status == 409 && code(&a) == ErrorCode::LeaseExpired.as_str())
                        || (a.status == 404 && code(&a) == ErrorCode::SessionNotFound.as_str()) =>
                {
                    if let Err(e) = inner
                        .store
                        .finish_incoming(id, migration_id, false, Utc::now())
                        .await
                    {
                        tracing::warn!(session_id = %id, error = %e, "dropping a refused copy");
                    }
                    count("target_commit_refused");
                    return Err(PullError::TryAgain(format!(
                        "the holder refused the commit (HTTP {})",
                        a.status
                    )));
                }
                Ok(Ok(a)) => {
                    tracing::warn!(session_id = %id, status = a.status, "commit not confirmed; retrying");
                    if tokio::time::Instant::now() + Duration::from_millis(200) >= deadline {
                        count("target_commit_unknown");
                        return Err(PullError::TryAgain("the commit was not confirmed".into()));
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Ok(Err(e)) => {
                    tracing::warn!(session_id = %id, error = %e, "commit not answered; retrying");
                    if tokio::time::Instant::now() + Duration::from_millis(200) >= deadline {
                        count("target_commit_unknown");
                        return Err(PullError::TryAgain("the commit was not answered".into()));
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(_) => {
                    // Unknown outcome: the copy stays `incoming`, resolved at the next attach.
                    count("target_commit_unknown");
                    return Err(PullError::TryAgain("the commit timed out".into()));
                }
            }
        }
    }

    /// An `incoming` copy left by an earlier attach: retry its commit (idempotent at the holder).
    async fn resolve_incoming(
        &self,
        id: Uuid,
        hold: sbp_store::HoldRow,
        deadline: tokio::time::Instant,
    ) -> Result<(), PullError> {
        let Some(inner) = &self.inner else {
            return Err(PullError::NotHeld);
        };
        let (Some(migration_id), Some(peer_gateway)) = (hold.migration_id, hold.peer_gateway)
        else {
            return Err(PullError::TryAgain(
                "an unfinished handover has no holder".into(),
            ));
        };
        let holder = match inner.directory.known(&peer_gateway) {
            Some(p) => p,
            None => match hold.peer_url {
                Some(url) => inner
                    .directory
                    .at_url(&url)
                    .await
                    .map_err(|e| PullError::TryAgain(e.to_string()))?,
                None => return Err(PullError::TryAgain("unknown holder".into())),
            },
        };
        self.commit_at(&holder, id, migration_id, deadline).await
    }

    /// Resolves, at start, copies left `incoming` by a crash between adopt and commit.
    pub async fn resolve_all_incoming(&self) {
        let Some(inner) = &self.inner else {
            return;
        };
        let Ok(holds) = inner.store.incoming_holds().await else {
            return;
        };
        for h in holds {
            let id = h.session_id;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            if let Err(e) = self.resolve_incoming(id, h, deadline).await {
                tracing::warn!(session_id = %id, error = ?e, "an unfinished handover stays unresolved");
            }
        }
    }

    async fn ask_handover(
        &self,
        holder: &TrustedPeer,
        id: Uuid,
        session_token: &str,
        migration_id: Uuid,
    ) -> Result<HandoverEnvelope, PullError> {
        let Some(inner) = &self.inner else {
            return Err(PullError::NotHeld);
        };
        let count = |outcome: &'static str| inner.metrics.federation.count(fed::HANDOVERS, outcome);
        let path = handover_path(id);
        let url = format!("{}{path}", holder.url);
        let token = inner
            .identity
            .token(&holder.gateway_id, &id.to_string(), "POST", &path);
        // The holder proved it keeps the session's token hash (locate's `holder_proof`).
        let body = json!({ "session_token": session_token, "migration_id": migration_id });
        let a = inner
            .directory
            .client()
            .post_within(
                &url,
                Some(&token),
                &body,
                self.handover_cap(),
                Duration::from_secs(10),
            )
            .await
            .map_err(|e| {
                count("target_unreachable");
                PullError::TryAgain(e.to_string())
            })?;
        match a.status {
            200 => {}
            // The surface's token refused; any other 403 (this gateway not trusted there, say)
            // is not the surface's fault.
            403 if error_code(&a.body) == ErrorCode::Forbidden.as_str() => {
                count("target_forbidden");
                return Err(PullError::Forbidden);
            }
            404 => return Err(PullError::NotHeld),
            s => {
                count("target_refused");
                return Err(PullError::TryAgain(format!("the holder answered HTTP {s}")));
            }
        }
        let obj = a
            .object(&url)
            .map_err(|e| PullError::TryAgain(e.to_string()))?;
        if !holder.live_keys().any(|k| verify_object(&obj, k).is_ok()) {
            count("target_bad_envelope");
            return Err(PullError::TryAgain(
                "the handover envelope is not signed by the holder".into(),
            ));
        }
        let envelope = HandoverEnvelope::read(&obj).map_err(|e| {
            count("target_bad_envelope");
            PullError::TryAgain(format!("invalid handover envelope: {e}"))
        })?;
        let own = inner.identity.gateway_id();
        if envelope.check(own, Utc::now()).is_err()
            || envelope.session_id != id
            || envelope.migration_id != migration_id
            || envelope.from_gateway != holder.gateway_id
            || !crate::auth::token_matches(session_token, &envelope.token_hash)
        {
            count("target_bad_envelope");
            return Err(PullError::TryAgain(
                "the handover envelope is not for this handover".into(),
            ));
        }
        if let Ok(Some(h)) = inner.store.hold(id).await
            && envelope.epoch <= h.epoch
        {
            count("target_bad_envelope");
            return Err(PullError::TryAgain("a stale handover epoch".into()));
        }
        Ok(envelope)
    }
}
