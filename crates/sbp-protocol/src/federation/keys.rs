//! A node's Ed25519 identity: the signing key (PKCS#8 PEM on disk) and the public key peers pin
//! (standard base64 of its SPKI DER), with the ids derived from it.
//!
//! Both DER forms are fixed-size for Ed25519 (RFC 8410), so they are written by prefix and read by
//! checking the exact bytes: no ASN.1 variation is accepted where a peer's key is compared.

use std::fmt;

use base64::Engine as _;
use base64::engine::DecodePaddingMode;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig, STANDARD};
use ed25519_dalek::pkcs8::DecodePrivateKey as _;
use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

/// The DER of an Ed25519 SubjectPublicKeyInfo up to the key: SEQUENCE { SEQUENCE { OID 1.3.101.112 },
/// BIT STRING (0 unused bits) } of 42 bytes, followed by the 32 key bytes.
pub const SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
];

/// The length of an Ed25519 SPKI DER.
pub const SPKI_LEN: usize = SPKI_PREFIX.len() + 32;

/// The DER of a PKCS#8 v1 Ed25519 private key up to the seed: what `openssl genpkey -algorithm
/// ed25519` writes (version 0, the algorithm, an OCTET STRING holding the 32-byte OCTET STRING).
const PKCS8_V1_PREFIX: [u8; 16] = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
];

/// Standard base64 that also takes the URL-safe alphabet's text after mapping, with or without
/// padding: a pin is often typed or pasted in a shell.
const B64_STANDARD_LENIENT: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Why a key could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// Not a PEM `PRIVATE KEY` holding a PKCS#8 Ed25519 key (the parser's reason; never key bytes).
    #[error("not a PKCS#8 Ed25519 private key: {0}")]
    Pkcs8(String),
    #[error("public key is not base64")]
    Base64,
    /// The bytes are not exactly the 44-byte SPKI of an Ed25519 key.
    #[error("public key is not an Ed25519 SubjectPublicKeyInfo ({len} bytes)")]
    NotEd25519Spki { len: usize },
    /// The SPKI's 32 bytes are not a valid Ed25519 point.
    #[error("public key is not a valid Ed25519 point")]
    InvalidPoint,
}

/// Why a signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("signature is {0} bytes, not 64")]
    Length(usize),
    /// It does not verify under the strict rules (no small-order keys, canonical `S`).
    #[error("signature does not verify")]
    Invalid,
}

/// A node's private signing key. Its `Debug` shows only the key id.
#[derive(Clone)]
pub struct IdentityKey(SigningKey);

impl IdentityKey {
    /// The key of a 32-byte seed (RFC 8032's private key). The caller brings the randomness.
    pub fn from_seed(seed: [u8; 32]) -> Self {
        Self(SigningKey::from_bytes(&seed))
    }

    /// Reads a PEM `PRIVATE KEY`: PKCS#8 v1 (OpenSSL's output) or v2 (with the public key, which
    /// must then match the seed).
    pub fn from_pkcs8_pem(pem: &str) -> Result<Self, KeyError> {
        SigningKey::from_pkcs8_pem(pem)
            .map(Self)
            .map_err(|e| KeyError::Pkcs8(e.to_string()))
    }

    /// The PEM `PRIVATE KEY` in PKCS#8 v1, byte for byte what `openssl genpkey -algorithm ed25519`
    /// writes (v1 because OpenSSL 3.0 cannot read the v2 form). Every buffer that holds the seed
    /// is wiped when dropped.
    pub fn to_pkcs8_pem(&self) -> Zeroizing<String> {
        let mut der = Zeroizing::new([0u8; PKCS8_V1_PREFIX.len() + 32]);
        der[..PKCS8_V1_PREFIX.len()].copy_from_slice(&PKCS8_V1_PREFIX);
        der[PKCS8_V1_PREFIX.len()..].copy_from_slice(self.0.as_bytes());
        const HEAD: &str = "-----BEGIN PRIVATE KEY-----\n";
        const TAIL: &str = "\n-----END PRIVATE KEY-----\n";
        // 48 DER bytes are 64 base64 characters: one PEM line, no wrapping needed. The capacity is
        // exact, so the string never reallocates and leaves no copy of the seed behind.
        let mut pem = Zeroizing::new(String::with_capacity(HEAD.len() + 64 + TAIL.len()));
        pem.push_str(HEAD);
        STANDARD.encode_string(&der[..], &mut pem);
        pem.push_str(TAIL);
        pem
    }

    pub fn public_key(&self) -> PublicKey {
        PublicKey(self.0.verifying_key())
    }

    /// The id peers know this key by: [`PublicKey::key_id`].
    pub fn key_id(&self) -> String {
        self.public_key().key_id()
    }

