//! WebSocket frames from surfaces (`ClientFrame::parse`) and from the gateway (`ServerFrame`):
//! no input panics, and a frame that parsed survives its own serialisation unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sbp_protocol::{ClientFrame, ServerFrame};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(frame) = ClientFrame::parse(text) {
        let _ = frame.type_name();
        // `Unknown` is not serialisable (the gateway never sends it back).
        if !matches!(frame, ClientFrame::Unknown { .. }) {
            let json = serde_json::to_string(&frame).expect("a parsed frame serialises");
            let again = ClientFrame::parse(&json).expect("a serialised frame parses");
            assert_eq!(again, frame, "round trip through {json}");
        }
    }
    if let Ok(frame) = serde_json::from_str::<ServerFrame>(text) {
        let json = frame.to_json();
        let again: ServerFrame =
            serde_json::from_str(&json).expect("the gateway's own frame parses");
        assert_eq!(again, frame, "round trip through {json}");
    }
});
