//! Federation (L6) end to end: gateways and trackers as real `sbp serve` processes on loopback,
//! each with its own SQLite data dir and an identity key the test wrote (so the test can sign as
//! any of them), plus peers and trackers the test fakes to lie. Covers the signed manifest and
//! routes by role, export with announce and import by CID through a tracker, the bundle route's
//! refusals (every forged federation token, replay also across `kill -9`), tampered and wrong
//! bundles, forged tracker answers, key rotation followed by a peer, record expiry, SRV discovery,
//! single use of a roaming token across gateways, and the tracker's refusals of records. Tests
//! marked `ignore = "defect: ..."` show what the gateway gets wrong today.

#[path = "federation/fakes.rs"]
pub mod fakes;
#[path = "federation/net.rs"]
pub mod net;

use std::os::unix::fs::PermissionsExt as _;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use chrono::Utc;
use hmac::{Hmac, Mac as _};
use sbp_protocol::bundle::compute_cid;
use sbp_protocol::federation::{
    GatewayVouch, IdentityKey, ManifestError, ManifestTrust, ProviderRecord, RedeemAnswer,
    RegistryAnswer, Role, peek, sign_fed_token, verify_manifest, verify_object,
    verify_old_signature,
};
use sbp_test_support::{TestDns, TestSrv};
use serde_json::{Map, Value, json};
use sha2::{Digest as _, Sha256};

use crate::support::{Sbp, WAIT, eventually, run_to_end, sbp_command, sbp_serve_in, send};
use fakes::FakeNode;
use net::{
    Node, bearer_get, bundle_of, claims, claims_object, compact, contains, conversation,
    corrupt_bundle, export, fed_header, files_under, has_family, hour, import, imported, metric,
    object, random_cid, roaming_sid, same_history, sessions, status_code, time,
};

/// Where a peer redeems a roaming token at the gateway that minted it.
const REDEEM_PATH: &str = "/v1/sbp/federation/tokens/redeem";

/// The manifest of `node` checked field by field against what the issue fixes, and its signature
/// against the key the test wrote.
fn check_manifest(node: &Node, m: &Map<String, Value>, role: Role) {
    let now = Utc::now();
    assert_eq!(m["sbp_version"], sbp_protocol::DEFAULT_SBP_VERSION, "{m:?}");
    assert_eq!(m["gateway_id"], node.gateway_id.as_str(), "{m:?}");
    assert_eq!(m["gateway_name"], node.name.as_str(), "{m:?}");
    assert_eq!(m["role"], role.as_str(), "{m:?}");
    assert_eq!(m["federation"], true, "{m:?}");
    assert_eq!(m["public_key"], node.public_key().to_b64_spki(), "{m:?}");
    assert_eq!(m["key_id"], node.key.key_id(), "{m:?}");
    assert_eq!(m["old_keys"], json!([]), "{m:?}");
    assert!(m["signature"].is_string(), "{m:?}");
    let valid_until = time(&m["valid_until"]);
    assert!(valid_until > now, "{m:?}");
    assert!(
        valid_until <= now + chrono::Duration::days(7),
        "valid_until at most 7 days ahead: {m:?}"
    );

    let ws = node.url.replacen("http://", "ws://", 1);
    let u = &node.url;
    let gateway = json!({
        "ws": format!("{ws}/v1/sbp/ws/{{session_id}}"),
        "export": format!("{u}/v1/sbp/sessions/{{session_id}}/export"),
        "import": format!("{u}/v1/sbp/sessions/import"),
        "bundle": format!("{u}/v1/sbp/bundles/{{bundle_cid}}"),
    });
    let registry = format!("{u}/v1/sbp/registry");
    let expected = match role {
        Role::Gateway => gateway,
        Role::Tracker => json!({ "registry": registry }),
        Role::Both => {
            let mut all = gateway;
            all["registry"] = json!(registry);
            all
        }
    };
    assert_eq!(m["endpoints"], expected, "{}", node.name);

    let v = verify_manifest(m, ManifestTrust::Pinned(&node.public_key()), now)
        .unwrap_or_else(|e| panic!("{}'s manifest verifies by its key: {e}", node.name));
    assert_eq!(v.manifest.gateway_id, node.gateway_id);
    assert_eq!(v.rotated_from, None);
    // The signature covers the content, and only the node's key makes it.
    let mut changed = m.clone();
    changed.insert("gateway_name".into(), json!("someone else"));
    assert!(matches!(
        verify_manifest(&changed, ManifestTrust::Pinned(&node.public_key()), now),
        Err(ManifestError::Signature(_))
    ));
    let stranger = IdentityKey::from_seed([0xEE; 32]).public_key();
    assert!(matches!(
        verify_manifest(m, ManifestTrust::Pinned(&stranger), now),
        Err(ManifestError::Untrusted)
    ));
}

/// 1. The manifest's shape and signature for each role; a plain `sbp serve` has no manifest and
/// says L5; a federated gateway says L6; a tracker-only node serves no session, bundle or
/// WebSocket route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifest_is_signed_and_routes_follow_the_role() {
    let plain_dir = tempfile::tempdir().expect("tempdir");
    let plain = Sbp::start(plain_dir.path(), &[]).await;
    let mut gateway = Node::new("gw-one", 11).await;
    gateway.start(&["--role", "gateway"]).await;
    let mut tracker = Node::new("tracker-one", 12).await;
    tracker.start(&["--role", "tracker"]).await;
    let mut both = Node::new("both-one", 13).await;
    both.start(&["--role", "both"]).await;

    // Without a federation flag nothing of L6 is there.
    let (status, _, body) = send(plain.get("/.well-known/sbp")).await;
    assert_eq!(status, 404, "{body}");
    assert!(
        !plain_dir.path().join("federation.key").exists(),
        "no identity key is made"
    );
    let (id, token) = conversation(&plain, "plain").await;
    let (ws, attached) = plain.attach(&id, &token).await;
    assert_eq!(attached["type"], "SESSION_ATTACHED", "{attached}");
    assert_eq!(attached["sbp_level"], "L5", "{attached}");
    ws.close().await;

    for (node, role) in [
        (&gateway, Role::Gateway),
        (&tracker, Role::Tracker),
        (&both, Role::Both),
    ] {
        let m = node.manifest().await;
        check_manifest(node, &m, role);
    }

    for node in [&gateway, &both] {
        let (id, token) = conversation(node.gw(), "federated").await;
        let (ws, attached) = node.gw().attach(&id, &token).await;
        assert_eq!(attached["sbp_level"], "L6", "{}: {attached}", node.name);
        ws.close().await;
    }

    // A tracker hosts no sessions.
    let t = tracker.gw();
    let cid = random_cid();
    for (what, req) in [
        (
            "chat",
            t.post(
                "/v1/chat/completions",
                &json!({"model": "sbp/echo", "messages": [{"role": "user", "content": "hi"}]}),
            ),
        ),
        (
            "import",
            t.post("/v1/sbp/sessions/import", &json!({"bundle_cid": cid})),
        ),
        ("bundle", t.get(&format!("/v1/sbp/bundles/{cid}"))),
        (
            "websocket",
            t.get(&format!("/v1/sbp/ws/{}", uuid::Uuid::new_v4()))
                .header("connection", "upgrade")
                .header("upgrade", "websocket")
                .header("sec-websocket-version", "13")
                .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ),
        ("sessions", t.post("/v1/sessions", &json!({}))),
    ] {
        let (status, _, body) = send(req).await;
        assert_eq!(status, 404, "a tracker has no {what} route: {body}");
    }
    let (status, _, body) = send(t.get("/healthz")).await;
    assert_eq!(status, 200, "{body}");
    // ... and a gateway no registry, while `both` has it (an empty record is refused, not 404).
    let (status, _, body) = send(gateway.gw().post("/v1/sbp/registry", &json!({}))).await;
    assert_eq!(status, 404, "{body}");
    for node in [&tracker, &both] {
        let (status, _, body) = send(node.gw().post("/v1/sbp/registry", &json!({}))).await;
        assert_eq!(
            status_code(status, &body),
            (400, "SBP_REGISTRY_RECORD_INVALID".to_owned()),
            "{}: {body}",
            node.name
        );
    }
}

