//! A completion request body (`ChatRequest::from_object`) on arbitrary JSON: no input panics,
//! every view of the messages reads without panicking, what parsed survives its own
//! serialisation, and the request editors (output cap, system note, usage) keep it parseable.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sbp_protocol::ChatRequest;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Ok(Value::Object(body)) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let Ok(mut req) = ChatRequest::from_object(body) else {
        return;
    };
    let _ = req.wants_stream();
    let _ = req.declared_functions();
    let _ = req.output_token_limit();
    for m in &req.messages {
        let _ = (
            m.role(),
            m.content(),
            m.text(),
            m.tool_call_id(),
            m.has_tool_calls(),
        );
        for call in m.tool_calls() {
            let _ = (call.id(), call.name(), call.arguments());
        }
    }

    let json = serde_json::to_value(&req).expect("a parsed request serialises");
    let Value::Object(map) = json.clone() else {
        panic!("a request serialises to an object: {json}");
    };
    let again = ChatRequest::from_object(map).expect("a serialised request parses");
    assert_eq!(again, req, "round trip through {json}");

    let limit = data.first().copied().map_or(1, u64::from) + 1;
    req.cap_output_tokens(limit);
    assert!(req.output_token_limit().is_some_and(|l| l <= limit));
    req.insert_system_note("a note from the fuzzer");
    req.request_stream_usage();
    let Value::Object(map) = serde_json::to_value(&req).expect("serialises") else {
        panic!("not an object");
    };
    ChatRequest::from_object(map).expect("an edited request still parses");
});
