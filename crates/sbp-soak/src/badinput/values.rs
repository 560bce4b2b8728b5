//! The raw material of bad inputs: values of the wrong type or size, structural mutations of a
//! JSON document, and byte-level damage to its text.

use serde_json::{Map, Value, json};

use crate::rng::Rng;

/// Field names the gateway reads somewhere: an added field is more likely to hit a parser.
const FIELDS: &[&str] = &[
    "messages",
    "role",
    "content",
    "tool_calls",
    "tool_call_id",
    "name",
    "model",
    "stream",
    "tools",
    "tool_choice",
    "sbp",
    "session_id",
    "session_token",
    "resume",
    "force_new_session",
    "checkpoint_every",
    "status",
    "ttl_seconds",
    "label",
    "include_bundle",
    "seq",
    "last_seq",
    "step_count",
    "message_count",
    "roaming_token",
    "bundle",
    "allow_reuse",
    "target_agent_id",
    "schema_id",
    "payload",
    "timeout_ms",
    "tool_name",
    "tool_input",
    "to_agent_id",
    "handoff_message",
    "reason",
    "agent_id",
    "metadata",
    "jsonrpc",
    "method",
    "params",
    "id",
    "max_tokens",
    "max_completion_tokens",
    "stream_options",
    "n",
    "surface_context",
];

/// Nested arrays `depth` deep (serde_json refuses more than 128 levels; below that the value
/// reaches the gateway's own code).
pub fn nested(depth: usize, object: bool) -> Value {
    let mut v = json!(1);
    for _ in 0..depth {
        v = if object {
            json!({ "a": v })
        } else {
            json!([v])
        };
    }
    v
}

/// A value of the wrong type, size or shape.
pub fn weird(rng: &mut Rng) -> Value {
    match rng.below(34) {
        0 => Value::Null,
        1 => json!(true),
        2 => json!(false),
        3 => json!(0),
        4 => json!(-1),
        5 => json!(1.5),
        6 => json!(-0.0),
        7 => json!(1e308),
        8 => json!(-1e308),
        9 => json!(u64::MAX),
        10 => json!(i64::MIN),
        11 => json!(1u64 << 63),
        12 => json!((1u64 << 63) - 1),
        13 => json!(""),
        14 => json!(" "),
        15 => json!("x".repeat(rng.range(1_000, 200_000) as usize)),
        16 => json!("\u{0}\u{202e}\u{feff}\u{ffff}😀"),
        17 => json!([]),
        18 => json!({}),
        19 => nested(rng.range(20, 120) as usize, false),
        20 => nested(rng.range(20, 120) as usize, true),
        21 => json!(vec![Value::Null; rng.range(100, 5000) as usize]),
        22 => json!({"role": "usr", "content": "hi"}),
        23 => json!({"role": "tool", "content": "no call id"}),
        24 => json!({"role": "assistant", "tool_calls": [{"id": 1, "function": "x"}]}),
        25 => json!({"role": "user", "content": {"a": 1}}),
        26 => json!([{"type": "text", "text": 1}]),
        27 => json!([{"type": "image_url", "image_url": {"url": "x"}}]),
        28 => json!({"role": 5}),
        29 => json!("not-a-uuid"),
        30 => json!("00000000-0000-0000-0000-000000000000"),
        31 => json!({"type": "function", "function": {"name": 7, "parameters": "x"}}),
        32 => json!(-9.007_199_254_740_993e15),
        _ => json!([1, "two", null, {"three": [4]}]),
    }
}

/// Every place in `v` a mutation can hit: paths of object keys and array indices.
fn paths(v: &Value, prefix: &mut Vec<PathStep>, out: &mut Vec<Vec<PathStep>>, budget: &mut usize) {
    if *budget == 0 {
        return;
    }
    *budget -= 1;
    out.push(prefix.clone());
    match v {
        Value::Object(m) => {
            for (k, child) in m {
                prefix.push(PathStep::Key(k.clone()));
                paths(child, prefix, out, budget);
                prefix.pop();
            }
        }
        Value::Array(a) => {
            for (i, child) in a.iter().enumerate().take(8) {
                prefix.push(PathStep::Index(i));
                paths(child, prefix, out, budget);
                prefix.pop();
            }
        }
        _ => {}
    }
}

#[derive(Debug, Clone)]
enum PathStep {
    Key(String),
    Index(usize),
}

fn at<'a>(v: &'a mut Value, path: &[PathStep]) -> Option<&'a mut Value> {
    let mut cur = v;
    for step in path {
        cur = match (step, cur) {
            (PathStep::Key(k), Value::Object(m)) => m.get_mut(k)?,
            (PathStep::Index(i), Value::Array(a)) => a.get_mut(*i)?,
            _ => return None,
        };
    }
    Some(cur)
}