/// Without `--federation-key` a node makes its identity key at first start, in the data dir,
/// private, never logged, and keeps it; `sbp federation public-key --data-dir` prints the key its
/// manifest names, and the gateway id is derived from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generated_identity_key_is_private_and_kept() {
    let dir = tempfile::tempdir().expect("tempdir");
    let start = || {
        let mut cmd = sbp_serve_in(dir.path(), &["--role", "gateway"]);
        cmd.env("SBP_LOG", "debug");
        Sbp::spawn(cmd)
    };
    let manifest = |gw: &Sbp| {
        let req = gw.get("/.well-known/sbp");
        async move {
            let (status, _, body) = send(req).await;
            assert_eq!(status, 200, "{body}");
            body
        }
    };
    let mut gw = start().await;
    let first = manifest(&gw).await;
    let key_file = dir.path().join("federation.key");
    let mode = std::fs::metadata(&key_file)
        .expect("the generated key file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "mode {mode:o}");
    let pem = std::fs::read_to_string(&key_file).expect("read the key");
    let key = IdentityKey::from_pkcs8_pem(&pem).expect("PKCS#8 Ed25519");
    assert_eq!(first["public_key"], key.public_key().to_b64_spki());
    assert_eq!(
        first["gateway_id"],
        key.public_key().derive_gateway_id(),
        "derived from the first key"
    );
    let data_dir = dir.path().display().to_string();
    let (code, out, err) = run_to_end(
        sbp_command("federation", &["public-key", "--data-dir", &data_dir]),
        WAIT,
    )
    .await;
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.trim(), key.public_key().to_b64_spki());

    gw.proc.kill9();
    let (out, err) = gw.proc.output();
    let secret_line = pem.lines().nth(1).expect("the PEM's base64 line");
    assert!(!out.contains(secret_line) && !err.contains(secret_line));
    let gw = start().await;
    let again = manifest(&gw).await;
    assert_eq!(
        (&again["public_key"], &again["gateway_id"]),
        (&first["public_key"], &first["gateway_id"]),
        "the key is kept across restarts"
    );
}

/// 2. A exports with `"announce": true`; C, which like A pins only the tracker, imports by CID:
/// the tracker names A in a signed answer holding A's signed record, C trusts A (and A trusts
/// C) through the tracker's vouches, and the session arrives whole. The tracker never sees the
/// session's content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_announced_on_a_is_imported_by_cid_on_c_through_the_tracker() {
    let mut t = Node::new("tracker-two", 21).await;
    t.start(&["--role", "tracker"]).await;
    let mut a = Node::new("gw-a-two", 22).await;
    a.start(&["--tracker", &t.pin()]).await;
    let mut c = Node::new("gw-c-two", 23).await;
    c.start(&["--tracker", &t.pin()]).await;
    for node in [&a, &c] {
        let vouch = node.wait_vouched_by(&t).await;
        assert!(verify_object(&vouch, &t.public_key()).is_ok(), "{vouch:?}");
        let vouch = GatewayVouch::read(&vouch).expect("a vouch");
        assert_eq!(
            (
                vouch.tracker_id.as_str(),
                vouch.gateway_url.as_str(),
                vouch.public_key
            ),
            (
                t.gateway_id.as_str(),
                node.url.as_str(),
                node.public_key().to_b64_spki()
            )
        );
    }

    let marker = format!("secret-{}", uuid::Uuid::new_v4().simple());
    let (id, token) = conversation(a.gw(), &marker).await;
    let exported = export(a.gw(), &id, &token, json!({"announce": true})).await;
    assert_eq!(
        exported["announced_to"],
        json!([t.gateway_id]),
        "{exported}"
    );
    let cid = exported["bundle_cid"].as_str().expect("cid").to_owned();

    let (status, headers, answer) = send(t.gw().get(&format!("/v1/sbp/registry/{cid}"))).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        headers.get("cache-control").and_then(|v| v.to_str().ok()),
        Some("no-store")
    );
    let answer = object(answer);
    assert!(
        verify_object(&answer, &t.public_key()).is_ok(),
        "signed by the tracker's key: {answer:?}"
    );
    let read = RegistryAnswer::read(&answer).expect("a registry answer");
    assert_eq!(read.tracker_id, t.gateway_id);
    assert_eq!(read.bundle_cid, cid);
    assert!(read.check(&cid, Utc::now()).is_ok(), "fresh, at most 5 min");
    assert_eq!(read.providers.len(), 1, "{answer:?}");
    let record = &read.providers[0];
    assert!(
        verify_object(record, &a.public_key()).is_ok(),
        "A's own signature on its record: {record:?}"
    );
    let record = ProviderRecord::read(record).expect("a provider record");
    assert_eq!(record.gateway_id, a.gateway_id);
    assert_eq!(record.bundle_url, a.bundle_url(&cid));
    assert!(
        !serde_json::to_string(&answer)
            .expect("json")
            .contains(&marker),
        "no content in the answer"
    );

    let (status, v) = import(c.gw(), json!({"bundle_cid": cid})).await;
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["bundle_cid"], cid.as_str(), "{v}");
    let (new_id, new_token) = imported(&v);
    let original = a.gw().messages(&id, &token).await;
    assert_eq!(original.len(), 4, "{original:?}");
    assert!(original[0].1.contains(&marker));
    same_history(&c.gw().messages(&new_id, &new_token).await, &original);

    assert_eq!(
        metric(
            &c.metrics().await,
            "sbp_federation_bundle_fetches_total{outcome=\"ok\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &a.metrics().await,
            "sbp_federation_bundle_serves_total{outcome=\"served\"}"
        ),
        1.0
    );
    let tm = t.metrics().await;
    assert_eq!(
        metric(&tm, "sbp_tracker_announces_total{outcome=\"created\"}"),
        1.0,
        "{tm}"
    );
    assert!(metric(&tm, "sbp_tracker_lookups_total{outcome=\"found\"}") >= 2.0);

    // The tracker's store holds the record (the CID) and nothing of the session.
    let files = files_under(&t.data_dir);
    assert!(
        files.iter().any(|(_, b)| contains(b, cid.as_bytes())),
        "the tracker stored the record: {:?}",
        files.iter().map(|(p, _)| p).collect::<Vec<_>>()
    );
    for (path, bytes) in &files {
        assert!(
            !contains(bytes, marker.as_bytes()),
            "{} holds session content",
            path.display()
        );
    }
}

