//! The demo's story, step by step, told through the client SDK against the two gateways: every
//! fact printed is one the SDK read off the wire (HTTP responses, WebSocket frames), and every
//! step checks what it shows, so a gateway or SDK that misbehaves fails the step that saw it.

use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use base64::Engine as _;
use sbp_adapt::estimate_tokens;
use sbp_client::protocol::frames::ToolCall;
use sbp_client::protocol::{ServerFrame, SessionStatus, SurfaceContext};
use sbp_client::types::{
    ChatReply, Delivery, ExportRequest, HandoffRequest, ImportRequest, Lineage, NewSession,
    PushTurn, StoredMessage,
};
use sbp_client::{
    Client, DisconnectKind, Event, SessionClient, Surface, SurfaceConfig, ToolSpec, Tools,
};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::out::{Out, Style};

/// The steps' headings, in order.
pub const STEPS: [&str; 8] = [
    "A phone attaches and asks",
    "The phone goes offline; the agent keeps working",
    "A watch attaches and drains the tether",
    "A desktop takes over and gets Markdown",
    "The agent calls the phone's gps",
    "The session roams: export, import, fork, handoff",
    "The phone attaches to gateway B; the session follows",
    "What you just saw",
];

/// The watch's output budget.
const WATCH_TOKENS: u64 = 40;
/// Longest wait for any one thing the gateway is expected to do.
const WAIT: Duration = Duration::from_secs(10);

/// Where the phone is, as its `gps` tool answers.
const LAT: f64 = 35.6586;
const LON: f64 = 139.7454;

const QUESTION: &str = "What should I see in Tokyo in three days?";
const AWAY_HOTELS: &str = "While you were offline I compared fourteen hotels near Shinjuku \
    station. Three stand out for price and location: the first is four minutes from the south \
    exit, the second has a rooftop bath with a view of Mount Fuji on clear mornings, and the \
    third is the cheapest at sixteen thousand yen a night. Shall I hold a room at one of them?";
const AWAY_PLAN: &str = "Today's plan:\n\n- **09:00** Tsukiji outer market\n- **11:30** \
    teamLab Planets\n- **15:00** Asakusa and Senso-ji\n\nBring *cash* for the market stalls.";
const AWAY_FLIGHT: &str = "Flight update: your Thursday flight to Sapporo now leaves at 10:40 \
    instead of 09:55, from gate 62. Check-in closes forty minutes before departure, and the \
    airline has already moved your seat to 14A by the window, as you asked last week. Nothing \
    else changed: the hotel in Sapporo still expects you on Thursday evening.";
const DESKTOP_ASK: &str = "Compare the two hotels:\n\n| Hotel | Price | Walk |\n|---|---|---|\n\
    | Keio Plaza | ¥21,000 | 4 min |\n| Hotel Gracery | ¥16,500 | 9 min |\n\n**Pick one** and \
    I will book it.";
const GPS_ASK: &str = r#"Where am I right now? [call gps {"accuracy":"fine"}]"#;
const AWAY_BOARDING: &str = "Boarding for Sapporo starts at 10:10 at gate 62.";
const LANDED: &str = "I landed in Sapporo. What now?";

/// What the phone's gps handler was asked and answered, reported to the story.
type ToolReport = (Value, Value);

/// The story's state, carried from step to step.
pub struct Story {
    out: Out,
    a: Client,
    b: Client,
    /// The session on gateway A.
    session: Option<SessionClient>,
    /// The phone's tools (the same handler at each of its attaches) and what they report.
    phone_tools: Tools,
    reports: mpsc::UnboundedReceiver<ToolReport>,
    /// The attached surfaces, kept here so that a failed step still detaches them.
    phone: Option<Surface>,
    watch: Option<Surface>,
    desktop: Option<Surface>,
    /// Turns tethered while no surface was attached, in order.
    tethered: Vec<Tethered>,
    /// The watch's rendering of the Markdown turn, for contrast with the desktop's.
    watch_markdown: Option<(u64, String)>,
    facts: Facts,
}

/// Numbers for the closing summary.
#[derive(Debug, Default)]
struct Facts {
    chunks: usize,
    drained: usize,
    cut: usize,
    messages_a: u64,
    sessions_b: usize,
    /// Turns tethered on A that arrived with the session on B.
    moved_turns: u64,
}

/// A turn tethered while no surface was attached, as the backend made it.
struct Tethered {
    /// A completion the model wrote (else a turn the backend pushed).
    completion: bool,
    /// The text as written: what the transcript must hold.
    original: String,
}

impl Tethered {
    fn what(&self) -> &'static str {
        if self.completion {
            "completion"
        } else {
            "pushed turn"
        }
    }
}

/// A turn that streamed to a surface, as the surface and the HTTP caller saw it.
struct LiveTurn {
    reply: ChatReply,
    chunks: usize,
    /// The chunks joined: what the surface received.
    received: String,
    seq: Option<u64>,
    tool_calls: Vec<(ToolCall, ToolReport)>,
}

impl Story {
    pub fn new(out: Out, a: Client, b: Client) -> Self {
        let (report, reports) = mpsc::unbounded_channel();
        let gps = ToolSpec::new("gps")
            .description("Where the phone is: latitude and longitude in degrees")
            .input_schema(json!({
                "type": "object",
                "properties": {"accuracy": {"type": "string", "enum": ["coarse", "fine"]}},
                "additionalProperties": false,
            }));
        let phone_tools = Tools::new().tool(gps, move |input: Value| {
            let report = report.clone();
            async move {
                let fine = input.get("accuracy").and_then(Value::as_str) == Some("fine");
                let result =
                    json!({"lat": LAT, "lon": LON, "accuracy_m": if fine { 8 } else { 500 }});
                // The story may have stopped listening (a failed step); the gateway still gets
                // its answer.
                let _ = report.send((input, result.clone()));
                Ok(result)
            }
        });
        Self {
            out,
            a,
            b,
            session: None,
            phone_tools,
            reports,
            phone: None,
            watch: None,
            desktop: None,
            tethered: Vec::new(),
            watch_markdown: None,
            facts: Facts::default(),
        }
    }

