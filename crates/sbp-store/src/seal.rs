//! Encryption at rest (`sbp serve --encryption-key`): a [`Sealer`] turns a column's plaintext into
//! a sealed value and back, with XChaCha20-Poly1305 under the keyring's current key and a random
//! 24-byte nonce per value. Pure: no IO; the backends call it on every column that holds session
//! content, so nothing above the store ever sees a sealed value.
//!
//! A sealed value names the key that sealed it and binds itself to its place: the associated data
//! is the column and the row's key (a session, snapshot, turn, export or link id, a bundle's CID,
//! an Idempotency-Key), so a value copied into another row or column does not open. Values of one
//! session's messages (and tether entries) are bound to the session, not to their seq: PostgreSQL
//! numbers them inside the statement that writes them.
//!
//! Format: `sbp:enc:v1:` then, in text columns, base64url (no padding) of `key id (4) || nonce (24)
//! || ciphertext || tag (16)`; in byte columns (bundles) those bytes as they are after the prefix.
//!
//! The `sbp:` family of prefixes is reserved: a plain value (encryption off) that starts with
//! `sbp:` is stored escaped as `sbp:raw:` then the value, and read back without it, so a prompt
//! such as `sbp:enc:v1:hello` is never taken for a sealed value. A value with neither prefix is a
//! plaintext (written before encryption was on, or before escaping existed) and reads as it is.
//! A legacy value that starts with `sbp:enc:v1:` but is not well-formed sealed data (not base64url,
//! or shorter than key id, nonce and tag) reads as the plain value too, keyring or not: sealing
//! never writes such a value. A well-formed one is opened, and fails (no keyring, unknown key,
//! forged) rather than being handed out as text: it cannot be told apart from a sealed value, and
//! a reseal reports it. A legacy plain value that began with `sbp:raw:` loses that prefix on read.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use base64::Engine as _;
use chacha20poly1305::aead::{Aead, Generate, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use sha2::{Digest, Sha256};

/// What every sealed value starts with (the version is part of it).
pub const PREFIX: &str = "sbp:enc:v1:";
/// The reserved family: a plain value starting with it is stored escaped (module docs).
const RESERVED: &str = "sbp:";
/// What an escaped plain value starts with.
const RAW: &str = "sbp:raw:";
const KEY_LEN: usize = 32;
const KEY_ID_LEN: usize = 4;
const NONCE_LEN: usize = 24;
const TAG_LEN: usize = 16;
/// The plaintext of a key-check value (see [`Sealer::check`]).
const CHECK_PLAINTEXT: &[u8] = b"sbp encryption key check";
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::URL_SAFE_NO_PAD;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// A key file's text is not 32 bytes in hex or base64 (the text itself is never repeated).
    #[error(
        "an encryption key is 32 bytes written as 64 hex digits or in base64 (`sbp encryption-key generate` makes one); {0}"
    )]
    BadKey(String),
    /// The same key was given twice (as current and previous, or twice as previous).
    #[error("encryption key {0} is given twice")]
    DuplicateKey(KeyId),
    /// A value is sealed under a key the keyring does not hold.
    #[error("a value of {0} is sealed under key {1}, which is not in the keyring")]
    UnknownKey(&'static str, KeyId),
    /// A value does not authenticate: altered, moved from another row, or sealed under another
    /// key whose id is the same.
    #[error("a sealed value of {0} does not authenticate (altered or moved from another row)")]
    Forged(&'static str),
    #[error("a sealed value of {0} is malformed")]
    Malformed(&'static str),
    /// A sealed value was read without a keyring.
    #[error("a value of {0} is sealed, and no encryption key is configured")]
    NoKeyring(&'static str),
    #[error("no randomness for a nonce: {0}")]
    Random(String),
    /// Startup without a key over a database holding sealed values.
    #[error(
        "this database holds values sealed under encryption key(s) {}: start with --encryption-key (and --previous-encryption-key) holding them",
        KeyId::list(.0)
    )]
    Locked(Vec<KeyId>),
    /// Startup with a keyring that lacks keys the database's values are sealed under.
    #[error(
        "this database holds values sealed under encryption key(s) {}, which are neither --encryption-key nor a --previous-encryption-key",
        KeyId::list(.0)
    )]
    MissingKeys(Vec<KeyId>),
    /// The current key is no longer recorded by the database: a reseal run elsewhere retired it
    /// while this process kept it as current. Nothing more is sealed under it.
    #[error(
        "encryption key {0} was retired by a reseal (the database no longer records it): restart this gateway with the current --encryption-key"
    )]
    Retired(KeyId),
    /// A key has the id of one the database recorded, and yet does not open its check value.
    #[error("encryption key {0} does not open this database's check value for that key id")]
    WrongKey(KeyId),
}

/// The first 4 bytes of SHA-256 over a domain tag and the key: names a key in every value it
/// seals and in logs without revealing anything usable about it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyId([u8; KEY_ID_LEN]);

