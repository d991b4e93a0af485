//! Command-line parsing and dispatch: `setup`, `run`, `status`, `skip`, `teardown`, `config`.

mod admin;
mod effective;
pub(crate) mod setup;
mod skip;
mod status;
mod teardown;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};

use crate::config::Config;

#[derive(Debug, Parser)]
#[command(name = "outbox-streamer", version, about = "Streams transactional-outbox rows to Kafka in commit order")]
pub struct Cli {
    /// The TOML configuration file.
    #[arg(long, short, env = "OUTBOX_CONFIG", default_value = "outbox-streamer.toml", global = true)]
    pub config: PathBuf,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create (idempotently) the outbox tables, publications, slots and enqueue function.
    ///
    /// Give the admin login through the environment, not the command line: arguments are
    /// visible to every user of the machine (`ps`, /proc/PID/cmdline) and land in shell
    /// history. Either `OUTBOX_SETUP_URL='postgres://owner:…@db/app' outbox-streamer setup`,
    /// or a URL without password plus `--admin-password-env VAR`.
    #[command(verbatim_doc_comment)]
    Setup {
        /// Print the SQL instead of running it.
        #[arg(long)]
        dry_run: bool,
        /// Run the DDL as this login (an owner or superuser) instead of the source's `url`;
        /// the source's login is then granted what the streamer needs. Prefer the
        /// OUTBOX_SETUP_URL variable: a password here is visible in the process list.
        #[arg(long, env = "OUTBOX_SETUP_URL", hide_env_values = true)]
        admin_url: Option<String>,
        /// Read the admin login's password from this environment variable, so that
        /// --admin-url (or OUTBOX_SETUP_URL) needs none.
        #[arg(long, value_name = "VAR")]
        admin_password_env: Option<String>,
        /// Grant this application role (PostgreSQL) or account (MariaDB: `name`, a role or
        /// 'name'@'%', or `name@host`) what enqueuing needs: INSERT on every outbox table and
        /// EXECUTE on `<prefix>_enqueue`. Repeatable. Roles granted by an earlier setup get the
        /// same on tables added later (more shards or partitions).
        #[arg(long = "app-role", value_name = "NAME")]
        app_roles: Vec<String>,
        /// PostgreSQL with `storage = "wal"`: revoke EXECUTE on pg_logical_emit_message from
        /// PUBLIC in the source's database and grant it to the streamer and the application
        /// roles only, so no other login can forge a WAL-only message (needs a superuser).
        #[arg(long)]
        restrict_emit: bool,
        /// A source whose `layout` is another outbox's (`tw-tkms`): create its tables that do
        /// not exist yet, as that outbox documents them. Without it, setup only checks them
        /// and says what is missing; it never alters or drops them.
        #[arg(long)]
        create_tables: bool,
        /// PostgreSQL, when a replication slot is to be created: how long to wait for the
        /// prepared (two-phase) transactions found on the server to be decided before naming
        /// them and creating nothing (a new slot waits until every one has ended).
        #[arg(long, value_name = "SECONDS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(0..=3600))]
        prepared_wait: u64,
    },
    /// Stream every shard-partition until SIGTERM or SIGINT.
    Run,
    /// Show every shard-partition: what its streamer does, slot, position, lag and rows pending.
    ///
    /// The streamer's state (streaming, caught-up, catching-up, retrying, halted, starting,
    /// not running, unknown) is asked of the running instances: under [coordination] of each
    /// lease holder, at the metrics address it publishes in ZooKeeper; otherwise of the
    /// instance at [metrics] listen of this config (or --metrics-address). The rest is read
    /// from the databases.
    ///
    /// Exit codes:
    ///   0  healthy
    ///   1  a shard-partition is not running while rows wait, lags beyond --max-lag-bytes or
    ///      --max-pending-rows, or has a missing or lost slot, no checkpoint, an unreadable
    ///      table or a catch-up pending
    ///   2  a shard-partition is halted: an operator must act (the reason says how)
    ///   3  status failed: configuration, a database or ZooKeeper (the error says which)
    #[command(verbatim_doc_comment)]
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Exit 1 when a shard-partition's lag (WAL or binlog bytes behind) exceeds this.
        #[arg(long)]
        max_lag_bytes: Option<i64>,
        /// Exit 1 when a shard-partition has more rows waiting than this.
        #[arg(long)]
        max_pending_rows: Option<i64>,
        /// Without [coordination]: ask the streamer at this host:port (its [metrics] listen)
        /// instead of the address in this config, e.g. from another host.
        #[arg(long, value_name = "HOST:PORT")]
        metrics_address: Option<String>,
    },
    /// Moved out of this binary: the bench is `outbox-bench` (docs/benchmarks.md). Kept hidden
    /// only to say so: it runs nothing and links none of the bench.
    #[command(hide = true, disable_help_flag = true)]
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Tell a stopped or halted shard-partition not to publish a row, a transaction's
    /// unidentifiable rows, or its whole backlog (refused while the stream runs).
    Skip {
        /// The shard-partition: <source>/<shard>/<partition>, as the halt message names it.
        #[arg(long)]
        stream: String,
        /// The row id to skip (it is also deleted from the table): a number, or the key (uuid)
        /// of a table identified by one, as the halt message names it.
        #[arg(long, conflicts_with_all = ["transaction", "backlog", "message"])]
        id: Option<String>,
        /// A WAL-only message (`storage = "wal"`) to skip, by the LSN its halt message names.
        #[arg(long, conflicts_with_all = ["transaction", "backlog"])]
        message: Option<String>,
        /// The transaction (its outbox-lsn or outbox-gtid) whose rows without a readable id
        /// are to be skipped.
        #[arg(long, conflicts_with = "backlog")]
        transaction: Option<String>,
        /// Discard everything committed so far: delete the table's rows and move the stored
        /// position to the end of the log.
        #[arg(long)]
        backlog: bool,
    },
    /// Remove what `setup` created — tables (only empty ones unless --drop-pending),
    /// publications, this database's slots, checkpoint rows and table, the enqueue function —
    /// and the cluster's ZooKeeper nodes. Says what it would do; --yes does it.
    Teardown(teardown::TeardownArgs),
    /// Check the configuration file; --effective prints every shard-partition's settings as they
    /// apply (defaults, then overrides), secrets masked.
    Config {
        /// Print every setting, per shard-partition, with what set it.
        #[arg(long)]
        effective: bool,
        /// JSON instead of TOML.
        #[arg(long, requires = "effective")]
        json: bool,
    },
}

