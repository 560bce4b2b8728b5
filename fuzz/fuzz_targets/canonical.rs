//! Canonical JSON (Python's `json.dumps(sort_keys=True)`): for any JSON value the output is
//! ASCII, is JSON, reads back as the same value, and is a fixed point; any finite float's
//! Python repr reads back as the same float.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sbp_protocol::canonical::{python_float_repr, to_canonical_bytes};
use serde_json::Value;

/// Equal as JSON values, numbers compared by value (an integer beyond 64 bits is a float either
/// way; `-0` may read as an integer or a float).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            match (x.as_u64(), y.as_u64(), x.as_i64(), y.as_i64()) {
                (Some(p), Some(q), _, _) => p == q,
                (_, _, Some(p), Some(q)) => p == q,
                _ => x.as_f64() == y.as_f64(),
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

fuzz_target!(|data: &[u8]| {
    if let Some(bytes) = data.get(..8) {
        let mut b = [0u8; 8];
        b.copy_from_slice(bytes);
        let f = f64::from_le_bytes(b);
        if f.is_finite() {
            let repr = python_float_repr(f);
            let back: f64 = repr.parse().expect("a float repr parses");
            assert_eq!(back.to_bits(), f.to_bits(), "{f:?} printed as {repr}");
        }
    }
    let Ok(value) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let out = to_canonical_bytes(&value);
    assert!(out.is_ascii());
    let back: Value = serde_json::from_slice(&out).expect("canonical output is JSON");
    assert!(same(&back, &value), "{value} came back as {back}");
    assert_eq!(to_canonical_bytes(&back), out, "not a fixed point");
});