impl KeyId {
    fn of(key: &[u8; KEY_LEN]) -> Self {
        let digest = Sha256::new()
            .chain_update(b"sbp encryption key id\0")
            .chain_update(key)
            .finalize();
        let mut id = [0u8; KEY_ID_LEN];
        id.copy_from_slice(&digest[..KEY_ID_LEN]);
        Self(id)
    }

    /// Parses the 8 hex digits [`fmt::Display`] writes.
    pub fn parse(text: &str) -> Option<Self> {
        let bytes = text.as_bytes();
        if bytes.len() != 2 * KEY_ID_LEN {
            return None;
        }
        let mut id = [0u8; KEY_ID_LEN];
        // `from_str_radix` takes a leading `+`: only hex digits make an id.
        if !bytes.iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        for (i, pair) in bytes.chunks(2).enumerate() {
            let s = std::str::from_utf8(pair).ok()?;
            id[i] = u8::from_str_radix(s, 16).ok()?;
        }
        Some(Self(id))
    }

    fn list(ids: &[KeyId]) -> String {
        ids.iter()
            .map(KeyId::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyId({self})")
    }
}

/// One 32-byte key. `Debug` shows its id only.
#[derive(Clone)]
pub struct Key {
    id: KeyId,
    cipher: XChaCha20Poly1305,
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.id)
    }
}

impl Key {
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, SealError> {
        let key: &[u8; KEY_LEN] = bytes
            .try_into()
            .map_err(|_| SealError::BadKey(format!("this one decodes to {} bytes", bytes.len())))?;
        let cipher = XChaCha20Poly1305::new_from_slice(key)
            .map_err(|_| SealError::BadKey("the cipher refused it".to_owned()))?;
        Ok(Self {
            id: KeyId::of(key),
            cipher,
        })
    }

    /// A key file's text: 64 hex digits, or base64 (standard or URL-safe, padded or not) of 32
    /// bytes; surrounding whitespace is ignored.
    pub fn from_text(text: &str) -> Result<Self, SealError> {
        let t = text.trim();
        if t.len() == 2 * KEY_LEN && t.bytes().all(|b| b.is_ascii_hexdigit()) {
            let mut key = [0u8; KEY_LEN];
            for (i, pair) in t.as_bytes().chunks(2).enumerate() {
                // Two ASCII hex digits: checked above, so both conversions succeed.
                let digits =
                    std::str::from_utf8(pair).map_err(|_| SealError::BadKey(String::new()))?;
                key[i] = u8::from_str_radix(digits, 16)
                    .map_err(|_| SealError::BadKey("bad hex".to_owned()))?;
            }
            return Self::from_bytes(&key);
        }
        let unpadded = t.trim_end_matches('=');
        let decoded = B64
            .decode(unpadded.replace('+', "-").replace('/', "_"))
            .map_err(|_| {
                SealError::BadKey(format!(
                    "this text ({} characters) is neither",
                    t.chars().count()
                ))
            })?;
        Self::from_bytes(&decoded)
    }

    /// A fresh random key, as the text a key file holds (base64, one line).
    pub fn generate_text() -> Result<String, SealError> {
        let key =
            chacha20poly1305::Key::try_generate().map_err(|e| SealError::Random(e.to_string()))?;
        Ok(base64::engine::general_purpose::STANDARD.encode(key.as_slice()))
    }

    pub fn id(&self) -> KeyId {
        self.id
    }
}

/// The key new values are sealed under, and earlier keys values may still be sealed under.
#[derive(Debug, Clone)]
pub struct Keyring {
    current: Key,
    previous: Vec<Key>,
}

impl Keyring {
    /// A key may appear once: the same key as current and previous is a configuration mistake.
    pub fn new(current: Key, previous: Vec<Key>) -> Result<Self, SealError> {
        let mut seen = vec![current.id];
        for key in &previous {
            if seen.contains(&key.id) {
                return Err(SealError::DuplicateKey(key.id));
            }
            seen.push(key.id);
        }
        Ok(Self { current, previous })
    }

    fn find(&self, id: KeyId) -> Option<&Key> {
        std::iter::once(&self.current)
            .chain(&self.previous)
            .find(|k| k.id == id)
    }
}

/// The column a value lives in: part of its associated data, so a value does not open elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Column {
    MessageBody,
    TetherContent,
    SessionLastTask,
    SessionMetadata,
    SnapshotTask,
    SnapshotState,
    IdempotencyResponse,
    MemoryPayload,
    BundleBody,
    ExportLabel,
    LinkLabel,
    LinkReason,
    TurnError,
    /// The per-key check value that startup opens.
    KeyCheck,
}

