//! Encryption at rest from the command line: `sbp encryption-key generate` makes a key file, and
//! `sbp store reseal` rewrites every sealed value under the current key so an earlier key can be
//! retired.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use sbp_store::postgres::{PostgresOptions, PostgresStore, redacted_url};
use sbp_store::redis_tether::{RedisTetherOptions, TetheredStore, redacted_redis_url};
use sbp_store::seal::{Forget, Kept, Key, Resealed, Sealer};
use sbp_store::sqlite::{SqliteOptions, SqliteStore};

use crate::config::{Database, ServeArgs, Settings, TetherSettings, load_keyring};

#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Make a new random 32-byte key (base64, one line) for `sbp serve --encryption-key FILE`.
    Generate {
        /// Write the key to FILE (created owner-only, 0600; an existing file is never
        /// overwritten) instead of printing it.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// Re-seal every stored value under --encryption-key (values sealed under a
    /// --previous-encryption-key, and values written before encryption was on), then make the
    /// database forget the earlier keys, so `sbp serve` starts without them. Values that do not
    /// open are listed and keep the earlier keys (exit status non-zero), as does a Redis tether
    /// the database records but --tether does not give. Run it with the gateways stopped, or once
    /// every running gateway already seals under the new key. On SQLite it ends with a VACUUM and
    /// an emptied WAL, so no earlier bytes stay in the files.
    Reseal(Box<ResealArgs>),
}

/// Where the data is and the keys: the same flags, variables and TOML keys as `sbp serve`.
#[derive(Debug, Args)]
pub struct ResealArgs {
    /// TOML file with any of these options (as for `sbp serve`).
    #[arg(long, env = "SBP_CONFIG")]
    pub config: Option<PathBuf>,
    /// The data directory whose `sbp.db` to reseal. [default: ./sbp-data]
    #[arg(long, env = "SBP_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// `sqlite://PATH` or `postgres://...`, as for `sbp serve`. [default: sqlite://<data-dir>/sbp.db]
    #[arg(long, env = "SBP_DATABASE")]
    pub database: Option<String>,
    /// The Redis tether (`redis://...`), when the gateway runs with one: its streams are
    /// resealed too, before the database forgets the earlier keys.
    #[arg(long, env = "SBP_TETHER")]
    pub tether: Option<String>,
    /// Prefix of the tether's Redis keys. [default: sbp:]
    #[arg(long, env = "SBP_TETHER_PREFIX")]
    pub tether_prefix: Option<String>,
    /// The key to seal everything under (FILE, as for `sbp serve`).
    #[arg(long, env = "SBP_ENCRYPTION_KEY", value_name = "FILE")]
    pub encryption_key: Option<PathBuf>,
    /// Every earlier key something may still be sealed under (repeatable).
    #[arg(
        long = "previous-encryption-key",
        env = "SBP_PREVIOUS_ENCRYPTION_KEYS",
        value_delimiter = ',',
        value_name = "FILE"
    )]
    pub previous_encryption_key: Vec<PathBuf>,
}

pub fn generate(out: Option<PathBuf>) -> anyhow::Result<()> {
    let text = Key::generate_text().map_err(|e| anyhow::anyhow!("{e}"))?;
    let id = Key::from_text(&text)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .id();
    match out {
        None => {
            let mut stdout = std::io::stdout();
            writeln!(stdout, "{text}")?;
            stdout.flush()?;
        }
        Some(path) => {
            let mut opts = std::fs::OpenOptions::new();
            opts.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
            let mut file = opts.open(&path).with_context(|| {
                format!("creating {} (an existing file is kept)", path.display())
            })?;
            writeln!(file, "{text}")?;
            file.sync_all()?;
            eprintln!("encryption key {id} written to {}", path.display());
        }
    }
    Ok(())
}