    pub fn out(&mut self) -> &mut Out {
        &mut self.out
    }

    /// Runs step `n` (1-based).
    pub async fn step(&mut self, n: usize, elapsed: Duration) -> anyhow::Result<()> {
        match n {
            1 => self.phone_asks().await,
            2 => self.phone_offline().await,
            3 => self.watch_drains().await,
            4 => self.desktop_markdown().await,
            5 => self.gps_call().await,
            6 => self.roam().await,
            7 => self.session_moves().await,
            8 => {
                self.summary(elapsed);
                Ok(())
            }
            _ => bail!("there is no step {n}"),
        }
    }

    /// Detaches every surface still attached (after a failed step), so the gateways stop cleanly.
    pub async fn close_surfaces(&mut self) {
        for surface in [&mut self.phone, &mut self.watch, &mut self.desktop] {
            if let Some(mut s) = surface.take() {
                // Best effort: a surface that does not confirm in time is dropped, which
                // detaches it.
                let _ = tokio::time::timeout(WAIT, s.close()).await;
            }
        }
    }

    fn session(&self) -> anyhow::Result<&SessionClient> {
        self.session.as_ref().context("no session yet")
    }

    async fn attach(&self, context: SurfaceContext, tools: bool) -> anyhow::Result<Surface> {
        let session = self.session()?;
        let mut config = session.surface().context(context).connect_timeout(WAIT);
        if tools {
            config = config.tools(self.phone_tools.clone());
        }
        let mut surface = Surface::connect(config).await.context("attaching")?;
        match next(&mut surface).await? {
            Event::Connected { .. } => Ok(surface),
            other => bail!("expected the attach first, got {other:?}"),
        }
    }

    async fn phone_asks(&mut self) -> anyhow::Result<()> {
        self.out.explain(
            "A phone (mobile, declaring a `gps` tool with a JSON schema) attaches to a new \
             session on gateway A and asks; the reply streams to it over the WebSocket.",
        );
        let session = self
            .a
            .create_session(NewSession::default())
            .await
            .context("creating a session on A")?;
        self.out.fact(&format!(
            "POST /v1/sessions on A: session {} (agent {})",
            short(session.id()),
            session.get().await?.agent_id.unwrap_or_default()
        ));
        self.session = Some(session);
        let surface = self.attach(mobile(), true).await?;
        let phone = self.phone.insert(surface);
        let att = phone.attached().clone();
        self.out.fact(&format!(
            "SESSION_ATTACHED: device {}, tools registered [{}], {} queued, extensions [{}]",
            att.device_type,
            att.mcp_tools_registered.join(", "),
            att.queued_turns,
            att.extensions.join(", ")
        ));
        ensure!(
            att.mcp_tools_registered == ["gps"],
            "the gateway registered {:?}, not the phone's gps",
            att.mcp_tools_registered
        );
        ensure!(
            att.queued_turns == 0,
            "a new session has {} turns queued",
            att.queued_turns
        );
        self.out.said("phone", Style::User, QUESTION);
        let session = self.session()?.clone();
        let phone = self.phone.as_mut().context("the phone is not attached")?;
        let turn = live_turn(&mut self.out, phone, &session, QUESTION, None).await?;
        ensure!(
            turn.received == turn.reply.text,
            "the phone received {:?}, the reply was {:?}",
            turn.received,
            turn.reply.text
        );
        self.facts.chunks += turn.chunks;
        self.out.fact(&format!(
            "turn complete: {} TURN_CHUNKs, tether seq {}, {} completion tokens, step {}, model {}",
            turn.chunks,
            opt(turn.seq),
            usage(&turn.reply, "completion_tokens"),
            turn.reply.meta.step_count,
            turn.reply.meta.model_routed_to.as_deref().unwrap_or("?")
        ));
        Ok(())
    }

    async fn phone_offline(&mut self) -> anyhow::Result<()> {
        self.out.explain(
            "The phone detaches. The agent's backend goes on: it pushes turns and runs a \
             completion while no surface is attached, and the gateway tethers each one.",
        );
        let mut phone = self.phone.take().context("the phone is not attached")?;
        phone.close().await;
        let session = self.session()?.clone();
        // The gateway closes the socket before it records the suspension: look until it has.
        let info = wait_for(|| async {
            let info = session.get().await.ok()?;
            (info.status == SessionStatus::Suspended).then_some(info)
        })
        .await
        .context("the session was not suspended after the phone's DETACH")?;
        self.out.fact(&format!(
            "the phone sent DETACH: session {}, surface attached: {}",
            info.status.as_str(),
            info.surface_attached
        ));
        let pushed = session.push_turn(PushTurn::assistant(AWAY_HOTELS)).await?;
        self.note_push("backend pushed a turn", &pushed)?;
        self.tethered.push(Tethered {
            completion: false,
            original: AWAY_HOTELS.to_owned(),
        });

        let reply = session.send_message(AWAY_PLAN).await?;
        self.out.fact(&format!(
            "backend ran a completion (resuming the suspended session): {} words in, {} \
             completion tokens out, nobody attached",
            AWAY_PLAN.split_whitespace().count(),
            usage(&reply, "completion_tokens")
        ));
        self.tethered.push(Tethered {
            completion: true,
            original: reply.text,
        });

        let pushed = session.push_turn(PushTurn::assistant(AWAY_FLIGHT)).await?;
        self.note_push("backend pushed another turn", &pushed)?;
        self.tethered.push(Tethered {
            completion: false,
            original: AWAY_FLIGHT.to_owned(),
        });

        let info = session.get().await?;
        self.out.fact(&format!(
            "GET /v1/sessions/{}: status {}, {} messages, {} turns tethered",
            short(session.id()),
            info.status.as_str(),
            info.message_count,
            info.tether_turns_pending
        ));
        ensure!(
            info.tether_turns_pending == self.tethered.len() as u64,
            "{} turns tethered, expected {}",
            info.tether_turns_pending,
            self.tethered.len()
        );
        ensure!(
            !info.surface_attached,
            "a surface is attached to the session"
        );
        Ok(())
    }