impl Column {
    pub fn name(self) -> &'static str {
        match self {
            Self::MessageBody => "messages.body",
            Self::TetherContent => "tether.content",
            Self::SessionLastTask => "sessions.last_task",
            Self::SessionMetadata => "sessions.metadata",
            Self::SnapshotTask => "snapshots.current_task",
            Self::SnapshotState => "snapshots.state",
            Self::IdempotencyResponse => "idempotency.response_body",
            Self::MemoryPayload => "session_memory.payload",
            Self::BundleBody => "bundles.body",
            Self::ExportLabel => "exports.label",
            Self::LinkLabel => "lineage.label",
            Self::LinkReason => "lineage.reason",
            Self::TurnError => "turns.error",
            Self::KeyCheck => "sealing_keys.check_value",
        }
    }
}

/// Every column a backend seals: its table, the column, and the column holding the row key its
/// values are bound to. A reseal walks them all.
pub const SEALED_COLUMNS: &[(Column, &str, &str, &str)] = &[
    (Column::MessageBody, "messages", "body", "session_id"),
    (Column::TetherContent, "tether", "content", "session_id"),
    (Column::SessionLastTask, "sessions", "last_task", "id"),
    (Column::SessionMetadata, "sessions", "metadata", "id"),
    (Column::SnapshotTask, "snapshots", "current_task", "id"),
    (Column::SnapshotState, "snapshots", "state", "id"),
    (
        Column::IdempotencyResponse,
        "idempotency",
        "response_body",
        "key",
    ),
    (
        Column::MemoryPayload,
        "session_memory",
        "payload",
        "session_id",
    ),
    (Column::BundleBody, "bundles", "body", "cid"),
    (Column::ExportLabel, "exports", "label", "id"),
    (Column::LinkLabel, "lineage", "label", "id"),
    (Column::LinkReason, "lineage", "reason", "id"),
    (Column::TurnError, "turns", "error", "id"),
];

/// What a reseal rewrote: per column (`table.column`), the values it sealed under the current key
/// (plain ones, and ones sealed under an earlier key); the values it could not open; and whether
/// the database then forgot the earlier keys.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resealed {
    pub columns: Vec<(&'static str, u64)>,
    /// Values left as they were because they do not open (unknown key, altered, moved): while any
    /// remains, the earlier keys are kept. At most [`MAX_UNOPENED`] are listed.
    pub unopened: Vec<Unopened>,
    /// How many unopened values there were in all (the list stops at [`MAX_UNOPENED`]).
    pub unopened_total: u64,
    /// How many earlier keys the database forgot; `None` when it kept them (see `kept`).
    pub forgotten: Option<u64>,
    /// Why the earlier keys were kept, when they were.
    pub kept: Option<Kept>,
}

/// The most unopened values a reseal lists (it counts them all).
pub const MAX_UNOPENED: usize = 1000;

/// A value a reseal could not open: where it is and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unopened {
    /// `table.column`, or `redis tether.content` for a stream entry.
    pub column: String,
    /// The row's primary key (its columns' values joined with `/`), or `session/entry id`.
    pub row: String,
    pub error: SealError,
}

/// Why a reseal kept the earlier keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// Some values do not open: retiring a key would lose whatever they hold.
    Unopened,
    /// A Redis tether seals under this keyring and its streams were not resealed in this run.
    TetherNotResealed,
    /// The caller asked to keep them (the tether's reseal was not clean).
    Asked,
    /// Values sealed under an earlier key were written while the reseal ran (a gateway still
    /// seals under one): run it again once every gateway seals under the current key.
    WrittenMeanwhile,
}

/// When a reseal may make the database forget the earlier keys: always only after a clean run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forget {
    /// After a clean run, unless a Redis tether seals under the keyring here.
    IfClean,
    /// After a clean run, the Redis tether's streams having just been resealed cleanly too.
    IfCleanWithTether,
    /// Never (rewrite only).
    Never,
}

impl Resealed {
    pub fn note_unopened(&mut self, column: impl Into<String>, row: String, error: SealError) {
        self.unopened_total += 1;
        if self.unopened.len() < MAX_UNOPENED {
            self.unopened.push(Unopened {
                column: column.into(),
                row,
                error,
            });
        }
    }

    /// Adds another part's counts and unopened values (a page, or the tether's streams).
    pub fn merge(&mut self, other: Resealed) {
        for (column, n) in other.columns {
            self.add_named(column, n);
        }
        self.unopened_total += other.unopened_total;
        let room = MAX_UNOPENED.saturating_sub(self.unopened.len());
        self.unopened.extend(other.unopened.into_iter().take(room));
    }

    pub fn is_clean(&self) -> bool {
        self.unopened_total == 0
    }

    /// Why the earlier keys must be kept whatever the database holds (values that did not open,
    /// or the caller's choice); `None` when they may go, subject to the backend's own checks
    /// (a Redis tether under `Forget::IfClean`, then the last scan).
    pub fn keep_regardless(&self, forget: Forget) -> Option<Kept> {
        if !self.is_clean() {
            Some(Kept::Unopened)
        } else if forget == Forget::Never {
            Some(Kept::Asked)
        } else {
            None
        }
    }

