//! Operator configuration of southbound MCP servers, and the one-line syntax it is written in.

use std::{fmt, str::FromStr};

/// How to reach one MCP server.
#[derive(Clone, PartialEq, Eq)]
pub enum ServerTransport {
    /// A child process speaking newline-delimited JSON-RPC on stdin/stdout.
    /// `env` is added to the gateway's own environment.
    Stdio {
        command: String,
        args: Vec<String>,
        env: Vec<(String, String)>,
    },
    /// A streamable-HTTP endpoint; `bearer` is sent as `Authorization: Bearer <token>`.
    Http { url: String, bearer: Option<String> },
}

// Hand-written so that tokens and environment values (often API keys) never reach a log line.
impl fmt::Debug for ServerTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServerTransport::Stdio { command, args, env } => f
                .debug_struct("Stdio")
                .field("command", command)
                .field("args", args)
                .field(
                    "env",
                    &env.iter()
                        .map(|(k, _)| format!("{k}=<redacted>"))
                        .collect::<Vec<_>>(),
                )
                .finish(),
            ServerTransport::Http { url, bearer } => f
                .debug_struct("Http")
                .field("url", url)
                .field("bearer", &bearer.as_ref().map(|_| "<redacted>"))
                .finish(),
        }
    }
}

/// One configured MCP server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Unique among the configured servers: ASCII letters, digits, `_` and `-`.
    pub name: String,
    pub transport: ServerTransport,
}

/// Why an operator's server line was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("expected `name=stdio:<command line>` or `name=http(s)://...`, got {0:?}")]
    Syntax(String),
    #[error("invalid server name {0:?}: use ASCII letters, digits, `_` and `-`")]
    Name(String),
    #[error("empty command line for MCP server {0:?}")]
    EmptyCommand(String),
    #[error("unterminated quote in command line of MCP server {0:?}")]
    UnterminatedQuote(String),
    #[error("trailing backslash in command line of MCP server {0:?}")]
    TrailingBackslash(String),
    #[error("invalid URL for MCP server {name:?}: {reason}")]
    Url { name: String, reason: String },
}

impl ServerConfig {
    pub(crate) fn name_is_valid(name: &str) -> bool {
        !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    }
}

/// Parses one line of operator configuration:
///
/// * `name=stdio:<command line>`: the command line is split like a POSIX shell would, without
///   expansions: whitespace separates words, `'...'` is literal, `"..."` allows `\"` and `\\`, and a
///   backslash outside quotes escapes the next character. Leading `KEY=value` words become the
///   child's extra environment, as in a shell: `fs=stdio:API_KEY=abc npx -y @scope/server /data`.
/// * `name=http://host/path` or `name=https://host/path`: a streamable-HTTP server, no bearer token
///   (set [`ServerTransport::Http::bearer`] from a secret store, not from a config line).
impl FromStr for ServerConfig {
    type Err = ConfigError;

    fn from_str(line: &str) -> Result<Self, Self::Err> {
        let line = line.trim();
        let (name, spec) = line
            .split_once('=')
            .ok_or_else(|| ConfigError::Syntax(line.to_owned()))?;
        let name = name.trim();
        if !ServerConfig::name_is_valid(name) {
            return Err(ConfigError::Name(name.to_owned()));
        }
        let spec = spec.trim();
        let transport = if let Some(command_line) = spec.strip_prefix("stdio:") {
            stdio_transport(name, command_line)?
        } else if spec.starts_with("http://") || spec.starts_with("https://") {
            let uri: http::Uri =
                spec.parse()
                    .map_err(|e: http::uri::InvalidUri| ConfigError::Url {
                        name: name.to_owned(),
                        reason: e.to_string(),
                    })?;
            if uri.host().is_none_or(str::is_empty) {
                return Err(ConfigError::Url {
                    name: name.to_owned(),
                    reason: "no host".into(),
                });
            }
            ServerTransport::Http {
                url: spec.to_owned(),
                bearer: None,
            }
        } else {
            return Err(ConfigError::Syntax(line.to_owned()));
        };
        Ok(ServerConfig {
            name: name.to_owned(),
            transport,
        })
    }
}

fn stdio_transport(name: &str, command_line: &str) -> Result<ServerTransport, ConfigError> {
    let mut words = split_command_line(command_line).map_err(|e| match e {
        SplitError::UnterminatedQuote => ConfigError::UnterminatedQuote(name.to_owned()),
        SplitError::TrailingBackslash => ConfigError::TrailingBackslash(name.to_owned()),
    })?;
    let assignments = words
        .iter()
        .take_while(|w| env_assignment(&w.text).is_some() && !w.quoted_name)
        .count();
    let rest = words.split_off(assignments);
    let env = words
        .iter()
        .filter_map(|w| env_assignment(&w.text))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let mut rest = rest.into_iter().map(|w| w.text);
    let command = rest
        .next()
        .ok_or_else(|| ConfigError::EmptyCommand(name.to_owned()))?;
    Ok(ServerTransport::Stdio {
        command,
        args: rest.collect(),
        env,
    })
}

