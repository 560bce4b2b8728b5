//! L6, federation, checked from outside with no key of the federation: the node's
//! `/.well-known/sbp` manifest (every field, endpoints by role, valid at most 7 days ahead, signed
//! by its own `public_key`); on a gateway, the bundle route's refusals (a path that is not a CID,
//! no token, a garbage token, an unsigned `alg: none` token) and SESSION_ATTACHED saying L6; on a
//! tracker, a lookup of an unknown bundle (404, or a signed answer for that CID whose providers
//! are references only) and an empty record refused. What the gateway checks need of a manifest
//! (the audience of a token) is read from it; without one they are skipped, and the manifest's
//! row says why.

use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Duration, Utc};
use reqwest::Method;
use sbp_protocol::federation::{
    ManifestTrust, ProviderRecord, PublicKey, RegistryAnswer, Role, verify_manifest, verify_object,
};
use serde_json::{Map, Value, json};

use crate::conformance::client::{Ctx, Resp, attach};
use crate::conformance::outcome::{Outcome, Problem, ensure, fail, pass, pass_with, short, skip};

/// Where a node describes itself.
pub const MANIFEST_PATH: &str = "/.well-known/sbp";
/// The longest a manifest may be valid ahead of now.
const MAX_VALIDITY: Duration = Duration::days(7);
/// The clock difference tolerated between the node and this checker.
const SKEW: Duration = Duration::seconds(60);
/// The fields every manifest carries, besides `endpoints`.
const FIELDS: [&str; 10] = [
    "sbp_version",
    "gateway_id",
    "gateway_name",
    "role",
    "federation",
    "public_key",
    "key_id",
    "old_keys",
    "valid_until",
    "signature",
];
/// What a provider record may hold: references, never content.
const CONTENT_KEYS: [&str; 3] = ["messages", "bundle", "content"];

/// The endpoints a manifest of `role` names (and no others of the five).
fn endpoints_of(role: Role) -> &'static [&'static str] {
    match role {
        Role::Gateway => &["ws", "export", "import", "bundle"],
        Role::Tracker => &["registry"],
        Role::Both => &["ws", "export", "import", "bundle", "registry"],
    }
}

/// `GET /.well-known/sbp` as it came, when the node has one (a 404 is `Ok(None)`).
pub async fn fetch_manifest(ctx: &Ctx) -> Result<Option<Resp>, Problem> {
    let resp = ctx.get(MANIFEST_PATH, None).await?;
    if resp.status == 404 {
        return Ok(None);
    }
    Ok(Some(resp))
}

/// The manifest's object, or SKIP: the check needs what a manifest says.
async fn manifest_for(ctx: &Ctx, what: &str) -> Result<Map<String, Value>, Problem> {
    let resp = fetch_manifest(ctx).await?;
    match resp.as_ref().map(|r| (r.status, r.body.as_object())) {
        Some((200, Some(obj))) => Ok(obj.clone()),
        _ => Err(skip(format!(
            "no federation manifest at {MANIFEST_PATH} (see l6.manifest): {what} needs one"
        ))),
    }
}

pub async fn manifest(ctx: Arc<Ctx>) -> Outcome {
    let Some(resp) = fetch_manifest(&ctx).await? else {
        return Err(fail(format!(
            "GET {MANIFEST_PATH} answered 404: federation (L6) is not on at {} (`sbp serve` turns \
             it on with --role gateway|tracker|both, --peer, --tracker or --peer-srv)",
            ctx.base
        )));
    };
    resp.expect(&[200])?;
    let obj = resp.body.as_object().ok_or_else(|| {
        fail(format!(
            "{}: the manifest is not a JSON object: {}",
            resp.what,
            resp.quote()
        ))
    })?;
    manifest_verdict(obj, &ctx.base, Utc::now())
}