/// 3. The bundle route refuses a malformed CID, a missing token, every forged token, an
/// untrusted issuer, and a replayed `jti`, also after `kill -9` and a restart; a valid token gets
/// the bytes of exactly that CID with `Content-Digest` and `Cache-Control: no-store`; a stored
/// bundle corrupted on disk is never served (500).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bundle_route_refuses_forged_and_replayed_tokens() {
    let mut c = Node::new("gw-c-three", 31).await;
    c.start(&["--role", "gateway"]).await;
    // A peer the test plays itself, to see when A fetches its manifest.
    let f = FakeNode::start(Role::Gateway, 33).await;
    let mut a = Node::new("gw-a-three", 32).await;
    a.start(&["--peer", &c.pin(), "--peer", &f.pin()]).await;
    let (id, token) = conversation(a.gw(), "bundle route").await;
    let exported = export(a.gw(), &id, &token, json!({})).await;
    let cid = exported["bundle_cid"].as_str().expect("cid").to_owned();
    let roaming = exported["roaming_token"]
        .as_str()
        .expect("roaming token")
        .to_owned();
    let path = format!("/v1/sbp/bundles/{cid}");

    for bad in [
        "z".repeat(64),
        cid.to_uppercase(),
        cid[..63].to_owned(),
        format!("{cid}0"),
    ] {
        let token = c.token(
            &a.gateway_id,
            &bad,
            "GET",
            &format!("/v1/sbp/bundles/{bad}"),
        );
        let (status, _, body) = send(bearer_get(
            a.gw(),
            Some(&token),
            &format!("/v1/sbp/bundles/{bad}"),
        ))
        .await;
        assert_eq!(
            status_code(status, &body),
            (422, "SBP_INVALID_CID".to_owned()),
            "{bad}: {body}"
        );
    }

    let (status, headers, body) = send(bearer_get(a.gw(), None, &path)).await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(
        body["error"]["code"], "SBP_FEDERATION_TOKEN_INVALID",
        "{body}"
    );
    assert!(
        headers
            .get("www-authenticate")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("Bearer")),
        "{headers:?}"
    );

    // Forged tokens, each with the reason the metrics must count it under.
    let valid = || claims(&c.gateway_id, &a.gateway_id, &cid, "GET", &path);
    let sign_c = |claims: &sbp_protocol::federation::FedClaims| sign_fed_token(claims, &c.key);
    let other = IdentityKey::from_seed([0x77; 32]);
    let mut forged: Vec<(String, String, &str)> = Vec::new();
    // Signed by another key under that key's id, claiming to be C.
    forged.push((
        "unknown kid".into(),
        compact(
            &fed_header(&other.key_id()),
            &Value::Object(claims_object(&valid())),
            |b| other.sign(b).to_vec(),
        ),
        "unknown_kid",
    ));
    forged.push((
        "C's kid, another key's signature".into(),
        compact(
            &fed_header(&c.key.key_id()),
            &Value::Object(claims_object(&valid())),
            |b| other.sign(b).to_vec(),
        ),
        "signature",
    ));
    let mut wrong_aud = valid();
    wrong_aud.aud = c.gateway_id.clone();
    forged.push(("wrong aud".into(), sign_c(&wrong_aud), "aud"));
    let mut wrong_sub = valid();
    wrong_sub.sub = random_cid();
    forged.push(("wrong sub".into(), sign_c(&wrong_sub), "sub"));
    let mut wrong_htm = valid();
    wrong_htm.htm = "POST".into();
    forged.push(("wrong htm".into(), sign_c(&wrong_htm), "htm"));
    let mut full_url = valid();
    full_url.htu = format!("{}{path}", a.url);
    forged.push(("htu with scheme and host".into(), sign_c(&full_url), "htu"));
    let mut other_path = valid();
    other_path.htu = format!("/v1/sbp/bundles/{}", random_cid());
    forged.push(("htu of another path".into(), sign_c(&other_path), "htu"));
    forged.push((
        "alg none".into(),
        compact(
            &json!({"alg": "none", "typ": "sbp-fed+jwt", "kid": c.key.key_id()}),
            &Value::Object(claims_object(&valid())),
            |_| Vec::new(),
        ),
        "alg",
    ));
    let hs256 = |secret: &[u8]| {
        let secret = secret.to_vec();
        compact(
            &json!({"alg": "HS256", "typ": "sbp-fed+jwt", "kid": c.key.key_id()}),
            &Value::Object(claims_object(&valid())),
            move |b| {
                let mut mac = Hmac::<Sha256>::new_from_slice(&secret).expect("any key length");
                mac.update(b);
                mac.finalize().into_bytes().to_vec()
            },
        )
    };
    forged.push((
        "HS256 keyed with A's public key".into(),
        hs256(a.public_key().as_bytes()),
        "alg",
    ));
    forged.push((
        "HS256 keyed with C's published public_key".into(),
        hs256(c.public_key().to_b64_spki().as_bytes()),
        "alg",
    ));
    let now = Utc::now().timestamp();
    let mut expired = valid();
    (expired.iat, expired.exp) = (now - 200, now - 80);
    forged.push(("expired 80 s ago".into(), sign_c(&expired), "expired"));
    let mut ahead = valid();
    (ahead.iat, ahead.exp) = (now + 75, now + 175);
    forged.push(("iat 75 s ahead".into(), sign_c(&ahead), "iat_future"));
    let mut long = valid();
    long.exp = long.iat + 301;
    forged.push(("lifetime 301 s".into(), sign_c(&long), "lifetime"));
    for claim in ["iss", "aud", "sub", "htm", "htu", "iat", "exp", "jti"] {
        let mut payload = claims_object(&valid());
        payload.remove(claim);
        forged.push((
            format!("without {claim}"),
            compact(&fed_header(&c.key.key_id()), &Value::Object(payload), |b| {
                c.key.sign(b).to_vec()
            }),
            "missing_claim",
        ));
    }
    forged.push(("a roaming token".into(), roaming.clone(), "alg"));
    forged.push((
        "typ JWT".into(),
        compact(
            &json!({"alg": "EdDSA", "typ": "JWT", "kid": c.key.key_id()}),
            &Value::Object(claims_object(&valid())),
            |b| c.key.sign(b).to_vec(),
        ),
        "typ",
    ));

    let mut expected_reasons: std::collections::BTreeMap<&str, u32> = Default::default();
    expected_reasons.insert("missing", 1);
    for (what, token, reason) in &forged {
        let (status, headers, body) = send(bearer_get(a.gw(), Some(token), &path)).await;
        assert_eq!(
            status_code(status, &body),
            (401, "SBP_FEDERATION_TOKEN_INVALID".to_owned()),
            "{what}: {body}"
        );
        assert!(
            headers.contains_key("www-authenticate"),
            "{what}: {headers:?}"
        );
        *expected_reasons.entry(reason).or_default() += 1;
    }

    // An unknown kid makes A refetch the peer's manifest at most once per 30 s (the fetch that
    // first learned the peer does not count).
    let as_f = |c: &sbp_protocol::federation::FedClaims| sign_fed_token(c, &f.key);
    let f_valid = || claims(&f.gateway_id, &a.gateway_id, &cid, "GET", &path);
    let (status, _, body) = send(bearer_get(a.gw(), Some(&as_f(&f_valid())), &path)).await;
    assert_eq!(status, 200, "F is pinned: {body}");
    assert_eq!(f.manifest_fetches(), 1, "learned once");
    for round in 0..3 {
        let token = compact(
            &fed_header(&other.key_id()),
            &Value::Object(claims_object(&f_valid())),
            |b| other.sign(b).to_vec(),
        );
        let (status, _, body) = send(bearer_get(a.gw(), Some(&token), &path)).await;
        assert_eq!(
            status_code(status, &body),
            (401, "SBP_FEDERATION_TOKEN_INVALID".to_owned()),
            "round {round}: {body}"
        );
        *expected_reasons.entry("unknown_kid").or_default() += 1;
    }
    assert_eq!(
        f.manifest_fetches(),
        2,
        "one refetch for three unknown kids within 30 s"
    );

    // A valid token from a gateway A does not trust.
    let stranger = IdentityKey::from_seed([0x78; 32]);
    let untrusted = sign_fed_token(
        &claims(
            &stranger.public_key().derive_gateway_id(),
            &a.gateway_id,
            &cid,
            "GET",
            &path,
        ),
        &stranger,
    );
    let (status, _, body) = send(bearer_get(a.gw(), Some(&untrusted), &path)).await;
    assert_eq!(
        status_code(status, &body),
        (403, "SBP_FEDERATION_UNTRUSTED".to_owned()),
        "{body}"
    );
    expected_reasons.insert("untrusted", 1);

    // A valid token: the bytes of exactly this CID.
    let good = c.token(&a.gateway_id, &cid, "GET", &path);
    let resp = tokio::time::timeout(WAIT, bearer_get(a.gw(), Some(&good), &path).send())
        .await
        .expect("in time")
        .expect("sent");
    assert_eq!(resp.status(), 200);
    let headers = resp.headers().clone();
    let bytes = resp.bytes().await.expect("body");
    assert_eq!(
        headers.get("cache-control").and_then(|v| v.to_str().ok()),
        Some("no-store")
    );
    let digest = format!("sha-256=:{}:", STANDARD.encode(Sha256::digest(&bytes)));
    assert_eq!(
        headers.get("content-digest").and_then(|v| v.to_str().ok()),
        Some(digest.as_str())
    );
    let bundle = object(serde_json::from_slice(&bytes).expect("a JSON bundle"));
    assert_eq!(
        compute_cid(&bundle),
        cid,
        "the recomputed CID is the one asked"
    );

    // Replayed: refused, also by the restarted process (the jti is in the database).
    let (status, headers, body) = send(bearer_get(a.gw(), Some(&good), &path)).await;
    assert_eq!(
        status_code(status, &body),
        (401, "SBP_FEDERATION_TOKEN_REPLAYED".to_owned()),
        "{body}"
    );
    assert!(headers.contains_key("www-authenticate"), "{headers:?}");
    expected_reasons.insert("replayed", 1);

    // A valid token for a CID A does not hold.
    let absent = random_cid();
    let absent_path = format!("/v1/sbp/bundles/{absent}");
    let (status, _, body) = send(bearer_get(
        a.gw(),
        Some(&c.token(&a.gateway_id, &absent, "GET", &absent_path)),
        &absent_path,
    ))
    .await;
    assert_eq!(status, 404, "{body}");

    let text = a.metrics().await;
    for (reason, n) in &expected_reasons {
        assert_eq!(
            metric(
                &text,
                &format!("sbp_federation_token_rejections_total{{reason=\"{reason}\"}}")
            ),
            f64::from(*n),
            "rejections for {reason}:\n{text}"
        );
    }

    a.kill9();
    a.restart().await;
    let (status, _, body) = send(bearer_get(a.gw(), Some(&good), &path)).await;
    assert_eq!(
        status_code(status, &body),
        (401, "SBP_FEDERATION_TOKEN_REPLAYED".to_owned()),
        "still refused after kill -9: {body}"
    );
    let fresh = c.token(&a.gateway_id, &cid, "GET", &path);
    let (status, _, body) = send(bearer_get(a.gw(), Some(&fresh), &path)).await;
    assert_eq!(status, 200, "a new token still works: {body}");

    // A stored bundle that no longer matches its CID is never served.
    a.kill9();
    corrupt_bundle(
        &a.data_dir.join("sbp.db"),
        &cid,
        "bundle route",
        "bundle rouTe",
    );
    a.restart().await;
    let fresh = c.token(&a.gateway_id, &cid, "GET", &path);
    let (status, _, body) = send(bearer_get(a.gw(), Some(&fresh), &path)).await;
    assert_eq!(
        status_code(status, &body),
        (500, "SBP_BUNDLE_CORRUPT".to_owned()),
        "{body}"
    );
    assert!(!body.to_string().contains("bundle rou"), "{body}");
    assert_eq!(
        metric(
            &a.metrics().await,
            "sbp_federation_bundle_serves_total{outcome=\"corrupt\"}"
        ),
        1.0
    );
}