/// Applies one structural mutation to `v` and says which.
pub fn mutate(rng: &mut Rng, v: &mut Value) -> String {
    let mut all = Vec::new();
    let mut budget = 200;
    paths(v, &mut Vec::new(), &mut all, &mut budget);
    let path = rng.pick(&all);
    let where_ = describe_path(&path);
    match rng.below(6) {
        // Replace a value (the whole document when the path is empty).
        0..=2 => {
            let new = weird(rng);
            let what = format!(
                "{where_} := {}",
                crate::raw::snippet(new.to_string().as_bytes(), 60)
            );
            if let Some(slot) = at(v, &path) {
                *slot = new;
            }
            what
        }
        // Remove it from its parent.
        3 if !path.is_empty() => {
            let (last, parent) = path
                .split_last()
                .map_or((None, &path[..0]), |(l, p)| (Some(l), p));
            if let (Some(slot), Some(last)) = (at(v, parent), last) {
                match (slot, last) {
                    (Value::Object(m), PathStep::Key(k)) => {
                        m.remove(k);
                    }
                    (Value::Array(a), PathStep::Index(i)) if *i < a.len() => {
                        a.remove(*i);
                    }
                    _ => {}
                }
            }
            format!("removed {where_}")
        }
        // Add a field to an object, or grow an array by repetition.
        _ => match at(v, &path) {
            Some(Value::Object(m)) => {
                let key = if rng.chance(70) {
                    rng.pick(FIELDS).to_owned()
                } else {
                    format!("x-{}", rng.below(1000))
                };
                let new = weird(rng);
                let what = format!(
                    "{where_}.{key} := {}",
                    crate::raw::snippet(new.to_string().as_bytes(), 60)
                );
                m.insert(key, new);
                what
            }
            Some(Value::Array(a)) if !a.is_empty() => {
                let n = rng.range(50, 3000) as usize;
                let first = a[0].clone();
                a.extend(std::iter::repeat_n(first, n));
                format!("{where_} grown by {n} copies")
            }
            Some(slot) => {
                let new = weird(rng);
                let what = format!(
                    "{where_} := {}",
                    crate::raw::snippet(new.to_string().as_bytes(), 60)
                );
                *slot = new;
                what
            }
            None => "no-op".into(),
        },
    }
}

fn describe_path(path: &[PathStep]) -> String {
    if path.is_empty() {
        return "$".into();
    }
    let mut s = String::from("$");
    for step in path {
        match step {
            PathStep::Key(k) => {
                s.push('.');
                s.push_str(k);
            }
            PathStep::Index(i) => s.push_str(&format!("[{i}]")),
        }
    }
    s
}