/// Whether `obj` is a complete manifest, valid now and signed by its own key; the pass notes
/// what it is.
fn manifest_verdict(obj: &Map<String, Value>, base: &str, now: DateTime<Utc>) -> Outcome {
    let missing: Vec<&str> = FIELDS
        .iter()
        .chain(["endpoints"].iter())
        .copied()
        .filter(|f| obj.get(*f).is_none_or(Value::is_null))
        .collect();
    ensure(missing.is_empty(), || {
        format!("the manifest lacks {}", missing.join(", "))
    })?;
    ensure(obj["federation"] == true, || {
        format!("`federation` is {}, expected true", obj["federation"])
    })?;
    for field in FIELDS
        .iter()
        .filter(|f| !["federation", "old_keys"].contains(f))
    {
        ensure(
            obj[*field].as_str().is_some_and(|s| !s.trim().is_empty()),
            || format!("`{field}` is {}, expected a non-empty string", obj[*field]),
        )?;
    }
    ensure(obj["old_keys"].is_array(), || {
        format!("`old_keys` is {}, expected an array", obj["old_keys"])
    })?;
    let role_text = obj["role"].as_str().unwrap_or_default();
    let role = Role::parse(role_text).ok_or_else(|| {
        fail(format!(
            "`role` is \"{}\", expected gateway, tracker or both",
            short(role_text, 40)
        ))
    })?;
    let valid_until = time(obj, "valid_until")?;
    // `issued_at` is this implementation's addition: checked when present.
    if obj.contains_key("issued_at") {
        time(obj, "issued_at")?;
    }
    ensure(valid_until > now, || {
        format!("the manifest expired at {valid_until}")
    })?;
    ensure(valid_until <= now + MAX_VALIDITY + SKEW, || {
        format!(
            "`valid_until` {valid_until} is more than 7 days ahead ({:.1} days)",
            (valid_until - now).num_seconds() as f64 / 86_400.0
        )
    })?;

    let endpoints = obj["endpoints"].as_object().ok_or_else(|| {
        fail(format!(
            "`endpoints` is {}, expected an object",
            obj["endpoints"]
        ))
    })?;
    let want = endpoints_of(role);
    for name in ["ws", "export", "import", "bundle", "registry"] {
        let listed = endpoints.get(name).filter(|v| !v.is_null());
        match (want.contains(&name), listed) {
            (true, None) => {
                return Err(fail(format!(
                    "a {} manifest must name the `{name}` endpoint; `endpoints` is {}",
                    role.as_str(),
                    short(&obj["endpoints"].to_string(), 200)
                )));
            }
            (true, Some(url)) => {
                let url = url.as_str().unwrap_or_default();
                let scheme_ok = ["http://", "https://", "ws://", "wss://"]
                    .iter()
                    .any(|s| url.starts_with(s));
                ensure(scheme_ok, || {
                    format!("endpoints.{name} is \"{}\", not a URL", short(url, 80))
                })?;
            }
            (false, Some(_)) => {
                return Err(fail(format!(
                    "a {} manifest names the `{name}` endpoint, which its role does not serve",
                    role.as_str()
                )));
            }
            (false, None) => {}
        }
    }

    let verified = verify_manifest(obj, ManifestTrust::SelfSigned, now).map_err(|e| {
        fail(format!(
            "the manifest does not verify with its own public_key: {e}"
        ))
    })?;
    let mut note = format!(
        "{} {} (key {}), valid {:.1} h more",
        role.as_str(),
        verified.manifest.gateway_id,
        verified.manifest.key_id,
        (valid_until - now).num_seconds() as f64 / 3600.0
    );
    // Endpoints under another origin than the one checked: worth knowing (a public URL that
    // differs from the address the checker used), not a failure.
    let origin = origin_of(base);
    let elsewhere: Vec<&str> = want
        .iter()
        .copied()
        .filter(|name| {
            endpoints
                .get(*name)
                .and_then(Value::as_str)
                .is_some_and(|u| origin_of(u) != origin)
        })
        .collect();
    if !elsewhere.is_empty() {
        note.push_str(&format!(
            "; endpoints {} are under another origin than {base}",
            elsewhere.join(", ")
        ));
    }
    pass_with(note)
}