/// 4. A malicious peer (listed first) serving tampered bytes, then a valid bundle of another CID:
/// each refused, the honest peer serves; with only the malicious peer, 502; a CID nobody has, 404;
/// a peer named by `from` but not trusted is never asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malicious_peer_bytes_are_refused_and_the_next_provider_serves() {
    let evil = FakeNode::start(Role::Gateway, 41).await;
    let mut g = Node::new("gw-g-four", 42).await;
    let mut h = Node::new("gw-h-four", 43).await;
    let mut lone = Node::new("gw-lone-four", 44).await;
    h.start(&["--peer", &g.pin()]).await;
    g.start(&["--peer", &evil.pin(), "--peer", &h.pin()]).await;
    lone.start(&["--peer", &evil.pin()]).await;

    let (cid1, bundle1, id1, token1) = bundle_of(h.gw(), "honest one").await;
    let (cid2, _, id2, token2) = bundle_of(h.gw(), "honest two").await;
    let text = serde_json::to_string(&bundle1).expect("json");
    assert!(text.contains("honest one"));
    let tampered = text.replacen("honest one", "forged one", 1).into_bytes();
    evil.serve_bundle(&cid1, tampered);

    let (status, v) = import(g.gw(), json!({"bundle_cid": cid1})).await;
    assert_eq!(status, 201, "the honest peer serves: {v}");
    let (nid, ntoken) = imported(&v);
    same_history(
        &g.gw().messages(&nid, &ntoken).await,
        &h.gw().messages(&id1, &token1).await,
    );
    let gm = g.metrics().await;
    assert_eq!(
        metric(
            &gm,
            "sbp_federation_bundle_fetches_total{outcome=\"bad_bytes\"}"
        ),
        1.0,
        "{gm}"
    );
    // The malicious peer was asked first, with a token for it, for exactly that bundle.
    let bearers = evil.bearers();
    assert_eq!(bearers.len(), 1, "{bearers:?}");
    let seen = peek(&bearers[0]).expect("a federation token");
    assert_eq!(
        (
            seen.claims.iss.as_str(),
            seen.claims.aud.as_str(),
            seen.claims.sub.as_str()
        ),
        (
            g.gateway_id.as_str(),
            evil.gateway_id.as_str(),
            cid1.as_str()
        )
    );
    assert_eq!(
        (seen.claims.htm.as_str(), seen.claims.htu.as_str()),
        ("GET", format!("/v1/sbp/bundles/{cid1}").as_str())
    );

    // A valid bundle, of another CID than the one asked.
    evil.serve_bundle(&cid2, serde_json::to_vec(&bundle1).expect("json"));
    let (status, v) = import(g.gw(), json!({"bundle_cid": cid2})).await;
    assert_eq!(status, 201, "{v}");
    let (nid, ntoken) = imported(&v);
    same_history(
        &g.gw().messages(&nid, &ntoken).await,
        &h.gw().messages(&id2, &token2).await,
    );
    let gm = g.metrics().await;
    assert_eq!(
        metric(
            &gm,
            "sbp_federation_bundle_fetches_total{outcome=\"bad_bytes\"}"
        ),
        2.0,
        "{gm}"
    );
    assert_eq!(
        metric(&gm, "sbp_federation_bundle_fetches_total{outcome=\"ok\"}"),
        2.0,
        "{gm}"
    );

    // Only the malicious peer: every provider served bad bytes.
    for cid in [&cid1, &cid2] {
        let (status, v) = import(lone.gw(), json!({"bundle_cid": cid})).await;
        assert_eq!(
            status_code(status, &v),
            (502, "SBP_BUNDLE_UNAVAILABLE".to_owned()),
            "{v}"
        );
    }
    let (status, v) = import(g.gw(), json!({"bundle_cid": random_cid()})).await;
    assert_eq!(
        status_code(status, &v),
        (404, "SBP_NOT_FOUND".to_owned()),
        "{v}"
    );

    // A URL named in the request confers no trust: a peer G does not pin is never asked for
    // bytes, even though it holds a valid bundle nobody else has.
    let stranger = FakeNode::start(Role::Gateway, 45).await;
    let (cid3, bundle3, _, _) = bundle_of(lone.gw(), "only the stranger has it").await;
    stranger.serve_bundle(&cid3, serde_json::to_vec(&bundle3).expect("json"));
    let (status, v) = import(g.gw(), json!({"bundle_cid": cid3, "from": stranger.url})).await;
    assert_eq!(
        status_code(status, &v),
        (404, "SBP_NOT_FOUND".to_owned()),
        "{v}"
    );
    assert_eq!(stranger.bearers(), Vec::<String>::new(), "never asked");
}

