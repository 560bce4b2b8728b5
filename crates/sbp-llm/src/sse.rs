//! Server-sent events read incrementally, as the HTML standard's event-stream parsing says, for
//! the two fields a provider reads (`event`, `data`): each byte is looked at once, an event may
//! hold at most a bound of bytes, and a stream that is not UTF-8 is an error, not a stall.

/// One event: its type (`message` when none was named) and its data lines joined by `\n`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Event {
    pub event: String,
    pub data: String,
}

/// Why a stream cannot be read on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SseError {
    #[error("a server-sent event larger than {0} bytes")]
    TooLarge(usize),
    #[error("the event stream is not UTF-8")]
    NotUtf8,
}

/// The parser's state between two reads: the unfinished line and the unfinished event.
#[derive(Debug)]
pub(crate) struct Parser {
    max: usize,
    line: Vec<u8>,
    event: String,
    data: String,
    /// The last read ended with a CR: a LF starting the next one ends the same line.
    after_cr: bool,
    /// No line has ended yet (a byte order mark may start the first).
    first_line: bool,
}

impl Parser {
    /// A parser holding at most `max` bytes of one event (its unfinished line included).
    pub(crate) fn new(max: usize) -> Self {
        Self {
            max,
            line: Vec::new(),
            event: String::new(),
            data: String::new(),
            after_cr: false,
            first_line: true,
        }
    }

    /// Reads `bytes` up to the end of the first event they complete: how many bytes it took,
    /// and that event if one was completed (the rest is for the next call). An error comes only
    /// once the events before it have been given out.
    pub(crate) fn feed(&mut self, bytes: &[u8]) -> Result<(usize, Option<Event>), SseError> {
        let mut at = 0;
        if self.after_cr && !bytes.is_empty() {
            self.after_cr = false;
            if bytes[0] == b'\n' {
                at = 1;
            }
        }
        while let Some(end) = bytes[at..].iter().position(|&b| b == b'\n' || b == b'\r') {
            let end = at + end;
            self.line.extend_from_slice(&bytes[at..end]);
            self.check_size()?;
            let event = self.end_line()?;
            at = end + 1;
            if bytes[end] == b'\r' {
                match bytes.get(at) {
                    Some(b'\n') => at += 1,
                    None => self.after_cr = true,
                    Some(_) => {}
                }
            }
            if event.is_some() {
                return Ok((at, event));
            }
        }
        self.line.extend_from_slice(&bytes[at..]);
        self.check_size()?;
        Ok((bytes.len(), None))
    }

    fn check_size(&self) -> Result<(), SseError> {
        match self.line.len() + self.event.len() + self.data.len() > self.max {
            true => Err(SseError::TooLarge(self.max)),
            false => Ok(()),
        }
    }

    /// A line has ended: the event it completes, if any.
    fn end_line(&mut self) -> Result<Option<Event>, SseError> {
        let mut line = std::mem::take(&mut self.line);
        let mut text = std::str::from_utf8(&line).map_err(|_| SseError::NotUtf8)?;
        if std::mem::take(&mut self.first_line) {
            text = text.strip_prefix('\u{feff}').unwrap_or(text);
        }
        let mut event = None;
        if text.is_empty() {
            event = self.dispatch();
        } else if !text.starts_with(':') {
            let (field, value) = match text.split_once(':') {
                Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
                None => (text, ""),
            };
            match field {
                "data" => {
                    self.data.push_str(value);
                    self.data.push('\n');
                }
                "event" => value.clone_into(&mut self.event),
                // `id` and `retry` serve reconnection, which a provider call does not do.
                _ => {}
            }
        }
        // The line's buffer is kept for the next line, unless a long line made it large.
        if line.capacity() <= KEPT_LINE_CAPACITY {
            line.clear();
            self.line = line;
        }
        Ok(event)
    }

    /// A blank line: the event so far, if it has data, is complete.
    fn dispatch(&mut self) -> Option<Event> {
        let event = std::mem::take(&mut self.event);
        if self.data.is_empty() {
            return None;
        }
        let mut data = std::mem::take(&mut self.data);
        data.pop();
        Some(Event {
            event: match event.is_empty() {
                true => "message".to_owned(),
                false => event,
            },
            data,
        })
    }
}