    /// Records what forgetting the earlier keys gave: how many were forgotten, or how many
    /// values a gateway sealed under one of them while the reseal ran (then they are kept).
    pub fn forgot(&mut self, outcome: Result<u64, u64>) {
        match outcome {
            Ok(n) => self.forgotten = Some(n),
            Err(stale) => {
                self.kept = Some(Kept::WrittenMeanwhile);
                tracing::warn!(
                    values = stale,
                    "values sealed under an earlier key were written during the reseal"
                );
            }
        }
    }

    pub fn add(&mut self, column: Column, n: u64) {
        self.add_named(column.name(), n);
    }

    /// [`Resealed::add`] for a place that is not a SQL column (the tether's streams).
    pub fn add_named(&mut self, name: &'static str, n: u64) {
        match self.columns.iter_mut().find(|(c, _)| *c == name) {
            Some((_, total)) => *total += n,
            None => self.columns.push((name, n)),
        }
    }

    pub fn total(&self) -> u64 {
        self.columns.iter().map(|(_, n)| n).sum()
    }
}

fn aad(column: Column, row: &str) -> Vec<u8> {
    let name = column.name();
    let mut aad = Vec::with_capacity(PREFIX.len() + name.len() + 1 + row.len());
    aad.extend_from_slice(PREFIX.as_bytes());
    aad.extend_from_slice(name.as_bytes());
    aad.push(0);
    aad.extend_from_slice(row.as_bytes());
    aad
}

/// Seals and opens column values; without a keyring (encryption off) it passes values through.
/// Cheap to clone.
#[derive(Clone, Default)]
pub struct Sealer {
    keys: Option<Arc<Keyring>>,
    /// Set (for every clone) once the backend finds the current key no longer recorded: from then
    /// on nothing is sealed, so no value is written under a key the database has forgotten.
    retired: Arc<AtomicBool>,
}

impl fmt::Debug for Sealer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.keys {
            None => write!(f, "Sealer(off)"),
            Some(k) => write!(f, "Sealer(current {})", k.current.id),
        }
    }
}

/// A value as a reseal sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sealed {
    Plain,
    By(KeyId),
}

impl Sealer {
    /// Encryption off: values are stored and read as they are.
    pub fn off() -> Self {
        Self::default()
    }

    pub fn new(keyring: Keyring) -> Self {
        Self {
            keys: Some(Arc::new(keyring)),
            retired: Arc::default(),
        }
    }