/// 5. A pinned tracker whose lookup answers lie: each is ignored and nothing is imported; a
/// correct answer from the same tracker, naming an honest gateway, works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_tracker_answers_are_ignored() {
    let fake = FakeNode::start(Role::Tracker, 51).await;
    let mut g = Node::new("gw-g-five", 52).await;
    let mut h = Node::new("gw-h-five", 53).await;
    g.start(&["--tracker", &fake.pin()]).await;
    h.start(&["--peer", &g.pin()]).await;
    let (cid, _, id, token) = bundle_of(h.gw(), "provided by h").await;

    let now = Utc::now();
    fake.vouch_for(
        &h.gateway_id,
        GatewayVouch {
            tracker_id: fake.gateway_id.clone(),
            gateway_id: h.gateway_id.clone(),
            gateway_url: h.url.clone(),
            public_key: h.public_key().to_b64_spki(),
            key_id: h.key.key_id(),
            verified_at: now,
            expires_at: now + hour(),
        }
        .to_signed_map(&fake.key),
    );
    let answer = |asked: &str,
                  providers: Vec<Map<String, Value>>,
                  issued: chrono::DateTime<Utc>,
                  key: &IdentityKey| {
        RegistryAnswer {
            tracker_id: fake.gateway_id.clone(),
            bundle_cid: asked.to_owned(),
            issued_at: issued,
            expires_at: issued + chrono::Duration::minutes(5),
            providers,
        }
        .to_signed_map(key)
    };
    let good_record = h.record(&cid, 1, hour());
    let bytes = |m: Map<String, Value>| serde_json::to_vec(&m).expect("json");

    let mut flipped = answer(&cid, vec![good_record.clone()], now, &fake.key);
    let mut signature = STANDARD
        .decode(flipped["signature"].as_str().expect("signature"))
        .expect("base64");
    signature[10] ^= 0x01;
    flipped.insert("signature".into(), json!(STANDARD.encode(signature)));
    let mut unsigned = good_record.clone();
    unsigned.remove("signature");
    let forged_record = ProviderRecord::read(&good_record)
        .expect("record")
        .to_signed_map(&IdentityKey::from_seed([0x55; 32]));
    let other_cid_record = h.record(&random_cid(), 1, hour());
    let mut expired_record = good_record.clone();
    expired_record.insert(
        "expires_at".into(),
        json!((now - chrono::Duration::minutes(1)).to_rfc3339()),
    );
    expired_record.insert(
        "issued_at".into(),
        json!((now - chrono::Duration::minutes(2)).to_rfc3339()),
    );
    sbp_protocol::federation::sign_object(&mut expired_record, &h.key);

    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("a flipped byte in the signature", bytes(flipped)),
        (
            "signed by another key",
            bytes(answer(
                &cid,
                vec![good_record.clone()],
                now,
                &IdentityKey::from_seed([0x56; 32]),
            )),
        ),
        (
            "stale",
            bytes(answer(
                &cid,
                vec![good_record.clone()],
                now - chrono::Duration::minutes(10),
                &fake.key,
            )),
        ),
        (
            "for another CID",
            bytes(answer(
                &random_cid(),
                vec![good_record.clone()],
                now,
                &fake.key,
            )),
        ),
        (
            "an unsigned record",
            bytes(answer(&cid, vec![unsigned], now, &fake.key)),
        ),
        (
            "a record signed by another key",
            bytes(answer(&cid, vec![forged_record], now, &fake.key)),
        ),
        (
            "a record for another CID",
            bytes(answer(&cid, vec![other_cid_record], now, &fake.key)),
        ),
        (
            "an expired record",
            bytes(answer(&cid, vec![expired_record], now, &fake.key)),
        ),
    ];
    for (what, answer) in cases {
        fake.answer_lookups(answer);
        let before = fake.lookups();
        let (status, v) = import(g.gw(), json!({"bundle_cid": cid})).await;
        assert_eq!(
            status_code(status, &v),
            (404, "SBP_NOT_FOUND".to_owned()),
            "{what}: {v}"
        );
        assert!(fake.lookups() > before, "{what}: the tracker was asked");
    }
    let gm = g.metrics().await;
    assert_eq!(
        metric(
            &gm,
            "sbp_federation_tracker_queries_total{outcome=\"bad_answer\"}"
        ),
        4.0,
        "{gm}"
    );
    assert!(
        !has_family(&gm, "sbp_federation_bundle_fetches_total"),
        "no provider was asked for bytes:\n{gm}"
    );
    assert!(
        !has_family(&h.metrics().await, "sbp_federation_bundle_serves_total"),
        "h never served"
    );
    assert_eq!(sessions(&gm), 0.0, "nothing was imported:\n{gm}");

    fake.answer_lookups(bytes(answer(
        &cid,
        vec![good_record],
        Utc::now(),
        &fake.key,
    )));
    let (status, v) = import(g.gw(), json!({"bundle_cid": cid})).await;
    assert_eq!(status, 201, "the correct answer works: {v}");
    let (nid, ntoken) = imported(&v);
    same_history(
        &g.gw().messages(&nid, &ntoken).await,
        &h.gw().messages(&id, &token).await,
    );
}

/// 6. B rotates its key while stopped; its manifest then lists the old key and carries
/// `old_signature`, and A, which pinned B's old key, follows: B's token signed by the new key is
/// accepted after A refetches B's manifest. After a second rotation whose old key expired at
/// once, A (pinned to the first key, still listed) still trusts B, and a node that pinned the
/// expired key does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_rotation_is_followed_by_a_peer_that_pinned_the_old_key() {
    let mut a = Node::new("gw-a-six", 61).await;
    let mut b = Node::new("gw-b-six", 62).await;
    a.start(&["--peer", &b.pin()]).await;
    b.start(&["--peer", &a.pin()]).await;
    let old = b.key.clone();

    let (cid1, _, _, _) = bundle_of(a.gw(), "before the rotation").await;
    let (status, v) = import(b.gw(), json!({"bundle_cid": cid1})).await;
    assert_eq!(status, 201, "A knows B by its first key: {v}");

    b.kill9();
    let key_file = b.key_file.display().to_string();
    let (code, out, err) = run_to_end(
        sbp_command("federation", &["rotate-key", "--federation-key", &key_file]),
        WAIT,
    )
    .await;
    assert_eq!(code, Some(0), "{err}");
    b.reload_key();
    assert_ne!(b.key.key_id(), old.key_id(), "a new key");
    assert_eq!(out.trim(), b.public_key().to_b64_spki(), "{out}");
    let (code, out, err) = run_to_end(
        sbp_command("federation", &["public-key", "--federation-key", &key_file]),
        WAIT,
    )
    .await;
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.trim(), b.public_key().to_b64_spki());
    b.restart().await;

    let m = b.manifest().await;
    let now = Utc::now();
    assert_eq!(
        m["gateway_id"],
        b.gateway_id.as_str(),
        "the id outlives the key"
    );
    assert_eq!(m["public_key"], b.public_key().to_b64_spki());
    assert_eq!(m["key_id"], b.key.key_id());
    let old_keys = m["old_keys"].as_array().expect("old_keys");
    assert_eq!(old_keys.len(), 1, "{m:?}");
    assert_eq!(old_keys[0]["key_id"], old.key_id());
    assert_eq!(old_keys[0]["public_key"], old.public_key().to_b64_spki());
    let expires = time(&old_keys[0]["expires_at"]);
    assert!(
        expires > now + chrono::Duration::days(6) && expires <= now + chrono::Duration::days(7),
        "the old key verifies for 7 days: {expires}"
    );
    assert!(verify_object(&m, &b.public_key()).is_ok());
    assert!(
        verify_old_signature(&m, &old.public_key()).is_ok(),
        "old_signature by the old key: {m:?}"
    );
    let v = verify_manifest(&m, ManifestTrust::Pinned(&old.public_key()), now)
        .expect("the old pin follows the rotation");
    assert_eq!(v.rotated_from, Some(old.public_key()));

    // B's token now carries the new key's id, which A has never seen.
    let (cid2, _, id2, token2) = bundle_of(a.gw(), "after the rotation").await;
    let (status, v) = import(b.gw(), json!({"bundle_cid": cid2})).await;
    assert_eq!(status, 201, "A followed B's rotation: {v}");
    let (nid, ntoken) = imported(&v);
    same_history(
        &b.gw().messages(&nid, &ntoken).await,
        &a.gw().messages(&id2, &token2).await,
    );
    let am = a.metrics().await;
    assert!(
        !has_family(&am, "sbp_federation_token_rejections_total"),
        "no token of B was refused:\n{am}"
    );

    // A second rotation whose old key (the one A followed to) stops verifying after 1 s; the
    // first key, which A pinned, still verifies for days.
    let followed = b.key.clone();
    b.kill9();
    let (code, _, err) = run_to_end(
        sbp_command(
            "federation",
            &[
                "rotate-key",
                "--federation-key",
                &key_file,
                "--old-key-ttl",
                "1s",
            ],
        ),
        WAIT,
    )
    .await;
    assert_eq!(code, Some(0), "{err}");
    b.reload_key();
    b.restart().await;
    let m = eventually(WAIT, "the followed key expired", || async {
        let m = b.manifest().await;
        let listed: Vec<Value> = m["old_keys"]
            .as_array()
            .expect("old_keys")
            .iter()
            .map(|k| k["key_id"].clone())
            .collect();
        (listed == [json!(old.key_id())]).then_some(m)
    })
    .await;
    assert_eq!(m["public_key"], b.public_key().to_b64_spki());
    assert!(verify_old_signature(&m, &old.public_key()).is_ok(), "{m:?}");
    let now = Utc::now();
    assert!(verify_manifest(&m, ManifestTrust::Pinned(&old.public_key()), now).is_ok());
    assert!(matches!(
        verify_manifest(&m, ManifestTrust::Pinned(&followed.public_key()), now),
        Err(ManifestError::Untrusted)
    ));

    // A, started afresh, still follows B from its pin.
    a.kill9();
    a.restart().await;
    let path = format!("/v1/sbp/bundles/{cid2}");
    let (status, _, body) = send(bearer_get(
        a.gw(),
        Some(&b.token(&a.gateway_id, &cid2, "GET", &path)),
        &path,
    ))
    .await;
    assert_eq!(status, 200, "{body}");
    // A node that pinned the expired key does not.
    let mut d = Node::new("gw-d-six", 63).await;
    let stale_pin = format!("{}#{}", b.url, followed.public_key().to_b64_spki());
    d.start(&["--peer", &stale_pin]).await;
    let cid = random_cid();
    let path = format!("/v1/sbp/bundles/{cid}");
    let (status, _, body) = send(bearer_get(
        d.gw(),
        Some(&b.token(&d.gateway_id, &cid, "GET", &path)),
        &path,
    ))
    .await;
    assert_eq!(
        status_code(status, &body),
        (403, "SBP_FEDERATION_UNTRUSTED".to_owned()),
        "an expired old key verifies nothing: {body}"
    );
}