/// pgwire-replication logs every failed replication session at ERROR itself (a busy slot:
/// several lines a second); the runner reports the same error once, classified, at the level
/// it deserves. `RUST_LOG` naming `pgwire_replication` turns it back on.
const QUIET_REPLICATION_WORKER: &str = "pgwire_replication::client::tokio_client=off";

/// The ZooKeeper client logs each session it opens and closes at INFO: noise on the output of
/// a one-shot command such as `status`, which reports a failure to connect itself. `run` keeps
/// them; `RUST_LOG` naming `zookeeper_client` turns them back on.
const QUIET_ZOOKEEPER_SESSIONS: &str = "zookeeper_client=off";

/// The RabbitMQ client logs connection and channel events the streamer reports itself, and
/// logs a returned message whole — row data, which is never logged. `RUST_LOG` naming `lapin`
/// turns the first back on; returned messages stay off.
const QUIET_RABBITMQ_CLIENT: &str = "lapin=off";
const NO_RETURNED_MESSAGES: &str = "lapin::returned_messages=off";
/// tokio-postgres logs every statement's parameters at debug level — the message API's
/// payloads, keys and headers among them, which are never logged. Off, whatever `RUST_LOG` says.
const NO_QUERY_PARAMETERS: &str = "tokio_postgres::query=off";