    /// The Ed25519 signature of `msg` (RFC 8032, deterministic).
    pub fn sign(&self, msg: &[u8]) -> [u8; 64] {
        self.0.sign(msg).to_bytes()
    }
}

impl fmt::Debug for IdentityKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdentityKey")
            .field("key_id", &self.key_id())
            .finish_non_exhaustive()
    }
}

/// A peer's (or our own) Ed25519 public key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublicKey(VerifyingKey);

impl PublicKey {
    /// Reads the manifest's `public_key` (or a pin's `KEY`): base64 of the 44-byte Ed25519 SPKI DER.
    /// Standard base64 is the form written; URL-safe and unpadded text are accepted too.
    pub fn from_b64_spki(s: &str) -> Result<Self, KeyError> {
        let s = s.trim();
        // Mapping the URL-safe characters onto the standard ones accepts both alphabets, and mixed
        // text decodes to the same bytes either way, so nothing ambiguous gets in.
        let standard: String = s
            .chars()
            .map(|c| match c {
                '-' => '+',
                '_' => '/',
                c => c,
            })
            .collect();
        let der = B64_STANDARD_LENIENT
            .decode(standard)
            .map_err(|_| KeyError::Base64)?;
        Self::from_spki_der(&der)
    }

    /// Reads the 44-byte Ed25519 SPKI DER, refusing any other algorithm or encoding.
    pub fn from_spki_der(der: &[u8]) -> Result<Self, KeyError> {
        let not_ed25519 = || KeyError::NotEd25519Spki { len: der.len() };
        let key = der.strip_prefix(&SPKI_PREFIX).ok_or_else(not_ed25519)?;
        let key: &[u8; 32] = key.try_into().map_err(|_| not_ed25519())?;
        VerifyingKey::from_bytes(key)
            .map(Self)
            .map_err(|_| KeyError::InvalidPoint)
    }

    /// The manifest's `public_key`: standard base64 (padded) of the SPKI DER.
    pub fn to_b64_spki(&self) -> String {
        STANDARD.encode(self.spki_der())
    }

    /// `302a300506032b6570032100` followed by the 32 key bytes.
    pub fn spki_der(&self) -> Vec<u8> {
        let mut der = Vec::with_capacity(SPKI_LEN);
        der.extend_from_slice(&SPKI_PREFIX);
        der.extend_from_slice(self.0.as_bytes());
        der
    }