/// 7. A record announced with a short TTL is found at once and not after it expires (the
/// gateway stopped, so nothing can renew it); a gateway's announces are rate limited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announced_records_expire_and_announces_are_rate_limited() {
    let mut t = Node::new("tracker-seven", 71).await;
    t.start(&["--role", "tracker", "--tracker-announce-rate", "1/m,2"])
        .await;
    let mut a = Node::new("gw-a-seven", 72).await;
    a.start(&["--tracker", &t.pin(), "--announce-ttl", "3s"])
        .await;
    a.wait_vouched_by(&t).await;

    let (id, token) = conversation(a.gw(), "short lived").await;
    let exported = export(a.gw(), &id, &token, json!({"announce": true})).await;
    assert_eq!(
        exported["announced_to"],
        json!([t.gateway_id]),
        "{exported}"
    );
    let cid = exported["bundle_cid"].as_str().expect("cid").to_owned();
    let lookup = format!("/v1/sbp/registry/{cid}");

    let (status, _, answer) = send(t.gw().get(&lookup)).await;
    assert_eq!(status, 200, "found at once: {answer}");
    let record = ProviderRecord::read(
        answer["providers"][0]
            .as_object()
            .expect("a provider record"),
    )
    .expect("record");
    assert_eq!(
        record.expires_at - record.issued_at,
        chrono::Duration::seconds(3),
        "{answer}"
    );

    // Two announces a minute, in a burst of two: A's export used one.
    let post = |record: Map<String, Value>| {
        let req = t.gw().post("/v1/sbp/registry", &Value::Object(record));
        async move {
            let (status, _, body) = send(req).await;
            status_code(status, &body)
        }
    };
    assert_eq!(post(a.record(&random_cid(), 1, hour())).await.0, 201);
    assert_eq!(
        post(a.record(&random_cid(), 1, hour())).await,
        (429, "SBP_REGISTRY_QUOTA".to_owned())
    );

    a.kill9();
    let gone_at = eventually(Duration::from_secs(15), "the record expired", || {
        let req = t.gw().get(&lookup);
        async move {
            let (status, _, body) = send(req).await;
            match status {
                404 => Some(Utc::now()),
                200 => None,
                other => panic!("lookup answered {other}: {body}"),
            }
        }
    })
    .await;
    assert!(
        gone_at >= record.expires_at - chrono::Duration::seconds(1),
        "not before its expiry: gone at {gone_at}, expires {}",
        record.expires_at
    );
}

/// 7b. `--announce-ttl` says a record is renewed while its export lives: with a 3 s TTL and a
/// 24 h export, the tracker keeps finding the bundle past the first record's expiry, under a
/// newer record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announced_records_are_renewed_while_the_export_lives() {
    let mut t = Node::new("tracker-seven-b", 73).await;
    t.start(&["--role", "tracker"]).await;
    let mut a = Node::new("gw-a-seven-b", 74).await;
    a.start(&["--tracker", &t.pin(), "--announce-ttl", "3s"])
        .await;
    a.wait_vouched_by(&t).await;

    let (id, token) = conversation(a.gw(), "long lived export").await;
    let exported = export(a.gw(), &id, &token, json!({"announce": true})).await;
    assert_eq!(
        exported["announced_to"],
        json!([t.gateway_id]),
        "{exported}"
    );
    let cid = exported["bundle_cid"].as_str().expect("cid").to_owned();
    let lookup = format!("/v1/sbp/registry/{cid}");
    let first = {
        let (status, _, answer) = send(t.gw().get(&lookup)).await;
        assert_eq!(status, 200, "{answer}");
        ProviderRecord::read(answer["providers"][0].as_object().expect("record")).expect("record")
    };
    let renewed = eventually(Duration::from_secs(15), "a renewed record", || {
        let req = t.gw().get(&lookup);
        async move {
            let (status, _, answer) = send(req).await;
            assert_eq!(
                status, 200,
                "the record lapsed while its export lives: {answer}"
            );
            let record = ProviderRecord::read(answer["providers"][0].as_object().expect("record"))
                .expect("record");
            (record.expires_at > first.expires_at).then_some(record)
        }
    })
    .await;
    assert!(renewed.seq > first.seq, "{renewed:?} after {first:?}");
}

/// 8. SRV discovery: C finds A (and B, tried first by priority) under `_sbp._tcp.fed.test` on a
/// DNS server the test runs, trusts them on first use, and imports by CID. Without TOFU and
/// without a pin, D skips the same targets; and once A's key changes without a rotation, C no
/// longer trusts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn srv_peers_are_candidates_that_must_pass_trust() {
    let mut a = Node::new("gw-a-eight", 81).await;
    let mut b = Node::new("gw-b-eight", 82).await;
    let mut c = Node::new("gw-c-eight", 83).await;
    let mut d = Node::new("gw-d-eight", 84).await;
    const SERVICE: &str = "_sbp._tcp.fed.test.";
    let dns = TestDns::start(
        "fed.test.",
        vec![
            TestSrv::new(SERVICE, 20, 0, a.relay_port(), "127.0.0.1."),
            TestSrv::new(SERVICE, 10, 0, b.relay_port(), "127.0.0.1."),
        ],
    )
    .await;
    let dns_addr = dns.addr.to_string();
    a.start(&["--peer", &c.pin()]).await;
    b.start(&["--peer", &c.pin()]).await;
    let srv = [
        "--peer-srv",
        "fed.test",
        "--dns-server",
        &dns_addr,
        "--federation-allow-http",
    ];
    let mut with_tofu = srv.to_vec();
    with_tofu.push("--federation-tofu");
    c.start(&with_tofu).await;
    d.start(&srv).await;

    let (id, token) = conversation(a.gw(), "found through dns").await;
    let exported = export(a.gw(), &id, &token, json!({})).await;
    let cid = exported["bundle_cid"].as_str().expect("cid").to_owned();

    let (status, v) = import(c.gw(), json!({"bundle_cid": cid})).await;
    assert_eq!(status, 201, "{v}");
    let (nid, ntoken) = imported(&v);
    same_history(
        &c.gw().messages(&nid, &ntoken).await,
        &a.gw().messages(&id, &token).await,
    );
    let cm = c.metrics().await;
    assert_eq!(
        metric(
            &cm,
            "sbp_federation_bundle_fetches_total{outcome=\"not_found\"}"
        ),
        1.0,
        "B (priority 10) was asked first:\n{cm}"
    );
    assert_eq!(
        metric(&cm, "sbp_federation_bundle_fetches_total{outcome=\"ok\"}"),
        1.0,
        "{cm}"
    );

    let (status, v) = import(d.gw(), json!({"bundle_cid": cid})).await;
    assert_eq!(
        status_code(status, &v),
        (404, "SBP_NOT_FOUND".to_owned()),
        "an SRV target is not trusted by being listed: {v}"
    );
    assert!(
        !has_family(&d.metrics().await, "sbp_federation_bundle_fetches_total"),
        "D asked no untrusted target for bytes"
    );
    assert_eq!(
        metric(
            &a.metrics().await,
            "sbp_federation_bundle_serves_total{outcome=\"served\"}"
        ),
        1.0
    );

    // A's key replaced without a rotation (no old_signature): C, which trusted A on first use,
    // no longer does, also after a restart (the key it trusted is stored).
    a.kill9();
    let replaced = IdentityKey::from_seed([0x85; 32]);
    std::fs::write(&a.key_file, replaced.to_pkcs8_pem().as_bytes()).expect("write the key");
    a.reload_key();
    a.restart().await;
    assert_eq!(
        a.manifest().await["public_key"],
        a.public_key().to_b64_spki()
    );
    let (id2, token2) = conversation(a.gw(), "after a key change").await;
    let exported = export(a.gw(), &id2, &token2, json!({})).await;
    let cid2 = exported["bundle_cid"].as_str().expect("cid").to_owned();
    c.kill9();
    c.restart().await;
    let (status, v) = import(c.gw(), json!({"bundle_cid": cid2})).await;
    assert_eq!(
        status_code(status, &v),
        (404, "SBP_NOT_FOUND".to_owned()),
        "a changed key without old_signature is not trusted: {v}"
    );
    assert!(
        !has_family(&a.metrics().await, "sbp_federation_bundle_serves_total"),
        "C did not ask A"
    );
}