    /// The backend found the current key no longer recorded (a reseal retired it): every clone
    /// refuses to seal from now on ([`SealError::Retired`]).
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Relaxed);
    }

    /// The error a backend answers with once the current key is retired, `None` while it is not.
    pub fn retired(&self) -> Option<SealError> {
        let current = self.current()?;
        self.retired
            .load(Ordering::Relaxed)
            .then_some(SealError::Retired(current))
    }

    /// How a value sealed under the current key starts, as text (the prefix and the base64
    /// characters that only the key id determines) and as bytes (the prefix and the key id): lets
    /// a backend find the values sealed under other keys without decoding every value.
    pub fn current_heads(&self) -> Option<(String, Vec<u8>)> {
        let id = self.current()?;
        let b64 = B64.encode(id.0);
        // 32 bits of key id: the first 5 characters (30 bits) depend on nothing else.
        let text = format!("{PREFIX}{}", b64.get(..5)?);
        Some((text, [PREFIX.as_bytes(), &id.0].concat()))
    }

    /// Whether `id` is a key other than the current one (so a reseal has not reached the value).
    pub fn is_earlier(&self, sealed: Sealed) -> bool {
        matches!((self.current(), sealed), (Some(current), Sealed::By(id)) if id != current)
    }

    pub fn is_on(&self) -> bool {
        self.keys.is_some()
    }

    /// The key new values are sealed under.
    pub fn current(&self) -> Option<KeyId> {
        self.keys.as_ref().map(|k| k.current.id)
    }

    /// `key id || nonce || ciphertext || tag` under the current key; `None` when off.
    fn seal_raw(
        &self,
        column: Column,
        row: &str,
        plain: &[u8],
    ) -> Result<Option<Vec<u8>>, SealError> {
        let Some(keys) = &self.keys else {
            return Ok(None);
        };
        if let Some(e) = self.retired() {
            return Err(e);
        }
        seal_with(&keys.current, column, row, plain).map(Some)
    }

    fn open_raw(&self, column: Column, row: &str, raw: &[u8]) -> Result<Vec<u8>, SealError> {
        let keys = self
            .keys
            .as_ref()
            .ok_or(SealError::NoKeyring(column.name()))?;
        if raw.len() < KEY_ID_LEN + NONCE_LEN + TAG_LEN {
            return Err(SealError::Malformed(column.name()));
        }
        let mut id = [0u8; KEY_ID_LEN];
        id.copy_from_slice(&raw[..KEY_ID_LEN]);
        let id = KeyId(id);
        let key = keys
            .find(id)
            .ok_or(SealError::UnknownKey(column.name(), id))?;
        open_with(key, column, row, raw)
    }

    /// Text to store in a text column: sealed when on; when off `plain` itself, escaped when it
    /// starts with the reserved `sbp:`.
    pub fn seal<'a>(
        &self,
        column: Column,
        row: &str,
        plain: &'a str,
    ) -> Result<Cow<'a, str>, SealError> {
        Ok(match self.seal_raw(column, row, plain.as_bytes())? {
            None if plain.starts_with(RESERVED) => Cow::Owned(format!("{RAW}{plain}")),
            None => Cow::Borrowed(plain),
            Some(raw) => {
                let mut text = String::with_capacity(PREFIX.len() + raw.len().div_ceil(3) * 4);
                text.push_str(PREFIX);
                B64.encode_string(&raw, &mut text);
                Cow::Owned(text)
            }
        })
    }

    pub fn seal_opt<'a>(
        &self,
        column: Column,
        row: &str,
        plain: Option<&'a str>,
    ) -> Result<Option<Cow<'a, str>>, SealError> {
        plain.map(|p| self.seal(column, row, p)).transpose()
    }

    /// The plaintext of a stored text value: opened when sealed, unescaped when escaped, as it is
    /// when plain (module docs).
    pub fn open(&self, column: Column, row: &str, stored: String) -> Result<String, SealError> {
        if let Some(plain) = stored.strip_prefix(RAW) {
            return Ok(plain.to_owned());
        }
        // Without a keyring nothing here was sealed (a store opened without a key refuses a
        // database that records keys): a value that only looks sealed was written as plain text
        // before the reserved prefix was escaped, and reads as it is.
        if self.keys.is_none() {
            return Ok(stored);
        }
        let Some(raw) = sealed_text(&stored) else {
            return Ok(stored);
        };
        let plain = self.open_raw(column, row, &raw)?;
        String::from_utf8(plain).map_err(|_| SealError::Malformed(column.name()))
    }

    pub fn open_opt(
        &self,
        column: Column,
        row: &str,
        stored: Option<String>,
    ) -> Result<Option<String>, SealError> {
        stored.map(|s| self.open(column, row, s)).transpose()
    }

    /// Bytes to store in a byte column (bundles).
    pub fn seal_bytes<'a>(
        &self,
        column: Column,
        row: &str,
        plain: &'a [u8],
    ) -> Result<Cow<'a, [u8]>, SealError> {
        Ok(match self.seal_raw(column, row, plain)? {
            None if plain.starts_with(RESERVED.as_bytes()) => {
                Cow::Owned([RAW.as_bytes(), plain].concat())
            }
            None => Cow::Borrowed(plain),
            Some(raw) => {
                let mut bytes = Vec::with_capacity(PREFIX.len() + raw.len());
                bytes.extend_from_slice(PREFIX.as_bytes());
                bytes.extend_from_slice(&raw);
                Cow::Owned(bytes)
            }
        })
    }

    pub fn open_bytes(
        &self,
        column: Column,
        row: &str,
        stored: Vec<u8>,
    ) -> Result<Vec<u8>, SealError> {
        if let Some(plain) = stored.strip_prefix(RAW.as_bytes()) {
            return Ok(plain.to_vec());
        }
        // As in `open`: without a keyring nothing was sealed.
        if self.keys.is_none() {
            return Ok(stored);
        }
        match sealed_bytes(&stored) {
            None => Ok(stored),
            Some(raw) => self.open_raw(column, row, raw),
        }
    }

    /// Whether a stored text value is plain (escaped, legacy, or not well-formed sealed data) or
    /// which key sealed it.
    pub fn sealed_by(stored: &str) -> Sealed {
        if stored.starts_with(RAW) {
            return Sealed::Plain;
        }
        match sealed_text(stored) {
            None => Sealed::Plain,
            Some(raw) => Sealed::By(key_id_of(&raw)),
        }
    }

    /// [`Sealer::sealed_by`] for a byte column.
    pub fn sealed_by_bytes(stored: &[u8]) -> Sealed {
        if stored.starts_with(RAW.as_bytes()) {
            return Sealed::Plain;
        }
        match sealed_bytes(stored) {
            None => Sealed::Plain,
            Some(raw) => Sealed::By(key_id_of(raw)),
        }
    }

    /// Whether a reseal rewrites the value: plain, or sealed under a key that is not the current.
    /// Always false when off.
    pub fn needs_reseal(&self, sealed: Sealed) -> bool {
        match (self.current(), sealed) {
            (None, _) => false,
            (Some(_), Sealed::Plain) => true,
            (Some(current), Sealed::By(id)) => id != current,
        }
    }

    /// Startup: checks the keyring against the keys the database records (`(key id, check value)`
    /// of every key it holds values under). Off, any recorded key is [`SealError::Locked`]; on,
    /// every recorded key must be in the keyring and open its check value. Returns the record to
    /// add for the current key when the database does not have it yet (before any value is
    /// sealed under it).
    pub fn check(
        &self,
        recorded: &[(String, String)],
    ) -> Result<Option<(String, String)>, SealError> {
        let ids = recorded
            .iter()
            .map(|(id, _)| KeyId::parse(id).ok_or(SealError::Malformed(Column::KeyCheck.name())))
            .collect::<Result<Vec<_>, _>>()?;
        let Some(keys) = &self.keys else {
            return if ids.is_empty() {
                Ok(None)
            } else {
                Err(SealError::Locked(ids))
            };
        };
        let missing: Vec<KeyId> = ids
            .iter()
            .copied()
            .filter(|id| keys.find(*id).is_none())
            .collect();
        if !missing.is_empty() {
            return Err(SealError::MissingKeys(missing));
        }
        for (id, (text, check)) in ids.iter().zip(recorded) {
            if self.open_check(*id, text, check).is_err() {
                return Err(SealError::WrongKey(*id));
            }
        }
        let current = keys.current.id;
        if ids.contains(&current) {
            return Ok(None);
        }
        let id = current.to_string();
        let raw = seal_with(&keys.current, Column::KeyCheck, &id, CHECK_PLAINTEXT)?;
        Ok(Some((id, format!("{PREFIX}{}", B64.encode(raw)))))
    }

    fn open_check(&self, id: KeyId, row: &str, check: &str) -> Result<(), SealError> {
        let column = Column::KeyCheck;
        let raw = check
            .strip_prefix(PREFIX)
            .and_then(|b| B64.decode(b).ok())
            .ok_or(SealError::Malformed(column.name()))?;
        if raw.get(..KEY_ID_LEN) != Some(&id.0[..]) {
            return Err(SealError::WrongKey(id));
        }
        let plain = self.open_raw(column, row, &raw)?;
        if plain == CHECK_PLAINTEXT {
            Ok(())
        } else {
            Err(SealError::WrongKey(id))
        }
    }
}

