//! Parses the `[[fake:NAME=VALUE]]` directives that script the fake out of a prompt.
//!
//! Pure: no IO, no clock. An unknown directive or a bad value is an error rather than
//! being ignored, so a typo in a test prompt fails loudly instead of silently echoing.

use std::fmt;
use std::time::Duration;

const OPEN: &str = "[[fake:";
const CLOSE: &str = "]]";

/// Everything the directives in one prompt asked for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Directives {
    /// `slow=MS`: wait before answering (before the first chunk when streaming).
    pub slow: Option<Duration>,
    /// `chunk_delay=MS`: wait between SSE events.
    pub chunk_delay: Option<Duration>,
    /// `error=STATUS`: answer with this HTTP status and an OpenAI error body.
    pub error: Option<u16>,
    /// `reply=TEXT`: reply with TEXT instead of the echo.
    pub reply: Option<String>,
    /// `chunks=N`: stream the reply as exactly N content chunks.
    pub chunks: Option<usize>,
    /// `tool=NAME` or `tool=NAME:{json}`, in prompt order.
    pub tools: Vec<ToolDirective>,
    /// `hang=1`: never answer.
    pub hang: bool,
    /// `drop=1`: abort the connection after two SSE events.
    pub drop: bool,
}

/// One `tool=` directive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolDirective {
    pub name: String,
    /// The arguments exactly as written in the prompt (may be invalid JSON on purpose).
    pub arguments: String,
}

/// A prompt with its directives taken out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed {
    pub directives: Directives,
    /// The prompt without directives, trimmed at both ends.
    pub text: String,
}

/// Why a prompt's directives could not be understood.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirectiveError(pub String);

impl fmt::Display for DirectiveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DirectiveError {}

fn err(message: impl Into<String>) -> DirectiveError {
    DirectiveError(message.into())
}

/// Takes every `[[fake:NAME=VALUE]]` out of `input`.
pub fn parse(input: &str) -> Result<Parsed, DirectiveError> {
    let mut directives = Directives::default();
    if !input.contains(OPEN) {
        return Ok(Parsed {
            directives,
            text: input.trim().to_owned(),
        });
    }
    let mut text = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(start) = rest.find(OPEN) {
        text.push_str(&rest[..start]);
        let body = &rest[start + OPEN.len()..];
        let used = apply(body, &mut directives)?;
        rest = &body[used..];
    }
    text.push_str(rest);
    Ok(Parsed {
        directives,
        text: text.trim().to_owned(),
    })
}

/// Applies the directive at the start of `body` (just after `[[fake:`) and returns how many
/// bytes of `body` it took, closing `]]` included.
fn apply(body: &str, d: &mut Directives) -> Result<usize, DirectiveError> {
    let close = body
        .find(CLOSE)
        .ok_or_else(|| err(format!("unterminated directive `{OPEN}{body}`")))?;
    let eq = body[..close]
        .find('=')
        .ok_or_else(|| err(format!("directive `{}` has no `=VALUE`", &body[..close])))?;
    let name = body[..eq].trim();
    let value_start = eq + 1;

    if name == "tool" {
        let (tool, used) = tool(&body[value_start..])?;
        d.tools.push(tool);
        return Ok(value_start + used);
    }

    let value = &body[value_start..close];
    match name {
        "slow" => d.slow = Some(millis(name, value)?),
        "chunk_delay" => d.chunk_delay = Some(millis(name, value)?),
        "error" => d.error = Some(status(value)?),
        "reply" => d.reply = Some(value.to_owned()),
        "chunks" => {
            let n: usize = number(name, value)?;
            if n == 0 {
                return Err(err("`chunks` must be at least 1"));
            }
            d.chunks = Some(n);
        }
        "hang" => d.hang = flag(name, value)?,
        "drop" => d.drop = flag(name, value)?,
        other => return Err(err(format!("unknown fake directive `{other}`"))),
    }
    Ok(close + CLOSE.len())
}