/// 9. One roaming token minted by A, imported on B and C at once: exactly one succeeds, the
/// other is told the token is consumed, and so is A (and the winner) afterwards. The redeem route
/// refuses an untrusted caller and a token for another session, answers a trusted one signed,
/// and consumes the token for everyone but that caller's own retry. A fork (`allow_reuse`) consumes
/// nothing; with the minting gateway down the import is 503 and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_roaming_token_is_single_use_across_gateways() {
    let mut t = Node::new("tracker-nine", 91).await;
    t.start(&["--role", "tracker"]).await;
    let mut a = Node::new("gw-a-nine", 92).await;
    let mut b = Node::new("gw-b-nine", 93).await;
    let mut c = Node::new("gw-c-nine", 94).await;
    for node in [&mut a, &mut b, &mut c] {
        node.start(&["--tracker", &t.pin()]).await;
    }
    for node in [&a, &b, &c] {
        node.wait_vouched_by(&t).await;
    }

    let (id, token) = conversation(a.gw(), "one owner").await;
    let exported = export(a.gw(), &id, &token, json!({})).await;
    let roaming = exported["roaming_token"]
        .as_str()
        .expect("token")
        .to_owned();
    assert_eq!(
        sbp_protocol::token::peek_iss(&roaming).as_deref(),
        Some(a.gateway_id.as_str()),
        "the token names its minting gateway"
    );
    // A fork (`allow_reuse`) redeemed at A consumes nothing.
    let (status, v) = import(
        b.gw(),
        json!({"roaming_token": roaming, "allow_reuse": true}),
    )
    .await;
    assert_eq!(status, 201, "a fork: {v}");
    let (fid, ftoken) = imported(&v);
    same_history(
        &b.gw().messages(&fid, &ftoken).await,
        &a.gw().messages(&id, &token).await,
    );

    let body = json!({"roaming_token": roaming});
    let ((sb, vb), (sc, vc)) =
        tokio::join!(import(b.gw(), body.clone()), import(c.gw(), body.clone()));
    let mut outcomes = [(sb, &vb, &b), (sc, &vc, &c)];
    outcomes.sort_by_key(|(s, _, _)| *s);
    let [(won, won_body, winner), (lost, lost_body, _)] = outcomes;
    assert_eq!((won, lost), (201, 410), "B: {vb}\nC: {vc}");
    assert_eq!(
        lost_body["error"]["code"], "SBP_TOKEN_CONSUMED",
        "{lost_body}"
    );
    let (nid, ntoken) = imported(won_body);
    same_history(
        &winner.gw().messages(&nid, &ntoken).await,
        &a.gw().messages(&id, &token).await,
    );

    let (status, v) = import(a.gw(), body.clone()).await;
    assert_eq!(
        status_code(status, &v),
        (410, "SBP_TOKEN_CONSUMED".to_owned()),
        "{v}"
    );
    let (status, v) = import(winner.gw(), body).await;
    assert_eq!(
        status_code(status, &v),
        (410, "SBP_TOKEN_CONSUMED".to_owned()),
        "not twice on the winner either: {v}"
    );

    // The redeem route itself, called by the test as B (which A trusts through the tracker).
    let (id3, token3) = conversation(a.gw(), "redeemed directly").await;
    let exported3 = export(a.gw(), &id3, &token3, json!({})).await;
    let roaming3 = exported3["roaming_token"]
        .as_str()
        .expect("token")
        .to_owned();
    let sid = roaming_sid(&roaming3);
    assert_eq!(sid, id3);
    let redeem = |bearer: &str| {
        let req = a
            .gw()
            .post(REDEEM_PATH, &json!({"roaming_token": roaming3}))
            .bearer_auth(bearer);
        async move { send(req).await }
    };
    let stranger = IdentityKey::from_seed([0x95; 32]);
    let untrusted = sign_fed_token(
        &claims(
            &stranger.public_key().derive_gateway_id(),
            &a.gateway_id,
            &sid,
            "POST",
            REDEEM_PATH,
        ),
        &stranger,
    );
    let (status, _, v) = redeem(&untrusted).await;
    assert_eq!(
        status_code(status, &v),
        (403, "SBP_FEDERATION_UNTRUSTED".to_owned()),
        "{v}"
    );
    let other_session = uuid::Uuid::new_v4().to_string();
    let (status, _, v) = redeem(&b.token(&a.gateway_id, &other_session, "POST", REDEEM_PATH)).await;
    assert_eq!(
        status_code(status, &v),
        (401, "SBP_FEDERATION_TOKEN_INVALID".to_owned()),
        "a federation token for another session: {v}"
    );
    let as_b = b.token(&a.gateway_id, &sid, "POST", REDEEM_PATH);
    let (status, headers, answer) = redeem(&as_b).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        headers.get("cache-control").and_then(|v| v.to_str().ok()),
        Some("no-store")
    );
    let answer = object(answer);
    assert!(
        verify_object(&answer, &a.public_key()).is_ok(),
        "signed by the minting gateway: {answer:?}"
    );
    let answer = RedeemAnswer::read(&answer).expect("a redeem answer");
    assert_eq!(
        answer.bundle_cid,
        exported3["bundle_cid"].as_str().expect("cid")
    );
    assert_eq!(answer.session_id.to_string(), id3);
    assert_eq!(
        answer.export_id.to_string(),
        exported3["export_id"].as_str().expect("id")
    );
    let (status, _, v) = redeem(&as_b).await;
    assert_eq!(
        status_code(status, &v),
        (401, "SBP_FEDERATION_TOKEN_REPLAYED".to_owned()),
        "{v}"
    );
    let body3 = json!({"roaming_token": roaming3});
    let (status, v) = import(c.gw(), body3.clone()).await;
    assert_eq!(
        status_code(status, &v),
        (410, "SBP_TOKEN_CONSUMED".to_owned()),
        "redeemed by B: {v}"
    );
    // B, which redeemed it, completes its import (a retry after a lost answer), once.
    let (status, v) = import(b.gw(), body3.clone()).await;
    assert_eq!(status, 201, "{v}");
    let (status, v) = import(b.gw(), body3).await;
    assert_eq!(
        status_code(status, &v),
        (410, "SBP_TOKEN_CONSUMED".to_owned()),
        "{v}"
    );

    // The minting gateway down: 503, and nothing is written.
    let (id2, token2) = conversation(a.gw(), "minter down").await;
    let exported = export(a.gw(), &id2, &token2, json!({})).await;
    let roaming = exported["roaming_token"]
        .as_str()
        .expect("token")
        .to_owned();
    a.kill9();
    let sessions_before = sessions(&c.metrics().await);
    let (status, v) = import(c.gw(), json!({"roaming_token": roaming})).await;
    assert_eq!(
        status_code(status, &v),
        (503, "SBP_PEER_UNREACHABLE".to_owned()),
        "{v}"
    );
    assert_eq!(sessions(&c.metrics().await), sessions_before);
}