/// `scheme://host[:port]` of a URL, with `ws`/`wss` read as `http`/`https`.
fn origin_of(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let scheme = match scheme {
        "ws" => "http",
        "wss" => "https",
        s => s,
    };
    let host = rest.split(['/', '?', '#']).next().unwrap_or_default();
    format!("{scheme}://{host}")
}

fn time(obj: &Map<String, Value>, field: &str) -> Result<DateTime<Utc>, Problem> {
    let text = obj[field].as_str().unwrap_or_default();
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|_| {
            fail(format!(
                "`{field}` is \"{}\", not an RFC 3339 time",
                short(text, 40)
            ))
        })
}

/// A CID nothing is stored under: 64 random lowercase hex digits.
fn random_cid() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

fn bundle_path(cid: &str) -> String {
    format!("/v1/sbp/bundles/{cid}")
}

/// `GET path` with only `authorization` (no operator key: the bundle route's `Authorization`
/// carries a federation token).
async fn bare_get(ctx: &Ctx, path: &str, authorization: Option<&str>) -> Result<Resp, Problem> {
    let mut req = ctx.http.request(Method::GET, ctx.url(path));
    if let Some(a) = authorization {
        req = req.header("authorization", a);
    }
    let what = match authorization {
        Some(_) => format!("GET {path} (with a token)"),
        None => format!("GET {path} (no token)"),
    };
    ctx.send(what, req).await
}

/// 401 in the SBP envelope: the token was not accepted.
fn expect_unauthorized(resp: &Resp, token: &str) -> Result<(), Problem> {
    ensure(resp.status == 401, || {
        format!(
            "{} with {token}: expected 401, got {} {}",
            resp.what,
            resp.status,
            resp.quote()
        )
    })?;
    resp.expect_error(&[401], "")
}

pub async fn bundle_invalid_cid(ctx: Arc<Ctx>) -> Outcome {
    manifest_for(&ctx, "the bundle route").await?;
    let resp = bare_get(&ctx, &bundle_path("not-a-cid"), None).await?;
    resp.expect_error(&[422], "SBP_INVALID_CID")?;
    pass()
}

pub async fn bundle_needs_token(ctx: Arc<Ctx>) -> Outcome {
    manifest_for(&ctx, "the bundle route").await?;
    let resp = bare_get(&ctx, &bundle_path(&random_cid()), None).await?;
    expect_unauthorized(&resp, "no token")?;
    let challenge = resp.header("www-authenticate").unwrap_or_default();
    ensure(challenge.to_ascii_lowercase().starts_with("bearer"), || {
        format!(
            "{}: 401 without a `WWW-Authenticate: Bearer ...` challenge (got \"{}\")",
            resp.what,
            short(&challenge, 80)
        )
    })?;
    pass()
}

pub async fn bundle_garbage_token(ctx: Arc<Ctx>) -> Outcome {
    manifest_for(&ctx, "the bundle route").await?;
    let path = bundle_path(&random_cid());
    for token in ["not-a-token", "a.b.c", "eyJhbGciOiJFZERTQSJ9.e30."] {
        let resp = bare_get(&ctx, &path, Some(&format!("Bearer {token}"))).await?;
        expect_unauthorized(&resp, &format!("the garbage token \"{token}\""))?;
    }
    pass()
}

/// A federation token for `path` addressed to `audience`, well formed in every claim, with
/// header `alg: none` and no signature.
fn unsigned_token(audience: &str, cid: &str, path: &str, now: DateTime<Utc>) -> String {
    let header = json!({"alg": "none", "typ": "sbp-fed+jwt", "kid": "0123456789abcdef"});
    let claims = json!({
        "iss": uuid::Uuid::new_v4().simple().to_string(),
        "aud": audience,
        "sub": cid,
        "htm": "GET",
        "htu": path,
        "iat": now.timestamp(),
        "exp": now.timestamp() + 120,
        "jti": uuid::Uuid::new_v4().to_string(),
    });
    format!(
        "{}.{}.",
        URL_SAFE_NO_PAD.encode(header.to_string()),
        URL_SAFE_NO_PAD.encode(claims.to_string())
    )
}

