//! The browser surface page: `GET /` and `GET /assets/{file}`, served from files embedded in the
//! binary (nothing is fetched from anywhere else). The page holds no data, so it is open even with
//! operator API keys; every API call it makes carries the session token (and the operator key
//! when the user gave one).

use std::sync::OnceLock;

use axum::extract::Path;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sbp_protocol::ErrorCode;
use sha2::{Digest as _, Sha256};

/// No inline script or style anywhere, so `'self'` is all the page needs; `ws:`/`wss:` because
/// not every browser counts a WebSocket to the page's own host as `'self'`.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    connect-src 'self' ws: wss:; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
    frame-ancestors 'none'";

/// The tools the page offers need the location permission on its own origin, nothing else.
const PERMISSIONS_POLICY: &str = "geolocation=(self), camera=(), microphone=(), payment=(), usb=()";

struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

const INDEX: Asset = Asset {
    name: "index.html",
    content_type: "text/html; charset=utf-8",
    body: include_bytes!("../../assets/index.html"),
};

const ASSETS: [Asset; 4] = [
    Asset {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../../assets/app.js"),
    },
    Asset {
        name: "markdown.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../../assets/markdown.js"),
    },
    Asset {
        name: "style.css",
        content_type: "text/css; charset=utf-8",
        body: include_bytes!("../../assets/style.css"),
    },
    Asset {
        name: "icon.svg",
        content_type: "image/svg+xml",
        body: include_bytes!("../../assets/icon.svg"),
    },
];

/// `GET /`: the page itself.
pub async fn index(headers: HeaderMap) -> Response {
    serve(&INDEX, &headers)
}

/// `GET /assets/{file}`: one of the embedded files, or 404.
pub async fn asset(Path(file): Path<String>, headers: HeaderMap) -> Response {
    match ASSETS.iter().find(|a| a.name == file) {
        Some(asset) => serve(asset, &headers),
        None => super::errors::routing(ErrorCode::NotFound, "no such asset"),
    }
}

/// The asset with its headers. The file names carry no version, so browsers revalidate every
/// time (`no-cache`) and get a 304 while the binary is the same.
fn serve(asset: &Asset, request: &HeaderMap) -> Response {
    let etag = etag(asset);
    let fresh = request
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag || t.trim() == "*"));
    let mut resp = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(asset.content_type),
            )],
            asset.body,
        )
            .into_response()
    };
    let h = resp.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if let Ok(v) = HeaderValue::from_str(etag) {
        h.insert(header::ETAG, v);
    }
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        "permissions-policy",
        HeaderValue::from_static(PERMISSIONS_POLICY),
    );
    h.insert(
        "cross-origin-opener-policy",
        HeaderValue::from_static("same-origin"),
    );
    resp
}

/// A strong validator from the content, computed once per asset.
fn etag(asset: &Asset) -> &'static str {
    static TAGS: OnceLock<Vec<(&'static str, String)>> = OnceLock::new();
    let tags = TAGS.get_or_init(|| {
        std::iter::once(&INDEX)
            .chain(ASSETS.iter())
            .map(|a| {
                let digest = Sha256::digest(a.body);
                (a.name, format!("\"{}\"", hex::encode(&digest[..12])))
            })
            .collect()
    });
    tags.iter()
        .find(|(name, _)| *name == asset.name)
        .map_or("\"\"", |(_, tag)| tag.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_asset_writes_html_from_text() {
        // The page's safety rests on building DOM nodes from model text, never parsing it as HTML.
        let scripts: Vec<&Asset> = ASSETS.iter().filter(|a| a.name.ends_with(".js")).collect();
        assert_eq!(scripts.len(), 2);
        for asset in scripts {
            let js = std::str::from_utf8(asset.body).expect("utf-8");
            for sink in [
                "innerHTML",
                "outerHTML",
                "insertAdjacentHTML",
                "document.write",
                "DOMParser",
                "createContextualFragment",
                "eval(",
                "new Function",
            ] {
                assert!(!js.contains(sink), "{} uses {sink}", asset.name);
            }
        }
        let html = std::str::from_utf8(INDEX.body).expect("utf-8");
        assert!(!html.contains("<script>") && !html.contains("style="));
    }

    #[test]
    fn etags_differ_per_asset_and_are_quoted() {
        let a = etag(&ASSETS[0]);
        let b = etag(&ASSETS[1]);
        assert_ne!(a, b);
        assert!(
            a.starts_with('"') && a.ends_with('"') && a.len() == 26,
            "{a}"
        );
    }
}
