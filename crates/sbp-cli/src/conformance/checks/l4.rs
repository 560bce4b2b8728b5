//! L4, surfaces: the SurfaceContext is accepted in full, under `surface` too, as null or empty,
//! with unknown fields and values; and the declared budget reaches the output (the seeds require
//! `device_type` and `max_output_tokens` to be passed to output generation: an iot surface with a
//! small budget must get a shorter rendering of a long reply than a desktop; when the model's reply
//! is too short to need a budget, nothing can be verified and the check is skipped). Surfaces that
//! read live turns declare `streaming`: the seeds let a gateway send others a complete turn.

use std::sync::Arc;

use serde_json::{Value, json};

use super::nonce;
use crate::conformance::client::{Ctx, attach};
use crate::conformance::outcome::{Outcome, Problem, ensure, pass, pass_with, short, skip};

/// The iot surface's budget, in tokens (a word is at least one).
const BUDGET: usize = 12;

pub async fn surface_context_accepted(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: a phone").await?;
    let surface_id = format!("conformance-device-{}", nonce());
    let surface = json!({
        "device_type": "mobile",
        "max_output_tokens": 300,
        "ui_capabilities": ["markdown", "streaming"],
        "locale": "en-US",
        "surface_id": surface_id,
        "mcp_tools": ["camera"],
    });
    let (ws, attached) = attach(&ctx, &s, json!({"surface_context": surface})).await?;
    ensure(attached["device_type"] == "mobile", || {
        format!(
            "SESSION_ATTACHED.device_type is {}, expected \"mobile\"",
            attached["device_type"]
        )
    })?;
    if let Some(id) = attached.get("surface_id").filter(|v| !v.is_null()) {
        ensure(*id == surface_id.as_str(), || {
            format!("SESSION_ATTACHED.surface_id is {id}, expected \"{surface_id}\"")
        })?;
    }
    ws.detach().await?;
    pass()
}

pub async fn surface_field_alias(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: a watch").await?;
    let (ws, attached) = attach(&ctx, &s, json!({"surface": {"device_type": "iot"}})).await?;
    ensure(attached["device_type"] == "iot", || {
        format!(
            "with the context under `surface`, SESSION_ATTACHED.device_type is {}, expected \"iot\"",
            attached["device_type"]
        )
    })?;
    ws.detach().await?;
    pass()
}

pub async fn surface_null(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: an unknown device").await?;
    for extra in [
        json!({"surface": null}),
        json!({"surface_context": null}),
        json!({"surface_context": {}}),
    ] {
        let (ws, attached) = attach(&ctx, &s, extra.clone()).await?;
        let device = &attached["device_type"];
        ensure(device.is_null() || *device == "unknown", || {
            format!("with {extra}, SESSION_ATTACHED.device_type is {device}, expected \"unknown\"")
        })?;
        ws.detach().await?;
    }
    pass()
}

pub async fn unknown_fields_tolerated(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: from the future").await?;
    let surface = json!({
        "device_type": "hologram-9000",
        "ui_capabilities": ["telepathy", "streaming"],
        "max_output_tokens": null,
        "conformance_future_field": {"nested": [1, 2, 3]},
    });
    let (mut ws, _) = attach(&ctx, &s, json!({"surface_context": surface})).await?;
    // Tolerated means working: the next turn still reaches this surface.
    let resp = ctx
        .chat(Some(&s.token), "conformance: can you hear me?", Value::Null)
        .await?;
    resp.expect(&[200])?;
    ws.live_turn().await?;
    pass()
}

/// A long plain-text request: any model that repeats or answers it at length exceeds a small
/// budget.
fn long_prompt() -> String {
    let sentence = "The quick brown fox jumps over the lazy dog near the quiet river bank.";
    format!(
        "conformance {}: {}",
        nonce(),
        std::iter::repeat_n(sentence, 8)
            .collect::<Vec<_>>()
            .join(" ")
    )
}

/// What a surface declaring `surface` receives for one long turn.
async fn rendering(ctx: &Ctx, surface: Value, prompt: &str) -> Result<String, Problem> {
    let (s, _) = ctx.new_session("conformance: rendering").await?;
    let (mut ws, _) = attach(ctx, &s, json!({"surface_context": surface})).await?;
    let resp = ctx.chat(Some(&s.token), prompt, Value::Null).await?;
    resp.expect(&[200])?;
    let (text, _) = ws.live_turn().await?;
    ws.detach().await?;
    Ok(text)
}

fn words(text: &str) -> usize {
    text.split_whitespace().count()
}

pub async fn iot_budget_shorter(ctx: Arc<Ctx>) -> Outcome {
    let prompt = long_prompt();
    let desktop = rendering(
        &ctx,
        json!({"device_type": "desktop", "ui_capabilities": ["markdown", "tables", "streaming"]}),
        &prompt,
    )
    .await?;
    let watch = rendering(
        &ctx,
        json!({"device_type": "iot", "max_output_tokens": BUDGET,
               "ui_capabilities": ["streaming"]}),
        &prompt,
    )
    .await?;
    budget_shows(&desktop, &watch)
}

/// Compares the two renderings of one reply: the budget shows only in a reply longer than it.
fn budget_shows(desktop: &str, watch: &str) -> Outcome {
    let (d, w) = (words(desktop), words(watch));
    if d <= BUDGET {
        return Err(skip(format!(
            "the model's reply was only {d} words, within the budget of {BUDGET}: nothing to adapt, nothing verified"
        )));
    }
    ensure(w < d && w > 0, || {
        format!(
            "the iot surface (max_output_tokens {BUDGET}) got {w} words ('{}'), the desktop {d}: expected a shorter, non-empty rendering",
            short(watch, 60)
        )
    })?;
    pass_with(format!("iot {w} words, desktop {d}"))
}

#[cfg(test)]
mod tests {
    use super::budget_shows;
    use crate::conformance::outcome::Status;

    #[test]
    fn the_budget_must_shorten_a_long_reply() {
        let long = "word ".repeat(40);
        assert!(budget_shows(&long, "word word word").is_ok());
        let same = budget_shows(&long, &long).expect_err("refused");
        assert_eq!(same.status, Status::Fail);
        assert!(
            same.reason.contains("expected a shorter"),
            "{}",
            same.reason
        );
        let empty = budget_shows(&long, "").expect_err("refused");
        assert_eq!(empty.status, Status::Fail);
        let short = budget_shows("a short reply", "a short reply").expect_err("refused");
        assert_eq!(short.status, Status::Skip);
    }
}