    fn note_push(
        &mut self,
        what: &str,
        pushed: &sbp_client::types::PushedTurn,
    ) -> anyhow::Result<()> {
        ensure!(
            pushed.delivery == Delivery::Tethered,
            "{what}: delivered {:?}, expected tethered",
            pushed.delivery
        );
        self.out
            .fact(&format!("{what}: seq {}, delivery tethered", pushed.seq));
        Ok(())
    }

    async fn watch_drains(&mut self) -> anyhow::Result<()> {
        self.out.explain(&format!(
            "A watch (iot, max_output_tokens {WATCH_TOKENS}) attaches: the queued turns arrive \
             as TETHER_TURNs, in order, each shortened to the watch's budget. The transcript \
             keeps the originals."
        ));
        let context = SurfaceContext {
            device_type: Some("iot".into()),
            max_output_tokens: Some(WATCH_TOKENS),
            ..SurfaceContext::default()
        };
        let surface = self.attach(context, false).await?;
        let watch = self.watch.insert(surface);
        let queued = watch.attached().queued_turns;
        self.out.fact(&format!(
            "SESSION_ATTACHED: device {}, {queued} queued",
            watch.attached().device_type
        ));
        // Checked before draining: a short queue would otherwise show up only as a drain that
        // waits for turns that never come.
        ensure!(
            queued == self.tethered.len() as u64,
            "{queued} turns queued, expected {}",
            self.tethered.len()
        );
        let drained = drain(watch, self.tethered.len()).await?;
        let seqs: Vec<u64> = drained.iter().map(|t| t.seq).collect();
        ensure!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "the TETHER_TURNs came out of order: seqs {}",
            join(&seqs)
        );
        // The transcript, read back: every tethered turn is stored as it was written, whatever
        // the watch was shown.
        let session = self.session()?.clone();
        let page = session
            .messages(None, Some(1000))
            .await
            .context("reading the transcript")?;
        let stored = stored_in_order(&page.messages, &self.tethered)?;
        for ((turn, tethered), stored) in drained.iter().zip(&self.tethered).zip(&stored) {
            let shown = turn.content.clone().unwrap_or_default();
            let what = match &turn.model_used {
                Some(model) => format!("completion by {model}"),
                None => "pushed turn".to_owned(),
            };
            ensure!(
                turn.role == "assistant" && turn.model_used.is_some() == tethered.completion,
                "seq {} is a {} {what}, but a {} was tethered there",
                turn.seq,
                turn.role,
                tethered.what()
            );
            // The drain's order is the tether's: each turn opens as the one tethered in its place
            // (compared by its first words, since the watch's rendering rewrites Markdown).
            ensure!(
                opening(&shown) == opening(&tethered.original),
                "seq {} shows {shown:?}, which does not open like the {} tethered there ({:?})",
                turn.seq,
                tethered.what(),
                tethered.original
            );
            let tokens = u64::from(estimate_tokens(&shown));
            let cut = shown.ends_with('…');
            self.out.fact(&format!(
                "TETHER_TURN seq {}: {what}, {} tokens stored → {tokens} on the watch{}",
                turn.seq,
                estimate_tokens(stored),
                if cut { " (cut)" } else { "" }
            ));
            self.out.quote(Style::Agent, &shown);
            ensure!(
                tokens <= WATCH_TOKENS,
                "seq {} reached the watch with {tokens} tokens, over its budget of {WATCH_TOKENS}",
                turn.seq
            );
            if let Some(syntax) = markdown_syntax(&shown) {
                bail!(
                    "seq {} reached the watch with Markdown ({syntax}): {shown:?}",
                    turn.seq
                );
            }
            if markdown_syntax(stored).is_some() {
                self.watch_markdown = Some((turn.seq, shown.clone()));
            }
            self.facts.cut += usize::from(cut);
        }
        self.out.fact(&format!(
            "GET /v1/sessions/{}/messages: the transcript holds all {} originals verbatim",
            short(session.id()),
            stored.len()
        ));
        self.facts.drained = drained.len();
        ensure!(self.facts.cut > 0, "no rendering was cut to the budget");
        ensure!(
            self.watch_markdown.is_some(),
            "no tethered turn was Markdown"
        );
        // The SDK acknowledges each turn once the application has taken it; the gateway drops
        // acknowledged turns from the tether.
        let pending = wait_for(|| async {
            let info = session.get().await.ok()?;
            (info.tether_turns_pending == 0).then_some(0u64)
        })
        .await
        .context("the watch's ACKs did not empty the tether")?;
        self.out.fact(&format!(
            "the watch ACKed seq {}: {pending} turns left in the tether",
            join(&seqs)
        ));
        Ok(())
    }

    async fn desktop_markdown(&mut self) -> anyhow::Result<()> {
        self.out.explain(
            "A desktop attaches. One surface per session: the watch is displaced. A desktop \
             renders Markdown, so its reply arrives byte for byte as the model wrote it.",
        );
        let context = SurfaceContext {
            device_type: Some("desktop".into()),
            ..SurfaceContext::default()
        };
        let surface = self.attach(context, false).await?;
        self.desktop = Some(surface);
        let mut watch = self.watch.take().context("the watch is not attached")?;
        let code = displaced(&mut watch).await?;
        self.out.fact(&format!(
            "the watch's socket was closed with code {code} (displaced)"
        ));
        ensure!(code == 4409, "the watch was closed with {code}, not 4409");
        let desktop = self
            .desktop
            .as_mut()
            .context("the desktop is not attached")?;
        let queued = desktop.attached().queued_turns;
        self.out.fact(&format!(
            "SESSION_ATTACHED: device {}, {queued} queued",
            desktop.attached().device_type
        ));
        ensure!(queued == 0, "{queued} turns queued after the watch's drain");
        self.out.said("desktop", Style::User, DESKTOP_ASK);
        let session = self.session.clone().context("no session yet")?;
        let turn = live_turn(&mut self.out, desktop, &session, DESKTOP_ASK, None).await?;
        self.facts.chunks += turn.chunks;
        ensure!(
            turn.received == turn.reply.text,
            "the desktop received {:?}, the HTTP reply was {:?}",
            turn.received,
            turn.reply.text
        );
        let page = session
            .messages(None, Some(1000))
            .await
            .context("reading the transcript")?;
        let stored = page
            .messages
            .last()
            .filter(|m| m.role == "assistant")
            .and_then(StoredMessage::text)
            .context("the transcript does not end with the desktop's reply")?;
        ensure!(
            turn.received == stored,
            "the desktop received {:?}, the stored reply is {stored:?}",
            turn.received
        );
        let missing: Vec<&str> = [
            ("**", "bold"),
            ("\n| ", "table rows"),
            ("|---", "table rule"),
        ]
        .into_iter()
        .filter(|(m, _)| !turn.received.contains(m))
        .map(|(_, what)| what)
        .collect();
        ensure!(
            missing.is_empty(),
            "Markdown lost ({}): {:?}",
            missing.join(", "),
            turn.received
        );
        self.out.good(&format!(
            "desktop got Markdown untouched: {} TURN_CHUNKs, {} bytes, identical to the stored \
             reply (bold and table intact)",
            turn.chunks,
            turn.received.len(),
        ));
        if let Some((seq, shown)) = &self.watch_markdown {
            self.out.fact(&format!(
                "for contrast, the watch got the Markdown plan (seq {seq}) as plain text:"
            ));
            self.out.quote(Style::Agent, shown);
        }
        let mut desktop = self.desktop.take().context("the desktop is not attached")?;
        desktop.close().await;
        Ok(())
    }

    async fn gps_call(&mut self) -> anyhow::Result<()> {
        self.out.explain(
            "The phone re-attaches with its gps tool. The model asks for `surface_gps` (sbp/echo \
             calls a tool named as [call gps] in the message); the gateway sends the phone a \
             TOOL_CALL, its handler answers, and the result goes back to the model.",
        );
        let surface = self.attach(mobile(), true).await?;
        let phone = self.phone.insert(surface);
        let att = phone.attached().clone();
        self.out.fact(&format!(
            "SESSION_ATTACHED: device {}, tools registered [{}], {} queued",
            att.device_type,
            att.mcp_tools_registered.join(", "),
            att.queued_turns
        ));
        ensure!(
            att.mcp_tools_registered == ["gps"] && att.queued_turns == 0,
            "the phone re-attached with tools {:?} and {} turns queued",
            att.mcp_tools_registered,
            att.queued_turns
        );
        self.out.said("phone", Style::User, GPS_ASK);
        let session = self.session.clone().context("no session yet")?;
        let phone = self.phone.as_mut().context("the phone is not attached")?;
        let turn = live_turn(
            &mut self.out,
            phone,
            &session,
            GPS_ASK,
            Some(&mut self.reports),
        )
        .await?;
        self.facts.chunks += turn.chunks;
        let [(call, (input, result))] = turn.tool_calls.as_slice() else {
            bail!("expected one TOOL_CALL, got {}", turn.tool_calls.len());
        };
        ensure!(
            call.tool_name == "gps",
            "the call was for {}",
            call.tool_name
        );
        ensure!(
            *input == json!({"accuracy": "fine"}),
            "the handler got {input}"
        );
        for coordinate in [LAT.to_string(), LON.to_string()] {
            ensure!(
                turn.reply.text.contains(&coordinate),
                "the final reply does not mention {coordinate}: {}",
                turn.reply.text
            );
        }
        self.out.good(&format!(
            "the final reply carries the phone's coordinates {LAT}, {LON} (from {result})"
        ));
        // The transcript holds the tool round between the question and the answer.
        let page = session.messages(None, Some(1000)).await?;
        let tail: Vec<String> = page
            .messages
            .iter()
            .rev()
            .take(4)
            .rev()
            .map(
                |m| match m.extra.get("tool_calls").and_then(Value::as_array) {
                    Some(calls) => format!(
                        "assistant (tool_calls {})",
                        calls
                            .iter()
                            .filter_map(|c| c.pointer("/function/name").and_then(Value::as_str))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    None => m.role.clone(),
                },
            )
            .collect();
        self.out.fact(&format!(
            "turn complete: tether seq {}; the transcript ends … {}",
            opt(turn.seq),
            tail.join(" → ")
        ));
        ensure!(
            tail == [
                "user",
                "assistant (tool_calls surface_gps)",
                "tool",
                "assistant"
            ],
            "the transcript does not end with the tool round"
        );
        let mut phone = self.phone.take().context("the phone is not attached")?;
        phone.close().await;
        Ok(())
    }

    async fn roam(&mut self) -> anyhow::Result<()> {
        self.out.explain(
            "Export the session on A (a bundle sealed by its CID, and a signed roaming token), \
             import it into gateway B (which redeems the token at A, the gateway that signed it, \
             and fetches the bundle from A by its CID), fork it there, hand it off to another \
             agent, and read its lineage.",
        );
        let session = self.session()?.clone();
        let on_a = session.get().await?;
        self.facts.messages_a = on_a.message_count;
        let export = session
            .export(ExportRequest {
                ttl_seconds: Some(3600),
                label: Some("continue on gateway B".into()),
                include_bundle: true,
            })
            .await
            .context("exporting on A")?;
        let exported = export.message_count.unwrap_or_default();
        self.out.fact(&format!(
            "export on A: {exported} messages exported, bundle CID {}",
            export.bundle_cid
        ));
        let alg = token_alg(&export.roaming_token)?;
        self.out.fact(&format!(
            "roaming token {}… ({} characters, {alg}, expires {})",
            export.roaming_token.chars().take(24).collect::<String>(),
            export.roaming_token.len(),
            export.expires_at.as_deref().unwrap_or("?")
        ));
        ensure!(
            exported == on_a.message_count,
            "the export holds {exported} messages, the session {}",
            on_a.message_count
        );
        let bundle = export
            .bundle
            .clone()
            .context("the export response has no bundle")?;
        let request = ImportRequest {
            roaming_token: Some(export.roaming_token.clone()),
            bundle: Some(bundle),
            ..ImportRequest::default()
        };
        let imported = self
            .b
            .import(request.clone())
            .await
            .context("importing into B")?;
        let on_b = imported.session.get().await?;
        self.out.fact(&format!(
            "import on B: new session {}, {} messages restored (of {exported} exported), {} on \
             B with its provenance note",
            short(&imported.info.session_id),
            imported.info.messages_restored,
            on_b.message_count
        ));
        ensure!(
            imported.info.messages_restored == exported,
            "B restored {} messages of {exported}",
            imported.info.messages_restored
        );
        // The one message more on B is the gateway's note of where the history came from.
        let page = imported
            .session
            .messages(None, Some(1000))
            .await
            .context("reading the transcript on B")?;
        let note = page
            .messages
            .last()
            .filter(|m| m.role == "system")
            .and_then(StoredMessage::text)
            .unwrap_or_default();
        ensure!(
            on_b.message_count == exported + 1
                && page.messages.len() as u64 == on_b.message_count
                && note.contains(&format!("imported from {}", session.id())),
            "B holds {} messages ({} listed), expected the {exported} restored and a note naming \
             the source; the last is {note:?}",
            on_b.message_count,
            page.messages.len()
        );
        match self.b.import(request).await {
            Err(e) if e.status() == Some(410) => self.out.fact(&format!(
                "the same token again on B: {} {} (single use)",
                410,
                e.code().unwrap_or("?")
            )),
            Err(e) => bail!("a second import failed the wrong way: {e}"),
            Ok(again) => bail!(
                "a second import of one token succeeded ({})",
                again.info.session_id
            ),
        }
        let b_session = imported.session;
        let fork = b_session
            .fork(Some("plan B"))
            .await
            .context("forking on B")?;
        self.out.fact(&format!(
            "fork on B: session {} \"plan B\", at message {}",
            short(&fork.info.session_id),
            opt(fork.info.fork_point_msg)
        ));
        let handoff = b_session
            .handoff(HandoffRequest {
                to_agent_id: "booking-agent".into(),
                handoff_message: Some("Please book the Keio Plaza for three nights.".into()),
                reason: Some("booking".into()),
            })
            .await
            .context("handing off on B")?;
        self.out.fact(&format!(
            "handoff on B to booking-agent: session {}, the imported session is now {}",
            short(&handoff.info.session_id),
            handoff.info.source_status.map_or("?", |s| s.as_str())
        ));
        let lineage = b_session.lineage().await.context("reading the lineage")?;
        self.facts.sessions_b = 1 + lineage.forks.len() + lineage.outgoing_handoffs.len();
        self.out.fact(&format!(
            "GET /v1/sbp/sessions/{}/lineage on B:",
            short(b_session.id())
        ));
        let tree = lineage_tree(&lineage);
        for line in &tree {
            self.out.line(&format!("    {line}"));
        }
        ensure!(
            lineage
                .forks
                .iter()
                .any(|f| f.fork_session_id == fork.info.session_id),
            "the lineage does not list the fork"
        );
        ensure!(
            lineage
                .outgoing_handoffs
                .iter()
                .any(|h| h.to_session_id.as_deref() == Some(handoff.info.session_id.as_str())),
            "the lineage does not list the handoff"
        );
        ensure!(
            lineage
                .imported_from
                .as_ref()
                .and_then(|i| i.source_session_id.as_deref())
                == Some(session.id()),
            "the lineage does not name the session on A as the source"
        );
        Ok(())
    }

    async fn session_moves(&mut self) -> anyhow::Result<()> {
        self.out.explain(
            "The phone travels and attaches to gateway B with the session's id and token. B does \
             not hold the session, so before answering it asks its peers: A hands it over (a \
             lease, a signed envelope, the bundle by its CID), B adopts it under the same id and \
             token with its tether, and A answers for it from then on only with where it went.",
        );
        let session = self.session()?.clone();
        let a_url = shown_url(self.a.base_url());
        let b_url = shown_url(self.b.base_url());
        // A turn for the phone while it is in the air, tethered on A.
        let pushed = session
            .push_turn(PushTurn::assistant(AWAY_BOARDING))
            .await
            .context("pushing a turn on A")?;
        self.note_push("backend pushed a turn on A", &pushed)?;

        let config = SurfaceConfig::new(&b_url, session.id(), session.token())
            .context(mobile())
            .tools(self.phone_tools.clone())
            .connect_timeout(WAIT);
        let surface = Surface::connect(config)
            .await
            .context("attaching the phone to B")?;
        let phone = self.phone.insert(surface);
        let att = phone.attached().clone();
        self.out.fact(&format!(
            "SESSION_ATTACHED from gateway B: session {}, sbp_level {}, {} queued",
            short(&att.session_id),
            att.sbp_level,
            att.queued_turns
        ));
        ensure!(
            att.session_id == session.id(),
            "B attached session {}, not {}",
            att.session_id,
            session.id()
        );
        ensure!(att.sbp_level == "L6", "B says sbp_level {}", att.sbp_level);
        ensure!(
            att.queued_turns == 1,
            "{} turns queued on B, expected the 1 tethered on A",
            att.queued_turns
        );
        let drained = drain(phone, 1).await?;
        let turn = drained.first().context("no TETHER_TURN")?;
        let shown = turn.content.clone().unwrap_or_default();
        self.out.fact(&format!(
            "TETHER_TURN seq {} on B: the turn tethered on A (seq {}), carried with the session",
            turn.seq, pushed.seq
        ));
        self.out.quote(Style::Agent, &shown);
        ensure!(
            turn.seq == pushed.seq && shown == AWAY_BOARDING,
            "B drained seq {} {shown:?}, A tethered seq {} {AWAY_BOARDING:?}",
            turn.seq,
            pushed.seq
        );
        self.facts.moved_turns = att.queued_turns;

        // A no longer answers for the session: it says where it went.
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(WAIT)
            .build()
            .context("building the HTTP client")?;
        let answer = http
            .post(format!("{a_url}/v1/sbp/sessions/{}/turns", session.id()))
            .header("x-session-token", session.token())
            .json(&json!({"content": "still there, A?"}))
            .send()
            .await
            .context("asking A")?;
        let status = answer.status().as_u16();
        let body: Value = answer.json().await.context("A's answer")?;
        let code = body.pointer("/error/code").and_then(Value::as_str);
        let to = body
            .pointer("/error/detail/gateway_url")
            .and_then(Value::as_str)
            .map(|u| u.trim_end_matches('/').to_owned());
        self.out.fact(&format!(
            "POST /v1/sbp/sessions/{}/turns on A: {status} {} → gateway_url {}",
            short(session.id()),
            code.unwrap_or("?"),
            to.as_deref().unwrap_or("?")
        ));
        ensure!(
            status == 409 && code == Some("SBP_SESSION_MOVED") && to.as_deref() == Some(&b_url),
            "A answered {status} {body}, expected 409 SBP_SESSION_MOVED naming {b_url}"
        );

        // The SDK's session client was made for A: it follows the move and sends again to B.
        self.out.said("phone", Style::User, LANDED);
        let phone = self.phone.as_mut().context("the phone is not attached")?;
        let turn = live_turn(&mut self.out, phone, &session, LANDED, None).await?;
        self.facts.chunks += turn.chunks;
        let now_at = shown_url(&session.base_url());
        self.out.fact(&format!(
            "the SDK followed SBP_SESSION_MOVED: the session client now calls {now_at}; the reply \
             streamed to the phone on B ({} TURN_CHUNKs)",
            turn.chunks
        ));
        ensure!(now_at == b_url, "the session client calls {now_at}, not B");
        ensure!(
            turn.received == turn.reply.text,
            "the phone received {:?}, the reply was {:?}",
            turn.received,
            turn.reply.text
        );
        let lineage = session
            .lineage()
            .await
            .context("reading the lineage on B")?;
        let moves = lineage
            .extra
            .get("migrations")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let from_a = moves.iter().find(|m| m["kind"] == "migrated_from");
        self.out.fact(&format!(
            "GET /v1/sbp/sessions/{}/lineage on B: migrated_from gateway {}",
            short(session.id()),
            from_a.and_then(|m| m["gateway_id"].as_str()).unwrap_or("?")
        ));
        ensure!(
            from_a.is_some(),
            "B's lineage has no migrated_from: {moves:?}"
        );
        let mut phone = self.phone.take().context("the phone is not attached")?;
        phone.close().await;
        Ok(())
    }

    fn summary(&mut self, elapsed: Duration) {
        self.out
            .explain("The protocol's levels, each seen on the wire above:");
        let f = &self.facts;
        let lines = [
            format!(
                "L1 durable sessions: {} messages on A, each stored in SQLite before it was \
                 acknowledged",
                f.messages_a
            ),
            format!(
                "L2 tether: {} turns queued while no surface was attached, drained in order to the \
                 next one and acknowledged; {} live TURN_CHUNKs",
                f.drained, f.chunks
            ),
            format!(
                "L3 roaming: exported on A, imported on B (token single use), forked and handed \
                 off there: {} sessions on B, one lineage",
                f.sessions_b
            ),
            format!(
                "L4 surfaces: the same stored replies as ≤ {WATCH_TOKENS}-token plain text on a \
                 watch ({} cut with …) and as untouched Markdown on a desktop",
                f.cut
            ),
            "L5 tools: the model called the phone's gps with TOOL_CALL, the phone answered with \
             TOOL_RESULT"
                .to_owned(),
            format!(
                "L6 federation: the phone attached to B with the same id and token and the session \
                 moved from A with its {} tethered turn(s); A answers 409 SBP_SESSION_MOVED naming \
                 B, and the SDK followed it",
                f.moved_turns
            ),
        ];
        for line in lines {
            self.out.fact(&line);
        }
        self.out
            .good(&format!("story told in {:.1} s", elapsed.as_secs_f64()));
    }
}