pub async fn bundle_alg_none(ctx: Arc<Ctx>) -> Outcome {
    let manifest =
        manifest_for(&ctx, "an `alg: none` token (addressed to the gateway's id)").await?;
    let audience = manifest["gateway_id"].as_str().unwrap_or_default();
    let cid = random_cid();
    let path = bundle_path(&cid);
    let token = unsigned_token(audience, &cid, &path, Utc::now());
    let resp = bare_get(&ctx, &path, Some(&format!("Bearer {token}"))).await?;
    // Its issuer is no peer of the gateway: refused as unauthenticated (401) or as untrusted
    // (403), depending on which the gateway checks first. Either way it is not served; whether
    // the gateway would take `alg: none` from a trusted issuer cannot be seen from outside.
    resp.expect_error(&[401, 403], "")?;
    pass_with(format!("refused with {}", resp.status))
}

pub async fn session_attached_l6(ctx: Arc<Ctx>) -> Outcome {
    manifest_for(&ctx, "SESSION_ATTACHED's sbp_level L6").await?;
    let (s, _) = ctx.new_session("conformance: federated").await?;
    let (ws, attached) = attach(&ctx, &s, json!({})).await?;
    ensure(attached["sbp_level"] == "L6", || {
        format!(
            "SESSION_ATTACHED.sbp_level is {}, expected \"L6\" on a federated gateway",
            attached["sbp_level"]
        )
    })?;
    ws.detach().await?;
    pass()
}

pub async fn registry_lookup(ctx: Arc<Ctx>) -> Outcome {
    let manifest = manifest_for(&ctx, "the tracker's answer (its signature)").await?;
    let cid = random_cid();
    let resp = ctx.get(&format!("/v1/sbp/registry/{cid}"), None).await?;
    match resp.status {
        404 => pass_with("404 for a bundle nobody announced"),
        200 => {
            let obj = resp.body.as_object().ok_or_else(|| {
                fail(format!(
                    "{}: 200 but not a JSON object: {}",
                    resp.what,
                    resp.quote()
                ))
            })?;
            registry_answer_verdict(obj, &manifest, &cid, Utc::now())
        }
        _ => Err(fail(format!(
            "{}: expected 404 (or a signed answer), got {} {}",
            resp.what,
            resp.status,
            resp.quote()
        ))),
    }
}

/// Whether a tracker's 200 answer for `cid` is signed by the tracker's manifest key, for that
/// CID, fresh, and lists providers as their signed records only (no session content).
fn registry_answer_verdict(
    obj: &Map<String, Value>,
    manifest: &Map<String, Value>,
    cid: &str,
    now: DateTime<Utc>,
) -> Outcome {
    let key_text = manifest["public_key"].as_str().unwrap_or_default();
    let key = PublicKey::from_b64_spki(key_text)
        .map_err(|e| fail(format!("the manifest's public_key is not a key: {e}")))?;
    verify_object(obj, &key).map_err(|e| {
        fail(format!(
            "the answer is not signed by the tracker's key: {e}"
        ))
    })?;
    let answer = RegistryAnswer::read(obj).map_err(|e| fail(format!("the answer: {e}")))?;
    answer
        .check(cid, now)
        .map_err(|e| fail(format!("the answer for {cid}: {e}")))?;
    ensure(
        Some(answer.tracker_id.as_str()) == manifest["gateway_id"].as_str(),
        || {
            format!(
                "the answer names tracker {}, the manifest {}",
                answer.tracker_id, manifest["gateway_id"]
            )
        },
    )?;
    for (i, p) in answer.providers.iter().enumerate() {
        if let Some(k) = CONTENT_KEYS.iter().find(|k| p.contains_key(**k)) {
            return Err(fail(format!(
                "providers[{i}] carries `{k}`: a tracker answers references, never content"
            )));
        }
        let record = ProviderRecord::read(p).map_err(|e| fail(format!("providers[{i}]: {e}")))?;
        ensure(record.bundle_cid == cid, || {
            format!(
                "providers[{i}] is for bundle {}, not {cid}",
                record.bundle_cid
            )
        })?;
    }
    pass_with(format!(
        "a signed answer with {} provider record(s)",
        answer.providers.len()
    ))
}

