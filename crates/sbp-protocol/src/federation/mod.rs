//! Gateway federation (SBP L6), the pure part: Ed25519 identity keys, signed JSON, the
//! `/.well-known/sbp` manifest and its trust rules, federation tokens (EdDSA JWS) and the signed
//! records gateways and trackers exchange. No IO: callers bring the clock, the randomness and the
//! keys they trust.

pub mod fields;
pub mod jws;
pub mod keys;
pub mod manifest;
pub mod records;
pub mod signed;

/// The crate whose `Zeroizing` wraps [`IdentityKey::to_pkcs8_pem`]'s output.
pub use zeroize;

pub use fields::FieldError;
pub use jws::{
    CLOCK_SKEW_SECS, Expect, FED_TOKEN_TYP, FedClaims, FedTokenError, MAX_FED_TOKEN_LIFETIME_SECS,
    Unverified, peek, sign_fed_token,
};
pub use keys::{IdentityKey, KeyError, PublicKey, SignatureError};
pub use manifest::{
    Endpoints, MAX_MANIFEST_VALIDITY_SECS, Manifest, ManifestError, ManifestTrust, OldKey, Role,
    VerifiedManifest, verify_manifest,
};
pub use records::{
    GatewayVouch, HandoverCommit, HandoverEnvelope, HandoverTetherEntry, MAX_ANSWER_LIFETIME_SECS,
    MAX_RECORD_LIFETIME_SECS, MAX_VOUCH_LIFETIME_SECS, ProviderRecord, RecordError, RedeemAnswer,
    RegistryAnswer, is_cid,
};
pub use signed::{
    OLD_SIGNATURE, SIGNATURE, SignedError, add_old_signature, sign_object, signing_bytes,
    verify_object, verify_old_signature,
};