/// A base URL as printed: without the slash the URL type adds to an empty path.
fn shown_url(url: &reqwest::Url) -> String {
    url.as_str().trim_end_matches('/').to_owned()
}

/// A mobile surface's context (its tools come from the handler).
fn mobile() -> SurfaceContext {
    SurfaceContext {
        device_type: Some("mobile".into()),
        ..SurfaceContext::default()
    }
}

/// The next event, within [`WAIT`].
async fn next(surface: &mut Surface) -> anyhow::Result<Event> {
    match tokio::time::timeout(WAIT, surface.next_event()).await {
        Ok(Some(e)) => Ok(e),
        Ok(None) => bail!("the surface's connection ended"),
        Err(_) => bail!("nothing arrived on the surface within {WAIT:?}"),
    }
}

/// The first `n` TETHER_TURNs.
async fn drain(
    surface: &mut Surface,
    n: usize,
) -> anyhow::Result<Vec<sbp_client::protocol::frames::TetherTurn>> {
    let mut turns = Vec::with_capacity(n);
    while turns.len() < n {
        match next(surface).await? {
            Event::Frame(ServerFrame::TetherTurn(t)) => turns.push(t),
            Event::Disconnected(d) => bail!("disconnected during the drain: {}", d.reason),
            _ => {}
        }
    }
    Ok(turns)
}

