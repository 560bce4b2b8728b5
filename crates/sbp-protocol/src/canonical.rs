//! Canonical JSON: Python's `json.dumps(obj, sort_keys=True)` reproduced byte for byte, the input of `bundle_cid`.
//!
//! The layout is Python's default: separators `", "` and `": "`, keys sorted by code point (equal to
//! UTF-8 byte order), `ensure_ascii=True` escaping, and floats as Python's `repr`. Floats must be
//! finite, which every `serde_json::Value` already guarantees. Integers beyond the `u64`/`i64` range
//! arrive from serde_json as floats and so print as floats here, unlike Python: the protocol has none.

use serde_json::{Map, Number, Value};

/// Python's `json.dumps(value, sort_keys=True)` (default separators `", "` and `": "`, `ensure_ascii=True`),
/// as UTF-8 bytes (pure ASCII in fact).
pub fn to_canonical_bytes(value: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    write_canonical(value, &mut out);
    out
}

/// Appends the canonical form of `value` to `out`.
pub fn write_canonical(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => write_number(n, out),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.extend_from_slice(b", ");
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        Value::Object(map) => {
            let entries = sorted_entries(map, &[]);
            write_entries(&entries, out);
        }
    }
}

/// Appends the canonical form of the object `map` with the `extra` entries added (an extra entry
/// replaces an entry of `map` with the same key), without building the merged map.
pub fn write_object_with(map: &Map<String, Value>, extra: &[(&str, &Value)], out: &mut Vec<u8>) {
    let skip: Vec<&str> = extra.iter().map(|(k, _)| *k).collect();
    let mut entries = sorted_entries(map, &skip);
    entries.extend_from_slice(extra);
    entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
    write_entries(&entries, out);
}

/// The entries of `map` except the keys in `skip`, sorted as Python's `sort_keys` sorts them.
pub(crate) fn sorted_entries<'a>(
    map: &'a Map<String, Value>,
    skip: &[&str],
) -> Vec<(&'a str, &'a Value)> {
    let mut entries: Vec<(&str, &Value)> = map
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .filter(|(k, _)| !skip.contains(k))
        .collect();
    // `str` orders by UTF-8 bytes, which is code point order, which is Python's order.
    entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
    entries
}

/// Writes `{"k": v, ...}` for already sorted entries.
pub(crate) fn write_entries(entries: &[(&str, &Value)], out: &mut Vec<u8>) {
    out.push(b'{');
    for (i, (key, value)) in entries.iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        write_entry(key, value, out);
    }
    out.push(b'}');
}

/// Writes one `"key": value` pair.
pub(crate) fn write_entry(key: &str, value: &Value, out: &mut Vec<u8>) {
    write_string(key, out);
    out.extend_from_slice(b": ");
    write_canonical(value, out);
}

fn write_number(n: &Number, out: &mut Vec<u8>) {
    if let Some(u) = n.as_u64() {
        write_u64(u, out);
    } else if let Some(i) = n.as_i64() {
        // Only negative values reach here: non-negative ones were taken by `as_u64`.
        out.push(b'-');
        write_u64(i.unsigned_abs(), out);
    } else if let Some(f) = n.as_f64() {
        write_float(f, out);
    } else {
        // Unreachable without `arbitrary_precision`; keep serde_json's own text rather than panic.
        out.extend_from_slice(n.to_string().as_bytes());
    }
}