pub async fn reseal(args: ResealArgs) -> anyhow::Result<()> {
    // The settings `sbp serve` would resolve from the same flags, variables and file.
    let s = Settings::resolve(ServeArgs {
        config: args.config,
        data_dir: args.data_dir,
        database: args.database,
        tether: args.tether,
        tether_prefix: args.tether_prefix,
        encryption_key: args.encryption_key,
        previous_encryption_key: args.previous_encryption_key,
        ..ServeArgs::default()
    })?;
    let sealer = load_keyring(s.encryption_key.as_deref(), &s.previous_encryption_keys)?;
    let Some(current) = sealer.current() else {
        bail!("sbp store reseal needs --encryption-key: the key to seal everything under");
    };
    let (done, streamed) = match &s.database {
        Database::Sqlite(path) => {
            if !path.exists() {
                bail!("no database at {}", path.display());
            }
            let opts = SqliteOptions {
                sealer: sealer.clone(),
                ..SqliteOptions::new(path)
            };
            let store = SqliteStore::open(opts)
                .await
                .with_context(|| format!("opening {}", path.display()))?;
            let streamed =
                reseal_streams(Arc::new(store.clone()), s.tether.as_ref(), &sealer).await?;
            let done = store
                .reseal_with(forget(streamed.as_ref()))
                .await
                .context("resealing")?;
            (done, streamed)
        }
        Database::Postgres(url) => {
            let opts = PostgresOptions {
                sealer: sealer.clone(),
                ..PostgresOptions::default()
            };
            let store = PostgresStore::open(url, opts)
                .await
                .with_context(|| format!("opening {}", redacted_url(url)))?;
            let streamed =
                reseal_streams(Arc::new(store.clone()), s.tether.as_ref(), &sealer).await?;
            let done = store
                .reseal_with(forget(streamed.as_ref()))
                .await
                .context("resealing")?;
            (done, streamed)
        }
    };
    report(done, streamed, current)
}

/// The database forgets the earlier keys only after the tether's streams (when given) were
/// resealed with every entry opened.
fn forget(streamed: Option<&Resealed>) -> Forget {
    match streamed {
        None => Forget::IfClean,
        Some(t) if t.is_clean() => Forget::IfCleanWithTether,
        Some(_) => Forget::Never,
    }
}

/// The tether's streams first: once the database forgets the earlier keys, nothing may be left
/// under them anywhere.
async fn reseal_streams<S: sbp_store::Store + 'static>(
    store: Arc<S>,
    tether: Option<&TetherSettings>,
    sealer: &Sealer,
) -> anyhow::Result<Option<Resealed>> {
    let Some(t) = tether else {
        return Ok(None);
    };
    let opts = RedisTetherOptions {
        prefix: t.prefix.clone(),
        mode: t.mode,
        sealer: sealer.clone(),
        ..RedisTetherOptions::default()
    };
    let label = redacted_redis_url(&t.url);
    let tethered = TetheredStore::open(store, &t.url, opts)
        .await
        .with_context(|| format!("opening the tether at {label}"))?;
    let done = tethered
        .reseal_streams()
        .await
        .with_context(|| format!("resealing the tether at {label}"))?;
    Ok(Some(done))
}

/// Prints what was rewritten and every value that did not open; fails (non-zero exit) unless the
/// earlier keys were forgotten.
fn report(
    mut done: Resealed,
    streamed: Option<Resealed>,
    current: sbp_store::seal::KeyId,
) -> anyhow::Result<()> {
    let kept = done.kept;
    if let Some(t) = streamed {
        done.merge(t);
    }
    println!("resealed {} values under key {current}", done.total());
    for (column, n) in &done.columns {
        println!("  {column}: {n}");
    }
    for u in &done.unopened {
        println!("  does not open: {} row {}: {}", u.column, u.row, u.error);
    }
    if done.unopened_total > done.unopened.len() as u64 {
        println!(
            "  ... and {} more that do not open",
            done.unopened_total - done.unopened.len() as u64
        );
    }
    match kept {
        None => {
            println!("earlier keys are no longer needed");
            Ok(())
        }
        Some(Kept::Unopened) | Some(Kept::Asked) => bail!(
            "{} values do not open: the earlier keys are kept (repair or delete those rows, then run sbp store reseal again)",
            done.unopened_total
        ),
        Some(Kept::WrittenMeanwhile) => bail!(
            "values sealed under an earlier key were written while the reseal ran (a gateway still seals under one): the earlier keys are kept; give every gateway the new --encryption-key, then run sbp store reseal again"
        ),
        Some(Kept::TetherNotResealed) => bail!(
            "a Redis tether seals under these keys: the earlier keys are kept; run sbp store reseal again with --tether (or the tether in --config)"
        ),
    }
}