/// The sealed bytes of a text value that is well-formed sealed data: the prefix, then base64url
/// of at least a key id, a nonce and a tag. `None`: a plain value.
fn sealed_text(stored: &str) -> Option<Vec<u8>> {
    let raw = B64.decode(stored.strip_prefix(PREFIX)?).ok()?;
    (raw.len() >= KEY_ID_LEN + NONCE_LEN + TAG_LEN).then_some(raw)
}

/// [`sealed_text`] for a byte column (no base64 there).
fn sealed_bytes(stored: &[u8]) -> Option<&[u8]> {
    let raw = stored.strip_prefix(PREFIX.as_bytes())?;
    (raw.len() >= KEY_ID_LEN + NONCE_LEN + TAG_LEN).then_some(raw)
}

/// The key id a well-formed sealed value starts with.
fn key_id_of(raw: &[u8]) -> KeyId {
    let mut id = [0u8; KEY_ID_LEN];
    // Well-formed sealed data is longer than a key id.
    if let Some(head) = raw.get(..KEY_ID_LEN) {
        id.copy_from_slice(head);
    }
    KeyId(id)
}

fn seal_with(key: &Key, column: Column, row: &str, plain: &[u8]) -> Result<Vec<u8>, SealError> {
    let nonce = XNonce::try_generate().map_err(|e| SealError::Random(e.to_string()))?;
    let ciphertext = key
        .cipher
        .encrypt(
            &nonce,
            Payload {
                msg: plain,
                aad: &aad(column, row),
            },
        )
        // Only a plaintext beyond the cipher's limit (256 GiB) fails.
        .map_err(|_| SealError::Malformed(column.name()))?;
    let mut raw = Vec::with_capacity(KEY_ID_LEN + NONCE_LEN + ciphertext.len());
    raw.extend_from_slice(&key.id.0);
    raw.extend_from_slice(nonce.as_slice());
    raw.extend_from_slice(&ciphertext);
    Ok(raw)
}