fn write_u64(mut n: u64, out: &mut Vec<u8>) {
    let mut buf = [0u8; 20];
    let mut pos = buf.len();
    loop {
        pos -= 1;
        // `n % 10` is below 10, so the cast cannot truncate.
        buf[pos] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&buf[pos..]);
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn write_u_escape(unit: u16, out: &mut Vec<u8>) {
    out.extend_from_slice(&[
        b'\\',
        b'u',
        HEX[usize::from(unit >> 12)],
        HEX[usize::from((unit >> 8) & 0xf)],
        HEX[usize::from((unit >> 4) & 0xf)],
        HEX[usize::from(unit & 0xf)],
    ]);
}

/// Writes `s` quoted and escaped as Python's `ensure_ascii=True` does.
pub(crate) fn write_string(s: &str, out: &mut Vec<u8>) {
    out.reserve(s.len() + 2);
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if (0x20..=0x7e).contains(&b) && b != b'"' && b != b'\\' {
            i += 1;
            continue;
        }
        out.extend_from_slice(&bytes[start..i]);
        if b < 0x80 {
            match b {
                b'"' => out.extend_from_slice(b"\\\""),
                b'\\' => out.extend_from_slice(b"\\\\"),
                b'\n' => out.extend_from_slice(b"\\n"),
                b'\r' => out.extend_from_slice(b"\\r"),
                b'\t' => out.extend_from_slice(b"\\t"),
                0x08 => out.extend_from_slice(b"\\b"),
                0x0c => out.extend_from_slice(b"\\f"),
                _ => write_u_escape(u16::from(b), out),
            }
            i += 1;
        } else {
            // `i` is a char boundary: we only ever step over whole chars.
            let Some(c) = s[i..].chars().next() else {
                break;
            };
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                write_u_escape(*unit, out);
            }
            i += c.len_utf8();
        }
        start = i;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// Python's `repr()` of a finite float (`1e-05`, `1e+16`, `100.0`, `-0.0`, `0.1`).
pub fn python_float_repr(f: f64) -> String {
    let mut out = Vec::with_capacity(24);
    write_float(f, &mut out);
    // `write_float` only writes ASCII, so the lossy conversion never replaces anything.
    String::from_utf8_lossy(&out).into_owned()
}

/// Writes a float as Python's `repr`: ryu's shortest round-trip digits, laid out by Python's rules.
fn write_float(f: f64, out: &mut Vec<u8>) {
    if !f.is_finite() {
        // Not reachable from a `Value`; Python would write these (invalid JSON) names.
        out.extend_from_slice(if f.is_nan() {
            b"NaN"
        } else if f > 0.0 {
            b"Infinity"
        } else {
            b"-Infinity"
        });
        return;
    }
    let mut buf = ryu::Buffer::new();
    let text = buf.format_finite(f).as_bytes();
    let (negative, text) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, text),
    };
    // Decompose ryu's text (`1.5e-7`, `0.0001`, `100.0`, `1e16`) into significant digits and
    // `point`, the number of digits before the decimal point (value = 0.DIGITS * 10^point).
    let (mantissa, exp) = match text.iter().position(|&b| b == b'e') {
        Some(pos) => (&text[..pos], parse_exp(&text[pos + 1..])),
        None => (text, 0),
    };
    let mut digits = [0u8; 24];
    let mut n = 0usize;
    let mut point: i32 = exp;
    let mut seen_point = false;
    for &b in mantissa {
        if b == b'.' {
            seen_point = true;
            continue;
        }
        if n == 0 && b == b'0' {
            // A leading zero: after the point it shifts the digits right, before it it is nothing.
            if seen_point {
                point -= 1;
            }
            continue;
        }
        if n < digits.len() {
            digits[n] = b;
            n += 1;
        }
        if !seen_point {
            point += 1;
        }
    }
    while n > 0 && digits[n - 1] == b'0' {
        n -= 1;
    }
    if negative {
        out.push(b'-');
    }
    if n == 0 {
        out.extend_from_slice(b"0.0");
        return;
    }
    let digits = &digits[..n];
    let sci_exp = point - 1;
    if !(-4..16).contains(&sci_exp) {
        out.push(digits[0]);
        if digits.len() > 1 {
            out.push(b'.');
            out.extend_from_slice(&digits[1..]);
        }
        out.push(b'e');
        out.push(if sci_exp < 0 { b'-' } else { b'+' });
        let abs = sci_exp.unsigned_abs();
        if abs < 10 {
            out.push(b'0');
        }
        write_u64(u64::from(abs), out);
    } else if point <= 0 {
        out.extend_from_slice(b"0.");
        out.resize(out.len() + point.unsigned_abs() as usize, b'0');
        out.extend_from_slice(digits);
    } else {
        // 1 <= point <= 16 here.
        let point = point.unsigned_abs() as usize;
        if point >= digits.len() {
            out.extend_from_slice(digits);
            out.resize(out.len() + (point - digits.len()), b'0');
            out.extend_from_slice(b".0");
        } else {
            out.extend_from_slice(&digits[..point]);
            out.push(b'.');
            out.extend_from_slice(&digits[point..]);
        }
    }
}