fn env_assignment(word: &str) -> Option<(&str, &str)> {
    let (key, value) = word.split_once('=')?;
    let mut bytes = key.bytes();
    let first_ok = bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
    (first_ok && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')).then_some((key, value))
}

#[derive(Debug, PartialEq, Eq)]
enum SplitError {
    UnterminatedQuote,
    TrailingBackslash,
}

struct Word {
    text: String,
    /// Some part before the first `=` was quoted or escaped; a shell would not treat such a word
    /// as an assignment (`"A"=1 cmd` runs a command named `A=1`).
    quoted_name: bool,
}

fn split_command_line(line: &str) -> Result<Vec<Word>, SplitError> {
    let mut words = Vec::new();
    let mut current: Option<Word> = None;
    let mut chars = line.chars();
    let mut seen_eq = false;
    let mark_quoted = |word: &mut Word, seen_eq: bool| {
        if !seen_eq {
            word.quoted_name = true;
        }
    };
    while let Some(c) = chars.next() {
        if c.is_whitespace() {
            if let Some(word) = current.take() {
                words.push(word);
            }
            seen_eq = false;
            continue;
        }
        let word = current.get_or_insert_with(|| Word {
            text: String::new(),
            quoted_name: false,
        });
        match c {
            '\'' => {
                mark_quoted(word, seen_eq);
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => word.text.push(c),
                        None => return Err(SplitError::UnterminatedQuote),
                    }
                }
            }
            '"' => {
                mark_quoted(word, seen_eq);
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\')) => word.text.push(c),
                            Some(c) => {
                                word.text.push('\\');
                                word.text.push(c);
                            }
                            None => return Err(SplitError::UnterminatedQuote),
                        },
                        Some(c) => word.text.push(c),
                        None => return Err(SplitError::UnterminatedQuote),
                    }
                }
            }
            '\\' => {
                mark_quoted(word, seen_eq);
                match chars.next() {
                    Some(c) => word.text.push(c),
                    None => return Err(SplitError::TrailingBackslash),
                }
            }
            c => {
                if c == '=' {
                    seen_eq = true;
                }
                word.text.push(c);
            }
        }
    }
    if let Some(word) = current {
        words.push(word);
    }
    Ok(words)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stdio(command: &str, args: &[&str], env: &[(&str, &str)]) -> ServerTransport {
        ServerTransport::Stdio {
            command: command.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    #[test]
    fn parses_good_lines() {
        let cases = [
            (
                "fs=stdio:npx -y @modelcontextprotocol/server-filesystem /data",
                "fs",
                stdio(
                    "npx",
                    &["-y", "@modelcontextprotocol/server-filesystem", "/data"],
                    &[],
                ),
            ),
            (
                r#" py = stdio:python3 "my server.py" --name 'a b' x\ y "q\"q" "#,
                "py",
                stdio(
                    "python3",
                    &["my server.py", "--name", "a b", "x y", "q\"q"],
                    &[],
                ),
            ),
            (
                "k=stdio:API_KEY=abc DEBUG= node s.js --opt=1",
                "k",
                stdio(
                    "node",
                    &["s.js", "--opt=1"],
                    &[("API_KEY", "abc"), ("DEBUG", "")],
                ),
            ),
            (r#"q=stdio:"A"=1 b"#, "q", stdio("A=1", &["b"], &[])),
            (
                "x=stdio:K='a b' cmd",
                "x",
                stdio("cmd", &[], &[("K", "a b")]),
            ),
            (
                "remote=https://mcp.example.com/mcp?x=1",
                "remote",
                ServerTransport::Http {
                    url: "https://mcp.example.com/mcp?x=1".into(),
                    bearer: None,
                },
            ),
            (
                "local_2=http://127.0.0.1:8080/mcp",
                "local_2",
                ServerTransport::Http {
                    url: "http://127.0.0.1:8080/mcp".into(),
                    bearer: None,
                },
            ),
        ];
        for (line, name, transport) in cases {
            let parsed: ServerConfig = line.parse().unwrap_or_else(|e| panic!("{line}: {e}"));
            assert_eq!(parsed.name, name, "{line}");
            assert_eq!(parsed.transport, transport, "{line}");
        }
    }

    #[test]
    fn rejects_bad_lines() {
        let cases = [
            ("no-equals", ConfigError::Syntax("no-equals".into())),
            ("=stdio:x", ConfigError::Name("".into())),
            ("a b=stdio:x", ConfigError::Name("a b".into())),
            ("a=ftp://x", ConfigError::Syntax("a=ftp://x".into())),
            ("a=stdio:   ", ConfigError::EmptyCommand("a".into())),
            ("a=stdio:K=v", ConfigError::EmptyCommand("a".into())),
            ("a=stdio:x 'y", ConfigError::UnterminatedQuote("a".into())),
            (
                "a=stdio:x \"y\\",
                ConfigError::UnterminatedQuote("a".into()),
            ),
            ("a=stdio:x \\", ConfigError::TrailingBackslash("a".into())),
        ];
        for (line, expected) in cases {
            assert_eq!(line.parse::<ServerConfig>(), Err(expected), "{line}");
        }
        assert!(matches!(
            "a=http://".parse::<ServerConfig>(),
            Err(ConfigError::Url { .. })
        ));
    }

    #[test]
    fn debug_hides_secrets() {
        let config = ServerConfig {
            name: "s".into(),
            transport: ServerTransport::Http {
                url: "https://x".into(),
                bearer: Some("sekrit".into()),
            },
        };
        assert!(!format!("{config:?}").contains("sekrit"));
        let config: ServerConfig = "s=stdio:TOKEN=sekrit cmd".parse().expect("valid line");
        assert!(!format!("{config:?}").contains("sekrit"));
    }
}