    /// The raw 32 key bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        self.0.as_bytes()
    }

    /// The first 16 hex characters of SHA-256 of the SPKI DER: a token's `kid`.
    pub fn key_id(&self) -> String {
        self.spki_sha256_hex(16)
    }

    /// The first 32 hex characters of SHA-256 of the SPKI DER: a node's `gateway_id`, derived from
    /// its first key only (it is stored and survives rotation).
    pub fn derive_gateway_id(&self) -> String {
        self.spki_sha256_hex(32)
    }

    fn spki_sha256_hex(&self, chars: usize) -> String {
        let mut id = hex::encode(Sha256::digest(self.spki_der()));
        id.truncate(chars);
        id
    }

    /// Checks an Ed25519 signature with `verify_strict`: small-order keys and non-canonical
    /// signatures are refused, so one message has one valid signature per key.
    pub fn verify(&self, msg: &[u8], sig: &[u8]) -> Result<(), SignatureError> {
        let sig = Signature::from_slice(sig).map_err(|_| SignatureError::Length(sig.len()))?;
        self.0
            .verify_strict(msg, &sig)
            .map_err(|_| SignatureError::Invalid)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // In tests a panic is the failure report.
mod tests {
    use super::*;

    /// RFC 8032 section 7.1, test 1 (the empty message).
    const RFC8032_SEED: &str = "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60";
    const RFC8032_PUBLIC: &str = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a";
    const RFC8032_SIGNATURE: &str = "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b";

    /// Made once with `openssl genpkey -algorithm ed25519` (OpenSSL 3.0).
    const OPENSSL_PEM: &str = "-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEINTNOOoEQrT8eJ7gx7yrRv9yyk07qOdUghCAWUbQpFTj
-----END PRIVATE KEY-----
";
    /// `openssl pkey -in key.pem -pubout -outform DER | base64` of that key.
    const OPENSSL_PUBLIC_B64: &str = "MCowBQYDK2VwAyEAj2totGKho5DfLsw1u3pSSPytFgLDX69TZs6CPRHWlC0=";
    /// `... | sha256sum` of the same DER.
    const OPENSSL_SPKI_SHA256: &str =
        "e2960ec3b8b7af09613b4d48af823315a496551ec508adf38e2b7f0d6b84b991";

    /// `printf 'sbp federation interop' | openssl pkeyutl -sign -inkey key.pem -rawin` with that key.
    const OPENSSL_SIGNATURE: &str = "8b43bb51a568a0862d8b2ec168d5deda0f5ebf1e1939c1e236a428a41d3efeae3bc1c81809b065cbfdaa3158e46c417bccae612379f62d99dc0f0320fce31308";

    fn seed(hex_seed: &str) -> [u8; 32] {
        hex::decode(hex_seed).unwrap().try_into().unwrap()
    }

    #[test]
    fn rfc8032_test_1() {
        let key = IdentityKey::from_seed(seed(RFC8032_SEED));
        assert_eq!(hex::encode(key.public_key().as_bytes()), RFC8032_PUBLIC);
        let sig = key.sign(b"");
        assert_eq!(hex::encode(sig), RFC8032_SIGNATURE);
        assert_eq!(key.public_key().verify(b"", &sig), Ok(()));
        assert_eq!(
            key.public_key().verify(b"x", &sig),
            Err(SignatureError::Invalid)
        );
        assert_eq!(
            key.public_key().verify(b"", &sig[..63]),
            Err(SignatureError::Length(63))
        );
        assert_eq!(
            key.public_key().verify(b"", &[]),
            Err(SignatureError::Length(0))
        );
    }

    #[test]
    fn openssl_key_loads_and_is_written_back_identically() {
        let key = IdentityKey::from_pkcs8_pem(OPENSSL_PEM).unwrap();
        let public = key.public_key();
        assert_eq!(public.to_b64_spki(), OPENSSL_PUBLIC_B64);
        assert_eq!(public.key_id(), OPENSSL_SPKI_SHA256[..16]);
        assert_eq!(public.derive_gateway_id(), OPENSSL_SPKI_SHA256[..32]);
        assert_eq!(key.key_id(), public.key_id());
        assert_eq!(key.to_pkcs8_pem().as_str(), OPENSSL_PEM);
        let msg = b"sbp federation interop";
        assert_eq!(hex::encode(key.sign(msg)), OPENSSL_SIGNATURE);
        let from_b64 = PublicKey::from_b64_spki(OPENSSL_PUBLIC_B64).unwrap();
        assert_eq!(
            from_b64.verify(msg, &hex::decode(OPENSSL_SIGNATURE).unwrap()),
            Ok(())
        );
    }

    #[test]
    fn pem_round_trip() {
        let key = IdentityKey::from_seed([7; 32]);
        let pem = key.to_pkcs8_pem();
        let back = IdentityKey::from_pkcs8_pem(&pem).unwrap();
        assert_eq!(back.public_key(), key.public_key());
        assert_eq!(back.sign(b"m"), key.sign(b"m"));
    }

    /// A PKCS#8 v2 (RFC 8410 `OneAsymmetricKey` with `publicKey [1]`) PEM of `seed`, with `public`
    /// as the embedded public key.
    fn v2_pem(seed: &[u8; 32], public: &[u8; 32]) -> String {
        let mut der = vec![
            0x30, 0x51, 0x02, 0x01, 0x01, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22,
            0x04, 0x20,
        ];
        der.extend_from_slice(seed);
        der.extend_from_slice(&[0x81, 0x21, 0x00]);
        der.extend_from_slice(public);
        let b64 = STANDARD.encode(&der);
        let lines: Vec<&str> = b64
            .as_bytes()
            .chunks(64)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect();
        format!(
            "-----BEGIN PRIVATE KEY-----\n{}\n-----END PRIVATE KEY-----\n",
            lines.join("\n")
        )
    }

    #[test]
    fn pkcs8_v2_loads_and_its_public_key_must_match() {
        let seed = [9u8; 32];
        let public = *IdentityKey::from_seed(seed).public_key().as_bytes();
        let key = IdentityKey::from_pkcs8_pem(&v2_pem(&seed, &public)).unwrap();
        assert_eq!(key.public_key().as_bytes(), &public);
        let other = *IdentityKey::from_seed([8; 32]).public_key().as_bytes();
        assert!(matches!(
            IdentityKey::from_pkcs8_pem(&v2_pem(&seed, &other)),
            Err(KeyError::Pkcs8(_))
        ));
    }

    /// RFC 8410 section 10.3: PKCS#8 v2 with an attribute and the public key.
    const RFC8410_V2_PEM: &str = "-----BEGIN PRIVATE KEY-----
MHICAQEwBQYDK2VwBCIEINTuctv5E1hK1bbY8fdp+K06/nwoy/HU++CXqI9EdVhC
oB8wHQYKKoZIhvcNAQkJFDEPDA1DdXJkbGUgQ2hhaXJzgSEAGb9ECWmEzf6FQbrB
Z9w7lshQhqowtrbLDFw4rXAxZuE=
-----END PRIVATE KEY-----
";

    #[test]
    fn rfc8410_v2_example_loads() {
        let key = IdentityKey::from_pkcs8_pem(RFC8410_V2_PEM).unwrap();
        assert_eq!(
            hex::encode(key.public_key().as_bytes()),
            "19bf44096984cdfe8541bac167dc3b96c85086aa30b6b6cb0c5c38ad703166e1"
        );
    }

    #[test]
    fn garbage_pem_is_refused() {
        for pem in [
            "",
            "-----BEGIN PRIVATE KEY-----\n-----END PRIVATE KEY-----\n",
            "-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEAj2totGKho5DfLsw1u3pSSPytFgLDX69TZs6CPRHWlC0=\n-----END PUBLIC KEY-----\n",
        ] {
            assert!(
                matches!(IdentityKey::from_pkcs8_pem(pem), Err(KeyError::Pkcs8(_))),
                "{pem}"
            );
        }
    }

    #[test]
    fn debug_shows_only_the_key_id() {
        let key = IdentityKey::from_seed(seed(RFC8032_SEED));
        assert_eq!(
            format!("{key:?}"),
            format!("IdentityKey {{ key_id: {:?}, .. }}", key.key_id())
        );
    }

    #[test]
    fn spki_b64_round_trip_and_lenient_forms() {
        let public = IdentityKey::from_seed([3; 32]).public_key();
        let b64 = public.to_b64_spki();
        assert_eq!(b64.len(), 60);
        assert!(b64.ends_with('='));
        assert_eq!(public.spki_der().len(), SPKI_LEN);
        assert_eq!(
            hex::encode(&public.spki_der()[..12]),
            "302a300506032b6570032100"
        );
        assert_eq!(PublicKey::from_b64_spki(&b64).unwrap(), public);
        let url_safe = b64.replace('+', "-").replace('/', "_");
        assert_eq!(PublicKey::from_b64_spki(&url_safe).unwrap(), public);
        assert_eq!(
            PublicKey::from_b64_spki(b64.trim_end_matches('=')).unwrap(),
            public
        );
        assert_eq!(
            PublicKey::from_b64_spki(url_safe.trim_end_matches('=')).unwrap(),
            public
        );
        assert_eq!(PublicKey::from_b64_spki("%%%"), Err(KeyError::Base64));
    }

    #[test]
    fn non_ed25519_spki_is_refused() {
        // An X25519 key (OID 1.3.101.110): same length, other algorithm.
        let mut x25519 = IdentityKey::from_seed([3; 32]).public_key().spki_der();
        x25519[8] = 0x6e;
        assert_eq!(
            PublicKey::from_b64_spki(&STANDARD.encode(&x25519)),
            Err(KeyError::NotEd25519Spki { len: 44 })
        );
        // A P-256 SPKI (91 bytes), as `openssl ecparam -genkey -name prime256v1 | openssl pkey -pubout` writes.
        let p256 = "MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEC4GEiH7q+lPus/4/TAHmUGrKD9PKchAQCAL6mM+KIDu1pKyzS3CKzwiNhIpOZNYnr+kv/Yi57xtZkvyDrJSOOA==";
        assert_eq!(
            PublicKey::from_b64_spki(p256),
            Err(KeyError::NotEd25519Spki { len: 91 })
        );
        // The raw 32 key bytes alone, and the SPKI with a trailing byte.
        let public = IdentityKey::from_seed([3; 32]).public_key();
        assert_eq!(
            PublicKey::from_b64_spki(&STANDARD.encode(public.as_bytes())),
            Err(KeyError::NotEd25519Spki { len: 32 })
        );
        let mut long = public.spki_der();
        long.push(0);
        assert_eq!(
            PublicKey::from_b64_spki(&STANDARD.encode(&long)),
            Err(KeyError::NotEd25519Spki { len: 45 })
        );
    }

    #[test]
    fn invalid_point_is_refused() {
        // y = 2 does not decompress to a point on the curve.
        let mut der = SPKI_PREFIX.to_vec();
        let mut y = [0u8; 32];
        y[0] = 2;
        der.extend_from_slice(&y);
        assert_eq!(PublicKey::from_spki_der(&der), Err(KeyError::InvalidPoint));
    }

    #[test]
    fn small_order_key_verifies_nothing() {
        // The identity point (y = 1): with it, the "signature" R = identity, S = 0 satisfies the
        // cofactored and the plain equation for every message; verify_strict refuses it.
        let mut der = SPKI_PREFIX.to_vec();
        let mut y = [0u8; 32];
        y[0] = 1;
        der.extend_from_slice(&y);
        let weak = PublicKey::from_spki_der(&der).unwrap();
        let mut sig = [0u8; 64];
        sig[0] = 1;
        assert_eq!(weak.verify(b"anything", &sig), Err(SignatureError::Invalid));
    }
}