/// Parses ryu's exponent (`16`, `-7`); it is always a few plain digits.
fn parse_exp(text: &[u8]) -> i32 {
    let (negative, digits) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, text),
    };
    let magnitude = digits
        .iter()
        .fold(0i32, |acc, &d| acc * 10 + i32::from(d.wrapping_sub(b'0')));
    if negative { -magnitude } else { magnitude }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // In tests a panic is the failure report.
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// (input JSON, output of python3.11 `json.dumps(json.loads(input), sort_keys=True)`), pasted verbatim.
    const GOLDEN: &[(&str, &str)] = &[
        (r#"null"#, r#"null"#),
        (r#"true"#, r#"true"#),
        (r#"false"#, r#"false"#),
        (r#"0"#, r#"0"#),
        (r#"-1"#, r#"-1"#),
        (r#"{}"#, r#"{}"#),
        (r#"[]"#, r#"[]"#),
        (r#""""#, r#""""#),
        (r#"[[]]"#, r#"[[]]"#),
        (r#"{"a": {}}"#, r#"{"a": {}}"#),
        (
            r#"{"b": [1, {"d": {}, "c": []}], "a": {"z": null, "y": true, "x": false}}"#,
            r#"{"a": {"x": false, "y": true, "z": null}, "b": [1, {"c": [], "d": {}}]}"#,
        ),
        (
            r#"[1, [2, [3, [4, {"k": [5]}]]]]"#,
            r#"[1, [2, [3, [4, {"k": [5]}]]]]"#,
        ),
        (
            r#"{"z": 1, "Z": 2, "a": 3, "A": 4, "_": 5, "é": 6, "東": 7, "😀": 8, "ｚ": 9, "\uffff": 10, "\u00e9a": 11, "": 12, "aa": 13, "a\u0000": 14}"#,
            r#"{"": 12, "A": 4, "Z": 2, "_": 5, "a": 3, "a\u0000": 14, "aa": 13, "z": 1, "\u00e9": 6, "\u00e9a": 11, "\u6771": 7, "\uff5a": 9, "\uffff": 10, "\ud83d\ude00": 8}"#,
        ),
        (
            r#""quote\" backslash\\ slash/ nl\n cr\r tab\t bs\b ff\f""#,
            r#""quote\" backslash\\ slash/ nl\n cr\r tab\t bs\b ff\f""#,
        ),
        (
            r#""\u0000\u0001\u0007\u000b\u000e\u001f \u007f~""#,
            r#""\u0000\u0001\u0007\u000b\u000e\u001f \u007f~""#,
        ),
        (
            r#""\u0080\u00a0\u00e9\u00ff\u0100\u2014\u2028\u2029\ufeff\uffff""#,
            r#""\u0080\u00a0\u00e9\u00ff\u0100\u2014\u2028\u2029\ufeff\uffff""#,
        ),
        (
            r#""Plan a trip to Tokyo \u2014 東京 ✈""#,
            r#""Plan a trip to Tokyo \u2014 \u6771\u4eac \u2708""#,
        ),
        (
            r#""😀 𝄞 \ud83d\ude00 \udbff\udfff \ud800\udc00""#,
            r#""\ud83d\ude00 \ud834\udd1e \ud83d\ude00 \udbff\udfff \ud800\udc00""#,
        ),
        (
            r#"{"✈": "😀", "𝄞": ["\t", "/", "</script>"]}"#,
            r#"{"\u2708": "\ud83d\ude00", "\ud834\udd1e": ["\t", "/", "</script>"]}"#,
        ),
        (
            r#"[-9223372036854775808, 9223372036854775807, 18446744073709551615, 9007199254740993, -9007199254740993]"#,
            r#"[-9223372036854775808, 9223372036854775807, 18446744073709551615, 9007199254740993, -9007199254740993]"#,
        ),
        (
            r#"[0.1, 1e-05, 0.0001, 1e16, 1e15, 123456789012345680.0, 5e-324, 1.7976931348623157e308, -0.0, 100.0, 1500.5, 2.5e-07]"#,
            r#"[0.1, 1e-05, 0.0001, 1e+16, 1000000000000000.0, 1.2345678901234568e+17, 5e-324, 1.7976931348623157e+308, -0.0, 100.0, 1500.5, 2.5e-07]"#,
        ),
        (
            r#"[0.0, 1.0, -1.5, 1e100, 1e-100, 1.5e-07, 1e22, 1e21, 9999999999999998.0, 1.2345678901234567e-05, 0.30000000000000004, 2.2250738585072014e-308, 12345.678, 0.5, 3.141592653589793, -1e-07, 1e+16, 1.0e15]"#,
            r#"[0.0, 1.0, -1.5, 1e+100, 1e-100, 1.5e-07, 1e+22, 1e+21, 9999999999999998.0, 1.2345678901234568e-05, 0.30000000000000004, 2.2250738585072014e-308, 12345.678, 0.5, 3.141592653589793, -1e-07, 1e+16, 1000000000000000.0]"#,
        ),
        (
            r#"{"content": "Budget: 1500.50 EUR", "cost_usd": 0.002, "n": 42, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Tōkyō\"}"}}]}"#,
            r#"{"content": "Budget: 1500.50 EUR", "cost_usd": 0.002, "n": 42, "tool_calls": [{"function": {"arguments": "{\"city\": \"T\u014dky\u014d\"}", "name": "get_weather"}, "id": "call_1", "type": "function"}]}"#,
        ),
    ];

    #[test]
    fn golden_python_outputs() {
        for (input, expected) in GOLDEN {
            let value: Value = serde_json::from_str(input).unwrap();
            let got = to_canonical_bytes(&value);
            assert_eq!(String::from_utf8(got).unwrap(), *expected, "input: {input}");
        }
    }

    #[test]
    fn float_repr_table() {
        // Python 3.11 repr() of each value.
        let cases: &[(f64, &str)] = &[
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789012345680.0, "1.2345678901234568e+17"),
            (5e-324, "5e-324"),
            (f64::MAX, "1.7976931348623157e+308"),
            (f64::MIN_POSITIVE, "2.2250738585072014e-308"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (100.0, "100.0"),
            (1500.5, "1500.5"),
            (2.5e-7, "2.5e-07"),
            (1e100, "1e+100"),
            (-1.5e-7, "-1.5e-07"),
            (9999999999999998.0, "9999999999999998.0"),
        ];
        for (f, expected) in cases {
            assert_eq!(python_float_repr(*f), *expected, "{f:e}");
        }
    }

    fn arb_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            (-1e6f64..1e6).prop_map(Value::from),
            any::<String>().prop_map(Value::String),
            "[ -~\u{7f}\u{0}-\u{1f}é東✈😀𝄞]{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map(any::<String>(), inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn float_repr_round_trips(f in any::<f64>().prop_filter("finite", |f| f.is_finite())) {
            let text = python_float_repr(f);
            let back: f64 = text.parse().unwrap();
            prop_assert_eq!(back.to_bits(), f.to_bits(), "{}", text);
        }

        #[test]
        fn output_is_ascii_and_parses_back(v in arb_value()) {
            let bytes = to_canonical_bytes(&v);
            prop_assert!(bytes.is_ascii());
            let back: Value = serde_json::from_slice(&bytes).unwrap();
            prop_assert_eq!(back, v);
        }
    }

    /// Differential test against the machine's python3: ours must equal `json.dumps(x, sort_keys=True)`.
    #[test]
    fn matches_python3_json_dumps() {
        use proptest::strategy::ValueTree;
        use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
        use std::io::Write;
        use std::process::{Command, Stdio};

        let script = "import json, sys\n\
                      for x in json.load(sys.stdin):\n    \
                      sys.stdout.write(json.dumps(x, sort_keys=True) + '\\n')\n";
        let child = Command::new("python3")
            .args(["-c", script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn();
        let mut child = match child {
            Ok(child) => child,
            Err(err) => {
                println!("python3 not available ({err}); skipping the differential test");
                return;
            }
        };

        let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]);
        let mut runner = TestRunner::new_with_rng(Config::default(), rng);
        let strategy = arb_value();
        let mut values: Vec<Value> = (0..200)
            .map(|_| strategy.new_tree(&mut runner).unwrap().current())
            .collect();
        // The vectors that matter most, always included.
        for f in [
            0.1,
            1e-5,
            1e16,
            1e15,
            1500.5,
            -0.0,
            5e-324,
            f64::MAX,
            2.5e-7,
            1e22,
        ] {
            values.push(Value::from(f));
        }
        let input = serde_json::to_vec(&values).unwrap();

        let mut stdin = child.stdin.take().unwrap();
        // Write from a thread so a full stdout pipe cannot deadlock us.
        let writer = std::thread::spawn(move || stdin.write_all(&input));
        let output = child.wait_with_output().unwrap();
        writer.join().unwrap().unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );

        let stdout = String::from_utf8(output.stdout).unwrap();
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines.len(), values.len());
        for (value, line) in values.iter().zip(lines) {
            let ours = String::from_utf8(to_canonical_bytes(value)).unwrap();
            assert_eq!(ours, line, "value: {value:?}");
        }
    }
}