/// Installs the tracing subscriber (`RUST_LOG` filters, default `info`) for `command`.
pub fn init_logging(format: LogFormat, command: &Command) {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,rdkafka=warn"));
    let rust_log = std::env::var("RUST_LOG").unwrap_or_default();
    if !rust_log.contains("pgwire_replication") {
        filter = filter.add_directive(QUIET_REPLICATION_WORKER.parse().expect("a valid directive"));
    }
    if !rust_log.contains("lapin") {
        filter = filter.add_directive(QUIET_RABBITMQ_CLIENT.parse().expect("a valid directive"));
    }
    filter = filter.add_directive(NO_RETURNED_MESSAGES.parse().expect("a valid directive"));
    filter = filter.add_directive(NO_QUERY_PARAMETERS.parse().expect("a valid directive"));
    if !matches!(command, Command::Run) && !rust_log.contains("zookeeper_client") {
        filter = filter.add_directive(QUIET_ZOOKEEPER_SESSIONS.parse().expect("a valid directive"));
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

pub async fn execute(cli: Cli) -> anyhow::Result<ExitCode> {
    let load = || Config::load(&cli.config).with_context(|| "loading the configuration (see docs/configuration.md)");
    match cli.command {
        Command::Setup {
            dry_run,
            admin_url,
            admin_password_env,
            app_roles,
            restrict_emit,
            create_tables,
            prepared_wait,
        } => {
            let password =
                match &admin_password_env {
                    Some(var) => Some(std::env::var(var).map_err(|_| {
                        anyhow::anyhow!("--admin-password-env: the environment variable {var} is not set")
                    })?),
                    None => None,
                };
            let admin = match (&admin_url, &password) {
                (Some(url), password) => Some(crate::db::AdminLogin { url, password: password.as_deref() }),
                (None, Some(_)) => {
                    anyhow::bail!("--admin-password-env needs the admin login's URL: --admin-url or OUTBOX_SETUP_URL")
                }
                (None, None) => None,
            };
            let how = crate::db::SetupRequest {
                dry_run,
                admin,
                app_roles: &app_roles,
                restrict_emit,
                create_tables,
                prepared_wait: std::time::Duration::from_secs(prepared_wait),
                api: None,
            };
            setup::setup(&load()?, &how).await
        }
        Command::Run => {
            crate::run::run(load()?).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { json, max_lag_bytes, max_pending_rows, metrics_address } => {
            let limits = status::Limits { max_lag_bytes, max_pending_rows };
            let checked = match load() {
                Ok(config) => status::status(&config, json, limits, metrics_address).await,
                Err(e) => Err(e),
            };
            // A probe tells "could not look" from "looked and found trouble".
            Ok(checked.unwrap_or_else(|e| {
                eprintln!("error: {e:#}");
                ExitCode::from(status::exit::UNKNOWN)
            }))
        }
        Command::Skip { stream, id, message, transaction, backlog } => {
            let what = match (id, message, transaction, backlog) {
                (Some(id), None, None, false) => skip::What::row(&id)?,
                (None, Some(at), None, false) => skip::What::message(&at)?,
                (None, None, Some(label), false) => skip::What::Transaction(label),
                (None, None, None, true) => skip::What::Backlog,
                _ => anyhow::bail!("skip: give exactly one of --id, --message, --transaction or --backlog"),
            };
            skip::skip(&load()?, &stream, what).await
        }
        Command::Teardown(args) => teardown::teardown(&load()?, args).await,
        Command::Config { effective: false, .. } => {
            effective::check(&load()?, &cli.config);
            Ok(ExitCode::SUCCESS)
        }
        Command::Config { effective: true, json } => {
            effective::effective(&load()?, &cli.config, json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench { args } => anyhow::bail!("{}", bench_moved(&args)),
    }
}

/// What `outbox-streamer bench …` says since the bench became its own binary.
fn bench_moved(args: &[String]) -> String {
    let args: String = args.iter().map(|a| format!(" {a}")).collect();
    format!(
        "bench is no longer part of outbox-streamer: run `outbox-bench{args}` (in a checkout: `cargo build --bin outbox-streamer && cargo run -p outbox-bench --{args}`); see docs/benchmarks.md"
    )
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    /// `outbox-streamer bench …` takes any flags and names the command that replaced it.
    #[test]
    fn bench_says_where_it_moved() {
        let cli = Cli::try_parse_from(["outbox-streamer", "bench", "--quick", "--db", "mariadb"]).expect("parses");
        let Command::Bench { args } = cli.command else { panic!("parsed as {:?}", cli.command) };
        let message = bench_moved(&args);
        assert!(message.contains("run `outbox-bench --quick --db mariadb`"), "{message}");
        assert!(message.contains("cargo run -p outbox-bench -- --quick --db mariadb"), "{message}");
    }
}