/// Waits for the surface to be closed by the gateway; returns the close code.
async fn displaced(surface: &mut Surface) -> anyhow::Result<u16> {
    loop {
        if let Event::Disconnected(d) = next(surface).await? {
            ensure!(
                d.kind == DisconnectKind::Displaced && !d.will_reconnect,
                "the connection ended as {:?} ({})",
                d.kind,
                d.reason
            );
            return d.effective_code().context("no close code");
        }
    }
}

/// Sends `text` over HTTP while reading the surface's frames until the turn's TURN_COMPLETE,
/// printing the reply as it streams. TOOL_CALLs (answered by the surface's handler) are printed
/// with the handler's answer, read from `reports`.
async fn live_turn(
    out: &mut Out,
    surface: &mut Surface,
    session: &SessionClient,
    text: &str,
    mut reports: Option<&mut mpsc::UnboundedReceiver<ToolReport>>,
) -> anyhow::Result<LiveTurn> {
    let http = session.send_message(text);
    tokio::pin!(http);
    let deadline = Instant::now() + WAIT;
    let mut reply = None;
    let mut complete = None;
    let mut received = String::new();
    let mut chunks = 0;
    let mut tool_calls = Vec::new();
    while reply.is_none() || complete.is_none() {
        tokio::select! {
            r = &mut http, if reply.is_none() => {
                reply = Some(r.context("the completion request")?);
            }
            event = surface.next_event(), if complete.is_none() => match event {
                Some(Event::Frame(ServerFrame::TurnChunk(c))) => {
                    if chunks == 0 {
                        out.stream_start("agent");
                    }
                    out.stream(&c.delta);
                    received.push_str(&c.delta);
                    chunks += 1;
                }
                Some(Event::Frame(ServerFrame::TurnComplete(c))) => {
                    out.stream_end();
                    complete = Some(c);
                }
                Some(Event::Frame(ServerFrame::ToolCall(call))) => {
                    out.tool(&format!(
                        "TOOL_CALL → phone: {} {} (call_id {}, timeout {} ms)",
                        call.tool_name,
                        call.tool_input,
                        short(&call.call_id),
                        opt(call.timeout_ms)
                    ));
                    let reports = reports.as_deref_mut().context("a TOOL_CALL nobody expected")?;
                    let report = tokio::time::timeout(WAIT, reports.recv())
                        .await
                        .ok()
                        .flatten()
                        .context("the tool handler did not report")?;
                    out.tool(&format!("TOOL_RESULT ← phone: {}", report.1));
                    tool_calls.push((call, report));
                }
                Some(Event::Disconnected(d)) => {
                    bail!("the surface was disconnected mid-turn: {}", d.reason)
                }
                Some(_) => {}
                None => bail!("the surface ended mid-turn"),
            },
            () = tokio::time::sleep_until(deadline) => {
                bail!("the turn did not complete within {WAIT:?}")
            }
        }
    }
    let (Some(reply), Some(complete)) = (reply, complete) else {
        bail!("the turn ended without its reply");
    };
    Ok(LiveTurn {
        reply,
        chunks,
        received,
        seq: complete.seq,
        tool_calls,
    })
}