/// 10. The tracker accepts a record only from the gateway it names, signed by it, fresh, with a
/// rising `seq`, within the per-gateway cap; a node claiming another's id can neither register
/// nor announce; and the tracker fetches nothing but manifests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tracker_refuses_records_it_cannot_vouch_for() {
    let mut t = Node::new("tracker-ten", 101).await;
    t.start(&[
        "--role",
        "tracker",
        "--tracker-max-records",
        "3",
        "--tracker-announce-rate",
        "0",
    ])
    .await;
    let mut a = Node::new("gw-a-ten", 102).await;
    a.start(&["--role", "gateway"]).await;
    let x = IdentityKey::from_seed([103; 32]);
    let post = |record: Map<String, Value>| {
        let req = t.gw().post("/v1/sbp/registry", &Value::Object(record));
        async move {
            let (status, _, body) = send(req).await;
            status_code(status, &body)
        }
    };
    let now = Utc::now();
    let cids: Vec<String> = (0..5).map(|_| random_cid()).collect();

    // Another gateway's id on A's URL.
    let not_a = ProviderRecord {
        gateway_id: x.public_key().derive_gateway_id(),
        bundle_cid: cids[0].clone(),
        bundle_url: a.bundle_url(&cids[0]),
        seq: 1,
        issued_at: now,
        expires_at: now + hour(),
    };
    assert_eq!(
        post(not_a.to_signed_map(&x)).await,
        (403, "SBP_REGISTRY_NOT_OWNER".to_owned())
    );
    // A's id, but a URL that is not A's bundle endpoint.
    let mut elsewhere = ProviderRecord::read(&a.record(&cids[0], 1, hour())).expect("record");
    elsewhere.bundle_url = format!("{}/v1/sbp/elsewhere/{}", a.url, cids[0]);
    assert_eq!(
        post(elsewhere.to_signed_map(&a.key)).await,
        (403, "SBP_REGISTRY_NOT_OWNER".to_owned())
    );
    // A's record signed by another key, and A's record changed after signing.
    let parsed = ProviderRecord::read(&a.record(&cids[0], 1, hour())).expect("record");
    assert_eq!(
        post(parsed.to_signed_map(&x)).await,
        (401, "SBP_REGISTRY_SIGNATURE".to_owned())
    );
    let mut altered = a.record(&cids[0], 1, hour());
    altered.insert("seq".into(), json!(2));
    assert_eq!(
        post(altered).await,
        (401, "SBP_REGISTRY_SIGNATURE".to_owned())
    );
    // A node that claims A's gateway id under its own key can neither register nor announce.
    let impostor = FakeNode::claiming(Role::Gateway, 104, &a.gateway_id).await;
    let impostor_record = |cid: &str| {
        let now = Utc::now();
        ProviderRecord {
            gateway_id: a.gateway_id.clone(),
            bundle_cid: cid.to_owned(),
            bundle_url: format!("{}/v1/sbp/bundles/{cid}", impostor.url),
            seq: 9,
            issued_at: now,
            expires_at: now + hour(),
        }
        .to_signed_map(&impostor.key)
    };
    let register = |url: &str| {
        let req = t
            .gw()
            .post("/v1/sbp/registry/gateways", &json!({ "gateway_url": url }));
        async move {
            let (status, _, body) = send(req).await;
            status_code(status, &body)
        }
    };
    assert_eq!(
        register(&impostor.url).await,
        (403, "SBP_REGISTRY_NOT_OWNER".to_owned())
    );
    assert_eq!(
        post(impostor_record(&cids[4])).await,
        (403, "SBP_REGISTRY_NOT_OWNER".to_owned())
    );

    // Longer than 24 h.
    assert_eq!(
        post(a.record(
            &cids[0],
            1,
            chrono::Duration::hours(24) + chrono::Duration::minutes(1)
        ))
        .await,
        (400, "SBP_REGISTRY_RECORD_INVALID".to_owned())
    );

    // seq only rises.
    assert_eq!(
        post(a.record(&cids[0], 5, hour())).await,
        (201, String::new())
    );
    assert_eq!(
        post(a.record(&cids[0], 4, hour())).await,
        (409, "SBP_REGISTRY_STALE".to_owned())
    );
    assert_eq!(
        post(a.record(&cids[0], 6, hour())).await,
        (200, String::new())
    );
    let (status, _, answer) = send(t.gw().get(&format!("/v1/sbp/registry/{}", cids[0]))).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["providers"][0]["seq"], 6, "{answer}");

    // Three records per gateway here.
    assert_eq!(
        post(a.record(&cids[1], 1, hour())).await,
        (201, String::new())
    );
    assert_eq!(
        post(a.record(&cids[2], 1, hour())).await,
        (201, String::new())
    );
    assert_eq!(
        post(a.record(&cids[3], 1, hour())).await,
        (429, "SBP_REGISTRY_QUOTA".to_owned())
    );
    let (status, _, answer) = send(t.gw().get(&format!("/v1/sbp/registry/{}", cids[3]))).await;
    assert_eq!(status, 404, "{answer}");

    // Once the tracker knows A, the impostor fares no better, and A's vouch is A's.
    assert_eq!(
        register(&impostor.url).await,
        (403, "SBP_REGISTRY_NOT_OWNER".to_owned())
    );
    assert_eq!(
        post(impostor_record(&cids[4])).await,
        (403, "SBP_REGISTRY_NOT_OWNER".to_owned())
    );
    assert_eq!(register(&a.url).await.0, 200);
    let (status, _, vouch) = send(
        t.gw()
            .get(&format!("/v1/sbp/registry/gateways/{}", a.gateway_id)),
    )
    .await;
    assert_eq!(status, 200, "{vouch}");
    assert!(verify_object(&object(vouch.clone()), &t.public_key()).is_ok());
    assert_eq!(
        (&vouch["gateway_url"], &vouch["public_key"]),
        (&json!(a.url), &json!(a.public_key().to_b64_spki())),
        "{vouch}"
    );

    let tm = t.metrics().await;
    for (outcome, n) in [
        ("not_owner", 4.0),
        ("not_registered", 2.0),
        ("registered", 1.0),
        ("bad_signature", 2.0),
        ("invalid", 1.0),
        ("created", 3.0),
        ("stale", 1.0),
        ("replaced", 1.0),
        ("quota", 1.0),
    ] {
        assert_eq!(
            metric(
                &tm,
                &format!("sbp_tracker_announces_total{{outcome=\"{outcome}\"}}")
            ),
            n,
            "{outcome}:\n{tm}"
        );
    }
    assert!(
        !has_family(&a.metrics().await, "sbp_federation_bundle_serves_total"),
        "the tracker never asked A for a bundle"
    );
}

/// 11. A gateway's announce budget at a tracker is its own: records that claim its id but do not
/// verify (anyone can send them) must not use it up, or anyone could keep its bundles out of the
/// tracker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_records_do_not_use_up_a_gateways_announce_rate() {
    let mut t = Node::new("tracker-eleven", 111).await;
    t.start(&["--role", "tracker", "--tracker-announce-rate", "1/m,2"])
        .await;
    let mut a = Node::new("gw-a-eleven", 112).await;
    a.start(&["--tracker", &t.pin()]).await;
    a.wait_vouched_by(&t).await;

    let attacker = IdentityKey::from_seed([113; 32]);
    for _ in 0..3 {
        let in_a_name = ProviderRecord::read(&a.record(&random_cid(), 1, hour()))
            .expect("record")
            .to_signed_map(&attacker);
        let (status, _, body) =
            send(t.gw().post("/v1/sbp/registry", &Value::Object(in_a_name))).await;
        assert!(
            matches!(status, 401 | 429),
            "a forged record is never accepted: {status} {body}"
        );
    }
    let (id, token) = conversation(a.gw(), "still announced").await;
    let exported = export(a.gw(), &id, &token, json!({"announce": true})).await;
    assert_eq!(
        exported["announced_to"],
        json!([t.gateway_id]),
        "A's own announce is accepted: {exported}\n{}",
        t.metrics().await
    );
}