pub async fn registry_refuses_empty(ctx: Arc<Ctx>) -> Outcome {
    manifest_for(&ctx, "the registry").await?;
    let resp = ctx.post("/v1/sbp/registry", None, &json!({})).await?;
    // An empty record is malformed (400), or unsigned (401/403): refused either way.
    resp.expect_error(&[400, 401, 403], "")?;
    pass()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conformance::outcome::Status;
    use sbp_protocol::federation::{Endpoints, IdentityKey, Manifest, sign_object};

    fn now() -> DateTime<Utc> {
        Utc::now()
    }

    fn signed(role: Role, valid: Duration, key: &IdentityKey) -> Map<String, Value> {
        Manifest {
            sbp_version: "1.2".into(),
            gateway_id: key.public_key().derive_gateway_id(),
            gateway_name: "node".into(),
            role,
            public_key: key.public_key().to_b64_spki(),
            key_id: key.key_id(),
            old_keys: Vec::new(),
            issued_at: now() - Duration::seconds(5),
            valid_until: now() + valid,
            endpoints: Endpoints::for_role(role, "http://127.0.0.1:8080"),
        }
        .to_signed_map(key, None)
    }

    fn reason(o: Outcome) -> String {
        match o {
            Ok(p) => panic!("passed: {:?}", p.note),
            Err(p) => {
                assert_eq!(p.status, Status::Fail, "{}", p.reason);
                p.reason
            }
        }
    }

    #[test]
    fn a_complete_signed_manifest_passes_for_every_role() {
        let key = IdentityKey::from_seed([3; 32]);
        for role in [Role::Gateway, Role::Tracker, Role::Both] {
            let m = signed(role, Duration::hours(24), &key);
            let note = manifest_verdict(&m, "http://127.0.0.1:8080", now())
                .expect("passes")
                .note
                .unwrap_or_default();
            assert!(note.starts_with(role.as_str()), "{note}");
            assert!(!note.contains("another origin"), "{note}");
        }
        let m = signed(Role::Gateway, Duration::hours(24), &key);
        let note = manifest_verdict(&m, "https://gw.example", now())
            .expect("passes")
            .note
            .unwrap_or_default();
        assert!(note.contains("under another origin"), "{note}");
    }

    #[test]
    fn bad_manifests_fail_naming_what_is_wrong() {
        let key = IdentityKey::from_seed([3; 32]);
        let good = signed(Role::Both, Duration::hours(24), &key);
        let base = "http://127.0.0.1:8080";
        let cases: Vec<(Map<String, Value>, &str)> = vec![
            (
                {
                    let mut m = good.clone();
                    m.remove("old_keys");
                    m
                },
                "lacks old_keys",
            ),
            (
                {
                    let mut m = good.clone();
                    m.insert("federation".into(), json!(false));
                    m
                },
                "`federation` is false",
            ),
            (
                {
                    let mut m = good.clone();
                    m.insert("role".into(), json!("mirror"));
                    m
                },
                "`role` is \"mirror\"",
            ),
            (
                {
                    let mut m = good.clone();
                    m["endpoints"]
                        .as_object_mut()
                        .expect("endpoints")
                        .remove("bundle");
                    sign_object(&mut m, &key);
                    m
                },
                "must name the `bundle` endpoint",
            ),
            (
                {
                    let mut m = signed(Role::Tracker, Duration::hours(24), &key);
                    m["endpoints"]["ws"] = json!("ws://127.0.0.1:8080/v1/sbp/ws/{session_id}");
                    sign_object(&mut m, &key);
                    m
                },
                "names the `ws` endpoint, which its role does not serve",
            ),
            (
                signed(Role::Gateway, Duration::days(30), &key),
                "more than 7 days ahead",
            ),
            (
                signed(Role::Gateway, Duration::seconds(-10), &key),
                "expired",
            ),
            (
                {
                    let mut m = good.clone();
                    m.insert("gateway_name".into(), json!("someone else"));
                    m
                },
                "does not verify with its own public_key",
            ),
            (
                {
                    let mut m = good.clone();
                    m.insert("valid_until".into(), json!("tomorrow"));
                    m
                },
                "not an RFC 3339 time",
            ),
        ];
        for (m, says) in cases {
            let why = reason(manifest_verdict(&m, base, now()));
            assert!(why.contains(says), "expected '{says}' in: {why}");
        }
    }

    #[test]
    fn tracker_answers_must_be_signed_for_the_cid_and_hold_references_only() {
        let key = IdentityKey::from_seed([5; 32]);
        let manifest = signed(Role::Tracker, Duration::hours(24), &key);
        let cid = "ab".repeat(32);
        let gateway = IdentityKey::from_seed([6; 32]);
        let record = ProviderRecord {
            gateway_id: gateway.public_key().derive_gateway_id(),
            bundle_cid: cid.clone(),
            bundle_url: format!("https://gw.example/v1/sbp/bundles/{cid}"),
            seq: 1,
            issued_at: now() - Duration::seconds(5),
            expires_at: now() + Duration::hours(1),
        }
        .to_signed_map(&gateway);
        let answer = |providers: Vec<Map<String, Value>>, for_cid: &str, by: &IdentityKey| {
            RegistryAnswer {
                tracker_id: key.public_key().derive_gateway_id(),
                bundle_cid: for_cid.to_owned(),
                issued_at: now() - Duration::seconds(1),
                expires_at: now() + Duration::minutes(4),
                providers,
            }
            .to_signed_map(by)
        };
        let ok = answer(vec![record.clone()], &cid, &key);
        if let Err(p) = registry_answer_verdict(&ok, &manifest, &cid, now()) {
            panic!("{}", p.reason);
        }

        let stranger = IdentityKey::from_seed([7; 32]);
        let mut with_content = record.clone();
        with_content.insert(
            "messages".into(),
            json!([{"role": "user", "content": "hi"}]),
        );
        let other_cid = "cd".repeat(32);
        for (a, says) in [
            (
                answer(vec![record.clone()], &cid, &stranger),
                "not signed by the tracker's key",
            ),
            (
                answer(vec![record.clone()], &other_cid, &key),
                "not the one asked",
            ),
            (answer(vec![with_content], &cid, &key), "carries `messages`"),
        ] {
            let why = reason(registry_answer_verdict(&a, &manifest, &cid, now()));
            assert!(why.contains(says), "expected '{says}' in: {why}");
        }
    }

    #[test]
    fn the_unsigned_token_says_none_and_has_every_claim() {
        let t = unsigned_token("aud-id", "cid", "/v1/sbp/bundles/cid", now());
        let parts: Vec<&str> = t.split('.').collect();
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[2], "", "no signature");
        let header: Value =
            serde_json::from_slice(&URL_SAFE_NO_PAD.decode(parts[0]).expect("b64")).expect("json");
        assert_eq!(header["alg"], "none");
        let claims: Value =
            serde_json::from_slice(&URL_SAFE_NO_PAD.decode(parts[1]).expect("b64")).expect("json");
        for claim in ["iss", "aud", "sub", "htm", "htu", "iat", "exp", "jti"] {
            assert!(!claims[claim].is_null(), "{claim}");
        }
        assert_eq!(random_cid().len(), 64);
        assert!(sbp_protocol::federation::is_cid(&random_cid()));
    }
}