/// Polls `check` until it answers, for at most [`WAIT`]: the gateway applies ACKs without telling
/// the sender, so the demo looks.
async fn wait_for<T, F, Fut>(mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            bail!("not within {WAIT:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The lineage as a small tree: where the session came from, then what came of it.
fn lineage_tree(l: &Lineage) -> Vec<String> {
    let mut lines = Vec::new();
    let field = |v: &Option<String>| v.as_deref().unwrap_or("?").to_owned();
    let indent = match &l.imported_from {
        Some(from) => {
            lines.push(format!(
                "session {} on gateway A",
                short(&field(&from.source_session_id))
            ));
            lines.push(format!(
                "└─ imported (export {}) as session {} on gateway B",
                short(&field(&from.export_id)),
                short(&l.session_id)
            ));
            "   "
        }
        None => {
            lines.push(format!("session {}", short(&l.session_id)));
            ""
        }
    };
    let mut children: Vec<String> = l
        .forks
        .iter()
        .map(|f| {
            format!(
                "fork \"{}\" → session {} (via {})",
                f.fork_label.as_deref().unwrap_or(""),
                short(&f.fork_session_id),
                f.via.as_deref().unwrap_or("fork")
            )
        })
        .collect();
    children.extend(l.outgoing_handoffs.iter().map(|h| {
        format!(
            "handoff → {} → session {}",
            field(&h.to_agent_id),
            short(&field(&h.to_session_id))
        )
    }));
    let count = children.len();
    for (i, child) in children.into_iter().enumerate() {
        let branch = if i + 1 == count { "└─" } else { "├─" };
        lines.push(format!("{indent}{branch} {child}"));
    }
    lines
}

/// A UUID's short form: its last 8 hex digits. UUIDv7 ids begin with their timestamp, so ids
/// made in the same minute share their first digits and differ at the end.
fn short(id: &str) -> String {
    let hex: String = id.chars().filter(char::is_ascii_hexdigit).collect();
    match hex.len() {
        0..=8 => id.to_owned(),
        n => format!("…{}", &hex[n - 8..]),
    }
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

fn join(seqs: &[u64]) -> String {
    seqs.iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn usage(reply: &ChatReply, key: &str) -> u64 {
    reply
        .body
        .pointer(&format!("/usage/{key}"))
        .and_then(Value::as_u64)
        .unwrap_or_default()
}

/// The stored texts of the tethered turns, found in the transcript in the order they were
/// tethered, each identical to its original.
fn stored_in_order<'a>(
    transcript: &'a [StoredMessage],
    tethered: &[Tethered],
) -> anyhow::Result<Vec<&'a str>> {
    let mut rest = transcript.iter();
    tethered
        .iter()
        .map(|t| {
            rest.find(|m| m.role == "assistant" && m.text() == Some(t.original.as_str()))
                .and_then(StoredMessage::text)
                .with_context(|| {
                    format!(
                        "the transcript does not hold the {} {:?} verbatim, in its place",
                        t.what(),
                        t.original
                    )
                })
        })
        .collect()
}

/// The first three words of `text` without Markdown's markers (emphasis, headings, quotes,
/// bullets), lowercased: what an adapted rendering and its original have in common.
fn opening(text: &str) -> Vec<String> {
    text.split_whitespace()
        .map(|w| {
            w.trim_matches(|c: char| "*_#>|`~-•+".contains(c))
                .to_lowercase()
        })
        .filter(|w| !w.is_empty())
        .take(3)
        .collect()
}

/// The first piece of Markdown syntax in `text`, if any: bold, a table row, a heading.
fn markdown_syntax(text: &str) -> Option<&'static str> {
    if text.contains("**") {
        return Some("bold");
    }
    text.lines().map(str::trim_start).find_map(|line| {
        if line.starts_with('|') {
            Some("a table row")
        } else if line.starts_with('#') {
            Some("a heading")
        } else {
            None
        }
    })
}

/// The signing algorithm a JWT names in its header (`alg` of the base64url JSON before the first
/// dot).
fn token_alg(token: &str) -> anyhow::Result<String> {
    let header = token.split('.').next().unwrap_or_default();
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(header.trim_end_matches('='))
        .context("the roaming token's header is not base64url")?;
    let header: Value =
        serde_json::from_slice(&bytes).context("the roaming token's header is not JSON")?;
    header
        .get("alg")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .context("the roaming token's header names no alg")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openings_ignore_markdown_markers() {
        let original = "Echo: Today's plan:\n\n- **09:00** Tsukiji";
        let shown = "Echo: Today's plan:\n\n• 09:00 Tsukiji";
        assert_eq!(opening(original), ["echo:", "today's", "plan:"]);
        assert_eq!(opening(original), opening(shown));
        assert_eq!(opening("# **Day one** is here"), ["day", "one", "is"]);
        assert_ne!(opening("Flight update: your"), opening("While you were"));
    }

    #[test]
    fn markdown_syntax_is_found_in_any_line() {
        assert_eq!(markdown_syntax("plain\n• a bullet"), None);
        assert_eq!(markdown_syntax("a **bold** word"), Some("bold"));
        assert_eq!(markdown_syntax("x\n  | a | b |"), Some("a table row"));
        assert_eq!(markdown_syntax("x\n## Title"), Some("a heading"));
        assert_eq!(markdown_syntax("gate 62 | seat 14A"), None);
    }

    #[test]
    fn the_token_header_names_its_alg() {
        // {"alg":"HS256","typ":"JWT"}
        let token = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.e30.sig";
        assert_eq!(token_alg(token).expect("alg"), "HS256");
        assert!(token_alg("not a token").is_err());
    }

    #[test]
    fn stored_turns_are_found_in_order_and_verbatim() {
        let msg = |role: &str, text: &str| -> StoredMessage {
            serde_json::from_value(json!({"role": role, "content": text})).expect("message")
        };
        let transcript = [
            msg("user", "q"),
            msg("assistant", "one"),
            msg("user", "plan"),
            msg("assistant", "two"),
        ];
        let t = |text: &str| Tethered {
            completion: false,
            original: text.to_owned(),
        };
        assert_eq!(
            stored_in_order(&transcript, &[t("one"), t("two")]).expect("found"),
            ["one", "two"]
        );
        assert!(stored_in_order(&transcript, &[t("two"), t("one")]).is_err());
        assert!(stored_in_order(&transcript, &[t("one"), t("tw")]).is_err());
    }

    #[test]
    fn short_ids_are_the_tail() {
        assert_eq!(short("0192f0a1-7c3e-7d11-8a2b-9c2e41d03f5a"), "…41d03f5a");
        assert_eq!(short("abc"), "abc");
    }
}