/// Byte-level damage to a JSON text; says which.
pub fn damage(rng: &mut Rng, text: &mut Vec<u8>) -> String {
    let pos = rng.below(text.len() as u64 + 1) as usize;
    match rng.below(17) {
        0 => {
            text.truncate(pos);
            format!("truncated at byte {pos}")
        }
        1 => {
            let n = rng.range(1, 4);
            for _ in 0..n {
                if !text.is_empty() {
                    let i = rng.below(text.len() as u64) as usize;
                    text[i] = rng.next_u64() as u8;
                }
            }
            format!("{n} random bytes changed")
        }
        2 => {
            // Invalid UTF-8 inside the first string.
            let seq: &[u8] = rng.pick(&[
                &[0xff][..],
                &[0xc3, 0x28],
                &[0xc0, 0xaf],
                &[0xed, 0xa0, 0x80],
                &[0xf4, 0x90, 0x80, 0x80],
                &[0xe2, 0x82],
            ]);
            let at = text.iter().position(|b| *b == b'"').map_or(pos, |p| p + 1);
            text.splice(at..at, seq.iter().copied());
            format!("invalid UTF-8 {seq:02x?} at byte {at}")
        }
        3 => {
            let lit: &str = rng.pick(&[
                "123456789012345678901234567890",
                "-9223372036854775809",
                "18446744073709551616",
                "1e999",
                "-1e999",
                "NaN",
                "Infinity",
                "-0",
                "00",
                "1.",
                ".5",
                "+1",
                "0x10",
            ]);
            replace_first_number(text, lit);
            format!("first number replaced by {lit}")
        }
        4 => {
            let depth = rng.range(129, 100_000) as usize;
            *text = format!("{}{}", "[".repeat(depth), "]".repeat(depth)).into_bytes();
            format!("arrays nested {depth} deep")
        }
        5 => {
            let tail: &str = rng.pick(&["}", "x", "\0", " {\"a\":1}", "]", ",", "\n\n\n"]);
            text.extend_from_slice(tail.as_bytes());
            format!("trailing {tail:?}")
        }
        6 => {
            text.splice(0..0, [0xef, 0xbb, 0xbf]);
            "UTF-8 BOM first".into()
        }
        7 => {
            let body: &str = rng.pick(&[
                "",
                " ",
                "null",
                "[]",
                "\"str\"",
                "1",
                "{}",
                "true",
                "{\"\":{}}",
            ]);
            *text = body.as_bytes().to_vec();
            format!("body {body:?}")
        }
        8 => {
            // A duplicate key: which one wins is up to the parser.
            if text.first() == Some(&b'{') {
                text.splice(1..1, br#""messages":"dup","content":5,"#.iter().copied());
            }
            "duplicate keys".into()
        }
        9 => {
            let at = text.iter().position(|b| *b == b'"').map_or(pos, |p| p + 1);
            text.splice(at..at, br"\ud800".iter().copied());
            "lone surrogate escape".into()
        }
        10 => {
            let at = text.iter().position(|b| *b == b'"').map_or(pos, |p| p + 1);
            text.splice(at..at, [0x01, 0x0a, 0x7f]);
            "raw control characters in a string".into()
        }
        11 => {
            // UTF-16LE with a BOM.
            let s = String::from_utf8_lossy(text).into_owned();
            let mut out = vec![0xff, 0xfe];
            for u in s.encode_utf16() {
                out.extend_from_slice(&u.to_le_bytes());
            }
            *text = out;
            "UTF-16LE encoded".into()
        }
        12 => {
            let n = rng.range(1, 64) as usize;
            let junk = rng.bytes(n);
            text.splice(pos..pos, junk);
            format!("{n} random bytes inserted at {pos}")
        }
        13 => {
            // Deep but within serde_json's limit, as text, inside the document.
            let depth = rng.range(60, 127) as usize;
            let deep = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
            if text.first() == Some(&b'{') {
                text.splice(1..1, format!("\"deep\":{deep},").into_bytes());
            }
            format!("field nested {depth} deep")
        }
        14 => {
            // Escapes that decode to NUL and to non-characters.
            let at = text.iter().position(|b| *b == b'"').map_or(pos, |p| p + 1);
            text.splice(at..at, br"\u0000\uffff\ufffe".iter().copied());
            "escaped NUL and non-characters".into()
        }
        15 => {
            if let Some(i) = text.iter().position(|b| *b == b':') {
                text.remove(i);
            }
            "a colon missing".into()
        }
        _ => {
            let n = rng.range(1, 8);
            for _ in 0..n {
                if !text.is_empty() {
                    let i = rng.below(text.len() as u64) as usize;
                    text.remove(i);
                }
            }
            format!("{n} bytes deleted")
        }
    }
}

fn replace_first_number(text: &mut Vec<u8>, lit: &str) {
    let mut in_string = false;
    let mut escaped = false;
    for i in 0..text.len() {
        let b = text[i];
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        if b == b'"' {
            in_string = true;
        } else if b.is_ascii_digit() || b == b'-' {
            let end = text[i..]
                .iter()
                .position(|c| {
                    !(c.is_ascii_digit() || matches!(c, b'-' | b'+' | b'.' | b'e' | b'E'))
                })
                .map_or(text.len(), |p| i + p);
            text.splice(i..end, lit.bytes());
            return;
        }
    }
    // No number: put one in as a field.
    if text.first() == Some(&b'{') {
        text.splice(1..1, format!("\"n\":{lit},").into_bytes());
    }
}

/// A JSON object from a `json!` literal (always an object by construction).
pub fn obj(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_are_deterministic_and_change_the_document() {
        let base = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let mut changed = 0;
        for i in 0..200 {
            let mut a = base.clone();
            let mut b = base.clone();
            let da = mutate(&mut Rng::for_case(9, i), &mut a);
            let db = mutate(&mut Rng::for_case(9, i), &mut b);
            assert_eq!(a, b);
            assert_eq!(da, db);
            changed += usize::from(a != base);
        }
        assert!(changed > 150, "{changed}");
    }

    #[test]
    fn numbers_are_found_outside_strings() {
        let mut t = br#"{"a":"12","b":34}"#.to_vec();
        replace_first_number(&mut t, "1e999");
        assert_eq!(t, br#"{"a":"12","b":1e999}"#);
    }

    #[test]
    fn nesting_stays_within_the_parser_limit_when_asked() {
        let v = nested(120, false);
        let text = v.to_string();
        assert!(serde_json::from_str::<Value>(&text).is_ok());
    }
}