/// Parses `NAME` or `NAME:ARGS` up to the closing `]]`. ARGS that parse as one JSON value may
/// contain `]]` themselves; anything else runs to the first `]]` and is kept verbatim, so a test
/// can script malformed arguments.
fn tool(value: &str) -> Result<(ToolDirective, usize), DirectiveError> {
    let close = value
        .find(CLOSE)
        .ok_or_else(|| err("unterminated `tool` directive"))?;
    let (name_end, args_start) = match value[..close].find(':') {
        Some(colon) => (colon, Some(colon + 1)),
        None => (close, None),
    };
    let name = value[..name_end].trim();
    if name.is_empty() {
        return Err(err("`tool` needs a function name"));
    }
    let Some(args_start) = args_start else {
        let tool = ToolDirective {
            name: name.to_owned(),
            arguments: "{}".to_owned(),
        };
        return Ok((tool, close + CLOSE.len()));
    };

    let args = &value[args_start..];
    let mut values = serde_json::Deserializer::from_str(args).into_iter::<serde::de::IgnoredAny>();
    if let Some(Ok(_)) = values.next() {
        let end = values.byte_offset();
        let after = &args[end..];
        let trimmed = after.trim_start();
        if trimmed.starts_with(CLOSE) {
            let used = args_start + end + (after.len() - trimmed.len()) + CLOSE.len();
            let tool = ToolDirective {
                name: name.to_owned(),
                arguments: args[..end].trim().to_owned(),
            };
            return Ok((tool, used));
        }
    }
    let tool = ToolDirective {
        name: name.to_owned(),
        arguments: value[args_start..close].trim().to_owned(),
    };
    Ok((tool, close + CLOSE.len()))
}

fn number<T: std::str::FromStr>(name: &str, value: &str) -> Result<T, DirectiveError> {
    value
        .trim()
        .parse()
        .map_err(|_| err(format!("`{name}` wants a number, got `{value}`")))
}

fn millis(name: &str, value: &str) -> Result<Duration, DirectiveError> {
    number(name, value).map(Duration::from_millis)
}

/// An HTTP status the fake can answer with: 200..=599 (1xx is not a final response).
pub fn status(value: &str) -> Result<u16, DirectiveError> {
    let code: u16 = number("error", value)?;
    if (200..=599).contains(&code) {
        Ok(code)
    } else {
        Err(err(format!(
            "`error` wants an HTTP status 200..=599, got {code}"
        )))
    }
}

fn flag(name: &str, value: &str) -> Result<bool, DirectiveError> {
    match value.trim() {
        "1" | "true" => Ok(true),
        "0" | "false" => Ok(false),
        other => Err(err(format!("`{name}` wants 1 or 0, got `{other}`"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(input: &str) -> Parsed {
        parse(input).expect("directives parse")
    }

    #[test]
    fn plain_text_is_trimmed_and_has_no_directives() {
        let p = ok("  hello world \n");
        assert_eq!(p.text, "hello world");
        assert_eq!(p.directives, Directives::default());
    }

    #[test]
    fn every_directive_parses_and_is_stripped() {
        let p = ok(
            "a [[fake:slow=10]]b[[fake:chunk_delay=5]] [[fake:error=429]]\
             [[fake:reply=Hi there, friend]][[fake:chunks=3]][[fake:hang=1]][[fake:drop=true]] c",
        );
        assert_eq!(p.text, "a b  c");
        let d = p.directives;
        assert_eq!(d.slow, Some(Duration::from_millis(10)));
        assert_eq!(d.chunk_delay, Some(Duration::from_millis(5)));
        assert_eq!(d.error, Some(429));
        assert_eq!(d.reply.as_deref(), Some("Hi there, friend"));
        assert_eq!(d.chunks, Some(3));
        assert!(d.hang);
        assert!(d.drop);
    }

    #[test]
    fn tools_keep_order_and_arguments() {
        let p = ok(
            r#"[[fake:tool=lookup]] [[fake:tool=get_weather:{"city":"Paris","days":[[1,2]]}]] [[fake:tool=bad:{not json]] done"#,
        );
        assert_eq!(p.text, "done");
        let names: Vec<_> = p.directives.tools.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["lookup", "get_weather", "bad"]);
        let args: Vec<_> = p
            .directives
            .tools
            .iter()
            .map(|t| t.arguments.as_str())
            .collect();
        assert_eq!(
            args,
            ["{}", r#"{"city":"Paris","days":[[1,2]]}"#, "{not json"]
        );
    }

    #[test]
    fn mistakes_are_errors() {
        for bad in [
            "[[fake:slow=abc]]",
            "[[fake:slow=10",
            "[[fake:nope=1]]",
            "[[fake:slow]]",
            "[[fake:error=99]]",
            "[[fake:error=600]]",
            "[[fake:chunks=0]]",
            "[[fake:hang=yes]]",
            "[[fake:tool=]]",
            "[[fake:tool=:{}]]",
        ] {
            assert!(parse(bad).is_err(), "{bad} should not parse");
        }
    }

    #[test]
    fn reply_runs_to_the_first_close() {
        let p = ok("[[fake:reply=x = y [a]]]");
        assert_eq!(p.directives.reply.as_deref(), Some("x = y [a"));
        assert_eq!(p.text, "]");
    }
}