/// The line buffer's capacity kept from one line to the next.
const KEPT_LINE_CAPACITY: usize = 64 << 10;

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(event: &str, data: &str) -> Event {
        Event {
            event: event.to_owned(),
            data: data.to_owned(),
        }
    }

    /// The events of `text` fed in pieces cut at every one of `cuts`.
    fn parse(text: &[u8], cuts: &[usize], max: usize) -> Result<Vec<Event>, SseError> {
        let mut p = Parser::new(max);
        let mut out = Vec::new();
        let mut at = 0;
        for &cut in cuts.iter().chain([&text.len()]) {
            let mut piece = &text[at..cut];
            loop {
                let (taken, event) = p.feed(piece)?;
                piece = &piece[taken..];
                match event {
                    Some(event) => out.push(event),
                    None => break,
                }
            }
            assert!(
                piece.is_empty(),
                "a read is taken whole once no event is left in it"
            );
            at = cut;
        }
        Ok(out)
    }

    /// Every line ending the standard allows, a byte order mark, comments, fields without a value
    /// or a space, several data lines and named events read the same wherever the bytes are cut.
    #[test]
    fn events_read_the_same_however_the_bytes_arrive() {
        let text = "\u{feff}: a comment\r\ndata: one\r\n\r\nevent: ping\rdata:two\rdata\r\rdata:  three \n\ndata: {\"x\":1}\n\nid: 7\nretry: 5\n\n: nothing\n\nevent: only a name\n\ndata: last\r\n\r\n";
        let want = vec![
            ev("message", "one"),
            ev("ping", "two\n"),
            ev("message", " three "),
            ev("message", "{\"x\":1}"),
            ev("message", "last"),
        ];
        let bytes = text.as_bytes();
        for cut in 0..=bytes.len() {
            assert_eq!(
                parse(bytes, &[cut], 1 << 10),
                Ok(want.clone()),
                "cut at {cut}"
            );
        }
        let every: Vec<usize> = (1..bytes.len()).collect();
        assert_eq!(parse(bytes, &every, 1 << 10), Ok(want));
    }

    /// An event without its blank line is not given out, and a stream's unfinished event is not
    /// either (the standard drops it).
    #[test]
    fn an_unfinished_event_is_held() {
        assert_eq!(parse(b"data: a\n", &[], 64), Ok(vec![]));
        assert_eq!(
            parse(b"data: a\n\ndata: b", &[], 64),
            Ok(vec![ev("message", "a")])
        );
        // A CR at the end of one read and a LF at the start of the next end one line, also
        // with an empty read between them.
        assert_eq!(
            parse(b"data: a\r\n\r\n", &[8, 9, 10], 64),
            Ok(vec![ev("message", "a")])
        );
        assert_eq!(
            parse(b"data: a\r\ndata: b\n\n", &[8, 8, 8], 64),
            Ok(vec![ev("message", "a\nb")])
        );
        // A byte order mark is dropped only at the stream's start.
        assert_eq!(
            parse("data: a\n\n\u{feff}data: b\n\n".as_bytes(), &[], 64),
            Ok(vec![ev("message", "a")])
        );
    }

    /// An event may hold at most the bound, counting its unfinished line, and blank lines do not
    /// reset what an event already holds; an event at the bound is read.
    #[test]
    fn an_event_past_its_bound_fails_the_stream() {
        let long = format!("data: {}", "x".repeat(100));
        assert_eq!(
            parse(long.as_bytes(), &[50], 64),
            Err(SseError::TooLarge(64))
        );
        let lines = "data: xxxxxxxxxx\n".repeat(10);
        assert_eq!(
            parse(lines.as_bytes(), &[], 64),
            Err(SseError::TooLarge(64))
        );
        // Each event under the bound: any number of them.
        let events = "data: xxxxxxxxxx\n\n".repeat(100);
        assert_eq!(
            parse(events.as_bytes(), &[7, 300], 64).map(|e| e.len()),
            Ok(100)
        );
        // `data: ` + 58 bytes is the bound exactly.
        let exact = format!("data: {}\n\n", "y".repeat(58));
        assert_eq!(parse(exact.as_bytes(), &[], 64).map(|e| e.len()), Ok(1));
    }

    /// A read is taken up to the end of the event it completes, its CRLF or its last CR
    /// included; a LF in the next read after such a CR belongs to it.
    #[test]
    fn a_read_is_taken_to_the_end_of_its_event() {
        let mut p = Parser::new(64);
        let (taken, event) = p.feed(b"data: a\r\n\r\nX").expect("read");
        assert_eq!((taken, event), (11, Some(ev("message", "a"))));
        let mut p = Parser::new(64);
        let (taken, event) = p.feed(b"data: a\r\n\r").expect("read");
        assert_eq!((taken, event), (10, Some(ev("message", "a"))));
        assert_eq!(p.feed(b"\n").expect("read"), (1, None));
        let (taken, event) = p.feed(b"data: b\n\n").expect("read");
        assert_eq!((taken, event), (9, Some(ev("message", "b"))));
    }

    /// The events before a bad line are given out before its error, however the bytes arrive.
    #[test]
    fn events_before_an_error_come_first() {
        let bytes = b"data: one\n\ndata: [DONE]\n\n\xff\n";
        for cut in 0..=bytes.len() {
            let mut p = Parser::new(64);
            let (taken, first) = p.feed(&bytes[..cut.max(11)]).expect("no error yet");
            assert_eq!(first, Some(ev("message", "one")), "cut at {cut}");
            assert_eq!(taken, 11);
        }
    }

    /// A byte that is not UTF-8 fails the stream at the end of its line, wherever it is cut.
    #[test]
    fn a_stream_not_utf8_fails() {
        let bytes = b"data: ok\n\ndata: \xff\n\n\n\n\n\n";
        for cut in 0..bytes.len() {
            assert_eq!(
                parse(bytes, &[cut], 64),
                Err(SseError::NotUtf8),
                "cut at {cut}"
            );
        }
        // A character split between two reads is whole again.
        let e_acute = "data: caf\u{e9}\n\n".as_bytes();
        for cut in 0..e_acute.len() {
            assert_eq!(parse(e_acute, &[cut], 64), Ok(vec![ev("message", "café")]));
        }
    }
}