fn open_with(key: &Key, column: Column, row: &str, raw: &[u8]) -> Result<Vec<u8>, SealError> {
    let nonce = XNonce::try_from(&raw[KEY_ID_LEN..KEY_ID_LEN + NONCE_LEN])
        .map_err(|_| SealError::Malformed(column.name()))?;
    key.cipher
        .decrypt(
            &nonce,
            Payload {
                msg: &raw[KEY_ID_LEN + NONCE_LEN..],
                aad: &aad(column, row),
            },
        )
        .map_err(|_| SealError::Forged(column.name()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> Key {
        Key::from_bytes(&[byte; KEY_LEN]).expect("32 bytes")
    }

    fn sealer(current: u8, previous: &[u8]) -> Sealer {
        Sealer::new(
            Keyring::new(key(current), previous.iter().map(|b| key(*b)).collect())
                .expect("distinct keys"),
        )
    }

    #[test]
    fn values_round_trip_and_bind_to_their_place() {
        let s = sealer(1, &[]);
        let sealed = s
            .seal(Column::MessageBody, "row-1", "héllo")
            .expect("seal")
            .into_owned();
        assert!(sealed.starts_with(PREFIX));
        assert!(!sealed.contains("héllo"));
        assert_eq!(
            s.open(Column::MessageBody, "row-1", sealed.clone())
                .expect("open"),
            "héllo"
        );
        assert_eq!(
            s.open(Column::MessageBody, "row-2", sealed.clone()),
            Err(SealError::Forged("messages.body"))
        );
        assert_eq!(
            s.open(Column::TetherContent, "row-1", sealed.clone()),
            Err(SealError::Forged("tether.content"))
        );
        let again = s.seal(Column::MessageBody, "row-1", "héllo").expect("seal");
        assert_ne!(again, sealed, "a fresh nonce per value");
        // A character inside the base64 (the last one also carries padding bits, and a change
        // there can make the text undecodable, i.e. not sealed data at all).
        let mut tampered = sealed.into_bytes();
        let mid = PREFIX.len() + (tampered.len() - PREFIX.len()) / 2;
        tampered[mid] = if tampered[mid] == b'A' { b'B' } else { b'A' };
        let tampered = String::from_utf8(tampered).expect("ascii");
        assert!(s.open(Column::MessageBody, "row-1", tampered).is_err());

        let bytes = s
            .seal_bytes(Column::BundleBody, "cid", b"{\"a\":1}")
            .expect("seal")
            .into_owned();
        assert!(bytes.starts_with(PREFIX.as_bytes()));
        assert_eq!(
            s.open_bytes(Column::BundleBody, "cid", bytes)
                .expect("open"),
            b"{\"a\":1}"
        );
    }

    #[test]
    fn plain_values_pass_and_sealed_ones_need_a_key() {
        let off = Sealer::off();
        assert_eq!(
            off.seal(Column::SessionLastTask, "r", "task").expect("off"),
            "task"
        );
        assert_eq!(
            off.open(Column::SessionLastTask, "r", "task".into())
                .expect("off"),
            "task"
        );
        let on = sealer(1, &[]);
        assert_eq!(
            on.open(Column::SessionLastTask, "r", "legacy".into())
                .expect("plain"),
            "legacy"
        );
        let sealed = on
            .seal(Column::SessionLastTask, "r", "task")
            .expect("seal")
            .into_owned();
        // Without a keyring a value is never opened: a store opened without a key refuses a
        // database that records keys (`Sealer::check`), so what reaches `open` is plain text.
        assert_eq!(
            off.open(Column::SessionLastTask, "r", sealed.clone()),
            Ok(sealed.clone())
        );
        assert_eq!(
            sealer(2, &[]).open(Column::SessionLastTask, "r", sealed),
            Err(SealError::UnknownKey("sessions.last_task", key(1).id()))
        );
    }

    #[test]
    fn rotation_opens_old_values_and_reseals_them() {
        let old = sealer(1, &[]);
        let sealed = old
            .seal(Column::SnapshotState, "s", "{}")
            .expect("seal")
            .into_owned();
        let rotated = sealer(2, &[1]);
        assert_eq!(Sealer::sealed_by(&sealed), Sealed::By(key(1).id()));
        assert!(rotated.needs_reseal(Sealer::sealed_by(&sealed)));
        assert!(
            rotated.needs_reseal(Sealer::sealed_by("{}")),
            "plain values are sealed by a reseal"
        );
        assert_eq!(
            rotated
                .open(Column::SnapshotState, "s", sealed)
                .expect("previous key"),
            "{}"
        );
        let resealed = rotated
            .seal(Column::SnapshotState, "s", "{}")
            .expect("seal")
            .into_owned();
        assert_eq!(Sealer::sealed_by(&resealed), Sealed::By(key(2).id()));
        assert!(!rotated.needs_reseal(Sealer::sealed_by(&resealed)));
        let bytes = rotated
            .seal_bytes(Column::BundleBody, "c", b"x")
            .expect("seal");
        assert_eq!(Sealer::sealed_by_bytes(&bytes), Sealed::By(key(2).id()));
        assert_eq!(Sealer::sealed_by_bytes(b"{}"), Sealed::Plain);
        assert!(!Sealer::off().needs_reseal(Sealed::Plain));
    }

    #[test]
    fn startup_check_names_what_is_missing() {
        let first = sealer(1, &[]);
        let record = first.check(&[]).expect("empty db").expect("records key 1");
        assert_eq!(record.0, key(1).id().to_string());
        let recorded = vec![record];
        assert_eq!(first.check(&recorded), Ok(None));
        assert_eq!(Sealer::off().check(&[]), Ok(None));
        assert_eq!(
            Sealer::off().check(&recorded),
            Err(SealError::Locked(vec![key(1).id()]))
        );
        assert_eq!(
            sealer(3, &[]).check(&recorded),
            Err(SealError::MissingKeys(vec![key(1).id()]))
        );
        let rotated = sealer(2, &[1]).check(&recorded).expect("old key held");
        assert_eq!(rotated.map(|r| r.0), Some(key(2).id().to_string()));
        let forged = vec![(
            recorded[0].0.clone(),
            sealer(1, &[])
                .check(&[])
                .expect("x")
                .expect("y")
                .1
                .replace('A', "B"),
        )];
        assert!(first.check(&forged).is_err());
    }

    #[test]
    fn key_files_take_hex_or_base64_of_32_bytes() {
        let hex = "01".repeat(32);
        assert_eq!(
            Key::from_text(&format!("{hex}\n")).expect("hex").id(),
            key(1).id()
        );
        let b64 = base64::engine::general_purpose::STANDARD.encode([1u8; 32]);
        assert_eq!(Key::from_text(&b64).expect("b64").id(), key(1).id());
        let url = B64.encode([1u8; 32]);
        assert_eq!(Key::from_text(&url).expect("b64url").id(), key(1).id());
        let generated = Key::generate_text().expect("random");
        assert!(Key::from_text(&generated).is_ok());
        assert_ne!(generated, Key::generate_text().expect("random"));
        for bad in [
            "",
            "short",
            &"01".repeat(31),
            &base64::engine::general_purpose::STANDARD.encode([1u8; 16]),
        ] {
            assert!(
                matches!(Key::from_text(bad), Err(SealError::BadKey(_))),
                "{bad:?}"
            );
        }
        let err = Key::from_text("secret-looking-text")
            .expect_err("bad")
            .to_string();
        assert!(
            !err.contains("secret"),
            "the key text is never repeated: {err}"
        );
        assert!(matches!(
            Keyring::new(key(1), vec![key(1)]),
            Err(SealError::DuplicateKey(_))
        ));
        assert_eq!(KeyId::parse(&key(1).id().to_string()), Some(key(1).id()));
        assert_eq!(KeyId::parse("+f+f+f+f"), None, "signed hex is not an id");
        assert_eq!(KeyId::parse("0a0b0c0G"), None);
    }

    /// Encryption off: a value in the reserved family is escaped, so it never reads as sealed.
    #[test]
    fn reserved_prefix_values_are_escaped_and_legacy_ones_read_plain() {
        let off = Sealer::off();
        let on = sealer(1, &[]);
        for text in [
            "sbp:enc:v1:hello",
            "sbp:raw:x",
            "sbp:",
            &format!("{PREFIX}{}", "A".repeat(80)),
        ] {
            let stored = off
                .seal(Column::SessionLastTask, "r", text)
                .expect("off")
                .into_owned();
            assert!(stored.starts_with(RAW), "{stored}");
            assert_eq!(Sealer::sealed_by(&stored), Sealed::Plain);
            for s in [&off, &on] {
                assert_eq!(
                    s.open(Column::SessionLastTask, "r", stored.clone()),
                    Ok(text.to_owned())
                );
            }
            let bytes = off
                .seal_bytes(Column::BundleBody, "c", text.as_bytes())
                .expect("off")
                .into_owned();
            assert_eq!(Sealer::sealed_by_bytes(&bytes), Sealed::Plain);
            assert_eq!(
                on.open_bytes(Column::BundleBody, "c", bytes),
                Ok(text.as_bytes().to_vec())
            );
        }
        assert_eq!(
            off.seal(Column::SessionLastTask, "r", "plain")
                .expect("off"),
            "plain"
        );
        // Written before escaping existed: not well-formed sealed data, so plain, keyring or not.
        for legacy in [
            "sbp:enc:v1:hello",
            "sbp:enc:v1:AAAAAAAA",
            "sbp:enc:v1:",
            "sbp:enc:v1:a b",
        ] {
            assert_eq!(Sealer::sealed_by(legacy), Sealed::Plain, "{legacy}");
            for s in [&off, &on] {
                assert_eq!(
                    s.open(Column::SessionLastTask, "r", legacy.to_owned()),
                    Ok(legacy.to_owned())
                );
            }
            assert_eq!(
                on.open_bytes(Column::BundleBody, "c", legacy.as_bytes().to_vec()),
                Ok(legacy.as_bytes().to_vec())
            );
        }
        // Well-formed: without a keyring it can only be legacy plain text (a database that
        // records keys is refused without one); with a keyring it cannot be told from a sealed
        // value, so it must open.
        let looks_sealed = format!("{PREFIX}{}", "A".repeat(80));
        assert_eq!(
            off.open(Column::SessionLastTask, "r", looks_sealed.clone()),
            Ok(looks_sealed.clone())
        );
        assert_eq!(
            off.open_bytes(Column::BundleBody, "c", looks_sealed.as_bytes().to_vec()),
            Ok(looks_sealed.as_bytes().to_vec())
        );
        assert!(on.open(Column::SessionLastTask, "r", looks_sealed).is_err());
    }
}
